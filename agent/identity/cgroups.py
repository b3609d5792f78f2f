"""cgroup v2 ids <-> paths, from the cgroup v2 mount passed in.

The BPF side only sees `bpf_get_current_cgroup_id()`, which on these kernels is
the inode number of the cgroup's directory in the v2 mount. Everything a human
reads is a path, so this module keeps the id -> path map, rescanning the tree
when an id it has not seen shows up (rate-limited: unknown ids arrive every
interval once short-lived cgroups are gone).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

from agent.probe.mounts import find_cgroup2_mount

__all__ = ["CgroupPaths", "cgroup_glob_matches", "cgroup_glob_regex", "find_cgroup2_mount"]

log = logging.getLogger(__name__)

# A cgroup that was removed (or whose last task exited mid-read) answers with one
# of these; that is ordinary churn, not a failure.
_VANISHED = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ENODEV, errno.ESRCH})


class CgroupPaths:
    """Maps cgroup v2 ids to paths relative to the mount ("/", "/batch/etl").

    Lookups are dict hits; a miss rescans the whole tree at most once per
    `min_rescan_s`, and a map older than `max_age_s` is rebuilt on the next
    lookup so renamed and removed cgroups do not linger forever. A miss for
    an id above every id of the last scan is a cgroup created since (the
    kernel hands out cgroup ids in increasing order): it rescans at most once
    per `new_rescan_s`, so a new pod's first waits are named within an
    interval rather than counted as "unknown" for a second, while the misses
    of removed cgroups (ids below) stay rate-limited.
    """

    def __init__(
        self,
        root: Path,
        *,
        min_rescan_s: float = 1.0,
        new_rescan_s: float = 0.05,
        max_age_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.root = Path(root)
        self.min_rescan_s = min_rescan_s
        self.new_rescan_s = new_rescan_s
        self._max_id = 0
        self.max_age_s = max_age_s
        self._clock = clock
        self._lock = threading.Lock()
        self._by_id: dict[int, str] = {}
        self._scanned_at: float | None = None
        self.scans = 0
        self.errors = 0

    def path_of(self, cgid: int) -> str | None:
        """The path of cgroup `cgid`, or None if no such cgroup exists now."""
        self._expire()
        path = self._by_id.get(cgid)
        if path is None and self._may_rescan(new=cgid > self._max_id):
            self.rescan()
            path = self._by_id.get(cgid)
        return path

    def id_of(self, path: str) -> int | None:
        """The id of the cgroup at `path`, read fresh: a path can be reused by a
        new cgroup (new id), while an id is never reused for another cgroup."""
        directory = self._dir(path)
        if directory is None:
            return None
        try:
            st = os.lstat(directory)
        except OSError as e:
            self._note_error("stat", directory, e)
            return None
        if not stat.S_ISDIR(st.st_mode):
            return None
        key = _normalise(path)
        with self._lock:
            self._by_id[st.st_ino] = key
        return st.st_ino

    def pids(self, path: str) -> list[int]:
        """Process ids in the cgroup (its cgroup.procs), empty if it is gone."""
        return [int(x) for x in self._read_lines(path, "cgroup.procs") if x.strip().isdigit()]

    def threads(self, path: str) -> int:
        """How many threads the cgroup holds (lines of cgroup.threads), 0 if gone."""
        return sum(1 for x in self._read_lines(path, "cgroup.threads") if x.strip())

    def known(self) -> dict[int, str]:
        """A copy of the current id -> path map (for listings and debugging)."""
        self._expire()
        if self._scanned_at is None:
            self.rescan()
        with self._lock:
            return dict(self._by_id)

    def rescan(self) -> None:
        """Rebuild the map from the tree; directories vanishing mid-walk are skipped."""
        by_id: dict[int, str] = {}
        try:
            by_id[os.lstat(self.root).st_ino] = "/"
        except OSError as e:
            self._note_error("stat", self.root, e)
        stack: list[tuple[str, str]] = [(str(self.root), "")]
        while stack:
            directory, rel = stack.pop()
            try:
                with os.scandir(directory) as it:
                    for entry in it:
                        try:
                            if not entry.is_dir(follow_symlinks=False):
                                continue
                            ino = entry.stat(follow_symlinks=False).st_ino
                        except OSError as e:
                            self._note_error("stat", entry.path, e)
                            continue
                        child = f"{rel}/{entry.name}"
                        by_id[ino] = child
                        stack.append((entry.path, child))
            except OSError as e:
                self._note_error("scan", directory, e)
        with self._lock:
            self._by_id = by_id
            self._max_id = max(by_id, default=0)
            self._scanned_at = self._clock()
            self.scans += 1

    def _may_rescan(self, new: bool = False) -> bool:
        if self._scanned_at is None:
            return True
        return self._clock() - self._scanned_at >= (self.new_rescan_s if new else self.min_rescan_s)

    def _expire(self) -> None:
        if self._scanned_at is not None and self._clock() - self._scanned_at >= self.max_age_s:
            self.rescan()

    def _dir(self, path: str) -> Path | None:
        # Paths may come from API queries: never let ".." climb out of the mount.
        parts = [p for p in path.split("/") if p]
        if any(p in (".", "..") for p in parts):
            return None
        return self.root.joinpath(*parts)

    def _read_lines(self, path: str, name: str) -> list[str]:
        directory = self._dir(path)
        if directory is None:
            return []
        file = directory / name
        try:
            with open(file, encoding="ascii") as f:
                return f.read().splitlines()
        except OSError as e:
            self._note_error("read", file, e)
            return []

    def _note_error(self, action: str, where: object, e: OSError) -> None:
        if e.errno in _VANISHED:
            return
        self.errors += 1
        log.warning("cgroup %s of %s failed: %s", action, where, e)


def _normalise(path: str) -> str:
    parts = [p for p in path.split("/") if p]
    return "/" + "/".join(parts)


def cgroup_glob_regex(pattern: str) -> re.Pattern[str]:
    """Compile a cgroup path glob: `*` and `?` stay within one path component,
    `[...]` is a character class, and a `**` component spans any number of
    components (zero included), so "/kubepods*/**/cri-containerd-abc*" fits both
    the systemd and the cgroupfs layouts whatever the QoS nesting depth."""
    components = [c for c in pattern.split("/") if c]
    parts: list[str] = []
    for component in components:
        if component == "**":
            parts.append(r"(?:/[^/]+)*")
        else:
            parts.append("/" + _component_regex(component))
    # The root cgroup is "/", which has no components: match it as the empty string
    # (see cgroup_glob_matches), so "/" and "/**" both match the root.
    try:
        return re.compile("".join(parts) + r"\Z")
    except re.error as e:  # e.g. a reversed range such as [z-a]
        raise ValueError(f"invalid glob {pattern!r}: {e.msg}") from None


def _component_regex(component: str) -> str:
    out: list[str] = []
    i = 0
    n = len(component)
    while i < n:
        c = component[i]
        if c == "*":
            while i < n and component[i] == "*":
                i += 1
            out.append(r"[^/]*")
            continue
        if c == "?":
            out.append(r"[^/]")
        elif c == "[":
            j = i + 1
            if j < n and component[j] == "!":
                j += 1
            if j < n and component[j] == "]":
                j += 1  # a "]" first in the class is a member, as in fnmatch
            end = component.find("]", j)
            if end == -1:
                out.append(re.escape(c))  # an unclosed "[" is literal, as in fnmatch
            else:
                body = component[i + 1 : end]
                negate = body.startswith("!")
                if negate:
                    body = body[1:]
                # Escape every member but "-" so ranges work and nothing else is special.
                members = "".join(ch if ch == "-" else re.escape(ch) for ch in body)
                out.append(("[^/" if negate else "[") + members + "]")
                i = end + 1
                continue
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def cgroup_glob_matches(regex: re.Pattern[str], path: str) -> bool:
    """Whether the cgroup v2 `path` ("/" for the root) fits a compiled glob."""
    return regex.match("" if path == "/" else path.rstrip("/")) is not None
