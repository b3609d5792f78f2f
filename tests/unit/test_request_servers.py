"""Request spans of other servers (presets and configured rules), and the
servers streamed from the agent's start because of their command line.

None of SGLang, Triton or TGI runs here, so their spans are fixtures derived
from each server's own tracing code, read at a named commit (each fixture's
`_derivedFrom` says which files, at which commit or release, and what shape
they give): SGLang's "<role> Req <rid[:8]>" root span with `rid` and its
gen_ai.* latencies, beside thread spans; Triton's attribute-less
`InferRequest` root with the model's child span and `compute` (OTLP/HTTP, its
only transport); TGI's handler spans with durations as Rust Duration text,
beside the router's inner spans of the same names. They are posted to the real
OTLP/HTTP receiver as OTLP/JSON, moved to the present.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from agent.attribution.request_sched import EventSched, RequestSched
from agent.config import ConfigError, RequestSpanRule, parse_config
from agent.store.events import EventLog
from agent.traces.identity import SpanOrigin
from agent.traces.metrics import TraceCounters
from agent.traces.pipeline import RequestPipeline
from agent.traces.receiver_http import HttpReceiver
from agent.traces.request_store import RequestStore
from agent.traces.servers import RequestRules, ServerProcesses, is_server_cmdline, parse_duration
from tests.support.agent import post_traces


class Sched:
    def __init__(self) -> None:
        self.watched: set[str] = set()

    def watch(self, service: str) -> None:
        self.watched.add(service)

    def pin(self, services: set[str]) -> None:
        pass

    def covered_until(self) -> float:
        return float("inf")

    def between(self, service: str, start: float, end: float, front: int | None = None, phases=()) -> RequestSched:
        return RequestSched(0.1 * (end - start), 1, (("batch", 0.1 * (end - start)),), 0.0, 0, 1e-6,
                            delay_seconds=0.1 * (end - start), delay_by=(("batch", 0.1 * (end - start)),))


class OneService:
    def origin(self, peer, resource) -> SpanOrigin:
        assert peer is not None and peer.host == "127.0.0.1"  # the receiver handed the connection on
        return SpanOrigin("llm", "connection")


def send(port: int, service_name: str, spans: list[tuple[str, dict, int]]) -> None:
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(SimpleSpanProcessor(HttpSpanExporter(endpoint=f"http://127.0.0.1:{port}/v1/traces")))
    tracer = provider.get_tracer(service_name)
    base = time.time_ns() - 10_000_000_000
    for name, attrs, dur_ms in spans:
        span = tracer.start_span(name, start_time=base, attributes=attrs)
        span.end(end_time=base + dur_ms * 1_000_000)
    provider.shutdown()


@pytest.fixture
def receiver():
    def make(servers, rules=()):
        store = RequestStore(900)
        pipeline = RequestPipeline(Sched(), OneService(), (), store, TraceCounters(), tick_s=0.02,
                                   rules=RequestRules(servers, rules))
        rx = HttpReceiver("127.0.0.1", 0, pipeline, pipeline.counters)
        pipeline.start()
        rx.start()
        made.append((rx, pipeline))
        return rx.port, store

    made = []
    yield make
    for rx, pipeline in made:
        rx.stop()
        pipeline.stop()


def wait_for(store: RequestStore, n: int) -> list[dict]:
    deadline = time.monotonic() + 10
    while len(store.query()) < n:
        assert time.monotonic() < deadline, store.query()
        time.sleep(0.02)
    return store.query()


FIXTURES = Path(__file__).parent / "fixtures" / "otlp"
FIXTURE_T0_NS = 1764680000_000000000  # where the derived fixtures' clocks start


def post_fixture(port: int, name: str) -> dict:
    """Post a derived fixture, its times moved to end within the last minute; returns it."""
    doc = json.loads((FIXTURES / name).read_text())
    shift = time.time_ns() - 30_000_000_000 - FIXTURE_T0_NS

    def moved(node):
        if isinstance(node, dict):
            return {k: (str(int(v) + shift) if k.endswith("UnixNano") else moved(v)) for k, v in node.items()}
        return [moved(v) for v in node] if isinstance(node, list) else node
    status, body = post_traces(port, json.dumps(moved(doc)).encode(), "application/json")
    assert status == 200, body
    return doc


def test_sglang_root_spans_are_requests_with_their_own_latencies(receiver):
    port, store = receiver(("vllm", "sglang"))
    doc = post_fixture(port, "sglang_req_spans.json")
    assert "sglang/srt/observability/trace.py" in json.dumps(doc["_derivedFrom"])
    docs = {d["request_id"]: d for d in wait_for(store, 2)}
    time.sleep(0.3)
    assert len(store.query()) == 2   # thread spans are not requests
    unified = docs["7f3a9c21e4b54d0f9a8b6c5d4e3f2a10"]
    assert (unified["e2e"], unified["ttft"], unified["queue"]) == (0.8123, 0.0412, None)  # SGLang's own figures
    assert docs["5e6f7a8b9c0d4e1f"]["e2e"] == pytest.approx(0.3, abs=1e-5)   # none recorded: the span's duration


def test_triton_infer_request_spans_are_requests(receiver):
    port, store = receiver(("vllm", "triton"))
    post_fixture(port, "triton_infer_spans.json")
    docs = wait_for(store, 2)
    time.sleep(0.3)
    assert len(store.query()) == 2   # the model's and compute spans are parts of the request
    # InferRequest carries no attributes: the span id names the request; the trace id joins its model span.
    assert sorted((d["request_id"], d["e2e"]) for d in docs) == [
        ("f100000000000001", pytest.approx(0.251, abs=1e-5)), ("f200000000000001", pytest.approx(0.12, abs=1e-5))]
    assert all(d["service"] == "llm" and d["queue"] is None for d in docs)


def test_tgi_handler_spans_are_requests_not_the_routers_inner_spans_of_the_same_name(receiver):
    port, store = receiver(("vllm", "tgi"))
    post_fixture(port, "tgi_router_spans.json")
    docs = wait_for(store, 5)
    time.sleep(0.3)
    assert len(store.query()) == 5   # Infer::generate/generate_stream, async_stream, compat_generate are not
    got = sorted((d["span_id"], d["e2e"], d["queue"]) for d in docs)
    assert got == [("a100000000000001", pytest.approx(0.812432571), pytest.approx(0.0125)),
                   ("b100000000000001", pytest.approx(1.250031), pytest.approx(0.003001)),
                   ("c100000000000001", pytest.approx(2.402108), pytest.approx(4e-5)),
                   ("d100000000000001", pytest.approx(0.6405), 0.0),
                   ("e100000000000002", pytest.approx(0.095004), pytest.approx(0.0011))]
    assert all(d["request_id"] == d["span_id"] for d in docs)
    assert all(d["sched"]["runq_wait_seconds"] == pytest.approx(0.1 * (d["end"] - d["start"]), rel=1e-3)
               for d in docs)


def test_only_enabled_presets_and_configured_rules_count(receiver):
    config = parse_config({"request_spans": {"servers": ["vllm"], "rules": [
        {"span_name": "handle_*", "request_id": ["app.req", "app.request_id"], "e2e": "app.total", "queue": "app.q"}]}},
        "c.yaml")
    port, store = receiver(config.request_spans.servers, config.request_spans.rules)
    send(port, "app", [("handle_chat", {"app.request_id": "a-1", "app.total": 0.5, "app.q": "20ms"}, 600),
                       ("InferRequest", {"triton.request_id": "t-1"}, 100)])   # triton not enabled
    [doc] = wait_for(store, 1)
    time.sleep(0.3)
    assert len(store.query()) == 1
    assert (doc["request_id"], doc["e2e"], doc["queue"]) == ("a-1", 0.5, pytest.approx(0.02))


def test_request_span_config_errors_are_one_sentence():
    with pytest.raises(ConfigError) as e:
        parse_config({"request_spans": {"servers": ["vllm", "ollama"]}}, "c.yaml")
    assert str(e.value) == ("c.yaml: request_spans.servers: unknown server 'ollama' (known: vllm, sglang, triton, "
                            "tgi; describe others under request_spans.rules)")
    with pytest.raises(ConfigError) as e:
        parse_config({"request_spans": {"rules": [{"request_id": "x"}]}}, "c.yaml")
    assert str(e.value) == "c.yaml: request_spans.rules[0].span_name: expected a glob on the span name, got None"
    with pytest.raises(ConfigError) as e:
        parse_config({"request_spans": {"watch": "vllm"}}, "c.yaml")
    assert str(e.value) == "c.yaml: request_spans.watch: expected a list of names, got 'vllm'"
    assert parse_config({"request_spans": {"rules": [{"span_name": "x", "request_id": "id"}]}}, "c.yaml") \
        .request_spans.rules == (RequestSpanRule("x", ("id",)),)


def test_durations_as_text():
    assert parse_duration("1.5s") == 1.5 and parse_duration("12.5ms") == pytest.approx(0.0125)
    assert parse_duration("40µs") == pytest.approx(4e-5) and parse_duration(0.25) == 0.25
    assert parse_duration("None") is None and parse_duration(True) is None and parse_duration(float("nan")) is None


@pytest.mark.parametrize("argv, server", [
    (["/usr/local/bin/vllm", "serve", "Qwen/Qwen2.5-0.5B", "--otlp-traces-endpoint", "http://127.0.0.1:4317"], "vllm"),
    (["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "x"], "vllm"),
    (["VLLM::EngineCore"], "vllm"),
    (["python3", "-m", "sglang.launch_server", "--enable-trace"], "sglang"),
    (["/opt/tritonserver/bin/tritonserver", "--model-repository=/models"], "triton"),
    (["text-generation-launcher", "--model-id", "x"], "tgi"),
    (["python3", "serve.py", "--help-vllm"], None),
    (["vim", "vllm/serve.py"], None),
])
def test_server_command_lines(argv, server):
    assert is_server_cmdline("\0".join(argv).encode() + b"\0", ("vllm", "sglang", "triton", "tgi")) == server


def test_server_processes_are_found_and_named_services_kept(tmp_path):
    for pid, argv, cgroup in ((300, ["vllm", "serve", "m"], "/inference/vllm"), (301, ["VLLM::EngineCore"], "/inference/vllm"),
                              (400, ["bash"], "/user"), (500, ["tritonserver"], "/triton")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cmdline").write_bytes("\0".join(argv).encode() + b"\0")
        (tmp_path / str(pid) / "cgroup").write_text(f"0::{cgroup}\n")

    class Cgroups:
        def id_of(self, path: str) -> int | None:
            return {"/inference/vllm": 7, "/user": 8, "/triton": 9}.get(path)

    names = {7: "vllm", 8: "user", 9: "triton"}
    found = ServerProcesses(Cgroups(), names.__getitem__, ("vllm",), ("batch-api",), proc_root=tmp_path)
    assert found.services() == {"vllm", "batch-api"}   # triton is not an enabled preset
    # Where the engine serves its own metrics: from `vllm serve`'s command line (port 8000 by default).
    assert found.engines == {"vllm": "http://127.0.0.1:8000/metrics"}
    assert ServerProcesses(Cgroups(), names.__getitem__, ("vllm", "triton"), proc_root=tmp_path).services() == \
        {"vllm", "triton"}


def test_watching_ends_when_a_service_stops_sending_and_pins_hold():
    now = [1000.0]
    sched = EventSched(EventLog(retention_ns=10**9), lambda s: {hash(s) & 0xffff}, str, Sched(),
                       idle_s=60.0, clock=lambda: now[0])
    sched.watch("vllm")
    sched.pin({"sglang"})
    assert sched.watching() == {"vllm", "sglang"}
    assert len(sched.watched_cgroups()) == 2
    now[0] += 59
    sched.watch("vllm")                 # still sending
    now[0] += 59
    assert sched.watching() == {"vllm", "sglang"} and len(sched.watched_cgroups()) == 2
    now[0] += 61                        # silent for more than idle_s
    sched.watched_cgroups()
    assert sched.watching() == {"sglang"}   # pinned: kept
    sched.pin(set())                    # the server went away: idle from now
    now[0] += 61
    sched.watched_cgroups()
    assert sched.watching() == set()


def test_host_is_never_watched_and_unresolved_spans_are_counted_with_one_warning(caplog):
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from agent.traces.identity import Peer

    class Origins:
        def __init__(self) -> None:
            self.next = SpanOrigin("host", "connection", ignored=("service.name",))

        def origin(self, peer, resource) -> SpanOrigin:
            return self.next

    def export(n: int) -> ExportTraceServiceRequest:
        req = ExportTraceServiceRequest()
        spans = req.resource_spans.add().scope_spans.add()
        for i in range(n):
            s = spans.spans.add()
            s.name, s.span_id, s.trace_id = "llm_request", bytes([i + 1]) * 8, b"\1" * 16
            s.start_time_unix_nano, s.end_time_unix_nano = 10**18, 10**18 + 10**9
        return req

    sched, origins, counters = Sched(), Origins(), TraceCounters()
    pipeline = RequestPipeline(sched, origins, (), RequestStore(900), counters)
    peer = Peer("203.0.113.9", 40000, "10.0.0.1", 4317)
    pipeline.ingest(export(2), "grpc", peer)
    assert sched.watched == set() and counters.claims_ignored == {"service.name": 1}
    origins.next = SpanOrigin(None, "unresolved", reason="remote_peer")
    with caplog.at_level("WARNING", logger="agent.traces.pipeline"):
        for _ in range(3):
            pipeline.ingest(export(2), "grpc", peer)
    assert counters.unresolved == {"remote_peer": 6}
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith("request spans from 203.0.113.9:40000 are not attributed to any service (remote_peer): ")
    assert "point the server at the agent on its own node" in warning


def test_a_requests_wait_is_split_by_process_and_thread_name():
    import ctypes
    import os
    import threading

    from agent.identity.threads import ThreadNames
    from agent.probe.snapshot import EV_PREEMPTED, EV_RUNQ, SchedEvent

    # A real thread of this process, named the way vLLM's engine core names its loop.
    named, done = threading.Event(), threading.Event()
    tids: list[int] = []

    def engine_loop() -> None:
        ctypes.CDLL(None).prctl(15, b"EngineCoreLoop", 0, 0, 0)  # PR_SET_NAME
        tids.append(threading.get_native_id())
        named.set()
        done.wait(10)

    t = threading.Thread(target=engine_loop)
    t.start()
    try:
        assert named.wait(5)
        names = ThreadNames()
        me = Path("/proc/self/comm").read_text().strip()
        assert names(tids[0]) == (os.getpid(), me, "EngineCoreLoop")
        log = EventLog(retention_ns=10**12)
        now_mono = time.monotonic_ns()
        log.add([SchedEvent(10, EV_RUNQ, now_mono - 3_000_000, now_mono - 1_000_000, 0, tids[0]),
                 SchedEvent(10, EV_PREEMPTED, now_mono - 900_000, now_mono - 800_000, 11, tids[0]),
                 SchedEvent(10, EV_RUNQ, now_mono - 2_000_000, now_mono - 1_500_000, 0, 999_999_999)])
        sched = EventSched(log, lambda s: {10}, str, Sched(), thread_names=names)
        sched.watch("vllm")
        sched.watched_cgroups()
        sched._watching["vllm"] = 0.0  # watched long before the window
        wall = time.time()
        # The window reaches a second back: this thread may be descheduled for
        # milliseconds between building the events and reading the clock.
        got = sched.between("vllm", wall - 1.0, wall)
        assert got.by_thread == ((os.getpid(), me, "EngineCoreLoop", pytest.approx(0.0021, abs=1e-4)),
                                 (0, "?", "tid 999999999", pytest.approx(0.0005, abs=1e-4)))
        assert sum(w for *_, w in got.by_thread) == pytest.approx(got.runq_wait_seconds)
        assert got.as_dict()["by_thread"][0] == {"pid": os.getpid(), "process": me, "thread": "EngineCoreLoop",
                                                 "wait_seconds": pytest.approx(0.0021, abs=1e-4)}
    finally:
        done.set()
        t.join()
