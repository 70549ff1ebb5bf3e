//! The CPU executor: a sharded training step equals the single-device step (loss, every
//! gradient and the updated parameters within 1e-4 relative) under data, tensor, sequence,
//! context, pipeline and interleaved-pipeline parallelism, ZeRO, and their combinations.

use autopar_engine::executor::placement::State;
use autopar_engine::executor::{ExecError, ExecLayout, RunOptions, check, lower, run_program};
use autopar_rules::cost::context_parallel::CpComm;
use autopar_rules::model::graph::Graph;
use autopar_tests::executor::{
    MeshScheme, attach_profile, layout, measured_covers_template, mesh_placements, sharded_states,
    staged_placements, tiny_cpu_target, tiny_gpt, tiny_llama, tiny_moe,
};
use std::collections::BTreeMap;

const OPTS: RunOptions = RunOptions {
    steps: 2,
    seed: 7,
    check: true,
};

fn assert_matches(graph: &Graph, l: &ExecLayout) {
    let prog = lower(graph, l).expect("lowers");
    let (run, report) = check(graph, &prog, &OPTS).expect("runs");
    println!(
        "{:<28} loss {:.6} | loss {:.1e} grad {:.1e} ({}) param {:.1e}",
        l.describe(),
        run.losses[0],
        report.loss_rel,
        report.grad_rel,
        report.worst_grad,
        report.param_rel
    );
    assert!(report.passed, "{}: {report:?}", l.describe());
    assert!(report.compared > 0);
    // The loss of a random model is about ln(vocab).
    assert!(run.losses.iter().all(|l| l.is_finite() && *l > 1.0));
}

/// Fused gradient accumulation (the products add into the gradient of earlier micro-batches)
/// computes the gradients a separate accumulation pass does, on every device of a sharded run
/// with biases and a tied embedding, up to rounding.
#[test]
fn fused_gradient_accumulation_gives_the_same_gradients() {
    let g = tiny_gpt(1, 16, 2);
    let base = layout(1, 2, false, 0, 4, vec![vec![(0, 1)], vec![(2, 3)]]);
    let grads = |fused: bool| {
        let l = ExecLayout {
            grad_accumulation_fusion: fused,
            ..base.clone()
        };
        let reports = run_program(&lower(&g, &l).expect("lowers"), &OPTS).expect("runs");
        reports
            .into_iter()
            .map(|r| r.grads.into_iter().next().expect("first step's gradients"))
            .collect::<Vec<_>>()
    };
    let (fused, separate) = (grads(true), grads(false));
    let mut compared = 0;
    for (a, b) in fused.iter().zip(&separate) {
        assert_eq!(a.len(), b.len());
        for (v, x) in a {
            let y = &b[v].data;
            let diff: f64 = x
                .data
                .iter()
                .zip(y)
                .map(|(p, q)| f64::from(p - q).powi(2))
                .sum();
            let norm: f64 = y.iter().map(|q| f64::from(*q).powi(2)).sum();
            assert!(diff.sqrt() <= 1e-6 * norm.sqrt().max(1e-30), "value {v}");
            compared += 1;
        }
    }
    assert!(compared > 10, "{compared} gradients compared");
}

#[test]
fn llama_data_tensor_and_sequence_parallel() {
    let whole = vec![vec![(0, 5)]];
    let g2 = tiny_llama(1, 32, 2);
    assert_matches(&g2, &layout(2, 1, false, 0, 2, whole.clone()));
    assert_matches(&g2, &layout(1, 2, false, 0, 2, whole.clone()));
    assert_matches(&g2, &layout(1, 2, true, 0, 2, whole.clone()));
    assert_matches(&g2, &layout(2, 2, true, 1, 1, whole));
}

#[test]
fn llama_pipelines_interleaved_and_combined() {
    let g1 = tiny_llama(1, 32, 1);
    assert_matches(
        &g1,
        &layout(1, 1, false, 0, 4, vec![vec![(0, 2)], vec![(3, 5)]]),
    );
    // Interleaved: virtual stages 0..3 are (stage 0, chunk 0), (1, 0), (0, 1), (1, 1).
    let inter = vec![vec![(0, 1), (3, 3)], vec![(2, 2), (4, 5)]];
    assert_matches(&g1, &layout(1, 1, false, 0, 4, inter.clone()));
    let g2 = tiny_llama(2, 32, 2);
    // 8 virtual devices: dp2 x tp2 x pp2, sequence parallel, ZeRO-1.
    assert_matches(
        &g2,
        &layout(2, 2, true, 1, 2, vec![vec![(0, 2)], vec![(3, 5)]]),
    );
    // 8 virtual devices, interleaved.
    assert_matches(&g2, &layout(2, 2, false, 0, 2, inter));
}

#[test]
fn gpt_with_tied_embeddings_biases_and_unfused_attention() {
    let g = tiny_gpt(1, 16, 2);
    assert_matches(&g, &layout(1, 2, false, 0, 2, vec![vec![(0, 3)]]));
    assert_matches(&g, &layout(1, 2, true, 0, 2, vec![vec![(0, 3)]]));
    // The tied embedding lives on the first and the last stage.
    assert_matches(
        &g,
        &layout(2, 2, true, 1, 2, vec![vec![(0, 1)], vec![(2, 3)]]),
    );
}

