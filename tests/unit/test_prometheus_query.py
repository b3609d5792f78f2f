"""`attribution --prometheus` reads the fleet rules' recorded series when they
cover the window asked and are fresh, the raw counters otherwise; over the
same figures both give the same records.

The fake Prometheus answers each query from one table of window totals: raw
queries get the totals (`increase`), recorded ones the totals over the rules'
300 s (`rate`), the way Prometheus's rules define them; the maxima of gauges
are the same either way. The real thing is tests/e2e/test_fleet.py.
"""

from __future__ import annotations

import re

import pytest
import yaml

from agent.cli.prometheus_query import (
    RECORDED_BUCKETS,
    RECORDED_MAX_AGE_S,
    RECORDED_MAXIMA,
    RECORDED_RATES,
    RULES_WINDOW_S,
    fleet_attribution,
)
from tests.support.prometheus import RULES

NOW = 1_800_000_000.0
WINDOW = RULES_WINDOW_S
# service -> figures over the window; by_service and slo keyed tables inside.
TOTALS = {
    "shop/api": {"count": 12_000.0, "wait": 3.5, "io_count": 40.0, "io_sum": 0.25, "migrations": 17.0,
                 "throttled": 0.0, "p0.5": 0.0002, "p0.95": 0.001, "p0.99": 0.004, "io_p99": 0.02,
                 "pre_count": {"batch/worker": 300.0, "ads/api": 20.0},
                 "pre_wait": {"batch/worker": 1.25, "ads/api": 0.5},
                 "targets": {"runq_p99": 0.003}, "breaches": {"runq_p99": 180.0}},
    "batch/worker": {"count": 900.0, "wait": 0.75, "io_count": 0.0, "io_sum": 0.0, "migrations": 2.0,
                     "throttled": 0.5, "g0.5": 0.0003, "g0.95": 0.002, "g0.99": 0.006,
                     "pre_count": {"shop/api": 50.0}, "pre_wait": {"shop/api": 0.25},
                     "targets": {}, "breaches": {}},
}
RAW = {"slatrace_runq_latency_seconds_count": "count", "slatrace_runq_latency_seconds_sum": "wait",
       "slatrace_iowait_seconds_count": "io_count", "slatrace_iowait_seconds_sum": "io_sum",
       "slatrace_migrations_total": "migrations", "slatrace_cpu_throttled_seconds_total": "throttled",
       "slatrace_preemptions_total": "pre_count", "slatrace_preempted_wait_seconds_total": "pre_wait",
       "slatrace_slo_breaches_total": "breaches"}
RECORDED = {"service:slatrace_runq_latency_seconds_count:rate5m": "count",
            "service:slatrace_runq_wait_seconds:rate5m": "wait",
            "service:slatrace_iowait_seconds_count:rate5m": "io_count",
            "service:slatrace_iowait_seconds_sum:rate5m": "io_sum",
            "service:slatrace_migrations:rate5m": "migrations",
            "service:slatrace_cpu_throttled_seconds:rate5m": "throttled",
            "service_by_service:slatrace_preemptions:rate5m": "pre_count",
            "service_by_service:slatrace_preempted_wait_seconds:rate5m": "pre_wait",
            "service_slo:slatrace_slo_breaches:rate5m": "breaches"}
RUNQ_BUCKETS = "service_le:slatrace_runq_latency_seconds_bucket:rate5m"
IO_BUCKETS = "service_le:slatrace_iowait_seconds_bucket:rate5m"
GAUGE_MAX = "service_quantile:slatrace_runq_latency_quantile_seconds:max"
TARGET_MAX = "service_slo:slatrace_slo_target_seconds:max"
EVERY_RECORD = frozenset(RECORDED) | {RUNQ_BUCKETS, IO_BUCKETS, GAUGE_MAX, TARGET_MAX}
# What the fleet rules recorded before they recorded I/O wait, migrations,
# throttling, the nodes' quantiles and the SLO targets.
FIRST_RECORDS = frozenset({"service:slatrace_runq_latency_seconds_count:rate5m",
                           "service:slatrace_runq_wait_seconds:rate5m",
                           "service_by_service:slatrace_preemptions:rate5m",
                           "service_by_service:slatrace_preempted_wait_seconds:rate5m",
                           "service_slo:slatrace_slo_breaches:rate5m", RUNQ_BUCKETS})


