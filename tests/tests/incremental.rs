//! The build system: exact counts of what a build solves and reuses, what an edit invalidates,
//! `explain`, profiles, a killed build, a corrupt entry, `--dry-run`, the cache commands and
//! `watch`.

use autopar_tests::{Run, SMALL_WORKSPACE, TempWorkspace};
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

/// Solve counts of a `build --json` run: (total, memory hits, local hits, remote hits, solved).
fn counts(r: &Run) -> (u64, u64, u64, u64, u64) {
    assert_eq!(r.code, 0, "stderr:\n{}", r.stderr);
    let j = r.json();
    let f = |k: &str| {
        j[k].as_u64()
            .unwrap_or_else(|| panic!("{k} missing from {j}"))
    };
    (
        f("solves_total"),
        f("hits_memory"),
        f("hits_local"),
        f("hits_remote"),
        f("solved"),
    )
}

fn solved(r: &Run) -> u64 {
    counts(r).4
}

#[test]
fn a_second_build_solves_nothing_nor_does_renaming_or_reordering() {
    let ws = TempWorkspace::with_toml(SMALL_WORKSPACE);
    let (total, memory, local, remote, solved_first) = counts(&ws.run(&["build", "--json"]));
    assert_eq!(local + remote, 0, "cold cache");
    assert_eq!(total, memory + solved_first);
    assert!(solved_first > 2);
    // Nothing changed: each target's plan is found under its key, nothing else is asked for.
    assert_eq!(counts(&ws.run(&["build", "--json"])), (2, 0, 2, 0, 0));
    let plan = ws.read("plans/tiny.json");
    // Rename a model (and the target's reference), reorder the file: same keys.
    let renamed = SMALL_WORKSPACE
        .replace(
            "name = \"tiny\"\ntransformer",
            "name = \"small-llama\"\ntransformer",
        )
        .replace("model = \"tiny\"", "model = \"small-llama\"");
    let (models, rest) = renamed
        .split_once("[[cluster]]")
        .expect("the file has a cluster");
    ws.write("workspace.toml", &format!("[[cluster]]{rest}\n{models}"));
    let r = ws.run(&["build", "--json"]);
    assert_eq!(solved(&r), 0, "{}", r.stdout);
    // The plan names the model as the workspace now does.
    let now = ws.read("plans/tiny.json");
    assert!(now.contains("small-llama"), "renamed model in the plan");
    assert_eq!(now.replace("small-llama", "tiny"), plan);
}

#[test]
fn identical_blocks_share_one_solve_per_parallel_setting() {
    let ws = TempWorkspace::default_copy();
    let r = ws.run(&["build", "gpt3-175b", "--json"]);
    // Layer costs: embedding, block (all 96 share one key), output layer, under each
    // (micro-batch, tp, sp) the search prices: tp 1 without SP, tp 2/4/8 with and without, for
    // micro-batches 1, 2, 4, 8: 4 + 3 x 2 x 4 = 28 settings. Plus the search itself.
    let settings = 4 + 3 * 2 * 4;
    assert_eq!(solved(&r), 3 * settings + 1, "{}", r.stdout);
    let record: Value =
        serde_json::from_str(&ws.read(".autopar/builds/gpt3-175b.json")).expect("record");
    let layers = record["layers"].as_array().expect("layer records");
    assert_eq!(layers.len() as u64, 3 * settings);
    let blocks = layers
        .iter()
        .filter(|l| {
            l["slot"]
                .as_str()
                .is_some_and(|s| s.starts_with("layers.0 "))
        })
        .count() as u64;
    assert_eq!(
        blocks, settings,
        "one block cost per setting, asked for as layers.0"
    );
}

#[test]
fn more_layers_re_plan_without_a_new_layer_cost() {
    let ws = TempWorkspace::default_copy();
    assert_eq!(
        solved(&ws.run(&["build", "gpt3-175b", "--json"])),
        3 * 28 + 1
    );
    let model = ws.read("models/gpt3-175b.json");
    assert!(model.contains("\"n_layer\": 96"));
    ws.write(
        "models/gpt3-175b.json",
        &model.replace("\"n_layer\": 96", "\"n_layer\": 104"),
    );
    let dry = ws
        .run(&["build", "gpt3-175b", "--dry-run", "--json"])
        .json();
    assert_eq!(dry["targets"][0]["layer_costs_to_solve"], 0, "{dry}");
    assert_eq!(dry["targets"][0]["layer_costs_cached"], 84, "{dry}");
    let r = ws.run(&["build", "gpt3-175b", "--json"]);
    let (total, memory, local, _, solved) = counts(&r);
    assert_eq!(solved, 1, "only the search: {}", r.stdout);
    assert_eq!(local, 84, "every distinct layer cost from the store");
    assert_eq!(total, memory + local + solved);
    let explain = ws.run(&["explain", "gpt3-175b"]);
    assert_eq!(explain.code, 0, "{}", explain.stderr);
    assert!(
        explain.stdout.contains("model edit: layers: 96 -> 104"),
        "{}",
        explain.stdout
    );
    assert!(
        explain
            .stdout
            .contains("0 of 84 distinct layer costs solved"),
        "{}",
        explain.stdout
    );
}

