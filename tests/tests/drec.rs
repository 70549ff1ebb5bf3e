//! D-Rec (`solve sharding --solver drec`): on transformer blocks and generated graphs it stays
//! within the documented bound of the exact optimum and never returns a plan over the budget;
//! its plans have the structure of the exact solver's; `auto` switches to it above
//! `AUTO_DREC_VARIABLES`; ops it cannot cut stay replicated with a warning.

use autopar_rules::cost::sharding::Mesh;
use autopar_rules::model::frontend::parse_graph_file;
use autopar_rules::model::graph::{DType, Graph, LayerKind};
use autopar_rules::solve::intra::stage::{
    AUTO_DREC_VARIABLES, SolverChoice, StageModel, StageOptions, StagePlan,
};
use autopar_tests::TempWorkspace;
use autopar_tests::graphs::{Family, graph_file};
use autopar_tests::sharding::{lower, mesh};
use std::ops::Range;

/// How far above the optimum D-Rec may land on these cases (README, "Intra-operator
/// sharding"): the worst measured is 25.5%, GPT-2 small's block on 2x1 under a budget that
/// binds; without a binding budget the default models' blocks stay within 12.4%.
const BOUND: f64 = 0.30;

fn model<'a>(
    graph: &'a Graph,
    layers: Range<usize>,
    m: Mesh,
    opts: StageOptions<'a>,
) -> StageModel<'a> {
    let device = autopar_tests::sharding::cluster_for(m.shape[0], m.shape[1]).device;
    StageModel::build(graph, layers.clone(), m, &device, opts)
        .unwrap_or_else(|e| panic!("layers {layers:?}: {e}"))
}

fn with(solver: SolverChoice, budget: Option<f64>) -> StageOptions<'static> {
    StageOptions {
        solver,
        memory_budget: budget,
        ..StageOptions::default()
    }
}

/// D-Rec's plan against the exact one on `layers`, unconstrained and under a budget halfway
/// between the leanest plan and the unconstrained optimum; returns the worst gap.
fn check(graph: &Graph, layers: Range<usize>, (a, b): (u64, u64), at: &str) -> f64 {
    let (m, _) = mesh(a, b);
    let free = model(graph, layers.clone(), m, with(SolverChoice::Exact, None));
    let lean = free.problem().leanest().memory;
    let unconstrained = free.solve().unwrap_or_else(|e| panic!("{at}: {e}"));
    let mut worst: f64 = 0.0;
    for budget in [None, Some(0.5 * (lean + unconstrained.memory.total))] {
        let solve = |solver| -> StagePlan {
            model(graph, layers.clone(), m, with(solver, budget))
                .solve()
                .unwrap_or_else(|e| panic!("{at} ({budget:?}): {e}"))
        };
        let (exact, drec) = (solve(SolverChoice::Exact), solve(SolverChoice::Drec));
        assert_eq!(drec.solve.solver, "drec", "{at}");
        assert!(!drec.solve.optimal, "{at}: D-Rec proves nothing");
        if let Some(budget) = budget {
            assert!(
                drec.memory.total <= budget * (1.0 + 1e-9),
                "{at}: {} over the budget {budget}",
                drec.memory.total
            );
        }
        // The same plan structure: every op and parameter with its specs.
        assert_eq!(drec.ops.len(), exact.ops.len(), "{at}");
        assert_eq!(drec.parameters.len(), exact.parameters.len(), "{at}");
        let gap = drec.objective / exact.objective - 1.0;
        assert!(
            gap >= -1e-9,
            "{at}: D-Rec {} below the optimum {}",
            drec.objective,
            exact.objective
        );
        assert!(
            gap <= BOUND,
            "{at} ({budget:?}): D-Rec {} is {:.1}% above the optimum {}",
            drec.objective,
            gap * 100.0,
            exact.objective
        );
        // What it reports is what its plan costs.
        assert!(
            (drec.solve.cost - drec.objective).abs() <= 1e-9 * drec.objective,
            "{at}"
        );
        worst = worst.max(gap);
    }
    worst
}

#[test]
fn drec_stays_within_the_bound_on_transformer_blocks() {
    let mut worst: f64 = 0.0;
    for file in ["gpt2-small.json", "llama2-7b.json"] {
        let g = lower(file, 1, Some(512), 8);
        let block = g
            .layers
            .iter()
            .position(|l| l.kind == LayerKind::Block)
            .expect("a transformer block");
        for shape in [(1, 2), (2, 1), (2, 2), (1, 4), (2, 4)] {
            let at = format!("{file} block on {}x{}", shape.0, shape.1);
            worst = worst.max(check(&g, block..block + 1, shape, &at));
        }
    }
    println!("worst D-Rec gap on the blocks: {:.2}%", worst * 100.0);
}

