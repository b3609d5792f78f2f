"""Metric figures computed from the store: one computation, many exporters.

The families are declared in agent/export/catalog.py (its SCHEDULER part); the
Prometheus collector turns the `Family` list computed here into its metric
families (and /metrics text); the OTLP metrics exporter reads those same families back from
the Prometheus registry. A figure (a bucket count, a wait total, a quantile) is
thus computed in exactly one place and the two exports cannot disagree. Pure:
no host access, no bcc, nothing at import time.

Counters are built from the store's totals since start, which never shrink;
gauges from its recent window. Figures the store does not hold (cgroup CPU
throttling, SLO breach counts, per-request scheduling delay) come from hooks in
`Sources`; without a hook the family is still declared (so the catalog and the
docs are complete) but carries no points.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from agent import __version__
from agent.attribution.slo import judge_slos
from agent.config import Slo
from agent.export.catalog import (
    AGENT_STATS,
    BPF_EVENTS,
    BPF_MISSES,
    BPF_RUN,
    BUILD_INFO,
    INTERVALS,
    IOWAIT,
    MAP_ERRORS,
    PREEMPTED_WAIT,
    PREEMPTIONS,
    QUANTILE_WINDOW_S,
    REQUEST_SCHED_DELAY,
    RUNQ_LATENCY,
    RUNQ_QUANTILE,
    RUNQ_WAIT,
    SCHEDULER,
    SERVICES_TRACKED,
    SLO_BREACHES,
    SLO_OK,
    SLO_TARGET,
    SLO_VALUE,
    THROTTLED,
    WAKEUP_WAIT,
    MetricSpec,
)
from agent.probe.layout import ERROR_MAPS
from agent.probe.snapshot import HIST_IOWAIT, HIST_RUNQ
from agent.store.histogram import Histogram, classic_bounds, cumulative_counts
from agent.store.store import IDLE, ServiceWindow, Store
from agent.store.table import ServiceTable, counter_row, quantiles, sum_by

QUANTILES = (0.5, 0.95, 0.99)
# The families read from the kernel's per-cgroup counters, each naming its fields.
CGROUP_COUNTER_FAMILIES = tuple(spec for spec in SCHEDULER if spec.cgroup_fields)
# by_service values exported per service, ranked by the wait they caused
# since the service was first seen; "idle" is exported besides them.
TOP_CULPRITS = 3
# The most series one service costs without buckets (docs/metrics.md's table
# lists them): a histogram without buckets is 3 (+Inf, _sum, _count), the
# quantile summary 5, a culprit 3; each per-cgroup counter one per field.
SERIES_PER_SERVICE = (
    3 + 1 + 5 + 3                # run-queue histogram, wait, quantiles; I/O-wait histogram
    + 1 + 3                      # throttling; request delay histogram
    + 3 * TOP_CULPRITS + 1       # the top culprits, and idle
    + sum(len(spec.cgroup_fields) for spec in CGROUP_COUNTER_FAMILIES if spec.in_budget))


@dataclass(frozen=True)
class Point:
    """A counter or gauge value for one label set."""

    labels: tuple[str, ...]
    value: float


@dataclass(frozen=True)
class HistogramPoint:
    """Cumulative bucket counts at `bounds` (seconds), then the total (+Inf)."""

    labels: tuple[str, ...]
    bounds: tuple[float, ...]
    cumulative: tuple[int, ...]
    sum: float

    @property
    def count(self) -> int:
        return self.cumulative[-1]


@dataclass(frozen=True)
class SummaryPoint:
    """Quantiles over a recent window, count and sum since start: the usual
    meaning of a Prometheus summary (client summaries slide their quantiles too)."""

    labels: tuple[str, ...]
    quantiles: tuple[tuple[float, float], ...]   # (q, value in seconds); empty without recent samples
    count: int
    sum: float


AnyPoint = Point | HistogramPoint | SummaryPoint


@dataclass(frozen=True)
class Family:
    spec: MetricSpec
    points: tuple[AnyPoint, ...]


@dataclass(frozen=True)
class AgentStats:
    """The collection loop's own figures, as the daemon keeps them."""

    poll_duration_seconds: float   # the last collection: map reads and the store's interval
    poll_errors: int               # collections that failed since start (retried next interval)
    # The self-check (agent/store/tally.py): kind -> waits the BPF programs
    # saw, and of them the ones that never reached the agent.
    waits_seen: Mapping[str, int] = field(default_factory=dict)
    waits_missing: Mapping[str, int] = field(default_factory=dict)


