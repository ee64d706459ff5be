//! What the core needs to know of a request, without the host. The filter
//! implements [`RequestView`] over proxy-wasm; tests implement it over a map.

/// Read access to one request's headers (pseudo-headers included, raw bytes:
/// client headers need not be UTF-8) and its peer address.
pub trait RequestView {
    fn header(&self, name: &str) -> Option<Vec<u8>>;
    /// The downstream peer address as Envoy reports it (`ip:port`).
    fn client_address(&self) -> Option<String>;
    /// An Envoy attribute (`source.address` is `["source", "address"]`,
    /// dynamic metadata is under `["metadata", "filter_metadata", ns, ...]`)
    /// as the host serializes it; `None` when absent.
    fn property(&self, path: &[&str]) -> Option<Vec<u8>>;
}

/// The request line, read once per request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestLine {
    pub method: String,
    /// `:path` without the query string.
    pub path: Vec<u8>,
    /// `:authority`, lower-case, without port.
    pub host: String,
}

/// Which parts of the request line a configuration looks at: each one not
/// needed is a header read (a host call, a VM exit) saved on every request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Needs {
    pub method: bool,
    pub path: bool,
    pub host: bool,
}

impl Needs {
    pub const ALL: Needs = Needs {
        method: true,
        path: true,
        host: true,
    };
}

impl RequestLine {
    pub fn read(view: &dyn RequestView) -> RequestLine {
        RequestLine::read_needed(view, Needs::ALL)
    }

    /// The parts in `needs`; the others stay empty (nothing reads them).
    pub fn read_needed(view: &dyn RequestView, needs: Needs) -> RequestLine {
        let method = needs
            .method
            .then(|| view.header(":method"))
            .flatten()
            .map(|m| String::from_utf8_lossy(&m).to_ascii_uppercase())
            .unwrap_or_default();
        let mut path = needs
            .path
            .then(|| view.header(":path"))
            .flatten()
            .unwrap_or_default();
        if let Some(q) = path.iter().position(|&b| b == b'?') {
            path.truncate(q);
        }
        let authority = needs
            .host
            .then(|| view.header(":authority"))
            .flatten()
            .map(|a| String::from_utf8_lossy(&a).to_ascii_lowercase())
            .unwrap_or_default();
        RequestLine {
            method,
            path,
            host: strip_port(&authority).to_string(),
        }
    }
}

/// `host:port` → `host`; `[v6]:port` → `[v6]`; anything else unchanged.
pub fn strip_port(authority: &str) -> &str {
    if authority.starts_with('[') {
        return match authority.find(']') {
            Some(end) => &authority[..=end],
            None => authority,
        };
    }
    match authority.rfind(':') {
        Some(i) if authority[i + 1..].bytes().all(|b| b.is_ascii_digit()) => &authority[..i],
        _ => authority,
    }
}

/// Envoy's `source.address` is `ip:port`; a descriptor wants the ip.
pub fn client_ip(address: &str) -> &str {
    let host = strip_port(address);
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

/// The value of the first `name` parameter in the query string of `path`
/// (a whole `:path`), percent-decoded exactly once; a parameter without `=`
/// has the empty value. `+` stays `+` (no form decoding), and a `%` not
/// followed by two hex digits stays as it is. Names compare after decoding.
pub fn query_param(path: &[u8], name: &str) -> Option<Vec<u8>> {
    let q = path.iter().position(|&b| b == b'?')?;
    let query = &path[q + 1..];
    let query = query.split(|&b| b == b'#').next().unwrap_or(query);
    query
        .split(|&b| b == b'&')
        .filter(|pair| !pair.is_empty())
        .find_map(|pair| {
            let (key, value) = match pair.iter().position(|&b| b == b'=') {
                Some(i) => (&pair[..i], &pair[i + 1..]),
                None => (pair, &pair[pair.len()..]),
            };
            (percent_decode(key) == name.as_bytes()).then(|| percent_decode(value))
        })
}

fn percent_decode(raw: &[u8]) -> Vec<u8> {
    percent_encoding::percent_decode(raw).collect()
}

/// The service and method of a gRPC call: its `:path` is
/// `/<package.Service>/<Method>` and its content-type `application/grpc`
/// (or `application/grpc+proto`, `;` parameters allowed). `None` for any
/// other request, so a limit keyed on them does not apply to it.
pub fn grpc_call<'a>(path: &'a [u8], content_type: Option<&[u8]>) -> Option<(&'a [u8], &'a [u8])> {
    if !crate::grpc::is_grpc(content_type?) {
        return None;
    }
    let rest = path.strip_prefix(b"/")?;
    let slash = rest.iter().position(|&b| b == b'/')?;
    let (service, method) = (&rest[..slash], &rest[slash + 1..]);
    let clean = |s: &[u8]| !s.is_empty() && !s.iter().any(|&b| matches!(b, b'/' | b'?' | b'#'));
    (clean(service) && clean(method)).then_some((service, method))
}

