//! One request's path through the filter, independent of proxy-wasm.

use std::rc::Rc;
use std::time::Duration;

use crate::config::{Config, FailureMode};
use crate::filter::{Counter, Host};
use crate::ratelimit::{parse_outcome, Plan};
use crate::request::RequestLine;
use crate::response::{bad_request, rate_limit_headers, too_many_requests, unavailable};
use crate::scripts::RATELIMIT;
use crate::webdis::{command_body, parse_reply, Reply};

/// What the host should do after a request-headers callback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Continue,
    Pause,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Idle,
    /// Waiting for Webdis; `eval` is true once the EVALSHA fallback was taken,
    /// `retried` once the single retry after a Webdis 503 was spent.
    AwaitingRedis {
        token: u32,
        eval: bool,
        retried: bool,
    },
    Done,
}

/// The answer of a Redis callout, as the host saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CalloutReply {
    /// The HTTP status of Webdis' answer; `None` when the call failed
    /// (timeout, connection refused, reset).
    pub status: Option<u32>,
    /// The answer came from Webdis itself (its `server` header), not from
    /// Envoy on its behalf.
    pub from_webdis: bool,
    pub body: Vec<u8>,
}

pub struct Flow {
    config: Rc<Config>,
    plan: Plan,
    phase: Phase,
    /// When the Redis decision must be in: every attempt (retry, NOSCRIPT
    /// fallback) shares the one configured timeout.
    deadline: Duration,
    response_headers: Vec<(String, String)>,
}

impl Flow {
    pub fn new(config: Rc<Config>) -> Flow {
        Flow {
            config,
            plan: Plan::default(),
            phase: Phase::Idle,
            deadline: Duration::ZERO,
            response_headers: Vec::new(),
        }
    }

    pub fn on_request_headers<H: Host>(&mut self, host: &mut H) -> Verdict {
        let line = RequestLine::read(host);
        self.plan = match Plan::build(&self.config, &line, host) {
            Ok(plan) => plan,
            Err(bad) => {
                self.phase = Phase::Done;
                host.send_local(&bad_request(&bad.detail));
                return Verdict::Pause;
            }
        };
        if self.plan.is_empty() {
            self.phase = Phase::Done;
            return Verdict::Continue;
        }
        for check in &self.plan.checks {
            host.count(Counter::Checked(check.limit));
        }
        self.deadline = host.now() + self.config.redis.timeout;
        match self.call(host, false, false) {
            Ok(()) => Verdict::Pause,
            Err(why) => self.fail(host, &why, false),
        }
    }

    fn call<H: Host>(&mut self, host: &mut H, eval: bool, retried: bool) -> Result<(), String> {
        let (keys, argv) = self.plan.script_args(&self.config);
        let nkeys = keys.len().to_string();
        let mut args: Vec<&[u8]> = Vec::with_capacity(2 + keys.len() + argv.len());
        let command = if eval {
            args.push(RATELIMIT.source.as_bytes());
            "EVAL"
        } else {
            args.push(RATELIMIT.sha1.as_bytes());
            "EVALSHA"
        };
        args.push(nkeys.as_bytes());
        args.extend(keys.iter().map(Vec::as_slice));
        args.extend(argv.iter().map(Vec::as_slice));
        let body = command_body(command, &args);
        let left = self.deadline.saturating_sub(host.now());
        if left < Duration::from_millis(1) {
            return Err("redis timeout spent".to_string());
        }
        host.count(Counter::RedisCalls);
        let token = host.dispatch_redis(&self.config.redis, &body, left)?;
        self.phase = Phase::AwaitingRedis {
            token,
            eval,
            retried,
        };
        Ok(())
    }

    /// Redis could not decide: apply the failure mode. `paused` tells whether
    /// the request is waiting on us (callout) or still in its headers callback.
    fn fail<H: Host>(&mut self, host: &mut H, why: &str, paused: bool) -> Verdict {
        self.phase = Phase::Done;
        host.count(Counter::RedisErrors);
        match self.plan.failure_mode(&self.config) {
            FailureMode::Deny => {
                log::warn!("redis-guard: rate limit undecided, denying: {why}");
                host.count(Counter::FailureDenied);
                host.send_local(&unavailable("rate limit backend unavailable"));
                Verdict::Pause
            }
            FailureMode::Allow => {
                log::warn!("redis-guard: rate limit undecided, allowing: {why}");
                host.count(Counter::FailureAllowed);
                if paused {
                    host.resume_request();
                }
                Verdict::Continue
            }
        }
    }

