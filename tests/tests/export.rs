//! `autopar export`: every framework's file parses with a real parser (TOML, YAML, JSON) or
//! names every argument, and states the plan's degrees and batch arithmetic; what a framework
//! cannot express is an error naming it.

use autopar_tests::TempWorkspace;
use serde_json::Value;

/// The default workspace with three more Megatron-LM layouts of tiny-llama on one 8-GPU node.
fn workspace() -> TempWorkspace {
    let ws = TempWorkspace::default_copy();
    let mut toml = ws.read("workspace.toml");
    for (name, search) in [
        // tp2 pp2 dp2 without ZeRO: every framework can run it.
        (
            "plain",
            "tp = [2]\npp = [2]\ninterleave = [1]\nsequence_parallel = [true]\nzero = [0]\nmicro_batch = [2]\nrecompute = [\"full\"]",
        ),
        // FSDP: tp1 pp1 dp8 with ZeRO-3.
        (
            "fsdp",
            "tp = [1]\npp = [1]\nzero = [3]\nmicro_batch = [1]\nrecompute = [\"none\"]",
        ),
        // Stages that cannot split evenly: 4 blocks over 3 stages.
        (
            "uneven",
            "tp = [2]\npp = [3]\ninterleave = [1]\nsequence_parallel = [true]\nzero = [0]\nmicro_batch = [1]",
        ),
    ] {
        toml.push_str(&format!(
            "\n[[target]]\nname = \"{name}\"\nmodel = \"tiny-llama\"\ncluster = \"dgx-h100-1\"\n\
             global_batch = 48\nseq_len = 128\nspace = \"megatron\"\n[target.search]\n{search}\n"
        ));
    }
    // pp3 needs a GPU count divisible by 3 x tp: a 6-GPU node.
    toml = toml.replacen(
        "name = \"uneven\"\nmodel = \"tiny-llama\"\ncluster = \"dgx-h100-1\"",
        "name = \"uneven\"\nmodel = \"tiny-llama\"\ncluster = \"six\"",
        1,
    );
    toml.push_str(
        "\n[[cluster]]\nname = \"six\"\npreset = \"h100-sxm\"\nnodes = 1\ngpus_per_node = 6\n",
    );
    ws.write("workspace.toml", &toml);
    let b = ws.run(&[
        "build",
        "plain",
        "fsdp",
        "uneven",
        "tiny-llama-3d",
        "tiny-llama-cpu-2d",
    ]);
    assert_eq!(b.code, 0, "{}", b.stderr);
    ws
}

fn plan(ws: &TempWorkspace, target: &str) -> Value {
    serde_json::from_str(&ws.read(&format!("plans/{target}.json"))).expect("plan")
}

fn export(ws: &TempWorkspace, target: &str, format: &str) -> autopar_tests::Run {
    ws.run(&["export", target, "--format", format])
}

/// The value after `--name` in a script, one argument per line.
fn arg<'a>(script: &'a str, name: &str) -> Option<&'a str> {
    script.lines().find_map(|l| {
        let l = l.trim().trim_end_matches('\\').trim();
        l.strip_prefix(&format!("--{name} "))
    })
}

fn has_flag(script: &str, name: &str) -> bool {
    script
        .lines()
        .any(|l| l.trim().trim_end_matches('\\').trim() == format!("--{name}"))
}

