//! Composing layers exactly (ALGORITHMS.md §3): each layer is solved once per mesh for every
//! choice of its boundary specs, giving a table `cost[before][after]`; a range of layers is
//! then a shortest path through the chain of tables. Because the only terms of the range's
//! problem that join two layers are the specs of the tensors crossing their boundary (the
//! activation going forward, its gradient coming back), the path's cost is the optimum of the
//! whole range's problem, which is what lets identical blocks share one solve.
//!
//! A boundary state is the spec of every tensor crossing the boundary, each as its producer
//! makes it: the consumer's resharding is inside the consumer's table, as it is inside the
//! whole range's problem. The specs of tensors crossing the range's own ends are free there,
//! as in the whole range's problem.
//!
//! Memory is carried along: each entry keeps the memory of the plan reaching its cost. The
//! per-device budget is not applied here (a chain's optimum is the unconstrained one).

use super::exact::{self, Declined};
use super::problem::{Edge, Problem, Var};
use super::stage::{IntraError, StageModel, StageOptions};
use crate::cost::cluster::Device;
use crate::cost::sharding::{Mesh, Spec};
use crate::model::graph::{Graph, TensorId};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeSet, HashMap};
use std::ops::Range;

/// Why a range cannot be composed from per-layer tables.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ChainError {
    /// A tensor joins two layers that are not neighbours (a tied weight, a shared input).
    #[error(
        "layers {first} and {second} share tensor `{tensor}` but are not neighbours: the range is not a chain"
    )]
    NotAChain {
        /// The earlier layer.
        first: usize,
        /// The later layer.
        second: usize,
        /// The tensor's name.
        tensor: String,
    },
    /// The layer's problem could not be built.
    #[error(transparent)]
    Intra(#[from] IntraError),
    /// The elimination would be too large.
    #[error("the layer's boundary table is too large for the exact solver ({0:?})")]
    TooWide(Declined),
    /// Consecutive tables do not meet on the same boundary.
    #[error("layer tables {0} and {1} do not share a boundary")]
    Mismatch(usize, usize),
}

/// One layer solved for every choice of its boundary specs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerTable {
    /// The layer.
    pub layer: usize,
    /// Boundary states with the previous layer: the spec of each crossing tensor.
    pub before: Vec<Vec<Spec>>,
    /// Boundary states with the next layer.
    pub after: Vec<Vec<Spec>>,
    /// Least cost per (before, after) pair, row-major (`after` fastest); infinite when no
    /// choice of the layer gives that pair.
    pub cost: Vec<f64>,
    /// Per pair: memory per device of the plan reaching the cost, bytes.
    pub memory: Vec<f64>,
}

impl LayerTable {
    /// Index of the pair (`b`, `a`).
    fn at(&self, b: usize, a: usize) -> usize {
        b * self.after.len() + a
    }
}

/// Cost of a range from its layer tables.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChainCost {
    /// Least objective of the range (per micro-batch, s).
    pub cost: f64,
    /// Memory per device of the plan reaching it, bytes.
    pub memory: f64,
}

/// Which layer makes each tensor and which layers read it.
struct Crossings {
    maker: HashMap<TensorId, usize>,
    readers: HashMap<TensorId, BTreeSet<usize>>,
}

impl Crossings {
    fn of(graph: &Graph) -> Crossings {
        let mut maker = HashMap::new();
        let mut readers: HashMap<TensorId, BTreeSet<usize>> = HashMap::new();
        for (l, layer) in graph.layers.iter().enumerate() {
            for &o in layer.forward.iter().chain(&layer.backward) {
                let op = graph.op(o);
                for &t in op.outputs.iter().chain(&op.saves) {
                    if !op.inputs.contains(&t) {
                        maker.entry(t).or_insert(l);
                    }
                }
                for &t in op.inputs.iter().chain(&op.saves) {
                    readers.entry(t).or_default().insert(l);
                }
            }
        }
        Crossings { maker, readers }
    }

    /// Tensors crossing between layers `l` and `l + 1`, in id order.
    fn boundary(&self, l: usize) -> Vec<TensorId> {
        let mut out: Vec<TensorId> = self
            .readers
            .iter()
            .filter(|(t, r)| match self.maker.get(t) {
                Some(&m) if m == l => r.contains(&(l + 1)),
                Some(&m) if m == l + 1 => r.contains(&l),
                _ => false,
            })
            .map(|(&t, _)| t)
            .collect();
        out.sort_unstable();
        out
    }

