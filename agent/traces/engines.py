"""The engines' own latency histograms, scraped beside the scheduler's figures.

Each inference server the agent finds by its command line (a `vllm serve`)
serves Prometheus metrics on its HTTP port; a worker scrapes them every few
seconds and keeps the scrapes for the retention, so any window's figures are
the difference of two scrapes (agent/traces/engine_metrics.py). The API puts
them next to the scheduling delay of the requests that ended in the same
window.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from agent.traces.engine_metrics import QUANTILES, EngineHistogram, parse_histograms, window_figures
from agent.workers import Worker

__all__ = ["ENGINES_PATH", "EngineScraper", "EngineSummary", "engine_routes", "engine_window", "requests_figures"]

log = logging.getLogger(__name__)

MAX_BODY = 8 << 20


@dataclass(frozen=True)
class EngineSummary:
    """One engine histogram as a Prometheus summary: recent quantiles, totals since the engine started."""

    service: str
    phase: str
    metric: str                                   # the engine's own metric name
    quantiles: tuple[tuple[float, float], ...]    # (q, seconds) over the window
    count: float
    sum: float


def fetch(url: str, timeout: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read(MAX_BODY).decode("utf-8", "replace")


class EngineScraper:
    """Scrapes every engine on a worker ("engine-metrics") every `every_s`;
    errors counted and logged once per engine until it answers again."""

    def __init__(self, targets: Callable[[], Mapping[str, str]], *, every_s: float = 5.0,
                 retention_s: float = 900.0, fetch: Callable[[str], str] = fetch,
                 clock: Callable[[], float] = time.time) -> None:
        self._targets = targets
        self.every_s = every_s
        self._retention = retention_s
        self._fetch = fetch
        self._clock = clock
        self._lock = threading.Lock()
        # service -> (url, scrapes (wall time, role -> histogram), oldest first)
        self._scrapes: dict[str, tuple[str, deque[tuple[float, dict[str, EngineHistogram]]]]] = {}
        self._failing: set[str] = set()
        self.errors = 0
        self.worker = Worker.periodic("engine-metrics", "scraping the engines' metrics", self.scrape_once,
                                      every_s, on_error=self._count_error)

    def scrape_once(self) -> None:
        now = self._clock()
        for service, url in dict(self._targets()).items():
            try:
                hists = parse_histograms(self._fetch(url))
            except Exception as e:  # noqa: BLE001 - any engine may be down or answer garbage: count, say
                self.errors += 1
                if url not in self._failing:
                    self._failing.add(url)
                    log.warning("cannot read the engine metrics of %s at %s (%s); retrying every %.0f s",
                                service, url, e, self.every_s)
                continue
            self._failing.discard(url)
            with self._lock:
                known = self._scrapes.get(service)
                if known is None or known[0] != url:
                    known = self._scrapes[service] = (url, deque())
                known[1].append((now, hists))
                while known[1] and known[1][0][0] < now - self._retention:
                    known[1].popleft()

    def figures(self, since_s: float, service: str | None = None) -> list[dict]:
        """Per service, the engine's figures over the last `since_s` seconds:
        from the last scrape at or before the window's start (or the first)
        to the newest. An engine whose metrics hold none of the known
        histograms says so (`latency` empty)."""
        now = self._clock()
        out = []
        with self._lock:
            items = [(s, url, list(scrapes)) for s, (url, scrapes) in self._scrapes.items()
                     if service is None or s == service]
        for name, url, scrapes in sorted(items):
            if not scrapes:
                continue
            start = now - since_s
            before = [s for s in scrapes if s[0] <= start]
            first = before[-1] if before else scrapes[0]
            last = scrapes[-1]
            out.append({"service": name, "url": url, "start": first[0], "end": last[0],
                        "latency": window_figures(last[1], first[1] if first is not last else None)})
        return out

    def latency_summaries(self, window_s: float) -> list[EngineSummary]:
        """Per service and phase the engine exposes, for /metrics: the
        quantiles over the last `window_s` seconds (none without requests in
        the window) and the count and sum of seconds since the engine started
        (its histogram's own, from the newest scrape)."""
        with self._lock:
            newest = {s: scrapes[-1][1] for s, (_, scrapes) in self._scrapes.items() if scrapes}
        out = []
        for fig in self.figures(window_s):
            hists = newest.get(fig["service"], {})
            for phase, f in sorted(fig["latency"].items()):
                total = hists.get(phase)
                if total is None:
                    continue
                values = ((q, f.get(f"p{round(q * 100)}")) for q in QUANTILES) if f["count"] else ()
                quantiles = tuple((q, v) for q, v in values if v is not None)
                out.append(EngineSummary(fig["service"], phase, f["metric"], quantiles, total.count, total.sum))
        return out

    def _count_error(self, error: BaseException) -> None:
        self.errors += 1

    def start(self) -> None:
        self.worker.start()

    def shutdown(self, timeout: float = 2.0) -> None:
        self.worker.stop(timeout)


def requests_figures(docs: list[dict], start: float, end: float) -> dict:
    """The service's requests that ended in [start, end]: how many, their
    latency and their scheduling delay (median, P95, largest), to read beside
    the engine's histograms of the same window."""
    inside = [d for d in docs if start <= d.get("end", 0.0) <= end and d.get("sched")]

    def summary(values: list[float]) -> dict:
        if not values:
            return {"p50": None, "p95": None, "max": None}
        values = sorted(values)
        return {"p50": statistics.median(values), "p95": values[min(len(values) - 1, int(0.95 * len(values)))],
                "max": values[-1]}

    return {"count": len(inside),
            "e2e": summary([d["e2e"] for d in inside if d.get("e2e") is not None]),
            "delay": summary([d["sched"]["delay_seconds"] for d in inside])}


ENGINES_PATH = "/api/v1/engines"


def engine_routes(scraper: EngineScraper, store) -> dict:
    """`/api/v1/engines?since=SECONDS&service=NAME`: per service, the engine's
    own latency figures over the window next to the latency and scheduling
    delay of the requests that ended in it."""
    # The API's helpers, wherever the transport layer keeps them now.
    from agent.traces.api import QueryError, error, float_param, json_response, str_param  # noqa: PLC0415

    def engines(query: dict[str, list[str]]):
        try:
            since = float_param(query, "since", 60.0)
        except QueryError as e:
            return error(400, str(e))
        return json_response(200, {"engines": engine_window(scraper, store, since, str_param(query, "service"))})

    return {ENGINES_PATH: engines}


def engine_window(scraper: EngineScraper, store, since_s: float, service: str | None = None) -> list[dict]:
    """Per service with an engine: its own figures over the last `since_s`
    seconds, and the requests that ended between the same two scrapes."""
    out = []
    for fig in scraper.figures(since_s, service):
        docs = store.query(service=fig["service"], since_s=since_s + scraper.every_s)
        out.append({**fig, "requests": requests_figures(docs, fig["start"], fig["end"])})
    return out
