"""cgroup id -> service name: the operator's rules first, then automatic names.

Called once per cgroup per interval by the aggregation loop, so answers are
cached per cgroup id; an entry is re-resolved when the cgroup's path changes,
when the pod index changes, or after `refresh_s`, because `comm` and `pid`
rules depend on which processes are in the cgroup right now.

The automatic names (a pod's workload, a systemd unit, a Docker container,
host, the cgroup path) are agent/identity/automatic.py's. A service whose
cgroups stop showing up is forgotten after `retention_s`, so the listing does
not grow forever. What each service is made of, for the API, is
agent/identity/listing.py's job.
"""

from __future__ import annotations

import fnmatch
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from agent.identity.automatic import HOST, Identity, identify
from agent.identity.cgroups import CgroupPaths, cgroup_glob_matches, cgroup_glob_regex
from agent.identity.docker import DockerNames
from agent.identity.kubernetes import PodIndex
from agent.identity.rules import ServiceRule
from agent.probe.snapshot import KERNEL_CGID

log = logging.getLogger(__name__)

# HOST (the root cgroup's automatic name) is automatic.py's; it is named here
# too, beside the other names every consumer of service names must know.
__all__ = [
    "HOST",
    "OTHER",
    "UNKNOWN",
    "Service",
    "KERNEL",
    "ServiceResolver",
]

UNKNOWN = "unknown"
OTHER = "other"


@dataclass(frozen=True)
class Service:
    """A service name and where it came from: config, k8s, systemd, docker,
    cgroup, kernel or host."""

    name: str
    source: str


# Not a service of its own (never listed): the name for ids with no cgroup behind them.
_UNKNOWN = Service(UNKNOWN, "unknown")
KERNEL = Service("kernel", "kernel")


@dataclass(frozen=True)
class _CompiledRule:
    rule: ServiceRule
    cgroup: re.Pattern[str] | None


def _compile(rules: Iterable[ServiceRule]) -> list[_CompiledRule]:
    return [_CompiledRule(rule=r, cgroup=cgroup_glob_regex(r.cgroup) if r.cgroup is not None else None)
            for r in rules]


# Rule key -> the Identity field it globs; a cgroup without that field (a
# k8s_pod rule on a systemd unit, a pod whose object is unknown) never matches.
_IDENTITY_MATCHERS = (
    ("k8s_namespace", "namespace"),
    ("k8s_pod", "pod"),
    ("k8s_container", "container"),
    ("systemd_unit", "unit"),
)


@dataclass
class _Entry:
    path: str | None
    service: Service
    resolved_at: float
    identity: Identity
    pods_generation: int


