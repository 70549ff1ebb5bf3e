//! The op graph: the one intermediate representation every model source lowers to.
//!
//! A [`Graph`] holds tensors (with shapes, dtypes and how tensor parallelism splits them) and ops
//! (forward and backward, with FLOPs), grouped into [`Layer`]s. It is instantiated at a concrete
//! micro-batch size and sequence length, so every number in it is exact for that shape.
//! Frontends build the forward part with [`GraphBuilder`]; [`GraphBuilder::finish`] derives the
//! backward ops (see `autodiff`) so that backward semantics live in one place.

mod autodiff;
mod builder;
mod flops;
mod summary;

pub use builder::GraphBuilder;
pub use summary::{GraphSummary, LayerGroup, LayerSummary, OpSummary};

use serde::{Deserialize, Serialize};

/// Element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// IEEE single precision.
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE half precision.
    F16,
    /// 32-bit integer (token ids, labels).
    I32,
    /// Bytes (dropout masks).
    U8,
    /// An 8-bit float (E4M3 or E5M2): the copies Transformer Engine casts a matrix product's
    /// operands to under FP8 training ([`Op::fp8`]).
    F8,
}

impl DType {
    /// Size of one element in bytes.
    pub fn bytes(self) -> u64 {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::Bf16 | DType::F16 => 2,
            DType::U8 | DType::F8 => 1,
        }
    }
}

/// Index of a tensor in [`Graph::tensors`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TensorId(pub u32);

/// Index of an op in [`Graph::ops`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct OpId(pub u32);

/// What a tensor is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TensorKind {
    /// Data fed to the model (token ids, labels); never differentiated.
    Input,
    /// A trained weight.
    Parameter,
    /// An intermediate value of the forward pass.
    Activation,
    /// The gradient of an activation: transient, alive during the backward pass only.
    Gradient,
    /// The gradient of a parameter: accumulated in the gradient buffer over micro-batches.
    WeightGradient,
}

/// How tensor parallelism (degree `t`) distributes a tensor over its group.
///
/// This is Megatron-LM's scheme expressed on tensors: a `Model` split divides a weight or
/// activation along a feature axis (heads, FFN width, vocabulary) on every rank; a `Sequence`
/// split applies only under sequence parallelism, where token-major activations outside the
/// model-parallel regions are divided along the sequence axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "split", content = "axis", rename_all = "lowercase")]
pub enum Split {
    /// Replicated on every tensor-parallel rank.
    None,
    /// Divided along this axis under sequence parallelism, replicated otherwise.
    Sequence(u8),
    /// Divided along this axis by tensor parallelism.
    Model(u8),
    /// An expert-major tensor of a mixture-of-experts layer (`[E, ..]`): its experts (axis 0)
    /// are divided by expert parallelism; for an activation `[E, C, ..]`, axis 1 holds the
    /// tokens routed to each expert.
    Experts,
    /// As [`Split::Experts`], with this axis also divided by expert tensor parallelism.
    ExpertModel(u8),
}

impl Split {
    /// Whether the split is an expert-major one ([`Split::Experts`] or
    /// [`Split::ExpertModel`]): a routed expert's weight or token buffer.
    pub fn is_expert(self) -> bool {
        matches!(self, Split::Experts | Split::ExpertModel(_))
    }
}

/// A tensor of the graph.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Tensor {
    /// Name, unique in the graph (informational: never part of a cache key).
    pub name: String,
    /// Shape at the graph's micro-batch size and sequence length.
    pub shape: Vec<u64>,
    /// Element type.
    pub dtype: DType,
    /// Role of the tensor.
    pub kind: TensorKind,
    /// Tensor-parallel distribution.
    pub split: Split,
    /// Whether a gradient flows to this tensor.
    pub requires_grad: bool,
}

impl Tensor {
    /// Number of elements (saturating: shapes come from user files).
    pub fn elements(&self) -> u64 {
        self.shape.iter().fold(1u64, |n, &d| n.saturating_mul(d))
    }

