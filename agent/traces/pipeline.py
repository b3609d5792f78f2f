"""From decoded export requests to attributed requests.

Receivers call `ingest` on their own threads; it only parses the `llm_request`
spans, finds their service and queues them, so a receiver answers in
microseconds per span. A worker (`process`, every `tick_s`) attributes each
queued request once the scheduler source covers its end: asking earlier would
read figures that are still being collected. Requests wait at most
`max_wait_s`, and at most `max_pending` wait at all; beyond either they are
attributed with what there is and marked incomplete, never dropped silently.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from agent.attribution.request_sched import RequestSched, RequestSchedSource
from agent.attribution.requests import judge, request_document
from agent.config import Slo
from agent.identity.services import HOST, KERNEL, OTHER, UNKNOWN
from agent.traces.identity import Peer, SpanOrigin, SpanServices, describe_peer, unresolved_hint
from agent.traces.metrics import TraceCounters
from agent.traces.request_store import RequestStore
from agent.traces.servers import RequestRules, parse_request
from agent.traces.spans import RequestSpan, attributes, iter_spans

__all__ = ["RequestPipeline", "SpanSink"]

log = logging.getLogger(__name__)

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
        max_pending: int = 50_000,
        max_wait_s: float = 10.0,
        tick_s: float = 0.1,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._sched = sched
        self._services = services
        self._slos = tuple(slos)
        self.store = store
        self.counters = counters
        self._sink = sink
        self._rules = rules if rules is not None else RequestRules()
        self.max_pending = max_pending
        self.max_wait_s = max_wait_s
        self.tick_s = tick_s
        self._clock = clock
        self._lock = threading.Lock()
        self._heap: list[tuple[float, int, _Pending]] = []  # by span end
        self._seq = itertools.count()
        self._warned: dict[str, float] = {}  # unresolved reason -> when last warned
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors = 0

    # --- receiver side ---------------------------------------------------

    def ingest(self, req: ExportTraceServiceRequest, transport: str, peer: Peer | None = None) -> int:
        """Take every span of an export request sent from `peer`; returns how
        many were taken."""
        n = 0
        now = self._clock()
        origins: dict[int, SpanOrigin] = {}
        overflow: list[_Pending] = []
        for rs, ss, span in iter_spans(req):
            n += 1
            rule = self._rules.match(span.name)
            if rule is None:
                if self._sink is not None:
                    self._sink.forward(rs, ss, span)
                continue
            origin = origins.get(id(rs))
            if origin is None:
                origin = origins[id(rs)] = self._services.origin(peer, attributes(rs.resource.attributes))
                self._note_origin(origin, peer)
            parsed = parse_request(rule, span)
            if origin.service is not None and origin.service not in NEVER_WATCHED:
                self._sched.watch(origin.service)  # record finely while it sends
            elif origin.reason is not None:
                self.counters.add_unresolved(origin.reason)
            item = _Pending(parsed, origin, now, (rs, ss, span) if self._sink is not None else None)
            with self._lock:
                heapq.heappush(self._heap, (parsed.end, next(self._seq), item))
                if len(self._heap) > self.max_pending:
                    overflow.append(heapq.heappop(self._heap)[2])
                self.counters.pending = len(self._heap)
        self.counters.add_received(transport, n)
        for item in overflow:
            # The oldest request goes out now, with what the source has.
            self.counters.pending_dropped += 1
            self._finish(item, complete=False)
        return n

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
            while self._heap and self._heap[0][0] <= covered:
                ready.append((heapq.heappop(self._heap)[2], True))
            # Clock skew or a stalled source: don't hold a request forever.
            stale = [e for e in self._heap if now - e[2].received > self.max_wait_s]
            if stale:
                self._heap = [e for e in self._heap if now - e[2].received <= self.max_wait_s]
                heapq.heapify(self._heap)
                ready.extend((e[2], False) for e in stale)
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
                sched = self._sched.between(service, span.start, span.end)
            except Exception:  # a source bug must cost one request's figures, not the pipeline
                self.errors += 1
                log.exception("scheduling figures for request %s failed", span.request_id)
        slo = judge(span, self._slos, service)
        doc = request_document(span, service, item.origin.how, sched, slo, complete)
        self.store.add(doc)
        self.counters.add_request(doc["service"], sched.runq_wait_seconds if sched else None, slo, span.end)
        if self._sink is not None and item.proto is not None:
            self._sink.forward(*item.proto, extra=enrichment(doc))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="requests", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                self.process()
            except Exception:
                self.errors += 1
                log.exception("attributing requests failed; retrying next tick")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


def enrichment(doc: dict) -> dict:
    """The `slatrace.*` attributes added to a forwarded request span."""
    out: dict = {"slatrace.service": doc["service"], "slatrace.verdict": doc["verdict"],
                 "slatrace.slo_breached": any(not s["ok"] for s in doc["slo"])}
    sched = doc["sched"]
    if sched is not None:
        out.update({
            "slatrace.runq_wait_seconds": sched["runq_wait_seconds"],
            "slatrace.preemptions": sched["preemptions"],
            "slatrace.iowait_seconds": sched["iowait_seconds"],
            "slatrace.migrations": sched["migrations"],
        })
        if doc["culprits"]:
            top = doc["culprits"][0]
            out["slatrace.top_culprit"] = top["service"]
            out["slatrace.top_culprit_wait_seconds"] = top["wait_seconds"]
    return out

