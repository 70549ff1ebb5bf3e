//! The local content-addressed cache: planning results keyed by the blake3 of exactly their
//! inputs (the engine computes keys), in a sled database (by default `.autopar/cache`).
//!
//! Every value is a [`record`](crate::record) bound to its key and checked on every read:
//! damaged bytes, or intact bytes of another key, are a miss with a warning naming the key,
//! and the entry is removed. A value, its metadata and its last-use time are written in one
//! transaction.
//!
//! The store is an accelerator and never a point of failure. Every call into sled goes through
//! one boundary ([`LocalCache::call`]) that contains sled's panics and classifies its errors: a
//! damaged database (sled reports corruption, fails to parse its own files, or panics) is moved
//! aside to `<dir>.corrupt-<ms>` with one warning, and a new one takes its place: empty at open,
//! or, in the middle of a build, holding every entry of the old one that still verifies. A
//! database that cannot be used for other reasons (no permission, a full disk, another process
//! holding it past the wait) is reported, and the caller works without it. Records larger than
//! a few KiB are kept in files beside the database ([`record_files`]), so that walking sled's
//! tree stays cheap. sled's file lock lets one process use a cache at a time; another `autopar` waits
//! for it (see [`LocalCache::open`]) rather than share it unsafely.

use crate::StoreError;
use crate::contain::contain;
use crate::fault;
use crate::record::{self, Key, RecordError};
use crate::record_files;
use crate::seal;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// How long opening the database may take before the store gives up on it (a hung network
/// file system, say); the build then goes on without the local cache.
const OPEN_TIMEOUT: Duration = Duration::from_secs(20);

/// How long closing the database may take: sled flushes again when its last handle drops, and
/// after a write the disk refused (ENOSPC) that flush can wait forever for the write.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long copying the entries that still verify out of a database found damaged in the
/// middle of a build may take (a damaged sled tree can be walked for minutes before it fails).
const SALVAGE_TIMEOUT: Duration = Duration::from_secs(20);

/// Bytes of pages sled keeps in memory (its default is 1 GiB): the build holds the results it
/// uses itself, so the store's page cache only saves re-reading hot pages.
const CACHE_CAPACITY: u64 = 64 * 1024 * 1024;

/// Writes are made durable at least this often while a build stores results, so a killed build
/// keeps all but the last moments of its work (sled's own periodic flusher thread is off: its
/// panics could not be contained).
const FLUSH_EVERY: Duration = Duration::from_millis(500);

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
    /// The stored bytes were not the result of this key (damaged, or another key's); the entry
    /// was removed.
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

/// A damaged database that was moved aside and replaced by a new one.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Repair {
    /// Where the damaged database now is.
    pub moved_to: PathBuf,
    /// What was wrong with it.
    pub reason: String,
    /// Entries that still verified against their keys and were copied into the new database
    /// (damage found in the middle of a build; a database damaged at open is not read again).
    #[serde(default)]
    pub kept: u64,
}

/// What `verify` found and repaired.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct VerifyReport {
    /// Entries checked.
    pub checked: u64,
    /// Entries removed, for any reason below.
    pub removed: u64,
    /// Values whose bytes did not match their hash.
    pub damaged: u64,
    /// Intact values stored under a key that is not theirs.
    pub other_key: u64,
    /// Values of an earlier autopar's layout.
    pub old_layout: u64,
    /// Metadata or last-use records without a value, or values without metadata.
    pub orphans: u64,
    /// Damaged databases moved aside (while opening or while reading).
    pub repairs: Vec<Repair>,
    /// Damage the database absorbed without an error, found against its seal when it was
    /// opened (lost entries, a rewritten settings file, a damaged snapshot).
    pub damage: Vec<String>,
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

/// An open database and its trees.
struct Handle {
    db: sled::Db,
    values: sled::Tree,
    meta: sled::Tree,
    used: sled::Tree,
    /// Tells handles apart, so a damaged one is replaced once however many callers saw it.
    generation: u64,
}

/// The database, or why there is none.
enum State {
    Open(Arc<Handle>),
    Closed(String),
}

/// Why a call into the database did not give a result.
enum CallError {
    /// The database was damaged; it has been replaced (or closed, if that failed too).
    Damaged(String),
    /// The environment refused (permissions, disk full, ...), or there is no database.
    Io(std::io::Error),
}

/// Why an attempt to open the database failed.
enum OpenError {
    /// Another process holds it.
    Locked(std::io::Error),
    /// Its files are damaged.
    Damaged(String),
    /// It cannot be used here (permissions, disk full, timeout).
    Unusable(std::io::Error),
}

/// The local cache.
pub struct LocalCache {
    path: PathBuf,
    state: RwLock<State>,
    generations: AtomicU64,
    repairs: Mutex<Vec<Repair>>,
    /// What the seal found when the cache was opened.
    damage: Vec<String>,
    last_flush: Mutex<Instant>,
    /// Set when the environment refused a call (disk full, read-only): closing does not wait.
    refused: AtomicBool,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether a sled error means its files are damaged, rather than that the environment refused.
fn is_damage(e: &sled::Error) -> bool {
    use std::io::ErrorKind as K;
    match e {
        sled::Error::Io(io) => {
            !matches!(
                io.kind(),
                K::PermissionDenied
                    | K::ReadOnlyFilesystem
                    | K::StorageFull
                    | K::QuotaExceeded
                    | K::OutOfMemory
                    | K::TimedOut
                    | K::Interrupted
                    | K::WouldBlock
            ) && !is_lock_error(io)
        }
        _ => true,
    }
}

fn is_lock_error(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::WouldBlock || e.to_string().contains("acquire lock")
}

/// A sled error in words (its corruption error prints a debugging backtrace placeholder).
fn describe(e: &sled::Error) -> String {
    match e {
        sled::Error::Corruption { .. } => "sled found corrupted data".into(),
        other => other.to_string(),
    }
}

/// A panic contained inside sled, in words: damaged files trip its internal checks (the build
/// itself did not panic, so the word is not used).
fn internal_error(panic: &str) -> String {
    format!("sled failed an internal check: {panic}")
}

fn io(e: sled::Error) -> std::io::Error {
    match e {
        sled::Error::Io(e) => e,
        other => std::io::Error::other(other.to_string()),
    }
}

/// The record `stored` (sled's value under `key`) stands for: itself, or the file it marks.
fn resolve<'a>(
    cache: &Path,
    key: &Key,
    stored: &'a [u8],
) -> std::io::Result<std::borrow::Cow<'a, [u8]>> {
    if record_files::is_marker(stored) {
        record_files::read(cache, key).map(std::borrow::Cow::Owned)
    } else {
        Ok(std::borrow::Cow::Borrowed(stored))
    }
}

