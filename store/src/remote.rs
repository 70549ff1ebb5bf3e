//! The remote cache client, in the Bazel HTTP cache layout (DESIGN.md "Remote cache"):
//! `GET/HEAD/PUT {base}[/{instance}]/ac/<key>` holds an `ActionResult` whose output file points
//! at `{base}[/{instance}]/cas/<sha256>`, the result's [record](crate::record).
//!
//! Nothing here can fail or slow down a build by more than a moment:
//! - every request has a connect timeout and a read timeout (the wait for the answer to start;
//!   transfers get [`MIN_RATE`] on top for their bytes);
//! - requests run on threads of their own and the build waits for them only while the remote is
//!   healthy: the first failure suspends the remote, which abandons every lookup in flight, and
//!   a single probe in the background decides whether it is used again; a second failure drops
//!   it for the rest of the run (one warning);
//! - a refused read (401/403) drops it, a refused write (403) makes the run read-only (one
//!   warning each);
//! - what comes back is checked twice: the blob against its SHA-256 (as bazel-remote does) and
//!   the record inside against the key asked for, so an entry served under another key is a
//!   miss with a warning naming the key, never a result;
//! - uploads go through [`Uploader`]: a bounded queue and a few threads the build never waits
//!   on, with a deadline at exit after which what is left is dropped and counted.

use crate::Key;
use crate::reapi::{action_result, blob_of, sha256_hex};
use crate::record::{self, RecordError};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Default connect timeout.
pub const CONNECT_TIMEOUT: Duration = Duration::from_millis(1000);

/// Default read timeout: how long the server may take to start answering.
pub const READ_TIMEOUT: Duration = Duration::from_millis(1000);

/// Slowest transfer rate accepted, bytes per second: a blob of `n` bytes may take
/// `read timeout + n / MIN_RATE` (a server dripping bytes is a failed server).
pub const MIN_RATE: u64 = 1 << 20;

/// Largest action-cache entry read, bytes (an `ActionResult` is a few hundred).
const MAX_AC_BYTES: u64 = 1 << 16;

/// Largest result blob read, bytes.
const MAX_BLOB_BYTES: u64 = 1 << 30;

/// How often a caller waiting for an answer checks whether the remote was suspended meanwhile.
const POLL: Duration = Duration::from_millis(10);

/// Entries refused for their content (damaged, or another key's) that are each named in a
/// warning; the rest are counted in [`RemoteStats::rejected`].
const NAMED_REJECTIONS: u64 = 10;

/// Threads that upload in the background.
const UPLOAD_THREADS: usize = 4;

/// Bytes waiting for upload at most; more are dropped (they stay in the local store).
const UPLOAD_QUEUE_BYTES: u64 = 256 << 20;

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
    /// Base URL (`http://host:port/prefix`, `https://user:password@host/prefix`).
    pub url: String,
    /// Read-write or read-only.
    pub mode: Mode,
    /// Bearer token (never logged).
    pub token: Option<String>,
    /// Limit on establishing a connection (name resolution included).
    pub connect_timeout: Duration,
    /// Limit on waiting for the server to start answering; transfers get [`MIN_RATE`] more.
    pub timeout: Duration,
    /// Path segment between the base and `ac/`/`cas/`, if the server partitions by instance.
    pub instance: Option<String>,
    /// PEM certificates to trust for `https` instead of the public roots (a team's own CA).
    pub ca_pem: Option<Vec<u8>>,
}

/// What the remote did in this run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteStats {
    /// Results found.
    pub hits: u64,
    /// Results not there, unusable, or not asked for because the remote was not in use.
    pub misses: u64,
    /// Requests that failed (network, server errors, refusals).
    pub errors: u64,
    /// Entries refused for their content: damaged, or intact but another key's.
    pub rejected: u64,
    /// Results uploaded.
    pub uploads: u64,
    /// Results not uploaded: the queue was full, the remote was dropped, or the deadline at
    /// exit came first.
    pub uploads_dropped: u64,
    /// Wall time, in milliseconds, during which the build waited on the remote: some lookup
    /// was waiting for its answer, or the finished build for its uploads. This is what a slow
    /// or failing remote can add to a build, whatever else the machine is doing.
    #[serde(default)]
    pub waited_ms: u64,
}

/// Outcome of a remote lookup.
#[derive(Debug, PartialEq)]
pub enum Fetch {
    /// The verified payload.
    Hit(Vec<u8>),
    /// Not there, or not usable (corrupt, another key's, unreachable, disabled).
    Miss,
}

