//! What one layer costs on one device under a tensor-, context- and expert-parallel configuration:
//! kernel time and communication per micro-batch, activations kept for the backward pass under each
//! recomputation mode, parameters held.

use crate::canonical::KeyParts;
use crate::cost::analytic::{
    Collective, collective_time, fp8_cast_time, gradient_accumulation, kernel_dtype,
    op_kernel_time, op_traffic,
};
use crate::cost::cluster::{Device, Link};
use crate::cost::context_parallel::{self, AttentionBytes, CpConfig, CpGroups};
use crate::cost::profile::{CollectiveSignature, OpSignature, Profile, ProfileRead, kernel_name};
use crate::cost::tensor_parallel::{
    Group, Phase, TpCollective, TpConfig, collectives, device_shape_in_op, divided_axis_in_op,
    gemm_shape, op_device_flops, saved_bytes, stored_bytes, stored_elements, tensor_bytes_in_op,
};
use crate::model::graph::{
    DType, Graph, LayerKind, Op, OpId, OpKind, Pass, Split, TensorId, TensorKind,
};
use serde::{Deserialize, Serialize};

/// How the framework runs kernels, beyond what the hardware determines.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct KernelOptions {
    /// Dtype of weights and activations.
    pub dtype: DType,
    /// Bytes per element of the gradient buffer weight gradients accumulate into across
    /// micro-batches.
    pub grad_buffer_bytes: f64,
    /// Weight-gradient products accumulate straight into the gradient buffer
    /// (Megatron-LM's `--gradient-accumulation-fusion`); otherwise every micro-batch adds
    /// each fresh weight gradient to the buffer in a separate kernel.
    pub grad_accumulation_fusion: bool,
    /// Transformer Engine's userbuffers overlap the tensor-parallel all-gathers and
    /// reduce-scatters with the products next to them (Megatron-Core's `--tp-comm-overlap`;
    /// [`crate::cost::tp_comm_overlap`]).
    #[serde(default)]
    pub tp_comm_overlap: bool,
}
use std::collections::HashMap;

/// Costs of one layer per micro-batch on one device.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerCost {
    /// Role of the layer.
    pub kind: LayerKind,
    /// Forward kernel time, s.
    pub fwd_compute: f64,
    /// Forward tensor-, context- and expert-parallel communication, s.
    pub fwd_comm: f64,
    /// Backward kernel time, s.
    pub bwd_compute: f64,
    /// Backward tensor-, context- and expert-parallel communication not hidden behind compute, s.
    pub bwd_comm: f64,
    /// Forward kernel time of the attention-core ops (what selective recomputation re-runs), s.
    pub attention_core_compute: f64,
    /// Forward context-parallel communication of the attention core that is not hidden
    /// behind it (re-run with it by selective recomputation: the ring passes the key/value
    /// blocks again), s.
    #[serde(default)]
    pub attention_core_comm: f64,
    /// Forward FLOPs of the whole layer (all ranks together).
    pub fwd_flops: f64,
    /// Backward FLOPs of the whole layer.
    pub bwd_flops: f64,
    /// Forward FLOPs of the attention core.
    pub attention_core_flops: f64,
    /// Activations kept for the backward pass without recomputation, bytes per device.
    pub saved: f64,
    /// Activations kept under selective recomputation (attention-core outputs dropped).
    pub saved_selective: f64,
    /// The layer's input, the only activation kept under full recomputation, bytes per device.
    pub checkpoint: f64,
    /// Activations kept under torchtitan's `op` policy of selective checkpointing (the input,
    /// the attention kernel's outputs and every other linear layer's output), bytes per device.
    #[serde(default)]
    pub saved_op_policy: f64,
    /// Forward time that policy re-runs during backward (every op whose output it drops, and
    /// their forward collectives but reduce-scatters, whose outputs it keeps), s.
    #[serde(default)]
    pub op_policy_recompute: f64,
    /// Forward FLOPs that policy re-runs.
    #[serde(default)]
    pub op_policy_flops: f64,
    /// Largest activation gradient of the backward pass, bytes per device, as the op making it
    /// writes it (a partial sum before its reduce-scatter is whole).
    pub grad_working: f64,
    /// The fp32 probabilities the loss keeps for its backward (the cross-entropy's saved
    /// softmax, one fp32 value per logit), bytes per device; 0 for layers without a loss.
    #[serde(default)]
    pub loss_probs: f64,
    /// Parameters the layer owns, elements per device.
    pub params: f64,
    /// Of those, the routed experts' (reduced and sharded over the expert data-parallel group).
    #[serde(default)]
    pub expert_params: f64,
    /// Of those, the weights FP8 products read ([`crate::model::graph::Op::fp8`]), whose FP8
    /// copies the layer also keeps ([`crate::cost::memory::FP8_WEIGHT_COPY_BYTES`]).
    #[serde(default)]
    pub fp8_params: f64,
    /// Parameters the layer reads but another layer owns (a tied output embedding), as
    /// (owning layer, elements per device).
    pub borrowed_params: Vec<(usize, f64)>,
    /// Size of the activation entering the layer, bytes (unsharded).
    pub input_bytes: f64,
}

