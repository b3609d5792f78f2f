"""The daemon behind a web configuration: a real Prometheus scraping it over
TLS with basic auth (and failing with a wrong password), the CLI talking to
it and to a Prometheus behind its own TLS and basic auth, a bad file refused
before the BPF compile, and a bad file at SIGHUP keeping the old settings."""

from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.support import needs_kernel, require_kernel
from tests.support.agent import REPO, SLATRACE, Agent, free_port
from tests.support.certs import PASSWORD, USER, basic, make_pki

pytestmark = pytest.mark.e2e


class SecureAgent(Agent):
    """`slatrace run --web-config-file`, reached over HTTPS with the PKI's CA."""

    def __init__(self, pki, web: Path, *args: str) -> None:
        super().__init__("--web-config-file", str(web), *args)
        self.url = f"https://localhost:{self.port}"
        self.ctx = ssl.create_default_context(cafile=str(pki.ca))

    def fetch(self, path: str, auth: str | None = basic()) -> tuple[int, bytes]:
        req = urllib.request.Request(self.url + path, headers={"Authorization": auth} if auth else {})
        try:
            with urllib.request.urlopen(req, context=self.ctx, timeout=10) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def ready_now(self) -> bool:
        return self.fetch("/readyz", auth=None)[0] == 200   # the probe needs no credentials


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def cli(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLATRACE_")}
    return subprocess.run(SLATRACE + list(argv), cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**clean, **(env or {})})


def test_a_bad_web_config_refuses_the_start_before_the_bpf_compile(pki, tmp_path):
    bad = tmp_path / "web.yml"
    bad.write_text(yaml.safe_dump({"basic_auth_users": {USER: PASSWORD}}))   # a password where a hash belongs
    t0 = time.monotonic()
    out = cli("run", "--listen", f"127.0.0.1:{free_port()}", "--otlp-grpc-listen", "off",
              "--otlp-http-listen", "off", "--web-config-file", str(bad))
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "is not a bcrypt hash" in lines[0] and str(bad) in lines[0], out.stderr
    assert "Traceback" not in out.stderr and time.monotonic() - t0 < 20
    # The same file named by the config YAML (relative to it).
    (tmp_path / "config.yaml").write_text("web_config_file: web.yml\n")
    out = cli("run", "--listen", f"127.0.0.1:{free_port()}", "--otlp-grpc-listen", "off",
              "--otlp-http-listen", "off", "--config", str(tmp_path / "config.yaml"))
    assert out.returncode != 0 and "is not a bcrypt hash" in out.stderr and len(out.stderr.splitlines()) == 1


