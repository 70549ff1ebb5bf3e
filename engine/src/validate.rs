//! `autopar validate`: every measured run priced as `autopar estimate` prices it, and how far
//! the predictions are from the measurements (time, memory, ranking, out-of-memory verdicts).

use crate::error::EngineError;
use crate::runs::{MeasuredRun, MeasuredTime, bad};
use crate::session::Session;
use crate::workspace::DEFAULT_VOCAB_MULTIPLE;
use autopar_rules::cost::cluster::Cluster;
use autopar_rules::cost::profile::Profile;
use autopar_rules::model::frontend::ModelDef;
use autopar_rules::plan::accuracy::{mean_abs, relative_error, spearman};
use autopar_rules::plan::estimate::Estimator;
use autopar_rules::plan::layout::{Layout, LayoutError, TrainingOptions};
use rayon::prelude::*;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// One run, predicted and measured.
#[derive(Clone, Debug, Serialize)]
pub struct RunCheck {
    /// Line of the runs file.
    pub line: usize,
    /// Model, as the file names it.
    pub model: String,
    /// Cluster, as the file names it.
    pub cluster: String,
    /// The layout.
    pub layout: Layout,
    /// Under full recomputation, the blocks of each stage recomputed (`None`: all).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recompute_layers: Option<u64>,
    /// Sequence length priced.
    pub seq: u64,
    /// Runtime preset.
    pub runtime: &'static str,
    /// Trained with FP8 products.
    pub fp8: bool,
    /// Measured step time, s (`None`: out of memory).
    pub measured_step_time_s: Option<f64>,
    /// Predicted step time, s.
    pub predicted_step_time_s: f64,
    /// `predicted / measured - 1` of the step time (runs that ran).
    pub time_error: Option<f64>,
    /// Measured peak memory per GPU, GiB.
    pub measured_memory_gib: Option<f64>,
    /// Predicted peak memory per GPU, GiB.
    pub predicted_memory_gib: f64,
    /// `predicted / measured - 1` of the memory.
    pub memory_error: Option<f64>,
    /// The run ran out of memory.
    pub measured_oom: bool,
    /// autopar predicts it runs out of memory (needs more than the device holds).
    pub predicted_oom: bool,
}

/// The rank agreement inside one (model, cluster) group.
#[derive(Clone, Debug, Serialize)]
pub struct GroupRank {
    /// Model.
    pub model: String,
    /// Cluster.
    pub cluster: String,
    /// Runs of the group that ran (OOM runs have no time to rank).
    pub runs: usize,
    /// Spearman's correlation of predicted and measured time per token; `None` with fewer
    /// than three runs or a tie of every run.
    pub spearman: Option<f64>,
    /// Mean |time error| of the group.
    pub mean_abs_error: Option<f64>,
}

/// Predictions against a file of measured runs.
#[derive(Clone, Debug, Serialize)]
pub struct Validation {
    /// Every run, in file order.
    pub runs: Vec<RunCheck>,
    /// Mean |time error| over runs that ran.
    pub mean_abs_error: Option<f64>,
    /// Mean |memory error| over runs with a measured memory.
    pub memory_mean_abs_error: Option<f64>,
    /// Rank agreement per (model, cluster) group, in order of first appearance.
    pub spearman: Vec<GroupRank>,
    /// Fraction of runs whose out-of-memory verdict autopar predicts right.
    pub oom_agreement: Option<f64>,
}

/// The model `arg` names: a workspace model, or a file relative to the working directory or
/// to the runs file's folder.
fn resolve_model(
    session: &Session,
    arg: &str,
    runs_dir: &Path,
) -> Result<(String, ModelDef), EngineError> {
    let beside: PathBuf = runs_dir.join(arg);
    if !Path::new(arg).is_file() && beside.is_file() {
        return session.model(&beside.to_string_lossy());
    }
    session.model(arg)
}

/// The models and clusters a runs file names, each resolved once.
pub(crate) struct Resolved<'r> {
    /// By the file's name: the model's name and definition.
    pub models: BTreeMap<&'r str, (String, ModelDef)>,
    /// By the file's name: the cluster and the measured times it prices with.
    pub clusters: BTreeMap<&'r str, (Cluster, Option<Profile>)>,
}

/// Prices every run of `runs` (read from `file`) and compares.
pub fn validate(
    session: &Session,
    file: &Path,
    runs: &[MeasuredRun],
) -> Result<Validation, EngineError> {
    let Resolved { models, clusters } = resolve(session, file, runs)?;
    let checks: Vec<RunCheck> = runs
        .par_iter()
        .map(|r| {
            let (name, def) = &models[r.model.as_str()];
            let (cluster, profile) = &clusters[r.cluster.as_str()];
            check(file, r, name, def, cluster, profile.as_ref())
        })
        .collect::<Result<_, _>>()?;
    Ok(summarize(checks))
}

