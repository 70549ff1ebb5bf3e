//! Measuring kernels and collectives on the CPU backend, for `autopar profile run`.
//!
//! A profile names a kernel by its op signature: the graph op's kind, pass, dtype and
//! per-device shapes. Each signature is read as the computation the CPU executor runs for that
//! graph op: a forward op is its kernel's forward; a backward op is the part of its kernel's
//! backward the graph names (a product's input gradient is the product with the weight's layout
//! flipped, its weight gradient `xᵀ · dy`; a norm's backward gives the input and gain gradients
//! together). The same kernel functions the executor calls are timed, so a measured profile
//! prices what `autopar run` executes. Every dtype is computed in f32.
//!
//! Operands are filled with deterministic noise (token ids and labels below their bound). A
//! timing is the median of the runs after one warm-up: at least [`MIN_RUNS`] runs and at least
//! [`MIN_TIME`] of them, at most [`MAX_RUNS`]. Collectives run between threads through the
//! executor's [`Fabric`], every rank starting each run together.

use super::attention::Keys;
use super::comm::{Endpoint, Fabric};
use super::cpu::{id_below, noise};
use super::kernels::{Group, Kernel, backward, batch_matmul_grad_b, forward, matmul_weight_grad};
use super::placement::slice;
use super::tensor::Tensor;
use super::{ExecError, median};
use autopar_rules::cost::profile::{CollectiveName, OpSignature};
use autopar_rules::model::graph::Pass;
use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// Fewest timed runs of a measurement.
pub const MIN_RUNS: usize = 5;
/// Most timed runs of a measurement.
pub const MAX_RUNS: usize = 200;
/// Timed runs continue until they add up to at least this.
pub const MIN_TIME: Duration = Duration::from_millis(50);
/// Largest number of f32 elements the operands and results of one kernel may hold (4 GiB).
pub const MAX_ELEMENTS: usize = 1 << 30;

/// A measured time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timing {
    /// Median of the timed runs, seconds.
    pub seconds: f64,
    /// Timed runs.
    pub runs: usize,
}

/// The attention core as one device runs it.
const WHOLE_ATTENTION: Kernel = Kernel::Attention {
    scale: 1.0,
    zigzag: 1,
    keys: Keys::Whole,
};

/// The whole tensor-parallel group of a kernel measured on its own: this rank alone.
struct Alone;

impl Group for Alone {
    fn rank(&self) -> (usize, usize) {
        (0, 1)
    }
    fn all_reduce_sum(&mut self, _: &mut [f32]) -> Result<(), ExecError> {
        Ok(())
    }
    fn all_reduce_max(&mut self, _: &mut [f32]) -> Result<(), ExecError> {
        Ok(())
    }
    fn shift(&mut self, data: Vec<f32>) -> Result<Vec<f32>, ExecError> {
        Ok(data)
    }
}

/// What one run of a measured kernel computes.
enum Work {
    /// A kernel's forward.
    Forward {
        kernel: Kernel,
        x: Vec<Tensor>,
        out_shapes: Vec<Vec<usize>>,
    },
    /// A kernel's backward.
    Backward {
        kernel: Kernel,
        x: Vec<Tensor>,
        y: Vec<Tensor>,
        aux: Option<Tensor>,
        dy: Vec<Tensor>,
    },
    /// The weight (and bias) gradient of a product.
    WeightGrad {
        x: Tensor,
        dy: Tensor,
        mkn: (usize, usize, usize),
        transpose_b: bool,
        bias: bool,
    },
    /// The gradient of a batched product's second operand.
    BatchGradB {
        a: Tensor,
        d: Tensor,
        b_shape: Vec<usize>,
        transpose_b: bool,
    },
}

/// A kernel ready to be timed: the computation a signature names, on operands of its shapes.
pub struct OpBench {
    work: Work,
}

fn no_kernel(sig: &OpSignature, why: impl std::fmt::Display) -> ExecError {
    ExecError::NoKernel(format!("{sig}: {why}"))
}

/// Deterministic operand values: noise, or integers below `bound`.
fn filled(shape: &[usize], tag: u64, bound: Option<usize>) -> Tensor {
    let n: usize = shape.iter().product();
    let data = (0..n)
        .map(|i| {
            let u = noise(&[tag, i as u64]);
            bound.map_or(u, |b| id_below(u, b))
        })
        .collect();
    Tensor {
        shape: shape.to_vec(),
        data,
    }
}

/// `Ok` when `sig` has `n_in` operands and `n_out` results.
fn check_arity(
    sig: &OpSignature,
    ins: &[Vec<usize>],
    outs: &[Vec<usize>],
    n_in: usize,
    n_out: usize,
) -> Result<(), ExecError> {
    if ins.len() == n_in && outs.len() == n_out {
        Ok(())
    } else {
        Err(no_kernel(
            sig,
            format!(
                "expected {n_in} operands and {n_out} results, found {} and {}",
                ins.len(),
                outs.len()
            ),
        ))
    }
}

