//! The intra-op problem of a range of layers on a mesh (ALGORITHMS.md §3): one variable per op
//! that is not a follower, per parameter (where its weights and its optimizer states live) and
//! per tensor entering the range; costs from the analytic model, with the kernel times a
//! profile measured on an op's tile shapes in place of the modelled ones; and the plan read
//! back from a solution.
//!
//! What the objective counts, per micro-batch:
//! * every op's kernel on its tile, and the collectives its strategy implies: an all-reduce of
//!   an activation that comes out as a partial sum, an all-reduce of row statistics when a
//!   normalised dimension is split;
//! * every resharding between the spec a tensor is produced in and the spec a consumer needs
//!   (a working weight held more sharded than an op needs is gathered, as ZeRO-3 does);
//! * once per step (so divided by the number of micro-batches): the reduction of each weight
//!   gradient into the layout of its optimizer states (all-reduce or reduce-scatter), the
//!   optimizer's update of its shard, and the all-gather of updated weights into their working
//!   layout (ZeRO-1/2 when the states are more sharded than the weights).
//!
//! Memory is the per-device peak at the start of the last in-flight micro-batch's backward:
//! activations saved for backward (times the micro-batches in flight), gradient buffers (kept
//! in the layout the weight gradient is produced in), working weights and optimizer states,
//! which a plan holds (the budget bounds them, as a sum over variables); and on top of them the
//! backward pass's largest transient, as the Megatron-LM estimate counts it: the largest
//! activation gradient an op makes, or, with `fp32_loss`, the two fp32 logit-sized tensors
//! PyTorch's unfused cross-entropy backward holds.

mod megatron;

pub use megatron::{MegatronSharding, PinError};

mod drec;

use super::drec::Cut;
use super::einsum::{DimKind, Einsum, einsum};
use super::problem::{Assignment, Edge, Problem, Var};
use super::{exact, ilp};
use crate::cost::analytic::{
    Collective, FP8_CAST_BYTES_PER_ELEMENT, GemmShape, fp8_cast_time, gradient_accumulation,
    kernel_dtype, op_kernel_time, op_traffic,
};
use crate::cost::cluster::{Device, GIB};
use crate::cost::memory::{FP8_WEIGHT_COPY_BYTES, Precision, StateBytes, fp32_loss_working};
use crate::cost::profile::{CollectiveSignature, OpSignature, Profile, kernel_name};
use crate::cost::sharding::{
    AxisSplit, Mesh, Spec, Step, reduce_steps, reshard_steps, steps_time, valid_specs,
};
use crate::cost::tp_comm_overlap::Userbuffers;
use crate::model::graph::{DType, Graph, OpId, OpKind, Pass, TensorId, TensorKind};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::time::Instant;

/// Mesh axis -> dimension of an op's loop nest it splits.
type Assign = [Option<usize>; 2];

/// Which solver runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SolverChoice {
    /// The exact solver when the graph's width allows, else the ILP (D-Rec above
    /// [`AUTO_DREC_VARIABLES`]).
    #[default]
    Auto,
    /// Only the exact solver.
    Exact,
    /// Only the ILP.
    Ilp,
    /// D-Rec's linear-time heuristic ([`crate::solve::intra::drec`]): not proven optimal.
    Drec,
}

/// Above this many variables, [`SolverChoice::Auto`] uses D-Rec: a range that large (about
/// 1,800 forward ops) is a long unrolled or multi-branch graph, on which the exact solver
/// grows superlinearly (a generated 5,000-op transformer: 13,180 variables, 22 s exact, 0.13 s
/// D-Rec on 2x4) while D-Rec stays linear. A transformer block has a few dozen variables, and
/// the build solves one layer at a time, so builds stay exact.
pub const AUTO_DREC_VARIABLES: usize = 5_000;

/// [`SolveInfo::solver`] of a plan joined from parts that different solvers found.
pub const MIXED_SOLVERS: &str = "mixed";

/// How the range is trained.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StageOptions<'p> {
    /// Micro-batches per step (per-step costs are divided by this).
    pub microbatches: u64,
    /// Micro-batches whose saved activations are live at the peak.
    pub inflight: u64,
    /// Per-device memory budget, bytes.
    pub memory_budget: Option<f64>,
    /// Training precision (bytes of weights, gradients and optimizer states).
    pub precision: Precision,
    /// Solver.
    pub solver: SolverChoice,
    /// ILP time limit, s.
    pub time_limit: f64,
    /// Largest factor the exact solver may build before the ILP takes over.
    pub max_exact_entries: f64,
    /// Most additions a layer table's exact elimination may plan
    /// ([`crate::solve::intra::chain::MAX_TABLE_WORK`] by default).
    pub max_table_work: f64,
    /// Weight-gradient products accumulate into the gradient buffer themselves
    /// (Megatron-LM's `--gradient-accumulation-fusion`); otherwise a separate kernel adds
    /// each fresh weight gradient to it.
    pub grad_accumulation_fusion: bool,
    /// Gradient buffers are fp32 and gradients are reduced in fp32 (Megatron-LM's
    /// `--accumulate-allreduce-grads-in-fp32`); otherwise both are in the working precision.
    pub grad_reduce_in_fp32: bool,
    /// The loss is PyTorch's unfused fp32 cross-entropy (torchtitan's): its backward holds two
    /// fp32 tensors the size of the probabilities it saved ([`crate::plan::runtime::Runtime`]).
    pub fp32_loss: bool,
    /// Transformer Engine's userbuffers overlap an all-gather into a product and a
    /// reduce-scatter out of one with that product ([`StageModel::userbuffers_exposed`]), as
    /// Megatron-Core's `--tp-comm-overlap` does for the tensor-parallel group's.
    pub tp_comm_overlap: bool,
    /// Measured kernel times: an op whose tile shapes the profile measured (under the name,
    /// pass and dtype `autopar profile` gives it) costs the measured time, as in Megatron-LM's
    /// layer costs.
    pub profile: Option<&'p Profile>,
}

impl Default for StageOptions<'_> {
    fn default() -> Self {
        StageOptions {
            microbatches: 1,
            inflight: 1,
            memory_budget: None,
            precision: Precision::Bf16,
            solver: SolverChoice::Auto,
            time_limit: 60.0,
            max_exact_entries: 4e6,
            max_table_work: crate::solve::intra::chain::MAX_TABLE_WORK,
            grad_accumulation_fusion: true,
            grad_reduce_in_fp32: false,
            fp32_loss: false,
            tp_comm_overlap: false,
            profile: None,
        }
    }
}

impl StageOptions<'_> {
    /// Bytes per parameter of weights, gradients and optimizer states.
    pub fn state_bytes(&self) -> StateBytes {
        StateBytes::of(self.precision, self.grad_reduce_in_fp32)
    }
}

/// Why the intra-op pass found no plan.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum IntraError {
    /// The layer range is empty or outside the graph.
    #[error("layers {first}..{end}: expected a non-empty range within the model's {layers} layers")]
    Range {
        /// First layer asked for.
        first: usize,
        /// One past the last.
        end: usize,
        /// Layers in the graph.
        layers: usize,
    },
    /// No sharding fits the memory budget.
    #[error(
        "no sharding fits {budget_gib:.2} GiB per device: the leanest sharding of this range needs {least_gib:.2} GiB (raise the budget, or use a bigger mesh or fewer layers)"
    )]
    NoFit {
        /// The budget, GiB.
        budget_gib: f64,
        /// What the leanest sharding needs, GiB.
        least_gib: f64,
    },
    /// The exact solver was asked for but the graph is too wide for it.
    #[error("the exact solver declined ({0}); use the ILP")]
    TooWide(String),
    /// The ILP failed.
    #[error(transparent)]
    Ilp(#[from] ilp::IlpError),
    /// The range holds an op the intra-op space does not model (mixture-of-experts routing,
    /// multi-head latent attention).
    #[error("op `{op}` ({kind}): the intra-op ILP does not model it yet")]
    Unsupported {
        /// The op's name.
        op: String,
        /// Its kind.
        kind: &'static str,
    },
}

/// Why a collective runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// An op's result is a partial sum over a split reduced dimension.
    PartialSum,
    /// A normalised dimension is split: per-row statistics are summed.
    Statistics,
    /// A tensor is produced in one spec and consumed in another.
    Reshard,
    /// A working weight is held more sharded than an op uses it.
    WeightGather,
    /// A weight gradient is reduced into its optimizer states' layout (once per step).
    GradientSync,
    /// Updated weights are gathered from the optimizer's shards (once per step).
    UpdatedWeights,
}

/// When a cost is paid.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Every micro-batch, in the forward pass.
    Forward,
    /// Every micro-batch, in the backward pass.
    Backward,
    /// Once per step.
    Step,
}

/// One collective of the plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CollectiveUse {
    /// The collective.
    pub kind: Collective,
    /// Mesh axis.
    pub axis: usize,
    /// Payload, bytes.
    pub bytes: f64,
    /// Time, s.
    pub seconds: f64,
    /// The tensor it moves.
    pub tensor: String,
    /// Why.
    pub reason: Reason,
    /// When.
    pub phase: Phase,
}

