"""Loads bpf/sched.bpf.c, drains its maps, hands out snapshots.

BCC compiles, loads and attaches the programs in a short-lived child process
(agent/probe/build.py), which hands over the maps, programs and attachments
as file descriptors: this process reads them with the bpf(2) system call
(agent/probe/bpfsys.py) and never maps libbcc or the compiler. Every
snapshot drains the counting maps:
flip the generation the programs count into, wait out programs still using
the old one, read the old generation in batches (one syscall per chunk), then
delete exactly those keys. Entries of dead cgroups vanish with their last
interval and the maps hold one interval of live data (docs/maps.md).
"""

from __future__ import annotations

import ctypes as ct
import errno
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import agent
from agent.probe.features import ATTACH_MODES, Features
import numpy as np

from agent.probe.bpfsys import BpfMap, possible_cpus, raw_tracepoint_open
from agent.probe.btf import WATCH_TRACEPOINTS
from agent.probe.build import Built, BuildError, BuildProcess, MapMemoryError, PendingBuild
from agent.probe.layout import (BLAME_CACHE, ERROR_MAPS, HIST_CACHE, MAP_TYPES, NR_TALLY, TALLY_IOWAIT, TALLY_RUNQ,
                                TF_KTHREAD, TS_RUNNING, BlameSlot, Ctl, HistSlot, TaskInfo)
from agent.probe.snapshot import (BLAME_ROW, CGROUP_FIELDS, CGROUP_ROW, EVENT_ROW, HIST_ROW, KERNEL_CGID,
                                  ProbeSnapshot, ProgramStats, SchedEvent, events_of)
from agent.probe.ring import RingReader

log = logging.getLogger(__name__)

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
        if features.task_layout.tgid_offset is not None:
            values["TASK_TGID_OFF"] = features.task_layout.tgid_offset
        if features.task_layout.state_offset is not None:
            values["TASK_STATE_OFF"] = features.task_layout.state_offset
        clock = features.task_layout.queue_clock
        if clock is not None:
            values.update(TASK_LAST_QUEUED_OFF=clock.last_queued, TASK_SE_CFS_RQ_OFF=clock.se_cfs_rq,
                          CFS_RQ_RQ_OFF=clock.cfs_rq_rq, RQ_CLOCK_OFF=clock.rq_clock)
        if features.task_layout.limit_clock is not None:
            values.update(features.task_layout.limit_clock.defines())
        if features.task_layout.syscall_site is not None:
            values.update(features.task_layout.syscall_site.defines())
    if skip_wakeups:
        values["SKIP_WAKEUPS"] = skip_wakeups
    for name, value in values.items():
        if not isinstance(value, int) or value < 0 or value >= 1 << 32:
            raise ValueError(f"{name}={value!r} is not a valid unsigned 32-bit value")
    return [f"-I{bpf_source_dir()}"] + [f"-D{k}={v:#x}" for k, v in values.items()]


__all__ = ["BuildError", "MapMemoryError", "MapSizes", "Probe", "ProbeLoad", "attach_mode", "cflags",
           "events_per_window"]


# Per-CPU write-combining caches -> entry type. Each holds two halves, one
# per generation, of max_entries / 2 entries.
CACHES = {"hist_cache": HistSlot, "blame_cache": BlameSlot}


