"""Finished requests for the API: bounded in number, in bytes and in age.

The insertion-ordered dict is the index and the eviction order when the store
is over its count or byte budget; a heap of end times is the expiry order, so
one request with an absurd end time cannot hold back the expiry of every later
one.

Entries are keyed by span (trace id, span id), not by request id: with n > 1
vLLM ends one span per child request, all carrying the parent's id, and every
one of those siblings is kept.
"""

from __future__ import annotations

import heapq
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["RequestStore"]

MiB = 1 << 20


def doc_bytes(doc: dict) -> int:
    """What a document costs, counted as its JSON size (the Python objects take
    a small multiple of it, the same for every document)."""
    return len(json.dumps(doc, separators=(",", ":"), default=str))


# A request span: (trace id, span id).
_Key = tuple[str, str]


class RequestStore:
    def __init__(self, retention_s: float, max_requests: int = 20_000, max_bytes: int = 32 * MiB,
                 clock: Callable[[], float] = time.time, on_evict: Callable[[int], None] | None = None) -> None:
        self.retention_s = retention_s
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self._clock = clock
        self._on_evict = on_evict
        self._lock = threading.Lock()
        self._by_id: OrderedDict[_Key, tuple[dict, int]] = OrderedDict()  # (trace, span) -> (doc, bytes)
        self._spans_of: dict[str, list[_Key]] = {}        # request id -> its spans' keys
        self._by_end: list[tuple[float, int, _Key]] = []  # (end, generation, key), stale entries skipped
        self._gen = 0
        self._gens: dict[_Key, int] = {}
        self.bytes = 0
        self.evicted = 0

    def add(self, doc: dict) -> None:
        size = doc_bytes(doc)
        evicted = 0
        key = (doc.get("trace_id") or "", doc.get("span_id") or doc["request_id"])
        with self._lock:
            # A repeated span (a retried export) replaces the older copy.
            self._drop_locked(key)
            self._gen += 1
            self._by_id[key] = (doc, size)
            self._spans_of.setdefault(doc["request_id"], []).append(key)
            self._gens[key] = self._gen
            heapq.heappush(self._by_end, (doc["end"], self._gen, key))
            self.bytes += size
            while self._by_id and (len(self._by_id) > self.max_requests or self.bytes > self.max_bytes):
                self._drop_locked(next(iter(self._by_id)))
                evicted += 1
            self.evicted += evicted
            self._expire_locked()
        if evicted and self._on_evict is not None:
            self._on_evict(evicted)

    def get(self, request_id: str) -> dict | None:
        """The first request with this id (see `get_all` for its siblings)."""
        found = self.get_all(request_id)
        return found[0] if found else None

    def get_all(self, request_id: str) -> list[dict]:
        """Every request with this id, oldest first: more than one when n > 1."""
        with self._lock:
            self._expire_locked()
            return [self._by_id[k][0] for k in self._spans_of.get(request_id, ())]

    def query(self, service: str | None = None, since_s: float | None = None,
              breached: bool = False) -> list[dict]:
        """Requests that ended in the last `since_s` seconds, oldest first."""
        with self._lock:
            self._expire_locked()
            docs = [doc for doc, _ in self._by_id.values()]
        cutoff = self._clock() - since_s if since_s is not None else None
        return [d for d in docs
                if (service is None or d["service"] == service)
                and (cutoff is None or d["end"] >= cutoff)
                and (not breached or any(not s["ok"] for s in d["slo"]))]

    def __len__(self) -> int:
        return len(self._by_id)

    def _drop_locked(self, key: tuple[str, str]) -> None:
        entry = self._by_id.pop(key, None)
        if entry is None:
            return
        self.bytes -= entry[1]
        self._gens.pop(key, None)
        request_id = entry[0]["request_id"]
        keys = self._spans_of.get(request_id, [])
        if key in keys:
            keys.remove(key)
        if not keys:
            self._spans_of.pop(request_id, None)

    def _expire_locked(self) -> None:
        cutoff = self._clock() - self.retention_s
        heap = self._by_end
        while heap and heap[0][0] < cutoff:
            _, gen, key = heapq.heappop(heap)
            if self._gens.get(key) == gen:
                self._drop_locked(key)
        # Entries of replaced or evicted documents are skipped above; rebuild
        # when they outnumber the live ones, so the heap stays bounded too.
        if len(heap) > 2 * len(self._by_id) + 1024:
            self._by_end = [e for e in heap if self._gens.get(e[2]) == e[1]]
            heapq.heapify(self._by_end)
