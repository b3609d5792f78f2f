"""Exact per-wait events of watched cgroups, kept briefly, cut by any window.

Interval totals cannot say how much of a 1 s interval's wait fell inside a
300 ms request. The kernel streams each wait of a watched cgroup (start, end,
other cgroup); summing their overlap with [start, end] gives the request's
figures to the nanosecond. A spinning thread's back-to-back short preempted
waits come as one record of their sum (bpf/sched.bpf.c stream_wait(): at
most 1 ms long, each wait under 100 µs); a window cuts such a record in
proportion to the time it covers, so only a window's edges can be off, by
less than the waits of one such record.

Layout, for speed of the window cut: per cgroup, one column per (kind, other
cgroup), sorted by end time, with running totals of durations. A window is
then two binary searches per column plus a short scan of the events that
straddle its edges (bounded by the column's longest event), whatever the
number of waits inside it. Run-queue waits are also kept per thread (one
column per thread id), so a request's wait splits by thread. Wake-ups across
processes (EV_WAKE) are kept per waking process, with the woken thread, so a
request can be followed to the processes that served it. About 32 bytes
per event, 65 for a run-queue wait; `max_events` bounds each of the two sets,
dropping the oldest.
"""

from __future__ import annotations

import threading
from array import array
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field

import numpy as np

from agent.probe.snapshot import (EV_IOWAIT, EV_LIMIT, EV_MIGRATE, EV_PREEMPTED, EV_RUNQ, EV_WAKE, EV_YIELD,
                                  RUNQ_KINDS, SchedEvent, event_rows)


