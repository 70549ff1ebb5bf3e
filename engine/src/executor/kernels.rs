//! CPU kernels: the forward and backward computation of every op kind on local tensor shards.
//!
//! Kernels see only their shard. The few that need the rest of their group (a
//! vocabulary-parallel embedding or cross-entropy, ring attention, and the rotary embedding and
//! attention of a sequence split over the group, which need their rank's positions) get it
//! through [`Group`]; everything else is local, the lowering having placed collectives around
//! the kernel.

use super::attention::{self, Keys};
use super::moe;
use super::tensor::{Mat, Tensor, matmul};
use serde::{Deserialize, Serialize};

/// Epsilon of layer and RMS normalisation (Megatron-LM's and LLaMA's default).
pub const NORM_EPS: f32 = 1e-5;
/// Base of the rotary embedding's frequencies (LLaMA's `rope_theta`).
pub const ROPE_THETA: f32 = 10_000.0;

/// What a kernel computes, with the attributes it needs beyond its operand shapes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kernel {
    /// Row gather from a table: inputs `[ids, table]`.
    Embedding {
        /// The table is split by rows over the group: ids outside this rank's rows give zeros.
        vocab_parallel: bool,
    },
    /// `x · w (+ bias)`, `w` stored `[n, k]` when `transpose_b`.
    MatMul {
        /// Weight stored transposed.
        transpose_b: bool,
        /// A third operand is a bias added to every row.
        bias: bool,
    },
    /// `x + bias` over the last axis (the bias of a row-parallel product, added after its
    /// reduction).
    BiasAdd,
    /// Batched product over leading axes; `b`'s leading axes may divide `a`'s (grouped heads).
    BatchMatMul {
        /// `b` stored `[.., n, k]`.
        transpose_b: bool,
    },
    /// Layer normalisation over the last axis: inputs `[x, gain, bias]`.
    LayerNorm,
    /// RMS normalisation over the last axis: inputs `[x, gain]`.
    RmsNorm,
    /// `softmax(scale · x)` over the last axis, causal mask on the last two axes.
    Softmax {
        /// Factor applied before the softmax.
        scale: f32,
    },
    /// GeLU, tanh approximation.
    Gelu,
    /// SiLU.
    Silu,
    /// `silu(x[.., :f]) * x[.., f:]`.
    SwiGlu,
    /// Sum of two tensors.
    Add,
    /// Product of two tensors.
    Mul,
    /// Identity (dropout executed with probability zero, so runs are deterministic).
    Identity,
    /// Rotary embedding of `[.., s, d]` (rotate-half convention), positions along axis `-2`;
    /// when the kernel's group splits the sequence, this rank holds its `rank`-th share.
    Rope {
        /// Context-parallel ranks whose load-balanced order the sequence is stored in
        /// ([`attention::zigzag_position`]; 1: in order).
        zigzag: usize,
    },
    /// Causal scaled dot-product attention of `q [b, h, sq, d]`, `k, v [b, g, sk, d]`; the
    /// output is token-major, `[b, sq, h, d]`, and the rows' log-sum-exp is kept for the
    /// backward.
    Attention {
        /// Factor applied to the scores (`1/sqrt(d)`).
        scale: f32,
        /// As [`Kernel::Rope`]'s.
        zigzag: usize,
        /// Where the keys and values come from (context parallelism).
        keys: Keys,
    },
    /// Mean softmax cross-entropy of logits `[.., V]` against labels.
    CrossEntropy {
        /// The logits are split over the group along the vocabulary (statistics all-reduced).
        vocab_parallel: bool,
        /// Devices the rows are split over: the loss written is this device's share of the
        /// mean over every row (a partial sum), its gradient the same share.
        row_parts: usize,
    },

    /// The last axis cut into parts, each viewed as `[.., n, d]` and moved to axis 1 when its
    /// output has one more axis (`[b, s, n*d]` to `[b, n, s, d]`).
    Slice {
        /// Widths of the parts (whole tensor).
        parts: Vec<usize>,
    },
    /// Swap of two axes.
    Transpose {
        /// First axis.
        a: usize,
        /// Second axis.
        b: usize,
    },
    /// A mixture-of-experts router's top-k of `scores [.., E]`: the gates `[.., k]` (softmax
    /// of the chosen scores) and the chosen experts `[.., k]` ([`moe::route`]).
    MoeRouter,
    /// Tokens `[.., h]` copied into their chosen experts' buffers `[E, C, h]`: inputs
    /// `[tokens, indices, gates]` (the gates choose the tokens kept past the capacity).
    MoeDispatch {
        /// Tokens past an expert's capacity are dropped (otherwise an error).
        drop: bool,
    },
    /// The experts' outputs `[E, C, h]` summed into every token with its gates.
    MoeCombine {
        /// As [`Kernel::MoeDispatch`]'s.
        drop: bool,
    },
}

