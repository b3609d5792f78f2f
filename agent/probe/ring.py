"""The event stream's ring buffer, read in place.

A BPF ring buffer is memory the kernel lets a process map (kernel >= 5.8):
one read-write page holding the consumer's position, then one read-only page
with the producer's position followed by the data pages, mapped twice in a row
so a record that wraps around the end reads as one piece. Each record is an
8-byte header (its length, with a busy bit while the program is still
writing it and a discard bit for one it gave up) and the record, padded to 8
bytes. BCC's reader calls back into Python once per record (~1 µs each
here); this one copies everything the producer has committed in one piece,
decodes it as numpy rows and moves the consumer position once per drain.

Nothing else may consume the same ring buffer: BCC's open_ring_buffer() is
never called on it.
"""

from __future__ import annotations

import mmap
import struct
import threading

import numpy as np

__all__ = ["RingReader"]

BUSY_BIT = 1 << 31      # include/uapi/linux/bpf.h BPF_RINGBUF_BUSY_BIT
DISCARD_BIT = 1 << 30   # BPF_RINGBUF_DISCARD_BIT
HEADER = 8              # BPF_RINGBUF_HDR_SZ
_POS = struct.Struct("<Q")


class RingReader:
    """Fixed-size records of `row` from the ring buffer map `fd` of
    `size` bytes of data (its max_entries: a power of two of pages)."""

    def __init__(self, fd: int, size: int, row: np.dtype) -> None:
        page = mmap.PAGESIZE
        if size % page or size & (size - 1):
            raise ValueError(f"ring buffer size {size} is not a power of two of {page}-byte pages")
        self._size = size
        self._row = np.dtype(row)
        self._stride = (HEADER + self._row.itemsize + 7) & ~7
        self._record = np.dtype({"names": ["len", "pg_off", "event"], "formats": ["<u4", "<u4", self._row],
                                 "offsets": [0, 4, HEADER], "itemsize": self._stride})
        self._consumer = mmap.mmap(fd, page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
        self._data = mmap.mmap(fd, page + 2 * size, mmap.MAP_SHARED, mmap.PROT_READ, offset=page)
        self._page = page
        # Taking a lock is an acquire barrier (a pthread mutex): where loads may
        # pass each other (arm64), the records are read only after the
        # producer position that says they are there, as libbpf's
        # smp_load_acquire() does. On x86 it costs one uncontended lock a drain.
        self._fence = threading.Lock()
        self.discarded = 0

    def close(self) -> None:
        self._consumer.close()
        self._data.close()

    def drain(self) -> np.ndarray:
        """Every record the producer has committed, oldest first, as `row`s;
        the consumer position then moves past them, freeing their room."""
        cons = _POS.unpack_from(self._consumer, 0)[0]
        prod = _POS.unpack_from(self._data, 0)[0]
        with self._fence:
            pass
        if prod <= cons:
            return np.empty(0, self._row)
        start = self._page + (cons & (self._size - 1))
        n = (prod - cons) // self._stride * self._stride
        raw = np.frombuffer(self._data[start:start + n], self._record)
        lengths = raw["len"]
        busy = np.flatnonzero(lengths & BUSY_BIT)
        if len(busy):  # a program is still writing this one: stop before it
            raw, lengths = raw[:busy[0]], lengths[:busy[0]]
        sizes = lengths & ~np.uint32(BUSY_BIT | DISCARD_BIT)
        if np.any(sizes != self._row.itemsize):
            raise ValueError(f"ring buffer record of {int(sizes[sizes != self._row.itemsize][0])} bytes, "
                             f"expected {self._row.itemsize}")
        kept = (lengths & DISCARD_BIT) == 0
        self.discarded += int(len(raw) - kept.sum())
        out = raw["event"][kept].copy()
        # The kernel reads the consumer position to know what room is free.
        _POS.pack_into(self._consumer, 0, cons + len(raw) * self._stride)
        return out
