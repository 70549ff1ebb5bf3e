//! The remote cache client, in the Bazel HTTP cache layout (DESIGN.md "Remote cache"):
//! `GET/HEAD/PUT {base}[/{instance}]/ac/<key>` holds an `ActionResult` whose output file points
//! at `{base}[/{instance}]/cas/<sha256>`, the result's bytes.
//!
//! Nothing here can fail a build: every error is a miss. Requests time out; after
//! [`BREAKER_FAILURES`] failures in a row the remote is left alone for the rest of the run (one
//! warning); a refused write (401/403) makes the run read-only (one warning); an entry that
//! does not match its hash is a miss (one warning each). Uploads go through [`Uploader`], a
//! bounded background queue the build never waits on.

use crate::Key;
use crate::reapi::{action_result, blob_of, sha256_hex};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Failures in a row after which the remote is not asked again in this run.
pub const BREAKER_FAILURES: u32 = 3;

/// Largest action-cache entry read, bytes (an `ActionResult` is a few hundred).
const MAX_AC_BYTES: u64 = 1 << 16;

/// Largest result blob read, bytes.
const MAX_BLOB_BYTES: u64 = 1 << 30;

/// Whether this client may write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Read and upload.
    Rw,
    /// Read only (untrusted CI).
    Ro,
}

/// How to reach a remote cache.
#[derive(Clone, Debug)]
pub struct RemoteConfig {
    /// Base URL (`http://host:port/prefix`).
    pub url: String,
    /// Read-write or read-only.
    pub mode: Mode,
    /// Bearer token (never logged).
    pub token: Option<String>,
    /// Limit on each request, connection included.
    pub timeout: Duration,
    /// Path segment between the base and `ac/`/`cas/`, if the server partitions by instance.
    pub instance: Option<String>,
}

/// What the remote did in this run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteStats {
    /// Results found.
    pub hits: u64,
    /// Results not there (or unusable).
    pub misses: u64,
    /// Requests that failed (network, server errors, refusals).
    pub errors: u64,
    /// Results uploaded.
    pub uploads: u64,
}

/// Outcome of a remote lookup.
#[derive(Debug, PartialEq)]
pub enum Fetch {
    /// The verified bytes.
    Hit(Vec<u8>),
    /// Not there, or not usable (corrupt, unreachable, disabled).
    Miss,
}

/// The remote cache client.
pub struct RemoteCache {
    cfg: RemoteConfig,
    agent: ureq::Agent,
    failures: AtomicU32,
    broken: AtomicBool,
    read_only: AtomicBool,
    hits: AtomicU64,
    misses: AtomicU64,
    errors: AtomicU64,
    uploads: AtomicU64,
}

/// Outcome of one HTTP exchange.
enum Reply {
    Ok(Vec<u8>),
    NotFound,
    Refused(u16),
    Failed(String),
}

impl RemoteCache {
    /// A client for `cfg`.
    pub fn new(cfg: RemoteConfig) -> Self {
        let agent = ureq::Agent::config_builder()
            .timeout_global(Some(cfg.timeout))
            .http_status_as_error(false)
            .user_agent(concat!("autopar/", env!("CARGO_PKG_VERSION")))
            .build()
            .into();
        RemoteCache {
            read_only: AtomicBool::new(cfg.mode == Mode::Ro),
            cfg,
            agent,
            failures: AtomicU32::new(0),
            broken: AtomicBool::new(false),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            uploads: AtomicU64::new(0),
        }
    }

    /// The base URL, for messages.
    pub fn url(&self) -> &str {
        &self.cfg.url
    }

