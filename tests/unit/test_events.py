"""EventLog window cuts against a brute-force overlap computation."""

import ctypes as ct
import random

import numpy as np

from agent.probe import layout
from agent.probe.snapshot import (EV_IOWAIT, EV_MIGRATE, EV_PREEMPTED, EV_RUNQ, EVENT_ROW, SchedEvent, event_rows,
                                  events_of)
from agent.store.events import EventLog


def _brute(events, cgids, lo, hi):
    runq = iowait = pre = mig = 0
    by = {}
    behind = {}
    for e in events:
        if e.cgid not in cgids:
            continue
        if e.kind == EV_MIGRATE:
            mig += lo <= e.end_ns <= hi
            continue
        ov = min(e.end_ns, hi) - max(e.start_ns, lo)
        if ov < 0:
            continue
        if e.kind == EV_IOWAIT:
            iowait += ov
        else:
            runq += ov
            if e.kind == EV_PREEMPTED:
                pre += 1
                by[e.other_cgid] = by.get(e.other_cgid, 0) + ov
            else:
                behind[e.other_cgid] = behind.get(e.other_cgid, 0) + ov
    return runq, iowait, pre, by, behind, mig


def _events(n, seed=1):
    rng = random.Random(seed)
    t = 1_000_000_000
    out = []
    for _ in range(n):
        t += rng.randint(1_000, 200_000)
        kind = rng.choice([EV_RUNQ, EV_RUNQ, EV_PREEMPTED, EV_IOWAIT, EV_MIGRATE])
        dur = 0 if kind == EV_MIGRATE else rng.randint(500, 5_000_000)
        cg = rng.choice([10, 11, 12])
        # arrival order = end order with a little cross-CPU jitter
        end = t + rng.randint(0, 20_000)
        other = rng.choice([0, 11, 12]) if kind in (EV_PREEMPTED, EV_RUNQ) else 0
        out.append(SchedEvent(cg, kind, end - dur, end, other, 7))
    return out


def test_window_cut_equals_brute_force():
    events = _events(20_000)
    log = EventLog(retention_ns=10**12)
    for i in range(0, len(events), 997):  # batches, as drained
        log.add(events[i:i + 997])
    rng = random.Random(2)
    for _ in range(50):
        lo = rng.randint(events[0].start_ns, events[-1].end_ns)
        hi = lo + rng.randint(1_000_000, 500_000_000)
        cgids = {10, 12} if rng.random() < 0.5 else {11}
        f = log.between(cgids, lo, hi)
        runq, iowait, pre, by, behind, mig = _brute(events, cgids, lo, hi)
        assert (f.runq_wait_ns, f.iowait_ns, f.preemptions, f.migrations) == (runq, iowait, pre, mig)
        assert {k: v for k, v in f.preempted_by.items() if v} == {k: v for k, v in by.items() if v}
        assert {k: v for k, v in f.behind.items() if v} == {k: v for k, v in behind.items() if v}


def test_retention_and_cap_drop_the_oldest():
    events = _events(5_000)
    log = EventLog(retention_ns=100_000_000)
    log.add(events)
    newest = max(e.end_ns for e in events)
    kept = [e for e in events if e.end_ns >= newest - 100_000_000]
    assert len(log) == len(kept)
    capped = EventLog(retention_ns=10**12, max_events=1_000)
    capped.add(events)
    assert len(capped) <= 1_000 and capped.dropped == len(events) - len(capped)


def test_waits_by_thread_equal_brute_force_and_sum_to_the_runq_wait():
    rng = random.Random(5)
    events = [SchedEvent(e.cgid, e.kind, e.start_ns, e.end_ns, e.other_cgid, rng.choice([101, 102, 103, 104]))
              for e in _events(20_000, seed=3)]
    log = EventLog(retention_ns=10**12)
    for i in range(0, len(events), 997):  # batches, as drained: some end before the last batch's last
        log.add(event_rows(events[i:i + 997]))
    for _ in range(30):
        lo = rng.randint(events[0].start_ns, events[-1].end_ns)
        hi = lo + rng.randint(1_000_000, 500_000_000)
        cgids = {10, 12}
        want: dict[int, int] = {}
        for e in events:
            if e.cgid in cgids and e.kind in (EV_RUNQ, EV_PREEMPTED):
                ov = min(e.end_ns, hi) - max(e.start_ns, lo)
                if ov > 0:
                    want[e.tid] = want.get(e.tid, 0) + ov
        got = log.waits_by_thread(cgids, lo, hi)
        assert got == want
        assert sum(got.values()) == log.between(cgids, lo, hi).runq_wait_ns


def test_thread_columns_of_dead_threads_are_dropped_with_their_events():
    log = EventLog(retention_ns=1_000_000)
    log.add([SchedEvent(10, EV_RUNQ, 0, 10, 0, tid) for tid in range(1, 500)])
    log.add([SchedEvent(10, EV_RUNQ, 5_000_000, 5_000_010, 0, 7)])  # the others age out
    assert log.waits_by_thread({10}, 0, 10**9) == {7: 10}
    assert len(log._cgroups[10]) == 2   # one (kind, other) column and one thread's