#[test]
fn megatron_collectives_per_block() {
    let g = tiny_llama(1, 32, 2);
    let plain = lower(
        &g,
        &layout(
            1,
            2,
            false,
            0,
            1,
            vec![vec![(0, 0)], vec![(1, 1)], vec![(2, 5)]],
        ),
    )
    .expect("lowers");
    // One block on its own stage: 2 all-reduces forward (attention and MLP outputs) and 2
    // backward (their inputs' gradients), nothing else (Megatron-LM, Shoeybi et al. 2019).
    let c = plain.collectives(1);
    assert_eq!(c.get("all_reduce"), Some(&4), "{c:?}");
    assert_eq!(c.values().sum::<usize>(), 4, "{c:?}");
    let sp = lower(
        &g,
        &layout(
            1,
            2,
            true,
            0,
            1,
            vec![vec![(0, 0)], vec![(1, 1)], vec![(2, 5)]],
        ),
    )
    .expect("lowers");
    // Sequence parallel: each all-reduce becomes an all-gather and a reduce-scatter. The
    // gradients of the two norms' gains, computed on a slice of the sequence, stay partial
    // sums through the micro-batches and are all-reduced once per step, as Megatron-LM's
    // layer-norm gradient all-reduce does.
    let c = sp.collectives(1);
    assert_eq!(c.get("all_gather"), Some(&4), "{c:?}");
    assert_eq!(c.get("reduce_scatter"), Some(&4), "{c:?}");
    assert_eq!(c.values().sum::<usize>(), 8, "{c:?}");
    let partial: Vec<&str> = sp.chunks[1]
        .parameters
        .iter()
        .map(|&p| &sp.values[p as usize])
        .filter(|v| {
            v.grad_placement
                .as_ref()
                .is_some_and(|g| g.0[0] == State::Partial)
        })
        .map(|v| v.name.as_str())
        .collect();
    assert_eq!(partial.len(), 2, "{partial:?}");
    assert!(partial.iter().all(|n| n.contains("norm")), "{partial:?}");
}

/// `layout` with every sequence split over `cp` ranks exchanging keys and values by `comm`
/// (`a2a+p2p`: a ring of all-to-all groups of 2).
fn with_cp(layout: ExecLayout, cp: usize, comm: CpComm) -> ExecLayout {
    ExecLayout {
        cp,
        cp_comm: comm,
        cp_a2a: 2,
        ..layout
    }
}

/// Context parallelism: every sequence stored in load-balanced order (rank r holds chunks r and
/// 2cp-1-r), attention as a ring of key/value blocks (p2p; cp 2 and 4), Ulysses' all-to-alls
/// (a2a), all-gathered keys and values (allgather), or a ring of 2 Ulysses groups of 2
/// (a2a+p2p); alone, and with tensor and sequence, pipeline and data parallelism and ZeRO.
#[test]
fn context_parallel_attention_matches_one_device() {
    let whole = vec![vec![(0, 5)]];
    let g1 = tiny_llama(1, 64, 1);
    // Outside the attention core every op works on its rank's tokens: the only collectives
    // that are not inside the core's kernel are the core's own (per block, forward and
    // backward) and the loss's sum (along each mesh axis that splits sequences).
    let per_block = |name: &str, n: usize| (name.to_string(), 4 * n);
    for (cp, comm, core) in [
        (2, CpComm::P2p, vec![]),
        (4, CpComm::P2p, vec![]),
        (2, CpComm::A2a, vec![per_block("all_to_all", 8)]),
        (4, CpComm::A2aP2p, vec![per_block("all_to_all", 8)]),
        (
            2,
            CpComm::AllGather,
            vec![per_block("all_gather", 2), per_block("reduce_scatter", 2)],
        ),
    ] {
        let l = with_cp(layout(1, 1, false, 0, 2, whole.clone()), cp, comm);
        let collectives: BTreeMap<String, usize> = lower(&g1, &l)
            .expect("lowers")
            .collectives(0)
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        let mut expected: BTreeMap<String, usize> = core.into_iter().collect();
        let axes = if comm == CpComm::A2aP2p { 2 } else { 1 };
        expected.insert("all_reduce".into(), axes);
        assert_eq!(collectives, expected, "{}", l.describe());
        assert_matches(&g1, &l);
    }
    // 8 virtual devices: tp2 (sequence parallel) x cp2 (ring) x pp2.
    let g2 = tiny_llama(1, 64, 2);
    let stages = vec![vec![(0, 2)], vec![(3, 5)]];
    assert_matches(
        &g2,
        &with_cp(layout(1, 2, true, 0, 2, stages), 2, CpComm::P2p),
    );
    // dp2 x cp2 with ZeRO-1: gradients reduced over both, Ulysses on two heads per rank.
    assert_matches(
        &g1,
        &with_cp(layout(2, 1, false, 1, 1, whole), 2, CpComm::A2a),
    );
}

/// `layout` with `ep` expert-parallel ranks and experts split `etp` ways (the expert group
/// takes whole tensor-parallel groups when etp is 1, then data-parallel ranks).
fn with_ep(layout: ExecLayout, ep: usize, etp: usize) -> ExecLayout {
    ExecLayout { ep, etp, ..layout }
}