/// The rest of a kernel's tensor-parallel group, for the kernels that talk to it.
pub trait Group {
    /// This rank and the group size.
    fn rank(&self) -> (usize, usize);
    /// Element-wise sum over the group, in place.
    fn all_reduce_sum(&mut self, data: &mut [f32]) -> Result<(), super::ExecError>;
    /// Element-wise maximum over the group, in place.
    fn all_reduce_max(&mut self, data: &mut [f32]) -> Result<(), super::ExecError>;
    /// One step of a ring: sends `data` to the next rank and returns the previous rank's.
    fn shift(&mut self, data: Vec<f32>) -> Result<Vec<f32>, super::ExecError>;
}

/// Results of a forward kernel: its outputs and what its backward needs besides operands and
/// outputs.
pub struct Forward {
    /// Outputs in order.
    pub outputs: Vec<Tensor>,
    /// Auxiliary values (per-token log-sum-exp of a cross-entropy, ...).
    pub aux: Option<Tensor>,
}

fn rows(t: &Tensor) -> usize {
    t.len() / t.last().max(1)
}

const GELU_C: f32 = 0.797_884_6; // sqrt(2/pi)

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Runs a kernel forward. `out_shapes` are the local shapes of its outputs.
pub fn forward(
    kernel: &Kernel,
    x: &[&Tensor],
    out_shapes: &[Vec<usize>],
    group: &mut dyn Group,
) -> Result<Forward, super::ExecError> {
    let mut aux = None;
    let single = |data: Vec<f32>| {
        vec![Tensor {
            shape: out_shapes[0].clone(),
            data,
        }]
    };
    let outputs = match kernel {
        Kernel::Embedding { vocab_parallel } => {
            let (ids, table) = (x[0], x[1]);
            let h = table.last();
            let mut out = vec![0.0f32; ids.len() * h];
            for (t, r) in table_rows(ids, table, *vocab_parallel, group) {
                out[t * h..(t + 1) * h].copy_from_slice(&table.data[r * h..(r + 1) * h]);
            }
            single(out)
        }
        Kernel::MatMul { transpose_b, bias } => {
            let (a, w) = (x[0], x[1]);
            let (k, n) = weight_dims(w, *transpose_b);
            let m = a.len() / k;
            let mut out = vec![0.0f32; m * n];
            matmul(
                Mat::new(&a.data, m, k),
                weight_mat(w, *transpose_b),
                &mut out,
                false,
            );
            if *bias {
                add_rows(&mut out, &x[2].data);
            }
            single(out)
        }
        Kernel::BiasAdd => {
            let mut out = x[0].data.clone();
            add_rows(&mut out, &x[1].data);
            single(out)
        }
        Kernel::BatchMatMul { transpose_b } => single(batch_matmul(x[0], x[1], *transpose_b)),
        Kernel::LayerNorm | Kernel::RmsNorm => {
            let rms = matches!(kernel, Kernel::RmsNorm);
            let (t, g) = (x[0], x[1]);
            let h = t.last();
            let mut out = vec![0.0f32; t.len()];
            for (r, row) in t.data.chunks(h).enumerate() {
                let (mean, rstd) = norm_stats(row, rms);
                for j in 0..h {
                    let mut y = (row[j] - mean) * rstd * g.data[j];
                    if !rms {
                        y += x[2].data[j];
                    }
                    out[r * h + j] = y;
                }
            }
            single(out)
        }
        Kernel::Softmax { scale } => single(softmax_causal(x[0], *scale)),
        Kernel::Gelu => single(x[0].data.iter().map(|&v| gelu(v).0).collect()),
        Kernel::Silu => single(x[0].data.iter().map(|&v| v * sigmoid(v)).collect()),
        Kernel::SwiGlu => {
            let t = x[0];
            let f = t.last() / 2;
            let mut out = Vec::with_capacity(t.len() / 2);
            for row in t.data.chunks(2 * f) {
                for j in 0..f {
                    let g = row[j];
                    out.push(g * sigmoid(g) * row[f + j]);
                }
            }
            single(out)
        }
        Kernel::Add => single(
            x[0].data
                .iter()
                .zip(&x[1].data)
                .map(|(a, b)| a + b)
                .collect(),
        ),
        Kernel::Mul => single(
            x[0].data
                .iter()
                .zip(&x[1].data)
                .map(|(a, b)| a * b)
                .collect(),
        ),
        Kernel::Identity => single(x[0].data.clone()),
        Kernel::Rope { zigzag } => single(rope(x[0], false, *zigzag, group)),
        Kernel::Attention {
            scale,
            zigzag,
            keys,
        } => {
            let (out, lse) = attention::forward((x[0], x[1], x[2]), *scale, *zigzag, *keys, group)?;
            aux = Some(Tensor {
                shape: vec![lse.len()],
                data: lse,
            });
            single(out)
        }
        Kernel::CrossEntropy {
            vocab_parallel,
            row_parts,
        } => {
            let (logits, labels) = (x[0], x[1]);
            let v = logits.last();
            let n = rows(logits);
            let all_rows = (n * row_parts.max(&1)) as f32;
            let (rank, ranks) = vocab_rank(*vocab_parallel, group);
            let offset = rank * v;
            let mut max: Vec<f32> = logits
                .data
                .chunks(v)
                .map(|r| r.iter().copied().fold(f32::NEG_INFINITY, f32::max))
                .collect();
            if ranks > 1 {
                group.all_reduce_max(&mut max)?;
            }
            let mut sum = vec![0.0f32; n];
            let mut target = vec![0.0f32; n];
            for (t, r) in logits.data.chunks(v).enumerate() {
                sum[t] = r.iter().map(|&z| (z - max[t]).exp()).sum();
                let label = labels.data[t] as usize;
                if label >= offset && label < offset + v {
                    target[t] = r[label - offset];
                }
            }
            if ranks > 1 {
                group.all_reduce_sum(&mut sum)?;
                group.all_reduce_sum(&mut target)?;
            }
            let lse: Vec<f32> = (0..n).map(|t| max[t] + sum[t].ln()).collect();
            let loss: f32 = (0..n).map(|t| lse[t] - target[t]).sum::<f32>() / all_rows;
            aux = Some(Tensor {
                shape: vec![n],
                data: lse,
            });
            single(vec![loss])
        }
        Kernel::Slice { .. } => slice_forward(kernel, x[0], out_shapes),
        Kernel::Transpose { a, b } => single(swap_axes(x[0], *a, *b).data),
        Kernel::MoeRouter => {
            let k = out_shapes[0].last().copied().unwrap_or(1);
            let (gates, idx) = moe::route(x[0], k);
            vec![
                Tensor {
                    shape: out_shapes[0].clone(),
                    data: gates,
                },
                Tensor {
                    shape: out_shapes[1].clone(),
                    data: idx,
                },
            ]
        }
        Kernel::MoeDispatch { drop } => {
            single(moe::dispatch(x[0], x[1], x[2], &out_shapes[0], *drop)?)
        }
        Kernel::MoeCombine { drop } => single(moe::combine(x[0], x[1], x[2], *drop)?),
    };
    Ok(Forward { outputs, aux })
}

