#!/usr/bin/env bash
# Idempotent host set-up for slatrace: Debian packages, a kernel-headers
# fallback for BCC, tracefs, and the project venv. Used by `make setup`,
# `make run`, `make test` and the Dockerfile, so every install step lives here.
#
#   scripts/setup.sh           everything (host packages + venv)
#   scripts/setup.sh --host    packages, headers fallback and tracefs only
#   scripts/setup.sh --venv    the venv only
#   scripts/setup.sh --deps    the venv from pyproject.toml alone: the pinned
#                              dependencies and, in image mode, slatrace installed
#                              editable, so the code can come in a later layer
#   scripts/setup.sh --headers-tree DIR
#                              Debian's kernel headers merged into one DIR, the
#                              form BCC_KERNEL_SOURCE takes
#   SLATRACE_SETUP_TEST=1      also the packages the test suite and benchmarks use,
#                              and the real vLLM engine of the inference tier in a
#                              venv of its own (scripts/setup-vllm.sh, built once)
#   SLATRACE_SETUP_IMAGE=1     building the container image (Dockerfile): mounts
#                              nothing, ships the headers tree but not the compiler
#                              the headers package pulls in, no test extras
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
venv="${SLATRACE_VENV:-$here/.venv}"
mode="${1:-all}"
image="${SLATRACE_SETUP_IMAGE:-0}"
# Where the image keeps its kernel-headers fallback; scripts/container-entrypoint.sh
# points BCC there when the node has no headers of its own.
image_headers="${SLATRACE_IMAGE_HEADERS:-/opt/slatrace/kernel-headers}"

log() { printf 'setup: %s\n' "$*" >&2; }
die() { printf 'setup: error: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "run as root (apt-get, mounting tracefs and loading BPF need it): sudo make setup"

apt_updated=0
apt_install() {
    local missing=()
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ $apt_updated -eq 0 ]; then
        log "apt-get update"
        DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
        apt_updated=1
    fi
    log "installing ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# Runs "$@" with package maintainer scripts forbidden to start services (the
# policy-rc.d convention), unless the host already has such a policy.
without_service_start() {
    local policy=/usr/sbin/policy-rc.d
    if [ -e "$policy" ]; then "$@"; return; fi
    printf '#!/bin/sh\nexit 101\n' > "$policy"
    chmod 0755 "$policy"
    local rc=0
    "$@" || rc=$?
    rm -f "$policy"
    return $rc
}

# Sets hdr and common to the newest Debian linux-headers-*-amd64 and -common
# directories, installing linux-headers-amd64 first if needed.
debian_headers() {
    apt_install linux-headers-amd64
    hdr=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -n 1)
    common=$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -n 1)
    [ -n "$hdr" ] && [ -n "$common" ] || die "no kernel headers under /usr/src after installing linux-headers-amd64"
}

# BCC_KERNEL_SOURCE names one directory, while Debian splits the headers into
# -common and -amd64 (generated files): copy both into one tree, -amd64 on top.
# A copy, not links: in a pod the node's /usr/src is mounted over the image's.
headers_tree() {
    local dest="$1" hdr common
    [ -n "$dest" ] || die "--headers-tree needs a directory"
    debian_headers
    rm -rf "$dest.tmp"
    mkdir -p "$dest.tmp"
    cp -a "$common/." "$dest.tmp/"
    cp -a "$hdr/." "$dest.tmp/"
    # BCC includes the running architecture's headers only, and nothing the
    # BPF programs include reaches the device-driver and firmware headers.
    local arch
    case "$(uname -m)" in
        x86_64|i?86) arch=x86 ;;
        aarch64) arch=arm64 ;;
        *) arch=$(uname -m) ;;
    esac
    find "$dest.tmp/arch" -mindepth 1 -maxdepth 1 ! -name "$arch" -exec rm -rf {} +
    (cd "$dest.tmp/include" && rm -rf drm sound media dt-bindings scsi target ufs video xen soc rdma \
        pcmcia kunit math-emu ras misc memory)
    rm -f "$dest.tmp/Module.symvers"
    basename "$hdr" > "$dest.tmp/.slatrace-headers"
    rm -rf "$dest"
    mv "$dest.tmp" "$dest"
    log "kernel headers tree ($(basename "$hdr")) at $dest"
}

