"""OTLP/gRPC trace receiver: opentelemetry-proto's TraceService on grpcio.

The servicer is registered with a pass-through request deserializer so that a
body that is not a valid ExportTraceServiceRequest answers INVALID_ARGUMENT with
the reason (grpcio's own deserialization failure would be an opaque INTERNAL).
grpcio enforces its message size limit (RESOURCE_EXHAUSTED) after it has
inflated a compressed message, so a gzip bomb stops there too; that limit is
set above the agent's own, which the handler checks so that every refusal up
to GRPC_MAX_MESSAGE is counted.

Export is served as a stream-unary method (the same frames on the wire as the
exporters' unary call): the handler then runs as soon as the call starts and
reads the one message itself, so a message grpcio refuses (above
GRPC_MAX_MESSAGE) or a client that cancels before sending reaches the handler
as a broken stream and is counted too, rather than vanishing inside grpcio.
The worker pool is bounded and so is the queue in front of it
(maximum_concurrent_rpcs): past it grpcio answers RESOURCE_EXHAUSTED at once,
which OTLP exporters retry, instead of queueing calls without end; those
refusals are counted by an interceptor.

With a web configuration, the port serves TLS from its tls_server_config
(grpcio asks for the certificate again at each new handshake, so a rotated
one serves the next connection; RequireAndVerifyClientCert makes it demand
and verify a client certificate) and, when it has users, each call must carry
`authorization: Basic ...` metadata (UNAUTHENTICATED otherwise), checked on
the worker that serves the call. grpcio's Python API has no TLS version or
cipher settings: min_version, max_version and cipher_suites apply to the HTTP
servers only, and a reload cannot turn client certificates on or off here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from agent.traces.identity import Peer, parse_grpc_peer
from agent.traces.metrics import TraceCounters
from agent.traces.otlp_decode import DecodeError, Limits, decode_protobuf
from agent.traces.pipeline import Overloaded, RequestPipeline
from agent.transport.access import WebAccess

__all__ = ["GrpcReceiver", "TraceServiceHandler"]

log = logging.getLogger(__name__)

SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
GRPC_MAX_MESSAGE = 64 << 20


class TraceServiceHandler(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, pipeline: RequestPipeline, counters: TraceCounters, limits: Limits,
                 access: WebAccess | None = None) -> None:
        self._pipeline = pipeline
        self._counters = counters
        self._limits = limits
        self._access = access
        self.local_port: int | None = None  # the port served, once bound: half of each connection's key

    def Export(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> ExportTraceServiceResponse:  # noqa: N802
        self._check_credentials(context)
        try:
            request = next(requests, None)
        except grpc.RpcError:
            request = None
        if request is None:
            # grpcio refused the message (larger than its limit; the stream then
            # ends or is cancelled, whichever it sees first) or the client sent
            # none: the call is over already, or this ends it.
            self._counters.add_rejected("grpc", "not_received")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no ExportTraceServiceRequest message arrived")
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

    def _check_credentials(self, context: grpc.ServicerContext) -> None:
        access = self._access
        if access is None or not access.auth.required:
            return
        header = next((str(v) for k, v in context.invocation_metadata() if k == "authorization"), None)
        if not access.auth.verify(header):
            self._counters.add_rejected("grpc", "unauthorized")
            said = "missing" if header is None else "wrong"
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          f"credentials {said}: send 'authorization: Basic ...' metadata")


def server_credentials(access: WebAccess) -> grpc.ServerCredentials:
    """TLS from the web configuration, asked for again at each handshake: a
    reloaded certificate serves the next connection."""
    served = [access.generation]

    def configuration(tls):
        return grpc.ssl_server_certificate_configuration([(tls.key_pem, tls.cert_pem)],
                                                         root_certificates=tls.ca_pem)

    def fetch():
        if access.generation == served[0]:
            return None  # unchanged
        served[0] = access.generation
        return configuration(access.config.tls)

    tls = access.config.tls
    return grpc.dynamic_ssl_server_credentials(configuration(tls), fetch,
                                               require_client_authentication=tls.requires_client_cert)


def _say_what_grpc_ignores(access: WebAccess) -> None:
    tls = access.config.tls
    ignored = [k for k, v in (("min_version", tls.min_version != "TLS12"), ("max_version", tls.max_version),
                              ("cipher_suites", tls.cipher_suites)) if v]
    if tls.client_auth_type == "VerifyClientCertIfGiven":
        ignored.append("client_auth_type VerifyClientCertIfGiven (no certificate is asked for)")
    if ignored:
        log.warning("the OTLP/gRPC receiver cannot apply %s of %s: grpcio has no such setting; the HTTP servers do",
                    ", ".join(ignored), access.path)


class _CountQueueFull(grpc.ServerInterceptor):
    """Counts the calls grpcio turns away because maximum_concurrent_rpcs
    calls are already running or queued. grpcio decides that under its server
    lock just before it asks the interceptors, and refuses without calling a
    handler; the interceptor, under the same lock, reads the same two numbers
    from the server's state. grpcio has no public hook for this: if a later
    grpcio renames them, nothing is counted (tests/unit/test_receivers.py
    fails on the pinned version rather than silently)."""

    def __init__(self, counters: TraceCounters) -> None:
        self._counters = counters
        self.server: grpc.Server | None = None

    def intercept_service(self, continuation, handler_call_details):
        state = getattr(self.server, "_state", None)
        limit = getattr(state, "maximum_concurrent_rpcs", None)
        if limit is not None and getattr(state, "active_rpc_count", 0) >= limit:
            self._counters.add_rejected("grpc", "queue_full")
        return continuation(handler_call_details)


class GrpcReceiver:
    def __init__(self, host: str, port: int, pipeline: RequestPipeline, counters: TraceCounters,
                 limits: Limits = Limits(), workers: int = 4, max_queued: int = 64,
                 access: WebAccess | None = None) -> None:
        handler = TraceServiceHandler(pipeline, counters, limits, access)
        queue_full = _CountQueueFull(counters)
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="otlp-grpc"),
            # grpcio's own refusal of a larger message reaches the handler only as a
            # broken stream: let messages up to GRPC_MAX_MESSAGE through to be judged there.
            options=[("grpc.max_receive_message_length", max(limits.max_body_bytes, GRPC_MAX_MESSAGE)),
                     ("grpc.so_reuseport", 0)],
            # Calls running or waiting for a worker; beyond, RESOURCE_EXHAUSTED at once.
            maximum_concurrent_rpcs=workers + max_queued,
            interceptors=(queue_full,),
        )
        queue_full.server = self._server
        rpc = grpc.stream_unary_rpc_method_handler(
            handler.Export,
            request_deserializer=None,  # raw bytes: decoded (and judged) by the handler
            response_serializer=ExportTraceServiceResponse.SerializeToString,
        )
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Export": rpc}),))
        address = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
        self.tls = access is not None and access.config.tls is not None
        try:
            if self.tls:
                _say_what_grpc_ignores(access)
                self.port = self._server.add_secure_port(address, server_credentials(access))
            else:
                self.port = self._server.add_insecure_port(address)
        except RuntimeError as e:
            raise OSError(f"cannot listen on {host}:{port} ({e})") from None
        if self.port == 0:  # grpcio reports a failed bind as port 0
            raise OSError(f"cannot listen on {host}:{port}: the address is in use or not local")
        handler.local_port = self.port

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        self._server.stop(grace=1.0).wait(2.0)
