"""The HTTP API as a pure function of the agent's state: (method, path, query)
-> Response. The server module only moves bytes; tests call this directly."""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Callable, Mapping
from urllib.parse import parse_qs

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as CONTENT_TYPE_OPENMETRICS
from prometheus_client.openmetrics.exposition import generate_latest as om_generate_latest
from prometheus_client.registry import CollectorRegistry

from agent.attribution.attribution import attribution
from agent.config import Config
from agent.store.store import Store
from agent.transport.response import (  # noqa: F401  (the API's helpers, re-exported)
    QueryError, Response, error, finite_only, float_param, json_response, str_param)

DEFAULT_SINCE_S = 60.0
# What /metrics answers with: the text format 0.0.4 unless the scraper asks for OpenMetrics.
CONTENT_TYPE_TEXT = CONTENT_TYPE_PLAIN_0_0_4


def wants_openmetrics(accept: str) -> bool:
    """Whether a scraper's Accept header asks for OpenMetrics (Prometheus asks
    for it first by default); anything else gets the 0.0.4 text format."""
    for item in accept.split(","):
        media, *params = (p.strip() for p in item.split(";"))
        if media.lower() != "application/openmetrics-text":
            continue
        q = next((p[2:] for p in params if p.lower().startswith("q=")), "1")
        version = next((p[8:] for p in params if p.lower().startswith("version=")), "1.0.0")
        try:
            if float(q) > 0 and version.split(".")[0] in ("0", "1"):
                return True
        except ValueError:
            continue
    return False


@dataclass
class AgentState:
    """What the API reads. `ready` flips once the programs are attached and
    one interval has been collected; `failure` is set when collection stops;
    `workers_down` names the background workers that should run and do not."""

    config: Config
    store: Store
    registry: CollectorRegistry
    describe_services: Callable[[], list[dict]]
    ready: bool = False
    failure: str | None = None
    # Set while the self-check finds waits lost between the kernel and the
    # agent (agent/store/tally.py): the figures are incomplete, so not ready.
    degraded: str | None = None
    extra_routes: dict[str, Callable[[dict[str, list[str]]], Response]] = field(default_factory=dict)
    # (start, end] -> per-service throttled seconds / per-(service, slo) breached intervals
    throttled_between: Callable[[float, float], dict[str, float]] | None = None
    breaches_between: Callable[[float, float], dict[tuple[str, str], int]] | None = None
    # (since seconds, service or None) -> the inference engines' own figures, one entry per service
    engines_since: Callable[[float, str | None], list[dict]] | None = None
    workers_down: Callable[[], list[str]] | None = None


class Api:
    def __init__(self, state: AgentState) -> None:
        self.state = state
        self._routes: dict[str, Callable[[dict[str, list[str]]], Response]] = {
            "/livez": self._livez,
            "/readyz": self._readyz,
            "/api/v1/services": self._services,
            "/api/v1/attribution": self._attribution,
        }

    def handle(self, method: str, target: str, headers: Mapping[str, str] | None = None) -> Response:
        """headers: the request's, names in lower case (only /metrics reads one, Accept)."""
        path, _, qs = target.partition("?")
        if method not in ("GET", "HEAD"):
            return error(405, f"{method} is not allowed on {path}; the API is read-only (GET)")
        if path.rstrip("/") == "/metrics":
            return self._metrics((headers or {}).get("accept", ""))
        route = self._routes.get(path.rstrip("/") or "/") or self.state.extra_routes.get(path)
        if route is None:
            for prefix, handler in self.state.extra_routes.items():
                if prefix.endswith("/") and path.startswith(prefix):
                    return handler({"_tail": [path[len(prefix):]], **parse_qs(qs)})
            return error(404, f"no such endpoint {path}; see /api/v1/services, /api/v1/attribution, /metrics")
        try:
            query = parse_qs(qs, strict_parsing=False)
            return route(query)
        except QueryError as e:
            return error(400, str(e))

    def _failing(self) -> str | None:
        """Why a restart is wanted: collections failing, or workers dead for good."""
        said = [self.state.failure] if self.state.failure else []
        down = self.state.workers_down() if self.state.workers_down is not None else []
        if down:
            said.append("workers not running: " + ", ".join(down))
        return "; ".join(said) or None

    def _livez(self, query) -> Response:
        failing = self._failing()
        if failing:
            return Response(503, f"failing: {failing}\n".encode(), "text/plain")
        return Response(200, b"ok\n", "text/plain")

    def _readyz(self, query) -> Response:
        if self.state.degraded:
            return Response(503, f"not ready: {self.state.degraded}\n".encode(), "text/plain")
        if self.state.ready and not self._failing():
            return Response(200, b"ready\n", "text/plain")
        return Response(503, b"not ready: BPF programs attaching or first interval not collected yet\n",
                        "text/plain")

    def _metrics(self, accept: str) -> Response:
        openmetrics = wants_openmetrics(accept)
        registry = self.state.registry
        # A registry that writes its own exposition (agent.export.prometheus.Registry) is faster at a node's size.
        own = getattr(registry, "exposition", None)
        if own is not None:
            body = own(openmetrics=openmetrics)
        else:
            body = (om_generate_latest if openmetrics else generate_latest)(registry)
        return Response(200, body, CONTENT_TYPE_OPENMETRICS if openmetrics else CONTENT_TYPE_TEXT)

    def _services(self, query) -> Response:
        return json_response(200, {"services": self.state.describe_services()})

    def _attribution(self, query) -> Response:
        since = float_param(query, "since", DEFAULT_SINCE_S)
        service = str_param(query, "service")
        window = self.state.store.window(since, service=service)
        throttled = breaches = None
        if window.intervals:
            if self.state.throttled_between is not None:
                throttled = self.state.throttled_between(window.start, window.end)
            if self.state.breaches_between is not None:
                breaches = self.state.breaches_between(window.start, window.end)
        engines = None
        if self.state.engines_since is not None:
            engines = {e["service"]: e for e in self.state.engines_since(since, service)}
        return json_response(200, attribution(window, self.state.config.slos, service, throttled, breaches, engines))