    /// Fails when a tensor (a parameter, an input or an activation) joins two layers of
    /// `range` that are not neighbours.
    fn check(&self, graph: &Graph, range: &Range<usize>) -> Result<(), ChainError> {
        let mut ts: Vec<(&TensorId, &BTreeSet<usize>)> = self.readers.iter().collect();
        ts.sort_unstable_by_key(|(t, _)| **t);
        for (t, r) in ts {
            let maker = self.maker.get(t);
            let mut layers = r.clone();
            layers.extend(maker);
            layers.retain(|l| range.contains(l));
            let (Some(&first), Some(&last)) = (layers.first(), layers.last()) else {
                continue;
            };
            // A tensor nothing makes (an input, a parameter) is one variable of the whole
            // range's problem, so two layers reading it are joined through it.
            if last > first + 1 || (maker.is_none() && last > first) {
                return Err(ChainError::NotAChain {
                    first,
                    second: last,
                    tensor: graph.tensor(*t).name.clone(),
                });
            }
        }
        Ok(())
    }
}

/// Solves layer `layer` of `graph` on `mesh` for every choice of its boundary specs.
pub fn layer_table(
    graph: &Graph,
    layer: usize,
    mesh: Mesh,
    device: &Device,
    opts: StageOptions,
) -> Result<LayerTable, ChainError> {
    let crossings = Crossings::of(graph);
    crossings.check(graph, &(layer..layer + 1))?;
    table(graph, &crossings, layer, mesh, device, opts)
}

fn table(
    graph: &Graph,
    crossings: &Crossings,
    layer: usize,
    mesh: Mesh,
    device: &Device,
    opts: StageOptions,
) -> Result<LayerTable, ChainError> {
    let model = StageModel::build(graph, layer..layer + 1, mesh, device, opts)?;
    let before = match layer {
        0 => Vec::new(),
        _ => crossings.boundary(layer - 1),
    };
    let after = crossings.boundary(layer);
    // Each crossing tensor's spec gets a variable over its distinct specs: the variable of a
    // tensor entering the layer is one already; a tensor the layer makes gets a new one,
    // joined to its producer's strategy by an edge that allows only the spec that strategy
    // makes (an exact projection: the elimination never picks an infinite entry when a
    // finite one exists, and every producer strategy has one).
    let mut p: Problem = model.problem().clone();
    let mut keep: Vec<usize> = Vec::new();
    let mut spec_of: Vec<(usize, Vec<Spec>)> = Vec::new();
    for &t in before.iter().chain(&after) {
        let (var, specs) = model
            .spec_variable(t)
            .ok_or(ChainError::Mismatch(layer, layer))?;
        let kept = if model.makes(t) {
            let mut distinct: Vec<Spec> = specs.clone();
            distinct.sort_unstable();
            distinct.dedup();
            let k = distinct.len();
            let cost = specs
                .iter()
                .flat_map(|s| {
                    distinct
                        .iter()
                        .map(move |d| if d == s { 0.0 } else { f64::INFINITY })
                })
                .collect();
            p.vars.push(Var {
                cost: vec![0.0; k],
                memory: vec![0.0; k],
            });
            let aux = p.vars.len() - 1;
            p.edges.push(Edge {
                u: var,
                v: aux,
                cost,
            });
            (aux, distinct)
        } else {
            (var, specs)
        };
        let slot = keep.iter().position(|&v| v == kept.0).unwrap_or_else(|| {
            keep.push(kept.0);
            keep.len() - 1
        });
        spec_of.push((slot, kept.1));
    }
    // Dropping dominated strategies of the other variables keeps every entry of the table.
    let (p, _) = p.without_dominated_except(&keep);
    let m = exact::marginal(&p, &keep, opts.max_exact_entries).map_err(ChainError::TooWide)?;
    let mut index_before: HashMap<Vec<Spec>, usize> = HashMap::new();
    let mut index_after: HashMap<Vec<Spec>, usize> = HashMap::new();
    let mut entries: Vec<(usize, usize, f64, f64)> = Vec::new();
    let mut joint = vec![0usize; keep.len()];
    for e in 0..m.cost.len() {
        let state = |range: Range<usize>| -> Vec<Spec> {
            spec_of[range]
                .iter()
                .map(|(slot, specs)| specs[joint[*slot]].clone())
                .collect()
        };
        let sb = state(0..before.len());
        let sa = state(before.len()..spec_of.len());
        let n = index_before.len();
        let b = *index_before.entry(sb).or_insert(n);
        let n = index_after.len();
        let a = *index_after.entry(sa).or_insert(n);
        entries.push((b, a, m.cost[e], m.memory[e]));
        for i in (0..joint.len()).rev() {
            joint[i] += 1;
            if joint[i] < m.k[i] {
                break;
            }
            joint[i] = 0;
        }
    }
    let ordered = |index: HashMap<Vec<Spec>, usize>| -> Vec<Vec<Spec>> {
        let mut v: Vec<(Vec<Spec>, usize)> = index.into_iter().collect();
        v.sort_unstable_by_key(|(_, i)| *i);
        v.into_iter().map(|(s, _)| s).collect()
    };
    let mut t = LayerTable {
        layer,
        before: ordered(index_before),
        after: ordered(index_after),
        cost: Vec::new(),
        memory: Vec::new(),
    };
    let pairs = t.before.len() * t.after.len();
    t.cost = vec![f64::INFINITY; pairs];
    t.memory = vec![f64::INFINITY; pairs];
    for (b, a, c, mem) in entries {
        let i = t.at(b, a);
        if (c, mem) < (t.cost[i], t.memory[i]) {
            t.cost[i] = c;
            t.memory[i] = mem;
        }
    }
    Ok(t)
}

