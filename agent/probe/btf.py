"""The few kernel layout facts the raw-tracepoint programs need, from BTF.

Raw tracepoints hand a program `struct task_struct *` pointers instead of a
record the kernel filled for it, which spares the cost of filling that record
on every context switch. The programs key their task map by those pointers and
read two task fields only off the hot path (the pid for events, the flags once
per task), at offsets that differ between kernel builds: they are taken here
from the running kernel's own type information (/sys/kernel/btf/vmlinux) and
passed to the compiler as -D constants, so no kernel header is ever trusted
for them.

For BTF-typed tracepoints they give the type id of each tracepoint
(btf_trace_<name>, what such a program attaches to), whether the kernel has
task-local storage, and the chain of pointers from a task to its cgroup v2
id, which those programs follow with plain loads.

They also locate, when the kernel keeps them, the scheduler's own enqueue time
of a task (task_struct.sched_info.last_queued, on the run queue's clock) and
that clock (rq.clock, reached through task_struct.se.cfs_rq->rq): a switch-in
whose wake-up the programs never saw recovers its wait from them.

Only what is needed is decoded: struct members (name, type, bit offset) and the
parameter count of the tracepoints' function prototypes (btf_trace_<name>),
which tells whether sched_switch passes prev_state (kernels from 5.18) or
the programs read it from the task (`__state` from 5.14, `state` before).
The format is the kernel's (include/uapi/linux/btf.h).
"""

from __future__ import annotations

import platform
import struct
from dataclasses import dataclass
from pathlib import Path

from agent.errors import SlatraceError

VMLINUX = Path("/sys/kernel/btf/vmlinux")

BTF_MAGIC = 0xEB9F
# kinds (btf.h BTF_KIND_*) and the bytes that follow a type's 12-byte header
KIND_PTR, KIND_STRUCT, KIND_UNION, KIND_TYPEDEF, KIND_FUNC, KIND_FUNC_PROTO = 2, 4, 5, 8, 12, 13
# what a member's type may wrap its struct or pointer in: typedef, and the
# qualifiers volatile, const, restrict, type_tag
KIND_QUALIFIERS = (KIND_TYPEDEF, 9, 10, 11, 18)
_TRAILER = {1: lambda vlen: 4, 3: lambda vlen: 12, 4: lambda vlen: 12 * vlen, 5: lambda vlen: 12 * vlen,
            6: lambda vlen: 8 * vlen, 13: lambda vlen: 8 * vlen, 14: lambda vlen: 4,
            15: lambda vlen: 12 * vlen, 17: lambda vlen: 4, 19: lambda vlen: 12 * vlen}


class BtfError(SlatraceError):
    """The kernel's BTF is missing or lacks what the raw-tracepoint path needs."""


@dataclass(frozen=True)
class QueueClock:
    """Where the kernel keeps a queued task's enqueue time and the clock it is
    read on, in bytes. The scheduler stamps sched_info.last_queued with its
    run queue's clock when it enqueues a task (CONFIG_SCHED_INFO) and clears it
    only after the sched_switch tracepoint that runs the task, so at that
    tracepoint rq.clock - last_queued is the wait. The run queue is reached
    through the task's CFS run queue (cfs_rq.rq exists with
    CONFIG_FAIR_GROUP_SCHED), which points at the task's CPU for every class."""

    last_queued: int       # task_struct.sched_info.last_queued (u64, rq clock ns)
    se_cfs_rq: int         # task_struct.se.cfs_rq (struct cfs_rq *)
    cfs_rq_rq: int         # cfs_rq.rq (struct rq *)
    rq_clock: int          # rq.clock (u64 ns)


