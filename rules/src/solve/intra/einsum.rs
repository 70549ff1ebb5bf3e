//! Every op of the IR as a loop nest over named dimensions (an "einsum"): which axis of each
//! operand and result carries which dimension, and what splitting a dimension over a mesh axis
//! costs. A strategy is then an assignment of mesh axes to dimensions.
//!
//! * a **parallel** dimension appears in every result: splitting it divides the work;
//! * a **reduce** dimension is summed over: a result that lacks it is a partial sum over the
//!   mesh axes it is split on (an all-reduce, or for weight gradients the per-step gradient
//!   synchronisation);
//! * a **stats** dimension is normalised over (layer norm, softmax, the loss's vocabulary):
//!   splitting it needs an all-reduce of a few values per row;
//! * a **fixed** dimension is never split (the keys of the attention core, a head's width).

use crate::model::graph::{Graph, Op, OpKind, TensorId, TensorKind};

/// What splitting a dimension means.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DimKind {
    /// Independent iterations.
    Parallel,
    /// Summed over.
    Reduce,
    /// Normalised over: splitting costs `reductions` all-reduces of `bytes` per row each.
    Stats {
        /// All-reduces, one after the other.
        reductions: u8,
        /// Bytes per row of each.
        bytes: f64,
    },
    /// Never split.
    Fixed,
}

/// An op's loop nest.
#[derive(Clone, Debug, PartialEq)]
pub struct Einsum {
    /// Dimensions.
    pub dims: Vec<DimKind>,
    /// Per operand, per axis: the dimension the axis carries (its split axis), if any.
    pub inputs: Vec<Vec<Option<usize>>>,
    /// Per result, per axis.
    pub outputs: Vec<Vec<Option<usize>>>,
    /// Per result, the dimensions it is a sum over: a split one leaves a partial sum. A result
    /// that lacks a dimension it is not summed over is computed whole on every device of the
    /// split (a bias gradient when the weight's rows are split).
    pub summed: Vec<Vec<usize>>,
}

/// An [`Einsum`] before its sums are known.
struct Raw {
    dims: Vec<DimKind>,
    inputs: Vec<Vec<Option<usize>>>,
    outputs: Vec<Vec<Option<usize>>>,
}

/// The loop nest with every result summed over the reduce dimensions it lacks.
fn finish(raw: Raw) -> Einsum {
    let summed = raw
        .outputs
        .iter()
        .map(|axes| {
            (0..raw.dims.len())
                .filter(|&d| raw.dims[d] == DimKind::Reduce && !axes.contains(&Some(d)))
                .collect()
        })
        .collect();
    Einsum {
        dims: raw.dims,
        inputs: raw.inputs,
        outputs: raw.outputs,
        summed,
    }
}

impl Einsum {
    /// Whether result `r` carries dimension `d`.
    pub fn output_has(&self, r: usize, d: usize) -> bool {
        self.outputs[r].contains(&Some(d))
    }
}

struct Builder {
    dims: Vec<DimKind>,
}

impl Builder {
    fn dim(&mut self, k: DimKind) -> usize {
        self.dims.push(k);
        self.dims.len() - 1
    }
}

fn shape(g: &Graph, t: TensorId) -> &[u64] {
    &g.tensor(t).shape
}

/// Axes of `s` (other than those in `skip`) matched in order to axes of `t` of equal size:
/// pairs (axis of s, axis of t).
fn match_in_order(
    s: &[u64],
    t: &[u64],
    skip_s: &[usize],
    skip_t: &[usize],
) -> Option<Vec<(usize, usize)>> {
    let sa: Vec<usize> = (0..s.len()).filter(|i| !skip_s.contains(i)).collect();
    let ta: Vec<usize> = (0..t.len()).filter(|i| !skip_t.contains(i)).collect();
    if sa.len() != ta.len() {
        return None;
    }
    let pairs: Vec<(usize, usize)> = sa.into_iter().zip(ta).collect();
    pairs.iter().all(|&(i, j)| s[i] == t[j]).then_some(pairs)
}

