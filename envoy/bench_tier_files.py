"""make bench-tier's files, shared by envoy/bench_tier.py (which writes
them) and envoy/bench_tier_valkey.py (which replays them on Valkey): the
output directory, the CLI that writes the calls, and where each case's
calls go. Its own module so that neither script imports the other."""
import bench as B

OUT = B.ROOT / "target" / "bench-tier"
CLI = B.ROOT / "target" / "release" / "redis-guard"


def calls_path(case_id):
    """The calls `redis-guard wire` wrote for case `case_id`, one a line."""
    return OUT / f"{case_id}.calls"
