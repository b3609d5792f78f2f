"""Test support: workloads in their own cgroups and a tracefs reference.

Kernel and end-to-end tests compare the agent against numbers computed another
way (raw tracefs events, /proc schedstat); the tools for that live here.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest

REQUIRE_KERNEL_ENV = "SLATRACE_REQUIRE_KERNEL"
# Records the kernel's ring buffer may refuse in one scene, each counted (the
# events error): from 6.15 its lock is a resilient spinlock, which gives up
# (a timeout, a deadlock check) rather than wait, and it refused one record,
# in a nearly empty 4 MiB buffer, in each of two runs of the whole suite
# beside emulated guests. A scene whose checks are one for one allows none.
RING_REFUSALS = 1
TRACEFS_CANDIDATES = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))


def require_kernel(reason: str) -> None:
    """Skip a kernel test, or fail it where it must run (CI sets the env)."""
    if os.environ.get(REQUIRE_KERNEL_ENV) == "1":
        pytest.fail(f"kernel test cannot run: {reason}", pytrace=False)
    pytest.skip(reason)


def needs_kernel() -> None:
    """At the start of a kernel or e2e test or fixture: skip it (fail it in CI)
    with the one sentence kernel_unavailable() gives, if it cannot run here."""
    reason = kernel_unavailable()
    if reason:
        require_kernel(reason)


def kernel_unavailable() -> str | None:
    """Why kernel tests cannot run here, or None when they can.

    A separate check from the recorder's own errors so that a missing
    prerequisite skips (or fails in CI) with one clear sentence.
    """
    if os.geteuid() != 0:
        return "needs root (tracefs instances and cgroup v2 directories)"
    if not any((p / "instances").is_dir() for p in TRACEFS_CANDIDATES):
        return "tracefs is not mounted (mount -t tracefs nodev /sys/kernel/tracing)"
    from tests.support.workload import cgroup2_mount

    if cgroup2_mount() is None:
        return "no cgroup v2 hierarchy is mounted"
    return None


def pid_alive(pid: int) -> bool:
    """Whether pid exists; names of test cgroups and instances carry their owner's pid."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def rmdir_when_free(path: Path, timeout: float = 5.0) -> None:
    """rmdir a cgroup or tracefs instance, retrying while the kernel says EBUSY.

    A cgroup stays busy until its killed tasks have fully exited, an instance
    while a reader still holds one of its files open.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.02)
