"""A real Prometheus server (Debian's `prometheus`) for end-to-end tests:
its own temporary data directory, a free loopback port, 1 s scrapes."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.support.agent import free_port, http_get

RULES = Path(__file__).resolve().parents[2] / "deploy" / "rules" / "slatrace.rules.yaml"


@dataclass
class Prometheus:
    url: str
    proc: subprocess.Popen
    timeout: float = 5.0   # per query; a fleet's queries on a busy machine want more

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        status, body = http_get(f"{self.url}/api/v1/query?{urllib.parse.urlencode(params)}", self.timeout)
        doc = json.loads(body)
        assert status == 200 and doc["status"] == "success", (expr, status, doc)
        return doc["data"]["result"]

    def get(self, path: str) -> dict:
        status, body = http_get(self.url + path)
        assert status == 200, (path, status, body)
        return json.loads(body)["data"]


def start_prometheus(tmp: Path, target: str | None = None, *, scrape_configs: list[dict] | None = None,
                     interval: str = "1s", rule_files: tuple[Path, ...] = (RULES,), nice: int = 0,
                     timeout: float = 30.0) -> Prometheus:
    """Prometheus scraping `target` (one agent) or `scrape_configs`, every
    `interval`, evaluating `rule_files`; under `nice` beside other people's tests."""
    port = free_port()
    if scrape_configs is None:
        scrape_configs = [{"job_name": "slatrace", "static_configs": [{"targets": [target]}]}]
    config = {
        "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
        "rule_files": [str(r) for r in rule_files],
        "scrape_configs": scrape_configs,
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = open(tmp / "prometheus.log", "wb")
    proc = subprocess.Popen(
        (["nice", "-n", str(nice)] if nice else [])
        + ["prometheus", f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
           f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT)
    prom = Prometheus(f"http://127.0.0.1:{port}", proc)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prometheus exited: {(tmp / 'prometheus.log').read_text()}")
        try:
            if http_get(prom.url + "/-/ready", timeout=1.0)[0] == 200:
                return prom
        except OSError:
            pass
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    raise TimeoutError(f"prometheus not ready after {timeout:.0f} s")


@contextlib.contextmanager
def running_prometheus(tmp: Path, target: str | None = None, **options) -> Iterator[Prometheus]:
    prom = start_prometheus(tmp, target, **options)
    try:
        yield prom
    finally:
        prom.proc.terminate()
        try:
            prom.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            prom.proc.kill()
            prom.proc.wait()


def dashboard_targets(path: Path) -> list[tuple[str, str]]:
    """(panel title [refId], PromQL) of every query of a Grafana dashboard."""
    dash = json.loads(path.read_text())
    return [(f'{panel["title"]} [{t["refId"]}]', t["expr"])
            for panel in dash["panels"] for t in panel.get("targets", [])]


def substitute(expr: str, instance: str, services: str, rate_interval: str = "5s") -> str:
    """Grafana's variables, as the dashboard would send them."""
    values = {"node": instance, "service": services, "__rate_interval": rate_interval, "__interval": "1s",
              "__range": "30s", "datasource": "prometheus"}
    return re.sub(r"\$\{?(\w+)\}?", lambda m: values[m.group(1)], expr)
