//! Tensor and sequence parallelism on the op graph, Megatron-LM style.
//!
//! The splits recorded on tensors say which ops are column-parallel (weight split along its
//! output features), row-parallel (split along its input features) or vocabulary-parallel, and
//! this module derives what each rank computes and which collectives the forward and backward
//! passes need (Shoeybi et al. 2019; Korthikanti et al. 2022 for sequence parallelism):
//!
//! | op                         | forward                 | backward                           |
//! |----------------------------|-------------------------|------------------------------------|
//! | column-parallel matmul     | SP: all-gather input    | all-reduce dX (SP: reduce-scatter dX, re-gather input for dW, overlapped with dX) |
//! | row-parallel matmul        | all-reduce Y (SP: reduce-scatter Y) | SP: all-gather dY      |
//! | vocab-parallel embedding   | all-reduce Y (SP: reduce-scatter Y) | SP: all-gather dY      |
//! | vocab-parallel cross-entropy | all-reduce of max, sum and target logit per token | —     |
//! | opaque op (a kind autopar does not know) | all-gather each divided operand; runs whole | all-gather each divided operand and result gradient |
//!
//! Everything else is local: ops on model-split tensors work on their shard, ops on the residual
//! stream are replicated (or work on a sequence shard under SP).
//!
//! Mixture-of-experts layers follow Megatron-Core's MoE parallel folding: the expert part of a
//! stage's `t x cp x dp` GPUs is laid out as `etp x ep x edp`. Each rank routes its own
//! tokens (its sequence shard: MoE needs SP under tensor parallelism), the all-to-all
//! dispatcher sends them to the `ep` ranks holding their experts, the `etp` ranks of an
//! expert all-gather them, each runs its `1/etp` of the expert's width, and the way back
//! reduce-scatters the partial outputs over `etp` and all-to-alls them home:
//!
//! | op           | forward                                    | backward                       |
//! |--------------|--------------------------------------------|--------------------------------|
//! | moe_dispatch | all-to-all over ep, all-gather over etp    | reduce-scatter over etp, all-to-all over ep |
//! | moe_combine  | reduce-scatter over etp, all-to-all over ep | all-gather over etp, all-to-all over ep |
//!
//! So one rank holds `E / ep` experts, each `1/etp` of its width, and works on
//! `C x ep x etp / t` tokens per expert (`C`: an expert's tokens in the graph's micro-batch).

use crate::cost::analytic::{Collective, GemmShape};
use crate::cost::tp_comm_overlap::Userbuffers;
use crate::model::graph::{Graph, Op, OpKind, Split, TensorId, TensorKind};

/// Tensor-parallel configuration of a stage, with the expert layout of its MoE layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TpConfig {
    /// Tensor-parallel degree.
    pub t: u64,
    /// Sequence parallelism on the replicated regions.
    pub sp: bool,
    /// Expert-parallel degree: ranks the routed experts are divided over.
    pub ep: u64,
    /// Expert tensor-parallel degree: ranks each expert's width is divided over.
    pub etp: u64,
}

impl TpConfig {
    /// Tensor parallelism `t` (with SP if `sp`) and no expert parallelism; experts, if any,
    /// split over the same `t` ranks as the dense layers (Megatron-Core's default).
    pub fn dense(t: u64, sp: bool) -> Self {
        TpConfig {
            t,
            sp,
            ep: 1,
            etp: t,
        }
    }
}

/// The communication group a collective runs over.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Group {
    /// The tensor-parallel group (`t` ranks).
    Tensor,
    /// The expert-parallel group (`ep` ranks, `etp` apart).
    Expert,
    /// The expert tensor-parallel group (`etp` neighbouring ranks).
    ExpertTensor,
}

impl Group {
    /// Ranks of the group under `cfg`.
    pub fn ranks(self, cfg: TpConfig) -> u64 {
        match self {
            Group::Tensor => cfg.t,
            Group::Expert => cfg.ep,
            Group::ExpertTensor => cfg.etp,
        }
    }
}

