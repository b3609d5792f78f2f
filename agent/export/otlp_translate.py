"""Prometheus metric families -> OTLP MetricsData, point for point.

The data are the families of the very registry /metrics serves; their units
come from the catalog (agent/export/catalog.py), as their help text did.
Nothing is re-recorded through SDK instruments: an instrument would
re-aggregate synthetic samples, while the agent already has exact cumulative
bucket counts. Every point carries the end of the newest interval in the store
as its time, so a reader can tell which cumulative state it describes.
"""

from __future__ import annotations

import logging
import math
import time

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from prometheus_client.metrics_core import Metric as PromMetric
from prometheus_client.registry import CollectorRegistry

from agent import __version__
from agent.export.catalog import FAMILIES
from agent.store.store import IntervalRecord, Store

__all__ = ["SCOPE_NAME", "build_metrics_data", "family_to_metric", "store_start_ns"]

log = logging.getLogger("slatrace.otlp")

SCOPE_NAME = "slatrace"
def _unit(family: PromMetric) -> str:
    """The catalog's unit; a family the catalog does not declare (registered
    by a test, say) gets one from its name."""
    spec = FAMILIES.get(family.name)
    if spec is not None:
        return spec.unit
    if family.unit:
        return "s" if family.unit == "seconds" else family.unit
    return "s" if family.name.endswith("_seconds") else ""


def _number(value: float) -> int | float:
    # The encoder picks as_int for ints and as_double for floats; counts the
    # collectors hand over as ints stay ints, so they read back exactly.
    return int(value) if isinstance(value, bool) else value


def _histogram_points(family: PromMetric, start_ns: int, time_ns: int) -> list[HistogramDataPoint]:
    # Samples of one series share the labels other than `le`.
    series: dict[tuple[tuple[str, str], ...], dict[str, object]] = {}
    for s in family.samples:
        labels = {k: v for k, v in s.labels.items() if k != "le"}
        entry = series.setdefault(tuple(sorted(labels.items())), {"labels": labels, "buckets": []})
        if s.name == family.name + "_bucket":
            entry["buckets"].append((float(s.labels["le"]), s.value))  # type: ignore[union-attr]
        elif s.name == family.name + "_count":
            entry["count"] = s.value
        elif s.name == family.name + "_sum":
            entry["sum"] = s.value
    points = []
    for entry in series.values():
        buckets = sorted(entry["buckets"])  # type: ignore[arg-type]
        if not buckets or buckets[-1][0] != math.inf:
            log.debug("histogram %s has no +Inf bucket; not exported", family.name)
            continue
        cumulative = [int(v) for _, v in buckets]
        per_bucket = [c - p for p, c in zip([0] + cumulative[:-1], cumulative)]
        if any(n < 0 for n in per_bucket):
            log.warning("histogram %s %s has decreasing cumulative counts; not exported",
                        family.name, entry["labels"])
            continue
        points.append(HistogramDataPoint(
            attributes=dict(entry["labels"]),  # type: ignore[arg-type]
            start_time_unix_nano=start_ns,
            time_unix_nano=time_ns,
            count=int(entry.get("count", cumulative[-1])),  # type: ignore[arg-type]
            sum=float(entry.get("sum", 0.0)),  # type: ignore[arg-type]
            bucket_counts=per_bucket,
            explicit_bounds=[le for le, _ in buckets[:-1]],
            # Unknown: the kernel keeps per-slot counts, not extremes. None leaves
            # the optional proto fields unset rather than claiming a value.
            min=None,  # type: ignore[arg-type]
            max=None,  # type: ignore[arg-type]
        ))
    return points


def family_to_metric(family: PromMetric, start_ns: int, time_ns: int) -> Metric | None:
    """One Prometheus metric family as one OTLP metric (cumulative), or None
    when it has no points or is of a type OTLP has no direct equivalent for
    (stateset, gaugehistogram)."""
    kind = family.type
    if kind == "counter":
        points = [NumberDataPoint(dict(s.labels), start_ns, time_ns, _number(s.value))
                  for s in family.samples if s.name == family.name + "_total"]
        data: Sum | Gauge | Histogram = Sum(points, AggregationTemporality.CUMULATIVE, is_monotonic=True)
        name = family.name
    elif kind in ("gauge", "unknown", "info"):
        # An info family's only sample is NAME_info = 1; Prometheus shows it so.
        sample_name = family.name + "_info" if kind == "info" else family.name
        points = [NumberDataPoint(dict(s.labels), 0, time_ns, _number(s.value))
                  for s in family.samples if s.name == sample_name]
        data = Gauge(points)
        name = sample_name
    elif kind == "histogram":
        data = Histogram(_histogram_points(family, start_ns, time_ns), AggregationTemporality.CUMULATIVE)
        name = family.name
    elif kind == "summary":
        # The SDK has no summary type to encode, and the interface names these
        # a gauge with a `quantile` attribute. The _sum/_count samples repeat
        # the matching histogram's and are left out.
        points = [NumberDataPoint(dict(s.labels), 0, time_ns, _number(s.value))
                  for s in family.samples if s.name == family.name and "quantile" in s.labels]
        data = Gauge(points)
        name = family.name
    else:
        return None
    if not data.data_points:
        return None  # a metric without points encodes to one with no data at all
    return Metric(name=name, description=family.documentation, unit=_unit(family), data=data)


def _consistent_families(registry: CollectorRegistry, store: Store,
                         attempts: int = 3) -> tuple[list[PromMetric], IntervalRecord | None]:
    """The registry's families and the newest interval they include.

    The store swaps totals and the newest record under one lock, so when the
    newest record is the same object before and after collecting, the families
    describe exactly the state that ends at that record.
    """
    families: list[PromMetric] = []
    before = store.latest()
    for _ in range(attempts):
        families = list(registry.collect())
        after = store.latest()
        if after is before:
            break
        before = after
    return families, before


def build_metrics_data(registry: CollectorRegistry, store: Store, resource: Resource,
                       start_ns: int | None = None) -> MetricsData | None:
    """MetricsData of everything the registry exposes, stamped with the end of
    the newest interval; None before the first interval."""
    families, latest = _consistent_families(registry, store)
    if latest is None:
        return None
    if start_ns is None:
        start_ns = store_start_ns(store)
    time_ns = int(latest.end * 1e9)
    metrics = [m for m in (family_to_metric(f, start_ns, time_ns) for f in families) if m is not None]
    scope = InstrumentationScope(SCOPE_NAME, __version__)
    return MetricsData([ResourceMetrics(resource, [ScopeMetrics(scope, metrics, "")], "")])


def store_start_ns(store: Store) -> int:
    """When the store's cumulative totals began: the start of its oldest interval
    (exact while the first interval is still retained, which it is at the first
    export unless retention is shorter than the export interval)."""
    records = store.records(math.inf)
    return int(min(r.start for r in records) * 1e9) if records else time.time_ns()
