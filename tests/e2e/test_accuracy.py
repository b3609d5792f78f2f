"""The agent's per-service figures against an exact reference computed another
way: every raw sched event of the victim's threads recorded through tracefs
(tight bounds) and the kernel's own schedstat accounting (loose bounds: on
these VMs a few percent of context switches are never traced)."""

from __future__ import annotations

import pytest

from tests.e2e.scenes import victim_beside_hogs
from tests.support.agent import Agent
from tests.support.tracefs import percentile
from tests.support.workload import TestCgroup

pytestmark = pytest.mark.e2e

VICTIM_SECONDS = 6.0


def _run_victim(tmp_path, work_ms: float):
    """A victim beside two CPU hogs per CPU, each group its own service; the
    agent's record of the victim, the tracefs reference and schedstat."""
    with TestCgroup("noisy") as noisy, TestCgroup("victim") as victim_cg:
        config = tmp_path / "slatrace.yaml"
        config.write_text(
            "services:\n"
            f"  - name: noisy\n    cgroup: \"{noisy.path}\"\n"
            f"  - name: victim\n    cgroup: \"{victim_cg.path}\"\n"
        )
        with Agent(config=config, interval=0.5) as agent:
            run = victim_beside_hogs(agent, noisy, victim_cg, "victim", VICTIM_SECONDS, work_ms, interval=0.5)
    assert run.record is not None, "the agent has no record of the victim"
    return run.record, run.reference, run.schedstat, run.hog_tids


def _seconds(waits) -> float:
    return sum(w.wait_ns for w in waits) / 1e9


def test_victim_beside_noisy_neighbour(kernel: None, tmp_path) -> None:
    """Sleeps ~1 ms, works ~0.3 ms: nearly all its wait comes after wakeups,
    while a hog holds the CPU."""
    record, ref, stat, hog_tids = _run_victim(tmp_path, work_ms=0.3)
    waits = ref.runq_waits_ns
    ss_wait_s = sum(s.wait_ns for s in stat.values()) / 1e9
    runq = record["runq"]
    print(f"\nagent: count={runq['count']} wait={runq['wait_seconds'] * 1e3:.2f} ms "
          f"p50={runq['p50'] * 1e6:.0f} p95={runq['p95'] * 1e6:.0f} p99={runq['p99'] * 1e6:.0f} us")
    print(f"tracefs: count={len(waits)} wait={ref.total_wait_s * 1e3:.2f} ms "
          f"p50={percentile(waits, 0.5) / 1e3:.0f} p95={percentile(waits, 0.95) / 1e3:.0f} "
          f"p99={percentile(waits, 0.99) / 1e3:.0f} us; schedstat wait={ss_wait_s * 1e3:.2f} ms")
    print(f"wakeup: {record['wakeup']}\npreemption: {record['preemption']}\nverdict: {record['verdict']}")

    assert len(waits) > 1000, "the victim hardly ran: the workload is broken"
    assert runq["wait_seconds"] == pytest.approx(ref.total_wait_s, rel=0.10)
    assert runq["wait_seconds"] == pytest.approx(ss_wait_s, rel=0.30)
    assert runq["count"] == pytest.approx(len(waits), rel=0.10)
    assert runq["p95"] == pytest.approx(percentile(waits, 0.95) / 1e9, rel=0.05)
    assert runq["p99"] == pytest.approx(percentile(waits, 0.99) / 1e9, rel=0.05)

    # Blame: the waits after wakeups, by who held the CPU when they ended.
    behind = {b["service"]: b["wait_seconds"] for b in record["wakeup"]["behind"]}
    ref_behind_hogs = _seconds(w for w in ref.wakeup_waits if w.preemptor in hog_tids)
    assert record["wakeup"]["behind"][0]["service"] == "noisy"
    assert behind["noisy"] == pytest.approx(ref_behind_hogs, rel=0.10)
    assert record["wakeup"]["wait_seconds"] + record["preemption"]["wait_seconds"] == \
        pytest.approx(runq["wait_seconds"], rel=0.01)
    assert record["blame"]["culprits"][0]["service"] == "noisy"
    assert "noisy" in record["verdict"]


def test_preempted_victim_names_its_preemptor(kernel: None, tmp_path) -> None:
    """Works 2 ms per wakeup, longer than its slice beside the hogs, so the
    hogs also take the CPU from it mid-burst: who preempted whom."""
    record, ref, _, hog_tids = _run_victim(tmp_path, work_ms=2.0)
    by = record["preemption"]["by"]
    ref_by_hogs = ref.preemptions_by(hog_tids)
    print(f"\npreemption: {record['preemption']}\nreference: {len(ref.preemptions)} preemptions, "
          f"{len(ref_by_hogs)} by the hogs ({_seconds(ref_by_hogs) * 1e3:.1f} ms)")
    assert len(ref_by_hogs) > 50, "the hogs hardly preempted the victim: the workload is broken"
    assert by[0]["service"] == "noisy"
    noisy = by[0]
    assert noisy["count"] == pytest.approx(len(ref_by_hogs), rel=0.10)
    assert noisy["wait_seconds"] == pytest.approx(_seconds(ref_by_hogs), rel=0.10)
    assert record["preemption"]["wait_seconds"] == pytest.approx(_seconds(ref.preemptions), rel=0.10)
