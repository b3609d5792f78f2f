"""Log-linear latency histograms: the kernel's bucket layout and quantiles over it.

The BPF side (bpf/sched.h, hist_slot() in bpf/sched.bpf.c) splits every power of
two between 2^8 and 2^34 ns into 16 linear sub-buckets and keeps, per slot, the
count and the exact sum of the values. Sixteen sub-buckets bound the relative
width of a slot to 1/16, so interpolated quantiles land within a few percent of
the exact ones, where plain log2 buckets can be 2x off.

This module mirrors that layout in Python and must stay in lock-step with the
C header; tests/unit/test_histogram.py parses the header to make sure it does.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Iterator, Mapping

import numpy as np

from agent.probe.layout import HIST_MAX_SHIFT, HIST_MIN_SHIFT, HIST_SLOTS, HIST_SUB, HIST_SUB_SHIFT
from agent.probe.snapshot import Bucket

OVERFLOW_SLOT = HIST_SLOTS - 1
# Values at or above this many ns land in the overflow slot.
OVERFLOW_NS = 1 << (HIST_MAX_SHIFT + 1)

_NS_PER_S = 1e9


def slot_of(ns: int) -> int:
    """The slot the kernel's hist_slot() puts a value of `ns` nanoseconds in.

    int.bit_length() is floor(log2)+1, the same quantity BCC's bpf_log2l()
    returns, so the arithmetic below is the C code line for line.
    """
    if ns < 0:
        raise ValueError(f"negative duration {ns} ns")
    if ns < (1 << HIST_MIN_SHIFT):
        return 0
    k = ns.bit_length() - 1
    if k > HIST_MAX_SHIFT:
        return OVERFLOW_SLOT
    sub = (ns >> (k - HIST_SUB_SHIFT)) & (HIST_SUB - 1)
    return 1 + (k - HIST_MIN_SHIFT) * HIST_SUB + sub


def slot_bounds(slot: int) -> tuple[int, float]:
    """[lo, hi) of a slot in ns; hi is inf for the overflow slot."""
    if not 0 <= slot < HIST_SLOTS:
        raise ValueError(f"slot {slot} outside 0..{HIST_SLOTS - 1}")
    if slot == 0:
        return 0, float(1 << HIST_MIN_SHIFT)
    if slot == OVERFLOW_SLOT:
        return OVERFLOW_NS, math.inf
    k = HIST_MIN_SHIFT + (slot - 1) // HIST_SUB
    width = 1 << (k - HIST_SUB_SHIFT)
    lo = (1 << k) + ((slot - 1) % HIST_SUB) * width
    return lo, float(lo + width)


# Upper bound (ns, exclusive) of every slot, for vectorised bucket counts.
_SLOT_HI = np.array([slot_bounds(s)[1] for s in range(HIST_SLOTS)], np.float64)


def _is_slot_boundary(ns: int) -> bool:
    return ns >= 0 and slot_bounds(slot_of(ns))[0] == ns


class Histogram(Mapping[int, Bucket]):
    """Immutable sparse histogram: slot -> Bucket(count, sum_ns).

    Held as three numpy columns (ascending slots, counts, sums), so that a
    node's worth of histograms is built, merged and summed with array
    operations rather than one Python object per slot. Immutable so the store
    can hand the same object to any number of reader threads. A bucket may
    carry a sum with a zero count (a read torn between the two updates
    splits one sample across two intervals; keeping the sum keeps wait totals
    exact); empty buckets are dropped.
    """

    __slots__ = ("_slots", "_counts", "_sums", "_count", "_sum_ns")

    def __init__(self, buckets: Mapping[int, Bucket] | None = None) -> None:
        items = sorted((buckets or {}).items())
        for slot, bucket in items:
            if not 0 <= slot < HIST_SLOTS:
                raise ValueError(f"slot {slot} outside 0..{HIST_SLOTS - 1}")
            if bucket.count < 0 or bucket.sum_ns < 0:
                raise ValueError(f"negative bucket {bucket} in slot {slot}")
        items = [(s, b) for s, b in items if b.count or b.sum_ns]
        self._set(np.array([s for s, _ in items], np.int64), np.array([b.count for _, b in items], np.int64),
                  np.array([b.sum_ns for _, b in items], np.int64))

    def _set(self, slots: np.ndarray, counts: np.ndarray, sums: np.ndarray,
             count: int | None = None, sum_ns: int | None = None) -> None:
        # The arrays are never handed out: readers get ints and Buckets.
        self._slots, self._counts, self._sums = slots, counts, sums
        self._count = int(counts.sum()) if count is None else count
        self._sum_ns = int(sums.sum()) if sum_ns is None else sum_ns

    @classmethod
    def from_arrays(cls, slots: np.ndarray, counts: np.ndarray, sums: np.ndarray,
                    count: int | None = None, sum_ns: int | None = None) -> Histogram:
        """From int64 columns the caller vouches for: slots ascending and unique
        within 0..HIST_SLOTS-1, counts and sums non-negative, no empty slot;
        count and sum_ns their totals when already known."""
        h = cls.__new__(cls)
        h._set(slots, counts, sums, count, sum_ns)
        return h

    @classmethod
    def total(cls, hists: Iterable[Histogram]) -> Histogram:
        """The sum of many histograms in one pass (windows merge hundreds)."""
        hists = [h for h in hists if len(h._slots)]
        if not hists:
            return cls()
        if len(hists) == 1:
            return hists[0]
        slots = np.concatenate([h._slots for h in hists])
        counts = np.zeros(HIST_SLOTS, np.int64)
        sums = np.zeros(HIST_SLOTS, np.int64)
        np.add.at(counts, slots, np.concatenate([h._counts for h in hists]))
        np.add.at(sums, slots, np.concatenate([h._sums for h in hists]))
        used = np.flatnonzero((counts != 0) | (sums != 0))
        return cls.from_arrays(used, counts[used], sums[used],
                               sum(h._count for h in hists), sum(h._sum_ns for h in hists))

    @classmethod
    def from_ns(cls, values: Iterable[int]) -> Histogram:
        """Bucket raw nanosecond values exactly as the kernel would."""
        acc: dict[int, list[int]] = {}
        for v in values:
            b = acc.setdefault(slot_of(v), [0, 0])
            b[0] += 1
            b[1] += v
        return cls({s: Bucket(c, t) for s, (c, t) in acc.items()})

    # Mapping protocol, in slot order.
    def __getitem__(self, slot: int) -> Bucket:
        i = int(np.searchsorted(self._slots, slot))
        if i == len(self._slots) or self._slots[i] != slot:
            raise KeyError(slot)
        return Bucket(int(self._counts[i]), int(self._sums[i]))

    def __iter__(self) -> Iterator[int]:
        return iter(self._slots.tolist())

    def __len__(self) -> int:
        return len(self._slots)

    def items(self):  # type: ignore[override]
        return list(zip(self._slots.tolist(), map(Bucket, self._counts.tolist(), self._sums.tolist())))

    def values(self):  # type: ignore[override]
        return list(map(Bucket, self._counts.tolist(), self._sums.tolist()))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Histogram):
            return (np.array_equal(self._slots, other._slots) and np.array_equal(self._counts, other._counts)
                    and np.array_equal(self._sums, other._sums))
        return Mapping.__eq__(self, other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Histogram(count={self._count}, sum_ns={self._sum_ns}, slots={len(self._slots)})"

    def merge(self, other: Histogram) -> Histogram:
        """Sum of two histograms: histograms of disjoint samples add slot-wise."""
        return Histogram.total((self, other))

    def without(self, part: Histogram) -> Histogram:
        """The samples of self that are not in `part`, a histogram of some of
        them (the same waits counted again): slot-wise differences, floored
        at zero where the two were read a drain apart."""
        counts = np.zeros(HIST_SLOTS, np.int64)
        sums = np.zeros(HIST_SLOTS, np.int64)
        counts[self._slots], sums[self._slots] = self._counts, self._sums
        np.subtract.at(counts, part._slots, part._counts)
        np.subtract.at(sums, part._slots, part._sums)
        np.maximum(counts, 0, out=counts)
        np.maximum(sums, 0, out=sums)
        used = np.flatnonzero((counts != 0) | (sums != 0))
        return Histogram.from_arrays(used, counts[used], sums[used])

    def __add__(self, other: Histogram) -> Histogram:
        if not isinstance(other, Histogram):
            return NotImplemented
        return self.merge(other)

    @property
    def count(self) -> int:
        return self._count

    @property
    def sum_ns(self) -> int:
        return self._sum_ns

    @property
    def sum_seconds(self) -> float:
        return self._sum_ns / _NS_PER_S

    @property
    def mean(self) -> float:
        """Exact mean in seconds (the kernel keeps exact sums); 0.0 when empty."""
        return self._sum_ns / self._count / _NS_PER_S if self._count else 0.0

    def quantile(self, q: float) -> float:
        """The q-quantile in seconds, interpolated inside its slot; 0.0 when empty.

        The target rank q*count falls in the first slot whose cumulative count
        reaches it; inside that slot the values are taken as spread evenly over
        [lo, hi). When the slot's exact sum proves every value in it is the same,
        that value is returned instead, and the overflow slot (no upper bound)
        answers with its mean.
        """
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile {q} outside [0, 1]")
        if self._count == 0:
            return 0.0
        rank = q * self._count
        cum = np.cumsum(self._counts)
        # First slot with a count whose cumulative count reaches the rank.
        i = int(np.searchsorted(cum, rank, side="left"))
        while self._counts[i] == 0:  # a sum-only slot cannot hold the rank
            i += 1
        before = int(cum[i] - self._counts[i])
        b = Bucket(int(self._counts[i]), int(self._sums[i]))
        return _value_in_slot(int(self._slots[i]), b, rank - before) / _NS_PER_S

    def quantile_slot(self, q: float) -> int:
        """The slot holding the q-quantile's rank (quantile() interpolates inside it); -1 when empty."""
        if not self._count:
            return -1
        cum = np.cumsum(self._counts)
        i = int(np.searchsorted(cum, q * self._count, side="left"))
        while self._counts[i] == 0:
            i += 1
        return int(self._slots[i])

    def count_from(self, slot: int) -> int:
        """Count of samples in `slot` and the slots above it."""
        return int(self._counts[np.searchsorted(self._slots, slot):].sum())

    def cumulative_at(self, bounds_ns: np.ndarray) -> np.ndarray:
        """Count of samples in slots that lie wholly below each bound."""
        his = _SLOT_HI[self._slots]
        cum = np.concatenate(([0], np.cumsum(self._counts)))
        return cum[np.searchsorted(his, bounds_ns, side="right")]


