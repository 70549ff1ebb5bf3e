//! The intra-op (ILP) space's plan: the pipeline Alpa's two levels choose (`solve::pipeline`),
//! priced the way a Megatron-LM layout is (`plan::estimate`) so the two spaces compare on one
//! scale, and compared op by op with Megatron-LM's sharding of the same stages.
//!
//! Pricing: the stages' forward and backward per micro-batch (compute, op collectives and
//! resharding, read from the layer tables' entries on the path priced, which are the decoded
//! plans' own), plus the point-to-point transfer of the
//! boundary activation and its gradient, go through the same 1F1B simulation as a Megatron
//! layout; each stage's per-step gradient synchronisation is exposed only beyond the slack
//! the pipeline's drain leaves it (stage `j` ends its backward passes about `j` backward
//! times before stage 0), and the slowest stage's optimizer step follows.
//!
//! Megatron-LM can run the plan when every stage has the same logical mesh `dp x tp` and
//! every op and weight of every stage has the spec Megatron-LM gives it on that mesh
//! (`StageModel::megatron_plan`), with or without sequence parallelism; the layers may be
//! split unevenly (`--pipeline-model-parallel-layout`).

use crate::cost::analytic::p2p_time;
use crate::cost::cluster::{Cluster, GIB};
use crate::cost::sharding::Mesh;
use crate::model::frontend::LowerOptions;
use crate::model::graph::{DType, Graph, Pass};
use crate::plan::estimate::{MemoryBreakdown, TimeBreakdown};
use crate::plan::layout::TrainingOptions;
use crate::solve::intra::chain::{TableSolver, boundary_bytes, moved};
use crate::solve::intra::stage::{MegatronSharding, SolverChoice, StageModel, StagePlan};
use crate::solve::pipeline::{
    MeshChoice, PipelineOptions, PipelinePlan, PricedPipeline, PricedStage, Skipped, layer_classes,
};
use crate::solve::schedule::{Bubble, PipelineSpec, Schedule, ScheduleError, simulate_times};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::Mutex;

/// How the ILP space lowers a model: micro-batches of `micro_batch` sequences in `dtype`, the
/// vocabulary padded for any tensor-parallel degree inside a node (`gpus_per_node`), so that one
/// graph serves every logical mesh. `autopar run` lowers a plan's ILP pipeline with the same
/// options, so the plan's specs fit its tensors.
pub fn lower_options(
    training: &TrainingOptions,
    gpus_per_node: u64,
    micro_batch: u64,
    dtype: DType,
) -> LowerOptions {
    LowerOptions {
        micro_batch,
        seq: training.seq,
        dtype,
        attention: training.attention,
        vocab_multiple: training.vocab_multiple.max(1).saturating_mul(gpus_per_node),
        eager_elementwise: training.eager_elementwise,
        fp8: training.fp8,
    }
}

/// Which space a target's plan is chosen from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Space {
    /// Both; the faster plan wins. A target's default.
    #[default]
    Both,
    /// Megatron-LM's layouts (tp, pp, dp, SP, ZeRO, recomputation, interleaving).
    Megatron,
    /// The intra-op ILP per layer and submesh with Alpa's stage DP.
    Ilp,
}

impl Space {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Space::Both => "both",
            Space::Megatron => "megatron",
            Space::Ilp => "ilp",
        }
    }
}

/// What the ILP space searches for a target.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct IlpSearch {
    /// Which space the plan comes from.
    pub space: Space,
    /// Sequences per micro-batch of the whole pipeline (each stage splits them over its
    /// mesh, so this is Megatron-LM's micro-batch times its data-parallel degree).
    pub micro_batch: Vec<u64>,
    /// Multi-node submeshes only of a power-of-two number of nodes.
    pub powers_of_two: bool,
    /// The logical mesh shapes stages may use; empty: all.
    #[serde(default)]
    pub logical_meshes: Vec<[u64; 2]>,
    /// Whether stages may recompute their layers (`full` among the target's `recompute`).
    pub recompute: bool,
    /// What fills the layer tables (the target's `solver`): `Auto` eliminates exactly and
    /// uses D-Rec for a layer too large for that, `Drec` uses D-Rec for every layer.
    #[serde(default)]
    pub solver: SolverChoice,
}

