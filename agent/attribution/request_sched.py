"""Scheduling figures of one service over one request's lifetime.

The traces subsystem asks a RequestSchedSource what the service's threads went
through between a request's start and end. Two sources exist: one prorates the
store's per-interval figures (coarse: the interval length), one sums exact
per-event records from the kernel for services that send spans.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from agent.store.store import Store


@dataclass(frozen=True)
class RequestSched:
    runq_wait_seconds: float
    preemptions: int
    preempted_by: tuple[tuple[str, float], ...]   # (service, wait seconds), largest first
    iowait_seconds: float
    migrations: int
    resolution_seconds: float                     # how finely the window was cut

    def as_dict(self) -> dict:
        return {
            "runq_wait_seconds": self.runq_wait_seconds,
            "preemptions": self.preemptions,
            "preempted_by": [{"service": s, "wait_seconds": w} for s, w in self.preempted_by],
            "iowait_seconds": self.iowait_seconds,
            "migrations": self.migrations,
        }


class RequestSchedSource(Protocol):
    def watch(self, service: str) -> None:
        """Record finely for `service` from now on (it sends request spans)."""

    def covered_until(self) -> float:
        """Wall-clock time up to which figures are complete; ask between() for
        a request only once its end is covered."""

    def between(self, service: str, start: float, end: float) -> RequestSched:
        """Figures of `service` over [start, end] (Unix seconds)."""


class IntervalSched:
    """Prorates the store's intervals that overlap the request by their overlap."""

    def __init__(self, store: Store, interval_s: float) -> None:
        self._store = store
        self._interval = interval_s

    def watch(self, service: str) -> None:
        pass

    def covered_until(self) -> float:
        latest = self._store.latest()
        return latest.end if latest else 0.0

    def between(self, service: str, start: float, end: float) -> RequestSched:
        runq = iowait = 0.0
        preemptions = migrations = 0.0
        by: dict[str, float] = {}
        for rec in self._store.records(since_s=max(0.0, time.time() - start) + self._interval):
            overlap = min(end, rec.end) - max(start, rec.start)
            figures = rec.services.get(service)
            if overlap <= 0 or figures is None:
                continue
            share = overlap / (rec.end - rec.start)
            runq += figures.runq.sum_seconds * share
            iowait += figures.iowait.sum_seconds * share
            migrations += figures.migrations * share
            for culprit, p in figures.preempted_by.items():
                preemptions += p.count * share
                by[culprit] = by.get(culprit, 0.0) + p.wait_ns / 1e9 * share
        ranked = tuple(sorted(by.items(), key=lambda kv: kv[1], reverse=True))
        return RequestSched(runq, round(preemptions), ranked, iowait, round(migrations), self._interval)