/// Mixture of experts (4 experts, top-2, deterministic routing): the router, the dispatch into
/// expert buffers and the gate-weighted combine match one device alone, under tensor and
/// sequence parallelism with the experts whole or split in width (etp), with the experts
/// divided over expert-parallel ranks that are data-parallel ones, tensor-parallel ones
/// (etp 1), or both, combined with pipeline parallelism and ZeRO, and with tokens dropped past
/// the experts' capacity.
#[test]
fn mixture_of_experts_matches_one_device() {
    let whole = vec![vec![(0, 3)]];
    let stages = vec![vec![(0, 1)], vec![(2, 3)]];
    // Dropless, buffers sized for every token (capacity 2 x the balanced share, E / k = 2).
    let g2 = tiny_moe(1, 32, 2, 2.0, false);
    assert_matches(&g2, &with_ep(layout(1, 2, true, 0, 2, whole.clone()), 1, 2));
    assert_matches(&g2, &with_ep(layout(1, 2, true, 0, 2, whole.clone()), 1, 1));
    // ep2: the graph's micro-batch is that of the two data-parallel ranks the mesh holds.
    let g1x2 = tiny_moe(2, 32, 1, 2.0, false);
    let g2x2 = tiny_moe(2, 32, 2, 2.0, false);
    let ep2 = with_ep(layout(1, 1, false, 0, 2, whole.clone()), 2, 1);
    let prog = lower(&g1x2, &ep2).expect("lowers");
    let placed = |name: &str| {
        let v = prog.values.iter().find(|v| v.name == name).expect(name);
        v.placement.0[0].clone()
    };
    // Each expert-parallel rank holds 2 of the 4 experts, and half the batch; dense weights are
    // whole on each.
    assert_eq!(placed("layers.0.experts.fc1.weight").axis(), Some(0));
    assert_eq!(placed("layers.0.attention.qkv.out").axis(), Some(0));
    assert_eq!(placed("layers.0.router.weight"), State::Replicated);
    assert_matches(&g1x2, &ep2);
    assert_matches(&g2x2, &with_ep(layout(1, 2, true, 1, 2, stages), 2, 2));
    // etp 1: the tensor-parallel group splits the experts (ep 2 on tp 2, two replicas), or the
    // tensor-parallel group and two data-parallel ranks (ep 4: one expert per rank).
    assert_matches(&g2, &with_ep(layout(2, 2, true, 1, 2, whole.clone()), 2, 1));
    let ep4 = with_ep(layout(1, 2, true, 0, 2, whole.clone()), 4, 1);
    let prog = lower(&g2x2, &ep4).expect("lowers");
    let fc1 = prog
        .values
        .iter()
        .find(|v| v.name == "layers.0.experts.fc1.weight")
        .expect("expert weight");
    assert_eq!(fc1.placement.local_shape(&fc1.shape, &[2, 2])[0], 1);
    assert_matches(&g2x2, &ep4);
    // Tokens dropped past half the balanced share, the same on every device.
    let dropping = tiny_moe(2, 32, 1, 0.5, true);
    let l = ExecLayout {
        moe_drop: true,
        ..with_ep(layout(1, 1, false, 0, 2, whole), 2, 1)
    };
    assert_matches(&dropping, &l);
}

#[test]
fn layouts_that_cannot_run_are_refused() {
    let g = tiny_llama(1, 32, 4);
    // Two key/value heads do not split four ways.
    let e = lower(&g, &layout(1, 4, false, 0, 1, vec![vec![(0, 5)]])).expect_err("kv heads");
    assert!(
        matches!(&e, ExecError::Lower(m) if m.contains("does not divide 4 ways")),
        "{e}"
    );
    // Chunks must cover the layers in order.
    let e = lower(
        &g,
        &layout(1, 1, false, 0, 1, vec![vec![(0, 2)], vec![(4, 5)]]),
    )
    .expect_err("gap");
    assert!(e.to_string().contains("start at layer 3"), "{e}");
    // Interleaving needs whole rounds of micro-batches.
    let e = lower(
        &g,
        &layout(
            1,
            1,
            false,
            0,
            3,
            vec![vec![(0, 1), (3, 3)], vec![(2, 2), (4, 5)]],
        ),
    )
    .expect_err("rounds");
    assert!(e.to_string().contains("multiple of the 2 stages"), "{e}");
    // Context parallelism: 2 cp chunks of the sequence, heads for Ulysses, a fused core.
    let whole = || layout(1, 1, false, 0, 1, vec![vec![(0, 5)]]);
    let e = lower(&g, &with_cp(whole(), 3, CpComm::P2p)).expect_err("chunks");
    assert!(e.to_string().contains("2 x cp = 6 equal chunks"), "{e}");
    let e = lower(&g, &with_cp(whole(), 4, CpComm::A2a)).expect_err("heads");
    assert!(
        e.to_string().contains("tp x 4 = 4 ranks") && e.to_string().contains("has 2"),
        "{e}"
    );
    let odd = ExecLayout {
        cp_a2a: 3,
        ..with_cp(whole(), 4, CpComm::A2aP2p)
    };
    let e = lower(&g, &odd).expect_err("hierarchical");
    assert!(e.to_string().contains("groups of 3"), "{e}");
    let gpt = tiny_gpt(1, 32, 1);
    let e = lower(
        &gpt,
        &with_cp(
            layout(1, 1, false, 0, 1, vec![vec![(0, 3)]]),
            2,
            CpComm::P2p,
        ),
    )
    .expect_err("unfused");
    assert!(e.to_string().contains("fused attention core"), "{e}");
}