/// The network of `ip` (as `client_ip` gives it): its first `v4` bits for
/// an IPv4 address (an IPv4-mapped IPv6 one included), its first `v6` bits
/// for IPv6, as `network/length` (`203.0.113.0/24`, `2001:db8:1:200::/56`).
/// `None` when `ip` is not an address.
pub fn address_prefix(ip: &str, v4: u8, v6: u8) -> Option<String> {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    let addr: IpAddr = ip.parse().ok()?;
    let addr = match addr {
        IpAddr::V6(a) => a.to_ipv4_mapped().map_or(addr, IpAddr::V4),
        v4 => v4,
    };
    Some(match addr {
        IpAddr::V4(a) => {
            let bits = u32::from(v4.min(32));
            let mask = u32::MAX.checked_shl(32 - bits).unwrap_or(0);
            format!("{}/{bits}", Ipv4Addr::from(u32::from(a) & mask))
        }
        IpAddr::V6(a) => {
            let bits = u32::from(v6.min(128));
            let mask = u128::MAX.checked_shl(128 - bits).unwrap_or(0);
            format!("{}/{bits}", Ipv6Addr::from(u128::from(a) & mask))
        }
    })
}

/// What an attribute or metadata value holds, as the config states it:
/// Envoy hands a value over as bytes without its type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ValueType {
    #[default]
    String,
    Number,
    Bool,
}

/// A value's descriptor text: a string as it is; a number (Envoy's 8-byte
/// double, as every JSON number in metadata is) in decimal, integers without
/// a fraction (`42`, `1.5`, `-0.25`); a bool as `true` / `false`. `Err`: the
/// value is not of that type; a list or an object (Envoy's serialized
/// pairs), or a number read as a string, holds NUL or control bytes, which
/// no string claim does.
pub fn typed_value(raw: Vec<u8>, ty: ValueType) -> Result<Vec<u8>, &'static str> {
    match ty {
        ValueType::String => {
            let text = std::str::from_utf8(&raw).map_err(|_| "not UTF-8 text")?;
            if text.chars().any(char::is_control) {
                return Err(
                    "not a string: a list, an object, or a number or bool read as a string",
                );
            }
            Ok(raw)
        }
        ValueType::Number => {
            let bytes: [u8; 8] = raw.try_into().map_err(|_| "not a number")?;
            let x = f64::from_le_bytes(bytes);
            if !x.is_finite() {
                return Err("not a finite number");
            }
            // Integers below 2^53 are exact doubles: print them as integers.
            if x.fract() == 0.0 && x.abs() < 9_007_199_254_740_992.0 {
                #[allow(clippy::cast_possible_truncation)]
                let n = x as i64;
                Ok(n.to_string().into_bytes())
            } else {
                Ok(x.to_string().into_bytes())
            }
        }
        ValueType::Bool => match raw.as_slice() {
            [0] => Ok(b"false".to_vec()),
            [1] => Ok(b"true".to_vec()),
            _ => Err("not a bool"),
        },
    }
}

