"""Kubernetes identity: kubepods cgroup paths -> pod UID and container ID, and
pod objects -> namespace, pod name, workload, container name.

The cgroup path alone gives the pod UID and the container ID for both kubelet
cgroup drivers (systemd: `kubepods.slice/kubepods-burstable.slice/
kubepods-burstable-pod<uid_with_underscores>.slice/cri-containerd-<id>.scope`;
cgroupfs: `kubepods/burstable/pod<uid>/<id>`), every QoS class and the
containerd, CRI-O and Docker runtimes. Names need the pod object, which comes
from the API server (`PodWatcher`, optional) or, in tests, from recorded JSON:
both feed the same `PodIndex` with the API's JSON shape.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.workers import Worker, WorkerHandle

__all__ = [
    "ContainerRef",
    "PodIndex",
    "PodInfo",
    "PodWatcher",
    "parse_kubepods_path",
    "pod_info",
    "workload_name",
]

log = logging.getLogger(__name__)

# A pod cgroup component: "pod<uid>" (cgroupfs) or "kubepods[-qos]-pod<uid>.slice"
# (systemd, where the UID's dashes are written as underscores). systemd slice
# names repeat their ancestry, so a kubelet whose cgroup root is /kubelet.slice
# makes "kubelet-kubepods-burstable-pod<uid>.slice": any prefix is allowed.
_POD_RE = re.compile(
    r"^(?:(?:[\w.@]+-)*kubepods(?:-(?P<sqos>burstable|besteffort))?-pod(?P<suid>[0-9a-fA-F_]{36})\.slice"
    r"|pod(?P<cuid>[0-9a-fA-F-]{36}))$"
)
_TOP_RE = re.compile(r"^(?:(?:[\w.@]+-)*kubepods\.slice|kubepods)$")
_QOS_RE = re.compile(r"^(?:(?:[\w.@]+-)*kubepods-(?P<qos>burstable|besteffort)\.slice|(?P<bare>burstable|besteffort))$")
# A container cgroup component under a pod, by runtime. cgroupfs drivers use the
# bare ID; "crio-conmon-<id>" is CRI-O's monitor process, not a container.
_CONTAINER_RE = re.compile(
    r"^(?:(?P<runtime>cri-containerd|crio|docker)-(?P<sid>[0-9a-f]{12,64})\.scope"
    r"|(?P<cid>[0-9a-f]{64}))$"
)


@dataclass(frozen=True)
class ContainerRef:
    """What a kubepods cgroup path says: the pod, its QoS class, and (below the
    pod's own cgroup) the container and its runtime."""

    pod_uid: str
    qos: str                      # guaranteed | burstable | besteffort
    container_id: str | None = None
    runtime: str | None = None    # containerd | cri-o | docker | None (cgroupfs: unknown)


def parse_kubepods_path(path: str) -> ContainerRef | None:
    """The pod (and container) a cgroup v2 path belongs to, or None outside kubepods.

    The kubepods tree may sit below another cgroup (kubelet.slice, a kind node's
    own cgroup), so it is searched for anywhere in the path."""
    parts = [p for p in path.split("/") if p]
    try:
        top = next(i for i, p in enumerate(parts) if _TOP_RE.match(p))
    except StopIteration:
        return None
    qos = "guaranteed"
    for i in range(top + 1, len(parts)):
        part = parts[i]
        q = _QOS_RE.match(part)
        if q is not None:
            qos = q.group("qos") or q.group("bare")
            continue
        m = _POD_RE.match(part)
        if m is None:
            return None
        if m.group("suid"):
            uid = m.group("suid").replace("_", "-").lower()
            qos = m.group("sqos") or qos
        else:
            uid = m.group("cuid").lower()
        if i + 1 >= len(parts):
            return ContainerRef(uid, qos)
        c = _CONTAINER_RE.match(parts[i + 1])
        if c is None:
            # crio-conmon-<id>.scope and the like: the pod's, not a container's.
            return ContainerRef(uid, qos)
        runtime = {"cri-containerd": "containerd", "crio": "cri-o", "docker": "docker"}.get(
            c.group("runtime") or ""
        )
        return ContainerRef(uid, qos, c.group("sid") or c.group("cid"), runtime)
    return None


@dataclass(frozen=True)
class PodInfo:
    """The parts of a pod object that name things."""

    uid: str
    namespace: str
    name: str
    workload: str
    owner_kind: str | None
    labels: Mapping[str, str]
    # container ID (runtime prefix stripped) -> container name
    containers: Mapping[str, str]
    node: str | None
    # The pod's own IPs (status.podIPs); none for a hostNetwork pod, whose IP is the node's.
    ips: tuple[str, ...] = ()
    service_account: str | None = None

    @property
    def service_name(self) -> str:
        return f"{self.namespace}/{self.workload}"


_RS_HASH_RE = re.compile(r"^(?P<base>.+)-[a-z0-9]{5,10}$")
_POD_SUFFIX_RE = re.compile(r"^(?P<base>.+)-[a-z0-9]{5}$")
_ORDINAL_RE = re.compile(r"^(?P<base>.+)-\d+$")


def workload_name(pod: Mapping[str, Any]) -> tuple[str, str | None]:
    """(workload name, owner kind) of a pod object in the API's JSON shape.

    ownerReferences decide when present: a ReplicaSet's name minus its
    pod-template-hash is the Deployment; a StatefulSet, DaemonSet or Job is its
    own name. Without them, the pod name minus the suffix its labels prove."""
    meta = pod.get("metadata") or {}
    name = str(meta.get("name") or "")
    labels = meta.get("labels") or {}
    template_hash = labels.get("pod-template-hash")
    owners = [o for o in meta.get("ownerReferences") or [] if o.get("controller", True)]
    if owners:
        kind = str(owners[0].get("kind") or "")
        owner = str(owners[0].get("name") or name)
        if kind == "ReplicaSet":
            if template_hash and owner.endswith("-" + template_hash):
                return owner[: -len(template_hash) - 1], "Deployment"
            m = _RS_HASH_RE.match(owner)
            # A bare ReplicaSet (no hash label) is its own workload.
            return (m.group("base") if m and template_hash else owner), (
                "Deployment" if template_hash else "ReplicaSet")
        return owner, kind or None
    if template_hash and f"-{template_hash}-" in name:
        return name[: name.rindex(f"-{template_hash}-")], "Deployment"
    if "statefulset.kubernetes.io/pod-name" in labels:
        m = _ORDINAL_RE.match(name)
        if m:
            return m.group("base"), "StatefulSet"
    return name, None


def _strip_runtime(container_id: str) -> str:
    # containerStatuses[].containerID is "containerd://<id>", "cri-o://<id>", "docker://<id>".
    return container_id.split("://", 1)[-1].lower()


def pod_info(pod: Mapping[str, Any]) -> PodInfo | None:
    """PodInfo from a pod object (API JSON shape); None when it has no UID."""
    meta = pod.get("metadata") or {}
    uid = meta.get("uid")
    if not uid:
        return None
    status = pod.get("status") or {}
    containers: dict[str, str] = {}
    for key in ("initContainerStatuses", "containerStatuses", "ephemeralContainerStatuses"):
        for cs in status.get(key) or []:
            cid = cs.get("containerID")
            if cid and cs.get("name"):
                containers[_strip_runtime(cid)] = str(cs["name"])
    workload, kind = workload_name(pod)
    ips: tuple[str, ...] = ()
    if not (pod.get("spec") or {}).get("hostNetwork"):
        listed = [str(p.get("ip")) for p in status.get("podIPs") or [] if p.get("ip")]
        ips = tuple(dict.fromkeys(listed + ([str(status["podIP"])] if status.get("podIP") else [])))
    return PodInfo(
        uid=str(uid).lower(),
        namespace=str(meta.get("namespace") or "default"),
        name=str(meta.get("name") or uid),
        workload=workload,
        owner_kind=kind,
        labels=dict(meta.get("labels") or {}),
        containers=containers,
        node=(pod.get("spec") or {}).get("nodeName"),
        ips=ips,
        service_account=(pod.get("spec") or {}).get("serviceAccountName") or None,
    )


class PodIndex:
    """Pods of this node by UID, fed by the watcher (or recorded objects)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pods: dict[str, PodInfo] = {}
        self.generation = 0  # bumped on every change, so callers can drop caches

    def upsert(self, pod: Mapping[str, Any]) -> None:
        info = pod_info(pod)
        if info is None:
            return
        with self._lock:
            if self._pods.get(info.uid) != info:
                self._pods[info.uid] = info
                self.generation += 1

    def delete(self, pod: Mapping[str, Any]) -> None:
        uid = str((pod.get("metadata") or {}).get("uid") or "").lower()
        with self._lock:
            if self._pods.pop(uid, None) is not None:
                self.generation += 1

    def replace(self, pods: Iterable[Mapping[str, Any]]) -> None:
        """The full list after a (re)list: pods missing from it are gone."""
        infos = {i.uid: i for i in (pod_info(p) for p in pods) if i is not None}
        with self._lock:
            self._pods = infos
            self.generation += 1

    def get(self, uid: str) -> PodInfo | None:
        with self._lock:
            return self._pods.get(uid.lower())

    def by_ip(self, ip: str) -> PodInfo | None:
        """The running pod with this IP (a finished pod's IP may be reused)."""
        with self._lock:
            pods = [p for p in self._pods.values() if ip in p.ips]
        return pods[0] if len(pods) == 1 else None

    def __len__(self) -> int:
        with self._lock:
            return len(self._pods)


class PodWatcher:
    """Lists and watches this node's pods (field selector spec.nodeName=NODE_NAME)
    into a PodIndex, on a worker, with the `kubernetes` client; a failed list
    or watch is relisted after a backoff that doubles up to `max_backoff_s`.

    Optional by design: without NODE_NAME, without the package or without
    credentials, `start` logs why and returns False, and pods are named from
    their cgroup path alone."""

    def __init__(self, index: PodIndex, node_name: str | None = None, backoff_s: float = 1.0,
                 max_backoff_s: float = 60.0) -> None:
        self.index = index
        self.node_name = node_name if node_name is not None else os.environ.get("NODE_NAME")
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.worker: Worker | None = None

    @property
    def errors(self) -> int:
        return self.worker.errors if self.worker is not None else 0

    def start(self) -> bool:
        if not self.node_name:
            log.info("NODE_NAME is not set: Kubernetes pod names are not looked up")
            return False
        try:
            import kubernetes  # noqa: PLC0415  (optional dependency)
        except ImportError:
            log.info("the 'kubernetes' package is not installed: pods are named by UID only")
            return False
        try:
            try:
                kubernetes.config.load_incluster_config()
            except kubernetes.config.ConfigException:
                kubernetes.config.load_kube_config()
        except Exception as e:  # noqa: BLE001  (the client raises several unrelated types here)
            log.warning("no Kubernetes credentials (%s): pods are named by UID only", e)
            return False
        self.worker = Worker.loop("k8s-pods", "watching this node's pods",
                                  lambda handle: self._run(kubernetes, handle))
        self.worker.start()
        return True

    def stop(self) -> None:
        """Without waiting: a watch in flight may block on the network for minutes."""
        if self.worker is not None:
            self.worker.stop(0)

    def _run(self, kubernetes: Any, handle: WorkerHandle) -> None:
        api = kubernetes.client.CoreV1Api()
        to_json = kubernetes.client.ApiClient().sanitize_for_serialization
        selector = f"spec.nodeName={self.node_name}"
        backoff = self.backoff_s
        while not handle.stopping:
            try:
                listed = api.list_pod_for_all_namespaces(field_selector=selector)
                self.index.replace(to_json(p) for p in listed.items)
                version = listed.metadata.resource_version
                watch = kubernetes.watch.Watch()
                for event in watch.stream(api.list_pod_for_all_namespaces, field_selector=selector,
                                          resource_version=version, timeout_seconds=300):
                    if handle.stopping:
                        watch.stop()
                        return
                    pod = to_json(event["object"])
                    if event["type"] == "DELETED":
                        self.index.delete(pod)
                    elif event["type"] in ("ADDED", "MODIFIED"):
                        self.index.upsert(pod)
                handle.succeeded()
                backoff = self.backoff_s
            except Exception as e:  # noqa: BLE001  (network, 410 Gone, auth: relist after a pause)
                handle.failed(e, again_in=backoff)
                if handle.wait(backoff):
                    return
                backoff = min(backoff * 2, self.max_backoff_s)
