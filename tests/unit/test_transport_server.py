"""The transport's HTTP/1.1 server on h11: what it refuses and how, byte for
byte, with raw sockets (the hostile-client tests are in tests/reliability)."""

from __future__ import annotations

import pytest

from agent.transport.response import Response
from agent.transport.server import MAX_HEADERS, BackgroundHTTPServer, HttpApp, Request, ServerLimits
from tests.reliability.test_server_attacks import raw


class Echo(HttpApp):
    def check_head(self, req: Request) -> Response | None:
        return Response(403, b"no\n", "text/plain") if req.path == "/deny" else None

    def handle(self, req: Request) -> Response:
        return Response(200, f"{req.method} {req.target} {len(req.body)}\n".encode(), "text/plain")


@pytest.fixture
def server():
    srv = BackgroundHTTPServer("127.0.0.1", 0, Echo(), "unit-http", ServerLimits(max_head_bytes=4096))
    srv.start()
    yield srv
    srv.stop()


def test_requests_keep_alive_and_bodies(server):
    out = raw(server.port, b"POST /a?x=1 HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
                           b"GET /b HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert out.count(b"HTTP/1.1 200 OK") == 2 and b"POST /a?x=1 5\n" in out and b"GET /b 0\n" in out
    # HTTP/1.0 needs no Host, and HEAD gets the head only.
    assert raw(server.port, b"GET /c HTTP/1.0\r\n\r\n").endswith(b"GET /c 0\n")
    out = raw(server.port, b"HEAD /d HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 200") and out.endswith(b"\r\n\r\n") and b"Content-Length: 10" in out


def test_a_refusal_does_not_wait_for_a_body_the_client_holds_back(server):
    out = raw(server.port, b"POST /deny HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\nExpect: 100-continue\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 403") and b"Connection: close" in out


def test_malformed_heads_are_refused_and_counted(server):
    assert raw(server.port, b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 5000 + b"\r\n\r\n") \
        .startswith(b"HTTP/1.1 431")
    many = b"".join(b"X-%d: 1\r\n" % i for i in range(MAX_HEADERS + 1))
    assert raw(server.port, b"GET / HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n").startswith(b"HTTP/1.1 431")
    assert raw(server.port, b"\x16\x03\x01 not http\r\n\r\n").startswith(b"HTTP/1.1 400")
    out = raw(server.port, b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 400")
    assert server.stats.malformed == 4