@dataclass(frozen=True)
class LimitClock:
    """Where the scheduler keeps how long a CFS run queue was held by a CPU
    limit (CFS bandwidth: its cgroup's or an ancestor's quota ran out), in
    bytes: a wait's two readings on one run queue give the part of the wait
    the limit held (bpf/sched.bpf.c limit_clock()). Three generations of the
    same bookkeeping, by what the kernel's BTF has: `self` (6.7+,
    cfs_rq.throttled_clock_self(_time) on rq.clock, zeroed when a throttle
    ends), `pelt` (5.19+, throttled_clock_pelt(_time) on rq.clock_pelt less
    rq.lost_idle_time) and `task` (before, throttled_clock_task(_time) on
    rq.clock_task); the last two are in progress while cfs_rq.throttle_count
    is non-zero."""

    kind: str              # "self", "pelt" or "task"
    se_cfs_rq: int         # task_struct.se.cfs_rq (struct cfs_rq *)
    cfs_rq_rq: int         # cfs_rq.rq (struct rq *)
    since: int             # cfs_rq.throttled_clock_<kind> (u64): when the throttle in progress began
    total: int             # cfs_rq.throttled_clock_<kind>_time (u64): the throttles that ended
    count: int             # cfs_rq.throttle_count (int): throttled levels at or above
    clock: int             # the rq clock `since` is read on
    clock_less: int | None = None   # rq.lost_idle_time, subtracted from rq.clock_pelt

    def defines(self) -> dict[str, int]:
        """The -D macros bpf/sched.bpf.c reads them under."""
        out = {"THR_SE_CFS_RQ_OFF": self.se_cfs_rq, "THR_CFS_RQ_RQ_OFF": self.cfs_rq_rq,
               "THR_SINCE_OFF": self.since, "THR_TOTAL_OFF": self.total, "THR_CLOCK_OFF": self.clock}
        if self.kind == "self":
            out["THR_BY_SINCE"] = 1
        else:
            out["THR_COUNT_OFF"] = self.count
        if self.clock_less is not None:
            out["THR_CLOCK_LESS_OFF"] = self.clock_less
        # The fields the helper reads, as one 8-byte-aligned block when they
        # lie close together (they do: the kernel declares them side by side).
        fields = [(self.since, 8), (self.total, 8)] + ([] if self.kind == "self" else [(self.count, 4)])
        lo = min(off for off, _ in fields) & ~7
        hi = max(off + size for off, size in fields)
        length = (hi - lo + 7) & ~7
        if length <= 64:
            out.update(THR_BLOCK_OFF=lo, THR_BLOCK_LEN=length)
        return out


@dataclass(frozen=True)
class SyscallSite:
    """Where a switched-out task's system call number is, in bytes: the
    programs tell a wait that began with the thread yielding (sched_yield:
    a loop polling for work another thread makes) from a preemption by it.
    A task entering the kernel saves its user registers at the top of its
    kernel stack (task_pt_regs(): task->stack + THREAD_SIZE - the padding
    kept above them, less struct pt_regs), the system call number in
    orig_ax. x86_64 only; THREAD_SIZE and the padding are not in BTF: 16 KiB,
    twice that with KASAN, and 16 bytes of padding with FRED (6.9+), both
    told by functions only those kernels have."""

    task_stack: int        # task_struct.stack (void *)
    nr: int                # from the stack's base to pt_regs.orig_ax

    def defines(self) -> dict[str, int]:
        return {"TASK_STACK_OFF": self.task_stack, "STACK_SYSCALL_NR_OFF": self.nr,
                "NR_SCHED_YIELD": NR_SCHED_YIELD}


NR_SCHED_YIELD = 24        # x86_64 (arch/x86/entry/syscalls/syscall_64.tbl)


@dataclass(frozen=True)
class CgroupChain:
    """Where a task's cgroup v2 id is, as bpf_get_current_cgroup_id() reads
    it (task->cgroups->dfl_cgrp->kn->id), in bytes: BTF-typed programs follow
    the pointers with plain loads instead of calling the helper."""

    task_cgroups: int      # task_struct.cgroups (struct css_set *)
    css_set_dfl_cgrp: int  # css_set.dfl_cgrp (struct cgroup *)
    cgroup_kn: int         # cgroup.kn (struct kernfs_node *)
    kernfs_node_id: int    # kernfs_node.id (u64 from 5.5)


@dataclass(frozen=True)
class TaskLayout:
    """What the raw-tracepoint programs read, in bytes."""

    pid_offset: int        # task_struct.pid (pid_t)
    flags_offset: int      # task_struct.flags (unsigned int, PF_*)
    tgid_offset: int | None = None   # task_struct.tgid (pid_t): the process of a woken task
    # Where prev's state comes from at sched_switch: None when the tracepoint
    # passes it (prev_state, kernels from 5.18); else the offset of the task's
    # own state field, `__state` (unsigned int, from 5.14) or `state` (long,
    # before; its low 32 bits hold every state bit on little-endian).
    state_offset: int | None = None
    state_field: str = "prev_state"
    # None when the kernel's BTF lacks one of its fields; queue_clock_missing
    # then says which.
    queue_clock: QueueClock | None = None
    queue_clock_missing: str = ""
    # BTF-typed tracepoints with task-local storage (agent/probe/tracing.py):
    # the BTF type id of each tracepoint's btf_trace_<name> typedef, empty
    # when the kernel lacks one or task-local storage; btf_tracing_missing
    # then says which.
    btf_trace_ids: tuple[tuple[str, int], ...] = ()
    btf_tracing_missing: str = ""
    # None when the kernel's BTF lacks one of the links: the helper then.
    cgroup_chain: CgroupChain | None = None
    # None when the kernel keeps no CFS bandwidth bookkeeping the programs can
    # read (CONFIG_CFS_BANDWIDTH off); limit_clock_missing then says why.
    limit_clock: LimitClock | None = None
    limit_clock_missing: str = ""
    # None where the programs cannot read a switched-out task's system call
    # (another architecture): yields then read as preemptions.
    syscall_site: SyscallSite | None = None
    syscall_site_missing: str = ""


