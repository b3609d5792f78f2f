"""The API's app on the transport: the JSON API, /metrics and the probes."""

from __future__ import annotations

from agent.api.routes import Api
from agent.transport.access import WebAccess
from agent.transport.response import Response
from agent.transport.server import BackgroundHTTPServer, HttpApp, ListenError, Request, ServerLimits

__all__ = ["ApiApp", "HttpServer", "PROBES"]

# Kubernetes' kubelet asks these without credentials (it cannot send a client
# certificate or a password it does not hold): they answer only ok / ready /
# why not, so they are served to anyone who completes the TLS handshake.
PROBES = ("/livez", "/readyz")


class ApiApp(HttpApp):
    """The JSON API, /metrics and the probes: GET and HEAD only."""

    def __init__(self, api: Api) -> None:
        self.api = api

    def check_head(self, req: Request) -> Response | None:
        if req.method not in ("GET", "HEAD"):
            resp = self.api.handle(req.method, req.target)
            return Response(resp.status, resp.body, resp.content_type, headers=(("Allow", "GET, HEAD"),))
        return None

    def handle(self, req: Request) -> Response:
        return self.api.handle("GET", req.target, req.headers)

    def inline(self, req: Request) -> bool:
        return req.path in PROBES

    def public(self, req: Request) -> bool:
        return req.path in PROBES


class HttpServer(BackgroundHTTPServer):
    """The agent's API, /metrics and probes."""

    def __init__(self, host: str, port: int, api: Api, limits: ServerLimits = ServerLimits(),
                 access: WebAccess | None = None) -> None:
        try:
            super().__init__(host, port, ApiApp(api), "http", limits, access)
        except OSError as e:
            raise ListenError(f"cannot listen on {host}:{port} ({e.strerror}): is another slatrace running? "
                              "choose another address with --listen") from None
