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


def test_ctypes_mirrors_match_what_bcc_compiled(probe_each_mode):
    """The build process hands over BCC's own descriptions of each map's key
    and value types; decoded by BCC here, they must be the Python mirrors,
    field by field, and the sizes the kernel holds the maps with."""
    import json

    from bcc import BPF  # the test process may map the compiler; the agent does not

    from agent.probe.layout import MAP_TYPES

    probe = probe_each_mode
    described = probe.map_type_descriptions()
    for name, (key_t, val_t) in MAP_TYPES.items():
        if name == "tasks" and probe.mode == "btf":
            continue   # task-local storage: user space never reads it
        key_desc, val_desc = described[name]
        bcc_key, bcc_val = (BPF._decode_table_type(json.loads(d)) for d in (key_desc, val_desc))
        assert ct.sizeof(bcc_key) == ct.sizeof(key_t) == probe._maps[name].key_size, name
        assert ct.sizeof(bcc_val) == ct.sizeof(val_t) == probe._maps[name].value_size, name
        if issubclass(key_t, ct.Structure):
            assert _fields(bcc_key) == _fields(key_t), name
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


def test_snapshots_drain_the_counting_maps(probe):
    """Each snapshot takes the counts since the previous one and deletes them
    from the kernel: the maps keep only what came after the last drain."""
    import numpy as np

    probe.snapshot()
    time.sleep(0.3)
    b = probe.snapshot()
    assert sum(bk.count for h in b.hists.values() for bk in h.values()) > 0
    for name in ("hists", "blame", "cgroups"):
        keys = [k for k, _ in probe._batches(name)]
        gens = np.concatenate(keys)["gen"] if keys else np.empty(0)
        # Only the generation programs count into now; the drained one is empty.
        assert set(gens.tolist()) <= {probe._ctl.gen}, name
    assert sum(st.run_cnt for st in b.programs.values()) >= 0
