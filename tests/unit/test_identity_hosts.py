"""systemd units, Docker containers outside Kubernetes, and the retention of
vanished services, on a fake cgroup tree and a fake Docker state directory
(config.v2.json as Docker writes it)."""

from __future__ import annotations

import json
from pathlib import Path

from agent.config import ServiceRule
from agent.identity.cgroups import CgroupPaths
from agent.identity.docker import DockerNames, docker_container_id
from agent.identity.kubernetes import PodIndex, PodWatcher
from agent.identity.listing import describe
from agent.identity.automatic import identify
from agent.identity.services import Service, ServiceResolver
from agent.identity.systemd import systemd_unit
from tests.support.fake_host import make_cgroup_dir

CID = "4f3c2b1a0e9d8c7b6a5f4e3d2c1b0a9f8e7d6c5b4a3f2e1d0c9b8a7f6e5d4c3b"


def test_systemd_units() -> None:
    assert systemd_unit("/system.slice/nginx.service") == "nginx.service"
    assert systemd_unit("/user.slice/user-1000.slice/session-3.scope") == "session-3.scope"
    assert systemd_unit("/user.slice/user-1000.slice/user@1000.service/app.slice/"
                        "app-gnome-firefox-1234.scope") == "app-gnome-firefox-1234.scope"
    # A delegated subtree belongs to its unit.
    assert systemd_unit("/system.slice/containerd.service/sub/leaf") == "containerd.service"
    assert systemd_unit("/init.scope") == "init.scope"
    assert systemd_unit("/system.slice") is None
    assert systemd_unit("/batch/etl") is None
    assert systemd_unit("/") is None


def write_docker_state(root: Path, cid: str, name: str) -> None:
    d = root / "containers" / cid
    d.mkdir(parents=True)
    # Trimmed from a real config.v2.json: only "Name" is read.
    (d / "config.v2.json").write_text(json.dumps({
        "StreamConfig": {}, "State": {"Running": True, "Pid": 4242}, "ID": cid,
        "Created": "2025-11-30T09:12:44.1Z", "Path": "nginx", "Args": ["-g", "daemon off;"],
        "Config": {"Hostname": cid[:12], "Image": "nginx:1.27"}, "Name": "/" + name,
        "Driver": "overlay2"}))


def test_docker_names_from_state_files(tmp_path: Path) -> None:
    assert docker_container_id(f"/system.slice/docker-{CID}.scope") == CID
    assert docker_container_id(f"/docker/{CID}") == CID
    assert docker_container_id("/system.slice/docker.service") is None
    names = DockerNames(tmp_path)
    assert names.name_of(CID) is None          # no state file yet
    names.forget(CID)
    write_docker_state(tmp_path, CID, "web")
    assert names.name_of(CID) == "web"
    ident = identify(f"/system.slice/docker-{CID}.scope", PodIndex(), names)
    assert (ident.name, ident.source, ident.container, ident.container_id) == ("web", "docker", "web", CID)
    # Unknown container: a short-ID name, still source docker.
    other = "ab" * 32
    assert identify(f"/docker/{other}", None, names).name == "docker/" + other[:12]
    (tmp_path / "containers" / "bad").mkdir()
    (tmp_path / "containers" / "bad" / "config.v2.json").write_text("{not json")
    assert names.name_of("bad") is None and names.errors == 1


def test_resolver_sources_and_systemd_rule(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    write_docker_state(tmp_path / "docker", CID, "web")
    ids = {p: make_cgroup_dir(root, p, [10 + i]) for i, p in enumerate(
        ["/", "/system.slice/nginx.service", "/system.slice/cron.service",
         f"/system.slice/docker-{CID}.scope", "/batch/etl"])}
    r = ServiceResolver([ServiceRule(name="web-tier", systemd_unit="nginx.*")], CgroupPaths(root),
                        docker=DockerNames(tmp_path / "docker"))
    assert r.resolve(ids["/"]) == Service("host", "host")
    assert r.resolve(ids["/system.slice/nginx.service"]) == Service("web-tier", "config")
    assert r.resolve(ids["/system.slice/cron.service"]) == Service("cron.service", "systemd")
    assert r.resolve(ids[f"/system.slice/docker-{CID}.scope"]) == Service("web", "docker")
    assert r.resolve(ids["/batch/etl"]) == Service("/batch/etl", "cgroup")
    assert r.cgroups_by_service()["cron.service"] == ["/system.slice/cron.service"]


def test_vanished_services_are_dropped_after_retention(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    now = [0.0]
    gone_id = make_cgroup_dir(root, "/gone", [5])
    stay_id = make_cgroup_dir(root, "/stay", [6])
    r = ServiceResolver([], CgroupPaths(root, clock=lambda: now[0]), retention_s=120.0,
                        clock=lambda: now[0])
    r.service_of(gone_id)
    r.service_of(stay_id)
    for f in (root / "gone").iterdir():
        f.unlink()
    (root / "gone").rmdir()
    for _ in range(3):  # the live one keeps being resolved every interval
        now[0] += 61
        r.service_of(stay_id)
    assert [s["name"] for s in describe(r)] == ["/stay"]
    # Still listed within the retention window.
    r2 = ServiceResolver([], CgroupPaths(root, clock=lambda: now[0]), retention_s=900.0,
                         clock=lambda: now[0])
    again = make_cgroup_dir(root, "/gone", [5])
    r2.service_of(again)
    for f in (root / "gone").iterdir():
        f.unlink()
    (root / "gone").rmdir()
    now[0] += 200
    r2.service_of(stay_id)
    assert "/gone" in [s["name"] for s in describe(r2)]


def test_pod_watcher_is_optional(monkeypatch) -> None:
    monkeypatch.delenv("NODE_NAME", raising=False)
    assert PodWatcher(PodIndex()).start() is False
