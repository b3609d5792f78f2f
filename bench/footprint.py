"""The agent's resident memory and start-up time, lever by lever.

    sudo .venv/bin/python -m bench.footprint [--rounds 5] [--no-write-md]
    sudo make bench-footprint

Each round starts the agent once per configuration (bench/agent_variant.py
undoes one start-up lever at a time; the order rotates every round), measures
spawn -> first /readyz 200, then reads /proc/PID/status at ready and STEADY_S
later: VmRSS, RssAnon, RssFile, and VmHWM (the start-up peak: the compile);
and, as every agent runs in a memory cgroup of its own, that cgroup's peak and
steady charge, its kernel memory (the BPF maps) and working set
(bench/memcg.py).
Medians over rounds go to BENCHMARKS.md between their own markers, raw
figures to bench-results/footprint-<timestamp>.json.

The kernel does not page out file pages another process maps too: when
another BCC tool holds libLLVM during a run, that run's RssFile stays high.
So that a shared host measures what a node where the agent is the only BCC
user would see, the bench runs the agents on private copies of the compiler
libraries (LD_LIBRARY_PATH; --shared-llvm uses the system's), and counts at
each reading the other processes mapping the agent's copy.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench import report
from bench.compiler_libraries import COMPILER_LIBRARIES, private_compiler_libraries
from bench.memcg import MemoryCgroup, drop_page_cache
from bench.tools import attach_seconds_in, free_port, log_tail, spawn, stop

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
STEADY_S = 3.0
READY_TIMEOUT_S = 60.0
RSS_TARGET = 64 * MIB
READY_TARGET_S = 1.5
# (label, variant, extra flags): receivers off as in bench/run.py, plus the
# shipped agent with its default OTLP receivers on (gRPC loaded).
CONFIGS = (
    ("shipped", "shipped", ()),
    ("shipped, OTLP receivers on", "shipped", ("--otlp-grpc-listen", "127.0.0.1:0",
                                               "--otlp-http-listen", "127.0.0.1:0")),
    ("no-release", "no-release", ()),
    ("trim-only", "trim-only", ()),
    ("pageout-only", "pageout-only", ()),
    ("full-first-interval", "full-first-interval", ()),
    ("before", "before", ()),
)
FIELDS = ("VmRSS", "RssAnon", "RssFile", "VmHWM", "Pss")
# The memory cgroup's figures (bench/memcg.py), read with the others: what a
# container's limit is held against.
CHARGE_FIELDS = ("peak", "current", "kernel", "working_set")
BEGIN = "<!-- BEGIN footprint results: written by `make bench-footprint`; edits inside are overwritten -->"
END = "<!-- END footprint results -->"


def status(pid: int) -> dict[str, int]:
    """The memory lines of /proc/PID/status, and Pss from smaps_rollup, in bytes.

    Pss splits pages shared with other processes among them: with another BCC
    tool running it shows what this agent costs where RSS cannot."""
    out = {}
    for name in ("status", "smaps_rollup"):
        for line in Path(f"/proc/{pid}/{name}").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in FIELDS:
                out[key] = int(value.split()[0]) * 1024
    return out


def llvm_sharers(own: int, library: str) -> int:
    """Other processes that map `library` now (those pages cannot be paged out by us)."""
    n = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == own:
            continue
        try:
            if library in (entry / "maps").read_text():
                n += 1
        except OSError:
            continue
    return n


def ready_get(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=0.5) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return 0


def one_run(variant: str, flags: tuple[str, ...], log: Path, env: dict[str, str]) -> dict[str, Any]:
    if env:
        # each run is charged for reading the compiler, as a first start on a node is
        drop_page_cache([Path(env["LD_LIBRARY_PATH"]) / name for name in COMPILER_LIBRARIES])
    with MemoryCgroup("footprint") as cg:
        return _run_in(cg, variant, flags, log, env)


def _run_in(cg: MemoryCgroup, variant: str, flags: tuple[str, ...], log: Path, env: dict[str, str]) -> dict[str, Any]:
    port = free_port()
    cmd = [sys.executable, "-m", "bench.agent_variant", variant, "run", "--listen", f"127.0.0.1:{port}",
           "--otlp-grpc-listen", "off", "--otlp-http-listen", "off", *flags]
    t0 = time.monotonic()
    proc = spawn(cg.joined(cmd), log, {**os.environ, **env})
    library = str(Path(env["LD_LIBRARY_PATH"]) / COMPILER_LIBRARIES[0]) if env else COMPILER_LIBRARIES[0]
    try:
        while ready_get(port) != 200:
            if proc.poll() is not None:
                raise RuntimeError(f"{variant} exited with status {proc.returncode}:\n{log_tail(log)}")
            if time.monotonic() - t0 > READY_TIMEOUT_S:
                raise RuntimeError(f"{variant} not ready {READY_TIMEOUT_S:.0f} s after start:\n{log_tail(log)}")
            time.sleep(0.01)
        ready = time.monotonic() - t0
        at_ready = status(proc.pid)
        time.sleep(STEADY_S)
        steady = status(proc.pid)
        charge = cg.read()
        sharers = llvm_sharers(proc.pid, library)
    finally:
        stop(proc, 15)
    compile_s = attach_seconds(log)
    return {"ready_s": ready, "compile_s": compile_s, "at_ready": at_ready, "steady": steady,
            "llvm_sharers": sharers, "charge": asdict(charge)}


def attach_seconds(log: Path) -> float:
    """The agent's own compile-and-attach time (bench.tools.attach_seconds_in)."""
    seconds = attach_seconds_in(log.read_text(errors="replace"))
    if seconds is None:
        raise RuntimeError(f"no 'BPF programs attached' line in {log}:\n{log_tail(log)}")
    return seconds


