"""What the probe hands to the store: what the kernel counted over one interval.

The probe drains its counting maps at every snapshot, so histograms, blame
pairs and per-cgroup counters are the counts since the previous snapshot (or
since load, for the first). Error and program-cost counters are the kernel's
cumulative ones; the store takes their deltas. Nothing here imports bcc, so
everything downstream is testable with recorded data.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, make_dataclass
from typing import NamedTuple

import numpy as np

from agent.probe import layout

# Re-exported: the kinds and ids snapshots are made of.
from agent.probe.layout import (
    BLAME_HOLDER,
    BLAME_PREEMPTED,
    CGROUP_FIELDS,
    EV_IOWAIT,
    EV_LIMIT,
    EV_MIGRATE,
    EV_PREEMPTED,
    EV_RUNQ,
    EV_WAKE,
    EV_YIELD,
    HIST_IOWAIT,
    HIST_RUNQ,
    HIST_RUNQ_LIMIT,
    KERNEL_CGID,
    NR_HIST_KINDS,
)

# The kinds of a run-queue wait's record (EV_LIMIT holds the part of one
# that a CPU limit held; its rest is one of these).
RUNQ_KINDS = (EV_RUNQ, EV_PREEMPTED, EV_YIELD)


class Bucket(NamedTuple):
    """One histogram slot. A named tuple: a node makes hundreds of thousands a
    second, and tuples are built in C."""

    count: int
    sum_ns: int


class PairCounters(NamedTuple):
    """Waits of a victim blamed on one culprit: how many, and how long."""

    count: int
    wait_ns: int


# One cgroup's counters of an interval, a field per cgroup_val member (0 when
# not given), so a counter added to the struct needs nothing here. Among them
# the waits a full map could not take, so a record can say what share of waits
# its figures cover.
CgroupCounters = make_dataclass("CgroupCounters", [(f, int, 0) for f in CGROUP_FIELDS], frozen=True)


@dataclass(frozen=True)
class ProgramStats:
    """In-kernel cost of one BPF program (kernel.bpf_stats_enabled), and the
    runs the kernel skipped (always counted, from 5.12)."""

    run_cnt: int
    run_time_ns: int
    # Times the kernel did not run the program on its tracepoint because a BPF
    # program or map operation was in progress on that CPU: an event lost.
    misses: int = 0



@dataclass(frozen=True)
class SchedEvent:
    """One wait of a task in a watched cgroup, on CLOCK_MONOTONIC; or several
    back-to-back short preempted waits of one thread behind the same culprit
    (`waits` of them, `wait_ns` in all between start_ns and end_ns)."""

    cgid: int
    kind: int
    start_ns: int
    end_ns: int
    # who kept the CPU: the preemptor (EV_PREEMPTED), who ran instead
    # (EV_YIELD), the holder (EV_RUNQ), self (EV_LIMIT); the waker's process
    # id for a wake-up across processes (EV_WAKE)
    other_cgid: int
    tid: int
    wait_ns: int | None = None   # None: end_ns - start_ns, one wait
    waits: int = 1

    @property
    def waited_ns(self) -> int:
        return self.end_ns - self.start_ns if self.wait_ns is None else self.wait_ns


# The ring buffer's record of one wait, taken from layout's mirror of struct
# sched_event: the events of a drain are decoded in one pass as these rows.
EVENT_ROW = np.dtype(layout.SchedEvent)


def event_rows(events: Iterable[SchedEvent]) -> np.ndarray:
    """Events as EVENT_ROW rows, as the probe drains them."""
    return np.array([(e.cgid, e.other_cgid, e.start_ns, e.end_ns, e.waited_ns, e.tid, e.kind, e.waits)
                     for e in events], dtype=EVENT_ROW)


def events_of(rows: np.ndarray) -> list[SchedEvent]:
    """EVENT_ROW rows as events, one object each."""
    return [SchedEvent(cgid, kind, start, end, other, tid, None if waits == 1 and wait == end - start else wait, waits)
            for cgid, other, start, end, wait, tid, kind, waits in rows.tolist()]


# Column layouts of a drained snapshot: one row per map entry.
HIST_ROW = np.dtype([("cgid", np.uint64), ("kind", np.uint16), ("slot", np.uint32), ("count", np.int64),
                     ("sum_ns", np.int64)])
BLAME_ROW = np.dtype([("victim", np.uint64), ("culprit", np.uint64), ("kind", np.uint16), ("count", np.int64),
                      ("wait_ns", np.int64)])
CGROUP_ROW = np.dtype([("cgid", np.uint64)] + [(f, np.int64) for f in CGROUP_FIELDS])


@dataclass(frozen=True)
class ProbeSnapshot:
    """One drained interval of kernel counts, as columns (numpy structured
    arrays, one row per map entry): a node's worth of entries moves from the
    kernel to the store without a Python object per entry. The dict views
    (hists, pairs, holders, cgroups) are for tests and tools."""

    mono_ns: int                 # CLOCK_MONOTONIC when the maps were read
    wall: float                  # Unix seconds at the same instant
    # Counts of the interval (drained):
    hist_rows: np.ndarray = field(default_factory=lambda: np.empty(0, HIST_ROW))
    blame_rows: np.ndarray = field(default_factory=lambda: np.empty(0, BLAME_ROW))
    cgroup_rows: np.ndarray = field(default_factory=lambda: np.empty(0, CGROUP_ROW))
    # Cumulative since load:
    errors: dict[str, int] = field(default_factory=dict)          # map name -> failed updates
    programs: dict[str, ProgramStats] = field(default_factory=dict)  # program -> cost
    # Waits the programs saw in the interval (run-queue, D-state), counted
    # before the caches and maps they then pass through; None where not read.
    tally: tuple[int, int] | None = None

    @classmethod
    def from_dicts(cls, mono_ns: int, wall: float,
                   hists: Mapping[tuple[int, int], Mapping[int, Bucket]] | None = None,
                   pairs: Mapping[tuple[int, int], PairCounters] | None = None,
                   holders: Mapping[tuple[int, int], PairCounters] | None = None,
                   cgroups: Mapping[int, CgroupCounters] | None = None,
                   errors: dict[str, int] | None = None,
                   programs: dict[str, ProgramStats] | None = None) -> ProbeSnapshot:
        """From the dict shapes: hists (cgroup, kind) -> {slot: Bucket};
        pairs (victim, preemptor; 0 = unknown) and holders (victim, holder of
        the CPU; 0 = idle) -> PairCounters; cgroups cgroup -> CgroupCounters."""
        h = [(cg, kind, slot, b.count, b.sum_ns) for (cg, kind), slots in (hists or {}).items()
             for slot, b in slots.items()]
        b = [(v, c, BLAME_PREEMPTED, p.count, p.wait_ns) for (v, c), p in (pairs or {}).items()]
        b += [(v, c, BLAME_HOLDER, p.count, p.wait_ns) for (v, c), p in (holders or {}).items()]
        c = [(cg, *(getattr(cc, f) for f in CGROUP_FIELDS)) for cg, cc in (cgroups or {}).items()]
        return cls(mono_ns, wall, np.array(h, HIST_ROW), np.array(b, BLAME_ROW), np.array(c, CGROUP_ROW),
                   dict(errors or {}), dict(programs or {}))

    @functools.cached_property
    def hists(self) -> dict[tuple[int, int], dict[int, Bucket]]:
        out: dict[tuple[int, int], dict[int, Bucket]] = {}
        for cg, kind, slot, count, total in self.hist_rows.tolist():
            out.setdefault((cg, kind), {})[slot] = Bucket(count, total)
        return out

    def _blame(self, kind: int) -> dict[tuple[int, int], PairCounters]:
        return {(v, c): PairCounters(n, w) for v, c, k, n, w in self.blame_rows.tolist() if k == kind}

    @functools.cached_property
    def pairs(self) -> dict[tuple[int, int], PairCounters]:
        return self._blame(BLAME_PREEMPTED)

    @functools.cached_property
    def holders(self) -> dict[tuple[int, int], PairCounters]:
        return self._blame(BLAME_HOLDER)

    @functools.cached_property
    def cgroups(self) -> dict[int, CgroupCounters]:
        return {cg: CgroupCounters(*rest) for cg, *rest in self.cgroup_rows.tolist()}


def carry_over(earlier: ProbeSnapshot, later: ProbeSnapshot) -> ProbeSnapshot:
    """One drained snapshot holding the counts of two consecutive ones, stamped
    with the later's time: an interval that could not be recorded is folded
    into the next instead of being lost (its counts are gone from the kernel).
    Rows of the same key may repeat; the store sums them."""
    return ProbeSnapshot(later.mono_ns, later.wall,
                         np.concatenate([earlier.hist_rows, later.hist_rows]),
                         np.concatenate([earlier.blame_rows, later.blame_rows]),
                         np.concatenate([earlier.cgroup_rows, later.cgroup_rows]),
                         later.errors, later.programs,
                         None if earlier.tally is None or later.tally is None else
                         (earlier.tally[0] + later.tally[0], earlier.tally[1] + later.tally[1]))