/// The sharding of one op.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OpSharding {
    /// Op name.
    pub name: String,
    /// Op kind.
    pub kind: String,
    /// Pass.
    pub pass: Pass,
    /// Spec of each operand as the op reads it.
    pub inputs: Vec<String>,
    /// Spec of each result (after any reduction).
    pub outputs: Vec<String>,
    /// Kernel time on one device, s.
    pub compute_seconds: f64,
    /// Name of the op whose variable it follows, if merged.
    pub follows: Option<String>,
}

/// Where one parameter lives.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ParamSharding {
    /// Parameter name.
    pub name: String,
    /// Shape.
    pub shape: Vec<u64>,
    /// Spec of the working weight.
    pub weight: String,
    /// Spec of the master weight and optimizer moments.
    pub states: String,
}

/// Per-device memory at the peak, bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StageMemory {
    /// Saved activations of the micro-batches in flight.
    pub activations: f64,
    /// Working weights.
    pub weights: f64,
    /// Gradient buffers.
    pub gradients: f64,
    /// Master weights and optimizer moments.
    pub optimizer: f64,
    /// The backward pass's largest transient (an activation gradient, or the unfused fp32
    /// loss's working tensors), live beside everything held. A budget does not bound it.
    #[serde(default)]
    pub working: f64,
    /// Everything held: activations, weights, gradients and optimizer states (what a budget
    /// bounds).
    pub total: f64,
    /// The per-device budget the solve respected, if any.
    pub budget: Option<f64>,
}

impl StageMemory {
    /// The per-device peak: everything held and the backward pass's transient.
    pub fn peak(&self) -> f64 {
        self.total + self.working
    }
}

/// Time split by kind, s.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StageTimes {
    /// Kernels.
    pub compute: f64,
    /// Collectives ops imply (partial sums, statistics).
    pub communication: f64,
    /// Reshardings between ops and weight gathers.
    pub resharding: f64,
}

/// How the problem was solved.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SolveInfo {
    /// `exact` or `ilp`.
    pub solver: String,
    /// Whether the optimum is proven.
    pub optimal: bool,
    /// Relative gap to the best lower bound known (0 when proven).
    pub gap: f64,
    /// Wall time of the solve, s.
    pub seconds: f64,
    /// The objective the solver reached, s per micro-batch: the same number as
    /// [`StagePlan::objective`], which is recomputed from the plan's parts.
    pub cost: f64,
    /// Variables (after follower merging).
    pub variables: usize,
    /// Strategies over all variables.
    pub strategies: usize,
    /// Strategies left after dropping dominated ones (what the solver saw).
    pub undominated: usize,
    /// Edges between variables.
    pub edges: usize,
    /// Largest factor the exact solver builds.
    pub width: f64,
    /// What the solver could not do as asked (D-Rec: operators nothing could cut on a mesh
    /// axis, kept replicated there). Always written, even when empty: the cache's encoding
    /// (postcard) has no field names, and a field left out cannot be read back.
    #[serde(default)]
    pub warnings: Vec<String>,
}

/// The intra-op plan of a layer range on a mesh: the stage cost the inter-op DP uses.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StagePlan {
    /// Mesh shape.
    pub mesh: [u64; 2],
    /// Layers `first..end`.
    pub layers: [usize; 2],
    /// Micro-batches per step.
    pub microbatches: u64,
    /// The objective: forward + backward per micro-batch + per-step costs / micro-batches, s.
    pub objective: f64,
    /// Forward latency per micro-batch, s.
    pub forward: f64,
    /// Backward latency per micro-batch, s.
    pub backward: f64,
    /// Per-step costs (gradient synchronisation, optimizer, updated-weight gathers), s.
    pub step: f64,
    /// Per-micro-batch time by kind.
    pub per_microbatch: StageTimes,
    /// Memory per device.
    pub memory: StageMemory,
    /// Per op.
    pub ops: Vec<OpSharding>,
    /// Per parameter.
    pub parameters: Vec<ParamSharding>,
    /// Every collective.
    pub collectives: Vec<CollectiveUse>,
    /// Solver.
    pub solve: SolveInfo,
}

impl StagePlan {
    /// Collectives of `reason` in `phase`.
    pub fn count(&self, reason: Reason, phase: Phase) -> usize {
        self.collectives
            .iter()
            .filter(|c| c.reason == reason && c.phase == phase)
            .count()
    }

    /// The same plan for another range with the same ops in the same order (an identical
    /// transformer block): every op, weight and tensor name looked up in `names`, which maps
    /// this range's names to the other's.
    pub fn renamed(mut self, names: &HashMap<String, String>, layers: [usize; 2]) -> StagePlan {
        let rename = |s: &mut String| {
            if let Some(n) = names.get(s.as_str()) {
                s.clone_from(n);
            }
        };
        self.layers = layers;
        for o in &mut self.ops {
            rename(&mut o.name);
            if let Some(f) = &mut o.follows {
                rename(f);
            }
        }
        self.parameters.iter_mut().for_each(|p| rename(&mut p.name));
        self.collectives
            .iter_mut()
            .for_each(|c| rename(&mut c.tensor));
        self
    }

    /// The same plan with `inflight` micro-batches in flight where it was solved with
    /// `built_with`: only the saved activations scale (without a budget, the solution does not
    /// depend on them).
    pub fn with_inflight(mut self, built_with: u64, inflight: u64) -> StagePlan {
        let m = &mut self.memory;
        m.activations *= inflight.max(1) as f64 / built_with.max(1) as f64;
        m.total = m.activations + m.weights + m.gradients + m.optimizer;
        self
    }

    /// The plan of consecutive ranges solved apart on one mesh (the layers of a chain, each
    /// with its boundary pinned to the chain's optimum), as one range: times, memory and
    /// solver figures add up, ops, parameters and collectives follow in order. `None` for
    /// no parts.
    pub fn join(parts: Vec<StagePlan>) -> Option<StagePlan> {
        let mut it = parts.into_iter();
        let mut out = it.next()?;
        for p in it {
            out.layers[1] = p.layers[1];
            out.objective += p.objective;
            out.forward += p.forward;
            out.backward += p.backward;
            out.step += p.step;
            out.per_microbatch.compute += p.per_microbatch.compute;
            out.per_microbatch.communication += p.per_microbatch.communication;
            out.per_microbatch.resharding += p.per_microbatch.resharding;
            out.memory.activations += p.memory.activations;
            out.memory.weights += p.memory.weights;
            out.memory.gradients += p.memory.gradients;
            out.memory.optimizer += p.memory.optimizer;
            out.memory.working = out.memory.working.max(p.memory.working);
            out.memory.total += p.memory.total;
            out.ops.extend(p.ops);
            out.parameters.extend(p.parameters);
            out.collectives.extend(p.collectives);
            let (a, b) = (&mut out.solve, p.solve);
            if a.solver != b.solver {
                a.solver = MIXED_SOLVERS.into();
            }
            for w in b.warnings {
                if !a.warnings.contains(&w) {
                    a.warnings.push(w);
                }
            }
            a.optimal &= b.optimal;
            a.gap = a.gap.max(b.gap);
            a.seconds += b.seconds;
            a.cost += b.cost;
            a.variables += b.variables;
            a.strategies += b.strategies;
            a.undominated += b.undominated;
            a.edges += b.edges;
            a.width = a.width.max(b.width);
        }
        Some(out)
    }
}

/// An op strategy priced.
#[derive(Clone, Debug)]
struct Realized {
    /// The mesh axes' dimensions it was made from.
    assign: Assign,
    /// Specs of the inputs as read.
    inputs: Vec<Spec>,
    /// Specs of the outputs (complete after reduction), then of implicit saved tensors.
    outputs: Vec<Spec>,
    /// Per output: mesh axes it is still a partial sum over. Weight gradients are reduced
    /// once per step, activations whose reduction can wait for their consumer on the way
    /// in (an all-reduce, or a reduce-scatter when the consumer wants them split, as
    /// sequence parallelism does); any other activation is all-reduced by the op.
    partial: Vec<u8>,
    compute: f64,
    comm: Vec<(Step, Reason, TensorId)>,
    gradients: f64,
    /// The backward transient of the op: its largest activation-gradient output, or the
    /// unfused fp32 loss's two working tensors.
    working: f64,
}

struct OpNode {
    op: OpId,
    var: usize,
    leader: Option<usize>,
    realized: Vec<Realized>,
}

struct ParamNode {
    tensor: TensorId,
    var: usize,
    /// (working weight, optimizer states).
    choices: Vec<(Spec, Spec)>,
}

struct SourceNode {
    tensor: TensorId,
    var: usize,
    specs: Vec<Spec>,
}

#[derive(Clone, Copy)]
enum Producer {
    /// Output (or implicit saved tensor) `j` of node `n`.
    Op(usize, usize),
    Source(usize),
    /// The copy node `n` read as its operand `i`: a weight-gradient product reads the output
    /// gradient the input-gradient product of the same op already resharded (Megatron-LM
    /// gathers it once for both).
    Read(usize, usize),
}

struct Flow {
    tensor: TensorId,
    from: Producer,
    to: usize,
    input: usize,
    /// The gather of a saved activation into a weight-gradient product: issued ahead and
    /// overlapped with the input-gradient product of the same op ([`StageModel::flow_time`]),
    /// wherever the activation was made (inside the range or entering it: a layer's table
    /// must price it as the whole range does).
    overlapped: bool,
}

