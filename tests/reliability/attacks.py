"""Hostile and clumsy clients, as a separate process so they do not share the
agent's GIL: `python -m tests.reliability.attacks KIND --port N ...` prints one
JSON document of figures. Every attack talks to 127.0.0.1 or ::1 only and is
bounded in connections and in time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import ssl
import statistics
import struct
import sys
import time

HOSTS = ("127.0.0.1", "::1")
# The start of a TLS ClientHello, never the rest: a handshake that stalls.
HELLO_START = b"\x16\x03\x01\x02\x00\x01"


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _client_tls(cafile: str | None) -> ssl.SSLContext | None:
    return ssl.create_default_context(cafile=cafile) if cafile else None


async def _get(host: str, port: int, path: str, timeout: float,
               tls: ssl.SSLContext | None = None) -> tuple[int, float]:
    """One GET on a fresh connection (over TLS with `tls`): (status, seconds); status 0 on failure."""
    t0 = time.monotonic()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(
            host, port, ssl=tls, server_hostname="localhost" if tls else None), timeout)
        writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        line = await asyncio.wait_for(reader.readline(), timeout)
        await asyncio.wait_for(reader.read(), timeout)
        writer.close()
        status = int(line.split()[1]) if line.startswith(b"HTTP/1.") else 0
    except (OSError, asyncio.TimeoutError, ValueError, IndexError, ssl.SSLError):
        status = 0
    return status, time.monotonic() - t0


async def crowd(port: int, clients: int, path: str, timeout: float, host: str) -> dict:
    """`clients` connections at once, each one GET."""
    t0 = time.monotonic()
    results = await asyncio.gather(*(_get(host, port, path, timeout) for _ in range(clients)))
    lat = [s for status, s in results if status == 200]
    return {"attack": "crowd", "clients": clients, "served": len(lat),
            "failed": clients - len(lat), "p50_s": _quantile(lat, 0.5), "p99_s": _quantile(lat, 0.99),
            "max_s": max(lat) if lat else None, "wall_s": time.monotonic() - t0}


async def slowloris(port: int, conns: int, hold_s: float, probes: int, path: str, host: str,
                    close_within_s: float, trickle_s: float = 0.0, tls: ssl.SSLContext | None = None) -> dict:
    """`conns` connections that send half a request head and stall (with
    `trickle_s`, one more header byte each that often); meanwhile `probes`
    GETs of `path`; then how many stalled connections the server closed, and
    how long after their opening. With `tls` the stalled connections send the
    start of a ClientHello instead and the probes come over TLS."""
    stalled = []
    opened = 0
    for _ in range(conns):
        try:
            r, w = await asyncio.wait_for(asyncio.open_connection(host, port), 5.0)
            w.write(HELLO_START if tls else b"GET /readyz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            stalled.append((r, w, time.monotonic()))
            opened += 1
        except (OSError, asyncio.TimeoutError):
            break

    async def trickle() -> None:
        """Each connection a byte every `trickle_s`, spread over that time as
        independent clients would: not all at once, which would time the
        attacker's own burst of writes along with the server."""
        tick = 0.02
        per_tick = max(1, round(len(stalled) * tick / trickle_s))
        i = 0
        while True:
            await asyncio.sleep(tick)
            for _ in range(per_tick):
                w = stalled[i % len(stalled)][1]
                i += 1
                if not w.transport.is_closing():
                    w.write(b"x")

    trickler = asyncio.create_task(trickle()) if trickle_s > 0 and stalled and not tls else None
    probe_lat = []
    probe_fail = 0
    t_end = time.monotonic() + hold_s
    for _ in range(probes):
        status, s = await _get(host, port, path, 5.0, tls)
        if status == 200:
            probe_lat.append(s)
        else:
            probe_fail += 1
        await asyncio.sleep(max(0.0, min(hold_s / max(probes, 1), t_end - time.monotonic())))

    async def closed(r: asyncio.StreamReader) -> float | None:
        """When the server closed or reset the connection (monotonic), None if it did not."""
        try:
            while True:
                if not await asyncio.wait_for(r.read(1 << 16), max(0.01, deadline - time.monotonic())):
                    return time.monotonic()
        except asyncio.TimeoutError:  # first: it is an OSError since Python 3.11
            return None
        except OSError:
            return time.monotonic()

    deadline = time.monotonic() + close_within_s
    closed_at = await asyncio.gather(*(closed(r) for r, _, _ in stalled))
    if trickler:
        trickler.cancel()
    for _, w, _ in stalled:
        w.transport.abort()
    after = [t - t0 for t, (_, _, t0) in zip(closed_at, stalled) if t is not None]
    return {"attack": "slowloris", "opened": opened, "probes": probes, "probe_failed": probe_fail,
            "probe_p50_s": _quantile(probe_lat, 0.5), "probe_p99_s": _quantile(probe_lat, 0.99),
            "probe_max_s": max(probe_lat) if probe_lat else None,
            "closed_by_server": len(after), "close_wait_s": close_within_s,
            "closed_after_p50_s": _quantile(after, 0.5), "closed_after_max_s": max(after) if after else None}