@dataclass
class _Column:
    """Events of one (cgroup, kind, other) in end order. cum[i] is the total
    wait of every event before index i ever appended (it survives pruning,
    so differences stay valid after the front is dropped); an event's own
    wait is cum[i + 1] - cum[i], its end - start unless it merges several."""

    start: array = field(default_factory=lambda: array("Q"))
    end: array = field(default_factory=lambda: array("Q"))
    cum: array = field(default_factory=lambda: array("Q", [0]))
    max_len_ns: int = 0
    # A thread's column also keeps each wait's kind and other cgroup (who
    # preempted it, or held the CPU it woke up to), for the critical path.
    kind: array | None = None
    other: array | None = None
    # Any other column keeps the running count of waits alike (a record may
    # hold several), for the window's counts of waits and preemptions.
    cumn: array | None = None

    def add(self, start: int, end: int, kind: int = 0, other: int = 0, wait: int | None = None,
            waits: int = 1) -> None:
        duration = end - start if wait is None else wait
        self.max_len_ns = max(self.max_len_ns, end - start)
        if self.end and end < self.end[-1]:
            # CPUs submit to the ring buffer a few microseconds out of order:
            # insert in place and rebuild the running totals from there.
            i = bisect_right(self.end, end)
            self.end.insert(i, end)
            self.start.insert(i, start)
            if self.kind is not None:
                self.kind.insert(i, kind)
                self.other.insert(i, other)
            durations = [self.cum[j + 1] - self.cum[j] for j in range(i, len(self.cum) - 1)]
            durations.insert(0, duration)
            self.cum.insert(i + 1, 0)
            for j, w in enumerate(durations, start=i + 1):
                self.cum[j] = self.cum[j - 1] + w
            if self.cumn is not None:
                counts = [self.cumn[j + 1] - self.cumn[j] for j in range(i, len(self.cumn) - 1)]
                counts.insert(0, waits)
                self.cumn.insert(i + 1, 0)
                for j, w in enumerate(counts, start=i + 1):
                    self.cumn[j] = self.cumn[j - 1] + w
            return
        self.end.append(end)
        self.start.append(start)
        if self.kind is not None:
            self.kind.append(kind)
            self.other.append(other)
        self.cum.append(self.cum[-1] + duration)
        if self.cumn is not None:
            self.cumn.append(self.cumn[-1] + waits)

    def extend(self, start: np.ndarray, end: np.ndarray, wait: np.ndarray, waits: np.ndarray,
               kind: np.ndarray | None = None, other: np.ndarray | None = None) -> None:
        """Events given in end order, as columns. Those ending before this
        column's last event go in one by one (a drain may hold a wait a CPU
        submitted late); the rest are appended in one piece."""
        late = int(np.searchsorted(end, self.end[-1], side="left")) if self.end else 0
        for i in range(late):
            self.add(int(start[i]), int(end[i]), int(kind[i]) if kind is not None else 0,
                     int(other[i]) if other is not None else 0, int(wait[i]), int(waits[i]))
        if late == len(end):
            return
        start, end = start[late:].astype(np.uint64), end[late:].astype(np.uint64)
        duration = wait[late:].astype(np.int64)
        self.max_len_ns = max(self.max_len_ns, int((end.astype(np.int64) - start.astype(np.int64)).max()))
        self.start.frombytes(start.tobytes())
        self.end.frombytes(end.tobytes())
        self.cum.frombytes((np.cumsum(duration) + self.cum[-1]).astype(np.uint64).tobytes())
        if self.cumn is not None:
            self.cumn.frombytes((np.cumsum(waits[late:].astype(np.int64)) + self.cumn[-1]).astype(np.uint64).tobytes())
        if self.kind is not None:
            self.kind.frombytes(kind[late:].astype(np.uint8).tobytes())
            self.other.frombytes(other[late:].astype(np.uint64).tobytes())

    def _part(self, k: int, s: int, e: int) -> int:
        """Event k's wait inside [s, e] (within its own span): all of it for a
        single wait, in proportion to the time covered for merged ones."""
        span = self.end[k] - self.start[k]
        wait = self.cum[k + 1] - self.cum[k]
        return e - s if wait == span else wait * (e - s) // span

    def clipped(self, lo: int, hi: int) -> list[tuple[int, int, int, int, int]]:
        """(start, end, kind, other, wait) of the events overlapping [lo, hi],
        clipped to it; wait is the time waited inside the clipped span."""
        out = []
        n = len(self.end)
        k = bisect_left(self.end, lo)
        reach = hi + self.max_len_ns
        while k < n and self.end[k] <= reach:
            s, e = max(self.start[k], lo), min(self.end[k], hi)
            if s < e:
                out.append((s, e, self.kind[k] if self.kind is not None else 0,
                            self.other[k] if self.other is not None else 0, self._part(k, s, e)))
            k += 1
        return out

    def drop_first(self, n: int) -> None:
        del self.start[:n]
        del self.end[:n]
        del self.cum[:n]
        if self.cumn is not None:
            del self.cumn[:n]
        if self.kind is not None:
            del self.kind[:n]
            del self.other[:n]

    def __len__(self) -> int:
        return len(self.end)

    def _waits(self, k: int) -> int:
        return 1 if self.cumn is None else self.cumn[k + 1] - self.cumn[k]

    def _count_part(self, k: int, s: int, e: int) -> int:
        """Event k's waits inside [s, e], at least one: in proportion to the
        time covered for a record of several."""
        n = self._waits(k)
        return n if n == 1 else max(1, n * (e - s) // (self.end[k] - self.start[k]))

    def overlap(self, lo: int, hi: int) -> tuple[int, int]:
        """(total wait inside [lo, hi] in ns, waits overlapping it)."""
        i = bisect_left(self.end, lo)        # first event ending at or after lo
        j = bisect_right(self.end, hi)       # first event ending after hi
        total = self.cum[j] - self.cum[i]
        count = j - i if self.cumn is None else self.cumn[j] - self.cumn[i]
        # Events ending inside the window but starting before it: clip.
        k = i
        reach = lo + self.max_len_ns
        while k < j and self.end[k] <= reach:
            if self.start[k] < lo:
                total -= self._part(k, self.start[k], lo)
                count -= self._waits(k) - self._count_part(k, lo, self.end[k])
            k += 1
        # Events ending after the window but starting inside or before it.
        n = len(self.end)
        reach = hi + self.max_len_ns
        k = j
        while k < n and self.end[k] <= reach:
            s = self.start[k]
            if s <= hi:
                total += self._part(k, max(s, lo), hi)
                count += self._count_part(k, max(s, lo), hi)
            k += 1
        return total, count


THREAD_KEY = -1  # a column key's "kind" for one thread's run-queue waits
WAKE_KEY = -2    # ... for one process's wake-ups of another's threads (other: the woken thread)


@dataclass(frozen=True)
class WindowFigures:
    runq_wait_ns: int
    runq_count: int
    preemptions: int
    preempted_by: dict[int, int]   # preemptor cgroup id -> wait ns inside the window
    behind: dict[int, int]         # CPU holder cgroup id (0: idle) -> wait ns after wakeups
    iowait_ns: int
    migrations: int
    # of runq_wait_ns, the part the service's own CPU limit held (EV_LIMIT:
    # a piece of a wait whose rest is counted in runq_count)
    limit_ns: int = 0


class EventLog:
    def __init__(self, retention_ns: int, max_events: int = 2_000_000) -> None:
        self._retention_ns = retention_ns
        self._max_events = max_events
        # cgroup -> (kind, other cgroup) -> column; run-queue waits also by thread,
        # under (THREAD_KEY, tid), so a request's wait can be split by thread.
        self._cgroups: dict[int, dict[tuple[int, int], _Column]] = {}
        self._count = 0
        self._thread_count = 0  # the per-thread copies of run-queue waits, capped alike
        self._lock = threading.Lock()
        self.dropped = 0

    def add(self, events: np.ndarray | list[SchedEvent]) -> None:
        """Events as the probe drains them (EVENT_ROW rows), or as objects."""
        rows = events if isinstance(events, np.ndarray) else event_rows(events)
        if not len(rows):
            return
        rows = rows[np.argsort(rows["end_ns"], kind="stable")]
        runq = rows[np.isin(rows["kind"], RUNQ_KINDS + (EV_LIMIT,)) & (rows["tid"] != 0)]
        wake = rows["kind"] == EV_WAKE
        with self._lock:
            for (cgid, kind, other), part in _groups(rows[~wake], ("cgid", "kind", "other_cgid")):
                self._column(cgid, (kind, other)).extend(part["start_ns"], part["end_ns"], part["wait_ns"],
                                                         part["waits"])
            for (cgid, waker), part in _groups(rows[wake], ("cgid", "other_cgid")):
                self._column(cgid, (WAKE_KEY, waker), by_thread=True).extend(
                    part["start_ns"], part["end_ns"], part["wait_ns"], part["waits"], part["kind"], part["tid"])
            for (cgid, tid), part in _groups(runq, ("cgid", "tid")):
                self._column(cgid, (THREAD_KEY, tid), by_thread=True).extend(
                    part["start_ns"], part["end_ns"], part["wait_ns"], part["waits"], part["kind"],
                    part["other_cgid"])
            self._count += len(rows)
            self._thread_count += len(runq)
            self._prune(int(rows["end_ns"][-1]) - self._retention_ns)

    def _column(self, cgid: int, key: tuple[int, int], by_thread: bool = False) -> _Column:
        columns = self._cgroups.get(cgid)
        if columns is None:
            columns = self._cgroups[cgid] = {}
        col = columns.get(key)
        if col is None:
            col = columns[key] = (_Column(kind=array("B"), other=array("Q")) if by_thread
                                  else _Column(cumn=array("Q", [0])))
        return col

    def _prune(self, horizon_ns: int) -> None:
        for columns in self._cgroups.values():
            for key, col in list(columns.items()):
                n = bisect_left(col.end, horizon_ns)
                if key[0] == THREAD_KEY:
                    col.drop_first(n)
                    self._thread_count -= n
                    if not col.end:
                        del columns[key]  # threads come and go; their columns must too
                elif n:
                    col.drop_first(n)
                    self._count -= n
                    if key[0] == WAKE_KEY and not col.end:
                        del columns[key]  # so do the processes that wake
        while self._count > self._max_events:
            col = max((c for cols in self._cgroups.values() for k, c in cols.items() if k[0] != THREAD_KEY), key=len)
            n = max(1, len(col) // 10)
            col.drop_first(n)
            self._count -= n
            self.dropped += n
        while self._thread_count > self._max_events:
            col = max((c for cols in self._cgroups.values() for k, c in cols.items() if k[0] == THREAD_KEY), key=len)
            n = max(1, len(col) // 10)
            col.drop_first(n)
            self._thread_count -= n

    def __len__(self) -> int:
        return self._count

    def between(self, cgids: set[int], start_ns: int, end_ns: int) -> WindowFigures:
        """Figures of the cgroups' events clipped to [start_ns, end_ns]."""
        runq = runq_count = iowait = preemptions = migrations = limit = 0
        by: dict[int, int] = {}
        behind: dict[int, int] = {}
        with self._lock:
            for cgid in cgids:
                for (kind, other), col in self._cgroups.get(cgid, {}).items():
                    if kind == THREAD_KEY:
                        continue
                    if kind == EV_MIGRATE:
                        migrations += bisect_right(col.end, end_ns) - bisect_left(col.end, start_ns)
                        continue
                    total, count = col.overlap(start_ns, end_ns)
                    if not count:
                        continue
                    if kind == EV_IOWAIT:
                        iowait += total
                    elif kind in (EV_PREEMPTED, EV_YIELD):   # a yield gave way as a preemption does
                        runq += total
                        runq_count += count
                        preemptions += count
                        by[other] = by.get(other, 0) + total
                    elif kind == EV_RUNQ:
                        runq += total
                        runq_count += count
                        behind[other] = behind.get(other, 0) + total
                    elif kind == EV_LIMIT:
                        runq += total
                        limit += total
        return WindowFigures(runq, runq_count, preemptions, by, behind, iowait, migrations, limit)

    def thread_waits(self, cgids: set[int], start_ns: int,
                     end_ns: int) -> dict[int, list[tuple[int, int, int, int, int]]]:
        """tid -> the run-queue waits (start, end, kind, other cgroup, time
        waited) of the cgroups' threads overlapping [start_ns, end_ns],
        clipped to it."""
        out: dict[int, list[tuple[int, int, int, int, int]]] = {}
        with self._lock:
            for cgid in cgids:
                for (kind, tid), col in self._cgroups.get(cgid, {}).items():
                    if kind == THREAD_KEY:
                        waits = col.clipped(start_ns, end_ns)
                        if waits:
                            out.setdefault(tid, []).extend(waits)
        return out

    def wakes(self, cgids: set[int], start_ns: int, end_ns: int) -> list[tuple[int, int]]:
        """(waking process id, woken thread id) of the wake-ups across
        processes into the cgroups' threads inside [start_ns, end_ns]."""
        out: list[tuple[int, int]] = []
        with self._lock:
            for cgid in cgids:
                for (kind, waker), col in self._cgroups.get(cgid, {}).items():
                    if kind == WAKE_KEY:
                        lo, hi = bisect_left(col.end, start_ns), bisect_right(col.end, end_ns)
                        out.extend((waker, col.other[i]) for i in range(lo, hi))
        return out

    def waits_by_thread(self, cgids: set[int], start_ns: int, end_ns: int) -> dict[int, int]:
        """tid -> run-queue wait (ns) of the cgroups' threads clipped to [start_ns, end_ns]."""
        out: dict[int, int] = {}
        with self._lock:
            for cgid in cgids:
                for (kind, tid), col in self._cgroups.get(cgid, {}).items():
                    if kind == THREAD_KEY:
                        total, _ = col.overlap(start_ns, end_ns)
                        if total:
                            out[tid] = out.get(tid, 0) + total
        return out


def _groups(rows: np.ndarray, fields: tuple[str, ...]):
    """(key, rows) for each distinct value of the fields, the rows of each in
    their order in `rows`."""
    if not len(rows):
        return
    # lexsort is stable and sorts by its last key first.
    keyed = rows[np.lexsort([rows[f] for f in reversed(fields)])]
    change = np.zeros(len(keyed), dtype=bool)
    change[0] = True
    for f in fields:
        change[1:] |= keyed[f][1:] != keyed[f][:-1]
    bounds = np.flatnonzero(change).tolist() + [len(keyed)]
    heads = keyed[change]
    keys = zip(*(heads[f].tolist() for f in fields))
    for key, lo, hi in zip(keys, bounds, bounds[1:]):
        yield key, keyed[lo:hi]
