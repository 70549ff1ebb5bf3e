//! Benchmark of `solve pipeline` (Alpa's two levels from cached per-layer tables) on the
//! default workspace's GPU targets, one sequence per micro-batch: the time with every table
//! solved (cold), with every table already known (warm: what a rebuild with nothing changed
//! costs), the tables and eliminations, and the process's peak memory.
//!
//! `cargo run --release -p autopar-tests --bin autopar-bench-pipeline`

use autopar_engine::cache::Cache;
use autopar_engine::pipeline::CachedTables;
use autopar_rules::cost::cluster::Cluster;
use autopar_rules::cost::memory::Precision;
use autopar_rules::solve::intra::stage::SolverChoice;
use autopar_rules::solve::pipeline::{PipelineOptions, PipelinePlan, plan_pipeline_with};
use autopar_tests::sharding::lower;
use std::process::ExitCode;
use std::time::Instant;

fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

/// Target, model file, preset, nodes, GPUs per node, global batch, sequence, and whether
/// multi-node submeshes are powers of two.
type Target = (
    &'static str,
    &'static str,
    &'static str,
    u64,
    u64,
    u64,
    u64,
    bool,
);

fn main() -> ExitCode {
    let targets: [Target; 4] = [
        (
            "gpt3-175b",
            "gpt3-175b.json",
            "a100-80g",
            128,
            8,
            1536,
            2048,
            true,
        ),
        (
            "llama2-70b",
            "llama2-70b.json",
            "h100-sxm",
            8,
            8,
            512,
            4096,
            false,
        ),
        (
            "llama3-8b",
            "llama3-8b.json",
            "h100-sxm",
            1,
            8,
            128,
            8192,
            false,
        ),
        (
            "gpt2-small",
            "gpt2-small.json",
            "a100-40g",
            1,
            8,
            512,
            1024,
            false,
        ),
    ];
    println!(
        "| target | cluster | mesh choices | tables | eliminations | cold | warm | stages | step | skipped |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut failed = false;
    for (name, file, dev, nodes, gpn, gbs, seq, pow2) in targets {
        let cluster =
            match Cluster::from_preset(&format!("{dev}:{nodes}x{gpn}"), dev, nodes, Some(gpn)) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("{name}: {e}");
                    return ExitCode::FAILURE;
                }
            };
        let graph = lower(file, 1, Some(seq), gpn);
        let opts = PipelineOptions {
            microbatches: gbs,
            memory_budget: cluster.device.hbm_bytes * 0.9,
            precision: Precision::Bf16,
            max_exact_entries: 4e6,
            max_table_work: autopar_rules::solve::intra::chain::MAX_TABLE_WORK,
            powers_of_two: pow2,
            logical_meshes: &[],
            recompute: true,
            grad_accumulation_fusion: true,
            grad_reduce_in_fp32: true,
            fp32_loss: false,
            tp_comm_overlap: false,
            profile: None,
            solver: SolverChoice::Auto,
        };
        // The engine's cached tables, in memory only: the second run finds every table.
        let cache = Cache::in_memory();
        let memo = CachedTables::new(&cache, name);
        let t = Instant::now();
        let cold = plan_pipeline_with(&graph, &cluster, opts, &memo);
        let cold_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let warm = plan_pipeline_with(&graph, &cluster, opts, &memo);
        let warm_s = t.elapsed().as_secs_f64();
        match (cold, warm) {
            (Ok(c), Ok(w)) if same(&c, &w) => println!(
                "| {name} | {} | {} | {} | {} | {cold_s:.2} s | {warm_s:.3} s | {} | {:.2} s | {} |",
                cluster.name,
                c.meshes,
                c.tables,
                c.solves,
                c.stages.len(),
                c.step,
                c.skipped.len()
            ),
            (c, w) => {
                eprintln!("{name}: cold {c:?}, warm {w:?}");
                failed = true;
            }
        }
    }
    println!("peak memory: {:.0} MiB", peak_rss_mib());
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// The two plans are the same but for how long each stage's decoding solve took.
fn same(a: &PipelinePlan, b: &PipelinePlan) -> bool {
    let untimed = |p: &PipelinePlan| {
        let mut p = p.clone();
        for st in &mut p.stages {
            st.plan.solve.seconds = 0.0;
        }
        p
    };
    untimed(a) == untimed(b)
}
