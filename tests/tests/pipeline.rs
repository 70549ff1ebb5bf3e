//! Alpa's two levels together: stage costs chained from per-layer tables feed the stage DP.
//! The plan's step time must equal exhaustive search over every split into stages, every
//! assignment of submeshes that tiles the cluster and every logical mesh, with each stage
//! priced by the intra-op solve of its whole range.

use autopar_rules::canonical::Digest;
use autopar_rules::cost::cluster::Cluster;
use autopar_rules::cost::cluster::Device;
use autopar_rules::cost::memory::Precision;
use autopar_rules::cost::sharding::Mesh;
use autopar_rules::model::frontend::{Attention, LowerOptions, ModelDef, parse_hf_config};
use autopar_rules::model::graph::{DType, Graph};
use autopar_rules::solve::inter::{place, submesh_choices};
use autopar_rules::solve::intra::chain::{
    ChainError, Crossings, LayerTable, TableSolver, decode_range, layer_table,
};
use autopar_rules::solve::intra::stage::{Phase, SolverChoice, StageModel, StageOptions};
use autopar_rules::solve::pipeline::{
    MeshChoice, PipelineError, PipelineOptions, Solve, TableSource, layer_classes,
    layer_identities, logical_meshes, plan_pipeline, plan_pipeline_with, table_key, table_requests,
};
use autopar_tests::sharding::lower;
use autopar_tests::{TempWorkspace, repo_root};
use std::collections::HashMap;
use std::sync::Mutex;

fn cluster(nodes: u64, gpus: u64) -> Cluster {
    Cluster::from_preset("test", "h100-sxm", nodes, Some(gpus)).expect("preset")
}

/// LLaMA-2 7B's shapes with `blocks` blocks.
fn llama(blocks: u64, micro_batch: u64) -> Graph {
    llama_seq(blocks, micro_batch, 128)
}

/// LLaMA-2 7B's shapes with `blocks` blocks on sequences of `seq` tokens.
fn llama_seq(blocks: u64, micro_batch: u64, seq: u64) -> Graph {
    let path = repo_root().join("models/llama2-7b.json");
    let text = std::fs::read_to_string(path).expect("llama2-7b.json");
    let mut cfg = parse_hf_config(&text).expect("config");
    cfg.layers = blocks;
    ModelDef::Transformer(cfg)
        .lower(
            "llama",
            &LowerOptions {
                micro_batch,
                seq,
                dtype: DType::Bf16,
                attention: Attention::Flash,
                vocab_multiple: 128,
                eager_elementwise: false,
                fp8: false,
            },
        )
        .expect("lowers")
}

fn options(microbatches: u64) -> PipelineOptions<'static> {
    PipelineOptions {
        microbatches,
        memory_budget: 1e15,
        precision: Precision::Bf16,
        max_exact_entries: 4e6,
        max_table_work: autopar_rules::solve::intra::chain::MAX_TABLE_WORK,
        powers_of_two: false,
        logical_meshes: &[],
        recompute: true,
        grad_accumulation_fusion: true,
        grad_reduce_in_fp32: true,
        fp32_loss: false,
        tp_comm_overlap: false,
        profile: None,
        solver: SolverChoice::Auto,
    }
}

