"""A request's delay: the wall-clock union of the waits of the threads that
carry its work, split by culprit — against figures computed by hand."""

from __future__ import annotations

import random
import time

import pytest

from agent.attribution.critical_path import clip, critical_delay
from agent.attribution.request_sched import EventSched, capped_delay
from agent.attribution.request_span import RequestSpan
from agent.attribution.requests import phase_windows, request_document
from agent.identity.threads import ThreadNames
from agent.probe.snapshot import EV_LIMIT, EV_PREEMPTED, EV_RUNQ, EV_WAKE, SchedEvent
from agent.store.events import EventLog

MS = 1_000_000


def test_union_and_split_by_hand():
    # Window [0, 100] ms. The step loop A waits 10-30 (batch preempted it) and
    # 50-60 (woke to an idle CPU); the event loop B waits 20-40 behind the
    # service's own threads; the helper C waits the whole window.
    waits = {1: [(10 * MS, 30 * MS, "batch"), (50 * MS, 60 * MS, "idle")],
             2: [(20 * MS, 40 * MS, "vllm")],
             3: [(0, 100 * MS, "batch")]}
    d = critical_delay(waits, threads=[1, 2])
    # Union: [10, 40] + [50, 60] = 40 ms (thread-seconds of A and B: 50 ms; of all three: 150 ms).
    assert d.seconds == pytest.approx(0.040)
    # 10-20 batch alone; 20-30 batch and vllm at once, 5 ms each; 30-40 vllm; 50-60 idle.
    assert d.by == (("batch", pytest.approx(0.015)), ("vllm", pytest.approx(0.015)), ("idle", pytest.approx(0.010)))
    # Told which service they belong to: B's wait behind its own threads fell
    # while the helper was kept waiting by batch, so it was batch's CPU in the end.
    chained = critical_delay(waits, threads=[1, 2], own="vllm")
    assert chained.seconds == pytest.approx(0.040)
    assert chained.by == (("batch", pytest.approx(0.030)), ("idle", pytest.approx(0.010)))
    # With the helper: the whole window, never more.
    everyone = critical_delay(waits, threads=[1, 2, 3])
    assert everyone.seconds == pytest.approx(0.100)
    # 0-10 C; 10-20 A+C (both batch); 20-30 A, B, C: 2/3 batch + 1/3 vllm; 30-40 B+C; 40-50 C; 50-60 A+C; 60-100 C.
    assert dict(everyone.by) == pytest.approx({"batch": (10 + 10 + 20 / 3 + 5 + 10 + 5 + 40) / 1e3,
                                               "vllm": (10 / 3 + 5) / 1e3, "idle": 5 / 1e3})


def test_the_limit_defers_to_a_neighbour_holding_another_of_the_requests_threads():
    # Window [0, 100] ms. The model thread A waits 0-60 behind batch, on the
    # CPU batch shares with it; B, the service's thread on the other CPU,
    # sits throttled by the service's own limit 20-80.
    waits = {1: [(0, 60 * MS, "batch")], 2: [(20 * MS, 80 * MS, "cpu_limit")]}
    d = critical_delay(waits, threads=[1, 2], own="vllm")
    # 0-60 batch (20-60 too: A cannot run before batch lets it, limit or not); 60-80 the limit alone.
    assert d.seconds == pytest.approx(0.080)
    assert d.by == (("batch", pytest.approx(0.060)), ("cpu_limit", pytest.approx(0.020)))
    # Not told which service the threads are: no one to defer to, an even split.
    assert dict(critical_delay(waits, threads=[1, 2]).by) == pytest.approx({"batch": 0.040, "cpu_limit": 0.040})
    # A helper outside the request's threads waiting behind batch changes nothing for the limit.
    helper = {**waits, 1: [], 3: [(0, 100 * MS, "batch")]}
    assert critical_delay(helper, threads=[1, 2], own="vllm").by == (("cpu_limit", pytest.approx(0.060)),)
    # Idle CPUs, the kernel and unknown culprits are no neighbours: the limit keeps its half.
    for other in ("idle", "kernel", "unknown"):
        alone = critical_delay({1: [(20 * MS, 80 * MS, other)], 2: waits[2]}, threads=[1, 2], own="vllm")
        assert dict(alone.by) == pytest.approx({other: 0.030, "cpu_limit": 0.030})


