"""TLS, client certificates and basic auth on the agent's servers, from an
exporter-toolkit web configuration: certificates made by the openssl CLI at
test time, real clients (urllib/ssl, curl, grpc, the OpenTelemetry SDK
exporters) against the real servers."""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from prometheus_client.registry import CollectorRegistry

from agent.api.routes import AgentState, Api
from agent.api.server import HttpServer
from agent.config import Config, Slo
from agent.export.prometheus import Registry
from agent.export.servers import ServerCollector
from agent.store.store import Store
from agent.traces.metrics import TraceCounters
from agent.traces.otlp_decode import Limits
from agent.traces.pipeline import RequestPipeline
from agent.traces.receiver_grpc import GrpcReceiver
from agent.traces.receiver_http import HttpReceiver
from agent.traces.request_store import RequestStore
from agent.transport import access as access_module
from agent.transport.access import WebAccess
from agent.transport.web_config import WebConfigError, load_web_config
from tests.support.certs import PASSWORD, USER, basic, hash_password, make_cert, make_pki
from tests.unit.test_receivers import FakeSched, own_services, send_requests, wait_for


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def api_server(access: WebAccess | None) -> HttpServer:
    api = Api(AgentState(Config(), Store(60), CollectorRegistry(), lambda: [{"name": "vllm"}]))
    srv = HttpServer("127.0.0.1", 0, api, access=access)
    srv.start()
    return srv


def get(url: str, ctx: ssl.SSLContext | None = None, auth: str | None = None) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": auth} if auth else {})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def client_ctx(pki, cert: tuple[Path, Path] | None = None, **kw) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    if cert:
        ctx.load_cert_chain(*map(str, cert))
    for k, v in kw.items():
        setattr(ctx, k, v)
    return ctx


# --- the file -----------------------------------------------------------------

@pytest.mark.parametrize("doc, says", [
    ({"basic_auth_users": {"alice": "hunter2"}}, "the password of 'alice' is not a bcrypt hash"),
    ({"tls_server_config": {"cert_file": "missing.crt", "key_file": "server.key"}}, "cannot read cert_file"),
    ({"tls_server_config": {"cert_file": "server.crt"}}, "key_file is required"),
    ({"tls_server_config": {"cert_file": "server.crt", "key_file": "server.key", "min_versoin": "TLS13"}},
     "unknown key 'min_versoin'"),
    ({"basic_auth_user": {}}, "unknown key 'basic_auth_user'"),
    ({"tls_server_config": {"cert_file": "server.crt", "key_file": "client.key"}},
     "are not a PEM certificate and its private key"),
    ({"tls_server_config": {"cert_file": "server.crt", "key_file": "server.key",
                            "client_auth_type": "RequireAndVerifyClientCert"}}, "needs client_ca_file"),
    ({"tls_server_config": {"cert_file": "server.crt", "key_file": "server.key",
                            "client_auth_type": "RequireAnyClientCert", "client_ca_file": "ca.crt"}},
     "without verifying it"),
    ({"tls_server_config": {"cert_file": "server.crt", "key_file": "server.key", "min_version": "TLS13",
                            "max_version": "TLS12"}}, "max_version TLS12 is below min_version TLS13"),
    ({"tls_server_config": {"cert_file": "server.crt", "key_file": "server.key",
                            "cipher_suites": ["TLS_RSA_WITH_RC4_128_SHA"]}}, "unknown suite"),
    ({"http_server_config": {"headers": {"Server": "x"}}}, "'Server' cannot be set"),
    ({"http_server_config": {"headers": {"X-Frame-Options": "allow"}}}, "must be one of deny, sameorigin"),
])
def test_a_bad_file_is_refused_whole_with_one_sentence(pki, doc, says):
    path = pki.dir / "bad.yml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(WebConfigError) as e:
        load_web_config(str(path))
    message = str(e.value)
    assert says in message, message
    assert message.startswith(str(path)) and "\n" not in message


@pytest.mark.parametrize("prefix", ["$2a$", "$2b$", "$2y$"])
def test_every_htpasswd_bcrypt_prefix_is_accepted(pki, prefix):
    path = pki.dir / "users.yml"
    path.write_text(yaml.safe_dump({"basic_auth_users": {USER: hash_password(PASSWORD, prefix)}}))
    auth = WebAccess(str(path)).auth
    assert auth.verify(basic()) and not auth.verify(basic(password="nope"))
    assert not auth.verify(basic(user="mallory")) and not auth.verify(None) and not auth.verify("Bearer x")