    /// Size in bytes of the whole (unsharded) tensor.
    pub fn bytes(&self) -> u64 {
        self.elements().saturating_mul(self.dtype.bytes())
    }

    /// Size in bytes of its FP8 copy (one byte per element), as Transformer Engine keeps and
    /// gathers it.
    pub fn fp8_copy_bytes(&self) -> u64 {
        self.elements().saturating_mul(DType::F8.bytes())
    }
}

/// Operation kinds. Backward ops reuse these kinds; [`Op::grad_of`] links them to the forward op.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "op")]
pub enum OpKind {
    /// Row gather `y[.., h] = table[ids]`; inputs `[ids, table]`.
    Embedding,
    /// Scatter-add of the output gradient into the embedding table (backward only).
    EmbeddingGrad,
    /// `y = x · w (+ bias)` with `w` of shape `[k, n]`, or `[n, k]` when `transpose_b`;
    /// inputs `[x, w]` or `[x, w, bias]`.
    MatMul {
        /// The weight is stored transposed (`[n, k]`), as a tied output embedding is.
        transpose_b: bool,
    },
    /// Batched product `c[.., m, n] = a[.., m, k] · b[.., k, n]` (`b[.., n, k]` when
    /// `transpose_b`); leading axes of `b` may divide those of `a` (grouped-query attention).
    BatchMatMul {
        /// `b` is given as `[.., n, k]`.
        transpose_b: bool,
    },
    /// Layer normalisation over the last axis; inputs `[x, gamma, beta]`.
    LayerNorm,
    /// RMS normalisation over the last axis; inputs `[x, gamma]`.
    RmsNorm,
    /// Fused scale + causal mask + softmax over the last axis.
    Softmax,
    /// GeLU (tanh approximation).
    Gelu,
    /// SiLU.
    Silu,
    /// Fused SwiGLU: `silu(x[.., :f]) * x[.., f:]`, output `[.., f]`.
    SwiGlu,
    /// Elementwise sum of two tensors.
    Add,
    /// Elementwise product of two tensors.
    Mul,
    /// Dropout; keeps a one-byte mask for the backward pass.
    Dropout,
    /// Fused dropout of `x` plus residual add: `y = dropout(x) + residual`; inputs `[x, residual]`.
    DropoutAdd,
    /// Rotary position embedding applied to queries or keys.
    Rope,
    /// Fused attention core (FlashAttention): inputs `[q, k, v]` shaped `[b, heads, s, d]`.
    FlashAttention {
        /// Causal masking: only the lower triangle of the score matrix is computed.
        causal: bool,
        /// The implementation that runs it: the same result at a different speed.
        #[serde(default, skip_serializing_if = "FlashKernel::is_cuda")]
        kernel: FlashKernel,
    },
    /// Softmax cross-entropy of logits `[.., V]` against integer labels; output is the loss.
    CrossEntropy,
    /// One input viewed as several outputs whose sizes add up to it (the fused QKV projection
    /// seen as q, k and v). A view in the forward pass; its backward assembles the gradients.
    Slice,
    /// A copy of the input into another axis order (`permute(..).contiguous()`).
    Transpose,
    /// Several inputs joined along the last axis into one output; an input whose other axes
    /// are 1 where the output's are not is broadcast along them (MLA's shared rotary key
    /// joined to every head's key).
    Concat,
    /// Router of a mixture-of-experts layer: scores `[.., E]` become the top-k gates `[.., k]`
    /// (fp32) and the chosen experts' indices `[.., k]` (i32).
    MoeRouter,
    /// Token dispatch: tokens `[.., h]` and the router's indices `[.., k]` become the
    /// expert-major buffer `[E, C, h]` (each token copied once per chosen expert; `C` the
    /// tokens per expert, padded to the capacity).
    MoeDispatch,
    /// Token combine: the experts' outputs `[E, C, h]`, the gates and the indices `[.., k]`
    /// become `[.., h]`, each token the gate-weighted sum of its experts' outputs.
    MoeCombine,
    /// An op of a kind autopar does not model (a graph file's custom kernel): it reads its
    /// inputs and writes its outputs, costs no FLOPs autopar knows of, and is never split
    /// inside, so every solver keeps its tensors replicated, except along the batch when
    /// `batched`. Its backward pass is one opaque op reading the output gradients and the
    /// forward inputs.
    Opaque {
        /// Axis 0 of every operand and result but the weights (and their gradients) is the
        /// batch: the op may run on a share of the samples, as data parallelism runs every op.
        batched: bool,
    },
}

