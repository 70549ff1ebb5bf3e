//! Lowering: a model graph and a parallel layout become the programs the devices run.
//!
//! Every stage runs on a logical mesh and every tensor gets a placement on it, one state per
//! mesh axis: Megatron-LM's scheme on the one-axis mesh of the tensor-parallel group (as the
//! graph's [`Split`]s state it; under context parallelism the mesh is `[cp, tp]` and every
//! activation's sequence axis is split along axis 0), or an intra-op plan's specs on its
//! stages' meshes. Every forward
//! op becomes one or two [`Step`]s: the placement each operand must be in (with the collectives
//! that bring it there), the kernel, the placement its outputs come out in (and the collectives
//! to their placements), and the same for the backward, each mesh axis's states derived by the
//! same rules. Megatron's `f`/`g` operators, sequence-parallel gathers and scatters, the
//! vocabulary-parallel loss and an intra-op plan's 2D shardings all follow from these rules
//! rather than being special-cased.
//! Layers are then grouped into the plan's chunks (virtual pipeline stages), and every stage
//! gets its list of [`Action`]s in the order of the 1F1B or interleaved 1F1B schedule.

use super::ExecError;
use super::attention::Keys;
use super::kernels::Kernel;
use super::placement::{Conversion, Placement, State, conversions};
use autopar_rules::cost::context_parallel::CpComm;
use autopar_rules::model::graph::{Graph, OpKind, Split, TensorId, TensorKind};
use autopar_rules::solve::schedule::{BlockKind, Schedule, stage_program};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// Version of the lowered program layout (part of its cache key).
pub const PROGRAM_VERSION: u32 = 5;

/// The parallel layout a program is lowered for.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ExecLayout {
    /// Tensor-parallel degree of Megatron-LM's layouts (the one-axis mesh of every stage when
    /// `meshes` is empty).
    pub tp: usize,
    /// Context-parallel degree of Megatron-LM's layouts: every sequence split over `cp` ranks
    /// in load-balanced order, the stage's mesh then `[cp, tp]`.
    #[serde(default = "one")]
    pub cp: usize,
    /// How the context-parallel ranks attend to each other's keys and values.
    #[serde(default)]
    pub cp_comm: CpComm,
    /// Under `a2a+p2p`, the ranks of the all-to-all level (inside a node); the ring runs over
    /// `cp / cp_a2a` groups of them, and the stage's mesh is `[cp / cp_a2a, cp_a2a, tp]`.
    #[serde(default = "one")]
    pub cp_a2a: usize,
    /// Expert-parallel degree of Megatron-LM's layouts, folded as Megatron-Core folds it: with
    /// `etp` = 1 the tensor-parallel group holds `tp` of the ranks, the rest are data-parallel
    /// ranks ([`ExecLayout::ep_over_data`]), which become the stage mesh's first axis: it splits
    /// the batch of every activation and, with the tensor-parallel axis, the experts of every
    /// expert weight and buffer.
    #[serde(default = "one")]
    pub ep: usize,
    /// Expert tensor-parallel degree: `tp` splits the experts' width with the tensor-parallel
    /// group, 1 keeps every expert whole on it.
    #[serde(default = "one")]
    pub etp: usize,
    /// Tokens past an expert's capacity are dropped (otherwise they are an error: a dropless
    /// plan sized the buffers).
    #[serde(default)]
    pub moe_drop: bool,
    /// Pipeline stages.
    pub pp: usize,
    /// Data-parallel replicas of the whole pipeline (Megatron-LM's data parallelism; an
    /// intra-op plan's data parallelism is a split of the batch on its mesh instead).
    pub dp: usize,
    /// Sequence parallelism in the tensor-parallel group.
    pub sequence_parallel: bool,
    /// ZeRO stage over the replicas: 0 all-reduces gradients; 1 and above reduce-scatter them,
    /// update a shard of the parameters and all-gather them.
    pub zero: u8,
    /// Micro-batches per pipeline per step.
    pub microbatches: usize,
    /// Layers of every chunk, `[stage][chunk] = (first, last)` inclusive; virtual stage
    /// `chunk * pp + stage` runs them.
    pub chunks: Vec<Vec<(usize, usize)>>,
    /// Weight-gradient products add into the gradient of the step's earlier micro-batches
    /// (Megatron-LM's `--gradient-accumulation-fusion`) instead of producing a fresh gradient
    /// that a separate pass adds.
    pub grad_accumulation_fusion: bool,
    /// The logical mesh of every stage (devices along each axis, axis 0 major) when an intra-op
    /// plan placed the tensors; stages may differ. Empty: every stage's mesh is Megatron-LM's,
    /// the tensor-parallel group after the expert- and context-parallel axes it has
    /// ([`ExecLayout::mesh`]).
    #[serde(default)]
    pub meshes: Vec<Vec<usize>>,
    /// Placements an intra-op plan chose, by tensor name, one state per mesh axis; a tensor it
    /// does not name is replicated, and `NAME@STAGE` places a value received by a stage whose
    /// mesh differs from its sender's. Empty: Megatron-LM's placements, from the graph's
    /// splits. Either way the same rules derive every kernel's states and the collectives
    /// between them.
    #[serde(default)]
    pub placements: BTreeMap<String, Placement>,
    /// Placements of parameters' optimizer states (master weight and Adam moments) inside the
    /// mesh, by parameter name (ZeRO-style sharding of an intra-op plan); a parameter it does
    /// not name keeps its states as its weight is placed.
    #[serde(default)]
    pub states: BTreeMap<String, Placement>,
    /// Layers whose forward the backward pass runs again: under full recomputation a
    /// Megatron-LM chunk's first blocks, or the layers an ILP stage recomputes. Both backends
    /// compute the same numbers either way; the CPU backend keeps every activation, the JAX
    /// program wraps these layers in `jax.checkpoint`.
    #[serde(default)]
    pub recomputed: Vec<usize>,
    /// Every attention core recomputed (selective recomputation), as [`ExecLayout::recomputed`].
    #[serde(default)]
    pub recompute_attention: bool,
}

fn one() -> usize {
    1
}

/// What one mesh axis of a Megatron-LM layout's stage holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MegatronAxis {
    /// Data-parallel ranks folded into expert parallelism: the batch split, and the experts.
    Experts,
    /// Context-parallel ranks: the sequence split, keys and values exchanged as said.
    Context(CpComm),
    /// The tensor-parallel group.
    Tensor,
}

impl ExecLayout {
    /// One device running every layer: the reference a sharded run is compared with.
    pub fn single(layers: usize, microbatches: usize) -> ExecLayout {
        ExecLayout {
            tp: 1,
            cp: 1,
            cp_comm: CpComm::default(),
            cp_a2a: 1,
            ep: 1,
            etp: 1,
            moe_drop: false,
            pp: 1,
            dp: 1,
            sequence_parallel: false,
            zero: 0,
            microbatches,
            chunks: vec![vec![(0, layers.saturating_sub(1))]],
            grad_accumulation_fusion: true,
            meshes: Vec::new(),
            placements: BTreeMap::new(),
            states: BTreeMap::new(),
            recomputed: Vec::new(),
            recompute_attention: false,
        }
    }

    /// An intra-op plan's layout: stage `j` holds the layers of `chunks[j]` on the logical mesh
    /// `meshes[j]`, every tensor placed by `placements` and every parameter's optimizer states
    /// by `states`.
    pub fn on_meshes(
        meshes: Vec<Vec<usize>>,
        microbatches: usize,
        chunks: Vec<Vec<(usize, usize)>>,
        placements: BTreeMap<String, Placement>,
        states: BTreeMap<String, Placement>,
    ) -> ExecLayout {
        ExecLayout {
            pp: chunks.len(),
            chunks,
            meshes,
            placements,
            states,
            ..ExecLayout::single(0, microbatches)
        }
    }

    /// Chunks per stage.
    pub fn interleave(&self) -> usize {
        self.chunks.first().map_or(0, Vec::len)
    }

    /// The logical mesh of pipeline stage `stage`.
    pub fn mesh(&self, stage: usize) -> Vec<usize> {
        match self.meshes.get(stage) {
            Some(m) if !self.meshes.is_empty() => m.clone(),
            _ => self.megatron_axes().into_iter().map(|(_, n)| n).collect(),
        }
    }

    /// The mesh axes of a Megatron-LM layout's stage, major first: the expert-parallel ranks
    /// (when `ep` > 1), the context-parallel ones (one axis, or two under `a2a+p2p`), then the
    /// tensor-parallel group, which varies fastest as in Megatron-Core's rank order.
    fn megatron_axes(&self) -> Vec<(MegatronAxis, usize)> {
        let mut axes = Vec::new();
        let over_data = Self::ep_over_data(self.tp, self.ep, self.etp);
        if over_data > 1 {
            axes.push((MegatronAxis::Experts, over_data));
        }
        if self.hierarchical() {
            let a = self.cp_a2a.max(1);
            axes.push((MegatronAxis::Context(CpComm::P2p), self.cp / a));
            axes.push((MegatronAxis::Context(CpComm::A2a), a));
        } else if self.cp > 1 {
            axes.push((MegatronAxis::Context(self.cp_comm), self.cp));
        }
        axes.push((MegatronAxis::Tensor, self.tp));
        axes
    }

    /// The expert-parallel ranks that are data-parallel ones: Megatron-Core's expert group
    /// `etp x ep` takes the tensor-parallel group first, so with `etp` = 1 the experts are split
    /// over the `tp` ranks and over `ep / tp` data-parallel ones; with `etp` = tp every expert
    /// is split in width there and the `ep` ranks are all data-parallel.
    pub fn ep_over_data(tp: usize, ep: usize, etp: usize) -> usize {
        if etp == 1 && tp > 1 && ep > 1 {
            (ep / tp).max(1)
        } else {
            ep.max(1)
        }
    }

    /// Whether the tensor-parallel group splits the experts (expert parallelism with `etp` = 1).
    fn experts_over_tensor(&self) -> bool {
        self.etp == 1 && self.tp > 1 && self.ep > 1
    }

    /// Whether sequences are split over two mesh axes, a ring of all-to-all groups
    /// (`a2a+p2p`).
    fn hierarchical(&self) -> bool {
        self.cp > 1 && self.cp_comm == CpComm::A2aP2p
    }

    /// Devices of one replica's stage `stage`.
    pub fn stage_devices(&self, stage: usize) -> usize {
        self.mesh(stage).iter().product()
    }

