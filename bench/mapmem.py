"""Map memory, estimated from map shapes, for this host and for a large one.

Hash maps are preallocated (BCC sets no BPF_F_NO_PREALLOC; LRU maps always
are), so the memory is taken at load time, whatever the traffic. The kernel's
own memlock figure is only available for the CPUs of this host; the formula
lets the bench answer for a 64-CPU host too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

# struct htab_elem (hash node, LRU node or per-CPU pointer, hash) per element,
# and struct bucket (list head and lock) per hash bucket; the kernel's own
# memlock figures here (6.x) match these to the byte for every hash map.
ELEM_OVERHEAD = 48
BUCKET = 16
PERCPU_HASH = {"percpu_hash", "lru_percpu_hash"}
HASH = {"hash", "lru_hash"}
PERCPU_ARRAY = {"percpu_array"}
ARRAY = {"array", "perf_event_array", "prog_array"}
RINGBUF = {"ringbuf"}
# Task-local storage takes nothing at load: each task's state is allocated
# with the task (docs/maps.md).
PER_TASK = {"task_storage"}
MIB = 1 << 20
MEMORY_LIMIT_64 = 64 * MIB   # the budget for a 64-CPU node


def round8(n: int) -> int:
    return (n + 7) & ~7


@dataclass(frozen=True)
class MapShape:
    name: str
    type: str
    max_entries: int
    key_size: int
    value_size: int


@dataclass(frozen=True)
class MapInfo(MapShape):
    memlock: int  # bytes the kernel charges for the map on this host
    id: int = 0   # the kernel's map id, while the map is loaded


def map_bytes(m: MapShape, cpus: int) -> int:
    """Bytes of one map on a host with `cpus` possible CPUs.

    buckets:      next_pow2(entries) x 16
    per-CPU hash: entries x (48 + round8(key) + 8) + entries x round8(value) x CPUs + buckets
    hash:         (entries + CPUs) x (48 + round8(key) + round8(value)) + buckets
                  (a preallocated hash keeps one spare element per CPU)
    LRU hash:     entries x (48 + round8(key) + round8(value)) + buckets
    arrays:       entries x round8(value)
    per-CPU array: entries x (8 + round8(value) x CPUs)   (a pointer per entry)
    ring buffer:  max_entries is its size in bytes
    task storage: nothing at load (allocated per task)
    """
    n = m.max_entries
    if m.type in PER_TASK:
        return 0
    if m.type in RINGBUF:
        return n
    if m.type in PERCPU_ARRAY:
        return n * (8 + round8(m.value_size) * cpus)
    if m.type in ARRAY:
        return n * round8(m.value_size)
    buckets = (1 << max(n - 1, 0).bit_length()) * BUCKET
    if m.type in PERCPU_HASH:
        return n * (ELEM_OVERHEAD + round8(m.key_size) + 8) + n * round8(m.value_size) * cpus + buckets
    elems = n if m.type.startswith("lru") else n + cpus
    return elems * (ELEM_OVERHEAD + round8(m.key_size) + round8(m.value_size)) + buckets


def total_bytes(maps: list[MapShape], cpus: int) -> int:
    return sum(map_bytes(m, cpus) for m in maps)


def summary(maps: list[MapInfo], cpus_here: int) -> dict[str, Any]:
    """Per map and in total: the formula here and at 64 CPUs, and the kernel's memlock."""
    rows = []
    for m in maps:
        rows.append({"name": m.name, "type": m.type, "max_entries": m.max_entries, "key_size": m.key_size,
                     "value_size": m.value_size, "memlock": m.memlock,
                     "bytes_here": map_bytes(m, cpus_here), "bytes_64": map_bytes(m, 64)})
    return {"maps": rows, "cpus_here": cpus_here,
            "bytes_here": sum(r["bytes_here"] for r in rows), "memlock_here": sum(r["memlock"] for r in rows),
            "bytes_64": sum(r["bytes_64"] for r in rows), "limit_64": MEMORY_LIMIT_64}


def possible_cpus(path: Path = Path("/sys/devices/system/cpu/possible")) -> int:
    """Per-CPU maps are sized by possible, not online, CPUs. "0-1,4-7" -> 6."""
    n = 0
    for part in path.read_text().strip().split(","):
        lo, _, hi = part.partition("-")
        n += int(hi or lo) - int(lo) + 1
    return n
