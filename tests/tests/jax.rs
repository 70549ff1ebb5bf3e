//! The JAX backend (README "Running plans on JAX"): every default CPU target's plan exported
//! as a JAX program, run by XLA's SPMD partitioner on virtual CPU devices, and compared with
//! the single-device run of the same program and with autopar's own CPU executor; the
//! collectives XLA compiled set beside the plan's.
//!
//! They need a Python with JAX (`$AUTOPAR_PYTHON`, else `python3`; `.ci/run` makes a virtual
//! environment). Without one, each test prints why it is skipped and passes.

use autopar_engine::executor::jax;
use autopar_tests::TempWorkspace;
use autopar_tests::executor::{attach_profile, measured_covers_template, tiny_cpu_target};

/// The Python with JAX, or `None` after printing why the test is skipped.
fn python() -> Option<String> {
    let python = jax::interpreter(None);
    match jax::probe(&python) {
        Ok(version) => {
            eprintln!("JAX {version} at {}", python.display());
            Some(python.display().to_string())
        }
        Err(e) => {
            eprintln!(
                "skipped: no Python with JAX ({e}); set {} to one (README, \"Running plans on JAX\")",
                jax::PYTHON_ENV
            );
            None
        }
    }
}

/// `run TARGET --backend jax --check` on the default workspace: the outcome's JSON.
fn run_checked(ws: &TempWorkspace, python: &str, target: &str) -> serde_json::Value {
    let r = ws.run(&[
        "run",
        target,
        "--backend",
        "jax",
        "--check",
        "--steps",
        "2",
        "--python",
        python,
        "--json",
    ]);
    assert_eq!(r.code, 0, "{target}: {}", r.stderr);
    r.json()
}

/// Appends tiny-llama targets to `ws`'s workspace, in fp32 and Megatron-LM's space: each
/// `(name, cluster, keys)`, its `keys` TOML lines with `global_batch`, `seq_len` and the
/// `[target.search]` table.
fn add_tiny_targets(ws: &TempWorkspace, targets: &[(&str, &str, String)]) {
    let mut toml = ws.read("workspace.toml");
    for (name, cluster, keys) in targets {
        toml.push_str(&format!(
            "\n[[target]]\nname = \"{name}\"\nmodel = \"tiny-llama\"\ncluster = \"{cluster}\"\n\
             space = \"megatron\"\nprecision = \"fp32\"\n{keys}"
        ));
    }
    ws.write("workspace.toml", &toml);
}

/// Builds `target` and runs it checked: both comparisons passed; the outcome's JSON.
fn build_and_check(ws: &TempWorkspace, python: &str, target: &str) -> serde_json::Value {
    let b = ws.run(&["build", target]);
    assert_eq!(b.code, 0, "{}", b.stderr);
    let j = run_checked(ws, python, target);
    assert_eq!(j["check"]["passed"], true, "{target}: {}", j["check"]);
    assert_eq!(
        j["jax"]["cpu_check"]["passed"], true,
        "{target}: {}",
        j["jax"]["cpu_check"]
    );
    j
}

#[test]
fn default_cpu_targets_run_on_jax_as_on_one_device_and_on_the_cpu_executor() {
    let Some(python) = python() else {
        return;
    };
    let ws = TempWorkspace::default_copy();
    // Every default CPU target.
    let targets = [
        "tiny-llama-cpu",
        "tiny-llama-cpu-ilp",
        "tiny-llama-cpu-stages",
        "tiny-llama-cpu-2d",
        "tiny-llama-cpu-cp",
        "tiny-llama-cpu-ulysses",
        "tiny-moe-cpu",
    ];
    let mut args = vec!["build"];
    args.extend(targets);
    let b = ws.run(&args);
    assert_eq!(b.code, 0, "{}", b.stderr);
    println!(
        "{:<24} {:>12} {:>12} {:>10} {:>10}  collectives per micro-batch (planned + deferred / compiled)",
        "target", "measured s", "predicted s", "vs 1 dev", "vs cpu"
    );
    for target in targets {
        let j = run_checked(&ws, &python, target);
        let check = &j["check"];
        let cpu = &j["jax"]["cpu_check"];
        assert_eq!(
            check["passed"], true,
            "{target} against one device: {check}"
        );
        assert_eq!(
            cpu["passed"], true,
            "{target} against the CPU executor: {cpu}"
        );
        // The same weights and data as the CPU executor: the first step's loss agrees to
        // rounding, not just within the tolerance.
        let (a, b) = (&j["result"]["losses"][0], &cpu["reference"]["losses"][0]);
        let (a, b) = (a.as_f64().unwrap_or(0.0), b.as_f64().unwrap_or(1.0));
        assert!((a - b).abs() / b < 1e-5, "{target}: loss {a} against {b}");
        let c = &j["jax"]["collectives"];
        println!(
            "{target:<24} {:>12.4} {:>12.4} {:>10.1e} {:>10.1e}  {} + {} / {}",
            j["measured_step_time_s"].as_f64().unwrap_or(0.0),
            j["predicted_step_time_s"].as_f64().unwrap_or(0.0),
            check["grad_rel"].as_f64().unwrap_or(0.0),
            cpu["grad_rel"].as_f64().unwrap_or(0.0),
            c["planned"],
            c["deferred"],
            c["compiled"],
        );
        // XLA inserts the plan's collectives (on the 2D mesh, an all-to-all over both axes
        // where a split over both moves to another tensor axis), and the ring attention its
        // collective permutes.
        assert_eq!(c["agree"], true, "{target}: {c}");
    }
}

