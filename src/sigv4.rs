//! AWS Signature Version 4 for S3 requests (header-based, single chunk).
//!
//! Pure functions: the caller supplies the clock (`unix_secs`) and sends the
//! returned headers, so the filter can sign uploads and fetches without any
//! host call here. Only what S3 needs is covered: no path normalisation and no
//! double encoding, because S3 signs the path exactly as it receives it.

use std::fmt;

use hmac::{Hmac, Mac};
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use sha2::Sha256;

use crate::codec::{hex, sha256_hex};

const ALGORITHM: &str = "AWS4-HMAC-SHA256";

/// SigV4 "unreserved" characters stay as they are; every other byte is `%XX`.
const UNRESERVED: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// In an object key '/' separates "folders" and S3 signs it unescaped.
const KEY_SET: &AsciiSet = &UNRESERVED.remove(b'/');

/// Headers the signer produces itself: a caller's copy is dropped so a stale or
/// conflicting value can never be signed alongside (or instead of) ours.
const OWNED_HEADERS: [&str; 5] = [
    "authorization",
    "host",
    "x-amz-content-sha256",
    "x-amz-date",
    "x-amz-security-token",
];

#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    pub access_key_id: String,
    pub secret_access_key: String,
    pub session_token: Option<String>,
}

// Credentials end up in logged config and error values; only the access key id
// (which travels in clear in every Authorization header) may be shown.
impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let token = self.session_token.as_ref().map(|_| "<redacted>");
        f.debug_struct("Credentials")
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &"<redacted>")
            .field("session_token", &token)
            .finish()
    }
}

#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    pub method: &'a str,
    /// Value of the Host header (sent by the caller as `:authority`).
    pub host: &'a str,
    /// Already-encoded canonical URI, e.g. from [`object_path`].
    pub path: &'a str,
    /// Raw (unencoded) query parameters.
    pub query: &'a [(&'a str, &'a str)],
    /// Extra headers to sign, e.g. `content-type`, `x-amz-meta-*`.
    pub headers: &'a [(&'a str, &'a str)],
    /// Lower-case hex SHA-256 of the body, or `UNSIGNED-PAYLOAD`.
    pub payload_sha256: &'a str,
}

/// `("20150830T123600Z", "20150830")` for the given second (UTC).
pub fn amz_date(unix_secs: u64) -> (String, String) {
    let days = unix_secs / 86_400;
    let rem = unix_secs % 86_400;
    let (y, m, d) = civil_from_days(days);
    let date = format!("{y:04}{m:02}{d:02}");
    let (h, min, sec) = (rem / 3600, rem % 3600 / 60, rem % 60);
    let stamp = format!("{date}T{h:02}{min:02}{sec:02}Z");
    (stamp, date)
}

/// Proleptic Gregorian date of a day count since 1970-01-01. Counting from
/// 0000-03-01 puts the leap day last in each year, and 400-year eras repeat
/// exactly, so the date falls out of integer division with no tables.
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468; // days from 0000-03-01 to 1970-01-01
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153; // month counted from March
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = era * 400 + yoe + u64::from(month <= 2);
    (year, month, day)
}

/// Path-style S3 URI `/bucket/key`, usable both as the request `:path` and as
/// the canonical URI, so what is signed is byte-for-byte what is sent.
pub fn object_path(bucket: &str, key: &str) -> String {
    format!(
        "/{}/{}",
        utf8_percent_encode(bucket, UNRESERVED),
        utf8_percent_encode(key, KEY_SET)
    )
}

fn hmac_sha256(key: &[u8], msg: &[u8]) -> [u8; 32] {
    // HMAC takes keys of any length; the Result only exists because the trait
    // is shared with fixed-key MACs. Should it ever fail, a zero MAC makes S3
    // answer 403 instead of taking the proxy down.
    let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(key) else {
        return [0; 32];
    };
    mac.update(msg);
    mac.finalize().into_bytes().into()
}

pub fn signing_key(secret: &str, date: &str, region: &str, service: &str) -> [u8; 32] {
    let k_date = hmac_sha256(format!("AWS4{secret}").as_bytes(), date.as_bytes());
    let k_region = hmac_sha256(&k_date, region.as_bytes());
    let k_service = hmac_sha256(&k_region, service.as_bytes());
    hmac_sha256(&k_service, b"aws4_request")
}

