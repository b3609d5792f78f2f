"""Scheduling figures of one service over one request's lifetime.

The traces subsystem asks a RequestSchedSource what the service's threads went
through between a request's start and end. Two sources exist: one prorates the
store's per-interval figures (coarse: the interval length), one sums exact
per-event records from the kernel for services that send spans.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Callable, Protocol

import numpy as np

from agent.attribution.causes import by_cause, cause_of, culprit_service
from agent.attribution.critical_path import Wait, clip, critical_delay
from agent.probe.snapshot import EV_LIMIT, EV_PREEMPTED, EV_YIELD, SchedEvent
from agent.store.events import EventLog
from agent.store.store import CPU_LIMIT, IDLE, UNKNOWN_SERVICE, Store

log = logging.getLogger(__name__)

# One warning a minute at most while the event stream drops events.
DROP_WARNING_S = 60.0


@dataclass(frozen=True)
class RequestSched:
    # thread-seconds: the run-queue waits of every thread of the service inside
    # the window, added up (exceeds the request's duration on a many-threaded server)
    runq_wait_seconds: float
    preemptions: int
    preempted_by: tuple[tuple[str, float], ...]   # (service, wait seconds), largest first
    iowait_seconds: float
    migrations: int
    resolution_seconds: float                     # how finely the window was cut
    # waits after a wakeup, by who held the CPU until they ended ("idle": nobody)
    waited_behind: tuple[tuple[str, float], ...] = ()
    # the wait by the service's own (pid, process name, thread name), largest first (exact figures only)
    by_thread: tuple[tuple[int, str, str, float], ...] = ()
    # wall-clock seconds the request's work spent waiting for a CPU (never
    # more than its duration; agent/attribution/critical_path.py), and by whom
    delay_seconds: float = 0.0
    delay_by: tuple[tuple[str, float], ...] = ()
    # the threads whose waits make up the delay (exact figures only)
    delay_threads: int = 0
    # the delay inside each phase vLLM reported (queued, prefill, decode)
    phases: tuple[PhaseDelay, ...] = ()
    # the service the figures are of: delay_by's culprits are causes relative to it
    service: str = ""
    # thread-seconds of runq_wait_seconds its own CPU limit held
    limit_seconds: float = 0.0
    # events the kernel's stream dropped (rate limit, full ring buffer) while
    # the request ran: its figures are then a lower bound
    dropped_events: int = 0

    def as_dict(self) -> dict:
        return {
            "delay_seconds": self.delay_seconds,
            "delay_by": delay_by_dicts(self.delay_by, self.service),
            "delay_by_cause": by_cause(self.delay_by, self.service),
            "limit_thread_seconds": self.limit_seconds,
            "dropped_events": self.dropped_events,
            "runq_thread_seconds": self.runq_wait_seconds,
            "runq_wait_seconds": self.runq_wait_seconds,
            "preemptions": self.preemptions,
            "preempted_by": [{"service": s, "wait_seconds": w} for s, w in self.preempted_by],
            "waited_behind": [{"service": s, "wait_seconds": w} for s, w in self.waited_behind],
            "iowait_seconds": self.iowait_seconds,
            "migrations": self.migrations,
            "by_thread": [{"pid": pid, "process": process, "thread": thread, "wait_seconds": w}
                          for pid, process, thread, w in self.by_thread],
            "phases": [p.as_dict() for p in self.phases],
        }


MAX_THREADS_SHOWN = 10
MAX_PROCESS_DEPTH = 8   # how far up a process's parents are followed to the request's front end


def delay_by_dicts(delay_by: Sequence[tuple[str, float]], own: str) -> list[dict]:
    """(culprit, seconds) as the REQUEST document's delay_by[] entries: who,
    and the cause (agent/attribution/causes.py); the CPU limit is shown under
    the service whose limit it is."""
    return [{"service": culprit_service(s, own), "cause": cause_of(s, own), "seconds": w} for s, w in delay_by]


@dataclass(frozen=True)
class PhaseDelay:
    """The scheduling delay inside one phase of a request (queued, prefill, decode)."""

    phase: str
    start: float
    end: float
    delay_seconds: float
    delay_by: tuple[tuple[str, float], ...]
    service: str = ""

    def as_dict(self) -> dict:
        return {"phase": self.phase, "start": self.start, "end": self.end, "delay_seconds": self.delay_seconds,
                "delay_by": delay_by_dicts(self.delay_by, self.service),
                "delay_by_cause": by_cause(self.delay_by, self.service)}


def _ranked(by: dict[str, float]) -> tuple[tuple[str, float], ...]:
    return tuple(sorted(by.items(), key=lambda kv: kv[1], reverse=True))


class RequestSchedSource(Protocol):
    def watch(self, service: str) -> None:
        """Record finely for `service` from now on (it sends request spans)."""

    def pin(self, services: set[str]) -> None:
        """Record finely for these services whether they send or not (replaces the last set)."""

    def covered_until(self) -> float:
        """Wall-clock time up to which figures are complete; ask between() for
        a request only once its end is covered."""

    def between(self, service: str, start: float, end: float, front: int | None = None,
                phases: Sequence[tuple[str, float, float]] = ()) -> RequestSched:
        """Figures of `service` over [start, end] (Unix seconds); `front`: the
        process that sent the request's span, when known; `phases`: windows
        (phase, start, end) inside it whose delay to tell apart."""


class IntervalSched:
    """Prorates the store's intervals that overlap the request by their overlap."""

    def __init__(self, store: Store, interval_s: float) -> None:
        self._store = store
        self._interval = interval_s

    def watch(self, service: str) -> None:
        pass

    def pin(self, services: set[str]) -> None:
        pass

    def covered_until(self) -> float:
        latest = self._store.latest()
        return latest.end if latest else 0.0

    def between(self, service: str, start: float, end: float, front: int | None = None,
                phases: Sequence[tuple[str, float, float]] = ()) -> RequestSched:
        runq = iowait = limit = 0.0
        preemptions = migrations = 0.0
        by: dict[str, float] = {}
        behind: dict[str, float] = {}
        for rec in self._store.records(since_s=max(0.0, time.time() - start) + self._interval):
            overlap = min(end, rec.end) - max(start, rec.start)
            figures = rec.services.get(service)
            if overlap <= 0 or figures is None:
                continue
            share = overlap / (rec.end - rec.start)
            runq += figures.runq.sum_seconds * share
            iowait += figures.iowait.sum_seconds * share
            limit += figures.limited.wait_ns / 1e9 * share
            migrations += figures.migrations * share
            for culprit, p in figures.preempted_by.items():
                preemptions += p.count * share
                by[culprit] = by.get(culprit, 0.0) + p.wait_ns / 1e9 * share
            for holder, p in figures.waited_behind.items():
                behind[holder] = behind.get(holder, 0.0) + p.wait_ns / 1e9 * share
        delay, delay_by = capped_delay(runq, by, behind, end - start, limit)
        return RequestSched(runq, round(preemptions), _ranked(by), iowait, round(migrations), self._interval,
                            _ranked(behind), delay_seconds=delay, delay_by=delay_by, service=service,
                            limit_seconds=limit, phases=phases_between(self, service, phases))


