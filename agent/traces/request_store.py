"""Finished requests for the API: bounded in number and in age.

Requests arrive roughly in end-time order, so an insertion-ordered dict is
both the index and the age order; the oldest go first when the store is full
or when they leave the retention window.

Entries are keyed by span (trace id, span id), not by request id: with n > 1
vLLM ends one span per child request, all carrying the parent's id, and every
one of those siblings is kept.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["RequestStore"]


class RequestStore:
    def __init__(self, retention_s: float, max_requests: int = 20_000,
                 clock: Callable[[], float] = time.time) -> None:
        self.retention_s = retention_s
        self.max_requests = max_requests
        self._clock = clock
        self._lock = threading.Lock()
        self._by_id: OrderedDict[tuple[str, str], dict] = OrderedDict()   # (trace id, span id) -> doc
        self._spans_of: dict[str, list[tuple[str, str]]] = {}             # request id -> its spans' keys
        self.evicted = 0

    def add(self, doc: dict) -> None:
        key = (doc.get("trace_id") or "", doc.get("span_id") or doc["request_id"])
        with self._lock:
            # A repeated span (a retried export) replaces the older copy.
            if key in self._by_id:
                self._drop_locked(key)
            self._by_id[key] = doc
            self._spans_of.setdefault(doc["request_id"], []).append(key)
            while len(self._by_id) > self.max_requests:
                self._drop_locked(next(iter(self._by_id)))
                self.evicted += 1
            self._expire_locked()

    def get(self, request_id: str) -> dict | None:
        """The first request with this id (see `get_all` for its siblings)."""
        found = self.get_all(request_id)
        return found[0] if found else None

    def get_all(self, request_id: str) -> list[dict]:
        """Every request with this id, oldest first: more than one when n > 1."""
        with self._lock:
            self._expire_locked()
            return [self._by_id[k] for k in self._spans_of.get(request_id, ())]

    def _drop_locked(self, key: tuple[str, str]) -> None:
        doc = self._by_id.pop(key)
        keys = self._spans_of.get(doc["request_id"], [])
        if key in keys:
            keys.remove(key)
        if not keys:
            self._spans_of.pop(doc["request_id"], None)

    def query(self, service: str | None = None, since_s: float | None = None,
              breached: bool = False) -> list[dict]:
        """Requests that ended in the last `since_s` seconds, oldest first."""
        with self._lock:
            self._expire_locked()
            docs = list(self._by_id.values())
        cutoff = self._clock() - since_s if since_s is not None else None
        return [d for d in docs
                if (service is None or d["service"] == service)
                and (cutoff is None or d["end"] >= cutoff)
                and (not breached or any(not s["ok"] for s in d["slo"]))]

    def __len__(self) -> int:
        return len(self._by_id)

    def _expire_locked(self) -> None:
        cutoff = self._clock() - self.retention_s
        while self._by_id:
            oldest = next(iter(self._by_id.values()))
            if oldest["end"] >= cutoff:
                return
            self._drop_locked(next(iter(self._by_id)))
