"""A private container engine for the container tier: build the image, run it as a pod.

Docker builds the project's Dockerfile; the containerd Docker starts runs the
image with `ctr` under what deploy/daemonset.yaml declares. Nothing here uses the
host's own Docker or containerd, if any: dockerd runs with its own socket,
exec-root and data-root, no bridge and no iptables, and everything it starts is
stopped and removed again. The data-root (layer cache, base image) is kept
between runs in CACHE so a warm run builds in seconds.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from tests.support import pid_alive

DOCKER = Path("/usr/bin/docker")
DOCKERD = Path("/usr/sbin/dockerd")
CTR = Path("/usr/bin/ctr")
DEBOOTSTRAP = Path("/usr/sbin/debootstrap")
CACHE = Path(os.environ.get("SLATRACE_TEST_CACHE", "/var/cache/slatrace-test"))
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
BASE_IMAGE = "debian:bookworm-slim"
NAMESPACE = "slatrace-test"
# Build and `docker run` containers go below this cgroup, ctr's below NAMESPACE.
DOCKER_CGROUP = "slatrace-docker-test"
# Where each run's sockets and state live; the name carries the owning pid.
RUN_PREFIX = "slatrace-docker-"
# The capabilities ctr 1.6 gives a container by default (it has no --cap-drop ALL).
CTR_DEFAULT_CAPS = ("CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
                    "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
                    "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE")


class EngineError(RuntimeError):
    pass


def missing_tools() -> str | None:
    """Why the container tier cannot run here, or None."""
    for tool, package in ((DOCKER, "docker.io"), (DOCKERD, "docker.io"), (CTR, "containerd"),
                          (DEBOOTSTRAP, "debootstrap")):
        if not tool.exists():
            return f"{tool} is missing (Debian's {package}; make setup-test installs it)"
    for tool in ("nsenter", "mountpoint"):
        if shutil.which(tool) is None:
            return f"{tool} (util-linux) is not installed"
    return None


def _run(argv: list[str | Path], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    r = subprocess.run([str(a) for a in argv], capture_output=True, timeout=timeout, **kwargs)
    if r.returncode != 0:
        def text(b: bytes | str | None) -> str:
            return (b.decode(errors="replace") if isinstance(b, bytes) else b or "").strip()
        raise EngineError(f"{' '.join(map(str, argv[:4]))}... failed ({r.returncode}): "
                          f"{text(r.stdout)[-3000:]}\n{text(r.stderr)[-2000:]}")
    return r


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path).rstrip("/") + "/"
    out = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        target = line.split()[1].replace("\\040", " ")
        if target == str(path) or target.startswith(prefix):
            out.append(target)
    return sorted(out, key=len, reverse=True)


def _unmount_under(path: Path) -> None:
    for target in _mounts_under(path):
        subprocess.run(["umount", "-l", target], capture_output=True, timeout=30)


@contextmanager
def cache_lock(timeout: float = 600.0) -> Iterator[None]:
    """One tier at a time per cache: dockerd cannot share its data-root."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "lock", "w") as f:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise EngineError(f"{CACHE} stayed locked by another container test run for {timeout:.0f} s")
                time.sleep(1)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def remove_stale_runs(root: Path = Path("/run")) -> None:
    """Stop and remove what a killed earlier run left: its dockerd, mounts, state."""
    for d in root.glob(RUN_PREFIX + "*"):
        m = re.fullmatch(re.escape(RUN_PREFIX) + r"(\d+)", d.name)
        if not m or pid_alive(int(m[1])):
            continue
        pidfile = d / "docker.pid"
        if pidfile.exists():
            pid = int(pidfile.read_text().strip() or 0)
            # Only the dockerd that was started with this directory.
            if pid and pid_alive(pid) and str(d) in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"):
                os.kill(pid, signal.SIGTERM)
                _wait_gone(pid, 30)
        _unmount_under(d)
        shutil.rmtree(d, ignore_errors=True)


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        try:  # our own child: reap it
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.1)
    return not pid_alive(pid)