impl LayerCost {
    /// A layer of `kind` that costs nothing (a starting point to add to).
    pub fn empty(kind: LayerKind) -> Self {
        LayerCost {
            kind,
            fwd_compute: 0.0,
            fwd_comm: 0.0,
            bwd_compute: 0.0,
            bwd_comm: 0.0,
            attention_core_compute: 0.0,
            attention_core_comm: 0.0,
            fwd_flops: 0.0,
            bwd_flops: 0.0,
            attention_core_flops: 0.0,
            saved: 0.0,
            saved_selective: 0.0,
            checkpoint: 0.0,
            saved_op_policy: 0.0,
            op_policy_recompute: 0.0,
            op_policy_flops: 0.0,
            grad_working: 0.0,
            loss_probs: 0.0,
            params: 0.0,
            expert_params: 0.0,
            fp8_params: 0.0,
            borrowed_params: Vec::new(),
            input_bytes: 0.0,
        }
    }
}

/// torchtitan's `op` policy of selective activation checkpointing, walked over one block's
/// forward ops in order (torchtitan's `_apply_ac_to_transformer_block`: a fresh count per
/// block, `aten.mm` outputs kept when the count is odd, scaled-dot-product attention outputs
/// always kept, everything else recomputed). The graph fuses some linear layers that
/// torchtitan runs one by one (query/key/value, gate/up): such a product counts as one linear
/// per part that its consumer splits it into, in the order of the parts.
#[derive(Default)]
struct OpPolicy {
    linears: u32,
}

impl OpPolicy {
    /// For forward op `o` of layer `li`: the share of its work the policy re-runs and the
    /// share of its outputs it keeps.
    fn share(&mut self, ctx: &LayerCostContext<'_>, li: usize, o: OpId) -> (f64, f64) {
        let g = ctx.g;
        let op = g.op(o);
        match op.kind {
            OpKind::FlashAttention { .. } => (0.0, 1.0),
            // Routed experts run grouped products (not `aten.mm`): recomputed, not counted.
            OpKind::MatMul { .. }
                if !op.attention_core
                    && !op
                        .inputs
                        .get(1)
                        .is_some_and(|&w| g.tensor(w).split.is_expert()) =>
            {
                let (mut rerun, mut kept) = (0.0, 0.0);
                for part in linear_parts(g, li, op) {
                    self.linears += 1;
                    if self.linears % 2 == 1 {
                        kept += part;
                    } else {
                        rerun += part;
                    }
                }
                (rerun, kept)
            }
            _ => (1.0, 0.0),
        }
    }
}

/// The linear layers a matrix product of layer `li` stands for, as shares of its output: the
/// parts a `slice` consumer splits it into (fused query/key/value), the two halves a SwiGLU
/// consumer reads (fused gate/up), else the whole product.
fn linear_parts(g: &Graph, li: usize, op: &Op) -> Vec<f64> {
    let Some(&y) = op.outputs.first() else {
        return vec![1.0];
    };
    let consumer = g.layers[li]
        .forward
        .iter()
        .map(|&c| g.op(c))
        .find(|c| c.inputs.contains(&y));
    match consumer {
        Some(c) if matches!(c.kind, OpKind::Slice) => {
            let sizes: Vec<f64> = c
                .outputs
                .iter()
                .map(|&t| g.tensor(t).elements() as f64)
                .collect();
            let total: f64 = sizes.iter().sum();
            if total > 0.0 {
                sizes.iter().map(|s| s / total).collect()
            } else {
                vec![1.0]
            }
        }
        Some(c) if matches!(c.kind, OpKind::SwiGlu) => vec![0.5, 0.5],
        _ => vec![1.0],
    }
}

/// What pricing a layer needs besides its graph.
#[derive(Clone, Copy, Debug)]
pub struct Pricing<'a> {
    /// Tensor-parallel configuration.
    pub tp: TpConfig,
    /// Context-parallel configuration (the graph is one rank's: `seq / cp` tokens).
    pub cp: CpConfig,
    /// The GPU.
    pub device: &'a Device,
    /// How kernels run.
    pub kernels: &'a KernelOptions,
    /// Links of the tensor-parallel group.
    pub tp_link: Link,
    /// Links of the expert-parallel and expert tensor-parallel groups.
    pub expert_links: ExpertLinks,
    /// Where the context-parallel group's ranks sit.
    pub cp_groups: CpGroups,
    /// Measured times that override the analytic model.
    pub profile: Option<&'a Profile>,
}

/// Where a stage's expert-parallel and expert tensor-parallel groups run.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct ExpertLinks {
    /// The expert-parallel group (`ep` ranks, `etp` apart: Megatron-Core's expert rank order
    /// is etp, ep, edp, pp).
    pub ep: Link,
    /// The expert tensor-parallel group (`etp` neighbouring ranks).
    pub etp: Link,
}

impl ExpertLinks {
    /// Both groups on `link` (a model without experts never uses them).
    pub fn alone(link: Link) -> Self {
        ExpertLinks {
            ep: link,
            etp: link,
        }
    }
}

/// Graph-wide facts a layer's cost depends on, computed once per graph: who produced and who
/// saves each activation, which layer owns each parameter.
pub struct LayerCostContext<'g> {
    g: &'g Graph,
    owned: Vec<Vec<TensorId>>,
    producer: HashMap<TensorId, OpId>,
    savers: HashMap<TensorId, Vec<OpId>>,
}

