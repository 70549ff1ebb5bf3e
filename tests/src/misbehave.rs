//! Remote caches that fail in the ways real ones do, on 127.0.0.1, for the failure tests: one
//! that accepts connections and never answers, one that resets them, one that answers 500, one
//! that cuts bodies short, one that answers one byte a second, and one that answers reads but
//! swallows uploads.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How a [`FaultyServer`] misbehaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Accepts connections and never answers.
    Blackhole,
    /// Closes every connection with a reset (the request left unread).
    Reset,
    /// Answers every request with HTTP 500.
    ServerError,
    /// Answers 200 with a body shorter than its `Content-Length`, then closes.
    Truncate,
    /// Answers one byte a second.
    Slow,
    /// Answers reads with 404 at once; takes uploads' headers and never answers them.
    SwallowUploads,
}

impl Fault {
    /// Every fault.
    pub const ALL: [Fault; 6] = [
        Fault::Blackhole,
        Fault::Reset,
        Fault::ServerError,
        Fault::Truncate,
        Fault::Slow,
        Fault::SwallowUploads,
    ];
}

/// A server that misbehaves as its [`Fault`] says until dropped.
pub struct FaultyServer {
    addr: String,
    stop: Arc<AtomicBool>,
}

/// Reads a request's head (up to the blank line), giving up after a few seconds.
fn read_head(s: &mut TcpStream) -> Vec<u8> {
    let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && Instant::now() < deadline {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => head.extend_from_slice(&buf[..n]),
            Err(_) => {}
        }
    }
    head
}

/// Holds the connection open, doing nothing, until the server stops.
fn hold(s: TcpStream, stop: &AtomicBool) {
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(s);
}

fn handle(fault: Fault, mut s: TcpStream, stop: &AtomicBool) {
    match fault {
        Fault::Blackhole => hold(s, stop),
        Fault::Reset => {
            // Closing a socket with unread data makes the kernel send a reset.
            std::thread::sleep(Duration::from_millis(20));
            drop(s);
        }
        Fault::ServerError => {
            read_head(&mut s);
            let _ = s.write_all(
                b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 6\r\nConnection: close\r\n\r\nbroken",
            );
        }
        Fault::Truncate => {
            read_head(&mut s);
            let _ = s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 4096\r\n\r\n");
            let _ = s.write_all(&[0x0a; 100]);
        }
        Fault::Slow => {
            read_head(&mut s);
            for b in b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n" {
                if stop.load(Ordering::Relaxed) || s.write_all(&[*b]).is_err() {
                    return;
                }
                let t = Instant::now();
                while t.elapsed() < Duration::from_secs(1) && !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
        Fault::SwallowUploads => loop {
            let head = read_head(&mut s);
            if head.is_empty() {
                return;
            }
            if head.starts_with(b"PUT") {
                return hold(s, stop);
            }
            if s.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                .is_err()
            {
                return;
            }
        },
    }
}

impl FaultyServer {
    /// Starts a server misbehaving as `fault` says.
    pub fn start(fault: Fault) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a local port");
        let addr = listener.local_addr().expect("address").to_string();
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if flag.load(Ordering::Relaxed) {
                    break;
                }
                let Ok(s) = conn else { continue };
                let flag = flag.clone();
                std::thread::spawn(move || handle(fault, s, &flag));
            }
        });
        FaultyServer { addr, stop }
    }

    /// Its base URL.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for FaultyServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect(&self.addr);
    }
}