/// One rank's share of an expert-split tensor's bytes (`None` for other tensors): `1/ep` of
/// the experts (and `1/etp` of a divided width) of a weight, `ep x etp / t` of an expert
/// buffer's tokens (and `1/etp` of a divided width).
fn expert_share(g: &Graph, t: TensorId, cfg: TpConfig) -> Option<f64> {
    let tensor = g.tensor(t);
    let (ep, etp, tp) = (
        cfg.ep.max(1) as f64,
        cfg.etp.max(1) as f64,
        cfg.t.max(1) as f64,
    );
    let width = match tensor.split {
        Split::Experts => 1.0,
        Split::ExpertModel(_) => 1.0 / etp,
        _ => return None,
    };
    Some(match tensor.kind {
        TensorKind::Parameter | TensorKind::WeightGradient => width / ep,
        _ => width * etp / tp,
    })
}

/// One rank's shape of an expert-split tensor (`None` for other tensors): its experts divided
/// by `ep`, a divided width by `etp`, an expert buffer's tokens scaled by `ep x etp / t`.
fn expert_shape(g: &Graph, t: TensorId, cfg: TpConfig) -> Option<Vec<u64>> {
    let tensor = g.tensor(t);
    let (ep, etp, tp) = (cfg.ep.max(1), cfg.etp.max(1), cfg.t.max(1));
    let mut shape = tensor.shape.clone();
    let divided = match tensor.split {
        Split::Experts => None,
        Split::ExpertModel(a) => Some(a as usize),
        _ => return None,
    };
    if let Some(e) = shape.get_mut(0) {
        *e = (*e / ep).max(1);
    }
    if let Some(a) = divided
        && let Some(d) = shape.get_mut(a)
    {
        *d = (*d / etp).max(1);
    }
    let buffer = !matches!(
        tensor.kind,
        TensorKind::Parameter | TensorKind::WeightGradient
    );
    if buffer && let Some(c) = shape.get_mut(1) {
        *c = (*c * ep * etp).div_ceil(tp);
    }
    Some(shape)
}

/// When a collective runs relative to the op that needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// On the critical path of the forward pass.
    Forward,
    /// On the critical path of the backward pass.
    Backward,
    /// In the backward pass, overlapped with the op's input-gradient product (Megatron issues
    /// the re-gather of a sequence-parallel input asynchronously).
    BackwardOverlapped,
}

/// A collective an op implies.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TpCollective {
    /// Which collective.
    pub kind: Collective,
    /// Full payload in bytes (for an all-to-all, what the whole group sends).
    pub bytes: f64,
    /// When it runs.
    pub phase: Phase,
    /// Over which group.
    pub group: Group,
    /// How Transformer Engine's userbuffers overlap it with the op's product when
    /// tensor-parallel communication overlap is on ([`crate::cost::tp_comm_overlap`]); `None`
    /// for a collective they never overlap.
    pub userbuffers: Option<Userbuffers>,
}

fn is_model(g: &Graph, t: TensorId) -> bool {
    matches!(g.tensor(t).split, Split::Model(_))
}

fn is_seq(g: &Graph, t: TensorId) -> bool {
    matches!(g.tensor(t).split, Split::Sequence(_))
}

/// Whether an op works on model-split tensors (and therefore on 1/t of the work).
pub fn op_is_model_parallel(g: &Graph, op: &Op) -> bool {
    op.inputs.iter().chain(&op.outputs).any(|&t| is_model(g, t))
}

