"""`python -m bench.http_servers`: the agent's HTTP server (agent/transport,
h11 under one asyncio loop and a pool of worker threads) against aiohttp's
web server, serving the same small app, under the attacks of RELIABILITY.md.

    .venv/bin/python -m bench.http_servers [--rounds 3] [--only crowd,slowloris,...]

aiohttp is not one of the agent's dependencies: the `bench` extra of
pyproject.toml pins the version measured (`pip install aiohttp==<pin>`).

Each server runs in a process of its own (`python -m bench.http_servers serve
ARM`), started afresh for every measurement; the attackers are
tests/reliability/attacks.py in a third process. The two arms take turns
(transport, aiohttp, transport, aiohttp, ...) within every round, so a
machine that gets busier or quieter weighs on both alike. Each figure is the
median over the rounds, with its range. Everything is on 127.0.0.1 (the
per-client attack also uses 127.0.0.2).

The app: `GET /readyz` (a small JSON body, answered on the event loop),
`GET /metrics` (~50 KB of text, on a worker thread) and `POST /ingest` (a body
of up to 4 MiB, answered on a worker thread). The transport is built as the
agent builds it (`raise_fd_limit()`, default `ServerLimits`, a `WebAccess`
for TLS); aiohttp with the nearest of its own settings (`ARMS` below).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from bench.tools import die_with_parent
from tests.reliability.measure import Sampler, attack, proc_figures, terminate
from tests.support.agent import REPO
from tests.support.certs import make_pki

ARMS = ("transport", "aiohttp")
MAX_BODY = 4 << 20          # the OTLP/HTTP receiver's body limit
READY = b'{"status": "ready"}'
METRICS = b"".join(f'slatrace_bench_seconds_bucket{{service="svc-{i}",le="{i}"}} {i * 7}\n'.encode()
                   for i in range(900))[:50_000]


# --- the servers (each in its own process) --------------------------------

def serve_transport(web_config: str | None, stopping: Callable[[], bool]) -> None:
    from agent.transport.access import WebAccess
    from agent.transport.response import Response, error
    from agent.transport.server import BackgroundHTTPServer, HttpApp, Request, raise_fd_limit

    class BenchApp(HttpApp):
        max_body_bytes = MAX_BODY

        def inline(self, req: Request) -> bool:
            return req.path == "/readyz"

        def handle(self, req: Request) -> Response:
            if req.method == "GET" and req.path == "/readyz":
                return Response(200, READY, "application/json")
            if req.method == "GET" and req.path == "/metrics":
                return Response(200, METRICS, "text/plain; version=0.0.4")
            if req.method == "POST" and req.path == "/ingest":
                return Response(200, json.dumps({"received": len(req.body)}).encode(), "application/json")
            return error(404, "no such path")

    raise_fd_limit()
    access = WebAccess(web_config) if web_config else None
    srv = BackgroundHTTPServer("127.0.0.1", 0, BenchApp(), "bench", access=access)
    srv.start()
    print(srv.port, flush=True)
    while not stopping():
        time.sleep(0.1)
    srv.stop()


def serve_aiohttp(web_config: str | None, stopping: Callable[[], bool]) -> None:
    """aiohttp with the nearest of its settings to ServerLimits: the same
    backlog, idle keep-alive, body limit and header count, and the handlers
    beyond /readyz on a pool of as many threads. It has no head or body
    deadline of its own (keepalive_timeout, armed at accept, also closes a
    connection whose first head has not come), no TLS handshake deadline but
    asyncio's 60 s (TCPSite passes none), no cap on connections, in all or per
    client, and no budget of bodies held at once."""
    from aiohttp import web

    from agent.transport.access import WebAccess
    from agent.transport.server import BACKLOG, ServerLimits, raise_fd_limit

    limits = ServerLimits()
    pool = ThreadPoolExecutor(max_workers=limits.workers, thread_name_prefix="bench-worker")

    async def readyz(request: web.Request) -> web.Response:
        return web.Response(body=READY, content_type="application/json")

    async def metrics(request: web.Request) -> web.Response:
        body = await asyncio.get_running_loop().run_in_executor(pool, lambda: METRICS)
        return web.Response(body=body, content_type="text/plain")

    async def ingest(request: web.Request) -> web.Response:
        data = await request.read()
        body = await asyncio.get_running_loop().run_in_executor(
            pool, lambda: json.dumps({"received": len(data)}).encode())
        return web.Response(body=body, content_type="application/json")

    async def run() -> None:
        app = web.Application(client_max_size=MAX_BODY)
        app.add_routes([web.get("/readyz", readyz), web.get("/metrics", metrics), web.post("/ingest", ingest)])
        runner = web.AppRunner(app, access_log=None, keepalive_timeout=limits.idle_timeout_s, max_headers=100,
                               max_line_size=limits.max_head_bytes, max_field_size=limits.max_head_bytes)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=BACKLOG,
                           ssl_context=WebAccess(web_config).tls_context if web_config else None)
        await site.start()
        print(runner.addresses[0][1], flush=True)
        while not stopping():
            await asyncio.sleep(0.1)
        await runner.cleanup()

    raise_fd_limit()
    asyncio.run(run())
    pool.shutdown(wait=False)


def serve(arm: str, web_config: str | None) -> int:
    """Serve until SIGTERM; the port is the first line on stdout."""
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    (serve_transport if arm == "transport" else serve_aiohttp)(web_config, lambda: bool(stop))
    return 0


class Server:
    """One arm's server process, started afresh for each measurement."""

    def __init__(self, arm: str, web_config: Path | None = None) -> None:
        cmd = [sys.executable, "-m", "bench.http_servers", "serve", arm]
        if web_config:
            cmd += ["--web-config", str(web_config)]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                                     preexec_fn=die_with_parent)
        line = self.proc.stdout.readline()
        if not line.strip().isdigit():
            self.stop()
            raise RuntimeError(f"bench.http_servers: the {arm} server did not start")
        self.port = str(int(line))
        time.sleep(0.3)  # past the start-up's own allocations

    def figures(self) -> dict:
        return proc_figures(self.proc.pid)

    def stop(self) -> None:
        terminate(self.proc, 15.0)


