//! The blobs `autopar cache serve` keeps: files under its directory, an index of their sizes
//! and last use for LRU eviction, and the request handlers.
//!
//! An upload streams to a temporary file (its name starts with `.`) while it is hashed, so a
//! server holds at most one frame of each upload in memory; the file is synced and renamed
//! into place only once it is complete and checked, so a blob is never seen partial, and a
//! temporary file an interrupted upload leaves is removed (when the request is dropped, or at
//! the next start). Uploads must keep coming: a body that stalls for the idle timeout, or
//! trickles slower than [`MIN_UPLOAD_RATE`], is dropped. The bytes of uploads in progress are
//! capped in total.

use super::Shared;
use super::auth::Scope;
use crate::reapi::is_action_result;
use axum::body::Body;
use axum::extract::{Path as UrlPath, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt as _;
use sha2::{Digest as _, Sha256};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt as _;

/// Largest action-cache entry accepted (an `ActionResult` is a few hundred bytes).
const MAX_AC_BYTES: u64 = 1 << 20;

/// Slowest average upload rate accepted after [`RATE_GRACE`], bytes per second.
pub const MIN_UPLOAD_RATE: u64 = 64 << 10;

/// How long an upload may take before [`MIN_UPLOAD_RATE`] applies.
const RATE_GRACE: Duration = Duration::from_secs(10);

/// Longest instance name (a path segment; file systems cap names at 255 bytes).
const MAX_INSTANCE: usize = 128;

/// Relative path -> (size, last-use tick), with the ticks in order for LRU eviction.
#[derive(Default)]
pub(super) struct Index {
    entries: HashMap<PathBuf, (u64, u64)>,
    /// Last-use tick -> relative path (least recently used first).
    order: BTreeMap<u64, PathBuf>,
    pub(super) total: u64,
    tick: u64,
}

impl Index {
    pub(super) fn len(&self) -> usize {
        self.entries.len()
    }

    fn touch(&mut self, rel: &Path) {
        self.tick += 1;
        let tick = self.tick;
        if let Some(e) = self.entries.get_mut(rel) {
            self.order.remove(&e.1);
            e.1 = tick;
            self.order.insert(tick, rel.to_path_buf());
        }
    }

    pub(super) fn insert(&mut self, rel: PathBuf, size: u64) {
        self.tick += 1;
        let tick = self.tick;
        if let Some((old, t)) = self.entries.insert(rel.clone(), (size, tick)) {
            self.order.remove(&t);
            self.total -= old;
        }
        self.order.insert(tick, rel);
        self.total += size;
    }

    pub(super) fn remove_entry(&mut self, rel: &Path) {
        if let Some((size, tick)) = self.entries.remove(rel) {
            self.order.remove(&tick);
            self.total -= size;
        }
    }

    /// The least recently used entry.
    pub(super) fn oldest(&self) -> Option<PathBuf> {
        self.order.values().next().cloned()
    }
}

/// Files under `dir` in the blob layout, with their sizes, oldest first. Temporary files that
/// interrupted uploads left behind are removed.
pub(super) fn scan(dir: &Path) -> Vec<(PathBuf, u64)> {
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
                    let _ = std::fs::remove_file(&p);
                    continue;
                }
                let mtime = meta.modified().unwrap_or(std::time::UNIX_EPOCH);
                out.push((rel.to_path_buf(), meta.len(), mtime));
            }
        }
    }
    out.sort_by_key(|e| e.2);
    out.into_iter().map(|(p, n, _)| (p, n)).collect()
}

fn valid_key(key: &str) -> bool {
    key.len() == 64 && key.bytes().all(|b| b.is_ascii_hexdigit())
}