    pub fn on_callout_reply<H: Host>(&mut self, host: &mut H, token: u32, reply: CalloutReply) {
        let Phase::AwaitingRedis {
            token: want,
            eval,
            retried,
        } = self.phase
        else {
            return;
        };
        if token != want {
            return;
        }
        match reply.status {
            Some(200) => {}
            // Webdis' own 503 says the command never reached Redis (e.g. the
            // first call on a pooled connection to a restarted Redis), so it
            // can run again without charging twice. Envoy's 503 (reset after
            // sending) carries no such promise and is not retried.
            Some(503) if reply.from_webdis && !retried => {
                host.count(Counter::RedisRetries);
                if let Err(e) = self.call(host, eval, true) {
                    self.fail(host, &e, true);
                }
                return;
            }
            Some(s) => {
                self.fail(host, &format!("webdis answered HTTP {s}"), true);
                return;
            }
            None => {
                self.fail(host, "redis call failed or timed out", true);
                return;
            }
        }
        let parsed = match parse_reply(&reply.body) {
            Ok(r) => r,
            Err(e) => {
                self.fail(host, &format!("unreadable reply: {e}"), true);
                return;
            }
        };
        if let Reply::Error(msg) = &parsed {
            // Scripts vanish when Redis restarts or a cluster node is new; EVAL
            // both runs and caches the script, so this costs one extra trip once.
            if parsed.error_kind() == Some("NOSCRIPT") && !eval {
                host.count(Counter::ScriptReloads);
                if let Err(e) = self.call(host, true, retried) {
                    self.fail(host, &e, true);
                }
                return;
            }
            self.fail(host, &format!("redis error: {msg}"), true);
            return;
        }
        let outcome = match parse_outcome(&parsed, self.plan.checks.len()) {
            Ok(o) => o,
            Err(e) => {
                self.fail(host, &format!("unexpected script reply: {e}"), true);
                return;
            }
        };
        self.phase = Phase::Done;
        for (check, result) in self.plan.checks.iter().zip(&outcome.results) {
            let shadow = self.config.limits[check.limit].shadow;
            match (shadow, result.allowed) {
                (true, false) => {
                    log::info!(
                        "redis-guard: shadow limit `{}` would reject",
                        self.config.limits[check.limit].name
                    );
                    host.count(Counter::ShadowRejected(check.limit));
                }
                (_, true) => host.count(Counter::Allowed(check.limit)),
                (false, false) => host.count(Counter::Rejected(check.limit)),
            }
        }
        if outcome.admitted {
            self.response_headers = rate_limit_headers(&self.config, &self.plan, &outcome);
            host.resume_request();
        } else {
            host.send_local(&too_many_requests(&self.config, &self.plan, &outcome));
        }
    }

    pub fn on_response_headers<H: Host>(&mut self, host: &mut H) {
        for (name, value) in self.response_headers.drain(..) {
            host.add_response_header(&name, &value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RedisTarget;
    use crate::request::RequestView;
    use crate::response::LocalReply;
    use std::collections::HashMap;

    #[derive(Default)]
    struct FakeHost {
        headers: HashMap<String, Vec<u8>>,
        dispatched: Vec<String>,
        dispatch_fails: bool,
        sent: Vec<LocalReply>,
        resumed: usize,
        added: Vec<(String, String)>,
        counters: Vec<Counter>,
        clock_ms: u64,
        timeouts: Vec<Duration>,
    }

    impl FakeHost {
        fn get(path: &str) -> FakeHost {
            let mut h = FakeHost::default();
            h.headers.insert(":method".into(), b"GET".to_vec());
            h.headers.insert(":path".into(), path.as_bytes().to_vec());
            h.headers
                .insert(":authority".into(), b"example.com".to_vec());
            h
        }
    }

    impl RequestView for FakeHost {
        fn header(&self, name: &str) -> Option<Vec<u8>> {
            self.headers.get(name).cloned()
        }
        fn client_address(&self) -> Option<String> {
            Some("127.0.0.1:1234".into())
        }
    }

    impl Host for FakeHost {
        fn dispatch_redis(
            &mut self,
            _: &RedisTarget,
            body: &[u8],
            timeout: Duration,
        ) -> Result<u32, String> {
            self.timeouts.push(timeout);
            if self.dispatch_fails {
                return Err("no cluster".into());
            }
            self.dispatched
                .push(String::from_utf8_lossy(body).into_owned());
            Ok(self.dispatched.len() as u32)
        }
        fn send_local(&mut self, reply: &LocalReply) {
            self.sent.push(reply.clone());
        }
        fn resume_request(&mut self) {
            self.resumed += 1;
        }
        fn add_response_header(&mut self, name: &str, value: &str) {
            self.added.push((name.into(), value.into()));
        }
        fn count(&mut self, counter: Counter) {
            self.counters.push(counter);
        }
        fn now(&self) -> Duration {
            Duration::from_millis(self.clock_ms)
        }
    }

    fn flow(failure: &str) -> Flow {
        let cfg = Config::parse(
            format!(
                r#"{{"redis":{{"cluster":"webdis"}},"failureMode":"{failure}","limits":[
                {{"name":"a","match":{{"pathPrefix":"/api"}},"tokenBucket":{{"capacity":2,"refill":1,"periodMs":1000}}}}]}}"#
            )
            .as_bytes(),
        )
        .unwrap();
        Flow::new(Rc::new(cfg))
    }

