//! Benchmark of D-Rec against the optimum (issue: D-Rec as a linear-time sharding solver).
//!
//! * `blocks`: the first transformer block of each dense model the default workspace plans
//!   (GPT-3 175B, LLaMA-2 70B, LLaMA-3 8B, GPT-2 small; micro-batch 1, their own sequence
//!   length) on H100 meshes 1x8, 2x4, 4x8 and 8x1, under the device's memory (`hbm`) and
//!   under a budget halfway between the leanest plan and the unconstrained optimum (`tight`):
//!   the exact solver's optimum, D-Rec's objective, the gap, and both solve times.
//! * `graphs`: generated graph files (`autopar_tests::graphs`: stacked transformer and MLP
//!   blocks, U-Net-like units) of about 100, 1,000, 5,000 and 20,000 forward ops, the whole
//!   range on 1x8 and 2x4, no memory budget: the time to build D-Rec's problem, its solve
//!   time and objective, and the exact optimum up to 1,000 forward ops (beyond, the exact
//!   solver takes from seconds to minutes: 22 s at 5,000).
//!
//! * `tables`: the same blocks' layer tables on the same meshes (what the build's ILP space
//!   solves per layer), by the exact elimination and by D-Rec (one run per pinned pair of
//!   boundary states): the time to fill each, D-Rec's runs, and the cost of every block of
//!   the model chained through each table, with the gap.
//!
//! `cargo run --release -p autopar-tests --bin autopar-bench-drec [-- REPEATS] [SECTION...]`
//! (sections `blocks`, `graphs`, `tables`; all by default)

use autopar_rules::cost::memory::Precision;
use autopar_rules::model::frontend::parse_graph_file;
use autopar_rules::model::graph::{DType, Graph, LayerKind, Pass};
use autopar_rules::plan::runtime::Runtime;
use autopar_rules::solve::intra::chain::{LayerTable, best_path, layer_table};
use autopar_rules::solve::intra::stage::{SolverChoice, StageModel, StageOptions, StagePlan};
use autopar_tests::graphs::{Family, graph_file};
use autopar_tests::sharding::{lower, mesh};
use std::ops::Range;
use std::process::ExitCode;
use std::time::Instant;

/// (model file, sequence length) of the blocks measured.
const MODELS: [(&str, u64); 4] = [
    ("gpt3-175b.json", 2048),
    ("llama2-70b.json", 4096),
    ("llama3-8b.json", 8192),
    ("gpt2-small.json", 1024),
];
/// Meshes measured, nodes x GPUs.
const MESHES: [(u64, u64); 4] = [(1, 8), (2, 4), (4, 8), (8, 1)];
/// Forward ops of the generated graphs (about).
const SIZES: [usize; 4] = [100, 1_000, 5_000, 20_000];
/// Largest generated graph whose optimum is computed.
const EXACT_UP_TO: usize = 1_000;

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// A problem solved: the plan, the time to build the problem, the median time the solver
/// reports (choosing every strategy) and the median time to turn its choice into the plan
/// (every op's specs, the collectives, memory: the same for every solver), ms.
struct Solved {
    plan: StagePlan,
    build_ms: f64,
    solve_ms: f64,
    plan_ms: f64,
}

/// Builds the problem of `layers` of `graph` on `a x b` once and solves it `repeats` times.
fn solve(
    graph: &Graph,
    layers: Range<usize>,
    (a, b): (u64, u64),
    opts: StageOptions,
    repeats: usize,
) -> Result<Solved, String> {
    let (m, cluster) = mesh(a, b);
    let start = Instant::now();
    let model =
        StageModel::build(graph, layers, m, &cluster.device, opts).map_err(|e| e.to_string())?;
    let build_ms = start.elapsed().as_secs_f64() * 1e3;
    let (mut solver, mut decode) = (Vec::new(), Vec::new());
    let mut plan = None;
    for _ in 0..repeats {
        let start = Instant::now();
        let solved = model.solve().map_err(|e| e.to_string())?;
        let total = start.elapsed().as_secs_f64() * 1e3;
        solver.push(solved.solve.seconds * 1e3);
        decode.push(total - solved.solve.seconds * 1e3);
        plan = Some(solved);
    }
    Ok(Solved {
        plan: plan.ok_or("no repeats")?,
        build_ms,
        solve_ms: median(solver),
        plan_ms: median(decode),
    })
}

/// The options `autopar solve sharding` solves with (the default runtime's gradient buffers).
fn opts(solver: SolverChoice, budget: Option<f64>) -> StageOptions<'static> {
    let runtime = Runtime::default();
    StageOptions {
        solver,
        memory_budget: budget,
        grad_accumulation_fusion: runtime.grad_accumulation_fusion(),
        grad_reduce_in_fp32: runtime.grad_reduce_in_fp32(Precision::Bf16),
        ..StageOptions::default()
    }
}

