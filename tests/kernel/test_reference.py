"""The tracefs reference against the kernel's own accounting.

Kernel and end-to-end tests trust tests/support/tracefs.py as the exact answer
for the agent; this checks that answer against /proc schedstat and the
context switch counters in /proc status, which the kernel keeps independently
of tracepoints, and the binary decoder against the kernel's own text output.
Loosely against /proc: on these VMs some context switches are never traced,
so tracepoint totals can come out up to ~20% low.
"""

from __future__ import annotations

import time

import pytest

from tests.support.tracefs import (SchedSwitch, TraceEvent, TraceRecorder, parse_lines,
                                   percentile, reference)
from tests.support.workload import (TestCgroup, hog_argv, iowait_argv, read_ctxt_switches,
                                    read_schedstat, victim_argv, wait_zombie)

VICTIM_SECONDS = 5.0
# Bursts longer than the scheduler's slice, so the hogs also take the CPU
# from the victim mid-burst, not only make it wait after each wakeup.
VICTIM_WORK_MS = 2.0


def _ms(ns: float) -> float:
    return ns / 1e6


@pytest.mark.kernel
def test_runq_reference_matches_schedstat(kernel: None) -> None:
    with TestCgroup("noisy") as noisy, TestCgroup("victim") as victim_cg:
        for i in range(4):
            noisy.spawn(hog_argv(cpu=i % 2))  # two hogs per CPU
        time.sleep(0.2)  # let the hogs reach their busy loops
        hog_tids = set(noisy.tids())
        assert len(hog_tids) == 4, hog_tids
        with TraceRecorder() as rec:
            victim = victim_cg.spawn(victim_argv(VICTIM_SECONDS, work_ms=VICTIM_WORK_MS))
            # Recording covers the victim's whole life, from its fork; its
            # schedstat read as a zombie covers the same span.
            wait_zombie(victim.pid, timeout=VICTIM_SECONDS + 30)
            stat = read_schedstat(victim.pid)
            ctxt = read_ctxt_switches(victim.pid)
        assert victim.wait() == 0

    ref = reference(rec.events, stat.keys())
    # How many of those preemptions the "R+" bit alone shows (see reference()).
    ref_plus = reference(rec.events, stat.keys(), r_is_preemption=False)
    ss_wait = sum(s.wait_ns for s in stat.values())
    ss_slices = sum(s.timeslices for s in stat.values())
    nonvol = sum(c.nonvoluntary for c in ctxt.values())
    vol = sum(c.voluntary for c in ctxt.values())
    by_hogs = ref.preemptions_by(hog_tids)
    waits = ref.runq_waits_ns
    print(f"\nevents={len(rec.events)} span={(ref.last_ts - ref.first_ts) / 1e9:.2f}s")
    print(f"victim wait: reference {_ms(ref.total_wait_ns):.1f} ms, schedstat {_ms(ss_wait):.1f} ms "
          f"(ratio {ref.total_wait_ns / max(ss_wait, 1):.3f})")
    print(f"victim waits: reference {len(waits)}, schedstat timeslices {ss_slices} "
          f"(ratio {len(waits) / max(ss_slices, 1):.3f})")
    print(f"switch-outs: involuntary {ref.involuntary_switches} (status {nonvol}), "
          f"voluntary {ref.voluntary_switches} (status {vol})")
    print(f"preemptions: {len(ref.preemptions)}, by hogs {len(by_hogs)} "
          f"({_ms(sum(p.wait_ns for p in by_hogs)):.1f} ms of wait); with R+ alone "
          f"{len(ref_plus.preemptions)}, by hogs {len(ref_plus.preemptions_by(hog_tids))}")
    print(f"gaps: switch_in={ref.untraced_switch_in} switch_out={ref.untraced_switch_out} "
          f"wakeup={ref.untraced_wakeup}; migrations={ref.migrations}")
    if waits:
        print("P50/P95/P99 us: " + " / ".join(f"{percentile(waits, q) / 1e3:.0f}"
                                               for q in (0.5, 0.95, 0.99)))

    assert ss_slices > 100, "the victim hardly ran: the workload is broken"
    assert abs(ref.total_wait_ns - ss_wait) <= 0.3 * ss_wait
    assert abs(len(waits) - ss_slices) <= 0.3 * ss_slices
    assert abs(ref.involuntary_switches - nonvol) <= 0.3 * nonvol
    assert abs(ref.voluntary_switches - vol) <= 0.3 * vol
    assert len(by_hogs) > 0, "the hogs never preempted the victim"


@pytest.mark.kernel
def test_iowait_reference_sees_d_state(kernel: None) -> None:
    with TestCgroup("io") as cg:
        with TraceRecorder() as rec:
            p = cg.spawn(iowait_argv(1.5))
            wait_zombie(p.pid, timeout=30)
        assert p.wait() == 0

    d_outs = sum(1 for e in rec.events
                 if isinstance(e, SchedSwitch) and e.prev_pid == p.pid and e.prev_state == "D")
    ref = reference(rec.events, [p.pid])
    print(f"\nD switch-outs {d_outs}, iowaits {len(ref.iowait_ns)}, gaps {ref.gaps}")
    assert d_outs > 0, "the I/O program never blocked in D state"
    assert ref.iowait_ns, "no D-state wait ended in a traced wakeup"
    print("iowait P50/P99 us: "
          f"{percentile(ref.iowait_ns, 0.5) / 1e3:.0f} / {percentile(ref.iowait_ns, 0.99) / 1e3:.0f}")
    assert len(ref.iowait_ns) <= d_outs


