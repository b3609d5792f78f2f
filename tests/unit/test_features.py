"""Kernel-feature parsing on recorded tracefs formats of two kernel generations."""

import dataclasses
import os
from pathlib import Path

import pytest

from agent.probe import features

FIXTURES = Path(__file__).parent / "fixtures"


def test_preempt_bit_and_states_current_kernel():
    # 6.x: TASK_REPORT_MAX = ((0x7f) + 1) << 1 = 0x100; D = 0x2; X = 0x10, Z = 0x20
    st = features.parse_switch_states((FIXTURES / "sched_switch.format-6.18").read_text())
    assert (st.preempt, st.d, st.dead) == (0x100, 0x2, 0x30)


def test_preempt_bit_and_states_old_kernel():
    # 4.x before TASK_REPORT: preempt = TASK_STATE_MAX = 2048, Z = 16, X = 32
    st = features.parse_switch_states((FIXTURES / "sched_switch.format-4.x").read_text())
    assert (st.preempt, st.d, st.dead) == (2048, 2, 48)


def test_format_without_preempt_flag_is_rejected():
    with pytest.raises(ValueError, match="preempt"):
        features.parse_switch_states('print fmt: "prev_state=%s", REC->prev_state ? "S" : "R"')


def test_expression_evaluator_refuses_anything_but_integer_arithmetic():
    assert features._eval_int("((0x1 | 0x2) + 1) << 1") == 8
    with pytest.raises(ValueError):
        features._eval_int("__import__('os').getpid()")


def test_privileges_from_capability_mask():
    root = "CapEff:\t000001ffffffffff\n"
    bpf_perfmon = f"CapEff:\t{(1 << 39) | (1 << 38):016x}\n"
    nobody = "CapEff:\t0000000000000000\n"
    features.check_privileges(root)
    features.check_privileges(bpf_perfmon)
    with pytest.raises(features.FeatureError, match="CAP_BPF"):
        features.check_privileges(nobody)
    with pytest.raises(features.FeatureError):
        features.check_privileges(f"CapEff:\t{1 << 39:016x}\n")  # BPF without PERFMON


def test_check_and_the_probe_read_one_prerequisite_list(monkeypatch):
    """`slatrace check` lists the probe's own prerequisites: what stops the
    agent at start (detect) is the first failing item of the same list, with
    the same words. tracefs is made to look absent to have one fail."""
    from agent.check import run_checks
    from agent.probe import features

    monkeypatch.setattr(features, "find_tracefs", lambda *a, **k: None)
    items, _ = features.prerequisites()
    failing = [p for p in items if not p.ok]
    assert failing and "tracefs" in {p.name for p in failing}
    with pytest.raises(features.FeatureError) as e:
        features.detect()
    assert str(e.value) == failing[0].detail
    checks = {c.name: (c.ok, c.detail) for c in run_checks()}
    assert all(checks[p.name] == (p.ok, p.detail) for p in items)
    assert {"bcc", "kernel-headers"} <= set(checks)   # what BCC needs besides


def test_check_names_the_attachment_the_agent_will_take(monkeypatch, tmp_path):
    """BTF-typed tracepoints where the kernel has task-local storage, raw ones
    with the offsets read from this kernel's BTF, or classic ones, each with
    why and its cost against the cheapest; never a failure, since classic
    ones work anywhere."""
    from agent import check
    from agent.probe import btf, loader

    if btf.VMLINUX.exists():    # this kernel's own BTF, where it has one
        got = check.attachment()
        layout = btf.task_layout()
        assert got.ok and f"pid at byte {layout.pid_offset}" in got.detail
        assert f".flags at {layout.flags_offset}" in got.detail
        mode = loader.attach_mode(features_with(layout))
        assert mode == ("btf" if layout.btf_trace_ids else "raw")
        assert f": {mode} tracepoints" in got.detail
        assert ("the cheapest mode, ~" if mode == "btf" else "x the cheapest mode's") in got.detail
        # Without task-local storage (5.10): raw ones, and why.
        old = dataclasses.replace(layout, btf_trace_ids=(), btf_tracing_missing="no task-local storage")
        monkeypatch.setattr(check, "task_layout", lambda: old)
        assert loader.attach_mode(features_with(old)) == "raw"
        raw = check.attachment().detail
        assert ": raw tracepoints, because BTF-typed ones are not usable (no task-local storage)" in raw
        assert f"{check.MODE_COST_NS['raw'] / check.MODE_COST_NS['btf']:.2f}x the cheapest" in raw
        with pytest.raises(ValueError) as e:
            loader.attach_mode(features_with(old), "btf")
        assert str(e.value) == "BTF-typed tracepoints are not usable on this kernel: no task-local storage"
    missing = tmp_path / "vmlinux"
    monkeypatch.setattr(check, "task_layout", lambda: btf.task_layout(missing))
    classic = check.attachment()
    assert classic.ok and str(missing) in classic.detail
    assert classic.detail.startswith(f"kernel {os.uname().release}: classic tracepoints, because raw ones")


def features_with(layout):
    from agent.probe.features import Features

    return Features(tracefs=None, states=None, cgroup2=None, task_layout=layout, raw_unavailable=None)


def test_a_cgroup_v1_only_host_is_refused_with_the_fix():
    """A v1-only host (Amazon Linux 2's default) has no cgroup v2 mount: one
    sentence says why figures would be wrong there and what to boot with."""
    mounts = ("cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,nosuid,nodev,noexec,relatime,cpu,cpuacct 0 0\n"
              "cgroup /sys/fs/cgroup/memory cgroup rw,nosuid,nodev,noexec,relatime,memory 0 0\n"
              "cgroup /sys/fs/cgroup/systemd cgroup rw,nosuid,nodev,noexec,relatime,xattr,name=systemd 0 0\n")
    text = features.cgroup_v1_only_problem(mounts)
    assert text.startswith("no cgroup v2 hierarchy is mounted: this host places processes in cgroup v1 "
                           "hierarchies only (cpu, cpuacct, memory)")
    assert "systemd.unified_cgroup_hierarchy=1" in text and ". " not in text
    assert "no cgroup hierarchy is mounted" in features.cgroup_v1_only_problem("")


def test_kernels_before_5_8_are_refused_in_one_sentence():
    assert features.kernel_version("5.10.0-46-amd64").ok
    assert features.kernel_version("6.18.44-fc-v1147").ok
    old = features.kernel_version("5.4.0-150-generic")
    assert not old.ok and old.detail.startswith("kernel 5.4.0-150-generic is older than 5.8")


def test_an_attach_mode_the_kernel_cannot_do_is_refused_in_one_sentence():
    from agent.probe import loader
    from agent.probe.features import Features

    no_btf = Features(tracefs=None, states=None, cgroup2=None, task_layout=None,
                      raw_unavailable="cannot read the kernel's BTF at /sys/kernel/btf/vmlinux (No such file)")
    assert loader.attach_mode(no_btf, "auto") == loader.attach_mode(no_btf, "classic") == "classic"
    with pytest.raises(ValueError) as e:
        loader.attach_mode(no_btf, "raw")
    assert str(e.value) == ("raw tracepoints are not usable on this kernel: cannot read the kernel's BTF at "
                            "/sys/kernel/btf/vmlinux (No such file)")
