"""The exact event stream of a watched cgroup against the in-kernel histogram
of the same cgroup: both are fed by the same switch-ins, so with no drops their
counts and sums must agree to the nanosecond."""

from __future__ import annotations

import time

import pytest

from agent.probe.snapshot import EV_IOWAIT, EV_MIGRATE, EV_PREEMPTED, EV_RUNQ, HIST_IOWAIT, HIST_RUNQ
from tests.support import RING_REFUSALS
from tests.support.workload import TestCgroup, hog_argv, iowait_argv, victim_argv

pytestmark = pytest.mark.kernel


def test_watched_cgroup_events_equal_its_histogram(unlimited_probe):
    probe = unlimited_probe
    with TestCgroup("noisy") as noisy, TestCgroup("victim") as victim:
        probe.watch({victim.id})
        for cpu in (0, 1):
            noisy.spawn(hog_argv(cpu=cpu))
        v = victim.spawn(victim_argv(2.0, sleep_ms=1.0, work_ms=0.3))
        io = victim.spawn(iowait_argv(2.0))
        events = []
        while v.poll() is None or io.poll() is None:
            time.sleep(0.1)
            events += probe.drain_events()
        time.sleep(0.1)
        events += probe.drain_events()
        snap = probe.snapshot()
        noise_events = [e for e in events if e.cgid != victim.id]

    runq = [e for e in events if e.cgid == victim.id and e.kind in (EV_RUNQ, EV_PREEMPTED)]
    iow = [e for e in events if e.cgid == victim.id and e.kind == EV_IOWAIT]
    hist = snap.hists[(victim.id, HIST_RUNQ)]
    # A record the ring buffer refused (RING_REFUSALS) is counted, never
    # silent: the stream is then short by that record's waits.
    lost = snap.errors["events"]
    assert lost <= RING_REFUSALS and snap.errors["events_rate_limited"] == 0, snap.errors
    assert noise_events == []  # only the watched cgroup streams
    io_hist = snap.hists[(victim.id, HIST_IOWAIT)]
    streamed = (sum(e.waits for e in runq), sum(e.waited_ns for e in runq), len(iow),
                sum(e.end_ns - e.start_ns for e in iow), sum(1 for e in events if e.kind == EV_MIGRATE))
    counted = (sum(b.count for b in hist.values()), sum(b.sum_ns for b in hist.values()),
               sum(b.count for b in io_hist.values()), sum(b.sum_ns for b in io_hist.values()),
               snap.cgroups[victim.id].migrations)
    assert counted[0] > 1000 and counted[2] > 0
    if not lost:
        assert streamed == counted
    else:
        # One record: a run-queue wait, or short ones merged (within 1 ms of
        # the first, each under 0.1 ms), an I/O wait or a migration;
        # everything else one for one.
        short = [c - s for s, c in zip(streamed, counted)]
        assert all(d >= 0 for d in short), (streamed, counted)
        runq_short = (short[0] == 1 or 0 < short[1] <= 1_100_000) and short[2:] == [0, 0, 0]
        io_short = short[:2] == [0, 0] and short[2] == 1 and short[4] == 0
        migrate_short = short[:4] == [0, 0, 0, 0] and short[4] == 1
        assert runq_short or io_short or migrate_short, (streamed, counted)
    # preempted waits carry their preemptor: here almost all are the hogs
    pre = [e for e in runq if e.kind == EV_PREEMPTED]
    assert pre and all(e.end_ns >= e.start_ns for e in pre)


def test_only_watched_cgroups_stream(probe):
    """The busy host streams nothing while an idle cgroup is the only one watched."""
    with TestCgroup("idle") as idle:
        probe.watch({idle.id})
        probe.snapshot()
        time.sleep(0.5)
        events = probe.drain_events()
        after = probe.snapshot()  # drained: the counts of the last 0.5 s
        probe.watch(set())
    host_runs = sum(b.count for (cg, kind), h in after.hists.items() if kind == HIST_RUNQ for b in h.values())
    assert host_runs > 0 and events == []