@dataclass
class Dockerd:
    """A private dockerd and the containerd it manages."""

    run_dir: Path = field(default_factory=lambda: Path("/run") / f"{RUN_PREFIX}{os.getpid()}")
    data_root: Path = CACHE / "docker"
    proc: subprocess.Popen | None = None

    @property
    def sock(self) -> Path:
        return self.run_dir / "docker.sock"

    @property
    def containerd_sock(self) -> Path:
        return self.run_dir / "exec" / "containerd" / "containerd.sock"

    def start(self, timeout: float = 60.0) -> None:
        self.run_dir.mkdir(parents=True)
        self.data_root.mkdir(parents=True, exist_ok=True)
        log = open(self.run_dir / "dockerd.log", "wb")
        self.proc = subprocess.Popen(
            [str(DOCKERD), "-H", f"unix://{self.sock}", "--exec-root", str(self.run_dir / "exec"),
             "--data-root", str(self.data_root), "--pidfile", str(self.run_dir / "docker.pid"),
             "--iptables=false", "--ip-forward=false", "--ip-masq=false", "--bridge=none",
             "--userland-proxy=false", f"--cgroup-parent=/{DOCKER_CGROUP}"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineError(f"dockerd exited with {self.proc.returncode}: {self.log()[-2000:]}")
            if self.sock.exists() and self.containerd_sock.exists():
                r = subprocess.run([str(DOCKER), "-H", f"unix://{self.sock}", "version"], capture_output=True,
                                   timeout=10)
                if r.returncode == 0:
                    return
            time.sleep(0.2)
        raise EngineError(f"dockerd not up after {timeout:.0f} s: {self.log()[-2000:]}")

    def log(self) -> str:
        try:
            return (self.run_dir / "dockerd.log").read_text(errors="replace")
        except OSError:
            return ""

    def docker(self, *args: str | Path, timeout: float = 120.0, **kwargs) -> subprocess.CompletedProcess:
        return _run([DOCKER, "-H", f"unix://{self.sock}", *args], timeout=timeout, **kwargs)

    def ctr(self, *args: str | Path, timeout: float = 60.0, check: bool = True,
            **kwargs) -> subprocess.CompletedProcess:
        argv = [str(CTR), "-a", str(self.containerd_sock), "-n", NAMESPACE, *map(str, args)]
        if check:
            return _run(argv, timeout=timeout, **kwargs)
        return subprocess.run(argv, capture_output=True, timeout=timeout, **kwargs)

    def has_image(self, ref: str) -> bool:
        r = subprocess.run([str(DOCKER), "-H", f"unix://{self.sock}", "image", "inspect", ref],
                           capture_output=True, timeout=30)
        return r.returncode == 0

    def task_ids(self) -> list[str]:
        return self.ctr("tasks", "ls", "-q", check=False).stdout.decode().split()

    def remove_container(self, cid: str, timeout: float = 15.0) -> None:
        """Kill its task if any, delete the task, then the container (runc removes its cgroups)."""
        if cid in self.task_ids():
            self.ctr("tasks", "kill", "-s", "SIGKILL", cid, check=False)
            deadline = time.monotonic() + timeout
            while cid in self.task_ids() and self.ctr("tasks", "delete", cid, check=False).returncode != 0:
                if time.monotonic() > deadline:
                    raise EngineError(f"task {cid} survives SIGKILL")
                time.sleep(0.2)
        self.ctr("containers", "delete", cid, check=False)

    def remove_namespace(self) -> None:
        """Every task, container, image and the namespace itself."""
        for cid in self.ctr("containers", "list", "-q", check=False).stdout.decode().split():
            self.remove_container(cid)
        refs = self.ctr("images", "list", "-q", check=False).stdout.decode().split()
        if refs:
            self.ctr("images", "remove", "--sync", *refs, check=False)
        self.ctr("namespaces", "remove", NAMESPACE)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop dockerd by its pid (it stops its containerd), then unmount and remove its state."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        # dockerd leaves the bind mount of its network namespace behind (exec/netns/default).
        _unmount_under(self.run_dir)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        remove_parent_cgroups()


def cgroup_mounts() -> list[Path]:
    return [Path(line.split()[1]) for line in Path("/proc/self/mounts").read_text().splitlines()
            if line.split()[2] in ("cgroup", "cgroup2")]


def remove_parent_cgroups() -> None:
    """The (then empty) parent cgroups runc made for the containers, in every hierarchy."""
    for mount in cgroup_mounts():
        for name in (NAMESPACE, DOCKER_CGROUP):
            try:
                (mount / name).rmdir()
            except FileNotFoundError:
                pass


# --- the base image ---------------------------------------------------------------

def host_mirror(sources_dir: Path = Path("/etc/apt")) -> str:
    """The Debian mirror the host's apt uses (deb822 sources or sources.list)."""
    deb822 = sources_dir / "sources.list.d" / "debian.sources"
    if deb822.exists():
        for stanza in deb822.read_text().split("\n\n"):
            fields = dict(re.findall(r"^(\w[\w-]*):\s*(.*)$", stanza, re.M))
            if "bookworm" in fields.get("Suites", "").split() and fields.get("URIs"):
                return fields["URIs"].split()[0]
    listed = sources_dir / "sources.list"
    if listed.exists():
        for line in listed.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "deb" and parts[2] == "bookworm":
                return parts[1] if not parts[1].startswith("[") else parts[2]
    raise EngineError("no Debian bookworm mirror in the host's apt sources to debootstrap the base image from")


# Like the slim image: no documentation, and apt keeps no caches in layers.
DPKG_SLIM = """path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
"""
APT_NO_CACHE = """DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
"""


def debootstrap_base(dest_tar: Path, timeout: float = 1200.0) -> None:
    """debian:bookworm-slim made locally: debootstrap minbase from the host's mirror."""
    work = Path(tempfile.mkdtemp(prefix="rootfs-", dir=CACHE))
    try:
        rootfs = work / "rootfs"
        _run([DEBOOTSTRAP, "--variant=minbase", "bookworm", rootfs, host_mirror()], timeout=timeout)
        apt = rootfs / "etc" / "apt"
        # The same sources as the host's apt (updates and security included).
        for src in (Path("/etc/apt/sources.list.d/debian.sources"), Path("/etc/apt/sources.list")):
            if src.exists():
                target = apt / src.relative_to("/etc/apt")
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, target)
        if (apt / "sources.list.d" / "debian.sources").exists():
            (apt / "sources.list").write_text("")
        (apt / "apt.conf.d" / "docker-clean").write_text(APT_NO_CACHE)
        (rootfs / "etc" / "dpkg" / "dpkg.cfg.d" / "docker-slim").write_text(DPKG_SLIM)
        for d in ("usr/share/man", "usr/share/info", "usr/share/locale", "var/lib/apt/lists",
                  "var/cache/apt/archives"):
            for child in (rootfs / d).glob("*"):
                if child.is_file() and child.name not in ("lock", "locale.alias"):
                    child.unlink()
                elif child.is_dir() and child.name != "partial":
                    shutil.rmtree(child)
        for doc in (rootfs / "usr/share/doc").glob("*"):
            for child in doc.iterdir():
                if child.name != "copyright":
                    shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
        for pkgcache in (rootfs / "var/cache/apt").glob("*.bin"):
            pkgcache.unlink()
        tmp_tar = dest_tar.with_suffix(".tmp")
        with tarfile.open(tmp_tar, "w") as tar:
            tar.add(rootfs, arcname=".")
        tmp_tar.rename(dest_tar)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def ensure_base_image(engine: Dockerd) -> str:
    """The image the Dockerfile builds on, trusting the host's CA bundle.

    debian:bookworm-slim from the data-root cache, else from a registry when
    SLATRACE_TEST_PULL=1, else made with debootstrap (the tarball is cached too). Outbound TLS may be
    intercepted on a test machine, so a thin layer adds the host's CA bundle:
    the build's pip sees it once ca-certificates is installed.
    """
    if not engine.has_image(BASE_IMAGE):
        # A registry only when asked: here Docker Hub is unreachable and a pull
        # can hang for minutes before it says so.
        pulled = False
        if os.environ.get("SLATRACE_TEST_PULL") == "1":
            pulled = subprocess.run([str(DOCKER), "-H", f"unix://{engine.sock}", "pull", BASE_IMAGE],
                                    capture_output=True, timeout=300).returncode == 0
        if not pulled:
            tar = CACHE / "bookworm-minbase.tar"
            if not tar.exists():
                debootstrap_base(tar)
            with open(tar, "rb") as f:
                engine.docker("import", "-", BASE_IMAGE, stdin=f, timeout=300)
    ref = "slatrace-test-base:latest"
    with tempfile.TemporaryDirectory() as ctx:
        shutil.copyfile(HOST_CA, Path(ctx) / "host-ca.crt")
        (Path(ctx) / "Dockerfile").write_text(
            f"FROM {BASE_IMAGE}\nCOPY host-ca.crt /usr/local/share/ca-certificates/host-ca.crt\n")
        engine.docker("build", "--network", "host", "-q", "-t", ref, ctx, timeout=300)
    return ref


# --- the image under the DaemonSet ------------------------------------------------

def build_image(engine: Dockerd, base: str, context: Path, tag: str, timeout: float = 1800.0) -> float:
    """docker build of the project's Dockerfile; returns the seconds it took."""
    start = time.monotonic()
    engine.docker("build", "--network", "host", "--build-arg", f"BASE_IMAGE={base}", "-t", tag, context,
                  timeout=timeout)
    return time.monotonic() - start


def import_image(engine: Dockerd, tag: str) -> str:
    """docker save | ctr images import: the image as containerd (a kubelet's runtime) sees it."""
    save = subprocess.Popen([str(DOCKER), "-H", f"unix://{engine.sock}", "save", tag], stdout=subprocess.PIPE)
    try:
        engine.ctr("images", "import", "-", stdin=save.stdout, timeout=300)
    finally:
        save.stdout.close()
        if save.wait(60) != 0:
            raise EngineError(f"docker save {tag} failed")
    return tag if "/" in tag.split(":")[0] else f"docker.io/library/{tag}"


def image_config(engine: Dockerd, tag: str) -> dict:
    return json.loads(engine.docker("image", "inspect", tag).stdout)[0]["Config"]


_QUANTITY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "K": 10**3, "M": 10**6, "G": 10**9}


