"""Requests that ran while the kernel's event stream dropped events say so.

A service that sends request spans is streamed wait by wait; the stream has a
rate limit per CPU (`event_rate`). Two threads of the service that sleep a
few µs at a time on one CPU make a wait per wake-up, tens of thousands a
second, far beyond a low limit (the stream merges a spinning loop's
preempted waits, never wake-ups: bpf/sched.bpf.c stream_wait()). The requests served meanwhile must come back
marked (sched_complete false, the number of dropped events, "at least" in the
verdict), those served before the flood must not, the kernel's own count
of dropped events must show in /metrics, and the agent must warn once, not
once a drain."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import needs_kernel
from tests.support.agent import Agent, free_port, http_get, wait_for_requests
from tests.support.vllm_tracing import server_env
from tests.support.workload import TestCgroup

pytestmark = pytest.mark.e2e

SERVER = Path(__file__).resolve().parents[1] / "support" / "inference_server.py"
SERVICE = "drops-test"
EVENT_RATE = 1000   # events per CPU per second: the config file's lowest
FLOOD = ("import time\n"
         "end = time.monotonic() + {seconds}\n"
         "while time.monotonic() < end:\n"
         "    time.sleep(1e-5)\n")


def serve(cgroup: TestCgroup, port: int, prefix: str, requests: int) -> list[str]:
    proc = cgroup.spawn([sys.executable, str(SERVER), "--otlp-traces-endpoint", f"http://127.0.0.1:{port}",
                         "--requests", str(requests), "--cpu", "0", "--prefix", prefix],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=server_env(None))
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err
    return [json.loads(line)["request_id"] for line in out.splitlines() if "request_id" in line]


@pytest.fixture(scope="module")
def flood(tmp_path_factory):
    needs_kernel()
    tmp = tmp_path_factory.mktemp("cfg")
    config = tmp / "slatrace.yaml"
    config.write_text(f"event_rate: {EVENT_RATE}\n"
                      f"services:\n  - name: {SERVICE}\n    cgroup: \"/slatrace-test-drops-{os.getpid()}-*\"\n")
    port = free_port()
    with Agent("--otlp-grpc-listen", f"127.0.0.1:{port}", "--otlp-http-listen", "off", config=config,
               interval=0.5) as agent, TestCgroup("drops") as svc:
        calm = serve(svc, port, f"calm-{os.getpid()}", 2)
        wait_for_requests(agent, set(calm))
        time.sleep(1.0)  # a drain or more after the calm requests: no drop can overlap them
        flooders = [svc.spawn(["taskset", "-c", "0", sys.executable, "-c", FLOOD.format(seconds=60)])
                    for _ in range(2)]
        try:
            time.sleep(1.0)
            flooded = serve(svc, port, f"flood-{os.getpid()}", 3)
            got = wait_for_requests(agent, set(calm) | set(flooded))
        finally:
            for p in flooders:
                p.kill()
                p.wait()
        _, metrics = http_get(agent.url + "/metrics")
        agent.stop()
        yield calm, flooded, got, metrics.decode(), agent.output()


def test_requests_served_during_the_flood_are_marked_a_lower_bound(flood):
    calm, flooded, got, _, _ = flood
    assert set(calm) | set(flooded) <= set(got)
    for rid in flooded:
        doc = got[rid]
        assert doc["sched_complete"] is False, doc
        assert doc["sched_dropped_events"] > 0 and doc["sched"]["dropped_events"] == doc["sched_dropped_events"]
    for rid in calm:
        assert got[rid]["sched_complete"] is True and got[rid]["sched_dropped_events"] == 0, got[rid]


def test_the_kernels_count_of_dropped_events_covers_the_marks(flood):
    _, flooded, got, metrics, _ = flood
    fam = {f.name: f for f in text_string_to_metric_families(metrics)}["slatrace_bpf_map_errors"]
    limited = next(s.value for s in fam.samples if s.labels["map"] == "events_rate_limited")
    # Each request counts the drops of the drains it overlaps; together they
    # never exceed what the kernel dropped, and the flood went far past the limit.
    assert limited > 10 * EVENT_RATE
    assert max(got[rid]["sched_dropped_events"] for rid in flooded) <= limited


def test_the_agent_warns_once_and_names_the_setting(flood):
    *_, log = flood
    warnings = [line for line in log.splitlines() if "event stream dropped" in line]
    assert len(warnings) == 1, warnings
    assert "raise event_rate in the config file" in warnings[0] and "lower bound" in warnings[0]
