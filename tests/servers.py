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
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return f"redis://127.0.0.1:{self.port}/0"
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc:
            self.proc.terminate()
            self.proc.wait(10)

    def restart(self) -> str:
        """Start again on the same port (after stop(): an outage that ends)."""
        return self.start()
