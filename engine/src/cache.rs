//! Memoized results: looked up in process memory, then in the local store, else solved and
//! stored, with counts of each outcome (the summary every build ends with).

use autopar_rules::canonical::Digest;
use autopar_store::remote::{Fetch, RemoteCache, Uploader};
pub use autopar_store::remote::{Mode, RemoteConfig, RemoteStats};
pub use autopar_store::{CacheStats, EntryMeta, GcReport, LocalCache, Repair, VerifyReport};
use autopar_store::{Key, Lookup};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Where a result came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    /// This process had it.
    Memory,
    /// The local store had it.
    Local,
    /// The remote cache had it.
    Remote,
    /// Nobody had it: computed.
    Solved,
}

impl Source {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Source::Memory => "memory",
            Source::Local => "local",
            Source::Remote => "remote",
            Source::Solved => "solved",
        }
    }
}

/// How many results a build asked for and where each came from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counts {
    /// Results asked for.
    pub total: u64,
    /// Found in process memory.
    pub memory: u64,
    /// Found in the local store.
    pub local: u64,
    /// Found in the remote cache.
    pub remote: u64,
    /// Computed.
    pub solved: u64,
}

impl Counts {
    fn add(&mut self, source: Source) {
        self.total += 1;
        *match source {
            Source::Memory => &mut self.memory,
            Source::Local => &mut self.local,
            Source::Remote => &mut self.remote,
            Source::Solved => &mut self.solved,
        } += 1;
    }
}

/// Kinds of result the cache counts apart ([`Cache::kind_counts`]).
pub mod kind {
    /// A per-layer intra-op table on one logical mesh (an ILP solve).
    pub const SHARDING: &str = "sharding";
    /// The stage DP over those tables for one micro-batch size, balanced and simulated.
    pub const STAGES: &str = "stages";
    /// The verdict that the layer tables of one micro-batch size's search need more work
    /// than a search may spend, keyed by those tables' keys.
    pub const TABLE_WORK: &str = "table-work";
    /// The fastest size's stages decoded (every op's specs) and compared with Megatron-LM's.
    pub const DECODE: &str = "decode";
    /// One layer's plan on one logical mesh with its boundary specs pinned (the decoding of
    /// one entry of its table).
    pub const LAYER_PLAN: &str = "layer-plan";
    /// A layer's cost under one Megatron-LM layout.
    pub const LAYER_COST: &str = "layer-cost";
    /// The Megatron-LM layout search (splits, SAPP balancing and simulation included).
    pub const SEARCH: &str = "search";
    /// A target's plan, found under the key of its inputs as written.
    pub const PLAN: &str = "plan";
    /// A lowered program of `autopar run`.
    pub const PROGRAM: &str = "program";
}

#[derive(Default)]
struct Counters {
    total: AtomicU64,
    memory: AtomicU64,
    local: AtomicU64,
    remote: AtomicU64,
    solved: AtomicU64,
    kinds: Mutex<std::collections::BTreeMap<&'static str, Counts>>,
}

/// The local cache directory of `ws`: `dir` when given (flag or `AUTOPAR_CACHE_DIR`), else
/// `[cache] dir`, else `.autopar/cache` next to the workspace file.
pub fn cache_dir(dir: Option<&Path>, ws: &crate::workspace::Workspace) -> std::path::PathBuf {
    match (dir, &ws.cache.dir) {
        (Some(d), _) => d.to_path_buf(),
        (None, Some(d)) => d.clone(),
        (None, None) => ws.root.join(".autopar").join("cache"),
    }
}

