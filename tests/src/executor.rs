//! Models and layouts for the executor tests.

use autopar_engine::executor::ExecLayout;
use autopar_engine::workspace;
use autopar_rules::model::frontend::{
    Attention, Bias, LowerOptions, Mlp, ModelDef, Norm, Position, TransformerConfig,
};
use autopar_rules::model::graph::{DType, Graph};

/// The shipped `tiny-llama` model of the default workspace (4 blocks, hidden 256, 8 heads over
/// 2 key/value heads, SwiGLU, RMSNorm, rotary positions), lowered at micro-batch `mb` and
/// sequence `seq` with its vocabulary padded for `tp` ranks.
pub fn tiny_llama(mb: u64, seq: u64, tp: u64) -> Graph {
    let ws = workspace::load(&crate::repo_root().join("workspace.toml")).expect("workspace");
    let def = &ws.model("tiny-llama").expect("tiny-llama is shipped").def;
    lower(def, mb, seq, tp, Attention::Flash)
}

/// A small GPT (learned positions, LayerNorm, GeLU, biases, dropout, tied embeddings, unfused
/// attention): every op kind the LLaMA model does not use.
pub fn tiny_gpt(mb: u64, seq: u64, tp: u64) -> Graph {
    let def = ModelDef::Transformer(TransformerConfig {
        hidden: 64,
        layers: 2,
        heads: 4,
        kv_heads: 4,
        head_dim: 16,
        ffn_hidden: 256,
        vocab: 250,
        max_seq: 64,
        mlp: Mlp::Gelu,
        norm: Norm::LayerNorm,
        position: Position::Learned,
        tied_embeddings: true,
        bias: Bias::All,
        dropout: true,
    });
    lower(&def, mb, seq, tp, Attention::Unfused)
}

fn lower(def: &ModelDef, mb: u64, seq: u64, tp: u64, attention: Attention) -> Graph {
    def.lower(
        "test",
        &LowerOptions {
            micro_batch: mb,
            seq,
            dtype: DType::F32,
            attention,
            vocab_multiple: 8 * tp,
        },
    )
    .expect("lowers")
}

/// A layout with `chunks[stage][chunk]` layer ranges.
pub fn layout(
    dp: usize,
    tp: usize,
    sp: bool,
    zero: u8,
    microbatches: usize,
    chunks: Vec<Vec<(usize, usize)>>,
) -> ExecLayout {
    ExecLayout {
        tp,
        pp: chunks.len(),
        dp,
        sequence_parallel: sp,
        zero,
        microbatches,
        chunks,
        grad_accumulation_fusion: true,
        meshes: Vec::new(),
        placements: Default::default(),
        states: Default::default(),
    }
}
