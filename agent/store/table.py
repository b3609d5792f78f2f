"""Columnar per-service figures of one interval, a window or the totals.

A node runs a thousand services. Building a Python object per service per
interval, and again per window, cost more than reading the kernel's maps did;
a ServiceTable keeps every service's histograms, blame and counters in a few
numpy columns indexed by a position in `names`, so merging sixty intervals or
adding one to the totals is a concatenation and one sort. A per-service
object (ServiceInterval) is built only for the service a reader asks for,
through the `services` mapping.

Immutable once built: the store hands the same table to any number of reader
threads.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from agent.probe.layout import CGROUP_FIELDS
from agent.probe.snapshot import HIST_IOWAIT, HIST_RUNQ, HIST_RUNQ_LIMIT, NR_HIST_KINDS, PairCounters
from agent.store.histogram import HIST_SLOTS, Histogram, grouped_quantiles

# Culprits beyond a victim's largest are summed under this name.
OTHER_CULPRITS = "other"
# Columns of `counters`, in the kernel's cgroup_val order (agent/probe/layout.py).
N_COUNTERS = len(CGROUP_FIELDS)


def counter_row(row: Sequence[int]) -> dict[str, int]:
    """One row of `counters` (as a list) by field name: cgroup_val's."""
    return dict(zip(CGROUP_FIELDS, row))

_EMPTY: Mapping = MappingProxyType({})
_I64 = np.int64
_DTYPES = {
    "active": np.int32, "h_svc": np.int32, "h_kind": np.uint8, "h_slot": np.int16, "h_count": _I64, "h_sum": _I64,
    "b_victim": np.int32, "b_culprit": np.int32, "b_preempted": np.uint8, "b_count": _I64, "b_wait": _I64,
    "cg_svc": np.int32, "cg_id": np.uint64,
}


@dataclass(frozen=True)
class ServiceInterval:
    """What one service's cgroups did over an interval (or a merged window)."""

    runq: Histogram
    iowait: Histogram
    # The victim's view: preemptor service -> preemptions of this service by it.
    preempted_by: Mapping[str, PairCounters]
    cgroups: frozenset[int]
    # Every per-cgroup counter of the kernel, summed over the service's
    # cgroups: cgroup_val field -> count (agent/probe/layout.py CGROUP_FIELDS).
    counters: Mapping[str, int] = field(default_factory=lambda: MappingProxyType(dict.fromkeys(CGROUP_FIELDS, 0)))
    # Run-queue waits after a wakeup, by the service that held the CPU until
    # they ended ("idle": the CPU was idle). With preempted_by, lost_blame and
    # the part the service's CPU limit held (limited), sums to runq.
    waited_behind: Mapping[str, PairCounters] = field(default_factory=lambda: _EMPTY)
    # The waits of runq its CPU limit held in part (whole waits: the tail's cause).
    runq_limited: Histogram = field(default_factory=Histogram)

    @property
    def migrations(self) -> int:
        return self.counters.get("migrations", 0)

    # What full kernel maps could not record (waits and their ns): runq and
    # iowait waits missing from the histograms, runq waits missing from blame.
    @property
    def lost_runq(self) -> PairCounters:
        return self._lost("runq")

    @property
    def lost_iowait(self) -> PairCounters:
        return self._lost("iowait")

    @property
    def lost_blame(self) -> PairCounters:
        return self._lost("blame")

    @property
    def limited(self) -> PairCounters:
        """Run-queue waits the service's CPU limit held in part, and the ns it held them."""
        return PairCounters(self.counters.get("limited_runq", 0), self.counters.get("limited_runq_ns", 0))

    def _lost(self, kind: str) -> PairCounters:
        return PairCounters(self.counters.get(f"lost_{kind}", 0), self.counters.get(f"lost_{kind}_ns", 0))

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


def sum_by(keys: np.ndarray, *columns: np.ndarray) -> tuple[np.ndarray, ...]:
    """Unique keys (ascending) and each column summed per key, exactly (int64)."""
    if not len(keys):
        return (keys, *columns)
    order = np.argsort(keys, kind="stable")
    keys = keys[order]
    starts = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1])))
    return (keys[starts], *(np.add.reduceat(c[order], starts) for c in columns))


def _empty(dtype=_I64) -> np.ndarray:
    return np.empty(0, dtype)