def monotonic_ns() -> int:
    """CLOCK_MONOTONIC, the clock of bpf_ktime_get_ns()."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


class Probe:
    """The loaded BPF programs. Create with Probe.load(); close() detaches."""

    def __init__(self, built: Built, ncpu: int) -> None:
        self._built = built
        self._ncpu = ncpu
        self._maps = {name: BpfMap.from_fd(name, fd, ncpu) for name, fd in built.maps.items()}
        self._buffers: dict[str, tuple] = {}
        self.load_mono_ns = monotonic_ns()
        self.load_wall = time.time()
        self._ring: RingReader | None = None   # the event stream, once something is watched
        self._watch_links: list[int] = []       # the WATCH_TRACEPOINTS programs, attached while watching
        self._ctl = Ctl(gen=0, watch_on=0)
        self.mode = "classic"  # set by load(): "btf", "raw" or "classic" tracepoints
        # Why "auto" fell back from "btf" to "raw" on this kernel, if it did.
        self.btf_refused = ""
        self._errors_seen = {name: 0 for name in ERROR_MAPS}
        # Whether the kernel has batch operations on per-CPU arrays (5.13 on);
        # None until the first drain asks.
        self._array_batch: bool | None = None

    @classmethod
    def load(cls, features: Features, sizes: MapSizes = MapSizes(), tracepoints: str = "auto",
             skip_wakeups: int = 0, cache_dir: Path | None = None) -> "Probe":
        """Compile and attach. tracepoints: "auto" (the cheapest this kernel
        has), "btf", "raw" or "classic"; ValueError when the one asked for
        cannot be used here. Where the kernel refuses the BTF-typed programs
        (a kernel between 5.11 and the one that let tracing programs use
        task-local storage), "auto" takes raw tracepoints and says why in
        btf_refused. skip_wakeups: see cflags(). cache_dir: where compiled
        programs are kept (agent/probe/cache.py); None compiles every time."""
        return cls.begin_load(features, sizes, tracepoints, skip_wakeups, cache_dir=cache_dir).result()

    @classmethod
    def begin_load(cls, features: Features, sizes: MapSizes = MapSizes(), tracepoints: str = "auto",
                   skip_wakeups: int = 0, process: BuildProcess | None = None,
                   cache_dir: Path | None = None) -> "ProbeLoad":
        """load(), started: the compile runs in its own process while the
        caller goes on; ProbeLoad.result() gives the Probe. `process`: a build
        process started ahead (it has imported BCC meanwhile), with the same
        cache_dir."""
        return ProbeLoad(cls, features, sizes, attach_mode(features, tracepoints), tracepoints == "auto",
                         skip_wakeups, process, cache_dir)

    @property
    def build_peak_bytes(self) -> int | None:
        """The build process's resident peak (VmHWM): the compile's."""
        return self._built.peak_bytes

    @property
    def cache(self) -> tuple[str, str]:
        """Where the programs came from ("hit", "miss", "refused",
        "unprivileged" or "off": agent/probe/build.py) and the build
        process's note on it."""
        return self._built.cache, self._built.cache_note

    def map_type_descriptions(self) -> dict[str, tuple[str, str]]:
        """Map name -> BCC's JSON descriptions of its key and value types, as compiled."""
        return dict(self._built.types)

    def close(self) -> None:
        """Detach (the attachments go first) and release every map."""
        self._attach_watch_programs(False)
        if self._ring is not None:
            self._ring.close()
            self._ring = None
        self._built.close()
        self._maps = {}

    def program_fds(self) -> dict[str, int]:
        """Program name (the tracepoint) -> fd, for the kernel's cost counters."""
        return dict(self._built.programs)

    def _map(self, name: str) -> BpfMap:
        try:
            return self._maps[name]
        except KeyError:
            raise KeyError(f"the loaded programs have no map {name!r} (closed?)") from None

    def watch(self, cgids: set[int]) -> None:
        """Stream exact wait events for exactly these cgroups from now on."""
        table = self._map("watched")
        key_t, val_t = MAP_TYPES["watched"]
        current = {key_t.from_buffer_copy(k).value for k in table.keys()}
        for cgid in current - cgids:
            table.delete(bytes(key_t(cgid)))
        for cgid in cgids - current:
            table.update(bytes(key_t(cgid)), bytes(val_t(1)))
        if cgids and self._ring is None:
            events = self._map("events")
            self._ring = RingReader(events.fd, events.max_entries, EVENT_ROW)
        self._attach_watch_programs(bool(cgids))
        self._ctl.watch_on = 1 if cgids else 0
        self._write_ctl()

    def _attach_watch_programs(self, on: bool) -> None:
        """The programs that serve only the event stream (sched_waking: who
        woke whom across processes) run while something is watched, and
        cost nothing on the wake-ups of a node that watches nothing."""
        if not on:
            for fd in self._watch_links:
                os.close(fd)
            self._watch_links = []
            return
        if self._watch_links or self.mode == "classic":
            return
        for name in WATCH_TRACEPOINTS:
            fd = self._built.programs.get(name)
            if fd is None:
                continue
            link = raw_tracepoint_open(fd, name if self.mode == "raw" else None)
            if link < 0:
                log.warning("cannot attach the %s program (%s): a request's delay counts every process of "
                            "its service", name, os.strerror(-link))
                continue
            self._watch_links.append(link)

    def _write_ctl(self) -> None:
        self._map("ctl").update(bytes(ct.c_uint32(0)), bytes(self._ctl))

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
        self._map("fence").update(bytes(ct.c_uint32(0)), bytes(ct.c_uint32(self._map("fence_inner").fd)))

    def mark_kernel_threads(self, tids: list[int]) -> int:
        """Count these tasks under the kernel pseudo cgroup from now on. New
        kernel threads are recognised in the kernel (forked by kthreadd); this
        covers the ones that existed before the programs were attached, on
        classic tracepoints. Raw tracepoints key tasks by address, which user
        space cannot name: there the programs read PF_KTHREAD when a task is
        first seen, and nothing is marked here. Returns how many were marked."""
        if self.mode != "classic":
            return 0
        table = self._map("tasks")
        key_t = MAP_TYPES["tasks"][0]
        marked = 0
        for tid in tids:
            key = bytes(key_t(tid))
            found = table.lookup(key)
            # Not seen yet: as if running, so a wakeup before its first
            # traced switch-out cannot start a bogus wait.
            info = TaskInfo.from_buffer_copy(found) if found is not None else \
                TaskInfo(ts=0, cgid=KERNEL_CGID, preemptor_cgid=0, state=TS_RUNNING, flags=0)
            info.flags |= TF_KTHREAD
            info.cgid = KERNEL_CGID
            try:
                table.update(key, bytes(info))
                marked += 1
            except OSError:  # the task map is full: the thread stays counted as host
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
        return sum(self._percpu_sum("errors", i) for i, name in enumerate(ERROR_MAPS) if name.startswith("events"))

    def _percpu_sum(self, name: str, index: int) -> int:
        """Entry `index` of a per-CPU array of u64, summed over CPUs."""
        value = self._map(name).lookup(bytes(ct.c_uint32(index)))
        return int(np.frombuffer(value, np.uint64).sum()) if value is not None else 0

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
        table = self._map("tally")
        out = []
        for kind in (TALLY_RUNQ, TALLY_IOWAIT):
            index = gen * NR_TALLY + kind
            out.append(self._percpu_sum("tally", index))
            table.update(bytes(ct.c_uint32(index)), bytes(table.value_bytes))
        return out[0], out[1]

    def _error_counts(self) -> dict[str, int]:
        return {name: self._percpu_sum("errors", i) for i, name in enumerate(ERROR_MAPS)}

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
        table = self._map(name)
        entries = table.max_entries // 2
        first = gen * entries
        index = np.arange(first, first + entries, dtype=np.uint32)
        slots = np.zeros((entries, self._ncpu), np.dtype(slot_t))
        if not self._read_array(table, first, index, slots):
            # Per-CPU arrays have batch operations from 5.13 only: one entry at a time.
            for i in range(entries):
                value = table.lookup(bytes(ct.c_uint32(first + i)))
                if value is not None:
                    slots[i] = np.frombuffer(value, slots.dtype, self._ncpu)
        used = (slots["val"]["count"] != 0).any(axis=1)
        self._zero_entries(table, index[used], slot_t)
        rows = slots[used].reshape(-1)
        rows = rows[rows["val"]["count"] != 0]
        return rows["key"], rows["val"]

    def _read_array(self, table: BpfMap, first: int, index: np.ndarray, slots: np.ndarray) -> bool:
        """Read entries first.. of an array map into `slots` in one batch;
        False where the kernel has no batch lookup for this map type.

        Success is the call's return value, never the count: a kernel without
        the operation leaves the count as it was passed, which reads as
        "all read" over buffers still full of zeros."""
        if self._array_batch is False:
            return False
        # The batch token is the key before the first one wanted (none: from 0).
        before, out, count = ct.c_uint32(first - 1), ct.c_uint32(0), ct.c_uint32(len(index))
        res = table.lookup_batch(before if first else None, out, index.ctypes.data, slots.ctypes.data, count)
        err = -res if res < 0 else 0
        if res == 0 or (err == errno.ENOENT and count.value == len(index)):
            self._array_batch = True
            return True
        if err in (errno.EINVAL, ENOTSUPP) and not self._array_batch:
            self._array_batch = False
            return False
        raise OSError(err, f"reading BPF map {table.name}: {os.strerror(err)}")

    def _zero_entries(self, table: BpfMap, index: np.ndarray, slot_t: type) -> None:
        """Zero these entries of a per-CPU array on every CPU, in one batch."""
        if not len(index):
            return
        index = np.ascontiguousarray(index, np.uint32)
        zeros = np.zeros((len(index), self._ncpu), np.dtype(slot_t))
        count = ct.c_uint32(len(index))
        if self._array_batch:
            res = table.update_batch(index.ctypes.data, zeros.ctypes.data, count)
            if res == 0:
                return
            raise OSError(-res, f"clearing BPF map {table.name}: {os.strerror(-res)}")
        # Per-CPU arrays have batch operations from 5.13 only: one entry at a time.
        for i, row in zip(index, zeros):
            table.update(bytes(ct.c_uint32(int(i))), row.tobytes())

    def _delete(self, name: str, keys: np.ndarray) -> None:
        table = self._map(name)
        keys = np.ascontiguousarray(keys)
        done = 0
        while done < len(keys):
            count = ct.c_uint32(len(keys) - done)
            res = table.delete_batch(keys[done:].ctypes.data, count)
            err = -res if res < 0 else 0
            if res == 0 or err == errno.ENOENT:
                done += count.value  # else the count is not the kernel's (see _batches)
            if res != 0:
                if err == errno.ENOENT:
                    done += 1  # gone already: skip it and go on
                    continue
                if err in (errno.EINVAL, ENOTSUPP):
                    # Kernels before 5.6 have no batch delete: one key at a time.
                    for row in keys[done:]:
                        table.delete(row.tobytes())
                    return
                raise OSError(err, f"deleting from BPF map {name}: {os.strerror(err)}")

    def _batches(self, name: str):
        """All (keys, values) of a hash map, as numpy arrays of one chunk each."""
        key_t, val_t = MAP_TYPES[name]
        if name not in self._buffers:
            self._buffers[name] = ((key_t * BATCH)(), (val_t * BATCH)())
        keys, vals = self._buffers[name]
        key_dt, val_dt = np.dtype(key_t), np.dtype(val_t)
        table = self._map(name)
        in_batch = ct.c_uint32(0)
        out_batch = ct.c_uint32(0)
        first = True
        while True:
            count = ct.c_uint32(BATCH)
            res = table.lookup_batch(None if first else in_batch, out_batch, keys, vals, count)
            err = -res if res < 0 else 0
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
                    items = list(table.items())
                    if items:
                        yield (np.frombuffer(b"".join(k for k, _ in items), key_dt),
                               np.frombuffer(b"".join(v for _, v in items), val_dt))
                    return
                raise OSError(err, f"reading BPF map {name}: {os.strerror(err)}")
            first = False
            in_batch.value = out_batch.value


