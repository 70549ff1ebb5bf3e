//! Exhaustive search over the layouts a target allows (tp x pp x dp x micro-batch x interleave
//! x sequence parallelism x recomputation x ZeRO with even stages), keeping the fastest layouts
//! that fit in memory.

use crate::canonical::{Digest, digest};
use crate::cost::context_parallel::CpComm;
use crate::plan::estimate::{Estimate, Estimator, PricingKey, Timing};
use crate::plan::layout::{Layout, LayoutError, Recompute};
use crate::plan::partition::Attempt;
use rayon::prelude::*;
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
    /// Context-parallel degrees (1: none).
    #[serde(default = "no_context_parallelism")]
    pub cp: Vec<u64>,
    /// How context-parallel ranks exchange keys and values (for degrees above 1).
    #[serde(default = "default_cp_comm")]
    pub cp_comm: Vec<CpComm>,
    /// Expert-parallel degrees (mixture-of-experts models; 1 for dense ones).
    #[serde(default = "no_context_parallelism")]
    pub ep: Vec<u64>,
    /// Expert tensor-parallel degrees (mixture-of-experts models; 1 for dense ones); empty:
    /// 1 and each layout's tp (Megatron-Core's two usual layouts: experts whole, or split as
    /// the dense layers are).
    #[serde(default = "no_context_parallelism")]
    pub etp: Vec<u64>,
}

fn no_context_parallelism() -> Vec<u64> {
    vec![1]
}

fn default_cp_comm() -> Vec<CpComm> {
    vec![CpComm::P2p]
}

impl SearchSpace {
    /// The default space on nodes of `gpus_per_node` GPUs: tp over the powers of two up to a
    /// node (Megatron-LM keeps tensor parallelism inside NVLink), any pp and dp, micro-batches
    /// 1 to 8, interleaving 1, 2 or 4, SP on or off, every recomputation mode, ZeRO 0 or 1 (the
    /// stages Megatron-LM's distributed optimizer provides; 2 and 3 are opt-in), no context
    /// parallelism (opt-in: degrees and `p2p` rings when asked for).
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
            cp: no_context_parallelism(),
            cp_comm: default_cp_comm(),
            ep: vec![1],
            etp: vec![1],
        }
    }

    /// The default space for a model with `experts` routed experts per MoE block on
    /// `gpus` GPUs: the default space plus every power-of-two expert-parallel degree that
    /// divides the experts, and expert tensor parallelism of 1 or the layout's tp.
    pub fn default_for_experts(gpus_per_node: u64, gpus: u64, experts: u64) -> Self {
        let mut space = SearchSpace::default_for(gpus_per_node);
        let mut ep = vec![1];
        while ep[ep.len() - 1] * 2 <= gpus && experts % (ep[ep.len() - 1] * 2) == 0 {
            ep.push(ep[ep.len() - 1] * 2);
        }
        space.ep = ep;
        space.etp = Vec::new();
        space
    }
}

/// Outcome of a search.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SearchResult {
    /// Fastest layouts that fit, best first (at most the number asked for), each with its best
    /// split of the layers.
    pub ranked: Vec<Estimate>,
    /// Layouts generated.
    pub candidates: usize,
    /// Layouts that can run (pass every divisibility rule).
    pub valid: usize,
    /// Valid layouts that fit in memory with the even split.
    pub feasible: usize,
    /// Layouts whose split was refined (DP, balancing, simulation).
    pub refined: usize,
    /// How each way of splitting the layers did for the best layout.
    pub best_attempts: Vec<Attempt>,
    /// Whether the refinement stopped at [`MAX_REFINED`] before its bound proved the rest
    /// slower.
    pub refine_capped: bool,
    /// When nothing fits: the valid layout needing the least memory.
    pub least_memory: Option<Estimate>,
    /// When nothing is valid: the reason the first candidate was rejected.
    pub first_rejection: Option<(Layout, String)>,
    /// When the space has context-parallel degrees besides 1: the same search without
    /// context parallelism, for comparison.
    #[serde(default)]
    pub without_cp: Option<WithoutCp>,
    /// Every layout that can run, as screened (layers split evenly, closed-form pipeline):
    /// `[step time s, memory per device GiB]`, for a picture of the space.
    #[serde(default)]
    pub points: Vec<[f64; 2]>,
}

/// The best layout without context parallelism, beside a search with it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WithoutCp {
    /// The fastest that fits, if any.
    pub best: Option<Estimate>,
    /// When none fits: the valid layout needing the least memory.
    pub least_memory: Option<Estimate>,
}

impl SearchResult {
    /// The best layout, if any fits.
    pub fn best(&self) -> Option<&Estimate> {
        self.ranked.first()
    }
}

/// Most layouts refined per search.
pub const MAX_REFINED: usize = 2000;