class _Btf:
    """Type headers indexed in one pass; names and members decoded on demand
    (vmlinux has ~150,000 types, of which three matter here)."""

    def __init__(self, data: bytes) -> None:
        magic, _version, _flags, hdr_len = struct.unpack_from("<HBBI", data, 0)
        if magic != BTF_MAGIC:
            raise BtfError("not a little-endian BTF blob")
        type_off, type_len, str_off, str_len = struct.unpack_from("<IIII", data, 8)
        self._data = data
        self._strings = data[hdr_len + str_off: hdr_len + str_off + str_len]
        self._pos = [0]  # type ids start at 1
        pos, end = hdr_len + type_off, hdr_len + type_off + type_len
        unpack = struct.Struct("<III").unpack_from
        while pos < end:
            self._pos.append(pos)
            _name, info, _ref = unpack(data, pos)
            kind, vlen = (info >> 24) & 0x1F, info & 0xFFFF
            trailer = _TRAILER.get(kind)
            pos += 12 + (trailer(vlen) if trailer else 0)

    def header(self, tid: int) -> tuple[int, int, int, bool, int]:
        """(name offset, kind, vlen, kflag, size-or-type) of a type id."""
        name_off, info, ref = struct.unpack_from("<III", self._data, self._pos[tid])
        return name_off, (info >> 24) & 0x1F, info & 0xFFFF, bool(info >> 31), ref

    def name_offset(self, name: str) -> int | None:
        off = self._strings.find(b"\0" + name.encode() + b"\0")
        return None if off < 0 else off + 1

    def find(self, kind: int, name: str) -> int | None:
        want = self.name_offset(name)
        if want is None:
            return None
        for tid in range(1, len(self._pos)):
            name_off, k, *_ = self.header(tid)
            if name_off == want and k == kind:
                return tid
        return None

    def members(self, tid: int) -> list[tuple[str, int, int]]:
        """(name, type id, bit offset) of a struct or union's members."""
        _name, _kind, vlen, kflag, _size = self.header(tid)
        pos = self._pos[tid] + 12
        out = []
        for m_name, m_type, m_off in struct.iter_unpack("<III", self._data[pos:pos + 12 * vlen]):
            end = self._strings.index(b"\0", m_name)
            out.append((self._strings[m_name:end].decode(), m_type, m_off & 0xFFFFFF if kflag else m_off))
        return out


def _strip(btf: _Btf, tid: int) -> tuple[int, int]:
    """(type id, kind) under typedefs and qualifiers."""
    while True:
        _name, kind, _vlen, _kflag, ref = btf.header(tid)
        if kind not in KIND_QUALIFIERS:
            return tid, kind
        tid = ref


def _member(btf: _Btf, tid: int, member: str, owner: str) -> tuple[int, int]:
    """(byte offset, type id) of a member of struct type tid, looking through
    anonymous structs and unions."""
    def find(tid: int, base_bits: int) -> tuple[int, int] | None:
        for m_name, m_type, bits in btf.members(tid):
            if m_name == member:
                return base_bits + bits, m_type
            if not m_name and btf.header(m_type)[1] in (KIND_STRUCT, KIND_UNION):
                found = find(m_type, base_bits + bits)
                if found is not None:
                    return found
        return None

    found = find(tid, 0)
    if found is None or found[0] % 8:
        raise BtfError(f"{owner}.{member} not found (or not byte-aligned) in the kernel's BTF")
    return found[0] // 8, found[1]


def _struct(btf: _Btf, name: str) -> int:
    tid = btf.find(KIND_STRUCT, name)
    if tid is None:
        raise BtfError(f"struct {name} not found in the kernel's BTF")
    return tid


