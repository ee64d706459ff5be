//! What the README's promises are checked against beyond the filter's own
//! counters: Envoy's process, its Prometheus scrape (every series, the
//! latency histogram), an Envoy that refuses its configuration, raw HTTP/1.1
//! on one kept-alive connection (response header values that are not UTF-8,
//! one Envoy worker on purpose), a stand-in that makes Webdis refuse an
//! exact number of calls, and bounded polling instead of sleeps.

use super::*;

/// How much earlier than the client's own clock says an Envoy timer can
/// fire (a callout timeout, a retry pause): Envoy arms its timers from the
/// time its event loop cached when the loop iteration began (libevent reads
/// the clock once per iteration) and sleeps in whole milliseconds. A 400 ms
/// callout timeout was seen to end 397 ms after the client sent the request.
/// Client-side lower bounds at a timer subtract this; the exact evidence is
/// the filter's own stats.
pub const ENVOY_TIMER_GRANULARITY: Duration = Duration::from_millis(20);

/// The callout latency histogram (microseconds, Envoy's clock).
pub const LATENCY: &str = "redis_guard_redis_callout_latency_us";

/// Envoy with the filter whose stats are flushed every 100 ms (5 s by
/// default), so a test waits briefly for histogram samples to be merged.
pub fn envoy_flushing_stats(filter_config: &str, webdis_port: u16, upstream_port: u16) -> Envoy {
    Envoy::start_edited(filter_config, webdis_port, upstream_port, |yaml| {
        format!("stats_flush_interval: 0.1s\n{yaml}")
    })
}

/// Calls `check` every 10 ms until it gives a value, for at most `limit`;
/// panics naming `what` otherwise. The one way the tests wait for a state.
pub fn poll<T>(what: &str, limit: Duration, check: impl FnMut() -> Option<T>) -> T {
    poll_every(what, limit, Duration::from_millis(10), check)
}

/// The same, looking every `every` (for checks that cost the server work).
pub fn poll_every<T>(
    what: &str,
    limit: Duration,
    every: Duration,
    mut check: impl FnMut() -> Option<T>,
) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = check() {
            return v;
        }
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(every);
    }
}