/// The files a cache directory holds (sled's, the seal, and the seal's temporary file when
/// a process stopped while writing it): a directory holding anything else is not moved
/// aside, whatever state it is in.
fn is_cache_file(name: &str) -> bool {
    matches!(
        name,
        "conf" | "db" | "blobs" | seal::FILE | record_files::DIR
    ) || name.starts_with("snap.")
        || name.starts_with(&crate::partial_prefix(Path::new(seal::FILE)))
}

/// The name of a file in `dir` that is not one of the cache's, if there is one.
fn foreign_file(dir: &Path) -> Option<String> {
    std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .find(|n| !is_cache_file(n))
}

/// What the thread opening the database reports, in order.
enum Opening {
    /// sled opened the files; the entries are being counted.
    Opened,
    /// The database and its entry count, or why there is none.
    Done(Result<Result<(Handle, usize), sled::Error>, String>),
}

/// One attempt to open the database at `dir` and count its entries (which reads every page),
/// on a thread of its own: a panic is damage; an open that hangs is given up on after
/// [`OPEN_TIMEOUT`], and so is a count that does not finish, as damage (sled 0.34 walks a
/// damaged tree up to a million times before it panics, minutes of reads).
fn open_handle(dir: &Path, generation: u64) -> Result<(Handle, usize), OpenError> {
    let (tx, rx) = std::sync::mpsc::sync_channel(2);
    let path = dir.to_path_buf();
    let spawned = std::thread::Builder::new()
        .name("autopar-cache-open".into())
        .spawn(move || {
            let opened = contain(|| -> Result<(Handle, usize), sled::Error> {
                let db = sled::Config::new()
                    .path(&path)
                    .flush_every_ms(None)
                    .cache_capacity(CACHE_CAPACITY)
                    .open()?;
                let handle = Handle {
                    values: db.open_tree("values")?,
                    meta: db.open_tree("meta")?,
                    used: db.open_tree("used")?,
                    db,
                    generation,
                };
                let _ = tx.send(Opening::Opened);
                let entries = handle.values.len();
                // Flushes count `meta` (cheaper than `values`): walk it here too, under the
                // open's deadline, so that damage to it is found now and not by a flush that
                // never returns.
                let _ = handle.meta.len();
                Ok((handle, entries))
            });
            let _ = tx.send(Opening::Done(opened));
        });
    if let Err(e) = spawned {
        return Err(OpenError::Unusable(e));
    }
    let mut opened = false;
    loop {
        match rx.recv_timeout(OPEN_TIMEOUT) {
            Ok(Opening::Opened) => opened = true,
            Ok(Opening::Done(done)) => {
                return match done {
                    Ok(Ok(h)) => Ok(h),
                    Ok(Err(sled::Error::Io(e))) if is_lock_error(&e) => Err(OpenError::Locked(e)),
                    Ok(Err(e)) if is_damage(&e) => Err(OpenError::Damaged(describe(&e))),
                    Ok(Err(e)) => Err(OpenError::Unusable(io(e))),
                    Err(panic) => Err(OpenError::Damaged(internal_error(&panic))),
                };
            }
            Err(_) if opened => {
                return Err(OpenError::Damaged(format!(
                    "sled did not finish reading its entries within {} s",
                    OPEN_TIMEOUT.as_secs()
                )));
            }
            Err(_) => {
                return Err(OpenError::Unusable(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("opening took more than {} s", OPEN_TIMEOUT.as_secs()),
                )));
            }
        }
    }
}

/// Moves the damaged database at `dir` aside and makes `dir` an empty directory again.
fn move_aside(dir: &Path, reason: &str) -> Result<Repair, StoreError> {
    let err = |action| crate::err(action, dir);
    // Only a directory of the cache's own files is moved: a directory of other things must
    // never lose them.
    if let Some(name) = foreign_file(dir) {
        return Err(err(
            "not repairing the cache, as its directory holds other files",
        )(std::io::Error::other(format!(
            "`{name}` is not a file of the cache database"
        ))));
    }
    let moved_to = PathBuf::from(format!("{}.corrupt-{}", dir.display(), now_ms()));
    std::fs::rename(dir, &moved_to).map_err(err("moving a corrupt cache aside"))?;
    std::fs::create_dir_all(dir).map_err(err("creating cache directory"))?;
    Ok(Repair {
        moved_to,
        reason: reason.to_string(),
        kept: 0,
    })
}

/// Says, once, that the database at `dir` was damaged and what became of it.
fn warn_repaired(dir: &Path, repair: &Repair) {
    tracing::warn!(
        cache = %dir.display(),
        moved_to = %repair.moved_to.display(),
        reason = %repair.reason,
        kept = repair.kept,
        "the cache database is corrupt; starting a new one"
    );
}