/// The remote is used.
const HEALTHY: u8 = 0;
/// It failed once; a probe decides.
const SUSPENDED: u8 = 1;
/// It is not used again in this run.
const DROPPED: u8 = 2;

/// What went wrong with an exchange.
enum Trouble {
    /// Not there.
    NotFound,
    /// 401 or 403.
    Refused(u16),
    /// The network or the server failed.
    Failed(String),
    /// The server answered, with something unusable (a miss, not a failure of the server).
    Unusable(String),
}

struct Shared {
    cfg: RemoteConfig,
    /// The URL without credentials, for messages.
    shown: String,
    agent: ureq::Agent,
    health: AtomicU8,
    /// Counts the times the remote became healthy, so a failure of a request started before the
    /// probe succeeded does not count against it.
    epoch: AtomicU64,
    probed: AtomicBool,
    /// Why the remote was suspended, for the warning if the run ends before the probe does.
    suspended_because: Mutex<String>,
    read_only: AtomicBool,
    /// Warned once that the remote holds records of an earlier autopar.
    warned_old: AtomicBool,
    hits: AtomicU64,
    misses: AtomicU64,
    errors: AtomicU64,
    rejected: AtomicU64,
    uploads: AtomicU64,
    uploads_dropped: AtomicU64,
    waits: Waits,
}

/// The union of the intervals during which some caller waited on the remote.
#[derive(Default)]
struct Waits {
    /// Callers waiting now, and since when one has been.
    open: Mutex<(usize, Option<Instant>)>,
    /// Closed stretches, microseconds.
    total_us: AtomicU64,
}

impl Waits {
    /// Counts the time until the returned guard is dropped.
    fn begin(&self) -> WaitGuard<'_> {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        if open.0 == 0 {
            open.1 = Some(Instant::now());
        }
        open.0 += 1;
        WaitGuard(self)
    }

    /// Waited so far, the stretch still open included.
    fn total(&self) -> Duration {
        let open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let running = open.1.map_or(Duration::ZERO, |t| t.elapsed());
        Duration::from_micros(self.total_us.load(Ordering::Relaxed)) + running
    }
}

/// One caller's wait (see [`Waits::begin`]).
struct WaitGuard<'a>(&'a Waits);

impl Drop for WaitGuard<'_> {
    fn drop(&mut self) {
        let mut open = self.0.open.lock().unwrap_or_else(|e| e.into_inner());
        open.0 -= 1;
        if open.0 == 0
            && let Some(since) = open.1.take()
        {
            let us = u64::try_from(since.elapsed().as_micros()).unwrap_or(u64::MAX);
            self.0.total_us.fetch_add(us, Ordering::Relaxed);
        }
    }
}

/// The remote cache client (cheap to clone: clones share the connection pool and the state).
#[derive(Clone)]
pub struct RemoteCache {
    shared: Arc<Shared>,
}

/// The URL without `user:password@`.
fn redact(url: &str) -> String {
    match url.split_once("://") {
        Some((scheme, rest)) => {
            let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
            let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
            format!("{scheme}://{host}{path}")
        }
        None => url.to_string(),
    }
}

/// Checks that `pem` holds at least one certificate; returns how many.
pub fn check_ca(pem: &[u8]) -> Result<usize, String> {
    let mut n = 0;
    for item in ureq::tls::parse_pem(pem) {
        match item {
            Ok(ureq::tls::PemItem::Certificate(_)) => n += 1,
            Ok(_) => {}
            Err(e) => return Err(e.to_string()),
        }
    }
    if n == 0 {
        return Err("no PEM certificate found".into());
    }
    Ok(n)
}

