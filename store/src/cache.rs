//! The local content-addressed cache: planning results keyed by the blake3 of exactly their
//! inputs (the engine computes keys), in a sled database (by default `.autopar/cache`).
//!
//! Every value is stored in an envelope carrying the blake3 of its payload, checked on every
//! read: a mismatch is reported as corrupt, the entry is removed and the caller recomputes.
//! A value, its metadata and its last-use time are written in one transaction. sled's file lock
//! lets one process use a cache at a time; another `autopar` waits for it (see
//! [`LocalCache::open`]) rather than share it unsafely.

use crate::StoreError;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Marks an envelope of this layout.
const MAGIC: &[u8; 4] = b"APV1";
/// Magic, then the 32-byte blake3 of the payload.
const HEADER: usize = 4 + 32;

/// A cache key: the blake3 of a result's canonical inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key(pub [u8; 32]);

impl Key {
    /// Lower-case hex.
    pub fn hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// What the cache knows about an entry besides its value.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EntryMeta {
    /// Kind of result (`layer-cost`, `plan`, ...).
    pub kind: String,
    /// What the result is, for people (`block of gpt3-175b, mb 1, tp 8 sp, a100-80g`).
    pub description: String,
    /// Hashes of the profile signatures the result's inputs include, so a profile change can
    /// name the results it invalidates.
    #[serde(default)]
    pub reads: Vec<[u8; 32]>,
    /// Payload size, bytes.
    pub size: u64,
    /// When it was stored, ms since the Unix epoch.
    pub created_ms: u64,
}

/// Outcome of a lookup.
#[derive(Debug, PartialEq)]
pub enum Lookup {
    /// The verified payload.
    Hit(Vec<u8>),
    /// No entry.
    Miss,
    /// The stored bytes did not match their hash; the entry was removed.
    Corrupt,
}

/// Counts of a cache.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CacheStats {
    /// Entries per kind, sorted by kind.
    pub kinds: Vec<(String, u64, u64)>,
    /// All entries.
    pub entries: u64,
    /// Their payload bytes.
    pub bytes: u64,
    /// Size of the database on disk, bytes.
    pub disk_bytes: u64,
}

/// What `verify` found.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct VerifyReport {
    /// Entries checked.
    pub checked: u64,
    /// Corrupt entries, removed.
    pub removed: u64,
}

/// What `gc` did.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GcReport {
    /// Entries removed (least recently used first).
    pub removed: u64,
    /// Payload bytes freed.
    pub freed: u64,
    /// Payload bytes left.
    pub remaining: u64,
}

/// The local cache.
pub struct LocalCache {
    path: PathBuf,
    db: sled::Db,
    values: sled::Tree,
    meta: sled::Tree,
    used: sled::Tree,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn envelope(payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + payload.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(blake3::hash(payload).as_bytes());
    out.extend_from_slice(payload);
    out
}

/// The payload of an envelope, if it is intact.
fn open_envelope(bytes: &[u8]) -> Option<&[u8]> {
    if bytes.len() < HEADER || &bytes[..4] != MAGIC {
        return None;
    }
    let payload = &bytes[HEADER..];
    (blake3::hash(payload).as_bytes() == &bytes[4..HEADER]).then_some(payload)
}

fn io(e: sled::Error) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

impl LocalCache {
    /// Opens (creating) the cache at `dir`. While another process holds it, retries for up
    /// to `wait`; then fails with an error saying so. A database sled cannot read is moved
    /// aside (`<dir>.corrupt-<ms>`) and a fresh one created.
    pub fn open(dir: &Path, wait: Duration) -> Result<Self, StoreError> {
        let err = |action: &'static str| {
            let path = dir.to_path_buf();
            move |source: std::io::Error| StoreError {
                action,
                path,
                source,
            }
        };
        std::fs::create_dir_all(dir).map_err(err("creating cache directory"))?;
        let deadline = Instant::now() + wait;
        let db = loop {
            match sled::Config::new().path(dir).open() {
                Ok(db) => break db,
                Err(sled::Error::Io(e)) if is_lock_error(&e) && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(sled::Error::Io(e)) if is_lock_error(&e) => {
                    return Err(err("another autopar process holds the cache")(e));
                }
                Err(sled::Error::Corruption { .. }) => {
                    let aside = PathBuf::from(format!("{}.corrupt-{}", dir.display(), now_ms()));
                    tracing::warn!(
                        cache = %dir.display(),
                        moved_to = %aside.display(),
                        "the cache database is corrupt; starting a new one"
                    );
                    std::fs::rename(dir, &aside).map_err(err("moving a corrupt cache aside"))?;
                    std::fs::create_dir_all(dir).map_err(err("creating cache directory"))?;
                }
                Err(e) => return Err(err("opening cache")(io(e))),
            }
        };
        let tree = |name: &str| db.open_tree(name).map_err(|e| err("opening cache")(io(e)));
        Ok(LocalCache {
            path: dir.to_path_buf(),
            values: tree("values")?,
            meta: tree("meta")?,
            used: tree("used")?,
            db,
        })
    }

