"""redis-py without its asyncio client (decision 267): each case runs in a fresh interpreter, as redis is
imported once per process."""

import subprocess
import sys

import pytest

ASYNC_CLIENT = ("redis.asyncio.client", "redis.asyncio.connection", "redis.asyncio.cluster", "redis.asyncio.sentinel")


def _python(code: str, **env: str) -> str:
    import os

    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                           env={"PATH": os.environ["PATH"], **env})
    assert shown.returncode == 0, shown.stderr[-800:]
    return shown.stdout


def test_the_synchronous_client_talks_to_redis_without_the_asyncio_client(redis_url):
    out = _python(
        "import sys\n"
        "from billingctl.adapters.syncredis import redis_module\n"
        "redis = redis_module()\n"
        "client = redis.Redis.from_url(sys.argv[1] if len(sys.argv) > 1 else __import__('os').environ['URL'])\n"
        "client.set('billing:probe', 'x'); print(client.get('billing:probe').decode())\n"
        f"print(sorted(m for m in {ASYNC_CLIENT!r} if m in sys.modules))\n"
        "print('redis.asyncio' in sys.modules)\n",
        URL=redis_url)
    assert out.split("\n")[:3] == ["x", "[]", "True"]  # the package exists; its client was never loaded


def test_the_shared_rate_limiter_on_redis_loads_no_asyncio_client(redis_url):
    """`limits` imports redis itself: the limiter makes sure it finds it imported so."""
    out = _python(
        "import os, sys\n"
        "from billingctl.adapters.ratelimit import RateLimiter\n"
        "limiter = RateLimiter(5, 60, 'billing:probe-limit', redis_url=os.environ['URL'], max_wait=0)\n"
        "print(limiter._limiter.hit(limiter.item, limiter.key))\n"
        "print(type(limiter._limiter.storage).__module__)\n"
        f"print(sorted(m for m in {ASYNC_CLIENT!r} if m in sys.modules))\n",
        URL=redis_url)
    assert out.split("\n")[:3] == ["True", "limits.storage.redis", "[]"]


@pytest.mark.parametrize("how", ["attribute", "from_import", "submodule"])
def test_the_asyncio_client_still_loads_when_asked_for(how):
    """A read of any name from `redis.asyncio` runs its body then; nothing a caller sees differs."""
    ask = {"attribute": "import redis.asyncio\nclient = redis.asyncio.Redis\n",
           "from_import": "from redis.asyncio import Redis as client\n",
           "submodule": "from redis.asyncio.client import Redis as client\nimport redis.asyncio\n"
                        "assert redis.asyncio.Redis is client\n"}[how]
    out = _python(
        "import sys\n"
        "from billingctl.adapters.syncredis import redis_module\n"
        "redis_module()\n"
        f"{ask}"
        "print(client.__module__, client.__name__)\n"
        "import redis.asyncio as package\n"
        "print(sorted(name for name in ('Redis', 'RedisCluster', 'Sentinel', 'from_url') if hasattr(package, name)))\n"
        "print(package.__spec__.loader.__class__.__name__)\n")
    assert out.split("\n")[:3] == ["redis.asyncio.client Redis", "['Redis', 'RedisCluster', 'Sentinel', 'from_url']",
                                   "SourceFileLoader"]


def test_redis_imported_before_is_left_as_it_was():
    out = _python(
        "import sys, redis\n"
        "from billingctl.adapters.syncredis import redis_module\n"
        "print(redis_module() is redis, 'redis.asyncio.client' in sys.modules)\n"
        "print(any(type(f).__name__ == '_Finder' for f in sys.meta_path))\n")
    assert out.split("\n")[:2] == ["True True", "False"]


def test_a_missing_name_is_still_an_attribute_error():
    out = _python(
        "from billingctl.adapters.syncredis import redis_module\n"
        "redis = redis_module()\n"
        "try:\n"
        "    redis.asyncio.NoSuchThing\n"
        "except AttributeError as error:\n"
        "    print('AttributeError', 'NoSuchThing' in str(error))\n"
        "print(hasattr(redis.asyncio, 'Redis'))\n")
    assert out.split("\n")[:2] == ["AttributeError True", "True"]
