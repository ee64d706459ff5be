//! The HTTP context, one per stream: each of the stream's callbacks goes
//! to its flow, with a host for this stream.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use proxy_wasm::traits::HttpContext;
use proxy_wasm::types::Action;

use crate::filter::clock::CallbackClock;
use crate::filter::flow::Flow;
use crate::filter::Action as FlowAction;

use super::host::ProxyHost;
use super::Shared;

pub(super) struct Http {
    pub(super) context_id: u32,
    /// Shared with the root, which resumes the flow after a retry pause.
    pub(super) flow: Option<Rc<RefCell<Flow>>>,
    pub(super) shared: Option<Rc<Shared>>,
}

impl Drop for Http {
    fn drop(&mut self) {
        self.forget_wake_ups();
    }
}

impl Http {
    /// The stream is over: nothing wakes it any more.
    fn forget_wake_ups(&self) {
        let Some(shared) = self.shared.as_deref() else {
            return;
        };
        // Most streams never wait: an empty table is not hashed into (this
        // runs at on_log and again as the context goes).
        if let Ok(mut waiting) = shared.waiting.try_borrow_mut() {
            if !waiting.is_empty() {
                waiting.cancel(self.context_id);
            }
        }
        if let Ok(mut flows) = shared.wakeable.try_borrow_mut() {
            if !flows.is_empty() {
                flows.remove(&self.context_id);
            }
        }
    }

    /// Runs `f` on the flow with a host for this stream.
    fn with_flow<R>(
        &mut self,
        default: R,
        f: impl FnOnce(&mut Flow, &mut ProxyHost<'_>) -> R,
    ) -> R {
        self.with_flow_at(None, default, f)
    }

    /// [`Http::with_flow`] with the callback's clock, when it was read.
    pub(super) fn with_flow_at<R>(
        &mut self,
        clock: Option<Duration>,
        default: R,
        f: impl FnOnce(&mut Flow, &mut ProxyHost<'_>) -> R,
    ) -> R {
        let Some(rc) = self.flow.as_ref() else {
            return default;
        };
        let mut host = ProxyHost {
            shared: self.shared.as_deref(),
            context_id: self.context_id,
            me: Rc::downgrade(rc),
            via_root: false,
            clock: CallbackClock::new(clock),
            ended: false,
        };
        match rc.try_borrow_mut() {
            Ok(mut flow) => {
                host.ended = flow.ended();
                f(&mut flow, &mut host)
            }
            Err(_) => default,
        }
    }
}

fn action(a: FlowAction) -> Action {
    match a {
        FlowAction::Continue => Action::Continue,
        FlowAction::Pause => Action::Pause,
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        #[cfg(feature = "panic-trigger")]
        panic_if_asked();
        let (act, inert) = self.with_flow((Action::Continue, false), |flow, host| {
            (
                action(flow.on_request_headers(host, end_of_stream)),
                flow.inert(),
            )
        });
        if inert {
            self.flow = None;
        }
        act
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.with_flow(Action::Continue, |flow, host| {
            action(flow.on_request_body(host, body_size, end_of_stream))
        })
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        self.with_flow(Action::Continue, |flow, host| {
            action(flow.on_request_trailers(host))
        })
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        self.with_flow(Action::Continue, |flow, host| {
            action(flow.on_response_headers(host, end_of_stream))
        })
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        self.with_flow(Action::Continue, |flow, host| {
            action(flow.on_response_trailers(host))
        })
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.with_flow(Action::Continue, |flow, host| {
            action(flow.on_response_body(host, body_size, end_of_stream))
        })
    }

    fn on_log(&mut self) {
        self.with_flow((), |flow, host| flow.on_stream_end(host));
        self.forget_wake_ups();
    }
}

/// Test builds only (`--features panic-trigger`, tests/e2e_panic.rs): a
/// request carrying this header panics, to show what a panic does in Envoy.
#[cfg(feature = "panic-trigger")]
#[allow(clippy::panic)]
fn panic_if_asked() {
    if let Ok(Some(_)) = proxy_wasm::hostcalls::get_map_value_bytes(
        proxy_wasm::types::MapType::HttpRequestHeaders,
        "x-redis-guard-test-panic",
    ) {
        panic!("asked to by x-redis-guard-test-panic");
    }
}
