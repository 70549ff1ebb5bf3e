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

/// A graph file with ops of kinds autopar does not know: every command reads it with one
/// warning per kind (the line, the kinds known, the kind a typo most likely meant), plans and
/// prices it, and the executor refuses it by name.
#[test]
fn unknown_op_kinds_are_planned_as_opaque_ops_with_a_warning() {
    let ws = TempWorkspace::default_copy();
    // tiny-mlp shrunk to what the CPU executor holds, with a typo in one kind.
    let text = autopar_tests::sharding::opaque_mlp()
        .replace("32768", "512")
        .replace("4096", "256")
        .replace("1024", "64")
        .replace(
            r#""name": "mlp1.down", "kind": "matmul""#,
            r#""name": "mlp1.down", "kind": "matmull""#,
        );
    ws.write("custom.graph.json", &text);
    let line_of = |needle: &str| text.lines().position(|l| l.contains(needle)).expect(needle) + 1;
    let g = ws.run(&["graph", "custom.graph.json", "--json"]);
    assert_eq!(g.code, 0, "{}", g.stderr);
    for (kind, hint) in [
        ("fused_act", ""),
        ("my_norm", ""),
        ("matmull", r#" (did you mean "matmul"?)"#),
    ] {
        let warning = format!("custom.graph.json:{}:", line_of(kind));
        let what = format!(r#"unknown op kind "{kind}"{hint}: run as an opaque op"#);
        assert!(
            g.stderr.contains(&warning) && g.stderr.contains(&what),
            "{kind}: {}",
            g.stderr
        );
    }
    assert_eq!(
        g.stderr.matches("unknown op kind").count(),
        3,
        "{}",
        g.stderr
    );
    assert!(
        g.stderr
            .contains("the kinds autopar knows are embedding, matmul")
    );

    let s = ws.run(&[
        "solve",
        "sharding",
        "--model",
        "custom.graph.json",
        "--mesh",
        "1x2",
        "--layers",
        "1",
        "--json",
    ]);
    assert_eq!(s.code, 0, "{}", s.stderr);
    let ops = s.json()["ops"].as_array().cloned().unwrap_or_default();
    assert!(ops.iter().any(|o| o["kind"] == "opaque"), "{}", s.stdout);

    let e = ws.run(&[
        "estimate",
        "--model",
        "custom.graph.json",
        "--cluster",
        "h100-sxm:1x8",
        "--tp",
        "2",
        "--pp",
        "1",
        "--mbs",
        "1",
        "--gbs",
        "8",
        "--sp",
        "--json",
    ]);
    assert_eq!(e.code, 0, "{}", e.stderr);
    assert!(e.json()["step_time_s"].as_f64().is_some_and(|t| t > 0.0));

    let mut toml = ws.read("workspace.toml");
    toml.push_str(
        r#"
[[model]]
name = "custom"
graph = "custom.graph.json"

[[target]]
name = "custom"
model = "custom"
cluster = "dgx-h100-1"
global_batch = 8
seq_len = 32
"#,
    );
    ws.write("workspace.toml", &toml);
    let b = ws.run(&["build", "custom", "--json"]);
    assert_eq!(b.code, 0, "{}", b.stderr);
    let plan: serde_json::Value =
        serde_json::from_str(&ws.read("plans/custom.json")).expect("plan");
    assert!(
        plan["spaces"]["ilp"]["step_time_s"].as_f64().is_some(),
        "{plan}"
    );
    let r = ws.run(&["run", "custom", "--steps", "1"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(
        r.stderr.contains(
            "(opaque): autopar's executors (CPU and JAX) have no kernel for ops of kinds"
        ),
        "{}",
        r.stderr
    );
}