/// The best step by trying every pipeline.
fn exhaustive(g: &Graph, c: &Cluster, b: u64) -> f64 {
    let layers = g.layers.len();
    let subs = submesh_choices(c.nodes, c.gpus_per_node, false);
    let mut memo: HashMap<(usize, usize, usize, usize), f64> = HashMap::new();
    let mut stage = |k: usize, i: usize, s: usize, cfg: usize| -> f64 {
        *memo.entry((k, i, s, cfg)).or_insert_with(|| {
            let (n, m) = subs[s];
            let mesh = Mesh::logical(c, subs[s], logical_meshes(n * m)[cfg]);
            // The whole range's problem with the search's own options (fp32 gradients).
            let opts = options(b).stage_options(1);
            StageModel::build(g, k..i + 1, mesh, &c.device, opts)
                .and_then(|m| m.solve())
                .map_or(f64::INFINITY, |p| p.objective)
        })
    };
    let mut best = f64::INFINITY;
    // Every split: stack of (start, end, submesh, config).
    /// The fixed part of the search: submesh shapes, cluster, micro-batches.
    type Ctx<'a> = (&'a [(u64, u64)], &'a Cluster, u64);
    fn walk(
        k: usize,
        layers: usize,
        chosen: &mut Vec<(usize, usize, usize, usize)>,
        ctx: Ctx,
        stage: &mut dyn FnMut(usize, usize, usize, usize) -> f64,
        best: &mut f64,
    ) {
        let (subs, c, b) = ctx;
        let used: u64 = chosen.iter().map(|x| subs[x.2].0 * subs[x.2].1).sum();
        if k == layers {
            let shapes: Vec<(u64, u64)> = chosen.iter().map(|x| subs[x.2]).collect();
            if used != c.gpus() || place(&shapes, c.nodes, c.gpus_per_node).is_none() {
                return;
            }
            let costs: Vec<f64> = chosen
                .iter()
                .map(|&(k, i, s, f)| stage(k, i, s, f))
                .collect();
            let total = costs.iter().sum::<f64>()
                + (b as f64 - 1.0) * costs.iter().copied().fold(0.0, f64::max);
            *best = best.min(total);
            return;
        }
        for i in k..layers {
            for (s, &(n, m)) in subs.iter().enumerate() {
                if used + n * m > c.gpus() {
                    continue;
                }
                for cfg in 0..logical_meshes(n * m).len() {
                    chosen.push((k, i, s, cfg));
                    walk(i + 1, layers, chosen, ctx, stage, best);
                    chosen.pop();
                }
            }
        }
    }
    walk(
        0,
        layers,
        &mut Vec::new(),
        (&subs, c, b),
        &mut stage,
        &mut best,
    );
    best
}

#[test]
fn the_pipeline_is_the_exhaustive_optimum() {
    let cases: Vec<(&str, Graph, Cluster, u64)> = vec![
        (
            "mlp on 1x4, B=4",
            lower("tiny-mlp.graph.json", 2, Some(128), 1),
            cluster(1, 4),
            4,
        ),
        (
            "mlp on 2x2, B=8",
            lower("tiny-mlp.graph.json", 2, Some(128), 1),
            cluster(2, 2),
            8,
        ),
        ("llama 2 blocks on 1x2, B=4", llama(2, 2), cluster(1, 2), 4),
        ("llama 2 blocks on 2x1, B=2", llama(2, 1), cluster(2, 1), 2),
    ];
    for (name, g, c, b) in cases {
        let plan = plan_pipeline(&g, &c, options(b)).unwrap_or_else(|e| panic!("{name}: {e}"));
        let want = exhaustive(&g, &c, b);
        assert!(
            (plan.step - want).abs() <= 1e-9 * want,
            "{name}: pipeline {} vs exhaustive {want}: {:?}",
            plan.step,
            plan.stages
        );
        let devices: u64 = plan
            .stages
            .iter()
            .map(|s| s.priced.mesh.submesh.0 * s.priced.mesh.submesh.1)
            .sum();
        assert_eq!(devices, c.gpus(), "{name}");
        assert_eq!(plan.stages.first().map(|s| s.priced.layers[0]), Some(0));
        assert_eq!(
            plan.stages.last().map(|s| s.priced.layers[1]),
            Some(g.layers.len())
        );
    }
}

#[test]
fn identical_blocks_are_solved_once() {
    let g = llama(6, 1);
    let classes = layer_classes(&g);
    // Embedding, the first block, the inner blocks, the last block and the head: the first and
    // last blocks border other kinds of layer, but the tensors crossing are the same shape.
    let distinct: Vec<usize> = (0..g.layers.len()).filter(|&l| classes[l] == l).collect();
    assert_eq!(distinct, vec![0, 1, 7], "{classes:?}");
    let c = cluster(1, 2);
    let plan = plan_pipeline(&g, &c, options(4)).expect("plans");
    // 3 distinct layers on (1,1) x 1 logical mesh and (1,2) x 2.
    assert_eq!(plan.meshes, 3);
    assert_eq!(plan.tables, 9);
}

