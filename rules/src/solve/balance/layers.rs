//! Which layers of one pipeline stage to recompute (activation checkpointing) so that the
//! stage fits its memory cap with its micro-batches in flight, at the least recomputation
//! time: the balancing step after Alpa's stage DP in the intra-op space (ALGORITHMS.md §4,
//! SAPP's recompute balancing for a stage whose layers and sharding are fixed).
//!
//! Layer `l` recomputed keeps `checkpoint_l` bytes per micro-batch in flight instead of its
//! activations `a_l`, adds its forward time `f_l` to the backward pass, and holds `a_l` for
//! one micro-batch while it is recomputed. With `R` the recomputed set and `q` micro-batches
//! in flight the stage needs
//!
//! ```text
//! states + q * (sum_{l not in R} a_l + sum_{l in R} checkpoint_l) + max_{l in R} a_l
//! ```
//!
//! Recomputing a layer can also cost memory (with one micro-batch in flight it keeps its
//! inputs and still holds its activations while it is recomputed), so recomputing every layer
//! is not always the leanest choice. Layers with the same figures are interchangeable
//! (identical transformer blocks with the same sharding), so the search enumerates how many
//! of each such group are recomputed: exact. A stage of more than [`MAX_EXACT_COMBINATIONS`]
//! combinations (a dozen or more distinct layers) instead recomputes layers in order of
//! forward time per byte saved until it fits, and says that the choice is not proven least.

use crate::solve::intra::chain::Entry;

/// Most combinations of group counts searched exactly.
pub const MAX_EXACT_COMBINATIONS: u64 = 100_000;

/// The layers to recompute.
#[derive(Clone, Debug, PartialEq)]
pub struct RecomputeChoice {
    /// Per layer of the stage, in order: recomputed or not.
    pub recomputed: Vec<bool>,
    /// Forward time added to the backward pass per micro-batch, s.
    pub seconds: f64,
    /// Memory per device with the micro-batches in flight, bytes.
    pub memory: f64,
    /// Activations kept per micro-batch in flight, bytes.
    pub activations: f64,
    /// Whether the choice is proven the least recomputation (group counts enumerated).
    pub exact: bool,
}

impl RecomputeChoice {
    /// The stage of `layers` with `inflight` micro-batches in flight and the layers marked in
    /// `recomputed` recomputed.
    pub fn of(layers: &[Entry], inflight: u64, recomputed: Vec<bool>, exact: bool) -> Self {
        let (memory, activations) = stage_memory(layers, inflight, &recomputed);
        let seconds = layers
            .iter()
            .zip(&recomputed)
            .filter(|(_, r)| **r)
            .map(|(e, _)| e.forward)
            .sum();
        RecomputeChoice {
            recomputed,
            seconds,
            memory,
            activations,
            exact,
        }
    }
}

/// The memory of a stage whose layers are `layers` (each its entry in a table built with one
/// micro-batch in flight) with `inflight` micro-batches in flight and the layers marked in
/// `recomputed` recomputed; and the activations kept per micro-batch.
pub fn stage_memory(layers: &[Entry], inflight: u64, recomputed: &[bool]) -> (f64, f64) {
    let q = inflight.max(1) as f64;
    let mut states = 0.0;
    let mut kept = 0.0;
    let mut peak = 0.0f64;
    for (e, &r) in layers.iter().zip(recomputed) {
        // The backward transient is live beside the layer's recomputed activations, and only
        // the largest layer's counts.
        states += e.memory - e.activations - e.working;
        if r {
            kept += e.checkpoint;
            peak = peak.max(e.peak_layer + e.working);
        } else {
            kept += e.activations;
            peak = peak.max(e.working);
        }
    }
    (states + q * kept + peak, kept)
}

