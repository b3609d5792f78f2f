"""Per-service figures for a window: percentiles, blame and SLO verdicts.

Turns the store's merged windows into the JSON records of SPEC.md
(`GET /api/v1/attribution`). Pure: no host access, no bcc.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.config import Slo

# SLO keys judged from the scheduler histograms, and how to read them
SCHED_SLOS = {
    "runq_p99": ("runq", 0.99),
    "runq_p95": ("runq", 0.95),
    "iowait_p99": ("iowait", 0.99),
}


@dataclass(frozen=True)
class SloResult:
    name: str
    target: float
    value: float | None
    ok: bool

    def as_dict(self) -> dict:
        return {"name": self.name, "target": self.target, "value": self.value, "ok": self.ok}


def judge_slos(slos: tuple[Slo, ...], service: str, figures) -> list[SloResult]:
    """SLOs of `service` judged on a ServiceWindow/ServiceInterval. An SLO with
    no samples in the window is met: nothing waited."""
    out = []
    for slo in slos:
        if slo.service != service:
            continue
        for name, (hist_name, q) in SCHED_SLOS.items():
            target = getattr(slo, name)
            if target is None:
                continue
            hist = getattr(figures, hist_name)
            value = hist.quantile(q) if hist.count else None
            out.append(SloResult(name, target, value, value is None or value <= target))
    return out


def service_record(service: str, start: float, end: float, figures, slos: tuple[Slo, ...] = (),
                   throttled_seconds: float = 0.0) -> dict:
    runq, iowait = figures.runq, figures.iowait
    by = sorted(figures.preempted_by.items(), key=lambda kv: kv[1].wait_ns, reverse=True)
    preempt_count = sum(p.count for _, p in by)
    preempt_wait = sum(p.wait_ns for _, p in by) / 1e9
    return {
        "service": service,
        "start": start,
        "end": end,
        "runq": {
            "count": runq.count,
            "wait_seconds": runq.sum_seconds,
            "p50": runq.quantile(0.5),
            "p95": runq.quantile(0.95),
            "p99": runq.quantile(0.99),
        },
        "preemption": {
            "count": preempt_count,
            "wait_seconds": preempt_wait,
            "by": [{"service": name, "count": p.count, "wait_seconds": p.wait_ns / 1e9} for name, p in by],
        },
        "iowait": {"count": iowait.count, "seconds": iowait.sum_seconds, "p99": iowait.quantile(0.99)},
        "migrations": figures.migrations,
        "throttled_seconds": throttled_seconds,
        "untraced": {
            "switch_in": figures.untraced_switch_in,
            "switch_out": figures.untraced_switch_out,
            "wakeup": figures.untraced_wakeup,
        },
        "slo": [r.as_dict() for r in judge_slos(slos, service, figures)],
    }


def attribution(window, slos: tuple[Slo, ...] = (), service: str | None = None) -> dict:
    """The `GET /api/v1/attribution` document for a store Window, services
    sorted by run-queue P99, worst first."""
    records = [
        service_record(name, window.start, window.end, figures, slos)
        for name, figures in window.services.items()
        if service is None or name == service
    ]
    records.sort(key=lambda r: r["runq"]["p99"], reverse=True)
    return {"attribution": records}