def sequential(port: int, count: int, path: str, body_bytes: int, host: str, cafile: str | None) -> dict:
    """`count` requests one after another, each on a new connection (a GET,
    or with `body_bytes` a POST of that many bytes); with `cafile` over TLS,
    the handshake timed on its own."""
    tls = _client_tls(cafile)
    body = b"x" * body_bytes
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {body_bytes}\r\nConnection: close\r\n\r\n"
            if body_bytes else f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").encode()
    total, handshakes, failed = [], [], 0
    for _ in range(count):
        t0 = time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=5) as raw:
                raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as curl and Go's clients do
                conn = raw
                if tls:
                    conn = tls.wrap_socket(raw, server_hostname="localhost")
                    handshakes.append(time.monotonic() - t0)
                conn.sendall(head + body)
                answer = b""
                while chunk := conn.recv(1 << 16):
                    answer += chunk
                if not answer.startswith(b"HTTP/1.1 200"):
                    failed += 1
                    continue
        except (OSError, ssl.SSLError):
            failed += 1
            continue
        total.append(time.monotonic() - t0)
    return {"attack": "sequential", "count": count, "path": path, "body_bytes": body_bytes, "tls": bool(tls),
            "failed": failed, "p50_s": statistics.median(total) if total else None,
            "p99_s": _quantile(total, 0.99),
            "handshake_p50_s": statistics.median(handshakes) if handshakes else None}


async def hog(port: int, conns: int, host: str, settle_s: float, path: str, other: str) -> dict:
    """One address opens `conns` connections and sends nothing; after
    `settle_s`, how many the server closed, and whether a probe of `path`
    from that address and from `other` (another loopback address) is answered."""
    held = []
    for _ in range(conns):
        try:
            held.append(await asyncio.wait_for(asyncio.open_connection(host, port), 5.0))
        except (OSError, asyncio.TimeoutError):
            break
    await asyncio.sleep(settle_s)

    async def closed(r: asyncio.StreamReader) -> bool:
        try:
            return not await asyncio.wait_for(r.read(1), 0.2)
        except asyncio.TimeoutError:
            return False
        except OSError:
            return True

    # All at once: one by one, the last would be looked at past the server's head deadline.
    closed_flags = await asyncio.gather(*(closed(r) for r, _ in held))
    same = await _get(host, port, path, 5.0)
    t0 = time.monotonic()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, local_addr=(other, 0)), 5.0)
        writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        line = await asyncio.wait_for(reader.readline(), 5.0)
        writer.close()
        other_status = int(line.split()[1]) if line.startswith(b"HTTP/1.") else 0
    except (OSError, asyncio.TimeoutError, ValueError, IndexError):
        other_status = 0
    other_s = time.monotonic() - t0
    for _, w in held:
        w.transport.abort()
    return {"attack": "hog", "opened": len(held), "closed_by_server": sum(closed_flags), "settle_s": settle_s,
            "same_address_probe": same[0], "same_address_probe_s": same[1],
            "other_address_probe": other_status, "other_address_probe_s": other_s}


def resets(port: int, count: int, host: str) -> dict:
    """Clients that send a request and reset the connection (RST) at once."""
    for _ in range(count):
        s = socket.create_connection((host, port), timeout=5)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\npartial")
        s.close()
    return {"attack": "resets", "count": count}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="attacks")
    p.add_argument("kind", choices=["crowd", "slowloris", "resets", "sequential", "hog"])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1", choices=HOSTS)
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--path", default="/readyz")
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--hold", type=float, default=3.0)
    p.add_argument("--probes", type=int, default=20)
    p.add_argument("--close-within", type=float, default=5.0)
    p.add_argument("--trickle", type=float, default=0.0, help="slowloris: a byte every so many seconds")
    p.add_argument("--tls-ca", help="slowloris, sequential: speak TLS, trusting this CA file")
    p.add_argument("--body-bytes", type=int, default=0, help="sequential: POST this many bytes")
    p.add_argument("--settle", type=float, default=2.0, help="hog: seconds before counting closed connections")
    p.add_argument("--other", default="127.0.0.2", help="hog: the second client's loopback address")
    a = p.parse_args(argv)
    if not 0 < a.clients <= 5000:
        p.error("--clients must be 1..5000")
    if a.kind == "crowd":
        doc = asyncio.run(crowd(a.port, a.clients, a.path, a.timeout, a.host))
    elif a.kind == "slowloris":
        doc = asyncio.run(slowloris(a.port, a.clients, a.hold, a.probes, a.path, a.host, a.close_within,
                                    a.trickle, _client_tls(a.tls_ca)))
    elif a.kind == "sequential":
        doc = sequential(a.port, a.clients, a.path, a.body_bytes, a.host, a.tls_ca)
    elif a.kind == "hog":
        if not a.other.startswith("127."):
            p.error("--other must be a loopback address (127.x.y.z)")
        doc = asyncio.run(hog(a.port, a.clients, a.host, a.settle, a.path, a.other))
    else:
        doc = resets(a.port, a.clients, a.host)
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())

