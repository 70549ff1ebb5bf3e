//! Minimising `sum + weight * max` over solutions, given a solver for "minimum sum with every
//! part at most `t`". Both pipeline problems have this shape: a pipeline of `B` micro-batches
//! costs `sum of stage times + (B - 1) * max stage time`.
//!
//! `t` ranges over the sorted distinct part costs. Writing `Φ(t)` for the minimum sum under
//! bound `t` (non-increasing in `t`), every solution whose largest part costs `M` has total at
//! least `Φ(M) + weight * M`, and the solver run at `t = M` finds one with at most that total.
//! Parts are non-negative, so a solution's sum is at least its largest part and its total at
//! least `(weight + 1) * M`: once a solution of total `X` is known, no bound at or above
//! `X / (weight + 1)` can win (the classic stop), which usually leaves a narrow window just above
//! the smallest feasible bound.
//!
//! The search never evaluates a bound it can rule out that way. Solvers whose work grows with the
//! bound (the stage DP's bands widen with it) are cheap at small bounds, so the smallest feasible
//! bound is found by galloping up from the smallest candidate (1, 3, 7, 15, ... candidates) and
//! then bisecting, not by bisecting the whole list from its largest, most expensive end. The
//! window above it is then searched by bisection over intervals `(a, z]` of candidates, each
//! discarded when no solution whose maximum lies in it can win: when
//! `max(Φ(z), t_{a+1}) + weight * t_{a+1}` already reaches the best total (with a lower bound of
//! `Φ(z)` where `z` was not evaluated), or when `Φ(z) = Φ(a)` (such a solution has at least the
//! sum of, and a larger maximum than, the one found at `a`). The search stays exact.

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

/// Runs the search over `bounds` (sorted, distinct, non-negative). `solve(t)` returns the
/// minimum-sum solution with every part (non-negative) at most `t`, or `None` if there is none;
/// it must be monotone (feasible at `t` implies feasible at larger bounds). `gap` skips bounds
/// closer than this to an evaluated one (zero keeps the search exact).
pub fn minimize<S>(
    bounds: &[f64],
    weight: f64,
    gap: f64,
    mut solve: impl FnMut(f64) -> Option<Bounded<S>>,
) -> Option<Best<S>> {
    let top = bounds.len().checked_sub(1)?;
    let mut best: Option<(f64, S)> = None;
    let mut evaluated = 0;
    let mut evaluate = |i: usize, best: &mut Option<(f64, S)>| -> Option<f64> {
        evaluated += 1;
        let b = solve(bounds[i])?;
        let total = b.sum + weight * b.max;
        if best.as_ref().is_none_or(|(bt, _)| total < *bt) {
            *best = Some((total, b.solution));
        }
        Some(b.sum)
    };
    // Feasible candidates evaluated: (index, Φ).
    let mut known: Vec<(usize, f64)> = Vec::new();
    // The smallest feasible candidate: gallop up to a feasible one, then bisect below it.
    let mut infeasible: Option<usize> = None;
    let mut probe = 0;
    let mut feasible = loop {
        if let Some(phi) = evaluate(probe, &mut best) {
            known.push((probe, phi));
            break probe;
        }
        infeasible = Some(probe);
        if probe == top {
            return None;
        }
        probe = (2 * probe + 1).min(top);
    };
    while let Some(below) = infeasible.filter(|&b| b + 1 < feasible) {
        let mid = (below + 1 + feasible) / 2;
        match evaluate(mid, &mut best) {
            Some(phi) => {
                known.push((mid, phi));
                feasible = mid;
            }
            None => infeasible = Some(mid),
        }
    }
    known.sort_by_key(|&(i, _)| i);
    // Intervals (a, z] of candidates not yet covered, with Φ(a), a lower bound of Φ(z) (exact
    // where z was evaluated, else 0) and whether z was evaluated.
    let mut stack: Vec<(usize, f64, usize, f64, bool)> = known
        .windows(2)
        .map(|w| (w[0].0, w[0].1, w[1].0, w[1].1, true))
        .collect();
    if let Some(&(last, phi)) = known.last()
        && last < top
    {
        stack.push((last, phi, top, 0.0, false));
    }
    while let Some((a, phi_a, mut z, phi_z, mut z_known)) = stack.pop() {
        let Some(best_total) = best.as_ref().map(|(b, _)| *b) else {
            break;
        };
        // Candidates at or above best / (weight + 1) cannot win.
        let cap = a + bounds[a + 1..=z].partition_point(|&t| (weight + 1.0) * t < best_total);
        if cap < z {
            z = cap;
            z_known = false;
        }
        if z <= a || (z == a + 1 && z_known) || phi_z >= phi_a || bounds[z] - bounds[a] < gap {
            continue;
        }
        let t_next = bounds[a + 1];
        if phi_z.max(t_next) + weight * t_next >= best_total {
            continue;
        }
        // Strictly inside (a, z) when z was evaluated, else possibly z itself.
        let mid = if z_known {
            (a + z) / 2
        } else {
            (a + z).div_ceil(2)
        };
        let Some(phi_mid) = evaluate(mid, &mut best) else {
            continue;
        };
        stack.push((a, phi_a, mid, phi_mid, true));
        if mid < z {
            stack.push((mid, phi_mid, z, phi_z, z_known));
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

    proptest::proptest! {
        /// On random solution sets (each a list of non-negative parts), the search's optimum
        /// equals the exhaustive minimum of `sum + weight * max`, and it never evaluates a
        /// bound twice.
        #[test]
        fn equals_exhaustive_search(
            sols in proptest::collection::vec(
                proptest::collection::vec(0u32..40, 1..5), 1..30),
            weight in 0u32..50,
        ) {
            let sols: Vec<(f64, f64)> = sols
                .iter()
                .map(|parts| {
                    let sum: u32 = parts.iter().sum();
                    let max = parts.iter().copied().max().unwrap_or(0);
                    (f64::from(sum), f64::from(max))
                })
                .collect();
            let w = f64::from(weight);
            let expect = sols.iter().map(|&(s, m)| s + w * m).fold(f64::INFINITY, f64::min);
            let bounds = candidates(sols.iter().map(|&(_, m)| m));
            let mut seen = Vec::new();
            let mut twice = false;
            let best = minimize(&bounds, w, 0.0, |t| {
                twice |= seen.contains(&t.to_bits());
                seen.push(t.to_bits());
                sols.iter()
                    .filter(|(_, m)| *m <= t)
                    .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)))
                    .map(|&(sum, max)| Bounded { sum, max, solution: () })
            });
            proptest::prop_assert!(!twice, "a bound was evaluated twice");
            proptest::prop_assert_eq!(best.map(|b| b.total), Some(expect));
        }
    }
}
