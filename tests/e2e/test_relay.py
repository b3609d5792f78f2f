"""Spans through a real OpenTelemetry Collector: vLLM -> collector -> slatrace,
and (the last test) vLLM -> slatrace -> collector.

The collector is PyPI's `rotel` (a Rust OTLP collector, pinned in the test
extras), run inside a service cgroup of its own and trusted with `--otlp-relay
service=...`; a second rotel in another cgroup is not trusted. The servers are
the stand-in vLLM (tests/support/inference_server.py), whose tracing is vLLM's
own `init_tracer` (tests/support/vllm_tracing.py): what it sends beside the
SDK's default resource comes from the environment the OpenTelemetry SDK reads,
as an operator would set it for vLLM —

- `OTEL_EXPERIMENTAL_RESOURCE_DETECTORS=otel,process,host`: the SDK's process
  and host detectors add `process.pid`, `host.name`, `host.id`;
- `OTEL_RESOURCE_ATTRIBUTES=k8s.pod.uid=...`: the downward-API way to name
  the pod.

In a real cluster the Collector's k8sattributes and resourcedetection
processors add the same attributes to what it relays; rotel relays them as
they come. No kubelet runs here, so the "pod" is a cgroup tree shaped as the
kubelet's systemd driver makes it (kubepods.slice/.../pod<uid>.slice/
cri-containerd-<id>.scope) below the test's own cgroup.

Each span must land on the service that sent it; claims coming through the
untrusted collector are the collector's own and counted as ignored; spans the
trusted collector vouches nothing for, or names a pod not on this node for,
are unknown and counted by reason, in /metrics and in /api/v1/spans.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.support import needs_kernel
from agent.traces.spans import attributes
from tests.support.agent import Agent, free_port, http_get, wait_for_requests
from tests.support.otlp_receiver import OtlpReceiver
from tests.support.vllm_tracing import server_env
from tests.support.workload import TestCgroup

pytestmark = pytest.mark.e2e

SERVER = Path(__file__).resolve().parents[1] / "support" / "inference_server.py"
TAG = os.getpid()


def rotel_binary() -> Path:
    import rotel
    path = Path(rotel.__file__).parent / "rotel-agent"
    assert path.is_file(), f"{path} is missing: reinstall the test extras (make setup with SLATRACE_SETUP_TEST=1)"
    return path


def start_collector(cg: TestCgroup, workdir: Path, agent_grpc: int) -> tuple[subprocess.Popen, int, int]:
    """rotel inside `cg`, exporting to an OTLP/gRPC receiver on this port (the
    agent's); (process, gRPC port, HTTP port)."""
    grpc_port, http_port = free_port(), free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    proc = cg.spawn([str(rotel_binary()), "start", "--otlp-grpc-endpoint", f"127.0.0.1:{grpc_port}",
                     "--otlp-http-endpoint", f"127.0.0.1:{http_port}", "--exporter", "otlp",
                     "--otlp-exporter-endpoint", f"http://127.0.0.1:{agent_grpc}",
                     "--pid-file", str(workdir / "rotel.pid"), "--log-file", str(workdir / "rotel.log")],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    for port in (grpc_port, http_port):
        while True:
            assert proc.poll() is None, f"rotel exited with {proc.returncode}"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "rotel does not listen"
                time.sleep(0.1)
    return proc, grpc_port, http_port


def serve(cg: TestCgroup, endpoint: str, prefix: str, env: dict[str, str], child: str = "",
          release: str = "0.15") -> subprocess.Popen:
    return cg.spawn([sys.executable, str(SERVER), "--otlp-traces-endpoint", endpoint, "--release", release,
                     "--requests", "3", "--prefill", "20000", "--decode", "20000", "--decode-steps", "2",
                     "--queue-ms", "1", "--prefix", prefix,
                     # Up while its spans travel: a pid is only found while its process lives.
                     "--linger-s", "6"], child=child,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def request_ids(proc: subprocess.Popen) -> list[str]:
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err
    return [json.loads(line)["request_id"] for line in out.splitlines() if "request_id" in line]


def metric(text: str, name: str, label: str) -> float:
    for line in text.splitlines():
        if line.startswith(f"{name}{{{label}}} "):
            return float(line.split()[-1])
    return 0.0


@pytest.fixture(scope="module")
def scene(tmp_path_factory):
    needs_kernel()
    tmp = tmp_path_factory.mktemp("relay")
    config = tmp / "slatrace.yaml"
    # Each test cgroup (TestCgroup names them /slatrace-test-NAME-PID-*) a service; the pod's below its own.
    services = {"app-host": "app-host-{}-*", "app-pod": "app-pod-{}-*/**", "otel-relay": "relay-{}-*",
                "rogue-relay": "rogue-{}-*"}
    config.write_text("services:\n" + "".join(f'  - name: {name}\n    cgroup: "/slatrace-test-{glob.format(TAG)}"\n'
                                              for name, glob in services.items()))
    pod_uid = str(uuid.uuid4())
    pod_cgroup = (f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{pod_uid.replace('-', '_')}.slice/"
                  f"cri-containerd-{secrets.token_hex(32)}.scope")
    agent_grpc = free_port()
    # The flag, as an operator starts the agent; the config key is the same rule (tests/unit/test_span_relays.py).
    with Agent("--otlp-grpc-listen", f"127.0.0.1:{agent_grpc}", "--otlp-relay", "service=otel-relay",
               config=config, interval=0.5) as agent, \
            TestCgroup("relay") as relay_cg, TestCgroup("rogue") as rogue_cg, \
            TestCgroup("app-host") as host_cg, TestCgroup("app-pod") as pod_cg:
        trusted, t_grpc, t_http = start_collector(relay_cg, tmp / "trusted", agent_grpc)
        rogue, r_grpc, _ = start_collector(rogue_cg, tmp / "rogue", agent_grpc)
        detectors = {"OTEL_EXPERIMENTAL_RESOURCE_DETECTORS": "otel,process,host"}
        runs = {
            # process.pid + host.name/host.id through the trusted collector, over gRPC.
            "pid": serve(host_cg, f"http://127.0.0.1:{t_grpc}", f"pid-{TAG}", server_env(**detectors)),
            # A pod's uid (vLLM 0.16, which adds vllm.process_id), over OTLP/HTTP to the collector.
            "pod": serve(pod_cg, f"http://127.0.0.1:{t_http}/v1/traces", f"pod-{TAG}",
                         server_env("http/protobuf", OTEL_RESOURCE_ATTRIBUTES=f"k8s.pod.uid={pod_uid}"),
                         child=pod_cgroup, release="0.16"),
            # The same claims through the collector nobody trusts.
            "rogue": serve(host_cg, f"http://127.0.0.1:{r_grpc}", f"rogue-{TAG}", server_env(**detectors)),
            # vLLM as it ships (no origin attributes) through the trusted collector.
            "bare": serve(host_cg, f"http://127.0.0.1:{t_grpc}", f"bare-{TAG}", server_env()),
            # A pod of another node.
            "elsewhere": serve(host_cg, f"http://127.0.0.1:{t_grpc}", f"elsewhere-{TAG}",
                               server_env(OTEL_RESOURCE_ATTRIBUTES=f"k8s.pod.uid={uuid.uuid4()}")),
        }
        sent = {name: request_ids(proc) for name, proc in runs.items()}
        got = wait_for_requests(agent, {rid for ids in sent.values() for rid in ids}, timeout=60)
        metrics = http_get(agent.url + "/metrics", timeout=30)[1].decode()
        spans = agent.get_json("/api/v1/spans")
        assert trusted.poll() is None and rogue.poll() is None
        yield sent, got, metrics, spans


def test_every_span_lands_on_the_service_that_sent_it(scene):
    sent, got, *_ = scene
    missing = {rid for ids in sent.values() for rid in ids} - set(got)
    assert not missing, f"not received through the collectors: {sorted(missing)}"
    assert all(len(ids) == 3 for ids in sent.values())
    assert {(got[r]["service"], got[r]["service_from"]) for r in sent["pid"]} == {("app-host", "relay:process.pid")}
    assert {(got[r]["service"], got[r]["service_from"]) for r in sent["pod"]} == {("app-pod", "relay:k8s.pod.uid")}


def test_an_untrusted_collector_is_only_itself_and_its_claims_are_counted(scene):
    sent, got, metrics, spans = scene
    assert {(got[r]["service"], got[r]["service_from"]) for r in sent["rogue"]} == {("rogue-relay", "connection")}
    # Counted per resource of each export; the SDK and rotel batch, so at least one.
    assert metric(metrics, "slatrace_otlp_claims_ignored_total", 'attribute="process.pid"') >= 1
    assert spans["claims_ignored"].get("process.pid", 0) >= 1


def test_unknown_origins_are_counted_not_guessed(scene):
    sent, got, metrics, spans = scene
    for name in ("bare", "elsewhere"):
        assert {(got[r]["service"], got[r]["service_from"], got[r]["sched"]) for r in sent[name]} == \
            {("unknown", "unresolved", None)}
    for reason, name in (("relay_no_origin", "bare"), ("relay_origin_not_found", "elsewhere")):
        assert metric(metrics, "slatrace_otlp_spans_unresolved_total", f'reason="{reason}"') == len(sent[name])
        assert spans["unresolved"][reason] == len(sent[name])
    assert spans["relays"] == [{"service": "otel-relay"}]


def test_the_agent_forwards_enriched_spans_through_a_real_collector(tmp_path):
    """vLLM -> slatrace -> collector: the agent's --otlp-endpoint is rotel,
    which exports on to a test OTLP receiver; every request span arrives there
    with the agent's `slatrace.service`."""
    needs_kernel()
    config = tmp_path / "slatrace.yaml"
    config.write_text(f'services:\n  - name: app-fwd\n    cgroup: "/slatrace-test-app-fwd-{TAG}-*"\n')
    agent_grpc = free_port()
    with OtlpReceiver(http_enabled=False) as sink, TestCgroup("collector-out") as out_cg, \
            TestCgroup("app-fwd") as app_cg:
        collector, c_grpc, _ = start_collector(out_cg, tmp_path / "out", sink.grpc_port)
        with Agent("--otlp-grpc-listen", f"127.0.0.1:{agent_grpc}", "--otlp-endpoint", f"http://127.0.0.1:{c_grpc}",
                   config=config, interval=0.5):
            sent = set(request_ids(serve(app_cg, f"http://127.0.0.1:{agent_grpc}", f"fwd-{TAG}", server_env())))

            def arrived(received) -> dict[str, dict]:
                return {a["gen_ai.request.id"]: a for r in received for rs in r.request.resource_spans
                        for ss in rs.scope_spans for span in ss.spans if span.name == "llm_request"
                        for a in [attributes(span.attributes)]}
            got = arrived(sink.wait_for_traces(timeout=60, predicate=lambda rx: sent <= set(arrived(rx))))
        assert collector.poll() is None
    assert sent <= set(got), f"not forwarded through the collector: {sorted(sent - set(got))}"
    assert {got[rid]["slatrace.service"] for rid in sent} == {"app-fwd"}


def test_a_relay_named_by_a_reload_is_trusted_from_then_on(tmp_path):
    """SIGHUP with otlp_relays added: the collector's spans, its own until
    then, take the origin it vouches for from the reload on."""
    needs_kernel()
    services = (f'services:\n  - name: app-reload\n    cgroup: "/slatrace-test-app-reload-{TAG}-*"\n'
                f'  - name: relay-reload\n    cgroup: "/slatrace-test-relay-reload-{TAG}-*"\n')
    config = tmp_path / "slatrace.yaml"
    config.write_text(services)
    agent_grpc = free_port()
    env = server_env(OTEL_EXPERIMENTAL_RESOURCE_DETECTORS="otel,process,host")
    with Agent("--otlp-grpc-listen", f"127.0.0.1:{agent_grpc}", config=config, interval=0.5) as agent, \
            TestCgroup("relay-reload") as relay_cg, TestCgroup("app-reload") as app_cg:
        _, c_grpc, _ = start_collector(relay_cg, tmp_path / "relay", agent_grpc)
        before = request_ids(serve(app_cg, f"http://127.0.0.1:{c_grpc}", f"before-{TAG}", env))
        config.write_text(services + "otlp_relays:\n  - service: relay-reload\n")
        agent.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while "otlp_relays 0->1" not in agent.output():
            assert time.monotonic() < deadline, agent.output()
            time.sleep(0.1)
        after = request_ids(serve(app_cg, f"http://127.0.0.1:{c_grpc}", f"after-{TAG}", env))
        got = wait_for_requests(agent, set(before) | set(after), timeout=60)
    assert {(got[r]["service"], got[r]["service_from"]) for r in before} == {("relay-reload", "connection")}
    assert {(got[r]["service"], got[r]["service_from"]) for r in after} == {("app-reload", "relay:process.pid")}
