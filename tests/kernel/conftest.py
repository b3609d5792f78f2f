"""The loaded BPF program, for kernel tests that talk to the probe directly."""

from __future__ import annotations

import importlib.util

import pytest

from tests.support import kernel_unavailable, require_kernel


@pytest.fixture
def probe():
    reason = kernel_unavailable() or (None if importlib.util.find_spec("bcc") else "python3-bpfcc is not installed")
    if reason:
        require_kernel(reason)
    from agent.probe import features
    from agent.probe.loader import Probe

    p = Probe.load(features.detect())
    yield p
    p.close()
