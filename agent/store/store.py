"""Time-indexed store: cumulative probe snapshots in, per-service intervals out.

The probe drains the kernel's counters keyed by cgroup id at every snapshot, so
each snapshot is one interval of counts. The store names the cgroups after
their services and keeps a ring of intervals for the retention window, so any
"last N seconds" question is a merge of intervals.

One thread ingests, any number read. Everything a reader gets is immutable.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from agent.snapshot import (
    HIST_IOWAIT,
    HIST_RUNQ,
    Bucket,
    CgroupCounters,
    PairCounters,
    ProbeSnapshot,
    ProgramStats,
    carry_over,
)
from agent.store.histogram import Histogram

# Service name for preemptions whose preemptor cgroup the kernel did not know.
UNKNOWN_SERVICE = "unknown"
# Holder of a CPU that was idle until the waiting task got it.
IDLE = "idle"

_EMPTY: Mapping = MappingProxyType({})


@dataclass(frozen=True)
class ServiceInterval:
    """What one service's cgroups did over an interval (or a merged window)."""

    runq: Histogram
    iowait: Histogram
    # The victim's view: preemptor service -> preemptions of this service by it.
    preempted_by: Mapping[str, PairCounters]
    migrations: int
    untraced_switch_in: int
    untraced_switch_out: int
    untraced_wakeup: int
    cgroups: frozenset[int]
    # Run-queue waits after a wakeup, by the service that held the CPU until
    # they ended (IDLE: the CPU was idle). With preempted_by and lost_blame,
    # sums to runq.
    waited_behind: Mapping[str, PairCounters] = field(default_factory=lambda: _EMPTY)
    # What full kernel maps could not record (waits and their ns): runq and
    # iowait waits missing from the histograms, runq waits missing from blame.
    lost_runq: PairCounters = PairCounters(0, 0)
    lost_iowait: PairCounters = PairCounters(0, 0)
    lost_blame: PairCounters = PairCounters(0, 0)

    @property
    def coverage(self) -> float:
        """Share of run-queue waits the histogram holds (1.0 when nothing was lost)."""
        total = self.runq.count + self.lost_runq.count
        return self.runq.count / total if total else 1.0

    @property
    def preemptions(self) -> int:
        return sum(p.count for p in self.preempted_by.values())

    @property
    def preempted_wait_ns(self) -> int:
        return sum(p.wait_ns for p in self.preempted_by.values())


# A window is a sum of intervals and has the same shape.
ServiceWindow = ServiceInterval


@dataclass(frozen=True)
class IntervalRecord:
    start: float           # Unix seconds of the earlier snapshot
    end: float             # Unix seconds of the later snapshot
    start_mono_ns: int
    end_mono_ns: int
    services: Mapping[str, ServiceInterval]
    errors: Mapping[str, int]  # map name -> failed updates during the interval


@dataclass(frozen=True)
class Window:
    """Merged intervals; start/end are what the intervals actually cover."""

    start: float
    end: float
    services: Mapping[str, ServiceWindow]
    intervals: int
    errors: Mapping[str, int]


