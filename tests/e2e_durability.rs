//! What survives a Redis crash: keyed requests run to completion, Redis is
//! killed (SIGKILL: nothing flushed on the way out) and started again from
//! its directory, and every key is retried through the same real Envoy and
//! Webdis. With an append-only file fsynced on every write (what the demo
//! and compose run), every retry is a replay and budgets stay spent; without
//! persistence (the control) every record is gone and every retry runs again.
//!
//! A process crash is not a machine crash: Redis write()s a change to its
//! append-only file before it answers, so only the fsync that puts it on the
//! disk differs between `always` and `everysec`, and only a power loss or a
//! kernel crash loses what the page cache held. No test can pull the plug,
//! so the window is shown as strace sees it: the time from Redis answering a
//! write (to Webdis, hence to the filter) until the fsync that covers it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::{BTreeMap, HashMap};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::*;

const KEYS: usize = 30;

/// 2^40 ms: a fixed window no run crosses the edge of (aligned to the epoch,
/// the current one ends in 2039). An hour-long one resets at the top of the
/// hour, now and then between the spending and the check.
const LONG_WINDOW_MS: u64 = 1 << 40;

/// How long a completed record is kept (the default `recordTtlMs`).
const RECORD_TTL_MS: i64 = 86_400_000;

/// Keyed POSTs to /pay, scoped by x-tenant; GET /metered limited to 5 per
/// window.
fn config() -> String {
    filter_config(3000)
        .limits(&format!(
            r#"[{{"name":"metered","match":{{"pathPrefix":"/metered"}},
                "fixedWindow":{{"limit":5,"windowMs":{LONG_WINDOW_MS}}}}}]"#
        ))
        .idempotency(
            r#"[{"name":"pay","match":{"pathPrefix":"/pay"},"tenant":[{"header":"x-tenant"}]}]"#,
        )
        .build()
}

struct Crashable {
    redis: Redis,
    webdis: Webdis,
    upstream: Upstream,
    envoy: Envoy,
}

impl Crashable {
    fn start(aof: Option<&'static str>) -> Crashable {
        let redis = Redis::start_with_aof(aof);
        let webdis = Webdis::start(redis.port);
        let upstream = Upstream::start();
        let envoy = Envoy::start(&config(), webdis.port, upstream.port);
        Crashable {
            redis,
            webdis,
            upstream,
            envoy,
        }
    }

    fn pay(&self, i: usize) -> Resp {
        let key = format!("key-{i}");
        http(
            "POST",
            &self.envoy.url(&format!("/pay/{i}")),
            &[("idempotency-key", &key), ("x-tenant", "acme")],
            Some(format!("{{\"amount\":{i}}}").as_bytes()),
        )
    }

    fn metered(&self) -> u16 {
        get(&self.envoy.url("/metered"), &[]).status
    }

    /// Runs every key and spends 3 of the 5 metered requests, then kills
    /// Redis the moment the last answer is in, and starts it again. Returns
    /// the answers, and when each stored record was to expire (Redis'
    /// PEXPIRETIME, read just before the kill), checked against the Redis
    /// clock around the run: exactly `RECORD_TTL_MS` after its request.
    fn run_then_crash(&mut self) -> (Vec<Resp>, BTreeMap<String, i64>) {
        let mut con = self.redis.conn();
        let t0 = redis_now_ms(&mut con);
        let first: Vec<Resp> = (0..KEYS).map(|i| self.pay(i)).collect();
        for r in &first {
            assert_eq!(r.status, 200, "{:?}", String::from_utf8_lossy(&r.body));
            assert_eq!(r.header("idempotent-replayed"), None);
        }
        for _ in 0..3 {
            assert_eq!(self.metered(), 200);
        }
        let keys: Vec<String> = redis::cmd("KEYS").arg("rg:idem:*").query(&mut con).unwrap();
        let expiries: BTreeMap<String, i64> = keys
            .into_iter()
            .map(|k| {
                let at = pexpiretime(&mut con, &k);
                (k, at)
            })
            .collect();
        let t1 = redis_now_ms(&mut con);
        assert_eq!(expiries.len(), KEYS, "one record per key");
        for (key, at) in &expiries {
            assert!(
                t0 + RECORD_TTL_MS <= *at && *at <= t1 + RECORD_TTL_MS,
                "{key} expires at {at}, not {RECORD_TTL_MS} ms after its request ({t0}..{t1})"
            );
        }
        self.redis.restart();
        self.webdis.wait_until_redis_answers();
        (first, expiries)
    }
}

