//! The build's two spaces: Megatron-LM's layouts and the intra-op ILP with Alpa's stage DP.
//! The faster plan wins and the plan says by how much, the target's `space` restricts the
//! choice, the ILP results are cached per kind and an edit re-runs only what it touches.

use autopar_tests::{Run, TempWorkspace};
use serde_json::Value;

/// A small transformer on one node of two GPUs (1D logical meshes only, so every table is
/// quick), with the target's extra keys after `global_batch`.
fn workspace(target_extra: &str, layers: u64) -> String {
    format!(
        r#"
[[model]]
name = "tiny"
transformer = {{ hidden = 256, layers = {layers}, heads = 8, ffn_hidden = 1024, vocab = 8000, max_seq = 256 }}

[[cluster]]
name = "two"
preset = "h100-sxm"
nodes = 1
gpus_per_node = 2

[[target]]
name = "tiny"
model = "tiny"
cluster = "two"
global_batch = 8
seq_len = 128
{target_extra}
"#
    )
}

fn built(r: &Run) -> Value {
    assert_eq!(r.code, 0, "stdout:\n{}\nstderr:\n{}", r.stdout, r.stderr);
    r.json()
}

/// `kinds.<kind>.<field>` of a `build --json` output (0 when the kind was not asked for).
fn kind(j: &Value, kind: &str, field: &str) -> u64 {
    j["kinds"][kind][field].as_u64().unwrap_or(0)
}

fn plan(ws: &TempWorkspace) -> Value {
    serde_json::from_str(&ws.read("plans/tiny.json")).expect("plan is JSON")
}

#[test]
fn the_faster_space_wins_and_the_plan_says_why() {
    let ws = TempWorkspace::with_toml(&workspace("space = \"both\"", 4));
    let j = built(&ws.run(&["build", "--json"]));
    let p = plan(&ws);
    let megatron = p["spaces"]["megatron"]["step_time_s"]
        .as_f64()
        .expect("the Megatron-LM space's best");
    let ilp = p["spaces"]["ilp"]["step_time_s"]
        .as_f64()
        .expect("the ILP space's best");
    let step = j["targets"][0]["step_time_s"].as_f64().expect("step");
    // Never slower than either space's best.
    assert_eq!(step, megatron.min(ilp), "{}", j);
    let winner = if ilp < megatron { "ilp" } else { "megatron" };
    assert_eq!(p["space"], winner);
    assert_eq!(j["targets"][0]["space"], winner);
    let stages = p["ilp"]["stages"].as_array().expect("ILP stages");
    assert!(!stages.is_empty());
    let layers: u64 = stages
        .iter()
        .map(|s| s["layers"][1].as_u64().unwrap_or(0) - s["layers"][0].as_u64().unwrap_or(0))
        .sum();
    assert_eq!(
        layers, 6,
        "embedding, 4 blocks and the head, each in one stage"
    );
    for s in stages {
        let devices = s["mesh"]["logical"][0].as_u64().unwrap_or(0)
            * s["mesh"]["logical"][1].as_u64().unwrap_or(0);
        assert!(devices == 1 || devices == 2, "{s}");
        let ops = s["ops"].as_array().expect("every op's specs");
        assert!(ops.len() > 10, "{s}");
        for o in ops {
            assert!(o["inputs"].is_array() && o["outputs"].is_array(), "{o}");
        }
        assert!(s["parameters"].as_array().is_some_and(|w| !w.is_empty()));
    }
    if winner == "ilp" {
        assert_eq!(p["megatron_expressible"], p["ilp"]["megatron_expressible"]);
    } else {
        assert_eq!(p["megatron_expressible"], true);
    }
    if p["ilp"]["megatron_expressible"] == false {
        assert!(p["ilp"]["not_megatron"].is_string(), "the plan says why");
    }
    // The text summary names the winner and the other space's best.
    let text = ws.run(&["build"]);
    assert_eq!(text.code, 0, "{}", text.stderr);
    assert!(
        text.stdout.contains(&format!("space     {winner} wins")),
        "{}",
        text.stdout
    );
    assert!(
        text.stdout.contains("  ilp       micro-batch"),
        "{}",
        text.stdout
    );
}