#[test]
fn every_framework_states_the_plans_layout() {
    let ws = workspace();
    let p = plan(&ws, "plain");
    let l = &p["estimate"]["layout"];
    let (tp, pp, dp) = (l["tp"].as_u64(), l["pp"].as_u64(), l["dp"].as_u64());
    let (mb, gb) = (l["micro_batch"].as_u64(), l["global_batch"].as_u64());
    assert_eq!((tp, pp, dp), (Some(2), Some(2), Some(2)), "{l}");

    // Megatron-LM: the plan's own arguments, one per line, after torchrun's.
    let m = export(&ws, "plain", "megatron");
    assert_eq!(m.code, 0, "{}", m.stderr);
    assert!(
        m.stdout.starts_with("#!/usr/bin/env bash\n"),
        "{}",
        m.stdout
    );
    assert_eq!(arg(&m.stdout, "nproc-per-node"), Some("8"));
    assert_eq!(arg(&m.stdout, "tensor-model-parallel-size"), Some("2"));
    assert_eq!(arg(&m.stdout, "pipeline-model-parallel-size"), Some("2"));
    assert_eq!(arg(&m.stdout, "micro-batch-size"), Some("2"));
    assert_eq!(arg(&m.stdout, "global-batch-size"), Some("48"));
    assert!(has_flag(&m.stdout, "sequence-parallel"));
    let plan_args: Vec<&str> = p["megatron_args"]
        .as_array()
        .expect("args")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    for a in plan_args.iter().filter(|a| a.starts_with("--")) {
        assert!(
            m.stdout.lines().any(|l| l.trim().starts_with(a)),
            "{a} in {}",
            m.stdout
        );
    }

    // NeMo: the Megatron-Core model YAML.
    let n = export(&ws, "plain", "nemo");
    assert_eq!(n.code, 0, "{}", n.stderr);
    let y: Value = yaml_serde::from_str(&n.stdout).expect("NeMo YAML parses");
    let model = &y["model"];
    assert_eq!(model["tensor_model_parallel_size"].as_u64(), tp);
    assert_eq!(model["pipeline_model_parallel_size"].as_u64(), pp);
    assert_eq!(model["virtual_pipeline_model_parallel_size"], Value::Null);
    assert_eq!(model["micro_batch_size"].as_u64(), mb);
    assert_eq!(model["global_batch_size"].as_u64(), gb);
    assert_eq!(model["sequence_parallel"], true);
    assert_eq!(model["num_layers"], 4);
    assert_eq!(model["num_query_groups"], 2);
    // Recomputation as the plan balanced it (none, selective or full).
    let recompute = l["recompute"].as_str().unwrap_or("");
    match recompute {
        "none" => assert_eq!(model["activations_checkpoint_granularity"], Value::Null),
        other => assert_eq!(model["activations_checkpoint_granularity"], other),
    }
    assert_eq!(model["optim"]["name"], "fused_adam");
    let devices = y["trainer"]["devices"].as_u64().unwrap_or(0)
        * y["trainer"]["num_nodes"].as_u64().unwrap_or(0);
    assert_eq!(
        Some(devices),
        tp.zip(pp).zip(dp).map(|((a, b), c)| a * b * c)
    );

    // torchtitan: the job TOML; DDP over the 2 replicas, a 1F1B pipeline split at a block.
    let t = export(&ws, "plain", "torchtitan");
    assert_eq!(t.code, 0, "{}", t.stderr);
    let job: toml::Table = t.stdout.parse().expect("torchtitan TOML parses");
    let par = &job["parallelism"];
    let int = |v: &toml::Value| v.as_integer().map(|i| i as u64);
    assert_eq!(int(&par["data_parallel_replicate_degree"]), dp);
    assert_eq!(int(&par["data_parallel_shard_degree"]), Some(1));
    assert_eq!(int(&par["tensor_parallel_degree"]), tp);
    assert_eq!(int(&par["pipeline_parallel_degree"]), pp);
    assert_eq!(par["pipeline_parallel_schedule"].as_str(), Some("1F1B"));
    assert_eq!(int(&par["pipeline_parallel_microbatch_size"]), mb);
    assert_eq!(
        par["pipeline_parallel_split_points"]
            .as_array()
            .map(|a| a.iter().filter_map(toml::Value::as_str).collect::<Vec<_>>()),
        Some(vec!["layers.2"])
    );
    let train = &job["training"];
    assert_eq!(int(&train["global_batch_size"]), gb);
    // A step's batch per data-parallel rank, cut into the pipeline's micro-batches.
    assert_eq!(
        int(&train["local_batch_size"]),
        gb.zip(dp).map(|(g, d)| g / d)
    );
    assert_eq!(int(&train["seq_len"]), Some(128));
    assert_eq!(
        job["activation_checkpoint"]["mode"].as_str(),
        Some(recompute)
    );

    // DeepSpeed: train_batch_size = micro-batch x accumulation x dp.
    let d = export(&ws, "plain", "deepspeed");
    assert_eq!(d.code, 0, "{}", d.stderr);
    let cfg: Value = serde_json::from_str(&d.stdout).expect("DeepSpeed JSON parses");
    let acc = cfg["gradient_accumulation_steps"].as_u64();
    assert_eq!(cfg["train_micro_batch_size_per_gpu"].as_u64(), mb);
    assert_eq!(
        cfg["train_batch_size"].as_u64(),
        mb.zip(acc).zip(dp).map(|((m, a), d)| m * a * d)
    );
    assert_eq!(cfg["train_batch_size"].as_u64(), gb);
    assert_eq!(cfg["zero_optimization"]["stage"], 0);
    assert_eq!(cfg["bf16"]["enabled"], true);
    let md = ws.run(&[
        "export",
        "plain",
        "--format",
        "megatron-deepspeed",
        "--deepspeed-config",
        "conf/ds.json",
    ]);
    assert_eq!(md.code, 0, "{}", md.stderr);
    assert!(has_flag(&md.stdout, "deepspeed"));
    assert_eq!(arg(&md.stdout, "deepspeed_config"), Some("conf/ds.json"));
    assert_eq!(arg(&md.stdout, "zero-stage"), Some("0"));
    assert_eq!(arg(&md.stdout, "pipeline-model-parallel-size"), Some("2"));
    assert_eq!(arg(&md.stdout, "num-key-value-heads"), Some("2"));

    // -o writes the file and says so.
    let o = ws.run(&[
        "export",
        "plain",
        "--format",
        "torchtitan",
        "-o",
        "job.toml",
    ]);
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert_eq!(ws.read("job.toml"), t.stdout);
    assert!(o.stderr.contains("wrote job.toml"), "{}", o.stderr);
}

