//! The intra-op sharding problem in solver form (ALGORITHMS.md §3): variables with one cost
//! and one memory per strategy, edges with a cost per pair of strategies, and an optional
//! memory budget.
//!
//! ```text
//! minimize  sum_v cost_v[s_v] + sum_(u,v) R_uv[s_u][s_v]
//! subject to sum_v memory_v[s_v] <= budget
//! ```

use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::Arc;

/// A variable: the strategies of a node (or of several merged nodes).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Var {
    /// Cost of each strategy, s.
    pub cost: Vec<f64>,
    /// Memory of each strategy, bytes.
    pub memory: Vec<f64>,
}

/// An edge: a cost for every pair of strategies of its two variables.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Edge {
    /// First variable.
    pub u: usize,
    /// Second variable.
    pub v: usize,
    /// `cost[i * k_v + j]`: strategy `i` of `u` with strategy `j` of `v`, s. Edges with
    /// equal tables may share one ([`Problem::merged_edges`] makes them): a graph of
    /// repeated layers has few distinct tables, and solvers that read every table again and
    /// again (D-Rec) then find them in cache.
    pub cost: Arc<[f64]>,
}

/// A problem.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Problem {
    /// Variables.
    pub vars: Vec<Var>,
    /// Edges between distinct variables.
    pub edges: Vec<Edge>,
    /// Memory budget, bytes.
    pub memory_budget: Option<f64>,
}

/// A choice of one strategy per variable, with its cost and memory.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Assignment {
    /// Strategy index per variable.
    pub choice: Vec<usize>,
    /// Objective, s.
    pub cost: f64,
    /// Memory, bytes.
    pub memory: f64,
}

/// Whether `memory` is within `budget`, allowing for rounding: the one test every solver uses.
pub fn within_budget(memory: f64, budget: f64) -> bool {
    memory <= budget * (1.0 + 1e-12) + 1e-9
}

impl Problem {
    /// Entries of its costs: every variable's strategies and every edge's pairs (what
    /// building it prices, and what a pass over it reads).
    pub fn entries(&self) -> f64 {
        let vars: usize = self.vars.iter().map(|v| v.cost.len()).sum();
        let edges: usize = self.edges.iter().map(|e| e.cost.len()).sum();
        (vars + edges) as f64
    }

    /// Strategies of variable `v`.
    pub fn k(&self, v: usize) -> usize {
        self.vars[v].cost.len()
    }

    /// Objective and memory of `choice`.
    pub fn evaluate(&self, choice: &[usize]) -> (f64, f64) {
        let mut cost = 0.0;
        let mut memory = 0.0;
        for (v, var) in self.vars.iter().enumerate() {
            cost += var.cost[choice[v]];
            memory += var.memory[choice[v]];
        }
        for e in &self.edges {
            cost += e.cost[choice[e.u] * self.k(e.v) + choice[e.v]];
        }
        (cost, memory)
    }

    /// The plan needing the least memory: memory is a sum over variables, so each takes its
    /// leanest strategy (the cheapest of those on a tie).
    pub fn leanest(&self) -> Assignment {
        let choice: Vec<usize> = self
            .vars
            .iter()
            .map(|var| {
                (0..var.cost.len())
                    .min_by(|&a, &b| {
                        var.memory[a]
                            .total_cmp(&var.memory[b])
                            .then(var.cost[a].total_cmp(&var.cost[b]))
                    })
                    .unwrap_or(0)
            })
            .collect();
        let (cost, memory) = self.evaluate(&choice);
        Assignment {
            choice,
            cost,
            memory,
        }
    }

    /// Whether `memory` fits the budget.
    pub fn fits(&self, memory: f64) -> bool {
        self.memory_budget.is_none_or(|b| within_budget(memory, b))
    }

