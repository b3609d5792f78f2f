"""`python -m bench.toggle`: the added cost per context switch of slatrace's
probe and of runqlat-bpfcc's, within one long pinned run.

Rounds of separate runs cannot judge a workload whose run time moves by more
than the tools cost (pinned hackbench here: 1.5-2.6 s with no tool, ~0.1 s
added). This loads both probes once — bpf/sched.bpf.c with the agent's own
flags, and runqlat-bpfcc's program as it prints it with `--ebpf` — detaches
them, starts one long pinned workload and attaches the raw tracepoints of
each tool in turn for short windows: off, slatrace, off, runqlat, ... Each
tool window's context-switch rate (/proc/stat ctxt) is compared with the off
windows on either side, so the workload's slow drift cancels; the added
cost per switch is 1/rate(tool) - 1/rate(off).

It measures the kernel side only (the probe, not the agent's user space,
which runs on another CPU). "slatrace" is the probe in the mode the agent
takes on this kernel (BTF-typed tracepoints where it has them); the cycle
also holds it in the other modes (raw tracepoints, and classic ones, what a
kernel without BTF gets) and the floor: empty programs on the same six
tracepoints in the agent's mode (and on raw ones), what any tool on them
costs before doing anything, so each tool's cost is also given as a ratio to
the floor. `--plot PNG` draws every arm per workload.
`--also DIR` adds slatrace's probe from another bpf/ directory to the cycle,
to weigh one version of the probe against another within the same run.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from agent.probe.btf import TRACEPOINTS
from agent.probe.build import detach_watch_programs
from bench import floor, resample, workloads
from bench.tools import RUNQLAT, die_with_parent
from tests.support.scale import compile_worker

SETTLE_S = 0.01       # after attaching, before the window opens


WORKLOADS = ("hackbench", "ring", "pipe")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.toggle", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="hackbench", metavar="NAME,...",
                   help="pinned hackbench --pipe -s 8192 -g 4, the 160-task token ring, perf bench sched pipe; "
                        "comma-separated, measured one after the other (default %(default)s)")
    p.add_argument("--seconds", type=float, default=240.0, help="how long to measure each (default %(default)s)")
    p.add_argument("--window", type=float, default=0.05, help="window length in seconds (default %(default)s)")
    p.add_argument("--cpu", type=int, default=1, help="CPU the workload is pinned to (default %(default)s; "
                   "this process stays on another)")
    p.add_argument("--also", action="append", default=[], type=Path, metavar="BPF_DIR",
                   help="toggle slatrace's probe built from this bpf/ directory too, e.g. from "
                        "`git worktree add /tmp/old <commit>`: /tmp/old/bpf (repeatable)")
    p.add_argument("--plot", type=Path, metavar="PNG", help="draw the added cost of every arm per workload there")
    args = p.parse_args(argv)
    for d in args.also:
        if not (d / "sched.bpf.c").is_file():
            p.error(f"--also {d}: no sched.bpf.c there")
    args.workload = [w.strip() for w in args.workload.split(",") if w.strip()]
    unknown = [w for w in args.workload if w not in WORKLOADS]
    if unknown or not args.workload:
        p.error(f"--workload: expected some of {', '.join(WORKLOADS)}, got {', '.join(unknown) or 'nothing'}")
    if args.seconds <= 0 or not 0.005 <= args.window <= 5:
        p.error("--seconds must be positive and --window between 0.005 and 5")
    return args


class Toggled:
    """A loaded BPF object whose tracepoints can be attached and detached in
    turn: BTF-typed ones (`tracing`, agent/probe/tracing.py), raw ones, or
    classic ones (BCC names their programs tracepoint__<category>__<event>)."""

    def __init__(self, bpf, tracing=None) -> None:
        self.bpf = bpf
        self.tracing = tracing
        # What an agent that watches nothing attaches.
        detach_watch_programs(bpf)
        self.raw = list(bpf.raw_tracepoint_fds)
        self.classic = list(bpf.tracepoint_fds)
        if not self.raw and not self.classic and tracing is None:
            raise RuntimeError("bench.toggle: a probe attached no tracepoint: nothing to toggle")

    def prog_fds(self) -> dict[str, int]:
        """Tracepoint name -> its program's fd."""
        if self.tracing is not None:
            return dict(self.tracing.prog_fds)
        return {name.decode().rsplit("__", 1)[-1]: fn.fd for name, fn in self.bpf.funcs.items()}

    def close(self) -> None:
        if self.tracing is not None:
            self.tracing.close()
        self.bpf.cleanup()

    def set(self, on: bool) -> None:
        if self.tracing is not None:
            if on:
                self.tracing.attach(TRACEPOINTS)
            else:
                self.tracing.detach()
        for tp in self.raw:
            if on:
                self.bpf.attach_raw_tracepoint(tp=tp, fn_name=b"raw_tracepoint__" + tp)
            else:
                self.bpf.detach_raw_tracepoint(tp=tp)
        for tp in self.classic:
            if on:
                self.bpf.attach_tracepoint(tp=tp, fn_name=b"tracepoint__" + tp.replace(b":", b"__"))
            else:
                self.bpf.detach_tracepoint(tp=tp)