impl IlpSearch {
    /// The default: both spaces ([`Space::default`]); micro-batches of every power of two up to 8 sequences per
    /// GPU of a node (Megatron-LM's default micro-batches 1 to 8 at any data-parallel degree
    /// inside a node) that divides the global batch; every submesh.
    pub fn default_for(gpus_per_node: u64, global_batch: u64) -> Self {
        let mut micro_batch = Vec::new();
        let mut m = 1;
        while m <= 8 * gpus_per_node.max(1) && m <= global_batch {
            if global_batch % m == 0 {
                micro_batch.push(m);
            }
            m *= 2;
        }
        IlpSearch {
            space: Space::default(),
            micro_batch,
            powers_of_two: false,
            logical_meshes: Vec::new(),
            recompute: true,
            solver: SolverChoice::Auto,
        }
    }
}

/// An op's specs in the plan, in Alpa's notation on the stage's logical mesh.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OpSpecs {
    /// Op name.
    pub op: String,
    /// Forward or backward.
    pub pass: Pass,
    /// Spec of each operand as the op reads it.
    pub inputs: Vec<String>,
    /// Spec of each result as the op writes it.
    pub outputs: Vec<String>,
}

/// A weight's specs in the plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ParamSpecs {
    /// Parameter name.
    pub name: String,
    /// Spec of the working weight.
    pub weight: String,
    /// Spec of the master weight and optimizer moments.
    pub states: String,
}

/// An op or weight the plan shards differently from Megatron-LM.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Difference {
    /// Op or parameter name.
    pub name: String,
    /// Its specs in the plan.
    pub plan: String,
    /// Its specs under Megatron-LM.
    pub megatron: String,
}

/// A stage against Megatron-LM's sharding of the same layers on the same logical mesh.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MegatronComparison {
    /// Why Megatron-LM cannot shard the stage on its mesh (heads not divisible by the
    /// tensor-parallel degree, ...); `None` when it can.
    pub unavailable: Option<String>,
    /// Sequence parallelism in the closest of Megatron-LM's layouts.
    pub sequence_parallel: bool,
    /// Its tensor-parallel degree.
    #[serde(default)]
    pub tensor_parallel: u64,
    /// Its data-parallel degree.
    #[serde(default)]
    pub data_parallel: u64,
    /// Its objective per micro-batch, s.
    pub objective_s: f64,
    /// What the plan saves against it per micro-batch, s.
    pub saves_s: f64,
    /// Ops and weights sharded differently.
    pub differences: Vec<Difference>,
}

/// One stage of the plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct IlpStage {
    /// Layers `start..end`.
    pub layers: [usize; 2],
    /// Name of the first layer.
    pub first_name: String,
    /// Name of the last layer.
    pub last_name: String,
    /// Submesh and logical mesh.
    pub mesh: MeshChoice,
    /// Forward per micro-batch, with sending the activation on, s.
    pub forward_s: f64,
    /// Backward per micro-batch, with sending the input gradient back, s.
    pub backward_s: f64,
    /// Of those, the point-to-point transfers, s.
    pub p2p_s: f64,
    /// Gradient synchronisation and updated-weight gathers per step, s.
    pub grad_sync_s: f64,
    /// Optimizer step, s.
    pub optimizer_s: f64,
    /// The intra-op objective per micro-batch (what the stage DP minimised), s.
    pub objective_s: f64,
    /// Micro-batches in flight under 1F1B.
    pub inflight: u64,
    /// Layers recomputed in the backward pass (indices), the fewest that fit memory.
    #[serde(default)]
    pub recomputed: Vec<usize>,
    /// Their names.
    #[serde(default)]
    pub recomputed_names: Vec<String>,
    /// Of `backward_s`, the recomputation, s.
    #[serde(default)]
    pub recompute_s: f64,
    /// Memory per device with those in flight, including the runtime's reserve, GiB.
    pub memory_gib: f64,
    /// Of `forward_s + backward_s`, the kernels without recomputation, s per micro-batch (the
    /// rest is recomputation, the op collectives and resharding, and `p2p_s`); `None` in plan
    /// files written before it was recorded.
    #[serde(default)]
    pub compute_s: Option<f64>,
    /// `memory_gib` by component, bytes (activations: the micro-batches in flight with the
    /// recomputation chosen, and transient buffers; workspace: the runtime's reserve); `None`
    /// in plan files written before it was recorded.
    #[serde(default)]
    pub memory: Option<MemoryBreakdown>,
    /// Every op's specs.
    pub ops: Vec<OpSpecs>,
    /// Every weight's specs.
    pub parameters: Vec<ParamSpecs>,
    /// Against Megatron-LM.
    pub megatron: MegatronComparison,
    /// What priced the stage's layers, in runs of consecutive layers: the exact elimination,
    /// or D-Rec (a heuristic: not proven optimal).
    #[serde(default)]
    pub solvers: Vec<SolverSpan>,
    /// What D-Rec warned of while pricing the stage's layers.
    #[serde(default)]
    pub warnings: Vec<String>,
}

