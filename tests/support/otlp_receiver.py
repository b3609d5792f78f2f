"""A real OTLP receiver for tests: metrics and traces, over gRPC and HTTP/protobuf.

The gRPC side is `opentelemetry-proto`'s generated service stubs on a grpcio
server; the HTTP side is a stdlib HTTP server that parses the protobuf
Export*ServiceRequest bodies the SDK's HTTP exporters post to /v1/metrics and
/v1/traces. Both listen on free loopback ports, keep every request they got (in
arrival order, with the headers it came with) and can be told to reject
requests, so tests can check what an exporter sent and how it copes with a
failing peer.

    with OtlpReceiver() as rx:
        ... point an exporter at rx.grpc_endpoint or rx.http_endpoint ...
        got = rx.wait_for_metrics(1)
        for name, point, resource in metric_points(got[-1].request): ...
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Generic, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from agent.traces.spans import attributes

ExportMetricsServiceRequest = metrics_service_pb2.ExportMetricsServiceRequest
ExportTraceServiceRequest = trace_service_pb2.ExportTraceServiceRequest

M = TypeVar("M", bound=Message)

METRICS_PATH = "/v1/metrics"
TRACES_PATH = "/v1/traces"
PROTOBUF = "application/x-protobuf"


@dataclass(frozen=True)
class Received(Generic[M]):
    """One export request as it arrived."""

    transport: str               # "grpc" or "http"
    request: M                   # the parsed Export*ServiceRequest
    headers: dict[str, str]      # gRPC metadata or HTTP headers, keys lower-cased
    received_at: float           # time.monotonic() on arrival


@dataclass
class _Inbox(Generic[M]):
    """Requests of one signal, appended by server threads, read by the test."""

    cond: threading.Condition = field(default_factory=threading.Condition)
    items: list[Received[M]] = field(default_factory=list)

    def add(self, item: Received[M]) -> None:
        with self.cond:
            self.items.append(item)
            self.cond.notify_all()

    def snapshot(self) -> list[Received[M]]:
        with self.cond:
            return list(self.items)

    def wait(self, predicate: Callable[[list[Received[M]]], bool], timeout: float) -> list[Received[M]]:
        with self.cond:
            if not self.cond.wait_for(lambda: predicate(self.items), timeout):
                raise TimeoutError(f"OTLP receiver: condition not met within {timeout} s "
                                   f"({len(self.items)} requests so far)")
            return list(self.items)

    def clear(self) -> None:
        with self.cond:
            self.items.clear()


class _MetricsServicer(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, rx: "OtlpReceiver") -> None:
        self._rx = rx

    def Export(self, request, context):  # noqa: N802 (generated interface)
        self._rx._on_grpc(self._rx._metrics, request, context)
        return metrics_service_pb2.ExportMetricsServiceResponse()


class _TraceServicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, rx: "OtlpReceiver") -> None:
        self._rx = rx

    def Export(self, request, context):  # noqa: N802 (generated interface)
        self._rx._on_grpc(self._rx._traces, request, context)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """OTLP metrics + traces receiver on 127.0.0.1; gRPC and HTTP each optional.

    `reject_with` makes every request fail until reset: a grpc.StatusCode for
    gRPC (HTTP answers the matching status, 503 for UNAVAILABLE, else 400).
    Rejected requests are not recorded, as a real collector would not keep them.
    """

    def __init__(self, grpc_enabled: bool = True, http_enabled: bool = True, host: str = "127.0.0.1") -> None:
        self.host = host
        self._grpc_enabled = grpc_enabled
        self._http_enabled = http_enabled
        self._metrics: _Inbox[Any] = _Inbox()
        self._traces: _Inbox[Any] = _Inbox()
        self._grpc_server: grpc.Server | None = None
        self._http_server: ThreadingHTTPServer | None = None
        self._http_thread: threading.Thread | None = None
        self.grpc_port = 0
        self.http_port = 0
        self.reject_with: grpc.StatusCode | None = None

    # Life cycle.

    def start(self) -> "OtlpReceiver":
        if self._grpc_enabled:
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
            metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_MetricsServicer(self), server)
            trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceServicer(self), server)
            self.grpc_port = server.add_insecure_port(f"{self.host}:0")
            if not self.grpc_port:
                raise OSError(f"cannot bind a gRPC port on {self.host}")
            server.start()
            self._grpc_server = server
        if self._http_enabled:
            self._http_server = ThreadingHTTPServer((self.host, 0), _handler_for(self))
            self._http_server.daemon_threads = True
            self.http_port = self._http_server.server_address[1]
            self._http_thread = threading.Thread(target=self._http_server.serve_forever,
                                                 name="otlp-receiver-http", daemon=True)
            self._http_thread.start()
        return self

    def stop(self) -> None:
        """Close both ports; requests in flight get at most a second to finish."""
        if self._grpc_server is not None:
            self._grpc_server.stop(grace=1.0).wait(5.0)
            self._grpc_server = None
        if self._http_server is not None:
            self._http_server.shutdown()
            self._http_server.server_close()
            self._http_server = None
        if self._http_thread is not None:
            self._http_thread.join(5.0)
            self._http_thread = None

    def __enter__(self) -> "OtlpReceiver":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # Where exporters should send (base URLs, as OTEL_EXPORTER_OTLP_ENDPOINT takes them).

    @property
    def grpc_endpoint(self) -> str:
        if not self.grpc_port:
            raise RuntimeError("the gRPC side is not running")
        return f"http://{self.host}:{self.grpc_port}"

    @property
    def http_endpoint(self) -> str:
        if not self.http_port:
            raise RuntimeError("the HTTP side is not running")
        return f"http://{self.host}:{self.http_port}"

    # What arrived.

    @property
    def metrics(self) -> list[Received[ExportMetricsServiceRequest]]:
        return self._metrics.snapshot()

    @property
    def traces(self) -> list[Received[ExportTraceServiceRequest]]:
        return self._traces.snapshot()

    def wait_for_metrics(self, count: int = 1, timeout: float = 10.0,
                         predicate: Callable[[list[Received[ExportMetricsServiceRequest]]], bool] | None = None,
                         ) -> list[Received[ExportMetricsServiceRequest]]:
        """All metrics requests, once at least `count` arrived (and predicate holds)."""
        return self._metrics.wait(lambda xs: len(xs) >= count and (predicate is None or predicate(xs)), timeout)

    def wait_for_traces(self, count: int = 1, timeout: float = 10.0,
                        predicate: Callable[[list[Received[ExportTraceServiceRequest]]], bool] | None = None,
                        ) -> list[Received[ExportTraceServiceRequest]]:
        """All trace requests, once at least `count` arrived (and predicate holds)."""
        return self._traces.wait(lambda xs: len(xs) >= count and (predicate is None or predicate(xs)), timeout)

    def clear(self) -> None:
        self._metrics.clear()
        self._traces.clear()

    # Server callbacks.

    def _on_grpc(self, inbox: _Inbox[Any], request: Message, context: grpc.ServicerContext) -> None:
        code = self.reject_with
        if code is not None:
            context.abort(code, "rejected by the test receiver")
        headers = {k.lower(): v if isinstance(v, str) else v.decode(errors="replace")
                   for k, v in context.invocation_metadata()}
        inbox.add(Received("grpc", request, headers, time.monotonic()))


def _http_status(code: grpc.StatusCode) -> int:
    # OTLP/HTTP: 503 (and 429, 502, 504) are retryable, other 4xx are not.
    return {grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.RESOURCE_EXHAUSTED: 429}.get(code, 400)


def _decompress(body: bytes, encoding: str) -> bytes:
    if encoding == "gzip":
        return gzip.decompress(body)
    if encoding == "deflate":
        return zlib.decompress(body)
    return body


def _handler_for(rx: OtlpReceiver) -> type[BaseHTTPRequestHandler]:
    routes: dict[str, tuple[_Inbox[Any], type[Message], type[Message]]] = {
        METRICS_PATH: (rx._metrics, ExportMetricsServiceRequest, metrics_service_pb2.ExportMetricsServiceResponse),
        TRACES_PATH: (rx._traces, ExportTraceServiceRequest, trace_service_pb2.ExportTraceServiceResponse),
    }

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the SDK's requests session expects

        def do_POST(self) -> None:  # noqa: N802 (http.server interface)
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length)
            route = routes.get(self.path.split("?", 1)[0])
            if route is None:
                return self._reply(404, b"", "text/plain")
            inbox, request_type, response_type = route
            if rx.reject_with is not None:
                return self._reply(_http_status(rx.reject_with), b"rejected by the test receiver", "text/plain")
            if self.headers.get("Content-Type", "").split(";")[0].strip() != PROTOBUF:
                return self._reply(415, b"only application/x-protobuf is accepted", "text/plain")
            try:
                request = request_type.FromString(
                    _decompress(body, self.headers.get("Content-Encoding", "").strip().lower()))
            except (DecodeError, OSError, zlib.error) as e:
                return self._reply(400, f"cannot parse the body: {e}".encode(), "text/plain")
            headers = {k.lower(): v for k, v in self.headers.items()}
            inbox.add(Received("http", request, headers, time.monotonic()))
            self._reply(200, response_type().SerializeToString(), PROTOBUF)

        def _reply(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass  # test output stays readable; the inbox is the record

    return Handler


# Reading what arrived.



@dataclass(frozen=True)
class MetricPoint:
    """One data point of one metric, flattened with where it came from."""

    name: str
    kind: str                    # "sum", "gauge", "histogram", ...: the Metric oneof
    unit: str
    point: Any                   # NumberDataPoint, HistogramDataPoint, ...
    attributes: dict[str, Any]   # the point's attributes
    resource: dict[str, Any]     # the resource's attributes
    scope: str
    temporality: int | None      # AggregationTemporality for sums and histograms
    monotonic: bool | None       # for sums


def metric_points(request: ExportMetricsServiceRequest) -> Iterator[MetricPoint]:
    for rm in request.resource_metrics:
        resource = attributes(rm.resource.attributes)
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                kind = m.WhichOneof("data")
                if kind is None:
                    continue  # a metric with no data: nothing to flatten
                data = getattr(m, kind)
                temporality = getattr(data, "aggregation_temporality", None)
                monotonic = getattr(data, "is_monotonic", None)
                for p in data.data_points:
                    yield MetricPoint(m.name, kind, m.unit, p, attributes(p.attributes), resource,
                                      sm.scope.name, temporality, monotonic)


def number_value(point: Any) -> float | int:
    """A NumberDataPoint's value, whichever of as_int / as_double it carries."""
    return getattr(point, point.WhichOneof("value"))
