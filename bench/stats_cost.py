"""What enabled BPF run-time stats cost per program run.

With stats on, the kernel reads the clock before and after every BPF program
run and adds to per-CPU counters; that cost lands on every BPF program of the
host, not just the agent's. Measured here with the agent's own programs
attached: `perf bench sched pipe` (one sched_switch and one wakeup per
message) timed with stats off and on, rounds interleaved; the difference in
wall time divided by the program runs counted while on is the cost per run.

    sudo .venv/bin/python -m bench.stats_cost [--rounds 9] [--loops 100000]

Needs root, perf, and kernel.bpf_stats_enabled=0 on the host (otherwise
there is no "off" to compare with).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from agent.bpf_stats import enable_run_time_stats
from agent.probe import features as feat

SYSCTL = Path("/proc/sys/kernel/bpf_stats_enabled")


def run_cnt(fds: dict[str, int]) -> int:
    total = 0
    for fd in fds.values():
        for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines():
            if line.startswith("run_cnt:"):
                total += int(line.split()[1])
    return total


def pipe_round(loops: int) -> float:
    t0 = time.perf_counter()
    subprocess.run(["perf", "bench", "sched", "pipe", "-l", str(loops)], check=True, capture_output=True)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.stats_cost")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--loops", type=int, default=100_000)
    p.add_argument("--wait", type=float, default=120.0, help="seconds to wait for the host sysctl to be off")
    a = p.parse_args(argv)
    deadline = time.monotonic() + min(max(a.wait, 0.0), 3600.0)
    while SYSCTL.read_text().strip() != "0":  # wait (bounded) for whoever turned it on
        if time.monotonic() > deadline:
            raise SystemExit("kernel.bpf_stats_enabled is on for the whole host: no 'off' to compare with")
        time.sleep(1.0)
    from agent.probe.loader import Probe

    probe = Probe.load(feat.detect())
    fds = probe.program_fds()
    rows = []
    try:
        pipe_round(a.loops)  # warm up
        for i in range(max(1, min(a.rounds, 50))):
            order = ("off", "on") if i % 2 == 0 else ("on", "off")
            row = {}
            for state in order:
                fd = enable_run_time_stats() if state == "on" else None
                try:
                    before = run_cnt(fds)
                    row[state] = pipe_round(a.loops)
                    if state == "on":
                        row["runs"] = run_cnt(fds) - before
                finally:
                    if fd is not None:
                        os.close(fd)
            # Another process may turn the host-wide sysctl on meanwhile: such a
            # round has no "off" and is dropped (and counted).
            row["host_sysctl_on"] = SYSCTL.read_text().strip() != "0"
            rows.append(row)
    finally:
        probe.close()
    dropped = sum(r["host_sysctl_on"] for r in rows)
    rows = [r for r in rows if not r["host_sysctl_on"] and r["runs"]]
    if not rows:
        raise SystemExit("every round saw kernel.bpf_stats_enabled turned on by another process; rerun")
    per_run = [(r["on"] - r["off"]) / r["runs"] * 1e9 for r in rows]
    doc = {
        "rounds": len(rows), "dropped_rounds": dropped, "loops": a.loops,
        "off_s_median": statistics.median(r["off"] for r in rows),
        "on_s_median": statistics.median(r["on"] for r in rows),
        "runs_per_round_median": statistics.median(r["runs"] for r in rows),
        "ns_per_run_median": statistics.median(per_run),
        "ns_per_run_min": min(per_run), "ns_per_run_max": max(per_run),
        "rows": rows,
    }
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
