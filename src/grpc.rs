//! gRPC: what the filter's own answers become for a gRPC client, and what
//! idempotency needs to know about a gRPC exchange (its framing, its status).
//!
//! A gRPC client reads its outcome from `grpc-status`, not the HTTP status:
//! an HTTP 429 becomes `UNAVAILABLE` in its hands and its `Retry-After` is
//! lost. So a problem reply to a gRPC request is sent as a trailers-only
//! response (Envoy writes it: HTTP 200, `grpc-status`, `grpc-message`) with
//! the status from [`code_for`], the rate-limit fields kept as metadata, and
//! the retry delay as `google.rpc.RetryInfo` in `grpc-status-details-bin`
//! (the response module's `grpc_reply` builds it). This module depends on no
//! other of the crate.

use base64::Engine;

/// The status codes of gRPC (`google.rpc.Code`), by their names.
pub const CODES: [&str; 17] = [
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
];

pub const OK: u32 = 0;
pub const UNKNOWN: u32 = 2;
pub const INVALID_ARGUMENT: u32 = 3;
pub const PERMISSION_DENIED: u32 = 7;
pub const RESOURCE_EXHAUSTED: u32 = 8;
pub const FAILED_PRECONDITION: u32 = 9;
pub const ABORTED: u32 = 10;
pub const UNIMPLEMENTED: u32 = 12;
pub const INTERNAL: u32 = 13;
pub const UNAVAILABLE: u32 = 14;
pub const DATA_LOSS: u32 = 15;
pub const UNAUTHENTICATED: u32 = 16;

/// The status a gRPC client reports for a response that carries no
/// `grpc-status`, from its HTTP status (gRPC's "HTTP to gRPC status code
/// mapping": 400 INTERNAL, 401 UNAUTHENTICATED, 403 PERMISSION_DENIED, 404
/// UNIMPLEMENTED, 429/502/503/504 UNAVAILABLE, anything else UNKNOWN).
pub fn code_from_http(status: u32) -> u32 {
    match status {
        400 => INTERNAL,
        401 => UNAUTHENTICATED,
        403 => PERMISSION_DENIED,
        404 => UNIMPLEMENTED,
        429 | 502 | 503 | 504 => UNAVAILABLE,
        _ => UNKNOWN,
    }
}

/// The code of a status name (`"NOT_FOUND"` is 5).
pub fn code_of(name: &str) -> Option<u32> {
    CODES.iter().position(|c| *c == name).map(|i| i as u32)
}

/// True for a gRPC request's content-type, decided exactly as Envoy decides
/// it (`Grpc::Common::hasGrpcContentType`): `application/grpc`, or it
/// followed by `+` (`application/grpc+proto`), byte for byte. Envoy treats
/// anything else (`application/grpc;charset=utf-8`, `Application/GRPC`,
/// `application/grpc-web`) as plain HTTP: so must the filter, or it would
/// wait for a `grpc-status` the response never carries.
pub fn is_grpc(content_type: &[u8]) -> bool {
    const GRPC: &[u8] = b"application/grpc";
    content_type.starts_with(GRPC) && matches!(content_type.get(GRPC.len()), None | Some(b'+'))
}

/// The gRPC status for the filter's own answer of HTTP `status`:
///
/// | HTTP | why                                   | gRPC |
/// |------|---------------------------------------|------|
/// | 429  | a limit rejected the request          | RESOURCE_EXHAUSTED (8), with RetryInfo |
/// | 413  | a keyed request's body is too large   | RESOURCE_EXHAUSTED (8) |
/// | 400  | bad idempotency key, cost or tenant   | INVALID_ARGUMENT (3) |
/// | 409  | the key's first request still runs    | ABORTED (10) |
/// | 422  | the key was used with another request | FAILED_PRECONDITION (9) |
/// | 502  | the stored response is lost/corrupt   | DATA_LOSS (15) |
/// | 503  | Redis or the object store unavailable | UNAVAILABLE (14) |
pub fn code_for(status: u32) -> u32 {
    match status {
        429 | 413 => RESOURCE_EXHAUSTED,
        400 => INVALID_ARGUMENT,
        409 => ABORTED,
        422 => FAILED_PRECONDITION,
        502 => DATA_LOSS,
        503 => UNAVAILABLE,
        // Nothing else is sent; gRPC's own HTTP mapping for the rest.
        401 => 16,
        403 => 7,
        404 => 12,
        _ => 2,
    }
}

// google.rpc.Status, google.protobuf.Any, google.rpc.RetryInfo and
// google.protobuf.Duration are written by hand: four small messages whose
// field numbers are fixed by the published protos; a protobuf runtime in the
// wasm would be many times their size. The tests decode them with the
// protobuf runtime of a real gRPC client.
fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn field_varint(out: &mut Vec<u8>, field: u64, v: u64) {
    if v != 0 {
        varint(out, field << 3);
        varint(out, v);
    }
}