#[test]
fn fsdp_and_uneven_splits_are_written_as_each_framework_expresses_them() {
    let ws = workspace();
    // ZeRO-3 over 8 ranks: torchtitan's FSDP, DeepSpeed's stage 3; NeMo's config has no
    // ZeRO-3.
    let t = export(&ws, "fsdp", "torchtitan");
    assert_eq!(t.code, 0, "{}", t.stderr);
    let job: toml::Table = t.stdout.parse().expect("TOML");
    assert_eq!(
        job["parallelism"]["data_parallel_shard_degree"].as_integer(),
        Some(8)
    );
    assert_eq!(
        job["parallelism"]["data_parallel_replicate_degree"].as_integer(),
        Some(1)
    );
    assert_eq!(job["activation_checkpoint"]["mode"].as_str(), Some("none"));
    let d = export(&ws, "fsdp", "deepspeed");
    let cfg: Value = serde_json::from_str(&d.stdout).expect("JSON");
    assert_eq!(cfg["zero_optimization"]["stage"], 3);
    let n = export(&ws, "fsdp", "nemo");
    assert_eq!(n.code, 1, "{}", n.stdout);
    assert!(
        n.stderr.contains("nemo cannot express this plan: ZeRO-3"),
        "{}",
        n.stderr
    );

    // Megatron-LM's selective recomputation is not torchtitan's selective checkpointing.
    let toml = ws.read("workspace.toml").replacen(
        "micro_batch = [1]\nrecompute = [\"none\"]",
        "micro_batch = [1]\nrecompute = [\"selective\"]",
        1,
    );
    assert_ne!(toml, ws.read("workspace.toml"));
    ws.write("workspace.toml", &toml);
    let b = ws.run(&["build", "fsdp"]);
    assert_eq!(b.code, 0, "{}", b.stderr);
    assert_eq!(
        plan(&ws, "fsdp")["estimate"]["layout"]["recompute"],
        "selective"
    );
    let t = export(&ws, "fsdp", "torchtitan");
    assert_eq!(t.code, 1, "{}", t.stdout);
    assert!(
        t.stderr
            .contains("torchtitan cannot express this plan: Megatron-LM's selective recomputation"),
        "{}",
        t.stderr
    );

    // 4 blocks over 3 stages: torchtitan's split points, Megatron-LM's pipeline layout; NeMo
    // and DeepSpeed split evenly only.
    let p = plan(&ws, "uneven");
    let t = export(&ws, "uneven", "torchtitan");
    assert_eq!(t.code, 0, "{}", t.stderr);
    let job: toml::Table = t.stdout.parse().expect("TOML");
    let points: Vec<String> = job["parallelism"]["pipeline_parallel_split_points"]
        .as_array()
        .expect("split points")
        .iter()
        .filter_map(|v| v.as_str().map(String::from))
        .collect();
    assert_eq!(points.len(), 2, "{points:?}");
    // Each split point is where a stage's first block is.
    let firsts: Vec<String> = p["estimate"]["stages"]
        .as_array()
        .expect("stages")
        .iter()
        .skip(1)
        .map(|s| {
            format!(
                "layers.{}",
                s["chunks"][0]["first"].as_u64().unwrap_or(0) - 1
            )
        })
        .collect();
    assert_eq!(points, firsts);
    let m = export(&ws, "uneven", "megatron");
    assert!(
        arg(&m.stdout, "pipeline-model-parallel-layout").is_some(),
        "{}",
        m.stdout
    );
    for f in ["nemo", "deepspeed", "megatron-deepspeed"] {
        let r = export(&ws, "uneven", f);
        assert_eq!(r.code, 1, "{f}: {}", r.stdout);
        assert!(
            r.stderr.contains("different numbers of layers"),
            "{f}: {}",
            r.stderr
        );
    }
}

