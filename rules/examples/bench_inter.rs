//! Benchmark of the stage-construction DP (issue figures): random instances on clusters of
//! 8-GPU hosts with every submesh shape of the cluster, 3 logical-mesh configurations and 128
//! micro-batches. Prints one row per size: median and maximum wall time over several seeds.
//!
//! `cargo run --release -p autopar-rules --example bench_inter`

use autopar_rules::solve::inter::{StageOptions, StageProblem, solve, submesh_choices};
use std::time::Instant;

/// A small deterministic generator (SplitMix64), so runs are reproducible.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Layers with random work; a stage's cost is its work over the submesh's devices, with
/// diminishing returns for larger submeshes (communication grows with them: exponent 0.8), a
/// per-configuration efficiency and a per-(stage, submesh) noise. Memory allows as many
/// following stages as the per-device share of the stage's weights and activations leaves room
/// for; the model's weights need a quarter of the cluster's memory.
fn instance(layers: usize, hosts: u64, seed: u64) -> StageProblem {
    let mut rng = Rng(seed);
    let per_host = 8;
    let submeshes = submesh_choices(hosts, per_host, false);
    let configs = 3;
    let work: Vec<f64> = (0..layers).map(|_| 0.5 + rng.next()).collect();
    let eff: Vec<f64> = (0..configs).map(|_| 0.6 + 0.4 * rng.next()).collect();
    let total_work: f64 = work.iter().sum();
    let devices = hosts * per_host;
    let n = layers * layers * submeshes.len() * configs;
    let mut cost = vec![-1.0; n];
    let mut max_succ = vec![-1i64; n];
    for k in 0..layers {
        let mut w = 0.0;
        for (i, &layer_work) in work.iter().enumerate().skip(k) {
            w += layer_work;
            for (s, &(h, m)) in submeshes.iter().enumerate() {
                let size = (h * m) as f64;
                let noise = 0.9 + 0.2 * rng.next();
                for (c, &e) in eff.iter().enumerate() {
                    let x = ((k * layers + i) * submeshes.len() + s) * configs + c;
                    cost[x] = w / (size.powf(0.8) * e) * noise;
                    // Weights and one micro-batch of activations per device, in units of the
                    // device memory.
                    let share = w / total_work * devices as f64 / size;
                    let room = 1.0 - 0.25 * share;
                    let act = 0.02 * share * (1.0 + 0.5 * c as f64);
                    max_succ[x] = if room <= 0.0 {
                        -1
                    } else {
                        (room / act).floor() as i64 - 1
                    };
                }
            }
        }
    }
    StageProblem {
        layers,
        submeshes,
        configs,
        cost,
        max_succ,
        devices,
        microbatches: 128,
    }
}

fn main() {
    println!(
        "{:>4} {:>6} {:>4} {:>2} {:>12} {:>12} {:>8} {:>7}",
        "L", "D", "S", "C", "median (s)", "max (s)", "bounds", "stages"
    );
    for (layers, hosts, runs) in [
        (16, 8, 5),
        (24, 16, 5),
        (32, 16, 5),
        (48, 32, 5),
        (64, 128, 3),
    ] {
        let mut times = Vec::new();
        let (mut bounds, mut stages, mut s) = (0, 0, 0);
        for seed in 0..runs {
            let p = instance(layers, hosts, seed);
            s = p.submeshes.len();
            let start = Instant::now();
            let plan = solve(p, StageOptions::default()).expect("feasible instance");
            times.push(start.elapsed().as_secs_f64());
            bounds = bounds.max(plan.bounds_evaluated);
            stages = stages.max(plan.stages.len());
        }
        times.sort_by(f64::total_cmp);
        println!(
            "{:>4} {:>6} {:>4} {:>2} {:>12.3} {:>12.3} {:>8} {:>7}",
            layers,
            hosts * 8,
            s,
            3,
            times[times.len() / 2],
            times[times.len() - 1],
            bounds,
            stages
        );
    }
}
