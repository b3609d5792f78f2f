"""Bucket layout against the C header, and quantiles against exact percentiles."""

from __future__ import annotations

import bisect
import math
import random

import numpy as np
import pytest

from agent.probe.snapshot import Bucket
from agent.store import histogram as h
from agent.store.histogram import (
    Histogram,
    classic_bounds,
    cumulative_counts,
    grouped_quantiles,
    slot_bounds,
    slot_of,
)
from tests.support.bpf_header import header_defines


def test_constants_match_sched_h() -> None:
    d = header_defines()
    for name in ("HIST_MIN_SHIFT", "HIST_MAX_SHIFT", "HIST_SUB_SHIFT", "HIST_SUB", "HIST_SLOTS"):
        assert getattr(h, name) == d[name], name
    assert h.HIST_SLOTS == 434


# Hand-computed from hist_slot(): k = floor(log2 v), sub = next 4 bits.
@pytest.mark.parametrize(
    "ns,slot",
    [
        (0, 0),
        (255, 0),
        (256, 1),
        (271, 1),
        (272, 2),
        (511, 16),
        (512, 17),
        (1000, 32),            # k=9, sub=(1000>>5)&15=15 -> 1+16+15
        (1024, 33),
        (100_000, 137),        # k=16, sub=(100000>>12)&15=8 -> 1+128+8
        ((1 << 35) - 1, 432),
        (1 << 35, 433),
        (1 << 40, 433),
    ],
)
def test_slot_of_hand_values(ns: int, slot: int) -> None:
    assert slot_of(ns) == slot


