//! Where one layout's layers go (ALGORITHMS.md §2, §4): the split of the layers into pipeline
//! chunks, found three ways and priced by simulating the schedule.
//!
//! * **even**: equally many blocks per chunk, every block recomputed under full recomputation
//!   (what Megatron-LM does without a custom layout);
//! * **dp**: Alpa's stage-construction DP ([`crate::solve::inter`]) over the layers, one chunk per
//!   stage: every stage runs on the layout's `tp x dp` devices (a single submesh shape, so the
//!   device count fixes `pp` stages), the cost of a range is its forward, backward,
//!   recomputation and transfers per micro-batch, and a range may only be followed by as many
//!   stages as its memory allows under 1F1B;
//! * **balance**: SAPP balancing ([`crate::solve::balance`]) of identical blocks, with Megatron-LM's
//!   expressible recomputation: under full recomputation the same number `N` of recomputed
//!   blocks in every chunk (`--recompute-method block --recompute-num-layers N`), any
//!   interleaving.
//!
//! The DP and the balancer optimise the pipeline proxy of their own models (the balancer ignores
//! transfers); the simulated step of each split decides.

use crate::cost::layer_cost::LayerCost;
use crate::cost::memory::model_states;
use crate::model::graph::{Graph, LayerKind};
use crate::plan::estimate::{ChunkLayers, Estimate, Estimator, Partition, PricingKey, even_chunks};
use crate::plan::layout::{Layout, LayoutError, Recompute};
use crate::solve::balance::{
    BalanceProblem, Extra, KINDS, MemoryTerms, RecomputeKind, SolveStatus, balance,
};
use crate::solve::inter::{StageOptions, StageProblem, solve};
use serde::{Deserialize, Serialize};

/// What one way of splitting the layers gave.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Attempt {
    /// The way.
    pub partition: Partition,
    /// Simulated step time, s, when it produced a split.
    pub step_time_s: Option<f64>,
    /// Whether that split fits in memory.
    pub fits: bool,
    /// Why it produced no split, or how good its solution is proven to be.
    pub note: String,
}

/// The best split of one layout.
#[derive(Clone, Debug, PartialEq)]
pub struct Refined {
    /// The fastest split that fits, else the one needing the least memory.
    pub estimate: Estimate,
    /// Every way tried.
    pub attempts: Vec<Attempt>,
}

/// Solver time limit when balancing falls back to the MILP, s.
const BALANCE_TIME_LIMIT_S: f64 = 2.0;

/// Most layers Alpa's DP splits: its table has one entry per range of layers, and its work per
/// bound on the stage time grows with the cube of the layers. Every published model has fewer
/// (LLaMA-3.1 405B: 126 blocks, Megatron-LM's 1T GPT: 128); deeper ones are split evenly and by
/// the balancer, which counts identical blocks instead of enumerating ranges of them.
pub const MAX_DP_LAYERS: usize = 512;

/// Relative tolerance under which block layers count as identical.
const SAME: f64 = 1e-9;

