"""One scene for probes attached side by side: CPU hogs, a victim that sleeps
and works in short turns, and a reader blocked in I/O, each in a cgroup of
its own, with the tracefs reference recorded over the victim's life."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import pytest

from agent.probe.snapshot import HIST_IOWAIT, HIST_RUNQ
from tests.support.tracefs import Reference, TraceRecorder, reference
from tests.support.workload import TestCgroup, hog_argv, iowait_argv, victim_argv, wait_zombie


def victim_figures(snap, cgid: int) -> dict[str, int]:
    """A cgroup's run-queue and I/O waits and its preemptions, from one snapshot."""
    runq = snap.hists.get((cgid, HIST_RUNQ), {})
    io = snap.hists.get((cgid, HIST_IOWAIT), {})
    preempted = [p for (v, _), p in snap.pairs.items() if v == cgid]
    return {"runq_count": sum(b.count for b in runq.values()), "runq_ns": sum(b.sum_ns for b in runq.values()),
            "io_count": sum(b.count for b in io.values()), "preemptions": sum(p.count for p in preempted),
            "preempted_ns": sum(p.wait_ns for p in preempted)}


@dataclass
class SceneResult:
    victim: dict        # probe's key -> victim_figures() of the victim
    io_counts: dict     # probe's key -> I/O waits of the reader's cgroup
    reference: Reference


def run_scene(probes: dict) -> SceneResult:
    """Run the scene once under every probe (key -> Probe) at the same time."""
    with TestCgroup("noisy") as noisy, TestCgroup("victim") as victim_cg, TestCgroup("io") as io_cg:
        for i in range(4):
            noisy.spawn(hog_argv(cpu=i % 2))
        time.sleep(0.3)
        for p in probes.values():
            p.snapshot()
        with TraceRecorder() as rec:
            v = victim_cg.spawn(victim_argv(3.0, sleep_ms=1.0, work_ms=2.0))
            io = io_cg.spawn(iowait_argv(2.0))
            wait_zombie(v.pid, timeout=40)
            tids = {int(t) for t in os.listdir(f"/proc/{v.pid}/task")}
            io.wait(timeout=40)
        time.sleep(0.05)
        snaps = {k: p.snapshot() for k, p in probes.items()}
        got = {k: victim_figures(s, victim_cg.id) for k, s in snaps.items()}
        io_counts = {k: victim_figures(s, io_cg.id)["io_count"] for k, s in snaps.items()}
        v.wait()
    return SceneResult(got, io_counts, reference(rec.events, tids))


def assert_each_matches_the_reference(scene: SceneResult) -> None:
    """Every probe counted the victim's waits and preemptions as the tracefs reference did."""
    ref = scene.reference
    assert len(ref.runq_waits_ns) > 200 and len(ref.preemptions) > 20
    for k, fig in scene.victim.items():
        assert fig["runq_count"] == pytest.approx(len(ref.runq_waits_ns), rel=0.03), k
        assert fig["runq_ns"] == pytest.approx(ref.total_wait_ns, rel=0.03), k
        assert fig["preemptions"] == pytest.approx(len(ref.preemptions), rel=0.05), k
        assert scene.io_counts[k] > 10, k


def assert_agree(scene: SceneResult, key, other) -> None:
    """Two probes of the scene gave the same figures, but for the few events
    at the edges of their snapshots, taken one after the other."""
    for f in ("runq_count", "runq_ns", "preemptions", "preempted_ns"):
        assert scene.victim[key][f] == pytest.approx(scene.victim[other][f], rel=0.02, abs=3), (key, f)
    assert scene.io_counts[key] == pytest.approx(scene.io_counts[other], rel=0.02, abs=3), key
