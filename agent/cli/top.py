"""`slatrace top`: a live per-service table, refreshed every interval.

Each frame is one /api/v1/attribution call over the last `--since` seconds,
sorted by the chosen field (run-queue P99 by default). `--once` prints a single
frame and exits; when stdout is not a terminal nothing but plain text is
written (no cursor movement, no colours), so it can be piped or captured.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from rich.console import Console
from rich.live import Live
from rich.table import Table

from agent.cli.attribution_view import limit_text, slo_text, top_culprit
from agent.durations import fmt_seconds

__all__ = ["SORT_FIELDS", "frame", "run_top", "sort_records"]

# --sort FIELD -> key of an attribution record; larger first, except the name.
SORT_FIELDS: dict[str, Callable[[dict], object]] = {
    "p99": lambda r: r["runq"]["p99"] or 0.0,
    "p95": lambda r: r["runq"]["p95"] or 0.0,
    "p50": lambda r: r["runq"]["p50"] or 0.0,
    "wait": lambda r: r["runq"]["wait_seconds"],
    "runs": lambda r: r["runq"]["count"],
    "preemptions": lambda r: r["preemption"]["count"],
    "throttled": lambda r: r.get("throttled_seconds", 0.0),
    "iowait": lambda r: r["iowait"]["seconds"],
    "migrations": lambda r: r["migrations"],
    "service": lambda r: r["service"],
}


def sort_records(records: list[dict], field: str) -> list[dict]:
    return sorted(records, key=SORT_FIELDS[field], reverse=field != "service")


def frame(doc: dict, sort: str, since: float, agent: str) -> Table:
    records = sort_records(doc.get("attribution", []), sort)
    table = Table(title=f"slatrace top — {agent} — last {since:g} s, sorted by {sort} — "
                        f"{time.strftime('%H:%M:%S')}")
    for col in ("service", "p50", "p95", "p99", "runq wait", "top culprit", "throttled", "own limit", "iowait",
                "migr", "cause", "SLO"):
        table.add_column(col, justify="left" if col in ("service", "top culprit", "cause", "SLO") else "right",
                         overflow="fold")
    for r in records:
        runq = r["runq"]
        slo = slo_text(r)
        table.add_row(
            r["service"], fmt_seconds(runq["p50"]), fmt_seconds(runq["p95"]), fmt_seconds(runq["p99"]),
            fmt_seconds(runq["wait_seconds"]), top_culprit(r), fmt_seconds(r.get("throttled_seconds", 0.0)),
            limit_text(r), fmt_seconds(r["iowait"]["seconds"]), str(r["migrations"]),
            (r.get("blame") or {}).get("cause", "-"),
            f"[red]{slo}[/]" if slo.startswith("BREACH") else slo,
        )
    return table


def run_top(fetch: Callable[[float], dict], *, agent: str, sort: str, interval: float, since: float,
            once: bool, file: TextIO | None = None) -> int:
    """fetch(since) returns the attribution document; called once per frame."""
    out = file or sys.stdout
    if once or not out.isatty():
        # Not a terminal (or one frame asked for): plain frames, one after another.
        console = Console(file=out, highlight=False, soft_wrap=True, width=None if out.isatty() else 200)
        while True:
            console.print(frame(fetch(since), sort, since, agent))
            if once:
                return 0
            time.sleep(interval)
    console = Console(file=out, highlight=False)
    with Live(frame(fetch(since), sort, since, agent), console=console, auto_refresh=False,
              screen=False) as live:
        while True:
            time.sleep(interval)
            live.update(frame(fetch(since), sort, since, agent), refresh=True)