/// Consecutive layers whose tables one solver filled.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SolverSpan {
    /// The solver.
    pub solver: TableSolver,
    /// Layers `start..end`.
    pub layers: [usize; 2],
}

/// Runs of equal solvers among `solvers`, the solvers of layers `first..`.
pub fn spans(first: usize, solvers: &[TableSolver]) -> Vec<SolverSpan> {
    let mut out: Vec<SolverSpan> = Vec::new();
    for (l, &solver) in (first..).zip(solvers) {
        match out.last_mut() {
            Some(span) if span.solver == solver => span.layers[1] = l + 1,
            _ => out.push(SolverSpan {
                solver,
                layers: [l, l + 1],
            }),
        }
    }
    out
}

/// The ILP space's best pipeline, priced.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct IlpPlan {
    /// Sequences per micro-batch (the whole pipeline's: each stage splits it over its mesh).
    pub micro_batch: u64,
    /// Micro-batches per step.
    pub num_microbatches: u64,
    /// Predicted step time, s.
    pub step_time_s: f64,
    /// Of which the simulated pipeline, s.
    pub pipeline_s: f64,
    /// Exposed gradient synchronisation, s.
    pub grad_sync_s: f64,
    /// Optimizer step, s.
    pub optimizer_s: f64,
    /// The pipeline's bubble.
    pub bubble: Bubble,
    /// Alpa's objective for the stages (`sum of stage costs + (B - 1) * largest`), s.
    pub alpa_step_s: f64,
    /// Peak memory per device over the stages, GiB.
    pub memory_per_device_gib: f64,
    /// The stages.
    pub stages: Vec<IlpStage>,
    /// Whether Megatron-LM can run this plan (see the module's doc).
    pub megatron_expressible: bool,
    /// Why not, when it cannot.
    pub not_megatron: Option<String>,
    /// Layer tables the search read.
    pub tables: usize,
    /// Mesh choices considered.
    pub meshes: usize,
    /// Layers left off a mesh choice because their table was too large to solve exactly.
    pub skipped: Vec<Skipped>,
}

impl IlpPlan {
    /// Where the step goes, as [`crate::plan::estimate::Estimate::time`] splits a Megatron-LM
    /// layout's: the slowest stage's (forward and backward per micro-batch, the largest)
    /// kernels, recomputation, op collectives with resharding (as tensor-parallel
    /// communication) and transfers over every micro-batch, the rest of the simulated
    /// pipeline as its bubble, then the exposed gradient synchronisation and the optimizer.
    /// The parts add up to the step time. `None` for a plan file that does not record its
    /// stages' kernel time.
    pub fn time(&self) -> Option<TimeBreakdown> {
        let m = self.num_microbatches.max(1) as f64;
        let busy = |s: &IlpStage| s.forward_s + s.backward_s;
        let slowest = self
            .stages
            .iter()
            .max_by(|a, b| busy(a).total_cmp(&busy(b)))?;
        let (compute, recompute, p2p, work) = (
            slowest.compute_s?,
            slowest.recompute_s,
            slowest.p2p_s,
            busy(slowest),
        );
        Some(TimeBreakdown {
            compute: compute * m,
            recompute: recompute.max(0.0) * m,
            tp_comm: (work - compute - recompute - p2p).max(0.0) * m,
            p2p: p2p * m,
            zero_comm: 0.0,
            bubble: (self.pipeline_s - work * m).max(0.0),
            grad_sync: self.grad_sync_s,
            optimizer: self.optimizer_s,
        })
    }

    /// The memory of the most loaded stage's devices, by component. `None` for a plan file
    /// that does not record it.
    pub fn memory(&self) -> Option<MemoryBreakdown> {
        self.stages
            .iter()
            .max_by(|a, b| a.memory_gib.total_cmp(&b.memory_gib))?
            .memory
    }

