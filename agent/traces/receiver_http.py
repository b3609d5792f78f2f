"""OTLP/HTTP trace receiver: `POST /v1/traces`, protobuf or JSON, gzip or not.

Its own server on its own port, as the OTLP defaults have it (4318 next to the
API's 9477). The size limit is checked against Content-Length before a byte of
the body is read; a refused request gets a google.rpc.Status in the request's
own encoding with the reason, as the OTLP/HTTP spec asks.
"""

from __future__ import annotations

import json
import logging

from google.protobuf import json_format
from google.rpc.status_pb2 import Status
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from agent.transport.access import WebAccess
from agent.transport.response import Response
from agent.transport.server import BackgroundHTTPServer, HttpApp, Request, ServerLimits
from agent.traces.identity import Peer
from agent.traces.metrics import TraceCounters
from agent.traces.otlp_decode import DecodeError, Limits, decode_body
from agent.traces.pipeline import Overloaded, RequestPipeline

__all__ = ["HttpReceiver", "OtlpHttpApp", "TRACES_PATH"]

log = logging.getLogger(__name__)

TRACES_PATH = "/v1/traces"
DRAIN_LIMIT = 64 << 20  # bytes of an oversized body read (and dropped) before answering 413
_REASONS = {400: "malformed", 401: "unauthorized", 411: "no_length", 413: "too_large", 415: "unsupported",
            503: "overloaded"}
_GRPC_CODES = {400: 3, 401: 16, 411: 3, 413: 8, 415: 3, 404: 5, 405: 12, 500: 13, 503: 14}  # google.rpc.Code


class OtlpHttpApp(HttpApp):
    """`POST /v1/traces`. The head is judged on the event loop (path, length);
    the body is decoded and ingested on a worker. `req.peer` / `req.local` name
    the connection the spans came in on."""

    drain_bytes = DRAIN_LIMIT

    def __init__(self, pipeline: RequestPipeline, counters: TraceCounters, limits: Limits) -> None:
        self.pipeline = pipeline
        self.counters = counters
        self.limits = limits
        self.max_body_bytes = limits.max_body_bytes

    def check_head(self, req: Request) -> Response | None:
        wants_json = _wants_json(req)
        if req.method != "POST":
            return _status(405, f"only POST {TRACES_PATH} is served here", True,
                           headers=(("Allow", "POST"),))
        if req.path != TRACES_PATH:
            return _status(404, f"no such endpoint {req.path}; OTLP traces go to POST {TRACES_PATH}", wants_json)
        size = req.content_length()
        if size is None:
            return self._refuse(411, "a Content-Length header is required", wants_json, close=True)
        if size > self.limits.max_body_bytes:
            # The server reads and discards a moderately oversized body so the
            # client, still sending, gets the 413 rather than a broken pipe; a
            # huge one is not worth the bandwidth and the connection is closed on it.
            return self._refuse(413, f"the body has {size} bytes, more than the limit of "
                                     f"{self.limits.max_body_bytes}; send smaller batches", wants_json, close=True)
        return None

    def unauthorized(self, req: Request, message: str) -> Response:
        return self._refuse(401, message, _wants_json(req))

    def handle(self, req: Request) -> Response:
        wants_json = _wants_json(req)
        try:
            decoded, is_json = decode_body(req.body, req.header("Content-Type"), req.header("Content-Encoding"),
                                           self.limits)
        except DecodeError as e:
            return self._refuse(e.status, e.reason, wants_json)
        try:
            # The sender is whoever holds the other end of this connection.
            peer = Peer(str(req.peer[0]), int(req.peer[1]), str(req.local[0]), int(req.local[1]))
            self.pipeline.ingest(decoded, "http", peer)
        except Overloaded as e:
            resp = self._refuse(503, str(e), wants_json)
            return Response(resp.status, resp.body, resp.content_type, headers=(("Retry-After", "1"),))
        except Exception:
            log.exception("ingesting an OTLP/HTTP export failed")
            return self._refuse(500, "the agent failed to ingest the spans; see its log", wants_json)
        resp = ExportTraceServiceResponse()
        if is_json:
            return Response(200, json_format.MessageToJson(resp).encode(), "application/json")
        return Response(200, resp.SerializeToString(), "application/x-protobuf")

    def _refuse(self, status: int, reason: str, wants_json: bool, close: bool = False) -> Response:
        self.counters.add_rejected("http", _REASONS.get(status, "internal"))
        return _status(status, reason, wants_json, close=close)


def _wants_json(req: Request) -> bool:
    return (req.header("Content-Type") or "").lower().startswith("application/json")


def _status(status: int, reason: str, wants_json: bool, close: bool = False,
            headers: tuple[tuple[str, str], ...] = ()) -> Response:
    """A refusal as a google.rpc.Status in the request's own encoding."""
    msg = Status(code=_GRPC_CODES.get(status, 2), message=reason)
    if wants_json:
        return Response(status, json.dumps({"code": msg.code, "message": reason}).encode(), "application/json",
                        headers=headers, close=close)
    return Response(status, msg.SerializeToString(), "application/x-protobuf", headers=headers, close=close)


class HttpReceiver(BackgroundHTTPServer):
    def __init__(self, host: str, port: int, pipeline: RequestPipeline, counters: TraceCounters,
                 limits: Limits = Limits(), server_limits: ServerLimits = ServerLimits(),
                 access: WebAccess | None = None) -> None:
        super().__init__(host, port, OtlpHttpApp(pipeline, counters, limits), "otlp-http", server_limits, access)