    /// The same problem with edges between the same pair of variables added together, so each
    /// pair has at most one edge, `u < v`.
    pub fn merged_edges(mut self) -> Problem {
        let mut map: std::collections::BTreeMap<(usize, usize), Vec<f64>> = Default::default();
        for e in std::mem::take(&mut self.edges) {
            let (ku, kv) = (self.k(e.u), self.k(e.v));
            let (a, b, flip) = if e.u < e.v {
                (e.u, e.v, false)
            } else {
                (e.v, e.u, true)
            };
            let (ka, kb) = if flip { (kv, ku) } else { (ku, kv) };
            let slot = map.entry((a, b)).or_insert_with(|| vec![0.0; ka * kb]);
            for i in 0..ku {
                for j in 0..kv {
                    let c = e.cost[i * kv + j];
                    if flip {
                        slot[j * ku + i] += c;
                    } else {
                        slot[i * kv + j] += c;
                    }
                }
            }
        }
        // Equal tables are stored once (equal bit for bit).
        let mut distinct: HashMap<Vec<u64>, Arc<[f64]>> = HashMap::new();
        self.edges = map
            .into_iter()
            .map(|((u, v), cost)| {
                let bits: Vec<u64> = cost.iter().map(|x| x.to_bits()).collect();
                let cost = distinct.entry(bits).or_insert_with(|| cost.into()).clone();
                Edge { u, v, cost }
            })
            .collect();
        self
    }

    /// The same problem without dominated strategies: a strategy is dropped when another of
    /// the same variable costs no more on its own and on every edge against every strategy of
    /// the other side (and, with a budget, needs no more memory). Repeated until nothing
    /// changes. Every optimum of the result is an optimum of `self`; the second value maps
    /// each variable's new strategy indices to the old ones.
    pub fn without_dominated(&self) -> (Problem, Vec<Vec<usize>>) {
        self.without_dominated_except(&[])
    }

    /// [`Problem::without_dominated`], keeping every strategy of the variables `protect`:
    /// for every choice of those, the least cost over the others is unchanged.
    pub fn without_dominated_except(&self, protect: &[usize]) -> (Problem, Vec<Vec<usize>>) {
        let n = self.vars.len();
        let mut keep: Vec<Vec<usize>> = (0..n).map(|v| (0..self.k(v)).collect()).collect();
        let mut incident: Vec<Vec<usize>> = vec![Vec::new(); n];
        for (i, e) in self.edges.iter().enumerate() {
            incident[e.u].push(i);
            incident[e.v].push(i);
        }
        let budget = self.memory_budget.is_some();
        let mut changed = true;
        while changed {
            changed = false;
            for v in (0..n).filter(|v| !protect.contains(v)) {
                let dominates = |a: usize, b: usize, keep: &[Vec<usize>]| -> bool {
                    let var = &self.vars[v];
                    if var.cost[a] > var.cost[b] || (budget && var.memory[a] > var.memory[b]) {
                        return false;
                    }
                    incident[v].iter().all(|&ei| {
                        let e = &self.edges[ei];
                        let kv = self.k(e.v);
                        if e.u == v {
                            keep[e.v]
                                .iter()
                                .all(|&w| e.cost[a * kv + w] <= e.cost[b * kv + w])
                        } else {
                            keep[e.u]
                                .iter()
                                .all(|&w| e.cost[w * kv + a] <= e.cost[w * kv + b])
                        }
                    })
                };
                let before = keep[v].len();
                let mut kept: Vec<usize> = Vec::with_capacity(before);
                for &b in &keep[v] {
                    // Dropped if a kept strategy dominates it, or a later one strictly does
                    // (ties keep the first).
                    let beaten = kept.iter().any(|&a| dominates(a, b, &keep))
                        || keep[v]
                            .iter()
                            .any(|&a| a > b && dominates(a, b, &keep) && !dominates(b, a, &keep));
                    if !beaten {
                        kept.push(b);
                    }
                }
                if kept.len() < before {
                    keep[v] = kept;
                    changed = true;
                }
            }
        }
        (self.restricted(&keep), keep)
    }

    /// The same problem with variable `v` limited to the strategies `keep[v]` (old indices, in
    /// the order given).
    pub fn restricted(&self, keep: &[Vec<usize>]) -> Problem {
        let vars = keep
            .iter()
            .enumerate()
            .map(|(v, kept)| Var {
                cost: kept.iter().map(|&i| self.vars[v].cost[i]).collect(),
                memory: kept.iter().map(|&i| self.vars[v].memory[i]).collect(),
            })
            .collect();
        let edges = self
            .edges
            .iter()
            .map(|e| {
                let kv = self.k(e.v);
                let mut cost = Vec::with_capacity(keep[e.u].len() * keep[e.v].len());
                for &a in &keep[e.u] {
                    for &b in &keep[e.v] {
                        cost.push(e.cost[a * kv + b]);
                    }
                }
                Edge {
                    u: e.u,
                    v: e.v,
                    cost: cost.into(),
                }
            })
            .collect();
        Problem {
            vars,
            edges,
            memory_budget: self.memory_budget,
        }
    }

