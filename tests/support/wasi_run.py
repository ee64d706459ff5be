#!/usr/bin/env python3
"""Cargo's runner for wasm32-wasip1 test binaries (Makefile `test-wasm32`):
`wasi_run.py TEST.wasm [libtest args...]` runs the binary under wasmtime with
WASI and exits with its exit code.

The filter runs as wasm32, where `usize` is 32 bits: the pure cores' tests run
there too, so an overflow a 64-bit native run cannot reach panics here (debug
build). The current directory (cargo's: the package root) is preopened under
its own absolute path, which is what `env!("CARGO_MANIFEST_DIR")` names, so
the tests read their fixtures as they do natively.
"""
import os
import sys

from wasmtime import Config, Engine, ExitTrap, Linker, Module, Store, Trap, WasiConfig, WasmtimeError


def main() -> int:
    config = Config()
    # Compiled code is cached on disk: a warm run skips Cranelift.
    config.cache = True
    engine = Engine(config)
    wasi = WasiConfig()
    wasi.argv = sys.argv[1:]
    wasi.inherit_env()
    wasi.inherit_stdout()
    wasi.inherit_stderr()
    cwd = os.getcwd()
    wasi.preopen_dir(cwd, cwd)
    wasi.preopen_dir(cwd, ".")
    store = Store(engine)
    store.set_wasi(wasi)
    linker = Linker(engine)
    linker.define_wasi()
    module = Module.from_file(engine, sys.argv[1])
    # The lib's test binary still imports the proxy-wasm host functions
    # (src/filter/proxy/, compiled for wasm32); no test calls them, and one
    # that did would trap rather than run against a host that is not there.
    linker.define_unknown_imports_as_traps(module)
    instance = linker.instantiate(store, module)
    try:
        instance.exports(store)["_start"](store)
    except ExitTrap as e:
        return e.code
    except (Trap, WasmtimeError) as e:
        # A panic aborts (no unwinding on wasm32), taking libtest's captured
        # output with it: the trap, its backtrace, and how to see the message.
        print(f"wasi_run.py: {sys.argv[1]}: {e}\n"
              "wasi_run.py: a panic aborts the whole binary; rerun the test named "
              "last above with `-- --nocapture NAME` for its message", file=sys.stderr)
        return 101
    return 0


if __name__ == "__main__":
    sys.exit(main())