fn field_bytes(out: &mut Vec<u8>, field: u64, v: &[u8]) {
    varint(out, (field << 3) | 2);
    varint(out, v.len() as u64);
    out.extend_from_slice(v);
}

/// `grpc-status-details-bin`: a `google.rpc.Status` with this code and
/// message and one detail, a `google.rpc.RetryInfo` whose `retry_delay` is
/// `retry_ms`; base64 without padding, as gRPC writes binary metadata.
pub fn status_details(code: u32, message: &str, retry_ms: u64) -> String {
    let mut duration = Vec::new();
    field_varint(&mut duration, 1, retry_ms / 1000);
    field_varint(&mut duration, 2, (retry_ms % 1000) * 1_000_000);
    let mut retry_info = Vec::new();
    field_bytes(&mut retry_info, 1, &duration);
    let mut any = Vec::new();
    field_bytes(&mut any, 1, b"type.googleapis.com/google.rpc.RetryInfo");
    field_bytes(&mut any, 2, &retry_info);
    let mut status = Vec::new();
    field_varint(&mut status, 1, u64::from(code));
    if !message.is_empty() {
        field_bytes(&mut status, 2, message.as_bytes());
    }
    field_bytes(&mut status, 3, &any);
    base64::engine::general_purpose::STANDARD_NO_PAD.encode(status)
}

/// The length-prefixed messages of a gRPC body: how many start in it, and
/// whether the last one is whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frames {
    pub started: usize,
    pub whole: bool,
}

/// Counts the messages of a gRPC body (1 byte flag, 4 bytes big-endian
/// length, the message).
pub fn frames(body: &[u8]) -> Frames {
    let mut rest = body;
    let mut started = 0;
    while !rest.is_empty() {
        started += 1;
        let Some(len) = rest.get(1..5) else {
            return Frames {
                started,
                whole: false,
            };
        };
        // The length is the client's: on wasm32 `5 + len` wraps to a
        // small offset and the loop would never end, so a frame whose end
        // cannot be represented is simply not whole.
        let len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]);
        let after = usize::try_from(len)
            .ok()
            .and_then(|len| len.checked_add(5))
            .and_then(|end| rest.get(end..));
        match after {
            Some(after) => rest = after,
            None => {
                return Frames {
                    started,
                    whole: false,
                }
            }
        }
    }
    Frames {
        started,
        whole: true,
    }
}

/// A `grpc-status` value, when it is one.
pub fn parse_status(raw: &[u8]) -> Option<u32> {
    let code: u32 = std::str::from_utf8(raw).ok()?.trim().parse().ok()?;
    (code < 17).then_some(code)
}

/// `grpc-message` as the client decodes it (percent-encoded on the wire).
pub fn decode_message(raw: &[u8]) -> String {
    String::from_utf8_lossy(&percent_encoding::percent_decode(raw).collect::<Vec<u8>>())
        .into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_content_types_are_recognised_as_envoy_does() {
        for ct in [
            "application/grpc",
            "application/grpc+proto",
            "application/grpc+",
        ] {
            assert!(is_grpc(ct.as_bytes()), "{ct}");
        }
        for ct in [
            "application/grpc;charset=utf-8",
            "Application/GRPC",
            "application/GRPC+proto",
            " application/grpc",
            "application/grpc-web",
            "application/json",
            "application/gr",
            "",
        ] {
            assert!(!is_grpc(ct.as_bytes()), "{ct}");
        }
    }

    #[test]
    fn frames_count_the_messages_a_body_starts() {
        assert_eq!(
            frames(b""),
            Frames {
                started: 0,
                whole: true
            }
        );
        assert_eq!(
            frames(b"\0\0\0\0\x03abc"),
            Frames {
                started: 1,
                whole: true
            }
        );
        assert_eq!(
            frames(b"\0\0\0\0\x03abc\0\0\0\0\0"),
            Frames {
                started: 2,
                whole: true
            }
        );
        assert_eq!(
            frames(b"\0\0\0\0\x03ab"),
            Frames {
                started: 1,
                whole: false
            }
        );
        assert_eq!(
            frames(b"\0\0\0\0\x01a\0\0"),
            Frames {
                started: 2,
                whole: false
            }
        );
    }

    #[test]
    fn statuses_parse_only_when_they_are_codes() {
        assert_eq!(parse_status(b"0"), Some(0));
        assert_eq!(parse_status(b"13"), Some(13));
        assert_eq!(parse_status(b"17"), None);
        assert_eq!(parse_status(b"x"), None);
        assert_eq!(code_of("NOT_FOUND"), Some(5));
        assert_eq!(code_of("nope"), None);
        assert_eq!(decode_message(b"bad%20key%0A"), "bad key\n");
    }
}
