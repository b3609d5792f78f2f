"""The bpf(2) system call for the agent, which never loads libbcc.

The agent holds its maps, programs and attachments as file descriptors
another process created (agent/probe/build.py) and reads the maps through
the kernel's stable ABI (include/uapi/linux/bpf.h): element lookups, updates
and deletes, key iteration, the batch operations (5.6 on) and the objects'
own description (BPF_OBJ_GET_INFO_BY_FD). A field an attribute struct leaves
out is zero to the kernel.

Every call returns 0 (or an fd) on success and -errno on failure, as the
system call does; nothing here raises for an errno.
"""

from __future__ import annotations

import ctypes as ct
import errno
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

__all__ = ["BpfMap", "MapInfo", "ProgramRefused", "bpf", "btf_load", "map_create", "map_info", "possible_cpus",
           "prog_info", "prog_load", "raw_tracepoint_open", "MAP_LOOKUP_ELEM", "MAP_UPDATE_ELEM", "MAP_DELETE_ELEM",
           "MAP_GET_NEXT_KEY", "MAP_LOOKUP_BATCH", "MAP_UPDATE_BATCH", "MAP_DELETE_BATCH"]

# Commands (enum bpf_cmd)
MAP_CREATE = 0
MAP_LOOKUP_ELEM = 1
MAP_UPDATE_ELEM = 2
MAP_DELETE_ELEM = 3
MAP_GET_NEXT_KEY = 4
PROG_LOAD = 5
OBJ_GET_INFO_BY_FD = 15
RAW_TRACEPOINT_OPEN = 17
BTF_LOAD = 18
MAP_LOOKUP_BATCH = 24
MAP_UPDATE_BATCH = 26
MAP_DELETE_BATCH = 27

# Map types whose values are one per possible CPU (enum bpf_map_type)
PERCPU_TYPES = {5, 6, 10}  # PERCPU_HASH, PERCPU_ARRAY, LRU_PERCPU_HASH

_SYSCALL_NR = {"x86_64": 321, "aarch64": 280}
_libc: ct.CDLL | None = None


def bpf(cmd: int, attr: ct.Structure) -> int:
    """bpf(cmd, &attr, sizeof attr): its result, or -errno."""
    global _libc
    if _libc is None:
        _libc = ct.CDLL(None, use_errno=True)
        _libc.syscall.restype = ct.c_long
    nr = _SYSCALL_NR.get(os.uname().machine)
    if nr is None:
        return -errno.ENOSYS
    res = _libc.syscall(ct.c_long(nr), ct.c_int(cmd), ct.byref(attr), ct.c_uint(ct.sizeof(attr)))
    return res if res >= 0 else -ct.get_errno()


class _Elem(ct.Structure):
    _fields_ = [("map_fd", ct.c_uint32), ("_pad", ct.c_uint32), ("key", ct.c_uint64), ("value", ct.c_uint64),
                ("flags", ct.c_uint64)]


class _Batch(ct.Structure):
    _fields_ = [("in_batch", ct.c_uint64), ("out_batch", ct.c_uint64), ("keys", ct.c_uint64),
                ("values", ct.c_uint64), ("count", ct.c_uint32), ("map_fd", ct.c_uint32),
                ("elem_flags", ct.c_uint64), ("flags", ct.c_uint64)]


class _Info(ct.Structure):
    _fields_ = [("bpf_fd", ct.c_uint32), ("info_len", ct.c_uint32), ("info", ct.c_uint64)]


class _MapInfo(ct.Structure):
    _fields_ = [("type", ct.c_uint32), ("id", ct.c_uint32), ("key_size", ct.c_uint32),
                ("value_size", ct.c_uint32), ("max_entries", ct.c_uint32), ("map_flags", ct.c_uint32),
                ("name", ct.c_char * 16), ("ifindex", ct.c_uint32), ("btf_vmlinux_value_type_id", ct.c_uint32),
                ("netns_dev", ct.c_uint64), ("netns_ino", ct.c_uint64), ("btf_id", ct.c_uint32),
                ("btf_key_type_id", ct.c_uint32), ("btf_value_type_id", ct.c_uint32)]