#[test]
fn the_space_option_restricts_the_choice() {
    let ws = TempWorkspace::with_toml(&workspace("space = \"megatron\"", 4));
    let j = built(&ws.run(&["build", "--json"]));
    let p = plan(&ws);
    assert_eq!(p["space"], "megatron");
    assert!(p["ilp"].is_null());
    assert_eq!(kind(&j, "sharding", "total"), 0, "no ILP table asked for");
    assert_eq!(kind(&j, "stages", "total"), 0);

    ws.write("workspace.toml", &workspace("space = \"ilp\"", 4));
    let j = built(&ws.run(&["build", "--json"]));
    let p = plan(&ws);
    assert_eq!(p["space"], "ilp");
    assert_eq!(
        j["targets"][0]["step_time_s"].as_f64(),
        p["ilp"]["step_time_s"].as_f64()
    );
}

#[test]
fn ilp_results_are_cached_per_kind_and_a_model_edit_re_solves_no_table() {
    let ws = TempWorkspace::with_toml(&workspace(
        "space = \"both\"\n[target.search]\nilp_micro_batch = [2, 4]",
        4,
    ));
    let first = built(&ws.run(&["build", "--json"]));
    // Three distinct layers (embedding, block, head) on each of the 1x1, 1x2 (as 1x2 and 2x1)
    // meshes, at each of the two micro-batch sizes.
    assert_eq!(kind(&first, "sharding", "solved"), 3 * 3 * 2, "{first}");
    assert_eq!(kind(&first, "stages", "solved"), 2, "one stage DP per size");
    // Only the fastest size's stages are decoded, and it is the plan's.
    assert_eq!(kind(&first, "decode", "total"), 1, "{first}");
    assert_eq!(kind(&first, "decode", "solved"), 1, "{first}");
    // Its layers' plans, one per distinct layer, mesh and boundary states: three here (the
    // embedding, the block and the head).
    assert_eq!(kind(&first, "layer-plan", "solved"), 3, "{first}");
    assert_eq!(kind(&first, "layer-plan", "total"), 3, "{first}");
    let p = plan(&ws);
    let sizes: Vec<(u64, f64)> = p["spaces"]["ilp_sizes"]
        .as_array()
        .expect("each size's best")
        .iter()
        .filter_map(|s| Some((s["micro_batch"].as_u64()?, s["step_time_s"].as_f64()?)))
        .collect();
    assert_eq!(sizes.len(), 2, "{sizes:?}");
    let decoded = &p["ilp"];
    let at = |mb: u64| sizes.iter().find(|s| s.0 == mb).map(|s| s.1);
    let mb = decoded["micro_batch"].as_u64().expect("its micro-batch");
    assert_eq!(decoded["step_time_s"].as_f64(), at(mb), "{sizes:?}");
    assert!(sizes.iter().all(|&(_, s)| at(mb) <= Some(s)), "{sizes:?}");
    assert!(
        p["ilp"]["stages"][0]["ops"]
            .as_array()
            .is_some_and(|o| !o.is_empty())
    );
    assert_eq!(kind(&first, "search", "solved"), 1);

    let again = built(&ws.run(&["build", "--json"]));
    for k in [
        "sharding",
        "stages",
        "decode",
        "layer-plan",
        "search",
        "layer-cost",
        "plan",
    ] {
        assert_eq!(kind(&again, k, "solved"), 0, "{k}: {again}");
    }
    assert_eq!(
        kind(&again, "layer-plan", "total"),
        0,
        "the decoded stages are found whole"
    );
    assert_eq!(kind(&again, "plan", "hits_local"), 1);
    assert_eq!(kind(&again, "stages", "hits_local"), 2);
    assert_eq!(kind(&again, "decode", "hits_local"), 1);

    // Two more blocks: the same layers, so no table is solved; the DPs and the search re-run.
    ws.write(
        "workspace.toml",
        &workspace(
            "space = \"both\"\n[target.search]\nilp_micro_batch = [2, 4]",
            6,
        ),
    );
    let edited = built(&ws.run(&["build", "--json"]));
    assert_eq!(kind(&edited, "sharding", "solved"), 0, "{edited}");
    assert_eq!(kind(&edited, "sharding", "hits_local"), 3 * 3 * 2);
    assert_eq!(kind(&edited, "stages", "solved"), 2);
    assert_eq!(kind(&edited, "decode", "solved"), 1);
    // Each layer of the plan decoded once per mesh and boundary states: the embedding's and
    // the blocks' plans are found again, the head's is decoded again (it moved, and its
    // ops' names with it).
    assert_eq!(kind(&edited, "layer-plan", "hits_local"), 2, "{edited}");
    assert_eq!(kind(&edited, "layer-plan", "solved"), 1, "{edited}");
    assert_eq!(kind(&edited, "search", "solved"), 1);
    assert_eq!(kind(&edited, "layer-cost", "solved"), 0);
}

