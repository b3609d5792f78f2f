"""The agent's HTTP/1.1 server (over TLS when configured), beneath the API
and the OTLP/HTTP receiver.

One asyncio event loop accepts connections, does the TLS handshakes and reads
requests; a small, fixed pool of worker threads runs the handlers. A client
that connects and sends nothing, or sends one byte a minute, therefore costs a
socket and a few hundred bytes of buffers — never a thread — and is closed
when its deadline passes:

- the listen backlog is 1,024 (socketserver's is 5);
- the TLS handshake and a request head must arrive within `head_timeout_s`,
  a body within `body_timeout_s`, and a kept-alive connection may sit idle
  `idle_timeout_s`;
- at most `max_connections` are open, `max_connections_per_client` from one
  peer address and `max_tls_connections` over TLS (asyncio holds a 256 KiB
  read buffer for each, handshake or not); past any of them, the connection
  (of that client, over TLS) that has waited longest for a request head (or
  its handshake) is closed to make room, so stalled clients can never lock the
  door on `/readyz` or a Prometheus scrape, nor take the agent's memory;
- request bodies buffered at once are bounded in bytes: a client whose body
  would exceed the budget is read later (TCP back-pressure), not refused;
- a client that resets costs one debug line; any other failure is one warning.

HTTP/1.1 itself — request lines, headers, framing, keep-alive, 100-continue —
is parsed by h11 (a small, strict, widely used sans-I/O library) fed from the
event loop, so the limits above stay the server's own. With a web
configuration (agent.transport.access) a clear-text client of a TLS listener
gets a failed handshake and nothing else, and a request without valid
credentials a 401 with `WWW-Authenticate: Basic`, before its body is read.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import ssl
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from http import HTTPStatus
from typing import TYPE_CHECKING

import h11

from agent.errors import SlatraceError
from agent.transport.response import Response, error
from agent.workers import Worker, WorkerHandle

if TYPE_CHECKING:
    from agent.transport.access import WebAccess

__all__ = ["HttpApp", "ListenError", "Request", "ServerLimits", "ServerStats",
           "BackgroundHTTPServer", "parse_listen", "raise_fd_limit"]

log = logging.getLogger(__name__)

BACKLOG = 1024
FD_RESERVE = 512
MAX_HEADERS = 100
READ_SIZE = 1 << 16
REALM = 'Basic realm="slatrace", charset="UTF-8"'


class ListenError(SlatraceError):
    pass


def parse_listen(value: str, flag: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"{flag} {value!r} is not HOST:PORT (for example 127.0.0.1:9477)")
    return host.strip("[]") or "0.0.0.0", int(port)


def raise_fd_limit(want: int = 65536) -> int:
    """Lift the soft open-files limit towards the hard one, so a crowd of
    clients meets the connection limit below rather than EMFILE; returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            log.warning("cannot raise the open-files limit from %d to %d: %s", soft, target, e)
    return soft


@dataclass(frozen=True)
class Request:
    """One request as the handler sees it. `peer` and `local` are the
    connection's (host, port) at each end."""

    method: str
    target: str
    version: str
    headers: dict[str, str]  # names in lower case; a repeated header keeps its last value
    peer: tuple[str, int]
    local: tuple[str, int]
    body: bytes = b""

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())

    def content_length(self) -> int | None:
        raw = self.headers.get("content-length")
        return int(raw) if raw is not None and raw.strip().isdigit() else None


class HttpApp:
    """What a server serves. `check_head` runs on the event loop with the
    head only (keep it cheap): a Response refuses the request before its body
    is read. `handle` runs on a worker thread with the whole request."""

    max_body_bytes: int = 64 << 10
    # A refused body up to this size is read and dropped, so a client still
    # sending gets the answer rather than a reset; a larger one closes the connection.
    drain_bytes: int = 1 << 20

    def check_head(self, req: Request) -> Response | None:
        return None

    def handle(self, req: Request) -> Response:
        raise NotImplementedError

    def inline(self, req: Request) -> bool:
        """True for a request cheap enough to answer on the event loop itself
        (health probes): it never queues behind busy workers."""
        return False

    def public(self, req: Request) -> bool:
        """True for a request served without credentials (health probes)."""
        return False

    def unauthorized(self, req: Request, message: str) -> Response:
        """The 401 in the app's own encoding; the server adds WWW-Authenticate."""
        return error(401, message)


