"""Per-request truth: a request span plus the scheduler's figures over its
lifetime -> the SPEC's REQUEST document, its request SLOs and a verdict.

Pure: the span, the figures and the SLOs come in, a dict goes out, so every
sentence the CLI prints can be tested without a kernel.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from agent.attribution.causes import CPU_LIMIT_CAUSE, IDLE_CAUSE, KERNEL_CAUSE, NEIGHBOUR, OWN_THREADS, cause_of
from agent.attribution.request_sched import RequestSched
from agent.attribution.request_span import RequestSpan
from agent.attribution.slo import REQUEST_SLOS, judge_request
from agent.config import Slo
from agent.durations import fmt_seconds

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
    # a cause of agent/attribution/causes.py (neighbour, cpu_limit,
    # own_threads, kernel, idle, unknown), or "iowait"
    kind: str
    seconds: float
    culprit: str | None = None   # the service that held the CPU (neighbour, own_threads, kernel)

    @property
    def contention(self) -> bool:
        """A service held the CPU: the request's culprits."""
        return self.kind in (NEIGHBOUR, OWN_THREADS, KERNEL_CAUSE)


def causes(sched: RequestSched, service: str | None = None) -> list[Cause]:
    """What the request of `service` lost, split into causes, largest first:
    its delay (wall-clock, on the request's critical path) by who or what
    kept the CPU, then the I/O wait."""
    own = sched.service or service or ""
    out = []
    for culprit, seconds in sched.delay_by:
        if seconds <= 0:
            continue
        kind = cause_of(culprit, own)
        out.append(Cause(kind, seconds, culprit if kind in (NEIGHBOUR, OWN_THREADS, KERNEL_CAUSE) else None))
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


def limit_words(limits: list[dict]) -> str:
    """Where the service's CPU limit is set, as the verdict names it."""
    if not limits:
        return "its own CPU limit"
    named = "; ".join(f"{lim['setting']}, {lim['cpus']:.3g} CPU, on "
                      + (f"the {lim['level']}'s cgroup" if lim["level"] != "cgroup" else lim["cgroup"])
                      for lim in limits)
    return f"its own CPU limit ({named})"


def verdict(span: RequestSpan, sched: RequestSched | None, service: str | None,
            limits: list[dict] | None = None) -> str:
    """One sentence naming the largest scheduling cause of the request's
    latency, and what would change it. Shares are of the request's window,
    the span's start to end, over which the delay is measured (vLLM's own e2e
    attribute can be a little shorter)."""
    if service is None:
        return ("no scheduling figures: the span's resource names no process, container or service "
                "this agent knows (set process.pid or service.name)")
    if sched is None:
        return f"no scheduling figures for {service} over this request yet"
    ranked = causes(sched, service)
    if not ranked or (ranked[0].seconds < SIGNIFICANT_SECONDS
                      and ranked[0].seconds < SIGNIFICANT_SHARE * max(span.e2e, 1e-9)):
        return f"no significant scheduling delay (waited for a CPU {fmt_seconds(sched.delay_seconds)})"
    top = ranked[0]
    window = span.end - span.start
    share = f"{min(1.0, top.seconds / window):.0%} of {fmt_seconds(window)} end to end" if window > 0 else \
        "of a request of no measurable duration"
    advice = ""
    if top.kind == CPU_LIMIT_CAUSE:
        what = limit_words(limits or [])
        advice = "; raise or remove the limit, or give the service less work per CPU"
    elif top.kind == OWN_THREADS:
        what = f"run-queue wait behind its own threads ({service})"
        advice = "; it runs more runnable threads than the CPUs it gets"
    elif top.kind == NEIGHBOUR:
        what = f"CPU contention from {top.culprit}"
        advice = f"; give {service} more CPU weight (requests) than {top.culprit}, or keep them apart"
    elif top.kind == KERNEL_CAUSE:
        what = "kernel threads holding the CPU"
    elif top.kind == IDLE_CAUSE:
        what = "wake-up latency on idle CPUs"
    elif top.kind == "iowait":
        what = "I/O wait (D state)"
    else:
        what = "run-queue wait without a recorded culprit"
    lower = (f" (at least: the event stream dropped {sched.dropped_events} events meanwhile)"
             if sched.dropped_events else "")
    # A limit that held the request too, though less: named, since between
    # throttles a limited service also waits longer behind others, which its
    # neighbour's share carries (docs/api.md: beside a neighbour of twenty
    # times its weight, removing vLLM's limit took away up to a quarter more
    # than the limit's own share).
    limited = next((c for c in ranked[1:] if c.kind == CPU_LIMIT_CAUSE), None)
    also = ""
    if limited is not None and top.kind != CPU_LIMIT_CAUSE and (
            limited.seconds >= SIGNIFICANT_SECONDS or limited.seconds >= SIGNIFICANT_SHARE * window):
        also = f"; {limit_words(limits or [])} also held it {fmt_seconds(limited.seconds)}"
        if top.kind == NEIGHBOUR:
            also += (f", and between throttles it waits longer behind {top.culprit}: removing the limit "
                     "can take away more than that")
    return f"{what} added {fmt_seconds(top.seconds)}{lower} ({share}){advice}{also}"


def judge(span: RequestSpan, slos: Iterable[Slo], service: str | None) -> list[dict]:
    """The request SLOs of the service, as the REQUEST document lists them."""
    return [r.as_dict() for r in judge_request(span, slos, service)]


def request_document(span: RequestSpan, service: str | None, how: str, sched: RequestSched | None,
                     slo: list[dict], complete: bool, limits: list[dict] | None = None) -> dict:
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
        "sched": {**sched.as_dict(), "limits": limits or []} if sched is not None else None,
        "sched_resolution_seconds": sched.resolution_seconds if sched is not None else None,
        # False when the figures were taken before the kernel side covered the
        # whole request (the source fell behind), or the kernel's event stream
        # dropped events while it ran; they may then be low.
        "sched_complete": complete and sched is not None and not sched.dropped_events,
        "sched_dropped_events": sched.dropped_events if sched is not None else 0,
        "slo": slo,
        # who delayed the request the most, preempting its work or holding the CPU it woke up to
        "culprits": [{"service": c.culprit, "wait_seconds": c.seconds}
                     for c in (causes(sched, service) if sched is not None else []) if c.contention],
        "verdict": verdict(span, sched, service, limits),
    }
