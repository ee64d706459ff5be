#!/usr/bin/env bash
# Unpacks the peers' sources (sources.txt: five repositories, each at its
# pinned revision) from git repositories into DEST, the directory
# `make bench-peers PEERS_SRC=DEST` builds from:
#
#   DEST/limitador  DEST/wasm-shim  DEST/cel-rust  DEST/proxy-wasm-rust-sdk
#   DEST/wasm-test-framework
#
# each with a .peers-source-rev file (commit and repository) that build.sh
# checks against sources.txt.
#
# Usage: PEERS_GIT_ROOT=DIR envoy/peers/extract.sh DEST
#   where DIR/<owner>+<name>/repo is each repository's git directory (a bare
#   snapshot, as a mirror tool leaves it; a clone's .git works too), or one
#   variable per repository: LIMITADOR_GIT WASM_SHIM_GIT CEL_RUST_GIT
#   PROXY_WASM_SDK_GIT WASM_TEST_FRAMEWORK_GIT.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dest=${1:?usage: PEERS_GIT_ROOT=DIR $0 DEST}
mkdir -p "$dest"

git_dir() { # dir repo -> the git directory holding repo
  local var
  var=$(echo "$1" | tr 'a-z-' 'A-Z_')_GIT
  var=${var/PROXY_WASM_RUST_SDK/PROXY_WASM_SDK}
  local g=${!var:-}
  if [[ -z "$g" ]]; then
    : "${PEERS_GIT_ROOT:?set PEERS_GIT_ROOT (or $var) to where the git repositories are}"
    g=$PEERS_GIT_ROOT/${2/\//+}/repo
  fi
  [[ -d "$g/.git" ]] && g=$g/.git
  [[ -d "$g" ]] || { echo "extract.sh: no git directory for $2 ($var or $g)" >&2; exit 1; }
  echo "$g"
}

grep -v '^[[:space:]]*#' "$here/sources.txt" | while read -r dir repo rev _; do
  [[ -n "$dir" ]] || continue
  g=$(git_dir "$dir" "$repo")
  if ! git --git-dir="$g" cat-file -e "$rev^{commit}" 2>/dev/null; then
    echo "extract.sh: $repo has no commit $rev in $g (fetch a newer snapshot)" >&2
    exit 1
  fi
  rm -rf "${dest:?}/$dir"
  mkdir -p "$dest/$dir"
  # Limitador's tree holds a stray coverage file (default.profraw) whose blob
  # some snapshots lack: `git archive` would stop half-way. It is not source.
  git --git-dir="$g" archive "$rev" -- . ':(exclude)default.profraw' | tar -x -C "$dest/$dir"
  echo "$rev $repo" >"$dest/$dir/.peers-source-rev"
  echo "unpacked $repo @ ${rev:0:12} -> $dest/$dir"
done