#[test]
fn a_target_can_price_its_layers_by_drec_and_the_plan_says_so() {
    let one_size = "[target.search]\nilp_micro_batch = [2]";
    let ws = TempWorkspace::with_toml(&workspace(
        &format!("space = \"ilp\"\nsolver = \"drec\"\n{one_size}"),
        4,
    ));
    let first = built(&ws.run(&["build", "--json"]));
    assert_eq!(kind(&first, "sharding", "solved"), 3 * 3, "{first}");
    let p = plan(&ws);
    let stages = p["ilp"]["stages"].as_array().expect("ILP stages");
    let mut covered = 0;
    for s in stages {
        for span in s["solvers"].as_array().expect("each stage's solvers") {
            assert_eq!(span["solver"], "drec", "{s}");
            covered +=
                span["layers"][1].as_u64().unwrap_or(0) - span["layers"][0].as_u64().unwrap_or(0);
        }
    }
    assert_eq!(covered, 6, "every layer's solver is named");
    let text = ws.run(&["build"]);
    assert_eq!(text.code, 0, "{}", text.stderr);
    assert!(
        text.stdout
            .contains("every layer priced by D-Rec (heuristic, not proven optimal)"),
        "{}",
        text.stdout
    );
    // D-Rec's tables are cached like the exact ones: a rebuild solves nothing.
    let again = built(&ws.run(&["build", "--json"]));
    assert_eq!(kind(&again, "sharding", "solved"), 0, "{again}");
    let explained = ws.run(&["explain", "tiny"]);
    assert_eq!(explained.code, 0, "{}", explained.stderr);
    assert!(
        explained.stdout.contains(
            "ILP space: every layer table (9) filled by D-Rec (heuristic, not proven optimal)"
        ),
        "{}",
        explained.stdout
    );
    // The solver is part of every table's key: back to the exact elimination, every table is
    // solved again and the plan names it.
    ws.write(
        "workspace.toml",
        &workspace(&format!("space = \"ilp\"\n{one_size}"), 4),
    );
    let exact = built(&ws.run(&["build", "--json"]));
    assert_eq!(kind(&exact, "sharding", "solved"), 3 * 3, "{exact}");
    let p = plan(&ws);
    for s in p["ilp"]["stages"].as_array().expect("ILP stages") {
        for span in s["solvers"].as_array().expect("each stage's solvers") {
            assert_eq!(span["solver"], "exact", "{s}");
        }
    }
}