    /// Counts so far.
    pub fn stats(&self) -> RemoteStats {
        RemoteStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
            uploads: self.uploads.load(Ordering::Relaxed),
        }
    }

    fn address(&self, section: &str, name: &str) -> String {
        let base = self.cfg.url.trim_end_matches('/');
        match &self.cfg.instance {
            Some(i) => format!("{base}/{i}/{section}/{name}"),
            None => format!("{base}/{section}/{name}"),
        }
    }

    fn authorized<B>(&self, req: ureq::RequestBuilder<B>) -> ureq::RequestBuilder<B> {
        match &self.cfg.token {
            Some(t) => req.header("Authorization", format!("Bearer {t}")),
            None => req,
        }
    }

    fn get_bytes(&self, url: &str, limit: u64) -> Reply {
        let req = self.authorized(self.agent.get(url));
        match req.call() {
            Ok(mut resp) => match resp.status().as_u16() {
                200 => match resp.body_mut().with_config().limit(limit).read_to_vec() {
                    Ok(b) => Reply::Ok(b),
                    Err(e) => Reply::Failed(format!("reading {url}: {e}")),
                },
                404 => Reply::NotFound,
                s @ (401 | 403) => Reply::Refused(s),
                s => Reply::Failed(format!("GET {url}: HTTP {s}")),
            },
            Err(e) => Reply::Failed(format!("GET {url}: {e}")),
        }
    }

    fn put_bytes(&self, url: &str, body: &[u8]) -> Reply {
        let req = self.authorized(self.agent.put(url));
        match req.send(body) {
            Ok(resp) => match resp.status().as_u16() {
                200..=299 => Reply::Ok(Vec::new()),
                s @ (401 | 403) => Reply::Refused(s),
                s => Reply::Failed(format!("PUT {url}: HTTP {s}")),
            },
            Err(e) => Reply::Failed(format!("PUT {url}: {e}")),
        }
    }

    fn failed(&self, why: &str) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        let n = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
        tracing::debug!(remote = %self.cfg.url, %why, "remote cache request failed");
        if n >= BREAKER_FAILURES && !self.broken.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "remote cache {} failed {n} times in a row ({why}); continuing without it",
                self.cfg.url
            );
        }
    }

    fn succeeded(&self) {
        self.failures.store(0, Ordering::Relaxed);
    }

    fn miss(&self) -> Fetch {
        self.misses.fetch_add(1, Ordering::Relaxed);
        Fetch::Miss
    }

    /// The verified bytes of the result under `key`.
    pub fn get(&self, key: &Key) -> Fetch {
        if self.broken.load(Ordering::Relaxed) {
            return self.miss();
        }
        let ac = match self.get_bytes(&self.address("ac", &key.hex()), MAX_AC_BYTES) {
            Reply::Ok(b) => b,
            Reply::NotFound => {
                self.succeeded();
                return self.miss();
            }
            Reply::Refused(s) => {
                self.errors.fetch_add(1, Ordering::Relaxed);
                if !self.broken.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        "remote cache {} refuses reads (HTTP {s}); continuing without it",
                        self.cfg.url
                    );
                }
                return self.miss();
            }
            Reply::Failed(why) => {
                self.failed(&why);
                return self.miss();
            }
        };
        self.succeeded();
        let Some((hash, size)) = blob_of(&ac) else {
            tracing::warn!(key = %key.hex(), "remote action-cache entry is not a valid ActionResult; ignored");
            return self.miss();
        };
        let blob = match self.get_bytes(&self.address("cas", &hash), size.min(MAX_BLOB_BYTES) + 1) {
            Reply::Ok(b) => b,
            Reply::NotFound => {
                self.succeeded();
                return self.miss();
            }
            Reply::Refused(_) => return self.miss(),
            Reply::Failed(why) => {
                self.failed(&why);
                return self.miss();
            }
        };
        self.succeeded();
        if blob.len() as u64 != size || sha256_hex(&blob) != hash {
            tracing::warn!(
                key = %key.hex(),
                "remote cache blob {hash} does not match its hash; ignored and recomputed"
            );
            return self.miss();
        }
        self.hits.fetch_add(1, Ordering::Relaxed);
        Fetch::Hit(blob)
    }

    /// Uploads a result: its bytes to the CAS, then the action-cache entry. Returns whether
    /// both were stored.
    pub fn put(&self, key: &Key, kind: &str, blob: &[u8]) -> bool {
        if self.broken.load(Ordering::Relaxed) || self.read_only.load(Ordering::Relaxed) {
            return false;
        }
        let steps = [
            (self.address("cas", &sha256_hex(blob)), blob.to_vec()),
            (self.address("ac", &key.hex()), action_result(kind, blob)),
        ];
        for (url, body) in &steps {
            match self.put_bytes(url, body) {
                Reply::Ok(_) => self.succeeded(),
                Reply::Refused(s) => {
                    self.errors.fetch_add(1, Ordering::Relaxed);
                    if !self.read_only.swap(true, Ordering::Relaxed) {
                        tracing::warn!(
                            "remote cache {} refuses writes (HTTP {s}); reading only for this run",
                            self.cfg.url
                        );
                    }
                    return false;
                }
                Reply::NotFound | Reply::Failed(_) => {
                    self.failed(&format!("PUT {url} failed"));
                    return false;
                }
            }
        }
        self.uploads.fetch_add(1, Ordering::Relaxed);
        true
    }
}

/// One result to upload.
struct Job {
    key: Key,
    kind: String,
    blob: Vec<u8>,
}

/// Uploads results in the background through a bounded queue: a full queue drops the upload
/// (the result is still cached locally) rather than slow the build down.
pub struct Uploader {
    tx: Mutex<Option<SyncSender<Job>>>,
    done: Mutex<Option<Receiver<()>>>,
    dropped: AtomicU64,
}

impl Uploader {
    /// Starts the upload thread for `remote`, queueing at most `capacity` results.
    pub fn start(remote: Arc<RemoteCache>, capacity: usize) -> Self {
        let (tx, rx) = sync_channel::<Job>(capacity.max(1));
        let (done_tx, done_rx) = sync_channel::<()>(1);
        std::thread::spawn(move || {
            for job in rx {
                remote.put(&job.key, &job.kind, &job.blob);
            }
            let _ = done_tx.send(());
        });
        Uploader {
            tx: Mutex::new(Some(tx)),
            done: Mutex::new(Some(done_rx)),
            dropped: AtomicU64::new(0),
        }
    }

    /// Queues an upload; `false` when the queue is full or closed (the upload is dropped).
    pub fn submit(&self, key: Key, kind: &str, blob: Vec<u8>) -> bool {
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        let sent = tx.as_ref().is_some_and(|tx| {
            tx.try_send(Job {
                key,
                kind: kind.to_string(),
                blob,
            })
            .is_ok()
        });
        if !sent {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
        sent
    }

    /// Uploads dropped because the queue was full.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Closes the queue and waits up to `wait` for the uploads already queued; returns whether
    /// they all finished.
    pub fn finish(&self, wait: Duration) -> bool {
        drop(self.tx.lock().unwrap_or_else(|e| e.into_inner()).take());
        match self.done.lock().unwrap_or_else(|e| e.into_inner()).take() {
            Some(done) => done.recv_timeout(wait).is_ok(),
            None => true,
        }
    }
}
