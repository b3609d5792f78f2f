"""/metrics as strict parsers read it, scraped from the real daemon under load.

Prometheus's own scraper tolerates a family written twice; the exposition
format does not, and promtool, OpenMetrics parsers and other agents that scrape
Prometheus endpoints reject the whole scrape. So while request spans flow in
over both OTLP receivers (the API server and the OTLP/HTTP receiver both count
connections), an engine's own histograms are scraped (recorded from vLLM) and
short-lived services come and go, every scrape must pass
`promtool check metrics` in the text format, and parse with prometheus_client's
strict OpenMetrics parser when the scraper asks for OpenMetrics, as Prometheus
does by default.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import yaml
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics

from tests.support import needs_kernel, require_kernel
from tests.support.agent import REPO, Agent, free_port, post_traces
from tests.support.engine_metrics import engine_endpoint
from tests.support.scale import Churn, Duty
from tests.support.workload import TestCgroup

pytestmark = pytest.mark.e2e

SERVER = REPO / "tests" / "support" / "inference_server.py"
FIXTURE = REPO / "tests" / "unit" / "fixtures" / "otlp" / "vllm_llm_request_v1.json"
# Prometheus 2.x's scrape Accept header.
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
CHURN_RATE, CHURN_LIFETIME, CHURN_S = 15.0, 1.0, 14.0
SCRAPE_EVERY_S = 1.5


@dataclass
class Scrape:
    openmetrics: str  # Accept: Prometheus's default
    text: str        # the text format (no Accept header), right after
    content_types: tuple[str, str]


def scrape(url: str) -> Scrape:
    bodies, types = [], []
    for accept in (PROMETHEUS_ACCEPT, None):
        req = urllib.request.Request(url + "/metrics")
        if accept:
            req.add_header("Accept", accept)
        with urllib.request.urlopen(req, timeout=30) as resp:
            bodies.append(resp.read().decode())
            types.append(resp.headers["Content-Type"])
    return Scrape(bodies[0], bodies[1], (types[0], types[1]))


def promtool_check(text: str) -> str:
    """promtool's complaints about an exposition ('' when it accepts it)."""
    r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    return "" if r.returncode == 0 and not (r.stdout + r.stderr).strip() else (r.stdout + r.stderr).strip()


@pytest.fixture(scope="module")
def scrapes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Scrape]]:
    needs_kernel()
    with engine_endpoint() as engine_url:
        yield _scrapes_under_load(tmp_path_factory, engine_url)


def _scrapes_under_load(tmp_path_factory: pytest.TempPathFactory, engine_url: str) -> list[Scrape]:
    if shutil.which("promtool") is None:
        require_kernel("promtool is not installed (SLATRACE_SETUP_TEST=1 scripts/setup.sh installs it)")
    tmp = tmp_path_factory.mktemp("exposition")
    cfg = tmp / "slatrace.yaml"
    cfg.write_text(yaml.safe_dump({
        "services": [{"name": "infer-exposition", "cgroup": f"/slatrace-test-infer-{os.getpid()}-*"}],
        "slos": [{"service": "infer-exposition", "runq_p99": 0.0001, "request_e2e_p99": 0.05}],
        "histograms": ["*"],   # every service's buckets: the largest exposition the churn can make
        "engines": [{"service": "infer-exposition", "url": engine_url}],
    }))
    vllm = tmp / "vllm"
    vllm.symlink_to(SERVER)   # `.../vllm serve`: a vLLM server's command line
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    grpc_port, http_port = free_port(), free_port()
    out: list[Scrape] = []
    with Agent("--otlp-grpc-listen", f"127.0.0.1:{grpc_port}", "--otlp-http-listen", f"127.0.0.1:{http_port}",
               config=cfg, interval=0.5) as agent, TestCgroup("infer") as infer:
        servers = [infer.spawn([sys.executable, str(vllm), "serve", "--otlp-traces-endpoint", endpoint,
                                "--requests", "6", "--cpu", "0", "--prefix", f"expo-{name}"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**env, **extra})
                   for name, endpoint, extra in (
                       ("grpc", f"http://127.0.0.1:{grpc_port}", {}),
                       ("http", f"http://127.0.0.1:{http_port}/v1/traces",
                        {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}))]
        duty = Duty.for_load(int(CHURN_RATE * CHURN_LIFETIME), 0.4)
        with Churn(CHURN_RATE, CHURN_LIFETIME, CHURN_S, duty, name="exposition") as churn:
            while churn.finished_at is None:
                # Spans over OTLP/HTTP between the servers' batches, and a refused one.
                assert post_traces(http_port, FIXTURE.read_bytes(), "application/json")[0] == 200
                assert post_traces(http_port, b"{", "application/json")[0] == 400
                out.append(scrape(agent.url))
                time.sleep(SCRAPE_EVERY_S)
            churn.join()
        for proc in servers:
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
        time.sleep(1.5)   # the last spans attributed
        out.append(scrape(agent.url))
    return out


