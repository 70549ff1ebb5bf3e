//! `autopar graph`: op graphs of the shipped models.

use autopar_tests::TempWorkspace;

#[test]
fn graph_json_summarises_layers_and_flops() {
    let ws = TempWorkspace::default_copy();
    let r = ws.run(&["graph", "gpt3-175b", "--json"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let j = r.json();
    let params = j["parameters"].as_u64().expect("parameters");
    assert!((params as f64 / 175e9 - 1.0).abs() < 0.01, "{params}");
    let groups = j["groups"].as_array().expect("groups");
    // Embedding, 96 identical blocks folded into one group, head.
    assert_eq!(groups.len(), 3);
    assert_eq!(
        (groups[1]["first"].as_u64(), groups[1]["last"].as_u64()),
        (Some(1), Some(96))
    );
    assert_eq!(groups[1]["layer"]["kind"], "block");
    // Forward FLOPs per token ~ 2 N plus attention; training ~ 3x forward.
    let fwd = j["forward_flops_per_token"].as_f64().expect("fwd");
    assert!(
        fwd > 2.0 * params as f64 && fwd < 2.2 * params as f64,
        "{fwd}"
    );
    let train = j["training_flops_per_token"].as_f64().expect("train");
    assert!((train / fwd - 3.0).abs() < 0.05, "{train} / {fwd}");
}

#[test]
fn graph_text_lists_ops_of_each_distinct_layer() {
    let ws = TempWorkspace::default_copy();
    let r = ws.run(&["graph", "llama3-8b", "--seq", "8192"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    for needle in [
        "llama3-8b: 8.03 B parameters, 34 layers",
        "FLOPs per token",
        "same for layers 1-32",
        "layers.0.attention.qkv",
        "flash_attention",
        "layers.0.mlp.swiglu",
        "head.loss.grad",
    ] {
        assert!(
            r.stdout.contains(needle),
            "missing {needle:?}:\n{}",
            r.stdout
        );
    }
}

#[test]
fn graph_of_a_graph_file() {
    let ws = TempWorkspace::default_copy();
    let r = ws.run(&["graph", "models/tiny-mlp.graph.json", "--json"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let j = r.json();
    assert_eq!(
        j["parameters"],
        2 * 32768 * 1024 + 2 * 2 * 1024 * 4096 + 1024
    );
    assert_eq!(j["seq"], 1024, "the file's max_seq is the default sequence");
}
