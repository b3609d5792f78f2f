"""One catalog of metric families: declared once, written only from it.

A family written by two collectors puts its HELP/TYPE block twice in /metrics,
and promtool and the OpenMetrics parsers reject the whole scrape. The catalog
refuses a second declaration when it is imported; the collectors write its
specs and nothing else, which a run of every collector checks against it; and
no module but the catalog builds a family of its own.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from agent.export import catalog
from agent.export.catalog import FAMILIES, Catalog, DuplicateFamily
from agent.export.otlp_translate import family_to_metric
from agent.export.prometheus import Registry
from agent.export.servers import ServerCollector
from agent.export.traces import TraceCollector
from agent.probe.layout import CGROUP_FIELDS
from agent.traces.metrics import TraceCounters

REPO = Path(__file__).resolve().parents[2]
CATALOG_PY = REPO / "agent" / "export" / "catalog.py"


def _generator():
    path = REPO / "scripts" / "gen-metrics-doc.py"
    spec = importlib.util.spec_from_file_location("gen_metrics_doc", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_family_declared_twice_is_refused():
    c = Catalog()
    c.declare("slatrace_x", "counter", "X.", unit="1", source="test")
    with pytest.raises(DuplicateFamily, match="slatrace_x"):
        c.declare("slatrace_x", "gauge", "X again.", unit="1", source="test")
    # Nor may a family write a sample name another family writes.
    with pytest.raises(DuplicateFamily, match="slatrace_x_total"):
        c.declare("slatrace_x_total", "gauge", "X's total.", unit="1", source="test")
    c.declare("slatrace_y_seconds", "histogram", "Y.", unit="s", source="test")
    with pytest.raises(DuplicateFamily, match="slatrace_y_seconds_count"):
        c.declare("slatrace_y_seconds_count", "gauge", "Y's count.", unit="1", source="test")
    assert [s.name for s in c] == ["slatrace_x", "slatrace_y_seconds"]


def test_a_duplicate_in_the_catalog_fails_its_import(tmp_path, monkeypatch):
    """The catalog module itself with one family declared a second time: the
    import raises, so such a change cannot start the agent or pass a test."""
    copy = tmp_path / "catalog_with_a_duplicate.py"
    copy.write_text(CATALOG_PY.read_text() + (
        '\nAGAIN = declare("slatrace_http_connections", "counter", "Another server\'s connections.",\n'
        '                 ("server", "outcome"), unit="1", source="a second HTTP server")\n'))
    spec = importlib.util.spec_from_file_location(copy.stem, copy)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, copy.stem, module)
    with pytest.raises(ValueError, match="slatrace_http_connections is already written") as raised:
        spec.loader.exec_module(module)
    assert type(raised.value).__name__ == DuplicateFamily.__name__   # the copy's own class


def test_every_family_is_in_one_part_of_the_catalog():
    parts = [catalog.SCHEDULER, catalog.TRACES, catalog.ENGINES, catalog.SERVERS, catalog.OTLP_EXPORT,
             catalog.WORKERS]
    names = [spec.name for part in parts for spec in part]
    assert sorted(names) == sorted(spec.name for spec in FAMILIES)
    for spec in FAMILIES:
        assert spec.name.startswith("slatrace_") and spec.help.endswith(".")
        assert spec.unit in ("s", "1"), spec.name
        assert (spec.unit == "s") == ("_seconds" in spec.name), spec.name


def test_what_feeds_a_family_is_declared_with_it():
    """The collectors that write families without code of their own find what
    feeds each in its entry: a field of the kernel's per-cgroup counters, or a
    reader of its source's figures."""
    for spec in FAMILIES:
        for field, labels in spec.cgroup_fields:
            assert spec.labels[0] == "service", spec.name
            assert field in CGROUP_FIELDS and len(labels) == len(spec.labels) - 1, spec.name
    read = [spec for spec in catalog.SCHEDULER if spec.source == catalog.AGENT_STATS]
    assert read and all(spec.read is not None for spec in (*read, *catalog.TRACES, *catalog.OTLP_EXPORT))


def test_the_collectors_write_exactly_the_catalog():
    """Every collector run with every label filled: each family it writes is
    declared, with the catalog's type, help and labels, and every declared
    family is written by one of them."""
    gen = _generator()
    text = gen.all_scrapes_text()
    written = {}
    for fam in text_string_to_metric_families(text):
        assert fam.name not in written, f"{fam.name} is written twice"
        written[fam.name] = fam
    assert set(written) == {spec.name for spec in FAMILIES}
    for name, fam in written.items():
        spec = FAMILIES[name]
        assert fam.type == spec.type and fam.documentation == spec.help, name
        extra = {"histogram": {"le"}, "summary": {"quantile"}}.get(spec.type, set())
        labels = {k for s in fam.samples for k in s.labels}
        assert labels == set(spec.labels) | extra, name


def test_the_help_on_metrics_is_the_catalogs_in_both_formats():
    counters = TraceCounters()
    counters.add_received("grpc", 1)
    registry = Registry()
    registry.register(TraceCollector(counters))
    registry.register(ServerCollector())
    om = {f.name: f for f in parse_openmetrics(registry.exposition(openmetrics=True).decode())}
    text = {f.name: f for f in text_string_to_metric_families(registry.exposition().decode())}
    for spec in catalog.TRACES:
        assert om[spec.name].documentation == text[spec.name].documentation == spec.help


def test_the_otlp_metrics_carry_the_catalogs_unit_and_help():
    counters = TraceCounters()
    counters.add_received("http", 2)
    counters.add_forwarded(1)
    registry = Registry()
    registry.register(TraceCollector(counters))
    registry.register(ServerCollector())
    metrics = [m for m in (family_to_metric(f, 1, 2) for f in registry.collect()) if m is not None]
    assert {m.name for m in metrics} >= {"slatrace_otlp_spans_received", "slatrace_otlp_forwarded_spans"}
    for m in metrics:
        assert (m.unit, m.description) == (FAMILIES[m.name].unit, FAMILIES[m.name].help)


def test_only_the_catalog_builds_families():
    """A family built by hand elsewhere (a prometheus_client *MetricFamily, a
    MetricSpec) would bypass the duplicate check; prometheus.py turns catalog
    specs into prometheus_client families and is the one other place allowed."""
    allowed = {CATALOG_PY, REPO / "agent" / "export" / "prometheus.py"}
    offenders = []
    for path in sorted((REPO / "agent").rglob("*.py")):
        if path in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
                if name.endswith("MetricFamily") or name == "MetricSpec":
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno} {name}")
    assert not offenders, offenders


def test_a_second_collector_of_a_catalog_family_is_refused_at_registration():
    registry = Registry()
    registry.register(TraceCollector(TraceCounters()))
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        registry.register(TraceCollector(TraceCounters()))
