"""Thread id -> (process id, process name, thread name), from /proc.

A request's run-queue wait is split by thread; vLLM V1 runs an API server, an
engine core and workers as separate processes (named by their titles, e.g.
"VLLM::EngineCor") with threads of their own, so the operator can see whose
loop waited; and which process started which (an engine core its workers), so
a request can be followed to the processes that served it. Names are cached
for a while: threads wait thousands of times a second, and a thread id is not
reused within a minute on any sane system.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["ThreadNames"]


class ThreadNames:
    def __init__(self, proc_root: Path = Path("/proc"), *, ttl_s: float = 60.0, max_cached: int = 65536,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._proc = Path(proc_root)
        self._ttl = ttl_s
        self._max = max_cached
        self._clock = clock
        self._cache: dict[int, tuple[float, tuple[int, str, str] | None]] = {}
        self._parents: dict[int, tuple[float, int | None]] = {}

    def __call__(self, tid: int) -> tuple[int, str, str] | None:
        """(pid, process name, thread name), or None once the thread is gone."""
        now = self._clock()
        hit = self._cache.get(tid)
        if hit is not None and now - hit[0] < self._ttl:
            return hit[1]
        found = self._read(tid)
        if len(self._cache) >= self._max:
            self._cache.clear()
        self._cache[tid] = (now, found)
        return found

    def parent(self, pid: int) -> int | None:
        """The process that started `pid` (PPid), or None once it is gone."""
        now = self._clock()
        hit = self._parents.get(pid)
        if hit is not None and now - hit[0] < self._ttl:
            return hit[1]
        try:
            status = (self._proc / str(pid) / "status").read_text()
            found = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("PPid:"))
        except (OSError, StopIteration, ValueError, IndexError):
            found = None
        if len(self._parents) >= self._max:
            self._parents.clear()
        self._parents[pid] = (now, found)
        return found

    def _read(self, tid: int) -> tuple[int, str, str] | None:
        try:
            # /proc/TID works for any thread id, though only process ids are listed.
            status = (self._proc / str(tid) / "status").read_text()
            thread = (self._proc / str(tid) / "comm").read_text().strip()
            pid = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("Tgid:"))
            process = (self._proc / str(pid) / "comm").read_text().strip()
        except (OSError, StopIteration, ValueError, IndexError):
            return None
        return pid, process, thread
