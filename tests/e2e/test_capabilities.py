"""The DaemonSet's capability set, measured on this kernel rather than guessed.

The real `slatrace run` is started as uid 0 holding exactly the capabilities
deploy/daemonset.yaml adds (bounding, inheritable, permitted, effective and
ambient sets, plus no_new_privs for allowPrivilegeEscalation: false), and must
become ready and report data. Each listed capability is then shown to be needed:
the kernel itself refuses the BPF programs without it (the agent's own
privilege check bypassed), and `slatrace run` says so in one line. Finally the
pod's view of the node is rehearsed with a private mount namespace: read-only
tracefs, cgroupfs and root filesystem, no debugfs, no node kernel headers (the
image's headers tree, chosen by the image's entrypoint), read-only /proc/sys.
No container engine exists here; the mount namespace stands in for one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.support import needs_kernel, require_kernel
from tests.support.agent import REPO, SLATRACE, Agent, free_port, http_get
from tests.support.workload import TestCgroup, read_schedstat, victim_argv

pytestmark = pytest.mark.e2e

DAEMONSET = REPO / "deploy" / "daemonset.yaml"
ENTRYPOINT = REPO / "scripts" / "container-entrypoint.sh"
SETUP = REPO / "scripts" / "setup.sh"
BPF_STATS = Path("/proc/sys/kernel/bpf_stats_enabled")
# linux/capability.h: the capabilities a BPF agent could plausibly need.
CAP_BITS = {"DAC_OVERRIDE": 1, "DAC_READ_SEARCH": 2, "SYS_PTRACE": 19, "SYS_ADMIN": 21,
            "SYS_RESOURCE": 24, "PERFMON": 38, "BPF": 39}

# Loads the probe the way the daemon does, minus the daemon's own privilege
# check, so what refuses is the kernel. Prints one result line.
LOAD_PROBE = """
import sys
from pathlib import Path
from agent.probe.mounts import find_cgroup2_mount
from agent.probe import features as feat
tracefs = feat.find_tracefs()
states = feat.parse_switch_states((tracefs / "events/sched/sched_switch/format").read_text())
cgroup2 = Path(find_cgroup2_mount(Path("/proc/mounts").read_text()))
from agent.probe.loader import Probe
try:
    probe = Probe.load(feat.Features(tracefs=tracefs, states=states, cgroup2=cgroup2))
except Exception as e:
    print("REFUSED", e)
    sys.exit(3)
