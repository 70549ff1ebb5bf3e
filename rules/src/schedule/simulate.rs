//! List-scheduling simulation of a pipeline step with uneven stages and chunks.
//!
//! Every stage runs its forward and backward blocks in the order its schedule prescribes
//! (GPipe, 1F1B, or Megatron-LM's interleaved 1F1B); a block starts when the stage is free and
//! its dependency is done: the forward of the previous virtual stage, or the backward of the
//! next one. This is exact for the schedules as implemented by Megatron-LM, whatever the stage
//! times, and reduces to the closed forms for equal stages.

use super::{Schedule, ideal_bubble};
use serde::{Deserialize, Serialize};

/// Times of one pipeline, per chunk `c` and stage `j`, indexed `[c][j]`. Virtual stage
/// `c * p + j` holds chunk `c` of stage `j`, as Megatron-LM numbers them.
#[derive(Clone, Debug, PartialEq)]
pub struct PipelineSpec {
    /// Schedule.
    pub schedule: Schedule,
    /// Micro-batches per step.
    pub microbatches: usize,
    /// Forward time of one micro-batch through a chunk, including sending its output.
    pub forward: Vec<Vec<f64>>,
    /// Backward time of one micro-batch through a chunk, including recomputation and sending
    /// the input gradient.
    pub backward: Vec<Vec<f64>>,
    /// The part of `backward` spent recomputing.
    pub recompute: Vec<Vec<f64>>,
    /// Activation bytes one micro-batch keeps on the chunk from its forward to its backward.
    pub activation: Vec<Vec<f64>>,
}

/// Why a pipeline cannot be simulated.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ScheduleError {
    /// The per-chunk tables disagree on their shape or are empty.
    #[error("per-chunk tables must all be chunks x stages and non-empty")]
    Shape,
    /// Megatron-LM's interleaved schedule needs the micro-batches to fill whole rounds.
    #[error(
        "interleaving needs the {microbatches} micro-batches to be a multiple of the {stages} stages"
    )]
    Interleave {
        /// Micro-batches.
        microbatches: usize,
        /// Stages.
        stages: usize,
    },
    /// No micro-batches.
    #[error("a step needs at least one micro-batch")]
    NoMicrobatches,
}

/// Forward or backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BlockKind {
    /// Forward of a chunk.
    Forward,
    /// Backward of a chunk.
    Backward,
}

/// One executed block of the timeline.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Block {
    /// Stage.
    pub stage: usize,
    /// Chunk on that stage.
    pub chunk: usize,
    /// Micro-batch.
    pub microbatch: usize,
    /// Forward or backward.
    pub kind: BlockKind,
    /// Start, s.
    pub start: f64,
    /// End, s.
    pub end: f64,
}

/// The bubble decomposition of ALGORITHMS.md §4: `real = ideal + imbalance + recompute`, as
/// fractions of the model's compute.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Bubble {
    /// `(p * makespan - C) / C` with `C` the compute without recomputation, summed over stages.
    pub real: f64,
    /// `(p - 1) / (v m)`.
    pub ideal: f64,
    /// What uneven stages cost: `real - ideal - recompute`.
    pub imbalance: f64,
    /// Recomputation over `C`.
    pub recompute: f64,
}

impl Bubble {
    /// The decomposition of a step of `p` stages, `m` micro-batches and `v` chunks per stage
    /// that took `makespan`, given the compute without recomputation and the recomputation,
    /// both summed over stages.
    pub fn of(p: usize, m: usize, v: usize, makespan: f64, compute: f64, recompute: f64) -> Self {
        if compute <= 0.0 {
            return Bubble {
                real: 0.0,
                ideal: 0.0,
                imbalance: 0.0,
                recompute: 0.0,
            };
        }
        // Rounding leaves a single stage's real bubble a hair below zero.
        let clean = |x: f64| if x.abs() < 1e-9 { 0.0 } else { x };
        let real = clean((p as f64 * makespan - compute) / compute);
        let ideal = ideal_bubble(p as u64, m as u64, v as u64);
        let rec = recompute / compute;
        Bubble {
            real,
            ideal,
            imbalance: clean(real - ideal - rec),
            recompute: rec,
        }
    }
}

/// Result of a simulation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Simulation {
    /// Every block, in the order it was scheduled.
    pub blocks: Vec<Block>,
    /// End of the last block, s.
    pub makespan: f64,
    /// Per stage: the most activation bytes alive at once.
    pub peak_activation: Vec<f64>,
    /// Per stage: the most micro-batch chunks in flight at once.
    pub peak_inflight: Vec<usize>,
    /// Bubble decomposition.
    pub bubble: Bubble,
}

/// One entry of a stage's program.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    /// Forward or backward.
    pub kind: BlockKind,
    /// Chunk of the stage.
    pub chunk: usize,
    /// Micro-batch.
    pub microbatch: usize,
}

