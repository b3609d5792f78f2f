"""Time-indexed store: cumulative probe snapshots in, per-service intervals out.

The probe drains the kernel's counters keyed by cgroup id at every snapshot, so
each snapshot is one interval of counts. The store names the cgroups after
their services and keeps a ring of intervals for the retention window, so any
"last N seconds" question is a merge of intervals.

One thread ingests, any number read. Everything a reader gets is immutable.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from agent.snapshot import (
    BLAME_PREEMPTED,
    CGROUP_FIELDS,
    HIST_IOWAIT,
    HIST_RUNQ,
    PairCounters,
    ProbeSnapshot,
    ProgramStats,
    carry_over,
)
from agent.store.histogram import HIST_SLOTS, Histogram

# Service name for preemptions whose preemptor cgroup the kernel did not know.
UNKNOWN_SERVICE = "unknown"
# Holder of a CPU that was idle until the waiting task got it.
IDLE = "idle"
# Intervals younger than FINE_S seconds are kept one by one; older ones are
# merged into one record per BLOCK_S seconds.
FINE_S = 120.0
BLOCK_S = 60.0
# Culprits beyond the largest CULPRITS_KEPT of a victim in one interval.
OTHER_CULPRITS = "other"
CULPRITS_KEPT = 8
# ... and beyond the largest CULPRITS_SUMMED of a victim over a window or since start.
CULPRITS_SUMMED = 32
# Where totals of services beyond max_services are counted (the resolver's name too).
OTHER_SERVICE = "other"

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
    coarse: bool = False       # several intervals merged into one block (older than FINE_S)


@dataclass(frozen=True)
class Window:
    """Merged intervals; start/end are what the intervals actually cover."""

    start: float
    end: float
    services: Mapping[str, ServiceWindow]
    intervals: int
    errors: Mapping[str, int]


class _ServiceSum:
    """Mutable accumulator for one service; frozen into a ServiceInterval.

    Histograms are collected and summed once at freeze time (one array pass
    for a whole window instead of one merge per interval)."""

    __slots__ = ("runq", "iowait", "pairs", "holders", "counters", "cgroups")

    def __init__(self) -> None:
        self.runq: list[Histogram] = []
        self.iowait: list[Histogram] = []
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

    def add_interval(self, s: ServiceInterval, blame: bool = True) -> None:
        self.runq.append(s.runq)
        self.iowait.append(s.iowait)
        if len(self.runq) > 64:  # long-lived totals: keep the lists short
            self.runq = [Histogram.total(self.runq)]
            self.iowait = [Histogram.total(self.iowait)]
        if blame:
            for table, pairs in ((self.pairs, s.preempted_by), (self.holders, s.waited_behind)):
                for name, (count, wait) in pairs.items():
                    cell = table.get(name)
                    if cell is None:
                        table[name] = [count, wait]
                    else:
                        cell[0] += count
                        cell[1] += wait
                if len(table) > 2 * CULPRITS_SUMMED:
                    _fold_small(table)
        for i, v in enumerate(
            (s.migrations, s.untraced_switch_in, s.untraced_switch_out, s.untraced_wakeup,
             s.lost_runq.count, s.lost_runq.wait_ns, s.lost_iowait.count, s.lost_iowait.wait_ns,
             s.lost_blame.count, s.lost_blame.wait_ns)
        ):
            self.counters[i] += v
        self.cgroups |= s.cgroups

    def freeze(self) -> ServiceInterval:
        return ServiceInterval(
            runq=Histogram.total(self.runq),
            iowait=Histogram.total(self.iowait),
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


def _fold_small(table: dict[str, list[int]]) -> None:
    """Keep the CULPRITS_SUMMED largest culprits by wait; sum the rest under
    OTHER_CULPRITS, so a long window or the totals stay bounded per victim."""
    ranked = sorted(table.items(), key=lambda kv: kv[1][1], reverse=True)
    other = table.get(OTHER_CULPRITS, [0, 0])
    kept = {name: cell for name, cell in ranked[:CULPRITS_SUMMED] if name != OTHER_CULPRITS}
    folded = [cell for name, cell in ranked[CULPRITS_SUMMED:] if name != OTHER_CULPRITS]
    table.clear()
    table.update(kept)
    table[OTHER_CULPRITS] = [other[0] + sum(c for c, _ in folded), other[1] + sum(w for _, w in folded)]


def _sum_by(keys: np.ndarray, *columns: np.ndarray) -> tuple[np.ndarray, ...]:
    """Unique keys (ascending) and each column summed per key, exactly (int64)."""
    if not len(keys):
        return (keys, *columns)
    order = np.argsort(keys, kind="stable")
    keys = keys[order]
    starts = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1])))
    return (keys[starts], *(np.add.reduceat(c[order], starts) for c in columns))


def _groups(group: np.ndarray) -> list[tuple[int, int, int]]:
    """(group value, start, stop) of each run of equal values in a sorted array."""
    if not len(group):
        return []
    edges = np.flatnonzero(group[1:] != group[:-1]) + 1
    starts = np.concatenate(([0], edges)).tolist()
    stops = np.concatenate((edges, [len(group)])).tolist()
    return [(int(group[a]), a, b) for a, b in zip(starts, stops)]


def _delta(prev: int | None, cur: int) -> int:
    """Growth of a cumulative counter; a counter that went down was re-created."""
    if prev is None or cur < prev:
        return cur
    return cur - prev


def _freeze_all(sums: Mapping[str, _ServiceSum]) -> Mapping[str, ServiceInterval]:
    return MappingProxyType({name: s.freeze() for name, s in sorted(sums.items())})


def _merge(records: Iterable[IntervalRecord], service: str | None,
           blame: bool = True) -> tuple[dict[str, _ServiceSum], dict[str, int]]:
    sums: dict[str, _ServiceSum] = {}
    errors: dict[str, int] = {}
    for rec in records:
        for name, s in rec.services.items():
            if service is None or name == service:
                sums.setdefault(name, _ServiceSum()).add_interval(s, blame)
        for name, n in rec.errors.items():
            errors[name] = errors.get(name, 0) + n
    return sums, errors


class Store:
    """Ring of per-service intervals covering the retention window, plus totals.

    A service's totals only grow while it is seen: Prometheus counters are
    built from them, and a counter that went down would read as a restart.
    A service not seen (no activity in an interval) for the retention, as the
    newest interval's end tells (the clock the ring is trimmed by), is
    forgotten with its totals, so the exported label set follows the live
    services; if it comes back its counters start again from zero, which
    Prometheus reads as a counter reset. At most max_services names are kept,
    "other" included: the totals of any further name are added to "other".
    The names in `reserved` (those the config rules give) always have a place.
    """

    def __init__(self, retention_s: float, clock: Callable[[], float] = time.time,
                 max_services: int | None = None, reserved: frozenset[str] = frozenset()) -> None:
        if retention_s <= 0:
            raise ValueError(f"retention must be positive, got {retention_s}")
        if max_services is not None and max_services < 1:
            raise ValueError(f"max_services must be at least 1, got {max_services}")
        self._retention_s = retention_s
        self._max_services = max_services
        self._reserved = reserved
        self._clock = clock
        self._lock = threading.Lock()          # guards everything readers see
        self._ingest_lock = threading.Lock()   # serialises writers
        self._prev: ProbeSnapshot | None = None
        self._carry: ProbeSnapshot | None = None  # counts of an interval that failed to resolve
        self._records: deque[IntervalRecord] = deque()
        self._collected = 0
        self._totals: dict[str, _ServiceSum] = {}
        self._last_seen: dict[str, float] = {}   # service -> end of its newest interval
        # Totals frozen per service, refrozen only for services an interval
        # changed: on a churning node most kept services are idle until forgotten.
        self._frozen_totals: dict[str, ServiceWindow] = {}
        self._changed_totals: set[str] = set()
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
            coarse = self._coarsened(record.end)
            with self._lock:
                self._records.append(record)
                if coarse is not None:
                    self._replace_oldest_fine(*coarse)
                horizon = record.end - self._retention_s
                while self._records and self._records[0].end < horizon:
                    self._records.popleft()
                self._add_totals(record)
                for name, n in errors.items():
                    self._error_totals[name] = self._error_totals.get(name, 0) + n
                self._programs = MappingProxyType(dict(snapshot.programs))
                self._prev = snapshot
                self._collected += 1
            return record

    def _coarsened(self, now: float) -> tuple[int, IntervalRecord] | None:
        """The oldest block of fine intervals that is complete and older than
        the fine horizon, merged into one record: (its index, the merge).

        A node's worth of services times the retention in one-second records
        would take gigabytes; intervals older than FINE_S are kept as one
        record per BLOCK_S instead, so a window reaching further back starts
        on a block boundary. Runs outside the readers' lock (the merge is the
        expensive part); only the ingest thread changes the ring."""
        recs = self._records
        i = next((k for k, r in enumerate(recs) if not r.coarse), len(recs))
        block = math.floor(recs[i].start / BLOCK_S) if i < len(recs) else None
        j = i
        while j < len(recs) and math.floor(recs[j].start / BLOCK_S) == block:
            j += 1
        # Complete (a later interval exists) and wholly past the fine horizon.
        if block is None or j == len(recs) or recs[j - 1].end >= now - FINE_S:
            return None
        taken = list(recs)[i:j]
        sums, errors = _merge(taken, None)
        merged = IntervalRecord(start=taken[0].start, end=taken[-1].end, start_mono_ns=taken[0].start_mono_ns,
                                end_mono_ns=taken[-1].end_mono_ns, services=_freeze_all(sums),
                                errors=MappingProxyType(errors), coarse=True)
        return i, merged

    def _replace_oldest_fine(self, i: int, merged: IntervalRecord) -> None:
        """Swap the fine records the merged block covers, from index i on."""
        recs = list(self._records)
        j = i
        while j < len(recs) and not recs[j].coarse and recs[j].end <= merged.end:
            j += 1
        recs[i:j] = [merged]
        self._records = deque(recs)

    @staticmethod
    def _interval(
        prev: ProbeSnapshot, cur: ProbeSnapshot, service_of: Callable[[int], str]
    ) -> tuple[dict[str, _ServiceSum], dict[str, int]]:
        """One interval per service, from the snapshot's columns: each cgroup is
        named once, then rows are summed per service with array operations."""
        h = cur.hist_rows[(cur.hist_rows["count"] != 0) | (cur.hist_rows["sum_ns"] != 0)]
        if np.any(h["kind"] > HIST_IOWAIT):
            bad = h[h["kind"] > HIST_IOWAIT][0]
            raise ValueError(f"unknown histogram kind {bad['kind']} for cgroup {bad['cgid']}")
        b = cur.blame_rows[(cur.blame_rows["count"] != 0) | (cur.blame_rows["wait_ns"] != 0)]
        c = cur.cgroup_rows
        if len(c):
            c = c[np.any(np.stack([c[f] != 0 for f in CGROUP_FIELDS]), axis=0)]

        cgids = np.unique(np.concatenate([h["cgid"], b["victim"], b["culprit"][b["culprit"] != 0], c["cgid"]]))
        index: dict[str, int] = {}
        of_cgid = np.array([index.setdefault(service_of(cg), len(index)) for cg in cgids.tolist()], np.int64)
        # Culprits the kernel did not know: no preemptor, or an idle CPU.
        unknown, idle = index.setdefault(UNKNOWN_SERVICE, len(index)), index.setdefault(IDLE, len(index))
        names = list(index)
        n = len(names)

        def svc(col: np.ndarray) -> np.ndarray:
            return of_cgid[np.searchsorted(cgids, col)] if len(col) else np.empty(0, np.int64)

        sums: dict[str, _ServiceSum] = {}

        def service(i: int) -> _ServiceSum:
            s = sums.get(names[i])
            if s is None:
                s = sums[names[i]] = _ServiceSum()
            return s

        # Which cgroups did something for each service.
        active = np.unique(np.concatenate([h["cgid"], b["victim"], c["cgid"]]))
        for cg, i in zip(active.tolist(), svc(active).tolist()):
            service(i).cgroups.add(cg)

        key = (svc(h["cgid"]) * 2 + h["kind"].astype(np.int64)) * HIST_SLOTS + h["slot"].astype(np.int64)
        key, counts, totals = _sum_by(key, h["count"], h["sum_ns"])
        slots = key % HIST_SLOTS
        spans = _groups(key // HIST_SLOTS)
        if spans:
            starts = np.array([a for _, a, _ in spans])
            group_counts = np.add.reduceat(counts, starts).tolist()
            group_sums = np.add.reduceat(totals, starts).tolist()
            for (group, a, z), gc, gs in zip(spans, group_counts, group_sums):
                hist = Histogram.from_arrays(slots[a:z], counts[a:z], totals[a:z], gc, gs)
                target = service(group // 2)
                (target.runq if group % 2 == HIST_RUNQ else target.iowait).append(hist)

        preempted = (b["kind"] == BLAME_PREEMPTED).astype(np.int64)
        culprit = np.where(b["culprit"] == 0, np.where(preempted == 1, unknown, idle), 0)
        known = b["culprit"] != 0
        culprit[known] = svc(b["culprit"][known])
        victim = svc(b["victim"])
        key, counts, waits = _sum_by((victim * n + culprit) * 2 + preempted, b["count"], b["wait_ns"])
        # Blame grows with active services, not services squared: per victim
        # and kind, the CULPRITS_KEPT largest culprits of the interval keep
        # their name, the rest are summed under OTHER_CULPRITS.
        group = key // (2 * n) * 2 + key % 2
        order = np.lexsort((-waits, group))
        group_sorted = group[order]
        first = np.flatnonzero(np.concatenate(([True], group_sorted[1:] != group_sorted[:-1]))) if len(key) else key
        rank = np.arange(len(key)) - np.repeat(first, np.diff(np.concatenate((first, [len(key)]))))
        folded = np.zeros(len(key), bool)
        folded[order[rank >= CULPRITS_KEPT]] = True
        if folded.any():
            other = index.setdefault(OTHER_CULPRITS, len(index))
            names = list(index)
            victim_k, rest = np.divmod(key, 2 * n)
            culprit_k = rest // 2
            culprit_k[folded] = other
            n2 = len(names)
            key, counts, waits = _sum_by((victim_k * n2 + culprit_k) * 2 + key % 2, counts, waits)
            n = n2
        pair, is_preempted = np.divmod(key, 2)
        victims, culprits = np.divmod(pair, n)
        for v, by, pre, count, wait in zip(victims.tolist(), culprits.tolist(), is_preempted.tolist(),
                                           counts.tolist(), waits.tolist()):
            target = sums.get(names[v]) or service(v)
            (target.pairs if pre else target.holders)[names[by]] = [count, wait]

        if len(c):
            per = np.zeros((n, len(CGROUP_FIELDS)), np.int64)
            np.add.at(per, svc(c["cgid"]), np.stack([c[f] for f in CGROUP_FIELDS], axis=1))
            for i in np.flatnonzero(per.any(axis=1)).tolist():
                target = service(i)
                for f, v in enumerate(per[i].tolist()):
                    target.counters[f] += v

        errors = {}
        for map_name, n in cur.errors.items():
            d = _delta(prev.errors.get(map_name), n)
            if d:
                errors[map_name] = d
        return sums, errors

    def _add_totals(self, record: IntervalRecord) -> None:
        """Adds an interval to the totals and forgets services unseen for the retention (lock held)."""
        others: int | None = None   # unreserved names kept, counted once per interval
        for name, s in record.services.items():
            key = name
            if name not in self._totals and self._max_services is not None and name not in self._reserved:
                if others is None:
                    others = sum(1 for n in self._totals if n != OTHER_SERVICE and n not in self._reserved)
                # Places are kept for "other" and every reserved name.
                if name != OTHER_SERVICE and others < self._max_services - 1 - len(self._reserved):
                    others += 1
                else:
                    key = OTHER_SERVICE
            self._totals.setdefault(key, _ServiceSum()).add_interval(s)
            self._last_seen[key] = record.end
            self._changed_totals.add(key)
        self._forget(record.end - self._retention_s)

    def _forget(self, horizon: float) -> None:
        """Drops the totals of services last seen before horizon (lock held)."""
        gone = [name for name, seen in self._last_seen.items() if seen < horizon]
        for name in gone:
            del self._last_seen[name]
            del self._totals[name]
            self._frozen_totals.pop(name, None)
            self._changed_totals.discard(name)

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

    def window(self, since_s: float, now: float | None = None, service: str | None = None,
               blame: bool = True) -> Window:
        """Merge of the intervals that ended after now - since_s.

        With no interval in range, start == end == now and services is empty.
        blame=False leaves preempted_by and waited_behind empty: quantile and
        SLO readers of a node's worth of services skip merging culprits.
        """
        if now is None:
            now = self._clock()
        return self._window(self.records(since_s, now), service, now, blame)

    def between(self, start: float, end: float, service: str | None = None) -> Window:
        """Merge of the intervals overlapping [start, end], e.g. one request's life."""
        with self._lock:
            recs = tuple(r for r in self._records if r.end > start and r.start < end)
        return self._window(recs, service, end)

    @staticmethod
    def _window(recs: tuple[IntervalRecord, ...], service: str | None, now: float, blame: bool = True) -> Window:
        sums, errors = _merge(recs, service, blame)
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
        """Per-service sums since each service was first seen, for the services
        seen within the retention; a service's sums only grow while it is kept."""
        with self._lock:
            # Frozen lazily: scrapes are rarer than intervals.
            for name in self._changed_totals:
                self._frozen_totals[name] = self._totals[name].freeze()
            self._changed_totals.clear()
            return dict(sorted(self._frozen_totals.items()))

    def error_totals(self) -> dict[str, int]:
        """Failed map updates per map since the store started."""
        with self._lock:
            return dict(self._error_totals)

    def programs(self) -> Mapping[str, ProgramStats]:
        """In-kernel program costs from the newest snapshot (cumulative)."""
        with self._lock:
            return self._programs
