//! A load generator for a remote cache server: clients in parallel, each on one keep-alive
//! connection, sending a mix of uploads of new blobs (sizes log-uniform between two bounds),
//! reads of blobs it uploaded (which must come back unchanged) and reads of missing entries
//! (which must be 404), checking every answer.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// What a load run saw.
#[derive(Clone, Debug, Default)]
pub struct LoadReport {
    /// Requests sent.
    pub requests: u64,
    /// Requests whose answer was not the expected one (or failed).
    pub errors: u64,
    /// Bytes uploaded and downloaded.
    pub bytes: u64,
    /// Wall time of the run, s.
    pub seconds: f64,
    /// Latencies, s, sorted.
    pub latencies: Vec<f64>,
}

impl LoadReport {
    /// Requests per second.
    pub fn rate(&self) -> f64 {
        self.requests as f64 / self.seconds.max(f64::MIN_POSITIVE)
    }

    /// The `q` quantile of latency, s.
    pub fn quantile(&self, q: f64) -> f64 {
        if self.latencies.is_empty() {
            return 0.0;
        }
        let i = ((self.latencies.len() - 1) as f64 * q).round() as usize;
        self.latencies[i]
    }
}

/// How long each client goes on.
#[derive(Clone, Copy, Debug)]
pub enum Length {
    /// This many requests.
    Requests(usize),
    /// For this long.
    Time(Duration),
}

/// The mix of one run.
#[derive(Clone, Copy, Debug)]
pub struct Mix {
    /// Concurrent clients.
    pub clients: usize,
    /// How long each goes on.
    pub length: Length,
    /// Smallest blob uploaded, bytes.
    pub min_blob: usize,
    /// Largest blob uploaded, bytes.
    pub max_blob: usize,
}

fn sha256_hex(bytes: &[u8]) -> String {
    autopar_engine::server::sha256_hex(bytes)
}

/// One client's keep-alive connection.
struct Connection {
    addr: String,
    reader: Option<BufReader<TcpStream>>,
}

impl Connection {
    fn stream(&mut self) -> Option<&mut BufReader<TcpStream>> {
        if self.reader.is_none() {
            let s = TcpStream::connect(&self.addr).ok()?;
            s.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
            let _ = s.set_nodelay(true);
            self.reader = Some(BufReader::new(s));
        }
        self.reader.as_mut()
    }

    /// One request: the status code and the body; the connection is dropped on any failure.
    fn request(&mut self, method: &str, path: &str, body: &[u8]) -> Option<(u16, Vec<u8>)> {
        let answer = self.exchange(method, path, body);
        if answer.is_none() {
            self.reader = None;
        }
        answer
    }

    fn exchange(&mut self, method: &str, path: &str, body: &[u8]) -> Option<(u16, Vec<u8>)> {
        let addr = self.addr.clone();
        let r = self.stream()?;
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        r.get_mut().write_all(head.as_bytes()).ok()?;
        r.get_mut().write_all(body).ok()?;
        let mut line = String::new();
        r.read_line(&mut line).ok()?;
        let code: u16 = line.split_whitespace().nth(1)?.parse().ok()?;
        let mut length = 0usize;
        loop {
            line.clear();
            r.read_line(&mut line).ok()?;
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some((k, v)) = l.split_once(':')
                && k.eq_ignore_ascii_case("content-length")
            {
                length = v.trim().parse().ok()?;
            }
        }
        let mut out = vec![0u8; if method == "HEAD" { 0 } else { length }];
        r.read_exact(&mut out).ok()?;
        Some((code, out))
    }
}

/// A small deterministic generator (xorshift), one per client.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A size log-uniform between `lo` and `hi`.
    fn size(&mut self, lo: usize, hi: usize) -> usize {
        let u = (self.next() % 1_000_000) as f64 / 1_000_000.0;
        let (a, b) = ((lo.max(1) as f64).ln(), (hi.max(lo).max(1) as f64).ln());
        (a + u * (b - a)).exp().round() as usize
    }
}

/// Runs `mix` against the server at `addr`: in turn per client, an upload of a new blob, a read
/// of one of its last eight blobs, another upload, another read, and every tenth request a read
/// of a key nobody stored.
pub fn run(addr: &str, mix: Mix) -> LoadReport {
    let start = Instant::now();
    let handles: Vec<_> = (0..mix.clients)
        .map(|c| {
            let addr = addr.to_string();
            std::thread::spawn(move || {
                let mut conn = Connection { addr, reader: None };
                let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (c as u64 + 1).wrapping_mul(0x1000_0001));
                let mut recent: Vec<(String, Vec<u8>)> = Vec::new();
                let (mut lat, mut errors, mut bytes) = (Vec::new(), 0u64, 0u64);
                let mut i = 0usize;
                loop {
                    match mix.length {
                        Length::Requests(n) if i >= n => break,
                        Length::Time(d) if start.elapsed() >= d => break,
                        _ => {}
                    }
                    let t0 = Instant::now();
                    let ok = if i % 10 == 9 {
                        let missing = sha256_hex(format!("missing {c} {i}").as_bytes());
                        conn.request("GET", &format!("/ac/{missing}"), b"")
                            .is_some_and(|r| r.0 == 404)
                    } else if i % 2 == 0 || recent.is_empty() {
                        let size = rng.size(mix.min_blob, mix.max_blob);
                        let seed = rng.next();
                        let body: Vec<u8> = (0..size)
                            .map(|k| (seed.wrapping_add(k as u64 * 0x9e37_79b9) >> 24) as u8)
                            .collect();
                        let name = sha256_hex(&body);
                        bytes += body.len() as u64;
                        let ok = conn
                            .request("PUT", &format!("/cas/{name}"), &body)
                            .is_some_and(|r| r.0 == 200);
                        if recent.len() == 8 {
                            recent.remove(0);
                        }
                        recent.push((name, body));
                        ok
                    } else {
                        let (name, body) = &recent[(rng.next() as usize) % recent.len()];
                        bytes += body.len() as u64;
                        conn.request("GET", &format!("/cas/{name}"), b"")
                            .is_some_and(|r| r.0 == 200 && &r.1 == body)
                    };
                    lat.push(t0.elapsed().as_secs_f64());
                    errors += u64::from(!ok);
                    i += 1;
                }
                (lat, errors, bytes)
            })
        })
        .collect();
    let mut report = LoadReport::default();
    for h in handles {
        match h.join() {
            Ok((lat, errors, bytes)) => {
                report.requests += lat.len() as u64;
                report.errors += errors;
                report.bytes += bytes;
                report.latencies.extend(lat);
            }
            Err(_) => report.errors += 1,
        }
    }
    report.seconds = start.elapsed().as_secs_f64();
    report.latencies.sort_by(f64::total_cmp);
    report
}