class Bucketed(Protocol):
    """A histogram already counted on the exported bounds (a HistogramPoint,
    or the trace side's per-request delays)."""

    bounds: tuple[float, ...]
    cumulative: tuple[int, ...]   # at each bound, then the total (+Inf)
    sum: float


@dataclass(frozen=True)
class Sources:
    """What the store does not hold; each hook returns cumulative figures.

    throttled_seconds: service -> seconds its cgroups were throttled (cpu.stat).
    slo_breaches: (service, slo name) -> intervals or requests that broke it;
      several sources (interval and request SLOs) combine with summed().
    request_sched_delay: service -> per-request run-queue wait, as a log-linear
      Histogram or already bucketed on `bounds` (Bucketed).
    bounds: the classic bucket bounds of every exported histogram.
    histograms: globs on service names whose histograms carry their buckets
      and whose every culprit is exported; any other service's histograms are
      exported as _sum, _count and the +Inf bucket only, and its top culprits
      (the series budget).
    agent_stats: the daemon's view of its own collection loop (AgentStats).
    """

    slos: tuple[Slo, ...] = ()
    bounds: tuple[float, ...] = field(default_factory=classic_bounds)
    histograms: tuple[str, ...] = ("*",)
    throttled_seconds: Callable[[], Mapping[str, float]] | None = None
    slo_breaches: Callable[[], Mapping[tuple[str, str], int]] | None = None
    request_sched_delay: Callable[[], Mapping[str, Histogram | Bucketed]] | None = None
    # (service, request SLO) -> (target, value judged over the last minute or None, ok)
    request_slos: Callable[[], Mapping[tuple[str, str], tuple[float, float | None, bool]]] | None = None
    agent_stats: Callable[[], AgentStats] | None = None


def read_points(spec: MetricSpec, figures: object) -> tuple[Point, ...]:
    """The points of a family its catalog entry reads (MetricSpec.read) from
    its source's figures: a number is one point without labels, a mapping one
    point per key (a label value, or a tuple of them), sorted."""
    assert spec.read is not None, spec.name
    value = spec.read(figures)
    if not isinstance(value, Mapping):
        return (Point((), value),)
    return tuple(Point(key if isinstance(key, tuple) else (key,), n) for key, n in sorted(value.items()))


def summed(*hooks: Callable[[], Mapping[tuple[str, str], int]]) -> Callable[[], dict[tuple[str, str], int]]:
    """One breach hook from several: each metric name must come from one
    family, so interval and request SLO breaches are added up here rather than
    exported by two collectors."""
    def total() -> dict[tuple[str, str], int]:
        out: dict[tuple[str, str], int] = {}
        for hook in hooks:
            for key, n in hook().items():
                out[key] = out.get(key, 0) + n
        return out
    return total


def histogram_point(labels: tuple[str, ...], hist: Histogram,
                    bounds: tuple[float, ...] | None = None) -> HistogramPoint:
    """Classic buckets of a log-linear histogram. The bounds sit on slot
    boundaries, so each cumulative count is exact, not re-estimated."""
    bounds = classic_bounds() if bounds is None else bounds
    return HistogramPoint(labels, bounds, tuple(cumulative_counts(hist, bounds)), hist.sum_seconds)


def without_buckets(p: HistogramPoint) -> HistogramPoint:
    """The same histogram as _sum, _count and the +Inf bucket only."""
    return HistogramPoint(p.labels, (), (p.count,), p.sum)


def histogram_services(globs: Iterable[str]) -> Callable[[str], bool]:
    """Whether a service's histograms carry buckets: its name matches one of globs."""
    patterns = tuple(globs)
    if "*" in patterns:
        return lambda _service: True
    return lambda service: any(fnmatch.fnmatchcase(service, g) for g in patterns)


