//! `autopar validate`: predictions against files of measured runs, the public datasets shipped
//! in `data/runs/`, and its input errors.

use autopar_rules::plan::accuracy::spearman;
use autopar_tests::megatron::TABLE1;
use autopar_tests::mosaicml::ROWS;
use autopar_tests::{TempWorkspace, repo_root};

/// `autopar validate FILE --json`, which must succeed.
fn validate(ws: &TempWorkspace, file: &str) -> serde_json::Value {
    let r = ws.run(&["validate", file, "--json"]);
    assert_eq!(r.code, 0, "validate {file}: {}", r.stderr);
    r.json()
}

/// A dataset of the repository.
fn dataset(name: &str) -> String {
    repo_root()
        .join("data/runs")
        .join(name)
        .to_string_lossy()
        .into_owned()
}

/// `validate` on the shipped dataset `name` with a column `column` of `false` added to every
/// run.
fn validate_with_false(ws: &TempWorkspace, name: &str, column: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(dataset(name))
        .expect("the dataset")
        .lines()
        .filter(|l| !l.starts_with('#'))
        .enumerate()
        .map(|(i, l)| match i {
            0 => format!("{l},{column}"),
            _ => format!("{l},false"),
        })
        .collect::<Vec<_>>()
        .join("\n");
    ws.write("changed.csv", &text);
    validate(ws, "changed.csv")
}

/// `estimate --json` with `args`, which must succeed: its predicted step time.
fn estimate_time(ws: &TempWorkspace, args: &[String]) -> f64 {
    let mut all = vec!["estimate".to_string()];
    all.extend_from_slice(args);
    all.push("--json".into());
    let all: Vec<&str> = all.iter().map(String::as_str).collect();
    let r = ws.run(&all);
    assert_eq!(r.code, 0, "{all:?}: {}", r.stderr);
    r.json()["step_time_s"].as_f64().expect("step_time_s")
}

