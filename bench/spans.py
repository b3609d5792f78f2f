"""Spans ingested per second on one core, with per-request attribution on.

The whole receive path but the socket: protobuf export requests of 512
`llm_request` spans (what the SDK's BatchSpanProcessor sends) are decoded,
ingested (span parsing, service lookup, queueing) and attributed from the
exact event source (EventSched over an EventLog holding the service's waits:
one every --wait-every-us, a fifth of them after a preemption), then stored.
Each request spans 0.5 s, so an attribution scans 0.5 s / wait-every waits:
100 at the default of one wait per 5 ms, 1000 at one per 0.5 ms.

    .venv/bin/python -m bench.spans [--spans 50000] [--wait-every-us 5000] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import time

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from agent.attribution.request_sched import EventSched
from agent.config import Slo
from agent.probe.snapshot import SchedEvent
from agent.store.events import EV_PREEMPTED, EV_RUNQ, EventLog
from agent.traces.identity import SpanOrigin
from agent.traces.metrics import TraceCounters
from agent.traces.otlp_decode import decode_body
from agent.traces.pipeline import RequestPipeline
from agent.traces.request_store import RequestStore

BATCH = 512
VLLM_CGID, BATCH_CGID = 100, 200


class _Covered:
    """Fallback source for requests older than the watch: none are, here."""

    def watch(self, service: str) -> None:
        pass

    def covered_until(self) -> float:
        return float("inf")

    def between(self, service, start, end, front=None, phases=()):  # pragma: no cover - never reached
        raise AssertionError("every request starts after the watch")


class _OneSender:
    """Every connection is the vLLM process (the lookup is cached per connection
    anyway; what is measured here is decoding and attribution)."""

    def origin(self, peer, resource) -> SpanOrigin:
        return SpanOrigin("vllm", "connection")


def export_bodies(n_spans: int, t0_ns: int) -> list[bytes]:
    bodies = []
    for first in range(0, n_spans, BATCH):
        req = ExportTraceServiceRequest()
        rs = req.resource_spans.add()
        for key, value in (("service.name", "vllm"), ("telemetry.sdk.language", "python")):
            kv = rs.resource.attributes.add()
            kv.key, kv.value.string_value = key, value
        ss = rs.scope_spans.add()
        ss.scope.name = "vllm.v1.engine.output_processor"
        for i in range(first, min(first + BATCH, n_spans)):
            span = ss.spans.add()
            span.trace_id = i.to_bytes(16, "big")
            span.span_id = (i + 1).to_bytes(8, "big")
            span.name = "llm_request"
            span.kind = Span.SPAN_KIND_SERVER
            span.start_time_unix_nano = t0_ns + i * 100_000
            span.end_time_unix_nano = span.start_time_unix_nano + 500_000_000
            for key, value in (("gen_ai.latency.e2e", 0.5), ("gen_ai.latency.time_to_first_token", 0.1),
                               ("gen_ai.latency.time_in_queue", 0.01), ("gen_ai.latency.time_in_model_prefill", 0.09),
                               ("gen_ai.latency.time_in_model_decode", 0.4),
                               ("gen_ai.latency.time_in_model_inference", 0.49)):
                kv = span.attributes.add()
                kv.key, kv.value.double_value = key, value
            for key, value in (("gen_ai.usage.prompt_tokens", 812), ("gen_ai.usage.completion_tokens", 256),
                               ("gen_ai.request.max_tokens", 256)):
                kv = span.attributes.add()
                kv.key, kv.value.int_value = key, value
            kv = span.attributes.add()
            kv.key, kv.value.string_value = "gen_ai.request.id", f"cmpl-{i}"
        bodies.append(req.SerializeToString())
    return bodies


def run(n_spans: int, wait_every_ns: int = 5_000_000) -> dict:
    os.sched_setaffinity(0, {0})  # one core
    log = EventLog(retention_ns=600 * 10**9, max_events=5_000_000)
    sched = EventSched(log, lambda s: {VLLM_CGID} if s == "vllm" else set(),
                       lambda c: {VLLM_CGID: "vllm", BATCH_CGID: "batch"}.get(c, "unknown"), _Covered())
    sched.watch("vllm")
    sched.watched_cgroups()
    t0 = time.time() + 0.01
    offset_ns = time.time_ns() - time.monotonic_ns()
    t0_ns = int(t0 * 1e9)
    horizon_ns = n_spans * 100_000 + 2 * 10**9
    events = [SchedEvent(VLLM_CGID, EV_PREEMPTED if k % 5 == 0 else EV_RUNQ,
                         t0_ns - offset_ns + k * wait_every_ns, t0_ns - offset_ns + k * wait_every_ns + 50_000,
                         BATCH_CGID if k % 5 == 0 else 0, 4242)
              for k in range(horizon_ns // wait_every_ns)]
    log.add(events)
    sched.ingest([], drained_at_wall=t0 + horizon_ns / 1e9 + 1)

    counters = TraceCounters()
    store = RequestStore(900, max_requests=n_spans + 1)
    pipeline = RequestPipeline(sched, _OneSender(),
                               (Slo("vllm", request_e2e_p99=0.4),), store, counters)
    bodies = export_bodies(n_spans, t0_ns)
    start = time.perf_counter()
    cpu0 = time.process_time()
    for body in bodies:
        req, _ = decode_body(body, "application/x-protobuf", None)
        pipeline.ingest(req, "bench")
        pipeline.process()
    pipeline.process()
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu0
    assert len(store) == n_spans, (len(store), n_spans)
    sample = store.get("cmpl-7")["sched"]
    return {"spans": n_spans, "waits_per_request": 500_000_000 // wait_every_ns, "seconds": round(wall, 3),
            "cpu_seconds": round(cpu, 3),
            "spans_per_second": round(n_spans / wall),
            # On a shared machine wall time includes waiting for the CPU; this does not.
            "spans_per_cpu_second": round(n_spans / cpu), "events_in_log": len(events),
            "sample_runq_wait_seconds": sample["runq_wait_seconds"], "sample_preemptions": sample["preemptions"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spans", type=int, default=50_000)
    p.add_argument("--wait-every-us", type=int, default=5000, help="one wait of the service per this many µs")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    result = run(args.spans, args.wait_every_us * 1000)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['spans']} llm_request spans in {result['seconds']} s ({result['cpu_seconds']} s CPU): "
              f"{result['spans_per_second']} spans/s on one core ({result['spans_per_cpu_second']} per CPU second), "
              f"attribution on, "
              f"{result['waits_per_request']} waits per request "
              f"(sample request: runq {result['sample_runq_wait_seconds']:.4f} s, "
              f"{result['sample_preemptions']} preemptions)")


if __name__ == "__main__":
    main()
