"""`slatrace requests` and `slatrace explain`: per-request answers from the agent.

Thin clients of /api/v1/requests; `--json` prints the API's document as is.
`explain` adds a small timeline: the request's phases as vLLM reported them,
and what the scheduler took from its service while it ran.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import quote

from agent.cli.errors import CliError
from agent.durations import fmt_seconds

if TYPE_CHECKING:  # rich loads only to print: `slatrace run` registers these commands too
    from rich.console import Console
    from rich.text import Text

__all__ = ["add_request_commands", "REQUEST_COMMANDS", "timeline"]

BAR_WIDTH = 50


def add_request_commands(sub: argparse._SubParsersAction,
                         client_flags: Callable[[argparse.ArgumentParser], None]) -> None:
    reqs = sub.add_parser("requests", help="recent requests of services that send spans, with their verdicts")
    reqs.add_argument("--service", metavar="S", help="one service (default: all)")
    reqs.add_argument("--since", type=float, metavar="SECONDS", help="window (default: the agent's retention)")
    reqs.add_argument("--breached", action="store_true", help="only requests that broke a request SLO")
    client_flags(reqs)

    explain = sub.add_parser("explain", help="why one request was slow: figures and a timeline")
    explain.add_argument("request_id", metavar="REQUEST_ID")
    client_flags(explain)


def cmd_requests(args: argparse.Namespace) -> int:
    from agent.cli.client import get  # noqa: PLC0415

    params: dict = {}
    if args.since is not None:
        if not args.since > 0:
            raise CliError(f"--since {args.since} must be a positive number of seconds")
        params["since"] = args.since
    if args.service:
        params["service"] = args.service
    if args.breached:
        params["breached"] = "true"
    doc = get(args.agent, "/api/v1/requests", params)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print_requests(doc)
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from agent.cli.client import get  # noqa: PLC0415

    doc = get(args.agent, "/api/v1/requests/" + quote(args.request_id, safe=""))
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print_explain(doc)
    return 0


REQUEST_COMMANDS = {"requests": cmd_requests, "explain": cmd_explain}


def _console() -> Console:
    from rich.console import Console  # noqa: PLC0415

    return Console(highlight=False, soft_wrap=False)


def _slo_text(slo: list[dict]) -> str:
    if not slo:
        return "-"
    broken = [s["name"] for s in slo if not s["ok"]]
    return "BREACH " + ",".join(broken) if broken else "ok"


def print_requests(doc: dict) -> None:
    from rich.table import Table  # noqa: PLC0415

    table = Table()
    numbers = ("e2e", "ttft", "cpu delay", "thread-s", "preempt")
    for col in ("request", "service", "e2e", "ttft", "cpu delay", "thread-s", "preempt", "top cause", "SLO",
                "verdict"):
        table.add_column(col, justify="right" if col in numbers else "left", overflow="fold")
    for r in doc.get("requests", []):
        sched = r.get("sched") or {}
        by = r.get("culprits") or []
        first = (sched.get("delay_by") or [None])[0]
        top = (f"{by[0]['service']} ({fmt_seconds(by[0]['wait_seconds'])})" if by and (
            first is None or first.get("cause", "neighbour") in ("neighbour", "own_threads", "kernel"))
            else f"{cause_label(first, r['service']).strip()} ({fmt_seconds(first['seconds'])})" if first else "-")
        table.add_row(
            r["request_id"], r["service"], fmt_seconds(r.get("e2e")), fmt_seconds(r.get("ttft")),
            # "≥": the event stream dropped events while it ran, a lower bound
            ("≥" if r.get("sched_dropped_events") else "") + fmt_seconds(sched.get("delay_seconds")),
            fmt_seconds(sched.get("runq_thread_seconds")),
            str(sched.get("preemptions", "-")),
            top, _slo_text(r.get("slo") or []), r.get("verdict", ""),
        )
    _console().print(table)


def _bar(offset: float, length: float, total: float, style: str, width: int = BAR_WIDTH) -> Text:
    """A row of the timeline: `length` seconds starting `offset` seconds in."""
    from rich.text import Text  # noqa: PLC0415

    offset, length, total = _finite(offset), _finite(length), _finite(total)
    scale = width / total if total > 0 else 0.0
    start = min(width, int(round(offset * scale)))
    n = min(width - start, max(1 if length > 0 else 0, int(round(length * scale))))
    text = Text("·" * start)
    text.append("█" * n, style=style)
    text.append("·" * (width - start - n))
    return text


def _finite(value) -> float:
    """A drawable number: anything else (None, NaN, infinity, text) draws as 0."""
    return value if isinstance(value, (int, float)) and math.isfinite(value) else 0.0


# How explain names each cause of a delay_by[] entry (docs/api.md).
CAUSE_LABELS = {"cpu_limit": "  its own CPU limit", "own_threads": "  its own threads", "idle": "  idle CPU (wake-up)",
                "unknown": "  no culprit known", "kernel": "  kernel threads"}


def cause_label(by: dict, service: str | None) -> str:
    """A delay_by[] entry's row label; an agent that sends no cause is read by its service."""
    cause = by.get("cause")
    if cause is None:
        who = by["service"]
        cause = ("idle" if who == "idle" else "own_threads" if who == service
                 else "unknown" if who == "unknown" else "neighbour")
    return CAUSE_LABELS.get(cause, f"  {by['service']}")


