//! The usage stage: a request admitted under usage-based limits took their
//! `reserve` (or what its JSON body names, `reserveFrom`: then the decision
//! waits for the body); its response says what it really cost (a header, a JSON body,
//! a streamed event body), and when the stream is over the difference is
//! charged or refunded by one lua/settle.lua call, which the worker's root
//! sends (it outlives the stream; the settlements of one hash tag share a
//! call). A response whose usage never arrives (the client left, the
//! upstream failed, the body was not JSON or was too large) is charged its
//! fallback.

use std::time::Duration;

use crate::config::Config;
use crate::filter::deferred::Kind;
use crate::filter::{Counter, Host};
use crate::ratelimit::{kind_args, Outcome, Plan};
use crate::response::Completion;
use crate::scripts::SETTLE;
use crate::usage::{reservation, weighted, EventStream, JsonBody, Term};

/// A settlement as the worker sends it: seven values per key.
pub const SETTLE_CALL: Kind = Kind {
    script: &SETTLE,
    per_key: 7,
    what: "the settlement of usage-based costs",
    lost: Some(Counter::UsageLost),
    resend_for: None,
};

/// A limit the request took its reserve from.
#[derive(Debug)]
struct Owed {
    limit: usize,
    key: Vec<u8>,
    reserved: u64,
    /// A quota's window edges at the decision (the settlement lands in the
    /// window that holds Redis' clock then: lua/settle.lua).
    edges: Option<[i64; 4]>,
    /// The plan the request carried: the settlement is judged under it, as
    /// the decision was (a plan stored in Redis wins over it there too).
    carried: Option<crate::overrides::Override>,
    /// Its terms' place in `UsageStage::terms`.
    terms: std::ops::Range<usize>,
    /// Its header's value, once the response's headers are read (for a
    /// response-counted limit: what its status says it costs).
    header: Option<u64>,
    /// A response-counted limit's cost by the HTTP status of a gRPC
    /// response whose `grpc-status` is still to come: it stands if the
    /// response completes without one.
    provisional: Option<u64>,
}

#[derive(Debug, Default)]
enum Reader {
    #[default]
    None,
    Json(JsonBody),
    Stream(EventStream),
}

#[derive(Debug, Default)]
pub struct UsageStage {
    /// Checks whose reservation the request body names, while it is read.
    reserving: Vec<usize>,
    /// The most bytes of the request body any of them reads.
    reserve_max: usize,
    owed: Vec<Owed>,
    /// Every owed limit's terms, one after another.
    terms: Vec<Term>,
    reader: Reader,
    /// Whether the client has the whole response (a response cut short is
    /// charged the fallback: its usage may be partial).
    response: Completion,
    complete: bool,
    tag: String,
    settled: bool,
    /// When the decision's call left: the settlement says how long ago.
    sent_at: Duration,
}

impl UsageStage {
    /// Whether the decision waits for the request body: a limit that
    /// applies reads its reservation from it. Without a body, the fixed
    /// reserves stand.
    pub fn on_request<H: Host>(
        &mut self,
        host: &mut H,
        config: &Config,
        plan: &Plan,
        end_of_stream: bool,
    ) -> bool {
        for (i, check) in plan.checks.iter().enumerate() {
            let Some(usage) = &config.limits[check.limit].usage else {
                continue;
            };
            if usage.reserve_from.is_empty() {
                continue;
            }
            if end_of_stream {
                host.count(Counter::UsageReserveUnread);
                continue;
            }
            self.reserving.push(i);
            self.reserve_max = self.reserve_max.max(usage.max_body);
        }
        self.reading()
    }

    /// The request was answered locally: its body is read no further.
    pub fn stop_reading(&mut self) {
        self.reserving.clear();
    }

    /// Whether the request body is still being read for reservations.
    pub fn reading(&self) -> bool {
        !self.reserving.is_empty()
    }

    /// The most bytes of the request body it reads (0 when not reading).
    pub fn request_max_body(&self) -> usize {
        if self.reading() {
            self.reserve_max
        } else {
            0
        }
    }

    /// The request body so far (`size` bytes buffered): once it is whole,
    /// or over every bound, what each reading check reserves, as
    /// `(check, units)`; a check whose body names nothing keeps its fixed
    /// reserve (counted).
    pub fn on_request_body<H: Host>(
        &mut self,
        host: &mut H,
        config: &Config,
        plan: &Plan,
        size: usize,
        end: bool,
    ) -> Option<Vec<(usize, u64)>> {
        if !self.reading() || !(end || size > self.reserve_max) {
            return None;
        }
        let body = host.request_body(size.min(self.reserve_max.saturating_add(1)));
        let mut reserved = Vec::new();
        for i in std::mem::take(&mut self.reserving) {
            let Some(check) = plan.checks.get(i) else {
                continue;
            };
            let Some(usage) = &config.limits[check.limit].usage else {
                continue;
            };
            match reservation(&body, usage.max_body, &usage.reserve_from, usage.quota) {
                Ok(units) => reserved.push((i, units)),
                Err(why) => {
                    log::debug!(
                        "redis-guard: no reservation in the request body for `{}` ({why:?}): reserving {}",
                        config.limits[check.limit].name,
                        usage.reserve
                    );
                    host.count(Counter::UsageReserveUnread);
                }
            }
        }
        Some(reserved)
    }

