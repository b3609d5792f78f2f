"""The OTLP receivers in-process, fed by the OpenTelemetry SDK's own exporters.

A fake scheduler source answers with figures computed from the window it is
asked about, so the test can check that each request was attributed over
exactly its own [start, end] — the times the sender put on the span.
"""

from __future__ import annotations

import gzip
import json
import random
import threading
import time
from pathlib import Path

import grpc
import pytest
from google.rpc.status_pb2 import Status
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.trace import SpanKind

from agent.attribution.request_sched import RequestSched
from agent.config import Slo
from agent.export.figures import Sources, compute
from agent.store.store import Store
from agent.traces.api import request_routes
from agent.traces.forward import Forwarder, make_exporter
from agent.identity.cgroups import CgroupPaths
from agent.probe.mounts import find_cgroup2_mount
from agent.traces.identity import SpanOrigin, SpanServices, cgroup_v2_path
from agent.export.traces import TraceCollector
from agent.traces.metrics import TraceCounters
from agent.traces.otlp_decode import Limits, decode_json
from agent.traces.pipeline import RequestPipeline
from agent.traces.receiver_grpc import GRPC_MAX_MESSAGE, SERVICE, GrpcReceiver
from agent.traces.receiver_http import HttpReceiver
from agent.traces.request_store import RequestStore
from agent.traces.spans import attributes, iter_spans
from tests.support.agent import post_traces
from tests.support.otlp_receiver import OtlpReceiver

FIXTURES = Path(__file__).parent / "fixtures" / "otlp"


class FakeSched:
    """runq wait = 10% of the window, 80% of it preempted by "batch"."""

    def __init__(self) -> None:
        self.covered = float("inf")
        self.watched: list[str] = []
        self.calls: list[tuple[str, float, float]] = []

    def watch(self, service: str) -> None:
        self.watched.append(service)

    def covered_until(self) -> float:
        return self.covered

    def between(self, service: str, start: float, end: float, front: int | None = None, phases=()) -> RequestSched:
        self.calls.append((service, start, end))
        d = end - start
        # 0.1 d thread-seconds, of which 0.06 d delayed the request (0.05 d by batch)
        return RequestSched(0.1 * d, 7, (("batch", 0.08 * d),), 0.0, 2, 1e-6,
                            delay_seconds=0.06 * d, delay_by=(("batch", 0.05 * d), ("idle", 0.01 * d)))


def own_services() -> SpanServices:
    """Spans are told apart by their connection: this process's own cgroup is "vllm"."""
    mount = find_cgroup2_mount(Path("/proc/mounts").read_text())
    assert mount, "no cgroup2 mount on this machine"
    cgroups = CgroupPaths(Path(mount))
    own = cgroups.id_of(cgroup_v2_path(Path("/proc/self/cgroup").read_text()))
    return SpanServices(cgroups, lambda cgid: "vllm" if cgid == own else "other", lambda: {"vllm", "other"})


class FixedOrigin:
    """For spans handed to the pipeline without a connection."""

    def origin(self, peer, resource) -> SpanOrigin:
        return SpanOrigin("vllm", "connection")


@pytest.fixture
def traces():
    sched = FakeSched()
    counters = TraceCounters()
    # The store's clock stands a minute after the fixture span ended, so the
    # recorded span is inside the retention window.
    store = RequestStore(900, clock=lambda: 1764680060.0)
    services = own_services()
    pipeline = RequestPipeline(sched, services, (Slo("vllm", request_e2e_p99=0.5),), store, counters, tick_s=0.02)
    limits = Limits(max_body_bytes=256 * 1024, max_decompressed_bytes=1 << 20, max_spans=100)
    grpc_rx = GrpcReceiver("127.0.0.1", 0, pipeline, counters, limits)
    http_rx = HttpReceiver("127.0.0.1", 0, pipeline, counters, limits)
    pipeline.start()
    grpc_rx.start()
    http_rx.start()
    yield sched, pipeline, store, counters, grpc_rx, http_rx
    grpc_rx.stop()
    http_rx.stop()
    pipeline.stop()


