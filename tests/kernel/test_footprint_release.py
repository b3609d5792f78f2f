"""The process that loads the probe never maps the compiler: BCC compiles in
a short-lived build process (agent/probe/build.py) that hands the programs
and maps over as file descriptors. The probe still reads, and the start-up's
release still runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.compiler_libraries import private_compiler_libraries

pytestmark = pytest.mark.kernel

MIB = 1 << 20

# Runs in a child process: what it maps is its own, not pytest's (which may
# have imported bcc for other tests).
CHILD = """
import json, re, sys, time
from agent.probe import features
from agent.probe.footprint import release_compiler_memory, resident_peak
from agent.probe.loader import Probe

probe = Probe.load(features.detect())
released = release_compiler_memory()
time.sleep(0.3)
snap = probe.snapshot()
runs = sum(b.count for h in snap.hists.values() for b in h.values())
maps = open("/proc/self/maps").read()
compilers = sorted({line.split(None, 5)[5] for line in maps.splitlines() if len(line.split(None, 5)) == 6
                    and re.search(r"/lib(LLVM|clang|bcc)[-.][^/]*\\.so", line.split(None, 5)[5])})
print(json.dumps({"peak": resident_peak(), "build_peak": probe.build_peak_bytes, "described": released.describe(),
                  "error": released.error, "runs": runs, "compilers": compilers, "bcc": "bcc" in sys.modules,
                  "mode": probe.mode}))
probe.close()
"""


def test_the_loading_process_never_maps_the_compiler(kernel: None, tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    env = private_compiler_libraries(tmp_path)
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=root, capture_output=True, text=True, timeout=180,
                         env={**os.environ, **env, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout.splitlines()[-1])
    print(f"\n{doc['mode']}: this process peaked at {doc['peak'] / MIB:.0f} MiB resident, the build process at "
          f"{doc['build_peak'] / MIB:.0f} MiB; {doc['described']}")
    assert doc["compilers"] == [] and not doc["bcc"]
    # The compile's peak (~140 MiB here) is the build process's; this one
    # holds Python, numpy and the maps' buffers.
    assert doc["build_peak"] > 100 * MIB
    assert doc["peak"] < doc["build_peak"] - 50 * MIB
    assert doc["error"] is None
    # The maps, read with bpf(2) through the handed-over fds, still fill.
    assert doc["runs"] > 0
