"""deploy/ and the Dockerfile, checked offline: every manifest against the
Kubernetes API schemas (oldest and newest that kubernetes-validate ships,
strict), the DaemonSet's least-privilege settings, the agent config, the
dashboards ConfigMap against dashboards/*.json, and the kustomization."""

from __future__ import annotations

import errno
import importlib.util
import json
import re
import shlex
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from kubernetes_validate import utils as kv

from agent.config import parse_config

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DASHBOARDS = REPO / "dashboards"
GENERATOR = REPO / "scripts" / "gen-dashboards-configmap.py"
# Kinds no Kubernetes API schema covers: the Prometheus Operator's, checked by hand below.
CUSTOM_KINDS = {"PodMonitor", "PrometheusRule", "ServiceMonitor"}
KV_VERSIONS = sorted(set(kv.all_versions()), key=lambda v: tuple(int(x) for x in v.split(".")))
OLDEST, NEWEST = KV_VERSIONS[0], KV_VERSIONS[-1]
AGENT_PORT = 9477


def manifest_files() -> list[Path]:
    """Every YAML file under deploy/ holding Kubernetes objects (apiVersion and
    kind), the kustomization itself aside."""
    found = []
    for path in sorted(DEPLOY.rglob("*.y*ml")):
        if path.name == "kustomization.yaml":
            continue
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        if docs and all(isinstance(d, dict) and "apiVersion" in d and "kind" in d for d in docs):
            found.append(path)
    return found


def objects() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p in manifest_files() for d in yaml.safe_load_all(p.read_text()) if d]