def test_the_scrapes_carry_the_load(scrapes: list[Scrape]) -> None:
    """Not vacuous: spans on both receivers, both servers' connections, churned services."""
    assert len(scrapes) >= 5
    last = scrapes[-1].text
    for needle in ('slatrace_otlp_spans_received_total{transport="grpc"}',
                   'slatrace_otlp_spans_received_total{transport="http"}',
                   'slatrace_http_connections_total{outcome="served",server="http"}',
                   'slatrace_http_connections_total{outcome="served",server="otlp-http"}',
                   'slatrace_otlp_rejected_requests_total{reason="malformed",transport="http"}',
                   'slatrace_requests_attributed_total{service="infer-exposition"}',
                   'slatrace_request_sched_delay_seconds_bucket{',
                   '# TYPE slatrace_engine_latency_quantile_seconds summary',
                   'slatrace_engine_latency_quantile_seconds_count{'):
        assert needle in last, f"the last scrape has no {needle}"
    churned = {line.split('service="')[1].split('"')[0] for s in scrapes for line in s.text.splitlines()
               if line.startswith("slatrace_runq_latency_seconds_count{") and "slatrace-test-exposition" in line}
    assert len(churned) >= 20, f"only {len(churned)} churned services were scraped"


def test_every_family_is_written_once(scrapes: list[Scrape]) -> None:
    for s in scrapes:
        for text in (s.text, s.openmetrics):
            types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
            twice = sorted({n for n in types if types.count(n) > 1})
            assert not twice, f"families written twice: {twice}"


def test_promtool_accepts_every_scrape(scrapes: list[Scrape]) -> None:
    for i, s in enumerate(scrapes):
        assert s.content_types[1].startswith("text/plain; version=0.0.4"), s.content_types[1]
        complaints = promtool_check(s.text)
        assert not complaints, f"promtool check metrics rejects scrape {i}: {complaints[:2000]}"


def test_openmetrics_is_served_and_parses_strictly(scrapes: list[Scrape]) -> None:
    for i, s in enumerate(scrapes):
        assert s.content_types[0].startswith("application/openmetrics-text; version=1.0.0"), s.content_types[0]
        assert s.openmetrics.endswith("# EOF\n")
        try:
            families = {f.name: f for f in parse_openmetrics(s.openmetrics)}
        except ValueError as e:
            pytest.fail(f"scrape {i} is not valid OpenMetrics: {e}")
        # The families of the text format scraped right after (a family may appear in between,
        # with its first sample; after the load, nothing moves).
        plain = {line.split()[2].removesuffix("_total") for line in s.text.splitlines() if line.startswith("# TYPE ")}
        quiet = s is scrapes[-1]
        assert (set(families) == plain) if quiet else (set(families) <= plain), set(families) ^ plain
    http = families["slatrace_http_connections"]
    assert {smp.labels["server"] for smp in http.samples} == {"http", "otlp-http"}
