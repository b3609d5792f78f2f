"""Every metric family slatrace exports, declared once: name, type, unit, help,
labels and the source that feeds it.

The collectors (SlatraceCollector, ServerCollector, TraceCollector,
EngineCollector, the OTLP exporter's own counters) write these specs and no
other; the OTLP translation takes its units from here; docs/metrics.md is
generated from here (scripts/gen-metrics-doc.py). A family declared twice, or
one whose samples would carry another family's name (a gauge `x_total` beside a
counter `x`), raises DuplicateFamily when this module is imported, so two
modules can no longer each write the same family into /metrics.

Lower floors (the transport, the trace receivers, the engine scraper) keep
plain numbers; the families built from them are declared here. Pure: no host
access, nothing but declarations at import.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["Catalog", "DuplicateFamily", "FAMILIES", "MetricSpec", "QUANTILE_WINDOW_S"]

MetricType = Literal["counter", "gauge", "histogram", "summary"]
TYPES = ("counter", "gauge", "histogram", "summary")

# The window of every exported quantile: the store's, and the engines'.
QUANTILE_WINDOW_S = 60.0


@dataclass(frozen=True)
class MetricSpec:
    """One metric as users see it. `name` is the base name: a counter is
    exposed to Prometheus as name + "_total", a histogram as its _bucket/_sum/_count."""

    name: str
    type: MetricType
    help: str
    labels: tuple[str, ...]
    unit: str = ""          # UCUM-ish unit for OTLP: "s", "1"
    source: str = "store"   # where the figure comes from (for the docs)
    # The `# UNIT` line of the OpenMetrics exposition ("" writes none).
    openmetrics_unit: str = ""
    # A per-service counter read from the kernel's per-cgroup counters: the
    # cgroup_val fields (bpf/sched.h) it exports, each with its labels' values
    # after `service`. agent/export/figures.py writes every such family the
    # same way: a series per service and field that is not zero.
    cgroup_fields: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # What a cgroup_fields value is multiplied by (1e-9: a field of ns, a family of seconds).
    cgroup_scale: float = 1.0
    # False for a family that stays empty while things are well (a full map's
    # losses): the series budget of a service (docs/metrics.md) leaves it out.
    in_budget: bool = True
    # What feeds a family its collector writes without code of its own: from
    # the figures of its source (TraceTotals for the trace receivers,
    # AgentStats for the collection loop), a number, or a mapping of label
    # values (one, or a tuple of them) -> number; figures.read_points() turns
    # it into points.
    read: Callable[[Any], Any] | None = None

    @property
    def exposed_names(self) -> tuple[str, ...]:
        """The sample names a Prometheus scrape shows for this metric."""
        if self.type == "counter":
            return (self.name + "_total",)
        if self.type == "histogram":
            return tuple(self.name + s for s in ("_bucket", "_sum", "_count"))
        if self.type == "summary":
            return (self.name, self.name + "_sum", self.name + "_count")
        return (self.name,)


class DuplicateFamily(ValueError):
    """A family name, or a sample name it writes, is declared a second time."""


class Catalog:
    """Metric specs in the order they were declared; each name at most once."""

    def __init__(self) -> None:
        self._specs: dict[str, MetricSpec] = {}
        self._owner: dict[str, str] = {}   # family or sample name -> the family that writes it

    def declare(self, name: str, type_: MetricType, help_: str, labels: tuple[str, ...] = (), *,
                unit: str, source: str, openmetrics_unit: str = "",
                cgroup_fields: tuple[tuple[str, tuple[str, ...]], ...] = (), cgroup_scale: float = 1.0,
                in_budget: bool = True, read: Callable[[Any], Any] | None = None) -> MetricSpec:
        if type_ not in TYPES:
            raise ValueError(f"{name}: unknown metric type {type_!r}")
        spec = MetricSpec(name, type_, help_, tuple(labels), unit, source, openmetrics_unit, cgroup_fields,
                          cgroup_scale, in_budget, read)
        written = (name, *spec.exposed_names)
        for n in written:
            if n in self._owner:
                raise DuplicateFamily(f"{n} is already written by the family {self._owner[n]}")
        for n in written:
            self._owner[n] = name
        self._specs[name] = spec
        return spec

    def __iter__(self) -> Iterator[MetricSpec]:
        return iter(self._specs.values())

    def __len__(self) -> int:
        return len(self._specs)

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def __getitem__(self, name: str) -> MetricSpec:
        return self._specs[name]

    def get(self, name: str) -> MetricSpec | None:
        return self._specs.get(name)


FAMILIES = Catalog()
declare = FAMILIES.declare

_SVC = ("service",)
_PAIR = ("service", "by_service")
_SLO = ("service", "slo")
# The collection loop's own figures (figures.AgentStats), each family read from them.
AGENT_STATS = "hook: Sources.agent_stats"

# -- The scheduler's figures: SlatraceCollector, from the store and Sources' hooks.
RUNQ_LATENCY = declare(
    "slatrace_runq_latency_seconds", "histogram",
    "Time from becoming runnable (wakeup, new task or preemption) to running on a CPU.",
    _SVC, unit="s", source="store")
RUNQ_WAIT = declare(
    "slatrace_runq_wait_seconds", "counter",
    "Sum of run-queue latency: seconds the service's threads spent runnable but not running.",
    _SVC, unit="s", source="store")
PREEMPTIONS = declare(
    "slatrace_preemptions", "counter",
    "Involuntary context switches of the service's tasks, by the service that took the CPU.",
    _PAIR, unit="1", source="store")
PREEMPTED_WAIT = declare(
    "slatrace_preempted_wait_seconds", "counter",
    "Run-queue wait that followed those preemptions, by the service that took the CPU.",
    _PAIR, unit="s", source="store")
WAKEUP_WAIT = declare(
    "slatrace_wakeup_wait_seconds", "counter",
    "Run-queue wait that followed a wakeup, by the service that held the CPU until the wait ended "
    "(\"idle\": the CPU was idle, wake-up latency).",
    _PAIR, unit="s", source="store")
IOWAIT = declare(
    "slatrace_iowait_seconds", "histogram",
    "Time blocked in uninterruptible sleep (D state) until woken.",
    _SVC, unit="s", source="store")
MIGRATIONS = declare(
    "slatrace_migrations", "counter", "Task migrations between CPUs.",
    _SVC, unit="1", source="store", cgroup_fields=(("migrations", ()),))
THROTTLED = declare(
    "slatrace_cpu_throttled_seconds", "counter",
    "CPU-quota throttling of the service's cgroups (cpu.stat throttled_usec).",
    _SVC, unit="s", source="hook: Sources.throttled_seconds")
CPU_LIMIT_WAIT = declare(
    "slatrace_cpu_limit_wait_seconds", "counter",
    "Run-queue wait the service's own CPU limit held (cpu.max, cpu.cfs_quota_us on its cgroup or an ancestor), "
    "measured per wait by the kernel programs on raw and BTF-typed tracepoints: the cause cpu_limit of "
    "slatrace_runq_wait_seconds_total; the rest of those waits is in the culprits' figures.",
    _SVC, unit="s", source="store", cgroup_fields=(("limited_runq_ns", ()),), cgroup_scale=1e-9)
# A summary rather than a gauge with a `quantile` label: the series are the
# same (`...{quantile="0.99"}`), and it is the type Prometheus' own linter
# accepts a `quantile` label on.
RUNQ_QUANTILE = declare(
    "slatrace_runq_latency_quantile_seconds", "summary",
    f"Run-queue latency quantiles over the last {QUANTILE_WINDOW_S:.0f} s, interpolated in the in-kernel "
    "log-linear histogram (1/16-octave slots); _sum and _count since start.",
    _SVC, unit="s", source="store")
SLO_BREACHES = declare(
    "slatrace_slo_breaches", "counter", "Intervals (or requests) that broke an SLO.",
    _SLO, unit="1", source="hook: Sources.slo_breaches")
SLO_TARGET = declare(
    "slatrace_slo_target_seconds", "gauge", "Configured SLO target.",
    _SLO, unit="s", source="config slos")
SLO_VALUE = declare(
    "slatrace_slo_value_seconds", "gauge",
    f"Value the SLO is judged on, over the last {QUANTILE_WINDOW_S:.0f} s (absent without samples).",
    _SLO, unit="s", source="config slos")
SLO_OK = declare(
    "slatrace_slo_ok", "gauge",
    f"1 when the SLO holds over the last {QUANTILE_WINDOW_S:.0f} s (or had no samples), 0 when broken.",
    _SLO, unit="1", source="config slos")
REQUEST_SCHED_DELAY = declare(
    "slatrace_request_sched_delay_seconds", "histogram",
    "Per request span: how much longer the request took because its work waited for a CPU "
    "(wall-clock, on its critical path; never more than its duration).",
    _SVC, unit="s", source="hook: Sources.request_sched_delay")
UNTRACED = declare(
    "slatrace_untraced_events", "counter",
    "Scheduler transitions the kernel did not trace (a switch-in, switch-out or wakeup missing "
    "from the event stream); counted, never invented.",
    ("service", "kind"), unit="1", source="store",
    cgroup_fields=tuple((f"untraced_{kind}", (kind,)) for kind in ("switch_in", "switch_out", "wakeup")))
RECOVERED = declare(
    "slatrace_recovered_waits", "counter",
    "Run-queue waits after a wakeup the programs did not see (counted in slatrace_untraced_events_total "
    "with kind wakeup), recovered from the scheduler's own enqueue time and "
    "included in the wait figures (raw and BTF-typed tracepoints; docs/api.md).",
    _SVC, unit="1", source="store", cgroup_fields=(("recovered_wakeup", ()),), in_budget=False)
LOST_WAITS = declare(
    "slatrace_lost_waits", "counter",
    "Waits a full kernel map could not record (docs/maps.md), by kind: runq and iowait waits "
    "missing from the histograms, blame for runq waits missing from the culprits; counted, never invented.",
    ("service", "kind"), unit="1", source="store",
    cgroup_fields=tuple((f"lost_{kind}", (kind,)) for kind in ("runq", "iowait", "blame")), in_budget=False)
BPF_EVENTS = declare(
    "slatrace_bpf_events", "counter",
    "Runs of each BPF program, counted while kernel BPF stats are on (by default 1 s a minute, "
    "--bpf-stats): a sample, not every run.",
    ("program",), unit="1", source="store")
BPF_RUN = declare(
    "slatrace_bpf_run_seconds", "counter",
    "Time spent in each BPF program over the runs slatrace_bpf_events counts; their ratio is the cost per run.",
    ("program",), unit="s", source="store")
BPF_MISSES = declare(
    "slatrace_bpf_program_misses", "counter",
    "Times the kernel skipped a slatrace BPF program on its tracepoint because another BPF program, or on "
    "classic tracepoints a BPF map operation, was in progress on that CPU; each skip loses an event, so "
    "possibly a wait (kernels from 5.12 count them).",
    ("program",), unit="1", source="store")
MAP_ERRORS = declare(
    "slatrace_bpf_map_errors", "counter",
    "Failed BPF map updates (map full, busy) and dropped events, per map.",
    ("map",), unit="1", source="store")
POLL_DURATION = declare(
    "slatrace_poll_duration_seconds", "gauge",
    "Time the last collection took to read the BPF maps and store the interval.",
    unit="s", source=AGENT_STATS, read=lambda st: st.poll_duration_seconds)
POLL_ERRORS = declare(
    "slatrace_poll_errors", "counter", "Collections that failed (retried next interval).",
    unit="1", source=AGENT_STATS, read=lambda st: float(st.poll_errors))
WAITS_SEEN = declare(
    "slatrace_waits_seen", "counter",
    "Waits the BPF programs saw, by kind (runq, iowait), counted before the caches and maps "
    "they pass through: the self-check's reference.",
    ("kind",), unit="1", source=AGENT_STATS, read=lambda st: {k: float(n) for k, n in st.waits_seen.items()})
WAITS_MISSING = declare(
    "slatrace_waits_missing", "counter",
    "Waits the BPF programs saw that never reached the agent's figures (the self-check); "
    "anything but 0 means the figures on this kernel are incomplete.",
    ("kind",), unit="1", source=AGENT_STATS, read=lambda st: {k: float(n) for k, n in st.waits_missing.items()})
SERVICES_TRACKED = declare(
    "slatrace_services_tracked", "gauge",
    "Distinct service label values exported (bounded by max_services, overflow is \"other\").",
    unit="1", source="store")
INTERVALS = declare(
    "slatrace_intervals_collected", "counter", "Intervals collected since the agent started.",
    unit="1", source="store")
BUILD_INFO = declare(
    "slatrace_build_info", "gauge", "slatrace version; always 1.",
    ("version",), unit="1", source="store")

SCHEDULER: tuple[MetricSpec, ...] = (
    RUNQ_LATENCY, RUNQ_WAIT, PREEMPTIONS, PREEMPTED_WAIT, WAKEUP_WAIT, IOWAIT, MIGRATIONS, THROTTLED, CPU_LIMIT_WAIT,
    RUNQ_QUANTILE,
    SLO_BREACHES, SLO_TARGET, SLO_VALUE, SLO_OK, REQUEST_SCHED_DELAY, UNTRACED, RECOVERED, LOST_WAITS, BPF_EVENTS,
    BPF_RUN, BPF_MISSES, MAP_ERRORS, POLL_DURATION, POLL_ERRORS, WAITS_SEEN, WAITS_MISSING, SERVICES_TRACKED, INTERVALS,
    BUILD_INFO,
)

# -- The trace side: TraceCollector, each family read from agent.traces.metrics.TraceTotals.
_TRACES = "trace receivers (TraceCounters)"
SPANS_RECEIVED = declare(
    "slatrace_otlp_spans_received", "counter", "Spans accepted by the OTLP trace receivers.",
    ("transport",), unit="1", source=_TRACES, read=lambda t: t.received)
REJECTED_REQUESTS = declare(
    "slatrace_otlp_rejected_requests", "counter",
    "OTLP export requests refused, by reason (malformed, too_large, unsupported, overloaded, unauthorized; "
    "gRPC also not_received: refused by grpcio above its 64 MiB limit or cancelled before the message, and "
    "queue_full: past the calls running or queued).",
    ("transport", "reason"), unit="1", source=_TRACES, read=lambda t: t.rejected)
SPANS_UNRESOLVED = declare(
    "slatrace_otlp_spans_unresolved", "counter",
    "Request spans whose sender could not be found, by reason (remote_peer, socket_not_found, no_process, "
    "no_cgroup, no_peer; from a trusted relay: relay_no_origin, relay_origin_not_found, relay_other_host, "
    "relay_pid_without_host).",
    ("reason",), unit="1", source=_TRACES, read=lambda t: t.unresolved)
CLAIMS_IGNORED = declare(
    "slatrace_otlp_claims_ignored", "counter",
    "Span resources whose attribute contradicted the connection they came on (or, from a trusted relay, the "
    "pod it names), by attribute.",
    ("attribute",), unit="1", source=_TRACES, read=lambda t: t.claims_ignored)
REQUESTS_ATTRIBUTED = declare(
    "slatrace_requests_attributed", "counter", "Request spans given scheduling figures.",
    _SVC, unit="1", source=_TRACES, read=lambda t: t.requests)
REQUESTS_PENDING = declare(
    "slatrace_requests_pending", "gauge",
    "Request spans waiting for the kernel side to cover their end.",
    unit="1", source=_TRACES, read=lambda t: t.pending)
PENDING_OVERFLOW = declare(
    "slatrace_requests_pending_overflow", "counter",
    "Request spans attributed before their end was covered because too many were pending.",
    unit="1", source=_TRACES, read=lambda t: t.pending_dropped)
SPANS_FORWARDED = declare(
    "slatrace_otlp_forwarded_spans", "counter", "Spans forwarded to --otlp-endpoint.",
    unit="1", source=_TRACES, read=lambda t: t.forwarded)
TRUNCATED_ATTRIBUTES = declare(
    "slatrace_otlp_truncated_attributes", "counter", "Attribute values cut to the receivers' length limit.",
    unit="1", source=_TRACES, read=lambda t: t.truncated_attributes)
REQUESTS_EVICTED = declare(
    "slatrace_requests_evicted", "counter",
    "Finished requests dropped from the API's store before the retention, to keep it within its count and "
    "byte budget.",
    unit="1", source=_TRACES, read=lambda t: t.store_evicted)
ATTRIBUTION_ERRORS = declare(
    "slatrace_requests_attribution_errors", "counter",
    "Requests whose scheduling figures could not be computed (or worker ticks that failed; each logged with "
    "its exception).",
    unit="1", source=_TRACES, read=lambda t: t.attribution_errors)
REQUEST_DELAY_BY_CAUSE = declare(
    "slatrace_request_delay_seconds", "counter",
    "Scheduling delay of the service's requests (their sched.delay_seconds, added up), by cause (neighbour, "
    "cpu_limit, own_threads, kernel, idle, unknown) and by who: the neighbour's service (the first 3 a "
    "service meets; later ones as \"other\"), the service itself for its own threads and its own CPU limit, "
    "kernel, idle or unknown.",
    ("service", "cause", "culprit"), unit="s", source=_TRACES, read=lambda t: t.delay_by_cause)
FORWARD_DROPPED = declare(
    "slatrace_otlp_forward_dropped_spans", "counter", "Spans not forwarded, by reason (queue_full, export_failed).",
    ("reason",), unit="1", source=_TRACES, read=lambda t: t.forward_dropped)

TRACES: tuple[MetricSpec, ...] = (
    SPANS_RECEIVED, REJECTED_REQUESTS, SPANS_UNRESOLVED, CLAIMS_IGNORED, REQUESTS_ATTRIBUTED, REQUESTS_PENDING,
    PENDING_OVERFLOW, SPANS_FORWARDED, TRUNCATED_ATTRIBUTES, REQUESTS_EVICTED, ATTRIBUTION_ERRORS, FORWARD_DROPPED,
    REQUEST_DELAY_BY_CAUSE,
)

# -- The inference engines' own figures: EngineCollector, from agent.traces.engines.EngineScraper.
_ENGINES = "engine scraper (EngineScraper)"
# A summary, as RUNQ_QUANTILE: a gauge may not carry a `quantile` label.
ENGINE_LATENCY = declare(
    "slatrace_engine_latency_quantile_seconds", "summary",
    f"The inference engine's own latency quantiles over the last {QUANTILE_WINDOW_S:.0f} s, from its Prometheus "
    "histograms (time to first token, inter-token, queue, prefill, decode, end to end), by phase and the "
    "engine's metric name; _sum and _count are the engine's own since it started; plot beside the same "
    "service's request scheduling delay.",
    ("service", "phase", "metric"), unit="s", source=_ENGINES, openmetrics_unit="seconds")
ENGINE_SCRAPE_ERRORS = declare(
    "slatrace_engine_scrape_errors", "counter",
    "Scrapes of an inference engine's metrics that failed (engine down, or not Prometheus text); logged once "
    "per engine.",
    unit="1", source=_ENGINES)

ENGINES: tuple[MetricSpec, ...] = (ENGINE_LATENCY, ENGINE_SCRAPE_ERRORS)

# -- The HTTP servers (API, OTLP/HTTP) and their web configuration: ServerCollector,
# from agent.transport's ServerStats and WebAccess.
_SERVERS = "HTTP servers (API, OTLP/HTTP)"
_WEB_CONFIG = "web configuration (--web-config-file)"
HTTP_CONNECTIONS = declare(
    "slatrace_http_connections", "counter",
    "HTTP connections accepted and how requests or connections ended early (timeouts, evicted, resets, "
    "malformed, errors, tls_failures, unauthorized); served counts requests answered.",
    ("server", "outcome"), unit="1", source=_SERVERS)
HTTP_CONNECTIONS_OPEN = declare(
    "slatrace_http_connections_open", "gauge", "HTTP connections open now.",
    ("server",), unit="1", source=_SERVERS)
WEB_CONFIG_RELOADS = declare(
    "slatrace_web_config_reloads", "counter",
    "Reloads of the web configuration (TLS certificates, basic auth users) after its files changed or SIGHUP; "
    "a failure keeps the settings in force.",
    ("outcome",), unit="1", source=_WEB_CONFIG)
WEB_CONFIG_OK = declare(
    "slatrace_web_config_last_reload_successful", "gauge",
    "1 if the web configuration's files loaded at the last look, 0 if they were refused (the previous "
    "settings are still in force).",
    unit="1", source=_WEB_CONFIG)

SERVERS: tuple[MetricSpec, ...] = (HTTP_CONNECTIONS, HTTP_CONNECTIONS_OPEN, WEB_CONFIG_RELOADS, WEB_CONFIG_OK)

# -- The OTLP metrics exporter's own health (--otlp-endpoint): agent.export.otlp, each family read from the exporter.
_OTLP = "OTLP metrics exporter (--otlp-endpoint)"
OTLP_EXPORTS = declare(
    "slatrace_otlp_exports", "counter", "OTLP metrics exports the collector accepted.",
    ("endpoint",), unit="1", source=_OTLP,
    read=lambda e: {e.settings.endpoint: e.stats.exports})
OTLP_EXPORT_FAILURES = declare(
    "slatrace_otlp_export_failures", "counter",
    "OTLP metrics exports dropped after the exporter gave up (collector down, timeout, rejected).",
    ("endpoint",), unit="1", source=_OTLP,
    read=lambda e: {e.settings.endpoint: e.stats.failures})
OTLP_EXPORT_DROPPED = declare(
    "slatrace_otlp_export_dropped_points", "counter",
    "Data points in the dropped exports; the next export carries their cumulative values.",
    ("endpoint",), unit="1", source=_OTLP,
    read=lambda e: {e.settings.endpoint: e.stats.dropped_points})

OTLP_EXPORT: tuple[MetricSpec, ...] = (OTLP_EXPORTS, OTLP_EXPORT_FAILURES, OTLP_EXPORT_DROPPED)

# -- The background workers (agent.workers): WorkerCollector, agent/export/workers.py.
_WORKERS = "background workers (agent.workers)"
WORKER_ERRORS = declare(
    "slatrace_worker_errors", "counter",
    "Failures of a background worker, by its name: an exception out of its step or loop (the worker goes on, "
    "a loop restarted), or one it handled and retried; each is also one warning line naming the worker.",
    ("worker",), unit="1", source=_WORKERS)

WORKERS: tuple[MetricSpec, ...] = (WORKER_ERRORS,)
