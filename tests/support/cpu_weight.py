"""A CPU weight for a test's neighbour, and a CPU limit for a test's service,
wherever the cpu controller lives.

A neighbour delays a latency-sensitive service only when it weighs more (as a
pod with larger CPU requests does): at equal weight the service's short,
waking threads preempt a hog at once. On a hybrid hierarchy the cpu controller
may sit on cgroup v1 (and autogroup makes `nice` meaningless), so the weight is
v1's `cpu.shares` there, v2's `cpu.weight` where cpu is on v2.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType

from tests.support import pid_alive, rmdir_when_free

V1_SHARES_PER_WEIGHT = 1024 / 100   # cpu.shares 1024 = cpu.weight 100, the default of both


def v1_cpu_mount(mounts_text: str | None = None) -> Path | None:
    """Where the v1 cpu controller is mounted, if it is."""
    text = mounts_text if mounts_text is not None else Path("/proc/mounts").read_text()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[2] == "cgroup" and "cpu" in parts[3].split(","):
            return Path(parts[1])
    return None


class CpuWeight:
    """Processes added get `weight` (cgroup v2 units: 100 is the default) for as
    long as the context lasts. `v2_dir` is the test cgroup the processes are
    already in, used when the cpu controller is on v2."""

    def __init__(self, name: str, weight: int, v2_dir: Path) -> None:
        self.weight = weight
        self._v1 = v1_cpu_mount()
        if self._v1 is not None:
            self.dir = self._v1 / f"slatrace-test-{name}-{os.getpid()}"
        else:
            self.dir = v2_dir

    def __enter__(self) -> "CpuWeight":
        if self._v1 is not None:
            for stale in self._v1.glob("slatrace-test-*-*"):   # left by a run that was killed
                owner = stale.name.rsplit("-", 1)[-1]
                if owner.isdigit() and not pid_alive(int(owner)):
                    _empty_and_remove(self._v1, stale)
            self.dir.mkdir()
            (self.dir / "cpu.shares").write_text(str(int(self.weight * V1_SHARES_PER_WEIGHT)))
        else:
            parent = self.dir.parent / "cgroup.subtree_control"
            if "cpu" not in parent.read_text().split():
                parent.write_text("+cpu")
            (self.dir / "cpu.weight").write_text(str(self.weight))
        return self

    def add(self, pid: int) -> None:
        if self._v1 is not None:
            (self.dir / "cgroup.procs").write_text(str(pid))

    def limit(self, quota_us: int | None, period_us: int = 100_000) -> None:
        """A CFS bandwidth limit of quota_us per period_us (None: none), as a
        Kubernetes CPU limit sets it: v1's cpu.cfs_quota_us, v2's cpu.max."""
        if self._v1 is not None:
            (self.dir / "cpu.cfs_period_us").write_text(str(period_us))
            (self.dir / "cpu.cfs_quota_us").write_text(str(-1 if quota_us is None else quota_us))
        else:
            (self.dir / "cpu.max").write_text(f"{'max' if quota_us is None else quota_us} {period_us}")

    def throttled_ns(self) -> int:
        """The wall time the group was throttled, from its cpu.stat."""
        stat = dict(line.split() for line in (self.dir / "cpu.stat").read_text().splitlines())
        return int(stat["throttled_time"]) if "throttled_time" in stat else int(stat["throttled_usec"]) * 1000

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._v1 is not None:
            _empty_and_remove(self._v1, self.dir)


def _empty_and_remove(root: Path, cgroup: Path) -> None:
    """Whatever is left goes back to the root: a v1 cgroup with tasks cannot be removed."""
    for pid in (cgroup / "cgroup.procs").read_text().split():
        try:
            (root / "cgroup.procs").write_text(pid)
        except OSError:
            pass  # exited meanwhile
    rmdir_when_free(cgroup)