/// Lower-cased, trimmed headers to sign, sorted by name, repeated names merged
/// with ',' in the order given (as SigV4 specifies).
fn headers_to_sign(req: &Request, amz_date: &str, token: Option<&str>) -> Vec<(String, String)> {
    let mut all: Vec<(String, String)> = req
        .headers
        .iter()
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), trim_all(v)))
        .filter(|(n, _)| !OWNED_HEADERS.contains(&n.as_str()))
        .collect();
    all.push(("host".into(), trim_all(req.host)));
    all.push(("x-amz-content-sha256".into(), req.payload_sha256.into()));
    all.push(("x-amz-date".into(), amz_date.into()));
    if let Some(token) = token {
        all.push(("x-amz-security-token".into(), trim_all(token)));
    }
    // Stable, so repeated names keep their values in the caller's order.
    all.sort_by(|a, b| a.0.cmp(&b.0));
    let mut merged: Vec<(String, String)> = Vec::with_capacity(all.len());
    for (name, value) in all {
        match merged.last_mut() {
            Some((last, joined)) if *last == name => {
                joined.push(',');
                joined.push_str(&value);
            }
            _ => merged.push((name, value)),
        }
    }
    merged
}

fn trim_all(value: &str) -> String {
    value.split_ascii_whitespace().collect::<Vec<_>>().join(" ")
}

fn canonical_query(query: &[(&str, &str)]) -> String {
    let enc = |s: &str| utf8_percent_encode(s, UNRESERVED).to_string();
    // Sorted after encoding: S3 compares the encoded bytes.
    let mut pairs: Vec<(String, String)> = query.iter().map(|(k, v)| (enc(k), enc(v))).collect();
    pairs.sort();
    let parts: Vec<String> = pairs.into_iter().map(|(k, v)| format!("{k}={v}")).collect();
    parts.join("&")
}

/// The canonical request and its `SignedHeaders` list.
pub fn canonical_request(req: &Request, amz_date: &str, token: Option<&str>) -> (String, String) {
    let headers = headers_to_sign(req, amz_date, token);
    let lines: String = headers.iter().map(|(n, v)| format!("{n}:{v}\n")).collect();
    let names: Vec<&str> = headers.iter().map(|(n, _)| n.as_str()).collect();
    let signed = names.join(";");
    let (method, path, payload) = (req.method, req.path, req.payload_sha256);
    let query = canonical_query(req.query);
    let canonical = format!("{method}\n{path}\n{query}\n{lines}\n{signed}\n{payload}");
    (canonical, signed)
}

pub fn string_to_sign(amz_date: &str, scope: &str, canonical_request: &str) -> String {
    format!(
        "{ALGORITHM}\n{amz_date}\n{scope}\n{}",
        sha256_hex(canonical_request.as_bytes())
    )
}

