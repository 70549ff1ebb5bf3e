//! `autopar estimate` against published results, and its output contract.

use autopar_engine::executor::median;
use autopar_tests::TempWorkspace;
use autopar_tests::megatron::{SOFTWARE_2021, TABLE1};

/// `autopar estimate --json` with `args`, which must succeed.
fn estimate(ws: &TempWorkspace, args: &[&str]) -> serde_json::Value {
    let mut all = vec!["estimate"];
    all.extend_from_slice(args);
    all.push("--json");
    let r = ws.run(&all);
    assert_eq!(r.code, 0, "{args:?}: {}", r.stderr);
    r.json()
}

/// Number `key` of the JSON object `j`, which must be there.
fn number(j: &serde_json::Value, key: &str) -> f64 {
    j[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} missing in {j}"))
}

/// Predicted TFLOP/s per GPU of `model` on `cluster` with the 2021 software, micro-batch 1,
/// global batch `gbs` and the layout flags `layout`.
fn tflops_2021(ws: &TempWorkspace, model: &str, cluster: &str, gbs: &str, layout: &[&str]) -> f64 {
    let mut args = vec![
        "--model",
        model,
        "--cluster",
        cluster,
        "--mbs",
        "1",
        "--gbs",
        gbs,
    ];
    args.extend_from_slice(layout);
    args.extend_from_slice(&SOFTWARE_2021);
    number(&estimate(ws, &args), "tflops_per_gpu")
}

/// Predicted TFLOP/s per GPU of every Megatron-LM 2021 Table 1 row, against the published
/// value. Goal of the cost model: every row within ±20% and the median within ±10%, with no
/// per-row adjustment. Run with `--nocapture` to see the table.
#[test]
fn megatron_2021_table1() {
    let ws = TempWorkspace::default_copy();
    println!(
        "{:<12} {:>3} {:>3} {:>3} {:>4} {:>2} {:>5} {:>9} {:>9} {:>7}",
        "model", "tp", "pp", "dp", "mbs", "v", "gbs", "published", "autopar", "err"
    );
    let mut errors = Vec::new();
    for row in TABLE1 {
        let args = row.estimate_args();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let j = estimate(&ws, &args);
        let predicted = number(&j, "tflops_per_gpu");
        let err = predicted / row.tflops - 1.0;
        println!(
            "{:<12} {:>3} {:>3} {:>3} {:>4} {:>2} {:>5} {:>9.0} {predicted:>9.1} {:>+6.1}%",
            row.model.trim_end_matches(".json"),
            row.tp,
            row.pp,
            row.dp(),
            row.micro_batch,
            row.interleave,
            row.global_batch,
            row.tflops,
            err * 100.0
        );
        assert_eq!(j["fits"], true, "{}: the published layout fits", row.model);
        errors.push((row.model, err));
    }
    // The issue's goal: every row within ±20%, the median within ±10%. No constant of the cost
    // model was fitted to this table (the matmul efficiency is fitted to MosaicML's runs, see
    // tests/calibration.rs), so it is an out-of-sample check.
    for (model, err) in &errors {
        assert!(err.abs() <= 0.20, "{model}: {err:+}");
    }
    let errors: Vec<f64> = errors.into_iter().map(|(_, e)| e).collect();
    let median = median(errors);
    println!("median error: {:+.1}%", median * 100.0);
    assert!(median.abs() <= 0.10, "median error {median}");
}