/// Remote-cache settings given on the command line or in the environment (flags win over the
/// environment, both over `[cache]` in `workspace.toml`).
#[derive(Clone, Debug, Default)]
pub struct RemoteFlags {
    /// Base URL.
    pub url: Option<String>,
    /// Read-write or read-only.
    pub mode: Option<Mode>,
    /// File with the bearer token.
    pub token_file: Option<std::path::PathBuf>,
    /// Read timeout, ms.
    pub timeout_ms: Option<u64>,
    /// Connect timeout, ms.
    pub connect_timeout_ms: Option<u64>,
    /// Instance prefix.
    pub instance: Option<String>,
    /// PEM file of the certificates to trust for `https`.
    pub ca_file: Option<std::path::PathBuf>,
}

/// The remote cache to use, if any: `flags` over `[cache]`; the token from
/// `AUTOPAR_REMOTE_TOKEN`, else the token file.
pub fn remote_config(
    flags: &RemoteFlags,
    ws: &crate::workspace::Workspace,
) -> Result<Option<RemoteConfig>, crate::EngineError> {
    let c = &ws.cache;
    let Some(url) = flags.url.clone().or_else(|| c.remote.clone()) else {
        return Ok(None);
    };
    let mode = flags.mode.unwrap_or(match c.remote_mode.as_deref() {
        Some("ro") => Mode::Ro,
        _ => Mode::Rw,
    });
    let token = match std::env::var("AUTOPAR_REMOTE_TOKEN") {
        Ok(t) if !t.trim().is_empty() => Some(t.trim().to_string()),
        _ => match flags.token_file.as_ref().or(c.token_file.as_ref()) {
            Some(path) => Some(crate::input::read_text(path)?.trim().to_string()),
            None => None,
        },
    };
    let ca_pem = match flags.ca_file.as_ref().or(c.ca_file.as_ref()) {
        Some(path) => {
            let pem = crate::input::read_text(path)?.into_bytes();
            autopar_store::remote::check_ca(&pem).map_err(|reason| {
                crate::EngineError::Argument {
                    flag: "--remote-ca-file",
                    expected: "a PEM file of one or more certificates".into(),
                    found: format!("{} ({reason})", path.display()),
                }
            })?;
            Some(pem)
        }
        None => None,
    };
    let ms = |flag: Option<u64>, ws: Option<u64>, default: Duration| {
        flag.or(ws).map_or(default, Duration::from_millis)
    };
    Ok(Some(RemoteConfig {
        url,
        mode,
        token,
        connect_timeout: ms(
            flags.connect_timeout_ms,
            c.connect_timeout_ms,
            autopar_store::remote::CONNECT_TIMEOUT,
        ),
        timeout: ms(
            flags.timeout_ms,
            c.timeout_ms,
            autopar_store::remote::READ_TIMEOUT,
        ),
        instance: flags.instance.clone().or_else(|| c.instance.clone()),
        ca_pem,
    }))
}

/// How long a build waits for another `autopar` process to release the local store.
pub const LOCK_WAIT: Duration = Duration::from_secs(30);

/// Largest result kept in process memory when the local store holds it too.
const MAX_REMEMBERED_BYTES: usize = 256 * 1024;

/// Results kept in process memory, shareable between the caches of successive builds (`watch`).
pub type Memory = Arc<Mutex<HashMap<Digest, Arc<Vec<u8>>>>>;

/// Results queued for upload at most; more are dropped (they stay in the local store).
pub const UPLOAD_QUEUE: usize = 4096;

/// How long a finished build waits for its uploads before it exits; what is left is dropped
/// and counted (the results stay in the local store).
pub const UPLOAD_DEADLINE: Duration = Duration::from_millis(1500);

/// The memo of results: process memory over an optional local store over an optional remote.
pub struct Cache {
    local: Option<LocalCache>,
    /// Cleared by the first failed write: a full or read-only disk is reported once, and not
    /// written to again in this process.
    local_writable: AtomicBool,
    /// Set by the first failure of the local store, read or write: the only one reported.
    local_warned: AtomicBool,
    memory: Memory,
    remote: Option<(RemoteCache, Uploader)>,
    counters: Counters,
}

