"""The HTTP servers' families: written once for every server that feeds them,
and a second writer of a family refused when it registers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics

from agent.transport.server import ServerStats
from agent.export.prometheus import Registry, SlatraceCollector
from agent.export.servers import ServerCollector
from agent.store.store import Store
from agent.export.traces import TraceCollector
from agent.traces.metrics import TraceCounters


def server(name: str, **counts: int) -> SimpleNamespace:
    return SimpleNamespace(name=name, stats=ServerStats(**counts))


def test_two_servers_write_one_family_each() -> None:
    registry = Registry()
    servers = ServerCollector(server("http", accepted=5, served=4, open=1))
    registry.register(servers)
    servers.add(server("otlp-http", accepted=7, malformed=2))
    text = registry.exposition().decode()
    assert text.count("# TYPE slatrace_http_connections_total counter") == 1
    assert text.count("# TYPE slatrace_http_connections_open gauge") == 1
    assert 'slatrace_http_connections_total{outcome="accepted",server="http"} 5.0' in text
    assert 'slatrace_http_connections_total{outcome="malformed",server="otlp-http"} 2.0' in text
    assert 'slatrace_http_connections_open{server="otlp-http"} 0.0' in text
    # The strict parser refuses a family written twice ("clashing name").
    families = {f.name: f for f in parse_openmetrics(registry.exposition(openmetrics=True).decode())}
    assert {s.labels["server"] for s in families["slatrace_http_connections"].samples} == {"http", "otlp-http"}
    assert len(families["slatrace_http_connections"].samples) == 2 * (1 + len(ServerStats.OUTCOMES))


def test_a_second_collector_of_a_family_is_refused_when_it_registers() -> None:
    registry = Registry()
    registry.register(SlatraceCollector(Store(900)))
    registry.register(TraceCollector(TraceCounters()))
    registry.register(ServerCollector())
    with pytest.raises(ValueError, match="slatrace_http_connections"):
        registry.register(ServerCollector(server("otlp-http")))
    with pytest.raises(ValueError, match="slatrace_otlp_spans_received"):
        registry.register(TraceCollector(TraceCounters()))


def test_a_server_name_is_counted_once() -> None:
    servers = ServerCollector(server("http"))
    with pytest.raises(ValueError, match="'http' is already counted"):
        servers.add(server("http"))


def test_no_server_no_family() -> None:
    registry = Registry()
    registry.register(ServerCollector())
    assert registry.exposition() == b""
    assert registry.exposition(openmetrics=True) == b"# EOF\n"
