//! Mixture-of-experts models: the HuggingFace configs of Mixtral, Qwen-MoE and DeepSeek-V3 read
//! to their published parameter counts, expert parallelism priced under MoE parallel folding,
//! the search's optimum against every layout of a small space, and the errors of bad input.

use autopar_rules::cost::cluster::parse_cluster_shorthand;
use autopar_rules::model::frontend::{
    Attention, Bias, LowerOptions, Mlp, ModelDef, MoeConfig, MoeRouting, Norm, Position,
    TransformerConfig,
};
use autopar_rules::model::graph::{DType, TensorKind};
use autopar_rules::plan::estimate::Estimator;
use autopar_rules::plan::layout::{Layout, Recompute};
use autopar_rules::plan::runtime::{GivenSettings, Runtime};
use autopar_rules::plan::search::{SearchSpace, candidates, search};
use autopar_tests::TempWorkspace;

/// `autopar graph MODEL --json` of a shipped model file.
fn graph(ws: &TempWorkspace, file: &str) -> serde_json::Value {
    let r = ws.run(&["graph", file, "--seq", "4096", "--json"]);
    assert_eq!(r.code, 0, "{file}: {}", r.stderr);
    r.json()
}

/// `x` rounded to the digits a model card gives (`digits` after the point, in billions).
fn billions(x: u64, digits: i32) -> f64 {
    let scale = 10f64.powi(digits);
    (x as f64 / 1e9 * scale).round() / scale
}

/// Total and active parameters against their model cards. Cards count the input embedding
/// differently: Mistral AI counts it in Mixtral-8x7B's 12.9B active (12.88B), DeepSeek does not
/// in V3's 37B (36.63B; 37.55B with it), Qwen counts it in Qwen1.5-MoE-A2.7B's 2.7B (2.69B) and
/// in Qwen3-30B-A3B's 3.3B (3.35B, which the card truncates). Each count must round to the
/// card's figure at the card's precision, except Qwen3-30B-A3B's active count, within 2%.
#[test]
fn published_parameter_counts() {
    let ws = TempWorkspace::default_copy();
    for (file, total, active, digits, with_embedding, exact) in [
        ("models/mixtral-8x7b.json", 46.7, 12.9, 1, true, true),
        ("models/deepseek-v3.json", 671.0, 37.0, 0, false, true),
        ("models/qwen1.5-moe-a2.7b.json", 14.3, 2.7, 1, true, true),
        ("models/qwen3-30b-a3b.json", 30.5, 3.3, 1, true, false),
    ] {
        let j = graph(&ws, file);
        let count = |key: &str| j[key].as_u64().unwrap_or_else(|| panic!("{file}: {key}"));
        assert_eq!(billions(count("parameters"), digits), total, "{file}");
        let key = if with_embedding {
            "active_parameters"
        } else {
            "active_parameters_without_input_embedding"
        };
        if exact {
            assert_eq!(billions(count(key), digits), active, "{file}: {key}");
        } else {
            let rel = count(key) as f64 / 1e9 / active - 1.0;
            assert!(rel.abs() < 0.02, "{file}: {key} {}", count(key));
        }
    }
}

