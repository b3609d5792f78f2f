"""The agent's YAML configuration: parsed once, validated strictly, then frozen.

Every error names the file, the key path and the fix in one sentence, because the
person reading it is an operator at a terminal, not a Python programmer.
"""

from __future__ import annotations

import glob
import math
import os
import reprlib
from dataclasses import dataclass, fields, replace
from typing import Any

import yaml

from agent.errors import SlatraceError
from agent.identity.cgroups import cgroup_glob_regex
from agent.identity.rules import ServiceRule
from agent.probe.features import ATTACH_MODES
from agent.store.histogram import BUCKETS_PER_OCTAVE, DEFAULT_BUCKETS_PER_OCTAVE

__all__ = [
    "Config",
    "ConfigError",
    "DEFAULT_CONFIG_YAML",
    "EngineTarget",
    "PRESETS",
    "REQUEST_SPAN_NAME",
    "RequestSpanRule",
    "RELAY_MATCHERS",
    "RelayRule",
    "RequestSpans",
    "ServiceRule",
    "Slo",
    "load_config",
    "parse_config",
    "parse_relays",
    "relays_from_flags",
]

MIN_INTERVAL_S = 0.1   # below it, polling the maps would take a core
MAX_INTERVAL_S = 60.0
DEFAULT_MAX_SERVICES = 1000
# The event stream's rate limit, per CPU per second (bpf/sched.bpf.c rate_ok()).
DEFAULT_EVENT_RATE = 50000
MIN_EVENT_RATE, MAX_EVENT_RATE = 1000, 10_000_000
MAX_RETENTION_S = 7 * 86400.0


class ConfigError(SlatraceError):
    """A configuration problem, worded as one sentence an operator can act on."""


@dataclass(frozen=True)
class Slo:
    """Latency targets of one service, in seconds; None means not judged."""

    service: str
    runq_p99: float | None = None
    runq_p95: float | None = None
    iowait_p99: float | None = None
    request_e2e_p99: float | None = None
    request_ttft_p99: float | None = None


@dataclass(frozen=True)
class RequestSpanRule:
    """Which spans are requests: a glob on the span name, the attributes holding
    the request id (first present wins; none: the span id) and the durations."""

    span_name: str
    request_id: tuple[str, ...] = ()
    e2e: str | None = None
    queue: str | None = None
    ttft: str | None = None
    server: str = "custom"
    # Attributes the span must carry with these values (presets: a server that
    # gives its request span's name to inner spans too).
    where: tuple[tuple[str, str], ...] = ()


# vLLM's request span (agent/traces/spans.py parses it in full).
REQUEST_SPAN_NAME = "llm_request"
# The module of TGI's HTTP handlers, as tracing-opentelemetry names it on their spans.
_TGI_HANDLERS = (("code.namespace", "text_generation_router::server"),)

# The inference servers whose request spans the agent knows, each a preset of
# `request_spans.servers`: its rules here; the span shapes they follow and the
# servers' command lines are agent/traces/servers.py's.
PRESETS: dict[str, tuple[RequestSpanRule, ...]] = {
    "vllm": (RequestSpanRule(REQUEST_SPAN_NAME, ("gen_ai.request.id",), server="vllm"),),
    "sglang": (RequestSpanRule("*Req *", ("rid", "gen_ai.request.id"), e2e="gen_ai.latency.e2e",
                               ttft="gen_ai.latency.time_to_first_token", server="sglang"),),
    "triton": (RequestSpanRule("InferRequest", server="triton"),),
    "tgi": tuple(RequestSpanRule(name, e2e="total_time", queue="queue_time", server="tgi", where=_TGI_HANDLERS)
                 for name in ("generate", "generate_stream", "completions", "chat_completions")),
}


@dataclass(frozen=True)
class RequestSpans:
    servers: tuple[str, ...] = ("vllm",)     # presets in force (spans and command lines)
    rules: tuple[RequestSpanRule, ...] = ()  # for other servers
    watch: tuple[str, ...] = ()              # services streamed from the start


@dataclass(frozen=True)
class RelayRule:
    """A sender trusted to relay spans (an OpenTelemetry Collector): its spans'
    origin is the one its resource attributes vouch for. It matches a sender
    when every matcher given does."""

    service: str | None = None              # glob on the service name the agent gives the sender
    cgroup: str | None = None               # glob on the sender's cgroup v2 path
    pid: int | None = None                  # a process of the sender's cgroup
    k8s_namespace: str | None = None        # the sending pod's namespace
    k8s_service_account: str | None = None  # and its service account


