"""`slatrace attribution --prometheus URL`: the attribution records for a whole
fleet, rebuilt from what Prometheus scraped from every agent.

Quantiles are `histogram_quantile` over the buckets summed across agents;
a service exported without buckets (the series budget: no SLO, rule or
`histograms` entry names it) gets the agent's own run-queue quantiles over
its last 60 s instead, and no I/O-wait quantile. Counts and seconds are
`increase` of the counters over the window. Blame and
verdicts are computed by the agent's own rule (attribution.blame_from_totals),
so the two answers differ only by what Prometheus stores: the classic bucket
bounds (about 1.4x apart) and the scrape grid.

Asked for the window the shipped `slatrace.fleet` rules precompute (5 m), and
when Prometheus holds their series fresh, every figure is read from those
recorded series (already summed, or maximised, over the nodes) instead of
re-summing every node's raw series: the same expressions, evaluated by the
rules at their last evaluation, whose moment ends the window. The answer
then costs the same at any number of nodes. A figure the rules hold no series
for is asked raw at that same moment: rules from before it was recorded give
the right answer that way, and where no node exports the figure at all the
raw query reads nothing.
"""

from __future__ import annotations

import math
import time
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from agent.attribution.blame import blame_from_totals
from agent.attribution.verdict import verdict
from agent.cli.client import FetchError, fetch_json
from agent.errors import SlatraceError

__all__ = ["PrometheusError", "PrometheusQuery", "fleet_attribution", "recorded_series"]

QUANTILES = (0.5, 0.95, 0.99)
# Queries in flight at once: more than a small Prometheus has cores only makes
# each one slower (and nearer the timeout).
PARALLEL_QUERIES = 4
# The window of the shipped fleet rules' `:rate5m` series (deploy/rules/slatrace.rules.yaml).
RULES_WINDOW_S = 300
# Recorded series older than this are not used: the docs ask for an evaluation
# every 15 s to 1 min, so older ones mean the rules are not keeping up.
RECORDED_MAX_AGE_S = 60.0
# The fleet rules' rates, by the figure they stand for: summed again over the
# figure's labels (a global layer above several Prometheus servers holds one
# series per cluster) and multiplied by the window, they are its increase.
RECORDED_RATES = {
    "count": "service:slatrace_runq_latency_seconds_count:rate5m",
    "wait": "service:slatrace_runq_wait_seconds:rate5m",
    "io_count": "service:slatrace_iowait_seconds_count:rate5m",
    "io_sum": "service:slatrace_iowait_seconds_sum:rate5m",
    "migrations": "service:slatrace_migrations:rate5m",
    "throttled": "service:slatrace_cpu_throttled_seconds:rate5m",
    "pre_count": "service_by_service:slatrace_preemptions:rate5m",
    "pre_wait": "service_by_service:slatrace_preempted_wait_seconds:rate5m",
    "breaches": "service_slo:slatrace_slo_breaches:rate5m",
}
# Their summed bucket rates, by the histogram they sum.
RECORDED_BUCKETS = {
    "slatrace_runq_latency_seconds": "service_le:slatrace_runq_latency_seconds_bucket:rate5m",
    "slatrace_iowait_seconds": "service_le:slatrace_iowait_seconds_bucket:rate5m",
}
# Their maxima over the nodes, by the gauge they take it of: the maximum of
# these again is the answer at any layer.
RECORDED_MAXIMA = {
    "slatrace_runq_latency_quantile_seconds": "service_quantile:slatrace_runq_latency_quantile_seconds:max",
    "slatrace_slo_target_seconds": "service_slo:slatrace_slo_target_seconds:max",
}


class PrometheusError(SlatraceError):
    """One sentence: Prometheus could not be asked or did not answer."""