setup_host() {
    # Debian's BCC (the PyPI package called "bcc" is an unrelated library).
    if [ "$image" = 1 ]; then
        # The venv brings its own pip.
        apt_install python3-bpfcc python3-venv ca-certificates
    else
        apt_install python3-bpfcc python3-venv python3-pip ca-certificates
    fi
    if [ "${SLATRACE_SETUP_TEST:-0}" = 1 ]; then
        # gcc + libc6-dev: the scale tests and bench build a tiny C worker at run time
        apt_install bpfcc-tools stress-ng rt-tests linux-perf bpftool prometheus util-linux libcap2-bin \
            gcc libc6-dev
        # The container tier (tests/container): Docker builds the image, its
        # containerd runs it, debootstrap makes the base image when no registry
        # is reachable, and containers-common is CRI-O's and podman's seccomp
        # profile. No service may start from a package's postinst: the tests run
        # a private dockerd of their own.
        without_service_start apt_install docker.io debootstrap golang-github-containers-common
        # The kernel tier (tests/qemu): Debian's kernels boot under qemu's
        # emulator with a busybox initramfs; the kernels themselves are fetched
        # from Debian's registry by the tier and cached.
        apt_install qemu-system-x86 busybox-static
        # tests/schema: Grafana's dashboard model from npm, with the machine's
        # node (Debian's nodejs when there is none).
        command -v node >/dev/null && command -v npm >/dev/null || apt_install nodejs npm
        "$here/scripts/setup-grafana-schema.sh"
    fi

    if [ "$image" = 1 ]; then
        # An image build: the node's kernel is unknown until the pod starts, and
        # the node's /lib/modules and tracefs are mounted by the DaemonSet (nothing
        # can be mounted during a build). Ship the fallback headers tree only.
        headers_tree "$image_headers"
        # linux-headers-amd64 pulls in gcc, cpp and binutils for building modules;
        # the tree is a copy, so the packages (and the compiler) go again.
        log "removing the kernel headers packages and their toolchain"
        DEBIAN_FRONTEND=noninteractive apt-get purge -y -qq 'linux-headers-*' 'linux-kbuild-*' >/dev/null
        # (binutils stays otherwise: python3.11 suggests it.)
        DEBIAN_FRONTEND=noninteractive apt-get autoremove --purge -y -qq \
            -o APT::AutoRemove::SuggestsImportant=false >/dev/null
        apt-get clean
        rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt /var/log/dpkg.log \
            /usr/share/doc /usr/share/man /usr/share/info
        find /usr/share/locale -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} +
        # glibc's iconv character-set modules (~9 MB): Python decodes with its
        # own codecs and nothing else the agent runs converts through glibc.
        find /usr/lib -maxdepth 2 -type d -name gconv -prune -exec rm -rf {} +
        # Debian's Python modules as bytecode only (~13 MB of sources): the
        # image never edits them, and imports find the .pyc where the .py was.
        local stdlib
        stdlib=$(/usr/bin/python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
        /usr/bin/python3 -m compileall -q -b -j 0 "$stdlib" /usr/lib/python3/dist-packages >/dev/null || true
        find "$stdlib" /usr/lib/python3/dist-packages -name '*.py' -delete
        find "$stdlib" /usr/lib/python3/dist-packages -name __pycache__ -type d -prune -exec rm -rf {} +
        /usr/bin/python3 -c "import asyncio, json, ssl, venv, ensurepip, bcc" \
            || die "Debian's Python no longer imports as bytecode only"
        return 0
    fi

    # BCC compiles against /lib/modules/$(uname -r)/build. When the running
    # kernel has no headers, point it at Debian's generic ones. Our BPF code
    # reads only tracepoint args, whose layout BCC takes from tracefs, so the
    # header version does not change what the programs compute.
    local kver moddir
    kver=$(uname -r)
    moddir="/lib/modules/$kver"
    if [ ! -e "$moddir/build/include" ] && [ -z "${BCC_KERNEL_SOURCE:-}" ]; then
        local hdr common
        debian_headers
        mkdir -p "$moddir"
        ln -sfn "$hdr" "$moddir/build"
        ln -sfn "$common" "$moddir/source"
        log "kernel headers for $kver missing: using $hdr"
    fi

    # tracefs: BCC reads tracepoint formats from it.
    if [ ! -e /sys/kernel/tracing/events/sched/sched_switch/format ]; then
        mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null \
            || die "cannot mount tracefs at /sys/kernel/tracing"
        log "mounted tracefs at /sys/kernel/tracing"
    fi
    # BCC still looks under debugfs on some versions.
    if [ -d /sys/kernel/debug ] && [ ! -e /sys/kernel/debug/tracing/events ]; then
        mountpoint -q /sys/kernel/debug || mount -t debugfs nodev /sys/kernel/debug 2>/dev/null || true
    fi
}

make_venv() {
    # The venv must see Debian's bcc module in /usr/lib/python3/dist-packages,
    # so it is built from the system python with system site packages.
    if [ ! -x "$venv/bin/python" ]; then
        log "creating $venv"
        /usr/bin/python3 -m venv --system-site-packages "$venv"
    fi
}

check_bcc() {
    "$venv/bin/python" -c "import bcc" 2>/dev/null \
        || die "the venv cannot import bcc: is python3-bpfcc installed for /usr/bin/python3?"
}

# The pinned requirements of pyproject.toml (build system, dependencies and,
# outside the image, the test extras), one per line.
requirements() {
    /usr/bin/python3 - "$here/pyproject.toml" "$image" <<'PY'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)
reqs = project["build-system"]["requires"] + project["project"]["dependencies"]
if sys.argv[2] != "1":
    reqs += project["project"].get("optional-dependencies", {}).get("test", [])
