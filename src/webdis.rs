//! The wire to Redis: Webdis' HTTP command encoding out, RESP in.
//!
//! A command is POSTed as `COMMAND/arg1/arg2….raw`. Webdis splits on `/`,
//! treats a trailing `.ext` as the output format and decodes `%XX` and `+` in
//! each argument, so every byte that is not an ASCII letter or digit is
//! percent-encoded: keys and arguments reach Redis byte for byte and a client
//! value can never add an argument or a command. The `.raw` format returns
//! Redis' own RESP, which is binary-safe (its JSON output is not).
//!
//! A `PUT` carries the command in its path and its last argument as the
//! body, which Webdis passes to Redis byte for byte (no percent-decoding, no
//! `.ext`): a packed binary argument travels at its own size.

/// One request to Webdis.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Command {
    /// `Some(path)`: a PUT to this path (the command and every argument but
    /// the last), `body` being the last argument. `None`: a POST to `/` whose
    /// body is the whole command.
    pub put: Option<String>,
    pub body: Vec<u8>,
}

impl Command {
    /// The POST that runs `command args…` (see [`command_body`]).
    pub fn post(command: &str, args: &[&[u8]]) -> Command {
        Command {
            put: None,
            body: command_body(command, args),
        }
    }

    /// The PUT that runs `command args… last`: `last` is the body, as is.
    pub fn put(command: &str, args: &[&[u8]], last: Vec<u8>) -> Command {
        let mut path = String::with_capacity(
            command.len() + 6 + args.iter().map(|a| a.len() * 3 + 1).sum::<usize>(),
        );
        path.push('/');
        path.push_str(command);
        for arg in args {
            path.push('/');
            push_encoded_str(&mut path, arg);
        }
        path.push_str(".raw");
        Command {
            put: Some(path),
            body: last,
        }
    }

    /// The request's method and path.
    pub fn method_path(&self) -> (&'static str, &str) {
        match &self.put {
            Some(path) => ("PUT", path.as_str()),
            None => ("POST", "/"),
        }
    }

    /// Bytes on the wire besides the headers: a PUT's path and the body.
    pub fn wire_len(&self) -> usize {
        self.put.as_ref().map_or(0, String::len) + self.body.len()
    }
}

/// Where `cmd`'s script ARGV starts (a byte offset into its PUT path, or
/// its POST body), if it runs one of `echoing`: the SHA-1s of the scripts
/// that give a nonce put there back first in their reply (the book, Running
/// it: When things fail, says why), by `EVALSHA` or by `EVAL` with the
/// script's source. `None` for any other command. Reads an `EVALSHA` in
/// place: nothing is allocated for the commands that carry no nonce.
pub fn nonce_at(cmd: &Command, echoing: &[&str]) -> Option<usize> {
    let text: &[u8] = match &cmd.put {
        Some(path) => path.as_bytes(),
        None => &cmd.body,
    };
    let skip = usize::from(cmd.put.is_some());
    let encoded = text.get(skip..)?.strip_suffix(b".raw")?;
    let mut parts = encoded.split(|b| *b == b'/');
    let name = parts.next()?;
    let script = parts.next()?;
    let echoes = match name {
        b"EVALSHA" => echoing.iter().any(|e| e.as_bytes() == script),
        // A call goes as EVAL after a NOSCRIPT: every call does while a
        // restarted Redis has no scripts, which is when Webdis reconnects
        // and may hand a late reply to the wrong socket. The same script
        // echoes the nonce, so it carries one too (make soak once saw a
        // keyed request answered with another tenant's stored response at
        // such a restart, when EVAL carried none). Its SHA-1 is that of
        // the decoded source: EVAL is rare, so the hash is paid rarely.
        b"EVAL" => {
            use sha1::{Digest, Sha1};
            let source: Vec<u8> = percent_encoding::percent_decode(script).collect();
            let sha = crate::codec::hex(&Sha1::digest(&source));
            echoing.iter().any(|e| *e == sha)
        }
        _ => false,
    };
    if !echoes {
        return None;
    }
    let nkeys: usize = std::str::from_utf8(parts.next()?).ok()?.parse().ok()?;
    // Segments are percent-encoded: every `/` separates two. The ARGV start
    // at the slash after the last key, or at the end when there is none.
    let mut slashes = encoded
        .iter()
        .enumerate()
        .filter(|(_, b)| **b == b'/')
        .map(|(i, _)| i);
    // The slash before the last key (or before `nkeys` when there is no
    // key) must be there: a command with fewer keys than it says is left.
    slashes.nth(nkeys.checked_add(1)?)?;
    Some(skip + slashes.next().unwrap_or(encoded.len()))
}