class PrometheusQuery:
    """Instant queries against the Prometheus HTTP API (/api/v1/query)."""

    def __init__(self, url: str, timeout: float = 10.0, clock: Callable[[], float] = time.time) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._clock = clock

    def vector(self, expr: str, at: float) -> list[tuple[dict[str, str], float]]:
        query = urllib.parse.urlencode({"query": expr, "time": f"{at:.3f}"})
        url = f"{self.url}/api/v1/query?{query}"
        try:
            doc = fetch_json(url, self.timeout, what=f"Prometheus at {self.url}")
        except FetchError as e:
            if e.sentence:
                raise PrometheusError(e.sentence) from None
            if e.not_json:
                raise PrometheusError(f"Prometheus at {self.url} did not answer JSON; is it a Prometheus "
                                      "server?") from None
            if e.status is not None:
                raise PrometheusError(f"Prometheus at {self.url} refused the query ({e.status}: {e.detail})") \
                    from None
            raise PrometheusError(f"cannot reach Prometheus at {self.url} ({e.detail}); "
                                  "check the --prometheus URL") from None
        if doc.get("status") != "success" or doc.get("data", {}).get("resultType") != "vector":
            raise PrometheusError(f"Prometheus at {self.url} answered {doc.get('error') or doc.get('status')}")
        out = []
        for item in doc["data"]["result"]:
            value = float(item["value"][1])
            if not math.isnan(value):
                out.append((item["metric"], value))
        return out


def _by_service(rows: list[tuple[dict[str, str], float]]) -> dict[str, float]:
    return {labels.get("service", ""): v for labels, v in rows}


def recorded_series(prom: PrometheusQuery, at: float, service: str | None = None,
                    max_age: float = RECORDED_MAX_AGE_S) -> tuple[float, frozenset[str]] | None:
    """The last evaluation, at or before `at`, at which the fleet rules
    recorded every series read here for the service (or all), and which of
    those series hold anything; None when the rules hold none that fresh.
    A group's rules are written one after another with the evaluation's
    timestamp: the oldest of each series' newest sample is the last
    evaluation all of them have finished."""
    sel = f'{{service="{service}"}}' if service else ""
    series = [*RECORDED_RATES.values(), *RECORDED_BUCKETS.values(), *RECORDED_MAXIMA.values()]  # "count" first
    with ThreadPoolExecutor(max_workers=PARALLEL_QUERIES) as pool:
        newest = list(pool.map(lambda s: prom.vector(f"max(timestamp({s}{sel}))", at), series))
    if not newest[0]:
        return None   # no run-queue figures recorded: the rules are not loaded (or not for it)
    moment = min(rows[0][1] for rows in newest if rows)
    if not at - max_age <= moment <= at:
        return None
    return moment, frozenset(s for s, rows in zip(series, newest) if rows)