/// Polls until `get()` equals `want` (bounded), then returns it.
pub fn poll_eq<T: PartialEq + std::fmt::Debug>(
    what: &str,
    want: T,
    limit: Duration,
    mut get: impl FnMut() -> T,
) {
    let start = Instant::now();
    loop {
        let got = get();
        if got == want {
            return;
        }
        assert!(
            start.elapsed() < limit,
            "{what}: still {got:?} after {limit:?}, want {want:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The rate-limit fields of a response (IETF draft and X-RateLimit-*).
pub fn rate_limit_fields(headers: &[(String, String)]) -> Vec<String> {
    headers
        .iter()
        .map(|(n, _)| n.to_ascii_lowercase())
        .filter(|n| n.starts_with("ratelimit") || n.starts_with("x-ratelimit"))
        .collect()
}

impl Envoy {
    /// The Envoy process' id.
    pub fn pid(&self) -> u32 {
        self.proc.child.as_ref().expect("envoy not running").id()
    }

    /// Whether the Envoy process is still alive (not exited, not restarted).
    pub fn alive(&mut self) -> bool {
        self.proc.is_running()
    }

    /// How long this Envoy process has been up, from its admin
    /// `/server_info` (live; the `server.uptime` stat moves only on a stats
    /// flush). A restarted Envoy starts again from zero.
    pub fn uptime(&self) -> Duration {
        let info = get(
            &format!("http://127.0.0.1:{}/server_info", self.admin_port),
            &[],
        )
        .json();
        assert_eq!(info["state"], "LIVE", "{info}");
        let secs = info["uptime_current_epoch"]
            .as_str()
            .and_then(|s| s.strip_suffix('s'))
            .unwrap_or_else(|| panic!("no uptime in {info}"));
        Duration::from_secs_f64(secs.parse().unwrap())
    }
}

/// An Envoy that exited at start-up: how, what it logged, and the listener
/// port it was given.
pub struct Refused {
    pub status: std::process::ExitStatus,
    pub log: String,
    pub port: u16,
}

/// Starts Envoy with `filter_config` as the harness does, but expects it to
/// refuse the configuration: waits (bounded to 30 s) for the process to exit
/// and never for readiness. Fails the test if Envoy is still running then.
pub fn envoy_refusing(filter_config: &str) -> Refused {
    let dir = Scratch::new("envoy-refused");
    let port = free_port();
    let yaml = render(
        "envoy/envoy.yaml",
        &[
            ("ADMIN_PORT", free_port().to_string()),
            ("LISTEN_PORT", port.to_string()),
            // Nothing listens on these: the filter must fail before any call.
            ("UPSTREAM_PORT", free_port().to_string()),
            ("WEBDIS_PORT", free_port().to_string()),
            ("OBJECT_STORE_PORT", free_port().to_string()),
            ("WASM_PATH", wasm_path().display().to_string()),
            (
                "FILTER_CONFIG",
                serde_json::to_string(&with_test_credentials(filter_config)).unwrap(),
            ),
        ],
    );
    let conf = dir.0.join("envoy.yaml");
    std::fs::write(&conf, yaml).unwrap();
    let (status, log) = run_to_exit(
        "envoy with a bad filter config",
        Command::new(envoy_bin())
            .arg("-c")
            .arg(&conf)
            .args(["--concurrency", "2", "--disable-hot-restart"])
            .args(["--log-level", "warn"]),
        &dir.0.join("envoy.log"),
        Duration::from_secs(30),
    );
    Refused { status, log, port }
}

/// A response read byte for byte: header values as sent, not as text.
#[derive(Debug, Clone)]
pub struct RawResp {
    pub status: u16,
    /// Names lowercased, in the order received.
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Vec<u8>,
}

impl RawResp {
    /// Every value of a header, in order.
    pub fn values(&self, name: &str) -> Vec<&[u8]> {
        self.headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_slice())
            .collect()
    }

    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.values(name).first().copied()
    }
}

/// One kept-alive HTTP/1.1 connection to a port: every request on it is
/// served by the same Envoy worker. Panics if the server closes it.
pub struct RawConn {
    stream: std::io::BufReader<TcpStream>,
}

impl RawConn {
    pub fn open(port: u16) -> RawConn {
        let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
        RawConn {
            stream: std::io::BufReader::new(s),
        }
    }

    pub fn send(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &[u8])],
        body: &[u8],
    ) -> RawResp {
        use std::io::BufRead;
        let length = format!("content-length: {}\r\n", body.len());
        let req = super::raw_request_bytes(method, path, &length, headers, body);
        self.stream.get_mut().write_all(&req).unwrap();

        let mut line = Vec::new();
        let mut read_line = |stream: &mut std::io::BufReader<TcpStream>| {
            line.clear();
            let n = stream.read_until(b'\n', &mut line).unwrap();
            assert!(n > 0, "connection closed by the server");
            line.strip_suffix(b"\r\n").unwrap_or(&line).to_vec()
        };
        let status_line = String::from_utf8(read_line(&mut self.stream)).unwrap();
        let status = status_line.split(' ').nth(1).unwrap().parse().unwrap();
        let mut headers = Vec::new();
        loop {
            let l = read_line(&mut self.stream);
            if l.is_empty() {
                break;
            }
            let colon = l.iter().position(|b| *b == b':').unwrap();
            let name = String::from_utf8(l[..colon].to_vec())
                .unwrap()
                .to_ascii_lowercase();
            let value = l[colon + 1..].trim_ascii().to_vec();
            headers.push((name, value));
        }
        let header = |name: &str| {
            headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| String::from_utf8_lossy(v).to_string())
        };
        let mut body = Vec::new();
        if let Some(len) = header("content-length") {
            body.resize(len.parse().unwrap(), 0);
            self.stream.read_exact(&mut body).unwrap();
        } else if header("transfer-encoding").as_deref() == Some("chunked") {
            loop {
                let size = String::from_utf8(read_line(&mut self.stream)).unwrap();
                let size =
                    usize::from_str_radix(size.split(';').next().unwrap().trim(), 16).unwrap();
                let mut chunk = vec![0; size + 2];
                self.stream.read_exact(&mut chunk).unwrap();
                if size == 0 {
                    break;
                }
                body.extend_from_slice(&chunk[..size]);
            }
        }
        RawResp {
            status,
            headers,
            body,
        }
    }
}

/// One request on a connection of its own.
pub fn raw_request(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &[u8])],
    body: &[u8],
) -> RawResp {
    RawConn::open(port).send(method, path, headers, body)
}

/// One Prometheus scrape of an Envoy (`/stats/prometheus`): (metric name,
/// labels as `k="v",...`) -> value. Remembers which series a test read, so
/// it can also assert that no other series of a family was there.
pub struct Scrape {
    pub values: std::collections::BTreeMap<(String, String), f64>,
    pub text: String,
    read: std::cell::RefCell<std::collections::BTreeSet<(String, String)>>,
}

impl Scrape {
    pub fn take(envoy: &Envoy) -> Scrape {
        let r = get(
            &format!("http://127.0.0.1:{}/stats/prometheus", envoy.admin_port),
            &[],
        );
        assert_eq!(r.status, 200);
        let text = String::from_utf8(r.body).unwrap();
        let mut values = std::collections::BTreeMap::new();
        for line in text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
        {
            let (series, value) = line.rsplit_once(' ').unwrap();
            let (name, labels) = match series.split_once('{') {
                Some((n, rest)) => (n, rest.trim_end_matches('}')),
                None => (series, ""),
            };
            values.insert(
                (name.to_string(), labels.to_string()),
                value.parse().unwrap(),
            );
        }
        Scrape {
            values,
            text,
            read: Default::default(),
        }
    }

