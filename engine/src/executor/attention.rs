//! The attention core of the CPU backend, blockwise as FlashAttention computes it, and its
//! context-parallel forms.
//!
//! Scores are computed block by block of keys and merged through each row's log-sum-exp, so the
//! same code attends to the whole sequence at once (one block), to keys all-gathered from the
//! context-parallel group (`allgather`), or to key/value blocks passed round the group one step
//! at a time (`p2p`, ring attention: Liu et al. 2023; Megatron-Core's
//! `AttnFuncWithCPAndKVP2P`). Ulysses (`a2a`) needs nothing here: its all-to-alls are
//! placements the lowering converts between, and the kernel sees whole sequences of fewer heads.
//!
//! Under context parallelism a sequence is stored in Megatron-Core's load-balanced order: cut
//! into `2 cp` chunks, rank `r` holds chunks `r` and `2 cp - 1 - r`, one after the other
//! ([`zigzag_position`]); the causal mask and the rotary embedding read the true positions.
//! The backward uses the forward's log-sum-exp (kept as the kernel's auxiliary value) and
//! recomputes each block's probabilities; in the ring, each key/value block travels with its
//! gradient and comes home after the last step.

use super::ExecError;
use super::kernels::{Group, batch_map};
use super::tensor::{Mat, Tensor, matmul};
use serde::{Deserialize, Serialize};

/// Where an attention kernel's keys and values come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Keys {
    /// Queries, keys and values cover the whole sequence (heads or the batch may be split).
    Whole,
    /// Queries are this rank's share of the sequence; keys and values were all-gathered over
    /// the kernel's group and cover all of it.
    Gathered,
    /// Queries, keys and values are this rank's share; key/value blocks pass round the
    /// kernel's group, one step per rank.
    Ring,
}

/// The position in its sequence of storage index `j`, for a sequence of `s` tokens stored in
/// the load-balanced order of `cp` context-parallel ranks (rank `r` holds chunks `r` and
/// `2 cp - 1 - r` of `2 cp`); `cp = 1` stores the sequence in order.
pub fn zigzag_position(j: usize, s: usize, cp: usize) -> usize {
    let chunk = s / (2 * cp).max(1);
    if cp <= 1 || chunk == 0 {
        return j;
    }
    let (u, within) = (j / chunk, j % chunk);
    let rank = u / 2;
    let true_chunk = if u % 2 == 0 { rank } else { 2 * cp - 1 - rank };
    true_chunk * chunk + within
}

/// Positions of `len` stored rows starting at storage index `first` of a sequence of `s`.
fn positions(first: usize, len: usize, s: usize, zigzag: usize) -> Vec<usize> {
    (first..first + len)
        .map(|j| zigzag_position(j, s, zigzag))
        .collect()
}

/// Shapes of one attention call: `q [b, h, sq, d]`, keys `[b, g, sk, d]`.
struct Dims {
    heads: usize,
    sq: usize,
    sk: usize,
    d: usize,
}

impl Dims {
    fn of(q: &Tensor, k: &Tensor) -> Dims {
        let r = q.shape.len();
        Dims {
            heads: q.shape[1],
            sq: q.shape[r - 2],
            sk: k.shape[r - 2],
            d: q.shape[r - 1],
        }
    }
}

/// Positions of this rank's query rows and, per ring step (one entry unless `Ring`), of the
/// key block it holds then, with the block's owner.
fn layout(
    keys: Keys,
    dims: &Dims,
    zigzag: usize,
    group: &dyn Group,
) -> (Vec<usize>, Vec<Vec<usize>>) {
    let (rank, n) = group.rank();
    match keys {
        Keys::Whole => (
            positions(0, dims.sq, dims.sq, zigzag),
            vec![positions(0, dims.sk, dims.sk, zigzag)],
        ),
        Keys::Gathered => {
            let s = dims.sk;
            (
                positions(rank * dims.sq, dims.sq, s, zigzag),
                vec![positions(0, s, s, zigzag)],
            )
        }
        Keys::Ring => {
            let s = dims.sq * n;
            let blocks = (0..n)
                .map(|step| {
                    let owner = (rank + n - step) % n;
                    positions(owner * dims.sk, dims.sk, s, zigzag)
                })
                .collect();
            (positions(rank * dims.sq, dims.sq, s, zigzag), blocks)
        }
    }
}

/// Causally masked scores of one query matrix against one key block, scaled.
fn scores(
    q: &[f32],
    k: &[f32],
    dims: &Dims,
    qpos: &[usize],
    kpos: &[usize],
    scale: f32,
) -> Vec<f32> {
    let mut s = vec![0.0f32; dims.sq * dims.sk];
    matmul(
        Mat::new(q, dims.sq, dims.d),
        Mat::t(k, dims.sk, dims.d),
        &mut s,
        false,
    );
    for (r, row) in s.chunks_mut(dims.sk).enumerate() {
        for (c, x) in row.iter_mut().enumerate() {
            *x = if kpos[c] <= qpos[r] {
                *x * scale
            } else {
                f32::NEG_INFINITY
            };
        }
    }
    s
}

