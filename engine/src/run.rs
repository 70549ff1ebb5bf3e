//! `autopar run`: a stored plan lowered (or its lowered program taken from the cache) and
//! executed on a backend, with the measured step time next to the plan's prediction.

use crate::EngineError;
use crate::cache::{Cache, Source, kind};
use crate::executor::placement::{Placement, State};
use crate::executor::{
    Backend, CPU_DEVICE, CheckReport, ExecError, ExecLayout, Program, RunOptions, RunResult, check,
    compare, cuda, jax, lower, run_program, summarize,
};
use crate::workspace::Workspace;
use autopar_rules::canonical::digest;
use autopar_rules::cost::context_parallel::hierarchical_inner;
use autopar_rules::cost::sharding::Spec;
use autopar_rules::model::frontend::LowerOptions;
use autopar_rules::model::graph::{DType, Graph, LayerKind, Pass, TensorId, TensorKind};
use autopar_rules::plan::estimate::TimeBreakdown;
use autopar_rules::plan::format::{Plan, SpaceBest};
use autopar_rules::plan::ilp::{self, IlpPlan, OpSpecs, Space};
use autopar_rules::plan::layout::Recompute;
use autopar_store::EntryMeta;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
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
    /// The predicted step time of what ran, on the plan's cluster, s.
    pub predicted_step_time_s: f64,
    /// Where the predicted step time goes. When an ILP pipeline ran, `compute` is its
    /// simulated pipeline (kernels, collectives, transfers and bubble together), and
    /// `grad_sync` and `optimizer` its per-step terms.
    pub predicted_time: TimeBreakdown,
    /// The cluster the prediction is for.
    pub cluster: String,
    /// The cluster's device is the one the backend runs on (a `cpu` cluster on the CPU
    /// backend) and every virtual device has a core of its own, so measured and predicted
    /// times compare.
    pub comparable: bool,
    /// Cores this machine runs threads on (a CPU cluster of more devices than that shares
    /// them, and its times do not compare with the plan's).
    pub host_cores: usize,
    /// Comparison with the single-device run, with `--check`.
    pub check: Option<CheckReport>,
    /// The space the plan chose, whose pipeline ran: `ilp` runs every stage on its own
    /// logical mesh with the plan's specs, `megatron` the plan's Megatron-LM layout.
    pub plan_space: Space,
    /// The ILP space's best, when the plan chose it.
    pub ilp: Option<SpaceBest>,
    /// What the JAX backend ran and compiled (`--backend jax`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jax: Option<JaxReport>,
}

/// What `run --backend jax` ran: the exported program, the collectives XLA compiled against
/// the plan's, and (with `--check`) the comparison with autopar's CPU executor.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JaxReport {
    /// The Python that ran it.
    pub python: String,
    /// Its JAX version.
    pub jax_version: String,
    /// XLA's platform (`cpu`, `gpu`).
    pub platform: String,
    /// The program's cache key (hex) and where it came from (`exported`, or a cache level).
    pub program_key: String,
    /// `exported`, or the cache level that had the program.
    pub program_source: String,
    /// Collectives of one micro-batch's forward and backward on one device, per virtual stage.
    pub collectives: Collectives,
    /// The sharded run compared with autopar's CPU executor's single-device run (`--check`).
    pub cpu_check: Option<CheckReport>,
}

/// Collectives by kind (`all_reduce`, `all_gather`, `reduce_scatter`, `all_to_all`,
/// `collective_permute`).
pub type CollectiveCounts = BTreeMap<String, usize>;

/// The plan's collectives beside those XLA compiled.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Collectives {
    /// The plan's, per virtual stage: one micro-batch's forward and backward on one device
    /// (conversions, and the collectives of kernels that talk: a vocabulary-parallel loss).
    pub planned: Vec<CollectiveCounts>,
    /// Per virtual stage, the weight gradients the plan leaves partial until the step (data
    /// parallelism inside an intra-op plan's mesh, sequence-parallel norm weights) and XLA
    /// reduces in every micro-batch's backward instead: one all-reduce each.
    pub deferred: Vec<CollectiveCounts>,
    /// Per virtual stage, the forward collectives of the steps the plan recomputes
    /// (`jax.checkpoint`ed): the backward runs again those whose results its gradients read,
    /// which XLA decides, so these bound what recomputation adds.
    #[serde(default)]
    pub recomputed: Vec<CollectiveCounts>,
    /// XLA's, per virtual stage: the compiled forward and backward functions together.
    pub compiled: Vec<CollectiveCounts>,
    /// XLA's in every stage's optimizer step (the replicas' gradient reduction, ZeRO's
    /// gathers); the plan's step synchronisation is priced, not counted per micro-batch.
    pub compiled_update: Vec<CollectiveCounts>,
    /// Whether every virtual stage's compiled counts are its planned ones plus its deferred,
    /// plus at most its recomputed ones.
    pub agree: bool,
}

