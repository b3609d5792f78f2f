"""Counters of the trace side, as plain numbers.

The pipeline and receivers bump plain counters under one lock; the export
floor declares their families (agent/export/catalog.py) and turns a totals()
snapshot into them at scrape time (agent/export/traces.py). Request SLO
breaches and per-request delays are counted here but exported by the main
collector (agent/export/figures.py), beside interval SLO breaches, so each
metric name has one family.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from agent.attribution.slo import holds
from agent.store.histogram import classic_bounds
from agent.store.table import OTHER_CULPRITS

__all__ = ["DelayBuckets", "TraceCounters", "TraceTotals"]


# Request SLOs are judged like the interval ones: on the last minute.
SLO_WINDOW_S = 60.0
# Requests kept per (service, SLO) for that judgement; beyond it, the oldest go.
SLO_SAMPLES = 10_000
# Neighbours named in a service's request delay by cause: the first ones seen
# keep their label for good (a counter never moves to another series); later
# ones are counted under "other".
DELAY_CULPRITS = 3


@dataclass(frozen=True)
class TraceTotals:
    """One consistent look at the counters, for the exporters."""

    received: Mapping[str, int]                 # transport -> spans accepted
    rejected: Mapping[tuple[str, str], int]     # (transport, reason) -> export requests refused
    unresolved: Mapping[str, int]               # reason -> request spans with no service
    claims_ignored: Mapping[str, int]           # resource attribute -> resources whose claim was ignored
    requests: Mapping[str, int]                 # service -> request spans attributed
    pending: int
    pending_dropped: int
    forwarded: int
    truncated_attributes: int
    store_evicted: int
    attribution_errors: int
    forward_dropped: Mapping[str, int]          # reason -> spans not forwarded
    # (service, cause, culprit) -> seconds of request delay (docs/api.md delay_by[])
    delay_by_cause: Mapping[tuple[str, str, str], float] = field(default_factory=dict)


@dataclass(frozen=True)
class DelayBuckets:
    """One service's per-request delays, counted on the exported bounds."""

    bounds: tuple[float, ...]
    cumulative: tuple[int, ...]   # at each bound, then the total (+Inf)
    sum: float


