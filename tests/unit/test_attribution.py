"""Blame, verdicts and SLO breach counting on hand-built windows.

Every expected number is worked out by hand from the inputs, so the split
rule (measured shares, throttling taken out of the preemption waits first) is
pinned down exactly.
"""

from __future__ import annotations

from types import MappingProxyType

import pytest

from agent.attribution.attribution import attribution, service_record
from agent.attribution.blame import blame, blame_from_totals
from agent.attribution.breaches import SloBreaches
from agent.config import Slo
from agent.probe.layout import CGROUP_FIELDS
from agent.probe.snapshot import Bucket, PairCounters
from agent.store.histogram import Histogram, slot_of
from agent.store.store import ServiceInterval, Window

MS = 1_000_000


def hist(values_ns: list[int]) -> Histogram:
    buckets: dict[int, list[int]] = {}
    for v in values_ns:
        b = buckets.setdefault(slot_of(v), [0, 0])
        b[0] += 1
        b[1] += v
    return Histogram({s: Bucket(c, t) for s, (c, t) in buckets.items()})


def figures(runq_ns: list[int], by: dict[str, tuple[int, int]], iowait_ns: list[int] = ()) -> ServiceInterval:
    return ServiceInterval(runq=hist(runq_ns), iowait=hist(list(iowait_ns)),
                           preempted_by=MappingProxyType({k: PairCounters(*v) for k, v in by.items()}),
                           cgroups=frozenset({1}), counters=dict.fromkeys(CGROUP_FIELDS, 0) | {"migrations": 3})


def test_neighbours_ranked_by_measured_wait() -> None:
    # 1.0 s of run-queue wait: 0.5 s after preemptions by "batch", 0.2 s by
    # "etl", 0.1 s by the kernel; 0.2 s after wakeups; plus 0.25 s of D state.
    f = figures([100 * MS] * 10, {"batch": (5, 500 * MS), "etl": (2, 200 * MS), "unknown": (1, 100 * MS)},
                [250 * MS])
    b = blame("web", f)
    assert b["delay_seconds"] == pytest.approx(1.25)
    assert [(c["service"], c["kind"]) for c in b["culprits"]] == [
        ("batch", "neighbour"), ("etl", "neighbour"), ("unknown", "kernel")]
    assert [c["seconds"] for c in b["culprits"]] == pytest.approx([0.5, 0.2, 0.1])
    assert b["kinds"]["neighbour"]["share"] == pytest.approx(0.7 / 1.25)
    assert b["kinds"]["busy_cpu"]["seconds"] == pytest.approx(0.2)
    assert b["kinds"]["io"]["seconds"] == pytest.approx(0.25)
    assert b["cause"] == "neighbours"
    assert sum(s["share"] for s in b["shares"]) == pytest.approx(1.0)


def test_own_quota_is_not_neighbour_contention() -> None:
    # 2.0 s of run-queue wait, 1.8 s of it after "preemptions" (a throttled task
    # is switched out as if preempted: mostly by idle, some by a neighbour);
    # cpu.stat says the cgroup was throttled 1.5 s.
    f = figures([200 * MS] * 10, {"unknown": (10, 1200 * MS), "batch": (4, 600 * MS)})
    b = blame("api", f, throttled_seconds=1.5)
    # 1.5 s of the 1.8 s preemption wait is throttling: each culprit keeps 0.3/1.8 of its own.
    assert b["kinds"]["own_quota"]["seconds"] == pytest.approx(1.5)
    assert {c["service"]: c["seconds"] for c in b["culprits"]} == pytest.approx(
        {"unknown": 1.2 * 0.3 / 1.8, "batch": 0.6 * 0.3 / 1.8})
    assert b["kinds"]["busy_cpu"]["seconds"] == pytest.approx(0.2)
    assert b["cause"] == "own_quota"
    rec = service_record("api", 0.0, 10.0, f, throttled_seconds=1.5)
    assert "own CPU limit" in rec["verdict"] and "held its threads 1.50 s" in rec["verdict"]
    assert "75%" in rec["verdict"]  # 1.5 of 2.0 s
    # Throttling larger than the wait it can explain is capped at that wait.
    assert blame("api", f, throttled_seconds=9.0)["kinds"]["own_quota"]["seconds"] == pytest.approx(2.0)