print("\n".join(reqs))
PY
}

# The directory of every package pyproject.toml lists, relative to $here, with
# __init__.py for the Python packages (those mapped with package-dir hold data:
# bpf/ is the namespace package agent.bpf).
package_files() {
    /usr/bin/python3 - "$here/pyproject.toml" <<'PY'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    st = tomllib.load(f)["tool"]["setuptools"]
mapped = st.get("package-dir", {})
for pkg in st["packages"]:
    print(mapped[pkg] + "/" if pkg in mapped else pkg.replace(".", "/") + "/__init__.py")
PY
}

setup_deps() {
    make_venv
    log "installing slatrace's dependencies into $venv"
    local reqs
    reqs=$(mktemp)
    requirements > "$reqs"
    "$venv/bin/pip" install -q --disable-pip-version-check --no-cache-dir -r "$reqs"
    rm -f "$reqs"
    if [ "$image" = 1 ]; then
        # slatrace itself, editable: the venv maps its packages to $here, where
        # the code arrives in a later layer. The packages are created empty for
        # the install (and removed again when this run made them).
        local made=() f top
        for f in $(package_files) README.md; do
            top="$here/${f%%/*}"
            [ -e "$top" ] || made+=("$top")
            if [ "${f%/}" != "$f" ]; then mkdir -p "$here/$f"
            else mkdir -p "$(dirname "$here/$f")"; [ -e "$here/$f" ] || : > "$here/$f"; fi
        done
        "$venv/bin/pip" install -q --disable-pip-version-check --no-cache-dir --no-deps \
            --no-build-isolation -e "$here"
        rm -rf "${made[@]}"
        # What the running agent never imports, ~110 MB: the kubernetes client's
        # asyncio twin (the agent uses the threaded client) with aiohttp and
        # the packages only aiohttp needs, then the install tooling itself.
        local k8s
        k8s=$(echo "$venv"/lib/python3*/site-packages/kubernetes)
        rm -rf "$k8s/aio"
        "$venv/bin/pip" uninstall -q -y aiohttp aiohttp-retry aiohappyeyeballs aiosignal frozenlist \
            multidict propcache yarl attrs >/dev/null
        # rich draws the CLI's tables without pygments (syntax highlighting)
        # or markdown-it (Markdown rendering): ~11 MB the image never runs.
        "$venv/bin/pip" uninstall -q -y pygments markdown-it-py mdurl >/dev/null
        "$venv/bin/pip" uninstall -q -y pip setuptools wheel >/dev/null
        # The packages' own test suites and type stubs (numpy's alone are ~20 MB).
        local site
        site=$(echo "$venv"/lib/python3*/site-packages)
        find "$site" -type d -name tests -prune -exec rm -rf {} +
        find "$site" -name '*.pyi' -delete
        # Every package as bytecode only, next to where its sources were, so it
        # still imports: pip left each module twice (source and __pycache__),
        # the kubernetes client alone has 34 MB of generated sources, and the
        # image never edits them (PYTHONDONTWRITEBYTECODE keeps it that way).
        "$venv/bin/python" -m compileall -q -b -j 0 "$site" >/dev/null
        find "$site" -name '*.py' -delete
        find "$site" -name __pycache__ -type d -prune -exec rm -rf {} +
        "$venv/bin/python" -c "import numpy, grpc, yaml, prometheus_client, psutil, rich.console, rich.table
import opentelemetry.sdk.trace, opentelemetry.exporter.otlp.proto.grpc.trace_exporter
import kubernetes.client, kubernetes.watch, kubernetes.config
kubernetes.client.ApiClient().sanitize_for_serialization(kubernetes.client.V1Pod(metadata=kubernetes.client.V1ObjectMeta(name='p')))" \
            || die "the venv no longer imports as bytecode only, without its test suites and asyncio part"
    fi
    check_bcc
}

setup_venv() {
    make_venv
    local stamp="$venv/.slatrace-installed"
    # The image runs the agent only: no test extras there.
    local spec="$here[test]"
    if [ "$image" = 1 ]; then spec="$here"; fi
    if [ ! -f "$stamp" ] || [ "$here/pyproject.toml" -nt "$stamp" ]; then
        log "installing slatrace and its dependencies into $venv"
        "$venv/bin/pip" install -q --disable-pip-version-check -e "$spec"
        touch "$stamp"
    fi
    check_bcc
}

case "$mode" in
    all)
        setup_host
        setup_venv
        if [ "${SLATRACE_SETUP_TEST:-0}" = 1 ] && [ "$image" != 1 ]; then
            "$here/scripts/setup-vllm.sh"
        fi
        ;;
    --host) setup_host ;;
    --venv) setup_venv ;;
    --deps) setup_deps ;;
    --headers-tree) headers_tree "${2:-}" ;;
    *) die "unknown argument $mode (use --host, --venv, --deps or --headers-tree DIR)" ;;
esac