    /// Redis decided: an admitted request owes its usage-based limits the
    /// difference to what they reserved (a shadow limit that would have
    /// rejected took nothing, and owes nothing).
    pub fn on_outcome(
        &mut self,
        config: &Config,
        plan: &Plan,
        outcome: &Outcome,
        sent_at: Duration,
    ) {
        if !outcome.admitted {
            return;
        }
        self.sent_at = sent_at;
        for (check, result) in plan.checks.iter().zip(&outcome.results) {
            let Some(usage) = &config.limits[check.limit].usage else {
                continue;
            };
            if !result.allowed {
                continue;
            }
            let start = self.terms.len();
            self.terms.extend(usage.terms.iter().cloned());
            self.owed.push(Owed {
                limit: check.limit,
                key: check.key.clone(),
                reserved: check.cost,
                edges: check.edges,
                carried: check.carried,
                terms: start..self.terms.len(),
                header: None,
                provisional: None,
            });
        }
        self.tag = plan.tag.clone().unwrap_or_default();
    }

    pub fn on_response_headers<H: Host>(&mut self, host: &mut H, config: &Config, end: bool) {
        if self.owed.is_empty() {
            return;
        }
        let mut status: Option<ResponseStatus> = None;
        for owed in &mut self.owed {
            let rule = config.limits[owed.limit].usage.as_ref();
            if let Some(set) = rule.and_then(|u| u.counted.as_ref()) {
                let status = status.get_or_insert_with(|| ResponseStatus::read(host));
                (owed.header, owed.provisional) = status.cost(set, owed.reserved);
                continue;
            }
            owed.header = rule
                .and_then(|u| u.header.as_deref())
                .and_then(|name| host.response_header(name))
                .and_then(|v| whole_number(&v));
        }
        let length = host
            .response_header("content-length")
            .and_then(|v| crate::response::content_length(&v));
        self.complete = self.response.headers(length, end);
        if self.terms.is_empty() {
            return;
        }
        // A compressed body cannot be read here: its usage is unknown (put
        // a decompressor before this filter to read it).
        let encoded = host
            .response_header("content-encoding")
            .is_some_and(|v| !v.eq_ignore_ascii_case(b"identity"));
        if encoded {
            return;
        }
        let max = self
            .owed
            .iter()
            .filter_map(|o| config.limits[o.limit].usage.as_ref().map(|u| u.max_body))
            .max()
            .unwrap_or(0);
        let streamed = host.response_header("content-type").is_some_and(|v| {
            let v = String::from_utf8_lossy(&v).to_ascii_lowercase();
            v.trim_start().starts_with("text/event-stream")
        });
        self.reader = if streamed {
            Reader::Stream(EventStream::new(self.terms.len(), max))
        } else {
            Reader::Json(JsonBody::new(max))
        };
    }

    /// Reads a piece of the body, up to the response's completion (a piece
    /// Envoy hands over again with what was held after it is not read
    /// twice).
    pub fn on_response_body<H: Host>(&mut self, host: &mut H, size: usize, end: bool) {
        if self.complete || self.owed.is_empty() {
            return;
        }
        let void = match &self.reader {
            Reader::None => true,
            Reader::Json(body) => body.void(),
            Reader::Stream(stream) => stream.void(),
        };
        let read = match &mut self.reader {
            _ if void => size,
            reader => {
                let chunk = host.response_body(size);
                match reader {
                    Reader::Json(body) => body.feed(&chunk),
                    Reader::Stream(stream) => stream.feed(&chunk, &self.terms),
                    Reader::None => {}
                }
                chunk.len()
            }
        };
        self.complete = self.response.body(read, end);
    }

    /// Trailers end the response; a usage header not among the headers
    /// may be a trailer (gRPC sends its metadata there).
    pub fn on_response_trailers<H: Host>(&mut self, host: &mut H, config: &Config) {
        self.complete = true;
        for owed in &mut self.owed {
            if owed.header.is_some() {
                continue;
            }
            let rule = config.limits[owed.limit].usage.as_ref();
            if let Some(set) = rule.and_then(|u| u.counted.as_ref()) {
                owed.header = host
                    .response_trailer("grpc-status")
                    .and_then(|v| crate::grpc::parse_status(&v))
                    .map(|code| {
                        if set.counts_grpc(code) {
                            owed.reserved
                        } else {
                            0
                        }
                    });
                continue;
            }
            owed.header = rule
                .and_then(|u| u.header.as_deref())
                .and_then(|name| host.response_trailer(name))
                .and_then(|v| whole_number(&v));
        }
    }

