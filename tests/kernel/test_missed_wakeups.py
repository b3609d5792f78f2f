"""Waits after wake-ups the programs never see are recovered from the
scheduler's own enqueue time: one wake-up in four skipped on purpose, the
agent's waits one for one against the tracefs reference
(tests/support/missed_wakeups.py; the kernel matrix runs the same on each
kernel)."""

from __future__ import annotations

import pytest

from tests.support import missed_wakeups

pytestmark = pytest.mark.kernel


def test_waits_after_missed_wakeups_are_recovered(kernel):
    doc = missed_wakeups.measure()
    print("\n" + missed_wakeups.summary(doc))
    missed_wakeups.judge(doc, "host", emulated=False)
