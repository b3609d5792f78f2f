"""The linter the code's noqa comments are written for, over the whole tree
(its rules are in pyproject.toml): a new finding fails the suite."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_ruff_finds_nothing():
    ruff = Path(sys.executable).parent / "ruff"
    if not ruff.exists():
        ruff = shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is not installed: run 'make setup-test' (it is a pinned test dependency)")
    out = subprocess.run([str(ruff), "check", "--no-cache", "--output-format", "concise", "."], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_test_modules_have_unique_names_across_tiers():
    """The tiers are not packages: pytest imports each module by its basename,
    and a second module of the same name stops the whole collection."""
    from collections import Counter

    names = Counter(p.name for p in (REPO / "tests").glob("*/test_*.py"))
    assert [n for n, c in names.items() if c > 1] == []
