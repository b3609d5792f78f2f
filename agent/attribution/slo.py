"""One judge for every SLO: a figure holds its target when it is at most the
target, and an SLO with nothing measured (no waits, no request with that
figure) holds. Scheduler SLOs are judged on a service's histograms over an
interval or a window, request SLOs on one request, or on the P99 of the
requests that ended in the last minute; all of them through holds()."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from agent.attribution.request_span import RequestSpan
from agent.config import Slo

__all__ = ["REQUEST_SLOS", "SCHED_SLOS", "SloResult", "holds", "judge_request", "judge_slos"]

# SLO keys judged from the scheduler histograms, and how to read them.
SCHED_SLOS = {
    "runq_p99": ("runq", 0.99),
    "runq_p95": ("runq", 0.95),
    "iowait_p99": ("iowait", 0.99),
}
# Request SLO keys and the request figure each is judged on.
REQUEST_SLOS = (("request_e2e_p99", "e2e"), ("request_ttft_p99", "ttft"))


def holds(value: float | None, target: float) -> bool:
    """The one rule: within the target, or nothing measured."""
    return value is None or value <= target


@dataclass(frozen=True)
class SloResult:
    name: str
    target: float
    value: float | None
    ok: bool

    def as_dict(self) -> dict:
        return {"name": self.name, "target": self.target, "value": self.value, "ok": self.ok}


def judge_slos(slos: tuple[Slo, ...], service: str, figures: Any) -> list[SloResult]:
    """Scheduler SLOs of `service` judged on a ServiceWindow/ServiceInterval."""
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
            out.append(SloResult(name, target, value, holds(value, target)))
    return out


def judge_request(span: RequestSpan, slos: Iterable[Slo], service: str | None) -> list[SloResult]:
    """Request SLOs of the service on one request. A request without the
    judged figure (no ttft attribute) is not judged on it."""
    out = []
    for slo in slos:
        if slo.service != service:
            continue
        for name, figure in REQUEST_SLOS:
            target, value = getattr(slo, name), getattr(span, figure)
            if target is not None and value is not None:
                out.append(SloResult(name, target, value, holds(value, target)))
    return out
