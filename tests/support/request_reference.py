"""A request's delay replayed from the raw tracefs events, another way than
the agent: the waits of the engine's threads over the request's window, and
who ran on the CPUs they waited for, instant by instant.

The request's critical threads are the main thread of each of its processes
(the API server's event loop, the engine core's step loop, the worker's
model loop: the thread whose name is its process's), as the agent's
critical path counts them; the delay is the union of their waits.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence

from tests.support.tracefs import SchedSwitch, TraceEvent, WaitSpan

Names = dict[int, tuple[int, str, str]]   # tid -> (pid, process, thread), tests/support/vllm_scene.py ThreadCensus
Occupancy = dict[int, tuple[list[int], list[int], list[int]]]


class SpanIndex:
    """The reference's waits in end order, to cut a window without reading them all."""

    def __init__(self, spans: Iterable[WaitSpan]) -> None:
        self.spans = sorted(spans, key=lambda s: s.end_ns)
        self.ends = [s.end_ns for s in self.spans]
        self.longest = max((s.end_ns - s.start_ns for s in self.spans), default=0)

    def overlapping(self, lo: int, hi: int):
        i = bisect.bisect_right(self.ends, lo)
        while i < len(self.spans) and self.ends[i] <= hi + self.longest:
            s = self.spans[i]
            if s.start_ns < hi:
                yield s
            i += 1


def request_window(offset_ns: int, doc: dict) -> tuple[int, int]:
    """The request document's window (Unix seconds) on the monotonic clock
    tracefs stamps with; offset_ns = time.time_ns() - time.monotonic_ns()."""
    return int(doc["start"] * 1e9) - offset_ns, int(doc["end"] * 1e9) - offset_ns


def is_critical(names: Names, tid: int) -> bool:
    return tid in names and names[tid][1] == names[tid][2]


def clipped_waits(index: SpanIndex, lo: int, hi: int) -> dict[int, list[tuple[int, int]]]:
    out: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for s in index.overlapping(lo, hi):
        out[s.tid].append((max(s.start_ns, lo), min(s.end_ns, hi)))
    return out


def union_ns(intervals: Iterable[tuple[int, int]]) -> int:
    total, reach = 0, None
    for s, e in sorted(intervals):
        if reach is None or s > reach:
            total += e - s
            reach = e
        elif e > reach:
            total += e - reach
            reach = e
    return total


def cpu_occupancy(events: Sequence[TraceEvent]) -> Occupancy:
    """Per CPU, who ran when: (starts, ends, tids) of every slice between two switches."""
    out: Occupancy = defaultdict(lambda: ([], [], []))
    current: dict[int, tuple[int, int]] = {}
    for ev in events:
        if isinstance(ev, SchedSwitch):
            if ev.cpu in current:
                start, tid = current[ev.cpu]
                starts, ends, tids = out[ev.cpu]
                starts.append(start)
                ends.append(ev.ts_ns)
                tids.append(tid)
            current[ev.cpu] = (ev.ts_ns, ev.next_pid)
    return dict(out)


def who_ran(index: SpanIndex, names: Names, occupancy: Occupancy, lo: int, hi: int,
            category: Callable[[int], str]) -> dict[str, float]:
    """The delay over [lo, hi] split by who *ran* on the CPUs its waiting
    critical threads waited for, instant by instant (seconds by
    `category(tid)`, tid 0 being the idle task; "other" where no switch was
    seen): a reference for the agent's split, computed another way than its
    per-wait culprit. While several threads wait, each has an equal share."""
    waits = [(max(s.start_ns, lo), min(s.end_ns, hi), s.cpu, s.tid) for s in index.overlapping(lo, hi)
             if is_critical(names, s.tid)]
    edges = sorted((t, step, i) for i, (a, b, _, _) in enumerate(waits) for t, step in ((a, 1), (b, -1)))
    split: dict[str, float] = defaultdict(float)
    active: dict[int, tuple[int, int]] = {}   # wait index -> (cpu, tid), swept in time order
    last = None
    for t1, step, i in edges:
        t0, last = last, t1
        if t0 is not None and t1 > t0 and active:
            _charge(split, list(active.values()), t0, t1, occupancy, category)
        if step > 0:
            active[i] = waits[i][2:]
        else:
            active.pop(i, None)
    return split


def _charge(split: dict[str, float], active: list[tuple[int, int]], t0: int, t1: int, occupancy: Occupancy,
            category: Callable[[int], str]) -> None:
    """[t0, t1] of the delay, split evenly between the waiting threads, each
    share by who ran on the CPU that thread waited for."""
    for cpu, waiter in active:
        starts, ends, tids = occupancy.get(cpu, ([], [], []))
        i = max(0, bisect.bisect_right(starts, t0) - 1)
        covered = 0
        while i < len(starts) and starts[i] < t1:
            overlap = min(ends[i], t1) - max(starts[i], t0)
            if overlap > 0 and tids[i] != waiter:
                split[category(tids[i])] += overlap / len(active) / 1e9
                covered += overlap
            i += 1
        split["other"] += max(0, (t1 - t0) - covered) / len(active) / 1e9