/// Headers to add: `x-amz-date`, `x-amz-content-sha256`, `x-amz-security-token`
/// (with a session token) and `authorization`. Host is signed but not returned.
pub fn sign(
    req: &Request,
    creds: &Credentials,
    region: &str,
    service: &str,
    unix_secs: u64,
) -> Vec<(String, String)> {
    let (stamp, date) = amz_date(unix_secs);
    let token = creds.session_token.as_deref();
    let (canonical, signed) = canonical_request(req, &stamp, token);
    let scope = format!("{date}/{region}/{service}/aws4_request");
    let sts = string_to_sign(&stamp, &scope, &canonical);
    let key = signing_key(&creds.secret_access_key, &date, region, service);
    let signature = hex(&hmac_sha256(&key, sts.as_bytes()));
    let authorization = format!(
        "{ALGORITHM} Credential={}/{scope}, SignedHeaders={signed}, Signature={signature}",
        creds.access_key_id
    );
    let mut out: Vec<(String, String)> = vec![
        ("x-amz-date".into(), stamp),
        ("x-amz-content-sha256".into(), req.payload_sha256.into()),
    ];
    if let Some(token) = token {
        out.push(("x-amz-security-token".into(), token.into()));
    }
    out.push(("authorization".into(), authorization));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const AKID: &str = "AKIAIOSFODNN7EXAMPLE";
    // AWS's examples use two secrets: '+' in the general SigV4 (IAM) pages,
    // '/' in the S3 pages. Swapping them breaks every published signature.
    const IAM_DOC_SECRET: &str = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY";
    const S3_DOC_SECRET: &str = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY";
    const EMPTY_SHA256: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
    const MAY_24_2013: u64 = 1_369_353_600;

    fn creds(token: Option<&str>) -> Credentials {
        Credentials {
            access_key_id: AKID.into(),
            secret_access_key: S3_DOC_SECRET.into(),
            session_token: token.map(Into::into),
        }
    }

    /// The S3 docs' examples: virtual-hosted bucket, empty body.
    fn base<'a>() -> Request<'a> {
        Request {
            method: "GET",
            host: "examplebucket.s3.amazonaws.com",
            path: "/",
            query: &[],
            headers: &[],
            payload_sha256: EMPTY_SHA256,
        }
    }

    fn sign_at(req: &Request, token: Option<&str>, unix_secs: u64) -> Vec<(String, String)> {
        sign(req, &creds(token), "us-east-1", "s3", unix_secs)
    }

    fn header<'a>(out: &'a [(String, String)], name: &str) -> &'a str {
        out.iter().find(|(n, _)| n == name).unwrap().1.as_str()
    }

    fn names(out: &[(String, String)]) -> Vec<&str> {
        out.iter().map(|(n, _)| n.as_str()).collect()
    }

    #[test]
    fn signing_key_matches_aws_doc_example() {
        let key = signing_key(IAM_DOC_SECRET, "20120215", "us-east-1", "iam");
        let want = "f4780e2d9f65fa895f9c67b32ce1baf0b0d8a43505a000a1a9e090d414db404d";
        assert_eq!(hex(&key), want);
    }

    #[test]
    fn s3_doc_get_object() {
        let req = Request {
            path: "/test.txt",
            headers: &[("Range", "bytes=0-9")],
            ..base()
        };
        let (canonical, signed) = canonical_request(&req, "20130524T000000Z", None);
        let want = format!(
            "GET\n/test.txt\n\nhost:examplebucket.s3.amazonaws.com\nrange:bytes=0-9\n\
             x-amz-content-sha256:{EMPTY_SHA256}\nx-amz-date:20130524T000000Z\n\n\
             host;range;x-amz-content-sha256;x-amz-date\n{EMPTY_SHA256}"
        );
        assert_eq!(canonical, want);
        let scope = "20130524/us-east-1/s3/aws4_request";
        let sts = string_to_sign("20130524T000000Z", scope, &canonical);
        let cr_hash = "7344ae5b7ee6c3e7e6b0fe0640412a37625d1fbfff95c48bbb2dc43964946972";
        let want = format!("AWS4-HMAC-SHA256\n20130524T000000Z\n{scope}\n{cr_hash}");
        assert_eq!(sts, want);
        let out = sign_at(&req, None, MAY_24_2013);
        let want = ["x-amz-date", "x-amz-content-sha256", "authorization"];
        assert_eq!(names(&out), want);
        assert_eq!(header(&out, "x-amz-date"), "20130524T000000Z");
        assert_eq!(header(&out, "x-amz-content-sha256"), EMPTY_SHA256);
        assert_eq!(
            header(&out, "authorization"),
            format!(
                "AWS4-HMAC-SHA256 Credential={AKID}/{scope}, SignedHeaders={signed}, \
                 Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"
            )
        );
    }

    #[test]
    fn s3_doc_put_object() {
        let hash = sha256_hex(b"Welcome to Amazon S3.");
        let want = "44ce7dd67c959e0d3524ffac1771dfbba87d2b6b4b4e99e42034a8b803f8b072";
        assert_eq!(hash, want);
        let path = format!("/{}", utf8_percent_encode("test$file.text", KEY_SET));
        assert_eq!(path, "/test%24file.text");
        let headers = [
            ("Date", "Fri, 24 May 2013 00:00:00 GMT"),
            ("x-amz-storage-class", "REDUCED_REDUNDANCY"),
        ];
        let req = Request {
            method: "PUT",
            path: &path,
            headers: &headers,
            payload_sha256: &hash,
            ..base()
        };
        let (canonical, signed) = canonical_request(&req, "20130524T000000Z", None);
        let want = "date;host;x-amz-content-sha256;x-amz-date;x-amz-storage-class";
        assert_eq!(signed, want);
        let cr_hash = "9e0e90d9c76de8fa5b200d8c849cd5b8dc7a3be3951ddb7f6a76b4158342019d";
        assert_eq!(sha256_hex(canonical.as_bytes()), cr_hash);
        let out = sign_at(&req, None, MAY_24_2013);
        let sig = "Signature=98ad721746da40c64f1a55b78f14c238d841ea1380cd77a1b5971af0ece108bd";
        assert!(header(&out, "authorization").ends_with(sig));
    }

    #[test]
    fn amz_date_instants() {
        let cases = [
            (0, "19700101T000000Z"),
            (946_684_799, "19991231T235959Z"),
            (951_868_800, "20000301T000000Z"),
            (1_709_251_199, "20240229T235959Z"),
            (2_147_483_648, "20380119T031408Z"),
            (4_107_542_400, "21000301T000000Z"),
        ];
        for (secs, stamp) in cases {
            let (s, d) = amz_date(secs);
            assert_eq!((s.as_str(), d.as_str()), (stamp, &stamp[..8]), "{secs}");
        }
        // Absurd clocks must still format rather than overflow.
        assert!(amz_date(u64::MAX).0.ends_with('Z'));
    }

    #[test]
    fn object_path_encoding() {
        assert_eq!(object_path("bucket", "a/b c"), "/bucket/a/b%20c");
        assert_eq!(object_path("bucket", "x+y%z$"), "/bucket/x%2By%25z%24");
        assert_eq!(object_path("bucket", "é/日"), "/bucket/%C3%A9/%E6%97%A5");
        assert_eq!(object_path("bucket", "-._~AZaz09"), "/bucket/-._~AZaz09");
        assert_eq!(object_path("b/c", "k"), "/b%2Fc/k");
    }

    #[test]
    fn headers_lowercased_sorted_trimmed_and_merged() {
        let headers = [
            ("X-Amz-Meta-B", "  two   words \t here "),
            ("Content-Type", "text/plain"),
            ("x-amz-meta-b", "second"),
            ("X-Amz-Date", "19990101T000000Z"),
            ("Host", "evil.example"),
        ];
        let query = [("z", "1"), ("a b", "x/y"), ("a b", "w")];
        let req = Request {
            method: "PUT",
            host: "127.0.0.1:9000",
            path: "/b/k",
            query: &query,
            headers: &headers,
            payload_sha256: "UNSIGNED-PAYLOAD",
        };
        let (canonical, _) = canonical_request(&req, "20240101T000000Z", Some(" tok "));
        let want = "PUT\n/b/k\na%20b=w&a%20b=x%2Fy&z=1\ncontent-type:text/plain\n\
             host:127.0.0.1:9000\nx-amz-content-sha256:UNSIGNED-PAYLOAD\n\
             x-amz-date:20240101T000000Z\nx-amz-meta-b:two words here,second\n\
             x-amz-security-token:tok\n\n\
             content-type;host;x-amz-content-sha256;x-amz-date;x-amz-meta-b;x-amz-security-token\n\
             UNSIGNED-PAYLOAD";
        assert_eq!(canonical, want);
    }

    #[test]
    fn session_token_is_sent_and_signed() {
        // Produced by botocore 1.44.8 (S3SigV4Auth.add_auth, clock fixed at
        // 2024-02-29T23:59:59Z) as an independent implementation, for
        // GET http://127.0.0.1:9000/redis-guard/k?list-type=2&prefix=a%2Fb%20c~
        let headers = [
            ("X-Amz-Meta-Note", "  a   b  c "),
            ("Content-Type", "text/plain"),
        ];
        let path = object_path("redis-guard", "k");
        let query = [("prefix", "a/b c~"), ("list-type", "2")];
        let req = Request {
            host: "127.0.0.1:9000",
            path: &path,
            query: &query,
            headers: &headers,
            ..base()
        };
        let out = sign_at(&req, Some("SESSION/TOKEN+x=="), 1_709_251_199);
        let want = ["x-amz-date", "x-amz-content-sha256", "x-amz-security-token"];
        assert_eq!(names(&out)[..3], want);
        assert_eq!(header(&out, "x-amz-security-token"), "SESSION/TOKEN+x==");
        assert_eq!(
            header(&out, "authorization"),
            "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20240229/us-east-1/s3/aws4_request, \
             SignedHeaders=content-type;host;x-amz-content-sha256;x-amz-date;x-amz-meta-note;\
             x-amz-security-token, \
             Signature=0c77eab50b975c007cd7b1abef739aa69597b7b60fab054289e7478b20214445"
        );
    }

    #[test]
    fn path_style_put_matches_botocore() {
        // Produced by botocore 1.44.8 (S3SigV4Auth.add_auth, clock fixed at
        // 2024-05-01T12:30:45Z) as an independent implementation, for
        // PUT http://127.0.0.1:9000/redis-guard/idem/x%20y with body "hello".
        let hash = sha256_hex(b"hello");
        let path = object_path("redis-guard", "idem/x y");
        assert_eq!(path, "/redis-guard/idem/x%20y");
        let headers = [("Content-Type", "application/octet-stream")];
        let req = Request {
            method: "PUT",
            host: "127.0.0.1:9000",
            path: &path,
            headers: &headers,
            payload_sha256: &hash,
            ..base()
        };
        let out = sign_at(&req, None, 1_714_566_645);
        assert_eq!(header(&out, "x-amz-date"), "20240501T123045Z");
        assert_eq!(
            header(&out, "authorization"),
            "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20240501/us-east-1/s3/aws4_request, \
             SignedHeaders=content-type;host;x-amz-content-sha256;x-amz-date, \
             Signature=df81453d053b6bbbe3413534b4e9d185f926768ec8ae9df6c54d69e136da0472"
        );
    }

    #[test]
    fn debug_redacts_secrets() {
        let shown = format!("{:?} {:?}", creds(Some("SESSION-TOKEN-VALUE")), creds(None));
        assert!(shown.contains(AKID) && shown.contains("<redacted>"));
        assert!(!shown.contains("bPxRfiCY") && !shown.contains("SESSION-TOKEN-VALUE"));
    }
}