/// The axis of tensor `t` that is divided by `cfg.t` as `op` sees it on one device, if any.
///
/// A model-split tensor is divided everywhere. A sequence-split tensor is divided under SP,
/// except in an op that also touches model-split tensors: there it is consumed after an
/// all-gather or produced before a reduce-scatter, i.e. whole.
pub fn divided_axis_in_op(g: &Graph, op: &Op, t: TensorId, cfg: TpConfig) -> Option<usize> {
    if matches!(op.kind, OpKind::Opaque { .. }) {
        // Never split: it reads its operands gathered and writes whole results, which each
        // rank slices to what it stores.
        return None;
    }
    match g.tensor(t).split {
        Split::Model(axis) => Some(axis as usize),
        Split::Sequence(axis) if cfg.sp && !op_is_model_parallel(g, op) => Some(axis as usize),
        _ => None,
    }
}

/// Per-device size in bytes of tensor `t` as `op` reads or writes it.
pub fn tensor_bytes_in_op(g: &Graph, op: &Op, t: TensorId, cfg: TpConfig) -> f64 {
    let bytes = g.tensor(t).bytes() as f64;
    if let Some(share) = expert_share(g, t, cfg) {
        return bytes * share;
    }
    match divided_axis_in_op(g, op, t, cfg) {
        Some(_) => bytes / cfg.t as f64,
        None => bytes,
    }
}

/// Shape of tensor `t` as `op` sees it on one device.
pub fn device_shape_in_op(g: &Graph, op: &Op, t: TensorId, cfg: TpConfig) -> Vec<u64> {
    if let Some(shape) = expert_shape(g, t, cfg) {
        return shape;
    }
    let mut shape = g.tensor(t).shape.clone();
    if let Some(axis) = divided_axis_in_op(g, op, t, cfg)
        && let Some(d) = shape.get_mut(axis)
    {
        *d /= cfg.t.max(1);
    }
    shape
}

/// Shape of a matrix product `op` as one device runs it (`None` for other ops).
pub fn gemm_shape(g: &Graph, op: &Op, cfg: TpConfig) -> Option<GemmShape> {
    let out = *op.outputs.first()?;
    let mut shape: Vec<f64> = g.tensor(out).shape.iter().map(|&d| d as f64).collect();
    if let Some(local) = expert_shape(g, out, cfg) {
        shape = local.iter().map(|&d| d as f64).collect();
    } else if let Some(axis) = divided_axis_in_op(g, op, out, cfg)
        && let Some(d) = shape.get_mut(axis)
    {
        *d /= cfg.t as f64;
    }
    let n = *shape.last()?;
    match op.kind {
        OpKind::MatMul { .. } => {
            let total: f64 = shape.iter().product();
            Some(GemmShape {
                batch: 1.0,
                m: total / n,
                n,
            })
        }
        OpKind::BatchMatMul { .. } if shape.len() >= 2 => Some(GemmShape {
            batch: shape[..shape.len() - 2].iter().product(),
            m: shape[shape.len() - 2],
            n,
        }),
        _ => None,
    }
}

/// The axis of tensor `t` divided over the tensor-parallel ranks where it is stored between
/// ops: a model-split axis always, a sequence-split one under sequence parallelism (`sp`).
pub fn stored_divided_axis(g: &Graph, t: TensorId, sp: bool) -> Option<usize> {
    match g.tensor(t).split {
        Split::Model(axis) => Some(axis as usize),
        Split::Sequence(axis) if sp => Some(axis as usize),
        _ => None,
    }
}

/// Per-device size in bytes of a tensor stored between ops (activations kept for the backward
/// pass, weights): divided by t along its [`stored_divided_axis`], an expert tensor by its
/// ranks' share.
pub fn stored_bytes(g: &Graph, t: TensorId, cfg: TpConfig) -> f64 {
    let bytes = g.tensor(t).bytes() as f64;
    if let Some(share) = expert_share(g, t, cfg) {
        return bytes * share;
    }
    match stored_divided_axis(g, t, cfg.sp) {
        Some(_) => bytes / cfg.t as f64,
        None => bytes,
    }
}