/// The executor's layout of a stored plan.
pub fn exec_layout(plan: &Plan) -> ExecLayout {
    let e = &plan.estimate;
    let l = &e.layout;
    let over_data = ExecLayout::ep_over_data(l.tp as usize, l.ep as usize, l.etp as usize);
    ExecLayout {
        tp: e.layout.tp as usize,
        cp: e.layout.cp as usize,
        cp_comm: e.layout.cp_comm,
        cp_a2a: hierarchical_inner(e.layout.tp, e.layout.cp, plan.cluster.gpus_per_node) as usize,
        ep: l.ep.max(1) as usize,
        etp: l.etp.max(1) as usize,
        moe_drop: plan.training.moe_routing.drop_tokens,
        pp: e.layout.pp as usize,
        // Expert parallelism folds its data-parallel ranks into the stage's mesh.
        dp: e.layout.dp as usize / over_data,
        sequence_parallel: e.layout.sequence_parallel,
        zero: e.layout.zero,
        microbatches: e.num_microbatches as usize,
        chunks: e
            .stages
            .iter()
            .map(|s| s.chunks.iter().map(|c| (c.first, c.last)).collect())
            .collect(),
        grad_accumulation_fusion: plan.training.grad_accumulation_fusion,
        meshes: Vec::new(),
        placements: BTreeMap::new(),
        states: BTreeMap::new(),
        // Set with the graph ([`megatron_recomputed`]).
        recomputed: Vec::new(),
        recompute_attention: l.recompute == Recompute::Selective,
    }
}

/// The graph a plan runs: its model at the plan's micro-batch and sequence (experts' buffers
/// sized by its routing), vocabulary padded as the plan's tensor-parallel degree pads it. The
/// executor computes in f32. Under expert parallelism the micro-batch is that of the
/// data-parallel ranks the stage's mesh holds.
pub fn plan_graph(ws: &Workspace, plan: &Plan) -> Result<Graph, EngineError> {
    let model = ws.plan_model(plan)?;
    let l = &plan.estimate.layout;
    let over_data = ExecLayout::ep_over_data(l.tp as usize, l.ep as usize, l.etp as usize);
    let routed = model.def.with_routing(plan.training.moe_routing);
    routed
        .as_ref()
        .unwrap_or(&model.def)
        .lower(
            &model.name,
            &LowerOptions {
                micro_batch: l.micro_batch.saturating_mul(over_data as u64),
                seq: plan.training.seq,
                dtype: DType::F32,
                attention: plan.training.attention,
                vocab_multiple: plan.training.vocab_multiple.max(1).saturating_mul(l.tp),
                eager_elementwise: plan.training.eager_elementwise,
                // Every product runs in f32 here, an FP8 plan's too: FP8 changes what a
                // product costs and keeps, not what the plan computes.
                fp8: false,
            },
        )
        .map_err(|e| EngineError::Exec(ExecError::Lower(e.to_string())))
}

/// What `run` executes of a plan.
#[derive(Clone, Debug)]
pub struct Prepared {
    /// The plan's model at the micro-batch the run feeds.
    pub graph: Graph,
    /// The executor's layout.
    pub layout: ExecLayout,
}

/// The graph and layout `plan` runs with, refused when they would not fit the CPU backend's
/// budget: everything [`run_plan`] checks before lowering. A plan that chose the ILP space's
/// pipeline runs it, every stage on its own logical mesh with every tensor placed as the plan's
/// specs say; a plan of the Megatron-LM space runs its layout.
pub fn prepare(ws: &Workspace, plan: &Plan) -> Result<Prepared, EngineError> {
    let prepared = prepare_any(ws, plan)?;
    check_budget(&prepared.graph, &prepared.layout, &plan.model.name)?;
    Ok(prepared)
}

