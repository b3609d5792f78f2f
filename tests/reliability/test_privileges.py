"""What blocks the agent, named by `check` (which really creates a BPF map and
opens a tracepoint event) and by `run`: a missing capability, a seccomp filter
that refuses bpf() or perf_event_open(), tracefs permissions. Non-root uids
hold capabilities through setpriv; seccomp filters are installed by
tests/support/seccomp.py before exec, as a container runtime does."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.support.agent import REPO, SLATRACE, free_port

pytestmark = pytest.mark.usefixtures("kernel")

NOBODY = ["--reuid", "65534", "--regid", "65534", "--clear-groups"]


def as_user(caps: list[str], uid: bool = True) -> list[str]:
    spec = ",".join(["-all"] + [f"+{c}" for c in caps])
    return ["setpriv", *(NOBODY if uid else []), f"--inh-caps={spec}", f"--ambient-caps={spec}",
            f"--bounding-set={spec}", "--"]


def seccomp(*calls: str) -> list[str]:
    return [sys.executable, "-m", "tests.support.seccomp", ",".join(calls), "--"]


@pytest.fixture(autouse=True)
def _setpriv():
    if shutil.which("setpriv") is None:
        pytest.fail("setpriv (util-linux) is missing: make setup-test installs it")


def check(prefix: list[str]) -> dict[str, tuple[bool, str]]:
    r = subprocess.run([*prefix, *SLATRACE, "check", "--json"], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    doc = json.loads(r.stdout)
    assert r.returncode == (0 if doc["ok"] else 1)
    return {c["name"]: (c["ok"], c["detail"]) for c in doc["checks"]}


def run_line(prefix: list[str]) -> str:
    r = subprocess.run([*prefix, *SLATRACE, "run", "--listen", f"127.0.0.1:{free_port()}",
                        "--otlp-grpc-listen", "off", "--otlp-http-listen", "off"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_non_root_with_bpf_and_perfmon_is_told_about_tracefs_permissions():
    checks = check(as_user(["bpf", "perfmon"]))
    assert checks["privileges"][0] and checks["bpf-map"][0]
    ok, detail = checks["tracefs"]
    assert not ok and "mode 0700" in detail and "CAP_DAC_READ_SEARCH" in detail
    assert "not mounted" not in detail
    line = run_line(as_user(["bpf", "perfmon"]))
    assert "CAP_DAC_READ_SEARCH" in line and "not mounted" not in line


def test_non_root_with_what_the_readme_lists_passes_every_kernel_check():
    checks = check(as_user(["bpf", "perfmon", "dac_read_search"]))
    for name in ("privileges", "bpf-map", "tracefs", "perf-event", "tracepoint:sched:sched_switch"):
        assert checks[name][0], (name, checks[name])


def test_non_root_without_perfmon_is_told_which_capability():
    checks = check(as_user(["bpf", "dac_read_search"]))
    ok, detail = checks["privileges"]
    assert not ok and "CAP_PERFMON" in detail and "CAP_BPF" not in detail.split("without")[1].split(",")[0]
    ok, detail = checks["perf-event"]
    assert not ok and "lacks CAP_PERFMON" in detail
    assert "CAP_PERFMON" in run_line(as_user(["bpf", "dac_read_search"]))


def test_uid_0_without_capabilities_is_not_told_to_run_as_root():
    line = run_line(as_user([], uid=False))
    assert "uid 0 but without CAP_BPF and CAP_PERFMON" in line
    assert "as root" not in line


@pytest.mark.parametrize("blocked, check_name", [("bpf", "bpf-map"), ("perf_event_open", "perf-event")])
def test_a_seccomp_filter_is_named(blocked: str, check_name: str):
    checks = check(seccomp(blocked))
    assert checks["privileges"][0]
    ok, detail = checks[check_name]
    assert not ok and "seccomp" in detail, detail
    line = run_line(seccomp(blocked))
    assert "seccomp" in line and "compile" not in line
