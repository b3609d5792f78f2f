"""Background work in one shape: a named daemon thread that runs a periodic
step or a long-running loop, counts and logs what escapes it, restarts a loop
that died, and says whether it ended in time when stopped.

A step or loop that raises costs one warning line naming the worker and what
it does (the traceback at debug level) and one count in `errors`; the worker
goes on: a step at its next period, a loop after `restart_s`. A loop that
returns while nobody asked it to stop leaves the worker dead, which
`should_run` and `/livez` report. Every started worker is listed by
`started()` for as long as it is referenced.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Worker", "WorkerHandle", "WorkerState", "not_running", "started"]

log = logging.getLogger("slatrace.workers")

# How long a loop that died by an exception waits before it runs again.
RESTART_S = 1.0

_started: weakref.WeakSet[Worker] = weakref.WeakSet()
_started_lock = threading.Lock()


@dataclass(frozen=True)
class WorkerState:
    name: str
    what: str
    alive: bool            # its thread runs (restarting after a failure counts)
    should_run: bool       # started and not asked to stop
    errors: int            # exceptions that escaped a step or the loop, or were reported
    last_error: str | None
    last_success: float | None  # Unix seconds of the last step that ended well (or loop's report)

    @property
    def dead(self) -> bool:
        return self.should_run and not self.alive


class WorkerHandle:
    """What a loop holds: whether to stop, a wait that stop cuts short, and
    where to report a failure it handles itself or a piece of work done."""

    def __init__(self, worker: Worker) -> None:
        self._worker = worker

    @property
    def stopping(self) -> bool:
        return self._worker._stop.is_set()

    def wait(self, seconds: float | None) -> bool:
        """Sleep up to `seconds` (None: until stopped); True when stopping."""
        return self._worker._stop.wait(seconds)

    def wait_nudge(self, seconds: float | None) -> bool:
        """Sleep until `Worker.nudge()`, stop or `seconds`; True when nudged
        (and not stopping). A nudge while not waiting is kept for the next wait."""
        w = self._worker
        w._nudge.wait(seconds)
        if w._stop.is_set() or not w._nudge.is_set():
            return False
        w._nudge.clear()
        return True

    def failed(self, error: BaseException, again_in: float | None = None) -> None:
        """A failure the loop handles itself (and retries after `again_in`):
        logged and counted as an escaped one would be."""
        self._worker._failed(error, again_in)

    def succeeded(self) -> None:
        self._worker._succeeded()


class Worker:
    """A named daemon thread. Build one with `periodic` (a step every
    `every_s`) or `loop` (a function that runs until its handle says stop)."""

    def __init__(self, name: str, what: str, body: Callable[[WorkerHandle], None], *,
                 on_stop: Callable[[], None] | None = None,
                 on_error: Callable[[BaseException], None] | None = None,
                 restart_s: float = RESTART_S, clock: Callable[[], float] = time.time) -> None:
        self.name = name
        self.what = what
        self._body = body
        self._on_stop = on_stop
        self._on_error = on_error
        self.restart_s = restart_s
        self._clock = clock
        self._stop = threading.Event()
        self._nudge = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._handle = WorkerHandle(self)
        self.every_s: float | None = None  # a periodic worker's period
        self.errors = 0
        self.last_error: str | None = None
        self.last_success: float | None = None

    @classmethod
    def periodic(cls, name: str, what: str, step: Callable[[], object], every_s: float, *,
                 first_now: bool = True, **kwargs) -> Worker:
        """`step()` now (or after one period), then `every_s` after each end."""
        worker: Worker

        def run(handle: WorkerHandle) -> None:
            if not first_now and handle.wait(worker.every_s):
                return
            while True:
                try:
                    step()
                except Exception as e:  # noqa: BLE001  (counted and logged; the next period runs)
                    worker._failed(e, worker.every_s)
                else:
                    worker._succeeded()
                if handle.wait(worker.every_s):
                    return

        worker = cls(name, what, run, **kwargs)
        worker.every_s = every_s
        return worker

    @classmethod
    def loop(cls, name: str, what: str, body: Callable[[WorkerHandle], None], **kwargs) -> Worker:
        """`body(handle)` runs until `handle.stopping`; restarted after
        `restart_s` when it raises."""
        return cls(name, what, body, **kwargs)

    # --- control ---------------------------------------------------------

    def start(self) -> None:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        with _started_lock:
            _started.add(self)

    def nudge(self) -> None:
        """Cut the loop's `wait_nudge` short; safe inside a signal handler (sets a flag only)."""
        self._nudge.set()

    def stop(self, deadline: float | None = None) -> bool:
        """Ask the worker to stop and wait up to `deadline` seconds (None: no
        limit, 0: not at all); True when its thread has ended (or never ran)."""
        self._stop.set()
        self._nudge.set()
        if self._on_stop is not None:
            try:
                self._on_stop()
            except Exception as e:  # noqa: BLE001  (stopping must go on)
                log.warning("%s (%s): waking it to stop failed: %s", self.name, self.what, e)
        thread = self._thread
        if thread is None:
            return True
        if thread is not threading.current_thread():
            thread.join(deadline)
        ended = not thread.is_alive()
        if not ended and deadline:
            log.warning("%s (%s) did not stop within %.3g s", self.name, self.what, deadline)
        return ended

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def alive(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def state(self) -> WorkerState:
        return WorkerState(self.name, self.what, self.alive,
                           self._thread is not None and not self._stop.is_set(),
                           self.errors, self.last_error, self.last_success)

    # --- thread ----------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._body(self._handle)
            except Exception as e:  # noqa: BLE001  (counted and logged; restarted below)
                self._failed(e, None if self._stop.is_set() else self.restart_s)
                if self._stop.wait(self.restart_s):
                    return
                continue
            if not self._stop.is_set():
                log.warning("%s (%s) ended without being asked to stop", self.name, self.what)
            return

    def _failed(self, error: BaseException, again_in: float | None) -> None:
        said = f"{type(error).__name__}: {error}"
        with self._lock:
            self.errors += 1
            self.last_error = said
        then = f"; again in {again_in:.3g} s" if again_in is not None else ""
        log.warning("%s (%s) failed: %s%s", self.name, self.what, said, then)
        log.debug("%s (%s) failed", self.name, self.what, exc_info=error)
        if self._on_error is not None:
            self._on_error(error)

    def _succeeded(self) -> None:
        self.last_success = self._clock()


def started() -> list[Worker]:
    """Every worker started and still referenced, by name."""
    with _started_lock:
        return sorted(_started, key=lambda w: w.name)


def not_running(workers: list[Worker] | None = None) -> list[str]:
    """Names of the workers that should run and do not (dead, not restarting)."""
    return [w.name for w in (started() if workers is None else workers) if w.state().dead]