def _fields(ev: TraceEvent) -> tuple:
    return tuple((k, getattr(ev, k)) for k in ev.__dataclass_fields__ if k != "ts_ns")


@pytest.mark.kernel
def test_raw_decoder_matches_the_kernels_text(kernel: None) -> None:
    """Every field the binary decoder reads must equal what the kernel prints."""
    with TestCgroup("decode") as cg:
        # One buffer read twice: as the kernel's text, then as binary pages.
        with TraceRecorder(mode="both", buffer_kb=65536) as rec:
            victim = cg.spawn(victim_argv(1.0))
            io = cg.spawn(iowait_argv(0.5))
            cg.spawn(hog_argv(cpu=0))
            wait_zombie(victim.pid, timeout=30)
            wait_zombie(io.pid, timeout=30)

    raw, text = rec.events, rec.text_events
    kinds = {type(e).__name__ for e in raw}
    print(f"\n{len(raw)} events from pages, {len(text)} from text; {sorted(kinds)}")
    assert {"SchedSwitch", "SchedWakeup", "SchedMigrate"} <= kinds, kinds
    assert len(raw) == len(text)
    assert [_fields(e) for e in raw] == [_fields(e) for e in text]
    # Text rounds to the nearest microsecond (ns2usecs); nothing else may differ.
    assert [(e.ts_ns + 500) // 1000 * 1000 for e in raw] == [e.ts_ns for e in text]
    assert any(e.ts_ns % 1000 for e in raw), "pages lost the nanoseconds"


# Lines as a 6.18 VM prints them (trace_clock mono), with comm values holding
# spaces and dashes; the preemptor 800 was never switched out before, so BPF
# would not know its cgroup yet.
EXCERPT = """\
# tracer: nop
          <idle>-0       [001] dNh4.   640.000100: sched_wakeup_new: comm=my worker pid=700 prio=120 target_cpu=001
 memfd:sealed-91-3280    [001] d..2.   640.000150: sched_switch: prev_comm=memfd:sealed-91 prev_pid=3280 prev_prio=120 prev_state=S ==> next_comm=my worker next_pid=700 next_prio=120
       my worker-700     [001] d..2.   640.000400: sched_switch: prev_comm=my worker prev_pid=700 prev_prio=120 prev_state=R ==> next_comm=hog-1 next_pid=800 next_prio=120
           hog-1-800     [001] d..2.   640.003400: sched_switch: prev_comm=hog-1 prev_pid=800 prev_prio=120 prev_state=R+ ==> next_comm=my worker next_pid=700 next_prio=120
       my worker-700     [001] d..2.   640.003500: sched_switch: prev_comm=my worker prev_pid=700 prev_prio=120 prev_state=D ==> next_comm=swapper/1 next_pid=0 next_prio=120
          <idle>-0       [000] d.s4.   640.004000: sched_migrate_task: comm=my worker pid=700 prio=120 orig_cpu=1 dest_cpu=0
          <idle>-0       [000] dNs5.   640.004500: sched_wakeup: comm=my worker pid=700 prio=120 target_cpu=000
          <idle>-0       [000] dNs5.   640.004510: sched_wakeup: comm=my worker pid=700 prio=120 target_cpu=000
          <idle>-0       [000] d..2.   640.004600: sched_switch: prev_comm=swapper/0 prev_pid=0 prev_prio=120 prev_state=R ==> next_comm=my worker next_pid=700 next_prio=120
       my worker-700     [000] d..2.   640.005000: sched_switch: prev_comm=my worker prev_pid=700 prev_prio=120 prev_state=S ==> next_comm=swapper/0 next_pid=0 next_prio=120
          <idle>-0       [000] d..2.   640.006000: sched_switch: prev_comm=swapper/0 prev_pid=0 prev_prio=120 prev_state=R ==> next_comm=my worker next_pid=700 next_prio=120
       my worker-700     [000] d..2.   640.006100: sched_switch: prev_comm=my worker prev_pid=700 prev_prio=120 prev_state=Z ==> next_comm=swapper/0 next_pid=0 next_prio=120
"""


def test_reference_follows_the_bpf_state_machine() -> None:
    events = parse_lines(EXCERPT.splitlines())
    assert len(events) == 12
    ref = reference(events, [700])
    # new -> 50 us; preempted by 800 (on the way to user space: "R") -> 3000 us;
    # woken twice (the second wakeup changes nothing) -> 100 us
    assert ref.runq_waits_ns == [50_000, 3_000_000, 100_000]
    assert ref.preemptions == [(700, 800, 3_000_000)]
    assert ref.unknown_preemptor == 1
    assert ref.iowait_ns == [1_000_000]
    assert ref.migrations == 1
    # The sleep at 640.005000 ends in a switch-in without a traced wakeup.
    assert (ref.untraced_switch_in, ref.untraced_switch_out, ref.untraced_wakeup) == (0, 0, 1)
    assert ref.first_ts == 640_000_100_000 and ref.last_ts == 640_006_100_000
    assert percentile(ref.runq_waits_ns, 0.5) == 100_000
    assert percentile(ref.runq_waits_ns, 0.99) == 3_000_000
    assert (ref.involuntary_switches, ref.voluntary_switches) == (1, 3)
    plus_only = reference(events, [700], r_is_preemption=False)
    assert plus_only.runq_waits_ns == ref.runq_waits_ns and plus_only.preemptions == []
