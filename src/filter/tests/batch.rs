//! Batched decisions: the request's side (it joins its worker's batch and
//! takes the verdict it is handed) and the worker's (what leaves when).

use std::cell::Cell;

use super::*;
use crate::batch::pack;
use crate::config::Batch;
use crate::filter::handoff::Member;
use crate::filter::stage::batch::{Batcher, Verdict, Waiter};
use crate::filter::Histogram;
use crate::scripts::{BATCH, RATELIMIT};
use crate::webdis::{parse_reply, Reply};

/// One limit, batching on (the default).
fn batched_config() -> Rc<Config> {
    Rc::new(
        Config::parse(
            br#"{"redis":{"cluster":"webdis","timeoutMs":300},"failureMode":"deny","limits":[
            {"name":"a","tokenBucket":{"capacity":5,"refill":1,"periodMs":1000}}]}"#,
        )
        .unwrap(),
    )
}

fn admit_reply() -> Reply {
    parse_reply(ADMIT).unwrap()
}

#[test]
fn a_request_joins_its_workers_batch_instead_of_calling() {
    let cfg = batched_config();
    let mut f = Flow::new(cfg.clone(), test_breaker());
    let mut h = FakeHost::get("/x");
    assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
    assert!(h.dispatched.is_empty(), "the worker sends the call");
    assert_eq!(h.batched.len(), 1);
    let member = &h.batched[0];
    let plan = Plan::build(&cfg, &RequestLine::read(&h), &h).unwrap();
    assert_eq!(
        member.args,
        plan.script_args(&cfg, None, None),
        "its own call's arguments"
    );
    assert_eq!(Some(member.tag.as_str()), plan.tag.as_deref());
    assert_eq!(member.deadline, Duration::from_millis(300));
    f.on_batch_verdict(&mut h, Verdict::Ran(admit_reply()));
    assert_eq!((h.resumed, h.sent.len()), (1, 0));
    assert_eq!(count(&h, Counter::Allowed(0)), 1);
    f.on_response_headers(&mut h, true);
    assert!(h.added.iter().any(|(n, _)| n == "ratelimit-policy"));
    f.on_batch_verdict(&mut h, Verdict::Ran(admit_reply()));
    assert_eq!(h.resumed, 1, "a second verdict changes nothing");
}

#[test]
fn a_batched_rejection_is_a_429_and_feeds_the_over_limit_cache() {
    let cfg = batched_config();
    let mut f = Flow::new(cfg.clone(), test_breaker());
    let mut h = FakeHost::get("/x");
    f.on_request_headers(&mut h, true);
    f.on_batch_verdict(&mut h, Verdict::Ran(parse_reply(REJECT).unwrap()));
    assert_eq!(h.sent.last().map(|r| r.status), Some(429));
    let mut g = Flow::new(cfg, test_breaker());
    assert_eq!(g.on_request_headers(&mut h, true), Action::Pause);
    assert_eq!(
        h.batched.len(),
        1,
        "the next one is answered from the cache"
    );
    assert_eq!(count(&h, Counter::OverLimitCached), 1);
}

#[test]
fn a_failed_batch_gives_each_member_its_failure_mode_and_spares_the_breaker() {
    let cfg = batched_config();
    let breaker = Rc::new(Breakers::new(2, Duration::from_millis(100)));
    let mut h = FakeHost::get("/x");
    for _ in 0..5 {
        let mut f = Flow::new(cfg.clone(), breaker.clone());
        f.on_request_headers(&mut h, true);
        let failure = (ErrorKind::Timeout, "batch timed out".to_string());
        f.on_batch_verdict(&mut h, Verdict::Failed(failure));
    }
    assert_eq!(count(&h, Counter::RedisError(ErrorKind::Timeout)), 5);
    assert_eq!(count(&h, Counter::FailureDenied), 5);
    assert_eq!(h.sent.iter().filter(|r| r.status == 503).count(), 5);
    assert_eq!(
        count(&h, Counter::CircuitOpened),
        0,
        "the batch told it, once"
    );
    assert_eq!(breaker.for_tag(Some(TAG)).consecutive_failures(), 0);
}

