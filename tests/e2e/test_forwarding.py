"""Forwarding through the real daemon: spans sent to the agent by the real OTel
SDK exporter reach a test OTLP receiver (the agent's --otlp-endpoint) with
their ids and parent kept, and `llm_request` spans carry the agent's
`slatrace.*` figures, equal to what its own API says about the request."""

from __future__ import annotations

import os
import time

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from agent.traces.spans import attributes
from tests.support import needs_kernel
from tests.support.agent import Agent, free_port
from tests.support.otlp_receiver import OtlpReceiver

pytestmark = pytest.mark.e2e


def test_spans_are_forwarded_with_ids_and_slatrace_attributes():
    needs_kernel()
    grpc_port = free_port()
    with OtlpReceiver(http_enabled=False) as collector, \
            Agent("--otlp-endpoint", collector.grpc_endpoint,
                  "--otlp-grpc-listen", f"127.0.0.1:{grpc_port}") as agent:
        provider = TracerProvider(resource=Resource.create({"service.name": "vllm",
                                                            "process.pid": os.getpid()}))
        provider.add_span_processor(SimpleSpanProcessor(
            OTLPSpanExporter(endpoint=f"127.0.0.1:{grpc_port}", insecure=True)))
        tracer = provider.get_tracer("test")
        with tracer.start_as_current_span("http_request") as parent:
            with tracer.start_as_current_span("llm_request", kind=trace.SpanKind.SERVER) as span:
                span.set_attribute("gen_ai.request.id", "cmpl-forward-1")
                end = time.monotonic() + 0.3
                while time.monotonic() < end:   # real CPU work inside the request
                    pass
                span.set_attribute("gen_ai.latency.e2e", 0.3)
            parent_ctx, span_ctx = parent.get_span_context(), span.get_span_context()
        provider.shutdown()

        got = collector.wait_for_traces(
            timeout=20.0, predicate=lambda reqs: any(
                s.name == "llm_request" for r in reqs for rs in r.request.resource_spans
                for ss in rs.scope_spans for s in ss.spans))
        spans = {s.name: s for r in got for rs in r.request.resource_spans for ss in rs.scope_spans
                 for s in ss.spans}
        doc = agent.get_json("/api/v1/requests/cmpl-forward-1")

    req, http = spans["llm_request"], spans["http_request"]
    assert req.trace_id == span_ctx.trace_id.to_bytes(16, "big")
    assert req.span_id == span_ctx.span_id.to_bytes(8, "big")
    assert req.parent_span_id == parent_ctx.span_id.to_bytes(8, "big")
    assert http.span_id == parent_ctx.span_id.to_bytes(8, "big")
    assert not any(kv.key.startswith("slatrace.") for kv in http.attributes)  # forwarded untouched
    attrs = attributes(req.attributes)
    assert attrs["gen_ai.request.id"] == "cmpl-forward-1"
    # Found through the connection, the pid it claims being its own; this test process runs in the root cgroup
    assert attrs["slatrace.service"] == doc["service"] == "host" and doc["service_from"] == "process.pid"
    assert attrs["slatrace.verdict"] == doc["verdict"]
    assert attrs["slatrace.runq_wait_seconds"] == pytest.approx(doc["sched"]["runq_wait_seconds"])
    assert attrs["slatrace.preemptions"] == doc["sched"]["preemptions"]
    assert attrs["slatrace.migrations"] == doc["sched"]["migrations"]