    /// Virtual devices.
    pub fn devices(&self) -> usize {
        self.dp * (0..self.pp).map(|j| self.stage_devices(j)).sum::<usize>()
    }

    /// One-line description, e.g. `dp2 tp2 pp2 v2 sp zero1 m4`, or `meshes 2x2,1x4 m4 (plan's
    /// placements)` when an intra-op plan placed the tensors.
    pub fn describe(&self) -> String {
        if !self.placements.is_empty() || !self.meshes.is_empty() {
            let meshes: Vec<String> = (0..self.pp)
                .map(|j| {
                    let m: Vec<String> = self.mesh(j).iter().map(usize::to_string).collect();
                    m.join("x")
                })
                .collect();
            return format!(
                "meshes {} m{} (plan's placements)",
                meshes.join(","),
                self.microbatches
            );
        }
        format!(
            "dp{} tp{}{}{} pp{} v{}{}{} m{}",
            self.dp,
            self.tp,
            if self.hierarchical() {
                format!(
                    " cp{} ({}, {} x {})",
                    self.cp,
                    self.cp_comm.name(),
                    self.cp / self.cp_a2a.max(1),
                    self.cp_a2a
                )
            } else if self.cp > 1 {
                format!(" cp{} ({})", self.cp, self.cp_comm.name())
            } else {
                String::new()
            },
            if self.ep > 1 || self.etp > 1 {
                format!(" ep{} etp{}", self.ep, self.etp)
            } else {
                String::new()
            },
            self.pp,
            self.interleave(),
            if self.sequence_parallel { " sp" } else { "" },
            if self.zero > 0 {
                format!(" zero{}", self.zero)
            } else {
                String::new()
            },
            self.microbatches
        )
    }
}

/// How a parameter is initialised.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Init {
    /// Small random values (weights).
    Weight,
    /// One plus a small perturbation (normalisation gains).
    Gain,
    /// Small random values around zero (biases).
    Bias,
}

/// What a value of the program is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Fed data: integer ids below `bound`, or floats when `bound` is `None`.
    Input {
        /// Exclusive upper bound of integer ids.
        bound: Option<usize>,
    },
    /// A trained weight.
    Parameter {
        /// Initialisation.
        init: Init,
    },
    /// An intermediate value.
    Activation {
        /// Whether a gradient flows to it.
        requires_grad: bool,
    },
}

/// A value: a graph tensor, or a temporary the lowering introduced.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ValueInfo {
    /// Name (the graph tensor's).
    pub name: String,
    /// Whole shape.
    pub shape: Vec<usize>,
    /// Where it lives on its stage's mesh between steps.
    pub placement: Placement,
    /// Role.
    pub role: Role,
    /// A parameter's gradient between the backward passes of a step and the step's
    /// synchronisation: its placement, partial sums left on the mesh axes where every use
    /// leaves one (a data-parallel split of the batch), so that they are reduced once per step.
    #[serde(default)]
    pub grad_placement: Option<Placement>,
    /// A parameter's optimizer states (master weight and Adam moments): sharded further than
    /// the weight under ZeRO-style sharding inside the mesh.
    #[serde(default)]
    pub state_placement: Option<Placement>,
}

/// One kernel with the collectives around it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Step {
    /// The graph op (and a suffix for a split-off part).
    pub name: String,
    /// What runs.
    pub kernel: Kernel,
    /// Operand values.
    pub inputs: Vec<u32>,
    /// Result values.
    pub outputs: Vec<u32>,
    /// Forward: per operand, the collectives from its placement to what the kernel reads.
    pub before: Vec<Vec<Conversion>>,
    /// Forward: per result, the collectives from what the kernel writes to its placement.
    pub after: Vec<Vec<Conversion>>,
    /// Backward: per result, the collectives bringing its gradient to what the kernel reads.
    pub grad_before: Vec<Vec<Conversion>>,
    /// Backward: per operand, the collectives taking its gradient to the operand's placement
    /// (`None`: no gradient flows to it).
    pub grad_after: Vec<Option<Vec<Conversion>>>,
    /// Placements the kernel writes its results in (their local shapes follow from them).
    pub out_states: Vec<Placement>,
    /// Placements the kernel writes its operands' gradients in.
    pub grad_states: Vec<Placement>,
    /// Mesh axes over which the kernel itself communicates (a vocabulary split over them):
    /// its group is the devices that differ only on these axes.
    #[serde(default)]
    pub kernel_axes: Vec<usize>,
}

/// The code of one virtual pipeline stage.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChunkCode {
    /// Pipeline stage holding it.
    pub stage: usize,
    /// Chunk index on that stage.
    pub chunk: usize,
    /// Layers (inclusive).
    pub layers: (usize, usize),
    /// Activations received from the previous virtual stage (sent back as gradients), as
    /// this stage names them.
    pub recv: Vec<u32>,
    /// The same activations as the previous virtual stage names them (another value where the
    /// two stages' meshes differ and the value is placed anew).
    pub recv_from: Vec<u32>,
    /// The previous virtual stage runs on another mesh: activations cross whole (gathered on
    /// the sender's mesh, cut to this stage's placement) and their gradients the same way back,
    /// Alpa's cross-mesh resharding.
    pub reshard: bool,
    /// Activations sent to the next virtual stage (their gradients come back).
    pub send: Vec<u32>,
    /// Fed inputs it reads.
    pub inputs: Vec<u32>,
    /// Parameters it reads.
    pub parameters: Vec<u32>,
    /// Steps in forward order.
    pub steps: Vec<Step>,
}

/// One entry of a stage's program.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Wait for the previous virtual stage's activations of a micro-batch.
    RecvActivations {
        /// Virtual stage.
        chunk: usize,
        /// Micro-batch.
        microbatch: usize,
    },
    /// Forward of a virtual stage for one micro-batch.
    Forward {
        /// Virtual stage.
        chunk: usize,
        /// Micro-batch.
        microbatch: usize,
    },
    /// Send the outputs to the next virtual stage.
    SendActivations {
        /// Virtual stage.
        chunk: usize,
        /// Micro-batch.
        microbatch: usize,
    },
    /// Wait for the gradients of the outputs from the next virtual stage.
    RecvGradients {
        /// Virtual stage.
        chunk: usize,
        /// Micro-batch.
        microbatch: usize,
    },
    /// Backward of a virtual stage for one micro-batch.
    Backward {
        /// Virtual stage.
        chunk: usize,
        /// Micro-batch.
        microbatch: usize,
    },
    /// Send the gradients of the inputs to the previous virtual stage.
    SendGradients {
        /// Virtual stage.
        chunk: usize,
        /// Micro-batch.
        microbatch: usize,
    },
    /// Sum the gradients of parameters held by several stages (a tied embedding).
    SyncTied,
    /// Data-parallel gradient synchronisation (all-reduce, or reduce-scatter under ZeRO).
    SyncGradients,
    /// Adam update (on a shard and then all-gathered under ZeRO).
    OptimizerStep,
}

/// A parameter several pipeline stages hold a copy of.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Tied {
    /// The parameter.
    pub value: u32,
    /// Stages holding it.
    pub stages: Vec<usize>,
}

/// A lowered plan: the code of every virtual stage and the action list of every stage. The
/// program of a device is its stage's actions, run with its (data, tensor) rank.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Program {
    /// [`PROGRAM_VERSION`].
    pub version: u32,
    /// Layout.
    pub layout: ExecLayout,
    /// Sequences per micro-batch.
    pub micro_batch: usize,
    /// Every value.
    pub values: Vec<ValueInfo>,
    /// Virtual stages, indexed `chunk * pp + stage`.
    pub chunks: Vec<ChunkCode>,
    /// Actions per stage, one step.
    pub stages: Vec<Vec<Action>>,
    /// The loss value.
    pub loss: u32,
    /// Parameters held by several stages.
    pub tied: Vec<Tied>,
}

impl Program {
    /// Collectives of each name a forward and backward of one micro-batch run on one device of
    /// virtual stage `chunk` (communicating conversions only).
    pub fn collectives(&self, chunk: usize) -> BTreeMap<&'static str, usize> {
        let mut out = BTreeMap::new();
        let Some(code) = self.chunks.get(chunk) else {
            return out;
        };
        for step in &code.steps {
            for c in Self::lists(step).flatten().filter(|c| c.communicates()) {
                *out.entry(c.name()).or_insert(0) += 1;
            }
        }
        out
    }

    /// [`Program::collectives`] counted as calls: consecutive conversions of one kind along
    /// different mesh axes in one list, on the same tensor axis, are one collective over their
    /// combined group (as XLA issues them: an all-gather of a tensor axis split over both axes
    /// of a 2D mesh is one all-gather over its four devices, while gathering rows along one
    /// mesh axis and columns along the other is two).
    pub fn collective_calls(&self, chunk: usize) -> BTreeMap<&'static str, usize> {
        let mut out = BTreeMap::new();
        if let Some(code) = self.chunks.get(chunk) {
            for step in &code.steps {
                count_calls(Self::lists(step), &mut out);
            }
        }
        out
    }

    /// The collectives that running the forward of steps `again` of virtual stage `chunk` once
    /// more would issue (recomputation): their forward conversions, counted as
    /// [`Program::collective_calls`] counts them, and their kernels' forward collectives.
    pub fn forward_calls(
        &self,
        chunk: usize,
        again: impl Fn(usize) -> bool,
    ) -> BTreeMap<&'static str, usize> {
        let mut out = BTreeMap::new();
        let Some(code) = self.chunks.get(chunk) else {
            return out;
        };
        let mesh = self.layout.mesh(code.stage);
        let steps = code.steps.iter().enumerate().filter(|(i, _)| again(*i));
        for (_, step) in steps {
            count_calls(step.before.iter().chain(&step.after), &mut out);
            if let Some((kind, _, forward)) = kernel_calls(step, &mesh) {
                *out.entry(kind).or_insert(0) += forward;
            }
        }
        out
    }

    /// Every conversion list of a step: forward before and after, backward before and after.
    fn lists(step: &Step) -> impl Iterator<Item = &Vec<Conversion>> {
        step.before
            .iter()
            .chain(&step.after)
            .chain(&step.grad_before)
            .chain(step.grad_after.iter().flatten())
    }

    /// Collectives that kernels of virtual stage `chunk` run themselves, by name, for one
    /// micro-batch on one device, forward and backward: a vocabulary-parallel loss all-reduces
    /// its rows' maximum, sum and target logit; a ring attention over `n` ranks passes its
    /// key/value block `n - 1` times forward, the block with its gradient `n - 1` times
    /// backward and the gradient home once more: `2 n - 1` collective permutes.
    pub fn kernel_collectives(&self, chunk: usize) -> BTreeMap<&'static str, usize> {
        let mut out = BTreeMap::new();
        let Some(code) = self.chunks.get(chunk) else {
            return out;
        };
        let mesh = self.layout.mesh(code.stage);
        for step in &code.steps {
            if let Some((kind, calls, _)) = kernel_calls(step, &mesh) {
                *out.entry(kind).or_insert(0) += calls;
            }
        }
        out
    }
}