/// How much faster than its optimistic time a layout's best split may be: balancing can even
/// out the head and the tail, which the even split leaves on the first and last stage.
pub const REFINE_SLACK: f64 = 0.15;

/// Order of preference: faster first; then less memory; then the simpler layout.
fn rank(a: &Estimate, b: &Estimate) -> Ordering {
    a.step_time_s
        .total_cmp(&b.step_time_s)
        .then(a.memory.total.total_cmp(&b.memory.total))
        .then_with(|| {
            let key = |l: &Layout| {
                (
                    l.tp * l.cp * l.pp,
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
        for &cp in &space.cp {
            let comms = if cp == 1 {
                &[CpComm::P2p][..]
            } else {
                &space.cp_comm[..]
            };
            let etps = if space.etp.is_empty() {
                let mut both = vec![1, tp];
                both.dedup();
                both
            } else {
                space.etp.clone()
            };
            for &cp_comm in comms {
                for &ep in &space.ep {
                    for &etp in &etps {
                        let base = Layout {
                            tp,
                            cp,
                            cp_comm,
                            ep,
                            etp,
                            pp: 1,
                            dp: 1,
                            micro_batch: 1,
                            global_batch,
                            interleave: 1,
                            sequence_parallel: false,
                            recompute: Recompute::None,
                            zero: 0,
                        };
                        push_candidates(space, gpus, base, &mut out);
                    }
                }
            }
        }
    }
    out
}

/// The candidates of `space` with `base`'s tp, cp and global batch.
fn push_candidates(space: &SearchSpace, gpus: u64, base: Layout, out: &mut Vec<Layout>) {
    let (tp, global_batch) = (base.tp, base.global_batch);
    let stage = tp.saturating_mul(base.cp);
    if stage == 0 || gpus % stage != 0 {
        return;
    }
    let pps = space
        .pp
        .clone()
        .unwrap_or_else(|| crate::solve::pipeline::divisors(gpus / stage));
    for &pp in &pps {
        if pp == 0 || (gpus / stage) % pp != 0 {
            continue;
        }
        let dp = gpus / stage / pp;
        if space.dp.as_ref().is_some_and(|ds| !ds.contains(&dp)) {
            continue;
        }
        // The expert layout folds onto the stage's GPUs.
        if (stage * dp) % base.ep.saturating_mul(base.etp).max(1) != 0 {
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
                            let l = Layout {
                                pp,
                                dp,
                                micro_batch,
                                interleave,
                                sequence_parallel,
                                recompute,
                                zero,
                                ..base
                            };
                            // ZeRO shards over the ranks holding the same weights: nothing
                            // to shard with one.
                            if zero > 0 && l.grad_ranks() == 1 {
                                continue;
                            }
                            out.push(l);
                        }
                    }
                }
            }
        }
    }
}

/// The combinations the candidates of `space` price layers under.
pub fn pricing_combinations(space: &SearchSpace, gpus: u64, global_batch: u64) -> Vec<PricingKey> {
    let mut out: Vec<PricingKey> = candidates(space, gpus, global_batch)
        .iter()
        .map(PricingKey::of)
        .collect();
    out.sort();
    out.dedup();
    out
}

/// The hash of every layer cost a search of `space` would read (or why a combination cannot
/// run): two searches with equal digests, layouts and options give the same result.
pub fn layer_cost_digest(est: &Estimator<'_>, space: &SearchSpace, global_batch: u64) -> Digest {
    type Entry = (PricingKey, Result<Digest, String>);
    let mut h: Vec<Entry> = Vec::new();
    for key in pricing_combinations(space, est.cluster().gpus(), global_batch) {
        let entry = match est.layer_costs(key) {
            Ok(p) => Ok(digest(&p.1)),
            Err(e) => Err(e.to_string()),
        };
        h.push((key, entry));
    }
    digest(&h)
}