#[test]
fn a_batch_that_cannot_take_the_request_decides_it_at_once() {
    let mut f = Flow::new(batched_config(), test_breaker());
    let mut h = FakeHost::get("/x");
    h.batch_fails = Some((ErrorKind::Dispatch, "no cluster".to_string()));
    assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
    assert_eq!(h.sent.last().map(|r| r.status), Some(503));
    assert_eq!(count(&h, Counter::RedisError(ErrorKind::Dispatch)), 1);
}

#[test]
fn keyed_requests_lease_fetches_and_probes_keep_their_own_call() {
    // Keyed: the acquire joined with its limits, one call of its own.
    let json = IDEM_CONFIG
        .replace(r#""batch":{"enabled":false},"#, "")
        .replace("FAILURE", "allow");
    let cfg = Rc::new(Config::parse(json.as_bytes()).unwrap());
    assert!(cfg.redis.batch.is_some());
    let mut f = Flow::new(cfg, test_breaker());
    let mut h = FakeHost::post("/pay", b"abc-123");
    f.on_request_headers(&mut h, true);
    assert_eq!((h.dispatched.len(), h.batched.len()), (1, 0));

    // A lease fetch.
    let cfg = Rc::new(
        Config::parse(
            br#"{"redis":{"cluster":"w"},"limits":[{"name":"a",
            "tokenBucket":{"capacity":100,"refill":1,"periodMs":1000},"lease":{"tokens":3,"ttlMs":500}}]}"#,
        )
        .unwrap(),
    );
    let mut f = Flow::new(cfg, test_breaker());
    let mut h = FakeHost::get("/x");
    f.on_request_headers(&mut h, true);
    assert!(h.dispatched[0].contains(&LEASE.sha1));
    assert!(h.batched.is_empty());

    // The probe of an open breaker tests Redis alone.
    let breaker = Rc::new(Breakers::new(1, Duration::from_millis(100)));
    let mut h = FakeHost::get("/x");
    let mut f = Flow::new(batched_config(), breaker.clone());
    f.on_request_headers(&mut h, true);
    f.on_batch_verdict(&mut h, Verdict::Failed((ErrorKind::Timeout, "t".into())));
    crate::filter::retry::tell_breaker(&mut h, &breaker.for_tag(Some(TAG)));
    h.clock_ms = 150;
    let mut probe = Flow::new(batched_config(), breaker);
    assert_eq!(probe.on_request_headers(&mut h, true), Action::Pause);
    assert_eq!((h.dispatched.len(), h.batched.len()), (1, 1));
    assert!(h.dispatched[0].contains(&RATELIMIT.sha1));
}

// ---- the worker's batcher ------------------------------------------------

/// A stream, as the batcher sees it: a number, and whether it left.
#[derive(Clone, Debug, PartialEq)]
struct Stream(usize, Rc<Cell<bool>>);

impl Waiter for Stream {
    fn gone(&self) -> bool {
        self.1.get()
    }
}

#[test]
fn a_request_finding_its_worker_quiet_sends_its_own_call_at_once_and_frees_the_group_when_answered()
{
    let cfg = batched_config();
    let mut f = Flow::new(cfg.clone(), test_breaker());
    let mut h = FakeHost::get("/x");
    h.quiet_worker = true;
    assert_eq!(f.on_request_headers(&mut h, true), Action::Pause);
    assert!(h.batched.is_empty(), "no queue, no wake-up");
    assert_eq!(h.dispatched.len(), 1, "its own call, from its own stream");
    assert!(
        h.dispatched[0].starts_with(&format!("EVALSHA/{}/", RATELIMIT.sha1)),
        "the single-request script"
    );
    assert_eq!(count(&h, Counter::BatchAlone), 1);
    assert_eq!(count(&h, Counter::BatchCalls), 0);
    let plan = Plan::build(&cfg, &RequestLine::read(&h), &h).unwrap();
    assert_eq!(h.alone, [plan.tag.clone().unwrap()]);
    assert!(h.released.is_empty(), "held while the call is out");
    f.on_callout_reply(&mut h, 1, ok(ADMIT));
    assert_eq!(h.resumed, 1);
    assert_eq!(h.released, h.alone, "answered: the group is free");
    f.on_stream_end(&mut h);
    assert_eq!(h.released.len(), 1, "released once");
}

