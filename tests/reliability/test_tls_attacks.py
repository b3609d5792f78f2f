"""The HTTP server over TLS under clients that never finish their handshake:
they cost no thread, are closed by the handshake deadline, and the probes
and a scrape still get through."""

from __future__ import annotations

import socket
import ssl
import threading
import time

import pytest

from agent.transport.access import WebAccess
from agent.transport.response import Response
from agent.transport.server import BackgroundHTTPServer, HttpApp, Request, ServerLimits
from tests.support.certs import make_pki


class Ready(HttpApp):
    def inline(self, req: Request) -> bool:
        return True

    def handle(self, req: Request) -> Response:
        return Response(200, b"ready\n", "text/plain")


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
        # Every stalled handshake is closed by the deadline (+ slack), counted as a TLS failure.
        deadline = time.monotonic() + srv.limits.head_timeout_s + 5
        while srv.stats.open and time.monotonic() < deadline:
            time.sleep(0.1)
        assert srv.stats.open == 0
        assert srv.stats.tls_failures >= 500 and srv.stats.timeouts >= 500
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
