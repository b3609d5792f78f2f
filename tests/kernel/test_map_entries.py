"""The scale tests and bench count the agent's BPF map entries themselves
(bench/bpfstats.py: BPF_MAP_GET_FD_BY_ID + BPF_MAP_GET_NEXT_KEY): checked here
against keys the test wrote and against bpftool."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from bench import bpfstats

pytestmark = pytest.mark.kernel


def test_map_keys_by_id_match_what_was_written_and_bpftool(probe):
    ids = {0x1111_0000_0001, 0x2222_0000_0002, 0x3333_0000_0003}
    probe.watch(ids)
    try:
        maps = {m.name: m for m in bpfstats.process_maps(os.getpid())}
        keys = bpfstats.process_map_keys(os.getpid())
        assert sorted(int.from_bytes(k, "little") for k in keys["watched"]) == sorted(ids)
        assert bpfstats.keys_naming(keys["watched"], {0x2222_0000_0002, 42}) == 1

        dump = subprocess.run(["bpftool", "map", "dump", "id", str(maps["watched"].id), "--json"],
                              capture_output=True, text=True, check=True, timeout=30)
        assert len(json.loads(dump.stdout)) == len(ids)
        # every hash map of the probe is walked, arrays and the ring buffer are not
        assert set(keys) == {m.name for m in maps.values() if m.type in bpfstats.KEYED}
    finally:
        probe.watch(set())