def phases_between(source: RequestSchedSource, service: str,
                   phases: Sequence[tuple[str, float, float]]) -> tuple[PhaseDelay, ...]:
    """Each phase's delay as a request of its own (what prorated figures can do)."""
    out = []
    for phase, start, end in phases:
        got = source.between(service, start, end)
        out.append(PhaseDelay(phase, start, end, got.delay_seconds, got.delay_by, service))
    return tuple(out)


def capped_delay(runq: float, preempted_by: dict[str, float], behind: dict[str, float],
                 duration: float, limit: float = 0.0) -> tuple[float, tuple[tuple[str, float], ...]]:
    """Without per-wait events the critical path cannot be drawn: the delay is
    the thread-seconds capped at the request's duration (an upper bound), split
    like the waits (`limit`: the part the service's own CPU limit held)."""
    split: dict[str, float] = {CPU_LIMIT: limit} if limit > 0 else {}
    for name, wait in list(preempted_by.items()) + list(behind.items()):
        split[name] = split.get(name, 0.0) + wait
    rest = runq - sum(split.values())
    if rest > 1e-12:
        split[UNKNOWN_SERVICE] = split.get(UNKNOWN_SERVICE, 0.0) + rest
    delay = max(0.0, min(runq, duration))
    scale = delay / runq if runq > 0 else 0.0
    return delay, _ranked({name: wait * scale for name, wait in split.items() if wait > 0})


