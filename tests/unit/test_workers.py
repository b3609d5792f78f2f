"""The one shape of background work: a failing step is counted and logged and
the worker goes on, a loop that dies comes back, a stop says whether the
worker ended in time, and /livez names a worker that should run and does not."""

from __future__ import annotations

import logging
import threading
import time

from agent.api.routes import AgentState, Api
from agent.config import Config
from agent.store.store import Store
from agent.workers import Worker, not_running, started


def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_step_that_raises_is_counted_and_logged_and_the_worker_goes_on(caplog):
    calls: list[float] = []

    def step() -> None:
        calls.append(time.monotonic())
        if len(calls) % 2:
            raise ValueError(f"bad read {len(calls)}")

    worker = Worker.periodic("probe-reader", "reading the probe", step, every_s=0.01)
    caplog.set_level(logging.DEBUG, logger="slatrace.workers")
    worker.start()
    try:
        wait_for(lambda: len(calls) >= 6)
    finally:
        assert worker.stop(2.0)
    state = worker.state()
    # Steps 1, 3, 5, ... raised: as many errors as odd steps, and a success after each.
    assert state.errors == (len(calls) + 1) // 2
    assert state.last_error.startswith("ValueError: bad read ")
    assert state.last_success is not None and not state.should_run and not state.alive
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings[0] == "probe-reader (reading the probe) failed: ValueError: bad read 1; again in 0.01 s"
    assert len(warnings) == state.errors
    # The traceback goes to debug, one per failure.
    assert sum(r.exc_info is not None for r in caplog.records if r.levelno == logging.DEBUG) == state.errors


def test_first_step_now_or_after_one_period():
    now, later = [], []
    a = Worker.periodic("a", "now", lambda: now.append(1), every_s=10.0)
    b = Worker.periodic("b", "later", lambda: later.append(1), every_s=10.0, first_now=False)
    a.start()
    b.start()
    wait_for(lambda: now)
    time.sleep(0.05)
    assert a.stop(1.0) and b.stop(1.0)
    assert now == [1] and later == []


def test_a_loop_that_dies_is_restarted_after_a_backoff():
    runs: list[float] = []

    def body(handle) -> None:
        runs.append(time.monotonic())
        if len(runs) < 3:
            raise ConnectionError("peer went away")
        handle.succeeded()
        handle.wait(None)

    worker = Worker.loop("watcher", "watching", body, restart_s=0.05)
    worker.start()
    try:
        wait_for(lambda: len(runs) == 3)
        state = worker.state()
        assert state.errors == 2 and state.last_error == "ConnectionError: peer went away"
        assert state.alive and not state.dead
        assert all(b - a >= 0.04 for a, b in zip(runs, runs[1:]))
    finally:
        assert worker.stop(1.0)
    assert len(runs) == 3


def test_stop_with_a_deadline_reports_a_step_that_would_not_end():
    release = threading.Event()
    entered = threading.Event()

    def stuck() -> None:
        entered.set()
        release.wait(10.0)

    worker = Worker.periodic("stuck", "blocking on a dead peer", stuck, every_s=0.01)
    worker.start()
    entered.wait(2.0)
    t0 = time.monotonic()
    assert worker.stop(0.1) is False
    assert 0.09 <= time.monotonic() - t0 < 1.0
    release.set()
    assert worker.stop(2.0) is True


def test_a_nudge_ends_the_wait_and_stop_wakes_what_the_loop_blocks_on():
    nudged: list[bool] = []
    blocked = threading.Event()

    def body(handle) -> None:
        while not handle.stopping:
            if handle.wait_nudge(10.0):
                nudged.append(True)
        blocked.wait(10.0)  # something only on_stop releases

    worker = Worker.loop("reload", "reloading", body, on_stop=blocked.set)
    worker.start()
    worker.nudge()
    wait_for(lambda: nudged == [True])
    assert worker.stop(1.0)


def test_livez_names_a_worker_that_should_run_and_does_not():
    def body(handle) -> None:
        return  # ends without being asked to

    dead = Worker.loop("k8s-pods", "watching this node's pods", body)
    fine = Worker.loop("events", "draining", lambda handle: handle.wait(None))
    state = AgentState(config=Config(), store=Store(60.0), registry=None, describe_services=list,
                       workers_down=lambda: not_running([dead, fine]))
    api = Api(state)
    state.ready = True
    fine.start()
    assert api.handle("GET", "/livez").status == 200
    dead.start()
    wait_for(lambda: not dead.alive)
    r = api.handle("GET", "/livez")
    assert (r.status, r.body) == (503, b"failing: workers not running: k8s-pods\n")
    assert api.handle("GET", "/readyz").status == 503
    state.failure = "the last 10 collections failed (OSError: x)"
    assert api.handle("GET", "/livez").body == (b"failing: the last 10 collections failed (OSError: x); "
                                                 b"workers not running: k8s-pods\n")
    # Asked to stop, a worker is no longer one that should run.
    dead.stop(1.0)
    state.failure = None
    assert api.handle("GET", "/livez").status == 200
    assert fine in started()
    fine.stop(1.0)


def test_each_workers_errors_are_a_series_of_slatrace_worker_errors_total():
    from prometheus_client.parser import text_string_to_metric_families

    from agent.export.prometheus import Registry
    from agent.export.workers import WorkerCollector

    def boom() -> None:
        raise OSError("no such file")

    failing = Worker.periodic("engine-metrics", "scraping", boom, every_s=0.01)
    quiet = Worker.periodic("events", "draining", lambda: None, every_s=0.01)
    registry = Registry()
    registry.register(WorkerCollector(lambda: [failing, quiet]))
    failing.start()
    quiet.start()
    try:
        wait_for(lambda: failing.errors >= 3)
    finally:
        failing.stop(1.0)
        quiet.stop(1.0)
    (family,) = text_string_to_metric_families(registry.exposition().decode())
    assert family.name == "slatrace_worker_errors" and family.type == "counter"
    assert {s.labels["worker"]: s.value for s in family.samples} == {"engine-metrics": failing.errors, "events": 0}