    /// The plan in one line: micro-batch, stages and their meshes (runs of equal meshes
    /// counted).
    pub fn describe(&self) -> String {
        let mut runs: Vec<(MeshChoice, usize)> = Vec::new();
        for s in &self.stages {
            match runs.last_mut() {
                Some((m, n)) if *m == s.mesh => *n += 1,
                _ => runs.push((s.mesh, 1)),
            }
        }
        let meshes: Vec<String> = runs
            .iter()
            .map(|(m, n)| {
                let one = format!(
                    "{}x{} as {}x{}",
                    m.submesh.0, m.submesh.1, m.logical[0], m.logical[1]
                );
                if *n > 1 {
                    format!("{n} x ({one})")
                } else {
                    one
                }
            })
            .collect();
        format!(
            "micro-batch {} ({} micro-batches) · {} stage(s): {}",
            self.micro_batch,
            self.num_microbatches,
            self.stages.len(),
            meshes.join(", ")
        )
    }
}

/// One micro-batch size's pipeline, priced and simulated before its stages are decoded:
/// what the sizes are compared by.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct IlpCandidate {
    /// Sequences per micro-batch.
    pub micro_batch: u64,
    /// Predicted step time, s (the decoded plan's [`IlpPlan::step_time_s`]).
    pub step_time_s: f64,
    /// The pipeline.
    pub pipeline: PricedPipeline,
}

/// A stage's times as the schedule sees them, s.
struct StageTiming {
    forward: f64,
    backward: f64,
    p2p: f64,
    sync: f64,
    optimizer: f64,
}

/// The pipeline's simulated step.
struct Timing {
    stages: Vec<StageTiming>,
    makespan: f64,
    bubble: Bubble,
    grad_sync: f64,
    optimizer: f64,
}

impl Timing {
    fn step_time(&self) -> f64 {
        self.makespan + self.grad_sync + self.optimizer
    }
}

/// Simulates `stages` (found on `graph` with `opts`) on `cluster`: each stage's forward and
/// backward per micro-batch (compute, op collectives and resharding, from its layers'
/// tables), plus the point-to-point transfers of the boundary activation and its gradient,
/// through 1F1B; then the exposed gradient synchronisation and the slowest optimizer step.
fn simulate(
    graph: &Graph,
    cluster: &Cluster,
    opts: PipelineOptions,
    stages: &[&PricedStage],
) -> Result<Timing, ScheduleError> {
    let p = stages.len();
    let crossing = boundary_bytes(graph);
    let devices: Vec<u64> = stages
        .iter()
        .map(|s| s.mesh.logical[0] * s.mesh.logical[1])
        .collect();
    // Stages laid out on consecutive devices, in order.
    let first_rank: Vec<u64> = devices
        .iter()
        .scan(0, |next, &d| {
            let at = *next;
            *next += d;
            Some(at)
        })
        .collect();
    // Each device of the smaller mesh sends or receives its share of the whole tensor.
    let transfer = |from: usize, to: usize, bytes: f64| {
        let link = cluster.p2p_link(first_rank[from], first_rank[to]);
        p2p_time(bytes / devices[from].min(devices[to]) as f64, link)
    };
    let mut spec = PipelineSpec {
        schedule: Schedule::OneFOneB,
        microbatches: opts.microbatches.max(1) as usize,
        forward: vec![vec![0.0; p]],
        backward: vec![vec![0.0; p]],
        recompute: vec![vec![0.0; p]],
        activation: vec![vec![0.0; p]],
    };
    let mut timed = Vec::with_capacity(p);
    for (j, st) in stages.iter().enumerate() {
        let [start, end] = st.layers;
        let send_f = if j + 1 < p {
            transfer(j, j + 1, crossing[end - 1][0])
        } else {
            0.0
        };
        let send_b = if j > 0 {
            transfer(j, j - 1, crossing[start - 1][1])
        } else {
            0.0
        };
        let t = StageTiming {
            forward: st.forward + send_f,
            backward: st.backward + st.recompute_s + send_b,
            p2p: send_f + send_b,
            sync: st.sync,
            optimizer: (st.step - st.sync).max(0.0),
        };
        spec.forward[0][j] = t.forward;
        spec.backward[0][j] = t.backward;
        spec.recompute[0][j] = st.recompute_s;
        spec.activation[0][j] = st.activations;
        timed.push(t);
    }
    let sim = simulate_times(&spec)?;
    let grad_sync = timed
        .iter()
        .enumerate()
        .map(|(j, s)| s.sync - j as f64 * s.backward)
        .fold(0.0f64, f64::max);
    let optimizer = timed.iter().map(|s| s.optimizer).fold(0.0f64, f64::max);
    Ok(Timing {
        stages: timed,
        makespan: sim.makespan,
        bubble: sim.bubble,
        grad_sync,
        optimizer,
    })
}

