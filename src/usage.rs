//! Usage-based cost without the host (issue 15, its reading part): what a
//! response says the request cost, from a JSON body or a streamed
//! `text/event-stream` body, by JSON Pointer (RFC 6901), one pointer or a
//! weighted sum of several (prompt tokens × 1 + completion tokens × 4).
//!
//! The stage that uses it is `filter/stage/usage.rs`; the settlement is
//! lua/settle.lua.
//!
//! Bounded: a JSON body is kept up to its bound and read once whole; an
//! event stream is scanned event by event, keeping only the unfinished
//! event (itself bounded). Over a bound the usage is unknown, never guessed:
//! the caller charges its fallback.

/// One term of the cost: the integer at `pointer`, times `weight`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Term {
    pub pointer: String,
    pub weight: u64,
}

/// Why a response's usage is unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unknown {
    /// No term's pointer named a whole number anywhere in the response.
    Absent,
    /// The body (or one event) was larger than its bound.
    TooLarge,
    /// The weighted sum does not fit in 64 bits.
    Overflow,
}

/// The weighted sum of the terms' values; a term never found counts 0, but
/// at least one must be found.
pub fn weighted(terms: &[Term], values: &[Option<u64>]) -> Result<u64, Unknown> {
    if values.iter().all(Option::is_none) {
        return Err(Unknown::Absent);
    }
    terms
        .iter()
        .zip(values)
        .try_fold(0u64, |sum, (term, value)| {
            value
                .unwrap_or(0)
                .checked_mul(term.weight)
                .and_then(|v| sum.checked_add(v))
        })
        .ok_or(Unknown::Overflow)
}

/// Reads each term's value from one JSON document (a response's stated
/// usage); `None` per term absent or not a whole non-negative number.
fn read_terms(doc: &serde_json::Value, terms: &[Term]) -> Vec<Option<u64>> {
    read_terms_with(doc, terms, serde_json::Value::as_u64)
}

fn read_terms_with(
    doc: &serde_json::Value,
    terms: &[Term],
    read: fn(&serde_json::Value) -> Option<u64>,
) -> Vec<Option<u64>> {
    terms
        .iter()
        .map(|t| doc.pointer(&t.pointer).and_then(read))
        .collect()
}

/// A number a client asks for, as units, never fewer than it says: a
/// fraction counts rounded up (`1000.5` is 1001), and an integer past 64
/// bits, which serde_json reads as a float (`18446744073709551616`, `1e30`),
/// saturates at `u64::MAX` (a float's `as` conversion saturates).
/// Negative: not units.
fn asked_units(value: &serde_json::Value) -> Option<u64> {
    if let Some(n) = value.as_u64() {
        return Some(n);
    }
    let f = value.as_f64()?;
    (f >= 0.0).then(|| f.ceil() as u64)
}

/// A whole JSON response body, kept up to `max` bytes.
#[derive(Debug, Clone)]
pub struct JsonBody {
    max: usize,
    buf: Vec<u8>,
    too_large: bool,
}

impl JsonBody {
    pub fn new(max: usize) -> JsonBody {
        JsonBody {
            max,
            buf: Vec::new(),
            too_large: false,
        }
    }

    pub fn feed(&mut self, chunk: &[u8]) {
        if self.too_large {
            return;
        }
        if self.buf.len() + chunk.len() > self.max {
            // Dropped at once: nothing of it will be read.
            self.too_large = true;
            self.buf = Vec::new();
            return;
        }
        self.buf.extend_from_slice(chunk);
    }

    /// Over its bound: nothing more will be read.
    pub fn void(&self) -> bool {
        self.too_large
    }

    /// The cost the whole body states.
    pub fn cost(&self, terms: &[Term]) -> Result<u64, Unknown> {
        weighted(terms, &self.values(terms)?)
    }

    /// Each term's value in the whole body.
    pub fn values(&self, terms: &[Term]) -> Result<Vec<Option<u64>>, Unknown> {
        if self.too_large {
            return Err(Unknown::TooLarge);
        }
        let doc: serde_json::Value =
            serde_json::from_slice(&self.buf).map_err(|_| Unknown::Absent)?;
        Ok(read_terms(&doc, terms))
    }
}

