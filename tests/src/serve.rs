//! A running `autopar cache serve` and raw HTTP requests to it, for the remote-cache tests.

use crate::binary;
use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A running `autopar cache serve`.
pub struct Server {
    child: Child,
    /// `host:port` it listens on.
    pub addr: String,
    /// Its blob directory.
    pub dir: tempfile::TempDir,
}

impl Server {
    /// Starts a server on a new directory with `extra` arguments.
    pub fn start(extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().expect("server dir");
        Self::start_in(dir, extra)
    }

    /// Starts a server on `dir` with `extra` arguments.
    pub fn start_in(dir: tempfile::TempDir, extra: &[&str]) -> Self {
        let mut args = vec![
            "cache".to_string(),
            "serve".into(),
            "--dir".into(),
            dir.path().display().to_string(),
            "--listen".into(),
            "127.0.0.1:0".into(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut child = Command::new(binary())
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("server starts");
        let stdout = child.stdout.take().expect("stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("server says where it listens");
        let addr = line
            .trim()
            .rsplit("://")
            .next()
            .expect("an address")
            .to_string();
        Server { child, addr, dir }
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its base URL.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// `GET /status`, parsed.
    pub fn status(&self) -> Value {
        let (code, body) = http(&self.addr, "GET", "/status", &[], b"");
        assert_eq!(code, 200);
        serde_json::from_slice(&body).expect("status JSON")
    }

    /// SIGTERM, then wait; returns the exit status and what it printed last.
    pub fn stop(mut self) -> (bool, tempfile::TempDir) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let ok = self.child.wait().map(|s| s.success()).unwrap_or(false);
        let dir = std::mem::replace(&mut self.dir, tempfile::tempdir().expect("dir"));
        (ok, dir)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTP/1.1 request on a fresh connection: (status, body).
pub fn http(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> (u16, Vec<u8>) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).expect("write");
    // A server may answer (413, 503) and close before taking the whole body.
    let _ = s.write_all(body);
    let mut resp = Vec::new();
    let _ = s.read_to_end(&mut resp);
    let head_end = resp
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(resp.len(), |p| p + 4);
    let head = String::from_utf8_lossy(&resp[..head_end]);
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (code, resp[head_end..].to_vec())
}
