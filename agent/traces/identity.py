"""Which slatrace service sent a span: from the connection it came on.

A span's resource says whatever its sender wants, and vLLM says almost nothing
(the OTel SDK's default resource; from 0.16 also `vllm.process_id`, a pid in
vLLM's own pid namespace). So the sender is found from who is at the other end
of the connection:

- a local peer (loopback, or any address of this host): the peer's socket in
  /proc/net/tcp{,6} -> its inode -> the process holding it (/proc/*/fd) -> its
  cgroup -> the service;
- a pod IP: the pod (the pod index) -> its containers' cgroups.

Resource attributes are hints that may only narrow within that identity: a
pid (`vllm.process_id`, `process.pid`) is translated through the NSpid line of
/proc/PID/status among the sender's own processes, a `container.id` or
`k8s.pod.uid` must be the sender's. A hint that contradicts the connection is
ignored and reported (`SpanOrigin.ignored`); `service.name` never names a
service.

A sender the config trusts as a relay (an OpenTelemetry Collector: every span
it forwards comes from its own socket) is the one exception: for its spans the
origin is what its resource attributes vouch for — `k8s.pod.uid`,
`k8s.pod.ip`, `container.id` (each naming cgroups of this node), and a pid
(`process.pid`, `vllm.process_id`) that narrows within them, or alone, with a
`host.name` or `host.id` naming this host, is a pid of the host. An origin
that names nothing here is unresolved with its reason, never guessed.

A batch exporter keeps its connection open, so the answer is cached per
connection; /proc is read again only when the entry ages out.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.config import RelayRule
from agent.identity.cgroups import CgroupPaths, cgroup_glob_matches, cgroup_glob_regex
from agent.identity.kubernetes import PodIndex, PodInfo, parse_kubepods_path

__all__ = ["PID_HINTS", "Peer", "SpanOrigin", "SpanServices", "ThisHost", "cgroup_v2_path", "describe_peer",
           "ns_pids", "parse_grpc_peer", "socket_owner", "tcp_socket_inode", "unresolved_hint"]

# Resource attributes that name the sending process, in the order they are read.
PID_HINTS = ("vllm.process_id", "process.pid")
# The resource attributes an origin is read from (and the cache is keyed by).
_HINT_KEYS = PID_HINTS + ("container.id", "k8s.pod.uid", "k8s.pod.ip", "host.name", "host.id", "service.name")

# Why a span has no service (the `reason` label of slatrace_otlp_spans_unresolved_total).
NO_PEER = "no_peer"              # the transport gave no peer address
REMOTE_PEER = "remote_peer"      # neither this host nor a pod of this node
SOCKET_NOT_FOUND = "socket_not_found"  # a local peer whose socket is not in this network namespace
NO_PROCESS = "no_process"        # the socket has no visible owner (another pid namespace, or closed)
NO_CGROUP = "no_cgroup"          # the process or pod has no cgroup the agent knows
# ... and why a trusted relay's span has none.
RELAY_NO_ORIGIN = "relay_no_origin"                # the relay vouched for no origin attribute
RELAY_ORIGIN_NOT_FOUND = "relay_origin_not_found"  # the pod, container or process it names is not on this node
RELAY_OTHER_HOST = "relay_other_host"              # a pid whose host.name / host.id is another host's
RELAY_PID_WITHOUT_HOST = "relay_pid_without_host"  # a pid alone: no host attribute says whose pid it is

# How long a relayed origin is kept: a relay speaks for many processes, whose
# pids and pods come and go, so it is looked up again soon; an unknown one sooner.
RELAY_TTL_S = 5.0
RELAY_UNKNOWN_TTL_S = 1.0


@dataclass(frozen=True)
class Peer:
    """The remote end of a connection and, when known, the agent's end of it."""

    host: str
    port: int
    local_host: str | None = None
    local_port: int | None = None

    def key(self) -> tuple:
        return (self.host, self.port, self.local_host, self.local_port)


@dataclass(frozen=True)
class SpanOrigin:
    service: str | None     # None: unresolved (see `reason`)
    how: str                # "connection", "pod_ip", the hint that narrowed it ("vllm.process_id", ...),
                            # or "relay:<attribute>" for a trusted relay's span
    cgroup_id: int | None = None
    pid: int | None = None  # the sending process on this host, when known
    reason: str | None = None            # why unresolved
    ignored: tuple[str, ...] = ()        # hints that contradicted the connection


