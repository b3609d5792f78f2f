"""Blame: the split of a service's measured delay over its causes. Pure
arithmetic on figures; the agent's records and the CLI's Prometheus read-back
both go through it, so the two split by exactly the same rule.

Blame is a split of the service's measured delay by measured time, never by
fixed weights. The delay is its run-queue wait plus its D-state wait. The
run-queue wait is divided into:

- own-quota throttling: the part of each wait the service's own CPU limit
  held, measured per wait by the kernel programs (raw and BTF-typed
  tracepoints; the rest of those waits is in the blame pairs already). Where
  no wait was measured so (classic tracepoints, figures read back from an
  older Prometheus), the cgroup's throttled time from cpu.stat stands in,
  capped at the run-queue wait: the wall time the group was throttled, not
  the waits of its threads, so only an estimate;
- waits after preemptions, by the service that took the CPU (the same
  service, a neighbour, or kernel/unknown — the idle task included). A
  throttled task is switched out as if preempted, so the throttled time is
  taken out of these waits first, pro rata, instead of being counted twice;
- waits after wakeups, by the service that held the CPU until the waiter got
  it (the kernel records the last holder); a CPU that was idle is nobody's
  fault (kind "idle": wake-up latency). Without holder figures (e.g. from
  an older Prometheus series) the rest stays unattributed as "busy_cpu".

That is what tells a service starved by its own quota from a victim of its
neighbours: the same run-queue wait, a different measured cause.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agent.store.store import IDLE

__all__ = ["KERNEL_NAMES", "blame", "blame_from_totals"]

# Preemptor names that are not a service anyone runs: the kernel's own threads,
# the idle task and tasks whose cgroup the probe never saw.
KERNEL_NAMES = frozenset({"kernel", "unknown"})


def _culprit_kind(service: str, culprit: str) -> str:
    if culprit == service:
        return "self"
    if culprit in KERNEL_NAMES:
        return "kernel"
    return "neighbour"


# Category of the largest share -> what the verdict calls it.
_CAUSE_OF_KIND = {
    "neighbour": "neighbours",
    "self": "self",
    "kernel": "kernel",
    "own_quota": "own_quota",
    "busy_cpu": "busy_cpu",
    "idle": "idle",
    "io": "iowait",
    "unattributed": "unattributed",
}


def blame(service: str, figures: Any, throttled_seconds: float = 0.0) -> dict:
    """The measured split of `service`'s delay over a window (see the module doc)."""
    return blame_from_totals(
        service,
        # Waits a full histogram map could not take still happened: the
        # delay is the recorded sum plus the lost one.
        runq_wait=(figures.runq.sum_ns + figures.lost_runq.wait_ns) / 1e9,
        iowait=(figures.iowait.sum_ns + figures.lost_iowait.wait_ns) / 1e9,
        preempted={name: p.wait_ns / 1e9 for name, p in figures.preempted_by.items()},
        throttled_seconds=throttled_seconds,
        behind={name: p.wait_ns / 1e9 for name, p in figures.waited_behind.items()},
        unattributed_seconds=figures.lost_blame.wait_ns / 1e9,
        limited_seconds=figures.limited.wait_ns / 1e9,
    )


def blame_from_totals(service: str, runq_wait: float, iowait: float, preempted: Mapping[str, float],
                      throttled_seconds: float = 0.0, behind: Mapping[str, float] | None = None,
                      unattributed_seconds: float = 0.0, limited_seconds: float = 0.0) -> dict:
    """blame() on plain totals, so figures read back from Prometheus are split
    by exactly the same rule as the agent's own.

    unattributed_seconds: run-queue wait whose culprit the kernel could not
    record (a full blame map). It stays an explicit share: the known culprits
    are not scaled up to cover it.

    limited_seconds: the part of the waits the service's own CPU limit held,
    measured per wait; the pairs hold only the rest of those waits. When
    zero, throttled_seconds (cpu.stat) stands in, taken out of the
    preemptions, whose waits include it."""
    wait = runq_wait
    raw_total = sum(preempted.values())
    # Pair waits and the histogram sum come from the same switch-ins, but a
    # map update can fail on one side only: never let the parts exceed the whole.
    preempted_total = min(raw_total, wait)
    measured = limited_seconds > 0
    throttled = min(max(limited_seconds if measured else throttled_seconds, 0.0), wait)
    if measured:
        keep = min(1.0, (wait - throttled) / raw_total) if raw_total else 0.0
        wakeup = max(0.0, wait - throttled - raw_total * keep)
    else:
        from_preempt = min(throttled, preempted_total)
        keep = (preempted_total - from_preempt) / raw_total if raw_total else 0.0
        wakeup = max(0.0, wait - preempted_total - (throttled - from_preempt))
    unattributed = min(max(unattributed_seconds, 0.0), wakeup)
    wakeup -= unattributed
    delay = wait + iowait

    def share(seconds: float) -> float:
        return seconds / delay if delay > 0 else 0.0

    shares = [{"cause": "preemption", "service": name, "kind": _culprit_kind(service, name),
               "seconds": s * keep, "share": share(s * keep)}
              for name, s in preempted.items() if s * keep > 0]
    if throttled > 0:
        shares.append({"cause": "throttling", "kind": "own_quota", "seconds": throttled,
                       "share": share(throttled), "measured": "per_wait" if measured else "cpu.stat"})
    behind_total = sum(behind.values()) if behind else 0.0
    if wakeup > 0 and behind_total > 0:
        # Holder waits and the histogram come from the same switch-ins; scale
        # them onto the wakeup part so the parts never exceed the whole.
        scale = wakeup / behind_total
        for name, s in behind.items():
            if s > 0:
                kind = "idle" if name == IDLE else _culprit_kind(service, name)
                shares.append({"cause": "runq_after_wakeup", "service": name, "kind": kind,
                               "seconds": s * scale, "share": share(s * scale)})
    elif wakeup > 0:
        shares.append({"cause": "runq_after_wakeup", "kind": "busy_cpu", "seconds": wakeup,
                       "share": share(wakeup)})
    # Culprits: services, however they took the CPU, largest first.
    per_service: dict[str, float] = {}
    for sh in shares:
        if "service" in sh and sh["kind"] != "idle":
            per_service[sh["service"]] = per_service.get(sh["service"], 0.0) + sh["seconds"]
    culprits = sorted(({"service": n, "kind": _culprit_kind(service, n), "seconds": v, "share": share(v)}
                       for n, v in per_service.items()), key=lambda c: c["seconds"], reverse=True)
    if iowait > 0:
        shares.append({"cause": "iowait", "kind": "io", "seconds": iowait, "share": share(iowait)})
    if unattributed > 0:
        shares.append({"cause": "unattributed", "kind": "unattributed", "seconds": unattributed,
                       "share": share(unattributed)})

    by_kind: dict[str, float] = {}
    for s in shares:
        by_kind[s["kind"]] = by_kind.get(s["kind"], 0.0) + s["seconds"]
    cause = "none"
    if delay > 0 and by_kind:
        cause = _CAUSE_OF_KIND[max(by_kind.items(), key=lambda kv: kv[1])[0]]
    return {
        "delay_seconds": delay,
        "cause": cause,
        "kinds": {k: {"seconds": v, "share": share(v)} for k, v in
                  sorted(by_kind.items(), key=lambda kv: kv[1], reverse=True)},
        "culprits": culprits,
        "shares": sorted(shares, key=lambda s: s["seconds"], reverse=True),
        "unattributed": {"seconds": unattributed, "share": share(unattributed)},
    }