#[test]
fn what_a_framework_lacks_is_named_never_dropped() {
    let ws = workspace();
    // tp2 pp2 v2 sp ZeRO-1 dp2: torchtitan has no ZeRO-1, DeepSpeed no interleaving.
    for (f, says) in [
        ("torchtitan", "ZeRO-1 over 2 data-parallel ranks"),
        ("deepspeed", "2 model chunks per stage"),
        ("megatron-deepspeed", "2 model chunks per stage"),
    ] {
        let r = export(&ws, "tiny-llama-3d", f);
        assert_eq!(r.code, 1, "{f}: {}", r.stdout);
        assert!(
            r.stderr
                .contains(&format!("{f} cannot express this plan: {says}")),
            "{f}: {}",
            r.stderr
        );
        assert!(r.stdout.is_empty());
    }
    let n = export(&ws, "tiny-llama-3d", "nemo");
    let y: Value = yaml_serde::from_str(&n.stdout).expect("YAML");
    assert_eq!(y["model"]["virtual_pipeline_model_parallel_size"], 2);
    assert_eq!(y["model"]["optim"]["name"], "distributed_fused_adam");

    // A plan of the ILP space that Megatron-LM's layouts cannot express is refused, saying
    // why and how to export the best Megatron-LM layout instead.
    let r = export(&ws, "tiny-llama-cpu-2d", "nemo");
    assert_eq!(r.code, 1, "{}", r.stdout);
    assert!(
        r.stderr.contains("ILP pipeline") && r.stderr.contains("--megatron-layout"),
        "{}",
        r.stderr
    );
    let fallback = ws.run(&[
        "export",
        "tiny-llama-cpu-2d",
        "--format",
        "nemo",
        "--megatron-layout",
    ]);
    assert_eq!(fallback.code, 0, "{}", fallback.stderr);
    let y: Value = yaml_serde::from_str(&fallback.stdout).expect("YAML");
    let l = &plan(&ws, "tiny-llama-cpu-2d")["estimate"]["layout"];
    assert_eq!(y["model"]["tensor_model_parallel_size"], l["tp"]);

    // GPT-2 is not one of torchtitan's model classes.
    let b = ws.run(&["build", "gpt2-small"]);
    assert_eq!(b.code, 0, "{}", b.stderr);
    let g = export(&ws, "gpt2-small", "torchtitan");
    assert_eq!(g.code, 1);
    assert!(g.stderr.contains("not LLaMA-shaped"), "{}", g.stderr);

    // Bad input: unknown format, unknown target, no plan built.
    assert_eq!(export(&ws, "plain", "keras").code, 2);
    assert_eq!(export(&ws, "nope", "nemo").code, 2);
    let unbuilt = export(&ws, "llama3-8b", "nemo");
    assert_ne!(unbuilt.code, 0);
    assert!(
        unbuilt.stderr.contains("autopar build llama3-8b"),
        "{}",
        unbuilt.stderr
    );
}

