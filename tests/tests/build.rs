//! `autopar build` and `autopar plan show` on the default workspace and variations of it.

use autopar_tests::TempWorkspace;
use serde_json::Value;

const REQUIRED: [(&str, u64); 3] = [("gpt3-175b", 1024), ("llama2-70b", 64), ("llama3-8b", 8)];

fn target<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["targets"]
        .as_array()
        .and_then(|ts| ts.iter().find(|t| t["name"] == name))
        .unwrap_or_else(|| panic!("target {name} missing from {report}"))
}

#[test]
fn default_workspace_plans_every_target() {
    let ws = TempWorkspace::default_copy();
    let run = ws.run(&["build", "--json"]);
    assert_eq!(run.code, 0, "stderr:\n{}", run.stderr);
    let report = run.json();
    assert_eq!(report["infeasible"], 0);
    for (name, gpus) in REQUIRED {
        let t = target(&report, name);
        assert_eq!(t["status"], "planned", "{t}");
        let l = &t["layout"];
        let product = ["tp", "pp", "dp"]
            .iter()
            .map(|k| l[k].as_u64().expect("degree"))
            .product::<u64>();
        assert_eq!(product, gpus, "{name}: tp x pp x dp uses the whole cluster");
        assert_eq!(t["fits"], true);
        let mfu = t["mfu"].as_f64().expect("mfu");
        assert!(mfu > 0.2 && mfu < 0.8, "{name}: MFU {mfu}");
        // The plan on disk is the one reported.
        let plan: Value =
            serde_json::from_str(&ws.read(&format!("plans/{name}.json"))).expect("plan JSON");
        assert_eq!(plan["estimate"]["layout"], *l);
        assert_eq!(plan["target"], name);
        let usable = plan["estimate"]["memory_capacity"]
            .as_f64()
            .expect("capacity");
        let needed = plan["estimate"]["memory"]["total"]
            .as_f64()
            .expect("memory");
        assert!(needed <= usable, "{name}: {needed} > {usable}");
    }
    // Megatron-LM's finding: tensor parallelism stays inside an 8-GPU node.
    let gpt3 = target(&report, "gpt3-175b");
    assert!(gpt3["layout"]["tp"].as_u64().expect("tp") <= 8);
}

#[test]
fn plan_show_prints_what_build_stored() {
    let ws = TempWorkspace::default_copy();
    let built = ws.run(&["build", "llama3-8b"]);
    assert_eq!(built.code, 0, "{}", built.stderr);
    // Only the named target is built.
    assert!(ws.path().join("plans/llama3-8b.json").exists());
    assert!(!ws.path().join("plans/gpt3-175b.json").exists());

    let shown = ws.run(&["plan", "show", "llama3-8b", "--json"]);
    assert_eq!(shown.code, 0, "{}", shown.stderr);
    let stored: Value = serde_json::from_str(&ws.read("plans/llama3-8b.json")).expect("plan");
    assert_eq!(shown.json(), stored);

    let text = ws.run(&["plan", "show", "llama3-8b"]);
    assert_eq!(text.code, 0);
    for needle in [
        "layout",
        "MFU",
        "per device",
        "weights",
        "activations",
        "--tensor-model-parallel-size",
        "--num-query-groups 8",
        "--swiglu",
    ] {
        assert!(
            text.stdout.contains(needle),
            "missing {needle:?} in\n{}",
            text.stdout
        );
    }
    // The text report of the build says the same as plan show.
    assert!(
        built
            .stdout
            .contains(text.stdout.lines().next().expect("first line"))
    );
}

#[test]
fn plan_show_before_build_says_what_to_run() {
    let ws = TempWorkspace::default_copy();
    let r = ws.run(&["plan", "show", "llama3-8b"]);
    assert_eq!(r.code, 1);
    assert!(
        r.stderr.contains("run `autopar build llama3-8b` first"),
        "{}",
        r.stderr
    );
}

#[test]
fn unknown_target_is_a_usage_error() {
    let ws = TempWorkspace::default_copy();
    let r = ws.run(&["build", "gpt5"]);
    assert_eq!(r.code, 2);
    assert!(
        r.stderr.contains("target `gpt5` is not known"),
        "{}",
        r.stderr
    );
    assert!(
        r.stderr.contains("llama3-8b"),
        "lists the known targets: {}",
        r.stderr
    );
}

const TOO_BIG: &str = r#"
[[model]]
name = "llama3-405b"
hf_config = "models/llama3-405b.json"

[[model]]
name = "gpt2"
hf_config = "models/gpt2-small.json"

[[cluster]]
name = "one-node"
preset = "a100-40g"
nodes = 1
gpus_per_node = 8

[[target]]
name = "huge"
model = "llama3-405b"
cluster = "one-node"
global_batch = 64
seq_len = 4096

[[target]]
name = "small"
model = "gpt2"
cluster = "one-node"
global_batch = 64
seq_len = 1024
"#;

#[test]
fn infeasible_target_names_the_memory_constraint_and_partial_build_exits_3() {
    let ws = TempWorkspace::with_toml(TOO_BIG);
    let r = ws.run(&["build"]);
    assert_eq!(
        r.code, 3,
        "one target planned, one infeasible:\n{}",
        r.stderr
    );
    assert!(
        r.stderr
            .contains("target huge is infeasible: no layout fits in memory"),
        "{}",
        r.stderr
    );
    assert!(r.stderr.contains("GiB per device"), "{}", r.stderr);
    assert!(
        r.stderr
            .contains("a100-40g has 36.0 GiB usable (40.0 GiB less 10% headroom)"),
        "{}",
        r.stderr
    );
    assert!(ws.path().join("plans/small.json").exists());
    assert!(!ws.path().join("plans/huge.json").exists());

    let only = ws.run(&["build", "huge", "--json"]);
    assert_eq!(only.code, 1);
    let report = only.json();
    assert_eq!(target(&report, "huge")["status"], "infeasible");
}

#[test]
fn a_target_that_becomes_infeasible_loses_its_stale_plan() {
    let ws = TempWorkspace::with_toml(TOO_BIG);
    assert_eq!(ws.run(&["build", "small"]).code, 0);
    assert!(ws.path().join("plans/small.json").exists());
    // The same target now asks for a model that cannot fit.
    ws.write(
        "workspace.toml",
        &TOO_BIG.replace("model = \"gpt2\"", "model = \"llama3-405b\""),
    );
    let r = ws.run(&["build", "small"]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(!ws.path().join("plans/small.json").exists());
}

#[test]
fn graph_file_and_inline_models_are_planned() {
    let ws = TempWorkspace::with_toml(
        r#"
[[model]]
name = "mlp"
graph = "models/tiny-mlp.graph.json"

[[model]]
name = "tiny"
transformer = { hidden = 256, layers = 4, heads = 8, kv_heads = 2, ffn_hidden = 768, vocab = 32000, max_seq = 2048, mlp = "swiglu", norm = "rmsnorm", position = "rope" }

[[cluster]]
name = "node"
preset = "h100-sxm"
nodes = 1
gpus_per_node = 8

[[target]]
name = "mlp"
model = "mlp"
cluster = "node"
global_batch = 32
[target.search]
tp = [2]

[[target]]
name = "tiny"
model = "tiny"
cluster = "node"
global_batch = 64
"#,
    );
    let r = ws.run(&["build", "--json"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let report = r.json();
    let mlp = target(&report, "mlp");
    assert_eq!(mlp["layout"]["tp"], 2, "the search space restricts tp");
    assert_eq!(target(&report, "tiny")["status"], "planned");
}
