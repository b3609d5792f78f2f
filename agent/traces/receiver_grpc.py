"""OTLP/gRPC trace receiver: opentelemetry-proto's TraceService on grpcio.

The servicer is registered with a pass-through request deserializer so that a
body that is not a valid ExportTraceServiceRequest answers INVALID_ARGUMENT with
the reason (grpcio's own deserialization failure would be an opaque INTERNAL).
grpcio enforces its message size limit (RESOURCE_EXHAUSTED) after it has
inflated a compressed message, so a gzip bomb stops there too; that limit is
set above the agent's own, which the handler checks so that every refusal up
to GRPC_MAX_MESSAGE is counted.
"""

from __future__ import annotations

import logging
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from agent.traces.identity import Peer, parse_grpc_peer
from agent.traces.metrics import TraceCounters
from agent.traces.otlp_decode import DecodeError, Limits, decode_protobuf
from agent.traces.pipeline import Overloaded, RequestPipeline

__all__ = ["GrpcReceiver", "TraceServiceHandler"]

log = logging.getLogger(__name__)

SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
GRPC_MAX_MESSAGE = 64 << 20


class TraceServiceHandler(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, pipeline: RequestPipeline, counters: TraceCounters, limits: Limits) -> None:
        self._pipeline = pipeline
        self._counters = counters
        self._limits = limits
        self.local_port: int | None = None  # the port served, once bound: half of each connection's key

    def Export(self, request: bytes, context: grpc.ServicerContext) -> ExportTraceServiceResponse:  # noqa: N802
        try:
            if len(request) > self._limits.max_body_bytes:
                raise DecodeError(413, f"the message has {len(request)} bytes, more than the limit of "
                                       f"{self._limits.max_body_bytes}; send smaller batches")
            req = decode_protobuf(request, self._limits)
        except DecodeError as e:
            self._counters.add_rejected("grpc", "too_large" if e.status == 413 else "malformed")
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if e.status == 413 else grpc.StatusCode.INVALID_ARGUMENT
            context.abort(code, e.reason)
        try:
            addr = parse_grpc_peer(context.peer())
            peer = Peer(addr[0], addr[1], None, self.local_port) if addr else None
            self._pipeline.ingest(req, "grpc", peer)
        except Overloaded as e:
            self._counters.add_rejected("grpc", "overloaded")
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))  # retryable for OTLP exporters
        except Exception:
            log.exception("ingesting an OTLP/gRPC export failed")
            self._counters.add_rejected("grpc", "internal")
            context.abort(grpc.StatusCode.INTERNAL, "the agent failed to ingest the spans; see its log")
        return ExportTraceServiceResponse()


class GrpcReceiver:
    def __init__(self, host: str, port: int, pipeline: RequestPipeline, counters: TraceCounters,
                 limits: Limits = Limits(), workers: int = 4) -> None:
        handler = TraceServiceHandler(pipeline, counters, limits)
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="otlp-grpc"),
            # grpcio's own refusal of a larger message is not seen (nor counted) by the
            # handler: let messages up to GRPC_MAX_MESSAGE through to be judged there.
            options=[("grpc.max_receive_message_length", max(limits.max_body_bytes, GRPC_MAX_MESSAGE)),
                     ("grpc.so_reuseport", 0)],
        )
        rpc = grpc.unary_unary_rpc_method_handler(
            handler.Export,
            request_deserializer=None,  # raw bytes: decoded (and judged) by the handler
            response_serializer=ExportTraceServiceResponse.SerializeToString,
        )
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Export": rpc}),))
        try:
            self.port = self._server.add_insecure_port(f"{host}:{port}" if ":" not in host else f"[{host}]:{port}")
        except RuntimeError as e:
            raise OSError(f"cannot listen on {host}:{port} ({e})") from None
        if self.port == 0:  # grpcio reports a failed bind as port 0
            raise OSError(f"cannot listen on {host}:{port}: the address is in use or not local")
        handler.local_port = self.port

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        self._server.stop(grace=1.0).wait(2.0)
