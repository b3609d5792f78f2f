"""Which spans are requests, per inference server, and which processes serve them.

vLLM's `llm_request` span is parsed in full (agent.traces.spans). Other servers
describe their requests differently; a rule says which span is one request
(a glob on the span name, and attributes it must carry), which attribute holds
its id, and which hold its end-to-end, queue and first-token times. Presets
(their rules in agent/config.py PRESETS, their command lines here) cover the
servers known to send spans, checked against span shapes derived from each
server's own tracing code (tests/unit/fixtures/otlp/*, which name the release
or commit read):

- sglang (`--enable-trace`, OTLP/gRPC or http/protobuf, service.name
  `sglang`): the root span of a request is "<role> Req <rid[:8]>" (role empty
  unless prefill/decode are disaggregated, so often " Req ..."), with `rid`
  and, once finished, `gen_ai.request.id`, `gen_ai.latency.e2e` and
  `gen_ai.latency.time_to_first_token` in seconds (no queue time); its thread
  and stage spans are not requests;
- triton (`--trace-config mode=opentelemetry`, OTLP/HTTP only, 1 in 1000
  sampled by default: set rate=1): one `InferRequest` root span per request,
  from receiving it to sending the response; it carries no attributes — the
  client's request id (`triton.request_id`) is on its child span named after
  the model — so the span id names the request, and the trace id joins the two;
- tgi (the router's `--otlp-endpoint`, OTLP/gRPC, service.name
  `text-generation-inference.router`): the handlers `generate`,
  `generate_stream`, `completions` and `chat_completions` record
  `total_time` and `queue_time` as text ("812.4ms", Rust's Duration); the
  router's inner `Infer::generate` / `Infer::generate_stream` spans carry the
  same names, so only spans of the handlers' module
  (`code.namespace=text_generation_router::server`) are requests; no request
  id (the span id names it).

The same presets name the servers' command lines, so their processes can be
streamed from the agent's start: a request's figures are only exact from the
moment its service is watched, and a server's first spans arrive seconds after
its first requests (vLLM exports in 5 s batches).
"""

from __future__ import annotations

import fnmatch
import logging
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from opentelemetry.proto.trace.v1.trace_pb2 import Span

from agent.config import PRESETS, RequestSpanRule
from agent.identity.cgroups import CgroupPaths
from agent.traces.engine_metrics import engine_url
from agent.traces.identity import cgroup_v2_path
from agent.traces.spans import RequestSpan, attributes, request_span

__all__ = ["PRESETS", "RequestRules", "ServerProcesses", "is_server_cmdline", "parse_duration", "parse_request"]

log = logging.getLogger(__name__)


def parse_request(rule: RequestSpanRule, span: Span) -> RequestSpan:
    """A span that `rule` says is a request, in typed form."""
    if rule.server == "vllm":
        return request_span(span)
    attrs = attributes(span.attributes)
    start = span.start_time_unix_nano / 1e9
    end = max(span.end_time_unix_nano / 1e9, start)
    span_id = span.span_id.hex()
    rid = next((str(attrs[k]) for k in rule.request_id if attrs.get(k) not in (None, "")), None)
    e2e = _seconds(attrs, rule.e2e)
    return RequestSpan(
        request_id=rid or span_id, trace_id=span.trace_id.hex(), span_id=span_id,
        parent_span_id=span.parent_span_id.hex() or None, start=start, end=end,
        e2e=e2e if e2e is not None and e2e >= 0 else end - start,
        ttft=_seconds(attrs, rule.ttft), queue=_seconds(attrs, rule.queue))


_CMDLINES: dict[str, tuple[re.Pattern[str], ...]] = {
    # `vllm serve MODEL`, `python -m vllm.entrypoints.openai.api_server`, vLLM V1's engine core
    # and workers (their process titles), all of which the API server's span speaks for.
    "vllm": (re.compile(r"(^|/)vllm\x00serve(\x00|$)"), re.compile(r"\x00-m\x00vllm\.entrypoints\."),
             re.compile(r"^VLLM::")),
    "sglang": (re.compile(r"\x00-m\x00sglang\.launch_server(\x00|$)"), re.compile(r"(^|/)sglang\x00serve(\x00|$)")),
    "triton": (re.compile(r"(^|/)tritonserver(\x00|$)"),),
    "tgi": (re.compile(r"(^|/)text-generation-(launcher|router|server)(\x00|$)"),),
}