#[test]
fn bad_space_options_are_named() {
    for (extra, field, found) in [
        ("space = \"fastest\"", "space", "fastest"),
        (
            "[target.search]\nilp_micro_batch = [3]",
            "target.search.ilp_micro_batch",
            "3",
        ),
        ("[target.search]\nsubmeshes = \"some\"", "submeshes", "some"),
        ("solver = \"greedy\"", "solver", "greedy"),
        (
            "[target.search]\nlogical_meshes = [\"2by2\"]",
            "target.search.logical_meshes",
            "2by2",
        ),
        (
            "[target.search]\nlogical_meshes = [\"3x3\"]",
            "of a submesh of cluster",
            "3x3",
        ),
    ] {
        let ws = TempWorkspace::with_toml(&workspace(extra, 4));
        let r = ws.run(&["build"]);
        assert_eq!(r.code, 2, "{extra}: {}", r.stderr);
        assert!(
            r.stderr.contains(field) && r.stderr.contains(found),
            "{extra}: {}",
            r.stderr
        );
        assert!(!r.stderr.contains("panicked"), "{}", r.stderr);
    }
}

#[test]
fn dry_run_counts_the_ilp_solves_a_network_edit_costs_and_explain_names_them() {
    // Two nodes of two GPUs: submeshes 1x1, 1x2 and 2x2, the last one across nodes.
    let on_two_nodes = |nic_gbits: u64| {
        workspace(
            "space = \"both\"\n[target.search]\nilp_micro_batch = [2]",
            4,
        )
        .replace("nodes = 1", &format!("nodes = 2\nnic_gbits = {nic_gbits}"))
    };
    let ws = TempWorkspace::with_toml(&on_two_nodes(800));
    let cold = ws.run(&["build", "--dry-run", "--json"]);
    let cold = built(&cold);
    let stages = &cold["targets"][0]["ilp"][0];
    assert_eq!(stages["stages_cached"], false, "{cold}");
    assert_eq!(cold["targets"][0]["ilp_decode_cached"], false, "{cold}");
    // Embedding, block and head on 1x1, 1x2, 2x1, 1x4, 2x2 and 4x1.
    assert_eq!(stages["tables_to_solve"], 3 * 6, "{cold}");
    let first = built(&ws.run(&["build", "--json"]));
    assert_eq!(kind(&first, "sharding", "solved"), 3 * 6, "{first}");
    let again = built(&ws.run(&["build", "--dry-run", "--json"]));
    assert_eq!(again["targets"][0]["ilp_decode_cached"], true, "{again}");
    let text = ws.run(&["build", "--dry-run"]);
    assert!(
        text.stdout.contains("tiny: cached, nothing to solve"),
        "{}",
        text.stdout
    );

    ws.write("workspace.toml", &on_two_nodes(400));
    let dry = built(&ws.run(&["build", "--dry-run", "--json"]));
    let stages = &dry["targets"][0]["ilp"][0];
    assert_eq!(stages["stages_cached"], false, "{dry}");
    assert_eq!(dry["targets"][0]["ilp_decode_cached"], false, "{dry}");
    let text = ws.run(&["build", "--dry-run"]);
    assert!(
        text.stdout
            .contains("ILP space: the fastest size's stages would be decoded"),
        "{}",
        text.stdout
    );
    // Only the tables of the four-device meshes read the network across nodes.
    assert_eq!(stages["tables_to_solve"], 3 * 3, "{dry}");
    assert_eq!(stages["tables_cached"], 3 * 3, "{dry}");
    let tables = stages["tables"].as_array().expect("the tables named");
    for t in tables {
        let slot = t["slot"].as_str().unwrap_or_default();
        assert!(
            ["1x4", "2x2", "4x1"].iter().any(|m| slot.ends_with(m)),
            "{slot}"
        );
        assert!(
            t["reasons"][0]
                .as_str()
                .unwrap_or_default()
                .contains("link numbers"),
            "{t}"
        );
    }
    let edited = built(&ws.run(&["build", "--json"]));
    assert_eq!(kind(&edited, "sharding", "solved"), 3 * 3, "{edited}");
    assert_eq!(kind(&edited, "stages", "solved"), 1, "{edited}");
    // Megatron-LM's layer costs read the network only through tensor-parallel groups, which
    // stay inside a node.
    assert_eq!(kind(&edited, "layer-cost", "solved"), 0, "{edited}");

    let explained = ws.run(&["explain", "tiny"]);
    assert_eq!(explained.code, 0, "{}", explained.stderr);
    assert!(
        explained
            .stdout
            .contains("ILP space, micro-batch 2: stage DP re-ran; 9 of 18 layer tables solved"),
        "{}",
        explained.stdout
    );
    assert!(
        explained
            .stdout
            .contains("9 table(s): the mesh's link numbers changed (cluster network edit)"),
        "{}",
        explained.stdout
    );

    let again = built(&ws.run(&["build", "--dry-run", "--json"]));
    assert_eq!(
        again["targets"][0]["ilp"][0]["stages_cached"], true,
        "{again}"
    );
    assert_eq!(
        again["targets"][0]["ilp"][0]["tables_to_solve"], 0,
        "{again}"
    );
}

