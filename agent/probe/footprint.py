"""Hands the start-up's memory back once the programs are attached.

The agent itself never maps the compiler: BCC compiles in a short-lived
process (agent/probe/build.py). Start-up still touches pages of libraries the
agent then hardly uses (the TLS library prometheus_client's import pulls in,
numpy's OpenBLAS, gRPC's core), and leaves heap that malloc keeps. Those are
returned here, once, right after attach. The compiler's steps below matter
only to a process that compiled with BCC itself (a test or a bench does: in
such a process libLLVM's and libclang-cpp's touched pages, ~80 MiB, and the
compiler's freed heap, ~25 MiB, would otherwise stay resident):

- malloc_trim(0) gives the free heap back to the kernel;
- madvise(MADV_PAGEOUT) over the compiler's file mappings, then over every
  other shared library's, drops their resident pages;
- posix_fadvise(DONTNEED) over the compiler's files drops what is left of
  them in the page cache: the pages readahead brought in that were never
  mapped (~80 MiB). They would be reclaimed first under pressure, but until
  then they are charged to the agent's memory cgroup: its steady charge falls
  from ~180 to ~100 MiB (BENCHMARKS.md, "Memory cgroup charge"). They stay mapped, so
  what the agent does use faults back in from the page cache on first use
  (a minor fault, once: the steady working set is what stays resident), and a
  later call into the compiler (a second compile, the destructors at exit)
  faults its pages back in: slower, never wrong. The kernel skips pages
  another process also maps, so the saving shows only where the agent is
  their sole user.

Nothing here is required for correctness: each step that the kernel or libc
refuses is skipped and reported.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import re
from dataclasses import dataclass
from pathlib import Path

MADV_PAGEOUT = 21  # linux/mman.h, kernel >= 5.4
# The compiler's libraries as Debian's python3-bpfcc maps them (libbcc links
# libLLVM and libclang-cpp dynamically); libbcc itself keeps running (map
# reads, the ring buffer) and is left alone.
COMPILER_LIBRARIES = re.compile(r"/lib(LLVM|clang-cpp|clang)[-.][^/]*\.so[^/]*$")
# Every other shared object (lib*.so.N, a Python extension's .so).
SHARED_LIBRARIES = re.compile(r"\.so(\.[0-9]+)*$")


@dataclass(frozen=True)
class Released:
    """What release_compiler_memory() did, for the start-up log."""

    trimmed: bool          # malloc_trim(0) released something
    paged_out_bytes: int   # size of the compiler's ranges advised (mapped, not necessarily resident)
    ranges: int
    error: str | None = None
    library_bytes: int = 0  # size of the other shared libraries' ranges advised
    library_ranges: int = 0
    files_dropped: int = 0  # compiler files whose unmapped page cache was dropped
    peak_bytes: int | None = None  # VmHWM before the release: the compile's resident peak
    map_bytes: int | None = None   # the BPF maps' kernel memory

    def describe(self) -> str:
        text = f"heap trimmed: {'yes' if self.trimmed else 'no'}; "
        if self.ranges:  # the compiler mapped here (not in the agent: agent/probe/build.py compiles)
            text += (f"compiler mappings paged out: {self.ranges} ranges, {self.paged_out_bytes / 2**20:.0f} MiB "
                     "mapped" + (f", page cache of {self.files_dropped} files dropped" if self.files_dropped else "")
                     + "; other ")
        text += f"shared libraries: {self.library_ranges} ranges, {self.library_bytes / 2**20:.0f} MiB mapped"
        text += f" ({self.error})" if self.error else ""
        if self.peak_bytes is not None:
            # A container's memory limit holds both (BENCHMARKS.md, "Memory cgroup charge").
            text += f"; start-up peak {self.peak_bytes / 2**20:.0f} MiB resident (VmHWM)"
            if self.map_bytes is not None:
                text += f" + {self.map_bytes / 2**20:.1f} MiB of BPF maps in kernel memory"
        return text


def compiler_ranges(maps_text: str, pattern: re.Pattern[str] = COMPILER_LIBRARIES,
                    but: re.Pattern[str] | None = None) -> list[tuple[int, int]]:
    """(start, end) of every mapping of /proc/PID/maps whose file matches
    pattern (and not `but`)."""
    out = []
    for line in maps_text.splitlines():
        fields = line.split(None, 5)
        if len(fields) < 6 or not pattern.search(fields[5]) or (but is not None and but.search(fields[5])):
            continue
        start, _, end = fields[0].partition("-")
        out.append((int(start, 16), int(end, 16)))
    return out


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def trim_heap(libc: ctypes.CDLL | None = None) -> bool:
    """malloc_trim(0): True when glibc returned memory to the kernel."""
    libc = libc or _libc()
    trim = getattr(libc, "malloc_trim", None)  # glibc only
    return bool(trim(0)) if trim is not None else False


def page_out(ranges: list[tuple[int, int]], libc: ctypes.CDLL | None = None) -> tuple[int, str | None]:
    """MADV_PAGEOUT over ranges; (bytes advised, first error or None)."""
    libc = libc or _libc()
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    done, error = 0, None
    for start, end in ranges:
        if libc.madvise(start, end - start, MADV_PAGEOUT) == 0:
            done += end - start
            continue
        err = ctypes.get_errno()
        error = error or f"madvise(MADV_PAGEOUT): {os.strerror(err)}"
        if err == errno.EINVAL:  # kernel before 5.4: no MADV_PAGEOUT at all
            break
    return done, error


def compiler_files(maps_text: str) -> list[str]:
    """The compiler libraries' paths in /proc/PID/maps, each once."""
    out = []
    for line in maps_text.splitlines():
        fields = line.split(None, 5)
        if len(fields) == 6 and COMPILER_LIBRARIES.search(fields[5]) and fields[5] not in out:
            out.append(fields[5])
    return out


