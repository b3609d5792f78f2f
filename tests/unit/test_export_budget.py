"""The series budget, counted on real scrapes of the collector over a store fed
a synthetic node (tests/support/synthetic_node.py), against figures the node
keeps from its raw values."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as om_generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.config import Config, ServiceRule, Slo
from agent.export.figures import (
    SERIES_PER_SERVICE,
    TOP_CULPRITS,
    AgentStats,
    Sources,
    exported_culprits,
    top_culprits,
)
from agent.export.prometheus import Registry, SlatraceCollector
from agent.store.histogram import Histogram, classic_bounds
from agent.store.store import Store
from tests.support.synthetic_node import SyntheticNode

N = 200


def scrape(store: Store, sources: Sources) -> list:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(SlatraceCollector(store, sources=sources))
    return [s for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples]


def series_by_service(samples: list) -> Counter:
    return Counter(s.labels["service"] for s in samples if "service" in s.labels)


def feed(node: SyntheticNode, store: Store, intervals: int, start: int = 0) -> None:
    for t in range(start, start + intervals + 1):
        store.ingest(node.snapshot(t), node.name)


@pytest.fixture(scope="module")
def node_scrape() -> tuple[SyntheticNode, list, Config]:
    node = SyntheticNode(N, seed=3, neighbours=9)
    # Two services keep their buckets: one by an SLO, one named by a rule.
    config = Config(services=(ServiceRule(name=node.name(node.cgid(7)), cgroup="/x"),),
                    slos=(Slo(service=node.name(node.cgid(10)), runq_p99=0.001),))
    # The store's clock stands just after the last snapshot, so the quantiles'
    # last 60 s hold the intervals.
    store = Store(900, clock=lambda: node.snapshot(3).wall + 0.5, max_services=config.max_services)
    feed(node, store, 3)
    # Every service is throttled and serves requests: each hook adds its series.
    names = [node.name(node.cgid(i)) for i in range(N)]
    sources = Sources(slos=config.slos, histograms=config.histogram_globs(),
                      throttled_seconds=lambda: {n: 0.5 for n in names},
                      request_sched_delay=lambda: {n: Histogram.from_ns([30_000, 900_000]) for n in names})
    return node, scrape(store, sources), config


def expected_series(node: SyntheticNode, i: int) -> int:
    """Series of service i without buckets, counted from the node's raw figures."""
    waits = node.neighbour_wait_ns(i)
    top = set(sorted(waits, key=lambda by: (-waits[by], by))[:TOP_CULPRITS])
    return (3 + 1 + 5                           # runq: +Inf/_sum/_count, wait total, summary (3 quantiles + 2)
            + (3 if node.has_iowait(i) else 0)  # iowait: +Inf/_sum/_count
            + (1 if node.migrations(i) else 0)
            + 3 * (1 if node.untraced(i) else 0)
            + (1 if node.limited_ns(i) else 0)        # its own CPU limit's part
            + 1 + 3                             # throttled; request delay +Inf/_sum/_count
            + node.culprit_series(i, top))


def test_every_service_costs_about_30_series_by_default(node_scrape) -> None:
    node, samples, _ = node_scrape
    counts = series_by_service(samples)
    bucketed = {node.name(node.cgid(7)), node.name(node.cgid(10))}
    assert len(counts) == N
    for i in range(N):
        name = node.name(node.cgid(i))
        if name not in bucketed:
            assert counts[name] == expected_series(node, i), name
    assert max(n for s, n in counts.items() if s not in bucketed) <= SERIES_PER_SERVICE
    # Not vacuous: the worst-placed services use the whole budget.
    assert max(n for s, n in counts.items() if s not in bucketed) == SERIES_PER_SERVICE


def test_buckets_only_for_services_with_an_slo_or_a_rule(node_scrape) -> None:
    node, samples, _ = node_scrape
    les: dict[str, set[str]] = {}
    for s in samples:
        if s.name == "slatrace_runq_latency_seconds_bucket":
            les.setdefault(s.labels["service"], set()).add(s.labels["le"])
    bucketed = {node.name(node.cgid(7)), node.name(node.cgid(10))}
    assert {s for s, le in les.items() if len(le) > 1} == bucketed
    for s in bucketed:
        assert len(les[s]) == len(classic_bounds()) + 1
    # Everyone else keeps +Inf, _sum and _count: rates and means still work.
    assert all(le == {"+Inf"} for s, le in les.items() if s not in bucketed)
    count = {s.labels["service"]: s.value for s in samples if s.name == "slatrace_runq_latency_seconds_count"}
    assert count[node.name(node.cgid(42))] == node.runq_count(42, 3)


