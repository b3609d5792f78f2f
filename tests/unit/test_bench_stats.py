"""The bench's ring workload and how it judges a ratio of two noisy slowdowns."""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path

import pytest

from bench import workloads
from bench.run import judge, ratio_interval
from tests.support.scale import compile_worker


def test_an_exact_ratio_has_a_point_interval() -> None:
    rq = [1.0, 1.4, 0.9, 1.2, 1.1, 1.3]
    assert ratio_interval([0.8 * x for x in rq], rq) == pytest.approx([0.8, 0.8])


def test_the_interval_holds_the_ratio_and_widens_with_noise() -> None:
    rng = random.Random(1)
    rq = [1.0 + rng.gauss(0, 0.05) for _ in range(12)]
    quiet = [0.7 + rng.gauss(0, 0.05) for _ in range(12)]
    noisy = [0.7 + rng.gauss(0, 0.5) for _ in range(12)]
    lo_q, hi_q = ratio_interval(quiet, rq)
    lo_n, hi_n = ratio_interval(noisy, rq)
    assert lo_q < 0.7 < hi_q and hi_q < 0.9
    assert hi_n - lo_n > 2 * (hi_q - lo_q)


def test_no_interval_from_too_few_rounds_or_a_slowdown_within_the_noise() -> None:
    assert ratio_interval([1.0, 2.0], [1.0, 1.0]) is None
    assert ratio_interval([1.0] * 6, [0.1, -0.2, 0.1, -0.3, 0.2, -0.1]) is None


@pytest.mark.parametrize("interval, verdict", [([0.6, 0.85], True), ([0.95, 1.3], False), ([0.7, 1.1], None),
                                               (None, True)])
def test_a_target_passes_only_when_the_whole_interval_is_within_it(interval, verdict) -> None:
    assert judge(0.8 if interval is None else sum(interval) / 2, interval, 0.9) is verdict


@pytest.mark.parametrize("ratio, rounds, verdict", [(0.8, 2, True), (2.2, 2, False), (2.2, 6, None), (0.8, 6, None)])
def test_no_interval_from_enough_rounds_is_not_a_verdict(ratio, rounds, verdict) -> None:
    """Two rounds have no interval and the median decides; six rounds with no
    interval means runqlat's slowdown was within the noise (ratio_interval),
    so the median of a noisy ratio decides nothing."""
    assert judge(ratio, None, 1.0, rounds) is verdict


def test_the_ring_switches_once_per_hop(tmp_path: Path) -> None:
    """Counted by the kernel (/proc/stat ctxt), not by the ring itself."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: make setup-test installs gcc")
    exe = compile_worker(tmp_path, workloads.RING_SOURCE)
    w = workloads.ring(exe, tasks=16, laps=200, cpu=0)
    before, t0 = workloads.context_switches(), time.monotonic()
    usecs = w.run()
    wall_ns = (time.monotonic() - t0) * 1e9
    switches = workloads.context_switches() - before
    assert switches >= 16 * 200
    # The result times ns_per_unit is the ring's own duration: within the
    # run's wall time, which adds only the forks and the compiler-free start.
    assert 0.2 * wall_ns < usecs * w.ns_per_unit < wall_ns


def test_workloads_are_chosen_by_their_command_line_names(tmp_path: Path) -> None:
    pinned = workloads.hackbench(4, 10, cpu=1)
    assert (pinned.slug, pinned.pinned) == ("hackbench-pinned", True)
    assert (workloads.hackbench(4, 10).slug, workloads.hackbench(4, 10).pinned) == ("hackbench", False)
    assert workloads.pipe(10, cpu=1).slug == "pipe-pinned"


def test_toggle_compares_each_tool_window_with_the_off_windows_beside_it() -> None:
    from bench.toggle import added_per_switch

    # 1,000 ns a switch with no tool (1e6/s); a tool window at 8e5/s costs 250 ns more a switch.
    seq = [("off", 1e6), ("slatrace", 8e5), ("off", 1e6), ("runqlat", 5e5), ("off", 1e6), ("slatrace", 1e6)]
    added = added_per_switch(seq)
    assert added["slatrace"] == pytest.approx([250.0])     # the last window has no off window after it
    assert added["runqlat"] == pytest.approx([1000.0])
    # Drift cancels: off windows on either side at 1e6 and 5e5 average to 750,000/s.
    assert added_per_switch([("off", 1e6), ("runqlat", 6e5), ("off", 5e5)])["runqlat"] == \
        pytest.approx([(1 / 6e5 - 1 / 7.5e5) * 1e9])


def test_toggle_ratio_interval_holds_the_ratio() -> None:
    from bench.toggle import ratio_of_means

    rng = random.Random(2)
    a = [700 + rng.gauss(0, 300) for _ in range(500)]
    b = [1000 + rng.gauss(0, 300) for _ in range(500)]
    r, lo, hi = ratio_of_means(a, b)
    assert lo < r < hi and lo < 0.7 < hi and hi - lo < 0.15


def test_toggle_takes_several_workloads_and_other_probe_builds(tmp_path: Path) -> None:
    from bench.toggle import parse_args

    (tmp_path / "sched.bpf.c").write_text("/* an older build of the probe */\n")
    args = parse_args(["--workload", "ring, pipe", "--also", str(tmp_path), "--seconds", "10"])
    assert args.workload == ["ring", "pipe"] and args.also == [tmp_path]
    with pytest.raises(SystemExit):
        parse_args(["--workload", "ring,nope"])
    with pytest.raises(SystemExit):
        parse_args(["--also", str(tmp_path / "missing")])


def test_the_rounds_give_each_tools_slowdown_over_the_floors() -> None:
    """Paired per round like the tools: floor +100 ns, slatrace +250, runqlat +400 per switch."""
    from bench.report import total_cost_table
    from bench.run import total_cost

    w = workloads.Workload("pipe (pinned)", "s", ("taskset", "-c", "1", "perf"), 1e9)
    records = []
    for rnd, base in enumerate((1.00, 1.02, 0.98)):   # the host drifts between rounds
        for config, added_ns in (("none", 0), ("slatrace", 250), ("runqlat", 400), ("floor", 100)):
            wall = base + added_ns * 1000 / 1e9        # 1,000 switches a run
            records.append({"round": rnd, "config": config, "switches": {w.name: 1000},
                            "workloads": {w.name: wall}, "workload_cpu_s": {w.name: wall}})
    wall = total_cost(records, (w,))[w.name]["wall"]
    assert wall["added_ns_per_switch"] == pytest.approx({"slatrace": 250, "runqlat": 400, "floor": 100})
    assert wall["floor_ratio"] == pytest.approx({"slatrace": 2.5, "runqlat": 4.0})
    assert wall["floor_ratio_95"]["slatrace"] == pytest.approx([2.5, 2.5])
    res = {"total_cost": total_cost(records, (w,)), "alone": {"summary": {}}}
    assert total_cost_table(res)[2].endswith("| 100 | 2.50x (2.50–2.50) | 4.00x (4.00–4.00) |")
    # rounds without the arm (an older run's records): the table keeps its old columns
    old = total_cost([r for r in records if r["config"] != "floor"], (w,))
    assert "floor" not in old[w.name]["wall"]["added_ns_per_switch"] and not old[w.name]["wall"]["floor_ratio"]
    assert "floor" not in total_cost_table({"total_cost": old, "alone": {"summary": {}}})[0]