# --- the measurements ----------------------------------------------------

def _under(srv: Server, *args: str, timeout: float = 300.0) -> dict:
    """An attack, with the server's idle figures before and its peaks during."""
    idle = srv.figures()
    with Sampler(srv.proc.pid) as s:
        fig = attack(*args, "--port", srv.port, timeout=timeout)
    fig.update(idle_threads=idle["threads"], idle_rss_mib=idle["rss_mib"],
               peak_threads=s.peak.get("threads", idle["threads"]),
               rss_growth_mib=s.peak.get("rss_mib", idle["rss_mib"]) - idle["rss_mib"],
               alive=srv.proc.poll() is None)
    return fig


# 1,000 clients at once; 1,000 slowloris connections; 200 stalled TLS handshakes.
CROWD = 1000
SLOWLORIS = 1000
STALLED_TLS = 200


def crowd(srv: Server, pki: Any) -> dict:
    return _under(srv, "crowd", "--clients", str(CROWD), "--timeout", "60")


def sequential(srv: Server, pki: Any) -> dict:
    return _under(srv, "sequential", "--clients", "300", "--path", "/readyz")


def post(srv: Server, pki: Any) -> dict:
    return _under(srv, "sequential", "--clients", "300", "--path", "/ingest", "--body-bytes", "20000")


def metrics(srv: Server, pki: Any) -> dict:
    return _under(srv, "sequential", "--clients", "300", "--path", "/metrics")


def hog(srv: Server, pki: Any) -> dict:
    return _under(srv, "hog", "--clients", "1100", "--settle", "2")


def slowloris(srv: Server, pki: Any) -> dict:
    # A header byte every 2 s per connection; up to 40 s for the server to close them.
    return _under(srv, "slowloris", "--clients", str(SLOWLORIS), "--hold", "5", "--probes", "200",
                  "--trickle", "2", "--close-within", "40")


def tls(srv: Server, pki: Any) -> dict:
    seq = attack("sequential", "--port", srv.port, "--clients", "200", "--path", "/readyz", "--tls-ca", str(pki.ca))
    stall = _under(srv, "slowloris", "--clients", str(STALLED_TLS), "--hold", "5", "--probes", "200",
                   "--tls-ca", str(pki.ca), "--close-within", "15")
    return {"handshake_p50_s": seq["handshake_p50_s"], "request_p50_s": seq["p50_s"], "failed": seq["failed"],
            **{f"stall_{k}": v for k, v in stall.items()}}


MEASURES: dict[str, Callable[[Server, Any], dict]] = {
    "crowd": crowd, "sequential": sequential, "post": post, "metrics": metrics, "hog": hog,
    "slowloris": slowloris, "tls": tls}


