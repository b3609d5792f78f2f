"""The causes of a service's waits over a window: its own CPU limit's part
(measured per wait by the kernel), the rest by who held the CPU, against a
hand-built window."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from agent.attribution.attribution import service_record
from agent.attribution.blame import blame
from agent.attribution.causes import CAUSES, by_cause, cause_of, tail_share, wait_by_cause
from agent.probe.layout import CGROUP_FIELDS
from agent.probe.snapshot import PairCounters
from agent.store.histogram import Histogram
from agent.store.table import ServiceInterval

MS = 1_000_000


def window(limit_waits: list[int], other_waits: list[int], limit_ns: int) -> ServiceInterval:
    """A limited service: `limit_waits` held in part (limit_ns in all) by its
    own CPU limit, the rest of each after the limit lifted behind an idle CPU;
    `other_waits` behind a neighbour (2/3) and its own threads (1/3)."""
    runq = Histogram.from_ns(limit_waits + other_waits)
    limited = Histogram.from_ns(limit_waits)
    rest = sum(limit_waits) - limit_ns
    other = sum(other_waits)
    counters = dict.fromkeys(CGROUP_FIELDS, 0)
    counters.update(limited_runq=len(limit_waits), limited_runq_ns=limit_ns)
    return ServiceInterval(runq=runq, iowait=Histogram(), cgroups=frozenset({7}),
                           preempted_by=MappingProxyType({"batch": PairCounters(10, other * 2 // 3),
                                                          "vllm": PairCounters(5, other - other * 2 // 3)}),
                           waited_behind=MappingProxyType({"idle": PairCounters(len(limit_waits), rest)}),
                           counters=MappingProxyType(counters), runq_limited=limited)


def test_every_wait_is_split_by_cause_and_the_parts_add_up():
    w = window([80 * MS] * 10, [1 * MS] * 990, limit_ns=790 * MS)
    split = wait_by_cause("vllm", w)
    assert list(split) == ["cpu_limit", "neighbour", "own_threads", "idle"]
    assert split["cpu_limit"] == pytest.approx(0.790)
    assert split["idle"] == pytest.approx(0.010)
    assert split["neighbour"] == pytest.approx(0.660) and split["own_threads"] == pytest.approx(0.330)
    assert sum(split.values()) == pytest.approx(w.runq.sum_seconds)


def test_the_tail_reads_as_its_own_limit():
    # 980 short waits behind others and 20 long ones the limit held: the P99
    # lies among the long ones, and every wait at or above it is the limit's.
    w = window([80 * MS] * 20, [1 * MS] * 980, limit_ns=1580 * MS)
    assert tail_share(w.runq, w.runq_limited, 0.99) == 1.0
    assert tail_share(w.runq, w.runq_limited, 0.5) == pytest.approx(20 / 1000)
    # With 1% long waits the P99 is the last short one: its slot holds them all.
    one_percent = window([80 * MS] * 10, [1 * MS] * 990, limit_ns=790 * MS)
    assert tail_share(one_percent.runq, one_percent.runq_limited, 0.99) == pytest.approx(10 / 1000)
    record = service_record("vllm", 0.0, 60.0, w)
    without = record["cpu_limit"].pop("without_limit")
    assert record["cpu_limit"] == {"count": 20, "wait_seconds": pytest.approx(1.580), "p99_share": 1.0}
    # The waits the limit did not hold: the 980 of 1 ms, contention alone.
    assert without["count"] == 980 and without["p99"] == pytest.approx(0.001, rel=0.07)
    assert record["runq"]["p99"] > 0.05
    assert record["runq"]["by_cause"]["cpu_limit"] == pytest.approx(1.580)
    assert "100% of the waits at or above it held by its own CPU limit" in record["verdict"]
    # Contention alone: no tail share.
    calm = window([], [1 * MS] * 100, limit_ns=0)
    assert tail_share(calm.runq, calm.runq_limited, 0.99) == 0.0
    assert "without_limit" not in service_record("vllm", 0.0, 60.0, calm)["cpu_limit"]


def test_blame_takes_the_measured_limit_not_the_groups_throttled_time():
    w = window([80 * MS] * 10, [1 * MS] * 990, limit_ns=790 * MS)
    # cpu.stat's throttled time (the group's wall time, 0.4 s) is ignored when
    # the waits were measured: the pairs hold only the rest of those waits.
    b = blame("vllm", w, throttled_seconds=0.4)
    own = [s for s in b["shares"] if s["kind"] == "own_quota"]
    assert own == [{"cause": "throttling", "kind": "own_quota", "seconds": pytest.approx(0.790),
                    "share": pytest.approx(0.790 / 1.790), "measured": "per_wait"}]
    assert sum(s["seconds"] for s in b["shares"]) == pytest.approx(w.runq.sum_seconds)
    # Without a measured part (classic tracepoints) cpu.stat stands in.
    unmeasured = window([], [1 * MS] * 990, limit_ns=0)
    own = [s for s in blame("vllm", unmeasured, throttled_seconds=0.4)["shares"] if s["kind"] == "own_quota"]
    assert own[0]["measured"] == "cpu.stat" and own[0]["seconds"] == pytest.approx(0.4)


def test_the_vocabulary_is_closed():
    assert CAUSES == ("neighbour", "cpu_limit", "own_threads", "kernel", "idle", "unknown")
    assert [cause_of(c, "vllm") for c in ("batch", "cpu_limit", "vllm", "kernel", "idle", "unknown")] == \
        ["neighbour", "cpu_limit", "own_threads", "kernel", "idle", "unknown"]
    assert by_cause([("a", 1.0), ("b", 2.0), ("vllm", 0.5)], "vllm") == {"neighbour": 3.0, "own_threads": 0.5}


def test_the_services_a_limit_held_are_read_from_the_counters_column():
    from agent.probe.snapshot import CgroupCounters, ProbeSnapshot
    from agent.store.store import Store

    store = Store(retention_s=60)
    names = {1: "limited", 2: "free"}
    store.ingest(ProbeSnapshot(0, 1000.0), names.__getitem__)
    record = store.ingest(ProbeSnapshot.from_dicts(10**9, 1001.0, cgroups={
        1: CgroupCounters(limited_runq=3, limited_runq_ns=9_000_000), 2: CgroupCounters(migrations=4)}),
        names.__getitem__)
    assert record.table.services_with("limited_runq") == ["limited"]
    assert record.table.services_with("migrations") == ["free"]
