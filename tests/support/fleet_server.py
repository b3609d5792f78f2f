"""N node agents' /metrics from one process: `python -m tests.support.fleet_server`.

Node i serves GET /node/<i>/metrics, written at scrape time by the agent's own
exporter from that node's store (tests/support/fleet.py, LiveNode), so its
counters grow with the wall clock. One process and one port for the whole
fleet, so a thousand targets cost one Python process; Prometheus tells the
nodes apart by the `instance` label its configuration gives each
(prometheus_targets()). Prints `ready PORT` once every node is built.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.support.fleet import FleetSpec, LiveNode, node_state

PATH = re.compile(r"^/node/(\d+)/metrics$")
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
TEXT = "text/plain; version=0.0.4; charset=utf-8"


REPO = Path(__file__).resolve().parents[2]


@dataclass
class FleetServer:
    address: str        # host:port
    start: float        # the nodes' tick 0 (Unix seconds)
    proc: subprocess.Popen


@contextlib.contextmanager
def running_fleet(spec: FleetSpec, nice: int = 10, timeout: float = 300.0) -> Iterator[FleetServer]:
    """The server in a process of its own (under `nice`), stopped on exit."""
    proc = subprocess.Popen(
        (["nice", "-n", str(nice)] if nice else [])
        + [sys.executable, "-m", "tests.support.fleet_server", "--nodes", str(spec.nodes),
           "--services", str(spec.services_per_node), "--seed", str(spec.seed)],
        cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        ready = _first_line(proc, timeout)
        if not ready.startswith("ready "):
            raise RuntimeError(f"fleet server did not start (exit {proc.poll()}): {ready!r}")
        _, port, start = ready.split()
        yield FleetServer(f"127.0.0.1:{port}", float(start), proc)
    finally:
        proc.terminate()
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


def prometheus_targets(spec: FleetSpec, address: str) -> list[dict]:
    """static_configs for a Prometheus scraping every node of the server at `address`."""
    return [{"targets": [address], "labels": {"instance": spec.instance(i), "__metrics_path__": f"/node/{i}/metrics"}}
            for i in range(spec.nodes)]


class FleetHandler(BaseHTTPRequestHandler):
    nodes: list[LiveNode] = []
    locks: list[threading.Lock] = []
    scrapes = 0

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        m = PATH.match(self.path)
        if self.path == "/livez":
            self._send(200, b"ok\n", "text/plain")
            return
        if m is None or int(m.group(1)) >= len(self.nodes):
            self._send(404, b"no such node\n", "text/plain")
            return
        i = int(m.group(1))
        om = "application/openmetrics-text" in self.headers.get("Accept", "")
        with self.locks[i]:
            body = self.nodes[i].exposition(time.time(), openmetrics=om)
        type(self).scrapes += 1
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
    p.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT")
    args = p.parse_args(argv)
    spec = FleetSpec(nodes=args.nodes, services_per_node=args.services, seed=args.seed)
    start = time.time()
    FleetHandler.nodes = [LiveNode(spec, node_state(spec, i), start) for i in range(spec.nodes)]
    FleetHandler.locks = [threading.Lock() for _ in range(spec.nodes)]
    host, port = args.listen.rsplit(":", 1)
    server = ThreadingHTTPServer((host, int(port)), FleetHandler)
    server.daemon_threads = True
    print(f"ready {server.server_address[1]} {start:.3f}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