def _member_offset(btf: _Btf, struct_name: str, member: str) -> int:
    """Byte offset of a member, looking through anonymous structs and unions."""
    return _path(btf, _struct(btf, struct_name), member, struct_name)[0]


def _path(btf: _Btf, tid: int, path: str, owner: str) -> tuple[int, int]:
    """(byte offset, type id) of a dotted member path inside struct type tid."""
    offset = 0
    for member in path.split("."):
        tid, kind = _strip(btf, tid)
        if kind not in (KIND_STRUCT, KIND_UNION):
            raise BtfError(f"{owner} is not a struct in the kernel's BTF")
        off, tid = _member(btf, tid, member, owner)
        offset, owner = offset + off, f"{owner}.{member}"
    return offset, tid


def _pointee(btf: _Btf, tid: int, what: str) -> int:
    """The struct a pointer member points to."""
    tid, kind = _strip(btf, tid)
    if kind != KIND_PTR:
        raise BtfError(f"{what} is not a pointer in the kernel's BTF")
    return btf.header(tid)[4]


def _cgroup_chain(btf: _Btf) -> CgroupChain | None:
    offsets = []
    tid, owner = _struct(btf, "task_struct"), "task_struct"
    try:
        for member in ("cgroups", "dfl_cgrp", "kn"):
            off, ptr = _path(btf, tid, member, owner)
            offsets.append(off)
            tid, owner = _pointee(btf, ptr, f"{owner}.{member}"), f"{owner}.{member}"
        off, id_type = _path(btf, tid, "id", owner)
    except BtfError:
        return None
    id_type, kind = _strip(btf, id_type)
    if kind != 1 or btf.header(id_type)[4] != 8:   # an 8-byte integer (a union before 5.5)
        return None
    return CgroupChain(*offsets, off)


def _queue_clock(btf: _Btf) -> QueueClock:
    task = _struct(btf, "task_struct")
    last_queued, _ = _path(btf, task, "sched_info.last_queued", "task_struct")
    se_cfs_rq, cfs_rq_ptr = _path(btf, task, "se.cfs_rq", "task_struct")
    cfs_rq = _pointee(btf, cfs_rq_ptr, "task_struct.se.cfs_rq")
    cfs_rq_rq, rq_ptr = _path(btf, cfs_rq, "rq", "cfs_rq")
    rq = _pointee(btf, rq_ptr, "cfs_rq.rq")
    rq_clock, _ = _path(btf, rq, "clock", "rq")
    return QueueClock(last_queued=last_queued, se_cfs_rq=se_cfs_rq, cfs_rq_rq=cfs_rq_rq, rq_clock=rq_clock)


def _syscall_site(btf: _Btf) -> SyscallSite:
    if platform.machine() != "x86_64":
        raise BtfError(f"the programs read a task's system call on x86_64 only, not {platform.machine()}")
    stack = _member_offset(btf, "task_struct", "stack")
    regs = _struct(btf, "pt_regs")
    orig_ax = _member_offset(btf, "pt_regs", "orig_ax")
    thread_size = 16384 << (1 if btf.find(KIND_FUNC, "kasan_report") is not None else 0)
    padding = 16 if btf.find(KIND_FUNC, "fred_entry_from_user") is not None else 0
    return SyscallSite(task_stack=stack, nr=thread_size - padding - btf.header(regs)[4] + orig_ax)


# (kind, cfs_rq fields' suffix, rq clock, what is subtracted from it), newest first.
_LIMIT_CLOCKS = (("self", "self", "clock", None), ("pelt", "pelt", "clock_pelt", "lost_idle_time"),
                 ("task", "task", "clock_task", None))


def _limit_clock(btf: _Btf) -> LimitClock:
    task = _struct(btf, "task_struct")
    se_cfs_rq, cfs_rq_ptr = _path(btf, task, "se.cfs_rq", "task_struct")
    cfs_rq = _pointee(btf, cfs_rq_ptr, "task_struct.se.cfs_rq")
    cfs_rq_rq, rq_ptr = _path(btf, cfs_rq, "rq", "cfs_rq")
    rq = _pointee(btf, rq_ptr, "cfs_rq.rq")
    count, _ = _path(btf, cfs_rq, "throttle_count", "cfs_rq")
    for kind, suffix, clock, less in _LIMIT_CLOCKS:
        try:
            since, _ = _path(btf, cfs_rq, f"throttled_clock_{suffix}", "cfs_rq")
            total, _ = _path(btf, cfs_rq, f"throttled_clock_{suffix}_time", "cfs_rq")
            clock_off, _ = _path(btf, rq, clock, "rq")
            less_off = _path(btf, rq, less, "rq")[0] if less else None
        except BtfError:
            continue
        return LimitClock(kind, se_cfs_rq, cfs_rq_rq, since, total, count, clock_off, less_off)
    raise BtfError("cfs_rq has no throttled_clock_self, _pelt or _task bookkeeping in the kernel's BTF")


