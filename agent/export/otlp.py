"""OTLP metrics export: the figures of /metrics, pushed to an OpenTelemetry collector.

The data are the metric families of the very registry /metrics serves,
translated point for point (agent/export/otlp_translate.py) into the SDK's
MetricsData, which the SDK's OTLP exporter (gRPC or HTTP/protobuf) sends;
where and how is agent/export/otlp_settings.py. Reading the registry keeps
both exports identical by construction, whatever is added to it later.

Export runs on its own worker, one request at a time, each bounded by a timeout; a failed request is
dropped and counted, never queued, so a dead collector costs neither the poll
loop's time nor memory.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.metrics_core import Metric as PromMetric
from prometheus_client.registry import Collector, CollectorRegistry
from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricExportResult,
    MetricsData,
)
from opentelemetry.sdk.resources import OTELResourceDetector, Resource

from agent import __version__
from agent.export.catalog import OTLP_EXPORT
from agent.export.figures import Family, read_points
from agent.export.otlp_settings import (
    GRPC,
    ExportSettings,
    resolve_settings,
)
from agent.export.otlp_translate import build_metrics_data, store_start_ns
from agent.export.prometheus import declared, to_metric
from agent.store.store import Store
from agent.workers import Worker

log = logging.getLogger("slatrace.otlp")

# At most one log line per this many seconds while the collector stays down.
FAILURE_LOG_PERIOD_S = 60.0


_RATE_LIMIT_KEYS = 64

# The loggers through which the SDK's exporters report each failed attempt.
_SDK_EXPORTER_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
    "opentelemetry.exporter.otlp.proto.http._common",
)


def build_resource(environ: Mapping[str, str] | None = None) -> Resource:
    """service.name=slatrace, host.name, k8s.node.name (from NODE_NAME); what
    OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME say wins over these defaults."""
    env = os.environ if environ is None else environ
    attrs: dict[str, str] = {
        "service.name": "slatrace",
        "service.version": __version__,
        "host.name": socket.gethostname(),
    }
    if env.get("NODE_NAME"):
        attrs["k8s.node.name"] = env["NODE_NAME"]
    # The SDK's detector reads os.environ itself; it parses and percent-decodes
    # OTEL_RESOURCE_ATTRIBUTES and applies OTEL_SERVICE_NAME over it.
    attrs.update(OTELResourceDetector().detect().attributes)
    return Resource.create(attrs)


def make_exporter(settings: ExportSettings) -> MetricExporter:
    """The SDK's OTLP exporter for the protocol. Headers, compression, TLS
    certificates and OTEL_EXPORTER_OTLP_INSECURE are read by the exporter itself
    from the standard variables (metrics-specific first)."""
    if settings.protocol == GRPC:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (  # noqa: PLC0415 (loads grpc)
            OTLPMetricExporter as GrpcExporter,
        )
        return GrpcExporter(endpoint=settings.endpoint, timeout=settings.timeout_s)
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import (  # noqa: PLC0415
        OTLPMetricExporter as HttpExporter,
    )
    return HttpExporter(endpoint=settings.endpoint, timeout=settings.timeout_s)


class _RateLimitFilter(logging.Filter):
    """Lets one record per message template through per period: a collector that
    stays down must not fill the log with one error per attempt."""

    def __init__(self, period_s: float) -> None:
        super().__init__()
        self._period_s = period_s
        self._last: dict[tuple[str, object], float] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, record.msg)
        now = time.monotonic()
        with self._lock:
            if len(self._last) > _RATE_LIMIT_KEYS:
                # Templates are few; many keys mean preformatted messages, which
                # must not grow this map without bound.
                self._last.clear()
            last = self._last.get(key)
            if last is not None and now - last < self._period_s:
                return False
            self._last[key] = now
        return True


@dataclass
class ExportStats:
    exports: int = 0          # requests the collector accepted
    failures: int = 0         # requests dropped after the exporter gave up
    dropped_points: int = 0   # data points in those requests
    last_success: float = 0.0  # Unix seconds


class OtlpMetricsExporter:
    """Pushes the registry's figures over OTLP every interval, on its own thread."""

    def __init__(self, registry: CollectorRegistry, store: Store, settings: ExportSettings,
                 resource: Resource | None = None, exporter: MetricExporter | None = None) -> None:
        self.settings = settings
        self.stats = ExportStats()
        self._registry = registry
        self._store = store
        self._resource = resource if resource is not None else build_resource()
        self._exporter = exporter if exporter is not None else make_exporter(settings)
        # No final export on stop: with the collector down it would hold shutdown
        # for a whole timeout, and the next start exports again anyway.
        self.worker = Worker.periodic("otlp-metrics", "exporting OTLP metrics", self.export_once,
                                      settings.interval_s, first_now=False, on_stop=self._abort_export)
        self._start_ns: int | None = None
        self._lock = threading.Lock()
        self._failing_since_log = 0.0
        self._log_filter = _RateLimitFilter(FAILURE_LOG_PERIOD_S)

    @classmethod
    def from_options(cls, registry: CollectorRegistry, store: Store, endpoint: str,
                     protocol: str | None = None) -> "OtlpMetricsExporter":
        """From --otlp-endpoint/--otlp-protocol and the standard variables;
        OtlpConfigError (or the SDK's ValueError) on an unusable setting."""
        return cls(registry, store, resolve_settings(endpoint, protocol))

    def collector(self) -> Collector:
        """A Prometheus collector for the export's own health, for /metrics."""
        return _ExportStatsCollector(self)

    def start(self) -> None:
        for name in _SDK_EXPORTER_LOGGERS:
            logging.getLogger(name).addFilter(self._log_filter)
        self.worker.start()
        log.info("exporting OTLP metrics (%s) to %s every %.3g s", self.settings.protocol,
                 self.settings.endpoint, self.settings.interval_s)

    def stop(self) -> None:
        """Stop without a final export."""
        self.worker.stop(self.settings.timeout_s + 1.0)
        for name in _SDK_EXPORTER_LOGGERS:
            logging.getLogger(name).removeFilter(self._log_filter)

    def _abort_export(self) -> None:
        """Aborts the exporter's retry back-off if an export is in flight."""
        try:
            self._exporter.shutdown(timeout_millis=1000)
        except Exception:
            log.exception("shutting down the OTLP metrics exporter failed")

    def export_once(self) -> bool | None:
        """One export; True when accepted, False when dropped, None when there
        is nothing to send yet. Never raises: the thread must keep going."""
        data: MetricsData | None = None
        error: Exception | None = None
        try:
            if self._start_ns is None and self._store.latest() is not None:
                self._start_ns = store_start_ns(self._store)
            data = build_metrics_data(self._registry, self._store, self._resource, self._start_ns)
            if data is None:
                return None
            ok = self._exporter.export(data, timeout_millis=self.settings.timeout_s * 1000) \
                is MetricExportResult.SUCCESS
        except Exception as e:  # noqa: BLE001  (a bug in building or sending must not end the export thread)
            ok, error = False, e
        self._record(ok, data, error)
        return ok

    def _record(self, ok: bool, data: MetricsData | None, error: Exception | None) -> None:
        recovered = should_log = False
        with self._lock:
            if ok:
                recovered = bool(self._failing_since_log)
                self.stats.exports += 1
                self.stats.last_success = time.time()
                self._failing_since_log = 0.0
            else:
                self.stats.failures += 1
                self.stats.dropped_points += _count_points(data) if data is not None else 0
                now = time.monotonic()
                should_log = not self._failing_since_log or now - self._failing_since_log >= FAILURE_LOG_PERIOD_S
                if should_log:
                    self._failing_since_log = now
        if recovered:
            log.info("OTLP metrics export to %s works again", self.settings.endpoint)
        elif not ok and should_log:
            log.warning("OTLP metrics export to %s failed%s; the figures are dropped and sent whole at the "
                        "next interval (%d failed so far)", self.settings.endpoint,
                        f" ({error})" if error else "", self.stats.failures, exc_info=error)


def _count_points(data: MetricsData) -> int:
    return sum(len(m.data.data_points) for rm in data.resource_metrics
               for sm in rm.scope_metrics for m in sm.metrics)


class _ExportStatsCollector(Collector):
    def __init__(self, exporter: OtlpMetricsExporter) -> None:
        self._exporter = exporter

    def collect(self) -> Iterable[PromMetric]:
        return [to_metric(Family(spec, read_points(spec, self._exporter))) for spec in OTLP_EXPORT]

    def describe(self) -> Iterable[PromMetric]:
        return [declared(spec) for spec in OTLP_EXPORT]
