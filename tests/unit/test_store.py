"""Store: hand-made drained snapshots (one interval of counts each) with hand-computed intervals."""

from __future__ import annotations

import math
import threading
from collections import Counter

import pytest

from agent.probe.snapshot import (
    HIST_IOWAIT,
    HIST_RUNQ,
    Bucket,
    CgroupCounters,
    PairCounters,
    ProbeSnapshot,
    ProgramStats,
)
from agent.store.histogram import Histogram
from agent.store.store import Store

R, IO = HIST_RUNQ, HIST_IOWAIT
WEB_A, BATCH, WEB_B = 101, 102, 103  # two cgroups of "web", one of "batch"
SERVICES = {WEB_A: "web", BATCH: "batch", WEB_B: "web"}


class CountingResolver:
    def __init__(self) -> None:
        self.calls: Counter[int] = Counter()

    def __call__(self, cgid: int) -> str:
        self.calls[cgid] += 1
        return SERVICES[cgid]


def snap(t: int, hists=None, pairs=None, cgroups=None, errors=None, programs=None) -> ProbeSnapshot:
    return ProbeSnapshot.from_dicts(
        mono_ns=t * 1_000_000_000,
        wall=1000.0 + t,
        hists=hists or {},
        pairs=pairs or {},
        cgroups=cgroups or {},
        errors=errors or {},
        programs=programs or {},
    )


BASE = snap(0)
S1 = snap(
    1,
    hists={
        (WEB_A, R): {20: Bucket(2, 1200)},
        (WEB_B, R): {20: Bucket(1, 600), 40: Bucket(1, 5000)},
        (BATCH, R): {40: Bucket(4, 20000)},
        (WEB_A, IO): {100: Bucket(1, 70000)},
    },
    pairs={(WEB_A, BATCH): PairCounters(2, 3000), (WEB_B, 0): PairCounters(1, 500)},
    cgroups={WEB_A: CgroupCounters(migrations=3), BATCH: CgroupCounters(migrations=1, untraced_switch_in=1)},
    errors={"hists": 0},
    programs={"sched_switch": ProgramStats(100, 50_000)},
)
S2 = snap(
    2,
    hists={
        (WEB_A, R): {20: Bucket(3, 1800), 21: Bucket(1, 700)},
        (WEB_B, R): {20: Bucket(0, 0)},                           # an entry that counted nothing
        (BATCH, R): {40: Bucket(1, 5100)},
    },
    pairs={(WEB_A, BATCH): PairCounters(1, 1000), (BATCH, WEB_A): PairCounters(1, 250)},
    cgroups={
        WEB_A: CgroupCounters(migrations=2),
        BATCH: CgroupCounters(untraced_wakeup=2),
    },
    errors={"hists": 2},                                          # cumulative: +2
    programs={"sched_switch": ProgramStats(250, 90_000)},
)

# Hand-computed intervals.
WEB_1_RUNQ = Histogram({20: Bucket(3, 1800), 40: Bucket(1, 5000)})
WEB_2_RUNQ = Histogram({20: Bucket(3, 1800), 21: Bucket(1, 700)})
BATCH_1_RUNQ = Histogram({40: Bucket(4, 20000)})
BATCH_2_RUNQ = Histogram({40: Bucket(1, 5100)})


def filled_store(retention_s: float = 900.0) -> tuple[Store, CountingResolver, list]:
    store = Store(retention_s, clock=lambda: 1002.0)
    resolver = CountingResolver()
    out = [store.ingest(s, resolver) for s in (BASE, S1, S2)]
    return store, resolver, out


def test_first_snapshot_is_the_baseline() -> None:
    store = Store(60)
    resolver = CountingResolver()
    assert store.ingest(S1, resolver) is None
    assert store.intervals_collected == 0 and store.latest() is None
    assert not resolver.calls
    # Whatever the baseline held is not part of the first interval.
    rec = store.ingest(S2, resolver)
    assert rec is not None
    assert rec.services["batch"].runq == BATCH_2_RUNQ
    assert rec.services["web"].runq == Histogram({20: Bucket(3, 1800), 21: Bucket(1, 700)})


