"""The trace side of the daemon, assembled: receivers -> pipeline -> store,
API routes, counters and (with --otlp-endpoint) the forwarder. The daemon
exposes the counters (`counters`, `engines`) through agent/export/traces.py.

The daemon builds one `Traces` after the probe is attached (the pipeline needs
the cgroup map and the scheduler source) and closes it on shutdown.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from agent.attribution.request_sched import RequestSchedSource
from agent.config import Config
from agent.reload import ConfigSubscribers
from agent.store.histogram import classic_bounds
from agent.identity.cgroups import CgroupPaths
from agent.identity.kubernetes import PodIndex
from agent.traces.api import request_routes
from agent.traces.engines import EngineScraper, engine_routes, engine_window
from agent.traces.identity import SpanServices, ThisHost
from agent.traces.metrics import TraceCounters
from agent.traces.otlp_decode import Limits
from agent.traces.pipeline import RequestPipeline
from agent.traces.pipeline import NEVER_WATCHED
from agent.traces.request_store import RequestStore
from agent.traces.servers import RequestRules, ServerProcesses
from agent.transport.access import WebAccess
from agent.transport.server import parse_listen
from agent.workers import Worker

__all__ = ["Traces", "parse_listen_or_off"]

log = logging.getLogger(__name__)

# How often /proc is searched for inference servers to stream from the start.
SERVER_SCAN_S = 2.0


def parse_listen_or_off(value: str | None, flag: str) -> tuple[str, int] | None:
    if value is None or value.strip().lower() == "off":
        return None
    return parse_listen(value, flag)


class Traces:
    def __init__(
        self,
        config: Config,
        sched: RequestSchedSource,
        cgroups: CgroupPaths,
        service_of: Callable[[int], str],
        known_services: Callable[[], Iterable[str]],
        *,
        grpc_listen: str | None,
        http_listen: str | None,
        otlp_endpoint: str | None = None,
        otlp_protocol: str | None = None,
        limits: Limits = Limits(),
        pods: PodIndex | None = None,
        access: WebAccess | None = None,
        subscribers: ConfigSubscribers | None = None,
        cpu_limits: Callable[[str], Sequence[Any]] = lambda service: (),
    ) -> None:
        self.counters = TraceCounters(bounds=classic_bounds(config.buckets_per_octave))
        self.store = RequestStore(config.retention, on_evict=self.counters.add_store_evicted)
        self.forwarder = None
        if otlp_endpoint:
            from agent.traces.forward import Forwarder, make_exporter  # noqa: PLC0415

            self.forwarder = Forwarder(make_exporter(otlp_endpoint, otlp_protocol), self.counters)
        spans = config.request_spans
        self.span_services = SpanServices(cgroups, service_of, known_services, pods=pods,
                                          relays=config.otlp_relays, host=ThisHost.read())
        self.pipeline = RequestPipeline(
            sched, self.span_services, config.slos, self.store, self.counters,
            self.forwarder, max_wait_s=max(10.0, 5 * config.interval), rules=RequestRules(spans.servers, spans.rules),
            cpu_limits=cpu_limits)
        if subscribers is not None:  # a reload's SLOs judge requests finished from then on; relays trusted at once
            subscribers.subscribe("slos", self.pipeline.set_slos)
            subscribers.subscribe("otlp_relays", self.span_services.set_relays)
        self._sched = sched
        self.servers = ServerProcesses(cgroups, service_of, spans.servers, spans.watch)
        # The engines found by the scan serve their own latency histograms: read beside ours.
        configured = {e.service: e.url for e in config.engines}
        self.engines = EngineScraper(lambda: {**self.servers.engines, **configured}, retention_s=config.retention)
        self._scan = Worker.periodic("request-servers", "looking for inference servers", self.pin_servers,
                                     SERVER_SCAN_S, first_now=False)
        self._grpc_addr = parse_listen_or_off(grpc_listen, "--otlp-grpc-listen")
        self._http_addr = parse_listen_or_off(http_listen, "--otlp-http-listen")
        self._limits = limits
        self._access = access
        self.grpc = None
        self.http = None

    def routes(self) -> dict:
        return {**request_routes(self.store, self.counters, lambda: self.span_services.relays),
                **engine_routes(self.engines, self.store)}

    def engines_since(self, since_s: float, service: str | None = None) -> list[dict]:
        """The engines' own figures over the last `since_s` seconds, beside their requests' delay."""
        return engine_window(self.engines, self.store, since_s, service)

    def start(self) -> None:
        """Bind and serve; OSError when an address cannot be bound."""
        if self.forwarder is not None:
            self.forwarder.start()
        self.pin_servers()
        self._scan.start()
        self.engines.start()
        self.pipeline.start()
        if self._grpc_addr is not None:
            from agent.traces.receiver_grpc import GrpcReceiver  # noqa: PLC0415  (loads grpc: only when asked)

            self.grpc = GrpcReceiver(*self._grpc_addr, self.pipeline, self.counters, self._limits,
                                     access=self._access)
            self.grpc.start()
            log.info("OTLP/gRPC trace receiver on %s:%d%s", self._grpc_addr[0], self.grpc.port,
                     " (TLS)" if self.grpc.tls else "")
        if self._http_addr is not None:
            from agent.traces.receiver_http import HttpReceiver  # noqa: PLC0415

            try:
                self.http = HttpReceiver(*self._http_addr, self.pipeline, self.counters, self._limits,
                                         access=self._access)
            except OSError as e:
                raise OSError(f"cannot listen on {self._http_addr[0]}:{self._http_addr[1]} ({e.strerror})") from None
            self.http.start()
            log.info("OTLP/HTTP trace receiver on %s://%s:%d/v1/traces", self.http.scheme, self._http_addr[0],
                     self.http.port)

    def pin_servers(self) -> None:
        """Stream the services running a known inference server (or named in
        the config) from now on, before their first span arrives."""
        self._sched.pin(self.servers.services() - NEVER_WATCHED)

    def close(self) -> None:
        self._scan.stop(2.0)
        self.engines.shutdown()
        for part in (self.grpc, self.http):
            if part is not None:
                part.stop()
        self.grpc = self.http = None
        self.pipeline.stop()
        self.pipeline.process()  # what is covered by now still gets its figures
        if self.forwarder is not None:
            self.forwarder.stop()
