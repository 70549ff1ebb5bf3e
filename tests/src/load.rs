//! A load generator for a remote cache server: clients in parallel, each sending a mix of
//! uploads, reads of what it uploaded and lookups of missing entries, each on its own
//! connection, checking every answer.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// What a load run saw.
#[derive(Clone, Debug, Default)]
pub struct LoadReport {
    /// Requests sent.
    pub requests: u64,
    /// Requests whose answer was not the expected one (or failed).
    pub errors: u64,
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

fn sha256_hex(bytes: &[u8]) -> String {
    autopar_engine::server::sha256_hex(bytes)
}

/// One request on a fresh connection: the status code, and the body.
fn request(addr: &str, method: &str, path: &str, body: &[u8]) -> Option<(u16, Vec<u8>)> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).ok()?;
    s.write_all(body).ok()?;
    let mut resp = Vec::new();
    s.read_to_end(&mut resp).ok()?;
    let end = resp.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let code = String::from_utf8_lossy(&resp[..end])
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some((code, resp[end..].to_vec()))
}

/// `clients` clients, each sending `per_client` requests: in turn a PUT of a new blob, a GET
/// of a blob it stored (which must come back unchanged), and a HEAD of a key nobody stored
/// (which must be a 404).
pub fn run(addr: &str, clients: usize, per_client: usize) -> LoadReport {
    let start = Instant::now();
    let handles: Vec<_> = (0..clients)
        .map(|c| {
            let addr = addr.to_string();
            std::thread::spawn(move || {
                let mut stored: Vec<(String, Vec<u8>)> = Vec::new();
                let mut lat = Vec::with_capacity(per_client);
                let mut errors = 0u64;
                for i in 0..per_client {
                    let t0 = Instant::now();
                    let ok = match i % 3 {
                        0 => {
                            let body = format!("client {c} blob {i}").repeat(8).into_bytes();
                            let name = sha256_hex(&body);
                            let ok = request(&addr, "PUT", &format!("/cas/{name}"), &body)
                                .is_some_and(|r| r.0 == 200);
                            stored.push((name, body));
                            ok
                        }
                        1 => match stored.last() {
                            Some((name, body)) => {
                                request(&addr, "GET", &format!("/cas/{name}"), b"")
                                    .is_some_and(|r| r.0 == 200 && &r.1 == body)
                            }
                            None => false,
                        },
                        _ => {
                            let missing = sha256_hex(format!("missing {c} {i}").as_bytes());
                            request(&addr, "HEAD", &format!("/ac/{missing}"), b"")
                                .is_some_and(|r| r.0 == 404)
                        }
                    };
                    lat.push(t0.elapsed().as_secs_f64());
                    errors += u64::from(!ok);
                }
                (lat, errors)
            })
        })
        .collect();
    let mut report = LoadReport::default();
    for h in handles {
        match h.join() {
            Ok((lat, errors)) => {
                report.requests += lat.len() as u64;
                report.errors += errors;
                report.latencies.extend(lat);
            }
            Err(_) => report.errors += per_client as u64,
        }
    }
    report.seconds = start.elapsed().as_secs_f64();
    report.latencies.sort_by(f64::total_cmp);
    report
}
