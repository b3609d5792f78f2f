"""How vLLM sets up tracing and fills its `llm_request` span, by release.

Written from vLLM's own `vllm/tracing.py` (up to 0.15) and `vllm/tracing/`
package (0.16 on), as read from their wheels, so that test processes send what a
real vLLM sends — and nothing it does not:

- the tracer provider: `TracerProvider()` with the SDK's default resource up to
  0.15; from 0.16 a resource of `vllm.instrumenting_module_name` and
  `vllm.process_id` (the pid as a string, in vLLM's own pid namespace);
- the exporter: chosen by OTEL_EXPORTER_OTLP_TRACES_PROTOCOL (gRPC unless it
  says `http/protobuf`) and built from the endpoint as given, so up to 0.15 a
  gRPC endpoint without `http://` means TLS; from 0.16 gRPC is always insecure;
- a BatchSpanProcessor with its defaults (a batch every 5 s).

The V1 engine's span: the request's external id, latencies, token counts, and
sampling parameters only when truthy (temperature 0, top_p 0 or n 0 are left
out); no model name, no finish reasons. With n > 1 every child request ends in
its own span carrying the parent's id.
"""

from __future__ import annotations

import os
from typing import Any

V1_MODULE = "vllm.llm_engine"


def init_tracer(instrumenting_module_name: str, endpoint: str, release: str = "0.15"):
    """The tracer vLLM `release` ("0.15" or "0.16") builds for `--otlp-traces-endpoint endpoint`;
    returns (tracer, provider)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if release == "0.15":
        provider = TracerProvider()
    else:
        provider = TracerProvider(resource=Resource.create({
            "vllm.instrumenting_module_name": instrumenting_module_name,
            "vllm.process_id": str(os.getpid())}))
    provider.add_span_processor(BatchSpanProcessor(span_exporter(endpoint, release)))
    return provider.get_tracer(instrumenting_module_name), provider


def span_exporter(endpoint: str, release: str = "0.15"):
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        if release == "0.15":
            return OTLPSpanExporter(endpoint=endpoint)
        return OTLPSpanExporter(endpoint=endpoint, insecure=True)
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        return OTLPSpanExporter(endpoint=endpoint)
    raise ValueError(f"Unsupported OTLP protocol '{protocol}' is configured")


def v1_attributes(request_id: str, *, arrival_s: float, scheduled_s: float, first_token_s: float,
                  last_token_s: float, prompt_tokens: int, completion_tokens: int,
                  temperature: float = 0.0, top_p: float = 1.0, max_tokens: int | None = None,
                  n: int = 1) -> dict[str, Any]:
    """The V1 output processor's attributes for one finished request (times in seconds)."""
    attrs: dict[str, Any] = {
        "gen_ai.latency.time_to_first_token": first_token_s - arrival_s,
        "gen_ai.latency.e2e": last_token_s - arrival_s,
        "gen_ai.latency.time_in_queue": scheduled_s - arrival_s,
        "gen_ai.usage.prompt_tokens": prompt_tokens,
        "gen_ai.usage.completion_tokens": completion_tokens,
        "gen_ai.latency.time_in_model_prefill": first_token_s - scheduled_s,
        "gen_ai.latency.time_in_model_decode": last_token_s - first_token_s,
        "gen_ai.latency.time_in_model_inference": last_token_s - scheduled_s,
        "gen_ai.request.id": request_id,
    }
    for key, value in (("gen_ai.request.top_p", top_p), ("gen_ai.request.max_tokens", max_tokens),
                       ("gen_ai.request.temperature", temperature), ("gen_ai.request.n", n)):
        if value:
            attrs[key] = value
    return attrs


def server_env(protocol: str | None = None, **extra: str) -> dict[str, str]:
    """The environment a test server starts with: none of the runner's OTEL_*
    variables, the traces protocol vLLM reads (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL)
    when given, and `extra` (the OTel SDK's own variables a test sets)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    if protocol:
        env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = protocol
    return {**env, **extra}
