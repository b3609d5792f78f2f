"""Per-service figures for a window: percentiles, blame and SLO verdicts.

Turns the store's merged windows into the JSON records of
`GET /api/v1/attribution` (the interface spec's, plus docs/api.md). Pure: no host access, no bcc.

Blame is a split of the service's measured delay by measured time, never by
fixed weights. The delay is its run-queue wait plus its D-state wait. The
run-queue wait is divided into:

- own-quota throttling: the cgroup's throttled time from cpu.stat, capped at
  the run-queue wait (a throttled task is runnable but dequeued, so its
  throttled time is run-queue wait; the kernel measured it directly);
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

from agent.attribution.slo import SCHED_SLOS, SloResult, judge_slos
from agent.config import Slo
from agent.durations import fmt_seconds
from agent.store.store import IDLE

__all__ = [
    "SCHED_SLOS",
    "SloResult",
    "attribution",
    "blame",
    "blame_from_totals",
    "judge_slos",
    "service_record",
    "verdict",
]

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
    )


def blame_from_totals(service: str, runq_wait: float, iowait: float, preempted: Mapping[str, float],
                      throttled_seconds: float = 0.0, behind: Mapping[str, float] | None = None,
                      unattributed_seconds: float = 0.0) -> dict:
    """blame() on plain totals, so figures read back from Prometheus are split
    by exactly the same rule as the agent's own.

    unattributed_seconds: run-queue wait whose culprit the kernel could not
    record (a full blame map). It stays an explicit share: the known culprits
    are not scaled up to cover it."""
    wait = runq_wait
    raw_total = sum(preempted.values())
    # Pair waits and the histogram sum come from the same switch-ins, but a
    # map update can fail on one side only: never let the parts exceed the whole.
    preempted_total = min(raw_total, wait)
    throttled = min(max(throttled_seconds, 0.0), wait)
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
                       "share": share(throttled)})
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


def _pct(share: float) -> str:
    return f"{share * 100:.0f}%"


def verdict(record: Mapping[str, Any]) -> str:
    """One sentence naming the largest measured cause of the service's delay."""
    service = record["service"]
    b = record["blame"]
    runq = record["runq"]
    broken = [s for s in record.get("slo", []) if not s["ok"]]
    lead = f"{service}: run-queue P99 {fmt_seconds(runq['p99'])}"
    if broken:
        lead += " (" + ", ".join(f"{s['name']} {fmt_seconds(s['value'])} over its {fmt_seconds(s['target'])} target"
                                 for s in broken) + ")"
    if b["cause"] == "none":
        return f"{service}: no measurable scheduling or I/O delay in this window."
    kinds = b["kinds"]
    delay = fmt_seconds(b["delay_seconds"])

    def part(kind: str) -> float:
        return kinds.get(kind, {}).get("share", 0.0)

    neighbours = [c for c in b["culprits"] if c["kind"] == "neighbour"]
    named = " and ".join(f"{c['service']} ({fmt_seconds(c['seconds'])}, {_pct(c['share'])})" for c in neighbours[:2])
    cause = b["cause"]
    if cause == "own_quota":
        body = (f"starved by its own CPU quota, throttled {fmt_seconds(kinds['own_quota']['seconds'])} "
                f"= {_pct(part('own_quota'))} of its {delay} delay, while neighbours account for "
                f"{_pct(part('neighbour'))}")
    elif cause == "neighbours":
        body = (f"delayed by its neighbours, {named}, "
                f"{_pct(part('neighbour'))} of its {delay} delay (own quota {_pct(part('own_quota'))})")
    elif cause == "idle":
        body = (f"mostly wake-up latency on idle CPUs, {_pct(part('idle'))} of its {delay} delay: "
                "no neighbour to blame")
    elif cause == "busy_cpu":
        body = (f"mostly waited for a busy CPU after waking up, {_pct(part('busy_cpu'))} of its {delay} delay"
                + (f"; preemptions by {named} add {_pct(part('neighbour'))}" if neighbours else "")
                + (f"; own quota {_pct(part('own_quota'))}" if part("own_quota") else ""))
    elif cause == "iowait":
        body = f"mostly blocked in I/O (D state), {_pct(part('io'))} of its {delay} delay"
    elif cause == "unattributed":
        body = (f"{_pct(part('unattributed'))} of its {delay} delay has no recorded culprit "
                "(the agent's blame map was full; see slatrace_bpf_map_errors_total)")
    elif cause == "self":
        body = (f"mostly preempted by its own threads, {_pct(part('self'))} of its {delay} delay "
                f"(more runnable threads than CPUs it gets)")
    else:  # kernel
        body = f"mostly preempted by kernel or unknown tasks, {_pct(part('kernel'))} of its {delay} delay"
    return f"{lead}: {body}."


