"""Fixtures shared by every tier."""

from __future__ import annotations

import pytest

from tests.support import needs_kernel


@pytest.fixture
def kernel() -> None:
    """Root, tracefs and cgroup v2 are here, or the test skips (fails in CI)."""
    needs_kernel()