def load_probe(feat, mode: str, bpf_dir: Path | None = None) -> Toggled:
    """slatrace's probe compiled with the agent's flags for `mode` (from
    `bpf_dir` instead of the shipped bpf/ where given), attached."""
    from bcc import BPF

    from agent.probe import loader
    from agent.probe.tracing import TracingPrograms
    flags = loader.cflags(feat, loader.MapSizes(), mode)
    if bpf_dir is None:
        b = BPF(src_file=str(loader.bpf_source_dir() / "sched.bpf.c").encode(), cflags=flags)
    else:
        # The include path first, so its own sched.h is the one found.
        b = BPF(src_file=str(bpf_dir / "sched.bpf.c").encode(), cflags=[f"-I{bpf_dir}", *flags])
    if mode != "btf":
        return Toggled(b)
    # A variant of an older probe may attach to fewer tracepoints.
    lib = __import__("bcc").libbcc.lib
    ids = {name: tid for name, tid in feat.task_layout.btf_trace_ids
           if lib.bpf_function_start(b.module, b"tp_btf__" + name.encode())}
    return Toggled(b, TracingPrograms(b, ids))


def load_floor(mode: str) -> Toggled:
    """The empty programs (bench/floor.py) in `mode`, attached."""
    return Toggled(*floor.load(mode))


def load_probes(also: list[Path] = ()) -> dict[str, Toggled]:
    """Every probe of the cycle, compiled and detached: slatrace's in the mode
    the agent takes here ("slatrace"; BTF-typed tracepoints where the kernel
    has them), then from each directory of `also` ("slatrace@<directory>"),
    slatrace's on raw tracepoints ("slatrace-raw", where the agent's mode is
    BTF-typed) and on classic ones ("slatrace-classic"), the empty floor in
    the agent's mode ("floor"; "floor-raw" beside it where that is BTF-typed)
    and runqlat-bpfcc's program ("runqlat")."""
    # Imported here: python3-bpfcc is needed only where probes are loaded.
    from bcc import BPF

    from agent.probe import features, loader
    feat = features.detect()
    if not feat.task_layout:
        raise RuntimeError("bench.toggle: this kernel has no BTF for task_struct: both tools would not take "
                           "raw tracepoints; nothing to compare here")
    mode = loader.attach_mode(feat, "auto")
    text = subprocess.run([RUNQLAT, "--ebpf"], capture_output=True, text=True, timeout=60, check=True).stdout
    out = {"slatrace": load_probe(feat, mode)}
    for d in also:
        out[f"slatrace@{d}"] = load_probe(feat, mode, d)
    if mode == "btf":
        out["slatrace-raw"] = load_probe(feat, "raw")
    out["slatrace-classic"] = load_probe(feat, "classic")
    out["floor"] = load_floor(mode)
    if mode == "btf":
        out["floor-raw"] = load_floor("raw")
    out["runqlat"] = Toggled(BPF(text=text))
    for t in out.values():
        t.set(False)
    return out


def added_per_switch(seq: list[tuple[str, float]]) -> dict[str, list[float]]:
    """ns added per switch in each tool window, against the mean rate of the
    off windows on either side of it."""
    out: dict[str, list[float]] = {}
    for i in range(1, len(seq) - 1):
        state, rate = seq[i]
        before, after = seq[i - 1], seq[i + 1]
        if state == "off" or before[0] != "off" or after[0] != "off" or rate <= 0:
            continue
        off = (before[1] + after[1]) / 2
        out.setdefault(state, []).append((1 / rate - 1 / off) * 1e9)
    return out


def ratio_of_means(a: list[float], b: list[float], seed: int = 0) -> tuple[float, float, float]:
    """mean(a) / mean(b) and its 95% interval, resampling windows (nan
    bounds when mean(b) is within the noise)."""
    def draw(rng: random.Random) -> tuple[float, float]:
        den = statistics.fmean(rng.choices(b, k=len(b)))
        return statistics.fmean(rng.choices(a, k=len(a))), den

    lo, hi = resample.ratio_interval(draw, seed) or (float("nan"), float("nan"))
    return statistics.fmean(a) / statistics.fmean(b), lo, hi


def preflight() -> None:
    if os.geteuid() != 0:
        raise SystemExit("bench.toggle: run as root (it loads BPF programs)")
    for tool in (RUNQLAT, "hackbench", "perf", "cc"):
        if shutil.which(tool) is None:
            raise SystemExit(f"bench.toggle: {tool} not found: run 'make setup-test'")


def workload(name: str, cpu: int, tmp: Path) -> workloads.Workload:
    """The pinned workloads of `make bench`, long enough to outlast the windows."""
    if name == "hackbench":
        return workloads.hackbench(4, 1_000_000, cpu)
    if name == "ring":
        return workloads.ring(compile_worker(tmp, workloads.RING_SOURCE), 160, 100_000_000, cpu)
    return workloads.pipe(1_000_000_000, cpu)


