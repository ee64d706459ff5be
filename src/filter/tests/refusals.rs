//! How a decision's call reads Redis' error replies: a refusal before the
//! script wrote anything is sent again within the timeout; a refusal of
//! the credentials is the failure mode at once, counted as auth.

use super::*;

#[test]
fn a_refusal_before_the_script_wrote_is_retried_not_no_answer() {
    for refusal in [
        &b"-TRYAGAIN Multiple keys request during rehashing of slot\r\n"[..],
        b"-CLUSTERDOWN The cluster is down\r\n",
        b"-LOADING Redis is loading the dataset in memory\r\n",
        // Redis 7.0.15's words when a script's first write meets a replica.
        b"-READONLY You can't write against a read only replica. script: 54ae29159bacdf93a25462d644f00c822e89b44b, on @user_script:1.\r\n",
        b"-MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.\r\n",
    ] {
        let mut f = flow("deny");
        let mut h = FakeHost::get("/api/x");
        h.can_schedule = true;
        f.on_request_headers(&mut h, true);
        f.on_callout_reply(&mut h, 1, ok(refusal));
        assert_eq!(h.wakes, [RETRY_DELAY]);
        f.on_wake(&mut h);
        assert_eq!(h.dispatched.len(), 2);
        assert_eq!(h.dispatched[0], h.dispatched[1], "the same command again");
        f.on_callout_reply(&mut h, 2, ok(ADMIT));
        assert_eq!((h.resumed, h.sent.len()), (1, 0));
        assert_eq!(count(&h, Counter::RedisRetries), 1);
        assert!(!h
            .counters
            .iter()
            .any(|c| matches!(c, Counter::RedisError(_))));
    }
    // Other error replies are failures at once.
    let (mut f, mut h) = started("deny");
    f.on_callout_reply(&mut h, 1, ok(b"-OOM command not allowed\r\n"));
    assert_eq!(h.dispatched.len(), 1);
    assert_eq!(h.sent[0].status, 503);
    assert_eq!(count(&h, Counter::RedisError(ErrorKind::Redis)), 1);
}

#[test]
fn a_credentials_refusal_by_redis_is_counted_as_auth_and_takes_the_failure_mode() {
    for refusal in [
        &b"-NOAUTH Authentication required.\r\n"[..],
        b"-WRONGPASS invalid username-password pair or user is disabled.\r\n",
        b"-NOPERM this user has no permissions to run the 'evalsha' command\r\n",
        b"-ERR The user executing the script can't run this command or subcommand\r\n",
    ] {
        let (mut f, mut h) = started("deny");
        f.on_callout_reply(&mut h, 1, ok(refusal));
        assert_eq!(h.dispatched.len(), 1, "not retried");
        assert_eq!(h.sent[0].status, 503);
        assert_eq!(count(&h, Counter::RedisError(ErrorKind::Auth)), 1);
        assert_eq!(count(&h, Counter::RedisError(ErrorKind::Redis)), 0);
    }
}
