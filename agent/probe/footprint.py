"""Hands the start-up's memory back once the programs are attached.

BCC compiles in-process with clang/LLVM. After the compile the agent never
runs that code again, yet it stays resident: the pages of libLLVM and
libclang-cpp that the compile touched (file pages, ~80 MiB) and the heap the
compiler freed but malloc kept (~25 MiB). Start-up also touches pages of
libraries the agent then hardly uses (the TLS library prometheus_client's
import pulls in, numpy's OpenBLAS, most of libbcc): ~12 MiB more. All of it is
returned here, once, right after attach:

- malloc_trim(0) gives the free heap back to the kernel;
- madvise(MADV_PAGEOUT) over the compiler's file mappings, then over every
  other shared library's, drops their resident pages. They stay mapped, so
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

    def describe(self) -> str:
        text = (f"heap trimmed: {'yes' if self.trimmed else 'no'}; compiler mappings paged out: "
                f"{self.ranges} ranges, {self.paged_out_bytes / 2**20:.0f} MiB mapped; other shared libraries: "
                f"{self.library_ranges} ranges, {self.library_bytes / 2**20:.0f} MiB mapped")
        return text + (f" ({self.error})" if self.error else "")


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


def library_ranges(maps_text: str) -> list[tuple[int, int]]:
    """The shared libraries' mappings other than the compiler's."""
    return compiler_ranges(maps_text, SHARED_LIBRARIES, but=COMPILER_LIBRARIES)


def release_compiler_memory(maps: Path = Path("/proc/self/maps")) -> Released:
    libc = _libc()
    trimmed = trim_heap(libc)
    try:
        text = maps.read_text()
    except OSError as e:
        return Released(trimmed, 0, 0, f"cannot read {maps}: {e.strerror}")
    ranges, others = compiler_ranges(text), library_ranges(text)
    advised, error = page_out(ranges, libc)
    library_bytes, library_error = page_out(others, libc)
    return Released(trimmed, advised, len(ranges), error or library_error, library_bytes, len(others))