fn numel(s: &[usize]) -> usize {
    s.iter().product()
}

/// `(m, k, n)` of `x · w` with `w` of shape `w` (`[n, k]` when `transpose_b`), if `x` holds
/// whole rows of `k`.
fn product_dims(x: &[usize], w: &[usize], transpose_b: bool) -> Option<(usize, usize, usize)> {
    let [a, b] = *w else { return None };
    let (k, n) = if transpose_b { (b, a) } else { (a, b) };
    (k > 0 && numel(x) % k == 0).then(|| (numel(x) / k, k, n))
}

/// `(lead, m, k, n)` of the batched product `a · b`, if the shapes fit.
fn batch_dims(a: &[usize], b: &[usize], transpose_b: bool) -> Option<(Vec<usize>, usize, usize)> {
    if a.len() < 2 || a.len() != b.len() {
        return None;
    }
    let r = a.len();
    let (bk, bn) = if transpose_b {
        (b[r - 1], b[r - 2])
    } else {
        (b[r - 2], b[r - 1])
    };
    let leads_divide = a[..r - 2]
        .iter()
        .zip(&b[..r - 2])
        .all(|(&x, &y)| y > 0 && x % y == 0);
    (leads_divide && bk == a[r - 1]).then(|| (a[..r - 2].to_vec(), a[r - 2], bn))
}

/// The two axes whose exchange turns `from` into `to`.
fn swapped_axes(from: &[usize], to: &[usize]) -> Option<(usize, usize)> {
    if from.len() != to.len() || numel(from) != numel(to) {
        return None;
    }
    let differ: Vec<usize> = (0..from.len()).filter(|&i| from[i] != to[i]).collect();
    match differ[..] {
        [a, b] if from[a] == to[b] && from[b] == to[a] => Some((a, b)),
        // Equal extents: which axes move does not change the work.
        [] if from.len() >= 2 => Some((from.len() - 2, from.len() - 1)),
        _ => None,
    }
}

/// Widths of a slice's parts along its input's last axis, from the part shapes.
fn slice_parts(x: &[usize], parts: &[Vec<usize>]) -> Option<Vec<usize>> {
    let widths: Vec<usize> = parts
        .iter()
        .map(|p| {
            if p.len() == x.len() + 1 && p.len() >= 3 {
                // [b, n, s, d] viewed from [b, s, n*d].
                p[1] * p[p.len() - 1]
            } else {
                p.last().copied().unwrap_or(0)
            }
        })
        .collect();
    let rows = numel(x) / x.last().copied().unwrap_or(1).max(1);
    let fits = x.last() == Some(&widths.iter().sum())
        && parts.iter().zip(&widths).all(|(p, w)| numel(p) == rows * w);
    fits.then_some(widths)
}

impl OpBench {
    /// The kernel `sig` names, with operands of its shapes, or why the CPU backend has none.
    pub fn new(sig: &OpSignature) -> Result<OpBench, ExecError> {
        let to_usize = |s: &Vec<u64>| -> Result<Vec<usize>, ExecError> {
            s.iter()
                .map(|&d| usize::try_from(d).map_err(|_| no_kernel(sig, "extent too large")))
                .collect()
        };
        let ins = sig
            .inputs
            .iter()
            .map(to_usize)
            .collect::<Result<Vec<_>, _>>()?;
        let outs = sig
            .outputs
            .iter()
            .map(to_usize)
            .collect::<Result<Vec<_>, _>>()?;
        let elements = ins
            .iter()
            .chain(&outs)
            .try_fold(0usize, |acc, s| {
                s.iter()
                    .try_fold(1usize, |p, &d| p.checked_mul(d))
                    .and_then(|n| acc.checked_add(n))
            })
            .unwrap_or(usize::MAX);
        if elements > MAX_ELEMENTS {
            return Err(ExecError::TooLarge(format!(
                "{sig}: {elements} elements, more than the {MAX_ELEMENTS} a CPU measurement holds"
            )));
        }
        let work = match sig.pass {
            Pass::Forward => Self::forward_work(sig, &ins, &outs)?,
            Pass::Backward => Self::backward_work(sig, &ins, &outs)?,
        };
        Ok(OpBench { work })
    }

