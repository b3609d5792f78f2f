"""The collector over a hand-built store, against counts made from the raw values.

The reference side never goes through Histogram or cumulative_counts: bucket
counts are brute-force counts of raw nanosecond values, and histogram_quantile
is re-implemented here from Prometheus' promql/quantile.go (bucketQuantile).
"""

from __future__ import annotations

import importlib.util
import math
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.config import Slo
from agent.export import figures
from agent.export.catalog import SCHEDULER
from agent.export.figures import AgentStats, Sources
from agent.export.prometheus import SlatraceCollector
from agent.probe.layout import ERROR_MAPS
from agent.probe.snapshot import Bucket, CgroupCounters, PairCounters, ProbeSnapshot, ProgramStats
from agent.store.histogram import Histogram, classic_bounds
from agent.store.store import Store

CG_API, CG_BATCH, CG_DB = 101, 202, 303
NAMES = {CG_API: "api", CG_BATCH: "batch", CG_DB: "db"}


def prometheus_histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float:
    """Prometheus' bucketQuantile: linear interpolation inside the bucket that
    holds rank q*count, the first bucket starting at 0, answers in the +Inf
    bucket clamped to the highest finite bound. `buckets` are (le, cumulative)."""
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    buckets = sorted(buckets)
    if len(buckets) < 2 or not math.isinf(buckets[-1][0]):
        return math.nan
    total = buckets[-1][1]
    if total == 0:
        return math.nan
    rank = q * total
    b = next(i for i, (_, c) in enumerate(buckets[:-1]) if c >= rank) if any(
        c >= rank for _, c in buckets[:-1]) else len(buckets) - 1
    if b == len(buckets) - 1:
        return buckets[-2][0]
    if b == 0 and buckets[0][0] <= 0:
        return buckets[0][0]
    start, end, count = 0.0, buckets[b][0], buckets[b][1]
    if b > 0:
        start = buckets[b - 1][0]
        count -= buckets[b - 1][1]
        rank -= buckets[b - 1][1]
    return start + (end - start) * (rank / count)