/// The order in which stage `j` of `p` (with `v` chunks, `m` micro-batches) runs its blocks:
/// what the simulator times and what the executor runs. Interleaving (`v > 1`) needs `m` to
/// be a multiple of `p` ([`simulate`] checks).
pub fn stage_program(schedule: Schedule, j: usize, p: usize, v: usize, m: usize) -> Vec<Step> {
    let fwd = |chunk, microbatch| Step {
        kind: BlockKind::Forward,
        chunk,
        microbatch,
    };
    let bwd = |chunk, microbatch| Step {
        kind: BlockKind::Backward,
        chunk,
        microbatch,
    };
    match schedule {
        Schedule::GPipe => {
            let mut out = Vec::with_capacity(2 * m * v);
            for c in 0..v {
                out.extend((0..m).map(|mb| fwd(c, mb)));
            }
            for c in (0..v).rev() {
                out.extend((0..m).map(|mb| bwd(c, mb)));
            }
            out
        }
        Schedule::OneFOneB if v == 1 => {
            let warmup = (p - j - 1).min(m);
            let mut out = Vec::with_capacity(2 * m);
            out.extend((0..warmup).map(|mb| fwd(0, mb)));
            for i in 0..m - warmup {
                out.push(fwd(0, warmup + i));
                out.push(bwd(0, i));
            }
            out.extend((m - warmup..m).map(|mb| bwd(0, mb)));
            out
        }
        Schedule::OneFOneB => {
            // Megatron-LM's interleaved order over virtual micro-batches k = 0..m*v: rounds of
            // p micro-batches go through chunk 0, then chunk 1, ...; backwards in reverse chunk
            // order.
            let total = m * v;
            let microbatch = |k: usize| (k / (p * v)) * p + k % p;
            let chunk = |k: usize| (k / p) % v;
            let warmup = ((p - j - 1) * 2 + (v - 1) * p).min(total);
            let mut out = Vec::with_capacity(2 * total);
            out.extend((0..warmup).map(|k| fwd(chunk(k), microbatch(k))));
            for i in 0..total - warmup {
                let k = warmup + i;
                out.push(fwd(chunk(k), microbatch(k)));
                out.push(bwd(v - 1 - chunk(i), microbatch(i)));
            }
            out.extend((total - warmup..total).map(|k| bwd(v - 1 - chunk(k), microbatch(k))));
            out
        }
    }
}

/// The micro-batches of each chunk in flight on stage `j` after each of its forwards, keeping
/// only the counts no other moment exceeds on every chunk. Activation memory peaks at one of
/// these moments whatever the chunk sizes, so a memory constraint per profile is exact. Depends
/// only on the order of the stage's blocks, not on their times.
pub fn inflight_profiles(
    schedule: Schedule,
    j: usize,
    p: usize,
    v: usize,
    m: usize,
) -> Vec<Vec<u32>> {
    let mut held = vec![0u32; v];
    let mut profiles: Vec<Vec<u32>> = Vec::new();
    for step in stage_program(schedule, j, p, v, m) {
        match step.kind {
            BlockKind::Forward => {
                held[step.chunk] += 1;
                let dominated = profiles
                    .iter()
                    .any(|q| q.iter().zip(&held).all(|(a, b)| a >= b));
                if !dominated {
                    profiles.retain(|q| !q.iter().zip(&held).all(|(a, b)| a <= b));
                    profiles.push(held.clone());
                }
            }
            BlockKind::Backward => held[step.chunk] -= 1,
        }
    }
    profiles
}