def turns(arms: tuple[str, ...], rounds: int) -> list[tuple[int, str]]:
    """The order of the runs: every arm once per round, in turn (A B A B ...)."""
    return [(r, arm) for r in range(rounds) for arm in arms]


def spread(values: list[float | None]) -> tuple[float, float, float] | None:
    """Median and range of the values measured (None: not measured)."""
    got = [v for v in values if v is not None]
    if not got:
        return None
    return statistics.median(got), min(got), max(got)


def cell(values: list[float | None], scale: float = 1.0, digits: int = 1) -> str:
    """`median (low–high)` of the values times `scale`; one value if all agree."""
    s = spread(values)
    if s is None:
        return "—"
    med, lo, hi = (round(v * scale, digits) for v in s)
    fmt = f"{{:,.{digits}f}}"
    return fmt.format(med) if lo == hi else f"{fmt.format(med)} ({fmt.format(lo)}–{fmt.format(hi)})"


# (label, measure, key, scale, digits)
ROWS = [
    ("server process idle: RSS (MiB)", "sequential", "idle_rss_mib", 1, 1),
    ("... threads", "sequential", "idle_threads", 1, 0),
    (f"(a) {CROWD:,} × `GET /readyz` at once: served", "crowd", "served", 1, 0),
    ("... client latency p50 (ms)", "crowd", "p50_s", 1e3, 0),
    ("... client latency p99 (ms)", "crowd", "p99_s", 1e3, 0),
    ("... wall time (s)", "crowd", "wall_s", 1, 2),
    ("... server threads, peak", "crowd", "peak_threads", 1, 0),
    ("... server RSS growth, peak (MiB)", "crowd", "rss_growth_mib", 1, 1),
    ("(b) one `GET /readyz` per new connection, median (ms)", "sequential", "p50_s", 1e3, 2),
    ("... the same, `GET /metrics` (50 KB, on a worker), median (ms)", "metrics", "p50_s", 1e3, 2),
    ("... server threads, peak", "metrics", "peak_threads", 1, 0),
    ("(c) one `POST` of 20 KB per new connection, median (ms)", "post", "p50_s", 1e3, 2),
    ("... p99 (ms)", "post", "p99_s", 1e3, 2),
    (f"(d) {SLOWLORIS:,} slowloris (a head byte every 2 s) held: opened", "slowloris", "opened", 1, 0),
    ("... `/readyz` probes failed (of 200)", "slowloris", "probe_failed", 1, 0),
    ("... `/readyz` p50 (ms)", "slowloris", "probe_p50_s", 1e3, 1),
    ("... `/readyz` p99 (ms)", "slowloris", "probe_p99_s", 1e3, 1),
    ("... closed by the server within 40 s", "slowloris", "closed_by_server", 1, 0),
    ("... closed after (s from connect, median)", "slowloris", "closed_after_p50_s", 1, 1),
    ("... server threads, peak", "slowloris", "peak_threads", 1, 0),
    ("... server RSS growth, peak (MiB)", "slowloris", "rss_growth_mib", 1, 1),
    ("(e) 1,100 idle connections from 127.0.0.1: closed by the server", "hog", "closed_by_server", 1, 0),
    ("... a new `/readyz` from 127.0.0.1 answered (status)", "hog", "same_address_probe", 1, 0),
    ("... a `/readyz` from 127.0.0.2 answered (status)", "hog", "other_address_probe", 1, 0),
    ("(f) TLS 1.3 (ECDSA P-256): handshake per new connection, median (ms)", "tls", "handshake_p50_s", 1e3, 2),
    ("... handshake + `GET /readyz`, median (ms)", "tls", "request_p50_s", 1e3, 2),
    (f"(g) {STALLED_TLS} stalled TLS handshakes held: `/readyz` over TLS probes failed (of 200)", "tls",
     "stall_probe_failed", 1, 0),
    ("... `/readyz` over TLS p50 (ms)", "tls", "stall_probe_p50_s", 1e3, 1),
    ("... `/readyz` over TLS p99 (ms)", "tls", "stall_probe_p99_s", 1e3, 1),
    ("... stalled handshakes closed by the server within 15 s", "tls", "stall_closed_by_server", 1, 0),
    ("... closed after (s from connect, median)", "tls", "stall_closed_after_p50_s", 1, 1),
    ("... server threads, peak", "tls", "stall_peak_threads", 1, 0),
    ("... server RSS growth, peak (MiB)", "tls", "stall_rss_growth_mib", 1, 1),
]
PROBE_P99_LIMIT_S = 0.100  # RELIABILITY.md: `/readyz` within 100 ms under 1,000 slowloris connections


