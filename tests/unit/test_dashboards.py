"""Grafana dashboards: structure, variables, data sources, and that every metric
they query is one the collector really exposes."""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((REPO / "dashboards").glob("*.json"))
DS_REF = "${datasource}"

# PromQL words that look like identifiers but are not metric names.
_PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
                    "unless", "offset", "inf", "nan"}
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (also with Grafana variables in it)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)          # label values, strings
    e = re.sub(r"\{[^}]*\}", "", e)                         # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)                        # range selectors
    e = _GROUPING.sub(" ", e)                               # grouping label lists
    e = re.sub(r"\$\{?\w+\}?", " ", e)                      # Grafana variables
    names = set()
    for m in re.finditer(r"(?<![\w.])([a-zA-Z_:][\w:]*)(\s*\()?", e):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in _PROMQL_KEYWORDS:
            continue
        names.add(word)
    return names


def test_metric_names_parser() -> None:
    expr = ('1e9 * sum by (program) (rate(slatrace_bpf_run_seconds_total{instance=~"$node"}[$__rate_interval]))'
            ' / on (service) group_left () histogram_quantile(0.99, sum by (service, le) '
            '(rate(slatrace_runq_latency_seconds_bucket{service=~"${service}", le="0.5"}[5m]))) or up')
    assert metric_names(expr) == {"slatrace_bpf_run_seconds_total", "slatrace_runq_latency_seconds_bucket", "up"}


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _panels(dash: dict) -> Iterator[dict]:
    for p in dash["panels"]:
        yield p
        yield from p.get("panels", [])   # collapsed rows keep their panels inside


def _targets(dash: dict) -> Iterator[tuple[dict, dict]]:
    for p in _panels(dash):
        for t in p.get("targets", []):
            yield p, t


def _exposed_names() -> tuple[set[str], set[str]]:
    """Sample names and `le` values of a collector run with every hook filled in."""
    path = REPO / "scripts" / "gen-metrics-doc.py"
    spec = importlib.util.spec_from_file_location("gen_metrics_doc", path)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    names, les = set(), set()
    text = gen.scrape_text() + gen.engine_scrape_text()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            names.add(s.name)
            if "le" in s.labels:
                les.add(s.labels["le"])
    return names, les


