"""Prometheus exposition: a Collector that reads the store at scrape time.

Nothing is mutated from the poll loop; each scrape turns the families that
agent.export.figures computes (the same ones the OTLP exporter sends) into
prometheus_client metric families. Counters come from the store's totals since
start, gauges from its recent window.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

from prometheus_client import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as om_generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from agent.export.catalog import QUANTILE_WINDOW_S, SCHEDULER, MetricSpec
from agent.export.figures import (
    QUANTILES,
    Family,
    HistogramPoint,
    Point,
    Sources,
    SummaryPoint,
    compute,
)
from agent.store.store import Store

__all__ = ["QUANTILES", "QUANTILE_WINDOW_S", "Registry", "SlatraceCollector", "declared", "render", "to_metric"]

OM_EOF = b"# EOF\n"


def _le(bound: float) -> str:
    # repr() round-trips the float, so the `le` Prometheus parses is exactly
    # the slot boundary the count was taken at.
    return repr(float(bound))


def declared(spec: MetricSpec) -> Metric:
    """A catalog family without samples: what to_metric() fills, and what
    describe() yields, so a registry with auto_describe refuses a second
    collector of the same family."""
    labels = list(spec.labels)
    unit = spec.openmetrics_unit
    if spec.type == "counter":
        return CounterMetricFamily(spec.name, spec.help, labels=labels, unit=unit)
    if spec.type == "gauge":
        return GaugeMetricFamily(spec.name, spec.help, labels=labels, unit=unit)
    if spec.type == "summary":
        return SummaryMetricFamily(spec.name, spec.help, labels=labels, unit=unit)
    return HistogramMetricFamily(spec.name, spec.help, labels=labels, unit=unit)


def to_metric(family: Family) -> Metric:
    """One figures.Family as a prometheus_client metric family."""
    metric = declared(family.spec)
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


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


def _label_string(names: tuple[str, ...], values: tuple[str, ...]) -> str:
    """name="value" pairs sorted by name, as prometheus_client writes them."""
    return ",".join(f'{n}="{_escape(v)}"' for n, v in sorted(zip(names, values)))


def render(families: Iterable[Family], openmetrics: bool = False) -> str:
    """The text exposition (format 0.0.4, or OpenMetrics 1.0 without its
    `# EOF`) of figures families, line for line what prometheus_client's
    generate_latest (or openmetrics.exposition.generate_latest) writes for
    to_metric() of each.

    Written directly because a node's scrape carries ~16,000 samples:
    prometheus_client builds a Sample and re-validates every label name per
    sample, most of a scrape's time at that size. The unit tests compare the
    two byte for byte."""
    out: list[str] = []
    for family in families:
        if not family.points:
            continue
        spec = family.spec
        name = spec.name + "_total" if spec.type == "counter" else spec.name
        # OpenMetrics names a counter's family without _total and escapes quotes in HELP too.
        head = spec.name if openmetrics else name
        doc = spec.help.replace("\\", r"\\").replace("\n", r"\n")
        if openmetrics:
            doc = doc.replace('"', r'\"')
        out.append(f"# HELP {head} {doc}\n# TYPE {head} {spec.type}\n")
        if openmetrics and spec.openmetrics_unit:
            out.append(f"# UNIT {head} {spec.openmetrics_unit}\n")
        labels = spec.labels
        for p in family.points:
            base = _label_string(labels, p.labels)
            if isinstance(p, HistogramPoint):
                # `le` takes its place among the sorted label names, as the library writes it.
                for le, c in zip([*map(_le, p.bounds), "+Inf"], p.cumulative):
                    out.append(f"{spec.name}_bucket{{{_label_string((*labels, 'le'), (*p.labels, le))}}} "
                               f"{floatToGoString(c)}\n")
                braces = f"{{{base}}}" if base else ""
                out.append(f"{spec.name}_count{braces} {floatToGoString(p.count)}\n"
                           f"{spec.name}_sum{braces} {floatToGoString(p.sum)}\n")
            elif isinstance(p, SummaryPoint):
                for q, v in p.quantiles:
                    out.append(f"{spec.name}{{{_label_string((*labels, 'quantile'), (*p.labels, str(q)))}}} "
                               f"{floatToGoString(v)}\n")
                braces = f"{{{base}}}" if base else ""
                out.append(f"{spec.name}_count{braces} {floatToGoString(p.count)}\n"
                           f"{spec.name}_sum{braces} {floatToGoString(p.sum)}\n")
            else:
                out.append(f"{name}{{{base}}} {floatToGoString(p.value)}\n" if base
                           else f"{name} {floatToGoString(p.value)}\n")
    return "".join(out)


class Registry(CollectorRegistry):
    """A registry whose /metrics text lets a collector that can write its own
    exposition (SlatraceCollector.exposition) do so; every other collector
    goes through prometheus_client. collect() is unchanged, so the OTLP
    exporter reads the same families as before."""

    def __init__(self) -> None:
        # auto_describe: every collector's family names are known at register(),
        # so a second collector of a family already registered is refused there
        # instead of writing the family twice in /metrics.
        super().__init__(auto_describe=True)
        self._in_order: list[Collector] = []

    def register(self, collector: Collector) -> None:
        super().register(collector)
        self._in_order.append(collector)

    def unregister(self, collector: Collector) -> None:
        super().unregister(collector)
        self._in_order.remove(collector)

    def exposition(self, openmetrics: bool = False) -> bytes:
        """The /metrics body: text format 0.0.4, or OpenMetrics 1.0."""
        parts: list[bytes] = []
        for collector in list(self._in_order):
            own = getattr(collector, "exposition", None)
            if own is not None:
                parts.append(own(openmetrics=openmetrics).encode())
            elif openmetrics:
                parts.append(om_generate_latest(collector).removesuffix(OM_EOF))
            else:
                parts.append(generate_latest(collector))
        if openmetrics:
            parts.append(OM_EOF)
        return b"".join(parts)


class SlatraceCollector(Collector):
    """Every metric of the catalog, computed afresh at each scrape.

    sources carries what the store does not hold (the daemon's own loop
    figures, SLO config, throttling, breach counts, request delays).
    """

    def __init__(self, store: Store, *, sources: Sources | None = None) -> None:
        self._store = store
        self._sources = sources or Sources()

    def update_sources(self, **changes) -> None:
        """Replace some sources (the SLOs after a config reload)."""
        self._sources = dataclasses.replace(self._sources, **changes)

    def collect(self) -> Iterator[Metric]:
        for family in compute(self._store, self._sources):
            # A family with no points still has HELP/TYPE lines; skipping it keeps
            # the exposition to what is measured (and `promtool check metrics` quiet).
            if family.points:
                yield to_metric(family)

    def exposition(self, openmetrics: bool = False) -> str:
        """The same families as collect(), as exposition text."""
        return render(compute(self._store, self._sources), openmetrics)

    def describe(self) -> Iterator[Metric]:
        # Names only, so a registry with auto_describe can detect clashes
        # without running a scrape.
        for spec in SCHEDULER:
            yield declared(spec)
