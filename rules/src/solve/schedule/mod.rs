//! Pipeline schedules (ALGORITHMS.md §4): closed forms for step time and in-flight
//! activations, a list-scheduling simulator for uneven stages, the bubble decomposition and a
//! Chrome-trace export of the simulated timeline.

mod simulate;
mod trace;

pub use simulate::{
    Block, BlockKind, Bubble, PipelineSpec, ScheduleError, Simulation, Step, inflight_profiles,
    simulate, simulate_times, stage_program,
};
pub use trace::{MAX_TRACE_BLOCKS, chrome_trace, shown_spec, trace_spec};

use serde::{Deserialize, Serialize};

/// How micro-batches flow through the pipeline stages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    /// All forwards, then all backwards: every micro-batch in flight at once.
    GPipe,
    /// One-forward-one-backward (PipeDream-Flush), interleaved when stages hold several chunks.
    #[serde(rename = "1f1b")]
    OneFOneB,
}

/// Time of one step's pipeline of `m` micro-batches, where stage `j` needs `stage_times[j]` for
/// the forward and backward of one micro-batch through all of its `v` chunks:
///
/// ```text
/// (sum_j T_j - max_j T_j) / v + m * max_j T_j
/// ```
///
/// For equal stages this is `(m + (p - 1)/v) T`, i.e. an ideal bubble of `(p - 1)/(v m)`; for
/// `v = 1` it is Alpa's `sum_j T_j + (m - 1) max_j T_j`.
pub fn pipeline_time(stage_times: &[f64], m: u64, v: u64) -> f64 {
    let max = stage_times.iter().copied().fold(0.0, f64::max);
    let sum: f64 = stage_times.iter().sum();
    (sum - max) / v.max(1) as f64 + m as f64 * max
}

/// Ideal bubble fraction `(p - 1) / (v m)` of a pipeline of `p` equal stages.
pub fn ideal_bubble(p: u64, m: u64, v: u64) -> f64 {
    (p.saturating_sub(1)) as f64 / (v.max(1) * m.max(1)) as f64
}

/// Micro-batches' worth of stage `j`'s activations alive at its peak (stage `j` of `p`, `m`
/// micro-batches, `v` chunks per stage).
///
/// GPipe keeps all `m`. 1F1B runs `p - j - 1` warm-up forwards, so `min(p - j, m)`. Interleaved
/// 1F1B (Megatron-LM) runs `2 (p - j - 1) + (v - 1) p` warm-up chunk forwards, so
/// `(2 (p - j - 1) + (v - 1) p + 1) / v` stage-equivalents, capped at `m`; for stage 0 that is
/// `p (1 + (p - 1)/(p v))`.
pub fn inflight(schedule: Schedule, j: u64, p: u64, m: u64, v: u64) -> f64 {
    match schedule {
        Schedule::GPipe => m as f64,
        Schedule::OneFOneB if v <= 1 => (p - j).min(m) as f64,
        Schedule::OneFOneB => {
            let chunks = 2 * (p - j - 1) + (v - 1) * p + 1;
            chunks.min(m * v) as f64 / v as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_stages_match_the_closed_forms() {
        let t = 3.0;
        for p in 1..9u64 {
            for m in [1u64, 4, 8, 32] {
                let times = vec![t; p as usize];
                let expect = (m + p - 1) as f64 * t;
                assert!((pipeline_time(&times, m, 1) - expect).abs() < 1e-9);
                let v = 2;
                let inter = (m as f64 + (p - 1) as f64 / v as f64) * t;
                assert!((pipeline_time(&times, m, v) - inter).abs() < 1e-9);
                let bubble = pipeline_time(&times, m, v) / (m as f64 * t) - 1.0;
                assert!((bubble - ideal_bubble(p, m, v)).abs() < 1e-9);
            }
        }
        // SAPP's published example: p = 8, m = 32 -> 7/32.
        assert_eq!(ideal_bubble(8, 32, 1), 0.21875);
    }

    #[test]
    fn uneven_stages_follow_alpa() {
        let times = [1.0, 4.0, 2.0];
        assert_eq!(pipeline_time(&times, 5, 1), 7.0 + 4.0 * 4.0);
    }

    #[test]
    fn inflight_counts() {
        assert_eq!(inflight(Schedule::GPipe, 0, 4, 16, 1), 16.0);
        assert_eq!(inflight(Schedule::OneFOneB, 0, 4, 16, 1), 4.0);
        assert_eq!(inflight(Schedule::OneFOneB, 3, 4, 16, 1), 1.0);
        assert_eq!(inflight(Schedule::OneFOneB, 0, 8, 2, 1), 2.0);
        let (p, v) = (8u64, 4u64);
        let expect = p as f64 * (1.0 + (p - 1) as f64 / (p * v) as f64);
        assert!((inflight(Schedule::OneFOneB, 0, p, 64, v) - expect).abs() < 1e-12);
    }
}