/// Simulates one step of the pipeline.
pub fn simulate(spec: &PipelineSpec) -> Result<Simulation, ScheduleError> {
    let v = spec.forward.len();
    let p = spec.forward.first().map_or(0, Vec::len);
    let tables = [
        &spec.forward,
        &spec.backward,
        &spec.recompute,
        &spec.activation,
    ];
    if v == 0
        || p == 0
        || tables
            .iter()
            .any(|t| t.len() != v || t.iter().any(|r| r.len() != p))
    {
        return Err(ScheduleError::Shape);
    }
    let m = spec.microbatches;
    if m == 0 {
        return Err(ScheduleError::NoMicrobatches);
    }
    if spec.schedule == Schedule::OneFOneB && v > 1 && m % p != 0 {
        return Err(ScheduleError::Interleave {
            microbatches: m,
            stages: p,
        });
    }
    let programs: Vec<Vec<Step>> = (0..p)
        .map(|j| stage_program(spec.schedule, j, p, v, m))
        .collect();
    let vstages = p * v;
    // End times of forward and backward blocks, per micro-batch and virtual stage.
    let mut f_end = vec![f64::NAN; m * vstages];
    let mut b_end = vec![f64::NAN; m * vstages];
    let idx = |mb: usize, vs: usize| mb * vstages + vs;
    let mut next = vec![0usize; p];
    let mut free = vec![0.0f64; p];
    let mut held = vec![0.0f64; p];
    let mut held_count = vec![0usize; p];
    let mut peak_activation = vec![0.0f64; p];
    let mut peak_inflight = vec![0usize; p];
    let mut blocks = Vec::with_capacity(2 * m * vstages);
    let total_blocks = 2 * m * vstages;
    while blocks.len() < total_blocks {
        let mut progressed = false;
        for j in 0..p {
            while let Some(step) = programs[j].get(next[j]) {
                let vs = step.chunk * p + j;
                let ready = match step.kind {
                    BlockKind::Forward if vs == 0 => Some(0.0),
                    BlockKind::Forward => Some(f_end[idx(step.microbatch, vs - 1)]),
                    BlockKind::Backward if vs + 1 == vstages => {
                        Some(f_end[idx(step.microbatch, vs)])
                    }
                    BlockKind::Backward => Some(b_end[idx(step.microbatch, vs + 1)]),
                };
                let Some(ready) = ready.filter(|t| !t.is_nan()) else {
                    break;
                };
                let start = free[j].max(ready);
                let (duration, table) = match step.kind {
                    BlockKind::Forward => (spec.forward[step.chunk][j], &mut f_end),
                    BlockKind::Backward => (spec.backward[step.chunk][j], &mut b_end),
                };
                let end = start + duration;
                table[idx(step.microbatch, vs)] = end;
                free[j] = end;
                let act = spec.activation[step.chunk][j];
                match step.kind {
                    BlockKind::Forward => {
                        held[j] += act;
                        held_count[j] += 1;
                        peak_activation[j] = peak_activation[j].max(held[j]);
                        peak_inflight[j] = peak_inflight[j].max(held_count[j]);
                    }
                    BlockKind::Backward => {
                        held[j] -= act;
                        held_count[j] -= 1;
                    }
                }
                blocks.push(Block {
                    stage: j,
                    chunk: step.chunk,
                    microbatch: step.microbatch,
                    kind: step.kind,
                    start,
                    end,
                });
                next[j] += 1;
                progressed = true;
            }
        }
        // Every schedule above is deadlock-free; a stall would be a bug in `program`.
        debug_assert!(progressed, "pipeline simulation stalled");
        if !progressed {
            break;
        }
    }
    let makespan = free.iter().copied().fold(0.0, f64::max);
    let mf = m as f64;
    let sum = |t: &Vec<Vec<f64>>| t.iter().flatten().sum::<f64>() * mf;
    let recompute = sum(&spec.recompute);
    let compute = sum(&spec.forward) + sum(&spec.backward) - recompute;
    let bubble = Bubble::of(p, m, v, makespan, compute, recompute);
    Ok(Simulation {
        blocks,
        makespan,
        peak_activation,
        peak_inflight,
        bubble,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uniform(schedule: Schedule, p: usize, v: usize, m: usize, f: f64, b: f64) -> PipelineSpec {
        PipelineSpec {
            schedule,
            microbatches: m,
            forward: vec![vec![f; p]; v],
            backward: vec![vec![b; p]; v],
            recompute: vec![vec![0.0; p]; v],
            activation: vec![vec![1.0; p]; v],
        }
    }

    #[test]
    fn equal_stages_match_the_closed_forms() {
        for p in 1..=8usize {
            for m in [1usize, 2, 3, 8, 16, 24] {
                for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
                    let s = simulate(&uniform(schedule, p, 1, m, 1.0, 2.0)).expect("simulates");
                    let expect = (m + p - 1) as f64 * 3.0;
                    assert!(
                        (s.makespan - expect).abs() < 1e-9,
                        "{schedule:?} p={p} m={m}: {}",
                        s.makespan
                    );
                    assert!((s.bubble.real - s.bubble.ideal).abs() < 1e-9);
                    assert!(s.bubble.imbalance.abs() < 1e-9);
                    for j in 0..p {
                        let inflight = match schedule {
                            Schedule::GPipe => m,
                            Schedule::OneFOneB => (p - j).min(m),
                        };
                        assert_eq!(
                            s.peak_inflight[j], inflight,
                            "{schedule:?} p={p} m={m} j={j}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn interleaved_matches_megatrons_bubble() {
        for p in [2usize, 3, 4, 8] {
            for v in [2usize, 3, 4] {
                for rounds in [1usize, 2, 4] {
                    let m = p * rounds;
                    // A stage's work split evenly over its v chunks.
                    let (f, b) = (1.0 / v as f64, 2.0 / v as f64);
                    let s =
                        simulate(&uniform(Schedule::OneFOneB, p, v, m, f, b)).expect("simulates");
                    let expect = (m as f64 + (p - 1) as f64 / v as f64) * 3.0;
                    assert!(
                        (s.makespan - expect).abs() < 1e-9,
                        "p={p} v={v} m={m}: {} vs {expect}",
                        s.makespan
                    );
                    for j in 0..p {
                        let chunks = (2 * (p - j - 1) + (v - 1) * p + 1).min(m * v);
                        assert_eq!(s.peak_inflight[j], chunks, "p={p} v={v} m={m} j={j}");
                    }
                }
            }
        }
    }

    #[test]
    fn a_slow_stage_sets_the_pace() {
        let mut spec = uniform(Schedule::OneFOneB, 4, 1, 16, 1.0, 2.0);
        spec.forward[0][2] = 2.0;
        spec.backward[0][2] = 4.0;
        let s = simulate(&spec).expect("simulates");
        // The bottleneck stage runs every micro-batch: m x 6 is a lower bound; Alpa's closed
        // form (sum + (m - 1) max) over-counts the fill of a pipeline whose slow stage is not
        // the first one, so it bounds from above here.
        let closed = super::super::pipeline_time(&[3.0, 3.0, 6.0, 3.0], 16, 1);
        assert!(s.makespan >= 16.0 * 6.0, "{}", s.makespan);
        assert!(s.makespan <= closed, "{} > {closed}", s.makespan);
        // Stage 2 starts after two upstream forwards (2), idles once waiting for stage 3's
        // first backward (1), then runs its 16 x 6 without a gap; stages 1 and 0 finish the
        // last backward after it (2 + 2): 2 + 1 + 96 + 4 = 103.
        assert!((s.makespan - 103.0).abs() < 1e-9, "{}", s.makespan);
        assert!(s.bubble.imbalance > 0.0);
        // Dependencies hold in the timeline.
        for blk in &s.blocks {
            assert!(blk.end >= blk.start);
        }
    }

    #[test]
    fn recompute_is_separated_in_the_bubble() {
        let mut spec = uniform(Schedule::OneFOneB, 4, 1, 8, 1.0, 3.0);
        spec.recompute = vec![vec![1.0; 4]];
        let s = simulate(&spec).expect("simulates");
        // C = 4 stages x 8 micro-batches x (1 + 3 - 1); recompute = 4 x 8 x 1.
        assert!((s.bubble.recompute - 1.0 / 3.0).abs() < 1e-12);
        assert!(
            (s.bubble.real - s.bubble.ideal - s.bubble.recompute - s.bubble.imbalance).abs()
                < 1e-12
        );
        // Equal stages: what the definitions leave in `imbalance` is only the cross term
        // ideal x recompute (the fill and drain also recompute).
        let cross = s.bubble.ideal * s.bubble.recompute;
        assert!((s.bubble.imbalance - cross).abs() < 1e-12, "{:?}", s.bubble);
    }

    #[test]
    fn profiles_cover_the_peak_whatever_the_chunk_sizes() {
        for (p, v, m) in [
            (4usize, 1usize, 8usize),
            (4, 2, 8),
            (8, 2, 32),
            (8, 3, 16),
            (3, 4, 6),
        ] {
            for j in 0..p {
                let profiles = inflight_profiles(Schedule::OneFOneB, j, p, v, m);
                let most: u32 = profiles.iter().map(|q| q.iter().sum()).max().unwrap_or(0);
                let expect = if v == 1 {
                    (p - j).min(m)
                } else {
                    (2 * (p - j - 1) + (v - 1) * p + 1).min(m * v)
                };
                assert_eq!(most as usize, expect, "p={p} v={v} j={j}");
                // For any activation sizes, the simulated peak is the worst profile.
                for sizes in [
                    vec![1.0; v],
                    (0..v).map(|c| 1.0 + c as f64).collect(),
                    (0..v).map(|c| (v - c) as f64).collect(),
                ] {
                    let mut spec = uniform(Schedule::OneFOneB, p, v, m, 1.0, 2.0);
                    spec.activation = sizes.iter().map(|&a| vec![a; p]).collect();
                    let sim = simulate(&spec).expect("simulates");
                    let worst = profiles
                        .iter()
                        .map(|q| {
                            q.iter()
                                .zip(&sizes)
                                .map(|(&n, a)| n as f64 * a)
                                .sum::<f64>()
                        })
                        .fold(0.0, f64::max);
                    assert!(
                        (sim.peak_activation[j] - worst).abs() < 1e-9,
                        "p={p} v={v} j={j} {sizes:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn rejects_bad_shapes() {
        let mut spec = uniform(Schedule::OneFOneB, 4, 2, 6, 1.0, 2.0);
        assert!(matches!(
            simulate(&spec),
            Err(ScheduleError::Interleave { .. })
        ));
        spec.microbatches = 8;
        spec.recompute.pop();
        assert_eq!(simulate(&spec), Err(ScheduleError::Shape));
    }
}
