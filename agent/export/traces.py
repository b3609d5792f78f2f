"""The trace side's families: the OTLP receivers, request attribution and
forwarding (TraceCollector), and the inference engines' own latency quantiles
(EngineCollector).

agent/traces counts in plain numbers (TraceCounters.totals(),
EngineScraper.latency_summaries()) and imports nothing of the exporters; the
families are declared in agent/export/catalog.py and built here at scrape time.
Every family is written even without samples, as it always was.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from agent.export.catalog import ENGINE_LATENCY, ENGINE_SCRAPE_ERRORS, ENGINES, QUANTILE_WINDOW_S, TRACES
from agent.export.figures import Family, Point, SummaryPoint, read_points
from agent.export.prometheus import declared, to_metric

__all__ = ["EngineCollector", "TraceCollector"]


class _TraceCounters(Protocol):
    def totals(self) -> object:
        """agent.traces.metrics.TraceTotals: the catalog's TRACES entries say what they read of it."""


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


class TraceCollector(Collector):
    def __init__(self, counters: _TraceCounters) -> None:
        self._counters = counters

    def families(self) -> tuple[Family, ...]:
        # Each family is read from the totals by its catalog entry.
        t = self._counters.totals()
        return tuple(Family(spec, read_points(spec, t)) for spec in TRACES)

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