#[test]
fn a_lone_call_keeps_its_group_through_a_retry_and_frees_it_when_it_fails_or_its_stream_ends() {
    let cfg = batched_config();
    // Refused (Webdis 503), retried after a pause, then timed out: failed.
    let mut f = Flow::new(cfg.clone(), test_breaker());
    let mut h = FakeHost::get("/x");
    h.quiet_worker = true;
    h.can_schedule = true;
    f.on_request_headers(&mut h, true);
    f.on_callout_reply(&mut h, 1, refused());
    assert_eq!(h.wakes.len(), 1);
    assert!(h.released.is_empty(), "held through the pause");
    f.on_wake(&mut h);
    assert_eq!(h.dispatched.len(), 2);
    f.on_callout_reply(&mut h, 2, no_answer());
    assert_eq!(h.sent.last().map(|r| r.status), Some(503), "deny");
    assert_eq!(h.released.len(), 1);

    // NOSCRIPT: the same call again as EVAL, the group still held.
    let mut f = Flow::new(cfg.clone(), test_breaker());
    let mut h = FakeHost::get("/x");
    h.quiet_worker = true;
    f.on_request_headers(&mut h, true);
    f.on_callout_reply(&mut h, 1, ok(b"-NOSCRIPT No matching script.\r\n"));
    assert_eq!(h.dispatched.len(), 2);
    assert!(h.dispatched[1].starts_with("EVAL/"));
    assert!(h.released.is_empty(), "held through the reload");
    f.on_callout_reply(&mut h, 2, ok(ADMIT));
    assert_eq!((h.resumed, h.released.len()), (1, 1));
    assert_eq!(
        count(&h, Counter::BatchAlone),
        1,
        "one lone call, resent once"
    );

    // A call that cannot be sent is no lone call: failed, counted as none,
    // the group freed at once.
    let mut f = Flow::new(cfg.clone(), test_breaker());
    let mut h = FakeHost::get("/x");
    h.quiet_worker = true;
    h.dispatch_fails = true;
    f.on_request_headers(&mut h, true);
    assert_eq!(h.sent.last().map(|r| r.status), Some(503));
    assert_eq!(count(&h, Counter::BatchAlone), 0);
    assert_eq!(h.released, h.alone);

    // The client leaves with the call out: the host cancels the call, so
    // no reply will come to free the group; the stream's end does.
    let mut f = Flow::new(cfg, test_breaker());
    let mut h = FakeHost::get("/x");
    h.quiet_worker = true;
    f.on_request_headers(&mut h, true);
    assert!(h.released.is_empty());
    f.on_stream_end(&mut h);
    assert_eq!(h.released, h.alone);
}

#[test]
fn a_group_held_by_a_lone_call_queues_what_arrives_and_wakes_the_worker_when_freed() {
    let (mut b, _) = batcher(32, 1);
    let mut h = FakeHost::get("/");
    assert!(b.try_alone("{t}"), "nothing out: go alone");
    assert!(!b.try_alone("{t}"), "one out: the next one queues");
    assert!(!b.join(stream(1), member("k", 300)), "no call to spare");
    assert!(b.flush(&mut h, &target()).is_empty());
    assert!(h.dispatched.is_empty(), "it waits for the lone call");
    assert!(
        b.release("{t}"),
        "freed: wake the worker to send what queued"
    );
    assert!(b.flush(&mut h, &target()).is_empty());
    assert_eq!(h.dispatched.len(), 1);
    assert!(!b.try_alone("{t}"), "a batch is out");
    b.on_reply(&mut h, &target(), 1, &batch_admit(1));
    assert!(b.try_alone("{t}"), "quiet again");
    assert!(!b.release("{t}"), "nothing queued: no wake-up");
    assert!(b.try_alone("{t}"), "the group was emptied");
    // With two calls allowed, a lone call leaves room for a batch.
    let (mut b, _) = batcher(32, 2);
    assert!(b.try_alone("{t}"));
    assert!(b.join(stream(2), member("k", 300)), "one call to spare");
    assert!(!b.try_alone("{t}"), "something queued: join it");
}

