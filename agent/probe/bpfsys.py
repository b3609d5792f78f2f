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

__all__ = ["BpfMap", "bpf", "possible_cpus", "MAP_LOOKUP_ELEM", "MAP_UPDATE_ELEM", "MAP_DELETE_ELEM",
           "MAP_GET_NEXT_KEY", "MAP_LOOKUP_BATCH", "MAP_UPDATE_BATCH", "MAP_DELETE_BATCH"]

# Commands (enum bpf_cmd)
MAP_LOOKUP_ELEM = 1
MAP_UPDATE_ELEM = 2
MAP_DELETE_ELEM = 3
MAP_GET_NEXT_KEY = 4
OBJ_GET_INFO_BY_FD = 15
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
                ("name", ct.c_char * 16)]


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