class _ServiceSum:
    """Mutable accumulator for one service; frozen into a ServiceInterval."""

    __slots__ = ("hists", "pairs", "holders", "counters", "cgroups")

    def __init__(self) -> None:
        self.hists: dict[int, dict[int, list[int]]] = {HIST_RUNQ: {}, HIST_IOWAIT: {}}
        self.pairs: dict[str, list[int]] = {}
        self.holders: dict[str, list[int]] = {}
        # migrations, untraced in/out/wakeup, then lost runq, iowait, blame (count, ns)
        self.counters = [0] * 10
        self.cgroups: set[int] = set()

    @staticmethod
    def _bump(table: dict, key: object, count: int, total: int) -> None:
        """Add to a [count, sum] cell."""
        cell = table.setdefault(key, [0, 0])
        cell[0] += count
        cell[1] += total

    def add_bucket(self, kind: int, slot: int, count: int, sum_ns: int) -> None:
        self._bump(self.hists[kind], slot, count, sum_ns)

    def add_pair(self, preemptor: str, count: int, wait_ns: int) -> None:
        self._bump(self.pairs, preemptor, count, wait_ns)

    def add_holder(self, holder: str, count: int, wait_ns: int) -> None:
        self._bump(self.holders, holder, count, wait_ns)

    def add_interval(self, s: ServiceInterval) -> None:
        for kind, hist in ((HIST_RUNQ, s.runq), (HIST_IOWAIT, s.iowait)):
            for slot, b in hist.items():
                self.add_bucket(kind, slot, b.count, b.sum_ns)
        for name, p in s.preempted_by.items():
            self.add_pair(name, p.count, p.wait_ns)
        for name, p in s.waited_behind.items():
            self.add_holder(name, p.count, p.wait_ns)
        for i, v in enumerate(
            (s.migrations, s.untraced_switch_in, s.untraced_switch_out, s.untraced_wakeup,
             s.lost_runq.count, s.lost_runq.wait_ns, s.lost_iowait.count, s.lost_iowait.wait_ns,
             s.lost_blame.count, s.lost_blame.wait_ns)
        ):
            self.counters[i] += v
        self.cgroups |= s.cgroups

    def freeze(self) -> ServiceInterval:
        def hist(kind: int) -> Histogram:
            return Histogram({s: Bucket(c, t) for s, (c, t) in self.hists[kind].items()})

        return ServiceInterval(
            runq=hist(HIST_RUNQ),
            iowait=hist(HIST_IOWAIT),
            preempted_by=MappingProxyType(
                {n: PairCounters(c, w) for n, (c, w) in sorted(self.pairs.items())}
            ),
            migrations=self.counters[0],
            untraced_switch_in=self.counters[1],
            untraced_switch_out=self.counters[2],
            untraced_wakeup=self.counters[3],
            cgroups=frozenset(self.cgroups),
            waited_behind=MappingProxyType(
                {n: PairCounters(c, w) for n, (c, w) in sorted(self.holders.items())}
            ),
            lost_runq=PairCounters(*self.counters[4:6]),
            lost_iowait=PairCounters(*self.counters[6:8]),
            lost_blame=PairCounters(*self.counters[8:10]),
        )


def _delta(prev: int | None, cur: int) -> int:
    """Growth of a cumulative counter; a counter that went down was re-created."""
    if prev is None or cur < prev:
        return cur
    return cur - prev


def _freeze_all(sums: Mapping[str, _ServiceSum]) -> Mapping[str, ServiceInterval]:
    return MappingProxyType({name: s.freeze() for name, s in sorted(sums.items())})


def _merge(records: Iterable[IntervalRecord], service: str | None) -> tuple[dict[str, _ServiceSum], dict[str, int]]:
    sums: dict[str, _ServiceSum] = {}
    errors: dict[str, int] = {}
    for rec in records:
        for name, s in rec.services.items():
            if service is None or name == service:
                sums.setdefault(name, _ServiceSum()).add_interval(s)
        for name, n in rec.errors.items():
            errors[name] = errors.get(name, 0) + n
    return sums, errors


