//! Lowering: a model graph and a parallel layout become the programs the devices run.
//!
//! Every tensor gets a placement inside its tensor-parallel group (Megatron-LM's scheme, as the
//! graph's [`Split`]s state it). Every forward op becomes one or two [`Step`]s: the state each
//! operand must be in (with the collectives that bring it there), the kernel, the state its
//! outputs come out in (and the collectives to their placements), and the same for the
//! backward. Megatron's `f`/`g` operators, sequence-parallel gathers and scatters and the
//! vocabulary-parallel loss all follow from these rules rather than being special-cased.
//! Layers are then grouped into the plan's chunks (virtual pipeline stages), and every stage
//! gets its list of [`Action`]s in the order of the 1F1B or interleaved 1F1B schedule.

use super::ExecError;
use super::kernels::Kernel;
use super::placement::{Conversion, State, conversions, divides};
use autopar_rules::model::graph::{Graph, OpKind, Split, TensorId, TensorKind};
use autopar_rules::solve::schedule::{BlockKind, Schedule, stage_program};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// Version of the lowered program layout (part of its cache key).
pub const PROGRAM_VERSION: u32 = 2;

/// The parallel layout a program is lowered for.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ExecLayout {
    /// Tensor-parallel degree.
    pub tp: usize,
    /// Pipeline stages.
    pub pp: usize,
    /// Data-parallel degree.
    pub dp: usize,
    /// Sequence parallelism in the tensor-parallel group.
    pub sequence_parallel: bool,
    /// ZeRO stage: 0 all-reduces gradients; 1 and above reduce-scatter them, update a shard of
    /// the parameters and all-gather them.
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
    /// Placements an intra-op plan chose, by tensor name, in the tensor-parallel group (there
    /// every device of a stage's logical mesh); a tensor it does not name is replicated. Empty:
    /// Megatron-LM's placements, from the graph's splits. Either way the same rules derive
    /// every kernel's states and the collectives between them.
    #[serde(default)]
    pub placements: BTreeMap<String, State>,
}

impl ExecLayout {
    /// One device running every layer: the reference a sharded run is compared with.
    pub fn single(layers: usize, microbatches: usize) -> ExecLayout {
        ExecLayout {
            tp: 1,
            pp: 1,
            dp: 1,
            sequence_parallel: false,
            zero: 0,
            microbatches,
            chunks: vec![vec![(0, layers.saturating_sub(1))]],
            grad_accumulation_fusion: true,
            placements: BTreeMap::new(),
        }
    }

    /// Chunks per stage.
    pub fn interleave(&self) -> usize {
        self.chunks.first().map_or(0, Vec::len)
    }

    /// Virtual devices.
    pub fn devices(&self) -> usize {
        self.tp * self.pp * self.dp
    }

    /// One-line description, e.g. `dp2 tp2 pp2 v2 sp zero1 m4`, or `mesh8 pp2 m4 (plan's
    /// placements)` when an intra-op plan placed the tensors.
    pub fn describe(&self) -> String {
        if !self.placements.is_empty() {
            return format!(
                "mesh{} pp{} m{} (plan's placements)",
                self.tp, self.pp, self.microbatches
            );
        }
        format!(
            "dp{} tp{} pp{} v{}{}{} m{}",
            self.dp,
            self.tp,
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
    /// Where it lives in the tensor-parallel group between steps.
    pub placement: State,
    /// Role.
    pub role: Role,
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
    /// States the kernel writes its results in (their local shapes follow from them).
    pub out_states: Vec<State>,
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
    /// Activations received from the previous virtual stage (sent back as gradients).
    pub recv: Vec<u32>,
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
            let lists = step
                .before
                .iter()
                .chain(&step.after)
                .chain(&step.grad_before)
                .chain(step.grad_after.iter().flatten());
            for c in lists.flatten().filter(|c| c.communicates()) {
                *out.entry(c.name()).or_insert(0) += 1;
            }
        }
        out
    }
}

fn err(message: impl Into<String>) -> ExecError {
    ExecError::Lower(message.into())
}