impl RemoteCache {
    /// A client for `cfg`.
    pub fn new(cfg: RemoteConfig) -> Self {
        let mut builder = ureq::Agent::config_builder()
            .timeout_resolve(Some(cfg.connect_timeout))
            .timeout_connect(Some(cfg.connect_timeout))
            .timeout_send_request(Some(cfg.timeout))
            .timeout_recv_response(Some(cfg.timeout))
            .timeout_send_body(Some(cfg.timeout))
            .timeout_recv_body(Some(cfg.timeout))
            .http_status_as_error(false)
            .user_agent(concat!("autopar/", env!("CARGO_PKG_VERSION")));
        if let Some(pem) = &cfg.ca_pem {
            let certs: Vec<_> = ureq::tls::parse_pem(pem)
                .filter_map(|item| match item {
                    Ok(ureq::tls::PemItem::Certificate(c)) => Some(c),
                    _ => None,
                })
                .collect();
            builder = builder.tls_config(
                ureq::tls::TlsConfig::builder()
                    .root_certs(ureq::tls::RootCerts::Specific(Arc::new(certs)))
                    .build(),
            );
        }
        let agent = builder.build().into();
        RemoteCache {
            shared: Arc::new(Shared {
                read_only: AtomicBool::new(cfg.mode == Mode::Ro),
                shown: redact(&cfg.url),
                cfg,
                agent,
                health: AtomicU8::new(HEALTHY),
                epoch: AtomicU64::new(0),
                probed: AtomicBool::new(false),
                suspended_because: Mutex::new(String::new()),
                warned_old: AtomicBool::new(false),
                hits: AtomicU64::new(0),
                misses: AtomicU64::new(0),
                errors: AtomicU64::new(0),
                rejected: AtomicU64::new(0),
                uploads: AtomicU64::new(0),
                uploads_dropped: AtomicU64::new(0),
                waits: Waits::default(),
            }),
        }
    }

    /// The base URL (without credentials), for messages.
    pub fn url(&self) -> &str {
        &self.shared.shown
    }

    /// Counts so far.
    pub fn stats(&self) -> RemoteStats {
        let s = &self.shared;
        RemoteStats {
            hits: s.hits.load(Ordering::Relaxed),
            misses: s.misses.load(Ordering::Relaxed),
            errors: s.errors.load(Ordering::Relaxed),
            rejected: s.rejected.load(Ordering::Relaxed),
            uploads: s.uploads.load(Ordering::Relaxed),
            uploads_dropped: s.uploads_dropped.load(Ordering::Relaxed),
            waited_ms: u64::try_from(s.waits.total().as_millis()).unwrap_or(u64::MAX),
        }
    }

    /// Whether the remote is in use (not suspended or dropped).
    pub fn healthy(&self) -> bool {
        self.shared.health.load(Ordering::Acquire) == HEALTHY
    }

    fn miss(&self) -> Fetch {
        self.shared.misses.fetch_add(1, Ordering::Relaxed);
        Fetch::Miss
    }

    /// The verified payload of the result under `key`.
    pub fn get(&self, key: &Key) -> Fetch {
        if !self.healthy() {
            return self.miss();
        }
        let epoch = self.shared.epoch.load(Ordering::Acquire);
        let s = self.shared.clone();
        let k = *key;
        let Some(answer) = self.wait(move || s.fetch(&k)) else {
            return self.miss();
        };
        match answer {
            Ok(payload) => {
                self.shared.hits.fetch_add(1, Ordering::Relaxed);
                Fetch::Hit(payload)
            }
            Err(Trouble::NotFound) => self.miss(),
            Err(Trouble::Unusable(why)) => {
                let n = self.shared.rejected.fetch_add(1, Ordering::Relaxed) + 1;
                if n <= NAMED_REJECTIONS {
                    tracing::warn!(
                        key = %key.hex(),
                        remote = %self.url(),
                        "remote cache entry ignored: {why}{}",
                        if n == NAMED_REJECTIONS {
                            "; further ones are counted in the summary"
                        } else {
                            ""
                        }
                    );
                }
                self.miss()
            }
            Err(Trouble::Refused(status)) => {
                self.shared.errors.fetch_add(1, Ordering::Relaxed);
                if self.shared.health.swap(DROPPED, Ordering::AcqRel) != DROPPED {
                    tracing::warn!(
                        "remote cache {} refuses reads (HTTP {status}); continuing without it",
                        self.url()
                    );
                }
                self.miss()
            }
            Err(Trouble::Failed(why)) => {
                self.failed(epoch, &why, *key);
                self.miss()
            }
        }
    }