def test_kernel_threads_are_counted_apart_from_host(probe_each_mode):
    """Waits of kernel threads (recognised by PF_KTHREAD on raw tracepoints,
    marked at start-up on classic ones, or forked by kthreadd) land on the
    kernel pseudo cgroup; their number matches the tracefs reference for the
    same tids over the same span."""
    from agent.identity.kthreads import kernel_thread_tids
    from agent.probe.snapshot import KERNEL_CGID
    from tests.support.tracefs import TraceRecorder, reference
    from tests.support.workload import iowait_argv

    probe = probe_each_mode
    kthreads = kernel_thread_tids()
    assert len(kthreads) > 10
    assert probe.mark_kernel_threads(kthreads) == (len(kthreads) if probe.mode == "classic" else 0)
    time.sleep(0.3)  # every marked thread switches out once: its state is known
    with TestCgroup("io") as io:
        with TraceRecorder() as rec:
            probe.snapshot()
            io.spawn(iowait_argv(2.0)).wait(timeout=30)  # flushes wake kworkers
            after = probe.snapshot()  # drained: what happened between the two
    agent_waits = sum(b.count for b in after.hists.get((KERNEL_CGID, HIST_RUNQ), {}).values())
    # The reference over the recording (which brackets the two snapshots by a
    # few milliseconds), for the kernel threads and any kthreadd forked meanwhile.
    ref = reference(rec.events, set(kthreads) | set(kernel_thread_tids()))
    print(f"\nkernel-thread waits: agent {agent_waits}, reference {len(ref.runq_waits_ns)}")
    assert agent_waits > 20
    assert agent_waits == pytest.approx(len(ref.runq_waits_ns), rel=0.10)


def test_a_spinning_loops_waits_merge_and_hold_every_wait(unlimited_probe):
    """Two threads yielding to each other on one CPU: the stream carries
    their short waits merged, many to a record, with nothing lost against the
    histogram of every wait, and each record holds exactly the waits tracefs
    saw inside it (tests/support/merged.py; each kernel of the matrix too)."""
    from tests.support import merged

    doc = merged.measure(unlimited_probe)
    print("\n" + merged.summary(doc))
    merged.judge(doc, "host", emulated=False)


# Two processes take turns over two pipes; each writes only once the other
# sleeps in read() (its state and system call, from /proc), so every write
# wakes it, however loaded the machine. Each is pinned to its own CPU, left
# idle while it sleeps: the kernel then queues the wake-up to that CPU and
# traces sched_wakeup there, in an interrupt, not in the waker. A thread of
# the parent runs beside its main thread (wake-ups inside one process, which
# must not stream).
PING_PONG = r"""
import os, platform, sys, threading, time
n = int(sys.argv[1])
cpus = sorted(os.sched_getaffinity(0))
a_r, a_w = os.pipe()
b_r, b_w = os.pipe()
READ = {"x86_64": "0", "aarch64": "63"}[platform.machine()]

def asleep(pid):
    while (open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "S"
           or open(f"/proc/{pid}/syscall").read().split()[0] != READ):
        time.sleep(0.0002)

parent = os.getpid()
child = os.fork()
if child == 0:
    os.sched_setaffinity(0, {cpus[-1]})
    for _ in range(n):
        os.read(a_r, 1)
        asleep(parent)
        os.write(b_w, b"x")
    os._exit(0)
os.sched_setaffinity(0, {cpus[0]})
ev = threading.Event()
def poke():
    for _ in range(n):
        time.sleep(0.002)
        ev.set()
t = threading.Thread(target=poke)
t.start()
for _ in range(n):
    asleep(child)
    os.write(a_w, b"x")
    os.read(b_r, 1)
t.join()
os.waitpid(child, 0)
print(child, flush=True)
"""


