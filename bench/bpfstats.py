"""In-kernel cost of another process's BPF programs, from the kernel's own counters.

With kernel.bpf_stats_enabled=1 every program's fdinfo carries run_cnt and
run_time_ns. Which program serves which tracepoint comes from `bpftool perf
show`, which knows the attachment of classic tracepoints (slatrace) and raw
tracepoints (runqlat) alike; after that only fdinfo is read, so sampling the
counters around a workload costs no extra process.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

from agent.probe.bpfsys import possible_cpus
from bench.mapmem import MapInfo

BPF_STATS = Path("/proc/sys/kernel/bpf_stats_enabled")

SWITCH = ("sched_switch",)
WAKEUP = ("sched_wakeup", "sched_wakeup_new")
# Runs beside sched_wakeup for each wake-up (raw and BTF-typed programs):
# its time is the wake-up's, its runs are not more wake-ups.
WAKING = ("sched_waking",)


@dataclass(frozen=True)
class Counter:
    run_cnt: int
    run_time_ns: int

    def __sub__(self, other: "Counter") -> "Counter":
        return Counter(self.run_cnt - other.run_cnt, self.run_time_ns - other.run_time_ns)

    def __add__(self, other: "Counter") -> "Counter":
        return Counter(self.run_cnt + other.run_cnt, self.run_time_ns + other.run_time_ns)


ZERO = Counter(0, 0)


def parse_fdinfo(text: str) -> dict[str, str]:
    """`key:\tvalue` lines of /proc/PID/fdinfo/FD."""
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


def read_fdinfo(pid: int, fd: int) -> dict[str, str]:
    return parse_fdinfo(Path(f"/proc/{pid}/fdinfo/{fd}").read_text())


def bpf_fds(pid: int, kind: str) -> dict[int, int]:
    """id -> fd of the process's BPF objects of one kind ("prog" or "map"),
    found by their anon inode name and the prog_id/map_id line of fdinfo."""
    out = {}
    fd_dir = Path(f"/proc/{pid}/fd")
    for entry in fd_dir.iterdir():
        try:
            if os.readlink(entry) != f"anon_inode:bpf-{kind}":
                continue
            info = read_fdinfo(pid, int(entry.name))
        except OSError:  # closed between listing and reading
            continue
        if f"{kind}_id" in info:
            out[int(info[f"{kind}_id"])] = int(entry.name)
    return out


def parse_perf_show(doc: list[dict], pid: int) -> dict[str, int]:
    """tracepoint -> prog_id of one process, from `bpftool perf show --json`."""
    out = {}
    for row in doc:
        if row.get("pid") == pid and row.get("fd_type") in ("tracepoint", "raw_tracepoint"):
            out[row["tracepoint"]] = int(row["prog_id"])
    return out


def attached_programs(pid: int) -> dict[str, int]:
    """tracepoint -> prog_id of the programs that process has attached now."""
    res = subprocess.run(["bpftool", "perf", "show", "--json"], capture_output=True, text=True, timeout=20)
    if res.returncode != 0:
        raise RuntimeError(f"bpftool perf show failed: {res.stderr.strip()}")
    return parse_perf_show(json.loads(res.stdout or "[]"), pid)


class ProgramCounters:
    """The cost counters of one process's tracepoint programs, keyed by tracepoint."""

    def __init__(self, pid: int, programs: dict[str, int]) -> None:
        self.pid = pid
        self.prog_ids = dict(programs)
        by_id = bpf_fds(pid, "prog")
        missing = [tp for tp, pid_ in programs.items() if pid_ not in by_id]
        if missing:
            raise RuntimeError(f"pid {pid} holds no fd for the programs of {', '.join(missing)}")
        self._fds = {tp: by_id[prog_id] for tp, prog_id in programs.items()}

    @classmethod
    def of(cls, pid: int) -> "ProgramCounters":
        return cls(pid, attached_programs(pid))

    def read(self) -> dict[str, Counter]:
        out = {}
        for tp, fd in self._fds.items():
            info = read_fdinfo(self.pid, fd)
            out[tp] = Counter(int(info.get("run_cnt", 0)), int(info.get("run_time_ns", 0)))
        return out