def quantity_bytes(q: str | int) -> int:
    m = re.fullmatch(r"(\d+)([KMG]i?)?", str(q))
    if not m:
        raise ValueError(f"unsupported quantity {q!r}")
    return int(m[1]) * _QUANTITY.get(m[2] or "", 1)


def quantity_cpus(q: str | int | float) -> float:
    s = str(q)
    return int(s[:-1]) / 1000 if s.endswith("m") else float(s)


@dataclass
class PodSpec:
    """What `ctr run` needs to reproduce one container of a pod template."""

    pod: dict
    container: dict
    volumes: dict[str, dict]

    @classmethod
    def from_daemonset(cls, doc: dict) -> "PodSpec":
        pod = doc["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        return cls(pod, container, {v["name"]: v for v in pod.get("volumes", [])})

    def caps(self) -> list[str]:
        sc = self.container.get("securityContext", {}).get("capabilities", {})
        return [f"CAP_{c}" for c in sc.get("add", [])]

    def seccomp(self) -> dict:
        return (self.container.get("securityContext", {}).get("seccompProfile")
                or self.pod.get("securityContext", {}).get("seccompProfile") or {"type": "Unconfined"})

    def port(self, name_or_number: str | int) -> int:
        if isinstance(name_or_number, int):
            return name_or_number
        return next(p["containerPort"] for p in self.container["ports"] if p["name"] == name_or_number)

    def ctr_args(self, scratch: Path, config_data: dict[str, str], *, caps: list[str] | None = None,
                 seccomp_file: Path | None = None, host_paths: dict[str, Path] | None = None) -> list[str]:
        """ctr run flags for the container: securityContext, hostPID, mounts, resources, env.

        caps, seccomp_file (a Localhost profile) and host_paths (volume name ->
        other host directory) let a test change one thing about the pod.
        """
        sc = self.container.get("securityContext", {})
        args: list[str] = []
        if sc.get("privileged"):
            args.append("--privileged")
        if sc.get("allowPrivilegeEscalation", True):
            args.append("--allow-new-privs")  # ctr sets no_new_privs by default
        if sc.get("readOnlyRootFilesystem"):
            args.append("--read-only")
        drop = sc.get("capabilities", {}).get("drop", [])
        dropped = CTR_DEFAULT_CAPS if "ALL" in drop else tuple(f"CAP_{c}" for c in drop)
        for cap in dropped:
            args += ["--cap-drop", cap]
        for cap in (self.caps() if caps is None else caps):
            args += ["--cap-add", cap]
        profile = self.seccomp() if seccomp_file is None else {"type": "Localhost"}
        if profile["type"] == "RuntimeDefault":
            args.append("--seccomp")
        elif profile["type"] == "Localhost":
            if seccomp_file is None:
                raise EngineError(f"a Localhost seccomp profile ({profile.get('localhostProfile')}) needs its file")
            args += ["--seccomp", "--seccomp-profile", str(seccomp_file)]
        if self.pod.get("hostPID"):
            args += ["--with-ns", f"pid:/proc/{os.getpid()}/ns/pid"]
        if self.pod.get("hostNetwork"):
            args.append("--net-host")
        # ctr 1.6 has no --user: the image runs as root, the DaemonSet must say so.
        if sc.get("runAsUser", 0) != 0 or sc.get("runAsGroup", 0) != 0:
            raise EngineError("runAsUser/runAsGroup other than 0 cannot be reproduced with ctr 1.6")
        limits = self.container.get("resources", {}).get("limits", {})
        requests = self.container.get("resources", {}).get("requests", {})
        if "memory" in limits:
            args += ["--memory-limit", str(quantity_bytes(limits["memory"]))]
        if "cpu" in limits:
            args += ["--cpus", str(quantity_cpus(limits["cpu"]))]
        if "cpu" in requests:  # the kubelet's shares for a CPU request
            args += ["--cpu-shares", str(max(2, int(quantity_cpus(requests["cpu"]) * 1024)))]
        for m in self.container.get("volumeMounts", []):
            args += ["--mount", self._mount(m, scratch, config_data, host_paths or {})]
        for env in self.container.get("env", []):
            if "value" in env:
                args += ["--env", f"{env['name']}={env['value']}"]
            elif env.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "spec.nodeName":
                args += ["--env", f"{env['name']}={os.uname().nodename}"]
            else:
                raise EngineError(f"env {env['name']}: only values and spec.nodeName are reproduced")
        return args

    def _mount(self, m: dict, scratch: Path, config_data: dict[str, str], host_paths: dict[str, Path]) -> str:
        vol = self.volumes[m["name"]]
        ro = m.get("readOnly", False)
        if "hostPath" in vol:
            src = host_paths.get(m["name"], Path(vol["hostPath"]["path"]))
            if vol["hostPath"].get("type") == "DirectoryOrCreate":
                src.mkdir(mode=0o700, parents=True, exist_ok=True)   # as the kubelet does
            if vol["hostPath"].get("type") == "Directory" and not src.is_dir():
                raise EngineError(f"hostPath {src} is not a directory on this node")
        elif "configMap" in vol:
            src = scratch / m["name"]
            src.mkdir(exist_ok=True)
            for key, text in config_data.items():
                (src / key).write_text(text)
            ro = True  # the kubelet mounts ConfigMaps read-only
        elif "emptyDir" in vol:
            # A tmpfs of the volume's size limit (what medium: Memory would be).
            size = vol["emptyDir"].get("sizeLimit")
            opts = f"options=size={quantity_bytes(size)}" if size else "options=rw"
            return f"type=tmpfs,source=tmpfs,destination={m['mountPath']},{opts}"
        else:
            raise EngineError(f"volume {m['name']}: unsupported kind {sorted(vol)}")
        return f"type=bind,source={src},destination={m['mountPath']},options=rbind:{'ro' if ro else 'rw'}"

    def command(self, image_cfg: dict) -> list[str]:
        """Kubernetes semantics: command replaces the entrypoint, args the image's CMD."""
        entry = self.container.get("command", image_cfg.get("Entrypoint") or [])
        args = self.container.get("args", image_cfg.get("Cmd") or [] if "command" not in self.container else [])
        return [*entry, *args]


class Task:
    """One container run with `ctr run -d`, its output in a log file."""

    def __init__(self, engine: Dockerd, image: str, name: str, ctr_args: list[str], command: list[str],
                 log: Path) -> None:
        self.engine, self.name, self.log_path = engine, name, log
        engine.ctr("run", "-d", "--log-uri", f"file://{log}", *ctr_args, image, name, *command, timeout=60)
        self.pid = int(self._task_field("PID"))
        self.exit_status: int | None = None

    def _task_field(self, column: str) -> str:
        out = self.engine.ctr("tasks", "ls").stdout.decode().splitlines()
        header = out[0].split()
        for line in out[1:]:
            fields = line.split()
            if fields and fields[0] == self.name:
                return fields[header.index(column)]
        raise EngineError(f"no task {self.name}")

    def running(self) -> bool:
        return self._task_field("STATUS") == "RUNNING"

    def output(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def http_get(self, port: int, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
        """GET inside the pod's network namespace (the pod has no host ports)."""
        code = ("import sys, urllib.request, urllib.error\n"
                "try:\n r = urllib.request.urlopen(sys.argv[1], timeout=float(sys.argv[2]))\n"
                " s, b = r.status, r.read()\n"
                "except urllib.error.HTTPError as e:\n s, b = e.code, e.read()\n"
                "sys.stdout.buffer.write(b'%d\\n' % s + b)\n")
        r = subprocess.run(["nsenter", f"--net=/proc/{self.pid}/ns/net", "/usr/bin/python3", "-c", code,
                            f"http://127.0.0.1:{port}{path}", str(timeout)],
                           capture_output=True, timeout=timeout + 10)
        if r.returncode != 0:
            raise OSError(r.stderr.decode(errors="replace").strip().splitlines()[-1:] or "GET failed")
        status, _, body = r.stdout.partition(b"\n")
        return int(status), body

    def wait_ready(self, port: int, path: str, timeout: float) -> float:
        """Seconds until `path` answers 200; EngineError if the task exits first."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if not self.running():
                raise EngineError(f"the container exited before it was ready: {self.output()[-3000:]}")
            try:
                if self.http_get(port, path, timeout=1.0)[0] == 200:
                    return time.monotonic() - start
            except (OSError, subprocess.TimeoutExpired):
                pass
            time.sleep(0.2)
        raise EngineError(f"not ready after {timeout:.0f} s: {self.output()[-3000:]}")

    def wait_exit(self, timeout: float) -> int:
        """The exit status once the task stopped; the task is deleted then."""
        deadline = time.monotonic() + timeout
        while self.running():
            if time.monotonic() > deadline:
                raise EngineError(f"still running after {timeout:.0f} s: {self.output()[-3000:]}")
            time.sleep(0.1)
        # ctr 1.6 has no `tasks wait`: `tasks delete` exits with the task's status.
        r = self.engine.ctr("tasks", "delete", self.name, check=False)
        err = r.stderr.decode(errors="replace")
        m = re.search(r"exit with non-zero exit code (\d+)", err)
        if m:
            self.exit_status = int(m[1])
        elif r.returncode == 0:
            self.exit_status = 0
        else:
            raise EngineError(f"ctr tasks delete {self.name}: {err.strip()}")
        return self.exit_status

    def exec(self, argv: list[str], timeout: float = 60.0) -> str:
        """Runs argv in the container (same namespaces, capabilities and seccomp filter); its stdout."""
        r = self.engine.ctr("tasks", "exec", "--exec-id", f"exec-{secrets.token_hex(3)}", self.name, *argv,
                            timeout=timeout)
        return r.stdout.decode(errors="replace")

    def signal(self, sig: str) -> None:
        self.engine.ctr("tasks", "kill", "-s", sig, self.name)

    def remove(self) -> None:
        self.engine.remove_container(self.name)


def memory_limit(pid: int, proc: Path = Path("/proc"), cgroupfs: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The memory limit of pid's cgroup in bytes (v1 memory controller, else v2 memory.max); None if none."""
    lines = (proc / str(pid) / "cgroup").read_text().splitlines()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            value = int((cgroupfs / "memory" / path.lstrip("/") / "memory.limit_in_bytes").read_text())
            return None if value >= 2**62 else value
    for line in lines:
        if line.startswith("0::"):
            from tests.support.workload import cgroup2_mount
            text = (cgroup2_mount() / line[3:].lstrip("/") / "memory.max").read_text().strip()
            return None if text == "max" else int(text)
    return None


def resolve_seccomp_profile(profile: dict, caps: list[str]) -> dict:
    """A profile with its capability conditions decided for `caps`, as CRI-O decides them.

    Docker-format profiles hold rules that apply only with (`includes`) or
    without (`excludes`) some capability. ctr 1.6 loads such a file without
    deciding them, so the runtime's evaluation is done here first.
    """
    held = set(caps)
    rules = []
    for rule in profile["syscalls"]:
        inc, exc = rule.get("includes") or {}, rule.get("excludes") or {}
        if not set(inc.get("caps", [])) <= held or set(exc.get("caps", [])) & held:
            continue
        if inc.get("arches") and not {"amd64", "x86_64"} & set(inc["arches"]):
            continue
        if inc.get("minKernel"):
            continue  # kernel-version rules only widen what a newer kernel may call
        rules.append({k: v for k, v in rule.items() if k not in ("includes", "excludes", "comment")})
    out = {k: v for k, v in profile.items() if k not in ("syscalls", "archMap")}
    out["architectures"] = ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"]
    out["syscalls"] = rules
    return out