probe.snapshot()
probe.close()
print("LOADED")
"""


def manifest_caps() -> list[str]:
    ds = yaml.safe_load(DAEMONSET.read_text())
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    return list(container["securityContext"]["capabilities"]["add"])


def cap_mask(caps: list[str]) -> int:
    unknown = set(caps) - CAP_BITS.keys()
    assert not unknown, f"add {unknown} to CAP_BITS to test them"
    return sum(1 << CAP_BITS[c] for c in caps)


def with_caps(caps: list[str]) -> list[str]:
    """setpriv prefix: uid 0 with exactly `caps` in every set, as a container
    runtime starts a root container with capabilities drop ALL + add caps."""
    spec = ",".join(["-all"] + [f"+{c.lower()}" for c in caps])
    return ["setpriv", "--no-new-privs", f"--inh-caps={spec}", f"--ambient-caps={spec}",
            f"--bounding-set={spec}"]


def status_caps(pid: int) -> dict[str, int]:
    text = Path(f"/proc/{pid}/status").read_text()
    return {k: int(v, 16) for k, v in re.findall(r"^(Cap\w+):\s*([0-9a-f]+)$", text, re.M)} | {
        "NoNewPrivs": int(re.search(r"^NoNewPrivs:\s*(\d)", text, re.M).group(1))}


def one_clear_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.fixture(scope="module", autouse=True)
def prerequisites() -> None:
    needs_kernel()
    if shutil.which("setpriv") is None:
        require_kernel("setpriv (util-linux) is not installed")


@pytest.fixture(scope="module")
def caps() -> list[str]:
    caps = manifest_caps()
    assert caps, "the DaemonSet adds no capability: it cannot load BPF programs"
    return caps


def test_agent_works_with_exactly_the_manifest_capabilities(caps: list[str]):
    with TestCgroup("caps") as cg:
        agent = Agent(interval=0.5)
        agent.cmd = with_caps(caps) + agent.cmd
        with agent:
            held = status_caps(agent.proc.pid)
            # The proof the run below is not a root run in disguise.
            for key in ("CapEff", "CapPrm", "CapBnd", "CapInh"):
                assert held[key] == cap_mask(caps), (key, hex(held[key]))
            assert held["NoNewPrivs"] == 1
            victim = cg.spawn(victim_argv(1.5, sleep_ms=1.0, work_ms=0.3))
            time.sleep(1.2)
            runs = sum(s.timeslices for s in read_schedstat(victim.pid).values())
            assert victim.wait(timeout=15) == 0
            time.sleep(1.2)  # two more intervals
            doc = agent.get_json("/api/v1/attribution?since=60")
            assert http_get(agent.url + "/livez")[0] == 200
    record = next((r for r in doc["attribution"] if r["service"] == cg.path), None)
    assert record is not None, f"no attribution for {cg.path}: {[r['service'] for r in doc['attribution']]}"
    # A victim that sleeps 1 ms runs hundreds of times a second; tracepoints may
    # miss a few percent of switches here (KERNEL-NOTES), so compare loosely
    # with the kernel's own count, taken before the victim's last 0.3 s.
    assert runs > 200
    assert record["runq"]["count"] >= 0.5 * runs, (record["runq"], runs)
    assert record["runq"]["wait_seconds"] > 0


@pytest.mark.parametrize("cap", manifest_caps())
def test_kernel_refuses_the_programs_without(cap: str, caps: list[str]):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    full = subprocess.run(with_caps(caps) + [sys.executable, "-c", LOAD_PROBE], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert full.returncode == 0 and "LOADED" in full.stdout, full.stdout + full.stderr
    fewer = [c for c in caps if c != cap]
    r = subprocess.run(with_caps(fewer) + [sys.executable, "-c", LOAD_PROBE], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 3 and "REFUSED" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("cap", manifest_caps())
def test_run_without_a_required_capability_says_so(cap: str, caps: list[str]):
    fewer = [c for c in caps if c != cap]
    try:
        r = subprocess.run(with_caps(fewer) + SLATRACE + ["run", "--listen", "127.0.0.1:0",
                                                          "--otlp-grpc-listen", "off", "--otlp-http-listen", "off"],
                           cwd=REPO, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:  # subprocess.run has killed it
        pytest.fail(f"slatrace run kept running without CAP_{cap}: drop it from the DaemonSet", pytrace=False)
    assert r.returncode != 0
    line = one_clear_line(r.stderr)
    assert f"CAP_{cap}" in line, line


def test_bpf_stats_need_no_sys_admin_when_the_node_enables_them(caps: list[str]):
    # The agent cannot write kernel.bpf_stats_enabled without CAP_SYS_ADMIN (and
    # /proc/sys is read-only in a pod anyway): with the sysctl set on the node,
    # its self-cost metrics move all the same.
    assert "SYS_ADMIN" not in caps
    before = BPF_STATS.read_text().strip()
    if before == "0":
        BPF_STATS.write_text("1")
    try:
        agent = Agent(interval=0.5)
        agent.cmd = with_caps(caps) + agent.cmd
        with agent:
            assert status_caps(agent.proc.pid)["CapEff"] & 1 << CAP_BITS["SYS_ADMIN"] == 0
            time.sleep(1.0)
            status, body = http_get(agent.url + "/metrics")
    finally:
        if before == "0":
            BPF_STATS.write_text("0")
    assert status == 200
    m = re.search(r'^slatrace_bpf_events_total\{program="sched_switch"\} (\S+)$', body.decode(), re.M)
    assert m and float(m.group(1)) > 0, "BPF self-cost metrics should move with the sysctl on"


POD_VIEW = """
set -eu
headers="$1"; repo="$2"; shift 2
# What a pod of deploy/daemonset.yaml sees of the node:
mount -t tmpfs none /mnt
mkdir /mnt/headers /mnt/repo
mount --bind "$repo" /mnt/repo             # the image's /opt/slatrace (may live under /tmp here)
mount --bind "$headers" /mnt/headers && mount -o remount,bind,ro /mnt/headers   # the image's tree
mount -t tmpfs none /sys/kernel/debug                                            # no debugfs
mount --bind /sys/kernel/tracing /sys/kernel/tracing && mount -o remount,bind,ro /sys/kernel/tracing
cg=$(awk '$3 == "cgroup2" {print $2; exit}' /proc/mounts)
mount --bind "$cg" "$cg" && mount -o remount,bind,ro "$cg"
mount -t tmpfs -o ro none /lib/modules     # a node without headers
mount -t tmpfs -o ro none /usr/src
mount --bind /proc/sys /proc/sys && mount -o remount,bind,ro /proc/sys
mount -t tmpfs none /tmp                   # the emptyDir
mkdir -p "$repo" && mount --bind /mnt/repo "$repo"
mount -o remount,bind,ro /                 # readOnlyRootFilesystem
exec "$@"
"""


@pytest.fixture(scope="module")
def headers_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The image's fallback headers, made by the same set-up step the Dockerfile runs."""
    if shutil.which("unshare") is None:
        require_kernel("unshare (util-linux) is not installed")
    dest = tmp_path_factory.mktemp("image") / "kernel-headers"
    r = subprocess.run([str(SETUP), "--headers-tree", str(dest)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert (dest / "include" / "linux" / "kconfig.h").is_file()
    assert (dest / "include" / "generated" / "autoconf.h").is_file()
    return dest


def pod_command(tmp_path: Path, headers: Path, fallback: str, caps: list[str], port: int) -> list[str]:
    script = tmp_path / "pod-view.sh"
    script.write_text(POD_VIEW)
    return (["unshare", "--mount", "--propagation", "private", "sh", str(script), str(headers), str(REPO),
             "env", f"SLATRACE_FALLBACK_HEADERS={fallback}", f"SLATRACE_BIN={Path(sys.executable).parent / 'slatrace'}",
             "PYTHONDONTWRITEBYTECODE=1"]
            + with_caps(caps)
            # The program cache off: each start compiles, with the headers the pod sees.
            + [str(ENTRYPOINT), "run", "--listen", f"127.0.0.1:{port}", "--otlp-grpc-listen", "off",
               "--otlp-http-listen", "off", "--interval", "0.5", "--bpf-cache", "off"])


def test_agent_runs_in_the_pods_view_of_the_node(tmp_path: Path, headers_tree: Path, caps: list[str]):
    port = free_port()
    proc = subprocess.Popen(pod_command(tmp_path, headers_tree, "/mnt/headers", caps, port), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        ready = False
        while time.monotonic() < deadline and proc.poll() is None and not ready:
            try:
                ready = http_get(f"http://127.0.0.1:{port}/readyz", timeout=1.0)[0] == 200
            except OSError:
                pass
            time.sleep(0.1)
        assert ready, f"not ready in the pod's view (exit {proc.poll()})"
        time.sleep(1.0)
        status, body = http_get(f"http://127.0.0.1:{port}/api/v1/attribution?since=60")
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    counts = [r["runq"]["count"] for r in json.loads(body)["attribution"]]
    assert status == 200 and max(counts) > 0
    # The entrypoint noticed the node has no headers and used the image's.
    assert "using the image's linux-headers-" in out, out


def test_without_the_headers_fallback_the_pod_view_has_no_headers(tmp_path: Path, headers_tree: Path,
                                                                  caps: list[str]):
    # The control for the test above: the mounts really hide the node's headers.
    r = subprocess.run(pod_command(tmp_path, headers_tree, "/nonexistent", caps, free_port()), cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "cannot load the BPF programs" in r.stderr
    assert "Traceback" not in r.stderr
