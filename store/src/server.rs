//! `autopar cache serve`: a small remote cache for teams without one, speaking the subset of
//! the Bazel HTTP cache that autopar's client uses: `GET`/`HEAD`/`PUT` on
//! `[/{instance}]/ac/<64 hex>` (an `ActionResult`, validated) and `[/{instance}]/cas/<sha256>`
//! (any bytes, whose SHA-256 must be the name), and `GET /status`.
//!
//! Blobs are files under the directory, written atomically and durably before the upload is
//! acknowledged. A size limit per blob and in total; past the total the least recently used
//! entries are evicted. Bearer tokens with `read` or `readwrite` scope, compared in constant
//! time and never logged; anonymous reads only when allowed. SIGINT or SIGTERM stops the server
//! after the requests in flight (acknowledged writes are already on disk).

use crate::StoreError;
use crate::reapi::is_action_result;
pub use crate::reapi::sha256_hex;
use axum::Router;
use axum::body::Body;
use axum::extract::{Path as UrlPath, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use subtle::ConstantTimeEq;

/// What a token may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// GET and HEAD.
    Read,
    /// GET, HEAD and PUT.
    ReadWrite,
}

/// A bearer token and its scope.
#[derive(Clone)]
pub struct Token {
    /// The secret.
    pub secret: String,
    /// What it allows.
    pub scope: Scope,
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the secret.
        write!(f, "Token({:?})", self.scope)
    }
}

/// Reads a tokens file: one `read <token>` or `readwrite <token>` per line; `#` comments and
/// blank lines are ignored. Errors are (line number, message).
pub fn parse_tokens(text: &str) -> Result<Vec<Token>, (usize, String)> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut parts = line.split_whitespace();
        let scope = match parts.next() {
            Some("read") => Scope::Read,
            Some("readwrite") => Scope::ReadWrite,
            Some(other) => {
                return Err((
                    i + 1,
                    format!("expected `read` or `readwrite` before the token, found `{other}`"),
                ));
            }
            None => continue,
        };
        let Some(secret) = parts.next() else {
            return Err((
                i + 1,
                "expected a token after the scope, found nothing".into(),
            ));
        };
        if parts.next().is_some() {
            return Err((i + 1, "expected `<scope> <token>`, found more words".into()));
        }
        out.push(Token {
            secret: secret.to_string(),
            scope,
        });
    }
    Ok(out)
}

/// How to run the server.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// Directory holding the blobs.
    pub dir: PathBuf,
    /// Address to listen on (`127.0.0.1:9092`; port 0 picks a free one).
    pub listen: String,
    /// Accepted tokens; none means everyone may read and write.
    pub tokens: Vec<Token>,
    /// Reads without a token are allowed even when tokens are configured.
    pub allow_anonymous_read: bool,
    /// Largest blob accepted, bytes.
    pub max_blob: u64,
    /// Largest total, bytes; least recently used entries are evicted past it.
    pub max_total: u64,
}

/// Counters served at `/status`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ServerStatus {
    /// Entries stored.
    pub entries: u64,
    /// Their bytes.
    pub bytes: u64,
    /// The total limit.
    pub max_bytes: u64,
    /// GET/HEAD that found the entry.
    pub hits: u64,
    /// GET/HEAD that did not.
    pub misses: u64,
    /// PUTs stored.
    pub uploads: u64,
    /// Requests refused (authorization, size, hash, malformed).
    pub rejects: u64,
    /// Entries evicted for space.
    pub evictions: u64,
}

#[derive(Default)]
struct Index {
    /// Relative path -> (size, last-use tick).
    entries: HashMap<PathBuf, (u64, u64)>,
    /// Last-use tick -> relative path (least recently used first).
    order: BTreeMap<u64, PathBuf>,
    total: u64,
    tick: u64,
}

impl Index {
    fn touch(&mut self, rel: &Path) {
        self.tick += 1;
        let tick = self.tick;
        if let Some(e) = self.entries.get_mut(rel) {
            self.order.remove(&e.1);
            e.1 = tick;
            self.order.insert(tick, rel.to_path_buf());
        }
    }

    fn insert(&mut self, rel: PathBuf, size: u64) {
        self.tick += 1;
        let tick = self.tick;
        if let Some((old, t)) = self.entries.insert(rel.clone(), (size, tick)) {
            self.order.remove(&t);
            self.total -= old;
        }
        self.order.insert(tick, rel);
        self.total += size;
    }

    fn remove(&mut self, rel: &Path) {
        if let Some((size, tick)) = self.entries.remove(rel) {
            self.order.remove(&tick);
            self.total -= size;
        }
    }
}

