//! Property tests over what the filter computes from lengths a client (or an
//! upstream) declares: gRPC frame lengths, RESP bulk and array lengths, body
//! bounds, content-lengths, `max_tokens`. Each is drawn near 2^32 and 2^64,
//! where `usize` arithmetic wraps on wasm32 (32 bits) and not natively.
//!
//! `make test` runs this file twice: natively, and as wasm32-wasip1 under a
//! WASI runtime in a debug build, where an overflowing `+` panics (and the
//! panic aborts the binary): a wrap that loops forever in release is a
//! failure there. So nothing here may rely on unwinding (`catch_unwind`,
//! `#[should_panic]`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support {
    pub mod fixed_seed;
}

use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::Config as ProptestConfig;

use redis_guard::grpc::{frames, Frames};
use redis_guard::response::{content_length, Completion};
use redis_guard::usage::{reservation, Term};
use redis_guard::webdis::parse_reply;

const CASES: u32 = 256;
const SEED: u64 = 0x5eed_2832;

fn config() -> ProptestConfig {
    support::fixed_seed::config(CASES, SEED, 1024)
}

/// Lengths at the edges of 32 and 64 bits (and a few ordinary ones).
fn edge_u32() -> impl Strategy<Value = u32> {
    prop_oneof![
        (u32::MAX - 16)..=u32::MAX,
        (i32::MAX as u32 - 8)..=(i32::MAX as u32 + 8),
        0u32..64,
        any::<u32>(),
    ]
}

fn edge_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        (u64::from(u32::MAX) - 16)..=(u64::from(u32::MAX) + 16),
        (u64::MAX - 16)..=u64::MAX,
        (i64::MAX as u64 - 4)..=(i64::MAX as u64 + 4),
        any::<u64>(),
    ]
}

/// One gRPC frame header declaring `len`, then `body`.
fn frame(len: u32, body: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8];
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(body);
    out
}

proptest! {
    #![proptest_config(config())]

    /// The 5-byte body `00 ff ff ff fb` hung a worker: `5 + len` wrapped to
    /// 0 on wasm32. A frame longer than the body is one started message,
    /// not whole, whatever its declared length.
    #[test]
    fn a_grpc_frame_declaring_more_than_the_body_is_started_and_not_whole(
        len in edge_u32(),
        body in vec(any::<u8>(), 0..32),
    ) {
        prop_assume!(u64::from(len) > body.len() as u64);
        prop_assert_eq!(frames(&frame(len, &body)), Frames { started: 1, whole: false });
    }

    /// Frames that fit are counted exactly, however they are cut.
    #[test]
    fn whole_grpc_frames_are_counted_and_a_cut_one_is_not_whole(
        messages in vec(vec(any::<u8>(), 0..16), 0..6),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut body = Vec::new();
        for m in &messages {
            body.extend_from_slice(&frame(m.len() as u32, m));
        }
        prop_assert_eq!(frames(&body), Frames { started: messages.len(), whole: true });
        if !body.is_empty() {
            let at = cut.index(body.len());
            let got = frames(&body[..at]);
            prop_assert!(got.started <= messages.len());
        }
    }

    /// Any bytes at all: an answer, never a hang or a panic.
    #[test]
    fn grpc_frames_of_any_bytes_end(body in vec(any::<u8>(), 0..64)) {
        let got = frames(&body);
        prop_assert!(got.started <= body.len());
    }

    /// A RESP bulk string or array declaring a length near 2^32 or 2^64 is
    /// refused as truncated or malformed, never read past its input.
    #[test]
    fn resp_lengths_near_the_word_size_are_refused(
        n in edge_u64(),
        tag in prop::sample::select(&[b'$', b'*'][..]),
        body in vec(any::<u8>(), 0..32),
    ) {
        prop_assume!(n > 64);
        let mut input = format!("{}{n}\r\n", tag as char).into_bytes();
        input.extend_from_slice(&body);
        prop_assert!(parse_reply(&input).is_err());
    }

    /// A content-length too large for `usize` is no length (the response is
    /// then complete at its end of stream), and a body's bytes are counted
    /// without wrapping: complete once, at the end or at the length.
    #[test]
    fn a_response_is_complete_once_whatever_its_lengths(
        declared in edge_u64(),
        pieces in vec(edge_u32(), 1..6),
    ) {
        let parsed = content_length(declared.to_string().as_bytes());
        prop_assert_eq!(parsed, usize::try_from(declared).ok());
        let mut c = Completion::default();
        let mut done = u32::from(c.headers(parsed, false));
        let mut seen: u64 = 0;
        for (i, piece) in pieces.iter().enumerate() {
            seen = seen.saturating_add(u64::from(*piece));
            let end = i + 1 == pieces.len();
            let now = c.body(*piece as usize, end);
            done += u32::from(now);
            if now && !end {
                // Complete before the end only when the length is reached.
                prop_assert!(parsed.is_some_and(|n| seen.min(usize::MAX as u64) >= n as u64));
            }
        }
        prop_assert_eq!(done, 1);
    }

    /// `max_tokens` of any size or form reserves at least what it says,
    /// clamped to the quota: never the fixed fallback a client could pick
    /// by writing a number too large or a float.
    #[test]
    fn max_tokens_of_any_size_reserves_no_less_than_it_asks_within_the_quota(
        n in edge_u64(),
        quota in 1u64..100_000,
        form in 0..4u8,
    ) {
        let terms = [Term { pointer: "/max_tokens".to_string(), weight: 1 }];
        let written = match form {
            0 => n.to_string(),
            1 => format!("{n}.0"),
            2 => format!("{n}0000000000"),
            _ => format!("{n}e3"),
        };
        let body = format!("{{\"max_tokens\":{written}}}");
        let asked: f64 = written.parse().unwrap();
        let want = if asked >= quota as f64 { quota } else { (asked.ceil() as u64).max(1) };
        prop_assert_eq!(reservation(body.as_bytes(), 4096, &terms, quota), Ok(want), "{}", body);
    }
}

/// The exact body that hung a worker, and its neighbours.
#[test]
fn the_five_byte_body_that_hung_a_worker_is_one_unfinished_message() {
    for body in [
        &b"\x00\xff\xff\xff\xfb"[..],
        b"\x00\xff\xff\xff\xff",
        b"\x00\xff\xff\xff\xfa",
        b"\x01\xff\xff\xff\xfb\x00",
    ] {
        assert_eq!(
            frames(body),
            Frames {
                started: 1,
                whole: false
            },
            "{body:?}"
        );
    }
}
