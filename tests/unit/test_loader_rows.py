"""The loader's merge of blame counts read from the shared map and from every
CPU's write-combining cache (bpf/sched.h blame_cache): one row per
(victim, culprit, kind), counts and waits summed, checked against a plain
dictionary sum."""

from __future__ import annotations

import random

import numpy as np

from agent.probe.layout import BlameKey, BlameVal
from agent.probe.loader import _sum_pairs


def _arrays(rows):
    keys = np.zeros(len(rows), np.dtype(BlameKey))
    vals = np.zeros(len(rows), np.dtype(BlameVal))
    for i, (victim, culprit, kind, count, wait) in enumerate(rows):
        keys[i] = (victim, culprit, kind, 1, 0)
        vals[i] = (count, wait)
    return keys, vals


def test_pairs_from_the_map_and_the_caches_are_summed_per_key():
    rng = random.Random(7)
    pairs = [(rng.randrange(1, 6), rng.randrange(0, 6), rng.randrange(2)) for _ in range(12)]
    # The map holds each key once; the caches of several CPUs may hold it again.
    in_map = [(v, c, k, rng.randrange(1, 50), rng.randrange(1, 10**9)) for v, c, k in set(pairs)]
    in_caches = [(*rng.choice(pairs), rng.randrange(1, 50), rng.randrange(1, 10**9)) for _ in range(40)]
    keys, vals = _sum_pairs(*_arrays(in_map), *_arrays(in_caches))
    expected: dict[tuple, list[int]] = {}
    for v, c, k, n, w in in_map + in_caches:
        e = expected.setdefault((v, c, k), [0, 0])
        e[0] += n
        e[1] += w
    got = {(int(a["victim_cgid"]), int(a["culprit_cgid"]), int(a["kind"])): [int(b["count"]), int(b["wait_ns"])]
           for a, b in zip(keys, vals)}
    assert got == expected
    assert len(keys) == len(expected)


def test_nothing_cached_leaves_the_map_rows_as_they_are():
    keys, vals = _arrays([(1, 2, 0, 3, 4)])
    empty_k, empty_v = _arrays([])
    k2, v2 = _sum_pairs(keys, vals, empty_k, empty_v)
    assert k2 is keys and v2 is vals