def test_all_zero_kinds_have_no_series(node_scrape) -> None:
    node, samples, _ = node_scrape
    io = {s.labels["service"] for s in samples if s.name.startswith("slatrace_iowait_seconds")}
    assert io == {node.name(node.cgid(i)) for i in range(N) if node.has_iowait(i)}
    assert 0 < len(io) < N
    migrations = {s.labels["service"] for s in samples if s.name == "slatrace_migrations_total"}
    assert migrations == {node.name(node.cgid(i)) for i in range(N) if node.migrations(i)}
    untraced = {s.labels["service"] for s in samples if s.name == "slatrace_untraced_events_total"}
    assert untraced == {node.name(node.cgid(i)) for i in range(N) if node.untraced(i)}
    kinds = {s.labels["kind"] for s in samples if s.name == "slatrace_untraced_events_total"}
    assert kinds == {"switch_in", "switch_out", "wakeup"}


def test_culprits_are_the_top_three_by_wait_plus_idle(node_scrape) -> None:
    node, samples, _ = node_scrape
    exported: dict[str, set[str]] = {}
    for s in samples:
        if s.name in ("slatrace_preempted_wait_seconds_total", "slatrace_wakeup_wait_seconds_total"):
            exported.setdefault(s.labels["service"], set()).add(s.labels["by_service"])
    for i in range(N):
        waits = node.neighbour_wait_ns(i)
        assert len(waits) > TOP_CULPRITS  # the node gives more neighbours than the budget keeps
        top = sorted(waits, key=lambda by: (-waits[by], by))[:TOP_CULPRITS]
        if i in (7, 10):   # given buckets by a rule and an SLO: every culprit
            assert exported[node.name(node.cgid(i))] == set(waits) | {"idle"}
        else:
            assert exported[node.name(node.cgid(i))] == set(top) | {"idle"}


def test_a_dead_service_leaves_after_the_retention_and_restarts_from_zero() -> None:
    node = SyntheticNode(5, seed=4, stops={2: 3})   # service 2 is not seen after interval 3
    store = Store(retention_s=10)                   # the clock is the snapshots' own (1 s apart)
    dead = node.name(node.cgid(2))
    feed(node, store, 12)                           # last seen at t=3, newest t=12: 9 s < 10 s
    counts = series_by_service(scrape(store, Sources()))
    assert dead in counts
    store.ingest(node.snapshot(13), node.name)      # 10 s: still within the retention
    assert dead in series_by_service(scrape(store, Sources()))
    store.ingest(node.snapshot(14), node.name)      # 11 s: gone, and only it
    counts = series_by_service(scrape(store, Sources()))
    assert dead not in counts and len(counts) == 4
    # It comes back: its counters start again from its one new interval.
    back = SyntheticNode(5, seed=4)
    store.ingest(back.snapshot(15), back.name)
    samples = scrape(store, Sources())
    count = {s.labels["service"]: s.value for s in samples if s.name == "slatrace_runq_latency_seconds_count"}
    assert count[dead] == back.runq_count(2, 1)
    assert count[node.name(node.cgid(0))] == node.runq_count(0, 15)


def test_services_tracked_never_exceeds_max_services() -> None:
    node = SyntheticNode(50, seed=5)
    store = Store(retention_s=900, max_services=10)
    feed(node, store, 2)
    samples = scrape(store, Sources())
    (tracked,) = [s.value for s in samples if s.name == "slatrace_services_tracked"]
    assert tracked == 10 == len(series_by_service(samples))
    count = {s.labels["service"]: s.value for s in samples if s.name == "slatrace_runq_latency_seconds_count"}
    # Nine names and "other", which holds every wait of the rest.
    assert "other" in count
    assert sum(count.values()) == sum(node.runq_count(i, 2) for i in range(50))


def test_histograms_glob_gives_buckets_to_matching_services() -> None:
    node = SyntheticNode(20, seed=6)
    store = Store(retention_s=900)
    feed(node, store, 1)
    config = Config(histograms=("/svc/001*",))
    samples = scrape(store, Sources(histograms=config.histogram_globs()))
    with_buckets = {s.labels["service"] for s in samples
                    if s.name == "slatrace_runq_latency_seconds_bucket" and s.labels["le"] != "+Inf"}
    assert with_buckets == {f"/svc/{i:04d}" for i in range(10, 20)}


