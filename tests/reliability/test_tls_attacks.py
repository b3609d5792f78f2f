"""The HTTP server over TLS under clients that never finish their handshake
(they cost no thread, are closed by the handshake deadline, and the probes
still get through), and under a flood of wrong passwords (bcrypt takes at
most a quarter of the workers: a scrape with known credentials still gets
through)."""

from __future__ import annotations

import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import bcrypt
import pytest
import yaml

from agent.transport.access import WebAccess
from agent.transport.response import Response
from agent.transport.server import BackgroundHTTPServer, HttpApp, Request, ServerLimits
from tests.support.certs import USER, basic, make_pki


class Ready(HttpApp):
    def inline(self, req: Request) -> bool:
        return True

    def handle(self, req: Request) -> Response:
        return Response(200, b"ready\n", "text/plain")


class OnWorkers(HttpApp):
    def handle(self, req: Request) -> Response:
        return Response(200, b"# metrics\n", "text/plain")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_stalled_handshakes_cost_no_thread_and_do_not_delay_probes(pki):
    access = WebAccess(str(pki.web_config(users=False)))
    srv = BackgroundHTTPServer("127.0.0.1", 0, Ready(), "tls-test", ServerLimits(head_timeout_s=2.0), access)
    srv.start()
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    threads_before = threading.active_count()
    stalled = []
    try:
        for i in range(500):
            s = socket.create_connection(("127.0.0.1", srv.port))
            if i % 2:
                s.sendall(b"\x16\x03\x01\x02\x00\x01")   # the start of a ClientHello, never the rest
            stalled.append(s)
        took = []
        for _ in range(20):
            t0 = time.monotonic()
            with socket.create_connection(("localhost", srv.port), timeout=5) as raw, \
                    ctx.wrap_socket(raw, server_hostname="localhost") as tls:
                tls.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                assert tls.recv(100).startswith(b"HTTP/1.1 200")
            took.append(time.monotonic() - t0)
        took.sort()
        assert took[len(took) // 2] <= 0.1, took
        assert threading.active_count() - threads_before <= srv.limits.workers + 1
        # Every stalled handshake is closed by the deadline (+ slack), counted as a TLS
        # failure, or earlier to keep TLS connections under their cap, counted as evicted.
        deadline = time.monotonic() + srv.limits.head_timeout_s + 5
        while srv.stats.open and time.monotonic() < deadline:
            time.sleep(0.1)
        assert srv.stats.open == 0
        assert srv.stats.tls_failures + srv.stats.evicted >= 500 and srv.stats.timeouts + srv.stats.evicted >= 500
        assert srv.stats.evicted >= 500 - srv.limits.max_tls_connections
        closed = 0
        for s in stalled:
            s.settimeout(1)
            try:
                closed += s.recv(1) == b""
            except OSError:
                closed += 1
        assert closed == 500
    finally:
        for s in stalled:
            s.close()
        srv.stop()


def test_tls_connections_are_capped_by_evicting_the_longest_stalled(pki):
    """asyncio holds a 256 KiB read buffer for every TLS connection, handshake
    or not: 300 stalled handshakes against a cap of 32 leave at most 32 open
    (the longest stalled closed first, counted as evicted), and a real client
    still gets its answer over TLS."""
    access = WebAccess(str(pki.web_config(users=False)))
    limits = ServerLimits(head_timeout_s=30.0, max_tls_connections=32)
    srv = BackgroundHTTPServer("127.0.0.1", 0, Ready(), "tls-cap", limits, access)
    srv.start()
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    stalled = []
    try:
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", srv.port))
            s.sendall(b"\x16\x03\x01\x02\x00\x01")   # the start of a ClientHello, never the rest
            stalled.append(s)
        deadline = time.monotonic() + 10
        while srv.stats.accepted < 300 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.stats.accepted == 300
        assert srv.stats.open <= 32 and srv.stats.evicted >= 300 - 32, srv.stats
        with socket.create_connection(("localhost", srv.port), timeout=5) as raw, \
                ctx.wrap_socket(raw, server_hostname="localhost") as tls:
            tls.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert tls.recv(100).startswith(b"HTTP/1.1 200")
        # The first ones were closed (reset: their hello sits unread): the oldest stalled go first.
        stalled[0].settimeout(2)
        try:
            assert stalled[0].recv(1) == b""
        except ConnectionResetError:
            pass
    finally:
        for s in stalled:
            s.close()
        srv.stop()


def test_a_flood_of_wrong_passwords_leaves_workers_for_a_scrape(pki, tmp_path):
    web = tmp_path / "web.yml"
    web.write_text(yaml.safe_dump({"basic_auth_users": {
        USER: bcrypt.hashpw(b"right", bcrypt.gensalt(rounds=12)).decode()}}))   # ~0.2 s a check, as deployed
    srv = BackgroundHTTPServer("127.0.0.1", 0, OnWorkers(), "auth-test", ServerLimits(), WebAccess(str(web)))
    srv.start()

    def get(password: str) -> tuple[int, float]:
        t0 = time.monotonic()
        with socket.create_connection(("127.0.0.1", srv.port), timeout=60) as s:
            s.sendall(f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: {basic(password=password)}\r\n"
                      "Connection: close\r\n\r\n".encode())
            status = int(s.recv(100).split()[1])
        return status, time.monotonic() - t0

    try:
        assert get("right")[0] == 200          # checked once, then remembered
        with ThreadPoolExecutor(40) as pool:
            flood = [pool.submit(get, f"guess-{i}") for i in range(40)]
            time.sleep(0.3)
            status, took = get("right")
            assert status == 200 and took < 1.0, took
            assert all(f.result()[0] == 401 for f in flood)
        assert srv.stats.unauthorized == 40
    finally:
        srv.stop()
