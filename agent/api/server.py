"""A threaded HTTP server over Api.handle (stdlib http.server)."""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from agent.api.routes import Api, error

log = logging.getLogger(__name__)


class ListenError(Exception):
    pass


def parse_listen(value: str, flag: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"{flag} {value!r} is not HOST:PORT (for example 127.0.0.1:9477)")
    return host.strip("[]") or "0.0.0.0", int(port)


def make_handler(api: Api) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "slatrace"
        protocol_version = "HTTP/1.1"

        def _serve(self, head_only: bool) -> None:
            try:
                resp = api.handle("GET", self.path)
            except Exception:  # a bug must cost one request, not the server
                log.exception("error serving %s", self.path)
                resp = error(500, "internal error; see the agent's log")
            self.send_response(resp.status)
            self.send_header("Content-Type", resp.content_type)
            self.send_header("Content-Length", str(len(resp.body)))
            self.end_headers()
            if not head_only:
                self.wfile.write(resp.body)

        def do_GET(self) -> None:  # noqa: N802
            self._serve(False)

        def do_HEAD(self) -> None:  # noqa: N802
            self._serve(True)

        def log_message(self, fmt: str, *args) -> None:
            log.debug("%s %s", self.address_string(), fmt % args)

    return Handler


class BackgroundHTTPServer:
    """A ThreadingHTTPServer on its own daemon thread: start(), stop(), port."""

    def __init__(self, host: str, port: int, handler: type[BaseHTTPRequestHandler], name: str) -> None:
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name=name, daemon=True)

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class HttpServer(BackgroundHTTPServer):
    """The agent's API, /metrics and probes."""

    def __init__(self, host: str, port: int, api: Api) -> None:
        try:
            super().__init__(host, port, make_handler(api), "http")
        except OSError as e:
            raise ListenError(f"cannot listen on {host}:{port} ({e.strerror}): is another slatrace running? "
                              "choose another address with --listen") from None