RELAY_MATCHERS = tuple(f.name for f in fields(RelayRule))


@dataclass(frozen=True)
class EngineTarget:
    """Where a service's inference engine serves its own Prometheus metrics,
    for engines the agent cannot find by their command line (`engines`)."""

    service: str
    url: str


@dataclass(frozen=True)
class Config:
    interval: float = 1.0
    retention: float = 900.0
    max_services: int = DEFAULT_MAX_SERVICES
    buckets_per_octave: int = DEFAULT_BUCKETS_PER_OCTAVE
    services: tuple[ServiceRule, ...] = ()
    slos: tuple[Slo, ...] = ()
    # Globs on service names whose histograms keep their buckets, besides the
    # services that have an SLO or are named by a rule.
    histograms: tuple[str, ...] = ()

    request_spans: RequestSpans = RequestSpans()
    # Senders trusted to relay other processes' spans (`otlp_relays`, --otlp-relay).
    otlp_relays: tuple[RelayRule, ...] = ()
    # Which tracepoints the programs attach to (agent/probe/loader.py
    # ATTACH_MODES); read at start-up only.
    attach_mode: str = "auto"
    # Per-wait events each CPU may stream per second for the services that send
    # request spans (the ring buffer's rate limit); beyond it events are dropped
    # and the requests they fall in are marked incomplete.
    event_rate: int = DEFAULT_EVENT_RATE
    # The exporter-toolkit web configuration (TLS, client certificates, basic
    # auth) of the API, /metrics and the OTLP receivers; --web-config-file wins.
    web_config_file: str | None = None
    # Engines' metrics endpoints beside those found from `vllm serve` command
    # lines (agent/traces/engines.py); read at start-up only.
    engines: tuple[EngineTarget, ...] = ()

    def histogram_globs(self) -> tuple[str, ...]:
        """Globs on the services whose histograms carry buckets: those an SLO
        or a rule names (matched literally), then the `histograms` list."""
        named = sorted({s.service for s in self.slos} | {r.name for r in self.services})
        return tuple(glob.escape(n) for n in named) + self.histograms


# What `slatrace run` uses without --config; tests check it parses to Config().
DEFAULT_CONFIG_YAML = f"""\
# slatrace configuration. Every key is optional; these are the defaults.
interval: 1            # seconds between aggregations (0 < interval <= 60)
retention: 900         # seconds of history the API can answer from (>= interval)
max_services: 1000     # at most this many service names, "other" included; new ones beyond count as "other"
buckets_per_octave: 2  # histogram buckets exported per power of two: 1, 2 (43 buckets), 4 or 8;
                       # 4 keeps histogram_quantile within ~8% of the agent's quantile, at twice the series
attach_mode: auto      # tracepoints the programs use: auto (raw where the kernel's BTF allows, else
                       # classic), raw or classic; read at start-up only
event_rate: {DEFAULT_EVENT_RATE}      # per-wait events each CPU may stream per second for services that send request
                       # spans; beyond it they are dropped and their requests marked incomplete (start-up only)
web_config_file:       # TLS, client certificates and basic auth for the API, /metrics and the OTLP
                       # receivers: node_exporter's --web.config.file format (relative to this file)
histograms: []         # services whose histograms keep their buckets (globs on the service name, "*" for
                       # all), besides those with an SLO or named by a rule; others export _sum/_count only

# First matching rule wins. A task matching no rule gets an automatic name:
# "host" for the root cgroup, otherwise its cgroup v2 path (e.g. /batch/etl).
services: []
#  - name: vllm
#    cgroup: "/kubepods*/**/cri-containerd-abc*"   # glob on the cgroup v2 path
#  - name: batch
#    comm: "stress-ng*"                             # glob on the process name
#  # also accepted: k8s_namespace, k8s_pod, k8s_container, systemd_unit, pid

slos: []
#  - service: vllm
#    runq_p99: 0.005            # seconds
#    request_e2e_p99: 2.0       # seconds, judged from the service's request spans

# Request spans received over OTLP. Servers found by their command line (and the
# services listed under watch) are streamed from the agent's start.
request_spans:
  servers: [vllm]              # presets: {", ".join(PRESETS)}
  rules: []
#  - span_name: "handle_request"   # glob on the span name
#    request_id: [app.request_id]  # attributes holding the id (else the span id)
#    e2e: app.total_seconds        # optional: end to end, queue and first-token times
#    queue: app.queue_seconds
#    ttft: app.ttft_seconds
  watch: []

# Senders trusted to relay spans (an OpenTelemetry Collector between the servers
# and the agent): their spans' service comes from the resource attributes they
# vouch for (k8s.pod.uid, k8s.pod.ip, container.id, process.pid with host.name
# or host.id). Every other sender is known by its connection alone.
otlp_relays: []
#  - service: otel-collector                  # glob on the sender's service name
#  - cgroup: "/system.slice/otelcol*.service"  # glob on its cgroup v2 path; also: pid
#  - k8s_namespace: observability              # pods of this namespace...
#    k8s_service_account: otel-collector       # ...running as this service account

# Inference engines' own Prometheus metrics, read beside the scheduler's figures
# (/api/v1/engines). A `vllm serve` is found by its command line (--host, --port);
# list others here. Read at start-up only.
engines: []
#  - service: vllm
#    url: http://10.0.0.7:8000/metrics
"""

