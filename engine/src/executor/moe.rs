//! Mixture-of-experts kernels of the CPU backend: the router's top-k choice, the dispatch of
//! tokens into expert-major buffers and the gate-weighted combine, forward and backward.
//!
//! The router is Megatron-Core's default (`--moe-router-topk k`, no pre-softmax): each token
//! keeps its `k` highest scores (ties to the lower expert) and its gates are the softmax of
//! those `k` scores, which is Mixtral's renormalised top-k softmax. The tokens routed to an
//! expert take the slots of its buffer `[E, C, h]` in token order. Past `C`, a plan that drops
//! tokens keeps the `C` with the highest gates (Megatron-Core's default
//! `--moe-token-drop-policy probs`, ties to the earlier token); a dropless plan that sized its
//! buffers too small for this routing is an error. Dispatch and combine compute the same slots
//! from the same gates and indices, so they agree on every device.

use super::ExecError;
use super::tensor::Tensor;

/// Top-k of every row of `scores [.., E]`: the gates (softmax of the chosen scores) and the
/// chosen experts' indices, each `[.., k]`.
pub fn route(scores: &Tensor, k: usize) -> (Vec<f32>, Vec<f32>) {
    let e = scores.last();
    let rows = scores.len() / e.max(1);
    let mut gates = Vec::with_capacity(rows * k);
    let mut idx = Vec::with_capacity(rows * k);
    for row in scores.data.chunks(e) {
        let mut order: Vec<usize> = (0..e).collect();
        // Highest score first; equal scores keep the lower expert first.
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        let chosen = &order[..k.min(e)];
        let max = chosen
            .iter()
            .map(|&j| row[j])
            .fold(f32::NEG_INFINITY, f32::max);
        let exp: Vec<f32> = chosen.iter().map(|&j| (row[j] - max).exp()).collect();
        let sum: f32 = exp.iter().sum();
        for (&j, &x) in chosen.iter().zip(&exp) {
            gates.push(x / sum);
            idx.push(j as f32);
        }
    }
    (gates, idx)
}

/// Gradient of the scores (`e` experts) from the gates' gradient: the softmax backward over
/// each token's chosen experts; the others get none.
pub fn route_backward(gates: &Tensor, idx: &Tensor, d_gates: &[f32], e: usize) -> Vec<f32> {
    let k = gates.last();
    let (gates, idx) = (&gates.data, &idx.data);
    let rows = gates.len() / k.max(1);
    let mut d = vec![0.0f32; rows * e];
    for t in 0..rows {
        let (g, dg) = (&gates[t * k..(t + 1) * k], &d_gates[t * k..(t + 1) * k]);
        let dot: f32 = g.iter().zip(dg).map(|(a, b)| a * b).sum();
        for j in 0..k {
            d[t * e + idx[t * k + j] as usize] = g[j] * (dg[j] - dot);
        }
    }
    d
}

/// The slot of every (token, choice) in its expert's buffer of `capacity` rows, in token
/// order; `None` when it is dropped.
fn slots(
    gates: &[f32],
    idx: &[f32],
    experts: usize,
    capacity: usize,
    drop: bool,
) -> Result<Vec<Option<usize>>, ExecError> {
    let mut routed: Vec<Vec<usize>> = vec![Vec::new(); experts];
    for (i, &x) in idx.iter().enumerate() {
        let e = x as usize;
        let Some(list) = routed.get_mut(e) else {
            return Err(ExecError::Lower(format!(
                "the router chose expert {e} of {experts}"
            )));
        };
        list.push(i);
    }
    let mut out = vec![None; idx.len()];
    for (e, mut list) in routed.into_iter().enumerate() {
        if list.len() > capacity {
            if !drop {
                return Err(ExecError::Lower(format!(
                    "expert {e} received {} tokens, more than the {capacity} its buffer holds, \
                     and the plan drops no tokens: raise the target's `moe_load_imbalance`",
                    list.len()
                )));
            }
            // Keep the highest gates (the earlier token on a tie), then token order.
            list.sort_by(|&a, &b| gates[b].total_cmp(&gates[a]).then(a.cmp(&b)));
            list.truncate(capacity);
            list.sort_unstable();
        }
        for (slot, i) in list.into_iter().enumerate() {
            out[i] = Some(slot);
        }
    }
    Ok(out)
}

/// Where every kept (token, choice) sits: its token, its index among the `[.., k]` choices and
/// the offset of its row in the buffers `[E, C, h]` (`shape`).
fn placed(
    gates: &Tensor,
    idx: &Tensor,
    shape: &[usize],
    drop: bool,
) -> Result<Vec<(usize, usize, usize)>, ExecError> {
    let (e, c, h) = (shape[0], shape[1], shape[2]);
    let k = idx.last().max(1);
    Ok(slots(&gates.data, &idx.data, e, c, drop)?
        .into_iter()
        .enumerate()
        .filter_map(|(i, slot)| slot.map(|s| (i / k, i, (idx.data[i] as usize * c + s) * h)))
        .collect())
}

