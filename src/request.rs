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
}
