"""SLO breaches of the scheduler SLOs, interval by interval: counted since
start (the slatrace_slo_breaches_total counter) and kept per interval for the
retention window, so a window's attribution can say how many of its
intervals broke each SLO. Written by the poll loop, read by the API and the
exporters, hence the lock."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Mapping
from typing import Any

from agent.attribution.slo import SCHED_SLOS, judge_slos
from agent.config import Slo

__all__ = ["SloBreaches"]


class SloBreaches:
    """Intervals that broke a scheduler SLO: counted since start (the
    `slatrace_slo_breaches_total` counter) and kept per interval for the
    retention window, so a window's record can say how many of its intervals
    broke each SLO."""

    def __init__(self, slos: tuple[Slo, ...], retention_s: float) -> None:
        self.slos = slos
        self.retention_s = retention_s
        self._lock = threading.Lock()
        self._totals: dict[tuple[str, str], int] = {}
        self._recent: deque[tuple[float, str, str]] = deque()

    def observe(self, end: float, services: Mapping[str, Any]) -> list[tuple[str, str]]:
        """Judge one interval (service -> ServiceInterval) ending at `end`;
        returns the (service, slo) pairs it broke."""
        broken = [
            (service, r.name)
            for service in sorted({s.service for s in self.slos})
            if service in services
            for r in judge_slos(self.slos, service, services[service])
            if not r.ok
        ]
        with self._lock:
            for key in broken:
                self._totals[key] = self._totals.get(key, 0) + 1
                self._recent.append((end, *key))
            # Judged services are listed at 0 once seen, so rate() works from the
            # start; an SLO of a service never seen is not exported as if it held.
            for slo in self.slos:
                for name in SCHED_SLOS:
                    if getattr(slo, name) is not None and slo.service in services:
                        self._totals.setdefault((slo.service, name), 0)
            while self._recent and self._recent[0][0] < end - self.retention_s:
                self._recent.popleft()
        return broken

    def totals(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._totals)

    def between(self, start: float, end: float) -> dict[tuple[str, str], int]:
        """Breached intervals that ended in (start, end], per (service, slo)."""
        out: dict[tuple[str, str], int] = {}
        with self._lock:
            for t, service, slo in self._recent:
                if start < t <= end:
                    out[(service, slo)] = out.get((service, slo), 0) + 1
        return out
