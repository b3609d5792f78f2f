"""Creates the maps, loads and attaches the programs of a cache record
(agent/probe/cache.py) with bpf(2) and perf_event_open(2): what BCC does
after a compile, without the compiler.

The maps are created from the definitions the kernel gave for BCC's maps;
the programs are BCC's instructions with the new maps' fds patched in, so the
kernel holds the same programs (tests/kernel compare their tags) over maps of
the same shapes. Only maps the kernel refuses without BTF get it (task-local
storage wants an int key and a value type of the value's size): a generated
BTF of an int and a byte array; the others are created without, as their
BTF serves only to print their entries. Programs are loaded without BTF line
information: it serves only to print the verifier's log.
"""

from __future__ import annotations

import ctypes as ct
import errno
import fcntl
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from agent.probe.bpfsys import btf_load, map_create, prog_load, raw_tracepoint_open
from agent.probe.btf import WATCH_TRACEPOINTS
from agent.probe.cache import MapDef, Programs, patch
from agent.probe.features import PERF_FLAG_FD_CLOEXEC, PERF_TYPE_TRACEPOINT, lift_memlock_limit, syscall

# Map types that refuse to exist without BTF for their value (enum bpf_map_type).
LOCAL_STORAGE_TYPES = {24, 28, 29, 32}   # SK_, INODE_, TASK_, CGRP_STORAGE
MAP_OF_MAPS_TYPES = {12, 13}             # ARRAY_OF_MAPS, HASH_OF_MAPS
PERF_EVENT_IOC_ENABLE = 0x2400           # _IO('$', 0)
PERF_EVENT_IOC_SET_BPF = 0x40042408      # _IOW('$', 8, __u32)
PERF_SAMPLE_RAW = 1 << 10


@dataclass
class Loaded:
    """What the build process hands over: name -> fd, and the attachments."""

    maps: dict[str, int] = field(default_factory=dict)
    programs: dict[str, int] = field(default_factory=dict)
    attachments: list[int] = field(default_factory=list)
    _btf: list[int] = field(default_factory=list)

    def close(self) -> None:
        for fd in [*self.attachments, *self.programs.values(), *self.maps.values(), *self._btf]:
            try:
                os.close(fd)
            except OSError:
                pass
        self.maps, self.programs, self.attachments, self._btf = {}, {}, [], []


def storage_btf(value_size: int) -> bytes:
    """A BTF blob of three types: [1] int (the key), [2] unsigned char,
    [3] unsigned char[value_size] (the value) (include/uapi/linux/btf.h)."""
    strings = b"\0int\0unsigned char\0"
    types = (struct.pack("<IIII", 1, 1 << 24, 4, (1 << 24) | 32)          # INT "int", signed, 32 bits
             + struct.pack("<IIII", 5, 1 << 24, 1, 8)                     # INT "unsigned char", 8 bits
             + struct.pack("<IIIIII", 0, 3 << 24, 0, 2, 1, value_size))   # ARRAY of [2], index [1]
    header = struct.pack("<HBBIIIII", 0xEB9F, 1, 0, 24, 0, len(types), len(types), len(strings))
    return header + types + strings


def _create_map(m: MapDef, loaded: Loaded) -> int:
    extra = {}
    if m.type in LOCAL_STORAGE_TYPES:
        btf = btf_load(storage_btf(m.value_size))
        if btf < 0:
            raise OSError(-btf, f"loading the BTF of map {m.name}: {os.strerror(-btf)}")
        loaded._btf.append(btf)
        extra = {"btf_fd": btf, "btf_key_type_id": 1, "btf_value_type_id": 3}
    if m.type in MAP_OF_MAPS_TYPES:
        if m.inner not in loaded.maps:
            raise OSError(errno.EINVAL, f"map {m.name} needs map {m.inner!r}, created before it")
        extra["inner_map_fd"] = loaded.maps[m.inner]
    for attempt in range(2):
        fd = map_create(m.type, m.key_size, m.value_size, m.max_entries, m.flags, m.kernel_name, **extra)
        # Before 5.11 maps are charged to RLIMIT_MEMLOCK: lifted once, as BCC does.
        if fd == -errno.EPERM and not attempt and lift_memlock_limit():
            continue
        break
    if fd < 0:
        raise OSError(-fd, f"creating BPF map {m.name}: {os.strerror(-fd)}")
    return fd


def _perf_attach(prog_fd: int, tracefs: Path, category: str, name: str) -> int:
    """A perf event on the classic tracepoint running the program, as BCC's
    bpf_attach_tracepoint() opens it (CPU 0, every event): the event's fd."""
    tp_id = int((tracefs / "events" / category / name / "id").read_text())
    attr = (ct.c_uint64 * 16)()
    attr[0] = PERF_TYPE_TRACEPOINT | (ct.sizeof(attr) << 32)   # type, size
    attr[1] = tp_id                                            # config
    attr[2] = 1                                                # sample_period
    attr[3] = PERF_SAMPLE_RAW                                  # sample_type
    attr[6] = 1                                                # wakeup_events
    fd = syscall("perf_event_open", ct.byref(attr), ct.c_int(-1), ct.c_int(0), ct.c_int(-1),
                 ct.c_ulong(PERF_FLAG_FD_CLOEXEC))
    if fd < 0:
        raise OSError(-fd, f"opening the perf event of tracepoint {category}:{name}: {os.strerror(-fd)}")
    try:
        fcntl.ioctl(fd, PERF_EVENT_IOC_SET_BPF, prog_fd)
        fcntl.ioctl(fd, PERF_EVENT_IOC_ENABLE, 0)
    except OSError:
        os.close(fd)
        raise
    return fd


def load(programs: Programs, tracefs: Path) -> Loaded:
    """Create, load and attach everything in the record. Raises
    bpfsys.ProgramRefused (the verifier), OSError (a map or an attachment
    the kernel refused; ENOMEM is the memory cgroup's limit) or
    cache.CacheProblem (a record that does not hold together); whatever was
    created is closed first."""
    loaded = Loaded()
    try:
        pending = list(programs.maps)
        while pending:   # a map of maps after the map it is made from
            ready = [m for m in pending if m.type not in MAP_OF_MAPS_TYPES or m.inner in loaded.maps]
            if not ready:
                raise OSError(errno.EINVAL, f"maps {', '.join(m.name for m in pending)} need maps the record lacks")
            for m in ready:
                loaded.maps[m.name] = _create_map(m, loaded)
                pending.remove(m)
        fds = [loaded.maps[m.name] for m in programs.maps]
        license_ = programs.license.encode()
        for p in programs.programs:
            loaded.programs[p.name] = prog_load(p.kernel_name, p.type, patch(p, fds), license_,
                                                programs.kern_version, p.expected_attach_type, p.attach_btf_id)
        for p in programs.programs:
            fd = loaded.programs[p.name]
            if p.name in WATCH_TRACEPOINTS:   # the agent attaches these while it watches (Probe.watch)
                continue
            if p.attach == "perf":
                loaded.attachments.append(_perf_attach(fd, tracefs, p.category, p.name))
                continue
            link = raw_tracepoint_open(fd, p.name if p.attach == "raw" else None)
            if link < 0:
                raise OSError(-link, f"attaching the {p.name} program: {os.strerror(-link)}")
            loaded.attachments.append(link)
    except BaseException:
        loaded.close()
        raise
    # The BTF objects are held by the maps that use them.
    for fd in loaded._btf:
        os.close(fd)
    loaded._btf = []
    return loaded
