//! proxy-wasm glue: the only code that calls the host. Host calls go through
//! `hostcalls` (which return errors) rather than the trait defaults (which
//! unwrap), and every error is logged, not unwrapped. The SDK still panics on
//! statuses it does not expect, so maps that may be absent are not read.

use std::rc::Rc;
use std::time::{Duration, UNIX_EPOCH};

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType};

use crate::config::{Config, RedisTarget};
use crate::filter::flow::{CalloutReply, Flow, Verdict};
use crate::filter::{Counter, Host};
use crate::request::RequestView;
use crate::response::LocalReply;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    // A panic aborts the VM (panic=abort); at least say why, at critical level.
    std::panic::set_hook(Box::new(|info| {
        let _ = hostcalls::log(LogLevel::Critical, &format!("redis-guard panicked: {info}"));
    }));
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::default()) });
}}

/// Envoy stat ids, defined once per configuration.
#[derive(Default)]
struct Metrics {
    per_limit: Vec<[u32; 4]>,
    redis_calls: u32,
    script_reloads: u32,
    redis_retries: u32,
    redis_errors: u32,
    failure_allowed: u32,
    failure_denied: u32,
}

fn counter(name: &str) -> u32 {
    match hostcalls::define_metric(MetricType::Counter, name) {
        Ok(id) => id,
        Err(e) => {
            log::warn!("redis-guard: cannot define metric {name}: {e:?}");
            u32::MAX
        }
    }
}

impl Metrics {
    fn define(config: &Config) -> Metrics {
        let per_limit = config
            .limits
            .iter()
            .map(|l| {
                let base = format!("redis_guard.ratelimit.{}", l.name);
                [
                    counter(&format!("{base}.checked")),
                    counter(&format!("{base}.allowed")),
                    counter(&format!("{base}.rejected")),
                    counter(&format!("{base}.shadow_rejected")),
                ]
            })
            .collect();
        Metrics {
            per_limit,
            redis_calls: counter("redis_guard.redis.calls"),
            script_reloads: counter("redis_guard.redis.script_reloads"),
            redis_retries: counter("redis_guard.redis.retries"),
            redis_errors: counter("redis_guard.redis.errors"),
            failure_allowed: counter("redis_guard.failure_mode.allowed"),
            failure_denied: counter("redis_guard.failure_mode.denied"),
        }
    }

    fn id(&self, c: Counter) -> Option<u32> {
        let limit = |i: usize, k: usize| self.per_limit.get(i).map(|ids| ids[k]);
        match c {
            Counter::Checked(i) => limit(i, 0),
            Counter::Allowed(i) => limit(i, 1),
            Counter::Rejected(i) => limit(i, 2),
            Counter::ShadowRejected(i) => limit(i, 3),
            Counter::RedisCalls => Some(self.redis_calls),
            Counter::ScriptReloads => Some(self.script_reloads),
            Counter::RedisRetries => Some(self.redis_retries),
            Counter::RedisErrors => Some(self.redis_errors),
            Counter::FailureAllowed => Some(self.failure_allowed),
            Counter::FailureDenied => Some(self.failure_denied),
        }
    }
}

struct Shared {
    config: Rc<Config>,
    metrics: Metrics,
}

