//! Benchmark of the intra-op pass: solve time of one transformer block of GPT-3 175B and
//! LLaMA-2 70B on meshes 1x8, 2x4, 4x8 and 8x8 of H100s, for each solver, under the device's
//! memory (`hbm`) and under a budget halfway between the leanest plan's memory and the
//! unconstrained optimum's (`tight`, which excludes the unconstrained optimum). Prints a
//! table of the problem size, the median and p95 solve time (dominance pruning included), the
//! time to generate the strategies, and the objective each solver reached.
//!
//! `cargo run --release -p autopar-tests --bin autopar-bench-sharding [-- REPEATS]`

use autopar_rules::solve::intra::stage::{SolverChoice, StageModel, StageOptions, StagePlan};
use autopar_tests::sharding::{lower, mesh};
use std::process::ExitCode;
use std::time::Instant;

/// (model file, sequence length) of the blocks measured.
const MODELS: [(&str, u64); 2] = [("gpt3-175b.json", 2048), ("llama2-70b.json", 4096)];
/// Meshes measured, nodes x GPUs.
const MESHES: [(u64, u64); 4] = [(1, 8), (2, 4), (4, 8), (8, 8)];

fn quantile(sorted: &[f64], q: f64) -> f64 {
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[i]
}

struct Row {
    model: String,
    mesh: String,
    budget: &'static str,
    solver: &'static str,
    variables: usize,
    strategies: String,
    width: f64,
    generate_ms: f64,
    median_ms: f64,
    p95_ms: f64,
    objective_ms: f64,
}

fn measure(
    file: &str,
    seq: u64,
    (a, b): (u64, u64),
    solver: SolverChoice,
    tight: bool,
    repeats: usize,
) -> Result<Row, String> {
    let graph = lower(file, 1, Some(seq), a * b);
    let (m, cluster) = mesh(a, b);
    let first_block = graph
        .layers
        .iter()
        .position(|l| l.kind == autopar_rules::model::graph::LayerKind::Block)
        .ok_or("no transformer block")?;
    let layers = first_block..first_block + 1;
    let budget = if tight {
        let free = StageModel::build(
            &graph,
            layers.clone(),
            m,
            &cluster.device,
            StageOptions::default(),
        )
        .and_then(|model| model.solve())
        .map_err(|e| e.to_string())?;
        let lean = StageModel::build(
            &graph,
            layers.clone(),
            m,
            &cluster.device,
            StageOptions::default(),
        )
        .map_err(|e| e.to_string())?
        .problem()
        .leanest();
        0.5 * (lean.memory + free.memory.total)
    } else {
        cluster.device.hbm_bytes
    };
    let opts = StageOptions {
        memory_budget: Some(budget),
        solver,
        ..StageOptions::default()
    };
    let start = Instant::now();
    let model =
        StageModel::build(&graph, layers, m, &cluster.device, opts).map_err(|e| e.to_string())?;
    let generate_ms = start.elapsed().as_secs_f64() * 1e3;
    let mut times = Vec::with_capacity(repeats);
    let mut last: Option<StagePlan> = None;
    for _ in 0..repeats {
        let start = Instant::now();
        let plan = model.solve().map_err(|e| e.to_string())?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
        last = Some(plan);
    }
    times.sort_by(f64::total_cmp);
    let plan = last.ok_or("no repeats")?;
    let s = &plan.solve;
    Ok(Row {
        model: file.trim_end_matches(".json").to_string(),
        mesh: format!("{a}x{b}"),
        budget: if tight { "tight" } else { "hbm" },
        solver: match solver {
            SolverChoice::Ilp => "ilp",
            _ => "exact",
        },
        variables: s.variables,
        strategies: format!("{}/{}", s.undominated, s.strategies),
        width: s.width,
        generate_ms,
        median_ms: quantile(&times, 0.5),
        p95_ms: quantile(&times, 0.95),
        objective_ms: plan.objective * 1e3,
    })
}

fn main() -> ExitCode {
    let repeats: usize = match std::env::args().nth(1).map(|a| a.parse()) {
        None => 21,
        Some(Ok(n)) if n > 0 => n,
        Some(_) => {
            eprintln!("usage: autopar-bench-sharding [REPEATS > 0]");
            return ExitCode::from(2);
        }
    };
    let mut rows = Vec::new();
    for tight in [false, true] {
        for (file, seq) in MODELS {
            for shape in MESHES {
                for solver in [SolverChoice::Exact, SolverChoice::Ilp] {
                    match measure(file, seq, shape, solver, tight, repeats) {
                        Ok(r) => rows.push(r),
                        Err(e) => {
                            eprintln!("{file} on {}x{}: {e}", shape.0, shape.1);
                            return ExitCode::FAILURE;
                        }
                    }
                }
            }
        }
    }
    println!(
        "{:<11} {:<5} {:<6} {:<6} {:>4} {:>10} {:>9} {:>7} {:>10} {:>8} {:>13}",
        "block",
        "mesh",
        "budget",
        "solver",
        "vars",
        "strategies",
        "factor",
        "gen ms",
        "median ms",
        "p95 ms",
        "objective ms"
    );
    for r in &rows {
        println!(
            "{:<11} {:<5} {:<6} {:<6} {:>4} {:>10} {:>9.0} {:>7.1} {:>10.1} {:>8.1} {:>13.4}",
            r.model,
            r.mesh,
            r.budget,
            r.solver,
            r.variables,
            r.strategies,
            r.width,
            r.generate_ms,
            r.median_ms,
            r.p95_ms,
            r.objective_ms
        );
    }
    println!(
        "({repeats} solves each; strategies = undominated/all; factor = largest factor of the exact solver)"
    );
    ExitCode::SUCCESS
}