#[test]
fn stages_decoded_together_equal_each_decoded_alone() {
    // Four one-GPU hosts and many micro-batches: several stages of identical blocks on 1x1,
    // each with its own micro-batches in flight, share their layers' decoded plans.
    let g = llama(6, 1);
    let c = cluster(4, 1);
    let opts = options(64);
    let plan = plan_pipeline(&g, &c, opts).expect("plans");
    let classes = layer_classes(&g);
    let mut meshes: Vec<MeshChoice> = plan.stages.iter().map(|s| s.priced.mesh).collect();
    meshes.dedup();
    assert!(
        meshes.len() < plan.stages.len(),
        "stages share a mesh: {meshes:?}"
    );
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1e-30);
    for s in &plan.stages {
        let st = &s.priced;
        let mesh = Mesh::logical(&c, st.mesh.submesh, st.mesh.logical);
        let tables: Vec<LayerTable> = (st.layers[0]..st.layers[1])
            .map(|l| layer_table(&g, classes[l], mesh, &c.device, opts.stage_options(1)))
            .collect::<Result<_, _>>()
            .expect("tables");
        let refs: Vec<&LayerTable> = tables.iter().collect();
        let alone = decode_range(
            &g,
            st.layers[0]..st.layers[1],
            mesh,
            &c.device,
            opts.stage_options(st.inflight),
            &refs,
            &st.states,
        )
        .expect("decodes");
        let together = &s.plan;
        assert_eq!(together.ops, alone.ops, "{:?}", st.layers);
        assert_eq!(together.parameters, alone.parameters, "{:?}", st.layers);
        assert_eq!(together.collectives, alone.collectives, "{:?}", st.layers);
        assert_eq!(together.layers, alone.layers);
        for (what, a, b) in [
            ("objective", together.objective, alone.objective),
            (
                "activations",
                together.memory.activations,
                alone.memory.activations,
            ),
            ("memory", together.memory.total, alone.memory.total),
        ] {
            assert!(close(a, b), "{:?} {what}: {a} vs {b}", st.layers);
        }
    }
}

/// Solves every table it is not holding already, keeping each under its key: a cache.
struct Held(Mutex<HashMap<Digest, LayerTable>>);

impl TableSource for Held {
    fn table(
        &self,
        graph: &Graph,
        crossings: &Crossings,
        layer: usize,
        identity: Digest,
        mesh: Mesh,
        device: &Device,
        opts: StageOptions,
    ) -> Result<LayerTable, ChainError> {
        let key = table_key(identity, &mesh, device, &opts, &[]).key();
        if let Some(t) = self.0.lock().expect("not poisoned").get(&key) {
            return Ok(t.clone());
        }
        let t = Solve.table(graph, crossings, layer, identity, mesh, device, opts)?;
        self.0.lock().expect("not poisoned").insert(key, t.clone());
        Ok(t)
    }
}

#[test]
fn table_requests_are_exactly_the_tables_the_search_asks_for() {
    let g = llama(3, 1);
    let c = cluster(2, 2);
    let asked = Held(Mutex::new(HashMap::new()));
    plan_pipeline_with(&g, &c, options(4), &asked).expect("plans");
    // Decoding the chosen stages asks for some tables a second time: the keys held are the
    // distinct ones asked for.
    let mut asked: Vec<Digest> = asked
        .0
        .into_inner()
        .expect("not poisoned")
        .into_keys()
        .collect();
    let requests = table_requests(&g, &c, options(4));
    let mut listed: Vec<Digest> = requests.iter().map(|r| r.key.key()).collect();
    // 3 distinct layers on 1x1 (one logical mesh), 1x2 (two) and 2x2 (three).
    assert_eq!(listed.len(), 3 * 6);
    assert!(requests.iter().all(|r| r.layer <= 4));
    asked.sort();
    listed.sort();
    assert_eq!(asked, listed);
}

