//! Decoder-only transformers (GPT-2/GPT-3, LLaMA, Mistral, Qwen2) lowered to the op graph.
//!
//! The lowering follows Megatron-LM's implementation, op for op where it matters for cost and
//! memory: fused QKV and fused gate/up projections, column-parallel projections into the
//! attention and MLP, row-parallel projections out of them, vocabulary-parallel embedding, output
//! layer and cross-entropy, fused bias-dropout-add. Saved activations therefore reproduce the
//! accounting of Korthikanti et al. 2022 (34·s·b·h + 5·a·s²·b per GPT layer, ALGORITHMS.md §5).

use crate::error::FieldError;
use crate::limits;
use crate::model::graph::{
    DType, FlashKernel, Graph, GraphBuilder, GraphError, LayerKind, OpKind, Split, TensorId,
    TensorKind,
};
use serde::{Deserialize, Serialize};

/// Feed-forward block variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mlp {
    /// `W2 · gelu(W1 · x)` (GPT).
    Gelu,
    /// `W2 · (silu(Wg · x) ⊙ (Wu · x))` (LLaMA family).
    SwiGlu,
}

/// Normalisation layer variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Norm {
    /// LayerNorm with gain and bias.
    LayerNorm,
    /// RMSNorm with gain.
    RmsNorm,
}

/// Position encoding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Position {
    /// A learned table of `max_seq` position embeddings (GPT).
    Learned,
    /// Rotary embeddings applied to queries and keys (LLaMA).
    Rope,
}

/// Which linear layers carry a bias.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Bias {
    /// Every linear layer (GPT).
    All,
    /// Only the query/key/value projection (Qwen2).
    Qkv,
    /// None (LLaMA).
    None,
}

/// How the attention core is executed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Attention {
    /// One fused kernel that never stores the score matrix: FlashAttention-2's CUDA kernels
    /// (`flash-attn`, PyTorch's `scaled_dot_product_attention`, whose backend priority puts
    /// flash attention first; Megatron-Core's `--attention-backend flash`;
    /// [`FlashKernel::Cuda`]).
    Flash,
    /// The same fused kernel written in Triton ([`FlashKernel::Triton`]): llm-foundry's
    /// `attn_impl: triton`.
    #[serde(rename = "flash-triton")]
    FlashTriton,
    /// cuDNN's fused flash attention, Transformer Engine's `FusedAttention` (Megatron-Core's
    /// `--attention-backend fused`; [`FlashKernel::Cudnn`]).
    Fused,
    /// Transformer Engine's `DotProductAttention` left to choose (Megatron-Core's default
    /// `--attention-backend auto`): it disables flash-attn "to give FusedAttention preference
    /// on Hopper+" and runs flash-attn on Ampere, the faster kernel on each
    /// ([`FlashKernel::Auto`]).
    Auto,
    /// Score matmul, softmax, dropout and context matmul as separate kernels with the score
    /// matrix in memory (Megatron-LM before flash attention, e.g. its 2021 results).
    Unfused,
}

impl Attention {
    /// Every implementation.
    pub const ALL: [Attention; 5] = [
        Attention::Flash,
        Attention::FlashTriton,
        Attention::Fused,
        Attention::Auto,
        Attention::Unfused,
    ];

    /// Its name in workspace files, flags and runs files.
    pub fn name(self) -> &'static str {
        match self {
            Attention::Flash => "flash",
            Attention::FlashTriton => "flash-triton",
            Attention::Fused => "fused",
            Attention::Auto => "auto",
            Attention::Unfused => "unfused",
        }
    }

    /// The implementation named `s`.
    pub fn parse(s: &str) -> Option<Attention> {
        Attention::ALL.into_iter().find(|a| a.name() == s)
    }

    /// Every name, comma-separated (for error messages).
    pub fn names() -> String {
        Attention::ALL.map(Attention::name).join(", ")
    }

    /// The names of the fused (blockwise) kernels, quoted and joined by "or" (for error
    /// messages).
    pub fn fused_names() -> String {
        let fused: Vec<String> = Attention::ALL
            .into_iter()
            .filter(|a| a.flash_kernel().is_some())
            .map(|a| format!("\"{}\"", a.name()))
            .collect();
        fused.join(" or ")
    }

    /// The fused kernel that runs the attention core, or `None` when it is unfused.
    pub fn flash_kernel(self) -> Option<FlashKernel> {
        match self {
            Attention::Flash => Some(FlashKernel::Cuda),
            Attention::FlashTriton => Some(FlashKernel::Triton),
            Attention::Fused => Some(FlashKernel::Cudnn),
            Attention::Auto => Some(FlashKernel::Auto),
            Attention::Unfused => None,
        }
    }
}

