"""An installed slatrace (not a checkout) finds its BPF sources."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_wheel_ships_bpf_sources_and_installed_package_finds_them(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(REPO)], check=True, cwd=tmp_path)
    [wheel] = (tmp_path / "dist").glob("slatrace-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"agent/bpf/sched.bpf.c", "agent/bpf/sched.h"} <= names
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                    str(wheel)], check=True)
    out = subprocess.run(
        [sys.executable, "-I", "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
         "from agent.probe.loader import bpf_source_dir; print(bpf_source_dir())", str(target)],
        capture_output=True, text=True, check=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": ""})
    found = Path(out.stdout.strip())
    assert found == target / "agent" / "bpf"
    assert (found / "sched.bpf.c").read_text() == (REPO / "bpf" / "sched.bpf.c").read_text()
