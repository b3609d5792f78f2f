"""Debian's kernels in qemu: fetch, cache, boot a guest that runs one job.

The kernel tier proves the agent on the kernels users' nodes run (Debian's
5.10, 6.1 and 6.12), not only on this host's. Kernel packages come from
Debian's package registry through a private apt configuration (nothing of the
host's apt state changes), are unpacked once into a cache, and boot under
qemu's TCG emulator: the host's /dev/kvm is para-virtualised and stock kernels
hang on it. The guest mounts the host's root filesystem read-only over
virtio-9p, so the checkout, its venv and Debian's BCC are the host's own; a
second, writable share carries the job script in and the results out.

With multi-threaded TCG an attach on 6.12 oopsed the guest (the emulator
racing the kernel's live patching of the tracepoint), so TCG runs
single-threaded.
"""

from __future__ import annotations

import fcntl
import io
import lzma
import os
import re
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

CACHE = Path(os.environ.get("SLATRACE_KERNEL_CACHE", "/var/cache/slatrace/kernels"))
MIRROR = "http://deb.debian.org/debian"
SECURITY = "http://deb.debian.org/debian-security"
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
BUSYBOX = Path("/bin/busybox")
QEMU = "qemu-system-x86_64"

# Kernel series -> the Debian release that ships it.
SUITES = {"5.10": "bullseye", "6.1": "bookworm", "6.12": "trixie"}

# What the initramfs loads, in this order, to mount the host's root over 9p
# (whatever of these a kernel builds in is simply absent from its modules).
NINEP_MODULES = ("virtio_ring", "virtio", "virtio_pci_modern_dev", "virtio_pci_legacy_dev", "virtio_pci",
                 "fscache", "netfs", "9pnet", "9pnet_virtio", "9p")


class GuestError(RuntimeError):
    """A kernel could not be fetched or booted; the message says which step."""


@dataclass(frozen=True)
class Kernel:
    series: str        # "5.10"
    suite: str         # "bullseye"
    release: str       # uname -r in the guest, e.g. "5.10.0-46-amd64"
    package: str       # the Debian package it came from, with its version
    root: Path         # the unpacked package

    @property
    def vmlinuz(self) -> Path:
        return self.root / "boot" / f"vmlinuz-{self.release}"

    @property
    def modules(self) -> Path:
        for base in (self.root / "lib" / "modules", self.root / "usr" / "lib" / "modules"):
            if (base / self.release).is_dir():
                return base / self.release
        raise GuestError(f"{self.package} has no modules directory for {self.release}")


def _run(argv: list[str], what: str, timeout: float = 600) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise GuestError(f"{what} failed: {e}") from None
    if done.returncode != 0:
        raise GuestError(f"{what} failed (exit {done.returncode}): {done.stderr.strip()[-600:]}")
    return done.stdout


def _apt(suite: str) -> list[str]:
    """apt-get/apt-cache options naming only `suite`, with state of its own."""
    base = CACHE / "apt" / suite
    (base / "lists" / "partial").mkdir(parents=True, exist_ok=True)
    (base / "cache" / "archives" / "partial").mkdir(parents=True, exist_ok=True)
    (base / "parts").mkdir(exist_ok=True)
    sources = base / "sources.list"
    sources.write_text("".join(
        f"deb [signed-by={KEYRING}] {url} {s} main\n"
        for url, s in ((MIRROR, suite), (MIRROR, f"{suite}-updates"), (SECURITY, f"{suite}-security"))))
    return [f"-oDir::Etc::SourceList={sources}", f"-oDir::Etc::SourceParts={base / 'parts'}",
            f"-oDir::State::Lists={base / 'lists'}", f"-oDir::Cache={base / 'cache'}",
            "-oAPT::Get::List-Cleanup=0", "-oDebug::NoLocking=1", "-qq"]