#[cfg(test)]
pub mod fake {
    use super::RequestView;
    use std::collections::HashMap;

    /// A request for unit tests: headers by lower-case name.
    #[derive(Debug, Default, Clone)]
    pub struct FakeRequest {
        pub headers: HashMap<String, Vec<u8>>,
        pub address: Option<String>,
        /// Attributes by path, joined with `/`.
        pub properties: HashMap<String, Vec<u8>>,
    }

    impl FakeRequest {
        pub fn new(method: &str, path: &str) -> Self {
            FakeRequest::default()
                .with(":method", method.as_bytes())
                .with(":path", path.as_bytes())
                .with(":authority", b"api.example.com")
                .addr("10.1.2.3:5555")
        }
        pub fn with(mut self, name: &str, value: &[u8]) -> Self {
            self.headers.insert(name.to_string(), value.to_vec());
            self
        }
        pub fn addr(mut self, a: &str) -> Self {
            self.address = Some(a.to_string());
            self
        }
        pub fn prop(mut self, path: &[&str], value: &[u8]) -> Self {
            self.properties.insert(path.join("/"), value.to_vec());
            self
        }
    }

    impl RequestView for FakeRequest {
        fn header(&self, name: &str) -> Option<Vec<u8>> {
            self.headers.get(name).cloned()
        }
        fn client_address(&self) -> Option<String> {
            self.address.clone()
        }
        fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
            self.properties.get(&path.join("/")).cloned()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::fake::FakeRequest;
    use super::*;

    #[test]
    fn strips_ports_from_authorities_and_addresses() {
        assert_eq!(strip_port("api.example.com:8080"), "api.example.com");
        assert_eq!(strip_port("api.example.com"), "api.example.com");
        assert_eq!(strip_port("[::1]:443"), "[::1]");
        assert_eq!(client_ip("[::1]:443"), "::1");
        assert_eq!(client_ip("127.0.0.1:5000"), "127.0.0.1");
    }

    #[test]
    fn request_line_drops_the_query_and_normalises_case() {
        let r = FakeRequest::new("post", "/a/b?x=1").with(":authority", b"API.Example.com:80");
        let line = RequestLine::read(&r);
        assert_eq!(line.method, "POST");
        assert_eq!(line.path, b"/a/b");
        assert_eq!(line.host, "api.example.com");
    }

    #[test]
    fn a_query_parameter_is_its_first_value_percent_decoded_once() {
        let q = |path: &str, name: &str| query_param(path.as_bytes(), name);
        assert_eq!(q("/a?key=k1&key=k2", "key"), Some(b"k1".to_vec()));
        assert_eq!(q("/a?x=1&key=a%20b", "key"), Some(b"a b".to_vec()));
        // Once: %2520 is %20, not a space.
        assert_eq!(q("/a?key=%2520", "key"), Some(b"%20".to_vec()));
        assert_eq!(
            q("/a?key=a+b", "key"),
            Some(b"a+b".to_vec()),
            "no form decoding"
        );
        assert_eq!(q("/a?key=%zz%4", "key"), Some(b"%zz%4".to_vec()));
        assert_eq!(q("/a?key=%FF", "key"), Some(vec![0xff]));
        assert_eq!(q("/a?flag&key", "key"), Some(vec![]));
        assert_eq!(q("/a?%6Bey=v", "key"), Some(b"v".to_vec()), "names decoded");
        assert_eq!(q("/a?key=v#frag", "key"), Some(b"v".to_vec()));
        assert_eq!(q("/a?keys=v&ke=w", "key"), None);
        assert_eq!(q("/a?Key=v", "key"), None, "names are case-sensitive");
        assert_eq!(q("/a", "key"), None);
    }

