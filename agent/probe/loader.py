"""Loads bpf/sched.bpf.c with BCC, reads its maps, hands out snapshots.

The only module that imports bcc. Maps are read with BPF_MAP_LOOKUP_BATCH in
fixed-size chunks (one syscall per chunk instead of two per entry).
"""

from __future__ import annotations

import ctypes as ct
import errno
import os
import time
from dataclasses import dataclass
from pathlib import Path

import agent
from agent.probe.features import Features
from agent.probe.layout import ERROR_MAPS, MAP_TYPES, TaskInfo
from agent.probe.layout import SchedEvent as RawEvent
from agent.snapshot import (KERNEL_CGID, Bucket, CgroupCounters, PairCounters, ProbeSnapshot, ProgramStats,
                            SchedEvent)

# bpf/sched.h
TS_RUNNING = 1
TF_KTHREAD = 1

BATCH = 512
ENOTSUPP = 524  # kernel-internal errno for an unsupported map operation; not in Python's errno


@dataclass(frozen=True)
class MapSizes:
    """max_entries of each map. Memory, per map: entries x value x possible CPUs
    for the per-CPU maps, entries x (key + value) for the task map, plus about
    100 bytes of kernel bookkeeping per entry (docs/memory.md)."""

    tasks: int = 65536
    hists: int = 32768
    pairs: int = 4096                # each of the pairs and holders maps
    cgroups: int = 2048
    watched: int = 1024
    event_pages: int = 1024          # 4 MiB of ring buffer with 4 KiB pages
    event_rate: int = 50000          # events per CPU per ~1.07 s


def bpf_source_dir() -> Path:
    """agent/bpf in an installed package (pyproject maps bpf/ there), bpf/ in a
    checkout or an editable install."""
    package = Path(agent.__file__).parent
    for candidate in (package / "bpf", package.parent / "bpf"):
        if (candidate / "sched.bpf.c").is_file():
            return candidate
    raise FileNotFoundError(f"sched.bpf.c not found in {package / 'bpf'} or {package.parent / 'bpf'}: reinstall slatrace")


def cflags(features: Features, sizes: MapSizes) -> list[str]:
    values = {
        "PREEMPT_BIT": features.states.preempt,
        "STATE_D": features.states.d,
        "STATE_DEAD": features.states.dead,
        "MAX_TASKS": sizes.tasks,
        "MAX_HIST": sizes.hists,
        "MAX_PAIRS": sizes.pairs,
        "MAX_CGROUPS": sizes.cgroups,
        "MAX_WATCHED": sizes.watched,
        "EVENT_PAGES": sizes.event_pages,
        "MAX_EVENT_RATE": sizes.event_rate,
    }
    if sizes.event_pages & (sizes.event_pages - 1):
        raise ValueError(f"EVENT_PAGES={sizes.event_pages} must be a power of two")
    for name, value in values.items():
        if not isinstance(value, int) or value < 0 or value >= 1 << 32:
            raise ValueError(f"{name}={value!r} is not a valid unsigned 32-bit value")
    return [f"-I{bpf_source_dir()}"] + [f"-D{k}={v:#x}" for k, v in values.items()]


