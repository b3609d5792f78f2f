"""The HTTP server under a crowd, slow clients, resets and wrong methods.

The server runs in this process (its own thread, as in the daemon); the
attackers run in a separate process (tests/reliability/attacks.py) so they do
not share its interpreter lock.
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import threading
import time

import pytest

from agent.api.routes import Response
from agent.transport.server import BackgroundHTTPServer, HttpApp, Request, ServerLimits
from tests.support.agent import REPO


class Probe(HttpApp):
    """/readyz answers; every request's addresses are recorded."""

    def __init__(self) -> None:
        self.seen: list[tuple[tuple[str, int], tuple[str, int]]] = []

    def handle(self, req: Request) -> Response:
        self.seen.append((req.peer, req.local))
        return Response(200, b"ready\n", "text/plain")


@pytest.fixture
def server(request):
    limits = getattr(request, "param", ServerLimits(head_timeout_s=2.0, idle_timeout_s=2.0))
    app = Probe()
    srv = BackgroundHTTPServer("127.0.0.1", 0, app, "test-http", limits)
    srv.start()
    yield srv
    srv.stop()


def attack(*args: str, timeout: float = 120.0) -> dict:
    out = subprocess.run([sys.executable, "-m", "tests.reliability.attacks", *args], cwd=REPO,
                         capture_output=True, text=True, timeout=timeout, check=True)
    return json.loads(out.stdout)


def test_a_thousand_clients_at_once_are_served(server):
    figures = attack("crowd", "--port", str(server.port), "--clients", "1000", "--timeout", "30")
    assert figures["served"] >= 990, figures
    # Every one of them reached the handler, over its own connection.
    assert len(server.app.seen) == figures["served"]
    assert len({peer for peer, _ in server.app.seen}) == figures["served"]


def test_slow_clients_cost_no_thread_and_do_not_delay_probes(server):
    threads_before = threading.active_count()
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(attack(
        "slowloris", "--port", str(server.port), "--clients", "1000", "--hold", "1.5", "--probes", "15",
        "--close-within", str(server.limits.head_timeout_s + 2.0))))
    t.start()
    peak = threads_before
    while t.is_alive():
        peak = max(peak, threading.active_count())
        time.sleep(0.05)
    t.join()
    assert result["opened"] == 1000, result
    assert result["probe_failed"] == 0, result
    assert result["probe_p50_s"] <= 0.1, result
    # Stalled heads are closed by the server within the head timeout (+ slack).
    assert result["closed_by_server"] == 1000, result
    assert server.stats.timeouts >= 1000
    # Workers only: at most limits.workers threads beyond the test's own.
    assert peak - threads_before <= server.limits.workers + 1


@pytest.mark.parametrize("server", [ServerLimits(max_connections=50, head_timeout_s=30.0)], indirect=True)
def test_past_the_connection_limit_the_longest_waiting_client_makes_room(server):
    result = attack("slowloris", "--port", str(server.port), "--clients", "200", "--hold", "0.5", "--probes", "5",
                    "--close-within", "3")
    assert result["probe_failed"] == 0, result
    # 200 stalled + 5 probes against 50 places: at least 150 stalled ones were evicted, no probe was.
    assert server.stats.evicted >= 150
    assert result["closed_by_server"] >= 150
    assert server.stats.open <= 51


def test_a_client_reset_is_at_most_one_quiet_line(server, caplog):
    caplog.set_level(logging.DEBUG, logger="agent.transport.server")
    attack("resets", "--port", str(server.port), "--clients", "50")
    deadline = time.monotonic() + 5
    while server.stats.resets + server.stats.timeouts < 50 and time.monotonic() < deadline:
        time.sleep(0.05)
    records = [r for r in caplog.records if r.name == "agent.transport.server"]
    assert len(records) <= 50
    assert all(r.levelno <= logging.DEBUG and r.exc_info is None for r in records)
    assert server.stats.resets == 50
    # ... and counted where an operator sees it.
    from prometheus_client import CollectorRegistry, generate_latest
    from agent.export.servers import ServerCollector

    registry = CollectorRegistry()
    registry.register(ServerCollector(server))
    text = generate_latest(registry).decode()
    assert 'slatrace_http_connections_total{outcome="resets",server="test-http"} 50.0' in text


