"""Prometheus exposition: a Collector that reads the store at scrape time.

Nothing is mutated from the poll loop; each scrape turns the families that
agent.export.figures computes (the same ones the OTLP exporter sends) into
prometheus_client metric families. Counters come from the store's totals since
start, gauges from its recent window.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from agent.export.figures import (
    CATALOG,
    QUANTILE_WINDOW_S,
    QUANTILES,
    Family,
    HistogramPoint,
    MetricSpec,
    Point,
    Sources,
    SummaryPoint,
    compute,
)
from agent.store.store import Store

__all__ = ["QUANTILES", "QUANTILE_WINDOW_S", "SlatraceCollector", "to_metric"]


def _le(bound: float) -> str:
    # repr() round-trips the float, so the `le` Prometheus parses is exactly
    # the slot boundary the count was taken at.
    return repr(float(bound))


def _empty(spec: MetricSpec) -> Metric:
    labels = list(spec.labels)
    if spec.type == "counter":
        return CounterMetricFamily(spec.name, spec.help, labels=labels)
    if spec.type == "gauge":
        return GaugeMetricFamily(spec.name, spec.help, labels=labels)
    if spec.type == "summary":
        return SummaryMetricFamily(spec.name, spec.help, labels=labels)
    return HistogramMetricFamily(spec.name, spec.help, labels=labels)


def to_metric(family: Family) -> Metric:
    """One figures.Family as a prometheus_client metric family."""
    metric = _empty(family.spec)
    for p in family.points:
        if isinstance(p, HistogramPoint):
            buckets = [(_le(b), c) for b, c in zip(p.bounds, p.cumulative)] + [("+Inf", p.count)]
            metric.add_metric(list(p.labels), buckets, p.sum)  # type: ignore[call-arg]
        elif isinstance(p, SummaryPoint):
            labels = dict(zip(family.spec.labels, p.labels))
            for q, v in p.quantiles:
                metric.add_sample(family.spec.name, {**labels, "quantile": str(q)}, v)
            metric.add_metric(list(p.labels), p.count, p.sum)  # type: ignore[call-arg]
        else:
            assert isinstance(p, Point)
            metric.add_metric(list(p.labels), p.value)  # type: ignore[call-arg]
    return metric


class SlatraceCollector(Collector):
    """Every metric of the catalog, computed afresh at each scrape.

    self_metrics is the daemon's view of its own loop (poll duration, poll
    errors), keyed by metric name; sources carries what the store does not
    hold (SLO config, throttling, breach counts, request delays).
    """

    def __init__(self, store: Store, self_metrics: Callable[[], Mapping[str, float]] | None = None,
                 *, sources: Sources | None = None) -> None:
        self._store = store
        sources = sources or Sources()
        if sources.agent_stats is None and self_metrics is not None:
            sources = dataclasses.replace(sources, agent_stats=self_metrics)
        self._sources = sources

    def update_sources(self, **changes) -> None:
        """Replace some sources (the SLOs after a config reload)."""
        self._sources = dataclasses.replace(self._sources, **changes)

    def collect(self) -> Iterator[Metric]:
        for family in compute(self._store, self._sources):
            # A family with no points still has HELP/TYPE lines; skipping it keeps
            # the exposition to what is measured (and `promtool check metrics` quiet).
            if family.points:
                yield to_metric(family)

    def describe(self) -> Iterator[Metric]:
        # Names only, so a registry with auto_describe can detect clashes
        # without running a scrape.
        for spec in CATALOG:
            yield _empty(spec)
