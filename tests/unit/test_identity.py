"""cgroup ids -> paths -> service names, on a fake cgroup tree and a fake /proc.

The fake tree's directory inode numbers play the cgroup ids, exactly as the
kernel's do in the real cgroup v2 mount.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.config import ServiceRule
from agent.identity.cgroups import (
    CgroupPaths,
    cgroup_glob_matches,
    cgroup_glob_regex,
    find_cgroup2_mount,
)
from agent.identity.listing import describe
from agent.identity.services import Service, ServiceResolver

HYBRID_MOUNTS = """\
sysfs /sys sysfs rw,nosuid,nodev,noexec,relatime 0 0
proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0
tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0
cgroup /sys/fs/cgroup/systemd cgroup rw,relatime,name=systemd 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
"""

UNIFIED_MOUNTS = """\
proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0
cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime,nsdelegate,memory_recursiveprot 0 0
"""

SYSTEMD_POD = (
    "/kubepods.slice/kubepods-burstable.slice/"
    "kubepods-burstable-pod1d2c3b4a_5e6f_7a8b_9c0d_1e2f3a4b5c6d.slice/"
    "cri-containerd-abc123def456.scope"
)
SYSTEMD_GUARANTEED_POD = (
    "/kubepods.slice/kubepods-pod1d2c3b4a_5e6f_7a8b_9c0d_1e2f3a4b5c6d.slice/"
    "cri-containerd-abc999.scope"
)
CGROUPFS_POD = "/kubepods/burstable/pod1d2c3b4a-5e6f-7a8b-9c0d-1e2f3a4b5c6d/abc123def456"
CGROUPFS_GUARANTEED_POD = "/kubepods/pod1d2c3b4a-5e6f-7a8b-9c0d-1e2f3a4b5c6d/abc123def456"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_cgroup(root: Path, rel: str, procs: list[int] = (), threads: int | None = None) -> int:
    """Creates a fake cgroup directory with cgroup.procs and cgroup.threads; returns its id."""
    d = root / rel.strip("/") if rel != "/" else root
    d.mkdir(parents=True, exist_ok=True)
    (d / "cgroup.procs").write_text("".join(f"{p}\n" for p in procs))
    n = len(procs) if threads is None else threads
    (d / "cgroup.threads").write_text("".join(f"{1000 + i}\n" for i in range(n)))
    return os.stat(d).st_ino


def make_proc(proc: Path, pid: int, comm: str) -> None:
    (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    (proc / str(pid) / "comm").write_text(comm + "\n")


@pytest.fixture
def tree(tmp_path: Path) -> dict:
    root = tmp_path / "cgroup"
    proc = tmp_path / "proc"
    ids = {
        "/": make_cgroup(root, "/", procs=[1, 2], threads=5),
        "/batch": make_cgroup(root, "/batch"),
        "/batch/etl": make_cgroup(root, "/batch/etl", procs=[300, 301], threads=7),
        "/web": make_cgroup(root, "/web", procs=[400]),
        SYSTEMD_POD: make_cgroup(root, SYSTEMD_POD, procs=[500], threads=3),
    }
    for pid, comm in [(1, "systemd"), (2, "kthreadd"), (300, "stress-ng"), (301, "stress-ng-cpu"),
                      (400, "nginx"), (500, "python3")]:
        make_proc(proc, pid, comm)
    return {"root": root, "proc": proc, "ids": ids, "clock": FakeClock()}


# --- /proc/mounts ----------------------------------------------------------------


def test_find_cgroup2_mount() -> None:
    assert find_cgroup2_mount(HYBRID_MOUNTS) == "/sys/fs/cgroup/unified"
    assert find_cgroup2_mount(UNIFIED_MOUNTS) == "/sys/fs/cgroup"
    # Only the type field counts: a v1 hierarchy whose device is named "cgroup2" is not v2.
    v1_only = HYBRID_MOUNTS.replace("cgroup2 rw,relatime 0 0", "cgroup rw,relatime,pids 0 0")
    assert "cgroup2 /sys/fs/cgroup/unified cgroup " in v1_only
    assert find_cgroup2_mount(v1_only) is None
    assert find_cgroup2_mount("") is None
    assert find_cgroup2_mount("cgroup2 /mnt/my\\040cgroups cgroup2 rw 0 0\n") == "/mnt/my cgroups"


# --- CgroupPaths -----------------------------------------------------------------


def test_ids_map_to_paths_and_back(tree: dict) -> None:
    paths = CgroupPaths(tree["root"], clock=tree["clock"])
    for path, cgid in tree["ids"].items():
        assert paths.path_of(cgid) == path
        assert paths.id_of(path) == cgid
    assert paths.id_of("batch/etl/") == tree["ids"]["/batch/etl"]
    # Intermediate directories of the pod path are cgroups too.
    assert paths.id_of("/kubepods.slice") == os.stat(tree["root"] / "kubepods.slice").st_ino
    assert paths.scans == 1
    known = paths.known()
    assert {known[i] for i in tree["ids"].values()} == set(tree["ids"])
    assert len(known) == 8  # root, batch, etl, web, 4 levels of the pod path


def test_files_symlinks_and_escapes_are_not_cgroups(tree: dict) -> None:
    root = tree["root"]
    (root / "link").symlink_to(root / "batch", target_is_directory=True)
    paths = CgroupPaths(root, clock=tree["clock"])
    assert "/link" not in paths.known().values()
    assert "/link/etl" not in paths.known().values()
    assert paths.path_of(os.stat(root / "cgroup.procs").st_ino) is None
    assert paths.id_of("/cgroup.procs") is None  # a file, not a cgroup
    assert paths.id_of("/link") is None  # a symlink, not a cgroup
    assert paths.id_of("/nope") is None
    assert paths.id_of("/batch/../..") is None
    assert paths.pids("/../proc") == []


def test_rescan_on_miss_is_rate_limited(tree: dict) -> None:
    clock = tree["clock"]
    paths = CgroupPaths(tree["root"], min_rescan_s=1.0, clock=clock)
    assert paths.path_of(tree["ids"]["/web"]) == "/web"
    assert paths.scans == 1
    clock.now += 0.5
    assert paths.path_of(1) is None  # below every id seen: a removed cgroup, too soon after the last scan
    assert paths.scans == 1
    clock.now += 0.5
    assert paths.path_of(1) is None
    assert paths.scans == 2
    # A cgroup created since the last scan has a higher id than any it saw:
    # named at once, not a second later.
    late = make_cgroup(tree["root"], "/late")
    assert late > max(tree["ids"].values())
    clock.now += 0.06
    assert paths.path_of(late) == "/late"
    assert paths.scans == 3
    newer = make_cgroup(tree["root"], "/newer")
    assert paths.path_of(newer) is None  # within new_rescan_s of the last scan
    assert paths.scans == 3
    assert paths.path_of(tree["ids"]["/web"]) == "/web"  # hits never rescan
    assert paths.scans == 3


def test_old_map_is_rebuilt_so_renames_show(tree: dict) -> None:
    clock = tree["clock"]
    paths = CgroupPaths(tree["root"], max_age_s=60.0, clock=clock)
    web = tree["ids"]["/web"]
    assert paths.path_of(web) == "/web"
    os.rename(tree["root"] / "web", tree["root"] / "frontend")
    clock.now += 30
    assert paths.path_of(web) == "/web"  # cached; the id is still known
    clock.now += 30
    assert paths.path_of(web) == "/frontend"
    assert paths.scans == 2


def test_pids_and_threads(tree: dict) -> None:
    paths = CgroupPaths(tree["root"], clock=tree["clock"])
    assert paths.pids("/batch/etl") == [300, 301]
    assert paths.threads("/batch/etl") == 7
    assert paths.pids("/") == [1, 2]
    assert paths.threads("/") == 5
    assert paths.pids("/batch") == []
    assert paths.threads("/batch") == 0


def test_vanished_cgroups_answer_empty(tree: dict) -> None:
    paths = CgroupPaths(tree["root"], clock=tree["clock"])
    etl = tree["root"] / "batch" / "etl"
    for f in etl.iterdir():
        f.unlink()
    etl.rmdir()
    assert paths.pids("/batch/etl") == []
    assert paths.threads("/batch/etl") == 0
    assert paths.id_of("/batch/etl") is None
    assert paths.errors == 0  # vanishing is churn, not an error


def test_missing_root_gives_empty_map(tmp_path: Path) -> None:
    paths = CgroupPaths(tmp_path / "absent", clock=FakeClock())
    assert paths.path_of(1) is None
    assert paths.known() == {}


# --- cgroup globs ----------------------------------------------------------------


@pytest.mark.parametrize(
    "pattern, path, expected",
    [
        # The SPEC example against both kubelet cgroup drivers and QoS depths.
        ("/kubepods*/**/cri-containerd-abc*", SYSTEMD_POD, True),
        ("/kubepods*/**/cri-containerd-abc*", SYSTEMD_GUARANTEED_POD, True),
        ("/kubepods*/**/cri-containerd-abc*", "/kubepods.slice/cri-containerd-abc.scope", True),
        ("/kubepods*/**/cri-containerd-abc*", SYSTEMD_POD.replace("abc123", "xyz123"), False),
        ("/kubepods*/**/cri-containerd-abc*", "/system.slice/cri-containerd-abc1.scope", False),
        ("/kubepods*/**/cri-containerd-abc*", CGROUPFS_POD, False),  # no scope prefix there
        ("/kubepods*/**/abc*", CGROUPFS_POD, True),
        ("/kubepods*/**/abc*", CGROUPFS_GUARANTEED_POD, True),
        ("/kubepods*/**/abc*", "/kubepods/burstable", False),
        ("/kubepods*/*/abc*", CGROUPFS_GUARANTEED_POD, True),
        ("/kubepods*/*/abc*", CGROUPFS_POD, False),  # one * is one component
        # `*` stays inside a component and must match the whole of it.
        ("/batch/*", "/batch/etl", True),
        ("/batch/*", "/batch/etl/worker", False),
        ("/batch/*", "/batch", False),
        ("/batch*", "/batch/etl", False),
        ("/bat", "/batch", False),
        ("/batch/**", "/batch", True),
        ("/batch/**", "/batch/etl/worker", True),
        ("/**/etl", "/batch/etl", True),
        ("/**/etl", "/etl", True),
        ("/**/etl", "/batch/etl2", False),
        ("/**", "/", True),
        ("/", "/", True),
        ("/", "/batch", False),
        ("/web?", "/web1", True),
        ("/web?", "/web", False),
        ("/web[0-9]", "/web7", True),
        ("/web[!0-9]", "/web7", False),
        ("/web[!0-9]", "/webx", True),
        ("/a.b", "/aXb", False),  # regex characters are literal
        ("/a+(b)", "/a+(b)", True),
        ("/x[", "/x[", True),  # an unclosed class is literal
    ],
)
def test_cgroup_glob(pattern: str, path: str, expected: bool) -> None:
    assert cgroup_glob_matches(cgroup_glob_regex(pattern), path) is expected


def test_bad_glob_range_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="bad character range"):
        cgroup_glob_regex("/web[9-0]")


# --- ServiceResolver -------------------------------------------------------------


def fake_processes(pids: list[int]) -> list[dict]:
    """Stands in for psutil: the fake tree's pids are not this machine's processes."""
    return [{"pid": pid, "comm": f"p{pid}", "cmdline": f"p{pid} --run", "threads": 1} for pid in pids]


def resolver(tree: dict, rules: list[ServiceRule], **kw) -> ServiceResolver:
    paths = CgroupPaths(tree["root"], clock=tree["clock"])
    return ServiceResolver(rules, paths, proc_root=tree["proc"], clock=tree["clock"], **kw)


def test_automatic_names(tree: dict) -> None:
    r = resolver(tree, [])
    ids = tree["ids"]
    assert r.service_of(ids["/"]) == "host"
    assert r.resolve(ids["/"]) == Service("host", "host")
    assert r.service_of(ids["/batch/etl"]) == "/batch/etl"
    assert r.resolve(ids["/batch/etl"]) == Service("/batch/etl", "cgroup")
    # A pod whose object is unknown (no API server) is named by its UID.
    assert r.resolve(ids[SYSTEMD_POD]) == Service("pod/1d2c3b4a-5e6f-7a8b-9c0d-1e2f3a4b5c6d", "k8s")
    assert r.service_of(0) == "unknown"
    assert r.service_of(987654321) == "unknown"


def test_rules_first_match_wins(tree: dict) -> None:
    rules = [
        ServiceRule(name="vllm", cgroup="/kubepods*/**/cri-containerd-abc*"),
        ServiceRule(name="stress", comm="stress-ng*"),
        ServiceRule(name="etl", cgroup="/batch/**"),  # shadowed by "stress" for /batch/etl
        ServiceRule(name="nginx", pid=400),
        ServiceRule(name="late-web", cgroup="/web"),
    ]
    r = resolver(tree, rules)
    ids = tree["ids"]
    assert r.resolve(ids[SYSTEMD_POD]) == Service("vllm", "config")
    assert r.service_of(ids["/batch/etl"]) == "stress"
    assert r.service_of(ids["/batch"]) == "etl"  # no processes, but the glob fits
    assert r.service_of(ids["/web"]) == "nginx"
    assert r.service_of(ids["/"]) == "host"


def test_comm_and_pid_rules_look_inside_the_cgroup(tree: dict) -> None:
    ids = tree["ids"]
    r = resolver(tree, [
        ServiceRule(name="cpu-worker", comm="stress-ng-c?u"),  # the 2nd process of etl
        ServiceRule(name="init", pid=1),
        ServiceRule(name="case", comm="NGINX"),  # comm globs are case-sensitive
        ServiceRule(name="ghost", pid=999),  # in no cgroup
    ])
    assert r.service_of(ids["/batch/etl"]) == "cpu-worker"
    assert r.service_of(ids["/"]) == "init"
    assert r.service_of(ids["/web"]) == "/web"


def test_all_matchers_of_a_rule_must_match(tree: dict) -> None:
    ids = tree["ids"]
    r = resolver(tree, [
        ServiceRule(name="wrong-comm", cgroup="/batch/*", comm="nginx"),
        ServiceRule(name="k8s-only", k8s_namespace="default"),
        ServiceRule(name="k8s-and-cgroup", cgroup="/web", k8s_pod="web-*"),
        ServiceRule(name="unit", systemd_unit="nginx.service"),
        ServiceRule(name="both", cgroup="/batch/*", comm="stress-ng"),
    ])
    assert r.service_of(ids["/batch/etl"]) == "both"
    # No pod object and no systemd unit behind these cgroups: those rules cannot match.
    assert r.service_of(ids["/web"]) == "/web"
    assert r.service_of(ids["/"]) == "host"


def test_process_vanishing_between_procs_and_comm(tree: dict) -> None:
    (tree["proc"] / "300" / "comm").unlink()
    (tree["proc"] / "300").rmdir()
    r = resolver(tree, [ServiceRule(name="cpu", comm="stress-ng-cpu")])
    assert r.service_of(tree["ids"]["/batch/etl"]) == "cpu"


def test_cache_is_refreshed_after_refresh_s(tree: dict) -> None:
    clock = tree["clock"]
    etl = tree["ids"]["/batch/etl"]
    r = resolver(tree, [ServiceRule(name="java", comm="java")], refresh_s=10.0)
    assert r.service_of(etl) == "/batch/etl"
    make_proc(tree["proc"], 300, "java")  # exec: the process changed its name
    clock.now += 9
    assert r.service_of(etl) == "/batch/etl"  # cached
    clock.now += 1
    assert r.service_of(etl) == "java"


def test_cache_follows_path_changes(tree: dict) -> None:
    clock = tree["clock"]
    web = tree["ids"]["/web"]
    r = resolver(tree, [ServiceRule(name="front", cgroup="/frontend")], refresh_s=3600.0)
    assert r.service_of(web) == "/web"
    os.rename(tree["root"] / "web", tree["root"] / "frontend")
    clock.now += 60  # the path map is rebuilt; the resolver's entry is still young
    assert r.service_of(web) == "front"


def test_max_services_overflow_goes_to_other(tree: dict) -> None:
    ids = tree["ids"]
    # Four names at most: one kept for the rule's "nginx", one for "other".
    r = resolver(tree, [ServiceRule(name="nginx", comm="nginx")], max_services=4)
    assert r.service_of(ids["/"]) == "host"
    assert r.service_of(ids["/batch"]) == "/batch"
    assert r.service_of(ids["/batch/etl"]) == "other"
    assert r.resolve(ids[SYSTEMD_POD]) == Service("other", "cgroup")
    # Names already seen keep their name; configured names are never folded.
    assert r.service_of(ids["/batch"]) == "/batch"
    assert r.service_of(ids["/web"]) == "nginx"
    assert [s["name"] for s in describe(r, fake_processes)] == ["/batch", "host", "nginx", "other"]


def test_max_services_counts_forgotten_names_out(tree: dict) -> None:
    """A name unseen for the retention leaves, and its place goes to the next one."""
    ids = tree["ids"]
    r = resolver(tree, [], max_services=2, retention_s=100.0)
    clock = tree["clock"]
    assert r.service_of(ids["/"]) == "host"
    assert r.service_of(ids["/batch"]) == "other"
    clock.now += 50
    assert r.service_of(ids["/batch"]) == "other"   # keeps "other" alive, not "host"
    clock.now += 120                                # host unseen for 170 s, "other" for 120 s
    r.service_of(ids["/batch/etl"])                 # a resolve sweeps; both names are gone
    assert [s["name"] for s in describe(r, fake_processes)] == ["/batch/etl"]
    assert r.service_of(ids["/batch"]) == "other"


def test_describe(tree: dict) -> None:
    ids = tree["ids"]
    r = resolver(tree, [
        ServiceRule(name="batch", cgroup="/batch/**"),
        ServiceRule(name="vllm", comm="python3"),
    ])
    for path in ("/", "/batch", "/batch/etl", SYSTEMD_POD):
        r.service_of(ids[path])
    r.service_of(0)
    r.service_of(424242)
    assert describe(r, fake_processes) == [
        {"name": "batch", "source": "config", "cgroups": ["/batch", "/batch/etl"], "tasks": 7,
         "processes": 2, "commands": fake_processes([300, 301])},
        {"name": "host", "source": "host", "cgroups": ["/"], "tasks": 5,
         "processes": 2, "commands": fake_processes([1, 2])},
        {"name": "vllm", "source": "config", "cgroups": [SYSTEMD_POD], "tasks": 3,
         "processes": 1, "commands": fake_processes([500]),
         "identity": [{"pod_uid": "1d2c3b4a-5e6f-7a8b-9c0d-1e2f3a4b5c6d",
                       "container_id": "abc123def456", "runtime": "containerd", "qos": "burstable"}]},
    ]
    # A removed cgroup drops out of the listing; its service stays, with no tasks.
    pod = tree["root"] / SYSTEMD_POD.strip("/")
    for f in pod.iterdir():
        f.unlink()
    pod.rmdir()
    assert describe(r, fake_processes)[2] == {"name": "vllm", "source": "config", "cgroups": [], "tasks": 0,
                               "processes": 0, "commands": []}


def test_removed_cgroups_leave_the_cache(tree: dict) -> None:
    clock = tree["clock"]
    web = tree["ids"]["/web"]
    r = resolver(tree, [])
    assert r.service_of(web) == "/web"
    for f in (tree["root"] / "web").iterdir():
        f.unlink()
    (tree["root"] / "web").rmdir()
    clock.now += 61  # path map and sweep both due
    assert r.service_of(tree["ids"]["/"]) == "host"
    assert web not in r._cache
    assert r.service_of(web) == "unknown"