/// Simulates `pipeline`, found on `graph` (lowered with `micro_batch` sequences) with
/// `opts`, on `cluster`.
pub fn candidate(
    graph: &Graph,
    cluster: &Cluster,
    micro_batch: u64,
    opts: PipelineOptions,
    pipeline: PricedPipeline,
) -> Result<IlpCandidate, ScheduleError> {
    let stages: Vec<&PricedStage> = pipeline.stages.iter().collect();
    let step_time_s = simulate(graph, cluster, opts, &stages)?.step_time();
    Ok(IlpCandidate {
        micro_batch,
        step_time_s,
        pipeline,
    })
}

/// Prices `pipeline`, found on `graph` (lowered with `micro_batch` sequences) with `opts`,
/// on `cluster`, and compares each stage with Megatron-LM's sharding of it.
pub fn price(
    graph: &Graph,
    cluster: &Cluster,
    micro_batch: u64,
    opts: PipelineOptions,
    pipeline: &PipelinePlan,
) -> Result<IlpPlan, ScheduleError> {
    let priced: Vec<&PricedStage> = pipeline.stages.iter().map(|s| &s.priced).collect();
    let timing = simulate(graph, cluster, opts, &priced)?;
    let classes = layer_classes(graph);
    let memo = MegatronMemo::default();
    let stages: Vec<IlpStage> = pipeline
        .stages
        .par_iter()
        .zip(&timing.stages)
        .map(|(stage, t)| {
            let (st, plan) = (&stage.priced, &stage.plan);
            let [start, end] = st.layers;
            IlpStage {
                layers: st.layers,
                first_name: graph.layers[start].name.clone(),
                last_name: graph.layers[end - 1].name.clone(),
                mesh: st.mesh,
                forward_s: t.forward,
                backward_s: t.backward,
                p2p_s: t.p2p,
                grad_sync_s: t.sync,
                optimizer_s: t.optimizer,
                objective_s: st.cost,
                inflight: st.inflight,
                recomputed: st.recomputed.clone(),
                recomputed_names: st
                    .recomputed
                    .iter()
                    .map(|&l| graph.layers[l].name.clone())
                    .collect(),
                recompute_s: st.recompute_s,
                memory_gib: (st.memory + cluster.device.reserved_bytes) / GIB,
                compute_s: Some(plan.per_microbatch.compute),
                memory: Some({
                    let m = &plan.memory;
                    let states = m.weights + m.gradients + m.optimizer;
                    // The stage's memory holds the backward transient too, the estimate's
                    // workspace beside the runtime's reserve.
                    MemoryBreakdown {
                        weights: m.weights,
                        grads: m.gradients,
                        optimizer: m.optimizer,
                        activations: (st.memory - states - m.working).max(0.0),
                        workspace: cluster.device.reserved_bytes + m.working,
                        total: st.memory.max(states) + cluster.device.reserved_bytes,
                    }
                }),
                ops: plan
                    .ops
                    .iter()
                    .map(|o| OpSpecs {
                        op: o.name.clone(),
                        pass: o.pass,
                        inputs: o.inputs.clone(),
                        outputs: o.outputs.clone(),
                    })
                    .collect(),
                parameters: plan
                    .parameters
                    .iter()
                    .map(|w| ParamSpecs {
                        name: w.name.clone(),
                        weight: w.weight.clone(),
                        states: w.states.clone(),
                    })
                    .collect(),
                megatron: compare(graph, &classes, cluster, st.mesh, opts, plan, &memo),
                solvers: spans(start, &stage.solvers),
                warnings: plan.solve.warnings.clone(),
            }
        })
        .collect();
    let (megatron_expressible, not_megatron) = expressible(&stages, graph.layers.len());
    Ok(IlpPlan {
        micro_batch,
        num_microbatches: opts.microbatches.max(1),
        step_time_s: timing.step_time(),
        pipeline_s: timing.makespan,
        grad_sync_s: timing.grad_sync,
        optimizer_s: timing.optimizer,
        bubble: timing.bubble,
        alpa_step_s: pipeline.step,
        memory_per_device_gib: stages.iter().map(|s| s.memory_gib).fold(0.0, f64::max),
        stages,
        megatron_expressible,
        not_megatron,
        tables: pipeline.tables,
        meshes: pipeline.meshes,
        skipped: pipeline.skipped.clone(),
    })
}

