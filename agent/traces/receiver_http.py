"""OTLP/HTTP trace receiver: `POST /v1/traces`, protobuf or JSON, gzip or not.

Its own server on its own port, as the OTLP defaults have it (4318 next to the
API's 9477). The size limit is checked against Content-Length before a byte of
the body is read; a refused request gets a google.rpc.Status in the request's
own encoding with the reason, as the OTLP/HTTP spec asks.
"""

from __future__ import annotations

import json
import logging
from http.server import BaseHTTPRequestHandler

from google.protobuf import json_format
from google.rpc.status_pb2 import Status
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from agent.api.server import BackgroundHTTPServer
from agent.traces.identity import Peer
from agent.traces.metrics import TraceCounters
from agent.traces.otlp_decode import DecodeError, Limits, decode_body
from agent.traces.pipeline import RequestPipeline

__all__ = ["HttpReceiver", "TRACES_PATH"]

log = logging.getLogger(__name__)

TRACES_PATH = "/v1/traces"
DRAIN_LIMIT = 64 << 20  # bytes of an oversized body read (and dropped) before answering 413
_REASONS = {400: "malformed", 411: "no_length", 413: "too_large", 415: "unsupported"}
_GRPC_CODES = {400: 3, 411: 3, 413: 8, 415: 3, 404: 5, 405: 12, 500: 13}  # google.rpc.Code


def _make_handler(pipeline: RequestPipeline, counters: TraceCounters, limits: Limits) -> type:
    class Handler(BaseHTTPRequestHandler):
        server_version = "slatrace-otlp"
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802
            wants_json = (self.headers.get("Content-Type") or "").lower().startswith("application/json")
            if self.path.split("?", 1)[0] != TRACES_PATH:
                self._drain_or_close()
                return self._status(404, f"no such endpoint {self.path}; OTLP traces go to POST {TRACES_PATH}",
                                    wants_json)
            length = self.headers.get("Content-Length")
            if length is None or not length.strip().isdigit():
                self.close_connection = True
                return self._refuse(411, "a Content-Length header is required", wants_json)
            size = int(length)
            if size > limits.max_body_bytes:
                # Read and discard a moderately oversized body so the client, still
                # sending, gets the 413 rather than a broken pipe; a huge one is not
                # worth the bandwidth and the connection is closed on it.
                if size <= DRAIN_LIMIT:
                    self._discard(size)
                self.close_connection = True
                return self._refuse(413, f"the body has {size} bytes, more than the limit of "
                                         f"{limits.max_body_bytes}; send smaller batches", wants_json)
            body = self.rfile.read(size)
            try:
                req, is_json = decode_body(body, self.headers.get("Content-Type"),
                                           self.headers.get("Content-Encoding"), limits)
            except DecodeError as e:
                return self._refuse(e.status, e.reason, wants_json)
            try:
                pipeline.ingest(req, "http", self._peer())
            except Exception:
                log.exception("ingesting an OTLP/HTTP export failed")
                return self._refuse(500, "the agent failed to ingest the spans; see its log", wants_json)
            resp = ExportTraceServiceResponse()
            if is_json:
                self._send(200, json_format.MessageToJson(resp).encode(), "application/json")
            else:
                self._send(200, resp.SerializeToString(), "application/x-protobuf")

        def _peer(self) -> Peer | None:
            # The sender is whoever holds the other end of this connection.
            try:
                host, port = self.client_address[:2]
                local_host, local_port = self.connection.getsockname()[:2]
            except (OSError, TypeError, ValueError):
                return None
            return Peer(str(host), int(port), str(local_host), int(local_port))

        def do_GET(self) -> None:  # noqa: N802
            self._status(405, f"only POST {TRACES_PATH} is served here", True)

        def _discard(self, size: int) -> None:
            while size > 0:
                chunk = self.rfile.read(min(size, 1 << 16))
                if not chunk:
                    return
                size -= len(chunk)

        def _drain_or_close(self) -> None:
            length = self.headers.get("Content-Length")
            if length and length.isdigit() and int(length) <= limits.max_body_bytes:
                self.rfile.read(int(length))
            else:
                self.close_connection = True

        def _refuse(self, status: int, reason: str, wants_json: bool) -> None:
            counters.add_rejected("http", _REASONS.get(status, "internal"))
            self._status(status, reason, wants_json)

        def _status(self, status: int, reason: str, wants_json: bool) -> None:
            msg = Status(code=_GRPC_CODES.get(status, 2), message=reason)
            if wants_json:
                self._send(status, json.dumps({"code": msg.code, "message": reason}).encode(), "application/json")
            else:
                self._send(status, msg.SerializeToString(), "application/x-protobuf")

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args) -> None:
            log.debug("%s %s", self.address_string(), fmt % args)

    return Handler


class HttpReceiver(BackgroundHTTPServer):
    def __init__(self, host: str, port: int, pipeline: RequestPipeline, counters: TraceCounters,
                 limits: Limits = Limits()) -> None:
        super().__init__(host, port, _make_handler(pipeline, counters, limits), "otlp-http")