#[test]
fn logical_mesh_shapes_restrict_the_search() {
    let g = llama(3, 1);
    let c = cluster(2, 2);
    let only = [[2u64, 2]];
    let opts = PipelineOptions {
        logical_meshes: &only,
        ..options(4)
    };
    // Only the 2x2 submesh has a 2x2 logical mesh: 3 distinct layers on it.
    let requests = table_requests(&g, &c, opts);
    assert_eq!(requests.len(), 3);
    assert!(requests.iter().all(|r| r.mesh.logical == [2, 2]));
    let p = plan_pipeline(&g, &c, opts).expect("plans");
    assert!(
        p.stages.iter().all(|s| s.priced.mesh.logical == [2, 2]),
        "{p:?}"
    );
    // No shape that lays out a submesh: nothing to search.
    let none = [[3u64, 3]];
    let opts = PipelineOptions {
        logical_meshes: &none,
        ..options(4)
    };
    assert!(table_requests(&g, &c, opts).is_empty());
    assert!(plan_pipeline(&g, &c, opts).is_err());
}

#[test]
fn a_tight_budget_limits_the_micro_batches_in_flight() {
    let g = llama(2, 1);
    let c = cluster(1, 2);
    let loose = plan_pipeline(&g, &c, options(8)).expect("plans");
    let most = loose
        .stages
        .iter()
        .map(|s| s.priced.memory)
        .fold(0.0, f64::max);
    // Every stage's memory is what its in-flight micro-batches need, within the budget.
    for budget in [most * 0.999, most * 0.5] {
        let opts = PipelineOptions {
            memory_budget: budget,
            ..options(8)
        };
        match plan_pipeline(&g, &c, opts) {
            Ok(p) => {
                assert!(p.stages.iter().all(|s| s.priced.memory <= budget), "{p:?}");
                assert!(p.step >= loose.step * (1.0 - 1e-12));
            }
            Err(e) => assert!(e.to_string().contains("no"), "{e}"),
        }
    }
}

#[test]
fn solve_pipeline_prints_and_reports_the_stages() {
    let ws = TempWorkspace::default_copy();
    let base = [
        "solve",
        "pipeline",
        "--model",
        "llama2-7b",
        "--cluster",
        "h100-sxm:1x4",
        "--seq",
        "512",
    ];
    let j = ws
        .run(&[&base[..], &["--gbs", "16", "--json"]].concat())
        .json();
    let stages = j["stages"].as_array().expect("stages");
    let costs: Vec<f64> = stages.iter().filter_map(|s| s["cost"].as_f64()).collect();
    assert_eq!(costs.len(), stages.len());
    let b = j["microbatches"].as_f64().expect("microbatches");
    assert_eq!(b, 16.0);
    let want = costs.iter().sum::<f64>() + (b - 1.0) * costs.iter().copied().fold(0.0, f64::max);
    let step = j["step"].as_f64().expect("step");
    assert!((step - want).abs() <= 1e-9 * want, "{j}");
    let devices: u64 = stages
        .iter()
        .map(|s| {
            let m = &s["mesh"]["submesh"];
            m[0].as_u64().unwrap_or(0) * m[1].as_u64().unwrap_or(0)
        })
        .sum();
    assert_eq!(devices, 4, "{j}");
    // 3 distinct layers (embedding, block, head) on 1x1, 1x2 (2 logical meshes), 1x4 (3).
    assert_eq!(j["tables"], 18, "{j}");
    let text = ws.run(&[&base[..], &["--gbs", "16"]].concat());
    assert_eq!(text.code, 0, "{}", text.stderr);
    assert!(text.stdout.contains("step "), "{}", text.stdout);
    assert!(
        text.stdout
            .contains("layer tables: 18 (6 mesh choices x distinct layers): 0 memory hits, 18 local hits, 0 remote hits, 0 solved"),
        "the second run reads every table from the store:\n{}",
        text.stdout
    );
    let bad = ws.run(&[&base[..], &["--gbs", "15", "--mbs", "2"]].concat());
    assert_eq!(bad.code, 2, "{}", bad.stderr);
    assert!(bad.stderr.contains("--gbs"), "{}", bad.stderr);
    let tight = ws.run(&[&base[..], &["--gbs", "16", "--memory-gib", "0.5"]].concat());
    assert_eq!(tight.code, 1, "{}", tight.stderr);
    let square = ws
        .run(
            &[
                &base[..],
                &["--gbs", "16", "--logical-meshes", "2x2", "--json"],
            ]
            .concat(),
        )
        .json();
    let stages = square["stages"].as_array().expect("stages");
    assert!(
        stages
            .iter()
            .all(|s| s["mesh"]["logical"] == serde_json::json!([2, 2])),
        "{square}"
    );
    let odd = ws.run(&[&base[..], &["--gbs", "16", "--logical-meshes", "2by2"]].concat());
    assert_eq!(odd.code, 2, "{}", odd.stderr);
    assert!(odd.stderr.contains("--logical-meshes"), "{}", odd.stderr);
}

