"""`make bench`: slatrace's cost against bcc's runqlat-bpfcc, and the agent at
scale, in one bounded run.

1. Both tools attached at once over the same workload runs: the kernel's
   per-program counters (kernel.bpf_stats_enabled) give ns per sched_switch
   and per wakeup for each, on exactly the same events.
2. Interleaved rounds of none / slatrace / runqlat / floor (order rotated
   each round) over the same workloads: throughput medians and ratios to
   "none", each tool's in-kernel cost alone and its slowdown over the
   floor's (empty programs on slatrace's tracepoints, bench/floor.py),
   slatrace's start-up time, RSS and poll time.
3. Scale (bench/scale.py): the agent beside 10 / 100 / 1,000 busy services
   and beside cgroup churn: CPU, memory, poll time, /metrics size, BPF map
   entries and errors, with PNG plots.
4. The raw results go to bench-results/bench-<timestamp>.json; a Markdown
   summary is printed and written into BENCHMARKS.md between markers.

The VM is noisy, so everything is compared as medians and ratios of runs
interleaved in time, never as one absolute number.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import hashlib
import json
import math
import os
import platform
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import bpfstats, fleet, mapmem, plots, report, resample, scale, toggle, workloads
from bench.bpfstats import BpfStatsSwitch, Counter
from bench.tools import RUNQLAT, Floor, Runqlat, Slatrace, Tool
from tests.support.scale import compile_worker

ROOT = Path(__file__).resolve().parent.parent
# The floor (bench/floor.py): empty programs on slatrace's tracepoints, what
# any tool there costs before doing anything; each tool's cost is also given
# as a ratio to it.
CONFIGS = ("none", "slatrace", "runqlat", "floor")
TOOLS = {"slatrace": Slatrace, "runqlat": Runqlat, "floor": Floor}
PEERS = ("slatrace", "runqlat")
SETTLE_S = 0.5          # after attach/detach, so start-up and teardown stay out of the workload
COST_RATIO_LIMIT = 1.5  # slatrace ns per scheduler event / runqlat's
# Total cost (the workload's slowdown per context switch), slatrace / runqlat.
# Judged on the pinned workloads (tasks one at a time on one CPU): their
# slowdown is the tools' cost. Unpinned hackbench's wall time on a shared VM
# moves by more than the tools cost; it is shown, not judged.
TOTAL_COST_LIMITS = {"pipe (pinned)": 0.9, "hackbench (pinned)": 1.0, "ring (pinned)": 1.0}
# A judged ratio passes when its whole 95% interval (bootstrap over rounds) is
# within the limit and fails when the whole interval is beyond it; an
# interval across the limit is reported as not resolved by this run.
STARTUP_LIMIT_S = 1.5
RSS_LIMIT = 64 << 20
# The pinned layout: the pipe on one CPU, the tools' processes on another.
PIPE_CPU, TOOL_CPU = 1, 0
REQUIRED = ("hackbench", "perf", "bpftool", RUNQLAT)
SECTIONS = ("cost", "scale", "fleet")
PLOTS_DIR = ROOT / "docs" / "bench"


class Progress:
    """Timestamped progress lines: an operator is waiting on this."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def __call__(self, msg: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {msg}", flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5, --quick 2)")
    p.add_argument("--quick", action="store_true", help="fewer rounds and shorter workloads: a smoke test")
    p.add_argument("--hackbench-groups", type=int, default=4)
    p.add_argument("--hackbench-loops", type=int, default=None, help="default 1000 (--quick 400)")
    p.add_argument("--pipe-loops", type=int, default=None,
                   help="perf bench sched pipe -l (default 300000, --quick 100000)")
    p.add_argument("--workloads", default=None, metavar="NAME,...",
                   help="run only these: hackbench, pipe-pinned, hackbench-pinned, ring-pinned (default all; "
                        "e.g. many rounds of one noisy workload)")
    p.add_argument("--repeat", type=int, default=None,
                   help="runs of each pinned workload per tool start in the rounds, their median kept: fewer "
                        "outliers for the judged ratios (default 3, --quick 1)")
    p.add_argument("--ring-tasks", type=int, default=160, help="tasks in the token ring (default %(default)s)")
    p.add_argument("--ring-laps", type=int, default=None,
                   help="laps of the token round the ring (default 1000, --quick 300)")
    p.add_argument("--toggle-seconds", type=float, default=None, metavar="SECONDS",
                   help="after the rounds, each tool attached in turn for 50 ms windows within one long pinned "
                        "run per workload (bench/toggle.py), this long each; 0 to skip (default 240, --quick 20)")
    p.add_argument("--toggle-workloads", default=",".join(toggle.WORKLOADS), metavar="NAME,...",
                   help="workloads of the toggled measurement (default %(default)s)")
    p.add_argument("--budget", type=float, default=400.0, metavar="SECONDS",
                   help="start no round that would end after this (default %(default)s)")
    md = p.add_mutually_exclusive_group()
    md.add_argument("--write-md", dest="write_md", action="store_true", default=None,
                    help="update BENCHMARKS.md (the default, except with --quick)")
    md.add_argument("--no-write-md", dest="write_md", action="store_false")
    p.add_argument("--check-targets", action="store_true", help="exit 1 when a target is missed")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help=f"don't pin perf bench sched pipe to CPU {PIPE_CPU} and the tools to CPU {TOOL_CPU}")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help="comma-separated: cost (against runqlat), scale (many services, churn), fleet (a real "
                        "Prometheus scraping many nodes); default all")
    p.add_argument("--scale-services", default=None, metavar="N,N,...",
                   help="service counts of the scale section (default 10,100,1000, --quick 10,100)")
    p.add_argument("--scale-seconds", type=float, default=None,
                   help="measured window per service count (default 30, --quick 10)")
    p.add_argument("--churn-seconds", type=float, default=None,
                   help="how long the churn creates cgroups, 0 to skip it (default 60, --quick 15)")
    p.add_argument("--scale-load", type=float, default=0.6, metavar="CPUS",
                   help="CPUs the scale workload asks for in total (default %(default)s)")
    p.add_argument("--fleet-nodes", default=None, metavar="N,N,...",
                   help="node counts of the fleet section (default 100,300,1000, --quick 20,50)")
    p.add_argument("--fleet-services", type=int, default=20, metavar="N",
                   help="services per node in the fleet section (default %(default)s)")
    p.add_argument("--fleet-warm", type=float, default=None, metavar="SECONDS",
                   help="seconds before the fleet figures are read (default 330: the rules' 5 m windows full; "
                        "--quick 60)")
    args = p.parse_args(argv)
    args.rounds = args.rounds if args.rounds is not None else (2 if args.quick else 5)
    args.hackbench_loops = args.hackbench_loops or (400 if args.quick else 1000)
    args.pipe_loops = args.pipe_loops or (100000 if args.quick else 300000)
    args.ring_laps = args.ring_laps or (300 if args.quick else 1000)
    args.repeat = args.repeat or (1 if args.quick else 3)
    args.toggle_seconds = args.toggle_seconds if args.toggle_seconds is not None else (20 if args.quick else 240)
    args.toggle_workloads = [x.strip() for x in args.toggle_workloads.split(",") if x.strip()]
    if any(w not in toggle.WORKLOADS for w in args.toggle_workloads) or args.toggle_seconds < 0:
        p.error(f"--toggle-workloads: expected some of {', '.join(toggle.WORKLOADS)}; "
                "--toggle-seconds must not be negative")
    args.workloads = [x.strip() for x in args.workloads.split(",") if x.strip()] if args.workloads else None
    if args.ring_tasks < 2 or args.ring_laps < 1 or args.repeat < 1:
        p.error("--ring-tasks must be at least 2, --ring-laps and --repeat at least 1")
    args.write_md = (not args.quick) if args.write_md is None else args.write_md
    args.pin = args.pin and len(os.sched_getaffinity(0)) >= 2
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    args.sections = [x.strip() for x in args.sections.split(",") if x.strip()]
    unknown = [x for x in args.sections if x not in SECTIONS]
    if unknown or not args.sections:
        p.error(f"--sections: expected some of {', '.join(SECTIONS)}, got {', '.join(unknown) or 'nothing'}")
    try:
        args.scale_services = [int(x) for x in (args.scale_services or ("10,100" if args.quick else
                                                                       "10,100,1000")).split(",") if x]
    except ValueError:
        p.error("--scale-services: expected whole numbers separated by commas, e.g. 10,100,1000")
    if any(n < 1 or n > 5000 for n in args.scale_services):
        p.error("--scale-services: each count must be between 1 and 5000")
    try:
        args.fleet_nodes = [int(x) for x in (args.fleet_nodes or ("20,50" if args.quick else "100,300,1000"))
                            .split(",") if x]
    except ValueError:
        p.error("--fleet-nodes: expected whole numbers separated by commas, e.g. 100,300,1000")
    if any(n < 1 or n > 5000 for n in args.fleet_nodes) or not 1 <= args.fleet_services <= 65:
        p.error("--fleet-nodes: each count between 1 and 5000; --fleet-services between 1 and 65")
    args.fleet_warm = args.fleet_warm if args.fleet_warm is not None else (60.0 if args.quick else fleet.WARM_S)
    args.scale_seconds = args.scale_seconds if args.scale_seconds is not None else (10.0 if args.quick else 30.0)
    args.churn_seconds = args.churn_seconds if args.churn_seconds is not None else (15.0 if args.quick else 60.0)
    if args.scale_seconds <= 0 or args.churn_seconds < 0 or args.scale_load <= 0:
        p.error("--scale-seconds and --scale-load must be positive, --churn-seconds at least 0")
    return args


