"""Workloads shared by the blame, CLI and Prometheus tests: real cgroups on
this machine, each one a service of its own.

- contention: a victim that computes in 20 ms bursts between 1 ms sleeps, beside
  "heavy" (four busy loops at nice 0) and "light" (one busy loop at nice 3,
  about half the weight of one heavy loop). The victim's measured preemption
  waits must rank heavy first, light second, both present. Given a CPU, all
  six share it: on two CPUs the load balancer may otherwise settle light on
  the CPU the victim is not on, and light then never delays it at all.
- quota: one busy loop under its own CPU quota (cgroup v2 cpu.max where the cpu
  controller is on v2, else the v1 cpu hierarchy's cpu.cfs_quota_us).
- victim_beside_hogs: a victim that sleeps ~1 ms and works a little, beside two
  pinned busy loops per CPU, every raw sched event recorded through tracefs:
  the agent's record of the victim against the exact reference.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from agent.throttle import find_cpu_hierarchy
from tests.support.agent import Agent
from tests.support.tracefs import Reference, TraceRecorder, reference
from tests.support.workload import Schedstat, TestCgroup, hog_argv, read_schedstat, victim_argv, wait_zombie

HEAVY_HOGS = 4
LIGHT_NICE = 3


@dataclass
class Contention:
    heavy: TestCgroup
    light: TestCgroup
    victim: TestCgroup
    victim_pid: int


@contextlib.contextmanager
def contention(seconds: float, heavy_hogs: int = HEAVY_HOGS, cpu: int | None = None) -> Iterator[Contention]:
    pin = [] if cpu is None else ["taskset", "-c", str(cpu)]
    with TestCgroup("heavy") as heavy, TestCgroup("light") as light, TestCgroup("victim") as victim:
        for _ in range(heavy_hogs):
            heavy.spawn(hog_argv(cpu))
        light.spawn(["nice", "-n", str(LIGHT_NICE)] + hog_argv(cpu))
        p = victim.spawn(pin + victim_argv(seconds, sleep_ms=1.0, work_ms=20.0))
        yield Contention(heavy, light, victim, p.pid)


@dataclass
class QuotaCgroup:
    """Where the quota lives and how to read the kernel's own throttled time."""

    version: int
    directory: Path      # the cgroup holding the quota
    wrap: list[str]      # argv prefix that moves the program into it first (v1)

    def throttled_seconds(self) -> float:
        stat = dict(line.split() for line in (self.directory / "cpu.stat").read_text().splitlines())
        if self.version == 2:
            return int(stat["throttled_usec"]) / 1e6
        return int(stat["throttled_time"]) / 1e9


@contextlib.contextmanager
def quota(service: TestCgroup, percent: int) -> Iterator[QuotaCgroup]:
    """A CPU quota of `percent` of one CPU (100 ms period) for `service`."""
    hierarchy = find_cpu_hierarchy(Path("/proc/mounts").read_text())
    if hierarchy is None:
        raise RuntimeError("no cpu controller on this host (neither cgroup v2 nor a v1 cpu hierarchy)")
    quota_us = 1000 * percent
    if hierarchy.version == 2:
        root_control = service.mount / "cgroup.subtree_control"
        if "cpu" not in root_control.read_text().split():
            root_control.write_text("+cpu")
        (service.dir / "cpu.max").write_text(f"{quota_us} 100000")
        yield QuotaCgroup(2, service.dir, [])
        return
    directory = hierarchy.root / f"slatrace-test-quota-{secrets.token_hex(3)}"
    directory.mkdir()
    try:
        (directory / "cpu.cfs_period_us").write_text("100000")
        (directory / "cpu.cfs_quota_us").write_text(str(quota_us))
        wrap = ["/bin/sh", "-c", f'echo $$ > {directory}/cgroup.procs && exec "$@"', "sh"]
        yield QuotaCgroup(1, directory, wrap)
    finally:
        # The test's own cgroup kills the processes; the v1 group is ours to remove.
        with contextlib.suppress(OSError):
            for pid in (directory / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    import os
                    os.kill(int(pid), 9)
        import time
        for _ in range(100):
            try:
                directory.rmdir()
                break
            except OSError:
                time.sleep(0.05)


@dataclass
class VictimRun:
    record: dict | None            # the agent's attribution record of the victim (None: it has none)
    reference: Reference           # exact, from the raw tracefs events of its threads
    schedstat: dict[int, Schedstat]
    hog_tids: set[int]


def victim_beside_hogs(agent: Agent, noisy: TestCgroup, victim_cg: TestCgroup, service: str, seconds: float,
                       work_ms: float, interval: float) -> VictimRun:
    """Four pinned busy loops in `noisy` (two per CPU), then a victim in
    `victim_cg` recorded through tracefs over its whole life; `service` is the
    victim's name in the agent."""
    for i in range(4):
        noisy.spawn(hog_argv(cpu=i % 2))
    time.sleep(0.3)
    hog_tids = set(noisy.tids())
    with TraceRecorder() as rec:
        victim = victim_cg.spawn(victim_argv(seconds, sleep_ms=1.0, work_ms=work_ms))
        wait_zombie(victim.pid, timeout=seconds + 30)
        stat = read_schedstat(victim.pid)
        time.sleep(2.4 * interval)  # two more intervals: the victim's last waits are collected
        # asked before the recorder drains and decodes its buffers, which can
        # take longer than a short retention on a busy host
        records = agent.get_json(f"/api/v1/attribution?service={service}&since=600")["attribution"]
    assert victim.wait() == 0
    assert len(records) <= 1, records
    return VictimRun(records[0] if records else None, reference(rec.events, stat.keys()), stat, hog_tids)