    fn forward_work(
        sig: &OpSignature,
        ins: &[Vec<usize>],
        outs: &[Vec<usize>],
    ) -> Result<Work, ExecError> {
        let bad = |why: &str| no_kernel(sig, why);
        let noisy = |i: usize| filled(&ins[i], i as u64, None);
        let arity = |n_in: usize, n_out: usize| check_arity(sig, ins, outs, n_in, n_out);
        let same_shape = |a: &[usize], b: &[usize]| {
            if a == b {
                Ok(())
            } else {
                Err(bad("operand and result shapes differ"))
            }
        };
        let kernel = match sig.op.as_str() {
            "embedding" => {
                arity(2, 1)?;
                let rows = ins[1].first().copied().unwrap_or(0);
                if ins[1].len() != 2 || rows == 0 || numel(&outs[0]) != numel(&ins[0]) * ins[1][1] {
                    return Err(bad("expected ids, a [rows, h] table and [ids.., h]"));
                }
                return Ok(Work::Forward {
                    kernel: Kernel::Embedding {
                        vocab_parallel: false,
                    },
                    x: vec![filled(&ins[0], 0, Some(rows)), noisy(1)],
                    out_shapes: outs.to_vec(),
                });
            }
            "matmul" | "matmul_tb" => {
                let transpose_b = sig.op == "matmul_tb";
                let bias = ins.len() == 3;
                arity(if bias { 3 } else { 2 }, 1)?;
                let (m, _, n) = product_dims(&ins[0], &ins[1], transpose_b)
                    .ok_or_else(|| bad("operand shapes do not multiply"))?;
                if numel(&outs[0]) != m * n || (bias && numel(&ins[2]) != n) {
                    return Err(bad("result or bias shape does not match the product"));
                }
                Kernel::MatMul { transpose_b, bias }
            }
            "batch_matmul" | "batch_matmul_tb" => {
                arity(2, 1)?;
                let transpose_b = sig.op == "batch_matmul_tb";
                let (lead, m, n) = batch_dims(&ins[0], &ins[1], transpose_b)
                    .ok_or_else(|| bad("operand shapes do not multiply"))?;
                if numel(&outs[0]) != numel(&lead) * m * n {
                    return Err(bad("result shape does not match the product"));
                }
                Kernel::BatchMatMul { transpose_b }
            }
            "layernorm" | "rmsnorm" => {
                let rms = sig.op == "rmsnorm";
                arity(if rms { 2 } else { 3 }, 1)?;
                let h = ins[0].last().copied().unwrap_or(0);
                if ins[1..].iter().any(|p| numel(p) != h) {
                    return Err(bad("gain or bias does not match the last axis"));
                }
                same_shape(&ins[0], &outs[0])?;
                if rms {
                    Kernel::RmsNorm
                } else {
                    Kernel::LayerNorm
                }
            }
            "softmax" => {
                arity(1, 1)?;
                same_shape(&ins[0], &outs[0])?;
                if ins[0].len() < 2 {
                    return Err(bad("expected scores with at least two axes"));
                }
                Kernel::Softmax { scale: 1.0 }
            }
            "gelu" | "silu" | "dropout" | "rope" => {
                arity(1, 1)?;
                same_shape(&ins[0], &outs[0])?;
                match sig.op.as_str() {
                    "gelu" => Kernel::Gelu,
                    "silu" => Kernel::Silu,
                    // Executed with probability zero: a copy.
                    "dropout" => Kernel::Identity,
                    _ if ins[0].len() >= 2 && ins[0][ins[0].len() - 1] % 2 == 0 => {
                        Kernel::Rope { zigzag: 1 }
                    }
                    _ => return Err(bad("expected [.., s, d] with d even")),
                }
            }
            "swiglu" => {
                arity(1, 1)?;
                let f = outs[0].last().copied().unwrap_or(0);
                if ins[0].last() != Some(&(2 * f)) || numel(&ins[0]) != 2 * numel(&outs[0]) {
                    return Err(bad("expected [.., 2f] -> [.., f]"));
                }
                Kernel::SwiGlu
            }
            "add" | "mul" | "dropout_add" => {
                arity(2, 1)?;
                same_shape(&ins[0], &ins[1])?;
                same_shape(&ins[0], &outs[0])?;
                if sig.op == "mul" {
                    Kernel::Mul
                } else {
                    Kernel::Add
                }
            }
            "transpose" => {
                arity(1, 1)?;
                let (a, b) = swapped_axes(&ins[0], &outs[0])
                    .ok_or_else(|| bad("the result is not the operand with two axes swapped"))?;
                Kernel::Transpose { a, b }
            }
            "flash_attention_causal" => {
                arity(3, 1)?;
                attention_shapes(&ins[0], &ins[1], &ins[2]).ok_or_else(|| {
                    bad("expected q [b, h, s, d] and k, v [b, g, s, d] with g dividing h")
                })?;
                if numel(&outs[0]) != numel(&ins[0]) {
                    return Err(bad("result shape does not match q"));
                }
                WHOLE_ATTENTION
            }
            "cross_entropy" => {
                arity(2, 1)?;
                let v = ce_vocab(&ins[0], &ins[1]).ok_or_else(|| {
                    bad("expected logits [.., V] and one label per row of logits")
                })?;
                return Ok(Work::Forward {
                    kernel: Kernel::CrossEntropy {
                        vocab_parallel: false,
                        row_parts: 1,
                    },
                    x: vec![noisy(0), filled(&ins[1], 1, Some(v))],
                    out_shapes: outs.to_vec(),
                });
            }
            "slice" => {
                arity(1, outs.len().max(1))?;
                let parts = slice_parts(&ins[0], outs)
                    .ok_or_else(|| bad("the parts do not tile the operand"))?;
                Kernel::Slice { parts }
            }
            other => return Err(bad(&format!("no CPU kernel computes `{other}` forward"))),
        };
        Ok(Work::Forward {
            kernel,
            x: (0..ins.len()).map(noisy).collect(),
            out_shapes: outs.to_vec(),
        })
    }