/// A layer as its cost sees it, with names, ids and its position in the model left out:
/// tensors are numbered in order of first use, and the facts that come from outside the layer
/// (which inputs were produced before it, which saved activations selective recomputation can
/// drop, which parameters it owns or borrows) are recorded. Identical blocks are equal.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CanonicalLayer {
    kind: LayerKind,
    tensors: Vec<CanonicalTensor>,
    forward: Vec<CanonicalOp>,
    backward: Vec<CanonicalOp>,
    /// Saved activations, each with whether selective recomputation can drop it.
    saved: Vec<(u32, bool)>,
    inputs: Vec<u32>,
    owned: Vec<u32>,
    borrowed: Vec<u32>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
struct CanonicalTensor {
    shape: Vec<u64>,
    dtype: DType,
    kind: TensorKind,
    split: Split,
    requires_grad: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
struct CanonicalOp {
    kind: OpKind,
    pass: Pass,
    inputs: Vec<u32>,
    outputs: Vec<u32>,
    saves: Vec<u32>,
    attention_core: bool,
    eager: bool,
    // Only when set: a layer without FP8 products keeps the key it always had.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    fp8: bool,
    flops: f64,
}

impl<'g> LayerCostContext<'g> {
    /// Collects the graph-wide facts of `g`.
    pub fn new(g: &'g Graph) -> Self {
        let owned = g.owned_parameters();
        // Which op produced each activation, including the implicit ones (dropout masks).
        let mut producer: HashMap<TensorId, OpId> = HashMap::new();
        let mut savers: HashMap<TensorId, Vec<OpId>> = HashMap::new();
        for layer in &g.layers {
            for &o in &layer.forward {
                let op = g.op(o);
                for &t in op.outputs.iter().chain(&op.saves) {
                    if !op.inputs.contains(&t) {
                        producer.entry(t).or_insert(o);
                    }
                }
                for &t in &op.saves {
                    savers.entry(t).or_default().push(o);
                }
            }
        }
        LayerCostContext {
            g,
            owned,
            producer,
            savers,
        }
    }

    /// The graph.
    pub fn graph(&self) -> &'g Graph {
        self.g
    }

    fn is_core(&self, o: OpId) -> bool {
        self.g.op(o).attention_core
    }

    /// Whether selective recomputation can drop saved activation `t`: an attention-core op
    /// produced it and only attention-core ops keep it.
    fn recomputable(&self, t: TensorId) -> bool {
        self.producer.get(&t).is_some_and(|&p| self.is_core(p))
            && self
                .savers
                .get(&t)
                .is_some_and(|s| s.iter().all(|&o| self.is_core(o)))
    }

    /// The kernel op `o` runs, as profiles name it.
    pub fn op_signature(&self, o: OpId, p: &Pricing<'_>) -> OpSignature {
        let g = self.g;
        let op = g.op(o);
        let shapes = |ts: &[TensorId]| -> Vec<Vec<u64>> {
            ts.iter()
                .map(|&t| device_shape_in_op(g, op, t, p.tp))
                .collect()
        };
        let mut inputs = shapes(&op.inputs);
        let outputs = shapes(&op.outputs);
        // An op on sequence-split rows under SP (GPT-2's position embedding and its gradient)
        // reads the ids of those rows only: its kernel is on consistent shapes, the ones the
        // intra-op problem's strategy gives it.
        let split_rows = op
            .inputs
            .iter()
            .zip(&inputs)
            .chain(op.outputs.iter().zip(&outputs))
            .find_map(|(&t, local)| {
                let axis = divided_axis_in_op(g, op, t, p.tp)?;
                matches!(g.tensor(t).split, Split::Sequence(_)).then(|| (axis, local[axis]))
            });
        if let Some((axis, rows)) = split_rows {
            for (&t, local) in op.inputs.iter().zip(&mut inputs) {
                if g.tensor(t).dtype == DType::I32
                    && local.get(axis) == Some(&(rows * p.tp.t.max(1)))
                {
                    local[axis] = rows;
                }
            }
        }
        OpSignature {
            op: kernel_name(op.kind),
            pass: op.pass,
            dtype: kernel_dtype(op, p.kernels.dtype),
            inputs,
            outputs,
        }
    }

    fn collective_signature(
        kind: Collective,
        group: Group,
        p: &Pricing<'_>,
    ) -> CollectiveSignature {
        CollectiveSignature {
            collective: kind.into(),
            ranks: group.ranks(p.tp),
            internode: Self::group_link(group, p).internode(),
        }
    }

    /// The links of `group`.
    fn group_link(group: Group, p: &Pricing<'_>) -> Link {
        match group {
            Group::Tensor => p.tp_link,
            Group::Expert => p.expert_links.ep,
            Group::ExpertTensor => p.expert_links.etp,
        }
    }

    /// Time of op `o`'s kernel (plus the separate accumulation of a fresh weight gradient when
    /// the product does not fuse it), measured when the profile has its signature.
    fn op_time(&self, o: OpId, p: &Pricing<'_>, reads: &mut Vec<ProfileRead>) -> f64 {
        let (modelled, accumulate) = self.kernel_and_accumulation(o, p);
        let measured = p
            .profile
            .and_then(|prof| prof.op_time(&self.op_signature(o, p)));
        let kernel = match measured {
            Some((seconds, read)) => {
                reads.push(read);
                seconds
            }
            None => modelled,
        };
        kernel + accumulate
    }