def median(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for label, _, _ in CONFIGS:
        mine = [r for r in runs if r["label"] == label]
        if not mine:
            continue
        out[label] = {"runs": len(mine), "ready_s": median([r["ready_s"] for r in mine]),
                      "compile_s": median([r["compile_s"] for r in mine]),
                      "rest_s": median([r["ready_s"] - r["compile_s"] for r in mine]),
                      "shared_runs": sum(1 for r in mine if r["llvm_sharers"])}
        for f in FIELDS:
            out[label][f] = median([r["steady"][f] for r in mine])
        for f in CHARGE_FIELDS:
            out[label][f"cgroup_{f}"] = median([r["charge"][f] for r in mine])
    return out


def _mib(m: dict[str, float]) -> str:
    return f"{m['median'] / MIB:.0f} ({m['min'] / MIB:.0f}–{m['max'] / MIB:.0f})"


def _sec(m: dict[str, float]) -> str:
    return f"{m['median']:.2f} ({m['min']:.2f}–{m['max']:.2f})"


def render(res: dict[str, Any]) -> str:
    s = res["summary"]
    m = res["machine"]
    lines = [f"Measured {m['date']} on {m['nproc']} CPUs, kernel {m['kernel']}; command `{m['command']}`; "
             f"{res['rounds']} interleaved rounds (order rotated each round), one start per configuration "
             f"and round; medians (min–max). Memory read {STEADY_S:.0f} s after ready; the peak is VmHWM, "
             "reached during the compile. Each agent runs in its own memory cgroup (bench/memcg.py): its "
             "peak and steady charge hold page cache and kernel memory (the BPF maps) besides RSS; the "
             "working set is the charge less inactive file pages. "
             f"Compiler libraries: {m['compiler_libraries']}. Load average "
             f"(1 min) {m['load_average'][0]:.1f} before, {m['load_average'][1]:.1f} after: start-up times "
             "grow with it (the compile is CPU-bound).", ""]
    shipped = s.get("shipped")
    if shipped:
        rss, ready, rest = shipped["VmRSS"]["median"], shipped["ready_s"]["median"], shipped["rest_s"]["median"]
        lines += ["| target | measured | limit | verdict |", "|---|---:|---:|---|",
                  f"| RSS, steady (shipped) | {rss / MIB:.0f} MiB | ≤ 64 MiB | "
                  f"{'PASS' if rss <= RSS_TARGET else 'MISS'} |",
                  f"| start-up, spawn → /readyz 200 (shipped) | {ready:.2f} s | ≤ {READY_TARGET_S} s | "
                  f"{'PASS' if ready <= READY_TARGET_S else 'MISS'} |",
                  f"| the same without the BPF compile (shipped) | {rest:.2f} s | – | – |", ""]
    lines += ["| configuration | ready s | of which compile s | ready − compile s | RSS MiB | RssAnon MiB | "
              "RssFile MiB | PSS MiB | start-up peak (VmHWM) MiB | cgroup peak MiB | cgroup steady MiB | "
              "of which kernel MiB | working set MiB |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, v in s.items():
        r = v["ready_s"]
        lines.append(f"| {label} | {r['median']:.2f} ({r['min']:.2f}–{r['max']:.2f}) | {_sec(v['compile_s'])} | "
                     f"{_sec(v['rest_s'])} | {_mib(v['VmRSS'])} | "
                     f"{_mib(v['RssAnon'])} | {_mib(v['RssFile'])} | {_mib(v['Pss'])} | {_mib(v['VmHWM'])} | "
                     + " | ".join(_mib(v[f"cgroup_{f}"]) for f in CHARGE_FIELDS) + " |")
    shared = {label: v["shared_runs"] for label, v in s.items() if v["shared_runs"]}
    if shared:
        lines += ["", "Runs during which another process mapped the same libLLVM (its pages then stay resident): "
                  + ", ".join(f"{k}: {n}" for k, n in shared.items()) + "."]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.footprint", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-write-md", dest="write_md", action="store_false", default=True)
    p.add_argument("--shared-llvm", action="store_true",
                   help="load the system's compiler libraries (shared with any other BCC tool running)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("bench: run as root (loading BPF needs it): sudo make bench-footprint")
    logdir = Path(tempfile.mkdtemp(prefix="slatrace-footprint-"))
    try:
        env = {} if args.shared_llvm else private_compiler_libraries(logdir)
        return measure(args, argv, logdir, env)
    finally:
        shutil.rmtree(logdir, ignore_errors=True)


def measure(args: argparse.Namespace, argv: list[str], logdir: Path, env: dict[str, str]) -> int:
    runs = []
    t0 = time.monotonic()
    load_before = os.getloadavg()[0]
    for rnd in range(args.rounds):
        order = CONFIGS[rnd % len(CONFIGS):] + CONFIGS[:rnd % len(CONFIGS)]
        for label, variant, flags in order:
            try:
                r = one_run(variant, flags, logdir / f"{variant}-{rnd}.log", env)
            except RuntimeError as e:
                print(f"bench: {e}", file=sys.stderr)
                return 1
            r.update(label=label, round=rnd)
            runs.append(r)
            print(f"[{time.monotonic() - t0:6.1f}s] round {rnd + 1}/{args.rounds} {label:28s} ready "
                  f"{r['ready_s']:.2f} s (compile {r['compile_s']:.2f} s), "
                  f"RSS {r['steady']['VmRSS'] / MIB:.0f} MiB (anon "
                  f"{r['steady']['RssAnon'] / MIB:.0f}, file {r['steady']['RssFile'] / MIB:.0f}), peak "
                  f"{r['steady']['VmHWM'] / MIB:.0f} MiB; cgroup peak {r['charge']['peak'] / MIB:.0f}, steady "
                  f"{r['charge']['current'] / MIB:.0f} MiB" + (f"; {r['llvm_sharers']} other libLLVM users"
                                                            if r["llvm_sharers"] else ""), flush=True)
    command = "make bench-footprint" if os.environ.get("MAKELEVEL") else " ".join(
        [".venv/bin/python", "-m", "bench.footprint", *argv])
    res = {"machine": {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                       "kernel": platform.release(), "nproc": os.cpu_count(), "command": command,
                       "compiler_libraries": "system (shared)" if args.shared_llvm else "private copies",
                       "load_average": [load_before, os.getloadavg()[0]]},
           "rounds": args.rounds, "runs": runs, "summary": summarize(runs)}
    report.publish(ROOT, "footprint", res, render(res), write_md=args.write_md, begin=BEGIN, end=END,
                   heading="Resident memory and start-up, lever by lever")
    return 0


if __name__ == "__main__":
    sys.exit(main())