def cgroup_v2_path(proc_cgroup_text: str) -> str | None:
    """The v2 path from /proc/PID/cgroup content (the "0::/path" line)."""
    for line in proc_cgroup_text.splitlines():
        if line.startswith("0::"):
            return line[3:].strip() or "/"
    return None


def parse_grpc_peer(peer: str | None) -> tuple[str, int] | None:
    """grpcio's `context.peer()` ("ipv4:127.0.0.1:54321", "ipv6:[::1]:5432") as (host, port)."""
    if not peer:
        return None
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None  # unix sockets and the like carry no address
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


_ESTABLISHED = "01"  # the st column of /proc/net/tcp


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        addr = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def _proc_net_addr(field: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int] | None:
    """"0100007F:1F90" (or the 32-hex-digit IPv6 form) from /proc/net/tcp{,6}:
    the address is stored as native-endian 32-bit words."""
    hex_addr, _, hex_port = field.partition(":")
    try:
        raw = bytes.fromhex(hex_addr)
        port = int(hex_port, 16)
    except ValueError:
        return None
    if len(raw) not in (4, 16):
        return None
    words = b"".join(raw[i:i + 4][::-1] if sys.byteorder == "little" else raw[i:i + 4]
                     for i in range(0, len(raw), 4))
    addr = ipaddress.ip_address(words)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr, port


def tcp_socket_inode(proc: Path, peer: Peer, net: str = "net", *, exact: bool = True) -> int | None:
    """The inode of the connected socket whose own address is `peer`, from
    `proc`/`net`/tcp and tcp6 (one network namespace's table). `exact` also
    asks its remote end to be the agent's end of the connection, when known."""
    want = _ip(peer.host)
    local = _ip(peer.local_host) if peer.local_host else None
    if want is None:
        return None
    for name in ("tcp", "tcp6"):
        try:
            lines = (proc / net / name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) < 10 or f[3] != _ESTABLISHED:
                continue
            mine, theirs = _proc_net_addr(f[1]), _proc_net_addr(f[2])
            if mine is None or theirs is None or mine != (want, peer.port):
                continue
            if exact and peer.local_port is not None and theirs[1] != peer.local_port:
                continue
            if exact and local is not None and not local.is_unspecified and theirs[0] != local:
                continue
            if f[9].isdigit() and int(f[9]) != 0:
                return int(f[9])
    return None


def socket_owner(proc: Path, inode: int) -> tuple[int, Path] | None:
    """The process holding socket `inode` and the fd it holds it by (the
    lowest pid if several share it)."""
    target = f"socket:[{inode}]"
    found = None
    for entry in proc.iterdir():
        if not entry.name.isdigit() or (found is not None and int(entry.name) >= found[0]):
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd) == target:
                    found = (int(entry.name), fd)
                    break
            except OSError:
                continue
    return found


def ns_pids(proc: Path, pid: int) -> tuple[int, ...]:
    """The NSpid line of /proc/PID/status: the pid in each pid namespace, the
    host's first and the process's own last; () if the process is gone."""
    try:
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return tuple(int(x) for x in line.split()[1:])
    except (OSError, ValueError):
        pass
    return ()


def _pid_ns(proc: Path, pid: int) -> str | None:
    try:
        return os.readlink(proc / str(pid) / "ns" / "pid")
    except OSError:
        return None


def _claimed_pid(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value > 0 else None
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip()) or None
    return None


@dataclass(frozen=True)
class _Sender:
    """What the connection proves: the candidate cgroups (path -> id), and the
    process when it is known."""

    how: str
    cgroups: tuple[tuple[str, int], ...]
    pid: int | None = None
    pod_uid: str | None = None
    socket: tuple[Path, str] | None = None  # (/proc/PID/fd/N, "socket:[inode]") while the connection lives

    def alive(self) -> bool:
        if self.socket is None:
            return True
        try:
            return os.readlink(self.socket[0]) == self.socket[1]
        except OSError:
            return False


