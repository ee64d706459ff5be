//! The filter's Lua scripts called exactly as the filter sends them (KEYS and
//! ARGV in the order each script's header documents), and their replies
//! parsed, for the script tests (tests/lua_*.rs). One builder per script, so
//! a change of a script's contract is made here once.

use std::sync::LazyLock;

use redis::{Cmd, Connection, Value};
use redis_guard::scripts::{
    Script, BATCH, CC_RELEASE, CC_RENEW, IDEM_COMPLETE, IDEM_RELEASE, RATELIMIT,
};

// ---------------------------------------------------------------------------
// Sending a script

/// EVAL of the script's source: what the filter sends after NOSCRIPT.
pub fn eval(script: &Script) -> Cmd {
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(&script.source);
    cmd
}

/// EVALSHA by the SHA-1 the filter sends (the script must be loaded).
pub fn evalsha(script: &Script) -> Cmd {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(&script.sha1);
    cmd
}

/// SCRIPT LOAD; returns the SHA-1 Redis names the script by.
pub fn load(con: &mut Connection, script: &Script) -> String {
    redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(&script.source)
        .query(con)
        .unwrap()
}

/// EVAL with hand-made KEYS and ARGV (text or bytes), for the contract
/// errors and packed batches.
pub fn eval_raw<K: redis::ToRedisArgs, A: redis::ToRedisArgs>(
    con: &mut Connection,
    script: &Script,
    keys: &[K],
    argv: &[A],
) -> redis::RedisResult<Value> {
    eval(script).arg(keys.len()).arg(keys).arg(argv).query(con)
}

// ---------------------------------------------------------------------------
// A test clock

/// The clock preamble of lua/ratelimit.lua and lua/batch.lua: Redis TIME,
/// in ms, read once.
const TIME_PREAMBLE: &str = "local t = redis.call('TIME')\n\
     local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n";

/// The key the test-clock scripts read `now` (ms) from.
pub const CLOCK_KEY: &str = "test:clock";

/// `script` with its TIME preamble replaced by a read of [`CLOCK_KEY`], so a
/// test sets the instant every call is decided at. The preamble must occur
/// exactly once: a script whose clock is read some other way fails here
/// instead of silently keeping Redis TIME. (The read names a key outside
/// KEYS, which a standalone Redis allows; the filter never sends this.)
pub fn with_test_clock(script: &Script) -> Script {
    let found = script.source.matches(TIME_PREAMBLE).count();
    assert_eq!(
        found, 1,
        "the TIME preamble occurs {found} times in the script, not once"
    );
    let source = script.source.replacen(
        TIME_PREAMBLE,
        &format!("local now = tonumber(redis.call('GET', '{CLOCK_KEY}'))\n"),
        1,
    );
    let sha1 = redis::Script::new(&source).get_hash().to_string();
    Script { source, sha1 }
}

/// `script` with every TTL dropped: PEXPIRE does nothing and SET loses its
/// PX/EX. For tests that move the test clock freely: a TTL is counted on
/// Redis' real clock, so a key whose state lasts 1 ms on the test clock can
/// vanish before the next call (or even at once: Redis 7.0 deletes a key
/// whose PEXPIRE lands on a ms that has just passed). The scripts must be
/// right without expiry anyway: a state says which instant or window it
/// belongs to. A local `redis` shadows the global for the whole joined
/// chunk, so the script's own text is unchanged.
pub fn without_expiry(script: &Script) -> Script {
    let shim = "local redis = setmetatable({ call = function(...)\n\
         local a = {...}\n\
         local c = string.upper(a[1])\n\
         if c == 'PEXPIRE' or c == 'EXPIRE' then return 1 end\n\
         if c == 'SET' then\n\
           local out, i = {a[1], a[2], a[3]}, 4\n\
           while i <= #a do\n\
             local o = string.upper(tostring(a[i]))\n\
             if o == 'PX' or o == 'EX' then i = i + 2\n\
             else out[#out + 1] = a[i]; i = i + 1 end\n\
           end\n\
           return redis.call(unpack(out))\n\
         end\n\
         return redis.call(...)\n\
       end }, { __index = redis })\n";
    let source = format!("{shim}{}", script.source);
    let sha1 = redis::Script::new(&source).get_hash().to_string();
    Script { source, sha1 }
}