fn stream(n: usize) -> Stream {
    Stream(n, Rc::new(Cell::new(false)))
}

fn member(key: &str, deadline_ms: u64) -> Member {
    Member {
        tag: "{t}".to_string(),
        // One token of a 5-token bucket, in lua/ratelimit.lua's layout.
        args: (
            vec![key.as_bytes().to_vec()],
            ["1", "tb", "5", "1", "1000", "1", "1"]
                .iter()
                .map(|v| v.as_bytes().to_vec())
                .collect(),
        ),
        deadline: Duration::from_millis(deadline_ms),
    }
}

/// The batch call of `m` members of `key` as the fake host shows it: a PUT
/// whose path names the key once, the packed members its body.
fn batch_of(key: &str, m: usize) -> String {
    let packed = pack(&vec![member(key, 300).args; m]).unwrap();
    format!(
        "EVALSHA/{}/1/{key}.raw<{}",
        BATCH.sha1,
        String::from_utf8_lossy(&packed.body)
    )
}

fn batcher(max_requests: usize, max_in_flight: usize) -> (Batcher<Stream>, Rc<Breakers>) {
    let breaker = Rc::new(Breakers::new(2, Duration::from_millis(100)));
    let limits = Batch {
        max_requests,
        max_in_flight,
    };
    (Batcher::new(limits, breaker.clone()), breaker)
}

fn target() -> crate::config::RedisTarget {
    batched_config().redis.clone()
}

/// lua/batch.lua's reply admitting `m` members (one limit each).
fn batch_admit(m: usize) -> CalloutReply {
    let mut out = format!("*{}\r\n:{m}\r\n", 1 + 6 * m);
    for _ in 0..m {
        out.push_str(":5\r\n:1\r\n:1\r\n:4\r\n:0\r\n:1000\r\n");
    }
    ok(out.as_bytes())
}

fn ids(verdicts: &[(Stream, Verdict)]) -> Vec<usize> {
    verdicts.iter().map(|(s, _)| s.0).collect()
}

/// Joins each member and flushes, as the root does when woken.
fn join_all(
    b: &mut Batcher<Stream>,
    h: &mut FakeHost,
    members: Vec<(Stream, Member)>,
) -> Vec<bool> {
    let wakes = members.into_iter().map(|(w, m)| b.join(w, m)).collect();
    assert!(b.flush(h, &target()).is_empty());
    wakes
}

