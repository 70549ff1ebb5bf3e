//! Every documented bound of the workspace format is one autopar handles in bounded time and
//! memory: at the bound a target plans (or is found infeasible, saying why), one past it is
//! refused with the field, and files that are not inputs (a device, a huge file) are refused
//! before they are read.

use autopar_tests::{Run, TempWorkspace, assert_no_panic};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

/// Longest a bounded case may take (the debug build on two cores shared with the other tests
/// of this file). The slowest case, the longest flat list searched in both spaces until the ILP
/// space's tables pass the work bound, takes about 66 s in a release build on two cores and
/// 120 s in debug beside another case, so the bound leaves that room twice over.
const TIME: Duration = Duration::from_secs(300);

/// Most memory a bounded build may use.
const MEMORY: u64 = 2 << 30;

/// Runs autopar in `ws` with `args`, killing it past [`TIME`].
fn bounded(ws: &TempWorkspace, args: &[&str], case: &str) -> Run {
    let start = Instant::now();
    let mut child = ws.spawn(args);
    loop {
        if let Ok(Some(_)) = child.try_wait() {
            break;
        }
        assert!(
            start.elapsed() < TIME,
            "{case}: still running after {TIME:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let r = Run::from(child.wait_with_output().expect("output"));
    assert_no_panic(&r, case);
    r
}

/// A build of the one target of `toml` that plans (exit 0) or is infeasible (exit 1, saying
/// which constraint failed), within the time and memory bounds.
fn builds(toml: &str, case: &str) -> Value {
    let ws = TempWorkspace::with_toml(toml);
    let r = bounded(&ws, &["build", "--json"], case);
    assert!(
        matches!(r.code, 0 | 1),
        "{case}: exit {}\n{}",
        r.code,
        r.stderr
    );
    let report = r.json();
    let peak = report["peak_rss_bytes"].as_u64().unwrap_or(0);
    assert!(peak < MEMORY, "{case}: {} MiB", peak >> 20);
    if r.code == 1 {
        let reason = report["targets"][0]["reason"].as_str().unwrap_or("");
        assert!(!reason.is_empty(), "{case}: infeasible without a reason");
    }
    report
}

/// A run that must be refused as bad input (exit 2) naming `field`.
fn refused(ws: &TempWorkspace, args: &[&str], field: &str, case: &str) {
    let r = bounded(ws, args, case);
    assert_eq!(r.code, 2, "{case}: exit code\n{}{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains(field),
        "{case}: names `{field}`:\n{}",
        r.stderr
    );
}

fn workspace(model: &str, cluster: &str, target_extra: &str) -> String {
    format!(
        "[[model]]\nname = \"m\"\n{model}\n\n[[cluster]]\nname = \"c\"\npreset = \"h100-sxm\"\n\
         {cluster}\n\n[[target]]\nname = \"t\"\nmodel = \"m\"\ncluster = \"c\"\n{target_extra}\n"
    )
}

fn transformer(field: &str, value: u64) -> String {
    let mut fields = vec![
        ("hidden", 256u64),
        ("layers", 4),
        ("heads", 8),
        ("ffn_hidden", 1024),
        ("vocab", 32000),
        ("max_seq", 2048),
    ];
    for f in &mut fields {
        if f.0 == field {
            f.1 = value;
        }
    }
    let body: Vec<String> = fields.iter().map(|(k, v)| format!("{k} = {v}")).collect();
    format!("transformer = {{ {} }}", body.join(", "))
}

const NODE: &str = "nodes = 1\ngpus_per_node = 8";

#[test]
fn model_bounds_plan_at_the_limit_and_are_refused_past_it() {
    use autopar_rules::limits;
    for (field, max) in [
        ("layers", limits::MAX_LAYERS),
        ("hidden", limits::MAX_WIDTH),
        ("ffn_hidden", limits::MAX_WIDTH),
        ("vocab", limits::MAX_VOCAB),
        ("max_seq", limits::MAX_SEQ),
    ] {
        let seq = if field == "max_seq" { max } else { 2048 };
        let at = workspace(
            &transformer(field, max),
            NODE,
            &format!("global_batch = 64\nseq_len = {seq}"),
        );
        let report = builds(&at, &format!("{field} = {max}"));
        if field == "layers" {
            // The deepest model plans: the layer folding keeps it to seconds.
            assert_eq!(report["planned"], 1, "{report}");
        }
        let past = workspace(&transformer(field, max + 1), NODE, "global_batch = 64");
        let ws = TempWorkspace::with_toml(&past);
        refused(&ws, &["build"], field, &format!("{field} = {}", max + 1));
    }
}

#[test]
fn cluster_and_batch_bounds_plan_at_the_limit_and_are_refused_past_it() {
    use autopar_rules::limits;
    let model = transformer("layers", 4);
    // The largest cluster, with a batch that fills it, searching both spaces: the ILP space's
    // size is counted over every submesh and logical mesh of it (each submesh's factorisations
    // found up to the square root, not by walking every device count), and it is left out,
    // saying why.
    let nodes = limits::MAX_GPUS / 8;
    let report = builds(
        &workspace(
            &model,
            &format!("nodes = {nodes}\ngpus_per_node = 8"),
            &format!("global_batch = {}\nspace = \"both\"", limits::MAX_GPUS),
        ),
        "the most GPUs",
    );
    assert_eq!(report["planned"], 1, "{report}");
    let left_out = report["targets"][0]["spaces"]["ilp_not_searched"]
        .as_str()
        .unwrap_or("");
    assert!(left_out.contains("layer tables"), "{report}");
    let ws = TempWorkspace::with_toml(&workspace(
        &model,
        &format!("nodes = {}\ngpus_per_node = 8", nodes + 1),
        "global_batch = 64",
    ));
    refused(&ws, &["build"], "nodes", "one node too many");
    // The largest global batch: 2^27 micro-batches per step are simulated in part.
    let report = builds(
        &workspace(
            &model,
            NODE,
            &format!("global_batch = {}\nseq_len = 128", limits::MAX_BATCH),
        ),
        "the largest batch",
    );
    assert_eq!(report["planned"], 1, "{report}");
    let ws = TempWorkspace::with_toml(&workspace(
        &model,
        NODE,
        &format!("global_batch = {}", limits::MAX_BATCH + 1),
    ));
    refused(&ws, &["build"], "global_batch", "a batch too large");
}

/// A graph file of `layers` distinct blocks of `units` units each (a matrix product up to a
/// width of its own, one back down, a residual add: three ops), as `layers` or as one flat
/// `ops` list.
fn graph_file(layers: usize, units: usize, flat: bool, layer_count: Option<u64>) -> Value {
    let mut tensors = vec![
        json!({"name": "tokens", "shape": ["b", "s"], "kind": "input", "dtype": "i32"}),
        json!({"name": "labels", "shape": ["b", "s"], "kind": "input", "dtype": "i32"}),
        json!({"name": "emb", "shape": [1024, 64], "kind": "parameter"}),
        json!({"name": "x0", "shape": ["b", "s", 64]}),
    ];
    let mut blocks = Vec::new();
    let mut x = "x0".to_string();
    let mut t = 0;
    for i in 0..layers {
        let mut ops = Vec::new();
        for _ in 0..units {
            // Blocks differ in their inner width, so no two share a cost.
            let width = 64 + i % 251;
            let [up, h, down, y, next] = ["up", "h", "down", "y", "x"].map(|n| {
                if n == "x" {
                    format!("x{}", t + 1)
                } else {
                    format!("{n}{t}")
                }
            });
            tensors.push(json!({"name": up, "shape": [64, width], "kind": "parameter"}));
            tensors.push(json!({"name": h, "shape": ["b", "s", width]}));
            tensors.push(json!({"name": down, "shape": [width, 64], "kind": "parameter"}));
            tensors.push(json!({"name": y, "shape": ["b", "s", 64]}));
            tensors.push(json!({"name": next, "shape": ["b", "s", 64]}));
            ops.push(json!({"name": format!("mm_up{t}"), "kind": "matmul", "inputs": [x, up], "outputs": [h]}));
            ops.push(json!({"name": format!("mm_down{t}"), "kind": "matmul", "inputs": [h, down], "outputs": [y]}));
            ops.push(json!({"name": format!("add{t}"), "kind": "add", "inputs": [y, x], "outputs": [next]}));
            x = next;
            t += 1;
        }
        blocks.push(json!({"name": format!("block{i}"), "kind": "block", "ops": ops}));
    }
    tensors.push(json!({"name": "out", "shape": [64, 1024], "kind": "parameter"}));
    tensors.push(json!({"name": "logits", "shape": ["b", "s", 1024]}));
    tensors.push(json!({"name": "loss", "shape": [1], "dtype": "f32"}));
    let embed = json!({"name": "embed", "kind": "embedding", "ops": [
        {"name": "lookup", "kind": "embedding", "inputs": ["tokens", "emb"], "outputs": ["x0"]}]});
    let head = json!({"name": "head", "kind": "head", "ops": [
        {"name": "proj", "kind": "matmul", "inputs": [x, "out"], "outputs": ["logits"]},
        {"name": "ce", "kind": "cross_entropy", "inputs": ["logits", "labels"], "outputs": ["loss"]}]});
    let mut all = vec![embed];
    all.extend(blocks);
    all.push(head);
    let mut file = json!({"format": "autopar-graph/1", "max_seq": 256, "tensors": tensors});
    if flat {
        let ops: Vec<Value> = all
            .iter()
            .flat_map(|l| l["ops"].as_array().cloned().unwrap_or_default())
            .collect();
        file["ops"] = json!(ops);
        if let Some(n) = layer_count {
            file["layer_count"] = json!(n);
        }
    } else {
        file["layers"] = json!(all);
    }
    file
}

#[test]
fn graph_file_bounds_plan_at_the_limit_and_are_refused_past_it() {
    use autopar_rules::limits;
    let toml = workspace(
        "graph = \"model.graph.json\"",
        NODE,
        "global_batch = 64\nseq_len = 256\nspace = \"both\"",
    );
    let case = |file: &Value| -> TempWorkspace {
        let ws = TempWorkspace::with_toml(&toml);
        ws.write("model.graph.json", &file.to_string());
        ws
    };
    // The most layers (the blocks, an embedding and a head), with two units each.
    let layers = limits::MAX_LAYERS as usize - 2;
    assert!(layers * 2 * 3 + 3 <= limits::MAX_GRAPH_OPS);
    let at = graph_file(layers, 2, false, None);
    let ws = case(&at);
    let r = bounded(&ws, &["build", "--json"], "4096 distinct layers");
    assert!(matches!(r.code, 0 | 1), "{}", r.stderr);
    assert!(r.json()["peak_rss_bytes"].as_u64().unwrap_or(0) < MEMORY);
    let past = graph_file(layers + 1, 1, false, None);
    refused(&case(&past), &["build"], "layers", "4097 layers");
    let past = graph_file(layers, 3, false, None);
    assert!(layers * 3 * 3 + 3 > limits::MAX_GRAPH_OPS);
    refused(&case(&past), &["build"], "ops", "too many ops");
    // A flat list at its bounds is clustered; past them it is refused.
    let longest = (limits::MAX_CLUSTERED_OPS - 3) / 3;
    let flat = graph_file(longest, 1, true, Some(limits::MAX_CLUSTERED_LAYERS));
    let ws = case(&flat);
    let r = bounded(&ws, &["build", "--json"], "the longest flat list");
    assert!(matches!(r.code, 0 | 1), "{}", r.stderr);
    // Searching both spaces, the ILP space's 128 distinct layers on every
    // logical mesh of the node pass the work one search may take at every micro-batch size:
    // it stops, and says so.
    let spaces = &r.json()["targets"][0]["spaces"];
    let why = spaces["ilp_no_plan"].as_str().unwrap_or_default();
    assert!(why.contains("units of work"), "{spaces}");
    // Whether the tables pass the bound depends on them alone, so the verdict is kept under
    // their keys: after a change the tables do not read (recomputation), a dry run says every
    // size stops at once, and the build neither reads nor solves a table.
    let kinds = |j: &Value, kind: &str, field: &str| j["kinds"][kind][field].as_u64().unwrap_or(0);
    let verdicts = kinds(&r.json(), "table-work", "solved");
    assert!(verdicts > 0, "{}", r.json()["kinds"]);
    // `explain` says which sizes passed the bound, and later how each was stopped.
    let stopped = |ws: &TempWorkspace, how: &str, line: &str| {
        let explained = ws.run(&["explain", "t", "--json"]);
        assert_eq!(explained.code, 0, "{}", explained.stderr);
        let sizes = explained.json()["ilp"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let past = sizes.iter().filter(|s| s["past_work_bound"] == how).count();
        assert_eq!(past as u64, verdicts, "{}", explained.stdout);
        let text = ws.run(&["explain", "t"]).stdout;
        assert_eq!(text.matches(line).count() as u64, verdicts, "{text}");
    };
    stopped(&ws, "solved", "before they passed the work bound");
    ws.write(
        "workspace.toml",
        &format!("{toml}[target.search]\nrecompute = [\"none\"]\n"),
    );
    let dry = ws.run(&["build", "--dry-run", "--json"]);
    assert_eq!(dry.code, 0, "{}", dry.stderr);
    let sizes = dry.json()["targets"][0]["ilp"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(sizes.len() as u64, verdicts, "{}", dry.stdout);
    for size in &sizes {
        assert_eq!(size["past_work_bound"], true, "{size}");
        assert_eq!(size["tables_to_solve"], 0, "{size}");
    }
    let again = bounded(&ws, &["build", "--json"], "the longest flat list, edited");
    let j = again.json();
    assert_eq!(kinds(&j, "sharding", "total"), 0, "{}", j["kinds"]);
    assert_eq!(
        kinds(&j, "table-work", "hits_local"),
        verdicts,
        "{}",
        j["kinds"]
    );
    assert_eq!(kinds(&j, "stages", "solved"), verdicts, "{}", j["kinds"]);
    stopped(
        &ws,
        "local",
        "stopped at once by the stored verdict (local)",
    );
    let why = j["targets"][0]["spaces"]["ilp_no_plan"]
        .as_str()
        .unwrap_or_default();
    assert!(why.contains("units of work"), "{j}");
    let past = graph_file(longest + 1, 1, true, None);
    refused(&case(&past), &["build"], "ops", "a flat list too long");
    let past = graph_file(100, 1, true, Some(limits::MAX_CLUSTERED_LAYERS + 1));
    refused(&case(&past), &["build"], "layer_count", "too many clusters");
    // Sizes up to 2^32 are accepted; one past is refused.
    let mut huge = graph_file(2, 1, false, None);
    huge["tensors"][2]["shape"] = json!([limits::MAX_DIM, 64]);
    let r = bounded(&case(&huge), &["build", "--json"], "a 2^32 vocabulary");
    assert_eq!(r.code, 1, "does not fit, and says so\n{}", r.stderr);
    huge["tensors"][2]["shape"] = json!([limits::MAX_DIM + 1, 64]);
    refused(
        &case(&huge),
        &["build"],
        "tensors[2].shape",
        "a size past 2^32",
    );
}

#[test]
fn files_that_are_not_inputs_are_refused_before_they_are_read() {
    let toml = workspace("hf_config = \"config.json\"", NODE, "global_batch = 64");
    // A device that never ends.
    let ws = TempWorkspace::with_toml(&toml.replace("config.json", "/dev/zero"));
    refused(&ws, &["build"], "/dev/zero", "/dev/zero");
    let r = ws.run(&["build"]);
    assert!(r.stderr.contains("not a regular file"), "{}", r.stderr);
    // A directory, and a file past the size limit (sparse: no disk is used).
    let ws = TempWorkspace::with_toml(&toml);
    std::fs::create_dir(ws.path().join("config.json")).expect("a directory");
    refused(&ws, &["build"], "config.json", "a directory");
    let ws = TempWorkspace::with_toml(&toml);
    let f = std::fs::File::create(ws.path().join("config.json")).expect("file");
    f.set_len(autopar_engine::input::MAX_INPUT_BYTES + 1)
        .expect("sparse");
    refused(&ws, &["build"], "config.json", "a huge file");
    let r = ws.run(&["build"]);
    assert!(r.stderr.contains("limited to"), "{}", r.stderr);
}

#[test]
fn plans_stay_inside_the_workspace_unless_the_command_line_says_otherwise() {
    let base = workspace(&transformer("layers", 4), NODE, "global_batch = 64");
    for plans in ["/etc", "../outside", "plans/../../outside"] {
        let ws = TempWorkspace::with_toml(&format!("[workspace]\nplans = \"{plans}\"\n{base}"));
        refused(&ws, &["build"], "workspace.plans", plans);
    }
    // Through a symbolic link that leads out.
    let ws = TempWorkspace::with_toml(&format!("[workspace]\nplans = \"out/plans\"\n{base}"));
    let elsewhere = tempfile::tempdir().expect("elsewhere");
    std::os::unix::fs::symlink(elsewhere.path(), ws.path().join("out")).expect("symlink");
    refused(&ws, &["build"], "workspace.plans", "a link out");
    // Inside is fine, and an absolute directory chosen on the command line too.
    let ws = TempWorkspace::with_toml(&format!("[workspace]\nplans = \"out/plans\"\n{base}"));
    assert_eq!(ws.run(&["build"]).code, 0);
    assert!(ws.path().join("out/plans/t.json").exists());
    let chosen = tempfile::tempdir().expect("chosen");
    let dir = chosen.path().display().to_string();
    let r = ws.run(&["--plans-dir", &dir, "build"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(chosen.path().join("t.json").exists());
}

#[test]
fn absurd_profile_times_are_refused_with_their_line() {
    let ws = TempWorkspace::default_copy();
    let profile = ws.read("profiles/host-cpu.json");
    // The first measured time becomes 10^308 µs.
    let at = profile.find("\"time_us\":").expect("a measured time") + "\"time_us\":".len();
    let end = at + profile[at..].find('}').expect("the entry ends");
    let edited = format!("{}1e308{}", &profile[..at], &profile[end..]);
    ws.write("profiles/host-cpu.json", &edited);
    let r = bounded(&ws, &["build", "tiny-llama-cpu"], "1e308 us");
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(
        r.stderr.contains("host-cpu.json:"),
        "file and line: {}",
        r.stderr
    );
    assert!(r.stderr.contains("one hour"), "{}", r.stderr);
}

#[test]
fn edited_plans_are_refused_before_they_run() {
    let ws = TempWorkspace::default_copy();
    assert_eq!(ws.run(&["build", "tiny-llama-3d"]).code, 0);
    let plan: Value =
        serde_json::from_str(&ws.read("plans/tiny-llama-3d.json")).expect("plan JSON");
    // A billion sequences a step, with the micro-batches to match.
    let mut big = plan.clone();
    let l = &big["estimate"]["layout"];
    let per = l["micro_batch"].as_u64().expect("mb") * l["dp"].as_u64().expect("dp");
    big["estimate"]["layout"]["global_batch"] = json!(per * 250_000_000);
    big["estimate"]["num_microbatches"] = json!(250_000_000u64);
    ws.write("big.json", &big.to_string());
    let r = bounded(&ws, &["run", "--plan", "big.json"], "a billion sequences");
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(
        r.stderr.contains("floating-point operations"),
        "{}",
        r.stderr
    );
    // A tensor-parallel degree the cluster cannot hold.
    let mut wide = plan;
    wide["estimate"]["layout"]["tp"] = json!(1_000_000);
    ws.write("wide.json", &wide.to_string());
    let r = bounded(&ws, &["run", "--plan", "wide.json"], "tp 1000000");
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(
        r.stderr
            .contains("tp 1000000 x cp 1 x pp 2 x dp 2 is not the 8 GPUs"),
        "{}",
        r.stderr
    );
}
