//! How well predictions agree with measured runs: relative errors and Spearman's rank
//! correlation, the figures `autopar validate` reports.

/// Fewest runs a group needs for its rank correlation to be reported: with two, any pair of
/// distinct values correlates at ±1, which says nothing.
pub const MIN_RANKED: usize = 3;

/// `predicted / measured - 1`.
pub fn relative_error(predicted: f64, measured: f64) -> f64 {
    predicted / measured - 1.0
}

/// Mean of `|e|` over `errors`; `None` when there are none.
pub fn mean_abs(errors: &[f64]) -> Option<f64> {
    (!errors.is_empty()).then(|| errors.iter().map(|e| e.abs()).sum::<f64>() / errors.len() as f64)
}

/// The rank of every value (1 = smallest), ties sharing the mean of the ranks they span.
pub fn ranks(values: &[f64]) -> Vec<f64> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    order.sort_by(|&a, &b| values[a].total_cmp(&values[b]));
    let mut out = vec![0.0; values.len()];
    let mut i = 0;
    while i < order.len() {
        let mut j = i;
        while j + 1 < order.len() && values[order[j + 1]] == values[order[i]] {
            j += 1;
        }
        // Positions i..=j hold equal values: each gets the mean of ranks i+1..=j+1.
        let rank = (i + j) as f64 / 2.0 + 1.0;
        for &k in &order[i..=j] {
            out[k] = rank;
        }
        i = j + 1;
    }
    out
}

/// Spearman's rank correlation of `x` and `y` (Pearson's correlation of their ranks, so ties
/// count correctly); `None` with fewer than [`MIN_RANKED`] pairs or when either side has one
/// value only.
pub fn spearman(x: &[f64], y: &[f64]) -> Option<f64> {
    if x.len() != y.len() || x.len() < MIN_RANKED {
        return None;
    }
    let (rx, ry) = (ranks(x), ranks(y));
    let n = x.len() as f64;
    let mean = (n + 1.0) / 2.0;
    let (mut sxy, mut sxx, mut syy) = (0.0, 0.0, 0.0);
    for (a, b) in rx.iter().zip(&ry) {
        let (da, db) = (a - mean, b - mean);
        sxy += da * db;
        sxx += da * da;
        syy += db * db;
    }
    (sxx > 0.0 && syy > 0.0).then(|| sxy / (sxx * syy).sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn ranks_share_ties() {
        assert_eq!(ranks(&[3.0, 1.0, 2.0]), vec![3.0, 1.0, 2.0]);
        assert_eq!(ranks(&[5.0, 1.0, 5.0, 0.0]), vec![3.5, 2.0, 3.5, 1.0]);
    }

    #[test]
    fn spearman_of_known_orders() {
        assert_eq!(spearman(&[1.0, 2.0, 3.0], &[10.0, 20.0, 30.0]), Some(1.0));
        assert_eq!(spearman(&[1.0, 2.0, 3.0], &[3.0, 2.0, 1.0]), Some(-1.0));
        // Textbook case without ties: 1 - 6 Σd² / (n(n²-1)) with d = (0, 1, -1, 0, 0).
        let r = spearman(&[1.0, 2.0, 3.0, 4.0, 5.0], &[1.0, 3.0, 2.0, 4.0, 5.0]);
        assert!((r.unwrap_or(0.0) - (1.0 - 6.0 * 2.0 / 120.0)).abs() < 1e-12);
        assert_eq!(spearman(&[1.0, 2.0], &[1.0, 2.0]), None);
        assert_eq!(spearman(&[1.0, 1.0, 1.0], &[1.0, 2.0, 3.0]), None);
    }

    /// The classic formula `1 - 6 Σd² / (n(n²-1))`, exact when neither side has ties.
    fn by_formula(x: &[f64], y: &[f64]) -> f64 {
        let (rx, ry) = (ranks(x), ranks(y));
        let n = x.len() as f64;
        let d2: f64 = rx.iter().zip(&ry).map(|(a, b)| (a - b).powi(2)).sum();
        1.0 - 6.0 * d2 / (n * (n * n - 1.0))
    }

    proptest! {
        #[test]
        fn spearman_matches_the_formula_without_ties(
            pairs in proptest::collection::btree_map(0u32..1000, 0u32..1000, 3..20)
        ) {
            // Distinct x by construction; make y distinct by adding the index.
            let x: Vec<f64> = pairs.keys().map(|&k| k as f64).collect();
            let y: Vec<f64> = pairs
                .values()
                .enumerate()
                .map(|(i, &v)| v as f64 * 100.0 + i as f64)
                .collect();
            let r = spearman(&x, &y).unwrap_or(f64::NAN);
            prop_assert!((r - by_formula(&x, &y)).abs() < 1e-9);
            prop_assert!((-1.0..=1.0).contains(&r));
            // Invariant under any increasing transform of either side.
            let y3: Vec<f64> = y.iter().map(|v| v.powi(3) + 7.0).collect();
            prop_assert!((spearman(&x, &y3).unwrap_or(f64::NAN) - r).abs() < 1e-9);
        }
    }
}