/// Runs a kernel backward: gradients of its operands (`None` where none flows) from its
/// operands `x`, outputs `y`, auxiliary values and output gradients `dy`.
///
/// `into[i]`, where given, holds the gradient operand `i` accumulated so far: a matrix product
/// adds its weight and bias gradients straight into it and returns `None` for them (fused
/// gradient accumulation); every other gradient is returned fresh.
pub fn backward(
    kernel: &Kernel,
    x: &[&Tensor],
    y: &[&Tensor],
    aux: Option<&Tensor>,
    dy: &[&Tensor],
    group: &mut dyn Group,
    into: &mut [Option<&mut Tensor>],
) -> Result<Vec<Option<Tensor>>, super::ExecError> {
    let like = |t: &Tensor, data: Vec<f32>| {
        Some(Tensor {
            shape: t.shape.clone(),
            data,
        })
    };
    let d = dy[0];
    Ok(match kernel {
        Kernel::Embedding { vocab_parallel } => {
            let (ids, table) = (x[0], x[1]);
            let h = table.last();
            let mut grad = vec![0.0f32; table.len()];
            for (t, r) in table_rows(ids, table, *vocab_parallel, group) {
                for j in 0..h {
                    grad[r * h + j] += d.data[t * h + j];
                }
            }
            vec![None, like(table, grad)]
        }
        Kernel::MatMul { transpose_b, bias } => {
            let (a, w) = (x[0], x[1]);
            let (k, n) = weight_dims(w, *transpose_b);
            let m = a.len() / k;
            // dx = dy · wᵀ
            let mut dx = vec![0.0f32; a.len()];
            let wt = if *transpose_b {
                Mat::new(&w.data, n, k)
            } else {
                Mat::t(&w.data, k, n)
            };
            matmul(Mat::new(&d.data, m, n), wt, &mut dx, false);
            let mut acc = |i: usize| into.get_mut(i).and_then(Option::take);
            let dw = match acc(1) {
                Some(sum) => {
                    matmul_weight_grad_into(
                        &a.data,
                        &d.data,
                        (m, k, n),
                        *transpose_b,
                        &mut sum.data,
                        true,
                    );
                    None
                }
                None => like(
                    w,
                    matmul_weight_grad(&a.data, &d.data, (m, k, n), *transpose_b),
                ),
            };
            let mut out = vec![like(a, dx), dw];
            if *bias {
                let db = column_sums(&d.data, n);
                out.push(match acc(2) {
                    Some(sum) => {
                        sum.data.iter_mut().zip(&db).for_each(|(s, g)| *s += g);
                        None
                    }
                    None => like(x[2], db),
                });
            }
            out
        }
        Kernel::BiasAdd => vec![
            like(x[0], d.data.clone()),
            like(x[1], column_sums(&d.data, x[1].len())),
        ],
        Kernel::BatchMatMul { transpose_b } => {
            // da = d · bᵀ is the product with b's layout flipped.
            let da = batch_matmul(d, x[1], !*transpose_b);
            let db = batch_matmul_grad_b(x[0], d, &x[1].shape, *transpose_b);
            vec![like(x[0], da), like(x[1], db)]
        }
        Kernel::LayerNorm | Kernel::RmsNorm => {
            let rms = matches!(kernel, Kernel::RmsNorm);
            let (t, g) = (x[0], x[1]);
            let h = t.last();
            let mut dx = vec![0.0f32; t.len()];
            let mut dg = vec![0.0f32; h];
            let mut db = vec![0.0f32; h];
            for (r, row) in t.data.chunks(h).enumerate() {
                let (mean, rstd) = norm_stats(row, rms);
                let dyr = &d.data[r * h..(r + 1) * h];
                // xhat = (x - mean) * rstd; dxhat = dy * g.
                let mut sum_dxhat = 0.0f32;
                let mut sum_dxhat_xhat = 0.0f32;
                for j in 0..h {
                    let xhat = (row[j] - mean) * rstd;
                    let dxhat = dyr[j] * g.data[j];
                    dg[j] += dyr[j] * xhat;
                    db[j] += dyr[j];
                    sum_dxhat += dxhat;
                    sum_dxhat_xhat += dxhat * xhat;
                }
                let hf = h as f32;
                for j in 0..h {
                    let xhat = (row[j] - mean) * rstd;
                    let dxhat = dyr[j] * g.data[j];
                    dx[r * h + j] = if rms {
                        rstd * (dxhat - xhat * sum_dxhat_xhat / hf)
                    } else {
                        rstd * (dxhat - sum_dxhat / hf - xhat * sum_dxhat_xhat / hf)
                    };
                }
            }
            let mut out = vec![like(t, dx), like(g, dg)];
            if !rms {
                out.push(like(x[2], db));
            }
            out
        }
        Kernel::Softmax { scale } => {
            let p = y[0];
            let n = p.last();
            let mut dx = vec![0.0f32; p.len()];
            for (r, (pr, dr)) in p.data.chunks(n).zip(d.data.chunks(n)).enumerate() {
                let dot: f32 = pr.iter().zip(dr).map(|(a, b)| a * b).sum();
                for j in 0..n {
                    dx[r * n + j] = scale * pr[j] * (dr[j] - dot);
                }
            }
            vec![like(x[0], dx)]
        }
        Kernel::Gelu => vec![like(
            x[0],
            x[0].data
                .iter()
                .zip(&d.data)
                .map(|(&v, &g)| g * gelu(v).1)
                .collect(),
        )],
        Kernel::Silu => vec![like(
            x[0],
            x[0].data
                .iter()
                .zip(&d.data)
                .map(|(&v, &g)| {
                    let s = sigmoid(v);
                    g * (s + v * s * (1.0 - s))
                })
                .collect(),
        )],
        Kernel::SwiGlu => {
            let t = x[0];
            let f = t.last() / 2;
            let mut dx = vec![0.0f32; t.len()];
            for (r, row) in t.data.chunks(2 * f).enumerate() {
                for j in 0..f {
                    let (g, u) = (row[j], row[f + j]);
                    let s = sigmoid(g);
                    let dyv = d.data[r * f + j];
                    dx[r * 2 * f + j] = dyv * u * (s + g * s * (1.0 - s));
                    dx[r * 2 * f + f + j] = dyv * g * s;
                }
            }
            vec![like(t, dx)]
        }
        Kernel::Add => vec![like(x[0], d.data.clone()), like(x[1], d.data.clone())],
        Kernel::Mul => vec![
            like(
                x[0],
                d.data.iter().zip(&x[1].data).map(|(g, b)| g * b).collect(),
            ),
            like(
                x[1],
                d.data.iter().zip(&x[0].data).map(|(g, a)| g * a).collect(),
            ),
        ],
        Kernel::Identity => vec![like(x[0], d.data.clone())],
        Kernel::Rope { zigzag } => vec![like(x[0], rope(d, true, *zigzag, group))],
        Kernel::Attention {
            scale,
            zigzag,
            keys,
        } => {
            let lse = aux.map(|a| a.data.as_slice()).unwrap_or(&[]);
            let (dq, dk, dv) = attention::backward(
                (x[0], x[1], x[2]),
                y[0],
                lse,
                d,
                *scale,
                *zigzag,
                *keys,
                group,
            )?;
            vec![like(x[0], dq), like(x[1], dk), like(x[2], dv)]
        }
        Kernel::CrossEntropy {
            vocab_parallel,
            row_parts,
        } => {
            let (logits, labels) = (x[0], x[1]);
            let v = logits.last();
            let n = rows(logits);
            let (rank, _) = vocab_rank(*vocab_parallel, group);
            let offset = rank * v;
            let lse = aux.map(|a| a.data.as_slice()).unwrap_or(&[]);
            let scale = d.data[0] / (n * row_parts.max(&1)) as f32;
            let mut dx = vec![0.0f32; logits.len()];
            for (t, r) in logits.data.chunks(v).enumerate() {
                let l = lse.get(t).copied().unwrap_or(0.0);
                for j in 0..v {
                    dx[t * v + j] = (r[j] - l).exp() * scale;
                }
                let label = labels.data[t] as usize;
                if label >= offset && label < offset + v {
                    dx[t * v + label - offset] -= scale;
                }
            }
            vec![like(logits, dx), None]
        }
        Kernel::Slice { .. } => vec![like(x[0], slice_backward(kernel, x[0], dy))],
        Kernel::Transpose { a, b } => vec![Some(swap_axes(d, *a, *b))],
        Kernel::MoeRouter => {
            let ds = moe::route_backward(y[0], y[1], &d.data, x[0].last());
            vec![like(x[0], ds)]
        }
        Kernel::MoeDispatch { drop } => {
            let dx = moe::dispatch_backward(d, x[1], x[2], *drop)?;
            vec![like(x[0], dx), None, None]
        }
        Kernel::MoeCombine { drop } => {
            let (dy, dg) = moe::combine_backward(x[0], x[1], x[2], d, *drop)?;
            vec![like(x[0], dy), like(x[1], dg), None]
        }
    })
}

