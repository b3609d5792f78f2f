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
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from agent.probe.snapshot import (
    BLAME_PREEMPTED,
    CGROUP_FIELDS,
    NR_HIST_KINDS,
    ProbeSnapshot,
    ProgramStats,
    carry_over,
)
from agent.store.histogram import HIST_SLOTS
from agent.store.table import OTHER_CULPRITS, ServiceInterval, ServiceTable, fold_culprits, merge, sum_by

# Service name for preemptions whose preemptor cgroup the kernel did not know.
UNKNOWN_SERVICE = "unknown"
# Holder of a CPU that was idle until the waiting task got it.
IDLE = "idle"
# What held the part of a wait during which the waiter's own CPU limit
# throttled it (the kernel's EV_LIMIT events): no service, its own limit.
CPU_LIMIT = "cpu_limit"
# Intervals younger than FINE_S seconds are kept one by one; older ones are
# merged into one record per BLOCK_S seconds.
FINE_S = 120.0
BLOCK_S = 60.0
# Culprits beyond the largest CULPRITS_KEPT of a victim in one interval are
# summed under OTHER_CULPRITS (agent/store/table.py).
CULPRITS_KEPT = 8
# ... and beyond the largest CULPRITS_SUMMED of a victim over a window or since start.
CULPRITS_SUMMED = 32
# Intervals at most waiting to be merged into the totals.
PENDING_MAX = 10
# Where totals of services beyond max_services are counted (the resolver's name too).
OTHER_SERVICE = "other"

_EMPTY: Mapping = MappingProxyType({})


# A window is a sum of intervals and has the same shape.
ServiceWindow = ServiceInterval


@dataclass(frozen=True)
class IntervalRecord:
    start: float           # Unix seconds of the earlier snapshot
    end: float             # Unix seconds of the later snapshot
    start_mono_ns: int
    end_mono_ns: int
    table: ServiceTable    # every service's figures, as columns
    errors: Mapping[str, int]  # map name -> failed updates during the interval
    coarse: bool = False       # several intervals merged into one block (older than FINE_S)

    @property
    def services(self) -> Mapping[str, ServiceInterval]:
        """service -> its figures over the interval (built when first read)."""
        return self.table.services


@dataclass(frozen=True)
class Window:
    """Merged intervals; start/end are what the intervals actually cover."""

    start: float
    end: float
    services: Mapping[str, ServiceWindow]
    intervals: int
    errors: Mapping[str, int]
    table: ServiceTable | None = None   # the same figures as columns, for readers of every service


def _delta(prev: int | None, cur: int) -> int:
    """Growth of a cumulative counter; a counter that went down was re-created."""
    if prev is None or cur < prev:
        return cur
    return cur - prev


