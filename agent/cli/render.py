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
