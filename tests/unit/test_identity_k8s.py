"""Kubernetes identity from recorded cgroup paths and recorded pod objects.

No API server can exist here, so the pod objects are a recorded `kubectl get
pods -o json` list (fixtures/k8s/pods.json) fed to the same PodIndex the
watcher fills; the cgroup paths (fixtures/k8s/cgroup-paths.tsv) are those the
kubelet's systemd and cgroupfs drivers make for containerd, CRI-O and Docker in
every QoS class. Each path must map to the right pod, namespace, container and
service name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.config import ServiceRule
from agent.identity.cgroups import CgroupPaths
from agent.identity.kubernetes import PodIndex, parse_kubepods_path, pod_info, workload_name
from agent.identity.listing import describe
from agent.identity.automatic import identify
from agent.identity.services import Service, ServiceResolver
from tests.support.fake_host import make_cgroup_dir

FIXTURES = Path(__file__).parent / "fixtures" / "k8s"
PODS = json.loads((FIXTURES / "pods.json").read_text())["items"]


def _rows() -> list[tuple[str, ...]]:
    rows = []
    for line in (FIXTURES / "cgroup-paths.tsv").read_text().splitlines():
        if line and not line.startswith("#"):
            rows.append(tuple(None if f == "-" else f for f in line.split("\t")))
    return rows


ROWS = _rows()
BY_NAME = {p["metadata"]["name"]: p for p in PODS}


@pytest.fixture
def index() -> PodIndex:
    idx = PodIndex()
    idx.replace(PODS)
    return idx


@pytest.mark.parametrize("path,pod,container,service,runtime,qos", ROWS, ids=[r[3] + ":" + r[0][:40] for r in ROWS])
def test_each_driver_and_runtime_path_names_the_pod(index: PodIndex, path: str, pod: str, container: str,
                                                    service: str, runtime: str | None, qos: str) -> None:
    ref = parse_kubepods_path(path)
    assert ref is not None
    assert ref.pod_uid == BY_NAME[pod]["metadata"]["uid"]
    assert ref.qos == qos
    assert ref.runtime == runtime
    assert ref.container_id == path.rsplit("/", 1)[1].split("-")[-1].removesuffix(".scope")
    ident = identify(path, index)
    assert (ident.name, ident.source) == (service, "k8s")
    assert ident.namespace == BY_NAME[pod]["metadata"]["namespace"]
    assert ident.pod == pod
    assert ident.container == container


def test_all_qos_classes_runtimes_and_drivers_are_covered() -> None:
    assert {r[5] for r in ROWS} == {"guaranteed", "burstable", "besteffort"}
    assert {r[4] for r in ROWS} == {"containerd", "cri-o", "docker", None}
    assert any(r[0].startswith("/kubepods.slice/") for r in ROWS)
    assert any(r[0].startswith("/kubepods/") for r in ROWS)


def test_pod_level_and_foreign_paths() -> None:
    uid = "1d2c3b4a-5e6f-4a8b-9c0d-1e2f3a4b5c6d"
    pod = f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid.replace('-', '_')}.slice"
    ref = parse_kubepods_path(pod)
    assert ref is not None and (ref.pod_uid, ref.container_id, ref.qos) == (uid, None, "burstable")
    conmon = parse_kubepods_path(pod + "/crio-conmon-" + "a" * 64 + ".scope")
    assert conmon is not None and conmon.container_id is None
    for path in ("/", "/kubepods.slice", "/kubepods/burstable", "/system.slice/containerd.service",
                 "/kubepods/burstable/notapod/abc", "/my-kubepods/pod" + uid):
        ref = parse_kubepods_path(path)
        assert ref is None or ref.pod_uid is None, path


def test_without_the_api_pods_are_named_by_uid() -> None:
    path, pod = ROWS[0][0], ROWS[0][1]
    ident = identify(path, PodIndex())
    uid = BY_NAME[pod]["metadata"]["uid"]
    assert (ident.name, ident.source, ident.pod_uid, ident.namespace) == (f"pod/{uid}", "k8s", uid, None)
    assert identify(path, None).name == f"pod/{uid}"


def test_workload_names_from_owners_and_labels() -> None:
    assert workload_name(BY_NAME["vllm-7d9f8c6b5-x2kqp"]) == ("vllm", "Deployment")
    assert workload_name(BY_NAME["redis-0"]) == ("redis", "StatefulSet")
    assert workload_name(BY_NAME["node-exporter-4kx8z"]) == ("node-exporter", "DaemonSet")
    assert workload_name(BY_NAME["nightly-etl-28903840-q7w2v"]) == ("nightly-etl-28903840", "Job")
    # No ownerReferences: the pod-template-hash label proves the suffix.
    assert workload_name(BY_NAME["web-5f6d7c8b9d-kq2xz"]) == ("web", "Deployment")
    # A StatefulSet pod recorded without owners: the ordinal goes.
    sts = json.loads(json.dumps(BY_NAME["redis-0"]))
    del sts["metadata"]["ownerReferences"]
    assert workload_name(sts) == ("redis", "StatefulSet")
    # A bare pod keeps its name, even one that looks suffixed.
    assert workload_name({"metadata": {"name": "debug-shell-abcde"}}) == ("debug-shell-abcde", None)


def test_index_follows_watch_events(index: PodIndex) -> None:
    uid = BY_NAME["redis-0"]["metadata"]["uid"]
    assert index.get(uid).service_name == "cache/redis"
    gen = index.generation
    index.delete(BY_NAME["redis-0"])
    assert index.get(uid) is None and index.generation > gen
    renamed = json.loads(json.dumps(BY_NAME["redis-0"]))
    renamed["metadata"]["namespace"] = "cache2"
    index.upsert(renamed)
    assert index.get(uid).service_name == "cache2/redis"
    assert pod_info({"metadata": {"name": "x"}}) is None  # no UID: ignored


def test_resolver_names_pods_and_applies_k8s_rules(tmp_path: Path, index: PodIndex) -> None:
    root = tmp_path / "cg"
    ids = {r[0]: make_cgroup_dir(root, r[0], [100 + i]) for i, r in enumerate(ROWS)}
    rules = [
        ServiceRule(name="llm-server", k8s_namespace="inference", k8s_container="vllm"),
        ServiceRule(name="exporters", k8s_pod="node-exporter-*"),
        ServiceRule(name="never", k8s_namespace="cache", k8s_container="sidecar"),
    ]
    clock = [0.0]
    r = ServiceResolver(rules, CgroupPaths(root), pods=index,
                        clock=lambda: clock[0])
    names = {path: r.resolve(cgid) for path, cgid in ids.items()}
    assert names[ROWS[0][0]] == Service("llm-server", "config")     # the vllm container
    assert names[ROWS[1][0]] == Service("inference/vllm", "k8s")    # its metrics sidecar
    assert names[ROWS[2][0]] == Service("cache/redis", "k8s")
    assert names[ROWS[3][0]] == Service("exporters", "config")
    listed = {s["name"]: s for s in describe(r, lambda pids: [])}
    assert listed["cache/redis"]["identity"] == [{
        "pod_uid": BY_NAME["redis-0"]["metadata"]["uid"], "namespace": "cache", "pod": "redis-0",
        "workload": "redis", "container": "redis", "container_id": ROWS[2][0].split("crio-")[1][:-6],
        "runtime": "cri-o", "qos": "guaranteed"}]
    # A pod object arriving later renames its cgroups at once (the index changed).
    late = PodIndex()
    r2 = ServiceResolver([], CgroupPaths(root), pods=late,
                         clock=lambda: clock[0])
    redis_id = ids[ROWS[2][0]]
    assert r2.service_of(redis_id).startswith("pod/")
    late.upsert(BY_NAME["redis-0"])
    assert r2.service_of(redis_id) == "cache/redis"