assert set(PRESETS) == set(_CMDLINES)


def parse_duration(value: Any) -> float | None:
    """Seconds from a number, or from text as Rust's Duration prints it ("1.5s", "12.3ms", "40µs")."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value) if value == value else None
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(ns|µs|us|ms|s)?\s*", value)
        if m:
            scale = {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1.0}[m.group(2)]
            return float(m.group(1)) * scale
    return None


def _seconds(attrs: Mapping[str, Any], key: str | None) -> float | None:
    return parse_duration(attrs.get(key)) if key else None


class RequestRules:
    """The rules in force: the enabled presets, then the configured rules."""

    def __init__(self, servers: Iterable[str] = ("vllm",), rules: Iterable[RequestSpanRule] = ()) -> None:
        self.rules = tuple(r for s in servers for r in PRESETS[s]) + tuple(rules)
        self._exact: dict[str, list[RequestSpanRule]] = {}
        for r in self.rules:
            if not any(c in r.span_name for c in "*?["):
                self._exact.setdefault(r.span_name, []).append(r)
        self._globs = tuple(r for r in self.rules if any(c in r.span_name for c in "*?["))

    def match(self, name: str, span: Span | None = None) -> RequestSpanRule | None:
        """The first rule for a span of this name (whose required attributes
        `span` carries); exact names before globs."""
        for rule in self._exact.get(name, ()):
            if _holds(rule, span):
                return rule
        return next((r for r in self._globs if fnmatch.fnmatchcase(name, r.span_name) and _holds(r, span)), None)


def _holds(rule: RequestSpanRule, span: Span | None) -> bool:
    if not rule.where:
        return True
    if span is None:
        return False
    attrs = attributes(span.attributes)
    return all(str(attrs.get(key)) == value for key, value in rule.where)


def is_server_cmdline(cmdline: bytes, servers: Iterable[str]) -> str | None:
    """The preset whose command line this is (/proc/PID/cmdline bytes), if any."""
    text = cmdline.rstrip(b"\0").decode("utf-8", "replace")
    for server in servers:
        if any(p.search(text) for p in _CMDLINES.get(server, ())):
            return server
    return None


class ServerProcesses:
    """Services that run a known inference server now, from /proc's command
    lines, plus the services the config names: streamed from the start."""

    def __init__(self, cgroups: CgroupPaths, service_of: Callable[[int], str], servers: Iterable[str],
                 named: Iterable[str] = (), proc_root: Path = Path("/proc")) -> None:
        self._cgroups = cgroups
        self._service_of = service_of
        self._servers = tuple(servers)
        self._named = frozenset(named)
        self._proc = Path(proc_root)
        self._seen: set[tuple[int, str]] = set()
        # service -> where its engine serves its own metrics (vLLM's /metrics), from the last scan
        self.engines: dict[str, str] = {}

    def services(self) -> set[str]:
        found = set(self._named)
        engines: dict[str, str] = {}
        for entry in self._proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes()
                server = is_server_cmdline(cmdline, self._servers)
                if server is None:
                    continue
                path = cgroup_v2_path((entry / "cgroup").read_text())
            except OSError:
                continue  # gone meanwhile
            cgid = self._cgroups.id_of(path) if path else None
            if cgid is None:
                continue
            service = self._service_of(cgid)
            found.add(service)
            url = engine_url(cmdline.rstrip(b"\0").decode("utf-8", "replace").split("\0")) if server == "vllm" else None
            if url is not None:
                engines.setdefault(service, url)
            if (int(entry.name), service) not in self._seen:
                if len(self._seen) > 10_000:
                    self._seen.clear()  # pids churn; only the log line depends on it
                self._seen.add((int(entry.name), service))
                log.info("%s server (pid %s) found: streaming service %s's scheduler events from now on",
                         server, entry.name, service)
        self.engines = engines
        return found