    /// The analytic time of op `o`'s kernel, and of the separate kernels it needs: the
    /// accumulation of a fresh weight gradient into the gradient buffer when the product does
    /// not fuse it, and an FP8 product's cast of its operand ([`Graph::fp8_cast_operand`]).
    fn kernel_and_accumulation(&self, o: OpId, p: &Pricing<'_>) -> (f64, f64) {
        let g = self.g;
        let op = g.op(o);
        let kernels = p.kernels;
        let dtype = kernels.dtype;
        let tp = p.tp;
        let mut bytes = op_traffic(op, |t| tensor_bytes_in_op(g, op, t, tp));
        let mut accumulate = 0.0;
        for &t in &op.outputs {
            let tensor = g.tensor(t);
            if tensor.kind != TensorKind::WeightGradient {
                continue;
            }
            let (traffic, separate) = gradient_accumulation(
                stored_elements(g, t, tp),
                tensor.dtype.bytes() as f64,
                kernels.grad_buffer_bytes,
                kernels.grad_accumulation_fusion && op.kind.is_matmul(),
                p.device,
                dtype,
            );
            bytes += traffic;
            accumulate += separate;
        }
        accumulate += self.fp8_cast_time(o, p);
        let flops = op_device_flops(g, op, tp);
        let kernel = op_kernel_time(op, flops, bytes, p.device, dtype, gemm_shape(g, op, tp));
        (kernel, accumulate)
    }

    /// Every kernel and tensor-parallel collective of layer `li` with the time the analytic
    /// model gives it, in microseconds: what a profile measuring this layer would hold.
    pub fn modelled_entries(&self, li: usize, p: &Pricing<'_>) -> Profile {
        let g = self.g;
        let layer = &g.layers[li];
        let mut prof = Profile::new(p.device.name.clone());
        for &o in layer.forward.iter().chain(&layer.backward) {
            let (kernel, _) = self.kernel_and_accumulation(o, p);
            prof.insert_op(self.op_signature(o, p), kernel * 1e6);
        }
        for &o in &layer.forward {
            for coll in collectives(g, g.op(o), p.tp) {
                if coll.bytes > 0.0 {
                    let (n, link) = (coll.group.ranks(p.tp), Self::group_link(coll.group, p));
                    prof.insert_collective(
                        Self::collective_signature(coll.kind, coll.group, p),
                        coll.bytes as u64,
                        collective_time(coll.kind, n, coll.bytes, link) * 1e6,
                    );
                }
            }
        }
        prof
    }

    /// Time of a tensor-parallel collective, interpolated from the profile when it measured
    /// the collective on this group.
    fn collective_time(
        &self,
        coll: &TpCollective,
        p: &Pricing<'_>,
        reads: &mut Vec<ProfileRead>,
    ) -> f64 {
        let n = coll.group.ranks(p.tp);
        if n <= 1 || coll.bytes <= 0.0 {
            return 0.0;
        }
        let measured = p.profile.and_then(|prof| {
            prof.collective_time(
                &Self::collective_signature(coll.kind, coll.group, p),
                coll.bytes,
            )
        });
        match measured {
            Some((seconds, used)) => {
                reads.extend(used);
                seconds
            }
            None => collective_time(coll.kind, n, coll.bytes, Self::group_link(coll.group, p)),
        }
    }