def test_thread_waits_keep_kind_and_culprit_in_end_order_and_clip():
    # Submitted out of order, as CPUs fill the ring buffer: each wait keeps its own kind and culprit.
    log = EventLog(retention_ns=10**12)
    log.add([SchedEvent(10, EV_RUNQ, 100, 200, 0, 7), SchedEvent(10, EV_PREEMPTED, 300, 400, 11, 7),
             SchedEvent(10, EV_PREEMPTED, 210, 250, 12, 7), SchedEvent(10, EV_RUNQ, 50, 500, 13, 8)])
    assert log.thread_waits({10}, 150, 350) == {7: [(150, 200, EV_RUNQ, 0, 50), (210, 250, EV_PREEMPTED, 12, 40),
                                                     (300, 350, EV_PREEMPTED, 11, 50)],
                                                8: [(150, 350, EV_RUNQ, 13, 200)]}
    assert log.thread_waits({10}, 600, 700) == {} and log.thread_waits({99}, 0, 1000) == {}


def test_event_rows_have_the_ring_buffer_records_layout_and_round_trip():
    # The drain reads the records' bytes as EVENT_ROW.
    raw = layout.SchedEvent(cgid=2**63 + 5, other_cgid=11, start_ns=100, end_ns=250, wait_ns=150, tid=4_000_000,
                            kind=EV_PREEMPTED, waits=1)
    (row,) = events_of(np.frombuffer(ct.string_at(ct.addressof(raw), ct.sizeof(raw)), dtype=EVENT_ROW))
    assert row == SchedEvent(2**63 + 5, EV_PREEMPTED, 100, 250, 11, 4_000_000)
    events = _events(300)
    assert events_of(event_rows(events)) == events


def _spinner(n, seed=3):
    """A spinning thread's short preempted waits behind one culprit, as the
    kernel streams them one by one, and as it merges them (bpf/sched.bpf.c
    stream_wait(): each under 100 µs, no record over 1 ms)."""
    rng = random.Random(seed)
    t = 1_000_000_000
    waits = []
    for _ in range(n):
        t += rng.randint(1_000, 5_000)                  # ran
        w = rng.randint(500, 90_000)                    # waited
        waits.append((t, t + w))
        t += w
    merged, group = [], []
    for s, e in waits + [(None, None)]:
        if group and (s is None or e - group[0][0] > 1_000_000):
            merged.append(SchedEvent(10, EV_PREEMPTED, group[0][0], group[-1][1], 12, 7,
                                     sum(b - a for a, b in group), len(group)))
            group = []
        if s is not None:
            group.append((s, e))
    return [SchedEvent(10, EV_PREEMPTED, s, e, 12, 7) for s, e in waits], merged


def test_merged_waits_cut_like_the_waits_they_hold_at_record_edges_and_in_proportion_inside():
    single, merged = _spinner(3_000)
    assert sum(m.waits for m in merged) == len(single) and len(merged) < len(single) / 5
    one, many = EventLog(retention_ns=10**12), EventLog(retention_ns=10**12)
    one.add(single)
    many.add(merged)
    total = sum(e.end_ns - e.start_ns for e in single)
    everything = (0, 2 * 10**12)
    assert many.between({10}, *everything).runq_wait_ns == one.between({10}, *everything).runq_wait_ns == total
    assert many.between({10}, *everything).preemptions == len(single)
    assert many.waits_by_thread({10}, *everything) == {7: total}
    # A window whose edges fall between records: the same figures exactly.
    lo, hi = merged[3].end_ns, merged[-4].end_ns
    a, b = one.between({10}, lo, hi), many.between({10}, lo, hi)
    assert (a.runq_wait_ns, a.preemptions, a.preempted_by) == (b.runq_wait_ns, b.preemptions, b.preempted_by)
    # Edges inside records: off by less than the waits of the two records cut.
    lo = (merged[3].start_ns + merged[3].end_ns) // 2
    hi = (merged[-4].start_ns + merged[-4].end_ns) // 2
    a, b = one.between({10}, lo, hi), many.between({10}, lo, hi)
    assert abs(a.runq_wait_ns - b.runq_wait_ns) <= merged[3].wait_ns + merged[-4].wait_ns
    assert abs(a.preemptions - b.preemptions) <= merged[3].waits + merged[-4].waits
    (waits,) = many.thread_waits({10}, lo, hi).values()
    assert sum(w for *_, w in waits) == b.runq_wait_ns
    assert waits[0][0] == lo and waits[-1][1] == hi
    # Out of order by a few µs, as CPUs submit: the totals stay right.
    late = EventLog(retention_ns=10**12)
    late.add(merged[:10] + merged[11:20])
    late.add([merged[10]] + merged[20:])
    assert late.between({10}, *everything).runq_wait_ns == total
    assert late.between({10}, *everything).preemptions == len(single)
