//! Response statuses a rule counts: HTTP classes (`4xx`) and codes (`401`),
//! and gRPC status names (`UNAUTHENTICATED`), for limits charged only for
//! the responses they count (failed logins, a partner's `5xx`).

use crate::grpc;

/// HTTP statuses by class (`4xx`) and exact code (`401`): what an
/// idempotency rule stores, what a response-counted limit counts.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct HttpStatuses {
    /// 4 for `4xx`.
    classes: Vec<u32>,
    exact: Vec<u32>,
}

impl HttpStatuses {
    /// Adds `entry` if it is a class (`2xx` to `5xx`) or a status from 200
    /// to 599; false (nothing added) otherwise.
    pub fn add(&mut self, entry: &str) -> bool {
        let b = entry.as_bytes();
        if b.len() == 3 && b"2345".contains(&b[0]) && &b[1..] == b"xx" {
            self.classes.push(u32::from(b[0] - b'0'));
            return true;
        }
        let code = (b.len() == 3 && b.iter().all(u8::is_ascii_digit))
            .then(|| entry.parse::<u32>().ok())
            .flatten()
            .filter(|c| (200..600).contains(c));
        match code {
            Some(code) => {
                self.exact.push(code);
                true
            }
            None => false,
        }
    }

    pub fn contains(&self, status: u32) -> bool {
        self.exact.contains(&status) || self.classes.contains(&(status / 100))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StatusSet {
    http: HttpStatuses,
    grpc: Vec<u32>,
}

impl StatusSet {
    /// Parses each entry, or says which one is wrong and why: an entry that
    /// names no status a response can have is refused (`6xx`, `1xx`, `600`,
    /// `unauthenticated`), since it would silently count nothing.
    pub fn parse(list: &[String]) -> Result<StatusSet, (usize, String)> {
        let mut set = StatusSet::default();
        for (i, entry) in list.iter().enumerate() {
            if set.http.add(entry) {
                continue;
            }
            if let Some(code) = grpc::code_of(entry) {
                set.grpc.push(code);
            } else {
                return Err((
                    i,
                    format!(
                        "`{entry}` is neither an HTTP class (2xx to 5xx), an HTTP status (200 to 599) nor a gRPC status name (UNAUTHENTICATED, PERMISSION_DENIED, ...)"
                    ),
                ));
            }
        }
        if list.is_empty() {
            return Err((0, "must name at least one status".to_string()));
        }
        Ok(set)
    }

    /// Whether an HTTP response with `status` counts.
    pub fn counts_http(&self, status: u32) -> bool {
        self.http.contains(status)
    }

    /// Whether a gRPC response ending with `code` counts.
    pub fn counts_grpc(&self, code: u32) -> bool {
        self.grpc.contains(&code)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(list: &[&str]) -> Result<StatusSet, (usize, String)> {
        StatusSet::parse(&list.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn classes_codes_and_grpc_names_count_their_responses_only() {
        let s = set(&["401", "5xx", "UNAUTHENTICATED"]).unwrap();
        assert!(s.counts_http(401));
        assert!(!s.counts_http(403));
        assert!(s.counts_http(500) && s.counts_http(503));
        assert!(!s.counts_http(200));
        assert!(s.counts_grpc(16));
        assert!(!s.counts_grpc(0) && !s.counts_grpc(7));
    }

    #[test]
    fn an_entry_that_names_no_status_is_refused_by_its_index() {
        for bad in [
            "6xx",
            "1xx",
            "600",
            "199",
            "4XX",
            "unauthenticated",
            "",
            "40",
        ] {
            let (i, why) = set(&["401", bad]).unwrap_err();
            assert_eq!(i, 1, "{bad}");
            assert!(why.contains("neither"), "{bad}: {why}");
        }
        assert!(set(&[]).unwrap_err().1.contains("at least one"));
    }
}
