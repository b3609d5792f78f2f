"""The loader's merge of counts read from a shared map and from every CPU's
write-combining cache (bpf/sched.h hist_cache, blame_cache): one row per key,
every value field summed, checked against a plain dictionary sum."""

from __future__ import annotations

import random

import numpy as np
import pytest

from agent.probe.layout import BlameKey, BlameVal, HistKey, HistVal
from agent.probe.loader import _sum_rows

BLAME = (BlameKey, BlameVal, ("victim_cgid", "culprit_cgid", "kind"))
HIST = (HistKey, HistVal, ("cgid", "kind", "slot"))


def _arrays(kind, rows):
    key_t, val_t, fields = kind
    keys = np.zeros(len(rows), np.dtype(key_t))
    vals = np.zeros(len(rows), np.dtype(val_t))
    for i, row in enumerate(rows):
        for f, v in zip(fields, row):
            keys[i][f] = v
        keys[i]["gen"] = 1
        vals[i] = row[len(fields):]
    return keys, vals


@pytest.mark.parametrize("kind", [BLAME, HIST], ids=["blame", "hists"])
def test_rows_from_the_map_and_the_caches_are_summed_per_key(kind):
    rng = random.Random(7)
    picks = [(rng.randrange(1, 6), rng.randrange(0, 6), rng.randrange(2)) for _ in range(12)]
    # The map holds each key once; the caches of several CPUs may hold it again.
    in_map = [(*k, rng.randrange(1, 50), rng.randrange(1, 10**9)) for k in set(picks)]
    in_caches = [(*rng.choice(picks), rng.randrange(1, 50), rng.randrange(1, 10**9)) for _ in range(40)]
    fields = kind[2]
    keys, vals = _sum_rows(*_arrays(kind, in_map), *_arrays(kind, in_caches), fields)
    expected: dict[tuple, list[int]] = {}
    for *k, n, w in in_map + in_caches:
        e = expected.setdefault(tuple(k), [0, 0])
        e[0] += n
        e[1] += w
    names = vals.dtype.names
    got = {tuple(int(a[f]) for f in fields): [int(b[names[0]]), int(b[names[1]])] for a, b in zip(keys, vals)}
    assert got == expected
    assert len(keys) == len(expected)


def test_nothing_cached_leaves_the_map_rows_as_they_are():
    keys, vals = _arrays(BLAME, [(1, 2, 0, 3, 4)])
    empty_k, empty_v = _arrays(BLAME, [])
    k2, v2 = _sum_rows(keys, vals, empty_k, empty_v, BLAME[2])
    assert k2 is keys and v2 is vals