#[test]
fn a_kernel_re_measured_re_solves_only_the_tables_that_read_it() {
    let ws = TempWorkspace::default_copy();
    built(&ws.run(&["build", "tiny-llama-cpu", "--json"]));
    // One kernel re-measured: the forward RMSNorm of one sequence, which the block and the
    // head (its final norm) run at micro-batch 1 on the one CPU device.
    let mut profile: Value =
        serde_json::from_str(&ws.read("profiles/host-cpu.json")).expect("profile is JSON");
    let ops = profile["ops"].as_array_mut().expect("ops");
    let entry = ops
        .iter_mut()
        .find(|e| {
            e["op"] == "rmsnorm"
                && e["pass"] == "forward"
                && e["inputs"][0] == serde_json::json!([1, 128, 256])
        })
        .expect("the measured RMSNorm");
    entry["time_us"] = serde_json::json!(500.0);
    let edited = serde_json::to_string_pretty(&profile).expect("encodes");
    ws.write("remeasured.json", &edited);

    let diff = built(&ws.run(&["profile", "diff", "host-cpu", "remeasured.json", "--json"]));
    let tables = diff["invalidates"]
        .as_array()
        .expect("invalidated results")
        .iter()
        .filter(|r| r["kind"] == "layer-table")
        .count();
    assert_eq!(tables, 2, "{diff}");

    ws.write("profiles/host-cpu.json", &edited);
    let dry = built(&ws.run(&["build", "tiny-llama-cpu", "--dry-run", "--json"]));
    let predicted: u64 = dry["targets"][0]["ilp"]
        .as_array()
        .expect("the ILP space's sizes")
        .iter()
        .map(|s| s["tables_to_solve"].as_u64().unwrap_or(0))
        .sum();
    assert_eq!(predicted, 2, "{dry}");

    let rebuilt = built(&ws.run(&["build", "tiny-llama-cpu", "--json"]));
    assert_eq!(kind(&rebuilt, "sharding", "solved"), 2, "{rebuilt}");
    let explained = ws.run(&["explain", "tiny-llama-cpu"]);
    assert!(
        explained.stdout.contains(
            "2 table(s): profile entry rmsnorm forward f32 [1,128,256]x[256] -> [1,128,256]: \
             50.544999999999995 us -> 500 us"
        ),
        "{}",
        explained.stdout
    );
}

/// 4096-token sequences on two devices of 0.25 GiB: Megatron-LM's layouts fit only with full
/// recomputation.
fn tight(extra: &str) -> String {
    workspace(&format!("space = \"both\"\n{extra}"), 4)
        .replace("max_seq = 256", "max_seq = 4096")
        .replace("seq_len = 128", "seq_len = 4096")
        .replace(
            "gpus_per_node = 2",
            "gpus_per_node = 2\noverrides = { hbm_gib = 0.25, reserved_gib = 0.001 }",
        )
}