/// lua/ratelimit.lua deciding at the test clock.
pub static RATELIMIT_AT: LazyLock<Script> = LazyLock::new(|| with_test_clock(&RATELIMIT));

/// lua/batch.lua deciding at the test clock.
pub static BATCH_AT: LazyLock<Script> = LazyLock::new(|| with_test_clock(&BATCH));

/// Sets the test clock to `ms`.
pub fn set_clock(con: &mut Connection, ms: i64) {
    redis::cmd("SET")
        .arg(CLOCK_KEY)
        .arg(ms)
        .query::<()>(con)
        .unwrap();
}

/// Milliseconds, for test-clock instants.
pub const SECOND: i64 = 1000;
pub const MINUTE: i64 = 60_000;
pub const HOUR: i64 = 3_600_000;

/// A test-clock instant on an hour edge (so on every minute and second edge
/// too): 472222 hours after the epoch.
pub const T0: i64 = 1_699_999_200_000;

/// One request's limits, decided at `now` on the test clock.
pub fn at(con: &mut Connection, now: i64, limits: &[Limit]) -> Decision {
    request_at(con, now, limits, None).decision()
}

/// One limit alone at `now`: its verdict (which is the request's).
pub fn one(con: &mut Connection, now: i64, limit: &Limit) -> Verdict {
    let d = at(con, now, std::slice::from_ref(limit));
    assert_eq!(d.admitted, d.limits[0].allowed, "{d:?}");
    d.limits[0]
}

/// One request through lua/ratelimit.lua decided at test-clock instant `now`.
pub fn request_at(con: &mut Connection, now: i64, limits: &[Limit], idem: Option<&Idem>) -> Reply {
    set_clock(con, now);
    let v: Value = with_limits(eval(&RATELIMIT_AT), limits, idem)
        .query(con)
        .unwrap_or_else(|e| panic!("EVAL at {now} failed for {limits:?} {idem:?}: {e}"));
    let reply = parse(v);
    if let Reply::Decided(d) = &reply {
        assert_eq!(d.limits.len(), limits.len(), "one verdict per limit");
    }
    reply
}

// ---------------------------------------------------------------------------
// lua/ratelimit.lua: the limits of one request and its idempotency key

/// One limit as lua/ratelimit.lua takes it: six ARGV values.
#[derive(Debug, Clone)]
pub struct Limit {
    pub key: String,
    pub alg: &'static str,
    pub a: i64,
    pub b: i64,
    /// A number, or a concurrency limit's slot id.
    pub c: String,
    pub cost: i64,
    pub enforce: bool,
    /// A blocking limit's block (ms); 0 for none; negative: a usage-based
    /// limit's (honoured, started only by its settlement).
    pub block: i64,
}

/// Token bucket: `capacity` tokens, `refill` tokens every `period_ms`.
pub fn tb(key: &str, capacity: i64, refill: i64, period_ms: i64) -> Limit {
    Limit {
        key: key.to_string(),
        alg: "tb",
        a: capacity,
        b: refill,
        c: period_ms.to_string(),
        cost: 1,
        enforce: true,
        block: 0,
    }
}

/// Sliding-window log: `limit` requests per `window_ms`.
pub fn sw(key: &str, limit: i64, window_ms: i64) -> Limit {
    Limit {
        key: key.to_string(),
        alg: "sw",
        a: limit,
        b: window_ms,
        c: "0".to_string(),
        cost: 1,
        enforce: true,
        block: 0,
    }
}

/// GCRA: a burst of `burst` units, `rate` units back every `period_ms`.
pub fn gcra(key: &str, burst: i64, rate: i64, period_ms: i64) -> Limit {
    Limit {
        key: key.to_string(),
        alg: "gcra",
        a: burst,
        b: rate,
        c: period_ms.to_string(),
        cost: 1,
        enforce: true,
        block: 0,
    }
}

/// Fixed window aligned to the epoch: `limit` units per `window_ms`.
pub fn fw(key: &str, limit: i64, window_ms: i64) -> Limit {
    Limit {
        key: key.to_string(),
        alg: "fw",
        a: limit,
        b: window_ms,
        c: "0".to_string(),
        cost: 1,
        enforce: true,
        block: 0,
    }
}