def test_peer_and_local_addresses_reach_the_handler():
    for host in ("127.0.0.1", "::1"):
        app = Probe()
        srv = BackgroundHTTPServer(host, 0, app, "test-http")
        srv.start()
        try:
            with socket.create_connection((host, srv.port)) as s:
                s.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                assert s.recv(100).startswith(b"HTTP/1.1 200")
                mine = s.getsockname()[:2]
        finally:
            srv.stop()
        assert app.seen == [((host, mine[1]), (host, srv.port))]


def raw(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_api_answers_other_methods_with_json_405(tmp_path):
    from agent.api.routes import AgentState, Api
    from agent.api.server import HttpServer
    from agent.config import Config
    from agent.store.store import Store
    from prometheus_client.registry import CollectorRegistry

    api = Api(AgentState(Config(), Store(60), CollectorRegistry(), lambda: []))
    srv = HttpServer("127.0.0.1", 0, api)
    srv.start()
    try:
        for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
            out = raw(srv.port, f"{method} /api/v1/services HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
                                "Connection: close\r\n\r\nabc".encode())
            head, _, body = out.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 405"), out
            assert b"Allow: GET, HEAD" in head
            assert "read-only" in json.loads(body)["error"]
        out = raw(srv.port, b"BREW / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 405")
        # HTTP/1.1 without Host is malformed (RFC 9112, 3.2): 400, as h11 judges it.
        out = raw(srv.port, b"GET /livez HTTP/1.1\r\nConnection: close\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 400")
        out = raw(srv.port, b"garbage\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 400") and json.loads(out.partition(b"\r\n\r\n")[2])
        # Keep-alive: two requests on one connection, the second closes it.
        out = raw(srv.port, b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\nGET /livez HTTP/1.1\r\nHost: x\r\n"
                            b"Connection: close\r\n\r\n")
        assert out.count(b"HTTP/1.1 200") == 2
    finally:
        srv.stop()


@pytest.mark.parametrize("server", [ServerLimits(max_connections_per_client=40, head_timeout_s=30.0)],
                         indirect=True)
def test_one_client_cannot_hold_more_than_its_share(server):
    hold = []
    try:
        for _ in range(100):
            s = socket.create_connection(("127.0.0.1", server.port))
            s.sendall(b"GET /readyz HTTP/1.1\r\n")
            hold.append(s)
        # Another client address on the loopback still gets in, and is not evicted.
        with socket.create_connection(("127.0.0.1", server.port), source_address=("127.0.0.2", 0)) as other:
            other.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert other.recv(100).startswith(b"HTTP/1.1 200")
        deadline = time.monotonic() + 5
        while (server.stats.evicted < 60 or server.stats.open > 40) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.stats.evicted == 60
        assert server.stats.open == 40
    finally:
        for s in hold:
            s.close()


class Busy(HttpApp):
    """Every worker is stuck until released; /readyz is answered inline."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def inline(self, req: Request) -> bool:
        return req.path == "/readyz"

    def handle(self, req: Request) -> Response:
        if req.path != "/readyz":
            self.release.wait(10)
        return Response(200, b"ok\n", "text/plain")


def test_health_probes_do_not_queue_behind_busy_workers():
    app = Busy()
    srv = BackgroundHTTPServer("127.0.0.1", 0, app, "test-http", ServerLimits(workers=2))
    srv.start()
    stuck = []
    try:
        for _ in range(4):  # two hold the workers, two wait for one
            s = socket.create_connection(("127.0.0.1", srv.port))
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            stuck.append(s)
        time.sleep(0.2)
        t0 = time.monotonic()
        out = raw(srv.port, b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        took = time.monotonic() - t0
        assert out.startswith(b"HTTP/1.1 200") and took < 1.0, took
    finally:
        app.release.set()
        for s in stuck:
            s.close()
        srv.stop()


def test_a_low_open_files_limit_lowers_the_connection_limit():
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    try:
        srv = BackgroundHTTPServer("127.0.0.1", 0, Probe(), "test-http")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        assert srv.max_connections == (1024 - 512) // 2
    finally:
        srv.stop()
