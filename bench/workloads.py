"""The two scheduler-heavy workloads and the parsing of their results.

hackbench (rt-tests) is many-to-many messaging between process groups: lots of
wakeups and switches across both CPUs. `perf bench sched pipe` is two tasks
ping-ponging a pipe: the switch path at its hottest. Both print their own
timing, which is what the throughput comparison uses.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from bench.tools import run_bounded

TIMEOUT = 60.0


@dataclass(frozen=True)
class Workload:
    name: str
    unit: str           # of the result; smaller is better for both
    cmd: tuple[str, ...]

    def run(self) -> float:
        res = run_bounded(list(self.cmd), TIMEOUT)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(self.cmd)} exited with {res.returncode}: {res.output[-500:]}")
        return parse(self.name, res.output)


def hackbench(groups: int, loops: int) -> Workload:
    return Workload("hackbench", "s", ("hackbench", "-g", str(groups), "-l", str(loops)))


def pipe(loops: int) -> Workload:
    return Workload("pipe", "usecs/op", ("perf", "bench", "sched", "pipe", "-l", str(loops)))


_HACKBENCH = re.compile(r"^Time:\s*([0-9.]+)\s*$", re.M)
_PIPE = re.compile(r"([0-9.]+)\s+usecs/op")


def parse(name: str, output: str) -> float:
    """hackbench: "Time: 1.418" (seconds); perf pipe: "9.05 usecs/op"."""
    m = (_HACKBENCH if name == "hackbench" else _PIPE).search(output)
    if not m:
        raise RuntimeError(f"cannot find the result in the {name} output: {output[-300:]!r}")
    return float(m.group(1))
