"""The checkers checked: each must flag a history that breaks its bound by
one admission and pass the same history within it. Run before every soak
(a checker that flags nothing would make a clean table say nothing)."""

from . import check, config


def admissions(times_ms, latency_ms=1.0, wall0=1_800_000_000.0):
    """(sent, done, wall sent, wall done) for decisions at `times_ms`."""
    return [(t / 1000, (t + latency_ms) / 1000, wall0 + t / 1000, wall0 + (t + latency_ms) / 1000)
            for t in times_ms]


def flags(fn, *args):
    out = []
    fn(*args, out)
    return bool(out)


def run():
    failures = []

    def expect(name, got, want):
        if got != want:
            failures.append(f"{name}: flagged {got}, expected {want}")

    cap, per_ms = check.rate_bound("tb")
    burst = int(cap)
    # A full bucket at once, then one per refill period: within the bound;
    # one more in the burst: past it.
    period = 1 / per_ms
    ok = [0.0] * burst + [period * k + 5 for k in range(1, 5)]
    expect("token bucket within", flags(check.check_bucket, "tb", "u", admissions(ok)), False)
    expect("token bucket past", flags(check.check_bucket, "tb", "u",
                                      admissions(sorted(ok + [1.0]))), True)
    s = config.LIMITS["sw"]["slidingWindow"]
    lim, w = s["limit"], s["windowMs"]
    spaced = [k * (w / lim) + 2 for k in range(2 * lim)]
    expect("sliding window within", flags(check.check_window, "sw", "u", admissions(spaced),
                                          lim, w), False)
    expect("sliding window past", flags(check.check_window, "sw", "u",
                                        admissions(sorted(spaced + [w / 2])), lim, w), True)
    f = config.LIMITS["fw"]["fixedWindow"]
    base = 3_600_000 * 500_000  # an aligned window's start, in ms
    inside = [base + 10 * k for k in range(f["limit"])]
    expect("fixed window within", flags(check.check_aligned, "fw", "u",
                                        admissions(inside, wall0=0.0), f["limit"],
                                        f["windowMs"]), False)
    expect("fixed window past", flags(check.check_aligned, "fw", "u",
                                      admissions(inside + [base + 500], wall0=0.0), f["limit"],
                                      f["windowMs"]), True)
    class Rec:
        import threading
        lock = threading.Lock()
        keys = {"k": {"path": "/pay/k", "answers": [("200", b'{"path": "/pay/k"}')],
                      "no_answer": 0, "completed": True, "replayed": True}}
    out = []
    check.check_keys(Rec, {"byPath": {"/pay/k": 1}}, 0, out)
    expect("a key run once", bool(out), False)
    check.check_keys(Rec, {"byPath": {"/pay/k": 2}}, 1, out)
    expect("a key run twice, a store failed", bool(out), False)
    check.check_keys(Rec, {"byPath": {"/pay/k": 2}}, 0, out)
    expect("a key run twice", bool(out), True)
    return failures