/// Sliding-window counter: `limit` units per (estimated) `window_ms`.
pub fn swc(key: &str, limit: i64, window_ms: i64) -> Limit {
    Limit {
        key: key.to_string(),
        alg: "swc",
        a: limit,
        b: window_ms,
        c: "0".to_string(),
        cost: 1,
        enforce: true,
        block: 0,
    }
}

/// Concurrency: at most `max` slots in flight, each leased for `lease_ms`;
/// `slot` is the request's slot id (hex).
pub fn cc(key: &str, max: i64, lease_ms: i64, slot: &str) -> Limit {
    Limit {
        key: key.to_string(),
        alg: "cc",
        a: max,
        b: lease_ms,
        c: slot.to_string(),
        cost: 1,
        enforce: true,
        block: 0,
    }
}

impl Limit {
    pub fn cost(mut self, cost: i64) -> Limit {
        self.cost = cost;
        self
    }

    /// A rejection blocks the key for `ms` (the enforce value says it).
    pub fn block(mut self, ms: i64) -> Limit {
        self.block = ms;
        self
    }

    pub fn shadow(mut self) -> Limit {
        self.enforce = false;
        self
    }
}

/// One request's idempotency part: record key, owner token, fingerprint, lock TTL.
#[derive(Debug, Clone)]
pub struct Idem {
    pub key: String,
    pub owner: String,
    pub fingerprint: String,
    pub lock_ms: i64,
}

pub fn idem(key: &str, owner: &str, fingerprint: &str, lock_ms: i64) -> Idem {
    Idem {
        key: key.to_string(),
        owner: owner.to_string(),
        fingerprint: fingerprint.to_string(),
        lock_ms,
    }
}

/// Appends numkeys, KEYS and ARGV in lua/ratelimit.lua's documented order:
/// the limits' keys, the record's key (keyed requests only), N, six values
/// per limit, then "1", owner, fingerprint and lock TTL for a keyed request.
/// An unkeyed request sends no flag at all (the header's "absent").
pub fn with_limits(mut cmd: Cmd, limits: &[Limit], idem: Option<&Idem>) -> Cmd {
    cmd.arg(limits.len() + usize::from(idem.is_some()));
    for l in limits {
        cmd.arg(&l.key);
    }
    if let Some(i) = idem {
        cmd.arg(&i.key);
    }
    cmd.arg(request_argv(limits, idem));
    cmd
}

/// One request's ARGV for lua/ratelimit.lua, and for each member of
/// lua/batch.lua, exactly as the filter builds it (src/ratelimit.rs,
/// `script_args`): six values per limit, then the idempotency flag and its
/// values only when the request carries a key. An unkeyed request sends no
/// flag, so in a batch the next member's values follow its last limit.
pub fn request_argv(limits: &[Limit], idem: Option<&Idem>) -> Vec<String> {
    let mut argv = vec![limits.len().to_string()];
    for l in limits {
        argv.extend([
            l.alg.to_string(),
            l.a.to_string(),
            l.b.to_string(),
            l.c.clone(),
            l.cost.to_string(),
            match (l.enforce, l.block) {
                (false, _) => "0".to_string(),
                (true, 0) => "1".to_string(),
                (true, ms) => ms.to_string(),
            },
        ]);
    }
    if let Some(i) = idem {
        argv.extend([
            "1".to_string(),
            i.owner.clone(),
            i.fingerprint.clone(),
            i.lock_ms.to_string(),
        ]);
    }
    argv
}

/// KEYS and the one packed argument of lua/batch.lua for `members`, each a
/// request's KEYS and ARGV as the filter builds them, packed by the
/// filter's own code (`redis_guard::batch::pack`).
pub fn packed(members: &[(Vec<String>, Vec<String>)]) -> (Vec<Vec<u8>>, Vec<u8>) {
    let bytes =
        |v: &[String]| -> Vec<Vec<u8>> { v.iter().map(|s| s.as_bytes().to_vec()).collect() };
    let args: Vec<_> = members.iter().map(|(k, a)| (bytes(k), bytes(a))).collect();
    let packed =
        redis_guard::batch::pack(&args).unwrap_or_else(|e| panic!("cannot pack {members:?}: {e}"));
    (packed.keys, packed.body)
}

/// The same for unkeyed members, each a list of limits.
pub fn packed_batch(members: &[Vec<Limit>]) -> (Vec<Vec<u8>>, Vec<u8>) {
    let members: Vec<_> = members
        .iter()
        .map(|limits| {
            let keys = limits.iter().map(|l| l.key.clone()).collect();
            (keys, request_argv(limits, None))
        })
        .collect();
    packed(&members)
}

