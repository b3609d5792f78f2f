"""Terminal tables for the CLI (rich). Without a TTY, rich prints plain text."""

from __future__ import annotations


from rich.console import Console
from rich.table import Table



def _console() -> Console:
    return Console(highlight=False, soft_wrap=False)


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