#[test]
fn a_megatron_layout_of_every_dimension_runs_on_jax() {
    let Some(python) = python() else {
        return;
    };
    let ws = TempWorkspace::default_copy();
    // tp2 with sequence parallelism, pp2 with 2 interleaved chunks, dp2 and ZeRO-1, on 8
    // virtual devices.
    let j = build_and_check(&ws, &python, "tiny-llama-3d");
    let c = &j["jax"]["collectives"];
    let (planned, deferred, compiled) = (&c["planned"], &c["deferred"], &c["compiled"]);
    assert_eq!(compiled.as_array().map(Vec::len), Some(4), "{c}");
    // The middle chunks (one block each): the sequence-parallel all-gathers and
    // reduce-scatters of the plan, and one all-reduce per norm weight, whose gradient the plan
    // reduces once per step and XLA once per micro-batch.
    for chunk in 1..3 {
        assert_eq!(planned[chunk]["all_gather"], 4, "{c}");
        assert_eq!(compiled[chunk]["all_gather"], 4, "{c}");
        assert_eq!(compiled[chunk]["reduce_scatter"], 4, "{c}");
        assert_eq!(
            compiled[chunk]["all_reduce"], deferred[chunk]["all_reduce"],
            "{c}"
        );
    }
    // Every chunk, the embedding's (vocabulary-parallel, its gradient added into each rank's
    // rows) and the loss's included.
    assert_eq!(c["agree"], true, "{c}");
}

/// Two more context-parallel layouts on 2 x 2 CPU devices, each attention a ring written out
/// with `shard_map` and `ppermute`: a ring of two Ulysses pairs (`a2a+p2p`), and a ring over one
/// mesh axis while tensor parallelism splits the heads over the other (left to XLA's
/// partitioner).
#[test]
fn ring_attention_runs_on_jax_beside_ulysses_and_tensor_parallelism() {
    let Some(python) = python() else {
        return;
    };
    let ws = TempWorkspace::default_copy();
    let keys = |tp: u32, cp: u32, comm: &str| {
        format!(
            "global_batch = 2\nseq_len = 512\n[target.search]\ntp = [{tp}]\ncp = [{cp}]\n\
             cp_comm = [\"{comm}\"]\n"
        )
    };
    add_tiny_targets(
        &ws,
        &[
            ("cp-rings-of-pairs", "host-cpu-2x2", keys(1, 4, "a2a+p2p")),
            ("cp-ring-tp", "host-cpu-2x2", keys(2, 2, "p2p")),
        ],
    );
    // Per attention and micro-batch, 2 n - 1 collective permutes on a ring of n: rings of 2
    // ranks in both (two Ulysses pairs; cp 2), 3 permutes in each of the 4 blocks.
    for (target, permutes) in [("cp-rings-of-pairs", 4 * 3), ("cp-ring-tp", 4 * 3)] {
        let j = build_and_check(&ws, &python, target);
        let c = &j["jax"]["collectives"];
        assert_eq!(
            c["planned"][0]["collective_permute"], permutes,
            "{target}: {c}"
        );
        assert_eq!(c["agree"], true, "{target}: {c}");
    }
}