def timeline(doc: dict, width: int = BAR_WIDTH) -> list[tuple[str, Text, str]]:
    """(label, bar, duration) rows: the request's phases, then how long its
    work waited for a CPU, by whom (drawn from the start: how much, not when)."""
    e2e = doc.get("e2e") or 0.0
    rows = [("end to end", _bar(0, e2e, e2e, "bold", width), fmt_seconds(e2e))]
    phases = doc.get("phases") or {}
    sched = doc.get("sched") or {}
    cut = {p["phase"]: p for p in sched.get("phases") or []}
    offset = 0.0
    for name in ("queue", "prefill", "decode"):
        value = phases.get(name)
        if value is None:
            continue
        rows.append((name, _bar(offset, value, e2e, "cyan", width), fmt_seconds(value)))
        waited = cut.get(name)
        if waited is not None and waited["delay_seconds"] > 0:
            # The phase's wait and its largest share, by name and seconds.
            top = waited["delay_by"][0] if waited["delay_by"] else None
            named = "its own CPU limit" if top and top.get("cause") == "cpu_limit" else top["service"] if top else ""
            rows.append(("  of it, CPU wait", _bar(offset, waited["delay_seconds"], e2e, "red", width),
                         fmt_seconds(waited["delay_seconds"])
                         + (f" ({named} {fmt_seconds(top['seconds'])})" if top else "")))
        offset += value
    ttft = doc.get("ttft")
    if ttft is not None:
        rows.append(("first token", _bar(0, ttft, e2e, "green", width), fmt_seconds(ttft)))
    if sched:
        delay = sched.get("delay_seconds")
        rows.append(("waited for a CPU", _bar(0, delay, e2e, "yellow", width), fmt_seconds(delay)))
    service = doc.get("service")
    for by in sched.get("delay_by") or []:
        rows.append((cause_label(by, service), _bar(0, by["seconds"], e2e, "red", width), fmt_seconds(by["seconds"])))
    if sched:
        if sched.get("iowait_seconds"):
            rows.append(("I/O wait", _bar(0, sched["iowait_seconds"], e2e, "magenta", width),
                         fmt_seconds(sched["iowait_seconds"])))
    return rows


def print_explain(doc: dict) -> None:
    from rich.table import Table  # noqa: PLC0415
    from rich.text import Text  # noqa: PLC0415

    console = _console()
    console.print(Text(f"request {doc['request_id']}  service {doc['service']}  trace {doc.get('trace_id', '')}",
                       style="bold"))
    console.print(Text(doc.get("verdict", ""), style="bold yellow"))
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column("what", no_wrap=True)
    table.add_column("timeline", no_wrap=True)
    table.add_column("seconds", justify="right", no_wrap=True)
    # The bar gives way on a narrow terminal (or a pipe's 80 columns): labels and figures stay whole.
    for label, bar, duration in timeline(doc, width=max(20, min(BAR_WIDTH, console.width - 44))):
        table.add_row(label, bar, duration)
    console.print(table)
    sched = doc.get("sched")
    if sched:
        console.print(f"run-queue wait of all its threads {fmt_seconds(sched.get('runq_thread_seconds'))} "
                      "(thread-seconds)   "
                      f"preemptions {sched['preemptions']}   migrations {sched['migrations']}   "
                      f"iowait {fmt_seconds(sched['iowait_seconds'])}   "
                      f"resolution {fmt_seconds(doc.get('sched_resolution_seconds'))}"
                      + ("" if doc.get("sched_complete", True) else "   (figures incomplete)"))
        for limit in sched.get("limits") or []:
            console.print(f"CPU limit: {limit['setting']} ({limit['cpus']:.3g} CPU) on {limit['cgroup']}"
                          + (f", the {limit['level']}'s cgroup" if limit["level"] != "cgroup" else ""))
        if doc.get("sched_dropped_events"):
            console.print(f"[yellow]a lower bound: the kernel's event stream dropped {doc['sched_dropped_events']} "
                          "events while this request ran (its rate limit: raise event_rate in the config "
                          "file)[/]")
        threads = sched.get("by_thread") or []
        if threads:
            where = Table(title="run-queue wait by process and thread", title_justify="left", box=None,
                          pad_edge=False)
            for column in ("process", "pid", "thread", "wait"):
                where.add_column(column, justify="right" if column in ("pid", "wait") else "left")
            for t in threads:
                where.add_row(t["process"], str(t["pid"]), t["thread"], fmt_seconds(t["wait_seconds"]))
            console.print(where)
    for s in doc.get("slo") or []:
        state = "[green]ok[/]" if s["ok"] else "[red]BREACH[/]"
        console.print(f"SLO {s['name']}: {fmt_seconds(s.get('value'))} vs target {fmt_seconds(s['target'])} {state}")