    /// The cost of layer `li`, with the profile measurements it read.
    pub fn cost_with_reads(&self, li: usize, p: &Pricing<'_>) -> (LayerCost, Vec<ProfileRead>) {
        let g = self.g;
        let tp = p.tp;
        let layer = &g.layers[li];
        let mut reads = Vec::new();
        let mut c = LayerCost::empty(layer.kind);
        // The attention core attends a rank's queries to every key: `cp` times the work of
        // the graph's own tokens (see `context_parallel`).
        let cp = p.cp.c.max(1) as f64;
        let mut op_policy = OpPolicy::default();
        for &o in &layer.forward {
            let op = g.op(o);
            let mut t = self.op_time(o, p, &mut reads);
            let mut flops = op.flops;
            if op.attention_core && p.cp.c > 1 {
                let bwd_local = self.attention_backward_time(li, o, p);
                let cpa = context_parallel::attention(
                    p.cp,
                    t,
                    bwd_local,
                    self.attention_bytes(op, tp),
                    p.cp_groups,
                );
                t = cpa.fwd_compute;
                flops *= cp;
                c.fwd_comm += cpa.fwd_comm;
                c.bwd_comm += cpa.bwd_comm;
                c.attention_core_comm += cpa.fwd_comm;
            }
            c.fwd_compute += t;
            c.fwd_flops += flops;
            if op.attention_core {
                c.attention_core_compute += t;
                c.attention_core_flops += flops;
            }
            if op.kind == OpKind::CrossEntropy {
                c.loss_probs += op
                    .saves
                    .iter()
                    .map(|&t| stored_bytes(g, t, tp))
                    .sum::<f64>();
            }
            // The share of the op that torchtitan's `op` policy re-runs, and the bytes of its
            // output that it keeps.
            let (rerun, kept) = op_policy.share(self, li, o);
            c.op_policy_recompute += rerun * t;
            c.op_policy_flops += rerun * flops;
            c.saved_op_policy += op
                .outputs
                .iter()
                .chain(
                    op.saves
                        .iter()
                        .filter(|t| !op.inputs.contains(t) && !op.outputs.contains(t)),
                )
                .map(|&t| kept * stored_bytes(g, t, tp))
                .sum::<f64>();
            for coll in collectives(g, op, tp) {
                let mut ct = self.collective_time(&coll, p, &mut reads);
                if let Some(ub) = coll.userbuffers.filter(|_| p.kernels.tp_comm_overlap) {
                    let product = self.product_beside(li, o, &coll, p);
                    ct = ub.exposed(ct, product, coll.group.ranks(tp));
                }
                if coll.phase == Phase::Forward && coll.kind != Collective::ReduceScatter {
                    c.op_policy_recompute += rerun * ct;
                }
                match coll.phase {
                    Phase::Forward => c.fwd_comm += ct,
                    Phase::Backward => c.bwd_comm += ct,
                    // Issued ahead of the input-gradient product and overlapped with it; that
                    // product costs about what the weight-gradient product does (the same
                    // FLOPs), which is what the intra-op model charges against too.
                    Phase::BackwardOverlapped => {
                        let hidden = self.weight_gradient_time(li, o, p).unwrap_or(t);
                        c.bwd_comm += (ct - hidden).max(0.0)
                    }
                }
            }
        }
        for &o in &layer.backward {
            let op = g.op(o);
            let scale = if self.is_attention_backward(o) {
                cp
            } else {
                1.0
            };
            c.bwd_compute += self.op_time(o, p, &mut reads) * scale;
            c.bwd_flops += op.flops * scale;
            // As the op writes it: under sequence parallelism a tensor-parallel product's
            // input gradient is a whole partial sum before its reduce-scatter (Megatron-LM's
            // `LinearWithGradAccumulationAndAsyncCommunication.backward`).
            for &t in &op.outputs {
                if g.tensor(t).kind == TensorKind::Gradient {
                    c.grad_working = c.grad_working.max(tensor_bytes_in_op(g, op, t, tp));
                }
            }
        }
        for (saver, t) in g.saved_activations_with_savers(li) {
            let b = saved_bytes(g, g.op(saver), t, tp);
            c.saved += b;
            if !self.recomputable(t) {
                c.saved_selective += b;
            }
        }
        for t in g.layer_inputs(li) {
            c.checkpoint += stored_bytes(g, t, tp);
            c.saved_op_policy += stored_bytes(g, t, tp);
            c.input_bytes += g.tensor(t).bytes() as f64;
        }
        c.params = self.owned[li]
            .iter()
            .map(|&t| stored_elements(g, t, tp))
            .sum();
        c.expert_params = self.owned[li]
            .iter()
            // Routed experts' weights, reduced over the expert data-parallel group.
            .filter(|&&t| g.tensor(t).split.is_expert())
            .map(|&t| stored_elements(g, t, tp))
            .sum();
        let fp8_weights: Vec<TensorId> = layer
            .forward
            .iter()
            .filter_map(|&o| g.fp8_weight(g.op(o)))
            .collect();
        c.fp8_params = self.owned[li]
            .iter()
            .filter(|t| fp8_weights.contains(t))
            .map(|&t| stored_elements(g, t, tp))
            .sum();
        c.borrowed_params = self.borrowed(li, tp);
        (c, reads)
    }

    /// Whether backward op `o` is the gradient of an attention core.
    fn is_attention_backward(&self, o: OpId) -> bool {
        self.g
            .op(o)
            .grad_of
            .is_some_and(|f| self.g.op(f).attention_core)
    }

    /// Kernel time of the backward ops of attention-core op `o` of layer `li` over the graph's
    /// own tokens (their profile reads are recorded where the backward pass is priced).
    fn attention_backward_time(&self, li: usize, o: OpId, p: &Pricing<'_>) -> f64 {
        self.g.layers[li]
            .backward
            .iter()
            .filter(|&&b| self.g.op(b).grad_of == Some(o))
            .map(|&b| self.op_time(b, p, &mut Vec::new()))
            .sum()
    }

    /// Bytes one rank holds of an attention core's queries, keys and values, and output.
    fn attention_bytes(&self, op: &Op, tp: TpConfig) -> AttentionBytes {
        let g = self.g;
        let size = |t: TensorId| tensor_bytes_in_op(g, op, t, tp);
        let inputs: Vec<f64> = op.inputs.iter().map(|&t| size(t)).collect();
        AttentionBytes {
            q: inputs.first().copied().unwrap_or(0.0),
            kv: inputs.iter().skip(1).sum(),
            out: op.outputs.iter().map(|&t| size(t)).sum(),
        }
    }

    /// The backward op of layer `li` that forward op `o` implies: its weight-gradient
    /// product (`weight`) or its input-gradient one.
    fn gradient_op(&self, li: usize, o: OpId, weight: bool) -> Option<OpId> {
        let g = self.g;
        g.layers[li]
            .backward
            .iter()
            .copied()
            .find(|&b| g.op(b).grad_of == Some(o) && g.makes_weight_gradient(b) == weight)
    }

    /// Time of the weight-gradient product of forward op `o` of layer `li`, if it has one.
    fn weight_gradient_time(&self, li: usize, o: OpId, p: &Pricing<'_>) -> Option<f64> {
        let wgrad = self.gradient_op(li, o, true)?;
        // Its profile reads are recorded where the backward pass is priced.
        Some(self.op_time(wgrad, p, &mut Vec::new()))
    }