# --- the API server -----------------------------------------------------------

def test_https_with_basic_auth_and_open_probes(pki):
    web = pki.web_config()
    doc = yaml.safe_load(web.read_text())
    doc["http_server_config"] = {"headers": {"Strict-Transport-Security": "max-age=31536000",
                                             "X-Content-Type-Options": "nosniff"}}
    web.write_text(yaml.safe_dump(doc))
    srv = api_server(WebAccess(str(web)))
    base = f"https://localhost:{srv.port}"
    ctx = client_ctx(pki)
    try:
        status, headers, body = get(base + "/api/v1/services", ctx)
        assert status == 401 and headers["WWW-Authenticate"].startswith("Basic ")
        assert "credentials missing" in json.loads(body)["error"]
        assert get(base + "/metrics", ctx, basic(password="wrong"))[0] == 401
        status, headers, body = get(base + "/api/v1/services", ctx, basic())
        assert status == 200 and json.loads(body) == {"services": [{"name": "vllm"}]}
        assert headers["Strict-Transport-Security"] == "max-age=31536000"
        assert headers["X-Content-Type-Options"] == "nosniff"
        # The kubelet's probes need no credentials and learn nothing but the state.
        assert get(base + "/livez", ctx)[:1] == (200,)
        assert get(base + "/readyz", ctx)[0] == 503
        # curl, as an operator would.
        out = subprocess.run(["curl", "-sS", "--cacert", str(pki.ca), "-u", f"{USER}:{PASSWORD}",
                              base + "/api/v1/services"], capture_output=True, text=True, timeout=30)
        assert json.loads(out.stdout) == {"services": [{"name": "vllm"}]}, out.stderr
        # Clear text gets a failed handshake, never an HTTP answer.
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            s.sendall(b"GET /api/v1/services HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = s.recv(1024)
        assert not answer.startswith(b"HTTP"), answer
        wait_for(lambda: srv.stats.tls_failures == 1)
        assert srv.stats.unauthorized == 2
    finally:
        srv.stop()


def test_min_version_tls13_refuses_a_tls12_client(pki):
    srv = api_server(WebAccess(str(pki.web_config("tls13.yml", users=False, min_version="TLS13"))))
    try:
        old = client_ctx(pki, maximum_version=ssl.TLSVersion.TLSv1_2)
        with pytest.raises(urllib.error.URLError) as e:
            get(f"https://localhost:{srv.port}/livez", old)
        assert isinstance(e.value.reason, ssl.SSLError)
        new = client_ctx(pki, minimum_version=ssl.TLSVersion.TLSv1_3)
        assert get(f"https://localhost:{srv.port}/livez", new)[0] == 200
        # ... and the other way round: max_version TLS12 serves a TLS 1.2 client only.
    finally:
        srv.stop()
    srv = api_server(WebAccess(str(pki.web_config("tls12.yml", users=False, max_version="TLS12",
                                                   cipher_suites=["TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256"]))))
    try:
        with socket.create_connection(("localhost", srv.port)) as raw, \
                client_ctx(pki).wrap_socket(raw, server_hostname="localhost") as tls:
            assert tls.version() == "TLSv1.2" and tls.cipher()[0] == "ECDHE-ECDSA-AES128-GCM-SHA256"
    finally:
        srv.stop()


def test_require_and_verify_client_cert(pki):
    srv = api_server(WebAccess(str(pki.web_config("mtls.yml", users=False,
                                                  client_auth="RequireAndVerifyClientCert"))))
    url = f"https://localhost:{srv.port}/api/v1/services"
    try:
        assert get(url, client_ctx(pki, pki.client))[0] == 200
        for cert in (None, pki.stranger):   # none, or one from another CA
            with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
                get(url, client_ctx(pki, cert))
        wait_for(lambda: srv.stats.tls_failures == 2)
    finally:
        srv.stop()


def test_certificate_rotation_serves_new_handshakes_and_keeps_connections(pki, tmp_path, monkeypatch):
    """cert-manager rewrites the files under a running agent: the watcher
    picks them up, a kept-alive connection goes on, new ones see the new certificate."""
    monkeypatch.setattr(access_module, "WATCH_S", 0.1)
    d = tmp_path
    for name in ("ca.crt", "ca.key", "server.crt", "server.key"):
        (d / name).write_bytes((pki.dir / name).read_bytes())
    web = d / "web.yml"
    web.write_text(yaml.safe_dump({"tls_server_config": {"cert_file": "server.crt", "key_file": "server.key"},
                                   "basic_auth_users": {USER: hash_password(PASSWORD)}}))
    access = WebAccess(str(web))
    access.start()
    srv = api_server(access)
    ctx = client_ctx(pki)

    def served_cert() -> bytes:
        with socket.create_connection(("localhost", srv.port)) as raw, \
                ctx.wrap_socket(raw, server_hostname="localhost") as tls:
            return tls.getpeercert(binary_form=True)

    try:
        before = served_cert()
        kept = http.client.HTTPSConnection("localhost", srv.port, context=ctx, timeout=10)
        kept.request("GET", "/api/v1/services", headers={"Authorization": basic()})
        assert kept.getresponse().read() and True
        make_cert(d, "server", "ca", "serverAuth")   # a new key and certificate, same names
        wait_for(lambda: access.generation == 2, timeout=10)
        # The connection opened before goes on, on its old session.
        kept.request("GET", "/api/v1/services", headers={"Authorization": basic()})
        assert kept.getresponse().status == 200
        assert served_cert() != before
        # A users file with a plain password is refused: the old settings stay, said in a metric.
        web.write_text(yaml.safe_dump({"tls_server_config": {"cert_file": "server.crt", "key_file": "server.key"},
                                       "basic_auth_users": {USER: "plain"}}))
        wait_for(lambda: not access.last_ok, timeout=10)
        assert access.failures == 1 and access.generation == 2
        assert get(f"https://localhost:{srv.port}/api/v1/services", ctx, basic())[0] == 200
        registry = Registry()
        servers = ServerCollector(srv)
        servers.watch_access(access)
        registry.register(servers)
        text = registry.exposition().decode()
        assert "slatrace_web_config_last_reload_successful 0.0" in text
        assert 'slatrace_web_config_reloads_total{outcome="failure"} 1.0' in text
        assert 'slatrace_web_config_reloads_total{outcome="success"} 1.0' in text
        kept.close()
    finally:
        access.shutdown()
        srv.stop()


# --- the OTLP receivers ---------------------------------------------------------

@pytest.fixture
def secure_traces(pki):
    access = WebAccess(str(pki.web_config("otlp.yml")))
    sched = FakeSched()
    counters = TraceCounters()
    store = RequestStore(900)
    pipeline = RequestPipeline(sched, own_services(), (Slo("vllm", request_e2e_p99=0.5),), store, counters,
                               tick_s=0.02)
    limits = Limits(max_body_bytes=256 * 1024, max_decompressed_bytes=1 << 20, max_spans=100)
    grpc_rx = GrpcReceiver("127.0.0.1", 0, pipeline, counters, limits, access=access)
    http_rx = HttpReceiver("127.0.0.1", 0, pipeline, counters, limits, access=access)
    pipeline.start()
    grpc_rx.start()
    http_rx.start()
    yield store, counters, grpc_rx, http_rx
    grpc_rx.stop()
    http_rx.stop()
    pipeline.stop()


def test_otel_sdk_exporters_deliver_over_tls_with_credentials(pki, secure_traces, monkeypatch):
    # requests lets these override the exporter's own CA file (its session's verify).
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    monkeypatch.delenv("CURL_CA_BUNDLE", raising=False)
    store, counters, grpc_rx, http_rx = secure_traces
    creds = grpc.ssl_channel_credentials(pki.ca.read_bytes())
    grpc_ok = GrpcSpanExporter(endpoint=f"localhost:{grpc_rx.port}", credentials=creds,
                               headers={"authorization": basic()})
    http_ok = HttpSpanExporter(endpoint=f"https://localhost:{http_rx.port}/v1/traces",
                               certificate_file=str(pki.ca), headers={"Authorization": basic()})
    send_requests(grpc_ok, ["over-grpc"], 0.2)
    send_requests(http_ok, ["over-http"], 0.2)
    wait_for(lambda: store.get_all("over-grpc") and store.get_all("over-http"))
    assert dict(counters.received) == {"grpc": 1, "http": 1}
    # Without credentials, or with wrong ones: refused and counted, nothing taken in.
    bad_grpc = GrpcSpanExporter(endpoint=f"localhost:{grpc_rx.port}", credentials=creds,
                                headers={"authorization": basic(password="x")}, timeout=5)
    bad_http = HttpSpanExporter(endpoint=f"https://localhost:{http_rx.port}/v1/traces",
                                certificate_file=str(pki.ca), timeout=5)
    for exporter in (bad_grpc, bad_http):
        send_requests(exporter, ["refused"], 0.2)
    channel = grpc.secure_channel(f"localhost:{grpc_rx.port}", creds)
    call = channel.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export")
    with pytest.raises(grpc.RpcError) as e:
        call(b"", timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    channel.close()
    status, headers, _ = get(f"https://localhost:{http_rx.port}/v1/traces", client_ctx(pki))
    assert status == 401 and headers["WWW-Authenticate"].startswith("Basic ")
    assert counters.rejected[("grpc", "unauthorized")] >= 1
    assert counters.rejected[("http", "unauthorized")] >= 1
    # Clear text to the gRPC port: no channel comes up.
    plain = grpc.insecure_channel(f"localhost:{grpc_rx.port}")
    with pytest.raises(grpc.FutureTimeoutError):
        grpc.channel_ready_future(plain).result(timeout=2)
    plain.close()
    assert dict(counters.received) == {"grpc": 1, "http": 1}


def test_grpc_receiver_requires_a_client_certificate_from_the_ca(pki):
    access = WebAccess(str(pki.web_config("otlp-mtls.yml", users=False, client_auth="RequireAndVerifyClientCert")))
    counters = TraceCounters()
    pipeline = RequestPipeline(FakeSched(), own_services(), (), RequestStore(900), counters, tick_s=0.02)
    rx = GrpcReceiver("127.0.0.1", 0, pipeline, counters, access=access)
    rx.start()
    try:
        def ready(cert) -> bool:
            kw = {"private_key": cert[1].read_bytes(), "certificate_chain": cert[0].read_bytes()} if cert else {}
            channel = grpc.secure_channel(f"localhost:{rx.port}",
                                          grpc.ssl_channel_credentials(pki.ca.read_bytes(), **kw))
            try:
                grpc.channel_ready_future(channel).result(timeout=3)
                return True
            except grpc.FutureTimeoutError:
                return False
            finally:
                channel.close()

        assert ready(pki.client)
        assert not ready(None)
        assert not ready(pki.stranger)
    finally:
        rx.stop()


def test_the_grpc_receiver_serves_a_rotated_certificate(pki, tmp_path):
    for name in ("ca.crt", "ca.key", "server.crt", "server.key"):
        (tmp_path / name).write_bytes((pki.dir / name).read_bytes())
    web = tmp_path / "web.yml"
    web.write_text(yaml.safe_dump({"tls_server_config": {"cert_file": "server.crt", "key_file": "server.key"}}))
    access = WebAccess(str(web))
    counters = TraceCounters()
    pipeline = RequestPipeline(FakeSched(), own_services(), (), RequestStore(900), counters, tick_s=0.02)
    rx = GrpcReceiver("127.0.0.1", 0, pipeline, counters, access=access)
    rx.start()
    try:
        def served() -> bytes:
            return ssl.get_server_certificate(("localhost", rx.port), ca_certs=str(pki.ca)).encode()

        before = served()
        make_cert(tmp_path, "server", "ca", "serverAuth")
        assert access.reload("test")
        deadline = time.monotonic() + 10
        while served() == before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert served() != before
    finally:
        rx.stop()


def test_the_grpc_receiver_says_which_tls_settings_it_cannot_apply(pki, caplog):
    access = WebAccess(str(pki.web_config("grpc13.yml", users=False, min_version="TLS13")))
    counters = TraceCounters()
    pipeline = RequestPipeline(FakeSched(), own_services(), (), RequestStore(900), counters, tick_s=0.02)
    rx = GrpcReceiver("127.0.0.1", 0, pipeline, counters, access=access)
    rx.stop()
    said = [r.getMessage() for r in caplog.records if "OTLP/gRPC receiver cannot apply" in r.getMessage()]
    assert len(said) == 1 and "min_version" in said[0] and "grpc13.yml" in said[0]
