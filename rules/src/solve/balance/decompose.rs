//! SAPP's memory decomposition: measured per-stage peaks, with known layer and recompute counts,
//! solved for the memory terms of the model (ALGORITHMS.md §4).
//!
//! ```text
//! M_j = const + n_j par + (p - j) sum_r c_jr act_r        for the middle stages,
//! M_0 = head  + n_0 par +  p      sum_r c_0r act_r,
//! M_{p-1} = tail + n par + 1 * sum_r c_r act_r,
//! ```
//!
//! `head` and `tail` include the constant, as SAPP publishes them; the balancer therefore adds
//! the constant only to middle stages (SAPP adds it twice on the first and last stage).
//! The middle stages are solved first: exactly when there are as many as unknowns, by least
//! squares when there are more, and refused when the system is rank-deficient (for instance
//! when every stage has the same number of layers, `const` and `par` cannot be told apart).

use super::{KINDS, RecomputeKind};
use serde::{Deserialize, Serialize};

/// Memory of one measured run: stage count, per-stage layer and recompute counts, and measured
/// peaks (stage index, memory) including the first and the last stage.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryRun {
    /// Pipeline stages of the run.
    pub stages: usize,
    /// Body layers per stage.
    pub layers: Vec<u32>,
    /// Layers of each recompute kind per stage.
    pub counts: Vec<[u32; KINDS]>,
    /// Measured peaks: (stage, memory).
    pub memories: Vec<(usize, f64)>,
}

/// The decomposed memory model (same unit as the measurements).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct MemoryTerms {
    /// Per-stage constant (optimizer workspace, buffers) of a middle stage.
    pub constant: f64,
    /// Weights and optimizer states of one body layer.
    pub parameter: f64,
    /// Activations of one body layer for one micro-batch, per recompute kind (`None` when the
    /// measurements say nothing about the kind).
    pub activation: [Option<f64>; KINDS],
    /// Extra memory of the first stage (embedding), constant included.
    pub head: f64,
    /// Extra memory of the last stage (output layer, loss), constant included.
    pub tail: f64,
}

/// Why the measurements cannot be decomposed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DecomposeError {
    /// The first or last stage was not measured.
    #[error("the memory of stage {0} (first and last stage are required) is missing")]
    MissingEnd(usize),
    /// A stage index outside the pipeline, or inconsistent lists.
    #[error("{0}")]
    Shape(String),
    /// Too few middle stages for the unknowns.
    #[error(
        "{unknowns} unknowns (constant, per-layer parameters, activations of {kinds}) need at \
         least {needed} measured middle stages, found {found}"
    )]
    TooFew {
        /// Unknowns of the middle-stage system.
        unknowns: usize,
        /// Recompute kinds involved.
        kinds: String,
        /// Middle stages needed.
        needed: usize,
        /// Middle stages measured.
        found: usize,
    },
    /// The system does not determine the unknowns.
    #[error(
        "the measured middle stages do not determine the memory terms (rank {rank} of \
         {unknowns}): vary the layer counts (offsets) and recompute counts between stages"
    )]
    RankDeficient {
        /// Rank of the system.
        rank: usize,
        /// Unknowns.
        unknowns: usize,
    },
}

/// Least squares `min |A x - b|` by Householder QR; `None` if `A` (rows x cols) has rank below
/// `cols` (relative pivot tolerance 1e-9).
pub(crate) fn least_squares(mut a: Vec<Vec<f64>>, mut b: Vec<f64>) -> Result<Vec<f64>, usize> {
    let (rows, cols) = (a.len(), a.first().map_or(0, Vec::len));
    let scale = a
        .iter()
        .flatten()
        .fold(0.0f64, |m, &x| m.max(x.abs()))
        .max(f64::MIN_POSITIVE);
    for k in 0..cols {
        let norm = (k..rows).map(|i| a[i][k] * a[i][k]).sum::<f64>().sqrt();
        if norm <= 1e-9 * scale {
            // Columns 0..k are independent, column k depends on them.
            return Err(k);
        }
        let alpha = if a[k][k] > 0.0 { -norm } else { norm };
        let mut v: Vec<f64> = (k..rows).map(|i| a[i][k]).collect();
        v[0] -= alpha;
        let vnorm2: f64 = v.iter().map(|x| x * x).sum();
        if vnorm2 == 0.0 {
            continue;
        }
        // Reflect the remaining columns: a_j -= 2 (v . a_j) / |v|^2 v.
        let factors: Vec<f64> = (k..cols)
            .map(|j| 2.0 * (k..rows).map(|i| v[i - k] * a[i][j]).sum::<f64>() / vnorm2)
            .collect();
        for (i, row) in a.iter_mut().enumerate().skip(k) {
            for (j, f) in (k..cols).zip(&factors) {
                row[j] -= f * v[i - k];
            }
        }
        let dot: f64 = (k..rows).map(|i| v[i - k] * b[i]).sum();
        let f = 2.0 * dot / vnorm2;
        for i in k..rows {
            b[i] -= f * v[i - k];
        }
    }
    let mut x = vec![0.0; cols];
    for k in (0..cols).rev() {
        let s: f64 = (k + 1..cols).map(|j| a[k][j] * x[j]).sum();
        x[k] = (b[k] - s) / a[k][k];
    }
    Ok(x)
}