/// Resolves every model and cluster `runs` name once, in file order, so an error names its
/// first line.
pub(crate) fn resolve<'r>(
    session: &Session,
    file: &Path,
    runs: &'r [MeasuredRun],
) -> Result<Resolved<'r>, EngineError> {
    let runs_dir = file.parent().unwrap_or(Path::new("."));
    let mut models: BTreeMap<&str, (String, ModelDef)> = BTreeMap::new();
    let mut clusters: BTreeMap<&str, (Cluster, Option<Profile>)> = BTreeMap::new();
    for r in runs {
        if !models.contains_key(r.model.as_str()) {
            let m = resolve_model(session, &r.model, runs_dir).map_err(|e| {
                bad(
                    file,
                    r.line,
                    "model",
                    "a workspace model or a model file",
                    format!("`{}` ({e})", r.model),
                )
            })?;
            models.insert(&r.model, m);
        }
        if !clusters.contains_key(r.cluster.as_str()) {
            let c = session.cluster(&r.cluster).map_err(|e| {
                bad(
                    file,
                    r.line,
                    "cluster",
                    "a workspace cluster, PRESET:NODESxGPUS or NODE-PRESET:NODES",
                    format!("`{}` ({e})", r.cluster),
                )
            })?;
            // A workspace cluster's measured times price the run as `estimate` prices it.
            let profile = if r.cluster.contains(':') {
                None
            } else {
                session
                    .workspace()?
                    .cluster_profile(&r.cluster)
                    .map(|(_, p)| p)
            };
            clusters.insert(&r.cluster, (c, profile));
        }
    }
    Ok(Resolved { models, clusters })
}

/// Prices run `r` of `file` on `cluster` and compares it with what was measured.
pub(crate) fn check(
    file: &Path,
    r: &MeasuredRun,
    name: &str,
    def: &ModelDef,
    cluster: &Cluster,
    profile: Option<&Profile>,
) -> Result<RunCheck, EngineError> {
    let opts = run_options(file, r, def)?;
    let e = r
        .price(&Estimator::new(name, def, cluster, opts).with_profile(profile))
        .map_err(|e| layout_error(file, r, e))?;
    let measured = match r.step_time {
        MeasuredTime::Seconds(t) => Some(t),
        MeasuredTime::OutOfMemory => None,
    };
    Ok(RunCheck {
        line: r.line,
        model: r.model.clone(),
        cluster: r.cluster.clone(),
        layout: r.layout,
        recompute_layers: r.recompute_layers,
        seq: opts.seq,
        runtime: r.runtime.name(),
        fp8: opts.fp8,
        measured_step_time_s: measured,
        predicted_step_time_s: e.step_time_s,
        time_error: measured.map(|m| relative_error(e.step_time_s, m)),
        measured_memory_gib: r.memory_gib,
        predicted_memory_gib: e.memory_per_device_gib,
        memory_error: r
            .memory_gib
            .map(|m| relative_error(e.memory_per_device_gib, m)),
        measured_oom: measured.is_none(),
        predicted_oom: !e.fits,
    })
}

/// A layout of run `r` of `file` that cannot run the model on its cluster.
pub(crate) fn layout_error(file: &Path, r: &MeasuredRun, e: LayoutError) -> EngineError {
    bad(
        file,
        r.line,
        "layout",
        "a layout that runs the model on the cluster",
        e.to_string(),
    )
}

/// The training options run `r` of `file` ran with: its runtime's, with what the file states
/// explicitly, and no memory headroom (the verdict compares the need with the whole device: a
/// real run has none).
pub(crate) fn run_options(
    file: &Path,
    r: &MeasuredRun,
    def: &ModelDef,
) -> Result<TrainingOptions, EngineError> {
    let seq = r.seq.or(def.max_seq()).ok_or_else(|| {
        bad(
            file,
            r.line,
            "seq",
            "a sequence length (the model does not declare one)",
            "nothing",
        )
    })?;
    Ok(r.runtime.options(
        seq,
        r.precision,
        r.attention,
        0.0,
        DEFAULT_VOCAB_MULTIPLE,
        r.settings,
    ))
}

/// The figures over every run.
pub fn summarize(runs: Vec<RunCheck>) -> Validation {
    let time: Vec<f64> = runs.iter().filter_map(|r| r.time_error).collect();
    let memory: Vec<f64> = runs.iter().filter_map(|r| r.memory_error).collect();
    let agreed = runs
        .iter()
        .filter(|r| r.measured_oom == r.predicted_oom)
        .count();
    let mut groups: Vec<((String, String), Vec<&RunCheck>)> = Vec::new();
    for r in runs.iter().filter(|r| r.measured_step_time_s.is_some()) {
        let key = (r.model.clone(), r.cluster.clone());
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, members)) => members.push(r),
            None => groups.push((key, vec![r])),
        }
    }
    let ranks = groups
        .into_iter()
        .map(|((model, cluster), members)| {
            // Time per token, so runs of one group with different batches compare fairly.
            let per_token = |t: f64, r: &RunCheck| t / (r.layout.global_batch * r.seq) as f64;
            let measured: Vec<f64> = members
                .iter()
                .map(|r| per_token(r.measured_step_time_s.unwrap_or(f64::NAN), r))
                .collect();
            let predicted: Vec<f64> = members
                .iter()
                .map(|r| per_token(r.predicted_step_time_s, r))
                .collect();
            let errors: Vec<f64> = members.iter().filter_map(|r| r.time_error).collect();
            GroupRank {
                model,
                cluster,
                runs: members.len(),
                spearman: spearman(&predicted, &measured),
                mean_abs_error: mean_abs(&errors),
            }
        })
        .collect();
    Validation {
        mean_abs_error: mean_abs(&time),
        memory_mean_abs_error: mean_abs(&memory),
        oom_agreement: (!runs.is_empty()).then(|| agreed as f64 / runs.len() as f64),
        spearman: ranks,
        runs,
    }
}