def drop_page_cache(paths: list[str]) -> tuple[int, str | None]:
    """posix_fadvise(DONTNEED) over whole files: the kernel drops their cached
    pages that no process maps. (files done, first error or None)"""
    done, error = 0, None
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            done += 1
        except OSError as e:
            error = error or f"posix_fadvise({path}): {e.strerror}"
    return done, error


def library_ranges(maps_text: str) -> list[tuple[int, int]]:
    """The shared libraries' mappings other than the compiler's."""
    return compiler_ranges(maps_text, SHARED_LIBRARIES, but=COMPILER_LIBRARIES)


def resident_peak(status: Path = Path("/proc/self/status")) -> int | None:
    """VmHWM in bytes: the most this process has had resident (the compile)."""
    try:
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def bpf_map_bytes(fdinfo: Path = Path("/proc/self/fdinfo")) -> int | None:
    """The kernel memory of the BPF maps this process holds (their `memlock`),
    which is charged to its memory cgroup beside its pages; None if unreadable."""
    total = 0
    try:
        entries = list(fdinfo.iterdir())
    except OSError:
        return None
    for entry in entries:
        try:
            fields = dict(line.split(":", 1) for line in entry.read_text().splitlines() if ":" in line)
        except OSError:
            continue  # closed meanwhile
        if "map_type" in fields and fields.get("memlock", "").strip().isdigit():
            total += int(fields["memlock"])
    return total


def release_compiler_memory(maps: Path = Path("/proc/self/maps"), proc_self: Path = Path("/proc/self")) -> Released:
    libc = _libc()
    peak, map_bytes = resident_peak(proc_self / "status"), bpf_map_bytes(proc_self / "fdinfo")
    trimmed = trim_heap(libc)
    try:
        text = maps.read_text()
    except OSError as e:
        return Released(trimmed, 0, 0, f"cannot read {maps}: {e.strerror}", peak_bytes=peak, map_bytes=map_bytes)
    ranges, others = compiler_ranges(text), library_ranges(text)
    advised, error = page_out(ranges, libc)
    dropped, drop_error = drop_page_cache(compiler_files(text))
    library_bytes, library_error = page_out(others, libc)
    return Released(trimmed, advised, len(ranges), error or drop_error or library_error, library_bytes,
                    len(others), files_dropped=dropped, peak_bytes=peak, map_bytes=map_bytes)