/// Architecture of a decoder-only transformer.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TransformerConfig {
    /// Model width `h`.
    pub hidden: u64,
    /// Number of transformer blocks.
    pub layers: u64,
    /// Attention heads `a`.
    pub heads: u64,
    /// Key/value heads (grouped-query attention); equal to `heads` for multi-head attention.
    pub kv_heads: u64,
    /// Width of one head.
    pub head_dim: u64,
    /// Inner width of the feed-forward block.
    pub ffn_hidden: u64,
    /// Vocabulary size.
    pub vocab: u64,
    /// Longest sequence the position encoding was trained for.
    pub max_seq: u64,
    /// Feed-forward variant.
    pub mlp: Mlp,
    /// Normalisation variant.
    pub norm: Norm,
    /// Position encoding.
    pub position: Position,
    /// The output layer reuses the input embedding matrix.
    pub tied_embeddings: bool,
    /// Which linear layers have a bias.
    pub bias: Bias,
    /// Dropout layers are present (training with a non-zero dropout probability).
    pub dropout: bool,
    /// Mixture-of-experts feed-forward blocks (Mixtral, Qwen-MoE, DeepSeek); `None`: dense.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<MoeConfig>,
    /// Multi-head latent attention (DeepSeek-V2/V3) instead of (grouped-query) attention.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mla: Option<MlaConfig>,
    /// RMSNorm over each head of the queries and keys before the rotary embedding (Qwen3).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub qk_norm: bool,
}

/// A ratio kept in thousandths, so that configurations holding it stay hashable (`1.25` is
/// `Milli(1250)`); written as a number in files.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Milli(pub u64);

impl Milli {
    /// The nearest thousandth of `x` (`None` unless finite and positive).
    pub fn of(x: f64) -> Option<Milli> {
        (x.is_finite() && x > 0.0 && x < 1e6).then(|| Milli((x * 1000.0).round().max(1.0) as u64))
    }

    /// The ratio.
    pub fn get(self) -> f64 {
        self.0 as f64 / 1000.0
    }
}

impl Serialize for Milli {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(self.get())
    }
}

impl<'de> Deserialize<'de> for Milli {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let x = f64::deserialize(d)?;
        Milli::of(x).ok_or_else(|| {
            serde::de::Error::custom(format!("expected a positive ratio, found {x}"))
        })
    }
}

/// How many tokens the busiest expert gets, relative to a perfectly balanced router.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MoeRouting {
    /// Tokens of each expert's buffer relative to the mean `tokens x k / E`: the capacity
    /// factor when tokens are dropped, the expected load of the busiest expert otherwise.
    pub factor: Milli,
    /// Tokens past an expert's capacity are dropped (Megatron-LM's
    /// `--moe-expert-capacity-factor`); otherwise every token is kept (dropless).
    pub drop_tokens: bool,
}

impl Default for MoeRouting {
    /// Dropless with a perfectly balanced router.
    fn default() -> Self {
        MoeRouting {
            factor: Milli(1000),
            drop_tokens: false,
        }
    }
}

/// The mixture-of-experts part of a transformer: which blocks route their tokens to experts,
/// and how.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MoeConfig {
    /// Routed experts `E` of every MoE block.
    pub experts: u64,
    /// Experts each token is routed to (`k`).
    pub top_k: u64,
    /// Inner width of one routed expert (a gated MLP like the dense one).
    pub expert_ffn: u64,
    /// Inner width of the shared expert(s) every token also passes through (0: none;
    /// DeepSeek's `n_shared_experts x moe_intermediate_size`, Qwen2-MoE's
    /// `shared_expert_intermediate_size`).
    #[serde(default)]
    pub shared_ffn: u64,
    /// The first blocks keep the dense MLP of width `ffn_hidden` (DeepSeek's
    /// `first_k_dense_replace`).
    #[serde(default)]
    pub dense_layers: u64,
    /// The router's scores carry a learned per-expert bias (DeepSeek-V3's
    /// `e_score_correction_bias`, used by its auxiliary-loss-free balancing).
    #[serde(default)]
    pub router_bias: bool,
    /// Tokens per expert, for the target being planned.
    #[serde(default)]
    pub routing: MoeRouting,
}

impl MoeConfig {
    /// Whether block `i` (from 0) is a mixture-of-experts block.
    pub fn is_moe_block(&self, i: u64) -> bool {
        i >= self.dense_layers
    }

    /// Tokens each expert's buffer holds when `tokens` tokens are routed: the balanced share
    /// `tokens x k / E` times the routing factor, rounded up.
    pub fn capacity(&self, tokens: u64) -> u64 {
        let mean = tokens.saturating_mul(self.top_k) as f64 / self.experts.max(1) as f64;
        ((mean * self.routing.factor.get()).ceil() as u64).max(1)
    }
}

/// Multi-head latent attention (DeepSeek-V2, Liu et al. 2024): queries and keys/values are
/// projected down to small latents, normalised, and projected back up per head; a narrow
/// rotary part of the key is shared by all heads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MlaConfig {
    /// Width of the query latent (`q_lora_rank`); 0: queries are projected directly.
    pub q_lora_rank: u64,
    /// Width of the key/value latent (`kv_lora_rank`).
    pub kv_lora_rank: u64,
    /// Per-head width of the query and key part without rotary embedding.
    pub qk_nope_head_dim: u64,
    /// Per-head width of the rotary part of queries and keys.
    pub qk_rope_head_dim: u64,
    /// Per-head width of the values.
    pub v_head_dim: u64,
}

