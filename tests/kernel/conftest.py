"""The loaded BPF program, for kernel tests that talk to the probe directly."""

from __future__ import annotations

import importlib.util

import pytest

from tests.support import kernel_unavailable, require_kernel


@pytest.fixture
def probe():
    yield from _load("auto")


@pytest.fixture
def unlimited_probe():
    """The programs with an event rate no workload here reaches: the rate
    limit (tested on its own) must not thin a stream compared one for one."""
    from agent.probe.loader import MapSizes
    yield from _load("auto", MapSizes(event_rate=10_000_000))


@pytest.fixture(params=["btf", "raw", "classic"])
def probe_each_mode(request):
    """The programs on BTF-typed tracepoints, then raw, then classic ones."""
    yield from _load(request.param)


@pytest.fixture(params=["btf", "raw", "classic"])
def unlimited_probe_each_mode(request):
    """unlimited_probe on BTF-typed, then raw, then classic tracepoints (a
    test picks some with indirect parametrization)."""
    from agent.probe.loader import MapSizes
    yield from _load(request.param, MapSizes(event_rate=10_000_000))


def _load(tracepoints: str, sizes=None):
    reason = kernel_unavailable() or (None if importlib.util.find_spec("bcc") else "python3-bpfcc is not installed")
    if reason:
        require_kernel(reason)
    from agent.probe import features
    from agent.probe.loader import Probe

    p = Probe.load(features.detect(), tracepoints=tracepoints) if sizes is None else \
        Probe.load(features.detect(), sizes, tracepoints=tracepoints)
    yield p
    p.close()