/// The default long-sequence and mixture-of-experts CPU targets run as planned and match one
/// device: ring attention over 4 context-parallel devices, Ulysses over 2, and 2 expert-parallel
/// ranks times 2 tensor-parallel ones.
#[test]
fn default_context_parallel_and_moe_targets_run_and_check() {
    let ws = autopar_tests::TempWorkspace::default_copy();
    let targets = [
        "tiny-llama-cpu-cp",
        "tiny-llama-cpu-ulysses",
        "tiny-moe-cpu",
    ];
    let b = ws.run(&["build", targets[0], targets[1], targets[2]]);
    assert_eq!(b.code, 0, "{}", b.stderr);
    for target in targets {
        let plan: serde_json::Value =
            serde_json::from_str(&ws.read(&format!("plans/{target}.json"))).expect("plan");
        let planned = &plan["estimate"]["layout"];
        let r = ws.run(&["run", target, "--check", "--steps", "2", "--json"]);
        assert_eq!(r.code, 0, "{target}: {}", r.stderr);
        let j = r.json();
        assert_eq!(j["check"]["passed"], true, "{target}: {}", j["check"]);
        let ran = &j["layout"];
        let (devices, expected) = match target {
            "tiny-llama-cpu-cp" => (4, [("cp", 4), ("ep", 1)]),
            "tiny-llama-cpu-ulysses" => (2, [("cp", 2), ("ep", 1)]),
            _ => (4, [("cp", 1), ("ep", 2)]),
        };
        assert_eq!(j["devices"], devices, "{target}");
        for (key, n) in expected {
            assert_eq!(planned[key], n, "{target}: {key}");
            assert_eq!(ran[key], n, "{target}: {key}");
        }
        match target {
            "tiny-llama-cpu-cp" => assert_eq!(ran["cp_comm"], "p2p"),
            "tiny-llama-cpu-ulysses" => assert_eq!(ran["cp_comm"], "a2a"),
            // etp 1: the expert-parallel ranks are the tensor-parallel group, and the two
            // data-parallel replicas stay replicas.
            _ => assert_eq!(
                (&planned["etp"], &planned["dp"], &ran["dp"]),
                (&1.into(), &2.into(), &2.into())
            ),
        }
    }
}

