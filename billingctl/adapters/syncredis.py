"""redis-py's synchronous client without its asyncio client (issue 39 item 5, decision 267).

`import redis` runs `from redis import asyncio` (every release since 4.2): the asyncio client, cluster,
connection pool, sentinel and keyspace notifications, none of which a synchronous process uses, loaded by
every process that reaches Redis (about 27 million instructions of a one-shot `jobs run poll`).
`redis_module()` imports redis with the package `redis.asyncio` created but its body
(`redis/asyncio/__init__.py`) run only when something first reads a name from it. Its submodules still
import as usual (redis's synchronous commands import `redis.asyncio.observability.recorder`), and
`redis.asyncio.Redis` still works, loaded at that read (a submodule read as a name is imported alone, as
the body would have bound it). Where the package cannot be found the usual way,
or redis was imported before, nothing is deferred."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
from types import ModuleType

DEFERRED = "redis.asyncio"


class _DeferredBody(importlib.abc.Loader):
    """Creates the package as its own loader would, and runs its body at the first name read from it."""

    def __init__(self, loader: importlib.abc.Loader):
        self._loader = loader
        self._lock = threading.RLock()

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        def __getattr__(name: str):
            if not name.startswith("__"):
                # A submodule read as a name (`from redis.asyncio import _himport_exec`, in the body of
                # `redis.asyncio.client` imported directly) is imported alone, as it would have been bound.
                full = f"{module.__name__}.{name}"
                try:
                    return importlib.import_module(full)
                except ModuleNotFoundError as error:
                    if error.name != full:
                        raise
            self._run(module)
            return getattr(module, name)

        module.__getattr__ = __getattr__

    def _run(self, module: ModuleType) -> None:
        with self._lock:
            if module.__dict__.pop("__getattr__", None) is None:
                return  # already run (by another thread, or a read during the body itself)
            module.__spec__.loader = module.__loader__ = self._loader
            self._loader.exec_module(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != DEFERRED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.submodule_search_locations is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _DeferredBody(spec.loader)
        return spec


_import_lock = threading.Lock()


def redis_module() -> ModuleType:
    """`redis`, imported once per process with its asyncio package's body deferred."""
    with _import_lock:
        if "redis" not in sys.modules:
            finder = _Finder()
            sys.meta_path.insert(0, finder)
            try:
                import redis  # noqa: F401
            finally:
                sys.meta_path.remove(finder)
    return sys.modules["redis"]
