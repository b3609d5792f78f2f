"""The cause of a wait: what kept a service's work from a CPU.

One closed vocabulary, named once (bpf/sched.h CAUSE_*, mirrored as
agent/probe/layout.py CAUSES), which every figure of delay carries. The kernel
decides one cause itself, per wait: the part during which the waiter's own
CPU limit throttled it (`cpu_limit`). The others follow from who kept the CPU
for the rest of the wait, named by the store (a service, `idle`, `unknown`):

- `neighbour`: another service held the CPU;
- `own_threads`: the service's own threads did;
- `kernel`: kernel threads did;
- `idle`: the CPU was idle when the waiter woke (wake-up latency);
- `unknown`: no culprit recorded (a wait whose start the programs missed, a
  full blame map, or a preemption by a task never seen switching out).

Pure: names in, names out.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from agent.identity.services import KERNEL
from agent.probe.layout import CAUSES
from agent.store.store import CPU_LIMIT, IDLE, UNKNOWN_SERVICE

__all__ = ["CAUSES", "CPU_LIMIT_CAUSE", "IDLE_CAUSE", "KERNEL_CAUSE", "NEIGHBOUR", "OWN_THREADS", "UNKNOWN",
           "cause_of", "culprit_service", "by_cause", "wait_by_cause", "tail_share"]

NEIGHBOUR, CPU_LIMIT_CAUSE, OWN_THREADS, KERNEL_CAUSE, IDLE_CAUSE, UNKNOWN = CAUSES

# Culprit names that are a cause of their own rather than a service.
_PSEUDO = {CPU_LIMIT: CPU_LIMIT_CAUSE, IDLE: IDLE_CAUSE, UNKNOWN_SERVICE: UNKNOWN, KERNEL.name: KERNEL_CAUSE}


def cause_of(culprit: str, own: str) -> str:
    """The cause of a wait of service `own` charged to `culprit`."""
    pseudo = _PSEUDO.get(culprit)
    if pseudo is not None:
        return pseudo
    return OWN_THREADS if culprit == own else NEIGHBOUR


def culprit_service(culprit: str, own: str) -> str:
    """The service a share is shown under: the limit is the service's own."""
    return own if culprit == CPU_LIMIT else culprit


def by_cause(delay_by: Iterable[tuple[str, float]], own: str) -> dict[str, float]:
    """(culprit, seconds) pairs summed by cause, largest first."""
    out: dict[str, float] = {}
    for culprit, seconds in delay_by:
        cause = cause_of(culprit, own)
        out[cause] = out.get(cause, 0.0) + seconds
    return dict(sorted(out.items(), key=lambda kv: kv[1], reverse=True))


def wait_by_cause(service: str, figures: Any) -> dict[str, float]:
    """A service's run-queue wait over a window (store figures) in seconds by
    cause, largest first: the part its CPU limit held, the rest by who held
    the CPU (after preemptions and after wake-ups), and what a full blame map
    could not record as `unknown`."""
    parts = [(CPU_LIMIT, figures.limited.wait_ns / 1e9), (UNKNOWN_SERVICE, figures.lost_blame.wait_ns / 1e9)]
    for table in (figures.preempted_by, figures.waited_behind):
        parts += [(name, p.wait_ns / 1e9) for name, p in table.items()]
    return {cause: seconds for cause, seconds in by_cause(parts, service).items() if seconds > 0}


def tail_share(runq: Any, limited: Any, q: float) -> float:
    """Of the waits at or above the q-quantile's histogram slot, the share its
    CPU limit held in part: 1.0 reads "the tail is all its own limit"."""
    if not runq.count:
        return 0.0
    slot = runq.quantile_slot(q)
    above = runq.count_from(slot)
    return limited.count_from(slot) / above if above else 0.0