    fn backward_work(
        sig: &OpSignature,
        ins: &[Vec<usize>],
        outs: &[Vec<usize>],
    ) -> Result<Work, ExecError> {
        let bad = |why: &str| no_kernel(sig, why);
        let noisy = |i: usize| filled(&ins[i], i as u64, None);
        let zeros = |s: &[usize]| Tensor::zeros(s.to_vec());
        let arity = |n_in: usize, n_out: usize| check_arity(sig, ins, outs, n_in, n_out);
        let bwd =
            |kernel: Kernel, x: Vec<Tensor>, y: Vec<Tensor>, dy: Vec<Tensor>| Work::Backward {
                kernel,
                x,
                y,
                aux: None,
                dy,
            };
        let work = match sig.op.as_str() {
            "matmul" | "matmul_tb" => {
                let transpose_b = sig.op == "matmul_tb";
                // The input gradient: `dy · w` read with the weight's layout flipped, which the
                // graph names as this product.
                let as_product = ins.len() == 2
                    && outs.len() == 1
                    && product_dims(&ins[0], &ins[1], transpose_b)
                        .is_some_and(|(m, _, n)| numel(&outs[0]) == m * n);
                // The weight gradient: `[x, dy] -> [w (, bias)]`.
                let weight = (ins.len() == 2 && (1..=2).contains(&outs.len()))
                    .then(|| {
                        let [r, c] = outs[0][..] else { return None };
                        let (k, n) = if transpose_b { (c, r) } else { (r, c) };
                        let m = numel(&ins[0]) / k.max(1);
                        let fits = k > 0
                            && n > 0
                            && m * k == numel(&ins[0])
                            && m * n == numel(&ins[1])
                            && outs.get(1).is_none_or(|b| numel(b) == n);
                        fits.then_some((m, k, n))
                    })
                    .flatten();
                match (as_product, weight) {
                    (_, Some(mkn)) if !as_product || outs.len() == 2 => Work::WeightGrad {
                        x: noisy(0),
                        dy: noisy(1),
                        mkn,
                        transpose_b,
                        bias: outs.len() == 2,
                    },
                    (true, _) => Work::Forward {
                        kernel: Kernel::MatMul {
                            transpose_b,
                            bias: false,
                        },
                        x: vec![noisy(0), noisy(1)],
                        out_shapes: outs.to_vec(),
                    },
                    _ => return Err(bad("neither an input nor a weight gradient of a product")),
                }
            }
            "batch_matmul" | "batch_matmul_tb" => {
                arity(2, 1)?;
                let transpose_b = sig.op == "batch_matmul_tb";
                let as_product = batch_dims(&ins[0], &ins[1], transpose_b)
                    .is_some_and(|(lead, m, n)| numel(&outs[0]) == numel(&lead) * m * n);
                if as_product {
                    Work::Forward {
                        kernel: Kernel::BatchMatMul { transpose_b },
                        x: vec![noisy(0), noisy(1)],
                        out_shapes: outs.to_vec(),
                    }
                } else {
                    // The second operand's gradient, `[a, dy] -> db`, stored `[.., k, n]` or
                    // `[.., n, k]`.
                    let (a, d, b) = (&ins[0], &ins[1], &outs[0]);
                    let r = a.len();
                    let fits = r >= 2
                        && d.len() == r
                        && b.len() == r
                        && a[..r - 1] == d[..r - 1]
                        && a[..r - 2]
                            .iter()
                            .zip(&b[..r - 2])
                            .all(|(&x, &y)| y > 0 && x % y == 0);
                    let (k, n) = (a.get(r.wrapping_sub(1)), d.get(r.wrapping_sub(1)));
                    let stored = |kn: bool| match (k, n) {
                        (Some(&k), Some(&n)) if fits => {
                            let want = if kn { [k, n] } else { [n, k] };
                            b[r - 2..] == want
                        }
                        _ => false,
                    };
                    let transposed = if stored(true) {
                        false
                    } else if stored(false) {
                        true
                    } else {
                        return Err(bad("neither operand's gradient of a batched product"));
                    };
                    Work::BatchGradB {
                        a: noisy(0),
                        d: noisy(1),
                        b_shape: b.clone(),
                        transpose_b: transposed,
                    }
                }
            }
            "embedding_grad" => {
                arity(2, 1)?;
                let [rows, h] = outs[0][..] else {
                    return Err(bad("expected a [rows, h] table gradient"));
                };
                if rows == 0 || numel(&ins[1]) != numel(&ins[0]) * h {
                    return Err(bad("expected ids and [ids.., h] gradients"));
                }
                bwd(
                    Kernel::Embedding {
                        vocab_parallel: false,
                    },
                    vec![filled(&ins[0], 0, Some(rows)), zeros(&outs[0])],
                    vec![],
                    vec![noisy(1)],
                )
            }
            "layernorm" | "rmsnorm" => {
                // [x, dy, gain (, bias)] -> [dx, dgain (, dbias)].
                let rms = sig.op == "rmsnorm";
                let n = if rms { 3 } else { 4 };
                if ins.len() != n || outs.is_empty() {
                    return Err(bad(&format!("expected {n} operands")));
                }
                let h = ins[0].last().copied().unwrap_or(0);
                if ins[1] != ins[0] || ins[2..].iter().any(|p| numel(p) != h) {
                    return Err(bad("gain or gradient does not match the input"));
                }
                let mut x = vec![noisy(0), noisy(2)];
                if !rms {
                    x.push(noisy(3));
                }
                bwd(
                    if rms {
                        Kernel::RmsNorm
                    } else {
                        Kernel::LayerNorm
                    },
                    x,
                    vec![],
                    vec![noisy(1)],
                )
            }
            "softmax" => {
                // [dy, probabilities] -> dx.
                arity(2, 1)?;
                if ins[0] != ins[1] || ins[0] != outs[0] || ins[0].len() < 2 {
                    return Err(bad(
                        "expected gradient, probabilities and result of one shape",
                    ));
                }
                bwd(
                    Kernel::Softmax { scale: 1.0 },
                    vec![zeros(&outs[0])],
                    vec![noisy(1)],
                    vec![noisy(0)],
                )
            }
            "gelu" | "silu" | "swiglu" => {
                // [dy, x] -> dx.
                arity(2, 1)?;
                let fits = if sig.op == "swiglu" {
                    ins[1] == outs[0] && numel(&ins[1]) == 2 * numel(&ins[0])
                } else {
                    ins[0] == ins[1] && ins[1] == outs[0]
                };
                if !fits {
                    return Err(bad("gradient, input and result shapes do not match"));
                }
                let kernel = match sig.op.as_str() {
                    "gelu" => Kernel::Gelu,
                    "silu" => Kernel::Silu,
                    _ => Kernel::SwiGlu,
                };
                bwd(kernel, vec![noisy(1)], vec![], vec![noisy(0)])
            }
            "rope" | "dropout" => {
                // [dy (, mask)] -> dx.
                if ins.is_empty() || ins.len() > 2 || outs.len() != 1 || ins[0] != outs[0] {
                    return Err(bad("expected the gradient and a result of its shape"));
                }
                let kernel = if sig.op == "dropout" {
                    Kernel::Identity
                } else if ins[0].len() >= 2 && outs[0][outs[0].len() - 1] % 2 == 0 {
                    Kernel::Rope { zigzag: 1 }
                } else {
                    return Err(bad("expected [.., s, d] with d even"));
                };
                bwd(kernel, vec![zeros(&outs[0])], vec![], vec![noisy(0)])
            }
            "transpose" => {
                arity(1, 1)?;
                let (a, b) = swapped_axes(&ins[0], &outs[0])
                    .ok_or_else(|| bad("the result is not the gradient with two axes swapped"))?;
                bwd(
                    Kernel::Transpose { a, b },
                    vec![zeros(&outs[0])],
                    vec![],
                    vec![noisy(0)],
                )
            }
            "add" => {
                // The sum of two gradient contributions.
                arity(2, 1)?;
                if ins[0] != ins[1] || ins[0] != outs[0] {
                    return Err(bad("operand and result shapes differ"));
                }
                Work::Forward {
                    kernel: Kernel::Add,
                    x: vec![noisy(0), noisy(1)],
                    out_shapes: outs.to_vec(),
                }
            }
            "mul" => {
                // [a, b, dy] -> [da, db] (or one of them).
                if ins.len() != 3 || outs.is_empty() || outs.len() > 2 {
                    return Err(bad("expected [a, b, dy] and one or two gradients"));
                }
                if ins[0] != ins[1] || ins[1] != ins[2] || outs.iter().any(|o| *o != ins[0]) {
                    return Err(bad("operand and result shapes differ"));
                }
                bwd(
                    Kernel::Mul,
                    vec![noisy(0), noisy(1)],
                    vec![],
                    vec![noisy(2)],
                )
            }
            "flash_attention_causal" => {
                // [q, k, v, out, dout] -> [dq, dk, dv].
                arity(5, 3)?;
                attention_shapes(&ins[0], &ins[1], &ins[2])
                    .filter(|_| numel(&ins[4]) == numel(&ins[0]))
                    .ok_or_else(|| {
                        bad("expected q [b, h, s, d], k, v [b, g, s, d] and dout like q")
                    })?;
                // The backward reads the forward's output and log-sum-exp.
                let x = vec![noisy(0), noisy(1), noisy(2)];
                let refs: Vec<&Tensor> = x.iter().collect();
                let f = forward(&WHOLE_ATTENTION, &refs, &[ins[0].clone()], &mut Alone)?;
                Work::Backward {
                    kernel: WHOLE_ATTENTION,
                    x,
                    y: f.outputs,
                    aux: f.aux,
                    dy: vec![noisy(4)],
                }
            }
            "cross_entropy" => {
                // [logits, labels] -> dlogits, with the forward's log-sum-exp.
                arity(2, 1)?;
                let v = ce_vocab(&ins[0], &ins[1])
                    .filter(|_| ins[0] == outs[0])
                    .ok_or_else(|| bad("expected logits [.., V], labels and dlogits"))?;
                let kernel = Kernel::CrossEntropy {
                    vocab_parallel: false,
                    row_parts: 1,
                };
                let x = vec![noisy(0), filled(&ins[1], 1, Some(v))];
                let refs: Vec<&Tensor> = x.iter().collect();
                let f = forward(&kernel, &refs, &[vec![1]], &mut Alone)?;
                Work::Backward {
                    kernel,
                    x,
                    y: f.outputs,
                    aux: f.aux,
                    dy: vec![Tensor {
                        shape: vec![1],
                        data: vec![1.0],
                    }],
                }
            }
            "slice" => {
                // The parts' gradients assembled into the input's.
                if outs.len() != 1 || ins.is_empty() {
                    return Err(bad("expected the parts' gradients and one result"));
                }
                let parts = slice_parts(&outs[0], ins)
                    .ok_or_else(|| bad("the parts do not tile the result"))?;
                bwd(
                    Kernel::Slice { parts },
                    vec![zeros(&outs[0])],
                    vec![],
                    (0..ins.len()).map(noisy).collect(),
                )
            }
            other => return Err(bad(&format!("no CPU kernel computes `{other}` backward"))),
        };
        Ok(work)
    }

