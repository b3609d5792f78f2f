"""What the probe hands to the store: cumulative kernel counters at one instant.

Counters are cumulative since the programs were loaded and already summed over
CPUs; the store turns consecutive snapshots into per-interval deltas. Nothing
here imports bcc, so everything downstream is testable with recorded data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# hist kinds, as in bpf/sched.h
HIST_RUNQ = 0
HIST_IOWAIT = 1
# The pseudo cgroup id kernel threads are counted under (bpf/sched.h).
KERNEL_CGID = 0xFFFFFFFFFFFFFFFE


@dataclass(frozen=True)
class Bucket:
    count: int
    sum_ns: int


@dataclass(frozen=True)
class PairCounters:
    """Preemptions of a victim cgroup by a preemptor cgroup."""

    count: int
    wait_ns: int


@dataclass(frozen=True)
class CgroupCounters:
    migrations: int = 0
    untraced_switch_in: int = 0
    untraced_switch_out: int = 0
    untraced_wakeup: int = 0


@dataclass(frozen=True)
class ProgramStats:
    """In-kernel cost of one BPF program (kernel.bpf_stats_enabled)."""

    run_cnt: int
    run_time_ns: int


# sched_event kinds, as in bpf/sched.h
EV_RUNQ = 0
EV_PREEMPTED = 1
EV_IOWAIT = 2
EV_MIGRATE = 3


@dataclass(frozen=True)
class SchedEvent:
    """One wait of a task in a watched cgroup, on CLOCK_MONOTONIC."""

    cgid: int
    kind: int
    start_ns: int
    end_ns: int
    other_cgid: int   # the preemptor for EV_PREEMPTED, else 0
    tid: int


@dataclass(frozen=True)
class ProbeSnapshot:
    mono_ns: int                 # CLOCK_MONOTONIC when the maps were read
    wall: float                  # Unix seconds at the same instant
    # (cgroup id, HIST_RUNQ | HIST_IOWAIT) -> {slot: Bucket}
    hists: dict[tuple[int, int], dict[int, Bucket]] = field(default_factory=dict)
    # (victim cgroup id, preemptor cgroup id) -> PairCounters; preemptor 0 = unknown
    pairs: dict[tuple[int, int], PairCounters] = field(default_factory=dict)
    # (victim cgroup id, cgroup that held the CPU until the wait ended) -> the
    # run-queue waits that followed a wakeup; holder 0 = the CPU was idle
    holders: dict[tuple[int, int], PairCounters] = field(default_factory=dict)
    cgroups: dict[int, CgroupCounters] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)          # map name -> failed updates
    programs: dict[str, ProgramStats] = field(default_factory=dict)  # program -> cost
