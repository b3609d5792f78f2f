"""Finished requests for the API: bounded in number, in bytes and in age.

The insertion-ordered dict is the index by id and the eviction order when the
store is over its count or byte budget; a heap of end times is the expiry
order, so one request with an absurd end time cannot hold back the expiry of
every later one.
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


class RequestStore:
    def __init__(self, retention_s: float, max_requests: int = 20_000, max_bytes: int = 32 * MiB,
                 clock: Callable[[], float] = time.time, on_evict: Callable[[int], None] | None = None) -> None:
        self.retention_s = retention_s
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self._clock = clock
        self._on_evict = on_evict
        self._lock = threading.Lock()
        self._by_id: OrderedDict[str, tuple[dict, int]] = OrderedDict()  # id -> (doc, bytes)
        self._by_end: list[tuple[float, int, str]] = []  # (end, generation, id), stale entries skipped
        self._gen = 0
        self._gens: dict[str, int] = {}
        self.bytes = 0
        self.evicted = 0

    def add(self, doc: dict) -> None:
        size = doc_bytes(doc)
        evicted = 0
        with self._lock:
            # A repeated id (a retried export) replaces the older copy.
            self._drop_locked(doc["request_id"])
            self._gen += 1
            self._by_id[doc["request_id"]] = (doc, size)
            self._gens[doc["request_id"]] = self._gen
            heapq.heappush(self._by_end, (doc["end"], self._gen, doc["request_id"]))
            self.bytes += size
            while self._by_id and (len(self._by_id) > self.max_requests or self.bytes > self.max_bytes):
                self._drop_locked(next(iter(self._by_id)))
                evicted += 1
            self.evicted += evicted
            self._expire_locked()
        if evicted and self._on_evict is not None:
            self._on_evict(evicted)

    def get(self, request_id: str) -> dict | None:
        with self._lock:
            self._expire_locked()
            entry = self._by_id.get(request_id)
            return entry[0] if entry else None

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

    def _drop_locked(self, request_id: str) -> None:
        entry = self._by_id.pop(request_id, None)
        if entry is not None:
            self.bytes -= entry[1]
            self._gens.pop(request_id, None)

    def _expire_locked(self) -> None:
        cutoff = self._clock() - self.retention_s
        heap = self._by_end
        while heap and heap[0][0] < cutoff:
            _, gen, request_id = heapq.heappop(heap)
            if self._gens.get(request_id) == gen:
                self._drop_locked(request_id)
        # Entries of replaced or evicted documents are skipped above; rebuild
        # when they outnumber the live ones, so the heap stays bounded too.
        if len(heap) > 2 * len(self._by_id) + 1024:
            self._by_end = [e for e in heap if self._gens.get(e[2]) == e[1]]
            heapq.heapify(self._by_end)
