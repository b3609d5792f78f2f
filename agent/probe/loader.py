"""Loads bpf/sched.bpf.c with BCC, drains its maps, hands out snapshots.

The only module that imports bcc. Every snapshot drains the counting maps:
flip the generation the programs count into, wait out programs still using
the old one, read the old generation in batches (one syscall per chunk), then
delete exactly those keys. Entries of dead cgroups vanish with their last
interval and the maps hold one interval of live data (docs/maps.md).
"""

from __future__ import annotations

import ctypes as ct
import errno
import os
import time
from dataclasses import dataclass
from pathlib import Path

import agent
from agent.probe.features import ATTACH_MODES, Features
import numpy as np

from agent.probe.layout import (BLAME_CACHE, ERROR_MAPS, HIST_CACHE, MAP_TYPES, NR_TALLY, TALLY_IOWAIT, TALLY_RUNQ,
                                TF_KTHREAD, TS_RUNNING, BlameSlot, Ctl, HistSlot, TaskInfo)
from agent.probe.snapshot import (BLAME_ROW, CGROUP_FIELDS, CGROUP_ROW, EVENT_ROW, HIST_ROW, KERNEL_CGID,
                                  ProbeSnapshot, ProgramStats, SchedEvent, events_of)
from agent.probe.ring import RingReader
from agent.probe.tracing import TracingPrograms

BATCH = 4096
ENOTSUPP = 524  # kernel-internal errno for an unsupported map operation; not in Python's errno


@dataclass(frozen=True)
class MapSizes:
    """max_entries of each map. The counting maps hold one interval of live
    keys, not all-time ones; their memory does not grow with the number of
    CPUs (docs/maps.md gives the formula, bench/mapmem.py computes it)."""

    tasks: int = 65536
    hists: int = 262144              # (cgroup, kind, slot) keys of one interval, both generations
    blame: int = 131072              # (victim, culprit, kind) keys of one interval
    cgroups: int = 16384             # cgroups active in one interval
    watched: int = 1024
    # Per CPU and generation; a power of two. The default exceeds the 434
    # slots of one cgroup's histogram, so a busy cgroup never evicts its own.
    hist_cache: int = HIST_CACHE
    blame_cache: int = BLAME_CACHE
    event_pages: int = 1024          # 4 MiB of ring buffer with 4 KiB pages
    event_rate: int = 53687          # events per CPU per 2^30 ns window: events_per_window(50000 a second)


def events_per_window(per_second: int) -> int:
    """The programs count events in windows of 2^30 ns (~1.07 s)."""
    return round(per_second * (1 << 30) / 1e9)


def bpf_source_dir() -> Path:
    """agent/bpf in an installed package (pyproject maps bpf/ there), bpf/ in a
    checkout or an editable install."""
    package = Path(agent.__file__).parent
    for candidate in (package / "bpf", package.parent / "bpf"):
        if (candidate / "sched.bpf.c").is_file():
            return candidate
    raise FileNotFoundError(f"sched.bpf.c not found in {package / 'bpf'} or {package.parent / 'bpf'}: "
                            "reinstall slatrace")


def attach_mode(features: Features, wanted: str = "auto") -> str:
    """The attachment to use, or ValueError saying why the wanted one cannot be."""
    if wanted not in ATTACH_MODES:
        raise ValueError(f"the attach mode must be one of {', '.join(ATTACH_MODES)}, got {wanted!r}")
    layout = features.task_layout
    if wanted == "classic" or (wanted == "auto" and layout is None):
        return "classic"
    if layout is None:
        raise ValueError(f"{wanted} tracepoints are not usable on this kernel: {features.raw_unavailable}")
    if wanted == "raw" or (wanted == "auto" and not layout.btf_trace_ids):
        return "raw"
    if not layout.btf_trace_ids:
        raise ValueError(f"BTF-typed tracepoints are not usable on this kernel: {layout.btf_tracing_missing}")
    return "btf"


