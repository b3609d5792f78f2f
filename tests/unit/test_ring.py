"""The ring buffer reader against memory laid out as the kernel lays it out
(include/uapi/linux/bpf.h, kernel/bpf/ringbuf.c): a consumer page, a producer
page, the data pages twice in a row; records with a busy and a discard bit."""

from __future__ import annotations

import mmap
import os
import struct

import numpy as np
import pytest

from agent.probe.ring import BUSY_BIT, DISCARD_BIT, HEADER, RingReader
from agent.probe.snapshot import EVENT_ROW

PAGE = mmap.PAGESIZE
SIZE = 2 * PAGE
STRIDE = (HEADER + EVENT_ROW.itemsize + 7) & ~7


class FakeRing:
    """A file mapped like a BPF ring buffer map: writing a record writes it
    through both mappings of the data pages, as the kernel's double mapping shows it."""

    def __init__(self, tmp_path) -> None:
        self.path = tmp_path / "ring"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT)
        # consumer page, producer page, data, data again
        os.ftruncate(self.fd, 2 * PAGE + 2 * SIZE)
        self.prod = 0

    def consumer(self) -> int:
        return struct.unpack("<Q", os.pread(self.fd, 8, 0))[0]

    def put(self, event: tuple, flags: int = 0) -> None:
        rec = struct.pack("<II", EVENT_ROW.itemsize | flags, 0) + np.array([event], EVENT_ROW).tobytes()
        rec = rec.ljust(STRIDE, b"\0")
        for i, byte in enumerate(rec):  # byte by byte: a record may wrap
            off = (self.prod + i) % SIZE
            for base in (2 * PAGE, 2 * PAGE + SIZE):
                os.pwrite(self.fd, bytes([byte]), base + off)
        self.prod += STRIDE
        os.pwrite(self.fd, struct.pack("<Q", self.prod), PAGE)

    def close(self) -> None:
        os.close(self.fd)


@pytest.fixture
def ring(tmp_path):
    """A fake ring buffer and a reader on it."""
    fake = FakeRing(tmp_path)
    reader = RingReader(fake.fd, SIZE, EVENT_ROW)
    yield fake, reader
    reader.close()
    fake.close()


def event(i: int) -> tuple:
    # (cgid, other, start, end, wait, tid, kind, waits): every fourth merges waits
    merged = i % 4 == 0
    return (100 + i, 7, 1000 * i, 1000 * i + 500, 120 if merged else 500, 4000 + i, i % 5, 3 if merged else 1)


def test_records_come_out_in_order_across_the_wrap_and_free_their_room(ring):
    ring, reader = ring
    got = []
    for round_ in range(5):   # 5 x 100 records of 48 bytes: several laps of an 8 KiB ring
        for i in range(100):
            ring.put(event(round_ * 100 + i))
        rows = reader.drain()
        got += rows.tolist()
        assert ring.consumer() == ring.prod
    assert got == [event(i) for i in range(500)]
    assert len(reader.drain()) == 0


def test_a_record_still_being_written_stops_the_drain_and_discarded_ones_are_skipped(ring):
    ring, reader = ring
    ring.put(event(1))
    ring.put(event(2), DISCARD_BIT)
    ring.put(event(3))
    ring.put(event(4), BUSY_BIT)
    ring.put(event(5))
    assert reader.drain().tolist() == [event(1), event(3)]
    assert reader.discarded == 1
    assert ring.consumer() == 3 * STRIDE   # up to the busy one, which stays


def test_a_record_of_another_size_is_refused(ring):
    ring, reader = ring
    ring.put(event(1))
    os.pwrite(ring.fd, struct.pack("<I", 16), 2 * PAGE)
    with pytest.raises(ValueError, match="record of 16 bytes"):
        reader.drain()
    with pytest.raises(ValueError, match="power of two"):
        RingReader(ring.fd, 3 * PAGE, EVENT_ROW)