#[test]
fn a_network_change_invalidates_only_multi_node_tables() {
    let g = llama(2, 1);
    let ids = layer_identities(&g);
    let before = cluster(2, 4);
    let mut after = before.clone();
    after.network.nic_bandwidth *= 2.0;
    let opts = StageOptions::default();
    let subs = submesh_choices(2, 4, false);
    let mut changed = Vec::new();
    for &(n, m) in &subs {
        for logical in logical_meshes(n * m) {
            let key = |c: &Cluster| {
                table_key(
                    ids[1],
                    &Mesh::logical(c, (n, m), logical),
                    &c.device,
                    &opts,
                    &[],
                )
                .key()
            };
            if key(&before) != key(&after) {
                changed.push(((n, m), logical));
            }
        }
    }
    assert!(!changed.is_empty());
    assert!(changed.iter().all(|((n, _), _)| *n > 1), "{changed:?}");
    // Every logical mesh of the two-node submesh whose axis 0 crosses nodes changes.
    assert!(changed.contains(&((2, 4), [2, 4])), "{changed:?}");
}

#[test]
fn tables_too_wide_to_solve_are_named_not_dropped_silently() {
    let g = lower("tiny-mlp.graph.json", 2, Some(128), 1);
    let c = cluster(1, 4);
    let full = plan_pipeline(&g, &c, options(4)).expect("plans");
    assert!(full.skipped.is_empty());
    let opts = PipelineOptions {
        max_exact_entries: 2e3,
        solver: SolverChoice::Exact,
        ..options(4)
    };
    let narrow = plan_pipeline(&g, &c, opts).expect("plans on the meshes left");
    assert!(!narrow.skipped.is_empty());
    for k in &narrow.skipped {
        assert!(k.reason.contains("too large"), "{k:?}");
        // No stage of the plan holds a skipped layer on its mesh choice.
        let l = g
            .layers
            .iter()
            .position(|x| x.name == k.layer)
            .expect("layer");
        assert!(
            !narrow.stages.iter().any(|s| s.priced.mesh == k.mesh
                && (s.priced.layers[0]..s.priced.layers[1]).contains(&l)),
            "{k:?} in {:?}",
            narrow.stages
        );
    }
    assert!(narrow.step >= full.step * (1.0 - 1e-12));
}

#[test]
fn tables_too_wide_to_eliminate_are_filled_by_drec_under_auto() {
    let g = lower("tiny-mlp.graph.json", 2, Some(128), 1);
    let c = cluster(1, 4);
    let full = plan_pipeline(&g, &c, options(4)).expect("plans");
    assert!(
        full.stages
            .iter()
            .all(|s| s.solvers.iter().all(|&t| t == TableSolver::Exact))
    );
    let narrow = PipelineOptions {
        max_exact_entries: 2e3,
        ..options(4)
    };
    let fallback = plan_pipeline(&g, &c, narrow).expect("plans");
    // Nothing is left out: the layers too wide to eliminate are priced by D-Rec, which the
    // stages say, and the pipeline costs what its decoded plans cost.
    assert!(fallback.skipped.is_empty(), "{:?}", fallback.skipped);
    let exact = plan_pipeline(
        &g,
        &c,
        PipelineOptions {
            solver: SolverChoice::Exact,
            ..narrow
        },
    )
    .expect("plans");
    // D-Rec's entries bound the exact ones from above, and more mesh choices are open than
    // with the wide layers left out.
    assert!(fallback.step >= full.step * (1.0 - 1e-12));
    assert!(fallback.step <= exact.step * (1.0 + 1e-12));
    // Held to a logical mesh on which a layer is too wide to eliminate, the pipeline prices
    // that layer by D-Rec, the stages say so, and it costs what its decoded plans cost.
    let wide = exact
        .skipped
        .first()
        .expect("a layer too wide on some mesh")
        .mesh
        .logical;
    let only = [wide];
    let held = plan_pipeline(
        &g,
        &c,
        PipelineOptions {
            logical_meshes: &only,
            ..narrow
        },
    )
    .expect("plans on that mesh");
    let drec_layers: usize = held
        .stages
        .iter()
        .map(|s| {
            assert_eq!(s.solvers.len(), s.priced.layers[1] - s.priced.layers[0]);
            s.solvers
                .iter()
                .filter(|&&t| t == TableSolver::Drec)
                .count()
        })
        .sum();
    println!(
        "step: exact {:.6} s; D-Rec where too wide {:.6} s; exact with those left out {:.6} s; \
         on {}x{} alone {:.6} s with {drec_layers} layers priced by D-Rec",
        full.step, fallback.step, exact.step, wide[0], wide[1], held.step
    );
    assert!(drec_layers > 0, "{:?}", held.stages);
    let joined: f64 = held.stages.iter().map(|s| s.plan.objective).sum();
    let priced: f64 = held
        .stages
        .iter()
        .map(|s| s.priced.cost - s.priced.recompute_s)
        .sum();
    assert!(
        (joined - priced).abs() <= 1e-9 * priced,
        "decoded {joined} vs priced {priced}"
    );
}

