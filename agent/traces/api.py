"""`/api/v1/requests` and `/api/v1/requests/{id}` over the request store, and
`/api/v1/spans`: what the receivers took in and what could not be placed.

Registered through AgentState.extra_routes; each handler is a pure function of
the query, like the rest of the API.
"""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import unquote

from dataclasses import asdict

from agent.transport.response import QueryError, Response, error, float_param, json_response, str_param
from agent.config import RelayRule
from agent.traces.metrics import TraceCounters
from agent.traces.request_store import RequestStore

__all__ = ["REQUESTS_PATH", "SPANS_PATH", "request_routes"]

REQUESTS_PATH = "/api/v1/requests"
SPANS_PATH = "/api/v1/spans"
_TRUE = ("1", "true", "yes")
_FALSE = ("0", "false", "no", "")

Query = dict[str, list[str]]


def request_routes(store: RequestStore, counters: TraceCounters | None = None,
                   relays: Callable[[], tuple[RelayRule, ...]] = tuple) -> dict[str, Callable[[Query], Response]]:
    def listing(query: Query) -> Response:
        try:
            since = float_param(query, "since", store.retention_s)
            breached_raw = (str_param(query, "breached") or "").lower()
            if breached_raw not in _TRUE + _FALSE:
                raise QueryError(f"breached={breached_raw!r} must be true or false")
        except QueryError as e:
            return error(400, str(e))
        docs = store.query(service=str_param(query, "service"), since_s=since, breached=breached_raw in _TRUE)
        return json_response(200, {"requests": docs})

    def one(query: Query) -> Response:
        request_id = unquote(query.get("_tail", [""])[0]).strip("/")
        if not request_id:
            return listing(query)
        docs = store.get_all(request_id)
        if not docs:
            return error(404, f"no request {request_id!r} in the last {store.retention_s:.0f} s; "
                              f"list them with {REQUESTS_PATH}")
        # With n > 1 the child requests share the id: the first answers, the others ride along.
        return json_response(200, dict(docs[0], siblings=docs[1:]) if len(docs) > 1 else docs[0])

    def spans(query: Query) -> Response:
        return json_response(200, spans_document(counters or TraceCounters(), relays()))

    return {REQUESTS_PATH: listing, REQUESTS_PATH + "/": one, SPANS_PATH: spans}


def spans_document(counters: TraceCounters, relays: tuple[RelayRule, ...]) -> dict:
    """Counts since the agent started: spans taken per transport, request
    spans whose service could not be found (by reason), resources whose claims
    were ignored (by attribute), and the relays trusted."""
    with counters._lock:
        return {
            "received": dict(counters.received),
            "rejected": [{"transport": t, "reason": r, "count": n} for (t, r), n in sorted(counters.rejected.items())],
            "unresolved": dict(sorted(counters.unresolved.items())),
            "claims_ignored": dict(sorted(counters.claims_ignored.items())),
            "relays": [{k: v for k, v in asdict(r).items() if v is not None} for r in relays],
        }