#[test]
fn fp8_plans_export_where_transformer_engine_runs_them() {
    let ws = TempWorkspace::default_copy();
    let mut toml = ws.read("workspace.toml");
    toml.push_str(
        "\n[[target]]\nname = \"fp8\"\nmodel = \"tiny-llama\"\ncluster = \"dgx-h100-1\"\n\
         global_batch = 48\nseq_len = 128\nspace = \"megatron\"\nfp8 = true\n[target.search]\n\
         tp = [2]\npp = [2]\ninterleave = [1]\nsequence_parallel = [true]\nzero = [0]\n\
         micro_batch = [2]\nrecompute = [\"full\"]\n",
    );
    ws.write("workspace.toml", &toml);
    let b = ws.run(&["build", "fp8"]);
    assert_eq!(b.code, 0, "{}", b.stderr);
    let m = export(&ws, "fp8", "megatron");
    assert_eq!(m.code, 0, "{}", m.stderr);
    assert_eq!(arg(&m.stdout, "fp8-format"), Some("hybrid"), "{}", m.stdout);
    assert!(has_flag(&m.stdout, "bf16"), "{}", m.stdout);
    let n = export(&ws, "fp8", "nemo");
    assert_eq!(n.code, 0, "{}", n.stderr);
    let y: Value = yaml_serde::from_str(&n.stdout).expect("YAML");
    assert_eq!(y["model"]["fp8"], true);
    assert_eq!(y["model"]["fp8_hybrid"], true);
    assert_eq!(y["model"]["transformer_engine"], true);
    for f in ["torchtitan", "deepspeed", "megatron-deepspeed"] {
        let r = export(&ws, "fp8", f);
        assert_eq!(r.code, 1, "{f}: {}", r.stdout);
        assert!(
            r.stderr.contains(&format!(
                "{f} cannot express this plan: FP8 training as Transformer Engine runs it"
            )),
            "{f}: {}",
            r.stderr
        );
    }
}

#[test]
fn userbuffers_export_where_transformer_engine_runs_them() {
    let ws = TempWorkspace::default_copy();
    let mut toml = ws.read("workspace.toml");
    toml.push_str(
        "\n[[target]]\nname = \"ub\"\nmodel = \"tiny-llama\"\ncluster = \"dgx-h100-1\"\n\
         global_batch = 48\nseq_len = 128\nspace = \"megatron\"\nruntime = \"nemo\"\n\
         [target.search]\ntp = [2]\npp = [2]\ninterleave = [1]\nsequence_parallel = [true]\n\
         zero = [0]\nmicro_batch = [2]\nrecompute = [\"full\"]\n",
    );
    ws.write("workspace.toml", &toml);
    let b = ws.run(&["build", "ub"]);
    assert_eq!(b.code, 0, "{}", b.stderr);
    let m = export(&ws, "ub", "megatron");
    assert_eq!(m.code, 0, "{}", m.stderr);
    assert!(has_flag(&m.stdout, "tp-comm-overlap"), "{}", m.stdout);
    let n = export(&ws, "ub", "nemo");
    assert_eq!(n.code, 0, "{}", n.stderr);
    let y: Value = yaml_serde::from_str(&n.stdout).expect("YAML");
    assert_eq!(y["model"]["ub_tp_comm_overlap"], true);
    for f in ["torchtitan", "deepspeed", "megatron-deepspeed"] {
        let r = export(&ws, "ub", f);
        assert_eq!(r.code, 1, "{f}: {}", r.stdout);
        assert!(
            r.stderr
                .contains("overlapped with the products by Transformer Engine's userbuffers")
                && r.stderr.contains("tp_comm_overlap = false"),
            "{f}: {}",
            r.stderr
        );
    }
    // Planned without them, the same plan exports to torchtitan.
    ws.write(
        "workspace.toml",
        &toml.replace(
            "runtime = \"nemo\"\n",
            "runtime = \"nemo\"\ntp_comm_overlap = false\n",
        ),
    );
    let b = ws.run(&["build", "ub"]);
    assert_eq!(b.code, 0, "{}", b.stderr);
    let m = export(&ws, "ub", "megatron");
    assert!(!has_flag(&m.stdout, "tp-comm-overlap"), "{}", m.stdout);
    let t = export(&ws, "ub", "deepspeed");
    assert!(!t.stderr.contains("userbuffers"), "{}", t.stderr);
}