    /// The time of an FP8 product's cast of its operand ([`Graph::fp8_cast_operand`]; 0 for
    /// any other op), as the rank holds it (the sequence shard under sequence parallelism),
    /// before it is gathered in FP8 ([`crate::cost::tensor_parallel::collectives`]).
    fn fp8_cast_time(&self, o: OpId, p: &Pricing<'_>) -> f64 {
        let g = self.g;
        g.fp8_cast_operand(g.op(o)).map_or(0.0, |x| {
            let elements = stored_bytes(g, x, p.tp) / g.tensor(x).dtype.bytes() as f64;
            fp8_cast_time(elements, p.device)
        })
    }

    /// What hides forward op `o`'s collective `coll` when userbuffers overlap it
    /// ([`crate::cost::tp_comm_overlap`]): in the forward, the product itself; in the
    /// backward, its input-gradient product, which the gather of the output gradient feeds and
    /// which stands for the weight-gradient product the input gradient's reduce-scatter runs
    /// beside (the same FLOPs), as the intra-op model prices both. Without an FP8 cast: that
    /// runs before the gather.
    fn product_beside(&self, li: usize, o: OpId, coll: &TpCollective, p: &Pricing<'_>) -> f64 {
        let product = match coll.phase {
            Phase::Forward => Some(o),
            _ => self.gradient_op(li, o, false),
        };
        product.map_or(0.0, |b| {
            // Its profile reads are recorded where its pass is priced.
            self.op_time(b, p, &mut Vec::new()) - self.fp8_cast_time(b, p)
        })
    }

    /// The cost of layer `li`.
    pub fn cost(&self, li: usize, p: &Pricing<'_>) -> LayerCost {
        self.cost_with_reads(li, p).0
    }

    /// Parameters layer `li` reads that another layer owns, as (owning layer, elements per
    /// device): where the layer sits in the model, not part of its canonical form.
    pub fn borrowed(&self, li: usize, tp: TpConfig) -> Vec<(usize, f64)> {
        let g = self.g;
        g.borrowed_parameters(li, &self.owned)
            .iter()
            .filter_map(|&t| {
                let owner = self.owned.iter().position(|o| o.contains(&t))?;
                Some((owner, stored_elements(g, t, tp)))
            })
            .collect()
    }

    /// The profile measurements pricing layer `li` reads, without pricing it.
    pub fn profile_reads(&self, li: usize, p: &Pricing<'_>) -> Vec<ProfileRead> {
        let Some(prof) = p.profile else {
            return Vec::new();
        };
        let g = self.g;
        let layer = &g.layers[li];
        let mut reads = Vec::new();
        for &o in layer.forward.iter().chain(&layer.backward) {
            if let Some((_, read)) = prof.op_time(&self.op_signature(o, p)) {
                reads.push(read);
            }
        }
        for &o in &layer.forward {
            for coll in collectives(g, g.op(o), p.tp) {
                if coll.bytes > 0.0
                    && coll.group.ranks(p.tp) > 1
                    && let Some((_, used)) = prof.collective_time(
                        &Self::collective_signature(coll.kind, coll.group, p),
                        coll.bytes,
                    )
                {
                    reads.extend(used);
                }
            }
        }
        reads
    }

    /// Every kernel and collective signature layer `li` runs: the profile entries that could
    /// change its cost.
    pub fn signatures(
        &self,
        li: usize,
        p: &Pricing<'_>,
    ) -> (Vec<OpSignature>, Vec<CollectiveSignature>) {
        let g = self.g;
        let layer = &g.layers[li];
        let mut ops: Vec<OpSignature> = layer
            .forward
            .iter()
            .chain(&layer.backward)
            .map(|&o| self.op_signature(o, p))
            .collect();
        ops.sort();
        ops.dedup();
        let mut colls: Vec<CollectiveSignature> = Vec::new();
        for &o in &layer.forward {
            for coll in collectives(g, g.op(o), p.tp) {
                if coll.group.ranks(p.tp) > 1 {
                    colls.push(Self::collective_signature(coll.kind, coll.group, p));
                }
            }
        }
        colls.sort();
        colls.dedup();
        (ops, colls)
    }

    /// The canonical form of layer `li`.
    pub fn canonical(&self, li: usize) -> CanonicalLayer {
        let g = self.g;
        let layer = &g.layers[li];
        let mut ids: HashMap<TensorId, u32> = HashMap::new();
        let mut tensors = Vec::new();
        let mut id = |t: TensorId| -> u32 {
            *ids.entry(t).or_insert_with(|| {
                let tensor = g.tensor(t);
                tensors.push(CanonicalTensor {
                    shape: tensor.shape.clone(),
                    dtype: tensor.dtype,
                    kind: tensor.kind,
                    split: tensor.split,
                    requires_grad: tensor.requires_grad,
                });
                (tensors.len() - 1) as u32
            })
        };
        let ops = |list: &[OpId], id: &mut dyn FnMut(TensorId) -> u32| -> Vec<CanonicalOp> {
            list.iter()
                .map(|&o| {
                    let op = g.op(o);
                    CanonicalOp {
                        kind: op.kind,
                        pass: op.pass,
                        inputs: op.inputs.iter().map(|&t| id(t)).collect(),
                        outputs: op.outputs.iter().map(|&t| id(t)).collect(),
                        saves: op.saves.iter().map(|&t| id(t)).collect(),
                        attention_core: op.attention_core,
                        eager: op.eager,
                        fp8: op.fp8,
                        flops: op.flops,
                    }
                })
                .collect()
        };
        let forward = ops(&layer.forward, &mut id);
        let backward = ops(&layer.backward, &mut id);
        let saved = g
            .saved_activations(li)
            .into_iter()
            .map(|t| (id(t), self.recomputable(t)))
            .collect();
        let inputs = g.layer_inputs(li).into_iter().map(&mut id).collect();
        let owned = self.owned[li].iter().map(|&t| id(t)).collect();
        let borrowed = g
            .borrowed_parameters(li, &self.owned)
            .into_iter()
            .map(&mut id)
            .collect();
        CanonicalLayer {
            kind: layer.kind,
            tensors,
            forward,
            backward,
            saved,
            inputs,
            owned,
            borrowed,
        }
    }

