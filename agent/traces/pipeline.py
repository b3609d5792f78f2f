"""From decoded export requests to attributed requests.

Receivers call `ingest` on their own threads; it only parses the `llm_request`
spans, finds their service and queues them, so a receiver answers in
microseconds per span. A worker (`process`, every `tick_s`) attributes each
queued request once the scheduler source covers its end: asking earlier would
read figures that are still being collected. Requests wait at most
`max_wait_s`, and at most `max_pending` (and `max_pending_bytes`) wait at
all; beyond either they are attributed by the worker with what there is and
marked incomplete, never dropped silently. When even that backlog outgrows
the worker, exports are refused (`Overloaded`, a retryable answer for the
sender) and counted, rather than costing the receiver threads.

Spans kept for forwarding are copied out of their export request, with their
attribute values cut to `max_attribute_length`: a kept span never pins the
whole request it came in.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any
from collections import deque
from dataclasses import dataclass, replace

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from agent.attribution.request_sched import RequestSched, RequestSchedSource
from agent.attribution.requests import judge, phase_windows, request_document
from agent.config import Slo
from agent.identity.services import HOST, KERNEL, OTHER, UNKNOWN
from agent.traces.identity import Peer, SpanOrigin, SpanServices, describe_peer, unresolved_hint
from agent.traces.metrics import TraceCounters
from agent.traces.otlp_decode import truncate_attributes
from agent.traces.request_store import RequestStore
from agent.traces.servers import RequestRules, parse_request
from agent.traces.spans import RequestSpan, attributes, iter_spans
from agent.workers import Worker

__all__ = ["MAX_FUTURE_SKEW_S", "Overloaded", "RequestPipeline", "SpanSink"]

log = logging.getLogger(__name__)

MiB = 1 << 20
# A span may end at most this far after the agent's clock (clock skew between
# hosts); a later end is clamped to it, so a bogus end cannot hold the queue.
MAX_FUTURE_SKEW_S = 5.0
# Bytes a pending request costs beside its protobuf span (the parsed form).
_PENDING_OVERHEAD = 600


class Overloaded(Exception):
    """The pipeline cannot take more now; receivers answer a retryable error."""


# Never streamed because a span says so: whole-host buckets, whose events would
# swamp the stream (one span claiming `host` used to cost a fifth of a core).
NEVER_WATCHED = frozenset({HOST, KERNEL.name, UNKNOWN, OTHER})
# One warning per unresolved reason at most this often.
WARN_EVERY_S = 300.0


class SpanSink:
    """Where spans go on (the forwarder); the default sink drops them."""

    def forward(self, resource_spans: ResourceSpans, scope_spans: ScopeSpans, span: Span,
                extra: dict | None = None) -> None:
        pass


@dataclass
class _Pending:
    span: RequestSpan
    origin: SpanOrigin
    received: float
    proto: tuple[ResourceSpans, ScopeSpans, Span] | None  # kept only when forwarding
    size: int = _PENDING_OVERHEAD


class RequestPipeline:
    def __init__(
        self,
        sched: RequestSchedSource,
        services: SpanServices,
        slos: Iterable[Slo],
        store: RequestStore,
        counters: TraceCounters,
        sink: SpanSink | None = None,
        *,
        rules: RequestRules | None = None,
        cpu_limits: Callable[[str], Sequence[Any]] = lambda service: (),
        max_pending: int = 50_000,
        max_pending_bytes: int = 64 * MiB,
        max_attribute_length: int = 8192,
        max_wait_s: float = 10.0,
        tick_s: float = 0.1,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._sched = sched
        self._cpu_limits = cpu_limits   # service -> its CPU limits (objects with as_dict())
        self._services = services
        self._slos = tuple(slos)
        self.store = store
        self.counters = counters
        self._sink = sink
        self._rules = rules if rules is not None else RequestRules()
        self.max_pending = max_pending
        self.max_pending_bytes = max_pending_bytes
        self.max_attribute_length = max_attribute_length
        self._pending_bytes = 0
        # Popped from the heap for lack of room, finished by the worker.
        self._early: deque[_Pending] = deque()
        self.max_wait_s = max_wait_s
        self.tick_s = tick_s
        self._clock = clock
        self._lock = threading.Lock()
        self._heap: list[tuple[float, int, _Pending]] = []  # by span end
        self._seq = itertools.count()
        self._warned: dict[str, float] = {}  # unresolved reason -> when last warned
        self.worker = Worker.periodic("requests", "attributing requests", self.process, tick_s, first_now=False,
                                      on_error=lambda e: self.counters.add_attribution_error())

    def set_slos(self, slos: Iterable[Slo]) -> None:
        """Judge requests finished from now on against these (a config reload)."""
        self._slos = tuple(slos)

    # --- receiver side ---------------------------------------------------

    def ingest(self, req: ExportTraceServiceRequest, transport: str, peer: Peer | None = None) -> int:
        """Take every span of an export request sent from `peer`; returns how
        many were taken."""
        self._admit()
        self.counters.add_truncated(truncate_attributes(req, self.max_attribute_length))
        n = 0
        now = self._clock()
        origins: dict[int, SpanOrigin] = {}
        copies: dict[int, tuple[ResourceSpans, ScopeSpans]] = {}
        for rs, ss, span in iter_spans(req):
            n += 1
            rule = self._rules.match(span.name, span)
            if rule is None:
                if self._sink is not None:
                    self._sink.forward(*detached(rs, ss, span, copies))
                continue
            origin = origins.get(id(rs))
            if origin is None:
                origin = origins[id(rs)] = self._services.origin(peer, attributes(rs.resource.attributes))
                self._note_origin(origin, peer)
            parsed = clamped(parse_request(rule, span), now)
            if origin.service is not None and origin.service not in NEVER_WATCHED:
                self._sched.watch(origin.service)  # record finely while it sends
            elif origin.reason is not None:
                self.counters.add_unresolved(origin.reason)
            proto = detached(rs, ss, span, copies) if self._sink is not None else None
            size = _PENDING_OVERHEAD + (proto[2].ByteSize() if proto is not None else 0)
            self._push(_Pending(parsed, origin, now, proto, size))
        self.counters.add_received(transport, n)
        return n

    def _admit(self) -> None:
        """Refuse an export while the early backlog (requests already pushed
        out of the heap) is more than the worker clears in a few ticks."""
        with self._lock:
            backlog = len(self._early)
        if backlog > max(1000, self.max_pending // 10):
            raise Overloaded(f"{backlog} requests are waiting to be attributed; retry later")

    def _push(self, item: _Pending) -> None:
        """Into the heap by end; past the count or byte budget the oldest go
        to the worker's early list, to be attributed with what there is."""
        with self._lock:
            heapq.heappush(self._heap, (item.span.end, next(self._seq), item))
            self._pending_bytes += item.size
            while self._heap and (len(self._heap) > self.max_pending
                                  or self._pending_bytes > self.max_pending_bytes):
                out = heapq.heappop(self._heap)[2]
                self._pending_bytes -= out.size
                self._early.append(out)
                self.counters.pending_dropped += 1
            self.counters.pending = len(self._heap)

    def _note_origin(self, origin: SpanOrigin, peer: Peer | None) -> None:
        for attr in origin.ignored:
            self.counters.add_claim_ignored(attr)
        if origin.reason is None:
            return
        now = self._clock()
        if now - self._warned.get(origin.reason, -WARN_EVERY_S) >= WARN_EVERY_S:
            self._warned[origin.reason] = now
            log.warning("request spans from %s are not attributed to any service (%s): %s",
                        describe_peer(peer), origin.reason, unresolved_hint(origin.reason))

    # --- worker side -----------------------------------------------------

    def process(self) -> int:
        """Attribute every pending request whose end is covered (or that waited
        too long); returns how many were attributed."""
        covered = self._sched.covered_until()
        now = self._clock()
        ready: list[tuple[_Pending, bool]] = []
        with self._lock:
            while self._early:
                ready.append((self._early.popleft(), False))
            while self._heap and self._heap[0][0] <= covered:
                ready.append((heapq.heappop(self._heap)[2], True))
            # Clock skew or a stalled source: don't hold a request forever.
            stale = [e for e in self._heap if now - e[2].received > self.max_wait_s]
            if stale:
                self._heap = [e for e in self._heap if now - e[2].received <= self.max_wait_s]
                heapq.heapify(self._heap)
                ready.extend((e[2], False) for e in stale)
            self._pending_bytes = sum(e[2].size for e in self._heap) if stale else self._pending_bytes - sum(
                item.size for item, complete in ready if complete)
            self.counters.pending = len(self._heap)
        for item, complete in ready:
            self._finish(item, complete)
        return len(ready)

    def pending(self) -> int:
        with self._lock:
            return len(self._heap)

    def _finish(self, item: _Pending, complete: bool) -> None:
        span, service = item.span, item.origin.service
        sched: RequestSched | None = None
        if service is not None:
            try:
                front = item.origin.pid   # the process that sent the span: the request's front end
                sched = self._sched.between(service, span.start, span.end, front, phase_windows(span))
            except Exception:  # a source bug must cost one request's figures, not the pipeline
                self.counters.add_attribution_error()
                log.exception("scheduling figures for request %s failed", span.request_id)
        slo = judge(span, self._slos, service)
        limits = [limit.as_dict() for limit in self._cpu_limits(service)] if service is not None else []
        doc = request_document(span, service, item.origin.how, sched, slo, complete, limits)
        self.store.add(doc)
        self.counters.add_request(doc["service"], sched.delay_seconds if sched else None, slo, span.end,
                                  doc["sched"]["delay_by"] if sched else [])
        if self._sink is not None and item.proto is not None:
            self._sink.forward(*item.proto, extra=enrichment(doc))

    def start(self) -> None:
        self.worker.start()

    def stop(self) -> None:
        self.worker.stop(5.0)