def fetch(series: str) -> Kernel:
    """The newest Debian kernel of a series, unpacked in the cache (fetched
    from Debian's registry the first time only)."""
    suite = SUITES[series]
    (CACHE / suite).mkdir(parents=True, exist_ok=True)
    # Two guests of one series (the cgroup v1 node runs 5.10 too) fetch it
    # once: apt's lists of one suite take one writer at a time.
    with open(CACHE / suite / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _fetch_locked(series, suite)


def _fetch_locked(series: str, suite: str) -> Kernel:
    done = CACHE / suite / "kernel"
    if (done / ".package").is_file():
        package, release = (done / ".package").read_text().split()
        return Kernel(series, suite, release, package, done)
    opts = _apt(suite)
    _run(["apt-get", *opts, "update"], f"apt-get update for {suite}")
    depends = _run(["apt-cache", *opts, "depends", "linux-image-amd64"], f"apt-cache depends ({suite})")
    m = re.search(r"Depends: (linux-image-[\w.+~-]+-amd64)\b", depends)
    if not m:
        raise GuestError(f"linux-image-amd64 of {suite} names no kernel image package: {depends.strip()}")
    image = m.group(1)
    debs = CACHE / suite / "debs"
    shutil.rmtree(debs, ignore_errors=True)
    debs.mkdir(parents=True)
    _run(["sh", "-c", f'cd "{debs}" && apt-get "$@" download {image}', "sh", *opts], f"downloading {image}")
    deb = next(debs.glob("*.deb"))
    tmp = CACHE / suite / "kernel.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    _run(["dpkg-deb", "-x", str(deb), str(tmp)], f"unpacking {deb.name}")
    release = image.removeprefix("linux-image-")
    version = _run(["dpkg-deb", "-f", str(deb), "Version"], "reading the package version").strip()
    shutil.rmtree(debs)
    (tmp / ".package").write_text(f"{image}={version} {release}\n")
    shutil.rmtree(done, ignore_errors=True)
    tmp.rename(done)
    return Kernel(series, suite, release, f"{image}={version}", done)


def _module_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    if path.suffix == ".xz":
        return lzma.decompress(data)
    if path.suffix != ".ko":
        raise GuestError(f"{path.name}: unknown module compression")
    return data


def _depends(module: bytes) -> list[str]:
    """The modules a module needs, from the `depends=` of its .modinfo."""
    m = re.search(rb"(?:^|\0)depends=([^\0]*)\0", module)
    return [d.decode() for d in m.group(1).split(b",") if d] if m else []


def _find_modules(kernel: Kernel) -> dict[str, Path]:
    out = {}
    for path in (kernel.modules / "kernel").rglob("*.ko*"):
        out[path.name.split(".ko")[0].replace("-", "_")] = path
    return out


def _needed(kernel: Kernel) -> list[tuple[str, bytes]]:
    """The 9p modules and what they depend on, dependencies first."""
    available = _find_modules(kernel)
    order: list[tuple[str, bytes]] = []
    seen: set[str] = set()

    def add(name: str) -> None:
        if name in seen or name not in available:
            return
        seen.add(name)
        data = _module_bytes(available[name])
        for dep in _depends(data):
            add(dep.replace("-", "_"))
        order.append((name, data))

    for name in NINEP_MODULES:
        add(name)
    if "9p" not in seen and not (kernel.modules / "modules.builtin").read_text().count("/9p.ko"):
        raise GuestError(f"{kernel.release} has neither a 9p module nor 9p built in")
    return order


def _cpio(entries: list[tuple[str, int, bytes]]) -> bytes:
    """An uncompressed newc archive of (name, mode, data) entries."""
    out = io.BytesIO()
    for ino, (name, mode, data) in enumerate(entries + [("TRAILER!!!", 0, b"")], start=1):
        encoded = name.encode() + b"\0"
        header = "070701" + "".join(f"{v:08x}" for v in (
            ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(encoded), 0))
        out.write(header.encode() + encoded)
        out.write(b"\0" * (-(110 + len(encoded)) % 4))
        out.write(data)
        out.write(b"\0" * (-len(data) % 4))
    return out.getvalue()


INIT = r"""#!/bin/busybox sh
# slatrace kernel tier: mount the host's root read-only over 9p, give the
# guest its own proc, sys, cgroups, tracefs and writable scratch, run the job.
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $(cat /modules.order); do insmod /modules/$m.ko || echo "init: insmod $m failed"; done
mkdir -p /newroot /host /results
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=262144,cache=loose hostroot /newroot \
    || { echo "init: cannot mount the host root"; poweroff -f; }
mount --bind /newroot /host
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 results /results
for d in proc sys dev; do mount --move /$d /newroot/$d; done
for d in tmp run var/tmp root var/log lib/modules; do mount -t tmpfs tmpfs /newroot/$d; done
mkdir -p /newroot/run/results
mount --move /results /newroot/run/results
# What the job needs from under a scratch directory (a checkout in /tmp):
# the host's own directory, bound back over the guest's empty one.
for p in $(cat /newroot/run/results/keep); do mkdir -p /newroot$p && mount --bind /host$p /newroot$p; done
mount -t devpts devpts /newroot/dev/pts 2>/dev/null
mount -t tmpfs tmpfs /newroot/dev/shm 2>/dev/null
mount -t tracefs nodev /newroot/sys/kernel/tracing
mount -t debugfs nodev /newroot/sys/kernel/debug
mount -t bpf bpf /newroot/sys/fs/bpf
mount -t tmpfs cgroup /newroot/sys/fs/cgroup
if grep -q '^cgroup-v1$' /newroot/run/results/cgroups 2>/dev/null; then
    for c in cpu,cpuacct memory pids; do
        mkdir -p /newroot/sys/fs/cgroup/$c
        mount -t cgroup -o $c cgroup /newroot/sys/fs/cgroup/$c
    done
else
    mount -t cgroup2 cgroup2 /newroot/sys/fs/cgroup
fi
ip link set lo up
chroot /newroot /bin/sh /run/results/job.sh > /newroot/run/results/job.log 2>&1
echo "init: job exited $?"
sync
poweroff -f
"""


def initramfs(kernel: Kernel) -> Path:
    """busybox-static, the kernel's own 9p modules and /init, cached per kernel."""
    path = CACHE / kernel.suite / f"initramfs-{kernel.release}.cpio"
    if path.is_file() and path.stat().st_mtime >= Path(__file__).stat().st_mtime:
        return path
    if not BUSYBOX.is_file():
        raise GuestError(f"{BUSYBOX} is missing: install busybox-static (make setup-test does)")
    modules = _needed(kernel)
    entries = [(d, 0o040755, b"") for d in ("bin", "dev", "proc", "sys", "modules", "newroot", "host", "results")]
    entries += [("bin/busybox", 0o100755, BUSYBOX.read_bytes()), ("init", 0o100755, INIT.encode()),
                ("modules.order", 0o100644, "".join(f"{n}\n" for n, _ in modules).encode())]
    entries += [(f"modules/{n}.ko", 0o100644, data) for n, data in modules]
    # Guests of one kernel may boot at once: each writes its own file, the last rename wins.
    tmp = path.with_suffix(f".tmp{os.getpid()}-{threading.get_ident()}")
    tmp.write_bytes(_cpio(entries))
    tmp.replace(path)
    return path


@dataclass
class GuestRun:
    kernel: Kernel
    results: Path       # the writable share: job.log and whatever the job wrote
    console: str
    seconds: float

    def log(self) -> str:
        p = self.results / "job.log"
        return p.read_text(errors="replace") if p.is_file() else ""


def boot(kernel: Kernel, job: str, results: Path, *, cgroup_v1: bool = False, keep: tuple[Path, ...] = (),
         timeout: float = 900, cpus: int = 2, memory_mb: int = 2048) -> GuestRun:
    """Boot `kernel` and run the shell script `job` in the host's root
    (chrooted, read-only), /run/results being `results`; with cgroup_v1 the
    guest mounts cgroup v1 hierarchies only, as a v1-only node does. The
    guest has scratch tmpfs over /tmp, /run, /var/tmp, /root and /var/log:
    `keep` names directories there it must see as the host has them (the
    checkout, when it lies in /tmp). Returns
    when the guest powered off; GuestError when it did not within `timeout`."""
    if shutil.which(QEMU) is None:
        raise GuestError(f"{QEMU} is missing: install qemu-system-x86 (make setup-test does)")
    results.mkdir(parents=True, exist_ok=True)
    (results / "job.sh").write_text(job)
    (results / "cgroups").write_text("cgroup-v1\n" if cgroup_v1 else "cgroup-v2\n")
    (results / "keep").write_text("".join(f"{Path(p).resolve()}\n" for p in keep))
    console = results / "console.log"
    argv = [QEMU, "-accel", "tcg,thread=single", "-cpu", "max", "-smp", str(cpus), "-m", f"{memory_mb}M",
            "-kernel", str(kernel.vmlinuz), "-initrd", str(initramfs(kernel)),
            "-append", "console=ttyS0 panic=-1 mitigations=off quiet",
            "-fsdev", "local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap",
            "-device", "virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot",
            "-fsdev", f"local,id=results,path={results},security_model=none,multidevs=remap",
            "-device", "virtio-9p-pci,fsdev=results,mount_tag=results",
            "-serial", f"file:{console}", "-display", "none", "-no-reboot", "-nic", "none"]
    start = time.monotonic()
    try:
        subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise GuestError(f"{kernel.release} did not power off within {timeout:.0f} s; console tail: "
                         f"{_tail(console)}") from None
    run = GuestRun(kernel, results, console.read_text(errors="replace") if console.is_file() else "",
                   time.monotonic() - start)
    if "init: job exited" not in run.console:
        raise GuestError(f"{kernel.release}: the job did not run to its end; console tail: {_tail(console)}")
    return run


def _tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "(no console output)"
