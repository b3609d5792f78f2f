"""Grafana dashboards: structure, variables, data sources, and that every metric
they query is one the collector really exposes."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from agent.attribution.causes import CAUSES
from tests.support import require_kernel

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
    text = gen.all_scrapes_text()  # the trace side's families too (request delay by cause)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            names.add(s.name)
            if "le" in s.labels:
                les.add(s.labels["le"])
    return names, les


def test_the_dashboards_exist() -> None:
    assert {p.name for p in DASHBOARDS} >= {"slatrace-overview.json", "slatrace-requests.json",
                                            "slatrace-fleet.json"}


def test_fleet_dashboard_reads_recorded_series_and_drills_down_by_node() -> None:
    fleet = {n for n in _recorded_names() if n.startswith(("service_", "service:"))}
    exprs = [t["expr"] for _, t in _targets(_load(REPO / "dashboards" / "slatrace-fleet.json"))]
    read = set().union(*(metric_names(e) for e in exprs))
    # The fleet figures come from the recorded series, not from every node's raw series again.
    assert {"service_quantile:slatrace_runq_latency_seconds:histogram_quantile5m",
            "service_by_service:slatrace_preempted_wait_seconds:rate5m",
            "service_cause_culprit:slatrace_request_delay_seconds:rate5m",
            "service_slo:slatrace_slo_breach_ratio:rate5m"} <= read & fleet
    raw = [e for e in exprs if not metric_names(e) <= fleet]
    assert raw and all('instance=~"$node"' in e and "instance" in e.split("by (", 1)[-1] for e in raw
                       if "histogram_quantile" in e)


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


def _recorded_names() -> set[str]:
    """Series the recording rules write (deploy/rules/slatrace.rules.yaml): the fleet dashboard reads them."""
    doc = yaml.safe_load((REPO / "deploy" / "rules" / "slatrace.rules.yaml").read_text())
    return {r["record"] for g in doc["groups"] for r in g["rules"] if "record" in r}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_queried_metric_is_exposed(path: Path) -> None:
    exposed, les = _exposed_names()
    exposed |= _recorded_names()
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
    # Series recorded over every node (the fleet rules) have no instance left to filter on.
    fleet = {n for n in _recorded_names() if "instance" not in n.partition(":")[0].split("_")}
    for panel, t in _targets(_load(path)):
        for name, selector in re.findall(r"([\w:]*)\{([^}]*)\}", t["expr"]):
            if name in fleet:
                assert 'service=~"$service"' in selector, (panel["title"], t["expr"])
            else:
                assert 'instance=~"$node"' in selector, (panel["title"], t["expr"])


def test_overview_covers_the_questions_it_must_answer() -> None:
    exprs = " ".join(t["expr"] for _, t in _targets(_load(REPO / "dashboards" / "slatrace-overview.json")))
    for needle in ("histogram_quantile(0.5,", "histogram_quantile(0.95,", "histogram_quantile(0.99,",
                   "slatrace_runq_latency_quantile_seconds", "slatrace_preempted_wait_seconds_total",
                   "slatrace_preemptions_total", "slatrace_iowait_seconds", "slatrace_migrations_total",
                   "slatrace_cpu_throttled_seconds_total", "slatrace_slo_ok", "slatrace_slo_breaches_total",
                   "rate(slatrace_bpf_run_seconds_total", "rate(slatrace_bpf_events_total",
                   "slatrace_bpf_map_errors_total", "slatrace_cpu_limit_wait_seconds_total"):
        assert needle in exprs, needle
    requests = " ".join(t["expr"] for _, t in _targets(_load(REPO / "dashboards" / "slatrace-requests.json")))
    assert "slatrace_request_sched_delay_seconds_bucket" in requests
    assert "slatrace_request_delay_seconds_total" in requests


# The panels that split a delay by cause (docs/api.md "The causes of a wait").
OVERVIEW_BY_CAUSE = "Run-queue wait by cause: own CPU limit vs neighbours"
REQUESTS_BY_CAUSE = "Request delay by cause"
REQUESTS_BY_CULPRIT = "Request delay caused by neighbours, by culprit"


def _panel(name: str, title: str) -> dict:
    (panel,) = [p for p in _panels(_load(REPO / "dashboards" / name)) if p["title"] == title]
    return panel


def test_request_delay_panels_add_up_every_node_by_cause_and_culprit() -> None:
    (cause,) = _panel("slatrace-requests.json", REQUESTS_BY_CAUSE)["targets"]
    assert cause["expr"].startswith("sum by (service, cause) (rate(slatrace_request_delay_seconds_total{")
    (culprit,) = _panel("slatrace-requests.json", REQUESTS_BY_CULPRIT)["targets"]
    assert culprit["expr"].startswith("sum by (service, culprit) (rate(slatrace_request_delay_seconds_total{")
    assert 'cause="neighbour"' in culprit["expr"]
    for t in (cause, culprit):
        # Summed over the selected nodes, not one line per node.
        assert "instance" not in re.search(r"^sum by \(([^)]*)\)", t["expr"]).group(1)


def test_the_own_limit_and_the_throttled_time_are_told_apart() -> None:
    by_cause = _panel("slatrace-overview.json", OVERVIEW_BY_CAUSE)
    # A line for every cause of the closed vocabulary, the own limit first.
    assert sorted(c for t in by_cause["targets"] for c in _causes_drawn(t)) == sorted(CAUSES)
    assert _causes_drawn(by_cause["targets"][0]) == ["cpu_limit"]
    assert "slatrace_cpu_limit_wait_seconds_total" in by_cause["targets"][0]["expr"]
    (throttled,) = [p for p in _panels(_load(REPO / "dashboards" / "slatrace-overview.json"))
                    if "slatrace_cpu_throttled_seconds_total" in json.dumps(p.get("targets", []))]
    assert "cpu.stat" in throttled["title"] and "not the waits" in throttled["title"]
    # Side by side.
    assert throttled["gridPos"]["y"] == by_cause["gridPos"]["y"]


def _causes_drawn(target: dict) -> list[str]:
    """The causes one query of the by-cause panel draws: named in its legend,
    or, where the legend takes the cause label, the pseudo-culprits it selects."""
    cause = re.match(r"\{\{service\}\} (\{\{cause\}\}|\w+)", target["legendFormat"]).group(1)
    if cause != "{{cause}}":
        return [cause]
    (selected,) = set(re.findall(r'by_service=~"([^"]+)"', target["expr"]))  # after preemptions and wake-ups alike
    return sorted(selected.split("|"))


def _as_rules(panels: list[dict]) -> tuple[dict, dict[str, str]]:
    """The panels' queries as recording rules over every node and service,
    named panel_<id>_<refId>, and each rule's legend cause."""
    rules, named = [], {}
    for p in panels:
        for t in p["targets"]:
            expr = (t["expr"].replace('"$node"', '".*"').replace('"$service"', '".*"')
                    .replace("$__rate_interval", "5m"))
            record = f"panel_{p['id']}_{t['refId']}"
            rules.append({"record": record, "expr": expr})
            named[record] = t["legendFormat"]
    return {"groups": [{"name": "dashboards", "rules": rules}]}, named