impl OpKind {
    /// Short lower-case name used in reports and in the graph file format.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::Embedding => "embedding",
            OpKind::EmbeddingGrad => "embedding_grad",
            OpKind::MatMul { .. } => "matmul",
            OpKind::BatchMatMul { .. } => "batch_matmul",
            OpKind::LayerNorm => "layernorm",
            OpKind::RmsNorm => "rmsnorm",
            OpKind::Softmax => "softmax",
            OpKind::Gelu => "gelu",
            OpKind::Silu => "silu",
            OpKind::SwiGlu => "swiglu",
            OpKind::Add => "add",
            OpKind::Mul => "mul",
            OpKind::Dropout => "dropout",
            OpKind::DropoutAdd => "dropout_add",
            OpKind::Rope => "rope",
            OpKind::FlashAttention { .. } => "flash_attention",
            OpKind::CrossEntropy => "cross_entropy",
            OpKind::Slice => "slice",
            OpKind::Transpose => "transpose",
            OpKind::Concat => "concat",
            OpKind::MoeRouter => "moe_router",
            OpKind::MoeDispatch => "moe_dispatch",
            OpKind::MoeCombine => "moe_combine",
            OpKind::Opaque { .. } => "opaque",
        }
    }

    /// Whether eager PyTorch runs this kind as a composite of several elementwise kernels
    /// where fused implementations run one ([`crate::cost::analytic::eager_traffic_factor`]).
    pub fn has_eager_composite(self) -> bool {
        matches!(self, OpKind::RmsNorm | OpKind::Rope | OpKind::SwiGlu)
    }

    /// Whether the op runs on tensor cores as a matrix product (roofline uses the matmul peak).
    pub fn is_matmul(self) -> bool {
        matches!(self, OpKind::MatMul { .. } | OpKind::BatchMatMul { .. })
    }
}

/// Implementation of the fused attention kernel ([`OpKind::FlashAttention`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FlashKernel {
    /// FlashAttention-2's CUDA kernels (`flash-attn`, PyTorch's SDPA flash backend), priced
    /// with [`crate::cost::cluster::Device::attention_efficiency`].
    #[default]
    Cuda,
    /// FlashAttention written in Triton (`flash_attn.flash_attn_triton`), llm-foundry's
    /// `attn_impl: triton`.
    Triton,
    /// cuDNN's fused attention (Transformer Engine's `FusedAttention`), priced with
    /// [`crate::cost::cluster::Device::fused_attention_efficiency`].
    Cudnn,
    /// Whichever of [`FlashKernel::Cuda`] and [`FlashKernel::Cudnn`] is faster on the device,
    /// as Transformer Engine's backend selection picks.
    Auto,
}

impl FlashKernel {
    /// Whether this is the default CUDA implementation.
    pub fn is_cuda(&self) -> bool {
        *self == FlashKernel::Cuda
    }
}

/// Forward or backward pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pass {
    /// Forward pass.
    Forward,
    /// Backward pass.
    Backward,
}