#[test]
fn recomputation_fits_budgets_that_nothing_else_fits() {
    let g = llama_seq(2, 8, 4096);
    let c = cluster(1, 2);
    let loose = plan_pipeline(&g, &c, options(8)).expect("plans");
    assert!(loose.stages.iter().all(|s| s.priced.recomputed.is_empty()));
    let most = loose
        .stages
        .iter()
        .map(|s| s.priced.memory)
        .fold(0.0, f64::max);
    let mut last = loose.step;
    let (mut recomputing, mut only_recomputed) = (0, 0);
    for f in [0.95, 0.9, 0.8, 0.7, 0.6, 0.5] {
        let budget = most * f;
        let opts = PipelineOptions {
            memory_budget: budget,
            ..options(8)
        };
        let Ok(p) = plan_pipeline(&g, &c, opts) else {
            continue;
        };
        // A tighter budget never makes the step faster; every stage fits; a stage's cost is
        // its plan's without recomputation plus the forward passes it runs again.
        assert!(p.step >= last * (1.0 - 1e-12), "{f}: {} < {last}", p.step);
        last = p.step;
        for s in &p.stages {
            assert!(s.priced.memory <= budget, "{f}: {s:?}");
            assert!(
                (s.priced.cost - (s.plan.objective + s.priced.recompute_s)).abs()
                    <= 1e-9 * s.priced.cost,
                "{f}: {} vs {} + {}",
                s.priced.cost,
                s.plan.objective,
                s.priced.recompute_s
            );
            // What the stage was priced with (read from its layers' table entries) is what
            // its decoded plan says.
            let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs().max(1e-12);
            let sync: f64 = s
                .plan
                .collectives
                .iter()
                .filter(|c| c.phase == Phase::Step)
                .map(|c| c.seconds)
                .sum();
            for (what, priced, decoded) in [
                ("forward", s.priced.forward, s.plan.forward),
                ("backward", s.priced.backward, s.plan.backward),
                ("step", s.priced.step, s.plan.step),
                ("sync", s.priced.sync, sync),
            ] {
                assert!(close(priced, decoded), "{f}: {what} {priced} vs {decoded}");
            }
            assert_eq!(s.priced.recomputed.is_empty(), s.priced.recompute_s == 0.0);
            assert!(
                s.priced
                    .recomputed
                    .iter()
                    .all(|l| (s.priced.layers[0]..s.priced.layers[1]).contains(l))
            );
            if !s.priced.recomputed.is_empty() {
                recomputing += 1;
                // Recomputing saves memory: without it the stage would not fit.
                assert!(s.plan.memory.peak() > budget, "{f}: {s:?}");
            }
        }
        // Without recomputation, no stage recomputes and the plan is no faster.
        let plain = PipelineOptions {
            recompute: false,
            ..opts
        };
        match plan_pipeline(&g, &c, plain) {
            Ok(q) => {
                assert!(q.stages.iter().all(|s| s.priced.recomputed.is_empty()));
                assert!(q.step >= p.step * (1.0 - 1e-12));
            }
            Err(_) => only_recomputed += 1,
        }
    }
    assert!(recomputing > 0, "no budget needed recomputation");
    assert!(
        only_recomputed > 0,
        "every budget fit without recomputation"
    );
}