/// Tables of layers `first..end` of `graph` on `mesh`, one solve per layer.
pub fn range_tables(
    graph: &Graph,
    layers: Range<usize>,
    mesh: Mesh,
    device: &Device,
    opts: StageOptions,
) -> Result<Vec<LayerTable>, ChainError> {
    let crossings = Crossings::of(graph);
    crossings.check(graph, &layers)?;
    layers
        .map(|l| table(graph, &crossings, l, mesh, device, opts))
        .collect()
}

/// The least cost of the range whose layer tables are `tables`, in order: a shortest path
/// over boundary states, free at both ends.
pub fn compose(tables: &[LayerTable]) -> Result<ChainCost, ChainError> {
    let Some(first) = tables.first() else {
        return Ok(ChainCost {
            cost: 0.0,
            memory: 0.0,
        });
    };
    // Best (cost, memory) per state of the boundary after the current layer.
    let mut best: Vec<(f64, f64)> = (0..first.after.len())
        .map(|a| {
            (0..first.before.len())
                .map(|b| (first.cost[first.at(b, a)], first.memory[first.at(b, a)]))
                .fold((f64::INFINITY, f64::INFINITY), min_pair)
        })
        .collect();
    for (i, pair) in tables.windows(2).enumerate() {
        let (prev, next) = (&pair[0], &pair[1]);
        let index: HashMap<&Vec<Spec>, usize> = next
            .before
            .iter()
            .enumerate()
            .map(|(i, s)| (s, i))
            .collect();
        if prev.after.len() != next.before.len() {
            return Err(ChainError::Mismatch(i, i + 1));
        }
        let mut step = vec![(f64::INFINITY, f64::INFINITY); next.after.len()];
        for (s, &(c, m)) in prev.after.iter().zip(&best) {
            let b = *index.get(s).ok_or(ChainError::Mismatch(i, i + 1))?;
            if !c.is_finite() {
                continue;
            }
            for (a, slot) in step.iter_mut().enumerate() {
                let j = next.at(b, a);
                *slot = min_pair(*slot, (c + next.cost[j], m + next.memory[j]));
            }
        }
        best = step;
    }
    let (cost, memory) = best
        .into_iter()
        .fold((f64::INFINITY, f64::INFINITY), min_pair);
    Ok(ChainCost { cost, memory })
}

/// The smaller cost, ties to less memory.
fn min_pair(a: (f64, f64), b: (f64, f64)) -> (f64, f64) {
    if b < a { b } else { a }
}