    /// The optimum by trying every choice (for tests and tiny problems); `None` if nothing
    /// fits the budget.
    pub fn brute_force(&self) -> Option<Assignment> {
        let n = self.vars.len();
        let mut choice = vec![0usize; n];
        let mut best: Option<Assignment> = None;
        loop {
            let (cost, memory) = self.evaluate(&choice);
            if self.fits(memory) && best.as_ref().is_none_or(|b| cost < b.cost - 1e-12) {
                best = Some(Assignment {
                    choice: choice.clone(),
                    cost,
                    memory,
                });
            }
            let mut v = 0;
            loop {
                if v == n {
                    return best;
                }
                choice[v] += 1;
                if choice[v] < self.k(v) {
                    break;
                }
                choice[v] = 0;
                v += 1;
            }
        }
    }
}

/// Random problems for the solvers' property tests.
#[cfg(test)]
pub(crate) mod testing {
    use super::{Edge, Problem, Var};

    /// A problem with `ks[v]` strategies per variable, an edge per pair of distinct variables
    /// in `pairs`, costs and memories drawn from `seed` (0 to 10), and a budget at
    /// `budget_frac` of the way from the least to the most memory any choice needs (none from
    /// 1.2 up).
    pub fn random(
        ks: &[usize],
        pairs: Vec<(usize, usize)>,
        budget_frac: f64,
        seed: u64,
    ) -> Problem {
        let mut state = seed | 1;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % 1000) as f64 / 100.0
        };
        let vars: Vec<Var> = ks
            .iter()
            .map(|&k| Var {
                cost: (0..k).map(|_| next()).collect(),
                memory: (0..k).map(|_| next()).collect(),
            })
            .collect();
        let edges: Vec<Edge> = pairs
            .into_iter()
            .filter(|(u, v)| u != v)
            .map(|(u, v)| Edge {
                u,
                v,
                cost: (0..ks[u] * ks[v]).map(|_| next()).collect(),
            })
            .collect();
        let least: f64 = vars
            .iter()
            .map(|v| v.memory.iter().copied().fold(f64::INFINITY, f64::min))
            .sum();
        let most: f64 = vars
            .iter()
            .map(|v| v.memory.iter().copied().fold(0.0, f64::max))
            .sum();
        let budget = (budget_frac < 1.2).then_some(least + (most - least) * budget_frac);
        Problem {
            vars,
            edges,
            memory_budget: budget,
        }
        .merged_edges()
    }
}

#[cfg(test)]
mod tests {
    use super::{Edge, Problem, Var};
    use std::sync::Arc;

    #[test]
    fn merged_edges_add_parallel_edges_and_share_equal_tables() {
        let var = || Var {
            cost: vec![0.0; 2],
            memory: vec![0.0; 2],
        };
        let edge = |u, v, cost: [f64; 4]| Edge {
            u,
            v,
            cost: cost.to_vec().into(),
        };
        let p = Problem {
            vars: vec![var(), var(), var(), var()],
            edges: vec![
                edge(0, 1, [1.0, 2.0, 3.0, 4.0]),
                edge(2, 3, [1.0, 2.0, 3.0, 4.0]),
                // Parallel to (0, 1) seen from the other end: added transposed.
                edge(1, 0, [0.0, 0.0, 0.0, 0.0]),
                edge(1, 2, [1.0, 2.0, 3.0, 5.0]),
            ],
            memory_budget: None,
        }
        .merged_edges();
        let table = |u, v| {
            p.edges
                .iter()
                .find(|e| (e.u, e.v) == (u, v))
                .map(|e| e.cost.clone())
                .expect("the edge")
        };
        assert_eq!(p.edges.len(), 3);
        assert_eq!(&*table(0, 1), &[1.0, 2.0, 3.0, 4.0]);
        assert!(Arc::ptr_eq(&table(0, 1), &table(2, 3)));
        assert!(!Arc::ptr_eq(&table(0, 1), &table(1, 2)));
        assert_eq!(p.evaluate(&[1, 0, 1, 1]).0, 3.0 + 4.0 + 2.0);
    }
}