/// lua/batch.lua at `now` on the test clock, for unkeyed members: each
/// member's decision.
pub fn batch_at(con: &mut Connection, now: i64, members: &[Vec<Limit>]) -> Vec<Decision> {
    let (keys, packed) = packed_batch(members);
    set_clock(con, now);
    let v: Value = eval(&BATCH_AT)
        .arg(keys.len())
        .arg(&keys)
        .arg(&packed)
        .query(con)
        .unwrap_or_else(|e| panic!("batch at {now}: {e}"));
    batch_decisions(v, members.len())
}

/// A batch's reply, `[M, len_1, reply_1..., len_2, reply_2...]`, as each
/// member's reply (asserting that framing).
pub fn split_batch_reply(v: Value, m: usize) -> Vec<Vec<Value>> {
    let Value::Array(items) = v else {
        panic!("batch reply is not an array: {v:?}")
    };
    let int = |v: &Value| match v {
        Value::Int(n) => *n,
        other => panic!("not an integer: {other:?} in {items:?}"),
    };
    assert_eq!(int(&items[0]), m as i64, "member count in {items:?}");
    let mut out = Vec::with_capacity(m);
    let mut i = 1;
    while i < items.len() {
        let len = usize::try_from(int(&items[i])).unwrap();
        assert!(
            i + len < items.len(),
            "member reply runs past the end: {items:?}"
        );
        out.push(items[i + 1..i + 1 + len].to_vec());
        i += 1 + len;
    }
    assert_eq!(out.len(), m, "member replies in {items:?}");
    out
}

/// A batch's reply as each member's decision (verdicts 1 and 0 only).
pub fn batch_decisions(v: Value, m: usize) -> Vec<Decision> {
    split_batch_reply(v, m)
        .into_iter()
        .map(|reply| parse(Value::Array(reply)).decision())
        .collect()
}

/// lua/batch.lua run (EVAL) on a packed batch: its flat reply as integers.
pub fn batch_flat(con: &mut Connection, (keys, body): (Vec<Vec<u8>>, Vec<u8>)) -> Vec<i64> {
    let v: Value = eval(&BATCH)
        .arg(keys.len())
        .arg(&keys)
        .arg(body)
        .query(con)
        .unwrap_or_else(|e| panic!("batch EVAL failed: {e}"));
    redis::from_redis_value(&v).unwrap()
}

/// One limit's verdict: four integers of the reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    pub allowed: bool,
    pub remaining: i64,
    pub retry_ms: i64,
    pub reset_ms: i64,
}

/// An admitting verdict (retry is always 0).
pub fn admits(remaining: i64, reset_ms: i64) -> Verdict {
    Verdict {
        allowed: true,
        remaining,
        retry_ms: 0,
        reset_ms,
    }
}

/// A rejecting verdict (reset always equals retry).
pub fn rejects(remaining: i64, retry_ms: i64) -> Verdict {
    Verdict {
        allowed: false,
        remaining,
        retry_ms,
        reset_ms: retry_ms,
    }
}

/// Verdicts 1 and 0: whether every enforced limit admitted the request (and
/// so was charged, and the lock taken), and each limit's own verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub admitted: bool,
    pub limits: Vec<Verdict>,
}

/// lua/ratelimit.lua's reply, by verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// 1 or 0: decided by the rate limits.
    Decided(Decision),
    /// 2: another request holds the lock, for this many more ms.
    Busy(i64),
    /// 3: the stored response.
    Completed {
        status: i64,
        headers: Vec<u8>,
        body: Vec<u8>,
    },
    /// 3 with the body in the object store: the reference instead.
    Offloaded {
        status: i64,
        headers: Vec<u8>,
        object_key: Vec<u8>,
        sha256: Vec<u8>,
        len: i64,
    },
    /// 4: the key was used with another fingerprint.
    Mismatch,
}

impl Reply {
    /// Verdict 1 with these limits' verdicts.
    pub fn admitted(limits: Vec<Verdict>) -> Reply {
        Reply::Decided(Decision {
            admitted: true,
            limits,
        })
    }