    /// Where the cache lives.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn error(&self, action: &'static str) -> impl FnOnce(sled::Error) -> StoreError + '_ {
        move |e| StoreError {
            action,
            path: self.path.clone(),
            source: io(e),
        }
    }

    /// The verified payload under `key`.
    pub fn get(&self, key: &Key) -> Result<Lookup, StoreError> {
        let Some(bytes) = self
            .values
            .get(key.0)
            .map_err(self.error("reading cache"))?
        else {
            return Ok(Lookup::Miss);
        };
        match open_envelope(&bytes) {
            Some(payload) => {
                let payload = payload.to_vec();
                // Last use, for gc; losing it costs nothing but eviction order.
                let _ = self.used.insert(key.0, &now_ms().to_be_bytes());
                Ok(Lookup::Hit(payload))
            }
            None => {
                tracing::warn!(key = %key.hex(), cache = %self.path.display(), "corrupt cache entry removed");
                self.remove(key)?;
                Ok(Lookup::Corrupt)
            }
        }
    }

    /// Whether an entry exists (without reading or verifying it).
    pub fn contains(&self, key: &Key) -> Result<bool, StoreError> {
        self.values
            .contains_key(key.0)
            .map_err(self.error("reading cache"))
    }

    /// Stores `payload` under `key` with `meta` (its size and creation time are filled in).
    pub fn put(&self, key: &Key, payload: &[u8], meta: &EntryMeta) -> Result<(), StoreError> {
        let meta = EntryMeta {
            size: payload.len() as u64,
            created_ms: now_ms(),
            ..meta.clone()
        };
        let meta_bytes = serde_json::to_vec(&meta).map_err(|e| StoreError {
            action: "encoding cache metadata",
            path: self.path.clone(),
            source: std::io::Error::other(e),
        })?;
        let value = envelope(payload);
        let used = now_ms().to_be_bytes();
        use sled::Transactional;
        (&self.values, &self.meta, &self.used)
            .transaction(|(v, m, u)| {
                v.insert(&key.0, value.as_slice())?;
                m.insert(&key.0, meta_bytes.as_slice())?;
                u.insert(&key.0, &used)?;
                Ok::<(), sled::transaction::ConflictableTransactionError<()>>(())
            })
            .map_err(|e| StoreError {
                action: "writing cache",
                path: self.path.clone(),
                source: std::io::Error::other(format!("{e:?}")),
            })
    }

    /// Removes an entry.
    pub fn remove(&self, key: &Key) -> Result<(), StoreError> {
        self.values
            .remove(key.0)
            .map_err(self.error("removing a cache entry"))?;
        self.meta
            .remove(key.0)
            .map_err(self.error("removing a cache entry"))?;
        self.used
            .remove(key.0)
            .map_err(self.error("removing a cache entry"))?;
        Ok(())
    }

    /// Makes every write so far durable.
    pub fn flush(&self) -> Result<(), StoreError> {
        self.db.flush().map_err(self.error("flushing cache"))?;
        Ok(())
    }

    /// Every entry's metadata.
    pub fn entries(&self) -> Result<Vec<(Key, EntryMeta)>, StoreError> {
        let mut out = Vec::new();
        for item in self.meta.iter() {
            let (k, v) = item.map_err(self.error("reading cache"))?;
            let Ok(key) = <[u8; 32]>::try_from(k.as_ref()) else {
                continue;
            };
            let meta: EntryMeta = serde_json::from_slice(&v).unwrap_or_default();
            out.push((Key(key), meta));
        }
        Ok(out)
    }

    /// Counts of entries and bytes.
    pub fn stats(&self) -> Result<CacheStats, StoreError> {
        let mut kinds: std::collections::BTreeMap<String, (u64, u64)> = Default::default();
        let mut stats = CacheStats::default();
        for (_, meta) in self.entries()? {
            let e = kinds.entry(meta.kind.clone()).or_default();
            e.0 += 1;
            e.1 += meta.size;
            stats.entries += 1;
            stats.bytes += meta.size;
        }
        stats.kinds = kinds.into_iter().map(|(k, (n, b))| (k, n, b)).collect();
        stats.disk_bytes = self
            .db
            .size_on_disk()
            .map_err(self.error("reading cache"))?;
        Ok(stats)
    }

    /// Reads and checks every value; removes the corrupt ones and metadata without a value.
    pub fn verify(&self) -> Result<VerifyReport, StoreError> {
        let mut report = VerifyReport::default();
        let mut bad = Vec::new();
        for item in self.values.iter() {
            let (k, v) = item.map_err(self.error("reading cache"))?;
            report.checked += 1;
            if open_envelope(&v).is_none() {
                bad.push(k);
            }
        }
        for item in self.meta.iter() {
            let (k, _) = item.map_err(self.error("reading cache"))?;
            if !self
                .values
                .contains_key(&k)
                .map_err(self.error("reading cache"))?
            {
                bad.push(k);
            }
        }
        for k in bad {
            if let Ok(key) = <[u8; 32]>::try_from(k.as_ref()) {
                tracing::warn!(key = %Key(key).hex(), "corrupt cache entry removed");
                self.remove(&Key(key))?;
                report.removed += 1;
            }
        }
        self.flush()?;
        Ok(report)
    }

    /// Removes least recently used entries until the payloads total at most `max_bytes`.
    pub fn gc(&self, max_bytes: u64) -> Result<GcReport, StoreError> {
        let mut entries: Vec<(u64, Key, u64)> = Vec::new();
        let mut total = 0u64;
        for (key, meta) in self.entries()? {
            let used = self
                .used
                .get(key.0)
                .map_err(self.error("reading cache"))?
                .and_then(|v| <[u8; 8]>::try_from(v.as_ref()).ok())
                .map_or(0, u64::from_be_bytes);
            total += meta.size;
            entries.push((used, key, meta.size));
        }
        entries.sort();
        let mut report = GcReport::default();
        for (_, key, size) in entries {
            if total <= max_bytes {
                break;
            }
            self.remove(&key)?;
            total -= size;
            report.removed += 1;
            report.freed += size;
        }
        report.remaining = total;
        self.flush()?;
        Ok(report)
    }

    /// Removes every entry.
    pub fn clear(&self) -> Result<u64, StoreError> {
        let n = self.values.len() as u64;
        for tree in [&self.values, &self.meta, &self.used] {
            tree.clear().map_err(self.error("clearing cache"))?;
        }
        self.flush()?;
        Ok(n)
    }

    /// The raw stored bytes of an entry (envelope included), for tools that check integrity.
    pub fn raw(&self, key: &Key) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self
            .values
            .get(key.0)
            .map_err(self.error("reading cache"))?
            .map(|v| v.to_vec()))
    }
}

