"""`python -m bench.progtime`: each program's own run time per event, for
weighing a change to the probe before the toggle measures what it costs the
workload.

The kernel's BPF statistics (kernel.bpf_stats_enabled, on only while this
runs) add up every program's run time and run count; their ratio is the
program's time per event, plus the ~30 ns per run the statistics' own two
clock reads cost, the same for every arm (the floor's empty programs show
it). Each arm is attached alone during a pinned `perf bench sched pipe` of
--loops round trips, the arms in turn for --rounds rounds; the medians of
sched_switch's and sched_wakeup's time per run are printed.

    python -m bench.progtime [--mode btf|raw|classic] [--variant BPF_DIR ...]

A variant is a copy of bpf/ with one change (`cp -r bpf /tmp/x`, edit
/tmp/x/sched.bpf.c): the shipped probe, each variant and the floor run side
by side, so a lever's worth in ns per event reads off directly.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

from bench.toggle import Toggled, load_floor, load_probe

STATS = Path("/proc/sys/kernel/bpf_stats_enabled")
PROGRAMS = ("sched_switch", "sched_wakeup")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.progtime", description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("auto", "btf", "raw", "classic"), default="auto",
                   help="attach mode of every arm (default: the agent's on this kernel)")
    p.add_argument("--variant", action="append", default=[], type=Path, metavar="BPF_DIR",
                   help="a changed copy of bpf/ to run beside the shipped one (repeatable)")
    p.add_argument("--rounds", type=int, default=5, help="rounds over the arms (default %(default)s)")
    p.add_argument("--loops", type=int, default=200_000, help="pipe round trips per arm and round "
                   "(default %(default)s)")
    p.add_argument("--cpu", type=int, default=1, help="CPU the pipe is pinned to (default %(default)s)")
    args = p.parse_args(argv)
    for d in args.variant:
        if not (d / "sched.bpf.c").is_file():
            p.error(f"--variant {d}: no sched.bpf.c there")
    if args.rounds < 1 or args.loops < 1000:
        p.error("--rounds must be at least 1 and --loops at least 1000")
    return args


def counters(fd: int) -> tuple[int, int]:
    """(run_time_ns, run_cnt) of a program, from its fdinfo."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines()
                  if ":" in line)
    return int(fields.get("run_time_ns", 0)), int(fields.get("run_cnt", 0))


def measure(arms: dict[str, Toggled], rounds: int, loops: int, cpu: int) -> dict[str, dict[str, list[float]]]:
    out: dict[str, dict[str, list[float]]] = {name: {p: [] for p in PROGRAMS} for name in arms}
    cmd = ["taskset", "-c", str(cpu), "perf", "bench", "sched", "pipe", "-l", str(loops)]
    for _ in range(rounds):
        for name, arm in arms.items():
            fds = arm.prog_fds()
            arm.set(True)
            try:
                before = {p: counters(fds[p]) for p in PROGRAMS}
                subprocess.run(cmd, capture_output=True, check=True, timeout=600)
                after = {p: counters(fds[p]) for p in PROGRAMS}
            finally:
                arm.set(False)
            for p in PROGRAMS:
                runs = after[p][1] - before[p][1]
                out[name][p].append((after[p][0] - before[p][0]) / runs if runs else float("nan"))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from agent.probe import features, loader

    feat = features.detect()
    try:
        mode = loader.attach_mode(feat, args.mode)
    except ValueError as e:
        print(f"bench.progtime: {e}", file=sys.stderr)
        return 1
    arms = {"slatrace": load_probe(feat, mode)}
    for d in args.variant:
        arms[f"variant {d}"] = load_probe(feat, mode, d)
    arms["floor"] = load_floor(mode)
    for arm in arms.values():
        arm.set(False)
    previous = STATS.read_text().strip()
    STATS.write_text("1")
    try:
        got = measure(arms, args.rounds, args.loops, args.cpu)
    finally:
        STATS.write_text(previous)
        for arm in arms.values():
            arm.close()
    print(f"{mode} tracepoints, ns per run (median of {args.rounds} rounds of {args.loops} pipe round trips "
          f"on CPU {args.cpu}; the statistics' own clock reads included):")
    for name, per in got.items():
        print(f"  {name:24s} " + "  ".join(f"{p} {statistics.median(v):6.1f}" for p, v in per.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