#[test]
fn a_quiet_worker_sends_a_request_when_woken_and_queues_only_behind_its_calls() {
    let (mut b, _) = batcher(32, 1);
    let mut h = FakeHost::get("/");
    assert_eq!(
        join_all(&mut b, &mut h, vec![(stream(1), member("k", 300))]),
        [true]
    );
    assert_eq!(h.dispatched.len(), 1, "sent by the flush");
    // A PUT: the keys in the path, the packed members as the body.
    assert_eq!(h.dispatched[0], batch_of("k", 1));
    assert_eq!(h.timeouts, [Duration::from_millis(300)]);
    let wakes: Vec<bool> = (2..=4)
        .map(|n| b.join(stream(n), member("k", 300)))
        .collect();
    assert_eq!(
        wakes,
        [false, false, false],
        "the group has no call to spare"
    );
    assert!(b.flush(&mut h, &target()).is_empty());
    assert_eq!(h.dispatched.len(), 1, "three wait for the call out");
    let verdicts = b.on_reply(&mut h, &target(), 1, &batch_admit(1));
    assert_eq!(ids(&verdicts), [1]);
    assert!(matches!(&verdicts[0].1, Verdict::Ran(Reply::Array(Some(v))) if v.len() == 5));
    assert_eq!(h.dispatched.len(), 2, "what queued left as one call");
    assert_eq!(h.dispatched[1], batch_of("k", 3), "the key sent once");
    let verdicts = b.on_reply(&mut h, &target(), 2, &batch_admit(3));
    assert_eq!(ids(&verdicts), [2, 3, 4]);
    assert_eq!(count(&h, Counter::BatchCalls), 2);
    assert_eq!(
        h.observed,
        [(Histogram::BatchSize, 1), (Histogram::BatchSize, 3)]
    );
    assert_eq!(count(&h, Counter::RedisCalls), 2);
}

#[test]
fn members_that_join_before_the_worker_wakes_leave_together() {
    let (mut b, _) = batcher(32, 2);
    let mut h = FakeHost::get("/");
    let wakes = join_all(
        &mut b,
        &mut h,
        (1..=3).map(|n| (stream(n), member("k", 300))).collect(),
    );
    assert_eq!(wakes, [true, true, true]);
    assert_eq!(h.dispatched.len(), 1, "one call for all three");
    assert_eq!(h.observed, [(Histogram::BatchSize, 3)]);
}

#[test]
fn calls_in_flight_are_bounded_and_batches_by_max_requests() {
    let (mut b, _) = batcher(2, 2);
    let mut h = FakeHost::get("/");
    b.join(stream(1), member("k", 300));
    b.flush(&mut h, &target());
    b.join(stream(2), member("k", 300));
    b.flush(&mut h, &target());
    for n in 3..=7 {
        assert!(!b.join(stream(n), member("k", 300)));
    }
    assert_eq!(h.dispatched.len(), 2, "two calls out, one member each");
    let verdicts = b.on_reply(&mut h, &target(), 1, &batch_admit(1));
    assert_eq!(ids(&verdicts), [1]);
    assert_eq!(h.dispatched.len(), 3);
    assert_eq!(h.dispatched[2], batch_of("k", 2), "at most 2 per call");
    b.on_reply(&mut h, &target(), 2, &batch_admit(1));
    b.on_reply(&mut h, &target(), 3, &batch_admit(2));
    let last = b.on_reply(&mut h, &target(), 4, &batch_admit(2));
    assert_eq!(ids(&last), [5, 6]);
    assert_eq!(h.dispatched.len(), 5);
    let after = b.on_reply(&mut h, &target(), 5, &batch_admit(1));
    assert_eq!(ids(&after), [7]);
    assert_eq!(h.dispatched.len(), 5, "nothing left");
}

#[test]
fn groups_of_different_hash_tags_never_share_a_call() {
    let (mut b, _) = batcher(32, 1);
    let mut h = FakeHost::get("/");
    let mut other = member("j", 300);
    other.tag = "{u}".to_string();
    join_all(
        &mut b,
        &mut h,
        vec![(stream(1), member("k", 300)), (stream(2), other)],
    );
    assert_eq!(h.dispatched.len(), 2);
    assert!(h.dispatched.contains(&batch_of("k", 1)));
    assert!(h.dispatched.contains(&batch_of("j", 1)));
}

#[test]
fn a_member_whose_client_left_is_dropped_before_its_batch_leaves() {
    let (mut b, _) = batcher(32, 1);
    let mut h = FakeHost::get("/");
    join_all(&mut b, &mut h, vec![(stream(1), member("k", 300))]);
    let leaving = stream(2);
    b.join(leaving.clone(), member("k", 300));
    b.join(stream(3), member("k", 300));
    leaving.1.set(true);
    b.on_reply(&mut h, &target(), 1, &batch_admit(1));
    assert_eq!(h.dispatched[1], batch_of("k", 1), "one member");
    let verdicts = b.on_reply(&mut h, &target(), 2, &batch_admit(1));
    assert_eq!(ids(&verdicts), [3]);
}

