"""`slatrace attribution --prometheus`: a real Prometheus (Debian's, started
here on loopback with its own directory, scraping every second) scrapes a real
agent; the fleet answer must agree with the agent's own for the same window
within the resolution of the exported buckets.

The series budget is on: the victim gets buckets (a `histograms` entry), the
heavy hogs do not, so their quantiles come from the agent's 60 s quantile
gauge and must match the agent's own answer for its last 60 s."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.parse
from pathlib import Path

import pytest

from agent.cli.prometheus_query import PrometheusQuery, fleet_attribution
from agent.store.histogram import classic_bounds
from tests.e2e.scenes import contention
from tests.support import needs_kernel, require_kernel
from tests.support.agent import REPO, SLATRACE, Agent, free_port, http_get
from tests.support.workload import PREFIX

pytestmark = pytest.mark.e2e

WINDOW = 5.0
# Neighbouring classic bounds are at most this far apart: a quantile read from
# them by linear interpolation stays within one bucket of the agent's.
BUCKET_RATIO = max(b / a for a, b in zip(classic_bounds(), classic_bounds()[1:]))


class Prometheus:
    def __init__(self, target: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="slatrace-prom-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        (self.dir / "prometheus.yml").write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            f"scrape_configs:\n  - job_name: slatrace\n    static_configs:\n      - targets: ['{target}']\n")
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Prometheus":
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={self.dir / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.dir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
             "--log.level=warn"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def samples(self, expr: str) -> float:
        try:
            status, body = http_get(f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        except OSError:  # not listening yet
            return 0.0
        if status != 200:
            return 0.0
        result = json.loads(body)["data"]["result"]
        return float(result[0]["value"][1]) if result else 0.0


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory):
    needs_kernel()
    if shutil.which("prometheus") is None:
        require_kernel("Debian's prometheus is not installed (make setup-test installs it)")
    cfg = tmp_path_factory.mktemp("cfg") / "slatrace.yaml"
    cfg.write_text(f'histograms: ["/{PREFIX}victim-*"]\n')   # the scene's victim cgroup, by its name
    with Agent(config=cfg, interval=0.5) as agent, contention(WINDOW + 12, heavy_hogs=2) as c, \
            Prometheus(f"127.0.0.1:{agent.port}") as prom:
        deadline = time.monotonic() + 30
        series = f'count_over_time(slatrace_runq_latency_seconds_count{{service="{c.victim.path}"}}[{WINDOW:g}s])'
        while prom.samples(series) < WINDOW and time.monotonic() < deadline:
            time.sleep(0.5)
        assert prom.samples(series) >= WINDOW, "Prometheus did not scrape the agent"
        # Both asked at the same instant about the same window, while the load is steady.
        at = time.time()
        ours = {r["service"]: r for r in agent.get_json(f"/api/v1/attribution?since={WINDOW:g}")["attribution"]}
        minute = {r["service"]: r for r in agent.get_json("/api/v1/attribution?since=60")["attribution"]}
        fleet = {r["service"]: r for r in fleet_attribution(PrometheusQuery(prom.url), WINDOW, at)["attribution"]}
        cli = subprocess.run(SLATRACE + ["attribution", c.victim.path, "--prometheus", prom.url, "--since",
                                         f"{WINDOW:g}", "--json"], cwd=REPO, capture_output=True, text=True,
                             timeout=60)
        status, metrics = http_get(agent.url + "/metrics")
        assert status == 200
        yield c, ours, minute, fleet, cli, metrics.decode()


def test_quantiles_agree_within_bucket_resolution(both) -> None:
    c, ours, _, fleet, _, _ = both
    a, p = ours[c.victim.path], fleet[c.victim.path]
    for q in ("p50", "p95", "p99"):
        assert a["runq"][q] and p["runq"][q], q
        ratio = p["runq"][q] / a["runq"][q]
        assert 1 / (BUCKET_RATIO * 1.15) <= ratio <= BUCKET_RATIO * 1.15, (q, a["runq"], p["runq"])


def test_services_without_buckets_get_the_agent_quantiles(both) -> None:
    c, _, minute, fleet, _, metrics = both
    # The budget is really on: the hogs have no finite bucket, the victim has.
    heavy_les = {line.split('le="', 1)[1].split('"', 1)[0] for line in metrics.splitlines()
                 if line.startswith("slatrace_runq_latency_seconds_bucket{") and f'"{c.heavy.path}"' in line}
    assert heavy_les == {"+Inf"}
    assert sum(1 for line in metrics.splitlines() if line.startswith("slatrace_runq_latency_seconds_bucket{")
               and f'"{c.victim.path}"' in line) > 10
    a, p = minute[c.heavy.path], fleet[c.heavy.path]
    for q in ("p50", "p95", "p99"):
        assert a["runq"][q] and p["runq"][q], q
        # The same figure, read one scrape (at most 1 s, two intervals) apart.
        assert p["runq"][q] == pytest.approx(a["runq"][q], rel=0.15), (q, a["runq"], p["runq"])


def test_counters_agree(both) -> None:
    c, ours, _, fleet, _, _ = both
    for cg in (c.victim, c.heavy):
        a, p = ours[cg.path], fleet[cg.path]
        # Agent intervals (0.5 s) and scrapes (1 s) cut the window differently.
        assert p["runq"]["count"] == pytest.approx(a["runq"]["count"], rel=0.3)
        assert p["runq"]["wait_seconds"] == pytest.approx(a["runq"]["wait_seconds"], rel=0.3)
    victim_a = [b["service"] for b in ours[c.victim.path]["preemption"]["by"]]
    victim_p = [b["service"] for b in fleet[c.victim.path]["preemption"]["by"]]
    assert c.heavy.path in victim_p
    assert victim_p.index(c.heavy.path) <= victim_a.index(c.heavy.path) + 1


def test_cli_prometheus_json(both) -> None:
    c, _, _, _, cli, _ = both
    assert cli.returncode == 0, cli.stderr
    (rec,) = json.loads(cli.stdout)["attribution"]
    assert rec["service"] == c.victim.path and rec["source"] == "prometheus"
    assert rec["verdict"].startswith(c.victim.path)
