//! Every class of bad input exits with code 2 and one line naming file, line, column, field,
//! what was expected and what was found. Nothing panics.

use autopar_tests::{TempWorkspace, run_in};

/// A valid workspace; each test breaks one thing in it. Line numbers below refer to this text.
const BASE: &str = r#"[[model]]
name = "gpt"
hf_config = "models/gpt2-small.json"

[[model]]
name = "tiny"
transformer = { hidden = 256, layers = 2, heads = 8, ffn_hidden = 1024, vocab = 1000, max_seq = 512 }

[[cluster]]
name = "node"
preset = "a100-80g"
nodes = 1
gpus_per_node = 8

[[target]]
name = "t"
model = "gpt"
cluster = "node"
global_batch = 64
seq_len = 1024
"#;

/// Builds a workspace where `from` is replaced by `to`, runs `build`, and checks that it fails
/// with exit code 2 and exactly the `expected` error line.
fn check(from: &str, to: &str, expected: &str) {
    assert!(BASE.contains(from), "{from:?} is not in the base workspace");
    let ws = TempWorkspace::with_toml(&BASE.replacen(from, to, 1));
    let r = ws.run(&["build"]);
    assert_eq!(r.code, 2, "stdout:\n{}\nstderr:\n{}", r.stdout, r.stderr);
    assert!(!r.stderr.contains("panicked"), "{}", r.stderr);
    assert_eq!(r.stderr.trim(), format!("error: {expected}"));
}