/// A workspace whose cluster reads profile `measured.json` (Megatron-LM's space, whose layer
/// costs the tests count).
const PROFILED: &str = r#"
[[model]]
name = "tiny"
transformer = { hidden = 512, layers = 4, heads = 8, ffn_hidden = 2048, vocab = 32000, max_seq = 1024 }

[[profile]]
name = "measured"
file = "measured.json"

[[cluster]]
name = "one"
preset = "h100-sxm"
nodes = 1
gpus_per_node = 1
profiles = ["measured"]

[[target]]
name = "tiny"
model = "tiny"
cluster = "one"
global_batch = 8
space = "megatron"
[target.search]
micro_batch = [1]
"#;

const EMPTY_PROFILE: &str =
    r#"{"format": "autopar-profile/1", "device": "h100-sxm", "ops": [], "collectives": []}"#;

#[test]
fn a_profile_entry_re_solves_exactly_the_layers_that_run_it() {
    let ws = TempWorkspace::with_toml(PROFILED);
    ws.write("measured.json", EMPTY_PROFILE);
    // Embedding, block, output layer; and the search.
    assert_eq!(solved(&ws.run(&["build", "--json"])), 4);
    let t = ws.run(&["profile", "template", "tiny", "-o", "template.json"]);
    assert_eq!(t.code, 0, "{}", t.stderr);
    let mut template: Value = serde_json::from_str(&ws.read("template.json")).expect("template");
    // The QKV projection: a forward matrix product with 3 x 512 outputs, which only blocks run.
    let qkv = template["ops"]
        .as_array()
        .expect("ops")
        .iter()
        .find(|o| {
            o["op"] == "matmul"
                && o["pass"] == "forward"
                && o["outputs"][0].as_array().and_then(|s| s.last()) == Some(&Value::from(1536))
        })
        .cloned()
        .expect("the template lists the QKV product");
    let mut measured = qkv.clone();
    measured["time_us"] = Value::from(qkv["time_us"].as_f64().expect("time") * 3.0);
    template["ops"] = Value::Array(vec![measured]);
    template["collectives"] = Value::Array(vec![]);
    ws.write("measured.json", &template.to_string());
    let r = ws.run(&["build", "--json"]);
    let (_, _, local, _, re_solved) = counts(&r);
    assert_eq!(
        re_solved, 2,
        "the block's cost and the search: {}",
        r.stdout
    );
    assert_eq!(local, 2, "embedding and output layer reused");
    let record: Value = serde_json::from_str(&ws.read(".autopar/builds/tiny.json")).expect("rec");
    let re_solved: Vec<&str> = record["layers"]
        .as_array()
        .expect("layers")
        .iter()
        .filter(|l| l["source"] == "solved")
        .map(|l| l["slot"].as_str().expect("slot"))
        .collect();
    assert_eq!(re_solved, ["layers.0 · mb 1 · tp 1"]);
    let explain = ws.run(&["explain", "tiny"]).stdout;
    assert!(
        explain.contains("profile entry matmul forward bf16 [1,1024,512]x[512,1536]x[1536] -> [1,1024,1536] now measured"),
        "{explain}"
    );
    // `profile diff` names the same entry and the cached results it invalidates: the block's
    // cost with and without the measurement.
    ws.write("before.json", EMPTY_PROFILE);
    let diff = ws.run(&["profile", "diff", "before.json", "measured", "--json"]);
    assert_eq!(diff.code, 0, "{}", diff.stderr);
    let d = diff.json();
    assert_eq!(d["added"].as_array().map(Vec::len), Some(1), "{d}");
    let invalidated: Vec<&str> = d["invalidates"]
        .as_array()
        .expect("invalidates")
        .iter()
        .filter(|e| e["kind"] == "layer-cost")
        .map(|e| e["description"].as_str().expect("description"))
        .collect();
    assert!(
        !invalidated.is_empty()
            && invalidated
                .iter()
                .all(|s| s.starts_with("layers.0 (block)")),
        "{invalidated:?}"
    );
    assert_eq!(d["targets"], serde_json::json!(["tiny"]));
    // An entry no layer runs changes the target's inputs but no layer cost: nothing is
    // solved, the stored search result is reused.
    let mut extra: Value = serde_json::from_str(&ws.read("measured.json")).expect("profile");
    extra["ops"]
        .as_array_mut()
        .expect("ops")
        .push(serde_json::json!({
            "op": "gelu", "pass": "forward", "dtype": "bf16",
            "inputs": [[7, 7]], "outputs": [[7, 7]], "time_us": 1.0
        }));
    ws.write("measured.json", &extra.to_string());
    assert_eq!(solved(&ws.run(&["build", "--json"])), 0);
    let record: Value = serde_json::from_str(&ws.read(".autopar/builds/tiny.json")).expect("rec");
    assert_eq!(record["plan"]["reused_after_change"], true);
}