def test_both_dashboards_exist() -> None:
    assert {p.name for p in DASHBOARDS} >= {"slatrace-overview.json", "slatrace-requests.json"}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_structure_and_variables(path: Path) -> None:
    dash = _load(path)
    assert dash["schemaVersion"] >= 39
    assert dash["uid"] == path.stem
    ids = [p["id"] for p in _panels(dash)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    node = variables["node"]
    assert node["type"] == "query" and node["datasource"]["uid"] == DS_REF
    assert re.search(r"label_values\(.*,\s*(instance|node)\)", node["query"]["query"])
    service = variables["service"]
    assert service["type"] == "query" and service["multi"] is True and service["includeAll"] is True
    assert service["datasource"]["uid"] == DS_REF
    assert "$node" in service["query"]["query"]
    # No hard-coded instances: every instance/node matcher goes through $node.
    text = path.read_text()
    assert not re.search(r'instance=~?\\"(?!\$node)', text)
    for p in _panels(dash):
        if p["type"] == "row":
            continue
        assert p["gridPos"]["w"] <= 24 and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_target_uses_the_datasource_variable(path: Path) -> None:
    dash = _load(path)
    targets = list(_targets(dash))
    assert targets
    for panel, t in targets:
        assert panel["datasource"]["uid"] == DS_REF, panel["title"]
        assert t["datasource"]["uid"] == DS_REF, (panel["title"], t["refId"])
        assert t["datasource"]["type"] == "prometheus"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_panel_has_a_title_a_description_and_the_datasource_variable(path: Path) -> None:
    """Grafana shows the description as the panel's (i) tooltip: it says what
    the panel answers. Every panel queries Prometheus through $datasource, so
    the dashboard imports into any Grafana without a data source UID to fix."""
    for p in _panels(_load(path)):
        assert p.get("title", "").strip(), f"panel {p['id']} of {path.name} has no title"
        if p["type"] == "row":
            continue
        desc = p.get("description", "")
        assert len(desc) >= 40 and desc.rstrip().endswith((".", "?")), \
            f"panel {p['title']!r} of {path.name} needs a description (a sentence or two) of what it answers"
        assert p.get("datasource") == {"type": "prometheus", "uid": DS_REF}, \
            f"panel {p['title']!r} of {path.name} must use the Prometheus data source through {DS_REF}"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_queried_metric_is_exposed(path: Path) -> None:
    exposed, les = _exposed_names()
    dash = _load(path)
    exprs = [t["expr"] for _, t in _targets(dash)]
    for v in dash["templating"]["list"]:
        if isinstance(v.get("query"), dict):
            # label_values(SELECTOR, LABEL): the selector is PromQL, the label is not.
            m = re.fullmatch(r"label_values\((.*),\s*\w+\)", v["query"]["query"])
            exprs.append(m.group(1) if m else v["query"]["query"])
    for expr in exprs:
        names = metric_names(expr)
        assert names, expr
        assert names <= exposed, (names - exposed, expr)
        # `le` matchers must name a real bound, or the series is silently empty.
        for le in re.findall(r'\ble="([^"]+)"', expr):
            assert le in les, (le, expr)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_panel_with_a_service_label_filters_on_node_and_service(path: Path) -> None:
    for panel, t in _targets(_load(path)):
        for selector in re.findall(r"\{([^}]*)\}", t["expr"]):
            assert 'instance=~"$node"' in selector, (panel["title"], t["expr"])


def test_overview_covers_the_questions_it_must_answer() -> None:
    exprs = " ".join(t["expr"] for _, t in _targets(_load(REPO / "dashboards" / "slatrace-overview.json")))
    for needle in ("histogram_quantile(0.5,", "histogram_quantile(0.95,", "histogram_quantile(0.99,",
                   "slatrace_runq_latency_quantile_seconds", "slatrace_preempted_wait_seconds_total",
                   "slatrace_preemptions_total", "slatrace_iowait_seconds", "slatrace_migrations_total",
                   "slatrace_cpu_throttled_seconds_total", "slatrace_slo_ok", "slatrace_slo_breaches_total",
                   "rate(slatrace_bpf_run_seconds_total", "rate(slatrace_bpf_events_total",
                   "slatrace_bpf_map_errors_total"):
        assert needle in exprs, needle
    requests = " ".join(t["expr"] for _, t in _targets(_load(REPO / "dashboards" / "slatrace-requests.json")))
    assert "slatrace_request_sched_delay_seconds_bucket" in requests


# Alert rules: the PrometheusRule is generated from the plain rule file, and
# every alert carries a summary and a runbook link that resolves.

RULES = REPO / "deploy" / "rules" / "slatrace.rules.yaml"


def _github_anchors(markdown: str) -> set[str]:
    anchors = set()
    for m in re.finditer(r"^#+\s+(.+)$", markdown, re.M):
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


def test_prometheus_rule_is_generated_from_the_rule_file() -> None:
    import yaml

    path = REPO / "scripts" / "gen-prometheus-rule.py"
    spec = importlib.util.spec_from_file_location("gen_prometheus_rule", path)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    committed = (REPO / "deploy" / "prometheus-rules.yaml").read_text()
    assert committed == gen.render(RULES.read_text()), "run scripts/gen-prometheus-rule.py"
    doc = yaml.safe_load(committed)
    assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["kind"] == "PrometheusRule"
    assert doc["spec"] == yaml.safe_load(RULES.read_text())


def test_every_alert_has_a_summary_and_a_runbook_section() -> None:
    import yaml

    anchors = _github_anchors((REPO / "docs" / "runbook.md").read_text())
    exposed, _ = _exposed_names()
    groups = yaml.safe_load(RULES.read_text())["groups"]
    records = {r["record"] for g in groups for r in g["rules"] if "record" in r}
    alerts = [r for g in groups for r in g["rules"] if "alert" in r]
    assert {a["alert"] for a in alerts} >= {"SlatraceSLOBreached", "SlatraceSLOBurnRateFast",
                                            "SlatraceNeighbourContention", "SlatraceAgentDown",
                                            "SlatraceBPFMapErrors"}
    runbook = (REPO / "docs" / "runbook.md").read_text()
    sections = dict(re.findall(r"^## (\S+)\n(.*?)(?=^## |\Z)", runbook, re.M | re.S))
    for a in alerts:
        ann = a["annotations"]
        assert ann["summary"], a["alert"]
        page, _, anchor = ann["runbook_url"].partition("#")
        assert page == "docs/runbook.md" and anchor == a["alert"].lower() and anchor in anchors, a["alert"]
        assert a["labels"]["severity"] in ("warning", "critical")
        # The section says what to do: more than a heading.
        assert len(sections.get(a["alert"], "").split()) >= 30, f"docs/runbook.md has no real section for {a['alert']}"
    # And no section for an alert that no longer exists.
    orphans = {h for h in sections if h.startswith("Slatrace")} - {a["alert"] for a in alerts}
    assert not orphans, f"docs/runbook.md has sections for alerts the rules do not define: {orphans}"
    for r in (r for g in groups for r in g["rules"]):
        names = metric_names(r["expr"])
        assert names <= exposed | records | {"up"}, (names - exposed - records, r["expr"])
