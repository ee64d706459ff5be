//! The deny stage: a request a deny rule covers is answered `403` before
//! any limit is looked at, and counted; nothing else of it is read.

use crate::config::Config;
use crate::deny::{forbidden, refusing};
use crate::filter::{Counter, Host};
use crate::request::RequestLine;
use crate::response::LocalReply;

/// `Err`: the reply that refuses the request.
pub fn on_request<H: Host>(
    host: &mut H,
    config: &Config,
    line: &RequestLine,
) -> Result<(), LocalReply> {
    let Some(rule) = refusing(&config.deny, line, host) else {
        return Ok(());
    };
    log::debug!("redis-guard: deny rule `{}` refused the request", rule.name);
    host.count(Counter::Denied);
    Err(forbidden(&rule.name))
}
