"""Kernel threads: /proc parsing and the "kernel" service."""

from pathlib import Path

from agent.identity.cgroups import CgroupPaths
from agent.identity.kthreads import PF_KTHREAD, kernel_thread_tids, stat_flags
from agent.identity.listing import describe
from agent.identity.services import ServiceResolver
from agent.probe.snapshot import KERNEL_CGID

# Recorded /proc/PID/stat lines (6.18): a kworker and a user process whose comm
# holds a space and a parenthesis.
KWORKER = "9 (kworker/0:0-events) I 2 0 0 0 -1 69238880 0 0 0 0 0 3 0 0 20 0 1 0 3 0 0 18446744073709551615"
USER = "4242 (we ird) name) S 1 4242 4242 0 -1 4194560 120 0 0 0 1 0 0 0 20 0 1 0 377 1000 200 18446744073709551615"


def test_stat_flags_counts_fields_after_the_last_parenthesis():
    assert stat_flags(KWORKER) == 69238880 and stat_flags(KWORKER) & PF_KTHREAD
    assert stat_flags(USER) == 4194560 and not stat_flags(USER) & PF_KTHREAD


def test_kernel_thread_tids_from_a_proc_tree(tmp_path):
    for pid, line in ((9, KWORKER), (4242, USER)):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(line + "\n")
    (tmp_path / "77").mkdir()           # exited between listing and reading
    (tmp_path / "self").mkdir()
    assert kernel_thread_tids(tmp_path) == [9]


def test_kernel_pseudo_cgroup_is_the_kernel_service(tmp_path):
    proc = tmp_path / "proc"
    (proc / "9").mkdir(parents=True)
    (proc / "9" / "stat").write_text(KWORKER)
    resolver = ServiceResolver([], CgroupPaths(tmp_path), proc_root=proc)
    assert resolver.resolve(KERNEL_CGID).name == "kernel"
    assert resolver.resolve(KERNEL_CGID).source == "kernel"
    assert describe(resolver) == [{"name": "kernel", "source": "kernel", "cgroups": [], "tasks": 1,
                                    "processes": 1, "commands": []}]


def test_pseudo_cgroup_id_matches_the_bpf_header():
    header = (Path(__file__).resolve().parents[2] / "bpf" / "sched.h").read_text()
    assert f"#define KERNEL_CGID {KERNEL_CGID:#x}ULL" in header