_TOP_KEYS = ("interval", "retention", "max_services", "buckets_per_octave", "attach_mode", "event_rate", "histograms",
             "services", "slos", "request_spans", "otlp_relays", "web_config_file", "engines")
_REQUEST_SPANS_KEYS = ("servers", "rules", "watch")
_REQUEST_RULE_KEYS = ("span_name", "request_id", "e2e", "queue", "ttft")
_RULE_MATCHERS = (
    "cgroup",
    "comm",
    "k8s_namespace",
    "k8s_pod",
    "k8s_container",
    "systemd_unit",
    "pid",
)
_RULE_KEYS = ("name",) + _RULE_MATCHERS
_SLO_TARGETS = tuple(f.name for f in fields(Slo) if f.name != "service")
_SLO_KEYS = ("service",) + _SLO_TARGETS

# What each string matcher means, so a type error can say what was expected.
_MATCHER_HINTS = {
    "cgroup": "a glob on the cgroup v2 path",
    "comm": "a glob on the process name",
    "k8s_namespace": "a Kubernetes namespace",
    "k8s_pod": "a glob on the pod name",
    "k8s_container": "a container name",
    "systemd_unit": "a systemd unit name",
}


def load_config(path: str | None) -> Config:
    """Read and validate the file at `path`; no file means the embedded defaults."""
    if path is None:
        return parse_config(yaml.safe_load(DEFAULT_CONFIG_YAML), "<defaults>")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: cannot read: not UTF-8 text ({e.reason})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(_yaml_error_sentence(path, e)) from None
    config = parse_config(data, path)
    if config.web_config_file is not None and not os.path.isabs(config.web_config_file):
        config = replace(config, web_config_file=os.path.join(os.path.dirname(os.path.abspath(path)),
                                                              config.web_config_file))
    return config


