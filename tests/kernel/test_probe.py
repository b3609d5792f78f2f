"""The loaded BPF program against its Python mirrors and the bucket math."""

from __future__ import annotations

import ctypes as ct
import time

import pytest

pytestmark = pytest.mark.kernel


def _fields(t) -> list[tuple[str, int, int]]:
    if not isinstance(t, type) or not issubclass(t, ct.Structure):
        return [("", 0, ct.sizeof(t))]
    return [(name, getattr(t, name).offset, getattr(t, name).size) for name, *_ in t._fields_]


def test_ctypes_mirrors_match_what_bcc_compiled(probe):
    from agent.probe.layout import MAP_TYPES

    for name, (key_t, val_t) in MAP_TYPES.items():
        table = probe.bpf[name.encode()]
        bcc_val = getattr(table, "sLeaf", table.Leaf)  # per-CPU tables keep the scalar type in sLeaf
        assert ct.sizeof(table.Key) == ct.sizeof(key_t), name
        assert ct.sizeof(bcc_val) == ct.sizeof(val_t), name
        if issubclass(key_t, ct.Structure):
            assert _fields(table.Key) == _fields(key_t), name
        if issubclass(val_t, ct.Structure):
            assert _fields(bcc_val) == _fields(val_t), name


def test_kernel_slots_agree_with_python_bucket_bounds(probe):
    """Every bucket's mean value must lie inside the bounds Python assigns to
    that slot: the in-kernel slot computation and slot_bounds() agree."""
    from agent.store.histogram import HIST_SLOTS, slot_bounds

    time.sleep(1.0)  # let the host's own scheduling fill some buckets
    snap = probe.snapshot()
    checked = 0
    for (cgid, kind), buckets in snap.hists.items():
        for slot, b in buckets.items():
            assert 0 <= slot < HIST_SLOTS
            lo, hi = slot_bounds(slot)
            assert lo <= b.sum_ns / b.count < hi, (cgid, kind, slot, b)
            checked += 1
    assert checked >= 5, "the host produced almost no run-queue samples in 1 s"


def test_counters_are_cumulative(probe):
    a = probe.snapshot()
    time.sleep(0.3)
    b = probe.snapshot()
    assert b.mono_ns > a.mono_ns
    for key, buckets in a.hists.items():
        for slot, bucket in buckets.items():
            assert b.hists[key][slot].count >= bucket.count
    assert sum(st.run_cnt for st in b.programs.values()) >= sum(st.run_cnt for st in a.programs.values())