def grouped_quantiles(group: np.ndarray, slots: np.ndarray, counts: np.ndarray, sums: np.ndarray,
                      qs: tuple[float, ...]) -> tuple[np.ndarray, list[tuple[float, ...]]]:
    """Quantiles (seconds) of many histograms at once, the same values
    Histogram.quantile gives each: rows sorted by (group, slot), one per slot.

    Returns the groups (ascending) with a sample and, per group, one value per q.
    The search for each rank runs over all groups in one array pass; only the
    interpolation inside the chosen slot (3 values per group) is scalar code,
    the same as Histogram.quantile's, so the two cannot disagree."""
    if any(not 0.0 < q <= 1.0 for q in qs):
        raise ValueError(f"quantiles must lie in (0, 1], got {qs}")
    if not len(group):
        return group, []
    starts = np.flatnonzero(np.concatenate(([True], group[1:] != group[:-1])))
    totals = np.add.reduceat(counts, starts)
    keep = totals > 0
    starts, totals = starts[keep], totals[keep]
    cum = np.cumsum(counts)
    base = cum[starts] - counts[starts]
    # First row whose cumulative count within its group reaches the rank:
    # counts are integers, so reaching q*total is reaching its ceiling, and
    # the search stays in exact integer arithmetic.
    found = [np.searchsorted(cum, base + np.ceil(q * totals).astype(np.int64), side="left") for q in qs]
    out: list[tuple[float, ...]] = []
    slot_l, count_l, sum_l, cum_l = slots.tolist(), counts.tolist(), sums.tolist(), cum.tolist()
    for g, b0, total in zip(range(len(starts)), base.tolist(), totals.tolist()):
        values = []
        for q, idx in zip(qs, found):
            i = int(idx[g])
            # A rank above the group's base lands on a row of the group with a count.
            rank_in_slot = q * total - (cum_l[i] - count_l[i] - b0)
            values.append(_value_in_slot(slot_l[i], Bucket(count_l[i], sum_l[i]), rank_in_slot) / _NS_PER_S)
        out.append(tuple(values))
    return group[starts], out


