"""The `GET /api/v1/attribution` document: per-service records for a store
window (the interface spec's fields plus docs/api.md's), each with its
percentiles, preemption and wakeup figures, SLO results, blame
(agent/attribution/blame.py) and verdict (agent/attribution/verdict.py).
Pure: no host access, no bcc.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agent.attribution.blame import blame
from agent.attribution.causes import tail_share, wait_by_cause
from agent.attribution.slo import judge_slos
from agent.attribution.verdict import verdict
from agent.config import Slo

__all__ = ["attribution", "service_record"]


def unlimited_quantiles(runq: Any, limited: Any) -> dict:
    """The quantiles of the waits the service's own CPU limit did not hold:
    what contention alone gives it (absent when the limit held none)."""
    if not limited.count:
        return {}
    rest = runq.without(limited)
    return {"without_limit": {"count": rest.count, "p50": rest.quantile(0.5), "p95": rest.quantile(0.95),
                              "p99": rest.quantile(0.99)}}


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
            # The wait by cause (agent/attribution/causes.py), largest first.
            "by_cause": wait_by_cause(service, figures),
        },
        # The part of the waits the service's own CPU limit held, measured
        # per wait, and the share of the waits at or above the P99 it held in
        # part; the quantiles of the waits it did not touch: contention alone.
        "cpu_limit": {
            "count": figures.limited.count,
            "wait_seconds": figures.limited.wait_ns / 1e9,
            "p99_share": tail_share(runq, figures.runq_limited, 0.99),
            **unlimited_quantiles(runq, figures.runq_limited),
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
            "switch_in": figures.counters["untraced_switch_in"],
            "switch_out": figures.counters["untraced_switch_out"],
            "wakeup": figures.counters["untraced_wakeup"],
            "wakeup_recovered": figures.counters["recovered_wakeup"],
        },
        "slo": slo,
        "blame": blame(service, figures, throttled_seconds),
    }
    record["verdict"] = verdict(record)
    return record


def attribution(window: Any, slos: tuple[Slo, ...] = (), service: str | None = None,
                throttled: Mapping[str, float] | None = None,
                breaches: Mapping[tuple[str, str], int] | None = None,
                engines: Mapping[str, dict] | None = None) -> dict:
    """The `GET /api/v1/attribution` document for a store Window, services
    sorted by run-queue P99, worst first. `throttled` (service -> seconds) and
    `breaches` ((service, slo) -> intervals) cover the same intervals;
    `engines` (service -> its inference engine's own latency figures beside
    its requests' scheduling delay) the same window, as the scrapes allow."""
    throttled = throttled or {}
    engines = engines or {}
    records = [
        service_record(name, window.start, window.end, figures, slos,
                       throttled.get(name, 0.0), breaches)
        for name, figures in window.services.items()
        if service is None or name == service
    ]
    for record in records:
        if record["service"] in engines:
            record["engine"] = engines[record["service"]]
    records.sort(key=lambda r: r["runq"]["p99"], reverse=True)
    return {"attribution": records}
