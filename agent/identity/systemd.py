"""systemd identity: a cgroup path -> the unit that owns it.

systemd puts every service and scope in a cgroup named after the unit
(`/system.slice/nginx.service`, `/user.slice/user-1000.slice/session-3.scope`,
`/user.slice/user-1000.slice/user@1000.service/app.slice/foo.service`); a unit
that delegates its subtree may have cgroups of its own below, which still
belong to the unit. So the deepest `.service`/`.scope` component names it.
"""

from __future__ import annotations

__all__ = ["systemd_unit"]

_UNIT_SUFFIXES = (".service", ".scope")


def systemd_unit(path: str) -> str | None:
    """The systemd unit owning cgroup `path`, or None if no unit does."""
    parts = [p for p in path.split("/") if p]
    for part in reversed(parts):
        if part.endswith(_UNIT_SUFFIXES) and len(part) > max(map(len, _UNIT_SUFFIXES)):
            return part
    return None