    /// The value of a series, marked as read; panics (showing the filter's
    /// lines) if absent.
    pub fn value(&self, name: &str, labels: &str) -> f64 {
        let key = (name.to_string(), labels.to_string());
        match self.values.get(&key) {
            Some(v) => {
                self.read.borrow_mut().insert(key);
                *v
            }
            None => panic!(
                "no series {name}{{{labels}}} in:\n{}",
                self.text
                    .lines()
                    .filter(|l| l.contains("redis_guard"))
                    .collect::<Vec<_>>()
                    .join("\n")
            ),
        }
    }

    /// A counter or gauge.
    pub fn get(&self, name: &str, labels: &str) -> u64 {
        self.value(name, labels) as u64
    }

    pub fn type_of(&self, name: &str) -> Option<&str> {
        self.text
            .lines()
            .find_map(|l| l.strip_prefix(&format!("# TYPE {name} ")))
    }

    /// A histogram's buckets as (upper bound, cumulative count), its sample
    /// count and sum, all marked as read. The buckets must be cumulative and
    /// end at `+Inf` with the count.
    pub fn histogram(&self, name: &str) -> (Vec<(f64, u64)>, u64, f64) {
        let prefix = "le=\"";
        let mut buckets: Vec<(f64, u64)> = self
            .values
            .keys()
            .filter(|(n, _)| *n == format!("{name}_bucket"))
            .map(|(n, labels)| {
                let le = labels
                    .strip_prefix(prefix)
                    .and_then(|l| l.strip_suffix('"'))
                    .unwrap();
                let bound = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().unwrap()
                };
                (bound, self.get(n, labels))
            })
            .collect();
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        let count = self.get(&format!("{name}_count"), "");
        let sum = self.value(&format!("{name}_sum"), "");
        assert!(buckets.windows(2).all(|w| w[0].1 <= w[1].1), "{buckets:?}");
        assert_eq!(buckets.last(), Some(&(f64::INFINITY, count)));
        (buckets, count, sum)
    }

    /// Every series whose name starts with `prefix` that the test never read.
    pub fn unread(&self, prefix: &str) -> Vec<String> {
        let read = self.read.borrow();
        self.values
            .keys()
            .filter(|k| k.0.starts_with(prefix) && !read.contains(*k))
            .map(|(n, l)| format!("{n}{{{l}}}"))
            .collect()
    }
}

/// Scrapes until the histogram `name` holds `want` samples (bounded to
/// 15 s): Envoy merges histograms only on its stats flush.
pub fn scrape_with_samples(envoy: &Envoy, name: &str, want: u64) -> Scrape {
    poll_every(
        &format!("{want} samples in {name}"),
        Duration::from_secs(15),
        Duration::from_millis(200),
        || {
            let s = Scrape::take(envoy);
            let count = s
                .values
                .get(&(format!("{name}_count"), String::new()))
                .copied()
                .unwrap_or(0.0) as u64;
            (count >= want).then_some(s)
        },
    )
}

/// Reads one HTTP/1.1 message (head and a `content-length` body) whole;
/// `None` when the peer closed the connection first.
pub fn read_message(stream: &mut std::io::BufReader<TcpStream>) -> Option<Vec<u8>> {
    use std::io::BufRead;
    let mut message = Vec::new();
    let mut length = 0;
    loop {
        let start = message.len();
        if stream.read_until(b'\n', &mut message).ok()? == 0 {
            return None;
        }
        let line = String::from_utf8_lossy(&message[start..]).to_ascii_lowercase();
        if let Some(v) = line.strip_prefix("content-length:") {
            length = v.trim().parse().ok()?;
        }
        if line == "\r\n" {
            break;
        }
    }
    let start = message.len();
    message.resize(start + length, 0);
    stream.read_exact(&mut message[start..]).ok()?;
    Some(message)
}

/// What a stand-in in front of Webdis answers one call with: given the
/// request, and a way to have Webdis answer it.
type Serve = dyn Fn(&[u8], &mut dyn FnMut(&[u8]) -> Vec<u8>) -> Vec<u8> + Send + Sync;