def test_cause_panels_give_the_hand_computed_figures(tmp_path: Path) -> None:
    """The cause panels' PromQL, run by promtool on series whose rates are
    known (increments per minute whose rates are exact in binary:
    3.75/min = 0.0625/s), against the split worked out by hand."""
    import yaml

    if shutil.which("promtool") is None:
        require_kernel("promtool is not installed (SLATRACE_SETUP_TEST=1 scripts/setup.sh)")
    by_cause = _panel("slatrace-overview.json", OVERVIEW_BY_CAUSE)
    req_cause = _panel("slatrace-requests.json", REQUESTS_BY_CAUSE)
    req_culprit = _panel("slatrace-requests.json", REQUESTS_BY_CULPRIT)
    rules, legends = _as_rules([by_cause, req_cause, req_culprit])
    (tmp_path / "panels.rules.yaml").write_text(yaml.safe_dump(rules, width=10_000))

    def series(metric: str, inc: float, **labels: str) -> dict:
        sel = ", ".join(f'{k}="{v}"' for k, v in labels.items())
        return {"series": f"{metric}{{{sel}}}", "values": f"0+{inc}x20"}

    wait, pre, wake = ("slatrace_runq_wait_seconds_total", "slatrace_preempted_wait_seconds_total",
                       "slatrace_wakeup_wait_seconds_total")
    req = "slatrace_request_delay_seconds_total"
    inputs = [
        # victim on two nodes, batch on n1.
        series(wait, 15, instance="n1", service="victim"),
        series(wait, 7.5, instance="n2", service="victim"),
        series(wait, 3.75, instance="n1", service="batch"),
        series("slatrace_cpu_limit_wait_seconds_total", 3.75, instance="n1", service="victim"),     # 0.0625
        series("slatrace_cpu_limit_wait_seconds_total", 1.875, instance="n2", service="victim"),    # 0.03125
        series(pre, 1.875, instance="n1", service="victim", by_service="batch"),                    # 0.03125
        series(wake, 0.9375, instance="n1", service="victim", by_service="batch"),                  # 0.015625
        series(wake, 0.46875, instance="n1", service="victim", by_service="other"),                 # 0.0078125
        series(pre, 0.46875, instance="n2", service="victim", by_service="batch"),                  # 0.0078125
        series(pre, 0.9375, instance="n1", service="victim", by_service="victim"),                  # 0.015625
        series(wake, 0.46875, instance="n2", service="victim", by_service="victim"),                # 0.0078125
        series(pre, 0.234375, instance="n1", service="victim", by_service="kernel"),                # 0.00390625
        series(wake, 0.9375, instance="n1", service="victim", by_service="idle"),                   # 0.015625
        series(wake, 0.9375, instance="n2", service="victim", by_service="idle"),                   # 0.015625
        series(pre, 0.234375, instance="n1", service="victim", by_service="unknown"),               # 0.00390625
        # To batch, victim is a neighbour; batch's own threads are not.
        series(pre, 0.46875, instance="n1", service="batch", by_service="victim"),                  # 0.0078125
        series(wake, 0.234375, instance="n1", service="batch", by_service="batch"),                 # 0.00390625
        # victim's requests.
        series(req, 1.875, instance="n1", service="victim", cause="cpu_limit", culprit="victim"),   # 0.03125
        series(req, 0.9375, instance="n2", service="victim", cause="cpu_limit", culprit="victim"),  # 0.015625
        series(req, 0.9375, instance="n1", service="victim", cause="neighbour", culprit="batch"),   # 0.015625
        series(req, 0.46875, instance="n2", service="victim", cause="neighbour", culprit="batch"),  # 0.0078125
        series(req, 0.46875, instance="n2", service="victim", cause="neighbour", culprit="etl"),    # 0.0078125
        series(req, 0.234375, instance="n1", service="victim", cause="own_threads", culprit="victim"),
    ]
    # By hand, per second, summed over the two nodes.
    overview = {
        "cpu_limit": {"victim": 0.09375},
        "neighbour": {"victim": 0.0625, "batch": 0.0078125},
        "own_threads": {"victim": 0.0234375, "batch": 0.00390625},
        "kernel": {"victim": 0.00390625},
        "idle": {"victim": 0.03125},
        "unknown": {"victim": 0.00390625},
    }
    requests_by_cause = {"cpu_limit": 0.046875, "neighbour": 0.03125, "own_threads": 0.00390625}
    requests_by_culprit = {"batch": 0.0234375, "etl": 0.0078125}
    cases = []
    for target in by_cause["targets"]:
        record = f"panel_{by_cause['id']}_{target['refId']}"
        causes = _causes_drawn(target)
        if "{{cause}}" in legends[record]:     # one series per service and cause
            samples = [(f'service="{s}", cause="{c}"', v) for c in causes for s, v in overview[c].items()]
        else:
            (cause,) = causes
            samples = [(f'service="{s}"', v) for s, v in overview[cause].items()]
        cases.append({"expr": record, "eval_time": "10m",
                      "exp_samples": [{"labels": f"{record}{{{labels}}}", "value": v} for labels, v in samples]})
    record = f"panel_{req_cause['id']}_A"
    cases.append({"expr": record, "eval_time": "10m", "exp_samples": [
        {"labels": f'{record}{{service="victim", cause="{c}"}}', "value": v} for c, v in requests_by_cause.items()]})
    record = f"panel_{req_culprit['id']}_A"
    cases.append({"expr": record, "eval_time": "10m", "exp_samples": [
        {"labels": f'{record}{{service="victim", culprit="{c}"}}', "value": v}
        for c, v in requests_by_culprit.items()]})
    (tmp_path / "panels.test.yaml").write_text(yaml.safe_dump({
        "rule_files": ["panels.rules.yaml"], "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": inputs, "promql_expr_test": cases}]}, width=10_000))
    r = subprocess.run(["promtool", "test", "rules", "panels.test.yaml"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


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
                                            "SlatraceBPFMapErrors", "SlatraceCPULimitDelaysRequests"}
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
