//! Durable storage for autopar: atomic file outputs, the content-addressed local cache, the
//! remote cache client and the built-in remote cache server.
//!
//! Everything autopar writes must survive an interrupted process: a reader sees either the old
//! file or the complete new one, never a torn write, and a cache entry is served only if it
//! matches its hash.

mod cache;
mod contain;
#[cfg(feature = "fault-injection")]
pub mod fault;
pub mod reapi;
pub mod record;
mod record_files;
pub mod remote;
mod seal;
pub mod server;

pub use cache::{CacheStats, EntryMeta, GcReport, LocalCache, Lookup, Repair, VerifyReport};
pub use record::Key;

/// Without the `fault-injection` feature no fault is ever injected.
#[cfg(not(feature = "fault-injection"))]
mod fault {
    pub(crate) fn write_error() -> Option<std::io::Error> {
        None
    }

    pub(crate) fn damaged_now() -> bool {
        false
    }
}

use std::io::Write;
use std::path::{Path, PathBuf};

/// A storage failure, naming the path involved.
#[derive(Debug, thiserror::Error)]
#[error("{action} {}", path.display())]
pub struct StoreError {
    /// What was being done.
    pub action: &'static str,
    /// The file or directory.
    pub path: PathBuf,
    /// The underlying error.
    #[source]
    pub source: std::io::Error,
}

/// Lower-case hex of `bytes` (keys, digests, CAS names).
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A `map_err` adapter: the I/O error of `action` on `path`.
pub(crate) fn err<'p>(
    action: &'static str,
    path: &'p Path,
) -> impl FnOnce(std::io::Error) -> StoreError + 'p {
    move |source| StoreError {
        action,
        path: path.to_path_buf(),
        source,
    }
}

/// Writes `bytes` to `path` atomically and durably: the data goes to a temporary file in the
/// same directory (`.<name>.partial-*`), is flushed to disk, then renamed over `path`; the
/// directory is synced so the rename itself survives a crash. Missing parent directories are
/// created, and partial files a killed writer of `path` left behind are removed.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), StoreError> {
    remove_partials(path);
    let (dir, mut tmp) = temporary_beside(path)?;
    tmp.write_all(bytes).map_err(err("writing", tmp.path()))?;
    tmp.as_file().sync_all().map_err(err("syncing", path))?;
    tmp.persist(path).map_err(|e| StoreError {
        action: "renaming into place",
        path: path.to_path_buf(),
        source: e.error,
    })?;
    if let Ok(d) = std::fs::File::open(dir) {
        // Directory fsync is not supported everywhere; the data itself is already durable.
        let _ = d.sync_all();
    }
    Ok(())
}

/// Whether [`write_atomic`] could write `path`, checked before long work whose result would
/// otherwise be lost: creates the missing parent directories and a temporary file beside it
/// (removed again), and refuses a path that is a directory.
pub fn check_writable(path: &Path) -> Result<(), StoreError> {
    if path.is_dir() {
        return Err(StoreError {
            action: "writing a file over the directory",
            path: path.to_path_buf(),
            source: std::io::Error::from(std::io::ErrorKind::IsADirectory),
        });
    }
    temporary_beside(path).map(|_| ())
}

/// The directory `path` is in.
fn parent_of(path: &Path) -> &Path {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// The prefix of the temporary files [`write_atomic`] writes `path` through.
fn partial_prefix(path: &Path) -> String {
    let name = path
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    format!(".{name}.partial-")
}

/// Removes the temporary files of `path` that an interrupted [`write_atomic`] left behind.
pub fn remove_partials(path: &Path) {
    let prefix = partial_prefix(path);
    let Ok(entries) = std::fs::read_dir(parent_of(path)) else {
        return;
    };
    for e in entries.flatten() {
        if e.file_name().to_string_lossy().starts_with(&prefix) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// The directory of `path` (created when missing) and a new temporary file in it.
fn temporary_beside(path: &Path) -> Result<(&Path, tempfile::NamedTempFile), StoreError> {
    let dir = parent_of(path);
    std::fs::create_dir_all(dir).map_err(err("creating directory", dir))?;
    let tmp = temporary_in(dir, &partial_prefix(path))
        .map_err(err("creating a temporary file in", dir))?;
    Ok((dir, tmp))
}

/// A new temporary file in `dir` whose name starts with `prefix`.
fn temporary_in(dir: &Path, prefix: &str) -> std::io::Result<tempfile::NamedTempFile> {
    let mut builder = tempfile::Builder::new();
    builder.prefix(prefix);
    // Temporary files are private (0600) by default; outputs are ordinary files, readable as
    // the umask allows.
    #[cfg(unix)]
    builder.permissions(std::os::unix::fs::PermissionsExt::from_mode(0o666));
    builder.tempfile_in(dir)
}

/// Bytes that compressing does not shrink (xorshift noise from `seed`), for tests of large
/// values.
#[cfg(test)]
pub(crate) fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed.max(1);
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_whole_file_and_creates_directories() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("a/b/plan.json");
        write_atomic(&p, b"first").expect("write");
        write_atomic(&p, b"second, longer").expect("overwrite");
        assert_eq!(std::fs::read(&p).expect("read"), b"second, longer");
        let leftovers: Vec<_> = std::fs::read_dir(p.parent().expect("parent"))
            .expect("list")
            .collect();
        assert_eq!(leftovers.len(), 1, "no temporary files left behind");
    }

    #[test]
    fn what_a_killed_writer_left_is_removed_by_the_next() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("plan.json");
        std::fs::write(dir.path().join(".plan.json.partial-abc123"), b"half a pl")
            .expect("leftover");
        std::fs::write(dir.path().join(".other.json.partial-x"), b"another file's").expect("other");
        write_atomic(&p, b"whole").expect("write");
        let mut names: Vec<String> = std::fs::read_dir(dir.path())
            .expect("list")
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, [".other.json.partial-x", "plan.json"]);
    }

    #[test]
    fn writability_is_checked_without_leaving_anything() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("a/profile.json");
        check_writable(&p).expect("writable");
        let parent = p.parent().expect("parent");
        assert!(parent.is_dir(), "the directory is created");
        assert_eq!(std::fs::read_dir(parent).expect("list").count(), 0);
        assert!(check_writable(parent).is_err(), "a directory is not a file");
        let blocked = dir.path().join("file");
        std::fs::write(&blocked, b"").expect("write");
        assert!(check_writable(&blocked.join("under-a-file.json")).is_err());
    }

    #[cfg(unix)]
    #[test]
    fn outputs_are_not_private_temporary_files() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("plan.json");
        write_atomic(&p, b"{}").expect("write");
        let mode = |p: &Path| std::fs::metadata(p).expect("stat").permissions().mode() & 0o777;
        // The same mode as a file written plainly under the same umask.
        let plain = dir.path().join("plain");
        std::fs::write(&plain, b"{}").expect("write");
        assert_eq!(mode(&p), mode(&plain), "{:o}", mode(&p));
    }

    #[test]
    fn reports_the_path_on_failure() {
        let dir = tempfile::tempdir().expect("tempdir");
        let blocker = dir.path().join("file");
        std::fs::write(&blocker, b"x").expect("write");
        let e = write_atomic(&blocker.join("child.json"), b"y").expect_err("parent is a file");
        assert!(e.to_string().contains("file"), "{e}");
    }
}
