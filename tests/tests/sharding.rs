//! The intra-op pass on the shipped models: the exact solver and the ILP agree on every layer
//! graph, the plans that emerge on a GPT block are the known ones (Megatron's tensor
//! parallelism on one node, pure data parallelism across nodes, sharded optimizer states and
//! weights under a tight budget), and `autopar solve sharding` reports them.

use autopar_rules::cost::sharding::Mesh;
use autopar_rules::model::graph::{Graph, LayerKind};
use autopar_rules::solve::intra::stage::{
    MegatronSharding, Phase, Reason, SolverChoice, StageModel, StageOptions, StagePlan,
};
use autopar_tests::TempWorkspace;
use autopar_tests::sharding::{cluster_for, lower, mesh, shipped_models};
use std::ops::Range;

const GIB: f64 = (1u64 << 30) as f64;

fn solve(graph: &Graph, layers: Range<usize>, m: &Mesh, opts: StageOptions) -> StagePlan {
    let device = cluster_for(m.shape[0], m.shape[1]).device;
    let model = StageModel::build(graph, layers.clone(), *m, &device, opts)
        .unwrap_or_else(|e| panic!("layers {layers:?}: {e}"));
    model
        .solve()
        .unwrap_or_else(|e| panic!("layers {layers:?}: {e}"))
}

fn with(solver: SolverChoice) -> StageOptions<'static> {
    StageOptions {
        solver,
        ..StageOptions::default()
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-6 * a.abs().max(b.abs()).max(1e-12)
}

/// One layer of each kind (embedding, block, head): all blocks of a model are the same graph.
fn layer_graphs(g: &Graph) -> Vec<Range<usize>> {
    let mut seen: Vec<LayerKind> = Vec::new();
    let mut out = Vec::new();
    for (i, l) in g.layers.iter().enumerate() {
        if !seen.contains(&l.kind) {
            seen.push(l.kind);
            out.push(i..i + 1);
        }
    }
    out
}

#[test]
fn exact_and_ilp_agree_on_every_layer_graph_of_every_shipped_model() {
    let meshes = [(1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (2, 8)];
    let mut checked = 0;
    let mut binding = 0;
    for file in shipped_models() {
        // The vocabulary padded for the largest mesh suits them all.
        let g = lower(&file, 1, Some(2048), 16);
        // Mixture-of-experts and MLA models: the intra-op space refuses their layers, naming
        // the op, instead of sharding ops it does not model.
        if let Some(op) = g.first_megatron_only_op() {
            let (m, c) = mesh(1, 2);
            let layer = op.layer as usize;
            let e = StageModel::build(&g, layer..layer + 1, m, &c.device, StageOptions::default())
                .err()
                .unwrap_or_else(|| panic!("{file}: layer {layer} was built"));
            assert!(e.to_string().contains(&op.name), "{file}: {e}");
            continue;
        }
        for layers in layer_graphs(&g) {
            for (a, b) in meshes {
                let (m, _) = mesh(a, b);
                let exact = solve(&g, layers.clone(), &m, with(SolverChoice::Exact));
                let ilp = solve(&g, layers.clone(), &m, with(SolverChoice::Ilp));
                let at = format!("{file} layers {layers:?} on {a}x{b}");
                assert_eq!(exact.solve.solver, "exact", "{at}");
                assert!(ilp.solve.optimal, "{at}: the ILP hit its time limit");
                assert!(
                    close(exact.objective, ilp.objective),
                    "{at}: exact {} vs ilp {}",
                    exact.objective,
                    ilp.objective
                );
                // The plan read back costs what the solver minimised.
                for p in [&exact, &ilp] {
                    assert!(
                        close(p.objective, p.solve.cost),
                        "{at}: plan {} vs solver {}",
                        p.objective,
                        p.solve.cost
                    );
                }
                checked += 1;
                // A budget between the leanest plan's memory and the unconstrained
                // optimum's: both solvers find the same constrained optimum.
                let device = cluster_for(a, b).device;
                let free =
                    StageModel::build(&g, layers.clone(), m, &device, StageOptions::default())
                        .unwrap_or_else(|e| panic!("{at}: {e}"));
                let lean = free.problem().leanest();
                let budget = 0.5 * (lean.memory + exact.memory.total);
                let tight = |solver| StageOptions {
                    memory_budget: Some(budget),
                    ..with(solver)
                };
                let run = |solver| {
                    StageModel::build(&g, layers.clone(), m, &device, tight(solver))
                        .and_then(|model| model.solve())
                        .unwrap_or_else(|e| panic!("{at} under {budget} B: {e}"))
                };
                let (x, i) = (run(SolverChoice::Exact), run(SolverChoice::Ilp));
                assert_eq!(x.solve.solver, "exact", "{at}");
                assert!(x.memory.total <= budget * (1.0 + 1e-9), "{at}");
                assert!(i.memory.total <= budget * (1.0 + 1e-9), "{at}");
                assert!(
                    close(x.objective, i.objective),
                    "{at} under {budget} B: exact {} vs ilp {}",
                    x.objective,
                    i.objective
                );
                if budget < exact.memory.total * (1.0 - 1e-9) {
                    binding += 1;
                }
            }
        }
    }
    // 31 transformers and the MLP graph file x (embedding, block, head) x 6 meshes.
    assert_eq!(checked, 32 * 3 * 6);
    // Most of the tighter budgets exclude the unconstrained optimum.
    assert!(binding > checked / 2, "{binding} of {checked} budgets bind");
}

fn block(g: &Graph) -> Range<usize> {
    let i = g
        .layers
        .iter()
        .position(|l| l.kind == LayerKind::Block)
        .unwrap_or_else(|| panic!("a transformer block"));
    i..i + 1
}

fn param<'p>(
    plan: &'p StagePlan,
    suffix: &str,
) -> &'p autopar_rules::solve::intra::stage::ParamSharding {
    plan.parameters
        .iter()
        .find(|p| p.name.ends_with(suffix))
        .unwrap_or_else(|| panic!("parameter {suffix}"))
}

