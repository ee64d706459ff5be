//! A callout's answer as the flow reads it: status, whether Webdis sent it,
//! and its body, with the nonce checked (the book, Running it: When things fail).

use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType};

use crate::filter::CalloutReply;

/// Reads the current callout's answer (headers may be absent on failure).
pub(super) fn callout_reply(
    num_headers: usize,
    body_size: usize,
    max_body: usize,
    nonce: Option<&str>,
) -> CalloutReply {
    // A failed call (reset, timeout) arrives with no headers, and reading
    // a missing map makes the SDK panic: do not read what is not there.
    if num_headers == 0 {
        return CalloutReply {
            status: None,
            from_webdis: false,
            body: Vec::new(),
        };
    }
    // Bytes, not strings: the SDK unwraps a failed UTF-8 conversion.
    let header = |name: &str| {
        hostcalls::get_map_value_bytes(MapType::HttpCallResponseHeaders, name)
            .ok()
            .flatten()
    };
    let status = header(":status").and_then(|s| std::str::from_utf8(&s).ok()?.parse::<u32>().ok());
    let from_webdis = header("server").is_some_and(|s| s.eq_ignore_ascii_case(b"webdis"));
    let mut body = if body_size == 0 {
        Vec::new()
    } else if body_size > max_body {
        // Larger than the call can legitimately answer (an object fetch
        // longer than the stored object): not copied into the VM; the flow
        // sees a body that does not match what it expects.
        log::warn!("redis-guard: callout reply of {body_size} bytes not read (limit {max_body})");
        Vec::new()
    } else {
        hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
            .ok()
            .flatten()
            .unwrap_or_default()
    };
    // A call sent with a nonce: Webdis' answer must give it back first. One
    // that does not is another connection's late reply written to this
    // socket (the book, Running it: When things fail); this call's own reply is lost, and
    // the call may have run: it is answered as a call that got no answer.
    if let Some(nonce) = nonce.filter(|_| status == Some(200) && from_webdis) {
        if !crate::webdis::strip_nonce(&mut body, nonce) {
            log::warn!(
                "redis-guard: Webdis answered with a reply that is not this call's \
                 (another connection's, written to this one): taken as no answer"
            );
            return CalloutReply {
                status: None,
                from_webdis: false,
                body: Vec::new(),
            };
        }
    }
    CalloutReply {
        status,
        from_webdis,
        body,
    }
}