#[test]
fn with_an_append_only_file_fsynced_always_every_record_survives_a_crash() {
    let mut s = Crashable::start(Some("always"));
    let (first, expiries) = s.run_then_crash();
    for (i, before) in first.iter().enumerate() {
        let retry = s.pay(i);
        assert_eq!(retry.status, before.status);
        assert_eq!(
            retry.header("idempotent-replayed"),
            Some("true"),
            "key-{i} ran again"
        );
        assert_eq!(retry.body, before.body, "key-{i}: the stored response");
    }
    assert_eq!(s.upstream.executed(), (KEYS + 3) as u64, "no key ran twice");
    // The budget spent before the crash stays spent: 2 of 5 are left.
    let after: Vec<u16> = (0..3).map(|_| s.metered()).collect();
    assert_eq!(after, [200, 200, 429]);
    // Records expire when they would have: the append-only file holds each
    // expiry as an instant (PEXPIREAT), not a TTL that restarts at the load.
    let mut con = s.redis.conn();
    let keys: Vec<String> = redis::cmd("KEYS").arg("rg:idem:*").query(&mut con).unwrap();
    let restored: BTreeMap<String, i64> = keys
        .into_iter()
        .map(|k| {
            let at = pexpiretime(&mut con, &k);
            (k, at)
        })
        .collect();
    assert_eq!(restored, expiries);
}

#[test]
fn without_persistence_a_crash_forgets_every_record_and_every_retry_runs_again() {
    let mut s = Crashable::start(None);
    s.run_then_crash();
    for i in 0..KEYS {
        let retry = s.pay(i);
        assert_eq!(retry.status, 200);
        assert_eq!(
            retry.header("idempotent-replayed"),
            None,
            "key-{i}: nothing to replay"
        );
    }
    assert_eq!(
        s.upstream.executed(),
        (2 * KEYS + 3) as u64,
        "every key ran twice"
    );
    // The spent budget is forgotten too: 5 more.
    let after: Vec<u16> = (0..6).map(|_| s.metered()).collect();
    assert_eq!(after, [200, 200, 200, 200, 200, 429]);
}

/// One system call as strace reported it: thread, name, first argument (a
/// file descriptor for the calls traced), start and end (s since the epoch).
#[derive(Debug, Clone)]
struct Call {
    tid: u32,
    name: String,
    fd: i64,
    start: f64,
    end: f64,
}

/// Parses `strace -f -ttt -T` output, joining `<unfinished ...>` calls to
/// their `<... resumed>` ends.
fn parse_trace(text: &str) -> Vec<Call> {
    let mut calls = Vec::new();
    let mut pending: HashMap<u32, Call> = HashMap::new();
    let duration = |line: &str| -> f64 {
        line.rsplit_once('<')
            .and_then(|(_, d)| d.trim_end().strip_suffix('>'))
            .and_then(|d| d.parse().ok())
            .unwrap_or(0.0)
    };
    for line in text.lines() {
        // strace pads the thread id to five columns ("5128  1796…"), so the
        // fields are split on runs of spaces.
        let Some((tid, line)) = line.trim_start().split_once(' ') else {
            continue;
        };
        let Some((at, rest)) = line.trim_start().split_once(' ') else {
            continue;
        };
        let (Ok(tid), Ok(at)) = (tid.parse::<u32>(), at.parse::<f64>()) else {
            continue;
        };
        if let Some(resumed) = rest.strip_prefix("<... ") {
            if let Some(mut call) = pending.remove(&tid) {
                assert!(resumed.starts_with(&call.name), "{line}");
                call.end = at;
                calls.push(call);
            }
            continue;
        }
        let Some((name, args)) = rest.split_once('(') else {
            continue; // +++ exited, --- SIGNAL
        };
        let fd = args
            .split([',', ')', ' '])
            .next()
            .and_then(|n| n.parse().ok())
            .unwrap_or(-1);
        let call = Call {
            tid,
            name: name.to_string(),
            fd,
            start: at,
            end: at,
        };
        if rest.ends_with("<unfinished ...>") {
            pending.insert(tid, call);
        } else {
            calls.push(Call {
                end: at + duration(rest),
                ..call
            });
        }
    }
    calls.sort_by(|a, b| a.start.total_cmp(&b.start));
    calls
}

