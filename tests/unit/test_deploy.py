"""deploy/ and the Dockerfile, checked offline: every manifest against the
Kubernetes API schemas (oldest and newest that kubernetes-validate ships,
strict), the DaemonSet's least-privilege settings, the agent config, the
dashboards ConfigMap against dashboards/*.json, the kustomization, and the
component deploy/secure (rendered with its patches, compared with kustomize,
validated, and its web configuration loaded by the agent's own parser)."""

from __future__ import annotations

import base64
import errno
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import bcrypt
import pytest
import yaml
from kubernetes_validate import utils as kv

from agent.config import parse_config
from agent.transport.web_config import load_web_config
from tests.support.certs import make_ca, make_cert

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
    """Every YAML file of the base deploy/ holding Kubernetes objects (apiVersion
    and kind): the kustomization itself aside, and so are the folders with a
    kustomization of their own (deploy/secure, checked further down)."""
    found = []
    for path in sorted(DEPLOY.rglob("*.y*ml")):
        if path.name == "kustomization.yaml":
            continue
        if any((parent / "kustomization.yaml").exists() for parent in path.parents
               if parent != DEPLOY and parent.is_relative_to(DEPLOY)):
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


def validate_strictly(doc: dict[str, Any], version: str, where: str) -> None:
    try:
        kv.validate(doc, version, strict=True)
    except kv.ValidationError as e:
        pytest.fail(f"{where}: {doc['kind']}/{doc['metadata']['name']} is invalid for "
                    f"Kubernetes {version}: {e.message} at {'.'.join(map(str, e.path))}")