/// Per-device bytes of an activation `saver`, the first op that saves it, keeps for the
/// backward pass: as stored ([`stored_bytes`]), or whole when an opaque op keeps it as it
/// read it.
pub fn saved_bytes(g: &Graph, saver: &Op, t: TensorId, cfg: TpConfig) -> f64 {
    match saver.kind {
        OpKind::Opaque { .. } => g.tensor(t).bytes() as f64,
        _ => stored_bytes(g, t, cfg),
    }
}

/// Per-device stored elements of a tensor (for parameter counts).
pub fn stored_elements(g: &Graph, t: TensorId, cfg: TpConfig) -> f64 {
    stored_bytes(g, t, cfg) / g.tensor(t).dtype.bytes() as f64
}

/// FLOPs one device executes for `op`.
pub fn op_device_flops(g: &Graph, op: &Op, cfg: TpConfig) -> f64 {
    // An expert op's work is spread over every rank of the stage's expert layout: `1/t` of the
    // graph's (which holds one tensor-parallel group's tokens).
    let opaque = matches!(op.kind, OpKind::Opaque { .. });
    let sharded = !opaque && op_is_model_parallel(g, op)
        || op
            .inputs
            .iter()
            .chain(&op.outputs)
            .any(|&t| g.tensor(t).split.is_expert())
        || (!opaque && cfg.sp && op.inputs.iter().chain(&op.outputs).any(|&t| is_seq(g, t)));
    if sharded {
        op.flops / cfg.t as f64
    } else {
        op.flops
    }
}