fn gap(drec: f64, optimum: f64) -> f64 {
    (drec / optimum - 1.0) * 100.0
}

fn blocks(repeats: usize) -> Result<Vec<f64>, String> {
    println!(
        "{:<11} {:<5} {:<6} {:>4} {:>10} {:>13} {:>12} {:>8} {:>9} {:>8}",
        "block",
        "mesh",
        "budget",
        "vars",
        "strategies",
        "optimum ms",
        "D-Rec ms",
        "gap",
        "exact ms",
        "D-Rec ms"
    );
    let mut gaps = Vec::new();
    for (file, seq) in MODELS {
        for (a, b) in MESHES {
            let graph = lower(file, 1, Some(seq), a * b);
            let block = graph
                .layers
                .iter()
                .position(|l| l.kind == LayerKind::Block)
                .ok_or("no transformer block")?;
            let layers = block..block + 1;
            let (m, cluster) = mesh(a, b);
            let free = StageModel::build(
                &graph,
                layers.clone(),
                m,
                &cluster.device,
                opts(SolverChoice::Exact, None),
            )
            .map_err(|e| e.to_string())?;
            let lean = free.problem().leanest().memory;
            let free = free.solve().map_err(|e| e.to_string())?;
            for (name, budget) in [
                ("hbm", cluster.device.hbm_bytes),
                ("tight", 0.5 * (lean + free.memory.total)),
            ] {
                let exact = solve(
                    &graph,
                    layers.clone(),
                    (a, b),
                    opts(SolverChoice::Exact, Some(budget)),
                    repeats,
                )?;
                let drec = solve(
                    &graph,
                    layers.clone(),
                    (a, b),
                    opts(SolverChoice::Drec, Some(budget)),
                    repeats,
                )?;
                let (exact_ms, drec_ms) = (exact.solve_ms, drec.solve_ms);
                let (exact, drec) = (exact.plan, drec.plan);
                if drec.memory.total > budget * (1.0 + 1e-9) {
                    return Err(format!(
                        "{file} on {a}x{b} ({name}): D-Rec's plan is over the budget"
                    ));
                }
                let g = gap(drec.objective, exact.objective);
                gaps.push(g);
                println!(
                    "{:<11} {:<5} {:<6} {:>4} {:>10} {:>13.4} {:>12.4} {:>7.1}% {:>9.2} {:>8.2}",
                    file.trim_end_matches(".json"),
                    format!("{a}x{b}"),
                    name,
                    drec.solve.variables,
                    drec.solve.strategies,
                    exact.objective * 1e3,
                    drec.objective * 1e3,
                    g,
                    exact_ms,
                    drec_ms
                );
            }
        }
    }
    Ok(gaps)
}

fn graphs(repeats: usize) -> Result<(), String> {
    println!(
        "{:<11} {:>7} {:>7} {:<5} {:>6} {:>9} {:>9} {:>10} {:>8} {:>13} {:>13} {:>8} {:>9}",
        "graph",
        "fwd ops",
        "IR ops",
        "mesh",
        "vars",
        "strategies",
        "build ms",
        "D-Rec ms",
        "plan ms",
        "D-Rec obj ms",
        "optimum ms",
        "gap",
        "exact ms"
    );
    for family in [Family::Transformer, Family::Mlp, Family::UNet] {
        for size in SIZES {
            let units = (size.saturating_sub(4) / family.ops_per_unit()).max(1);
            let text = graph_file(family, units);
            let graph = parse_graph_file(&text)
                .and_then(|s| s.lower(1, 2048, DType::Bf16))
                .map_err(|e| format!("{} x {units}: {e}", family.name()))?;
            let forward = graph.ops.iter().filter(|o| o.pass == Pass::Forward).count();
            let all = 0..graph.layers.len();
            for shape in [(1, 8), (2, 4)] {
                let Solved {
                    plan: drec,
                    build_ms,
                    solve_ms: drec_ms,
                    plan_ms,
                } = solve(
                    &graph,
                    all.clone(),
                    shape,
                    opts(SolverChoice::Drec, None),
                    repeats,
                )?;
                let exact = if forward <= EXACT_UP_TO {
                    Some(solve(
                        &graph,
                        all.clone(),
                        shape,
                        opts(SolverChoice::Exact, None),
                        1,
                    )?)
                } else {
                    None
                };
                let (optimum, g, exact_ms) = match &exact {
                    Some(e) => (
                        format!("{:.3}", e.plan.objective * 1e3),
                        format!("{:.1}%", gap(drec.objective, e.plan.objective)),
                        format!("{:.0}", e.solve_ms),
                    ),
                    None => ("-".into(), "-".into(), "-".into()),
                };
                println!(
                    "{:<11} {:>7} {:>7} {:<5} {:>6} {:>9} {:>9.0} {:>10.1} {:>8.1} {:>13.3} {:>13} {:>8} {:>9}",
                    family.name(),
                    forward,
                    graph.ops.len(),
                    format!("{}x{}", shape.0, shape.1),
                    drec.solve.variables,
                    drec.solve.strategies,
                    build_ms,
                    drec_ms,
                    plan_ms,
                    drec.objective * 1e3,
                    optimum,
                    g,
                    exact_ms
                );
            }
        }
    }
    Ok(())
}

