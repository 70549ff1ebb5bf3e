//! Minimising `sum + weight * max` over solutions, given a solver for "minimum sum with every
//! part at most `t`". Both pipeline problems have this shape: a pipeline of `B` micro-batches
//! costs `sum of stage times + (B - 1) * max stage time`.
//!
//! `t` ranges over the sorted distinct part costs. Writing `Φ(t)` for the minimum sum under
//! bound `t` (non-increasing in `t`), every solution whose largest part costs `M` has total at
//! least `Φ(M) + weight * M`, and the solver run at `t = M` finds one with at most that total.
//! Instead of running the solver for every candidate, the search bisects the candidate list and
//! discards an interval `(a, b]` of bounds when no solution whose maximum lies in it can win:
//! when `Φ(b) + weight * t_{a+1}` already reaches the best total, or when `Φ(b) = Φ(a)` (such a
//! solution has at least the sum of, and a larger maximum than, the one found at `a`). This
//! subsumes the classic stop `(weight + 1) * t >= best` and stays exact.

/// A solution of the bound-`t` subproblem: its sum, its actual largest part, and the solution.
pub struct Bounded<S> {
    /// Minimum sum under the bound.
    pub sum: f64,
    /// Largest part of that solution (at most the bound).
    pub max: f64,
    /// The solution.
    pub solution: S,
}

/// The best solution and how many bounds were evaluated.
pub struct Best<S> {
    /// `sum + weight * max` of the solution.
    pub total: f64,
    /// The solution.
    pub solution: S,
    /// Subproblems solved.
    pub evaluated: usize,
}

/// Runs the search over `bounds` (sorted, distinct). `solve(t)` returns the minimum-sum solution
/// with every part at most `t`, or `None` if there is none; it must be monotone (feasible at `t`
/// implies feasible at larger bounds). `gap` skips bounds closer than this to an evaluated one
/// (zero keeps the search exact).
pub fn minimize<S>(
    bounds: &[f64],
    weight: f64,
    gap: f64,
    mut solve: impl FnMut(f64) -> Option<Bounded<S>>,
) -> Option<Best<S>> {
    let top = bounds.len().checked_sub(1)?;
    let mut best: Option<(f64, S)> = None;
    let mut evaluated = 0;
    let mut evaluate = |t: f64, best: &mut Option<(f64, S)>| -> Option<f64> {
        evaluated += 1;
        let b = solve(t)?;
        let total = b.sum + weight * b.max;
        if best.as_ref().is_none_or(|(bt, _)| total < *bt) {
            *best = Some((total, b.solution));
        }
        Some(b.sum)
    };
    let phi_top = evaluate(bounds[top], &mut best)?;
    // The smallest feasible bound, by bisection (feasibility is monotone).
    let (mut lo, mut hi) = (0usize, top);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if evaluate(bounds[mid], &mut best).is_some() {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    if lo < top
        && let Some(phi_lo) = evaluate(bounds[lo], &mut best)
    {
        let mut stack = vec![(lo, phi_lo, top, phi_top)];
        while let Some((a, phi_a, z, phi_z)) = stack.pop() {
            if z <= a + 1 || phi_z >= phi_a || bounds[z] - bounds[a] < gap {
                continue;
            }
            let floor = phi_z + weight * bounds[a + 1];
            if best.as_ref().is_some_and(|(b, _)| floor >= *b) {
                continue;
            }
            let mid = (a + z) / 2;
            let Some(phi_mid) = evaluate(bounds[mid], &mut best) else {
                continue;
            };
            stack.push((a, phi_a, mid, phi_mid));
            stack.push((mid, phi_mid, z, phi_z));
        }
    }
    best.map(|(total, solution)| Best {
        total,
        solution,
        evaluated,
    })
}

/// Sorted distinct finite values.
pub fn candidates(values: impl IntoIterator<Item = f64>) -> Vec<f64> {
    let mut v: Vec<f64> = values.into_iter().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    v.dedup();
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_best_trade_off_between_sum_and_max() {
        // Three solutions: (sum, max) = (10, 5), (6, 6), (3, 9); weight 2 -> totals 20, 18, 21.
        let sols: [(f64, f64); 3] = [(10.0, 5.0), (6.0, 6.0), (3.0, 9.0)];
        let bounds = candidates([5.0, 6.0, 9.0, 7.0]);
        let best = minimize(&bounds, 2.0, 0.0, |t| {
            sols.iter()
                .filter(|(_, m)| *m <= t)
                .min_by(|a, b| a.0.total_cmp(&b.0))
                .map(|&(sum, max)| Bounded {
                    sum,
                    max,
                    solution: (sum, max),
                })
        })
        .expect("feasible");
        assert_eq!(best.total, 18.0);
        assert_eq!(best.solution, (6.0, 6.0));
        assert!(minimize(&bounds, 2.0, 0.0, |_| None::<Bounded<()>>).is_none());
    }
}