def _sum_errors(records: Iterable[IntervalRecord]) -> dict[str, int]:
    errors: dict[str, int] = {}
    for rec in records:
        for name, n in rec.errors.items():
            errors[name] = errors.get(name, 0) + n
    return errors


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
        self._totals = ServiceTable.empty()
        # Intervals not yet merged into the totals: merging once per read (a
        # scrape every 15 s) instead of once per interval saves most of the
        # totals' cost on a node; they are merged at the latest every
        # PENDING_MAX intervals, or when a service is forgotten.
        self._pending: list[ServiceTable] = []
        self._last_seen: dict[str, float] = {}   # service -> end of its newest interval (the totals' services)
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
                table, errors = self._interval(prev, snapshot, service_of)
            except BaseException:
                self._carry = snapshot
                raise
            # Consecutive intervals of a steady node name the same services:
            # sharing one names tuple lets merges map it once.
            latest = self._records[-1].table.names if self._records else None
            if latest is not None and table.names == latest:
                table = table.renamed(latest)
            record = IntervalRecord(
                start=prev.wall,
                end=snapshot.wall,
                start_mono_ns=prev.mono_ns,
                end_mono_ns=snapshot.mono_ns,
                table=table,
                errors=MappingProxyType(errors),
            )
            # The merges run outside the readers' lock; only this thread writes.
            coarse = self._coarsened(record.end)
            totals, pending, last_seen = self._added_to_totals(record)
            with self._lock:
                self._records.append(record)
                if coarse is not None:
                    self._replace_oldest_fine(*coarse)
                horizon = record.end - self._retention_s
                while self._records and self._records[0].end < horizon:
                    self._records.popleft()
                self._totals, self._pending, self._last_seen = totals, pending, last_seen
                for name, n in errors.items():
                    self._error_totals[name] = self._error_totals.get(name, 0) + n
                self._programs = MappingProxyType(dict(snapshot.programs))
                self._prev = snapshot
                self._collected += 1
            return record

    def _coarsened(self, now: float) -> tuple[int, IntervalRecord] | None:
        """The oldest fine interval once it is older than the fine horizon,
        merged into the coarse record of its block: (index of the first record
        replaced, the merge).

        A node's worth of services times the retention in one-second records
        would take gigabytes; intervals older than FINE_S are kept as one
        record per BLOCK_S instead, so a window reaching further back starts
        on a block boundary. Each interval is folded in as it ages, one merge
        per poll, rather than a whole block at once (a spike of a minute's
        worth of merging in one poll)."""
        recs = self._records
        i = next((k for k, r in enumerate(recs) if not r.coarse), len(recs))
        if i == len(recs) or recs[i].end >= now - FINE_S:
            return None
        fine = recs[i]
        block = math.floor(fine.start / BLOCK_S)
        taken = [fine]
        if i > 0 and math.floor(recs[i - 1].start / BLOCK_S) == block:
            taken.insert(0, recs[i - 1])
            i -= 1
        merged = IntervalRecord(start=taken[0].start, end=fine.end, start_mono_ns=taken[0].start_mono_ns,
                                end_mono_ns=fine.end_mono_ns,
                                table=merge([r.table for r in taken], CULPRITS_SUMMED),
                                errors=MappingProxyType(_sum_errors(taken)), coarse=True)
        return i, merged

    def _replace_oldest_fine(self, i: int, merged: IntervalRecord) -> None:
        """Swap the records the merge covers (at i, and the fine one after a coarse one)."""
        recs = list(self._records)
        recs[i:i + (2 if recs[i].coarse else 1)] = [merged]
        self._records = deque(recs)

    @staticmethod
    def _interval(
        prev: ProbeSnapshot, cur: ProbeSnapshot, service_of: Callable[[int], str]
    ) -> tuple[ServiceTable, dict[str, int]]:
        """One interval's table, from the snapshot's columns: each cgroup is
        named once, then rows are summed per service with array operations."""
        h = cur.hist_rows[(cur.hist_rows["count"] != 0) | (cur.hist_rows["sum_ns"] != 0)]
        if np.any(h["kind"] >= NR_HIST_KINDS):
            bad = h[h["kind"] >= NR_HIST_KINDS][0]
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
        # Culprits beyond a victim's largest of the interval.
        other = index.setdefault(OTHER_CULPRITS, len(index))
        n = len(index)

        def svc(col: np.ndarray) -> np.ndarray:
            return of_cgid[np.searchsorted(cgids, col)] if len(col) else np.empty(0, np.int64)

        # Which cgroups did something for each service: the services of the interval.
        active_cg = np.unique(np.concatenate([h["cgid"], b["victim"], c["cgid"]]))
        cg_svc = svc(active_cg)
        order = np.lexsort((active_cg, cg_svc))
        cg_svc, active_cg = cg_svc[order], active_cg[order]

        key = (svc(h["cgid"]) * NR_HIST_KINDS + h["kind"].astype(np.int64)) * HIST_SLOTS + h["slot"].astype(np.int64)
        key, counts, sums = sum_by(key, h["count"], h["sum_ns"])
        hsvc, rest = np.divmod(key, NR_HIST_KINDS * HIST_SLOTS)
        hkind, hslot = np.divmod(rest, HIST_SLOTS)

        preempted = (b["kind"] == BLAME_PREEMPTED).astype(np.int64)
        culprit = np.where(b["culprit"] == 0, np.where(preempted == 1, unknown, idle), 0)
        known = b["culprit"] != 0
        culprit[known] = svc(b["culprit"][known])
        bkey, bcount, bwait = sum_by((svc(b["victim"]) * n + culprit) * 2 + preempted, b["count"], b["wait_ns"])
        pair, pre = np.divmod(bkey, 2)
        victim, culprit = np.divmod(pair, n)
        # Blame grows with active services, not services squared: per victim
        # and kind, the CULPRITS_KEPT largest culprits of the interval keep
        # their name, the rest are summed under OTHER_CULPRITS.
        victim, culprit, pre, bcount, bwait = fold_culprits(victim, culprit, pre, bcount, bwait,
                                                            CULPRITS_KEPT, other)

        counters = np.zeros((n, len(CGROUP_FIELDS)), np.int64)
        if len(c):
            np.add.at(counters, svc(c["cgid"]), np.stack([c[f] for f in CGROUP_FIELDS], axis=1))

        table = ServiceTable(tuple(index), np.unique(cg_svc), hsvc, hkind, hslot, counts, sums, victim, culprit,
                             pre, bcount, bwait, counters, cg_svc, active_cg)
        errors = {}
        for map_name, k in cur.errors.items():
            d = _delta(prev.errors.get(map_name), k)
            if d:
                errors[map_name] = d
        return table.compacted(), errors

    def _added_to_totals(self, record: IntervalRecord) -> tuple[ServiceTable, list[ServiceTable], dict[str, float]]:
        """The totals and their pending intervals with one interval added, the
        services unseen for the retention forgotten, and when each kept
        service was last seen.

        Beyond max_services, a new name's figures (as a service and as a
        culprit) are counted under OTHER_SERVICE."""
        t = record.table
        last_seen = dict(self._last_seen)
        names = list(t.names)
        others: int | None = None   # unreserved names kept, counted once per interval
        for i in t.active.tolist():
            name = names[i]
            if name in last_seen or self._max_services is None or name in self._reserved:
                continue
            if others is None:
                others = sum(1 for k in last_seen if k != OTHER_SERVICE and k not in self._reserved)
            # Places are kept for "other" and every reserved name.
            if name != OTHER_SERVICE and others < self._max_services - 1 - len(self._reserved):
                others += 1
            else:
                names[i] = OTHER_SERVICE
        if others is not None:
            t = t.renamed(names)
        for i in t.active.tolist():
            last_seen[names[i]] = record.end
        pending = [*self._pending, t]
        totals = self._totals
        horizon = record.end - self._retention_s
        gone = {name for name, seen in last_seen.items() if seen < horizon}
        if gone or len(pending) >= PENDING_MAX:
            totals, pending = merge([totals, *pending], CULPRITS_SUMMED), []
        if gone:
            for name in gone:
                del last_seen[name]
            totals = totals.without(gone)
        return totals, pending, last_seen

    def _merged_totals(self) -> ServiceTable:
        """The totals with the pending intervals merged in (readers' lock held)."""
        if self._pending:
            self._totals, self._pending = merge([self._totals, *self._pending], CULPRITS_SUMMED), []
        return self._totals

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
        if not recs:
            return Window(now, now, _EMPTY, 0, _EMPTY, ServiceTable.empty())
        tables = [r.table if service is None else r.table.only(service) for r in recs]
        table = merge(tables, CULPRITS_SUMMED, blame)
        return Window(
            start=min(r.start for r in recs),
            end=max(r.end for r in recs),
            services=table.services,
            intervals=len(recs),
            errors=MappingProxyType(_sum_errors(recs)),
            table=table,
        )

    def totals(self) -> Mapping[str, ServiceWindow]:
        """Per-service sums since each service was first seen, for the services
        seen within the retention; a service's sums only grow while it is kept."""
        return self.totals_table().services

    def totals_table(self) -> ServiceTable:
        """The totals as columns, for readers of every service."""
        with self._lock:
            return self._merged_totals()

    def cgroups(self, service: str) -> frozenset[int]:
        """The cgroup ids a service's totals were counted from (without merging them)."""
        with self._lock:
            tables = [self._totals, *self._pending]
        return frozenset().union(*(t.cgroups_of(service) for t in tables))

    def services(self) -> frozenset[str]:
        """The services the totals hold (without merging them)."""
        with self._lock:
            return frozenset(self._last_seen)

    def error_totals(self) -> dict[str, int]:
        """Failed map updates per map since the store started."""
        with self._lock:
            return dict(self._error_totals)

    def programs(self) -> Mapping[str, ProgramStats]:
        """In-kernel program costs from the newest snapshot (cumulative)."""
        with self._lock:
            return self._programs