def test_first_interval_aggregates_cgroups_per_service() -> None:
    _, _, (none, r1, _) = filled_store()
    assert none is None
    assert (r1.start, r1.end, r1.start_mono_ns, r1.end_mono_ns) == (1000.0, 1001.0, 0, 1_000_000_000)
    web, batch = r1.services["web"], r1.services["batch"]
    assert set(r1.services) == {"web", "batch"}
    assert web.runq == WEB_1_RUNQ
    assert web.runq.count == 4 and web.runq.sum_ns == 6800
    assert web.iowait == Histogram({100: Bucket(1, 70000)})
    assert dict(web.preempted_by) == {"batch": PairCounters(2, 3000), "unknown": PairCounters(1, 500)}
    assert web.preemptions == 3 and web.preempted_wait_ns == 3500
    assert web.migrations == 3 and web.counters["untraced_switch_in"] == 0
    assert web.cgroups == frozenset({WEB_A, WEB_B})
    assert batch.runq == BATCH_1_RUNQ
    assert batch.iowait.count == 0
    assert dict(batch.preempted_by) == {}
    assert (batch.migrations, batch.counters["untraced_switch_in"], batch.counters["untraced_wakeup"]) == (1, 1, 0)
    assert batch.cgroups == frozenset({BATCH})
    assert dict(r1.errors) == {}


def test_second_interval_is_the_drained_counts() -> None:
    _, _, (_, _, r2) = filled_store()
    web, batch = r2.services["web"], r2.services["batch"]
    assert web.runq == WEB_2_RUNQ
    assert web.iowait.count == 0
    assert dict(web.preempted_by) == {"batch": PairCounters(1, 1000)}
    assert web.migrations == 2
    # WEB_B's entry counted nothing: it did nothing.
    assert web.cgroups == frozenset({WEB_A})
    assert batch.runq == BATCH_2_RUNQ
    assert dict(batch.preempted_by) == {"web": PairCounters(1, 250)}
    assert (batch.migrations, batch.counters["untraced_switch_in"], batch.counters["untraced_wakeup"]) == (0, 0, 2)
    assert dict(r2.errors) == {"hists": 2}


def test_service_of_called_once_per_cgroup_per_ingest() -> None:
    store = Store(60)
    store.ingest(BASE, CountingResolver())
    for s in (S1, S2):
        resolver = CountingResolver()
        store.ingest(s, resolver)
        assert resolver.calls and max(resolver.calls.values()) == 1
        assert 0 not in resolver.calls  # the unknown preemptor is never resolved
    # S2's preemptor WEB_A of BATCH was resolved through service_of.
    assert resolver.calls[WEB_A] == 1 and resolver.calls[BATCH] == 1


def test_probe_reload_restarts_the_error_counters() -> None:
    store, resolver, _ = filled_store()
    reloaded = snap(
        3,
        hists={(WEB_A, R): {20: Bucket(1, 610)}},
        pairs={(WEB_A, BATCH): PairCounters(1, 90)},
        cgroups={WEB_A: CgroupCounters(migrations=1)},
        errors={"hists": 1},
    )
    rec = store.ingest(reloaded, resolver)
    web = rec.services["web"]
    assert web.runq == Histogram({20: Bucket(1, 610)})
    assert dict(web.preempted_by) == {"batch": PairCounters(1, 90)}
    assert web.migrations == 1
    assert dict(rec.errors) == {"hists": 1}
    assert set(rec.services) == {"web"}
    assert store.error_totals() == {"hists": 3}


def test_window_merges_to_hand_summed_histograms() -> None:
    store, _, _ = filled_store()
    w = store.window(since_s=60)
    assert (w.start, w.end, w.intervals) == (1000.0, 1002.0, 2)
    web = w.services["web"]
    assert web.runq == Histogram({20: Bucket(6, 3600), 21: Bucket(1, 700), 40: Bucket(1, 5000)})
    assert web.runq == WEB_1_RUNQ + WEB_2_RUNQ
    assert web.iowait == Histogram({100: Bucket(1, 70000)})
    assert dict(web.preempted_by) == {"batch": PairCounters(3, 4000), "unknown": PairCounters(1, 500)}
    assert web.migrations == 5
    assert web.cgroups == frozenset({WEB_A, WEB_B})
    batch = w.services["batch"]
    assert batch.runq == Histogram({40: Bucket(5, 25100)})
    assert (batch.migrations, batch.counters["untraced_switch_in"], batch.counters["untraced_wakeup"]) == (1, 1, 2)
    assert dict(w.errors) == {"hists": 2}

    only_batch = store.window(since_s=60, service="batch")
    assert set(only_batch.services) == {"batch"}
    assert only_batch.services["batch"] == batch

    # Intervals ending after now - since_s: only the second one.
    last = store.window(since_s=0.5, now=1002.0)
    assert (last.start, last.end, last.intervals) == (1001.0, 1002.0, 1)
    assert last.services["web"].runq == WEB_2_RUNQ

    empty = store.window(since_s=10, now=2000.0)
    assert (empty.start, empty.end, empty.intervals, dict(empty.services)) == (2000.0, 2000.0, 0, {})