def delta(after: dict[str, Counter], before: dict[str, Counter]) -> dict[str, Counter]:
    return {tp: after[tp] - before.get(tp, ZERO) for tp in after}


def add(a: dict[str, Counter], b: dict[str, Counter]) -> dict[str, Counter]:
    return {tp: a.get(tp, ZERO) + b.get(tp, ZERO) for tp in set(a) | set(b)}


def _sum(counters: dict[str, Counter], names: tuple[str, ...]) -> Counter:
    total = ZERO
    for name in names:
        total += counters.get(name, ZERO)
    return total


def _per_run(c: Counter) -> float | None:
    return c.run_time_ns / c.run_cnt if c.run_cnt else None


def cost_summary(counters: dict[str, Counter]) -> dict[str, float | int | None]:
    """ns per run of the switch program, per wake-up (the wakeup programs'
    time with sched_waking's, over the wake-ups) and per scheduler event, plus the time of every program of the
    tool per sched_switch, which also charges a tool for its other programs."""
    switch = _sum(counters, SWITCH)
    wakeup = _sum(counters, WAKEUP)
    wakeup = Counter(wakeup.run_cnt, wakeup.run_time_ns + _sum(counters, WAKING).run_time_ns)
    events = switch + wakeup
    everything = _sum(counters, tuple(counters))
    return {
        "switch_runs": switch.run_cnt,
        "switch_ns": _per_run(switch),
        "wakeup_runs": wakeup.run_cnt,
        "wakeup_ns": _per_run(wakeup),
        "event_runs": events.run_cnt,
        "event_ns": _per_run(events),
        "all_programs_time_ns": everything.run_time_ns,
        "all_programs_ns_per_switch": everything.run_time_ns / switch.run_cnt if switch.run_cnt else None,
    }


class BpfStatsSwitch:
    """kernel.bpf_stats_enabled=1 for the bench; the previous value comes back
    afterwards. ensure() re-asserts it before each measurement, because a
    process that restores its own saved value could turn it off mid-run."""

    def __init__(self, path: Path = BPF_STATS) -> None:
        self._path = path
        self.previous: str | None = None
        self.reasserted = 0

    def enable(self) -> None:
        self.previous = self._path.read_text().strip()
        self._path.write_text("1")

    def ensure(self) -> None:
        if self._path.read_text().strip() != "1":
            self._path.write_text("1")
            self.reasserted += 1

    def restore(self) -> None:
        if self.previous is not None:
            self._path.write_text(self.previous)
            self.previous = None


def process_maps(pid: int) -> list[MapInfo]:
    """The BPF maps a process holds, as `bpftool map show` describes them."""
    ids = bpf_fds(pid, "map")
    res = subprocess.run(["bpftool", "map", "show", "--json"], capture_output=True, text=True, timeout=20)
    if res.returncode != 0:
        raise RuntimeError(f"bpftool map show failed: {res.stderr.strip()}")
    out = []
    for row in json.loads(res.stdout or "[]"):
        if row.get("id") in ids:
            out.append(MapInfo(name=row.get("name", f"id{row['id']}"), type=row["type"],
                               max_entries=int(row["max_entries"]), key_size=int(row["bytes_key"]),
                               value_size=int(row["bytes_value"]), memlock=int(row.get("bytes_memlock", 0)),
                               id=int(row["id"])))
    return sorted(out, key=lambda m: m.name)


# --- map entries -------------------------------------------------------------
# Counted with the bpf() syscall itself (BPF_MAP_GET_FD_BY_ID, then
# BPF_MAP_GET_NEXT_KEY over the keys), independently of the agent's own reading
# code and without copying the values: a 32768-key per-CPU map takes ~0.1 s.