/// Tokens `x [.., h]` copied into their experts' buffers `[E, C, h]` (`shape`), as the
/// chosen experts `idx [.., k]` and their gates say.
pub fn dispatch(
    x: &Tensor,
    idx: &Tensor,
    gates: &Tensor,
    shape: &[usize],
    drop: bool,
) -> Result<Vec<f32>, ExecError> {
    let h = shape[2];
    let mut out = vec![0.0f32; shape.iter().product()];
    for (t, _, at) in placed(gates, idx, shape, drop)? {
        out[at..at + h].copy_from_slice(&x.data[t * h..(t + 1) * h]);
    }
    Ok(out)
}

/// Gradient of the tokens from the buffers' gradient `d [E, C, h]`.
pub fn dispatch_backward(
    d: &Tensor,
    idx: &Tensor,
    gates: &Tensor,
    drop: bool,
) -> Result<Vec<f32>, ExecError> {
    let h = d.last();
    let tokens = idx.len() / idx.last().max(1);
    let mut dx = vec![0.0f32; tokens * h];
    for (t, _, at) in placed(gates, idx, &d.shape, drop)? {
        for (g, v) in dx[t * h..(t + 1) * h].iter_mut().zip(&d.data[at..at + h]) {
            *g += v;
        }
    }
    Ok(dx)
}

/// Every token's gate-weighted sum of its experts' outputs `y [E, C, h]`, with the gates and
/// the chosen experts `[.., k]`.
pub fn combine(
    y: &Tensor,
    gates: &Tensor,
    idx: &Tensor,
    drop: bool,
) -> Result<Vec<f32>, ExecError> {
    let h = y.last();
    let tokens = idx.len() / idx.last().max(1);
    let mut out = vec![0.0f32; tokens * h];
    for (t, i, at) in placed(gates, idx, &y.shape, drop)? {
        for (o, v) in out[t * h..(t + 1) * h].iter_mut().zip(&y.data[at..at + h]) {
            *o += gates.data[i] * v;
        }
    }
    Ok(out)
}

/// Gradients of the experts' outputs and of the gates from the output gradient `d [.., h]`.
pub fn combine_backward(
    y: &Tensor,
    gates: &Tensor,
    idx: &Tensor,
    d: &Tensor,
    drop: bool,
) -> Result<(Vec<f32>, Vec<f32>), ExecError> {
    let h = y.last();
    let mut dy = vec![0.0f32; y.len()];
    let mut dg = vec![0.0f32; gates.len()];
    for (t, i, at) in placed(gates, idx, &y.shape, drop)? {
        let row = &d.data[t * h..(t + 1) * h];
        for j in 0..h {
            dy[at + j] = gates.data[i] * row[j];
        }
        dg[i] = y.data[at..at + h].iter().zip(row).map(|(a, b)| a * b).sum();
    }
    Ok((dy, dg))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_two_gates_are_the_softmax_of_the_chosen_scores() {
        let scores = Tensor {
            shape: vec![1, 4],
            data: vec![0.5, 2.0, 2.0, -1.0],
        };
        let (gates, idx) = route(&scores, 2);
        // Equal scores: the lower expert first.
        assert_eq!(idx, vec![1.0, 2.0]);
        assert!((gates[0] - 0.5).abs() < 1e-7 && (gates[1] - 0.5).abs() < 1e-7);
    }

    #[test]
    fn dispatch_and_combine_agree_on_slots_and_drop_past_capacity() {
        // Three tokens all choosing expert 0 (k = 1), capacity 2: the lowest gate (the
        // second token's) is dropped.
        let x = Tensor {
            shape: vec![3, 1],
            data: vec![1.0, 2.0, 3.0],
        };
        let idx = Tensor {
            shape: vec![3, 1],
            data: vec![0.0, 0.0, 0.0],
        };
        let gates = Tensor {
            shape: vec![3, 1],
            data: vec![0.9, 0.2, 0.9],
        };
        let buf = dispatch(&x, &idx, &gates, &[2, 2, 1], true).expect("drops");
        assert_eq!(buf, vec![1.0, 3.0, 0.0, 0.0]);
        let y = Tensor {
            shape: vec![2, 2, 1],
            data: buf,
        };
        let out = combine(&y, &gates, &idx, true).expect("combines");
        assert_eq!(out, vec![0.9, 0.0, 0.9 * 3.0]);
        // Without dropping, the overflow is an error naming the expert.
        let e = dispatch(&x, &idx, &gates, &[2, 2, 1], false).expect_err("dropless");
        assert!(e.to_string().contains("expert 0"), "{e}");
    }
}
