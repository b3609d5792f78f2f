"""What a cgroup is, read from its path and the metadata behind it, and the
automatic service name that follows (as the interface spec defines them): a
Kubernetes container -> NAMESPACE/WORKLOAD, a systemd unit -> the unit name, a
Docker container -> its name, the root cgroup -> host, any other cgroup -> its
path.

It touches no host itself: the pod index and the Docker names are handed in.
Which name a cgroup finally gets, the operator's rules first, is
agent/identity/services.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.identity.docker import DockerNames, docker_container_id
from agent.identity.kubernetes import PodIndex, parse_kubepods_path
from agent.identity.systemd import systemd_unit

__all__ = ["HOST", "Identity", "identify"]

HOST = "host"


@dataclass(frozen=True)
class Identity:
    """What one cgroup is, from its path and the metadata behind it. `name` and
    `source` are the automatic service name; the rest feeds rules and listings."""

    name: str
    source: str
    pod_uid: str | None = None
    namespace: str | None = None
    pod: str | None = None
    workload: str | None = None
    container: str | None = None
    container_id: str | None = None
    runtime: str | None = None
    qos: str | None = None
    unit: str | None = None

    def details(self) -> dict:
        """The non-empty identity fields, for /api/v1/services."""
        keys = ("pod_uid", "namespace", "pod", "workload", "container", "container_id",
                "runtime", "qos", "unit")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


def identify(path: str, pods: PodIndex | None = None, docker: DockerNames | None = None) -> Identity:
    """The automatic identity of cgroup `path`; kubepods first, because pod
    containers are also systemd scopes and may be Docker containers."""
    if path == "/":
        return Identity(HOST, "host")
    ref = parse_kubepods_path(path)
    if ref is not None:
        info = pods.get(ref.pod_uid) if pods is not None else None
        if info is None:
            # Without the API only the UID is known; the name changes to
            # NAMESPACE/WORKLOAD as soon as the pod object arrives.
            return Identity(f"pod/{ref.pod_uid}", "k8s", pod_uid=ref.pod_uid,
                            container_id=ref.container_id, runtime=ref.runtime, qos=ref.qos)
        container = None
        if ref.container_id is not None:
            container = info.containers.get(ref.container_id)
            if container is None:  # the API may list a 12-char prefix or the full ID
                container = next((n for cid, n in info.containers.items()
                                  if cid.startswith(ref.container_id) or ref.container_id.startswith(cid)),
                                 None)
        return Identity(info.service_name, "k8s", pod_uid=ref.pod_uid, namespace=info.namespace,
                        pod=info.name, workload=info.workload, container=container,
                        container_id=ref.container_id, runtime=ref.runtime, qos=ref.qos)
    cid = docker_container_id(path)
    if cid is not None:
        name = docker.name_of(cid) if docker is not None else None
        return Identity(name or f"docker/{cid[:12]}", "docker", container=name, container_id=cid,
                        runtime="docker")
    unit = systemd_unit(path)
    if unit is not None:
        return Identity(unit, "systemd", unit=unit)
    return Identity(path, "cgroup")
