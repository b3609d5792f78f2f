"""The trace side's families: the OTLP receivers, request attribution and
forwarding (TraceCollector), and the inference engines' own latency quantiles
(EngineCollector).

agent/traces counts in plain numbers (TraceCounters.totals(),
EngineScraper.latency_summaries()) and imports nothing of the exporters; the
families are declared in agent/export/catalog.py and built here at scrape time.
Every family is written even without samples, as it always was.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Protocol

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from agent.export.catalog import (
    ATTRIBUTION_ERRORS,
    CLAIMS_IGNORED,
    ENGINE_LATENCY,
    ENGINE_SCRAPE_ERRORS,
    ENGINES,
    FORWARD_DROPPED,
    PENDING_OVERFLOW,
    QUANTILE_WINDOW_S,
    REJECTED_REQUESTS,
    REQUESTS_ATTRIBUTED,
    REQUESTS_EVICTED,
    REQUESTS_PENDING,
    SPANS_FORWARDED,
    SPANS_RECEIVED,
    SPANS_UNRESOLVED,
    TRACES,
    TRUNCATED_ATTRIBUTES,
)
from agent.export.figures import Family, Point, SummaryPoint
from agent.export.prometheus import declared, to_metric

__all__ = ["EngineCollector", "TraceCollector"]


class _TraceTotals(Protocol):
    """agent.traces.metrics.TraceTotals, as read here."""

    received: Mapping[str, int]
    rejected: Mapping[tuple[str, str], int]
    unresolved: Mapping[str, int]
    claims_ignored: Mapping[str, int]
    requests: Mapping[str, int]
    pending: int
    pending_dropped: int
    forwarded: int
    truncated_attributes: int
    store_evicted: int
    attribution_errors: int
    forward_dropped: Mapping[str, int]


class _TraceCounters(Protocol):
    def totals(self) -> _TraceTotals: ...


class _EngineSummary(Protocol):
    service: str
    phase: str
    metric: str
    quantiles: tuple[tuple[float, float], ...]
    count: float
    sum: float


class _EngineScraper(Protocol):
    errors: int

    def latency_summaries(self, window_s: float) -> Sequence[_EngineSummary]: ...


def _by_key(counts: Mapping) -> tuple[Point, ...]:
    """One point per key (a label value, or a tuple of them), sorted."""
    return tuple(Point(key if isinstance(key, tuple) else (key,), n) for key, n in sorted(counts.items()))


class TraceCollector(Collector):
    def __init__(self, counters: _TraceCounters) -> None:
        self._counters = counters

    def families(self) -> tuple[Family, ...]:
        t = self._counters.totals()
        return (
            Family(SPANS_RECEIVED, _by_key(t.received)),
            Family(REJECTED_REQUESTS, _by_key(t.rejected)),
            Family(SPANS_UNRESOLVED, _by_key(t.unresolved)),
            Family(CLAIMS_IGNORED, _by_key(t.claims_ignored)),
            Family(REQUESTS_ATTRIBUTED, _by_key(t.requests)),
            Family(REQUESTS_PENDING, (Point((), t.pending),)),
            Family(PENDING_OVERFLOW, (Point((), t.pending_dropped),)),
            Family(SPANS_FORWARDED, (Point((), t.forwarded),)),
            Family(TRUNCATED_ATTRIBUTES, (Point((), t.truncated_attributes),)),
            Family(REQUESTS_EVICTED, (Point((), t.store_evicted),)),
            Family(ATTRIBUTION_ERRORS, (Point((), t.attribution_errors),)),
            Family(FORWARD_DROPPED, _by_key(t.forward_dropped)),
        )

    def collect(self) -> Iterator[Metric]:
        for family in self.families():
            yield to_metric(family)

    def describe(self) -> Iterator[Metric]:
        for spec in TRACES:
            yield declared(spec)


class EngineCollector(Collector):
    """The engines' own latency quantiles over the last minute, per service
    and phase, under the engine's metric name: series to plot beside the
    requests' scheduling delay (slatrace_request_sched_delay_seconds) of the
    same service. A phase the engine does not expose has no series."""

    def __init__(self, scraper: _EngineScraper) -> None:
        self._scraper = scraper

    def families(self) -> tuple[Family, ...]:
        summaries = tuple(SummaryPoint((e.service, e.phase, e.metric), e.quantiles, int(e.count), e.sum)
                          for e in self._scraper.latency_summaries(QUANTILE_WINDOW_S))
        return (Family(ENGINE_LATENCY, summaries),
                Family(ENGINE_SCRAPE_ERRORS, (Point((), self._scraper.errors),)))

    def collect(self) -> Iterator[Metric]:
        for family in self.families():
            yield to_metric(family)

    def describe(self) -> Iterator[Metric]:
        for spec in ENGINES:
            yield declared(spec)