struct Shared {
    cfg: ServeConfig,
    index: Mutex<Index>,
    hits: AtomicU64,
    misses: AtomicU64,
    uploads: AtomicU64,
    rejects: AtomicU64,
    evictions: AtomicU64,
}

impl Shared {
    fn status(&self) -> ServerStatus {
        let idx = self.index.lock().unwrap_or_else(|e| e.into_inner());
        ServerStatus {
            entries: idx.entries.len() as u64,
            bytes: idx.total,
            max_bytes: self.cfg.max_total,
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            uploads: self.uploads.load(Ordering::Relaxed),
            rejects: self.rejects.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
        }
    }

    fn reject(&self, status: StatusCode, why: &str) -> Response {
        self.rejects.fetch_add(1, Ordering::Relaxed);
        (status, format!("{why}\n")).into_response()
    }

    /// The scope the request's token grants (`None`: no valid token).
    fn scope(&self, headers: &HeaderMap) -> Option<Scope> {
        if self.cfg.tokens.is_empty() {
            return Some(Scope::ReadWrite);
        }
        let given = headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))?;
        // Compare against every token, in constant time per comparison.
        let mut found = None;
        for t in &self.cfg.tokens {
            if bool::from(t.secret.as_bytes().ct_eq(given.as_bytes())) {
                found = Some(t.scope);
            }
        }
        found
    }
}

/// Files under `dir` in the blob layout, with their sizes and modification times.
fn scan(dir: &Path) -> Vec<(PathBuf, u64, std::time::SystemTime)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            let Ok(meta) = e.metadata() else { continue };
            if meta.is_dir() {
                stack.push(p);
            } else if let Ok(rel) = p.strip_prefix(dir) {
                let name = rel.file_name().and_then(|n| n.to_str()).unwrap_or("");
                if name.starts_with('.') {
                    // A temporary file an interrupted write left behind.
                    let _ = std::fs::remove_file(&p);
                    continue;
                }
                let mtime = meta.modified().unwrap_or(std::time::UNIX_EPOCH);
                out.push((rel.to_path_buf(), meta.len(), mtime));
            }
        }
    }
    out.sort_by_key(|e| e.2);
    out
}

fn valid_key(key: &str) -> bool {
    key.len() == 64 && key.bytes().all(|b| b.is_ascii_hexdigit())
}