def _tracepoint_params(btf: _Btf, tracepoint: str) -> int | None:
    """Arguments of a raw tracepoint (without the leading context pointer)."""
    tid = btf.find(KIND_TYPEDEF, f"btf_trace_{tracepoint}")
    if tid is None:
        return None
    ptr = btf.header(tid)[4]
    _n, kind, _v, _k, proto = btf.header(ptr)
    if kind != KIND_PTR:
        return None
    _n, kind, vlen, _k, _r = btf.header(proto)
    return vlen - 1 if kind == KIND_FUNC_PROTO else None


# The tracepoints the programs attach to (bpf/sched.bpf.c) in every mode,
TRACEPOINTS = ("sched_switch", "sched_wakeup", "sched_wakeup_new", "sched_migrate_task", "sched_process_fork",
               "sched_process_exit")
# and on raw and BTF-typed tracepoints, which pass the woken task: sched_waking,
# in the waker's context (on_waking()). It serves only the event stream, so it
# is attached only while a service is watched (Probe.watch): a node whose
# services send no spans pays nothing for it on its every wake-up.
WATCH_TRACEPOINTS = ("sched_waking",)
RAW_TRACEPOINTS = TRACEPOINTS + WATCH_TRACEPOINTS


def _btf_tracing(btf: _Btf) -> dict:
    """What BTF-typed tracepoints need: each tracepoint's type, and task-local
    storage (the map type, 5.11+; whether tracing programs may use it is the
    verifier's to say when they load)."""
    if btf.name_offset("BPF_MAP_TYPE_TASK_STORAGE") is None:
        return {"btf_tracing_missing": "the kernel has no task-local storage (BPF_MAP_TYPE_TASK_STORAGE, 5.11+)"}
    ids = []
    for name in RAW_TRACEPOINTS:
        tid = btf.find(KIND_TYPEDEF, f"btf_trace_{name}")
        if tid is None:
            return {"btf_tracing_missing": f"the kernel's BTF has no btf_trace_{name}"}
        ids.append((name, tid))
    return {"btf_trace_ids": tuple(ids)}


def task_layout(path: Path = VMLINUX) -> TaskLayout:
    """The task_struct offsets, when the raw-tracepoint path can run here.

    Chosen by what the kernel's BTF says, not by its version: sched_switch's
    prototype tells whether prev_state is passed (from 5.18) or must be read
    from the task. Raises BtfError naming what is missing (no BTF)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise BtfError(f"cannot read the kernel's BTF at {path} ({e.strerror})") from None
    btf = _Btf(data)
    switch_args = _tracepoint_params(btf, "sched_switch")
    if switch_args is None or switch_args < 3:
        raise BtfError("the kernel's BTF has no sched_switch(preempt, prev, next) raw tracepoint prototype")
    pid, flags = _member_offset(btf, "task_struct", "pid"), _member_offset(btf, "task_struct", "flags")
    try:
        tgid = _member_offset(btf, "task_struct", "tgid")
    except BtfError:
        tgid = None   # wake-ups across processes are then not told
    try:
        clock = {"queue_clock": _queue_clock(btf)}
    except BtfError as e:
        clock = {"queue_clock_missing": str(e)}
    clock.update(_btf_tracing(btf), cgroup_chain=_cgroup_chain(btf))
    try:
        clock["limit_clock"] = _limit_clock(btf)
    except BtfError as e:
        clock["limit_clock_missing"] = str(e)
    try:
        clock["syscall_site"] = _syscall_site(btf)
    except BtfError as e:
        clock["syscall_site_missing"] = str(e)
    if switch_args >= 4:
        return TaskLayout(pid_offset=pid, flags_offset=flags, tgid_offset=tgid, **clock)
    # Before 5.18 the tracepoint does not pass prev_state: read it from prev.
    for field in ("__state", "state"):
        try:
            state = _member_offset(btf, "task_struct", field)
            return TaskLayout(pid_offset=pid, flags_offset=flags, tgid_offset=tgid, state_offset=state,
                              state_field=field, **clock)
        except BtfError:
            continue
    raise BtfError("sched_switch does not pass prev_state and task_struct has neither __state nor state in the "
                   "kernel's BTF")