class _ProgInfo(ct.Structure):
    _fields_ = [("type", ct.c_uint32), ("id", ct.c_uint32), ("tag", ct.c_uint8 * 8), ("jited_prog_len", ct.c_uint32),
                ("xlated_prog_len", ct.c_uint32), ("jited_prog_insns", ct.c_uint64),
                ("xlated_prog_insns", ct.c_uint64), ("load_time", ct.c_uint64), ("created_by_uid", ct.c_uint32),
                ("nr_map_ids", ct.c_uint32), ("map_ids", ct.c_uint64), ("name", ct.c_char * 16)]


class _MapCreate(ct.Structure):
    _fields_ = [("map_type", ct.c_uint32), ("key_size", ct.c_uint32), ("value_size", ct.c_uint32),
                ("max_entries", ct.c_uint32), ("map_flags", ct.c_uint32), ("inner_map_fd", ct.c_uint32),
                ("numa_node", ct.c_uint32), ("map_name", ct.c_char * 16), ("map_ifindex", ct.c_uint32),
                ("btf_fd", ct.c_uint32), ("btf_key_type_id", ct.c_uint32), ("btf_value_type_id", ct.c_uint32)]


class _ProgLoad(ct.Structure):
    _fields_ = [("prog_type", ct.c_uint32), ("insn_cnt", ct.c_uint32), ("insns", ct.c_uint64),
                ("license", ct.c_uint64), ("log_level", ct.c_uint32), ("log_size", ct.c_uint32),
                ("log_buf", ct.c_uint64), ("kern_version", ct.c_uint32), ("prog_flags", ct.c_uint32),
                ("prog_name", ct.c_char * 16), ("prog_ifindex", ct.c_uint32),
                ("expected_attach_type", ct.c_uint32), ("prog_btf_fd", ct.c_uint32),
                ("func_info_rec_size", ct.c_uint32), ("func_info", ct.c_uint64), ("func_info_cnt", ct.c_uint32),
                ("line_info_rec_size", ct.c_uint32), ("line_info", ct.c_uint64), ("line_info_cnt", ct.c_uint32),
                ("attach_btf_id", ct.c_uint32), ("attach_prog_fd", ct.c_uint32)]


class _BtfLoad(ct.Structure):
    _fields_ = [("btf", ct.c_uint64), ("btf_log_buf", ct.c_uint64), ("btf_size", ct.c_uint32),
                ("btf_log_size", ct.c_uint32), ("btf_log_level", ct.c_uint32)]


class _RawTracepointOpen(ct.Structure):
    _fields_ = [("name", ct.c_uint64), ("prog_fd", ct.c_uint32), ("_pad", ct.c_uint32)]


LOG_SIZE = 1 << 20   # the verifier's log, asked for only to explain a refusal


class ProgramRefused(Exception):
    """The kernel refused a program; the message carries the verifier's last word."""

    def __init__(self, name: str, err: int, why: str) -> None:
        super().__init__(f"the kernel refused the {name} program ({os.strerror(err)}): {why}")
        self.name, self.errno, self.why = name, err, why


@dataclass(frozen=True)
class MapInfo:
    """A map's definition as the kernel holds it."""

    type: int
    key_size: int
    value_size: int
    max_entries: int
    flags: int
    name: str
    btf_id: int


def map_info(fd: int) -> MapInfo:
    """BPF_OBJ_GET_INFO_BY_FD on a map; OSError if the kernel refuses."""
    info = _MapInfo()
    res = bpf(OBJ_GET_INFO_BY_FD, _Info(bpf_fd=fd, info_len=ct.sizeof(info), info=ct.addressof(info)))
    if res < 0:
        raise OSError(-res, f"describing BPF map fd {fd}: {os.strerror(-res)}")
    return MapInfo(info.type, info.key_size, info.value_size, info.max_entries, info.map_flags,
                   info.name.decode(errors="replace"), info.btf_id)


def prog_info(fd: int) -> tuple[int, str, bytes]:
    """A program's type, name and tag (the kernel's hash of its instructions
    with map references zeroed: equal tags, equal programs)."""
    info = _ProgInfo()
    res = bpf(OBJ_GET_INFO_BY_FD, _Info(bpf_fd=fd, info_len=ct.sizeof(info), info=ct.addressof(info)))
    if res < 0:
        raise OSError(-res, f"describing BPF program fd {fd}: {os.strerror(-res)}")
    return info.type, info.name.decode(errors="replace"), bytes(info.tag)