/// This rank and the group size for a vocabulary-parallel kernel, (0, 1) for a replicated one.
fn vocab_rank(parallel: bool, group: &dyn Group) -> (usize, usize) {
    if parallel { group.rank() } else { (0, 1) }
}

/// `(token, local row)` of every id of `ids` that falls in this rank's rows of `table` (all of
/// them unless the table is split over the group by rows).
fn table_rows<'a>(
    ids: &'a Tensor,
    table: &Tensor,
    vocab_parallel: bool,
    group: &dyn Group,
) -> impl Iterator<Item = (usize, usize)> + 'a {
    let (rank, _) = vocab_rank(vocab_parallel, group);
    let local_rows = rows(table);
    let offset = rank * local_rows;
    ids.data.iter().enumerate().filter_map(move |(t, &id)| {
        let id = id as usize;
        (id >= offset && id < offset + local_rows).then(|| (t, id - offset))
    })
}

fn weight_dims(w: &Tensor, transpose_b: bool) -> (usize, usize) {
    let (r, c) = (w.shape[0], w.shape[1]);
    if transpose_b { (c, r) } else { (r, c) }
}

fn weight_mat(w: &Tensor, transpose_b: bool) -> Mat<'_> {
    if transpose_b {
        Mat::t(&w.data, w.shape[0], w.shape[1])
    } else {
        Mat::new(&w.data, w.shape[0], w.shape[1])
    }
}

