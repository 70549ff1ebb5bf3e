//! Operator clustering: a topologically ordered op sequence cut into `L` contiguous layers so
//! the inter-operator DP runs on `L` layers instead of `K` ops (ALGORITHMS.md §1).
//!
//! ```text
//! G(k, r) = min over i <= k of max(G(i - 1, r - 1), Comm(i, k))
//!           subject to FLOPs(o_i..o_k) <= (1 + delta) FLOPs_total / L
//! ```
//!
//! `Comm(i, k)` is the bytes of the tensors ops `i..k` read that an op before `i` produced
//! (parameters and model inputs excluded): what crosses into the layer. Every layer holds at
//! least one heavy op (matrix product, attention) when there are enough of them. Among the
//! clusterings with the least maximum communication the one with the most uniform FLOPs wins
//! (least sum of squared layer FLOPs); two passes keep this exact (the first finds the optimal
//! maximum, the second minimises the sum of squares under it). When no clustering meets the
//! FLOPs bound, `delta` is doubled until one does.

use crate::model::graph::{Graph, OpKind, TensorKind};

/// What clustering needs to know of one forward op.
#[derive(Clone, Debug, PartialEq)]
pub struct OpCost {
    /// Forward FLOPs.
    pub flops: f64,
    /// Matrix product or attention.
    pub heavy: bool,
    /// Activations the op reads: (tensor id, bytes, index of the producing op).
    pub reads: Vec<(usize, f64, usize)>,
}

/// A clustering.
#[derive(Clone, Debug, PartialEq)]
pub struct Clustering {
    /// Layers as inclusive op ranges, in order.
    pub ranges: Vec<(usize, usize)>,
    /// Largest communication into a layer, bytes.
    pub max_comm: f64,
    /// The FLOPs tolerance that was needed.
    pub delta: f64,
}

/// Why ops cannot be clustered.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LayeringError {
    /// More layers than ops, or none.
    #[error("cannot cut {ops} ops into {layers} layers")]
    Count {
        /// Ops.
        ops: usize,
        /// Layers asked for.
        layers: usize,
    },
}

/// The forward ops of `g` in order, with what clustering needs.
pub fn op_costs(g: &Graph) -> Vec<OpCost> {
    let forward: Vec<usize> = g
        .ops
        .iter()
        .enumerate()
        .filter(|(_, o)| o.pass == crate::model::graph::Pass::Forward)
        .map(|(i, _)| i)
        .collect();
    let mut producer = vec![usize::MAX; g.tensors.len()];
    for (pos, &o) in forward.iter().enumerate() {
        for &t in &g.ops[o].outputs {
            producer[t.0 as usize] = pos;
        }
    }
    forward
        .iter()
        .map(|&o| {
            let op = &g.ops[o];
            OpCost {
                flops: op.flops,
                heavy: matches!(
                    op.kind,
                    OpKind::MatMul { .. }
                        | OpKind::BatchMatMul { .. }
                        | OpKind::FlashAttention { .. }
                ),
                reads: op
                    .inputs
                    .iter()
                    .filter(|t| g.tensor(**t).kind == TensorKind::Activation)
                    .filter(|t| producer[t.0 as usize] != usize::MAX)
                    .map(|t| {
                        (
                            t.0 as usize,
                            g.tensor(*t).bytes() as f64,
                            producer[t.0 as usize],
                        )
                    })
                    .collect(),
            }
        })
        .collect()
}

/// `comm[i][k]`: bytes entering layer `[i, k]`.
fn communication(ops: &[OpCost]) -> Vec<Vec<f64>> {
    let k_max = ops.len();
    let tensors = ops
        .iter()
        .flat_map(|o| o.reads.iter().map(|r| r.0 + 1))
        .max()
        .unwrap_or(0);
    let mut stamp = vec![usize::MAX; tensors];
    let mut comm = vec![vec![0.0; k_max]; k_max];
    for (i, row) in comm.iter_mut().enumerate() {
        let mut total = 0.0;
        for (k, op) in ops.iter().enumerate().skip(i) {
            for &(t, bytes, producer) in &op.reads {
                if producer < i && stamp[t] != i {
                    stamp[t] = i;
                    total += bytes;
                }
            }
            row[k] = total;
        }
    }
    comm
}

