"""Spans through a trusted relay (an OpenTelemetry Collector): the origin is
what the relay vouches for, everyone else stays known by the connection, and
an origin that names nothing here is counted, never guessed.

A recorded /proc (net/tcp, fds, NSpid, cgroups) stands for the host. No
Kubernetes API server runs here: pods come from recorded `kubectl get pods -o
json` lists in the API's shape (fixtures/k8s/pods.json, and relay-pods.json
with the collectors' pods and their service accounts), fed to the PodIndex the
watcher fills. The real collector in between is tests/e2e/test_relay.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from agent.config import ConfigError, RelayRule, parse_config, relays_from_flags
from agent.identity.kubernetes import PodIndex
from agent.traces.api import SPANS_PATH, request_routes
from agent.traces.identity import (
    RELAY_NO_ORIGIN, RELAY_ORIGIN_NOT_FOUND, RELAY_OTHER_HOST, RELAY_PID_WITHOUT_HOST, Peer, SpanServices, ThisHost,
)
from agent.traces.metrics import TraceCounters
from agent.traces.pipeline import RequestPipeline
from agent.traces.request_store import RequestStore
from agent.traces.spans import iter_spans
from tests.support.fake_host import FakeCgroups, FakeProc, v4

FIXTURES = Path(__file__).parent / "fixtures" / "k8s"
PODS = json.loads((FIXTURES / "pods.json").read_text())["items"] + \
    json.loads((FIXTURES / "relay-pods.json").read_text())["items"]
VLLM_POD = "1d2c3b4a-5e6f-4a8b-9c0d-1e2f3a4b5c6d"
VLLM_CID = "ec8207a3dde607f7867f8f5390915018488b877761306ffd4ef099f9b3ee16a1"
METRICS_CID = "177a7ea3611fe6b138557deaf44941614b66c0ece1766308044c8b65c8ba2123"
SLICE = "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-{}.scope"
AGENT_POD_CID = "9c1e7d2f4a6b8c0e2d4f6a8c0e2b4d6f8a0c2e4f6b8d0a2c4e6f8a0b2c4d6e8f"
GATEWAY_CID = "8b0d6c1e3f5a7b9d1c3e5f7a9b1d3c5e7f9a1b3d5c7e9f1a3b5d7c9e1f3a5b7d"
DEBUG_CID = "7a9c5b0d2e4f6a8c0b2d4e6f8a0c2b4d6e8f0a2c4b6d8e0f2a4c6b8d0e2f4a6c"
PATHS = {
    1: "/", 10: "/vllm.service", 11: "/batch.service", 12: "/otelcol.service",
    13: "/system.slice/docker-" + "d0c4e7" * 10 + "abcd.scope",
    21: SLICE.format(VLLM_POD.replace("-", "_"), VLLM_CID),
    22: SLICE.format(VLLM_POD.replace("-", "_"), METRICS_CID),
    30: SLICE.format("5a6b7c8d_0e1f_4a2b_8c3d_4e5f6a7b8c9d", AGENT_POD_CID),
    31: SLICE.format("6b7c8d9e_1f2a_4b3c_9d4e_5f6a7b8c9d0e", GATEWAY_CID),
    32: SLICE.format("7c8d9e0f_2a3b_4c4d_8e5f_6a7b8c9d0e1f", DEBUG_CID),
}
NAMES = {1: "host", 10: "vllm", 11: "batch", 12: "otelcol", 13: "chat-app", 21: "inference/vllm",
         22: "inference/vllm-metrics", 30: "observability/otel-agent", 31: "observability/otel-gateway",
         32: "default/debug-collector"}
HOST = ThisHost(frozenset({"node-a"}), frozenset({"3d1219c7c4c5404aaa1f6d2a48adfda4"}))
# The collector's own connections: on the host, and from the three collector pods.
OTELCOL = Peer("127.0.0.1", 50000, None, 4317)
BATCH = Peer("127.0.0.1", 50001, None, 4317)
AGENT_POD, GATEWAY_POD, DEBUG_POD = (Peer(f"10.244.1.{n}", 41000, "10.244.1.9", 4317) for n in (50, 51, 52))


@pytest.fixture
def node(tmp_path):
    proc = FakeProc(tmp_path / "proc")
    cgroups = FakeCgroups(dict(PATHS), procs={PATHS[10]: [4242], PATHS[11]: [4300], PATHS[12]: [5000],
                                              PATHS[13]: [6100], PATHS[21]: [9100, 9101], PATHS[22]: [9200],
                                              PATHS[30]: [7000], PATHS[31]: [7100], PATHS[32]: [7200]})
    for pid, cgid in ((4242, 10), (5000, 12), (6100, 13)):
        proc.process(pid, PATHS[cgid], sockets=(70000 + pid,))
    proc.process(4300, PATHS[11], sockets=(74300,))
    proc.process(9100, PATHS[21], nspid=(9100, 1), ns="pid:[4026533001]")
    proc.process(9101, PATHS[21], nspid=(9101, 57), ns="pid:[4026533001]")
    proc.process(9200, PATHS[22], nspid=(9200, 1), ns="pid:[4026533002]")
    proc.connection(v4("127.0.0.1", 50000), v4("127.0.0.1", 4317), 75000)
    proc.connection(v4("127.0.0.1", 50001), v4("127.0.0.1", 4317), 74300)
    pods = PodIndex()
    pods.replace(PODS)

    def services(*relays: RelayRule, host: ThisHost = HOST) -> SpanServices:
        return SpanServices(cgroups, NAMES.__getitem__, lambda: set(NAMES.values()), proc_root=proc.root, pods=pods,
                            relays=relays, host=host)
    return services


def origin(services: SpanServices, peer: Peer, **resource) -> tuple:
    o = services.origin(peer, {k.replace("_", "."): v for k, v in resource.items()})
    return o.service, o.how, o.pid, o.reason, o.ignored


def test_a_relay_on_the_host_vouches_for_a_pid_of_this_host(node):
    services = node(RelayRule(service="otelcol"))
    # The OTel SDK's process and host resource detectors (or the Collector's resourcedetection processor).
    assert origin(services, OTELCOL, process_pid=4242, host_name="node-a") == \
        ("vllm", "relay:process.pid", 4242, None, ())
    assert origin(services, OTELCOL, process_pid=6100, host_id="3D1219C7C4C5404AAA1F6D2A48ADFDA4")[:3] == \
        ("chat-app", "relay:process.pid", 6100)
    # Unknown origins: said with their reason, never the relay's own service.
    assert origin(services, OTELCOL, process_pid=4242)[3] == RELAY_PID_WITHOUT_HOST
    assert origin(services, OTELCOL, process_pid=4242, host_name="node-b")[3] == RELAY_OTHER_HOST
    assert origin(services, OTELCOL, process_pid=31337, host_name="node-a")[3] == RELAY_ORIGIN_NOT_FOUND
    # A host pid whose process lives in a pid namespace of its own (a container) would not report it: not it.
    assert origin(services, OTELCOL, process_pid=9101, host_name="node-a")[3] == RELAY_ORIGIN_NOT_FOUND
    assert origin(services, OTELCOL, service_name="vllm")[:4] == (None, "unresolved", None, RELAY_NO_ORIGIN)


def test_everyone_else_stays_known_by_the_connection(node):
    services = node(RelayRule(service="otelcol"))
    # The same claims from a sender that is no relay: ignored, and said so (counted by the pipeline).
    assert origin(services, BATCH, process_pid=4242, host_name="node-a") == \
        ("batch", "connection", 4300, None, ("process.pid",))
    assert origin(services, BATCH, k8s_pod_uid=VLLM_POD, k8s_pod_ip="10.244.1.17")[4] == \
        ("k8s.pod.uid", "k8s.pod.ip")
    # And with no relay configured, the collector is only itself.
    assert origin(node(), OTELCOL, process_pid=4242, host_name="node-a") == \
        ("otelcol", "connection", 5000, None, ("process.pid",))


@pytest.mark.parametrize("rule, trusted", [
    (RelayRule(service="otel*"), True), (RelayRule(cgroup="/otelcol.service"), True),
    (RelayRule(cgroup="/*.service", service="otelcol"), True), (RelayRule(pid=5000), True),
    (RelayRule(pid=4300), False), (RelayRule(service="otelcol", pid=4300), False),
    (RelayRule(k8s_namespace="observability"), False),   # a host process is in no namespace
])
def test_relay_rules_on_the_host(node, rule, trusted):
    o = node(rule).origin(OTELCOL, {"process.pid": 4242, "host.name": "node-a"})
    assert (o.service == "vllm") is trusted and (o.service == "otelcol") is not trusted


def test_a_relay_pod_vouches_for_pods_and_containers_of_this_node(node):
    services = node(RelayRule(k8s_namespace="observability", k8s_service_account="otel-collector"))
    # The Collector's k8sattributes processor adds k8s.pod.uid (and k8s.pod.ip) to what it relays.
    assert origin(services, AGENT_POD, k8s_pod_uid=VLLM_POD)[:3] == ("inference/vllm", "relay:k8s.pod.uid", None)
    assert origin(services, AGENT_POD, k8s_pod_ip="10.244.1.17")[:2] == ("inference/vllm", "relay:k8s.pod.ip")
    # container.id picks the container of the pod; alone, it finds it anywhere (a Docker host too).
    assert origin(services, AGENT_POD, k8s_pod_uid=VLLM_POD, container_id=METRICS_CID)[0] == \
        "inference/vllm-metrics"
    assert origin(services, AGENT_POD, container_id=METRICS_CID[:12])[:2] == \
        ("inference/vllm-metrics", "relay:container.id")
    assert origin(services, AGENT_POD, container_id="d0c4e7" * 2)[0] == "chat-app"
    # A pid (in the pod's own pid namespace) narrows within the pod; one it has not is ignored, the pod stays.
    assert origin(services, AGENT_POD, k8s_pod_uid=VLLM_POD, process_pid=57)[:3] == \
        ("inference/vllm", "relay:k8s.pod.uid", 9101)
    assert origin(services, AGENT_POD, k8s_pod_uid=VLLM_POD, process_pid=99) == \
        ("inference/vllm", "relay:k8s.pod.uid", None, None, ("process.pid",))
    # A container of another pod than the one named: the pod stands, the container is ignored.
    assert origin(services, AGENT_POD, k8s_pod_uid=VLLM_POD, container_id=AGENT_POD_CID)[::4] == \
        ("inference/vllm", ("container.id",))
    # Pods of other nodes, and IPs no pod has, are unknown origins.
    assert origin(services, AGENT_POD, k8s_pod_uid="0000aaaa-0000-4000-8000-000000000000")[3] == \
        RELAY_ORIGIN_NOT_FOUND
    assert origin(services, AGENT_POD, k8s_pod_ip="10.244.7.7")[3] == RELAY_ORIGIN_NOT_FOUND
    assert origin(services, AGENT_POD, container_id="ffffffffffffffff")[3] == RELAY_ORIGIN_NOT_FOUND


def test_only_the_named_namespace_and_service_account_are_relays(node):
    services = node(RelayRule(k8s_namespace="observability", k8s_service_account="otel-collector"))
    # The gateway runs as "default" and the debug collector in another namespace: claims, not origins.
    for peer, own in ((GATEWAY_POD, "observability/otel-gateway"), (DEBUG_POD, "default/debug-collector")):
        assert origin(services, peer, k8s_pod_uid=VLLM_POD)[::4] == (own, ("k8s.pod.uid",))
    # A namespace alone trusts each of its pods.
    services = node(RelayRule(k8s_namespace="observability"))
    assert origin(services, GATEWAY_POD, k8s_pod_uid=VLLM_POD)[0] == "inference/vllm"
    assert origin(services, DEBUG_POD, k8s_pod_uid=VLLM_POD)[0] == "default/debug-collector"


def test_new_relays_apply_at_once(node):
    services = node()
    assert origin(services, OTELCOL, process_pid=4242, host_name="node-a")[0] == "otelcol"
    services.set_relays((RelayRule(service="otelcol"),))
    assert origin(services, OTELCOL, process_pid=4242, host_name="node-a")[0] == "vllm"


def test_unknown_origins_and_ignored_claims_are_counted_by_the_pipeline(node):
    counters = TraceCounters()
    pipeline = RequestPipeline(Sched(), node(RelayRule(service="otelcol")), (), RequestStore(900), counters)

    def export(*resources: dict) -> ExportTraceServiceRequest:
        """One export of several resources, as a collector batches them, decoded from the wire."""
        req = ExportTraceServiceRequest()
        for resource in resources:
            span = Span(name="llm_request", trace_id=b"\1" * 16, span_id=b"\2" * 8, start_time_unix_nano=10**18,
                        end_time_unix_nano=10**18 + 10**9)
            rs = ResourceSpans(scope_spans=[ScopeSpans(spans=[span, span])])
            rs.resource.attributes.extend(KeyValue(key=k, value=AnyValue(string_value=str(v)))
                                          for k, v in resource.items())
            req.resource_spans.append(rs)
        return ExportTraceServiceRequest.FromString(req.SerializeToString())

    pipeline.ingest(export({"process.pid": 4242, "host.name": "node-b"}, {"service.name": "x"},
                           {"process.pid": 4242, "host.name": "node-a"}), "grpc", OTELCOL)
    pipeline.ingest(export({"k8s.pod.uid": VLLM_POD}), "grpc", BATCH)
    pipeline.process()
    assert counters.unresolved == {RELAY_OTHER_HOST: 2, RELAY_NO_ORIGIN: 2}
    assert counters.claims_ignored == {"k8s.pod.uid": 1}
    assert counters.requests == {"unknown": 4, "vllm": 2, "batch": 2}
    # The API says the same, with the relays in force.
    resp = request_routes(RequestStore(900), counters, lambda: (RelayRule(service="otelcol"),))[SPANS_PATH]({})
    doc = json.loads(resp.body)
    assert (doc["unresolved"], doc["claims_ignored"], doc["relays"]) == \
        ({RELAY_NO_ORIGIN: 2, RELAY_OTHER_HOST: 2}, {"k8s.pod.uid": 1}, [{"service": "otelcol"}])


class Sched:
    def watch(self, service: str) -> None:
        pass

    def covered_until(self) -> float:
        return float("inf")

    def between(self, service, start, end, front=None, phases=()):
        return None


def test_this_host_from_its_files(tmp_path):
    (tmp_path / "1" / "root" / "etc").mkdir(parents=True)
    (tmp_path / "1" / "root" / "etc" / "hostname").write_text("node-a\n")
    (tmp_path / "1" / "root" / "etc" / "machine-id").write_text("ABCDEF0123\n")
    host = ThisHost.read(tmp_path, env={"NODE_NAME": "Gpu-Node-1"})
    assert {"node-a", "gpu-node-1"} <= host.names and "abcdef0123" in host.ids
    assert host.judge({"host.name": "GPU-NODE-1"}) is True and host.judge({"host.id": "abcdef0123"}) is True
    assert host.judge({"host.name": "elsewhere"}) is False and host.judge({"process.pid": 1}) is None


def test_a_reload_changes_the_relays_live():
    from agent.config import Config
    from agent.reload import describe_changes
    assert describe_changes(Config(), Config(otlp_relays=(RelayRule(service="otelcol"),))) == ("otlp_relays 0->1", [])


def test_relay_config_and_flags():
    relays = [{"service": "otel*"}, {"k8s_namespace": "observability", "k8s_service_account": "otel"}]
    config = parse_config({"otlp_relays": relays}, "c.yaml")
    assert config.otlp_relays == (RelayRule(service="otel*"),
                                  RelayRule(k8s_namespace="observability", k8s_service_account="otel"))
    assert relays_from_flags(["cgroup=/otelcol.service,pid=12"]) == (RelayRule(cgroup="/otelcol.service", pid=12),)
    for bad, message in (
        ({"otlp_relays": [{}]}, "c.yaml: otlp_relays[0]: the relay rule has no matcher; add one of service, cgroup, "
                                "pid, k8s_namespace, k8s_service_account"),
        ({"otlp_relays": [{"k8s_service_account": "otel"}]},
         "c.yaml: otlp_relays[0]: a service account is named within its namespace; add k8s_namespace next to "
         "k8s_service_account"),
        ({"otlp_relays": [{"cgroup": "otelcol.service"}]},
         "c.yaml: otlp_relays[0].cgroup: the glob must be an absolute cgroup v2 path, got 'otelcol.service'"),
        ({"otlp_relays": [{"pid": 0}]},
         "c.yaml: otlp_relays[0].pid: expected a process id (a whole number >= 1), got 0"),
    ):
        with pytest.raises(ConfigError) as e:
            parse_config(bad, "c.yaml")
        assert str(e.value) == message
    for flag, message in (
        ("otelcol", "--otlp-relay 'otelcol': expected KEY=VALUE pairs joined by commas, with keys among service, "
                    "cgroup, pid, k8s_namespace, k8s_service_account (e.g. service=otel-collector)"),
        ("name=otelcol", "--otlp-relay 'name=otelcol': unknown key 'name' (known keys: service, cgroup, pid, "
                         "k8s_namespace, k8s_service_account)"),
        ("pid=x", "--otlp-relay 'pid=x': pid: expected a process id (a whole number >= 1), got 'x'"),
    ):
        with pytest.raises(ConfigError) as e:
            relays_from_flags([flag])
        assert str(e.value) == message


def test_each_resource_of_a_batched_export_is_its_own_while_spans_are_walked():
    """A collector sends many resources in one export; the pipeline finds each
    resource's origin once, keyed by the resource: two resources must never
    look the same during the walk (protobuf reuses a freed wrapper's id)."""
    req = ExportTraceServiceRequest()
    for i in range(10):
        rs = req.resource_spans.add()
        rs.resource.attributes.add(key="process.pid", value=AnyValue(int_value=1000 + i))
        rs.scope_spans.add().spans.add(name="llm_request")
    walked = [(id(rs), id(ss), rs.resource.attributes[0].value.int_value)
              for rs, ss, _ in iter_spans(ExportTraceServiceRequest.FromString(req.SerializeToString()))]
    assert len({rs for rs, _, _ in walked}) == len({ss for _, ss, _ in walked}) == 10
    assert [pid for *_, pid in walked] == list(range(1000, 1010))


def test_the_deploy_examples_are_valid_relays():
    """The commented relay in deploy/configmap.yaml and deploy/daemonset.yaml, uncommented, is a working rule."""
    import yaml
    deploy = Path(__file__).resolve().parents[2] / "deploy"
    config = yaml.safe_load((deploy / "configmap.yaml").read_text())["data"]["config.yaml"]
    lines = config.splitlines()
    start = lines.index("# otlp_relays:")
    example = "\n".join(line.removeprefix("# ") for line in lines[start:] if line.startswith("# "))
    rule = RelayRule(k8s_namespace="observability", k8s_service_account="otel-collector")
    assert parse_config(yaml.safe_load(example), "configmap").otlp_relays == (rule,)
    flag = next(line for line in (deploy / "daemonset.yaml").read_text().splitlines() if '"--otlp-relay"' in line)
    assert relays_from_flags([flag.split('"--otlp-relay", "')[1].split('"')[0]]) == (rule,)
