"""Where a web request's provider follow-ups run once its answer is sent (issue 39 items 3 and 4).

Inline (the default; Flask's test client, the in-process sandbox's WSGI transport): when the server
closes the response, in the thread that served it, so `sandbox pay` returns with the subscription active.

On a thread of its own (the gunicorn entry point, `webhooks_app.wsgi:public()`): a sync worker that made
them itself served nothing else meanwhile, so the requests queued behind it waited out the provider and
a new payment's p99 rose whenever the budget's window freed. One thread a worker process makes them in
turn from a bounded queue; when the queue is full the work is left where it already is, in the database,
for the activations job (the same idempotency keys). A worker that exits (a graceful restart, the
interpreter shutting down) lets the follow-up in flight finish, within CLOSE_GRACE_SECONDS, and leaves
the queued ones to the job: none is cut between the provider's answer and our record of it when the
grace suffices, and none makes the exit wait for the budget.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("webhooks_app.followups")

QUEUE_CAPACITY = 256  # requests' follow-ups waiting for the thread; past it, the activations job has them
CLOSE_GRACE_SECONDS = 10.0  # within gunicorn's graceful timeout (30 s in the unit)


def run_inline(work: Callable[[], None]) -> bool:
    work()
    return True


class FollowupThread:
    """One daemon thread per process, started on first use (after gunicorn forks its workers, and again
    in a child that inherits this object from its parent)."""

    def __init__(self, capacity: int = QUEUE_CAPACITY):
        self.capacity = capacity
        self._guard = threading.Lock()
        self._pid: int | None = None
        self._queue: queue.Queue = queue.Queue(capacity)
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None

    def __call__(self, work: Callable[[], None]) -> bool:
        """Queue `work`; False when the queue is full (the work stays in the database for the job)."""
        if self._closing.is_set():
            return False
        self._ensure_started()
        try:
            self._queue.put_nowait(work)
        except queue.Full:
            log.info("follow-up left to the activations job: the web worker's follow-up queue is full",
                     extra={"capacity": self.capacity})
            return False
        return True

    def join(self) -> None:
        """Until every queued follow-up has run (tests, and a caller that must see them done)."""
        self._queue.join()

    def close(self, timeout: float = CLOSE_GRACE_SECONDS) -> int:
        """Take no more work, let the follow-up in flight finish (within `timeout`) and leave the queued
        ones to the activations job; how many were left. Registered to run when the process exits."""
        self._closing.set()
        left = 0
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
            left += 1
            self._queue.task_done()
        if self._thread is not None and self._pid == os.getpid():
            self._queue.put(None)  # wakes a thread waiting for work: it stops
            self._thread.join(timeout)
        if left:
            log.info("follow-ups left to the activations job: the web worker is exiting", extra={"left": left})
        return left

    def _ensure_started(self) -> None:
        if self._pid == os.getpid():
            return
        with self._guard:
            if self._pid != os.getpid():
                self._queue = queue.Queue(self.capacity)  # a forked child's copy holds no live thread
                self._thread = threading.Thread(target=self._loop, name="billing-followups", daemon=True)
                self._thread.start()
                self._pid = os.getpid()
                atexit.register(self.close)

    def _loop(self) -> None:
        work_queue = self._queue
        while True:
            work = work_queue.get()
            if work is None:  # closing
                work_queue.task_done()
                return
            try:
                if not self._closing.is_set():
                    work()
            except Exception:  # noqa: BLE001 - the work logs its own failures; the thread must outlive any
                log.exception("follow-up failed; the activations job retries it")
            finally:
                work_queue.task_done()