/// `cmd` with the argument `~<nonce>` inserted at `at` ([`nonce_at`]).
pub fn insert_nonce(cmd: &Command, at: usize, nonce: &str) -> Command {
    // `~` is not alphanumeric: percent-encoded, as every argument byte is.
    let splice = |text: &[u8]| -> Vec<u8> {
        let at = at.min(text.len());
        let mut out = Vec::with_capacity(text.len() + 4 + nonce.len());
        out.extend_from_slice(&text[..at]);
        out.extend_from_slice(b"/%7E");
        out.extend_from_slice(nonce.as_bytes());
        out.extend_from_slice(&text[at..]);
        out
    };
    match &cmd.put {
        // The path is ASCII (percent-encoded) and `at` one of its slashes.
        Some(path) => Command {
            put: Some(match (path.get(..at), path.get(at..)) {
                // Pushed, not format!: the formatter cost about 1,400 fuel
                // a batch call in the wasm (envoy/cost_gate --segments).
                (Some(head), Some(tail)) => {
                    let mut spliced = String::with_capacity(path.len() + 4 + nonce.len());
                    spliced.push_str(head);
                    spliced.push_str("/%7E");
                    spliced.push_str(nonce);
                    spliced.push_str(tail);
                    spliced
                }
                _ => path.clone(),
            }),
            body: cmd.body.clone(),
        },
        None => Command {
            put: None,
            body: splice(&cmd.body),
        },
    }
}

/// Takes the nonce out of a reply to a call sent with it ([`insert_nonce`])
/// where its script put it, first: in place, leaving the reply the script
/// would have given without it; true if it was there. An error reply stays
/// as it is and counts as the call's (a script's error, or Redis' own
/// before the script ran, carries no nonce). Anything else without this
/// nonce first is not this call's reply (Webdis wrote another connection's
/// late reply to this one's socket: the book, Running it: When things fail): false.
pub fn strip_nonce(body: &mut Vec<u8>, nonce: &str) -> bool {
    if body.first() == Some(&b'-') {
        return true;
    }
    // `*<n>\r\n`, then the nonce's bulk string `$<len>\r\n~<nonce>\r\n`,
    // read in place with the reply parser's own line and integer readers.
    let Some((count, head)) = body.strip_prefix(b"*").and_then(|rest| line(rest).ok()) else {
        return false;
    };
    let Some(n) = int(count).ok().filter(|n| *n >= 1) else {
        return false;
    };
    let at = 1 + head;
    let Some((len, len_line)) = body
        .get(at..)
        .and_then(|b| b.strip_prefix(b"$"))
        .and_then(|b| line(b).ok())
    else {
        return false;
    };
    if int(len).ok() != i64::try_from(nonce.len() + 1).ok() {
        return false;
    }
    let value = at + 1 + len_line;
    let end = value + 1 + nonce.len() + 2;
    let ours = body.get(value..end).is_some_and(|v| {
        v[0] == b'~' && &v[1..1 + nonce.len()] == nonce.as_bytes() && v.ends_with(b"\r\n")
    });
    if !ours {
        return false;
    }
    let mut head = String::with_capacity(24);
    head.push('*');
    crate::codec::push_decimal(&mut head, u64::try_from(n - 1).unwrap_or(0));
    head.push_str("\r\n");
    body.splice(..end, head.into_bytes());
    true
}

/// Appends `arg` percent-encoded: every byte but an ASCII letter or digit
/// as `%XX` (upper-case hex), byte for byte what `percent_encode(arg,
/// NON_ALPHANUMERIC)` gives, without its iterator of chunks (every call's
/// keys and arguments go through here).
pub fn push_encoded(out: &mut Vec<u8>, arg: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    out.reserve(arg.len());
    for &b in arg {
        if b.is_ascii_alphanumeric() {
            out.push(b);
        } else {
            out.extend_from_slice(&[b'%', HEX[usize::from(b >> 4)], HEX[usize::from(b & 15)]]);
        }
    }
}