@dataclass(frozen=True)
class ThisHost:
    """The names and ids this host goes by, to judge a relay's `host.name` /
    `host.id` beside a pid."""

    names: frozenset[str] = frozenset()
    ids: frozenset[str] = frozenset()

    @classmethod
    def read(cls, proc_root: Path = Path("/proc"), env: Mapping[str, str] = os.environ) -> ThisHost:
        """The kernel's host name, the node's name (NODE_NAME, as the DaemonSet
        sets it) and the machine id, also as the host's pid 1 sees them (the
        agent in a pod of its own)."""
        names, ids = {socket.gethostname(), env.get("NODE_NAME", "")}, set()
        for root in (Path("/"), Path(proc_root) / "1" / "root"):
            for name, into in (("etc/hostname", names), ("etc/machine-id", ids)):
                try:
                    into.add((root / name).read_text().strip())
                except OSError:
                    pass
        return cls(frozenset(n.lower() for n in names if n), frozenset(i.lower() for i in ids if i))

    def judge(self, resource: Mapping[str, Any]) -> bool | None:
        """Whether the resource's host is this one; None when it names no host."""
        given = [(str(resource[k]).strip().lower(), known) for k, known in
                 (("host.id", self.ids), ("host.name", self.names)) if isinstance(resource.get(k), str) and resource[k]]
        if not given:
            return None
        return any(value in known for value, known in given)