/// The fields of [`TransformerConfig`], so validators can name the one at fault in whatever
/// vocabulary the source document uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransformerField {
    /// [`TransformerConfig::hidden`]
    Hidden,
    /// [`TransformerConfig::layers`]
    Layers,
    /// [`TransformerConfig::heads`]
    Heads,
    /// [`TransformerConfig::kv_heads`]
    KvHeads,
    /// [`TransformerConfig::head_dim`]
    HeadDim,
    /// [`TransformerConfig::ffn_hidden`]
    FfnHidden,
    /// [`TransformerConfig::vocab`]
    Vocab,
    /// [`TransformerConfig::max_seq`]
    MaxSeq,
    /// [`MoeConfig::experts`]
    Experts,
    /// [`MoeConfig::top_k`]
    TopK,
    /// [`MoeConfig::expert_ffn`]
    ExpertFfn,
}

/// A violated constraint of a transformer configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct TransformerConfigError {
    /// The field at fault.
    pub field: TransformerField,
    /// What a valid value looks like.
    pub expected: String,
    /// The value found.
    pub found: String,
}

impl TransformerConfigError {
    /// Converts to a [`FieldError`] using `name` to spell the field.
    pub fn into_field_error(self, name: impl Fn(TransformerField) -> String) -> FieldError {
        FieldError::new(name(self.field), self.expected, self.found)
    }
}

/// Options that fix the shapes and kernels of a lowering.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LowerOptions {
    /// Sequences per micro-batch.
    pub micro_batch: u64,
    /// Tokens per sequence.
    pub seq: u64,
    /// Dtype of weights and activations.
    pub dtype: DType,
    /// Attention-core implementation.
    pub attention: Attention,
    /// Pad the vocabulary to a multiple of this (Megatron pads to 128 × tensor-parallel size).
    pub vocab_multiple: u64,
    /// RMSNorm, RoPE and SwiGLU run as eager PyTorch composites of elementwise kernels
    /// ([`crate::plan::layout::TrainingOptions::eager_elementwise`]).
    pub eager_elementwise: bool,
    /// A transformer block's products with a weight run on the FP8 tensor cores
    /// ([`crate::plan::layout::TrainingOptions::fp8`]).
    pub fp8: bool,
}

impl TransformerConfig {
    /// Checks the constraints an architecture must satisfy (positive sizes, heads dividing the
    /// width, key/value heads dividing the heads).
    pub fn validate(&self) -> Result<(), TransformerConfigError> {
        use TransformerField as F;
        let positive = [
            (F::Hidden, self.hidden),
            (F::Layers, self.layers),
            (F::Heads, self.heads),
            (F::KvHeads, self.kv_heads),
            (F::HeadDim, self.head_dim),
            (F::FfnHidden, self.ffn_hidden),
            (F::Vocab, self.vocab),
            (F::MaxSeq, self.max_seq),
        ];
        for (field, v) in positive {
            let max = match field {
                F::Layers => limits::MAX_LAYERS,
                F::Vocab => limits::MAX_VOCAB,
                F::MaxSeq => limits::MAX_SEQ,
                _ => limits::MAX_WIDTH,
            };
            if v == 0 || v > max {
                return Err(TransformerConfigError {
                    field,
                    expected: format!("a positive integer up to {max}"),
                    found: v.to_string(),
                });
            }
        }
        if let Some(m) = &self.moe {
            for (field, v) in [(F::Experts, m.experts), (F::ExpertFfn, m.expert_ffn)] {
                if v == 0 || v > limits::MAX_WIDTH {
                    return Err(TransformerConfigError {
                        field,
                        expected: format!("a positive integer up to {}", limits::MAX_WIDTH),
                        found: v.to_string(),
                    });
                }
            }
            if m.top_k == 0 || m.top_k > m.experts {
                return Err(TransformerConfigError {
                    field: F::TopK,
                    expected: format!("1 to the {} experts", m.experts),
                    found: m.top_k.to_string(),
                });
            }
        }
        if self.heads % self.kv_heads != 0 {
            return Err(TransformerConfigError {
                field: F::KvHeads,
                expected: format!("a divisor of the {} attention heads", self.heads),
                found: self.kv_heads.to_string(),
            });
        }
        Ok(())
    }

    /// Head width when the source does not give it: the width divided by the heads, which must
    /// divide it.
    pub fn default_head_dim(hidden: u64, heads: u64) -> Result<u64, TransformerConfigError> {
        if heads == 0 || hidden % heads != 0 {
            return Err(TransformerConfigError {
                field: TransformerField::Heads,
                expected: format!("a number of heads that divides the hidden size {hidden}"),
                found: heads.to_string(),
            });
        }
        Ok(hidden / heads)
    }