def parse_config(data: Any, source: str) -> Config:
    """Validate already-loaded YAML data; `source` names the file in errors."""
    if data is None:
        return Config()
    top = _mapping(data, source, "", "the top level", _TOP_KEYS)
    interval = _number(top, "interval", source, default=1.0)
    problem = interval_problem(interval)
    if problem:
        raise ConfigError(f"{source}: interval: {problem}")
    retention = _number(top, "retention", source, default=900.0)
    problem = retention_problem(retention, interval)
    if problem:
        raise ConfigError(f"{source}: retention: {problem}")
    max_services = top.get("max_services")
    if max_services is None:
        max_services = DEFAULT_MAX_SERVICES
    if not _is_int(max_services) or max_services < 1:
        raise ConfigError(
            f"{source}: max_services: expected a whole number of at least 1, got {_short(max_services)}"
        )
    per_octave = top.get("buckets_per_octave")
    if per_octave is None:
        per_octave = DEFAULT_BUCKETS_PER_OCTAVE
    if not _is_int(per_octave) or per_octave not in BUCKETS_PER_OCTAVE:
        choices = ", ".join(str(n) for n in BUCKETS_PER_OCTAVE)
        raise ConfigError(f"{source}: buckets_per_octave: expected one of {choices}, got {_short(per_octave)}")
    attach_mode = top.get("attach_mode", "auto")
    if attach_mode not in ATTACH_MODES:
        raise ConfigError(f"{source}: attach_mode: expected one of {', '.join(ATTACH_MODES)}, "
                          f"got {_short(attach_mode)}")
    event_rate = top.get("event_rate", DEFAULT_EVENT_RATE)
    if not _is_int(event_rate) or not MIN_EVENT_RATE <= event_rate <= MAX_EVENT_RATE:
        raise ConfigError(f"{source}: event_rate: expected a whole number of events per CPU per second from "
                          f"{MIN_EVENT_RATE} to {MAX_EVENT_RATE}, got {_short(event_rate)}")
    rules = tuple(
        _service_rule(item, source, f"services[{i}]")
        for i, item in enumerate(_sequence(top, "services", source))
    )
    slos = tuple(
        _slo(item, source, f"slos[{i}]") for i, item in enumerate(_sequence(top, "slos", source))
    )
    histograms = tuple(_histogram_glob(item, source, f"histograms[{i}]")
                       for i, item in enumerate(_sequence(top, "histograms", source)))
    named = {r.name for r in rules}
    if len(named) >= max_services:
        raise ConfigError(
            f"{source}: max_services: must be more than the {len(named)} service names the rules give "
            f"(one name is kept for \"other\"), got {max_services!r}"
        )
    return Config(
        interval=float(interval),
        retention=float(retention),
        max_services=int(max_services),
        buckets_per_octave=int(per_octave),
        services=rules,
        slos=slos,
        histograms=histograms,
        request_spans=_request_spans(top.get("request_spans"), source),
        attach_mode=attach_mode,
        event_rate=int(event_rate),
        otlp_relays=parse_relays(_sequence(top, "otlp_relays", source), source, "otlp_relays"),
        web_config_file=_web_config_file(top.get("web_config_file"), source),
        engines=tuple(_engine(item, source, f"engines[{i}]")
                      for i, item in enumerate(_sequence(top, "engines", source))),
    )


def _engine(item: Any, source: str, where: str) -> EngineTarget:
    m = _mapping(item, source, where, "an engine (service and url)", ("service", "url"))
    service, url = m.get("service"), m.get("url")
    if not isinstance(service, str) or not service.strip():
        raise ConfigError(f"{source}: {where}.service: expected the service's name, got {_short(service)}")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ConfigError(f"{source}: {where}.url: expected the engine's metrics URL "
                          f"(http://HOST:PORT/metrics), got {_short(url)}")
    return EngineTarget(service.strip(), url)


def _web_config_file(value: Any, source: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{source}: web_config_file: expected the path of a web configuration file, "
                          f"got {_short(value)}")
    return value


def parse_relays(items: list[Any], source: str, where: str) -> tuple[RelayRule, ...]:
    """Relay rules from their YAML form (also what --otlp-relay's KEY=VALUE pairs make)."""
    return tuple(_relay(item, source, f"{where}[{i}]") for i, item in enumerate(items))


def relays_from_flags(values: list[str]) -> tuple[RelayRule, ...]:
    """`--otlp-relay KEY=VALUE[,KEY=VALUE]` flags as relay rules (checked as the file's are)."""
    items = []
    for value in values:
        pairs = [p.partition("=") for p in value.split(",") if p.strip()]
        if not pairs or any(not sep or not k.strip() for k, sep, _ in pairs):
            raise ConfigError(f"--otlp-relay {value!r}: expected KEY=VALUE pairs joined by commas, with keys "
                              f"among {', '.join(RELAY_MATCHERS)} (e.g. service=otel-collector)")
        item: dict[str, Any] = {}
        for k, _, v in pairs:
            k, v = k.strip(), v.strip()
            item[k] = int(v) if k == "pid" and v.isdigit() else v
        items.append(item)
    return tuple(_relay(item, f"--otlp-relay {value!r}", "") for value, item in zip(values, items))


