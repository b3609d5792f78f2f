"""The C <-> Python contract: every constant and struct of bpf/sched.h, once.

Nothing else in the agent restates a value from the header: histogram math,
snapshots and the loader import it from here. tests/unit/test_layout.py checks
every constant against the header's #defines, and tests/kernel/test_probe.py
checks the ctypes mirrors field by field against what BCC compiled (BCC builds
its own types; these exist so buffers can be allocated without a loaded
program). Pure: no bcc import.
"""

from __future__ import annotations

import ctypes as ct

# Log-linear histogram layout (hist_slot()).
HIST_MIN_SHIFT = 8
HIST_MAX_SHIFT = 34
HIST_SUB_SHIFT = 4
HIST_SUB = 1 << HIST_SUB_SHIFT
HIST_SLOTS = 2 + (HIST_MAX_SHIFT - HIST_MIN_SHIFT + 1) * HIST_SUB
# hist_key.kind
HIST_RUNQ = 0
HIST_IOWAIT = 1
HIST_RUNQ_LIMIT = 2   # the HIST_RUNQ waits a CPU limit held in part, counted again
NR_HIST_KINDS = 3
# The pseudo cgroup id kernel threads are counted under.
KERNEL_CGID = 0xFFFFFFFFFFFFFFFE
KTHREADD_PID = 2
TF_KTHREAD = 1
TF_THR_START = 2
TF_PEND_YIELD = 8
# task_info.state
TS_UNKNOWN = 0
TS_RUNNING = 1
TS_RUNNABLE = 2
TS_PREEMPTED = 3
TS_SLEEPING = 4
TS_BLOCKED = 5
TS_EXITING = 6
# sched_event.kind
EV_RUNQ = 0
EV_PREEMPTED = 1
EV_IOWAIT = 2
EV_MIGRATE = 3
EV_LIMIT = 4   # the part of a run-queue wait its CPU limit held
EV_YIELD = 5   # a run-queue wait that began with the task yielding (polling)
EV_WAKE = 6    # a wake-up across processes of watched services (other_cgid: the waker's process id)
# blame_key.kind
BLAME_PREEMPTED = 0
BLAME_HOLDER = 1
# The causes of a wait (sched.h CAUSE_*), in their numeric order: the one list
# of their names; agent/attribution/causes.py decides them.
CAUSE_NEIGHBOUR = 0
CAUSE_CPU_LIMIT = 1
CAUSE_OWN_THREADS = 2
CAUSE_KERNEL = 3
CAUSE_IDLE = 4
CAUSE_UNKNOWN = 5
NR_CAUSES = 6
CAUSES = ("neighbour", "cpu_limit", "own_threads", "kernel", "idle", "unknown")
# tally array index within a generation (the self-check's counts)
TALLY_RUNQ = 0
TALLY_IOWAIT = 1
NR_TALLY = 2
BLAME_CACHE = 64  # per-CPU blame_cache entries per generation
HIST_CACHE = 512  # per-CPU hist_cache entries per generation
# cgroup_val, in field order: the one Python list of the per-cgroup counters.
# The snapshot's rows and CgroupCounters, the store's columns, the exported
# families (agent/export/catalog.py names the fields it reads) all iterate it;
# the programs find a field's index from the struct itself (CG_INDEX()).
CGROUP_FIELDS = (
    "migrations", "untraced_switch_in", "untraced_switch_out", "untraced_wakeup", "recovered_wakeup",
    "lost_runq", "lost_runq_ns", "lost_iowait", "lost_iowait_ns", "lost_blame", "lost_blame_ns",
    "limited_runq", "limited_runq_ns",
)
# errors array index (ERR_*) -> the map whose update failed; "pairs" is the
# blame map (the name predates it and labels exported series).
ERROR_MAPS = ("tasks", "hists", "pairs", "cgroups", "events", "events_rate_limited")
NR_ERRORS = len(ERROR_MAPS)


class TaskInfo(ct.Structure):
    _fields_ = [
        ("ts", ct.c_uint64),
        ("cgid", ct.c_uint64),
        ("preemptor_cgid", ct.c_uint64),
        ("state", ct.c_uint32),
        ("flags", ct.c_uint32),
        ("thr_cfs_rq", ct.c_uint64),
        ("thr_ns", ct.c_uint64),
        ("pend_start", ct.c_uint64),
        ("pend_end", ct.c_uint64),
        ("pend_other", ct.c_uint64),
        ("pend_wait", ct.c_uint32),
        ("pend_n", ct.c_uint32),
    ]


class Ctl(ct.Structure):
    _fields_ = [("gen", ct.c_uint32), ("watch_on", ct.c_uint32)]


class HistKey(ct.Structure):
    _fields_ = [("cgid", ct.c_uint64), ("slot", ct.c_uint32), ("kind", ct.c_uint16), ("gen", ct.c_uint16)]


class HistVal(ct.Structure):
    _fields_ = [("count", ct.c_uint64), ("sum_ns", ct.c_uint64)]


class HistSlot(ct.Structure):
    _fields_ = [("key", HistKey), ("val", HistVal)]


class BlameKey(ct.Structure):
    _fields_ = [("victim_cgid", ct.c_uint64), ("culprit_cgid", ct.c_uint64), ("kind", ct.c_uint16),
                ("gen", ct.c_uint16), ("pad", ct.c_uint32)]


class BlameVal(ct.Structure):
    _fields_ = [("count", ct.c_uint64), ("wait_ns", ct.c_uint64)]


class BlameSlot(ct.Structure):
    _fields_ = [("key", BlameKey), ("val", BlameVal)]


class CgroupKey(ct.Structure):
    _fields_ = [("cgid", ct.c_uint64), ("gen", ct.c_uint32), ("pad", ct.c_uint32)]


class CgroupVal(ct.Structure):
    _fields_ = [(name, ct.c_uint64) for name in CGROUP_FIELDS]


class SchedEvent(ct.Structure):
    _fields_ = [
        ("cgid", ct.c_uint64),
        ("other_cgid", ct.c_uint64),
        ("start_ns", ct.c_uint64),
        ("end_ns", ct.c_uint64),
        ("wait_ns", ct.c_uint64),
        ("tid", ct.c_uint32),
        ("kind", ct.c_uint16),
        ("waits", ct.c_uint16),
    ]


class EventRate(ct.Structure):
    _fields_ = [("window", ct.c_uint64), ("count", ct.c_uint64)]


# map name -> (key type, value type) as declared in bpf/sched.bpf.c
MAP_TYPES: dict[str, tuple[type, type]] = {
    "tasks": (ct.c_uint64, TaskInfo),  # task address (raw tracepoints) or tid (classic); none on btf
    "hists": (HistKey, HistVal),
    "blame": (BlameKey, BlameVal),
    "cgroups": (CgroupKey, CgroupVal),
    "errors": (ct.c_uint32, ct.c_uint64),
    "ctl": (ct.c_uint32, Ctl),
    "watched": (ct.c_uint64, ct.c_uint8),
    "event_rates": (ct.c_uint32, EventRate),
}

# Map of maps -> the map its entries are shaped like, as BPF_ARRAY_OF_MAPS
# names it in bpf/sched.bpf.c: a map of maps is created from such a map.
INNER_MAPS: dict[str, str] = {"fence": "fence_inner"}

# Maps drained every interval: their keys carry a generation.
DRAINED_MAPS = ("hists", "blame", "cgroups")