/// Megatron-LM's plans of single layers, shared by the stages of one plan: per (submesh,
/// logical mesh, sequence parallel, distributed optimizer, layer class), the first layer
/// solved and its plan, or why there is none.
type MegatronMemo = Mutex<MegatronPlans>;

/// The memo's map.
type MegatronPlans = HashMap<MegatronKey, Result<(usize, StagePlan), String>>;

/// See [`MegatronMemo`].
type MegatronKey = ((u64, u64), [u64; 2], bool, bool, usize);

/// The memo, even if another stage's thread panicked holding it (it holds finished plans).
fn lock(memo: &MegatronMemo) -> std::sync::MutexGuard<'_, MegatronPlans> {
    memo.lock().unwrap_or_else(|e| e.into_inner())
}

/// The stage's plan against Megatron-LM's layouts of its layers on its logical mesh `a x b`:
/// data parallel over axis 0 and tensor parallel over axis 1, with and without sequence
/// parallelism, and, on a `1 x b` mesh, also plain data parallelism over all `b` devices
/// (the same devices as a `b x 1` mesh, its splits named for axis 1); the optimizer states
/// split over the data-parallel axis when the plan splits them. The closest layout (fewest
/// differences, then the cheaper) is the comparison.
#[allow(clippy::too_many_arguments)]
fn compare(
    graph: &Graph,
    classes: &[usize],
    cluster: &Cluster,
    choice: MeshChoice,
    opts: PipelineOptions,
    plan: &StagePlan,
    memo: &MegatronMemo,
) -> MegatronComparison {
    // Megatron-LM's plan pins every spec: neither its time nor its specs depend on the
    // micro-batches in flight (only its memory, which the comparison does not read).
    let stage_opts = opts.stage_options(1);
    let distributed_optimizer = plan.parameters.iter().any(|w| w.states != w.weight);
    let pinned = |logical: [u64; 2], sp: bool| -> Result<StagePlan, String> {
        let mesh = Mesh::logical(cluster, choice.submesh, logical);
        let mut parts = Vec::new();
        let range = plan.layers[0]..plan.layers[1];
        for (l, &class) in range.clone().zip(&classes[range]) {
            // Identical layers have the same plan, in any stage: each class is solved once
            // per mesh and layout, then renamed.
            let key = (choice.submesh, logical, sp, distributed_optimizer, class);
            let known = lock(memo).get(&key).cloned();
            let (first, p) = match known {
                Some(found) => found?,
                None => {
                    let solved =
                        StageModel::build(graph, l..l + 1, mesh, &cluster.device, stage_opts)
                            .map_err(|e| e.to_string())
                            .and_then(|model| {
                                model
                                    .megatron_plan(MegatronSharding {
                                        sp,
                                        distributed_optimizer,
                                    })
                                    .map_err(|e| e.to_string())
                            })
                            .map(|p| (l, p));
                    lock(memo).insert(key, solved.clone());
                    solved?
                }
            };
            parts.push(moved(graph, p, first, l));
        }
        StagePlan::join(parts).ok_or_else(|| "the stage holds no layer".to_string())
    };
    let [a, b] = choice.logical;
    // (sequence parallel, [dp, tp], Megatron-LM's plan)
    let mut candidates: Vec<(bool, [u64; 2], Result<StagePlan, String>)> = [false, true]
        .into_iter()
        .map(|sp| (sp, [a, b], pinned(choice.logical, sp)))
        .collect();
    if a == 1 && b > 1 {
        candidates.push((false, [b, 1], pinned([b, 1], false).map(renamed_to_axis_1)));
    }
    let best = candidates
        .iter()
        .filter_map(|(sp, degrees, r)| {
            r.as_ref()
                .ok()
                .map(|m| (*sp, *degrees, m, differences(plan, m)))
        })
        .min_by(|x, y| {
            (x.3.len(), x.2.objective)
                .partial_cmp(&(y.3.len(), y.2.objective))
                .unwrap_or(std::cmp::Ordering::Equal)
        });
    match best {
        Some((sp, [dp, tp], m, differences)) => MegatronComparison {
            unavailable: None,
            sequence_parallel: sp,
            tensor_parallel: tp,
            data_parallel: dp,
            objective_s: m.objective,
            saves_s: m.objective - plan.objective,
            differences,
        },
        None => MegatronComparison {
            unavailable: candidates.into_iter().find_map(|(_, _, r)| r.err()),
            sequence_parallel: false,
            tensor_parallel: 0,
            data_parallel: 0,
            objective_s: f64::INFINITY,
            saves_s: f64::INFINITY,
            differences: Vec::new(),
        },
    }
}