    /// The stream is over: what each owed limit is charged, as one
    /// settlement handed to the worker.
    pub fn on_stream_end<H: Host>(&mut self, host: &mut H, config: &Config) {
        if self.owed.is_empty() || self.settled {
            return;
        }
        self.settled = true;
        let values = match (&mut self.reader, self.complete) {
            (_, false) => None,
            (Reader::Json(body), true) => body.values(&self.terms).ok(),
            (Reader::Stream(stream), true) => stream.finish_values(&self.terms).ok(),
            (Reader::None, true) => None,
        };
        let mut keys = Vec::new();
        let mut argv = Vec::new();
        let age = crate::filter::millis(host.now().saturating_sub(self.sent_at));
        for owed in &self.owed {
            let limit = &config.limits[owed.limit];
            let Some(usage) = &limit.usage else {
                continue;
            };
            // A header states the cost at once; a body only once it is all
            // there (a stream cut short may hold part of its usage).
            let stated = owed
                .header
                .or(owed.provisional.filter(|_| self.complete))
                .or_else(|| {
                    let values = values.as_ref()?;
                    weighted(&self.terms[owed.terms.clone()], &values[owed.terms.clone()]).ok()
                });
            let cost = match stated {
                Some(cost) => cost.min(crate::config::MAX_USAGE_UNITS),
                None => {
                    log::debug!(
                        "redis-guard: no usage for `{}`: charging its fallback",
                        limit.name
                    );
                    host.count(Counter::UsageFallback);
                    usage.fallback.unwrap_or(owed.reserved)
                }
            };
            let delta = i128::from(cost) - i128::from(owed.reserved);
            let units = u64::try_from(delta.unsigned_abs()).unwrap_or(u64::MAX);
            // A blocking limit's usage that counted (nothing back) may leave
            // it exhausted: the settlement checks, and starts the block.
            let block = limit.block_ms.filter(|_| delta >= 0).unwrap_or(0);
            match delta.signum() {
                1 => host.count_n(Counter::UsageCharged, units),
                -1 => host.count_n(Counter::UsageRefunded, units),
                _ if block > 0 => {}
                _ => continue,
            }
            let algorithm = owed
                .carried
                .map_or(limit.algorithm, |o| o.apply(&limit.algorithm));
            let (alg, a, b, c) = kind_args(&algorithm);
            keys.push(owed.key.clone());
            // `+o`: the settlement reads the customer's stored plan in its
            // own call, as the decision did (lua/settle.lua).
            let mut alg = alg.as_bytes().to_vec();
            if limit.overrides.redis {
                alg.extend_from_slice(b"+o");
            }
            argv.push(alg);
            argv.push(a.to_string().into_bytes());
            argv.push(b.to_string().into_bytes());
            argv.push(match limit.algorithm {
                crate::config::Algorithm::Quota { .. } => crate::ratelimit::edges_arg(owed.edges),
                _ => c.to_string().into_bytes(),
            });
            argv.push(delta.to_string().into_bytes());
            argv.push(age.to_string().into_bytes());
            argv.push(block.to_string().into_bytes());
        }
        if keys.is_empty() {
            return;
        }
        let settlements = keys.len() as u64;
        if let Err(why) = host.defer(SETTLE_CALL, &self.tag, (keys, argv), Duration::ZERO) {
            log::warn!("redis-guard: cannot settle usage-based costs: {why}");
            host.count_n(Counter::UsageLost, settlements);
        }
    }
}

/// A response's status as response-counted limits judge it, read once for
/// all of them: its HTTP status, and for a gRPC response its `grpc-status`
/// when these headers carry it (trailers-only); otherwise the trailers
/// decide, and the HTTP status is the provisional answer for a response
/// that ends without one.
struct ResponseStatus {
    http: Option<u32>,
    grpc: bool,
    grpc_status: Option<u32>,
}

impl ResponseStatus {
    fn read<H: Host>(host: &mut H) -> ResponseStatus {
        let http = host
            .response_header(":status")
            .and_then(|v| std::str::from_utf8(&v).ok()?.parse::<u32>().ok());
        let grpc = host
            .response_header("content-type")
            .is_some_and(|ct| crate::grpc::is_grpc(&ct));
        let grpc_status = if grpc {
            host.response_header("grpc-status")
                .and_then(|v| crate::grpc::parse_status(&v))
        } else {
            None
        };
        ResponseStatus {
            http,
            grpc,
            grpc_status,
        }
    }

    /// What a limit counting `set` is charged (its reserve, or nothing),
    /// and the provisional charge of a gRPC response still to end.
    fn cost(&self, set: &crate::statuses::StatusSet, reserved: u64) -> (Option<u64>, Option<u64>) {
        let cost = |counts: bool| if counts { reserved } else { 0 };
        if !self.grpc {
            return (self.http.map(|s| cost(set.counts_http(s))), None);
        }
        if let Some(code) = self.grpc_status {
            return (Some(cost(set.counts_grpc(code))), None);
        }
        // Without a grpc-status, the client sees the status its HTTP one
        // maps to: either may be what the limit counts.
        let http = self
            .http
            .map(|s| cost(set.counts_http(s) || set.counts_grpc(crate::grpc::code_from_http(s))));
        (None, http)
    }
}

/// A header's or trailer's value as a cost.
fn whole_number(v: &[u8]) -> Option<u64> {
    std::str::from_utf8(v).ok()?.trim().parse().ok()
}
