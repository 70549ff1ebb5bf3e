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
    DType, Graph, GraphBuilder, GraphError, LayerKind, OpKind, Split, TensorId, TensorKind,
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
    /// One fused kernel that never stores the score matrix (FlashAttention).
    Flash,
    /// Score matmul, softmax, dropout and context matmul as separate kernels with the score
    /// matrix in memory (Megatron-LM before flash attention, e.g. its 2021 results).
    Unfused,
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
        Lowering {
            c,
            o: *o,
            g: GraphBuilder::new(name, o.micro_batch, o.seq),
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
        let h = self.c.hidden;
        let gain = self.param(format!("{prefix}.weight"), vec![h], Split::None);
        let mut inputs = vec![x, gain];
        let kind = match self.c.norm {
            Norm::LayerNorm => {
                inputs.push(self.param(format!("{prefix}.bias"), vec![h], Split::None));
                OpKind::LayerNorm
            }
            Norm::RmsNorm => OpKind::RmsNorm,
        };
        let y = self.hidden_act(format!("{prefix}.out"));
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
        let (b, s, h) = (self.o.micro_batch, self.o.seq, c.hidden);
        let (a, g, d) = (c.heads, c.kv_heads, c.head_dim);
        let p = format!("layers.{i}");
        self.g.begin_layer(p.clone(), LayerKind::Block);

        // Attention.
        let ln1 = self.norm(&format!("{p}.input_norm"), x)?;
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
        let ctx = self.act(
            format!("{p}.attention.context"),
            vec![b, a, s, d],
            Split::Model(1),
        );
        let proj_in = match self.o.attention {
            Attention::Flash => {
                let op = self.g.op(
                    format!("{p}.attention.core"),
                    OpKind::FlashAttention { causal: true },
                    &[q, k, v],
                    &[ctx],
                )?;
                self.g.set_attention_core(op);
                ctx
            }
            Attention::Unfused => {
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
        let attn_out = self.hidden_act(format!("{p}.attention.proj.out"));
        self.linear(
            &format!("{p}.attention.proj"),
            proj_in,
            (a * d, h),
            Split::Model(0),
            c.bias == Bias::All,
            attn_out,
        )?;
        let x1 = self.residual(&format!("{p}.attention.residual"), attn_out, x)?;

        // Feed-forward.
        let ln2 = self.norm(&format!("{p}.mlp_norm"), x1)?;
        let f = c.ffn_hidden;
        let mlp_bias = c.bias == Bias::All;
        let act = match c.mlp {
            Mlp::Gelu => {
                let up = self.act(format!("{p}.mlp.fc1.out"), vec![b, s, f], Split::Model(2));
                self.linear(
                    &format!("{p}.mlp.fc1"),
                    ln2,
                    (h, f),
                    Split::Model(1),
                    mlp_bias,
                    up,
                )?;
                let y = self.act(format!("{p}.mlp.gelu.out"), vec![b, s, f], Split::Model(2));
                self.g
                    .op(format!("{p}.mlp.gelu"), OpKind::Gelu, &[up], &[y])?;
                y
            }
            Mlp::SwiGlu => {
                let gu = self.act(
                    format!("{p}.mlp.gate_up.out"),
                    vec![b, s, 2 * f],
                    Split::Model(2),
                );
                self.linear(
                    &format!("{p}.mlp.gate_up"),
                    ln2,
                    (h, 2 * f),
                    Split::Model(1),
                    mlp_bias,
                    gu,
                )?;
                let y = self.act(
                    format!("{p}.mlp.swiglu.out"),
                    vec![b, s, f],
                    Split::Model(2),
                );
                self.g
                    .op(format!("{p}.mlp.swiglu"), OpKind::SwiGlu, &[gu], &[y])?;
                y
            }
        };
        let mlp_out = self.hidden_act(format!("{p}.mlp.fc2.out"));
        self.linear(
            &format!("{p}.mlp.fc2"),
            act,
            (f, h),
            Split::Model(0),
            mlp_bias,
            mlp_out,
        )?;
        self.residual(&format!("{p}.mlp.residual"), mlp_out, x1)
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
