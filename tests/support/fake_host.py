"""Fake host trees for unit tests: cgroup directories and /proc trees under a
tmp_path, and the agent's cgroup map over them."""

from __future__ import annotations

import os
import socket
from pathlib import Path

HOST_NS = "pid:[4026531836]"


def make_cgroup_dir(root: Path, rel: str, pids: list[int] = ()) -> int:
    """A cgroup-like directory with its cgroup.procs/threads; returns its inode,
    which stands for the cgroup id as on a real v2 mount."""
    d = root / rel.strip("/")
    d.mkdir(parents=True, exist_ok=True)
    (d / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))
    (d / "cgroup.threads").write_text("".join(f"{p}\n" for p in pids))
    return d.stat().st_ino


def v4(ip: str, port: int) -> str:
    """An address as /proc/net/tcp prints it on a little-endian machine."""
    return f"{socket.inet_aton(ip)[::-1].hex().upper()}:{port:04X}"


def v6(ip: str, port: int) -> str:
    raw = socket.inet_pton(socket.AF_INET6, ip)
    return "".join(raw[i:i + 4][::-1].hex().upper() for i in range(0, 16, 4)) + f":{port:04X}"


class FakeProc:
    """A /proc tree: processes (cgroup, NSpid, pid namespace, fds) and net/tcp{,6}."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "net").mkdir(parents=True)
        self.tcp = ["  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode"]
        self.tcp6 = list(self.tcp)
        self.flush()

    def process(self, pid: int, cgroup: str, nspid: tuple[int, ...] | None = None, ns: str = HOST_NS,
                sockets: tuple[int, ...] = ()) -> None:
        d = self.root / str(pid)
        (d / "fd").mkdir(parents=True)
        (d / "ns").mkdir()
        (d / "cgroup").write_text(f"0::{cgroup}\n")
        (d / "status").write_text(f"Name:\tpython3\nPid:\t{pid}\nNSpid:\t{' '.join(map(str, nspid or (pid,)))}\n")
        os.symlink(ns, d / "ns" / "pid")
        os.symlink("/dev/null", d / "fd" / "0")
        for i, inode in enumerate(sockets, start=3):
            os.symlink(f"socket:[{inode}]", d / "fd" / str(i))

    def connection(self, local: str, remote: str, inode: int, six: bool = False) -> None:
        table = self.tcp6 if six else self.tcp
        table.append(f"   {len(table) - 1}: {local} {remote} 01 00000000:00000000 00:00000000 00000000     0"
                     f"        0 {inode} 1 0000000000000000 20 4 30 10 -1")
        self.flush()

    def flush(self) -> None:
        (self.root / "net" / "tcp").write_text("\n".join(self.tcp) + "\n")
        (self.root / "net" / "tcp6").write_text("\n".join(self.tcp6) + "\n")


class FakeCgroups:
    def __init__(self, paths: dict[int, str], procs: dict[str, list[int]] | None = None) -> None:
        self.paths = paths
        self.procs = procs or {}

    def id_of(self, path: str) -> int | None:
        return next((i for i, p in self.paths.items() if p == path), None)

    def known(self) -> dict[int, str]:
        return dict(self.paths)

    def pids(self, path: str) -> list[int]:
        return self.procs.get(path, [])

    def threads(self, path: str) -> int:
        return len(self.procs.get(path, []))