/// The collectives a step's kernel runs itself for one micro-batch on a stage of `mesh`
/// ([`Program::kernel_collectives`]): their kind, how many forward and backward together, and
/// how many of those in the forward. `None` for a kernel that does not talk.
fn kernel_calls(step: &Step, mesh: &[usize]) -> Option<(&'static str, usize, usize)> {
    let group: usize = step
        .kernel_axes
        .iter()
        .map(|&a| mesh.get(a).copied().unwrap_or(1))
        .product();
    if group < 2 {
        return None;
    }
    match step.kernel {
        // The rows' maximum, sum and target logit, all in the forward.
        Kernel::CrossEntropy {
            vocab_parallel: true,
            ..
        } => Some(("all_reduce", 3, 3)),
        Kernel::Attention {
            keys: Keys::Ring, ..
        } => Some(("collective_permute", 2 * group - 1, group - 1)),
        _ => None,
    }
}

/// Adds the collectives of conversion `lists` to `out`, as calls: consecutive conversions of
/// one kind along different mesh axes in one list, on the same tensor axis, are one.
fn count_calls<'a>(
    lists: impl Iterator<Item = &'a Vec<Conversion>>,
    out: &mut BTreeMap<&'static str, usize>,
) {
    for list in lists {
        let mut previous: Option<&Conversion> = None;
        for c in list.iter().filter(|c| c.communicates()) {
            let merged = previous.is_some_and(|p| {
                p.name() == c.name()
                    && p.mask() & c.mask() == 0
                    && !matches!(c, Conversion::AllToAll { .. })
                    && gathered_axis(p) == gathered_axis(c)
            });
            if !merged {
                *out.entry(c.name()).or_insert(0) += 1;
            }
            previous = Some(c);
        }
    }
}

/// The tensor axis a conversion gathers or scatters (none for an all-reduce).
fn gathered_axis(c: &Conversion) -> Option<usize> {
    match c {
        Conversion::AllGather { from, .. } => from.axis(),
        Conversion::ReduceScatter { to, .. } | Conversion::Slice { to, .. } => to.axis(),
        Conversion::AllReduce { .. } | Conversion::AllToAll { .. } => None,
    }
}

fn err(message: impl Into<String>) -> ExecError {
    ExecError::Lower(message.into())
}

/// Why `op` (multi-head latent attention's join, or an op of a kind autopar does not know)
/// cannot run here.
fn unsupported(op: &autopar_rules::model::graph::Op) -> ExecError {
    let what = match op.kind {
        OpKind::Opaque { .. } => {
            "autopar's executors (CPU and JAX) have no kernel for ops of kinds autopar does not \
             know"
        }
        _ => "the CPU executor does not run multi-head latent attention yet",
    };
    err(format!(
        "`{}` ({}): {what}; plan and estimate such models",
        op.name,
        op.kind.name()
    ))
}

/// Lowers `graph` for `layout`.
pub fn lower(graph: &Graph, layout: &ExecLayout) -> Result<Program, ExecError> {
    check_layout(graph, layout)?;
    if let Some(op) = graph
        .ops
        .iter()
        .find(|o| matches!(o.kind, OpKind::Concat | OpKind::Opaque { .. }))
    {
        return Err(unsupported(op));
    }
    let axes = layout.mesh(0).len();
    let parts = split_parts(graph);
    let seq_axes = sequence_axes(graph);
    let context = Context::of(layout);
    let mut values: Vec<ValueInfo> = Vec::with_capacity(graph.tensors.len());
    for (i, t) in graph.tensors.iter().enumerate() {
        let shape: Vec<usize> = t.shape.iter().map(|&d| d as usize).collect();
        let placement = if layout.placements.is_empty() && layout.meshes.is_empty() {
            megatron_placement(t.split, &shape, parts[i].as_ref(), seq_axes[i], layout)
        } else {
            match layout.placements.get(&t.name) {
                Some(p) => plan_placement(p, &shape, parts[i].as_ref(), &t.name)?,
                None => Placement::replicated(axes),
            }
        };
        let role = match t.kind {
            TensorKind::Input => Role::Input {
                bound: input_bound(graph, TensorId(i as u32)),
            },
            TensorKind::Parameter => Role::Parameter {
                init: parameter_init(graph, TensorId(i as u32)),
            },
            _ => Role::Activation {
                requires_grad: t.requires_grad,
            },
        };
        let state_placement = match (&role, layout.states.get(&t.name)) {
            (Role::Parameter { .. }, Some(p)) => {
                Some(plan_placement(p, &shape, parts[i].as_ref(), &t.name)?)
            }
            (Role::Parameter { .. }, None) => Some(placement.clone()),
            _ => None,
        };
        values.push(ValueInfo {
            name: t.name.clone(),
            shape,
            placement,
            role,
            grad_placement: None,
            state_placement,
        });
    }
    for v in &values {
        if matches!(v.role, Role::Input { .. })
            && v.shape.first().copied() != Some(graph.micro_batch as usize)
        {
            return Err(err(format!(
                "input `{}` {:?} must have the micro-batch ({}) as its first axis",
                v.name, v.shape, graph.micro_batch
            )));
        }
    }

    // Virtual stage of every layer, and whether a virtual stage's mesh differs from its
    // predecessor's (activations then cross whole).
    let pp = layout.pp;
    let mut layer_chunk = vec![0usize; graph.layers.len()];
    for (j, stage) in layout.chunks.iter().enumerate() {
        for (c, &(first, last)) in stage.iter().enumerate() {
            for slot in &mut layer_chunk[first..=last] {
                *slot = c * pp + j;
            }
        }
    }
    let virtual_stages = pp * layout.interleave();
    let reshard: Vec<bool> = (0..virtual_stages)
        .map(|vs| vs > 0 && layout.mesh(vs % pp) != layout.mesh((vs - 1) % pp))
        .collect();

    let mut steps_of: Vec<Vec<Step>> = vec![Vec::new(); virtual_stages];
    let mut loss = None;
    // Producer (virtual stage) of every activation so far; values placed anew by the virtual
    // stage that receives them across a change of mesh.
    let mut produced_in: BTreeMap<u32, usize> = BTreeMap::new();
    let mut renamed: BTreeMap<(u32, usize), u32> = BTreeMap::new();
    for (li, layer) in graph.layers.iter().enumerate() {
        let vs = layer_chunk[li];
        let mesh = layout.mesh(vs % pp);
        for &oid in &layer.forward {
            let op = graph.op(oid);
            if matches!(op.kind, OpKind::CrossEntropy) {
                loss = op.outputs.first().map(|t| t.0);
            }
            let mut ins = Vec::with_capacity(op.inputs.len());
            for t in &op.inputs {
                let v = t.0;
                let from = produced_in.get(&v).copied();
                let crosses = from.is_some_and(|f| f < vs && reshard[f + 1..=vs].contains(&true));
                if !crosses {
                    ins.push(v);
                    continue;
                }
                if from != Some(vs - 1) {
                    return Err(err(format!(
                        "`{}` is read by `{}` more than one stage after it is made, across a \
                         change of mesh; the executor moves such values one stage at a time",
                        values[v as usize].name, op.name
                    )));
                }
                let local = match renamed.get(&(v, vs)) {
                    Some(&l) => l,
                    None => {
                        let name = format!("{}@{}", values[v as usize].name, vs % pp);
                        let shape = values[v as usize].shape.clone();
                        let placement = match layout.placements.get(&name) {
                            Some(p) => plan_placement(p, &shape, None, &name)?,
                            None => Placement::replicated(mesh.len()),
                        };
                        values.push(ValueInfo {
                            name,
                            placement,
                            grad_placement: None,
                            state_placement: None,
                            ..values[v as usize].clone()
                        });
                        let l = (values.len() - 1) as u32;
                        renamed.insert((v, vs), l);
                        l
                    }
                };
                ins.push(local);
            }
            let steps = lower_op(graph, oid, &ins, &mut values, &mesh, &context)?;
            for s in &steps {
                for &o in &s.outputs {
                    produced_in.insert(o, vs);
                }
            }
            steps_of[vs].extend(steps);
        }
    }
    let loss = loss.ok_or_else(|| err("the model has no cross-entropy loss to train on"))?;

    // Producer and last consumer (virtual stage) of every activation; a value placed anew is
    // read, as its sender names it, where it is received.
    let mut producer: BTreeMap<u32, usize> = BTreeMap::new();
    let mut last_use: BTreeMap<u32, usize> = BTreeMap::new();
    for (vs, steps) in steps_of.iter().enumerate() {
        for s in steps {
            for &o in &s.outputs {
                producer.insert(o, vs);
            }
            for &i in &s.inputs {
                let e = last_use.entry(i).or_insert(vs);
                *e = (*e).max(vs);
            }
        }
    }
    for &(v, vs) in renamed.keys() {
        let e = last_use.entry(v).or_insert(vs);
        *e = (*e).max(vs);
    }
    let crossing = |vs: usize| -> Vec<u32> {
        producer
            .iter()
            .filter(|&(v, &p)| p < vs && last_use.get(v).is_some_and(|&c| c >= vs))
            .map(|(&v, _)| v)
            .collect()
    };
    let mut chunks = Vec::with_capacity(virtual_stages);
    let mut holders: BTreeMap<u32, BTreeSet<usize>> = BTreeMap::new();
    for (vs, steps) in steps_of.into_iter().enumerate() {
        let (stage, chunk) = (vs % pp, vs / pp);
        let mut inputs = BTreeSet::new();
        let mut params = BTreeSet::new();
        for s in &steps {
            for &i in &s.inputs {
                match values[i as usize].role {
                    Role::Input { .. } => {
                        inputs.insert(i);
                    }
                    Role::Parameter { .. } => {
                        params.insert(i);
                        holders.entry(i).or_default().insert(stage);
                    }
                    Role::Activation { .. } => {}
                }
            }
        }
        let recv_from = if vs == 0 { vec![] } else { crossing(vs) };
        let recv = recv_from
            .iter()
            .map(|&v| renamed.get(&(v, vs)).copied().unwrap_or(v))
            .collect();
        chunks.push(ChunkCode {
            stage,
            chunk,
            layers: layout.chunks[stage][chunk],
            recv,
            recv_from,
            reshard: reshard[vs],
            send: crossing(vs + 1),
            inputs: inputs.into_iter().collect(),
            parameters: params.into_iter().collect(),
            steps,
        });
    }
    let tied: Vec<Tied> = holders
        .into_iter()
        .filter(|(_, s)| s.len() > 1)
        .map(|(value, s)| Tied {
            value,
            stages: s.into_iter().collect(),
        })
        .collect();
    defer_gradient_reductions(&mut values, &mut chunks, &tied, layout)?;
    let stages = (0..pp)
        .map(|j| stage_actions(j, pp, layout.interleave(), layout.microbatches))
        .collect();
    Ok(Program {
        version: PROGRAM_VERSION,
        layout: layout.clone(),
        micro_batch: graph.micro_batch as usize,
        values,
        chunks,
        stages,
        loss,
        tied,
    })
}