#[test]
fn queued_members_past_their_deadline_fail_as_timeouts_and_the_call_takes_the_oldest_deadline() {
    let (mut b, _) = batcher(32, 1);
    let mut h = FakeHost::get("/");
    join_all(&mut b, &mut h, vec![(stream(1), member("k", 300))]);
    b.join(stream(2), member("k", 100));
    b.join(stream(3), member("k", 400));
    b.join(stream(4), member("k", 350));
    h.clock_ms = 150;
    let verdicts = b.on_reply(&mut h, &target(), 1, &batch_admit(1));
    assert_eq!(ids(&verdicts), [1, 2]);
    assert!(matches!(
        &verdicts[1].1,
        Verdict::Failed((ErrorKind::Timeout, _))
    ));
    assert_eq!(h.dispatched[1], batch_of("k", 2));
    assert_eq!(
        h.timeouts,
        [Duration::from_millis(300), Duration::from_millis(200)],
        "what is left of the oldest member's 350 ms"
    );
}

#[test]
fn a_failed_batch_fails_every_member_and_tells_the_breaker_once() {
    let (mut b, breaker) = batcher(32, 1);
    let mut h = FakeHost::get("/");
    join_all(&mut b, &mut h, vec![(stream(1), member("k", 300))]);
    for n in 2..=4 {
        b.join(stream(n), member("k", 300));
    }
    b.on_reply(&mut h, &target(), 1, &batch_admit(1));
    let verdicts = b.on_reply(&mut h, &target(), 2, &no_answer());
    assert_eq!(ids(&verdicts), [2, 3, 4]);
    assert!(verdicts
        .iter()
        .all(|(_, v)| matches!(v, Verdict::Failed((ErrorKind::Timeout, _)))));
    assert_eq!(breaker.for_tag(Some("{t}")).consecutive_failures(), 1);
}

#[test]
fn a_batch_that_cannot_be_sent_fails_its_members_at_once() {
    let (mut b, breaker) = batcher(32, 1);
    let mut h = FakeHost::get("/");
    h.dispatch_fails = true;
    b.join(stream(1), member("k", 300));
    b.join(stream(2), member("k", 300));
    let verdicts = b.flush(&mut h, &target());
    assert_eq!(ids(&verdicts), [1, 2]);
    assert!(verdicts
        .iter()
        .all(|(_, v)| matches!(v, Verdict::Failed((ErrorKind::Dispatch, _)))));
    assert_eq!(breaker.for_tag(Some("{t}")).consecutive_failures(), 1);
    h.dispatch_fails = false;
    join_all(&mut b, &mut h, vec![(stream(3), member("k", 300))]);
    assert_eq!(h.dispatched.len(), 1, "the group has its call back");
}

#[test]
fn a_batch_meeting_noscript_goes_once_more_as_eval_and_a_refusal_once_more_at_once() {
    let (mut b, _) = batcher(32, 1);
    let mut h = FakeHost::get("/");
    join_all(&mut b, &mut h, vec![(stream(1), member("k", 300))]);
    let noscript = ok(b"-NOSCRIPT No matching script.\r\n");
    assert!(b.on_reply(&mut h, &target(), 1, &noscript).is_empty());
    assert_eq!(count(&h, Counter::ScriptReloads), 1);
    assert!(h.dispatched[1].starts_with("EVAL/"));
    assert!(b.on_reply(&mut h, &target(), 2, &refused()).is_empty());
    assert_eq!(h.dispatched.len(), 3, "sent again at once");
    assert_eq!(count(&h, Counter::RedisRetries), 1);
    let verdicts = b.on_reply(&mut h, &target(), 3, &refused());
    assert!(matches!(
        &verdicts[0].1,
        Verdict::Failed((ErrorKind::Http, _))
    ));
}

