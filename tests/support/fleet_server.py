"""N node agents' /metrics from a few processes: `python -m tests.support.fleet_server`.

Node i serves GET /node/<i>/metrics, written by the agent's own exporter from
that node's store (tests/support/fleet.py, LiveNode), so its counters grow
with the wall clock. The nodes are split over `--workers` processes (node i
in worker i mod W, each on a port of its own), so a thousand targets cost a
few Python processes; Prometheus tells the nodes apart by the `instance`
label its configuration gives each (prometheus_targets()).

A scrape costs a copy of bytes, not a render: each node's first scrape is
rendered when it comes, and tells its worker when Prometheus scrapes that
node (every `--scrape-interval`, at a phase of the node's own). From then on
a background renderer advances the node's store to the moment of its next
scrape and renders it through the exporter a little before that scrape
comes (LEAD), so the scrape gets the node's figures at the moment it was
asked and one render a scrape is done off the request's path, spread over
the interval as Prometheus spreads its scrapes. A scrape that comes when no
render was made for its moment (the renderer fell behind, or Prometheus
moved the node's phase) is rendered when it comes, as before, and counted.
GET /stats gives a worker's counts and CPU seconds.

Prints `ready PORT[,PORT...] START` once every node is built.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import math
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.support.agent import http_get
from tests.support.fleet import FleetSpec, LiveNode, node_state

PATH = re.compile(r"^/node/(\d+)/metrics$")
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
TEXT = "text/plain; version=0.0.4; charset=utf-8"
# A node's render is made this share of the scrape interval before its scrape.
LEAD = 1 / 3
# Nodes a worker process serves, at most, when running_fleet() chooses how many.
NODES_PER_WORKER = 500

REPO = Path(__file__).resolve().parents[2]


@dataclass
class FleetServer:
    addresses: list[str]   # host:port of each worker; node i on addresses[i % len(addresses)]
    start: float           # the nodes' tick 0 (Unix seconds)
    procs: list[subprocess.Popen]

    def address(self, node: int) -> str:
        return self.addresses[node % len(self.addresses)]

    def stats(self) -> dict[str, float]:
        """The workers' counts (GET /stats) added up."""
        out: dict[str, float] = {}
        for address in self.addresses:
            status, body = http_get(f"http://{address}/stats", timeout=10.0)
            if status == 200:
                for k, v in json.loads(body).items():
                    out[k] = out.get(k, 0) + v
        return out


@contextlib.contextmanager
def running_fleet(spec: FleetSpec, nice: int = 10, timeout: float = 300.0, scrape_s: float = 15.0,
                  workers: int | None = None) -> Iterator[FleetServer]:
    """The server's workers, each in a process of its own (under `nice`), stopped on exit."""
    workers = workers or max(1, math.ceil(spec.nodes / NODES_PER_WORKER))
    start = time.time()
    procs = []
    try:
        for k in range(workers):
            procs.append(subprocess.Popen(
                (["nice", "-n", str(nice)] if nice else [])
                + [sys.executable, "-m", "tests.support.fleet_server", "--nodes", str(spec.nodes),
                   "--services", str(spec.services_per_node), "--seed", str(spec.seed), "--part", f"{k}/{workers}",
                   "--start", f"{start:.3f}", "--scrape-interval", str(scrape_s)],
                cwd=REPO, stdout=subprocess.PIPE, text=True))
        ports = []
        for proc in procs:
            ready = _first_line(proc, timeout)
            if not ready.startswith("ready "):
                raise RuntimeError(f"fleet server did not start (exit {proc.poll()}): {ready!r}")
            ports.append(ready.split()[1])
        yield FleetServer([f"127.0.0.1:{p}" for p in ports], start, procs)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _first_line(proc: subprocess.Popen, timeout: float) -> str:
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return out[0].strip() if out else ""


def prometheus_targets(spec: FleetSpec, fleet: FleetServer) -> list[dict]:
    """static_configs for a Prometheus scraping every node of `fleet`."""
    return [{"targets": [fleet.address(i)],
             "labels": {"instance": spec.instance(i), "__metrics_path__": f"/node/{i}/metrics"}}
            for i in range(spec.nodes)]


