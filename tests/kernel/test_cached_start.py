"""A start from the program cache (agent/probe/cache.py, bpfload.py) against a
compiled start: the kernel holds the same programs (their tags: the kernel's
hash of their instructions, map references aside) over maps of the same
shapes, both count the same waits as the tracefs reference over one scene,
the cached start's event stream equals its histogram to the nanosecond, and
a damaged record or one the kernel refuses falls back to the compile."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import struct
import time
from pathlib import Path

import pytest

from agent.probe.btf import RAW_TRACEPOINTS, TRACEPOINTS
from tests.support.attach_scene import assert_agree, assert_each_matches_the_reference, run_scene

pytestmark = pytest.mark.kernel


@pytest.fixture
def features(kernel):
    from agent.probe import features as feat
    from tests.support import require_kernel

    if importlib.util.find_spec("bcc") is None:
        require_kernel("python3-bpfcc is not installed")
    f = feat.detect()
    if f.task_layout is None:
        pytest.fail(f"raw tracepoints are not usable on this kernel: {f.raw_unavailable}")
    return f


def _modes(features) -> list[str]:
    return (["btf"] if features.task_layout.btf_trace_ids else []) + ["raw", "classic"]


def _load(features, mode: str, cache: Path, expect: str, sizes=None):
    from agent.probe.loader import MapSizes, Probe

    p = Probe.load(features, sizes or MapSizes(), tracepoints=mode, cache_dir=cache)
    if p.cache[0] != expect:
        p.close()
        pytest.fail(f"{mode}: the program cache answered {p.cache}, expected {expect!r}")
    return p


def _kernel_view(probe) -> dict:
    """What the kernel holds: each program's type, name and tag, each map's definition."""
    from agent.probe.bpfsys import map_info, prog_info

    maps = {}
    for name, fd in probe._built.maps.items():
        m = map_info(fd)
        maps[name] = (m.type, m.key_size, m.value_size, m.max_entries, m.flags, m.name)
    return {"programs": {name: prog_info(fd) for name, fd in probe.program_fds().items()}, "maps": maps,
            "types": probe.map_type_descriptions()}


def test_a_cached_start_holds_the_programs_and_maps_the_compile_made(features, tmp_path):
    for mode in _modes(features):
        compiled = _load(features, mode, tmp_path, "miss")
        try:
            cached = _load(features, mode, tmp_path, "hit")
            try:
                want, got = _kernel_view(compiled), _kernel_view(cached)
                assert got == want, mode
                attached = TRACEPOINTS if mode == "classic" else RAW_TRACEPOINTS
                assert len(want["programs"]) == len(attached) and cached.mode == compiled.mode == mode
                assert cached.build_peak_bytes < compiled.build_peak_bytes / 2, "the cached start mapped the compiler"
            finally:
                cached.close()
        finally:
            compiled.close()


def test_cached_and_compiled_starts_count_the_same_waits_as_the_reference(features, tmp_path):
    """Every attach mode, compiled and from the cache, all attached over one
    scene: each agrees with the tracefs reference, and each cached start with
    its compiled twin."""
    modes = _modes(features)
    probes = {}
    try:
        for mode in modes:
            probes[(mode, "compiled")] = _load(features, mode, tmp_path, "miss")
            probes[(mode, "cached")] = _load(features, mode, tmp_path, "hit")
        scene = run_scene(probes)
    finally:
        for p in probes.values():
            p.close()
    got, ref = scene.victim, scene.reference
    print("".join(f"\n{k} {got[k]}" for k in probes) + f"\nreference: {len(ref.runq_waits_ns)} waits, "
          f"{ref.total_wait_ns} ns, {len(ref.preemptions)} preemptions")
    assert_each_matches_the_reference(scene)
    for mode in modes:
        assert_agree(scene, (mode, "cached"), (mode, "compiled"))


def test_a_cached_starts_event_stream_equals_its_histogram(features, tmp_path):
    """The ring buffer the cache creates streams every wait the histogram counts."""
    from agent.probe.loader import MapSizes

    spec = importlib.util.spec_from_file_location("event_stream", Path(__file__).with_name("test_event_stream.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sizes = MapSizes(event_rate=10_000_000)
    _load(features, "auto", tmp_path, "miss", sizes).close()
    probe = _load(features, "auto", tmp_path, "hit", sizes)
    try:
        module.test_watched_cgroup_events_equal_its_histogram(probe)
    finally:
        probe.close()


def _record(tmp_path: Path) -> Path:
    [path] = [p for p in tmp_path.iterdir() if p.suffix == ".bpfcache"]
    return path


def _counts(probe) -> int:
    probe.snapshot()
    time.sleep(0.3)
    return sum(b.count for h in probe.snapshot().hists.values() for b in h.values())


def test_a_damaged_record_falls_back_to_the_compile_and_is_written_again(features, tmp_path):
    _load(features, "auto", tmp_path, "miss").close()
    path = _record(tmp_path)
    path.write_bytes(path.read_bytes()[:-100])
    probe = _load(features, "auto", tmp_path, "refused")
    try:
        assert "damaged" in probe.cache[1] and "compiled and stored" in probe.cache[1]
        assert _counts(probe) > 0
    finally:
        probe.close()
    _load(features, "auto", tmp_path, "hit").close()


def test_a_record_the_kernel_refuses_falls_back_to_the_compile(features, tmp_path):
    """A record whose program the verifier rejects (here: one reading a
    register it never wrote) is dropped and compiled again, with the
    verifier's reason in the note."""
    from agent.probe.cache import decode, encode

    _load(features, "auto", tmp_path, "miss").close()
    path = _record(tmp_path)
    programs = decode(path.read_bytes(), json.loads(path.read_bytes().split(b"\n", 1)[1])["key"])
    broken = programs.programs[0]
    # r0 = r5 (never written); exit
    insns = struct.pack("<BBhi", 0xBF, 5 << 4, 0, 0) + struct.pack("<BBhi", 0x95, 0, 0, 0)
    programs = dataclasses.replace(programs, programs=(dataclasses.replace(broken, insns=insns, map_refs=()),
                                                       *programs.programs[1:]))
    path.write_bytes(encode(programs))
    probe = _load(features, "auto", tmp_path, "refused")
    try:
        assert f"the kernel refused the {broken.kernel_name} program" in probe.cache[1]
        assert "R5 !read_ok" in probe.cache[1] and "compiled and stored" in probe.cache[1]
        assert _counts(probe) > 0
    finally:
        probe.close()
    _load(features, "auto", tmp_path, "hit").close()
