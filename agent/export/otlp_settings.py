"""Where and how the agent exports over OTLP, one signal at a time: the
metrics exporter (agent/export/otlp.py) and the trace forwarder
(agent/traces/forward.py) read --otlp-endpoint, --otlp-protocol and the
standard OTEL_EXPORTER_OTLP_* variables through this one resolver, in the
SDKs' order (signal-specific first), with one sentence for a bad value."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from agent.errors import SlatraceError

GRPC = "grpc"
HTTP_PROTOBUF = "http/protobuf"
PROTOCOLS = (GRPC, HTTP_PROTOBUF)
# Defaults of the OpenTelemetry specification (environment variables section).
DEFAULT_EXPORT_INTERVAL_S = 60.0
DEFAULT_EXPORTER_TIMEOUT_S = 10.0
# OTLP/HTTP paths appended to a base endpoint, per signal.
SIGNAL_PATHS = {"METRICS": "/v1/metrics", "TRACES": "/v1/traces"}


class OtlpConfigError(SlatraceError, ValueError):
    """One sentence for the operator about an unusable OTLP setting."""


@dataclass(frozen=True)
class ExportSettings:
    protocol: str       # GRPC or HTTP_PROTOBUF
    endpoint: str       # what the exporter connects to (gRPC target or full HTTP URL)
    interval_s: float   # between the end of one export and the start of the next
    timeout_s: float    # bound on one export, retries included


def resolve_protocol(flag: str | None, signal: str = "METRICS",
                     environ: Mapping[str, str] | None = None) -> str:
    """--otlp-protocol, else OTEL_EXPORTER_OTLP_<SIGNAL>_PROTOCOL, else
    OTEL_EXPORTER_OTLP_PROTOCOL, else grpc: the SDKs' order (signal-specific first)."""
    env = os.environ if environ is None else environ
    for source, value in (("--otlp-protocol", flag),
                          (f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL", env.get(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL")),
                          ("OTEL_EXPORTER_OTLP_PROTOCOL", env.get("OTEL_EXPORTER_OTLP_PROTOCOL"))):
        if value:
            value = value.strip().lower()
            if value not in PROTOCOLS:
                raise OtlpConfigError(f"{source}={value} is not supported; use one of {', '.join(PROTOCOLS)}")
            return value
    return GRPC


def _positive_float(environ: Mapping[str, str], name: str, scale: float = 1.0) -> float | None:
    raw = environ.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        value = float(raw) * scale
    except ValueError:
        raise OtlpConfigError(f"{name}={raw!r} is not a number") from None
    if not value > 0 or math.isinf(value):
        raise OtlpConfigError(f"{name}={raw!r} must be a positive number")
    return value


def resolve_settings(endpoint: str, protocol: str | None = None,
                     environ: Mapping[str, str] | None = None, signal: str = "METRICS") -> ExportSettings:
    """Where and how often to export one signal (METRICS or TRACES), from
    --otlp-endpoint and the standard variables.

    The endpoint is a base URL, like OTEL_EXPORTER_OTLP_ENDPOINT: HTTP gets
    /v1/metrics or /v1/traces appended (and needs http:// or https://), gRPC
    uses it as is. OTEL_EXPORTER_OTLP_<SIGNAL>_ENDPOINT, when set, is used as is
    and wins, as signal-specific settings do in the SDKs. Timeouts:
    OTEL_EXPORTER_OTLP_<SIGNAL>_TIMEOUT, else OTEL_EXPORTER_OTLP_TIMEOUT
    (seconds, as the Python SDK reads them), else 10 s; for metrics capped by
    OTEL_METRIC_EXPORT_TIMEOUT (ms). Interval (metrics): OTEL_METRIC_EXPORT_INTERVAL
    (ms), else 60 s.
    """
    if signal not in SIGNAL_PATHS:
        raise ValueError(f"unknown OTLP signal {signal!r}")
    env = os.environ if environ is None else environ
    proto = resolve_protocol(protocol, signal, env)
    signal_endpoint = (env.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT") or "").strip()
    if signal_endpoint:
        target = signal_endpoint
    else:
        base = endpoint.strip()
        if not base:
            raise OtlpConfigError("the OTLP endpoint is empty; give --otlp-endpoint a URL such as "
                                  "http://collector:4317")
        target = base.rstrip("/") + SIGNAL_PATHS[signal] if proto == HTTP_PROTOBUF else base
    if proto == HTTP_PROTOBUF and not target.startswith(("http://", "https://")):
        raise OtlpConfigError(f"OTLP/HTTP endpoint {target!r} must start with http:// or https://")
    timeout = (_positive_float(env, f"OTEL_EXPORTER_OTLP_{signal}_TIMEOUT")
               or _positive_float(env, "OTEL_EXPORTER_OTLP_TIMEOUT") or DEFAULT_EXPORTER_TIMEOUT_S)
    interval = DEFAULT_EXPORT_INTERVAL_S
    if signal == "METRICS":
        cap = _positive_float(env, "OTEL_METRIC_EXPORT_TIMEOUT", 1e-3)
        if cap is not None:
            timeout = min(timeout, cap)
        interval = _positive_float(env, "OTEL_METRIC_EXPORT_INTERVAL", 1e-3) or DEFAULT_EXPORT_INTERVAL_S
    return ExportSettings(protocol=proto, endpoint=target, interval_s=interval, timeout_s=timeout)