class Recorder:
    """Kernel-side counts built from raw events. The lists and sums are
    cumulative (the brute-force reference); snapshot() hands over only what
    came since the previous one, as the drained BPF maps do."""

    def __init__(self) -> None:
        self.runq: dict[int, list[int]] = {}
        self.iowait: dict[int, list[int]] = {}
        self.pairs: dict[tuple[int, int], list[int]] = {}
        self.migrations: dict[int, int] = {}
        self.switch_cnt = 0
        self.switch_ns = 0
        self.map_errors = 0
        self._sent: dict[object, object] = {}

    def _since_last(self, key: object, now: object, zero: object) -> object:
        before = self._sent.get(key, zero)
        self._sent[key] = now
        return before

    def snapshot(self, t: float) -> ProbeSnapshot:
        hists: dict[tuple[int, int], dict[int, Bucket]] = {}
        for kind, per_cg in ((0, self.runq), (1, self.iowait)):
            for cg, values in per_cg.items():
                done = self._since_last(("hist", kind, cg), len(values), 0)
                if values[done:]:
                    hists[(cg, kind)] = dict(Histogram.from_ns(values[done:]).items())
        pairs = {}
        for k, (c, w) in self.pairs.items():
            c0, w0 = self._since_last(("pair", k), (c, w), (0, 0))
            pairs[k] = PairCounters(c - c0, w - w0)
        cgroups = {}
        for cg, n in self.migrations.items():
            n0 = self._since_last(("migrations", cg), n, 0)
            cgroups[cg] = CgroupCounters(migrations=n - n0, untraced_switch_in=n // 10 - n0 // 10)
        return ProbeSnapshot.from_dicts(
            mono_ns=int(t * 1e9), wall=t, hists=hists, pairs=pairs, cgroups=cgroups,
            errors={"hists": self.map_errors},
            programs={"sched_switch": ProgramStats(self.switch_cnt, self.switch_ns)},
        )


def _lognormal_ns(rng: random.Random, n: int, median_ns: float, sigma: float) -> list[int]:
    return [max(1, int(rng.lognormvariate(math.log(median_ns), sigma))) for _ in range(n)]


def _feed(rec: Recorder, rng: random.Random, step: int) -> None:
    rec.runq.setdefault(CG_API, []).extend(_lognormal_ns(rng, 2000, 40_000, 1.2))
    rec.runq.setdefault(CG_BATCH, []).extend(_lognormal_ns(rng, 500, 2_000_000, 0.8))
    rec.iowait.setdefault(CG_DB, []).extend(_lognormal_ns(rng, 100, 5_000_000, 0.5))
    # Values sitting exactly on bucket bounds: the edge cases of the comparison.
    rec.runq[CG_API].extend([8192, 8192 * 23 // 16, 1 << 20])
    for (victim, by), (c, w) in {(CG_API, CG_BATCH): (30, 3_000_000), (CG_API, CG_DB): (4, 50_000),
                                 (CG_BATCH, CG_API): (7, 900_000)}.items():
        p = rec.pairs.setdefault((victim, by), [0, 0])
        p[0] += c * step
        p[1] += w * step
    for cg in NAMES:
        rec.migrations[cg] = rec.migrations.get(cg, 0) + 11 * step
    rec.switch_cnt += 10_000
    rec.switch_ns += 7_000_000
    rec.map_errors += step - 1


def _scrape(collector: SlatraceCollector) -> dict[str, object]:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def _samples(families: dict, name: str, suffix: str = "") -> dict[tuple, float]:
    out = {}
    for s in families[name].samples:
        if s.name == name + suffix:
            out[tuple(sorted(s.labels.items()))] = s.value
    return out


@pytest.fixture()
def scenario() -> tuple[Store, Recorder, list[dict]]:
    """Three scrapes of a store fed three intervals of hand-made snapshots."""
    rng = random.Random(7)
    rec = Recorder()
    now = [1000.0]
    store = Store(retention_s=900, clock=lambda: now[0])
    store.ingest(rec.snapshot(now[0]), NAMES.__getitem__)
    collector = SlatraceCollector(store, sources=Sources(
        agent_stats=lambda: AgentStats(poll_duration_seconds=0.004, poll_errors=0)))
    scrapes = []
    for step in (1, 2, 3):
        _feed(rec, rng, step)
        now[0] += 1.0
        store.ingest(rec.snapshot(now[0]), NAMES.__getitem__)
        scrapes.append(_scrape(collector))
    return store, rec, scrapes


def test_bucket_counts_equal_brute_force_counts(scenario) -> None:
    _, rec, scrapes = scenario
    last = scrapes[-1]
    for family, raw in (("slatrace_runq_latency_seconds", rec.runq), ("slatrace_iowait_seconds", rec.iowait)):
        buckets = _samples(last, family, "_bucket")
        for cg, values in raw.items():
            service = NAMES[cg]
            got = {float(dict(k)["le"]): v for k, v in buckets.items() if dict(k)["service"] == service}
            assert len(got) == len(classic_bounds()) + 1
            for le, count in got.items():
                bound_ns = math.inf if math.isinf(le) else round(le * 1e9)
                # The kernel counts values below a slot boundary; a value equal
                # to a bound is one bucket higher than `le` would put it.
                assert count == sum(1 for v in values if v < bound_ns), (service, le)
            assert _samples(last, family, "_count")[(("service", service),)] == len(values)
            assert _samples(last, family, "_sum")[(("service", service),)] == pytest.approx(sum(values) / 1e9)


def test_finer_bounds_export_exact_counts_for_every_histogram(scenario) -> None:
    """buckets_per_octave: 4 — every histogram, request delays included, on
    the 85 finer bounds, each count still exact."""
    store, rec, _ = scenario
    bounds = classic_bounds(4)
    delay = Histogram.from_ns([20_000, 20_000, 2_000_000])
    fams = _scrape(SlatraceCollector(store, sources=Sources(bounds=bounds, request_sched_delay=lambda: {"api": delay})))
    for family, raw in (("slatrace_runq_latency_seconds", rec.runq), ("slatrace_iowait_seconds", rec.iowait)):
        buckets = _samples(fams, family, "_bucket")
        for cg, values in raw.items():
            got = {float(dict(k)["le"]): v for k, v in buckets.items() if dict(k)["service"] == NAMES[cg]}
            assert sorted(got) == sorted(bounds) + [math.inf]
            for le, count in got.items():
                bound_ns = math.inf if math.isinf(le) else round(le * 1e9)
                assert count == sum(1 for v in values if v < bound_ns), (NAMES[cg], le)
    delays = _samples(fams, "slatrace_request_sched_delay_seconds", "_bucket")
    assert len(delays) == len(bounds) + 1
    # 20 µs lies between the four-per-octave bounds 19.46 µs and 23.55 µs.
    assert delays[(("le", "1.9456e-05"), ("service", "api"))] == 0
    assert delays[(("le", "2.3552e-05"), ("service", "api"))] == 2


def test_counters_equal_raw_totals_and_never_decrease(scenario) -> None:
    _, rec, scrapes = scenario
    last = scrapes[-1]
    pre = _samples(last, "slatrace_preemptions", "_total")
    wait = _samples(last, "slatrace_preempted_wait_seconds", "_total")
    for (victim, by), (count, wait_ns) in rec.pairs.items():
        key = (("by_service", NAMES[by]), ("service", NAMES[victim]))
        assert pre[key] == count
        assert wait[key] == pytest.approx(wait_ns / 1e9)
    runq_wait = _samples(last, "slatrace_runq_wait_seconds", "_total")
    for cg, values in rec.runq.items():
        assert runq_wait[(("service", NAMES[cg]),)] == pytest.approx(sum(values) / 1e9)
    mig = _samples(last, "slatrace_migrations", "_total")
    assert mig == {(("service", n),): rec.migrations[cg] for cg, n in NAMES.items()}
    assert _samples(last, "slatrace_bpf_events", "_total") == {(("program", "sched_switch"),): 30_000}
    assert _samples(last, "slatrace_bpf_run_seconds", "_total")[(("program", "sched_switch"),)] \
        == pytest.approx(0.021)
    errors = _samples(last, "slatrace_bpf_map_errors", "_total")
    assert {dict(k)["map"] for k in errors} == set(ERROR_MAPS)
    assert errors[(("map", "hists"),)] == 0 + 1 + 2
    assert _samples(last, "slatrace_intervals_collected", "_total") == {(): 3}

    counter_names = [s.name for s in SCHEDULER if s.type == "counter"]
    for earlier, later in zip(scrapes, scrapes[1:]):
        for name in counter_names:
            if name not in earlier:
                continue
            before, after = _samples(earlier, name, "_total"), _samples(later, name, "_total")
            for key, value in before.items():
                assert after[key] >= value, (name, key)
        for name in ("slatrace_runq_latency_seconds", "slatrace_iowait_seconds"):
            before, after = _samples(earlier, name, "_bucket"), _samples(later, name, "_bucket")
            for key, value in before.items():
                assert after[key] >= value, (name, key)


def test_quantile_summary_is_the_windowed_log_linear_quantile(scenario) -> None:
    store, rec, scrapes = scenario
    q = _samples(scrapes[-1], "slatrace_runq_latency_quantile_seconds")
    window = store.window(60)
    for cg in rec.runq:
        service = NAMES[cg]
        exact = sorted(rec.runq[cg])
        for quantile in (0.5, 0.95, 0.99):
            value = q[(("quantile", str(quantile)), ("service", service))]
            assert value == window.services[service].runq.quantile(quantile)
            # ... and that is within 1/16 octave of the exact order statistic.
            ref = exact[math.ceil(quantile * len(exact)) - 1] / 1e9
            assert value == pytest.approx(ref, rel=1 / 16)
    # A service with no run-queue samples has count/sum but no quantile series.
    assert not [k for k in q if ("service", "db") in k]


def test_self_metrics_and_hooks() -> None:
    store = Store(retention_s=900, clock=lambda: 100.0)
    store.ingest(ProbeSnapshot.from_dicts(0, 98.0), lambda cg: "api")
    twelve_ms = dict(Histogram.from_ns([12_000_000] * 4).items())
    store.ingest(ProbeSnapshot.from_dicts(10**9, 99.0, hists={(1, 0): twelve_ms}, pairs={(1, 1): PairCounters(1, 10)},
                                          holders={(1, 0): PairCounters(1, 5)},
                               programs={"sched_wakeup": ProgramStats(5, 500)}), lambda cg: "api")
    sources = Sources(
        slos=(Slo("api", runq_p99=0.005, runq_p95=0.5),),
        throttled_seconds=lambda: {"api": 1.5},
        slo_breaches=lambda: {("api", "runq_p99"): 3},
        request_sched_delay=lambda: {"api": Histogram.from_ns([30_000, 2_000_000])},
        agent_stats=lambda: AgentStats(poll_duration_seconds=0.25, poll_errors=2,
                                       waits_seen={"runq": 40, "iowait": 3}, waits_missing={"runq": 1, "iowait": 0}),
    )
    fams = _scrape(SlatraceCollector(store, sources=sources))
    assert _samples(fams, "slatrace_cpu_throttled_seconds", "_total") == {(("service", "api"),): 1.5}
    assert _samples(fams, "slatrace_slo_breaches", "_total") == {(("service", "api"), ("slo", "runq_p99")): 3}
    delay = _samples(fams, "slatrace_request_sched_delay_seconds", "_count")
    assert delay == {(("service", "api"),): 2}
    # 4 waits of 12 ms: P99 12 ms breaks the 5 ms target, P95 meets 0.5 s.
    ok = _samples(fams, "slatrace_slo_ok")
    assert ok == {(("service", "api"), ("slo", "runq_p99")): 0.0, (("service", "api"), ("slo", "runq_p95")): 1.0}
    value = _samples(fams, "slatrace_slo_value_seconds")
    assert value[(("service", "api"), ("slo", "runq_p99"))] == pytest.approx(0.012, rel=1 / 16)
    assert _samples(fams, "slatrace_slo_target_seconds")[(("service", "api"), ("slo", "runq_p99"))] == 0.005
    assert _samples(fams, "slatrace_wakeup_wait_seconds", "_total") == {
        (("by_service", "idle"), ("service", "api")): 5e-9}
    assert _samples(fams, "slatrace_poll_duration_seconds") == {(): 0.25}
    assert _samples(fams, "slatrace_poll_errors", "_total") == {(): 2}
    assert _samples(fams, "slatrace_waits_seen", "_total") == {(("kind", "runq"),): 40, (("kind", "iowait"),): 3}
    assert _samples(fams, "slatrace_waits_missing", "_total") == {(("kind", "runq"),): 1, (("kind", "iowait"),): 0}
    assert "slatrace_unknown_thing" not in fams
    assert _samples(fams, "slatrace_services_tracked") == {(): 1}
    # With every hook given, every family of the catalog is exported, except
    # the kinds that never happened here: an all-zero kind has no series.
    zero = {"slatrace_iowait_seconds", "slatrace_migrations", "slatrace_untraced_events", "slatrace_recovered_waits",
            "slatrace_lost_waits", "slatrace_cpu_limit_wait_seconds"}
    assert set(fams) == {s.name for s in SCHEDULER} - zero


def test_services_beyond_the_store_cap_are_one_label_value() -> None:
    """Cardinality is the store's: whatever it folds into "other" is one series."""
    store = Store(retention_s=900, clock=lambda: 100.0)
    store.ingest(ProbeSnapshot.from_dicts(0, 98.0), str)
    hists = {(cg, 0): {100: Bucket(1, 40_000)} for cg in range(1, 50)}
    store.ingest(ProbeSnapshot.from_dicts(10**9, 99.0, hists=hists), lambda cg: "api" if cg == 1 else "other")
    fams = _scrape(SlatraceCollector(store))
    services = {dict(k)["service"] for k in _samples(fams, "slatrace_runq_latency_seconds", "_count")}
    assert services == {"api", "other"}
    assert _samples(fams, "slatrace_runq_latency_seconds", "_count")[(("service", "other"),)] == 48


def _datasets() -> Iterable[tuple[str, list[int]]]:
    """Log-normal and bimodal run-queue-like distributions, medians 10 µs .. 10 s."""
    rng = random.Random(1)
    for exp10 in range(-5, 2):
        for sigma in (0.5, 1.0, 2.0):
            median = 10.0 ** exp10 * 1e9
            yield f"lognormal median={median / 1e9:g}s sigma={sigma}", _lognormal_ns(rng, 20_000, median, sigma)
    # Slow shares keep the tested quantiles off the split between the modes:
    # a quantile in the empty gap between two modes is ill-defined for any
    # bucketing (docs/metrics.md shows how far off it gets).
    for fast, slow, share in ((20_000, 4_000_000, 0.03), (50_000, 30_000_000, 0.2),
                              (10_000, 1_000_000_000, 0.02), (200_000, 5_000_000, 0.4)):
        n_slow = int(20_000 * share)
        values = _lognormal_ns(rng, 20_000 - n_slow, fast, 0.6) + _lognormal_ns(rng, n_slow, slow, 0.6)
        yield f"bimodal {fast / 1e3:g}us/{slow / 1e6:g}ms slow={share}", values


def test_histogram_quantile_within_10_percent_of_agent_quantile() -> None:
    """What a dashboard computes from /metrics vs what the agent computes
    from its 1/16-octave slots, for every quantile from 10 µs to 10 s."""
    bounds = classic_bounds()
    worst = (0.0, "")
    for label, values in _datasets():
        hist = Histogram.from_ns(values)
        point = figures.histogram_point(("x",), hist)
        buckets = list(zip(bounds, point.cumulative)) + [(math.inf, point.count)]
        for q in (0.5, 0.9, 0.95, 0.99):
            agent_q = hist.quantile(q)
            if not 10e-6 <= agent_q <= 10.0:
                continue
            err = abs(prometheus_histogram_quantile(q, buckets) - agent_q) / agent_q
            worst = max(worst, (err, f"{label} q={q}"))
    assert worst[0] <= 0.10, worst
    # The comparison must be able to fail: 2x-wide log2 buckets do not get there.
    log2 = [b for i, b in enumerate(bounds) if i % 2 == 0]
    hist = Histogram.from_ns(_lognormal_ns(random.Random(3), 20_000, 3_000_000, 0.5))
    counts = figures.histogram_point(("x",), hist, tuple(log2)).cumulative
    cum = list(zip(log2, counts)) + [(math.inf, counts[-1])]
    errs = [abs(prometheus_histogram_quantile(q, cum) - hist.quantile(q)) / hist.quantile(q) for q in (0.5, 0.99)]
    assert max(errs) > 0.10


def test_reference_quantile_matches_prometheus_edge_cases() -> None:
    b = [(1.0, 10.0), (2.0, 20.0), (math.inf, 30.0)]
    assert prometheus_histogram_quantile(0.5, b) == 1.5          # rank 15: halfway through (1, 2]
    assert prometheus_histogram_quantile(0.9, b) == 2.0          # in +Inf: highest finite bound
    assert prometheus_histogram_quantile(0.1, b) == pytest.approx(0.3)  # first bucket starts at 0
    assert math.isnan(prometheus_histogram_quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]))


def _load_script(name: str):
    path = Path(__file__).resolve().parents[2] / "scripts" / name
    spec = importlib.util.spec_from_file_location(name.replace("-", "_").removesuffix(".py"), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_metrics_doc_is_generated_from_the_code() -> None:
    gen = _load_script("gen-metrics-doc.py")
    assert gen.DOC.read_text() == gen.render(), "docs/metrics.md is stale: run scripts/gen-metrics-doc.py"


def test_breach_sources_add_up_and_bucketed_delays_pass_through() -> None:
    intervals = {("api", "runq_p99"): 3}
    requests = {("api", "request_e2e_p99"): 2, ("api", "runq_p99"): 1}
    assert figures.summed(lambda: intervals, lambda: requests)() == {
        ("api", "runq_p99"): 4, ("api", "request_e2e_p99"): 2}
    store = Store(retention_s=900, clock=lambda: 100.0)
    bounds = classic_bounds()
    # 3 requests: 20 µs, 20 µs, 2 ms, bucketed elsewhere on the same bounds.
    cumulative = tuple(sum(1 for v in (20e-6, 20e-6, 2e-3) if v < b) for b in bounds) + (3,)
    sources = Sources(request_sched_delay=lambda: {"api": figures.HistogramPoint(("ignored",), bounds,
                                                                                   cumulative, 0.00204)})
    fams = _scrape(SlatraceCollector(store, sources=sources))
    buckets = _samples(fams, "slatrace_request_sched_delay_seconds", "_bucket")
    assert buckets[(("le", "3.2768e-05"), ("service", "api"))] == 2
    assert buckets[(("le", "+Inf"), ("service", "api"))] == 3
    wrong = Sources(request_sched_delay=lambda: {"api": figures.HistogramPoint((), (0.1,), (1, 1), 0.05)})
    with pytest.raises(ValueError):
        _scrape(SlatraceCollector(store, sources=wrong))