/// An activation saved for the backward pass, held as `at` gives it: as its producer made it
/// (or as it entered the range), or as an opaque op read it. Megatron-LM's column-parallel
/// products under sequence parallelism keep their input's sequence shard and gather it again
/// for the weight gradient (`LinearWithGradAccumulationAndAsyncCommunication`; Korthikanti et
/// al. 2022 §4.2.2), which is what every backward read, a flow from the producer, prices.
struct Saved {
    tensor: TensorId,
    at: Producer,
}

struct WeightUse {
    param: usize,
    to: usize,
    input: usize,
}

struct GradSync {
    from: usize,
    output: usize,
    param: usize,
}

/// The intra-op problem of a layer range, ready to solve and to read solutions back.
pub struct StageModel<'g> {
    graph: &'g Graph,
    mesh: Mesh,
    device: Device,
    layers: Range<usize>,
    opts: StageOptions<'g>,
    nodes: Vec<OpNode>,
    params: Vec<ParamNode>,
    sources: Vec<SourceNode>,
    flows: Vec<Flow>,
    saved: Vec<Saved>,
    uses: Vec<WeightUse>,
    syncs: Vec<GradSync>,
    var_sizes: Vec<usize>,
    /// D-Rec's view of each variable ([`StageModel::drec_cuts`]): per strategy, what it cuts
    /// on each mesh axis, recorded as the strategies are made.
    cuts: Vec<Vec<[Cut; 2]>>,
    /// Per variable, whether it is an operator's (D-Rec cuts those on every level it can).
    forced: Vec<bool>,
    /// Where each tensor made inside the range comes from: (node, output index).
    produced: HashMap<TensorId, (usize, usize)>,
    /// Activations and gradients whose partial sums are reduced on the way into their
    /// consumer: one consumer, in the producer's layer, and never saved for the backward
    /// pass.
    deferred: HashSet<TensorId>,
    /// The weights the range's FP8 products read: each is cast to FP8 once per step and its
    /// FP8 copies held ([`crate::cost::memory::FP8_WEIGHT_COPY_BYTES`]).
    fp8_weights: HashSet<TensorId>,
    problem: Problem,
}

/// Ops that take their operand's strategy (elementwise and views) instead of a variable.
fn is_follower_kind(kind: OpKind) -> bool {
    matches!(
        kind,
        OpKind::Gelu
            | OpKind::Silu
            | OpKind::SwiGlu
            | OpKind::Add
            | OpKind::Mul
            | OpKind::Dropout
            | OpKind::DropoutAdd
            | OpKind::Rope
            | OpKind::Slice
            | OpKind::Transpose
    )
}

/// The spec of a tensor whose axes carry `axes` under `assign`.
fn spec_of(axes: &[Option<usize>], assign: &Assign) -> Spec {
    Spec(
        axes.iter()
            .map(|d| {
                let mut mask = 0u8;
                for (a, on) in assign.iter().enumerate() {
                    if d.is_some() && *on == *d {
                        mask |= 1 << a;
                    }
                }
                AxisSplit::from_axes(mask)
            })
            .collect(),
    )
}