fn valid_instance(s: &str) -> bool {
    !s.is_empty()
        && !s.starts_with('.')
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

async fn status(State(s): State<Arc<Shared>>) -> Response {
    axum::Json(s.status()).into_response()
}

async fn blob(
    State(s): State<Arc<Shared>>,
    method: Method,
    UrlPath(parts): UrlPath<Vec<String>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let (instance, section, key) = match parts.as_slice() {
        [section, key] => (None, section.as_str(), key.to_ascii_lowercase()),
        [instance, section, key] if valid_instance(instance) => (
            Some(instance.as_str()),
            section.as_str(),
            key.to_ascii_lowercase(),
        ),
        _ => return (StatusCode::NOT_FOUND, "no such path\n").into_response(),
    };
    if !matches!(section, "ac" | "cas") || !valid_key(&key) {
        return (
            StatusCode::NOT_FOUND,
            "expected /ac/<64 hex> or /cas/<64 hex>\n",
        )
            .into_response();
    }
    let rel = match instance {
        Some(i) => PathBuf::from(i).join(section).join(&key),
        None => PathBuf::from(section).join(&key),
    };
    let scope = s.scope(&headers);
    match method {
        Method::GET | Method::HEAD => {
            if scope.is_none() && !s.cfg.allow_anonymous_read {
                return s.reject(
                    StatusCode::UNAUTHORIZED,
                    "a token with read scope is required",
                );
            }
            let path = s.cfg.dir.join(&rel);
            let read = tokio::task::spawn_blocking(move || std::fs::read(path)).await;
            match read {
                Ok(Ok(bytes)) => {
                    s.hits.fetch_add(1, Ordering::Relaxed);
                    s.index
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .touch(&rel);
                    if method == Method::HEAD {
                        ([("content-length", bytes.len().to_string())], ()).into_response()
                    } else {
                        bytes.into_response()
                    }
                }
                _ => {
                    s.misses.fetch_add(1, Ordering::Relaxed);
                    StatusCode::NOT_FOUND.into_response()
                }
            }
        }
        Method::PUT => {
            match scope {
                Some(Scope::ReadWrite) => {}
                Some(Scope::Read) => {
                    return s.reject(StatusCode::FORBIDDEN, "this token may only read");
                }
                None => {
                    return s.reject(
                        StatusCode::UNAUTHORIZED,
                        "a token with readwrite scope is required",
                    );
                }
            }
            let limit = s.cfg.max_blob.min(s.cfg.max_total);
            let bytes = match axum::body::to_bytes(body, limit as usize).await {
                Ok(b) => b,
                Err(_) => {
                    return s.reject(
                        StatusCode::PAYLOAD_TOO_LARGE,
                        &format!("blobs are limited to {limit} bytes"),
                    );
                }
            };
            if section == "cas" && sha256_hex(&bytes) != key {
                return s.reject(
                    StatusCode::BAD_REQUEST,
                    "the body's SHA-256 is not its name",
                );
            }
            if section == "ac" && !is_action_result(&bytes) {
                return s.reject(
                    StatusCode::BAD_REQUEST,
                    "action-cache entries must be ActionResult protobufs",
                );
            }
            let path = s.cfg.dir.join(&rel);
            let size = bytes.len() as u64;
            let written =
                tokio::task::spawn_blocking(move || crate::write_atomic(&path, &bytes)).await;
            match written {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::error!(error = %e, "cache server write failed");
                    return (StatusCode::INTERNAL_SERVER_ERROR, "write failed\n").into_response();
                }
                Err(_) => return StatusCode::INTERNAL_SERVER_ERROR.into_response(),
            }
            s.uploads.fetch_add(1, Ordering::Relaxed);
            let mut evict = Vec::new();
            {
                let mut idx = s.index.lock().unwrap_or_else(|e| e.into_inner());
                idx.insert(rel.clone(), size);
                while idx.total > s.cfg.max_total {
                    let Some((_, victim)) = idx.order.iter().next().map(|(t, p)| (*t, p.clone()))
                    else {
                        break;
                    };
                    if victim == rel {
                        break;
                    }
                    idx.remove(&victim);
                    evict.push(victim);
                }
            }
            for victim in evict {
                s.evictions.fetch_add(1, Ordering::Relaxed);
                let _ = std::fs::remove_file(s.cfg.dir.join(victim));
            }
            StatusCode::OK.into_response()
        }
        _ => (StatusCode::METHOD_NOT_ALLOWED, "GET, HEAD or PUT\n").into_response(),
    }
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

/// Runs the server until SIGINT or SIGTERM; `ready` is called with the bound address once it
/// accepts connections.
pub fn serve(cfg: ServeConfig, ready: impl FnOnce(SocketAddr)) -> Result<ServerStatus, StoreError> {
    let err = |action: &'static str, path: &Path| {
        let path = path.to_path_buf();
        move |source: std::io::Error| StoreError {
            action,
            path,
            source,
        }
    };
    std::fs::create_dir_all(&cfg.dir).map_err(err("creating cache directory", &cfg.dir))?;
    let mut index = Index::default();
    for (rel, size, _) in scan(&cfg.dir) {
        index.insert(rel, size);
    }
    let shared = Arc::new(Shared {
        cfg: cfg.clone(),
        index: Mutex::new(index),
        hits: AtomicU64::new(0),
        misses: AtomicU64::new(0),
        uploads: AtomicU64::new(0),
        rejects: AtomicU64::new(0),
        evictions: AtomicU64::new(0),
    });
    let app = Router::new()
        .route("/status", get(status))
        .route("/{a}/{b}", any(blob))
        .route("/{a}/{b}/{c}", any(blob))
        .layer(axum::extract::DefaultBodyLimit::disable())
        .with_state(shared.clone());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(err("starting the server runtime", &cfg.dir))?;
    let listen = PathBuf::from(&cfg.listen);
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(&cfg.listen)
            .await
            .map_err(err("listening on", &listen))?;
        let addr = listener
            .local_addr()
            .map_err(err("listening on", &listen))?;
        ready(addr);
        axum::serve(listener, app)
            .with_graceful_shutdown(shutdown_signal())
            .await
            .map_err(err("serving on", &listen))
    })?;
    Ok(shared.status())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_file() {
        let t = parse_tokens("# team\nread r0\n\nreadwrite w0\n").expect("parses");
        assert_eq!(t.len(), 2);
        assert_eq!(t[1].scope, Scope::ReadWrite);
        assert_eq!(
            format!("{:?}", t[1]),
            "Token(ReadWrite)",
            "the secret is never printed"
        );
        assert_eq!(parse_tokens("write x").expect_err("scope").0, 1);
        assert_eq!(parse_tokens("\nread").expect_err("token").0, 2);
    }

    #[test]
    fn least_recently_used_comes_first() {
        let mut idx = Index::default();
        idx.insert("a".into(), 10);
        idx.insert("b".into(), 10);
        idx.touch(Path::new("a"));
        assert_eq!(idx.order.values().next(), Some(&PathBuf::from("b")));
        idx.insert("a".into(), 5);
        assert_eq!(idx.total, 15);
        idx.remove(Path::new("b"));
        assert_eq!((idx.total, idx.entries.len()), (5, 1));
    }
}