class FakePrometheus:
    def __init__(self, recorded_at: float | None, newer: dict[str, float] | None = None,
                 held: frozenset[str] = EVERY_RECORD) -> None:
        # recorded_at: the rules' last evaluation; newer: series already written by
        # the next one; held: the recorded series the rules write
        self.recorded_at = recorded_at
        self.newer = newer or {}
        self.held = held
        self.asked: list[tuple[str, float]] = []

    def _clock(self) -> float:
        return NOW

    def _series(self, series: str, *allowed: str) -> None:
        assert series in allowed, series
        assert ":" not in series or series in self.held, f"{series} is not recorded here"

    def vector(self, expr: str, at: float) -> list[tuple[dict[str, str], float]]:
        self.asked.append((expr, at))
        only = re.search(r'service="([^"]+)"', expr)
        services = [s for s in TOTALS if only is None or s == only.group(1)]
        if m := re.match(r"max\(timestamp\(([\w:]+)", expr):
            if m.group(1) not in self.held:
                return []
            at_most = [t for t in (self.newer.get(m.group(1)), self.recorded_at) if t is not None and t <= at]
            return [({}, at_most[0])] if at_most else []
        if m := re.match(r'max by \(service\) \(([\w:]+)\{quantile="([\d.]+)"', expr):
            series, q = m.groups()
            self._series(series, "slatrace_runq_latency_quantile_seconds", GAUGE_MAX)
            return [({"service": s}, TOTALS[s][f"g{q}"]) for s in services if f"g{q}" in TOTALS[s]]
        if m := re.match(r"histogram_quantile\(([\d.]+), sum by \(service, le\) \(([\w:]+)", expr):
            q, series = m.groups()
            if series != "increase":
                self._series(series, RUNQ_BUCKETS, IO_BUCKETS)
            key = "io_p99" if "iowait" in expr else f"p{q}"
            return [({"service": s}, TOTALS[s][key]) for s in services if key in TOTALS[s]]
        if m := re.match(r"max by \(service, slo\) \(([\w:]+)", expr):
            self._series(m.group(1), "slatrace_slo_target_seconds", TARGET_MAX)
            return [({"service": s, "slo": k}, v) for s in services for k, v in TOTALS[s]["targets"].items()]
        m = re.match(r"sum by \(([\w, ]+)\) \((?:increase\()?([\w:]+)", expr)
        assert m, expr
        by, series = m.groups()
        if series in RECORDED:
            self._series(series, series)
        key, scale = (RAW[series], 1.0) if series in RAW else (RECORDED[series], 1.0 / RULES_WINDOW_S)
        out = []
        for s in services:
            value = TOTALS[s][key]
            if isinstance(value, dict):
                inner = by.split(", ")[1]
                out += [({"service": s, inner: k}, v * scale) for k, v in value.items()]
            else:
                out.append(({"service": s}, value * scale))
        return out


def _without_window(doc: dict) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("start", "end", "source")} for r in doc["attribution"]]


def assert_close(a: object, b: object, path: str = "") -> None:
    """Equal, numbers within float rounding (a rate times its window)."""
    if isinstance(a, dict) and isinstance(b, dict):
        assert set(a) == set(b), path
        for k in a:
            assert_close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_close(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-12), path
    else:
        assert a == b, path


def test_recorded_series_give_the_raw_answer_and_end_at_their_evaluation() -> None:
    raw = fleet_attribution(FakePrometheus(None), WINDOW)
    fresh = FakePrometheus(NOW - 10)
    recorded = fleet_attribution(fresh, WINDOW)
    assert [r["source"] for r in raw["attribution"]] == ["prometheus"] * 2
    assert [r["source"] for r in recorded["attribution"]] == ["prometheus_recorded"] * 2
    assert_close(_without_window(recorded), _without_window(raw))
    shop = next(r for r in recorded["attribution"] if r["service"] == "shop/api")
    assert shop["runq"]["count"] == 12_000 and shop["runq"]["wait_seconds"] == pytest.approx(3.5)
    assert shop["slo"][0]["intervals_breached"] == 180 and shop["slo"][0]["ok"] is False
    assert [b["service"] for b in shop["preemption"]["by"]] == ["batch/worker", "ads/api"]
    assert (shop["start"], shop["end"]) == (NOW - 10 - WINDOW, NOW - 10)
    # Every figure over the window that ends at the rules' evaluation, and
    # every one from the recorded series: nothing raw is left to read.
    asked = [(e, at) for e, at in fresh.asked if not e.startswith("max(timestamp(")]
    assert {at for _, at in asked} == {NOW - 10}
    assert all(re.search(r"\((service\w*:[\w:]+)", e) for e, _ in asked)
    assert not any("increase(" in e or re.search(r"\(slatrace_", e) for e, _ in asked)