    /// Runs `work` on a thread of its own and waits for it while the remote stays healthy;
    /// `None` when the remote was suspended or dropped meanwhile (the work is abandoned).
    fn wait<R: Send + 'static>(&self, work: impl FnOnce() -> R + Send + 'static) -> Option<R> {
        let (tx, rx) = sync_channel(1);
        let spawned = std::thread::Builder::new()
            .name("autopar-remote".into())
            .spawn(move || {
                let _ = tx.send(work());
            });
        if spawned.is_err() {
            return None;
        }
        let _waiting = self.shared.waits.begin();
        loop {
            match rx.recv_timeout(POLL) {
                Ok(r) => return Some(r),
                Err(RecvTimeoutError::Timeout) if self.healthy() => {}
                Err(_) => return None,
            }
        }
    }

    /// A request started in `epoch` failed: the first failure suspends the remote and probes it
    /// once in the background; a failure after that drops it for the rest of the run.
    fn failed(&self, epoch: u64, why: &str, probe_key: Key) {
        let s = &self.shared;
        s.errors.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(remote = %self.url(), %why, "remote cache request failed");
        if s.epoch.load(Ordering::Acquire) != epoch {
            return;
        }
        if s.health
            .compare_exchange(HEALTHY, SUSPENDED, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return;
        }
        *s.suspended_because
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = why.to_string();
        if s.probed.swap(true, Ordering::AcqRel) {
            self.drop_remote(why);
            return;
        }
        let me = self.clone();
        let why = why.to_string();
        let spawned = std::thread::Builder::new()
            .name("autopar-remote-probe".into())
            .spawn(move || match me.shared.fetch_ac(&probe_key) {
                Ok(_) | Err(Trouble::NotFound) | Err(Trouble::Unusable(_)) => {
                    tracing::debug!(remote = %me.url(), "remote cache answered the probe; using it again");
                    me.shared.epoch.fetch_add(1, Ordering::AcqRel);
                    me.shared.health.store(HEALTHY, Ordering::Release);
                }
                Err(Trouble::Refused(s)) => me.drop_remote(&format!("HTTP {s}")),
                Err(Trouble::Failed(again)) => {
                    me.shared.errors.fetch_add(1, Ordering::Relaxed);
                    if again == why {
                        me.drop_remote(&format!("twice: {why}"));
                    } else {
                        me.drop_remote(&format!("{why}; then {again}"));
                    }
                }
            });
        if spawned.is_err() {
            self.drop_remote("no thread for the probe");
        }
    }

    /// Ends the run's use of the remote: one still suspended (its probe has not answered) is
    /// reported as dropped, so every failing remote is named once.
    pub fn settle(&self) {
        if self.shared.health.load(Ordering::Acquire) == SUSPENDED {
            let why = self
                .shared
                .suspended_because
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            self.drop_remote(&why);
        }
    }

    fn drop_remote(&self, why: &str) {
        if self.shared.health.swap(DROPPED, Ordering::AcqRel) != DROPPED {
            tracing::warn!(
                "remote cache {} failed ({why}); continuing without it for the rest of this run",
                self.url()
            );
        }
    }

    /// Uploads a result: its record to the CAS, then the action-cache entry. Returns whether
    /// both were stored.
    pub fn put(&self, key: &Key, kind: &str, payload: &[u8]) -> bool {
        let s = &self.shared;
        if !self.healthy() || s.read_only.load(Ordering::Relaxed) {
            return false;
        }
        let epoch = s.epoch.load(Ordering::Acquire);
        let blob = record::seal(key, payload);
        let steps = [
            (s.address("cas", &sha256_hex(&blob)), blob.clone()),
            (s.address("ac", &key.hex()), action_result(kind, &blob)),
        ];
        for (url, body) in &steps {
            match s.send(url, body) {
                Ok(()) => {}
                Err(Trouble::Refused(status)) => {
                    s.errors.fetch_add(1, Ordering::Relaxed);
                    if !s.read_only.swap(true, Ordering::Relaxed) {
                        tracing::warn!(
                            "remote cache {} refuses writes (HTTP {status}); reading only for this run",
                            self.url()
                        );
                    }
                    return false;
                }
                Err(Trouble::Failed(why) | Trouble::Unusable(why)) => {
                    self.failed(epoch, &why, *key);
                    return false;
                }
                Err(Trouble::NotFound) => {
                    self.failed(epoch, &format!("PUT {}: HTTP 404", redact(url)), *key);
                    return false;
                }
            }
        }
        s.uploads.fetch_add(1, Ordering::Relaxed);
        true
    }
}

/// Subtracts `n` from `a`, stopping at zero (jobs still running when [`Uploader::finish`]
/// gave up on them finish later).
fn take(a: &AtomicU64, n: u64) {
    let _ = a.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
        Some(v.saturating_sub(n))
    });
}

impl Shared {
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

