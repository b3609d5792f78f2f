"""Per-request truth: a request span plus the scheduler's figures over its
lifetime -> the SPEC's REQUEST document, its request SLOs and a verdict.

Pure: the span, the figures and the SLOs come in, a dict goes out, so every
sentence the CLI prints can be tested without a kernel.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from agent.attribution.request_sched import RequestSched
from agent.attribution.request_span import RequestSpan
from agent.attribution.slo import REQUEST_SLOS, judge_request
from agent.config import Slo
from agent.durations import fmt_seconds
from agent.store.store import IDLE, UNKNOWN_SERVICE

__all__ = [
    "Cause",
    "REQUEST_SLOS",
    "causes",
    "judge",
    "phase_windows",
    "request_document",
    "verdict",
]

# (SLO field in config, request figure it judges)

# A cause below both of these is noise on a busy machine, not a reason for a miss.
SIGNIFICANT_SECONDS = 0.010
SIGNIFICANT_SHARE = 0.05


@dataclass(frozen=True)
class Cause:
    # "contention" (a culprit preempted the service or held the CPU it woke up
    # to), "wakeup" (wake-up latency on an idle CPU), "runq" (wait with no
    # culprit recorded) or "iowait"
    kind: str
    seconds: float
    culprit: str | None = None


def causes(sched: RequestSched) -> list[Cause]:
    """What the request lost, split into causes, largest first: its delay
    (wall-clock, on the request's critical path) by who kept the CPU, then
    the I/O wait."""
    out = []
    for culprit, seconds in sched.delay_by:
        if seconds <= 0:
            continue
        if culprit == IDLE:
            out.append(Cause("wakeup", seconds))
        elif culprit == UNKNOWN_SERVICE:
            out.append(Cause("runq", seconds))   # no culprit recorded
        else:
            out.append(Cause("contention", seconds, culprit))
    if sched.iowait_seconds > 0:
        out.append(Cause("iowait", sched.iowait_seconds))
    out.sort(key=lambda c: c.seconds, reverse=True)
    return out


PHASES = ("queue", "prefill", "decode")


def phase_windows(span: RequestSpan) -> list[tuple[str, float, float]]:
    """(phase, start, end) in Unix seconds of the phases vLLM reported, one
    after the other from the request's start, within [start, end]."""
    out = []
    t = span.start
    for name in PHASES:
        length = getattr(span, name)
        if length is None or not length > 0:
            continue
        a, b = min(t, span.end), min(t + length, span.end)
        if b > a:
            out.append((name, a, b))
        t += length
    return out


def verdict(span: RequestSpan, sched: RequestSched | None, service: str | None) -> str:
    """One sentence naming the largest scheduling cause of the request's latency."""
    if service is None:
        return ("no scheduling figures: the span's resource names no process, container or service "
                "this agent knows (set process.pid or service.name)")
    if sched is None:
        return f"no scheduling figures for {service} over this request yet"
    ranked = causes(sched)
    if not ranked or (ranked[0].seconds < SIGNIFICANT_SECONDS
                      and ranked[0].seconds < SIGNIFICANT_SHARE * max(span.e2e, 1e-9)):
        return f"no significant scheduling delay (waited for a CPU {fmt_seconds(sched.delay_seconds)})"
    top = ranked[0]
    share = f"{top.seconds / span.e2e:.0%} of {fmt_seconds(span.e2e)} end to end" if span.e2e > 0 else \
        "of a request of no measurable duration"
    if top.kind == "contention" and top.culprit == service:
        what = f"run-queue wait behind its own threads ({service})"
    elif top.kind == "contention":
        what = f"CPU contention from {top.culprit}"
    elif top.kind == "wakeup":
        what = "wake-up latency on idle CPUs"
    elif top.kind == "runq":
        what = "run-queue wait without a recorded culprit"
    else:
        what = "I/O wait (D state)"
    return f"{what} added {fmt_seconds(top.seconds)} ({share})"


def judge(span: RequestSpan, slos: Iterable[Slo], service: str | None) -> list[dict]:
    """The request SLOs of the service, as the REQUEST document lists them."""
    return [r.as_dict() for r in judge_request(span, slos, service)]


def request_document(span: RequestSpan, service: str | None, how: str, sched: RequestSched | None,
                     slo: list[dict], complete: bool) -> dict:
    """The SPEC's REQUEST JSON (plus a few added fields)."""
    return {
        "request_id": span.request_id,
        "trace_id": span.trace_id,
        "span_id": span.span_id,
        "parent_span_id": span.parent_span_id,
        "service": service if service is not None else "unknown",
        "service_from": how,
        "start": span.start,
        "end": span.end,
        "e2e": span.e2e,
        "ttft": span.ttft,
        "queue": span.queue,
        "phases": span.phases(),
        "tokens": {"prompt": span.prompt_tokens, "completion": span.completion_tokens,
                   "max": span.max_tokens},
        "model": span.model,
        "finish_reasons": list(span.finish_reasons),
        "sched": sched.as_dict() if sched is not None else None,
        "sched_resolution_seconds": sched.resolution_seconds if sched is not None else None,
        # False when the figures were taken before the kernel side covered the
        # whole request (the source fell behind); they may then be low.
        "sched_complete": complete and sched is not None,
        "slo": slo,
        # who delayed the request the most, preempting its work or holding the CPU it woke up to
        "culprits": [{"service": c.culprit, "wait_seconds": c.seconds}
                     for c in (causes(sched) if sched is not None else []) if c.kind == "contention"],
        "verdict": verdict(span, sched, service),
    }