    /// The same work for the JAX profiler (`profile run --backend jax`), as JSON: `work`
    /// (`forward`, `backward`, `weight_grad`, `batch_grad_b`), the kernel as the lowering names
    /// it, and its operands' shapes (integer ids with their bound).
    pub fn jax_work(&self) -> serde_json::Value {
        use serde_json::json;
        let specs = |kernel: &Kernel, x: &[Tensor]| -> Vec<serde_json::Value> {
            let bound = |i: usize| match (kernel, i) {
                (Kernel::Embedding { .. }, 0) => x.get(1).and_then(|t| t.shape.first().copied()),
                (Kernel::CrossEntropy { .. }, 1) => x.first().map(Tensor::last),
                _ => None,
            };
            x.iter()
                .enumerate()
                .map(|(i, t)| json!({"shape": t.shape, "bound": bound(i)}))
                .collect()
        };
        match &self.work {
            Work::Forward {
                kernel,
                x,
                out_shapes,
            } => json!({
                "work": "forward",
                "kernel": kernel,
                "inputs": specs(kernel, x),
                "out_shapes": out_shapes,
            }),
            Work::Backward { kernel, x, dy, .. } => json!({
                "work": "backward",
                "kernel": kernel,
                "inputs": specs(kernel, x),
                "out_shapes": dy.iter().map(|t| t.shape.clone()).collect::<Vec<_>>(),
            }),
            Work::WeightGrad { mkn, bias, .. } => json!({
                "work": "weight_grad",
                "mkn": [mkn.0, mkn.1, mkn.2],
                "bias": bias,
            }),
            Work::BatchGradB {
                a,
                d,
                b_shape,
                transpose_b,
            } => json!({
                "work": "batch_grad_b",
                "a": a.shape,
                "d": d.shape,
                "b_shape": b_shape,
                "transpose_b": transpose_b,
            }),
        }
    }