#[test]
fn one_node_gives_megatron_tensor_parallelism() {
    for (file, seq, up) in [
        ("gpt3-175b.json", 2048, "mlp.fc1.weight"),
        ("llama2-70b.json", 4096, "mlp.gate_up.weight"),
    ] {
        let g = lower(file, 1, Some(seq), 8);
        let (m, c) = mesh(1, 8);
        let plan = solve(&g, block(&g), &m, StageOptions::default());
        // Weights are (in, out): column-parallel splits out, row-parallel splits in, over the
        // 8 GPUs of the node (mesh axis 1).
        for (suffix, spec) in [
            ("attention.qkv.weight", "RS1"),
            (up, "RS1"),
            ("attention.proj.weight", "S1R"),
            ("mlp.fc2.weight", "S1R"),
        ] {
            assert_eq!(param(&plan, suffix).weight, spec, "{file} {suffix}");
        }
        // Megatron-LM's partial sums, reduced into sequence shards (its sequence
        // parallelism): after attention and after the MLP, forward and backward, all over
        // the node's axis.
        assert_eq!(plan.count(Reason::PartialSum, Phase::Forward), 2, "{file}");
        assert_eq!(plan.count(Reason::PartialSum, Phase::Backward), 2, "{file}");
        assert!(plan.collectives.iter().all(|c| c.axis == 1), "{file}");
        // Megatron-LM's layout, with and without sequence parallelism, is a point of the
        // space: the optimum is never worse.
        let model = StageModel::build(&g, block(&g), m, &c.device, StageOptions::default())
            .unwrap_or_else(|e| panic!("{e}"));
        for sp in [false, true] {
            let pinned = model
                .megatron_plan(MegatronSharding {
                    sp,
                    distributed_optimizer: false,
                })
                .unwrap_or_else(|e| panic!("{file} sp {sp}: {e}"));
            assert!(
                plan.objective <= pinned.objective * (1.0 + 1e-12),
                "{file} sp {sp}: {} > {}",
                plan.objective,
                pinned.objective
            );
        }
    }
}

#[test]
fn across_nodes_gives_pure_data_parallelism() {
    let g = lower("gpt3-175b.json", 8, Some(2048), 8);
    let (m, _) = mesh(8, 1);
    let opts = StageOptions {
        microbatches: 64,
        ..StageOptions::default()
    };
    let plan = solve(&g, block(&g), &m, opts);
    // Every op splits the batch (the first dimension of each activation) over the 8 nodes.
    for op in &plan.ops {
        for spec in op.outputs.iter().chain(&op.inputs) {
            let activation = spec.len() > 3 || (spec.len() == 3 && !spec.starts_with('R'));
            if activation {
                assert!(spec.starts_with("S0"), "{}: {spec}", op.name);
            }
        }
    }
    // Weights are replicated; no collective inside a micro-batch; gradients are synchronised
    // once per step over the node axis.
    for p in &plan.parameters {
        assert!(
            p.weight.chars().all(|c| c == 'R'),
            "{}: {}",
            p.name,
            p.weight
        );
    }
    assert!(plan.collectives.iter().all(|c| c.phase == Phase::Step));
    assert!(plan.count(Reason::GradientSync, Phase::Step) >= plan.parameters.len());
    assert!(plan.collectives.iter().all(|c| c.axis == 0));
}