#[test]
fn drec_stays_within_the_bound_on_generated_graphs() {
    let mut worst: f64 = 0.0;
    for family in [Family::Transformer, Family::Mlp, Family::UNet] {
        let g = parse_graph_file(&graph_file(family, 3))
            .and_then(|s| s.lower(1, 512, DType::Bf16))
            .unwrap_or_else(|e| panic!("{family:?}: {e}"));
        for shape in [(1, 4), (2, 2)] {
            let at = format!("{} x 3 on {}x{}", family.name(), shape.0, shape.1);
            worst = worst.max(check(&g, 0..g.layers.len(), shape, &at));
        }
    }
    println!(
        "worst D-Rec gap on the generated graphs: {:.2}%",
        worst * 100.0
    );
}

#[test]
fn auto_takes_drec_above_the_documented_size_only() {
    let (m, _) = mesh(1, 2);
    let small = parse_graph_file(&graph_file(Family::Mlp, 4))
        .and_then(|s| s.lower(1, 256, DType::Bf16))
        .expect("a small graph");
    let plan = model(
        &small,
        0..small.layers.len(),
        m,
        with(SolverChoice::Auto, None),
    )
    .solve()
    .expect("solved");
    assert_eq!(plan.solve.solver, "exact");
    // Enough MLP units for more variables than the limit.
    let units = AUTO_DREC_VARIABLES / 10;
    let large = parse_graph_file(&graph_file(Family::Mlp, units))
        .and_then(|s| s.lower(1, 256, DType::Bf16))
        .expect("a large graph");
    let built = model(
        &large,
        0..large.layers.len(),
        m,
        with(SolverChoice::Auto, None),
    );
    assert!(built.problem().vars.len() > AUTO_DREC_VARIABLES);
    let plan = built.solve().expect("solved");
    assert_eq!(plan.solve.solver, "drec");
}

#[test]
fn solve_sharding_runs_drec_from_the_command_line() {
    let ws = TempWorkspace::default_copy();
    let args = |solver: &'static str| {
        vec![
            "solve",
            "sharding",
            "--model",
            "gpt2-small",
            "--mesh",
            "2x2",
            "--seq",
            "512",
            "--solver",
            solver,
        ]
    };
    let text = ws.run(&args("drec"));
    assert_eq!(text.code, 0, "{}", text.stderr);
    assert!(
        text.stdout
            .contains("solver drec (heuristic, not proven optimal)"),
        "{}",
        text.stdout
    );
    let json = |solver: &'static str| {
        let mut a = args(solver);
        a.push("--json");
        let out = ws.run(&a);
        assert_eq!(out.code, 0, "{}", out.stderr);
        out.json()
    };
    let (drec, exact) = (json("drec"), json("exact"));
    assert_eq!(drec["solve"]["solver"], "drec");
    assert_eq!(drec["solve"]["optimal"], false);
    let objective = |v: &serde_json::Value| v["objective"].as_f64().expect("objective");
    assert!(objective(&drec) >= objective(&exact) * (1.0 - 1e-9));
    assert!(objective(&drec) <= objective(&exact) * (1.0 + BOUND));
}

#[test]
fn ops_nothing_can_cut_stay_replicated_with_a_warning() {
    // No dimension of the MLP graph (1024, 4096, 32768 wide, 1024 tokens) divides by 3.
    let ws = TempWorkspace::default_copy();
    let out = ws.run(&[
        "solve",
        "sharding",
        "--model",
        "models/tiny-mlp.graph.json",
        "--mesh",
        "1x3",
        "--layers",
        "0..4",
        "--solver",
        "drec",
        "--json",
    ]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        out.stderr.contains("warning: op `") && out.stderr.contains("kept replicated"),
        "{}",
        out.stderr
    );
    let plan = out.json();
    let ops = plan["ops"].as_array().expect("ops");
    assert!(!ops.is_empty());
    for op in ops {
        for spec in op["inputs"].as_array().into_iter().flatten() {
            let spec = spec.as_str().unwrap_or_default();
            assert!(!spec.contains('S'), "{op}: split on a mesh nothing divides");
        }
    }
}