def fleet_attribution(prom: PrometheusQuery, since: float, at: float | None = None,
                      service: str | None = None, rules_window: float = RULES_WINDOW_S) -> dict:
    """The /api/v1/attribution document (same shape, `source: prometheus`, or
    `prometheus_recorded` when read from the fleet rules' series) for the
    `since` seconds before `at`, summed over every scraped agent.
    `rules_window` is the window the rules' `:rate5m` series cover."""
    at = prom._clock() if at is None else at
    window = max(1, round(since))
    rng = f"[{window}s]"
    sel_inner = f', service="{service}"' if service else ""
    sel = f'{{service="{service}"}}' if service else ""
    recorded = recorded_series(prom, at, service) if window == round(rules_window) else None
    held: frozenset[str] = frozenset()
    if recorded is not None:
        at, held = recorded   # the window the rules' figures cover ends at their evaluation

    # Every query is independent: a few run at once (Prometheus evaluates them in
    # parallel), which at a thousand nodes is most of the answer's time.
    queries: dict[str, str] = {}
    rates: set[str] = set()   # keys answered by recorded rates: times the window below

    def inc(key: str, metric: str, by: str = "service") -> None:
        if RECORDED_RATES[key] in held:
            queries[key] = f"sum by ({by}) ({RECORDED_RATES[key]}{sel})"
            rates.add(key)
        else:
            queries[key] = f"sum by ({by}) (increase({metric}{sel}{rng}))"

    def quantile(key: str, metric: str, q: float) -> None:
        # A histogram with the +Inf bucket only answers NaN, which vector() drops.
        if RECORDED_BUCKETS[metric] in held:
            buckets = f"{RECORDED_BUCKETS[metric]}{sel}"
        else:
            buckets = f"increase({metric}_bucket{sel}{rng})"
        queries[key] = f"histogram_quantile({q}, sum by (service, le) ({buckets}))"

    def maxima(gauge: str) -> str:
        # The nodes' gauges, or the rules' maxima of them: the maximum of either is the answer.
        return RECORDED_MAXIMA[gauge] if RECORDED_MAXIMA[gauge] in held else gauge

    inc("count", "slatrace_runq_latency_seconds_count")
    inc("wait", "slatrace_runq_latency_seconds_sum")
    for q in QUANTILES:
        queries[f"gauge{q}"] = (f"max by (service) ({maxima('slatrace_runq_latency_quantile_seconds')}"
                                f'{{quantile="{q}"{sel_inner}}})')
        quantile(f"buckets{q}", "slatrace_runq_latency_seconds", q)
    inc("io_count", "slatrace_iowait_seconds_count")
    inc("io_sum", "slatrace_iowait_seconds_sum")
    quantile("io_p99", "slatrace_iowait_seconds", 0.99)
    inc("migrations", "slatrace_migrations_total")
    inc("throttled", "slatrace_cpu_throttled_seconds_total")
    inc("pre_count", "slatrace_preemptions_total", "service, by_service")
    inc("pre_wait", "slatrace_preempted_wait_seconds_total", "service, by_service")
    queries["targets"] = f"max by (service, slo) ({maxima('slatrace_slo_target_seconds')}{sel})"
    inc("breaches", "slatrace_slo_breaches_total", "service, slo")
    with ThreadPoolExecutor(max_workers=PARALLEL_QUERIES) as pool:
        answers = dict(zip(queries, pool.map(lambda expr: prom.vector(expr, at), queries.values())))
    for key in rates:
        answers[key] = [(labels, v * window) for labels, v in answers[key]]
    source = "prometheus" if recorded is None else "prometheus_recorded"

    count = _by_service(answers["count"])
    wait = _by_service(answers["wait"])
    # The agent's own quantiles where a service has no buckets.
    qs = {q: _by_service(answers[f"gauge{q}"]) | _by_service(answers[f"buckets{q}"]) for q in QUANTILES}
    io_count = _by_service(answers["io_count"])
    io_sum = _by_service(answers["io_sum"])
    io_p99 = _by_service(answers["io_p99"])
    migrations = _by_service(answers["migrations"])
    throttled = _by_service(answers["throttled"])
    pre_count: dict[str, dict[str, float]] = {}
    pre_wait: dict[str, dict[str, float]] = {}
    for target, key in ((pre_count, "pre_count"), (pre_wait, "pre_wait")):
        for labels, v in answers[key]:
            target.setdefault(labels.get("service", ""), {})[labels.get("by_service", "")] = v
    targets = {(labels.get("service", ""), labels.get("slo", "")): v for labels, v in answers["targets"]}
    breaches = {(labels.get("service", ""), labels.get("slo", "")): v for labels, v in answers["breaches"]}

    records = []
    for name in sorted(set(count) | set(io_count)):
        if not count.get(name) and not io_count.get(name):
            continue  # nothing happened to it in the window
        by = sorted(pre_wait.get(name, {}).items(), key=lambda kv: kv[1], reverse=True)
        runq = {"count": round(count.get(name, 0.0)), "wait_seconds": wait.get(name, 0.0),
                "p50": qs[0.5].get(name), "p95": qs[0.95].get(name), "p99": qs[0.99].get(name)}
        slo = []
        for (svc, slo_name), target in sorted(targets.items()):
            if svc != name:
                continue
            value = {"runq_p99": runq["p99"], "runq_p95": runq["p95"], "iowait_p99": io_p99.get(name)}.get(slo_name)
            if slo_name not in ("runq_p99", "runq_p95", "iowait_p99"):
                continue
            slo.append({"name": slo_name, "target": target, "value": value,
                        "ok": value is None or value <= target,
                        "intervals_breached": round(breaches.get((name, slo_name), 0.0))})
        record = {
            "service": name, "start": at - since, "end": at, "source": source,
            "runq": runq,
            "preemption": {
                "count": round(sum(pre_count.get(name, {}).values())),
                "wait_seconds": sum(w for _, w in by),
                "by": [{"service": b, "count": round(pre_count.get(name, {}).get(b, 0.0)), "wait_seconds": w}
                       for b, w in by],
            },
            "iowait": {"count": round(io_count.get(name, 0.0)), "seconds": io_sum.get(name, 0.0),
                       "p99": io_p99.get(name)},
            "migrations": round(migrations.get(name, 0.0)),
            "throttled_seconds": throttled.get(name, 0.0),
            "slo": slo,
            "blame": blame_from_totals(name, wait.get(name, 0.0), io_sum.get(name, 0.0), dict(by),
                                       throttled.get(name, 0.0)),
        }
        record["verdict"] = verdict(record)
        records.append(record)
    records.sort(key=lambda r: r["runq"]["p99"] or 0.0, reverse=True)
    return {"attribution": records}