#[test]
fn the_base_workspace_is_valid() {
    let ws = TempWorkspace::with_toml(BASE);
    let r = ws.run(&["build"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
}

#[test]
fn unknown_key() {
    check(
        "seq_len = 1024",
        "seq_len = 1024\nbatch = 4",
        "workspace.toml:21:1: field `target.batch`: expected one of `name`, `model`, \
         `cluster`, `global_batch`, `seq_len`, `precision`, `memory_headroom`, `attention`, \
         `moe_capacity_factor`, `moe_load_imbalance`, `grad_accumulation_fusion`, `grad_reduce_in_fp32`, `overlap_grad_reduce`, \
         `overlap_param_gather`, `fp32_loss`, `eager_elementwise`, `fp8`, `tp_comm_overlap`, `backward_prefetch`, `runtime`, `vocab_multiple`, `space`, `solver`, `search`, `profiles`, \
         found unknown field `batch`",
    );
}

#[test]
fn wrong_type() {
    check(
        "global_batch = 64",
        "global_batch = \"sixty-four\"",
        "workspace.toml:19:16: field `target.global_batch`: expected a positive integer, found \
         string \"sixty-four\"",
    );
}

#[test]
fn zero_batch() {
    check(
        "global_batch = 64",
        "global_batch = 0",
        "workspace.toml:19:16: field `target.global_batch`: expected a positive integer, found \
         integer `0`",
    );
}

#[test]
fn zero_gpus() {
    check(
        "gpus_per_node = 8",
        "gpus_per_node = 0",
        "workspace.toml:13:17: field `cluster.gpus_per_node`: expected a positive integer, found \
         integer `0`",
    );
}

#[test]
fn missing_model_file() {
    let ws = TempWorkspace::with_toml(&BASE.replace("models/gpt2-small.json", "models/nope.json"));
    let r = ws.run(&["build"]);
    assert_eq!(r.code, 2);
    assert!(
        r.stderr.starts_with(
            "error: workspace.toml:3:13: field `model.hf_config`: expected a readable file \
             (relative to the workspace), found `models/nope.json` (No such file or directory"
        ),
        "{}",
        r.stderr
    );
}

#[test]
fn heads_not_dividing_hidden_inline() {
    check(
        "heads = 8,",
        "heads = 7,",
        "workspace.toml:7:43: field `model.transformer.heads`: expected a number of heads that \
         divides the hidden size 256, found 7",
    );
}

#[test]
fn kv_heads_not_dividing_heads_inline() {
    check(
        "heads = 8,",
        "heads = 8, kv_heads = 3,",
        "workspace.toml:7:54: field `model.transformer.kv_heads`: expected a divisor of the 8 \
         attention heads, found 3",
    );
}

#[test]
fn heads_not_dividing_hidden_in_a_model_file() {
    let ws = TempWorkspace::with_toml(BASE);
    let config = ws
        .read("models/gpt2-small.json")
        .replace("\"n_head\": 12", "\"n_head\": 10");
    ws.write("models/gpt2-small.json", &config);
    let r = ws.run(&["build"]);
    assert_eq!(r.code, 2);
    assert_eq!(
        r.stderr.trim(),
        "error: models/gpt2-small.json:13:3: field `n_head`: expected a number of heads that \
         divides the hidden size 768, found 10"
    );
}

#[test]
fn invalid_json_in_a_model_file() {
    let ws = TempWorkspace::with_toml(BASE);
    ws.write(
        "models/gpt2-small.json",
        "{\n  \"n_embd\": 768,\n  \"n_head\": 12\n  \"n_layer\": 12\n}\n",
    );
    let r = ws.run(&["build"]);
    assert_eq!(r.code, 2);
    assert!(
        r.stderr.starts_with("error: models/gpt2-small.json:4:3: field `(document)`: expected a JSON object, found invalid JSON"),
        "{}",
        r.stderr
    );
}

#[test]
fn unknown_preset() {
    check(
        "preset = \"a100-80g\"",
        "preset = \"v100\"",
        "workspace.toml:11:10: field `cluster.preset`: expected one of a100-40g, a100-80g, \
         h100-sxm, h200, cpu, dgx-a100, dgx-a100-40g, dgx-h100, dgx-h200, p4d, p4de, found \
         \"v100\"",
    );
}

#[test]
fn unknown_cluster_key() {
    check(
        "gpus_per_node = 8",
        "gpus_per_node = 8\nnodez = 2",
        "workspace.toml:14:1: field `cluster.nodez`: expected one of `name`, `preset`, `nodes`, \
         `gpus_per_node`, `nics_per_node`, `nic_gbits`, `calibration`, `overrides`, `profiles`, \
         found unknown field `nodez`",
    );
}

#[test]
fn unknown_device_override() {
    check(
        "gpus_per_node = 8",
        "gpus_per_node = 8\noverrides = { nvlink = 900 }",
        "workspace.toml:14:24: field `cluster.overrides.nvlink`: expected one of sm_count, \
         peak_bf16_tflops, peak_fp8_tflops, peak_fp32_tflops, hbm_gib, hbm_tbps, nvlink_gbps, \
         nvlink_latency_us, internode_latency_us, matmul_efficiency, gemm_pipeline_depth, \
         attention_efficiency, fused_attention_efficiency, hbm_efficiency, nvlink_efficiency, internode_efficiency, kernel_overhead_us, \
         reserved_gib, found unknown field `nvlink`",
    );
}

#[test]
fn impossible_override() {
    check(
        "gpus_per_node = 8",
        "gpus_per_node = 8\noverrides = { nvlink_gbps = 50, matmul_efficiency = 1.5 }",
        "workspace.toml:14:53: field `cluster.overrides.matmul_efficiency`: expected a fraction \
         in (0, 1], found 1.5",
    );
}

#[test]
fn the_per_gpu_network_key_of_earlier_versions_points_to_the_node_keys() {
    check(
        "gpus_per_node = 8",
        "gpus_per_node = 8\noverrides = { internode_gbps = 50 }",
        "workspace.toml:14:32: field `cluster.overrides.internode_gbps`: expected the cluster's \
         `nics_per_node` and `nic_gbits` (adapters per node and Gb/s each) in place of a per-GPU \
         network bandwidth, found unknown field `internode_gbps`",
    );
}

#[test]
fn a_device_preset_needs_its_gpus_per_node() {
    check(
        "nodes = 1\ngpus_per_node = 8",
        "nodes = 1",
        "workspace.toml:9:1: field `cluster.gpus_per_node`: expected a positive integer \
         (`a100-80g` is a device preset; a node preset such as dgx-a100 carries its own), found \
         nothing",
    );
}

#[test]
fn a_line_rate_must_be_positive() {
    check(
        "gpus_per_node = 8",
        "gpus_per_node = 8\nnic_gbits = -100",
        "workspace.toml:14:13: field `cluster.nic_gbits`: expected a positive line rate in Gb/s \
         (e.g. 200 for HDR InfiniBand), found -100",
    );
}

#[test]
fn overrides_change_the_prediction() {
    let slow = BASE.replace(
        "gpus_per_node = 8",
        "gpus_per_node = 8\noverrides = { nvlink_gbps = 30 }",
    );
    let predict = |toml: &str| {
        let ws = TempWorkspace::with_toml(toml);
        let r = ws.run(&[
            "estimate",
            "--model",
            "gpt",
            "--cluster",
            "node",
            "--tp",
            "4",
            "--gbs",
            "64",
            "--json",
        ]);
        assert_eq!(r.code, 0, "{}", r.stderr);
        r.json()["time"]["tp_comm"].as_f64().expect("tp comm")
    };
    let (fast, slow) = (predict(BASE), predict(&slow));
    // The ring steps' latencies stay, so less than ten times.
    assert!(
        slow > 3.0 * fast,
        "a tenth of the NVLink bandwidth: {fast} -> {slow}"
    );
}

#[test]
fn unknown_model_reference() {
    check(
        "model = \"gpt\"",
        "model = \"gpt-4\"",
        "workspace.toml:17:9: field `target.model`: expected one of the [[model]] names: gpt, \
         tiny, found \"gpt-4\"",
    );
}

#[test]
fn duplicate_name() {
    check(
        "name = \"tiny\"",
        "name = \"gpt\"",
        "workspace.toml:6:8: field `model.name`: expected a name not used by another [[model]], \
         found \"gpt\" again",
    );
}

#[test]
fn unknown_enum_value() {
    check(
        "seq_len = 1024",
        "seq_len = 1024\nprecision = \"bf8\"",
        "workspace.toml:21:13: field `target.precision`: expected one of `bf16`, `fp16`, `fp32`, \
         found `bf8`",
    );
}

#[test]
fn headroom_out_of_range() {
    check(
        "seq_len = 1024",
        "seq_len = 1024\nmemory_headroom = 1.5",
        "workspace.toml:21:19: field `target.memory_headroom`: expected a fraction in [0, 1), \
         found 1.5",
    );
}

#[test]
fn sequence_longer_than_the_position_table() {
    check(
        "seq_len = 1024",
        "seq_len = 2048",
        "workspace.toml:20:11: field `target.seq_len`: expected at most 1024 (the model's \
         learned position table), found 2048",
    );
}

#[test]
fn empty_search_list() {
    check(
        "seq_len = 1024",
        "seq_len = 1024\n[target.search]\ntp = []",
        "workspace.toml:22:6: field `target.search.tp`: expected a list with at least one value, \
         found an empty list",
    );
}

#[test]
fn torchtitans_op_policy_is_not_searched() {
    check(
        "seq_len = 1024",
        "seq_len = 1024\n[target.search]\nrecompute = [\"none\", \"selective-op\"]",
        "workspace.toml:22:13: field `target.search.recompute`: expected none, selective or full \
         (the search plans Megatron-LM's recomputation; price torchtitan's `selective-op` with \
         `estimate --recompute selective-op`), found \"selective-op\"",
    );
}

#[test]
fn zero_stage_out_of_range() {
    check(
        "seq_len = 1024",
        "seq_len = 1024\n[target.search]\nzero = [0, 4]",
        "workspace.toml:22:12: field `target.search.zero`: expected a ZeRO stage: 0, 1, 2 or 3, \
         found integer `4`",
    );
}

#[test]
fn context_parallel_search_values() {
    check(
        "seq_len = 1024",
        "seq_len = 1024\n[target.search]\ncp = [1, 0]",
        "workspace.toml:22:10: field `target.search.cp`: expected a positive integer, found \
         integer `0`",
    );
    check(
        "seq_len = 1024",
        "seq_len = 1024\n[target.search]\ncp = [1, 2]\ncp_comm = [\"ring\"]",
        "workspace.toml:23:12: field `target.search.cp_comm`: expected one of `p2p`, `a2a`, \
         `allgather`, `a2a+p2p`, found `ring`",
    );
}

#[test]
fn toml_syntax_error() {
    check(
        "[[target]]",
        "[[target]",
        "workspace.toml:15:10: field `(document)`: expected valid TOML, found unclosed array \
         table, expected `]`",
    );
    // In a value: the key is named.
    check(
        "seq_len = 1024",
        "seq_len = \"1024",
        "workspace.toml:20:16: field `target.seq_len`: expected valid TOML, found invalid basic \
         string, expected `\"`",
    );
}

#[test]
fn missing_workspace_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let r = run_in(dir.path(), &["build"]);
    assert_eq!(r.code, 2);
    assert!(
        r.stderr
            .starts_with("error: cannot read workspace.toml: No such file"),
        "{}",
        r.stderr
    );
}

#[test]
fn graph_file_errors_point_into_the_graph_file() {
    let ws = TempWorkspace::with_toml(
        "[[model]]\nname = \"m\"\ngraph = \"models/tiny-mlp.graph.json\"\n",
    );
    let text = ws
        .read("models/tiny-mlp.graph.json")
        .replace("\"inputs\": [\"h_0\"]", "\"inputs\": [\"h_9\"]");
    ws.write("models/tiny-mlp.graph.json", &text);
    let r = ws.run(&["build"]);
    assert_eq!(r.code, 2);
    assert_eq!(
        r.stderr.trim(),
        "error: models/tiny-mlp.graph.json:34:55: field `layers[1].ops[1].inputs[0]`: expected \
         the name of a tensor listed in `tensors`, found \"h_9\""
    );
}

#[test]
fn bad_command_line_values() {
    let ws = TempWorkspace::with_toml(BASE);
    let cases: [(&[&str], &str); 6] = [
        (
            &[
                "estimate",
                "--model",
                "gpt",
                "--cluster",
                "a100-80g:0x8",
                "--gbs",
                "8",
            ],
            "error: --cluster: expected PRESET:NODESxGPUS or NODE-PRESET:NODES, e.g. a100-80g:4x8 or dgx-h100:16, found `a100-80g:0x8` (the number of nodes must be a positive integer, found `0`)",
        ),
        (
            &[
                "estimate",
                "--model",
                "gpt",
                "--cluster",
                "node",
                "--tp",
                "5",
                "--pp",
                "1",
                "--dp",
                "1",
                "--gbs",
                "8",
            ],
            "error: tp x pp x dp = 5 x 1 x 1 = 5, but the cluster has 8 GPUs",
        ),
        (
            &[
                "estimate",
                "--model",
                "gpt",
                "--cluster",
                "node",
                "--tp",
                "4",
                "--pp",
                "4",
                "--gbs",
                "8",
            ],
            "error: --tp 4 x --cp 1 x --pp 4: expected a product that divides the 8 GPUs of `node`, found 16; pass --dp, or degrees that fit",
        ),
        (
            &[
                "estimate",
                "--model",
                "gpt",
                "--cluster",
                "a100-80g:1x8",
                "--tp",
                "8",
                "--gbs",
                "8",
            ],
            "error: tp = 8 does not divide the attention heads (12)",
        ),
        (
            &[
                "estimate",
                "--model",
                "nope",
                "--cluster",
                "node",
                "--gbs",
                "8",
            ],
            "error: model `nope` is not known: expected a model of workspace.toml (gpt, tiny)",
        ),
        (
            &["estimate", "--model", "gpt"],
            "error: the following required arguments were not provided",
        ),
    ];
    for (args, prefix) in cases {
        let r = ws.run(args);
        assert_eq!(r.code, 2, "{args:?}: {}", r.stderr);
        assert!(r.stderr.starts_with(prefix), "{args:?}:\n{}", r.stderr);
    }
}