#[test]
fn cli_runs_checks_and_caches_a_plan() {
    let ws = autopar_tests::TempWorkspace::default_copy();
    let mut toml = ws.read("workspace.toml");
    toml.push_str(
        r#"
[[target]]
name = "tiny-test"
model = "tiny-llama"
cluster = "dgx-h100-1"
global_batch = 8
seq_len = 32
space = "both"
[target.search]
tp = [2]
pp = [2]
interleave = [2]
sequence_parallel = [true]
zero = [1]
micro_batch = [1]
"#,
    );
    ws.write("workspace.toml", &toml);
    let b = ws.run(&["build", "tiny-test"]);
    assert_eq!(b.code, 0, "{}", b.stderr);
    let r = ws.run(&["run", "tiny-test", "--check", "--steps", "2", "--json"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let j = r.json();
    assert_eq!(j["devices"], 8);
    assert_eq!(j["program"]["source"], "lowered");
    assert_eq!(j["check"]["passed"], true, "{j}");
    assert_eq!(j["result"]["losses"].as_array().map(Vec::len), Some(2));
    assert!(j["predicted_step_time_s"].as_f64().is_some_and(|t| t > 0.0));
    // The second run of the same plan lowers nothing.
    let again = ws.run(&["run", "tiny-test", "--steps", "1", "--json"]);
    assert_eq!(again.code, 0, "{}", again.stderr);
    assert_eq!(again.json()["program"]["source"], "local");
    assert_eq!(again.json()["program"]["key"], j["program"]["key"]);
    // Text output names the measured and predicted step times.
    let text = ws.run(&["run", "tiny-test", "--steps", "1"]);
    assert!(text.stdout.contains("predicted"), "{}", text.stdout);

    // This plan chose the ILP space's pipeline, one stage on a 1x8 mesh, and that runs: every
    // tensor placed as the plan's specs say (its column- and row-parallel MLP, its
    // vocabulary-parallel embedding and output), checked against one device above.
    let plan: serde_json::Value =
        serde_json::from_str(&ws.read("plans/tiny-test.json")).expect("plan");
    assert_eq!(j["plan_space"], "ilp", "{j}");
    assert_eq!(j["ilp"], plan["spaces"]["ilp"]);
    assert_eq!(j["predicted_step_time_s"], plan["ilp"]["step_time_s"]);
    let placements = j["layout"]["placements"].as_object().expect("placements");
    let mut split = 0;
    for stage in plan["ilp"]["stages"].as_array().expect("stages") {
        for w in stage["parameters"].as_array().expect("weights") {
            let spec = w["weight"].as_str().expect("spec");
            let name = w["name"].as_str().expect("name");
            let placed = &placements[name];
            // On a 1x8 mesh only mesh axis 1 divides: `S1` on axis k is a split of axis k
            // along mesh axis 1.
            assert_eq!(placed[0], "replicated", "{name}: {spec} vs {placed}");
            match spec.find("S1") {
                Some(_) => {
                    let axis = spec.replace("S1", "s").find('s').expect("axis");
                    assert_eq!(
                        placed[1]["split"]["axis"], axis,
                        "{name}: {spec} vs {placed}"
                    );
                    split += 1;
                }
                None => assert_eq!(placed[1], "replicated", "{name}: {spec} vs {placed}"),
            }
        }
    }
    assert!(split > 0, "the plan splits some weights");
    assert!(
        text.stdout.contains("the ILP space's pipeline") && !text.stdout.contains("note"),
        "{}",
        text.stdout
    );
    // The same specs on a 2x4 mesh: the splits over mesh axis 1 now divide 4 ways and mesh
    // axis 0 replicates; the pipeline still runs as planned and checks.
    let mut wide = plan.clone();
    for stage in wide["ilp"]["stages"].as_array_mut().expect("stages") {
        stage["mesh"]["logical"] = serde_json::json!([2, 4]);
    }
    ws.write("wide-plan.json", &wide.to_string());
    let w = ws.run(&[
        "run",
        "--plan",
        "wide-plan.json",
        "--steps",
        "1",
        "--check",
        "--json",
    ]);
    assert_eq!(w.code, 0, "{}", w.stderr);
    let wj = w.json();
    assert_eq!(wj["plan_space"], "ilp");
    assert_eq!(wj["layout"]["meshes"], serde_json::json!([[2, 4]]));
    assert_eq!(wj["check"]["passed"], true, "{wj}");
    // One edited onto more devices than the cluster has is refused, naming the meshes.
    let mut vast = plan.clone();
    for stage in vast["ilp"]["stages"].as_array_mut().expect("stages") {
        stage["mesh"]["logical"] = serde_json::json!([1, 1u64 << 40]);
        stage["mesh"]["submesh"] = serde_json::json!([1, 1u64 << 40]);
    }
    ws.write("vast-plan.json", &vast.to_string());
    let v = ws.run(&["run", "--plan", "vast-plan.json", "--steps", "1", "--json"]);
    assert_eq!(v.code, 2, "{}", v.stderr);
    assert!(
        v.stderr.contains("do not fit the 8 GPUs") && v.stderr.contains("1x1099511627776"),
        "{}",
        v.stderr
    );
    // Plans whose specs cannot run are input errors naming what is wrong.
    let edit = |f: &dyn Fn(&mut serde_json::Value)| {
        let mut p = plan.clone();
        f(&mut p["ilp"]["stages"][0]);
        p
    };
    let cases: Vec<(&str, serde_json::Value, Vec<&str>)> = vec![
        (
            "thirds.json",
            edit(&|s| {
                s["mesh"]["logical"] = serde_json::json!([1, 3]);
                s["mesh"]["submesh"] = serde_json::json!([1, 3]);
            }),
            vec!["does not divide 3 ways", "[R S"],
        ),
        (
            "misfit-mesh.json",
            edit(&|s| s["mesh"]["logical"] = serde_json::json!([2, 2])),
            vec!["logical mesh 2x2 does not lay out the devices of its submesh 1x8"],
        ),
        (
            "bad-spec.json",
            edit(&|s| s["parameters"][0]["weight"] = "S7R".into()),
            vec!["is not a spec", "embedding.word"],
        ),
        (
            "no-specs.json",
            edit(&|s| {
                let ops = s["ops"].as_array_mut().expect("ops");
                ops.retain(|o| o["op"] != "layers.1.attention.qkv");
            }),
            vec!["no specs for op `layers.1.attention.qkv`"],
        ),
    ];
    for (file, p, needles) in cases {
        ws.write(file, &p.to_string());
        let r = ws.run(&["run", "--plan", file, "--steps", "1"]);
        assert_eq!(r.code, 2, "{file}: {}", r.stderr);
        for n in needles {
            assert!(r.stderr.contains(n), "{file}: `{n}` in {}", r.stderr);
        }
    }
    // A plan of the Megatron-LM space runs its layout and says nothing more.
    let mut megatron = plan.clone();
    megatron["space"] = "megatron".into();
    ws.write("megatron-plan.json", &megatron.to_string());
    let m = ws.run(&[
        "run",
        "--plan",
        "megatron-plan.json",
        "--steps",
        "1",
        "--json",
    ]);
    assert_eq!(m.code, 0, "{}", m.stderr);
    assert_eq!(m.json()["plan_space"].as_str(), Some("megatron"));
    assert!(m.json()["ilp"].is_null());
    assert_eq!(m.json()["layout"]["tp"], 2);
    let text = ws.run(&["run", "--plan", "megatron-plan.json", "--steps", "1"]);
    assert!(
        !text.stdout.contains("note") && !text.stdout.contains("ILP"),
        "{}",
        text.stdout
    );

    // No GPU stack here (or no CUDA kernels in this build): exit 2 saying what is missing.
    let cuda = ws.run(&["run", "tiny-test", "--backend", "cuda"]);
    assert_eq!(cuda.code, 2, "{}", cuda.stderr);
    assert!(
        cuda.stderr.contains("CUDA") || cuda.stderr.contains("libcuda"),
        "{}",
        cuda.stderr
    );
    // Bad input: unknown target, missing plan file, no plan built yet.
    assert_eq!(ws.run(&["run", "no-such-target"]).code, 2);
    let missing = ws.run(&["run", "--plan", "missing.json"]);
    assert_eq!(missing.code, 2);
    assert!(missing.stderr.contains("--plan"), "{}", missing.stderr);
    // Plan files that cannot run: not a plan, another schema, edited to a micro-batch the CPU
    // cannot hold, or to a global batch its micro-batches do not make. Each is refused (exit
    // 2) before anything is allocated, saying why.
    // Edits go to the Megatron-LM layout run (`estimate`) where it has the field, in the plan
    // made one of the Megatron-LM space; one edit goes to the ILP pipeline of the plan as built.
    let built = ws.read("plans/tiny-test.json");
    let mut ilp_huge: serde_json::Value = serde_json::from_str(&built).expect("plan");
    ilp_huge["ilp"]["micro_batch"] = 1_000_000.into();
    let plan = built.replacen("\"space\": \"ilp\"", "\"space\": \"megatron\"", 1);
    assert_ne!(plan, built, "the plan chose the ILP space");
    let edit = |pairs: &[(&str, &str)]| {
        pairs.iter().fold(plan.clone(), |text, (from, to)| {
            let estimate = text.find("\"estimate\": {").unwrap_or(0);
            let at = text[estimate..]
                .find(from)
                .map(|i| estimate + i)
                .or_else(|| text.find(from))
                .unwrap_or_else(|| panic!("the plan has {from}"));
            format!("{}{to}{}", &text[..at], &text[at + from.len()..])
        })
    };
    let cases = [
        (
            "not-a-plan.json",
            "{\"steps\": 3}\n".to_string(),
            "found no `schema` field",
        ),
        (
            "old.json",
            edit(&[("\"schema\": 3", "\"schema\": 2")]),
            "plan schema 2 is not 3 (written by another version of autopar); rebuild it with \
             `autopar build tiny-test`",
        ),
        (
            "huge.json",
            edit(&[
                ("\"micro_batch\": 1,", "\"micro_batch\": 1000000,"),
                ("\"global_batch\": 8,", "\"global_batch\": 8000000,"),
            ]),
            "GiB of activations",
        ),
        (
            "retyped.json",
            edit(&[("\"micro_batch\": 1,", "\"micro_batch\": \"one\",")]),
            "field `estimate.layout.micro_batch`: expected u64, found string \"one\"",
        ),
        ("huge-ilp.json", ilp_huge.to_string(), "GiB of activations"),
        (
            "skewed.json",
            edit(&[("\"global_batch\": 8,", "\"global_batch\": 9,")]),
            "inconsistent",
        ),
    ];
    for (file, text, says) in cases {
        ws.write(file, &text);
        let r = ws.run(&["run", "--plan", file]);
        assert_eq!(r.code, 2, "{file}: {}", r.stderr);
        assert!(r.stderr.contains(says), "{file}: {}", r.stderr);
    }
    // A plan the workspace has moved on from is not run against its old prediction.
    let toml = ws.read("workspace.toml");
    let edited = toml.replacen(
        "name = \"tiny-test\"\nmodel = \"tiny-llama\"\ncluster = \"dgx-h100-1\"\nglobal_batch = 8\n",
        "name = \"tiny-test\"\nmodel = \"tiny-llama\"\ncluster = \"dgx-h100-1\"\nglobal_batch = 16\n",
        1,
    );
    assert_ne!(edited, toml, "tiny-test has a global batch of 8");
    ws.write("workspace.toml", &edited);
    let r = ws.run(&["run", "tiny-test", "--steps", "1"]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(
        r.stderr.contains(
            "the plan of `tiny-test` is out of date (search space or global batch changed): \
             run `autopar build tiny-test` first"
        ),
        "{}",
        r.stderr
    );
    // `plan show` still shows it, with a warning.
    let shown = ws.run(&["plan", "show", "tiny-test"]);
    assert_eq!(shown.code, 0, "{}", shown.stderr);
    assert!(
        shown
            .stderr
            .starts_with("warning: the plan of `tiny-test` is out of date")
            && shown.stdout.starts_with("tiny-test: tiny-llama"),
        "{}",
        shown.stderr
    );
    ws.write("workspace.toml", &toml);
    assert_eq!(ws.run(&["run", "tiny-test", "--steps", "1"]).code, 0);
    assert!(ws.run(&["plan", "show", "tiny-test"]).stderr.is_empty());
    let unbuilt = ws.run(&["run", "llama3-8b"]);
    assert_eq!(unbuilt.code, 1);
    assert!(
        unbuilt.stderr.contains("autopar build llama3-8b"),
        "{}",
        unbuilt.stderr
    );
}

#[test]
fn profile_run_measures_what_the_targets_price_and_plans_read_it() {
    let ws = autopar_tests::TempWorkspace::default_copy();
    let mut toml = ws.read("workspace.toml");
    toml.push_str(&tiny_cpu_target("two-threads"));
    ws.write("workspace.toml", &toml);
    let before = ws.run(&["build", "tiny-cpu", "--json"]);
    assert_eq!(before.code, 0, "{}", before.stderr);
    let modelled_step = ws.read("plans/tiny-cpu.json");

    let r = ws.run(&[
        "profile",
        "run",
        "--model",
        "tiny-llama",
        "--cluster",
        "two-threads",
        "-o",
        "measured.json",
        "--json",
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let summary = r.json();
    assert_eq!(summary["device"], "cpu");
    assert_eq!(summary["targets"], serde_json::json!(["tiny-cpu"]));
    assert_eq!(summary["skipped"], serde_json::json!([]), "{summary}");
    assert!(
        summary["fastest_product"]["flops_per_s"]
            .as_f64()
            .is_some_and(|f| f > 0.0)
    );
    // Every kernel and collective the target's search prices (tp 1 and 2) has a positive time.
    let got = measured_covers_template(&ws, "tiny-cpu");
    assert_eq!(got.device, "cpu");
    assert!(
        got.entries()
            .iter()
            .any(|(e, _)| matches!(e, autopar_rules::cost::profile::EntryId::Collective(..))),
        "tensor parallelism over two threads measures collectives"
    );

    // Attached to the cluster, the measurements replace the modelled times.
    let attached = attach_profile(&toml, "two-threads", "measured");
    ws.write("workspace.toml", &attached);
    let after = ws.run(&["build", "tiny-cpu"]);
    assert_eq!(after.code, 0, "{}", after.stderr);
    assert_ne!(ws.read("plans/tiny-cpu.json"), modelled_step);
    let explain = ws.run(&["explain", "tiny-cpu"]);
    assert!(explain.stdout.contains("profile"), "{}", explain.stdout);
    // Running the plan on the CPU compares like with like.
    let run = ws.run(&["run", "tiny-cpu", "--steps", "2", "--json"]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(run.json()["comparable"], true);
    let text = ws.run(&["run", "tiny-cpu", "--steps", "1"]);
    assert!(text.stdout.contains("error "), "{}", text.stdout);

    // Bad input: unknown names, a pair no target trains, no GPU stack.
    let profile_run = |model: &str, extra: &[&str]| {
        let mut args = vec![
            "profile",
            "run",
            "--model",
            model,
            "--cluster",
            "two-threads",
        ];
        args.extend_from_slice(extra);
        ws.run(&args)
    };
    let unknown = profile_run("nope", &[]);
    assert_eq!(unknown.code, 2);
    assert!(
        unknown.stderr.contains("model `nope`"),
        "{}",
        unknown.stderr
    );
    let unpaired = profile_run("gpt2-small", &[]);
    assert_eq!(unpaired.code, 2);
    assert!(
        unpaired.stderr.contains("gpt2-small on two-threads"),
        "{}",
        unpaired.stderr
    );
    let cuda = profile_run("tiny-llama", &["--backend", "cuda"]);
    assert_eq!(cuda.code, 2, "{}", cuda.stderr);
    // An output that cannot be written is refused before anything is measured.
    let onto_dir = profile_run("tiny-llama", &["-o", "profiles"]);
    assert_eq!(onto_dir.code, 2, "{}", onto_dir.stderr);
    assert!(
        onto_dir.stderr.contains("profiles: is a directory") && onto_dir.stdout.is_empty(),
        "{}",
        onto_dir.stderr
    );
}

/// Plans of the intra-op space on two-axis meshes: data x tensor parallelism, 2D weights
/// (each matrix split along both axes, so one axis reduces the product as another splits its
/// output), the roles of the axes swapped, and one tensor axis split over both mesh axes
/// (`S01`, tensor parallelism of 4 on a 2 x 2 mesh).
#[test]
fn two_axis_meshes_match_one_device() {
    let g = tiny_llama(4, 32, 2);
    let schemes = [
        MeshScheme {
            batch: Some(0),
            model: vec![1],
            cross: None,
        },
        MeshScheme {
            batch: None,
            model: vec![1],
            cross: Some(0),
        },
        MeshScheme {
            batch: Some(1),
            model: vec![0],
            cross: None,
        },
    ];
    for scheme in &schemes {
        let l = ExecLayout::on_meshes(
            vec![vec![2, 2]],
            2,
            vec![vec![(0, 5)]],
            mesh_placements(&g, scheme, None),
            Default::default(),
        );
        assert_matches(&g, &l);
    }
    // 2D weights really split on both axes, and the data-parallel split leaves weight
    // gradients partial until the step's synchronisation.
    let two_d = lower(
        &g,
        &ExecLayout::on_meshes(
            vec![vec![2, 2]],
            2,
            vec![vec![(0, 5)]],
            mesh_placements(&g, &schemes[1], None),
            Default::default(),
        ),
    )
    .expect("lowers");
    assert!(two_d.values.iter().any(|v| {
        v.state_placement.is_some() && v.placement.0.iter().all(|s| s.axis().is_some())
    }));
    let dp_tp = lower(
        &g,
        &ExecLayout::on_meshes(
            vec![vec![2, 2]],
            2,
            vec![vec![(0, 5)]],
            mesh_placements(&g, &schemes[0], None),
            Default::default(),
        ),
    )
    .expect("lowers");
    assert!(dp_tp.values.iter().all(|v| {
        v.grad_placement
            .as_ref()
            .is_none_or(|gp| gp.0[0] == State::Partial)
    }));
    let gpt = tiny_gpt(2, 16, 4);
    let s01 = MeshScheme {
        batch: None,
        model: vec![0, 1],
        cross: None,
    };
    assert_matches(
        &gpt,
        &ExecLayout::on_meshes(
            vec![vec![2, 2]],
            2,
            vec![vec![(0, 3)]],
            mesh_placements(&gpt, &s01, None),
            Default::default(),
        ),
    );
}

/// ZeRO inside the mesh: optimizer states sharded over the data-parallel mesh axis, gradients
/// reduce-scattered into them, master weights updated there and all-gathered.
#[test]
fn optimizer_states_sharded_inside_the_mesh() {
    let g = tiny_llama(4, 32, 2);
    let scheme = MeshScheme {
        batch: Some(0),
        model: vec![1],
        cross: None,
    };
    let placements = mesh_placements(&g, &scheme, None);
    let states = sharded_states(&g, &placements, &[2, 2], 0);
    assert!(states.len() > 10, "{}", states.len());
    assert_matches(
        &g,
        &ExecLayout::on_meshes(vec![vec![2, 2]], 2, vec![vec![(0, 5)]], placements, states),
    );
}

/// Stages on different meshes (stage 0 data-parallel on 1 x 2, stage 1 data x tensor
/// parallel on 2 x 2): activations and gradients cross the boundary whole and are cut to the
/// receiver's placement.
#[test]
fn stages_on_different_meshes() {
    let g = tiny_llama(4, 32, 2);
    let first = MeshScheme {
        batch: Some(1),
        model: vec![],
        cross: None,
    };
    let second = MeshScheme {
        batch: Some(0),
        model: vec![1],
        cross: None,
    };
    let placements = staged_placements(&g, &[(0..3, first), (3..6, second.clone())]);
    let l = ExecLayout::on_meshes(
        vec![vec![1, 2], vec![2, 2]],
        4,
        vec![vec![(0, 2)], vec![(3, 5)]],
        placements,
        Default::default(),
    );
    assert_eq!(l.devices(), 6);
    let prog = lower(&g, &l).expect("lowers");
    assert!(prog.chunks[1].reshard && !prog.chunks[0].reshard);
    assert_eq!(prog.chunks[1].recv.len(), 1);
    assert_ne!(prog.chunks[1].recv, prog.chunks[1].recv_from);
    assert_matches(&g, &l);
    // Tensor parallelism of 2 then data x tensor parallelism, with the embedding that the
    // first and last stages share summed across their meshes.
    let gpt = tiny_gpt(4, 16, 2);
    let tp = MeshScheme {
        batch: None,
        model: vec![1],
        cross: None,
    };
    let l = ExecLayout::on_meshes(
        vec![vec![1, 2], vec![2, 2]],
        4,
        vec![vec![(0, 1)], vec![(2, 3)]],
        staged_placements(&gpt, &[(0..2, tp), (2..4, second)]),
        Default::default(),
    );
    assert_eq!(lower(&gpt, &l).expect("lowers").tied.len(), 1);
    assert_matches(&gpt, &l);
}

/// The default workspace's CPU targets of the ILP space run as their build planned them and
/// match one device: optimizer states sharded inside a 1 x 2 mesh, stages on 1 x 1 and 1 x 2
/// meshes, a 2 x 2 logical mesh with 2D shardings.
#[test]
fn default_cpu_targets_of_the_ilp_space_run_as_planned() {
    let ws = autopar_tests::TempWorkspace::default_copy();
    let targets = [
        "tiny-llama-cpu-ilp",
        "tiny-llama-cpu-stages",
        "tiny-llama-cpu-2d",
    ];
    let mut args = vec!["build"];
    args.extend(targets);
    let b = ws.run(&args);
    assert_eq!(b.code, 0, "{}", b.stderr);
    for target in targets {
        let plan: serde_json::Value =
            serde_json::from_str(&ws.read(&format!("plans/{target}.json"))).expect("plan");
        assert_eq!(plan["space"], "ilp", "{target}");
        let stages = plan["ilp"]["stages"].as_array().expect("stages");
        let meshes: Vec<&serde_json::Value> =
            stages.iter().map(|s| &s["mesh"]["logical"]).collect();
        match target {
            "tiny-llama-cpu-ilp" => assert!(
                stages[0]["parameters"]
                    .as_array()
                    .expect("weights")
                    .iter()
                    .any(|w| w["weight"] != w["states"]),
                "{target}: some optimizer states are sharded apart from their weight"
            ),
            "tiny-llama-cpu-stages" => assert!(
                meshes.windows(2).any(|w| w[0] != w[1]),
                "{target}: stages on different meshes: {meshes:?}"
            ),
            _ => assert!(
                meshes.iter().all(|m| **m == serde_json::json!([2, 2])),
                "{target}: {meshes:?}"
            ),
        }
        let r = ws.run(&["run", target, "--check", "--steps", "2", "--json"]);
        assert_eq!(r.code, 0, "{target}: {}", r.stderr);
        let j = r.json();
        assert_eq!(j["plan_space"], "ilp", "{target}");
        assert_eq!(j["check"]["passed"], true, "{target}: {}", j["check"]);
        let devices: u64 = meshes
            .iter()
            .map(|m| m[0].as_u64().unwrap_or(0) * m[1].as_u64().unwrap_or(0))
            .sum();
        assert_eq!(j["devices"], devices, "{target}");
        assert_eq!(
            j["comparable"],
            j["host_cores"].as_u64().is_some_and(|c| c >= devices),
            "{target}"
        );
    }
    // Other logical mesh shapes re-run the ILP search of that target, and explain says why.
    let toml = ws.read("workspace.toml");
    let edited = toml.replacen(
        "logical_meshes = [\"2x2\"]",
        "logical_meshes = [\"1x4\"]",
        1,
    );
    assert_ne!(edited, toml);
    ws.write("workspace.toml", &edited);
    let b = ws.run(&["build", "tiny-llama-cpu-2d"]);
    assert_eq!(b.code, 0, "{}", b.stderr);
    let plan: serde_json::Value =
        serde_json::from_str(&ws.read("plans/tiny-llama-cpu-2d.json")).expect("plan");
    assert_eq!(
        plan["ilp"]["stages"][0]["mesh"]["logical"],
        serde_json::json!([1, 4])
    );
    let explain = ws.run(&["explain", "tiny-llama-cpu-2d"]);
    assert!(
        explain.stdout.contains("logical mesh shapes changed"),
        "{}",
        explain.stdout
    );
}
