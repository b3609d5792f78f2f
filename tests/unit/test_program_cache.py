"""The compiled programs' cache (agent/probe/cache.py) and the build process's
choice between it and the compiler (agent/probe/build.py), without a kernel:
the record's file, its key, and every way a record can be unusable falling
back to a compile with the reason."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from agent.probe import build
from agent.probe.bpfload import storage_btf
from agent.probe.cache import (KEEP, CacheMiss, CacheProblem, MapDef, ProgramCache, ProgramDef, Programs, cache_key,
                               decode, encode, kernel_identity, patch, relocate)

KERNEL = {"release": "6.18.0", "build": "#1 SMP", "machine": "x86_64", "btf": "ab" * 32}


def _insn(code: int, regs: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, regs, off, imm)


# r1 = map fd 7 (ld_imm64, src_reg 1); r0 = 0; r2 = map fd 9 value (src_reg 2); exit
PROGRAM = (_insn(0x18, 1 << 4 | 1, imm=7) + _insn(0) + _insn(0xB7, imm=0)
           + _insn(0x18, 2 << 4 | 2, imm=9) + _insn(0, imm=16) + _insn(0x95))


def _programs(key: str = "k" * 64) -> Programs:
    insns, refs = relocate(PROGRAM, {7: 0, 9: 1})
    return Programs(key=key, license="GPL", kern_version=0,
                    maps=(MapDef("hists", 1, 16, 16, 1024, 0, "hists", "{}", "{}"),
                          MapDef("fence_inner", 2, 4, 4, 1, 0, "fence_inner", '"int"', '"int"'),
                          MapDef("fence", 12, 4, 4, 1, 0, "fence", '"int"', '"int"', inner="fence_inner")),
                    programs=(ProgramDef("sched_switch", "sched_switch", 26, "btf", insns, refs,
                                         expected_attach_type=23, attach_btf_id=4242),
                              ProgramDef("sched_wakeup", "tracepoint__sch", 5, "perf", insns, refs, "sched")))


def test_map_references_are_zeroed_listed_and_patched_back() -> None:
    insns, refs = relocate(PROGRAM, {7: 0, 9: 1})
    assert refs == ((0, 0), (3, 1))
    assert struct.unpack_from("<i", insns, 4)[0] == 0 and struct.unpack_from("<i", insns, 3 * 8 + 4)[0] == 0
    # the second half of each 16-byte load is left alone (here: the value's offset)
    assert insns[4 * 8:5 * 8] == PROGRAM[4 * 8:5 * 8]
    prog = ProgramDef("x", "x", 5, "perf", insns, refs, "sched")
    assert patch(prog, [7, 9]) == PROGRAM
    assert patch(prog, [31, 32]) == PROGRAM.replace(struct.pack("<i", 7), struct.pack("<i", 31), 1) \
        .replace(struct.pack("<i", 9), struct.pack("<i", 32), 1)


def test_a_reference_to_a_map_outside_the_module_cannot_be_cached() -> None:
    with pytest.raises(CacheProblem, match="refers to fd 7"):
        relocate(PROGRAM, {9: 0})
    with pytest.raises(CacheProblem, match="not whole instructions"):
        relocate(PROGRAM[:-3], {7: 0, 9: 1})


def test_a_patch_that_does_not_land_on_a_map_load_is_refused() -> None:
    prog = ProgramDef("x", "x", 5, "perf", PROGRAM, ((2, 0),))
    with pytest.raises(CacheProblem, match="not a map load"):
        patch(prog, [5])


def test_a_record_reads_back_as_written(tmp_path: Path) -> None:
    cache = ProgramCache(tmp_path / "bpf")
    p = _programs()
    path = cache.store(p)
    assert path.parent == tmp_path / "bpf" and oct(path.parent.stat().st_mode & 0o777) == "0o700"
    assert cache.read(p.key) == p
    assert cache.has_records()


def test_the_key_changes_with_every_input(tmp_path: Path) -> None:
    src = tmp_path / "bpf"
    src.mkdir()
    (src / "sched.bpf.c").write_text("int x;\n")
    (src / "sched.h").write_text("#define A 1\n")
    base = dict(src_dir=src, cflags=["-DA=0x1"], mode="btf", trace_ids={"sched_switch": 5}, version="0.1.0",
                kernel=KERNEL)
    key = cache_key(**base)
    assert key == cache_key(**base)
    changed = [cache_key(**{**base, "cflags": ["-DA=0x2"]}), cache_key(**{**base, "mode": "raw"}),
               cache_key(**{**base, "trace_ids": {"sched_switch": 6}}), cache_key(**{**base, "version": "0.2.0"}),
               cache_key(**{**base, "kernel": {**KERNEL, "release": "6.12.0"}}),
               cache_key(**{**base, "kernel": {**KERNEL, "btf": "cd" * 32}})]
    (src / "sched.h").write_text("#define A 2\n")
    changed.append(cache_key(**base))
    assert key not in changed and len(set(changed)) == len(changed)


def test_the_kernel_is_known_by_its_release_build_and_btf(tmp_path: Path) -> None:
    (tmp_path / "vmlinux").write_bytes(b"\x9f\xeb\x01")
    ident = kernel_identity(tmp_path / "vmlinux")
    assert ident["release"] == os.uname().release and ident["build"] == os.uname().version
    assert ident["btf"] != kernel_identity(tmp_path / "absent")["btf"] == "none"


@pytest.mark.parametrize("damage, why", [
    (lambda d: d[: len(d) // 2], "damaged"),
    (lambda d: d.replace(b'"GPL"', b'"MIT"'), "damaged"),
    (lambda d: b"garbage\n" + d, "not a program cache record"),
    (lambda d: d.replace(b"slatrace-bpf-cache 1 ", b"slatrace-bpf-cache 99 ", 1), "format 99"),
    (lambda d: b"", "not a program cache record"),
])
def test_a_damaged_record_is_a_problem_never_a_traceback(damage, why) -> None:
    data = encode(_programs())
    with pytest.raises(CacheProblem, match=why):
        decode(damage(data), "k" * 64)


def test_a_record_whose_body_hashes_but_does_not_parse_is_a_problem() -> None:
    import hashlib

    for body in (b"{}", b"[1, 2]", b'{"key": 1}', json.dumps({**json.loads(encode(_programs()).split(b"\n", 1)[1]),
                                                              "maps": [{"name": "x"}]}).encode()):
        data = f"slatrace-bpf-cache 1 {hashlib.sha256(body).hexdigest()}\n".encode() + body
        with pytest.raises(CacheProblem, match="does not parse"):
            decode(data, "k" * 64)


def test_a_record_of_another_key_is_not_used(tmp_path: Path) -> None:
    cache = ProgramCache(tmp_path)
    p = _programs("a" * 64)
    cache.store(p)
    os.replace(cache.path(p.key), cache.path("b" * 64))
    with pytest.raises(CacheProblem, match="another compile's"):
        cache.read("b" * 64)
    with pytest.raises(CacheMiss, match="no compiled programs"):
        cache.read("c" * 64)


def test_a_record_others_may_write_is_not_loaded(tmp_path: Path) -> None:
    cache = ProgramCache(tmp_path / "bpf")
    p = _programs()
    cache.store(p)
    os.chmod(cache.path(p.key), 0o666)
    with pytest.raises(CacheProblem, match="writable by others"):
        cache.read(p.key)
    os.chmod(cache.path(p.key), 0o600)
    os.chmod(tmp_path / "bpf", 0o777)
    with pytest.raises(CacheProblem, match="writable by others"):
        cache.read(p.key)


def test_only_the_newest_records_stay(tmp_path: Path) -> None:
    cache = ProgramCache(tmp_path)
    (tmp_path / "other-tool-data").write_text("kept")
    for i in range(KEEP + 2):
        path = cache.store(_programs(str(i) * 64))
        os.utime(path, (1000 + i, 1000 + i))
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert len(kept) == KEEP + 1 and "other-tool-data" in kept
    assert cache.path("0" * 64).name not in kept and cache.path(str(KEEP + 1) * 64).name in kept


def test_the_storage_btf_is_an_int_key_and_a_value_of_its_size() -> None:
    blob = storage_btf(56)
    magic, version, _, hdr_len, type_off, type_len, str_off, str_len = struct.unpack_from("<HBBIIIII", blob)
    assert (magic, version, hdr_len, type_off) == (0xEB9F, 1, 24, 0)
    assert len(blob) == hdr_len + type_len + str_len and str_off == type_len
    types, strings = blob[24:24 + type_len], blob[24 + str_off:]
    assert strings.startswith(b"\0")
    name_off, info, size, enc = struct.unpack_from("<IIII", types, 0)
    assert strings[name_off:].split(b"\0")[0] == b"int" and info >> 24 == 1 and size == 4 and enc & 0xFF == 32
    _, info, _, elem, index, nelems = struct.unpack_from("<IIIIII", types, 32)
    assert info >> 24 == 3 and (elem, index, nelems) == (2, 1, 56)


# The build process's choice, with the compile and the kernel replaced.

def _request(tmp_path: Path) -> dict:
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "sched.bpf.c").write_text("int x;\n")
    return {"src": str(src / "sched.bpf.c"), "cflags": ["-DA=0x1"], "mode": "raw", "trace_ids": {}}


@pytest.fixture
def compiles(monkeypatch):
    """_compile_and_attach replaced: counts its calls; its record is _programs() under the key asked."""
    calls = []

    def fake(request):
        calls.append(request)
        return {"maps": {}, "types": {}, "programs": {}, "attachments": [], "peak_bytes": 1,
                "compiler_files": []}, [], lambda key: _programs(key)

    monkeypatch.setattr(build, "_compile_and_attach", fake)
    monkeypatch.setattr(build, "kernel_identity", lambda: KERNEL, raising=False)
    return calls


def test_a_first_start_compiles_and_stores_then_a_restart_loads_the_record(tmp_path, compiles, monkeypatch) -> None:
    cache = ProgramCache(tmp_path / "cache")
    reply, _ = build._serve(_request(tmp_path), cache)
    assert reply["cache"] == "miss" and "no compiled programs" in reply["cache_note"]
    cache.store(_programs("0" * 64))   # another key's record: this one is looked for, and missed
    reply, _ = build._serve({**_request(tmp_path), "cflags": ["-DA=0x2"]}, cache)
    assert reply["cache"] == "miss" and "no compiled programs for this kernel and build" in reply["cache_note"]
    assert len(compiles) == 2
    assert "compiled and stored in" in reply["cache_note"]
    loaded = []

    def load(programs, tracefs):
        loaded.append(programs)
        from agent.probe.bpfload import Loaded
        return Loaded(maps={m.name: 100 + i for i, m in enumerate(programs.maps)})

    monkeypatch.setattr("agent.probe.bpfload.load", load)
    reply, fds = build._serve(_request(tmp_path), cache)
    assert reply["cache"] == "hit" and len(compiles) == 2 and len(loaded) == 1
    assert tuple(reply["types"]["fence"]) == ('"int"', '"int"')
    assert fds == [100, 101, 102] and reply["compiler_files"] == []


def test_a_damaged_record_falls_back_to_the_compile_and_is_rewritten(tmp_path, compiles) -> None:
    cache = ProgramCache(tmp_path / "cache")
    build._serve(_request(tmp_path), cache)
    [path] = list((tmp_path / "cache").iterdir())
    path.write_bytes(path.read_bytes()[:100])
    reply, _ = build._serve(_request(tmp_path), cache)
    assert reply["cache"] == "refused" and "damaged" in reply["cache_note"] and len(compiles) == 2
    assert "compiled and stored" in reply["cache_note"]
    decode(path.read_bytes(), json.loads(path.read_bytes().split(b"\n", 1)[1])["key"])  # whole again


def test_a_refused_record_is_discarded_and_compiled(tmp_path, compiles, monkeypatch) -> None:
    from agent.probe.bpfsys import ProgramRefused

    cache = ProgramCache(tmp_path / "cache")
    build._serve(_request(tmp_path), cache)

    def refuse(programs, tracefs):
        raise ProgramRefused("sched_switch", 13, "R1 invalid mem access 'scalar'")

    monkeypatch.setattr("agent.probe.bpfload.load", refuse)
    reply, _ = build._serve(_request(tmp_path), cache)
    assert reply["cache"] == "refused" and len(compiles) == 2
    assert "the kernel refused the sched_switch program (Permission denied): R1 invalid mem access" \
        in reply["cache_note"]


def test_a_directory_that_cannot_be_written_still_compiles(tmp_path, compiles) -> None:
    (tmp_path / "file").write_text("")
    reply, _ = build._serve(_request(tmp_path), ProgramCache(tmp_path / "file" / "cache"))
    assert reply["cache"] == "miss" and "compiled, not stored" in reply["cache_note"] and len(compiles) == 1


def test_without_a_cache_nothing_is_read_or_written(tmp_path, compiles) -> None:
    reply, _ = build._serve(_request(tmp_path), None)
    assert reply["cache"] == "off" and len(compiles) == 1 and list(tmp_path.iterdir()) == [tmp_path / "src"]


def test_a_refusal_for_want_of_privileges_keeps_the_record(tmp_path, compiles, monkeypatch) -> None:
    """EPERM is the process's capabilities, not the record: the compile meets
    the same refusal and names it, and a privileged start still finds the record."""
    from agent.probe.bpfsys import ProgramRefused

    cache = ProgramCache(tmp_path / "cache")
    build._serve(_request(tmp_path), cache)
    [path] = list((tmp_path / "cache").iterdir())

    def refuse(programs, tracefs):
        raise ProgramRefused("sched_switch", 1, "")

    monkeypatch.setattr("agent.probe.bpfload.load", refuse)
    reply, _ = build._serve(_request(tmp_path), cache)
    assert reply["cache"] == "unprivileged" and "Operation not permitted" in reply["cache_note"]
    assert len(compiles) == 2 and path.exists()


def test_whatever_goes_wrong_with_a_record_the_start_compiles(tmp_path, compiles, monkeypatch) -> None:
    cache = ProgramCache(tmp_path / "cache")
    build._serve(_request(tmp_path), cache)

    def broken(programs, tracefs):
        raise ValueError("invalid literal for int() with base 10: ''")

    monkeypatch.setattr("agent.probe.bpfload.load", broken)
    reply, _ = build._serve(_request(tmp_path), cache)
    assert reply["cache"] == "refused" and "ValueError" in reply["cache_note"] and len(compiles) == 2

    def fake(request):
        compiles.append(request)
        return {"maps": {}, "types": {}, "programs": {}, "attachments": [], "peak_bytes": 1,
                "compiler_files": []}, [], lambda key: {}["no such map"]

    monkeypatch.setattr(build, "_compile_and_attach", fake)
    reply, _ = build._serve({**_request(tmp_path), "mode": "classic"}, cache)
    assert "error" not in reply and "compiled, not stored" in reply["cache_note"]