def start_prometheus(tmp: Path, jobs: list[dict], web_config: Path | None = None, ca: Path | None = None):
    port = free_port()
    (tmp / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"}, "scrape_configs": jobs}))
    cmd = ["prometheus", f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
           f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]
    if web_config is not None:
        cmd.append(f"--web.config.file={web_config}")
    proc = subprocess.Popen(cmd, stdout=open(tmp / "prometheus.log", "wb"), stderr=subprocess.STDOUT)
    scheme = "https" if web_config else "http"
    url = f"{scheme}://localhost:{port}"
    ctx = ssl.create_default_context(cafile=str(ca)) if ca else None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, (tmp / "prometheus.log").read_text()
        try:
            req = urllib.request.Request(url + "/-/ready", headers={"Authorization": basic()})
            with urllib.request.urlopen(req, context=ctx, timeout=1) as resp:
                if resp.status == 200:
                    return proc, url, ctx
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError("prometheus not ready after 30 s")


def prom_get(url: str, path: str, ctx, **params) -> dict:
    req = urllib.request.Request(f"{url}{path}?{urllib.parse.urlencode(params)}", headers={"Authorization": basic()})
    with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
        return json.loads(resp.read())["data"]


def test_prometheus_scrapes_over_tls_with_basic_auth_and_the_cli_follows(pki, tmp_path):
    needs_kernel()
    if shutil.which("prometheus") is None:
        require_kernel("Debian's prometheus package is not installed (SLATRACE_SETUP_TEST=1 scripts/setup.sh)")
    password_file = tmp_path / "password"
    password_file.write_text(PASSWORD + "\n")
    wrong_file = tmp_path / "wrong"
    wrong_file.write_text("not-it\n")
    web = pki.web_config()
    with SecureAgent(pki, web) as agent:
        def job(name: str, pw: Path) -> dict:
            return {"job_name": name, "scheme": "https", "static_configs": [{"targets": [f"localhost:{agent.port}"]}],
                    "tls_config": {"ca_file": str(pki.ca)},
                    "basic_auth": {"username": USER, "password_file": str(pw)}}

        proc, url, ctx = start_prometheus(tmp_path, [job("good", password_file), job("wrong", wrong_file)],
                                          web_config=web, ca=pki.ca)
        try:
            deadline = time.monotonic() + 30
            targets = {}
            while time.monotonic() < deadline:
                targets = {t["labels"]["job"]: t for t in prom_get(url, "/api/v1/targets", ctx)["activeTargets"]}
                if targets.get("good", {}).get("health") == "up" and targets.get("wrong", {}).get("health") == "down":
                    break
                time.sleep(0.5)
            assert targets["good"]["health"] == "up", targets
            assert targets["wrong"]["health"] == "down" and "401" in targets["wrong"]["lastError"], targets
            stored = prom_get(url, "/api/v1/query", ctx, query='count({job="good", __name__=~"slatrace_.+"})')
            assert stored["result"] and float(stored["result"][0]["value"][1]) > 10

            # The CLI against the protected agent: flags, environment, and one line when something is missing.
            out = cli("services", "--json", "--agent", agent.url, "--ca-file", str(pki.ca), "--user", USER,
                      "--password-file", str(password_file))
            assert out.returncode == 0, out.stderr
            assert "services" in json.loads(out.stdout)
            out = cli("services", "--json", "--agent", agent.url, env={
                "SLATRACE_CA_FILE": str(pki.ca), "SLATRACE_USER": USER, "SLATRACE_PASSWORD": PASSWORD})
            assert out.returncode == 0, out.stderr
            for argv, says in (
                    ((), "give the CA that signed it with --ca-file"),
                    (("--ca-file", str(pki.ca)), "asks for credentials: give --user and --password-file"),
                    (("--ca-file", str(pki.ca), "--user", USER, "--password-file", str(wrong_file)),
                     f"refused the credentials of user '{USER}'"),
                    (("--ca-file", str(pki.ca), "--user", USER), "has no password"),
            ):
                out = cli("services", "--agent", agent.url, *argv)
                assert out.returncode == 2 and len(out.stderr.splitlines()) == 1 and says in out.stderr, \
                    (argv, out.stderr)
            out = cli("services", "--agent", f"http://localhost:{agent.port}")
            assert out.returncode == 2 and "use an https:// URL" in out.stderr, out.stderr

            # attribution --prometheus against a Prometheus behind TLS and basic auth. An increase needs two
            # scrapes that saw the counters move, which a loaded machine may not have had yet.
            deadline = time.monotonic() + 30
            while True:
                out = cli("attribution", "--json", "--since", "30", "--prometheus", url, "--ca-file", str(pki.ca),
                          "--user", USER, "--password-file", str(password_file))
                assert out.returncode == 0, out.stderr
                if json.loads(out.stdout)["attribution"] or time.monotonic() > deadline:
                    break
                time.sleep(1)
            assert json.loads(out.stdout)["attribution"]
            out = cli("attribution", "--since", "30", "--prometheus", url, "--ca-file", str(pki.ca))
            assert out.returncode == 2 and f"Prometheus at {url} asks for credentials" in out.stderr, out.stderr
        finally:
            proc.terminate()
            proc.wait(10)


def test_a_bad_file_at_sighup_keeps_the_old_settings(pki, tmp_path):
    needs_kernel()
    web = tmp_path / "web.yml"
    for name in ("server.crt", "server.key"):
        (tmp_path / name).write_bytes((pki.dir / name).read_bytes())
    good = yaml.safe_load(pki.web_config().read_text())
    web.write_text(yaml.safe_dump(good))
    with SecureAgent(pki, web) as agent:
        assert agent.fetch("/api/v1/services")[0] == 200
        web.write_text(yaml.safe_dump({**good, "basic_auth_users": {USER: PASSWORD}}))
        agent.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 15
        while "web config reload (SIGHUP) failed" not in agent.output() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "keeping the settings in force" in agent.output()
        assert agent.fetch("/api/v1/services")[0] == 200     # the old users still get in
        metrics = agent.fetch("/metrics")[1].decode()
        assert "slatrace_web_config_last_reload_successful 0.0" in metrics
        assert 'slatrace_web_config_reloads_total{outcome="failure"} 1.0' in metrics
        # A good file again (a new user), by SIGHUP: in force at once.
        web.write_text(yaml.safe_dump({**good, "basic_auth_users": {"grafana": good["basic_auth_users"][USER]}}))
        agent.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 15
        while agent.fetch("/api/v1/services", basic("grafana"))[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert agent.fetch("/api/v1/services", basic("grafana"))[0] == 200
        assert agent.fetch("/api/v1/services")[0] == 401
        assert "slatrace_web_config_last_reload_successful 1.0" in agent.fetch("/metrics", basic("grafana"))[1].decode()
