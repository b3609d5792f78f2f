"""`slatrace run`: wires kernel -> probe -> store -> API/exporters and polls.

Start-up order: HTTP first (so /livez answers while BPF compiles), then the
probe, then one interval, then /readyz turns 200. Every failure the operator can
fix is reported as one sentence and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING


from agent.api.routes import AgentState, Api
from agent.attribution.breaches import SloBreaches
from agent.attribution.request_sched import EventSched, IntervalSched
from agent.api.server import HttpServer
from agent.bpf_stats import BpfStatsSampler
from agent.config import Config
from agent.errors import SlatraceError
from agent.export.figures import AgentStats, Bucketed, Sources, summed
from agent.export.otlp_settings import OtlpConfigError
from agent.export.prometheus import Registry, SlatraceCollector
from agent.export.servers import ServerCollector
from agent.export.traces import EngineCollector, TraceCollector
from agent.export.workers import WorkerCollector
from agent.identity.cgroups import CgroupPaths
from agent.identity.docker import DockerNames
from agent.identity.kthreads import kernel_thread_tids
from agent.identity.listing import describe as describe_services
from agent.identity.threads import ThreadNames
from agent.identity.kubernetes import PodIndex, PodWatcher
from agent.identity.services import ServiceResolver
from agent.probe import features as feat
from agent.probe.build import BuildProcess
from agent.probe.snapshot import ProbeSnapshot
from agent.reload import ConfigReloader, ConfigSubscribers
from agent.store.events import EventLog
from agent.store.histogram import classic_bounds
from agent.store.store import Store
from agent.store.tally import WaitTally
from agent.throttle import ThrottleLedger, ThrottleReader, find_cpu_hierarchy
from agent.transport.access import WebAccess
from agent.transport.server import parse_listen, raise_fd_limit
from agent.transport.web_config import WebConfigError
from agent.workers import Worker, not_running, started

if TYPE_CHECKING:
    from agent.export.otlp import OtlpMetricsExporter

log = logging.getLogger("slatrace")

# How often exact wait events of watched services are drained from the ring
# buffer: bounds both the buffer's fill and the delay before a request is
# attributed.
EVENT_DRAIN_S = 0.1
# The first interval ends this soon after attach (or after one interval, if
# shorter), so /readyz turns 200 without waiting a whole interval; the store
# keeps each interval's real start and end, so a short first one is exact.
FIRST_INTERVAL_S = 0.1
# This many failed collections in a row make /livez answer 503.
FAILED_POLLS_UNHEALTHY = 10


def seccomp_hint(status_text: str | None = None) -> str:
    """Why holding CAP_BPF may not be enough: a seccomp filter answers bpf() before the kernel's
    capability check (the containers-common default of CRI-O and podman wants CAP_SYS_ADMIN)."""
    if status_text is None:
        status_text = Path("/proc/self/status").read_text()
    if not any(line.split() == ["Seccomp:", "2"] for line in status_text.splitlines()):
        return ""
    return (" under a seccomp filter, which may refuse bpf() whatever the capabilities (CRI-O's and "
            "podman's default profile does): use the Localhost profile deploy/seccomp/slatrace.json")


class StartupError(SlatraceError):
    """One sentence for the operator: what is missing and how to fix it."""


@dataclass(frozen=True)
class RunOptions:
    listen: str = "127.0.0.1:9477"
    otlp_grpc_listen: str = "127.0.0.1:4317"
    otlp_http_listen: str = "127.0.0.1:4318"
    otlp_endpoint: str | None = None
    # --otlp-protocol; None defers to OTEL_EXPORTER_OTLP_[<SIGNAL>_]PROTOCOL, else grpc.
    otlp_protocol: str | None = None
    # What SIGHUP reloads: the file, with the command line's flags on top.
    config_path: str | None = None
    config_overrides: tuple[tuple[str, object], ...] = ()
    bpf_stats: str = "sampled"  # --bpf-stats: sampled (1 s a minute), always, off
    web_config_file: str | None = None  # --web-config-file; else the config's web_config_file
    # --bpf-cache: where the compiled BPF programs are kept for the next start; None: compile every time.
    bpf_cache: str | None = None


class Daemon:
    def __init__(self, config: Config, options: RunOptions, builder: BuildProcess | None = None) -> None:
        self.config = config
        self.options = options
        self._builder = builder   # the BPF build process, if started ahead (start() takes it)
        self.stop_event = threading.Event()
        self.store = Store(config.retention, max_services=config.max_services,
                           reserved=frozenset(r.name for r in config.services))
        self.registry = Registry()
        self.poll_seconds = 0.0
        self.polls = 0
        self.poll_errors = 0
        self.tally = WaitTally()
        # Who reads which live section of the config: a reload calls them.
        self.subscribers = ConfigSubscribers()
        self._resolver: ServiceResolver | None = None
        # CPU-quota throttling and interval SLO breaches, kept per interval beside the store.
        self.throttle = ThrottleLedger(config.retention)
        self.breaches = SloBreaches(config.slos, config.retention)
        self.subscribers.subscribe("slos", self._set_interval_slos)
        self._throttle_reader: ThrottleReader | None = None
        self._pods = PodIndex()
        self._pod_watcher = PodWatcher(self._pods)
        self.state = AgentState(config=config, store=self.store, registry=self.registry,
                                describe_services=self._describe_services,
                                throttled_between=self.throttle.between,
                                breaches_between=self.breaches.between,
                                workers_down=not_running)
        # One family per metric name: request SLO breaches (counted by the
        # traces subsystem) are added to interval breaches here.
        self._collector = SlatraceCollector(self.store, sources=Sources(
            agent_stats=self._agent_stats,
            slos=config.slos, bounds=classic_bounds(config.buckets_per_octave),
            histograms=config.histogram_globs(),
            throttled_seconds=self.throttle.totals,
            slo_breaches=summed(self.breaches.totals, self._request_breaches),
            request_sched_delay=self._request_delays, request_slos=self._request_slos))
        self.registry.register(self._collector)
        # One collector for every HTTP server (API, OTLP/HTTP): one family each.
        self._servers = ServerCollector()
        self.registry.register(self._servers)
        # Every background worker's failures, by name.
        self.registry.register(WorkerCollector(started))
        self._probe = None
        self._probe_load = None   # the build process at work, during start()
        self._bpf_stats = BpfStatsSampler(getattr(options, "bpf_stats", "sampled"))
        self._slo_warnings = UnknownSloWarnings()
        self.subscribers.subscribe("slos", lambda slos: self._slo_warnings.reset())
        self._server: HttpServer | None = None
        self._access: WebAccess | None = None  # the web configuration (TLS, basic auth), if any
        self._otlp_metrics: OtlpMetricsExporter | None = None  # with --otlp-endpoint
        self.event_log = EventLog(retention_ns=int(min(config.retention, 600.0) * 1e9))
        names = ThreadNames()
        self.request_sched = EventSched(self.event_log, self._cgroups_of, self._service_of,
                                        IntervalSched(self.store, config.interval), thread_names=names,
                                        parent_of=names.parent, retention_s=config.retention)
        self._watched: set[int] = set()
        self._drain = Worker.periodic("events", "draining scheduler events", self._drain_step, EVENT_DRAIN_S,
                                      first_now=False)
        self._traces = None  # agent.traces.runtime.Traces once the probe is attached

    def _request_breaches(self) -> dict[tuple[str, str], int]:
        return self._traces.counters.breach_counts() if self._traces else {}

    def _request_slos(self) -> dict[tuple[str, str], tuple[float, float | None, bool]]:
        return self._traces.counters.slo_status() if self._traces else {}

    def _request_delays(self) -> dict[str, Bucketed]:
        return self._traces.counters.delay_points() if self._traces else {}

    def _service_of(self, cgid: int) -> str:
        return self._resolver.service_of(cgid) if self._resolver else "unknown"

    def _cgroups_of(self, service: str) -> set[int]:
        return set(self.store.cgroups(service))

    def _describe_services(self) -> list[dict]:
        return describe_services(self._resolver) if self._resolver else []

    def _agent_stats(self) -> AgentStats:
        return AgentStats(poll_duration_seconds=self.poll_seconds, poll_errors=self.poll_errors,
                          waits_seen=dict(self.tally.seen_total), waits_missing=dict(self.tally.missing_total))

    def start(self) -> None:
        try:
            host, port = parse_listen(self.options.listen, "--listen")
        except ValueError as e:
            raise StartupError(str(e)) from None
        # BCC compiles and attaches in a process of its own (agent/probe/build.py),
        # started first: it imports BCC while this one reads its files and the
        # kernel's features, then compiles while the rest of the agent starts.
        t0 = time.monotonic()
        cache_dir = Path(self.options.bpf_cache) if getattr(self.options, "bpf_cache", None) else None
        builder, self._builder = self._builder or BuildProcess(cache_dir), None
        try:
            self._access = self._load_web_config()
            # Prerequisites before binding anything: an unprivileged start must fail
            # on what matters, not on the port.
            try:
                features = feat.detect()
            except feat.FeatureError as e:
                raise StartupError(str(e)) from None
            from agent.probe.loader import (  # noqa: PLC0415  (imports numpy)
                MapMemoryError, MapSizes, Probe, attach_mode, events_per_window)

            try:
                mode = attach_mode(features, self.config.attach_mode)
            except ValueError as e:
                raise StartupError(f"{e}; use --attach-mode classic (or auto)") from None
        except BaseException:
            builder.cancel()
            raise
        self._probe_load = Probe.begin_load(features, tracepoints=mode, process=builder, cache_dir=cache_dir,
                                            sizes=MapSizes(event_rate=events_per_window(self.config.event_rate)))
        self._otlp_metrics = self._make_otlp_metrics()
        raise_fd_limit()
        self._server = HttpServer(host, port, Api(self.state), access=self._access)
        self._server.start()
        self._servers.add(self._server)
        log.info("listening on %s://%s:%d", self._server.scheme, host, self._server.port)
        cgroups = CgroupPaths(features.cgroup2)
        self._pod_watcher.start()
        self._resolver = ServiceResolver(self.config.services, cgroups, max_services=self.config.max_services,
                                         retention_s=self.config.retention, pods=self._pods,
                                         docker=DockerNames())
        self.subscribers.subscribe("services", self._resolver.set_rules)
        self._throttle_reader = ThrottleReader(find_cpu_hierarchy(Path("/proc/mounts").read_text()),
                                               features.cgroup2)
        self._start_traces(cgroups)
        try:
            self._probe = self._probe_load.result()
        except MapMemoryError as e:
            raise StartupError(f"cannot load the BPF programs: {e}") from None
        except Exception as e:  # noqa: BLE001  (BCC's reason, from the build process)
            raise StartupError(f"cannot load the BPF programs ({e}){seccomp_hint()}; run 'slatrace check' "
                               "to see which prerequisite is missing") from None
        finally:
            self._probe_load = None
        if self._probe.btf_refused:
            log.warning("the kernel refused the BTF-typed programs (%s); raw tracepoints instead",
                        self._probe.btf_refused)
        self._log_attached(time.monotonic() - t0)
        self._bpf_stats.start()
        if self._probe.mode != "classic":
            log.info("kernel threads counted as service 'kernel' (recognised in the kernel)")
        else:
            marked = self._probe.mark_kernel_threads(kernel_thread_tids())
            log.info("%d kernel threads counted as service 'kernel'", marked)
        self.store.ingest(self._probe.baseline(), self._resolver.service_of)
        if self._otlp_metrics is not None:
            self._otlp_metrics.start()
        self._drain.start()
        # Last of the start-up: the receivers' libraries (gRPC) are loaded by now.
        self._release_compiler_memory()
        self._collect_first_interval()

    def _log_attached(self, seconds: float) -> None:
        """One line for the attach, and one saying why the program cache was not used, if it was not."""
        cache, note = self._probe.cache
        if cache in ("miss", "unprivileged"):
            log.info("BPF program cache: %s", note)
        elif cache == "refused":
            log.warning("BPF program cache not used: %s", note)
        peak = self._probe.build_peak_bytes
        how = "loaded from the cache" if cache == "hit" else "compiled"
        log.info("BPF programs attached to %s tracepoints in %.2f s%s", self._probe.mode, seconds,
                 f" ({how} by a separate process, peak {peak / 2**20:.0f} MiB resident)" if peak else "")

    def _load_web_config(self) -> WebAccess | None:
        """The web configuration, read whole before anything binds or compiles:
        a bad file refuses the start with one sentence."""
        path = getattr(self.options, "web_config_file", None) or self.config.web_config_file
        if not path:
            return None
        try:
            access = WebAccess(path)
        except WebConfigError as e:
            raise StartupError(f"bad web config: {e}") from None
        self._servers.watch_access(access)
        self.subscribers.on_hangup(access.request)  # SIGHUP reads its files again too
        access.start()
        log.info("web config %s: %s", path, access.describe())
        return access

    def _collect_first_interval(self) -> None:
        """A short first interval: ready soon after attach, not one interval later."""
        if not self.stop_event.wait(min(FIRST_INTERVAL_S, self.config.interval)):
            self.poll_once()

    def _release_compiler_memory(self) -> None:
        """Start-up is done: give its heap and the pages of libraries it touched back
        (agent/probe/footprint.py). The compiler ran in the build process."""
        from agent.probe.footprint import release_compiler_memory  # noqa: PLC0415

        log.info("after start-up: %s", release_compiler_memory().describe())

    def _start_traces(self, cgroups: CgroupPaths) -> None:
        from agent.traces.runtime import Traces  # noqa: PLC0415

        try:
            self._traces = Traces(self.config, self.request_sched, cgroups, self._resolver.service_of,
                                  lambda: {r.name for r in self.config.services} | set(self.store.services()),
                                  grpc_listen=self.options.otlp_grpc_listen, http_listen=self.options.otlp_http_listen,
                                  otlp_endpoint=self.options.otlp_endpoint,
                                  otlp_protocol=getattr(self.options, "otlp_protocol", None), pods=self._pods,
                                  access=self._access, subscribers=self.subscribers,
                                  cpu_limits=self.throttle.limits_of)
            self.registry.register(TraceCollector(self._traces.counters))
            self.registry.register(EngineCollector(self._traces.engines))
            self.state.extra_routes.update(self._traces.routes())
            self.state.engines_since = self._traces.engines_since
            self._traces.start()
            if self._traces.http is not None:
                self._servers.add(self._traces.http)
        except OtlpConfigError as e:
            raise StartupError(f"cannot forward spans to --otlp-endpoint: {e}") from None
        except (OSError, ValueError) as e:
            raise StartupError(f"cannot start the OTLP trace receivers: {e}; choose other addresses with "
                               "--otlp-grpc-listen / --otlp-http-listen, or 'off'") from None

    def _make_otlp_metrics(self) -> OtlpMetricsExporter | None:
        """The OTLP metrics exporter for --otlp-endpoint, built before anything
        binds so that a bad OTEL_* setting fails the start with one sentence."""
        if not self.options.otlp_endpoint:
            return None
        from agent.export.otlp import OtlpMetricsExporter  # noqa: PLC0415  (loads grpc)

        try:
            exporter = OtlpMetricsExporter.from_options(self.registry, self.store, self.options.otlp_endpoint,
                                                        self.options.otlp_protocol)
        except ValueError as e:
            raise StartupError(f"cannot export OTLP metrics: {e}") from None
        # Its success/failure counters show in /metrics next to what it exports.
        self.registry.register(exporter.collector())
        return exporter

    def apply_config(self, new: Config) -> None:
        """Services, SLOs and trusted relays of a reloaded config, to every reader subscribed."""
        self.subscribers.publish(self.config, new)
        self.config = new
        self.state.config = new

    def _set_interval_slos(self, slos) -> None:
        self.breaches.slos = slos
        self._collector.update_sources(slos=slos)

    def sample_bpf_stats(self) -> None:
        """One BPF-stats sampling window now (SIGUSR1); safe in a signal handler."""
        self._bpf_stats.request()

    def housekeeping(self) -> None:
        """Every few seconds, off the collection path."""
        seen = set(self.store.services())
        if self._traces is not None:
            seen |= set(self._traces.counters.requests)
        self._slo_warnings.check(self.config.slos, seen)

    def poll_once(self) -> None:
        t0 = time.monotonic()
        snap = self._probe.snapshot()
        self._check_tally(snap)
        record = self.store.ingest(snap, self._resolver.service_of)
        if record is not None:
            limited = record.table.services_with("limited_runq")
            self.throttle.add(record.end, self._throttle_reader.poll(self._resolver.cgroups_by_service(), limited))
            self.throttle.set_limits(self._throttle_reader.limits())
            self.breaches.observe(record.end, record.services)
        self.poll_seconds = time.monotonic() - t0
        self.polls += 1
        self.state.ready = True

    def _check_tally(self, snap: ProbeSnapshot) -> None:
        """The self-check (agent/store/tally.py): /readyz, a log line on each
        change and the slatrace_waits_missing counter say when waits are lost."""
        self.tally.observe(snap)
        verdict = self.tally.verdict()
        if verdict is None:
            return
        degraded = None if verdict.ok else verdict.detail
        if degraded and not self.state.degraded:
            log.error("self-check: %s", degraded)
        elif self.state.degraded and not degraded:
            log.warning("self-check: waits reach the agent again (%s)", verdict.detail)
        self.state.degraded = degraded

    def drain_events_once(self) -> None:
        cgids = self.request_sched.watched_cgroups()
        if cgids != self._watched:
            self._probe.watch(cgids)
            self._watched = cgids
        drained_at = time.time()
        rows = self._probe.drain_event_rows()
        dropped = self._probe.dropped_events()
        self.request_sched.ingest(rows, drained_at, dropped)

    def _drain_step(self) -> None:
        if self._probe is not None:
            self.drain_events_once()

    def loop(self) -> None:
        interval = self.config.interval
        deadline = time.monotonic() + interval
        health = CollectionHealth(self.state)
        while not self.stop_event.wait(max(0.0, deadline - time.monotonic())):
            try:
                self.poll_once()
                health.succeeded()
            except Exception as e:
                self.poll_errors += 1
                health.failed(e)
                log.exception("collecting an interval failed; the next interval will retry")
            deadline += interval
            if deadline < time.monotonic():  # fell behind (suspend, overload): skip, don't burst
                deadline = time.monotonic() + interval

    def close(self) -> None:
        self.stop_event.set()
        self._pod_watcher.stop()
        if self._traces is not None:
            self._traces.close()
            self._traces = None
        self._drain.stop(2.0)
        if self._probe_load is not None:
            self._probe_load.cancel()
            self._probe_load = None
        if self._probe is not None:
            self._probe.close()
            self._probe = None
            log.info("BPF programs detached")
        self._bpf_stats.stop()
        if self._otlp_metrics is not None:
            self._otlp_metrics.stop()
            self._otlp_metrics = None
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._access is not None:
            self._access.shutdown()


class CollectionHealth:
    """Sets AgentState.failure, which turns /livez to 503, while collections
    keep failing. One failed interval is retried (its counts are carried over
    into the next); FAILED_POLLS_UNHEALTHY in a row mean the agent no longer
    collects, and a kubelet should restart it. A success clears it."""

    def __init__(self, state: AgentState, limit: int = FAILED_POLLS_UNHEALTHY) -> None:
        self.state = state
        self.limit = limit
        self.in_a_row = 0

    def succeeded(self) -> None:
        self.in_a_row = 0
        self.state.failure = None

    def failed(self, error: BaseException) -> None:
        self.in_a_row += 1
        if self.in_a_row >= self.limit:
            self.state.failure = f"the last {self.in_a_row} collections failed ({type(error).__name__}: {error})"


class UnknownSloWarnings:
    """An SLO names a service that has not been seen for `grace_s`: said once
    per name (it is not exported until the service appears)."""

    def __init__(self, grace_s: float = 60.0, clock=time.monotonic) -> None:
        self.grace_s = grace_s
        self._clock = clock
        self._since = clock()
        self._warned: set[str] = set()

    def reset(self) -> None:
        self._since = self._clock()
        self._warned.clear()

    def check(self, slos, seen: set[str]) -> list[str]:
        if self._clock() - self._since < self.grace_s:
            return []
        missing = sorted({s.service for s in slos} - seen - self._warned)
        for name in missing:
            log.warning("the SLO for service %r matches no service seen in %.0f s: it is not exported until "
                        "that service appears ('slatrace services' lists the names)", name, self.grace_s)
        self._warned.update(missing)
        return missing


def run(config: Config, options: RunOptions, builder: BuildProcess | None = None) -> int:
    """The agent until SIGTERM; `builder`: its BPF build process, started ahead."""
    daemon = Daemon(config, options, builder)
    reloader = ConfigReloader(options.config_path, dict(options.config_overrides), lambda: daemon.config,
                              daemon.apply_config, tick=daemon.housekeeping,
                              # SIGHUP still reloads a web config given by flag alone.
                              warn_without_path=not getattr(options, "web_config_file", None))

    def on_signal(signum, frame) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        daemon.stop_event.set()

    def on_hangup(signum, frame) -> None:
        reloader.request()
        daemon.subscribers.hangup()

    def on_usr1(signum, frame) -> None:
        daemon.sample_bpf_stats()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_hangup)
    signal.signal(signal.SIGUSR1, on_usr1)
    reloader.start()
    try:
        daemon.start()
        log.info("collecting every %.3g s, keeping %.0f s of history (pid %d)",
                 config.interval, config.retention, os.getpid())
        daemon.loop()
    finally:
        reloader.stop()
        daemon.close()
    return 0