def test_a_poll_is_charged_only_where_no_work_waits():
    # Window [0, 100] ms. The worker W polls (yields) behind batch 0-60 for
    # the step the engine core E makes; E sits throttled by the service's
    # limit 20-80. W's polling holds nothing E's step does not: 20-60 is the
    # limit's, and W does not make batch hold the request against it.
    polls = {1: [(0, 60 * MS, "batch", 60 * MS, True)], 2: [(20 * MS, 80 * MS, "cpu_limit")]}
    d = critical_delay(polls, threads=[1, 2], own="vllm")
    assert d.seconds == pytest.approx(0.080)
    assert d.by == (("cpu_limit", pytest.approx(0.060)), ("batch", pytest.approx(0.020)))
    # The same wait not a poll: batch holds W's work (the limit defers to it).
    work = {1: [(0, 60 * MS, "batch", 60 * MS, False)], 2: polls[2]}
    assert critical_delay(work, threads=[1, 2], own="vllm").by == (("batch", pytest.approx(0.060)),
                                                                     ("cpu_limit", pytest.approx(0.020)))
    # A poll alone is charged to whoever ran instead; two polls split evenly.
    alone = {1: [(0, 60 * MS, "batch", 60 * MS, True)], 2: [(30 * MS, 90 * MS, "kernel", 60 * MS, True)]}
    d = critical_delay(alone, threads=[1, 2], own="vllm")
    assert d.seconds == pytest.approx(0.090)
    assert dict(d.by) == pytest.approx({"batch": 0.045, "kernel": 0.045})
    # A wait behind the service's own thread goes to a neighbour keeping
    # another of its threads from work, not from polling (a data-parallel
    # engine core spinning on the neighbour's CPU while another serves).
    sibling = {1: [(0, 10 * MS, "vllm")], 5: [(0, 10 * MS, "batch", 10 * MS, True)]}
    assert critical_delay(sibling, threads=[1], own="vllm").by == (("vllm", pytest.approx(0.010)),)
    sibling[5] = [(0, 10 * MS, "batch", 10 * MS, False)]
    assert critical_delay(sibling, threads=[1], own="vllm").by == (("batch", pytest.approx(0.010)),)
    # Clipping keeps the flag.
    assert clip(polls[1], 10 * MS, 20 * MS) == [(10 * MS, 20 * MS, "batch", 10 * MS, True)]


def test_touching_and_empty_waits():
    assert critical_delay({1: [(0, 10, "a"), (10, 20, "b")], 2: [(5, 5, "c")]}, [1, 2]).seconds == pytest.approx(20e-9)
    assert critical_delay({}, [1]).seconds == 0.0 and critical_delay({}, [1]).by == ()