fn valid_instance(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_INSTANCE
        && !s.starts_with('.')
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// `GET /status`: counters only, never a key.
pub(super) async fn status(State(s): State<Arc<Shared>>) -> Response {
    axum::Json(s.status()).into_response()
}

/// `GET`, `HEAD` or `PUT` on `[/{instance}]/{ac|cas}/{key}`.
pub(super) async fn blob(
    State(s): State<Arc<Shared>>,
    method: Method,
    UrlPath(parts): UrlPath<Vec<String>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let (instance, section, key) = match parts.as_slice() {
        [section, key] => (None, section.as_str(), key.to_ascii_lowercase()),
        [instance, section, key] => (
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
    if let Some(i) = instance
        && !valid_instance(i)
    {
        return s.reject(
            StatusCode::BAD_REQUEST,
            &format!(
                "an instance name is 1 to {MAX_INSTANCE} letters, digits, '.', '_' or '-', not \
                 starting with '.'"
            ),
        );
    }
    let rel = match instance {
        Some(i) => PathBuf::from(i).join(section).join(&key),
        None => PathBuf::from(section).join(&key),
    };
    let scope = s.credentials.scope(&headers);
    match method {
        Method::GET | Method::HEAD => {
            if scope.is_none() && !s.cfg.allow_anonymous_read {
                return s.reject(
                    StatusCode::UNAUTHORIZED,
                    "credentials with read scope are required",
                );
            }
            read(&s, &rel, method == Method::HEAD).await
        }
        Method::PUT => {
            match scope {
                Some(Scope::ReadWrite) => {}
                Some(Scope::Read) => {
                    return s.reject(StatusCode::FORBIDDEN, "these credentials may only read");
                }
                None => {
                    return s.reject(
                        StatusCode::UNAUTHORIZED,
                        "credentials with readwrite scope are required",
                    );
                }
            }
            let limit = if section == "ac" {
                MAX_AC_BYTES.min(s.cfg.max_blob)
            } else {
                s.cfg.max_blob
            }
            .min(s.cfg.max_total);
            match upload(&s, &rel, section, &key, limit, &headers, body).await {
                Ok(size) => {
                    s.uploads.fetch_add(1, Ordering::Relaxed);
                    s.stored(rel, size);
                    StatusCode::OK.into_response()
                }
                Err((status, why)) => s.reject(status, &why),
            }
        }
        _ => (StatusCode::METHOD_NOT_ALLOWED, "GET, HEAD or PUT\n").into_response(),
    }
}

/// Serves a blob, streamed from its file.
async fn read(s: &Shared, rel: &Path, head: bool) -> Response {
    let path = s.cfg.dir.join(rel);
    let opened = match tokio::fs::File::open(&path).await {
        Ok(f) => match f.metadata().await {
            Ok(m) if m.is_file() => Some((f, m.len())),
            _ => None,
        },
        Err(_) => None,
    };
    let Some((file, len)) = opened else {
        s.misses.fetch_add(1, Ordering::Relaxed);
        return StatusCode::NOT_FOUND.into_response();
    };
    s.hits.fetch_add(1, Ordering::Relaxed);
    s.index().touch(rel);
    let length = [(header::CONTENT_LENGTH, len.to_string())];
    if head {
        return (length, ()).into_response();
    }
    let stream = tokio_util::io::ReaderStream::new(file);
    (length, Body::from_stream(stream)).into_response()
}

/// Bytes of uploads in progress, reserved when one starts and released when it ends.
pub(super) struct Reservation<'a> {
    inflight: &'a AtomicU64,
    bytes: u64,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        self.inflight.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// Reserves `bytes` of the in-flight cap; `None` when they do not fit (one upload alone always
/// does, whatever its size).
fn reserve(inflight: &AtomicU64, cap: u64, bytes: u64) -> Option<Reservation<'_>> {
    inflight
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |cur| {
            (cur == 0 || cur.saturating_add(bytes) <= cap).then_some(cur + bytes)
        })
        .ok()
        .map(|_| Reservation { inflight, bytes })
}

/// A temporary file removed when dropped, unless it was renamed into place.
struct Temporary {
    path: PathBuf,
    kept: bool,
}

impl Drop for Temporary {
    fn drop(&mut self) {
        if !self.kept {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// A unique name for a temporary file.
fn temporary_name(key: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        ".upload-{}-{}-{}",
        &key[..16],
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// Receives an upload into `rel`: streamed to a temporary file while hashed, checked (a CAS
/// blob against its name, an AC entry as an `ActionResult`), synced and renamed into place.
/// Returns its size, or the status and reason of a refusal.
async fn upload(
    s: &Shared,
    rel: &Path,
    section: &str,
    key: &str,
    limit: u64,
    headers: &HeaderMap,
    mut body: Body,
) -> Result<u64, (StatusCode, String)> {
    let too_large = || {
        (
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("blobs are limited to {limit} bytes"),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(too_large());
    }
    let Some(_reservation) = reserve(&s.inflight, s.cfg.max_inflight, declared.unwrap_or(limit))
    else {
        return Err((
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "uploads in progress already hold {} bytes; retry",
                s.cfg.max_inflight
            ),
        ));
    };
    let failed = |what: &str, e: std::io::Error| {
        tracing::error!(error = %e, "cache server {what} failed");
        let status = if e.kind() == std::io::ErrorKind::StorageFull {
            StatusCode::INSUFFICIENT_STORAGE
        } else {
            StatusCode::INTERNAL_SERVER_ERROR
        };
        (status, format!("{what} failed"))
    };
    let path = s.cfg.dir.join(rel);
    let dir = path
        .parent()
        .map_or_else(|| s.cfg.dir.clone(), Path::to_path_buf);
    tokio::fs::create_dir_all(&dir)
        .await
        .map_err(|e| failed("creating the directory", e))?;
    let mut tmp = Temporary {
        path: dir.join(temporary_name(key)),
        kept: false,
    };
    let mut file = tokio::fs::File::create(&tmp.path)
        .await
        .map_err(|e| failed("write", e))?;
    let mut hasher = Sha256::new();
    let mut entry = Vec::new();
    let mut size = 0u64;
    let start = Instant::now();
    loop {
        let frame = match tokio::time::timeout(s.cfg.idle_timeout, body.frame()).await {
            Err(_) => {
                return Err((
                    StatusCode::REQUEST_TIMEOUT,
                    format!(
                        "the upload stalled for {} ms",
                        s.cfg.idle_timeout.as_millis()
                    ),
                ));
            }
            Ok(None) => break,
            Ok(Some(Err(e))) => {
                // The connection's own idle timeout may be the one that fired.
                let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&e);
                while let Some(c) = cause {
                    if c.downcast_ref::<std::io::Error>()
                        .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
                    {
                        return Err((StatusCode::REQUEST_TIMEOUT, "the upload stalled".into()));
                    }
                    cause = c.source();
                }
                return Err((StatusCode::BAD_REQUEST, format!("reading the body: {e}")));
            }
            Ok(Some(Ok(frame))) => frame,
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        size += data.len() as u64;
        if size > limit {
            return Err(too_large());
        }
        hasher.update(&data);
        if section == "ac" {
            entry.extend_from_slice(&data);
        }
        file.write_all(&data)
            .await
            .map_err(|e| failed("write", e))?;
        let late = start.elapsed().saturating_sub(RATE_GRACE);
        if size < (late.as_secs_f64() * MIN_UPLOAD_RATE as f64) as u64 {
            return Err((
                StatusCode::REQUEST_TIMEOUT,
                format!("the upload is slower than {MIN_UPLOAD_RATE} bytes/s"),
            ));
        }
    }
    let digest = crate::hex(&hasher.finalize());
    if section == "cas" && digest != key {
        return Err((
            StatusCode::BAD_REQUEST,
            "the body's SHA-256 is not its name".into(),
        ));
    }
    if section == "ac" && !is_action_result(&entry) {
        return Err((
            StatusCode::BAD_REQUEST,
            "action-cache entries must be ActionResult protobufs".into(),
        ));
    }
    file.sync_all().await.map_err(|e| failed("write", e))?;
    drop(file);
    tokio::fs::rename(&tmp.path, &path)
        .await
        .map_err(|e| failed("write", e))?;
    tmp.kept = true;
    // The rename itself survives a crash once the directory is synced (not supported
    // everywhere; the data is durable already).
    if let Ok(d) = tokio::fs::File::open(&dir).await {
        let _ = d.sync_all().await;
    }
    Ok(size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn least_recently_used_comes_first() {
        let mut idx = Index::default();
        idx.insert("a".into(), 10);
        idx.insert("b".into(), 10);
        idx.touch(Path::new("a"));
        assert_eq!(idx.order.values().next(), Some(&PathBuf::from("b")));
        idx.insert("a".into(), 5);
        assert_eq!(idx.total, 15);
        idx.remove_entry(Path::new("b"));
        assert_eq!((idx.total, idx.len()), (5, 1));
    }

    #[test]
    fn reservations_cap_the_bytes_in_flight_but_admit_one_upload() {
        let inflight = AtomicU64::new(0);
        let big = reserve(&inflight, 100, 500).expect("one upload alone always fits");
        assert!(reserve(&inflight, 100, 1).is_none());
        drop(big);
        let a = reserve(&inflight, 100, 60).expect("fits");
        assert!(reserve(&inflight, 100, 50).is_none());
        let b = reserve(&inflight, 100, 40).expect("fits");
        assert_eq!(inflight.load(Ordering::Relaxed), 100);
        drop((a, b));
        assert_eq!(inflight.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn instance_names_are_bounded_path_segments() {
        assert!(valid_instance("team-a.v2_x"));
        assert!(!valid_instance(""));
        assert!(!valid_instance(".hidden"));
        assert!(!valid_instance("a/b"));
        assert!(!valid_instance(&"x".repeat(MAX_INSTANCE + 1)));
    }
}