def measure(probes: dict, name: str, seconds: float, window: float, cpu: int,
            progress: Callable[[str], None] = print) -> dict[str, Any]:
    """One long pinned run of the workload, the tools attached in turn; this
    process must run on another CPU than `cpu`."""
    with tempfile.TemporaryDirectory(prefix="slatrace-toggle-") as tmp:
        cmd = list(workload(name, cpu, Path(tmp)).cmd)
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=die_with_parent)
        cycle = [state for tool in probes for state in ("off", tool)]
        seq: list[tuple[str, float]] = []
        attached = None
        try:
            time.sleep(1.0)   # past the forks
            end = time.monotonic() + seconds
            i = 0
            while time.monotonic() < end and proc.poll() is None:
                state = cycle[i % len(cycle)]
                i += 1
                if state != "off":
                    attached = probes[state]
                    attached.set(True)
                    time.sleep(SETTLE_S)
                c0, t0 = workloads.context_switches(), time.monotonic()
                time.sleep(window)
                c1, t1 = workloads.context_switches(), time.monotonic()
                if attached:
                    attached.set(False)
                    attached = None
                seq.append((state, (c1 - c0) / (t1 - t0)))
                if i % 800 == 0:
                    progress(f"toggle {name}: {seconds - (end - time.monotonic()):.0f} of {seconds:.0f} s, "
                             f"{i} windows")
        finally:
            if attached:
                attached.set(False)
            # The whole group: hackbench's 160 children outlive a kill of its main process.
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.returncode not in (0, -9):
        raise RuntimeError(f"bench.toggle: {name} exited with {proc.returncode} before the end")
    added = added_per_switch(seq)
    if not all(added.get(t) for t in probes):
        raise RuntimeError("bench.toggle: too few windows: measure for longer")
    off = statistics.median(r for s, r in seq if s == "off")
    out: dict[str, Any] = {"command": " ".join(cmd).replace(f"{tmp}/", ""), "seconds": seconds, "window_s": window,
                           "off_ns_per_switch": 1e9 / off}
    for tool in probes:
        v = added[tool]
        out[tool] = {"windows": len(v), "mean_ns": statistics.fmean(v), "median_ns": statistics.median(v),
                     "sd_ns": statistics.pstdev(v)}
        if tool != "runqlat":
            r, lo, hi = ratio_of_means(v, added["runqlat"])
            out[tool].update(ratio=r, ratio_95=None if math.isnan(lo) else [lo, hi])
        if tool != "floor":
            r, lo, hi = ratio_of_means(v, added["floor"])
            out[tool].update(floor_ratio=r, floor_ratio_95=None if math.isnan(lo) else [lo, hi])
    # The shipped probe's ratio, the one the targets judge.
    out.update(ratio=out["slatrace"]["ratio"], ratio_95=out["slatrace"]["ratio_95"])
    return out


def run(names: list[str], seconds: float, window: float, cpu: int,
        progress: Callable[[str], None] = print, also: list[Path] = ()) -> dict[str, dict[str, Any]]:
    """Load both probes once and measure each workload in turn. Runs this
    process on a CPU other than `cpu` meanwhile, and restores its affinity."""
    others = sorted(os.sched_getaffinity(0) - {cpu})
    if not others:
        raise RuntimeError(f"bench.toggle: needs a CPU besides {cpu} for itself")
    affinity = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {others[0]})
    try:
        probes = load_probes(also)
        try:
            return {name: measure(probes, name, seconds, window, cpu, progress) for name in names}
        finally:
            for probe in probes.values():
                probe.close()
    finally:
        os.sched_setaffinity(0, affinity)


def describe(name: str, m: dict[str, Any]) -> str:
    lines = [f"{name}: `{m['command']}`; {m['window_s'] * 1e3:.0f} ms windows over {m['seconds']:.0f} s; "
             f"no tool: {m['off_ns_per_switch']:.0f} ns a switch"]
    tools = [t for t in m if t.startswith(("slatrace", "floor"))] + ["runqlat"]
    for tool in tools:
        t = m[tool]
        lines.append(f"  {tool:16s} {t['windows']} windows: added {t['mean_ns']:.0f} ns per switch "
                     f"(median {t['median_ns']:.0f}, sd {t['sd_ns']:.0f})")
    for tool in tools:
        for key, peer in (("ratio", "runqlat"), ("floor_ratio", "floor")):
            if key in m[tool]:
                iv = m[tool][f"{key}_95"]
                lines.append(f"  {tool} / {peer}: {m[tool][key]:.2f}x" +
                             (f" (95%: {iv[0]:.2f}-{iv[1]:.2f})" if iv else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    preflight()
    try:
        results = run(args.workload, args.seconds, args.window, args.cpu, lambda msg: print(msg, flush=True),
                      args.also)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    for name, m in results.items():
        print(describe(name, m))
    if args.plot:
        from bench import plots
        print(f"wrote {plots.modes(results, args.plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
