"""The self-check: did every wait the programs saw reach the agent?

The programs count each wait where it enters the histogram path (bpf/sched.h
`tally`), before it passes through the per-CPU caches, the shared maps and the
agent's drain. What arrives must add up to the same number: the histograms'
counts plus the waits a full map could not take (counted per cgroup, and
shown as coverage). A gap is a loss nothing else would show — coverage is
computed from what arrived — such as a kernel whose map operations behave
otherwise than the drain expects.

The tally cannot see an event the kernel never ran a program for: it skips a
program on its tracepoint while another BPF program, or on classic
tracepoints any BPF map operation, is in progress on that CPU, and counts the
skip (recursion_misses, from 5.12). Those skips are judged beside the gap.

The check judges a window of intervals with a little slack, not each interval
alone.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from agent.probe.snapshot import HIST_IOWAIT, HIST_RUNQ, ProbeSnapshot

KINDS = ("runq", "iowait")
WINDOW_INTERVALS = 60
# Judged a loss beyond this share of the waits seen in the window, and this
# many waits (stragglers across a drain).
TOLERANCE = 0.005
SLACK = 16


@dataclass(frozen=True)
class TallyVerdict:
    ok: bool
    seen: int       # waits the programs saw over the window
    arrived: int    # of them, how many reached the agent
    detail: str     # one sentence


def arrived(snap: ProbeSnapshot) -> tuple[int, int]:
    """Run-queue and D-state waits that reached the agent in a snapshot: the
    histograms' counts plus what full maps could not take."""
    rows, cg = snap.hist_rows, snap.cgroup_rows
    runq = int(rows["count"][rows["kind"] == HIST_RUNQ].sum()) + int(cg["lost_runq"].sum())
    iowait = int(rows["count"][rows["kind"] == HIST_IOWAIT].sum()) + int(cg["lost_iowait"].sum())
    return runq, iowait


class WaitTally:
    """Seen and arrived waits per interval, over a sliding window."""

    def __init__(self, window: int = WINDOW_INTERVALS, tolerance: float = TOLERANCE, slack: int = SLACK) -> None:
        self.tolerance = tolerance
        self.slack = slack
        self._window: deque[np.ndarray] = deque(maxlen=window)  # rows: [seen, arrived] per kind
        self._skipped: deque[int] = deque(maxlen=window)          # program runs the kernel skipped
        self._misses_before: int | None = None
        self.seen_total = dict.fromkeys(KINDS, 0)
        self.missing_total = dict.fromkeys(KINDS, 0)

    def observe(self, snap: ProbeSnapshot) -> None:
        if snap.tally is None:
            return
        got = arrived(snap)
        row = np.array([[snap.tally[i], got[i]] for i in range(len(KINDS))], np.int64)
        self._window.append(row)
        misses = sum(p.misses for p in snap.programs.values())
        self._skipped.append(max(0, misses - self._misses_before) if self._misses_before is not None else misses)
        self._misses_before = misses
        for i, kind in enumerate(KINDS):
            self.seen_total[kind] += int(row[i, 0])
            self.missing_total[kind] += max(0, int(row[i, 0] - row[i, 1]))

    def verdict(self) -> TallyVerdict | None:
        """None before the first interval with a tally."""
        if not self._window:
            return None
        sums = np.sum(self._window, axis=0)
        seen, got = int(sums[:, 0].sum()), int(sums[:, 1].sum())
        for i, kind in enumerate(KINDS):
            s, a = int(sums[i, 0]), int(sums[i, 1])
            if abs(s - a) > self.slack + self.tolerance * s:
                return TallyVerdict(False, seen, got, (
                    f"the BPF programs saw {s} {kind} waits in the last {len(self._window)} intervals but {a} "
                    "reached the agent, so its figures on this kernel are incomplete: please report it with "
                    "the output of 'slatrace check --json'"))
        skipped = sum(self._skipped)
        if skipped > self.slack + self.tolerance * seen:
            return TallyVerdict(False, seen, got, (
                f"the kernel skipped slatrace's BPF programs {skipped} times in the last {len(self._window)} "
                "intervals (another BPF program, or on classic tracepoints a BPF map operation, was running on "
                "that CPU), so waits may be missing from its figures; on BTF-typed or raw tracepoints (--attach-mode "
                "btf or raw) a "
                "program is skipped only where it would run inside itself"))
        return TallyVerdict(True, seen, got, f"{got} of {seen} waits the BPF programs saw reached the agent")