/// The other published results ALGORITHMS.md §7 asks a planner to reproduce: sanity checks of
/// the cost model, not tuning targets. Run with `--nocapture` to see the figures.
#[test]
fn megatron_published_facts() {
    let ws = TempWorkspace::default_copy();

    // Korthikanti et al. 2022, Table 5: the 22B GPT on 8 A100 (t 8, micro-batch 4, global batch
    // 4) takes 1.42 s per iteration with full recomputation and 1.10 s with selective
    // recomputation and sequence parallelism, both fitting in memory.
    let gpt22 = |mode: &[&str]| {
        let mut args = vec![
            "--model",
            "models/gpt-22b.json",
            "--cluster",
            "a100-80g:1x8",
            "--tp",
            "8",
            "--mbs",
            "4",
            "--gbs",
            "4",
            "--attention",
            "unfused",
            "--seq",
            "2048",
        ];
        args.extend_from_slice(mode);
        estimate(&ws, &args)
    };
    let full = gpt22(&["--recompute", "full"]);
    let selective = gpt22(&["--recompute", "selective", "--sp"]);
    let (t_full, t_sel) = (
        number(&full, "step_time_s"),
        number(&selective, "step_time_s"),
    );
    println!(
        "22B, 8 A100: full recompute {t_full:.2} s (published 1.42, {:+.1}%), selective + SP \
         {t_sel:.2} s (published 1.10, {:+.1}%), speed-up {:.2} (published 1.29)",
        (t_full / 1.42 - 1.0) * 100.0,
        (t_sel / 1.10 - 1.0) * 100.0,
        t_full / t_sel
    );
    assert_eq!(full["fits"], true);
    assert_eq!(selective["fits"], true);
    assert!((t_full / 1.42 - 1.0).abs() <= 0.20, "{t_full}");
    assert!((t_sel / 1.10 - 1.0).abs() <= 0.20, "{t_sel}");
    assert!(
        (1.15..=1.45).contains(&(t_full / t_sel)),
        "{t_full} / {t_sel}"
    );

    // Narayanan et al. 2021, §5.2: GPT-3 175B on 1536 A100 with global batch 1536 reaches 141
    // TFLOP/s per GPU with PTD-P and 44 with ZeRO-3 without model parallelism (one sequence
    // per GPU). autopar prices ZeRO-3 as prefetched per-layer gathers over the nodes' combined
    // adapters, which hides them behind compute; the 44 is not reproduced (README, "Accuracy")
    // and only printed.
    let gpt3 = |layout: &[&str]| {
        tflops_2021(
            &ws,
            "models/gpt3-175b.json",
            "a100-80g:192x8",
            "1536",
            layout,
        )
    };
    let zero3 = gpt3(&["--tp", "1", "--pp", "1", "--zero", "3"]);
    let ptd = gpt3(&["--tp", "8", "--pp", "12"]);
    println!(
        "175B, 1536 A100: PTD-P t 8 · p 12 {ptd:.1} TFLOP/s (published 141, {:+.1}%); ZeRO-3 \
         {zero3:.1} (published 44, not reproduced)",
        (ptd / 141.0 - 1.0) * 100.0
    );
    assert!((ptd / 141.0 - 1.0).abs() <= 0.20, "{ptd}");

    // Narayanan et al. 2021, Figure 13: the 162B GPT on 64 A100 (8 nodes, micro-batch 1, as
    // `run_figure_13.sh`): tensor parallelism within a node (t 8 · p 8) is best, and taking it
    // across nodes (t 16, t 32) costs up to 2x.
    for gbs in ["32", "128"] {
        let at = |t: u64| {
            let (t, p) = (t.to_string(), (64 / t).to_string());
            let layout = ["--tp", &t, "--pp", &p];
            tflops_2021(&ws, "models/gpt-162b.json", "a100-80g:8x8", gbs, &layout)
        };
        let by_t: Vec<(u64, f64)> = [2, 4, 8, 16, 32].iter().map(|&t| (t, at(t))).collect();
        let best = by_t[2].1;
        println!(
            "162B, 64 A100, global batch {gbs}: {}",
            by_t.iter()
                .map(|(t, x)| format!("t {t} · p {} {x:.1}", 64 / t))
                .collect::<Vec<_>>()
                .join(", ")
        );
        assert!(by_t.iter().all(|&(_, x)| x <= best), "{by_t:?}");
        assert!(by_t[4].1 < by_t[3].1 && by_t[3].1 < best, "{by_t:?}");
        assert!((1.2..=2.5).contains(&(best / by_t[4].1)), "{by_t:?}");
    }

    // Narayanan et al. 2021, Figure 12: GPT-3 175B on 96 A100 (t 8, p 12, micro-batch 1; two
    // layers per virtual stage, so 4 chunks per stage, in NVIDIA's `run_figure_12.sh`): the
    // interleaved schedule gains more than 10% at small batch sizes, and less as the batch
    // grows.
    let mut gains = Vec::new();
    for gbs in ["12", "24", "36", "48", "60"] {
        let at = |v: &str| {
            let layout = ["--tp", "8", "--pp", "12", "--vp", v];
            tflops_2021(&ws, "models/gpt3-175b.json", "a100-80g:12x8", gbs, &layout)
        };
        let gain = at("4") / at("1") - 1.0;
        println!(
            "175B, 96 A100, global batch {gbs}: interleaving gains {:+.1}%",
            gain * 100.0
        );
        gains.push(gain);
    }
    assert!(gains[0] > 0.10 && gains[1] > 0.10, "{gains:?}");
    assert!(gains.windows(2).all(|w| w[1] < w[0]), "{gains:?}");
}