/// A tensor's placement in Megatron-LM's layouts: its graph split in the tensor-parallel
/// group (a sequence split only under sequence parallelism), after, under context
/// parallelism, its sequence axis `seq` split over the context-parallel ranks.
fn megatron_placement(
    split: Split,
    shape: &[usize],
    parts: Option<&Vec<usize>>,
    seq: Option<usize>,
    layout: &ExecLayout,
) -> Placement {
    let whole = |a: usize| State::Split {
        axis: a,
        parts: parts
            .cloned()
            .unwrap_or_else(|| vec![shape.get(a).copied().unwrap_or(1)]),
    };
    let tensor = |split: Split| match split {
        _ if layout.tp == 1 => State::Replicated,
        Split::None => State::Replicated,
        Split::Model(a) => whole(a as usize),
        Split::Sequence(a) if layout.sequence_parallel => split_whole(a as usize, shape),
        Split::Sequence(_) => State::Replicated,
        // The experts themselves, or (expert tensor parallelism) their width.
        Split::Experts | Split::ExpertModel(_) if layout.experts_over_tensor() => {
            split_whole(0, shape)
        }
        Split::ExpertModel(a) if layout.etp == layout.tp => whole(a as usize),
        Split::Experts | Split::ExpertModel(_) => State::Replicated,
    };
    let states = layout
        .megatron_axes()
        .into_iter()
        .map(|(axis, _)| match axis {
            // Experts (axis 0 of expert weights and buffers), or the batch of what has one.
            MegatronAxis::Experts if split.is_expert() => split_whole(0, shape),
            MegatronAxis::Experts if seq.is_some() => split_whole(0, shape),
            MegatronAxis::Experts => State::Replicated,
            MegatronAxis::Context(_) => match seq {
                Some(a) => split_whole(a, shape),
                None => State::Replicated,
            },
            MegatronAxis::Tensor => tensor(split),
        })
        .collect();
    Placement(states)
}

/// The sequence axis of every tensor of the forward pass, followed from the fed inputs
/// (`[b, s]`) through every op; `None` for parameters, the loss and tensors without one.
/// Context parallelism splits these axes. They are the graph's shapes' axes; consumers of an
/// attention core read its output token-major (`[b, s, heads, d]`, [`token_major`]).
fn sequence_axes(graph: &Graph) -> Vec<Option<usize>> {
    let mut axes: Vec<Option<usize>> = graph
        .tensors
        .iter()
        .map(|t| (t.kind == TensorKind::Input && t.shape.len() >= 2).then_some(1))
        .collect();
    let mut read = axes.clone();
    for layer in &graph.layers {
        for &oid in &layer.forward {
            let op = graph.op(oid);
            let first = op.inputs.first().and_then(|t| read[t.0 as usize]);
            let any = op.inputs.iter().find_map(|t| read[t.0 as usize]);
            for &o in &op.outputs {
                let rank = graph.tensor(o).shape.len();
                let axis = match op.kind {
                    // `[b, s, n*d]` viewed as `[b, n, s, d]` moves the sequence one axis on.
                    OpKind::Slice => first.map(|a| {
                        let grows = op
                            .inputs
                            .first()
                            .is_some_and(|&x| rank > graph.tensor(x).shape.len());
                        if grows && a >= 1 { a + 1 } else { a }
                    }),
                    OpKind::Transpose => first.map(|a| {
                        match op
                            .inputs
                            .first()
                            .and_then(|x| transpose_axes(graph, x.0, o.0))
                        {
                            Some((p, q)) if a == p => q,
                            Some((p, q)) if a == q => p,
                            _ => a,
                        }
                    }),
                    OpKind::CrossEntropy | OpKind::MoeDispatch => None,
                    OpKind::Embedding | OpKind::MatMul { .. } => first,
                    _ => any,
                };
                let axis = axis.filter(|&a| a + 1 < rank);
                axes[o.0 as usize] = axis;
                read[o.0 as usize] = match op.kind {
                    OpKind::FlashAttention { .. } => axis.map(|a| if a == 2 { 1 } else { a }),
                    _ => axis,
                };
            }
        }
    }
    axes
}

/// Context parallelism as the rules see it: the load-balanced order every sequence is stored
/// in (the layout's `cp`; 1: in order), and, per mesh axis, how the ranks along it exchange
/// keys and values when it splits sequences (a Megatron-LM layout's context-parallel axes;
/// under `a2a+p2p` a ring axis and an all-to-all axis).
#[derive(Clone, Debug)]
struct Context {
    zigzag: usize,
    comms: Vec<Option<CpComm>>,
    moe_drop: bool,
}

impl Context {
    fn of(layout: &ExecLayout) -> Context {
        let megatron = layout.placements.is_empty() && layout.meshes.is_empty();
        let comms = layout
            .megatron_axes()
            .into_iter()
            .map(|(axis, _)| match axis {
                MegatronAxis::Context(c) if megatron => Some(c),
                _ => None,
            })
            .collect();
        Context {
            zigzag: layout.cp.max(1),
            comms,
            moe_drop: layout.moe_drop,
        }
    }

    /// How the ranks along mesh axis `a` exchange keys and values, if it splits sequences.
    fn comm_on(&self, a: usize) -> Option<CpComm> {
        self.comms.get(a).copied().flatten()
    }
}

/// A plan's placement of a tensor: a split of a fused last axis divides each of its parts
/// (whole heads of q, k, v); partial sums are not a placement between ops.
fn plan_placement(
    given: &Placement,
    shape: &[usize],
    parts: Option<&Vec<usize>>,
    name: &str,
) -> Result<Placement, ExecError> {
    let states = given
        .0
        .iter()
        .map(|s| match s {
            State::Split { axis, .. } => Ok(State::Split {
                axis: *axis,
                parts: parts
                    .filter(|_| *axis + 1 == shape.len())
                    .cloned()
                    .unwrap_or_else(|| vec![shape.get(*axis).copied().unwrap_or(1)]),
            }),
            State::Partial => Err(err(format!(
                "`{name}` is placed as a partial sum between ops; a placement is replicated \
                 or split"
            ))),
            State::Replicated => Ok(State::Replicated),
        })
        .collect::<Result<_, _>>()?;
    Ok(Placement(states))
}

/// Leaves a parameter's gradient as a partial sum on the mesh axes where every use of it
/// leaves one (the batch split over the axis), to be reduced once per step by the
/// synchronisation rather than after every micro-batch; a weight shared between stages is
/// completed where it is made, since stages sum it as placed. Each use's gradient conversion is
/// then the one to that placement.
fn defer_gradient_reductions(
    values: &mut [ValueInfo],
    chunks: &mut [ChunkCode],
    tied: &[Tied],
    layout: &ExecLayout,
) -> Result<(), ExecError> {
    let mut made: BTreeMap<u32, Vec<Placement>> = BTreeMap::new();
    for code in chunks.iter() {
        for s in &code.steps {
            for (&v, g) in s.inputs.iter().zip(&s.grad_states) {
                if matches!(values[v as usize].role, Role::Parameter { .. }) {
                    made.entry(v).or_default().push(g.clone());
                }
            }
        }
    }
    for (&v, uses) in &made {
        let info = &mut values[v as usize];
        let shared = tied.iter().any(|t| t.value == v);
        let grad = Placement(
            info.placement
                .0
                .iter()
                .enumerate()
                .map(|(a, p)| {
                    if !shared && uses.iter().all(|u| u.0.get(a) == Some(&State::Partial)) {
                        State::Partial
                    } else {
                        p.clone()
                    }
                })
                .collect(),
        );
        info.grad_placement = Some(grad);
    }
    for code in chunks.iter_mut() {
        let mesh = layout.mesh(code.stage);
        for &p in &code.parameters {
            let info = &values[p as usize];
            if let Some(why) = info
                .state_placement
                .as_ref()
                .and_then(|sp| sp.misfit(&info.shape, &mesh))
            {
                return Err(err(format!(
                    "the optimizer states of `{}` {:?} cannot be placed so on stage {}'s mesh \
                     {mesh:?}: {why}",
                    info.name, info.shape, code.stage
                )));
            }
        }
        for s in &mut code.steps {
            for k in 0..s.inputs.len() {
                let info = &values[s.inputs[k] as usize];
                let (Some(target), Some(Some(_))) = (&info.grad_placement, s.grad_after.get(k))
                else {
                    continue;
                };
                s.grad_after[k] = Some(conversions(&s.grad_states[k], target, &mesh).ok_or_else(
                    || {
                        err(format!(
                            "`{}`: no collective takes the gradient of `{}` from {:?} to {:?}",
                            s.name, info.name, s.grad_states[k], target
                        ))
                    },
                )?);
            }
        }
    }
    Ok(())
}