    /// The time a transfer of `bytes` may take.
    fn allowance(&self, bytes: u64) -> Duration {
        self.cfg.timeout + Duration::from_micros(bytes.saturating_mul(1_000_000) / MIN_RATE)
    }

    fn get_bytes(&self, url: &str, limit: u64) -> Result<Vec<u8>, Trouble> {
        let req = self
            .authorized(self.agent.get(url))
            .config()
            .timeout_recv_body(Some(self.allowance(limit)))
            .build();
        let shown = redact(url);
        match req.call() {
            Ok(mut resp) => match resp.status().as_u16() {
                200 => resp
                    .body_mut()
                    .with_config()
                    .limit(limit)
                    .read_to_vec()
                    .map_err(|e| Trouble::Failed(format!("reading {shown}: {e}"))),
                404 => Err(Trouble::NotFound),
                s @ (401 | 403) => Err(Trouble::Refused(s)),
                s => Err(Trouble::Failed(format!("GET {shown}: HTTP {s}"))),
            },
            Err(e) => Err(Trouble::Failed(format!("GET {shown}: {e}"))),
        }
    }

    fn send(&self, url: &str, body: &[u8]) -> Result<(), Trouble> {
        let req = self
            .authorized(self.agent.put(url))
            .config()
            .timeout_send_body(Some(self.allowance(body.len() as u64)))
            .build();
        let shown = redact(url);
        match req.send(body) {
            Ok(resp) => match resp.status().as_u16() {
                200..=299 => Ok(()),
                s @ (401 | 403) => Err(Trouble::Refused(s)),
                s => Err(Trouble::Failed(format!("PUT {shown}: HTTP {s}"))),
            },
            Err(e) => Err(Trouble::Failed(format!("PUT {shown}: {e}"))),
        }
    }

    /// The CAS blob the action-cache entry of `key` names: (SHA-256, size).
    fn fetch_ac(&self, key: &Key) -> Result<(String, u64), Trouble> {
        let ac = self.get_bytes(&self.address("ac", &key.hex()), MAX_AC_BYTES)?;
        blob_of(&ac).ok_or_else(|| Trouble::Unusable("not a valid ActionResult".into()))
    }

    /// The payload of the result under `key`, checked against the blob's hash and the key.
    fn fetch(&self, key: &Key) -> Result<Vec<u8>, Trouble> {
        let (hash, size) = self.fetch_ac(key)?;
        if size > MAX_BLOB_BYTES {
            return Err(Trouble::Unusable(format!(
                "its blob is {size} bytes, more than the {MAX_BLOB_BYTES} autopar reads"
            )));
        }
        let blob = self.get_bytes(&self.address("cas", &hash), size + 1)?;
        if blob.len() as u64 != size || sha256_hex(&blob) != hash {
            return Err(Trouble::Unusable(format!(
                "blob {hash} does not match its hash; recomputed"
            )));
        }
        match record::open(key, &blob) {
            Ok(payload) => Ok(payload.into_owned()),
            Err(RecordError::OldLayout) => {
                if !self.warned_old.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        "remote cache {} holds results of an earlier autopar; they are recomputed",
                        self.shown
                    );
                }
                Err(Trouble::NotFound)
            }
            Err(e) => Err(Trouble::Unusable(format!(
                "the entry is not the result of this key: {e}"
            ))),
        }
    }
}

/// One result to upload.
struct Job {
    key: Key,
    kind: String,
    payload: Vec<u8>,
}

/// The queue and its counts, shared with the upload threads.
struct Queue {
    tx: Mutex<Option<SyncSender<Job>>>,
    /// Jobs submitted and not finished (uploaded, failed or skipped).
    pending: AtomicU64,
    /// Bytes of those jobs.
    bytes: AtomicU64,
}

/// Uploads results in the background through a bounded queue: a full queue drops the upload
/// (the result is still cached locally) rather than slow the build down.
pub struct Uploader {
    remote: RemoteCache,
    queue: Arc<Queue>,
    done: Mutex<Vec<Receiver<()>>>,
}