#[test]
fn a_tight_budget_shards_optimizer_states_then_weights() {
    let g = lower("gpt3-175b.json", 8, Some(2048), 8);
    let (m, _) = mesh(8, 1);
    let opts = |budget: Option<f64>, solver| StageOptions {
        microbatches: 64,
        memory_budget: budget,
        solver,
        ..StageOptions::default()
    };
    let matrices = |plan: &StagePlan| -> Vec<(String, String, String)> {
        plan.parameters
            .iter()
            .filter(|p| p.shape.len() == 2)
            .map(|p| (p.name.clone(), p.weight.clone(), p.states.clone()))
            .collect()
    };
    let free = solve(&g, block(&g), &m, opts(None, SolverChoice::Auto));
    let mem = free.memory;
    // Optimizer states as replicated as the weights would need the full states on every
    // device; a budget below that forces them to be sharded (ZeRO-1).
    let replicated_states = mem.total + mem.optimizer * (8.0 - 1.0);
    let budget = replicated_states - 0.5 * mem.optimizer * 7.0;
    let zero1 = solve(&g, block(&g), &m, opts(Some(budget), SolverChoice::Auto));
    assert!(zero1.memory.total <= budget * (1.0 + 1e-9));
    for (name, _, states) in matrices(&zero1) {
        assert!(states.contains("S0"), "{name}: states {states}");
    }
    // Below what replicated working weights and gradients need, the weights are sharded
    // too (ZeRO-3 / FSDP) and gathered for use, which costs time.
    let tight = 6.0 * GIB;
    assert!(mem.total > tight);
    let exact = solve(&g, block(&g), &m, opts(Some(tight), SolverChoice::Exact));
    let ilp = solve(&g, block(&g), &m, opts(Some(tight), SolverChoice::Ilp));
    assert_eq!(exact.solve.solver, "exact");
    for plan in [&exact, &ilp] {
        assert!(plan.memory.total <= tight * (1.0 + 1e-9));
        assert!(plan.objective > free.objective);
        assert!(plan.memory.weights < free.memory.weights);
        for (name, weight, states) in matrices(plan) {
            assert!(states.contains("S0"), "{name}: states {states}");
            // The large matrices at least; the attention projection (a quarter of the MLP's)
            // may stay whole when gathering it costs more than what sharding it saves.
            if !name.ends_with("attention.proj.weight") {
                assert!(weight.contains("S0"), "{name}: weight {weight}");
            }
        }
    }
    assert!(close(exact.objective, ilp.objective));
    assert!(close(exact.objective, exact.solve.cost));
}

#[test]
fn solve_sharding_reports_specs_collectives_memory_and_solver() {
    let ws = TempWorkspace::default_copy();
    let out = ws.run(&[
        "solve",
        "sharding",
        "--model",
        "gpt3-175b",
        "--mesh",
        "1x8",
        "--seq",
        "2048",
    ]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    for needle in [
        "on mesh 1x8",
        "solver exact (optimal)",
        "memory per device:",
        "layers.0.attention.qkv.weight",
        "all_reduce",
        "partial_sum",
    ] {
        assert!(out.stdout.contains(needle), "{needle} in\n{}", out.stdout);
    }
    let j = ws
        .run(&[
            "solve",
            "sharding",
            "--model",
            "gpt3-175b",
            "--mesh",
            "2x4",
            "--layers",
            "1..3",
            "--solver",
            "ilp",
            "--json",
        ])
        .json();
    assert_eq!(j["mesh"], serde_json::json!([2, 4]));
    assert_eq!(j["layers"], serde_json::json!([1, 3]));
    assert_eq!(j["layer_names"].as_array().map(Vec::len), Some(2));
    assert_eq!(j["solve"]["solver"], "ilp");
    assert!(j["ops"].as_array().is_some_and(|o| o.len() > 40));
    assert!(j["memory"]["total"].as_f64().is_some_and(|m| m > 0.0));
    assert!(j["objective"].as_f64().is_some_and(|t| t > 0.0));
}

#[test]
fn solve_sharding_rejects_bad_input() {
    let ws = TempWorkspace::default_copy();
    for (args, needle) in [
        (vec!["--mesh", "3x"], "--mesh: expected AxB"),
        (
            vec!["--mesh", "1x8", "--layers", "5..2"],
            "--layers: expected",
        ),
        (
            vec!["--mesh", "1x8", "--layers", "0..999"],
            "within the model's layers 0..98",
        ),
        (
            vec!["--mesh", "1x8", "--memory-gib", "0"],
            "--memory-gib: expected a positive",
        ),
        (vec!["--mesh", "4x4", "--cluster", "a100-80g:1x8"], "--mesh"),
    ] {
        let mut all = vec!["solve", "sharding", "--model", "gpt3-175b"];
        all.extend(args.iter().copied());
        let out = ws.run(&all);
        assert_eq!(out.code, 2, "{args:?}: {}", out.stderr);
        assert!(out.stderr.contains(needle), "{args:?}: {}", out.stderr);
    }
    // A budget nothing fits is a failed solve, not a usage error.
    let out = ws.run(&[
        "solve",
        "sharding",
        "--model",
        "gpt3-175b",
        "--mesh",
        "1x8",
        "--memory-gib",
        "0.5",
    ]);
    assert_eq!(out.code, 1, "{}", out.stderr);
    assert!(
        out.stderr.contains("no sharding fits 0.50 GiB"),
        "{}",
        out.stderr
    );
}
