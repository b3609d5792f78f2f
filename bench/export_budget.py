"""/metrics size and scrape time at 100 and 1,000 services, through the real
collector over a store fed a synthetic node (tests/support/synthetic_node.py).

    .venv/bin/python -m bench.export_budget [--services 100 1000]

Each size is scraped with the default budget (buckets only for services with
an SLO or a rule: none here) and with `histograms: ["*"]` (every service
bucketed), the cost the budget avoids. No root, no kernel: it measures the
export path alone.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.export.figures import Sources
from agent.export.prometheus import SlatraceCollector
from agent.store.histogram import Histogram
from agent.store.store import Store
from tests.support.synthetic_node import SyntheticNode

# One more than the 60 s quantile window at 1 s intervals: a scrape merges a full window.
INTERVALS = 61
SERVICE = re.compile(r"[{,]service=\"([^\"]*)\"")
SCRAPES = 5


def measure(n: int, histograms: tuple[str, ...], intervals: int = INTERVALS) -> dict:
    """Feeds `intervals` 1 s intervals; the last SCRAPES each follow an ingest,
    as a scrape every interval would (the sliding 60 s window then moves by one)."""
    node = SyntheticNode(n, seed=1, neighbours=9)
    now = [0.0]
    store = Store(900, clock=lambda: now[0], max_services=1000)
    names = [node.name(node.cgid(i)) for i in range(n)]
    sources = Sources(histograms=histograms, throttled_seconds=lambda: {s: 0.5 for s in names},
                      request_sched_delay=lambda: {s: Histogram.from_ns([30_000, 900_000]) for s in names})
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SlatraceCollector(store, sources=sources))
    ingest_s, scrape_s, body = [], [], b""
    for t in range(intervals + 1):
        snap = node.snapshot(t)
        now[0] = snap.wall + 0.5
        start = time.perf_counter()
        store.ingest(snap, node.name)
        ingest_s.append(time.perf_counter() - start)
        if t == intervals - SCRAPES:
            generate_latest(registry)           # the first scrape merges the whole window
        elif t > intervals - SCRAPES:
            start = time.perf_counter()
            body = generate_latest(registry)
            scrape_s.append(time.perf_counter() - start)
    lines = [ln for ln in body.decode().splitlines() if ln and not ln.startswith("#")]
    per_service = Counter(m.group(1) for ln in lines if (m := SERVICE.search(ln)))
    return {"services": n, "histograms": ",".join(histograms) or "(budget)", "bytes": len(body),
            "series": len(lines), "max_per_service": max(per_service.values()),
            "scrape_ms": statistics.median(scrape_s) * 1e3, "ingest_ms": statistics.median(ingest_s[1:]) * 1e3}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--intervals", type=int, default=INTERVALS,
                        help="1 s intervals fed before scraping (default: a full 60 s quantile window)")
    args = parser.parse_args(argv)
    if args.intervals < 1 or any(n < 1 for n in args.services):
        parser.error("--intervals and --services must be at least 1")
    print("| services | histograms | /metrics bytes | series | max series/service | scrape ms | ingest ms |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for n in args.services:
        for histograms in ((), ("*",)):
            r = measure(n, histograms, args.intervals)
            print(f"| {r['services']} | {r['histograms']} | {r['bytes']:,} | {r['series']:,} | "
                  f"{r['max_per_service']} | {r['scrape_ms']:.0f} | {r['ingest_ms']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