/// The least recomputation that fits `budget` with `inflight` micro-batches in flight;
/// `None` when not even recomputing every layer fits.
pub fn least_recompute(layers: &[Entry], inflight: u64, budget: f64) -> Option<RecomputeChoice> {
    let n = layers.len();
    let choice = |recomputed: Vec<bool>, exact: bool| {
        RecomputeChoice::of(layers, inflight, recomputed, exact)
    };
    let fits = |r: &[bool]| stage_memory(layers, inflight, r).0 <= budget;
    if fits(&vec![false; n]) {
        return Some(choice(vec![false; n], true));
    }
    // Groups of interchangeable layers, each with its members in order.
    let figures = |e: &Entry| {
        [
            e.memory,
            e.activations,
            e.forward,
            e.checkpoint,
            e.peak_layer,
            e.working,
        ]
        .map(f64::to_bits)
    };
    let mut groups: Vec<([u64; 6], Vec<usize>)> = Vec::new();
    for (l, e) in layers.iter().enumerate() {
        let f = figures(e);
        match groups.iter_mut().find(|(g, _)| *g == f) {
            Some((_, members)) => members.push(l),
            None => groups.push((f, vec![l])),
        }
    }
    let combinations = groups
        .iter()
        .try_fold(1u64, |acc, (_, m)| acc.checked_mul(m.len() as u64 + 1));
    if combinations.is_none_or(|c| c > MAX_EXACT_COMBINATIONS) {
        let r = greedy(layers, &fits);
        return fits(&r).then(|| choice(r, false));
    }
    // Every count per group; the first members of a group are the recomputed ones.
    let mut counts = vec![0usize; groups.len()];
    let mut best: Option<(f64, Vec<bool>)> = None;
    loop {
        let mut r = vec![false; n];
        for ((_, members), &c) in groups.iter().zip(&counts) {
            for &l in &members[..c] {
                r[l] = true;
            }
        }
        let seconds: f64 = groups
            .iter()
            .zip(&counts)
            .map(|((_, m), &c)| c as f64 * layers[m[0]].forward)
            .sum();
        if best.as_ref().is_none_or(|(s, _)| seconds < *s) && fits(&r) {
            best = Some((seconds, r));
        }
        // Next combination (odometer).
        let mut g = 0;
        loop {
            if g == groups.len() {
                return best.map(|(_, r)| choice(r, true));
            }
            counts[g] += 1;
            if counts[g] <= groups[g].1.len() {
                break;
            }
            counts[g] = 0;
            g += 1;
        }
    }
}