/// A plan on a `b x 1` mesh with its splits named as on the `1 x b` mesh of the same devices
/// (axis 1 has one device, so no spec names it).
fn renamed_to_axis_1(mut p: StagePlan) -> StagePlan {
    let rename = |s: &mut String| *s = s.replace("S0", "S1");
    for o in &mut p.ops {
        o.inputs
            .iter_mut()
            .chain(o.outputs.iter_mut())
            .for_each(rename);
    }
    for w in &mut p.parameters {
        rename(&mut w.weight);
        rename(&mut w.states);
    }
    p
}

/// Ops and weights of `plan` whose specs differ from `megatron`'s (the same ops, in order).
fn differences(plan: &StagePlan, megatron: &StagePlan) -> Vec<Difference> {
    let ops = plan
        .ops
        .iter()
        .zip(&megatron.ops)
        .filter(|(a, m)| a.inputs != m.inputs || a.outputs != m.outputs)
        .map(|(a, m)| Difference {
            name: a.name.clone(),
            plan: format!("{} -> {}", a.inputs.join(" "), a.outputs.join(" ")),
            megatron: format!("{} -> {}", m.inputs.join(" "), m.outputs.join(" ")),
        });
    let weights = plan
        .parameters
        .iter()
        .zip(&megatron.parameters)
        .filter(|(a, m)| a.weight != m.weight || a.states != m.states)
        .map(|(a, m)| Difference {
            name: a.name.clone(),
            plan: format!("weight {} states {}", a.weight, a.states),
            megatron: format!("weight {} states {}", m.weight, m.states),
        });
    ops.chain(weights).collect()
}

/// The blocks of a stage of a model of `layers` layers (the embedding is the first layer,
/// the output layer the last): its layers less those two.
pub fn stage_blocks(stage: &IlpStage, layers: usize) -> usize {
    let [a, b] = stage.layers;
    (b - a) - usize::from(a == 0) - usize::from(b == layers)
}

/// Megatron-LM's `--recompute-num-layers N` of block-wise recomputation that recomputes what
/// the stages do (the first `min(N, blocks)` blocks of every stage); `Ok(0)` when nothing is
/// recomputed, and why not when Megatron-LM cannot.
pub fn megatron_recompute(stages: &[IlpStage], layers: usize) -> Result<usize, String> {
    for s in stages {
        let outside = s
            .recomputed
            .iter()
            .zip(&s.recomputed_names)
            .find(|(l, _)| **l == 0 || **l + 1 == layers);
        if let Some((l, name)) = outside {
            return Err(format!(
                "it recomputes `{name}` (layer {l}); Megatron-LM recomputes transformer blocks only"
            ));
        }
    }
    let n = stages.iter().map(|s| s.recomputed.len()).max().unwrap_or(0);
    for s in stages {
        let blocks = stage_blocks(s, layers);
        let first_block = s.layers[0] + usize::from(s.layers[0] == 0);
        let want: Vec<usize> = (first_block..first_block + n.min(blocks)).collect();
        if s.recomputed != want {
            return Err(format!(
                "layers {}..{} recompute {} of their {blocks} blocks where another stage \
                 recomputes {n}; Megatron-LM's block-wise recomputation recomputes the first \
                 min(N, blocks) blocks of every stage for one N",
                s.layers[0],
                s.layers[1],
                s.recomputed.len(),
            ));
        }
    }
    Ok(n)
}