    /// Vocabulary after padding to a multiple of `multiple`.
    pub fn padded_vocab(&self, multiple: u64) -> u64 {
        let m = multiple.max(1);
        self.vocab.div_ceil(m) * m
    }

    /// Lowers the architecture to an op graph with forward and backward ops.
    pub fn lower(&self, name: &str, opts: &LowerOptions) -> Result<Graph, GraphError> {
        Lowering::new(self, name, opts).run()
    }
}

struct Lowering<'c> {
    c: &'c TransformerConfig,
    o: LowerOptions,
    g: GraphBuilder,
    vocab: u64,
}

impl<'c> Lowering<'c> {
    fn new(c: &'c TransformerConfig, name: &str, o: &LowerOptions) -> Self {
        let mut g = GraphBuilder::new(name, o.micro_batch, o.seq);
        g.eager_elementwise(o.eager_elementwise);
        g.fp8(o.fp8);
        Lowering {
            c,
            o: *o,
            g,
            vocab: c.padded_vocab(o.vocab_multiple),
        }
    }

    fn param(&mut self, name: String, shape: Vec<u64>, split: Split) -> TensorId {
        self.g
            .tensor(name, shape, self.o.dtype, TensorKind::Parameter, split)
    }

    fn act(&mut self, name: String, shape: Vec<u64>, split: Split) -> TensorId {
        self.g
            .tensor(name, shape, self.o.dtype, TensorKind::Activation, split)
    }

    /// A token-major activation `[b, s, width]`, split like the residual stream.
    fn hidden_act(&mut self, name: String) -> TensorId {
        let (b, s, h) = (self.o.micro_batch, self.o.seq, self.c.hidden);
        self.act(name, vec![b, s, h], Split::Sequence(1))
    }

    fn norm(&mut self, prefix: &str, x: TensorId) -> Result<TensorId, GraphError> {
        let y = self.hidden_act(format!("{prefix}.out"));
        self.norm_into(prefix, x, y)
    }

    /// Normalisation of `x` over its last axis into `y` (declared by the caller).
    fn norm_into(
        &mut self,
        prefix: &str,
        x: TensorId,
        y: TensorId,
    ) -> Result<TensorId, GraphError> {
        let h = *self.g.shape(x).last().unwrap_or(&1);
        let gain = self.param(format!("{prefix}.weight"), vec![h], Split::None);
        let mut inputs = vec![x, gain];
        let kind = match self.c.norm {
            Norm::LayerNorm => {
                inputs.push(self.param(format!("{prefix}.bias"), vec![h], Split::None));
                OpKind::LayerNorm
            }
            Norm::RmsNorm => OpKind::RmsNorm,
        };
        self.g.op(prefix.to_string(), kind, &inputs, &[y])?;
        Ok(y)
    }

    /// `y = x · W (+ b)` with W of shape `[k, n]` split as `w_split`.
    fn linear(
        &mut self,
        prefix: &str,
        x: TensorId,
        (k, n): (u64, u64),
        w_split: Split,
        bias: bool,
        y: TensorId,
    ) -> Result<(), GraphError> {
        let w = self.param(format!("{prefix}.weight"), vec![k, n], w_split);
        let mut inputs = vec![x, w];
        if bias {
            // A column-parallel bias is split with the output; a row-parallel one is added after
            // the reduction, replicated.
            let b_split = match w_split {
                Split::Model(1) => Split::Model(0),
                _ => Split::None,
            };
            inputs.push(self.param(format!("{prefix}.bias"), vec![n], b_split));
        }
        self.g.op(
            prefix.to_string(),
            OpKind::MatMul { transpose_b: false },
            &inputs,
            &[y],
        )?;
        Ok(())
    }

    /// Residual connection, through dropout when the model trains with dropout.
    fn residual(
        &mut self,
        name: &str,
        x: TensorId,
        residual: TensorId,
    ) -> Result<TensorId, GraphError> {
        let y = self.hidden_act(format!("{name}.out"));
        let kind = if self.c.dropout {
            OpKind::DropoutAdd
        } else {
            OpKind::Add
        };
        self.g.op(name.to_string(), kind, &[x, residual], &[y])?;
        Ok(y)
    }

