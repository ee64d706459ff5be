"""The cost gate (make cost-gate, tests/cost_gate.rs): the release filter run
under wasmtime with a recording proxy-wasm host, counting every ABI import it
calls and the wasm fuel it burns per request of each bench scenario, against
budgets.json. Deterministic: a virtual clock, seeded randomness, fixed
replies; no timing anywhere.

  host.py       the proxy-wasm host (ABI 0.2.1 imports, WASI, the recorder)
  webdis.py     Webdis' side: what each script call the filter sends answers
  scenarios.py  the bench scenarios (envoy/bench.py's configs) and the driver
  run.py        runs them, compares with budgets.json, reports
"""
