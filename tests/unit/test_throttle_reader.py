"""Throttling per service on fake cgroup trees: the cpu controller on v1 (found
through /proc/PID/cgroup) and on v2 (the service's cgroup or an ancestor)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.throttle import CpuHierarchy, ThrottleLedger, ThrottleReader, find_cpu_hierarchy

HYBRID = """cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
"""
UNIFIED = "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime 0 0\n"


def test_find_cpu_hierarchy() -> None:
    assert find_cpu_hierarchy(HYBRID) == CpuHierarchy(1, Path("/sys/fs/cgroup/cpu"))
    combined = HYBRID.replace("rw,relatime,cpu 0", "rw,relatime,cpu,cpuacct 0")
    assert find_cpu_hierarchy(combined).version == 1
    assert find_cpu_hierarchy(UNIFIED, lambda root: "cpuset cpu io memory pids") == CpuHierarchy(
        2, Path("/sys/fs/cgroup"))
    assert find_cpu_hierarchy(UNIFIED, lambda root: "memory pids") is None


def _dir(root: Path, rel: str) -> Path:
    d = root / rel.strip("/")
    d.mkdir(parents=True, exist_ok=True)
    return d


def test_v1_cpu_cgroups_found_through_proc(tmp_path: Path) -> None:
    v2, v1, proc = tmp_path / "v2", tmp_path / "v1", tmp_path / "proc"
    (_dir(v2, "/svc") / "cgroup.procs").write_text("10\n11\n")
    (_dir(v2, "/other") / "cgroup.procs").write_text("12\n")
    for pid, cpu in ((10, "/limited/leaf"), (11, "/limited"), (12, "/")):
        _dir(proc, str(pid))
        (proc / str(pid) / "cgroup").write_text(f"4:memory:/x\n2:cpu,cpuacct:{cpu}\n0::/svc\n")
    limited = _dir(v1, "/limited")
    (limited / "cpu.cfs_quota_us").write_text("20000\n")
    (_dir(v1, "/limited/leaf") / "cpu.cfs_quota_us").write_text("-1\n")
    (limited / "cpu.stat").write_text("nr_periods 10\nnr_throttled 5\nthrottled_time 500000000\n")
    old = os.stat(limited).st_ctime
    r = ThrottleReader(CpuHierarchy(1, v1), v2, proc, started_at=old + 3600)  # cgroup older than the agent
    services = {"svc": ["/svc"], "other": ["/other"]}
    assert r.poll(services) == {}  # first reading of an old cgroup is the baseline
    (limited / "cpu.stat").write_text("nr_periods 20\nnr_throttled 9\nthrottled_time 750000000\n")
    assert r.poll(services) == {"svc": pytest.approx(0.25)}
    assert r.map_builds == 1
    # A cgroup born after the agent started was watched all its life: counted in full.
    r2 = ThrottleReader(CpuHierarchy(1, v1), v2, proc, started_at=old - 10)
    assert r2.poll(services) == {"svc": pytest.approx(0.75)}


def test_v2_quota_on_an_ancestor_and_final_reading(tmp_path: Path) -> None:
    v2 = tmp_path / "v2"
    pod = _dir(v2, "/kubepods/pod1")
    (pod / "cpu.max").write_text("50000 100000\n")
    (pod / "cpu.stat").write_text("usage_usec 1\nthrottled_usec 1000\n")
    (_dir(v2, "/kubepods/pod1/c1") / "cpu.max").write_text("max 100000\n")
    (_dir(v2, "/free") / "cpu.max").write_text("max 100000\n")
    now = [0.0]
    r = ThrottleReader(CpuHierarchy(2, v2), v2, tmp_path / "proc", started_at=0.0, map_refresh_s=10,
                       clock=lambda: now[0])
    assert r.poll({"app": ["/kubepods/pod1/c1"], "free": ["/free"]}) == {"app": pytest.approx(0.001)}
    (pod / "cpu.stat").write_text("usage_usec 1\nthrottled_usec 301000\n")
    now[0] = 20.0  # remap is due, and "app" is gone from the services: one last reading
    assert r.poll({"free": ["/free"]}) == {"app": pytest.approx(0.3)}
    assert r.poll({"free": ["/free"]}) == {}


def test_ledger_windows_and_totals() -> None:
    led = ThrottleLedger(retention_s=10.0)
    led.add(1.0, {"a": 0.5})
    led.add(2.0, {"a": 0.25, "b": 1.0})
    assert led.between(1.0, 2.0) == {"a": 0.25, "b": 1.0}
    assert led.between(0.0, 2.0) == {"a": 0.75, "b": 1.0}
    led.add(20.0, {})
    assert led.between(0.0, 20.0) == {}
    assert led.totals() == {"a": 0.75, "b": 1.0}


def test_services_are_mapped_again_a_share_per_poll(tmp_path: Path, monkeypatch) -> None:
    """Each service is mapped again within map_refresh_s, a share of them per
    poll, rather than all of them in one poll; a new cgroup is mapped at once."""
    v2 = tmp_path / "v2"
    services = {}
    for i in range(100):
        d = _dir(v2, f"/s{i}")
        (d / "cpu.max").write_text("50000 100000\n")
        (d / "cpu.stat").write_text("usage_usec 1\nthrottled_usec 0\n")
        services[f"s{i}"] = [f"/s{i}"]
    now = [0.0]
    r = ThrottleReader(CpuHierarchy(2, v2), v2, tmp_path / "proc", started_at=0.0, map_refresh_s=10,
                       clock=lambda: now[0])
    mapped: list[set[str]] = []
    real = r._build_map
    monkeypatch.setattr(r, "_build_map", lambda wanted: mapped.append(set(wanted)) or real(wanted))
    r.poll(services)
    assert mapped[-1] == set(services)           # the first poll maps every service
    for _ in range(10):
        now[0] += 1.0
        r.poll(services)
    assert [len(m) for m in mapped[1:]] == [10] * 10
    assert set().union(*mapped[1:]) == set(services)
    # A service with a new cgroup is mapped on the next poll, whatever its turn.
    (_dir(v2, "/s5b") / "cpu.max").write_text("max 100000\n")
    now[0] += 0.01
    r.poll({**services, "s5": ["/s5", "/s5b"]})
    assert "s5" in mapped[-1]


def test_limits_are_read_every_poll_and_a_new_one_found_when_the_kernel_sees_it(tmp_path: Path) -> None:
    v2 = tmp_path / "v2"
    pod = _dir(v2, "/kubepods/pod1")
    (pod / "cpu.max").write_text("max 100000\n")
    (pod / "cpu.stat").write_text("usage_usec 1\nthrottled_usec 0\n")
    leaf = "/kubepods/pod1/cri-containerd-0123"
    (_dir(v2, leaf) / "cpu.max").write_text("max 100000\n")
    now = [0.0]
    r = ThrottleReader(CpuHierarchy(2, v2), v2, tmp_path / "proc", started_at=0.0, map_refresh_s=60,
                       clock=lambda: now[0])
    services = {"app": [leaf]}
    r.poll(services)
    assert r.limits() == {}
    # The pod gets a limit; the map is not due for a minute, but the kernel
    # saw the service's waits held by a limit: it is found at once.
    (pod / "cpu.max").write_text("50000 100000\n")
    r.poll(services)              # no time since the last map: no share of the services is due
    assert r.limits() == {}
    r.poll(services, limited=["app"])
    (limit,) = r.limits()["app"]
    assert (limit.cgroup, limit.setting, limit.cpus, limit.level) == (
        "/kubepods/pod1", "cpu.max 50000 100000", 0.5, "pod")
    # Changed in place: read again at the next poll.
    (pod / "cpu.max").write_text("25000 100000\n")
    builds = r.map_builds
    r.poll(services)
    assert r.limits()["app"][0].cpus == 0.25 and r.map_builds == builds