/// Clusters `ops` into `layers` layers (see the module documentation).
pub fn cluster(ops: &[OpCost], layers: usize, delta: f64) -> Result<Clustering, LayeringError> {
    let k_max = ops.len();
    if layers == 0 || layers > k_max {
        return Err(LayeringError::Count { ops: k_max, layers });
    }
    let comm = communication(ops);
    let mut prefix_flops = vec![0.0; k_max + 1];
    let mut prefix_heavy = vec![0usize; k_max + 1];
    for (i, o) in ops.iter().enumerate() {
        prefix_flops[i + 1] = prefix_flops[i] + o.flops;
        prefix_heavy[i + 1] = prefix_heavy[i] + usize::from(o.heavy);
    }
    let total = prefix_flops[k_max];
    let min_heavy = usize::from(prefix_heavy[k_max] >= layers);
    let mut delta = delta.max(0.0);
    loop {
        let cap = (1.0 + delta) * total / layers as f64;
        let ok = |i: usize, k: usize| {
            prefix_flops[k + 1] - prefix_flops[i] <= cap * (1.0 + 1e-12)
                && prefix_heavy[k + 1] - prefix_heavy[i] >= min_heavy
        };
        // A layer ending before op k starts no earlier than `first[k]`: the FLOPs bound admits
        // only a suffix of start points (FLOPs are never negative), so the passes skip the rest.
        let first: Vec<usize> = (0..=k_max)
            .map(|k| {
                prefix_flops[..k].partition_point(|&p| prefix_flops[k] - p > cap * (1.0 + 1e-12))
            })
            .collect();
        if let Some((ranges, max_comm)) = solve(&comm, &prefix_flops, &first, layers, &ok) {
            return Ok(Clustering {
                ranges,
                max_comm,
                delta,
            });
        }
        // Beyond total FLOPs the bound no longer restricts anything; the heavy-op rule alone
        // always admits a clustering when it applies.
        if cap > total {
            return Err(LayeringError::Count { ops: k_max, layers });
        }
        delta = if delta == 0.0 { 0.125 } else { 2.0 * delta };
    }
}