/// Lowers `graph` for `layout`.
pub fn lower(graph: &Graph, layout: &ExecLayout) -> Result<Program, ExecError> {
    check_layout(graph, layout)?;
    let tp = layout.tp;
    let parts = split_parts(graph);
    let mut values: Vec<ValueInfo> = Vec::with_capacity(graph.tensors.len());
    for (i, t) in graph.tensors.iter().enumerate() {
        let shape: Vec<usize> = t.shape.iter().map(|&d| d as usize).collect();
        let placement = if tp == 1 {
            State::Replicated
        } else if !layout.placements.is_empty() {
            match layout.placements.get(&t.name) {
                // A split of a fused axis divides each of its parts (whole heads of q, k, v).
                Some(State::Split { axis, .. }) => State::Split {
                    axis: *axis,
                    parts: parts[i]
                        .clone()
                        .filter(|_| *axis + 1 == shape.len())
                        .unwrap_or_else(|| vec![shape.get(*axis).copied().unwrap_or(1)]),
                },
                Some(State::Partial) => {
                    return Err(err(format!(
                        "`{}` is placed as a partial sum between ops; a placement is \
                         replicated or split",
                        t.name
                    )));
                }
                Some(State::Replicated) | None => State::Replicated,
            }
        } else {
            match t.split {
                Split::None => State::Replicated,
                Split::Model(a) => State::Split {
                    axis: a as usize,
                    parts: parts[i]
                        .clone()
                        .unwrap_or_else(|| vec![shape.get(a as usize).copied().unwrap_or(1)]),
                },
                Split::Sequence(a) if layout.sequence_parallel => {
                    State::split(a as usize, &t.shape)
                }
                Split::Sequence(_) => State::Replicated,
            }
        };
        if let State::Split { axis, .. } = &placement
            && (*axis >= shape.len() || !divides(&placement, tp))
        {
            return Err(err(format!(
                "`{}` {:?} cannot be split {tp} ways along axis {axis}",
                t.name, t.shape
            )));
        }
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
        values.push(ValueInfo {
            name: t.name.clone(),
            shape,
            placement,
            role,
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

    // Virtual stage of every layer.
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

    let mut steps_of: Vec<Vec<Step>> = vec![Vec::new(); virtual_stages];
    let mut loss = None;
    for (li, layer) in graph.layers.iter().enumerate() {
        for &oid in &layer.forward {
            let op = graph.op(oid);
            if matches!(op.kind, OpKind::CrossEntropy) {
                loss = op.outputs.first().map(|t| t.0);
            }
            let steps = lower_op(graph, oid, &mut values)?;
            steps_of[layer_chunk[li]].extend(steps);
        }
    }
    let loss = loss.ok_or_else(|| err("the model has no cross-entropy loss to train on"))?;

    // Producer and last consumer (virtual stage) of every activation.
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
        chunks.push(ChunkCode {
            stage,
            chunk,
            layers: layout.chunks[stage][chunk],
            recv: if vs == 0 { vec![] } else { crossing(vs) },
            send: crossing(vs + 1),
            inputs: inputs.into_iter().collect(),
            parameters: params.into_iter().collect(),
            steps,
        });
    }
    let tied = holders
        .into_iter()
        .filter(|(_, s)| s.len() > 1)
        .map(|(value, s)| Tied {
            value,
            stages: s.into_iter().collect(),
        })
        .collect();
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

fn check_layout(graph: &Graph, layout: &ExecLayout) -> Result<(), ExecError> {
    if layout.tp == 0 || layout.pp == 0 || layout.dp == 0 || layout.microbatches == 0 {
        return Err(err("degrees and micro-batches must be at least 1"));
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
            OpKind::MatMul { .. } => {
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

/// A step from the states its kernel reads and writes; collectives follow from the values'
/// placements.
struct Rule {
    kernel: Kernel,
    inputs: Vec<u32>,
    outputs: Vec<u32>,
    in_states: Vec<State>,
    out_states: Vec<State>,
    grad_states: Vec<State>,
}

fn lower_op(
    graph: &Graph,
    oid: autopar_rules::model::graph::OpId,
    values: &mut Vec<ValueInfo>,
) -> Result<Vec<Step>, ExecError> {
    let op = graph.op(oid);
    let id = |t: &TensorId| t.0;
    let ins: Vec<u32> = op.inputs.iter().map(id).collect();
    let outs: Vec<u32> = op.outputs.iter().map(id).collect();
    let p = |v: u32, values: &[ValueInfo]| values[v as usize].placement.clone();
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
            match p(w, values) {
                State::Split { axis, parts } if axis == n_axis => {
                    // Column-parallel: the bias is split with the output.
                    let sb = (has_bias).then(|| p(ins[2], values));
                    let out = State::Split {
                        axis: ry - 1,
                        parts,
                    };
                    rules.push(matmul_rule(
                        &ins,
                        &outs,
                        transpose_b,
                        [rep.clone(), p(w, values)],
                        [State::Partial, p(w, values)],
                        sb.map(|b| [b.clone(), b]),
                        out,
                    ));
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
                    let target = if has_bias {
                        values.push(ValueInfo {
                            name: format!("{}.partial", values[outs[0] as usize].name),
                            ..values[outs[0] as usize].clone()
                        });
                        (values.len() - 1) as u32
                    } else {
                        outs[0]
                    };
                    rules.push(Rule {
                        kernel: Kernel::MatMul {
                            transpose_b,
                            bias: false,
                        },
                        inputs: vec![x, w],
                        outputs: vec![target],
                        in_states: vec![x_state.clone(), p(w, values)],
                        out_states: vec![State::Partial],
                        grad_states: vec![x_state, p(w, values)],
                    });
                    if has_bias {
                        let s = p(outs[0], values);
                        rules.push(bias_rule(target, ins[2], outs[0], s));
                    }
                }
                _ => {
                    let sx = keep_unless(p(x, values), &|a| a + 1 == rx);
                    let wg = partial_if_split(&sx);
                    rules.push(matmul_rule(
                        &ins,
                        &outs,
                        transpose_b,
                        [sx.clone(), rep.clone()],
                        [sx.clone(), wg.clone()],
                        has_bias.then(|| [rep.clone(), wg]),
                        sx,
                    ));
                }
            }
        }
        OpKind::BatchMatMul { transpose_b } => {
            let states: Vec<State> = [ins[0], ins[1], outs[0]]
                .iter()
                .map(|&v| p(v, values))
                .collect();
            let r = rank_of(outs[0], values);
            let shared = states[0]
                .axis()
                .filter(|&a| a + 2 < r && states.iter().all(|s| s.axis() == Some(a)));
            let (sa, sb, sc) = if shared.is_some() {
                (states[0].clone(), states[1].clone(), states[2].clone())
            } else {
                (rep.clone(), rep.clone(), rep.clone())
            };
            rules.push(Rule {
                kernel: Kernel::BatchMatMul { transpose_b },
                inputs: ins.clone(),
                outputs: outs.clone(),
                in_states: vec![sa.clone(), sb.clone()],
                out_states: vec![sc],
                grad_states: vec![sa, sb],
            });
        }
        OpKind::FlashAttention { .. } => {
            let states: Vec<State> = [ins[0], ins[1], ins[2], outs[0]]
                .iter()
                .map(|&v| p(v, values))
                .collect();
            let r = rank_of(outs[0], values);
            let shared = states[0]
                .axis()
                .filter(|&a| a + 2 < r && states.iter().all(|s| s.axis() == Some(a)));
            let mut ss = if shared.is_some() {
                states
            } else {
                vec![rep.clone(); 4]
            };
            // The kernel writes its output token-major, `[b, s, heads, d]`, as FlashAttention
            // does: the output projection reads it as rows of `heads * d`.
            let out = &mut values[outs[0] as usize];
            if out.shape.len() == 4 {
                out.shape.swap(1, 2);
                if let State::Split { axis: 1, parts } = &out.placement {
                    out.placement = State::Split {
                        axis: 2,
                        parts: parts.clone(),
                    };
                    ss[3] = out.placement.clone();
                }
            }
            let d = values[ins[0] as usize].shape.last().copied().unwrap_or(1);
            rules.push(Rule {
                kernel: Kernel::Attention {
                    scale: 1.0 / (d as f32).sqrt(),
                },
                inputs: ins.clone(),
                outputs: outs.clone(),
                in_states: ss[..3].to_vec(),
                out_states: vec![ss[3].clone()],
                grad_states: ss[..3].to_vec(),
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
                kernel: if matches!(op.kind, OpKind::LayerNorm) {
                    Kernel::LayerNorm
                } else {
                    Kernel::RmsNorm
                },
                inputs: ins.clone(),
                outputs: outs.clone(),
                in_states,
                out_states: vec![sx],
                grad_states,
            });
        }
        OpKind::Softmax | OpKind::Rope => {
            let r = rank_of(ins[0], values);
            let s = keep_unless(p(ins[0], values), &|a| a + 2 >= r);
            let kernel = if matches!(op.kind, OpKind::Rope) {
                Kernel::Rope
            } else {
                Kernel::Softmax {
                    scale: softmax_scale(graph, ins[0]),
                }
            };
            rules.push(unary(kernel, ins[0], outs[0], s));
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
                kernel: Kernel::SwiGlu,
                inputs: ins.clone(),
                outputs: outs.clone(),
                in_states: vec![sx.clone()],
                out_states: vec![sy],
                grad_states: vec![sx],
            });
        }
        OpKind::Add | OpKind::Mul | OpKind::DropoutAdd => {
            let s = p(outs[0], values);
            rules.push(Rule {
                kernel: if matches!(op.kind, OpKind::Mul) {
                    Kernel::Mul
                } else {
                    Kernel::Add
                },
                inputs: ins.clone(),
                outputs: outs.clone(),
                in_states: vec![s.clone(), s.clone()],
                out_states: vec![s.clone()],
                grad_states: vec![s.clone(), s],
            });
        }
        OpKind::Embedding => {
            let parallel = matches!(p(ins[1], values), State::Split { axis: 0, .. });
            let (st, so) = if parallel {
                (p(ins[1], values), State::Partial)
            } else {
                (rep.clone(), rep.clone())
            };
            rules.push(Rule {
                kernel: Kernel::Embedding {
                    vocab_parallel: parallel,
                },
                inputs: ins.clone(),
                outputs: outs.clone(),
                in_states: vec![rep.clone(), st.clone()],
                out_states: vec![so],
                grad_states: vec![rep.clone(), st],
            });
        }
        OpKind::CrossEntropy => {
            let r = rank_of(ins[0], values);
            let sl = p(ins[0], values);
            let parallel =
                matches!(&sl, State::Split { axis, parts } if axis + 1 == r && parts.len() == 1);
            let sl = if parallel { sl } else { rep.clone() };
            rules.push(Rule {
                kernel: Kernel::CrossEntropy {
                    vocab_parallel: parallel,
                },
                inputs: ins.clone(),
                outputs: outs.clone(),
                in_states: vec![sl.clone(), rep.clone()],
                out_states: vec![rep.clone()],
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
            let (sx, souts) = if split {
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
                kernel: Kernel::Slice { parts: widths },
                inputs: ins.clone(),
                outputs: outs.clone(),
                in_states: vec![sx.clone()],
                out_states: souts,
                grad_states: vec![sx],
            });
        }
        OpKind::Transpose => {
            let (a, b) = transpose_axes(graph, ins[0], outs[0]).ok_or_else(|| {
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
                kernel: Kernel::Transpose { a, b },
                inputs: ins.clone(),
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
    }
    rules
        .into_iter()
        .map(|r| finish(op.name.as_str(), r, values))
        .collect()
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
        kernel,
        inputs: vec![x],
        outputs: vec![y],
        in_states: vec![s.clone()],
        out_states: vec![s.clone()],
        grad_states: vec![s],
    }
}

/// `y = partial-reduced + bias`, in `y`'s placement.
fn bias_rule(x: u32, bias: u32, y: u32, s: State) -> Rule {
    let gb = if s.axis().is_some() {
        State::Partial
    } else {
        State::Replicated
    };
    Rule {
        kernel: Kernel::BiasAdd,
        inputs: vec![x, bias],
        outputs: vec![y],
        in_states: vec![s.clone(), State::Replicated],
        out_states: vec![s.clone()],
        grad_states: vec![s, gb],
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

fn finish(name: &str, r: Rule, values: &[ValueInfo]) -> Result<Step, ExecError> {
    let conv = |from: &State, to: &State, what: &str| {
        conversions(from, to).ok_or_else(|| {
            err(format!(
                "`{name}`: no collective takes {what} from {from:?} to {to:?}"
            ))
        })
    };
    let mut before = Vec::new();
    for (&v, s) in r.inputs.iter().zip(&r.in_states) {
        before.push(conv(&values[v as usize].placement, s, "an operand")?);
    }
    let mut after = Vec::new();
    let mut grad_before = Vec::new();
    for (&v, s) in r.outputs.iter().zip(&r.out_states) {
        let placement = &values[v as usize].placement;
        after.push(conv(s, placement, "a result")?);
        // The gradient of a partial sum is the gradient of the sum, on every rank.
        let need = if *s == State::Partial {
            State::Replicated
        } else {
            s.clone()
        };
        grad_before.push(conv(placement, &need, "a result's gradient")?);
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
    })
}