def _relay(item: Any, source: str, where: str) -> RelayRule:
    m = _mapping(item, source, where, "a relay rule", RELAY_MATCHERS)
    at = f"{source}: {where}" if where else source
    given = {k: v for k, v in m.items() if v is not None}
    if not given:
        raise ConfigError(f"{at}: the relay rule has no matcher; add one of {', '.join(RELAY_MATCHERS)}")
    for key, value in given.items():
        field = f"{at}.{key}" if where else f"{at}: {key}"
        if key == "pid":
            if not _is_int(value) or value < 1:
                raise ConfigError(f"{field}: expected a process id (a whole number >= 1), got {_short(value)}")
        elif not isinstance(value, str) or not value.strip():
            raise ConfigError(f"{field}: expected a non-empty string, got {_short(value)}")
        elif key == "cgroup" and not value.startswith("/"):
            raise ConfigError(f"{field}: the glob must be an absolute cgroup v2 path, got {_short(value)}")
        elif key == "cgroup":
            try:
                cgroup_glob_regex(value)
            except ValueError as e:
                raise ConfigError(f"{field}: {e}; fix the [...] character class") from None
    if "k8s_service_account" in given and "k8s_namespace" not in given:
        raise ConfigError(f"{at}: a service account is named within its namespace; "
                          f"add k8s_namespace next to k8s_service_account")
    return RelayRule(**given)


def _histogram_glob(item: Any, source: str, where: str) -> str:
    if not isinstance(item, str) or not item.strip():
        raise ConfigError(
            f"{source}: {where}: expected a service name or a glob on service names (e.g. \"vllm\" or "
            f"\"/batch/*\"), got {item!r}"
        )
    return item


def interval_problem(value: float) -> str | None:
    """Why `value` is no usable interval (None when it is); shared by the file and the flags."""
    if not _is_number(value) or not MIN_INTERVAL_S <= value <= MAX_INTERVAL_S:
        return (f"must be a number of seconds from {MIN_INTERVAL_S:g} to {MAX_INTERVAL_S:g}, "
                f"got {_short(value)}")
    return None


def retention_problem(value: float, interval: float) -> str | None:
    if not _is_number(value) or not interval <= value <= MAX_RETENTION_S:
        return (f"must be a number of seconds from the interval ({interval:g} s) to "
                f"{MAX_RETENTION_S:g}, got {_short(value)}")
    return None


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlist = _REPR.maxdict = 4
_REPR.maxlevel = 2


def _short(value: Any, limit: int = 60) -> str:
    """repr(value) cut to `limit` characters: an error message quotes, never
    expands, what it was given (a YAML alias can stand for gigabytes)."""
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _request_spans(value: Any, source: str) -> RequestSpans:
    if value is None:
        return RequestSpans()
    m = _mapping(value, source, "request_spans", "the request span settings", _REQUEST_SPANS_KEYS)
    servers = _names(m, "servers", source, list(RequestSpans().servers))
    for name in servers:
        if name not in PRESETS:
            raise ConfigError(f"{source}: request_spans.servers: unknown server {name!r} "
                              f"(known: {', '.join(PRESETS)}; describe others under request_spans.rules)")
    rules = []
    for i, item in enumerate(_sequence(m, "rules", f"{source}: request_spans")):
        where = f"request_spans.rules[{i}]"
        r = _mapping(item, source, where, "a request span rule", _REQUEST_RULE_KEYS)
        name = r.get("span_name")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{source}: {where}.span_name: expected a glob on the span name, got {name!r}")
        ids = r.get("request_id")
        ids = [ids] if isinstance(ids, str) else (ids or [])
        if not isinstance(ids, list) or not all(isinstance(x, str) and x for x in ids):
            raise ConfigError(f"{source}: {where}.request_id: expected an attribute name or a list of them, "
                              f"got {r.get('request_id')!r}")
        durations = {}
        for key in ("e2e", "queue", "ttft"):
            if r.get(key) is not None and not (isinstance(r[key], str) and r[key]):
                raise ConfigError(f"{source}: {where}.{key}: expected an attribute name, got {r[key]!r}")
            durations[key] = r.get(key)
        rules.append(RequestSpanRule(name, tuple(ids), **durations))
    return RequestSpans(servers=tuple(servers), rules=tuple(rules),
                        watch=tuple(_names(m, "watch", source, [])))