fn is_lock_error(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::WouldBlock || e.to_string().contains("lock")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(kind: &str) -> EntryMeta {
        EntryMeta {
            kind: kind.into(),
            description: "d".into(),
            ..EntryMeta::default()
        }
    }

    #[test]
    fn values_round_trip_and_survive_reopening() {
        let dir = tempfile::tempdir().expect("tempdir");
        let k = Key([7; 32]);
        {
            let c = LocalCache::open(dir.path(), Duration::ZERO).expect("opens");
            assert_eq!(c.get(&k).expect("get"), Lookup::Miss);
            c.put(&k, b"hello", &meta("plan")).expect("put");
            c.flush().expect("flush");
        }
        let c = LocalCache::open(dir.path(), Duration::ZERO).expect("reopens");
        assert_eq!(c.get(&k).expect("get"), Lookup::Hit(b"hello".to_vec()));
        let s = c.stats().expect("stats");
        assert_eq!((s.entries, s.bytes), (1, 5));
        assert_eq!(s.kinds, vec![("plan".to_string(), 1, 5)]);
    }

    #[test]
    fn a_flipped_byte_is_a_miss_and_the_entry_goes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let c = LocalCache::open(dir.path(), Duration::ZERO).expect("opens");
        let k = Key([1; 32]);
        c.put(&k, b"payload bytes", &meta("layer-cost"))
            .expect("put");
        let mut raw = c.raw(&k).expect("raw").expect("present");
        let last = raw.len() - 1;
        raw[last] ^= 0x01;
        c.values.insert(k.0, raw).expect("tamper");
        assert_eq!(c.get(&k).expect("get"), Lookup::Corrupt);
        assert_eq!(c.get(&k).expect("get"), Lookup::Miss, "removed");
        assert!(c.entries().expect("entries").is_empty());
    }

    #[test]
    fn verify_removes_corrupt_entries() {
        let dir = tempfile::tempdir().expect("tempdir");
        let c = LocalCache::open(dir.path(), Duration::ZERO).expect("opens");
        for i in 0..4u8 {
            c.put(&Key([i; 32]), &[i; 10], &meta("x")).expect("put");
        }
        c.values
            .insert([2u8; 32], &b"APV1 short"[..])
            .expect("tamper");
        let r = c.verify().expect("verify");
        assert_eq!((r.checked, r.removed), (4, 1));
        assert_eq!(c.stats().expect("stats").entries, 3);
    }

    #[test]
    fn gc_evicts_least_recently_used_first() {
        let dir = tempfile::tempdir().expect("tempdir");
        let c = LocalCache::open(dir.path(), Duration::ZERO).expect("opens");
        for i in 0..5u8 {
            c.put(&Key([i; 32]), &[0; 100], &meta("x")).expect("put");
            std::thread::sleep(Duration::from_millis(3));
        }
        // Touch the oldest: it becomes the most recent.
        assert!(matches!(c.get(&Key([0; 32])).expect("get"), Lookup::Hit(_)));
        let r = c.gc(250).expect("gc");
        assert_eq!((r.removed, r.freed, r.remaining), (3, 300, 200));
        let left: Vec<u8> = c
            .entries()
            .expect("entries")
            .iter()
            .map(|(k, _)| k.0[0])
            .collect();
        assert_eq!(left, vec![0, 4]);
    }

    #[test]
    fn a_second_opener_waits_then_says_the_cache_is_busy() {
        let dir = tempfile::tempdir().expect("tempdir");
        let _first = LocalCache::open(dir.path(), Duration::ZERO).expect("opens");
        // sled's lock is per process; in-process the second open shares the database, so this
        // only checks the error path does not hang or panic when it triggers.
        let second = LocalCache::open(dir.path(), Duration::from_millis(100));
        if let Err(e) = second {
            assert!(e.to_string().contains("holds the cache"), "{e}");
        }
    }
}