@dataclass(frozen=True)
class ServerLimits:
    head_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    idle_timeout_s: float = 30.0
    write_timeout_s: float = 30.0
    max_head_bytes: int = 64 << 10
    max_connections: int = 4096
    max_connections_per_client: int = 1024  # by peer address; past it that client's longest-waiting one goes
    # Over TLS, 256 KiB of asyncio's read buffer each: 128 hold 32 MiB, where
    # 1,000 stalled handshakes would outgrow the DaemonSet's memory limit.
    max_tls_connections: int = 128
    body_budget_bytes: int = 64 << 20  # request bodies held in memory at once, all connections
    workers: int = 8


@dataclass
class ServerStats:
    """Counters the server keeps; read by the metrics collector and tests."""

    accepted: int = 0
    served: int = 0
    timeouts: int = 0      # handshake, head, body, idle or write deadline passed
    evicted: int = 0       # closed to make room under max_connections
    resets: int = 0        # the client went away mid-request
    malformed: int = 0     # not HTTP/1.x, or a head too large
    errors: int = 0        # handler failures (500)
    tls_failures: int = 0  # TLS handshakes that failed (clear text, unknown CA, no client certificate, version)
    unauthorized: int = 0  # requests refused for missing or wrong credentials (401)
    open: int = 0

    OUTCOMES = ("served", "timeouts", "evicted", "resets", "malformed", "errors", "tls_failures", "unauthorized")


class _Budget:
    """Bytes of request bodies held at once; waiters queue in order."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._cond = asyncio.Condition()

    async def take(self, n: int) -> int:
        n = min(n, self.limit)  # a single body larger than the budget waits for an empty budget
        async with self._cond:
            await self._cond.wait_for(lambda: self.used + n <= self.limit)
            self.used += n
        return n

    async def give(self, n: int) -> None:
        async with self._cond:
            self.used -= n
            self._cond.notify_all()


class _Closed(Exception):
    """The connection is done (client closed, timed out or malformed)."""


class _Malformed(Exception):
    """Not HTTP/1.x: answered 400 (or 431) and closed."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


