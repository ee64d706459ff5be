#!/usr/bin/env bash
# Packs target/wasm32-wasip1/release/redis_guard.wasm as a Wasm OCI image for
# Istio (Wasm image spec, "compat" variant) into an OCI image layout, without
# Docker:
#
#   target/oci/redis-guard        OCI layout, tag = the crate version
#     manifest   annotation module.wasm.image/variant=compat
#     config     os linux, architecture amd64 (what Istio's fetcher resolves)
#     layer      one application/vnd.oci.image.layer.v1.tar+gzip layer whose
#                only entry is plugin.wasm
#
# Needs umoci and GNU tar (Debian: apt-get install -y umoci). Run from anywhere;
# `make oci` runs it after `make build`. Every run rebuilds the layout from
# scratch; with the same .wasm and the same SOURCE_DATE_EPOCH (default: the
# last commit's time) it produces the same digests.
#
# Environment: WASM (input), LAYOUT (output directory), TAG (default: version
# from Cargo.toml), IMAGE (registry repository shown in the push command),
# SOURCE_DATE_EPOCH (timestamps in the image).
set -euo pipefail
cd "$(dirname "$0")/../.."

die() { echo "envoy/oci/build.sh: $*" >&2; exit 1; }

WASM=${WASM:-target/wasm32-wasip1/release/redis_guard.wasm}
LAYOUT=${LAYOUT:-target/oci/redis-guard}
IMAGE=${IMAGE:-ghcr.io/example/redis-guard}

command -v umoci >/dev/null || die "umoci not found: install it with 'apt-get install -y umoci' (Debian)"
tar --version 2>/dev/null | grep -q 'GNU tar' || die "GNU tar is required (Debian package tar)"
[ -f "$WASM" ] || die "missing $WASM: run 'make build' first"
[ "$(head -c 4 "$WASM" | od -An -tx1 | tr -d ' \n')" = 0061736d ] \
  || die "$WASM is not a WebAssembly module (no \\0asm header)"

if [ -z "${TAG:-}" ]; then
  # The version of [package] in Cargo.toml.
  TAG=$(awk '/^\[/ { in_package = ($0 == "[package]") }
             in_package && /^version[ \t]*=/ { gsub(/.*=[ \t]*"|".*/, ""); print; exit }' Cargo.toml)
  [ -n "$TAG" ] || die "cannot read the package version from Cargo.toml; set TAG"
fi
[[ "$TAG" =~ ^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$ ]] || die "TAG '$TAG' is not a valid image tag"

if [ -z "${SOURCE_DATE_EPOCH:-}" ]; then
  SOURCE_DATE_EPOCH=$(git log -1 --format=%ct 2>/dev/null || echo 0)
fi
[[ "$SOURCE_DATE_EPOCH" =~ ^[0-9]+$ ]] || die "SOURCE_DATE_EPOCH '$SOURCE_DATE_EPOCH' is not a number of seconds"
CREATED=$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)

work=$(mktemp -d "${TMPDIR:-/tmp}/redis-guard-oci.XXXXXX")
trap 'rm -rf "$work"' EXIT

# The layer, built with GNU tar rather than `umoci insert`: umoci 0.4.7
# (Debian 12) leaves the end-of-archive blocks out of inserted layers
# (opencontainers/umoci#436). ustar, one entry, no directory entries, fixed
# owner, mode and time.
mkdir "$work/root"
cp "$WASM" "$work/root/plugin.wasm"
tar --create --file "$work/layer.tar" --format=ustar \
  --owner=0 --group=0 --numeric-owner --mode=0644 --mtime="@$SOURCE_DATE_EPOCH" \
  -C "$work/root" plugin.wasm
[ "$(tar --list --file "$work/layer.tar")" = plugin.wasm ] || die "unexpected layer contents"

image="$work/image"
umoci init --layout "$image"
umoci new --image "$image:$TAG"
# Added verbatim (its digest is the config's diff_id) and gzip-compressed.
umoci raw add-layer --image "$image:$TAG" \
  --history.created "$CREATED" --history.created_by "envoy/oci/build.sh: plugin.wasm" \
  "$work/layer.tar"
umoci config --image "$image:$TAG" --no-history \
  --os linux --architecture amd64 --created "$CREATED" \
  --manifest.annotation module.wasm.image/variant=compat \
  --manifest.annotation org.opencontainers.image.title=redis-guard \
  --manifest.annotation "org.opencontainers.image.version=$TAG"
umoci gc --layout "$image"

# Replace the previous layout only once the new one is complete.
mkdir -p "$(dirname "$LAYOUT")"
rm -rf "$LAYOUT"
mv "$image" "$LAYOUT"

# The manifest digest: what a registry reports for the pushed tag, and the
# value for the WasmPlugin's `sha256` field.
digest=$(sed -n 's/.*"digest":"sha256:\([0-9a-f]\{64\}\)".*/\1/p' "$LAYOUT/index.json")
[ -n "$digest" ] || die "no manifest digest in $LAYOUT/index.json"

cat <<EOF
OCI image layout: $LAYOUT (tag $TAG)
  manifest sha256:$digest
  plugin.wasm      $(sha256sum "$WASM" | cut -d' ' -f1)  ($(stat -c %s "$WASM") bytes, from $WASM)
Push it (skopeo, Debian package; log in first with 'skopeo login ${IMAGE%%/*}'):
  skopeo copy oci:$LAYOUT:$TAG docker://$IMAGE:$TAG
Then in the WasmPlugin:
  url: oci://$IMAGE:$TAG
  sha256: $digest
EOF
