//! Shared set-up of the intra-op sharding tests and benchmark: shipped models lowered at a
//! micro-batch and sequence length, meshes on a preset cluster.

use crate::repo_root;
use autopar_rules::cost::cluster::Cluster;
use autopar_rules::cost::sharding::Mesh;
use autopar_rules::model::frontend::{Attention, LowerOptions, ModelDef};
use autopar_rules::model::frontend::{parse_graph_file, parse_hf_config};
use autopar_rules::model::graph::{DType, Graph};
use autopar_rules::solve::intra::chain::Entry;
use autopar_rules::solve::intra::stage::StagePlan;

/// Every model file shipped under `models/` (HuggingFace configs and graph files), by file
/// name, sorted.
pub fn shipped_models() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(repo_root().join("models"))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".json"))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// `models/<file>` lowered with `micro_batch` sequences of `seq` tokens (the model's maximum
/// when `None`; 1024 for a graph file), bf16, flash attention, the vocabulary padded for
/// `devices`.
pub fn lower(file: &str, micro_batch: u64, seq: Option<u64>, devices: u64) -> Graph {
    lower_with(file, micro_batch, seq, devices, false, false)
}

/// [`lower`], with RMSNorm, RoPE and SwiGLU run as eager PyTorch composites when
/// `eager_elementwise` (a transformer's option; graph files ignore it), and the blocks'
/// products with a weight in FP8 when `fp8`.
pub fn lower_with(
    file: &str,
    micro_batch: u64,
    seq: Option<u64>,
    devices: u64,
    eager_elementwise: bool,
    fp8: bool,
) -> Graph {
    let path = repo_root().join("models").join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    if file.ends_with(".graph.json") {
        let spec = parse_graph_file(&text).unwrap_or_else(|e| panic!("{file}: {e}"));
        return spec
            .lower_with(micro_batch, seq.unwrap_or(1024), DType::Bf16, fp8)
            .unwrap_or_else(|e| panic!("{file}: {e}"));
    }
    let cfg = parse_hf_config(&text).unwrap_or_else(|e| panic!("{file}: {e}"));
    let seq = seq.unwrap_or(cfg.max_seq);
    let def = ModelDef::Transformer(cfg);
    let opts = LowerOptions {
        micro_batch,
        seq,
        dtype: DType::Bf16,
        attention: Attention::Flash,
        vocab_multiple: 128 * devices,
        eager_elementwise,
        fp8,
    };
    def.lower(file, &opts)
        .unwrap_or_else(|e| panic!("{file}: {e}"))
}

/// `models/tiny-mlp.graph.json` with two ops of kinds autopar does not know (opaque ops):
/// the first block's activation (`fused_act`, on model-split tensors) and the final norm
/// (`my_norm`, with a weight, on the residual stream).
pub fn opaque_mlp() -> String {
    let path = repo_root().join("models").join("tiny-mlp.graph.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let replaced = text
        .replace(
            r#""name": "mlp0.act", "kind": "gelu""#,
            r#""name": "mlp0.act", "kind": "fused_act""#,
        )
        .replace(
            r#""name": "final_norm", "kind": "rmsnorm""#,
            r#""name": "final_norm", "kind": "my_norm""#,
        );
    assert_eq!(replaced.matches("fused_act").count(), 1, "tiny-mlp changed");
    assert_eq!(replaced.matches("my_norm").count(), 1, "tiny-mlp changed");
    replaced
}

/// A graph file's `text` lowered with `micro_batch` sequences of `seq` tokens, bf16.
pub fn lower_text(text: &str, micro_batch: u64, seq: u64) -> Graph {
    parse_graph_file(text)
        .unwrap_or_else(|e| panic!("{e}"))
        .lower(micro_batch, seq, DType::Bf16)
        .unwrap_or_else(|e| panic!("{e}"))
}

/// An H100 cluster big enough for mesh `a x b`.
pub fn cluster_for(a: u64, b: u64) -> Cluster {
    Cluster::from_preset("h100", "h100-sxm", a.max(a * b / 8), Some(8))
        .unwrap_or_else(|e| panic!("the h100-sxm preset: {e}"))
}

/// Mesh `a x b` on [`cluster_for`].
pub fn mesh(a: u64, b: u64) -> (Mesh, Cluster) {
    let c = cluster_for(a, b);
    let m = Mesh::on(&c, a, b).unwrap_or_else(|e| panic!("{e}"));
    (m, c)
}

/// Asserts that `plan`, decoded from the path through a chain of layer tables, costs and holds
/// what the chain priced (`priced`, the path's entry); `at` names the case.
pub fn assert_decoded_as_priced(plan: &StagePlan, priced: &Entry, at: &str) {
    assert!(
        (plan.objective - priced.cost).abs() <= 1e-9 * priced.cost,
        "{at}: decoded plan costs {} s, the chain {} s",
        plan.objective,
        priced.cost
    );
    assert!(
        (plan.memory.peak() - priced.memory).abs() <= 1e-6 * priced.memory,
        "{at}: decoded plan peaks at {} bytes, the chain {}",
        plan.memory.peak(),
        priced.memory
    );
}
