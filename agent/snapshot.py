"""What the probe hands to the store: what the kernel counted over one interval.

The probe drains its counting maps at every snapshot, so histograms, blame
pairs and per-cgroup counters are the counts since the previous snapshot (or
since load, for the first). Error and program-cost counters are the kernel's
cumulative ones; the store takes their deltas. Nothing here imports bcc, so
everything downstream is testable with recorded data.
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
    # Waits a full map could not take (bpf/sched.h cgroup_val): counted here so
    # a record can say what share of waits its figures cover.
    lost_runq: int = 0
    lost_runq_ns: int = 0
    lost_iowait: int = 0
    lost_iowait_ns: int = 0
    lost_blame: int = 0
    lost_blame_ns: int = 0


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
    # Counts of the interval (drained): hists, pairs, holders, cgroups.
    # (cgroup id, HIST_RUNQ | HIST_IOWAIT) -> {slot: Bucket}
    hists: dict[tuple[int, int], dict[int, Bucket]] = field(default_factory=dict)
    # (victim cgroup id, preemptor cgroup id) -> PairCounters; preemptor 0 = unknown
    pairs: dict[tuple[int, int], PairCounters] = field(default_factory=dict)
    # (victim cgroup id, cgroup that held the CPU until the wait ended) -> the
    # run-queue waits that followed a wakeup; holder 0 = the CPU was idle
    holders: dict[tuple[int, int], PairCounters] = field(default_factory=dict)
    cgroups: dict[int, CgroupCounters] = field(default_factory=dict)
    # Cumulative since load:
    errors: dict[str, int] = field(default_factory=dict)          # map name -> failed updates
    programs: dict[str, ProgramStats] = field(default_factory=dict)  # program -> cost


def _add_pairs(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, p in b.items():
        q = out.get(k)
        out[k] = p if q is None else PairCounters(q.count + p.count, q.wait_ns + p.wait_ns)
    return out


def carry_over(earlier: ProbeSnapshot, later: ProbeSnapshot) -> ProbeSnapshot:
    """One drained snapshot holding the counts of two consecutive ones, stamped
    with the later's time: an interval that could not be recorded is folded
    into the next instead of being lost (its counts are gone from the kernel)."""
    hists = {k: dict(v) for k, v in earlier.hists.items()}
    for key, slots in later.hists.items():
        mine = hists.setdefault(key, {})
        for slot, b in slots.items():
            old = mine.get(slot)
            mine[slot] = b if old is None else Bucket(old.count + b.count, old.sum_ns + b.sum_ns)
    cgroups = dict(earlier.cgroups)
    for cgid, c in later.cgroups.items():
        old = cgroups.get(cgid)
        cgroups[cgid] = c if old is None else CgroupCounters(
            *(getattr(old, f) + getattr(c, f) for f in CgroupCounters.__dataclass_fields__))
    return ProbeSnapshot(mono_ns=later.mono_ns, wall=later.wall, hists=hists,
                         pairs=_add_pairs(earlier.pairs, later.pairs),
                         holders=_add_pairs(earlier.holders, later.holders), cgroups=cgroups,
                         errors=later.errors, programs=later.programs)
