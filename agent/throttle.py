"""CPU-quota throttling per service, from the kernel's own `cpu.stat`.

Where the cpu controller lives depends on the host: on a unified host it is on
the v2 tree (`cpu.max`, `cpu.stat` throttled_usec), on a hybrid one it may be a
v1 hierarchy (`cpu.cfs_quota_us`, `cpu.stat` throttled_time in ns) whose cgroups
have nothing to do with the v2 paths services are keyed by. So a service's
v2 cgroups are mapped to the cgroups that actually hold its CPU quota: the same
v2 cgroup or its nearest ancestor with a quota, or, on v1, the nearest cgroup
with a quota above the v1 cpu cgroup of each of its processes
(/proc/PID/cgroup).

That mapping costs a directory walk and a /proc read per process, so a
service is mapped again only when it shows a cgroup it did not have, or once
every `map_refresh_s` (60 s; a share of the services each poll, so a quota set
later or a process moved between v1 cgroups is seen within a minute); each interval then
reads one cpu.stat per quota cgroup and nothing else.
Deltas are kept per interval for the retention window, like the store's.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CpuHierarchy", "CpuLimit", "ThrottleLedger", "ThrottleReader", "find_cpu_hierarchy"]

log = logging.getLogger(__name__)

_VANISHED = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ENODEV, errno.ESRCH})


@dataclass(frozen=True)
class CpuHierarchy:
    """Where the cpu controller is: `version` 2 (root = the v2 mount) or 1 (root =
    the v1 mount carrying "cpu"); None when the host has no cpu controller."""

    version: int
    root: Path


def find_cpu_hierarchy(mounts_text: str, v2_controllers: Callable[[Path], str] | None = None) -> CpuHierarchy | None:
    """The cpu controller's hierarchy, from /proc/mounts content.

    A v1 mount with "cpu" among its options wins when present: a controller is
    bound to one hierarchy only, so v2 cannot have it then. Otherwise v2 has it
    if its root's cgroup.controllers lists it."""
    if v2_controllers is None:
        def v2_controllers(root: Path) -> str:
            try:
                return (root / "cgroup.controllers").read_text()
            except OSError:
                return ""
    v2: Path | None = None
    for line in mounts_text.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        point = Path(parts[1].replace("\\040", " "))
        if parts[2] == "cgroup" and "cpu" in parts[3].split(","):
            return CpuHierarchy(1, point)
        if parts[2] == "cgroup2" and v2 is None:
            v2 = point
    if v2 is not None and "cpu" in v2_controllers(v2).split():
        return CpuHierarchy(2, v2)
    return None


@dataclass(frozen=True)
class _QuotaCgroup:
    path: Path           # absolute directory of the cgroup holding the quota
    version: int


@dataclass(frozen=True)
class CpuLimit:
    """A CPU limit on a service's cgroups, as its operator set it."""

    cgroup: str          # path of the cgroup holding it, in its hierarchy ("/kubepods/.../pod<uid>")
    version: int         # cgroup version of the cpu controller
    quota_us: int
    period_us: int

    @property
    def cpus(self) -> float:
        return self.quota_us / self.period_us if self.period_us else 0.0

    @property
    def level(self) -> str:
        """Which Kubernetes object the cgroup is, when it is one: "pod",
        "container", else "cgroup"."""
        leaf = self.cgroup.rstrip("/").rsplit("/", 1)[-1]
        if leaf.startswith("pod") or "-pod" in leaf:
            return "pod"
        if leaf.startswith(("cri-containerd-", "crio-", "docker-", "containerd-")) or \
                (len(leaf) == 64 and all(c in "0123456789abcdef" for c in leaf)):
            return "container"
        return "cgroup"

    @property
    def setting(self) -> str:
        """The setting as it is written: `cpu.max 50000 100000` or its v1 pair."""
        if self.version == 2:
            return f"cpu.max {self.quota_us} {self.period_us}"
        return f"cpu.cfs_quota_us {self.quota_us} / cpu.cfs_period_us {self.period_us}"

    def as_dict(self) -> dict:
        return {"cgroup": self.cgroup, "setting": self.setting, "quota_seconds": self.quota_us / 1e6,
                "period_seconds": self.period_us / 1e6, "cpus": self.cpus, "level": self.level}


def _read_limit(directory: Path, root: Path, version: int) -> CpuLimit | None:
    try:
        if version == 2:
            quota, period = (directory / "cpu.max").read_text().split()[:2]
        else:
            quota = (directory / "cpu.cfs_quota_us").read_text().strip()
            period = (directory / "cpu.cfs_period_us").read_text().strip()
        q, p = int(quota), int(period)
    except (OSError, ValueError):
        return None
    if q <= 0:
        return None
    return CpuLimit("/" + str(directory.relative_to(root)).strip("."), version, q, p)