/// One operation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Op {
    /// Name (informational).
    pub name: String,
    /// What the op computes.
    pub kind: OpKind,
    /// Forward or backward.
    pub pass: Pass,
    /// Operands, in the order the kind documents.
    pub inputs: Vec<TensorId>,
    /// Results.
    pub outputs: Vec<TensorId>,
    /// Forward ops: the activations kept alive for the backward pass.
    pub saves: Vec<TensorId>,
    /// Index of the layer the op belongs to.
    pub layer: u32,
    /// Part of the attention core (score/softmax/context ops): the ops that selective
    /// activation recomputation re-runs instead of storing their outputs.
    pub attention_core: bool,
    /// Runs as eager PyTorch's composite of elementwise kernels, not one fused kernel
    /// ([`crate::cost::analytic::eager_traffic_factor`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub eager: bool,
    /// A matrix product that runs on the FP8 tensor cores (Transformer Engine's linear layers
    /// under `fp8`: a transformer block's products with a weight, forward and backward): its
    /// operands are cast to FP8 first ([`Graph::fp8_cast_operand`]) and it keeps an FP8 copy
    /// of its input for the backward pass instead of the input itself.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fp8: bool,
    /// Floating-point operations of the whole (unsharded) op.
    pub flops: f64,
    /// Backward ops: the forward op they differentiate.
    pub grad_of: Option<OpId>,
}

/// Role of a layer in the model, used to place layers on pipeline stages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LayerKind {
    /// Input embedding: placed on the first pipeline stage.
    Embedding,
    /// A repeated body layer: distributed evenly over pipeline stages.
    Block,
    /// Final norm, output projection and loss: placed on the last pipeline stage.
    Head,
}

impl LayerKind {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            LayerKind::Embedding => "embedding",
            LayerKind::Block => "block",
            LayerKind::Head => "head",
        }
    }
}

/// A contiguous group of ops: the unit that pipeline stages are made of.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Layer {
    /// Name (informational).
    pub name: String,
    /// Role of the layer.
    pub kind: LayerKind,
    /// Forward ops in execution order.
    pub forward: Vec<OpId>,
    /// Backward ops in execution order.
    pub backward: Vec<OpId>,
}

/// The op graph of a model at one micro-batch size and sequence length.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Graph {
    /// Model name (informational).
    pub name: String,
    /// Micro-batch size the shapes were instantiated with.
    pub micro_batch: u64,
    /// Sequence length the shapes were instantiated with.
    pub seq: u64,
    /// All tensors.
    pub tensors: Vec<Tensor>,
    /// All ops: forward ops in execution order, then backward ops in execution order.
    pub ops: Vec<Op>,
    /// Layers in forward order.
    pub layers: Vec<Layer>,
}

impl Graph {
    /// The tensor with this id.
    pub fn tensor(&self, id: TensorId) -> &Tensor {
        &self.tensors[id.0 as usize]
    }

    /// The op with this id.
    pub fn op(&self, id: OpId) -> &Op {
        &self.ops[id.0 as usize]
    }

    /// The operand an FP8 product ([`Op::fp8`]) casts to FP8 in a kernel of its own before it
    /// runs: the input of a forward product and the output gradient of an input-gradient
    /// product (Transformer Engine's `cast_transpose`, which also writes the transposed copy
    /// the weight-gradient product reads); a weight-gradient product reads copies made
    /// before it. `None` for any other op.
    pub fn fp8_cast_operand(&self, op: &Op) -> Option<TensorId> {
        let casts = op.fp8
            && (op.pass == Pass::Forward
                || !op
                    .outputs
                    .iter()
                    .any(|&t| self.tensor(t).kind == TensorKind::WeightGradient));
        casts.then(|| op.inputs.first().copied()).flatten()
    }

    /// The activation an FP8 product ([`Op::fp8`]) reads that its forward product keeps as an
    /// FP8 copy (one byte per element): the input of the forward product, which the
    /// weight-gradient product reads back from that copy (under sequence parallelism it
    /// gathers the copy's shard, as Transformer Engine's `_Linear` does). `None` for any
    /// other op.
    pub fn fp8_saved_operand(&self, op: &Op) -> Option<TensorId> {
        let x = *op.inputs.first()?;
        let wgrad = op.pass == Pass::Backward
            && op
                .outputs
                .iter()
                .any(|&t| self.tensor(t).kind == TensorKind::WeightGradient);
        (op.fp8
            && (op.pass == Pass::Forward || wgrad)
            && self.tensor(x).kind == TensorKind::Activation)
            .then_some(x)
    }