@dataclass(frozen=True, eq=False)
class ServiceTable:
    """Every service of an interval or window as columns.

    `names` are the names the columns refer to (services and culprits; a name
    may appear more than once, merges fold duplicates); `active` the positions
    that are services of this table (those with a cgroup). Histogram rows are
    sorted by (service, kind, slot) and unique; blame rows by (victim,
    culprit, preempted) and unique; `counters` has one row per name.
    """

    names: tuple[str, ...]
    active: np.ndarray           # int64 positions, ascending
    h_svc: np.ndarray            # histogram rows: service position
    h_kind: np.ndarray           #   HIST_RUNQ / HIST_IOWAIT / HIST_RUNQ_LIMIT
    h_slot: np.ndarray
    h_count: np.ndarray
    h_sum: np.ndarray
    b_victim: np.ndarray         # blame rows: victim and culprit positions
    b_culprit: np.ndarray
    b_preempted: np.ndarray      #   1: after a preemption, 0: behind a CPU holder after a wakeup
    b_count: np.ndarray
    b_wait: np.ndarray
    counters: np.ndarray         # (len(names), N_COUNTERS)
    cg_svc: np.ndarray           # (service position, cgroup id) pairs, unique
    cg_id: np.ndarray

    def __post_init__(self) -> None:
        # Compact types for what a record keeps for minutes (positions, kinds
        # and slots are small); counts and sums stay int64. Arithmetic on the
        # columns promotes to int64 again.
        for name, dtype in _DTYPES.items():
            col = getattr(self, name)
            if col.dtype != dtype:
                object.__setattr__(self, name, col.astype(dtype))

    @classmethod
    def empty(cls) -> ServiceTable:
        e = _empty()
        return cls((), e, e, e, e, e, e, e, e, e, e, e, np.zeros((0, N_COUNTERS), _I64), e, _empty(np.uint64))

    # Readers.

    @functools.cached_property
    def _positions(self) -> Mapping[str, int]:
        return MappingProxyType({self.names[i]: i for i in self.active.tolist()})

    @functools.cached_property
    def service_names(self) -> tuple[str, ...]:
        """The services of this table, sorted."""
        return tuple(sorted(self._positions))

    @functools.cached_property
    def services(self) -> Mapping[str, ServiceInterval]:
        """service -> its figures, each built when first read."""
        return _Services(self)

    def __len__(self) -> int:
        return len(self.active)

    def hist_totals(self, kind: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(service positions, counts, sums) of one histogram kind, per service that has rows."""
        rows = self.h_kind == kind
        svc, counts, sums = sum_by(self.h_svc[rows], self.h_count[rows], self.h_sum[rows])
        return svc, counts, sums

    def histogram(self, i: int, kind: int) -> Histogram:
        a, z = np.searchsorted(self.h_svc, [i, i + 1])
        if a == z:
            return Histogram()
        k = self.h_kind[a:z]
        b, y = np.searchsorted(k, [kind, kind + 1]) + a
        if b == y:
            return Histogram()
        return Histogram.from_arrays(self.h_slot[b:y].astype(_I64), self.h_count[b:y], self.h_sum[b:y])

    def services_with(self, field: str) -> list[str]:
        """The services whose per-cgroup counter `field` is not zero, read from
        the counters column: no per-service object is built."""
        col = CGROUP_FIELDS.index(field)
        return [self.names[i] for i in self.active[self.counters[self.active, col] != 0].tolist()]

    def cgroups_of(self, name: str) -> frozenset[int]:
        i = self._positions.get(name)
        if i is None:
            return frozenset()
        a, z = np.searchsorted(self.cg_svc, [i, i + 1])
        return frozenset(self.cg_id[a:z].tolist())

    def service(self, name: str) -> ServiceInterval | None:
        i = self._positions.get(name)
        if i is None:
            return None
        a, z = np.searchsorted(self.b_victim, [i, i + 1])
        pairs: dict[str, PairCounters] = {}
        holders: dict[str, PairCounters] = {}
        for by, pre, c, w in zip(self.b_culprit[a:z].tolist(), self.b_preempted[a:z].tolist(),
                                 self.b_count[a:z].tolist(), self.b_wait[a:z].tolist()):
            table = pairs if pre else holders
            name_by = self.names[by]
            old = table.get(name_by)
            table[name_by] = PairCounters(c, w) if old is None else PairCounters(old[0] + c, old[1] + w)
        return ServiceInterval(
            runq=self.histogram(i, HIST_RUNQ),
            iowait=self.histogram(i, HIST_IOWAIT),
            preempted_by=MappingProxyType(dict(sorted(pairs.items()))),
            cgroups=self.cgroups_of(name),
            counters=MappingProxyType(counter_row(self.counters[i].tolist())),
            waited_behind=MappingProxyType(dict(sorted(holders.items()))),
            runq_limited=self.histogram(i, HIST_RUNQ_LIMIT),
        )

    # Builders.

    def only(self, name: str) -> ServiceTable:
        """This table restricted to one service (with the names its culprits need)."""
        i = self._positions.get(name)
        if i is None:
            return ServiceTable.empty()
        h = self.h_svc == i
        b = self.b_victim == i
        c = self.cg_svc == i
        counters = np.zeros_like(self.counters)
        counters[i] = self.counters[i]
        return ServiceTable(self.names, np.array([i], _I64), self.h_svc[h], self.h_kind[h], self.h_slot[h],
                            self.h_count[h], self.h_sum[h], self.b_victim[b], self.b_culprit[b],
                            self.b_preempted[b], self.b_count[b], self.b_wait[b], counters, self.cg_svc[c],
                            self.cg_id[c])

    def renamed(self, names: Sequence[str]) -> ServiceTable:
        """The same columns under other names (one per position; equal names merge later)."""
        if len(names) != len(self.names):
            raise ValueError("renamed() needs one name per position")
        return ServiceTable(tuple(names), self.active, self.h_svc, self.h_kind, self.h_slot, self.h_count,
                            self.h_sum, self.b_victim, self.b_culprit, self.b_preempted, self.b_count, self.b_wait,
                            self.counters, self.cg_svc, self.cg_id)

    def without(self, names: set[str]) -> ServiceTable:
        """This table without the services named, as victims and as culprits
        (a dead service's series leave /metrics with it, including those of
        the live victims it once delayed), and without names nothing refers
        to any more."""
        drop = np.array([n in names for n in self.names], bool)
        if not drop.any() or not (drop[self.active].any() or drop[self.b_culprit].any()):
            return self
        h = ~drop[self.h_svc]
        b = ~drop[self.b_victim] & ~drop[self.b_culprit]
        c = ~drop[self.cg_svc]
        active = self.active[~drop[self.active]]
        return _compact(ServiceTable(self.names, active, self.h_svc[h], self.h_kind[h], self.h_slot[h],
                                     self.h_count[h], self.h_sum[h], self.b_victim[b], self.b_culprit[b],
                                     self.b_preempted[b], self.b_count[b], self.b_wait[b],
                                     np.where(drop[:, None], 0, self.counters), self.cg_svc[c], self.cg_id[c]))


    def compacted(self) -> ServiceTable:
        """The same table without names no column refers to."""
        return _compact(self)


class _Services(Mapping[str, ServiceInterval]):
    """A table's services as a read-only mapping, in name order."""

    __slots__ = ("_table", "_cache")

    def __init__(self, table: ServiceTable) -> None:
        self._table = table
        self._cache: dict[str, ServiceInterval] = {}

    def __getitem__(self, name: str) -> ServiceInterval:
        s = self._cache.get(name)
        if s is None:
            s = self._table.service(name)
            if s is None:
                raise KeyError(name)
            self._cache[name] = s
        return s

    def __contains__(self, name: object) -> bool:
        return name in self._table._positions

    def __iter__(self) -> Iterator[str]:
        return iter(self._table.service_names)

    def __len__(self) -> int:
        return len(self._table.active)


def _compact(t: ServiceTable) -> ServiceTable:
    """Drop names no column refers to, so a churning node's tables do not grow."""
    used = np.zeros(len(t.names), bool)
    for col in (t.active, t.b_culprit):
        used[col] = True
    if used.all():
        return t
    new = np.cumsum(used) - 1
    return ServiceTable(tuple(n for n, u in zip(t.names, used.tolist()) if u), new[t.active], new[t.h_svc],
                        t.h_kind, t.h_slot, t.h_count, t.h_sum, new[t.b_victim], new[t.b_culprit], t.b_preempted,
                        t.b_count, t.b_wait, t.counters[used], new[t.cg_svc], t.cg_id)


def fold_culprits(victim: np.ndarray, culprit: np.ndarray, preempted: np.ndarray, counts: np.ndarray,
                  waits: np.ndarray, keep: int, other: int) -> tuple[np.ndarray, ...]:
    """Per victim and kind, the `keep` culprits that caused the most wait keep
    their position; the rest are summed under position `other`. Rows must be
    unique per (victim, culprit, preempted). Returns the five columns sorted."""
    n = int(max(victim.max(initial=-1), culprit.max(initial=-1), other)) + 1
    group = victim * 2 + preempted
    order = np.lexsort((-waits, group))
    g = group[order]
    first = np.flatnonzero(np.concatenate(([True], g[1:] != g[:-1]))) if len(g) else g
    rank = np.arange(len(g)) - np.repeat(first, np.diff(np.concatenate((first, [len(g)]))))
    folded = np.zeros(len(g), bool)
    folded[order[rank >= keep]] = True
    if folded.any():
        culprit = np.where(folded, other, culprit)
    key, counts, waits = sum_by((victim * n + culprit) * 2 + preempted, counts, waits)
    pair, preempted = np.divmod(key, 2)
    victim, culprit = np.divmod(pair, n)
    return victim, culprit, preempted, counts, waits


def merge(tables: Sequence[ServiceTable], keep_culprits: int, blame: bool = True) -> ServiceTable:
    """The sum of several tables: histograms slot by slot, blame pair by pair
    (each victim's `keep_culprits` largest culprits by name, the rest under
    OTHER_CULPRITS), counters and cgroups per service. blame=False leaves the
    blame columns empty (quantile and SLO readers of a node skip them)."""
    tables = [t for t in tables if len(t)]
    if not tables:
        return ServiceTable.empty()
    if len(tables) == 1 and blame and len(set(tables[0].names)) == len(tables[0].names):
        return tables[0]
    # The union of the names, then each table's positions in it: C-level
    # dict and map calls, since a window maps sixty tables of a thousand names.
    distinct = list({id(t.names): t.names for t in tables}.values())
    union = dict.fromkeys(itertools.chain.from_iterable(distinct))
    if blame and any(len(t.b_victim) for t in tables):
        union.setdefault(OTHER_CULPRITS)
    index = {name: i for i, name in enumerate(union)}
    by_tuple = {id(names): np.fromiter(map(index.__getitem__, names), _I64, len(names)) for names in distinct}
    maps = [by_tuple[id(t.names)] for t in tables]
    n = len(index)
    names = tuple(index)

    def cat(col: str, mapped: bool = False) -> np.ndarray:
        parts = [m[getattr(t, col)] if mapped else getattr(t, col) for t, m in zip(tables, maps)]
        return np.concatenate(parts) if parts else _empty()

    active = np.unique(np.concatenate([m[t.active] for t, m in zip(tables, maps)]))
    hkey = (cat("h_svc", True) * NR_HIST_KINDS + cat("h_kind")) * HIST_SLOTS + cat("h_slot")
    hkey, hc, hs = sum_by(hkey, cat("h_count"), cat("h_sum"))
    hsvc, rest = np.divmod(hkey, NR_HIST_KINDS * HIST_SLOTS)
    hkind, hslot = np.divmod(rest, HIST_SLOTS)

    if blame:
        bkey = (cat("b_victim", True) * n + cat("b_culprit", True)) * 2 + cat("b_preempted")
        bkey, bc, bw = sum_by(bkey, cat("b_count"), cat("b_wait"))
        pair, pre = np.divmod(bkey, 2)
        vic, cul = np.divmod(pair, n)
        vic, cul, pre, bc, bw = fold_culprits(vic, cul, pre, bc, bw, keep_culprits, index[OTHER_CULPRITS]) \
            if len(bkey) else (vic, cul, pre, bc, bw)
    else:
        vic = cul = pre = bc = bw = _empty()

    counters = np.zeros((n, N_COUNTERS), _I64)
    rows = np.concatenate([t.counters for t in tables])
    nonzero = rows.any(axis=1)
    if nonzero.any():
        keys = np.concatenate(maps)[nonzero]
        order = np.argsort(keys, kind="stable")
        keys, rows = keys[order], rows[nonzero][order]
        starts = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1])))
        counters[keys[starts]] = np.add.reduceat(rows, starts, axis=0)

    cs, cid = cat("cg_svc", True), np.concatenate([t.cg_id for t in tables])
    order = np.lexsort((cid, cs))
    cs, cid = cs[order], cid[order]
    keep = np.concatenate(([True], (cs[1:] != cs[:-1]) | (cid[1:] != cid[:-1]))) if len(cs) else np.ones(0, bool)
    return _compact(ServiceTable(names, active, hsvc, hkind, hslot, hc, hs, vic, cul, pre, bc, bw, counters,
                                 cs[keep], cid[keep]))


def quantiles(table: ServiceTable, kind: int, qs: tuple[float, ...]) -> dict[str, tuple[float, ...]]:
    """service -> the qs quantiles (seconds) of its `kind` histogram, for the
    services with a sample (Histogram.quantile's values, computed for all at once)."""
    rows = table.h_kind == kind
    svc, values = grouped_quantiles(table.h_svc[rows], table.h_slot[rows], table.h_count[rows],
                                    table.h_sum[rows], qs)
    return {table.names[i]: v for i, v in zip(svc.tolist(), values)}
