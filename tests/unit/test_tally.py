"""The self-check: waits the programs saw against waits that reached the
agent, judged over a window with slack for stragglers across a drain."""

from dataclasses import replace

from agent.probe.snapshot import HIST_IOWAIT, HIST_RUNQ, Bucket, CgroupCounters, ProbeSnapshot, carry_over
from agent.store.tally import WaitTally, arrived


def snap(runq: int, iowait: int = 0, lost_runq: int = 0, tally: tuple[int, int] | None = None) -> ProbeSnapshot:
    """runq waits split over two slots of cgroup 7, iowait in cgroup 8."""
    hists = {(7, HIST_RUNQ): {3: Bucket(runq - runq // 2, 10), 9: Bucket(runq // 2, 20)},
             (8, HIST_IOWAIT): {4: Bucket(iowait, 5)}}
    s = ProbeSnapshot.from_dicts(0, 0.0, hists=hists, cgroups={7: CgroupCounters(lost_runq=lost_runq)})
    return replace(s, tally=tally)


def test_arrived_counts_histograms_and_what_full_maps_could_not_take():
    assert arrived(snap(101, iowait=7, lost_runq=5)) == (106, 7)


def test_every_wait_arrived_is_ok():
    t = WaitTally()
    for _ in range(10):
        t.observe(snap(1000, iowait=20, tally=(1000, 20)))
    v = t.verdict()
    assert v.ok and (v.seen, v.arrived) == (10_200, 10_200)
    assert t.missing_total == {"runq": 0, "iowait": 0}
    assert t.seen_total == {"runq": 10_000, "iowait": 200}


def test_a_straggler_across_a_drain_is_not_a_loss():
    # One wait counted in the first interval arrives with the second.
    t = WaitTally()
    t.observe(snap(999, tally=(1000, 0)))
    t.observe(snap(1001, tally=(1000, 0)))
    assert t.verdict().ok


def test_waits_lost_on_the_way_are_reported_in_one_sentence():
    # What the drain read as empty caches on kernels without batch lookups of
    # per-CPU arrays: most waits never arrived.
    t = WaitTally()
    for _ in range(5):
        t.observe(snap(400, tally=(1000, 0)))
    v = t.verdict()
    assert not v.ok
    assert v.detail.startswith("the BPF programs saw 5000 runq waits in the last 5 intervals but 2000 reached")
    assert t.missing_total["runq"] == 3000


def test_the_window_forgets_a_loss_that_stopped():
    t = WaitTally(window=3)
    t.observe(snap(0, tally=(1000, 0)))
    assert not t.verdict().ok
    for _ in range(3):
        t.observe(snap(1000, tally=(1000, 0)))
    assert t.verdict().ok
    assert t.missing_total["runq"] == 1000   # the counter keeps it


def test_snapshots_without_a_tally_are_not_judged():
    t = WaitTally()
    t.observe(snap(5))
    assert t.verdict() is None


def test_a_carried_over_interval_keeps_both_tallies():
    both = carry_over(snap(10, tally=(10, 1)), snap(20, tally=(21, 2)))
    assert both.tally == (31, 3)
    assert carry_over(snap(10), snap(20, tally=(21, 2))).tally is None


def test_programs_the_kernel_skipped_are_a_loss_the_tally_cannot_see():
    """Every wait that reached a program arrived, but the kernel skipped the
    switch program 40 times in one interval (fdinfo's recursion_misses, a
    cumulative count): the verdict names the skips, and forgets them with
    the window."""
    from agent.probe.snapshot import ProgramStats

    def with_misses(misses: int) -> ProbeSnapshot:
        return replace(snap(1000, tally=(1000, 0)), programs={"sched_switch": ProgramStats(0, 0, misses),
                                                               "sched_wakeup": ProgramStats(0, 0, 2)})

    t = WaitTally(window=3)
    t.observe(with_misses(3))       # 5 since load: within the slack
    assert t.verdict().ok
    t.observe(with_misses(43))
    v = t.verdict()
    assert not v.ok and v.detail.startswith("the kernel skipped slatrace's BPF programs 45 times in the last 2 ")
    for _ in range(3):
        t.observe(with_misses(43))  # no new skips
    assert t.verdict().ok