#[test]
fn a_batch_reply_for_fewer_members_than_sent_fails_them_all() {
    let (mut b, _) = batcher(32, 1);
    let mut h = FakeHost::get("/");
    join_all(&mut b, &mut h, vec![(stream(1), member("k", 300))]);
    b.join(stream(2), member("k", 300));
    b.join(stream(3), member("k", 300));
    b.on_reply(&mut h, &target(), 1, &batch_admit(1));
    let verdicts = b.on_reply(&mut h, &target(), 2, &batch_admit(1));
    assert_eq!(ids(&verdicts), [2, 3]);
    assert!(verdicts
        .iter()
        .all(|(_, v)| matches!(v, Verdict::Failed((ErrorKind::Reply, _)))));
}

#[test]
fn a_refused_batch_keeps_the_timer_running_until_it_is_sent_again() {
    let (mut b, _) = batcher(32, 1);
    let mut h = FakeHost::get("/");
    h.can_schedule = true;
    join_all(&mut b, &mut h, vec![(stream(1), member("k", 300))]);
    assert!(!b.needs_tick(), "one call out, nothing queued");
    assert!(b.on_reply(&mut h, &target(), 1, &refused()).is_empty());
    assert_eq!(h.wakes, [Duration::from_millis(25)]);
    assert!(b.needs_tick(), "the pause is the timer's");
    h.clock_ms = 24;
    assert!(b.on_tick(&mut h, &target()).is_empty());
    assert_eq!(h.dispatched.len(), 1, "not before its pause is over");
    assert!(b.needs_tick());
    h.clock_ms = 25;
    b.on_tick(&mut h, &target());
    assert_eq!(h.dispatched.len(), 2);
    assert!(!b.needs_tick());
    let verdicts = b.on_reply(&mut h, &target(), 2, &batch_admit(1));
    assert_eq!(ids(&verdicts), [1]);
}

#[test]
fn a_group_whose_wake_up_was_lost_is_flushed_by_the_timer() {
    let (mut b, _) = batcher(32, 1);
    let mut h = FakeHost::get("/");
    assert!(b.join(stream(1), member("k", 300)));
    assert!(b.needs_tick(), "queued with a call to spare");
    b.on_tick(&mut h, &target());
    assert_eq!(h.dispatched.len(), 1);
    assert!(!b.needs_tick());
}

#[test]
fn a_member_the_script_refused_fails_alone_and_spares_the_breaker() {
    let (mut b, breaker) = batcher(32, 1);
    let mut h = FakeHost::get("/");
    join_all(&mut b, &mut h, vec![(stream(1), member("k", 300))]);
    b.join(stream(2), member("k", 300));
    b.join(stream(3), member("k", 300));
    b.on_reply(&mut h, &target(), 1, &batch_admit(1));
    // lua/batch.lua's reply: member 1 refused (its length 1, the error its
    // lone call would have had), member 2 admitted.
    let why = "ERR redis-guard ratelimit: limit 1: no window of its edges holds Redis' clock (the proxy's clock is off by more than a window)";
    let reply = format!(
        "*9\r\n:2\r\n:1\r\n${}\r\n{why}\r\n:5\r\n:1\r\n:1\r\n:4\r\n:0\r\n:1000\r\n",
        why.len()
    );
    let verdicts = b.on_reply(&mut h, &target(), 2, &ok(reply.as_bytes()));
    assert_eq!(ids(&verdicts), [2, 3]);
    assert_eq!(
        verdicts[0].1,
        Verdict::Failed((ErrorKind::Redis, format!("redis error: {why}")))
    );
    assert!(matches!(&verdicts[1].1, Verdict::Ran(Reply::Array(Some(v))) if v.len() == 5));
    assert_eq!(breaker.for_tag(Some("{t}")).consecutive_failures(), 0);
}
