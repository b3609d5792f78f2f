"""cgroup id -> service name: the operator's rules first, then automatic names.

Called once per cgroup per interval by the aggregation loop, so answers are
cached per cgroup id; an entry is re-resolved when the cgroup's path changes or
after `refresh_s`, because `comm` and `pid` rules depend on which processes are
in the cgroup right now.
"""

from __future__ import annotations

import fnmatch
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from agent.config import ServiceRule
from agent.identity.cgroups import CgroupPaths, cgroup_glob_matches, cgroup_glob_regex

__all__ = [
    "HOST",
    "OTHER",
    "UNKNOWN",
    "Service",
    "ServiceResolver",
]

HOST = "host"
UNKNOWN = "unknown"
OTHER = "other"


@dataclass(frozen=True)
class Service:
    """A service name and where it came from: config, cgroup, kernel or host
    (k8s, systemd and docker once those resolvers exist)."""

    name: str
    source: str


# Not a service of its own (never listed): the name for ids with no cgroup behind them.
_UNKNOWN = Service(UNKNOWN, "unknown")


@dataclass(frozen=True)
class _CompiledRule:
    rule: ServiceRule
    cgroup: re.Pattern[str] | None
    # k8s_* and systemd_unit need metadata resolvers that do not exist yet; a rule
    # naming one cannot be satisfied, so it matches nothing rather than everything.
    unsatisfiable: bool


@dataclass
class _Entry:
    path: str | None
    service: Service
    resolved_at: float


class ServiceResolver:
    """Names the service of each cgroup id, and lists the services seen so far."""

    def __init__(
        self,
        rules: Iterable[ServiceRule],
        cgroup_paths: CgroupPaths,
        proc_root: Path = Path("/proc"),
        max_services: int = 500,
        *,
        refresh_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._rules = [
            _CompiledRule(
                rule=r,
                cgroup=cgroup_glob_regex(r.cgroup) if r.cgroup is not None else None,
                unsatisfiable=any(
                    v is not None
                    for v in (r.k8s_namespace, r.k8s_pod, r.k8s_container, r.systemd_unit)
                ),
            )
            for r in rules
        ]
        self._cgroups = cgroup_paths
        self._proc = Path(proc_root)
        self.max_services = max_services
        self.refresh_s = refresh_s
        self._clock = clock
        self._lock = threading.Lock()
        self._cache: dict[int, _Entry] = {}
        self._seen: dict[str, Service] = {}
        # Cached ids of removed cgroups are dropped this often; ids are never reused.
        self.sweep_s = max(60.0, refresh_s)
        self._swept_at = clock()

    def service_of(self, cgid: int) -> str:
        """The service name of cgroup `cgid` ("unknown" for 0 or a vanished id)."""
        return self.resolve(cgid).name

    def resolve(self, cgid: int) -> Service:
        """Like service_of, with the name's source."""
        if cgid == 0:
            return _UNKNOWN
        path = self._cgroups.path_of(cgid)
        now = self._clock()
        if now - self._swept_at >= self.sweep_s:
            self._sweep(now)
        with self._lock:
            entry = self._cache.get(cgid)
            if (
                entry is not None
                and entry.path == path
                and now - entry.resolved_at < self.refresh_s
            ):
                return entry.service
        if path is None:
            # Not cached: a removed cgroup's id never comes back, so keeping it
            # would only grow the cache.
            with self._lock:
                self._cache.pop(cgid, None)
            return _UNKNOWN
        service = self._admit(self._name(path))
        with self._lock:
            self._cache[cgid] = _Entry(path, service, now)
        return service

    def _sweep(self, now: float) -> None:
        with self._lock:
            cgids = list(self._cache)
            self._swept_at = now
        gone = [cgid for cgid in cgids if self._cgroups.path_of(cgid) is None]
        with self._lock:
            for cgid in gone:
                self._cache.pop(cgid, None)

    def describe(self) -> list[dict]:
        """Services seen so far, in the /api/v1/services shape, sorted by name.

        Reads cgroup.threads of every cgroup, so it is for API calls, not the
        per-interval path."""
        with self._lock:
            seen = list(self._seen.values())
            entries = [(cgid, e.path, e.service.name) for cgid, e in self._cache.items()]
        cgroups: dict[str, set[str]] = {}
        for cgid, path, name in entries:
            # Fresh check, so a cgroup removed since it was resolved is not listed.
            if path is not None and self._cgroups.id_of(path) == cgid:
                cgroups.setdefault(name, set()).add(path)
        out = []
        for service in sorted(seen, key=lambda s: s.name):
            paths = sorted(cgroups.get(service.name, ()))
            out.append(
                {
                    "name": service.name,
                    "source": service.source,
                    "cgroups": paths,
                    "tasks": sum(self._cgroups.threads(p) for p in paths),
                }
            )
        return out

    def _name(self, path: str) -> Service:
        procs: list[int] | None = None
        for compiled in self._rules:
            if compiled.unsatisfiable:
                continue
            rule = compiled.rule
            if compiled.cgroup is not None and not cgroup_glob_matches(compiled.cgroup, path):
                continue
            if rule.pid is not None or rule.comm is not None:
                if procs is None:
                    procs = self._cgroups.pids(path)
                if rule.pid is not None and rule.pid not in procs:
                    continue
                if rule.comm is not None and not any(
                    fnmatch.fnmatchcase(comm, rule.comm) for comm in self._comms(procs)
                ):
                    continue
            return Service(rule.name, "config")
        if path == "/":
            return Service(HOST, "host")
        return Service(path, "cgroup")

    def _comms(self, pids: list[int]) -> Iterable[str]:
        # Lazily, so a match on the first process spares reading the rest.
        for pid in pids:
            try:
                yield (self._proc / str(pid) / "comm").read_text(errors="replace").rstrip("\n")
            except OSError:
                continue  # the process exited between cgroup.procs and here

    def _admit(self, service: Service) -> Service:
        """Caps how many names reach the metrics: automatic names beyond
        max_services become "other". Names from config rules are always kept,
        since the operator asked for them and their number is bounded by the file."""
        with self._lock:
            if service.name in self._seen:
                return self._seen[service.name]
            counted = sum(1 for name in self._seen if name != OTHER)
            if service.source != "config" and counted >= self.max_services:
                service = Service(OTHER, "cgroup")
                if OTHER in self._seen:
                    return self._seen[OTHER]
            self._seen[service.name] = service
            return service
