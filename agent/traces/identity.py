"""Which slatrace service sent a span, from its resource attributes.

SPEC order: `process.pid` (that process's cgroup v2 path -> cgroup id -> the
service the BPF side counts it under), then `k8s.pod.uid` / `container.id`
(found inside a cgroup path), then `service.name` when it already names a
slatrace service. The pid is only meaningful in the agent's pid namespace, so a
pid that does not exist here falls through to the next rule.

Answers are cached briefly: spans arrive thousands per second from a handful of
processes, while /proc and the cgroup tree change slowly.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.identity.cgroups import CgroupPaths

__all__ = ["SpanOrigin", "SpanServices", "cgroup_v2_path"]


@dataclass(frozen=True)
class SpanOrigin:
    service: str | None     # None: no rule matched
    how: str                # "process.pid", "k8s.pod.uid", "container.id", "service.name" or "unresolved"
    cgroup_id: int | None = None


_UNRESOLVED = SpanOrigin(None, "unresolved")


def cgroup_v2_path(proc_cgroup_text: str) -> str | None:
    """The v2 path from /proc/PID/cgroup content (the "0::/path" line)."""
    for line in proc_cgroup_text.splitlines():
        if line.startswith("0::"):
            return line[3:].strip() or "/"
    return None


class SpanServices:
    def __init__(
        self,
        cgroups: CgroupPaths,
        service_of: Callable[[int], str],
        known_services: Callable[[], Iterable[str]],
        proc_root: Path = Path("/proc"),
        *,
        ttl_s: float = 5.0,
        max_cached: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cgroups = cgroups
        self._service_of = service_of
        self._known_services = known_services
        self._proc = Path(proc_root)
        self._ttl = ttl_s
        self._max_cached = max_cached
        self._clock = clock
        self._lock = threading.Lock()
        self._cache: dict[tuple, tuple[float, SpanOrigin]] = {}

    def origin(self, resource: Mapping[str, Any]) -> SpanOrigin:
        # Only the attributes the rules read form the key, so spans of one
        # process share one entry whatever else their resource carries.
        key = (resource.get("process.pid"), resource.get("k8s.pod.uid"), resource.get("container.id"),
               resource.get("service.name"))
        now = self._clock()
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None and now - hit[0] < self._ttl:
            return hit[1]
        found = self._resolve(*key)
        with self._lock:
            if len(self._cache) >= self._max_cached:
                self._cache.clear()  # rare: many distinct senders; a refill is cheap
            self._cache[key] = (now, found)
        return found

    def _resolve(self, pid: Any, pod_uid: Any, container_id: Any, service_name: Any) -> SpanOrigin:
        if isinstance(pid, (int, str)) and not isinstance(pid, bool) and str(pid).isdigit():
            found = self._by_pid(int(pid))
            if found is not None:
                return found
        for value, how in ((container_id, "container.id"), (pod_uid, "k8s.pod.uid")):
            if isinstance(value, str) and len(value) >= 8:
                found = self._by_path_fragment(value, how)
                if found is not None:
                    return found
        if isinstance(service_name, str) and service_name in set(self._known_services()):
            return SpanOrigin(service_name, "service.name")
        return _UNRESOLVED

    def _by_pid(self, pid: int) -> SpanOrigin | None:
        try:
            text = (self._proc / str(pid) / "cgroup").read_text()
        except OSError:
            return None
        path = cgroup_v2_path(text)
        if path is None:
            return None
        cgid = self._cgroups.id_of(path)
        if cgid is None:
            return None
        return SpanOrigin(self._service_of(cgid), "process.pid", cgid)

    def _by_path_fragment(self, value: str, how: str) -> SpanOrigin | None:
        # The systemd cgroup driver writes pod uids with "_" for "-".
        fragments = {value, value.replace("-", "_")}
        matches = [(path, cgid) for cgid, path in self._cgroups.known().items()
                   if any(f in path for f in fragments)]
        if not matches:
            return None
        # The deepest match: a container's cgroup, whose tasks the probe counts,
        # rather than the pod's (which holds no task of its own).
        path, cgid = max(matches, key=lambda m: (m[0].count("/"), len(m[0])))
        return SpanOrigin(self._service_of(cgid), how, cgid)
