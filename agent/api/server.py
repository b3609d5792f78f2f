"""The agent's HTTP/1.1 server, shared by the API and the OTLP/HTTP receiver.

One asyncio event loop accepts connections and reads requests; a small, fixed
pool of worker threads runs the handlers. A client that connects and sends
nothing, or sends one byte a minute, therefore costs a socket and a few hundred
bytes of buffers — never a thread — and is closed when its deadline passes:

- the listen backlog is 1,024 (socketserver's is 5);
- a request head must arrive within `head_timeout_s`, its body within
  `body_timeout_s`, and a kept-alive connection may sit idle `idle_timeout_s`;
- at most `max_connections` are open, and `max_connections_per_client` from one
  peer address; past either, the connection (of that client) that has waited
  longest for a request head is closed to make room, so stalled clients can
  never lock the door on `/readyz` or a Prometheus scrape;
- request bodies buffered at once are bounded in bytes: a client whose body
  would exceed the budget is read later (TCP back-pressure), not refused;
- a client that resets costs one debug line; any other failure is one warning.

The stdlib event loop is used rather than a server library because the agent
serves two small routes sets with Content-Length bodies, wants exactly these
limits, and must hand each request's peer and local address to the OTLP
receiver; none of that needs another dependency.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus

from agent.api.routes import Api, Response, error
from agent.errors import SlatraceError

__all__ = ["HttpApp", "HttpServer", "ListenError", "Request", "ServerLimits",
           "BackgroundHTTPServer", "parse_listen", "raise_fd_limit"]

log = logging.getLogger(__name__)

BACKLOG = 1024
FD_RESERVE = 512
MAX_HEADERS = 100


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


@dataclass(frozen=True)
class ServerLimits:
    head_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    idle_timeout_s: float = 30.0
    write_timeout_s: float = 30.0
    max_head_bytes: int = 64 << 10
    max_connections: int = 4096
    max_connections_per_client: int = 1024  # by peer address; past it that client's longest-waiting one goes
    body_budget_bytes: int = 64 << 20  # request bodies held in memory at once, all connections
    workers: int = 8


@dataclass
class ServerStats:
    """Counters the server keeps; read by the metrics collector and tests."""

    accepted: int = 0
    served: int = 0
    timeouts: int = 0      # head, body, idle or write deadline passed
    evicted: int = 0       # closed to make room under max_connections
    resets: int = 0        # the client went away mid-request
    malformed: int = 0     # not HTTP/1.x, or a head too large
    errors: int = 0        # handler failures (500)
    open: int = 0

    OUTCOMES = ("served", "timeouts", "evicted", "resets", "malformed", "errors")


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


class BackgroundHTTPServer:
    """An HttpApp served on its own thread: start(), stop(), port, stats."""

    def __init__(self, host: str, port: int, app: HttpApp, name: str, limits: ServerLimits = ServerLimits()) -> None:
        self.app = app
        self.limits = limits
        self.name = name
        self.stats = ServerStats()
        self._loop = asyncio.new_event_loop()
        self._pool = ThreadPoolExecutor(max_workers=limits.workers, thread_name_prefix=f"{name}-worker")
        # Bind now, in the caller's thread, so a busy port fails the start at once.
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
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
        self._budget: _Budget | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = threading.Event()

    @property
    def port(self) -> int:
        return self._port

    def start(self) -> None:
        self._thread.start()
        self._started.wait(5.0)

    def stop(self) -> None:
        if self._thread.is_alive():
            fut = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
            try:
                fut.result(timeout=5.0)
            except Exception:  # noqa: BLE001  (shutdown must not raise on the way out)
                log.warning("%s server did not shut down cleanly", self.name)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5.0)
        else:
            self._sock.close()
            self._loop.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # --- event loop ------------------------------------------------------

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.set_exception_handler(self._loop_exception)
        self._loop.run_until_complete(self._serve())
        self._started.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    def _loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        exc = context.get("exception")
        log.warning("%s server: %s%s", self.name, context.get("message", "error"), f" ({exc})" if exc else "")

    async def _serve(self) -> None:
        self._budget = _Budget(self.limits.body_budget_bytes)
        self._server = await asyncio.start_server(self._connection, sock=self._sock,
                                                  limit=self.limits.max_head_bytes)

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
            first = True
            while True:
                # The first head has head_timeout_s from the connection; a
                # kept-alive connection may idle idle_timeout_s before its next.
                self._waiting[task] = peer[0]
                try:
                    head = await self._read_head(reader, self.limits.head_timeout_s if first
                                                 else self.limits.idle_timeout_s)
                finally:
                    self._waiting.pop(task, None)
                first = False
                if head is None:
                    return
                keep = await self._exchange(head, reader, writer, peer, local)
                if not keep:
                    return
        except _Closed:
            pass
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
            left = self._per_host.pop(peer[0], 1) - 1
            if left:
                self._per_host[peer[0]] = left
            self.stats.open = len(self._conns)
            if writer.transport.get_write_buffer_size():
                writer.transport.abort()  # a client that stopped reading gets no more of our memory
            else:
                writer.close()

    def _evict_one(self, host: str | None = None) -> None:
        """Close the connection (of `host`, if given) that has waited longest for a request head."""
        for task, from_host in self._waiting.items():
            if task is not asyncio.current_task() and (host is None or from_host == host):
                self._waiting.pop(task)
                self.stats.evicted += 1
                task.cancel()
                return

    async def _read_head(self, reader: asyncio.StreamReader, timeout: float) -> bytes | None:
        try:
            return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
        except asyncio.TimeoutError:
            self.stats.timeouts += 1
            raise _Closed from None
        except asyncio.IncompleteReadError as e:
            if not e.partial:
                return None  # closed between requests: the normal end of a connection
            raise
        except asyncio.LimitOverrunError:
            self.stats.malformed += 1
            raise _Closed from None
        except ValueError:  # the StreamReader's own limit
            self.stats.malformed += 1
            raise _Closed from None

    async def _exchange(self, raw: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        peer: tuple[str, int], local: tuple[str, int]) -> bool:
        """Serve one request; True to keep the connection for another."""
        req = _parse_head(raw, peer, local)
        if req is None:
            self.stats.malformed += 1
            await self._write(writer, error(400, "malformed HTTP request"), head_only=False, close=True)
            return False
        keep = _keep_alive(req)
        length = req.content_length()
        refusal = self.app.check_head(req)
        if "transfer-encoding" in req.headers or (length is None and "content-length" in req.headers):
            # The body's end cannot be found: answer and close.
            keep = False
            length = None
            refusal = refusal or error(411, "chunked bodies are not accepted; send a Content-Length")
        if refusal is None and (length or 0) > self.app.max_body_bytes:
            refusal = error(413, f"the body has {length} bytes, more than the limit of {self.app.max_body_bytes}")
        if refusal is not None:
            if length and length <= self.app.drain_bytes:
                await self._discard(reader, length)
            elif length:
                keep = False
            await self._write(writer, refusal, req.method == "HEAD", close=not keep or refusal.close)
            return keep and not refusal.close
        if length:
            if (req.header("expect") or "").lower() == "100-continue":
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            held = await self._budget.take(length)
            try:
                body = await self._timed(reader.readexactly(length), self.limits.body_timeout_s)
                req = _with_body(req, body)
                resp = await self._handle(req)
            finally:
                await self._budget.give(held)
        else:
            resp = await self._handle(req)
        await self._write(writer, resp, req.method == "HEAD", close=not keep or resp.close)
        self.stats.served += 1
        return keep and not resp.close

    async def _handle(self, req: Request) -> Response:
        try:
            if self.app.inline(req):
                return self.app.handle(req)
            return await self._loop.run_in_executor(self._pool, self.app.handle, req)
        except Exception:  # a bug must cost one request, not the server
            self.stats.errors += 1
            log.exception("%s: error serving %s %s", self.name, req.method, req.path)
            return error(500, "internal error; see the agent's log")

    async def _discard(self, reader: asyncio.StreamReader, size: int) -> None:
        deadline = time.monotonic() + self.limits.body_timeout_s
        while size > 0:
            chunk = await self._timed(reader.read(min(size, 1 << 16)), deadline - time.monotonic())
            if not chunk:
                raise _Closed
            size -= len(chunk)

    async def _timed(self, aw, timeout: float):
        try:
            return await asyncio.wait_for(aw, max(timeout, 0.0))
        except asyncio.TimeoutError:
            self.stats.timeouts += 1
            raise _Closed from None

    async def _write(self, writer: asyncio.StreamWriter, resp: Response, head_only: bool, close: bool) -> None:
        reason = HTTPStatus(resp.status).phrase if resp.status in HTTPStatus._value2member_map_ else ""
        lines = [f"HTTP/1.1 {resp.status} {reason}", "Server: slatrace",
                 f"Content-Type: {resp.content_type}", f"Content-Length: {len(resp.body)}"]
        lines += [f"{k}: {v}" for k, v in resp.headers]
        if close:
            lines.append("Connection: close")
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        if not head_only:
            writer.write(resp.body)
        await self._timed(writer.drain(), self.limits.write_timeout_s)


def _addr(info) -> tuple[str, int]:
    if isinstance(info, tuple) and len(info) >= 2:
        return str(info[0]), int(info[1])
    return ("", 0)


def _parse_head(raw: bytes, peer: tuple[str, int], local: tuple[str, int]) -> Request | None:
    try:
        text = raw.decode("latin-1")
    except UnicodeDecodeError:
        return None
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1.") or not parts[0].isalpha() or not parts[1]:
        return None
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            return None
        headers[name.lower()] = value.strip()
        if len(headers) > MAX_HEADERS:
            return None
    return Request(parts[0].upper(), parts[1], parts[2], headers, peer, local)


def _with_body(req: Request, body: bytes) -> Request:
    return Request(req.method, req.target, req.version, req.headers, req.peer, req.local, body)


def _keep_alive(req: Request) -> bool:
    conn = (req.header("connection") or "").lower()
    if req.version == "HTTP/1.0":
        return conn == "keep-alive"
    return conn != "close"


class ApiApp(HttpApp):
    """The JSON API, /metrics and the probes: GET and HEAD only."""

    def __init__(self, api: Api) -> None:
        self.api = api

    def check_head(self, req: Request) -> Response | None:
        if req.method not in ("GET", "HEAD"):
            resp = self.api.handle(req.method, req.target)
            return Response(resp.status, resp.body, resp.content_type, headers=(("Allow", "GET, HEAD"),))
        return None

    def handle(self, req: Request) -> Response:
        return self.api.handle("GET", req.target, req.headers)

    def inline(self, req: Request) -> bool:
        return req.path in ("/livez", "/readyz")


class HttpServer(BackgroundHTTPServer):
    """The agent's API, /metrics and probes."""

    def __init__(self, host: str, port: int, api: Api, limits: ServerLimits = ServerLimits()) -> None:
        try:
            super().__init__(host, port, ApiApp(api), "http", limits)
        except OSError as e:
            raise ListenError(f"cannot listen on {host}:{port} ({e.strerror}): is another slatrace running? "
                              "choose another address with --listen") from None