/// Gradient of the weight of an `m x k` by `k x n` product from its input `x` (`m x k`) and
/// output gradient `dy` (`m x n`): `xᵀ · dy`, or `dyᵀ · x` when the weight is stored transposed.
pub fn matmul_weight_grad(
    x: &[f32],
    dy: &[f32],
    dims: (usize, usize, usize),
    transpose_b: bool,
) -> Vec<f32> {
    let mut dw = vec![0.0f32; dims.1 * dims.2];
    matmul_weight_grad_into(x, dy, dims, transpose_b, &mut dw, false);
    dw
}

/// [`matmul_weight_grad`] written into `dw`, or added to it when `accumulate` (the product
/// itself adds, as a fused gradient accumulation does).
fn matmul_weight_grad_into(
    x: &[f32],
    dy: &[f32],
    (m, k, n): (usize, usize, usize),
    transpose_b: bool,
    dw: &mut [f32],
    accumulate: bool,
) {
    if transpose_b {
        matmul(Mat::t(dy, m, n), Mat::new(x, m, k), dw, accumulate);
    } else {
        matmul(Mat::t(x, m, k), Mat::new(dy, m, n), dw, accumulate);
    }
}

fn add_rows(out: &mut [f32], bias: &[f32]) {
    for row in out.chunks_mut(bias.len()) {
        for (o, b) in row.iter_mut().zip(bias) {
            *o += b;
        }
    }
}

