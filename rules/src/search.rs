//! Exhaustive search over the layouts a target allows (tp x pp x dp x micro-batch x interleave
//! x sequence parallelism x recomputation x ZeRO with even stages), keeping the fastest layouts
//! that fit in memory.

use crate::estimate::{Estimate, Estimator};
use crate::layout::{Layout, LayoutError, Recompute};
use serde::{Deserialize, Serialize};
use std::cmp::Ordering;

/// The values each layout dimension may take. `None` for pp/dp means "any that fits".
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SearchSpace {
    /// Tensor-parallel degrees.
    pub tp: Vec<u64>,
    /// Pipeline-parallel degrees; `None`: every divisor of the GPU count.
    pub pp: Option<Vec<u64>>,
    /// Data-parallel degrees; `None`: whatever tp and pp leave.
    pub dp: Option<Vec<u64>>,
    /// Micro-batch sizes.
    pub micro_batch: Vec<u64>,
    /// Chunks per stage.
    pub interleave: Vec<u64>,
    /// Sequence parallelism on or off.
    pub sequence_parallel: Vec<bool>,
    /// Recomputation modes.
    pub recompute: Vec<Recompute>,
    /// ZeRO stages.
    pub zero: Vec<u8>,
}

impl SearchSpace {
    /// The default space on nodes of `gpus_per_node` GPUs: tp over the powers of two up to a
    /// node (Megatron-LM keeps tensor parallelism inside NVLink), any pp and dp, micro-batches
    /// 1 to 8, interleaving 1, 2 or 4, SP on or off, every recomputation mode, ZeRO 0 or 1 (the
    /// stages Megatron-LM's distributed optimizer provides; 2 and 3 are opt-in).
    pub fn default_for(gpus_per_node: u64) -> Self {
        let mut tp = vec![1];
        while tp[tp.len() - 1] * 2 <= gpus_per_node {
            tp.push(tp[tp.len() - 1] * 2);
        }
        SearchSpace {
            tp,
            pp: None,
            dp: None,
            micro_batch: vec![1, 2, 4, 8],
            interleave: vec![1, 2, 4],
            sequence_parallel: vec![false, true],
            recompute: vec![Recompute::None, Recompute::Selective, Recompute::Full],
            zero: vec![0, 1],
        }
    }
}

/// Outcome of a search.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SearchResult {
    /// Fastest layouts that fit, best first (at most the number asked for).
    pub ranked: Vec<Estimate>,
    /// Layouts generated.
    pub candidates: usize,
    /// Layouts that can run (pass every divisibility rule).
    pub valid: usize,
    /// Valid layouts that fit in memory.
    pub feasible: usize,
    /// When nothing fits: the valid layout needing the least memory.
    pub least_memory: Option<Estimate>,
    /// When nothing is valid: the reason the first candidate was rejected.
    pub first_rejection: Option<(Layout, String)>,
}

impl SearchResult {
    /// The best layout, if any fits.
    pub fn best(&self) -> Option<&Estimate> {
        self.ranked.first()
    }
}

fn divisors(n: u64) -> Vec<u64> {
    (1..=n).filter(|d| n % d == 0).collect()
}

/// Order of preference: faster first; then less memory; then the simpler layout.
fn rank(a: &Estimate, b: &Estimate) -> Ordering {
    a.step_time_s
        .total_cmp(&b.step_time_s)
        .then(a.memory.total.total_cmp(&b.memory.total))
        .then_with(|| {
            let key = |l: &Layout| {
                (
                    l.tp * l.pp,
                    l.interleave,
                    l.zero,
                    l.recompute,
                    l.sequence_parallel,
                    l.micro_batch,
                    l.pp,
                )
            };
            key(&a.layout).cmp(&key(&b.layout))
        })
}

/// Every layout in `space` for a step of `global_batch` sequences on the estimator's cluster.
pub fn candidates(space: &SearchSpace, gpus: u64, global_batch: u64) -> Vec<Layout> {
    let mut out = Vec::new();
    for &tp in &space.tp {
        if tp == 0 || gpus % tp != 0 {
            continue;
        }
        let pps = space.pp.clone().unwrap_or_else(|| divisors(gpus / tp));
        for &pp in &pps {
            if pp == 0 || (gpus / tp) % pp != 0 {
                continue;
            }
            let dp = gpus / tp / pp;
            if space.dp.as_ref().is_some_and(|ds| !ds.contains(&dp)) {
                continue;
            }
            for &micro_batch in &space.micro_batch {
                if micro_batch == 0 || global_batch % micro_batch.saturating_mul(dp) != 0 {
                    continue;
                }
                for &interleave in &space.interleave {
                    if interleave > 1 && pp < 2 {
                        continue;
                    }
                    for &sequence_parallel in &space.sequence_parallel {
                        if sequence_parallel && tp == 1 {
                            continue;
                        }
                        for &recompute in &space.recompute {
                            for &zero in &space.zero {
                                // ZeRO shards over the data-parallel group: nothing to shard
                                // with one replica.
                                if zero > 0 && dp == 1 {
                                    continue;
                                }
                                out.push(Layout {
                                    tp,
                                    pp,
                                    dp,
                                    micro_batch,
                                    global_batch,
                                    interleave,
                                    sequence_parallel,
                                    recompute,
                                    zero,
                                });
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

/// Prices every candidate and keeps the `keep` fastest that fit.
pub fn search(
    est: &Estimator<'_>,
    space: &SearchSpace,
    global_batch: u64,
    keep: usize,
) -> SearchResult {
    let cands = candidates(space, est.cluster().gpus(), global_batch);
    let mut fitting: Vec<Estimate> = Vec::new();
    let mut least_memory: Option<Estimate> = None;
    let mut first_rejection: Option<(Layout, LayoutError)> = None;
    let mut valid = 0;
    for layout in &cands {
        match est.evaluate(layout) {
            Ok(e) => {
                valid += 1;
                if e.fits {
                    fitting.push(e);
                } else if least_memory
                    .as_ref()
                    .is_none_or(|b| e.memory.total < b.memory.total)
                {
                    least_memory = Some(e);
                }
            }
            Err(err) => {
                if first_rejection.is_none() {
                    first_rejection = Some((*layout, err));
                }
            }
        }
    }
    let feasible = fitting.len();
    fitting.sort_by(rank);
    fitting.truncate(keep);
    SearchResult {
        ranked: fitting,
        candidates: cands.len(),
        valid,
        feasible,
        least_memory: if feasible == 0 { least_memory } else { None },
        first_rejection: if valid == 0 {
            first_rejection.map(|(l, e)| (l, e.to_string()))
        } else {
            None
        },
    }
}