def monotonic_ns() -> int:
    """CLOCK_MONOTONIC, the clock of bpf_ktime_get_ns()."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


class Probe:
    """The loaded BPF programs. Create with Probe.load(); close() detaches."""

    def __init__(self, bpf, ncpu: int) -> None:
        self._bpf = bpf
        self._ncpu = ncpu
        self._lib = __import__("bcc").libbcc.lib
        self._buffers: dict[str, tuple] = {}
        self.load_mono_ns = monotonic_ns()
        self.load_wall = time.time()
        self._events: list[SchedEvent] = []
        self._ring_open = False

    @classmethod
    def load(cls, features: Features, sizes: MapSizes = MapSizes()) -> "Probe":
        from bcc import BPF  # noqa: PLC0415  (bcc only where BPF is loaded)

        src = bpf_source_dir() / "sched.bpf.c"
        bpf = BPF(src_file=str(src).encode(), cflags=cflags(features, sizes))
        ncpu = len(bpf[b"errors"].getvalue(0))
        return cls(bpf, ncpu)

    @property
    def bpf(self):
        return self._bpf

    def close(self) -> None:
        if self._bpf is not None:
            self._bpf.cleanup()
            self._bpf = None

    def program_fds(self) -> dict[str, int]:
        """Program name (the tracepoint) -> fd, for the kernel's cost counters."""
        out = {}
        for name, fn in self._bpf.funcs.items():
            short = name.decode().rsplit("__", 1)[-1]
            out[short] = fn.fd
        return out

    def watch(self, cgids: set[int]) -> None:
        """Stream exact wait events for exactly these cgroups from now on."""
        table = self._bpf[b"watched"]
        current = {int(k.value) for k in table.keys()}
        for cgid in current - cgids:
            del table[table.Key(cgid)]
        for cgid in cgids - current:
            table[table.Key(cgid)] = table.Leaf(1)
        if cgids and not self._ring_open:
            self._bpf[b"events"].open_ring_buffer(self._on_event)
            self._ring_open = True
        on = self._bpf[b"watch_on"]
        on[on.Key(0)] = on.Leaf(1 if cgids else 0)

    def mark_kernel_threads(self, tids: list[int]) -> int:
        """Count these tasks under the kernel pseudo cgroup from now on. New
        kernel threads are recognised in the kernel (forked by kthreadd); this
        covers the ones that existed before the programs were attached.
        Returns how many were marked."""
        table = self._bpf[b"tasks"]
        marked = 0
        for tid in tids:
            key = table.Key(tid)
            try:
                info = table[key]
            except KeyError:
                # Not seen yet: as if running, so a wakeup before its first
                # traced switch-out cannot start a bogus wait.
                info = TaskInfo(ts=0, cgid=KERNEL_CGID, preemptor_cgid=0, state=TS_RUNNING, flags=0)
            info.flags |= TF_KTHREAD
            info.cgid = KERNEL_CGID
            try:
                table[key] = info
                marked += 1
            except Exception:  # the task map is full: the thread stays counted as host
                continue
        return marked

    def _on_event(self, ctx, data, size) -> None:
        e = ct.cast(data, ct.POINTER(RawEvent)).contents
        self._events.append(SchedEvent(e.cgid, e.kind, e.start_ns, e.end_ns, e.other_cgid, e.tid))

    def drain_events(self) -> list[SchedEvent]:
        """Every event the ring buffer holds, oldest first."""
        if not self._ring_open:
            return []
        self._bpf.ring_buffer_consume()
        out, self._events = self._events, []
        return out

    def baseline(self) -> ProbeSnapshot:
        """The all-zero snapshot of the moment the programs were attached."""
        return ProbeSnapshot(mono_ns=self.load_mono_ns, wall=self.load_wall)

    def snapshot(self) -> ProbeSnapshot:
        mono = monotonic_ns()
        wall = time.time()
        hists: dict[tuple[int, int], dict[int, Bucket]] = {}
        for key, vals in self._read("hists"):
            count = sum(v.count for v in vals)
            if count:
                hists.setdefault((key.cgid, key.kind), {})[key.slot] = Bucket(count, sum(v.sum_ns for v in vals))
        pairs = self._read_pairs("pairs")
        holders = self._read_pairs("holders")
        cgroups = {}
        for key, vals in self._read("cgroups"):
            cgroups[int(key)] = CgroupCounters(
                migrations=sum(v.migrations for v in vals),
                untraced_switch_in=sum(v.untraced_switch_in for v in vals),
                untraced_switch_out=sum(v.untraced_switch_out for v in vals),
                untraced_wakeup=sum(v.untraced_wakeup for v in vals),
            )
        err_table = self._bpf[b"errors"]
        errors = {name: int(sum(err_table.getvalue(i))) for i, name in enumerate(ERROR_MAPS)}
        return ProbeSnapshot(mono_ns=mono, wall=wall, hists=hists, pairs=pairs, holders=holders, cgroups=cgroups,
                             errors=errors, programs=self.program_stats())

    def _read_pairs(self, name: str) -> dict[tuple[int, int], PairCounters]:
        return {(key.victim_cgid, key.preemptor_cgid): PairCounters(sum(v.count for v in vals),
                                                                    sum(v.wait_ns for v in vals))
                for key, vals in self._read(name)}

    def program_stats(self) -> dict[str, ProgramStats]:
        """run_cnt / run_time_ns per program, from /proc/self/fdinfo (zero
        unless kernel.bpf_stats_enabled is on)."""
        out = {}
        for name, fd in self.program_fds().items():
            fields = {}
            try:
                for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines():
                    k, _, v = line.partition(":")
                    fields[k.strip()] = v.strip()
            except OSError:
                continue
            out[name] = ProgramStats(int(fields.get("run_cnt", 0)), int(fields.get("run_time_ns", 0)))
        return out

    def _read(self, name: str):
        """All (key, per-CPU values) of a per-CPU hash map, in batches."""
        key_t, val_t = MAP_TYPES[name]
        if name not in self._buffers:
            keys = (key_t * BATCH)()
            vals = ((val_t * self._ncpu) * BATCH)()
            self._buffers[name] = (keys, vals)
        keys, vals = self._buffers[name]
        fd = self._bpf[name.encode()].map_fd
        in_batch = ct.c_uint32(0)
        out_batch = ct.c_uint32(0)
        first = True
        while True:
            count = ct.c_uint32(BATCH)
            res = self._lib.bpf_lookup_batch(fd, None if first else ct.byref(in_batch), ct.byref(out_batch),
                                             ct.byref(keys), ct.byref(vals), ct.byref(count))
            err = ct.get_errno()
            # The views point into the reused buffers: the caller reduces each
            # entry before asking for the next one.
            for i in range(count.value):
                yield keys[i], vals[i]
            if res != 0:
                if err == errno.ENOENT:
                    break
                if first and err in (errno.EINVAL, ENOTSUPP):
                    # Kernels before 5.6 have no batch lookup: one key at a time.
                    yield from self._bpf[name.encode()].items()
                    return
                raise OSError(err, f"reading BPF map {name}: {os.strerror(err)}")
            first = False
            in_batch.value = out_batch.value
