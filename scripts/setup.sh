#!/usr/bin/env bash
# Idempotent host set-up for slatrace: Debian packages, a kernel-headers
# fallback for BCC, tracefs, and the project venv. Used by `make setup`,
# `make run`, `make test` and the Dockerfile, so every install step lives here.
#
#   scripts/setup.sh           everything (host packages + venv)
#   scripts/setup.sh --host    packages, headers fallback and tracefs only
#   scripts/setup.sh --venv    the venv only
#   scripts/setup.sh --headers-tree DIR
#                              Debian's kernel headers merged into one DIR, the
#                              form BCC_KERNEL_SOURCE takes
#   SLATRACE_SETUP_TEST=1      also the packages the test suite and benchmarks use
#   SLATRACE_SETUP_IMAGE=1     building the container image (Dockerfile): mounts
#                              nothing, ships the headers tree, no test extras
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
    basename "$hdr" > "$dest.tmp/.slatrace-headers"
    rm -rf "$dest"
    mv "$dest.tmp" "$dest"
    log "kernel headers tree ($(basename "$hdr")) at $dest"
}

setup_host() {
    # Debian's BCC (the PyPI package called "bcc" is an unrelated library).
    apt_install python3-bpfcc python3-venv python3-pip ca-certificates
    if [ "${SLATRACE_SETUP_TEST:-0}" = 1 ]; then
        # gcc + libc6-dev: the scale tests and bench build a tiny C worker at run time
        apt_install bpfcc-tools stress-ng rt-tests linux-perf bpftool prometheus util-linux libcap2-bin \
            gcc libc6-dev
    fi

    if [ "$image" = 1 ]; then
        # An image build: the node's kernel is unknown until the pod starts, and
        # the node's /lib/modules and tracefs are mounted by the DaemonSet (nothing
        # can be mounted during a build). Ship the fallback headers tree only.
        headers_tree "$image_headers"
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

setup_venv() {
    # The venv must see Debian's bcc module in /usr/lib/python3/dist-packages,
    # so it is built from the system python with system site packages.
    if [ ! -x "$venv/bin/python" ]; then
        log "creating $venv"
        /usr/bin/python3 -m venv --system-site-packages "$venv"
    fi
    local stamp="$venv/.slatrace-installed"
    # The image runs the agent only: no test extras there.
    local spec="$here[test]"
    if [ "$image" = 1 ]; then spec="$here"; fi
    if [ ! -f "$stamp" ] || [ "$here/pyproject.toml" -nt "$stamp" ]; then
        log "installing slatrace and its dependencies into $venv"
        "$venv/bin/pip" install -q --disable-pip-version-check -e "$spec"
        touch "$stamp"
    fi
    "$venv/bin/python" -c "import bcc" 2>/dev/null \
        || die "the venv cannot import bcc: is python3-bpfcc installed for /usr/bin/python3?"
}

case "$mode" in
    all) setup_host; setup_venv ;;
    --host) setup_host ;;
    --venv) setup_venv ;;
    --headers-tree) headers_tree "${2:-}" ;;
    *) die "unknown argument $mode (use --host, --venv or --headers-tree DIR)" ;;
esac