def _value_in_slot(slot: int, b: Bucket, rank_in_slot: float) -> float:
    """Value in ns at rank `rank_in_slot` (0 < r <= count) of one slot."""
    lo, hi = slot_bounds(slot)
    exact = _single_value(slot, b)
    if exact is not None:
        return float(exact)
    if slot == OVERFLOW_SLOT:
        # No upper bound to interpolate towards; the exact mean is the best guess
        # and never leaves the slot.
        return max(float(lo), b.sum_ns / b.count)
    frac = min(max(rank_in_slot / b.count, 0.0), 1.0)
    return lo + (hi - lo) * frac


def _single_value(slot: int, b: Bucket) -> int | None:
    """The one value every sample in the slot has, when the sum proves it.

    Values are integers in [lo, hi), so a sum of count*lo or count*(hi-1) can
    only come from identical values; a lone sample is its own sum. A sum outside
    the slot (a read torn between count and sum updates) proves nothing.
    """
    lo, hi = slot_bounds(slot)
    if b.count == 1:
        value = b.sum_ns
    elif b.sum_ns == b.count * lo:
        value = lo
    elif hi != math.inf and b.sum_ns == b.count * (int(hi) - 1):
        value = int(hi) - 1
    else:
        return None
    return value if lo <= value < hi else None