#[test]
fn estimate_json_contract_and_memory_failure() {
    let ws = TempWorkspace::default_copy();
    let j = estimate(
        &ws,
        &[
            "--model",
            "llama2-70b",
            "--cluster",
            "dgx-h100-8",
            "--tp",
            "8",
            "--pp",
            "4",
            "--mbs",
            "1",
            "--gbs",
            "512",
            "--seq",
            "4096",
            "--sp",
            "--recompute",
            "selective",
            "--zero",
            "1",
        ],
    );
    for key in [
        "step_time_s",
        "tflops_per_gpu",
        "mfu",
        "memory_per_device_gib",
        "fits",
        "tokens_per_s",
    ] {
        assert!(!j[key].is_null(), "{key} missing in {j}");
    }
    assert_eq!(j["layout"]["dp"], 2, "dp defaults to GPUs / (tp x pp)");
    let m = &j["memory"];
    let parts: f64 = ["weights", "grads", "optimizer", "activations", "workspace"]
        .iter()
        .map(|k| m[k].as_f64().expect("part"))
        .sum();
    assert!((parts - number(m, "total")).abs() < 1.0);
    let t = &j["time"];
    let time: f64 = [
        "compute",
        "recompute",
        "tp_comm",
        "p2p",
        "zero_comm",
        "bubble",
        "grad_sync",
        "optimizer",
    ]
    .iter()
    .map(|k| t[k].as_f64().expect("part"))
    .sum();
    let step = number(&j, "step_time_s");
    assert!(
        (time - step).abs() < 1e-9 * step,
        "the breakdown adds up to the step time"
    );

    // The same model without model parallelism does not fit on one H100: exit 1, fits = false.
    let oom = ws.run(&[
        "estimate",
        "--model",
        "llama2-70b",
        "--cluster",
        "h100-sxm:1x8",
        "--gbs",
        "64",
        "--seq",
        "4096",
        "--json",
    ]);
    assert_eq!(oom.code, 1);
    assert_eq!(oom.json()["fits"], false);
    assert!(
        oom.stderr.contains("GiB per device but h100-sxm has"),
        "{}",
        oom.stderr
    );
}

