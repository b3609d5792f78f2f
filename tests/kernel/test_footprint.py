"""The compiler's memory after attach: paged out, and the probe still works."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from agent.probe.footprint import COMPILER_LIBRARIES, release_compiler_memory

pytestmark = pytest.mark.kernel

MIB = 1 << 20


def compiler_resident(smaps: Path = Path("/proc/self/smaps")) -> tuple[int, int, int]:
    """(file pages only this process maps, file pages shared, anonymous pages)
    resident in the compiler's mappings, from smaps, in bytes.

    Shared file pages are also mapped by another process (another BCC tool)
    and cannot be paged out by this one; the anonymous ones are the
    libraries' relocated data, which without swap stays."""
    rss = anon = shared = 0
    chosen = False
    for line in smaps.read_text().splitlines():
        head = line.split(None, 5)
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            chosen = len(head) == 6 and bool(COMPILER_LIBRARIES.search(head[5]))
        elif chosen and head[0] == "Rss:":
            rss += int(head[1]) * 1024
        elif chosen and head[0] == "Anonymous:":
            anon += int(head[1]) * 1024
        elif chosen and head[0] in ("Shared_Clean:", "Shared_Dirty:"):
            shared += int(head[1]) * 1024
    return rss - anon - shared, shared, anon


def test_release_drops_the_compilers_pages_and_the_probe_still_reads(probe):
    before = compiler_resident()
    released = release_compiler_memory()
    after = compiler_resident()
    print("\ncompiler mappings resident, MiB of private file / shared file / anonymous pages: before "
          + " / ".join(f"{b / MIB:.1f}" for b in before) + ", after " + " / ".join(f"{b / MIB:.1f}" for b in after)
          + f"; {released.describe()}")
    assert released.error is None
    assert released.ranges >= 2  # libLLVM and libclang-cpp at least
    # The compile touched tens of MiB of their code (shared when another BCC
    # tool runs here too); what only this process held is gone.
    assert before[0] + before[1] > 20 * MIB
    assert after[0] < 2 * MIB
    # Map reads go through libbcc, untouched; the maps still fill.
    time.sleep(0.3)
    snap = probe.snapshot()
    assert sum(b.count for h in snap.hists.values() for b in h.values()) > 0