def preflight(sections: list[str]) -> None:
    kernel = {"cost", "scale"} & set(sections)
    if kernel and os.geteuid() != 0:
        raise SystemExit("bench: run as root (loading BPF and kernel.bpf_stats_enabled need it): sudo make bench")
    required = REQUIRED if "cost" in sections else ("bpftool",) if kernel else ()
    required += ("cc",) if kernel else ()
    required += ("prometheus",) if "fleet" in sections else ()
    missing = [t for t in required if shutil.which(t) is None]
    if missing:
        raise SystemExit(f"bench: {', '.join(missing)} not found: run 'make setup-test' (installs rt-tests, "
                         "linux-perf, bpftool, bpfcc-tools, gcc, prometheus)")
    if kernel and not bpfstats.BPF_STATS.exists():
        raise SystemExit(f"bench: {bpfstats.BPF_STATS} is missing: this kernel cannot report BPF program costs")


def command_line(argv: list[str]) -> str:
    """How this run was started, as an operator would retype it."""
    if os.environ.get("MAKELEVEL"):
        return "make bench" + (f" ARGS={shlex.quote(shlex.join(argv))}" if argv else "")
    return shlex.join([".venv/bin/python", "-m", "bench.run", *argv])


def machine(argv: list[str]) -> dict[str, Any]:
    src = ROOT / "bpf" / "sched.bpf.c"
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip() or "unknown"
        # Others may be editing the probe: say when what ran is not the commit.
        status = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "bpf", "agent"],
                                capture_output=True, text=True, timeout=10).stdout
        commit += dirty_note([line[3:] for line in status.splitlines() if len(line) > 3])
    except (OSError, subprocess.TimeoutExpired):
        commit = "unknown"
    return {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "kernel": platform.release(),
        "nproc": os.cpu_count(),
        "possible_cpus": mapmem.possible_cpus(),
        "commit": commit,
        "bpf_source_sha256": hashlib.sha256(src.read_bytes()).hexdigest()[:12] if src.exists() else "missing",
        "command": command_line(argv),
    }