class ServiceResolver:
    """Names the service of each cgroup id, and lists the services seen so far."""

    def __init__(
        self,
        rules: Iterable[ServiceRule],
        cgroup_paths: CgroupPaths,
        proc_root: Path = Path("/proc"),
        max_services: int = 1000,
        *,
        refresh_s: float = 10.0,
        retention_s: float = 900.0,
        pods: PodIndex | None = None,
        docker: DockerNames | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._rules = _compile(rules)
        self._rule_names = frozenset(c.rule.name for c in self._rules)
        self.pods = pods
        self.docker = docker
        self.retention_s = retention_s
        self._last_seen: dict[str, float] = {}
        self.cgroup_paths = cgroup_paths
        self.proc_root = Path(proc_root)
        self.max_services = max_services
        self.refresh_s = refresh_s
        self._clock = clock
        self._lock = threading.Lock()
        self._cache: dict[int, _Entry] = {}
        self._seen: dict[str, Service] = {}
        self._automatic: int | None = None   # automatic names in _seen; None: count again
        # Cached ids of removed cgroups are dropped this often; ids are never reused.
        self.sweep_s = max(60.0, refresh_s)
        self._swept_at = clock()

    def set_rules(self, rules: Iterable[ServiceRule]) -> None:
        """New naming rules (a config reload): every cgroup is named again on
        its next lookup."""
        compiled = _compile(rules)
        with self._lock:
            self._rules = compiled
            self._rule_names = frozenset(c.rule.name for c in compiled)
            self._cache.clear()
            self._automatic = None

    def service_of(self, cgid: int) -> str:
        """The service name of cgroup `cgid` ("unknown" for 0 or a vanished id)."""
        return self.resolve(cgid).name

    def resolve(self, cgid: int) -> Service:
        """Like service_of, with the name's source."""
        if cgid == 0:
            return _UNKNOWN
        if cgid == KERNEL_CGID:
            return self._admit(KERNEL, self._clock())
        path = self.cgroup_paths.path_of(cgid)
        now = self._clock()
        if now - self._swept_at >= self.sweep_s:
            self._sweep(now)
        generation = self.pods.generation if self.pods is not None else 0
        with self._lock:
            entry = self._cache.get(cgid)
            if (
                entry is not None
                and entry.path == path
                and now - entry.resolved_at < self.refresh_s
                and (entry.identity.source != "k8s" or entry.pods_generation == generation)
            ):
                self._last_seen[entry.service.name] = now
                if entry.service.name in self._seen:
                    return entry.service
        if path is None:
            # Not cached: a removed cgroup's id never comes back, so keeping it
            # would only grow the cache.
            with self._lock:
                self._cache.pop(cgid, None)
            return _UNKNOWN
        identity = identify(path, self.pods, self.docker)
        service = self._admit(self._name(path, identity), now)
        with self._lock:
            self._cache[cgid] = _Entry(path, service, now, identity, generation)
        return service

    def _sweep(self, now: float) -> None:
        with self._lock:
            cgids = list(self._cache)
            self._swept_at = now
        gone = [cgid for cgid in cgids if self.cgroup_paths.path_of(cgid) is None]
        with self._lock:
            for cgid in gone:
                self._cache.pop(cgid, None)
            # Services not resolved for a whole retention window have vanished.
            for name, seen_at in list(self._last_seen.items()):
                if now - seen_at > self.retention_s:
                    del self._last_seen[name]
                    self._seen.pop(name, None)
                    self._automatic = None

    def cgroups_by_service(self) -> dict[str, list[str]]:
        """Service -> paths of its cgroups resolved so far (cached, no I/O): what
        the throttling poller reads cpu.stat for."""
        with self._lock:
            out: dict[str, list[str]] = {}
            for e in self._cache.values():
                if e.path is not None:
                    out.setdefault(e.service.name, []).append(e.path)
        return out

    def known(self) -> tuple[list[Service], list[tuple[int, str | None, str, Identity]]]:
        """The services seen so far, and every cached cgroup as (id, path,
        service name, identity): what the services listing is built from."""
        with self._lock:
            return (list(self._seen.values()),
                    [(cgid, e.path, e.service.name, e.identity) for cgid, e in self._cache.items()])

    def _name(self, path: str, identity: Identity) -> Service:
        procs: list[int] | None = None
        for compiled in self._rules:
            rule = compiled.rule
            if compiled.cgroup is not None and not cgroup_glob_matches(compiled.cgroup, path):
                continue
            if not all(
                getattr(identity, field) is not None
                and fnmatch.fnmatchcase(getattr(identity, field), getattr(rule, key))
                for key, field in _IDENTITY_MATCHERS
                if getattr(rule, key) is not None
            ):
                continue
            if rule.pid is not None or rule.comm is not None:
                if procs is None:
                    procs = self.cgroup_paths.pids(path)
                if rule.pid is not None and rule.pid not in procs:
                    continue
                if rule.comm is not None and not any(
                    fnmatch.fnmatchcase(comm, rule.comm) for comm in self._comms(procs)
                ):
                    continue
            return Service(rule.name, "config")
        return Service(identity.name, identity.source)

    def _comms(self, pids: list[int]) -> Iterable[str]:
        # Lazily, so a match on the first process spares reading the rest.
        for pid in pids:
            try:
                yield (self.proc_root / str(pid) / "comm").read_text(errors="replace").rstrip("\n")
            except OSError:
                continue  # the process exited between cgroup.procs and here

    def _admit(self, service: Service, now: float) -> Service:
        """Caps how many names reach the metrics at max_services: places are
        kept for every name the config rules give (the operator asked for them
        and the file bounds their number) and for "other", where automatic
        names beyond the cap are counted."""
        with self._lock:
            if service.name in self._seen:
                self._last_seen[service.name] = now
                return self._seen[service.name]
            # Counted once, not per call: past the cap every new cgroup asks.
            if self._automatic is None:
                self._automatic = sum(1 for name in self._seen if name != OTHER and name not in self._rule_names)
            automatic = self._automatic
            room = self.max_services - 1 - len(self._rule_names)
            if service.source != "config" and automatic >= room:
                service = Service(OTHER, "cgroup")
                if OTHER in self._seen:
                    self._last_seen[OTHER] = now
                    return self._seen[OTHER]
            self._seen[service.name] = service
            self._last_seen[service.name] = now
            self._automatic = None
            return service