/// The two passes: least maximum communication, then least sum of squared FLOPs under it;
/// `first[k]`: no layer ending before op `k` that `ok` admits starts before it.
fn solve(
    comm: &[Vec<f64>],
    prefix_flops: &[f64],
    first: &[usize],
    layers: usize,
    ok: &dyn Fn(usize, usize) -> bool,
) -> Option<(Vec<(usize, usize)>, f64)> {
    let k_max = comm.len();
    let inf = f64::INFINITY;
    // Pass 1: g[r][k] = least max communication cutting ops 0..k (exclusive) into r layers.
    let mut g = vec![vec![inf; k_max + 1]; layers + 1];
    g[0][0] = 0.0;
    for r in 1..=layers {
        for k in 1..=k_max {
            for i in (r - 1).max(first[k])..k {
                if g[r - 1][i] < inf && ok(i, k - 1) {
                    let v = g[r - 1][i].max(comm[i][k - 1]);
                    if v < g[r][k] {
                        g[r][k] = v;
                    }
                }
            }
        }
    }
    let best_max = g[layers][k_max];
    if best_max == inf {
        return None;
    }
    // Pass 2: least sum of squared layer FLOPs with every layer's communication <= best_max.
    let flops = |i: usize, k: usize| prefix_flops[k + 1] - prefix_flops[i];
    let mut h = vec![vec![inf; k_max + 1]; layers + 1];
    let mut arg = vec![vec![0usize; k_max + 1]; layers + 1];
    h[0][0] = 0.0;
    for r in 1..=layers {
        for k in 1..=k_max {
            for i in (r - 1).max(first[k])..k {
                if h[r - 1][i] < inf && ok(i, k - 1) && comm[i][k - 1] <= best_max {
                    let v = h[r - 1][i] + flops(i, k - 1).powi(2);
                    if v < h[r][k] {
                        h[r][k] = v;
                        arg[r][k] = i;
                    }
                }
            }
        }
    }
    let mut ranges = Vec::with_capacity(layers);
    let mut k = k_max;
    for r in (1..=layers).rev() {
        let i = arg[r][k];
        ranges.push((i, k - 1));
        k = i;
    }
    ranges.reverse();
    Some((ranges, best_max))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Every way to cut the ops into `layers` contiguous layers, scored lexicographically.
    fn brute_force(ops: &[OpCost], layers: usize, delta: f64) -> Option<(f64, f64)> {
        let k_max = ops.len();
        let comm = communication(ops);
        let total: f64 = ops.iter().map(|o| o.flops).sum();
        let heavy_total = ops.iter().filter(|o| o.heavy).count();
        let min_heavy = usize::from(heavy_total >= layers);
        let cap = (1.0 + delta) * total / layers as f64;
        let mut best: Option<(f64, f64)> = None;
        for cuts in 0u32..(1 << (k_max - 1)) {
            if cuts.count_ones() as usize != layers - 1 {
                continue;
            }
            let (mut start, mut max, mut sq, mut ok) = (0, 0.0f64, 0.0, true);
            for i in 0..k_max {
                if i == k_max - 1 || cuts & (1 << i) != 0 {
                    let f: f64 = ops[start..=i].iter().map(|o| o.flops).sum();
                    let h = ops[start..=i].iter().filter(|o| o.heavy).count();
                    ok &= f <= cap * (1.0 + 1e-12) && h >= min_heavy;
                    max = max.max(comm[start][i]);
                    sq += f * f;
                    start = i + 1;
                }
            }
            if ok && best.is_none_or(|(bm, bs)| max < bm || (max == bm && sq < bs)) {
                best = Some((max, sq));
            }
        }
        best
    }

    fn ops_strategy() -> impl Strategy<Value = Vec<OpCost>> {
        (2usize..=9).prop_flat_map(|k| {
            proptest::collection::vec(
                (
                    0u32..20,
                    any::<bool>(),
                    proptest::collection::vec((0usize..9, 1u32..5), 0..3),
                ),
                k,
            )
            .prop_map(move |raw| {
                raw.into_iter()
                    .enumerate()
                    .map(|(i, (f, heavy, reads))| OpCost {
                        flops: f as f64,
                        heavy,
                        // Read the output of an earlier op (tensor id = producer index).
                        reads: reads
                            .into_iter()
                            .filter(|&(p, _)| p < i)
                            .map(|(p, b)| (p, b as f64 * 4.0, p))
                            .collect(),
                    })
                    .collect()
            })
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        #[test]
        fn dp_equals_exhaustive_search(ops in ops_strategy(), layers in 1usize..=4, delta in 0.0f64..1.5) {
            prop_assume!(layers <= ops.len());
            let got = cluster(&ops, layers, delta).expect("clusters");
            // With the delta the DP settled on, exhaustive search finds the same optimum.
            let (best_max, best_sq) = brute_force(&ops, layers, got.delta).expect("feasible at that delta");
            let comm = communication(&ops);
            let sq: f64 = got.ranges.iter().map(|&(i, k)| ops[i..=k].iter().map(|o| o.flops).sum::<f64>().powi(2)).sum();
            let max = got.ranges.iter().map(|&(i, k)| comm[i][k]).fold(0.0, f64::max);
            prop_assert_eq!(max, best_max);
            prop_assert_eq!(got.max_comm, best_max);
            prop_assert!((sq - best_sq).abs() < 1e-9, "{} vs {}", sq, best_sq);
            // Contiguous cover.
            prop_assert_eq!(got.ranges.first().map(|r| r.0), Some(0));
            prop_assert_eq!(got.ranges.last().map(|r| r.1), Some(ops.len() - 1));
            for w in got.ranges.windows(2) {
                prop_assert_eq!(w[0].1 + 1, w[1].0);
            }
        }
    }

    #[test]
    fn communication_counts_tensors_from_before_the_layer_once() {
        let ops = vec![
            OpCost {
                flops: 1.0,
                heavy: true,
                reads: vec![],
            },
            OpCost {
                flops: 1.0,
                heavy: false,
                reads: vec![(0, 8.0, 0)],
            },
            OpCost {
                flops: 1.0,
                heavy: true,
                reads: vec![(0, 8.0, 0), (1, 2.0, 1)],
            },
        ];
        let comm = communication(&ops);
        assert_eq!(
            comm[1][2], 8.0,
            "tensor 0 read twice, counted once; tensor 1 internal"
        );
        assert_eq!(comm[2][2], 10.0);
        assert_eq!(comm[0][2], 0.0);
    }
}
