"""vLLM's `llm_request` span, as vLLM sends it, in a typed form.

vLLM builds one SERVER span per finished request, named `llm_request`, starting
at the request's arrival (wall clock) and ending when the output is done. Its
attribute names live in vllm/tracing.py (SpanAttributes; vllm/tracing/ from
0.16). The V0 engine set the model name, temperature/top_p/max_tokens/n,
num_sequences, token usage, queue/ttft/e2e and, with detailed traces, the
scheduler/model-forward/model-execute times. The V1 engine sets the request's
external id, e2e/ttft/queue, prefill/decode/inference times and token usage,
and sampling parameters only when they are truthy (temperature 0 is absent);
it leaves out the model name and the finish reasons, and with n > 1 each child
request ends in its own span with the parent's id. Either set, or any subset
of it, parses: a missing attribute is None, never an error, because the span
is still worth its timing.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from agent.attribution.request_span import RequestSpan
from agent.config import REQUEST_SPAN_NAME

__all__ = [
    "REQUEST_SPAN_NAME",
    "VllmAttr",
    "RequestSpan",
    "any_value",
    "attributes",
    "iter_spans",
    "request_span",
]



class VllmAttr:
    """Attribute names vLLM sets on `llm_request` (vllm/tracing.py)."""

    REQUEST_ID = "gen_ai.request.id"
    RESPONSE_MODEL = "gen_ai.response.model"
    MAX_TOKENS = "gen_ai.request.max_tokens"
    TOP_P = "gen_ai.request.top_p"
    TEMPERATURE = "gen_ai.request.temperature"
    N = "gen_ai.request.n"
    PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    NUM_SEQUENCES = "gen_ai.usage.num_sequences"             # V0
    FINISH_REASONS = "gen_ai.response.finish_reasons"        # semantic conventions; vLLM does not set it
    E2E = "gen_ai.latency.e2e"
    TTFT = "gen_ai.latency.time_to_first_token"
    QUEUE = "gen_ai.latency.time_in_queue"
    PREFILL = "gen_ai.latency.time_in_model_prefill"         # V1
    DECODE = "gen_ai.latency.time_in_model_decode"           # V1
    INFERENCE = "gen_ai.latency.time_in_model_inference"     # V1
    SCHEDULER = "gen_ai.latency.time_in_scheduler"           # V0
    MODEL_FORWARD = "gen_ai.latency.time_in_model_forward"   # V0 (detailed traces)
    MODEL_EXECUTE = "gen_ai.latency.time_in_model_execute"   # V0 (detailed traces)


def any_value(v: AnyValue) -> Any:
    """An OTLP AnyValue as a plain Python value (None when unset)."""
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return attributes(v.kvlist_value.values)
    return getattr(v, kind)


def attributes(kvs: Iterator[KeyValue] | Any) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in kvs}


def iter_spans(req: ExportTraceServiceRequest) -> Iterator[tuple[ResourceSpans, ScopeSpans, Span]]:
    """Every span with its resource and scope. Their wrappers are kept alive
    for the whole walk: callers key per-resource work by id(), and protobuf
    (upb) hands a freed wrapper's id to the next resource — a collector's
    export of many resources would then give one resource's origin to all."""
    kept: list[ResourceSpans | ScopeSpans] = []
    for rs in req.resource_spans:
        kept.append(rs)
        for ss in rs.scope_spans:
            kept.append(ss)
            for span in ss.spans:
                yield rs, ss, span


def _float(attrs: Mapping[str, Any], key: str) -> float | None:
    value = attrs.get(key)
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return None
    if isinstance(value, (int, float)):
        value = float(value)
        return value if math.isfinite(value) else None  # NaN or infinity is no duration
    return None


def _int(attrs: Mapping[str, Any], key: str) -> int | None:
    value = _float(attrs, key)
    return int(value) if value is not None and abs(value) < 2**63 else None


def _str(attrs: Mapping[str, Any], key: str) -> str | None:
    value = attrs.get(key)
    if value is None or isinstance(value, (list, dict)):
        return None
    return value if isinstance(value, str) else str(value)


def request_span(span: Span, attrs: Mapping[str, Any] | None = None) -> RequestSpan:
    """A `llm_request` span in typed form; `attrs` may be passed when already decoded."""
    if attrs is None:
        attrs = attributes(span.attributes)
    start = span.start_time_unix_nano / 1e9
    end = max(span.end_time_unix_nano / 1e9, start)
    span_id = span.span_id.hex()
    reasons = attrs.get(VllmAttr.FINISH_REASONS)
    if isinstance(reasons, str):
        reasons = [reasons]
    e2e = _float(attrs, VllmAttr.E2E)
    return RequestSpan(
        # Without vLLM's id the span id still names the request uniquely.
        request_id=_str(attrs, VllmAttr.REQUEST_ID) or span_id,
        trace_id=span.trace_id.hex(),
        span_id=span_id,
        parent_span_id=span.parent_span_id.hex() or None,
        start=start,
        end=end,
        e2e=e2e if e2e is not None and e2e >= 0 else end - start,
        ttft=_float(attrs, VllmAttr.TTFT),
        queue=_float(attrs, VllmAttr.QUEUE),
        prefill=_float(attrs, VllmAttr.PREFILL),
        decode=_float(attrs, VllmAttr.DECODE),
        inference=_float(attrs, VllmAttr.INFERENCE),
        scheduler=_float(attrs, VllmAttr.SCHEDULER),
        model_forward=_float(attrs, VllmAttr.MODEL_FORWARD),
        model_execute=_float(attrs, VllmAttr.MODEL_EXECUTE),
        prompt_tokens=_int(attrs, VllmAttr.PROMPT_TOKENS),
        completion_tokens=_int(attrs, VllmAttr.COMPLETION_TOKENS),
        max_tokens=_int(attrs, VllmAttr.MAX_TOKENS),
        n=_int(attrs, VllmAttr.N),
        model=_str(attrs, VllmAttr.RESPONSE_MODEL),
        finish_reasons=tuple(str(r) for r in reasons) if isinstance(reasons, list) else (),
    )
