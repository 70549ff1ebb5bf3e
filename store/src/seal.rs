//! The seal of a local cache: what the database held when it was last flushed, so that damage
//! sled absorbs in silence is still reported.
//!
//! sled checks every record of its log, and stops recovery at the first one that fails: a
//! flipped byte or a truncated file loses the entries after it without an error. Nothing wrong
//! is ever served (each value is checked against its key), but a user deserves to hear why a
//! build went cold. The seal, `autopar.seal` beside sled's files and written atomically at every
//! explicit flush, records the number of entries, the blake3 of `conf` (sled's settings, which it
//! silently rewrites when damaged) and of each snapshot file. Opening compares them with what
//! is there.

use crate::StoreError;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The seal's file name in the cache directory.
pub(crate) const FILE: &str = "autopar.seal";

const FORMAT: &str = "autopar-seal/1";

/// What a flush left.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Seal {
    format: String,
    /// Entries (values) in the database.
    entries: u64,
    /// blake3 of sled's `conf` file, hex.
    conf: Option<String>,
    /// Snapshot files and their blake3, hex.
    snapshots: Vec<(String, String)>,
}

fn hash_file(path: &Path) -> Option<String> {
    let meta = std::fs::metadata(path).ok()?;
    if !meta.is_file() {
        return Some("not a regular file".into());
    }
    std::fs::read(path)
        .ok()
        .map(|b| blake3::hash(&b).to_hex().to_string())
}

fn snapshots(dir: &Path) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let snapshot = name.starts_with("snap.") && !name.ends_with(".generating");
            snapshot.then(|| hash_file(&e.path()).map(|h| (name, h)))?
        })
        .collect();
    out.sort();
    out
}

/// Records that the database at `dir` holds `entries` entries, with its current files.
pub(crate) fn write(dir: &Path, entries: u64) -> Result<(), StoreError> {
    let seal = Seal {
        format: FORMAT.into(),
        entries,
        conf: hash_file(&dir.join("conf")),
        snapshots: snapshots(dir),
    };
    let json = serde_json::to_vec(&seal).map_err(|e| StoreError {
        action: "encoding the cache seal",
        path: dir.join(FILE),
        source: std::io::Error::other(e),
    })?;
    crate::write_atomic(&dir.join(FILE), &json)
}

/// The seal at `dir` as it was before the database was opened, with what its files show
/// already: sled rewrites a damaged `conf` while it opens, so files are compared first.
pub(crate) struct Reading {
    seal: Option<Seal>,
    found: Vec<String>,
}

/// Reads the seal at `dir` and compares the files it records (before sled opens them).
pub(crate) fn read(dir: &Path) -> Reading {
    let path = dir.join(FILE);
    // No seal to compare with: nothing found, or what is wrong with the seal itself.
    let unsealed = |found: Option<&str>| Reading {
        seal: None,
        found: found
            .map(|what| format!("its seal {} {what}", path.display()))
            .into_iter()
            .collect(),
    };
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(_) if !path.exists() => return unsealed(None),
        Err(_) => return unsealed(Some("cannot be read")),
    };
    let seal = match serde_json::from_slice::<Seal>(&bytes) {
        Ok(s) if s.format == FORMAT => s,
        // A later autopar's seal: not this one's to judge.
        Ok(_) => return unsealed(None),
        Err(_) => return unsealed(Some("is damaged")),
    };
    let mut found = Vec::new();
    if seal.conf.is_some() && hash_file(&dir.join("conf")) != seal.conf {
        found.push("its settings file `conf` was changed or damaged".into());
    }
    for (name, hash) in &seal.snapshots {
        if let Some(now) = hash_file(&dir.join(name))
            && &now != hash
        {
            found.push(format!("its snapshot `{name}` was damaged"));
        }
    }
    Reading {
        seal: Some(seal),
        found,
    }
}

impl Reading {
    /// Everything that differs, now that the opened database is known to hold `entries`; empty
    /// when nothing does or there was no seal.
    pub(crate) fn compare(mut self, entries: u64) -> Vec<String> {
        if let Some(seal) = &self.seal
            && entries < seal.entries
        {
            self.found.insert(
                0,
                format!(
                    "it lost {} of the {} entries it held (a damaged or truncated database \
                     file); they are recomputed",
                    seal.entries - entries,
                    seal.entries
                ),
            );
        }
        self.found
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seal_names_what_changed_since_it_was_written() {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path();
        std::fs::write(d.join("conf"), b"settings").expect("conf");
        std::fs::write(d.join("snap.0000000000000001"), b"pages").expect("snapshot");
        let check = |entries| read(d).compare(entries);
        assert!(check(0).is_empty(), "no seal yet");
        write(d, 10).expect("seal");
        assert!(check(10).is_empty());
        assert!(check(12).is_empty(), "more entries are fine");
        let lost = check(7);
        assert_eq!(lost.len(), 1);
        assert!(lost[0].contains("lost 3 of the 10"), "{lost:?}");
        std::fs::write(d.join("conf"), b"").expect("empty conf");
        std::fs::write(d.join("snap.0000000000000001"), b"pageS").expect("flip");
        let found = check(10);
        assert_eq!(found.len(), 2, "{found:?}");
        std::fs::write(d.join(FILE), b"{ not a seal").expect("damage the seal");
        assert!(check(10)[0].contains("seal"));
    }
}
