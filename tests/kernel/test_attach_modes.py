"""BTF-typed tracepoints (task-local storage), raw tracepoints (task_struct.pid
at its BTF offset) and classic tracepoints attached side by side over the same
scene: each gives the tracefs reference's figures for the victim, and the
others'."""

from __future__ import annotations

import pytest

from tests.support.attach_scene import assert_agree, assert_each_matches_the_reference, run_scene
from tests.support.tracefs import percentile

pytestmark = pytest.mark.kernel


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
        scene = run_scene({p.mode: p for p in probes})
    finally:
        for p in probes:
            p.close()
    got, ref = scene.victim, scene.reference
    print("".join(f"\n{mode} {got[mode]}" for mode in modes)
          + f"\nreference: {len(ref.runq_waits_ns)} waits, {ref.total_wait_ns} ns, {len(ref.preemptions)} "
          f"preemptions, p99 {percentile(ref.runq_waits_ns, 0.99)}")
    assert_each_matches_the_reference(scene)
    for mode in modes[:-1]:
        assert_agree(scene, mode, "classic")


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