    fn run(mut self) -> Result<Graph, GraphError> {
        let (b, s, h) = (self.o.micro_batch, self.o.seq, self.c.hidden);
        // Embedding.
        self.g.begin_layer("embedding", LayerKind::Embedding);
        let ids = self.g.tensor(
            "tokens",
            vec![b, s],
            DType::I32,
            TensorKind::Input,
            Split::None,
        );
        let wte = self.param(
            "embedding.word".into(),
            vec![self.vocab, h],
            Split::Model(0),
        );
        let emb = self.hidden_act("embedding.word.out".into());
        self.g
            .op("embedding.word", OpKind::Embedding, &[ids, wte], &[emb])?;
        let mut x = emb;
        if self.c.position == Position::Learned {
            let pos = self.g.tensor(
                "positions",
                vec![b, s],
                DType::I32,
                TensorKind::Input,
                Split::None,
            );
            let wpe = self.param(
                "embedding.position".into(),
                vec![self.c.max_seq, h],
                Split::None,
            );
            let pe = self.hidden_act("embedding.position.out".into());
            self.g
                .op("embedding.position", OpKind::Embedding, &[pos, wpe], &[pe])?;
            let sum = self.hidden_act("embedding.sum".into());
            self.g
                .op("embedding.add", OpKind::Add, &[emb, pe], &[sum])?;
            x = sum;
        }
        if self.c.dropout {
            let y = self.hidden_act("embedding.dropout.out".into());
            self.g
                .op("embedding.dropout", OpKind::Dropout, &[x], &[y])?;
            x = y;
        }
        for i in 0..self.c.layers {
            x = self.block(i, x)?;
        }
        self.head(x, wte)?;
        self.g.finish()
    }

    fn block(&mut self, i: u64, x: TensorId) -> Result<TensorId, GraphError> {
        let c = self.c;
        let (a, h) = (c.heads, c.hidden);
        let p = format!("layers.{i}");
        self.g.begin_layer(p.clone(), LayerKind::Block);

        // Attention.
        let ln1 = self.norm(&format!("{p}.input_norm"), x)?;
        let (q, k, v) = match c.mla {
            Some(m) => self.mla_qkv(&p, ln1, m)?,
            None => self.qkv(&p, ln1)?,
        };
        let proj_in = self.attention_core(&p, q, k, v)?;
        let v_dim = *self.g.shape(v).last().unwrap_or(&c.head_dim);
        let attn_out = self.hidden_act(format!("{p}.attention.proj.out"));
        self.linear(
            &format!("{p}.attention.proj"),
            proj_in,
            (a * v_dim, h),
            Split::Model(0),
            c.bias == Bias::All,
            attn_out,
        )?;
        let x1 = self.residual(&format!("{p}.attention.residual"), attn_out, x)?;

        // Feed-forward.
        let ln2 = self.norm(&format!("{p}.mlp_norm"), x1)?;
        let mlp_out = match c.moe {
            Some(m) if m.is_moe_block(i) => self.moe(&p, ln2, &m)?,
            _ => self.mlp(&format!("{p}.mlp"), ln2, c.ffn_hidden)?,
        };
        self.residual(&format!("{p}.mlp.residual"), mlp_out, x1)
    }

    /// Queries, keys and values of (grouped-query) attention: the fused projection, split into
    /// heads, with the rotary embedding (after a per-head norm under `qk_norm`).
    fn qkv(
        &mut self,
        p: &str,
        ln1: TensorId,
    ) -> Result<(TensorId, TensorId, TensorId), GraphError> {
        let c = self.c;
        let (b, s, h) = (self.o.micro_batch, self.o.seq, c.hidden);
        let (a, g, d) = (c.heads, c.kv_heads, c.head_dim);
        let qkv_width = (a + 2 * g) * d;
        let qkv = self.act(
            format!("{p}.attention.qkv.out"),
            vec![b, s, qkv_width],
            Split::Model(2),
        );
        let qkv_bias = c.bias != Bias::None;
        self.linear(
            &format!("{p}.attention.qkv"),
            ln1,
            (h, qkv_width),
            Split::Model(1),
            qkv_bias,
            qkv,
        )?;
        let mut q = self.act(
            format!("{p}.attention.q"),
            vec![b, a, s, d],
            Split::Model(1),
        );
        let mut k = self.act(
            format!("{p}.attention.k"),
            vec![b, g, s, d],
            Split::Model(1),
        );
        let v = self.act(
            format!("{p}.attention.v"),
            vec![b, g, s, d],
            Split::Model(1),
        );
        self.g.op(
            format!("{p}.attention.split_qkv"),
            OpKind::Slice,
            &[qkv],
            &[q, k, v],
        )?;
        if c.qk_norm {
            let qn = self.act(
                format!("{p}.attention.q_norm.out"),
                vec![b, a, s, d],
                Split::Model(1),
            );
            q = self.norm_into(&format!("{p}.attention.q_norm"), q, qn)?;
            let kn = self.act(
                format!("{p}.attention.k_norm.out"),
                vec![b, g, s, d],
                Split::Model(1),
            );
            k = self.norm_into(&format!("{p}.attention.k_norm"), k, kn)?;
        }
        if c.position == Position::Rope {
            let qr = self.act(
                format!("{p}.attention.q_rot"),
                vec![b, a, s, d],
                Split::Model(1),
            );
            let kr = self.act(
                format!("{p}.attention.k_rot"),
                vec![b, g, s, d],
                Split::Model(1),
            );
            self.g
                .op(format!("{p}.attention.rope_q"), OpKind::Rope, &[q], &[qr])?;
            self.g
                .op(format!("{p}.attention.rope_k"), OpKind::Rope, &[k], &[kr])?;
            q = qr;
            k = kr;
        }
        Ok((q, k, v))
    }

