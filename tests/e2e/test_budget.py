"""The series budget on the real daemon: a service that stops leaves /metrics
once the retention has passed, and the `service` label never holds more values
than max_services, whatever else runs on the host."""

from __future__ import annotations

import subprocess
import time

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support import needs_kernel
from tests.support.agent import Agent, http_get
from tests.support.workload import PREFIX, TestCgroup, victim_argv

pytestmark = pytest.mark.e2e

RETENTION_S = 4.0
MAX_SERVICES = 6
GONE = "budget-gone"   # named by a rule, so it has a place however many services the host runs


def services_in(agent: Agent) -> tuple[set[str], float]:
    """Service label values of one scrape, and its slatrace_services_tracked."""
    status, body = http_get(agent.url + "/metrics", timeout=30)
    assert status == 200
    names: set[str] = set()
    tracked = -1.0
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            if "service" in s.labels:
                names.add(s.labels["service"])
            if s.name == "slatrace_services_tracked":
                tracked = s.value
    return names, tracked


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory):
    needs_kernel()
    cfg = tmp_path_factory.mktemp("budget") / "slatrace.yaml"
    cfg.write_text(yaml.safe_dump({"retention": RETENTION_S, "max_services": MAX_SERVICES,
                                   "services": [{"name": GONE, "cgroup": f"/{PREFIX}budget-gone-*"}]}))
    with Agent(config=cfg, interval=0.5) as a:
        yield a


def test_a_stopped_service_leaves_metrics_after_the_retention(agent: Agent) -> None:
    with TestCgroup("budget-gone") as cg:
        p = cg.spawn(victim_argv(2.0), stdout=subprocess.DEVNULL)
        p.wait(timeout=30)
        seen, _ = services_in(agent)
        assert GONE in seen, seen
    stopped = time.monotonic()
    gone_after = None
    while time.monotonic() - stopped < RETENTION_S + 20:
        names, _ = services_in(agent)
        if GONE not in names:
            gone_after = time.monotonic() - stopped
            break
        time.sleep(0.25)
    assert gone_after is not None, f"{GONE} still exported {RETENTION_S + 20:.0f} s after it stopped"
    # Not before the retention (less one interval and a scrape), and soon after.
    assert RETENTION_S - 1.0 <= gone_after <= RETENTION_S + 5.0, gone_after


def test_services_tracked_never_exceeds_max_services(agent: Agent) -> None:
    """Whatever runs on the host (its own services, and twelve test cgroups
    here), the label never has more than max_services values."""
    cgs = [TestCgroup(f"budget-{i}") for i in range(12)]
    try:
        for cg in cgs:
            cg.__enter__()
            cg.spawn(victim_argv(3.0), stdout=subprocess.DEVNULL)
        named: set[str] = set()
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline:
            names, tracked = services_in(agent)
            assert len(names) <= tracked <= MAX_SERVICES, (tracked, names)
            named |= names & {cg.path for cg in cgs}
            time.sleep(0.3)
        # Twelve busy cgroups, four places for automatic names: the rest is "other".
        assert "other" in names
        assert len(named) <= MAX_SERVICES - 2, named
    finally:
        for cg in cgs:
            cg.__exit__(None, None, None)
