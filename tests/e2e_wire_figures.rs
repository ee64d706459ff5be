//! Figures the docs promise about what the filter puts on the wire and in
//! Redis, through a real Envoy, Webdis and Redis: a nonce adds exactly 20
//! bytes to a decision's call and 24 to its reply (docs/src/running/
//! failures.md), observed between Envoy and Webdis; and the longest block a
//! limit takes, 30 days (docs/src/using/abuse.md), is answered and kept for
//! exactly 30 days (a figure past 2^31 ms, through the 32-bit filter).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::io::{BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

use support::probe::read_message;
use support::*;

/// 30 days in ms: the longest block.
const THIRTY_DAYS: i64 = 30 * 24 * 3_600_000;

/// One exchange between Envoy and Webdis: the request and the reply, each
/// the whole HTTP message.
type Exchange = (Vec<u8>, Vec<u8>);

/// A relay between Envoy and Webdis that passes every exchange on as it is
/// and keeps a copy. Its threads end with the test process; each serves one
/// of Envoy's connections with its own connection to Webdis.
struct Recorder {
    port: u16,
    seen: Arc<Mutex<Vec<Exchange>>>,
}

impl Recorder {
    fn start(webdis_port: u16) -> Recorder {
        let port = free_port();
        let listener = TcpListener::bind(("127.0.0.1", port)).unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::clone(&seen);
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                let log = Arc::clone(&log);
                std::thread::spawn(move || {
                    let mut to_envoy = conn.try_clone().unwrap();
                    let mut from_envoy = BufReader::new(conn);
                    let webdis = TcpStream::connect(("127.0.0.1", webdis_port)).unwrap();
                    let mut to_webdis = webdis.try_clone().unwrap();
                    let mut from_webdis = BufReader::new(webdis);
                    while let Some(request) = read_message(&mut from_envoy) {
                        to_webdis.write_all(&request).unwrap();
                        let Some(reply) = read_message(&mut from_webdis) else {
                            return;
                        };
                        log.lock().unwrap().push((request.clone(), reply.clone()));
                        if to_envoy.write_all(&reply).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Recorder { port, seen }
    }

    fn exchanges(&self) -> Vec<Exchange> {
        self.seen.lock().unwrap().clone()
    }
}

/// An HTTP message's head (lines, without the blank one) and body.
fn split(message: &[u8]) -> (Vec<String>, Vec<u8>) {
    let end = message
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a head");
    let head = String::from_utf8(message[..end].to_vec()).unwrap();
    (
        head.split("\r\n").map(str::to_string).collect(),
        message[end + 4..].to_vec(),
    )
}

/// Where the nonce (`/%7E` and 16 hex digits) is in `text`, if it is there
/// once; panics if it is there more than once.
fn nonce_at(text: &[u8]) -> Option<usize> {
    let hex = |b: &u8| b.is_ascii_digit() || (b'a'..=b'f').contains(b);
    let found: Vec<usize> = text
        .windows(20)
        .enumerate()
        .filter(|(_, w)| w.starts_with(b"/%7E") && w[4..].iter().all(hex))
        .map(|(i, _)| i)
        .collect();
    assert!(found.len() <= 1, "{} nonces", found.len());
    found.first().copied()
}

/// Webdis, Redis, the demo upstream and one Envoy whose calls go through a
/// [`Recorder`]: a token bucket on /api (fresh per x-user, 10 a minute) and
/// a fixed window of 1 on /login that blocks for 30 days.
struct World {
    redis: Redis,
    webdis: Webdis,
    recorder: Recorder,
    envoy: Envoy,
    _upstream: Upstream,
}

impl World {
    fn start() -> World {
        let redis = Redis::start();
        let webdis = Webdis::start(redis.port);
        let upstream = Upstream::start();
        let recorder = Recorder::start(webdis.port);
        let cfg = filter_config(3000)
            .limits(&format!(
                r#"[{{"name":"api","match":{{"pathPrefix":"/api"}},"descriptor":[{{"header":"x-user"}}],
                     "tokenBucket":{{"capacity":10,"refill":10,"periodMs":60000}}}},
                    {{"name":"login","match":{{"pathPrefix":"/login"}},"descriptor":[{{"header":"x-user"}}],
                     "fixedWindow":{{"limit":1,"windowMs":3600000}},
                     "block":{{"durationMs":{THIRTY_DAYS}}}}}]"#
            ))
            .build();
        let envoy = Envoy::start(&cfg, recorder.port, upstream.port);
        World {
            redis,
            webdis,
            recorder,
            envoy,
            _upstream: upstream,
        }
    }
}