def test_between_selects_overlapping_intervals() -> None:
    store, _, _ = filled_store()
    w = store.between(1001.2, 1001.8, service="web")
    assert (w.start, w.end, w.intervals) == (1001.0, 1002.0, 1)
    assert w.services["web"].runq == WEB_2_RUNQ
    assert store.between(1000.5, 1001.5).intervals == 2


def _runq_only(t: int, count: int) -> ProbeSnapshot:
    return snap(t, hists={(WEB_A, R): {20: Bucket(count, count * 300)}})


def test_retention_prunes_old_intervals_but_not_totals() -> None:
    store = Store(retention_s=2.5, clock=lambda: 1006.0)
    resolver = CountingResolver()
    for t, c in enumerate(range(7)):  # interval i counts i
        store.ingest(_runq_only(t, c), resolver)
    # Newest end 1006: ends >= 1003.5 are kept.
    assert [r.end for r in store.records(since_s=100)] == [1004.0, 1005.0, 1006.0]
    assert store.intervals_collected == 6
    assert store.window(since_s=100).services["web"].runq.count == 4 + 5 + 6
    assert store.totals()["web"].runq.count == 21
    assert store.totals()["web"].runq.sum_ns == 21 * 300
    assert store.latest().end == 1006.0


def test_lost_waits_and_coverage_are_summed_per_service() -> None:
    store = Store(60)
    store.ingest(BASE, CountingResolver())
    lost = snap(1, hists={(WEB_A, R): {20: Bucket(3, 900)}},
                cgroups={WEB_A: CgroupCounters(lost_runq=1, lost_runq_ns=400, lost_blame=2, lost_blame_ns=700),
                         WEB_B: CgroupCounters(lost_runq=2, lost_runq_ns=800, lost_iowait=1, lost_iowait_ns=5)})
    web = store.ingest(lost, CountingResolver()).services["web"]
    assert web.lost_runq == PairCounters(3, 1200)
    assert web.lost_iowait == PairCounters(1, 5)
    assert web.lost_blame == PairCounters(2, 700)
    assert web.coverage == pytest.approx(3 / 6)
    assert store.totals()["web"].lost_runq == PairCounters(3, 1200)
    assert store.window(60, now=1001.0).services["web"].coverage == pytest.approx(0.5)


def test_programs_and_readers_get_immutable_objects() -> None:
    store, _, (_, r1, _) = filled_store()
    assert dict(store.programs()) == {"sched_switch": ProgramStats(250, 90_000)}
    with pytest.raises(TypeError):
        r1.services["other"] = r1.services["web"]  # type: ignore[index]
    with pytest.raises(TypeError):
        r1.services["web"].preempted_by["x"] = PairCounters(1, 1)  # type: ignore[index]
    totals = store.totals()
    with pytest.raises(TypeError):
        totals["web"] = totals["batch"]  # type: ignore[index]
    assert store.totals()["web"].runq.count == 8


def test_failed_resolution_carries_the_counts_over() -> None:
    store = Store(60)
    store.ingest(BASE, CountingResolver())

    def broken(cgid: int) -> str:
        raise LookupError(cgid)

    with pytest.raises(LookupError):
        store.ingest(S1, broken)
    assert store.intervals_collected == 0
    rec = store.ingest(S2, CountingResolver())
    # S1's counts, drained from the kernel already, are carried into this interval.
    assert rec.start == 1000.0
    assert rec.services["web"].runq == WEB_1_RUNQ + WEB_2_RUNQ
    assert dict(rec.services["web"].preempted_by) == {"batch": PairCounters(3, 4000), "unknown": PairCounters(1, 500)}
    assert rec.services["batch"].migrations == 1


def test_concurrent_readers_see_consistent_windows() -> None:
    store = Store(retention_s=1000)
    resolver = CountingResolver()
    store.ingest(_runq_only(0, 0), resolver)
    stop = threading.Event()
    bad: list[str] = []

    def read() -> None:
        while not stop.is_set():
            w = store.window(since_s=10_000, now=5000.0)
            web = w.services.get("web")
            n = web.runq.count if web else 0
            # Interval i adds i, so up to interval k the count is k(k+1)/2
            # (however many of them have been merged into blocks).
            k = round(w.end - 1000.0) if w.intervals else 0
            if n != k * (k + 1) // 2:
                bad.append(f"up to interval {k}, count {n}")

    readers = [threading.Thread(target=read) for _ in range(3)]
    for t in readers:
        t.start()
    for i in range(1, 300):
        store.ingest(_runq_only(i, i), resolver)
    stop.set()
    for t in readers:
        t.join()
    assert not bad
    assert store.totals()["web"].runq.count == 299 * 300 // 2