def cflags(features: Features, sizes: MapSizes, mode: str = "classic", skip_wakeups: int = 0) -> list[str]:
    """The compiler's -I and -D flags. skip_wakeups (tests only): the wake-up
    programs ignore about one wake-up in that many, as if the kernel had
    skipped them, so the recovery of the waits they leave can be checked."""
    values = {
        "PREEMPT_BIT": features.states.preempt,
        "STATE_D": features.states.d,
        "STATE_DEAD": features.states.dead,
        "MAX_TASKS": sizes.tasks,
        "MAX_HIST": sizes.hists,
        "MAX_BLAME": sizes.blame,
        "MAX_CGROUPS": sizes.cgroups,
        "MAX_WATCHED": sizes.watched,
        "HIST_CACHE": sizes.hist_cache,
        "BLAME_CACHE": sizes.blame_cache,
        "EVENT_PAGES": sizes.event_pages,
        "MAX_EVENT_RATE": sizes.event_rate,
    }
    for name, n in (("EVENT_PAGES", sizes.event_pages), ("HIST_CACHE", sizes.hist_cache),
                    ("BLAME_CACHE", sizes.blame_cache)):
        if n < 1 or n & (n - 1):
            raise ValueError(f"{name}={n} must be a power of two")
    if mode in ("raw", "btf"):
        values["RAW_TP"] = 1
        if mode == "btf":
            values["TP_BTF"] = 1
            chain = features.task_layout.cgroup_chain
            if chain is not None:
                values.update(TASK_CGROUPS_OFF=chain.task_cgroups, CSS_SET_DFL_CGRP_OFF=chain.css_set_dfl_cgrp,
                              CGROUP_KN_OFF=chain.cgroup_kn, KERNFS_NODE_ID_OFF=chain.kernfs_node_id)
        values["TASK_PID_OFF"] = features.task_layout.pid_offset
        values["TASK_FLAGS_OFF"] = features.task_layout.flags_offset
        if features.task_layout.state_offset is not None:
            values["TASK_STATE_OFF"] = features.task_layout.state_offset
        clock = features.task_layout.queue_clock
        if clock is not None:
            values.update(TASK_LAST_QUEUED_OFF=clock.last_queued, TASK_SE_CFS_RQ_OFF=clock.se_cfs_rq,
                          CFS_RQ_RQ_OFF=clock.cfs_rq_rq, RQ_CLOCK_OFF=clock.rq_clock)
        if features.task_layout.limit_clock is not None:
            values.update(features.task_layout.limit_clock.defines())
    if skip_wakeups:
        values["SKIP_WAKEUPS"] = skip_wakeups
    for name, value in values.items():
        if not isinstance(value, int) or value < 0 or value >= 1 << 32:
            raise ValueError(f"{name}={value!r} is not a valid unsigned 32-bit value")
    return [f"-I{bpf_source_dir()}"] + [f"-D{k}={v:#x}" for k, v in values.items()]


class MapMemoryError(Exception):
    """The kernel refused a BPF map's memory: under a memory cgroup's limit, the
    maps' kernel memory is charged on top of what the compile holds."""

    def __str__(self) -> str:
        return ("the kernel refused memory for the BPF maps (Cannot allocate memory): the memory cgroup's "
                "limit is too small for the maps' kernel memory on top of the compile's peak; raise the "
                "container's memory limit (BENCHMARKS.md, 'Memory cgroup charge')")