#[test]
fn estimate_text_output() {
    let ws = TempWorkspace::default_copy();
    // GPT-3 175B on 1024 A100s at tp 8 pp 16, with `more` flags.
    let gpt3 = |more: &[&str]| {
        let mut args = vec![
            "estimate",
            "--model",
            "models/gpt3-175b.json",
            "--cluster",
            "a100-80g:128x8",
            "--tp",
            "8",
            "--pp",
            "16",
            "--mbs",
            "1",
            "--gbs",
            "1536",
        ];
        args.extend_from_slice(more);
        ws.run(&args)
    };
    let r = gpt3(&[
        "--vp",
        "2",
        "--sp",
        "--recompute",
        "selective",
        "--zero",
        "1",
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    for needle in [
        "tp 8 · pp 16 · dp 8",
        "interleave 2",
        "TFLOP/s per GPU",
        "MFU",
        "fits",
        "stages",
    ] {
        assert!(
            r.stdout.contains(needle),
            "missing {needle:?}:\n{}",
            r.stdout
        );
    }

    // Megatron-LM's block method: the first N blocks of each chunk, said in the layout line;
    // the flag without full recomputation is refused.
    let block = |recompute: &str| gpt3(&["--recompute", recompute, "--recompute-num-layers", "2"]);
    let r = block("full");
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stdout
            .contains("recompute full (the first 2 blocks of each chunk)"),
        "{}",
        r.stdout
    );
    let r = block("selective");
    assert_eq!(r.code, 2, "{}", r.stdout);
    assert!(
        r.stderr.contains(
            "--recompute-num-layers: expected --recompute full with it, found --recompute selective"
        ),
        "{}",
        r.stderr
    );
}

#[test]
fn estimate_prices_graph_file_models_under_tensor_parallelism() {
    let ws = TempWorkspace::default_copy();
    let price = |tp: &str| {
        estimate(
            &ws,
            &[
                "--model",
                "tiny-mlp",
                "--cluster",
                "h100-sxm:1x2",
                "--tp",
                tp,
                "--gbs",
                "8",
            ],
        )
    };
    let (one, two) = (price("1"), price("2"));
    // Column- and row-parallel MLPs: tensor parallelism halves the weights per device and adds
    // all-reduces.
    let w1 = number(&one["memory"], "weights");
    let w2 = number(&two["memory"], "weights");
    assert!((w2 / w1 - 0.5).abs() < 0.01, "{w1} {w2}");
    assert_eq!(one["time"]["tp_comm"], 0.0);
    assert!(number(&two["time"], "tp_comm") > 0.0);
}

/// A workspace cluster with `profiles` prices a hand-chosen layout with its measured times,
/// exactly as `autopar build` prices the same layout; the `PRESET:NODESxGPUS` form, which has no
/// profiles, prices it with the model alone.
#[test]
fn estimate_reads_the_clusters_profiles_as_build_does() {
    let ws = TempWorkspace::default_copy();
    let b = ws.run(&["build", "tiny-llama-cpu", "--json"]);
    assert_eq!(b.code, 0, "{}", b.stderr);
    let plan: serde_json::Value =
        serde_json::from_str(&ws.read("plans/tiny-llama-cpu.json")).expect("plan");
    let l = &plan["estimate"]["layout"];
    let arg = |k: &str| l[k].as_u64().expect(k).to_string();
    let price = |cluster: &str| {
        let (tp, pp, mbs) = (arg("tp"), arg("pp"), arg("micro_batch"));
        estimate(
            &ws,
            &[
                "--model",
                "tiny-llama",
                "--cluster",
                cluster,
                "--tp",
                &tp,
                "--pp",
                &pp,
                "--mbs",
                &mbs,
                "--gbs",
                "4",
                "--seq",
                "128",
                "--precision",
                "fp32",
            ],
        )
    };
    assert_eq!(
        l["recompute"], "none",
        "the layout estimate prices by default"
    );
    let measured = price("host-cpu");
    assert_eq!(measured["profiles"], serde_json::json!(["host-cpu"]));
    assert_eq!(
        measured["step_time_s"], plan["estimate"]["step_time_s"],
        "the same price as the build's"
    );
    let modelled = price("cpu:1x1");
    assert_eq!(modelled["profiles"], serde_json::json!([]));
    assert_ne!(modelled["step_time_s"], measured["step_time_s"]);
}

/// Each attention kernel family runs at its device's rate: on H100 cuDNN's fused attention is
/// faster than FlashAttention-2 and Transformer Engine's `auto` picks it; on A100 the order is
/// reversed and `auto` picks FlashAttention-2. Only the compute time moves, and the Triton kernel
/// is the slowest everywhere.
#[test]
fn attention_kernels_run_at_their_devices_rates() {
    let ws = TempWorkspace::default_copy();
    // LLaMA-3 8B on one node at 8,192 tokens under ZeRO-3, with `extra` flags.
    let args = |cluster: &'static str, extra: [&'static str; 2]| {
        let mut a = vec![
            "--model",
            "models/llama3-8b.json",
            "--cluster",
            cluster,
            "--mbs",
            "1",
            "--gbs",
            "8",
            "--seq",
            "8192",
            "--zero",
            "3",
        ];
        a.extend(extra);
        a
    };
    for (cluster, auto_is) in [("dgx-h100:1", "fused"), ("dgx-a100:1", "flash")] {
        let run = |attention: &'static str| {
            let mut a = args(cluster, ["--recompute", "full"]);
            a.extend(["--attention", attention]);
            estimate(&ws, &a)
        };
        let [flash, triton, fused, auto] = ["flash", "flash-triton", "fused", "auto"].map(run);
        let compute = |j: &serde_json::Value| number(&j["time"], "compute");
        assert_eq!(
            auto["step_time_s"],
            run(auto_is)["step_time_s"],
            "{cluster}"
        );
        assert!(
            compute(&triton) > compute(&flash).max(compute(&fused)),
            "{cluster}"
        );
        let (slow, fast) = if auto_is == "fused" {
            (&flash, &fused)
        } else {
            (&fused, &flash)
        };
        assert!(compute(slow) > compute(fast), "{cluster}");
        for key in ["tp_comm", "zero_comm", "grad_sync", "optimizer"] {
            assert_eq!(slow["time"][key], fast["time"][key], "{cluster} {key}");
        }
        // The memory is the same: no kernel of the family stores the score matrix.
        assert_eq!(slow["memory_per_device_gib"], fast["memory_per_device_gib"]);
    }
    // Megatron-Core leaves the choice to Transformer Engine; torchtitan's SDPA runs flash.
    let preset = |runtime: &'static str| {
        let mut a = vec!["estimate"];
        a.extend(args("dgx-h100:1", ["--runtime", runtime]));
        let r = ws.run(&a);
        assert_eq!(r.code, 0, "{}", r.stderr);
        r.stdout
    };
    assert!(
        preset("megatron-core").contains("auto attention (cuDNN on Hopper, flash-attn on Ampere)")
    );
    assert!(preset("torchtitan").contains("flash attention"));
}