def test_old_intervals_are_merged_into_blocks_without_losing_counts() -> None:
    """Past the fine horizon, one-second intervals become one record per
    block; every count is still there and recent intervals stay fine."""
    from agent.store.store import BLOCK_S, FINE_S

    store = Store(retention_s=900, clock=lambda: 1000.0 + 400)
    resolver = CountingResolver()
    store.ingest(snap(0), resolver)
    for t in range(1, 401):
        store.ingest(_runq_only(t, t % 7 + 1), resolver)
    recs = store.records(since_s=10_000)
    fine = [r for r in recs if not r.coarse]
    coarse = [r for r in recs if r.coarse]
    assert coarse and all(r.end - r.start <= BLOCK_S for r in coarse)
    assert all(math.floor(r.start / BLOCK_S) == math.floor((r.end - 0.5) / BLOCK_S) for r in coarse)
    assert min(r.end for r in fine) <= 1400 - FINE_S + BLOCK_S
    assert all(r.end - r.start == 1.0 for r in fine)
    # Contiguous, and no count lost or doubled.
    assert all(a.end == b.start for a, b in zip(recs, recs[1:]))
    assert store.window(since_s=10_000).services["web"].runq.count == sum(t % 7 + 1 for t in range(1, 401))
    assert len(recs) < 400 - FINE_S


def test_culprits_beyond_the_largest_are_summed_as_other() -> None:
    """Per interval a victim keeps its 8 largest culprits by wait; the rest
    are summed under "other", waits and counts intact."""
    from agent.store.store import CULPRITS_KEPT

    names = {1: "web"} | {100 + i: f"c{i}" for i in range(20)}
    store = Store(60)
    store.ingest(snap(0), names.__getitem__)
    pairs = {(1, 100 + i): PairCounters(1, 1000 * (i + 1)) for i in range(20)}
    rec = store.ingest(ProbeSnapshot.from_dicts(10**9, 1001.0, pairs=pairs), names.__getitem__)
    by = dict(rec.services["web"].preempted_by)
    assert len(by) == CULPRITS_KEPT + 1
    assert {f"c{i}" for i in range(12, 20)} | {"other"} == set(by)
    assert by["other"] == PairCounters(12, 1000 * sum(range(1, 13)))
    assert sum(p.wait_ns for p in by.values()) == 1000 * sum(range(1, 21))


def test_totals_read_before_and_after_their_pending_intervals_merge() -> None:
    """The totals merge their pending intervals when read; the names and
    cgroups of the services are answered without merging, and agree."""
    store, _, _ = filled_store()
    assert store.services() == {"web", "batch"}
    assert store.cgroups("web") == {WEB_A, WEB_B} and store.cgroups("batch") == {BATCH}
    assert store.cgroups("nobody") == frozenset()
    totals = store.totals()
    assert set(totals) == store.services()
    assert totals["web"].cgroups == store.cgroups("web")
    # Merged, and read again: the same figures.
    assert store.totals()["web"].runq == totals["web"].runq


def test_a_service_gone_for_the_retention_leaves_the_totals_as_a_culprit_too() -> None:
    """batch delays web, then dies; web lives on. After the retention batch is
    gone from the totals as a victim and as web's culprit, so none of its
    series stays in /metrics; web's own counts stay whole."""
    store = Store(retention_s=2.5, clock=lambda: 1006.0)
    resolver = CountingResolver()
    store.ingest(snap(0), resolver)
    store.ingest(snap(1, hists={(WEB_A, R): {20: Bucket(2, 1200)}, (BATCH, R): {40: Bucket(4, 20000)}},
                      pairs={(WEB_A, BATCH): PairCounters(2, 1200)}), resolver)
    assert store.totals()["web"].preempted_by["batch"] == PairCounters(2, 1200)
    for t in range(2, 7):   # web alone
        store.ingest(snap(t, hists={(WEB_A, R): {20: Bucket(1, 600)}}), resolver)
    totals = store.totals()
    assert "batch" not in totals and "batch" not in totals["web"].preempted_by
    assert totals["web"].runq.count == 2 + 5
