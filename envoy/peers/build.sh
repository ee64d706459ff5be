#!/usr/bin/env bash
# Builds the peers of make bench-peers from their public sources, never from
# a prebuilt binary:
#   limitador-server  (Kuadrant/limitador, release)      OUT/target/limitador/release/limitador-server
#   wasm_shim.wasm    (Kuadrant/wasm-shim, wasm32-wasip1) OUT/target/wasm-shim/wasm32-wasip1/release/wasm_shim.wasm
#
# Usage: envoy/peers/build.sh PEERS_SRC OUT
#   PEERS_SRC  the five repositories of sources.txt, unpacked (extract.sh):
#              PEERS_SRC/limitador, PEERS_SRC/wasm-shim, PEERS_SRC/cel-rust,
#              PEERS_SRC/proxy-wasm-rust-sdk, PEERS_SRC/wasm-test-framework
#   OUT        the build directory (make bench-peers: target/bench-peers/build)
# ONLY=limitador|wasm-shim builds one of them. PEERS_ANY_REV=1 builds sources
# at other revisions than sources.txt pins (the results then say which).
#
# PEERS_SRC is only read: the sources are copied to OUT/src, where wasm-shim's
# manifest gets the [patch] entries for its git dependencies (cargo cannot
# fetch them here) and the SDK copy gets proxy-wasm-kuadrant-compat.patch.
# First build: limitador-server about 20 min of both cores (its release
# profile has lto = true and codegen-units = 1, and rocksdb is a default
# feature), wasm-shim about 2 min; later runs only check them. On a shared
# machine run it under `nice -n 19`.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src=${1:-}
out=${2:?usage: $0 PEERS_SRC OUT}
ONLY=${ONLY:-}

pins() { grep -v '^[[:space:]]*#' "$here/sources.txt" | awk 'NF'; }

no_sources() {
  {
    echo "bench-peers: $1"
    echo "PEERS_SRC must be a directory with the sources of these five public repositories, at these"
    echo "revisions (envoy/peers/sources.txt):"
    pins | while read -r dir repo rev _; do printf '  PEERS_SRC/%-20s github:%s @ %s\n' "$dir" "$repo" "$rev"; done
    echo "Unpack them from git repositories with: PEERS_GIT_ROOT=DIR envoy/peers/extract.sh PEERS_SRC"
    echo "(envoy/peers/README.md); then: make bench-peers PEERS_SRC=PEERS_SRC. Nothing prebuilt is downloaded."
  } >&2
  exit 2
}

[[ -n "$src" ]] || no_sources "PEERS_SRC is not set"
[[ -d "$src" ]] || no_sources "PEERS_SRC=$src is not a directory"
src=$(cd "$src" && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)

# The revision of a source tree: extract.sh's stamp, else its git HEAD.
source_rev() {
  if [[ -f "$1/.peers-source-rev" ]]; then
    cut -d' ' -f1 "$1/.peers-source-rev"
  else
    git -C "$1" rev-parse HEAD 2>/dev/null || echo unknown
  fi
}

while read -r dir repo rev _; do
  [[ -f "$src/$dir/Cargo.toml" ]] || no_sources "no sources of $repo in $src/$dir"
  got=$(source_rev "$src/$dir")
  if [[ "$got" != "$rev" ]]; then
    if [[ -z "${PEERS_ANY_REV:-}" ]]; then
      no_sources "$src/$dir is $repo at ${got}, not the pinned $rev (PEERS_ANY_REV=1 builds it anyway)"
    fi
    echo "bench-peers: warning: $repo at $got, not the pinned $rev (PEERS_ANY_REV)" >&2
  fi
done < <(pins)

# Build tools: protoc (both compile .proto files), clang and libclang
# (bindgen, for rocksdb: Limitador's disk storage, a default feature), cmake.
need=""
command -v protoc >/dev/null || need="$need protobuf-compiler"
command -v clang >/dev/null || need="$need clang"
dpkg -s libclang-dev >/dev/null 2>&1 || need="$need libclang-dev"
command -v cmake >/dev/null || need="$need cmake"
if [[ -n "$need" ]]; then
  if [[ "$(id -u)" = 0 ]]; then
    echo "installing:$need"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $need >/dev/null
  else
    echo "bench-peers: missing Debian packages:$need — run: sudo apt-get install$need" >&2
    exit 1
  fi