    fn ok(body: &[u8]) -> CalloutReply {
        CalloutReply {
            status: Some(200),
            from_webdis: true,
            body: body.to_vec(),
        }
    }

    const ADMIT: &[u8] = b"*5\r\n$1\r\n1\r\n$1\r\n1\r\n$1\r\n1\r\n$1\r\n0\r\n$4\r\n1000\r\n";
    const REJECT: &[u8] = b"*5\r\n$1\r\n0\r\n$1\r\n0\r\n$1\r\n0\r\n$3\r\n400\r\n$3\r\n400\r\n";

    #[test]
    fn unmatched_requests_pass_without_a_redis_call() {
        let mut f = flow("allow");
        let mut h = FakeHost::get("/public");
        assert_eq!(f.on_request_headers(&mut h), Verdict::Continue);
        assert!(h.dispatched.is_empty());
    }

    #[test]
    fn admitted_request_resumes_and_gets_headers() {
        let mut f = flow("allow");
        let mut h = FakeHost::get("/api/x");
        assert_eq!(f.on_request_headers(&mut h), Verdict::Pause);
        assert_eq!(h.dispatched.len(), 1);
        assert!(h.dispatched[0].starts_with(&format!("EVALSHA/{}/1/rg%3Arl%3A%7B", RATELIMIT.sha1)));
        f.on_callout_reply(&mut h, 1, ok(ADMIT));
        assert_eq!(h.resumed, 1);
        assert!(h.sent.is_empty());
        f.on_response_headers(&mut h);
        assert!(h
            .added
            .iter()
            .any(|(n, v)| n == "x-ratelimit-remaining" && v == "1"));
        assert!(h.counters.contains(&Counter::Allowed(0)));
    }

    #[test]
    fn rejected_request_gets_429_and_is_not_resumed() {
        let mut f = flow("allow");
        let mut h = FakeHost::get("/api/x");
        f.on_request_headers(&mut h);
        f.on_callout_reply(&mut h, 1, ok(REJECT));
        assert_eq!(h.resumed, 0);
        assert_eq!(h.sent.len(), 1);
        assert_eq!(h.sent[0].status, 429);
        assert!(h.sent[0]
            .headers
            .iter()
            .any(|(n, v)| n == "retry-after" && v == "1"));
        assert!(h.counters.contains(&Counter::Rejected(0)));
    }

    #[test]
    fn noscript_falls_back_to_eval_once() {
        let mut f = flow("deny");
        let mut h = FakeHost::get("/api/x");
        f.on_request_headers(&mut h);
        f.on_callout_reply(&mut h, 1, ok(b"-NOSCRIPT No matching script.\r\n"));
        assert_eq!(h.dispatched.len(), 2);
        assert!(h.dispatched[1].starts_with("EVAL/"));
        assert!(h.dispatched[1].contains("%2D%2D%5B%5B%20redis%2Dguard"));
        // A second NOSCRIPT (impossible after EVAL, but never loop) is a failure.
        f.on_callout_reply(&mut h, 2, ok(b"-NOSCRIPT again\r\n"));
        assert_eq!(h.dispatched.len(), 2);
        assert_eq!(h.sent[0].status, 503);
    }

    #[test]
    fn stale_tokens_are_ignored() {
        let mut f = flow("allow");
        let mut h = FakeHost::get("/api/x");
        f.on_request_headers(&mut h);
        f.on_callout_reply(&mut h, 99, ok(ADMIT));
        assert_eq!(h.resumed, 0);
        f.on_callout_reply(&mut h, 1, ok(ADMIT));
        assert_eq!(h.resumed, 1);
        f.on_callout_reply(&mut h, 1, ok(ADMIT));
        assert_eq!(h.resumed, 1, "a reply after the decision changes nothing");
    }

