"""Which mappings the agent pages out after the compile (agent/probe/footprint.py)."""

from __future__ import annotations

from pathlib import Path

from agent.probe.footprint import (Released, bpf_map_bytes, compiler_files, compiler_ranges, drop_page_cache,
                                   library_ranges, resident_peak)

# /proc/PID/maps lines as a Debian 12 agent shows them after BCC compiled.
MAPS = """\
55d0c0000000-55d0c0021000 r--p 00000000 fe:01 1048601    /usr/bin/python3.11
7f2a10000000-7f2a10021000 rw-p 00000000 00:00 0
7f2a20000000-7f2a22bd1000 r--p 00000000 fe:01 2359312    /usr/lib/x86_64-linux-gnu/libLLVM-14.so.1
7f2a22bd1000-7f2a25f64000 r-xp 02bd1000 fe:01 2359312    /usr/lib/x86_64-linux-gnu/libLLVM-14.so.1
7f2a26000000-7f2a27000000 r-xp 00000000 fe:01 2359400    /usr/lib/llvm-14/lib/libclang-cpp.so.14
7f2a28000000-7f2a28100000 r-xp 00000000 fe:01 2359500    /usr/lib/x86_64-linux-gnu/libbcc.so.0.26.0
7f2a29000000-7f2a29100000 r-xp 00000000 fe:01 2359600    /usr/lib/x86_64-linux-gnu/libclang_rt.so
7f2a2a000000-7f2a2a001000 rw-p 00000000 00:00 0          [heap]
7f2a2b000000-7f2a2b001000 r--p 00000000 fe:01 2359700    /opt/my libLLVM-14.so.1 copy/libfoo.so
"""


def test_only_the_compiler_libraries_are_chosen() -> None:
    assert compiler_ranges(MAPS) == [
        (0x7F2A20000000, 0x7F2A22BD1000),
        (0x7F2A22BD1000, 0x7F2A25F64000),
        (0x7F2A26000000, 0x7F2A27000000),
    ]


def test_every_other_shared_library_is_chosen_apart() -> None:
    """Start-up touched them; what the agent uses faults back in."""
    assert library_ranges(MAPS) == [
        (0x7F2A28000000, 0x7F2A28100000),   # libbcc
        (0x7F2A29000000, 0x7F2A29100000),   # libclang_rt (not the compiler)
        (0x7F2A2B000000, 0x7F2A2B001000),
    ]
    assert not set(library_ranges(MAPS)) & set(compiler_ranges(MAPS))


def test_nothing_to_page_out_without_bcc() -> None:
    assert compiler_ranges("") == []
    assert compiler_ranges("7f2a2a000000-7f2a2a001000 rw-p 00000000 00:00 0\n") == []


def test_description_names_what_was_done() -> None:
    text = Released(trimmed=True, paged_out_bytes=161 << 20, ranges=7, library_bytes=90 << 20,
                    library_ranges=120).describe()
    assert text == ("heap trimmed: yes; compiler mappings paged out: 7 ranges, 161 MiB mapped; "
                    "other shared libraries: 120 ranges, 90 MiB mapped")
    # The agent maps no compiler (agent/probe/build.py compiles): only the other libraries are named.
    assert Released(trimmed=True, paged_out_bytes=0, ranges=0, library_bytes=53 << 20,
                    library_ranges=171).describe() == "heap trimmed: yes; shared libraries: 171 ranges, 53 MiB mapped"
    assert Released(False, 0, 0, "madvise(MADV_PAGEOUT): Invalid argument").describe().endswith(
        "(madvise(MADV_PAGEOUT): Invalid argument)")


def test_description_ends_with_the_start_up_peak() -> None:
    text = Released(True, 161 << 20, 7, peak_bytes=165 << 20, map_bytes=int(50.2 * (1 << 20))).describe()
    assert text.endswith("; start-up peak 165 MiB resident (VmHWM) + 50.2 MiB of BPF maps in kernel memory")


def test_peak_and_map_memory_come_from_proc(tmp_path: Path) -> None:
    """VmHWM from status; memlock summed over the fds that are BPF maps only."""
    (tmp_path / "status").write_text("Name:\tslatrace\nVmPeak:\t 900000 kB\nVmHWM:\t  168404 kB\nVmRSS:\t 57940 kB\n")
    fdinfo = tmp_path / "fdinfo"
    fdinfo.mkdir()
    (fdinfo / "3").write_text("pos:\t0\nflags:\t02000002\nmnt_id:\t15\nino:\t1057\n")
    (fdinfo / "4").write_text("pos:\t0\nflags:\t02000002\nmap_type:\t1\nkey_size:\t16\nmemlock:\t25165824\n")
    (fdinfo / "5").write_text("pos:\t0\nmap_type:\t27\nkey_size:\t0\nmemlock:\t4222976\n")
    (fdinfo / "6").write_text("pos:\t0\nprog_type:\t5\nmemlock:\t4096\n")
    assert resident_peak(tmp_path / "status") == 168404 * 1024
    assert bpf_map_bytes(fdinfo) == 25165824 + 4222976
    assert resident_peak(tmp_path / "missing") is None and bpf_map_bytes(tmp_path / "missing") is None


def test_the_compiler_files_are_named_once() -> None:
    assert compiler_files(MAPS) == ["/usr/lib/x86_64-linux-gnu/libLLVM-14.so.1",
                                    "/usr/lib/llvm-14/lib/libclang-cpp.so.14"]
    text = Released(True, 161 << 20, 7, files_dropped=2).describe()
    assert "161 MiB mapped, page cache of 2 files dropped; other shared libraries" in text


def test_dropping_the_page_cache_of_a_missing_file_is_reported(tmp_path: Path) -> None:
    (tmp_path / "lib.so").write_bytes(b"x" * 8192)
    done, error = drop_page_cache([str(tmp_path / "lib.so"), str(tmp_path / "gone.so")])
    assert done == 1 and error is not None and "gone.so" in error
