"""The trace side under hostile spans: huge attributes, non-finite numbers,
absurd end times, more pending requests than fit. Real receivers, real SDK or
raw OTLP bodies; the references are the bytes and times the test put in."""

from __future__ import annotations

import gc
import gzip
import io
import json
import threading
import time
from contextlib import redirect_stdout

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from agent.api.routes import json_response
from agent.cli.requests import print_explain
from agent.config import Slo
from agent.traces.api import request_routes
from agent.traces.forward import Forwarder
from agent.traces.metrics import TraceCounters
from agent.traces.pipeline import MAX_FUTURE_SKEW_S, Overloaded, RequestPipeline
from agent.traces.receiver_http import HttpReceiver
from agent.traces.request_store import RequestStore
from tests.support.agent import post_traces
from tests.unit.test_receivers import FakeSched, FixedOrigin

MiB = 1 << 20


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def export(spans: list[Span], service: str = "vllm") -> ExportTraceServiceRequest:
    rs = ResourceSpans(scope_spans=[ScopeSpans(spans=spans)])
    rs.resource.attributes.append(KeyValue(key="service.name", value=AnyValue(string_value=service)))
    return ExportTraceServiceRequest(resource_spans=[rs])


def request_span(rid: str, start_ns: int, end_ns: int, **attrs) -> Span:
    span = Span(name="llm_request", trace_id=bytes(16), span_id=rid.encode()[:8].ljust(8, b"\0"),
                start_time_unix_nano=start_ns, end_time_unix_nano=end_ns)
    span.attributes.append(KeyValue(key="gen_ai.request.id", value=AnyValue(string_value=rid)))
    for key, value in attrs.items():
        v = AnyValue(string_value=value) if isinstance(value, str) else AnyValue(double_value=value)
        span.attributes.append(KeyValue(key=key, value=v))
    return span


class Hold:
    """An exporter that never succeeds: the collector is blackholed."""

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult
        return SpanExportResult.FAILURE

    def shutdown(self):
        pass


def make(counters: TraceCounters, store: RequestStore, sink=None, **kw) -> tuple[FakeSched, RequestPipeline]:
    sched = FakeSched()
    services = FixedOrigin()
    return sched, RequestPipeline(sched, services, (Slo("vllm", request_e2e_p99=0.5),), store, counters, sink, **kw)


def test_huge_attributes_are_cut_counted_and_do_not_pin_their_requests():
    counters = TraceCounters()
    store = RequestStore(900)
    forwarder = Forwarder(Hold(), counters)  # not started: everything forwarded stays queued
    sched, pipeline = make(counters, store, forwarder)
    sched.covered = 0.0  # nothing is covered: every request stays pending, with its span kept to forward
    rx = HttpReceiver("127.0.0.1", 0, pipeline, counters)
    rx.start()
    try:
        now = time.time_ns()
        blob = "x" * MiB
        body = gzip.compress(export([request_span("warm", now, now)]).SerializeToString())
        assert post_traces(rx.port, body, "application/x-protobuf", "gzip")[0] == 200
        gc.collect()
        before = rss_bytes()
        for i in range(150):
            span = request_span(f"r{i}", now, now + 1000, **{"prompt": blob})
            body = gzip.compress(export([span]).SerializeToString())
            assert post_traces(rx.port, body, "application/x-protobuf", "gzip")[0] == 200
        gc.collect()
        grown = rss_bytes() - before
    finally:
        rx.stop()
    assert pipeline.pending() == 151
    assert counters.truncated_attributes == 150
    # 150 MiB of attribute values came in; what is kept is cut to 8 KiB each.
    assert grown <= 50 * MiB, f"RSS grew {grown / MiB:.1f} MiB"


def test_pending_overflow_is_attributed_by_the_worker_and_a_flood_is_refused():
    counters = TraceCounters()
    store = RequestStore(900)
    sched, pipeline = make(counters, store, max_pending=10)
    sched.covered = 0.0
    now = time.time_ns()
    for i in range(30):
        pipeline.ingest(export([request_span(f"r{i}", now, now + i)]), "http")
    # The 20 pushed out wait for the worker: the receiver thread asked nothing of the source.
    assert sched.calls == [] and counters.pending_dropped == 20 and pipeline.pending() == 10
    worker = threading.Thread(target=pipeline.process, name="requests")
    worker.start()
    worker.join()
    assert len(sched.calls) == 20
    assert [store.get(f"r{i}")["sched_complete"] for i in range(20)] == [False] * 20
    # A backlog the worker does not clear refuses further exports, counted by the receiver.
    for i in range(1001):  # each pushes one more out of the heap of 10
        pipeline.ingest(export([request_span(f"f{i}", now, now + i)]), "http")
    assert counters.pending_dropped == 20 + 1001
    with pytest.raises(Overloaded):
        pipeline.ingest(export([request_span("last", now, now)]), "http")


def test_overloaded_pipeline_answers_a_retryable_503_and_counts_it():
    counters = TraceCounters()
    sched, pipeline = make(counters, RequestStore(900), max_pending=1)
    sched.covered = 0.0
    now = time.time_ns()
    for i in range(1002):
        pipeline.ingest(export([request_span(f"r{i}", now, now)]), "http")
    rx = HttpReceiver("127.0.0.1", 0, pipeline, counters)
    rx.start()
    try:
        status, _ = post_traces(rx.port, export([request_span("x", now, now)]).SerializeToString(),
                                "application/x-protobuf")
    finally:
        rx.stop()
    assert status == 503
    assert counters.rejected == {("http", "overloaded"): 1}