#[test]
fn profiles_are_checked_like_any_input() {
    let ws = TempWorkspace::with_toml(PROFILED);
    ws.write(
        "measured.json",
        &EMPTY_PROFILE.replace("h100-sxm", "a100-80g"),
    );
    let r = ws.run(&["build"]);
    assert_eq!(r.code, 2, "{}", r.stdout);
    assert!(
        r.stderr.contains(
            "workspace.toml:15:13: field `cluster.profiles`: expected a profile measured on h100-sxm, found \"measured\", measured on a100-80g"
        ),
        "{}",
        r.stderr
    );
    ws.write(
        "measured.json",
        &EMPTY_PROFILE.replace("\"ops\": []", "\"ops\": 3"),
    );
    let r = ws.run(&["build"]);
    assert_eq!(r.code, 2, "{}", r.stdout);
    assert!(r.stderr.contains("measured.json:1:"), "{}", r.stderr);
}

#[test]
fn a_killed_build_leaves_a_usable_cache() {
    let ws = TempWorkspace::default_copy();
    let mut child = ws.spawn(&["build"]);
    std::thread::sleep(Duration::from_millis(400));
    child.kill().expect("kill -9");
    let _ = child.wait();
    let r = ws.run(&["build", "--json"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.json()["planned"], 17);
    let v = ws.run(&["cache", "verify"]);
    assert_eq!(v.code, 0, "{}", v.stderr);
    assert!(v.stdout.contains(", 0 corrupt removed"), "{}", v.stdout);
    assert_eq!(solved(&ws.run(&["build", "--json"])), 0);
}

#[test]
fn a_flipped_byte_is_detected_and_re_solved() {
    let ws = TempWorkspace::with_toml(SMALL_WORKSPACE);
    assert_eq!(ws.run(&["build", "tiny"]).code, 0);
    let plan = ws.read("plans/tiny.json");
    {
        let db = sled::open(ws.path().join(".autopar/cache")).expect("open the cache");
        let meta = db.open_tree("meta").expect("meta");
        let values = db.open_tree("values").expect("values");
        let key = meta
            .iter()
            .filter_map(Result::ok)
            .find(|(_, m)| serde_json::from_slice::<Value>(m).is_ok_and(|m| m["kind"] == "search"))
            .map(|(k, _)| k)
            .expect("a stored search result");
        let mut bytes = values.get(&key).expect("read").expect("value").to_vec();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x40;
        values.insert(&key, bytes).expect("write");
        db.flush().expect("flush");
    }
    let r = ws.run(&["build", "tiny", "--json"]);
    assert!(
        r.stderr.contains("corrupt cache entry removed"),
        "{}",
        r.stderr
    );
    let (_, _, local, _, again) = counts(&r);
    assert_eq!(again, 1, "the search again; its layer costs are intact");
    // Embedding, block and output layer under tp 1, tp 2 and tp 2 with SP.
    assert_eq!(local, 9);
    assert_eq!(ws.read("plans/tiny.json"), plan);
}

#[test]
fn dry_run_solves_and_writes_nothing() {
    let ws = TempWorkspace::with_toml(SMALL_WORKSPACE);
    let dry = ws.run(&["build", "--dry-run"]);
    assert_eq!(dry.code, 0, "{}", dry.stderr);
    assert!(
        dry.stdout
            .contains("tiny: search would run; layer costs: 9 to solve, 0 cached"),
        "{}",
        dry.stdout
    );
    assert!(
        dry.stdout.contains("because first build of this target"),
        "{}",
        dry.stdout
    );
    assert!(!ws.path().join("plans").exists());
    let stats = ws.run(&["cache", "stats", "--json"]).json();
    assert_eq!(stats["entries"], 0);
    assert_eq!(ws.run(&["build"]).code, 0);
    let dry = ws.run(&["build", "--dry-run"]);
    assert!(
        dry.stdout.contains("tiny: cached, nothing to solve"),
        "{}",
        dry.stdout
    );
}

#[test]
fn cache_commands_and_clean() {
    let ws = TempWorkspace::with_toml(SMALL_WORKSPACE);
    let first = solved(&ws.run(&["build", "--json"]));
    let stats = ws.run(&["cache", "stats", "--json"]).json();
    let kinds: Vec<&str> = stats["kinds"]
        .as_array()
        .expect("kinds")
        .iter()
        .map(|k| k[0].as_str().expect("kind"))
        .collect();
    assert_eq!(kinds, ["layer-cost", "plan-index", "search"]);
    // Everything but the two searches and their index entries is a layer cost.
    assert_eq!(stats["entries"].as_u64(), Some(first + 2));
    let gc = ws.run(&["cache", "gc", "--max-size", "0"]);
    assert_eq!(gc.code, 0, "{}", gc.stderr);
    assert!(
        gc.stdout.contains(", 0.0 MiB left") || gc.stdout.contains("0 B left"),
        "{}",
        gc.stdout
    );
    assert_eq!(
        solved(&ws.run(&["build", "--json"])),
        first,
        "everything again"
    );
    let bad = ws.run(&["cache", "gc", "--max-size", "lots"]);
    assert_eq!(bad.code, 2);
    assert!(
        bad.stderr
            .contains("--max-size: expected a size such as 500M"),
        "{}",
        bad.stderr
    );
    let clean = ws.run(&["clean", "--cache"]);
    assert_eq!(clean.code, 0, "{}", clean.stderr);
    assert!(!ws.path().join("plans/tiny.json").exists());
    assert!(!ws.path().join(".autopar/builds/tiny.json").exists());
    assert_eq!(ws.run(&["cache", "stats", "--json"]).json()["entries"], 0);
    let explain = ws.run(&["explain", "tiny"]);
    assert_eq!(explain.code, 1);
    assert!(
        explain.stderr.contains("run `autopar build tiny` first"),
        "{}",
        explain.stderr
    );
}

#[test]
fn concurrent_builds_share_the_cache_safely() {
    let ws = TempWorkspace::with_toml(SMALL_WORKSPACE);
    let a = ws.spawn(&["build", "--json"]);
    let b = ws.spawn(&["build", "--json"]);
    for child in [a, b] {
        let out = child.wait_with_output().expect("waits");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let v = ws.run(&["cache", "verify"]);
    assert!(v.stdout.contains(", 0 corrupt removed"), "{}", v.stdout);
    assert_eq!(solved(&ws.run(&["build", "--json"])), 0);
}

#[test]
fn watch_rebuilds_what_an_edit_touches() {
    let ws = TempWorkspace::with_toml(SMALL_WORKSPACE);
    let mut child = ws.spawn(&["watch", "--interval-ms", "50"]);
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let wait_for = |needle: &str| -> Vec<String> {
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut seen = Vec::new();
        while Instant::now() < deadline {
            if let Ok(line) = rx.recv_timeout(Duration::from_millis(100)) {
                let hit = line.contains(needle);
                seen.push(line);
                if hit {
                    return seen;
                }
            }
        }
        panic!("`{needle}` never appeared; saw {seen:?}");
    };
    let first = wait_for("watching for changes");
    assert!(first.iter().any(|l| l.starts_with("solves: ")), "{first:?}");
    // Only the tiny model changes: its target is re-searched, gpt2's plan comes from memory.
    ws.write(
        "workspace.toml",
        &SMALL_WORKSPACE.replace("layers = 4, heads = 8", "layers = 6, heads = 8"),
    );
    let second = wait_for("watching for changes");
    let summary = second
        .iter()
        .find(|l| l.starts_with("solves: "))
        .unwrap_or_else(|| panic!("no summary in {second:?}"));
    // Everything but tiny's search is in memory: the layer costs (the blocks did not change)
    // and gpt2's plan.
    assert!(
        summary.contains(" 0 local hits, 0 remote hits, 1 solved"),
        "{summary}"
    );
    // A change that leaves every target's inputs as they were rebuilds nothing.
    ws.write(
        "workspace.toml",
        &format!(
            "# a comment\n{}",
            SMALL_WORKSPACE.replace("layers = 4, heads = 8", "layers = 6, heads = 8")
        ),
    );
    wait_for("nothing to rebuild");
    child.kill().expect("stop watch");
    let _ = child.wait();
}
