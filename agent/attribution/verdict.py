"""The one-sentence verdict of a service record: its largest measured cause,
named with its share, in words an on-call engineer can act on."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agent.durations import fmt_seconds

__all__ = ["verdict"]


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
    tail = record.get("cpu_limit", {}).get("p99_share", 0.0)
    if tail >= 0.5:
        lead += f", {_pct(tail)} of the waits at or above it held by its own CPU limit"
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
        body = (f"starved by its own CPU limit, which held its threads {fmt_seconds(kinds['own_quota']['seconds'])} "
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
