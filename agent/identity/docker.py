"""Docker identity outside Kubernetes: a cgroup path -> container ID -> name.

Docker's cgroup is `/system.slice/docker-<id>.scope` with the systemd cgroup
driver and `/docker/<id>` with cgroupfs. The name comes from Docker's own state
file, `<root>/containers/<id>/config.v2.json` ("Name": "/web"), so no daemon
socket is needed and nothing is asked of the Docker API.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from pathlib import Path

__all__ = ["DockerNames", "docker_container_id"]

log = logging.getLogger(__name__)

DEFAULT_ROOT = Path("/var/lib/docker")

_SCOPE_RE = re.compile(r"^docker-(?P<id>[0-9a-f]{64})\.scope$")
_ID_RE = re.compile(r"^[0-9a-f]{64}$")


def docker_container_id(path: str) -> str | None:
    """The Docker container ID of cgroup `path` (outside kubepods), or None."""
    parts = [p for p in path.split("/") if p]
    for i, part in enumerate(parts):
        m = _SCOPE_RE.match(part)
        if m:
            return m.group("id")
        if part == "docker" and i + 1 < len(parts) and _ID_RE.match(parts[i + 1]):
            return parts[i + 1]
    return None


class DockerNames:
    """Container ID -> name, read from Docker's state directory and cached
    (a container's name only changes on `docker rename`, rare enough that the
    resolver's periodic refresh picks it up via `forget`)."""

    def __init__(self, root: Path = DEFAULT_ROOT) -> None:
        self.root = Path(root)
        self._lock = threading.Lock()
        self._names: dict[str, str | None] = {}
        self.errors = 0

    def name_of(self, container_id: str) -> str | None:
        with self._lock:
            if container_id in self._names:
                return self._names[container_id]
        name = self._read(container_id)
        with self._lock:
            self._names[container_id] = name
        return name

    def forget(self, container_id: str) -> None:
        with self._lock:
            self._names.pop(container_id, None)

    def _read(self, container_id: str) -> str | None:
        file = self.root / "containers" / container_id / "config.v2.json"
        try:
            doc = json.loads(file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            self.errors += 1
            log.warning("cannot read Docker container state %s: %s", file, e)
            return None
        name = doc.get("Name") if isinstance(doc, dict) else None
        if not isinstance(name, str) or not name.strip("/"):
            return None
        return name.lstrip("/")
