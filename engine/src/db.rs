//! The in-process incremental layer (salsa): the files a workspace is read from are inputs,
//! parsing the workspace and deriving each target's key are tracked queries. A long-running
//! `autopar watch` updates only the files that changed; salsa re-parses only when a file the
//! workspace read changed, and a target whose key comes out equal is not rebuilt (its plan is
//! found in memory under that key).

use crate::error::EngineError;
use crate::workspace::{Workspace, load_with};
use autopar_rules::canonical::Digest;
use salsa::Setter;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

pub use input::SourceFile;

mod input {
    // The macro generates accessors and setters without documentation.
    #![allow(missing_docs)]
    use std::path::PathBuf;

    /// A file the workspace reads: its path and its text (or why it could not be read).
    #[salsa::input]
    pub struct SourceFile {
        /// The path.
        #[returns(deref)]
        pub path: PathBuf,
        /// The text, or the reason it could not be read.
        #[returns(ref)]
        pub contents: Result<String, String>,
    }
}

/// The database's view for tracked queries: files by path, read on first use.
#[salsa::db]
pub trait Db: salsa::Database {
    /// The input for `path`, created (by reading the file) the first time it is asked for.
    fn file(&self, path: &Path) -> SourceFile;
}

/// The database.
#[salsa::db]
#[derive(Clone, Default)]
pub struct Database {
    storage: salsa::Storage<Self>,
    files: Arc<Mutex<HashMap<PathBuf, SourceFile>>>,
}

#[salsa::db]
impl salsa::Database for Database {}

fn read(path: &Path) -> Result<String, String> {
    crate::input::read_capped(path).map_err(|e| e.to_string())
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[salsa::db]
impl Db for Database {
    fn file(&self, path: &Path) -> SourceFile {
        if let Some(f) = lock(&self.files).get(path) {
            return *f;
        }
        let f = SourceFile::new(self, path.to_path_buf(), read(path));
        *lock(&self.files).entry(path.to_path_buf()).or_insert(f)
    }
}

impl Database {
    /// Re-reads every file read so far and updates those whose text changed; returns their
    /// paths. Queries that read them are recomputed on their next use, the others are not.
    pub fn refresh(&mut self) -> Vec<PathBuf> {
        let files: Vec<(PathBuf, SourceFile)> = lock(&self.files)
            .iter()
            .map(|(p, f)| (p.clone(), *f))
            .collect();
        let mut changed = Vec::new();
        for (path, file) in files {
            let now = read(&path);
            if *file.contents(self) != now {
                // The setter hands back the old text, which nobody needs.
                let _old = file.set_contents(self).to(now);
                changed.push(path);
            }
        }
        changed.sort();
        changed
    }
}

/// A loaded workspace, or why it failed (shared: salsa keeps it).
pub type Loaded = Result<Arc<Workspace>, Arc<EngineError>>;

/// The workspace in `file`, with the model and profile files it names read through the
/// database (so a change to any of them, and only to them, reloads it).
#[salsa::tracked(returns(ref), no_eq)]
pub fn workspace(db: &dyn Db, file: SourceFile) -> Loaded {
    let path = file.path(db);
    let text = match file.contents(db) {
        Ok(t) => t.clone(),
        Err(e) => {
            return Err(Arc::new(EngineError::Read {
                path: path.to_path_buf(),
                source: std::io::Error::other(e.clone()),
            }));
        }
    };
    let read = |p: &Path| -> std::io::Result<String> {
        db.file(p)
            .contents(db)
            .clone()
            .map_err(std::io::Error::other)
    };
    load_with(path, &text, &read)
        .map(Arc::new)
        .map_err(Arc::new)
}

/// Each target's key (what its plan depends on). Equal keys after an edit mean nothing to
/// rebuild for that target; salsa keeps the list when it comes out the same.
#[salsa::tracked(returns(ref))]
pub fn target_keys(db: &dyn Db, file: SourceFile) -> Vec<(String, Digest)> {
    match workspace(db, file) {
        Ok(ws) => ws
            .targets
            .iter()
            .map(|t| (t.name.clone(), crate::build::target_parts(ws, t).key()))
            .collect(),
        Err(_) => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unrelated_file_change_keeps_every_key_and_an_edit_changes_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ws = dir.path().join("workspace.toml");
        let toml = r#"
[[model]]
name = "a"
transformer = { hidden = 256, layers = 4, heads = 4, ffn_hidden = 1024, vocab = 1000, max_seq = 512 }

[[model]]
name = "b"
hf_config = "b.json"

[[cluster]]
name = "c"
preset = "h100-sxm"
nodes = 1
gpus_per_node = 8

[[target]]
name = "ta"
model = "a"
cluster = "c"
global_batch = 8

[[target]]
name = "tb"
model = "b"
cluster = "c"
global_batch = 8
"#;
        let b = r#"{"model_type": "gpt2", "n_embd": 256, "n_layer": 4, "n_head": 4, "n_positions": 512, "vocab_size": 1000}"#;
        std::fs::write(&ws, toml).expect("write");
        std::fs::write(dir.path().join("b.json"), b).expect("write");
        let mut db = Database::default();
        let file = db.file(&ws);
        let before = target_keys(&db, file).clone();
        assert_eq!(before.len(), 2);
        assert!(db.refresh().is_empty());
        // Reformatting the model file changes its text, not the model: the same keys.
        std::fs::write(dir.path().join("b.json"), b.replace(", ", ",\n  ")).expect("write");
        assert_eq!(db.refresh(), vec![dir.path().join("b.json")]);
        assert_eq!(target_keys(&db, file), &before);
        // Editing it changes only its target's key.
        std::fs::write(
            dir.path().join("b.json"),
            b.replace("\"n_layer\": 4", "\"n_layer\": 6"),
        )
        .expect("write");
        db.refresh();
        let after = target_keys(&db, file);
        assert_eq!(after[0], before[0]);
        assert_ne!(after[1], before[1]);
    }
}
