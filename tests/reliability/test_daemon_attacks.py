"""The real daemon (real BPF, root) against signals and host-state attacks:
SIGHUP reloads, BPF run-time stats only through a BPF_ENABLE_STATS fd that the
kernel releases even on SIGKILL."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.bpf_stats import BpfStatsSampler, enable_run_time_stats
from tests.support.agent import REPO, Agent, http_get

pytestmark = pytest.mark.usefixtures("kernel")

SYSCTL = Path("/proc/sys/kernel/bpf_stats_enabled")


def metric(url: str, name: str, labels: str = "") -> float | None:
    status, body = http_get(url + "/metrics")
    assert status == 200
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", body.decode(), re.M)
    return float(m.group(1)) if m else None


CONFIG = """\
services:
  - name: agent-itself
    comm: "no-such-command*"
slos:
  - service: host
    runq_p99: {target}
"""


def test_sighup_reloads_services_and_slos_and_a_bad_file_keeps_them(tmp_path: Path):
    path = tmp_path / "slatrace.yaml"
    path.write_text(CONFIG.format(target=0.005))
    sysctl_before = SYSCTL.read_text()
    with Agent(config=path, interval=0.5) as agent:
        deadline = time.monotonic() + 30
        while metric(agent.url, "slatrace_slo_target_seconds", '{service="host",slo="runq_p99"}') is None:
            assert time.monotonic() < deadline, "the host SLO never showed"
            time.sleep(0.2)
        path.write_text(CONFIG.format(target=0.004).replace("agent-itself", "me"))
        agent.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while metric(agent.url, "slatrace_slo_target_seconds", '{service="host",slo="runq_p99"}') != 0.004:
            assert time.monotonic() < deadline, "the reloaded SLO target never showed"
            time.sleep(0.2)
        path.write_text("slos: [")
        agent.proc.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert agent.proc.poll() is None
        assert http_get(agent.url + "/readyz")[0] == 200
        assert metric(agent.url, "slatrace_slo_target_seconds", '{service="host",slo="runq_p99"}') == 0.004
        assert agent.stop() == 0
    out = agent.output()
    assert SYSCTL.read_text() == sysctl_before
    reloads = [line for line in out.splitlines() if "reload" in line]
    assert len(reloads) == 2, out
    assert "services +me -agent-itself; slos ~host" in reloads[0]
    assert "ERROR" in reloads[1] and "keeping the running config" in reloads[1]
    assert "Traceback" not in out


def _counting_program():
    from bcc import BPF

    bpf = BPF(text='TRACEPOINT_PROBE(sched, sched_switch) { return 0; }')
    fd = bpf.load_func(b"tracepoint__sched__sched_switch", BPF.TRACEPOINT).fd
    return bpf, fd


def run_cnt(fd: int, pid: str = "self") -> int:
    for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines():
        if line.startswith("run_cnt:"):
            return int(line.split()[1])
    return 0


def moved_during(fd: int, seconds: float) -> int:
    before = run_cnt(fd)
    subprocess.run(["sh", "-c", "for i in $(seq 200); do :; done; sleep %s" % seconds], check=True)
    return run_cnt(fd) - before


@pytest.fixture
def sysctl_off():
    if SYSCTL.read_text().strip() != "0":
        pytest.skip("kernel.bpf_stats_enabled is on for the whole host: nothing to tell apart")


def test_stats_count_only_while_the_fd_is_held_and_end_on_sigkill(sysctl_off):
    bpf, fd = _counting_program()
    try:
        assert moved_during(fd, 0.3) == 0
        held = enable_run_time_stats()
        try:
            assert moved_during(fd, 0.3) > 0
            assert SYSCTL.read_text().strip() == "0"  # the host's setting is untouched
        finally:
            import os
            os.close(held)
        assert moved_during(fd, 0.3) == 0
        # Another process holds it and is killed: the kernel releases its fd.
        holder = subprocess.Popen([sys.executable, "-c", "from agent.bpf_stats import enable_run_time_stats as e;"
                                   "import time; e(); print('held', flush=True); time.sleep(60)"],
                                  cwd=REPO, stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "held"
        assert moved_during(fd, 0.3) > 0
        holder.kill()
        holder.wait()
        assert moved_during(fd, 0.3) == 0
    finally:
        bpf.cleanup()


def test_sampling_holds_stats_for_its_window_only(sysctl_off):
    bpf, fd = _counting_program()
    sampler = BpfStatsSampler("sampled", period_s=1.0, window_s=0.25)
    try:
        sampler.start()
        enabled = disabled = 0
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            (enabled := enabled + 1) if sampler.enabled else (disabled := disabled + 1)
            time.sleep(0.01)
        sampler.stop()
        assert sampler.samples >= 2
        share = enabled / (enabled + disabled)
        assert 0.1 < share < 0.45, share
        assert moved_during(fd, 0.2) == 0  # stopped: nothing held
    finally:
        bpf.cleanup()