class Store:
    """Ring of per-service intervals covering the retention window, plus totals.

    Totals since start never shrink: Prometheus counters are built from them,
    and a counter that went down would read as a restart.
    """

    def __init__(self, retention_s: float, clock: Callable[[], float] = time.time) -> None:
        if retention_s <= 0:
            raise ValueError(f"retention must be positive, got {retention_s}")
        self._retention_s = retention_s
        self._clock = clock
        self._lock = threading.Lock()          # guards everything readers see
        self._ingest_lock = threading.Lock()   # serialises writers
        self._prev: ProbeSnapshot | None = None
        self._carry: ProbeSnapshot | None = None  # counts of an interval that failed to resolve
        self._records: deque[IntervalRecord] = deque()
        self._collected = 0
        self._totals: dict[str, _ServiceSum] = {}
        self._frozen_totals: Mapping[str, ServiceWindow] | None = _EMPTY
        self._error_totals: dict[str, int] = {}
        self._programs: Mapping[str, ProgramStats] = _EMPTY

    def ingest(self, snapshot: ProbeSnapshot, service_of: Callable[[int], str]) -> IntervalRecord | None:
        """Record the interval a drained snapshot covers; the first is the baseline
        (the probe's load time: it carries no counts).

        If service_of raises, nothing is committed and the snapshot's counts
        (gone from the kernel by then) are carried into the next interval.
        """
        with self._ingest_lock:
            prev = self._prev
            if prev is None:
                with self._lock:
                    self._prev = snapshot
                    self._programs = MappingProxyType(dict(snapshot.programs))
                return None
            if self._carry is not None:
                snapshot = carry_over(self._carry, snapshot)
                self._carry = None
            try:
                services, errors = self._interval(prev, snapshot, service_of)
            except BaseException:
                self._carry = snapshot
                raise
            record = IntervalRecord(
                start=prev.wall,
                end=snapshot.wall,
                start_mono_ns=prev.mono_ns,
                end_mono_ns=snapshot.mono_ns,
                services=_freeze_all(services),
                errors=MappingProxyType(errors),
            )
            with self._lock:
                self._records.append(record)
                horizon = record.end - self._retention_s
                while self._records and self._records[0].end < horizon:
                    self._records.popleft()
                for name, s in record.services.items():
                    self._totals.setdefault(name, _ServiceSum()).add_interval(s)
                self._frozen_totals = None
                for name, n in errors.items():
                    self._error_totals[name] = self._error_totals.get(name, 0) + n
                self._programs = MappingProxyType(dict(snapshot.programs))
                self._prev = snapshot
                self._collected += 1
            return record

    @staticmethod
    def _interval(
        prev: ProbeSnapshot, cur: ProbeSnapshot, service_of: Callable[[int], str]
    ) -> tuple[dict[str, _ServiceSum], dict[str, int]]:
        names: dict[int, str] = {}

        def name(cgid: int) -> str:
            n = names.get(cgid)
            if n is None:
                n = names[cgid] = service_of(cgid)
            return n

        sums: dict[str, _ServiceSum] = {}

        def service(cgid: int) -> _ServiceSum:
            s = sums.setdefault(name(cgid), _ServiceSum())
            s.cgroups.add(cgid)
            return s

        for (cgid, kind), slots in cur.hists.items():
            if kind not in (HIST_RUNQ, HIST_IOWAIT):
                raise ValueError(f"unknown histogram kind {kind} for cgroup {cgid}")
            for slot, b in slots.items():
                if b.count or b.sum_ns:
                    service(cgid).add_bucket(kind, slot, b.count, b.sum_ns)

        for (victim, preemptor), p in cur.pairs.items():
            if p.count or p.wait_ns:
                service(victim).add_pair(UNKNOWN_SERVICE if preemptor == 0 else name(preemptor), p.count, p.wait_ns)

        for (victim, holder), p in cur.holders.items():
            if p.count or p.wait_ns:
                service(victim).add_holder(IDLE if holder == 0 else name(holder), p.count, p.wait_ns)

        for cgid, c in cur.cgroups.items():
            d = (c.migrations, c.untraced_switch_in, c.untraced_switch_out, c.untraced_wakeup,
                 c.lost_runq, c.lost_runq_ns, c.lost_iowait, c.lost_iowait_ns, c.lost_blame, c.lost_blame_ns)
            if any(d):
                s = service(cgid)
                for i, v in enumerate(d):
                    s.counters[i] += v

        errors = {}
        for map_name, n in cur.errors.items():
            d = _delta(prev.errors.get(map_name), n)
            if d:
                errors[map_name] = d
        return sums, errors

    # Readers.

    @property
    def intervals_collected(self) -> int:
        with self._lock:
            return self._collected

    def latest(self) -> IntervalRecord | None:
        with self._lock:
            return self._records[-1] if self._records else None

    def records(self, since_s: float, now: float | None = None) -> tuple[IntervalRecord, ...]:
        """Intervals that ended within the last since_s seconds before now."""
        horizon = (self._clock() if now is None else now) - since_s
        with self._lock:
            return tuple(r for r in self._records if r.end > horizon)

    def window(self, since_s: float, now: float | None = None, service: str | None = None) -> Window:
        """Merge of the intervals that ended after now - since_s.

        With no interval in range, start == end == now and services is empty.
        """
        if now is None:
            now = self._clock()
        return self._window(self.records(since_s, now), service, now)

    def between(self, start: float, end: float, service: str | None = None) -> Window:
        """Merge of the intervals overlapping [start, end], e.g. one request's life."""
        with self._lock:
            recs = tuple(r for r in self._records if r.end > start and r.start < end)
        return self._window(recs, service, end)

    @staticmethod
    def _window(recs: tuple[IntervalRecord, ...], service: str | None, now: float) -> Window:
        sums, errors = _merge(recs, service)
        if not recs:
            return Window(now, now, _EMPTY, 0, _EMPTY)
        return Window(
            start=min(r.start for r in recs),
            end=max(r.end for r in recs),
            services=_freeze_all(sums),
            intervals=len(recs),
            errors=MappingProxyType(errors),
        )

    def totals(self) -> dict[str, ServiceWindow]:
        """Per-service sums since the store started; they only ever grow."""
        with self._lock:
            if self._frozen_totals is None:
                # Frozen lazily: scrapes are rarer than intervals.
                self._frozen_totals = _freeze_all(self._totals)
            return dict(self._frozen_totals)

    def error_totals(self) -> dict[str, int]:
        """Failed map updates per map since the store started."""
        with self._lock:
            return dict(self._error_totals)

    def programs(self) -> Mapping[str, ProgramStats]:
        """In-kernel program costs from the newest snapshot (cumulative)."""
        with self._lock:
            return self._programs