    /// Whether layer `li` routes tokens to experts.
    fn has_experts(&self, li: usize) -> bool {
        self.g.layers[li]
            .forward
            .iter()
            .any(|&o| self.g.op(o).kind == OpKind::MoeDispatch)
    }

    /// The components of the key of layer `li`'s cost: exactly what the cost depends on.
    pub fn key_parts(&self, li: usize, p: &Pricing<'_>) -> KeyParts {
        KeyParts::new("layer-cost")
            .with("subgraph", &self.canonical(li))
            .with("parallelism", &(p.tp.t, p.tp.sp))
            // The cost reads the network only through the tensor-, context- and (for layers
            // with experts) expert-parallel groups' links.
            .with("device", &p.device.compute_part())
            .with("link", &p.tp_link)
            .with(
                "experts",
                &self
                    .has_experts(li)
                    .then_some((p.tp.ep, p.tp.etp, p.expert_links)),
            )
            .with(
                "context_parallel",
                &(p.cp.c > 1).then_some((p.cp, p.cp_groups)),
            )
            .with("kernels", p.kernels)
            .with("profile", &self.profile_reads(li, p))
    }
}

/// Costs of every layer of `g` on `device`, with tensor-parallel groups on `tp_link`, from the
/// analytic model alone.
pub fn layer_costs(
    g: &Graph,
    tp: TpConfig,
    device: &Device,
    kernels: &KernelOptions,
    tp_link: Link,
) -> Vec<LayerCost> {
    let ctx = LayerCostContext::new(g);
    let p = Pricing {
        tp,
        cp: CpConfig::NONE,
        device,
        kernels,
        tp_link,
        expert_links: ExpertLinks::alone(tp_link),
        cp_groups: CpGroups::alone(tp_link),
        profile: None,
    };
    (0..g.layers.len()).map(|li| ctx.cost(li, &p)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::cluster::preset;
    use crate::model::frontend::{
        Attention, Bias, LowerOptions, Mlp, Norm, Position, TransformerConfig,
    };

    /// `c` lowered at micro-batch 2 of 128 tokens, bf16, flash attention.
    fn lowered(c: TransformerConfig) -> Graph {
        c.lower(
            "m",
            &LowerOptions {
                micro_batch: 2,
                seq: 128,
                dtype: DType::Bf16,
                attention: Attention::Flash,
                vocab_multiple: 8,
                eager_elementwise: false,
                fp8: false,
            },
        )
        .expect("lowers")
    }

    fn gpt(layers: u64) -> Graph {
        lowered(TransformerConfig {
            hidden: 256,
            layers,
            heads: 4,
            kv_heads: 4,
            head_dim: 64,
            ffn_hidden: 1024,
            vocab: 1000,
            max_seq: 512,
            mlp: Mlp::Gelu,
            norm: Norm::LayerNorm,
            position: Position::Learned,
            tied_embeddings: true,
            bias: Bias::All,
            dropout: true,
            moe: None,
            mla: None,
            qk_norm: false,
        })
    }

    const KERNELS: KernelOptions = KernelOptions {
        dtype: DType::Bf16,
        grad_buffer_bytes: 4.0,
        grad_accumulation_fusion: true,
        tp_comm_overlap: false,
    };

    /// Pricing under `tp` with every group inside one 8-GPU node, no profile.
    fn on_one_node(device: &Device, tp: TpConfig) -> Pricing<'_> {
        let link = crate::cost::cluster::Cluster::from_preset("c", "h100-sxm", 1, Some(8))
            .expect("preset")
            .group_link(1, 2);
        Pricing {
            tp,
            cp: CpConfig::NONE,
            device,
            kernels: &KERNELS,
            tp_link: link,
            expert_links: ExpertLinks::alone(link),
            cp_groups: CpGroups::alone(link),
            profile: None,
        }
    }

    #[test]
    fn identical_blocks_share_a_key_wherever_they_sit() {
        let device = preset("h100-sxm").expect("preset");
        let p = on_one_node(&device, TpConfig::dense(2, true));
        let keys = |g: &Graph| -> Vec<_> {
            let ctx = LayerCostContext::new(g);
            (0..g.layers.len())
                .map(|li| ctx.key_parts(li, &p).key())
                .collect()
        };
        let four = gpt(4);
        let k4 = keys(&four);
        // Embedding, four blocks, head: three distinct keys.
        assert_eq!(k4.len(), 6);
        assert!(k4[1..5].iter().all(|k| *k == k4[1]));
        assert_ne!(k4[0], k4[1]);
        assert_ne!(k4[5], k4[1]);
        assert_ne!(k4[0], k4[5]);
        // More blocks change no layer's key.
        let k7 = keys(&gpt(7));
        assert_eq!(k7[0], k4[0]);
        assert_eq!(k7[3], k4[1]);
        assert_eq!(k7[8], k4[5]);
        // The cost of each block is the same too (what makes sharing a key sound).
        let ctx = LayerCostContext::new(&four);
        assert_eq!(ctx.cost(1, &p), ctx.cost(4, &p));
    }

    #[test]
    fn a_measured_kernel_replaces_the_model_only_where_its_signature_appears() {
        let device = preset("h100-sxm").expect("preset");
        let g = gpt(2);
        let ctx = LayerCostContext::new(&g);
        let link = crate::cost::cluster::Link {
            latency: 1e-5,
            bandwidth: 1e11,
            pairwise_bandwidth: 1e11,
            nodes: 1,
        };
        let base = Pricing {
            tp: TpConfig::dense(1, false),
            cp: CpConfig::NONE,
            device: &device,
            kernels: &KERNELS,
            tp_link: link,
            expert_links: ExpertLinks::alone(link),
            cp_groups: CpGroups::alone(link),
            profile: None,
        };
        // Measure the first forward matrix product of block 1 at ten times its modelled time.
        let block = &g.layers[1];
        let mm = *block
            .forward
            .iter()
            .find(|&&o| g.op(o).kind.is_matmul())
            .expect("a block has matrix products");
        let sig = ctx.op_signature(mm, &base);
        let before = ctx.cost(1, &base);
        let mut reads = Vec::new();
        let modelled = ctx.op_time(mm, &base, &mut reads);
        assert!(reads.is_empty());
        let mut prof = Profile::new("h100-sxm");
        prof.insert_op(sig.clone(), modelled * 10.0 * 1e6);
        let p = Pricing {
            profile: Some(&prof),
            ..base
        };
        let (after, reads) = ctx.cost_with_reads(1, &p);
        // Every op of the block with that signature now costs ten times as much.
        let same: usize = block
            .forward
            .iter()
            .filter(|&&o| ctx.op_signature(o, &base) == sig)
            .count();
        let delta = after.fwd_compute - before.fwd_compute;
        assert!(
            (delta - same as f64 * 9.0 * modelled).abs() < 1e-12,
            "{delta} vs {same} x 9 x {modelled}"
        );
        assert_eq!(reads.len(), same);
        assert_eq!(
            ctx.profile_reads(1, &p),
            reads,
            "reads are known without pricing"
        );
        // Keys change for the layers that run the kernel, and only for them.
        for li in 0..g.layers.len() {
            let runs = ctx.signatures(li, &base).0.contains(&sig);
            let changed = ctx.key_parts(li, &p).key() != ctx.key_parts(li, &base).key();
            assert_eq!(runs, changed, "layer {li}");
        }
    }

    /// torchtitan's op policy on a Llama block (grouped-query attention, SwiGLU): of the
    /// seven linear layers q, k, v, o, gate, up, down it keeps q, v, gate and down, and the
    /// attention kernel's output; it re-runs k, o, up and every op that is not a matrix
    /// product or the attention kernel.
    #[test]
    fn torchtitans_op_policy_keeps_every_other_linear_and_the_attention_output() {
        let g = lowered(TransformerConfig {
            hidden: 256,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            ffn_hidden: 512,
            vocab: 1000,
            max_seq: 512,
            mlp: Mlp::SwiGlu,
            norm: Norm::RmsNorm,
            position: Position::Rope,
            tied_embeddings: false,
            bias: Bias::None,
            dropout: false,
            moe: None,
            mla: None,
            qk_norm: false,
        });
        let device = preset("h100-sxm").expect("preset");
        let p = on_one_node(&device, TpConfig::dense(1, false));
        let ctx = LayerCostContext::new(&g);
        let c = ctx.cost(1, &p);
        // 256 tokens of bf16: the block input, q (256 wide) and v (128) of the fused 512-wide
        // projection, the attention output (256), gate (512 of the 1024-wide gate/up product)
        // and down (256).
        let tokens = 256.0;
        let op = |name: &str| {
            g.layers[1]
                .forward
                .iter()
                .map(|&o| g.op(o))
                .find(|o| o.name.ends_with(name))
                .unwrap_or_else(|| panic!("no op {name}"))
        };
        let kept = tokens * 2.0 * (256.0 + 256.0 + 128.0 + 256.0 + 512.0 + 256.0);
        assert_eq!(c.saved_op_policy, kept);
        assert!(c.checkpoint < c.saved_op_policy && c.saved_op_policy < c.saved);
        // Re-run: a quarter of the fused projection (k), o, half of gate/up, and the rest.
        let rest: f64 = g.layers[1]
            .forward
            .iter()
            .map(|&o| g.op(o))
            .filter(|o| !o.kind.is_matmul() && !matches!(o.kind, OpKind::FlashAttention { .. }))
            .map(|o| o.flops)
            .sum();
        let rerun = 0.25 * op("attention.qkv").flops
            + op("attention.proj").flops
            + 0.5 * op("mlp.gate_up").flops
            + rest;
        assert!(
            (c.op_policy_flops - rerun).abs() <= 1e-9 * rerun,
            "{} vs {rerun}",
            c.op_policy_flops
        );
        assert!(c.op_policy_recompute > 0.0 && c.op_policy_recompute < c.fwd_compute);
        // The count starts again in every block.
        assert_eq!(ctx.cost(2, &p), c);
    }
}
