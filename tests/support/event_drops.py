"""When the agent's per-wait event stream dropped events, read from the
kernel's own counters of the running agent (its `errors` per-CPU array: a
full ring buffer, the rate limit), every few milliseconds, with the wall
clock of each read: the reference a request's `sched_complete` and
`sched_dropped_events` are checked against. The agent itself reads the same
counters only at its drains and intervals; this reads them by map id with the
bpf() syscall (bench/bpfstats.py), without the agent's code.
"""

from __future__ import annotations

import bisect
import threading
import time

from agent.probe.layout import ERROR_MAPS
from bench.bpfstats import PercpuArray, process_maps

STREAM_ERRORS = tuple(i for i, name in enumerate(ERROR_MAPS) if name.startswith("events"))


class DropSampler:
    """(wall time, events dropped since the agent loaded) every `every_s`
    while the context lasts."""

    def __init__(self, agent_pid: int, every_s: float = 0.02) -> None:
        [errors] = [m for m in process_maps(agent_pid) if m.name == "errors"]
        self._array = PercpuArray(errors.id)
        self.every_s = every_s
        self.times: list[float] = []
        self.totals: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="drop-sampler", daemon=True)

    def read(self) -> int:
        return sum(self._array.sum(i) for i in STREAM_ERRORS)

    def _run(self) -> None:
        while True:
            total = self.read()
            self.times.append(time.time())
            self.totals.append(total)
            if self._stop.wait(self.every_s):
                return

    def __enter__(self) -> "DropSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
        self._array.close()

    def _at_or_before(self, t: float) -> int | None:
        i = bisect.bisect_right(self.times, t) - 1
        return i if i >= 0 else None

    def _at_or_after(self, t: float) -> int | None:
        i = bisect.bisect_left(self.times, t)
        return i if i < len(self.times) else None

    def surely_within(self, start: float, end: float) -> int:
        """Drops the stream surely made inside [start, end]: between the
        first read at or after start and the last at or before end."""
        a, b = self._at_or_after(start), self._at_or_before(end)
        if a is None or b is None or b <= a:
            return 0
        return self.totals[b] - self.totals[a]

    def at_most_around(self, start: float, end: float, margin_s: float) -> int | None:
        """Drops between the last read before start - margin_s and the first
        after end + margin_s: at least every drop near the window (None
        where the reads do not reach that far)."""
        a, b = self._at_or_before(start - margin_s), self._at_or_after(end + margin_s)
        if a is None or b is None:
            return None
        return self.totals[b] - self.totals[a]

    def total(self) -> int:
        return self.totals[-1] - self.totals[0] if self.totals else 0