/// Collectives a forward op implies, in its forward and its backward pass. Empty for t = 1.
pub fn collectives(g: &Graph, op: &Op, cfg: TpConfig) -> Vec<TpCollective> {
    let mut out = Vec::new();
    if matches!(op.kind, OpKind::MoeDispatch | OpKind::MoeCombine) {
        expert_collectives(g, op, cfg, &mut out);
        return out;
    }
    if cfg.t <= 1 {
        return out;
    }
    let bytes = |t: TensorId| g.tensor(t).bytes() as f64;
    let mut push = |kind, bytes, phase, userbuffers| {
        out.push(TpCollective {
            kind,
            bytes,
            phase,
            group: Group::Tensor,
            userbuffers,
        })
    };
    // Held as a sequence shard (under SP).
    let seq_shard = |t: TensorId| cfg.sp && is_seq(g, t);
    // Sum of partial results over the group: reduce-scatter into sequence shards under SP.
    let reduce = |t: TensorId| {
        if seq_shard(t) {
            Collective::ReduceScatter
        } else {
            Collective::AllReduce
        }
    };
    match op.kind {
        OpKind::MatMul { .. } => {
            let (x, w, y) = (op.inputs[0], op.inputs[1], op.outputs[0]);
            let column = is_model(g, y) && !is_model(g, x);
            let row = is_model(g, x) && !is_model(g, y);
            // Transformer Engine casts an FP8 product's operand on the sequence shard and
            // gathers the FP8 copy: the input in the forward, the output gradient in the
            // backward (`_Linear` with `sequence_parallel`).
            let fp8_bytes = |t: TensorId| g.tensor(t).fp8_copy_bytes() as f64;
            // Userbuffers overlap the gathers into a product and the reduce-scatters out of it
            // ([`crate::cost::tp_comm_overlap`]); an all-reduce runs exposed.
            let ring = Some(Userbuffers::RingExchange);
            if column {
                let gathered = seq_shard(x);
                if gathered {
                    let moved = if op.fp8 { fp8_bytes(x) } else { bytes(x) };
                    push(Collective::AllGather, moved, Phase::Forward, ring);
                }
                if g.tensor(x).requires_grad {
                    let bulk = seq_shard(x).then_some(Userbuffers::Bulk);
                    push(reduce(x), bytes(x), Phase::Backward, bulk);
                }
                if gathered && g.tensor(w).requires_grad {
                    // Transformer Engine keeps an FP8 product's input as its FP8 shard and
                    // gathers that (one byte per element) for the weight gradient.
                    let saved = match g.fp8_saved_operand(op) {
                        Some(x) => fp8_bytes(x),
                        None => bytes(x),
                    };
                    push(
                        Collective::AllGather,
                        saved,
                        Phase::BackwardOverlapped,
                        None,
                    );
                }
            } else if row {
                let ring_rs = seq_shard(y).then_some(Userbuffers::RingExchange);
                push(reduce(y), bytes(y), Phase::Forward, ring_rs);
                if seq_shard(y) {
                    let moved = if op.fp8 { fp8_bytes(y) } else { bytes(y) };
                    push(Collective::AllGather, moved, Phase::Backward, ring);
                }
            }
        }
        OpKind::Embedding => {
            let (table, y) = (op.inputs[1], op.outputs[0]);
            if is_model(g, table) {
                push(reduce(y), bytes(y), Phase::Forward, None);
                if seq_shard(y) {
                    push(Collective::AllGather, bytes(y), Phase::Backward, None);
                }
            }
        }
        OpKind::CrossEntropy => {
            let (logits, labels) = (op.inputs[0], op.inputs[1]);
            if is_model(g, logits) {
                // Max, sum of exponentials and target logit per token, in fp32.
                let per_token = 4.0 * g.tensor(labels).elements() as f64;
                for _ in 0..3 {
                    push(Collective::AllReduce, per_token, Phase::Forward, None);
                }
            }
        }
        OpKind::Opaque { .. } => {
            // Every rank runs it whole: it gathers the operands stored divided, and its
            // backward gathers them again with the divided results' gradients. It keeps what
            // it saves as it read it ([`saved_bytes`]), as the intra-op model counts every op.
            // Results and input gradients, whole on every rank, are sliced to what each
            // stores, for free.
            let divided = |t: TensorId| stored_divided_axis(g, t, cfg.sp).is_some();
            let backward = op.inputs.iter().any(|&t| g.tensor(t).requires_grad);
            for &x in op.inputs.iter().filter(|&&x| divided(x)) {
                push(Collective::AllGather, bytes(x), Phase::Forward, None);
                if backward {
                    push(Collective::AllGather, bytes(x), Phase::Backward, None);
                }
            }
            if backward {
                for &y in op.outputs.iter().filter(|&&y| divided(y)) {
                    push(Collective::AllGather, bytes(y), Phase::Backward, None);
                }
            }
        }
        _ => {}
    }
    out
}

/// The token exchanges of a dispatch or combine (see the module documentation). `B`, the
/// bytes of the graph's expert buffer, holds one tensor-parallel group's tokens; one rank
/// sends its `B / t` to the other ranks of its expert-parallel group, and the `etp` ranks of
/// an expert gather or scatter `etp x B / t`.
fn expert_collectives(g: &Graph, op: &Op, cfg: TpConfig, out: &mut Vec<TpCollective>) {
    let buffer = match op.kind {
        OpKind::MoeDispatch => op.outputs[0],
        _ => op.inputs[0],
    };
    let local = g.tensor(buffer).bytes() as f64 / cfg.t.max(1) as f64;
    let (ep, etp) = (cfg.ep.max(1), cfg.etp.max(1));
    let a2a = |phase| TpCollective {
        kind: Collective::AllToAll,
        bytes: local * ep as f64,
        phase,
        group: Group::Expert,
        userbuffers: None,
    };
    let gather = |kind, phase| TpCollective {
        kind,
        bytes: local * etp as f64,
        phase,
        group: Group::ExpertTensor,
        userbuffers: None,
    };
    let (fwd, bwd) = match op.kind {
        OpKind::MoeDispatch => (Collective::AllGather, Collective::ReduceScatter),
        _ => (Collective::ReduceScatter, Collective::AllGather),
    };
    if ep > 1 {
        out.push(a2a(Phase::Forward));
        out.push(a2a(Phase::Backward));
    }
    if etp > 1 {
        out.push(gather(fwd, Phase::Forward));
        out.push(gather(bwd, Phase::Backward));
    }
}