class TraceCounters:
    def __init__(self, clock: Callable[[], float] = time.time,
                 bounds: tuple[float, ...] | None = None) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        # (service, slo) -> recent (request end, judged value), and its target
        self._slo_samples: dict[tuple[str, str], deque[tuple[float, float]]] = {}
        self._slo_targets: dict[tuple[str, str], float] = {}
        self._bounds = classic_bounds() if bounds is None else bounds
        self.received: dict[str, int] = {}          # transport -> spans accepted
        self.rejected: dict[tuple[str, str], int] = {}  # (transport, reason) -> export requests refused
        self.requests: dict[str, int] = {}          # service -> request spans attributed
        self.breaches: dict[tuple[str, str], int] = {}  # (service, slo) -> requests that broke it
        self.pending_dropped = 0                    # attributed early because the pending queue was full
        self.forwarded = 0
        self.forward_dropped: dict[str, int] = {}   # reason -> spans not forwarded
        self._delay: dict[str, tuple[list[int], list[float]]] = {}  # service -> (bucket counts, [sum])
        self.pending = 0
        self.truncated_attributes = 0               # attribute values cut to Limits.max_attribute_length
        self.store_evicted = 0                      # finished requests dropped from the store before their age
        self.attribution_errors = 0                 # requests (or worker ticks) whose attribution raised
        self.unresolved: dict[str, int] = {}        # reason -> request spans with no service
        self.claims_ignored: dict[str, int] = {}    # resource attribute -> resources whose claim was ignored
        self.delay_by_cause: dict[tuple[str, str, str], float] = {}  # (service, cause, culprit) -> seconds
        self._named: dict[str, set[str]] = {}      # service -> the neighbours with a label of their own

    def add_received(self, transport: str, spans: int) -> None:
        with self._lock:
            self.received[transport] = self.received.get(transport, 0) + spans

    def add_rejected(self, transport: str, reason: str) -> None:
        with self._lock:
            key = (transport, reason)
            self.rejected[key] = self.rejected.get(key, 0) + 1

    def add_unresolved(self, reason: str, n: int = 1) -> None:
        with self._lock:
            self.unresolved[reason] = self.unresolved.get(reason, 0) + n

    def add_claim_ignored(self, attribute: str) -> None:
        with self._lock:
            self.claims_ignored[attribute] = self.claims_ignored.get(attribute, 0) + 1

    def add_request(self, service: str, delay_s: float | None, slo: list[dict], end: float,
                    delay_by: Sequence[Mapping] = ()) -> None:
        """One attributed request: its scheduling delay (wall-clock, on its
        critical path), its split (`{service, cause, seconds}` as the REQUEST
        document's delay_by[]) and its judged request SLOs (`{name, target,
        value, ok}`)."""
        with self._lock:
            self.requests[service] = self.requests.get(service, 0) + 1
            named = self._named.setdefault(service, set())
            for by in delay_by:
                culprit = by["service"]
                if by["cause"] == "neighbour" and culprit not in named:
                    if len(named) < DELAY_CULPRITS:
                        named.add(culprit)
                    else:
                        culprit = OTHER_CULPRITS
                key = (service, by["cause"], culprit)
                self.delay_by_cause[key] = self.delay_by_cause.get(key, 0.0) + by["seconds"]
            for judged in slo:
                key = (service, judged["name"])
                if not judged["ok"]:
                    self.breaches[key] = self.breaches.get(key, 0) + 1
                self._slo_samples.setdefault(key, deque(maxlen=SLO_SAMPLES)).append((end, judged["value"]))
                self._slo_targets[key] = judged["target"]
            if delay_s is not None:
                counts, total = self._delay.setdefault(service, ([0] * (len(self._bounds) + 1), [0.0]))
                counts[bisect.bisect_left(self._bounds, delay_s)] += 1
                total[0] += delay_s

    def add_truncated(self, n: int) -> None:
        if n:
            with self._lock:
                self.truncated_attributes += n

    def add_attribution_error(self) -> None:
        with self._lock:
            self.attribution_errors += 1

    def add_store_evicted(self, n: int) -> None:
        with self._lock:
            self.store_evicted += n

    def add_forwarded(self, n: int) -> None:
        with self._lock:
            self.forwarded += n

    def add_forward_dropped(self, reason: str, n: int) -> None:
        with self._lock:
            self.forward_dropped[reason] = self.forward_dropped.get(reason, 0) + n

    def slo_status(self) -> dict[tuple[str, str], tuple[float, float | None, bool]]:
        """(service, slo) -> (target, P99 of the requests that ended in the
        last SLO_WINDOW_S, ok): a request SLO named *_p99 holds while that P99
        is within the target (and, with no requests, trivially)."""
        horizon = self._clock() - SLO_WINDOW_S
        out = {}
        with self._lock:
            for key, samples in self._slo_samples.items():
                while samples and samples[0][0] < horizon:
                    samples.popleft()
                target = self._slo_targets[key]
                values = sorted(v for _, v in samples)
                p99 = values[max(0, math.ceil(0.99 * len(values)) - 1)] if values else None
                out[key] = (target, p99, holds(p99, target))
        return out

    def breach_counts(self) -> dict[tuple[str, str], int]:
        """(service, slo) -> requests that broke it, for other exporters."""
        with self._lock:
            return dict(self.breaches)

    def delay_points(self) -> dict[str, DelayBuckets]:
        """service -> per-request run-queue wait, bucketed on the exported bounds,
        for the main collector (figures.Sources.request_sched_delay)."""
        return {s: DelayBuckets(self._bounds, tuple(n for _, n in cumulative) + (count,), total)
                for s, (cumulative, count, total) in self.delay_histograms().items()}

    def totals(self) -> TraceTotals:
        with self._lock:
            return TraceTotals(
                received=dict(self.received), rejected=dict(self.rejected), unresolved=dict(self.unresolved),
                claims_ignored=dict(self.claims_ignored), requests=dict(self.requests), pending=self.pending,
                pending_dropped=self.pending_dropped, forwarded=self.forwarded,
                truncated_attributes=self.truncated_attributes, store_evicted=self.store_evicted,
                attribution_errors=self.attribution_errors, forward_dropped=dict(self.forward_dropped),
                delay_by_cause=dict(self.delay_by_cause))

    def delay_histograms(self) -> dict[str, tuple[list[tuple[float, int]], int, float]]:
        """service -> (cumulative (bound, count) pairs, count, sum)."""
        with self._lock:
            snap = {s: (list(c), t[0]) for s, (c, t) in self._delay.items()}
        out = {}
        for service, (counts, total) in snap.items():
            cumulative, running = [], 0
            for bound, n in zip(self._bounds, counts):
                running += n
                cumulative.append((bound, running))
            out[service] = (cumulative, running + counts[-1], total)
        return out