#[test]
fn the_trace_parser_reads_padded_thread_ids_and_joins_unfinished_calls() {
    let text = "5128  1796329489.823909 write(8, \"*2\\r\\n\"..., 50) = 50 <0.000028>\n\
                13212 1796329490.000001 fdatasync(8 <unfinished ...>\n\
                5128  1796329490.000002 write(9, \"+OK\\r\\n\", 5) = 5 <0.000100>\n\
                13212 1796329490.001500 <... fdatasync resumed>) = 0 <0.001499>\n\
                5128  +++ exited with 0 +++\n";
    let calls = parse_trace(text);
    let got: Vec<(u32, &str, i64)> = calls
        .iter()
        .map(|c| (c.tid, c.name.as_str(), c.fd))
        .collect();
    assert_eq!(
        got,
        [
            (5128, "write", 8),
            (13212, "fdatasync", 8),
            (5128, "write", 9)
        ]
    );
    assert!((calls[0].end - 1_796_329_489.823_937).abs() < 1e-6);
    assert!(
        (calls[1].end - 1_796_329_490.001_5).abs() < 1e-6,
        "its resumed end"
    );
}

/// What the trace shows of the append-only file.
#[derive(Debug)]
struct Window {
    /// Writes to the file by Redis' main thread.
    writes: usize,
    /// The longest time an answered write waited for its fsync (ms;
    /// negative: every write was on the disk before its answer left).
    max_ms: f64,
    /// The most answered writes not yet on the disk at one instant: what a
    /// machine crash then would lose.
    max_exposed: usize,
    /// The fsyncs of the file.
    syncs: usize,
    /// When the first fsync seen ended and the last one began (s since the
    /// epoch, the clock Redis counts its seconds on).
    first_sync_end: f64,
    last_sync_start: f64,
}

fn fsync_window(calls: &[Call], main: u32) -> Window {
    let syncs: Vec<&Call> = calls
        .iter()
        .filter(|c| c.name == "fdatasync" || c.name == "fsync")
        .collect();
    let aof = syncs
        .first()
        .expect("Redis never fsynced its append-only file")
        .fd;
    assert!(syncs.iter().all(|c| c.fd == aof), "one file is fsynced");
    let mut spans = Vec::new();
    for w in calls
        .iter()
        .filter(|c| c.tid == main && c.name == "write" && c.fd == aof)
    {
        // Its answer: the main thread's next write to another descriptor.
        let Some(ack) = calls
            .iter()
            .find(|c| c.tid == main && c.name == "write" && c.fd != aof && c.start >= w.end)
        else {
            continue;
        };
        // On the disk once an fsync begun after the write has returned.
        let durable = syncs
            .iter()
            .filter(|s| s.start >= w.end)
            .map(|s| s.end)
            .fold(f64::INFINITY, f64::min);
        assert!(
            durable.is_finite(),
            "a write at {} was never fsynced",
            w.start
        );
        spans.push((ack.start, durable));
    }
    let max_ms = spans
        .iter()
        .map(|(ack, durable)| (durable - ack) * 1000.0)
        .fold(f64::NEG_INFINITY, f64::max);
    let max_exposed = spans
        .iter()
        .map(|(t, _)| spans.iter().filter(|(a, d)| a <= t && t < d).count())
        .max()
        .unwrap_or(0);
    Window {
        writes: spans.len(),
        max_ms,
        max_exposed,
        syncs: syncs.len(),
        first_sync_end: syncs[0].end,
        last_sync_start: syncs[syncs.len() - 1].start,
    }
}

