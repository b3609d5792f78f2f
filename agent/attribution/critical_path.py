"""How much longer a request took because its work waited for a CPU.

Summing run-queue waits over a service's threads counts thread-seconds: vLLM
0.32 runs three processes and ~60 threads, most of them helpers (a gloo TCP
loop, ZMQ I/O threads, idle pool threads) whose waits hold nobody up, so the
sum overstates the delay several times and can exceed the request's
duration. The request's delay is instead the wall-clock **union** of the waits
of the threads that carry its work, clipped to its window: at any instant the
request is held up if one of those threads is runnable and not running. A
union of sub-intervals of [start, end] never exceeds end - start.

Each instant of the union is charged to whoever kept the CPU from the waiting
threads (the preemptor, or the task that held the CPU a woken thread wanted;
`idle` when the CPU was idle), split evenly when several of those threads
waited at once, so the shares add up to the delay.

Pure: waits in, figures out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Delay", "critical_delay"]


@dataclass(frozen=True)
class Delay:
    seconds: float
    by: tuple[tuple[str, float], ...]   # (culprit, seconds), largest first, adding up to `seconds`


def critical_delay(waits: Mapping[int, Sequence[tuple[int, int, str]]], threads: Iterable[int]) -> Delay:
    """The union over time of the waits (start_ns, end_ns, culprit) of
    `threads`, and its split by culprit.

    `waits` maps a thread id to its waits, already clipped to the request's
    window; threads not in `threads` are ignored.
    """
    edges: list[tuple[int, int, str]] = []   # (time, +1 start / -1 end, culprit)
    for tid in threads:
        for start, end, culprit in waits.get(tid, ()):
            if end > start:
                edges.append((start, 1, culprit))
                edges.append((end, -1, culprit))
    # Ends before starts at the same instant: touching waits do not overlap.
    edges.sort(key=lambda e: (e[0], e[1]))
    active: dict[str, int] = {}   # culprit -> waits in progress
    n_active = 0
    by: dict[str, float] = {}
    union = 0
    last = 0
    for t, step, culprit in edges:
        if n_active and t > last:
            span = t - last
            union += span
            for name, k in active.items():
                by[name] = by.get(name, 0.0) + span * k / n_active
        last = t
        n_active += step
        k = active.get(culprit, 0) + step
        if k:
            active[culprit] = k
        else:
            del active[culprit]
    ranked = sorted(((name, ns / 1e9) for name, ns in by.items() if ns > 0), key=lambda kv: kv[1], reverse=True)
    return Delay(union / 1e9, tuple(ranked))
