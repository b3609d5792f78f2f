"""The loaded BPF program, for kernel tests that talk to the probe directly."""

from __future__ import annotations

import importlib.util

import pytest

from tests.support import kernel_unavailable, require_kernel


@pytest.fixture
def probe():
    yield from _load("auto")


@pytest.fixture(params=["raw", "classic"])
def probe_each_mode(request):
    """The programs on raw tracepoints, then on classic ones."""
    yield from _load(request.param)


def _load(tracepoints: str):
    reason = kernel_unavailable() or (None if importlib.util.find_spec("bcc") else "python3-bpfcc is not installed")
    if reason:
        require_kernel(reason)
    from agent.probe import features
    from agent.probe.loader import Probe

    p = Probe.load(features.detect(), tracepoints=tracepoints)
    yield p
    p.close()
