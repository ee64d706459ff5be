//! Giving leased tokens back: the worker that received a grant watches its
//! slot, and its root hands the unspent tokens to one deferred call per
//! hash tag once the key's traffic stops or the lease is about to end.

use super::*;
use crate::filter::stage::lease::{give_back, Held, CHECK_MS, GIVE_BACK};
use crate::lease::{ENDING_MS, IDLE_MS};
use crate::scripts::LEASE_RETURN;

/// One token bucket of 100 (a token a second), leased 3 at a time for
/// `ttl_ms`.
fn leased(ttl_ms: u64) -> Rc<Config> {
    let json = format!(
        r#"{{"redis":{{"batch":{{"enabled":false}},"cluster":"w"}},"limits":[
        {{"name":"a","tokenBucket":{{"capacity":100,"refill":1,"periodMs":1000}},
         "lease":{{"tokens":3,"ttlMs":{ttl_ms}}}}}]}}"#
    );
    Rc::new(Config::parse(json.as_bytes()).unwrap())
}

/// A request that fetches a lease and is granted 3 (Redis' clock 1000 ms,
/// level 96000 credits, counter 5). Returns the bucket key.
fn fetch(cfg: &Rc<Config>, h: &mut FakeHost) -> Vec<u8> {
    let mut f = Flow::new(cfg.clone(), test_breaker());
    assert_eq!(f.on_request_headers(h, true), Action::Pause);
    let token = h.dispatched.len() as u32;
    f.on_callout_reply(
        h,
        token,
        ok(b"*9\r\n:1\r\n:1\r\n:96\r\n:0\r\n:4000\r\n:3\r\n$13\r\n1764900000123\r\n:96000\r\n:5\r\n"),
    );
    assert_eq!(count(h, Counter::LeaseFetched), 1);
    Plan::build(cfg, &RequestLine::read(h), h).unwrap().checks[0]
        .key
        .clone()
}

/// The root's slow tick at `ms`, with the worker's watched slots.
fn tick(cfg: &Config, h: &mut FakeHost, ms: u64) {
    tick_at(cfg, h, ms, true);
}

fn tick_at(cfg: &Config, h: &mut FakeHost, ms: u64, slow: bool) {
    h.clock_ms = ms;
    let mut held = std::mem::take(&mut h.held);
    give_back(h, cfg, &mut held, slow);
    h.held = held;
}

fn spend(cfg: &Rc<Config>, h: &mut FakeHost) -> Action {
    Flow::new(cfg.clone(), test_breaker()).on_request_headers(h, true)
}

#[test]
fn an_idle_keys_unspent_tokens_go_back_once_with_the_grants_tuple() {
    let cfg = leased(60_000);
    let mut h = FakeHost::get("/x");
    let key = fetch(&cfg, &mut h);
    assert_eq!(h.held.len(), 1, "the filling worker watches the slot");
    assert_eq!(spend(&cfg, &mut h), Action::Continue);
    h.clock_ms = 30;
    assert_eq!(spend(&cfg, &mut h), Action::Continue);
    // Spent at 30: busy until 30 + IDLE_MS.
    tick(&cfg, &mut h, 30 + IDLE_MS - 1);
    assert!(h.slot_releases.is_empty());
    tick(&cfg, &mut h, 30 + IDLE_MS + CHECK_MS);
    let tag = lease::tag_of(&key);
    assert!(!tag.is_empty());
    let want_key = String::from_utf8(key.clone()).unwrap();
    assert_eq!(
        h.slot_releases,
        [(
            tag,
            vec![want_key],
            ["100", "1", "1000", "1", "1764900000123", "96000", "5"]
                .map(String::from)
                .to_vec()
        )]
    );
    assert_eq!(h.deferred_scripts, std::slice::from_ref(&LEASE_RETURN.sha1));
    assert_eq!(h.counted_n, [(Counter::LeaseReturned, 1)]);
    assert_eq!(h.release_delays, [Duration::ZERO], "sent this tick");
    assert!(h.held.is_empty(), "nothing held: forgotten");
    // The token went back: the next request goes to Redis (strictly: the
    // background fetch the second spend claimed is still out), it does not
    // spend.
    let calls = h.dispatched.len();
    assert_eq!(spend(&cfg, &mut h), Action::Pause);
    assert_eq!(h.dispatched.len(), calls + 1);
    assert!(h.dispatched[calls].contains(&RATELIMIT.sha1));
    assert_eq!(count(&h, Counter::LeaseSpent), 2);
    // Nothing given twice.
    tick(&cfg, &mut h, 10_000);
    assert_eq!(h.slot_releases.len(), 1);
}

#[test]
fn a_busy_lease_goes_back_just_before_it_ends_and_spent_tokens_never_do() {
    // A lease of 200 ms: it gives back within a quarter of it (50 ms) of
    // its end however busy the key is.
    let cfg = leased(200);
    let mut h = FakeHost::get("/x");
    fetch(&cfg, &mut h);
    let ending = ENDING_MS.min(200 / 4);
    h.clock_ms = 200 - ending - 2;
    assert_eq!(spend(&cfg, &mut h), Action::Continue);
    tick(&cfg, &mut h, 200 - ending - 1);
    assert!(h.slot_releases.is_empty(), "busy, not ending yet");
    // A tick within CHECK_MS of the last looks at nothing.
    tick(&cfg, &mut h, 200 - ending);
    assert!(h.slot_releases.is_empty());
    tick(&cfg, &mut h, 200 - ending - 1 + CHECK_MS);
    assert_eq!(h.slot_releases.len(), 1);
    assert_eq!(
        h.slot_releases[0].2[3], "2",
        "the 2 unspent, not the spent one"
    );
    assert!(h.held.is_empty());
}