/// [`push_encoded`] into a path (what it appends is ASCII).
fn push_encoded_str(out: &mut String, arg: &[u8]) {
    let mut bytes = Vec::with_capacity(arg.len() * 3);
    push_encoded(&mut bytes, arg);
    // Only ASCII letters, digits, `%` and hex digits: valid UTF-8.
    out.push_str(std::str::from_utf8(&bytes).unwrap_or_default());
}

/// The POST body that runs `command args…` through Webdis, asking for RESP.
pub fn command_body(command: &str, args: &[&[u8]]) -> Vec<u8> {
    let mut body =
        Vec::with_capacity(command.len() + 8 + args.iter().map(|a| a.len() * 3 + 1).sum::<usize>());
    body.extend_from_slice(command.as_bytes());
    for arg in args {
        body.push(b'/');
        push_encoded(&mut body, arg);
    }
    body.extend_from_slice(b".raw");
    body
}

/// One RESP2 value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Status(String),
    Error(String),
    Int(i64),
    Bulk(Option<Vec<u8>>),
    Array(Option<Vec<Reply>>),
}

/// A reply as an error message and its log line quote it: bounded, since a
/// reply may be megabytes (a bulk string, arrays of many items), where
/// `Debug` would print each byte (the fuzzer's 8 MB bulk string took 2.4
/// billion wasm instructions and a 32 MB log line). Strings show their
/// first [`SHOWN_BYTES`] bytes, arrays their first [`SHOWN_ITEMS`] items
/// and two levels of nesting, each with the size of the whole.
pub struct Shown<'a>(pub &'a Reply);

impl std::fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        show(self.0, f, 0)
    }
}

/// How much of a reply [`Shown`] shows.
const SHOWN_BYTES: usize = 64;
const SHOWN_ITEMS: usize = 8;
const SHOWN_DEPTH: usize = 2;

fn show(reply: &Reply, f: &mut std::fmt::Formatter<'_>, depth: usize) -> std::fmt::Result {
    fn text(f: &mut std::fmt::Formatter<'_>, bytes: &[u8]) -> std::fmt::Result {
        let shown = bytes.get(..SHOWN_BYTES).unwrap_or(bytes);
        write!(f, "\"{}\"", shown.escape_ascii())?;
        if shown.len() < bytes.len() {
            write!(f, "... ({} bytes)", bytes.len())?;
        }
        Ok(())
    }
    match reply {
        Reply::Status(s) => f
            .write_str("Status(")
            .and_then(|()| text(f, s.as_bytes()))?,
        Reply::Error(s) => f.write_str("Error(").and_then(|()| text(f, s.as_bytes()))?,
        Reply::Int(n) => write!(f, "Int({n}")?,
        Reply::Bulk(None) => f.write_str("Bulk(None")?,
        Reply::Bulk(Some(b)) => f.write_str("Bulk(").and_then(|()| text(f, b))?,
        Reply::Array(None) => f.write_str("Array(None")?,
        Reply::Array(Some(items)) if depth >= SHOWN_DEPTH => {
            write!(f, "Array(... ({} items)", items.len())?
        }
        Reply::Array(Some(items)) => {
            f.write_str("Array([")?;
            for (i, item) in items.iter().take(SHOWN_ITEMS).enumerate() {
                if i > 0 {
                    f.write_str(", ")?;
                }
                show(item, f, depth + 1)?;
            }
            if items.len() > SHOWN_ITEMS {
                write!(f, ", ... ({} items)", items.len())?;
            }
            f.write_str("]")?;
        }
    }
    f.write_str(")")
}

impl Reply {
    /// An integer, whether Redis sent `:n` or Webdis re-encoded it as a bulk
    /// string (it does so for array elements).
    pub fn as_int(&self) -> Option<i64> {
        match self {
            Reply::Int(n) => Some(*n),
            Reply::Bulk(Some(b)) => std::str::from_utf8(b).ok()?.parse().ok(),
            _ => None,
        }
    }

    /// Why a script failed one member of a call that decides or settles
    /// several (lua/batch.lua, lua/settle.lua): the `ERR …` text it replies
    /// in that member's place, while the others are answered. `None` for
    /// anything else: a figure is digits, so it never reads as one.
    pub fn member_failure(&self) -> Option<&str> {
        match self {
            Reply::Bulk(Some(b)) if b.starts_with(b"ERR ") => std::str::from_utf8(b).ok(),
            _ => None,
        }
    }

