"""The part of a run-queue wait the service's own CPU limit held, against the
kernel's cpu.stat and the raw tracefs events of the same run
(tests/support/cpu_limit.py, where the bounds are; the kernel matrix runs the
same scenes on each kernel).

Two busy threads of one service share one CPU under a 20 ms / 100 ms quota:
alone there, where the CPU idles exactly while the limit holds them, and
beside a neighbour that weighs twice as much, to which the rest of their
waits belongs. Classic tracepoints pass no task pointer, so they cannot tell
the limit's part (docs/kernels.md).
"""

from __future__ import annotations

import pytest

from tests.support import cpu_limit

pytestmark = pytest.mark.kernel

SECONDS = 3.0
TELLING = pytest.mark.parametrize("unlimited_probe_each_mode", ["btf", "raw"], indirect=True)


@TELLING
def test_limit_part_alone_on_its_cpu(unlimited_probe_each_mode):
    probe = unlimited_probe_each_mode
    doc = cpu_limit.measure(probe, SECONDS)
    print("\n" + cpu_limit.summary(doc))
    assert doc["mode"] == probe.mode and doc["limit_clock"] is not None, doc
    cpu_limit.judge(doc, f"host {doc['mode']} alone", emulated=False)


@TELLING
def test_limit_part_beside_a_heavier_neighbour(unlimited_probe_each_mode):
    doc = cpu_limit.measure(unlimited_probe_each_mode, SECONDS, neighbour=True)
    print("\n" + cpu_limit.summary(doc))
    cpu_limit.judge(doc, f"host {doc['mode']} beside the neighbour", emulated=False)


@pytest.mark.parametrize("unlimited_probe_each_mode", ["classic"], indirect=True)
def test_classic_tracepoints_cannot_tell_the_limit_part(unlimited_probe_each_mode):
    doc = cpu_limit.measure(unlimited_probe_each_mode, SECONDS / 2)
    print("\n" + cpu_limit.summary(doc))
    cpu_limit.judge_classic(doc, "host classic")