class SpanServices:
    def __init__(
        self,
        cgroups: CgroupPaths,
        service_of: Callable[[int], str],
        known_services: Callable[[], Iterable[str]],
        proc_root: Path = Path("/proc"),
        *,
        pods: PodIndex | None = None,
        ttl_s: float = 60.0,
        max_cached: int = 4096,
        clock: Callable[[], float] = time.monotonic,
        relays: Iterable[RelayRule] = (),
        host: ThisHost = ThisHost(),
    ) -> None:
        self._cgroups = cgroups
        self._service_of = service_of
        self._known_services = known_services
        self._proc = Path(proc_root)
        self._pods = pods
        self._ttl = ttl_s
        self._max_cached = max_cached
        self._clock = clock
        self._lock = threading.Lock()
        # connection -> (when, pods generation, sender or reason)
        self._senders: dict[tuple, tuple[float, int, _Sender | str]] = {}
        self._narrowed: dict[tuple, tuple[float, SpanOrigin]] = {}      # (sender, hints) -> (expiry, origin)
        self._host = host
        self._relays: tuple[tuple[RelayRule, Any], ...] = ()
        self._rescanned = float("-inf")
        self.set_relays(relays)

    def set_relays(self, relays: Iterable[RelayRule]) -> None:
        """The senders trusted to relay spans from now on."""
        compiled = tuple((r, cgroup_glob_regex(r.cgroup) if r.cgroup else None) for r in relays)
        with self._lock:
            self._relays = compiled
            self._narrowed.clear()

    @property
    def relays(self) -> tuple[RelayRule, ...]:
        return tuple(r for r, _ in self._relays)

    def origin(self, peer: Peer | None, resource: Mapping[str, Any]) -> SpanOrigin:
        if peer is None:
            return SpanOrigin(None, "unresolved", reason=NO_PEER)
        now = self._clock()
        sender = self._sender(peer, now)
        if isinstance(sender, str):
            return SpanOrigin(None, "unresolved", reason=sender)
        key = (sender, tuple(repr(resource.get(k)) for k in _HINT_KEYS))
        with self._lock:
            hit = self._narrowed.get(key)
        if hit is not None and now < hit[0]:
            return hit[1]
        if self._is_relay(sender):
            found = self._relayed(resource)
            ttl = min(self._ttl, RELAY_TTL_S if found.service is not None else RELAY_UNKNOWN_TTL_S)
        else:
            found, ttl = self._narrow(sender, resource), self._ttl
        with self._lock:
            if len(self._narrowed) >= self._max_cached:
                self._narrowed.clear()  # rare: many distinct senders; a refill is cheap
            self._narrowed[key] = (now + ttl, found)
        return found

    # --- the connection ----------------------------------------------------

    def _sender(self, peer: Peer, now: float) -> _Sender | str:
        generation = self._pods.generation if self._pods is not None else 0
        with self._lock:
            hit = self._senders.get(peer.key())
        # A cached sender is checked each time: the peer's port may belong to
        # a new connection of another process once the old one closed, and a
        # pod's IP to another pod once the pod index changed.
        if hit is not None and now - hit[0] < self._ttl:
            _, seen, sender = hit
            if isinstance(sender, _Sender) and sender.how == "connection":
                if sender.alive():
                    return sender
            elif seen == generation:
                return sender
        found = self._find_sender(peer)
        with self._lock:
            if len(self._senders) >= self._max_cached:
                self._senders.clear()
            self._senders[peer.key()] = (now, generation, found)
        return found

    def _find_sender(self, peer: Peer) -> _Sender | str:
        inode = tcp_socket_inode(self._proc, peer)
        if inode is None and self._own_netns_is_not_the_hosts():
            # The agent in a network namespace of its own (a pod) but with the
            # host's pids: a host process reaches it through a Service, so its
            # socket is in the host's table (pid 1's), its remote end the Service's address.
            inode = tcp_socket_inode(self._proc, peer, "1/net", exact=False)
        if inode is not None:
            owner = socket_owner(self._proc, inode)
            if owner is None:
                return NO_PROCESS
            pid, fd = owner
            path, cgid = self._cgroup_of(pid)
            if cgid is None:
                return NO_CGROUP
            return _Sender("connection", ((path, cgid),), pid=pid, socket=(fd, f"socket:[{inode}]"))
        addr = _ip(peer.host)
        if addr is not None and addr.is_loopback:
            return SOCKET_NOT_FOUND
        pod = self._pods.by_ip(str(addr)) if self._pods is not None and addr is not None else None
        if pod is None:
            return REMOTE_PEER
        containers = self._pod_containers(pod.uid)
        if not containers:
            return NO_CGROUP
        return _Sender("pod_ip", tuple(containers), pod_uid=pod.uid)

    def _pod_containers(self, uid: str) -> list[tuple[str, int]]:
        """The pod's container cgroups, busiest first: unless a hint narrows
        it, the pod's spans are its busiest container's (the server, not its sidecars)."""
        uid = uid.lower()
        containers = []
        for cgid, path in self._cgroups.known().items():
            ref = parse_kubepods_path(path)
            if ref is not None and ref.pod_uid == uid and ref.container_id is not None:
                containers.append((path, cgid))
        containers.sort(key=lambda c: (-self._cgroups.threads(c[0]), c[0]))
        return containers

    def _own_netns_is_not_the_hosts(self) -> bool:
        try:
            return os.readlink(self._proc / "self" / "ns" / "net") != os.readlink(self._proc / "1" / "ns" / "net")
        except OSError:
            return False

    def _cgroup_of(self, pid: int) -> tuple[str | None, int | None]:
        try:
            path = cgroup_v2_path((self._proc / str(pid) / "cgroup").read_text())
        except OSError:
            return None, None
        if path is None:
            return None, None
        return path, self._cgroups.id_of(path)

    # --- the hints ---------------------------------------------------------

    def _narrow(self, sender: _Sender, resource: Mapping[str, Any]) -> SpanOrigin:
        cgroups, how, pid = list(sender.cgroups), sender.how, sender.pid
        ignored: list[str] = []
        for attr in PID_HINTS:
            claimed = _claimed_pid(resource.get(attr))
            if claimed is None:
                continue
            match = self._pid_within(sender, claimed)
            if match is None:
                ignored.append(attr)
            elif match:
                pid, path, cgid = match
                cgroups, how = [(path, cgid)], attr
            break  # the first pid hint present decides; the next is the same claim in other words
        container = resource.get("container.id")
        if isinstance(container, str) and len(container) >= 8:
            within = [(p, c) for p, c in cgroups if container.lower() in p]
            if within:
                if len(cgroups) > 1:
                    how = "container.id"
                cgroups = within
            else:
                ignored.append("container.id")
        pod_uid = resource.get("k8s.pod.uid")
        if isinstance(pod_uid, str) and pod_uid:
            fragments = {pod_uid.lower(), pod_uid.lower().replace("-", "_")}
            if not all(any(f in p for f in fragments) for p, _ in cgroups):
                ignored.append("k8s.pod.uid")
        pod_ip = resource.get("k8s.pod.ip")
        if isinstance(pod_ip, str) and pod_ip:
            pod = self._pod_of(sender)
            if pod is None or pod_ip not in pod.ips:
                ignored.append("k8s.pod.ip")
        path, cgid = cgroups[0]
        service = self._service_of(cgid)
        claimed_name = resource.get("service.name")
        if isinstance(claimed_name, str) and claimed_name != service and claimed_name in set(self._known_services()):
            ignored.append("service.name")
        return SpanOrigin(service, how, cgid, pid, ignored=tuple(ignored))

    def _pid_within(self, sender: _Sender, claimed: int) -> tuple[int, str, int] | tuple[()] | None:
        """The sender's process named `claimed` in its own pid namespace:
        (host pid, cgroup path, cgroup id); () when it stays ambiguous (the
        same pid in several containers of a pod); None when no process of the
        sender's identity has that pid (the claim contradicts the connection)."""
        if sender.pid is None:
            return self._pid_among(sender.cgroups, claimed)
        own = ns_pids(self._proc, sender.pid)
        path, cgid = sender.cgroups[0]
        if own and own[-1] == claimed:
            return sender.pid, path, cgid
        # Another process of the sender's pid namespace, in the sender's cgroup or below it.
        return self._pid_among(self._cgroups_under(path), claimed, _pid_ns(self._proc, sender.pid))

    def _pid_among(self, cgroups: Iterable[tuple[str, int]], claimed: int,
                   ns: str | None = None) -> tuple[int, str, int] | tuple[()] | None:
        """The process of these cgroups (and pid namespace `ns`, when given)
        whose own pid is `claimed`, as `_pid_within` answers."""
        candidates = [(p, cp, cc) for cp, cc in cgroups for p in self._cgroups.pids(cp)]
        matches = []
        for p, cp, cc in candidates:
            nsp = ns_pids(self._proc, p)
            if nsp and nsp[-1] == claimed and (ns is None or _pid_ns(self._proc, p) == ns):
                matches.append((p, cp, cc))
        if not matches:
            return None
        if len({cc for _, _, cc in matches}) > 1:
            return ()
        return min(matches)

    def _cgroups_under(self, path: str) -> list[tuple[str, int]]:
        prefix = path.rstrip("/") + "/"
        out = [(path, cgid) for cgid, p in self._cgroups.known().items() if p == path or p.startswith(prefix)]
        return out or [(path, self._cgroups.id_of(path) or 0)]

    # --- trusted relays ----------------------------------------------------

    def _pod_of(self, sender: _Sender) -> PodInfo | None:
        uid = sender.pod_uid
        if uid is None:
            ref = parse_kubepods_path(sender.cgroups[0][0])
            uid = ref.pod_uid if ref is not None else None
        return self._pods.get(uid) if uid is not None and self._pods is not None else None

    def _is_relay(self, sender: _Sender) -> bool:
        relays = self._relays
        if not relays:
            return False
        cgid = sender.cgroups[0][1]
        service = self._service_of(cgid)
        pod = self._pod_of(sender) if any(r.k8s_namespace for r, _ in relays) else None
        for rule, cgroup_re in relays:
            if rule.service is not None and not fnmatch.fnmatchcase(service, rule.service):
                continue
            if cgroup_re is not None and not any(cgroup_glob_matches(cgroup_re, p) for p, _ in sender.cgroups):
                continue
            if rule.pid is not None and rule.pid != sender.pid and not any(
                    rule.pid in self._cgroups.pids(p) for p, _ in sender.cgroups):
                continue
            if rule.k8s_namespace is not None and (pod is None or pod.namespace != rule.k8s_namespace):
                continue
            if rule.k8s_service_account is not None and (pod is None or
                                                         pod.service_account != rule.k8s_service_account):
                continue
            return True
        return False

    def _relayed(self, resource: Mapping[str, Any]) -> SpanOrigin:
        """The origin a trusted relay vouches for: cgroups named by the pod or
        container, a pid narrowing within them; or a pid of this host."""
        ignored: list[str] = []
        cgroups: list[tuple[str, int]] | None = None
        how = ""
        uid, ip = resource.get("k8s.pod.uid"), resource.get("k8s.pod.ip")
        if isinstance(uid, str) and uid.strip():
            cgroups, how = self._fresh(lambda: self._pod_containers(uid.strip())), "k8s.pod.uid"
        elif isinstance(ip, str) and ip.strip():
            pod = self._pods.by_ip(ip.strip()) if self._pods is not None else None
            cgroups = self._fresh(lambda: self._pod_containers(pod.uid)) if pod is not None else []
            how = "k8s.pod.ip"
        container = resource.get("container.id")
        if isinstance(container, str) and len(container.strip()) >= 12:
            cid = container.strip().lower()
            if cgroups is None:
                cgroups, how = self._fresh(lambda: self._container_cgroups(cid)), "container.id"
            elif cgroups:
                within = [c for c in cgroups if cid in c[0].rsplit("/", 1)[-1]]
                if within:
                    cgroups = within
                else:
                    ignored.append("container.id")
        attr, claimed = next(((a, p) for a in PID_HINTS if (p := _claimed_pid(resource.get(a))) is not None),
                             (None, None))
        if cgroups is not None:
            if not cgroups:
                return SpanOrigin(None, "unresolved", reason=RELAY_ORIGIN_NOT_FOUND, ignored=tuple(ignored))
            pid = None
            if claimed is not None:
                match = self._pid_among(cgroups, claimed)
                if match is None:
                    ignored.append(attr)
                elif match:
                    pid, path, cgid = match
                    cgroups = [(path, cgid)]
            path, cgid = cgroups[0]
            return SpanOrigin(self._service_of(cgid), "relay:" + how, cgid, pid, ignored=tuple(ignored))
        if claimed is None:
            return SpanOrigin(None, "unresolved", reason=RELAY_NO_ORIGIN)
        here = self._host.judge(resource)
        if here is None:
            return SpanOrigin(None, "unresolved", reason=RELAY_PID_WITHOUT_HOST)
        if not here:
            return SpanOrigin(None, "unresolved", reason=RELAY_OTHER_HOST)
        # The host's process of that pid, if it would report the same pid itself: a
        # process in a pid namespace of its own reports another one (its pod names it).
        own = ns_pids(self._proc, claimed)
        path, cgid = self._cgroup_of(claimed) if own and own[-1] == claimed else (None, None)
        if cgid is None:
            return SpanOrigin(None, "unresolved", reason=RELAY_ORIGIN_NOT_FOUND)
        return SpanOrigin(self._service_of(cgid), "relay:" + attr, cgid, claimed)

    def _container_cgroups(self, cid: str) -> list[tuple[str, int]]:
        """Cgroups of the container `cid` (a full id or a prefix of 12 or more
        characters): kubepods containers, docker-<id>.scope, libpod-<id>.scope, /docker/<id>."""
        return sorted((path, cgid) for cgid, path in self._cgroups.known().items()
                      if cid in path.rsplit("/", 1)[-1])

    def _fresh(self, find: Callable[[], list[tuple[str, int]]]) -> list[tuple[str, int]]:
        """`find()` over the known cgroups; when it finds nothing, once more
        after a rescan (at most once a second): a pod started a moment ago."""
        found = find()
        rescan = getattr(self._cgroups, "rescan", None)
        now = self._clock()
        if not found and rescan is not None and now - self._rescanned >= 1.0:
            self._rescanned = now
            rescan()
            found = find()
        return found