pub(super) fn column_sums(data: &[f32], n: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; n];
    for row in data.chunks(n) {
        for (o, v) in out.iter_mut().zip(row) {
            *o += v;
        }
    }
    out
}

fn norm_stats(row: &[f32], rms: bool) -> (f32, f32) {
    let h = row.len() as f32;
    let mean = if rms {
        0.0
    } else {
        row.iter().sum::<f32>() / h
    };
    let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / h;
    (mean, 1.0 / (var + NORM_EPS).sqrt())
}

/// GeLU (tanh form) and its derivative.
fn gelu(x: f32) -> (f32, f32) {
    let u = GELU_C * (x + 0.044_715 * x * x * x);
    let t = u.tanh();
    let du = GELU_C * (1.0 + 3.0 * 0.044_715 * x * x);
    (
        0.5 * x * (1.0 + t),
        0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du,
    )
}

/// Leading-axis bookkeeping of a batched product: for every matrix of `a`, the index of the
/// matrix of `b` it multiplies (`b`'s leading axes divide `a`'s: grouped heads share a key).
/// For every matrix of `a` (shape `a`), the index of the matrix of `b` (shape `b`) it is
/// multiplied with: `b`'s leading axes may divide `a`'s.
pub(super) fn batch_map(a: &[usize], b: &[usize]) -> Vec<usize> {
    let lead_a = &a[..a.len() - 2];
    let lead_b = &b[..b.len() - 2];
    let count: usize = lead_a.iter().product();
    let mut out = Vec::with_capacity(count);
    for i in 0..count {
        let mut rest = i;
        let mut idx_b = 0;
        let mut stride_b = 1;
        for ax in (0..lead_a.len()).rev() {
            let ia = rest % lead_a[ax];
            rest /= lead_a[ax];
            let group = lead_a[ax] / lead_b[ax].max(1);
            idx_b += (ia / group.max(1)) * stride_b;
            stride_b *= lead_b[ax];
        }
        out.push(idx_b);
    }
    out
}