#[derive(Default)]
struct Root {
    shared: Option<Rc<Shared>>,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let raw = match hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX) {
            Ok(Some(raw)) => raw,
            Ok(None) => {
                log::error!("redis-guard: no plugin configuration given");
                return false;
            }
            Err(e) => {
                log::error!("redis-guard: cannot read plugin configuration: {e:?}");
                return false;
            }
        };
        match Config::parse(&raw) {
            Ok(config) => {
                log::info!(
                    "redis-guard: configured {} limit(s), redis cluster `{}`",
                    config.limits.len(),
                    config.redis.cluster
                );
                let metrics = Metrics::define(&config);
                self.shared = Some(Rc::new(Shared {
                    config: Rc::new(config),
                    metrics,
                }));
                true
            }
            Err(e) => {
                log::error!("redis-guard: {e}");
                false
            }
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        // The SDK panics on None; a context without configuration passes traffic.
        Some(Box::new(Http {
            flow: self
                .shared
                .as_ref()
                .map(|s| Flow::new(Rc::clone(&s.config))),
            shared: self.shared.clone(),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Http {
    flow: Option<Flow>,
    shared: Option<Rc<Shared>>,
}

/// The [`Host`] over proxy-wasm calls, for the current stream.
struct ProxyHost<'a> {
    metrics: Option<&'a Metrics>,
}

impl RequestView for ProxyHost<'_> {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name)
            .ok()
            .flatten()
    }

    fn client_address(&self) -> Option<String> {
        let raw = hostcalls::get_property(vec!["source", "address"]).ok()??;
        String::from_utf8(raw).ok()
    }
}

impl Host for ProxyHost<'_> {
    fn now(&self) -> Duration {
        hostcalls::get_current_time()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .unwrap_or_default()
    }

    fn dispatch_redis(
        &mut self,
        target: &RedisTarget,
        body: &[u8],
        timeout: Duration,
    ) -> Result<u32, String> {
        hostcalls::dispatch_http_call(
            &target.cluster,
            vec![
                (":method", "POST"),
                (":path", "/"),
                (":authority", &target.authority),
                ("content-type", "text/plain"),
            ],
            Some(body),
            vec![],
            timeout,
        )
        .map_err(|e| format!("dispatch to cluster `{}` refused: {e:?}", target.cluster))
    }

    fn send_local(&mut self, reply: &LocalReply) {
        let headers: Vec<(&str, &str)> = reply
            .headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        if let Err(e) = hostcalls::send_http_response(reply.status, headers, Some(&reply.body)) {
            log::warn!("redis-guard: cannot send local reply: {e:?}");
        }
    }

    fn resume_request(&mut self) {
        if let Err(e) = hostcalls::resume_http_request() {
            log::warn!("redis-guard: cannot resume request: {e:?}");
        }
    }

    fn add_response_header(&mut self, name: &str, value: &str) {
        if let Err(e) = hostcalls::add_map_value(MapType::HttpResponseHeaders, name, value) {
            log::warn!("redis-guard: cannot add response header {name}: {e:?}");
        }
    }

    fn count(&mut self, counter: Counter) {
        if let Some(id) = self.metrics.and_then(|m| m.id(counter)) {
            if id != u32::MAX {
                let _ = hostcalls::increment_metric(id, 1);
            }
        }
    }
}

impl Context for Http {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        // A failed call (reset, timeout) arrives with no headers, and reading
        // a missing map makes the SDK panic: do not read what is not there.
        let (status, from_webdis, body) = if num_headers == 0 {
            (None, false, Vec::new())
        } else {
            let header = |name: &str| {
                hostcalls::get_map_value(MapType::HttpCallResponseHeaders, name)
                    .ok()
                    .flatten()
            };
            let status = header(":status").and_then(|s| s.parse::<u32>().ok());
            let from_webdis = header("server").is_some_and(|s| s.eq_ignore_ascii_case("webdis"));
            let body = if body_size == 0 {
                Vec::new()
            } else {
                hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
                    .ok()
                    .flatten()
                    .unwrap_or_default()
            };
            (status, from_webdis, body)
        };
        let metrics = self.shared.as_deref().map(|s| &s.metrics);
        if let Some(flow) = self.flow.as_mut() {
            flow.on_callout_reply(
                &mut ProxyHost { metrics },
                token_id,
                CalloutReply {
                    status,
                    from_webdis,
                    body,
                },
            );
        }
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let metrics = self.shared.as_deref().map(|s| &s.metrics);
        match self.flow.as_mut() {
            Some(flow) => match flow.on_request_headers(&mut ProxyHost { metrics }) {
                Verdict::Continue => Action::Continue,
                Verdict::Pause => Action::Pause,
            },
            None => Action::Continue,
        }
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let metrics = self.shared.as_deref().map(|s| &s.metrics);
        if let Some(flow) = self.flow.as_mut() {
            flow.on_response_headers(&mut ProxyHost { metrics });
        }
        Action::Continue
    }
}