fn check_layout(graph: &Graph, layout: &ExecLayout) -> Result<(), ExecError> {
    if layout.tp == 0
        || layout.cp == 0
        || layout.pp == 0
        || layout.dp == 0
        || layout.microbatches == 0
    {
        return Err(err("degrees and micro-batches must be at least 1"));
    }
    if layout.cp > 1 {
        check_context(graph, layout)?;
    }
    if !layout.meshes.is_empty() {
        let axes = layout.meshes[0].len();
        if layout.meshes.len() != layout.pp {
            return Err(err(format!(
                "{} stage meshes for {} pipeline stages",
                layout.meshes.len(),
                layout.pp
            )));
        }
        if let Some(m) = layout
            .meshes
            .iter()
            .find(|m| m.len() != axes || m.is_empty() || m.contains(&0))
        {
            return Err(err(format!(
                "stage mesh {m:?}: every stage's mesh needs the same number (>= 1) of axes, \
                 each of at least one device"
            )));
        }
    }
    if layout.chunks.len() != layout.pp {
        return Err(err(format!(
            "{} stages of chunks for {} pipeline stages",
            layout.chunks.len(),
            layout.pp
        )));
    }
    let v = layout.interleave();
    if v == 0 || layout.chunks.iter().any(|c| c.len() != v) {
        return Err(err(
            "every stage must hold the same number (>= 1) of chunks",
        ));
    }
    if v > 1 && layout.microbatches % layout.pp != 0 {
        return Err(err(format!(
            "interleaving needs the {} micro-batches to be a multiple of the {} stages",
            layout.microbatches, layout.pp
        )));
    }
    let mut next = 0;
    for c in 0..v {
        for j in 0..layout.pp {
            let (first, last) = layout.chunks[j][c];
            if first != next || last < first {
                return Err(err(format!(
                    "chunk {c} of stage {j} holds layers {first}..={last}; expected it to start at layer {next}"
                )));
            }
            next = last + 1;
        }
    }
    if next != graph.layers.len() {
        return Err(err(format!(
            "the chunks hold {next} layers, the model has {}",
            graph.layers.len()
        )));
    }
    Ok(())
}

