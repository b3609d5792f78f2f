"""The HTTP servers' own families (declared in agent/export/catalog.py): one
collector, whatever number of servers feed it.

The API server and the OTLP/HTTP receiver run the same server code and count the
same outcomes; their figures are one family each, told apart by the `server`
label. Two collectors writing the same family would put its HELP/TYPE block
twice in /metrics, which the exposition format forbids (promtool and the
OpenMetrics parsers reject the whole scrape), so the daemon keeps one
ServerCollector and adds each server to it as the server starts.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Protocol

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from agent.export.catalog import HTTP_CONNECTIONS, HTTP_CONNECTIONS_OPEN, SERVERS, WEB_CONFIG_OK, WEB_CONFIG_RELOADS
from agent.export.figures import Family, Point
from agent.export.prometheus import declared, to_metric

__all__ = ["ServerCollector"]


class _Stats(Protocol):
    OUTCOMES: tuple[str, ...]
    accepted: int
    open: int


class _Server(Protocol):
    name: str
    stats: _Stats


class _Access(Protocol):
    reloads: int
    failures: int
    last_ok: bool


class ServerCollector(Collector):
    """`slatrace_http_connections_total{server, outcome}` and the open count
    of every server added: each connection a server ended early is counted."""

    def __init__(self, *servers: _Server) -> None:
        self._lock = threading.Lock()
        self._servers: list[_Server] = []
        self._access: _Access | None = None
        for server in servers:
            self.add(server)

    def add(self, server: _Server) -> None:
        """Count one more server; its name must be new (it is the `server` label)."""
        with self._lock:
            if any(s.name == server.name for s in self._servers):
                raise ValueError(f"a server named {server.name!r} is already counted")
            self._servers.append(server)

    def watch_access(self, access: _Access) -> None:
        """Count the reloads of the web configuration the servers use."""
        self._access = access

    def families(self) -> tuple[Family, ...]:
        with self._lock:
            servers = list(self._servers)
        total: list[Point] = []
        opened: list[Point] = []
        for srv in servers:
            st = srv.stats
            total.append(Point((srv.name, "accepted"), st.accepted))
            total += [Point((srv.name, outcome), getattr(st, outcome)) for outcome in st.OUTCOMES]
            opened.append(Point((srv.name,), st.open))
        out = (Family(HTTP_CONNECTIONS, tuple(total)), Family(HTTP_CONNECTIONS_OPEN, tuple(opened)))
        access = self._access
        if access is not None:
            out += (Family(WEB_CONFIG_RELOADS, (Point(("success",), access.reloads),
                                                Point(("failure",), access.failures))),
                    Family(WEB_CONFIG_OK, (Point((), 1.0 if access.last_ok else 0.0),)))
        return out

    def collect(self) -> Iterator[Metric]:
        for family in self.families():
            if family.points:   # no HELP/TYPE block without samples, as SlatraceCollector
                yield to_metric(family)

    def describe(self) -> Iterator[Metric]:
        # Names only: a second collector of these families is refused at registration.
        for spec in SERVERS:
            yield declared(spec)