def test_never_more_than_the_window_and_the_split_adds_up():
    rng = random.Random(7)
    for _ in range(200):
        window = rng.randrange(1, 10**6)
        waits = {}
        for tid in range(rng.randrange(1, 60)):
            t, ws = 0, []
            while t < window:
                start = t + rng.randrange(0, window // 4 + 1)
                end = min(window, start + rng.randrange(0, window // 3 + 1))
                if start < end:
                    ws.append((start, end, rng.choice(["batch", "idle", "vllm"])))
                t = end + 1
            waits[tid] = ws
        d = critical_delay(waits, waits)
        assert d.seconds <= window / 1e9 + 1e-15
        assert sum(s for _, s in d.by) == pytest.approx(d.seconds, abs=1e-15)
        if window < 5000:  # small enough to count every covered nanosecond
            covered = {t for ws in waits.values() for s, e, _ in ws for t in range(s, e)}
            assert d.seconds == pytest.approx(len(covered) / 1e9)
        assert list(d.by) == sorted(d.by, key=lambda kv: kv[1], reverse=True)


class Fallback:
    def covered_until(self) -> float:
        return 0.0

    def between(self, service, start, end, front=None, phases=()):
        raise AssertionError("exact figures expected")


def engine_scene() -> tuple[EventSched, float]:
    """An engine's waits over a 100 ms request starting at the returned wall time.

    Two processes of one service: an engine (pid 100: its loop 100 and an
    output thread 101, both named like it, and gloo's TCP loop 102) and an
    API server (pid 200). Other cgroups: 11 = batch; 0 = idle when woken.
    """
    names = {100: (100, "VLLM::EngineCor", "VLLM::EngineCor"), 101: (100, "VLLM::EngineCor", "VLLM::EngineCor"),
             102: (100, "VLLM::EngineCor", "gloo_tcp_loop"), 200: (200, "vllm", "vllm")}
    log = EventLog(retention_ns=10**15)
    base = time.monotonic_ns() - 200 * MS
    log.add([SchedEvent(10, EV_PREEMPTED, base + 10 * MS, base + 30 * MS, 11, 100),   # loop preempted by batch
             SchedEvent(10, EV_RUNQ, base + 20 * MS, base + 25 * MS, 0, 200),          # API woke to an idle CPU
             SchedEvent(10, EV_RUNQ, base + 40 * MS, base + 50 * MS, 10, 101),         # behind its own threads
             SchedEvent(10, EV_RUNQ, base + 0 * MS, base + 45 * MS, 11, 102),          # the helper: not counted,
             SchedEvent(10, EV_RUNQ, base + 50 * MS, base + 95 * MS, 11, 102),         # but it says who held the CPU
             SchedEvent(10, EV_PREEMPTED, base + 95 * MS, base + 120 * MS, 11, 100)])  # straddles the end
    return watching(log, names, {10: "vllm", 11: "batch"}), wall(base)


def watching(log: EventLog, names: dict, services: dict[int, str], parents: dict | None = None) -> EventSched:
    """An EventSched over `log` that has watched service "vllm" (cgroup 10) from the start."""
    sched = EventSched(log, lambda s: {10}, services.__getitem__, Fallback(), thread_names=names.get,
                       parent_of=(parents or {}).get)
    sched.pin({"vllm"})
    sched.watched_cgroups()
    sched._watching["vllm"] = 0.0
    return sched


def wall(mono_ns: int) -> float:
    return (mono_ns + time.time_ns() - time.monotonic_ns()) / 1e9


def test_event_sched_counts_the_threads_named_like_their_process():
    sched, start = engine_scene()
    got = sched.between("vllm", start, start + 0.100)
    # Thread-seconds: 20 + 5 + 10 + 45 + 45 + 5 = 130 ms, more than the 100 ms request.
    assert got.runq_wait_seconds == pytest.approx(0.130, abs=2e-6)
    # Delay: [10, 30] + [40, 50] + [95, 100] = 35 ms (the API's 20-25 lies inside the loop's wait).
    assert got.delay_seconds == pytest.approx(0.035, abs=2e-6)
    # 10-20 batch; 20-25 batch and idle, 2.5 ms each; 25-30 batch; 40-50 behind its own thread, of which
    # 40-45 while the helper was kept waiting by batch (batch's), 45-50 its own; 95-100 batch.
    assert got.delay_by == (("batch", pytest.approx(0.0275, abs=2e-6)), ("vllm", pytest.approx(0.005, abs=2e-6)),
                            ("idle", pytest.approx(0.0025, abs=2e-6)))
    assert got.delay_threads == 3
    doc = got.as_dict()
    assert doc["runq_thread_seconds"] == doc["runq_wait_seconds"] == got.runq_wait_seconds
    assert doc["delay_by"][0] == {"service": "batch", "cause": "neighbour", "seconds": pytest.approx(0.0275, abs=2e-6)}
    # The by-thread view still shows every thread's waits, the helper's first.
    assert got.by_thread[0][:3] == (100, "VLLM::EngineCor", "gloo_tcp_loop")


def test_prorated_figures_cap_the_thread_seconds_at_the_duration():
    # 0.5 s of waits (0.3 batch, 0.1 idle, 0.1 without culprit) in a 0.2 s request.
    delay, by = capped_delay(0.5, {"batch": 0.3}, {"idle": 0.1}, 0.2)
    assert delay == pytest.approx(0.2)
    assert by == (("batch", pytest.approx(0.12)), ("idle", pytest.approx(0.04)), ("unknown", pytest.approx(0.04)))
    assert capped_delay(0.05, {"batch": 0.05}, {}, 0.2) == (0.05, (("batch", pytest.approx(0.05)),))


def test_phase_windows_follow_each_other_from_the_start():
    span = RequestSpan("r", "ab" * 16, "cd" * 8, None, 100.0, 101.8, 1.8, ttft=0.4, queue=0.05, prefill=0.3,
                       decode=1.4)
    assert phase_windows(span) == [("queue", 100.0, pytest.approx(100.05)),
                                   ("prefill", pytest.approx(100.05), pytest.approx(100.35)),
                                   ("decode", pytest.approx(100.35), pytest.approx(101.75))]
    # A phase reaching past the end is cut there; absent ones are left out.
    late = RequestSpan("r", "ab" * 16, "cd" * 8, None, 100.0, 100.5, 0.5, queue=None, prefill=0.3, decode=0.4)
    assert phase_windows(late) == [("prefill", 100.0, pytest.approx(100.3)),
                                   ("decode", pytest.approx(100.3), 100.5)]


def test_the_delay_of_each_phase():
    sched, start = engine_scene()
    phases = sched.between("vllm", start, start + 0.100, phases=[
        ("queue", start, start + 0.010), ("prefill", start + 0.010, start + 0.040),
        ("decode", start + 0.040, start + 0.100)]).phases
    assert [p.phase for p in phases] == ["queue", "prefill", "decode"]
    # Queued 0-10 ms: nothing of the work waited. Phase edges are float Unix
    # seconds (a quarter of a microsecond apart at today's dates), so a sliver
    # of the loop's wait from 10 ms on may fall on this side of the edge.
    assert phases[0].delay_seconds == pytest.approx(0.0, abs=2e-6)
    assert all(seconds < 1e-6 for _, seconds in phases[0].delay_by), phases[0].delay_by
    # Prefill 10-40: the loop 10-30 (batch), the API 20-25 (idle) inside it: 20 ms, 17.5 batch and 2.5 idle.
    assert phases[1].delay_seconds == pytest.approx(0.020, abs=2e-6)
    assert phases[1].delay_by == (("batch", pytest.approx(0.0175, abs=2e-6)), ("idle", pytest.approx(0.0025, abs=2e-6)))
    # Decode 40-100: 40-50 behind its own thread (40-45 while the helper waited for batch), 95-100 batch.
    assert phases[2].delay_seconds == pytest.approx(0.015, abs=2e-6)
    assert phases[2].delay_by == (("batch", pytest.approx(0.010, abs=2e-6)), ("vllm", pytest.approx(0.005, abs=2e-6)))
    # The phases cover the request: their delays add up to the request's.
    whole = sched.between("vllm", start, start + 0.1)
    assert sum(p.delay_seconds for p in phases) == pytest.approx(whole.delay_seconds)
    assert phases[1].as_dict() == {"phase": "prefill", "start": start + 0.010, "end": start + 0.040,
                                   "delay_seconds": pytest.approx(0.020, abs=2e-6),
                                   "delay_by": [{"service": "batch", "cause": "neighbour",
                                                 "seconds": pytest.approx(0.0175, abs=2e-6)},
                                                {"service": "idle", "cause": "idle",
                                                 "seconds": pytest.approx(0.0025, abs=2e-6)}],
                                   "delay_by_cause": {"neighbour": pytest.approx(0.0175, abs=2e-6),
                                                      "idle": pytest.approx(0.0025, abs=2e-6)}}


def test_explain_draws_each_phases_cpu_wait_under_it():
    from agent.cli.requests import timeline

    doc = {"service": "vllm", "e2e": 1.0, "ttft": 0.2, "phases": {"queue": 0.01, "prefill": 0.19, "decode": 0.8},
           "sched": {"delay_seconds": 0.5, "delay_by": [{"service": "batch", "seconds": 0.3},
                                                        {"service": "idle", "seconds": 0.1},
                                                        {"service": "vllm", "seconds": 0.1}],
                     "phases": [{"phase": "prefill", "start": 0.01, "end": 0.2, "delay_seconds": 0.1,
                                 "delay_by": [{"service": "idle", "seconds": 0.1}]},
                                {"phase": "decode", "start": 0.2, "end": 1.0, "delay_seconds": 0.4,
                                 "delay_by": [{"service": "batch", "seconds": 0.3},
                                              {"service": "vllm", "seconds": 0.1}]}]}}
    rows = [(label, duration) for label, _, duration in timeline(doc, width=10)]
    assert rows == [("end to end", "1.00 s"), ("queue", "10 ms"), ("prefill", "0.19 s"),
                    ("  of it, CPU wait", "0.10 s (idle 0.10 s)"), ("decode", "0.80 s"),
                    ("  of it, CPU wait", "0.40 s (batch 0.30 s)"),
                    ("first token", "0.20 s"), ("waited for a CPU", "0.50 s"), ("  batch", "0.30 s"),
                    ("  idle CPU (wake-up)", "0.10 s"), ("  its own threads", "0.10 s")]
    # The decode's wait is drawn where the decode is: from 20% of the way.
    bar = timeline(doc, width=10)[5][1]
    assert bar.plain == "··████····"


def test_explain_and_the_listing_name_the_limit_as_the_cause(capsys, monkeypatch):
    from agent.cli.requests import print_explain, print_requests, timeline

    monkeypatch.setenv("COLUMNS", "250")   # a wide terminal: rich folds cells to fit

    limit = {"cgroup": "/kubepods/burstable/pod1234", "setting": "cpu.max 50000 100000", "quota_seconds": 0.05,
             "period_seconds": 0.1, "cpus": 0.5, "level": "pod"}
    doc = {"request_id": "r1", "service": "vllm", "e2e": 0.3, "ttft": 0.1, "phases": {},
           "sched": {"delay_seconds": 0.21, "delay_by": [{"service": "vllm", "cause": "cpu_limit", "seconds": 0.19},
                                                         {"service": "idle", "cause": "idle", "seconds": 0.02}],
                     "runq_thread_seconds": 0.4, "preemptions": 3, "migrations": 0, "iowait_seconds": 0.0,
                     "limits": [limit]},
           "culprits": [], "slo": [], "verdict": "its own CPU limit (...) added 0.19 s", "sched_complete": True}
    rows = [(label, duration) for label, _, duration in timeline(doc, width=10)]
    assert ("  its own CPU limit", "0.19 s") in rows and ("  idle CPU (wake-up)", "20 ms") in rows
    print_explain(doc)
    out = capsys.readouterr().out
    line = "CPU limit: cpu.max 50000 100000 (0.5 CPU) on /kubepods/burstable/pod1234, the pod's cgroup"
    assert line in " ".join(out.split())
    print_requests({"requests": [doc]})
    out = capsys.readouterr().out
    assert "its own CPU limit" in out and "(0.19 s)" in out


def test_the_part_of_a_wait_the_services_own_limit_held_is_its_own_cause():
    """A limited engine loop: the kernel splits each throttled wait into the
    limit's part (EV_LIMIT) and the rest, after the limit lifted, charged to
    whoever then held the CPU (idle here, batch for the second wait)."""
    names = {100: (100, "VLLM::EngineCor", "VLLM::EngineCor"), 101: (100, "VLLM::EngineCor", "VLLM::EngineCor")}
    log = EventLog(retention_ns=10**15)
    base = time.monotonic_ns() - 200 * MS
    log.add([SchedEvent(10, EV_LIMIT, base + 10 * MS, base + 40 * MS, 10, 100),    # throttled 30 ms
             SchedEvent(10, EV_RUNQ, base + 40 * MS, base + 41 * MS, 0, 100),      # then woke to an idle CPU
             SchedEvent(10, EV_LIMIT, base + 12 * MS, base + 40 * MS, 10, 101),    # the other thread, as long
             SchedEvent(10, EV_RUNQ, base + 40 * MS, base + 42 * MS, 10, 101),     # then behind the first
             SchedEvent(10, EV_PREEMPTED, base + 60 * MS, base + 70 * MS, 11, 100),
             SchedEvent(10, EV_LIMIT, base + 70 * MS, base + 90 * MS, 10, 100)])   # throttled on the way
    service_of = {10: "vllm", 11: "batch"}.__getitem__
    sched = EventSched(log, lambda s: {10}, service_of, Fallback(), thread_names=names.get)
    sched.pin({"vllm"})
    sched.watched_cgroups()
    sched._watching["vllm"] = 0.0
    start = (base + time.time_ns() - time.monotonic_ns()) / 1e9
    got = sched.between("vllm", start, start + 0.100)
    # Thread-seconds: 30 + 1 + 28 + 2 + 10 + 20 = 91 ms, of which 78 ms the limit's.
    assert got.runq_wait_seconds == pytest.approx(0.091, abs=2e-6)
    assert got.limit_seconds == pytest.approx(0.078, abs=2e-6)
    # Delay: [10, 42] + [60, 90] = 62 ms: the limit 30 + 20, idle 0.5 (40-41 shared with 101's own wait),
    # 101 behind its own thread 0.5 + 1, batch 10.
    assert got.delay_seconds == pytest.approx(0.062, abs=2e-6)
    doc = got.as_dict()
    assert doc["delay_by_cause"] == {"cpu_limit": pytest.approx(0.050, abs=2e-6),
                                     "neighbour": pytest.approx(0.010, abs=2e-6),
                                     "own_threads": pytest.approx(0.0015, abs=2e-6),
                                     "idle": pytest.approx(0.0005, abs=2e-6)}
    assert doc["delay_by"][0] == {"service": "vllm", "cause": "cpu_limit", "seconds": pytest.approx(0.050, abs=2e-6)}
    assert sum(d["seconds"] for d in doc["delay_by"]) == pytest.approx(got.delay_seconds)


def test_a_request_that_ran_while_the_stream_dropped_events_is_marked(caplog):
    """The kernel's event stream drops what its rate limit refuses: a request
    that ran meanwhile says so (a lower bound), one that did not stays
    complete, and the agent warns once a minute, not once a drain."""
    sched, start = engine_scene()
    sched.ingest([], start - 1.0, dropped_total=0)
    sched.ingest([], start + 0.050, dropped_total=120)     # 120 dropped during the request
    sched.ingest([], start + 0.150, dropped_total=120)
    sched.ingest([], start + 0.250, dropped_total=125)     # 5 more, after it
    got = sched.between("vllm", start, start + 0.100)
    assert got.dropped_events == 120 and got.as_dict()["dropped_events"] == 120
    assert sched.dropped_between(start + 0.160, start + 0.300) == 5
    assert sched.dropped_between(start - 2.0, start - 1.5) == 0   # drops are placed between two drains
    doc = request_document(RequestSpan("r1", "ab" * 16, "cd" * 8, None, start, start + 0.1, 0.1), "vllm",
                           "connection", got, [], True)
    assert doc["sched_complete"] is False and doc["sched_dropped_events"] == 120
    assert "at least: the event stream dropped 120 events meanwhile" in doc["verdict"]
    warnings = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert len(warnings) == 1 and "event_rate" in warnings[0].getMessage()


def test_a_record_of_merged_waits_counts_what_it_waited():
    # A spinning thread's merged record: 40 µs waited in [0, 100 µs].
    us = 1_000
    alone = critical_delay({1: [(0, 100 * us, "vllm", 40 * us)]}, [1])
    assert alone.seconds == pytest.approx(40e-6) and alone.by == (("vllm", pytest.approx(40e-6)),)
    # Beside a whole wait of another critical thread: held up all through it.
    beside = critical_delay({1: [(0, 100 * us, "vllm", 40 * us)], 2: [(50 * us, 100 * us, "batch")]}, [1, 2])
    assert beside.seconds == pytest.approx((20 + 50) * 1e-6)
    # 50-100: the whole wait (density 1) and the record (0.4) share the instant by their densities.
    assert dict(beside.by) == pytest.approx({"vllm": 20e-6 + 50e-6 * 0.4 / 1.4, "batch": 50e-6 / 1.4})
    # Two records at once, taken as independent: 1 - (1 - 0.4)(1 - 0.5) of the time.
    two = critical_delay({1: [(0, 100 * us, "vllm", 40 * us)], 2: [(0, 100 * us, "batch", 50 * us)]}, [1, 2])
    assert two.seconds == pytest.approx(70e-6)
    assert sum(s for _, s in two.by) == pytest.approx(two.seconds)


def test_clipping_a_merged_record_keeps_its_share_in_proportion():
    from agent.attribution.critical_path import clip
    assert clip([(0, 100, "a", 40), (100, 200, "b")], 50, 150) == [(50, 100, "a", 20), (100, 150, "b")]
    assert clip([(0, 100, "a", 40)], 0, 100) == [(0, 100, "a", 40)] and clip([(0, 100, "a", 40)], 100, 200) == []


SINGLE_FRONT_END = {200: 1, 300: 200, 310: 300, 400: 200}
# vLLM with several API servers: the first process (100) starts them (200,
# 201), the engine cores and the coordinator (500) side by side.
SEVERAL_FRONT_ENDS = {100: 1, 200: 100, 201: 100, 300: 100, 310: 300, 400: 100, 500: 100}


def data_parallel_scene(parents: dict[int, int] = SINGLE_FRONT_END) -> tuple[EventSched, float]:
    """vLLM with two engine cores over a 100 ms request starting at the
    returned wall time: an API server (pid 200, the span's sender) that started
    engine cores 300 and 400; 300 started its worker 310. Engine 400 sits on a
    neighbour's CPU (cgroup 11) and waits 60 ms; engine 300 and its worker wait
    10 ms each. The API server hands the request to 300 (a wake-up of 300's
    thread) and 300's outputs come back (a wake-up of the API server's)."""
    names = {200: (200, "vllm", "vllm"), 300: (300, "VLLM::EngineCor", "VLLM::EngineCor"),
             310: (310, "VLLM::Worker", "VLLM::Worker"), 400: (400, "VLLM::EngineCor", "VLLM::EngineCor")}
    log = EventLog(retention_ns=10**15)
    base = time.monotonic_ns() - 200 * MS
    log.add([SchedEvent(10, EV_PREEMPTED, base + 10 * MS, base + 70 * MS, 11, 400),
             SchedEvent(10, EV_PREEMPTED, base + 80 * MS, base + 90 * MS, 12, 300),
             SchedEvent(10, EV_PREEMPTED, base + 90 * MS, base + 100 * MS, 12, 310),
             SchedEvent(10, EV_WAKE, base + 1 * MS, base + 1 * MS, 200, 300),    # the request handed to 300
             SchedEvent(10, EV_WAKE, base + 99 * MS, base + 99 * MS, 300, 200),  # its outputs back
             SchedEvent(10, EV_WAKE, base + 150 * MS, base + 150 * MS, 200, 400)])  # after the request
    return watching(log, names, {10: "vllm", 11: "batch", 12: "other"}, parents), wall(base)


def test_a_request_counts_the_engine_core_that_served_it_and_its_workers_only():
    sched, start = data_parallel_scene()
    got = sched.between("vllm", start, start + 0.100, front=200)
    assert got.delay_seconds == pytest.approx(0.020, abs=2e-6)
    assert dict(got.delay_by) == {"other": pytest.approx(0.020, abs=2e-6)}
    assert got.delay_threads == 2
    # The other engine core's waits stay in the thread-seconds and by thread.
    assert got.runq_wait_seconds == pytest.approx(0.080, abs=2e-6)
    phases = sched.between("vllm", start, start + 0.100, front=200, phases=[("decode", start, start + 0.100)]).phases
    assert phases[0].delay_seconds == pytest.approx(0.020, abs=2e-6)


def test_with_several_api_servers_the_other_engine_cores_do_not_count():
    sched, start = data_parallel_scene(SEVERAL_FRONT_ENDS)
    got = sched.between("vllm", start, start + 0.100, front=200)
    assert got.delay_seconds == pytest.approx(0.020, abs=2e-6)


def test_without_a_front_end_or_a_wake_up_across_processes_every_process_counts():
    sched, start = data_parallel_scene()
    assert sched.between("vllm", start, start + 0.100).delay_seconds == pytest.approx(0.080, abs=2e-6)
    # A front end that exchanged no wake-up in the window: nothing narrows.
    assert sched.between("vllm", start, start + 0.100, front=999).delay_seconds == pytest.approx(0.080, abs=2e-6)


def test_a_request_that_ran_while_the_stream_dropped_events_counts_every_process():
    sched, start = data_parallel_scene()
    sched.ingest([], drained_at_wall=start - 1.0, dropped_total=0)
    sched.ingest([], drained_at_wall=start + 1.0, dropped_total=5)
    got = sched.between("vllm", start, start + 0.100, front=200)
    assert got.dropped_events == 5
    assert got.delay_seconds == pytest.approx(0.080, abs=2e-6)


def test_thread_names_know_which_process_started_which(tmp_path):
    for pid, ppid in ((300, 200), (200, 1)):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "status").write_text(f"Name:\tx\nTgid:\t{pid}\nPPid:\t{ppid}\n")
    names = ThreadNames(tmp_path)
    assert names.parent(300) == 200 and names.parent(200) == 1
    assert names.parent(12345) is None