@dataclass
class Exposition:
    """A node's latest render: what it says and for which moment."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    body: bytes = b""
    openmetrics: bool = True
    moment: float = -math.inf     # the wall time the render's figures stand for
    next_moment: float | None = None  # the moment of the node's next scrape, once one was seen


class Worker:
    """One process's share of the fleet: its nodes, their renders, the renderer."""

    def __init__(self, nodes: dict[int, LiveNode], scrape_s: float) -> None:
        self.nodes = nodes
        self.renders = {i: Exposition() for i in nodes}
        self.scrape_s = scrape_s
        self.counts = {"nodes": len(nodes), "scrapes": 0, "served_prerendered": 0, "rendered_on_demand": 0,
                       "renders_late": 0, "render_errors": 0}
        self._counts_lock = threading.Lock()
        self._due: list[tuple[float, int, float]] = []   # (when to render, node, for which moment)
        self._wake = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="fleet-renderer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout)

    def scrape(self, i: int, now: float, openmetrics: bool) -> bytes:
        r = self.renders[i]
        with r.lock:
            prerendered = bool(r.body) and r.openmetrics == openmetrics and abs(r.moment - now) <= self.scrape_s / 2
            if not prerendered:
                self._render(i, now, openmetrics)
            body = r.body
            r.next_moment = now + self.scrape_s
        self._count("scrapes", "served_prerendered" if prerendered else "rendered_on_demand")
        with self._wake:
            heapq.heappush(self._due, (r.next_moment - LEAD * self.scrape_s, i, r.next_moment))
            self._wake.notify()
        return body

    def _count(self, *names: str) -> None:
        with self._counts_lock:
            for name in names:
                self.counts[name] += 1

    def _render(self, i: int, moment: float, openmetrics: bool) -> None:
        """Under the node's lock: its store advanced to `moment` (never back), rendered."""
        r = self.renders[i]
        r.body = self.nodes[i].exposition(moment, openmetrics=openmetrics)
        r.openmetrics, r.moment = openmetrics, moment

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopped and (not self._due or self._due[0][0] > time.time()):
                    self._wake.wait(self._due[0][0] - time.time() if self._due else None)
                if self._stopped:
                    return
                _, i, moment = heapq.heappop(self._due)
            r = self.renders[i]
            with r.lock:
                if r.next_moment != moment or r.moment >= moment:
                    continue   # scraped again since (its phase moved): a newer entry is queued
                if time.time() >= moment:
                    self._count("renders_late")   # the scrape came first and is rendered then
                    continue
                try:
                    self._render(i, moment, r.openmetrics)
                except Exception as e:  # noqa: BLE001 (counted and logged; the scrape renders on demand)
                    self._count("render_errors")
                    print(f"fleet_server: rendering node {i} failed: {e!r}", file=sys.stderr, flush=True)

    def stats(self) -> dict[str, float]:
        with self._counts_lock:
            return dict(self.counts, cpu_s=time.process_time())


class FleetHandler(BaseHTTPRequestHandler):
    worker: Worker

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        m = PATH.match(self.path)
        if self.path == "/livez":
            self._send(200, b"ok\n", "text/plain")
            return
        if self.path == "/stats":
            self._send(200, json.dumps(self.worker.stats()).encode(), "application/json")
            return
        if m is None or int(m.group(1)) not in self.worker.nodes:
            self._send(404, b"no such node here\n", "text/plain")
            return
        om = "application/openmetrics-text" in self.headers.get("Accept", "")
        body = self.worker.scrape(int(m.group(1)), time.time(), om)
        self._send(200, body, OPENMETRICS if om else TEXT)

    def _send(self, status: int, body: bytes, ctype: str) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass   # Prometheus gave up on the scrape (its timeout) or is stopping

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.support.fleet_server", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--services", type=int, default=20, help="services per node (default %(default)s)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--part", default="0/1", metavar="K/W",
                   help="serve the nodes i with i mod W == K (default: all of them)")
    p.add_argument("--start", type=float, default=None, help="the nodes' tick 0, Unix seconds (default: now)")
    p.add_argument("--scrape-interval", type=float, default=15.0, metavar="SECONDS",
                   help="how often Prometheus scrapes each node (default %(default)s)")
    p.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT")
    args = p.parse_args(argv)
    k, w = (int(x) for x in args.part.split("/"))
    if not 0 <= k < w or args.scrape_interval <= 0:
        p.error("--part K/W with 0 <= K < W; --scrape-interval positive")
    spec = FleetSpec(nodes=args.nodes, services_per_node=args.services, seed=args.seed)
    start = time.time() if args.start is None else args.start
    worker = Worker({i: LiveNode(spec, node_state(spec, i), start) for i in range(k, spec.nodes, w)},
                    args.scrape_interval)
    FleetHandler.worker = worker
    host, port = args.listen.rsplit(":", 1)
    server = ThreadingHTTPServer((host, int(port)), FleetHandler)
    server.daemon_threads = True
    worker.start()
    print(f"ready {server.server_address[1]} {start:.3f}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        worker.shutdown()
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
