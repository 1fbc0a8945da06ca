"""`billingctl` as a user runs it, without paying the libraries' imports on every run (decision 167).

A fresh `python -m billingctl` spends about 0.8 s of CPU importing the design card's libraries before our
code runs, and the suite runs the CLI over a thousand times. A zygote per test worker imports those libraries
once (the third-party ones only: none of ours, nothing that reads a variable the run sets); each run is a
process forked from it with the run's own arguments, environment, working directory, standard streams and
exit status. It runs `billingctl` as `python -m` does (`runpy`), then what the interpreter does on its way
out (non-daemon threads joined, exit handlers run, streams flushed), so metrics archived at exit, exit codes
and what an operator reads on stdout and stderr are the CLI's own.

What still needs a cold interpreter uses one: the start-up and import tests, the runbooks' commands through
bash, the terminal tests and the month in separate processes start `python -m billingctl` themselves, and
`BILLING_TEST_CLI=fresh` sends every run of `tests.helpers.billingctl` to a fresh interpreter too.

The protocol, over a Unix SEQPACKET socket (one message each): the client sends the run as JSON with its
stdin, stdout and stderr descriptors; the zygote forks and answers the child's pid, then its exit code
(negative: the signal that ended it, as `subprocess` reports it) once the child's pidfd is readable."""

from __future__ import annotations

import importlib
import json
import os
import selectors
import socket
import sys

# The libraries whose imports are most of a run's start-up. None reads a variable at import that a run sets
# (`SETS_AT_IMPORT` lists those the preloaded modules read; a run that sets one gets a fresh interpreter).
PRELOAD = ("sqlalchemy", "sqlalchemy.orm", "sqlalchemy.dialects.postgresql.psycopg", "sqlalchemy.dialects.sqlite",
           "psycopg", "pydantic", "pydantic_settings", "httpx", "httpcore", "redis", "typer", "limits",
           "tenacity")
SETS_AT_IMPORT = ("TYPER_USE_RICH", "PSYCOPG_WAIT_FUNC", "PSYCOPG_IMPL", "WRAPT_DISABLE_EXTENSIONS")


def command(argv) -> list[str]:
    """`python -m billingctl ARGS`, as a user runs it (and as a fresh interpreter is started)."""
    return [sys.executable, "-m", "billingctl", *argv]


def needs_fresh_interpreter(env: dict) -> bool:
    """Whether a run with `env` must start cold: BILLING_TEST_CLI=fresh in the suite's environment, or a
    variable that the interpreter or a preloaded library reads at start-up."""
    return os.environ.get("BILLING_TEST_CLI") == "fresh" \
        or any(name.startswith("PYTHON") or name in SETS_AT_IMPORT for name in env)


def _exit_code(code) -> int:
    """What the interpreter makes of `SystemExit(code)`."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _run(request: dict) -> int:
    """In the forked child: the run, as `python -m billingctl ARGS` in a fresh interpreter would do it."""
    import atexit
    import runpy
    import threading

    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.path[0] = request["cwd"]  # `python -m` puts the working directory first
    sys.argv = ["-m", *request["argv"]]  # runpy replaces the first with the module's path, as `-m` does
    try:
        runpy.run_module("billingctl", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # noqa: SLF001 - the interpreter's own exit sequence
    atexit._run_exitfuncs()  # noqa: SLF001
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code


def _fork(selector: selectors.BaseSelector, conn: socket.socket, request: dict, fds: list[int]) -> int:
    """Fork the run; in the child, close what belongs to the zygote (its socket, the other runs'
    connections and pidfds) and take the run's streams as descriptors 0, 1 and 2."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        for key in list(selector.get_map().values()):
            os.close(key.fd)
            if isinstance(key.data, tuple):
                key.data[1].close()
        selector.close()
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        code = _run(request)
    finally:
        os._exit(code & 0xFF)