def send_requests(exporter, ids: list[str], e2e: float) -> list[tuple[int, int]]:
    """Finished llm_request spans through the SDK; returns their (start, end) ns."""
    provider = TracerProvider()  # vLLM's: the SDK's default resource, no pid, no name
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("vllm.v1.engine.output_processor")
    times = []
    base = time.time_ns() - 5_000_000_000
    for i, rid in enumerate(ids):
        start = base + i * 1_000_000_000
        end = start + int(e2e * 1e9)
        span = tracer.start_span("llm_request", kind=SpanKind.SERVER, start_time=start, attributes={
            "gen_ai.request.id": rid, "gen_ai.latency.e2e": e2e, "gen_ai.latency.time_to_first_token": e2e / 4})
        span.end(end_time=end)
        times.append((start, end))
    provider.shutdown()
    return times


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_sdk_exporters_deliver_and_requests_are_attributed_over_their_window(traces, transport):
    sched, _, store, counters, grpc_rx, http_rx = traces
    exporter = GrpcSpanExporter(endpoint=f"127.0.0.1:{grpc_rx.port}", insecure=True) if transport == "grpc" else \
        HttpSpanExporter(endpoint=f"http://127.0.0.1:{http_rx.port}/v1/traces")
    ids = [f"{transport}-{i}" for i in range(3)]
    times = send_requests(exporter, ids, e2e=0.6)
    wait_for(lambda: all(store.get(i) for i in ids))
    for rid, (start_ns, end_ns) in zip(ids, times):
        doc = store.get(rid)
        assert doc["service"] == "vllm" and doc["service_from"] == "connection"
        assert doc["start"] == pytest.approx(start_ns / 1e9, abs=1e-6)
        assert doc["end"] == pytest.approx(end_ns / 1e9, abs=1e-6)
        assert doc["sched"]["runq_wait_seconds"] == pytest.approx(0.06, rel=1e-6)
        assert doc["sched"]["preempted_by"] == [{"service": "batch", "wait_seconds": pytest.approx(0.048)}]
        assert doc["slo"] == [{"name": "request_e2e_p99", "target": 0.5, "value": 0.6, "ok": False}]
        assert doc["sched"]["delay_seconds"] == pytest.approx(0.036, rel=1e-6)
        assert doc["verdict"] == ("CPU contention from batch added 30 ms (5% of 0.60 s end to end); "
                                      "give vllm more CPU weight (requests) than batch, or keep them apart")
    assert set(sched.watched) == {"vllm"}
    assert counters.received[transport] == 3
    assert counters.breach_counts() == {("vllm", "request_e2e_p99"): 3}


def test_requests_wait_until_their_end_is_covered(traces):
    sched, pipeline, store, _, _, http_rx = traces
    pipeline.stop()  # drive process() by hand
    sched.covered = 0.0
    body = (FIXTURES / "vllm_llm_request_v1.json").read_bytes()
    status, _ = post_traces(http_rx.port, body, "application/json")
    assert status == 200
    assert pipeline.pending() == 1 and pipeline.process() == 0 and not store.query()
    sched.covered = 1764680001.9   # just before the span's end (…01.9075)
    assert pipeline.process() == 0
    sched.covered = 1764680002.0
    assert pipeline.process() == 1
    doc = store.get("cmpl-8c5d1c2e4b7a4f0e9d3b6a1f2e7c9d40")
    assert doc["sched_complete"] and sched.calls[-1] == ("vllm", doc["start"], doc["end"])


def test_api_routes_list_filter_and_404(traces):
    _, _, store, _, _, http_rx = traces
    post_traces(http_rx.port, (FIXTURES / "vllm_llm_request_v1.json").read_bytes(), "application/json")
    wait_for(lambda: store.query())
    routes = request_routes(store)
    # The fixture span ended 58 s before the store's clock.
    assert json.loads(routes["/api/v1/requests"]({"since": ["50"]}).body) == {"requests": []}
    doc = json.loads(routes["/api/v1/requests"]({"since": ["60"], "service": ["vllm"]}).body)
    assert [r["request_id"] for r in doc["requests"]] == ["cmpl-8c5d1c2e4b7a4f0e9d3b6a1f2e7c9d40"]
    one = routes["/api/v1/requests/"]({"_tail": ["cmpl-8c5d1c2e4b7a4f0e9d3b6a1f2e7c9d40"]})
    assert one.status == 200 and json.loads(one.body)["e2e"] == pytest.approx(1.8027, abs=1e-4)
    missing = routes["/api/v1/requests/"]({"_tail": ["nope"]})
    assert missing.status == 404 and "nope" in json.loads(missing.body)["error"]
    assert routes["/api/v1/requests"]({"since": ["-1"]}).status == 400
    assert routes["/api/v1/requests"]({"breached": ["maybe"]}).status == 400


def reason_of(status_body: bytes, is_json: bool) -> str:
    if is_json:
        return json.loads(status_body)["message"]
    st = Status()
    st.ParseFromString(status_body)
    return st.message