BPF_MAP_GET_NEXT_KEY = 4
BPF_MAP_GET_FD_BY_ID = 14
SYS_BPF = {"x86_64": 321, "aarch64": 280}
KEYED = {"hash", "percpu_hash", "lru_hash", "lru_percpu_hash"}


def _bpf(cmd: int, attr: ctypes.Array) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    nr = SYS_BPF.get(platform.machine())
    if nr is None:
        raise RuntimeError(f"no bpf() syscall number known for {platform.machine()}")
    ret = libc.syscall(ctypes.c_long(nr), ctypes.c_long(cmd), attr, ctypes.c_uint(len(attr)))
    if ret < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return ret


def map_keys(map_id: int, key_size: int, max_entries: int) -> list[bytes]:
    """Every key of a loaded hash map, by map id. A map that changes meanwhile
    may restart the walk (the kernel's next-key of a deleted key is the first
    key); the walk is bounded and keys are deduplicated."""
    attr = ctypes.create_string_buffer(16)
    ctypes.c_uint32.from_buffer(attr, 0).value = map_id
    fd = _bpf(BPF_MAP_GET_FD_BY_ID, attr)
    try:
        key = ctypes.create_string_buffer(key_size)
        nxt = ctypes.create_string_buffer(key_size)
        attr = ctypes.create_string_buffer(24)
        ctypes.c_uint32.from_buffer(attr, 0).value = fd
        ctypes.c_uint64.from_buffer(attr, 16).value = ctypes.addressof(nxt)
        seen: dict[bytes, None] = {}
        for _ in range(2 * max_entries + 2):
            try:
                _bpf(BPF_MAP_GET_NEXT_KEY, attr)
            except OSError as e:
                if e.errno == errno.ENOENT:
                    break
                raise
            seen[nxt.raw] = None
            ctypes.memmove(key, nxt, key_size)
            ctypes.c_uint64.from_buffer(attr, 8).value = ctypes.addressof(key)
        return list(seen)
    finally:
        os.close(fd)


def process_map_keys(pid: int) -> dict[str, list[bytes]]:
    """Map name -> keys, for every hash map the process holds."""
    return {m.name: map_keys(m.id, m.key_size, m.max_entries)
            for m in process_maps(pid) if m.type in KEYED}


def keys_naming(keys: list[bytes], ids: set[int]) -> int:
    """How many keys hold one of these 64-bit ids (cgroup ids) in any aligned
    8-byte word: every per-cgroup key of the probe starts with a cgroup id, and
    a pair key names two."""
    n = 0
    for k in keys:
        if any(int.from_bytes(k[i:i + 8], "little") in ids for i in range(0, len(k) - 7, 8)):
            n += 1
    return n


BPF_MAP_LOOKUP_ELEM = 1


class PercpuArray:
    """Another process's per-CPU array of u64 counters, read by map id with
    the bpf() syscall: one lookup per index, summed over the CPUs, cheap
    enough to sample every few milliseconds without a process per read."""

    def __init__(self, map_id: int) -> None:
        attr = ctypes.create_string_buffer(16)
        ctypes.c_uint32.from_buffer(attr, 0).value = map_id
        self.fd = _bpf(BPF_MAP_GET_FD_BY_ID, attr)
        self._cpus = possible_cpus()
        self._key = ctypes.c_uint32(0)
        self._values = (ctypes.c_uint64 * self._cpus)()
        self._attr = ctypes.create_string_buffer(32)
        ctypes.c_uint32.from_buffer(self._attr, 0).value = self.fd
        ctypes.c_uint64.from_buffer(self._attr, 8).value = ctypes.addressof(self._key)
        ctypes.c_uint64.from_buffer(self._attr, 16).value = ctypes.addressof(self._values)

    def sum(self, index: int) -> int:
        self._key.value = index
        _bpf(BPF_MAP_LOOKUP_ELEM, self._attr)
        return sum(self._values)

    def close(self) -> None:
        os.close(self.fd)
