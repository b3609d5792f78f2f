"""BTF-typed tracepoints (task-local storage), raw tracepoints (task_struct.pid
at its BTF offset) and classic tracepoints attached side by side over the same
scene: each gives the tracefs reference's figures for the victim, and the
others'."""

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


def test_every_attach_mode_agrees_with_the_reference(kernel):
    """BTF-typed (where the kernel has them), raw and classic tracepoints, all
    loaded at once, count the same waits as the tracefs reference and as
    each other."""
    from agent.probe import features
    from agent.probe.loader import Probe

    f = features.detect()
    if f.task_layout is None:
        pytest.fail(f"raw tracepoints are not usable on this kernel: {f.raw_unavailable}")
    modes = (["btf"] if f.task_layout.btf_trace_ids else []) + ["raw", "classic"]
    probes = []
    try:
        for mode in modes:
            probes.append(Probe.load(f, tracepoints=mode))
        assert [p.mode for p in probes] == modes
        with TestCgroup("noisy") as noisy, TestCgroup("victim") as victim_cg, TestCgroup("io") as io_cg:
            for i in range(4):
                noisy.spawn(hog_argv(cpu=i % 2))
            time.sleep(0.3)
            for p in probes:
                p.snapshot()
            with TraceRecorder() as rec:
                v = victim_cg.spawn(victim_argv(3.0, sleep_ms=1.0, work_ms=2.0))
                io = io_cg.spawn(iowait_argv(2.0))
                wait_zombie(v.pid, timeout=40)
                tids = {int(t) for t in os.listdir(f"/proc/{v.pid}/task")}
                io.wait(timeout=40)
            time.sleep(0.05)
            snaps = {p.mode: p.snapshot() for p in probes}
            got = {mode: _figures(s, victim_cg.id) for mode, s in snaps.items()}
            io_counts = {mode: _figures(s, io_cg.id)["io_count"] for mode, s in snaps.items()}
            v.wait()
    finally:
        for p in probes:
            p.close()
    ref = reference(rec.events, tids)
    print("".join(f"\n{mode} {got[mode]}" for mode in modes)
          + f"\nreference: {len(ref.runq_waits_ns)} waits, {ref.total_wait_ns} ns, {len(ref.preemptions)} "
          f"preemptions, p99 {percentile(ref.runq_waits_ns, 0.99)}")
    assert len(ref.runq_waits_ns) > 200 and len(ref.preemptions) > 20
    for mode, fig in got.items():
        assert fig["runq_count"] == pytest.approx(len(ref.runq_waits_ns), rel=0.03), mode
        assert fig["runq_ns"] == pytest.approx(ref.total_wait_ns, rel=0.03), mode
        assert fig["preemptions"] == pytest.approx(len(ref.preemptions), rel=0.05), mode
        assert io_counts[mode] > 10, mode
    for mode in modes[:-1]:
        for key in ("runq_count", "runq_ns", "preemptions", "preempted_ns"):
            assert got[mode][key] == pytest.approx(got["classic"][key], rel=0.02, abs=3), (mode, key)
        assert io_counts[mode] == pytest.approx(io_counts["classic"], rel=0.02, abs=3), mode


def test_auto_takes_raw_tracepoints_when_the_kernel_refuses_the_btf_typed_programs(kernel, monkeypatch):
    """A kernel may have task-local storage yet refuse it to tracing programs
    (5.11): "auto" then loads raw tracepoints and says why, and an explicit
    "btf" fails with the kernel's reason."""
    from agent.probe import build, features, loader, tracing

    f = features.detect()
    if not (f.task_layout and f.task_layout.btf_trace_ids):
        pytest.skip("this kernel offers no BTF-typed tracepoints")

    class Refused(build.PendingBuild):
        """The build process's answer when the kernel refuses a tp_btf program."""

        def __init__(self, src, cflags, mode, trace_ids, process=None) -> None:
            super().__init__(src, cflags, mode, trace_ids, process)
            self.mode = mode

        def result(self, timeout: float = build.BUILD_TIMEOUT_S) -> build.Built:
            if self.mode != "btf":
                return super().result(timeout)
            self.cancel()
            raise tracing.TracingError("the kernel refused the BTF-typed sched_switch program (Invalid argument)")

    monkeypatch.setattr(loader, "PendingBuild", Refused)
    p = loader.Probe.load(f, tracepoints="auto")
    try:
        assert p.mode == "raw" and "refused the BTF-typed sched_switch" in p.btf_refused
        assert "sched_switch" in p.program_fds()
    finally:
        p.close()
    with pytest.raises(tracing.TracingError):
        loader.Probe.load(f, tracepoints="btf")