def service_record(service: str, start: float, end: float, figures: Any, slos: tuple[Slo, ...] = (),
                   throttled_seconds: float = 0.0,
                   breaches: Mapping[tuple[str, str], int] | None = None) -> dict:
    runq, iowait = figures.runq, figures.iowait
    by = sorted(figures.preempted_by.items(), key=lambda kv: kv[1].wait_ns, reverse=True)
    behind = figures.waited_behind
    preempt_count = sum(p.count for _, p in by)
    preempt_wait = sum(p.wait_ns for _, p in by) / 1e9
    slo = []
    for r in judge_slos(slos, service, figures):
        d = r.as_dict()
        if breaches is not None:
            d["intervals_breached"] = breaches.get((service, r.name), 0)
        slo.append(d)
    record = {
        "service": service,
        "start": start,
        "end": end,
        "runq": {
            "count": runq.count,
            "wait_seconds": runq.sum_seconds,
            "p50": runq.quantile(0.5),
            "p95": runq.quantile(0.95),
            "p99": runq.quantile(0.99),
            # Share of the service's waits the histogram holds: below 1.0 a
            # full kernel map dropped some, and the quantiles may read low.
            "coverage": figures.coverage,
            "lost": figures.lost_runq.count,
        },
        "preemption": {
            "count": preempt_count,
            "wait_seconds": preempt_wait,
            "by": [{"service": name, "count": p.count, "wait_seconds": p.wait_ns / 1e9} for name, p in by],
        },
        "wakeup": {
            "count": sum(p.count for p in behind.values()),
            "wait_seconds": sum(p.wait_ns for p in behind.values()) / 1e9,
            "behind": [{"service": name, "count": p.count, "wait_seconds": p.wait_ns / 1e9}
                       for name, p in sorted(behind.items(), key=lambda kv: kv[1].wait_ns, reverse=True)],
        },
        "iowait": {"count": iowait.count, "seconds": iowait.sum_seconds, "p99": iowait.quantile(0.99)},
        "migrations": figures.migrations,
        "throttled_seconds": throttled_seconds,
        "untraced": {
            "switch_in": figures.untraced_switch_in,
            "switch_out": figures.untraced_switch_out,
            "wakeup": figures.untraced_wakeup,
        },
        "slo": slo,
        "blame": blame(service, figures, throttled_seconds),
    }
    record["verdict"] = verdict(record)
    return record


def attribution(window: Any, slos: tuple[Slo, ...] = (), service: str | None = None,
                throttled: Mapping[str, float] | None = None,
                breaches: Mapping[tuple[str, str], int] | None = None) -> dict:
    """The `GET /api/v1/attribution` document for a store Window, services
    sorted by run-queue P99, worst first. `throttled` (service -> seconds) and
    `breaches` ((service, slo) -> intervals) cover the same intervals."""
    throttled = throttled or {}
    records = [
        service_record(name, window.start, window.end, figures, slos,
                       throttled.get(name, 0.0), breaches)
        for name, figures in window.services.items()
        if service is None or name == service
    ]
    records.sort(key=lambda r: r["runq"]["p99"], reverse=True)
    return {"attribution": records}