/// A block's table by `solver` on `a x b`: the table and the median time to fill it, ms.
fn table(
    graph: &Graph,
    block: usize,
    (a, b): (u64, u64),
    solver: SolverChoice,
    repeats: usize,
) -> Result<(LayerTable, f64), String> {
    let (m, cluster) = mesh(a, b);
    let mut times = Vec::new();
    let mut last = None;
    for _ in 0..repeats {
        let t = Instant::now();
        let filled = layer_table(graph, block, m, &cluster.device, opts(solver, None))
            .map_err(|e| e.to_string())?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
        last = Some(filled);
    }
    Ok((last.ok_or("no repeat")?, median(times)))
}

fn tables(repeats: usize) -> Result<Vec<f64>, String> {
    println!(
        "{:<11} {:<5} {:>6} {:>9} {:>9} {:>6} {:>14} {:>14} {:>8}",
        "block",
        "mesh",
        "blocks",
        "exact ms",
        "D-Rec ms",
        "runs",
        "exact chain ms",
        "D-Rec chain ms",
        "gap"
    );
    let mut gaps = Vec::new();
    for (file, seq) in MODELS {
        for shape in MESHES {
            let graph = lower(file, 1, Some(seq), shape.0 * shape.1);
            let blocks: Vec<usize> = (0..graph.layers.len())
                .filter(|&l| graph.layers[l].kind == LayerKind::Block)
                .collect();
            let first = *blocks.first().ok_or("no transformer block")?;
            let (exact, exact_ms) = table(&graph, first, shape, SolverChoice::Exact, repeats)?;
            let (drec, drec_ms) = table(&graph, first, shape, SolverChoice::Drec, repeats)?;
            // Identical blocks share one table: the chain of all of them.
            let chained = |t: &LayerTable| -> Result<f64, String> {
                let refs = vec![t; blocks.len()];
                best_path(&refs)
                    .map_err(|e| e.to_string())?
                    .map(|(e, _)| e.cost)
                    .ok_or_else(|| format!("{file}: no path"))
            };
            let (x, d) = (chained(&exact)?, chained(&drec)?);
            let g = gap(d, x);
            gaps.push(g);
            println!(
                "{:<11} {:<5} {:>6} {:>9.1} {:>9.1} {:>6} {:>14.3} {:>14.3} {:>7.1}%",
                file.trim_end_matches(".json"),
                format!("{}x{}", shape.0, shape.1),
                blocks.len(),
                exact_ms,
                drec_ms,
                drec.solves,
                x * 1e3,
                d * 1e3,
                g
            );
        }
    }
    Ok(gaps)
}

/// Sections, in the order they run.
const SECTIONS: [&str; 3] = ["blocks", "graphs", "tables"];

/// Mean and largest of `gaps`, %.
fn spread(gaps: &[f64]) -> (f64, f64) {
    let worst = gaps.iter().copied().fold(0.0, f64::max);
    (gaps.iter().sum::<f64>() / gaps.len().max(1) as f64, worst)
}

/// Runs the sections `runs` accepts.
fn run(repeats: usize, runs: impl Fn(&str) -> bool) -> Result<(), String> {
    if runs("blocks") {
        let (mean, worst) = spread(&blocks(repeats)?);
        println!(
            "blocks: D-Rec above the optimum by {mean:.1}% on average, {worst:.1}% at worst\n"
        );
    }
    if runs("graphs") {
        graphs(repeats)?;
        println!();
    }
    if runs("tables") {
        let (mean, worst) = spread(&tables(repeats)?);
        println!(
            "tables: D-Rec's chained blocks above the exact chain by {mean:.2}% on average, {worst:.2}% at worst\n"
        );
    }
    println!(
        "(times: median of {repeats}; solve: the time the solver reports; plan: turning its \
         choice into the plan; build: the problem's strategies and tables, once)"
    );
    Ok(())
}

fn main() -> ExitCode {
    let usage = || {
        eprintln!("usage: autopar-bench-drec [REPEATS > 0] [blocks] [graphs] [tables]");
        ExitCode::from(2)
    };
    let mut repeats = 3;
    let mut chosen = Vec::new();
    for (i, arg) in std::env::args().skip(1).enumerate() {
        match arg.parse::<usize>() {
            Ok(n) if i == 0 && n > 0 => repeats = n,
            _ if SECTIONS.contains(&arg.as_str()) => chosen.push(arg),
            _ => return usage(),
        }
    }
    let runs = |section: &str| chosen.is_empty() || chosen.iter().any(|c| c == section);
    match run(repeats, runs) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    }
}
