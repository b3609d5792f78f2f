#!/bin/sh
# `slatrace` inside the container image (installed as /usr/local/bin/slatrace):
# picks the kernel headers BCC compiles against, then runs the real command.
#
# The node's /lib/modules and /usr/src are mounted read-only by the DaemonSet.
# When the node ships headers for its running kernel, BCC finds them there by
# itself. When it does not (many cloud images), BCC is pointed at the Debian
# headers tree the image carries (scripts/setup.sh --headers-tree); that is safe
# because the BPF programs read tracepoint arguments only, whose layout BCC
# takes from the node's tracefs, never from the headers.
#
# Being the `slatrace` on PATH, it also serves `kubectl exec ... slatrace check`.
set -eu

fallback="${SLATRACE_FALLBACK_HEADERS:-/opt/slatrace/kernel-headers}"
release=$(uname -r)

if [ -z "${BCC_KERNEL_SOURCE:-}" ] && [ ! -e "/lib/modules/$release/build/include" ] \
        && [ -d "$fallback/include" ]; then
    BCC_KERNEL_SOURCE="$fallback"
    export BCC_KERNEL_SOURCE
    if [ "${1:-}" = run ]; then
        echo "slatrace: no kernel headers for $release on this node, using the image's" \
             "$(cat "$fallback/.slatrace-headers" 2>/dev/null || echo "$fallback")" >&2
    fi
fi

exec "${SLATRACE_BIN:-/opt/slatrace/.venv/bin/slatrace}" "$@"