/// What a request reserves under a limit whose reservation its JSON body
/// names (`max_tokens`): the terms' weighted sum, at least 1 (a request
/// always takes something) and at most `quota` (more could never be
/// admitted; the settlement charges the rest as debt if it is used).
/// A body over `max` bytes, not JSON or without the fields: unknown, and
/// the caller reserves its fixed amount.
pub fn reservation(body: &[u8], max: usize, terms: &[Term], quota: u64) -> Result<u64, Unknown> {
    if body.len() > max {
        return Err(Unknown::TooLarge);
    }
    let doc: serde_json::Value = match serde_json::from_slice(body) {
        Ok(doc) => doc,
        // A number past a float's range (`1e400`): serde_json refuses the
        // document, which an upstream may still read as infinity. It asks
        // for more than any quota, so it reserves all of it.
        Err(e) if e.to_string().starts_with("number out of range") => return Ok(quota.max(1)),
        Err(_) => return Err(Unknown::Absent),
    };
    let units = match weighted(terms, &read_terms_with(&doc, terms, asked_units)) {
        Err(Unknown::Overflow) => u64::MAX,
        other => other?,
    };
    Ok(units.clamp(1, quota.max(1)))
}

/// A `text/event-stream` body, scanned as it streams: each event's `data:`
/// lines, joined, are read as JSON, and each term keeps the last value any
/// event gave it (usage counts are running totals: OpenAI sends them once in
/// a final chunk, Anthropic its input tokens in `message_start` and its
/// output tokens, cumulative, in `message_delta`).
#[derive(Debug, Clone)]
pub struct EventStream {
    /// Most bytes of one unfinished event kept.
    max_event: usize,
    /// The unfinished event (bytes after the last event boundary).
    pending: Vec<u8>,
    /// The last value seen per term.
    last: Vec<Option<u64>>,
    too_large: bool,
}

impl EventStream {
    pub fn new(terms: usize, max_event: usize) -> EventStream {
        EventStream {
            max_event,
            pending: Vec::new(),
            last: vec![None; terms],
            too_large: false,
        }
    }

    /// Scans a piece of the stream: every event it completes is read at
    /// once, and only the unfinished rest is kept.
    pub fn feed(&mut self, chunk: &[u8], terms: &[Term]) {
        if self.too_large {
            return;
        }
        let mut buf = std::mem::take(&mut self.pending);
        buf.extend_from_slice(chunk);
        // Events are read where they lie; what is left is kept once.
        let mut at = 0;
        while let Some((end, next)) = event_boundary(&buf[at..]) {
            self.read_event(&buf[at..at + end], terms);
            at += next;
        }
        buf.drain(..at);
        self.pending = buf;
        if self.pending.len() > self.max_event {
            self.too_large = true;
            self.pending = Vec::new();
        }
    }

    /// An event over its bound: nothing more will be read.
    pub fn void(&self) -> bool {
        self.too_large
    }

    /// The stream ended: a last event without its blank line counts too.
    pub fn finish(&mut self, terms: &[Term]) -> Result<u64, Unknown> {
        weighted(terms, &self.finish_values(terms)?)
    }

    /// `finish`, as each term's last value.
    pub fn finish_values(&mut self, terms: &[Term]) -> Result<Vec<Option<u64>>, Unknown> {
        if self.too_large {
            return Err(Unknown::TooLarge);
        }
        let rest = std::mem::take(&mut self.pending);
        self.read_event(&rest, terms);
        Ok(self.last.clone())
    }

    fn read_event(&mut self, event: &[u8], terms: &[Term]) {
        let mut data: Vec<u8> = Vec::new();
        let mut lines = 0;
        for line in event.split(|b| *b == b'\n') {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            let Some(value) = line.strip_prefix(b"data:") else {
                continue;
            };
            let value = value.strip_prefix(b" ").unwrap_or(value);
            if lines > 0 {
                data.push(b'\n');
            }
            data.extend_from_slice(value);
            lines += 1;
        }
        // Not JSON ("[DONE]", a comment, a keep-alive): nothing to read.
        let Ok(doc) = serde_json::from_slice::<serde_json::Value>(&data) else {
            return;
        };
        for (last, value) in self.last.iter_mut().zip(read_terms(&doc, terms)) {
            if value.is_some() {
                *last = value;
            }
        }
    }
}