class BackgroundHTTPServer:
    """An HttpApp served on its own thread: start(), stop(), port, stats.
    `access` (the web configuration) adds TLS and basic auth."""

    def __init__(self, host: str, port: int, app: HttpApp, name: str, limits: ServerLimits = ServerLimits(),
                 access: WebAccess | None = None) -> None:
        self.app = app
        self.limits = limits
        self.name = name
        self.access = access
        self.stats = ServerStats()
        self._loop = asyncio.new_event_loop()
        self._pool = ThreadPoolExecutor(max_workers=limits.workers, thread_name_prefix=f"{name}-worker")
        # Bind now, in the caller's thread, so a busy port fails the start at once.
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP, not 0: asyncio turns on TCP_NODELAY only for sockets that
        # name it, and without it a TLS answer's close_notify waited 40 ms (delayed ACK).
        self._sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
            self._sock.listen(BACKLOG)
            self._sock.setblocking(False)
            self._port = self._sock.getsockname()[1]
        except OSError:
            self._sock.close()
            self._loop.close()
            self._pool.shutdown(wait=False)
            raise
        # Never more connections than open files allow: the agent keeps fds in
        # reserve for /proc, cgroups and BPF, and two servers share the rest.
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.max_connections = limits.max_connections if soft == resource.RLIM_INFINITY else \
            max(16, min(limits.max_connections, (soft - FD_RESERVE) // 2))
        self._waiting: OrderedDict[asyncio.Task, str] = OrderedDict()  # awaiting a head -> peer host
        self._per_host: dict[str, int] = {}
        self._conns: set[asyncio.Task] = set()
        self._tls: set[asyncio.Task] = set()   # connections over TLS (or in its handshake)
        self._budget: _Budget | None = None
        # bcrypt checks running at once: a flood of new passwords queues here
        # (on the loop, costing nothing) instead of taking every worker.
        self._bcrypt: asyncio.Semaphore | None = None
        self._server: asyncio.base_events.Server | None = None
        self.worker = Worker.loop(name, f"serving HTTP on port {self._port}", self._run, on_stop=self._stop_loop)
        self._started = threading.Event()

    @property
    def port(self) -> int:
        return self._port

    @property
    def scheme(self) -> str:
        return "https" if self.access is not None and self.access.tls_context is not None else "http"

    def start(self) -> None:
        self.worker.start()
        self._started.wait(5.0)

    def stop(self) -> None:
        if self.worker.alive:
            fut = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
            try:
                fut.result(timeout=5.0)
            except Exception:  # noqa: BLE001  (shutdown must not raise on the way out)
                log.warning("%s server did not shut down cleanly", self.name)
            self.worker.stop(5.0)
        else:
            self.worker.stop(0)
            self._sock.close()
            if not self._loop.is_closed():
                self._loop.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # --- event loop ------------------------------------------------------

    def _stop_loop(self) -> None:
        """The worker's wake-up on stop: ends run_forever from another thread."""
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._loop.stop)

    def _run(self, handle: WorkerHandle) -> None:
        if self._loop.is_closed():  # a restart after the loop died
            self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        self._loop.set_exception_handler(self._loop_exception)
        self._loop.run_until_complete(self._serve())
        self._started.set()
        handle.succeeded()
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    def _loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        exc = context.get("exception")
        if isinstance(exc, (ssl.SSLError, ConnectionError)):
            log.debug("%s server: %s (%s)", self.name, context.get("message", "error"), exc)
            return
        log.warning("%s server: %s%s", self.name, context.get("message", "error"), f" ({exc})" if exc else "")

    async def _serve(self) -> None:
        self._budget = _Budget(self.limits.body_budget_bytes)
        self._bcrypt = asyncio.Semaphore(max(1, self.limits.workers // 4))
        # backlog again: asyncio calls listen() on a given socket anew, with 100 by default.
        self._server = await asyncio.start_server(self._connection, sock=self._sock, backlog=BACKLOG,
                                                  limit=2 * READ_SIZE)

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._conns):
            task.cancel()
        if self._conns:
            await asyncio.wait(list(self._conns), timeout=2.0)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        peer = _addr(writer.get_extra_info("peername"))
        local = _addr(writer.get_extra_info("sockname"))
        self._conns.add(task)
        self._per_host[peer[0]] = self._per_host.get(peer[0], 0) + 1
        self.stats.accepted += 1
        self.stats.open = len(self._conns)
        if self._per_host[peer[0]] > self.limits.max_connections_per_client:
            self._evict_one(peer[0])
        if len(self._conns) > self.max_connections:
            self._evict_one()
        try:
            # The settings of the moment of accept serve this connection to its end.
            access = self.access
            tls = access.tls_context if access is not None else None
            if tls is not None:
                self._tls.add(task)
                if len(self._tls) > self.limits.max_tls_connections:
                    self._evict_one(among=self._tls)
                self._waiting[task] = peer[0]
                try:
                    await self._handshake(writer, tls, peer)
                finally:
                    self._waiting.pop(task, None)
            conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self.limits.max_head_bytes)
            first = True
            while True:
                # The first head has head_timeout_s from the connection; a
                # kept-alive connection may idle idle_timeout_s before its next.
                self._waiting[task] = peer[0]
                try:
                    event = await self._next_event(conn, reader, self.limits.head_timeout_s if first
                                                   else self.limits.idle_timeout_s, head=True)
                finally:
                    self._waiting.pop(task, None)
                first = False
                if not isinstance(event, h11.Request):
                    return  # closed between requests: the normal end of a connection
                keep = await self._exchange(conn, event, reader, writer, peer, local)
                if not keep or conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except _Closed:
            pass
        except _Malformed as e:
            self.stats.malformed += 1
            log.debug("%s: %s:%d sent a malformed request (%s)", self.name, *peer, e)
            writer.write(_raw_error(e.status, "malformed HTTP request"))
        except (ConnectionError, asyncio.IncompleteReadError):
            self.stats.resets += 1
            log.debug("%s: %s:%d went away mid-request", self.name, *peer)
        except asyncio.CancelledError:
            pass
        except Exception as e:  # noqa: BLE001  (one line, never a traceback per client)
            self.stats.errors += 1
            log.warning("%s: connection from %s:%d failed: %s", self.name, *peer, e)
        finally:
            self._conns.discard(task)
            self._tls.discard(task)
            left = self._per_host.pop(peer[0], 1) - 1
            if left:
                self._per_host[peer[0]] = left
            self.stats.open = len(self._conns)
            if writer.transport.is_closing():
                pass
            elif writer.transport.get_write_buffer_size():
                writer.transport.abort()  # a client that stopped reading gets no more of our memory
            else:
                writer.close()

    async def _handshake(self, writer: asyncio.StreamWriter, ctx: ssl.SSLContext, peer: tuple[str, int]) -> None:
        """The TLS handshake, on the event loop without blocking it (asyncio's
        TLS runs OpenSSL over memory buffers): a client that does not finish
        it in time, speaks clear text, or shows no acceptable certificate is
        closed with nothing said over HTTP."""
        timeout = self.limits.head_timeout_s
        try:
            async with asyncio.timeout(timeout + 1.0):
                await writer.start_tls(ctx, ssl_handshake_timeout=timeout)
        except TimeoutError:
            self.stats.timeouts += 1
            self.stats.tls_failures += 1
            raise _Closed from None
        except (ssl.SSLError, ConnectionError, OSError) as e:
            self.stats.tls_failures += 1
            if isinstance(e, ConnectionAbortedError) and "taking longer" in str(e):
                self.stats.timeouts += 1  # asyncio's own handshake deadline
            log.debug("%s: TLS handshake with %s:%d failed: %s", self.name, *peer, e)
            raise _Closed from None

    def _evict_one(self, host: str | None = None, among: set[asyncio.Task] | None = None) -> None:
        """Close the connection (of `host`, of `among`, if given) that has waited longest for a request head."""
        for task, from_host in self._waiting.items():
            if task is not asyncio.current_task() and (host is None or from_host == host) and \
                    (among is None or task in among):
                self._waiting.pop(task)
                self.stats.evicted += 1
                task.cancel()
                return

    async def _next_event(self, conn: h11.Connection, reader: asyncio.StreamReader, timeout: float,
                          head: bool = False):
        """The next h11 event, reading as needed until `timeout` from now. One
        deadline for all the reads: a client trickling a byte at a time would
        otherwise arm and cancel a timer for every byte."""
        event = self._parsed(conn, head)
        if event is not h11.NEED_DATA:
            return event
        try:
            async with asyncio.timeout(max(timeout, 0.0)):
                while event is h11.NEED_DATA:
                    data = await reader.read(READ_SIZE)
                    if not data and (conn.trailing_data[0] or conn.their_state not in (h11.IDLE, h11.DONE)):
                        raise ConnectionResetError("closed mid-request")
                    conn.receive_data(data)
                    event = self._parsed(conn, head)
        except TimeoutError:
            self.stats.timeouts += 1
            raise _Closed from None
        return event

    def _parsed(self, conn: h11.Connection, head: bool):
        """h11's next event from what has arrived (NEED_DATA if incomplete), the head's limits checked."""
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as e:
            raise _Malformed(e.error_status_hint, str(e)) from None
        if head and isinstance(event, h11.Request):
            if len(event.headers) > MAX_HEADERS:
                raise _Malformed(431, f"more than {MAX_HEADERS} header fields")
            # h11 bounds a head still arriving; one that came whole is measured here.
            size = len(event.target) + sum(len(n) + len(v) + 4 for n, v in event.headers)
            if size > self.limits.max_head_bytes:
                raise _Malformed(431, f"a request head of more than {self.limits.max_head_bytes} bytes")
        return event

    async def _exchange(self, conn: h11.Connection, event: h11.Request, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter, peer: tuple[str, int], local: tuple[str, int]) -> bool:
        """Serve one request; True to keep the connection for another."""
        req = _request(event, peer, local)
        keep = conn.their_http_version == b"1.1" and (req.header("connection") or "").lower() != "close" \
            or (req.header("connection") or "").lower() == "keep-alive"
        length = req.content_length()
        refusal = await self._check_access(req)
        refusal = refusal or self.app.check_head(req)
        if "transfer-encoding" in req.headers or (length is None and "content-length" in req.headers):
            # The body's end is not given up front: answer and close.
            keep = False
            length = None
            refusal = refusal or error(411, "chunked bodies are not accepted; send a Content-Length")
        if refusal is None and (length or 0) > self.app.max_body_bytes:
            refusal = error(413, f"the body has {length} bytes, more than the limit of {self.app.max_body_bytes}")
        if refusal is not None:
            waiting = conn.they_are_waiting_for_100_continue  # it sends no body unless told to
            if not waiting and "transfer-encoding" not in req.headers and (length or 0) <= self.app.drain_bytes:
                await self._body(conn, reader, keep=False)  # dropped, so the client gets the answer
            else:
                keep = False
            await self._write(conn, writer, refusal, req.method == "HEAD", close=not keep or refusal.close)
            return keep and not refusal.close
        if length:
            if conn.they_are_waiting_for_100_continue:
                writer.write(conn.send(h11.InformationalResponse(status_code=100, headers=[])))
            held = await self._budget.take(length)
            try:
                body = await self._body(conn, reader)
                req = replace(req, body=body)
                resp = await self._handle(req)
            finally:
                await self._budget.give(held)
        else:
            await self._body(conn, reader)  # the end of an empty message
            resp = await self._handle(req)
        await self._write(conn, writer, resp, req.method == "HEAD", close=not keep or resp.close)
        self.stats.served += 1
        return keep and not resp.close

    async def _check_access(self, req: Request) -> Response | None:
        """The 401 for a request without valid credentials, when the web
        configuration has users; bcrypt runs on a worker, not the event loop."""
        access = self.access
        if access is None:
            return None
        auth = access.auth
        if not auth.required or self.app.public(req):
            return None
        header = req.header("authorization")
        ok = auth.cached(header)
        if ok is None:
            async with self._bcrypt:
                ok = await self._loop.run_in_executor(self._pool, auth.verify, header)
        if ok:
            return None
        self.stats.unauthorized += 1
        said = "missing" if not header else "wrong"
        resp = self.app.unauthorized(req, f"credentials {said}: this agent asks for HTTP basic auth")
        return replace(resp, headers=resp.headers + (("WWW-Authenticate", REALM),))

    async def _handle(self, req: Request) -> Response:
        try:
            if self.app.inline(req):
                return self.app.handle(req)
            return await self._loop.run_in_executor(self._pool, self.app.handle, req)
        except Exception:  # a bug must cost one request, not the server
            self.stats.errors += 1
            log.exception("%s: error serving %s %s", self.name, req.method, req.path)
            return error(500, "internal error; see the agent's log")

    async def _body(self, conn: h11.Connection, reader: asyncio.StreamReader, keep: bool = True) -> bytes:
        """The request's body (h11 frames it by Content-Length), within body_timeout_s."""
        parts: list[bytes] = []
        end = time.monotonic() + self.limits.body_timeout_s
        while True:
            event = await self._next_event(conn, reader, end - time.monotonic())
            if isinstance(event, h11.Data):
                if keep:
                    parts.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                return b"".join(parts)
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionResetError("closed mid-body")

    async def _timed(self, aw, timeout: float):
        # asyncio.timeout, not wait_for: no inner task, so an eviction's
        # cancel cannot be lost when data arrives in the same loop turn.
        try:
            async with asyncio.timeout(max(timeout, 0.0)):
                return await aw
        except TimeoutError:
            self.stats.timeouts += 1
            raise _Closed from None

    async def _write(self, conn: h11.Connection, writer: asyncio.StreamWriter, resp: Response, head_only: bool,
                     close: bool) -> None:
        headers = [("Server", "slatrace"), ("Content-Type", resp.content_type),
                   ("Content-Length", str(len(resp.body))), *resp.headers]
        if self.access is not None:
            headers += self.access.config.headers
        if close:
            headers.append(("Connection", "close"))
        reason = HTTPStatus(resp.status).phrase if resp.status in HTTPStatus._value2member_map_ else ""
        data = conn.send(h11.Response(status_code=resp.status, headers=headers, reason=reason))
        if not head_only and resp.body:
            data += conn.send(h11.Data(data=resp.body))
        data += conn.send(h11.EndOfMessage())
        writer.write(data)
        await self._timed(writer.drain(), self.limits.write_timeout_s)


def _addr(info) -> tuple[str, int]:
    if isinstance(info, tuple) and len(info) >= 2:
        return str(info[0]), int(info[1])
    return ("", 0)


def _request(event: h11.Request, peer: tuple[str, int], local: tuple[str, int]) -> Request:
    headers = {bytes(name).decode("latin-1"): bytes(value).decode("latin-1") for name, value in event.headers}
    return Request(bytes(event.method).decode("ascii").upper(), bytes(event.target).decode("latin-1"),
                   "HTTP/" + bytes(event.http_version).decode("ascii"), headers, peer, local)


def _raw_error(status: int, message: str) -> bytes:
    """A refusal written without h11, whose state is broken by a malformed head."""
    resp = error(status, message)
    reason = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else ""
    head = (f"HTTP/1.1 {status} {reason}\r\nServer: slatrace\r\nContent-Type: {resp.content_type}\r\n"
            f"Content-Length: {len(resp.body)}\r\nConnection: close\r\n\r\n")
    return head.encode("latin-1") + resp.body