    /// Queries, keys and values of multi-head latent attention (DeepSeek-V2/V3, as Megatron-Core
    /// lowers it): the down-projections to the latents and their norms work on the residual
    /// stream's layout (its sequence shard under SP; Megatron-Core computes them on the whole
    /// sequence on every rank, a difference in kernel time of well under 1% of the block), the
    /// up-projections are column-parallel over heads, and the rotary key is shared by all heads.
    /// The rotary embedding runs over the whole query head (its rotary part is a third of it),
    /// an elementwise kernel bound by memory either way.
    fn mla_qkv(
        &mut self,
        p: &str,
        ln1: TensorId,
        m: MlaConfig,
    ) -> Result<(TensorId, TensorId, TensorId), GraphError> {
        let c = self.c;
        let (b, s, h, a) = (self.o.micro_batch, self.o.seq, c.hidden, c.heads);
        let (dn, dr, dv) = (m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim);
        let dq = dn + dr;
        // Queries.
        let q_in = if m.q_lora_rank > 0 {
            let r = m.q_lora_rank;
            let qa = self.act(
                format!("{p}.attention.q_down.out"),
                vec![b, s, r],
                Split::Sequence(1),
            );
            self.linear(
                &format!("{p}.attention.q_down"),
                ln1,
                (h, r),
                Split::None,
                false,
                qa,
            )?;
            let qn = self.act(
                format!("{p}.attention.q_norm.out"),
                vec![b, s, r],
                Split::Sequence(1),
            );
            self.norm_into(&format!("{p}.attention.q_norm"), qa, qn)?
        } else {
            ln1
        };
        let q_width = *self.g.shape(q_in).last().unwrap_or(&h);
        let qf = self.act(
            format!("{p}.attention.q_up.out"),
            vec![b, s, a * dq],
            Split::Model(2),
        );
        self.linear(
            &format!("{p}.attention.q_up"),
            q_in,
            (q_width, a * dq),
            Split::Model(1),
            false,
            qf,
        )?;
        let q = self.act(
            format!("{p}.attention.q"),
            vec![b, a, s, dq],
            Split::Model(1),
        );
        self.g
            .op(format!("{p}.attention.split_q"), OpKind::Slice, &[qf], &[q])?;
        let qr = self.act(
            format!("{p}.attention.q_rot"),
            vec![b, a, s, dq],
            Split::Model(1),
        );
        self.g
            .op(format!("{p}.attention.rope_q"), OpKind::Rope, &[q], &[qr])?;
        // Keys and values: one latent plus the shared rotary key.
        let r = m.kv_lora_rank;
        let kva = self.act(
            format!("{p}.attention.kv_down.out"),
            vec![b, s, r + dr],
            Split::Sequence(1),
        );
        self.linear(
            &format!("{p}.attention.kv_down"),
            ln1,
            (h, r + dr),
            Split::None,
            false,
            kva,
        )?;
        let latent = self.act(
            format!("{p}.attention.kv_latent"),
            vec![b, s, r],
            Split::Sequence(1),
        );
        let k_rope = self.act(
            format!("{p}.attention.k_rope"),
            vec![b, 1, s, dr],
            Split::Sequence(2),
        );
        self.g.op(
            format!("{p}.attention.split_kv_down"),
            OpKind::Slice,
            &[kva],
            &[latent, k_rope],
        )?;
        let kr = self.act(
            format!("{p}.attention.k_rope_rot"),
            vec![b, 1, s, dr],
            Split::Sequence(2),
        );
        self.g.op(
            format!("{p}.attention.rope_k"),
            OpKind::Rope,
            &[k_rope],
            &[kr],
        )?;
        let ln = self.act(
            format!("{p}.attention.kv_norm.out"),
            vec![b, s, r],
            Split::Sequence(1),
        );
        let latent = self.norm_into(&format!("{p}.attention.kv_norm"), latent, ln)?;
        let kvf = self.act(
            format!("{p}.attention.kv_up.out"),
            vec![b, s, a * (dn + dv)],
            Split::Model(2),
        );
        self.linear(
            &format!("{p}.attention.kv_up"),
            latent,
            (r, a * (dn + dv)),
            Split::Model(1),
            false,
            kvf,
        )?;
        let k_nope = self.act(
            format!("{p}.attention.k_nope"),
            vec![b, a, s, dn],
            Split::Model(1),
        );
        let v = self.act(
            format!("{p}.attention.v"),
            vec![b, a, s, dv],
            Split::Model(1),
        );
        self.g.op(
            format!("{p}.attention.split_kv_up"),
            OpKind::Slice,
            &[kvf],
            &[k_nope, v],
        )?;
        let k = self.act(
            format!("{p}.attention.k"),
            vec![b, a, s, dq],
            Split::Model(1),
        );
        self.g.op(
            format!("{p}.attention.join_k"),
            OpKind::Concat,
            &[k_nope, kr],
            &[k],
        )?;
        Ok((qr, k, v))
    }