def map_create(map_type: int, key_size: int, value_size: int, max_entries: int, flags: int = 0, name: str = "",
               inner_map_fd: int = 0, btf_fd: int = 0, btf_key_type_id: int = 0, btf_value_type_id: int = 0) -> int:
    """BPF_MAP_CREATE: the map's fd, or -errno."""
    return bpf(MAP_CREATE, _MapCreate(map_type=map_type, key_size=key_size, value_size=value_size,
                                      max_entries=max_entries, map_flags=flags, inner_map_fd=inner_map_fd,
                                      map_name=name.encode()[:15], btf_fd=btf_fd, btf_key_type_id=btf_key_type_id,
                                      btf_value_type_id=btf_value_type_id))


def btf_load(blob: bytes) -> int:
    """BPF_BTF_LOAD: the BTF object's fd, or -errno."""
    buf = ct.create_string_buffer(blob, len(blob))
    return bpf(BTF_LOAD, _BtfLoad(btf=ct.addressof(buf), btf_size=len(blob)))


def prog_load(name: str, prog_type: int, insns: bytes, license_: bytes, kern_version: int = 0,
              expected_attach_type: int = 0, attach_btf_id: int = 0) -> int:
    """BPF_PROG_LOAD: the program's fd. Raises ProgramRefused with the
    verifier's reason (the load is retried with its log to get it)."""
    code = ct.create_string_buffer(insns, len(insns))
    lic = ct.create_string_buffer(license_)
    attr = _ProgLoad(prog_type=prog_type, insn_cnt=len(insns) // 8, insns=ct.addressof(code),
                     license=ct.addressof(lic), kern_version=kern_version, prog_name=name.encode()[:15],
                     expected_attach_type=expected_attach_type, attach_btf_id=attach_btf_id)
    fd = bpf(PROG_LOAD, attr)
    if fd >= 0:
        return fd
    log = ct.create_string_buffer(LOG_SIZE)
    attr.log_level, attr.log_size, attr.log_buf = 1, LOG_SIZE, ct.addressof(log)
    fd = bpf(PROG_LOAD, attr)
    if fd >= 0:
        return fd
    # The verifier's reason is its last line but the statistics it ends with.
    lines = [ln for ln in log.value.decode(errors="replace").splitlines()
             if ln.strip() and not ln.startswith(("processed ", "verification time"))]
    raise ProgramRefused(name, -fd, lines[-1] if lines else os.strerror(-fd))


def raw_tracepoint_open(prog_fd: int, name: str | None) -> int:
    """BPF_RAW_TRACEPOINT_OPEN: the attachment's fd, or -errno. No name: a
    BTF-typed program, whose attach point is in the program itself."""
    tp = ct.create_string_buffer(name.encode()) if name else None
    return bpf(RAW_TRACEPOINT_OPEN, _RawTracepointOpen(name=ct.addressof(tp) if tp else 0, prog_fd=prog_fd))


def possible_cpus(path: Path = Path("/sys/devices/system/cpu/possible")) -> int:
    """The number of possible CPUs (as "0-63" or "0,2-3"): per-CPU values come
    one for each, the way the kernel copies them."""
    n = 0
    for part in path.read_text().strip().split(","):
        lo, _, hi = part.partition("-")
        n = max(n, int(hi or lo) + 1)
    return n


def _addr(buf) -> int | None:
    """The address of a ctypes object, a ctypes pointer/byref, a plain int address or None."""
    if buf is None or isinstance(buf, int):
        return buf
    return ct.cast(buf, ct.c_void_p).value if isinstance(buf, ct._Pointer) else ct.addressof(buf)


