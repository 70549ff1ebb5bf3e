//! `autopar run`: a stored plan lowered (or its lowered program taken from the cache) and
//! executed on a backend, with the measured step time next to the plan's prediction.

use crate::EngineError;
use crate::cache::{Cache, Source, kind};
use crate::executor::{
    Backend, CPU_DEVICE, CheckReport, ExecError, ExecLayout, Program, RunOptions, RunResult, check,
    cuda, lower, run_program, summarize,
};
use crate::workspace::Workspace;
use autopar_rules::canonical::digest;
use autopar_rules::model::frontend::LowerOptions;
use autopar_rules::model::graph::{DType, Graph, TensorKind};
use autopar_rules::plan::estimate::TimeBreakdown;
use autopar_rules::plan::format::{Plan, SpaceBest};
use autopar_rules::plan::ilp::Space;
use autopar_store::EntryMeta;
use serde::{Deserialize, Serialize};
use std::time::Instant;

/// Bytes of host memory the CPU backend may use for parameters, gradients and Adam moments of
/// all virtual devices together, and again for saved activations (a guard against running a
/// 175B plan, or a plan edited to a huge micro-batch, on a laptop).
pub const CPU_STATE_LIMIT: f64 = 8.0 * (1u64 << 30) as f64;

/// Most floating-point operations one step may take on the CPU backend (a few minutes on a
/// few cores): a plan edited to a billion-sequence batch is refused rather than run for years.
pub const CPU_STEP_FLOPS: f64 = 5e13;

/// Where the lowered program came from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProgramInfo {
    /// `lowered`, or the cache level that had it (`memory`, `local`, `remote`).
    pub source: String,
    /// Time to lower it or read it back, s.
    pub seconds: f64,
    /// Cache key (hex).
    pub key: String,
    /// Steps (kernels) per virtual stage.
    pub steps_per_chunk: Vec<usize>,
}

/// What a run did.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunOutcome {
    /// Target of the plan.
    pub target: String,
    /// Model.
    pub model: String,
    /// Backend.
    pub backend: Backend,
    /// The layout run.
    pub layout: ExecLayout,
    /// Virtual devices.
    pub devices: usize,
    /// Sequences per micro-batch and tokens per sequence.
    pub micro_batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// The program.
    pub program: ProgramInfo,
    /// Losses and step times.
    pub result: RunResult,
    /// Median measured step time, s.
    pub measured_step_time_s: f64,
    /// The plan's predicted step time on its cluster, s.
    pub predicted_step_time_s: f64,
    /// Where the predicted step time goes.
    pub predicted_time: TimeBreakdown,
    /// The cluster the prediction is for.
    pub cluster: String,
    /// The cluster's device is the one the backend runs on (a `cpu` cluster on the CPU
    /// backend), so measured and predicted times compare.
    pub comparable: bool,
    /// Comparison with the single-device run, with `--check`.
    pub check: Option<CheckReport>,
    /// The space the plan chose. The executor lowers Megatron-LM layouts: when the plan chose
    /// the ILP space's pipeline, the run is of the plan's best Megatron-LM layout (`estimate`),
    /// whose prediction `predicted_step_time_s` is, and `ilp` is the pipeline not run.
    pub plan_space: Space,
    /// The ILP space's best, when the plan chose it.
    pub ilp: Option<SpaceBest>,
}

/// The executor's layout of a stored plan.
pub fn exec_layout(plan: &Plan) -> ExecLayout {
    let e = &plan.estimate;
    ExecLayout {
        tp: e.layout.tp as usize,
        pp: e.layout.pp as usize,
        dp: e.layout.dp as usize,
        sequence_parallel: e.layout.sequence_parallel,
        zero: e.layout.zero,
        microbatches: e.num_microbatches as usize,
        chunks: e
            .stages
            .iter()
            .map(|s| s.chunks.iter().map(|c| (c.first, c.last)).collect())
            .collect(),
        grad_accumulation_fusion: plan.training.grad_accumulation_fusion,
    }
}