/// Checks that every model-split axis of the graph divides evenly by `t`; returns the first
/// offending tensor as `(name, axis, size)`.
pub fn indivisible_split(g: &Graph, t: u64) -> Option<(String, usize, u64)> {
    g.tensors.iter().find_map(|tensor| match tensor.split {
        Split::Model(axis)
            if !matches!(
                tensor.kind,
                TensorKind::Gradient | TensorKind::WeightGradient
            ) =>
        {
            let size = tensor.shape.get(axis as usize).copied().unwrap_or(0);
            (size % t != 0).then(|| (tensor.name.clone(), axis as usize, size))
        }
        _ => None,
    })
}

/// Checks that every sequence-split axis divides evenly by `t` (needed under SP).
pub fn indivisible_sequence(g: &Graph, t: u64) -> Option<(String, usize, u64)> {
    g.tensors.iter().find_map(|tensor| match tensor.split {
        Split::Sequence(axis) if tensor.kind == TensorKind::Activation => {
            let size = tensor.shape.get(axis as usize).copied().unwrap_or(0);
            (size % t != 0).then(|| (tensor.name.clone(), axis as usize, size))
        }
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::frontend::{
        Attention, Bias, LowerOptions, Mlp, MoeConfig, MoeRouting, Norm, Position,
        TransformerConfig,
    };
    use crate::model::graph::DType;

    /// One MoE block of 4 experts (top-2, width 32) on a 16-wide stream, 8 tokens per
    /// micro-batch: 4 tokens per expert.
    fn moe_block() -> Graph {
        TransformerConfig {
            hidden: 16,
            layers: 1,
            heads: 2,
            kv_heads: 2,
            head_dim: 8,
            ffn_hidden: 32,
            vocab: 64,
            max_seq: 8,
            mlp: Mlp::SwiGlu,
            norm: Norm::RmsNorm,
            position: Position::Rope,
            tied_embeddings: false,
            bias: Bias::None,
            dropout: false,
            moe: Some(MoeConfig {
                experts: 4,
                top_k: 2,
                expert_ffn: 32,
                shared_ffn: 0,
                dense_layers: 0,
                router_bias: false,
                routing: MoeRouting::default(),
            }),
            mla: None,
            qk_norm: false,
        }
        .lower(
            "moe",
            &LowerOptions {
                micro_batch: 1,
                seq: 8,
                dtype: DType::Bf16,
                attention: Attention::Flash,
                vocab_multiple: 1,
                eager_elementwise: false,
                fp8: false,
            },
        )
        .expect("lowers")
    }

    fn op<'g>(g: &'g Graph, name: &str) -> &'g Op {
        g.ops.iter().find(|o| o.name == name).expect("op")
    }

    fn tensor(g: &Graph, name: &str) -> TensorId {
        TensorId(
            g.tensors
                .iter()
                .position(|t| t.name == name)
                .expect("tensor") as u32,
        )
    }

    /// An opaque op on the residual stream (sequence-split) with a weight, and one between
    /// the column- and row-parallel products (model-split), in one block.
    fn opaque_block() -> Graph {
        let text = r#"{
  "format": "autopar-graph/1",
  "tensors": [
    {"name": "tokens", "shape": ["b", "s"], "kind": "input", "dtype": "i32"},
    {"name": "labels", "shape": ["b", "s"], "kind": "input", "dtype": "i32"},
    {"name": "emb", "shape": [64, 16], "kind": "parameter", "split": "model:0"},
    {"name": "x", "shape": ["b", "s", 16]},
    {"name": "g", "shape": [16], "kind": "parameter"},
    {"name": "y", "shape": ["b", "s", 16]},
    {"name": "w1", "shape": [16, 32], "kind": "parameter", "split": "model:1"},
    {"name": "h", "shape": ["b", "s", 32], "split": "model:2"},
    {"name": "a", "shape": ["b", "s", 32], "split": "model:2"},
    {"name": "w2", "shape": [32, 64], "kind": "parameter"},
    {"name": "logits", "shape": ["b", "s", 64]},
    {"name": "loss", "shape": [1], "dtype": "f32"}
  ],
  "layers": [{"name": "all", "ops": [
    {"name": "lookup", "kind": "embedding", "inputs": ["tokens", "emb"], "outputs": ["x"]},
    {"name": "scan", "kind": "selective_scan", "inputs": ["x", "g"], "outputs": ["y"]},
    {"name": "up", "kind": "matmul", "inputs": ["y", "w1"], "outputs": ["h"]},
    {"name": "act", "kind": "opaque", "inputs": ["h"], "outputs": ["a"]},
    {"name": "down", "kind": "matmul", "inputs": ["a", "w2"], "outputs": ["logits"]},
    {"name": "ce", "kind": "cross_entropy", "inputs": ["logits", "labels"], "outputs": ["loss"]}
  ]}]
}"#;
        crate::model::frontend::parse_graph_file(text)
            .expect("valid graph")
            .lower(2, 8, DType::Bf16)
            .expect("lowers")
    }

    #[test]
    fn an_opaque_op_runs_whole_on_gathered_operands() {
        let g = opaque_block();
        let gathers = |name: &str, cfg: TpConfig| -> Vec<(Phase, f64)> {
            collectives(&g, op(&g, name), cfg)
                .iter()
                .map(|c| {
                    assert_eq!(c.kind, Collective::AllGather, "{name}");
                    (c.phase, c.bytes)
                })
                .collect()
        };
        let stream = (2 * 8 * 16 * 2) as f64;
        let hidden = (2 * 8 * 32 * 2) as f64;
        let sp = TpConfig::dense(4, true);
        // Under SP the stream is stored in sequence shards: gathered into the op, and again
        // into its backward; its result is whole on every rank, not in shards.
        let y = tensor(&g, "y");
        assert_eq!(g.tensor(y).split, Split::None);
        let x = tensor(&g, "x");
        assert_eq!(
            saved_bytes(&g, op(&g, "scan"), x, sp),
            g.tensor(x).bytes() as f64
        );
        assert_eq!(stored_bytes(&g, x, sp), g.tensor(x).bytes() as f64 / 4.0);
        assert_eq!(
            gathers("scan", sp),
            [(Phase::Forward, stream), (Phase::Backward, stream)]
        );
        assert!(gathers("scan", TpConfig::dense(4, false)).is_empty());
        // Model-split operands are gathered with or without SP, and so is the gradient of a
        // model-split result.
        for cfg in [sp, TpConfig::dense(4, false)] {
            assert_eq!(
                gathers("act", cfg),
                [
                    (Phase::Forward, hidden),
                    (Phase::Backward, hidden),
                    (Phase::Backward, hidden)
                ]
            );
        }
        assert!(gathers("act", TpConfig::dense(1, true)).is_empty());
        // It reads and writes whole tensors and is not divided.
        for name in ["scan", "act", "scan.grad", "act.grad"] {
            let o = op(&g, name);
            for &t in o.inputs.iter().chain(&o.outputs) {
                assert_eq!(divided_axis_in_op(&g, o, t, sp), None, "{name}");
                assert_eq!(tensor_bytes_in_op(&g, o, t, sp), g.tensor(t).bytes() as f64);
            }
        }
    }

    /// The dispatch's buffer `[4, 4, 16]` in bf16 is 512 bytes for the tensor-parallel pair's 8
    /// tokens; each rank routes its 4 (256 bytes). Expert parallelism over both ranks
    /// exchanges them all-to-all (the group's 512 bytes) each way; expert tensor parallelism
    /// gathers both ranks' copies (512 bytes) and scatters the partial outputs back.
    #[test]
    fn dispatch_and_combine_exchange_each_ranks_tokens_over_their_groups() {
        let g = moe_block();
        let (dispatch, combine) = (
            op(&g, "layers.0.experts.dispatch"),
            op(&g, "layers.0.experts.combine"),
        );
        assert_eq!(g.tensor(dispatch.outputs[0]).shape, vec![4, 4, 16]);
        let ep = TpConfig {
            t: 2,
            sp: true,
            ep: 2,
            etp: 1,
        };
        let want = |kind, phase, group| TpCollective {
            kind,
            bytes: 512.0,
            phase,
            group,
            userbuffers: None,
        };
        for o in [dispatch, combine] {
            assert_eq!(
                collectives(&g, o, ep),
                vec![
                    want(Collective::AllToAll, Phase::Forward, Group::Expert),
                    want(Collective::AllToAll, Phase::Backward, Group::Expert),
                ]
            );
        }
        let etp = TpConfig::dense(2, true);
        assert_eq!(
            collectives(&g, dispatch, etp),
            vec![
                want(Collective::AllGather, Phase::Forward, Group::ExpertTensor),
                want(
                    Collective::ReduceScatter,
                    Phase::Backward,
                    Group::ExpertTensor
                ),
            ]
        );
        assert_eq!(
            collectives(&g, combine, etp),
            vec![
                want(
                    Collective::ReduceScatter,
                    Phase::Forward,
                    Group::ExpertTensor
                ),
                want(Collective::AllGather, Phase::Backward, Group::ExpertTensor),
            ]
        );
        // No expert groups, no exchange.
        assert!(collectives(&g, dispatch, TpConfig::dense(1, false)).is_empty());
    }

    /// What one rank holds and runs: under ep 2 its 2 experts whole, with both ranks' tokens
    /// of them (4 per expert); under etp 2 all 4 experts at half width with all 4 tokens of
    /// each. Either way a rank runs half the experts' FLOPs.
    #[test]
    fn a_rank_holds_its_experts_and_runs_its_share() {
        let g = moe_block();
        let fc1 = op(&g, "layers.0.experts.fc1");
        let (buffer, w1, up) = (fc1.inputs[0], fc1.inputs[1], fc1.outputs[0]);
        let ep = TpConfig {
            t: 2,
            sp: true,
            ep: 2,
            etp: 1,
        };
        let etp = TpConfig::dense(2, true);
        assert_eq!(device_shape_in_op(&g, fc1, buffer, ep), vec![2, 4, 16]);
        assert_eq!(device_shape_in_op(&g, fc1, w1, ep), vec![2, 16, 64]);
        assert_eq!(device_shape_in_op(&g, fc1, up, ep), vec![2, 4, 64]);
        assert_eq!(device_shape_in_op(&g, fc1, buffer, etp), vec![4, 4, 16]);
        assert_eq!(device_shape_in_op(&g, fc1, w1, etp), vec![4, 16, 32]);
        assert_eq!(device_shape_in_op(&g, fc1, up, etp), vec![4, 4, 32]);
        for cfg in [ep, etp] {
            assert_eq!(op_device_flops(&g, fc1, cfg), fc1.flops / 2.0);
            let s = gemm_shape(&g, fc1, cfg).expect("a product");
            assert_eq!(s.batch * s.m * s.n * 2.0 * 16.0, fc1.flops / 2.0);
            assert_eq!(stored_bytes(&g, w1, cfg), g.tensor(w1).bytes() as f64 / 2.0);
        }
        let x = tensor(&g, "layers.0.mlp_norm.out");
        assert!(!g.tensor(x).split.is_expert() && g.tensor(w1).split.is_expert());
    }
}