/// The axes of `x` that hold a matrix dimension of size `k` (the IR views `x` as `[rows, k]`):
/// the shortest trailing run with that product, else the smallest set containing the last axis
/// (heads and head width around the sequence axis), of equally small sets the one furthest
/// from the batch axis (with as many sequences as heads, `[b, h, s, d]` must not read as
/// `b x d`). The first of them is where a split goes.
fn k_axes(x: &[u64], k: u64) -> Option<Vec<usize>> {
    let r = x.len();
    let mut prod = 1u64;
    for i in (0..r).rev() {
        prod = prod.saturating_mul(x[i]);
        if prod == k {
            return Some((i..r).collect());
        }
        if prod > k {
            break;
        }
    }
    // A non-contiguous group (heads and head width around the sequence axis).
    let mut best: Option<Vec<usize>> = None;
    for mask in 1u32..(1 << r) {
        if mask & (1 << (r - 1)) == 0 {
            continue;
        }
        let axes: Vec<usize> = (0..r).filter(|i| mask & (1 << i) != 0).collect();
        let p = axes.iter().fold(1u64, |a, &i| a.saturating_mul(x[i]));
        let better = |b: &Vec<usize>| {
            axes.len() < b.len() || (axes.len() == b.len() && axes.first() > b.first())
        };
        if p == k && best.as_ref().is_none_or(better) {
            best = Some(axes);
        }
    }
    best
}

/// Axis lists of a tensor of rank `r` with `pairs` mapping its axes to dimensions.
fn axes_of(r: usize, pairs: &[(usize, usize)]) -> Vec<Option<usize>> {
    let mut v = vec![None; r];
    for &(axis, dim) in pairs {
        v[axis] = Some(dim);
    }
    v
}

/// Every axis of `t` aligned with the same-rank reference shape `reference` (whose axis `i`
/// is dimension `dims[i]`): equal sizes (or the last axis twice as wide, as SwiGLU's input)
/// carry the dimension, broadcast axes none.
fn aligned(
    g: &Graph,
    t: TensorId,
    reference: &[u64],
    dims: &[usize],
) -> Option<Vec<Option<usize>>> {
    let s = shape(g, t);
    if s.len() != reference.len() {
        return None;
    }
    Some(
        s.iter()
            .zip(reference)
            .enumerate()
            .map(|(i, (&n, &m))| {
                let last = i + 1 == s.len();
                (n == m || (last && (n == 2 * m || 2 * n == m))).then_some(dims[i])
            })
            .collect(),
    )
}

