"""One request as a sender's span describes it, the input of per-request
attribution. agent/traces decodes it from OTLP; attribution needs only this."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestSpan:
    """One request, times in Unix seconds, durations in seconds."""

    request_id: str
    trace_id: str                 # 32 hex digits
    span_id: str                  # 16 hex digits
    parent_span_id: str | None
    start: float
    end: float
    e2e: float                    # the attribute if present, else end - start
    ttft: float | None = None
    queue: float | None = None
    prefill: float | None = None
    decode: float | None = None
    inference: float | None = None
    scheduler: float | None = None
    model_forward: float | None = None
    model_execute: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    max_tokens: int | None = None
    n: int | None = None
    model: str | None = None
    finish_reasons: tuple[str, ...] = ()

    def phases(self) -> dict[str, float]:
        """The request's phases that vLLM reported, for the timeline."""
        out = {}
        for name in ("queue", "prefill", "decode", "inference", "scheduler", "model_forward", "model_execute"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out