/// A runtime preset sets precision, attention and weight-gradient accumulation fusion as the
/// table in `rules/src/plan/runtime.rs` says; a flag given explicitly wins; in a workspace, a
/// target's `runtime` does the same and a misspelt one is a located input error.
#[test]
fn runtime_presets_set_what_their_flags_set() {
    use autopar_rules::plan::runtime::Runtime;
    let ws = TempWorkspace::default_copy();
    let base = [
        "--model",
        "models/gpt-1.7b.json",
        "--cluster",
        "a100-80g:4x8",
        "--mbs",
        "16",
        "--gbs",
        "512",
        "--recompute",
        "full",
    ];
    let time = |extra: &[&str]| {
        let mut args = base.to_vec();
        args.extend_from_slice(extra);
        number(&estimate(&ws, &args), "step_time_s")
    };
    let mut seen = Vec::new();
    for r in Runtime::ALL {
        let mut flags = vec![
            "--precision",
            r.precision().name(),
            "--attention",
            r.attention().name(),
        ];
        if !r.grad_accumulation_fusion() {
            flags.push("--no-grad-accumulation-fusion");
        }
        let bool_flag = |b: bool| if b { "true" } else { "false" };
        flags.extend([
            "--grad-reduce-in-fp32",
            bool_flag(r.grad_reduce_in_fp32(r.precision())),
            "--overlap-grad-reduce",
            bool_flag(r.overlap_grad_reduce()),
            "--overlap-param-gather",
            bool_flag(r.overlap_param_gather()),
            "--fp32-loss",
            bool_flag(r.fp32_loss()),
            "--eager-elementwise",
            bool_flag(r.eager_elementwise()),
            "--tp-comm-overlap",
            bool_flag(r.tp_comm_overlap()),
        ]);
        let preset = time(&["--runtime", r.name()]);
        assert_eq!(preset, time(&flags), "{}", r.name());
        seen.push(preset);
    }
    // The presets differ where their settings do: nemo runs Megatron-Core with the
    // data-parallel reduction overlapped (dp 32 here), megatron-2021 in fp16 without fusion.
    assert!(seen[1] < seen[0], "{seen:?}");
    assert_ne!(seen[0], seen[3]);
    // The overlap is the only difference between the two.
    assert_eq!(
        seen[1],
        time(&[
            "--overlap-grad-reduce",
            "true",
            "--overlap-param-gather",
            "true"
        ])
    );
    // fp32 gradients take twice the bytes of bf16 ones to reduce.
    assert!(time(&["--grad-reduce-in-fp32", "false"]) < seen[0]);
    // An explicit flag wins over the preset.
    assert_eq!(
        time(&["--runtime", "megatron-2021", "--precision", "bf16"]),
        time(&[
            "--attention",
            "unfused",
            "--no-grad-accumulation-fusion",
            "--grad-reduce-in-fp32",
            "false"
        ])
    );

    let toml = ws.read("workspace.toml");
    let at = toml.find("global_batch = 1536").expect("the gpt3 target");
    let edited = format!("{}runtime = \"megatron2021\"\n{}", &toml[..at], &toml[at..]);
    ws.write("workspace.toml", &edited);
    let r = ws.run(&["build", "gpt3-175b"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(
        r.stderr
            .contains("field `target.runtime`: expected one of `megatron-core`"),
        "{}",
        r.stderr
    );
}

/// A cluster's network is its nodes' adapters: `p4de` (four 100 Gb/s adapters for eight A100
/// 80GB) prices exactly as a DGX A100 described with those adapters, the shorthand and the
/// workspace agree, and the data-parallel gradient all-reduce across nodes (one rank per node
/// under tp 8) takes four times the bandwidth term on a quarter of the network.
#[test]
fn the_network_a_cluster_describes_prices_its_collectives() {
    let ws = TempWorkspace::with_toml(
        r#"[[model]]
name = "gpt"
hf_config = "models/gpt2-small.json"

[[cluster]]
name = "p4de"
preset = "p4de"
nodes = 4

[[cluster]]
name = "dgx"
preset = "dgx-a100"
nodes = 4

[[cluster]]
name = "dgx-as-p4de"
preset = "dgx-a100"
nodes = 4
nics_per_node = 4
nic_gbits = 100
"#,
    );
    let layout = [
        "--tp", "4", "--pp", "1", "--dp", "8", "--mbs", "4", "--gbs", "64",
    ];
    let run = |cluster: &str| {
        let mut args = vec!["--model", "gpt", "--cluster", cluster];
        args.extend_from_slice(&layout);
        estimate(&ws, &args)
    };
    let (p4de, dgx, described) = (run("p4de"), run("dgx"), run("dgx-as-p4de"));
    assert_eq!(p4de["time"], described["time"]);
    assert_eq!(p4de["time"], run("p4de:4")["time"]);
    assert_eq!(dgx["time"], run("dgx-a100:4")["time"]);
    assert_eq!(dgx["time"], run("a100-80g:4x8")["time"]);
    // Two ranks per node over four nodes: 2 (n-1)/n of the gradients over the two ranks'
    // share of the node's adapters, plus the latency of a Simple ring: the start-up, then
    // 2 x 7 steps, 2 x 4 of them on the network (NCCL's count).
    let grads = |j: &serde_json::Value| number(&j["time"], "grad_sync");
    let latency = 20e-6 + 6.0 * 3.4e-6 + 8.0 * 14e-6;
    let ratio = (grads(&p4de) - latency) / (grads(&dgx) - latency);
    assert!((ratio - 4.0).abs() < 1e-6, "{ratio}");
    // Kernels and tensor parallelism inside a node do not see the network.
    assert_eq!(p4de["time"]["compute"], dgx["time"]["compute"]);
    assert_eq!(p4de["time"]["tp_comm"], dgx["time"]["tp_comm"]);
    let text = ws.run(&[
        "estimate",
        "--model",
        "gpt",
        "--cluster",
        "p4de",
        "--tp",
        "4",
        "--gbs",
        "64",
    ]);
    assert!(
        text.stdout
            .contains("p4de (4 x 8 a100-80g, 4 x 100 Gb/s per node)"),
        "{}",
        text.stdout
    );
}

/// Overlapping the data-parallel reduction with the backward (Megatron-Core's
/// `--overlap-grad-reduce`) hides all of it but the bucket of the layer the backward finishes
/// last, here the embedding (GPT-1.7B on one node: a 1.2 s backward against a 50 ms
/// all-reduce); the gradients' dtype scales the reduction.
#[test]
fn an_overlapped_reduction_leaves_only_the_last_layers_bucket() {
    let ws = TempWorkspace::default_copy();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "--model",
            "models/gpt-1.7b.json",
            "--cluster",
            "a100-80g:1x8",
            "--mbs",
            "16",
            "--gbs",
            "512",
            "--recompute",
            "full",
        ];
        args.extend_from_slice(extra);
        estimate(&ws, &args)
    };
    let sync = |j: &serde_json::Value| number(&j["time"], "grad_sync");
    let plain = run(&["--overlap-grad-reduce", "false"]);
    let overlapped = run(&["--overlap-grad-reduce", "true"]);
    let params = number(&plain["stages"][0], "params");
    // GPT-1.7B's embedding: (vocabulary 51200 + 2048 positions) x hidden 2304.
    let embedding = (51200.0 + 2048.0) * 2304.0;
    let ratio = sync(&overlapped) / sync(&plain);
    assert!(
        (ratio - embedding / params).abs() < 1e-9,
        "{ratio} vs {}",
        embedding / params
    );
    // bf16 gradients (DeepSpeed's and FSDP PURE's default) halve the bandwidth term.
    let half = run(&[
        "--overlap-grad-reduce",
        "false",
        "--grad-reduce-in-fp32",
        "false",
    ]);
    assert!(sync(&half) < 0.55 * sync(&plain) && sync(&half) > 0.45 * sync(&plain));
    // And the memory: 18 bytes per parameter with fp32 gradients, 20 with bf16 ones (the
    // optimizer's fp32 copy), Megatron-LM's figures without the distributed optimizer.
    let states = |j: &serde_json::Value| {
        let m = &j["stages"][0]["memory"];
        number(m, "weights") + number(m, "grads") + number(m, "optimizer")
    };
    assert!((states(&plain) / params - 18.0).abs() < 1e-9);
    assert!((states(&half) / params - 20.0).abs() < 1e-9);
}