@pytest.mark.parametrize("version", [OLDEST, NEWEST])
def test_every_manifest_validates_strictly(version: str):
    checked = 0
    for path, doc in objects():
        if doc["kind"] in CUSTOM_KINDS:
            continue
        validate_strictly(doc, version, path.name)
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
    assert sorted(host_paths.values()) == ["/lib/modules", "/sys/fs/cgroup", "/sys/kernel/tracing", "/usr/src",
                                           "/var/cache/slatrace/bpf"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    for name, path in host_paths.items():
        # Mounted where the agent and BCC look for them on a host.
        assert mounts[name]["mountPath"] == path
        if path != "/var/cache/slatrace/bpf":
            assert mounts[name]["readOnly"] is True, f"hostPath {path} must be mounted read-only"
    # Everything else the container can write is scratch space, and the
    # node's cache of compiled programs, where the agent looks by default.
    from agent.probe.cache import DEFAULT_DIR
    writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
    assert writable == {"/tmp", str(DEFAULT_DIR)}
    assert "emptyDir" in volumes[mounts["tmp"]["name"]]
    assert volumes[mounts["bpf-cache"]["name"]]["hostPath"]["type"] == "DirectoryOrCreate"


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


# --- deploy/secure: the component that protects the endpoints ------------------
#
# Rendered here as kustomize renders it, for the patch kinds the component uses
# (a strategic merge on the DaemonSet, a JSON patch on the PodMonitor), and
# compared with a real kustomize (`kubectl kustomize`) where the machine has one.

SECURE = DEPLOY / "secure"
K8S_1_30 = "1.30.0"
CERT_MANAGER_KINDS = {"Certificate", "Issuer", "ClusterIssuer"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "ClusterIssuer"}
# Strategic-merge keys of the pod-spec lists (the Kubernetes API's patchMergeKey);
# any other list is replaced whole, as kustomize does.
MERGE_KEYS = {"containers": "name", "initContainers": "name", "volumes": "name", "env": "name",
              "volumeMounts": "mountPath", "ports": "containerPort"}
SMP_KINDS = {"DaemonSet", "Deployment", "StatefulSet"}
# The Prometheus Operator's PodMonitor CRD (monitoring.coreos.com/v1), read from
# its openAPIV3Schema: PodMetricsEndpoint.tlsConfig (SafeTLSConfig), .basicAuth.
PM_TLS_FIELDS = {"ca", "cert", "insecureSkipVerify", "keySecret", "maxVersion", "minVersion", "serverName"}
PM_SECRET_OR_CONFIGMAP = {"secret", "configMap"}
PM_SECRET_KEY_SELECTOR = {"name", "key", "optional"}
PM_BASIC_AUTH_FIELDS = {"username", "password"}
# cert-manager.io/v1 Certificate fields the component uses, and its usages' spelling.
CM_CERT_FIELDS = {"secretName", "dnsNames", "ipAddresses", "commonName", "duration", "renewBefore", "usages",
                  "privateKey", "issuerRef", "isCA"}
CM_USAGES = {"signing", "digital signature", "content commitment", "key encipherment", "key agreement",
             "data encipherment", "cert sign", "crl sign", "encipher only", "decipher only", "any",
             "server auth", "client auth", "code signing", "email protection", "s/mime", "ipsec end system",
             "ipsec tunnel", "ipsec user", "timestamping", "ocsp signing", "microsoft sgc", "netscape sgc"}
OTLP_SENDER_LABEL = ("slatrace/otlp-sender", "true")


def _docs(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _strategic_merge(base: Any, patch: Any, key: str | None = None) -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = _strategic_merge(base[k], v, k) if k in base else v
        return out
    if isinstance(base, list) and isinstance(patch, list) and key in MERGE_KEYS:
        mk = MERGE_KEYS[key]
        by_key = {item[mk]: item for item in patch}
        merged = [_strategic_merge(item, by_key[item[mk]], None) if item[mk] in by_key else item for item in base]
        # kustomize puts the elements the patch adds before the base's, in the patch's order.
        added = [item for item in patch if item[mk] not in {b[mk] for b in base}]
        return added + merged
    return patch


def _json_patch(doc: Any, ops: list[dict[str, Any]]) -> Any:
    doc = json.loads(json.dumps(doc))
    for op in ops:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        node = doc
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if isinstance(node, list):
            index = len(node) if last == "-" else int(last)
        else:
            index = last
        if op["op"] == "test":
            assert node[index] == op["value"], f"JSON patch test failed at {op['path']}"
        elif op["op"] == "add":
            if isinstance(node, list):
                node.insert(index, op["value"])
            else:
                node[index] = op["value"]
        elif op["op"] == "replace":
            assert index in node if isinstance(node, dict) else index < len(node), op["path"]
            node[index] = op["value"]
        elif op["op"] == "remove":
            del node[index]
        else:
            raise AssertionError(f"JSON patch op {op['op']} is not rendered by this test")
    return doc


def _matches(doc: dict[str, Any], target: dict[str, Any]) -> bool:
    group, _, version = doc["apiVersion"].rpartition("/")
    want = {"group": group, "version": version, "kind": doc["kind"], "name": doc["metadata"]["name"]}
    return all(re.fullmatch(str(v), want[k]) for k, v in target.items() if k in want)


def _apply_patches(objs: list[dict[str, Any]], kust: dict[str, Any], root: Path) -> list[dict[str, Any]]:
    for entry in kust.get("patches", []):
        patch = yaml.safe_load((root / entry["path"]).read_text())
        if isinstance(patch, list):  # a JSON patch: only with a target
            hits = [i for i, o in enumerate(objs) if _matches(o, entry["target"])]
            assert hits, f"{entry['path']}: its target matches nothing"
            for i in hits:
                objs[i] = _json_patch(objs[i], patch)
        else:  # a strategic merge patch names its target itself
            assert patch["kind"] in SMP_KINDS, f"{entry['path']}: strategic merge on a kind without a schema here"
            target = entry.get("target") or {"kind": patch["kind"], "name": patch["metadata"]["name"]}
            hits = [i for i, o in enumerate(objs) if _matches(o, target)]
            assert len(hits) == 1, f"{entry['path']}: its target matches {len(hits)} objects"
            objs[hits[0]] = _strategic_merge(objs[hits[0]], patch)
    return objs


def render(components: tuple[Path, ...] = ()) -> list[dict[str, Any]]:
    """deploy/kustomization.yaml with `components` added, as `kustomize build` renders it."""
    kust = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    objs = [d for r in kust["resources"] for d in _docs(DEPLOY / r)]
    for comp in components:
        ck = yaml.safe_load((comp / "kustomization.yaml").read_text())
        assert ck["kind"] == "Component" and ck["apiVersion"] == "kustomize.config.k8s.io/v1alpha1"
        objs += [d for r in ck.get("resources", []) for d in _docs(comp / r)]
        objs = _apply_patches(objs, ck, comp)
    for o in objs:  # the namespace and images transformers
        if o["kind"] not in CLUSTER_SCOPED:
            o["metadata"]["namespace"] = kust["namespace"]
        for c in o.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            for image in kust.get("images", []):
                if c["image"].split(":")[0] == image["name"]:
                    c["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    return objs


def _by_id(objs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    out = {(o["kind"], o["metadata"]["name"]): o for o in objs}
    assert len(out) == len(objs), "two objects of one kind share a name"
    return out


@pytest.fixture(scope="module")
def secure() -> dict[tuple[str, str], dict[str, Any]]:
    return _by_id(render((SECURE,)))


def _get(objs: dict, kind: str, name: str) -> dict[str, Any]:
    assert (kind, name) in objs, f"{kind}/{name} is not in the rendered deploy/secure"
    return objs[(kind, name)]


def _secret_data(secret: dict[str, Any]) -> dict[str, str]:
    data = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    return {**data, **(secret.get("stringData") or {})}


def test_secure_is_a_component_the_default_deploy_leaves_out():
    kust = yaml.safe_load((SECURE / "kustomization.yaml").read_text())
    assert kust["apiVersion"] == "kustomize.config.k8s.io/v1alpha1" and kust["kind"] == "Component"
    listed = set(kust["resources"]) | {p["path"] for p in kust["patches"]}
    on_disk = {p.name for p in SECURE.glob("*.y*ml")} - {"kustomization.yaml"}
    assert listed == on_disk, "every file of deploy/secure is a resource or a patch, and exists"
    # Without cert-manager the default deploy keeps working: nothing of the component is in it.
    base = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert "components" not in base
    kinds = {o["kind"] for o in render()}
    assert not kinds & (CERT_MANAGER_KINDS | {"NetworkPolicy", "Secret"})
    base_ds = one("DaemonSet", "slatrace")["spec"]["template"]["spec"]["containers"][0]
    assert "--web-config-file" not in base_ds["args"]
    assert "scheme" not in base_ds["readinessProbe"]["httpGet"]


def test_render_of_the_base_is_the_manifests():
    # The renderer adds nothing of its own to the base but the namespace.
    expected = [json.loads(json.dumps(d)) for _, d in objects()]
    for d in expected:
        if d["kind"] not in CLUSTER_SCOPED:
            d["metadata"].setdefault("namespace", "slatrace")
    assert _by_id(render()) == _by_id(expected)


def _kubectl_kustomize(root: Path) -> list[dict[str, Any]]:
    if not shutil.which("kubectl"):
        pytest.skip("no kubectl on this machine: its kustomize is what this test compares with")
    out = subprocess.run(["kubectl", "kustomize", str(root)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_secure_render_is_what_kustomize_builds(tmp_path: Path, secure: dict):
    # As an operator enables it: an overlay of their own beside the checkout ...
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(
        {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
         # kustomize takes relative paths only
         "resources": [os.path.relpath(DEPLOY, overlay)], "components": [os.path.relpath(SECURE, overlay)]}))
    assert _by_id(_kubectl_kustomize(overlay)) == secure
    # ... or `components: [secure]` in deploy/kustomization.yaml itself.
    copy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy)
    kust = yaml.safe_load((copy / "kustomization.yaml").read_text())
    (copy / "kustomization.yaml").write_text(yaml.safe_dump({**kust, "components": ["secure"]}))
    assert _by_id(_kubectl_kustomize(copy)) == secure
    # And the base alone.
    assert _by_id(_kubectl_kustomize(DEPLOY)) == _by_id(render())


@pytest.mark.parametrize("version", [K8S_1_30, NEWEST])
def test_secure_render_validates_strictly(version: str, secure: dict):
    assert version in KV_VERSIONS
    checked = set()
    for (kind, _), doc in secure.items():
        if kind in CUSTOM_KINDS | CERT_MANAGER_KINDS:
            continue
        validate_strictly(doc, version, "deploy/secure")
        checked.add(kind)
    assert {"DaemonSet", "Secret", "NetworkPolicy"} <= checked


def test_secure_daemonset_mounts_the_secrets_and_passes_the_flag(secure: dict):
    ds = _get(secure, "DaemonSet", "slatrace")
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    base_c = one("DaemonSet", "slatrace")["spec"]["template"]["spec"]["containers"][0]
    args = c["args"]
    # The base's arguments are kept, the flag added.
    assert args[:len(base_c["args"])] == base_c["args"]
    web_path = Path(args[args.index("--web-config-file") + 1])
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}

    def secret_behind(path: Path) -> tuple[dict[str, Any], str]:
        mount_path = next(m for m in mounts if path.is_relative_to(m))
        mount = mounts[mount_path]
        assert mount.get("readOnly") is True and "subPath" not in mount, \
            f"{mount_path}: mounted read-only and whole (a subPath mount never sees the Secret's updates)"
        volume = volumes[mount["name"]]
        assert "secret" in volume, f"{mount_path} is not a Secret volume"
        return volume["secret"], str(path.relative_to(mount_path))

    web_secret, key = secret_behind(web_path)
    assert web_secret["secretName"] == "slatrace-web"
    assert key in _secret_data(_get(secure, "Secret", "slatrace-web"))
    # Every file the web configuration names is in a mounted Secret that holds that key.
    web = yaml.safe_load(_secret_data(_get(secure, "Secret", "slatrace-web"))[key])
    tls = web["tls_server_config"]
    for field in ("cert_file", "key_file", "client_ca_file"):
        if field in tls:
            src, file_key = secret_behind(Path(tls[field]))
            assert src["secretName"] == "slatrace-tls"
            assert file_key in {"tls.crt", "tls.key", "ca.crt"}  # kubernetes.io/tls, as cert-manager writes it
    # Probes over HTTPS, on the same paths and port; nothing else of the container changed.
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {**base_c[probe]["httpGet"], "scheme": "HTTPS"}
    for field in ("securityContext", "ports", "resources", "image"):
        assert c[field] == base_c[field]
    assert set(m["mountPath"] for m in base_c["volumeMounts"]) < set(mounts)
    assert {e["name"]: e for e in c["env"]}["SLATRACE_CA_FILE"]["value"] == "/etc/slatrace-tls/ca.crt"


def test_secure_tls_secret_comes_from_cert_manager(secure: dict):
    cert = next(o for (k, _), o in secure.items() if k == "Certificate" and o["spec"]["secretName"] == "slatrace-tls")
    spec = cert["spec"]
    assert cert["apiVersion"] == "cert-manager.io/v1"
    assert set(spec) <= CM_CERT_FIELDS and set(spec.get("usages", [])) <= CM_USAGES
    assert "server auth" in spec["usages"] and not spec.get("isCA")
    assert set(spec["issuerRef"]) <= {"name", "kind", "group"}
    issuer = _get(secure, spec["issuerRef"]["kind"], spec["issuerRef"]["name"])
    # A CA issuer, so that cert-manager writes ca.crt into slatrace-tls.
    ca = next(o for (k, _), o in secure.items() if k == "Certificate"
              and o["spec"]["secretName"] == issuer["spec"]["ca"]["secretName"])
    assert ca["spec"]["isCA"] is True and set(ca["spec"]) <= CM_CERT_FIELDS
    root = _get(secure, ca["spec"]["issuerRef"]["kind"], ca["spec"]["issuerRef"]["name"])
    assert root["spec"] == {"selfSigned": {}}
    # What clients verify the certificate by is among its names.
    pm = _get(secure, "PodMonitor", "slatrace")["spec"]["podMetricsEndpoints"][0]
    svc = _get(secure, "Service", "slatrace")
    assert pm["tlsConfig"]["serverName"] in spec["dnsNames"]
    assert f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc" in spec["dnsNames"]
    assert "localhost" in spec["dnsNames"]  # the CLI in the pod (SLATRACE_CA_FILE)


def test_secure_podmonitor_scrapes_https_with_the_operators_fields(secure: dict):
    pm = _get(secure, "PodMonitor", "slatrace")
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    base_ep = one("PodMonitor", "slatrace")["spec"]["podMetricsEndpoints"][0]
    assert {k: v for k, v in ep.items() if k not in ("scheme", "tlsConfig", "basicAuth")} == base_ep
    assert ep["scheme"] == "https"
    assert set(ep["tlsConfig"]) <= PM_TLS_FIELDS and "insecureSkipVerify" not in ep["tlsConfig"]
    (source,) = ep["tlsConfig"]["ca"].items()
    assert source[0] in PM_SECRET_OR_CONFIGMAP and set(source[1]) <= PM_SECRET_KEY_SELECTOR
    assert source[1] == {"name": "slatrace-tls", "key": "ca.crt"}
    assert set(ep["basicAuth"]) == PM_BASIC_AUTH_FIELDS
    creds = {}
    for field, ref in ep["basicAuth"].items():
        assert set(ref) <= PM_SECRET_KEY_SELECTOR and {"name", "key"} <= set(ref)
        secret = _get(secure, "Secret", ref["name"])
        assert secret["metadata"]["namespace"] == pm["metadata"]["namespace"]  # where the operator reads it
        creds[field] = _secret_data(secret)[ref["key"]]
    # The example's scrape password is the one whose hash the agent's web configuration holds.
    web = yaml.safe_load(_secret_data(_get(secure, "Secret", "slatrace-web"))["web.yml"])
    hashed = web["basic_auth_users"][creds["username"]]
    assert bcrypt.checkpw(creds["password"].encode(), hashed.encode())
    # And both say they are an example to replace.
    for name in ("web-config-secret.yaml", "scrape-secret.yaml"):
        assert "REPLACE" in (SECURE / name).read_text()


@pytest.mark.parametrize("variant", ["as shipped", "client certificates"])
def test_secure_web_config_loads_in_the_agent(tmp_path: Path, secure: dict, variant: str):
    """The agent's own parser accepts the example web configuration, with the
    files it names made at their mounted paths under tmp_path."""

    text = _secret_data(_get(secure, "Secret", "slatrace-web"))["web.yml"]
    if variant == "client certificates":  # the commented alternative in the Secret
        text, n = re.subn(r"# (client_auth_type|client_ca_file):", r"\1:", text)
        assert n == 2
    web = yaml.safe_load(text)
    tls_dir = tmp_path / "etc/slatrace-tls"
    tls_dir.mkdir(parents=True)
    cert = next(o for (k, _), o in secure.items() if k == "Certificate" and o["spec"]["secretName"] == "slatrace-tls")
    make_ca(tls_dir, "ca")
    san = ",".join([f"DNS:{n}" for n in cert["spec"]["dnsNames"]] + [f"IP:{ip}" for ip in cert["spec"]["ipAddresses"]])
    made = make_cert(tls_dir, "tls", "ca", "serverAuth", san=san)
    assert made == (tls_dir / "tls.crt", tls_dir / "tls.key")  # the names of a kubernetes.io/tls Secret
    for field in ("cert_file", "key_file", "client_ca_file"):
        if field in web["tls_server_config"]:
            path = web["tls_server_config"][field]
            assert path.startswith("/etc/slatrace-tls/")
            web["tls_server_config"][field] = str(tmp_path / path.lstrip("/"))
    web_file = tmp_path / "etc/slatrace-web/web.yml"
    web_file.parent.mkdir(parents=True)
    web_file.write_text(yaml.safe_dump(web))
    loaded = load_web_config(str(web_file))
    assert loaded.tls is not None
    assert loaded.tls.client_auth_type == ("VerifyClientCertIfGiven" if variant == "client certificates"
                                           else "NoClientCert")
    # Never RequireAndVerifyClientCert: the kubelet's probes carry no certificate.
    assert not loaded.tls.requires_client_cert
    assert [u for u, _ in loaded.users] == ["prometheus"]


def test_secure_networkpolicy_admits_prometheus_to_the_api_and_senders_to_otlp(secure: dict):
    np = _get(secure, "NetworkPolicy", "slatrace")
    spec = np["spec"]
    pod = _get(secure, "DaemonSet", "slatrace")["spec"]["template"]
    assert spec["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert spec["policyTypes"] == ["Ingress"]  # the agent's own connections stay open
    ports = {p["containerPort"]: p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    admitted: dict[int, list[dict]] = {}
    for rule in spec["ingress"]:
        # A rule without `from` or without `ports` would open every peer or every port.
        assert rule.get("from") and rule.get("ports"), rule
        for p in rule["ports"]:
            assert p["protocol"] == "TCP" and p["port"] in ports
            admitted.setdefault(p["port"], []).extend(rule["from"])
    assert set(admitted) == {AGENT_PORT, 4317, 4318}
    (prom,) = admitted[AGENT_PORT]
    # One peer with both selectors: Prometheus' pods in its namespace (two peers would be OR).
    assert set(prom) == {"namespaceSelector", "podSelector"}
    assert set(prom["namespaceSelector"]["matchLabels"]) == {"kubernetes.io/metadata.name"}
    assert prom["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
    for port in (4317, 4318):
        (sender,) = admitted[port]
        assert sender == {"namespaceSelector": {}, "podSelector": {"matchLabels": dict([OTLP_SENDER_LABEL])}}
    # deploy/README.md names the label and says what the policy cannot express.
    readme = (DEPLOY / "README.md").read_text()
    assert f"{OTLP_SENDER_LABEL[0]}: \"{OTLP_SENDER_LABEL[1]}\"" in readme
    assert "cannot" in readme.split("NetworkPolicy", 1)[1]