/// Prices every candidate and keeps the `keep` fastest that fit.
///
/// Every layout is first screened with its layers split evenly and the closed-form pipeline
/// time. Layouts are then refined ([`Estimator::refine`]: DP, balancing, simulated schedule) in
/// order of an optimistic time (the screened time, without recomputation for layouts that
/// recompute in full, since balancing may recompute fewer blocks), until that time, less
/// [`REFINE_SLACK`], exceeds the `keep`-th best refined step, or [`MAX_REFINED`] layouts were
/// refined. Layouts no split can fit (their average memory per stage already exceeds the
/// device) are skipped.
pub fn search(
    est: &Estimator<'_>,
    space: &SearchSpace,
    global_batch: u64,
    keep: usize,
) -> SearchResult {
    let cands = candidates(space, est.cluster().gpus(), global_batch);
    let mut screened: Vec<Estimate> = Vec::new();
    let mut first_rejection: Option<(Layout, LayoutError)> = None;
    for layout in &cands {
        match est.evaluate_timed(layout, Timing::ClosedForm) {
            Ok(e) => screened.push(e),
            Err(err) => {
                if first_rejection.is_none() {
                    first_rejection = Some((*layout, err));
                }
            }
        }
    }
    let valid = screened.len();
    let points = screened
        .iter()
        .map(|e| [e.step_time_s, e.memory_per_device_gib])
        .collect();
    let feasible = screened.iter().filter(|e| e.fits).count();
    let optimistic: Vec<f64> = screened
        .iter()
        .map(|e| {
            if e.layout.recompute == Recompute::Full {
                let relaxed = Layout {
                    recompute: Recompute::None,
                    ..e.layout
                };
                est.evaluate_timed(&relaxed, Timing::ClosedForm)
                    .map_or(e.step_time_s, |x| x.step_time_s.min(e.step_time_s))
            } else {
                e.step_time_s
            }
        })
        .collect();
    let mut order: Vec<usize> = (0..screened.len()).collect();
    order.sort_by(|&a, &b| optimistic[a].total_cmp(&optimistic[b]));

    let mut fitting: Vec<(Estimate, Vec<Attempt>)> = Vec::new();
    let mut least_memory: Option<Estimate> = None;
    let mut refined = 0;
    let mut refine_capped = false;
    // Layouts are refined a window at a time in parallel, then taken in order exactly as a
    // sequential pass would (the window's refinements past a stop are discarded), so the
    // result does not depend on the number of threads.
    let window = 8 * rayon::current_num_threads().max(1);
    'scan: for chunk in order.chunks(window) {
        let done: Vec<Option<Result<crate::plan::partition::Refined, LayoutError>>> = chunk
            .par_iter()
            .map(|&i| may_fit(&screened[i]).then(|| est.refine(&screened[i].layout)))
            .collect();
        for (&i, outcome) in chunk.iter().zip(done) {
            let bar = if fitting.len() >= keep.max(1) {
                fitting[keep.max(1) - 1].0.step_time_s
            } else {
                f64::INFINITY
            };
            if optimistic[i] * (1.0 - REFINE_SLACK) > bar {
                break 'scan;
            }
            let e = &screened[i];
            if least_memory
                .as_ref()
                .is_none_or(|b| e.memory.total < b.memory.total)
            {
                least_memory = Some(e.clone());
            }
            let Some(outcome) = outcome else {
                continue;
            };
            if refined == MAX_REFINED {
                refine_capped = true;
                break 'scan;
            }
            refined += 1;
            // Refining runs the checks screening passed; the simulation accepts what they
            // accept.
            let Ok(r) = outcome else {
                continue;
            };
            let best = r.estimate;
            if best.fits {
                // A layout that recomputes nothing after balancing may duplicate one refined
                // before.
                if fitting.iter().any(|(f, _)| f.layout == best.layout) {
                    continue;
                }
                fitting.push((best, r.attempts));
                fitting.sort_by(|a, b| rank(&a.0, &b.0));
            } else if least_memory
                .as_ref()
                .is_none_or(|b| best.memory.total < b.memory.total)
            {
                least_memory = Some(best);
            }
        }
    }
    fitting.truncate(keep);
    let without_cp = (space.cp.contains(&1) && space.cp.iter().any(|&c| c > 1)).then(|| {
        let plain = SearchSpace {
            cp: vec![1],
            ..space.clone()
        };
        let r = search(est, &plain, global_batch, 1);
        WithoutCp {
            best: r.ranked.into_iter().next(),
            least_memory: r.least_memory,
        }
    });
    let found = !fitting.is_empty();
    let best_attempts = fitting.first().map(|f| f.1.clone()).unwrap_or_default();
    SearchResult {
        ranked: fitting.into_iter().map(|f| f.0).collect(),
        best_attempts,
        candidates: cands.len(),
        valid,
        feasible,
        refined,
        refine_capped,
        least_memory: if found { None } else { least_memory },
        first_rejection: if valid == 0 {
            first_rejection.map(|(l, e)| (l, e.to_string()))
        } else {
            None
        },
        without_cp,
        points,
    }
}

/// Whether some split of `e`'s layers might fit: the stages' memory summed (model states and
/// reserved memory do not depend on the split, and every stage keeps at least one
/// micro-batch's activations of each of its layers at its most memory-saving recomputation,
/// which the even split uses) must not exceed what all stages hold.
fn may_fit(e: &Estimate) -> bool {
    let total: f64 = e
        .stages
        .iter()
        .map(|s| {
            let m = &s.memory;
            m.weights
                + m.grads
                + m.optimizer
                + s.chunks.iter().map(|c| c.activation_bytes).sum::<f64>()
        })
        .sum();
    total <= e.memory_capacity * e.stages.len() as f64
}