#[test]
fn a_nonce_adds_twenty_bytes_to_a_call_and_twenty_four_to_its_reply() {
    let world = World::start();
    let e = &world.envoy;
    // The first call of the script may meet NOSCRIPT and be sent again as
    // an EVAL (which carries no nonce): a decision before the one observed.
    assert_eq!(get(&e.url("/api/x"), &[("x-user", "warm")]).status, 200);
    let before = world.recorder.exchanges().len();
    assert_eq!(get(&e.url("/api/x"), &[("x-user", "ann")]).status, 200);
    let calls = world.recorder.exchanges().split_off(before);
    assert_eq!(calls.len(), 1, "one call for one decision");
    let (request, reply) = &calls[0];

    // Out: the nonce is one argument, `/%7E` and 16 hex digits (20 bytes),
    // in the request line's path (a PUT) or in the body (a POST). The call
    // without those 20 bytes is the call without a nonce: below, it gets
    // the same verdict.
    let (mut head, body) = split(request);
    let line = head[0].clone();
    let (method, rest) = line.split_once(' ').unwrap();
    let (path, version) = rest.rsplit_once(' ').unwrap();
    let take = |text: &[u8], at: usize| -> (Vec<u8>, Vec<u8>) {
        // The argument ends there: the next one, or `.raw`.
        assert!(
            matches!(text.get(at + 20), Some(b'/' | b'.')),
            "{}",
            String::from_utf8_lossy(text)
        );
        (
            text[at + 4..at + 20].to_vec(),
            [&text[..at], &text[at + 20..]].concat(),
        )
    };
    let (sent, path, body) = match (nonce_at(path.as_bytes()), nonce_at(&body)) {
        (Some(at), None) => {
            let (nonce, bare) = take(path.as_bytes(), at);
            (nonce, String::from_utf8(bare).unwrap(), body)
        }
        (None, Some(at)) => {
            let (nonce, bare) = take(&body, at);
            (nonce, path.to_string(), bare)
        }
        other => panic!(
            "no nonce, or two: {other:?}\n{}",
            String::from_utf8_lossy(request)
        ),
    };
    head[0] = format!("{method} {path} {version}");
    for line in head.iter_mut() {
        if line.to_ascii_lowercase().starts_with("content-length:") {
            *line = format!("content-length: {}", body.len());
        }
    }
    let bare = [head.join("\r\n").as_bytes(), b"\r\n\r\n", &body].concat();

    // Back: the same call without it, sent to Webdis on the same state (the
    // bucket gone again: fresh, as the filter's call found it), is answered
    // the same reply less exactly the nonce's 24 bytes, `$17\r\n~` and its
    // 16 digits and `\r\n`, after a count one lower.
    let mut con = world.redis.conn();
    let keys: Vec<String> = redis::cmd("KEYS").arg("*api*ann*").query(&mut con).unwrap();
    assert_eq!(keys.len(), 1, "{keys:?}");
    redis::cmd("DEL")
        .arg(&keys[0])
        .query::<()>(&mut con)
        .unwrap();
    let mut webdis = TcpStream::connect(("127.0.0.1", world.webdis.port)).unwrap();
    webdis.write_all(&bare).unwrap();
    let plain = read_message(&mut BufReader::new(webdis)).unwrap();
    let (with, without) = (split(reply).1, split(&plain).1);
    assert_eq!(with.len(), without.len() + 24, "24 bytes back");
    let count = |body: &[u8]| -> (usize, usize) {
        let end = body.windows(2).position(|w| w == b"\r\n").unwrap();
        let n = std::str::from_utf8(&body[1..end]).unwrap().parse().unwrap();
        (n, end + 2)
    };
    let ((n_with, at_with), (n_without, at_without)) = (count(&with), count(&without));
    assert_eq!(at_with, at_without, "the count keeps its digits here");
    assert_eq!(n_with, n_without + 1);
    let echoed = [b"$17\r\n~".as_slice(), &sent, b"\r\n"].concat();
    assert_eq!(
        &with[at_with..at_with + 24],
        echoed.as_slice(),
        "the nonce sent, given back first: {}",
        String::from_utf8_lossy(&with)
    );
    assert_eq!(
        &with[at_with + 24..],
        &without[at_without..],
        "the same verdict"
    );
}

#[test]
fn a_thirty_day_block_is_answered_and_kept_for_thirty_days() {
    let world = World::start();
    let e = &world.envoy;
    let login = |user: &str| get(&e.url("/login"), &[("x-user", user)]);
    assert_eq!(login("mallory").status, 200);
    // The rejection starts the block: Retry-After its 2,592,000 seconds.
    let mut con = world.redis.conn();
    let t0 = redis_now_ms(&mut con);
    let refused = login("mallory");
    assert_eq!(
        (refused.status, refused.header("retry-after")),
        (429, Some("2592000"))
    );
    let blocks: Vec<String> = redis::cmd("KEYS")
        .arg("rg:bl:*mallory*")
        .query(&mut con)
        .unwrap();
    assert_eq!(blocks.len(), 1, "{blocks:?}");
    assert_expires_in(&mut con, &blocks[0], THIRTY_DAYS, t0);
    // Held: refused again, and its Retry-After is still the block's time
    // left, whether Redis answers it or, within a second of Redis' answer,
    // this Envoy's over-limit cache: the cache holds an entry a second at
    // most, but answers with Redis' own wait (it said 1, its hold). The
    // wait runs on from the first refusal: seconds of a slow machine at
    // most, so anything under 2,591,990 is the hold's second. Each refusal
    // Redis gives writes the cache's entry again, so the next one, sent at
    // once, meets it (asserted: the cache answered one of them).
    let cached_before = e.counter("redis_guard.overlimit_cache.rejected");
    for _ in 0..5 {
        let held = login("mallory");
        let retry: u64 = held.header("retry-after").unwrap().parse().unwrap();
        assert_eq!(held.status, 429);
        assert!(
            (2_591_990..=2_592_000).contains(&retry),
            "Retry-After {retry}: the block's time left, not the cache's hold"
        );
        if e.counter("redis_guard.overlimit_cache.rejected") > cached_before {
            break;
        }
    }
    assert!(
        e.counter("redis_guard.overlimit_cache.rejected") > cached_before,
        "the over-limit cache answered none of the held refusals"
    );
    // Another user is not blocked.
    assert_eq!(login("ann").status, 200);
}