def test_http_bad_input_gets_the_right_status_and_the_receiver_keeps_serving(traces):
    _, _, store, counters, _, http_rx = traces
    good_json = (FIXTURES / "vllm_llm_request_v1.json").read_bytes()
    good_pb = decode_json(good_json).SerializeToString()
    rng = random.Random(7)
    noise = bytes(rng.randrange(256) for _ in range(512))
    cases = [
        (b"\x0a\xff\xff\xff\xff\x0f" + noise, "application/x-protobuf", None, 400, "protobuf"),   # length past end
        (good_pb[: len(good_pb) - 7], "application/x-protobuf", None, 400, "protobuf"),            # truncated
        (good_json, "text/plain", None, 415, "Content-Type"),
        (b"{\"resourceSpans\": [{\"scopeSpans\": [{\"spans\": [{\"name\": []}]}]}]}", "application/json", None,
         400, "name"),
        (b"{\"resourceSpans\": {\"a\": 1}}", "application/json", None, 400, "resourceSpans"),
        (b"x" * (300 * 1024), "application/x-protobuf", None, 413, "limit"),
        (gzip.compress(b"\0" * (8 << 20)), "application/x-protobuf", "gzip", 413, "inflates"),
        (b"not gzip at all", "application/json", "gzip", 400, "gzip"),
    ]
    for body, ctype, enc, status, words in cases:
        got, resp = post_traces(http_rx.port, body, ctype, enc)
        assert got == status, (ctype, enc, words, resp)
        assert words in reason_of(resp, ctype == "application/json"), resp
    # Still serving, in both encodings, with gzip.
    assert post_traces(http_rx.port, gzip.compress(good_pb), "application/x-protobuf", "gzip")[0] == 200
    status, resp = post_traces(http_rx.port, good_json, "application/json")
    assert status == 200 and json.loads(resp) == {}
    wait_for(lambda: store.get("cmpl-8c5d1c2e4b7a4f0e9d3b6a1f2e7c9d40"))
    assert sum(counters.rejected.values()) == len(cases)
    assert counters.rejected[("http", "too_large")] == 2


def test_http_random_bytes_are_refused(traces):
    http_rx = traces[5]
    rng = random.Random(1)
    refused = 0
    for _ in range(20):
        body = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300)))
        status, _ = post_traces(http_rx.port, body, "application/x-protobuf")
        # Protobuf is permissive: a few random byte strings are valid (empty) requests.
        assert status in (200, 400)
        refused += status == 400
    assert refused >= 15


