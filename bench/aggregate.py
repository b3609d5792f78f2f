"""The poll's user-space path at node scale, without a kernel: drained map
entries of N services in, per-service intervals, windows and totals out.

    .venv/bin/python -m bench.aggregate [--services 1000] [--slots 80] [--culprits 40] [--intervals 30]

Feeds the same numpy rows the probe's batch reads produce (bpf/sched.h
layouts: one histogram row per (cgroup, kind, slot), one blame row per
(victim, culprit, kind)) through the conversion and Store.ingest() that every
poll runs, then what a /metrics scrape reads (the 60-second window, its
quantiles, the totals) and writes (the exposition text).
The counting maps are shared between CPUs (docs/maps.md), so the number of
possible CPUs changes nothing here: 64 CPUs hand over the same rows as 2.
Times are CPU seconds of this process (the machine may be busy), medians over
the intervals.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import numpy as np

from agent.probe import loader
from agent.probe.layout import BlameKey, BlameVal, CgroupKey, CgroupVal, HistKey, HistVal
from agent.probe.snapshot import ProbeSnapshot
from agent.export.figures import QUANTILES, Sources
from agent.export.prometheus import Registry, SlatraceCollector
from agent.probe.snapshot import HIST_RUNQ
from agent.store.store import Store
from agent.store.table import quantiles


def rows(services: int, slots: int, culprits: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One interval's drained entries: every service waits in `slots` run-queue
    slots and a tenth as many D-state slots, behind `culprits` random others."""
    rng = np.random.default_rng(seed)
    cgids = np.arange(1000, 1000 + services, dtype=np.uint64)
    io_slots = max(1, slots // 10)
    per = slots + io_slots
    hk = np.zeros(services * per, np.dtype(HistKey))
    hv = np.zeros(len(hk), np.dtype(HistVal))
    hk["cgid"] = np.repeat(cgids, per)
    hk["kind"] = np.tile(np.r_[np.zeros(slots), np.ones(io_slots)], services)
    hk["slot"] = np.tile(np.r_[np.arange(slots) + 40, np.arange(io_slots) + 150], services)
    hv["count"] = rng.integers(1, 50, len(hk))
    hv["sum_ns"] = hv["count"] * rng.integers(10_000, 1_000_000, len(hk))
    bk = np.zeros(services * culprits, np.dtype(BlameKey))
    bv = np.zeros(len(bk), np.dtype(BlameVal))
    bk["victim_cgid"] = np.repeat(cgids, culprits)
    bk["culprit_cgid"] = rng.choice(np.r_[cgids, [0]], len(bk))
    bk["kind"] = rng.integers(0, 2, len(bk))
    bv["count"] = rng.integers(1, 20, len(bk))
    bv["wait_ns"] = bv["count"] * 30_000
    ck = np.zeros(services, np.dtype(CgroupKey))
    cv = np.zeros(services, np.dtype(CgroupVal))
    ck["cgid"] = cgids
    cv["migrations"] = rng.integers(0, 30, services)
    return (loader._hist_rows(hk, hv), loader._blame_rows(bk, bv), loader._cgroup_rows(ck, cv))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.aggregate", description=__doc__.split("\n\n")[0])
    p.add_argument("--services", type=int, default=1000)
    p.add_argument("--slots", type=int, default=80, help="run-queue histogram slots per service per interval")
    p.add_argument("--culprits", type=int, default=40, help="blame entries per service per interval")
    p.add_argument("--intervals", type=int, default=30)
    args = p.parse_args(argv)
    if min(args.services, args.slots, args.culprits, args.intervals) < 1:
        p.error("every count must be at least 1")

    names = {1000 + i: f"svc-{i}" for i in range(args.services)}
    store = Store(900, clock=lambda: float(args.intervals))
    store.ingest(ProbeSnapshot(0, 0.0), names.__getitem__)
    ingest = []
    for i in range(args.intervals):
        h, b, c = rows(args.services, args.slots, args.culprits, seed=i)
        t0 = time.process_time()
        store.ingest(ProbeSnapshot(mono_ns=(i + 1) * 10**9, wall=float(i + 1), hist_rows=h, blame_rows=b,
                                   cgroup_rows=c), names.__getitem__)
        ingest.append(time.process_time() - t0)
        print(f"\rinterval {i + 1}/{args.intervals}: {ingest[-1] * 1e3:.0f} ms", end="", flush=True)
    print()
    t0 = time.process_time()
    window = store.window(60, blame=False)
    t1 = time.process_time()
    recent = quantiles(window.table, HIST_RUNQ, QUANTILES)
    t2 = time.process_time()
    totals = store.totals_table()
    t3 = time.process_time()
    full = store.window(60)
    t4 = time.process_time()
    registry = Registry()
    registry.register(SlatraceCollector(store, sources=Sources(histograms=())))
    text = registry.exposition()
    t5 = time.process_time()
    print(f"{args.services} services, {len(h)} histogram rows + {len(b)} blame rows per interval")
    print(f"ingest per interval (median of {args.intervals}): {statistics.median(ingest) * 1e3:.0f} ms, "
          f"max {max(ingest) * 1e3:.0f} ms")
    print(f"60 s window, histograms only ({window.intervals} intervals): {(t1 - t0) * 1e3:.0f} ms; "
          f"{len(recent) * len(QUANTILES)} quantiles: {(t2 - t1) * 1e3:.0f} ms")
    print(f"totals of {len(totals)} services: {(t3 - t2) * 1e3:.0f} ms; "
          f"60 s window with blame ({len(full.services)} services): {(t4 - t3) * 1e3:.0f} ms")
    print(f"/metrics text (no buckets): {(t5 - t4) * 1e3:.0f} ms, {len(text) / 1e6:.2f} MB")
    print(f"peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