/// Merges one key block into the running output rows `out [sq, d]` (normalised) and their
/// log-sum-exp `lse [sq]`.
#[allow(clippy::too_many_arguments)]
fn attend_block(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: &Dims,
    (qpos, kpos): (&[usize], &[usize]),
    scale: f32,
    out: &mut [f32],
    lse: &mut [f32],
) {
    let (sk, d) = (dims.sk, dims.d);
    let mut p = scores(q, k, dims, qpos, kpos, scale);
    let mut block_lse = vec![f32::NEG_INFINITY; dims.sq];
    for (r, row) in p.chunks_mut(sk).enumerate() {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if max == f32::NEG_INFINITY {
            row.fill(0.0);
            continue;
        }
        let sum: f32 = row.iter().map(|&x| (x - max).exp()).sum();
        block_lse[r] = max + sum.ln();
        for x in row.iter_mut() {
            *x = (*x - block_lse[r]).exp();
        }
    }
    let mut block = vec![0.0f32; dims.sq * d];
    matmul(
        Mat::new(&p, dims.sq, sk),
        Mat::new(v, sk, d),
        &mut block,
        false,
    );
    for r in 0..dims.sq {
        let (a, b) = (lse[r], block_lse[r]);
        if b == f32::NEG_INFINITY {
            continue;
        }
        let merged = if a == f32::NEG_INFINITY {
            b
        } else {
            a.max(b) + (-(a - b).abs()).exp().ln_1p()
        };
        let (wa, wb) = ((a - merged).exp(), (b - merged).exp());
        for j in 0..d {
            out[r * d + j] = out[r * d + j] * wa + block[r * d + j] * wb;
        }
        lse[r] = merged;
    }
}

/// Gradients of one key block from the output gradient rows `dout [sq, d]`, `delta [sq]`
/// (rowsum of `dout * out`) and the forward's `lse`: adds into `dq`, `dk`, `dv`.
#[allow(clippy::too_many_arguments)]
fn block_backward(
    (q, k, v): (&[f32], &[f32], &[f32]),
    dims: &Dims,
    (qpos, kpos): (&[usize], &[usize]),
    scale: f32,
    (dout, delta, lse): (&[f32], &[f32], &[f32]),
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
) {
    let (sq, sk, d) = (dims.sq, dims.sk, dims.d);
    let mut p = scores(q, k, dims, qpos, kpos, scale);
    for (r, row) in p.chunks_mut(sk).enumerate() {
        for x in row.iter_mut() {
            *x = if lse[r] == f32::NEG_INFINITY {
                0.0
            } else {
                (*x - lse[r]).exp()
            };
        }
    }
    // dv += pᵀ · dout; dp = dout · vᵀ; ds = scale p (dp - delta).
    matmul(Mat::t(&p, sq, sk), Mat::new(dout, sq, d), dv, true);
    let mut ds = vec![0.0f32; sq * sk];
    matmul(Mat::new(dout, sq, d), Mat::t(v, sk, d), &mut ds, false);
    for (r, row) in ds.chunks_mut(sk).enumerate() {
        for (c, x) in row.iter_mut().enumerate() {
            *x = scale * p[r * sk + c] * (*x - delta[r]);
        }
    }
    matmul(Mat::new(&ds, sq, sk), Mat::new(k, sk, d), dq, true);
    matmul(Mat::t(&ds, sq, sk), Mat::new(q, sq, d), dk, true);
}

/// The `[sq, d]` rows of head `h` of batch `b` in a token-major `[b, sq, heads, d]` tensor.
fn token_rows(t: &[f32], dims: &Dims, i: usize) -> Vec<f32> {
    let (b, h) = (i / dims.heads, i % dims.heads);
    (0..dims.sq)
        .flat_map(|s| {
            let at = ((b * dims.sq + s) * dims.heads + h) * dims.d;
            t[at..at + dims.d].iter().copied()
        })
        .collect()
}

/// Key and value blocks packed for one ring step (and their gradients in the backward).
fn pack(parts: &[&[f32]]) -> Vec<f32> {
    parts.iter().flat_map(|p| p.iter().copied()).collect()
}

fn unpack(buf: &[f32], len: usize, count: usize) -> Vec<Vec<f32>> {
    (0..count)
        .map(|i| buf[i * len..(i + 1) * len].to_vec())
        .collect()
}