/// Where the first event in `buf` ends, and where the next one starts: a
/// blank line, in any of the line endings the format allows.
fn event_boundary(buf: &[u8]) -> Option<(usize, usize)> {
    let mut i = 0;
    while i < buf.len() {
        let eol = match buf[i] {
            b'\n' => 1,
            b'\r' if buf.get(i + 1) == Some(&b'\n') => 2,
            b'\r' => 1,
            _ => {
                i += 1;
                continue;
            }
        };
        let j = i + eol;
        match buf.get(j) {
            Some(b'\n') => return Some((i, j + 1)),
            Some(b'\r') if buf.get(j + 1) == Some(&b'\n') => return Some((i, j + 2)),
            // A lone CR could still be followed by its LF: wait for it.
            Some(b'\r') if j + 1 == buf.len() => return None,
            Some(b'\r') => return Some((i, j + 1)),
            _ => i = j,
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn terms(spec: &[(&str, u64)]) -> Vec<Term> {
        spec.iter()
            .map(|(p, w)| Term {
                pointer: p.to_string(),
                weight: *w,
            })
            .collect()
    }

    #[test]
    fn a_request_reserves_what_its_body_names_within_one_and_the_quota() {
        let max_tokens = terms(&[("/max_tokens", 1)]);
        let body = br#"{"model":"m","max_tokens":800,"messages":[]}"#;
        assert_eq!(reservation(body, 1024, &max_tokens, 5000), Ok(800));
        // Weighted, and summed over the terms it finds.
        let both = terms(&[("/max_tokens", 4), ("/n", 2)]);
        assert_eq!(reservation(body, 1024, &both, 5000), Ok(3200));
        // Bounded both ways.
        assert_eq!(reservation(body, 1024, &max_tokens, 500), Ok(500));
        let zero = br#"{"max_tokens":0}"#;
        assert_eq!(reservation(zero, 1024, &max_tokens, 500), Ok(1));
        for (body, reserved) in [
            // Past 64 bits (a float to serde_json) or past a float: the quota.
            (&br#"{"max_tokens":18446744073709551616}"#[..], 5000),
            (br#"{"max_tokens":1000000000000000000000000000000}"#, 5000),
            (br#"{"max_tokens":1e30}"#, 5000),
            (br#"{"max_tokens":1e400}"#, 5000),
            // A float counts, rounded up.
            (br#"{"max_tokens":1000.0}"#, 1000),
            (br#"{"max_tokens":1e3}"#, 1000),
            (br#"{"max_tokens":99.1}"#, 100),
            (br#"{"max_tokens":0.5}"#, 1),
        ] {
            let shown = String::from_utf8_lossy(body);
            assert_eq!(
                reservation(body, 1024, &max_tokens, 5000),
                Ok(reserved),
                "{shown}"
            );
        }
        let huge = br#"{"max_tokens":18446744073709551615}"#;
        assert_eq!(
            reservation(huge, 1024, &both, 500),
            Ok(500),
            "overflow is the quota"
        );
        // Unknown: the caller's fixed reserve.
        assert_eq!(
            reservation(br#"{"messages":[]}"#, 1024, &max_tokens, 500),
            Err(Unknown::Absent)
        );
        assert_eq!(
            reservation(br#"{"max_tokens":"800"}"#, 1024, &max_tokens, 500),
            Err(Unknown::Absent),
            "a string is not a count"
        );
        assert_eq!(
            reservation(b"max_tokens=800", 1024, &max_tokens, 500),
            Err(Unknown::Absent)
        );
        assert_eq!(
            reservation(body, body.len() - 1, &max_tokens, 5000),
            Err(Unknown::TooLarge)
        );
        assert_eq!(reservation(body, body.len(), &max_tokens, 5000), Ok(800));
    }

    const OPENAI_JSON: &[u8] = br#"{"id":"chatcmpl-1","object":"chat.completion",
        "choices":[{"index":0,"message":{"role":"assistant","content":"Hi"}}],
        "usage":{"prompt_tokens":12,"completion_tokens":30,"total_tokens":42}}"#;

    #[test]
    fn a_json_body_states_its_cost_by_one_pointer_or_a_weighted_sum() {
        let mut body = JsonBody::new(4096);
        for chunk in OPENAI_JSON.chunks(7) {
            body.feed(chunk);
        }
        assert_eq!(body.cost(&terms(&[("/usage/total_tokens", 1)])), Ok(42));
        let weighted = terms(&[("/usage/prompt_tokens", 1), ("/usage/completion_tokens", 4)]);
        assert_eq!(body.cost(&weighted), Ok(12 + 4 * 30));
        assert_eq!(
            body.cost(&terms(&[("/usage/cached_tokens", 1)])),
            Err(Unknown::Absent)
        );
        // A term found and one not: the missing one counts 0.
        let partly = terms(&[("/usage/prompt_tokens", 2), ("/usage/audio_tokens", 9)]);
        assert_eq!(body.cost(&partly), Ok(24));
    }

    #[test]
    fn a_json_body_over_its_bound_or_not_json_has_no_known_cost() {
        let t = terms(&[("/usage/total_tokens", 1)]);
        let mut body = JsonBody::new(OPENAI_JSON.len() - 1);
        body.feed(OPENAI_JSON);
        assert_eq!(body.cost(&t), Err(Unknown::TooLarge));
        let mut body = JsonBody::new(100);
        body.feed(b"<html>502</html>");
        assert_eq!(body.cost(&t), Err(Unknown::Absent));
        // Negative, fractional or string counts are no count.
        for bad in [&b"-3"[..], b"3.5", b"\"3\""] {
            let mut body = JsonBody::new(100);
            body.feed(b"{\"usage\":{\"total_tokens\":");
            body.feed(bad);
            body.feed(b"}}");
            assert_eq!(body.cost(&t), Err(Unknown::Absent), "{bad:?}");
        }
        let mut body = JsonBody::new(100);
        body.feed(br#"{"a":18446744073709551615}"#);
        assert_eq!(body.cost(&terms(&[("/a", 2)])), Err(Unknown::Overflow));
    }

    /// An OpenAI-style stream: content chunks, a final chunk with usage,
    /// then `[DONE]`.
    const OPENAI_SSE: &[u8] = b"data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}],\"usage\":null}\n\n\
data: {\"choices\":[{\"delta\":{\"content\":\"lo\"}}],\"usage\":null}\n\n\
data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":2,\"total_tokens\":11}}\n\n\
data: [DONE]\n\n";

    /// An Anthropic-style stream: input tokens in `message_start`, output
    /// tokens (a running total) in `message_delta`, CRLF line endings.
    const ANTHROPIC_SSE: &[u8] = b"event: message_start\r\n\
data: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\r\n\r\n\
event: content_block_delta\r\n\
data: {\"type\":\"content_block_delta\",\"delta\":{\"text\":\"Hi\"}}\r\n\r\n\
event: message_delta\r\n\
data: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":15}}\r\n\r\n\
event: message_delta\r\n\
data: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":40}}\r\n\r\n\
event: message_stop\r\n\
data: {\"type\":\"message_stop\"}\r\n\r\n";

    fn scan(stream: &[u8], t: &[Term], piece: usize, max_event: usize) -> Result<u64, Unknown> {
        let mut s = EventStream::new(t.len(), max_event);
        for chunk in stream.chunks(piece) {
            s.feed(chunk, t);
        }
        s.finish(t)
    }

    #[test]
    fn a_stream_states_its_cost_in_whichever_events_carry_it_however_it_is_cut() {
        let openai = terms(&[("/usage/prompt_tokens", 1), ("/usage/completion_tokens", 4)]);
        let anthropic = terms(&[
            ("/message/usage/input_tokens", 1),
            ("/usage/output_tokens", 5),
        ]);
        for piece in [1, 2, 3, 7, 64, 10_000] {
            assert_eq!(scan(OPENAI_SSE, &openai, piece, 1024), Ok(9 + 8), "{piece}");
            // The last running total counts, not their sum.
            assert_eq!(
                scan(ANTHROPIC_SSE, &anthropic, piece, 1024),
                Ok(25 + 5 * 40),
                "{piece}"
            );
        }
    }

    /// An Anthropic Messages answer that is not streamed: one JSON body,
    /// its usage at the top level.
    const ANTHROPIC_JSON: &[u8] = br#"{"id":"msg_01","type":"message","role":"assistant",
        "content":[{"type":"text","text":"Hi"}],"stop_reason":"end_turn",
        "usage":{"input_tokens":25,"output_tokens":40}}"#;

    /// The book's usage page: each Anthropic answer has its own pointers;
    /// the other's find only the output tokens, and listing both input
    /// pointers counts the input twice when a `message_delta` also reports it.
    #[test]
    fn anthropic_states_its_input_tokens_at_another_pointer_when_it_streams() {
        let json = terms(&[("/usage/input_tokens", 1), ("/usage/output_tokens", 5)]);
        let streamed = terms(&[
            ("/message/usage/input_tokens", 1),
            ("/usage/output_tokens", 5),
        ]);
        let mut body = JsonBody::new(4096);
        body.feed(ANTHROPIC_JSON);
        assert_eq!(body.cost(&json), Ok(25 + 5 * 40));
        assert_eq!(body.cost(&streamed), Ok(5 * 40));
        assert_eq!(scan(ANTHROPIC_SSE, &streamed, 7, 1024), Ok(25 + 5 * 40));
        assert_eq!(scan(ANTHROPIC_SSE, &json, 7, 1024), Ok(5 * 40));
        // Both input pointers: right for either answer while no message_delta
        // reports input tokens, twice the input once one does.
        let both = terms(&[
            ("/usage/input_tokens", 1),
            ("/message/usage/input_tokens", 1),
            ("/usage/output_tokens", 5),
        ]);
        assert_eq!(body.cost(&both), Ok(25 + 5 * 40));
        assert_eq!(scan(ANTHROPIC_SSE, &both, 7, 1024), Ok(25 + 5 * 40));
        let reporting = b"event: message_start\n\
data: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\n\
event: message_delta\n\
data: {\"type\":\"message_delta\",\"usage\":{\"input_tokens\":25,\"output_tokens\":40}}\n\n";
        assert_eq!(scan(reporting, &both, 7, 1024), Ok(2 * 25 + 5 * 40));
        assert_eq!(scan(reporting, &json, 7, 1024), Ok(25 + 5 * 40));
    }

    #[test]
    fn events_split_over_lines_and_a_last_event_without_its_blank_line_count() {
        let t = terms(&[("/usage/total_tokens", 1)]);
        let stream = b": keep-alive\n\ndata: {\"usage\":\ndata: {\"total_tokens\": 7}}";
        assert_eq!(scan(stream, &t, 5, 1024), Ok(7));
        // A bare CR ends lines too.
        assert_eq!(
            scan(b"data: {\"usage\":{\"total_tokens\":3}}\r\r", &t, 1, 1024),
            Ok(3)
        );
    }

    #[test]
    fn only_the_unfinished_event_is_kept_and_an_event_over_its_bound_voids_the_usage() {
        let t = terms(&[("/usage/total_tokens", 1)]);
        let mut s = EventStream::new(1, 64);
        for _ in 0..1000 {
            s.feed(
                b"data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\n",
                &t,
            );
            assert!(s.pending.is_empty());
        }
        s.feed(b"data: {\"usage\":{\"total_tokens\":", &t);
        assert!(!s.pending.is_empty() && s.pending.len() <= 64);
        s.feed(b"5}}\n\n", &t);
        assert_eq!(s.finish(&t), Ok(5));
        let big = format!("data: {{\"pad\":\"{}\"}}\n\n", "x".repeat(100));
        assert_eq!(scan(big.as_bytes(), &t, 10, 64), Err(Unknown::TooLarge));
        assert_eq!(scan(b"data: [DONE]\n\n", &t, 3, 64), Err(Unknown::Absent));
    }
}
