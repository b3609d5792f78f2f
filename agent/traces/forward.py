"""Forwarding received spans to the collector at --otlp-endpoint.

Receivers and the request worker hand spans over with a non-blocking put into
a bounded queue; one worker drains it in batches (and empties it on stop) and sends them with the
OpenTelemetry SDK's own OTLP span exporter (gRPC, or HTTP/protobuf as the SDKs
choose from OTEL_EXPORTER_OTLP_PROTOCOL). Protobuf spans become SDK
ReadableSpans with their trace id, span id, parent, kind, status, events and
links kept, so the collector sees the original span plus, for requests, the
`slatrace.*` attributes. A batch the exporter could not send (after its own
retries) is counted as dropped; a full queue (by count or by bytes) drops
and counts at once.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Mapping, Sequence
from urllib.parse import urlparse

from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from agent.export.otlp_settings import HTTP_PROTOBUF, resolve_settings
from agent.traces.metrics import TraceCounters
from agent.traces.pipeline import SpanSink
from agent.traces.spans import attributes
from agent.workers import Worker, WorkerHandle

__all__ = ["Forwarder", "make_exporter", "to_readable_span"]

log = logging.getLogger(__name__)

_KINDS = {1: SpanKind.INTERNAL, 2: SpanKind.SERVER, 3: SpanKind.CLIENT, 4: SpanKind.PRODUCER, 5: SpanKind.CONSUMER}
_STATUS = {0: StatusCode.UNSET, 1: StatusCode.OK, 2: StatusCode.ERROR}
_SPAN_OVERHEAD = 512  # bytes a queued span costs beside its protobuf size


def make_exporter(endpoint: str, protocol: str | None = None,
                  environ: Mapping[str, str] | None = None) -> SpanExporter:
    """The SDK's OTLP span exporter for `endpoint`, resolved as the metrics
    exporter resolves its own (agent/export/otlp_settings.py, the TRACES
    signal): --otlp-protocol, then OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, then
    OTEL_EXPORTER_OTLP_PROTOCOL; the /v1/traces path for HTTP; the TRACES
    endpoint and timeout variables. Headers, compression and TLS files the
    exporter reads from the standard variables itself."""
    settings = resolve_settings(endpoint, protocol, environ, signal="TRACES")
    if settings.protocol == HTTP_PROTOBUF:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter  # noqa: PLC0415
        return HttpExporter(endpoint=settings.endpoint, timeout=settings.timeout_s)
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter  # noqa: PLC0415
    parsed = urlparse(settings.endpoint if "://" in settings.endpoint else "http://" + settings.endpoint)
    return GrpcExporter(endpoint=parsed.netloc, insecure=parsed.scheme != "https", timeout=settings.timeout_s)


def _context(trace_id: bytes, span_id: bytes, flags: int = 0, state: str = "") -> SpanContext:
    return SpanContext(
        trace_id=int.from_bytes(trace_id, "big") if trace_id else 0,
        span_id=int.from_bytes(span_id, "big") if span_id else 0,
        is_remote=False,
        trace_flags=TraceFlags(flags & 0xFF),
        trace_state=TraceState.from_header([state]) if state else TraceState(),
    )


def to_readable_span(rs: ResourceSpans, ss: ScopeSpans, span: Span, extra: dict | None = None,
                     resource: Resource | None = None) -> ReadableSpan:
    attrs = attributes(span.attributes)
    if extra:
        attrs.update(extra)
    return ReadableSpan(
        name=span.name,
        context=_context(span.trace_id, span.span_id, span.flags, span.trace_state),
        parent=_context(span.trace_id, span.parent_span_id) if span.parent_span_id else None,
        resource=resource or Resource(attributes(rs.resource.attributes), rs.schema_url),
        attributes=attrs,
        events=[Event(e.name, attributes(e.attributes), e.time_unix_nano) for e in span.events],
        links=[Link(_context(link.trace_id, link.span_id, link.flags, link.trace_state), attributes(link.attributes))
               for link in span.links],
        kind=_KINDS.get(span.kind, SpanKind.INTERNAL),
        status=Status(_STATUS.get(span.status.code, StatusCode.UNSET), span.status.message or None),
        start_time=span.start_time_unix_nano,
        end_time=span.end_time_unix_nano,
        instrumentation_scope=InstrumentationScope(ss.scope.name, ss.scope.version or None, ss.schema_url or None,
                                                   attributes(ss.scope.attributes) or None),
    )


class Forwarder(SpanSink):
    def __init__(self, exporter: SpanExporter, counters: TraceCounters, *, max_queue: int = 20_000,
                 max_bytes: int = 64 << 20, max_batch: int = 512, flush_s: float = 0.2) -> None:
        self._exporter = exporter
        self._counters = counters
        self._queue: queue.Queue = queue.Queue(max_queue)
        self.max_bytes = max_bytes  # of queued spans (protobuf size), so a few huge spans cannot fill memory
        self._bytes = 0
        self._bytes_lock = threading.Lock()
        self.max_batch = max_batch
        self.flush_s = flush_s
        self.worker = Worker.loop("otlp-forward", "forwarding spans to the collector", self._run)

    def forward(self, resource_spans: ResourceSpans, scope_spans: ScopeSpans, span: Span,
                extra: dict | None = None) -> None:
        size = span.ByteSize() + _SPAN_OVERHEAD
        with self._bytes_lock:
            if self._bytes + size > self.max_bytes:
                self._counters.add_forward_dropped("queue_full", 1)
                return
            self._bytes += size
        try:
            self._queue.put_nowait((resource_spans, scope_spans, span, extra, size))
        except queue.Full:
            self._release(size)
            self._counters.add_forward_dropped("queue_full", 1)

    def _release(self, size: int) -> None:
        with self._bytes_lock:
            self._bytes -= size

    @property
    def queued_bytes(self) -> int:
        return self._bytes

    def start(self) -> None:
        self.worker.start()

    def _run(self, handle: WorkerHandle) -> None:
        """Until stopped and the queue is empty: what was queued is still sent on stop."""
        while not (handle.stopping and self._queue.empty()):
            batch = self._take()
            if batch:
                try:
                    if self.send([entry[:4] for entry in batch]):
                        handle.succeeded()
                finally:
                    self._release(sum(entry[4] for entry in batch))

    def _take(self) -> list[tuple]:
        try:
            batch = [self._queue.get(timeout=self.flush_s)]
        except queue.Empty:
            return []
        while len(batch) < self.max_batch:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return batch

    def send(self, batch: Sequence[tuple]) -> bool:
        """Export one batch; True when sent, else its spans are counted as dropped."""
        resources: dict[int, Resource] = {}
        spans = []
        for rs, ss, span, extra in batch:
            res = resources.get(id(rs))
            if res is None:
                res = resources[id(rs)] = Resource(attributes(rs.resource.attributes), rs.schema_url)
            spans.append(to_readable_span(rs, ss, span, extra, res))
        try:
            # The SDK's exporter retries a retryable failure (UNAVAILABLE, 429,
            # 503, ...) with backoff itself, within its timeout.
            result = self._exporter.export(spans)
        except Exception:  # an exporter bug or a transport error it did not catch
            log.exception("forwarding spans failed")
            result = SpanExportResult.FAILURE
        if result == SpanExportResult.SUCCESS:
            self._counters.add_forwarded(len(spans))
            return True
        log.warning("dropping %d spans: the collector did not take them (the exporter's retries included)",
                    len(spans))
        self._counters.add_forward_dropped("export_failed", len(spans))
        return False

    def stop(self, timeout: float = 5.0) -> None:
        self.worker.stop(timeout)
        try:
            self._exporter.shutdown()
        except Exception:
            log.exception("shutting the span exporter down failed")
