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
import struct
import sys
import time

HOSTS = ("127.0.0.1", "::1")


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def _get(host: str, port: int, path: str, timeout: float) -> tuple[int, float]:
    """One GET on a fresh connection: (status, seconds); status 0 on failure."""
    t0 = time.monotonic()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        line = await asyncio.wait_for(reader.readline(), timeout)
        await asyncio.wait_for(reader.read(), timeout)
        writer.close()
        status = int(line.split()[1]) if line.startswith(b"HTTP/1.") else 0
    except (OSError, asyncio.TimeoutError, ValueError, IndexError):
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
                    close_within_s: float) -> dict:
    """`conns` connections that send half a request head and stall; meanwhile
    `probes` GETs of `path`; then how many stalled connections the server closed."""
    stalled = []
    opened = 0
    for _ in range(conns):
        try:
            r, w = await asyncio.wait_for(asyncio.open_connection(host, port), 5.0)
            w.write(b"GET /readyz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            stalled.append((r, w))
            opened += 1
        except (OSError, asyncio.TimeoutError):
            break
    probe_lat = []
    probe_fail = 0
    t_end = time.monotonic() + hold_s
    for _ in range(probes):
        status, s = await _get(host, port, path, 5.0)
        if status == 200:
            probe_lat.append(s)
        else:
            probe_fail += 1
        await asyncio.sleep(max(0.0, min(hold_s / max(probes, 1), t_end - time.monotonic())))

    async def closed(r: asyncio.StreamReader) -> bool:
        """True once the server closed or reset the connection."""
        try:
            while True:
                if not await asyncio.wait_for(r.read(1 << 16), max(0.01, deadline - time.monotonic())):
                    return True
        except asyncio.TimeoutError:  # first: it is an OSError since Python 3.11
            return False
        except OSError:
            return True

    deadline = time.monotonic() + close_within_s
    closed_flags = await asyncio.gather(*(closed(r) for r, _ in stalled))
    for _, w in stalled:
        w.transport.abort()
    return {"attack": "slowloris", "opened": opened, "probes": probes, "probe_failed": probe_fail,
            "probe_p50_s": _quantile(probe_lat, 0.5), "probe_max_s": max(probe_lat) if probe_lat else None,
            "closed_by_server": sum(closed_flags), "close_wait_s": close_within_s}


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
    p.add_argument("kind", choices=["crowd", "slowloris", "resets"])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1", choices=HOSTS)
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--path", default="/readyz")
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--hold", type=float, default=3.0)
    p.add_argument("--probes", type=int, default=20)
    p.add_argument("--close-within", type=float, default=5.0)
    a = p.parse_args(argv)
    if not 0 < a.clients <= 5000:
        p.error("--clients must be 1..5000")
    if a.kind == "crowd":
        doc = asyncio.run(crowd(a.port, a.clients, a.path, a.timeout, a.host))
    elif a.kind == "slowloris":
        doc = asyncio.run(slowloris(a.port, a.clients, a.hold, a.probes, a.path, a.host, a.close_within))
    else:
        doc = resets(a.port, a.clients, a.host)
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())

