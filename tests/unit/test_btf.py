"""Raw-tracepoint layout from a kernel's BTF, chosen by what the BTF says:
sched_switch's prototype tells whether prev_state is passed (5.18 on) or
read from the task (`__state` from 5.14, `state` before). The blobs are
built here in the kernel's BTF format (include/uapi/linux/btf.h) with the
shapes those kernels have; the kernel tier boots the real ones."""

import struct

import pytest

from agent import check
from agent.probe import btf

INT, PTR, STRUCT, TYPEDEF, FUNC_PROTO = 1, 2, 4, 8, 13


class Types:
    """A BTF blob built type by type; add() returns the new type's id."""

    def __init__(self) -> None:
        self.strings, self.types, self.count = b"\0", b"", 0

    def name(self, s: str) -> int:
        off = len(self.strings)
        self.strings += s.encode() + b"\0"
        return off

    def add(self, name: str, kind: int, ref: int, vlen: int = 0, trailer: bytes = b"") -> int:
        self.types += struct.pack("<III", self.name(name) if name else 0, kind << 24 | vlen, ref) + trailer
        self.count += 1
        return self.count

    def struct(self, name: str, members: list[tuple[str, int, int]]) -> int:
        trailer = b"".join(struct.pack("<III", self.name(m), t, off * 8) for m, t, off in members)
        return self.add(name, STRUCT, 64, len(members), trailer)

    def blob(self) -> bytes:
        header = struct.pack("<HBBIIIII", 0xEB9F, 1, 0, 24, 0, len(self.types), len(self.types), len(self.strings))
        return header + self.types + self.strings


def switch_prototype(t: Types, params: int) -> None:
    """The sched_switch raw tracepoint prototype: a context pointer and params more."""
    ctx = t.add("", PTR, 0)
    proto = t.add("", FUNC_PROTO, 0, params + 1, b"".join(struct.pack("<II", 0, ctx) for _ in range(params + 1)))
    t.add("btf_trace_sched_switch", TYPEDEF, t.add("", PTR, proto))


def blob(task_members: list[tuple[str, int]], switch_params: int) -> bytes:
    """task_struct with (name, byte offset) int members, and a sched_switch
    raw tracepoint prototype taking a context pointer and switch_params more."""
    t = Types()
    i32 = t.add("int", INT, 4, trailer=struct.pack("<I", 32))
    t.struct("task_struct", [(m, i32, off) for m, off in task_members])
    switch_prototype(t, switch_params)
    return t.blob()


@pytest.mark.parametrize("members, params, state", [
    ([("pid", 2232), ("flags", 36), ("state", 16)], 3, ("state", 16)),        # 5.10: no prev_state, long state
    ([("pid", 2464), ("flags", 44), ("__state", 24)], 3, ("__state", 24)),    # 5.15: no prev_state, __state
    ([("pid", 1264), ("flags", 44), ("__state", 24)], 4, None),               # 5.18 on: prev_state passed
])
def test_the_state_comes_from_where_the_kernel_has_it(tmp_path, monkeypatch, members, params, state):
    path = tmp_path / "vmlinux"
    path.write_bytes(blob(members, params))
    layout = btf.task_layout(path)
    offsets = dict(members)
    assert (layout.pid_offset, layout.flags_offset) == (offsets["pid"], offsets["flags"])
    assert (None if layout.state_offset is None else (layout.state_field, layout.state_offset)) == state
    monkeypatch.setattr(check, "task_layout", lambda: btf.task_layout(path))
    detail = check.attachment("5.10.0-46-amd64").detail
    assert detail.startswith("kernel 5.10.0-46-amd64: raw tracepoints")
    if state:
        assert f"read from task_struct.{state[0]} at byte {state[1]}" in detail
    else:
        assert "sched_switch passes prev_state" in detail


def test_a_task_without_a_state_field_is_named(tmp_path):
    path = tmp_path / "vmlinux"
    path.write_bytes(blob([("pid", 8), ("flags", 4)], 3))
    with pytest.raises(btf.BtfError, match="neither __state nor state"):
        btf.task_layout(path)


VOLATILE, CONST = 9, 10


def queue_clock_blob(with_rq: bool) -> bytes:
    """task_struct -> se.cfs_rq -> rq -> clock, as the kernel nests them, with
    the typedefs and qualifiers a member's type goes through; without
    cfs_rq.rq when the kernel lacks CONFIG_FAIR_GROUP_SCHED."""
    t = Types()
    u32 = t.add("int", INT, 4, trailer=struct.pack("<I", 32))
    u64 = t.add("u64", TYPEDEF, t.add("long long unsigned int", INT, 8, trailer=struct.pack("<I", 64)))
    rq = t.struct("rq", [("nr_running", u32, 0), ("clock", t.add("", VOLATILE, u64), 2776)])
    rq_ptr = t.add("", PTR, rq)
    cfs_rq = t.struct("cfs_rq", [("load", u64, 0)] + ([("rq", rq_ptr, 312)] if with_rq else []))
    cfs_rq_ptr = t.add("", CONST, t.add("", PTR, cfs_rq))
    se = t.struct("sched_entity", [("load", u64, 0), ("cfs_rq", cfs_rq_ptr, 128)])
    info = t.struct("sched_info", [("pcount", u64, 0), ("last_queued", u64, 24)])
    t.struct("task_struct", [("flags", u32, 44), ("se", se, 168), ("sched_info", info, 1024), ("pid", u32, 1264)])
    switch_prototype(t, 4)
    return t.blob()