def serve(path: str, alive: int) -> None:
    """Import PRELOAD, then fork a run for each request until the test worker's end of `alive` closes."""
    import gc

    os.close(os.pidfd_open(os.getpid()))  # Linux 5.3 or later: without it, fail here, where the worker sees it
    for name in PRELOAD:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()  # what the imports made is never collected in a run, nor copied by its collections
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    # The worker waits for the path to appear: bound under another name and renamed once it listens, so a
    # connect never lands between bind and listen (ECONNREFUSED; a CI run's first CLI call on one worker,
    # 2026-11-27).
    listener.bind(f"{path}.binding")
    listener.listen(64)
    os.rename(f"{path}.binding", path)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "request")
    selector.register(alive, selectors.EVENT_READ, "alive")
    while True:
        for key, _ in selector.select():
            if key.data == "alive":
                return
            if key.data == "request":
                conn, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                pid = _fork(selector, conn, json.loads(message), fds)
                for fd in fds:
                    os.close(fd)
                try:
                    conn.send(str(pid).encode())
                except OSError:  # the client is gone: the run goes on, nobody waits for its status
                    pass
                selector.register(os.pidfd_open(pid), selectors.EVENT_READ, (pid, conn))
            else:
                pid, conn = key.data
                selector.unregister(key.fileobj)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                try:
                    conn.send(str(os.waitstatus_to_exitcode(status)).encode())
                except OSError:  # the client gave up (its timeout) and closed
                    pass
                conn.close()


class Run:
    """A run started through the zygote: as much of `subprocess.Popen` as the tests use (pid, poll, wait,
    send_signal, kill, communicate, returncode)."""

    def __init__(self, zygote: Zygote, conn: socket.socket, command: list[str], out, err):
        self._zygote, self._conn, self.args, self._out, self._err = zygote, conn, command, out, err
        conn.settimeout(60)
        self.pid = int(self._answer())
        self.returncode: int | None = None

    def _answer(self) -> bytes:
        answer = self._conn.recv(64)
        if not answer:
            raise RuntimeError(f"the CLI zygote dropped the run: {self._zygote.log_tail()}")
        return answer

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                self.returncode = int(self._answer())
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        import subprocess

        try:
            return self.wait(0.001)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Wait, then what the run wrote on stdout and stderr, decoded as `text=True` does."""
        import io

        self.wait(timeout)
        streams = []
        for written in (self._out, self._err):
            written.seek(0)
            streams.append(io.TextIOWrapper(written, newline=None).read())  # closes the file
        return streams[0], streams[1]


class Zygote:
    """The test worker's side: start the zygote, and run `billingctl ARGS` through it."""

    def __init__(self, root: str):
        import subprocess
        import tempfile
        import time

        self.dir = tempfile.mkdtemp(prefix="billingctl-zygote-")
        self.path = os.path.join(self.dir, "socket")
        alive, self._alive = os.pipe()
        log = open(os.path.join(self.dir, "log"), "wb")  # noqa: SIM115 - the zygote writes it for its life
        self.process = subprocess.Popen([sys.executable, "-m", "tests.cli_zygote", self.path, str(alive)],
                                        pass_fds=(alive,), env={"PATH": os.environ["PATH"]}, cwd=root,
                                        stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        os.close(alive)
        log.close()
        deadline = time.monotonic() + 120
        while not os.path.exists(self.path):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the CLI zygote did not start: {self.log_tail()}")
            time.sleep(0.02)

    def log_tail(self) -> str:
        with open(os.path.join(self.dir, "log"), errors="replace") as written:
            return written.read()[-2000:]

    def start(self, argv: list[str], env: dict, cwd: str | None = None) -> Run:
        """`billingctl ARGS` started in a process forked from the zygote; its stdout and stderr kept."""
        import tempfile

        request = {"argv": list(argv), "env": env, "cwd": cwd or os.getcwd()}
        out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()  # noqa: SIM115 - the Run reads them
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with open(os.devnull, "rb") as stdin:
            conn.connect(self.path)
            socket.send_fds(conn, [json.dumps(request).encode()], [stdin.fileno(), out.fileno(), err.fileno()])
        return Run(self, conn, command(argv), out, err)

    def run(self, argv: list[str], env: dict, timeout: float):
        """As `subprocess.run(..., capture_output=True, text=True, timeout=timeout)`."""
        import subprocess

        started = self.start(argv, env)
        try:
            stdout, stderr = started.communicate(timeout)
        except subprocess.TimeoutExpired:
            started.kill()
            raise
        return subprocess.CompletedProcess(started.args, started.returncode, stdout, stderr)


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