def test_reserved_names_keep_their_place_when_the_cap_is_full() -> None:
    node = SyntheticNode(30, seed=9)
    ruled = node.name(node.cgid(29))   # seen last, after the cap has filled
    store = Store(retention_s=900, max_services=5, reserved=frozenset({ruled}))
    feed(node, store, 1)
    samples = scrape(store, Sources())
    count = {s.labels["service"]: s.value for s in samples if s.name == "slatrace_runq_latency_seconds_count"}
    # Three automatic names, "other" and the reserved one: five.
    assert len(count) == 5 and ruled in count and "other" in count
    assert count[ruled] == node.runq_count(29, 1)
    assert sum(count.values()) == sum(node.runq_count(i, 1) for i in range(30))


def test_totals_of_a_churning_node_equal_the_merge_of_every_interval() -> None:
    """Services that each live a few intervals (cgroup churn): the totals,
    refrozen only for the services an interval changed, equal the merge of all
    the intervals kept."""
    node = SyntheticNode(40, seed=10, waits_per_interval=30, stops={i: 2 + i // 2 for i in range(40)})
    store = Store(retention_s=900)
    for t in range(25):
        store.ingest(node.snapshot(t), node.name)
        if t % 3 == 0:
            store.totals()   # scrapes in between freeze some services early
    totals = store.totals()
    now = node.snapshot(24).wall
    merged = Store._window(store.records(900, now), None, now).services
    assert set(totals) == set(merged) == {node.name(node.cgid(i)) for i in range(40)}
    for name, f in totals.items():
        m = merged[name]
        assert (f.runq.count, f.runq.sum_ns, f.iowait.count, f.migrations) == \
            (m.runq.count, m.runq.sum_ns, m.iowait.count, m.migrations), name
        assert dict(f.runq.items()) == dict(m.runq.items()), name
        assert dict(f.preempted_by) == dict(m.preempted_by) and dict(f.waited_behind) == dict(m.waited_behind)
    assert totals[node.name(node.cgid(39))].runq.count == node.runq_count(39, 24) > 0


def test_fast_exposition_is_byte_for_byte_the_libraries(node_scrape) -> None:
    """/metrics writes the collector's text directly (agent.export.prometheus.render);
    prometheus_client's generate_latest over the same families is the reference."""
    node, _, config = node_scrape
    store = Store(900, clock=lambda: node.snapshot(3).wall + 0.5, max_services=config.max_services)
    feed(node, store, 3)
    # Label values that need escaping: a quote, a backslash and a newline.
    odd = {node.cgid(0): 'we"ird\\name\nx'}
    store2 = Store(900, clock=lambda: node.snapshot(3).wall + 0.5)
    for t in range(4):
        store2.ingest(node.snapshot(t), lambda cg: odd.get(cg) or node.name(cg))
    names = [node.name(node.cgid(i)) for i in range(N)]
    sources = Sources(slos=config.slos, histograms=config.histogram_globs(),
                      throttled_seconds=lambda: {n: 0.5 for n in names},
                      request_sched_delay=lambda: {n: Histogram.from_ns([30_000, 900_000]) for n in names},
                      agent_stats=lambda: AgentStats(poll_duration_seconds=0.25, poll_errors=2))
    for s in (store, store2):
        for src in (sources, Sources(histograms=("*",))):
            collector = SlatraceCollector(s, sources=src)
            registry = Registry()
            registry.register(collector)
            reference = CollectorRegistry(auto_describe=False)
            reference.register(collector)
            fast, slow = registry.exposition(), generate_latest(reference)
            assert fast == slow
            assert fast.count(b"\n") > 2 * N   # not vacuous: a node's worth of samples
            # OpenMetrics (served when the scraper asks) likewise against the library's own writer.
            assert registry.exposition(openmetrics=True) == om_generate_latest(reference)


def test_exported_culprits_are_each_services_top_culprits(node_scrape) -> None:
    """The columnar choice of exported culprits against top_culprits() of each
    service's own figures."""
    node, _, _ = node_scrape
    store = Store(900, clock=lambda: node.snapshot(3).wall + 0.5)
    feed(node, store, 3)
    t = store.totals_table()
    every = np.zeros(len(t.names), bool)
    v, c, _, _, _ = exported_culprits(t, every)
    got: dict[str, set] = {}
    for victim, culprit in zip(v.tolist(), c.tolist()):
        got.setdefault(t.names[victim], set()).add(t.names[culprit])
    want = {}
    for name, f in store.totals().items():
        keep = top_culprits(f)
        named = (set(f.preempted_by) | set(f.waited_behind)) & keep
        if named:
            want[name] = named
    assert got == want
    assert sum(len(x) for x in want.values()) > N   # not vacuous
