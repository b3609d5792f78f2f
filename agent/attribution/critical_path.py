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

The service's own CPU limit defers the same way, to neighbours only: an
instant where one of the request's threads sat throttled while another of
them waited behind a neighbour goes to that neighbour. The request could not
move on before the neighbour let its thread run, limit or not; and a
throttle there is mostly the neighbour's doing, since the service's other
threads spend its quota waiting (spinning) for the one held. Removing the
limit alone leaves those instants held; removing the neighbour ends them.
(With a neighbour of twenty times vLLM's weight and the limit at 0.5 CPU, an
even split charged the limit 0.88 s a request where removing it took away
0.20-0.44 s.)

A wait that began with the thread yielding (a loop polling a queue for the
next step another thread makes, as vLLM's shared-memory readers do) is not
work held back: at an instant where another of the request's threads waits
for a CPU while one polls, the instant is charged to what keeps the other
waiting, and a poll does not make its culprit hold the request against the
limit, nor stand behind a wait on the service's own threads (above). The
request cannot move on before the thread polled for makes the step; where
no other thread waits, the poll is charged to whoever ran instead, as it
delays seeing the step. (With the engine core throttled
by the limit and the worker polling behind a neighbour for the step the
engine core had not sent, the neighbour was charged the instants the limit
held.) Where the programs cannot tell a yield (classic tracepoints, other
architectures: agent/probe/btf.py SyscallSite), polls count as preemptions.

A record of a spinning thread's merged short waits (agent/store/events.py)
waited only part of the time it covers: it counts as waiting that part of
every instant (its density), and instants where several such records overlap
count as held up in the part where any of them waited, taken as
independent (1 - the product of their parts not waiting). A whole wait
counts fully, so where no record is merged the union is exact.

Pure: waits in, figures out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from agent.identity.services import KERNEL
from agent.store.store import CPU_LIMIT, IDLE, UNKNOWN_SERVICE

__all__ = ["Delay", "Wait", "clip", "critical_delay"]

# Culprits that are not another service.
_NOT_NEIGHBOURS = frozenset({CPU_LIMIT, IDLE, UNKNOWN_SERVICE, KERNEL.name})

# (start_ns, end_ns, culprit) for a whole wait; with the time waited inside
# [start, end] as a fourth element for a record of merged waits; with a
# fifth, True when the waits were polls (the thread yielded).
Wait = tuple[int, int, str] | tuple[int, int, str, int] | tuple[int, int, str, int, bool]


@dataclass(frozen=True)
class Delay:
    seconds: float
    by: tuple[tuple[str, float], ...]   # (culprit, seconds), largest first, adding up to `seconds`


def clip(waits: Sequence[Wait], lo: int, hi: int) -> list[Wait]:
    """The waits inside [lo, hi], a merged record keeping the share of its
    waiting in proportion to the time left."""
    out: list[Wait] = []
    for w in waits:
        start, end = w[0], w[1]
        s, e = max(start, lo), min(end, hi)
        if s >= e:
            continue
        if len(w) >= 4 and (s, e) != (start, end):
            out.append((s, e, w[2], w[3] * (e - s) // (end - start), *w[4:]))
        else:
            out.append((s, e, *w[2:]))
    return out


def critical_delay(waits: Mapping[int, Sequence[Wait]], threads: Iterable[int],
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
    neighbours keeping the service's threads waiting then, evenly; and the
    part of an instant charged to the service's CPU limit goes to the
    neighbours holding one of `threads` at that instant, if any.
    """
    critical = set(threads)
    # (time, +1 start / -1 end, culprit, critical, density: the part of the
    # time covered that was waited, polling)
    edges: list[tuple[int, int, str, bool, float, bool]] = []
    for tid, ws in waits.items():
        on_path = tid in critical
        if not on_path and own is None:
            continue
        for w in ws:
            start, end, culprit = w[0], w[1], w[2]
            if end > start:
                density = min(1.0, w[3] / (end - start)) if len(w) >= 4 else 1.0
                polling = len(w) == 5 and bool(w[4])
                edges.append((start, 1, culprit, on_path, density, polling))
                edges.append((end, -1, culprit, on_path, density, polling))
    # Ends before starts at the same instant: touching waits do not overlap.
    edges.sort(key=lambda e: (e[0], e[1]))
    active: dict[str, float] = {}   # culprit -> critical work waiting in progress (sum of densities)
    polls: dict[str, float] = {}    # culprit -> critical polling in progress
    held: dict[str, float] = {}     # neighbour -> critical work waiting behind it in progress
    behind: dict[str, float] = {}   # culprit -> work waiting in progress of any thread, neither own nor idle
    whole = 0                       # critical whole waits in progress
    parts: dict[float, int] = {}    # density -> critical merged records in progress
    n_active = n_polls = n_behind = n_held = 0.0
    by: dict[str, float] = {}
    union = 0.0
    last = 0
    for t, step, culprit, on_path, density, polling in edges:
        if (active or polls) and t > last:
            span = (t - last) * _held(whole, parts)
            union += span
            now: dict[str, float] = {}
            # Polls are charged only where no work waits.
            charged, n_charged = (active, n_active) if active else (polls, n_polls)
            for name, k in charged.items():
                share = span * k / n_charged
                if name == own and behind:
                    for other, j in behind.items():
                        now[other] = now.get(other, 0.0) + share * j / n_behind
                else:
                    now[name] = now.get(name, 0.0) + share
            limit = now.pop(CPU_LIMIT, 0.0) if held and own is not None else 0.0
            for other, j in held.items():
                now[other] = now.get(other, 0.0) + limit * j / n_held
            for name, share in now.items():
                by[name] = by.get(name, 0.0) + share
        last = t
        if on_path:
            if polling:
                n_polls += step * density
                _count(polls, culprit, step * density)
            else:
                n_active += step * density
                _count(active, culprit, step * density)
                if culprit not in _NOT_NEIGHBOURS and culprit != own:
                    n_held += step * density
                    _count(held, culprit, step * density)
            if density == 1.0:
                whole += step
            else:
                _count(parts, density, step)
        if own is not None and culprit not in (own, IDLE) and not polling:
            n_behind += step * density
            _count(behind, culprit, step * density)
    ranked = sorted(((name, ns / 1e9) for name, ns in by.items() if ns > 0), key=lambda kv: kv[1], reverse=True)
    return Delay(union / 1e9, tuple(ranked))


def _held(whole: int, parts: Mapping[float, int]) -> float:
    """The part of an instant held up: all of it while a whole wait is in
    progress, else where any merged record waited (taken as independent)."""
    if whole:
        return 1.0
    free = 1.0
    for density, k in parts.items():
        free *= (1.0 - density) ** k
    return 1.0 - free


def _count(counts: dict, key, step) -> None:
    k = counts.get(key, 0) + step
    if abs(k) > 1e-9:
        counts[key] = k
    else:
        del counts[key]
