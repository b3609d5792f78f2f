"""Service identity against a real cgroup v2 child cgroup on this machine.

The kernel's own cgroup id comes from name_to_handle_at(2): for a cgroup v2
directory the file handle is the 8-byte kernfs id, the same number that
bpf_get_current_cgroup_id() returns. It is the reference for the claim the
identity code rests on (cgroup id == directory inode number).
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.config import ServiceRule
from agent.identity.cgroups import CgroupPaths
from agent.probe.mounts import find_cgroup2_mount
from agent.identity.listing import describe
from agent.identity.services import Service, ServiceResolver

pytestmark = pytest.mark.kernel

REQUIRE_KERNEL_ENV = "SLATRACE_REQUIRE_KERNEL"
FILEID_KERNFS = 0xFE
AT_FDCWD = -100


def require_kernel(reason: str) -> None:
    """Skip, or fail where the kernel tier must run (CI sets the env)."""
    if os.environ.get(REQUIRE_KERNEL_ENV) == "1":
        pytest.fail(f"kernel test cannot run: {reason}", pytrace=False)
    pytest.skip(reason)


class _FileHandle(ctypes.Structure):
    _fields_ = [
        ("handle_bytes", ctypes.c_uint),
        ("handle_type", ctypes.c_int),
        ("f_handle", ctypes.c_ubyte * 64),
    ]


def kernel_cgroup_id(directory: Path) -> int:
    """The kernel's id of a cgroup v2 directory, via its kernfs file handle."""
    libc = ctypes.CDLL(None, use_errno=True)
    fh = _FileHandle(handle_bytes=64)
    mount_id = ctypes.c_int()
    rc = libc.name_to_handle_at(
        AT_FDCWD, os.fsencode(directory), ctypes.byref(fh), ctypes.byref(mount_id), 0
    )
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"name_to_handle_at({directory}): {os.strerror(e)}")
    assert fh.handle_type == FILEID_KERNFS and fh.handle_bytes == 8
    return struct.unpack("<Q", bytes(fh.f_handle[:8]))[0]


@pytest.fixture
def mount() -> Path:
    if os.geteuid() != 0:
        require_kernel("needs root to create cgroup v2 directories")
    found = find_cgroup2_mount(Path("/proc/mounts").read_text())
    if found is None:
        require_kernel("no cgroup v2 hierarchy is mounted")
    return Path(found)


@pytest.fixture
def sleeper(mount: Path) -> Iterator[tuple[Path, subprocess.Popen]]:
    """A `sleep 30` inside a fresh child cgroup; both are gone afterwards."""
    cgroup = mount / f"slatrace-test-identity-{secrets.token_hex(4)}"
    cgroup.mkdir()
    proc: subprocess.Popen | None = None
    try:
        proc = subprocess.Popen(["sleep", "30"])
        (cgroup / "cgroup.procs").write_text(f"{proc.pid}\n")
        # Popen can return before the child has exec'd (its comm is still ours).
        deadline = time.monotonic() + 5.0
        while Path(f"/proc/{proc.pid}/comm").read_text().strip() != "sleep" and time.monotonic() < deadline:
            time.sleep(0.01)
        yield cgroup, proc
    finally:
        if proc is not None:
            proc.kill()
            proc.wait(timeout=10)
        _rmdir_when_empty(cgroup)
    assert not cgroup.exists()


def _rmdir_when_empty(cgroup: Path) -> None:
    # The reaped task can linger in the cgroup for a moment (EBUSY).
    deadline = time.monotonic() + 5.0
    while True:
        try:
            cgroup.rmdir()
            return
        except OSError as e:
            if e.errno == errno.ENOENT:
                return
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_cgroup_ids_are_kernel_ids(mount: Path, sleeper: tuple[Path, subprocess.Popen]) -> None:
    cgroup, proc = sleeper
    rel = "/" + cgroup.name
    # The kernel agrees the process is there (its v2 line is "0::PATH").
    assert f"0::{rel}\n" in Path(f"/proc/{proc.pid}/cgroup").read_text()

    paths = CgroupPaths(mount)
    cgid = kernel_cgroup_id(cgroup)
    assert cgid == os.stat(cgroup).st_ino
    assert paths.path_of(cgid) == rel
    assert paths.id_of(rel) == cgid
    assert paths.path_of(kernel_cgroup_id(mount)) == "/"
    assert paths.pids(rel) == [proc.pid]
    assert paths.threads(rel) == 1
    assert paths.errors == 0


def test_resolver_applies_rules_to_a_real_cgroup(
    mount: Path, sleeper: tuple[Path, subprocess.Popen]
) -> None:
    cgroup, proc = sleeper
    rel = "/" + cgroup.name
    cgid = kernel_cgroup_id(cgroup)
    paths = CgroupPaths(mount)

    by_comm = ServiceResolver([ServiceRule(name="sleepers", comm="sleep")], paths)
    assert by_comm.resolve(cgid) == Service("sleepers", "config")
    [described] = describe(by_comm)
    assert {k: described[k] for k in ("name", "source", "cgroups", "tasks", "processes")} == \
        {"name": "sleepers", "source": "config", "cgroups": [rel], "tasks": 1, "processes": 1}
    assert [(c["pid"], c["comm"]) for c in described["commands"]] == [(proc.pid, "sleep")]

    by_cgroup = ServiceResolver(
        [
            ServiceRule(name="nope", comm="sleepy"),
            ServiceRule(name="test", cgroup="/slatrace-test-*"),
        ],
        paths,
    )
    assert by_cgroup.resolve(cgid) == Service("test", "config")

    by_pid = ServiceResolver([ServiceRule(name="that-one", pid=proc.pid)], paths)
    assert by_pid.service_of(cgid) == "that-one"

    automatic = ServiceResolver([ServiceRule(name="absent", comm="no-such-process*")], paths)
    assert automatic.resolve(cgid) == Service(rel, "cgroup")
    assert automatic.service_of(kernel_cgroup_id(mount)) == "host"


def test_removed_cgroup_becomes_unknown(mount: Path) -> None:
    if os.geteuid() != 0:
        require_kernel("needs root to create cgroup v2 directories")
    cgroup = mount / f"slatrace-test-identity-{secrets.token_hex(4)}"
    cgroup.mkdir()
    try:
        cgid = kernel_cgroup_id(cgroup)
        now = [0.0]
        paths = CgroupPaths(mount, clock=lambda: now[0])
        resolver = ServiceResolver([], paths, clock=lambda: now[0])
        assert resolver.service_of(cgid) == "/" + cgroup.name
    finally:
        _rmdir_when_empty(cgroup)
    assert paths.id_of("/" + cgroup.name) is None
    now[0] += 61.0  # the path map is rebuilt, the resolver's cache swept
    assert resolver.service_of(cgid) == "unknown"
    assert describe(resolver) == [
        {"name": "/" + cgroup.name, "source": "cgroup", "cgroups": [], "tasks": 0, "processes": 0,
         "commands": []}
    ]