/// Recomputation under `jax.checkpoint`: selective (every attention core) and full (the first
/// blocks, as many as fit a device with 96.5% of its memory held back), each checked against
/// one device and the CPU executor; full recomputation runs some of each block's forward
/// collectives again in the backward pass, within what the plan bounds.
#[test]
fn recomputed_layers_run_under_jax_checkpoint() {
    let Some(python) = python() else {
        return;
    };
    let ws = TempWorkspace::default_copy();
    let keys = |extra: &str, recompute: &str| {
        format!(
            "global_batch = 2\nseq_len = 256\n{extra}[target.search]\ntp = [2]\n\
             micro_batch = [2]\nrecompute = [\"{recompute}\"]\n"
        )
    };
    add_tiny_targets(
        &ws,
        &[
            ("recompute-selective", "host-cpu-2", keys("", "selective")),
            (
                "recompute-full",
                "host-cpu-2",
                keys("memory_headroom = 0.965\n", "full"),
            ),
        ],
    );
    for target in ["recompute-selective", "recompute-full"] {
        let j = build_and_check(&ws, &python, target);
        let plan: serde_json::Value =
            serde_json::from_str(&ws.read(&format!("plans/{target}.json"))).expect("plan");
        // Blocks recomputed in full, or (selective) the 4 blocks' attention cores.
        let blocks: u64 = plan["estimate"]["stages"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|s| s["chunks"].as_array().into_iter().flatten())
            .map(|c| c["full_recompute"].as_u64().unwrap_or(0))
            .sum();
        let regions = if target == "recompute-full" {
            blocks
        } else {
            4
        };
        assert!(regions > 0, "{target} recomputes nothing: {plan}");
        let out = ws.path().join(format!("{target}.py"));
        let e = ws.run(&[
            "export",
            target,
            "--format",
            "jax",
            "-o",
            &out.to_string_lossy(),
        ]);
        assert_eq!(e.code, 0, "{}", e.stderr);
        let program = std::fs::read_to_string(&out).expect("the program");
        assert_eq!(
            program.matches("= jax.checkpoint(recomputed_").count() as u64,
            regions,
            "{target}"
        );
        let c = &j["jax"]["collectives"];
        assert_eq!(c["agree"], true, "{target}: {c}");
        if target == "recompute-full" {
            // Each block's tensor-parallel collectives bound what recomputation adds; the
            // backward runs again those whose results its gradients read (at least one per
            // block: the attention's output, which the MLP's norm reads).
            let total = |m: &serde_json::Value| -> u64 {
                m.as_object()
                    .into_iter()
                    .flatten()
                    .map(|(_, n)| n.as_u64().unwrap_or(0))
                    .sum()
            };
            let (planned, deferred) = (total(&c["planned"][0]), total(&c["deferred"][0]));
            let (bound, compiled) = (total(&c["recomputed"][0]), total(&c["compiled"][0]));
            assert!(bound >= 2 * regions, "{c}");
            assert!(compiled >= planned + deferred + regions, "{c}");
        } else {
            assert_eq!(c["recomputed"][0], serde_json::json!({}), "{c}");
        }
    }
}

#[test]
fn the_exported_program_is_readable_python_of_the_plan() {
    let ws = TempWorkspace::default_copy();
    let b = ws.run(&["build", "tiny-llama-cpu-ilp"]);
    assert_eq!(b.code, 0, "{}", b.stderr);
    let out = ws.path().join("plan.py");
    let out = out.to_string_lossy();
    let e = ws.run(&[
        "export",
        "tiny-llama-cpu-ilp",
        "--format",
        "jax",
        "-o",
        &out,
    ]);
    assert_eq!(e.code, 0, "{}", e.stderr);
    let text = ws.read("plan.py");
    // The plan's meshes, a sharding per value, the model's ops, and the schedule.
    for needle in [
        "MESHES = [[1, 2]]",
        "SPECS = {",
        "def chunk_0(p, recv, fed, shard):",
        "rms_norm(",
        "attention(",
        "ORDER = [(\"F\", 0, 0)",
        "def main():",
    ] {
        assert!(
            text.contains(needle),
            "no `{needle}` in the exported program"
        );
    }
    let again = ws.run(&["export", "tiny-llama-cpu-ilp", "--format", "jax"]);
    assert_eq!(again.code, 0, "{}", again.stderr);
    assert_eq!(
        again.stdout.trim_end(),
        text.trim_end(),
        "a second export differs"
    );
    // A plan too large to run on this machine still exports, for the GPUs it is for.
    let b = ws.run(&["build", "gpt2-small"]);
    assert_eq!(b.code, 0, "{}", b.stderr);
    let big = ws.run(&["export", "gpt2-small", "--format", "jax"]);
    assert_eq!(big.code, 0, "{}", big.stderr);
    assert!(big.stdout.contains("DEVICES = 8"), "{}", big.stdout);
}

#[test]
fn without_jax_the_backend_says_what_is_missing() {
    let ws = TempWorkspace::default_copy();
    let b = ws.run(&["build", "tiny-llama-cpu"]);
    assert_eq!(b.code, 0, "{}", b.stderr);
    let r = ws.run(&[
        "run",
        "tiny-llama-cpu",
        "--backend",
        "jax",
        "--python",
        "/nonexistent/python3",
    ]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(
        r.stderr.contains("/nonexistent/python3") && r.stderr.contains("pip install jax"),
        "{}",
        r.stderr
    );
}

#[test]
fn profile_run_times_every_entry_through_xla() {
    let Some(python) = python() else {
        return;
    };
    let ws = TempWorkspace::default_copy();
    let mut toml = ws.read("workspace.toml");
    toml.push_str(&tiny_cpu_target("two-devices"));
    ws.write("workspace.toml", &toml);
    let r = ws.run(&[
        "profile",
        "run",
        "--model",
        "tiny-llama",
        "--cluster",
        "two-devices",
        "--backend",
        "jax",
        "--python",
        &python,
        "-o",
        "measured.json",
        "--json",
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let summary = r.json();
    assert_eq!(summary["device"], "cpu", "{summary}");
    assert_eq!(summary["skipped"], serde_json::json!([]), "{summary}");
    // Every kernel and collective the target prices has a positive time.
    measured_covers_template(&ws, "tiny-cpu");
    // The profile feeds planning as a CPU backend's does.
    let attached = attach_profile(&toml, "two-devices", "xla");
    ws.write("workspace.toml", &attached);
    let b = ws.run(&["build", "tiny-cpu"]);
    assert_eq!(b.code, 0, "{}", b.stderr);
}