impl Estimator<'_> {
    /// Splits `layout`'s layers evenly, by the DP and by the balancer; returns the split with
    /// the fastest simulated step that fits (the least memory if none fits).
    pub fn refine(&self, layout: &Layout) -> Result<Refined, LayoutError> {
        self.check(layout)?;
        let prepared = self.prepare(PricingKey::of(layout))?;
        let (g, costs) = &*prepared;
        let mut candidates: Vec<(Partition, Result<Vec<ChunkLayers>, String>)> =
            vec![(Partition::Even, Ok(even_chunks(g, layout)?))];
        candidates.push((Partition::Dp, self.dp_chunks(costs, layout)));
        let mut balance_note = String::new();
        candidates.push((
            Partition::Balance,
            self.balanced_chunks(g, costs, layout)
                .map(|(chunks, status)| {
                    balance_note = match status {
                        SolveStatus::Optimal => "optimal for its model".into(),
                        SolveStatus::TimeLimit => format!(
                            "best found in the {BALANCE_TIME_LIMIT_S} s time limit, not proven"
                        ),
                    };
                    chunks
                }),
        ));
        let mut best: Option<Estimate> = None;
        let mut attempts = Vec::with_capacity(candidates.len());
        for (partition, chunks) in candidates {
            let chunks = match chunks {
                Ok(c) => c,
                Err(why) => {
                    attempts.push(Attempt {
                        partition,
                        step_time_s: None,
                        fits: false,
                        note: why,
                    });
                    continue;
                }
            };
            let e = self.evaluate_assignment(layout, &chunks, partition)?;
            attempts.push(Attempt {
                partition,
                step_time_s: Some(e.step_time_s),
                fits: e.fits,
                note: match partition {
                    Partition::Even => "Megatron-LM's default split".into(),
                    Partition::Dp => "optimal for its model".into(),
                    Partition::Balance => balance_note.clone(),
                },
            });
            // Fitting beats not fitting; then faster (the even split wins ties, being the
            // default), or less memory when nothing fits.
            let better = match &best {
                None => true,
                Some(b) => match (e.fits, b.fits) {
                    (true, false) => true,
                    (false, true) => false,
                    (true, true) => e.step_time_s < b.step_time_s * (1.0 - 1e-9),
                    (false, false) => e.memory.total < b.memory.total,
                },
            };
            if better {
                best = Some(e);
            }
        }
        let mut estimate = match best {
            Some(e) => e,
            None => self.evaluate(layout)?,
        };
        // Full recomputation of no block is no recomputation: say so, so the plan and its
        // Megatron-LM arguments do not ask for it.
        if layout.recompute == Recompute::Full
            && estimate
                .stages
                .iter()
                .flat_map(|s| &s.chunks)
                .all(|c| c.full_recompute == 0)
        {
            estimate.layout.recompute = Recompute::None;
        }
        Ok(Refined { estimate, attempts })
    }

    /// Recomputation of a block under the layout's policy when a whole stage is recomputed the
    /// same way (the DP's configuration).
    fn stage_kind(policy: Recompute, kind: LayerKind) -> Recompute {
        if kind == LayerKind::Block {
            policy
        } else {
            Recompute::None
        }
    }

    /// The DP's split, one chunk per stage.
    fn dp_chunks(&self, costs: &[LayerCost], l: &Layout) -> Result<Vec<ChunkLayers>, String> {
        if l.interleave > 1 {
            return Err("Alpa's DP has no interleaved chunks".into());
        }
        let n = costs.len();
        let p = l.pp as usize;
        let m = l.num_microbatches() as usize;
        if p > n {
            return Err(format!("{p} stages for {n} layers"));
        }
        if n > MAX_DP_LAYERS {
            return Err(format!(
                "skipped: the DP's work grows with the cube of the layers, and {n} is more than \
                 the {MAX_DP_LAYERS} it is run on (the balancer splits identical blocks exactly)"
            ));
        }
        let weight_bytes = self.options().state_bytes().weights;
        let capacity = self.capacity();
        let reserved = self.cluster().device.reserved_bytes;
        let mut cost = vec![f64::INFINITY; n * n];
        let mut max_succ = vec![-1i64; n * n];
        // Only layers that borrow parameters hold a different amount as their range grows.
        let borrowers: Vec<usize> = (0..n)
            .filter(|&b| !costs[b].borrowed_params.is_empty())
            .collect();
        for k in 0..n {
            // Running totals of the range k..=i as i grows, kept in O(1) per layer (the range's
            // sums are added in layer order, as a sum over the range would be). A layer that
            // borrows parameters from one outside the range holds a copy; when the owner joins,
            // the copy goes.
            let mut times = vec![0.0f64; n];
            let mut held = vec![0.0f64; n];
            let (mut act, mut transient) = (0.0, 0.0f64);
            let (mut time_sum, mut held_sum, mut own_largest) = (0.0f64, 0.0f64, 0.0f64);
            for i in k..n {
                let in_range = |x: usize| k <= x && x <= i;
                let kind_of = |b: usize| Self::stage_kind(l.recompute, costs[b].kind);
                for &b in borrowers.iter().filter(|&&b| k <= b && b < i) {
                    let hb = Self::held_params(costs, b, &in_range);
                    if hb != held[b] {
                        let lt = self.layer_time(&costs[b], kind_of(b), hb, l);
                        let t = lt.forward() + lt.backward();
                        time_sum += t - times[b];
                        held_sum += hb - held[b];
                        times[b] = t;
                        held[b] = hb;
                    }
                }
                let hi = Self::held_params(costs, i, &in_range);
                let lt = self.layer_time(&costs[i], kind_of(i), hi, l);
                times[i] = lt.forward() + lt.backward();
                held[i] = hi;
                time_sum += times[i];
                held_sum += hi;
                if costs[i].borrowed_params.is_empty() {
                    own_largest = own_largest.max(hi);
                }
                act += lt.saved;
                transient = transient.max(lt.transient);
                let mut t = time_sum;
                if i + 1 < n {
                    t += self.p2p_time(costs[i + 1].input_bytes, 0, 1, l);
                }
                if k > 0 {
                    t += self.p2p_time(costs[k].input_bytes, 1, 0, l);
                }
                let states = model_states(
                    held_sum,
                    self.options().state_bytes(),
                    l.zero,
                    l.grad_ranks(),
                );
                let gathered = if l.zero == 3 {
                    let largest = borrowers
                        .iter()
                        .filter(|&&b| k <= b && b <= i)
                        .map(|&b| held[b])
                        .fold(own_largest, f64::max);
                    2.0 * largest * weight_bytes
                } else {
                    0.0
                };
                let fixed = states.weights
                    + states.grads
                    + states.optimizer
                    + transient
                    + gathered
                    + reserved;
                // A stage with s stages from it to the end keeps min(s, m) micro-batches.
                let most = if act > 0.0 {
                    ((capacity - fixed) / act).floor()
                } else if fixed <= capacity {
                    f64::INFINITY
                } else {
                    -1.0
                };
                let x = k * n + i;
                if most >= 1.0 {
                    cost[x] = t;
                    max_succ[x] = if most >= m as f64 {
                        n as i64
                    } else {
                        most as i64 - 1
                    };
                }
            }
        }
        let problem = StageProblem {
            layers: n,
            submeshes: vec![(1, 1)],
            configs: 1,
            cost,
            max_succ,
            devices: p as u64,
            microbatches: m as u64,
        };
        let plan = solve(problem, StageOptions::default()).map_err(|e| e.to_string())?;
        let full = |c: &crate::solve::inter::StageChoice| {
            if l.recompute == Recompute::Full {
                costs[c.start..=c.end]
                    .iter()
                    .filter(|x| x.kind == LayerKind::Block)
                    .count()
            } else {
                0
            }
        };
        Ok(plan
            .stages
            .iter()
            .map(|c| ChunkLayers {
                first: c.start,
                last: c.end,
                full_recompute: full(c),
            })
            .collect())
    }

    /// The balancer's split: identical blocks between a head and a tail.
    fn balanced_chunks(
        &self,
        g: &Graph,
        costs: &[LayerCost],
        l: &Layout,
    ) -> Result<(Vec<ChunkLayers>, SolveStatus), String> {
        let blocks = g.block_layers();
        let (Some(&first), Some(&last)) = (blocks.first(), blocks.last()) else {
            return Err("the model has no blocks".into());
        };
        if last - first + 1 != blocks.len() {
            return Err("other layers sit between the blocks".into());
        }
        let b0 = &costs[first];
        let same = |a: f64, b: f64| (a - b).abs() <= SAME * a.abs().max(b.abs());
        let identical = blocks.iter().all(|&i| {
            let c = &costs[i];
            same(c.fwd_compute, b0.fwd_compute)
                && same(c.fwd_comm, b0.fwd_comm)
                && same(c.bwd_compute, b0.bwd_compute)
                && same(c.bwd_comm, b0.bwd_comm)
                && same(c.attention_core_compute, b0.attention_core_compute)
                && same(c.attention_core_comm, b0.attention_core_comm)
                && same(c.saved, b0.saved)
                && same(c.saved_selective, b0.saved_selective)
                && same(c.checkpoint, b0.checkpoint)
                && same(c.grad_working, b0.grad_working)
                && same(c.params, b0.params)
                && c.borrowed_params.is_empty()
        });
        if !identical {
            return Err("the blocks are not identical; the DP splits such models".into());
        }
        let (p, v) = (l.pp as usize, l.interleave as usize);
        let m = l.num_microbatches() as usize;
        let bytes = self.options().state_bytes();
        let weight_bytes = bytes.weights;
        let states = |params: f64| {
            let s = model_states(params, bytes, l.zero, l.grad_ranks());
            s.weights + s.grads + s.optimizer
        };
        // Megatron-LM's kinds, each with its slot in the balancer's per-kind arrays.
        let kinds = [
            (Recompute::None, RecomputeKind::None),
            (Recompute::Selective, RecomputeKind::Selective),
            (Recompute::Full, RecomputeKind::Full),
        ];
        let mut allowed = [false; KINDS];
        match l.recompute {
            Recompute::None => allowed[RecomputeKind::None.index()] = true,
            Recompute::Selective => allowed[RecomputeKind::Selective.index()] = true,
            Recompute::Full => {
                allowed[RecomputeKind::None.index()] = true;
                allowed[RecomputeKind::Full.index()] = true;
            }
            Recompute::SelectiveOp => {
                return Err(
                    "the balancer chooses among Megatron-LM's recomputation kinds; \
                            torchtitan's op policy applies to every block"
                        .into(),
                );
            }
        }
        let block = |r: Recompute| self.layer_time(b0, r, b0.params, l);
        let none = RecomputeKind::None.index();
        let mut backward = [0.0; KINDS];
        let mut activation = [None; KINDS];
        for (r, k) in kinds {
            backward[k.index()] = block(r).backward();
            activation[k.index()] = Some(block(r).saved);
        }
        for k in 0..KINDS {
            if !allowed[k] {
                backward[k] = backward[none];
            }
        }
        // The part of a stage that does not scale with its blocks: reserved memory, the
        // largest transient of a block's backward, ZeRO-3's gathered weights.
        let body_transient = kinds
            .iter()
            .filter(|(_, k)| allowed[k.index()])
            .map(|&(r, _)| block(r).transient)
            .fold(0.0, f64::max);
        let gathered = |largest: f64| {
            if l.zero == 3 {
                2.0 * largest * weight_bytes
            } else {
                0.0
            }
        };
        let reserved = self.cluster().device.reserved_bytes;
        let constant = reserved + body_transient + gathered(b0.params);
        // Head and tail: their states, their activations at the most micro-batches their chunk
        // ever holds, and what they add to the stage's transient.
        let profiles = self.profiles(p, v, m);
        let most = |j: usize, c: usize| profiles[j].iter().map(|q| q[c]).max().unwrap_or(1) as f64;
        let end = |range: std::ops::Range<usize>, j: usize, c: usize| -> (Extra, f64) {
            let (mut fwd, mut bwd, mut mem) = (0.0, 0.0, 0.0);
            let (mut transient, mut largest) = (body_transient, b0.params);
            for li in range {
                // The first and last stage differ when p > 1; a borrowed weight is then copied.
                let held = Self::held_params(costs, li, &|x| p == 1 || x == li);
                let lt = self.layer_time(&costs[li], Recompute::None, held, l);
                fwd += lt.forward();
                bwd += lt.backward();
                mem += states(held) + lt.saved * most(j, c);
                transient = transient.max(lt.transient);
                largest = largest.max(held);
            }
            let extra_workspace =
                transient - body_transient + gathered(largest) - gathered(b0.params);
            (
                Extra {
                    forward: fwd,
                    backward: bwd,
                },
                mem + extra_workspace,
            )
        };
        let (head, head_mem) = end(0..first, 0, 0);
        let (tail, tail_mem) = end(last + 1..costs.len(), p - 1, v - 1);
        let problem = BalanceProblem {
            stages: p,
            interleave: v,
            microbatches: m,
            layers: blocks.len(),
            forward: block(Recompute::None).forward(),
            backward,
            head,
            tail,
            memory: MemoryTerms {
                constant,
                parameter: states(b0.params),
                activation,
                head: constant + head_mem,
                tail: constant + tail_mem,
            },
            allowed,
            memory_cap: self.capacity(),
            uniform_full: true,
            time_limit: BALANCE_TIME_LIMIT_S,
        };
        let plan = balance(&problem, None).map_err(|e| e.to_string())?;
        // Virtual stage c * p + j holds chunk c of stage j; the head joins the first, the tail
        // the last.
        let mut chunks = Vec::with_capacity(p * v);
        let mut next = first;
        for vs in 0..p * v {
            let counts = plan.counts[vs / p][vs % p];
            let n: u32 = counts.iter().sum();
            let start = if vs == 0 { 0 } else { next };
            next += n as usize;
            let stop = if vs + 1 == p * v {
                costs.len() - 1
            } else {
                next - 1
            };
            chunks.push(ChunkLayers {
                first: start,
                last: stop,
                full_recompute: counts[RecomputeKind::Full.index()] as usize,
            });
        }
        Ok((chunks, plan.status))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::cluster::Cluster;
    use crate::cost::context_parallel::CpConfig;
    use crate::cost::memory::Precision;
    use crate::model::frontend::{
        Attention, Bias, Mlp, ModelDef, Norm, Position, TransformerConfig,
    };
    use crate::plan::layout::TrainingOptions;

    /// A small LLaMA-shaped model whose output layer costs a few blocks (large vocabulary).
    fn model(layers: u64) -> ModelDef {
        ModelDef::Transformer(TransformerConfig {
            hidden: 512,
            layers,
            heads: 8,
            kv_heads: 8,
            head_dim: 64,
            ffn_hidden: 1536,
            vocab: 64000,
            max_seq: 1024,
            mlp: Mlp::SwiGlu,
            norm: Norm::RmsNorm,
            position: Position::Rope,
            tied_embeddings: false,
            bias: Bias::None,
            dropout: false,
            moe: None,
            mla: None,
            qk_norm: false,
        })
    }

    fn cluster(gpus: u64) -> Cluster {
        Cluster::from_preset("test", "h100-sxm", 1, Some(gpus)).expect("preset")
    }

    fn options(headroom: f64) -> TrainingOptions {
        TrainingOptions {
            seq: 1024,
            precision: Precision::Bf16,
            attention: Attention::Flash,
            memory_headroom: headroom,
            vocab_multiple: 128,
            grad_accumulation_fusion: true,
            grad_reduce_in_fp32: true,
            overlap_grad_reduce: false,
            overlap_param_gather: false,
            moe_routing: Default::default(),
            fp32_loss: false,
            eager_elementwise: false,
            fp8: false,
            tp_comm_overlap: false,
            backward_prefetch: Default::default(),
        }
    }

    fn layout(pp: u64, v: u64, recompute: Recompute) -> Layout {
        Layout {
            cp: 1,
            cp_comm: Default::default(),
            ep: 1,
            etp: 1,
            tp: 1,
            pp,
            dp: 1,
            micro_batch: 1,
            global_batch: 16,
            interleave: v,
            sequence_parallel: false,
            recompute,
            zero: 0,
        }
    }

    /// Every split of `layers` layers into `parts` contiguous non-empty chunks.
    fn splits(layers: usize, parts: usize) -> Vec<Vec<ChunkLayers>> {
        fn go(
            start: usize,
            layers: usize,
            parts: usize,
            cur: &mut Vec<ChunkLayers>,
            out: &mut Vec<Vec<ChunkLayers>>,
        ) {
            if parts == 1 {
                cur.push(ChunkLayers {
                    first: start,
                    last: layers - 1,
                    full_recompute: 0,
                });
                out.push(cur.clone());
                cur.pop();
                return;
            }
            for last in start..=layers - parts {
                cur.push(ChunkLayers {
                    first: start,
                    last,
                    full_recompute: 0,
                });
                go(last + 1, layers, parts - 1, cur, out);
                cur.pop();
            }
        }
        let mut out = Vec::new();
        go(0, layers, parts, &mut Vec::new(), &mut out);
        out
    }

    /// Alpa's objective of a priced split: sum of stage times + (m - 1) x the largest.
    fn proxy(e: &Estimate) -> f64 {
        let times: Vec<f64> = e.stages.iter().map(|s| s.per_microbatch_s).collect();
        let max = times.iter().copied().fold(0.0, f64::max);
        times.iter().sum::<f64>() + (e.num_microbatches - 1) as f64 * max
    }

    #[test]
    fn dp_split_is_the_exhaustive_optimum_under_a_memory_cap() {
        let def = model(8);
        let c = cluster(4);
        let l = layout(4, 1, Recompute::None);
        let all = splits(10, 4);
        assert_eq!(all.len(), 84);
        // Price every split once without a cap to choose caps that bind.
        let free = Estimator::new("m", &def, &c, options(0.0));
        let peaks: Vec<f64> = all
            .iter()
            .map(|s| {
                free.evaluate_assignment(&l, s, Partition::Dp)
                    .expect("prices")
                    .memory
                    .total
            })
            .collect();
        let mut sorted = peaks.clone();
        sorted.sort_by(f64::total_cmp);
        for quantile in [0.1, 0.5, 1.0] {
            let cap = sorted[((sorted.len() - 1) as f64 * quantile) as usize] * (1.0 + 1e-9);
            let est = Estimator::new("m", &def, &c, options(1.0 - cap / c.device.hbm_bytes));
            let best = all
                .iter()
                .map(|s| {
                    est.evaluate_assignment(&l, s, Partition::Dp)
                        .expect("prices")
                })
                .filter(|e| e.fits)
                .map(|e| proxy(&e))
                .fold(f64::INFINITY, f64::min);
            let prepared = est
                .prepare(PricingKey {
                    micro_batch: 1,
                    tp: 1,
                    sp: false,
                    cp: CpConfig::NONE,
                    ep: 1,
                    etp: 1,
                })
                .expect("prepares");
            let chunks = est.dp_chunks(&prepared.1, &l).expect("a split fits");
            let got = est
                .evaluate_assignment(&l, &chunks, Partition::Dp)
                .expect("prices");
            assert!(got.fits, "quantile {quantile}");
            assert!(
                (proxy(&got) - best).abs() <= 1e-12 * best,
                "quantile {quantile}: DP {} vs exhaustive {best}",
                proxy(&got)
            );
        }
    }

    #[test]
    fn balancing_moves_blocks_off_the_output_layer() {
        let def = model(16);
        let c = cluster(4);
        let est = Estimator::new("m", &def, &c, options(0.1));
        for v in [1, 2] {
            let l = layout(4, v, Recompute::None);
            let even = est.evaluate(&l).expect("prices");
            let r = est.refine(&l).expect("refines");
            // The DP (v = 1) and the balancer find the same optimum; either beats the even split.
            assert_ne!(r.estimate.partition, Partition::Even, "v {v}");
            assert!(
                r.estimate.step_time_s < even.step_time_s * 0.97,
                "v {v}: {} vs even {}",
                r.estimate.step_time_s,
                even.step_time_s
            );
            let last = &r.estimate.stages[3];
            assert!(
                last.blocks < 16 / 4,
                "v {v}: the last stage keeps {} blocks",
                last.blocks
            );
            assert_eq!(r.attempts.len(), 3);
        }
    }

    #[test]
    fn refinement_fits_what_the_even_split_cannot_and_recomputes_only_what_it_must() {
        let def = model(16);
        let c = cluster(2);
        let l = layout(2, 1, Recompute::Full);
        // A cap below what any split needs without recomputation, above what the even split
        // needs recomputing every block.
        let free = Estimator::new("m", &def, &c, options(0.0));
        let none = splits(18, 2)
            .iter()
            .map(|s| {
                free.evaluate_assignment(&layout(2, 1, Recompute::None), s, Partition::Dp)
                    .expect("prices")
                    .memory
                    .total
            })
            .fold(f64::INFINITY, f64::min);
        let all = free.evaluate(&l).expect("prices");
        assert!(all.memory.total < none);
        let cap = (none + all.memory.total) / 2.0;
        let est = Estimator::new("m", &def, &c, options(1.0 - cap / c.device.hbm_bytes));
        assert!(
            !est.evaluate(&layout(2, 1, Recompute::None))
                .expect("prices")
                .fits
        );
        let r = est.refine(&l).expect("refines");
        let e = &r.estimate;
        assert!(e.fits);
        assert_eq!(e.layout.recompute, Recompute::Full);
        let recomputed: usize = e
            .stages
            .iter()
            .flat_map(|s| &s.chunks)
            .map(|c| c.full_recompute)
            .sum();
        assert!(
            recomputed > 0 && recomputed < 16,
            "recomputes {recomputed} of 16 blocks"
        );
        // Megatron-LM recomputes the first N blocks of every chunk: the same N everywhere.
        let n: Vec<usize> = e
            .stages
            .iter()
            .flat_map(|s| &s.chunks)
            .map(|c| c.full_recompute)
            .collect();
        assert!(n.iter().all(|&x| x == n[0]), "{n:?}");
        assert!(e.step_time_s < est.evaluate(&l).expect("prices").step_time_s);
    }
}