/// The writes of Redis' main thread to its append-only file that it then
/// answered (a write of its own to another descriptor followed), and the
/// fsyncs of that file, in the trace so far (none before the first fsync
/// says which descriptor the file is).
fn answered_writes_and_syncs(calls: &[Call], main: u32) -> (usize, usize) {
    let syncs: Vec<&Call> = calls
        .iter()
        .filter(|c| c.name == "fdatasync" || c.name == "fsync")
        .collect();
    let Some(aof) = syncs.first().map(|c| c.fd) else {
        return (0, 0);
    };
    let answered = calls
        .iter()
        .filter(|w| w.tid == main && w.name == "write" && w.fd == aof)
        .filter(|w| {
            calls
                .iter()
                .any(|c| c.tid == main && c.name == "write" && c.fd != aof && c.start >= w.end)
        })
        .count();
    (answered, syncs.len())
}

/// Whether the trace so far shows an fsync of the append-only file begun
/// after Redis' main thread last wrote to it, and returned. Only whole lines
/// count: strace may be midway through the last.
fn last_write_fsynced(text: &str, main: u32) -> bool {
    let whole = text.rfind('\n').map_or("", |end| &text[..=end]);
    let calls = parse_trace(whole);
    let syncs: Vec<&Call> = calls
        .iter()
        .filter(|c| c.name == "fdatasync" || c.name == "fsync")
        .collect();
    let Some(aof) = syncs.first().map(|c| c.fd) else {
        return false;
    };
    let last_write = calls
        .iter()
        .filter(|c| c.tid == main && c.name == "write" && c.fd == aof)
        .map(|c| c.end)
        .fold(f64::NEG_INFINITY, f64::max);
    syncs.iter().any(|c| c.start >= last_write)
}

