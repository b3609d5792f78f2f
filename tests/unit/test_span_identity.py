"""Span -> service from the connection: a recorded /proc (net/tcp, fds, NSpid,
pid namespaces, cgroups) and recorded pod objects, then this very process's
real sockets against the real /proc.

No Kubernetes API server runs here: pods come from the recorded `kubectl get
pods -o json` list (fixtures/k8s/pods.json), fed to the PodIndex the watcher fills.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from agent.identity.cgroups import CgroupPaths
from agent.probe.mounts import find_cgroup2_mount
from agent.identity.kubernetes import PodIndex
from tests.support.fake_host import FakeCgroups, FakeProc, v4, v6
from agent.traces.identity import (
    NO_PEER, NO_PROCESS, REMOTE_PEER, SOCKET_NOT_FOUND, Peer, SpanServices, cgroup_v2_path, ns_pids,
    parse_grpc_peer, tcp_socket_inode,
)

PODS = json.loads((Path(__file__).parent / "fixtures" / "k8s" / "pods.json").read_text())["items"]
VLLM_POD = "1d2c3b4a-5e6f-4a8b-9c0d-1e2f3a4b5c6d"
VLLM_CID = "ec8207a3dde607f7867f8f5390915018488b877761306ffd4ef099f9b3ee16a1"
METRICS_CID = "177a7ea3611fe6b138557deaf44941614b66c0ece1766308044c8b65c8ba2123"
POD_DIR = f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{VLLM_POD.replace('-', '_')}.slice"


NAMES = {10: "vllm", 11: "batch", 1: "host", 20: "k8s-pod", 21: "inference/vllm", 22: "inference/vllm-metrics"}


@pytest.fixture
def host(tmp_path):
    proc = FakeProc(tmp_path / "proc")
    cgroups = FakeCgroups({1: "/", 10: "/vllm.service", 11: "/batch.service", 20: POD_DIR,
                           21: f"{POD_DIR}/cri-containerd-{VLLM_CID}.scope",
                           22: f"{POD_DIR}/cri-containerd-{METRICS_CID}.scope"},
                          procs={"/vllm.service": [4242, 4250]})
    pods = PodIndex()
    pods.replace(PODS)
    services = SpanServices(cgroups, NAMES.__getitem__, lambda: set(NAMES.values()), proc_root=proc.root, pods=pods)
    return proc, cgroups, services


def test_grpc_peer_strings():
    assert parse_grpc_peer("ipv4:127.0.0.1:54321") == ("127.0.0.1", 54321)
    assert parse_grpc_peer("ipv6:[::1]:5432") == ("::1", 5432)
    assert parse_grpc_peer("unix:/run/x.sock") is None
    assert parse_grpc_peer("") is None and parse_grpc_peer(None) is None


def test_cgroup_v2_path_from_proc_pid_cgroup():
    assert cgroup_v2_path("12:cpu,cpuacct:/x\n0::/kubepods.slice/pod-a/cri-containerd-abc.scope\n") == \
        "/kubepods.slice/pod-a/cri-containerd-abc.scope"
    assert cgroup_v2_path("0::/\n") == "/"
    assert cgroup_v2_path("1:name=systemd:/\n") is None


def test_loopback_peer_is_the_process_holding_the_socket(host):
    proc, _, services = host
    proc.process(4242, "/vllm.service", sockets=(70001,))
    proc.process(4300, "/batch.service", sockets=(70002,))
    # Both ends of each connection are listed; only the client's end names the sender.
    proc.connection(v4("127.0.0.1", 54321), v4("127.0.0.1", 4317), 70001)
    proc.connection(v4("127.0.0.1", 4317), v4("127.0.0.1", 54321), 80001)
    proc.connection(v4("127.0.0.1", 54400), v4("127.0.0.1", 4317), 70002)
    o = services.origin(Peer("127.0.0.1", 54321, None, 4317), {"service.name": "unknown_service"})
    assert (o.service, o.how, o.cgroup_id, o.pid, o.ignored) == ("vllm", "connection", 10, 4242, ())
    assert services.origin(Peer("127.0.0.1", 54400, "127.0.0.1", 4317), {}).service == "batch"
    # The agent's local port is part of the key: the same client port toward another port is not ours.
    assert services.origin(Peer("127.0.0.1", 54321, None, 4318), {}).reason == SOCKET_NOT_FOUND


def test_ipv6_and_v4_mapped_peers(host):
    proc, _, services = host
    proc.process(4242, "/vllm.service", sockets=(70003, 70004))
    proc.connection(v6("::1", 40000), v6("::1", 4318), 70003, six=True)
    proc.connection(v6("::ffff:127.0.0.1", 40001), v6("::ffff:127.0.0.1", 4318), 70004, six=True)
    assert services.origin(Peer("::1", 40000, "::1", 4318), {}).service == "vllm"
    assert services.origin(Peer("127.0.0.1", 40001, None, 4318), {}).service == "vllm"


def test_a_claimed_service_name_never_names_the_service(host):
    proc, _, services = host
    proc.process(4300, "/batch.service", sockets=(70002,))
    proc.connection(v4("127.0.0.1", 54400), v4("127.0.0.1", 4317), 70002)
    o = services.origin(Peer("127.0.0.1", 54400, None, 4317), {"service.name": "vllm"})
    assert (o.service, o.ignored) == ("batch", ("service.name",))
    # A claimed pid of another service's process is no better.
    proc.process(4242, "/vllm.service")
    o = services.origin(Peer("127.0.0.1", 54400, None, 4317), {"process.pid": 4242})
    assert (o.service, o.how, o.ignored) == ("batch", "connection", ("process.pid",))


def test_vllm_process_id_in_its_own_pid_namespace(host):
    proc, _, services = host
    # vLLM in its own pid namespace is pid 1 there: the host's init must not win.
    proc.process(1, "/")
    proc.process(4242, "/vllm.service", nspid=(4242, 1), ns="pid:[4026532999]", sockets=(70001,))
    proc.process(4250, "/vllm.service", nspid=(4250, 7), ns="pid:[4026532999]")
    proc.connection(v4("127.0.0.1", 54321), v4("127.0.0.1", 4317), 70001)
    peer = Peer("127.0.0.1", 54321, None, 4317)
    o = services.origin(peer, {"vllm.process_id": "1"})
    assert (o.service, o.how, o.pid, o.ignored) == ("vllm", "vllm.process_id", 4242, ())
    # Another process of the sender's namespace and cgroup narrows to that process.
    o = services.origin(peer, {"vllm.process_id": "7"})
    assert (o.service, o.how, o.pid) == ("vllm", "vllm.process_id", 4250)
    # A pid nobody of the sender has is a contradiction, ignored and reported.
    o = services.origin(peer, {"vllm.process_id": "99"})
    assert (o.service, o.how, o.pid, o.ignored) == ("vllm", "connection", 4242, ("vllm.process_id",))


def test_pod_ip_is_its_pod_and_a_pid_picks_the_container(host):
    proc, cgroups, services = host
    vllm_dir, metrics_dir = cgroups.paths[21], cgroups.paths[22]
    cgroups.procs.update({vllm_dir: [9100, 9101], metrics_dir: [9200]})
    proc.process(9100, vllm_dir, nspid=(9100, 1), ns="pid:[4026533001]")
    proc.process(9101, vllm_dir, nspid=(9101, 57), ns="pid:[4026533001]")
    proc.process(9200, metrics_dir, nspid=(9200, 1), ns="pid:[4026533002]")
    peer = Peer("10.244.1.17", 38000, "10.244.1.1", 4317)
    o = services.origin(peer, {})
    assert (o.service, o.how, o.cgroup_id) == ("inference/vllm", "pod_ip", 21)  # the busiest container
    o = services.origin(peer, {"vllm.process_id": "57"})
    assert (o.service, o.how, o.cgroup_id, o.pid) == ("inference/vllm", "vllm.process_id", 21, 9101)
    # pid 1 is in both containers: ambiguous, so the pod's answer stands, and nothing is contradicted.
    o = services.origin(peer, {"vllm.process_id": "1"})
    assert o.how == "pod_ip" and o.ignored == ()
    o = services.origin(peer, {"container.id": VLLM_CID})
    assert (o.service, o.how, o.cgroup_id) == ("inference/vllm", "container.id", 21)
    # Another pod's uid or container is a contradiction.
    o = services.origin(peer, {"k8s.pod.uid": "9a8b7c6d-1111-4222-8333-444455556666", "container.id": "34fb46c847bb"})
    assert set(o.ignored) == {"k8s.pod.uid", "container.id"}
    # A hostNetwork pod's IP is the node's: not indexed, so not its pod.
    assert services.origin(Peer("192.168.10.5", 38001, None, 4317), {}).reason == REMOTE_PEER
    # The pod goes; its IP is then nobody's, whatever was cached for the connection.
    services._pods.replace([p for p in PODS if p["metadata"]["uid"] != VLLM_POD])
    assert services.origin(peer, {}).reason == REMOTE_PEER


def test_unresolved_reasons(host):
    proc, _, services = host
    assert services.origin(None, {}).reason == NO_PEER
    assert services.origin(Peer("203.0.113.9", 5000, None, 4317), {"service.name": "vllm"}).reason == REMOTE_PEER
    assert services.origin(Peer("127.0.0.1", 5000, None, 4317), {}).reason == SOCKET_NOT_FOUND
    # The socket is listed but no visible process holds it (another pid namespace).
    proc.connection(v4("127.0.0.1", 5001), v4("127.0.0.1", 4317), 70009)
    o = services.origin(Peer("127.0.0.1", 5001, None, 4317), {"process.pid": 4242})
    assert (o.service, o.reason) == (None, NO_PROCESS)


def test_an_agent_in_its_own_network_namespace_finds_host_senders_in_pid_1s_table(host):
    proc, _, services = host
    # A pod with hostPID but its own network: /proc/net is the pod's, /proc/1/net the node's.
    proc.process(4242, "/vllm.service", sockets=(70001,))
    (proc.root / "1" / "net").mkdir(parents=True)
    (proc.root / "self" / "ns").mkdir(parents=True)
    os.symlink("net:[4026532100]", proc.root / "self" / "ns" / "net")
    (proc.root / "1" / "ns").mkdir()
    os.symlink("net:[4026531840]", proc.root / "1" / "ns" / "net")
    # The node process reached the agent through a Service: its socket's remote end is the ClusterIP.
    (proc.root / "1" / "net" / "tcp").write_text(proc.tcp[0] + "\n   0: " + v4("192.168.10.5", 51000) + " " +
                                                  v4("10.96.0.42", 4317) + " 01 00000000:00000000 00:00000000 "
                                                  "00000000     0        0 70001 1 0 20 4 30 10 -1\n")
    o = services.origin(Peer("192.168.10.5", 51000, "10.244.1.9", 4317), {})
    assert (o.service, o.how, o.pid) == ("vllm", "connection", 4242)


def test_a_cached_sender_is_dropped_when_its_socket_closes(host):
    proc, _, services = host
    proc.process(4242, "/vllm.service", sockets=(70001,))
    proc.process(4300, "/batch.service", sockets=(70005,))
    proc.connection(v4("127.0.0.1", 54321), v4("127.0.0.1", 4317), 70001)
    peer = Peer("127.0.0.1", 54321, None, 4317)
    assert services.origin(peer, {}).service == "vllm"
    # The connection closes; another process gets the same port.
    os.unlink(proc.root / "4242" / "fd" / "3")
    proc.tcp[1] = proc.tcp[1].replace(" 70001 ", " 70005 ")
    proc.flush()
    assert services.origin(peer, {}).service == "batch"


def test_ns_pids_reads_nspid(host):
    proc, _, _ = host
    proc.process(4242, "/vllm.service", nspid=(4242, 17, 1))
    assert ns_pids(proc.root, 4242) == (4242, 17, 1)
    assert ns_pids(proc.root, 5) == ()


# --- this process's real sockets ---------------------------------------------------------------

def test_a_real_loopback_connection_resolves_to_this_process(tmp_path):
    mount = find_cgroup2_mount(Path("/proc/mounts").read_text())
    assert mount, "no cgroup2 mount on this machine"
    cgroup2 = Path(mount)
    own = cgroup_v2_path(Path("/proc/self/cgroup").read_text())
    cgroups = CgroupPaths(cgroup2)
    own_id = cgroups.id_of(own)
    services = SpanServices(cgroups, {own_id: "me"}.get, lambda: {"me"})
    for family, addr in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        with socket.socket(family) as listener:
            listener.bind((addr, 0))
            listener.listen()
            client = socket.create_connection((addr, listener.getsockname()[1]))
            server_side, peer = listener.accept()
            with client, server_side:
                local = server_side.getsockname()
                inode = os.fstat(client.fileno()).st_ino
                assert tcp_socket_inode(Path("/proc"), Peer(peer[0], peer[1], local[0], local[1])) == inode
                o = services.origin(Peer(peer[0], peer[1], local[0], local[1]), {"process.pid": os.getpid()})
                assert (o.service, o.how, o.cgroup_id, o.pid) == ("me", "process.pid", own_id, os.getpid())