/// The loop nest of `op`, or `None` for a form this module does not know (the op is then
/// only ever replicated).
pub fn einsum(g: &Graph, op: &Op) -> Option<Einsum> {
    let mut b = Builder { dims: Vec::new() };
    let is_weight_grad = |t: TensorId| g.tensor(t).kind == TensorKind::WeightGradient;
    match op.kind {
        OpKind::MatMul { transpose_b }
            if op.outputs.first().is_some_and(|&y| is_weight_grad(y)) =>
        {
            // dW = x^T dy (and db): the token axes are summed over.
            let (x, dy, dw) = (op.inputs[0], op.inputs[1], op.outputs[0]);
            let (xs, dys, dws) = (shape(g, x), shape(g, dy), shape(g, dw));
            if dws.len() != 2 {
                return None;
            }
            let (ka, na) = if transpose_b { (1, 0) } else { (0, 1) };
            let kaxes = k_axes(xs, dws[ka])?;
            let naxes = k_axes(dys, dws[na])?;
            let n_axis = naxes[0];
            let tokens = match_in_order(xs, dys, &kaxes, &naxes)?;
            let kd = b.dim(DimKind::Parallel);
            let nd = b.dim(DimKind::Parallel);
            let mut xp = vec![(kaxes[0], kd)];
            let mut dyp = vec![(n_axis, nd)];
            for &(i, j) in &tokens {
                let d = b.dim(DimKind::Reduce);
                xp.push((i, d));
                dyp.push((j, d));
            }
            let mut outputs = vec![axes_of(2, &[(ka, kd), (na, nd)])];
            if let Some(&db) = op.outputs.get(1) {
                (shape(g, db).len() == 1).then_some(())?;
                outputs.push(vec![Some(nd)]);
            }
            Some(finish(Raw {
                dims: b.dims,
                inputs: vec![axes_of(xs.len(), &xp), axes_of(dys.len(), &dyp)],
                outputs,
            }))
        }
        OpKind::MatMul { transpose_b } => {
            let (x, w, y) = (op.inputs[0], op.inputs[1], op.outputs[0]);
            let (xs, ws, ys) = (shape(g, x), shape(g, w), shape(g, y));
            if ws.len() != 2 {
                return None;
            }
            let (ka, na) = if transpose_b { (1, 0) } else { (0, 1) };
            let kaxes = k_axes(xs, ws[ka])?;
            // The result's columns may be several axes too (heads and head width).
            let naxes = k_axes(ys, ws[na])?;
            let n_axis = naxes[0];
            let tokens = match_in_order(xs, ys, &kaxes, &naxes)?;
            let kd = b.dim(DimKind::Reduce);
            let nd = b.dim(DimKind::Parallel);
            let mut xp = vec![(kaxes[0], kd)];
            let mut yp = vec![(n_axis, nd)];
            for &(i, j) in &tokens {
                let d = b.dim(DimKind::Parallel);
                xp.push((i, d));
                yp.push((j, d));
            }
            let mut inputs = vec![axes_of(xs.len(), &xp), axes_of(2, &[(ka, kd), (na, nd)])];
            if op.inputs.len() > 2 {
                inputs.push(vec![Some(nd)]);
            }
            Some(finish(Raw {
                dims: b.dims,
                inputs,
                outputs: vec![axes_of(ys.len(), &yp)],
            }))
        }
        OpKind::BatchMatMul { transpose_b } => {
            let (a, bb, c) = (op.inputs[0], op.inputs[1], op.outputs[0]);
            let (as_, bs, cs) = (shape(g, a), shape(g, bb), shape(g, c));
            let r = as_.len();
            if r < 2 || bs.len() != r || cs.len() != r {
                return None;
            }
            let lead: Vec<usize> = (0..r - 2).map(|_| b.dim(DimKind::Parallel)).collect();
            let standard = cs[r - 2] == as_[r - 2]
                && cs[r - 1] == if transpose_b { bs[r - 2] } else { bs[r - 1] }
                && as_[r - 1] == if transpose_b { bs[r - 1] } else { bs[r - 2] };
            let with_lead = |last2: [Option<usize>; 2]| -> Vec<Option<usize>> {
                lead.iter().map(|&d| Some(d)).chain(last2).collect()
            };
            if standard {
                let (m, k, n) = (
                    b.dim(DimKind::Parallel),
                    b.dim(DimKind::Reduce),
                    b.dim(DimKind::Parallel),
                );
                let bl = if transpose_b {
                    [Some(n), Some(k)]
                } else {
                    [Some(k), Some(n)]
                };
                Some(finish(Raw {
                    dims: b.dims,
                    inputs: vec![with_lead([Some(m), Some(k)]), with_lead(bl)],
                    outputs: vec![with_lead([Some(m), Some(n)])],
                }))
            } else {
                // grad_b: db = a^T dy, shaped as the forward's second operand.
                let fwd_tb = op
                    .grad_of
                    .map(|f| matches!(g.op(f).kind, OpKind::BatchMatMul { transpose_b: true }))
                    .unwrap_or(false);
                let (m, k, n) = (
                    b.dim(DimKind::Reduce),
                    b.dim(DimKind::Parallel),
                    b.dim(DimKind::Parallel),
                );
                let out = if fwd_tb {
                    [Some(n), Some(k)]
                } else {
                    [Some(k), Some(n)]
                };
                Some(finish(Raw {
                    dims: b.dims,
                    inputs: vec![with_lead([Some(m), Some(k)]), with_lead([Some(m), Some(n)])],
                    outputs: vec![with_lead(out)],
                }))
            }
        }
        OpKind::Embedding => {
            let (ids, table, y) = (op.inputs[0], op.inputs[1], op.outputs[0]);
            let (is, ts, ys) = (shape(g, ids), shape(g, table), shape(g, y));
            if ts.len() != 2 || ys.len() != is.len() + 1 {
                return None;
            }
            let v = b.dim(DimKind::Reduce);
            let h = b.dim(DimKind::Parallel);
            let tokens: Vec<usize> = is.iter().map(|_| b.dim(DimKind::Parallel)).collect();
            Some(finish(Raw {
                dims: b.dims,
                inputs: vec![
                    tokens.iter().map(|&d| Some(d)).collect(),
                    vec![Some(v), Some(h)],
                ],
                outputs: vec![tokens.iter().map(|&d| Some(d)).chain([Some(h)]).collect()],
            }))
        }
        OpKind::EmbeddingGrad => {
            let (ids, dy, dt) = (op.inputs[0], op.inputs[1], op.outputs[0]);
            let (is, dys, ts) = (shape(g, ids), shape(g, dy), shape(g, dt));
            if ts.len() != 2 || dys.len() != is.len() + 1 {
                return None;
            }
            let v = b.dim(DimKind::Parallel);
            let h = b.dim(DimKind::Parallel);
            let tokens: Vec<usize> = is.iter().map(|_| b.dim(DimKind::Reduce)).collect();
            Some(finish(Raw {
                dims: b.dims,
                inputs: vec![
                    tokens.iter().map(|&d| Some(d)).collect(),
                    tokens.iter().map(|&d| Some(d)).chain([Some(h)]).collect(),
                ],
                outputs: vec![vec![Some(v), Some(h)]],
            }))
        }
        OpKind::LayerNorm | OpKind::RmsNorm => {
            let x = op.inputs[0];
            let xs = shape(g, x).to_vec();
            let r = xs.len();
            let rank = r;
            let mut dims: Vec<usize> = (0..r - 1).map(|_| b.dim(DimKind::Parallel)).collect();
            dims.push(b.dim(DimKind::Stats {
                reductions: 1,
                bytes: 8.0,
            }));
            let map = |t: TensorId| -> Option<Vec<Option<usize>>> {
                let s = shape(g, t);
                if s.len() == r {
                    aligned(g, t, &xs, &dims)
                } else if s.len() == 1 && s[0] == xs[r - 1] {
                    Some(vec![Some(dims[r - 1])])
                } else {
                    None
                }
            };
            let mut e = finish(Raw {
                inputs: op.inputs.iter().map(|&t| map(t)).collect::<Option<_>>()?,
                outputs: op.outputs.iter().map(|&t| map(t)).collect::<Option<_>>()?,
                dims: b.dims,
            });
            // The gradients of the scale and shift sum over every row.
            for (r, axes) in e.outputs.iter().enumerate() {
                if axes.len() == 1 {
                    e.summed[r].extend_from_slice(&dims[..rank - 1]);
                }
            }
            Some(e)
        }
        OpKind::CrossEntropy
            if op
                .outputs
                .first()
                .is_some_and(|&o| shape(g, o).iter().product::<u64>() == 1) =>
        {
            // Forward: logits [T.., V], labels [T..] -> a scalar loss.
            let (logits, labels) = (op.inputs[0], op.inputs[1]);
            let (ls, lab) = (shape(g, logits), shape(g, labels));
            if ls.len() != lab.len() + 1 {
                return None;
            }
            let tokens: Vec<usize> = lab.iter().map(|_| b.dim(DimKind::Reduce)).collect();
            // Megatron-LM's vocabulary-parallel cross-entropy all-reduces the maximum logit, the
            // target logit and the sum of exponentials per token, in fp32, one after the other.
            let v = b.dim(DimKind::Stats {
                reductions: 3,
                bytes: 4.0,
            });
            let loss_rank = shape(g, op.outputs[0]).len();
            Some(finish(Raw {
                dims: b.dims,
                inputs: vec![
                    tokens.iter().map(|&d| Some(d)).chain([Some(v)]).collect(),
                    tokens.iter().map(|&d| Some(d)).collect(),
                ],
                outputs: vec![vec![None; loss_rank]],
            }))
        }
        OpKind::FlashAttention { .. } => {
            // q [B, A, S, D], k/v [B, G, S', D]; the keys S' and the width D are never split.
            let qs = shape(g, op.inputs[0]).to_vec();
            if qs.len() != 4 {
                return None;
            }
            let (bd, hd, sd) = (
                b.dim(DimKind::Parallel),
                b.dim(DimKind::Parallel),
                b.dim(DimKind::Parallel),
            );
            let (q_like, kv_like) = (
                vec![Some(bd), Some(hd), Some(sd), None],
                vec![Some(bd), Some(hd), None, None],
            );
            // Which tensors are queries (q, o, dy, dq) and which keys/values.
            let fwd = op.grad_of.map(|f| g.op(f)).unwrap_or(op);
            let (fq, fk, fv) = (fwd.inputs[0], fwd.inputs[1], fwd.inputs[2]);
            let role = |t: TensorId| -> Vec<Option<usize>> {
                if t == fk || t == fv {
                    kv_like.clone()
                } else {
                    q_like.clone()
                }
            };
            let inputs: Vec<Vec<Option<usize>>> = op.inputs.iter().map(|&t| role(t)).collect();
            let outputs: Vec<Vec<Option<usize>>> = if op.pass == crate::model::graph::Pass::Forward
            {
                vec![q_like.clone()]
            } else {
                // Gradients of the forward inputs that needed one, in order.
                fwd.inputs
                    .iter()
                    .filter(|&&t| g.tensor(t).requires_grad)
                    .zip(&op.outputs)
                    .map(|(&t, _)| {
                        if t == fq {
                            q_like.clone()
                        } else {
                            kv_like.clone()
                        }
                    })
                    .collect()
            };
            (outputs.len() == op.outputs.len()).then_some(())?;
            let mut e = finish(Raw {
                dims: b.dims,
                inputs,
                outputs,
            });
            // Key and value gradients sum over the queries.
            for (r, axes) in e.outputs.iter().enumerate() {
                if !axes.contains(&Some(sd)) {
                    e.summed[r].push(sd);
                }
            }
            Some(e)
        }
        OpKind::Transpose => {
            // A permutation: match axes by size, in order.
            let (x, y) = (op.inputs[0], op.outputs[0]);
            let (xs, ys) = (shape(g, x).to_vec(), shape(g, y).to_vec());
            if xs.len() != ys.len() {
                return None;
            }
            let dims: Vec<usize> = ys.iter().map(|_| b.dim(DimKind::Parallel)).collect();
            let mut used = vec![false; ys.len()];
            let mut xa = vec![None; xs.len()];
            for (i, &n) in xs.iter().enumerate() {
                let j = (0..ys.len()).find(|&j| !used[j] && ys[j] == n)?;
                used[j] = true;
                xa[i] = Some(dims[j]);
            }
            Some(finish(Raw {
                dims: b.dims,
                inputs: vec![xa],
                outputs: vec![dims.iter().map(|&d| Some(d)).collect()],
            }))
        }
        OpKind::Slice => {
            // One tensor viewed as several (forward), or assembled from them (backward): the
            // axes of equal size match in order; the remaining axis of the whole carries the
            // dimension of the parts' first remaining axis (a fused QKV's width holds the heads).
            let (whole, parts): (TensorId, Vec<TensorId>) =
                if op.pass == crate::model::graph::Pass::Forward {
                    (op.inputs[0], op.outputs.clone())
                } else {
                    (op.outputs[0], op.inputs.clone())
                };
            let ws = shape(g, whole).to_vec();
            let ps = shape(g, *parts.first()?).to_vec();
            let dims: Vec<usize> = ps.iter().map(|_| b.dim(DimKind::Parallel)).collect();
            // Map the whole's axes to the first part's axes.
            let mut wa = vec![None; ws.len()];
            let mut used = vec![false; ps.len()];
            let mut leftover = Vec::new();
            for (i, &n) in ws.iter().enumerate() {
                match (0..ps.len()).find(|&j| !used[j] && ps[j] == n) {
                    Some(j) => {
                        used[j] = true;
                        wa[i] = Some(dims[j]);
                    }
                    None => leftover.push(i),
                }
            }
            let rest: Vec<usize> = (0..ps.len()).filter(|&j| !used[j]).collect();
            if let (Some(&i), Some(&j)) = (leftover.first(), rest.first()) {
                wa[i] = Some(dims[j]);
            }
            let part_axes = |t: TensorId| -> Option<Vec<Option<usize>>> {
                let s = shape(g, t);
                (s.len() == ps.len()).then(|| {
                    s.iter()
                        .zip(&ps)
                        .zip(&dims)
                        .enumerate()
                        .map(|(j, ((&n, &m), &d))| {
                            (n == m || rest.first() == Some(&j)).then_some(d)
                        })
                        .collect()
                })
            };
            let parts_axes: Vec<Vec<Option<usize>>> =
                parts.iter().map(|&t| part_axes(t)).collect::<Option<_>>()?;
            let (inputs, outputs) = if op.pass == crate::model::graph::Pass::Forward {
                (vec![wa], parts_axes)
            } else {
                (parts_axes, vec![wa])
            };
            Some(finish(Raw {
                dims: b.dims,
                inputs,
                outputs,
            }))
        }
        // Nothing is known of how its axes relate: never split, but along the batch when
        // every operand and result but the weights' carries it on axis 0.
        OpKind::Opaque { batched } => {
            let weight = |t: TensorId| {
                matches!(
                    g.tensor(t).kind,
                    TensorKind::Parameter | TensorKind::WeightGradient
                )
            };
            let first = op.inputs.iter().chain(&op.outputs).find(|&&t| !weight(t))?;
            let batch = *shape(g, *first).first()?;
            let per_sample = op
                .inputs
                .iter()
                .chain(&op.outputs)
                .all(|&t| weight(t) || shape(g, t).first() == Some(&batch));
            if !batched || !per_sample {
                return None;
            }
            let d = b.dim(DimKind::Parallel);
            let axes = |t: TensorId| {
                let mut a = vec![None; shape(g, t).len()];
                if !weight(t) {
                    a[0] = Some(d);
                }
                a
            };
            let mut e = finish(Raw {
                inputs: op.inputs.iter().map(|&t| axes(t)).collect(),
                outputs: op.outputs.iter().map(|&t| axes(t)).collect(),
                dims: b.dims,
            });
            // A weight's gradient sums over the samples.
            for (r, &t) in op.outputs.iter().enumerate() {
                if weight(t) {
                    e.summed[r].push(d);
                }
            }
            Some(e)
        }
        _ => {
            // Elementwise (gelu, silu, swiglu, dropout, rope, add, mul, dropout_add), softmax,
            // and the backward kernels of all of these and of the loss: aligned with the first
            // result; the last axis of a softmax (and its backward) is normalised over.
            let y = *op.outputs.first()?;
            let ys = shape(g, y).to_vec();
            let stats_last = match op.kind {
                OpKind::Softmax => Some(if op.pass == crate::model::graph::Pass::Forward {
                    8.0
                } else {
                    4.0
                }),
                _ => None,
            };
            let r = ys.len();
            let dims: Vec<usize> = (0..r)
                .map(|i| match stats_last {
                    Some(c) if i + 1 == r => b.dim(DimKind::Stats {
                        reductions: 1,
                        bytes: c,
                    }),
                    _ => b.dim(DimKind::Parallel),
                })
                .collect();
            // The loss's backward reads the labels, one per token: the leading axes.
            let per_token = |t: TensorId| -> Option<Vec<Option<usize>>> {
                let s = shape(g, t);
                (op.kind == OpKind::CrossEntropy && s.len() + 1 == r && s == &ys[..r - 1])
                    .then(|| dims[..r - 1].iter().map(|&d| Some(d)).collect())
            };
            let map = |t: TensorId| -> Vec<Option<usize>> {
                aligned(g, t, &ys, &dims)
                    .or_else(|| per_token(t))
                    .unwrap_or_else(|| vec![None; shape(g, t).len()])
            };
            Some(finish(Raw {
                inputs: op.inputs.iter().map(|&t| map(t)).collect(),
                outputs: op.outputs.iter().map(|&t| map(t)).collect(),
                dims: b.dims,
            }))
        }
    }
}
