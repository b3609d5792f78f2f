"""Exact per-wait events of watched cgroups, kept briefly, cut by any window.

Interval totals cannot say how much of a 1 s interval's wait fell inside a
300 ms request. The kernel streams each wait of a watched cgroup (start, end,
preemptor); summing their overlap with [start, end] gives the request's figures
to the nanosecond. Columns of unsigned 64-bit arrays keep memory at ~33 bytes
per event; `max_events` bounds it, dropping the oldest.
"""

from __future__ import annotations

import threading
from array import array
from bisect import bisect_left
from dataclasses import dataclass, field

from agent.snapshot import EV_IOWAIT, EV_MIGRATE, EV_PREEMPTED, EV_RUNQ, SchedEvent


@dataclass
class _Columns:
    """One cgroup's events, in arrival order (end times are nearly sorted:
    each CPU submits in order, CPUs interleave within microseconds)."""

    start: array = field(default_factory=lambda: array("Q"))
    end: array = field(default_factory=lambda: array("Q"))
    other: array = field(default_factory=lambda: array("Q"))
    kind: array = field(default_factory=lambda: array("B"))
    max_len_ns: int = 0        # longest event kept: how far before a window to look

    def __len__(self) -> int:
        return len(self.end)

    def drop_first(self, n: int) -> None:
        for col in (self.start, self.end, self.other, self.kind):
            del col[:n]


@dataclass(frozen=True)
class WindowFigures:
    runq_wait_ns: int
    runq_count: int
    preemptions: int
    preempted_by: dict[int, int]   # preemptor cgroup id -> wait ns inside the window
    iowait_ns: int
    migrations: int


class EventLog:
    def __init__(self, retention_ns: int, max_events: int = 2_000_000) -> None:
        self._retention_ns = retention_ns
        self._max_events = max_events
        self._cgroups: dict[int, _Columns] = {}
        self._count = 0
        self._lock = threading.Lock()
        self.dropped = 0

    def add(self, events: list[SchedEvent]) -> None:
        with self._lock:
            newest = 0
            for e in events:
                cols = self._cgroups.get(e.cgid)
                if cols is None:
                    cols = self._cgroups[e.cgid] = _Columns()
                cols.start.append(e.start_ns)
                cols.end.append(e.end_ns)
                cols.other.append(e.other_cgid)
                cols.kind.append(e.kind)
                cols.max_len_ns = max(cols.max_len_ns, e.end_ns - e.start_ns)
                newest = max(newest, e.end_ns)
            self._count += len(events)
            if newest:
                self._prune(newest - self._retention_ns)

    def _prune(self, horizon_ns: int) -> None:
        for cols in self._cgroups.values():
            n = bisect_left(cols.end, horizon_ns)
            if n:
                cols.drop_first(n)
                self._count -= n
        while self._count > self._max_events:
            cols = max(self._cgroups.values(), key=len)
            n = max(1, len(cols) // 10)
            cols.drop_first(n)
            self._count -= n
            self.dropped += n

    def __len__(self) -> int:
        return self._count

    def between(self, cgids: set[int], start_ns: int, end_ns: int) -> WindowFigures:
        """Figures of the cgroups' events clipped to [start_ns, end_ns]."""
        runq = runq_count = iowait = preemptions = migrations = 0
        by: dict[int, int] = {}
        with self._lock:
            for cgid in cgids:
                cols = self._cgroups.get(cgid)
                if cols is None:
                    continue
                # End times are only nearly sorted, so start the scan a margin
                # early; the overlap test below is exact either way.
                i = bisect_left(cols.end, start_ns - 1_000_000)
                n = len(cols)
                while i < n:
                    s, e, kind = cols.start[i], cols.end[i], cols.kind[i]
                    i += 1
                    if e < start_ns or s > end_ns:
                        if s > end_ns + cols.max_len_ns + 1_000_000:
                            break
                        continue
                    if kind == EV_MIGRATE:
                        migrations += 1
                        continue
                    overlap = min(e, end_ns) - max(s, start_ns)
                    if overlap < 0:
                        continue
                    if kind == EV_IOWAIT:
                        iowait += overlap
                    elif kind in (EV_RUNQ, EV_PREEMPTED):
                        runq += overlap
                        runq_count += 1
                        if kind == EV_PREEMPTED:
                            preemptions += 1
                            other = cols.other[i - 1]
                            by[other] = by.get(other, 0) + overlap
        return WindowFigures(runq, runq_count, preemptions, by, iowait, migrations)