    /// Floating-point operations of a matrix product (`None` for other kernels).
    pub fn product_flops(&self) -> Option<f64> {
        let flops = match &self.work {
            Work::Forward {
                kernel: Kernel::MatMul { transpose_b, .. },
                x,
                ..
            } => {
                let (m, k, n) = product_dims(&x[0].shape, &x[1].shape, *transpose_b)?;
                m * k * n
            }
            Work::Forward {
                kernel: Kernel::BatchMatMul { transpose_b },
                x,
                ..
            } => {
                let (lead, m, n) = batch_dims(&x[0].shape, &x[1].shape, *transpose_b)?;
                numel(&lead) * m * x[0].last() * n
            }
            Work::WeightGrad { mkn: (m, k, n), .. } => m * k * n,
            Work::BatchGradB { a, d, .. } => a.len() * d.last(),
            _ => return None,
        };
        Some(2.0 * flops as f64)
    }

    /// Runs the kernel once.
    fn run(&self) -> Result<(), ExecError> {
        match &self.work {
            Work::Forward {
                kernel,
                x,
                out_shapes,
            } => {
                let refs: Vec<&Tensor> = x.iter().collect();
                black_box(forward(kernel, &refs, out_shapes, &mut Alone)?);
            }
            Work::Backward {
                kernel,
                x,
                y,
                aux,
                dy,
            } => {
                let xs: Vec<&Tensor> = x.iter().collect();
                let ys: Vec<&Tensor> = y.iter().collect();
                let dys: Vec<&Tensor> = dy.iter().collect();
                black_box(backward(
                    kernel,
                    &xs,
                    &ys,
                    aux.as_ref(),
                    &dys,
                    &mut Alone,
                    &mut [],
                )?);
            }
            Work::WeightGrad {
                x,
                dy,
                mkn,
                transpose_b,
                bias,
            } => {
                black_box(matmul_weight_grad(&x.data, &dy.data, *mkn, *transpose_b));
                if *bias {
                    black_box(super::kernels::column_sums(&dy.data, mkn.2));
                }
            }
            Work::BatchGradB {
                a,
                d,
                b_shape,
                transpose_b,
            } => {
                black_box(batch_matmul_grad_b(a, d, b_shape, *transpose_b));
            }
        }
        Ok(())
    }

