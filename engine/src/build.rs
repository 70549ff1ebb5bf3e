//! `autopar build`: plan every target of the workspace (in parallel) and write the plans.

use crate::error::EngineError;
use crate::plans::{remove_output, write_plan, write_trace};
use crate::workspace::{Target, Workspace};
use autopar_rules::cluster::GIB;
use autopar_rules::estimate::Estimator;
use autopar_rules::frontend::LowerOptions;
use autopar_rules::layout::LayoutError;
use autopar_rules::plan::{Plan, PlanModel};
use autopar_rules::schedule::{chrome_trace, simulate};
use autopar_rules::search::{SearchResult, search};
use rayon::prelude::*;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// How many layouts a plan lists: the chosen one and the runners-up.
pub const LAYOUTS_KEPT: usize = 6;

/// A target that got a plan.
#[derive(Debug, Clone)]
pub struct Planned {
    /// The plan.
    pub plan: Plan,
    /// Where it was written.
    pub path: PathBuf,
    /// Where the simulated timeline of its pipeline was written.
    pub trace: PathBuf,
}

/// What happened to one target.
#[derive(Debug, Clone)]
pub enum TargetResult {
    /// A layout fits; the plan was written.
    Planned(Box<Planned>),
    /// No layout can run or fits; the reason says which constraint failed.
    Infeasible {
        /// Why.
        reason: String,
    },
}

/// One target's outcome.
#[derive(Debug, Clone)]
pub struct TargetOutcome {
    /// Target name.
    pub name: String,
    /// Plan or reason.
    pub result: TargetResult,
    /// Layouts priced.
    pub layouts: usize,
    /// Wall time of this target.
    pub elapsed: Duration,
}

/// Result of a build.
#[derive(Debug, Clone)]
pub struct BuildReport {
    /// One outcome per target built, in workspace order.
    pub outcomes: Vec<TargetOutcome>,
    /// Wall time of the build.
    pub elapsed: Duration,
}

impl BuildReport {
    /// Number of targets that got a plan.
    pub fn planned(&self) -> usize {
        self.outcomes
            .iter()
            .filter(|o| matches!(o.result, TargetResult::Planned(_)))
            .count()
    }
}

/// Progress events, for a progress bar or log lines.
#[derive(Debug, Clone, Copy)]
pub enum Progress<'a> {
    /// A build of this many targets starts.
    Begin(usize),
    /// One target is done.
    Done(&'a TargetOutcome),
}