def top_culprits(f: ServiceWindow, n: int = TOP_CULPRITS) -> frozenset[str]:
    """The by_service values exported for one service: the n that caused the
    most wait (after preempting it or while holding the CPU it waited for),
    plus "idle". The rest stay in slatrace_runq_wait_seconds_total, unattributed.

    Dropped, not summed into an "other" label: every exported counter is then
    a pair's true total, which only grows; a folded sum would shrink whenever
    the ranking changed, and Prometheus would read a counter reset.
    (exported_culprits() makes the same choice for every service at once.)"""
    caused: dict[str, int] = {}
    for table in (f.preempted_by, f.waited_behind):
        for by, p in table.items():
            if by != IDLE:
                caused[by] = caused.get(by, 0) + p.wait_ns
    ranked = sorted(caused, key=lambda by: (-caused[by], by))[:n]
    return frozenset(ranked) | {IDLE}


def exported_culprits(t: ServiceTable, every: np.ndarray, n: int = TOP_CULPRITS) -> tuple[np.ndarray, ...]:
    """The blame rows of `t` that are exported, as columns (victim, culprit,
    preempted, count, wait) sorted by victim name then culprit name: per
    victim the n culprits top_culprits() names, plus "idle"; every culprit of
    the victims `every` marks (a bool per name position)."""
    v, c, pre, count, wait = t.b_victim.astype(np.int64), t.b_culprit.astype(np.int64), t.b_preempted, \
        t.b_count, t.b_wait
    if not len(v):
        return v, c, pre, count, wait
    names = np.array(t.names, dtype=object)
    by_name = np.empty(len(names), np.int64)
    by_name[np.argsort(names, kind="stable")] = np.arange(len(names))
    idle = (names == IDLE)[c]
    size = len(names)
    pair = v * size + c
    pk, caused = sum_by(pair[~idle], wait[~idle])
    pv, pc = np.divmod(pk, size)
    order = np.lexsort((by_name[pc], -caused, pv))
    g = pv[order]
    first = np.flatnonzero(np.concatenate(([True], g[1:] != g[:-1]))) if len(g) else g
    rank = np.arange(len(g)) - np.repeat(first, np.diff(np.concatenate((first, [len(g)]))))
    keep = idle | every[v] | np.isin(pair, pk[order[rank < n]])
    v, c, pre, count, wait = v[keep], c[keep], pre[keep], count[keep], wait[keep]
    order = np.lexsort((by_name[c], by_name[v]))
    return v[order], c[order], pre[order], count[order], wait[order]