fi
rustup target list --installed | grep -qx wasm32-wasip1 || rustup target add wasm32-wasip1

# OUT/src/<dir>: a copy of each source tree, made again only when its
# revision changed (or is unknown), so cargo sees unchanged files unchanged.
# The builds' target directories are outside the copies.
copy() {
  local dir=$1 rev copied=""
  rev="$(source_rev "$src/$dir") $src/$dir"
  [[ -f "$out/src/$dir/.peers-copy" ]] && copied=$(cat "$out/src/$dir/.peers-copy")
  if [[ "$rev" == unknown* || "$copied" != "$rev" ]]; then
    rm -rf "${out:?}/src/$dir"
    mkdir -p "$out/src/$dir"
    tar -C "$src/$dir" --exclude=./target -cf - . | tar -C "$out/src/$dir" -xf -
    echo "$rev" >"$out/src/$dir/.peers-copy"
    echo "copied $src/$dir -> $out/src/$dir"
  fi
}
while read -r dir _; do copy "$dir"; done < <(pins)

if [[ -z "$ONLY" || "$ONLY" == limitador ]]; then
  echo "== limitador-server (Kuadrant/limitador @ $(source_rev "$out/src/limitador"))"
  start=$SECONDS
  # --locked: exactly the dependency versions of the pinned Cargo.lock.
  # Its build script puts `git rev-parse HEAD` into --version, else
  # GITHUB_SHA (what its CI sets). The copy is no repository: without the
  # ceiling git found the one OUT sits in (redis-guard's) and Limitador named
  # that commit; GITHUB_SHA names the one built.
  (cd "$out/src/limitador" && CARGO_TARGET_DIR="$out/target/limitador" \
    GIT_CEILING_DIRECTORIES="$out/src" GITHUB_SHA="$(source_rev "$out/src/limitador")" \
    cargo build --release --locked -p limitador-server)
  "$out/target/limitador/release/limitador-server" --version
  echo "limitador-server: $((SECONDS - start)) s"
fi

if [[ -z "$ONLY" || "$ONLY" == wasm-shim ]]; then
  echo "== wasm-shim (Kuadrant/wasm-shim @ $(source_rev "$out/src/wasm-shim"))"
  start=$SECONDS
  sdk=$out/src/proxy-wasm-rust-sdk
  # wasm-shim is written against Kuadrant's fork of proxy-wasm-rust-sdk, whose
  # helpers get_plugin_configuration, get_grpc_call_response_body,
  # set_tick_period, resume_http_request and resume_http_response return
  # Result instead of unwrapping. The fork is not public; this patch gives
  # upstream v0.2.5 those five signatures (the same hostcalls underneath).
  # Without it wasm-shim fails with six E0308/E0599 errors.
  patch_file=$here/proxy-wasm-kuadrant-compat.patch
  if patch -d "$sdk" -p1 -R --dry-run -s -f <"$patch_file" >/dev/null 2>&1; then
    echo "proxy-wasm compat patch already applied"
  else
    patch -d "$sdk" -p1 -f <"$patch_file"
  fi
  toml=$out/src/wasm-shim/Cargo.toml
  [[ -f "$toml.orig" ]] || cp "$toml" "$toml.orig"
  # The [patch] block, written anew from the pristine manifest on every run:
  # wasm-shim's git dependencies from the local copies.
  cp "$toml.orig" "$toml"
  cat >>"$toml" <<EOF

# >>> make bench-peers: git dependencies from local copies (envoy/peers/build.sh)
[patch."https://github.com/cel-rust/cel-rust.git"]
cel = { path = "$out/src/cel-rust/cel" }

[patch."https://github.com/Kuadrant/proxy-wasm-rust-sdk.git"]
proxy-wasm = { path = "$sdk" }

[patch."https://github.com/Kuadrant/wasm-test-framework.git"]
proxy-wasm-test-framework = { path = "$out/src/wasm-test-framework" }
# <<< make bench-peers
EOF
  (cd "$out/src/wasm-shim" && CARGO_TARGET_DIR="$out/target/wasm-shim" \
    cargo build --release --target wasm32-wasip1 -p wasm-shim)
  ls -l "$out/target/wasm-shim/wasm32-wasip1/release/wasm_shim.wasm"
  echo "wasm-shim: $((SECONDS - start)) s"
fi