/// Context parallelism splits every activation over the cp ranks and keeps the work of a
/// step: with 4 ranks per sequence instead of 4 replicas, the activations per device fall to a
/// quarter and the model FLOPs per step are the same (the attention core attends a rank's
/// queries to every key). Megatron-Core's conditions are errors naming what does not divide.
#[test]
fn context_parallelism_splits_activations_and_keeps_the_work() {
    let ws = TempWorkspace::default_copy();
    let base = [
        "--model",
        "llama3-8b",
        "--cluster",
        "h100-sxm:4x8",
        "--tp",
        "8",
        "--gbs",
        "32",
    ];
    let run = |extra: &[&str]| {
        let mut args = base.to_vec();
        args.extend_from_slice(&["--sp", "--seq", "65536"]);
        args.extend_from_slice(extra);
        estimate(&ws, &args)
    };
    let (plain, split) = (run(&["--cp", "1"]), run(&["--cp", "4"]));
    assert_eq!(split["layout"]["cp"], 4);
    assert_eq!(plain["layout"]["dp"], 4);
    assert_eq!(split["layout"]["dp"], 1);
    let act = |j: &serde_json::Value| number(&j["memory"], "activations");
    let ratio = act(&split) / act(&plain);
    assert!((ratio - 0.25).abs() < 1e-9, "activations ratio {ratio}");
    let flops = |j: &serde_json::Value| number(j, "model_flops_per_step");
    let rel = (flops(&split) / flops(&plain) - 1.0).abs();
    assert!(rel < 1e-9, "model FLOPs differ by {rel}");
    // The ring overlaps its transfers with attention; the all-gather does not.
    let comm = |comm: &str| {
        number(
            &run(&["--cp", "4", "--cp-comm-type", comm])["time"],
            "tp_comm",
        )
    };
    assert!(comm("p2p") < comm("allgather"));
    // Selective recomputation re-runs the attention core and with it the exchange the core
    // does not hide: the all-gather of keys and values again, the ring's exposed steps again.
    let recompute = |comm: &str| {
        number(
            &run(&[
                "--cp",
                "4",
                "--cp-comm-type",
                comm,
                "--recompute",
                "selective",
            ])["time"],
            "recompute",
        )
    };
    assert!(
        recompute("allgather") > recompute("p2p"),
        "{} vs {}",
        recompute("allgather"),
        recompute("p2p")
    );
    // Hierarchical: at tp 8 no two of the 4 ranks share a node, so it is the ring alone.
    assert_eq!(comm("a2a+p2p"), comm("p2p"));
    for (args, want) in [
        (
            vec!["--cp", "4", "--seq", "65540"],
            "error: context parallelism cp = 4: the sequence of 65540 tokens does not split into 2 x cp = 8 equal chunks",
        ),
        (
            vec!["--cp", "4", "--seq", "65536", "--cp-comm-type", "a2a"],
            "error: context parallelism cp = 4: cp_comm = \"a2a\" splits the heads over tp x 4 = 32 ranks, but the model has 8 key/value heads",
        ),
        (
            vec!["--cp", "4", "--seq", "65536", "--attention", "unfused"],
            "error: context parallelism cp = 4: needs attention = \"flash\" or \"flash-triton\" or \"fused\" or \"auto\" (the ring and the gathers feed a blockwise attention kernel)",
        ),
    ] {
        let mut all = vec!["estimate"];
        all.extend(base);
        all.extend(args);
        let r = ws.run(&all);
        assert_eq!(r.code, 2, "{all:?}: {}", r.stderr);
        assert!(r.stderr.contains(want), "{all:?}: {}", r.stderr);
    }
}