def _names(m: dict[str, Any], key: str, source: str, default: list[str]) -> list[str]:
    value = m.get(key)
    if value is None:
        return default
    if not isinstance(value, list) or not all(isinstance(x, str) and x.strip() for x in value):
        raise ConfigError(f"{source}: request_spans.{key}: expected a list of names, got {value!r}")
    return value


def _service_rule(item: Any, source: str, where: str) -> ServiceRule:
    m = _mapping(item, source, where, "a service rule", _RULE_KEYS)
    name = m.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(
            f"{source}: {where}.name: expected the service name as a non-empty string, "
            f"got {_short(name)}"
        )
    given = [k for k in _RULE_MATCHERS if m.get(k) is not None]
    if not given:
        raise ConfigError(
            f"{source}: {where}: service {_short(name)} has no matcher; "
            f"add one of {', '.join(_RULE_MATCHERS)}"
        )
    values: dict[str, Any] = {}
    for key in given:
        value = m[key]
        if key == "pid":
            if not _is_int(value) or value < 1:
                raise ConfigError(
                    f"{source}: {where}.pid: expected a process id (a whole number >= 1), "
                    f"got {_short(value)}"
                )
        elif not isinstance(value, str) or not value:
            raise ConfigError(
                f"{source}: {where}.{key}: expected a string ({_MATCHER_HINTS[key]}), "
                f"got {_short(value)}"
            )
        elif key == "cgroup" and not value.startswith("/"):
            raise ConfigError(
                f"{source}: {where}.cgroup: the glob must be an absolute cgroup v2 path; "
                f"write '/{value}' or '/**/{value}' instead of {_short(value)}"
            )
        elif key == "cgroup":
            try:
                cgroup_glob_regex(value)
            except ValueError as e:
                raise ConfigError(
                    f"{source}: {where}.cgroup: {e}; fix the [...] character class"
                ) from None
        values[key] = value
    return ServiceRule(name=name, **values)


def _slo(item: Any, source: str, where: str) -> Slo:
    m = _mapping(item, source, where, "an SLO", _SLO_KEYS)
    service = m.get("service")
    if not isinstance(service, str) or not service.strip():
        raise ConfigError(
            f"{source}: {where}.service: expected the service name as a non-empty string, "
            f"got {_short(service)}"
        )
    targets: dict[str, float] = {}
    for key in _SLO_TARGETS:
        value = m.get(key)
        if value is None:
            continue
        if not _is_number(value) or value <= 0:
            raise ConfigError(
                f"{source}: {where}.{key}: expected a positive number of seconds, got {_short(value)}"
            )
        targets[key] = float(value)
    if not targets:
        raise ConfigError(
            f"{source}: {where}: the SLO of {_short(service)} sets no target; "
            f"add one of {', '.join(_SLO_TARGETS)}"
        )
    return Slo(service=service, **targets)


def _mapping(
    value: Any, source: str, where: str, what: str, known: tuple[str, ...]
) -> dict[str, Any]:
    prefix = f"{source}: {where}: " if where else f"{source}: "
    if not isinstance(value, dict):
        raise ConfigError(f"{prefix}expected {what} as a mapping of keys, got {_short(value)}")
    for key in value:
        if key not in known:
            raise ConfigError(
                f"{prefix}unknown key {_short(key)} (known keys: {', '.join(known)})"
            )
    return value


def _sequence(top: dict[str, Any], key: str, source: str) -> list[Any]:
    value = top.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError(
            f"{source}: {key}: expected a list (each item starting with '- '), got {_short(value)}"
        )
    return value


def _number(top: dict[str, Any], key: str, source: str, default: float) -> float:
    value = top.get(key)
    if value is None:  # `interval:` with nothing after it means the default, as for lists
        return default
    if not _is_number(value):
        raise ConfigError(f"{source}: {key}: expected a number of seconds, got {_short(value)}")
    return value  # as written, so range errors quote the user's own number


def _is_number(value: Any) -> bool:
    # YAML `true` loads as bool, which Python counts as an int; it is never a duration.
    # `.nan` and `.inf` are valid YAML floats but no usable duration either.
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _yaml_error_sentence(path: str, e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e)
    context = getattr(e, "context", None)
    detail = f"{context}, {problem}" if context else problem
    detail = " ".join(detail.split())
    if mark is not None:
        return f"{path}: line {mark.line + 1}: invalid YAML: {detail}"
    return f"{path}: invalid YAML: {detail}"