# Per-CPU write-combining caches -> entry type. Each holds two halves, one
# per generation, of max_entries / 2 entries.
CACHES = {"hist_cache": HistSlot, "blame_cache": BlameSlot}


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
        self._ring: RingReader | None = None   # the event stream, once something is watched
        self._ctl = Ctl(gen=0, watch_on=0)
        self.mode = "classic"  # set by load(): "btf", "raw" or "classic" tracepoints
        # Why "auto" fell back from "btf" to "raw" on this kernel, if it did.
        self.btf_refused = ""
        self._tracing = None   # the BTF-typed programs (agent/probe/tracing.py), in "btf" mode
        self._errors_seen = {name: 0 for name in ERROR_MAPS}
        # Whether the kernel has batch operations on per-CPU arrays (5.13 on);
        # None until the first drain asks.
        self._array_batch: bool | None = None

    @classmethod
    def load(cls, features: Features, sizes: MapSizes = MapSizes(), tracepoints: str = "auto",
             skip_wakeups: int = 0) -> "Probe":
        """Compile and attach. tracepoints: "auto" (the cheapest this kernel
        has), "btf", "raw" or "classic"; ValueError when the one asked for
        cannot be used here. Where the kernel refuses the BTF-typed programs
        (a kernel between 5.11 and the one that let tracing programs use
        task-local storage), "auto" takes raw tracepoints and says why in
        btf_refused. skip_wakeups: see cflags()."""
        mode = attach_mode(features, tracepoints)
        if mode != "btf":
            return cls._load(features, sizes, mode, skip_wakeups)
        try:
            return cls._load(features, sizes, mode, skip_wakeups)
        except MapMemoryError:
            raise
        except Exception as e:  # BCC raises a bare Exception when the kernel refuses a map
            if tracepoints != "auto":
                raise
            probe = cls._load(features, sizes, "raw", skip_wakeups)
            probe.btf_refused = str(e).strip() or type(e).__name__
            return probe

    @classmethod
    def _load(cls, features: Features, sizes: MapSizes, mode: str, skip_wakeups: int) -> "Probe":
        from bcc import BPF  # noqa: PLC0415  (bcc only where BPF is loaded)

        src = bpf_source_dir() / "sched.bpf.c"
        try:
            bpf = BPF(src_file=str(src).encode(), cflags=cflags(features, sizes, mode, skip_wakeups))
        except Exception:
            # libbcc's errno when it gave up (ctypes keeps it): ENOMEM is a map
            # the kernel could not charge, BCC's message says "failed to compile".
            if ct.get_errno() == errno.ENOMEM:
                raise MapMemoryError() from None
            raise
        ncpu = len(bpf[b"errors"].getvalue(0))
        probe = cls(bpf, ncpu)
        probe.mode = mode
        if mode == "btf":
            try:
                probe._tracing = TracingPrograms(bpf, dict(features.task_layout.btf_trace_ids))
                probe._tracing.attach()
            except BaseException:
                probe.close()
                raise
        return probe

    @property
    def bpf(self):
        return self._bpf

    def close(self) -> None:
        if self._ring is not None:
            self._ring.close()
            self._ring = None
        if self._tracing is not None:
            self._tracing.close()
            self._tracing = None
        if self._bpf is not None:
            self._bpf.cleanup()
            self._bpf = None

    def program_fds(self) -> dict[str, int]:
        """Program name (the tracepoint) -> fd, for the kernel's cost counters."""
        out = {}
        for name, fn in self._bpf.funcs.items():
            short = name.decode().rsplit("__", 1)[-1]
            out[short] = fn.fd
        if self._tracing is not None:
            out.update(self._tracing.prog_fds)
        return out

    def watch(self, cgids: set[int]) -> None:
        """Stream exact wait events for exactly these cgroups from now on."""
        table = self._bpf[b"watched"]
        current = {int(k.value) for k in table.keys()}
        for cgid in current - cgids:
            del table[table.Key(cgid)]
        for cgid in cgids - current:
            table[table.Key(cgid)] = table.Leaf(1)
        if cgids and self._ring is None:
            events = self._bpf[b"events"]
            self._ring = RingReader(events.map_fd, events.max_entries, EVENT_ROW)
        self._ctl.watch_on = 1 if cgids else 0
        self._write_ctl()

    def _write_ctl(self) -> None:
        table = self._bpf[b"ctl"]
        table[table.Key(0)] = self._ctl

    def _wait_for_programs(self) -> None:
        """Return once no program that may have read the old ctl.gen still runs.

        The kernel answers an update of a map of maps from user space only
        after an RCU grace period (kernel/bpf/syscall.c, since 4.20), and every
        tracepoint program runs inside an RCU read-side section: the update of
        the fence map is that wait. A fixed sleep is not enough: a program runs
        for microseconds, but a virtual CPU the hypervisor takes away stalls
        inside it for as long as it is away, and a straggler that adds to an
        entry between the read and the delete (or the zeroing of a cache
        entry) loses its wait without a trace, in the tally as well.
        """
        fence = self._bpf[b"fence"]
        fence[fence.Key(0)] = fence.Leaf(self._bpf[b"fence_inner"].map_fd)

    def mark_kernel_threads(self, tids: list[int]) -> int:
        """Count these tasks under the kernel pseudo cgroup from now on. New
        kernel threads are recognised in the kernel (forked by kthreadd); this
        covers the ones that existed before the programs were attached, on
        classic tracepoints. Raw tracepoints key tasks by address, which user
        space cannot name: there the programs read PF_KTHREAD when a task is
        first seen, and nothing is marked here. Returns how many were marked."""
        if self.mode != "classic":
            return 0
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
            except Exception:  # noqa: BLE001  (the task map is full: the thread stays counted as host)
                continue
        return marked

    def drain_event_rows(self) -> np.ndarray:
        """Every event the ring buffer holds, oldest first, as EVENT_ROW rows."""
        if self._ring is None:
            return np.empty(0, dtype=EVENT_ROW)
        return self._ring.drain()

    def dropped_events(self) -> int:
        """Events the stream dropped since load, all CPUs: a full ring buffer
        and the rate limit (the errors array, read without draining it)."""
        err = self._bpf[b"errors"]
        return sum(int(sum(err.getvalue(i))) for i, name in enumerate(ERROR_MAPS) if name.startswith("events"))

    def drain_events(self) -> list[SchedEvent]:
        """Every event the ring buffer holds, oldest first."""
        return events_of(self.drain_event_rows())

    def baseline(self) -> ProbeSnapshot:
        """The all-zero snapshot of the moment the programs were attached."""
        return ProbeSnapshot(mono_ns=self.load_mono_ns, wall=self.load_wall)

    def snapshot(self) -> ProbeSnapshot:
        """Drain one generation of the counting maps: the counts since the
        previous snapshot (or since load)."""
        old = self._ctl.gen
        self._ctl.gen = old ^ 1
        self._write_ctl()
        self._wait_for_programs()
        mono = monotonic_ns()
        wall = time.time()
        hist_keys, hist_vals = _sum_rows(*self._drain("hists", old), *self._drain_cache("hist_cache", old),
                                         ("cgid", "kind", "slot"))
        blame_keys, blame_vals = _sum_rows(*self._drain("blame", old), *self._drain_cache("blame_cache", old),
                                           ("victim_cgid", "culprit_cgid", "kind"))
        cg_keys, cg_vals = self._drain("cgroups", old)
        return ProbeSnapshot(mono_ns=mono, wall=wall, hist_rows=_hist_rows(hist_keys, hist_vals),
                             blame_rows=_blame_rows(blame_keys, blame_vals),
                             cgroup_rows=_cgroup_rows(cg_keys, cg_vals), errors=self._error_counts(),
                             programs=self.program_stats(), tally=self._drain_tally(old))

    def _drain_tally(self, gen: int) -> tuple[int, int]:
        """The waits the programs saw in generation `gen` (bpf/sched.h tally),
        summed over CPUs, then zeroed for that generation's next turn."""
        table = self._bpf[b"tally"]
        out = []
        for kind in (TALLY_RUNQ, TALLY_IOWAIT):
            key = table.Key(gen * NR_TALLY + kind)
            out.append(int(sum(table.getvalue(key))))
            table[key] = table.Leaf()
        return out[0], out[1]

    def _error_counts(self) -> dict[str, int]:
        err_table = self._bpf[b"errors"]
        return {name: int(sum(err_table.getvalue(i))) for i, name in enumerate(ERROR_MAPS)}

    def program_stats(self) -> dict[str, ProgramStats]:
        """run_cnt / run_time_ns per program, from /proc/self/fdinfo (zero
        unless kernel.bpf_stats_enabled is on), and the runs the kernel
        skipped (recursion_misses, always counted; absent before 5.12)."""
        out = {}
        for name, fd in self.program_fds().items():
            fields = {}
            try:
                for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines():
                    k, _, v = line.partition(":")
                    fields[k.strip()] = v.strip()
            except OSError:
                continue
            out[name] = ProgramStats(int(fields.get("run_cnt", 0)), int(fields.get("run_time_ns", 0)),
                                     int(fields.get("recursion_misses", 0)))
        return out

    def _drain(self, name: str, gen: int) -> tuple[np.ndarray, np.ndarray]:
        """Read every entry of generation `gen`, then delete exactly those.

        Runs after the flip and the fence, so no program writes to
        these keys any more: nothing counted between the read and the delete
        is lost. Entries of the current generation are read too (the batch
        interface cannot filter) but left alone; right after the flip there
        are only a few.
        """
        parts = list(self._batches(name))
        key_t, val_t = MAP_TYPES[name]
        if not parts:
            return np.empty(0, np.dtype(key_t)), np.empty(0, np.dtype(val_t))
        keys = np.concatenate([k for k, _ in parts])
        vals = np.concatenate([v for _, v in parts])
        mine = keys["gen"] == gen
        keys, vals = keys[mine], vals[mine]
        self._delete(name, keys)
        return keys, vals

    def _drain_cache(self, name: str, gen: int) -> tuple[np.ndarray, np.ndarray]:
        """The keys and values generation `gen` left in a per-CPU
        write-combining cache (hist_cache, blame_cache: bpf/sched.h), one row
        per used entry per CPU, then that half zeroed for its next turn. Same
        fence as the maps: no program adds to this half any more."""
        slot_t = CACHES[name]
        table = self._bpf[name.encode()]
        fd, entries = table.map_fd, table.max_entries // 2
        first = gen * entries
        index = np.arange(first, first + entries, dtype=np.uint32)
        slots = np.zeros((entries, self._ncpu), np.dtype(slot_t))
        if not self._read_array(name, fd, first, index, slots):
            # Per-CPU arrays have batch operations from 5.13 only: one entry at a time.
            for i in range(entries):
                idx = ct.c_uint32(first + i)
                if self._lib.bpf_lookup_elem(fd, ct.byref(idx), slots[i].ctypes.data) != 0:
                    err = ct.get_errno()
                    raise OSError(err, f"reading BPF map {name}: {os.strerror(err)}")
        used = (slots["val"]["count"] != 0).any(axis=1)
        self._zero_entries(name, fd, index[used], slot_t)
        rows = slots[used].reshape(-1)
        rows = rows[rows["val"]["count"] != 0]
        return rows["key"], rows["val"]

    def _read_array(self, name: str, fd: int, first: int, index: np.ndarray, slots: np.ndarray) -> bool:
        """Read entries first.. of an array map into `slots` in one batch;
        False where the kernel has no batch lookup for this map type.

        Success is the call's return value, never the count: a kernel without
        the operation leaves the count as it was passed, which reads as
        "all read" over buffers still full of zeros."""
        if self._array_batch is False:
            return False
        # The batch token is the key before the first one wanted (none: from 0).
        before, out, count = ct.c_uint32(first - 1), ct.c_uint32(0), ct.c_uint32(len(index))
        res = self._lib.bpf_lookup_batch(fd, ct.byref(before) if first else None, ct.byref(out),
                                         index.ctypes.data, slots.ctypes.data, ct.byref(count))
        err = ct.get_errno() if res != 0 else 0
        if res == 0 or (err == errno.ENOENT and count.value == len(index)):
            self._array_batch = True
            return True
        if err in (errno.EINVAL, ENOTSUPP) and not self._array_batch:
            self._array_batch = False
            return False
        raise OSError(err, f"reading BPF map {name}: {os.strerror(err)}")

    def _zero_entries(self, name: str, fd: int, index: np.ndarray, slot_t: type) -> None:
        """Zero these entries of a per-CPU array on every CPU, in one batch."""
        if not len(index):
            return
        index = np.ascontiguousarray(index, np.uint32)
        zeros = np.zeros((len(index), self._ncpu), np.dtype(slot_t))
        count = ct.c_uint32(len(index))
        if self._array_batch and self._lib.bpf_update_batch(fd, index.ctypes.data, zeros.ctypes.data,
                                                            ct.byref(count)) == 0:
            return
        if self._array_batch:
            err = ct.get_errno()
            raise OSError(err, f"clearing BPF map {name}: {os.strerror(err)}")
        # Per-CPU arrays have batch operations from 5.13 only: one entry at a time.
        for i, row in zip(index, zeros):
            idx = ct.c_uint32(int(i))
            if self._lib.bpf_update_elem(fd, ct.byref(idx), row.ctypes.data, 0) != 0:
                err = ct.get_errno()
                raise OSError(err, f"clearing BPF map {name}: {os.strerror(err)}")

    def _delete(self, name: str, keys: np.ndarray) -> None:
        fd = self._bpf[name.encode()].map_fd
        keys = np.ascontiguousarray(keys)
        done = 0
        while done < len(keys):
            count = ct.c_uint32(len(keys) - done)
            res = self._lib.bpf_delete_batch(fd, keys[done:].ctypes.data, ct.byref(count))
            err = ct.get_errno() if res != 0 else 0
            if res == 0 or err == errno.ENOENT:
                done += count.value  # else the count is not the kernel's (see _batches)
            if res != 0:
                if err == errno.ENOENT:
                    done += 1  # gone already: skip it and go on
                    continue
                if err in (errno.EINVAL, ENOTSUPP):
                    # Kernels before 5.6 have no batch delete: one key at a time.
                    table = self._bpf[name.encode()]
                    for row in keys[done:]:
                        try:
                            del table[table.Key.from_buffer_copy(row.tobytes())]
                        except KeyError:
                            pass
                    return
                raise OSError(err, f"deleting from BPF map {name}: {os.strerror(err)}")

    def _batches(self, name: str):
        """All (keys, values) of a hash map, as numpy arrays of one chunk each."""
        key_t, val_t = MAP_TYPES[name]
        if name not in self._buffers:
            self._buffers[name] = ((key_t * BATCH)(), (val_t * BATCH)())
        keys, vals = self._buffers[name]
        key_dt, val_dt = np.dtype(key_t), np.dtype(val_t)
        fd = self._bpf[name.encode()].map_fd
        in_batch = ct.c_uint32(0)
        out_batch = ct.c_uint32(0)
        first = True
        while True:
            count = ct.c_uint32(BATCH)
            res = self._lib.bpf_lookup_batch(fd, None if first else ct.byref(in_batch), ct.byref(out_batch),
                                             ct.byref(keys), ct.byref(vals), ct.byref(count))
            err = ct.get_errno() if res != 0 else 0
            # The count is the kernel's only on success or at the end (ENOENT);
            # a kernel without the operation leaves it as it was passed.
            n = count.value if res == 0 or err == errno.ENOENT else 0
            if n:
                # Copies: the buffers are reused by the next chunk.
                yield (np.frombuffer(keys, key_dt, n).copy(), np.frombuffer(vals, val_dt, n).copy())
            if res != 0:
                if err == errno.ENOENT:
                    break
                if first and err in (errno.EINVAL, ENOTSUPP):
                    # Kernels before 5.6 have no batch lookup: one key at a time.
                    items = list(self._bpf[name.encode()].items())
                    if items:
                        yield (np.frombuffer(b"".join(bytes(k) for k, _ in items), key_dt),
                               np.frombuffer(b"".join(bytes(v) for _, v in items), val_dt))
                    return
                raise OSError(err, f"reading BPF map {name}: {os.strerror(err)}")
            first = False
            in_batch.value = out_batch.value


