"""Who may call: the web configuration in force, its credentials check, and
the worker that re-reads it when its files change or on SIGHUP.

The settings are swapped whole: a connection takes the TLS context of the
moment it is accepted and keeps it to the end, so a rotated certificate
(cert-manager rewrites the Secret's files under a running pod) serves the
next handshake and drops no connection in flight. A file that does not load
keeps the settings in force, with one log line and a counted failure.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import os
import ssl
import threading
import time
from collections import OrderedDict

import bcrypt

from agent.transport.web_config import WebConfig, WebConfigError, load_web_config
from agent.workers import Worker, WorkerHandle

__all__ = ["BasicAuth", "WebAccess"]

log = logging.getLogger("slatrace")

WATCH_S = 2.0          # how often the files are looked at
_CACHE = 1024          # verified (user, password) pairs remembered; bcrypt costs ~50 ms each
# Compared against when the user is unknown, so that answering takes as long as for a known one.
_DUMMY_HASH = b"$2b$10$" + b"C" * 53


class BasicAuth:
    """`Authorization: Basic ...` against the users' bcrypt hashes. A pair
    once checked is remembered (by a digest, never the password), as
    exporter-toolkit does: bcrypt is slow on purpose, a scrape every 15 s
    should not pay it each time."""

    def __init__(self, users: dict[str, bytes]) -> None:
        self.users = users
        self._known: OrderedDict[bytes, bool] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def required(self) -> bool:
        return bool(self.users)

    def cached(self, header: str | None) -> bool | None:
        """The answer if it needs no bcrypt (no credentials, or a pair seen
        before); None when `verify` must run (on a worker thread)."""
        pair = _credentials(header)
        if pair is None:
            return False
        with self._lock:
            return self._known.get(self._key(*pair))

    def verify(self, header: str | None) -> bool:
        pair = _credentials(header)
        if pair is None:
            return False
        user, password = pair
        key = self._key(user, password)
        with self._lock:
            known = self._known.get(key)
        if known is not None:
            return known
        hashed = self.users.get(user)
        try:
            ok = bcrypt.checkpw(password.encode(), hashed or _DUMMY_HASH) and hashed is not None
        except ValueError:
            ok = False
        with self._lock:
            self._known[key] = ok
            if len(self._known) > _CACHE:
                self._known.popitem(last=False)
        return ok

    def _key(self, user: str, password: str) -> bytes:
        return hashlib.sha256(b"\0".join((user.encode(), password.encode(), self.users.get(user, b"")))).digest()


def _credentials(header: str | None) -> tuple[str, str] | None:
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        text = base64.b64decode(token.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    user, sep, password = text.partition(":")
    return (user, password) if sep else None


class WebAccess:
    """The web configuration in force for every server that uses it (the API
    and /metrics, the OTLP/HTTP and OTLP/gRPC receivers). Loading it at
    construction raises WebConfigError: the daemon refuses to start."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.config: WebConfig = load_web_config(path)
        self.auth = BasicAuth(self.config.users_map)
        if self.config.users and self.config.tls is None:
            log.warning("%s has basic_auth_users but no tls_server_config: passwords cross the network in "
                        "clear text", path)
        self.generation = 1
        self.reloads = 0
        self.failures = 0
        self.last_ok = True
        self.last_ok_time = time.time()
        self._stamps = _stamps(self.config.files)
        self._pending: tuple | None = None  # stamps seen changed at the last look
        self.worker = Worker.loop("web-config", "watching the web configuration's files", self._run)
        self._lock = threading.Lock()

    @property
    def tls_context(self) -> ssl.SSLContext | None:
        tls = self.config.tls
        return tls.context if tls is not None else None

    def describe(self) -> str:
        tls = self.config.tls
        parts = [f"TLS {tls.min_version}+ ({tls.client_auth_type})" if tls else "no TLS",
                 f"basic auth for {len(self.config.users)} user(s)" if self.config.users else "no basic auth"]
        return ", ".join(parts)

    # --- reloading ---------------------------------------------------------

    def reload(self, why: str = "SIGHUP") -> bool:
        """Read the files again; on any problem keep the settings in force."""
        with self._lock:
            stamps = _stamps(self.config.files)
            try:
                new = load_web_config(self.path)
                if (new.tls is None) != (self.config.tls is None):
                    raise WebConfigError(f"{self.path}: tls_server_config was "
                                         f"{'added' if new.tls else 'removed'}, which needs a restart")
            except WebConfigError as e:
                self._stamps = stamps  # said once per change of the files, not every look
                self.failures += 1
                self.last_ok = False
                log.error("web config reload (%s) failed, keeping the settings in force: %s", why, e)
                return False
            self._stamps = _stamps(new.files)
            self.last_ok = True
            self.last_ok_time = time.time()
            if new.digest == self.config.digest:
                return True
            self.config = new
            self.auth = BasicAuth(new.users_map)
            self.generation += 1
            self.reloads += 1
            log.info("web config reloaded (%s): %s", why, self.describe())
            return True

    def changed(self) -> bool:
        """True once the files differ from those loaded and have stayed the
        same for one look: a certificate and its key written one after the
        other are read together, not half-way."""
        now = _stamps(self.config.files)
        if now == self._stamps:
            self._pending = None
            return False
        settled = now == self._pending
        self._pending = now
        return settled

    def request(self) -> None:
        """Safe inside a signal handler: sets a flag, nothing else."""
        self.worker.nudge()

    def start(self) -> None:
        self.worker.start()

    def shutdown(self, timeout: float = 2.0) -> None:
        self.worker.stop(timeout)

    def _run(self, handle: WorkerHandle) -> None:
        while True:
            wanted = handle.wait_nudge(WATCH_S)
            if handle.stopping:
                return
            try:
                if wanted:
                    self.reload("SIGHUP")
                elif self.changed():
                    self.reload("files changed")
                handle.succeeded()
            except Exception as e:  # noqa: BLE001  (a bug must not end the watch; the settings in force stay)
                self.failures += 1
                handle.failed(e, again_in=WATCH_S)


def _stamps(paths: tuple[str, ...]) -> tuple:
    """What tells a file changed: through symlinks (a Kubernetes Secret volume
    swaps a `..data` link), its inode, size and modification time."""
    out = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append((p, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            out.append((p, None))
    return tuple(out)
