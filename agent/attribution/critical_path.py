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
waited at once, so the shares add up to the delay. A wait behind the
service's own thread is charged to whoever kept the service's threads
waiting at that instant, if anyone did: with a heavier neighbour the
service's threads take turns on the little CPU it leaves them, and the last
holder of a wait is then often a sibling, while the CPU was the neighbour's.

Pure: waits in, figures out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from agent.store.store import IDLE

__all__ = ["Delay", "critical_delay"]


@dataclass(frozen=True)
class Delay:
    seconds: float
    by: tuple[tuple[str, float], ...]   # (culprit, seconds), largest first, adding up to `seconds`


def critical_delay(waits: Mapping[int, Sequence[tuple[int, int, str]]], threads: Iterable[int],
                   own: str | None = None) -> Delay:
    """The union over time of the waits (start_ns, end_ns, culprit) of
    `threads`, and its split by culprit.

    `waits` maps a thread id to its waits, already clipped to the request's
    window. Only the waits of `threads` make the delay; when `own` (the
    service's name) is given, the other threads' waits tell who is behind a
    wait charged to the service itself: a thread that waited behind one of
    its own threads while its own threads were themselves kept waiting by
    someone else waited, in the end, for that someone (a neighbour holding
    the CPU the service's threads take turns on). Those instants go to the
    neighbours keeping the service's threads waiting then, evenly.
    """
    critical = set(threads)
    edges: list[tuple[int, int, str, bool]] = []   # (time, +1 start / -1 end, culprit, critical)
    for tid, ws in waits.items():
        on_path = tid in critical
        if not on_path and own is None:
            continue
        for start, end, culprit in ws:
            if end > start:
                edges.append((start, 1, culprit, on_path))
                edges.append((end, -1, culprit, on_path))
    # Ends before starts at the same instant: touching waits do not overlap.
    edges.sort(key=lambda e: (e[0], e[1]))
    active: dict[str, int] = {}   # culprit -> critical waits in progress
    behind: dict[str, int] = {}   # culprit -> waits in progress of any thread, neither own nor idle
    n_active = n_behind = 0
    by: dict[str, float] = {}
    union = 0
    last = 0
    for t, step, culprit, on_path in edges:
        if n_active and t > last:
            span = t - last
            union += span
            for name, k in active.items():
                share = span * k / n_active
                if name == own and n_behind:
                    for other, j in behind.items():
                        by[other] = by.get(other, 0.0) + share * j / n_behind
                else:
                    by[name] = by.get(name, 0.0) + share
        last = t
        if on_path:
            n_active += step
            _count(active, culprit, step)
        if own is not None and culprit not in (own, IDLE):
            n_behind += step
            _count(behind, culprit, step)
    ranked = sorted(((name, ns / 1e9) for name, ns in by.items() if ns > 0), key=lambda kv: kv[1], reverse=True)
    return Delay(union / 1e9, tuple(ranked))


def _count(counts: dict[str, int], key: str, step: int) -> None:
    k = counts.get(key, 0) + step
    if k:
        counts[key] = k
    else:
        del counts[key]