/// Causal attention of `q [b, h, sq, d]` against `k, v [b, g, sk, d]`: the token-major
/// output `[b, sq, h, d]` and every row's log-sum-exp `[b * h * sq]`.
pub fn forward(
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    scale: f32,
    zigzag: usize,
    keys: Keys,
    group: &mut dyn Group,
) -> Result<(Vec<f32>, Vec<f32>), ExecError> {
    let dims = Dims::of(q, k);
    let (qpos, blocks) = layout(keys, &dims, zigzag, group);
    let (qn, kn) = (dims.sq * dims.d, dims.sk * dims.d);
    let map = batch_map(&q.shape, &k.shape);
    let rows = map.len();
    let mut out_rows = vec![0.0f32; q.len()];
    let mut lse = vec![f32::NEG_INFINITY; rows * dims.sq];
    let (mut kb, mut vb) = (k.data.clone(), v.data.clone());
    for (step, kpos) in blocks.iter().enumerate() {
        if step > 0 {
            let moved = group.shift(pack(&[&kb, &vb]))?;
            let mut parts = unpack(&moved, k.len(), 2).into_iter();
            kb = parts.next().unwrap_or_default();
            vb = parts.next().unwrap_or_default();
        }
        for (i, &j) in map.iter().enumerate() {
            attend_block(
                &q.data[i * qn..(i + 1) * qn],
                &kb[j * kn..(j + 1) * kn],
                &vb[j * kn..(j + 1) * kn],
                &dims,
                (&qpos, kpos),
                scale,
                &mut out_rows[i * qn..(i + 1) * qn],
                &mut lse[i * dims.sq..(i + 1) * dims.sq],
            );
        }
    }
    // Token-major output.
    let mut out = vec![0.0f32; q.len()];
    for i in 0..rows {
        let (b, h) = (i / dims.heads, i % dims.heads);
        for s in 0..dims.sq {
            let at = ((b * dims.sq + s) * dims.heads + h) * dims.d;
            out[at..at + dims.d]
                .copy_from_slice(&out_rows[i * qn + s * dims.d..i * qn + (s + 1) * dims.d]);
        }
    }
    Ok((out, lse))
}

/// The gradients of `q`, `k` and `v`, in that order.
pub type QkvGrads = (Vec<f32>, Vec<f32>, Vec<f32>);

/// Gradients of `q`, `k` and `v` from the forward's output `out` and log-sum-exp `lse` and
/// the output gradient `d_out` (both token-major).
#[allow(clippy::too_many_arguments)]
pub fn backward(
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    out: &Tensor,
    lse: &[f32],
    d_out: &Tensor,
    scale: f32,
    zigzag: usize,
    keys: Keys,
    group: &mut dyn Group,
) -> Result<QkvGrads, ExecError> {
    let dims = Dims::of(q, k);
    let (qpos, blocks) = layout(keys, &dims, zigzag, group);
    let (qn, kn) = (dims.sq * dims.d, dims.sk * dims.d);
    let map = batch_map(&q.shape, &k.shape);
    let mut dq = vec![0.0f32; q.len()];
    let dout: Vec<Vec<f32>> = (0..map.len())
        .map(|i| token_rows(&d_out.data, &dims, i))
        .collect();
    let delta: Vec<Vec<f32>> = (0..map.len())
        .map(|i| {
            let o = token_rows(&out.data, &dims, i);
            (0..dims.sq)
                .map(|r| {
                    (0..dims.d)
                        .map(|j| dout[i][r * dims.d + j] * o[r * dims.d + j])
                        .sum()
                })
                .collect()
        })
        .collect();
    let (mut kb, mut vb) = (k.data.clone(), v.data.clone());
    let (mut dk, mut dv) = (vec![0.0f32; k.len()], vec![0.0f32; v.len()]);
    for (step, kpos) in blocks.iter().enumerate() {
        if step > 0 {
            let moved = group.shift(pack(&[&kb, &vb, &dk, &dv]))?;
            let mut parts = unpack(&moved, k.len(), 4).into_iter();
            kb = parts.next().unwrap_or_default();
            vb = parts.next().unwrap_or_default();
            dk = parts.next().unwrap_or_default();
            dv = parts.next().unwrap_or_default();
        }
        for (i, &j) in map.iter().enumerate() {
            let kj = j * kn..(j + 1) * kn;
            block_backward(
                (
                    &q.data[i * qn..(i + 1) * qn],
                    &kb[kj.clone()],
                    &vb[kj.clone()],
                ),
                &dims,
                (&qpos, kpos),
                scale,
                (&dout[i], &delta[i], &lse[i * dims.sq..(i + 1) * dims.sq]),
                &mut dq[i * qn..(i + 1) * qn],
                &mut dk[kj.clone()],
                &mut dv[kj],
            );
        }
    }
    if blocks.len() > 1 {
        // Each block's gradient is one step short of its owner.
        let moved = group.shift(pack(&[&dk, &dv]))?;
        let mut parts = unpack(&moved, k.len(), 2).into_iter();
        dk = parts.next().unwrap_or_default();
        dv = parts.next().unwrap_or_default();
    }
    Ok((dq, dk, dv))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zigzag_gives_rank_r_chunks_r_and_its_mirror() {
        // 8 tokens, cp = 2: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
        let order: Vec<usize> = (0..8).map(|j| zigzag_position(j, 8, 2)).collect();
        assert_eq!(order, vec![0, 1, 6, 7, 2, 3, 4, 5]);
        let identity: Vec<usize> = (0..8).map(|j| zigzag_position(j, 8, 1)).collect();
        assert_eq!(identity, (0..8).collect::<Vec<_>>());
        // Every position once.
        let mut all: Vec<usize> = (0..64).map(|j| zigzag_position(j, 64, 4)).collect();
        all.sort_unstable();
        assert_eq!(all, (0..64).collect::<Vec<_>>());
    }
}
