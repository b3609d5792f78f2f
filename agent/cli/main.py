"""The `slatrace` command: the daemon (`run`), `check`, and thin API clients.

A command is its parser in build_parser(), its `cmd_*` (which fetches with
`client.get`) with the printing of its answer beside it, and its entry in
COMMANDS; the request commands are agent/cli/requests.py's, the attribution
views attribution_view.py's and top.py's. rich is imported only to print:
`slatrace run` never loads it."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from agent import __version__
from agent.cli.client import add_credential_flags, credentials_from, use_credentials
from agent.cli.errors import CliError
from agent.cli.requests import REQUEST_COMMANDS, add_request_commands
from agent.probe.cache import DEFAULT_DIR as DEFAULT_CACHE_DIR
from agent.probe.features import ATTACH_MODES
from agent.errors import SlatraceError

DEFAULT_AGENT = "http://127.0.0.1:9477"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="slatrace",
        description="eBPF agent that explains why a latency-sensitive service misses its SLA.",
    )
    p.add_argument("--version", action="version", version=f"slatrace {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    run = sub.add_parser("run", help="run the agent in the foreground")
    run.add_argument("--config", metavar="PATH", help="YAML config file (every key optional)")
    run.add_argument("--listen", default="127.0.0.1:9477", metavar="HOST:PORT",
                     help="HTTP address for /metrics, /api/v1, /livez, /readyz (default %(default)s)")
    run.add_argument("--otlp-grpc-listen", default="127.0.0.1:4317", metavar="HOST:PORT",
                     help="OTLP/gRPC trace receiver, 'off' to disable (default %(default)s)")
    run.add_argument("--otlp-http-listen", default="127.0.0.1:4318", metavar="HOST:PORT",
                     help="OTLP/HTTP trace receiver, 'off' to disable (default %(default)s)")
    run.add_argument("--interval", type=float, metavar="SECONDS", help="aggregation interval (default 1)")
    run.add_argument("--retention", type=float, metavar="SECONDS", help="history kept for the API (default 900)")
    run.add_argument("--otlp-endpoint", metavar="URL", default=os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"),
                     help="export OTLP metrics and enriched spans there (default $OTEL_EXPORTER_OTLP_ENDPOINT)")
    run.add_argument("--otlp-protocol", choices=["grpc", "http/protobuf"], default=None,
                     help="OTLP export protocol (default $OTEL_EXPORTER_OTLP_PROTOCOL, else grpc)")
    run.add_argument("--bpf-stats", default="sampled", choices=["sampled", "always", "off"],
                     help="per-program cost counters through BPF_ENABLE_STATS: 1 s a minute (default), "
                          "the whole run, or never; the host's kernel.bpf_stats_enabled is never written")
    run.add_argument("--attach-mode", choices=list(ATTACH_MODES), default=None,
                     help="tracepoints the BPF programs attach to: btf (BTF-typed, with task-local storage: the "
                          "cheapest; 5.11+), raw (needs the kernel's BTF), classic, or auto: the cheapest the "
                          "kernel allows (default: the config's attach_mode, else auto)")
    run.add_argument("--otlp-relay", action="append", metavar="KEY=VALUE[,...]",
                     help="a sender trusted to relay spans (an OpenTelemetry Collector): its spans' service comes "
                          "from the resource attributes it vouches for; keys service, cgroup (globs), pid, "
                          "k8s_namespace, k8s_service_account; repeatable; replaces the config's otlp_relays")
    run.add_argument("--web-config-file", metavar="FILE",
                     help="TLS, client certificates and basic auth for the API, /metrics and the OTLP receivers, "
                          "in node_exporter's --web.config.file format; re-read when its files change or on "
                          "SIGHUP (default: the config's web_config_file)")
    run.add_argument("--bpf-cache", default=str(DEFAULT_CACHE_DIR), metavar="DIR",
                     help="keep the compiled BPF programs in DIR, so that a restart on the same kernel loads them "
                          "without compiling (about a second sooner); 'off' compiles at every start "
                          "(default %(default)s)")
    run.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])

    check = sub.add_parser("check", help="test every prerequisite and say how to fix what fails")
    check.add_argument("--json", action="store_true", help="print the JSON document")

    services = sub.add_parser("services", help="list the services the agent sees")
    _client_flags(services)

    attr = sub.add_parser("attribution", help="per-service run-queue percentiles and who is to blame")
    attr.add_argument("service", nargs="?", help="one service (default: all)")
    attr.add_argument("--since", type=float, default=60.0, metavar="SECONDS", help="window (default %(default)s)")
    attr.add_argument("--prometheus", metavar="URL",
                      help="answer for every agent Prometheus scrapes, from that Prometheus server")
    _client_flags(attr)

    top = sub.add_parser("top", help="live per-service table: P99, top culprit, throttling, SLO status")
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    top.add_argument("--sort", default="p99", metavar="FIELD",
                     help="p99 (default), p95, p50, wait, runs, preemptions, throttled, iowait, migrations, service")
    top.add_argument("--interval", type=float, default=2.0, metavar="SECONDS",
                     help="refresh every SECONDS (default %(default)s)")
    top.add_argument("--since", type=float, default=10.0, metavar="SECONDS",
                     help="figures over the last SECONDS (default %(default)s)")
    top.add_argument("--agent", default=DEFAULT_AGENT, metavar="URL", help="agent address (default %(default)s)")
    add_credential_flags(top)
    add_request_commands(sub, _client_flags)
    return p


def _client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--agent", default=DEFAULT_AGENT, metavar="URL", help="agent address (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the API's JSON document")
    add_credential_flags(p)


def cmd_run(args: argparse.Namespace) -> int:
    # The BPF build process first: it imports BCC while this process imports
    # the agent and reads its config (agent/probe/build.py).
    from agent.probe.build import BuildProcess  # noqa: PLC0415

    builder = BuildProcess(bpf_cache_dir(args.bpf_cache))
    try:
        return _run(args, builder)
    finally:
        builder.cancel()   # a no-op once the build has answered


def bpf_cache_dir(value: str) -> Path | None:
    """--bpf-cache: a directory, or none for "off" (or empty)."""
    return None if value.strip().lower() in ("", "off") else Path(value)


def _run(args: argparse.Namespace, builder) -> int:
    # gRPC's C core logs its own copy of errors the agent reports in one
    # sentence (a port in use); keep stderr to that sentence unless asked.
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    from agent.config import Config, interval_problem, load_config, retention_problem  # noqa: PLC0415
    from agent.daemon import RunOptions, run  # noqa: PLC0415

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = {}
    if args.interval is not None:
        problem = interval_problem(args.interval)
        if problem:
            raise CliError(f"--interval {problem}")
        overrides["interval"] = args.interval
    if args.retention is not None:
        overrides["retention"] = args.retention
    if args.otlp_relay:
        from agent.config import relays_from_flags  # noqa: PLC0415
        overrides["otlp_relays"] = relays_from_flags(args.otlp_relay)
    if args.attach_mode is not None:
        overrides["attach_mode"] = args.attach_mode
    config = load_config(args.config) if args.config else Config()
    if overrides:
        from dataclasses import replace  # noqa: PLC0415
        config = replace(config, **overrides)
    # One check for both sources: a retention from the file can fall below a
    # longer --interval as surely as a bad --retention can.
    problem = retention_problem(config.retention, config.interval)
    if problem:
        where = "--retention" if args.retention is not None else f"retention in {args.config or 'the default config'}"
        raise CliError(f"{where} {problem}")
    options = RunOptions(listen=args.listen, otlp_grpc_listen=args.otlp_grpc_listen,
                         otlp_http_listen=args.otlp_http_listen, otlp_endpoint=args.otlp_endpoint,
                         otlp_protocol=args.otlp_protocol, config_path=args.config,
                         config_overrides=tuple(overrides.items()), bpf_stats=args.bpf_stats,
                         web_config_file=args.web_config_file,
                         bpf_cache=str(builder.cache_dir) if builder.cache_dir else None)
    return run(config, options, builder)


def cmd_check(args: argparse.Namespace) -> int:
    from agent.check import run_checks  # noqa: PLC0415

    checks = run_checks()
    ok = all(c.ok for c in checks)
    if args.json:
        print(json.dumps({"ok": ok, "checks": [c.as_dict() for c in checks]}, indent=2))
    else:
        print_checks(checks)
        if not ok:
            failed = next(c for c in checks if not c.ok)
            print(f"slatrace: {failed.detail}", file=sys.stderr)
    return 0 if ok else 1


def cmd_services(args: argparse.Namespace) -> int:
    from agent.cli.client import get  # noqa: PLC0415

    doc = get(args.agent, "/api/v1/services")
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print_services(doc)
    return 0


def print_checks(checks) -> None:
    from rich.table import Table  # noqa: PLC0415

    table = Table(title="slatrace prerequisites")
    table.add_column("check")
    table.add_column("ok")
    table.add_column("detail", overflow="fold")
    for c in checks:
        table.add_row(c.name, "[green]yes[/]" if c.ok else "[red]NO[/]", c.detail)
    _print(table)


def print_services(doc: dict) -> None:
    from rich.table import Table  # noqa: PLC0415

    table = Table()
    for col in ("service", "source", "tasks", "cgroups"):
        table.add_column(col, justify="right" if col == "tasks" else "left")
    for s in doc.get("services", []):
        table.add_row(s["name"], s["source"], str(s.get("tasks", "")), ", ".join(s.get("cgroups", [])))
    _print(table)


def _print(renderable) -> None:
    """A table on stdout; without a TTY, rich prints plain text."""
    from rich.console import Console  # noqa: PLC0415

    Console(highlight=False, soft_wrap=False).print(renderable)


def cmd_attribution(args: argparse.Namespace) -> int:
    from agent.cli.attribution_view import print_attribution  # noqa: PLC0415
    from agent.cli.client import get  # noqa: PLC0415

    if not args.since > 0:
        raise CliError(f"--since {args.since} must be a positive number of seconds")
    if args.prometheus:
        from agent.cli.prometheus_query import PrometheusError, PrometheusQuery, fleet_attribution  # noqa: PLC0415

        try:
            doc = fleet_attribution(PrometheusQuery(args.prometheus), args.since, service=args.service)
        except PrometheusError as e:
            raise CliError(str(e)) from None
    else:
        params = {"since": args.since}
        if args.service:
            params["service"] = args.service
        doc = get(args.agent, "/api/v1/attribution", params)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print_attribution(doc)
    return 0


def cmd_top(args: argparse.Namespace) -> int:
    from agent.cli.client import get  # noqa: PLC0415
    from agent.cli.top import SORT_FIELDS, run_top  # noqa: PLC0415

    if args.sort not in SORT_FIELDS:
        raise CliError(f"--sort {args.sort!r} is not a field; use one of {', '.join(SORT_FIELDS)}")
    for flag, value in (("--interval", args.interval), ("--since", args.since)):
        if not value > 0:
            raise CliError(f"{flag} {value} must be a positive number of seconds")
    return run_top(lambda since: get(args.agent, "/api/v1/attribution", {"since": since}), agent=args.agent,
                   sort=args.sort, interval=args.interval, since=args.since, once=args.once)


COMMANDS = {"run": cmd_run, "check": cmd_check, "services": cmd_services, "attribution": cmd_attribution,
            "top": cmd_top,
            **REQUEST_COMMANDS}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if hasattr(args, "ca_file"):
            use_credentials(credentials_from(args))
        return COMMANDS[args.command](args)
    except SlatraceError as e:
        print(f"slatrace: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
