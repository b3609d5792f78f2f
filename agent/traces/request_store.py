"""Finished requests for the API: bounded in number and in age.

Requests arrive roughly in end-time order, so an insertion-ordered dict is
both the index by id and the age order; the oldest go first when the store is
full or when they leave the retention window.
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
        self._by_id: OrderedDict[str, dict] = OrderedDict()
        self.evicted = 0

    def add(self, doc: dict) -> None:
        with self._lock:
            # A repeated id (a retried export) replaces the older copy.
            self._by_id.pop(doc["request_id"], None)
            self._by_id[doc["request_id"]] = doc
            while len(self._by_id) > self.max_requests:
                self._by_id.popitem(last=False)
                self.evicted += 1
            self._expire_locked()

    def get(self, request_id: str) -> dict | None:
        with self._lock:
            self._expire_locked()
            return self._by_id.get(request_id)

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
            self._by_id.popitem(last=False)
