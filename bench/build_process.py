"""One agent's start-up against another's: two checkouts started in turn, side
by side in one run (first: the agent compiling in-process against the one
whose build process compiles; now: the build process compiling at every start
against the one that keeps the compiled programs for the next).

    git worktree add --detach /tmp/slatrace-before <commit before the change>
    sudo .venv/bin/python -m bench.build_process --before /tmp/slatrace-before [--rounds 7] [--no-write-md]

Each round starts the agent of each checkout twice, alternating A B A B (who
goes first rotates every round): a first start, with the compiler libraries'
page cache dropped and, for this checkout, its program cache empty (a node
that just pulled the image), then a restart (the page cache warm and the
programs the first start compiled in the cache, as when the kubelet restarts
the container). This checkout keeps its programs in a private directory
(--bpf-cache); --no-cache runs it with the cache off. Each start runs
in a memory cgroup of its own (bench/memcg.py) and is measured as
bench/footprint.py measures it: spawn -> first /readyz 200, /proc/PID/status
at ready and STEADY_S later (VmHWM is the agent process's own peak), the
cgroup's peak and steady charge (which hold the build process too), and the
build process's peak from the agent's log. Both sides run on the same private
copies of the compiler libraries and the same virtualenv; only the agent's
code differs (PYTHONPATH and working directory).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench import report
from bench.compiler_libraries import COMPILER_LIBRARIES, private_compiler_libraries
from bench.footprint import READY_TIMEOUT_S, attach_seconds, ready_get, status
from bench.memcg import MemoryCgroup, drop_page_cache
from bench.tools import free_port, log_tail, spawn, stop

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
STEADY_S = 3.0
PEAK_TARGET = 96 * MIB
READY_TARGET_S = 1.5
BUILD_PEAK = re.compile(r"(compiled|loaded from the cache) by a separate process, peak (\d+) MiB resident")
BEGIN = "<!-- BEGIN build-process results: written by `python -m bench.build_process`; edits inside are overwritten -->"
END = "<!-- END build-process results -->"
HEADING = "The compile in a process of its own"


def commit_of(tree: Path) -> str:
    return subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip() or "?"


def one_start(tree: Path, first: bool, log: Path, env: dict[str, str], cache: Path | None = None) -> dict[str, Any]:
    """Start the agent of `tree` in its own memory cgroup; its figures.
    cache: its program cache directory (emptied for a first start)."""
    if first:
        drop_page_cache([Path(env["LD_LIBRARY_PATH"]) / name for name in COMPILER_LIBRARIES])
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)
    port = free_port()
    cmd = [sys.executable, "-m", "agent.cli.main", "run", "--listen", f"127.0.0.1:{port}",
           "--otlp-grpc-listen", "off", "--otlp-http-listen", "off"]
    if cache is not None:
        cmd += ["--bpf-cache", str(cache)]
    with MemoryCgroup("build-process") as cg:
        old = os.getcwd()
        os.chdir(tree)  # `-m` puts the working directory first on the path
        try:
            t0 = time.monotonic()
            proc = spawn(cg.joined(cmd), log, {**os.environ, **env, "PYTHONPATH": str(tree)})
        finally:
            os.chdir(old)
        try:
            while ready_get(port) != 200:
                if proc.poll() is not None:
                    raise RuntimeError(f"{tree} exited with status {proc.returncode}:\n{log_tail(log)}")
                if time.monotonic() - t0 > READY_TIMEOUT_S:
                    raise RuntimeError(f"{tree} not ready {READY_TIMEOUT_S:.0f} s after start:\n{log_tail(log)}")
                time.sleep(0.01)
            ready = time.monotonic() - t0
            time.sleep(STEADY_S)
            steady = status(proc.pid)
            charge = cg.read()
        finally:
            stop(proc, 15)
    text = log.read_text(errors="replace")
    built = BUILD_PEAK.search(text)
    return {"ready_s": ready, "attach_s": attach_seconds(log), "steady": steady, "charge": asdict(charge),
            # Before the change the agent compiled itself: its own VmHWM was the compile's peak.
            "build_peak": int(built.group(2)) * MIB if built else None,
            "from_cache": bool(built and built.group(1) == "loaded from the cache")}


def _m(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for side in ("before", "after"):
        for kind in ("first start", "restart"):
            mine = [r for r in runs if r["side"] == side and r["kind"] == kind]
            if not mine:
                continue
            peaks = [r["build_peak"] for r in mine if r["build_peak"]]
            out[f"{side}, {kind}"] = {
                "runs": len(mine), "ready_s": _m([r["ready_s"] for r in mine]),
                "attach_s": _m([r["attach_s"] for r in mine]),
                "VmHWM": _m([r["steady"]["VmHWM"] for r in mine]), "VmRSS": _m([r["steady"]["VmRSS"] for r in mine]),
                "RssAnon": _m([r["steady"]["RssAnon"] for r in mine]),
                "RssFile": _m([r["steady"]["RssFile"] for r in mine]),
                "build_peak": _m(peaks) if peaks else None,
                "from_cache": sum(1 for r in mine if r.get("from_cache")),
                "cgroup_peak": _m([r["charge"]["peak"] for r in mine]),
                "cgroup_steady": _m([r["charge"]["current"] for r in mine]),
                "kernel": _m([r["charge"]["kernel"] for r in mine])}
    return out


def _mib(m: dict[str, float] | None) -> str:
    return "–" if m is None else f"{m['median'] / MIB:.0f} ({m['min'] / MIB:.0f}–{m['max'] / MIB:.0f})"


def _sec(m: dict[str, float]) -> str:
    return f"{m['median']:.2f} ({m['min']:.2f}–{m['max']:.2f})"


def render(res: dict[str, Any]) -> str:
    s, m = res["summary"], res["machine"]
    lines = [f"Measured {m['date']} on {m['nproc']} CPUs, kernel {m['kernel']}; before = commit {m['before']}, "
             f"after = commit {m['after']}; command `{m['command']}`; {res['rounds']} rounds, each starting both "
             "agents twice in turn (first start with the compiler libraries' page cache dropped and the after side's "
             f"program cache {'emptied' if res.get('cache', True) else 'off'}, then a restart), "
             "A B A B with the order rotated every round; medians (min–max). Memory read "
             f"{STEADY_S:.0f} s after ready; OTLP receivers off. Load average (1 min) {m['load_average'][0]:.1f} "
             f"before, {m['load_average'][1]:.1f} after: other engineers' runs share these 2 CPUs, so the times "
             "are noisy (compare the two sides of one row pair, not with other tables).", ""]
    after = s.get("after, first start")
    if after:
        restart = s.get("after, restart", after)
        lines += ["| target (after) | measured | limit | verdict |", "|---|---:|---:|---|",
                  f"| agent's own peak (VmHWM) | {after['VmHWM']['median'] / MIB:.0f} MiB | ≤ 96 MiB | "
                  f"{'PASS' if after['VmHWM']['median'] <= PEAK_TARGET else 'MISS'} |"]
        for label, v in (("first start", after), ("restart", restart)):
            before = s.get(f"before, {label}")
            if before is None:
                continue
            ok = before["ready_s"]["median"] >= v["ready_s"]["median"] <= READY_TARGET_S
            lines.append(f"| ready, {label} | {v['ready_s']['median']:.2f} s | ≤ {READY_TARGET_S} s and ≤ before "
                         f"({before['ready_s']['median']:.2f} s) | {'PASS' if ok else 'MISS'} |")
        before = s.get("before, first start")
        if before:
            ok = after["VmRSS"]["median"] <= before["VmRSS"]["median"]
            lines.append(f"| steady RSS | {after['VmRSS']['median'] / MIB:.0f} MiB | ≤ before "
                         f"({before['VmRSS']['median'] / MIB:.0f} MiB) | {'PASS' if ok else 'MISS'} |")
        lines.append("")
    lines += ["| agent, start | ready s | attach s | from the cache | agent VmHWM MiB | build process peak MiB | "
              "RSS MiB | RssAnon | RssFile | cgroup peak MiB | cgroup steady MiB | of which kernel MiB |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, v in s.items():
        lines.append(f"| {label} | {_sec(v['ready_s'])} | {_sec(v['attach_s'])} | "
                     f"{v.get('from_cache', 0)} of {v['runs']} | {_mib(v['VmHWM'])} | "
                     f"{_mib(v['build_peak'])} | {_mib(v['VmRSS'])} | {_mib(v['RssAnon'])} | {_mib(v['RssFile'])} | "
                     f"{_mib(v['cgroup_peak'])} | {_mib(v['cgroup_steady'])} | {_mib(v['kernel'])} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.build_process", description=__doc__.split("\n\n")[0])
    p.add_argument("--before", type=Path, required=True, help="a checkout of the agent to compare with")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--no-cache", dest="cache", action="store_false", default=True,
                   help="run this checkout with its program cache off (--bpf-cache off)")
    p.add_argument("--no-write-md", dest="write_md", action="store_false", default=True)
    args = p.parse_args(argv)
    if not (args.before / "agent" / "daemon.py").is_file():
        p.error(f"{args.before} is not a checkout of slatrace")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("bench: run as root (loading BPF needs it)")
    logdir = Path(tempfile.mkdtemp(prefix="slatrace-build-process-"))
    runs: list[dict[str, Any]] = []
    trees = {"before": args.before.resolve(), "after": ROOT}
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    try:
        env = private_compiler_libraries(logdir)
        for rnd in range(args.rounds):
            sides = ("before", "after") if rnd % 2 == 0 else ("after", "before")
            for kind in ("first start", "restart"):
                for side in sides:
                    log = logdir / f"{side}-{rnd}-{kind.replace(' ', '-')}.log"
                    try:
                        r = one_start(trees[side], kind == "first start", log, env,
                                      logdir / "bpf-cache" if side == "after" and args.cache else None)
                    except RuntimeError as e:
                        print(f"bench: {e}", file=sys.stderr)
                        return 1
                    r.update(side=side, kind=kind, round=rnd)
                    runs.append(r)
                    print(f"[{time.monotonic() - t0:6.1f}s] round {rnd + 1}/{args.rounds} {side:6s} {kind:11s} "
                          f"ready {r['ready_s']:.2f} s, VmHWM {r['steady']['VmHWM'] / MIB:.0f} MiB, RSS "
                          f"{r['steady']['VmRSS'] / MIB:.0f} MiB, {'cached' if r['from_cache'] else 'compiled'}, "
                          "build peak "
                          f"{(r['build_peak'] or 0) / MIB:.0f} MiB, cgroup peak {r['charge']['peak'] / MIB:.0f} "
                          f"/ steady {r['charge']['current'] / MIB:.0f} MiB", flush=True)
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
    res = {"machine": {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                       "kernel": platform.release(), "nproc": os.cpu_count(),
                       "before": commit_of(trees["before"]), "after": commit_of(ROOT),
                       "command": " ".join([".venv/bin/python", "-m", "bench.build_process", *argv]),
                       "load_average": [load_before, os.getloadavg()[0]]},
           "rounds": args.rounds, "cache": args.cache, "runs": runs, "summary": summarize(runs)}
    report.publish(ROOT, "build-process", res, render(res), write_md=args.write_md, begin=BEGIN, end=END,
                   heading=HEADING)
    return 0


if __name__ == "__main__":
    sys.exit(main())
