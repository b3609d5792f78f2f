"""The services listing of `GET /api/v1/services`: what each service the
resolver has named is made of right now (cgroups, tasks, processes, the
identity behind each cgroup).

Reads cgroup.threads and cgroup.procs of every cgroup and asks psutil about
processes, so it is for API calls, never the per-interval path; the naming
itself is agent/identity/services.py's.
"""

from __future__ import annotations

from collections.abc import Callable

from agent.identity.kthreads import kernel_thread_tids
from agent.identity.services import KERNEL, ServiceResolver

__all__ = ["describe", "psutil_processes"]


def psutil_processes(pids: list[int], limit: int = 10) -> list[dict]:
    """comm, cmdline and thread count of up to `limit` processes, via psutil;
    processes that exit meanwhile are skipped."""
    import psutil  # noqa: PLC0415  (only API listings need it)

    out = []
    for pid in pids[:limit]:
        try:
            p = psutil.Process(pid)
            with p.oneshot():
                out.append({"pid": pid, "comm": p.name(), "cmdline": " ".join(p.cmdline()),
                            "threads": p.num_threads()})
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def describe(resolver: ServiceResolver,
             process_info: Callable[[list[int]], list[dict]] = psutil_processes) -> list[dict]:
    """Services seen so far, in the /api/v1/services shape, sorted by name."""
    seen, entries = resolver.known()
    paths_of = resolver.cgroup_paths
    cgroups: dict[str, set[str]] = {}
    identities: dict[str, dict[str, dict]] = {}
    for cgid, path, name, identity in entries:
        # Fresh check, so a cgroup removed since it was resolved is not listed.
        if path is not None and paths_of.id_of(path) == cgid:
            cgroups.setdefault(name, set()).add(path)
            details = identity.details()
            if details:
                identities.setdefault(name, {})[path] = details
    out = []
    for service in sorted(seen, key=lambda s: s.name):
        if service == KERNEL:
            kthreads = kernel_thread_tids(resolver.proc_root)
            out.append({"name": service.name, "source": service.source, "cgroups": [],
                        "tasks": len(kthreads), "processes": len(kthreads), "commands": []})
            continue
        paths = sorted(cgroups.get(service.name, ()))
        pids = sorted({pid for p in paths for pid in paths_of.pids(p)})
        record = {
            "name": service.name,
            "source": service.source,
            "cgroups": paths,
            "tasks": sum(paths_of.threads(p) for p in paths),
            "processes": len(pids),
            "commands": process_info(pids),
        }
        found = identities.get(service.name)
        if found:
            record["identity"] = [found[p] for p in sorted(found)]
        out.append(record)
    return out
