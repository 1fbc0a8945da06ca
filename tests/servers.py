"""Throwaway PostgreSQL and Redis servers on free loopback ports, for the test session."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PG_BIN_DIRS = ["/usr/lib/postgresql/17/bin", "/usr/lib/postgresql/16/bin", "/usr/lib/postgresql/15/bin"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serving(url: str, attempts: int = 200, pause: float = 0.1) -> bool:
    """Whether an HTTP server answers `url` (any status) within `attempts` tries; a started gunicorn,
    nginx or Prometheus is waited for with it."""
    import httpx

    for _ in range(attempts):
        try:
            httpx.get(url, timeout=0.5)
            return True
        except httpx.TransportError:
            time.sleep(pause)
    return False


def stop_process(process: subprocess.Popen | None, grace: float = 10) -> None:
    """SIGTERM, then SIGKILL when it has not exited within `grace` seconds."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


def wait_for_port(port: int, what: str, process: subprocess.Popen | None = None, log: Path | None = None,
                  seconds: float = 20) -> None:
    """Until something accepts connections on the loopback `port`; RuntimeError when `process` exits first
    (with the end of its `log`) or nothing listens within `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{what} exited: {log.read_text()[-500:] if log and log.exists() else ''}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not start")


def _pg_bin(name: str) -> str:
    for d in PG_BIN_DIRS:
        if os.path.exists(os.path.join(d, name)):
            return os.path.join(d, name)
    found = shutil.which(name)
    if not found:
        raise RuntimeError(f"{name} not found: install Debian's postgresql (make test does)")
    return found


class PostgresServer:
    def __init__(self, durable: bool = False):
        """A throwaway server; fast and unsafe (fsync off) unless `durable` (a benchmark's fsync=on run)."""
        self.durable = durable
        self.root = Path(tempfile.mkdtemp(prefix="billing-pg-"))
        self.port = free_port()
        self.data = self.root / "data"
        self.as_root = os.geteuid() == 0

    def _run(self, args: list[str]) -> None:
        if self.as_root:
            args = ["runuser", "-u", "postgres", "--", *args]
        subprocess.run(args, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def start(self) -> str:
        os.chmod(self.root, 0o755)  # noqa: S103 - postgres must traverse it
        if self.as_root:
            shutil.chown(self.root, "postgres", "postgres")
        self._run([_pg_bin("initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8"])
        self.launch()
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def launch(self) -> None:
        """Start the server on its existing data directory."""
        unsafe = "" if self.durable else "-c fsync=off -c synchronous_commit=off -c full_page_writes=off "
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 {unsafe}-c max_connections=200"
        self._run([_pg_bin("pg_ctl"), "-D", str(self.data), "-o", options, "-l",
                   str(self.root / "log"), "-w", "-t", "60", "start"])

    def halt(self) -> None:
        """Stop the server, keeping its data (an outage)."""
        self._run([_pg_bin("pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop"])

    def stop(self) -> None:
        try:
            self._run([_pg_bin("pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop"])
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


class RedisServer:
    def __init__(self):
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> str:
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        if not os.path.exists(binary):
            raise RuntimeError("redis-server not found: install Debian's redis-server (make test does)")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for_port(self.port, "redis-server")
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.proc:
            self.proc.terminate()
            self.proc.wait(10)

    def restart(self) -> str:
        """Start again on the same port (after stop(): an outage that ends)."""
        return self.start()


NGINX_CONF = Path(__file__).resolve().parents[1] / "deploy" / "nginx" / "billing-public.conf"


class NginxFront:
    """Debian's nginx with the repository's public front (`deploy/nginx/billing-public.conf`) as it is
    shipped, only its listen port and upstream address moved to free loopback ports."""

    def __init__(self, root: Path, upstream_port: int):
        self.root, self.port, self.proc = root, free_port(), None
        site = NGINX_CONF.read_text()
        moved = site.replace("listen 80;", f"listen 127.0.0.1:{self.port};").replace(
            "server 127.0.0.1:8000;", f"server 127.0.0.1:{upstream_port};")
        if moved.count(str(self.port)) != 1 or moved.count(f":{upstream_port};") != 1:
            raise RuntimeError("deploy/nginx/billing-public.conf no longer has the listen and upstream lines")
        root.mkdir(parents=True, exist_ok=True)
        (root / "billing-public.conf").write_text(moved)
        user = "user root;\n" if os.geteuid() == 0 else ""  # the workers read the test's files
        temp = "\n".join(f"    {kind}_temp_path {root / kind};" for kind in ("client_body", "proxy", "fastcgi",
                                                                           "uwsgi", "scgi"))
        (root / "nginx.conf").write_text(
            f"{user}daemon off;\nworker_processes 1;\npid {root / 'nginx.pid'};\nerror_log {root / 'error.log'} warn;\n"
            "events { worker_connections 2048; }\n"
            f"http {{\n    access_log off;\n{temp}\n    include {root / 'billing-public.conf'};\n}}\n")

    def start(self) -> str:
        binary = shutil.which("nginx") or "/usr/sbin/nginx"
        if not os.path.exists(binary):
            raise RuntimeError("nginx not found: install Debian's nginx (make test does)")
        self.proc = subprocess.Popen([binary, "-p", str(self.root), "-c", str(self.root / "nginx.conf"),
                                      "-e", str(self.root / "error.log")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.port, "nginx", self.proc, self.root / "error.log")
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        stop_process(self.proc)
