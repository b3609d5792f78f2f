"""Where the kernel's filesystems are mounted, from /proc/mounts.

The probe needs the cgroup v2 mount to tell whether cgroup ids are usable;
service naming (agent/identity) needs it to turn ids into paths.
"""

from __future__ import annotations


def find_cgroup2_mount(mounts_text: str) -> str | None:
    """The first cgroup2 mount point in /proc/mounts content (hybrid hosts have it
    under /sys/fs/cgroup/unified, unified ones at /sys/fs/cgroup)."""
    for line in mounts_text.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[2] == "cgroup2":
            return _unescape_mount_field(parts[1])
    return None


def _unescape_mount_field(field: str) -> str:
    # /proc/mounts writes space, tab, newline and backslash as \040-style octal.
    out: list[str] = []
    i = 0
    while i < len(field):
        octal = field[i + 1 : i + 4]
        if field[i] == "\\" and len(octal) == 3 and all(c in "01234567" for c in octal):
            out.append(chr(int(octal, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)
