"""Fake host trees for unit tests: cgroup directories under a tmp_path."""

from __future__ import annotations

from pathlib import Path


def make_cgroup_dir(root: Path, rel: str, pids: list[int] = ()) -> int:
    """A cgroup-like directory with its cgroup.procs/threads; returns its inode,
    which stands for the cgroup id as on a real v2 mount."""
    d = root / rel.strip("/")
    d.mkdir(parents=True, exist_ok=True)
    (d / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))
    (d / "cgroup.threads").write_text("".join(f"{p}\n" for p in pids))
    return d.stat().st_ino