/// The graph a plan runs: its model at the plan's micro-batch and sequence, vocabulary padded
/// as the plan's tensor-parallel degree pads it. The executor computes in f32.
pub fn plan_graph(ws: &Workspace, plan: &Plan) -> Result<Graph, EngineError> {
    let model = ws
        .model(&plan.model.name)
        .ok_or_else(|| EngineError::Unknown {
            what: "model",
            name: plan.model.name.clone(),
            expected: "the plan's model to be declared in the workspace".into(),
        })?;
    let l = &plan.estimate.layout;
    model
        .def
        .lower(
            &model.name,
            &LowerOptions {
                micro_batch: l.micro_batch,
                seq: plan.training.seq,
                dtype: DType::F32,
                attention: plan.training.attention,
                vocab_multiple: plan.training.vocab_multiple.max(1).saturating_mul(l.tp),
            },
        )
        .map_err(|e| EngineError::Exec(ExecError::Lower(e.to_string())))
}

/// The graph and layout `plan` runs with, refused when they would not fit the CPU backend's
/// budget: everything [`run_plan`] checks before lowering.
pub fn prepare(ws: &Workspace, plan: &Plan) -> Result<(Graph, ExecLayout), EngineError> {
    let (l, m) = (&plan.estimate.layout, plan.estimate.num_microbatches);
    let devices = l.tp.checked_mul(l.pp).and_then(|x| x.checked_mul(l.dp));
    if devices != Some(plan.cluster.gpus()) {
        return Err(ExecError::Lower(format!(
            "the plan is inconsistent: tp {} x pp {} x dp {} is not the {} GPUs of its cluster \
             `{}`; rebuild it with `autopar build {}`",
            l.tp,
            l.pp,
            l.dp,
            plan.cluster.gpus(),
            plan.cluster.name,
            plan.target
        ))
        .into());
    }
    let batch = m
        .checked_mul(l.micro_batch)
        .and_then(|b| b.checked_mul(l.dp));
    if m == 0 || batch != Some(l.global_batch) {
        return Err(ExecError::Lower(format!(
            "the plan is inconsistent: {m} micro-batch(es) of {} on dp{} do not make its global \
             batch of {}; rebuild it with `autopar build {}`",
            l.micro_batch, l.dp, l.global_batch, plan.target
        ))
        .into());
    }
    let graph = plan_graph(ws, plan)?;
    let layout = exec_layout(plan);
    check_size(&graph, &layout, &plan.model.name)?;
    let flops = (graph.forward_flops() + graph.backward_flops()) * (m as f64) * (l.dp as f64);
    if flops > CPU_STEP_FLOPS {
        return Err(ExecError::TooLarge(format!(
            "a step of this plan computes {flops:.2e} floating-point operations ({m} \
             micro-batch(es) of {} on dp{}), above the {CPU_STEP_FLOPS:.0e} the CPU backend runs \
             per step (a few minutes); the CPU backend runs small models and batches (e.g. the \
             default workspace's tiny-llama targets)",
            l.micro_batch, l.dp
        ))
        .into());
    }
    Ok((graph, layout))
}