    /// Times the kernel.
    pub fn time(&self) -> Result<Timing, ExecError> {
        // Kernels index by the shapes checked above; a panic left would be a bug, reported as
        // one rather than taking the measurement down.
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| repeat(|| self.run())))
            .unwrap_or_else(|p| Err(ExecError::Panic(super::panic_message(p.as_ref()))))
    }
}

/// `(b, h, g, s, d)` of attention over `q [b, h, s, d]`, `k, v [b, g, s, d]`.
fn attention_shapes(q: &[usize], k: &[usize], v: &[usize]) -> Option<()> {
    let (&[b, h, s, d], &[kb, g, ks, kd]) = (q, k) else {
        return None;
    };
    (k == v && kb == b && ks == s && kd == d && g > 0 && h % g == 0).then_some(())
}

/// The vocabulary of a cross-entropy over `logits [.., V]` with one label per row.
fn ce_vocab(logits: &[usize], labels: &[usize]) -> Option<usize> {
    let v = *logits.last()?;
    (v > 0 && numel(logits) == numel(labels) * v).then_some(v)
}

/// Whether a measurement with `runs` timed runs, the first begun at `since`, needs another.
fn another_run(runs: usize, since: Instant) -> bool {
    runs < MAX_RUNS && (runs < MIN_RUNS || since.elapsed() < MIN_TIME)
}

/// The median time of `f` after one warm-up run.
fn repeat(mut f: impl FnMut() -> Result<(), ExecError>) -> Result<Timing, ExecError> {
    f()?;
    let mut samples = Vec::new();
    let start = Instant::now();
    while another_run(samples.len(), start) {
        let t = Instant::now();
        f()?;
        samples.push(t.elapsed().as_secs_f64());
    }
    Ok(Timing {
        runs: samples.len(),
        seconds: median(samples),
    })
}