/// Whether Megatron-LM can run the stages (of a model of `layers` layers), and why not.
fn expressible(stages: &[IlpStage], layers: usize) -> (bool, Option<String>) {
    let Some(first) = stages.first() else {
        return (false, Some("the plan has no stage".into()));
    };
    if let Some(s) = stages.iter().find(|s| s.mesh.logical != first.mesh.logical) {
        return (
            false,
            Some(format!(
                "stages run on different logical meshes ({}x{} for layers {}..{}, {}x{} for \
                 layers {}..{}); Megatron-LM gives every stage the same tp and dp",
                first.mesh.logical[0],
                first.mesh.logical[1],
                first.layers[0],
                first.layers[1],
                s.mesh.logical[0],
                s.mesh.logical[1],
                s.layers[0],
                s.layers[1]
            )),
        );
    }
    if let Some(s) = stages.iter().find(|s| s.megatron.unavailable.is_some()) {
        let why = s.megatron.unavailable.clone().unwrap_or_default();
        return (
            false,
            Some(format!(
                "Megatron-LM cannot shard layers {}..{} on {}x{}: {why}",
                s.layers[0], s.layers[1], s.mesh.logical[0], s.mesh.logical[1]
            )),
        );
    }
    let sp = first.megatron.sequence_parallel;
    if stages.iter().any(|s| s.megatron.sequence_parallel != sp) {
        return (
            false,
            Some("some stages use sequence parallelism and others do not".into()),
        );
    }
    if let Err(why) = megatron_recompute(stages, layers) {
        return (false, Some(why));
    }
    if let Some(s) = stages.iter().find(|s| !s.megatron.differences.is_empty()) {
        let d = &s.megatron.differences[0];
        return (
            false,
            Some(format!(
                "{} ops and weights are sharded as Megatron-LM cannot, e.g. `{}` as {} (Megatron-LM: {})",
                stages
                    .iter()
                    .map(|s| s.megatron.differences.len())
                    .sum::<usize>(),
                d.name,
                d.plan,
                d.megatron
            )),
        );
    }
    (true, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stage of layers `a..b` recomputing `recomputed`.
    fn stage(a: usize, b: usize, recomputed: &[usize]) -> IlpStage {
        IlpStage {
            layers: [a, b],
            first_name: String::new(),
            last_name: String::new(),
            mesh: MeshChoice {
                submesh: (1, 1),
                logical: [1, 1],
            },
            forward_s: 0.0,
            backward_s: 0.0,
            p2p_s: 0.0,
            grad_sync_s: 0.0,
            optimizer_s: 0.0,
            objective_s: 0.0,
            inflight: 1,
            recomputed: recomputed.to_vec(),
            recomputed_names: recomputed.iter().map(|l| format!("layer{l}")).collect(),
            recompute_s: 0.0,
            memory_gib: 0.0,
            compute_s: None,
            memory: None,
            ops: Vec::new(),
            parameters: Vec::new(),
            megatron: MegatronComparison {
                unavailable: None,
                sequence_parallel: false,
                tensor_parallel: 1,
                data_parallel: 1,
                objective_s: 0.0,
                saves_s: 0.0,
                differences: Vec::new(),
            },
            solvers: Vec::new(),
            warnings: Vec::new(),
        }
    }

    #[test]
    fn megatron_recomputes_the_first_blocks_of_every_stage() {
        // Embedding (0), blocks 1..=6, output layer (7), in stages 0..3, 3..6, 6..8.
        let split =
            |r: [&[usize]; 3]| vec![stage(0, 3, r[0]), stage(3, 6, r[1]), stage(6, 8, r[2])];
        assert_eq!(megatron_recompute(&split([&[], &[], &[]]), 8), Ok(0));
        assert_eq!(megatron_recompute(&split([&[1], &[3], &[6]]), 8), Ok(1));
        // Two per stage: the last stage has one block, recomputed.
        assert_eq!(
            megatron_recompute(&split([&[1, 2], &[3, 4], &[6]]), 8),
            Ok(2)
        );
        assert_eq!(
            megatron_recompute(&split([&[1, 2], &[3, 4, 5], &[6]]), 8),
            Ok(3)
        );
        let err = |r| megatron_recompute(&split(r), 8).expect_err("not Megatron-LM's");
        assert!(err([&[1, 2], &[4], &[6]]).starts_with("layers 3..6 recompute 1 of their 3"));
        assert!(err([&[1], &[3], &[]]).starts_with("layers 6..8 recompute 0 of their 1"));
        assert_eq!(
            err([&[], &[], &[7]]),
            "it recomputes `layer7` (layer 7); Megatron-LM recomputes transformer blocks only"
        );
        assert!(err([&[0, 1], &[3], &[6]]).contains("`layer0`"));
    }
}