/// Attaches strace to Redis, runs keyed requests 50 ms apart (keys from
/// `first`): `min` of them, then more, up to `max`, until `enough` says the
/// trace so far (its whole lines, and Redis' main thread) holds what the
/// caller needs; waits for the last fsync, detaches. Returns the window and
/// how many requests were sent.
fn traced(
    s: &Crashable,
    first: usize,
    (min, max): (usize, usize),
    enough: impl Fn(&[Call], u32) -> bool,
) -> (Window, usize) {
    let dir = Scratch::new("strace");
    let out = dir.0.join("trace");
    let err = dir.0.join("strace.err");
    // Into a pipe, strace writes each line as it ends (into a file, it
    // buffers until it exits), so the trace can be read while it runs.
    let mut strace = Proc::spawn(
        "strace",
        Command::new(on_path("strace"))
            .args([
                "-f",
                "-ttt",
                "-T",
                "-e",
                "trace=write,fdatasync,fsync",
                "-o",
            ])
            .arg(format!("|cat > '{}'", out.display()))
            .args(["-p", &s.redis.pid().to_string()])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&err).unwrap()),
    );
    let start = Instant::now();
    while !std::fs::read_to_string(&err)
        .unwrap_or_default()
        .contains("attached")
    {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "strace did not attach: {}",
            std::fs::read_to_string(&err).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut sent = 0;
    while sent < max {
        assert_eq!(s.pay(first + sent).status, 200);
        sent += 1;
        std::thread::sleep(Duration::from_millis(50));
        if sent >= min {
            let text = std::fs::read_to_string(&out).unwrap_or_default();
            let whole = text.rfind('\n').map_or("", |end| &text[..=end]);
            if enough(&parse_trace(whole), s.redis.pid()) {
                break;
            }
        }
    }
    // Under everysec the last writes wait for Redis' next fsync: wait until
    // the trace shows it, not for a time a slow machine can outlast.
    let start = Instant::now();
    while !last_write_fsynced(
        &std::fs::read_to_string(&out).unwrap_or_default(),
        s.redis.pid(),
    ) {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "Redis never fsynced its last write"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // strace writes the rest as it detaches, and cat after it: wait for
    // strace to exit (it waits for cat), not a fixed pause.
    strace.signal("INT");
    let start = Instant::now();
    while strace.is_running() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "strace did not detach"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let w = fsync_window(
        &parse_trace(&std::fs::read_to_string(&out).unwrap()),
        s.redis.pid(),
    );
    (w, sent)
}

#[test]
fn with_always_every_write_is_on_the_disk_before_redis_answers_it() {
    let s = Crashable::start(Some("always"));
    let (w, _) = traced(&s, 100, (20, 20), |_, _| true);
    eprintln!("appendfsync always: {w:?}");
    // Each keyed request writes its lock, then its record; Redis may join
    // the changes of one pass of its event loop in one write, so at least
    // one write per request was seen.
    assert!(w.writes >= 20, "{w:?}");
    assert!(w.max_ms <= 0.0, "an answer left before its fsync: {w:?}");
    assert_eq!(w.max_exposed, 0);
}

#[test]
fn with_everysec_an_answered_record_waits_up_to_a_second_for_the_disk_but_survives_a_process_crash()
{
    let mut s = Crashable::start(Some("everysec"));
    // Requests until the trace holds more than twice as many answered
    // writes as fsyncs, with room for two more fsyncs (one under way, and
    // the last): that many writes always include two answered one after
    // the other with no fsync begun between them, both exposed at once
    // however slow the machine (a slow one sends more requests).
    let (w, sent) = traced(&s, 100, (40, 400), |calls, main| {
        let (writes, syncs) = answered_writes_and_syncs(calls, main);
        writes >= 2 * (syncs + 2) + 2
    });
    eprintln!("appendfsync everysec, {sent} requests: {w:?}");
    assert!(w.writes >= sent, "one write per request at least: {w:?}");
    // The window a machine crash would fall into: answers leave before the
    // disk has their write, which waits for Redis' next fsync.
    assert!(w.max_ms > 0.0, "every answer left after its fsync: {w:?}");
    // Redis starts a background fsync only when none is under way and its
    // clock has turned to another second since it started the last (Valkey:
    // a second later on its millisecond clock). So every fsync after the
    // first seen began after the one before it had ended, each in a second
    // of its own, from the first one's end to the last one's start: at most
    // floor(last start) - floor(first end) + 1 of them, one more for the
    // clock Redis compares, read at the start of its event loop's pass (a
    // pass shorter than a second), and the first. Counted on the fsyncs' own
    // times, so
    // however late Redis' background thread gets to run them. How long a
    // write waits beyond that is the scheduler's, not Redis': printed
    // above, never bounded by a wall clock here.
    let seconds = w.last_sync_start.floor() - w.first_sync_end.floor();
    assert!(
        (w.syncs as f64) <= seconds + 3.0,
        "more than one fsync a second: {w:?}"
    );
    // Fewer fsyncs than half the writes (an fsync begins between at most
    // two of the pairs of answered writes that follow each other): some two
    // followed each other with no fsync begun between them, and both were
    // exposed at once.
    assert!(
        w.writes >= 2 * w.syncs + 2,
        "Redis fsynced at least once per two answered writes: {w:?}"
    );
    assert!(w.max_exposed >= 2, "{w:?}");
    // A process crash loses none of it: the data was written, only not
    // fsynced, and the page cache outlives the process.
    s.redis.restart();
    s.webdis.wait_until_redis_answers();
    for i in 100..100 + sent {
        assert_eq!(
            s.pay(i).header("idempotent-replayed"),
            Some("true"),
            "key-{i} ran again"
        );
    }
    assert_eq!(s.upstream.executed(), sent as u64, "no key ran twice");
}
