//! What the core needs to know of a request, without the host. The filter
//! implements [`RequestView`] over proxy-wasm; tests implement it over a map.

/// Read access to one request's headers (pseudo-headers included, raw bytes:
/// client headers need not be UTF-8) and its peer address.
pub trait RequestView {
    fn header(&self, name: &str) -> Option<Vec<u8>>;
    /// The downstream peer address as Envoy reports it (`ip:port`).
    fn client_address(&self) -> Option<String>;
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
    let hex = |b: u8| (b as char).to_digit(16);
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        if raw[i] == b'%' && i + 2 < raw.len() {
            if let (Some(h), Some(l)) = (hex(raw[i + 1]), hex(raw[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(raw[i]);
        i += 1;
    }
    out
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

#[cfg(test)]
pub mod fake {
    use super::RequestView;
    use std::collections::HashMap;

    /// A request for unit tests: headers by lower-case name.
    #[derive(Debug, Default, Clone)]
    pub struct FakeRequest {
        pub headers: HashMap<String, Vec<u8>>,
        pub address: Option<String>,
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
    }

    impl RequestView for FakeRequest {
        fn header(&self, name: &str) -> Option<Vec<u8>> {
            self.headers.get(name).cloned()
        }
        fn client_address(&self) -> Option<String> {
            self.address.clone()
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
