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


def blob(task_members: list[tuple[str, int]], switch_params: int) -> bytes:
    """task_struct with (name, byte offset) int members, and a sched_switch
    raw tracepoint prototype taking a context pointer and switch_params more."""
    strings = b"\0"

    def name(s: str) -> int:
        nonlocal strings
        off = len(strings)
        strings += s.encode() + b"\0"
        return off

    types = b""
    # 1: int
    types += struct.pack("<III", name("int"), INT << 24, 4) + struct.pack("<I", 32)
    # 2: struct task_struct
    members = b"".join(struct.pack("<III", name(m), 1, off * 8) for m, off in task_members)
    types += struct.pack("<III", name("task_struct"), STRUCT << 24 | len(task_members), 4096) + members
    # 3: void *(ctx), 4: func proto, 5: ptr to it, 6: typedef btf_trace_sched_switch
    types += struct.pack("<III", 0, PTR << 24, 0)
    params = b"".join(struct.pack("<II", 0, 3) for _ in range(switch_params + 1))
    types += struct.pack("<III", 0, FUNC_PROTO << 24 | (switch_params + 1), 0) + params
    types += struct.pack("<III", 0, PTR << 24, 4)
    types += struct.pack("<III", name("btf_trace_sched_switch"), TYPEDEF << 24, 5)
    header = struct.pack("<HBBIIIII", 0xEB9F, 1, 0, 24, 0, len(types), len(types), len(strings))
    return header + types + strings


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
