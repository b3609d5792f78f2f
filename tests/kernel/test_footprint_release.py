"""The compiler's memory after attach: paged out, and the probe still works."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from agent.probe.footprint import COMPILER_LIBRARIES
from bench.compiler_libraries import private_compiler_libraries

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


# Runs in a child process: the probe loaded on private copies of the compiler
# libraries, so that no other BCC tool on the host shares (and pins) their pages.
CHILD = """
import json, time
from agent.probe import features
from agent.probe.footprint import release_compiler_memory
from agent.probe.loader import Probe
from tests.kernel.test_footprint_release import compiler_resident, compiler_paths

probe = Probe.load(features.detect())
before = compiler_resident()
released = release_compiler_memory()
after = compiler_resident()
time.sleep(0.3)
snap = probe.snapshot()
runs = sum(b.count for h in snap.hists.values() for b in h.values())
probe.close()
print(json.dumps({"before": before, "after": after, "described": released.describe(), "error": released.error,
                  "ranges": released.ranges, "runs": runs, "paths": sorted(compiler_paths())}))
"""

def compiler_paths(maps: Path = Path("/proc/self/maps")) -> set[str]:
    return {line.split(None, 5)[5] for line in maps.read_text().splitlines()
            if len(line.split(None, 5)) == 6 and COMPILER_LIBRARIES.search(line.split(None, 5)[5])}


def test_release_drops_the_compilers_pages_and_the_probe_still_reads(kernel: None, tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    env = private_compiler_libraries(tmp_path)
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=root, capture_output=True, text=True, timeout=120,
                         env={**os.environ, **env, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout.splitlines()[-1])
    before, after = doc["before"], doc["after"]
    print("\ncompiler mappings resident, MiB of private file / shared file / anonymous pages: before "
          + " / ".join(f"{b / MIB:.1f}" for b in before) + ", after " + " / ".join(f"{b / MIB:.1f}" for b in after)
          + f"; {doc['described']}")
    assert doc["paths"] and all(p.startswith(str(tmp_path)) for p in doc["paths"]), doc["paths"]
    assert doc["error"] is None
    assert doc["ranges"] >= 2  # libLLVM and libclang-cpp at least
    # The compile touched tens of MiB of their code, which only this process
    # maps; after the release they are gone.
    assert before[0] > 20 * MIB
    assert after[0] < 2 * MIB
    # Map reads go through libbcc, untouched: the maps still fill.
    assert doc["runs"] > 0
