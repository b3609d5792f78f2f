"""The fleet scene (tests/support/fleet.py) without Prometheus: each node's
exposition is the agent's exporter's, its counters grow with the ticks, and the
reference the fleet test holds Prometheus against agrees with what a node
exports; bench/fleet.py's extrapolation."""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families

from bench.fleet import extrapolate
from tests.support.fleet import (
    CATALOG,
    SLO_SERVICES,
    FleetSpec,
    LiveNode,
    exact_quantile,
    exported_culprit_wait,
    node_p99,
    node_state,
    slo_targets,
)

SPEC = FleetSpec(nodes=50)


def _samples(body: bytes) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_nodes_differ_and_are_the_same_from_the_same_seed() -> None:
    a, b = node_state(SPEC, 3), node_state(SPEC, 3)
    assert a == b
    states = [node_state(SPEC, i) for i in range(SPEC.nodes)]
    assert all(len(st.services) == SPEC.services_per_node for st in states)
    assert len({frozenset(st.services) for st in states}) > SPEC.nodes // 2
    assert 0 < sum(bool(st.breaching) for st in states) < SPEC.nodes


def test_slo_verdicts_are_clear_cut() -> None:
    # Each node's own P99 is far from its SLO's target: slow nodes above, the rest below.
    targets = slo_targets(SPEC)
    assert set(targets) == set(CATALOG[:SLO_SERVICES])
    for i in range(SPEC.nodes):
        st = node_state(SPEC, i)
        for service, target in targets.items():
            if service in st.services:
                ratio = node_p99(st, service) / target
                assert not 1 / 1.05 < ratio < 1.05, (i, service)
                assert (ratio > 1) == (service in st.breaching), (i, service)


def test_exposition_counts_every_tick_and_the_reference_culprits() -> None:
    st = node_state(SPEC, 7)
    start = time.time() - 30 * SPEC.tick_s   # the store's window (SLOs, quantiles) ends now
    node = LiveNode(SPEC, st, start_wall=start, preload_ticks=40)
    first = _samples(node.exposition(start + 10 * SPEC.tick_s))
    later = _samples(node.exposition(start + 30 * SPEC.tick_s))
    for service, s in st.services.items():
        key = ("slatrace_runq_latency_seconds_count", (("service", service),))
        # 40 ticks before the scene, then 10; 20 more between the two scrapes.
        assert first[key] == 50 * len(s.runq_ns)
        assert later[key] - first[key] == 20 * len(s.runq_ns)
        exported = {dict(labels)["by_service"]: v for (name, labels), v in later.items()
                    if name == "slatrace_preempted_wait_seconds_total" and dict(labels)["service"] == service}
        ref = exported_culprit_wait(SPEC, st, service)
        assert exported.keys() == ref.keys(), service
        for by, w in ref.items():
            assert abs(exported[by] - 70 * w) < 1e-6 * 70 * w + 1e-9, (service, by)
    # The node's SLO verdicts come from the agent's judge.
    for service in slo_targets(SPEC):
        if service in st.services:
            ok = later[("slatrace_slo_ok", (("service", service), ("slo", "runq_p99")))]
            assert ok == (0.0 if service in st.breaching else 1.0)


def test_exact_quantile_is_the_nearest_rank() -> None:
    assert exact_quantile([1_000, 2_000, 3_000, 4_000], 0.5) == 2e-6
    assert exact_quantile([1_000, 2_000, 3_000, 4_000], 0.99) == 4e-6


def test_extrapolation_is_a_least_squares_line_never_falling() -> None:
    pts = [{"nodes": n, "v": v} for n, v in ((100, 1.0), (300, 3.0), (1000, 10.0))]
    assert abs(extrapolate(pts, lambda p: p["v"], 10_000) - 100.0) < 1e-9
    noisy = [{"nodes": n, "v": v} for n, v in ((100, 2.0), (300, 1.0), (1000, 1.5))]
    assert extrapolate(noisy, lambda p: p["v"], 10_000) == (2.0 + 1.0 + 1.5) / 3
    assert extrapolate(pts[:1], lambda p: p["v"]) is None