def compute(store: Store, sources: Sources = Sources(), now: float | None = None) -> list[Family]:
    """Every family of catalog.SCHEDULER, in its order, from one look at the store."""
    # Window first: a scrape racing an ingest then sees totals at least as new
    # as the window, never a window newer than the counters.
    window = store.window(QUANTILE_WINDOW_S, now=now, blame=False)
    totals = store.totals_table()
    services = totals.service_names
    bounds = sources.bounds
    bucketed = histogram_services(sources.histograms)
    points: dict[str, list[AnyPoint]] = {s.name: [] for s in SCHEDULER}

    # Every service's figures come from the totals' columns; a per-service
    # histogram is built only for the services whose buckets are exported.
    position = {totals.names[i]: i for i in totals.active.tolist()}
    runq = {i: (c, t) for i, c, t in zip(*(a.tolist() for a in totals.hist_totals(HIST_RUNQ)))}
    iowait = {i: (c, t) for i, c, t in zip(*(a.tolist() for a in totals.hist_totals(HIST_IOWAIT)))}
    counters = totals.counters.tolist()
    with_buckets = {s for s in services if bucketed(s)}

    def histogram(s: str, kind: int, count: int, sum_ns: int) -> HistogramPoint:
        if s in with_buckets:
            return histogram_point((s,), totals.histogram(position[s], kind), bounds)
        return HistogramPoint((s,), (), (count,), sum_ns / 1e9)

    # The series budget (docs/metrics.md): a kind that never happened to a
    # service has no series; culprits are the top few.
    for s in services:
        i = position[s]
        count, sum_ns = runq.get(i, (0, 0))
        if count:
            points[RUNQ_LATENCY.name].append(histogram(s, HIST_RUNQ, count, sum_ns))
            points[RUNQ_WAIT.name].append(Point((s,), sum_ns / 1e9))
        count, sum_ns = iowait.get(i, (0, 0))
        if count:
            points[IOWAIT.name].append(histogram(s, HIST_IOWAIT, count, sum_ns))
        cnt = counter_row(counters[i])
        for spec in CGROUP_COUNTER_FAMILIES:
            for name, labels in spec.cgroup_fields:
                if cnt[name]:
                    points[spec.name].append(Point((s, *labels), cnt[name] * spec.cgroup_scale))

    # Services given buckets (an SLO, a rule, `histograms`) keep every culprit too.
    every = np.array([name in with_buckets for name in totals.names], bool)
    names = totals.names
    for v, c, pre, count, wait in zip(*(a.tolist() for a in exported_culprits(totals, every))):
        labels = (names[v], names[c])
        if pre:
            points[PREEMPTIONS.name].append(Point(labels, count))
            points[PREEMPTED_WAIT.name].append(Point(labels, wait / 1e9))
        else:
            points[WAKEUP_WAIT.name].append(Point(labels, wait / 1e9))

    recent = quantiles(window.table, HIST_RUNQ, QUANTILES) if window.table is not None else {}
    for s in services:
        count, sum_ns = runq.get(position[s], (0, 0))
        if count:
            qs = tuple(zip(QUANTILES, recent[s])) if s in recent else ()
            points[RUNQ_QUANTILE.name].append(SummaryPoint((s,), qs, count, sum_ns / 1e9))

    # SLOs are judged for every configured service that has been seen, on the
    # same window as the quantile gauges, with the attribution API's judge.
    for s in sorted({slo.service for slo in sources.slos} & set(position)):
        figures = window.services.get(s)
        if figures is None:
            continue
        for r in judge_slos(sources.slos, s, figures):
            points[SLO_TARGET.name].append(Point((s, r.name), r.target))
            if r.value is not None:
                points[SLO_VALUE.name].append(Point((s, r.name), r.value))
            points[SLO_OK.name].append(Point((s, r.name), 1.0 if r.ok else 0.0))
    if sources.request_slos is not None:
        for (s, name), (target, value, ok) in sorted(sources.request_slos().items()):
            points[SLO_TARGET.name].append(Point((s, name), target))
            if value is not None:
                points[SLO_VALUE.name].append(Point((s, name), value))
            points[SLO_OK.name].append(Point((s, name), 1.0 if ok else 0.0))

    if sources.throttled_seconds is not None:
        for s, v in sorted(sources.throttled_seconds().items()):
            if v:
                points[THROTTLED.name].append(Point((s,), v))
    if sources.slo_breaches is not None:
        for (s, slo), n in sorted(sources.slo_breaches().items()):
            points[SLO_BREACHES.name].append(Point((s, slo), n))
    if sources.request_sched_delay is not None:
        for s, h in sorted(sources.request_sched_delay().items()):
            if isinstance(h, Histogram):
                p = histogram_point((s,), h, bounds)
            else:
                if tuple(h.bounds) != bounds:
                    raise ValueError(f"request delay histogram of {s!r} is not bucketed on the exported bounds")
                p = HistogramPoint((s,), tuple(h.bounds), tuple(h.cumulative), h.sum)
            if p.count:
                points[REQUEST_SCHED_DELAY.name].append(p if bucketed(s) else without_buckets(p))

    for name, st in sorted(store.programs().items()):
        points[BPF_EVENTS.name].append(Point((name,), st.run_cnt))
        points[BPF_RUN.name].append(Point((name,), st.run_time_ns / 1e9))
        points[BPF_MISSES.name].append(Point((name,), st.misses))
    # Every map is exported from the start, at 0: an error counter that appears
    # only with the first error defeats rate() and increase() in alerts.
    errors = {m: 0 for m in ERROR_MAPS} | store.error_totals()
    for name, n in sorted(errors.items()):
        points[MAP_ERRORS.name].append(Point((name,), n))

    if sources.agent_stats is not None:
        stats = sources.agent_stats()
        for spec in SCHEDULER:
            if spec.source == AGENT_STATS:
                points[spec.name] += read_points(spec, stats)
    points[SERVICES_TRACKED.name].append(Point((), float(len(services))))
    points[INTERVALS.name].append(Point((), float(store.intervals_collected)))
    points[BUILD_INFO.name].append(Point((__version__,), 1.0))

    return [Family(spec, tuple(points[spec.name])) for spec in SCHEDULER]