/// Times collective `what` over `ranks` threads, `bytes` being its whole payload (the reduced
/// tensor, or the gathered result), as the CPU executor runs it.
pub fn time_collective(
    what: CollectiveName,
    ranks: usize,
    bytes: u64,
) -> Result<Timing, ExecError> {
    let elements = usize::try_from(bytes / 4).unwrap_or(usize::MAX);
    if ranks < 2 || elements < ranks {
        return Err(ExecError::NoKernel(format!(
            "{ranks} ranks and {bytes} B: a collective needs two ranks and a float per rank"
        )));
    }
    if elements.saturating_mul(ranks) > MAX_ELEMENTS {
        return Err(ExecError::TooLarge(format!(
            "{bytes} B over {ranks} ranks: more than a CPU measurement holds"
        )));
    }
    if what == CollectiveName::AllToAll {
        return Err(ExecError::NoKernel(
            "all-to-all: the CPU executor runs no all-to-all".into(),
        ));
    }
    // Whole tensors split along axis 0 in `ranks` equal parts.
    let per = elements / ranks;
    let whole = per * ranks;
    let fabric = Arc::new(Fabric::default());
    let barrier = Arc::new(Barrier::new(ranks));
    // Rank 0 applies the kernels' rule (after a warm-up, at least MIN_RUNS runs and MIN_TIME)
    // and tells the others whether another run follows, so every rank runs as many.
    let go_on = Arc::new(AtomicBool::new(true));
    let group: Vec<usize> = (0..ranks).collect();
    let results: Vec<Result<Vec<f64>, ExecError>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..ranks)
            .map(|rank| {
                let (fabric, barrier, go_on, group) = (
                    fabric.clone(),
                    barrier.clone(),
                    go_on.clone(),
                    group.clone(),
                );
                s.spawn(move || -> Result<Vec<f64>, ExecError> {
                    let mut ep = Endpoint::new(fabric);
                    let mut samples = Vec::new();
                    let mut timed_since = None;
                    loop {
                        let t = match what {
                            CollectiveName::AllGather => filled(&[per], rank as u64, None),
                            _ => filled(&[whole], rank as u64, None),
                        };
                        barrier.wait();
                        let start = Instant::now();
                        match what {
                            CollectiveName::AllReduce | CollectiveName::ReduceScatter => {
                                let mut t = t;
                                ep.all_reduce_sum(&group, rank, &mut t.data)?;
                                if what == CollectiveName::ReduceScatter {
                                    t = slice(&t, 0, &[whole], rank, ranks);
                                }
                                black_box(t);
                            }
                            _ => {
                                black_box(ep.all_gather(&group, rank, t, 0, &[whole])?);
                            }
                        }
                        samples.push(start.elapsed().as_secs_f64());
                        if rank == 0 {
                            let since = *timed_since.get_or_insert_with(Instant::now);
                            go_on.store(another_run(samples.len() - 1, since), Ordering::Relaxed);
                        }
                        // The barrier orders rank 0's decision before everyone's read.
                        barrier.wait();
                        if !go_on.load(Ordering::Relaxed) {
                            break;
                        }
                    }
                    Ok(samples)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|p| Err(ExecError::Panic(super::panic_message(p.as_ref()))))
            })
            .collect()
    });
    // A collective takes as long as its slowest rank; the first run warms up.
    let mut per_run: Vec<f64> = Vec::new();
    for r in results {
        let timed = r?.into_iter().skip(1);
        per_run.resize(timed.len(), 0.0);
        for (slot, t) in per_run.iter_mut().zip(timed) {
            *slot = slot.max(t);
        }
    }
    Ok(Timing {
        runs: per_run.len(),
        seconds: median(per_run),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use autopar_rules::model::graph::DType;

    fn sig(op: &str, pass: Pass, inputs: &[&[u64]], outputs: &[&[u64]]) -> OpSignature {
        OpSignature {
            op: op.into(),
            pass,
            dtype: DType::F32,
            inputs: inputs.iter().map(|s| s.to_vec()).collect(),
            outputs: outputs.iter().map(|s| s.to_vec()).collect(),
        }
    }

    #[test]
    fn a_products_backward_is_read_as_input_or_weight_gradient() {
        // Forward x [2, 8, 16] · w [16, 32]: dgrad is `matmul_tb` [dy, w] -> dx, wgrad `matmul`
        // [x, dy] -> dw.
        let dgrad = OpBench::new(&sig(
            "matmul_tb",
            Pass::Backward,
            &[&[2, 8, 32], &[16, 32]],
            &[&[2, 8, 16]],
        ))
        .expect("dgrad");
        assert!(matches!(dgrad.work, Work::Forward { .. }));
        let wgrad = OpBench::new(&sig(
            "matmul",
            Pass::Backward,
            &[&[2, 8, 16], &[2, 8, 32]],
            &[&[16, 32]],
        ))
        .expect("wgrad");
        assert!(matches!(
            wgrad.work,
            Work::WeightGrad {
                mkn: (16, 16, 32),
                transpose_b: false,
                ..
            }
        ));
        for b in [dgrad, wgrad] {
            assert!(b.time().expect("times").seconds > 0.0);
        }
    }

    #[test]
    fn a_batched_products_second_gradient_may_be_stored_either_way() {
        // scores = q [1, 4, 8, 16] · kᵀ (k [1, 2, 8, 16], grouped): dk = dsᵀ · q, [1, 2, 8, 16].
        let b = OpBench::new(&sig(
            "batch_matmul",
            Pass::Backward,
            &[&[1, 4, 8, 8], &[1, 4, 8, 16]],
            &[&[1, 2, 8, 16]],
        ))
        .expect("grad b");
        assert!(matches!(b.work, Work::BatchGradB { .. }));
        assert!(b.time().is_ok());
    }

    #[test]
    fn shapes_that_do_not_fit_are_refused_not_run() {
        for s in [
            sig(
                "matmul",
                Pass::Forward,
                &[&[2, 8, 15], &[16, 32]],
                &[&[2, 8, 32]],
            ),
            sig("rmsnorm", Pass::Forward, &[&[4, 8], &[7]], &[&[4, 8]]),
            sig(
                "flash_attention",
                Pass::Forward,
                &[&[1, 2, 4, 8], &[1, 2, 4, 8], &[1, 2, 4, 8]],
                &[&[1, 2, 4, 8]],
            ),
            sig("slice", Pass::Forward, &[&[2, 12]], &[&[2, 5], &[2, 5]]),
            sig("softmax", Pass::Backward, &[&[4, 4], &[4, 5]], &[&[4, 4]]),
        ] {
            assert!(
                matches!(OpBench::new(&s), Err(ExecError::NoKernel(_))),
                "{s}"
            );
        }
        let big: &[u64] = &[1 << 20, 1 << 20];
        let huge = sig("add", Pass::Forward, &[big, big], &[big]);
        assert!(matches!(OpBench::new(&huge), Err(ExecError::TooLarge(_))));
    }

    #[test]
    fn collectives_run_between_threads() {
        for what in [
            CollectiveName::AllReduce,
            CollectiveName::AllGather,
            CollectiveName::ReduceScatter,
        ] {
            let t = time_collective(what, 2, 4096).expect("measures");
            assert!(t.seconds > 0.0 && (MIN_RUNS..=MAX_RUNS).contains(&t.runs));
        }
        assert!(time_collective(CollectiveName::AllToAll, 2, 4096).is_err());
    }
}