    /// Verdict 0 with these limits' verdicts.
    pub fn rate_limited(limits: Vec<Verdict>) -> Reply {
        Reply::Decided(Decision {
            admitted: false,
            limits,
        })
    }

    /// The decision of a verdict 1 or 0; panics on any other.
    #[track_caller]
    pub fn decision(self) -> Decision {
        match self {
            Reply::Decided(d) => d,
            other => panic!("expected verdict 0 or 1, got {other:?}"),
        }
    }
}

/// Parses lua/ratelimit.lua's flat reply array.
pub fn parse(v: Value) -> Reply {
    let Value::Array(items) = v else {
        panic!("reply is not an array: {v:?}")
    };
    // Figures of 2^31 and more come as decimal strings (lua/wire.lua), as
    // the filter reads them too.
    let int = |v: &Value| match v {
        Value::Int(i) => *i,
        Value::BulkString(b) if b.len() > 9 && b.iter().all(u8::is_ascii_digit) => {
            std::str::from_utf8(b).unwrap().parse().unwrap()
        }
        other => panic!("expected an integer, got {other:?} in {items:?}"),
    };
    let bytes = |v: &Value| match v {
        Value::BulkString(b) => b.clone(),
        other => panic!("expected a bulk string, got {other:?} in {items:?}"),
    };
    let flag = |v: &Value| match int(v) {
        0 => false,
        1 => true,
        other => panic!("expected 0 or 1, got {other} in {items:?}"),
    };
    assert!(!items.is_empty(), "empty reply");
    match int(&items[0]) {
        0 | 1 => {
            assert_eq!(
                (items.len() - 1) % 4,
                0,
                "four integers per limit: {items:?}"
            );
            Reply::Decided(Decision {
                admitted: flag(&items[0]),
                limits: items[1..]
                    .chunks_exact(4)
                    .map(|c| Verdict {
                        allowed: flag(&c[0]),
                        remaining: int(&c[1]),
                        retry_ms: int(&c[2]),
                        reset_ms: int(&c[3]),
                    })
                    .collect(),
            })
        }
        2 => {
            assert_eq!(items.len(), 2, "busy reply: {items:?}");
            Reply::Busy(int(&items[1]))
        }
        3 if items.len() == 7 => {
            assert_eq!(bytes(&items[3]), b"", "no body beside a reference");
            Reply::Offloaded {
                status: int(&items[1]),
                headers: bytes(&items[2]),
                object_key: bytes(&items[4]),
                sha256: bytes(&items[5]),
                len: int(&items[6]),
            }
        }
        3 => {
            assert_eq!(items.len(), 4, "completed reply: {items:?}");
            Reply::Completed {
                status: int(&items[1]),
                headers: bytes(&items[2]),
                body: bytes(&items[3]),
            }
        }
        4 => {
            assert_eq!(items.len(), 1, "mismatch reply: {items:?}");
            Reply::Mismatch
        }
        other => panic!("unknown verdict {other} in {items:?}"),
    }
}

/// One request through lua/ratelimit.lua (EVAL of the joined source).
pub fn request(con: &mut Connection, limits: &[Limit], idem: Option<&Idem>) -> Reply {
    let v: Value = with_limits(eval(&RATELIMIT), limits, idem)
        .query(con)
        .unwrap_or_else(|e| panic!("EVAL failed for {limits:?} {idem:?}: {e}"));
    let reply = parse(v);
    if let Reply::Decided(d) = &reply {
        assert_eq!(d.limits.len(), limits.len(), "one verdict per limit");
    }
    reply
}

// ---------------------------------------------------------------------------
// lua/idempotency_complete.lua and lua/idempotency_release.lua

/// lua/idempotency_complete.lua: 1 if stored, 0 if the lock is not ours.
pub fn complete(
    con: &mut Connection,
    key: &str,
    owner: &str,
    status: i64,
    headers: &[u8],
    body: &[u8],
    record_ms: i64,
) -> i64 {
    complete_as((key, owner), (status, headers, body), None, record_ms)
        .query(con)
        .unwrap()
}

/// lua/idempotency_complete.lua for a body in the object store: a 200 with
/// `headers`, an empty body, and the object's key, SHA-256 and length.
pub fn complete_offloaded(
    con: &mut Connection,
    key: &str,
    owner: &str,
    headers: &[u8],
    object: (&str, &str, usize),
    record_ms: i64,
) -> i64 {
    complete_as((key, owner), (200, headers, b""), Some(object), record_ms)
        .query(con)
        .unwrap()
}