@pytest.mark.parametrize("unlimited_probe_each_mode", ["btf", "raw", "classic"], indirect=True)
def test_wake_ups_across_processes_name_the_waking_process(unlimited_probe_each_mode):
    """A wake-up of a watched thread by another process of a watched service
    streams as EV_WAKE naming the waking process (other_cgid) and the woken
    thread: one per turn each way, as the scene makes them, none inside a
    process. Classic tracepoints cannot tell the woken task's process: none."""
    import subprocess

    from agent.probe.snapshot import EV_WAKE
    from tests.support.workload import PYTHON

    probe, turns = unlimited_probe_each_mode, 300
    with TestCgroup("pingpong") as cg:
        probe.watch({cg.id})
        proc = cg.spawn([PYTHON, "-c", PING_PONG, str(turns)], stdout=subprocess.PIPE, text=True)
        out, _ = proc.communicate(timeout=60)
        time.sleep(0.1)
        events = probe.drain_events()
        snap = probe.snapshot()
    parent, child = proc.pid, int(out.split()[0])
    wakes = [(e.other_cgid, e.tid) for e in events if e.kind == EV_WAKE]
    print(f"\n{probe.mode}: {len(wakes)} wake-ups across processes; parent woke child "
          f"{wakes.count((parent, child))}, child woke parent {wakes.count((child, parent))} of {turns} turns")
    assert snap.errors["events"] == 0 and snap.errors["events_rate_limited"] == 0
    if probe.mode == "classic":
        assert wakes == []
        return
    # Beside the turns, the child's exit wakes the parent in waitpid(): one
    # more at most (and the fork wakes the child, on sched_wakeup_new, not
    # streamed).
    assert wakes.count((parent, child)) == turns
    assert turns <= wakes.count((child, parent)) <= turns + 1
    # None inside a process: the main threads were woken only by the other
    # process. (A timer's wake-up of the parent's other thread, taken in an
    # interrupt while the child ran, names the child: the kernel's current
    # task is the only waker the tracepoint knows.)
    assert {waker for waker, _ in wakes} <= {parent, child}
    assert (parent, parent) not in wakes and (child, child) not in wakes


def _run_cnt(fd: int) -> int:
    """The kernel's count of a program's runs (while run-time statistics are on)."""
    for line in open(f"/proc/self/fdinfo/{fd}").read().splitlines():
        if line.startswith("run_cnt:"):
            return int(line.split()[1])
    return 0


@pytest.mark.parametrize("unlimited_probe_each_mode", ["btf", "raw"], indirect=True)
def test_the_waker_program_runs_only_while_a_service_is_watched(unlimited_probe_each_mode):
    """sched_waking serves only the event stream: the kernel runs it (its
    own run count, BPF_ENABLE_STATS) while a service is watched, never
    before the first watch or after the last."""
    import os
    import subprocess

    from agent.bpf_stats import enable_run_time_stats
    from agent.probe.snapshot import EV_WAKE
    from tests.support.workload import PYTHON

    probe, turns = unlimited_probe_each_mode, 50
    fd = probe.program_fds()["sched_waking"]
    stats = enable_run_time_stats()
    try:
        with TestCgroup("pingpong") as cg:
            def runs_over_a_scene() -> int:
                before = _run_cnt(fd)
                proc = cg.spawn([PYTHON, "-c", PING_PONG, str(turns)], stdout=subprocess.PIPE, text=True)
                proc.communicate(timeout=60)
                return _run_cnt(fd) - before

            unwatched = runs_over_a_scene()
            probe.watch({cg.id})
            watched = runs_over_a_scene()
            time.sleep(0.1)
            wakes = [e for e in probe.drain_events() if e.kind == EV_WAKE]
            probe.watch(set())
            after = runs_over_a_scene()
    finally:
        os.close(stats)
    print(f"\n{probe.mode}: sched_waking ran {unwatched} times unwatched, {watched} watched, {after} after; "
          f"{len(wakes)} wake-ups across processes streamed")
    assert unwatched == 0 and after == 0
    # Every wake-up on the machine runs it while attached: at least the
    # scene's two per turn, each streamed.
    assert watched >= 2 * turns and len(wakes) >= 2 * turns
