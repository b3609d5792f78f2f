"""Which spans are requests, per inference server, and which processes serve them.

vLLM's `llm_request` span is parsed in full (agent.traces.spans). Other servers
describe their requests differently; a rule says which span is one request
(a glob on the span name), which attribute holds its id, and which hold its
end-to-end, queue and first-token times. Presets cover the servers known to
send spans (KERNEL-NOTES):

- sglang: `--enable-trace`; the root span of a request is "[role] Req <rid[:8]>",
  its id in `rid`;
- triton: `--trace-config mode=opentelemetry` (OTLP/HTTP only); one
  `InferRequest` span per request (1 in 1000 sampled by default: set rate=1);
- tgi: the router's `generate` / `generate_stream` spans, durations as text
  ("12.5ms") in `total_time`, `queue_time`, no request id (the span id names it).

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

from agent.config import REQUEST_SERVERS, RequestSpanRule
from agent.identity.cgroups import CgroupPaths
from agent.traces.identity import cgroup_v2_path
from agent.traces.spans import REQUEST_SPAN_NAME, RequestSpan, attributes, request_span

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

PRESETS: dict[str, tuple[RequestSpanRule, ...]] = {
    "vllm": (RequestSpanRule(REQUEST_SPAN_NAME, ("gen_ai.request.id",), server="vllm"),),
    "sglang": (RequestSpanRule("*Req *", ("rid",), server="sglang"),),
    "triton": (RequestSpanRule("InferRequest", ("triton.request_id", "request_id"), server="triton"),),
    "tgi": (RequestSpanRule("generate", e2e="total_time", queue="queue_time", server="tgi"),
            RequestSpanRule("generate_stream", e2e="total_time", queue="queue_time", server="tgi")),
}
assert set(PRESETS) == set(REQUEST_SERVERS) == set(_CMDLINES)


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
        self._exact = {r.span_name: r for r in reversed(self.rules) if not any(c in r.span_name for c in "*?[")}

    def match(self, name: str) -> RequestSpanRule | None:
        rule = self._exact.get(name)
        if rule is not None:
            return rule
        return next((r for r in self.rules if fnmatch.fnmatchcase(name, r.span_name)), None)


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

    def services(self) -> set[str]:
        found = set(self._named)
        for entry in self._proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                server = is_server_cmdline((entry / "cmdline").read_bytes(), self._servers)
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
            if (int(entry.name), service) not in self._seen:
                if len(self._seen) > 10_000:
                    self._seen.clear()  # pids churn; only the log line depends on it
                self._seen.add((int(entry.name), service))
                log.info("%s server (pid %s) found: streaming service %s's scheduler events from now on",
                         server, entry.name, service)
        return found