/// ARGV in the script's order: owner, status, headers, body, record TTL,
/// then the object's key, SHA-256 and length when there is one.
fn complete_as(
    (key, owner): (&str, &str),
    (status, headers, body): (i64, &[u8], &[u8]),
    object: Option<(&str, &str, usize)>,
    record_ms: i64,
) -> Cmd {
    let mut cmd = eval(&IDEM_COMPLETE);
    cmd.arg(1)
        .arg(key)
        .arg(owner)
        .arg(status)
        .arg(headers)
        .arg(body)
        .arg(record_ms);
    if let Some((object_key, sha256, len)) = object {
        cmd.arg(object_key).arg(sha256).arg(len);
    }
    cmd
}

/// lua/idempotency_release.lua: 1 if released, 0 if the lock is not ours.
pub fn release(con: &mut Connection, key: &str, owner: &str) -> i64 {
    eval(&IDEM_RELEASE)
        .arg(1)
        .arg(key)
        .arg(owner)
        .query(con)
        .unwrap()
}

// ---------------------------------------------------------------------------
// lua/lease.lua and lua/lease_return.lua: in script/lease.rs

mod lease;
// Every test file takes this module; few call the lease scripts.
#[allow(unused_imports)]
pub use lease::*;

// ---------------------------------------------------------------------------
// lua/concurrency_renew.lua and lua/concurrency_release.lua

/// lua/concurrency_renew.lua renewing at the test clock.
pub static CC_RENEW_AT: LazyLock<Script> = LazyLock::new(|| with_test_clock(&CC_RENEW));

/// One concurrency limit a request holds its slot in, as the renewal and
/// the release name it: the limit's key, its lease (ms), the request's cost.
#[derive(Debug, Clone)]
pub struct Held {
    pub key: String,
    pub lease_ms: i64,
    pub cost: i64,
}

impl Limit {
    /// This concurrency limit as a held slot (its key, lease and cost).
    pub fn held(&self) -> Held {
        assert_eq!(self.alg, "cc", "only a concurrency limit holds a slot");
        Held {
            key: self.key.clone(),
            lease_ms: self.b,
            cost: self.cost,
        }
    }
}

/// Appends lua/concurrency_renew.lua's KEYS and ARGV: the keys, the slot
/// id, then lease and cost per key.
pub fn with_renewal(mut cmd: Cmd, slot: &str, held: &[Held]) -> Cmd {
    cmd.arg(held.len());
    for h in held {
        cmd.arg(&h.key);
    }
    cmd.arg(slot);
    for h in held {
        cmd.arg(h.lease_ms).arg(h.cost);
    }
    cmd
}

/// Appends lua/concurrency_release.lua's KEYS and ARGV: the keys, then the
/// slot id and the cost per key.
pub fn with_release(mut cmd: Cmd, slot: &str, held: &[Held]) -> Cmd {
    cmd.arg(held.len());
    for h in held {
        cmd.arg(&h.key);
    }
    for h in held {
        cmd.arg(slot).arg(h.cost);
    }
    cmd
}

/// lua/concurrency_renew.lua on Redis' clock: 1 or 0 per key.
pub fn cc_renew(con: &mut Connection, slot: &str, held: &[Held]) -> Vec<i64> {
    with_renewal(eval(&CC_RENEW), slot, held)
        .query(con)
        .unwrap_or_else(|e| panic!("renewal of {slot} in {held:?}: {e}"))
}

/// lua/concurrency_renew.lua at test-clock instant `now`: 1 or 0 per key.
pub fn cc_renew_at(con: &mut Connection, now: i64, slot: &str, held: &[Held]) -> Vec<i64> {
    set_clock(con, now);
    with_renewal(eval(&CC_RENEW_AT), slot, held)
        .query(con)
        .unwrap_or_else(|e| panic!("renewal at {now} of {slot} in {held:?}: {e}"))
}

/// lua/concurrency_release.lua for one request: how many of the keys held
/// its slot.
pub fn cc_release(con: &mut Connection, slot: &str, held: &[Held]) -> i64 {
    with_release(eval(&CC_RELEASE), slot, held)
        .query(con)
        .unwrap_or_else(|e| panic!("release of {slot} in {held:?}: {e}"))
}