impl Uploader {
    /// Starts the upload threads for `remote`, queueing at most `capacity` results.
    pub fn start(remote: RemoteCache, capacity: usize) -> Self {
        let (tx, rx) = sync_channel::<Job>(capacity.max(1));
        let rx = Arc::new(Mutex::new(rx));
        let queue = Arc::new(Queue {
            tx: Mutex::new(Some(tx)),
            pending: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
        });
        let mut done = Vec::new();
        for _ in 0..UPLOAD_THREADS {
            let (done_tx, done_rx) = sync_channel::<()>(1);
            let (rx, remote, queue) = (rx.clone(), remote.clone(), queue.clone());
            let spawned = std::thread::Builder::new()
                .name("autopar-upload".into())
                .spawn(move || {
                    loop {
                        let job = rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
                        let Ok(job) = job else { break };
                        if !remote.put(&job.key, &job.kind, &job.payload) {
                            remote
                                .shared
                                .uploads_dropped
                                .fetch_add(1, Ordering::Relaxed);
                        }
                        take(&queue.bytes, job.payload.len() as u64);
                        take(&queue.pending, 1);
                    }
                    let _ = done_tx.send(());
                });
            if spawned.is_ok() {
                done.push(done_rx);
            }
        }
        Uploader {
            remote,
            queue,
            done: Mutex::new(done),
        }
    }

    /// Queues an upload; `false` when it was dropped (the queue is full or closed, or the
    /// remote is not in use).
    pub fn submit(&self, key: Key, kind: &str, payload: Vec<u8>) -> bool {
        let s = &self.remote.shared;
        let size = payload.len() as u64;
        let usable = self.remote.healthy() && !s.read_only.load(Ordering::Relaxed);
        let room = self.queue.bytes.load(Ordering::Relaxed) + size <= UPLOAD_QUEUE_BYTES;
        let sent = usable
            && room
            && self
                .queue
                .tx
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_ref()
                .is_some_and(|tx| {
                    self.queue.pending.fetch_add(1, Ordering::Relaxed);
                    self.queue.bytes.fetch_add(size, Ordering::Relaxed);
                    let sent = tx
                        .try_send(Job {
                            key,
                            kind: kind.to_string(),
                            payload,
                        })
                        .is_ok();
                    if !sent {
                        take(&self.queue.pending, 1);
                        take(&self.queue.bytes, size);
                    }
                    sent
                });
        // A read-only remote is not a dropped upload: nothing was meant to be sent.
        if !sent && !s.read_only.load(Ordering::Relaxed) {
            s.uploads_dropped.fetch_add(1, Ordering::Relaxed);
        }
        sent
    }

    /// Closes the queue and waits until `deadline` for the uploads already queued, and not at
    /// all once the remote is out of use; what is left is counted as dropped. Returns whether
    /// every upload finished.
    pub fn finish(&self, deadline: Instant) -> bool {
        drop(
            self.queue
                .tx
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take(),
        );
        let done = std::mem::take(&mut *self.done.lock().unwrap_or_else(|e| e.into_inner()));
        let _waiting = self.remote.shared.waits.begin();
        let mut finished = true;
        for rx in done {
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                match rx.recv_timeout(left.min(POLL)) {
                    Ok(()) | Err(RecvTimeoutError::Disconnected) => break,
                    Err(RecvTimeoutError::Timeout) if left > POLL && self.remote.healthy() => {}
                    Err(RecvTimeoutError::Timeout) => {
                        finished = false;
                        break;
                    }
                }
            }
            if !finished {
                break;
            }
        }
        if !finished {
            let left = self.queue.pending.swap(0, Ordering::Relaxed);
            self.remote
                .shared
                .uploads_dropped
                .fetch_add(left, Ordering::Relaxed);
        }
        finished
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_never_reach_messages() {
        assert_eq!(
            redact("https://alice:s3cret@cache.example:9092/team"),
            "https://cache.example:9092/team"
        );
        assert_eq!(redact("http://127.0.0.1:9092"), "http://127.0.0.1:9092");
        assert_eq!(redact("not a url"), "not a url");
    }

    #[test]
    fn overlapping_waits_count_once() {
        let waits = Waits::default();
        let start = Instant::now();
        {
            let _a = waits.begin();
            std::thread::sleep(Duration::from_millis(30));
            let _b = waits.begin();
            std::thread::sleep(Duration::from_millis(30));
        }
        let both = start.elapsed();
        let counted = waits.total();
        // The two overlapping waits are one stretch: never more than the time they spanned,
        // not the 90 ms their sum would be.
        assert!(
            counted >= Duration::from_millis(60) && counted <= both,
            "{counted:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(waits.total(), counted, "nothing counts while nobody waits");
    }

    #[test]
    fn a_ca_file_must_hold_a_certificate() {
        assert!(check_ca(b"nothing here").is_err());
    }
}