fn number(v: &serde_json::Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

/// Every shipped dataset holds its source's rows, and validate prices each run exactly as
/// `estimate` prices the same layout with the runtime's settings spelled out as flags.
#[test]
fn shipped_datasets_are_priced_as_estimate_prices_them() {
    let ws = TempWorkspace::default_copy();

    let megatron = validate(&ws, &dataset("megatron-2021-table1.csv"));
    let runs = megatron["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), TABLE1.len());
    for (run, row) in runs.iter().zip(TABLE1) {
        // The 2021 software (`SOFTWARE_2021`) is what the `megatron-2021` runtime sets.
        let mut args = row.estimate_args();
        args.extend(["--memory-headroom".into(), "0".into()]);
        assert_eq!(
            number(&run["predicted_step_time_s"]),
            estimate_time(&ws, &args),
            "{}",
            row.model
        );
        // The step time is the paper's conversion of its FLOP/s (see the file's header).
        let (l, h) = model_shape(row.model);
        let (s, v, b) = (2048.0, 51200.0, row.global_batch as f64);
        let flops = 96.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h));
        let want = flops / (row.tflops * 1e12 * row.gpus as f64);
        let got = number(&run["measured_step_time_s"]);
        assert!(
            (got / want - 1.0).abs() < 1e-3,
            "{}: {got} vs {want}",
            row.model
        );
    }

    let mosaic = validate(&ws, &dataset("mosaicml-mpt.csv"));
    let runs = mosaic["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), ROWS.len());
    for (run, row) in runs.iter().zip(ROWS).step_by(13) {
        let model = row.model.path();
        let cluster = format!("{}:{}x8", row.gpu, row.nodes());
        let mut args = row.estimate_args(&model, &cluster);
        // llm-foundry: bf16, Triton flash attention, gradients added per micro-batch, the
        // data-parallel collectives overlapped (FSDP), spelled out over its preset.
        args.extend(
            [
                "--precision",
                "bf16",
                "--attention",
                "flash-triton",
                "--no-grad-accumulation-fusion",
                "--overlap-grad-reduce",
                "true",
                "--overlap-param-gather",
                "true",
            ]
            .map(String::from),
        );
        assert_eq!(
            number(&run["predicted_step_time_s"]),
            estimate_time(&ws, &args),
            "{model} on {cluster}"
        );
        let want = (row.global_batch * row.seq) as f64 / (row.tokens_per_gpu * row.gpus as f64);
        let got = number(&run["measured_step_time_s"]);
        assert!((got / want - 1.0).abs() < 1e-3, "{model}: {got} vs {want}");
    }

    let korthikanti = validate(&ws, &dataset("korthikanti-2022.csv"));
    assert_eq!(korthikanti["runs"].as_array().map(Vec::len), Some(2));

    // torchtitan publishes tokens/s per GPU (WPS) of FSDP over 64 GPUs.
    let torchtitan = validate(&ws, &dataset("torchtitan-a100.csv"));
    let runs = torchtitan["runs"].as_array().expect("runs");
    // (model, local batch, sequence, recompute, blocks recomputed, WPS; 0: out of memory)
    let published = [
        ("llama2-13b", 2, 4096, "none", None, 2162.0),
        ("llama2-70b", 2, 4096, "full", None, 353.0),
        ("llama3-70b", 1, 8192, "full", None, 331.0),
        ("llama3-8b", 1, 8192, "full", Some(16), 2904.0),
        ("llama3-8b", 1, 8192, "selective-op", None, 2973.0),
        ("llama2-13b", 2, 4096, "full", Some(20), 1914.0),
        ("llama2-13b", 2, 4096, "selective-op", None, 1904.0),
        ("llama2-70b", 1, 4096, "selective-op", None, 355.0),
        ("llama2-70b", 2, 4096, "selective-op", None, 0.0),
    ];
    assert_eq!(runs.len(), published.len());
    let torchtitan_estimate = |model: &str, batch: u64, seq: u64, recompute: &str, blocks| {
        let mut args = vec![
            "--model",
            &format!("models/{model}.json"),
            "--cluster",
            "dgx-a100:8",
            "--tp",
            "1",
            "--pp",
            "1",
            "--dp",
            "64",
            "--mbs",
            &batch.to_string(),
            "--gbs",
            &(64 * batch).to_string(),
            "--seq",
            &seq.to_string(),
            "--zero",
            "3",
            "--recompute",
            recompute,
            "--runtime",
            "torchtitan",
            "--memory-headroom",
            "0",
        ]
        .into_iter()
        .map(String::from)
        .collect::<Vec<_>>();
        if let Some(n) = blocks {
            args.extend(["--recompute-num-layers".into(), format!("{n}")]);
        }
        estimate_time(&ws, &args)
    };
    for (run, (model, batch, seq, recompute, blocks, wps)) in runs.iter().zip(published) {
        assert_eq!(run["model"], format!("models/{model}.json"));
        assert_eq!(run["layout"]["recompute"], recompute);
        assert_eq!(run["recompute_layers"].as_u64(), blocks);
        if wps == 0.0 {
            assert!(run["measured_oom"].as_bool().expect("bool"), "{model}");
            assert!(run["predicted_oom"].as_bool().expect("bool"), "{model}");
            continue;
        }
        let got = number(&run["measured_step_time_s"]);
        let want = (batch * seq) as f64 / wps;
        assert!((got / want - 1.0).abs() < 1e-3, "{model}: {got}");
        let predicted = number(&run["predicted_step_time_s"]);
        let estimated = torchtitan_estimate(model, batch, seq, recompute, blocks);
        assert_eq!(predicted, estimated, "{model} {recompute} {blocks:?}");
        // Half the (identical) blocks recomputed on one stage: halfway between none and all
        // in time.
        if blocks.is_some() {
            let none = torchtitan_estimate(model, batch, seq, "none", None);
            let full = torchtitan_estimate(model, batch, seq, "full", None);
            let half = (none + full) / 2.0;
            assert!(
                (predicted / half - 1.0).abs() < 1e-9,
                "{model}: {predicted} vs {half}"
            );
        }
    }

    // The goal for time is a mean |error| of at most 10% per dataset. The Megatron
    // datasets meet it; MosaicML's small models and torchtitan's runs with little or no
    // recomputation do not yet (printed, not asserted).
    for (name, v) in [
        ("megatron-2021-table1", &megatron),
        ("mosaicml-mpt", &mosaic),
        ("korthikanti-2022", &korthikanti),
        ("torchtitan-a100", &torchtitan),
    ] {
        println!(
            "{name}: mean |time error| {:.1}%, OOM agreement {}",
            number(&v["mean_abs_error"]) * 100.0,
            v["oom_agreement"]
        );
        assert_eq!(
            v["oom_agreement"], 1.0,
            "{name}: every out-of-memory verdict agrees"
        );
    }
    assert!(number(&megatron["mean_abs_error"]) <= 0.10);
    assert!(number(&korthikanti["mean_abs_error"]) <= 0.10);
}

/// NeMo's published FP8 runs on DGX H100 (NeMo 24.09): each is priced as `estimate --fp8`
/// prices its layout with the nemo runtime and bf16 gradients, the step times follow from the
/// published tokens per second, and the mean |error| meets the goal of 10% (7.5%, with the
/// backward products' split accumulator priced). Without FP8
/// products every run would be predicted slower; with tensor parallelism, without the
/// userbuffers NeMo's recipes turn on, too.
#[test]
fn nemo_fp8_runs_are_priced_with_fp8_products() {
    let ws = TempWorkspace::default_copy();
    let v = validate(&ws, &dataset("nemo-h100-fp8.csv"));
    let runs = v["runs"].as_array().expect("runs");
    // (model, GPUs, gbs, mbs, seq, tp, pp, cp, vp, tokens/s/GPU): the 24.09 table.
    let published = [
        (
            "gpt3-5b", 64u64, 2048u64, 4u64, 2048u64, 1u64, 1u64, 1u64, 1u64, 23406.0,
        ),
        ("gpt3-20b", 64, 256, 2, 2048, 2, 1, 1, 1, 5851.0),
        ("gpt3-175b", 128, 256, 1, 2048, 4, 8, 1, 6, 716.0),
        ("gpt3-175b", 512, 2048, 2, 2048, 4, 8, 1, 6, 825.0),
        ("llama2-7b", 8, 128, 1, 4096, 1, 1, 1, 1, 16934.0),
        ("llama2-13b", 16, 128, 1, 4096, 1, 4, 1, 10, 8715.0),
        ("llama2-70b", 64, 128, 1, 4096, 4, 4, 1, 20, 1728.0),
        ("llama3-8b", 8, 128, 1, 8192, 1, 1, 2, 1, 12273.0),
        ("llama3-70b", 64, 128, 1, 8192, 4, 4, 2, 5, 1524.0),
    ];
    assert_eq!(runs.len(), published.len());
    let mut exposed_times = Vec::new();
    for (run, (model, gpus, gbs, mbs, seq, tp, pp, cp, vp, tps)) in runs.iter().zip(published) {
        let got = number(&run["measured_step_time_s"]);
        let want = (gbs * seq) as f64 / (tps * gpus as f64);
        assert!((got / want - 1.0).abs() < 1e-3, "{model}: {got} vs {want}");
        let mut args: Vec<String> = [
            "--model",
            &format!("models/{model}.json"),
            "--cluster",
            &format!("dgx-h100:{}", gpus / 8),
            "--tp",
            &tp.to_string(),
            "--pp",
            &pp.to_string(),
            "--cp",
            &cp.to_string(),
            "--vp",
            &vp.to_string(),
            "--mbs",
            &mbs.to_string(),
            "--gbs",
            &gbs.to_string(),
            "--seq",
            &seq.to_string(),
            "--zero",
            "1",
            "--runtime",
            "nemo",
            "--grad-reduce-in-fp32",
            "false",
            "--memory-headroom",
            "0",
        ]
        .map(String::from)
        .to_vec();
        if tp > 1 {
            args.push("--sp".into());
        }
        let bf16 = estimate_time(&ws, &args);
        args.push("--fp8".into());
        let predicted = number(&run["predicted_step_time_s"]);
        assert_eq!(
            predicted,
            estimate_time(&ws, &args),
            "{model} on {gpus} GPUs"
        );
        assert!(predicted < bf16, "{model} on {gpus} GPUs: FP8 is no faster");
        if tp > 1 {
            args.extend(["--tp-comm-overlap".into(), "false".into()]);
            let exposed = estimate_time(&ws, &args);
            assert!(
                predicted < 0.97 * exposed,
                "{model} on {gpus} GPUs: userbuffers hide nothing ({predicted} vs {exposed})"
            );
            exposed_times.push(exposed);
        } else {
            exposed_times.push(predicted);
        }
    }
    // A runs file's `tp_comm_overlap` column wins over the runtime's.
    let e = validate_with_false(&ws, "nemo-h100-fp8.csv", "tp_comm_overlap");
    for (run, want) in e["runs"]
        .as_array()
        .expect("runs")
        .iter()
        .zip(&exposed_times)
    {
        assert_eq!(number(&run["predicted_step_time_s"]), *want, "{run}");
    }
    println!(
        "nemo-h100-fp8: mean |time error| {:.1}%",
        number(&v["mean_abs_error"]) * 100.0
    );
    assert_eq!(v["oom_agreement"], 1.0);
    assert!(number(&v["mean_abs_error"]) <= 0.10);
}

/// torchtitan's H100 runs publish peak memory: each is predicted with torchtitan's unfused
/// fp32 loss, whose backward holds two fp32 logit-sized gradients beside the saved
/// log-probabilities, and lands within 15% of the measured peak (12% below it today: the
/// caching allocator's reserve is not modelled).
#[test]
fn torchtitan_h100_memory_counts_the_fp32_loss() {
    let ws = TempWorkspace::default_copy();
    let v = validate(&ws, &dataset("torchtitan-h100.csv"));
    let runs = v["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 2);
    // Llama 3.1 8B: local batch 2 x 8192 tokens x a vocabulary of 128,256, one fp32 each.
    let logits_fp32 = 2.0 * 8192.0 * 128_256.0 * 4.0;
    for (run, (gpus, measured)) in runs.iter().zip([(8u64, 82.4), (128, 67.0)]) {
        assert_eq!(number(&run["measured_memory_gib"]), measured);
        let predicted = number(&run["predicted_memory_gib"]);
        let error = predicted / measured - 1.0;
        println!(
            "torchtitan-h100, {gpus} GPUs: {predicted:.1} GiB against {measured} GiB ({:+.1}%)",
            error * 100.0
        );
        assert!(
            error.abs() <= 0.15,
            "{gpus} GPUs: {predicted} GiB against {measured} GiB"
        );
        let memory = |runtime: &str, extra: &[&str]| {
            let dp = gpus.to_string();
            let gbs = (2 * gpus).to_string();
            let cluster = format!("dgx-h100:{}", gpus / 8);
            let r = ws.run(
                &[
                    "estimate",
                    "--model",
                    "models/llama3-8b.json",
                    "--cluster",
                    &cluster,
                    "--dp",
                    &dp,
                    "--mbs",
                    "2",
                    "--gbs",
                    &gbs,
                    "--seq",
                    "8192",
                    "--zero",
                    "3",
                    "--recompute",
                    "selective-op",
                    "--runtime",
                    runtime,
                    "--grad-reduce-in-fp32",
                    "true",
                    "--memory-headroom",
                    "0",
                    "--json",
                ]
                .into_iter()
                .chain(extra.iter().copied())
                .collect::<Vec<_>>(),
            );
            assert_eq!(r.code, 0, "{}", r.stderr);
            r.json()["memory"].clone()
        };
        let (titan, megatron) = (memory("torchtitan", &[]), memory("megatron-core", &[]));
        // The loss given explicitly wins over the runtime's.
        let unfused = memory("megatron-core", &["--fp32-loss", "true"]);
        let fused = memory("torchtitan", &["--fp32-loss", "false"]);
        assert_eq!(unfused["workspace"], titan["workspace"]);
        assert_eq!(fused["workspace"], megatron["workspace"]);
        let gib = f64::from(1u32 << 30);
        assert!((number(&titan["total"]) / gib - predicted).abs() < 0.05 + 1e-9 * predicted);
        // The fused loss (Megatron-LM's) overwrites its saved softmax with the gradient; the
        // unfused one needs two more fp32 logit-sized tensors at its backward.
        assert!(number(&titan["workspace"]) >= 2.0 * logits_fp32);
        assert!(number(&megatron["workspace"]) < 2.0 * logits_fp32);
        assert!(number(&titan["total"]) - number(&megatron["total"]) >= logits_fp32);
    }
    // A runs file's `fp32_loss` and `eager_elementwise` columns win over the runtime's too.
    let with_column = |column: &str| validate_with_false(&ws, "torchtitan-h100.csv", column);
    let f = with_column("fp32_loss");
    for (unfused, fused) in runs.iter().zip(f["runs"].as_array().expect("runs")) {
        let saved =
            number(&unfused["predicted_memory_gib"]) - number(&fused["predicted_memory_gib"]);
        assert!(saved * f64::from(1u32 << 30) >= logits_fp32, "{saved} GiB");
    }
    // torchtitan's eager norms, rotary embeddings and SwiGLU cost time, not memory.
    let f = with_column("eager_elementwise");
    for (eager, fused) in runs.iter().zip(f["runs"].as_array().expect("runs")) {
        let time = |r: &serde_json::Value| number(&r["predicted_step_time_s"]);
        assert!(time(eager) > 1.05 * time(fused), "{eager} vs {fused}");
        assert_eq!(
            eager["predicted_memory_gib"], fused["predicted_memory_gib"],
            "{eager} vs {fused}"
        );
    }
}

/// Layers and hidden size of a model file of the repository.
fn model_shape(file: &str) -> (f64, f64) {
    let text = std::fs::read_to_string(repo_root().join("models").join(file)).expect("model");
    let j: serde_json::Value = serde_json::from_str(&text).expect("json");
    (number(&j["n_layer"]), number(&j["n_embd"]))
}

const RUNS: &str = "\
# four layouts of LLaMA-2 7B on one node; the tp1 one does not fit (118 GiB predicted)
model,cluster,tp,pp,dp,mbs,gbs,step_time_s,memory_gib
llama2-7b,a100-80g:1x8,8,1,1,1,8,1.0,20.0
llama2-7b,a100-80g:1x8,4,1,2,1,8,oom,
llama2-7b,a100-80g:1x8,1,1,8,1,8,oom,
llama2-7b,a100-80g:1x8,2,1,4,1,8,0.9,60
gpt-22b,a100-80g:1x8,8,1,1,4,4,1.3,
";

/// The summary figures are what the runs' own numbers give: mean |error| of time and memory,
/// the OOM verdicts, Spearman per (model, cluster) group; JSON lines read like CSV.
#[test]
fn figures_follow_from_the_runs() {
    let ws = TempWorkspace::default_copy();
    ws.write("runs.csv", RUNS);
    let v = validate(&ws, "runs.csv");
    let runs = v["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 5);
    assert_eq!(
        runs.iter()
            .map(|r| r["line"].as_u64().unwrap_or(0))
            .collect::<Vec<_>>(),
        vec![3, 4, 5, 6, 7]
    );
    // Predicted OOM: only the tp1 layout (weights, gradients and Adam of 7B on one GPU).
    let predicted: Vec<bool> = runs.iter().map(|r| r["predicted_oom"] == true).collect();
    assert_eq!(predicted, vec![false, false, true, false, false]);
    // Measured OOM on lines 4 and 5: line 4 disagrees, the other four agree.
    assert_eq!(v["oom_agreement"], 4.0 / 5.0);

    let times: Vec<f64> = runs
        .iter()
        .filter_map(|r| r["time_error"].as_f64())
        .collect();
    assert_eq!(times.len(), 3);
    let mean = times.iter().map(|e| e.abs()).sum::<f64>() / 3.0;
    assert!((number(&v["mean_abs_error"]) - mean).abs() < 1e-12);
    let mem: Vec<f64> = runs
        .iter()
        .filter_map(|r| r["memory_error"].as_f64())
        .collect();
    assert_eq!(mem.len(), 2);
    for r in runs.iter().filter(|r| !r["memory_error"].is_null()) {
        let want = number(&r["predicted_memory_gib"]) / number(&r["measured_memory_gib"]) - 1.0;
        assert!((number(&r["memory_error"]) - want).abs() < 1e-12);
    }
    let mean_mem = mem.iter().map(|e| e.abs()).sum::<f64>() / 2.0;
    assert!((number(&v["memory_mean_abs_error"]) - mean_mem).abs() < 1e-12);

    // Groups: LLaMA with its two runs that ran (no correlation below three), the 22B with one.
    let groups = v["spearman"].as_array().expect("groups");
    assert_eq!(groups.len(), 2);
    assert_eq!(groups[0]["model"], "llama2-7b");
    assert_eq!(groups[0]["runs"], 2);
    assert!(groups[0]["spearman"].is_null());

    // A third run that ran gives the group a correlation, computed on time per token.
    ws.write(
        "runs.csv",
        &format!("{RUNS}llama2-7b,a100-80g:1x8,2,1,4,1,16,2.1,\n"),
    );
    let v = validate(&ws, "runs.csv");
    let runs = v["runs"].as_array().expect("runs");
    let llama: Vec<&serde_json::Value> = runs
        .iter()
        .filter(|r| r["model"] == "llama2-7b" && !r["measured_step_time_s"].is_null())
        .collect();
    let per_token = |r: &serde_json::Value, key: &str| {
        number(&r[key]) / (number(&r["layout"]["global_batch"]) * number(&r["seq"]))
    };
    let measured: Vec<f64> = llama
        .iter()
        .map(|r| per_token(r, "measured_step_time_s"))
        .collect();
    let predicted: Vec<f64> = llama
        .iter()
        .map(|r| per_token(r, "predicted_step_time_s"))
        .collect();
    let want = spearman(&predicted, &measured).expect("three runs");
    assert_eq!(v["spearman"][0]["runs"], 3);
    assert!((number(&v["spearman"][0]["spearman"]) - want).abs() < 1e-12);

    // The same runs as JSON lines.
    let mut jsonl = String::new();
    for line in RUNS.lines().skip(2) {
        let cells: Vec<&str> = line.split(',').collect();
        let mut obj = serde_json::json!({
            "model": cells[0], "cluster": cells[1],
            "tp": cells[2].parse::<u64>().unwrap_or(0),
            "pp": 1, "dp": cells[4].parse::<u64>().unwrap_or(0),
            "mbs": cells[5].parse::<u64>().unwrap_or(0),
            "gbs": cells[6].parse::<u64>().unwrap_or(0),
        });
        obj["step_time_s"] = match cells[7].parse::<f64>() {
            Ok(t) => t.into(),
            Err(_) => "oom".into(),
        };
        if let Ok(m) = cells[8].parse::<f64>() {
            obj["memory_gib"] = m.into();
        }
        jsonl += &format!("{obj}\n");
    }
    ws.write("runs.jsonl", &jsonl);
    ws.write("runs.csv", RUNS);
    let from_csv = validate(&ws, "runs.csv");
    let from_json = validate(&ws, "runs.jsonl");
    for (a, b) in from_csv["runs"]
        .as_array()
        .into_iter()
        .flatten()
        .zip(from_json["runs"].as_array().into_iter().flatten())
    {
        assert_eq!(a["predicted_step_time_s"], b["predicted_step_time_s"]);
        assert_eq!(a["measured_oom"], b["measured_oom"]);
    }
    assert_eq!(from_csv["oom_agreement"], from_json["oom_agreement"]);

    // The text report carries the same figures.
    let r = ws.run(&["validate", "runs.csv"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stdout
            .contains("out-of-memory verdicts agree on 4 of 5 runs (80%)"),
        "{}",
        r.stdout
    );
    assert!(r.stdout.contains("mean |time error|"), "{}", r.stdout);
}

/// A bad file is an input error (exit 2) naming file, line, field, expected and found.
#[test]
fn bad_runs_files_are_located_input_errors() {
    let ws = TempWorkspace::default_copy();
    let header = "model,cluster,tp,pp,dp,mbs,gbs,step_time_s\n";
    for (body, want) in [
        (
            "llama2-7b,a100-80g:1x8,3,1,1,1,8,1.0\n",
            "runs.csv:2: field `layout`: expected a layout that runs the model on the cluster, found tp x pp x dp = 3 x 1 x 1 = 3, but the cluster has 8 GPUs",
        ),
        (
            "llama2-7b,a100-80g:1x8,8,1,1,1,8,1.0\nllama9,a100-80g:1x8,8,1,1,1,8,1.0\n",
            "runs.csv:3: field `model`: expected a workspace model or a model file, found `llama9`",
        ),
        (
            "llama2-7b,v100:1x8,8,1,1,1,8,1.0\n",
            "runs.csv:2: field `cluster`: expected a workspace cluster, PRESET:NODESxGPUS or NODE-PRESET:NODES, found `v100:1x8`",
        ),
        (
            "llama2-7b,a100-80g:1x8,8,1,1,1,8,-1\n",
            "runs.csv:2: field `step_time_s`: expected seconds > 0, or oom, found `-1`",
        ),
    ] {
        ws.write("runs.csv", &format!("{header}{body}"));
        let r = ws.run(&["validate", "runs.csv"]);
        assert_eq!(r.code, 2, "{body}: {}", r.stderr);
        assert!(
            r.stderr.contains(want),
            "{body}\n  gave {}\n  want {want}",
            r.stderr
        );
        assert!(!r.stderr.contains("panicked"), "{}", r.stderr);
    }
    // Blocks recomputed without full recomputation.
    ws.write(
        "runs.csv",
        "model,cluster,tp,pp,dp,mbs,gbs,recompute,recompute_layers,step_time_s\n\
         llama2-7b,a100-80g:1x8,8,1,1,1,8,selective-op,4,1.0\n",
    );
    let r = ws.run(&["validate", "runs.csv"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    let want = "runs.csv:2: field `recompute_layers`: expected nothing unless `recompute` is full, \
                found `4` with recompute selective-op";
    assert!(r.stderr.contains(want), "{}", r.stderr);
    let r = ws.run(&["validate", "missing.csv"]);
    assert_eq!(r.code, 2);
    assert!(r.stderr.contains("cannot read missing.csv"), "{}", r.stderr);
}