def _rows(dtype: np.dtype, n: int, **columns: np.ndarray) -> np.ndarray:
    out = np.empty(n, dtype)
    for name, col in columns.items():
        out[name] = col
    return out


def _hist_rows(keys: np.ndarray, vals: np.ndarray) -> np.ndarray:
    return _rows(HIST_ROW, len(keys), cgid=keys["cgid"], kind=keys["kind"], slot=keys["slot"],
                 count=vals["count"], sum_ns=vals["sum_ns"])


def _sum_rows(keys: np.ndarray, vals: np.ndarray, more_keys: np.ndarray, more_vals: np.ndarray,
              fields: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Keys and values from a map and its per-CPU cache, one row per distinct
    key `fields` (the generation aside): a key can sit in both, and in
    several CPUs' caches. Every value field is summed."""
    if not len(more_keys):
        return keys, vals
    keys = np.concatenate([keys, more_keys.astype(keys.dtype)])
    vals = np.concatenate([vals, more_vals.astype(vals.dtype)])
    cols = np.stack([keys[f].astype(np.uint64) for f in fields], axis=1)
    uniq, first, inverse = np.unique(cols, axis=0, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    out = np.zeros(len(uniq), vals.dtype)
    for f in vals.dtype.names:
        np.add.at(out[f], inverse, vals[f])
    return keys[first], out


def _blame_rows(keys: np.ndarray, vals: np.ndarray) -> np.ndarray:
    return _rows(BLAME_ROW, len(keys), victim=keys["victim_cgid"], culprit=keys["culprit_cgid"], kind=keys["kind"],
                 count=vals["count"], wait_ns=vals["wait_ns"])


def _cgroup_rows(keys: np.ndarray, vals: np.ndarray) -> np.ndarray:
    return _rows(CGROUP_ROW, len(keys), cgid=keys["cgid"], **{f: vals[f] for f in CGROUP_FIELDS})