/// The text output names the active parameters beside the total.
#[test]
fn graph_prints_active_parameters_and_the_moe_ops() {
    let ws = TempWorkspace::default_copy();
    let r = ws.run(&["graph", "mixtral-8x7b", "--seq", "4096"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    for needle in [
        "mixtral-8x7b: 46.70 B parameters (12.88 B active per token, 12.75 B without the input embedding)",
        "layers.0.router.topk",
        "moe_dispatch",
        "[8, 1024, 4096] [8, 4096, 28672] -> [8, 1024, 28672]",
        "moe_combine",
    ] {
        assert!(r.stdout.contains(needle), "{needle}\n{}", r.stdout);
    }
    let r = ws.run(&["graph", "deepseek-v3", "--seq", "4096"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    for needle in [
        "layers.0.mlp.gate_up",
        "layers.3.router.topk",
        "layers.3.shared_experts.gate_up",
        "layers.0.attention.kv_down",
        "[1, 128, 4096, 192] [1, 128, 4096, 192] [1, 128, 4096, 128] -> [1, 128, 4096, 128]",
    ] {
        assert!(r.stdout.contains(needle), "{needle}\n{}", r.stdout);
    }
}

/// A small MoE model: 8 experts, top-2, on blocks of width 256.
fn tiny_moe() -> ModelDef {
    ModelDef::Transformer(TransformerConfig {
        hidden: 256,
        layers: 4,
        heads: 8,
        kv_heads: 4,
        head_dim: 32,
        ffn_hidden: 512,
        vocab: 4096,
        max_seq: 1024,
        mlp: Mlp::SwiGlu,
        norm: Norm::RmsNorm,
        position: Position::Rope,
        tied_embeddings: false,
        bias: Bias::None,
        dropout: false,
        moe: Some(MoeConfig {
            experts: 8,
            top_k: 2,
            expert_ffn: 512,
            shared_ffn: 0,
            dense_layers: 0,
            router_bias: false,
            routing: MoeRouting::default(),
        }),
        mla: None,
        qk_norm: false,
    })
}

fn layout(tp: u64, ep: u64, etp: u64, pp: u64, dp: u64) -> Layout {
    Layout {
        tp,
        cp: 1,
        cp_comm: Default::default(),
        ep,
        etp,
        pp,
        dp,
        micro_batch: 1,
        global_batch: 16,
        interleave: 1,
        sequence_parallel: tp > 1,
        recompute: Recompute::None,
        zero: 1,
    }
}

/// Expert parallelism divides the routed experts' weights and moves tokens, and changes
/// nothing else: with the same tp, pp and dp, the dense parameters and the model FLOPs of a
/// step are equal, the experts' weights per GPU fall by exactly ep, and their optimizer states
/// are sharded over the expert data-parallel group (dp x tp / (ep x etp)).
#[test]
fn expert_parallelism_divides_the_experts_and_keeps_the_work() {
    let model = tiny_moe();
    let cluster = parse_cluster_shorthand("h100-sxm:2x4").expect("cluster");
    let opts = Runtime::default().options(512, None, None, 0.1, 128, GivenSettings::default());
    let est = Estimator::new("tiny-moe", &model, &cluster, opts);
    let g = est.graph(1, 1, 1).expect("lowers");
    let expert_params: f64 = g
        .tensors
        .iter()
        .filter(|t| t.kind == TensorKind::Parameter && t.name.contains(".experts."))
        .map(|t| t.elements() as f64)
        .sum();
    assert_eq!(expert_params, 4.0 * 8.0 * 3.0 * 256.0 * 512.0);
    let plain = est.evaluate(&layout(1, 1, 1, 1, 8)).expect("ep 1");
    for ep in [2, 4, 8] {
        let split = est.evaluate(&layout(1, ep, 1, 1, 8)).expect("ep");
        let (a, b) = (&plain.stages[0], &split.stages[0]);
        assert_eq!(a.expert_params, expert_params);
        assert_eq!(b.expert_params, expert_params / ep as f64, "ep {ep}");
        assert_eq!(a.params - a.expert_params, b.params - b.expert_params);
        assert_eq!(plain.model_flops_per_step, split.model_flops_per_step);
        // The all-to-all appears; the compute of a step does not change.
        assert_eq!(plain.time.tp_comm, 0.0);
        assert!(split.time.tp_comm > 0.0, "ep {ep}");
        // ZeRO-1 shards the experts' optimizer states over 8 / ep ranks, the rest over 8.
        let dense = a.params - a.expert_params;
        let bytes = opts.state_bytes().optimizer;
        let want = bytes * (dense / 8.0 + b.expert_params / (8 / ep) as f64);
        let got = b.memory.optimizer;
        assert!((got / want - 1.0).abs() < 1e-12, "ep {ep}: {got} vs {want}");
    }
    // Expert tensor parallelism: each expert's width over etp ranks, under tp 2 with SP.
    let etp = est.evaluate(&layout(2, 2, 2, 1, 4)).expect("etp 2");
    assert_eq!(etp.stages[0].expert_params, expert_params / 4.0);
    assert_eq!(etp.model_flops_per_step, plain.model_flops_per_step);
}

/// The search over a space with expert degrees finds the layout that pricing every candidate
/// and refining it finds: nothing of the expert dimensions is cut by its bounds.
#[test]
fn the_search_is_the_optimum_of_every_expert_layout() {
    let model = tiny_moe();
    let cluster = parse_cluster_shorthand("h100-sxm:2x4").expect("cluster");
    let opts = Runtime::default().options(
        512,
        None,
        Some(Attention::Flash),
        0.1,
        128,
        GivenSettings::default(),
    );
    let est = Estimator::new("tiny-moe", &model, &cluster, opts);
    let space = SearchSpace {
        tp: vec![1, 2],
        micro_batch: vec![1, 2],
        interleave: vec![1],
        recompute: vec![Recompute::None, Recompute::Full],
        zero: vec![0, 1],
        ep: vec![1, 2, 4, 8],
        etp: vec![1, 2],
        ..SearchSpace::default_for(4)
    };
    let found = search(&est, &space, 16, 1);
    let best = found.best().expect("a layout fits");
    let mut exhaustive = f64::INFINITY;
    let mut with_ep = 0;
    for l in candidates(&space, cluster.gpus(), 16) {
        if let Ok(r) = est.refine(&l) {
            with_ep += usize::from(l.ep > 1);
            if r.estimate.fits {
                exhaustive = exhaustive.min(r.estimate.step_time_s);
            }
        }
    }
    assert!(with_ep > 0);
    assert_eq!(best.step_time_s, exhaustive, "{}", best.layout.describe());
}

/// Bad input is an error naming what is wrong, with exit code 2.
#[test]
fn bad_expert_input_is_a_clear_error() {
    let ws = TempWorkspace::default_copy();
    let base = [
        "estimate",
        "--model",
        "mixtral-8x7b",
        "--cluster",
        "h100-sxm:4x8",
        "--gbs",
        "256",
        "--seq",
        "4096",
    ];
    for (args, want) in [
        (
            vec!["--ep", "3", "--pp", "4"],
            "error: expert parallelism ep = 3, etp = 1: ep does not divide the model's 8 experts",
        ),
        (
            vec!["--ep", "4", "--tp", "2", "--pp", "4"],
            "error: expert parallelism ep = 4, etp = 2: mixture-of-experts layers under tensor parallelism need sequence parallelism",
        ),
        (
            vec!["--ep", "8", "--etp", "8", "--pp", "4"],
            "error: expert parallelism ep = 8, etp = 8: etp x ep = 64 does not divide a stage's tp x cp x dp = 8 GPUs",
        ),
        (
            vec!["--etp", "3", "--pp", "4"],
            "error: expert parallelism ep = 1, etp = 3: etp does not divide the experts' width 14336",
        ),
    ] {
        let mut all = base.to_vec();
        all.extend(args);
        let r = ws.run(&all);
        assert_eq!(r.code, 2, "{all:?}: {}", r.stderr);
        assert!(r.stderr.contains(want), "{all:?}: {}", r.stderr);
    }
    // A dense model has no experts to divide.
    let r = ws.run(&[
        "estimate",
        "--model",
        "llama3-8b",
        "--cluster",
        "h100-sxm:1x8",
        "--gbs",
        "64",
        "--ep",
        "2",
    ]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(
        r.stderr.contains(
            "expert parallelism ep = 2, etp = 1: the model has no mixture-of-experts layers"
        ),
        "{}",
        r.stderr
    );
    // Top-k above the experts, in a HuggingFace config: the field, its line, the range.
    let text = ws
        .read("models/mixtral-8x7b.json")
        .replace("\"num_experts_per_tok\": 2", "\"num_experts_per_tok\": 9");
    ws.write("models/bad-moe.json", &text);
    let r = ws.run(&["graph", "models/bad-moe.json"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(
        r.stderr.contains("num_experts_per_tok")
            && r.stderr.contains("expected 1 to the 8 experts, found 9"),
        "{}",
        r.stderr
    );
    // The intra-op ILP does not model routing: solve says so instead of planning wrongly.
    let r = ws.run(&[
        "solve",
        "sharding",
        "--model",
        "mixtral-8x7b",
        "--mesh",
        "1x2",
        "--seq",
        "128",
    ]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("moe_router"), "{}", r.stderr);
}

/// A target's router settings: a capacity factor drops tokens past it and sizes the experts'
/// buffers; a load imbalance is dropless; both at once, or either on a dense model, is an
/// error naming the field.
#[test]
fn router_settings_size_the_expert_buffers() {
    let ws = TempWorkspace::default_copy();
    let model = tiny_moe();
    let ModelDef::Transformer(c) = &model else {
        unreachable!()
    };
    let moe = c.moe.expect("moe");
    let opts = LowerOptions {
        micro_batch: 1,
        seq: 512,
        dtype: DType::Bf16,
        attention: Attention::Flash,
        vocab_multiple: 128,
        eager_elementwise: false,
        fp8: false,
    };
    for (factor, drop, cap) in [(1.0, false, 128), (1.25, true, 160), (1.3, false, 167)] {
        let routed = model
            .with_routing(MoeRouting {
                factor: autopar_rules::model::frontend::Milli::of(factor).expect("ratio"),
                drop_tokens: drop,
            })
            .expect("a MoE model");
        let g = routed.lower("tiny-moe", &opts).expect("lowers");
        let buffer = g
            .tensors
            .iter()
            .find(|t| t.name == "layers.0.experts.dispatched")
            .expect("dispatched");
        // 512 tokens x top-2 / 8 experts = 128 per expert, times the factor, rounded up.
        assert_eq!(buffer.shape, vec![8, cap, 256], "factor {factor}");
        assert_eq!(moe.capacity(512), 128);
    }
    let mut text = ws.read("workspace.toml");
    text = text.replace(
        "name = \"mixtral-8x7b\"\nmodel = \"mixtral-8x7b\"",
        "name = \"mixtral-8x7b\"\nmodel = \"mixtral-8x7b\"\nmoe_capacity_factor = 1.25\nmoe_load_imbalance = 1.1",
    );
    ws.write("workspace.toml", &text);
    let r = ws.run(&["build", "mixtral-8x7b"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(
        r.stderr.contains("field `target.moe_load_imbalance`: expected either moe_capacity_factor (tokens dropped) or moe_load_imbalance (dropless), not both"),
        "{}",
        r.stderr
    );
}

/// The value after `--name` in a launch script, one argument per line.
fn arg<'a>(script: &'a str, name: &str) -> Option<&'a str> {
    script.lines().find_map(|l| {
        let l = l.trim().trim_end_matches('\\').trim();
        l.strip_prefix(&format!("--{name} "))
    })
}

/// The default MoE targets plan with expert parallelism and export it as Megatron-LM and NeMo
/// launch it: the expert degrees, experts, router and (DeepSeek-V3) MLA and dense blocks; a
/// framework without this model is an error naming what it lacks.
#[test]
fn moe_plans_export_their_expert_layout() {
    let ws = TempWorkspace::default_copy();
    let b = ws.run(&["build", "mixtral-8x7b", "deepseek-v3"]);
    assert_eq!(b.code, 0, "{}", b.stderr);
    for target in ["mixtral-8x7b", "deepseek-v3"] {
        let plan: serde_json::Value =
            serde_json::from_str(&ws.read(&format!("plans/{target}.json"))).expect("plan");
        let layout = &plan["estimate"]["layout"];
        let (ep, etp) = (
            layout["ep"].as_u64().expect("ep"),
            layout["etp"].as_u64().expect("etp"),
        );
        assert!(ep > 1, "{target}: {layout}");
        let r = ws.run(&["export", target, "--format", "megatron"]);
        assert_eq!(r.code, 0, "{}", r.stderr);
        let s = &r.stdout;
        assert_eq!(arg(s, "expert-model-parallel-size"), Some(&*ep.to_string()));
        assert_eq!(
            arg(s, "expert-tensor-parallel-size"),
            Some(&*etp.to_string())
        );
        assert_eq!(arg(s, "moe-token-dispatcher-type"), Some("alltoall"));
        assert!(s.contains("--moe-grouped-gemm"), "{s}");
    }
    let r = ws.run(&["export", "deepseek-v3", "--format", "megatron"]);
    let s = &r.stdout;
    for (name, value) in [
        ("num-experts", "256"),
        ("moe-router-topk", "8"),
        ("moe-ffn-hidden-size", "2048"),
        ("moe-shared-expert-intermediate-size", "2048"),
        ("moe-layer-freq", "'([0]*3+[1]*58)'"),
        ("q-lora-rank", "1536"),
        ("kv-lora-rank", "512"),
        ("qk-head-dim", "128"),
        ("qk-pos-emb-head-dim", "64"),
        ("v-head-dim", "128"),
    ] {
        assert_eq!(arg(s, name), Some(value), "--{name}\n{s}");
    }
    let r = ws.run(&["export", "mixtral-8x7b", "--format", "nemo"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let y: serde_json::Value = yaml_serde::from_str(&r.stdout).expect("NeMo YAML parses");
    let plan: serde_json::Value =
        serde_json::from_str(&ws.read("plans/mixtral-8x7b.json")).expect("plan");
    let m = &y["model"];
    assert_eq!(m["num_moe_experts"], 8);
    assert_eq!(m["moe_router_topk"], 2);
    assert_eq!(
        m["expert_model_parallel_size"],
        plan["estimate"]["layout"]["ep"]
    );
    assert_eq!(
        m["expert_tensor_parallel_size"],
        plan["estimate"]["layout"]["etp"]
    );
    for (target, format, want) in [
        (
            "mixtral-8x7b",
            "torchtitan",
            "torchtitan's mixture-of-experts models are DeepSeek-V3's",
        ),
        ("deepseek-v3", "nemo", "multi-head latent attention"),
        (
            "mixtral-8x7b",
            "megatron-deepspeed",
            "mixture-of-experts layers",
        ),
    ] {
        let r = ws.run(&["export", target, "--format", format]);
        assert_eq!(r.code, 1, "{target} {format}: {}", r.stderr);
        assert!(r.stderr.contains(want), "{target} {format}: {}", r.stderr);
    }
}

/// Published Mixtral-8x7B training throughput: NVIDIA's Megatron-Core MoE guide reports 468
/// TFLOP/s per H100 in bf16 (Megatron-Core 0.9) with TP1 PP4 EP8 and interleaving. autopar's
/// prediction for that layout must be within 10%, and the default target's plan must use
/// expert parallelism inside a node with no tensor parallelism, as the published layout does.
#[test]
fn mixtral_matches_megatron_cores_published_throughput() {
    let ws = TempWorkspace::default_copy();
    let r = ws.run(&[
        "estimate",
        "--model",
        "mixtral-8x7b",
        "--cluster",
        "dgx-h100:8",
        "--gbs",
        "256",
        "--seq",
        "4096",
        "--tp",
        "1",
        "--pp",
        "4",
        "--ep",
        "8",
        "--vp",
        "4",
        "--zero",
        "1",
        "--balance",
        "--json",
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let tflops = r.json()["tflops_per_gpu"].as_f64().expect("tflops");
    let rel = tflops / 468.0 - 1.0;
    eprintln!(
        "Mixtral-8x7B TP1 PP4 EP8 on 8 x 8 H100: {tflops:.1} TFLOP/s per GPU ({:+.1}%)",
        rel * 100.0
    );
    assert!(rel.abs() < 0.10, "{tflops}");
    let b = ws.run(&["build", "mixtral-8x7b"]);
    assert_eq!(b.code, 0, "{}", b.stderr);
    let plan: serde_json::Value =
        serde_json::from_str(&ws.read("plans/mixtral-8x7b.json")).expect("plan");
    let l = &plan["estimate"]["layout"];
    assert_eq!(
        (l["tp"].as_u64(), l["ep"].as_u64()),
        (Some(1), Some(8)),
        "{l}"
    );
}