def test_slot_of_matches_bisect_over_independent_bounds() -> None:
    # Lower bounds built as 2^k * (16 + sub) / 16, then searched by bisection:
    # a different construction from slot_of's bit arithmetic.
    los = [0] + [(1 << k) * (16 + sub) // 16 for k in range(8, 35) for sub in range(16)] + [1 << 35]
    assert len(los) == h.HIST_SLOTS
    rng = random.Random(7)
    values = [rng.randrange(0, 1 << rng.randrange(1, 40)) for _ in range(20_000)]
    values += [lo + d for lo in los for d in (-1, 0, 1) if lo + d >= 0]
    for v in values:
        assert slot_of(v) == bisect.bisect_right(los, v) - 1, v


def test_slot_bounds_contiguous_and_consistent() -> None:
    prev_hi = 0.0
    for slot in range(h.HIST_SLOTS):
        lo, hi = slot_bounds(slot)
        assert lo == prev_hi
        assert slot_of(lo) == slot
        if hi != math.inf:
            assert slot_of(int(hi) - 1) == slot
            assert slot_of(int(hi)) == slot + 1
        prev_hi = hi
    assert slot_bounds(h.HIST_SLOTS - 1) == (1 << 35, math.inf)
    with pytest.raises(ValueError):
        slot_bounds(h.HIST_SLOTS)


def _hand_hist(values: list[int]) -> Histogram:
    """Histogram built sample by sample, the way the kernel fills it."""
    acc: dict[int, tuple[int, int]] = {}
    for v in values:
        c, s = acc.get(slot_of(v), (0, 0))
        acc[slot_of(v)] = (c + 1, s + v)
    return Histogram({slot: Bucket(c, s) for slot, (c, s) in acc.items()})


def _exact(values_sorted: list[int], q: float) -> float:
    """Nearest-rank percentile, seconds."""
    return values_sorted[max(math.ceil(q * len(values_sorted)) - 1, 0)] / 1e9


def _lognormal(rng: random.Random, median_ns: float, sigma: float, n: int) -> list[int]:
    return [int(rng.lognormvariate(math.log(median_ns), sigma)) for _ in range(n)]


def _distributions() -> dict[str, list[int]]:
    rng = random.Random(1234)
    fast = _lognormal(rng, 20_000, 0.2, 90_000)
    slow = _lognormal(rng, 5_000_000, 0.3, 10_000)
    bimodal = fast + slow
    rng.shuffle(bimodal)
    return {
        "lognormal": _lognormal(rng, 50_000, 1.5, 200_000),
        "bimodal": bimodal,
        "repeated": [123_456] * 5_000,
        "uniform": [rng.randrange(1_000, 10_000_000) for _ in range(100_000)],
    }


DISTRIBUTIONS = _distributions()


@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
@pytest.mark.parametrize("q", [0.5, 0.95, 0.99])
def test_quantile_within_5_percent_of_exact(name: str, q: float) -> None:
    values = DISTRIBUTIONS[name]
    hist = _hand_hist(values)
    exact = _exact(sorted(values), q)
    assert hist.quantile(q) == pytest.approx(exact, rel=0.05)


def test_quantile_error_typically_about_one_percent() -> None:
    values = DISTRIBUTIONS["lognormal"]
    hist = _hand_hist(values)
    s = sorted(values)
    errors = [abs(hist.quantile(q) / _exact(s, q) - 1) for q in (0.5, 0.9, 0.95, 0.99, 0.999)]
    assert max(errors) < 0.015, errors


def test_quantile_interpolates_inside_the_slot() -> None:
    # slot 33 = [1024, 1088), slot 34 = [1088, 1152): 4 + 4 values.
    hist = Histogram({33: Bucket(4, 4 * 1030), 34: Bucket(4, 4 * 1100)})
    # rank 0.5*8 = 4 -> top of slot 33.
    assert hist.quantile(0.5) == pytest.approx(1088e-9)
    # rank 0.75*8 = 6 -> half way through slot 34.
    assert hist.quantile(0.75) == pytest.approx((1088 + 32) * 1e-9)
    # rank 0.25*8 = 2 -> half way through slot 33.
    assert hist.quantile(0.25) == pytest.approx((1024 + 32) * 1e-9)
    assert hist.quantile(1.0) == pytest.approx(1152e-9)
    assert hist.quantile(0.0) == pytest.approx(1024e-9)


def test_quantile_slot_zero_interpolates_from_zero() -> None:
    hist = Histogram({0: Bucket(10, 1000)})
    assert hist.quantile(0.5) == pytest.approx(128e-9)


def test_quantile_single_values_are_exact() -> None:
    assert Histogram({33: Bucket(1, 1050)}).quantile(0.99) == pytest.approx(1050e-9)
    # All values equal to the slot's lower or last value: the sum proves it.
    assert Histogram({33: Bucket(7, 7 * 1024)}).quantile(0.99) == pytest.approx(1024e-9)
    assert Histogram({33: Bucket(7, 7 * 1087)}).quantile(0.5) == pytest.approx(1087e-9)
    # A lone sample whose sum is outside the slot (torn read) is interpolated.
    assert Histogram({33: Bucket(1, 0)}).quantile(0.5) == pytest.approx(1056e-9)


def test_quantile_overflow_slot_returns_its_mean() -> None:
    big = [(1 << 35) + 1_000, (1 << 36)]
    hist = _hand_hist([1000] * 2 + big)
    assert hist.quantile(0.99) == pytest.approx(sum(big) / 2 / 1e9)


def test_quantile_bounds_and_edge_cases() -> None:
    assert Histogram().quantile(0.99) == 0.0
    assert Histogram().mean == 0.0
    values = DISTRIBUTIONS["uniform"]
    hist = _hand_hist(values)
    top_slot = max(hist)
    assert hist.quantile(1.0) <= slot_bounds(top_slot)[1] / 1e9
    assert hist.quantile(1.0) >= max(values) / 1e9
    assert hist.quantile(0.0) >= slot_bounds(min(hist))[0] / 1e9
    with pytest.raises(ValueError):
        hist.quantile(1.5)


def test_counts_sums_and_merge_against_raw_values() -> None:
    rng = random.Random(3)
    a = [rng.randrange(0, 10**8) for _ in range(5000)]
    b = [rng.randrange(0, 10**6) for _ in range(3000)]
    ha, hb = _hand_hist(a), _hand_hist(b)
    merged = ha + hb
    assert merged == _hand_hist(a + b)
    assert merged == ha.merge(hb) == hb + ha
    assert merged.count == 8000
    assert merged.sum_ns == sum(a) + sum(b)
    assert merged.sum_seconds == pytest.approx((sum(a) + sum(b)) / 1e9)
    assert merged.mean == pytest.approx((sum(a) + sum(b)) / 8000 / 1e9)
    assert Histogram.from_ns(a) == ha
    # Sparse: only slots that hold something.
    assert set(ha) == {slot_of(v) for v in a}


def test_histogram_rejects_bad_buckets_and_drops_empty_ones() -> None:
    with pytest.raises(ValueError):
        Histogram({h.HIST_SLOTS: Bucket(1, 1)})
    with pytest.raises(ValueError):
        Histogram({3: Bucket(-1, 0)})
    assert len(Histogram({3: Bucket(0, 0), 4: Bucket(1, 330)})) == 1
    # A sum without a count (torn read) still counts towards the total wait.
    torn = Histogram({40: Bucket(0, 5000)})
    assert torn.count == 0 and torn.sum_ns == 5000 and torn.quantile(0.5) == 0.0


def test_classic_bounds_are_slot_boundaries() -> None:
    bounds = classic_bounds()
    assert len(bounds) == 43
    assert bounds[0] == pytest.approx(8192e-9)
    assert bounds[1] == pytest.approx(8192 * 23 / 16 * 1e-9)
    assert bounds[-1] == pytest.approx((1 << 34) * 1e-9)
    assert list(bounds) == sorted(set(bounds))
    for b in bounds:
        ns = round(b * 1e9)
        assert slot_bounds(slot_of(ns))[0] == ns


@pytest.mark.parametrize("per_octave, n", [(1, 22), (2, 43), (4, 85), (8, 169)])
def test_finer_bounds_are_slot_boundaries_and_refine_the_default(per_octave: int, n: int) -> None:
    bounds = classic_bounds(per_octave)
    assert len(bounds) == n
    assert list(bounds) == sorted(set(bounds))
    assert bounds[0] == pytest.approx(8192e-9) and bounds[-1] == pytest.approx((1 << 34) * 1e-9)
    for b in bounds:
        ns = round(b * 1e9)
        assert slot_bounds(slot_of(ns))[0] == ns
    # Each step is within one slot of the geometric one: 2^(1/per_octave).
    ratio = 2 ** (1 / per_octave)
    for lo, hi in zip(bounds, bounds[1:]):
        assert abs(hi / lo - ratio) <= 1 / 16 + 1e-9, (lo, hi)
    coarser = {1: (), 2: (1,), 4: (1, 2), 8: (1, 2, 4)}[per_octave]
    for c in coarser:
        assert set(classic_bounds(c)) <= set(bounds)


def test_bounds_refuse_other_resolutions() -> None:
    for bad in (0, 3, 16):
        with pytest.raises(ValueError, match="buckets per octave"):
            classic_bounds(bad)


def test_cumulative_counts_against_raw_values() -> None:
    rng = random.Random(11)
    values = _lognormal(rng, 300_000, 2.0, 50_000)
    # Values sitting exactly on bounds are counted in the bucket above.
    values += [8192, 8191, 1 << 20]
    bounds = classic_bounds()
    got = cumulative_counts(_hand_hist(values), bounds)
    want = [sum(1 for v in values if v < round(b * 1e9)) for b in bounds] + [len(values)]
    assert got == want


def test_cumulative_counts_rejects_bounds_off_slot_boundaries() -> None:
    with pytest.raises(ValueError):
        cumulative_counts(Histogram(), [0.001])  # 1 ms = 10^6 ns: mid-slot
    with pytest.raises(ValueError):
        cumulative_counts(Histogram(), [2**14 / 1e9, 2**13 / 1e9])


def test_grouped_quantiles_equal_each_histograms_own() -> None:
    """Many histograms at once (the export's path) against Histogram.quantile of
    each, on random log-normal data, identical-value slots and the overflow slot."""
    rng = np.random.default_rng(11)
    hists = []
    for g in range(300):
        values = rng.lognormal(8 + g % 9, 0.2 + g % 4, int(rng.integers(1, 500))).astype(np.int64)
        if g % 7 == 0:
            values[:] = values[0]
        if g % 11 == 0:
            values[0] = 1 << 36   # the overflow slot
        hists.append(Histogram.from_ns(values.tolist()))
    hists.append(Histogram())   # no samples: no quantiles
    group = np.concatenate([np.full(len(h), i) for i, h in enumerate(hists)])
    cols = [np.concatenate([np.array([getattr(b, f) for b in h.values()], np.int64) for h in hists])
            for f in ("count", "sum_ns")]
    slots = np.concatenate([np.array(list(h), np.int64) for h in hists])
    qs = (0.5, 0.95, 0.99, 1.0)
    groups, values = grouped_quantiles(group, slots, cols[0], cols[1], qs)
    assert groups.tolist() == list(range(300))
    assert values == [tuple(hists[g].quantile(q) for q in qs) for g in range(300)]