/// FP8 products (Transformer Engine): faster than bf16 on Hopper, each FP8 weight held with
/// its FP8 copy and transpose (2 bytes more), and the saved inputs of the products in one
/// byte; refused on a device without FP8 tensor cores, by `estimate` and in a workspace.
#[test]
fn fp8_products_are_priced_on_hopper_and_refused_elsewhere() {
    let ws = TempWorkspace::default_copy();
    let layout = [
        "--model",
        "models/llama2-7b.json",
        "--tp",
        "2",
        "--pp",
        "1",
        "--sp",
        "--mbs",
        "1",
        "--gbs",
        "128",
        "--seq",
        "4096",
        "--zero",
        "1",
    ];
    let priced = |fp8: bool| {
        let mut args = layout.to_vec();
        args.extend(["--cluster", "dgx-h100:1"]);
        if fp8 {
            args.push("--fp8");
        }
        estimate(&ws, &args)
    };
    let (bf16, fp8) = (priced(false), priced(true));
    assert!(number(&fp8, "step_time_s") < 0.8 * number(&bf16, "step_time_s"));
    let stage = |e: &serde_json::Value, key: &str| number(&e["stages"][0], key);
    // Every block weight but the norms' runs in FP8 (per block 4 x 4096^2 for attention and
    // 3 x 4096 x 11008 for the MLP: 6.48 B of the model's 6.74 B), halved by tensor
    // parallelism.
    let fp8_params = stage(&fp8, "fp8_params");
    assert_eq!(stage(&bf16, "fp8_params"), 0.0);
    assert!(
        (fp8_params / (32.0 * 202_375_168.0 / 2.0) - 1.0).abs() < 1e-9,
        "{fp8_params}"
    );
    let weights = |e: &serde_json::Value| number(&e["memory"], "weights");
    assert_eq!(weights(&fp8) - weights(&bf16), 2.0 * fp8_params);
    assert!(number(&fp8["memory"], "activations") < number(&bf16["memory"], "activations"));
    // Under sequence parallelism the all-gathers move FP8 copies (one byte per element, half
    // the bytes); the reduce-scatters stay in bf16.
    let tp_comm = |e: &serde_json::Value| number(&e["time"], "tp_comm");
    let ratio = tp_comm(&fp8) / tp_comm(&bf16);
    assert!(ratio > 0.5 && ratio < 0.85, "{ratio}");

    let mut args = layout.to_vec();
    args.extend(["--cluster", "dgx-a100:1", "--fp8"]);
    let mut all = vec!["estimate"];
    all.extend_from_slice(&args);
    let r = ws.run(&all);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(
        r.stderr.contains("fp8 needs FP8 tensor cores") && r.stderr.contains("a100-80g"),
        "{}",
        r.stderr
    );

    // In a workspace: a target on A100s is refused where it asks for FP8; one on H100s plans
    // with it and says so in its Megatron-LM arguments.
    let toml = std::fs::read_to_string(ws.path().join("workspace.toml")).expect("workspace");
    let target = |cluster: &str| {
        format!(
            "{toml}\n[[target]]\nname = \"fp8\"\nmodel = \"tiny-llama\"\ncluster = \"{cluster}\"\n\
             global_batch = 16\nseq_len = 128\nspace = \"megatron\"\nfp8 = true\n"
        )
    };
    ws.write("workspace.toml", &target("a100-40g-1"));
    let r = ws.run(&["build", "fp8"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    let lines = toml.lines().count() + 1;
    let at = format!("workspace.toml:{}:", lines + 8);
    assert!(
        r.stderr.contains(&at) && r.stderr.contains("field `target.fp8`"),
        "{at}: {}",
        r.stderr
    );
    ws.write("workspace.toml", &target("dgx-h100-1"));
    let r = ws.run(&["build", "fp8"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let plan = ws.read("plans/fp8.json");
    assert!(plan.contains("--fp8-format hybrid"), "{plan}");
    assert!(r.stdout.contains("bf16 with FP8 products"), "{}", r.stdout);
}

/// Transformer Engine's userbuffers (`--tp-comm-overlap`, on in the nemo runtime) hide
/// sequence parallelism's all-gathers and reduce-scatters behind the products next to them;
/// without sequence parallelism the all-reduces stay exposed, and the flag changes nothing.
#[test]
fn userbuffers_hide_sequence_parallel_collectives_behind_the_products() {
    let ws = TempWorkspace::default_copy();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "--model",
            "models/llama2-7b.json",
            "--cluster",
            "dgx-h100:1",
            "--tp",
            "4",
            "--pp",
            "1",
            "--mbs",
            "1",
            "--gbs",
            "128",
            "--seq",
            "4096",
            "--zero",
            "1",
        ];
        args.extend_from_slice(extra);
        estimate(&ws, &args)
    };
    let tp_comm = |e: &serde_json::Value| number(&e["time"], "tp_comm");
    let (hidden, exposed) = (
        run(&["--sp", "--tp-comm-overlap", "true"]),
        run(&["--sp", "--tp-comm-overlap", "false"]),
    );
    // On NVLink at tp 4, the products of a LLaMA-2 7B block take longer than their
    // collectives: little more than a ring's first steps stays exposed.
    assert!(
        tp_comm(&hidden) > 0.0 && tp_comm(&hidden) < 0.25 * tp_comm(&exposed),
        "{} vs {}",
        tp_comm(&hidden),
        tp_comm(&exposed)
    );
    assert!(number(&hidden, "step_time_s") < number(&exposed, "step_time_s"));
    assert_eq!(
        run(&["--tp-comm-overlap", "true"])["time"],
        run(&["--tp-comm-overlap", "false"])["time"],
        "all-reduces are never overlapped"
    );
    // NeMo's recipes turn it on; Megatron-Core's default leaves it off.
    assert_eq!(
        run(&["--sp", "--runtime", "nemo"])["time"],
        run(&["--sp", "--runtime", "nemo", "--tp-comm-overlap", "true"])["time"]
    );
    assert_eq!(run(&["--sp"])["time"], exposed["time"]);
}

/// ZeRO-3's backward waits for more of its collectives the later the next block's gather is
/// issued (`--backward-prefetch`): only the ZeRO communication changes, and a value PyTorch
/// spells otherwise is refused.
#[test]
fn a_later_backward_prefetch_exposes_more_of_zero3s_collectives() {
    let ws = TempWorkspace::default_copy();
    let layout = [
        "--model",
        "models/gpt-1.7b.json",
        "--cluster",
        "a100-80g:1x8",
        "--tp",
        "1",
        "--pp",
        "1",
        "--mbs",
        "4",
        "--gbs",
        "64",
        "--zero",
        "3",
        "--runtime",
        "llm-foundry",
    ];
    let run = |prefetch: &str| {
        estimate(
            &ws,
            &[&layout[..], &["--backward-prefetch", prefetch]].concat(),
        )
    };
    let [pre, post, none] = ["pre", "post", "none"].map(run);
    let zero = |j: &serde_json::Value| number(&j["time"], "zero_comm");
    assert!(
        zero(&pre) < zero(&post) && zero(&post) < zero(&none),
        "{} {} {}",
        zero(&pre),
        zero(&post),
        zero(&none)
    );
    for key in ["compute", "recompute", "grad_sync", "optimizer", "bubble"] {
        assert_eq!(
            number(&pre["time"], key),
            number(&none["time"], key),
            "{key}"
        );
    }
    let r = ws.run(
        &[
            &["estimate"][..],
            &layout,
            &["--backward-prefetch", "BACKWARD_POST"],
        ]
        .concat(),
    );
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(
        r.stderr.contains("expected one of pre, post, none"),
        "{}",
        r.stderr
    );
}
