"""ctypes mirrors of the structs in bpf/sched.h.

BCC builds its own ctypes types from the compiled program; these mirrors exist
so the reader can allocate batch buffers without a loaded program and so a
test can check that both agree field by field (tests/kernel/test_layout.py).
"""

from __future__ import annotations

import ctypes as ct


class TaskInfo(ct.Structure):
    _fields_ = [
        ("ts", ct.c_uint64),
        ("cgid", ct.c_uint64),
        ("preemptor_cgid", ct.c_uint64),
        ("state", ct.c_uint32),
        ("flags", ct.c_uint32),
    ]


class HistKey(ct.Structure):
    _fields_ = [("cgid", ct.c_uint64), ("kind", ct.c_uint32), ("slot", ct.c_uint32)]


class HistVal(ct.Structure):
    _fields_ = [("count", ct.c_uint64), ("sum_ns", ct.c_uint64)]


class PairKey(ct.Structure):
    _fields_ = [("victim_cgid", ct.c_uint64), ("preemptor_cgid", ct.c_uint64)]


class PairVal(ct.Structure):
    _fields_ = [("count", ct.c_uint64), ("wait_ns", ct.c_uint64)]


class CgroupVal(ct.Structure):
    _fields_ = [
        ("migrations", ct.c_uint64),
        ("untraced_switch_in", ct.c_uint64),
        ("untraced_switch_out", ct.c_uint64),
        ("untraced_wakeup", ct.c_uint64),
    ]


class SchedEvent(ct.Structure):
    _fields_ = [
        ("cgid", ct.c_uint64),
        ("other_cgid", ct.c_uint64),
        ("start_ns", ct.c_uint64),
        ("end_ns", ct.c_uint64),
        ("tid", ct.c_uint32),
        ("kind", ct.c_uint32),
    ]


class EventRate(ct.Structure):
    _fields_ = [("window", ct.c_uint64), ("count", ct.c_uint64)]


# map name -> (key type, value type) as declared in bpf/sched.bpf.c
MAP_TYPES: dict[str, tuple[type, type]] = {
    "tasks": (ct.c_uint32, TaskInfo),
    "hists": (HistKey, HistVal),
    "pairs": (PairKey, PairVal),
    "holders": (PairKey, PairVal),
    "cgroups": (ct.c_uint64, CgroupVal),
    "errors": (ct.c_uint32, ct.c_uint64),
    "watch_on": (ct.c_uint32, ct.c_uint32),
    "watched": (ct.c_uint64, ct.c_uint8),
    "event_rates": (ct.c_uint32, EventRate),
}

# index in the errors array -> the map whose update failed (bpf/sched.h ERR_*)
ERROR_MAPS = ("tasks", "hists", "pairs", "cgroups", "events", "events_rate_limited")
