"""Terminal tables for the CLI (rich). Without a TTY, rich prints plain text."""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table


def _console() -> Console:
    return Console(highlight=False, soft_wrap=False)


def fmt_seconds(value: float | None) -> str:
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return "-"
    if value == 0:
        return "0"
    if value < 1e-3:
        return f"{value * 1e6:.0f}µs"
    if value < 1:
        return f"{value * 1e3:.2f}ms"
    return f"{value:.2f}s"


def print_checks(checks) -> None:
    table = Table(title="slatrace prerequisites")
    table.add_column("check")
    table.add_column("ok")
    table.add_column("detail", overflow="fold")
    for c in checks:
        table.add_row(c.name, "[green]yes[/]" if c.ok else "[red]NO[/]", c.detail)
    _console().print(table)


def print_services(doc: dict) -> None:
    table = Table()
    for col in ("service", "source", "tasks", "cgroups"):
        table.add_column(col, justify="right" if col == "tasks" else "left")
    for s in doc.get("services", []):
        table.add_row(s["name"], s["source"], str(s.get("tasks", "")), ", ".join(s.get("cgroups", [])))
    _console().print(table)


def print_attribution(doc: dict) -> None:
    table = Table()
    for col in ("service", "runs", "wait", "p50", "p95", "p99", "preempted", "top culprit", "iowait", "migr", "SLO"):
        table.add_column(col, justify="left" if col in ("service", "top culprit", "SLO") else "right")
    for r in doc.get("attribution", []):
        runq, pre = r["runq"], r["preemption"]
        culprit = pre["by"][0] if pre["by"] else None
        slo = r.get("slo") or []
        slo_text = "-" if not slo else ("ok" if all(s["ok"] for s in slo) else
                                        "BREACH " + ",".join(s["name"] for s in slo if not s["ok"]))
        table.add_row(
            r["service"], str(runq["count"]), fmt_seconds(runq["wait_seconds"]),
            fmt_seconds(runq["p50"]), fmt_seconds(runq["p95"]), fmt_seconds(runq["p99"]),
            str(pre["count"]),
            f"{culprit['service']} ({fmt_seconds(culprit['wait_seconds'])})" if culprit else "-",
            fmt_seconds(r["iowait"]["seconds"]), str(r["migrations"]), slo_text,
        )
    _console().print(table)