def one(kind: str, name: str | None = None) -> dict[str, Any]:
    matches = [d for _, d in objects() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, found {len(matches)}"
    return matches[0]


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_dashboards_configmap", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def daemonset() -> dict[str, Any]:
    return one("DaemonSet", "slatrace")


@pytest.fixture(scope="module")
def container(daemonset: dict[str, Any]) -> dict[str, Any]:
    containers = daemonset["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["slatrace"]
    return containers[0]


# --- schemas ---------------------------------------------------------------

def test_kubernetes_validate_ships_several_versions():
    # The point of validating twice: an old and a new API server both accept it.
    assert OLDEST != NEWEST
    assert tuple(map(int, OLDEST.split("."))) <= (1, 26, 0)


@pytest.mark.parametrize("version", [OLDEST, NEWEST])
def test_every_manifest_validates_strictly(version: str):
    checked = 0
    for path, doc in objects():
        if doc["kind"] in CUSTOM_KINDS:
            continue
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as e:
            pytest.fail(f"{path.name}: {doc['kind']}/{doc['metadata']['name']} is invalid for "
                        f"Kubernetes {version}: {e.message} at {'.'.join(map(str, e.path))}")
        checked += 1
    assert checked >= 8  # Namespace, SA, ClusterRole(Binding), 2 ConfigMaps, DaemonSet, Service


def test_strict_validation_rejects_a_misspelt_field():
    # Proves the schemas above bite: a typo in the pod spec must be refused.
    ds = json.loads(json.dumps(one("DaemonSet", "slatrace")))
    ds["spec"]["template"]["spec"]["hostPid"] = True
    with pytest.raises(kv.ValidationError):
        kv.validate(ds, NEWEST, strict=True)


def test_podmonitor_required_fields(container: dict[str, Any], daemonset: dict[str, Any]):
    pm = one("PodMonitor", "slatrace")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    spec = pm["spec"]
    # The operator requires a selector and the endpoints list.
    assert spec["selector"]["matchLabels"].items() <= daemonset["spec"]["template"]["metadata"]["labels"].items()
    endpoints = spec["podMetricsEndpoints"]
    assert endpoints
    port_names = {p["name"] for p in container["ports"]}
    for ep in endpoints:
        assert ep["port"] in port_names
        assert ep.get("path", "/metrics") == "/metrics"
    assert pm["metadata"]["namespace"] in spec["namespaceSelector"]["matchNames"]


def test_prometheus_rules_required_fields():
    rules = [d for _, d in objects() if d["kind"] == "PrometheusRule"]
    if not rules:
        pytest.skip("deploy/prometheus-rules.yaml is not there yet")
    for rule in rules:
        assert rule["apiVersion"] == "monitoring.coreos.com/v1"
        assert rule["metadata"]["name"]
        groups = rule["spec"]["groups"]
        assert groups
        for group in groups:
            assert group["name"] and group["rules"], group
            for r in group["rules"]:
                assert r.get("expr"), r
                assert ("alert" in r) != ("record" in r), f"a rule is an alert or a record: {r}"


# --- the DaemonSet -----------------------------------------------------------

def test_not_privileged_drop_all_add_only_the_measured_set(container: dict[str, Any]):
    sc = container["securityContext"]
    assert sc["privileged"] is False
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    # Measured by tests/e2e/test_capabilities.py: CAP_BPF creates the maps,
    # CAP_PERFMON loads and attaches the tracepoint programs; nothing else.
    assert sc["capabilities"]["add"] == ["BPF", "PERFMON"]


def test_host_access(daemonset: dict[str, Any], container: dict[str, Any]):
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    assert not pod.get("hostNetwork", False)
    assert not pod.get("hostIPC", False)
    volumes = {v["name"]: v for v in pod["volumes"]}
    host_paths = {name: v["hostPath"]["path"] for name, v in volumes.items() if "hostPath" in v}
    assert sorted(host_paths.values()) == ["/lib/modules", "/sys/fs/cgroup", "/sys/kernel/tracing", "/usr/src"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    for name, path in host_paths.items():
        assert mounts[name]["readOnly"] is True, f"hostPath {path} must be mounted read-only"
        # Mounted where the agent and BCC look for them on a host.
        assert mounts[name]["mountPath"] == path
    # Everything else the container can write is scratch space.
    writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
    assert writable == {"/tmp"}
    assert "emptyDir" in volumes[mounts["tmp"]["name"]]


def test_probes_on_the_agent_port(container: dict[str, Any]):
    from agent.api.server import PROBES

    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": AGENT_PORT, "otlp-grpc": 4317, "otlp-http": 4318}
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/livez")):
        get = container[probe]["httpGet"]
        assert get["path"] == path
        # The kubelet sends no credentials: the probes are what the agent serves without them.
        assert path in PROBES and "httpHeaders" not in get
        port = ports[get["port"]] if isinstance(get["port"], str) else get["port"]
        assert port == AGENT_PORT


def test_the_commented_web_config_lines_make_a_valid_daemonset():
    """The lines deploy/daemonset.yaml offers for TLS and basic auth, applied, still validate."""
    text = (DEPLOY / "daemonset.yaml").read_text()
    section = text[text.index("# TLS and basic auth"):text.index("# and set `scheme: HTTPS`")]
    entries: list[str] = []
    for line in section.splitlines():
        body = line.strip().removeprefix("#").rstrip()
        if re.match(r" (args|volumeMounts|volumes):", body):
            entries.append(body.strip())
        elif entries and body.startswith("   "):   # a continuation of the entry above
            entries[-1] += " " + body.strip()
    patch = yaml.safe_load("\n".join(re.sub(r"\s+#.*$", "", e) for e in entries))
    ds = json.loads(json.dumps(one("DaemonSet", "slatrace")))
    pod = ds["spec"]["template"]["spec"]
    container = pod["containers"][0]
    container["args"] = patch["args"]
    container["volumeMounts"] += patch["volumeMounts"]
    pod["volumes"] += patch["volumes"]
    for probe in ("readinessProbe", "livenessProbe"):
        container[probe]["httpGet"]["scheme"] = "HTTPS"
    kv.validate(ds, NEWEST, strict=True)
    path = Path(patch["args"][patch["args"].index("--web-config-file") + 1])
    assert any(path.is_relative_to(m["mountPath"]) for m in patch["volumeMounts"])


def test_resources_env_and_scheduling(daemonset: dict[str, Any], container: dict[str, Any]):
    res = container["resources"]
    for key in ("cpu", "memory"):
        assert res["requests"][key] and res["limits"][key]
    assert res["limits"]["memory"].endswith("Mi") and int(res["limits"]["memory"][:-2]) >= 256
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    pod = daemonset["spec"]["template"]["spec"]
    assert {"operator": "Exists"} in pod["tolerations"]
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["terminationGracePeriodSeconds"] >= 10
    strategy = daemonset["spec"]["updateStrategy"]
    assert strategy["type"] == "RollingUpdate" and strategy["rollingUpdate"]["maxUnavailable"]
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert daemonset["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_service_account_and_rbac(daemonset: dict[str, Any]):
    pod = daemonset["spec"]["template"]["spec"]
    sa = one("ServiceAccount", pod["serviceAccountName"])
    role = one("ClusterRole", "slatrace")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = one("ClusterRoleBinding", "slatrace")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "slatrace"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                    "namespace": sa["metadata"]["namespace"]}]


def test_namespace_allows_the_pod():
    ns = one("Namespace", "slatrace")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    # kustomization.yaml sets the namespace; a manifest that names one must agree.
    for _, doc in objects():
        if doc["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding"):
            assert doc["metadata"].get("namespace", "slatrace") == "slatrace", doc["metadata"]["name"]


def test_service_is_node_local_and_targets_named_ports(container: dict[str, Any], daemonset: dict[str, Any]):
    svc = one("Service", "slatrace")
    spec = svc["spec"]
    assert spec["internalTrafficPolicy"] == "Local"
    assert spec["selector"].items() <= daemonset["spec"]["template"]["metadata"]["labels"].items()
    ports = {p["port"]: p["targetPort"] for p in spec["ports"]}
    assert ports == {4317: "otlp-grpc", 4318: "otlp-http", AGENT_PORT: "http"}
    assert set(ports.values()) <= {p["name"] for p in container["ports"]}


def test_agent_config_parses_and_is_mounted(container: dict[str, Any], daemonset: dict[str, Any]):
    cm = one("ConfigMap", "slatrace-config")
    config = parse_config(yaml.safe_load(cm["data"]["config.yaml"]), "deploy/configmap.yaml")
    assert config.interval == 1 and config.retention == 900
    # The DaemonSet passes --config pointing into the mounted ConfigMap.
    args = container["args"]
    path = Path(args[args.index("--config") + 1])
    mount = next(m for m in container["volumeMounts"] if path.is_relative_to(m["mountPath"]))
    volume = next(v for v in daemonset["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == "slatrace-config"
    assert path.name in cm["data"]


# --- dashboards ConfigMap ----------------------------------------------------

def test_dashboards_configmap_equals_the_json_files():
    files = sorted(DASHBOARDS.glob("*.json"))
    if not files:
        pytest.skip("dashboards/ holds no JSON yet: nothing to compare the ConfigMap with")
    cm = one("ConfigMap", "slatrace-dashboards")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert sorted(cm["data"]) == [f.name for f in files], \
        "run python3 scripts/gen-dashboards-configmap.py"
    for f in files:
        assert cm["data"][f.name].encode("utf-8") == f.read_bytes(), \
            f"{f.name} differs from the ConfigMap: run python3 scripts/gen-dashboards-configmap.py"
    assert load_generator().main(["--check"]) == 0


def test_generator_keeps_awkward_text_exact(tmp_path: Path):
    # Block scalars cannot hold every text; whatever style PyYAML picks, the
    # round trip must give back the same bytes.
    samples = {
        "plain.json": '{\n  "a": 1\n}\n',
        "no-final-newline.json": '{"a": 1}',
        "trailing-blanks.json": '{"a": 1}\n\n\n',
        "leading-indent.json": '   {"a": "x"}\n',
        "trailing-spaces.json": '{"a": "x"}  \n  \n',
        "tabs-unicode.json": '{\n\t"a": "\u00e9 \u2190 \\u0001"\n}\n',
    }
    for name, text in samples.items():
        (tmp_path / name).write_bytes(text.encode("utf-8"))
    gen = load_generator()
    doc = yaml.safe_load(gen.render(gen.dashboard_files(tmp_path)))
    assert doc["data"] == samples


def test_generator_refuses_what_grafana_cannot_load(tmp_path: Path):
    gen = load_generator()
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="broken.json"):
        gen.render(gen.dashboard_files(tmp_path))


# --- kustomization -----------------------------------------------------------

def test_kustomization_lists_every_manifest():
    kust = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    listed = kust["resources"]
    assert len(listed) == len(set(listed)), "a resource is listed twice"
    manifests = {p.relative_to(DEPLOY).as_posix() for p in manifest_files()}
    assert manifests - set(listed) == set(), "manifests missing from kustomization.yaml"
    assert kust["namespace"] == "slatrace"
    # Every listed resource exists (the alert rules are written alongside).
    missing = [r for r in listed if not (DEPLOY / r).exists()]
    assert missing == [], f"kustomization.yaml lists files that do not exist: {missing}"
    image = kust["images"][0]
    container = one("DaemonSet", "slatrace")["spec"]["template"]["spec"]["containers"][0]
    assert image["name"] == container["image"].split(":")[0]


# --- the image ---------------------------------------------------------------

def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (REPO / "Dockerfile").read_text()
    logical = re.sub(r"\\\n\s*", " ", text)
    out = []
    for line in logical.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_uses_the_project_setup_and_runs_the_agent():
    ins = dockerfile_instructions()
    # The base is an argument (tests/container builds on a locally made one).
    assert ins[0] == ("ARG", "BASE_IMAGE=debian:bookworm-slim")
    assert ins[1] == ("FROM", "${BASE_IMAGE}")
    runs = " ".join(rest for word, rest in ins if word == "RUN")
    assert "SLATRACE_SETUP_IMAGE=1 scripts/setup.sh" in runs
    entry = json.loads(next(rest for word, rest in ins if word == "ENTRYPOINT"))
    assert entry[1:] == ["run", "--listen", f"0.0.0.0:{AGENT_PORT}", "--otlp-grpc-listen", "0.0.0.0:4317",
                         "--otlp-http-listen", "0.0.0.0:4318"]
    health = next(rest for word, rest in ins if word == "HEALTHCHECK")
    assert f"127.0.0.1:{AGENT_PORT}/livez" in health
    labels = " ".join(rest for word, rest in ins if word == "LABEL")
    for key in ("title", "description", "version", "licenses"):
        assert f"org.opencontainers.image.{key}=" in labels
    # The entrypoint the image installs as `slatrace` is in the build context.
    assert "scripts/container-entrypoint.sh" in runs
    ignore = (REPO / ".dockerignore").read_text().split()
    assert "!scripts/" in ignore and "!agent/" in ignore and "!bpf/" in ignore


def test_dockerfile_copies_the_code_after_the_dependencies():
    # A change to the code must not rerun apt or pip's dependency install.
    ins = dockerfile_instructions()
    copies = [rest for word, rest in ins if word == "COPY"]
    assert copies[-1].split()[0] == "."
    assert [c.split()[0] for c in copies[:-1]] == ["scripts/setup.sh", "pyproject.toml"]
    last_copy = max(i for i, (word, _) in enumerate(ins) if word == "COPY")
    after = " ".join(rest for word, rest in ins[last_copy:] if word == "RUN")
    assert "setup.sh" not in after and "pip" not in after and "apt" not in after


def test_the_license_the_image_declares_is_shipped():
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    labels = " ".join(rest for word, rest in dockerfile_instructions() if word == "LABEL")
    assert 'org.opencontainers.image.licenses="Apache-2.0"' in labels
    assert "!LICENSE" in (REPO / ".dockerignore").read_text().split()


def test_dockerfile_exposes_what_the_daemonset_uses(container: dict[str, Any]):
    exposed = {int(p) for word, rest in dockerfile_instructions() if word == "EXPOSE" for p in shlex.split(rest)}
    assert exposed == {p["containerPort"] for p in container["ports"]}


# --- the Localhost seccomp profile -----------------------------------------------

SECCOMP = DEPLOY / "seccomp" / "slatrace.json"
UNISTD = Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h")


def _gen_seccomp():
    spec = importlib.util.spec_from_file_location("gen_seccomp", REPO / "scripts" / "gen-seccomp-profile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def seccomp_rules() -> tuple[dict, set[str], list[dict]]:
    doc = json.loads(SECCOMP.read_text())
    allowed = {n for rule in doc["syscalls"] if rule["action"] == "SCMP_ACT_ALLOW" and not rule.get("args")
               for n in rule["names"]}
    return doc, allowed, doc["syscalls"]


def test_seccomp_profile_refuses_by_default_and_allows_the_bpf_calls():
    doc, allowed, _ = seccomp_rules()
    assert doc["defaultAction"] == "SCMP_ACT_ERRNO"
    assert {"bpf", "perf_event_open"} <= allowed
    # What the agent's Python, BCC and the entrypoint shell need all the time.
    assert {"read", "write", "openat", "mmap", "futex", "epoll_wait", "execve", "socket", "bind", "accept4",
            "ioctl", "close", "exit_group", "rt_sigaction"} <= allowed
    denied = {n for group in _gen_seccomp().DENIED.values() for n in group}
    assert allowed & denied == set()
    assert {"mount", "unshare", "setns", "ptrace", "init_module", "kexec_load", "keyctl", "userfaultfd",
            "io_uring_setup"} <= denied


def test_seccomp_profile_keeps_clone_from_making_namespaces():
    _, allowed, rules = seccomp_rules()
    assert "clone" not in allowed and "clone3" not in allowed
    (clone,) = [r for r in rules if r["names"] == ["clone"]]
    (arg,) = clone["args"]
    assert arg["op"] == "SCMP_CMP_MASKED_EQ" and arg["value"] & 0x10000000 and arg["valueTwo"] == 0  # CLONE_NEWUSER
    (clone3,) = [r for r in rules if r["names"] == ["clone3"]]
    assert clone3["action"] == "SCMP_ACT_ERRNO" and clone3["errnoRet"] == errno.ENOSYS


def test_seccomp_profile_is_what_the_generator_makes_from_this_system_call_table():
    if not UNISTD.exists():
        pytest.skip(f"{UNISTD} is missing (linux-libc-dev)")
    gen = _gen_seccomp()
    assert json.loads(SECCOMP.read_text()) == gen.profile(gen.syscall_names(UNISTD)), (
        "regenerate with scripts/gen-seccomp-profile.py")