impl<'g> StageModel<'g> {
    /// Builds the problem of layers `layers` of `graph` on `mesh` of `device`s.
    pub fn build(
        graph: &'g Graph,
        layers: Range<usize>,
        mesh: Mesh,
        device: &Device,
        opts: StageOptions<'g>,
    ) -> Result<StageModel<'g>, IntraError> {
        if layers.start >= layers.end || layers.end > graph.layers.len() {
            return Err(IntraError::Range {
                first: layers.start,
                end: layers.end,
                layers: graph.layers.len(),
            });
        }
        let mut ops: Vec<OpId> = layers
            .clone()
            .flat_map(|l| {
                let layer = &graph.layers[l];
                layer.forward.iter().chain(&layer.backward).copied()
            })
            .collect();
        if let Some(op) = graph
            .first_megatron_only_op()
            .filter(|op| layers.contains(&(op.layer as usize)))
        {
            return Err(IntraError::Unsupported {
                op: op.name.clone(),
                kind: op.kind.name(),
            });
        }
        // Op ids are in execution order (forward, then backward in reverse).
        ops.sort_unstable();
        let layer_of: HashMap<OpId, usize> = layers
            .clone()
            .flat_map(|l| {
                let layer = &graph.layers[l];
                layer
                    .forward
                    .iter()
                    .chain(&layer.backward)
                    .map(move |&o| (o, l))
            })
            .collect();
        let mut model = StageModel {
            graph,
            mesh,
            device: device.clone(),
            layers,
            opts,
            nodes: Vec::new(),
            params: Vec::new(),
            sources: Vec::new(),
            flows: Vec::new(),
            saved: Vec::new(),
            uses: Vec::new(),
            syncs: Vec::new(),
            var_sizes: Vec::new(),
            cuts: Vec::new(),
            forced: Vec::new(),
            produced: HashMap::new(),
            deferred: deferred_reductions(graph, &ops),
            fp8_weights: ops
                .iter()
                .filter_map(|&o| graph.fp8_weight(graph.op(o)))
                .collect(),
            problem: Problem {
                vars: Vec::new(),
                edges: Vec::new(),
                memory_budget: opts.memory_budget,
            },
        };
        // The first forward op that saves each activation accounts for it.
        let mut saver: HashMap<TensorId, usize> = HashMap::new();
        for (n, &o) in ops.iter().enumerate() {
            let op = graph.op(o);
            if op.pass == Pass::Forward {
                for &t in &op.saves {
                    if matches!(
                        graph.tensor(t).kind,
                        TensorKind::Activation | TensorKind::Input
                    ) {
                        saver.entry(t).or_insert(n);
                    }
                }
            }
        }
        // Transformer Engine's FP8 copy of a product's input, and that input: the copy is held
        // as the input was made, a sequence shard under sequence parallelism (TE's `_Linear`
        // saves the quantized shard and gathers it for the weight gradient).
        let copy_of: HashMap<TensorId, TensorId> = ops
            .iter()
            .map(|&o| graph.op(o))
            .filter(|op| op.pass == Pass::Forward)
            .filter_map(|op| graph.fp8_saved_operand(op).map(|x| (op, x)))
            .flat_map(|(op, x)| {
                op.saves
                    .iter()
                    .filter(|&&t| graph.tensor(t).dtype == DType::F8)
                    .map(move |&t| (t, x))
            })
            .collect();
        let mut produced: HashMap<TensorId, (usize, usize)> = HashMap::new();
        // Per forward op, the nodes of its input-gradient ops, in order (`sibling_read`).
        let mut input_grads: HashMap<OpId, Vec<usize>> = HashMap::new();
        let mut param_of: HashMap<TensorId, usize> = HashMap::new();
        let mut source_of: HashMap<TensorId, usize> = HashMap::new();
        for (n, &o) in ops.iter().enumerate() {
            let op = graph.op(o);
            let e = einsum(graph, op);
            // A follower takes the strategy of the op producing its first operand in the same
            // layer. Across a layer boundary it chooses its own, so that the only terms joining
            // two layers are the specs of the tensors crossing it, and a range's optimum is
            // what its layers' boundary tables compose to (`chain`).
            let leader = op
                .inputs
                .first()
                .and_then(|t| produced.get(t))
                .filter(|&&(p, _)| layer_of.get(&ops[p]) == layer_of.get(&o))
                // An operand that may arrive as a partial sum is reduced into the spec its
                // consumer chooses, so the consumer chooses.
                .filter(|&&(p, j)| {
                    !model.nodes[p]
                        .realized
                        .iter()
                        .any(|r| r.partial.get(j).is_some_and(|&m| m != 0))
                })
                .filter(|_| is_follower_kind(op.kind) && e.is_some());
            let (var, leader, realized) = match (leader, &e) {
                (Some(&(p, j)), Some(e)) => {
                    let var = model.nodes[p].var;
                    let realized: Vec<Realized> = model.nodes[p]
                        .realized
                        .iter()
                        .map(|r| model.realize(o, Some(e), &model.derive(o, e, &r.outputs[j])))
                        .collect();
                    (var, Some(p), realized)
                }
                _ => {
                    let assigns = match &e {
                        Some(e) => model.assignments(o, e),
                        None => vec![[None, None]],
                    };
                    let realized: Vec<Realized> = assigns
                        .iter()
                        .flat_map(|a| {
                            model.scattered(o, &saver, n, model.realize(o, e.as_ref(), a))
                        })
                        .collect();
                    let var = model.var_sizes.len();
                    model.var_sizes.push(realized.len());
                    model.cuts.push(drec::op_cuts(&realized));
                    // D-Rec cuts every operator on every level it can; an opaque op that is
                    // not batched has nothing to cut, by its nature rather than its shapes.
                    model
                        .forced
                        .push(!matches!(op.kind, OpKind::Opaque { batched: false }));
                    (var, None, realized)
                }
            };
            if let Some(fwd) = op.grad_of
                && !graph.makes_weight_gradient(o)
            {
                input_grads.entry(fwd).or_default().push(n);
            }
            model.nodes.push(OpNode {
                op: o,
                var,
                leader,
                realized,
            });
            // Wire the operands.
            for (i, &t) in op.inputs.iter().enumerate() {
                let tensor = graph.tensor(t);
                if tensor.kind == TensorKind::Parameter {
                    let p = *param_of.entry(t).or_insert_with(|| {
                        let var = model.var_sizes.len();
                        let choices = param_choices(&tensor.shape, &mesh);
                        model.var_sizes.push(choices.len());
                        model.cuts.push(drec::param_cuts(&choices));
                        model.forced.push(false);
                        model.params.push(ParamNode {
                            tensor: t,
                            var,
                            choices,
                        });
                        model.params.len() - 1
                    });
                    model.uses.push(WeightUse {
                        param: p,
                        to: n,
                        input: i,
                    });
                } else {
                    let from = match model.sibling_read(o, t, &input_grads) {
                        Some(copy) => copy,
                        None => model.origin(t, &produced, &mut source_of),
                    };
                    model.flows.push(Flow {
                        tensor: t,
                        from,
                        to: n,
                        input: i,
                        // An opaque op's backward needs its operands before it starts.
                        overlapped: tensor.kind == TensorKind::Activation
                            && op.grad_of.is_some()
                            && graph.makes_weight_gradient(o)
                            && !matches!(op.kind, OpKind::Opaque { .. }),
                    });
                }
            }
            for (j, &t) in op
                .outputs
                .iter()
                .chain(&implicit_saves(graph, o))
                .enumerate()
            {
                produced.entry(t).or_insert((n, j));
            }
            // Weight gradients go to their parameter's optimizer states.
            if let Some(fwd) = op.grad_of {
                let params = graph
                    .op(fwd)
                    .inputs
                    .iter()
                    .filter(|&&t| graph.tensor(t).kind == TensorKind::Parameter);
                let grads = op
                    .outputs
                    .iter()
                    .enumerate()
                    .filter(|&(_, &t)| graph.tensor(t).kind == TensorKind::WeightGradient);
                for (&w, (j, _)) in params.zip(grads) {
                    if let Some(&p) = param_of.get(&w) {
                        model.syncs.push(GradSync {
                            from: n,
                            output: j,
                            param: p,
                        });
                    }
                }
            }
        }
        // Each saved activation, where it is held: as it was made, unless an opaque op made it
        // (whole but for the batch) or made it whole under every strategy, or the saver is
        // opaque (it runs whole on gathered operands), and then as the saver read it.
        for (n, &o) in ops.iter().enumerate() {
            let op = graph.op(o);
            for &t in op.saves.iter().filter(|t| saver.get(t) == Some(&n)) {
                let read = op.inputs.iter().position(|&u| u == t);
                let held = copy_of.get(&t).copied().unwrap_or(t);
                let made = model.origin(held, &produced, &mut source_of);
                let whole = match made {
                    Producer::Op(p, j) => {
                        matches!(graph.op(ops[p]).kind, OpKind::Opaque { .. })
                            || model.nodes[p]
                                .realized
                                .iter()
                                .all(|r| r.outputs[j].tiles(&mesh) == 1)
                    }
                    _ => false,
                };
                let opaque = matches!(op.kind, OpKind::Opaque { .. });
                let at = match (read, produced.get(&t)) {
                    (Some(i), _) if whole || opaque => Producer::Read(n, i),
                    // An FP8 copy the saver made, shaped like the operand it read.
                    (None, Some(&(p, j))) if whole => Producer::Op(p, j),
                    _ => made,
                };
                model.saved.push(Saved { tensor: t, at });
            }
        }
        model.produced = produced;
        model.problem = model.assemble();
        Ok(model)
    }

    /// The problem, for the solvers.
    pub fn problem(&self) -> &Problem {
        &self.problem
    }

    /// Per variable and choice: the activations saved for the backward pass per micro-batch
    /// in flight, bytes (part of the variable's memory).
    pub fn activation_memory(&self) -> Vec<Vec<f64>> {
        let inflight = self.opts.inflight.max(1) as f64;
        let mut out: Vec<Vec<f64>> = self.var_sizes.iter().map(|&k| vec![0.0; k]).collect();
        for s in &self.saved {
            let v = self.producer_var(s.at);
            for (c, m) in out[v].iter_mut().enumerate() {
                *m += self.saved_bytes(s, c) / inflight;
            }
        }
        out
    }

    /// Per variable and choice: the largest backward transient among its ops, bytes (see
    /// [`StageMemory::working`]; a plan's is the largest over its variables).
    pub fn working_memory(&self) -> Vec<Vec<f64>> {
        let mut out: Vec<Vec<f64>> = self.var_sizes.iter().map(|&k| vec![0.0; k]).collect();
        for node in &self.nodes {
            for (c, r) in node.realized.iter().enumerate() {
                let w = &mut out[node.var][c];
                *w = w.max(r.working);
            }
        }
        out
    }

    /// Whether an op of the range makes tensor `t`.
    pub fn makes(&self, t: TensorId) -> bool {
        self.produced.contains_key(&t)
    }

    /// The variable that decides the spec of tensor `t` as it crosses the range's edge, and
    /// that spec under each of the variable's choices: its producer's strategy when the range
    /// makes `t`, else the variable of `t` entering the range. `None` when no op of the range
    /// reads or makes `t`.
    pub fn spec_variable(&self, t: TensorId) -> Option<(usize, Vec<Spec>)> {
        if let Some(&(n, j)) = self.produced.get(&t) {
            let node = &self.nodes[n];
            return Some((
                node.var,
                node.realized.iter().map(|r| r.outputs[j].clone()).collect(),
            ));
        }
        self.sources
            .iter()
            .find(|s| s.tensor == t)
            .map(|s| (s.var, s.specs.clone()))
    }

    /// Every valid assignment of mesh axes to the non-fixed dimensions of `e`.
    fn assignments(&self, o: OpId, e: &Einsum) -> Vec<Assign> {
        let mut per_axis: [Vec<Option<usize>>; 2] = [vec![None], vec![None]];
        for (a, choices) in per_axis.iter_mut().enumerate() {
            if self.mesh.shape[a] > 1 {
                choices.extend(
                    e.dims
                        .iter()
                        .enumerate()
                        .filter(|(_, k)| **k != DimKind::Fixed)
                        .map(|(d, _)| Some(d)),
                );
            }
        }
        let mut out = Vec::new();
        for &d0 in &per_axis[0] {
            for &d1 in &per_axis[1] {
                let a = [d0, d1];
                if self.valid(o, e, &a) {
                    out.push(a);
                }
            }
        }
        out
    }

    /// Whether every tensor of op `o` divides evenly under `assign`.
    fn valid(&self, o: OpId, e: &Einsum, assign: &Assign) -> bool {
        let op = self.graph.op(o);
        let tensors = op.inputs.iter().zip(&e.inputs);
        let tensors = tensors.chain(op.outputs.iter().zip(&e.outputs));
        for (&t, axes) in tensors {
            let shape = &self.graph.tensor(t).shape;
            if !spec_of(axes, assign).valid_for(shape, &self.mesh) {
                return false;
            }
        }
        true
    }

    /// The assignment of a follower whose first operand arrives as `spec`: each mesh axis
    /// goes to the dimension the operand's split axis carries, as far as that divides.
    fn derive(&self, o: OpId, e: &Einsum, spec: &Spec) -> Assign {
        let mut a: Assign = [None, None];
        for (axis, slot) in a.iter_mut().enumerate() {
            if let Some(i) = spec.axis_on(axis) {
                *slot = e.inputs[0]
                    .get(i)
                    .copied()
                    .flatten()
                    .filter(|&d| e.dims[d] != DimKind::Fixed);
            }
        }
        // Drop splits that do not divide (the operand is then resharded on the way in).
        [a, [a[0], None], [None, a[1]], [None, None]]
            .into_iter()
            .find(|c| self.valid(o, e, c))
            .unwrap_or([None, None])
    }

    /// Prices op `o` under `assign`: specs, kernel time on its tile, the collectives it
    /// implies, and the gradients and transients it holds (saved activations are
    /// [`Saved`]).
    fn realize(&self, o: OpId, e: Option<&Einsum>, assign: &Assign) -> Realized {
        let g = self.graph;
        let op = g.op(o);
        let mesh = &self.mesh;
        let (inputs, outputs): (Vec<Spec>, Vec<Spec>) = match e {
            Some(e) => (
                e.inputs.iter().map(|ax| spec_of(ax, assign)).collect(),
                e.outputs.iter().map(|ax| spec_of(ax, assign)).collect(),
            ),
            None => (
                op.inputs
                    .iter()
                    .map(|&t| Spec::replicated(g.tensor(t).shape.len()))
                    .collect(),
                op.outputs
                    .iter()
                    .map(|&t| Spec::replicated(g.tensor(t).shape.len()))
                    .collect(),
            ),
        };
        // Results summed over a split dimension are partial sums.
        let partial: Vec<u8> = match e {
            Some(e) => (0..op.outputs.len())
                .map(|r| {
                    let mut mask = 0u8;
                    for (a, d) in assign.iter().enumerate() {
                        if let Some(d) = *d
                            && e.summed[r].contains(&d)
                        {
                            mask |= 1 << a;
                        }
                    }
                    mask
                })
                .collect(),
            None => vec![0; op.outputs.len()],
        };
        // Implicit saved tensors (masks, statistics) follow the operand they are shaped like.
        let mut outputs = outputs;
        for t in implicit_saves(g, o) {
            let shape = &g.tensor(t).shape;
            let like = op
                .inputs
                .iter()
                .zip(&inputs)
                .chain(op.outputs.iter().zip(outputs.iter()))
                .find(|(u, _)| g.tensor(**u).shape.starts_with(shape))
                .map(|(_, s)| Spec(s.0[..shape.len()].to_vec()));
            outputs.push(like.unwrap_or_else(|| Spec::replicated(shape.len())));
        }
        let spec_of_tensor = |t: TensorId| -> &Spec {
            op.inputs
                .iter()
                .position(|&u| u == t)
                .map(|i| &inputs[i])
                .or_else(|| {
                    op.outputs
                        .iter()
                        .chain(&implicit_saves(g, o))
                        .position(|&u| u == t)
                        .map(|j| &outputs[j])
                })
                .unwrap_or(&inputs[0])
        };
        let tile_bytes = |t: TensorId| -> f64 {
            g.tensor(t).bytes() as f64 / spec_of_tensor(t).tiles(mesh) as f64
        };
        let parts: u64 = assign
            .iter()
            .enumerate()
            .filter(|(_, d)| d.is_some())
            .map(|(a, _)| mesh.shape[a])
            .product();
        let gemm = op.kind.is_matmul().then(|| {
            let y = op.outputs[0];
            let local = outputs[0].tile_shape(&g.tensor(y).shape, mesh);
            let r = local.len();
            let (batch, m) = match op.kind {
                OpKind::BatchMatMul { .. } if r >= 2 => (
                    local[..r - 2].iter().product::<u64>() as f64,
                    local[r - 2] as f64,
                ),
                _ => (
                    1.0,
                    local[..r.saturating_sub(1)].iter().product::<u64>() as f64,
                ),
            };
            GemmShape {
                batch,
                m,
                n: local.last().copied().unwrap_or(1) as f64,
            }
        });
        // Weight gradients accumulate into the gradient buffer over the micro-batches.
        let (mut traffic, mut accumulate) = (op_traffic(op, tile_bytes), 0.0);
        for (&t, spec) in op.outputs.iter().zip(&outputs) {
            let tensor = g.tensor(t);
            if tensor.kind == TensorKind::WeightGradient {
                let (extra, separate) = gradient_accumulation(
                    tensor.elements() as f64 / spec.tiles(mesh) as f64,
                    tensor.dtype.bytes() as f64,
                    self.opts.state_bytes().grads,
                    self.opts.grad_accumulation_fusion && op.kind.is_matmul(),
                    &self.device,
                    self.opts.precision.dtype(),
                );
                traffic += extra;
                accumulate += separate;
            }
        }
        let measured = self.opts.profile.and_then(|prof| {
            let tiles = |ts: &[TensorId], specs: &[Spec]| -> Vec<Vec<u64>> {
                ts.iter()
                    .zip(specs)
                    .map(|(&t, spec)| spec.tile_shape(&g.tensor(t).shape, mesh))
                    .collect()
            };
            let sig = OpSignature {
                op: kernel_name(op.kind),
                pass: op.pass,
                dtype: kernel_dtype(op, self.opts.precision.dtype()),
                inputs: tiles(&op.inputs, &inputs),
                outputs: tiles(&op.outputs, &outputs),
            };
            prof.op_time(&sig).map(|(seconds, _)| seconds)
        });
        let kernel = measured.unwrap_or_else(|| {
            op_kernel_time(
                op,
                op.flops / parts as f64,
                traffic,
                &self.device,
                self.opts.precision.dtype(),
                gemm,
            )
        });
        // An FP8 product's cast of its operand is priced with the flow that brings it
        // ([`StageModel::fp8_cast`]).
        let compute = kernel + accumulate;
        let mut comm = Vec::new();
        let mut partial = partial;
        for (j, &t) in op.outputs.iter().enumerate() {
            if partial[j] != 0
                && g.tensor(t).kind != TensorKind::WeightGradient
                && !self.deferred.contains(&t)
            {
                let tile = tile_bytes(t);
                for a in 0..2 {
                    if partial[j] & (1 << a) != 0 {
                        comm.push((
                            self.step(Collective::AllReduce, a, tile),
                            Reason::PartialSum,
                            t,
                        ));
                    }
                }
                partial[j] = 0;
            }
        }
        if let Some(e) = e {
            for (d, kind) in e.dims.iter().enumerate() {
                let DimKind::Stats { reductions, bytes } = *kind else {
                    continue;
                };
                let Some(axis) = e.inputs[0].iter().position(|&x| x == Some(d)) else {
                    continue;
                };
                let x = op.inputs[0];
                let local = inputs[0].tile_shape(&g.tensor(x).shape, mesh);
                let rows = local.iter().product::<u64>() as f64 / local[axis].max(1) as f64;
                for (a, on) in assign.iter().enumerate() {
                    if *on == Some(d) {
                        for _ in 0..reductions {
                            comm.push((
                                self.step(Collective::AllReduce, a, rows * bytes),
                                Reason::Statistics,
                                x,
                            ));
                        }
                    }
                }
            }
        }
        let grad_bytes = self.opts.state_bytes().grads;
        let gradients: f64 = op
            .outputs
            .iter()
            .zip(&outputs)
            .filter(|(t, _)| g.tensor(**t).kind == TensorKind::WeightGradient)
            .map(|(&t, s)| g.tensor(t).elements() as f64 * grad_bytes / s.tiles(mesh) as f64)
            .sum();
        let mut working = op
            .outputs
            .iter()
            .filter(|&&t| g.tensor(t).kind == TensorKind::Gradient)
            .map(|&t| tile_bytes(t))
            .fold(0.0, f64::max);
        if self.opts.fp32_loss && op.kind == OpKind::CrossEntropy {
            let probs: f64 = op.saves.iter().map(|&t| tile_bytes(t)).sum();
            working = working.max(fp32_loss_working(probs));
        }
        Realized {
            assign: *assign,
            inputs,
            outputs,
            partial,
            compute,
            comm,
            gradients,
            working,
        }
    }

    /// `r`, and each way of reducing one of its all-reduced partial sums with a
    /// reduce-scatter instead, leaving the result split over that mesh axis along one of its
    /// dimensions (as Megatron-LM's sequence parallelism does with the vocabulary-parallel
    /// embedding's output). Results the op saves stay as they are.
    fn scattered(
        &self,
        o: OpId,
        saver: &HashMap<TensorId, usize>,
        n: usize,
        r: Realized,
    ) -> Vec<Realized> {
        let g = self.graph;
        let op = g.op(o);
        let mut out = Vec::new();
        for (k, (step, reason, t)) in r.comm.iter().enumerate() {
            if *reason != Reason::PartialSum || saver.get(t) == Some(&n) {
                continue;
            }
            let Some(j) = op.outputs.iter().position(|u| u == t) else {
                continue;
            };
            let shape = &g.tensor(*t).shape;
            for i in 0..shape.len() {
                let mut spec = r.outputs[j].clone();
                spec.0[i] = AxisSplit::from_axes(spec.0[i].axes() | (1 << step.axis));
                if !spec.valid_for(shape, &self.mesh) {
                    continue;
                }
                let mut v = r.clone();
                v.outputs[j] = spec;
                v.comm[k] = (
                    self.step(Collective::ReduceScatter, step.axis, step.bytes),
                    Reason::PartialSum,
                    *t,
                );
                out.push(v);
            }
        }
        out.insert(0, r);
        out
    }

    /// The forward pass's time per micro-batch as a problem over the same variables: the
    /// forward ops' compute and collectives and the resharding and weight gathers feeding
    /// them (what recomputing the range costs again in its backward pass). Its `evaluate`
    /// gives a plan's forward time, as [`StageModel::decode`] counts it.
    pub fn forward_problem(&self) -> Problem {
        self.assemble_terms(Terms::Forward)
    }

    /// The per-step terms over the same variables, s per step (not divided by the
    /// micro-batches; no memory): all of them (gradient synchronisation, optimizer,
    /// updated-weight gathers: a decoded plan's `step`), then only the collectives among them.
    pub fn step_problems(&self) -> [Problem; 2] {
        [
            self.assemble_terms(Terms::Step),
            self.assemble_terms(Terms::StepCollectives),
        ]
    }

    /// Sums every term into variable costs and edge tables.
    fn assemble(&self) -> Problem {
        self.assemble_terms(Terms::All)
    }

    /// Sums the `terms` into variable costs and edge tables.
    fn assemble_terms(&self, terms: Terms) -> Problem {
        let g = self.graph;
        let (per_microbatch, per_step, memory) = match terms {
            Terms::All => (true, true, true),
            Terms::Forward => (true, false, false),
            Terms::Step | Terms::StepCollectives => (false, true, false),
        };
        let counted = |n: usize| {
            per_microbatch && (terms == Terms::All || g.op(self.nodes[n].op).pass == Pass::Forward)
        };
        // Per-step terms are spread over the micro-batches in the objective.
        let b = match terms {
            Terms::All => self.opts.microbatches.max(1) as f64,
            _ => 1.0,
        };
        let mut vars: Vec<Var> = self
            .var_sizes
            .iter()
            .map(|&k| Var {
                cost: vec![0.0; k],
                memory: vec![0.0; k],
            })
            .collect();
        let mut edges: Vec<Edge> = Vec::new();
        for (n, node) in self.nodes.iter().enumerate() {
            if !counted(n) {
                continue;
            }
            for (c, r) in node.realized.iter().enumerate() {
                vars[node.var].cost[c] +=
                    r.compute + r.comm.iter().map(|(s, _, _)| s.seconds).sum::<f64>();
                if memory {
                    vars[node.var].memory[c] += r.gradients;
                }
            }
        }
        for s in self.saved.iter().filter(|_| memory) {
            let v = self.producer_var(s.at);
            for c in 0..self.var_sizes[v] {
                vars[v].memory[c] += self.saved_bytes(s, c);
            }
        }
        for p in self.params.iter().filter(|_| per_step) {
            for c in 0..p.choices.len() {
                if terms == Terms::StepCollectives {
                    // The updated-weight gathers only.
                    vars[p.var].cost[c] += self.param_times(p, c).1;
                    continue;
                }
                let (time, m) = self.param_cost(p, c);
                vars[p.var].cost[c] += time / b;
                if memory {
                    vars[p.var].memory[c] += m.weights + m.optimizer;
                }
            }
        }
        // Pairwise terms, each a table over the two variables' choices (or a diagonal when
        // both sides share a variable).
        let mut pairwise = |u: usize, v: usize, f: &dyn Fn(usize, usize) -> f64| {
            if u == v {
                for c in 0..self.var_sizes[u] {
                    vars[u].cost[c] += f(c, c);
                }
            } else {
                let (ku, kv) = (self.var_sizes[u], self.var_sizes[v]);
                let mut cost = vec![0.0; ku * kv];
                for cu in 0..ku {
                    for cv in 0..kv {
                        cost[cu * kv + cv] = f(cu, cv);
                    }
                }
                edges.push(Edge {
                    u,
                    v,
                    cost: cost.into(),
                });
            }
        };
        for f in self.flows.iter().filter(|f| counted(f.to)) {
            let v = self.nodes[f.to].var;
            let u = self.producer_var(f.from);
            pairwise(u, v, &|cu, cv| {
                self.flow_time(f, &self.flow_steps(f, cu, cv), cu, cv) + self.fp8_cast(f, cu, cv)
            });
        }
        for w in self.uses.iter().filter(|w| counted(w.to)) {
            let (u, v) = (self.params[w.param].var, self.nodes[w.to].var);
            pairwise(u, v, &|cu, cv| steps_time(&self.use_steps(w, cu, cv)));
        }
        for s in self.syncs.iter().filter(|_| per_step) {
            let (u, v) = (self.nodes[s.from].var, self.params[s.param].var);
            pairwise(u, v, &|cu, cv| steps_time(&self.sync_steps(s, cu, cv)) / b);
        }
        Problem {
            vars,
            edges,
            memory_budget: self.opts.memory_budget,
        }
        .merged_edges()
    }

    /// Whether the options' solver takes D-Rec for this range without trying an exact one:
    /// asked for, or `Auto` on a problem above [`AUTO_DREC_VARIABLES`] variables.
    pub fn drec_first(&self) -> bool {
        match self.opts.solver {
            SolverChoice::Drec => true,
            SolverChoice::Auto => self.var_sizes.len() > AUTO_DREC_VARIABLES,
            SolverChoice::Exact | SolverChoice::Ilp => false,
        }
    }

    /// Solves the problem with the configured solver and reads the plan back.
    pub fn solve(&self) -> Result<StagePlan, IntraError> {
        let all: Vec<Vec<usize>> = self.var_sizes.iter().map(|&k| (0..k).collect()).collect();
        self.solve_within(&all)
    }

    /// [`StageModel::solve`] with variable `v` limited to the strategies `allowed[v]` (e.g. a
    /// layer's boundary specs pinned to those of a chain's optimum).
    pub fn solve_within(&self, allowed: &[Vec<usize>]) -> Result<StagePlan, IntraError> {
        let start = Instant::now();
        if self.drec_first() {
            return self.solve_drec(allowed, start);
        }
        let pinned = self.problem.restricted(allowed);
        // Dominated strategies never need to be considered; transformer layers have many
        // (e.g. splits whose collectives cost more on the slower axis).
        let (reduced, keep) = pinned.without_dominated();
        let p = &reduced;
        let width = exact::width(p);
        let ilp = || -> Result<(Assignment, &'static str, bool, f64), IntraError> {
            match ilp::solve(p, self.opts.time_limit) {
                Ok(sol) => {
                    let cost = sol.assignment.cost;
                    let gap = if cost > 0.0 {
                        ((cost - sol.bound) / cost).max(0.0)
                    } else {
                        0.0
                    };
                    let optimal = sol.status == ilp::IlpStatus::Optimal;
                    Ok((
                        sol.assignment,
                        "ilp",
                        optimal,
                        if optimal { 0.0 } else { gap },
                    ))
                }
                Err(ilp::IlpError::Infeasible) => Err(self.no_fit()),
                Err(e) => Err(e.into()),
            }
        };
        let (assignment, solver, optimal, gap) = match self.opts.solver {
            SolverChoice::Ilp => ilp()?,
            choice => match exact::solve_checked(p, self.opts.max_exact_entries) {
                Ok(Some(a)) => (a, "exact", true, 0.0),
                Ok(None) => return Err(self.no_fit()),
                Err(_) if choice == SolverChoice::Auto => ilp()?,
                Err(declined) => return Err(IntraError::TooWide(format!("{declined:?}"))),
            },
        };
        let info = SolveInfo {
            solver: solver.to_string(),
            optimal,
            gap,
            seconds: start.elapsed().as_secs_f64(),
            cost: assignment.cost,
            variables: p.vars.len(),
            strategies: self.problem.vars.iter().map(|v| v.cost.len()).sum(),
            undominated: p.vars.iter().map(|v| v.cost.len()).sum(),
            edges: p.edges.len(),
            width,
            warnings: Vec::new(),
        };
        let choice: Vec<usize> = (assignment.choice.iter().zip(&keep).zip(allowed))
            .map(|((&c, kept), within)| within[kept[c]])
            .collect();
        Ok(self.decode(&choice, info))
    }

    fn no_fit(&self) -> IntraError {
        let least = self.problem.leanest().memory;
        IntraError::NoFit {
            budget_gib: self.opts.memory_budget.unwrap_or(f64::INFINITY) / GIB,
            least_gib: least / GIB,
        }
    }

    /// The plan of the solution `choice` (one strategy per variable).
    pub fn decode(&self, choice: &[usize], solve: SolveInfo) -> StagePlan {
        let g = self.graph;
        let b = self.opts.microbatches.max(1) as f64;
        let mut plan = StagePlan {
            mesh: self.mesh.shape,
            layers: [self.layers.start, self.layers.end],
            microbatches: self.opts.microbatches.max(1),
            objective: 0.0,
            forward: 0.0,
            backward: 0.0,
            step: 0.0,
            per_microbatch: StageTimes::default(),
            memory: StageMemory::default(),
            ops: Vec::new(),
            parameters: Vec::new(),
            collectives: Vec::new(),
            solve,
        };
        let phase_of = |n: usize| match g.op(self.nodes[n].op).pass {
            Pass::Forward => Phase::Forward,
            Pass::Backward => Phase::Backward,
        };
        let add = |plan: &mut StagePlan, phase: Phase, seconds: f64| match phase {
            Phase::Forward => plan.forward += seconds,
            Phase::Backward => plan.backward += seconds,
            Phase::Step => plan.step += seconds,
        };
        let record = |plan: &mut StagePlan, steps: &[Step], t: TensorId, reason, phase| {
            for s in steps {
                plan.collectives.push(CollectiveUse {
                    kind: s.kind,
                    axis: s.axis,
                    bytes: s.bytes,
                    seconds: s.seconds,
                    tensor: g.tensor(t).name.clone(),
                    reason,
                    phase,
                });
            }
        };
        for (n, node) in self.nodes.iter().enumerate() {
            let op = g.op(node.op);
            let r = &node.realized[choice[node.var]];
            let phase = phase_of(n);
            let comm: f64 = r.comm.iter().map(|(s, _, _)| s.seconds).sum();
            add(&mut plan, phase, r.compute + comm);
            plan.per_microbatch.compute += r.compute;
            plan.per_microbatch.communication += comm;
            plan.memory.gradients += r.gradients;
            plan.memory.working = plan.memory.working.max(r.working);
            for (s, reason, t) in &r.comm {
                record(&mut plan, std::slice::from_ref(s), *t, *reason, phase);
            }
            plan.ops.push(OpSharding {
                name: op.name.clone(),
                kind: op.kind.name().to_string(),
                pass: op.pass,
                inputs: r.inputs.iter().map(|s| s.to_string()).collect(),
                outputs: r.outputs[..op.outputs.len()]
                    .iter()
                    .map(|s| s.to_string())
                    .collect(),
                compute_seconds: r.compute,
                follows: node.leader.map(|l| g.op(self.nodes[l].op).name.clone()),
            });
        }
        for f in &self.flows {
            let (cu, cv) = (
                choice[self.producer_var(f.from)],
                choice[self.nodes[f.to].var],
            );
            let steps = self.flow_steps(f, cu, cv);
            let phase = phase_of(f.to);
            let cast = self.fp8_cast(f, cu, cv);
            add(&mut plan, phase, cast);
            plan.per_microbatch.compute += cast;
            let t = self.flow_time(f, &steps, cu, cv);
            add(&mut plan, phase, t);
            if self.pending_sum(f, cu) != 0 {
                plan.per_microbatch.communication += t;
                record(&mut plan, &steps, f.tensor, Reason::PartialSum, phase);
            } else {
                plan.per_microbatch.resharding += t;
                record(&mut plan, &steps, f.tensor, Reason::Reshard, phase);
            }
        }
        for s in &self.saved {
            plan.memory.activations += self.saved_bytes(s, choice[self.producer_var(s.at)]);
        }
        for w in &self.uses {
            let p = &self.params[w.param];
            let steps = self.use_steps(w, choice[p.var], choice[self.nodes[w.to].var]);
            let phase = phase_of(w.to);
            let t = steps_time(&steps);
            add(&mut plan, phase, t);
            plan.per_microbatch.resharding += t;
            record(&mut plan, &steps, p.tensor, Reason::WeightGather, phase);
        }
        for s in &self.syncs {
            let p = &self.params[s.param];
            let steps = self.sync_steps(s, choice[self.nodes[s.from].var], choice[p.var]);
            add(&mut plan, Phase::Step, steps_time(&steps));
            record(
                &mut plan,
                &steps,
                p.tensor,
                Reason::GradientSync,
                Phase::Step,
            );
        }
        let wb = self.opts.state_bytes().weights;
        for p in &self.params {
            let c = choice[p.var];
            let (time, memory) = self.param_cost(p, c);
            add(&mut plan, Phase::Step, time);
            plan.memory.weights += memory.weights;
            plan.memory.optimizer += memory.optimizer;
            let (w, o) = &p.choices[c];
            let tensor = g.tensor(p.tensor);
            let steps = self.measured(reshard_steps(
                tensor.elements() as f64 * wb,
                o,
                w,
                &self.mesh,
            ));
            record(
                &mut plan,
                &steps,
                p.tensor,
                Reason::UpdatedWeights,
                Phase::Step,
            );
            plan.parameters.push(ParamSharding {
                name: tensor.name.clone(),
                shape: tensor.shape.clone(),
                weight: w.to_string(),
                states: o.to_string(),
            });
        }
        let m = &mut plan.memory;
        m.total = m.activations + m.weights + m.gradients + m.optimizer;
        m.budget = self.opts.memory_budget;
        plan.objective = plan.forward + plan.backward + plan.step / b;
        plan
    }

    fn producer_var(&self, p: Producer) -> usize {
        match p {
            Producer::Op(n, _) | Producer::Read(n, _) => self.nodes[n].var,
            Producer::Source(s) => self.sources[s].var,
        }
    }

    fn producer_spec(&self, p: Producer, c: usize) -> &Spec {
        match p {
            Producer::Op(n, j) => &self.nodes[n].realized[c].outputs[j],
            Producer::Source(s) => &self.sources[s].specs[c],
            Producer::Read(n, i) => &self.nodes[n].realized[c].inputs[i],
        }
    }

    /// Where tensor `t` comes from: the op of the range that made it (`produced`), else the
    /// variable of `t` entering the range (`source_of`), made on first need.
    fn origin(
        &mut self,
        t: TensorId,
        produced: &HashMap<TensorId, (usize, usize)>,
        source_of: &mut HashMap<TensorId, usize>,
    ) -> Producer {
        if let Some(&(p, j)) = produced.get(&t) {
            return Producer::Op(p, j);
        }
        Producer::Source(*source_of.entry(t).or_insert_with(|| {
            let specs = valid_specs(&self.graph.tensor(t).shape, &self.mesh);
            let var = self.var_sizes.len();
            self.var_sizes.push(specs.len());
            self.cuts.push(drec::source_cuts(&specs));
            self.forced.push(false);
            self.sources.push(SourceNode {
                tensor: t,
                var,
                specs,
            });
            self.sources.len() - 1
        }))
    }

    /// Bytes per device that saved activation `s` holds for the micro-batches in flight when
    /// its holder's variable takes choice `c`.
    fn saved_bytes(&self, s: &Saved, c: usize) -> f64 {
        let tiles = self.producer_spec(s.at, c).tiles(&self.mesh) as f64;
        self.graph.tensor(s.tensor).bytes() as f64 / tiles * self.opts.inflight.max(1) as f64
    }

    /// Op `o` reads `t`: when `o` is a weight-gradient product and the input-gradient
    /// product of the same forward op (the last of `input_grads`, the nodes of each forward
    /// op's input-gradient ops so far) read `t` before it, that copy.
    fn sibling_read(
        &self,
        o: OpId,
        t: TensorId,
        input_grads: &HashMap<OpId, Vec<usize>>,
    ) -> Option<Producer> {
        let g = self.graph;
        let fwd = g.op(o).grad_of?;
        if !g.makes_weight_gradient(o) {
            return None;
        }
        input_grads.get(&fwd)?.iter().rev().find_map(|&m| {
            let i = g.op(self.nodes[m].op).inputs.iter().position(|&u| u == t)?;
            Some(Producer::Read(m, i))
        })
    }

    /// The mesh axes a flow's tensor is still a partial sum over when its producer takes
    /// choice `cu` (reduced on the way into the consumer).
    fn pending_sum(&self, f: &Flow, cu: usize) -> u8 {
        match f.from {
            Producer::Op(n, j) => self.nodes[n].realized[cu]
                .partial
                .get(j)
                .copied()
                .unwrap_or(0),
            Producer::Source(_) | Producer::Read(..) => 0,
        }
    }

    /// The collectives that bring a flow's tensor from its producer into its consumer's spec.
    fn flow_steps(&self, f: &Flow, cu: usize, cv: usize) -> Vec<Step> {
        let g = self.graph;
        let tensor = g.tensor(f.tensor);
        // A weight-gradient product reads its input back from the forward's FP8 copy; an FP8
        // product's operand is cast where it was made and moved in FP8.
        let to = g.op(self.nodes[f.to].op);
        let copy = to.pass == Pass::Backward && g.fp8_saved_operand(to) == Some(f.tensor);
        let bytes = if copy || self.fp8_cast_at_producer(f, cu) {
            tensor.fp8_copy_bytes() as f64
        } else {
            tensor.bytes() as f64
        };
        let from = self.producer_spec(f.from, cu);
        let to = &self.nodes[f.to].realized[cv].inputs[f.input];
        self.measured(match self.pending_sum(f, cu) {
            0 => reshard_steps(bytes, from, to, &self.mesh),
            partial => reduce_steps(bytes, partial, from, to, &self.mesh),
        })
    }

    /// Whether flow `f` carries the operand an FP8 product casts ([`Graph::fp8_cast_operand`])
    /// and that operand is whole when its producer takes choice `cu`: Transformer Engine casts
    /// the tensor as the rank holds it (the sequence shard under sequence parallelism) and
    /// gathers the FP8 copy (`_Linear` with `sequence_parallel`). A partial sum is reduced in
    /// the working precision first, and cast as the product reads it.
    fn fp8_cast_at_producer(&self, f: &Flow, cu: usize) -> bool {
        self.is_fp8_cast(f) && self.pending_sum(f, cu) == 0
    }

    fn is_fp8_cast(&self, f: &Flow) -> bool {
        let g = self.graph;
        f.input == 0 && g.fp8_cast_operand(g.op(self.nodes[f.to].op)) == Some(f.tensor)
    }

    /// The time of the FP8 cast flow `f` feeds (0 for any other flow): a memory-bound
    /// kernel over the operand where it is cast ([`StageModel::fp8_cast_at_producer`]).
    fn fp8_cast(&self, f: &Flow, cu: usize, cv: usize) -> f64 {
        if !self.is_fp8_cast(f) {
            return 0.0;
        }
        let spec = if self.fp8_cast_at_producer(f, cu) {
            self.producer_spec(f.from, cu)
        } else {
            &self.nodes[f.to].realized[cv].inputs[f.input]
        };
        let elements =
            self.graph.tensor(f.tensor).elements() as f64 / spec.tiles(&self.mesh) as f64;
        fp8_cast_time(elements, &self.device)
    }

    /// What a flow's collectives cost on the critical path: all of them, except that the
    /// gather of a saved activation into a weight-gradient product is issued ahead and runs
    /// while the input-gradient product of the same op computes (Megatron-LM does so under
    /// sequence parallelism, Korthikanti et al. 2022 §4.2.2); that product costs what the
    /// weight-gradient product does (the same FLOPs), so only the excess is exposed.
    /// With userbuffers, a collective they overlap exposes only what its product leaves.
    fn flow_time(&self, f: &Flow, steps: &[Step], cu: usize, cv: usize) -> f64 {
        let t = steps_time(steps);
        if f.overlapped {
            return (t - self.nodes[f.to].realized[cv].compute).max(0.0);
        }
        self.userbuffers_exposed(f, steps, t, cu, cv).unwrap_or(t)
    }

    /// What flow `f`'s one collective, of `t` seconds, leaves exposed when Transformer Engine's
    /// userbuffers overlap it with a product (tensor-parallel communication overlap on;
    /// [`crate::cost::tp_comm_overlap`]), or `None` where they do not: an all-gather into a product runs as a ring
    /// exchange beside that product (a column-parallel product's input, a row-parallel
    /// one's output gradient into its input-gradient product); a partial sum's
    /// reduce-scatter out of a product runs beside it, chunk by chunk in the forward, and in
    /// the backward in bulk beside the weight-gradient product, whose FLOPs the
    /// input-gradient product that made the sum stands for (as the layer costs price both).
    fn userbuffers_exposed(
        &self,
        f: &Flow,
        steps: &[Step],
        t: f64,
        cu: usize,
        cv: usize,
    ) -> Option<f64> {
        if !self.opts.tp_comm_overlap {
            return None;
        }
        let [step] = steps else { return None };
        let g = self.graph;
        let pending = self.pending_sum(f, cu) != 0;
        let (ub, product) = match (step.kind, f.from) {
            (Collective::AllGather, _) if !pending => {
                let to = &self.nodes[f.to];
                g.op(to.op)
                    .kind
                    .is_matmul()
                    .then(|| (Userbuffers::RingExchange, to.realized[cv].compute))
            }
            (Collective::ReduceScatter, Producer::Op(n, _)) if pending => {
                let from = &self.nodes[n];
                let op = g.op(from.op);
                let ub = match op.pass {
                    Pass::Forward => Userbuffers::RingExchange,
                    Pass::Backward => Userbuffers::Bulk,
                };
                op.kind.is_matmul().then(|| (ub, from.realized[cu].compute))
            }
            _ => None,
        }?;
        Some(ub.exposed(t, product, self.mesh.shape[step.axis]))
    }

    fn use_steps(&self, w: &WeightUse, cu: usize, cv: usize) -> Vec<Step> {
        let p = &self.params[w.param];
        let bytes = self.graph.tensor(p.tensor).bytes() as f64;
        let to = &self.nodes[w.to].realized[cv].inputs[w.input];
        self.measured(reshard_steps(bytes, &p.choices[cu].0, to, &self.mesh))
    }

    fn sync_steps(&self, s: &GradSync, cu: usize, cv: usize) -> Vec<Step> {
        let p = &self.params[s.param];
        let tensor = self.graph.tensor(p.tensor);
        let bytes = tensor.elements() as f64 * self.opts.state_bytes().grads;
        let r = &self.nodes[s.from].realized[cu];
        self.measured(reduce_steps(
            bytes,
            r.partial[s.output],
            &r.outputs[s.output],
            &p.choices[cv].1,
            &self.mesh,
        ))
    }

    /// Collective `kind` of `bytes` over mesh axis `axis`, timed as [`Self::measure`] says.
    fn step(&self, kind: Collective, axis: usize, bytes: f64) -> Step {
        let mut s = Step::on(kind, axis, bytes, &self.mesh);
        self.measure(&mut s);
        s
    }

    /// `steps`, each timed as [`Self::measure`] says.
    fn measured(&self, mut steps: Vec<Step>) -> Vec<Step> {
        steps.iter_mut().for_each(|s| self.measure(s));
        steps
    }

    /// The time the profile measured for the step's collective, group size and link
    /// (interpolated in the payload, as the layer costs read it), when it has one.
    fn measure(&self, s: &mut Step) {
        let Some(profile) = self.opts.profile else {
            return;
        };
        let sig = CollectiveSignature {
            collective: s.kind.into(),
            ranks: self.mesh.shape[s.axis],
            internode: self.mesh.links[s.axis].internode(),
        };
        if let Some((seconds, _)) = profile.collective_time(&sig, s.bytes) {
            s.seconds = seconds;
        }
    }

    /// Per-step time (optimizer update of the shard, gather of updated weights) and memory
    /// of parameter choice `c`.
    fn param_cost(&self, p: &ParamNode, c: usize) -> (f64, StageMemory) {
        let (w, o) = &p.choices[c];
        let tensor = self.graph.tensor(p.tensor);
        let elements = tensor.elements() as f64;
        let StateBytes {
            weights: wb,
            optimizer: ob,
            ..
        } = self.opts.state_bytes();
        let so = o.tiles(&self.mesh) as f64;
        let sw = w.tiles(&self.mesh) as f64;
        let (update, gather) = self.param_times(p, c);
        let copies = if self.fp8_weights.contains(&p.tensor) {
            FP8_WEIGHT_COPY_BYTES
        } else {
            0.0
        };
        (
            update + gather,
            StageMemory {
                weights: elements * (wb + copies) / sw,
                optimizer: elements * ob / so,
                ..StageMemory::default()
            },
        )
    }

    /// Parameter `p`'s per-step times with strategy `c`: the optimizer's update of its
    /// shard, and gathering the updated weights into their working spec.
    fn param_times(&self, p: &ParamNode, c: usize) -> (f64, f64) {
        let (w, o) = &p.choices[c];
        let elements = self.graph.tensor(p.tensor).elements() as f64;
        let wb = self.opts.state_bytes().weights;
        let mut traffic =
            elements * self.opts.precision.optimizer_traffic() / o.tiles(&self.mesh) as f64;
        if self.fp8_weights.contains(&p.tensor) {
            // Every device casts the working weight it computes with, once per step.
            traffic += elements * FP8_CAST_BYTES_PER_ELEMENT / w.tiles(&self.mesh) as f64;
        }
        let update = traffic / (self.device.hbm_bandwidth * self.device.hbm_efficiency);
        let gather = steps_time(&self.measured(reshard_steps(elements * wb, o, w, &self.mesh)));
        (update, gather)
    }
}

