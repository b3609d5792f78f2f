"""How the recovery test tells a recovered wait that starts off the
reference's from a wrong one. The cases are waits recorded on the host by
tests/kernel/test_missed_wakeups.py: (agent's start - reference's, reference
ns, agent ns, moves into the wait)."""

from __future__ import annotations

import pytest

from agent.probe.snapshot import EV_RUNQ, SchedEvent
from tests.support import missed_wakeups
from tests.support.tracefs import WaitSpan

T0 = 1_000_000_000


def pair(offset: int, ref_ns: int, agent_ns: int) -> tuple[WaitSpan, SchedEvent]:
    span = WaitSpan(tid=7, start_ns=T0, end_ns=T0 + ref_ns, wake_cpu=0, cpu=1, prev_pid=9)
    start = T0 + offset
    return span, SchedEvent(cgid=1, kind=EV_RUNQ, start_ns=start, end_ns=start + agent_ns, other_cgid=0, tid=7)


LAST_RAN = T0 - 1_300_000   # the switch-in before: a 0.3 ms run, a 1 ms sleep


def test_a_moved_wait_counts_from_the_move_inside_the_reference() -> None:
    span, e = pair(2_151_609, 2_231_338, 77_235)
    assert missed_wakeups.late_kind(span, e, LAST_RAN) == "inside"
    assert missed_wakeups.moved_before_start(span, e, [T0 + 2_142_326])
    assert not missed_wakeups.moved_before_start(span, e, [T0 - 5_000, T0 + 2_231_338 + 1])


def test_a_wait_whose_clock_was_not_updated_reads_as_zero_inside_the_reference() -> None:
    span, e = pair(22_583, 26_029, 0)
    assert missed_wakeups.late_kind(span, e, LAST_RAN) == "inside"
    assert not missed_wakeups.moved_before_start(span, e, [])


def test_a_wait_stamped_at_the_enqueue_before_a_stall_starts_early() -> None:
    span, e = pair(-477_371, 9_263, 484_882)
    assert missed_wakeups.late_kind(span, e, LAST_RAN) == "early"
    # and its end may be early too, by a stall between the switch-in's probes
    span, e = pair(-237_544, 457_491, 501_717)
    assert missed_wakeups.late_kind(span, e, LAST_RAN) == "early"


@pytest.mark.parametrize("offset,agent_ns", [
    (30_000, 100_000),        # ends 104 µs after the switch-in
    (-60_000, 100_000),       # ends 14 µs after the switch-in
    (-1_400_000, 1_410_000),  # starts before the task last ran
])
def test_a_wait_the_kernels_stamps_cannot_give_is_not_explained(offset: int, agent_ns: int) -> None:
    span, e = pair(offset, 26_000, agent_ns)
    assert missed_wakeups.late_kind(span, e, LAST_RAN) is None


def host_doc(**changes) -> dict:
    """A host run's figures (those of one run of the kernel test), changed as asked."""
    doc = {"cpus": [0, 1], "skip": 4, "mode": "btf", "event_errors": 0, "wakeups": 3000, "reference_gaps": 0,
           "untraced_wakeup": 457, "recovered_wakeup": 457, "reference_waits": 3991, "agent_waits": 3992,
           "unmatched": 0, "matched_reference_ns": 590_000_000, "matched_agent_ns": 584_200_000,
           "ontime_reference_ns": 588_000_000, "ontime_agent_ns": 584_200_000, "start_error_median_ns": 500,
           "late": 3, "late_moved": 1, "late_inside": 3, "late_early": 0, "late_unexplained": 0,
           "io": {"reference": 30268, "agent": 30268, "recovered": 7666, "unmatched": 0, "late": 4,
                  "past_switch_in": 0, "ontime": 30264, "ontime_reference_ns": 967_500_000,
                  "ontime_agent_ns": 987_700_000}}
    doc.update(changes)
    return doc


def test_the_judge_takes_waits_that_start_off_for_a_reason_and_refuses_the_rest() -> None:
    missed_wakeups.judge(host_doc(), "host", emulated=False)
    # A moved wait of 10 ms, dropped whole, leaves the waits on time exact.
    missed_wakeups.judge(host_doc(matched_agent_ns=574_200_000, late=4, late_inside=4), "host", emulated=False)
    with pytest.raises(AssertionError, match="late_unexplained': 1"):
        missed_wakeups.judge(host_doc(late_unexplained=1, late_inside=2), "host", emulated=False)
    # 2% short, beyond what 457 waits ending 10 µs early explain.
    with pytest.raises(AssertionError, match="ontime_agent_ns': 571000000"):
        missed_wakeups.judge(host_doc(ontime_agent_ns=571_000_000), "host", emulated=False)
    with pytest.raises(AssertionError, match="'late': 80"):
        missed_wakeups.judge(host_doc(late=80, late_inside=80), "host", emulated=False)
