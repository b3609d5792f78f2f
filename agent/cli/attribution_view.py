"""`slatrace attribution` as a table: one row per service, then each
service's one-sentence verdict (rich; plain text without a TTY)."""

from __future__ import annotations

import sys
from typing import TextIO

from rich.console import Console
from rich.table import Table

from agent.durations import fmt_seconds

__all__ = ["attribution_table", "limit_text", "print_attribution", "slo_text", "top_culprit"]


def top_culprit(record: dict) -> str:
    """The heaviest preemptor after throttling is taken out (blame), else the
    raw preemption list (records from older agents have no blame)."""
    culprits = (record.get("blame") or {}).get("culprits")
    if culprits:
        c = culprits[0]
        return f"{c['service']} ({fmt_seconds(c['seconds'])})"
    by = record["preemption"]["by"]
    return f"{by[0]['service']} ({fmt_seconds(by[0]['wait_seconds'])})" if by else "-"


def limit_text(record: dict) -> str:
    """The wait its own CPU limit held, and its share of the P99's tail."""
    limit = record.get("cpu_limit")
    if not limit or not limit["wait_seconds"]:
        return "-"
    tail = f" (P99 {limit['p99_share']:.0%})" if limit.get("p99_share") else ""
    return fmt_seconds(limit["wait_seconds"]) + tail


def slo_text(record: dict) -> str:
    slo = record.get("slo") or []
    if not slo:
        return "-"
    broken = [s["name"] for s in slo if not s["ok"]]
    return "BREACH " + ",".join(broken) if broken else "ok"


def attribution_table(doc: dict, title: str | None = None) -> Table:
    table = Table(title=title)
    for col in ("service", "runs", "wait", "p50", "p95", "p99", "preempted", "top culprit", "throttled",
                "own limit", "iowait", "migr", "cause", "SLO"):
        table.add_column(col, justify="left" if col in ("service", "top culprit", "cause", "SLO") else "right",
                         overflow="fold")
    for r in doc.get("attribution", []):
        runq = r["runq"]
        table.add_row(
            r["service"], str(runq["count"]), fmt_seconds(runq["wait_seconds"]), fmt_seconds(runq["p50"]),
            fmt_seconds(runq["p95"]), fmt_seconds(runq["p99"]), str(r["preemption"]["count"]), top_culprit(r),
            fmt_seconds(r.get("throttled_seconds", 0.0)), limit_text(r), fmt_seconds(r["iowait"]["seconds"]),
            str(r["migrations"]), (r.get("blame") or {}).get("cause", "-"), slo_text(r),
        )
    return table


def print_attribution(doc: dict, file: TextIO | None = None) -> None:
    out = file or sys.stdout
    console = Console(file=out, highlight=False, soft_wrap=True, width=None if out.isatty() else 200)
    console.print(attribution_table(doc))
    for r in doc.get("attribution", []):
        if r.get("verdict"):
            console.print(r["verdict"], markup=False)