def describe_peer(peer: Peer | None) -> str:
    if peer is None:
        return "an unknown peer"
    return f"[{peer.host}]:{peer.port}" if ":" in peer.host else f"{peer.host}:{peer.port}"


def unresolved_hint(reason: str) -> str:
    """What the operator can do about spans unresolved for `reason`."""
    return {
        NO_PEER: "the transport gave no peer address; send spans over TCP",
        REMOTE_PEER: "the sender is neither a process on this host nor a pod of this node (with pods, the "
                     "agent needs the pod watcher); point the server at the agent on its own node",
        SOCKET_NOT_FOUND: "its socket is not in the agent's network namespace; run the agent in the host's "
                          "network namespace (hostNetwork: true)",
        NO_PROCESS: "no visible process holds its socket; run the agent in the host's pid namespace "
                    "(hostPID: true), and give it CAP_SYS_PTRACE if the sender runs as another user "
                    "(its /proc/PID/fd is unreadable otherwise)",
        NO_CGROUP: "its cgroup is not under the agent's cgroup2 mount; mount the host's cgroup2 tree",
        RELAY_NO_ORIGIN: "the relay vouched for no origin; have it add k8s.pod.uid (the Collector's "
                         "k8sattributes processor) or process.pid with host.name (resourcedetection)",
        RELAY_ORIGIN_NOT_FOUND: "the pod, container or process the relay names is not on this node; send each "
                                "node's spans through a relay on that node (a DaemonSet collector)",
        RELAY_OTHER_HOST: "the relay names a process of another host; send each node's spans through a relay "
                          "on that node",
        RELAY_PID_WITHOUT_HOST: "a pid alone names no process; have the relay add host.name or host.id "
                                "(the Collector's resourcedetection processor), or k8s.pod.uid",
    }.get(reason, "see the agent's documentation")