def test_figures_the_rules_do_not_record_are_read_raw_over_the_same_window() -> None:
    # Rules from before I/O wait, migrations, throttling, the nodes' quantiles
    # and the SLO targets were recorded: those are asked raw, the rest is not,
    # and the answer is the same.
    raw = fleet_attribution(FakePrometheus(None), WINDOW)
    older = FakePrometheus(NOW - 10, held=FIRST_RECORDS)
    doc = fleet_attribution(older, WINDOW)
    assert {r["source"] for r in doc["attribution"]} == {"prometheus_recorded"}
    assert_close(_without_window(doc), _without_window(raw))
    asked = [(e, at) for e, at in older.asked if not e.startswith("max(timestamp(")]
    assert {at for _, at in asked} == {NOW - 10}
    raw_read = {m for e, _ in asked for m in re.findall(r"\((slatrace_\w+)", e)}
    assert raw_read == {"slatrace_runq_latency_quantile_seconds", "slatrace_iowait_seconds_count",
                        "slatrace_iowait_seconds_sum", "slatrace_iowait_seconds_bucket", "slatrace_migrations_total",
                        "slatrace_cpu_throttled_seconds_total", "slatrace_slo_target_seconds"}


def test_every_series_read_is_one_the_fleet_rules_record() -> None:
    (fleet,) = [g for g in yaml.safe_load(RULES.read_text())["groups"] if g["name"] == "slatrace.fleet"]
    records = {r["record"] for r in fleet["rules"] if "record" in r}
    read = {*RECORDED_RATES.values(), *RECORDED_BUCKETS.values(), *RECORDED_MAXIMA.values()}
    assert read == EVERY_RECORD and read <= records


@pytest.mark.parametrize("since, recorded_at", [
    (60, NOW - 10),                             # not the rules' window
    (WINDOW, None),                             # no recorded series
    (WINDOW, NOW - RECORDED_MAX_AGE_S - 1),     # the rules are not keeping up
])
def test_raw_counters_otherwise(since: float, recorded_at: float | None) -> None:
    prom = FakePrometheus(recorded_at)
    doc = fleet_attribution(prom, since)
    assert {r["source"] for r in doc["attribution"]} == {"prometheus"}
    assert {at for _, at in prom.asked} == {NOW}
    assert not any(":rate5m" in e for e, _ in prom.asked if not e.startswith("max(timestamp("))
    assert doc["attribution"][0]["end"] == NOW


def test_one_service_asks_for_its_own_recorded_series() -> None:
    prom = FakePrometheus(NOW - 5)
    doc = fleet_attribution(prom, WINDOW, service="batch/worker")
    assert [r["service"] for r in doc["attribution"]] == ["batch/worker"]
    assert doc["attribution"][0]["source"] == "prometheus_recorded"
    # Without buckets: the nodes' own quantiles, as on the raw path.
    assert doc["attribution"][0]["runq"]["p99"] == 0.006
    assert all('service="batch/worker"' in e for e, _ in prom.asked)


def test_an_evaluation_still_being_written_is_not_read() -> None:
    # The rules' next evaluation has written the first series of the group
    # but not yet the culprits: every figure is read at the one before.
    prom = FakePrometheus(NOW - 20, newer={"service:slatrace_runq_latency_seconds_count:rate5m": NOW - 5,
                                           "service_le:slatrace_runq_latency_seconds_bucket:rate5m": NOW - 5})
    doc = fleet_attribution(prom, WINDOW)
    assert {r["end"] for r in doc["attribution"]} == {NOW - 20}
    assert {at for e, at in prom.asked if not e.startswith("max(timestamp(")} == {NOW - 20}