    #[test]
    fn a_grpc_call_is_its_service_and_method_when_the_request_is_grpc() {
        let grpc = Some(&b"application/grpc"[..]);
        assert_eq!(
            grpc_call(b"/shop.v1.Orders/Create", grpc),
            Some((&b"shop.v1.Orders"[..], &b"Create"[..]))
        );
        assert!(grpc_call(b"/a.S/M", Some(b"application/grpc+proto")).is_some());
        // What Envoy does not take for gRPC is not a gRPC call here either.
        for ct in [
            "application/grpc; charset=x",
            "Application/GRPC",
            "application/json",
            "application/grpc-web",
            "application/grpcx",
        ] {
            assert_eq!(grpc_call(b"/a.S/M", Some(ct.as_bytes())), None, "{ct}");
        }
        assert_eq!(grpc_call(b"/a.S/M", None), None);
        for path in ["/a.S", "/a.S/", "//M", "/a.S/M/x", "/a.S/M?x=1", "a.S/M"] {
            assert_eq!(grpc_call(path.as_bytes(), grpc), None, "{path}");
        }
    }

    #[test]
    fn a_typed_value_is_its_canonical_text_or_an_error() {
        use ValueType::*;
        assert_eq!(
            typed_value(b"alice".to_vec(), String),
            Ok(b"alice".to_vec())
        );
        assert_eq!(typed_value("zoë".into(), String), Ok("zoë".into()));
        // Numbers and bools as Envoy sends them, read as strings: refused.
        assert!(typed_value(42f64.to_le_bytes().to_vec(), String).is_err());
        assert!(typed_value(vec![1], String).is_err());
        // A list and an object (Envoy's pairs): refused whatever the type.
        let list = b"\x02\0\0\0\x01\0\0\0\0\0\0\0\x01\0\0\0\0\0\0\0a\0\0b\0\0".to_vec();
        let object = b"\x01\0\0\0\x02\0\0\0\x04\0\0\0id\0acme\0".to_vec();
        for ty in [String, Number, Bool] {
            assert!(typed_value(list.clone(), ty).is_err(), "{ty:?}");
            assert!(typed_value(object.clone(), ty).is_err(), "{ty:?}");
        }
        assert!(typed_value(vec![0xff, 0xfe], String).is_err());
        let num = |x: f64| typed_value(x.to_le_bytes().to_vec(), Number);
        assert_eq!(num(42.0), Ok(b"42".to_vec()));
        assert_eq!(num(-7.0), Ok(b"-7".to_vec()));
        assert_eq!(num(1.5), Ok(b"1.5".to_vec()));
        assert_eq!(num(-0.25), Ok(b"-0.25".to_vec()));
        assert_eq!(num(0.0), Ok(b"0".to_vec()));
        assert_eq!(
            num(9_007_199_254_740_992.0),
            Ok(b"9007199254740992".to_vec())
        );
        assert!(num(f64::NAN).is_err());
        assert!(
            typed_value(b"42".to_vec(), Number).is_err(),
            "a string is not a number"
        );
        assert_eq!(typed_value(vec![1], Bool), Ok(b"true".to_vec()));
        assert_eq!(typed_value(vec![0], Bool), Ok(b"false".to_vec()));
        assert!(typed_value(b"true".to_vec(), Bool).is_err());
    }

    #[test]
    fn an_address_prefix_is_the_masked_network_of_either_family() {
        let p = |ip: &str| address_prefix(ip, 24, 56);
        assert_eq!(p("203.0.113.77").as_deref(), Some("203.0.113.0/24"));
        assert_eq!(p("::ffff:203.0.113.77").as_deref(), Some("203.0.113.0/24"));
        assert_eq!(
            p("2001:db8:1:2ff:aaaa::1").as_deref(),
            Some("2001:db8:1:200::/56")
        );
        assert_eq!(p("::1").as_deref(), Some("::/56"));
        assert_eq!(
            address_prefix("10.1.2.3", 0, 0).as_deref(),
            Some("0.0.0.0/0")
        );
        assert_eq!(
            address_prefix("10.1.2.3", 32, 128).as_deref(),
            Some("10.1.2.3/32")
        );
        assert_eq!(
            address_prefix("2001:db8::1", 24, 128).as_deref(),
            Some("2001:db8::1/128")
        );
        assert_eq!(p("not-an-address"), None);
    }
}
