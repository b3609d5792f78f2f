"""The agent's per-service figures against an exact reference computed another
way: every raw sched event of the victim's threads recorded through tracefs
(tight bounds) and the kernel's own schedstat accounting (loose bounds: on
these VMs a few percent of context switches are never traced)."""

from __future__ import annotations

import time

import pytest

from tests.support import kernel_unavailable, require_kernel
from tests.support.agent import Agent
from tests.support.tracefs import TraceRecorder, percentile, reference
from tests.support.workload import (TestCgroup, hog_argv, read_schedstat, victim_argv,
                                    wait_zombie)

pytestmark = pytest.mark.e2e

VICTIM_SECONDS = 6.0


@pytest.fixture
def kernel() -> None:
    reason = kernel_unavailable()
    if reason:
        require_kernel(reason)


def test_victim_beside_noisy_neighbour(kernel: None, tmp_path) -> None:
    with TestCgroup("noisy") as noisy, TestCgroup("victim") as victim_cg:
        config = tmp_path / "slatrace.yaml"
        config.write_text(
            "services:\n"
            f"  - name: noisy\n    cgroup: \"{noisy.path}\"\n"
            f"  - name: victim\n    cgroup: \"{victim_cg.path}\"\n"
        )
        with Agent(config=config, interval=0.5) as agent:
            for i in range(4):
                noisy.spawn(hog_argv(cpu=i % 2))  # two hogs per CPU
            time.sleep(0.3)
            with TraceRecorder(buffer_kb=65536, stream=True) as rec:
                victim = victim_cg.spawn(victim_argv(VICTIM_SECONDS, sleep_ms=1.0, work_ms=0.3))
                wait_zombie(victim.pid, timeout=VICTIM_SECONDS + 30)
                stat = read_schedstat(victim.pid)
            assert victim.wait() == 0
            time.sleep(1.2)  # two more intervals: the victim's last waits are collected
            doc = agent.get_json("/api/v1/attribution?service=victim&since=600")

    [record] = doc["attribution"]
    ref = reference(rec.events, stat.keys(), r_is_preemption=True)
    waits = ref.runq_waits_ns
    ss_wait_s = sum(s.wait_ns for s in stat.values()) / 1e9
    runq = record["runq"]
    print(f"\nagent: count={runq['count']} wait={runq['wait_seconds'] * 1e3:.2f} ms "
          f"p50={runq['p50'] * 1e6:.0f} p95={runq['p95'] * 1e6:.0f} p99={runq['p99'] * 1e6:.0f} us")
    print(f"tracefs: count={len(waits)} wait={ref.total_wait_s * 1e3:.2f} ms "
          f"p50={percentile(waits, 0.5) / 1e3:.0f} p95={percentile(waits, 0.95) / 1e3:.0f} "
          f"p99={percentile(waits, 0.99) / 1e3:.0f} us; schedstat wait={ss_wait_s * 1e3:.2f} ms")
    print(f"preemption: {record['preemption']}")

    assert len(waits) > 1000, "the victim hardly ran: the workload is broken"
    assert runq["wait_seconds"] == pytest.approx(ref.total_wait_s, rel=0.10)
    assert runq["wait_seconds"] == pytest.approx(ss_wait_s, rel=0.30)
    assert runq["count"] == pytest.approx(len(waits), rel=0.10)
    assert runq["p95"] == pytest.approx(percentile(waits, 0.95) / 1e9, rel=0.05)
    assert runq["p99"] == pytest.approx(percentile(waits, 0.99) / 1e9, rel=0.05)

    by = record["preemption"]["by"]
    assert by and by[0]["service"] == "noisy"
    ref_by_hogs = sum(p.wait_ns for p in ref.preemptions) / 1e9
    assert record["preemption"]["wait_seconds"] == pytest.approx(ref_by_hogs, rel=0.10)
