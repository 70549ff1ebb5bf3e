//! Resolving command-line names: a workspace model or cluster, a model file, or a cluster
//! shorthand, loading the workspace only when a name needs it.

use crate::db::{Database, Db, target_keys, workspace};
use crate::error::EngineError;
use crate::workspace::{Workspace, parse_model_text};
use autopar_rules::canonical::Digest;
use autopar_rules::cost::cluster::{Cluster, parse_cluster_shorthand};
use autopar_rules::model::frontend::ModelDef;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The workspace file a command works against, read through the incremental database on first
/// use (and again, for what changed, after [`Session::refresh`]).
pub struct Session {
    path: PathBuf,
    db: Database,
    plans_dir: Option<PathBuf>,
}

impl Session {
    /// A session on the workspace file `path`.
    pub fn new(path: PathBuf) -> Self {
        Session {
            path,
            db: Database::default(),
            plans_dir: None,
        }
    }

    /// The same session, writing plans to `dir` (a directory the user named on the command
    /// line, which may lie outside the workspace) instead of `[workspace] plans`.
    pub fn with_plans_dir(mut self, dir: Option<PathBuf>) -> Self {
        self.plans_dir = dir;
        self
    }

    /// Path of the workspace file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The workspace, loaded and validated (once per change of the files it reads).
    pub fn workspace(&self) -> Result<Arc<Workspace>, EngineError> {
        let file = self.db.file(&self.path);
        match (workspace(&self.db, file), &self.plans_dir) {
            (Ok(ws), None) => Ok(ws.clone()),
            (Ok(ws), Some(dir)) => Ok(Arc::new(Workspace {
                plans_dir: dir.clone(),
                ..(**ws).clone()
            })),
            (Err(e), _) => Err(EngineError::Shared(e.clone())),
        }
    }

    /// Each target's key, as the database last derived it.
    pub fn target_keys(&self) -> Vec<(String, Digest)> {
        let file = self.db.file(&self.path);
        target_keys(&self.db, file).clone()
    }

    /// Re-reads the files the workspace was read from; returns those that changed.
    pub fn refresh(&mut self) -> Vec<PathBuf> {
        self.db.refresh()
    }

    /// A model by workspace name, or from a model file (HuggingFace config or graph file).
    /// Returns the name to report it under and its architecture.
    pub fn model(&self, arg: &str) -> Result<(String, ModelDef), EngineError> {
        let path = Path::new(arg);
        if path.is_file() {
            let text = crate::input::read_text(path)?;
            let def = parse_model_text(path, &text, None)?;
            let name = path
                .file_stem()
                .map_or_else(|| arg.to_string(), |s| s.to_string_lossy().into_owned());
            return Ok((name, def));
        }
        let ws = self.named("model", arg, "a path to a model file")?;
        ws.model(arg)
            .map(|m| (m.name.clone(), m.def.clone()))
            .ok_or_else(|| EngineError::Unknown {
                what: "model",
                name: arg.to_string(),
                expected: format!(
                    "a model of {} ({}) or a path to a model file",
                    ws.file.display(),
                    ws.models
                        .iter()
                        .map(|m| m.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            })
    }

    /// A cluster by workspace name, or written `PRESET:NODESxGPUS` (`NODE-PRESET:NODES`).
    pub fn cluster(&self, arg: &str) -> Result<Cluster, EngineError> {
        if arg.contains(':') {
            return parse_cluster_shorthand(arg).map_err(|reason| EngineError::Argument {
                flag: "--cluster",
                // The reason names the known presets when the preset is the problem.
                expected:
                    "PRESET:NODESxGPUS or NODE-PRESET:NODES, e.g. a100-80g:4x8 or dgx-h100:16"
                        .to_string(),
                found: format!("`{arg}` ({reason})"),
            });
        }
        let ws = self.named(
            "cluster",
            arg,
            "PRESET:NODESxGPUS or NODE-PRESET:NODES, e.g. a100-80g:4x8 or dgx-h100:16",
        )?;
        ws.cluster(arg)
            .cloned()
            .ok_or_else(|| EngineError::Unknown {
                what: "cluster",
                name: arg.to_string(),
                expected: format!(
                    "a cluster of {} ({}), PRESET:NODESxGPUS or NODE-PRESET:NODES, e.g. a100-80g:4x8 or \
                     dgx-h100:16",
                    ws.file.display(),
                    ws.clusters
                        .iter()
                        .map(|c| c.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            })
    }

    /// The workspace for resolving a name; a missing workspace file becomes an "unknown name"
    /// error that says what else would have worked.
    fn named(
        &self,
        what: &'static str,
        arg: &str,
        otherwise: &str,
    ) -> Result<Arc<Workspace>, EngineError> {
        match self.workspace() {
            Err(e) => match e.inner() {
                EngineError::Read { path, .. } if !path.exists() => Err(EngineError::Unknown {
                    what,
                    name: arg.to_string(),
                    expected: format!(
                        "{otherwise} (there is no {} to look names up in)",
                        path.display()
                    ),
                }),
                _ => Err(e),
            },
            ok => ok,
        }
    }
}