@dataclass
class BpfMap:
    """A map by its fd, as the kernel describes it."""

    name: str
    fd: int
    type: int
    key_size: int
    value_size: int
    max_entries: int
    ncpu: int = 1   # the values per key: the possible CPUs for a per-CPU map

    @classmethod
    def from_fd(cls, name: str, fd: int, ncpu: int) -> "BpfMap":
        info = _MapInfo()
        res = bpf(OBJ_GET_INFO_BY_FD, _Info(bpf_fd=fd, info_len=ct.sizeof(info), info=ct.addressof(info)))
        if res < 0:
            raise OSError(-res, f"describing BPF map {name}: {os.strerror(-res)}")
        return cls(name, fd, info.type, info.key_size, info.value_size, info.max_entries,
                   ncpu if info.type in PERCPU_TYPES else 1)

    @property
    def value_bytes(self) -> int:
        """The size of one value as user space reads it (per-CPU: 8-byte aligned, one per CPU)."""
        if self.ncpu == 1:
            return self.value_size
        return (self.value_size + 7) // 8 * 8 * self.ncpu

    def _key(self, key: bytes) -> ct.Array:
        if len(key) != self.key_size:
            raise ValueError(f"BPF map {self.name}: key of {len(key)} bytes, expected {self.key_size}")
        return ct.create_string_buffer(key, self.key_size)

    def lookup(self, key: bytes) -> bytes | None:
        """The value (per-CPU: every CPU's, one after the other), None when the key is absent."""
        k, v = self._key(key), ct.create_string_buffer(self.value_bytes)
        res = bpf(MAP_LOOKUP_ELEM, _Elem(map_fd=self.fd, key=ct.addressof(k), value=ct.addressof(v)))
        if res == -errno.ENOENT:
            return None
        self._check(res, "reading")
        return v.raw

    def update(self, key: bytes, value: bytes) -> None:
        if len(value) != self.value_bytes:
            raise ValueError(f"BPF map {self.name}: value of {len(value)} bytes, expected {self.value_bytes}")
        k, v = self._key(key), ct.create_string_buffer(value, self.value_bytes)
        self._check(bpf(MAP_UPDATE_ELEM, _Elem(map_fd=self.fd, key=ct.addressof(k), value=ct.addressof(v))),
                    "writing")

    def delete(self, key: bytes) -> bool:
        """False when the key was absent."""
        k = self._key(key)
        res = bpf(MAP_DELETE_ELEM, _Elem(map_fd=self.fd, key=ct.addressof(k)))
        if res == -errno.ENOENT:
            return False
        self._check(res, "deleting from")
        return True

    def keys(self) -> Iterator[bytes]:
        """Every key, by BPF_MAP_GET_NEXT_KEY (no key: the first)."""
        cur, nxt = ct.create_string_buffer(self.key_size), ct.create_string_buffer(self.key_size)
        first = True
        while True:
            res = bpf(MAP_GET_NEXT_KEY, _Elem(map_fd=self.fd, key=0 if first else ct.addressof(cur),
                                              value=ct.addressof(nxt)))
            if res == -errno.ENOENT:
                return
            self._check(res, "listing")
            yield nxt.raw
            ct.memmove(cur, nxt, self.key_size)
            first = False

    def items(self) -> Iterator[tuple[bytes, bytes]]:
        """(key, value) of every key still there when read."""
        for key in list(self.keys()):
            value = self.lookup(key)
            if value is not None:
                yield key, value

    def lookup_batch(self, in_batch, out_batch, keys, values, count: ct.c_uint32) -> int:
        """BPF_MAP_LOOKUP_BATCH as libbpf's bpf_map_lookup_batch(): 0 or -errno;
        `count` is set to what the kernel wrote back (on a kernel without the
        operation, left as passed)."""
        return self._batch(MAP_LOOKUP_BATCH, in_batch, out_batch, keys, values, count)

    def update_batch(self, keys, values, count: ct.c_uint32) -> int:
        return self._batch(MAP_UPDATE_BATCH, None, None, keys, values, count)

    def delete_batch(self, keys, count: ct.c_uint32) -> int:
        return self._batch(MAP_DELETE_BATCH, None, None, keys, None, count)

    def _batch(self, cmd: int, in_batch, out_batch, keys, values, count: ct.c_uint32) -> int:
        attr = _Batch(in_batch=_addr(in_batch) or 0, out_batch=_addr(out_batch) or 0, keys=_addr(keys) or 0,
                      values=_addr(values) or 0, count=count.value, map_fd=self.fd)
        res = bpf(cmd, attr)
        count.value = attr.count
        return res

    def _check(self, res: int, doing: str) -> None:
        if res < 0:
            raise OSError(-res, f"{doing} BPF map {self.name}: {os.strerror(-res)}")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