def test_the_enqueue_time_and_the_run_queue_clock_are_found_through_pointers(tmp_path):
    path = tmp_path / "vmlinux"
    path.write_bytes(queue_clock_blob(with_rq=True))
    layout = btf.task_layout(path)
    assert (layout.pid_offset, layout.flags_offset) == (1264, 44)
    assert layout.queue_clock == btf.QueueClock(last_queued=1024 + 24, se_cfs_rq=168 + 128, cfs_rq_rq=312,
                                                rq_clock=2776)


def test_a_kernel_without_the_run_queue_pointer_says_so_and_still_attaches(tmp_path, monkeypatch):
    path = tmp_path / "vmlinux"
    path.write_bytes(queue_clock_blob(with_rq=False))
    layout = btf.task_layout(path)
    assert layout.queue_clock is None and "cfs_rq.rq not found" in layout.queue_clock_missing
    monkeypatch.setattr(check, "task_layout", lambda: btf.task_layout(path))
    detail = check.attachment("6.1.0-1-amd64").detail
    assert "raw tracepoints" in detail and "is lost, only counted (cfs_rq.rq not found" in detail


UNION = 5


def btf_tracing_blob(tracepoints: tuple[str, ...], task_storage: bool, id_bytes: int = 8) -> bytes:
    """A 6.x kernel's shapes for the BTF-typed mode: a btf_trace_<name> type
    per tracepoint, the task-local storage map type (an enumerator of enum
    bpf_map_type, here only its name) and task->cgroups->dfl_cgrp->kn->id,
    an 8-byte id from 5.5 (a union of two ints before)."""
    t = Types()
    u32 = t.add("int", INT, 4, trailer=struct.pack("<I", 32))
    u64 = t.add("u64", TYPEDEF, t.add("long long unsigned int", INT, 8, trailer=struct.pack("<I", 64)))
    kn_id = u64 if id_bytes == 8 else t.add("kernfs_node_id", UNION, 8, 2, b"".join(
        struct.pack("<III", t.name(m), u32, off * 8) for m, off in (("ino", 0), ("generation", 4))))
    kn = t.struct("kernfs_node", [("count", u32, 0), ("id", kn_id, 96)])
    cgroup = t.struct("cgroup", [("flags", u32, 0), ("kn", t.add("", PTR, kn), 256)])
    css_set = t.struct("css_set", [("refcount", u32, 0), ("dfl_cgrp", t.add("", PTR, cgroup), 112)])
    rcu = t.add("rcu", 18, css_set)   # BTF_KIND_TYPE_TAG: the kernel's __rcu
    t.struct("task_struct", [("flags", u32, 44), ("pid", u32, 1264), ("cgroups", t.add("", PTR, rcu), 2376)])
    if task_storage:
        t.name("BPF_MAP_TYPE_TASK_STORAGE")
    switch_prototype(t, 4)
    for name in tracepoints:
        if name != "sched_switch":
            t.add(f"btf_trace_{name}", TYPEDEF, t.add("", PTR, t.add("", FUNC_PROTO, 0)))
    return t.blob()


def test_btf_typed_tracepoints_and_the_cgroup_chain_are_found(tmp_path, monkeypatch):
    path = tmp_path / "vmlinux"
    path.write_bytes(btf_tracing_blob(btf.RAW_TRACEPOINTS, task_storage=True))
    layout = btf.task_layout(path)
    assert [name for name, _ in layout.btf_trace_ids] == list(btf.RAW_TRACEPOINTS)
    assert len({tid for _, tid in layout.btf_trace_ids}) == len(btf.RAW_TRACEPOINTS) and not layout.btf_tracing_missing
    assert layout.cgroup_chain == btf.CgroupChain(task_cgroups=2376, css_set_dfl_cgrp=112, cgroup_kn=256,
                                                  kernfs_node_id=96)
    monkeypatch.setattr(check, "task_layout", lambda: btf.task_layout(path))
    assert check.attachment("6.12.118+deb13-amd64").detail.startswith("kernel 6.12.118+deb13-amd64: btf tracepoints")


@pytest.mark.parametrize("tracepoints, task_storage, missing", [
    (btf.RAW_TRACEPOINTS, False, "no task-local storage (BPF_MAP_TYPE_TASK_STORAGE, 5.11+)"),
    (btf.RAW_TRACEPOINTS[:-1], True, "BTF has no btf_trace_sched_waking"),
])
def test_a_kernel_without_btf_typed_tracepoints_says_why_and_takes_raw_ones(tmp_path, monkeypatch, tracepoints,
                                                                            task_storage, missing):
    path = tmp_path / "vmlinux"
    path.write_bytes(btf_tracing_blob(tracepoints, task_storage))
    layout = btf.task_layout(path)
    assert layout.btf_trace_ids == () and missing in layout.btf_tracing_missing
    monkeypatch.setattr(check, "task_layout", lambda: btf.task_layout(path))
    detail = check.attachment("5.10.0-46-amd64").detail
    assert detail.startswith("kernel 5.10.0-46-amd64: raw tracepoints, because BTF-typed ones are not usable (")
    assert f"{missing}): ~{check.MODE_COST_NS['raw']} ns per context switch" in detail


def test_a_cgroup_id_that_is_not_one_integer_leaves_the_helper(tmp_path):
    """Before 5.5 kernfs_node.id was a union: the programs then call
    bpf_get_current_cgroup_id() instead of reading it."""
    path = tmp_path / "vmlinux"
    path.write_bytes(btf_tracing_blob(btf.RAW_TRACEPOINTS, task_storage=True, id_bytes=0))
    assert btf.task_layout(path).cgroup_chain is None