class ProbeLoad:
    """A Probe being compiled and attached by its build process
    (agent/probe/build.py); result() waits for it, cancel() stops it."""

    def __init__(self, probe_cls: type[Probe], features: Features, sizes: MapSizes, mode: str, fall_back: bool,
                 skip_wakeups: int, process: BuildProcess | None = None, cache_dir: Path | None = None) -> None:
        self._cls, self._features, self._sizes, self._skip = probe_cls, features, sizes, skip_wakeups
        self._process, self._cache_dir = process, cache_dir
        # "auto" on BTF-typed tracepoints falls back to raw ones if the kernel refuses them
        self._fall_back = fall_back and mode == "btf"
        self._mode = mode
        self._pending: PendingBuild | None = self._begin(mode)

    def _begin(self, mode: str) -> PendingBuild:
        trace_ids = dict(self._features.task_layout.btf_trace_ids) if mode == "btf" else {}
        process, self._process = self._process, None   # a child started ahead serves the first build
        if process is None:
            process = BuildProcess(self._cache_dir)
        return PendingBuild(bpf_source_dir() / "sched.bpf.c", cflags(self._features, self._sizes, mode, self._skip),
                            mode, trace_ids, process=process)

    def cancel(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None

    def result(self) -> Probe:
        refused = ""
        try:
            built = self._pending.result()
        except MapMemoryError:
            raise
        except Exception as e:  # BuildError or TracingError: the kernel refused the BTF-typed programs
            if not self._fall_back:
                raise
            refused = str(e).strip() or type(e).__name__
            self._mode = "raw"
            self._pending = self._begin("raw")
            built = self._pending.result()
        finally:
            self._pending = None
        try:
            probe = self._cls(built, possible_cpus())
        except BaseException:
            built.close()
            raise
        probe.mode = self._mode
        probe.btf_refused = refused
        return probe


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