/// [`prepare`] without the CPU backend's budget: what an exported program runs, on whatever
/// devices it is given.
pub fn prepare_any(ws: &Workspace, plan: &Plan) -> Result<Prepared, EngineError> {
    let (graph, layout) = match (plan.space, &plan.ilp) {
        (Space::Ilp, Some(ilp)) => ilp_run(ws, plan, ilp)?,
        _ => prepare_megatron(ws, plan)?,
    };
    Ok(Prepared { graph, layout })
}

/// The graph and layout of the plan's best Megatron-LM layout (`estimate`).
fn prepare_megatron(ws: &Workspace, plan: &Plan) -> Result<(Graph, ExecLayout), EngineError> {
    let (l, m) = (&plan.estimate.layout, plan.estimate.num_microbatches);
    let devices =
        l.tp.checked_mul(l.cp)
            .and_then(|x| x.checked_mul(l.pp))
            .and_then(|x| x.checked_mul(l.dp));
    if devices != Some(plan.cluster.gpus()) {
        return Err(ExecError::Lower(format!(
            "the plan is inconsistent: tp {} x cp {} x pp {} x dp {} is not the {} GPUs of its \
             cluster `{}`; rebuild it with `autopar build {}`",
            l.tp,
            l.cp,
            l.pp,
            l.dp,
            plan.cluster.gpus(),
            plan.cluster.name,
            plan.target
        ))
        .into());
    }
    // Megatron-Core's expert group takes the tensor-parallel ranks, then the context-parallel
    // ones, then data-parallel ones; the executor folds whole tensor-parallel groups and
    // data-parallel ranks.
    let over_data = ExecLayout::ep_over_data(l.tp as usize, l.ep as usize, l.etp as usize);
    let part_of_tensor = l.etp == 1 && l.tp > 1 && l.ep > 1 && l.ep % l.tp != 0;
    let over_context = l.cp > 1 && over_data > 1;
    if part_of_tensor || over_context || l.dp % over_data as u64 != 0 {
        return Err(ExecError::Lower(format!(
            "the plan folds ep = {} expert ranks (etp {}) over part of the tensor-parallel \
             group (tp {}) or over context-parallel ranks (cp {}, dp {}); the executor runs \
             expert ranks that take whole tensor-parallel groups, then data-parallel ranks",
            l.ep, l.etp, l.tp, l.cp, l.dp
        ))
        .into());
    }
    if l.etp != 1 && l.etp != l.tp {
        return Err(ExecError::Lower(format!(
            "the plan splits experts over etp = {} ranks; the executor runs etp 1 or tp ({})",
            l.etp, l.tp
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
    let mut layout = exec_layout(plan);
    layout.recomputed = megatron_recomputed(plan, &graph);
    Ok((graph, layout))
}

/// The layers a Megatron-LM layout recomputes in full: each chunk's first `full_recompute`
/// blocks (`--recompute-method block --recompute-num-layers N`).
fn megatron_recomputed(plan: &Plan, graph: &Graph) -> Vec<usize> {
    plan.estimate
        .stages
        .iter()
        .flat_map(|s| &s.chunks)
        .flat_map(|c| {
            (c.first..=c.last)
                .filter(|&l| {
                    graph
                        .layers
                        .get(l)
                        .is_some_and(|x| x.kind == LayerKind::Block)
                })
                .take(c.full_recompute)
        })
        .collect()
}

/// The graph and layout running `ilp`, the plan's ILP pipeline, or why the executor cannot:
/// every stage on its own logical mesh, every tensor placed as the plan's specs say.
fn ilp_run(ws: &Workspace, plan: &Plan, ilp: &IlpPlan) -> Result<(Graph, ExecLayout), EngineError> {
    ilp_layout(ws, plan, ilp).map_err(|why| {
        ExecError::Lower(format!(
            "the plan's ILP pipeline is inconsistent: {why}; rebuild it with `autopar build {}`",
            plan.target
        ))
        .into()
    })
}

/// [`ilp_run`], or what is wrong with the plan.
fn ilp_layout(ws: &Workspace, plan: &Plan, ilp: &IlpPlan) -> Result<(Graph, ExecLayout), String> {
    if ilp.stages.is_empty() {
        return Err("the ILP pipeline has no stages".into());
    }
    let model = ws
        .model(&plan.model.name)
        .ok_or_else(|| format!("the workspace declares no model `{}`", plan.model.name))?;
    // As the build lowered it, so that the specs' shapes are the graph's.
    let options = ilp::lower_options(
        &plan.training,
        plan.cluster.gpus_per_node,
        ilp.micro_batch,
        DType::F32,
    );
    let graph = model
        .def
        .lower(&model.name, &options)
        .map_err(|e| e.to_string())?;
    let chunks = ilp
        .stages
        .iter()
        .map(|s| match s.layers {
            [a, b] if a < b && b <= graph.layers.len() => Ok(vec![(a, b - 1)]),
            l => Err(format!(
                "a stage holds layers {}..{} of a model of {}",
                l[0],
                l[1],
                graph.layers.len()
            )),
        })
        .collect::<Result<_, String>>()?;
    let gpus = plan.cluster.gpus();
    let mut devices = 0u64;
    for (j, s) in ilp.stages.iter().enumerate() {
        let ([a, b], (n, m)) = (s.mesh.logical, s.mesh.submesh);
        if a.checked_mul(b) != n.checked_mul(m) {
            return Err(format!(
                "stage {j}'s logical mesh {a}x{b} does not lay out the devices of its submesh \
                 {n}x{m}"
            ));
        }
    }
    for s in &ilp.stages {
        let [a, b] = s.mesh.logical;
        devices = a
            .checked_mul(b)
            .filter(|&d| d >= 1)
            .and_then(|d| devices.checked_add(d))
            .filter(|&d| d <= gpus)
            .ok_or_else(|| {
                format!(
                    "its {} stage(s) on meshes of {} do not fit the {gpus} GPUs of its cluster",
                    ilp.stages.len(),
                    ilp.stages
                        .iter()
                        .map(|s| format!("{}x{}", s.mesh.logical[0], s.mesh.logical[1]))
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            })?;
    }
    let meshes: Vec<Vec<usize>> = ilp
        .stages
        .iter()
        .map(|s| s.mesh.logical.iter().map(|&n| n as usize).collect())
        .collect();
    let (placements, states) = ilp_placements(&graph, ilp, &meshes)?;
    let layout = ExecLayout {
        grad_accumulation_fusion: plan.training.grad_accumulation_fusion,
        recomputed: ilp
            .stages
            .iter()
            .flat_map(|s| s.recomputed.iter().copied())
            .collect(),
        ..ExecLayout::on_meshes(
            meshes,
            ilp.num_microbatches as usize,
            chunks,
            placements,
            states,
        )
    };
    Ok((graph, layout))
}

/// A plan's spec of tensor `t` as a placement on a two-axis mesh.
fn spec_placement(graph: &Graph, spec: &str, t: TensorId) -> Result<Placement, String> {
    let tensor = graph.tensor(t);
    let spec: Spec = spec
        .parse()
        .map_err(|e| format!("`{}` {:?}: {e}", tensor.name, tensor.shape))?;
    if spec.0.len() != tensor.shape.len() {
        return Err(format!(
            "spec `{spec}` of `{}` {:?} does not have one split per axis",
            tensor.name, tensor.shape
        ));
    }
    Ok(Placement(
        (0..2)
            .map(|a| match spec.axis_on(a) {
                Some(k) => State::split(k, &tensor.shape),
                None => State::Replicated,
            })
            .collect(),
    ))
}

/// Placements from the plan's specs: every tensor as the op that writes it writes it (a fed
/// input: as the first op reading it reads it), a value that a stage on another mesh receives
/// as its first reader there reads it (`NAME@STAGE`), every weight by its `weight` spec; and
/// the optimizer states of every weight by its `states` spec.
type Placements = BTreeMap<String, Placement>;

fn ilp_placements(
    graph: &Graph,
    ilp: &IlpPlan,
    meshes: &[Vec<usize>],
) -> Result<(Placements, Placements), String> {
    let by_name: HashMap<&str, TensorId> = graph
        .tensors
        .iter()
        .enumerate()
        .map(|(i, t)| (t.name.as_str(), TensorId(i as u32)))
        .collect();
    let mut out = BTreeMap::new();
    let mut states = BTreeMap::new();
    let mut made_in: HashMap<TensorId, usize> = HashMap::new();
    for (j, stage) in ilp.stages.iter().enumerate() {
        let specs: HashMap<&str, &OpSpecs> = stage
            .ops
            .iter()
            .filter(|o| o.pass == Pass::Forward)
            .map(|o| (o.op.as_str(), o))
            .collect();
        for layer in &graph.layers[stage.layers[0]..stage.layers[1]] {
            for &oid in &layer.forward {
                let op = graph.op(oid);
                let s = specs
                    .get(op.name.as_str())
                    .ok_or_else(|| format!("the plan has no specs for op `{}`", op.name))?;
                let spec = |list: &[String], k: usize| {
                    list.get(k).cloned().ok_or_else(|| {
                        format!("op `{}` has fewer specs than operands and results", op.name)
                    })
                };
                for (k, &t) in op.inputs.iter().enumerate() {
                    let tensor = graph.tensor(t);
                    let received = made_in
                        .get(&t)
                        .is_some_and(|&i| i < j && meshes[i] != meshes[j]);
                    let name = if received {
                        format!("{}@{j}", tensor.name)
                    } else {
                        tensor.name.clone()
                    };
                    if (received || tensor.kind == TensorKind::Input) && !out.contains_key(&name) {
                        out.insert(name, spec_placement(graph, &spec(&s.inputs, k)?, t)?);
                    }
                }
                for (k, &t) in op.outputs.iter().enumerate() {
                    let name = graph.tensor(t).name.clone();
                    out.insert(name, spec_placement(graph, &spec(&s.outputs, k)?, t)?);
                    made_in.insert(t, j);
                }
            }
        }
        for w in &stage.parameters {
            let t = *by_name
                .get(w.name.as_str())
                .ok_or_else(|| format!("the plan's weight `{}` is not in the model", w.name))?;
            out.insert(w.name.clone(), spec_placement(graph, &w.weight, t)?);
            states.insert(w.name.clone(), spec_placement(graph, &w.states, t)?);
        }
    }
    Ok((out, states))
}

/// Refuses a run whose state, activations or arithmetic exceed the CPU backend's budget.
fn check_budget(graph: &Graph, layout: &ExecLayout, name: &str) -> Result<(), EngineError> {
    check_size(graph, layout, name)?;
    let flops = (graph.forward_flops() + graph.backward_flops())
        * (layout.microbatches as f64)
        * (layout.dp as f64);
    if flops > CPU_STEP_FLOPS {
        return Err(ExecError::TooLarge(format!(
            "a step of this plan computes {flops:.2e} floating-point operations ({} \
             micro-batch(es) of {} on dp{}), above the {CPU_STEP_FLOPS:.0e} the CPU backend runs \
             per step (a few minutes); the CPU backend runs small models and batches (e.g. the \
             default workspace's tiny-llama targets)",
            layout.microbatches, graph.micro_batch, layout.dp
        ))
        .into());
    }
    Ok(())
}

/// Refuses models whose training state would not fit the CPU backend's budget.
fn check_size(graph: &Graph, layout: &ExecLayout, name: &str) -> Result<(), ExecError> {
    // Parameters, gradients and two Adam moments in f32, once per data-parallel replica; an
    // intra-op plan may replicate everything on every device of its widest stage.
    let copies = layout.dp
        * if layout.meshes.is_empty() {
            1
        } else {
            (0..layout.pp)
                .map(|j| layout.stage_devices(j))
                .max()
                .unwrap_or(1)
        };
    let bytes = graph.parameter_count() as f64 * 16.0 * copies as f64;
    if bytes > CPU_STATE_LIMIT {
        return Err(ExecError::TooLarge(format!(
            "`{name}` has {:.3e} parameters: its training state on the CPU backend needs {:.1} GiB \
             for {copies} cop(ies), above the {:.0} GiB the CPU backend allows; the CPU backend \
             runs small models (e.g. the default workspace's tiny-llama targets)",
            graph.parameter_count() as f64,
            bytes / (1u64 << 30) as f64,
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
    let activations = per_microbatch * inflight as f64 * copies as f64;
    if activations > CPU_STATE_LIMIT {
        return Err(ExecError::TooLarge(format!(
            "`{name}` at micro-batch {} x {} tokens saves up to {:.1} GiB of activations on the \
             CPU backend ({inflight} micro-batch(es) in flight, {copies} cop(ies)), above the \
             {:.0} GiB it allows",
            graph.micro_batch,
            graph.seq,
            activations / (1u64 << 30) as f64,
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
    python: Option<&std::path::Path>,
) -> Result<RunOutcome, EngineError> {
    if backend == Backend::Cuda {
        cuda::probe()?;
    }
    let python = jax::interpreter(python);
    let Prepared { graph, layout } = prepare(ws, plan)?;
    let host_cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let devices = layout.devices();
    let (predicted_step_time_s, predicted_time) = match (plan.space, &plan.ilp) {
        (Space::Ilp, Some(ilp)) => (
            ilp.step_time_s,
            TimeBreakdown {
                compute: ilp.pipeline_s,
                recompute: 0.0,
                tp_comm: 0.0,
                p2p: 0.0,
                zero_comm: 0.0,
                bubble: 0.0,
                grad_sync: ilp.grad_sync_s,
                optimizer: ilp.optimizer_s,
            },
        ),
        _ => (plan.estimate.step_time_s, plan.estimate.time),
    };
    let description = format!(
        "program of {} ({}), {}",
        plan.target,
        layout.describe(),
        backend.name()
    );
    let (prog, info) = program(cache, &graph, &layout, backend, &description)?;
    let (result, report, jax) = if backend == Backend::Jax {
        let (r, c, j) = run_jax(cache, plan, (&graph, &layout, &prog), opts, &python)?;
        (r, c, Some(j))
    } else if opts.check {
        let (r, c) = check(&graph, &prog, opts)?;
        (r, Some(c), None)
    } else {
        let reports = run_program(&prog, opts)?;
        (summarize(&prog, &reports), None, None)
    };
    Ok(RunOutcome {
        target: plan.target.clone(),
        model: plan.model.name.clone(),
        backend,
        devices,
        micro_batch: graph.micro_batch as usize,
        seq: graph.seq as usize,
        layout,
        program: info,
        measured_step_time_s: result.median_step_time(),
        result,
        predicted_step_time_s,
        predicted_time,
        cluster: plan.cluster.name.clone(),
        comparable: backend == Backend::Cpu
            && plan.cluster.device.name == CPU_DEVICE
            && devices <= host_cores,
        host_cores,
        check: report,
        plan_space: plan.space,
        ilp: (plan.space == Space::Ilp)
            .then(|| plan.spaces.ilp.clone())
            .flatten(),
        jax,
    })
}

/// An exported JAX program.
#[derive(Clone, Debug)]
pub struct JaxProgram {
    /// The program's text.
    pub text: String,
    /// Its cache key (hex).
    pub key: String,
    /// `exported`, or the cache level that had it.
    pub source: String,
}

/// The JAX program of `plan`: its lowered program written by [`jax::program::python`], from
/// the cache when an earlier export or run wrote the same.
pub fn jax_program(ws: &Workspace, cache: &Cache, plan: &Plan) -> Result<JaxProgram, EngineError> {
    let Prepared { graph, layout } = prepare_any(ws, plan)?;
    let description = format!("program of {} ({}), jax", plan.target, layout.describe());
    let (prog, _) = program(cache, &graph, &layout, Backend::Jax, &description)?;
    jax_source(cache, plan, &graph, &layout, &prog)
}

/// [`jax_program`] of a plan already lowered to `prog` (from `graph` under `layout`).
fn jax_source(
    cache: &Cache,
    plan: &Plan,
    graph: &Graph,
    layout: &ExecLayout,
    prog: &Program,
) -> Result<JaxProgram, EngineError> {
    let header = jax::program::Header {
        target: &plan.target,
        layout: &layout.describe(),
        cluster: &plan.cluster.name,
        predicted_step_time_s: plan.step_time_s(),
    };
    // The program is written from the lowered program: its layout's version is part of the key.
    let key = digest(&(
        "jax-program",
        crate::executor::lower::PROGRAM_VERSION,
        jax::program::SOURCE,
        &plan.target,
        &plan.cluster.name,
        plan.step_time_s().to_bits(),
        graph,
        layout,
    ));
    if let Some((text, source)) = cache.lookup::<String>(kind::PROGRAM, key) {
        return Ok(JaxProgram {
            text,
            key: key.hex(),
            source: source.name().to_string(),
        });
    }
    let text = jax::program::python(graph, prog, &header)?;
    cache.put(
        key,
        &text,
        &EntryMeta {
            kind: "program".into(),
            description: format!("JAX program of {} ({})", plan.target, layout.describe()),
            ..EntryMeta::default()
        },
    );
    cache.record(kind::PROGRAM, Source::Solved);
    Ok(JaxProgram {
        text,
        key: key.hex(),
        source: "exported".into(),
    })
}

/// Runs `plan` as a JAX program: exported, run on the devices JAX sees with every compiled
/// function's HLO written out, and with `--check` compared with the single-device run of the
/// same program and with the CPU executor's.
fn run_jax(
    cache: &Cache,
    plan: &Plan,
    (graph, layout, prog): (&Graph, &ExecLayout, &Program),
    opts: &RunOptions,
    python: &std::path::Path,
) -> Result<(RunResult, Option<CheckReport>, JaxReport), EngineError> {
    let jax_version = jax::probe(python)?;
    let JaxProgram { text, key, source } = jax_source(cache, plan, graph, layout, prog)?;
    let dir = tempfile::Builder::new()
        .prefix("autopar-jax-")
        .tempdir()
        .map_err(|e| ExecError::Unavailable(format!("cannot make a temporary folder: {e}")))?;
    let script = dir.path().join(format!("{}.py", plan.target));
    std::fs::write(&script, &text)
        .map_err(|e| ExecError::Unavailable(format!("cannot write {}: {e}", script.display())))?;
    let hlo = dir.path().join("hlo");
    let (dump, single_dump) = (dir.path().join("sharded"), dir.path().join("single"));
    let sharded = jax::run(&jax::Invocation {
        python,
        script: &script,
        steps: opts.steps,
        seed: opts.seed,
        single: false,
        dump: opts.check.then_some(dump.as_path()),
        hlo: Some(&hlo),
    })?;
    let collectives = compiled_collectives(graph, prog, &hlo)?;
    let (check, cpu_check) = match &sharded.snapshot {
        Some(ours) => {
            let single = jax::run(&jax::Invocation {
                python,
                script: &script,
                steps: opts.steps,
                seed: opts.seed,
                single: true,
                dump: Some(&single_dump),
                hlo: None,
            })?;
            let theirs = single.snapshot.unwrap_or_default();
            let reference = crate::executor::reference_program(graph, prog)?;
            let cpu = run_program(
                &reference,
                &RunOptions {
                    check: true,
                    ..*opts
                },
            )?;
            let cpu_snapshot = crate::executor::snapshot(&reference, &cpu);
            (
                Some(compare(ours, &theirs, single.result)),
                Some(compare(ours, &cpu_snapshot, summarize(&reference, &cpu))),
            )
        }
        None => (None, None),
    };
    Ok((
        sharded.result,
        check,
        JaxReport {
            python: python.display().to_string(),
            jax_version,
            platform: sharded.platform,
            program_key: key,
            program_source: source,
            collectives,
            cpu_check,
        },
    ))
}

/// The plan's collectives beside the ones XLA's SPMD partitioner inserted, read from the HLO
/// the program dumped into `hlo` after that pass (`jit_forward_<chunk>`, `jit_backward_<chunk>`,
/// `jit_update_<stage>`; the first compilation of each).
fn compiled_collectives(
    graph: &Graph,
    prog: &Program,
    hlo: &std::path::Path,
) -> Result<Collectives, ExecError> {
    let files: Vec<String> = std::fs::read_dir(hlo)
        .map_err(|e| {
            ExecError::Panic(format!(
                "the JAX program dumped no HLO in {}: {e}",
                hlo.display()
            ))
        })?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.contains("after_spmd-partitioning") && n.ends_with(".txt"))
        .collect();
    let l = &prog.layout;
    // Whether a function (`forward_<chunk>`, `backward_<chunk>`, `update_<stage>`) runs on one
    // device.
    let single_device = |function: &str| {
        let index: usize = function
            .rsplit('_')
            .next()
            .and_then(|i| i.parse().ok())
            .unwrap_or(0);
        let stage = if function.starts_with("update") {
            index
        } else {
            prog.chunks.get(index).map_or(0, |c| c.stage)
        };
        l.dp * l.stage_devices(stage) == 1
    };
    let read = |function: String| -> Result<CollectiveCounts, ExecError> {
        let marker = format!(".jit_{function}.");
        let Some(file) = files.iter().filter(|n| n.contains(&marker)).min() else {
            // XLA partitions nothing on one device, and dumps nothing.
            return if single_device(&function) {
                Ok(CollectiveCounts::new())
            } else {
                Err(ExecError::Panic(format!(
                    "XLA dumped no HLO of `{function}` after its SPMD partitioner in {} (a JAX \
                     whose pass names differ from JAX 0.10's?)",
                    hlo.display()
                )))
            };
        };
        let text = std::fs::read_to_string(hlo.join(file))
            .map_err(|e| ExecError::Panic(format!("cannot read {file}: {e}")))?;
        Ok(jax::hlo::collectives(&text))
    };
    let planned: Vec<CollectiveCounts> = (0..prog.chunks.len())
        .map(|c| {
            let mut counts: CollectiveCounts = prog
                .collective_calls(c)
                .into_iter()
                .map(|(k, n)| (k.to_string(), n))
                .collect();
            for (k, n) in prog.kernel_collectives(c) {
                *counts.entry(k.to_string()).or_insert(0) += n;
            }
            counts
        })
        .collect();
    // Gradients the plan leaves partial until the step's synchronisation: XLA completes them
    // in every micro-batch's backward, one all-reduce each (a jitted function's result cannot
    // stay a partial sum).
    let deferred: Vec<CollectiveCounts> = prog
        .chunks
        .iter()
        .map(|code| {
            let mesh = l.mesh(code.stage);
            let n = code
                .parameters
                .iter()
                .filter(|&&v| {
                    prog.values[v as usize]
                        .grad_placement
                        .as_ref()
                        .is_some_and(|g| {
                            g.0.iter().enumerate().any(|(a, s)| {
                                *s == State::Partial && mesh.get(a).is_some_and(|&d| d > 1)
                            })
                        })
                })
                .count();
            if n == 0 {
                CollectiveCounts::new()
            } else {
                CollectiveCounts::from([("all_reduce".to_string(), n)])
            }
        })
        .collect();
    let mut compiled = Vec::new();
    for c in 0..prog.chunks.len() {
        let mut counts = read(format!("forward_{c}"))?;
        for (k, n) in read(format!("backward_{c}"))? {
            *counts.entry(k).or_insert(0) += n;
        }
        compiled.push(counts);
    }
    let compiled_update = (0..prog.layout.pp)
        .map(|s| read(format!("update_{s}")))
        .collect::<Result<_, _>>()?;
    let expected: Vec<CollectiveCounts> = planned
        .iter()
        .zip(&deferred)
        .map(|(p, d)| {
            let mut e = p.clone();
            for (k, n) in d {
                *e.entry(k.clone()).or_insert(0) += n;
            }
            e
        })
        .collect();
    let recomputed: Vec<CollectiveCounts> = (0..prog.chunks.len())
        .map(|c| {
            let keys = jax::program::recompute_keys(graph, prog, c);
            prog.forward_calls(c, |i| keys.get(i).is_some_and(Option::is_some))
                .into_iter()
                .map(|(k, n)| (k.to_string(), n))
                .collect()
        })
        .collect();
    let agree = expected.len() == compiled.len()
        && expected
            .iter()
            .zip(&recomputed)
            .zip(&compiled)
            .all(|((e, r), c)| {
                let kinds: std::collections::BTreeSet<&String> =
                    e.keys().chain(r.keys()).chain(c.keys()).collect();
                kinds.into_iter().all(|k| {
                    let at = |m: &CollectiveCounts| m.get(k).copied().unwrap_or(0);
                    (at(e)..=at(e) + at(r)).contains(&at(c))
                })
            });
    Ok(Collectives {
        agree,
        planned,
        deferred,
        recomputed,
        compiled,
        compiled_update,
    })
}