fn batch_matmul(a: &Tensor, b: &Tensor, transpose_b: bool) -> Vec<f32> {
    let ra = a.shape.len();
    let (m, k) = (a.shape[ra - 2], a.shape[ra - 1]);
    let rb = b.shape.len();
    let n = if transpose_b {
        b.shape[rb - 2]
    } else {
        b.shape[rb - 1]
    };
    let map = batch_map(&a.shape, &b.shape);
    let mut out = vec![0.0f32; map.len() * m * n];
    for (i, &j) in map.iter().enumerate() {
        let am = Mat::new(&a.data[i * m * k..(i + 1) * m * k], m, k);
        let bs = &b.data[j * k * n..(j + 1) * k * n];
        let bm = if transpose_b {
            Mat::t(bs, n, k)
        } else {
            Mat::new(bs, k, n)
        };
        matmul(am, bm, &mut out[i * m * n..(i + 1) * m * n], false);
    }
    out
}

/// Gradient of a batched product's `b` (shaped `b_shape`) from `a` and the output gradient
/// `d`: `aᵀ · d`, or `dᵀ · a` when `b` is stored transposed, summed over the heads that share
/// one `b` (grouped-query attention).
pub fn batch_matmul_grad_b(
    a: &Tensor,
    d: &Tensor,
    b_shape: &[usize],
    transpose_b: bool,
) -> Vec<f32> {
    let ra = a.shape.len();
    let (m, k) = (a.shape[ra - 2], a.shape[ra - 1]);
    let n = d.last();
    let mut db = vec![0.0f32; b_shape.iter().product()];
    for (i, &j) in batch_map(&a.shape, b_shape).iter().enumerate() {
        let dm = &d.data[i * m * n..(i + 1) * m * n];
        let am = &a.data[i * m * k..(i + 1) * m * k];
        let dbs = &mut db[j * k * n..(j + 1) * k * n];
        if transpose_b {
            matmul(Mat::t(dm, m, n), Mat::new(am, m, k), dbs, true);
        } else {
            matmul(Mat::t(am, m, k), Mat::new(dm, m, n), dbs, true);
        }
    }
    db
}

fn softmax_causal(x: &Tensor, scale: f32) -> Vec<f32> {
    let r = x.shape.len();
    let (rows_per, n) = (x.shape[r - 2], x.shape[r - 1]);
    let mut out = vec![0.0f32; x.len()];
    for (row, (src, dst)) in x.data.chunks(n).zip(out.chunks_mut(n)).enumerate() {
        let i = row % rows_per;
        let live = (i + 1).min(n);
        let max = src[..live]
            .iter()
            .fold(f32::NEG_INFINITY, |a, &b| a.max(b * scale));
        let mut sum = 0.0f32;
        for j in 0..live {
            dst[j] = (src[j] * scale - max).exp();
            sum += dst[j];
        }
        for v in &mut dst[..live] {
            *v /= sum;
        }
    }
    out
}