/// Selects the targets named (all when `names` is empty), in workspace order.
pub fn select<'w>(ws: &'w Workspace, names: &[String]) -> Result<Vec<&'w Target>, EngineError> {
    for n in names {
        if ws.target(n).is_none() {
            return Err(EngineError::Unknown {
                what: "target",
                name: n.clone(),
                expected: format!(
                    "a target of {} ({})",
                    ws.file.display(),
                    ws.targets
                        .iter()
                        .map(|t| t.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            });
        }
    }
    Ok(ws
        .targets
        .iter()
        .filter(|t| names.is_empty() || names.contains(&t.name))
        .collect())
}

/// Plans the selected targets in parallel and writes their plans; stale plans of targets that
/// became infeasible are removed so no file describes a plan that no longer holds.
pub fn build(
    ws: &Workspace,
    names: &[String],
    progress: &(dyn Fn(Progress<'_>) + Sync),
) -> Result<BuildReport, EngineError> {
    let start = Instant::now();
    let targets = select(ws, names)?;
    progress(Progress::Begin(targets.len()));
    let outcomes = targets
        .par_iter()
        .map(|t| {
            let outcome = plan_target(ws, t)?;
            progress(Progress::Done(&outcome));
            Ok(outcome)
        })
        .collect::<Result<Vec<_>, EngineError>>()?;
    Ok(BuildReport {
        outcomes,
        elapsed: start.elapsed(),
    })
}

fn plan_target(ws: &Workspace, t: &Target) -> Result<TargetOutcome, EngineError> {
    let start = Instant::now();
    let model = &ws.models[t.model];
    let cluster = &ws.clusters[t.cluster];
    let span = tracing::info_span!("target", name = %t.name);
    let _enter = span.enter();
    let est = Estimator::new(&model.name, &model.def, cluster, t.options);
    let result = search(&est, &t.search, t.global_batch, LAYOUTS_KEPT);
    tracing::info!(
        candidates = result.candidates,
        valid = result.valid,
        feasible = result.feasible,
        "searched"
    );
    let path = ws.plan_path(&t.name);
    let trace = ws.trace_path(&t.name);
    let outcome = match plan_from(ws, t, &est, &result) {
        Ok(plan) => {
            write_plan(&path, &plan)?;
            // The estimate was simulated when refined, so this cannot fail.
            let sim = simulate(&plan.estimate.pipeline_spec())
                .map_err(|e| EngineError::Layout(LayoutError::Schedule(e)))?;
            let title = format!("{}: {}", t.name, plan.estimate.layout.describe());
            write_trace(&trace, &chrome_trace(&sim, &title))?;
            TargetResult::Planned(Box::new(Planned { plan, path, trace }))
        }
        Err(reason) => {
            remove_output(&path)?;
            remove_output(&trace)?;
            TargetResult::Infeasible { reason }
        }
    };
    Ok(TargetOutcome {
        name: t.name.clone(),
        result: outcome,
        layouts: result.candidates,
        elapsed: start.elapsed(),
    })
}

fn plan_from(
    ws: &Workspace,
    t: &Target,
    est: &Estimator<'_>,
    result: &SearchResult,
) -> Result<Plan, String> {
    let model = &ws.models[t.model];
    let cluster = &ws.clusters[t.cluster];
    // The model as published: unpadded vocabulary, one sequence.
    let g = model
        .def
        .lower(
            &model.name,
            &LowerOptions {
                micro_batch: 1,
                seq: t.options.seq,
                dtype: t.options.precision.dtype(),
                attention: t.options.attention,
                vocab_multiple: 1,
            },
        )
        .map_err(|e| e.to_string())?;
    let plan_model = PlanModel {
        name: model.name.clone(),
        parameters: g.parameter_count(),
        blocks: g.block_layers().len() as u64,
    };
    if let Some(plan) =
        Plan::from_search(&t.name, plan_model, &model.def, cluster, t.options, result)
    {
        return Ok(plan);
    }
    Err(infeasibility(t, est, result))
}

/// Says which constraint failed when no layout is chosen.
fn infeasibility(t: &Target, est: &Estimator<'_>, r: &SearchResult) -> String {
    let c = est.cluster();
    if r.candidates == 0 {
        return format!(
            "the search space is empty: no allowed combination of tp {:?}, pp, dp and micro-batch \
             {:?} splits a global batch of {} over {} GPUs",
            t.search.tp,
            t.search.micro_batch,
            t.global_batch,
            c.gpus()
        );
    }
    if let Some(e) = &r.least_memory {
        let s = &e.stages[e.peak_memory_stage];
        let m = &s.memory;
        let headroom = est.options().memory_headroom;
        return format!(
            "no layout fits in memory: the smallest of the {} valid layouts ({}) needs {:.1} GiB \
             per device on stage {} (weights {:.1}, grads {:.1}, optimizer {:.1}, activations \
             {:.1}, workspace {:.1}), the {} has {:.1} GiB usable ({:.1} GiB less {:.0}% headroom)",
            r.valid,
            e.layout.describe(),
            m.total / GIB,
            s.index,
            m.weights / GIB,
            m.grads / GIB,
            m.optimizer / GIB,
            m.activations / GIB,
            m.workspace / GIB,
            c.device.name,
            e.memory_capacity / GIB,
            c.device.hbm_bytes / GIB,
            headroom * 100.0
        );
    }
    match &r.first_rejection {
        Some((layout, why)) => format!(
            "none of the {} candidate layouts can run; the first ({}) fails because {why}",
            r.candidates,
            layout.describe()
        ),
        None => format!("none of the {} candidate layouts can run", r.candidates),
    }
}