    /// The attention core over `q`, `k`, `v` (`[b, heads, s, d]`); returns what the output
    /// projection reads.
    fn attention_core(
        &mut self,
        p: &str,
        q: TensorId,
        k: TensorId,
        v: TensorId,
    ) -> Result<TensorId, GraphError> {
        let c = self.c;
        let (b, s) = (self.o.micro_batch, self.o.seq);
        let a = c.heads;
        let d = *self.g.shape(v).last().unwrap_or(&c.head_dim);
        let ctx = self.act(
            format!("{p}.attention.context"),
            vec![b, a, s, d],
            Split::Model(1),
        );
        let proj_in = match self.o.attention.flash_kernel() {
            Some(kernel) => {
                let op = self.g.op(
                    format!("{p}.attention.core"),
                    OpKind::FlashAttention {
                        causal: true,
                        kernel,
                    },
                    &[q, k, v],
                    &[ctx],
                )?;
                self.g.set_attention_core(op);
                ctx
            }
            None => {
                let sc = vec![b, a, s, s];
                let scores = self.act(format!("{p}.attention.scores"), sc.clone(), Split::Model(1));
                let probs = self.act(format!("{p}.attention.probs"), sc.clone(), Split::Model(1));
                let mut ops = vec![
                    self.g.op(
                        format!("{p}.attention.qk"),
                        OpKind::BatchMatMul { transpose_b: true },
                        &[q, k],
                        &[scores],
                    )?,
                    self.g.op(
                        format!("{p}.attention.softmax"),
                        OpKind::Softmax,
                        &[scores],
                        &[probs],
                    )?,
                ];
                let mut weights = probs;
                if c.dropout {
                    let dropped =
                        self.act(format!("{p}.attention.dropout.out"), sc, Split::Model(1));
                    ops.push(self.g.op(
                        format!("{p}.attention.dropout"),
                        OpKind::Dropout,
                        &[probs],
                        &[dropped],
                    )?);
                    weights = dropped;
                }
                ops.push(self.g.op(
                    format!("{p}.attention.pv"),
                    OpKind::BatchMatMul { transpose_b: false },
                    &[weights, v],
                    &[ctx],
                )?);
                for op in ops {
                    self.g.set_attention_core(op);
                }
                // Heads back next to each other for the output projection: a real copy.
                let merged = self.act(
                    format!("{p}.attention.context_merged"),
                    vec![b, s, a, d],
                    Split::Model(2),
                );
                self.g.op(
                    format!("{p}.attention.merge_heads"),
                    OpKind::Transpose,
                    &[ctx],
                    &[merged],
                )?;
                merged
            }
        };
        Ok(proj_in)
    }

    /// The dense feed-forward block of inner width `f` reading `ln2`; returns its output.
    fn mlp(&mut self, p: &str, ln2: TensorId, f: u64) -> Result<TensorId, GraphError> {
        let c = self.c;
        let (b, s, h) = (self.o.micro_batch, self.o.seq, c.hidden);
        let mlp_bias = c.bias == Bias::All;
        let act = match c.mlp {
            Mlp::Gelu => {
                let up = self.act(format!("{p}.fc1.out"), vec![b, s, f], Split::Model(2));
                self.linear(
                    &format!("{p}.fc1"),
                    ln2,
                    (h, f),
                    Split::Model(1),
                    mlp_bias,
                    up,
                )?;
                let y = self.act(format!("{p}.gelu.out"), vec![b, s, f], Split::Model(2));
                self.g.op(format!("{p}.gelu"), OpKind::Gelu, &[up], &[y])?;
                y
            }
            Mlp::SwiGlu => {
                let gu = self.act(
                    format!("{p}.gate_up.out"),
                    vec![b, s, 2 * f],
                    Split::Model(2),
                );
                self.linear(
                    &format!("{p}.gate_up"),
                    ln2,
                    (h, 2 * f),
                    Split::Model(1),
                    mlp_bias,
                    gu,
                )?;
                let y = self.act(format!("{p}.swiglu.out"), vec![b, s, f], Split::Model(2));
                self.g
                    .op(format!("{p}.swiglu"), OpKind::SwiGlu, &[gu], &[y])?;
                y
            }
        };
        let mlp_out = self.hidden_act(format!("{p}.fc2.out"));
        self.linear(
            &format!("{p}.fc2"),
            act,
            (f, h),
            Split::Model(0),
            mlp_bias,
            mlp_out,
        )?;
        Ok(mlp_out)
    }