/// Rotary embedding (rotate-half) of `[.., s, d]`; `inverse` rotates back (its backward). The
/// rows are this rank's share of its group's sequence, stored in the order of `zigzag`
/// context-parallel ranks.
fn rope(x: &Tensor, inverse: bool, zigzag: usize, group: &dyn Group) -> Vec<f32> {
    let r = x.shape.len();
    let (s, d) = (x.shape[r - 2], x.shape[r - 1]);
    let (rank, ranks) = group.rank();
    let half = d / 2;
    let mut out = x.data.clone();
    for (row, (src, dst)) in x.data.chunks(d).zip(out.chunks_mut(d)).enumerate() {
        let pos = attention::zigzag_position(rank * s + row % s, s * ranks, zigzag) as f32;
        for i in 0..half {
            let freq = ROPE_THETA.powf(-2.0 * i as f32 / d as f32);
            let (sin, cos) = (pos * freq).sin_cos();
            let sin = if inverse { -sin } else { sin };
            let (a, b) = (src[i], src[i + half]);
            dst[i] = a * cos - b * sin;
            dst[i + half] = b * cos + a * sin;
        }
    }
    out
}

/// Local widths of the parts of a slice's input (its local last axis divided like the whole).
fn local_parts(kernel: &Kernel, input: &Tensor) -> Vec<usize> {
    let Kernel::Slice { parts } = kernel else {
        return vec![];
    };
    let whole: usize = parts.iter().sum();
    let local = input.last();
    parts.iter().map(|p| p * local / whole.max(1)).collect()
}

fn slice_forward(kernel: &Kernel, x: &Tensor, out_shapes: &[Vec<usize>]) -> Vec<Tensor> {
    let parts = local_parts(kernel, x);
    let w = x.last();
    let rows = rows(x);
    let mut offset = 0;
    let mut outs = Vec::with_capacity(parts.len());
    for (p, shape) in parts.iter().zip(out_shapes) {
        let mut data = Vec::with_capacity(rows * p);
        for r in 0..rows {
            data.extend_from_slice(&x.data[r * w + offset..r * w + offset + p]);
        }
        let mut t = Tensor {
            shape: x.shape.clone(),
            data,
        };
        if let Some(last) = t.shape.last_mut() {
            *last = *p;
        }
        if shape.len() == x.shape.len() + 1 {
            // [b, s, n*d] -> [b, s, n, d] -> [b, n, s, d].
            let (n, d) = (shape[1], shape[shape.len() - 1]);
            let r = t.shape.len();
            t.shape.pop();
            t.shape.push(n);
            t.shape.push(d);
            t = swap_axes(&t, 1, r - 1);
        }
        outs.push(t);
        offset += p;
    }
    outs
}

fn slice_backward(kernel: &Kernel, x: &Tensor, dy: &[&Tensor]) -> Vec<f32> {
    let parts = local_parts(kernel, x);
    let w = x.last();
    let rows = rows(x);
    let mut dx = vec![0.0f32; x.len()];
    let mut offset = 0;
    for (p, g) in parts.iter().zip(dy) {
        let flat = if g.shape.len() == x.shape.len() + 1 {
            let r = g.shape.len();
            swap_axes(g, 1, r - 2)
        } else {
            (*g).clone()
        };
        for r in 0..rows {
            dx[r * w + offset..r * w + offset + p].copy_from_slice(&flat.data[r * p..(r + 1) * p]);
        }
        offset += p;
    }
    dx
}

/// A copy of `x` with axes `a` and `b` exchanged.
pub fn swap_axes(x: &Tensor, a: usize, b: usize) -> Tensor {
    let (a, b) = (a.min(b), a.max(b));
    let mut shape = x.shape.clone();
    shape.swap(a, b);
    if a == b {
        return x.clone();
    }
    let outer: usize = x.shape[..a].iter().product();
    let (na, nb) = (x.shape[a], x.shape[b]);
    let mid: usize = x.shape[a + 1..b].iter().product();
    let inner: usize = x.shape[b + 1..].iter().product();
    let mut data = vec![0.0f32; x.len()];
    for o in 0..outer {
        for i in 0..na {
            for m in 0..mid {
                for j in 0..nb {
                    let src = (((o * na + i) * mid + m) * nb + j) * inner;
                    let dst = (((o * nb + j) * mid + m) * na + i) * inner;
                    data[dst..dst + inner].copy_from_slice(&x.data[src..src + inner]);
                }
            }
        }
    }
    Tensor { shape, data }
}