def _read_throttled_ns(cg: _QuotaCgroup) -> int | None:
    """Cumulative throttled time of one cgroup in ns, None if it is gone."""
    key = "throttled_usec" if cg.version == 2 else "throttled_time"
    try:
        text = (cg.path / "cpu.stat").read_text()
    except OSError as e:
        if e.errno not in _VANISHED:
            log.warning("cannot read %s/cpu.stat: %s", cg.path, e)
        return None
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value) * (1000 if cg.version == 2 else 1)
    return None


def _has_quota(directory: Path, version: int) -> bool:
    try:
        if version == 2:
            return (directory / "cpu.max").read_text().split()[0] != "max"
        return int((directory / "cpu.cfs_quota_us").read_text()) > 0
    except (OSError, ValueError, IndexError):
        return False


class ThrottleReader:
    """Per-interval throttled seconds of each service.

    `poll(cgroups_by_service)` takes service -> v2 cgroup paths (relative to the
    v2 mount) and returns service -> seconds throttled since the previous poll.
    A quota cgroup shared by several services counts for each of them: all of
    them were stalled while it was throttled.
    """

    def __init__(
        self,
        hierarchy: CpuHierarchy | None,
        v2_root: Path,
        proc_root: Path = Path("/proc"),
        *,
        map_refresh_s: float = 60.0,
        started_at: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.hierarchy = hierarchy
        self.v2_root = Path(v2_root)
        self.proc = Path(proc_root)
        self.map_refresh_s = map_refresh_s
        self._clock = clock
        # A quota cgroup created after the agent started was watched for its whole
        # life, so its first reading counts in full; an older one is a baseline.
        self.started_at = time.time() if started_at is None else started_at
        self._mapped_at: float | None = None   # when the previous poll mapped
        self._cursor = 0                       # where the next share of services to map again starts
        self._mapped_services: dict[str, frozenset[str]] = {}
        self._quota_of: dict[str, set[_QuotaCgroup]] = {}
        self._last: dict[_QuotaCgroup, int] = {}
        self._limit: dict[_QuotaCgroup, CpuLimit] = {}   # read when mapped
        self.map_builds = 0
        self.errors = 0

    def poll(self, cgroups_by_service: Mapping[str, Iterable[str]],
             limited: Iterable[str] = ()) -> dict[str, float]:
        """`limited`: services the kernel saw held by a CPU limit in the
        interval; one with no limit known yet is mapped again at once (a limit
        set since its last look)."""
        if self.hierarchy is None:
            return {}
        wanted = {s: frozenset(p) for s, p in cgroups_by_service.items()}
        now = self._clock()
        # Mapped again: a service that shows a cgroup it did not have, and a
        # share of the others so that each is looked at again within
        # map_refresh_s (processes move between v1 cgroups, quotas are set
        # later). Spread over the polls, a node's thousand services never
        # cost one poll a thousand directory walks at once.
        stale = [s for s, paths in wanted.items() if not paths <= self._mapped_services.get(s, frozenset())
                 or (s in limited and not self._quota_of.get(s))]
        stale_set = set(stale)
        rest = sorted(s for s in wanted if s not in stale_set)
        if self._mapped_at is None:
            due = rest
        else:
            share = min(1.0, max(0.0, now - self._mapped_at) / self.map_refresh_s)
            take = min(len(rest), int(len(rest) * share + 0.999))
            start = self._cursor % len(rest) if rest else 0
            due = (rest[start:] + rest[:start])[:take]
            self._cursor = start + take
        self._mapped_at = now
        retired: dict[str, set[_QuotaCgroup]] = {}
        remap = stale + due
        if remap:
            found = self._build_map({s: wanted[s] for s in remap})
            self.map_builds += 1
            for s in remap:
                self._mapped_services[s] = wanted[s]
                old = self._quota_of.get(s, set())
                new = found.get(s, set())
                # Cgroups that left the map (their process exited or moved) get
                # one last reading, so their final throttling is not lost.
                if old - new:
                    retired[s] = old - new
                if new:
                    self._quota_of[s] = new
                else:
                    self._quota_of.pop(s, None)
        for s in [s for s in self._quota_of if s not in wanted]:
            retired.setdefault(s, set()).update(self._quota_of.pop(s))
            self._mapped_services.pop(s, None)
        readings: dict[_QuotaCgroup, int | None] = {}
        out: dict[str, float] = {}
        for services in (self._quota_of, retired):
            for service, cgs in services.items():
                total = 0
                for cg in cgs:
                    if cg not in readings:
                        readings[cg] = self._delta(cg)
                        if services is self._quota_of:
                            self._reread_limit(cg)
                    total += readings[cg] or 0
                if total:
                    out[service] = out.get(service, 0.0) + total / 1e9
        live = {cg for cgs in self._quota_of.values() for cg in cgs}
        for cg in [cg for cg in self._last if cg not in live]:
            del self._last[cg]
        for cg in [cg for cg in self._limit if cg not in live]:
            del self._limit[cg]
        return out

    def _reread_limit(self, cg: _QuotaCgroup) -> None:
        """A quota changed in place is seen at the next poll, not the next map."""
        assert self.hierarchy is not None
        limit = _read_limit(cg.path, self.hierarchy.root, cg.version)
        if limit is None:
            self._limit.pop(cg, None)
        else:
            self._limit[cg] = limit

    def limits(self) -> dict[str, tuple[CpuLimit, ...]]:
        """service -> the CPU limits on its cgroups (the nearest of each), as
        read at the last poll (a limit set on a cgroup that had none is found
        when the service is mapped again: at once when the kernel sees its
        waits held by a limit, else within map_refresh_s)."""
        out = {}
        for service, cgs in self._quota_of.items():
            found = tuple(sorted((self._limit[cg] for cg in cgs if cg in self._limit), key=lambda limit: limit.cgroup))
            if found:
                out[service] = found
        return out

    def _delta(self, cg: _QuotaCgroup) -> int | None:
        cur = _read_throttled_ns(cg)
        if cur is None:
            self._last.pop(cg, None)
            return None
        prev = self._last.get(cg)
        self._last[cg] = cur
        if prev is None:
            return cur if self._born_after_start(cg.path) else 0
        return cur - prev if cur >= prev else cur  # went down: re-created

    def _born_after_start(self, directory: Path) -> bool:
        try:
            return os.stat(directory).st_ctime >= self.started_at
        except OSError:
            return False

    def _build_map(self, wanted: Mapping[str, frozenset[str]]) -> dict[str, set[_QuotaCgroup]]:
        assert self.hierarchy is not None
        out: dict[str, set[_QuotaCgroup]] = {}
        for service, paths in wanted.items():
            found: set[_QuotaCgroup] = set()
            for rel in paths:
                if self.hierarchy.version == 2:
                    cg = self._nearest_quota(self.hierarchy.root, rel, 2)
                    if cg is not None:
                        found.add(cg)
                else:
                    for v1_rel in self._v1_cpu_paths(rel):
                        cg = self._nearest_quota(self.hierarchy.root, v1_rel, 1)
                        if cg is not None:
                            found.add(cg)
            if found:
                out[service] = found
        return out

    def _nearest_quota(self, root: Path, rel: str, version: int) -> _QuotaCgroup | None:
        parts = [p for p in rel.split("/") if p and p not in (".", "..")]
        while parts:  # the root cgroup never has a quota
            directory = root.joinpath(*parts)
            if _has_quota(directory, version):
                cg = _QuotaCgroup(directory, version)
                limit = _read_limit(directory, root, version)
                if limit is not None:
                    self._limit[cg] = limit
                return cg
            parts.pop()
        return None

    def _v1_cpu_paths(self, v2_rel: str) -> set[str]:
        """The v1 cpu cgroups of the processes in one v2 cgroup."""
        parts = [p for p in v2_rel.split("/") if p and p not in (".", "..")]
        try:
            pids = (self.v2_root.joinpath(*parts) / "cgroup.procs").read_text().split()
        except OSError:
            return set()
        out = set()
        for pid in pids:
            try:
                lines = (self.proc / pid / "cgroup").read_text().splitlines()
            except OSError:
                continue  # exited meanwhile
            for line in lines:
                _, controllers, path = line.split(":", 2)
                if "cpu" in controllers.split(","):
                    out.add(path)
        return out


class ThrottleLedger:
    """Per-interval throttled seconds for the retention window, plus totals
    since start (which only grow: the Prometheus counter is built on them)."""

    def __init__(self, retention_s: float) -> None:
        self.retention_s = retention_s
        self._lock = threading.Lock()
        self._records: deque[tuple[float, dict[str, float]]] = deque()
        self._totals: dict[str, float] = {}
        self._limits: dict[str, tuple[CpuLimit, ...]] = {}

    def set_limits(self, limits: Mapping[str, tuple[CpuLimit, ...]]) -> None:
        with self._lock:
            self._limits = dict(limits)

    def limits_of(self, service: str) -> tuple[CpuLimit, ...]:
        """The CPU limits on the service's cgroups, as last read."""
        with self._lock:
            return self._limits.get(service, ())

    def add(self, end: float, seconds: Mapping[str, float]) -> None:
        with self._lock:
            self._records.append((end, dict(seconds)))
            while self._records and self._records[0][0] < end - self.retention_s:
                self._records.popleft()
            for s, v in seconds.items():
                self._totals[s] = self._totals.get(s, 0.0) + v

    def between(self, start: float, end: float) -> dict[str, float]:
        """Throttled seconds of intervals that ended in (start, end] — the same
        intervals a store window from `start` to `end` merged."""
        out: dict[str, float] = {}
        with self._lock:
            for t, seconds in self._records:
                if start < t <= end:
                    for s, v in seconds.items():
                        out[s] = out.get(s, 0.0) + v
        return out

    def totals(self) -> dict[str, float]:
        with self._lock:
            return dict(self._totals)
