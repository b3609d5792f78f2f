"""Every route of the API on a store fed hand-made intervals: status, content
type, JSON shape, the fields docs/api.md adds, and the figures against sums
computed by hand from the snapshots."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as CONTENT_TYPE_OPENMETRICS
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics

from agent.api.routes import AgentState, Api, wants_openmetrics
from agent.config import Config, Slo
from agent.export.figures import AgentStats, Sources
from agent.export.prometheus import Registry, SlatraceCollector
from agent.probe.snapshot import HIST_RUNQ, Bucket, CgroupCounters, PairCounters, ProbeSnapshot
from agent.store.histogram import slot_of
from agent.store.store import Store

REPO = Path(__file__).resolve().parents[2]
WEB, BATCH = 101, 102
NAMES = {WEB: "web", BATCH: "batch"}
NOW = 1010.0


# What /api/v1/engines says of web's inference engine (agent/traces/engines.py).
ENGINE = {"service": "web", "url": "http://127.0.0.1:8000/metrics", "start": 1001.0, "end": 1002.0,
          "latency": {"e2e": {"metric": "vllm:e2e_request_latency_seconds", "count": 2.0}}, "requests": {"count": 2}}


def snap(t: int, **kw) -> ProbeSnapshot:
    return ProbeSnapshot.from_dicts(mono_ns=t * 10**9, wall=1000.0 + t, **kw)


@pytest.fixture
def api() -> Api:
    store = Store(900, clock=lambda: NOW)
    store.ingest(snap(0), NAMES.__getitem__)
    for t in (1, 2):
        store.ingest(snap(t, hists={(WEB, HIST_RUNQ): {slot_of(20_000): Bucket(3, 3 * 20_000),
                                                       slot_of(3_000_000): Bucket(1, 3_000_000)},
                                    (BATCH, HIST_RUNQ): {slot_of(60_000): Bucket(2, 2 * 60_000)}},
                          pairs={(WEB, BATCH): PairCounters(1, 3_000_000)},
                          holders={(WEB, 0): PairCounters(3, 60_000)},
                          cgroups={WEB: CgroupCounters(migrations=2, lost_runq=1, lost_runq_ns=50_000)}),
                     NAMES.__getitem__)
    config = Config(slos=(Slo("web", runq_p99=0.001),))
    registry = Registry()
    registry.register(SlatraceCollector(store, sources=Sources(
        slos=config.slos, agent_stats=lambda: AgentStats(poll_duration_seconds=0.01, poll_errors=0))))
    state = AgentState(config=config, store=store, registry=registry,
                       describe_services=lambda: [{"name": "web", "source": "config", "cgroups": ["/web"]}],
                       breaches_between=lambda start, end: {("web", "runq_p99"): 2},
                       engines_since=lambda since, service: [ENGINE])
    state.ready = True
    return Api(state)


def get(api: Api, target: str) -> tuple[int, object, str]:
    r = api.handle("GET", target)
    body = json.loads(r.body) if r.content_type == "application/json" else r.body.decode()
    return r.status, body, r.content_type


def test_probes(api):
    assert api.handle("GET", "/livez").status == 200
    assert api.handle("GET", "/readyz").status == 200
    api.state.ready = False
    assert api.handle("GET", "/readyz").status == 503


# Prometheus 2.x's default scrape Accept header, and what it gets.
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


@pytest.mark.parametrize("accept, openmetrics", [
    (PROMETHEUS_ACCEPT, True),
    ("application/openmetrics-text", True),
    ("Application/OpenMetrics-Text; version=1.0.0; charset=utf-8", True),
    ("application/openmetrics-text;q=0", False),
    ("application/openmetrics-text;version=2.0.0", False),
    ("text/plain;version=0.0.4", False),
    ("*/*", False),
    ("", False),
])
def test_openmetrics_is_served_when_asked(accept, openmetrics):
    assert wants_openmetrics(accept) is openmetrics


def test_metrics_as_openmetrics_parse_strictly_with_the_same_figures(api):
    r = api.handle("GET", "/metrics", {"accept": PROMETHEUS_ACCEPT})
    assert r.status == 200 and r.content_type == CONTENT_TYPE_OPENMETRICS
    text = r.body.decode()
    assert text.endswith("# EOF\n") and text.count("# EOF") == 1
    families = {f.name: f for f in parse_openmetrics(text)}
    wait = families["slatrace_runq_wait_seconds"]
    assert wait.type == "counter"
    assert [s.value for s in wait.samples if s.labels == {"service": "web"}] == [pytest.approx(0.00612)]
    # Every family of the text format, no more, no less.
    plain = api.handle("GET", "/metrics").body.decode()
    names = {line.split()[2] for line in plain.splitlines() if line.startswith("# TYPE")}
    assert {n.removesuffix("_total") for n in names} == set(families)


def test_metrics_is_the_text_format_with_the_figures(api):
    status, text, ctype = get(api, "/metrics")
    assert status == 200 and ctype == CONTENT_TYPE_PLAIN_0_0_4
    # 2 intervals x (3 x 20 us + 3 ms) for web.
    assert 'slatrace_runq_wait_seconds_total{service="web"} 0.00612' in text
    assert 'slatrace_lost_waits_total{kind="runq",service="web"} 2.0' in text
    assert "slatrace_poll_errors_total 0.0" in text


def test_services_is_what_the_resolver_describes(api):
    status, doc, ctype = get(api, "/api/v1/services")
    assert status == 200 and ctype == "application/json"
    assert doc == {"services": [{"name": "web", "source": "config", "cgroups": ["/web"]}]}


def test_attribution_records_carry_the_figures_and_every_documented_field(api):
    status, doc, _ = get(api, "/api/v1/attribution?since=60")
    assert status == 200
    records = {r["service"]: r for r in doc["attribution"]}
    assert set(records) == {"web", "batch"}
    web = records["web"]
    assert web["runq"]["count"] == 8
    assert web["runq"]["wait_seconds"] == pytest.approx(2 * (3 * 20e-6 + 3e-3))
    assert web["runq"]["lost"] == 2 and web["runq"]["coverage"] == pytest.approx(8 / 10)
    assert web["migrations"] == 4
    assert web["preemption"]["by"][0]["service"] == "batch"
    assert web["preemption"]["by"][0]["wait_seconds"] == pytest.approx(6e-3)
    assert web["wakeup"]["behind"][0]["service"] == "idle"
    # The P99 (3 ms) breaks the 1 ms SLO: the verdict says something, the record says which.
    assert [s["name"] for s in web["slo"] if not s["ok"]] == ["runq_p99"]
    assert web["slo"][0]["intervals_breached"] == 2
    assert isinstance(web["verdict"], str) and web["verdict"]
    # Every field docs/api.md adds to the records is there.
    section = (REPO / "docs" / "api.md").read_text().split("## `GET /api/v1/attribution` records")[1]
    section = section.split("\n## ")[0]
    fields = {f for row in section.splitlines() if row.startswith("| `")
              for f in re.findall(r"`([a-z_]+(?:\[\])?(?:\.[a-z_{},]+)?)(?:\[\])?`", row.split("|")[1])}
    fields.discard("other")   # a culprit's name the table explains, not a field
    assert {"wakeup.count", "runq.coverage", "blame", "verdict"} <= fields
    assert "slo[].intervals_breached" in fields
    for field in fields:
        head, _, tail = field.partition(".")
        values = web[head[:-2]] if head.endswith("[]") else [web[head]]
        assert values, field
        for value in values:
            for part in (tail.strip("{}").split(",") if tail else []):
                assert part in value, (field, part)


def test_filters_and_errors(api):
    status, doc, _ = get(api, "/api/v1/attribution?service=batch")
    assert status == 200 and [r["service"] for r in doc["attribution"]] == ["batch"]
    status, doc, _ = get(api, "/api/v1/attribution?since=soon")
    assert status == 400 and "since" in doc["error"]
    status, doc, _ = get(api, "/api/v1/nothing")
    assert status == 404 and "no such endpoint" in doc["error"]
    r = api.handle("POST", "/api/v1/attribution")
    assert r.status == 405 and json.loads(r.body)["error"]


def _row(text: str, first_cell: str) -> list[str]:
    """The cells of the table row whose first cell is first_cell."""
    for line in text.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃|]", line) if c.strip()]
        if cells and cells[0] == first_cell:
            return cells
    raise AssertionError(f"no row {first_cell!r} in:\n{text}")


def test_cli_attribution_table_shows_the_api_figures(api):
    """`slatrace attribution`'s table from the API document above."""
    import io

    from agent.cli.attribution_view import print_attribution

    _, doc, _ = get(api, "/api/v1/attribution?since=60")
    out = io.StringIO()
    print_attribution(doc, file=out)
    text = out.getvalue()
    web = _row(text, "web")
    # service, runs, wait, p50, p95, p99, preempted, top culprit, throttled, iowait, migr, cause, SLO
    assert web[1] == "8" and web[2] == "6.1 ms" and web[5] == "3 ms"
    assert web[7].startswith("batch") and web[9] == "-" and web[11] == "4" and web[-1] == "BREACH runq_p99"
    assert _row(text, "batch")[-1] == "-"          # no SLO for batch
    assert any(line.startswith("web") and "batch" in line for line in text.splitlines()[-3:])   # the verdicts