#[test]
fn a_slot_holding_two_grants_gives_each_back_under_its_own_tuple_newest_first() {
    // A busy slot never empties: its tokens must not all go back under its
    // first grant's tuple, which Redis refuses once 600 s old.
    let cfg = leased(60_000);
    let mut h = FakeHost::get("/x");
    let key = fetch(&cfg, &mut h);
    // Two spent: 1 left, below the low-water mark of 2: the second spend
    // claimed a background fetch of 2, granted at Redis' clock 1000 ms later.
    assert_eq!(spend(&cfg, &mut h), Action::Continue);
    h.clock_ms = 10;
    assert_eq!(spend(&cfg, &mut h), Action::Continue);
    let (_, note) = h.prefetched[0].clone();
    on_prefetch_reply(
        &mut h,
        &note,
        ok(b"*9\r\n:1\r\n:1\r\n:92\r\n:0\r\n:8000\r\n:2\r\n$13\r\n1764900001123\r\n:92000\r\n:6\r\n"),
    );
    tick(&cfg, &mut h, 10 + IDLE_MS);
    let tag = lease::tag_of(&key);
    let want_key = String::from_utf8(key.clone()).unwrap();
    let back = |tokens: &str, at: &str, level: &str, returned: &str| {
        (
            tag.clone(),
            vec![want_key.clone()],
            ["100", "1", "1000", tokens, at, level, returned]
                .map(String::from)
                .to_vec(),
        )
    };
    assert_eq!(
        h.slot_releases,
        [
            back("2", "1764900001123", "92000", "6"),
            back("1", "1764900000123", "96000", "5"),
        ]
    );
    assert_eq!(
        h.counted_n,
        [(Counter::LeaseReturned, 2), (Counter::LeaseReturned, 1)]
    );
    assert!(h.held.is_empty(), "nothing held: forgotten");
}

#[test]
fn a_spent_out_or_lapsed_slot_is_forgotten_without_a_call_and_a_contended_one_kept() {
    let cfg = leased(1_000);
    let mut h = FakeHost::get("/x");
    fetch(&cfg, &mut h);
    for _ in 0..3 {
        assert_eq!(spend(&cfg, &mut h), Action::Continue);
    }
    tick(&cfg, &mut h, 500);
    assert!(h.slot_releases.is_empty() && h.held.is_empty());

    let long = leased(60_000);
    let mut h = FakeHost::get("/x");
    fetch(&long, &mut h);
    // Every compare-and-swap loses its race: kept, tried at the next check.
    h.lose_races = 100;
    tick(&long, &mut h, IDLE_MS);
    assert!(h.slot_releases.is_empty());
    assert_eq!(h.held.len(), 1);
    h.lose_races = 0;
    tick(&long, &mut h, IDLE_MS + CHECK_MS);
    assert_eq!(h.slot_releases.len(), 1);

    let mut h = FakeHost::get("/x");
    fetch(&cfg, &mut h);
    tick(&cfg, &mut h, 1_000);
    assert!(h.slot_releases.is_empty(), "lapsed: nothing to give");
    assert!(h.held.is_empty());
}

#[test]
fn a_worker_watches_one_entry_per_slot_and_the_give_back_takes_seven_values_a_key() {
    let mut held = Held::default();
    let (k1, k2) = (b"rg:rl:{t}:a:k1", b"rg:rl:{t}:a:k2");
    held.add(&lease::Slot::of(k1), k1, 0);
    held.add(&lease::Slot::of(k1), k1, 0);
    assert_eq!(held.len(), 1);
    held.add(&lease::Slot::of(k2), k2, 0);
    assert_eq!(held.len(), 2);
    assert_eq!(GIVE_BACK.per_key, 7);
    assert_eq!(GIVE_BACK.script.sha1, LEASE_RETURN.sha1);
}

#[test]
fn the_fast_tick_looks_at_watched_slots_once_a_second_at_most() {
    let cfg = leased(60_000);
    let mut h = FakeHost::get("/x");
    fetch(&cfg, &mut h);
    h.clock_ms = 900;
    assert_eq!(spend(&cfg, &mut h), Action::Continue);
    // A fast tick looks (busy: spent at 900).
    tick_at(&cfg, &mut h, IDLE_MS, false);
    // Idle by 1900, but a fast tick within IDLE_MS of the last look does
    // not look again.
    tick_at(&cfg, &mut h, 900 + IDLE_MS + CHECK_MS, false);
    assert!(h.slot_releases.is_empty());
    // The slow tick looks every CHECK_MS: given back.
    tick_at(&cfg, &mut h, 900 + IDLE_MS + CHECK_MS, true);
    assert_eq!(h.slot_releases.len(), 1);
    assert_eq!(h.slot_releases[0].2[3], "2");
}

#[test]
fn a_fast_tick_a_second_after_its_last_look_gives_idle_tokens_back() {
    let cfg = leased(60_000);
    let mut h = FakeHost::get("/x");
    fetch(&cfg, &mut h);
    tick_at(&cfg, &mut h, IDLE_MS - 1, false);
    assert!(h.slot_releases.is_empty(), "not a second since the start");
    tick_at(&cfg, &mut h, IDLE_MS, false);
    assert_eq!(h.slot_releases.len(), 1);
}