/// Recomputes layers in order of forward time per byte of activations it saves until the
/// stage fits, or every layer that saves memory when that does not suffice.
fn greedy(layers: &[Entry], fits: &dyn Fn(&[bool]) -> bool) -> Vec<bool> {
    let mut order: Vec<usize> = (0..layers.len()).collect();
    let ratio = |l: usize| {
        let saved = layers[l].activations - layers[l].checkpoint;
        if saved > 0.0 {
            layers[l].forward / saved
        } else {
            f64::INFINITY
        }
    };
    order.sort_by(|&a, &b| ratio(a).total_cmp(&ratio(b)));
    let mut r = vec![false; layers.len()];
    for l in order.into_iter().filter(|&l| ratio(l).is_finite()) {
        r[l] = true;
        if fits(&r) {
            break;
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A layer holding `states` bytes of weights and optimizer states.
    fn layer(states: f64, activations: f64, forward: f64, checkpoint: f64) -> Entry {
        Entry {
            cost: 3.0 * forward,
            memory: states + activations,
            activations,
            forward,
            checkpoint,
            peak_layer: activations,
            step: 0.0,
            sync: 0.0,
            working: 0.0,
        }
    }

    /// `e` with a backward transient of `working` bytes on top of what it holds.
    fn with_working(e: Entry, working: f64) -> Entry {
        Entry {
            memory: e.memory + working,
            working,
            ..e
        }
    }

    /// The least recomputation by trying every subset.
    fn brute(layers: &[Entry], inflight: u64, budget: f64) -> Option<f64> {
        let n = layers.len();
        (0u32..1 << n)
            .filter_map(|mask| {
                let r: Vec<bool> = (0..n).map(|l| mask & (1 << l) != 0).collect();
                let (m, _) = stage_memory(layers, inflight, &r);
                (m <= budget).then(|| {
                    (0..n)
                        .filter(|&l| r[l])
                        .map(|l| layers[l].forward)
                        .sum::<f64>()
                })
            })
            .min_by(f64::total_cmp)
    }

    #[test]
    fn the_least_recomputation_is_the_exhaustive_optimum() {
        // An embedding, identical blocks and a large head, as on a first or last stage.
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % 1000) as f64 / 1000.0
        };
        for case in 0..200 {
            let blocks = 1 + case % 6;
            // Backward transients (only the largest counts) on half the cases: a head's
            // large loss, a block's activation gradient.
            let w = if case % 2 == 0 { 1.0 } else { 0.0 };
            let block = with_working(
                layer(10.0 + next(), 4.0 + next(), 1.0 + next(), 0.5 * next()),
                w * next(),
            );
            let mut layers = vec![layer(3.0, 0.5 + next(), 0.2, 0.0)];
            layers.extend(std::iter::repeat_n(block, blocks));
            layers.push(with_working(
                layer(6.0 + next(), 8.0 * next(), 0.9 + next(), 0.4),
                w * 3.0 * next(),
            ));
            // A few odd layers too, so groups of one mix with groups of many.
            if case % 3 == 0 {
                layers.insert(2, layer(5.0, 3.0 * next(), 0.3 + next(), 0.1));
            }
            let inflight = 1 + (case as u64 % 4);
            let all = stage_memory(&layers, inflight, &vec![true; layers.len()]).0;
            let none = stage_memory(&layers, inflight, &vec![false; layers.len()]).0;
            for t in [0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0] {
                let budget = all * 0.99 + t * (none - all * 0.99);
                let want = brute(&layers, inflight, budget);
                let got = least_recompute(&layers, inflight, budget);
                match (want, &got) {
                    (None, None) => {}
                    (Some(w), Some(g)) => {
                        assert!(g.exact);
                        assert!((g.seconds - w).abs() < 1e-12, "case {case}: {g:?} vs {w}");
                        assert!(g.memory <= budget);
                    }
                    _ => panic!("case {case} budget {budget}: {got:?} vs {want:?}"),
                }
            }
        }
    }

    #[test]
    fn only_the_largest_backward_transient_counts() {
        let plain = layer(10.0, 4.0, 1.0, 0.5);
        let layers = [with_working(plain, 2.0), with_working(plain, 3.0)];
        // Held: 2 x (10 + 2 x 4 activations); the larger transient once.
        assert_eq!(stage_memory(&layers, 2, &[false, false]).0, 36.0 + 3.0);
        // The second layer recomputed: its input kept, its activations and its transient
        // live together while it is recomputed.
        assert_eq!(
            stage_memory(&layers, 2, &[false, true]).0,
            20.0 + 2.0 * (4.0 + 0.5) + (4.0 + 3.0)
        );
        // The chain's sum of the two keeps the larger transient as well.
        let sum = layers[0].plus(layers[1]);
        assert_eq!((sum.memory, sum.working), (2.0 * 14.0 + 3.0, 3.0));
    }

    #[test]
    fn many_distinct_layers_fit_greedily() {
        let layers: Vec<Entry> = (0..24)
            .map(|l| layer(1.0 + l as f64 * 0.01, 2.0 + l as f64 * 0.1, 1.0, 0.1))
            .collect();
        let all = stage_memory(&layers, 4, &[true; 24]).0;
        let got = least_recompute(&layers, 4, all * 1.2).expect("fits");
        assert!(!got.exact);
        assert!(got.memory <= all * 1.2);
        assert!(got.recomputed.iter().any(|r| !r));
        assert!(least_recompute(&layers, 4, all * 0.99).is_none());
    }
}