#[test]
fn a_search_past_its_work_bound_stops_and_says_so() {
    let g = llama(3, 1);
    let c = cluster(1, 4);
    let held = Held(Mutex::new(HashMap::new()));
    let plan = plan_pipeline_with(&g, &c, options(4), &held).expect("plans");
    let tables: Vec<LayerTable> = held
        .0
        .lock()
        .expect("not poisoned")
        .values()
        .cloned()
        .collect();
    assert_eq!(tables.len(), 18);
    assert!(tables.iter().all(|t| t.work > 0.0));
    let total: f64 = tables.iter().map(|t| t.work).sum();
    let largest = tables.iter().map(|t| t.work).fold(0.0, f64::max);
    // Work is counted, not timed: solving again records the same.
    let again = Held(Mutex::new(HashMap::new()));
    plan_pipeline_with(&g, &c, options(4), &again).expect("plans");
    let mut twice: Vec<f64> = again
        .0
        .into_inner()
        .expect("not poisoned")
        .values()
        .map(|t| t.work)
        .collect();
    let mut once: Vec<f64> = tables.iter().map(|t| t.work).collect();
    twice.sort_by(f64::total_cmp);
    once.sort_by(f64::total_cmp);
    assert_eq!(once, twice);
    // A bound the tables meet changes nothing.
    let bounded = |max: f64, solver: SolverChoice| PipelineOptions {
        max_table_work: max,
        solver,
        ..options(4)
    };
    let at = plan_pipeline(&g, &c, bounded(total, SolverChoice::Auto)).expect("plans");
    assert_eq!(at.step, plan.step);
    // Just under their total, the search stops and says why, whether its tables are solved or
    // found (the work is part of each table), and whatever the solver.
    for solver in [SolverChoice::Auto, SolverChoice::Exact] {
        let under = bounded(total * (1.0 - 1e-9), solver);
        let fresh = plan_pipeline(&g, &c, under).expect_err("stops");
        assert_eq!(
            fresh,
            PipelineError::TooMuchWork {
                max: under.max_table_work
            }
        );
        assert!(fresh.to_string().contains("units of work"), "{fresh}");
        let cache = Held(Mutex::new(HashMap::new()));
        let _ = plan_pipeline_with(&g, &c, under, &cache);
        assert_eq!(
            plan_pipeline_with(&g, &c, under, &cache).expect_err("stops"),
            fresh
        );
    }
    // A table whose elimination alone would pass the bound is not eliminated: under `exact`
    // its layer leaves that mesh choice, named, and the rest plans; under `auto` D-Rec fills
    // it (its work then counts like any other table's).
    let rest = total - largest;
    assert!(
        rest < largest - 1e5,
        "one table dominates: {rest} vs {largest}"
    );
    let narrow = plan_pipeline(&g, &c, bounded(rest, SolverChoice::Exact)).expect("plans");
    assert_eq!(narrow.skipped.len(), 1, "{:?}", narrow.skipped);
    assert!(
        narrow.skipped[0]
            .reason
            .contains("additions of the exact solver"),
        "{:?}",
        narrow.skipped
    );
    assert!(narrow.step >= plan.step * (1.0 - 1e-12));
    let widest = tables
        .iter()
        .find(|t| t.work == largest)
        .expect("the largest");
    let layer = widest.layer;
    let skipped = narrow.skipped[0].mesh;
    let mesh = Mesh::logical(&c, skipped.submesh, skipped.logical);
    let one = |max: f64, solver: SolverChoice| {
        layer_table(
            &g,
            layer,
            mesh,
            &c.device,
            StageOptions {
                max_table_work: max,
                solver,
                ..options(4).stage_options(1)
            },
        )
    };
    assert!(matches!(
        one(rest, SolverChoice::Exact),
        Err(ChainError::TooMuchWork { .. })
    ));
    assert_eq!(
        one(rest, SolverChoice::Auto).expect("D-Rec").solver,
        TableSolver::Drec
    );
    assert_eq!(one(total, SolverChoice::Auto).expect("exact").work, largest);
}