    /// The weight a forward FP8 product ([`Op::fp8`]) reads, whose FP8 copy and transpose are
    /// kept between micro-batches and cast once per step. `None` for any other op.
    pub fn fp8_weight(&self, op: &Op) -> Option<TensorId> {
        (op.fp8 && op.pass == Pass::Forward)
            .then(|| op.inputs.get(1).copied())
            .flatten()
    }

    /// Whether op `id` makes a weight gradient (a weight-gradient product, a norm's or a
    /// bias's backward).
    pub fn makes_weight_gradient(&self, id: OpId) -> bool {
        self.op(id)
            .outputs
            .iter()
            .any(|&t| self.tensor(t).kind == TensorKind::WeightGradient)
    }

    /// Total number of trained parameters (a weight shared by two layers counts once;
    /// saturating, as shapes are).
    pub fn parameter_count(&self) -> u64 {
        self.tensors
            .iter()
            .filter(|t| t.kind == TensorKind::Parameter)
            .map(Tensor::elements)
            .fold(0u64, u64::saturating_add)
    }

    /// Parameters one token's forward pass reads: every parameter, except that of each
    /// mixture-of-experts layer's routed experts (weights split as [`Split::Experts`] or
    /// [`Split::ExpertModel`]) only the `k` of `E` its router chooses count. Returns the count
    /// with the input embedding tables whole (as Mistral counts Mixtral-8x7B's 12.9B) and
    /// without them (as DeepSeek counts V3's 37B): a token reads one row of them.
    pub fn active_parameter_counts(&self) -> (u64, u64) {
        // Tables only embedding lookups read (a tied table is read whole by the output layer).
        let mut lookup_only = vec![true; self.tensors.len()];
        for op in self.ops.iter().filter(|o| o.pass == Pass::Forward) {
            if op.kind != OpKind::Embedding {
                for &t in &op.inputs {
                    lookup_only[t.0 as usize] = false;
                }
            }
        }
        let mut active = 0.0f64;
        let mut tables = 0.0f64;
        let mut seen = vec![false; self.tensors.len()];
        for layer in &self.layers {
            // The layer's routing fraction k / E, from its router's scores and gates.
            let routed = layer.forward.iter().find_map(|&o| {
                let op = self.op(o);
                (op.kind == OpKind::MoeRouter).then(|| {
                    let e = *self.tensor(op.inputs[0]).shape.last().unwrap_or(&1);
                    let k = *self.tensor(op.outputs[0]).shape.last().unwrap_or(&1);
                    k as f64 / e.max(1) as f64
                })
            });
            for &o in &layer.forward {
                for &t in &self.op(o).inputs {
                    let tensor = self.tensor(t);
                    if tensor.kind != TensorKind::Parameter || seen[t.0 as usize] {
                        continue;
                    }
                    seen[t.0 as usize] = true;
                    let n = tensor.elements() as f64;
                    active += match routed {
                        Some(f) if tensor.split.is_expert() => n * f,
                        _ => n,
                    };
                    if lookup_only[t.0 as usize] {
                        tables += n;
                    }
                }
            }
        }
        (active.round() as u64, (active - tables).round() as u64)
    }

    /// The first op of a kind that only the Megatron-LM layout space prices: those of
    /// mixture-of-experts layers and of multi-head latent attention (the intra-op ILP and the
    /// CPU executor do not model them yet).
    pub fn first_megatron_only_op(&self) -> Option<&Op> {
        self.ops.iter().find(|o| {
            matches!(
                o.kind,
                OpKind::Concat | OpKind::MoeRouter | OpKind::MoeDispatch | OpKind::MoeCombine
            )
        })
    }