def clamped(span: RequestSpan, now: float) -> RequestSpan:
    """`span` with its end (and start) no later than now plus the allowed skew."""
    limit = now + MAX_FUTURE_SKEW_S
    if span.end <= limit:
        return span
    start = min(span.start, limit)
    return replace(span, start=start, end=limit, e2e=min(span.e2e, limit - start))


def detached(rs: ResourceSpans, ss: ScopeSpans, span: Span,
             copies: dict[int, tuple[ResourceSpans, ScopeSpans]]) -> tuple[ResourceSpans, ScopeSpans, Span]:
    """Copies of the span and of its resource and scope (without their other
    spans), shared per scope through `copies`: what is kept no longer holds
    the export request's memory."""
    pair = copies.get(id(ss))
    if pair is None:
        pair = copies[id(ss)] = (ResourceSpans(resource=rs.resource, schema_url=rs.schema_url),
                                 ScopeSpans(scope=ss.scope, schema_url=ss.schema_url))
    own = Span()
    own.CopyFrom(span)
    return pair[0], pair[1], own


def enrichment(doc: dict) -> dict:
    """The `slatrace.*` attributes added to a forwarded request span."""
    out: dict = {"slatrace.service": doc["service"], "slatrace.verdict": doc["verdict"],
                 "slatrace.slo_breached": any(not s["ok"] for s in doc["slo"])}
    sched = doc["sched"]
    if sched is not None:
        out.update({
            "slatrace.delay_seconds": sched["delay_seconds"],
            "slatrace.runq_thread_seconds": sched["runq_thread_seconds"],
            "slatrace.runq_wait_seconds": sched["runq_wait_seconds"],
            "slatrace.preemptions": sched["preemptions"],
            "slatrace.iowait_seconds": sched["iowait_seconds"],
            "slatrace.migrations": sched["migrations"],
        })
        if sched["delay_by_cause"]:
            # The largest cause, and each cause's seconds (a trace backend can group by them).
            out["slatrace.top_cause"] = next(iter(sched["delay_by_cause"]))
            out.update({f"slatrace.delay_by_cause.{cause}": seconds
                        for cause, seconds in sched["delay_by_cause"].items()})
        if doc["culprits"]:
            top = doc["culprits"][0]
            out["slatrace.top_culprit"] = top["service"]
            out["slatrace.top_culprit_wait_seconds"] = top["wait_seconds"]
    return out

