//! The op graph against published numbers: parameter counts of the shipped models, activation
//! memory against Korthikanti et al. 2022 (ALGORITHMS.md §5), FLOPs against Megatron-LM's
//! formula.

use autopar_rules::cost::cluster::preset;
use autopar_rules::cost::layer_cost::{KernelOptions, LayerCost, layer_costs};
use autopar_rules::cost::tensor_parallel::TpConfig;
use autopar_rules::model::frontend::{
    Attention, Bias, LowerOptions, Mlp, Norm, Position, TransformerConfig, parse_hf_config,
};
use autopar_rules::model::graph::{DType, Graph, LayerKind};

fn model(file: &str) -> TransformerConfig {
    let path = format!("{}/../models/{file}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    parse_hf_config(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn lower(c: &TransformerConfig, b: u64, s: u64, attention: Attention) -> Graph {
    c.lower(
        "m",
        &LowerOptions {
            micro_batch: b,
            seq: s,
            dtype: DType::F16,
            attention,
            vocab_multiple: 1,
            eager_elementwise: false,
            fp8: false,
        },
    )
    .expect("lowers")
}

/// Published parameter counts. `digits` is the precision the source rounds to (in billions):
/// a count within half a unit of the last published digit, or within 1%, matches.
const PUBLISHED: &[(&str, f64, f64)] = &[
    // HuggingFace model cards / `model.num_parameters()`.
    ("gpt2-small.json", 124_439_808.0, 0.0),
    ("llama2-7b.json", 6_738_415_616.0, 0.0),
    ("llama2-13b.json", 13_015_864_320.0, 0.0),
    ("llama2-70b.json", 68_976_648_192.0, 0.0),
    ("llama3-8b.json", 8_030_261_248.0, 0.0),
    ("llama3-70b.json", 70_553_706_496.0, 0.0),
    ("llama3-405b.json", 405_853_388_800.0, 0.0),
    // GPT-3 paper, Table 2.1.
    ("gpt3-175b.json", 175.0e9, 0.05e9),
    // Megatron-LM 2021, Table 1 (billions, one decimal).
    ("gpt-1.7b.json", 1.7e9, 0.05e9),
    ("gpt-3.6b.json", 3.6e9, 0.05e9),
    ("gpt-7.5b.json", 7.5e9, 0.05e9),
    ("gpt-18.4b.json", 18.4e9, 0.05e9),
    ("gpt-39.1b.json", 39.1e9, 0.05e9),
    ("gpt-76.1b.json", 76.1e9, 0.05e9),
    ("gpt-145.6b.json", 145.6e9, 0.05e9),
    ("gpt-310.1b.json", 310.1e9, 0.05e9),
    ("gpt-529.6b.json", 529.6e9, 0.05e9),
    ("gpt-1t.json", 1008.0e9, 0.05e9),
    // Megatron-LM 2021, Figure 13 and the README of its `examples/sc21` scripts.
    ("gpt-162b.json", 162.2e9, 0.05e9),
    // Korthikanti et al. 2022, Table 3 (billions, no decimal).
    ("gpt-22b.json", 22.0e9, 0.5e9),
];

#[test]
fn parameter_counts_match_published_sizes() {
    for &(file, published, half_unit) in PUBLISHED {
        let g = lower(&model(file), 1, 8, Attention::Flash);
        let n = g.parameter_count() as f64;
        let err = (n - published).abs();
        assert!(
            err <= half_unit || err / published <= 0.01,
            "{file}: {n} parameters vs published {published}"
        );
        if half_unit == 0.0 {
            assert_eq!(n, published, "{file}: exact HuggingFace count");
        }
    }
}

#[test]
fn megatron_table_models_match_the_papers_formula() {
    // P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)) = 12 l h^2 + 13 l h + (V + s) h, plus the
    // final layernorm (2h).
    for (file, l, h) in [
        ("gpt-1.7b.json", 24u64, 2304u64),
        ("gpt-1t.json", 128, 25600),
    ] {
        let g = lower(&model(file), 1, 8, Attention::Flash);
        let (v, s) = (51200u64, 2048u64);
        let p = 12 * l * h * h + 13 * l * h + (v + s) * h + 2 * h;
        assert_eq!(g.parameter_count(), p, "{file}");
    }
}

fn costs(g: &Graph, t: u64, sp: bool) -> Vec<LayerCost> {
    let d = preset("a100-80g").expect("preset");
    let c = autopar_rules::cost::cluster::Cluster::from_preset("c", "a100-80g", 1, Some(8))
        .expect("preset");
    let kernels = KernelOptions {
        dtype: DType::F16,
        grad_buffer_bytes: 2.0,
        grad_accumulation_fusion: true,
        tp_comm_overlap: false,
    };
    layer_costs(g, TpConfig::dense(t, sp), &d, &kernels, c.group_link(1, t))
}

fn gpt(h: u64, a: u64, dropout: bool) -> TransformerConfig {
    TransformerConfig {
        hidden: h,
        layers: 2,
        heads: a,
        kv_heads: a,
        head_dim: h / a,
        ffn_hidden: 4 * h,
        vocab: 1024,
        max_seq: 4096,
        mlp: Mlp::Gelu,
        norm: Norm::LayerNorm,
        position: Position::Learned,
        tied_embeddings: true,
        bias: Bias::All,
        dropout,
        moe: None,
        mla: None,
        qk_norm: false,
    }
}

#[test]
fn gpt_block_activations_match_korthikanti() {
    let (s, b, h, a) = (2048u64, 2u64, 1024u64, 16u64);
    let g = lower(&gpt(h, a, true), b, s, Attention::Unfused);
    let block = g.block_layers()[0];
    let (s, b, h, a) = (s as f64, b as f64, h as f64, a as f64);
    let sbh = s * b * h;
    let scores = 5.0 * a * s / h;
    // No parallelism: s b h (34 + 5 a s / h).
    assert_eq!(costs(&g, 1, false)[block].saved, sbh * (34.0 + scores));
    for t in [2u64, 4, 8] {
        let tf = t as f64;
        // Tensor parallel: s b h (10 + 24/t + 5 a s / (h t)).
        let c = &costs(&g, t, false)[block];
        assert_eq!(c.saved, sbh * (10.0 + 24.0 / tf + scores / tf), "t={t}");
        // Tensor + sequence parallel: s b h / t (34 + 5 a s / h).
        let c = &costs(&g, t, true)[block];
        assert_eq!(c.saved, sbh / tf * (34.0 + scores), "t={t} sp");
        // Selective recomputation drops the 5 a s / h term.
        assert_eq!(c.saved_selective, sbh / tf * 34.0, "t={t} sp selective");
        // Full recomputation keeps the layer input, 2 s b h, sequence-sharded.
        assert_eq!(c.checkpoint, 2.0 * sbh / tf, "t={t} sp full");
    }
    // Flash attention never stores the score matrix: same as selective.
    let flash = lower(&gpt(1024, 16, true), 2, 2048, Attention::Flash);
    assert_eq!(costs(&flash, 1, false)[block].saved, sbh * 34.0);
}

#[test]
fn head_activations_match_the_logits_term() {
    // Last stage adds 4 s b h (1 + V/h) / t under sequence parallelism.
    let (s, b, h, v) = (1024u64, 1u64, 512u64, 1024u64);
    let g = lower(&gpt(h, 8, false), b, s, Attention::Flash);
    let head = g
        .layers
        .iter()
        .position(|l| l.kind == LayerKind::Head)
        .expect("head");
    for t in [1u64, 2, 4] {
        let c = &costs(&g, t, t > 1)[head];
        let expect = 4.0 * (s * b * h) as f64 * (1.0 + v as f64 / h as f64) / t as f64;
        assert_eq!(c.saved, expect, "t={t}");
    }
}

#[test]
fn llama_block_activations() {
    // SwiGLU, GQA, RMSNorm, no dropout, flash attention:
    // x, norm out, q, k, v, context, x1, norm out: (2+2+2+2g/a+2g/a+2+2+2) s b h; gate/up 4 s b f;
    // fc2 input 2 s b f.
    let c = model("llama3-8b.json");
    let g = lower(&c, 1, 4096, Attention::Flash);
    let block = g.block_layers()[0];
    let (s, h, f) = (4096.0, c.hidden as f64, c.ffn_hidden as f64);
    let ga = c.kv_heads as f64 / c.heads as f64;
    let expect = s * h * (12.0 + 4.0 * ga) + 6.0 * s * f;
    assert_eq!(costs(&g, 1, false)[block].saved, expect);
}

#[test]
fn flops_match_megatrons_formula() {
    // Per iteration with full recomputation: 96 B s l h^2 (1 + s/(6h) + V/(16 l h)); this
    // counts matrix products only, so the graph's total (which includes elementwise work) may
    // exceed it slightly.
    let c = model("gpt-145.6b.json");
    let (b, s) = (1u64, 2048u64);
    let g = lower(&c, b, s, Attention::Unfused);
    let (bf, sf, l, h, v) = (
        b as f64,
        s as f64,
        c.layers as f64,
        c.hidden as f64,
        c.vocab as f64,
    );
    let formula = 96.0 * bf * sf * l * h * h * (1.0 + sf / (6.0 * h) + v / (16.0 * l * h));
    let cs = costs(&g, 1, false);
    let recompute: f64 = cs
        .iter()
        .filter(|c| c.kind == LayerKind::Block)
        .map(|c| c.fwd_flops)
        .sum();
    let total = g.forward_flops() + g.backward_flops() + recompute;
    let rel = (total - formula) / formula;
    assert!(
        (0.0..0.01).contains(&rel),
        "graph {total:e} vs formula {formula:e} ({rel})"
    );
    // Backward of a transformer is twice its forward.
    let ratio = g.backward_flops() / g.forward_flops();
    assert!((ratio - 2.0).abs() < 0.02, "{ratio}");
}

#[test]
fn fp8_blocks_keep_one_byte_copies_of_their_products_inputs() {
    // Transformer Engine's linear layers keep the FP8 copy of their input (one byte per
    // element) in place of the input: the query/key/value projection's and the first MLP
    // product's (s b h each) and the second's (4 s b h), 2 bytes each in bf16, 6 s b h fewer
    // bytes than Korthikanti's 34 s b h. The output projection reads the attention kernel's
    // output, which that kernel keeps for its own backward: its FP8 copy comes on top, s b h.
    let (s, b, h, a) = (2048u64, 2u64, 1024u64, 16u64);
    let c = gpt(h, a, true);
    let opts = LowerOptions {
        micro_batch: b,
        seq: s,
        dtype: DType::Bf16,
        attention: Attention::Flash,
        vocab_multiple: 1,
        eager_elementwise: false,
        fp8: true,
    };
    let g = c.lower("m", &opts).expect("lowers");
    let block = g.block_layers()[0];
    let sbh = (s * b * h) as f64;
    for t in [1u64, 2, 4] {
        let tf = t as f64;
        assert_eq!(costs(&g, t, t > 1)[block].saved, sbh / tf * 29.0, "t={t}");
    }
    // Every product of a block with a weight runs in FP8, forward and backward; nothing
    // else does (the embedding, the output layer, attention).
    let layer = &g.layers[block];
    let products = |ops: &[autopar_rules::model::graph::OpId]| {
        ops.iter()
            .map(|&o| g.op(o))
            .filter(|op| matches!(op.kind, autopar_rules::model::graph::OpKind::MatMul { .. }))
            .map(|op| op.fp8)
            .collect::<Vec<_>>()
    };
    assert_eq!(products(&layer.forward), vec![true; 4]);
    assert_eq!(products(&layer.backward), vec![true; 8]);
    assert!(
        g.ops.iter().filter(|op| op.fp8).all(
            |op| op.layer as usize >= 1 && g.layers[op.layer as usize].kind == LayerKind::Block
        )
    );
    // A forward product casts its input, an input-gradient product its output gradient; a
    // weight-gradient product reads the copies both made.
    for &o in layer.forward.iter().chain(&layer.backward) {
        let op = g.op(o);
        if !op.fp8 {
            assert_eq!(g.fp8_cast_operand(op), None, "{}", op.name);
            continue;
        }
        let wgrad = op.name.ends_with(".wgrad");
        assert_eq!(g.fp8_cast_operand(op).is_some(), !wgrad, "{}", op.name);
    }
    // Without FP8 no op is marked.
    let plain = c
        .lower("m", &LowerOptions { fp8: false, ..opts })
        .expect("lowers");
    assert!(plain.ops.iter().all(|op| !op.fp8));
    let head = plain.layers.len() - 1;
    assert_eq!(
        costs(&plain, 1, false)[head].saved,
        costs(&g, 1, false)[head].saved
    );
}

#[test]
fn fp8_routed_experts_run_their_grouped_products_in_fp8() {
    use autopar_rules::model::frontend::MoeConfig;
    use autopar_rules::model::graph::{OpKind, TensorKind};
    let mut c = gpt(256, 4, false);
    c.moe = Some(MoeConfig {
        experts: 4,
        top_k: 2,
        expert_ffn: 512,
        shared_ffn: 0,
        dense_layers: 0,
        router_bias: false,
        routing: Default::default(),
    });
    let opts = LowerOptions {
        micro_batch: 1,
        seq: 128,
        dtype: DType::Bf16,
        attention: Attention::Flash,
        vocab_multiple: 1,
        eager_elementwise: false,
        fp8: true,
    };
    let g = c.lower("moe", &opts).expect("lowers");
    let forward: Vec<_> = g
        .ops
        .iter()
        .filter(|op| op.fp8 && op.pass == autopar_rules::model::graph::Pass::Forward)
        .collect();
    // Per block: the query/key/value and output projections and the experts' two grouped
    // products; not the router (Megatron-Core's is no TE layer), nor the attention core's
    // batched products, which read no weight.
    assert!(forward.iter().any(|op| op.name.ends_with("experts.fc1")));
    assert!(forward.iter().any(|op| op.name.ends_with("experts.fc2")));
    assert!(forward.iter().all(|op| !op.name.ends_with("router")));
    assert_eq!(forward.len(), 4 * c.layers as usize);
    assert!(
        g.ops
            .iter()
            .all(|op| !op.fp8
                || matches!(op.kind, OpKind::MatMul { .. } | OpKind::BatchMatMul { .. }))
    );
    for op in &forward {
        // What an FP8 product keeps is its input's one-byte copy, never a weight.
        for &t in &op.saves {
            let tensor = g.tensor(t);
            assert_eq!(tensor.kind, TensorKind::Activation, "{}", op.name);
            assert_eq!(tensor.dtype, DType::F8, "{}", op.name);
        }
    }
}

#[test]
fn pinned_stage_model_holds_korthikanti_activations() {
    use autopar_rules::cost::sharding::Mesh;
    use autopar_rules::solve::intra::stage::{MegatronSharding, StageModel, StageOptions};
    // The intra-op problem pinned to Megatron-LM's specs holds what Megatron-LM does: under
    // sequence parallelism a column-parallel product keeps its input's sequence shard (and
    // gathers it again for the weight gradient), so the whole block is divided by t.
    let (s, b, h) = (2048u64, 2u64, 1024u64);
    let g = lower(&gpt(h, 16, true), b, s, Attention::Flash);
    let block = g.block_layers()[0];
    let sbh = (s * b * h) as f64;
    let c = autopar_rules::cost::cluster::Cluster::from_preset("c", "a100-80g", 1, Some(8))
        .expect("preset");
    for t in [2u64, 4, 8] {
        let tf = t as f64;
        let mesh = Mesh::on(&c, 1, t).expect("mesh");
        let model = StageModel::build(
            &g,
            block..block + 1,
            mesh,
            &c.device,
            StageOptions::default(),
        )
        .expect("builds");
        for (sp, expected) in [(false, sbh * (10.0 + 24.0 / tf)), (true, sbh * 34.0 / tf)] {
            let plan = model
                .megatron_plan(MegatronSharding {
                    sp,
                    distributed_optimizer: false,
                })
                .expect("Megatron-LM's specs");
            let held = plan.memory.activations;
            assert!(
                (held / expected - 1.0).abs() < 1e-12,
                "t={t} sp={sp}: {held} against {expected}"
            );
        }
    }
}
