"""Kernel threads, from /proc: PF_KTHREAD in the flags field of /proc/PID/stat.

They live in the root cgroup beside host processes; the probe counts them
under a pseudo cgroup of their own, service "kernel".
"""

from __future__ import annotations

from pathlib import Path

PF_KTHREAD = 0x00200000


def stat_flags(stat_text: str) -> int:
    """The flags field (9th) of a /proc/PID/stat line; comm may hold spaces
    and parentheses, so fields are counted after its last ')'."""
    fields = stat_text[stat_text.rindex(")") + 2:].split()
    return int(fields[6])


def kernel_thread_tids(proc_root: Path = Path("/proc")) -> list[int]:
    out = []
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if stat_flags((entry / "stat").read_text()) & PF_KTHREAD:
                out.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
    return sorted(out)