/// Why `graph` cannot run with its sequences split over `layout.cp` ranks, if it cannot.
fn check_context(graph: &Graph, layout: &ExecLayout) -> Result<(), ExecError> {
    let cp = layout.cp;
    if !layout.placements.is_empty() || !layout.meshes.is_empty() {
        return Err(err(
            "context parallelism is a degree of Megatron-LM's layouts; an intra-op plan places \
             sequences on its own meshes",
        ));
    }
    let a2a = match layout.cp_comm {
        CpComm::A2a => cp,
        CpComm::A2aP2p => layout.cp_a2a,
        CpComm::P2p | CpComm::AllGather => 1,
    };
    if layout.cp_comm == CpComm::A2aP2p && (a2a == 0 || cp % a2a != 0) {
        return Err(err(format!(
            "cp_comm `a2a+p2p` groups the cp = {cp} ranks into all-to-all groups of {a2a}, \
             which does not divide them"
        )));
    }
    if graph.seq % (2 * cp as u64) != 0 {
        return Err(err(format!(
            "the sequence of {} tokens does not cut into 2 x cp = {} equal chunks (rank r \
             holds chunks r and 2cp-1-r)",
            graph.seq,
            2 * cp
        )));
    }
    let forward = graph.ops.iter().filter(|o| o.grad_of.is_none());
    for op in forward {
        match op.kind {
            OpKind::Softmax => {
                return Err(err(format!(
                    "`{}`: context parallelism splits a fused attention core; this model's \
                     attention is unfused (a softmax over the whole score matrix)",
                    op.name
                )));
            }
            OpKind::FlashAttention { .. } if a2a > 1 => {
                let ranks = (a2a * layout.tp) as u64;
                for &t in &op.inputs[..2] {
                    let heads = graph.tensor(t).shape.get(1).copied().unwrap_or(0);
                    if heads % ranks != 0 {
                        return Err(err(format!(
                            "`{}`: Ulysses (cp_comm {}) splits heads over tp x {a2a} = {ranks} \
                             ranks; `{}` has {heads}",
                            op.name,
                            layout.cp_comm.name(),
                            graph.tensor(t).name
                        )));
                    }
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// The actions of stage `j` for one training step.
fn stage_actions(j: usize, p: usize, v: usize, m: usize) -> Vec<Action> {
    let last = p * v - 1;
    let mut out = Vec::new();
    for s in stage_program(Schedule::OneFOneB, j, p, v, m) {
        let (chunk, microbatch) = (s.chunk * p + j, s.microbatch);
        match s.kind {
            BlockKind::Forward => {
                if chunk > 0 {
                    out.push(Action::RecvActivations { chunk, microbatch });
                }
                out.push(Action::Forward { chunk, microbatch });
                if chunk < last {
                    out.push(Action::SendActivations { chunk, microbatch });
                }
            }
            BlockKind::Backward => {
                if chunk < last {
                    out.push(Action::RecvGradients { chunk, microbatch });
                }
                out.push(Action::Backward { chunk, microbatch });
                if chunk > 0 {
                    out.push(Action::SendGradients { chunk, microbatch });
                }
            }
        }
    }
    out.extend([
        Action::SyncTied,
        Action::SyncGradients,
        Action::OptimizerStep,
    ]);
    out
}

/// Parts of the split axis of tensors feeding a fused consumer (the QKV slice, SwiGLU), pushed
/// back through the products that produce them.
fn split_parts(graph: &Graph) -> Vec<Option<Vec<usize>>> {
    let mut parts: Vec<Option<Vec<usize>>> = vec![None; graph.tensors.len()];
    let last = |t: TensorId| graph.tensor(t).shape.last().copied().unwrap_or(1) as usize;
    for op in graph.ops.iter().rev().filter(|o| o.grad_of.is_none()) {
        let Some(&x) = op.inputs.first() else {
            continue;
        };
        match op.kind {
            OpKind::Slice => {
                let rows = (graph.tensor(x).elements() / last(x).max(1) as u64).max(1);
                parts[x.0 as usize] = Some(
                    op.outputs
                        .iter()
                        .map(|&o| (graph.tensor(o).elements() / rows) as usize)
                        .collect(),
                );
            }
            OpKind::SwiGlu => {
                let f = last(x) / 2;
                parts[x.0 as usize] = Some(vec![f, f]);
            }
            // An expert's product (a grouped GEMM) passes them to its weights as a dense one.
            OpKind::MatMul { .. } | OpKind::BatchMatMul { .. } => {
                if let Some(p) = op.outputs.first().and_then(|y| parts[y.0 as usize].clone()) {
                    for &w in &op.inputs[1..] {
                        parts[w.0 as usize] = Some(p.clone());
                    }
                }
            }
            OpKind::Gelu | OpKind::Silu | OpKind::Dropout => {
                if let Some(p) = op.outputs.first().and_then(|y| parts[y.0 as usize].clone()) {
                    parts[x.0 as usize] = Some(p);
                }
            }
            _ => {}
        }
    }
    parts
}

fn input_bound(graph: &Graph, t: TensorId) -> Option<usize> {
    let mut bound: Option<usize> = None;
    for op in graph.ops.iter().filter(|o| o.grad_of.is_none()) {
        let b = match op.kind {
            OpKind::Embedding if op.inputs.first() == Some(&t) => {
                op.inputs.get(1).map(|&w| graph.tensor(w).shape[0] as usize)
            }
            OpKind::CrossEntropy if op.inputs.get(1) == Some(&t) => op
                .inputs
                .first()
                .and_then(|&l| graph.tensor(l).shape.last().map(|&v| v as usize)),
            _ => None,
        };
        if let Some(b) = b {
            bound = Some(bound.map_or(b, |x: usize| x.min(b)));
        }
    }
    bound
}

fn parameter_init(graph: &Graph, t: TensorId) -> Init {
    for op in graph.ops.iter().filter(|o| o.grad_of.is_none()) {
        match op.kind {
            OpKind::LayerNorm | OpKind::RmsNorm if op.inputs.get(1) == Some(&t) => {
                return Init::Gain;
            }
            OpKind::LayerNorm if op.inputs.get(2) == Some(&t) => return Init::Bias,
            OpKind::MatMul { .. } if op.inputs.get(2) == Some(&t) => return Init::Bias,
            _ => {}
        }
    }
    Init::Weight
}

/// A kernel with the states it reads and writes along one mesh axis.
struct Rule {
    kernel: Kernel,
    /// The kernel works with its group along this axis: a vocabulary split, a sequence split
    /// whose positions it reads, or keys and values passed or gathered over it.
    talks: bool,
    inputs: Vec<u32>,
    outputs: Vec<u32>,
    in_states: Vec<State>,
    out_states: Vec<State>,
    grad_states: Vec<State>,
}

/// A kernel with the placements it reads and writes on the whole mesh.
struct MeshRule {
    kernel: Kernel,
    kernel_axes: Vec<usize>,
    inputs: Vec<u32>,
    outputs: Vec<u32>,
    in_states: Vec<Placement>,
    out_states: Vec<Placement>,
    grad_states: Vec<Placement>,
}

/// Split along `axis` of a tensor of shape `shape`, in one part.
fn split_whole(axis: usize, shape: &[usize]) -> State {
    State::Split {
        axis,
        parts: vec![shape.get(axis).copied().unwrap_or(1)],
    }
}

/// The steps of forward op `oid` reading values `ins` on a stage of mesh `mesh`. Each mesh axis
/// derives the states its kernel reads and writes from the values' states on that axis, by the
/// same rules whether one axis (Megatron-LM's tensor-parallel group) or two; the kernel runs on
/// the pieces the axes leave each device, and the collectives between placements and states
/// run along each axis in its groups.
fn lower_op(
    graph: &Graph,
    oid: autopar_rules::model::graph::OpId,
    ins: &[u32],
    values: &mut Vec<ValueInfo>,
    mesh: &[usize],
    context: &Context,
) -> Result<Vec<Step>, ExecError> {
    let op = graph.op(oid);
    let outs: Vec<u32> = op.outputs.iter().map(|t| t.0).collect();
    // A dispatch also reads the gates its router wrote with the indices: past an expert's
    // capacity they choose the tokens kept.
    let with_gates;
    let ins = if matches!(op.kind, OpKind::MoeDispatch) {
        let gates = graph
            .ops
            .iter()
            .find(|o| {
                o.grad_of.is_none()
                    && matches!(o.kind, OpKind::MoeRouter)
                    && o.outputs.get(1) == op.inputs.get(1)
            })
            .and_then(|o| o.outputs.first())
            .ok_or_else(|| {
                err(format!(
                    "`{}`: no router wrote the expert indices it dispatches by",
                    op.name
                ))
            })?;
        with_gates = [ins, &[gates.0]].concat();
        &with_gates[..]
    } else {
        ins
    };
    if matches!(op.kind, OpKind::FlashAttention { .. }) {
        token_major(&mut values[outs[0] as usize]);
    }
    // A bias is added after the product's reduction when any mesh axis splits the contraction.
    let bias_target = match op.kind {
        OpKind::MatMul { transpose_b } if ins.len() == 3 => {
            let n_axis = if transpose_b { 0 } else { 1 };
            let row = values[ins[1] as usize]
                .placement
                .0
                .iter()
                .any(|s| s.axis().is_some_and(|a| a != n_axis));
            row.then(|| {
                values.push(ValueInfo {
                    name: format!("{}.partial", values[outs[0] as usize].name),
                    ..values[outs[0] as usize].clone()
                });
                (values.len() - 1) as u32
            })
        }
        _ => None,
    };
    let per_axis = (0..mesh.len())
        .map(|a| {
            let on = AxisContext {
                zigzag: context.zigzag,
                comm: context.comm_on(a),
                moe_drop: context.moe_drop,
            };
            axis_rules(
                graph,
                oid,
                ins,
                &outs,
                values,
                (a, mesh[a]),
                on,
                bias_target,
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    merge(&op.name, per_axis)?
        .into_iter()
        .map(|r| finish(op.name.as_str(), r, values, mesh))
        .collect()
}

/// FlashAttention writes its output token-major, `[b, s, heads, d]`: the output projection
/// reads it as rows of `heads * d`. The graph's `[b, heads, s, d]` and its placement follow.
fn token_major(out: &mut ValueInfo) {
    if out.shape.len() != 4 {
        return;
    }
    out.shape.swap(1, 2);
    for s in &mut out.placement.0 {
        if let State::Split { axis, .. } = s
            && (*axis == 1 || *axis == 2)
        {
            *axis = 3 - *axis;
        }
    }
}

/// What one mesh axis's rules know of context parallelism: the order sequences are stored in,
/// and, on the axis splitting them, how its ranks exchange keys and values.
#[derive(Clone, Copy, Debug)]
struct AxisContext {
    zigzag: usize,
    comm: Option<CpComm>,
    /// Tokens past an expert's capacity are dropped.
    moe_drop: bool,
}

/// One mesh axis's rules for an op, the axis given with its devices (`bias_target`: the value
/// a product writes before its bias is added, when another axis reduces the product first).
#[allow(clippy::too_many_arguments)]
fn axis_rules(
    graph: &Graph,
    oid: autopar_rules::model::graph::OpId,
    ins: &[u32],
    outs: &[u32],
    values: &[ValueInfo],
    (axis, mesh_size): (usize, usize),
    context: AxisContext,
    bias_target: Option<u32>,
) -> Result<Vec<Rule>, ExecError> {
    let op = graph.op(oid);
    let outs = outs.to_vec();
    let p = |v: u32, values: &[ValueInfo]| values[v as usize].placement.0[axis].clone();
    let rank_of = |v: u32, values: &[ValueInfo]| values[v as usize].shape.len();
    let rep = State::Replicated;
    let keep_unless = |s: State, bad: &dyn Fn(usize) -> bool| match s.axis() {
        Some(a) if bad(a) => State::Replicated,
        _ => s,
    };
    let partial_if_split = |s: &State| {
        if s.axis().is_some() {
            State::Partial
        } else {
            State::Replicated
        }
    };
    let mut rules = Vec::new();
    match op.kind {
        OpKind::MatMul { transpose_b } => {
            let (x, w) = (ins[0], ins[1]);
            let n_axis = if transpose_b { 0 } else { 1 };
            let ry = rank_of(outs[0], values);
            let rx = rank_of(x, values);
            let has_bias = ins.len() == 3;
            let (reads, grads, out, fused_bias) = match p(w, values) {
                State::Split { axis, parts } if axis == n_axis => {
                    // Column-parallel: the bias is split with the output.
                    let sb = has_bias.then(|| p(ins[2], values));
                    (
                        [rep.clone(), p(w, values)],
                        [State::Partial, p(w, values)],
                        State::Split {
                            axis: ry - 1,
                            parts,
                        },
                        sb.map(|b| [b.clone(), b]),
                    )
                }
                State::Split { parts, .. } => {
                    // Row-parallel: partial sums, reduced into the output's placement; the bias
                    // is added once, after the reduction. An operand whose trailing axes make
                    // up the contraction (`[b, s, heads, d]`) split on its first such axis
                    // already holds the right contiguous block of it.
                    let k: usize = parts.iter().sum();
                    let x_state = match p(x, values) {
                        State::Split { axis, parts: xp }
                            if xp.len() == 1
                                && parts.len() == 1
                                && values[x as usize].shape[axis..].iter().product::<usize>()
                                    == k =>
                        {
                            State::Split { axis, parts: xp }
                        }
                        _ => State::Split {
                            axis: rx - 1,
                            parts,
                        },
                    };
                    (
                        [x_state.clone(), p(w, values)],
                        [x_state, p(w, values)],
                        State::Partial,
                        None,
                    )
                }
                _ => {
                    // A split of the operand's leading (row) axes carries to the result; one
                    // of the contraction (`[b, s, heads, d]`: its last two axes) is gathered.
                    let sx = keep_unless(p(x, values), &|a| a + 1 >= ry);
                    let wg = partial_if_split(&sx);
                    (
                        [sx.clone(), rep.clone()],
                        [sx.clone(), wg.clone()],
                        sx,
                        has_bias.then(|| [rep.clone(), wg]),
                    )
                }
            };
            match bias_target {
                // Some mesh axis reduces the product first: the bias is added after.
                Some(target) => {
                    rules.push(matmul_rule(
                        &[x, w],
                        &[target],
                        transpose_b,
                        reads,
                        grads,
                        None,
                        out,
                    ));
                    rules.push(bias_rule(target, ins[2], outs[0], p(outs[0], values), ry));
                }
                None => rules.push(matmul_rule(
                    ins,
                    &outs,
                    transpose_b,
                    reads,
                    grads,
                    fused_bias,
                    out,
                )),
            }
        }
        OpKind::BatchMatMul { transpose_b } => {
            let states: Vec<State> = [ins[0], ins[1], outs[0]]
                .iter()
                .map(|&v| p(v, values))
                .collect();
            let r = rank_of(outs[0], values);
            let rb = rank_of(ins[1], values);
            let shared = states[0]
                .axis()
                .filter(|&a| a + 2 < r && states.iter().all(|s| s.axis() == Some(a)));
            // Besides a split of the leading (batch, heads, experts) axes, an expert's grouped
            // GEMM splits its width as a dense product does (expert tensor parallelism):
            // column-parallel on `b`'s last axis, row-parallel on its contraction.
            let (n_axis, k_axis) = if transpose_b {
                (rb - 2, rb - 1)
            } else {
                (rb - 1, rb - 2)
            };
            let (reads, grads, out) = match (&states[0], &states[1]) {
                _ if shared.is_some() => (
                    [states[0].clone(), states[1].clone()],
                    [states[0].clone(), states[1].clone()],
                    states[2].clone(),
                ),
                (State::Replicated, State::Split { axis, parts }) if *axis == n_axis => (
                    [rep.clone(), states[1].clone()],
                    [State::Partial, states[1].clone()],
                    State::Split {
                        axis: r - 1,
                        parts: parts.clone(),
                    },
                ),
                (State::Split { axis: a, .. }, State::Split { axis, .. })
                    if *a + 1 == r && *axis == k_axis =>
                {
                    (
                        [states[0].clone(), states[1].clone()],
                        [states[0].clone(), states[1].clone()],
                        State::Partial,
                    )
                }
                _ => (
                    [rep.clone(), rep.clone()],
                    [rep.clone(), rep.clone()],
                    rep.clone(),
                ),
            };
            rules.push(Rule {
                talks: false,
                kernel: Kernel::BatchMatMul { transpose_b },
                inputs: ins.to_vec(),
                outputs: outs.clone(),
                in_states: reads.to_vec(),
                out_states: vec![out],
                grad_states: grads.to_vec(),
            });
        }
        OpKind::FlashAttention { .. } => {
            // Heads or batch split alike on q, k, v and the output (written token-major,
            // `[b, s, heads, d]`: its heads are axis 2); on the context-parallel axis, the
            // sequence (axis 2 of q, k, v; 1 of the output) split as the comm type says.
            let states: Vec<State> = [ins[0], ins[1], ins[2]]
                .iter()
                .map(|&v| p(v, values))
                .collect();
            let out = p(outs[0], values);
            let r = rank_of(ins[0], values);
            let whole = |v: u32, a: usize| split_whole(a, &values[v as usize].shape);
            let comm = context
                .comm
                .filter(|_| states[0].axis() == Some(r - 2) && out.axis() == Some(1));
            let (ss, so, gs, keys) = match comm {
                Some(CpComm::P2p) => (states.clone(), out, states, Keys::Ring),
                Some(CpComm::AllGather) => (
                    vec![states[0].clone(), rep.clone(), rep.clone()],
                    out,
                    vec![states[0].clone(), State::Partial, State::Partial],
                    Keys::Gathered,
                ),
                Some(CpComm::A2a) => {
                    // Ulysses: the all-to-alls into and out of a heads split are conversions.
                    let heads: Vec<State> = ins[..3].iter().map(|&v| whole(v, 1)).collect();
                    (heads.clone(), whole(outs[0], 2), heads, Keys::Whole)
                }
                // Each axis is one level: `Context::of` never asks an axis for both.
                Some(CpComm::A2aP2p) | None => {
                    let shared = states[0].axis().filter(|&a| {
                        a + 2 < r
                            && states.iter().all(|s| s.axis() == Some(a))
                            && out.axis() == Some(if a == 1 { 2 } else { a })
                    });
                    if shared.is_some() {
                        (states.clone(), out, states, Keys::Whole)
                    } else {
                        (
                            vec![rep.clone(); 3],
                            rep.clone(),
                            vec![rep.clone(); 3],
                            Keys::Whole,
                        )
                    }
                }
            };
            let d = values[ins[0] as usize].shape.last().copied().unwrap_or(1);
            rules.push(Rule {
                talks: matches!(keys, Keys::Ring | Keys::Gathered),
                kernel: Kernel::Attention {
                    scale: 1.0 / (d as f32).sqrt(),
                    zigzag: context.zigzag,
                    keys,
                },
                inputs: ins.to_vec(),
                outputs: outs.clone(),
                in_states: ss,
                out_states: vec![so],
                grad_states: gs,
            });
        }
        OpKind::LayerNorm | OpKind::RmsNorm => {
            let r = rank_of(ins[0], values);
            let sx = keep_unless(p(ins[0], values), &|a| a + 1 == r);
            let pg = partial_if_split(&sx);
            let n = ins.len();
            let mut in_states = vec![sx.clone()];
            let mut grad_states = vec![sx.clone()];
            in_states.extend(std::iter::repeat_n(rep.clone(), n - 1));
            grad_states.extend(std::iter::repeat_n(pg, n - 1));
            rules.push(Rule {
                talks: false,
                kernel: if matches!(op.kind, OpKind::LayerNorm) {
                    Kernel::LayerNorm
                } else {
                    Kernel::RmsNorm
                },
                inputs: ins.to_vec(),
                outputs: outs.clone(),
                in_states,
                out_states: vec![sx],
                grad_states,
            });
        }
        OpKind::Softmax => {
            let r = rank_of(ins[0], values);
            let s = keep_unless(p(ins[0], values), &|a| a + 2 >= r);
            let kernel = Kernel::Softmax {
                scale: softmax_scale(graph, op.inputs[0].0),
            };
            rules.push(unary(kernel, ins[0], outs[0], s));
        }
        OpKind::Rope => {
            // A split of the sequence (axis -2) stays: the kernel reads its rank's positions.
            let r = rank_of(ins[0], values);
            let s = keep_unless(p(ins[0], values), &|a| a + 1 == r);
            let kernel = Kernel::Rope {
                zigzag: context.zigzag,
            };
            let talks = s.axis() == Some(r - 2);
            rules.push(Rule {
                talks,
                ..unary(kernel, ins[0], outs[0], s)
            });
        }
        OpKind::Gelu | OpKind::Silu | OpKind::Dropout => {
            let kernel = match op.kind {
                OpKind::Gelu => Kernel::Gelu,
                OpKind::Silu => Kernel::Silu,
                _ => Kernel::Identity,
            };
            rules.push(unary(kernel, ins[0], outs[0], p(ins[0], values)));
        }
        OpKind::SwiGlu => {
            let sx = p(ins[0], values);
            let r = rank_of(ins[0], values);
            let (sx, sy) = match &sx {
                State::Split { axis, parts } if axis + 1 == r => {
                    if parts.len() != 2 {
                        return Err(err(format!(
                            "`{}`: SwiGLU input split without its two halves",
                            op.name
                        )));
                    }
                    (
                        sx.clone(),
                        State::Split {
                            axis: *axis,
                            parts: vec![parts[0]],
                        },
                    )
                }
                _ => (sx.clone(), sx),
            };
            rules.push(Rule {
                talks: false,
                kernel: Kernel::SwiGlu,
                inputs: ins.to_vec(),
                outputs: outs.clone(),
                in_states: vec![sx.clone()],
                out_states: vec![sy],
                grad_states: vec![sx],
            });
        }
        OpKind::Add | OpKind::Mul | OpKind::DropoutAdd => {
            let s = p(outs[0], values);
            rules.push(Rule {
                talks: false,
                kernel: if matches!(op.kind, OpKind::Mul) {
                    Kernel::Mul
                } else {
                    Kernel::Add
                },
                inputs: ins.to_vec(),
                outputs: outs.clone(),
                in_states: vec![s.clone(), s.clone()],
                out_states: vec![s.clone()],
                grad_states: vec![s.clone(), s],
            });
        }
        OpKind::Embedding => {
            // A table split by rows (vocabulary-parallel: partial rows, summed) or by columns
            // (each rank looks up its columns); a replicated table looks up the ids as they
            // are split (the batch or the sequence), and its gradient is then a partial sum.
            let (ids, table) = (ins[0], ins[1]);
            let st = p(table, values);
            let ro = rank_of(outs[0], values);
            let parallel = matches!(st, State::Split { axis: 0, .. });
            let (sids, st, so, gt) = match &st {
                State::Split { axis: 0, .. } => (rep.clone(), st.clone(), State::Partial, st),
                State::Split { axis: 1, .. } => (
                    rep.clone(),
                    st.clone(),
                    split_whole(ro - 1, &values[outs[0] as usize].shape),
                    st,
                ),
                _ => {
                    let sids = p(ids, values);
                    let gt = partial_if_split(&sids);
                    let so = match sids.axis() {
                        Some(a) => split_whole(a, &values[outs[0] as usize].shape),
                        None => rep.clone(),
                    };
                    (sids, rep.clone(), so, gt)
                }
            };
            rules.push(Rule {
                talks: parallel,
                kernel: Kernel::Embedding {
                    vocab_parallel: parallel,
                },
                inputs: ins.to_vec(),
                outputs: outs.clone(),
                in_states: vec![sids.clone(), st],
                out_states: vec![so],
                grad_states: vec![sids, gt],
            });
        }
        OpKind::CrossEntropy => {
            // The vocabulary split (statistics reduced in the kernel), or the rows split with
            // their labels (each device writes its share of the mean, a partial sum).
            let r = rank_of(ins[0], values);
            let sl = p(ins[0], values);
            let parallel =
                matches!(&sl, State::Split { axis, parts } if axis + 1 == r && parts.len() == 1);
            let row = sl
                .axis()
                .filter(|&a| a + 1 < r && a < rank_of(ins[1], values) && !parallel);
            let (sl, slab, so) = match row {
                Some(a) => (
                    sl,
                    split_whole(a, &values[ins[1] as usize].shape),
                    State::Partial,
                ),
                None if parallel => (sl, rep.clone(), rep.clone()),
                None => (rep.clone(), rep.clone(), rep.clone()),
            };
            rules.push(Rule {
                talks: parallel,
                kernel: Kernel::CrossEntropy {
                    vocab_parallel: parallel,
                    row_parts: if row.is_some() { mesh_size } else { 1 },
                },
                inputs: ins.to_vec(),
                outputs: outs.clone(),
                in_states: vec![sl.clone(), slab],
                out_states: vec![so],
                grad_states: vec![sl, rep.clone()],
            });
        }
        OpKind::Slice => {
            let rx = rank_of(ins[0], values);
            let x_shape = values[ins[0] as usize].shape.clone();
            let rows: usize = x_shape[..rx.saturating_sub(1)]
                .iter()
                .product::<usize>()
                .max(1);
            let widths: Vec<usize> = outs
                .iter()
                .map(|&o| values[o as usize].shape.iter().product::<usize>() / rows)
                .collect();
            for &o in &outs {
                let s = &values[o as usize].shape;
                let ok = if s.len() == rx {
                    s[..rx - 1] == x_shape[..rx - 1]
                } else {
                    s.len() == rx + 1 && rx >= 2 && s[0] == x_shape[0] && s[2] == x_shape[1]
                };
                if !ok {
                    return Err(err(format!(
                        "`{}`: the executor runs slices of the last axis (optionally viewed as [b, heads, s, d]); output {:?} of input {:?} is neither",
                        op.name, s, x_shape
                    )));
                }
            }
            let sx = p(ins[0], values);
            let split =
                matches!(&sx, State::Split { axis, parts } if axis + 1 == rx && *parts == widths);
            let leading = sx.axis().filter(|&a| a + 1 < rx);
            let (sx, souts) = if let Some(a) = leading {
                // A split of a row axis (the batch, the sequence) carries to every part; the
                // sequence moves one axis on where `[b, s, n*d]` is viewed as `[b, n, s, d]`.
                let souts = outs
                    .iter()
                    .map(|&o| {
                        let s = &values[o as usize].shape;
                        let at = if s.len() == rx + 1 && a >= 1 {
                            a + 1
                        } else {
                            a
                        };
                        split_whole(at, s)
                    })
                    .collect();
                (sx, souts)
            } else if split {
                let souts = outs
                    .iter()
                    .zip(&widths)
                    .map(|(&o, &w)| {
                        let s = &values[o as usize].shape;
                        if s.len() == rx + 1 {
                            State::Split {
                                axis: 1,
                                parts: vec![s[1]],
                            }
                        } else {
                            State::Split {
                                axis: rx - 1,
                                parts: vec![w],
                            }
                        }
                    })
                    .collect();
                (sx, souts)
            } else {
                (rep.clone(), vec![rep.clone(); outs.len()])
            };
            rules.push(Rule {
                talks: false,
                kernel: Kernel::Slice { parts: widths },
                inputs: ins.to_vec(),
                outputs: outs.clone(),
                in_states: vec![sx.clone()],
                out_states: souts,
                grad_states: vec![sx],
            });
        }
        OpKind::Transpose => {
            let (a, b) = transpose_axes(graph, op.inputs[0].0, outs[0]).ok_or_else(|| {
                err(format!(
                    "`{}`: cannot tell which two axes the transpose swaps",
                    op.name
                ))
            })?;
            let sx = p(ins[0], values);
            let sy = match &sx {
                State::Split { axis, parts } => State::Split {
                    axis: if *axis == a {
                        b
                    } else if *axis == b {
                        a
                    } else {
                        *axis
                    },
                    parts: parts.clone(),
                },
                s => s.clone(),
            };
            rules.push(Rule {
                talks: false,
                kernel: Kernel::Transpose { a, b },
                inputs: ins.to_vec(),
                outputs: outs.clone(),
                in_states: vec![sx.clone()],
                out_states: vec![sy],
                grad_states: vec![sx],
            });
        }
        OpKind::EmbeddingGrad => {
            return Err(err(format!(
                "`{}`: a backward op in a forward layer",
                op.name
            )));
        }
        OpKind::MoeRouter => {
            // Each token's choice is its own: a split of the rows (batch, sequence) carries.
            let r = rank_of(ins[0], values);
            let s = keep_unless(p(ins[0], values), &|a| a + 1 == r);
            let outs_states = outs
                .iter()
                .map(|&o| match s.axis() {
                    Some(a) => split_whole(a, &values[o as usize].shape),
                    None => rep.clone(),
                })
                .collect();
            rules.push(Rule {
                talks: false,
                kernel: Kernel::MoeRouter,
                inputs: ins.to_vec(),
                outputs: outs.clone(),
                in_states: vec![s.clone()],
                out_states: outs_states,
                grad_states: vec![s],
            });
        }
        OpKind::MoeDispatch | OpKind::MoeCombine => {
            // Every rank routes every token of its group (Megatron-Core's all-gather token
            // dispatcher): the tokens and the router's choices are gathered, each expert's
            // buffer is filled whole and then kept where the expert lives (a slice), and the
            // combined tokens are cut back to each rank's rows.
            let dispatch = matches!(op.kind, OpKind::MoeDispatch);
            rules.push(Rule {
                talks: false,
                kernel: if dispatch {
                    Kernel::MoeDispatch {
                        drop: context.moe_drop,
                    }
                } else {
                    Kernel::MoeCombine {
                        drop: context.moe_drop,
                    }
                },
                inputs: ins.to_vec(),
                outputs: outs.clone(),
                in_states: vec![rep.clone(); ins.len()],
                out_states: vec![rep.clone()],
                grad_states: vec![rep.clone(); ins.len()],
            });
        }
        OpKind::Concat | OpKind::Opaque { .. } => {
            return Err(unsupported(op));
        }
    }
    Ok(rules)
}

/// The rules of every mesh axis as one: the same kernels on the same values, each operand and
/// result placed by its state on every axis; a kernel works with its group along the axes
/// whose rule [`Rule::talks`].
fn merge(name: &str, per_axis: Vec<Vec<Rule>>) -> Result<Vec<MeshRule>, ExecError> {
    let mut axes = per_axis.into_iter();
    let Some(first) = axes.next() else {
        return Err(err(format!("`{name}`: a mesh of no axes")));
    };
    let mut out: Vec<MeshRule> = first
        .into_iter()
        .map(|r| MeshRule {
            kernel_axes: if r.talks { vec![0] } else { vec![] },
            kernel: r.kernel,
            inputs: r.inputs,
            outputs: r.outputs,
            in_states: r
                .in_states
                .into_iter()
                .map(|s| Placement(vec![s]))
                .collect(),
            out_states: r
                .out_states
                .into_iter()
                .map(|s| Placement(vec![s]))
                .collect(),
            grad_states: r
                .grad_states
                .into_iter()
                .map(|s| Placement(vec![s]))
                .collect(),
        })
        .collect();
    for (a, rules) in axes.enumerate().map(|(i, r)| (i + 1, r)) {
        let same = rules.len() == out.len()
            && rules.iter().zip(&out).all(|(r, m)| {
                std::mem::discriminant(&r.kernel) == std::mem::discriminant(&m.kernel)
                    && r.inputs == m.inputs
                    && r.outputs == m.outputs
            });
        if !same {
            return Err(err(format!(
                "`{name}`: its placements on mesh axes 0 and {a} call for different kernels"
            )));
        }
        for (r, m) in rules.into_iter().zip(&mut out) {
            match (&mut m.kernel, &r.kernel) {
                (
                    Kernel::CrossEntropy {
                        vocab_parallel,
                        row_parts,
                    },
                    Kernel::CrossEntropy {
                        vocab_parallel: here,
                        row_parts: parts,
                    },
                ) => {
                    *vocab_parallel |= here;
                    *row_parts *= parts;
                }
                (
                    Kernel::Embedding { vocab_parallel },
                    Kernel::Embedding {
                        vocab_parallel: here,
                    },
                ) => *vocab_parallel |= here,
                // The context-parallel axis decides where keys and values come from.
                (Kernel::Attention { keys, .. }, Kernel::Attention { keys: here, .. })
                    if *here != Keys::Whole =>
                {
                    *keys = *here
                }
                _ => {}
            }
            if r.talks {
                m.kernel_axes.push(a);
            }
            let push = |to: &mut Vec<Placement>, from: Vec<State>| {
                for (p, s) in to.iter_mut().zip(from) {
                    p.0.push(s);
                }
            };
            push(&mut m.in_states, r.in_states);
            push(&mut m.out_states, r.out_states);
            push(&mut m.grad_states, r.grad_states);
        }
    }
    Ok(out)
}

/// A product `x · w (+ bias)` reading `x, w` in `reads` (bias: `bias[0]`), writing `out`, with
/// gradients in `grads` (bias: `bias[1]`).
fn matmul_rule(
    ins: &[u32],
    outs: &[u32],
    transpose_b: bool,
    reads: [State; 2],
    grads: [State; 2],
    bias: Option<[State; 2]>,
    out: State,
) -> Rule {
    let mut in_states = reads.to_vec();
    let mut grad_states = grads.to_vec();
    if let Some([read, grad]) = bias.clone() {
        in_states.push(read);
        grad_states.push(grad);
    }
    Rule {
        talks: false,
        kernel: Kernel::MatMul {
            transpose_b,
            bias: bias.is_some(),
        },
        inputs: ins.to_vec(),
        outputs: outs.to_vec(),
        in_states,
        out_states: vec![out],
        grad_states,
    }
}

fn unary(kernel: Kernel, x: u32, y: u32, s: State) -> Rule {
    Rule {
        talks: false,
        kernel,
        inputs: vec![x],
        outputs: vec![y],
        in_states: vec![s.clone()],
        out_states: vec![s.clone()],
        grad_states: vec![s],
    }
}

/// `y = reduced product + bias`, in `y`'s state `s`: a bias split with the output's last axis
/// (a column split on this axis), or replicated, its gradient a partial sum over the rows that
/// the axis splits.
fn bias_rule(x: u32, bias: u32, y: u32, s: State, rank: usize) -> Rule {
    let (read, grad) = match &s {
        // The output's last axis is the only one a bias broadcasts along.
        State::Split { axis, parts } if *axis + 1 == rank => (
            State::Split {
                axis: 0,
                parts: parts.clone(),
            },
            State::Split {
                axis: 0,
                parts: parts.clone(),
            },
        ),
        State::Split { .. } => (State::Replicated, State::Partial),
        _ => (State::Replicated, State::Replicated),
    };
    Rule {
        talks: false,
        kernel: Kernel::BiasAdd,
        inputs: vec![x, bias],
        outputs: vec![y],
        in_states: vec![s.clone(), read],
        out_states: vec![s.clone()],
        grad_states: vec![s, grad],
    }
}

/// The softmax scale: `1/sqrt(d)` when the scores come from a product over head width `d`.
fn softmax_scale(graph: &Graph, x: u32) -> f32 {
    graph
        .ops
        .iter()
        .find(|o| o.grad_of.is_none() && o.outputs.contains(&TensorId(x)))
        .filter(|o| matches!(o.kind, OpKind::BatchMatMul { .. }))
        .and_then(|o| o.inputs.first())
        .and_then(|&a| graph.tensor(a).shape.last())
        .map_or(1.0, |&d| 1.0 / (d as f32).sqrt())
}

/// The two axes a transpose swaps: where the split axes of input and output differ, else the
/// only swap that maps the input shape to the output's.
fn transpose_axes(graph: &Graph, x: u32, y: u32) -> Option<(usize, usize)> {
    let (tx, ty) = (graph.tensor(TensorId(x)), graph.tensor(TensorId(y)));
    let swapped = |a: usize, b: usize| {
        let mut s = tx.shape.clone();
        s.swap(a, b);
        s == ty.shape
    };
    if let (Split::Model(a), Split::Model(b)) = (tx.split, ty.split)
        && a != b
        && swapped(a as usize, b as usize)
    {
        return Some((a.min(b) as usize, a.max(b) as usize));
    }
    let r = tx.shape.len();
    let swaps: Vec<(usize, usize)> = (0..r)
        .flat_map(|a| (a + 1..r).map(move |b| (a, b)))
        .filter(|&(a, b)| tx.shape[a] != tx.shape[b] && swapped(a, b))
        .collect();
    (swaps.len() == 1).then(|| swaps[0])
}

/// A step from the placements its kernel reads and writes: the collectives from each
/// operand's placement to what the kernel reads, from what it writes to each result's
/// placement, and the same for the gradients.
fn finish(
    name: &str,
    r: MeshRule,
    values: &[ValueInfo],
    mesh: &[usize],
) -> Result<Step, ExecError> {
    let fits = |v: u32, p: &Placement| {
        let info = &values[v as usize];
        match p.misfit(&info.shape, mesh) {
            Some(why) => Err(err(format!(
                "`{name}`: `{}` {:?} cannot be placed {} on a {} mesh: {why}",
                info.name,
                info.shape,
                p,
                mesh.iter()
                    .map(usize::to_string)
                    .collect::<Vec<_>>()
                    .join("x")
            ))),
            None => Ok(()),
        }
    };
    let conv = |from: &Placement, to: &Placement, what: &str| {
        conversions(from, to, mesh).ok_or_else(|| {
            err(format!(
                "`{name}`: no collective takes {what} from {from} to {to}"
            ))
        })
    };
    let mut before = Vec::new();
    for (&v, s) in r.inputs.iter().zip(&r.in_states) {
        fits(v, &values[v as usize].placement)?;
        fits(v, s)?;
        before.push(conv(&values[v as usize].placement, s, "an operand")?);
    }
    let mut after = Vec::new();
    let mut grad_before = Vec::new();
    for (&v, s) in r.outputs.iter().zip(&r.out_states) {
        let placement = &values[v as usize].placement;
        fits(v, placement)?;
        fits(v, s)?;
        after.push(conv(s, placement, "a result")?);
        // The gradient of a partial sum is the gradient of the sum, on every rank.
        grad_before.push(conv(placement, &s.completed(), "a result's gradient")?);
    }
    let mut grad_after = Vec::new();
    for (&v, s) in r.inputs.iter().zip(&r.grad_states) {
        let info = &values[v as usize];
        let flows = match info.role {
            Role::Input { .. } => false,
            Role::Parameter { .. } => true,
            Role::Activation { requires_grad } => requires_grad,
        };
        grad_after.push(if flows {
            fits(v, s)?;
            Some(conv(s, &info.placement, "an operand's gradient")?)
        } else {
            None
        });
    }
    Ok(Step {
        name: name.to_string(),
        kernel: r.kernel,
        inputs: r.inputs,
        outputs: r.outputs,
        before,
        after,
        grad_before,
        grad_after,
        out_states: r.out_states,
        grad_states: r.grad_states,
        kernel_axes: r.kernel_axes,
    })
}