/// Decomposes measured stage memories into [`MemoryTerms`].
pub fn decompose(runs: &[MemoryRun]) -> Result<MemoryTerms, DecomposeError> {
    let Some(first) = runs.first() else {
        return Err(DecomposeError::Shape("no measured run".into()));
    };
    for r in runs {
        if r.stages < 3 || r.layers.len() != r.stages || r.counts.len() != r.stages {
            return Err(DecomposeError::Shape(format!(
                "a run needs at least 3 stages and per-stage lists of its length ({} stages, \
                 {} layer counts, {} recompute counts)",
                r.stages,
                r.layers.len(),
                r.counts.len()
            )));
        }
        for (j, c) in r.counts.iter().enumerate() {
            if c.iter().sum::<u32>() != r.layers[j] {
                return Err(DecomposeError::Shape(format!(
                    "stage {j}: recompute counts add up to {}, not its {} layers",
                    c.iter().sum::<u32>(),
                    r.layers[j]
                )));
            }
        }
        if let Some(&(j, _)) = r.memories.iter().find(|(j, _)| *j >= r.stages) {
            return Err(DecomposeError::Shape(format!(
                "stage {j} does not exist in a {}-stage pipeline",
                r.stages
            )));
        }
    }
    // Kinds the measurements involve.
    let mut used = [false; KINDS];
    used[RecomputeKind::None.index()] = true;
    for r in runs {
        for c in &r.counts {
            for k in 0..KINDS {
                used[k] |= c[k] > 0;
            }
        }
    }
    let kinds: Vec<usize> = (0..KINDS).filter(|&k| used[k]).collect();
    // One row per measured middle stage: [const, par, act_k...].
    let mut rows = Vec::new();
    let mut rhs = Vec::new();
    for r in runs {
        let p = r.stages;
        for &(j, m) in &r.memories {
            if j == 0 || j == p - 1 {
                continue;
            }
            let inflight = (p - j) as f64;
            let mut row = vec![1.0, r.layers[j] as f64];
            row.extend(kinds.iter().map(|&k| inflight * r.counts[j][k] as f64));
            rows.push(row);
            rhs.push(m);
        }
    }
    let unknowns = 2 + kinds.len();
    let names: Vec<&str> = kinds
        .iter()
        .map(|&k| RecomputeKind::ALL[k].name())
        .collect();
    if rows.len() < unknowns {
        return Err(DecomposeError::TooFew {
            unknowns,
            kinds: names.join(", "),
            needed: unknowns,
            found: rows.len(),
        });
    }
    let x = least_squares(rows, rhs)
        .map_err(|rank| DecomposeError::RankDeficient { rank, unknowns })?;
    let (constant, parameter) = (x[0], x[1]);
    let mut activation = [None; KINDS];
    for (i, &k) in kinds.iter().enumerate() {
        activation[k] = Some(x[2 + i]);
    }
    // First and last stage of the first run: what the body terms leave is head / tail.
    let body = |r: &MemoryRun, j: usize| {
        let inflight = (r.stages - j) as f64;
        r.layers[j] as f64 * parameter
            + inflight
                * kinds
                    .iter()
                    .map(|&k| r.counts[j][k] as f64 * activation[k].unwrap_or(0.0))
                    .sum::<f64>()
    };
    let measured = |j: usize| {
        first
            .memories
            .iter()
            .find(|(s, _)| *s == j)
            .map(|&(_, m)| m)
            .ok_or(DecomposeError::MissingEnd(j))
    };
    let last = first.stages - 1;
    let head = measured(0)? - body(first, 0);
    let tail = measured(last)? - body(first, last);
    Ok(MemoryTerms {
        constant,
        parameter,
        activation,
        head,
        tail,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn least_squares_solves_and_detects_rank() {
        let a = vec![vec![1.0, 1.0], vec![1.0, 2.0], vec![1.0, 3.0]];
        let x = least_squares(a, vec![2.0, 3.0, 4.0]).expect("full rank");
        assert!((x[0] - 1.0).abs() < 1e-12 && (x[1] - 1.0).abs() < 1e-12);
        let a = vec![vec![1.0, 2.0], vec![2.0, 4.0], vec![3.0, 6.0]];
        assert_eq!(least_squares(a, vec![1.0, 2.0, 3.0]), Err(1));
    }
}