/// Listens on a free port in front of Webdis and answers each HTTP exchange
/// as `serve` says; returns the port. Threads end with the test process;
/// each serves one connection, with its own connection to Webdis.
fn relay(webdis_port: u16, serve: std::sync::Arc<Serve>) -> u16 {
    let port = free_port();
    let listener = TcpListener::bind(("127.0.0.1", port)).unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { continue };
            let serve = std::sync::Arc::clone(&serve);
            std::thread::spawn(move || {
                let mut out = conn.try_clone().unwrap();
                let mut from_envoy = std::io::BufReader::new(conn);
                let mut to_webdis: Option<(TcpStream, std::io::BufReader<TcpStream>)> = None;
                while let Some(request) = read_message(&mut from_envoy) {
                    let mut webdis = |request: &[u8]| {
                        let (w, r) = to_webdis.get_or_insert_with(|| {
                            let s = TcpStream::connect(("127.0.0.1", webdis_port)).unwrap();
                            (s.try_clone().unwrap(), std::io::BufReader::new(s))
                        });
                        w.write_all(request).unwrap();
                        read_message(r).expect("webdis closed the connection")
                    };
                    if out.write_all(&serve(&request, &mut webdis)).is_err() {
                        return;
                    }
                }
            });
        }
    });
    port
}

/// A stand-in in front of Webdis: the first `refuse` calls it answers itself
/// as Webdis does while it has no Redis connection (503, `server: Webdis`:
/// the command never ran), every later one it passes to Webdis. So a test
/// knows exactly which calls met the refusal, whatever the timing.
pub struct WebdisRefusingFirst {
    pub port: u16,
    calls: std::sync::Arc<AtomicUsize>,
}

impl WebdisRefusingFirst {
    pub fn start(webdis_port: u16, refuse: usize) -> WebdisRefusingFirst {
        let calls = std::sync::Arc::new(AtomicUsize::new(0));
        let seen = std::sync::Arc::clone(&calls);
        let port = relay(
            webdis_port,
            std::sync::Arc::new(move |request, webdis| {
                if seen.fetch_add(1, Ordering::SeqCst) < refuse {
                    let refusal = "HTTP/1.1 503 Service Unavailable\r\n\
                         Server: Webdis\r\nContent-Length: 0\r\n\r\n";
                    return refusal.as_bytes().to_vec();
                }
                webdis(request)
            }),
        );
        WebdisRefusingFirst { port, calls }
    }

    /// Calls received so far (refused or passed on).
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

/// A stand-in in front of Webdis that passes every exchange on, except
/// that, once armed, it answers the next call with the reply Webdis gave
/// the call before it (which it still passes on): what Webdis 0.1.9 does
/// when it writes a connection's late reply to a socket another connection
/// has since been given (README, When things fail), played on demand.
pub struct WebdisReplaying {
    pub port: u16,
    armed: std::sync::Arc<std::sync::atomic::AtomicBool>,
    armed_eval: std::sync::Arc<std::sync::atomic::AtomicBool>,
    replayed: std::sync::Arc<AtomicUsize>,
}

impl WebdisReplaying {
    pub fn start(webdis_port: u16) -> WebdisReplaying {
        let armed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let armed_eval = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let replayed = std::sync::Arc::new(AtomicUsize::new(0));
        // The last reply, and the last reply to an EVAL.
        type Replies = (Option<Vec<u8>>, Option<Vec<u8>>);
        let last: std::sync::Mutex<Replies> = std::sync::Mutex::new((None, None));
        let (a, e, r) = (
            std::sync::Arc::clone(&armed),
            std::sync::Arc::clone(&armed_eval),
            std::sync::Arc::clone(&replayed),
        );
        let port = relay(
            webdis_port,
            std::sync::Arc::new(move |request, webdis| {
                let eval = request.windows(9).any(|w| w == b"\r\n\r\nEVAL/");
                let reply = webdis(request);
                let mut last = last.lock().unwrap();
                let old = if eval && e.load(Ordering::SeqCst) {
                    last.1.clone().filter(|_| e.swap(false, Ordering::SeqCst))
                } else {
                    last.0.clone().filter(|_| a.swap(false, Ordering::SeqCst))
                };
                if eval {
                    last.1 = Some(reply.clone());
                }
                last.0 = Some(reply.clone());
                match old {
                    Some(old) => {
                        r.fetch_add(1, Ordering::SeqCst);
                        old
                    }
                    None => reply,
                }
            }),
        );
        WebdisReplaying {
            port,
            armed,
            armed_eval,
            replayed,
        }
    }

    /// The next call gets the previous call's reply.
    pub fn arm(&self) {
        self.armed.store(true, Ordering::SeqCst);
    }

    /// The next EVAL (a call sent again with its script's source after a
    /// NOSCRIPT) gets the reply the previous EVAL got.
    pub fn arm_eval(&self) {
        self.armed_eval.store(true, Ordering::SeqCst);
    }

    /// Calls answered with another's reply so far.
    pub fn replayed(&self) -> usize {
        self.replayed.load(Ordering::SeqCst)
    }
}
