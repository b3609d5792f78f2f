"""Raw tracepoints (task_struct.pid at its BTF offset) and classic tracepoints
attached side by side over the same scene: both give the tracefs reference's
figures for the victim, and each other's."""

from __future__ import annotations

import os
import time

import pytest

from agent.probe.snapshot import HIST_IOWAIT, HIST_RUNQ
from tests.support.tracefs import TraceRecorder, percentile, reference
from tests.support.workload import TestCgroup, hog_argv, iowait_argv, victim_argv, wait_zombie

pytestmark = pytest.mark.kernel


def _figures(snap, cgid: int) -> dict[str, float]:
    runq = snap.hists.get((cgid, HIST_RUNQ), {})
    io = snap.hists.get((cgid, HIST_IOWAIT), {})
    preempted = [p for (v, _), p in snap.pairs.items() if v == cgid]
    return {"runq_count": sum(b.count for b in runq.values()), "runq_ns": sum(b.sum_ns for b in runq.values()),
            "io_count": sum(b.count for b in io.values()), "preemptions": sum(p.count for p in preempted),
            "preempted_ns": sum(p.wait_ns for p in preempted)}


def test_raw_and_classic_tracepoints_agree_with_the_reference(kernel):
    from agent.probe import features
    from agent.probe.loader import Probe

    f = features.detect()
    if f.task_layout is None:
        pytest.fail(f"raw tracepoints are not usable on this kernel: {f.raw_unavailable}")
    raw = Probe.load(f, tracepoints="raw")
    classic = Probe.load(f, tracepoints="classic")
    try:
        assert (raw.mode, classic.mode) == ("raw", "classic")
        with TestCgroup("noisy") as noisy, TestCgroup("victim") as victim_cg, TestCgroup("io") as io_cg:
            for i in range(4):
                noisy.spawn(hog_argv(cpu=i % 2))
            time.sleep(0.3)
            for p in (raw, classic):
                p.snapshot()
            with TraceRecorder() as rec:
                v = victim_cg.spawn(victim_argv(3.0, sleep_ms=1.0, work_ms=2.0))
                io = io_cg.spawn(iowait_argv(2.0))
                wait_zombie(v.pid, timeout=40)
                tids = {int(t) for t in os.listdir(f"/proc/{v.pid}/task")}
                io.wait(timeout=40)
            time.sleep(0.05)
            snaps = {p.mode: p.snapshot() for p in (raw, classic)}
            got = {mode: _figures(s, victim_cg.id) for mode, s in snaps.items()}
            io_counts = {mode: _figures(s, io_cg.id)["io_count"] for mode, s in snaps.items()}
            v.wait()
    finally:
        raw.close()
        classic.close()
    ref = reference(rec.events, tids)
    print(f"\nraw {got['raw']}\nclassic {got['classic']}\nreference: {len(ref.runq_waits_ns)} waits, "
          f"{ref.total_wait_ns} ns, {len(ref.preemptions)} preemptions, p99 {percentile(ref.runq_waits_ns, 0.99)}")
    assert len(ref.runq_waits_ns) > 200 and len(ref.preemptions) > 20
    for mode, fig in got.items():
        assert fig["runq_count"] == pytest.approx(len(ref.runq_waits_ns), rel=0.03), mode
        assert fig["runq_ns"] == pytest.approx(ref.total_wait_ns, rel=0.03), mode
        assert fig["preemptions"] == pytest.approx(len(ref.preemptions), rel=0.05), mode
        assert io_counts[mode] > 10, mode
    for key in ("runq_count", "runq_ns", "preemptions", "preempted_ns"):
        assert got["raw"][key] == pytest.approx(got["classic"][key], rel=0.02, abs=3), key
    assert io_counts["raw"] == pytest.approx(io_counts["classic"], rel=0.02, abs=3)