def wall_minus_mono_ns() -> int:
    """CLOCK_REALTIME - CLOCK_MONOTONIC, sampled with the tightest bracket of
    three reads, to place kernel timestamps (monotonic) on span times (wall)."""
    best = None
    for _ in range(3):
        m0 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        w = time.time_ns()
        m1 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        if best is None or m1 - m0 < best[0]:
            best = (m1 - m0, w - (m0 + m1) // 2)
    return best[1]


class EventSched:
    """Exact figures from the kernel's per-wait events of watched services.

    A service is watched from the first request span it sends, or from the
    start when it is pinned (a request server found by its command line), and
    stops being watched `idle_s` after its last span; requests that started
    before its events began flowing get the interval-prorated figures of
    `fallback` (and say so through resolution_seconds).
    """

    def __init__(self, log: EventLog, cgroups_of: Callable[[str], set[int]], service_of: Callable[[int], str],
                 fallback: RequestSchedSource, *, idle_s: float = 120.0, retention_s: float = 900.0,
                 clock: Callable[[], float] = time.time,
                 thread_names: Callable[[int], tuple[int, str, str] | None] = lambda tid: None,
                 parent_of: Callable[[int], int | None] = lambda pid: None) -> None:
        self._log = log
        self._parent_of = parent_of
        self._cgroups_of = cgroups_of
        self._service_of = service_of
        self._fallback = fallback
        self._lock = threading.Lock()
        self._watching: dict[str, float] = {}     # service -> wall time events began
        self._last_span: dict[str, float] = {}    # service -> wall time of its last request span
        self._pinned: frozenset[str] = frozenset()
        self._idle_s = idle_s
        self._clock = clock
        self._thread_names = thread_names
        self._covered_until = 0.0
        self._offset_ns = wall_minus_mono_ns()
        # (from, to, n): the stream dropped n events between two drains (wall clock)
        self._drops: deque[tuple[float, float, int]] = deque()
        self._dropped_total: int | None = None
        self._drained_at = 0.0
        self._warned_at: float | None = None
        self._unwarned = 0
        self.retention_s = retention_s

    def watch(self, service: str) -> None:
        with self._lock:
            self._watching.setdefault(service, float("inf"))  # starts at the next refresh
            self._last_span[service] = self._clock()

    def pin(self, services: set[str]) -> None:
        """Watch these services whether or not they send (replaces the last set)."""
        now = self._clock()
        with self._lock:
            for service in self._pinned - services:
                self._last_span.setdefault(service, now)  # idle from now unless it sends
            self._pinned = frozenset(services)
            for service in services:
                self._watching.setdefault(service, float("inf"))

    def watching(self) -> set[str]:
        with self._lock:
            return set(self._watching)

    def watched_cgroups(self) -> set[int]:
        """The cgroups to stream events for now; marks newly watched services
        as covered from this moment on, and stops watching services that
        stopped sending."""
        now = self._clock()
        with self._lock:
            for service in [s for s in self._watching if s not in self._pinned
                            and now - self._last_span.get(s, now) > self._idle_s]:
                del self._watching[service]
                self._last_span.pop(service, None)
            services = list(self._watching)
        cgids: set[int] = set()
        for service in services:
            found = self._cgroups_of(service)
            cgids |= found
            with self._lock:
                if found and self._watching[service] == float("inf"):
                    self._watching[service] = time.time()
        return cgids

    def ingest(self, events: np.ndarray | list[SchedEvent], drained_at_wall: float,
               dropped_total: int | None = None) -> None:
        """Events (EVENT_ROW rows) drained from the ring buffer when the wall clock read
        drained_at_wall: everything that ended before then is in, but for the
        events the stream dropped (dropped_total: since load, all CPUs)."""
        self._log.add(events)
        self._offset_ns = wall_minus_mono_ns()
        with self._lock:
            if dropped_total is not None:
                self._note_drops(dropped_total, drained_at_wall)
            self._covered_until = drained_at_wall

    def _note_drops(self, total: int, now: float) -> None:
        """Keep when the stream dropped events, and say so once a minute."""
        if self._dropped_total is not None and total > self._dropped_total:
            n = total - self._dropped_total
            self._drops.append((self._drained_at, now, n))
            self._unwarned += n
            if self._warned_at is None or now - self._warned_at >= DROP_WARNING_S:
                log.warning("the per-wait event stream dropped %d events since %s: the requests that ran then "
                            "are marked incomplete (sched_complete false, sched.dropped_events) and their "
                            "scheduling figures are a lower bound; raise event_rate in the config file (events "
                            "per CPU per second; slatrace_bpf_map_errors_total{map=\"events_rate_limited\"} "
                            "counts them)", self._unwarned,
                            "the last warning" if self._warned_at is not None else "the agent started")
                self._warned_at, self._unwarned = now, 0
        while self._drops and self._drops[0][1] < now - self.retention_s:
            self._drops.popleft()
        self._dropped_total = total
        self._drained_at = now

    def dropped_between(self, start: float, end: float) -> int:
        """Events the stream dropped between drains that overlap [start, end]
        (wall clock): the drops of all CPUs and watched services, so it may
        count some that were not this request's."""
        with self._lock:
            return sum(n for a, b, n in self._drops if a <= end and b >= start)

    def covered_until(self) -> float:
        # Both sources must have caught up: requests of services watched too
        # recently are answered by the fallback.
        with self._lock:
            watching, events = bool(self._watching), self._covered_until
        fallback = self._fallback.covered_until()
        return min(events, fallback) if watching else fallback

    def between(self, service: str, start: float, end: float, front: int | None = None,
                phases: Sequence[tuple[str, float, float]] = ()) -> RequestSched:
        with self._lock:
            since = self._watching.get(service, float("inf"))
        if start < since:
            return self._fallback.between(service, start, end, phases=phases)
        offset = self._offset_ns
        cgids = self._cgroups_of(service)
        lo, hi = int(start * 1e9) - offset, int(end * 1e9) - offset
        dropped = self.dropped_between(start, end)
        f = self._log.between(cgids, lo, hi)
        by: dict[str, float] = {}
        for cgid, wait_ns in f.preempted_by.items():
            name = self._service_of(cgid) if cgid else UNKNOWN_SERVICE
            by[name] = by.get(name, 0.0) + wait_ns / 1e9
        behind: dict[str, float] = {}
        for cgid, wait_ns in f.behind.items():
            name = self._service_of(cgid) if cgid else IDLE
            behind[name] = behind.get(name, 0.0) + wait_ns / 1e9
        waits = self._log.thread_waits(cgids, lo, hi)
        critical = self._critical(waits, self._served_by(cgids, lo, hi, front, dropped))
        blamed = self._blamed(waits)
        delay = critical_delay(blamed, critical, own=service)
        return RequestSched(f.runq_wait_ns / 1e9, f.preemptions, _ranked(by), f.iowait_ns / 1e9, f.migrations,
                            resolution_seconds=1e-6, waited_behind=_ranked(behind),
                            by_thread=self._by_thread({tid: sum(waited for _, _, _, _, waited in w)
                                                       for tid, w in waits.items()}),
                            delay_seconds=delay.seconds, delay_by=delay.by, delay_threads=len(critical),
                            service=service, limit_seconds=f.limit_ns / 1e9,
                            dropped_events=dropped,
                            phases=self._phases(blamed, critical, service, phases, offset))

    @staticmethod
    def _phases(waits: dict[int, list[Wait]], critical: list[int], service: str,
                phases: Sequence[tuple[str, float, float]], offset: int) -> tuple[PhaseDelay, ...]:
        """The delay inside each phase window (Unix seconds, inside the
        request's: phase_windows()) of one request, from its waits and
        critical threads."""
        out = []
        for phase, a, b in phases:
            lo, hi = int(a * 1e9) - offset, int(b * 1e9) - offset
            clipped = {tid: clip(w, lo, hi) for tid, w in waits.items()}
            d = critical_delay(clipped, critical, own=service)
            out.append(PhaseDelay(phase, a, b, d.seconds, d.by, service))
        return tuple(out)

    def _blamed(self, waits: dict[int, list[tuple[int, int, int, int, int]]]) -> dict[int, list[Wait]]:
        return {tid: [(s, e, self._culprit(kind, other), waited, kind == EV_YIELD) for s, e, kind, other, waited in w]
                for tid, w in waits.items()}

    def _culprit(self, kind: int, other: int) -> str:
        """Who kept the CPU from a wait: the service's own CPU limit for the
        part it held, the preemptor, or whoever held the CPU the thread woke
        up to (`idle`: nobody)."""
        if kind == EV_LIMIT:
            return CPU_LIMIT
        if other:
            return self._service_of(other)
        return UNKNOWN_SERVICE if kind in (EV_PREEMPTED, EV_YIELD) else IDLE

    def _critical(self, waits: dict[int, list], served: set[int] | None) -> list[int]:
        """The threads whose waits make the delay: those that carry work, of
        the processes that served the request when that is known."""
        if served is None:
            return [tid for tid in waits if self._carries_work(tid)]
        their_parents = {self._parent_of(pid) for pid in served} - {None}
        return [tid for tid in waits if self._carries_work(tid) and self._serving(tid, served, their_parents)]

    def _served_by(self, cgids: set[int], lo: int, hi: int, front: int | None, dropped: int) -> set[int] | None:
        """Who served a request: the process that sent its span (`front`, an
        API server) and its partners, the processes that exchanged a wake-up
        with it while the request ran (the engine core it handed the request
        to, whose outputs came back). A front end with several engine cores
        (vLLM's data parallel) hands each request to one; the others' waits
        did not hold it. None, all processes count, when the front is not
        known, when no wake-up across processes was seen (the programs cannot
        tell them on classic tracepoints, or the front end served the request
        alone), or when the stream dropped events meanwhile (a wake-up may be
        among them)."""
        if front is None or dropped:
            return None
        partners: set[int] = set()
        for waker, woken in self._log.wakes(cgids, lo, hi):
            names = self._thread_names(woken)
            if names is None:
                continue
            if waker == front and names[0] != front:
                partners.add(names[0])
            elif names[0] == front and waker != front:
                partners.add(waker)
        return partners | {front} if partners else None

    def _serving(self, tid: int, served: set[int], their_parents: set[int]) -> bool:
        """Whether the thread's process served: one of `served` (the front
        end and its partners), or a process one of them started (that engine
        core's workers); not a sibling of one of them that is none of them
        (another engine core, another API server) nor a process such a
        sibling started. Anything else (the processes above) counts."""
        names = self._thread_names(tid)
        if names is None:
            return True
        pid = names[0]
        for _ in range(MAX_PROCESS_DEPTH):
            if pid in served:
                return True
            parent = self._parent_of(pid)
            if parent is None:
                return True
            if parent in their_parents:
                return False
            pid = parent
        return True

    def _carries_work(self, tid: int) -> bool:
        """A thread named like its process: the main thread (an engine's step
        loop, an API server's event loop) and the Python and OpenMP threads it
        starts, which keep the name. Library helpers that wait on timers and
        sockets name themselves (gloo's TCP loops, ZMQ's background threads)."""
        names = self._thread_names(tid)
        return names is not None and names[1] == names[2]

    def _by_thread(self, waits: dict[int, int]) -> tuple[tuple[int, str, str, float], ...]:
        """Waits by (pid, process, thread name): a pool's threads share a name and add up."""
        named: dict[tuple[int, str, str], int] = {}
        for tid, ns in waits.items():
            key = self._thread_names(tid) or (0, "?", f"tid {tid}")  # gone before the request was attributed
            named[key] = named.get(key, 0) + ns
        ranked = sorted(named.items(), key=lambda kv: kv[1], reverse=True)[:MAX_THREADS_SHOWN]
        return tuple((pid, process, thread, ns / 1e9) for (pid, process, thread), ns in ranked)
