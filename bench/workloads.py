"""The two scheduler-heavy workloads and the parsing of their results.

hackbench (rt-tests) is many-to-many messaging between process groups: lots of
wakeups and switches across both CPUs. `perf bench sched pipe` is two tasks
ping-ponging a pipe: the switch path at its hottest, two context switches per
operation. The ring (bench/ring.c) passes a token through 160 tasks: as dense
in switches as the pipe, but over as many tasks as hackbench's four groups, so
the tools' per-task state is spread the way hackbench spreads it. Pinned to one
CPU (taskset), with the tools pinned to another, every switch runs the tools'
programs on that CPU and nothing else competes with it, so the slowdown per
operation is the cost per switch. All print their own timing, which is what
the throughput comparison uses.
"""

from __future__ import annotations

import re
import resource
from dataclasses import dataclass
from pathlib import Path

from bench.tools import run_bounded

TIMEOUT = 60.0
RING_SOURCE = Path(__file__).with_name("ring.c")


@dataclass(frozen=True)
class Workload:
    name: str
    unit: str           # of the result; smaller is better for both
    cmd: tuple[str, ...]
    ns_per_unit: float  # the result times this is the run's whole duration in ns

    @property
    def slug(self) -> str:
        """The name on the command line: "hackbench-pinned" for "hackbench (pinned)"."""
        return self.name.replace(" (pinned)", "-pinned")

    @property
    def pinned(self) -> bool:
        return self.cmd[0] == "taskset"

    def run(self) -> float:
        return self.run_timed()[0]

    def run_timed(self) -> tuple[float, float]:
        """The workload's own result, and the CPU seconds (user + system) it
        and all its processes used: what a tracing tool adds inside the
        traced tasks' context shows there, whatever the CPUs did meanwhile."""
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        res = run_bounded(list(self.cmd), TIMEOUT)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(self.cmd)} exited with {res.returncode}: {res.output[-500:]}")
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        return parse(self.name, res.output), cpu


def hackbench(groups: int, loops: int, cpu: int | None = None) -> Workload:
    """On every CPU, or pinned to one: then, like the pinned pipe, its tasks
    run one at a time and its slowdown is what the tools cost it. Pinned, it
    sends 8 KiB messages through pipes: with hackbench's default 100-byte
    messages over sockets one CPU's tasks switch only ~6,000 times a second
    (a sender fills the buffers for a whole slice), so a tool's cost per switch
    drowns in the run-to-run noise; 8 KiB pipe messages block every few
    messages, ~45,000 switches a second."""
    if cpu is None:
        return Workload("hackbench", "s", ("hackbench", "-g", str(groups), "-l", str(loops)), 1e9)
    return Workload("hackbench (pinned)", "s",
                    (*_pin(cpu), "hackbench", "--pipe", "-s", "8192", "-g", str(groups), "-l", str(loops)), 1e9)


def ring(exe: Path, tasks: int, laps: int, cpu: int) -> Workload:
    """The token ring, pinned: one switch per hop, tasks * laps hops."""
    return Workload("ring (pinned)", "usecs/hop", (*_pin(cpu), str(exe), str(tasks), str(laps)),
                    tasks * laps * 1e3)


def pipe(loops: int, cpu: int | None = None) -> Workload:
    name = "pipe" if cpu is None else "pipe (pinned)"
    return Workload(name, "usecs/op", (*_pin(cpu), "perf", "bench", "sched", "pipe", "-l", str(loops)), loops * 1e3)


def _pin(cpu: int | None) -> tuple[str, ...]:
    return ("taskset", "-c", str(cpu)) if cpu is not None else ()


def context_switches() -> int:
    """Context switches of the whole host since boot (/proc/stat ctxt)."""
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("ctxt "):
                return int(line.split()[1])
    raise RuntimeError("/proc/stat has no ctxt line")


_HACKBENCH = re.compile(r"^Time:\s*([0-9.]+)\s*$", re.M)
_PIPE = re.compile(r"([0-9.]+)\s+usecs/(?:op|hop)")


def parse(name: str, output: str) -> float:
    """hackbench: "Time: 1.418" (seconds); perf pipe: "9.05 usecs/op"; ring: "5.89 usecs/hop"."""
    m = (_HACKBENCH if name.startswith("hackbench") else _PIPE).search(output)
    if not m:
        raise RuntimeError(f"cannot find the result in the {name} output: {output[-300:]!r}")
    return float(m.group(1))
