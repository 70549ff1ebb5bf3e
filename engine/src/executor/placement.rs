//! Where the pieces of a tensor live inside a tensor-parallel group, and the collectives that
//! move a tensor from one placement to another.
//!
//! A tensor is replicated, split along one axis, or (an intermediate state only) a partial sum
//! that a reduction completes. A split axis may be made of *parts*, e.g. the fused QKV output
//! `[q | k | v]`: rank `r` then holds the `r`-th slice of every part, so each rank keeps whole
//! heads of q, k and v rather than the `r`-th contiguous block of the fused axis.

use super::tensor::Tensor;
use serde::{Deserialize, Serialize};

/// The state of a value on the ranks of a tensor-parallel group.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    /// Every rank holds the whole tensor.
    Replicated,
    /// Rank `r` holds slice `r` of every part of `axis`.
    Split {
        /// The divided axis.
        axis: usize,
        /// Lengths of the parts of that axis (whole tensor); their sum is the axis length.
        parts: Vec<usize>,
    },
    /// Every rank holds a summand of the tensor.
    Partial,
}

impl State {
    /// Split along `axis` of a tensor of shape `shape`, in one part.
    pub fn split(axis: usize, shape: &[u64]) -> State {
        State::Split {
            axis,
            parts: vec![shape.get(axis).copied().unwrap_or(1) as usize],
        }
    }

    /// The split axis, if any.
    pub fn axis(&self) -> Option<usize> {
        match self {
            State::Split { axis, .. } => Some(*axis),
            _ => None,
        }
    }
}

/// A collective that changes a value's state inside the tensor-parallel group.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Conversion {
    /// Keep this rank's slice of a replicated value (no communication).
    Slice {
        /// Target state.
        to: State,
    },
    /// Assemble the whole value from the slices of every rank.
    AllGather {
        /// Source state.
        from: State,
    },
    /// Sum the partial values of every rank.
    AllReduce,
    /// Sum the partial values and keep this rank's slice.
    ReduceScatter {
        /// Target state.
        to: State,
    },
}

impl Conversion {
    /// Short name for reports.
    pub fn name(&self) -> &'static str {
        match self {
            Conversion::Slice { .. } => "slice",
            Conversion::AllGather { .. } => "all_gather",
            Conversion::AllReduce => "all_reduce",
            Conversion::ReduceScatter { .. } => "reduce_scatter",
        }
    }

    /// Whether the conversion communicates.
    pub fn communicates(&self) -> bool {
        !matches!(self, Conversion::Slice { .. })
    }
}

/// The conversions that take a value from `from` to `to`, in order; `None` when impossible
/// (nothing turns a complete value back into a partial sum).
pub fn conversions(from: &State, to: &State) -> Option<Vec<Conversion>> {
    use State::*;
    Some(match (from, to) {
        (a, b) if a == b => vec![],
        (Replicated, Split { .. }) => vec![Conversion::Slice { to: to.clone() }],
        (Split { .. }, Replicated) => vec![Conversion::AllGather { from: from.clone() }],
        (Split { .. }, Split { .. }) => vec![
            Conversion::AllGather { from: from.clone() },
            Conversion::Slice { to: to.clone() },
        ],
        (Partial, Replicated) => vec![Conversion::AllReduce],
        (Partial, Split { .. }) => vec![Conversion::ReduceScatter { to: to.clone() }],
        (_, Partial) => return None,
        _ => return None,
    })
}

/// Ranges of the whole axis that rank `rank` of `ranks` holds, in order.
fn ranges(parts: &[usize], rank: usize, ranks: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::with_capacity(parts.len());
    let mut offset = 0;
    for &p in parts {
        let w = p / ranks;
        out.push((offset + rank * w, offset + (rank + 1) * w));
        offset += p;
    }
    out
}

/// Whether every part of a split divides evenly over `ranks`.
pub fn divides(state: &State, ranks: usize) -> bool {
    match state {
        State::Split { parts, .. } => parts.iter().all(|p| p % ranks == 0),
        _ => true,
    }
}

/// Rank `rank`'s slice (of `ranks`) of the whole tensor `whole` split as `axis`/`parts`.
pub fn slice(whole: &Tensor, axis: usize, parts: &[usize], rank: usize, ranks: usize) -> Tensor {
    let outer: usize = whole.shape[..axis].iter().product();
    let len = whole.shape[axis];
    let inner: usize = whole.shape[axis + 1..].iter().product();
    let spans = ranges(parts, rank, ranks);
    let local: usize = spans.iter().map(|(a, b)| b - a).sum();
    let mut data = Vec::with_capacity(outer * local * inner);
    for o in 0..outer {
        for &(a, b) in &spans {
            let start = (o * len + a) * inner;
            data.extend_from_slice(&whole.data[start..start + (b - a) * inner]);
        }
    }
    let mut shape = whole.shape.clone();
    shape[axis] = local;
    Tensor { shape, data }
}

/// The whole tensor from the slices of every rank (in rank order): the inverse of [`slice`].
pub fn gather(pieces: &[&Tensor], axis: usize, parts: &[usize]) -> Tensor {
    let ranks = pieces.len();
    let first = pieces[0];
    let outer: usize = first.shape[..axis].iter().product();
    let inner: usize = first.shape[axis + 1..].iter().product();
    let len: usize = parts.iter().sum();
    let mut shape = first.shape.clone();
    shape[axis] = len;
    let mut data = vec![0.0f32; outer * len * inner];
    for (rank, piece) in pieces.iter().enumerate() {
        let spans = ranges(parts, rank, ranks);
        let local: usize = spans.iter().map(|(a, b)| b - a).sum();
        for o in 0..outer {
            let mut src = o * local * inner;
            for &(a, b) in &spans {
                let n = (b - a) * inner;
                let dst = (o * len + a) * inner;
                data[dst..dst + n].copy_from_slice(&piece.data[src..src + n]);
                src += n;
            }
        }
    }
    Tensor { shape, data }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gather_inverts_slice_with_parts() {
        let shape = vec![2, 12, 3];
        let whole = Tensor {
            data: (0..72).map(|x| x as f32).collect(),
            shape,
        };
        for parts in [vec![12], vec![4, 4, 4], vec![8, 2, 2]] {
            let pieces: Vec<Tensor> = (0..2).map(|r| slice(&whole, 1, &parts, r, 2)).collect();
            let refs: Vec<&Tensor> = pieces.iter().collect();
            assert_eq!(gather(&refs, 1, &parts), whole);
        }
        // Rank 1 of [q q q q | k k | v v] holds the second half of each part.
        let row = Tensor {
            shape: vec![8],
            data: (0..8).map(|x| x as f32).collect(),
        };
        assert_eq!(
            slice(&row, 0, &[4, 2, 2], 1, 2).data,
            vec![2.0, 3.0, 5.0, 7.0]
        );
    }

    #[test]
    fn conversions_between_states() {
        let s = State::split(1, &[2, 4]);
        assert_eq!(
            conversions(&State::Partial, &State::Replicated).map(|c| c.len()),
            Some(1)
        );
        assert_eq!(
            conversions(&State::Partial, &s),
            Some(vec![Conversion::ReduceScatter { to: s.clone() }])
        );
        assert!(conversions(&State::Replicated, &State::Partial).is_none());
        assert_eq!(conversions(&s, &s), Some(vec![]));
    }
}
