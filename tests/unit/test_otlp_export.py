"""OTLP metrics export from a hand-made store, checked against the raw values
the store was built from, against the Prometheus exposition, and over a real
loopback OTLP receiver (gRPC and HTTP/protobuf)."""

from __future__ import annotations

import random
import time

import grpc
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector, CollectorRegistry
from opentelemetry.sdk.metrics.export import AggregationTemporality, Gauge, Histogram as OtlpHistogram, Sum

from agent.export import otlp
from agent.export.otlp import OtlpMetricsExporter, build_resource
from agent.export.otlp_translate import build_metrics_data
from agent.export.otlp_settings import ExportSettings, OtlpConfigError, resolve_protocol, resolve_settings
from agent.export.prometheus import SlatraceCollector
from agent.probe.snapshot import HIST_IOWAIT, HIST_RUNQ, PairCounters, ProbeSnapshot, ProgramStats, CgroupCounters
from agent.store.histogram import Histogram, classic_bounds, cumulative_counts
from agent.store.store import Store
from tests.support.agent import free_port
from tests.support.otlp_receiver import OtlpReceiver, metric_points, number_value

T0 = 1_764_680_000.0
SERVICES = {11: "vllm", 12: "vllm", 21: "batch"}  # two cgroups of one service


def _values(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    # Log-uniform from 100 ns to 2 s, plus values exactly on bucket bounds
    # (2^13 ns is the first one), where `<` and `<=` differ.
    vals = [int(10 ** rng.uniform(2, 9.3)) for _ in range(n)]
    return vals + [1 << 13, 1 << 20]


# cgroup -> (runq values per interval, iowait values per interval)
RUNQ = {11: [_values(1, 300), _values(2, 200)], 12: [_values(3, 50), _values(4, 80)], 21: [_values(5, 400), []]}
IOWAIT = {21: [_values(6, 20), _values(7, 10)]}
PAIRS = [{(11, 21): PairCounters(40, 4_000_000), (21, 0): PairCounters(3, 900)},
         {(11, 21): PairCounters(70, 9_500_000), (12, 21): PairCounters(5, 123_456), (21, 0): PairCounters(3, 900)}]
MIGRATIONS = [{11: 7, 21: 2}, {11: 9, 12: 4, 21: 2}]


def _snapshot(upto: int) -> ProbeSnapshot:
    """What the drained kernel maps hand over for interval `upto` (0 = the
    baseline); PAIRS and MIGRATIONS are cumulative, the snapshot their growth."""
    hists = {}
    for kind, table in ((HIST_RUNQ, RUNQ), (HIST_IOWAIT, IOWAIT)):
        for cg, per_interval in table.items():
            vals = per_interval[upto - 1] if upto else []
            if vals:
                hists[(cg, kind)] = dict(Histogram.from_ns(vals).items())
    pairs, cgroups = {}, {}
    if upto:
        before = PAIRS[upto - 2] if upto > 1 else {}
        for k, p in PAIRS[upto - 1].items():
            b = before.get(k, PairCounters(0, 0))
            pairs[k] = PairCounters(p.count - b.count, p.wait_ns - b.wait_ns)
        mig_before = MIGRATIONS[upto - 2] if upto > 1 else {}
        cgroups = {cg: CgroupCounters(migrations=n - mig_before.get(cg, 0)) for cg, n in MIGRATIONS[upto - 1].items()}
    return ProbeSnapshot.from_dicts(mono_ns=upto * 10**9, wall=T0 + upto, hists=hists, pairs=dict(pairs),
                                    cgroups=cgroups,
                         errors={"tasks": 2 * upto}, programs={"sched_switch": ProgramStats(1000 * upto, 77 * upto)})


def _service_values(table: dict[int, list[list[int]]], service: str) -> list[int]:
    return [v for cg, chunks in table.items() if SERVICES[cg] == service for chunk in chunks for v in chunk]


@pytest.fixture
def store() -> Store:
    st = Store(900, clock=lambda: T0 + 2.5)
    for i in range(3):
        st.ingest(_snapshot(i), SERVICES.__getitem__)
    return st


@pytest.fixture
def registry(store: Store) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(SlatraceCollector(store))
    return reg


def _metrics(data) -> dict:
    [rm] = data.resource_metrics
    [sm] = rm.scope_metrics
    return {m.name: m for m in sm.metrics}


def _points(metric, **attrs):
    return [p for p in metric.data.data_points if all(p.attributes.get(k) == v for k, v in attrs.items())]


def test_names_types_and_times(store, registry):
    data = build_metrics_data(registry, store, build_resource())
    metrics = _metrics(data)
    for name in ("slatrace_runq_latency_seconds", "slatrace_iowait_seconds"):
        assert isinstance(metrics[name].data, OtlpHistogram) and metrics[name].unit == "s"
        assert metrics[name].data.aggregation_temporality == AggregationTemporality.CUMULATIVE
    for name in ("slatrace_runq_wait_seconds", "slatrace_preemptions", "slatrace_preempted_wait_seconds",
                 "slatrace_migrations", "slatrace_bpf_events", "slatrace_bpf_run_seconds", "slatrace_bpf_map_errors"):
        assert isinstance(metrics[name].data, Sum), name
        assert metrics[name].data.is_monotonic
        assert metrics[name].data.aggregation_temporality == AggregationTemporality.CUMULATIVE
    assert isinstance(metrics["slatrace_runq_latency_quantile_seconds"].data, Gauge)
    # Every point is stamped with the end of the newest interval; cumulative
    # ones start where the store's totals start (the baseline snapshot).
    for m in metrics.values():
        for p in m.data.data_points:
            assert p.time_unix_nano == int((T0 + 2) * 1e9), m.name
            if not isinstance(m.data, Gauge):
                assert p.start_time_unix_nano == int(T0 * 1e9), m.name


@pytest.mark.parametrize("name,table", [("slatrace_runq_latency_seconds", RUNQ),
                                        ("slatrace_iowait_seconds", IOWAIT)])
def test_histogram_buckets_are_the_agents_exact_counts(store, registry, name, table):
    metric = _metrics(build_metrics_data(registry, store, build_resource()))[name]
    bounds = classic_bounds()
    services = {s for cg, s in SERVICES.items() if cg in table}
    assert {p.attributes["service"] for p in metric.data.data_points if p.count} == services
    for service in services:
        values = _service_values(table, service)
        [p] = _points(metric, service=service)
        assert p.attributes == {"service": service}
        assert list(p.explicit_bounds) == list(bounds)
        running = [sum(p.bucket_counts[:i + 1]) for i in range(len(p.bucket_counts))]
        # The agent's own figure, and the same counted straight from the raw values.
        assert running == cumulative_counts(Histogram.from_ns(values), bounds)
        assert running == [sum(v < round(b * 1e9) for v in values) for b in bounds] + [len(values)]
        assert p.count == len(values)
        assert p.sum == pytest.approx(sum(values) / 1e9, rel=1e-12)


def test_counters_match_the_hand_totals(store, registry):
    metrics = _metrics(build_metrics_data(registry, store, build_resource()))
    pre = {(p.attributes["service"], p.attributes["by_service"]): p.value
           for p in metrics["slatrace_preemptions"].data.data_points}
    assert pre == {("vllm", "batch"): 75, ("batch", "unknown"): 3}
    wait = {(p.attributes["service"], p.attributes["by_service"]): p.value
            for p in metrics["slatrace_preempted_wait_seconds"].data.data_points}
    assert wait[("vllm", "batch")] == pytest.approx((9_500_000 + 123_456) / 1e9)
    mig = {p.attributes["service"]: p.value for p in metrics["slatrace_migrations"].data.data_points}
    assert mig == {"vllm": 13, "batch": 2}
    runq_wait = {p.attributes["service"]: p.value for p in metrics["slatrace_runq_wait_seconds"].data.data_points}
    assert runq_wait["vllm"] == pytest.approx(sum(_service_values(RUNQ, "vllm")) / 1e9, rel=1e-12)
    errors = {p.attributes["map"]: p.value for p in metrics["slatrace_bpf_map_errors"].data.data_points}
    assert errors["tasks"] == 4
    [events] = metrics["slatrace_bpf_events"].data.data_points
    assert events.attributes == {"program": "sched_switch"} and events.value == 2000


def test_quantile_gauges_are_the_windows_quantiles(store, registry):
    metric = _metrics(build_metrics_data(registry, store, build_resource()))["slatrace_runq_latency_quantile_seconds"]
    for service in ("vllm", "batch"):
        ref = Histogram.from_ns(_service_values(RUNQ, service))
        got = {p.attributes["quantile"]: p.value for p in _points(metric, service=service)}
        assert set(got) == {"0.5", "0.95", "0.99"}
        for q, v in got.items():
            assert v == pytest.approx(ref.quantile(float(q)), rel=1e-12)


def test_every_prometheus_sample_is_exported_with_the_same_value(store, registry):
    """The two exports must not disagree: compare sample by sample."""
    metrics = _metrics(build_metrics_data(registry, store, build_resource()))
    text = generate_latest(registry).decode()
    compared = 0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = dict(s.labels)
            if fam.type == "counter" and s.name.endswith("_total"):
                [p] = _points(metrics[fam.name], **labels)
                assert p.value == pytest.approx(s.value, rel=1e-15), s
            elif fam.type == "histogram" and s.name.endswith("_bucket"):
                le = labels.pop("le")
                [p] = _points(metrics[fam.name], **labels)
                i = len(p.explicit_bounds) if le == "+Inf" else list(p.explicit_bounds).index(float(le))
                assert sum(p.bucket_counts[:i + 1]) == s.value, s
            elif fam.type == "summary" and "quantile" in labels:
                [p] = _points(metrics[fam.name], **labels)
                assert p.value == s.value
            elif fam.type == "gauge":
                [p] = _points(metrics[s.name], **labels)
                assert p.value == s.value
            else:
                continue
            compared += 1
    assert compared > 100


class _IngestDuringCollect(Collector):
    """Simulates a poll landing while a collection is running."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.done = False

    def collect(self):
        if not self.done:
            self.done = True
            last = _snapshot(2)
            extra = ProbeSnapshot.from_dicts(last.mono_ns + 10**9, last.wall + 1,
                                             cgroups={cg: CgroupCounters(migrations=100) for cg in last.cgroups},
                                             errors=last.errors, programs=last.programs)
            self.store.ingest(extra, SERVICES.__getitem__)
        return []


def test_collection_racing_an_ingest_is_retried(store, registry):
    registry.register(_IngestDuringCollect(store))
    metrics = _metrics(build_metrics_data(registry, store, build_resource()))
    mig = {p.attributes["service"]: p for p in metrics["slatrace_migrations"].data.data_points}
    # The retry saw the new interval: figures and time stamp agree.
    assert mig["vllm"].value == 13 + 200
    assert mig["vllm"].time_unix_nano == int((T0 + 3) * 1e9)


def test_nothing_to_export_before_the_first_interval():
    st = Store(900)
    reg = CollectorRegistry(auto_describe=False)
    reg.register(SlatraceCollector(st))
    assert build_metrics_data(reg, st, build_resource()) is None
    st.ingest(_snapshot(0), SERVICES.__getitem__)
    assert build_metrics_data(reg, st, build_resource()) is None


def test_protocol_and_endpoint_resolution():
    assert resolve_protocol(None, environ={}) == "grpc"
    assert resolve_protocol(None, environ={"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}) == "http/protobuf"
    env = {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "grpc"}
    assert resolve_protocol(None, environ=env) == "grpc"
    assert resolve_protocol("http/protobuf", environ=env) == "http/protobuf"
    with pytest.raises(OtlpConfigError, match="http/json"):
        resolve_protocol(None, environ={"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})

    s = resolve_settings("http://c:4317", None, {})
    assert (s.protocol, s.endpoint, s.interval_s, s.timeout_s) == ("grpc", "http://c:4317", 60.0, 10.0)
    s = resolve_settings("http://c:4318/", "http/protobuf", {"OTEL_METRIC_EXPORT_INTERVAL": "1500",
                                                          "OTEL_EXPORTER_OTLP_TIMEOUT": "3"})
    assert (s.endpoint, s.interval_s, s.timeout_s) == ("http://c:4318/v1/metrics", 1.5, 3.0)
    s = resolve_settings("http://c:4318", "http/protobuf", {
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://m:9/custom", "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT": "5",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "3", "OTEL_METRIC_EXPORT_TIMEOUT": "2500"})
    assert (s.endpoint, s.timeout_s) == ("http://m:9/custom", 2.5)
    with pytest.raises(OtlpConfigError, match="OTEL_METRIC_EXPORT_INTERVAL"):
        resolve_settings("http://c:4317", None, {"OTEL_METRIC_EXPORT_INTERVAL": "soon"})
    with pytest.raises(OtlpConfigError, match="http://"):
        resolve_settings("c:4318", "http/protobuf", {})


def test_resource_attributes(monkeypatch):
    for var in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "NODE_NAME"):
        monkeypatch.delenv(var, raising=False)
    attrs = build_resource().attributes
    assert attrs["service.name"] == "slatrace" and attrs["host.name"] and "k8s.node.name" not in attrs
    monkeypatch.setenv("NODE_NAME", "node-7")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=prod,host.name=h%201")
    attrs = build_resource().attributes
    assert attrs["k8s.node.name"] == "node-7" and attrs["deployment.environment"] == "prod"
    assert attrs["host.name"] == "h 1" and attrs["service.name"] == "slatrace"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "slatrace-eu")
    assert build_resource().attributes["service.name"] == "slatrace-eu"


@pytest.fixture
def receiver():
    with OtlpReceiver() as rx:
        yield rx


def _settings(endpoint: str, protocol: str, **env: str) -> ExportSettings:
    return resolve_settings(endpoint, protocol, {"OTEL_EXPORTER_OTLP_TIMEOUT": "1", **env})


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_loopback_export_delivers_the_exact_buckets(store, registry, receiver, monkeypatch, protocol):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-tenant=team-a")
    monkeypatch.setenv("NODE_NAME", "node-3")
    endpoint = receiver.grpc_endpoint if protocol == "grpc" else receiver.http_endpoint
    exporter = OtlpMetricsExporter(registry, store, _settings(endpoint, protocol))
    try:
        assert exporter.export_once() is True
    finally:
        exporter.stop()
    [got] = receiver.metrics
    assert got.transport == ("grpc" if protocol == "grpc" else "http")
    assert got.headers["x-tenant"] == "team-a"
    points = list(metric_points(got.request))
    assert points[0].resource["service.name"] == "slatrace"
    assert points[0].resource["k8s.node.name"] == "node-3"
    runq = {p.attributes["service"]: p.point for p in points if p.name == "slatrace_runq_latency_seconds"}
    for service in ("vllm", "batch"):
        values = _service_values(RUNQ, service)
        running = [sum(runq[service].bucket_counts[:i + 1]) for i in range(len(runq[service].bucket_counts))]
        assert running == cumulative_counts(Histogram.from_ns(values), classic_bounds())
        assert list(runq[service].explicit_bounds) == list(classic_bounds())
        assert runq[service].time_unix_nano == int((T0 + 2) * 1e9)
        assert not runq[service].HasField("min") and not runq[service].HasField("max")
    pre = {(p.attributes["service"], p.attributes["by_service"]): number_value(p.point)
           for p in points if p.name == "slatrace_preemptions"}
    assert pre[("vllm", "batch")] == 75


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_failures_are_dropped_counted_and_bounded(store, registry, receiver, protocol):
    closed = f"http://127.0.0.1:{free_port()}"
    exporter = OtlpMetricsExporter(registry, store, _settings(closed, protocol))
    registry.register(exporter.collector())
    try:
        t0 = time.monotonic()
        assert exporter.export_once() is False
        assert exporter.export_once() is False
        assert time.monotonic() - t0 < 2 * exporter.settings.timeout_s + 1
    finally:
        exporter.stop()
    assert exporter.stats.failures == 2 and exporter.stats.exports == 0
    per_export = otlp._count_points(build_metrics_data(registry, store, build_resource()))
    assert per_export > 30 and exporter.stats.dropped_points == 2 * per_export
    scraped = {s.name: s.value for f in text_string_to_metric_families(generate_latest(registry).decode())
               for s in f.samples}
    assert scraped["slatrace_otlp_export_failures_total"] == 2
    assert scraped["slatrace_otlp_export_dropped_points_total"] == exporter.stats.dropped_points

    # A collector that rejects, then recovers: the next export sends everything.
    endpoint = receiver.grpc_endpoint if protocol == "grpc" else receiver.http_endpoint
    exporter = OtlpMetricsExporter(registry, store, _settings(endpoint, protocol))
    try:
        receiver.reject_with = grpc.StatusCode.INVALID_ARGUMENT
        assert exporter.export_once() is False
        receiver.reject_with = None
        assert exporter.export_once() is True
    finally:
        exporter.stop()
    assert (exporter.stats.failures, exporter.stats.exports) == (1, 1)
    assert len(receiver.metrics) == 1


def test_thread_exports_every_interval_and_stops_promptly(store, registry, receiver):
    settings = ExportSettings("grpc", receiver.grpc_endpoint, interval_s=0.05, timeout_s=1.0)
    exporter = OtlpMetricsExporter(registry, store, settings)
    exporter.start()
    try:
        receiver.wait_for_metrics(3, timeout=5)
    finally:
        t0 = time.monotonic()
        exporter.stop()
        assert time.monotonic() - t0 < 1.5
    n = len(receiver.metrics)
    time.sleep(0.2)
    assert len(receiver.metrics) == n  # nothing after stop()


def test_an_exporter_that_raises_does_not_end_the_thread(store, registry):
    class Broken(otlp.MetricExporter):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def export(self, metrics_data, timeout_millis: float = 10_000, **kwargs):
            self.calls += 1
            raise RuntimeError("boom")

        def force_flush(self, timeout_millis: float = 10_000) -> bool:
            return True

        def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
            pass

    broken = Broken()
    exporter = OtlpMetricsExporter(registry, store, ExportSettings("grpc", "x", 0.02, 1.0), exporter=broken)
    exporter.start()
    deadline = time.monotonic() + 5
    while broken.calls < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    exporter.stop()
    assert broken.calls >= 3 and exporter.stats.failures == broken.calls


def test_traces_resolve_through_the_same_rules_with_their_own_variables():
    """The trace forwarder's exporter reads the TRACES signal's variables
    through the metrics exporter's resolver."""
    s = resolve_settings("http://c:4318", "http/protobuf", {}, signal="TRACES")
    assert (s.protocol, s.endpoint, s.timeout_s) == ("http/protobuf", "http://c:4318/v1/traces", 10.0)
    env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "4",
           "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "grpc", "OTEL_METRIC_EXPORT_TIMEOUT": "1000"}
    s = resolve_settings("http://c:4318/", None, env, signal="TRACES")
    assert (s.protocol, s.endpoint, s.timeout_s) == ("http/protobuf", "http://c:4318/v1/traces", 4.0)
    assert resolve_settings("http://c:4317", None, env).protocol == "grpc"   # metrics keep theirs
    s = resolve_settings("x", None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://t:1/in"}, signal="TRACES")
    assert s.endpoint == "https://t:1/in"
    with pytest.raises(OtlpConfigError, match="OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"):
        resolve_settings("http://c:4317", None, {"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "-1"}, signal="TRACES")