/// Copies every entry of the damaged database `old` that still verifies against its key, with
/// its metadata and last use (and record file, from `old_dir` to `new_dir`), into `new`, and
/// returns how many it copied. A build that finds
/// damage halfway keeps what it (and earlier builds) stored before; nothing unverified moves.
///
/// It runs on a thread of its own, for at most [`SALVAGE_TIMEOUT`], and stops at the first
/// error or panic of `old`: what lies past damaged pages is lost, as it was already.
fn salvage(old: Arc<Handle>, new: Arc<Handle>, old_dir: PathBuf, new_dir: PathBuf) -> u64 {
    let copied = Arc::new(AtomicU64::new(0));
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let counter = copied.clone();
    let spawned = std::thread::Builder::new()
        .name("autopar-cache-salvage".into())
        .spawn(move || {
            let _ = contain(|| -> sled::Result<()> {
                for item in old.values.iter() {
                    let (k, v) = item?;
                    let Ok(key) = <[u8; 32]>::try_from(k.as_ref()) else {
                        continue;
                    };
                    let Ok(bytes) = resolve(&old_dir, &Key(key), &v) else {
                        continue;
                    };
                    if record::open(&Key(key), &bytes).is_err() {
                        continue;
                    }
                    if record_files::is_marker(&v)
                        && record_files::carry(&old_dir, &new_dir, &Key(key), &bytes).is_err()
                    {
                        continue;
                    }
                    // An entry without readable metadata would be an orphan: left behind.
                    let Some(meta) = old.meta.get(&k)? else {
                        continue;
                    };
                    if serde_json::from_slice::<EntryMeta>(&meta).is_err() {
                        continue;
                    }
                    let used = old
                        .used
                        .get(&k)?
                        .map_or_else(|| now_ms().to_be_bytes().to_vec(), |u| u.to_vec());
                    new.values.insert(&k, v)?;
                    new.meta.insert(&k, meta)?;
                    new.used.insert(&k, used)?;
                    counter.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            });
            let _ = tx.send(());
        });
    if spawned.is_ok() && rx.recv_timeout(SALVAGE_TIMEOUT).is_err() {
        tracing::debug!(
            "copying out of the damaged cache took more than {} s; stopped waiting",
            SALVAGE_TIMEOUT.as_secs()
        );
    }
    copied.load(Ordering::Relaxed)
}

impl LocalCache {
    /// Opens (creating) the cache at `dir`. While another process holds it, retries for up
    /// to `wait`; then fails with an error saying so. A damaged database (one sled cannot read,
    /// or panics on) is moved aside (`<dir>.corrupt-<ms>`) with a warning and a new one is
    /// created. Fails when the directory cannot be used at all (no permission, full disk).
    pub fn open(dir: &Path, wait: Duration) -> Result<Self, StoreError> {
        let err = |action| crate::err(action, dir);
        std::fs::create_dir_all(dir).map_err(err("creating cache directory"))?;
        // A directory of other things (`--cache-dir ~` by mistake) is never made a cache: sled
        // would write its files among them, and a repair would move them all aside.
        if let Some(name) = foreign_file(dir) {
            return Err(err("not using as a cache directory")(
                std::io::Error::other(format!(
                    "it holds `{name}`, which is not a file of autopar's cache"
                )),
            ));
        }
        // Files sled rewrites while opening are compared with the seal before it opens them.
        let sealed = seal::read(dir);
        let deadline = Instant::now() + wait;
        let mut repairs = Vec::new();
        let (handle, entries) = loop {
            match open_handle(dir, 0) {
                Ok(opened) => break opened,
                Err(OpenError::Locked(_)) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(OpenError::Locked(e)) => {
                    return Err(err("another autopar process holds the cache")(e));
                }
                // One repair: a database that is damaged again right after being created new
                // is not a damaged file but a broken environment.
                Err(OpenError::Damaged(why)) if repairs.is_empty() => {
                    let repair = move_aside(dir, &why)?;
                    warn_repaired(dir, &repair);
                    repairs.push(repair);
                }
                Err(OpenError::Damaged(why)) => {
                    return Err(err("opening cache")(std::io::Error::other(why)));
                }
                Err(OpenError::Unusable(e)) => return Err(err("opening cache")(e)),
            }
        };
        // This process holds the cache now: a record file or seal half-written is a killed
        // process's.
        record_files::remove_partials(dir);
        crate::remove_partials(&dir.join(seal::FILE));
        // Damage sled absorbed without an error, against what the last flush sealed.
        let damage = if repairs.is_empty() {
            sealed.compare(entries as u64)
        } else {
            // Moved aside and named already; the new database has no seal.
            Vec::new()
        };
        if !damage.is_empty() {
            tracing::warn!(
                cache = %dir.display(),
                "the cache database was damaged since it was last written: {}",
                damage.join("; ")
            );
        }
        Ok(LocalCache {
            path: dir.to_path_buf(),
            state: RwLock::new(State::Open(Arc::new(handle))),
            generations: AtomicU64::new(1),
            repairs: Mutex::new(repairs),
            damage,
            last_flush: Mutex::new(Instant::now()),
            refused: AtomicBool::new(false),
        })
    }

    /// Where the cache lives.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Damaged databases moved aside since the cache was opened.
    pub fn repairs(&self) -> Vec<Repair> {
        lock(&self.repairs).clone()
    }

    /// Damage the database absorbed without an error, found against its seal at open.
    pub fn damage(&self) -> &[String] {
        &self.damage
    }

    /// The store boundary: runs `f` on the current database. A panic or a damage error inside
    /// it replaces the database (see [`LocalCache::replace`]), and `f` runs once more on the
    /// new one, which holds every entry that still verified: the caller sees the damage only
    /// if that fails too. Other errors are passed on.
    fn call<R>(&self, f: impl Fn(&Handle) -> sled::Result<R>) -> Result<R, CallError> {
        match self.call_once(&f) {
            Err(CallError::Damaged(why)) => match self.call_once(&f) {
                Err(CallError::Io(_)) => Err(CallError::Damaged(why)),
                again => again,
            },
            done => done,
        }
    }

    /// [`LocalCache::call`] without the second attempt.
    fn call_once<R>(&self, f: &impl Fn(&Handle) -> sled::Result<R>) -> Result<R, CallError> {
        let handle = match &*self.state.read().unwrap_or_else(|e| e.into_inner()) {
            State::Open(h) => h.clone(),
            State::Closed(why) => {
                return Err(CallError::Io(std::io::Error::other(why.clone())));
            }
        };
        let why = match contain(|| {
            if fault::damaged_now() {
                panic!("injected damage");
            }
            f(&handle)
        }) {
            Ok(Ok(r)) => return Ok(r),
            Ok(Err(e)) if !is_damage(&e) => {
                self.refused.store(true, Ordering::Relaxed);
                return Err(CallError::Io(io(e)));
            }
            Ok(Err(e)) => describe(&e),
            Err(panic) => internal_error(&panic),
        };
        self.replace(handle, &why);
        Err(CallError::Damaged(why))
    }

    /// Replaces the damaged database `handle` (unless another caller already did): moves its
    /// files aside, opens a new one and copies into it the entries that still verify (see
    /// [`salvage`]); if opening fails too, the store is closed for the rest of the process and
    /// callers work without it.
    fn replace(&self, handle: Arc<Handle>, why: &str) {
        let mut state = self.state.write().unwrap_or_else(|e| e.into_inner());
        match &*state {
            State::Open(current) if current.generation == handle.generation => {}
            _ => return,
        }
        // A damaged sled handle may panic again when dropped (its trees flush on drop), outside
        // any containment: the state's reference is leaked, so the caller's (lent to the
        // salvage, then dropped) is never the last. This happens at most once or twice a
        // process.
        let old = std::mem::replace(&mut *state, State::Closed(why.to_string()));
        if let State::Open(h) = old {
            std::mem::forget(h);
        }
        let generation = self.generations.fetch_add(1, Ordering::Relaxed);
        let replaced = move_aside(&self.path, why).and_then(|repair| {
            let opened = open_handle(&self.path, generation)
                .map(|(h, _)| Arc::new(h))
                .map_err(|e| {
                    let source = match e {
                        OpenError::Locked(e) | OpenError::Unusable(e) => e,
                        OpenError::Damaged(why) => std::io::Error::other(why),
                    };
                    StoreError {
                        action: "opening a new cache",
                        path: self.path.clone(),
                        source,
                    }
                });
            let kept = match &opened {
                Ok(new) => salvage(
                    handle,
                    new.clone(),
                    repair.moved_to.clone(),
                    self.path.clone(),
                ),
                Err(_) => 0,
            };
            let repair = Repair { kept, ..repair };
            warn_repaired(&self.path, &repair);
            lock(&self.repairs).push(repair);
            opened
        });
        match replaced {
            Ok(h) => *state = State::Open(h),
            Err(e) => {
                tracing::warn!("working without the local cache: {e}: {}", e.source);
                *state = State::Closed(format!("{e}: {}", e.source));
            }
        }
    }

    fn error(&self, action: &'static str) -> impl FnOnce(CallError) -> StoreError + '_ {
        move |e| StoreError {
            action,
            path: self.path.clone(),
            source: match e {
                CallError::Io(e) => e,
                CallError::Damaged(why) => std::io::Error::other(format!(
                    "the database was damaged ({why}) and has been replaced"
                )),
            },
        }
    }

    /// Fails a write with the injected fault, if there is one.
    fn check_fault(&self, action: &'static str) -> Result<(), StoreError> {
        match fault::write_error() {
            Some(source) => Err(StoreError {
                action,
                path: self.path.clone(),
                source,
            }),
            None => Ok(()),
        }
    }

    /// The verified payload under `key`.
    pub fn get(&self, key: &Key) -> Result<Lookup, StoreError> {
        let Some(stored) = self
            .call(|h| h.values.get(key.0))
            .map_err(self.error("reading cache"))?
        else {
            return Ok(Lookup::Miss);
        };
        let bytes = match resolve(&self.path, key, &stored) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                // A file a crash lost before it reached the disk: the result is solved again.
                tracing::debug!(key = %key.hex(), "cache record file missing; entry removed");
                let _ = self.remove(key);
                return Ok(Lookup::Miss);
            }
            Err(e) => return Ok(self.remove_corrupt(key, &format!("its record file: {e}"))),
        };
        match record::open(key, &bytes) {
            Ok(payload) => {
                let payload = payload.into_owned();
                // Last use, for gc; losing it costs nothing but eviction order.
                if fault::write_error().is_none() {
                    let _ = self.call(|h| h.used.insert(key.0, &now_ms().to_be_bytes()));
                }
                Ok(Lookup::Hit(payload))
            }
            Err(RecordError::OldLayout) => {
                tracing::debug!(key = %key.hex(), "cache entry of an earlier autopar removed");
                let _ = self.remove(key);
                Ok(Lookup::Miss)
            }
            Err(e) => Ok(self.remove_corrupt(key, &e.to_string())),
        }
    }

    /// Removes the entry under `key`, whose stored bytes are not its result (`why`), with a
    /// warning naming it.
    fn remove_corrupt(&self, key: &Key, why: &str) -> Lookup {
        tracing::warn!(
            key = %key.hex(),
            cache = %self.path.display(),
            "corrupt cache entry removed: {why}"
        );
        let _ = self.remove(key);
        Lookup::Corrupt
    }

    /// Whether an entry exists (without reading or verifying it).
    pub fn contains(&self, key: &Key) -> Result<bool, StoreError> {
        self.call(|h| h.values.contains_key(key.0))
            .map_err(self.error("reading cache"))
    }

    /// Stores `payload` under `key` with `meta` (its size and creation time are filled in).
    pub fn put(&self, key: &Key, payload: &[u8], meta: &EntryMeta) -> Result<(), StoreError> {
        self.check_fault("writing cache")?;
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
        let mut value = record::seal(key, payload);
        if value.len() > record_files::ABOVE {
            record_files::write(&self.path, key, &value).map_err(|source| StoreError {
                action: "writing a cache record file",
                path: record_files::path(&self.path, key),
                source,
            })?;
            value = record_files::MARKER.to_vec();
        }
        let used = now_ms().to_be_bytes();
        self.call(|h| {
            use sled::Transactional;
            (&h.values, &h.meta, &h.used)
                .transaction(|(v, m, u)| {
                    v.insert(&key.0, value.as_slice())?;
                    m.insert(&key.0, meta_bytes.as_slice())?;
                    u.insert(&key.0, &used)?;
                    Ok::<(), sled::transaction::ConflictableTransactionError<()>>(())
                })
                .map_err(|e| match e {
                    sled::transaction::TransactionError::Storage(e) => e,
                    sled::transaction::TransactionError::Abort(()) => {
                        sled::Error::ReportableBug("transaction aborted".into())
                    }
                })
        })
        .map_err(self.error("writing cache"))?;
        let due = {
            let mut last = lock(&self.last_flush);
            let due = last.elapsed() >= FLUSH_EVERY;
            if due {
                *last = Instant::now();
            }
            due
        };
        if due {
            self.call(|h| h.db.flush())
                .map_err(self.error("flushing cache"))?;
        }
        Ok(())
    }

    /// Removes an entry.
    pub fn remove(&self, key: &Key) -> Result<(), StoreError> {
        self.remove_raw(&key.0)
    }

    /// Removes the value, metadata and last use stored under the raw key `k` (which `verify`
    /// may find malformed).
    fn remove_raw(&self, k: &[u8]) -> Result<(), StoreError> {
        self.check_fault("removing a cache entry")?;
        self.call(|h| {
            h.values.remove(k)?;
            h.meta.remove(k)?;
            h.used.remove(k)?;
            Ok(())
        })
        .map_err(self.error("removing a cache entry"))?;
        if let Ok(key) = <[u8; 32]>::try_from(k) {
            record_files::remove(&self.path, &Key(key));
        }
        Ok(())
    }

    /// Makes every write so far durable, and seals what the database now holds.
    pub fn flush(&self) -> Result<(), StoreError> {
        self.check_fault("flushing cache")?;
        let entries = self
            .call(|h| {
                h.db.flush()?;
                // Every write puts a key in `values` and `meta` in one transaction, so their
                // counts agree.
                Ok(h.meta.len() as u64)
            })
            .map_err(self.error("flushing cache"))?;
        seal::write(&self.path, entries)
    }

    /// Every entry's metadata.
    pub fn entries(&self) -> Result<Vec<(Key, EntryMeta)>, StoreError> {
        self.call(|h| {
            let mut out = Vec::new();
            for item in h.meta.iter() {
                let (k, v) = item?;
                let Ok(key) = <[u8; 32]>::try_from(k.as_ref()) else {
                    continue;
                };
                let meta: EntryMeta = serde_json::from_slice(&v).unwrap_or_default();
                out.push((Key(key), meta));
            }
            Ok(out)
        })
        .map_err(self.error("reading cache"))
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
            .call(|h| h.db.size_on_disk())
            .map_err(self.error("reading cache"))?
            + record_files::bytes(&self.path);
        Ok(stats)
    }

    /// Reads and checks every value against its key, removes what is damaged, bound to another
    /// key, of an earlier layout or incomplete, and reports what it found, including damaged
    /// databases moved aside (when opening, or when a read found the damage).
    pub fn verify(&self) -> Result<VerifyReport, StoreError> {
        let mut report = VerifyReport::default();
        let scanned = self.call(|h| {
            let mut bad = Vec::new();
            let mut checked = 0;
            for item in h.values.iter() {
                let (k, v) = item?;
                checked += 1;
                let outcome = match <[u8; 32]>::try_from(k.as_ref()) {
                    Ok(key) => match resolve(&self.path, &Key(key), &v) {
                        Ok(bytes) => record::open(&Key(key), &bytes).err(),
                        Err(_) => Some(RecordError::Damaged),
                    },
                    Err(_) => Some(RecordError::Damaged),
                };
                if let Some(e) = outcome {
                    bad.push((k.to_vec(), Some(e)));
                } else if !h.meta.contains_key(&k)? {
                    bad.push((k.to_vec(), None));
                }
            }
            for tree in [&h.meta, &h.used] {
                for item in tree.iter() {
                    let (k, _) = item?;
                    if !h.values.contains_key(&k)? {
                        bad.push((k.to_vec(), None));
                    }
                }
            }
            Ok((checked, bad))
        });
        let bad = match scanned {
            Ok((checked, bad)) => {
                report.checked = checked;
                bad
            }
            // The scan itself found the database damaged: it was moved aside and replaced.
            Err(CallError::Damaged(_)) => Vec::new(),
            Err(e) => return Err(self.error("verifying cache")(e)),
        };
        for (k, why) in bad {
            match &why {
                Some(RecordError::Damaged) => report.damaged += 1,
                Some(RecordError::OtherKey(_)) => report.other_key += 1,
                Some(RecordError::OldLayout) => report.old_layout += 1,
                None => report.orphans += 1,
            }
            if let Some(e) = &why {
                tracing::warn!(key = %crate::hex(&k), "corrupt cache entry removed: {e}");
            }
            self.remove_raw(&k)?;
            report.removed += 1;
        }
        // Record files no entry points to (a write that stopped between its file and its
        // entry, half-written temporary files).
        for (path, key) in record_files::list(&self.path) {
            let pointed = match key {
                Some(key) => self
                    .call(|h| h.values.get(key.0))
                    .map_err(self.error("verifying cache"))?
                    .is_some_and(|v| record_files::is_marker(&v)),
                None => false,
            };
            if !pointed {
                record_files::remove_path(&path);
                report.orphans += 1;
                report.removed += 1;
            }
        }
        self.flush()?;
        report.repairs = self.repairs();
        report.damage = self.damage.clone();
        Ok(report)
    }

    /// Removes least recently used entries until the payloads total at most `max_bytes`.
    pub fn gc(&self, max_bytes: u64) -> Result<GcReport, StoreError> {
        let mut entries: Vec<(u64, Key, u64)> = Vec::new();
        let mut total = 0u64;
        for (key, meta) in self.entries()? {
            let used = self
                .call(|h| h.used.get(key.0))
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
        self.check_fault("clearing cache")?;
        let n = self
            .call(|h| {
                let n = h.values.len() as u64;
                for tree in [&h.values, &h.meta, &h.used] {
                    tree.clear()?;
                }
                Ok(n)
            })
            .map_err(self.error("clearing cache"))?;
        record_files::clear(&self.path);
        self.flush()?;
        Ok(n)
    }

    /// The raw stored bytes of an entry (record included), for tools that check integrity.
    pub fn raw(&self, key: &Key) -> Result<Option<Vec<u8>>, StoreError> {
        let stored = self
            .call(|h| h.values.get(key.0))
            .map_err(self.error("reading cache"))?;
        stored
            .map(|v| resolve(&self.path, key, &v).map(|b| b.into_owned()))
            .transpose()
            .map_err(|source| StoreError {
                action: "reading a cache record file",
                path: record_files::path(&self.path, key),
                source,
            })
    }

    /// Stores raw bytes under `key` as if the database had been damaged, for tests of what
    /// every reader does with them.
    #[cfg(any(test, feature = "fault-injection"))]
    pub fn put_raw(&self, key: &Key, bytes: &[u8]) -> Result<(), StoreError> {
        self.call(|h| h.values.insert(key.0, bytes).map(|_| ()))
            .map_err(self.error("writing cache"))
    }
}

impl Drop for LocalCache {
    /// Closes the database on a thread of its own, waiting at most [`CLOSE_TIMEOUT`] (and not
    /// at all after the environment refused a call): sled's flush on drop must not hold the
    /// process. The build has flushed what it wrote already.
    fn drop(&mut self) {
        let state = std::mem::replace(
            self.state.get_mut().unwrap_or_else(|e| e.into_inner()),
            State::Closed("closed".into()),
        );
        let State::Open(handle) = state else { return };
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let closing = std::thread::Builder::new()
            .name("autopar-cache-close".into())
            .spawn(move || {
                let _ = contain(|| drop(handle));
                let _ = tx.send(());
            });
        if closing.is_err() {
            return;
        }
        let wait = if self.refused.load(Ordering::Relaxed) {
            Duration::ZERO
        } else {
            CLOSE_TIMEOUT
        };
        if rx.recv_timeout(wait).is_err() {
            tracing::debug!("the local cache did not close within {} s", wait.as_secs());
        }
    }
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
        assert!(c.repairs().is_empty());
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
        c.put_raw(&k, &raw).expect("tamper");
        assert_eq!(c.get(&k).expect("get"), Lookup::Corrupt);
        assert_eq!(c.get(&k).expect("get"), Lookup::Miss, "removed");
        assert!(c.entries().expect("entries").is_empty());
    }

    #[test]
    fn the_result_of_another_key_is_never_served() {
        let dir = tempfile::tempdir().expect("tempdir");
        let c = LocalCache::open(dir.path(), Duration::ZERO).expect("opens");
        let (a, b) = (Key([1; 32]), Key([2; 32]));
        c.put(&a, b"result of a", &meta("x")).expect("put");
        c.put(&b, b"result of b", &meta("x")).expect("put");
        // A's intact record under B's key.
        let a_bytes = c.raw(&a).expect("raw").expect("present");
        c.put_raw(&b, &a_bytes).expect("swap");
        assert_eq!(c.get(&b).expect("get"), Lookup::Corrupt);
        assert_eq!(
            c.get(&a).expect("get"),
            Lookup::Hit(b"result of a".to_vec())
        );
    }

    #[test]
    fn verify_removes_what_is_not_the_result_of_its_key() {
        let dir = tempfile::tempdir().expect("tempdir");
        let c = LocalCache::open(dir.path(), Duration::ZERO).expect("opens");
        for i in 0..6u8 {
            c.put(&Key([i; 32]), &[i; 10], &meta("x")).expect("put");
        }
        c.put_raw(&Key([2; 32]), b"APV2 short").expect("tamper");
        let other = c.raw(&Key([4; 32])).expect("raw").expect("present");
        c.put_raw(&Key([3; 32]), &other).expect("swap");
        c.put_raw(&Key([5; 32]), b"APV1 an old layout")
            .expect("old");
        // A value without metadata.
        c.put_raw(&Key([9; 32]), &record::seal(&Key([9; 32]), b"x"))
            .expect("orphan");
        let r = c.verify().expect("verify");
        assert_eq!(
            (
                r.checked,
                r.removed,
                r.damaged,
                r.other_key,
                r.old_layout,
                r.orphans
            ),
            (7, 4, 1, 1, 1, 1)
        );
        assert_eq!(c.stats().expect("stats").entries, 3);
        assert_eq!(c.verify().expect("again").removed, 0);
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
    fn damage_found_mid_build_keeps_every_entry_that_still_verifies() {
        let parent = tempfile::tempdir().expect("tempdir");
        let dir = parent.path().join("cache");
        let c = LocalCache::open(&dir, Duration::ZERO).expect("opens");
        for i in 0..50u8 {
            c.put(&Key([i; 32]), &[i; 100], &meta("x")).expect("put");
        }
        // One entry damaged in place, one bound to another key, one without metadata: none
        // of them may move into the new database.
        c.put_raw(&Key([3; 32]), b"APV2 short").expect("tamper");
        let other = c.raw(&Key([4; 32])).expect("raw").expect("present");
        c.put_raw(&Key([5; 32]), &other).expect("swap");
        c.put_raw(&Key([60; 32]), &record::seal(&Key([60; 32]), b"x"))
            .expect("orphan");
        // A read finds the database damaged, as sled's panics on damaged pages do; it is
        // replaced, and the read runs again on the new one.
        let calls = AtomicU64::new(0);
        let read = c.call(|h| {
            if calls.fetch_add(1, Ordering::Relaxed) == 0 {
                panic!("damaged page");
            }
            h.values.get([7; 32])
        });
        assert!(
            matches!(read, Ok(Some(_))),
            "the second attempt reads the new database"
        );
        let repairs = c.repairs();
        assert_eq!(repairs.len(), 1);
        assert_eq!(repairs[0].kept, 48);
        assert!(repairs[0].moved_to.exists());
        for i in 0..50u8 {
            let got = c.get(&Key([i; 32])).expect("get");
            if i == 3 || i == 5 {
                assert_eq!(got, Lookup::Miss, "entry {i}");
            } else {
                assert_eq!(got, Lookup::Hit(vec![i; 100]), "entry {i}");
            }
        }
        assert_eq!(c.get(&Key([60; 32])).expect("get"), Lookup::Miss);
        // Metadata and last use came along: nothing for verify to remove, gc still works.
        assert_eq!(c.stats().expect("stats").entries, 48);
        assert_eq!(c.verify().expect("verify").removed, 0);
        // Writes go to the new database and survive reopening it.
        c.put(&Key([70; 32]), b"after", &meta("x")).expect("put");
        drop(c);
        let c = LocalCache::open(&dir, Duration::ZERO).expect("reopens");
        assert_eq!(c.stats().expect("stats").entries, 49);
        assert!(c.damage().is_empty(), "{:?}", c.damage());
    }

    /// Entries [`reopen_after`] stores: about the size of a build's cache.
    const ENTRIES: u16 = 400;

    /// Fills a cache, then damages its files with `damage` and reopens it.
    fn reopen_after(damage: impl Fn(&Path)) -> (tempfile::TempDir, LocalCache) {
        let parent = tempfile::tempdir().expect("tempdir");
        let dir = parent.path().join("cache");
        {
            let c = LocalCache::open(&dir, Duration::ZERO).expect("opens");
            for i in 0..ENTRIES {
                let mut k = [0u8; 32];
                k[..2].copy_from_slice(&i.to_be_bytes());
                c.put(&Key(k), &[7; 3000], &meta("x")).expect("put");
                // Several flushes: a log of several batches, as a build writes it.
                if i % 20 == 0 {
                    c.flush().expect("flush");
                }
            }
            c.flush().expect("flush");
        }
        damage(&dir);
        let c = LocalCache::open(&dir, Duration::ZERO).expect("a damaged cache still opens");
        (parent, c)
    }

    /// Every key [`reopen_after`] stored, and whether the cache serves each right or not at all.
    fn serves_nothing_wrong(c: &LocalCache) -> usize {
        let mut hits = 0;
        for i in 0..ENTRIES {
            let mut k = [0u8; 32];
            k[..2].copy_from_slice(&i.to_be_bytes());
            if let Ok(Lookup::Hit(v)) = c.get(&Key(k)) {
                assert_eq!(v, vec![7; 3000]);
                hits += 1;
            }
        }
        hits
    }

    #[test]
    fn flipped_bytes_in_the_database_never_panic_and_damage_is_moved_aside() {
        let mut repaired = 0;
        for seed in 0..12u64 {
            let (parent, c) = reopen_after(|dir| {
                let db = dir.join("db");
                let mut bytes = std::fs::read(&db).expect("read");
                let mut x = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                for _ in 0..10 {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let i = (x >> 33) as usize % bytes.len();
                    bytes[i] ^= 0xff;
                }
                std::fs::write(&db, bytes).expect("write");
            });
            serves_nothing_wrong(&c);
            for r in c.repairs() {
                assert!(r.moved_to.exists() && r.moved_to.starts_with(parent.path()));
                repaired += 1;
            }
            // The database in use works, whatever happened to the old one.
            c.put(&Key([1; 32]), b"v", &meta("x")).expect("put");
            assert_eq!(
                c.get(&Key([1; 32])).expect("get"),
                Lookup::Hit(b"v".to_vec())
            );
        }
        eprintln!("repaired {repaired}");
        assert!(
            repaired > 0,
            "some of the damage is the kind sled panics on"
        );
    }

    #[test]
    fn a_file_kind_replaced_by_a_directory_or_emptied_never_fails_the_open() {
        for (what, damage) in [
            ("db is a directory", "dir-db"),
            ("conf is a directory", "dir-conf"),
            ("conf is empty", "empty-conf"),
            ("conf is garbage", "garbage-conf"),
            ("db is empty", "empty-db"),
            ("db is cut in half", "half-db"),
        ] {
            let (_parent, c) = reopen_after(|dir| {
                let (file, how) = damage.split_once('-').map(|(h, f)| (f, h)).expect("pair");
                let p = dir.join(file);
                match how {
                    "dir" => {
                        std::fs::remove_file(&p).expect("remove");
                        std::fs::create_dir(&p).expect("dir");
                    }
                    "empty" => std::fs::write(&p, b"").expect("empty"),
                    "garbage" => std::fs::write(&p, [0xa5u8; 64]).expect("garbage"),
                    _ => {
                        let b = std::fs::read(&p).expect("read");
                        std::fs::write(&p, &b[..b.len() / 2]).expect("cut");
                    }
                }
            });
            serves_nothing_wrong(&c);
            assert!(
                !c.repairs().is_empty() || !c.damage().is_empty(),
                "{what}: the damage is named"
            );
            c.put(&Key([1; 32]), b"v", &meta("x")).expect(what);
        }
    }

    #[test]
    fn damaged_record_files_never_serve_a_wrong_value() {
        // Records this large are files beside the database (noise, which compressing does not
        // shrink); sled holds only a marker for each.
        let big = |i: u8| crate::noise(u64::from(i) + 1, 200_000);
        for damage in ["flip", "truncate", "empty", "remove", "directory", "swap"] {
            let dir = tempfile::tempdir().expect("tempdir");
            {
                let c = LocalCache::open(dir.path(), Duration::ZERO).expect("opens");
                for i in 0..4u8 {
                    c.put(&Key([i; 32]), &big(i), &meta("program"))
                        .expect("put");
                }
                c.flush().expect("flush");
            }
            let files: Vec<PathBuf> = (0..4u8)
                .map(|i| record_files::path(dir.path(), &Key([i; 32])))
                .collect();
            assert!(files.iter().all(|f| f.is_file()), "one file per record");
            assert!(
                std::fs::metadata(dir.path().join("db")).map_or(0, |m| m.len()) < 200_000,
                "the database holds markers, not the records"
            );
            let first = std::fs::read(&files[0]).expect("read");
            for f in &files {
                match damage {
                    "flip" => {
                        let mut bytes = std::fs::read(f).expect("read");
                        let mid = bytes.len() / 2;
                        bytes[mid] ^= 0x10;
                        std::fs::write(f, bytes).expect("write");
                    }
                    "truncate" => {
                        let bytes = std::fs::read(f).expect("read");
                        std::fs::write(f, &bytes[..bytes.len() / 3]).expect("write");
                    }
                    "empty" => std::fs::write(f, b"").expect("write"),
                    "remove" => std::fs::remove_file(f).expect("remove"),
                    "directory" => {
                        std::fs::remove_file(f).expect("remove");
                        std::fs::create_dir(f).expect("directory");
                    }
                    // Every file holds the intact record of key 0.
                    _ => std::fs::write(f, &first).expect("write"),
                }
            }
            let c = LocalCache::open(dir.path(), Duration::ZERO).expect("opens");
            for i in 0..4u8 {
                let got = c.get(&Key([i; 32])).expect("get");
                if damage == "swap" && i == 0 {
                    assert_eq!(got, Lookup::Hit(big(0)), "{damage}");
                    continue;
                }
                let expected = if damage == "remove" {
                    Lookup::Miss
                } else {
                    Lookup::Corrupt
                };
                assert_eq!(got, expected, "{damage} {i}");
                assert_eq!(c.get(&Key([i; 32])).expect("get"), Lookup::Miss, "removed");
            }
            // Stored again, served again.
            c.put(&Key([1; 32]), &big(1), &meta("program"))
                .expect(damage);
            assert_eq!(c.get(&Key([1; 32])).expect("get"), Lookup::Hit(big(1)));
        }
    }

    #[test]
    fn record_files_follow_their_entries() {
        let parent = tempfile::tempdir().expect("tempdir");
        let dir = parent.path().join("cache");
        let c = LocalCache::open(&dir, Duration::ZERO).expect("opens");
        let big = |i: u8| crate::noise(u64::from(i) + 1, 50_000);
        for i in 0..6u8 {
            c.put(&Key([i; 32]), &big(i), &meta("x")).expect("put");
        }
        c.put(&Key([9; 32]), b"small", &meta("x")).expect("put");
        assert_eq!(
            record_files::list(&dir).len(),
            6,
            "small records stay in sled"
        );
        // Removed with their entry, by gc and by clear; stray files go on verify.
        c.remove(&Key([0; 32])).expect("remove");
        assert!(!record_files::path(&dir, &Key([0; 32])).exists());
        std::fs::write(
            record_files::path(&dir, &Key([1; 32])).with_file_name("stray"),
            b"x",
        )
        .expect("stray");
        record_files::write(
            &dir,
            &Key([40; 32]),
            &record::seal(&Key([40; 32]), &big(40)),
        )
        .expect("orphan");
        let report = c.verify().expect("verify");
        assert_eq!((report.orphans, report.removed), (2, 2), "{report:?}");
        assert_eq!(record_files::list(&dir).len(), 5);
        // What a write killed half-way left is gone when the cache is next opened.
        let partial = dir.join(record_files::DIR).join(record_files::PARTIAL);
        std::fs::write(
            partial.join(format!("{}.a1b2c3", Key([41; 32]).hex())),
            b"half",
        )
        .expect("partial");
        drop(c);
        // So is the seal's temporary file, which does not make the directory foreign.
        let seal_partial = dir.join(format!(".{}.partial-x1y2", seal::FILE));
        std::fs::write(&seal_partial, b"{").expect("partial seal");
        let c = LocalCache::open(&dir, Duration::ZERO).expect("opens");
        assert!(!partial.exists());
        assert!(!seal_partial.exists());
        assert_eq!(c.verify().expect("verify").removed, 0);
        assert_eq!(record_files::list(&dir).len(), 5);
        // A database found damaged mid-build keeps its records, files included.
        let calls = AtomicU64::new(0);
        let _ = c.call(|h| {
            if calls.fetch_add(1, Ordering::Relaxed) == 0 {
                panic!("damaged page");
            }
            h.values.get([7; 32])
        });
        assert_eq!(c.repairs()[0].kept, 6);
        for i in 1..6u8 {
            assert_eq!(c.get(&Key([i; 32])).expect("get"), Lookup::Hit(big(i)));
        }
        let s = c.stats().expect("stats");
        assert!(s.disk_bytes >= 5 * 50_000, "{s:?}");
        assert_eq!(c.clear().expect("clear"), 6);
        assert!(record_files::list(&dir).is_empty());
    }

    #[test]
    fn a_directory_holding_other_files_is_never_used_nor_moved() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("notes.txt"), b"mine").expect("write");
        std::fs::write(dir.path().join("db"), [0x5au8; 4096]).expect("garbage db");
        std::fs::write(dir.path().join("conf"), [0x5au8; 64]).expect("garbage conf");
        let e = LocalCache::open(dir.path(), Duration::ZERO)
            .err()
            .expect("refused");
        assert!(e.to_string().contains("not using as a cache"), "{e}");
        assert!(e.source.to_string().contains("notes.txt"), "{}", e.source);
        assert!(dir.path().join("notes.txt").exists());
        assert_eq!(
            std::fs::read(dir.path().join("db")).expect("untouched"),
            [0x5a; 4096]
        );
    }

    #[test]
    fn a_second_opener_waits_then_says_the_cache_is_busy() {
        let dir = tempfile::tempdir().expect("tempdir");
        let _first = LocalCache::open(dir.path(), Duration::ZERO).expect("opens");
        let second = LocalCache::open(dir.path(), Duration::from_millis(100));
        let e = second.err().expect("the lock is held");
        assert!(e.to_string().contains("holds the cache"), "{e}");
    }
}