def test_grpc_malformed_and_oversized_messages(traces):
    _, _, _, counters, grpc_rx, _ = traces
    with grpc.insecure_channel(f"127.0.0.1:{grpc_rx.port}") as channel:
        export = channel.unary_unary(f"/{SERVICE}/Export", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as e:
            export(b"\x0a\xff\xff\xff\xff\x0f\x01\x02", timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "protobuf" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            export(b"\x0a" + b"\x80" * 300_000, timeout=5)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        good = decode_json((FIXTURES / "vllm_llm_request_v1.json").read_bytes()).SerializeToString()
        assert export(good, timeout=5) == b""   # an empty ExportTraceServiceResponse
    assert counters.rejected[("grpc", "malformed")] == 1


def test_grpcio_s_own_refusal_of_a_huge_message_is_counted(traces):
    """Above GRPC_MAX_MESSAGE grpcio refuses the message itself; the handler,
    which reads the stream, still sees the call and counts it."""
    _, _, _, counters, grpc_rx, _ = traces
    with grpc.insecure_channel(f"127.0.0.1:{grpc_rx.port}") as channel:
        export = channel.unary_unary(f"/{SERVICE}/Export", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as e:
            export(b"\x0a" + b"\x00" * (GRPC_MAX_MESSAGE + 1024), timeout=30)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        wait_for(lambda: counters.rejected.get(("grpc", "not_received")) == 1)
        good = decode_json((FIXTURES / "vllm_llm_request_v1.json").read_bytes()).SerializeToString()
        assert export(good, timeout=5) == b""   # and it keeps serving
    assert counters.rejected.get(("grpc", "not_received")) == 1
    assert ("grpc", "too_large") not in counters.rejected


def test_grpc_queue_is_bounded_and_its_refusals_are_counted(traces):
    """One worker and one queued call: a third call is refused at once with
    RESOURCE_EXHAUSTED (retryable for OTLP exporters) and counted; once the
    first two finish, calls are served again."""
    _, pipeline, _, counters, _, _ = traces
    rx = GrpcReceiver("127.0.0.1", 0, pipeline, counters, workers=1, max_queued=1)
    rx.start()
    release = threading.Event()
    good = decode_json((FIXTURES / "vllm_llm_request_v1.json").read_bytes()).SerializeToString()

    def held():   # a client that opens its call and sends its message only when released
        release.wait(30)
        yield good

    try:
        with grpc.insecure_channel(f"127.0.0.1:{rx.port}") as channel:
            stream = channel.stream_unary(f"/{SERVICE}/Export", request_serializer=None,
                                          response_deserializer=None)
            unary = channel.unary_unary(f"/{SERVICE}/Export", request_serializer=None, response_deserializer=None)
            pending = [stream.future(held(), timeout=30) for _ in range(2)]
            time.sleep(0.5)   # both admitted: one running, one queued
            with pytest.raises(grpc.RpcError) as e:
                unary(good, timeout=5)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert counters.rejected.get(("grpc", "queue_full")) == 1
            release.set()
            assert [f.result(timeout=30) for f in pending] == [b"", b""]
            assert unary(good, timeout=5) == b""
    finally:
        release.set()
        rx.stop()
    assert counters.rejected.get(("grpc", "queue_full")) == 1


def test_request_breaches_and_delay_reach_the_main_collector(traces):
    _, _, store, counters, _, http_rx = traces
    post_traces(http_rx.port, (FIXTURES / "vllm_llm_request_v1.json").read_bytes(), "application/json")
    wait_for(lambda: store.query())
    # wired as the daemon wires them: one family per metric name
    families = {f.spec.name: f for f in compute(Store(60.0), Sources(
        slo_breaches=counters.breach_counts, request_sched_delay=counters.delay_points,
        request_slos=counters.slo_status))}
    [breach] = families["slatrace_slo_breaches"].points
    assert breach.labels == ("vllm", "request_e2e_p99") and breach.value == 1
    # The request SLO is exported beside the interval ones (judged on the last
    # minute; the recorded span ended long ago, so nothing is left to judge).
    [target] = families["slatrace_slo_target_seconds"].points
    [ok] = families["slatrace_slo_ok"].points
    judged = store.query()[0]["slo"][0]
    assert target.labels == ok.labels == ("vllm", "request_e2e_p99") and target.value == judged["target"]
    assert ok.value == 1.0 and not families["slatrace_slo_value_seconds"].points
    [delay] = families["slatrace_request_sched_delay_seconds"].points
    runq = store.query()[0]["sched"]["delay_seconds"]  # the delay, not the thread-seconds
    assert delay.count == 1 and delay.sum == pytest.approx(runq)
    assert runq == pytest.approx(0.6 * store.query()[0]["sched"]["runq_thread_seconds"])
    below = [n for bound, n in zip(delay.bounds, delay.cumulative) if bound < runq]
    assert below and all(n == 0 for n in below)
    names = {f.name for f in TraceCollector(counters).collect()}
    assert not names & {"slatrace_slo_breaches", "slatrace_request_sched_delay_seconds"}


# --- forwarding -------------------------------------------------------------------

class FlakyExporter:
    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.batches: list[list] = []

    def export(self, spans):
        if self.failures:
            self.failures -= 1
            return SpanExportResult.FAILURE
        self.batches.append(list(spans))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def fixture_items():
    req = decode_json((FIXTURES / "vllm_llm_request_v1.json").read_bytes())
    return [(rs, ss, span, None) for rs, ss, span in iter_spans(req)]


def test_forwarder_leaves_retries_to_the_exporter_and_counts_drops():
    """One export call per batch (the SDK exporter retries inside it); a
    batch it could not send is counted as dropped, a full queue too."""
    counters = TraceCounters()
    ok = Forwarder(FlakyExporter(0), counters)
    assert ok.send(fixture_items())
    assert counters.forwarded == 1
    flaky = FlakyExporter(1)
    bad = Forwarder(flaky, counters)
    assert not bad.send(fixture_items())
    assert counters.forward_dropped == {"export_failed": 1} and flaky.failures == 0   # one call, no retry of ours
    full = Forwarder(FlakyExporter(0), counters, max_queue=2)   # not started: nothing drains
    for item in fixture_items() * 5:
        full.forward(*item)   # never blocks
    assert counters.forward_dropped["queue_full"] == 3


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_forwarding_keeps_ids_and_enriches_request_spans(protocol):
    with OtlpReceiver() as collector:
        endpoint = collector.grpc_endpoint if protocol == "grpc" else collector.http_endpoint
        counters = TraceCounters()
        forwarder = Forwarder(make_exporter(endpoint, protocol), counters, flush_s=0.05)
        sched = FakeSched()
        pipeline = RequestPipeline(sched, FixedOrigin(), (),
                                   RequestStore(900), counters, forwarder)
        forwarder.start()
        req = decode_json((FIXTURES / "vllm_llm_request_v1.json").read_bytes())
        other = req.resource_spans[0].scope_spans[0].spans.add()
        other.CopyFrom(req.resource_spans[0].scope_spans[0].spans[0])
        other.name = "http.request"
        other.span_id = bytes.fromhex("00112233445566ff")
        pipeline.ingest(req, "http")
        pipeline.process()
        got = collector.wait_for_traces(predicate=lambda xs: sum(
            len(ss.spans) for x in xs for rs in x.request.resource_spans for ss in rs.scope_spans) >= 2)
        forwarder.stop()
    spans = {span.name: (rs, span) for x in got for rs, _, span in iter_spans(x.request)}
    rs, fwd = spans["llm_request"]
    assert fwd.trace_id.hex() == "5b8efff798038103d269b633813fc60c"
    assert fwd.span_id.hex() == "1249ea9bf35be388" and fwd.parent_span_id.hex() == "eee19b7ec3c1b174"
    assert fwd.start_time_unix_nano == 1764680000104551000 and fwd.kind == 2
    attrs = attributes(fwd.attributes)
    assert attrs["gen_ai.request.id"] == "cmpl-8c5d1c2e4b7a4f0e9d3b6a1f2e7c9d40"
    duration = (fwd.end_time_unix_nano - fwd.start_time_unix_nano) / 1e9
    assert attrs["slatrace.runq_wait_seconds"] == pytest.approx(0.1 * duration)
    assert attrs["slatrace.runq_thread_seconds"] == pytest.approx(0.1 * duration)
    assert attrs["slatrace.delay_seconds"] == pytest.approx(0.06 * duration)
    assert attrs["slatrace.top_culprit"] == "batch" and attrs["slatrace.preemptions"] == 7
    assert attrs["slatrace.top_culprit_wait_seconds"] == pytest.approx(0.05 * duration)
    assert attrs["slatrace.verdict"].startswith("CPU contention from batch")
    assert attributes(rs.resource.attributes)["service.name"] == "unknown_service:python"
    _, plain = spans["http.request"]
    assert plain.span_id.hex() == "00112233445566ff"
    assert not any(k.startswith("slatrace.") for k in attributes(plain.attributes))
    assert counters.forwarded == 2


def test_ingest_is_safe_from_many_threads(traces):
    _, pipeline, store, _, _, _ = traces
    req = decode_json((FIXTURES / "vllm_llm_request_v1.json").read_bytes())
    reqs = []
    for t in range(8):
        r = ExportTraceServiceRequest()
        r.CopyFrom(req)
        span = r.resource_spans[0].scope_spans[0].spans[0]
        span.span_id = bytes([t + 1]) * 8
        for kv in span.attributes:
            if kv.key == "gen_ai.request.id":
                kv.value.string_value = f"t{t}"
        reqs.append(r)
    threads = [threading.Thread(target=pipeline.ingest, args=(r, "http")) for r in reqs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wait_for(lambda: len(store.query()) == 8)


def test_a_failing_scheduling_source_costs_one_request_and_is_counted():
    """The kernel side raising for a request: the request is still recorded
    (without scheduling figures), and the failure is counted for /metrics."""

    class Broken(FakeSched):
        def between(self, service, start, end, front=None, phases=()):
            raise RuntimeError("the event log is gone")

    counters = TraceCounters()
    store = RequestStore(900, clock=lambda: 1764680060.0)
    pipeline = RequestPipeline(Broken(), own_services(), (), store, counters, tick_s=0.02)
    http_rx = HttpReceiver("127.0.0.1", 0, pipeline, counters, Limits())
    pipeline.start()
    http_rx.start()
    try:
        post_traces(http_rx.port, (FIXTURES / "vllm_llm_request_v1.json").read_bytes(), "application/json")
        wait_for(lambda: store.query())
    finally:
        http_rx.stop()
        pipeline.stop()
    assert counters.attribution_errors == 1
    families = {f.name: f for f in TraceCollector(counters).collect()}
    assert families["slatrace_requests_attribution_errors"].samples[0].value == 1
