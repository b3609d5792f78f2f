#!/usr/bin/env bash
# Installs what tests/schema needs to check the dashboards against Grafana's own
# dashboard model: the pinned @grafana/schema releases (one per dashboard
# schemaVersion), ts-json-schema-generator, typescript and ajv, exactly as
# tests/schema/package-lock.json names them, with the machine's node and npm.
# Idempotent: a second run with the same lock file and node is a no-op.
#
#   scripts/setup-grafana-schema.sh    (setup.sh runs it under SLATRACE_SETUP_TEST=1)
#   SLATRACE_GRAFANA_SCHEMA_DIR        where node_modules goes
#                                      (default .cache/grafana-schema in the repository)
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
src="$here/tests/schema"
dest="${SLATRACE_GRAFANA_SCHEMA_DIR:-$here/.cache/grafana-schema}"

die() { printf 'setup-grafana-schema: error: %s\n' "$*" >&2; exit 1; }

command -v node >/dev/null && command -v npm >/dev/null \
    || die "node and npm are not installed (apt-get install nodejs npm)"
major=$(node -p 'process.versions.node.split(".")[0]')
[ "$major" -ge 18 ] || die "node $(node --version) is too old: ts-json-schema-generator 2.4 needs node 18 or newer"

stamp="$(cat "$src/package.json" "$src/package-lock.json" | sha256sum | cut -d' ' -f1) node $(node --version)"
if [ -d "$dest/node_modules" ] && [ "$(cat "$dest/.installed" 2>/dev/null)" = "$stamp" ]; then
    exit 0
fi

printf 'setup: installing Grafana dashboard schemas for the tests into %s\n' "$dest" >&2
rm -rf "$dest.tmp"
mkdir -p "$dest.tmp"
cp "$src/package.json" "$src/package-lock.json" "$dest.tmp/"
(cd "$dest.tmp" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error >/dev/null) \
    || die "npm ci failed in $dest.tmp (is the npm registry reachable?)"
echo "$stamp" > "$dest.tmp/.installed"
rm -rf "$dest"
mv "$dest.tmp" "$dest"