    /// Parameters owned by each layer: a weight belongs to the first layer that reads it.
    /// Returns, per layer, the owned parameter tensors.
    pub fn owned_parameters(&self) -> Vec<Vec<TensorId>> {
        let mut owner: Vec<Option<u32>> = vec![None; self.tensors.len()];
        let mut owned = vec![Vec::new(); self.layers.len()];
        for (li, layer) in self.layers.iter().enumerate() {
            for &op in &layer.forward {
                for &t in &self.op(op).inputs {
                    if self.tensor(t).kind == TensorKind::Parameter && owner[t.0 as usize].is_none()
                    {
                        owner[t.0 as usize] = Some(li as u32);
                        owned[li].push(t);
                    }
                }
            }
        }
        owned
    }

    /// Parameters a layer reads that another (earlier) layer owns: a tied output embedding.
    /// A pipeline stage that holds this layer but not the owner keeps its own copy. `owned` is
    /// [`Graph::owned_parameters`].
    pub fn borrowed_parameters(&self, layer: usize, owned: &[Vec<TensorId>]) -> Vec<TensorId> {
        let mut out = Vec::new();
        for &op in &self.layers[layer].forward {
            for &t in &self.op(op).inputs {
                if self.tensor(t).kind == TensorKind::Parameter
                    && !owned[layer].contains(&t)
                    && !out.contains(&t)
                {
                    out.push(t);
                }
            }
        }
        out
    }

    /// Activations the forward ops of a layer keep for the backward pass, each listed once.
    pub fn saved_activations(&self, layer: usize) -> Vec<TensorId> {
        self.saved_activations_with_savers(layer)
            .into_iter()
            .map(|(_, t)| t)
            .collect()
    }

    /// [`Graph::saved_activations`], each with the first forward op that saves it.
    pub fn saved_activations_with_savers(&self, layer: usize) -> Vec<(OpId, TensorId)> {
        let mut out: Vec<(OpId, TensorId)> = Vec::new();
        for &op in &self.layers[layer].forward {
            for &t in &self.op(op).saves {
                if !out.iter().any(|&(_, u)| u == t) {
                    out.push((op, t));
                }
            }
        }
        out
    }

    /// Activations a layer reads that were produced before it (its checkpoint under full
    /// recomputation). Parameters and model inputs are excluded.
    pub fn layer_inputs(&self, layer: usize) -> Vec<TensorId> {
        let forward = &self.layers[layer].forward;
        let produced_here: Vec<TensorId> = forward
            .iter()
            .flat_map(|&o| self.op(o).outputs.iter().copied())
            .collect();
        let mut out = Vec::new();
        for &op in forward {
            for &t in &self.op(op).inputs {
                if self.tensor(t).kind == TensorKind::Activation
                    && !produced_here.contains(&t)
                    && !out.contains(&t)
                {
                    out.push(t);
                }
            }
        }
        out
    }

    /// Forward FLOPs of one micro-batch through the whole model.
    pub fn forward_flops(&self) -> f64 {
        self.pass_flops(Pass::Forward)
    }

    /// Backward FLOPs of one micro-batch through the whole model.
    pub fn backward_flops(&self) -> f64 {
        self.pass_flops(Pass::Backward)
    }

    fn pass_flops(&self, pass: Pass) -> f64 {
        self.ops
            .iter()
            .filter(|o| o.pass == pass)
            .map(|o| o.flops)
            .sum()
    }

    /// Indices of layers of kind [`LayerKind::Block`].
    pub fn block_layers(&self) -> Vec<usize> {
        self.layers
            .iter()
            .enumerate()
            .filter(|(_, l)| l.kind == LayerKind::Block)
            .map(|(i, _)| i)
            .collect()
    }
}

/// A malformed graph: an op whose operands do not fit its kind, a dangling tensor reference, ...
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("op `{op}`: {message}")]
pub struct GraphError {
    /// Name of the offending op (or tensor).
    pub op: String,
    /// What is wrong.
    pub message: String,
}

impl GraphError {
    pub(crate) fn new(op: impl Into<String>, message: impl Into<String>) -> Self {
        GraphError {
            op: op.into(),
            message: message.into(),
        }
    }
}