def dirty_note(paths: list[str]) -> str:
    """" + uncommitted bpf/sched.bpf.c, 3 files under agent/" or ""."""
    if not paths:
        return ""
    bpf = sorted(p for p in paths if p.startswith("bpf/"))
    others = len(paths) - len(bpf)
    parts = bpf + ([f"{others} file(s) under agent/"] if others else [])
    return " + uncommitted " + ", ".join(parts)


def counters_json(c: dict[str, Counter]) -> dict[str, dict[str, int]]:
    return {tp: {"run_cnt": v.run_cnt, "run_time_ns": v.run_time_ns} for tp, v in sorted(c.items())}


def spread(values: list[float]) -> dict[str, Any]:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"values": [], "median": None, "min": None, "max": None}
    return {"values": vals, "median": statistics.median(vals), "min": min(vals), "max": max(vals)}


class Bench:
    def __init__(self, args: argparse.Namespace, stats: BpfStatsSwitch, logdir: Path, progress: Progress) -> None:
        self.args = args
        self.stats = stats
        self.logdir = logdir
        self.progress = progress
        self.running: list[Tool] = []
        self.tool_cpu = TOOL_CPU if args.pin else None
        pin = PIPE_CPU if args.pin else None
        self.workloads = (workloads.hackbench(args.hackbench_groups, args.hackbench_loops),
                          workloads.pipe(args.pipe_loops, pin))
        if args.pin:
            self.workloads += (workloads.hackbench(args.hackbench_groups, args.hackbench_loops * 3 // 10, pin),
                               workloads.ring(compile_worker(logdir, workloads.RING_SOURCE), args.ring_tasks,
                                              args.ring_laps, pin))
        if args.workloads:
            known = {w.slug for w in self.workloads}
            unknown = sorted(set(args.workloads) - known)
            if unknown:
                raise SystemExit(f"bench: --workloads: no workload {', '.join(unknown)} in this layout "
                                 f"(have {', '.join(sorted(known))})")
            self.workloads = tuple(w for w in self.workloads if w.slug in args.workloads)
        self.notes: list[str] = []
        self._starts = 0
        self.cpu: dict[str, float] = {}   # CPU seconds of each workload in the last measure()

    # -- tools ---------------------------------------------------------------
    def start(self, name: str) -> Tool:
        self._starts += 1
        tool = TOOLS[name].start(self.logdir / f"{name}-{self._starts}.log", self.tool_cpu)
        self.running.append(tool)
        tool.wait_ready()
        return tool

    def stop(self, tool: Tool) -> None:
        tool.stop()
        if tool in self.running:
            self.running.remove(tool)

    def stop_all(self) -> None:
        for tool in list(self.running):
            try:
                self.stop(tool)
            except Exception as e:  # noqa: BLE001  (keep stopping the others)
                print(f"bench: stopping {tool.name} (pid {tool.pid}) failed: {e}", file=sys.stderr)

    # -- measurement ---------------------------------------------------------
    def measure(self, tools: list[Tool], repeat: int = 1
                ) -> tuple[dict[str, float], dict[str, dict[str, dict[str, Counter]]], dict[str, int]]:
        """Run every workload (the pinned ones `repeat` times); per workload
        its median result, each tool's program-counter deltas summed over
        exactly those runs, and the host's median context switches in a run."""
        results: dict[str, float] = {}
        deltas: dict[str, dict[str, dict[str, Counter]]] = {}
        switches: dict[str, int] = {}
        self.cpu = {}
        for w in self.workloads:
            self.stats.ensure()
            before = {t.name: t.counters.read() for t in tools}
            runs, cpus, ctxts = [], [], []
            for _ in range(repeat if w.pinned else 1):
                ctxt = workloads.context_switches()
                result, cpu = w.run_timed()
                ctxts.append(workloads.context_switches() - ctxt)
                runs.append(result)
                cpus.append(cpu)
            results[w.name], self.cpu[w.name] = statistics.median(runs), statistics.median(cpus)
            switches[w.name] = round(statistics.median(ctxts))
            after = {t.name: t.counters.read() for t in tools}
            deltas[w.name] = {t.name: bpfstats.delta(after[t.name], before[t.name]) for t in tools}
        return results, deltas, switches

    def describe(self, results: dict[str, float]) -> str:
        return ", ".join(f"{w.name} {results[w.name]:.3f} {w.unit}" for w in self.workloads)

    def warm_up(self) -> None:
        self.progress("warm-up: one unrecorded run of each workload")
        for w in self.workloads:
            w.run()

    def together(self) -> dict[str, Any]:
        reps = 2 if self.args.quick else 3
        self.progress("both tools attached: starting slatrace")
        sla = self.start("slatrace")
        maps = bpfstats.process_maps(sla.pid)
        self.progress(f"slatrace ready in {sla.ready_seconds:.2f} s; starting runqlat-bpfcc")
        rq = self.start("runqlat")
        self.progress(f"runqlat attached in {rq.ready_seconds:.2f} s")
        time.sleep(SETTLE_S)
        windows = []
        totals: dict[str, dict[str, dict[str, Counter]]] = {}
        for rep in range(reps):
            results, deltas, _ = self.measure([sla, rq])
            for w, by_tool in deltas.items():
                windows.append({"rep": rep, "workload": w, "result": results[w],
                                **{t: counters_json(c) for t, c in by_tool.items()}})
                for t, c in by_tool.items():
                    totals.setdefault(w, {}).setdefault(t, {})
                    totals[w][t] = bpfstats.add(totals[w][t], c)
            s, r = (bpfstats.cost_summary(functools.reduce(bpfstats.add, (d[t] for d in deltas.values())))
                    for t in ("slatrace", "runqlat"))
            self.progress(f"both attached, repetition {rep + 1}/{reps}: {self.describe(results)}; ns/event "
                          f"slatrace {report._ns(s['event_ns'])}, runqlat {report._ns(r['event_ns'])}")
        self.stop(rq)
        self.stop(sla)
        time.sleep(SETTLE_S)
        return {"reps": reps, "windows": windows, "summary": summarize(totals), "maps": maps}

    def one_config(self, config: str, rnd: int) -> dict[str, Any]:
        rec: dict[str, Any] = {"round": rnd, "config": config}
        tool = None
        if config != "none":
            tool = self.start(config)
            rec["ready_s"] = tool.ready_seconds
            if isinstance(tool, Slatrace):
                rec["attach_s"] = tool.attach_seconds()
            time.sleep(SETTLE_S)
            cpu0 = tool.cpu_seconds()
        results, deltas, switches = self.measure([tool] if tool else [], self.args.repeat)
        rec["workloads"] = results
        rec["switches"] = switches
        rec["workload_cpu_s"] = dict(self.cpu)
        if tool:
            rec["cpu_s"] = tool.cpu_seconds() - cpu0
            rec["counters"] = {w: counters_json(by_tool[config]) for w, by_tool in deltas.items()}
            rec["_deltas"] = {w: by_tool[config] for w, by_tool in deltas.items()}
            if isinstance(tool, Slatrace):
                rec["rss_bytes"], rec["uss_bytes"] = tool.memory()
                rec["poll_s"] = tool.metric("slatrace_poll_duration_seconds")
            self.stop(tool)
            time.sleep(SETTLE_S)
        msg = self.describe(results)
        if tool:
            msg = f"ready in {rec['ready_s']:.2f} s; " + msg
        if "rss_bytes" in rec:
            msg += f"; RSS {rec['rss_bytes'] / mapmem.MIB:.0f} MiB, poll {rec['poll_s'] * 1e3:.1f} ms" \
                if rec["poll_s"] is not None else f"; RSS {rec['rss_bytes'] / mapmem.MIB:.0f} MiB"
        self.progress(f"round {rnd + 1}/{self.args.rounds} {config:8s}: {msg}")
        return rec

    def rounds(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        longest = 0.0
        for rnd in range(self.args.rounds):
            if out and self.progress.elapsed() + longest > self.args.budget:
                self.notes.append(f"stopped after {rnd} of {self.args.rounds} rounds to stay within the "
                                  f"{self.args.budget:.0f} s budget (--budget)")
                self.progress(self.notes[-1])
                break
            t0 = time.monotonic()
            order = CONFIGS[rnd % len(CONFIGS):] + CONFIGS[:rnd % len(CONFIGS)]
            for config in order:
                out.append(self.one_config(config, rnd))
            longest = max(longest, time.monotonic() - t0)
        return out


def summarize(totals: dict[str, dict[str, dict[str, Counter]]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Cost per workload and over all workloads, per tool, from summed deltas
    (sums, not a mean of ratios, so a short window weighs what it measured)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    overall: dict[str, dict[str, Counter]] = {}
    for w, by_tool in totals.items():
        out[w] = {}
        for t, c in by_tool.items():
            out[w][t] = bpfstats.cost_summary(c)
            overall[t] = bpfstats.add(overall.get(t, {}), c)
    out["all"] = {t: bpfstats.cost_summary(c) for t, c in overall.items()}
    return out


def throughput(records: list[dict[str, Any]], names: list[str]) -> dict[str, dict[str, dict[str, Any]]]:
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for config in CONFIGS:
        out[config] = {}
        for w in names:
            out[config][w] = spread([r["workloads"][w] for r in records if r["config"] == config])
    for config in CONFIGS:
        for w in names:
            base, med = out["none"][w]["median"], out[config][w]["median"]
            out[config][w]["ratio"] = med / base if base and med is not None else None
    return out


def total_cost(records: list[dict[str, Any]], bench_workloads: tuple[workloads.Workload, ...]
               ) -> dict[str, dict[str, Any]]:
    """Per workload, what each tool adds to it per context switch, over the
    median number of switches a run with no tool makes:

    - wall: the slowdown against the run with no tool of the same round
      (median over rounds).
      For the pinned pipe (one CPU, one task at a time) that is the cost of a
      switch; hackbench's wall time on a shared VM moves by more than the
      tools cost.
    - cpu: the added CPU time (user + system of all its processes), paired
      the same way: what the tool made the traced tasks pay, on every CPU.
    """
    out: dict[str, dict[str, Any]] = {}
    for w in bench_workloads:
        switches = statistics.median([r["switches"][w.name] for r in records if r["config"] == "none"] or [0])
        entry: dict[str, Any] = {"switches": switches}
        for kind, key, ns_per_unit in (("wall", "workloads", w.ns_per_unit), ("cpu", "workload_cpu_s", 1e9)):
            # Paired within each round (the host drifts over a run by more than
            # a tool costs), then the median over rounds.
            by_round: dict[int, dict[str, float]] = {}
            for r in records:
                by_round.setdefault(r["round"], {})[r["config"]] = r[key][w.name]
            rounds = [v for v in by_round.values() if all(c in v for c in ("none", *PEERS))]
            tools = [c for c in CONFIGS[1:] if all(c in v for v in rounds)]
            diffs = {c: [v[c] - v["none"] for v in rounds] for c in tools}
            added = {c: statistics.median(d) * ns_per_unit / switches if d and switches else None
                     for c, d in diffs.items()}

            def measurable(c: str) -> bool:
                # below the noise a ratio of two differences means nothing
                return added.get(c) is not None and math.isfinite(added[c]) and added[c] > 0

            ok = all(measurable(c) for c in PEERS)
            entry[kind] = {"added_ns_per_switch": added, "rounds": len(rounds),
                           "ratio": added["slatrace"] / added["runqlat"] if ok else None,
                           "ratio_95": ratio_interval(diffs["slatrace"], diffs["runqlat"]) if ok else None,
                           # each tool's slowdown over the floor's, from the same rounds
                           "floor_ratio": {c: added[c] / added["floor"] if measurable(c) and measurable("floor")
                                           else None for c in PEERS if "floor" in added},
                           "floor_ratio_95": {c: ratio_interval(diffs[c], diffs["floor"])
                                              if measurable(c) and measurable("floor") else None
                                              for c in PEERS if "floor" in added}}
        entry["judged"] = "wall" if w.name in TOTAL_COST_LIMITS else None
        out[w.name] = entry
    return out


def ratio_interval(sla: list[float], rq: list[float]) -> list[float] | None:
    """95% interval of median(sla) / median(rq), the rounds' paired slowdowns,
    resampling whole rounds; None from fewer than 3 rounds or when runqlat's
    slowdown is within the noise."""
    if len(sla) < 3:
        return None
    idx = range(len(sla))

    def draw(rng: random.Random) -> tuple[float, float]:
        pick = rng.choices(idx, k=len(sla))
        return statistics.median(sla[i] for i in pick), statistics.median(rq[i] for i in pick)

    return resample.ratio_interval(draw)


def judge(ratio: float | None, interval: list[float] | None, limit: float, samples: int = 0) -> bool | None:
    """PASS when the interval is within the limit, FAIL when beyond it, else
    not resolved (None). With no interval from fewer than 3 samples (rounds)
    the median decides; from more, no interval means runqlat's slowdown was
    within the noise: not resolved either."""
    if ratio is None:
        return None
    if interval is None:
        return ratio <= limit if samples < 3 else None
    if interval[1] <= limit:
        return True
    return False if interval[0] > limit else None


def cost_target(name: str, ratio: float | None, interval: list[float] | None, limit: float,
                samples: int = 0) -> dict[str, Any]:
    """A total-cost ratio judged on its interval (judge())."""
    return {"name": name, "measured": report._ratio(ratio) + report.interval(interval, "95%: "),
            "limit": f"≤ {limit}x", "value": ratio, "interval": interval,
            "pass": judge(ratio, interval, limit, samples)}


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for w, limit in TOTAL_COST_LIMITS.items():
        if w not in res["total_cost"]:
            continue      # not run (--workloads)
        wall = res["total_cost"][w].get("wall", {})
        out.append(cost_target(f"added cost per context switch on {w} (its slowdown), slatrace / runqlat",
                               wall.get("ratio"), wall.get("ratio_95"), limit, wall.get("rounds", 0)))
    for w, m in res.get("toggle", {}).items():
        out.append(cost_target(f"added cost per context switch on {w} (pinned), tools toggled within one run, "
                               "slatrace / runqlat", m["ratio"], m["ratio_95"], TOTAL_COST_LIMITS[f"{w} (pinned)"]))
    s = res["together"]["summary"].get("all", {})
    ratio = None
    if s.get("slatrace", {}).get("event_ns") and s.get("runqlat", {}).get("event_ns"):
        ratio = s["slatrace"]["event_ns"] / s["runqlat"]["event_ns"]
    out.append({"name": "in-kernel cost per scheduler event, slatrace / runqlat (both attached)",
                "measured": report._ratio(ratio), "limit": f"≤ {COST_RATIO_LIMIT}x", "value": ratio,
                "pass": None if ratio is None else ratio <= COST_RATIO_LIMIT})
    worst = None
    for w, by_tool in res["together"]["summary"].items():
        sl, rq = by_tool.get("slatrace", {}).get("event_ns"), by_tool.get("runqlat", {}).get("event_ns")
        if w != "all" and sl and rq and (worst is None or sl / rq > worst[1]):
            worst = (w, sl / rq)
    out.append({"name": "same, on the worst single workload" + (f" ({worst[0]})" if worst else ""),
                "measured": report._ratio(worst[1] if worst else None), "limit": f"≤ {COST_RATIO_LIMIT}x",
                "value": worst[1] if worst else None,
                "pass": None if worst is None else worst[1] <= COST_RATIO_LIMIT})
    ready = res["slatrace"]["ready_s"]["median"]
    out.append({"name": "slatrace start-up to ready (median)", "measured": report._num(ready, "{:.2f} s"),
                "limit": f"≤ {STARTUP_LIMIT_S:.1f} s", "value": ready,
                "pass": None if ready is None else ready <= STARTUP_LIMIT_S})
    rss = res["slatrace"]["rss_bytes"]["median"]
    out.append({"name": "slatrace RSS after the workloads (median)",
                "measured": report._num(rss / mapmem.MIB if rss else None, "{:.1f} MiB"),
                "limit": f"≤ {RSS_LIMIT / mapmem.MIB:.0f} MiB", "value": rss,
                "pass": None if rss is None else rss <= RSS_LIMIT})
    mem = res["memory"].get("bytes_64")
    out.append({"name": "BPF map memory on a 64-CPU host (formula)",
                "measured": report._num(mem / mapmem.MIB if mem else None, "{:.1f} MiB"),
                "limit": "≤ 64 MiB", "value": mem, "pass": None if not mem else mem <= mapmem.MEMORY_LIMIT_64})
    return out


def run(args: argparse.Namespace, argv: list[str], progress: Progress) -> dict[str, Any]:
    res: dict[str, Any] = {"machine": machine(argv), "sections": args.sections}
    if "cost" in args.sections:
        res.update(run_cost(args, res["machine"]["possible_cpus"], progress))
    if "scale" in args.sections:
        res["scale"] = run_scale(args, progress)
    if "fleet" in args.sections:
        res["fleet"] = fleet.run(args.fleet_nodes, args.fleet_services, progress, warm_s=args.fleet_warm)
        progress("fleet section done; no Prometheus or node server left")
    res["elapsed_s"] = progress.elapsed()
    return res


def run_scale(args: argparse.Namespace, progress: Progress) -> dict[str, Any]:
    logdir = Path(tempfile.mkdtemp(prefix="slatrace-bench-scale-"))
    ok = False
    try:
        pts = scale.points(args.scale_services, args.scale_seconds, args.churn_seconds, warmup_s=10.0)
        out = scale.run(pts, logdir, args.scale_load, sample_s=5.0, progress=progress)
        ok = True
    finally:
        if ok:
            shutil.rmtree(logdir, ignore_errors=True)
        else:
            print(f"bench: the agent's logs are kept in {logdir}", file=sys.stderr)
    progress("scale section done; no agent, worker or cgroup left")
    return out


def run_cost(args: argparse.Namespace, possible: int, progress: Progress) -> dict[str, Any]:
    stats = BpfStatsSwitch()
    logdir = Path(tempfile.mkdtemp(prefix="slatrace-bench-"))
    bench = Bench(args, stats, logdir, progress)
    res: dict[str, Any] = {}
    ok = False
    stats.enable()
    try:
        progress(f"kernel.bpf_stats_enabled=1 (was {stats.previous}); {args.rounds} rounds, "
                 f"workloads: {' | '.join(' '.join(w.cmd) for w in bench.workloads)}")
        bench.warm_up()
        together = bench.together()
        records = bench.rounds()
        ok = True
    finally:
        bench.stop_all()
        stats.restore()
        if ok:
            shutil.rmtree(logdir, ignore_errors=True)
        else:
            print(f"bench: the tools' logs are kept in {logdir}", file=sys.stderr)
    progress("kernel.bpf_stats_enabled restored; no tool left running")
    if args.toggle_seconds and args.toggle_workloads:
        # After the rounds, with the kernel's stats back off: they would add to every program run.
        progress(f"toggled within one run: {', '.join(args.toggle_workloads)}, {args.toggle_seconds:.0f} s each")
        try:
            res["toggle"] = toggle.run(args.toggle_workloads, args.toggle_seconds, 0.05, PIPE_CPU, progress)
        except RuntimeError as e:  # the rounds' results stand without it
            bench.notes.append(f"the toggled measurement did not run: {e}")

    alone: dict[str, dict[str, dict[str, Counter]]] = {}
    for r in records:
        for w, c in r.pop("_deltas", {}).items():
            alone.setdefault(w, {}).setdefault(r["config"], {})
            alone[w][r["config"]] = bpfstats.add(alone[w][r["config"]], c)
    sla = [r for r in records if r["config"] == "slatrace"]
    rq = [r for r in records if r["config"] == "runqlat"]
    res.update({
        "settings": {"rounds": args.rounds, "rounds_done": len({r["round"] for r in records}), "quick": args.quick,
                     "toggle_seconds": args.toggle_seconds, "pinned": args.pin, "tool_cpu": bench.tool_cpu,
                     "repeat": args.repeat,
                     "together_reps": together["reps"], "order": "rotated each round: " + ", ".join(CONFIGS),
                     "workloads": {w.name: " ".join(w.cmd).replace(f"{logdir}/", "") for w in bench.workloads}},
        "bpf_stats": {"previous": stats.previous, "reasserted": stats.reasserted},
        "together": {"reps": together["reps"], "windows": together["windows"], "summary": together["summary"]},
        "alone": {"summary": summarize(alone)},
        "rounds": records,
        "throughput": throughput(records, [w.name for w in bench.workloads]),
        "total_cost": total_cost(records, bench.workloads),
        "slatrace": {k: spread([r.get(k) for r in sla]) for k in ("ready_s", "attach_s", "rss_bytes", "uss_bytes",
                                                                   "poll_s", "cpu_s")},
        "runqlat": {k: spread([r.get(k) for r in rq]) for k in ("ready_s", "cpu_s")},
        "memory": mapmem.summary(together["maps"], possible),
        "notes": bench.notes + ([f"kernel.bpf_stats_enabled was turned off {stats.reasserted} time(s) during the "
                                 "run by another process and turned back on"] if stats.reasserted else []),
    })
    res["targets"] = targets(res)
    return res


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    preflight(args.sections)
    progress = Progress()

    def on_term(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through the finally that stops the tools

    signal.signal(signal.SIGTERM, on_term)
    try:
        res = run(args, argv, progress)
    except KeyboardInterrupt:
        print("bench: interrupted; what it started is stopped and removed, kernel.bpf_stats_enabled restored",
              file=sys.stderr)
        return 130
    except RuntimeError as e:  # a tool or workload failed: one message, the cleanup already ran
        print(f"bench: {e}", file=sys.stderr)
        return 1

    out_dir = ROOT / "bench-results"
    out_dir.mkdir(exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = out_dir / f"bench-{stamp}.json"
    path.write_text(json.dumps(res, indent=2, sort_keys=False) + "\n")
    print()
    # --quick runs leave the committed plots alone, like the Markdown
    plot_dir = PLOTS_DIR if args.write_md else out_dir / f"plots-{stamp}"
    if "cost" in args.sections:
        image = plots.cost(res, plot_dir / "cost.png")
        md = report.render(res, image.relative_to(ROOT).as_posix())
        print(md)
        if args.write_md:
            report.update_markdown(ROOT / "BENCHMARKS.md", md)
    if "scale" in args.sections:
        images = plots.scale(res["scale"], plot_dir)
        md = report.render_scale(res, [p.relative_to(ROOT).as_posix() for p in images])
        print(md)
        if args.write_md:
            report.update_markdown(ROOT / "BENCHMARKS.md", md, report.SCALE_BEGIN, report.SCALE_END, "Scale results")
    if "fleet" in args.sections:
        image = plots.fleet(res["fleet"], plot_dir / "fleet.png")
        md = fleet.render(res, image.relative_to(ROOT).as_posix())
        print(md)
        if args.write_md:
            report.update_markdown(ROOT / "BENCHMARKS.md", md, fleet.FLEET_BEGIN, fleet.FLEET_END,
                                   "Fleet results")
    print(f"raw results: {path.relative_to(ROOT)}")
    if args.write_md:
        print("BENCHMARKS.md updated")
    missed = [t["name"] for t in res.get("targets", []) + res.get("scale", {}).get("targets", [])
              + res.get("fleet", {}).get("targets", []) if t["pass"] is False]
    if missed:
        print("targets missed: " + "; ".join(missed))
    return 1 if missed and args.check_targets else 0


if __name__ == "__main__":
    sys.exit(main())
