"""A service under its own CPU quota: throttled_seconds against the kernel's
own cpu.stat, the part of its waits the limit held (measured per wait)
against the same, and a verdict that names its own limit, not a neighbour."""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.scenes import quota
from tests.support import needs_kernel
from tests.support.agent import Agent, http_get
from tests.support.workload import TestCgroup, hog_argv

pytestmark = pytest.mark.e2e

SECONDS = 3.0
PERCENT = 20


@pytest.fixture(scope="module")
def throttled():
    needs_kernel()
    with Agent(interval=0.5) as agent, TestCgroup("quota") as svc, quota(svc, PERCENT) as q:
        p = svc.spawn(q.wrap + hog_argv())
        time.sleep(SECONDS)
        p.kill()
        p.wait()
        kernel = q.throttled_seconds()  # final: nothing runs there any more
        time.sleep(1.5)  # a few more intervals read the final value
        rec = agent.get_json(f"/api/v1/attribution?since=120&service={svc.path}")["attribution"]
        _, body = http_get(agent.url + "/metrics")
        yield svc, q, kernel, rec, body.decode()


def test_throttled_seconds_match_the_kernel(throttled) -> None:
    _, q, kernel, rec, _ = throttled
    # 20% of one CPU for 3 s: about 80% of the time throttled.
    assert kernel > 0.5 * SECONDS * (1 - PERCENT / 100)
    (r,) = rec
    assert r["throttled_seconds"] == pytest.approx(kernel, rel=0.05), (r["throttled_seconds"], kernel, q.version)


def test_prometheus_counter_matches_the_kernel(throttled) -> None:
    svc, _, kernel, _, text = throttled
    fam = {f.name: f for f in text_string_to_metric_families(text)}["slatrace_cpu_throttled_seconds"]
    value = next(s.value for s in fam.samples if s.labels["service"] == svc.path)
    assert value == pytest.approx(kernel, rel=0.05)


def test_verdict_names_throttling_not_a_neighbour(throttled) -> None:
    _, _, _, rec, _ = throttled
    (r,) = rec
    assert r["blame"]["cause"] == "own_quota", r["blame"]
    assert r["blame"]["kinds"]["own_quota"]["share"] > 0.5
    assert "own CPU limit" in r["verdict"] and "delayed by its neighbours" not in r["verdict"]


def test_the_limits_part_of_the_waits_is_measured_per_wait(throttled) -> None:
    """One runnable thread: while its group is throttled it waits, so the part
    of its waits the limit held is the group's throttled time (cpu.stat), and
    the tail of its waits is the limit's."""
    svc, _, kernel, rec, text = throttled
    (r,) = rec
    assert r["cpu_limit"]["wait_seconds"] == pytest.approx(kernel, rel=0.10), (r["cpu_limit"], kernel)
    # Most of the tail; other tests' load on the same 2 CPUs adds contention waits of as long.
    assert r["cpu_limit"]["p99_share"] >= 0.5
    assert next(iter(r["runq"]["by_cause"])) == "cpu_limit"
    assert sum(r["runq"]["by_cause"].values()) == pytest.approx(r["runq"]["wait_seconds"], rel=1e-6)
    own = next(s for s in r["blame"]["shares"] if s["kind"] == "own_quota")
    assert own["measured"] == "per_wait" and own["seconds"] == pytest.approx(r["cpu_limit"]["wait_seconds"])
    assert "of the waits at or above it held by its own CPU limit" in r["verdict"]
    fam = {f.name: f for f in text_string_to_metric_families(text)}["slatrace_cpu_limit_wait_seconds"]
    value = next(s.value for s in fam.samples if s.labels["service"] == svc.path)
    assert value == pytest.approx(r["cpu_limit"]["wait_seconds"], rel=0.05)