def test_forward_queue_is_bounded_by_bytes():
    counters = TraceCounters()
    forwarder = Forwarder(Hold(), counters, max_bytes=4 * MiB)
    big = request_span("b", 0, 0, prompt="y" * MiB)
    for _ in range(10):
        forwarder.forward(ResourceSpans(), ScopeSpans(), big)
    assert counters.forward_dropped == {"queue_full": 7}
    assert forwarder.queued_bytes <= 4 * MiB


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), "NaN", "Infinity"])
def test_non_finite_latencies_are_null_and_every_answer_is_valid_json(bad):
    counters = TraceCounters()
    now = time.time()
    store = RequestStore(900)
    _, pipeline = make(counters, store)
    ns = int(now * 1e9)
    pipeline.ingest(export([request_span("nan", ns - 10**9, ns, **{
        "gen_ai.latency.e2e": bad, "gen_ai.latency.time_to_first_token": bad,
        "gen_ai.latency.time_in_queue": bad})]), "http")
    pipeline.process()
    doc = store.get("nan")
    assert doc["ttft"] is None and doc["queue"] is None
    assert doc["e2e"] == pytest.approx(1.0)  # from the span's own times
    for path in ("/api/v1/requests", "/api/v1/requests/nan"):
        routes = request_routes(store)
        handler = routes.get(path) or routes["/api/v1/requests/"]
        resp = handler({"_tail": ["nan"]})
        json.loads(resp.body, parse_constant=lambda c: pytest.fail(f"invalid JSON constant {c}"))
    # Whatever reaches the renderer, explain prints and does not raise.
    doc = json.loads(json.dumps({**doc, "e2e": float("inf"), "ttft": float("nan")}))
    with redirect_stdout(io.StringIO()):
        print_explain(doc)


def test_json_response_never_writes_nan():
    body = json_response(200, {"a": float("nan"), "b": [float("inf"), 1.5], "c": {"d": float("-inf")}}).body
    assert json.loads(body) == {"a": None, "b": [None, 1.5], "c": {"d": None}}


def test_an_end_at_the_end_of_time_is_clamped_and_does_not_stop_expiry():
    clock = [1_000_000.0]
    counters = TraceCounters()
    store = RequestStore(60, clock=lambda: clock[0])
    _, pipeline = make(counters, store, clock=lambda: clock[0])
    base = int(clock[0] * 1e9)
    pipeline.ingest(export([request_span("forever", base, 2**64 - 1)]), "http")
    pipeline.ingest(export([request_span(f"r{i}", base, base + i) for i in range(5)]), "http")
    pipeline.process()
    assert store.get("forever")["end"] == pytest.approx(clock[0] + MAX_FUTURE_SKEW_S)
    # Straight into the store, an absurd end no longer holds back the expiry of the others.
    store.add({**store.get("r0"), "request_id": "raw", "end": 1.8e10})
    clock[0] += 61 + MAX_FUTURE_SKEW_S
    assert [d["request_id"] for d in store.query()] == ["raw"]


def test_request_store_holds_its_byte_budget():
    store = RequestStore(900, max_bytes=1 * MiB, clock=lambda: 10.0)
    doc = {"request_id": "", "end": 5.0, "service": "s", "slo": [], "model": "m" * 10_000}
    for i in range(500):
        store.add({**doc, "request_id": f"r{i}"})
    assert store.bytes <= 1 * MiB
    assert len(store) == 1 * MiB // (len(json.dumps(doc, separators=(",", ":"))) + 2)
    assert store.evicted == 500 - len(store)


def test_truncation_reaches_every_attribute_and_leaves_short_ones_alone():
    from opentelemetry.proto.common.v1.common_pb2 import ArrayValue, KeyValueList

    from agent.traces.otlp_decode import truncate_attributes

    long_s, long_b = "s" * 100, b"b" * 100
    span = request_span("r", 0, 1, short="ok")
    span.attributes.append(KeyValue(key="bytes", value=AnyValue(bytes_value=long_b)))
    span.attributes.append(KeyValue(key="array", value=AnyValue(array_value=ArrayValue(
        values=[AnyValue(string_value=long_s), AnyValue(int_value=7)]))))
    span.attributes.append(KeyValue(key="map", value=AnyValue(kvlist_value=KeyValueList(
        values=[KeyValue(key="inner", value=AnyValue(string_value=long_s))]))))
    event = span.events.add(name="e")
    event.attributes.append(KeyValue(key="ev", value=AnyValue(string_value=long_s)))
    req = export([span])
    req.resource_spans[0].resource.attributes.append(KeyValue(key="res", value=AnyValue(string_value=long_s)))
    assert truncate_attributes(req, 10) == 5
    from agent.traces.spans import attributes
    got = attributes(req.resource_spans[0].scope_spans[0].spans[0].attributes)
    assert got["short"] == "ok" and got["bytes"] == b"b" * 10 and got["array"] == ["s" * 10, 7]
    assert got["map"] == {"inner": "s" * 10}
    assert attributes(req.resource_spans[0].scope_spans[0].spans[0].events[0].attributes) == {"ev": "s" * 10}
    assert attributes(req.resource_spans[0].resource.attributes)["res"] == "s" * 10
    assert truncate_attributes(req, 10) == 0  # nothing left to cut