/// Refuses models whose training state would not fit the CPU backend's budget.
fn check_size(graph: &Graph, layout: &ExecLayout, name: &str) -> Result<(), ExecError> {
    // Parameters, gradients and two Adam moments in f32, once per data-parallel replica.
    let bytes = graph.parameter_count() as f64 * 16.0 * layout.dp as f64;
    if bytes > CPU_STATE_LIMIT {
        return Err(ExecError::TooLarge(format!(
            "`{name}` has {:.3e} parameters: its training state on the CPU backend needs {:.1} GiB \
             for dp{}, above the {:.0} GiB the CPU backend allows; the CPU backend runs small \
             models (e.g. the default workspace's tiny-llama targets)",
            graph.parameter_count() as f64,
            bytes / (1u64 << 30) as f64,
            layout.dp,
            CPU_STATE_LIMIT / (1u64 << 30) as f64
        )));
    }
    // Every activation of one micro-batch, kept for as many micro-batches as a 1F1B schedule
    // can have in flight, on every replica: an upper bound of what the devices save.
    let per_microbatch: f64 = graph
        .tensors
        .iter()
        .filter(|t| t.kind == TensorKind::Activation)
        .map(|t| t.elements() as f64 * 4.0)
        .sum();
    let virtual_stages = layout.chunks.iter().map(Vec::len).sum::<usize>().max(1);
    let inflight = layout.microbatches.min(virtual_stages).max(1);
    let activations = per_microbatch * inflight as f64 * layout.dp as f64;
    if activations > CPU_STATE_LIMIT {
        return Err(ExecError::TooLarge(format!(
            "`{name}` at micro-batch {} x {} tokens saves up to {:.1} GiB of activations on the \
             CPU backend ({inflight} micro-batch(es) in flight, dp{}), above the {:.0} GiB it \
             allows",
            graph.micro_batch,
            graph.seq,
            activations / (1u64 << 30) as f64,
            layout.dp,
            CPU_STATE_LIMIT / (1u64 << 30) as f64
        )));
    }
    Ok(())
}

/// The lowered program of `graph` under `layout` for `backend`, from the cache when a previous
/// run lowered it.
pub fn program(
    cache: &Cache,
    graph: &Graph,
    layout: &ExecLayout,
    backend: Backend,
    description: &str,
) -> Result<(Program, ProgramInfo), ExecError> {
    let start = Instant::now();
    let key = digest(&(
        "program",
        crate::executor::lower::PROGRAM_VERSION,
        backend.name(),
        "f32",
        graph,
        layout,
    ));
    let steps = |p: &Program| p.chunks.iter().map(|c| c.steps.len()).collect();
    if let Some((p, source)) = cache.lookup::<Program>(kind::PROGRAM, key) {
        let info = ProgramInfo {
            source: source.name().to_string(),
            seconds: start.elapsed().as_secs_f64(),
            key: key.hex(),
            steps_per_chunk: steps(&p),
        };
        return Ok((p, info));
    }
    let p = lower(graph, layout)?;
    cache.put(
        key,
        &p,
        &EntryMeta {
            kind: "program".into(),
            description: description.to_string(),
            ..EntryMeta::default()
        },
    );
    cache.record(kind::PROGRAM, Source::Solved);
    let info = ProgramInfo {
        source: "lowered".into(),
        seconds: start.elapsed().as_secs_f64(),
        key: key.hex(),
        steps_per_chunk: steps(&p),
    };
    Ok((p, info))
}

/// Runs `plan` for `opts.steps` steps on `backend`.
pub fn run_plan(
    ws: &Workspace,
    cache: &Cache,
    plan: &Plan,
    backend: Backend,
    opts: &RunOptions,
) -> Result<RunOutcome, EngineError> {
    if backend == Backend::Cuda {
        cuda::probe()?;
    }
    let (graph, layout) = prepare(ws, plan)?;
    let description = format!(
        "program of {} ({}), {}",
        plan.target,
        layout.describe(),
        backend.name()
    );
    let (prog, info) = program(cache, &graph, &layout, backend, &description)?;
    let (result, report) = if opts.check {
        let (r, c) = check(&graph, &prog, opts)?;
        (r, Some(c))
    } else {
        let reports = run_program(&prog, opts)?;
        (summarize(&prog, &reports), None)
    };
    Ok(RunOutcome {
        target: plan.target.clone(),
        model: plan.model.name.clone(),
        backend,
        devices: layout.devices(),
        micro_batch: graph.micro_batch as usize,
        seq: graph.seq as usize,
        layout,
        program: info,
        measured_step_time_s: result.median_step_time(),
        result,
        predicted_step_time_s: plan.estimate.step_time_s,
        predicted_time: plan.estimate.time,
        cluster: plan.cluster.name.clone(),
        comparable: backend == Backend::Cpu && plan.cluster.device.name == CPU_DEVICE,
        check: report,
        plan_space: plan.space,
        ilp: (plan.space == Space::Ilp)
            .then(|| plan.spaces.ilp.clone())
            .flatten(),
    })
}