def test_throttling_beyond_preemption_waits_comes_from_wakeup_waits() -> None:
    b = blame_from_totals("x", runq_wait=1.0, iowait=0.0, preempted={"n": 0.2}, throttled_seconds=0.5)
    assert b["kinds"]["own_quota"]["seconds"] == pytest.approx(0.5)
    assert b["culprits"] == []            # all 0.2 s of preemption wait was throttling
    assert b["kinds"]["busy_cpu"]["seconds"] == pytest.approx(0.5)


def test_self_and_idle_service() -> None:
    b = blame("pool", figures([10 * MS] * 4, {"pool": (4, 40 * MS)}))
    assert b["cause"] == "self" and b["culprits"][0]["kind"] == "self"
    quiet = service_record("idle", 0.0, 1.0, figures([], {}))
    assert quiet["blame"]["cause"] == "none"
    assert quiet["verdict"] == "idle: no measurable scheduling or I/O delay in this window."


def test_attribution_document_keeps_every_field_and_adds_blame() -> None:
    w = Window(start=10.0, end=20.0, services=MappingProxyType({
        "web": figures([1 * MS] * 100, {"batch": (10, 50 * MS)}),
        "batch": figures([8 * MS] * 100, {"web": (3, 3 * MS)}),
    }), intervals=10, errors=MappingProxyType({}))
    slos = (Slo(service="batch", runq_p99=0.005),)
    doc = attribution(w, slos, throttled={"web": 0.01}, breaches={("batch", "runq_p99"): 7})
    assert [r["service"] for r in doc["attribution"]] == ["batch", "web"]  # worst P99 first
    batch, web = doc["attribution"]
    for key in ("service", "start", "end", "runq", "preemption", "iowait", "migrations", "throttled_seconds",
                "slo", "blame", "verdict"):
        assert key in web
    assert web["throttled_seconds"] == 0.01
    assert batch["slo"] == [{"name": "runq_p99", "target": 0.005, "value": pytest.approx(0.008, rel=0.07),
                             "ok": False, "intervals_breached": 7}]
    assert "runq_p99" in batch["verdict"] and "over its 5 ms target" in batch["verdict"]


def test_slo_breaches_count_intervals() -> None:
    slos = (Slo(service="web", runq_p99=0.005, iowait_p99=0.1),)
    b = SloBreaches(slos, retention_s=30.0)
    bad = {"web": figures([9 * MS] * 50, {})}
    good = {"web": figures([1 * MS] * 50, {})}
    assert b.observe(1.0, bad) == [("web", "runq_p99")]
    assert b.observe(2.0, good) == []
    assert b.observe(3.0, bad) == [("web", "runq_p99")]
    assert b.observe(4.0, {"other": figures([9 * MS], {})}) == []  # web idle: nothing broke
    assert b.totals() == {("web", "runq_p99"): 2, ("web", "iowait_p99"): 0}
    assert b.between(1.5, 4.0) == {("web", "runq_p99"): 1}
    b.observe(40.0, good)  # older than the retention window: gone from between(), kept in totals
    assert b.between(0.0, 40.0) == {}
    assert b.totals()[("web", "runq_p99")] == 2


def test_lost_waits_stay_unattributed_and_lower_coverage() -> None:
    # 1.0 s recorded (10 waits of 100 ms) + 0.5 s that no histogram slot took
    # (5 waits); 0.4 s behind "batch" recorded, 0.6 s of wakeup wait with no
    # blame entry.
    f = figures([100 * MS] * 10, {})
    f = ServiceInterval(runq=f.runq, iowait=f.iowait, preempted_by=f.preempted_by, cgroups=f.cgroups,
                        waited_behind=MappingProxyType({"batch": PairCounters(4, 400 * MS)}),
                        counters=dict.fromkeys(CGROUP_FIELDS, 0) | {"lost_runq": 5, "lost_runq_ns": 500 * MS,
                                                                    "lost_blame": 11, "lost_blame_ns": 1100 * MS})
    b = blame("web", f)
    assert b["delay_seconds"] == pytest.approx(1.5)
    # Known culprits keep their measured time; the rest is named unattributed.
    assert b["culprits"] == [pytest.approx({"service": "batch", "kind": "neighbour", "seconds": 0.4,
                                            "share": 0.4 / 1.5})]
    assert b["unattributed"]["seconds"] == pytest.approx(1.1)
    assert b["cause"] == "unattributed"
    assert sum(s["share"] for s in b["shares"]) == pytest.approx(1.0)
    rec = service_record("web", 0.0, 1.0, f)
    assert rec["runq"]["coverage"] == pytest.approx(10 / 15)
    assert rec["runq"]["lost"] == 5
    assert "no recorded culprit" in rec["verdict"]
