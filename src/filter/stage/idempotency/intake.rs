//! Idempotency intake: the request's key, checked at its headers, and its
//! fingerprint, once the body it covers is here.

use crate::config::{Config, FailureMode};
use crate::filter::Host;
use crate::idempotency::{fingerprint, parse_key, record_key};
use crate::keys;
use crate::ratelimit::IdemArgs;
use crate::request::RequestLine;
use crate::response::{bad_request, payload_too_large, LocalReply};

/// The idempotency key of this request, once validated.
#[derive(Debug, Clone)]
pub struct Keyed {
    /// Index into `Config::idempotency`.
    pub rule: usize,
    pub args: IdemArgs,
    /// A gRPC call: its outcome is its `grpc-status`, in its trailers.
    pub grpc: bool,
}

/// What the request needs before it can be decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ready {
    Now,
    /// The fingerprint covers the body: decide once it is all here.
    AfterBody,
}

#[derive(Debug, Default)]
pub struct Intake {
    keyed: Option<Keyed>,
    /// The body is being buffered for the fingerprint.
    reading: bool,
    method: String,
}

impl Intake {
    /// Finds the rule the request falls under and checks its key, its
    /// announced size and its tenant. `tag`: the hash tag the limits
    /// computed, if any (computed once per request).
    pub fn on_request_headers<H: Host>(
        &mut self,
        host: &mut H,
        config: &Config,
        line: &RequestLine,
        tag: Option<&str>,
        end_of_stream: bool,
    ) -> Result<Ready, LocalReply> {
        let found = config
            .idempotency
            .iter()
            .position(|r| r.matcher.matches(line, host));
        let Some(i) = found else {
            return Ok(Ready::Now);
        };
        let rule = &config.idempotency[i];
        let raw = match host.header(&rule.header) {
            None if rule.required => {
                let detail = format!("this request needs an `{}` header", rule.header);
                return Err(bad_request(&detail));
            }
            None => return Ok(Ready::Now),
            Some(raw) => raw,
        };
        let key = parse_key(&raw)
            .map_err(|why| bad_request(&format!("invalid `{}`: {why}", rule.header)))?;
        if let Some(len) = host
            .header("content-length")
            .and_then(|v| crate::response::content_length(&v))
        {
            if len > rule.max_request_body {
                return Err(payload_too_large(rule.max_request_body));
            }
        }
        let tag = match tag {
            Some(t) => t.to_string(),
            None => config.hash_tag_for(line, host),
        };
        let mut tenant = Vec::new();
        for (j, part) in rule.tenant.iter().enumerate() {
            if j > 0 {
                tenant.push(b':');
            }
            // No tenant, no scope: an absent or empty tenant must not share
            // one key space with every other such request.
            let value = part.value(line, host).unwrap_or_default();
            if value.is_empty() {
                let detail = format!("requests with `{}` need their tenant ({part})", rule.header);
                return Err(bad_request(&detail));
            }
            keys::push_value(&mut tenant, &value);
        }
        let grpc = host
            .header("content-type")
            .is_some_and(|ct| crate::grpc::is_grpc(&ct));
        let mut args = IdemArgs {
            key: record_key(&config.key_prefix, &tag, rule, &tenant, &key),
            owner: host.unique_token(),
            fingerprint: String::new(),
            lock_ttl_ms: rule.lock_ttl_ms,
        };
        if rule.fingerprint_body && !end_of_stream {
            self.method = line.method.clone();
            self.reading = true;
            self.keyed = Some(Keyed {
                rule: i,
                args,
                grpc,
            });
            return Ok(Ready::AfterBody);
        }
        // No body yet, or a rule that leaves it out: decide on the headers
        // (the body waits in Envoy until the request is resumed).
        args.fingerprint = fingerprint(&line.method, &full_path(host), b"");
        self.keyed = Some(Keyed {
            rule: i,
            args,
            grpc,
        });
        Ok(Ready::Now)
    }

    /// The body is being read for the fingerprint.
    pub fn reading(&self) -> bool {
        self.reading
    }

    /// The most of the body a keyed request may send.
    pub fn max_body(&self, config: &Config) -> usize {
        self.keyed
            .as_ref()
            .map_or(usize::MAX, |k| config.idempotency[k.rule].max_request_body)
    }

    /// A chunk of the body arrived: `Ok(true)` once it is complete and
    /// fingerprinted; a body over the rule's limit is a 413.
    pub fn on_request_body<H: Host>(
        &mut self,
        host: &mut H,
        config: &Config,
        body_size: usize,
        end_of_stream: bool,
    ) -> Result<bool, LocalReply> {
        let max = self.max_body(config);
        if body_size > max {
            self.reading = false;
            return Err(payload_too_large(max));
        }
        let grpc = self.keyed.as_ref().is_some_and(|k| k.grpc);
        if !end_of_stream && !grpc {
            return Ok(false);
        }
        let body = host.request_body(body_size);
        if grpc {
            // A key makes one call run once: a stream of requests is not
            // one call. Refused as soon as a second message starts (a
            // bidirectional stream waiting for answers would otherwise wait
            // here for an end that never comes).
            let frames = crate::grpc::frames(&body);
            let streaming = frames.started > 1 || (end_of_stream && !frames.whole);
            if streaming || (end_of_stream && frames.started == 0) {
                self.reading = false;
                return Err(bad_request(&format!(
                    "idempotency keys apply to unary gRPC calls: this call sent {} message{}",
                    frames.started,
                    if frames.started == 1 {
                        " (incomplete)"
                    } else {
                        "s"
                    },
                )));
            }
            if !end_of_stream {
                return Ok(false);
            }
        }
        self.reading = false;
        let path = full_path(host);
        if let Some(keyed) = self.keyed.as_mut() {
            keyed.args.fingerprint = fingerprint(&self.method, &path, &body);
        }
        Ok(true)
    }

    pub fn keyed(&self) -> Option<&Keyed> {
        self.keyed.as_ref()
    }

    pub fn args(&self) -> Option<&IdemArgs> {
        self.keyed.as_ref().map(|k| &k.args)
    }

    /// Deny when the request's idempotency rule says so.
    pub fn failure_mode(&self, config: &Config) -> Option<FailureMode> {
        self.keyed
            .as_ref()
            .map(|k| config.idempotency[k.rule].failure_mode)
    }
}

fn full_path(view: &dyn crate::request::RequestView) -> Vec<u8> {
    view.header(":path").unwrap_or_default()
}
