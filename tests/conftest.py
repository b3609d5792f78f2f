"""Fixtures shared by every tier."""

from __future__ import annotations

import pytest

from tests.support import kernel_unavailable, require_kernel


@pytest.fixture
def kernel() -> None:
    """Root, tracefs and cgroup v2 are here, or the test skips (fails in CI)."""
    reason = kernel_unavailable()
    if reason:
        require_kernel(reason)