#[test]
fn the_ilp_space_recomputes_what_memory_needs() {
    let ws = TempWorkspace::with_toml(&tight(""));
    let r = ws.run(&["build"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let p = plan(&ws);
    // Megatron-LM's layouts fit only with full recomputation of blocks. The ILP space's plan,
    // one stage sharded over both devices, fits only by recomputing every layer, the output
    // layer too, which Megatron-LM cannot; two stages of one device each with full
    // recomputation are faster, and the build takes them.
    assert_eq!(
        p["spaces"]["megatron"]["summary"]
            .as_str()
            .map(|s| s.contains("rc=full")),
        Some(true),
        "{}",
        p["spaces"]
    );
    let (megatron, ilp) = (
        p["spaces"]["megatron"]["step_time_s"].as_f64(),
        p["spaces"]["ilp"]["step_time_s"].as_f64(),
    );
    let (Some(megatron), Some(ilp)) = (megatron, ilp) else {
        panic!("both spaces plan: {}", p["spaces"]);
    };
    assert_eq!(p["space"], if ilp < megatron { "ilp" } else { "megatron" });
    let stages = p["ilp"]["stages"].as_array().expect("stages");
    let recomputed: Vec<&str> = stages
        .iter()
        .flat_map(|s| s["recomputed_names"].as_array().expect("names"))
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(
        recomputed,
        ["layers.0", "layers.1", "layers.2", "layers.3", "head"],
        "{recomputed:?}"
    );
    for s in stages {
        let usable = 0.25 * 0.9;
        assert!(
            s["memory_gib"].as_f64().unwrap_or(f64::INFINITY) <= usable,
            "{s}"
        );
        let (n, rs) = (
            s["recomputed"].as_array().map_or(0, Vec::len),
            s["recompute_s"].as_f64().unwrap_or(-1.0),
        );
        assert_eq!(n > 0, rs > 0.0, "{s}");
    }
    assert_eq!(p["ilp"]["megatron_expressible"], false);
    let why = p["ilp"]["not_megatron"].as_str().unwrap_or_default();
    assert!(why.contains("it recomputes `head`"), "{why}");
    assert!(r.stdout.contains(" recompute "), "{}", r.stdout);

    // Without full recomputation in the search, the ILP space recomputes nothing and has no
    // plan; Megatron-LM's tp 2 with sequence parallelism still fits.
    ws.write(
        "workspace.toml",
        &tight("search = { recompute = [\"none\", \"selective\"] }"),
    );
    let r = ws.run(&["build"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let p = plan(&ws);
    assert!(p["spaces"]["ilp"].is_null(), "{}", p["spaces"]);
    let why = p["spaces"]["ilp_no_plan"].as_str().unwrap_or_default();
    assert!(why.contains("within the memory limits"), "{why}");
}

#[test]
fn a_micro_batch_size_left_out_is_said_when_another_plans() {
    // Size 1 has an ILP pipeline; at 8 nothing fits. The plan says why 8 is missing, in the
    // file and in the summary, not only when no size has a plan.
    let ws = TempWorkspace::with_toml(&tight("search = { ilp_micro_batch = [1, 8] }"));
    let r = ws.run(&["build"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let p = plan(&ws);
    assert!(p["spaces"]["ilp"].is_object(), "{}", p["spaces"]);
    assert!(p["spaces"]["ilp_no_plan"].is_null(), "{}", p["spaces"]);
    let why = p["spaces"]["ilp_sizes_left_out"]
        .as_str()
        .unwrap_or_default();
    assert!(why.starts_with("micro-batch size 8: no pipeline"), "{why}");
    assert!(
        r.stdout.contains(&format!("ilp left out: {why}")),
        "{}",
        r.stdout
    );
}

#[test]
fn an_ilp_space_with_no_plan_says_why() {
    // At 8 sequences per micro-batch nothing fits the ILP space, even recomputed; Megatron-LM
    // recomputes at 1.
    let toml = tight("search = { ilp_micro_batch = [8] }");
    let ws = TempWorkspace::with_toml(&toml);
    let r = ws.run(&["build"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let p = plan(&ws);
    assert_eq!(p["space"], "megatron");
    assert!(p["spaces"]["ilp"].is_null(), "{}", p["spaces"]);
    let why = p["spaces"]["ilp_no_plan"].as_str().unwrap_or_default();
    assert!(
        why.starts_with("the ILP space has no plan: micro-batch size 8: no pipeline"),
        "{why}"
    );
    assert!(
        r.stdout.contains(&format!("space     megatron: {why}")),
        "{}",
        r.stdout
    );

    // Restricted to the ILP space, the target is infeasible, for the same reason.
    ws.write(
        "workspace.toml",
        &toml.replace("space = \"both\"", "space = \"ilp\""),
    );
    let r = ws.run(&["build"]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(
        r.stderr
            .contains("the ILP space has no plan (`space = \"ilp\"`): micro-batch size"),
        "{}",
        r.stderr
    );
}

#[test]
fn an_ilp_plan_megatron_can_run_exports_its_own_arguments() {
    // A LLaMA-shaped model on one device, from the ILP space only.
    let toml = workspace("space = \"ilp\"", 4)
        .replace(
            "transformer = { hidden = 256, layers = 4, heads = 8, ffn_hidden = 1024, vocab = 8000, max_seq = 256 }",
            "transformer = { hidden = 256, layers = 4, heads = 8, kv_heads = 2, ffn_hidden = 768, \
             vocab = 32000, max_seq = 2048, mlp = \"swiglu\", norm = \"rmsnorm\", position = \
             \"rope\", tied_embeddings = false, bias = \"none\" }",
        )
        .replace("gpus_per_node = 2", "gpus_per_node = 1");
    let ws = TempWorkspace::with_toml(&toml);
    built(&ws.run(&["build", "--json"]));
    let p = plan(&ws);
    assert_eq!(p["space"], "ilp");
    assert_eq!(
        p["megatron_expressible"], true,
        "{}",
        p["ilp"]["not_megatron"]
    );
    let args: Vec<&str> = p["megatron_args"]
        .as_array()
        .expect("arguments")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| *a == flag)
            .and_then(|i| args.get(i + 1).copied())
            .unwrap_or_default()
    };
    let stages = p["ilp"]["stages"].as_array().expect("stages");
    assert_eq!(
        value("--pipeline-model-parallel-size"),
        stages.len().to_string()
    );
    assert_eq!(value("--tensor-model-parallel-size"), "1");
    // One data-parallel rank: Megatron-LM's micro-batch is the ILP space's.
    assert_eq!(
        value("--micro-batch-size"),
        p["ilp"]["micro_batch"].to_string(),
        "{args:?}"
    );
    assert!(
        p["launch"]
            .as_str()
            .unwrap_or_default()
            .ends_with(&args.join(" ")),
        "{}",
        p["launch"]
    );

    // The same pipeline split unevenly in two stages: Megatron-LM's custom layout.
    let mut ilp = p["ilp"].clone();
    let mut first = ilp["stages"][0].clone();
    let mut second = first.clone();
    first["layers"] = serde_json::json!([0, 2]);
    second["layers"] = serde_json::json!([2, 6]);
    ilp["stages"] = serde_json::json!([first, second]);
    let ilp: autopar_rules::plan::ilp::IlpPlan = serde_json::from_value(ilp).expect("an ILP plan");
    let cfg = autopar_rules::model::frontend::parse_hf_config(
        &std::fs::read_to_string(autopar_tests::repo_root().join("models/llama2-7b.json"))
            .expect("config"),
    )
    .expect("parses");
    let def = autopar_rules::model::frontend::ModelDef::Transformer(cfg);
    let training = serde_json::from_value(p["training"].clone()).expect("training options");
    let args = autopar_rules::plan::format::ilp_megatron_args(&def, &ilp, 8, &training, 8)
        .expect("Megatron-LM runs it");
    let joined = args.join(" ");
    assert!(
        joined.contains("--pipeline-model-parallel-size 2")
            && joined.contains("--pipeline-model-parallel-layout Et|t*3L"),
        "{joined}"
    );
}