    /// The error's first word (`NOSCRIPT`, `BUSY`, `OOM`…), if this is an error.
    pub fn error_kind(&self) -> Option<&str> {
        match self {
            Reply::Error(e) => Some(e.split(' ').next().unwrap_or("")),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplyError {
    Truncated,
    Malformed(&'static str),
    TrailingBytes,
    TooDeep,
}

impl std::fmt::Display for ReplyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReplyError::Truncated => write!(f, "truncated RESP reply"),
            ReplyError::Malformed(what) => write!(f, "malformed RESP reply: {what}"),
            ReplyError::TrailingBytes => write!(f, "bytes after the RESP reply"),
            ReplyError::TooDeep => write!(f, "RESP reply nested too deeply"),
        }
    }
}

const MAX_DEPTH: usize = 8;

/// Parses exactly one RESP2 value that spans the whole input.
pub fn parse_reply(input: &[u8]) -> Result<Reply, ReplyError> {
    let (reply, used) = parse_at(input, 0)?;
    if used != input.len() {
        return Err(ReplyError::TrailingBytes);
    }
    Ok(reply)
}

fn line(input: &[u8]) -> Result<(&[u8], usize), ReplyError> {
    let end = input
        .windows(2)
        .position(|w| w == b"\r\n")
        .ok_or(ReplyError::Truncated)?;
    Ok((&input[..end], end + 2))
}

fn int(bytes: &[u8]) -> Result<i64, ReplyError> {
    std::str::from_utf8(bytes)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or(ReplyError::Malformed("bad integer"))
}

fn parse_at(input: &[u8], depth: usize) -> Result<(Reply, usize), ReplyError> {
    if depth > MAX_DEPTH {
        return Err(ReplyError::TooDeep);
    }
    let (&tag, rest) = input.split_first().ok_or(ReplyError::Truncated)?;
    let (head, head_len) = line(rest)?;
    let consumed = 1 + head_len;
    match tag {
        b'+' => Ok((
            Reply::Status(String::from_utf8_lossy(head).into_owned()),
            consumed,
        )),
        b'-' => Ok((
            Reply::Error(String::from_utf8_lossy(head).into_owned()),
            consumed,
        )),
        b':' => Ok((Reply::Int(int(head)?), consumed)),
        b'$' => {
            let n = int(head)?;
            if n < 0 {
                return Ok((Reply::Bulk(None), consumed));
            }
            // Past usize (wasm32: past 4 GiB) is past any input: truncated,
            // on every target alike.
            let n = usize::try_from(n).unwrap_or(usize::MAX);
            let body = &input[consumed..];
            if body.len() < n.saturating_add(2) {
                return Err(ReplyError::Truncated);
            }
            if &body[n..n + 2] != b"\r\n" {
                return Err(ReplyError::Malformed("bulk string not terminated"));
            }
            Ok((Reply::Bulk(Some(body[..n].to_vec())), consumed + n + 2))
        }
        b'*' => {
            let n = int(head)?;
            if n < 0 {
                return Ok((Reply::Array(None), consumed));
            }
            let n = usize::try_from(n).unwrap_or(usize::MAX);
            // Each element takes at least 3 bytes; refuse counts the input cannot hold
            // before reserving memory for them.
            if n > input.len() / 3 {
                return Err(ReplyError::Truncated);
            }
            let mut items = Vec::with_capacity(n);
            let mut at = consumed;
            for _ in 0..n {
                let (item, used) = parse_at(&input[at..], depth + 1)?;
                items.push(item);
                at += used;
            }
            Ok((Reply::Array(Some(items)), at))
        }
        _ => Err(ReplyError::Malformed("unknown type byte")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reply quoted in an error is bounded however large it is, and small
    /// ones are shown whole.
    #[test]
    fn a_reply_in_an_error_message_is_shown_bounded() {
        let big = Reply::Bulk(Some(vec![b'7'; 8 << 20]));
        let shown = Shown(&big).to_string();
        assert_eq!(
            shown,
            format!("Bulk(\"{}\"... (8388608 bytes))", "7".repeat(64))
        );
        let many = Reply::Array(Some(vec![Reply::Int(1); 100_000]));
        assert_eq!(
            Shown(&many).to_string(),
            "Array([Int(1), Int(1), Int(1), Int(1), Int(1), Int(1), Int(1), Int(1), ... (100000 items)])"
        );
        let deep = Reply::Array(Some(vec![Reply::Array(Some(vec![Reply::Array(Some(
            vec![Reply::Int(1); 3],
        ))]))]));
        assert_eq!(
            Shown(&deep).to_string(),
            "Array([Array([Array(... (3 items))])])"
        );
        let small = Reply::Array(Some(vec![
            Reply::Bulk(Some(b"~ab\r\n\xff".to_vec())),
            Reply::Bulk(None),
            Reply::Error("ERR x".to_string()),
            Reply::Status("OK".to_string()),
            Reply::Array(None),
        ]));
        assert_eq!(
            Shown(&small).to_string(),
            "Array([Bulk(\"~ab\\r\\n\\xff\"), Bulk(None), Error(\"ERR x\"), Status(\"OK\"), Array(None)])"
        );
    }

    #[test]
    fn arguments_are_encoded_as_percent_encoding_encodes_them() {
        use percent_encoding::{percent_encode, NON_ALPHANUMERIC};
        let every: Vec<u8> = (0u8..=255).collect();
        for arg in [
            &every[..],
            b"",
            b"rg:rl:{t}:a:tb.1.1.1000:5:alice",
            "é/+%?".as_bytes(),
        ] {
            let mut ours = Vec::new();
            push_encoded(&mut ours, arg);
            let theirs = percent_encode(arg, NON_ALPHANUMERIC).to_string();
            assert_eq!(String::from_utf8(ours).unwrap(), theirs);
            let mut path = String::from("/x");
            push_encoded_str(&mut path, arg);
            assert_eq!(path, format!("/x{theirs}"));
        }
    }

    #[test]
    fn encodes_every_special_byte() {
        let body = command_body(
            "EVALSHA",
            &[b"ab", b"a/b.c%d+e?f g", &[0, 0xff], "é".as_bytes()],
        );
        assert_eq!(
            String::from_utf8(body).unwrap(),
            "EVALSHA/ab/a%2Fb%2Ec%25d%2Be%3Ff%20g/%00%FF/%C3%A9.raw"
        );
    }

    #[test]
    fn a_put_carries_its_last_argument_as_the_body_byte_for_byte() {
        let c = Command::put("EVALSHA", &[b"ab", b"1", b"k:{t}.x"], vec![0, 0xff, b'/']);
        assert_eq!(
            c.method_path(),
            ("PUT", "/EVALSHA/ab/1/k%3A%7Bt%7D%2Ex.raw")
        );
        assert_eq!(c.body, [0, 0xff, b'/']);
        assert_eq!(c.wire_len(), 33 + 3);
        let p = Command::post("GET", &[b"k"]);
        assert_eq!(
            (p.method_path(), p.body.as_slice()),
            (("POST", "/"), &b"GET/k.raw"[..])
        );
    }

    #[test]
    fn empty_argument_stays_an_argument() {
        assert_eq!(command_body("GET", &[b""]), b"GET/.raw");
    }

    #[test]
    fn parses_webdis_array_of_bulk_integers() {
        let r = parse_reply(b"*3\r\n$1\r\n1\r\n$2\r\n-5\r\n:7\r\n").unwrap();
        let Reply::Array(Some(items)) = r else {
            panic!("not an array")
        };
        let ints: Vec<_> = items.iter().map(|i| i.as_int().unwrap()).collect();
        assert_eq!(ints, vec![1, -5, 7]);
    }

    #[test]
    fn parses_errors_and_kinds() {
        let r = parse_reply(b"-NOSCRIPT No matching script. Please use EVAL.\r\n").unwrap();
        assert_eq!(r.error_kind(), Some("NOSCRIPT"));
        assert_eq!(parse_reply(b"+OK\r\n").unwrap(), Reply::Status("OK".into()));
        assert_eq!(parse_reply(b"$-1\r\n").unwrap(), Reply::Bulk(None));
    }

    #[test]
    fn bulk_strings_are_binary_safe() {
        let r = parse_reply(b"$4\r\n\r\n\x00\xff\r\n").unwrap();
        assert_eq!(r, Reply::Bulk(Some(vec![b'\r', b'\n', 0, 0xff])));
    }

    #[test]
    fn rejects_truncated_and_trailing_input() {
        assert_eq!(parse_reply(b""), Err(ReplyError::Truncated));
        assert_eq!(parse_reply(b"*2\r\n:1\r\n"), Err(ReplyError::Truncated));
        assert_eq!(parse_reply(b"$5\r\nab\r\n"), Err(ReplyError::Truncated));
        assert_eq!(parse_reply(b":1\r\n:2\r\n"), Err(ReplyError::TrailingBytes));
        assert_eq!(parse_reply(b"*99999999999\r\n"), Err(ReplyError::Truncated));
        assert!(parse_reply(b"{\"EVALSHA\":[1]}").is_err());
        assert!(parse_reply(b":abc\r\n").is_err());
    }

    #[test]
    fn refuses_deep_nesting() {
        let deep = b"*1\r\n".repeat(20);
        assert_eq!(parse_reply(&deep), Err(ReplyError::TooDeep));
    }

    #[test]
    fn a_nonce_goes_first_in_the_argv_of_an_echoing_script_only() {
        let keys = [b"k:{t}".to_vec()];
        let argv = [b"1".to_vec(), b"tb".to_vec()];
        let with = |cmd: &Command| insert_nonce(cmd, nonce_at(cmd, &["ab"]).unwrap(), "00ff");
        let post = Command::post("EVALSHA", &[b"ab", b"1", &keys[0], &argv[0], &argv[1]]);
        assert_eq!(
            with(&post).body,
            b"EVALSHA/ab/1/k%3A%7Bt%7D/%7E00ff/1/tb.raw"
        );
        let two = Command::post("EVALSHA", &[b"ab", b"2", b"k1", b"k2", b"x"]);
        assert_eq!(with(&two).body, b"EVALSHA/ab/2/k1/k2/%7E00ff/x.raw");
        let put = Command::put("EVALSHA", &[b"ab", b"1", &keys[0]], b"\x00/x".to_vec());
        let put = with(&put);
        assert_eq!(
            put.put.as_deref(),
            Some("/EVALSHA/ab/1/k%3A%7Bt%7D/%7E00ff.raw")
        );
        assert_eq!(
            put.body, b"\x00/x",
            "the packed body stays the last argument"
        );
        assert_eq!(nonce_at(&post, &["cd"]), None, "another script");
        let eval = Command::post("EVAL", &[b"return 1", b"0"]);
        assert_eq!(nonce_at(&eval, &["ab"]), None, "another script's source");
        // EVAL of an echoing script (its source's SHA-1): the nonce goes
        // first in ARGV as for its EVALSHA.
        let source = b"return {ARGV[1]} -- 100% / +";
        use sha1::{Digest, Sha1};
        let sha = crate::codec::hex(&Sha1::digest(source));
        let eval = Command::post("EVAL", &[source, b"1", b"k1", b"x"]);
        let at = nonce_at(&eval, &[&sha]).unwrap();
        assert_eq!(
            insert_nonce(&eval, at, "00ff").body,
            [
                &eval.body[..eval.body.len() - b"/x.raw".len()],
                b"/%7E00ff/x.raw"
            ]
            .concat()
        );
        let none = Command::post("EVAL", &[source, b"0"]);
        assert_eq!(
            insert_nonce(&none, nonce_at(&none, &[&sha]).unwrap(), "00ff").body,
            [&none.body[..none.body.len() - 4], b"/%7E00ff.raw"].concat()
        );
        let short = Command::post("EVALSHA", &[b"ab", b"3", b"k"]);
        assert_eq!(nonce_at(&short, &["ab"]), None, "fewer keys than it says");
    }

    #[test]
    fn only_a_reply_with_this_calls_nonce_first_is_its_own() {
        let strip = |b: &[u8], nonce: &str| {
            let mut body = b.to_vec();
            strip_nonce(&mut body, nonce).then_some(body)
        };
        let ours = b"*3\r\n$5\r\n~00ff\r\n:1\r\n:7\r\n";
        assert_eq!(strip(ours, "00ff").unwrap(), b"*2\r\n:1\r\n:7\r\n");
        assert_eq!(strip(ours, "00fe"), None, "another call's");
        assert_eq!(strip(b"*2\r\n:1\r\n:7\r\n", "00ff"), None, "no nonce");
        assert_eq!(strip(b":1\r\n", "00ff"), None, "not an array");
        assert_eq!(strip(b"*0\r\n", "00ff"), None);
        let err = b"-NOSCRIPT No matching script\r\n";
        assert_eq!(strip(err, "00ff").unwrap(), err.to_vec(), "errors pass");
        let only = b"*1\r\n$5\r\n~00ff\r\n";
        assert_eq!(strip(only, "00ff").unwrap(), b"*0\r\n");
        let many = b"*12\r\n$5\r\n~00ff\r\n";
        assert_eq!(strip(many, "00ff").unwrap(), b"*11\r\n");
    }
}