# Classic bucket resolutions offered to exporters: bounds per power of two.
BUCKETS_PER_OCTAVE = (1, 2, 4, 8)
DEFAULT_BUCKETS_PER_OCTAVE = 2


def classic_bounds(per_octave: int = DEFAULT_BUCKETS_PER_OCTAVE) -> tuple[float, ...]:
    """Prometheus bucket upper bounds (seconds), the same for every service.

    Within each power of two 2^k ns, k = 13..33, the slot boundaries nearest
    to 2^k * 2^(i/per_octave), then 2^34 ns: 8.2 µs to 17 s. Every bound is a
    slot boundary, so the count at a bound is exact rather than re-estimated
    from a slot that straddles it. Two per octave (2^k and 2^k*(1+7/16), steps
    of ~1.4x) give 43 bounds; four (1, 1+3/16, 1+7/16, 1+11/16) give 85, and
    contain the two-per-octave set.
    """
    if per_octave not in BUCKETS_PER_OCTAVE:
        raise ValueError(f"buckets per octave must be one of {BUCKETS_PER_OCTAVE}, got {per_octave!r}")
    subs = [round(HIST_SUB * (2 ** (i / per_octave) - 1)) for i in range(per_octave)]
    bounds: list[float] = []
    for k in range(13, 34):
        for j in subs:
            bounds.append(((1 << k) + j * (1 << (k - HIST_SUB_SHIFT))) / _NS_PER_S)
    bounds.append((1 << 34) / _NS_PER_S)
    return tuple(bounds)


def cumulative_counts(hist: Histogram, bounds: Iterable[float]) -> list[int]:
    """Cumulative counts at each bound (seconds, ascending), then +Inf = total.

    A slot counts towards a bound when its whole range lies below the bound.
    Values are integer ns and bounds sit on slot boundaries, so this is the
    count of values < bound; the only difference from Prometheus' `le` is a
    value exactly equal to the bound, which lands one bucket higher.
    """
    return hist.cumulative_at(_bounds_ns(tuple(bounds))).tolist() + [hist.count]


@functools.lru_cache(maxsize=16)
def _bounds_ns(bounds: tuple[float, ...]) -> np.ndarray:
    """Validated bounds in ns; checked once per bound set, not per service."""
    out: list[int] = []
    for b in bounds:
        ns = round(b * _NS_PER_S)
        if not _is_slot_boundary(ns):
            raise ValueError(f"bucket bound {b} s is not a histogram slot boundary")
        if out and ns <= out[-1]:
            raise ValueError("bucket bounds must be strictly ascending")
        out.append(ns)
    return np.array(out, np.float64)
