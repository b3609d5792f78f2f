"""Prometheus exposition: a Collector that reads the store at scrape time.

Nothing is mutated from the poll loop; each scrape yields metric families built
from the store's cumulative totals (counters and histograms) and its recent
window (quantile gauges), as prometheus_client's custom collectors do.
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from agent import __version__
from agent.store.histogram import Histogram, classic_bounds, cumulative_counts
from agent.store.store import Store

QUANTILES = (0.5, 0.95, 0.99)
QUANTILE_WINDOW_S = 60.0


def _le(bound: float) -> str:
    return repr(float(bound))


def histogram_family(name: str, doc: str, per_service: dict[str, Histogram]) -> HistogramMetricFamily:
    bounds = classic_bounds()
    family = HistogramMetricFamily(name, doc, labels=["service"])
    for service, hist in sorted(per_service.items()):
        counts = cumulative_counts(hist, bounds)
        buckets = [(_le(b), c) for b, c in zip(bounds, counts)] + [("+Inf", hist.count)]
        family.add_metric([service], buckets, hist.sum_seconds)
    return family


class SlatraceCollector(Collector):
    def __init__(self, store: Store, self_metrics: Callable[[], dict[str, float]] | None = None) -> None:
        self._store = store
        self._self_metrics = self_metrics or (lambda: {})

    def collect(self) -> Iterator[Metric]:
        totals = self._store.totals()

        yield histogram_family(
            "slatrace_runq_latency_seconds",
            "Time from becoming runnable (wakeup, new task or preemption) to running on a CPU.",
            {s: f.runq for s, f in totals.items()},
        )
        wait = CounterMetricFamily("slatrace_runq_wait_seconds", "Sum of run-queue latency.", labels=["service"])
        for s, f in sorted(totals.items()):
            wait.add_metric([s], f.runq.sum_seconds)
        yield wait

        pre = CounterMetricFamily("slatrace_preemptions", "Involuntary context switches of the service's "
                                  "tasks, by the service that took the CPU.", labels=["service", "by_service"])
        pre_wait = CounterMetricFamily("slatrace_preempted_wait_seconds", "Run-queue wait that followed "
                                       "those preemptions.", labels=["service", "by_service"])
        for s, f in sorted(totals.items()):
            for by, p in sorted(f.preempted_by.items()):
                pre.add_metric([s, by], p.count)
                pre_wait.add_metric([s, by], p.wait_ns / 1e9)
        yield pre
        yield pre_wait

        yield histogram_family(
            "slatrace_iowait_seconds",
            "Time blocked in uninterruptible sleep (D state) until woken.",
            {s: f.iowait for s, f in totals.items()},
        )
        mig = CounterMetricFamily("slatrace_migrations", "Task migrations between CPUs.", labels=["service"])
        gaps = CounterMetricFamily("slatrace_untraced_events", "Scheduler transitions the kernel did not "
                                   "trace (a switch-in, switch-out or wakeup missing from the event stream).",
                                   labels=["service", "kind"])
        for s, f in sorted(totals.items()):
            mig.add_metric([s], f.migrations)
            gaps.add_metric([s, "switch_in"], f.untraced_switch_in)
            gaps.add_metric([s, "switch_out"], f.untraced_switch_out)
            gaps.add_metric([s, "wakeup"], f.untraced_wakeup)
        yield mig
        yield gaps

        quant = GaugeMetricFamily("slatrace_runq_latency_quantile_seconds",
                                  f"Run-queue latency quantiles over the last {QUANTILE_WINDOW_S:.0f} s, "
                                  "from the in-kernel log-linear histogram.", labels=["service", "quantile"])
        window = self._store.window(QUANTILE_WINDOW_S)
        for s, f in sorted(window.services.items()):
            if f.runq.count:
                for q in QUANTILES:
                    quant.add_metric([s, str(q)], f.runq.quantile(q))
        yield quant

        events = CounterMetricFamily("slatrace_bpf_events", "Runs of each BPF program (kernel BPF stats).",
                                     labels=["program"])
        run = CounterMetricFamily("slatrace_bpf_run_seconds", "Time spent in each BPF program (kernel BPF "
                                  "stats).", labels=["program"])
        for name, st in sorted(self._store.programs().items()):
            events.add_metric([name], st.run_cnt)
            run.add_metric([name], st.run_time_ns / 1e9)
        yield events
        yield run

        errors = CounterMetricFamily("slatrace_bpf_map_errors", "Failed BPF map updates (map full).",
                                     labels=["map"])
        for name, n in sorted(self._store.error_totals().items()):
            errors.add_metric([name], n)
        yield errors

        for name, value in sorted(self._self_metrics().items()):
            yield GaugeMetricFamily(name, "slatrace agent self-metric.", value=value)

        info = GaugeMetricFamily("slatrace_build_info", "slatrace version.", labels=["version"])
        info.add_metric([__version__], 1)
        yield info