    #[test]
    fn failures_follow_the_failure_mode() {
        let bad_replies = [
            CalloutReply {
                status: None,
                from_webdis: false,
                body: vec![],
            },
            CalloutReply {
                status: Some(502),
                from_webdis: false,
                body: vec![],
            },
            // Envoy's own 503 (reset after the command may have run): no retry.
            CalloutReply {
                status: Some(503),
                from_webdis: false,
                body: vec![],
            },
            CalloutReply {
                status: Some(403),
                from_webdis: true,
                body: b"forbidden".to_vec(),
            },
            ok(b"-BUSY Redis is busy running a script\r\n"),
            ok(b"{\"EVALSHA\":[1]}"),
            ok(b"*1\r\n$1\r\n1\r\n"),
            ok(b"*5\r\n$1\r\n1\r\n"),
        ];
        for reply in bad_replies {
            let mut f = flow("allow");
            let mut h = FakeHost::get("/api/x");
            f.on_request_headers(&mut h);
            f.on_callout_reply(&mut h, 1, reply.clone());
            assert_eq!((h.resumed, h.sent.len()), (1, 0), "allow on {reply:?}");
            assert!(h.counters.contains(&Counter::FailureAllowed));

            let mut f = flow("deny");
            let mut h = FakeHost::get("/api/x");
            f.on_request_headers(&mut h);
            f.on_callout_reply(&mut h, 1, reply.clone());
            assert_eq!(h.resumed, 0, "deny on {reply:?}");
            assert_eq!(h.sent.len(), 1);
            assert_eq!(h.sent[0].status, 503);
        }
    }

    #[test]
    fn a_webdis_503_is_retried_once_then_fails() {
        let unavailable = || CalloutReply {
            status: Some(503),
            from_webdis: true,
            body: vec![],
        };
        let mut f = flow("deny");
        let mut h = FakeHost::get("/api/x");
        f.on_request_headers(&mut h);
        f.on_callout_reply(&mut h, 1, unavailable());
        assert_eq!(h.dispatched.len(), 2);
        assert_eq!(h.dispatched[0], h.dispatched[1], "the same command again");
        f.on_callout_reply(&mut h, 2, ok(ADMIT));
        assert_eq!((h.resumed, h.sent.len()), (1, 0));

        let mut f = flow("deny");
        let mut h = FakeHost::get("/api/x");
        f.on_request_headers(&mut h);
        f.on_callout_reply(&mut h, 1, unavailable());
        f.on_callout_reply(&mut h, 2, unavailable());
        assert_eq!(h.dispatched.len(), 2, "one retry only");
        assert_eq!(h.sent[0].status, 503);
    }

    #[test]
    fn every_attempt_shares_the_one_timeout() {
        // timeoutMs is 50 (the default): EVALSHA at t=0 gets 50 ms; a
        // NOSCRIPT answer at t=30 leaves the EVAL 20 ms; at t=50 nothing is left.
        let mut f = flow("deny");
        let mut h = FakeHost::get("/api/x");
        f.on_request_headers(&mut h);
        h.clock_ms = 30;
        f.on_callout_reply(&mut h, 1, ok(b"-NOSCRIPT No matching script.\r\n"));
        assert_eq!(
            h.timeouts,
            [Duration::from_millis(50), Duration::from_millis(20)]
        );

        let mut f = flow("deny");
        let mut h = FakeHost::get("/api/x");
        f.on_request_headers(&mut h);
        h.clock_ms = 50;
        f.on_callout_reply(&mut h, 1, ok(b"-NOSCRIPT No matching script.\r\n"));
        assert_eq!(h.dispatched.len(), 1, "no attempt past the deadline");
        assert_eq!(h.sent[0].status, 503);
    }

    #[test]
    fn dispatch_failure_decides_at_once() {
        let mut f = flow("allow");
        let mut h = FakeHost::get("/api/x");
        h.dispatch_fails = true;
        assert_eq!(f.on_request_headers(&mut h), Verdict::Continue);
        assert_eq!(h.resumed, 0, "nothing to resume: the request never paused");

        let mut f = flow("deny");
        let mut h = FakeHost::get("/api/x");
        h.dispatch_fails = true;
        assert_eq!(f.on_request_headers(&mut h), Verdict::Pause);
        assert_eq!(h.sent[0].status, 503);
    }

    #[test]
    fn bad_cost_header_is_a_400_before_any_redis_call() {
        let cfg = Config::parse(
            br#"{"redis":{"cluster":"w"},"limits":[{"name":"a","costHeader":{"name":"x-cost","max":3},
                "tokenBucket":{"capacity":5,"refill":1,"periodMs":1000}}]}"#,
        )
        .unwrap();
        let mut f = Flow::new(Rc::new(cfg));
        let mut h = FakeHost::get("/");
        h.headers.insert("x-cost".into(), b"4".to_vec());
        assert_eq!(f.on_request_headers(&mut h), Verdict::Pause);
        assert_eq!(h.sent[0].status, 400);
        assert!(h.dispatched.is_empty());
    }
}