/// Which terms [`StageModel::assemble_terms`] sums.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Terms {
    /// The objective: every term, per-step ones divided by the micro-batches, with memory.
    All,
    /// The forward pass's ops, their collectives, and the resharding and weight gathers
    /// feeding them.
    Forward,
    /// The per-step terms, per step.
    Step,
    /// Of those, the collectives.
    StepCollectives,
}

/// The activations and gradients made by `ops` whose partial sums can be reduced on the way
/// into their consumer: read by at most one op of the graph, in the producer's layer, and
/// saved by none (what is saved or read twice is reduced once, by its producer).
fn deferred_reductions(g: &Graph, ops: &[OpId]) -> HashSet<TensorId> {
    let made: HashMap<TensorId, OpId> = ops
        .iter()
        .flat_map(|&o| g.op(o).outputs.iter().map(move |&t| (t, o)))
        .filter(|(t, _)| {
            matches!(
                g.tensor(*t).kind,
                TensorKind::Activation | TensorKind::Gradient
            )
        })
        .collect();
    let mut readers: HashMap<TensorId, Vec<OpId>> = HashMap::new();
    let mut saved: HashSet<TensorId> = HashSet::new();
    for o in 0..g.ops.len() {
        let op = g.op(OpId(o as u32));
        for &t in &op.inputs {
            if made.contains_key(&t) {
                readers.entry(t).or_default().push(OpId(o as u32));
            }
        }
        saved.extend(op.saves.iter().copied());
        // The input of an FP8 product is held as its FP8 copy, at the input's spec.
        if op.pass == Pass::Forward {
            saved.extend(g.fp8_saved_operand(op));
        }
    }
    // What no op reads (the loss) is never reduced: the backward pass starts from each
    // rank's part of it.
    made.into_iter()
        .filter(|(t, producer)| {
            !saved.contains(t)
                && match readers.get(t).map(Vec::as_slice) {
                    None | Some([]) => true,
                    Some([reader]) => g.op(*reader).layer == g.op(*producer).layer,
                    Some(_) => false,
                }
        })
        .map(|(t, _)| t)
        .collect()
}

/// Tensors op `o` saves that are neither operands nor results (dropout masks, statistics).
fn implicit_saves(g: &Graph, o: OpId) -> Vec<TensorId> {
    let op = g.op(o);
    op.saves
        .iter()
        .copied()
        .filter(|t| !op.inputs.contains(t) && !op.outputs.contains(t))
        .collect()
}

/// Where a parameter's working weight and optimizer states may live: every valid spec for
/// the states, with the weight split over any subset of the states' mesh axes (the states
/// are at least as sharded as the weight, as in ZeRO).
fn param_choices(shape: &[u64], mesh: &Mesh) -> Vec<(Spec, Spec)> {
    let mut out = Vec::new();
    for o in valid_specs(shape, mesh) {
        let axes = o.axes();
        for keep in 0..4u8 {
            if keep & !axes != 0 {
                continue;
            }
            let w = Spec(
                o.0.iter()
                    .map(|s| AxisSplit::from_axes(s.axes() & keep))
                    .collect(),
            );
            out.push((w, o.clone()));
        }
    }
    out
}
