//! Intra-operator auto-sharding (ALGORITHMS.md §3): for a range of layers on a 2D logical
//! mesh, a sharding strategy for every op that minimises compute, communication and
//! resharding under a memory budget, solved exactly.

pub mod chain;
pub mod drec;
pub mod einsum;
pub mod exact;
pub mod ilp;
pub mod problem;
pub mod stage;

#[cfg(test)]
mod tests {
    use super::problem::Problem;
    use super::{exact, ilp};
    use proptest::prelude::*;

    fn instance() -> impl Strategy<Value = Problem> {
        (1usize..=8)
            .prop_flat_map(|n| {
                (
                    proptest::collection::vec(1usize..=6, n),
                    proptest::collection::vec((0usize..n, 0usize..n), 0..=12),
                    0.0f64..1.3,
                    any::<u64>(),
                )
            })
            .prop_map(|(ks, pairs, budget_frac, seed)| {
                super::problem::testing::random(&ks, pairs, budget_frac, seed)
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        #[test]
        fn both_solvers_find_the_exhaustive_optimum(p in instance()) {
            let expect = p.brute_force();
            let got = exact::solve_checked(&p, 1e7).expect("small enough");
            let ilp = ilp::solve(&p, 30.0);
            match (&expect, &got, &ilp) {
                (None, None, Err(ilp::IlpError::Infeasible)) => {}
                (Some(e), Some(x), Ok(i)) => {
                    prop_assert!((x.cost - e.cost).abs() < 1e-9 * e.cost.abs().max(1.0), "exact {} vs exhaustive {}", x.cost, e.cost);
                    prop_assert!((i.assignment.cost - e.cost).abs() < 1e-6 * e.cost.abs().max(1.0), "ilp {} vs exhaustive {}", i.assignment.cost, e.cost);
                    prop_assert_eq!(i.status, ilp::IlpStatus::Optimal);
                    prop_assert!(p.fits(x.memory) && p.fits(i.assignment.memory));
                }
                (e, x, i) => prop_assert!(false, "exhaustive {:?}, exact {:?}, ilp {:?}", e, x, i),
            }
        }

        #[test]
        fn the_marginal_is_the_least_cost_for_every_choice_of_the_kept(
            p in instance(),
            mask in any::<u8>(),
        ) {
            let keep: Vec<usize> = (0..p.vars.len()).filter(|v| mask & (1 << v) != 0).collect();
            // Dropping dominated strategies of the others keeps every entry.
            let (reduced, _) = p.without_dominated_except(&keep);
            let m = exact::marginal(&reduced, &keep, 1e7).expect("small enough");
            prop_assert_eq!(m.cost.len(), keep.iter().map(|&v| p.k(v)).product::<usize>());
            // Exhaustive: the least cost of every full assignment, grouped by the kept part.
            let mut least = vec![f64::INFINITY; m.cost.len()];
            let mut choice = vec![0usize; p.vars.len()];
            loop {
                let entry = keep.iter().fold(0, |i, &v| i * p.k(v) + choice[v]);
                least[entry] = least[entry].min(p.evaluate(&choice).0);
                let Some(v) = (0..choice.len()).rev().find(|&v| choice[v] + 1 < p.k(v)) else {
                    break;
                };
                choice[v] += 1;
                choice[v + 1..].iter_mut().for_each(|c| *c = 0);
            }
            for (e, (&got, &want)) in m.cost.iter().zip(&least).enumerate() {
                prop_assert!((got - want).abs() < 1e-9 * want.abs().max(1.0), "entry {}: {} vs {}", e, got, want);
            }
        }

        #[test]
        fn dropping_dominated_strategies_keeps_the_optimum(p in instance()) {
            let (reduced, keep) = p.without_dominated();
            prop_assert_eq!(keep.len(), p.vars.len());
            let expect = p.brute_force();
            let got = exact::solve_checked(&reduced, 1e7).expect("small enough");
            match (&expect, &got) {
                (None, None) => {}
                (Some(e), Some(x)) => {
                    let choice: Vec<usize> = x.choice.iter().zip(&keep).map(|(&c, k)| k[c]).collect();
                    let (cost, memory) = p.evaluate(&choice);
                    prop_assert!((cost - e.cost).abs() < 1e-9 * e.cost.abs().max(1.0), "reduced {} vs exhaustive {}", cost, e.cost);
                    prop_assert!((cost - x.cost).abs() < 1e-9 * cost.abs().max(1.0));
                    prop_assert!(p.fits(memory));
                }
                (e, x) => prop_assert!(false, "exhaustive {:?}, reduced {:?}", e, x),
            }
        }
    }
}