def test_cli_services_and_checks_tables(capsys):
    from agent.cli.main import print_checks, print_services
    from agent.check import Check

    print_services({"services": [{"name": "web", "source": "config", "tasks": 3, "cgroups": ["/a", "/b"]}]})
    print_checks([Check("tracefs", True, "mounted at /sys/kernel/tracing"), Check("BTF", False, "missing")])
    text = capsys.readouterr().out
    assert _row(text, "web")[1:] == ["config", "3", "/a, /b"]
    assert _row(text, "tracefs")[1] == "yes" and _row(text, "BTF")[1:] == ["NO", "missing"]


def test_attribution_carries_the_engines_figures_of_the_services_that_have_one(api):
    seen = []
    engines_since = api.state.engines_since
    api.state.engines_since = lambda since, service: seen.append((since, service)) or engines_since(since, service)
    _, doc, _ = get(api, "/api/v1/attribution?since=60")
    records = {r["service"]: r for r in doc["attribution"]}
    assert records["web"]["engine"] == ENGINE and "engine" not in records["batch"]
    assert seen == [(60.0, None)]


def test_every_route_and_query_command_is_in_the_api_contract(api):
    """docs/api.md's table is the one list of routes (the README points to it):
    every route served is in it, and so is every command that queries one."""
    from agent.cli.main import COMMANDS
    from agent.traces.api import REQUESTS_PATH, SPANS_PATH
    from agent.traces.engines import ENGINES_PATH

    doc = (REPO / "docs" / "api.md").read_text()
    table = [line for line in doc.splitlines() if line.startswith("| `GET ")]
    for route in [*api._routes, REQUESTS_PATH, REQUESTS_PATH + "/{id}", SPANS_PATH, ENGINES_PATH, "/metrics"]:
        assert any(f"`GET {route}`" in row or f"`GET {route}?" in row for row in table), route
    cli = {name for row in table for name in re.findall(r"`(\w+)`", row.rsplit("|", 2)[1])}
    assert cli == set(COMMANDS) - {"run", "check"}
