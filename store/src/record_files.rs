//! Large records live in files beside the database, as Bazel's disk cache keeps its blobs:
//! `records/<2 hex>/<key hex>` under the cache directory, with a short marker under the key in
//! sled. sled keeps a large value inside its tree's pages, so every walk of the tree (opening
//! the store counts its entries, to find damage before a build relies on it) would read every
//! layer table, plan and lowered program: hundreds of MB for a workspace that searches the ILP
//! space. With the large records in files, that walk reads kilobytes.
//!
//! A record file holds the record exactly as sled would (key, hash, payload), so it is checked
//! on every read like any other: a damaged, truncated or foreign file is a miss, never a wrong
//! result. Files are written through a temporary file and a rename, without an fsync each: a
//! file a crash loses is a miss (the marker outlives it), and the next build stores it again.

use crate::record::Key;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The directory of record files inside the cache directory.
pub(crate) const DIR: &str = "records";

/// Records longer than this (bytes, header included) are stored in a file.
pub(crate) const ABOVE: usize = 16 * 1024;

/// What sled holds under the key of a record stored in a file.
pub(crate) const MARKER: &[u8; 4] = b"APF1";

/// Whether `stored` (sled's value) says the record is in a file.
pub(crate) fn is_marker(stored: &[u8]) -> bool {
    stored == MARKER
}

/// The file of `key`'s record under the cache directory `cache`.
pub(crate) fn path(cache: &Path, key: &Key) -> PathBuf {
    let hex = key.hex();
    cache.join(DIR).join(&hex[..2]).join(hex)
}

/// The directory, inside [`DIR`], where record files are written before their rename: one
/// directory, so that what a killed process left half-written is found without walking the
/// record directories.
pub(crate) const PARTIAL: &str = "partial";

/// Writes `record` as `key`'s file (replacing any file there): a temporary file in
/// [`PARTIAL`] and a rename, without an fsync.
pub(crate) fn write(cache: &Path, key: &Key, record: &[u8]) -> std::io::Result<()> {
    let path = path(cache, key);
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let partial = cache.join(DIR).join(PARTIAL);
    std::fs::create_dir_all(&partial)?;
    let mut tmp = crate::temporary_in(&partial, &key.hex())?;
    tmp.write_all(record)?;
    tmp.persist(&path).map_err(|e| e.error)?;
    Ok(())
}

/// Removes what writes left half-done when their process stopped in the middle of one. Only
/// the process holding the cache writes to it, so when it opens the cache nothing there is
/// in progress.
pub(crate) fn remove_partials(cache: &Path) {
    let _ = std::fs::remove_dir_all(cache.join(DIR).join(PARTIAL));
}

/// Puts `key`'s file of the cache directory `from` into `to`: a hard link (both are in the
/// same parent directory), else a copy of `record`, its verified bytes.
pub(crate) fn carry(from: &Path, to: &Path, key: &Key, record: &[u8]) -> std::io::Result<()> {
    let target = path(to, key);
    if let Some(dir) = target.parent() {
        std::fs::create_dir_all(dir)?;
    }
    match std::fs::hard_link(path(from, key), &target) {
        Ok(()) => Ok(()),
        Err(_) => write(to, key, record),
    }
}

/// The bytes of `key`'s file.
pub(crate) fn read(cache: &Path, key: &Key) -> std::io::Result<Vec<u8>> {
    std::fs::read(path(cache, key))
}

/// Removes `key`'s file, if there is one (or whatever damage left in its place).
pub(crate) fn remove(cache: &Path, key: &Key) {
    remove_path(&path(cache, key));
}

/// Removes the file, or directory, at `path`.
pub(crate) fn remove_path(path: &Path) {
    if std::fs::remove_file(path).is_err() {
        let _ = std::fs::remove_dir_all(path);
    }
}

/// Every record file under `cache` (and every file a write left half-done): the key its name
/// gives, `None` for a name that is not a key.
pub(crate) fn list(cache: &Path) -> Vec<(PathBuf, Option<Key>)> {
    let mut out = Vec::new();
    let Ok(dirs) = std::fs::read_dir(cache.join(DIR)) else {
        return out;
    };
    for d in dirs.flatten() {
        let Ok(files) = std::fs::read_dir(d.path()) else {
            out.push((d.path(), None));
            continue;
        };
        for f in files.flatten() {
            let name = f.file_name().to_string_lossy().into_owned();
            out.push((f.path(), Key::from_hex(&name)));
        }
    }
    out
}

/// Total bytes of the record files under `cache`.
pub(crate) fn bytes(cache: &Path) -> u64 {
    list(cache)
        .iter()
        .filter_map(|(p, _)| std::fs::metadata(p).ok())
        .map(|m| m.len())
        .sum()
}

/// Removes every record file under `cache`.
pub(crate) fn clear(cache: &Path) {
    let _ = std::fs::remove_dir_all(cache.join(DIR));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_to_keys() {
        let key = Key([0xab; 32]);
        let p = path(Path::new("/c"), &key);
        assert_eq!(p.parent().and_then(|d| d.file_name()), Some("ab".as_ref()));
        let name = p.file_name().map(|n| n.to_string_lossy().into_owned());
        assert_eq!(name.as_deref().and_then(Key::from_hex), Some(key));
        assert_eq!(Key::from_hex(".partial-x"), None);
        assert_eq!(Key::from_hex(&"zz".repeat(32)), None);
        assert_eq!(Key::from_hex(&"é".repeat(32)), None);
    }
}