    /// A mixture-of-experts block reading `ln2` (Megatron-Core's MoE layer): the router's
    /// scores and top-k choice, the tokens dispatched to their experts, the routed experts as
    /// grouped GEMMs over `[E, C, ..]` buffers, the outputs combined with the gates, plus the
    /// shared experts every token passes through.
    fn moe(&mut self, p: &str, ln2: TensorId, m: &MoeConfig) -> Result<TensorId, GraphError> {
        let c = self.c;
        let (b, s, h) = (self.o.micro_batch, self.o.seq, c.hidden);
        let (e, k, f) = (m.experts, m.top_k, m.expert_ffn);
        let cap = m.capacity(b.saturating_mul(s));
        let scores = self.act(
            format!("{p}.router.scores"),
            vec![b, s, e],
            Split::Sequence(1),
        );
        let w = self.param(format!("{p}.router.weight"), vec![h, e], Split::None);
        let mut inputs = vec![ln2, w];
        if m.router_bias {
            inputs.push(self.param(format!("{p}.router.bias"), vec![e], Split::None));
        }
        // Megatron-Core's router is a plain linear layer, not Transformer Engine's: it stays in
        // the model's dtype under FP8.
        self.g.fp8(false);
        self.g.op(
            format!("{p}.router"),
            OpKind::MatMul { transpose_b: false },
            &inputs,
            &[scores],
        )?;
        self.g.fp8(self.o.fp8);
        let gates = self.g.tensor(
            format!("{p}.router.gates"),
            vec![b, s, k],
            DType::F32,
            TensorKind::Activation,
            Split::Sequence(1),
        );
        let idx = self.g.tensor(
            format!("{p}.router.indices"),
            vec![b, s, k],
            DType::I32,
            TensorKind::Activation,
            Split::Sequence(1),
        );
        self.g.op(
            format!("{p}.router.topk"),
            OpKind::MoeRouter,
            &[scores],
            &[gates, idx],
        )?;
        let tokens = self.act(
            format!("{p}.experts.dispatched"),
            vec![e, cap, h],
            Split::Experts,
        );
        self.g.op(
            format!("{p}.experts.dispatch"),
            OpKind::MoeDispatch,
            &[ln2, idx],
            &[tokens],
        )?;
        let (up_width, up_out) = match c.mlp {
            Mlp::Gelu => (f, f),
            Mlp::SwiGlu => (2 * f, f),
        };
        let w1 = self.param(
            format!("{p}.experts.fc1.weight"),
            vec![e, h, up_width],
            Split::ExpertModel(2),
        );
        let up = self.act(
            format!("{p}.experts.fc1.out"),
            vec![e, cap, up_width],
            Split::ExpertModel(2),
        );
        self.g.op(
            format!("{p}.experts.fc1"),
            OpKind::BatchMatMul { transpose_b: false },
            &[tokens, w1],
            &[up],
        )?;
        let act = self.act(
            format!("{p}.experts.act.out"),
            vec![e, cap, up_out],
            Split::ExpertModel(2),
        );
        let act_kind = match c.mlp {
            Mlp::Gelu => OpKind::Gelu,
            Mlp::SwiGlu => OpKind::SwiGlu,
        };
        self.g
            .op(format!("{p}.experts.act"), act_kind, &[up], &[act])?;
        let w2 = self.param(
            format!("{p}.experts.fc2.weight"),
            vec![e, f, h],
            Split::ExpertModel(1),
        );
        let down = self.act(
            format!("{p}.experts.fc2.out"),
            vec![e, cap, h],
            Split::Experts,
        );
        self.g.op(
            format!("{p}.experts.fc2"),
            OpKind::BatchMatMul { transpose_b: false },
            &[act, w2],
            &[down],
        )?;
        let routed = self.hidden_act(format!("{p}.experts.out"));
        self.g.op(
            format!("{p}.experts.combine"),
            OpKind::MoeCombine,
            &[down, gates, idx],
            &[routed],
        )?;
        if m.shared_ffn == 0 {
            return Ok(routed);
        }
        let shared = self.mlp(&format!("{p}.shared_experts"), ln2, m.shared_ffn)?;
        let sum = self.hidden_act(format!("{p}.moe.out"));
        self.g.op(
            format!("{p}.moe.add"),
            OpKind::Add,
            &[routed, shared],
            &[sum],
        )?;
        Ok(sum)
    }

    fn head(&mut self, x: TensorId, wte: TensorId) -> Result<(), GraphError> {
        let (b, s, h) = (self.o.micro_batch, self.o.seq, self.c.hidden);
        self.g.begin_layer("head", LayerKind::Head);
        let xf = self.norm("head.final_norm", x)?;
        let logits = self.act(
            "head.logits".into(),
            vec![b, s, self.vocab],
            Split::Model(2),
        );
        if self.c.tied_embeddings {
            self.g.op(
                "head.output",
                OpKind::MatMul { transpose_b: true },
                &[xf, wte],
                &[logits],
            )?;
        } else {
            self.linear(
                "head.output",
                xf,
                (h, self.vocab),
                Split::Model(1),
                false,
                logits,
            )?;
        }
        let labels = self.g.tensor(
            "labels",
            vec![b, s],
            DType::I32,
            TensorKind::Input,
            Split::None,
        );
        let loss = self.g.tensor(
            "loss",
            vec![1],
            DType::F32,
            TensorKind::Activation,
            Split::None,
        );
        self.g.op(
            "head.loss",
            OpKind::CrossEntropy,
            &[logits, labels],
            &[loss],
        )?;
        Ok(())
    }
}