def table(results: dict[str, dict[str, list[dict]]]) -> str:
    """RELIABILITY.md's table: one row per figure, one column per arm."""
    lines = ["| | " + " | ".join(ARMS) + " |", "|---|" + "---:|" * len(ARMS)]
    for label, name, key, scale, digits in ROWS:
        if name in results:
            cells = [cell([r.get(key) for r in results[name].get(arm, [])], scale, digits) for arm in ARMS]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdict(results: dict[str, dict[str, list[dict]]]) -> str | None:
    """Whether the agent's server kept `/readyz` p99 within the limit under slowloris, in every round."""
    runs = results.get("slowloris", {}).get("transport", [])
    if not runs:
        return None
    p99 = [r.get("probe_p99_s") for r in runs]
    ok = all(v is not None and v <= PROBE_P99_LIMIT_S for v in p99) and not any(r["probe_failed"] for r in runs)
    worst = max((v for v in p99 if v is not None), default=float("nan"))
    return (f"transport under {SLOWLORIS:,} slowloris: `/readyz` p99 ≤ {PROBE_P99_LIMIT_S * 1e3:.0f} ms in every "
            f"round: {'yes' if ok else 'NO'} (worst round {worst * 1e3:.1f} ms)")


def missing_aiohttp() -> str | None:
    """One line on how to get aiohttp, if it is not installed."""
    if importlib.util.find_spec("aiohttp") is not None:
        return None
    with open(REPO / "pyproject.toml", "rb") as f:
        pins = tomllib.load(f)["project"]["optional-dependencies"]["bench"]
    return f"bench.http_servers needs aiohttp: .venv/bin/pip install {' '.join(pins)}  (pyproject.toml's `bench` extra)"


def loadavg() -> list[str]:
    """The 1, 5 and 15 minute load averages."""
    return Path("/proc/loadavg").read_text().split()[:3]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        p = argparse.ArgumentParser(prog="python -m bench.http_servers serve")
        p.add_argument("serve")
        p.add_argument("arm", choices=ARMS)
        p.add_argument("--web-config")
        a = p.parse_args(argv)
        return serve(a.arm, a.web_config)
    p = argparse.ArgumentParser(prog="python -m bench.http_servers", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="runs of each arm per measurement (default %(default)s)")
    p.add_argument("--only", default=",".join(MEASURES), metavar="NAME,...",
                   help=f"some of {', '.join(MEASURES)} (default: all)")
    a = p.parse_args(argv)
    if hint := missing_aiohttp():
        print(hint, file=sys.stderr)
        return 2
    names = [n.strip() for n in a.only.split(",") if n.strip()]
    if not 1 <= a.rounds <= 9 or not names or set(names) - MEASURES.keys():
        p.error(f"--rounds 1..9, --only some of {', '.join(MEASURES)}")
    results: dict[str, dict[str, list[dict]]] = {}
    loads = [loadavg()]
    with tempfile.TemporaryDirectory(prefix="slatrace-bench-http-") as tmp:
        pki = make_pki(Path(tmp))   # the openssl CLI, at run time
        web = pki.web_config(users=False)
        for name in names:
            for rnd, arm in turns(ARMS, a.rounds):
                srv = Server(arm, web if name == "tls" else None)
                try:
                    fig = MEASURES[name](srv, pki)
                finally:
                    srv.stop()
                fig.update(measure=name, arm=arm, round=rnd, load1=float(loadavg()[0]))
                results.setdefault(name, {}).setdefault(arm, []).append(fig)
                print(json.dumps(fig), flush=True)
                time.sleep(1.0)  # the closed sockets' TIME_WAIT and the last process's exit
    loads.append(loadavg())
    run_loads = [f["load1"] for by_arm in results.values() for runs in by_arm.values() for f in runs]
    print(f"\nload average (1, 5, 15 min) at the start {' '.join(loads[0])}, at the end {' '.join(loads[-1])}; "
          f"1-min load after each run {min(run_loads):.1f}–{max(run_loads):.1f} (median "
          f"{statistics.median(run_loads):.1f}); {os.cpu_count()} CPUs")
    print(table(results))
    if line := verdict(results):
        print("\n" + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