fn key(d: Digest) -> Key {
    Key(d.0)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Cache {
    /// A cache in memory only.
    pub fn in_memory() -> Self {
        Cache::with_memory(Memory::default())
    }

    /// A cache over results already in `memory` (kept by a long-running process).
    pub fn with_memory(memory: Memory) -> Self {
        Cache {
            local: None,
            local_writable: AtomicBool::new(true),
            local_warned: AtomicBool::new(false),
            memory,
            remote: None,
            counters: Counters::default(),
        }
    }

    /// The same cache, also reading from and uploading to the remote `cfg` describes.
    pub fn with_remote(mut self, cfg: RemoteConfig) -> Self {
        let remote = RemoteCache::new(cfg);
        let uploader = Uploader::start(remote.clone(), UPLOAD_QUEUE);
        self.remote = Some((remote, uploader));
        self
    }

    /// What the remote did (`None` without one).
    pub fn remote_stats(&self) -> Option<RemoteStats> {
        self.remote.as_ref().map(|(r, _)| r.stats())
    }

    /// Waits up to `wait` for queued uploads (the build's results are written already), and
    /// not at all once the remote is out of use; says so when some did not finish. What was not
    /// uploaded is counted in [`RemoteStats::uploads_dropped`].
    pub fn finish_uploads(&self, wait: Duration) {
        if let Some((remote, uploader)) = &self.remote {
            if !uploader.finish(Instant::now() + wait) && remote.healthy() {
                tracing::warn!(
                    "uploads to {} did not finish within {:.1} s; the rest are dropped (the \
                     results stay in the local cache)",
                    remote.url(),
                    wait.as_secs_f64()
                );
            }
            remote.settle();
        }
    }

    /// A cache backed by the local store at `dir`. A store that cannot be opened (held by
    /// another process past [`LOCK_WAIT`], unreadable) is reported and the build goes on without
    /// it: a cache problem never fails a build.
    pub fn open(dir: &Path) -> Self {
        Cache::open_with_memory(dir, Memory::default())
    }

    /// [`Cache::open`] over results already in `memory`.
    pub fn open_with_memory(dir: &Path, memory: Memory) -> Self {
        let mut cache = Cache::with_memory(memory);
        match LocalCache::open(dir, LOCK_WAIT) {
            Ok(local) => cache.local = Some(local),
            Err(e) => tracing::warn!("working without the local cache: {e}: {}", e.source),
        }
        cache
    }

    /// The results in process memory, to hand to the next build's cache.
    pub fn memory(&self) -> Memory {
        self.memory.clone()
    }

    /// The local store, if open.
    pub fn local(&self) -> Option<&LocalCache> {
        self.local.as_ref()
    }

    /// Counts since the cache was made (or last reset).
    pub fn counts(&self) -> Counts {
        let c = &self.counters;
        Counts {
            total: c.total.load(Ordering::Relaxed),
            memory: c.memory.load(Ordering::Relaxed),
            local: c.local.load(Ordering::Relaxed),
            remote: c.remote.load(Ordering::Relaxed),
            solved: c.solved.load(Ordering::Relaxed),
        }
    }

    /// Counts since the cache was made (or last reset), per kind of result ([`kind`]).
    pub fn kind_counts(&self) -> std::collections::BTreeMap<&'static str, Counts> {
        lock(&self.counters.kinds).clone()
    }

    /// Starts counting from zero (a new build in a long-running process).
    pub fn reset_counts(&self) {
        let c = &self.counters;
        for a in [&c.total, &c.memory, &c.local, &c.remote, &c.solved] {
            a.store(0, Ordering::Relaxed);
        }
        lock(&c.kinds).clear();
    }

    fn count(&self, kind: &'static str, source: Source) {
        let c = &self.counters;
        lock(&c.kinds).entry(kind).or_default().add(source);
        c.total.fetch_add(1, Ordering::Relaxed);
        match source {
            Source::Memory => &c.memory,
            Source::Local => &c.local,
            Source::Remote => &c.remote,
            Source::Solved => &c.solved,
        }
        .fetch_add(1, Ordering::Relaxed);
    }

    /// The value under `k` from memory or the local store, without counting.
    fn find<T: DeserializeOwned>(&self, k: Digest) -> Option<(T, Source)> {
        let cached = lock(&self.memory).get(&k).cloned();
        if let Some(bytes) = cached
            && let Ok(v) = postcard::from_bytes(&bytes)
        {
            return Some((v, Source::Memory));
        }
        if let Some(local) = &self.local {
            match local.get(&key(k)) {
                Ok(Lookup::Hit(bytes)) => match postcard::from_bytes(&bytes) {
                    Ok(v) => {
                        self.remember(k, bytes);
                        return Some((v, Source::Local));
                    }
                    Err(e) => {
                        // Intact bytes of another layout (an older autopar): drop them.
                        tracing::warn!(key = %k, error = %e, "undecodable cache entry removed");
                        let _ = local.remove(&key(k));
                    }
                },
                Ok(Lookup::Miss) | Ok(Lookup::Corrupt) => {}
                Err(e) => {
                    if !self.local_warned.swap(true, Ordering::Relaxed) {
                        tracing::warn!(
                            "cannot read the local cache ({e}: {}); recomputing",
                            e.source
                        );
                    }
                }
            }
        }
        let (remote, _) = self.remote.as_ref()?;
        let Fetch::Hit(bytes) = remote.get(&key(k)) else {
            return None;
        };
        let v = match postcard::from_bytes(&bytes) {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(key = %k, error = %e, "remote cache entry does not decode; ignored");
                return None;
            }
        };
        // A verified remote hit is kept locally, so the next build finds it there.
        let meta = EntryMeta {
            kind: "remote".into(),
            description: format!("copied from {}", remote.url()),
            ..EntryMeta::default()
        };
        self.store_locally(k, &bytes, &meta);
        self.remember(k, bytes);
        Some((v, Source::Remote))
    }

    /// Whether a result is known (for `--dry-run`), without counting or verifying it.
    pub fn contains(&self, k: Digest) -> bool {
        lock(&self.memory).contains_key(&k)
            || self
                .local
                .as_ref()
                .is_some_and(|l| l.contains(&key(k)).unwrap_or(false))
    }

    /// Writes a result to the local store, unless an earlier write failed: the first failure
    /// is the one warning, and the store is not written again in this process.
    fn store_locally(&self, k: Digest, bytes: &[u8], meta: &EntryMeta) {
        self.write_locally(|local| local.put(&key(k), bytes, meta));
    }

    /// Runs a write on the local store while it is writable; the first failure stops further
    /// writes and, unless the store already failed otherwise, is the one warning.
    fn write_locally(
        &self,
        write: impl FnOnce(&LocalCache) -> Result<(), autopar_store::StoreError>,
    ) {
        let Some(local) = &self.local else { return };
        if !self.local_writable.load(Ordering::Relaxed) {
            return;
        }
        if let Err(e) = write(local)
            && self.local_writable.swap(false, Ordering::Relaxed)
            && !self.local_warned.swap(true, Ordering::Relaxed)
        {
            tracing::warn!(
                "cannot write the local cache ({e}: {}); results of this run are kept in memory \
                 only",
                e.source
            );
        }
    }

    /// Stores a value in memory and in the local store, and queues its upload.
    pub fn put<T: Serialize>(&self, k: Digest, value: &T, meta: &EntryMeta) {
        let bytes = autopar_rules::canonical::encode(value);
        self.store_locally(k, &bytes, meta);
        if let Some((_, uploader)) = &self.remote {
            uploader.submit(key(k), &meta.kind, bytes.clone());
        }
        self.remember(k, bytes);
    }

    /// Keeps a result in process memory, unless it is large and the local store holds it: a
    /// 2D mesh's layer table is over a megabyte, read once per build, and a workspace solves
    /// hundreds of them (`watch` then reads them back from the store).
    fn remember(&self, k: Digest, bytes: Vec<u8>) {
        let stored = self.local.is_some() && self.local_writable.load(Ordering::Relaxed);
        if bytes.len() > MAX_REMEMBERED_BYTES && stored {
            return;
        }
        lock(&self.memory).insert(k, Arc::new(bytes));
    }

    /// The value under `k`, counted as a request: from memory, the store, or `solve` (whose
    /// result is stored with the metadata `meta` gives).
    pub fn get_or_solve<T: Serialize + DeserializeOwned>(
        &self,
        kind: &'static str,
        k: Digest,
        meta: impl FnOnce() -> EntryMeta,
        solve: impl FnOnce() -> T,
    ) -> (T, Source) {
        if let Some((v, source)) = self.find(k) {
            self.count(kind, source);
            return (v, source);
        }
        let v = solve();
        self.put(k, &v, &meta());
        self.count(kind, Source::Solved);
        (v, Source::Solved)
    }

    /// Looks up `k`, counting a hit; a miss is not counted (the caller solves or resolves it
    /// another way and reports that with [`Cache::record`]).
    pub fn lookup<T: DeserializeOwned>(
        &self,
        kind: &'static str,
        k: Digest,
    ) -> Option<(T, Source)> {
        let found = self.find(k);
        if let Some((_, source)) = &found {
            self.count(kind, *source);
        }
        found
    }

    /// Follows the index entry under `index` (a key) to the value it names, counting one hit;
    /// `None` (uncounted) when either is missing.
    pub fn lookup_indexed<T: DeserializeOwned>(
        &self,
        kind: &'static str,
        index: Digest,
    ) -> Option<(T, Source)> {
        let (target, s1) = self.find::<Digest>(index)?;
        let (v, s2) = self.find::<T>(target)?;
        let source = if s1 == Source::Remote || s2 == Source::Remote {
            Source::Remote
        } else if s1 == Source::Memory && s2 == Source::Memory {
            Source::Memory
        } else {
            Source::Local
        };
        self.count(kind, source);
        Some((v, source))
    }

    /// The value under `k` if known, uncounted (for `--dry-run` and tools).
    pub fn peek<T: DeserializeOwned>(&self, k: Digest) -> Option<T> {
        self.find(k).map(|(v, _)| v)
    }

    /// Counts a request resolved outside [`Cache::get_or_solve`].
    pub fn record(&self, kind: &'static str, source: Source) {
        self.count(kind, source);
    }

    /// Makes the store's writes durable.
    pub fn flush(&self) {
        self.write_locally(LocalCache::flush);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_then_store_then_solve() {
        let dir = tempfile::tempdir().expect("tempdir");
        let k = Digest([3; 32]);
        {
            let c = Cache::open(dir.path());
            let (v, s) = c.get_or_solve(kind::PLAN, k, EntryMeta::default, || 41u64);
            assert_eq!((v, s), (41, Source::Solved));
            let (v, s) = c.get_or_solve(kind::PLAN, k, EntryMeta::default, || 0u64);
            assert_eq!((v, s), (41, Source::Memory));
            c.flush();
            assert_eq!(
                c.counts(),
                Counts {
                    total: 2,
                    memory: 1,
                    local: 0,
                    remote: 0,
                    solved: 1
                }
            );
        }
        let c = Cache::open(dir.path());
        let (v, s) = c.get_or_solve(kind::PLAN, k, EntryMeta::default, || 0u64);
        assert_eq!((v, s), (41, Source::Local));
        c.record(kind::SEARCH, Source::Solved);
        let kinds = c.kind_counts();
        assert_eq!(kinds[kind::PLAN].local, 1);
        assert_eq!(kinds[kind::SEARCH].solved, 1);
        assert_eq!(kinds.len(), 2);
    }
}
