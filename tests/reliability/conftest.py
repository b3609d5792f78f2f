"""The reliability tier: hostile and clumsy inputs against the real servers,
stores and daemon. Fast attacks run with the rest of the suite; the long ones
(marked `long`) run with `make test-reliability`."""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("SLATRACE_LONG") == "1":
        return
    skip = pytest.mark.skip(reason="long attack: run with make test-reliability (SLATRACE_LONG=1)")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)
