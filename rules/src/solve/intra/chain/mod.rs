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
//! Memory is carried along: each entry keeps the memory of the plan reaching its cost, its
//! peak (what it holds and the backward pass's largest transient, which is not summed along
//! the chain but the largest of its layers'). The per-device budget is not applied here (a
//! chain's optimum is the unconstrained one).
//!
//! A layer too large to eliminate, or any layer when the options ask for D-Rec, gets D-Rec's
//! table instead (`drec`): entries only for the boundary states D-Rec is pinned to, each with
//! the plan reaching it, upper bounds of the exact entries. Chaining is the same.

use super::exact::{self, Declined, Planned};
use super::problem::{Edge, Problem, Var};
use super::stage::{IntraError, SolverChoice, StageModel, StageOptions, StagePlan};
use crate::cost::cluster::Device;
use crate::cost::sharding::{Mesh, Spec};
use crate::model::graph::{Graph, TensorId};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeSet, HashMap};
use std::ops::Range;

mod columns;
mod drec;

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
    /// D-Rec's table would pin the layer to too many pairs of boundary states.
    #[error("D-Rec's table of the layer would take {runs} runs, more than it may ({max})")]
    TooManyRuns {
        /// Runs: pairs of boundary states pinned.
        runs: f64,
        /// The most a table may take.
        max: usize,
    },
    /// The exact elimination would take more work than a whole pipeline search may.
    #[error(
        "the layer's boundary table would take {work:.1e} additions of the exact solver, more \
         than a whole pipeline search may ({max:.0e})"
    )]
    TooMuchWork {
        /// Additions planned ([`exact::Size::work`]).
        work: f64,
        /// The most it may ([`StageOptions::max_table_work`]).
        max: f64,
    },
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
    /// Per (before, after) pair, row-major (`after` fastest): the least cost and its plan's
    /// memory; [`Entry::NONE`] when no choice of the layer gives that pair. Stored column by
    /// column ([`columns`]).
    #[serde(with = "columns")]
    pub entries: Vec<Entry>,
    /// Solves run to fill the table: for the exact elimination one, or one per joint choice
    /// of the entering specs when keeping them all through one elimination would be too
    /// wide; for D-Rec one per run (per pinned pair of states, per state before the layer
    /// with the one after free, and one free run).
    pub solves: usize,
    /// The work filling it took, deterministic (not timed): the layer problem's cost entries
    /// (twenty units each), plus the additions of the exact eliminations
    /// ([`exact::Size::work`]), or the problem's entries again for every D-Rec run. A
    /// pipeline search bounds its tables' sum ([`MAX_TABLE_WORK`]).
    #[serde(default)]
    pub work: f64,
    /// What filled the table.
    #[serde(default)]
    pub solver: TableSolver,
    /// For a D-Rec table: per finite entry (its row-major index), the plan reaching it, a
    /// strategy per variable of the layer's problem. Decoding reads it: solving the layer
    /// again with both boundaries pinned could give D-Rec another plan.
    #[serde(default)]
    pub plans: Vec<(usize, Vec<u32>)>,
    /// What D-Rec warned of while filling the table (distinct, in order).
    #[serde(default)]
    pub warnings: Vec<String>,
}

/// What filled a layer table.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TableSolver {
    /// The exact elimination: every entry is the least cost of its pair of states.
    #[default]
    Exact,
    /// D-Rec's heuristic, pinned to each boundary state: entries are not proven optimal.
    Drec,
}

/// The least cost of a layer or range for one boundary state, and the memory of the plan
/// reaching it, with what recomputing its forward pass in the backward pass would cost and
/// save (activation checkpointing of every layer of the range).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    /// Objective per micro-batch, s.
    pub cost: f64,
    /// Peak memory per device with the options' micro-batches in flight, bytes: what the plan
    /// holds and its backward transient ([`Entry::working`]).
    pub memory: f64,
    /// Of that memory, the activations saved per micro-batch in flight, bytes.
    pub activations: f64,
    /// Of the cost, the forward pass (compute, its collectives, the resharding and weight
    /// gathers feeding it), s: what recomputing the plan's layers adds to the backward pass.
    pub forward: f64,
    /// Bytes per device per micro-batch that the layers keep instead of their activations
    /// when they are recomputed: the tensors entering each layer, as the plan shards them.
    pub checkpoint: f64,
    /// The largest single layer's activations per micro-batch, bytes: live while that layer
    /// is recomputed.
    pub peak_layer: f64,
    /// Per-step terms (gradient synchronisation, optimizer, updated-weight gathers), s per
    /// step: the cost holds them divided by the micro-batches.
    pub step: f64,
    /// Of `step`, the collectives (gradient synchronisation and updated-weight gathers), s.
    pub sync: f64,
    /// Of the memory, the backward pass's largest transient, bytes
    /// ([`crate::solve::intra::stage::StageMemory::working`]): the largest of the layers'.
    #[serde(default)]
    pub working: f64,
}

impl Entry {
    /// No plan.
    pub const NONE: Entry = Entry {
        cost: f64::INFINITY,
        memory: f64::INFINITY,
        activations: f64::INFINITY,
        forward: f64::INFINITY,
        checkpoint: f64::INFINITY,
        peak_layer: f64::INFINITY,
        step: f64::INFINITY,
        sync: f64::INFINITY,
        working: f64::INFINITY,
    };

    /// Nothing: the start of a sum.
    pub const ZERO: Entry = Entry {
        cost: 0.0,
        memory: 0.0,
        activations: 0.0,
        forward: 0.0,
        checkpoint: 0.0,
        peak_layer: 0.0,
        step: 0.0,
        sync: 0.0,
        working: 0.0,
    };

    /// Both together (two parts of one plan): what they hold adds up, the larger transient
    /// stays.
    pub fn plus(self, o: Entry) -> Entry {
        if !(self.cost.is_finite() && o.cost.is_finite()) {
            return Entry::NONE;
        }
        Entry {
            cost: self.cost + o.cost,
            memory: self.memory + o.memory - self.working.min(o.working),
            activations: self.activations + o.activations,
            forward: self.forward + o.forward,
            checkpoint: self.checkpoint + o.checkpoint,
            peak_layer: self.peak_layer.max(o.peak_layer),
            step: self.step + o.step,
            sync: self.sync + o.sync,
            working: self.working.max(o.working),
        }
    }

    /// The same plan with every layer recomputed: each micro-batch in flight keeps only the
    /// layers' inputs, the backward pass runs the forward again, and the layer being
    /// recomputed holds its activations meanwhile.
    pub fn recomputed(self) -> Entry {
        if !self.cost.is_finite() {
            return Entry::NONE;
        }
        Entry {
            cost: self.cost + self.forward,
            memory: self.memory - self.activations + self.checkpoint + self.peak_layer,
            activations: self.checkpoint,
            ..self
        }
    }

    /// The cheaper, ties to less memory.
    pub fn min(self, o: Entry) -> Entry {
        if cheaper(o.cost, o.memory, self.cost, self.memory) {
            o
        } else {
            self
        }
    }

    /// Memory with `inflight` micro-batches in flight instead of the options' `built_with`.
    pub fn memory_at(&self, inflight: u64, built_with: u64) -> f64 {
        self.memory + (inflight as f64 - built_with as f64) * self.activations
    }
}

impl LayerTable {
    /// Index of the pair (`b`, `a`).
    fn at(&self, b: usize, a: usize) -> usize {
        b * self.after.len() + a
    }

    /// The entry of the pair (`b`, `a`) of boundary states.
    pub fn entry(&self, b: usize, a: usize) -> Entry {
        self.entries[self.at(b, a)]
    }
}

/// Which layer makes each tensor and which layers read it: what decides the tensors crossing
/// each boundary between layers. Computed once per graph ([`Crossings::of`]) and shared by
/// its layers' tables.
pub struct Crossings {
    maker: HashMap<TensorId, usize>,
    readers: HashMap<TensorId, BTreeSet<usize>>,
    /// Per layer `l`, the tensors crossing between layers `l` and `l + 1`, in id order:
    /// found in one pass over the tensors, so that a deep graph's boundaries cost time linear
    /// in its size, not in its size times its layers.
    boundaries: Vec<Vec<TensorId>>,
}

impl Crossings {
    /// The crossings of `graph`'s layers.
    pub fn of(graph: &Graph) -> Crossings {
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
        // A tensor crosses a boundary when the layer on one side makes it and the layer on the
        // other reads it.
        let mut boundaries: Vec<Vec<TensorId>> = vec![Vec::new(); graph.layers.len()];
        for (t, r) in &readers {
            let Some(&m) = maker.get(t) else { continue };
            if r.contains(&(m + 1)) {
                boundaries[m].push(*t);
            }
            if m > 0 && r.contains(&(m - 1)) {
                boundaries[m - 1].push(*t);
            }
        }
        for b in &mut boundaries {
            b.sort_unstable();
        }
        Crossings {
            maker,
            readers,
            boundaries,
        }
    }

    /// Tensors crossing between layers `l` and `l + 1`, in id order.
    fn boundary(&self, l: usize) -> Vec<TensorId> {
        self.boundaries.get(l).cloned().unwrap_or_default()
    }

    /// Tensors crossing layer `l`'s edges: with layer `l - 1` (none for the first layer),
    /// then with layer `l + 1`.
    fn edges(&self, l: usize) -> (Vec<TensorId>, Vec<TensorId>) {
        let before = match l {
            0 => Vec::new(),
            _ => self.boundary(l - 1),
        };
        (before, self.boundary(l))
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

/// Per layer: the shapes of the tensors crossing its edges (before, then after), which with
/// its canonical form decide its tables.
pub fn crossing_shapes(graph: &Graph) -> Vec<Vec<Vec<u64>>> {
    let crossings = Crossings::of(graph);
    let boundaries: Vec<Vec<TensorId>> = (0..graph.layers.len())
        .map(|l| crossings.boundary(l))
        .collect();
    (0..graph.layers.len())
        .map(|l| {
            let before = l
                .checked_sub(1)
                .map(|p| boundaries[p].as_slice())
                .unwrap_or(&[]);
            before
                .iter()
                .chain(&boundaries[l])
                .map(|&t| graph.tensor(t).shape.clone())
                .collect()
        })
        .collect()
}

/// Per boundary between layers `l` and `l + 1`: the bytes of the tensors crossing it forward
/// (made by `l`, read by `l + 1`: the activation) and backward (made by `l + 1`, read by `l`:
/// its gradient), whole (unsharded).
pub fn boundary_bytes(graph: &Graph) -> Vec<[f64; 2]> {
    let crossings = Crossings::of(graph);
    (0..graph.layers.len().saturating_sub(1))
        .map(|l| {
            let mut out = [0.0; 2];
            for t in crossings.boundary(l) {
                let dir = usize::from(crossings.maker.get(&t) != Some(&l));
                out[dir] += graph.tensor(t).bytes() as f64;
            }
            out
        })
        .collect()
}

/// Solves layer `layer` of `graph` on `mesh` for every choice of its boundary specs.
pub fn layer_table(
    graph: &Graph,
    layer: usize,
    mesh: Mesh,
    device: &Device,
    opts: StageOptions,
) -> Result<LayerTable, ChainError> {
    layer_table_with(graph, &Crossings::of(graph), layer, mesh, device, opts)
}

/// [`layer_table`] with `graph`'s crossings computed already (a single layer is always a
/// chain: nothing to check). The options' solver fills it: the exact elimination
/// ([`SolverChoice::Exact`]; [`SolverChoice::Ilp`] too, since a chain's tables are
/// eliminations), or D-Rec (`drec::table`, [`SolverChoice::Drec`]), whose entries are not
/// proven optimal. [`SolverChoice::Auto`] eliminates unless the layer's problem is larger than
/// [`super::stage::AUTO_DREC_VARIABLES`] or its factors exceed `max_exact_entries`, and uses D-Rec then.
pub fn layer_table_with(
    graph: &Graph,
    crossings: &Crossings,
    layer: usize,
    mesh: Mesh,
    device: &Device,
    opts: StageOptions,
) -> Result<LayerTable, ChainError> {
    let bounded = Bounded::new(graph, crossings, layer, mesh, device, opts)?;
    let drec = || drec::table(graph, &bounded);
    match opts.solver {
        _ if bounded.model.drec_first() => drec(),
        SolverChoice::Auto => match exact_table(&bounded) {
            Err(ChainError::TooWide(_) | ChainError::TooMuchWork { .. }) => drec(),
            other => other,
        },
        SolverChoice::Exact | SolverChoice::Ilp | SolverChoice::Drec => exact_table(&bounded),
    }
}

/// A layer's problem with one variable holding the spec of every tensor crossing its edges,
/// and what reading an entry's plan needs.
struct Bounded<'g> {
    /// The layer's own problem.
    model: StageModel<'g>,
    /// The layer.
    layer: usize,
    /// Largest factor the exact elimination may build.
    max_entries: f64,
    /// Most additions the exact elimination may plan.
    max_work: f64,
    /// The layer's problem with one more variable per spec of each crossing tensor the layer
    /// makes (a projection of its producer's strategy).
    p: Problem,
    /// Tensors crossing the edge with the previous layer, in id order.
    before: Vec<TensorId>,
    /// Tensors crossing the edge with the next layer, in id order.
    after: Vec<TensorId>,
    /// The variables holding the boundary specs, one slot each.
    keep: Vec<usize>,
    /// Per crossing tensor (`before`, then `after`): its slot and the spec each strategy of
    /// the slot's variable gives it.
    spec_of: Vec<(usize, Vec<Spec>)>,
    /// Per crossing tensor (`before`, then `after`): the variable of the layer's own problem
    /// that decides its spec (its producer's, or its own when it enters) and the spec each
    /// strategy of that variable gives it.
    deciding: Vec<(usize, Vec<Spec>)>,
    /// Per variable, per strategy: activations saved per micro-batch, bytes.
    activations: Vec<Vec<f64>>,
    /// Per variable, per strategy: the backward transient, bytes.
    working: Vec<Vec<f64>>,
    /// The forward pass's terms of the layer's problem.
    forward: Problem,
    /// The per-step terms, and of them the collectives.
    step: [Problem; 2],
    /// Per tensor entering the layer forward: its variable and its bytes per device per
    /// strategy.
    entering: Vec<(usize, Vec<f64>)>,
}

impl<'g> Bounded<'g> {
    fn new(
        graph: &'g Graph,
        crossings: &Crossings,
        layer: usize,
        mesh: Mesh,
        device: &Device,
        opts: StageOptions<'g>,
    ) -> Result<Self, ChainError> {
        let model = StageModel::build(graph, layer..layer + 1, mesh, device, opts)?;
        let (before, after) = crossings.edges(layer);
        // Each crossing tensor's spec gets a variable over its distinct specs: the variable
        // of a tensor entering the layer is one already; a tensor the layer makes gets a new
        // one, joined to its producer's strategy by an edge that allows only the spec that
        // strategy makes (an exact projection: the elimination never picks an infinite entry
        // when a finite one exists, and every producer strategy has one).
        let mut p: Problem = model.problem().clone();
        let mut keep: Vec<usize> = Vec::new();
        let mut spec_of: Vec<(usize, Vec<Spec>)> = Vec::new();
        let deciding: Vec<(usize, Vec<Spec>)> = before
            .iter()
            .chain(&after)
            .map(|&t| model.spec_variable(t))
            .collect::<Option<_>>()
            .ok_or(ChainError::Mismatch(layer, layer))?;
        for (&t, (var, specs)) in before.iter().chain(&after).zip(&deciding) {
            let (var, specs) = (*var, specs.clone());
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
        // The tensors entering the layer forward (a boundary also carries the gradients the
        // layer sends back, which it makes).
        let entering = before
            .iter()
            .zip(&deciding)
            .filter(|&(&t, _)| !model.makes(t))
            .map(|(&t, (var, specs))| {
                let bytes = graph.tensor(t).bytes() as f64;
                let per_spec = specs
                    .iter()
                    .map(|s| bytes / s.tiles(&mesh) as f64)
                    .collect();
                (*var, per_spec)
            })
            .collect();
        Ok(Bounded {
            activations: model.activation_memory(),
            working: model.working_memory(),
            forward: model.forward_problem(),
            step: model.step_problems(),
            model,
            layer,
            max_entries: opts.max_exact_entries,
            max_work: opts.max_table_work,
            p,
            before,
            after,
            keep,
            spec_of,
            deciding,
            entering,
        })
    }

    /// The entry of the plan `choice` (a strategy per variable of `p`): cost, memory,
    /// activations, forward time and the bytes of the tensors entering the layer.
    fn read(&self, choice: &[usize]) -> Entry {
        let (cost, held) = self.p.evaluate(choice);
        let working = self
            .working
            .iter()
            .zip(choice)
            .map(|(per, &c)| per[c])
            .fold(0.0, f64::max);
        let activations = self
            .activations
            .iter()
            .zip(choice)
            .map(|(per, &c)| per[c])
            .sum();
        let own = &choice[..self.forward.vars.len()];
        let [step, sync] = &self.step;
        Entry {
            cost,
            memory: held + working,
            activations,
            forward: self.forward.evaluate(own).0,
            checkpoint: self.entering.iter().map(|(v, per)| per[choice[*v]]).sum(),
            peak_layer: activations,
            step: step.evaluate(own).0,
            sync: sync.evaluate(own).0,
            working,
        }
    }

    /// Per slot, whether its variable is the layer's own (a tensor entering the layer)
    /// rather than a projection of a tensor it makes.
    fn entering_slots(&self) -> Vec<bool> {
        let own = self.model.problem().vars.len();
        self.keep.iter().map(|&v| v < own).collect()
    }
}

/// Boundary states met while filling a table, numbered in order of first appearance.
#[derive(Default)]
struct States {
    before: HashMap<Vec<Spec>, usize>,
    after: HashMap<Vec<Spec>, usize>,
}

impl States {
    /// The number of `state` on one side, given a new one when first met.
    fn index(side: &mut HashMap<Vec<Spec>, usize>, state: Vec<Spec>) -> usize {
        let n = side.len();
        *side.entry(state).or_insert(n)
    }

    /// The table of `cells` ((before, after) state numbers, entry, and the plan reaching it
    /// for a D-Rec table), keeping the least entry of each pair.
    fn into_table(
        self,
        layer: usize,
        (solves, work): (usize, f64),
        solver: TableSolver,
        cells: Vec<(usize, usize, Entry, Option<Vec<u32>>)>,
    ) -> LayerTable {
        let ordered = |index: HashMap<Vec<Spec>, usize>| -> Vec<Vec<Spec>> {
            let mut v: Vec<(Vec<Spec>, usize)> = index.into_iter().collect();
            v.sort_unstable_by_key(|(_, i)| *i);
            v.into_iter().map(|(s, _)| s).collect()
        };
        let mut t = LayerTable {
            layer,
            before: ordered(self.before),
            after: ordered(self.after),
            entries: Vec::new(),
            solves,
            work,
            solver,
            plans: Vec::new(),
            warnings: Vec::new(),
        };
        t.entries = vec![Entry::NONE; t.before.len() * t.after.len()];
        let mut plans: HashMap<usize, Vec<u32>> = HashMap::new();
        for (b, a, e, plan) in cells {
            let i = t.at(b, a);
            if (e.cost, e.memory) < (t.entries[i].cost, t.entries[i].memory) {
                t.entries[i] = e;
                if let Some(plan) = plan {
                    plans.insert(i, plan);
                }
            }
        }
        t.plans = plans.into_iter().collect();
        t.plans.sort_unstable_by_key(|(i, _)| *i);
        t
    }
}

/// The layer's table by the exact elimination: every entry the least cost of its pair of
/// boundary states.
fn exact_table(b: &Bounded) -> Result<LayerTable, ChainError> {
    // Dropping dominated strategies of the other variables keeps every entry of the table.
    let (reduced, maps) = b.p.without_dominated_except(&b.keep);
    let Filled {
        k,
        values,
        solves,
        work,
    } = fill(
        &reduced,
        &maps,
        &b.keep,
        &b.entering_slots(),
        [b.max_entries, b.max_work],
        |choice| b.read(choice),
    )?;
    let spec_of = &b.spec_of;
    let nb = b.before.len();
    let mut states = States::default();
    // Each side's state is a function of the kept values of its slots: looked up once per
    // distinct combination of those (hundreds), not once per entry (tens of thousands).
    let mut memo: [HashMap<usize, usize>; 2] = Default::default();
    let mut cells = Vec::with_capacity(values.len());
    let mut joint = vec![0usize; b.keep.len()];
    for value in values {
        let mut side = |i: usize, range: Range<usize>, index: &mut HashMap<Vec<Spec>, usize>| {
            let code = spec_of[range.clone()]
                .iter()
                .try_fold(0usize, |c, (slot, _)| {
                    c.checked_mul(k[*slot])?.checked_add(joint[*slot])
                });
            if let Some(found) = code.and_then(|c| memo[i].get(&c)) {
                return *found;
            }
            let state: Vec<Spec> = spec_of[range]
                .iter()
                .map(|(slot, specs)| specs[joint[*slot]].clone())
                .collect();
            let at = States::index(index, state);
            if let Some(c) = code {
                memo[i].insert(c, at);
            }
            at
        };
        let before = side(0, 0..nb, &mut states.before);
        let after = side(1, nb..spec_of.len(), &mut states.after);
        cells.push((before, after, value, None));
        for i in (0..joint.len()).rev() {
            joint[i] += 1;
            if joint[i] < k[i] {
                break;
            }
            joint[i] = 0;
        }
    }
    let work = ENTRY_WORK * b.p.entries() + work;
    Ok(states.into_table(b.layer, (solves, work), TableSolver::Exact, cells))
}

/// Most work ([`LayerTable::work`]) the layer tables of one pipeline search (one micro-batch
/// size of a target) may take together before that search stops and says so, and so the most
/// one table's exact elimination may plan (under [`SolverChoice::Auto`] D-Rec fills a table
/// past it): about ten seconds of one core (a unit is a few nanoseconds). The default
/// workspace's largest search (LLaMA-2 70B on 8 H100s, 186 tables) takes 2.3e9 at each
/// micro-batch size. Whether a search stops depends on the tables' total alone (each table's
/// work is part of its cached result), never on timing or on what the cache holds.
pub const MAX_TABLE_WORK: f64 = 5e9;

/// Work units of one cost entry of a layer's problem, built or read by D-Rec: pricing an
/// entry (a strategy's kernels, a resharding's collectives) takes about as long as twenty of
/// the elimination's additions (measured on this project's 2-core machines: tables of 1D
/// meshes and D-Rec tables, made of little else, took 9 to 40 ns per entry, an elimination
/// about 1 ns per addition).
const ENTRY_WORK: f64 = 20.0;

/// Additions below which one elimination fills a table without comparing it with pinning
/// (about a millisecond).
const SMALL_WORK: f64 = 1e6;

/// The table of `p` (already reduced; `maps` takes its strategy indices back to the
/// unreduced problem's) over `keep`, each entry's plan read by `read` in unreduced indices.
/// Either one elimination keeping every boundary variable, or one per joint choice of the
/// kept variables marked `entering` (keeping the entering specs through the whole
/// elimination multiplies its factors by their domains, since the backward pass reads the
/// layer's input again; pinned, each elimination is small but every one repeats the buckets
/// that never see them). Whichever runs fewer additions ([`exact::Size::work`]) among those
/// that store at most `max_entries`: on 2D meshes the single elimination is usually tens of
/// times less work.
fn fill<T: Send>(
    p: &Problem,
    maps: &[Vec<usize>],
    keep: &[usize],
    entering: &[bool],
    [max_entries, max_work]: [f64; 2],
    read: impl Fn(&[usize]) -> T + Sync,
) -> Result<Filled<T>, ChainError> {
    // Reads an entry's plan in unreduced indices, through a buffer each elimination reuses.
    let back = |choice: &[usize], domains: Option<&[Vec<usize>]>, buf: &mut Vec<usize>| -> T {
        buf.clear();
        buf.extend(
            choice
                .iter()
                .enumerate()
                .map(|(v, &c)| maps[v][domains.map_or(c, |d| d[v][c])]),
        );
        read(buf)
    };
    let k: Vec<usize> = keep.iter().map(|&v| p.k(v)).collect();
    let slots: Vec<usize> = (0..keep.len()).filter(|&i| entering[i]).collect();
    let pin_count: f64 = slots.iter().map(|&i| k[i] as f64).product();
    let one_pin = |fixed: &[usize]| -> Vec<Vec<usize>> {
        let mut domains: Vec<Vec<usize>> =
            (0..p.vars.len()).map(|v| (0..p.k(v)).collect()).collect();
        for (&i, &c) in slots.iter().zip(fixed) {
            domains[keep[i]] = vec![c];
        }
        domains
    };
    // Every pin has the same shape (each entering domain cut to one value), so one sizes all;
    // a small single elimination is not worth sizing the alternative.
    let whole = Planned::keeping(p, keep);
    let first_pin = p.restricted(&one_pin(&vec![0; slots.len()]));
    let mut pinned: Option<Planned> = None;
    let one_shot = slots.is_empty() || whole.size().work <= SMALL_WORK || {
        let pin = pinned.insert(Planned::keeping(&first_pin, keep));
        whole.size().work <= pin_count * pin.size().work || pin.size().stored > max_entries
    };
    let too_much = |work: f64| ChainError::TooMuchWork {
        work,
        max: max_work,
    };
    // Pinning is the only alternative, and is at least as much work unless the single
    // elimination cannot be stored.
    if one_shot && whole.size().work > max_work && slots.is_empty() {
        return Err(too_much(whole.size().work));
    }
    if one_shot && whole.size().work <= max_work {
        let mut buf = Vec::new();
        match exact::marginal_planned(p, &whole, keep, max_entries, |c| back(c, None, &mut buf)) {
            Ok((k, values)) => {
                return Ok(Filled {
                    k,
                    values,
                    solves: 1,
                    work: whole.size().work,
                });
            }
            Err(Declined::TooWide(_)) if !slots.is_empty() => {}
            Err(e) => return Err(ChainError::TooWide(e)),
        }
    }
    // Every joint choice of the entering specs, each its own elimination (in parallel).
    let mut pins: Vec<Vec<usize>> = vec![Vec::new()];
    for &i in &slots {
        pins = pins
            .into_iter()
            .flat_map(|pin| {
                (0..k[i]).map(move |c| {
                    let mut next = pin.clone();
                    next.push(c);
                    next
                })
            })
            .collect();
    }
    // Every pin has the same shape: one plan serves them all.
    let pinned = pinned.unwrap_or_else(|| Planned::keeping(&first_pin, keep));
    let work = pin_count * pinned.size().work;
    if work > max_work {
        return Err(too_much(work));
    }
    let solved: Vec<(Vec<usize>, Vec<T>)> = pins
        .into_par_iter()
        .map(|fixed| {
            let domains = one_pin(&fixed);
            let mut buf = Vec::new();
            let (_, values) =
                exact::marginal_planned(&p.restricted(&domains), &pinned, keep, max_entries, |c| {
                    back(c, Some(&domains), &mut buf)
                })
                .map_err(ChainError::TooWide)?;
            Ok((fixed, values))
        })
        .collect::<Result<_, ChainError>>()?;
    let solves = solved.len();
    let mut cells: Vec<Option<T>> = (0..k.iter().product()).map(|_| None).collect();
    for (fixed, values) in solved {
        // Entry `e` of this elimination sets the free slots; the pinned ones are `fixed`.
        let mut joint = vec![0usize; keep.len()];
        for (&i, &c) in slots.iter().zip(&fixed) {
            joint[i] = c;
        }
        for value in values {
            let at = joint.iter().zip(&k).fold(0, |idx, (&c, &kk)| idx * kk + c);
            cells[at] = Some(value);
            for i in (0..keep.len()).rev().filter(|&i| !entering[i]) {
                joint[i] += 1;
                if joint[i] < k[i] {
                    break;
                }
                joint[i] = 0;
            }
        }
    }
    let values = cells
        .into_iter()
        .collect::<Option<Vec<T>>>()
        .ok_or(ChainError::Mismatch(0, 0))?;
    Ok(Filled {
        k,
        values,
        solves,
        work,
    })
}

/// A table [`fill`] filled.
struct Filled<T> {
    /// The kept variables' domain sizes.
    k: Vec<usize>,
    /// The entries, row-major.
    values: Vec<T>,
    /// Eliminations run.
    solves: usize,
    /// Their additions ([`exact::Size::work`]).
    work: f64,
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
        .map(|l| layer_table_with(graph, &crossings, l, mesh, device, opts))
        .collect()
}

/// The least cost of the range whose layer tables are `tables`, in order: a shortest path
/// over boundary states, free at both ends.
pub fn compose(tables: &[LayerTable]) -> Result<Entry, ChainError> {
    let tables: Vec<&LayerTable> = tables.iter().collect();
    Ok(best_path(&tables)?.map_or(Entry::NONE, |(e, _)| e))
}

/// Best entry per state after the range's first layer `t` (free before it).
pub fn start(t: &LayerTable) -> Vec<Entry> {
    // Row by row (the entries' order), comparing cost and memory alone: per state after, the
    // cheapest state before in index order, as a fold of `Entry::min` over each column.
    let width = t.after.len();
    let none = [Entry::NONE.cost, Entry::NONE.memory];
    let mut cheapest = vec![none; width];
    let mut from = vec![None::<usize>; width];
    for (b, row) in t.entries.chunks_exact(width.max(1)).enumerate() {
        for ((e, best), at) in row.iter().zip(&mut cheapest).zip(&mut from) {
            if cheaper(e.cost, e.memory, best[0], best[1]) {
                *best = [e.cost, e.memory];
                *at = Some(b);
            }
        }
    }
    from.iter()
        .enumerate()
        .map(|(a, b)| b.map_or(Entry::NONE, |b| t.entry(b, a)))
        .collect()
}

/// For each state after `prev`, its index among the states before `next`, or `usize::MAX`
/// for a state `next` cannot be in: a spec of a gradient that `next` makes and no strategy
/// of its producer writes (an opaque op's, which is never split inside). `None` when the two
/// tables do not meet on the same boundary (no state after `prev` is one before `next`).
/// A D-Rec table has only the states its plans reach after the layer, and every state it was
/// pinned to before it.
pub fn link(prev: &LayerTable, next: &LayerTable) -> Option<Vec<usize>> {
    let index: HashMap<&Vec<Spec>, usize> = next
        .before
        .iter()
        .enumerate()
        .map(|(i, s)| (s, i))
        .collect();
    let link: Vec<usize> = prev
        .after
        .iter()
        .map(|s| index.get(s).copied().unwrap_or(usize::MAX))
        .collect();
    (prev.after.is_empty() || link.iter().any(|&b| b != usize::MAX)).then_some(link)
}

/// A table's cost and memory per entry, each row-major like its entries: what chaining
/// compares ([`extend_linked`] reads two contiguous rows of numbers instead of whole entries).
#[derive(Clone, Debug)]
pub struct Ranking {
    cost: Vec<f64>,
    memory: Vec<f64>,
}

/// The [`Ranking`] of `t`'s entries.
pub fn ranking(t: &LayerTable) -> Ranking {
    Ranking {
        cost: t.entries.iter().map(|e| e.cost).collect(),
        memory: t.entries.iter().map(|e| e.memory).collect(),
    }
}

/// One chaining step's results, in buffers the next step reuses ([`extend_linked`]).
#[derive(Clone, Debug, Default)]
pub struct Extension {
    /// Best entry per state after the layer.
    pub best: Vec<Entry>,
    /// Per state after the layer, the index in the previous `best` of the state its path
    /// comes from (`usize::MAX` when none).
    pub from: Vec<usize>,
    /// The cheapest sum and its memory per state, while comparing.
    cost: Vec<f64>,
    memory: Vec<f64>,
}

/// Best entry per state after `next` (whose [`ranking`] is `next_rank`), given `best` per
/// state after the table before it, whose states [`link`] matched to `next`'s: the cheapest
/// sum, ties to less memory, then to the earlier state. Written to `out.best`, with each
/// entry's predecessor in `out.from`.
pub fn extend_linked(
    best: &[Entry],
    link: &[usize],
    next: &LayerTable,
    next_rank: &Ranking,
    out: &mut Extension,
) {
    let width = next.after.len();
    let reset = |v: &mut Vec<f64>| {
        v.clear();
        v.resize(width, f64::INFINITY);
    };
    reset(&mut out.cost);
    reset(&mut out.memory);
    out.from.clear();
    out.from.resize(width, usize::MAX);
    for (p, (&b, e)) in link.iter().zip(best).enumerate() {
        if !e.cost.is_finite() || b == usize::MAX {
            continue;
        }
        let row = b * width..(b + 1) * width;
        let slots = out
            .cost
            .iter_mut()
            .zip(out.memory.iter_mut())
            .zip(out.from.iter_mut());
        let candidates = next_rank.cost[row.clone()]
            .iter()
            .zip(&next_rank.memory[row]);
        // Predecessors come in index order, so a strict improvement keeps ties with the
        // earlier state.
        for (((c, m), at), (&nc, &nm)) in slots.zip(candidates) {
            let (sum, mem) = (e.cost + nc, e.memory + nm);
            if sum < *c || (sum == *c && mem < *m) {
                (*c, *m, *at) = (sum, mem, p);
            }
        }
    }
    // Only the winners' entries are summed whole.
    extend_along(best, &out.from, link, next, &mut out.best);
}

/// Best entry per state after `next`, written to `out`, when the path to each state `a` comes
/// from state `from[a]` of `best` ([`extend_linked`]'s choice, or a [`steady`] chain's
/// repeated one).
pub fn extend_along(
    best: &[Entry],
    from: &[usize],
    link: &[usize],
    next: &LayerTable,
    out: &mut Vec<Entry>,
) {
    let width = next.after.len();
    out.clear();
    out.extend(from.iter().enumerate().map(|(a, &p)| match p {
        usize::MAX => Entry::NONE,
        p if link[p] == usize::MAX => Entry::NONE,
        p => best[p].plus(next.entries[link[p] * width + a]),
    }));
}

/// Relative difference under which two increments of a chain count as equal in [`steady`]:
/// well above the rounding of the sums compared (about 1e-16 of each), far below any
/// difference the cost model resolves.
const STEADY_TOLERANCE: f64 = 1e-12;

/// Whether `best`, extended from `prev` by a table that links a layer to another of the same
/// class, is the chain's steady state: the same states have a path, and every path grew by
/// the same cost and the same memory. Then extending by that table again chooses the same
/// predecessors ([`extend_linked`]'s comparisons all shift by the same amounts), and so does
/// every further extension: the chain of identical blocks continues with [`extend_along`]
/// in time linear in the states instead of quadratic. A min-plus product's powers reach such
/// a state after a few steps when one boundary state is the cheapest to repeat; a chain
/// that never does is extended in full.
pub fn steady(prev: &[Entry], best: &[Entry]) -> bool {
    if prev.len() != best.len() {
        return false;
    }
    let mut first: Option<(f64, f64)> = None;
    let mut scale = (0.0f64, 0.0f64);
    let mut spread = (0.0f64, 0.0f64);
    for (p, b) in prev.iter().zip(best) {
        match (p.cost.is_finite(), b.cost.is_finite()) {
            (false, false) => continue,
            (true, true) => {}
            _ => return false,
        }
        let grew = (b.cost - p.cost, b.memory - p.memory);
        scale = (scale.0.max(b.cost.abs()), scale.1.max(b.memory.abs()));
        let (c, m) = *first.get_or_insert(grew);
        spread = (
            spread.0.max((grew.0 - c).abs()),
            spread.1.max((grew.1 - m).abs()),
        );
    }
    first.is_some()
        && spread.0 <= STEADY_TOLERANCE * scale.0
        && spread.1 <= STEADY_TOLERANCE * scale.1
}

/// Whether (`cost`, `memory`) is cheaper than (`than_cost`, `than_memory`), ties to less
/// memory (never when a number is NaN): the order of [`Entry::min`], and of the chains'
/// comparisons on the two numbers alone.
fn cheaper(cost: f64, memory: f64, than_cost: f64, than_memory: f64) -> bool {
    cost < than_cost || (cost == than_cost && memory < than_memory)
}

/// The range's best entry (free after its last layer), then its best with every layer
/// recomputed: the cheapest of its plans best without recomputation, each recomputed. The
/// states are compared on cost and memory alone (as [`Entry::recomputed`] makes them, for the
/// second) and only the winners' entries are copied: every state of every range of every
/// mesh choice passes through here.
pub fn finish(best: &[Entry]) -> [Entry; 2] {
    let (mut plain, mut recomputed) = (None::<usize>, None::<usize>);
    let none = [Entry::NONE.cost, Entry::NONE.memory];
    let (mut plain_at, mut recomputed_at) = (none, none);
    for (i, e) in best.iter().enumerate() {
        if cheaper(e.cost, e.memory, plain_at[0], plain_at[1]) {
            plain_at = [e.cost, e.memory];
            plain = Some(i);
        }
        // `Entry::recomputed`'s cost and memory, in its order of operations.
        if e.cost.is_finite() {
            let cost = e.cost + e.forward;
            let memory = e.memory - e.activations + e.checkpoint + e.peak_layer;
            if cheaper(cost, memory, recomputed_at[0], recomputed_at[1]) {
                recomputed_at = [cost, memory];
                recomputed = Some(i);
            }
        }
    }
    [
        plain.map_or(Entry::NONE, |i| best[i]),
        recomputed.map_or(Entry::NONE, |i| best[i].recomputed()),
    ]
}

/// A path through a range's tables: its entry and, per layer, its `before` and `after` state
/// indices.
pub type Path = (Entry, Vec<[usize; 2]>);

/// The cheapest path through `tables` (consecutive layers), free at both ends: its entry and,
/// per layer, the indices of its `before` and `after` states on the path. `None` when no
/// path has a finite cost.
pub fn best_path(tables: &[&LayerTable]) -> Result<Option<Path>, ChainError> {
    best_path_ending(tables, |e| e)
}

/// [`best_path`] with the last state chosen by `ending` of its entry (e.g. the entry
/// recomputed, as [`finish`] chooses its second); the entry returned is the path's own.
pub fn best_path_ending(
    tables: &[&LayerTable],
    ending: impl Fn(Entry) -> Entry,
) -> Result<Option<Path>, ChainError> {
    let Some(first) = tables.first() else {
        return Ok(Some((Entry::ZERO, Vec::new())));
    };
    let better = |a: &Entry, b: &Entry| cheaper(a.cost, a.memory, b.cost, b.memory);
    // Per layer and state after it: the best entry and the state before it on that path.
    let mut best = vec![Entry::NONE; first.after.len()];
    let mut back: Vec<Vec<usize>> = vec![vec![0; first.after.len()]];
    for (a, slot) in best.iter_mut().enumerate() {
        for b in 0..first.before.len() {
            let e = first.entries[first.at(b, a)];
            if better(&e, slot) {
                *slot = e;
                back[0][a] = b;
            }
        }
    }
    for (i, pair) in tables.windows(2).enumerate() {
        let (prev, next) = (pair[0], pair[1]);
        let link = link(prev, next).ok_or(ChainError::Mismatch(i, i + 1))?;
        let width = next.after.len();
        // The sums' cost and memory as `Entry::plus` makes them, compared before any entry
        // is summed whole; then only each state's winner is.
        // A state no sum reached keeps `none`: any sum that wins is cheaper, so differs.
        let none = [Entry::NONE.cost, Entry::NONE.memory];
        let mut sums = vec![none; width];
        let mut from = vec![0; width];
        for (p, (&b, e)) in link.iter().zip(&best).enumerate() {
            if !e.cost.is_finite() || b == usize::MAX {
                continue;
            }
            let row = &next.entries[b * width..(b + 1) * width];
            for (a, n) in row.iter().enumerate() {
                if !n.cost.is_finite() {
                    continue;
                }
                let cost = e.cost + n.cost;
                let memory = e.memory + n.memory - e.working.min(n.working);
                if cheaper(cost, memory, sums[a][0], sums[a][1]) {
                    sums[a] = [cost, memory];
                    from[a] = p;
                }
            }
        }
        best = (0..width)
            .map(|a| match sums[a] == none {
                true => Entry::NONE,
                false => best[from[a]].plus(next.entries[link[from[a]] * width + a]),
            })
            .collect();
        back.push(from);
    }
    let Some((mut a, total)) = best
        .iter()
        .copied()
        .enumerate()
        .filter(|(_, e)| e.cost.is_finite())
        .fold(None, |acc: Option<(usize, Entry)>, (a, e)| match acc {
            Some((_, b)) if !better(&ending(e), &ending(b)) => acc,
            _ => Some((a, e)),
        })
    else {
        return Ok(None);
    };
    let mut states = vec![[0usize; 2]; tables.len()];
    for l in (0..tables.len()).rev() {
        let p = back[l][a];
        if l == 0 {
            states[0] = [p, a];
        } else {
            let link = link(tables[l - 1], tables[l]).ok_or(ChainError::Mismatch(l - 1, l))?;
            states[l] = [link[p], a];
            a = p;
        }
    }
    Ok(Some((total, states)))
}

/// The plan of layers `layers` of `graph` on `mesh` that reaches the chain's optimum over
/// their `tables`: each layer solved again with its boundary specs pinned to the `states` of
/// the cheapest path ([`best_path`]), the layers' plans joined. Its objective is the
/// chain's, which is the whole range's optimum. A weight two layers of the range share
/// (GPT-2's tied embedding) is decoded as two copies, as the chain prices it.
pub fn decode_range(
    graph: &Graph,
    layers: Range<usize>,
    mesh: Mesh,
    device: &Device,
    opts: StageOptions,
    tables: &[&LayerTable],
    states: &[[usize; 2]],
) -> Result<StagePlan, ChainError> {
    let crossings = Crossings::of(graph);
    // Layers with one table (one class) pinned to the same states have the same plan: each
    // is solved once and renamed for the others.
    let mut solved: HashMap<(*const LayerTable, [usize; 2]), (usize, StagePlan)> = HashMap::new();
    let mut plans = Vec::with_capacity(layers.len());
    for (l, (table, &state)) in layers.clone().zip(tables.iter().zip(states)) {
        let key = (*table as *const LayerTable, state);
        if let Some((first, plan)) = solved.get(&key) {
            plans.push(moved(graph, plan.clone(), *first, l));
            continue;
        }
        let plan = decode_layer(graph, &crossings, l, mesh, device, opts, table, state)?;
        solved.insert(key, (l, plan.clone()));
        plans.push(plan);
    }
    StagePlan::join(plans).ok_or(ChainError::Mismatch(layers.start, layers.end))
}

/// Layer `l`'s plan on `mesh` with the specs crossing its boundaries pinned to the states
/// `[b, a]` (`before`, `after` indices) of its `table`: the plan reaching that entry.
#[allow(clippy::too_many_arguments)]
pub fn decode_layer(
    graph: &Graph,
    crossings: &Crossings,
    l: usize,
    mesh: Mesh,
    device: &Device,
    opts: StageOptions,
    table: &LayerTable,
    [b, a]: [usize; 2],
) -> Result<StagePlan, ChainError> {
    let model = StageModel::build(graph, l..l + 1, mesh, device, opts)?;
    if table.solver == TableSolver::Drec {
        // D-Rec's tables keep the plan of every entry.
        let at = table.at(b, a);
        let plan = table
            .plans
            .binary_search_by_key(&at, |(i, _)| *i)
            .map_err(|_| ChainError::Mismatch(l, l))?;
        let choice: Vec<usize> = table.plans[plan].1.iter().map(|&c| c as usize).collect();
        if choice.len() != model.problem().vars.len() {
            return Err(ChainError::Mismatch(l, l));
        }
        return Ok(model.decode_drec(&choice, table.warnings.clone(), 0.0));
    }
    let (before, after) = crossings.edges(l);
    let wanted = table.before.get(b).map_or(&[][..], Vec::as_slice);
    let pins = before
        .iter()
        .zip(wanted)
        .chain(after.iter().zip(&table.after[a]));
    let mut allowed: Vec<Vec<usize>> = model
        .problem()
        .vars
        .iter()
        .map(|v| (0..v.cost.len()).collect())
        .collect();
    for (&t, spec) in pins {
        let (var, specs) = model.spec_variable(t).ok_or(ChainError::Mismatch(l, l))?;
        allowed[var].retain(|&i| specs[i] == *spec);
    }
    Ok(model.solve_within(&allowed)?)
}

/// The hash of the names a plan of layer `l` holds: the layer's, and each of its ops' with
/// the tensors it reads, writes and saves (what a decoded plan names, beyond what the layer's
/// identity, which leaves names out, decides).
pub fn layer_names(graph: &Graph, l: usize) -> crate::canonical::Digest {
    let layer = &graph.layers[l];
    let ops: Vec<(&str, Vec<&str>)> = layer
        .forward
        .iter()
        .chain(&layer.backward)
        .map(|&o| {
            let op = graph.op(o);
            let tensors = op.inputs.iter().chain(&op.outputs).chain(&op.saves);
            let names = tensors.map(|&t| graph.tensor(t).name.as_str()).collect();
            (op.name.as_str(), names)
        })
        .collect();
    crate::canonical::digest(&(l, &layer.name, ops))
}

/// `plan`, solved for layer `first`, as the plan of layer `l` of the same class (renamed
/// unless it is that layer).
pub fn moved(graph: &Graph, plan: StagePlan, first: usize, l: usize) -> StagePlan {
    match first == l {
        true => plan,
        false => plan.renamed(&names_between(graph, first, l), [l, l + 1]),
    }
}

/// The names of layer `from`'s ops and of the tensors they read, write and save, mapped to
/// those of layer `to`, a layer of the same canonical form (the same ops in the same order,
/// each with its tensors in the same places).
pub fn names_between(graph: &Graph, from: usize, to: usize) -> HashMap<String, String> {
    let (a, b) = (&graph.layers[from], &graph.layers[to]);
    let mut names = HashMap::new();
    let ops = a.forward.iter().chain(&a.backward);
    for (&x, &y) in ops.zip(b.forward.iter().chain(&b.backward)) {
        let (x, y) = (graph.op(x), graph.op(y));
        names.insert(x.name.clone(), y.name.clone());
        let tensors = |o: &'_ crate::model::graph::Op| -> Vec<TensorId> {
            o.inputs
                .iter()
                .chain(&o.outputs)
                .chain(&o.saves)
                .copied()
                .collect()
        };
        for (s, t) in tensors(x).into_iter().zip(tensors(y)) {
            names.insert(graph.tensor(s).name.clone(), graph.tensor(t).name.clone());
        }
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::collection::vec;
    use proptest::prelude::*;

    /// Few distinct values and infinities, so that ties and missing plans are common.
    fn value() -> impl Strategy<Value = f64> {
        prop_oneof![9 => (0u8..4).prop_map(f64::from), 1 => Just(f64::INFINITY)]
    }

    fn entry() -> impl Strategy<Value = Entry> {
        proptest::array::uniform9(value()).prop_map(columns::entry)
    }

    /// An entry's fields by bit pattern (a recomputed infinity less an infinity is NaN).
    fn bits(e: &Entry) -> [u64; 9] {
        columns::COLUMNS.map(|field| field(e).to_bits())
    }

    /// A table of `entries` between `before` and `after` distinct states.
    fn table(before: usize, after: usize, entries: Vec<Entry>) -> LayerTable {
        table_from((0..before).collect(), after, entries)
    }

    /// A table of `entries` between the states numbered `before` and `after` states numbered
    /// from 0: a state after a layer links to the state before the next of the same number.
    fn table_from(before: Vec<usize>, after: usize, entries: Vec<Entry>) -> LayerTable {
        let spec = |i: usize| vec![Spec::replicated(i)];
        LayerTable {
            layer: 0,
            before: before.into_iter().map(spec).collect(),
            after: (0..after).map(spec).collect(),
            entries,
            solves: 0,
            work: 0.0,
            solver: TableSolver::Exact,
            plans: Vec::new(),
            warnings: Vec::new(),
        }
    }

    /// [`best_path`] as defined: whole entries summed and compared at every step.
    fn best_path_summing_every_entry(tables: &[&LayerTable]) -> Option<Path> {
        let better = |a: &Entry, b: &Entry| (a.cost, a.memory) < (b.cost, b.memory);
        let first = tables.first()?;
        let mut best = vec![Entry::NONE; first.after.len()];
        let mut back = vec![vec![0; first.after.len()]];
        for (a, slot) in best.iter_mut().enumerate() {
            for b in 0..first.before.len() {
                if better(&first.entry(b, a), slot) {
                    *slot = first.entry(b, a);
                    back[0][a] = b;
                }
            }
        }
        for pair in tables.windows(2) {
            let link = link(pair[0], pair[1])?;
            let mut step = vec![Entry::NONE; pair[1].after.len()];
            let mut from = vec![0; step.len()];
            for (p, (&b, e)) in link.iter().zip(&best).enumerate() {
                if !e.cost.is_finite() || b == usize::MAX {
                    continue;
                }
                for (a, slot) in step.iter_mut().enumerate() {
                    let candidate = e.plus(pair[1].entry(b, a));
                    if better(&candidate, slot) {
                        *slot = candidate;
                        from[a] = p;
                    }
                }
            }
            best = step;
            back.push(from);
        }
        let (mut a, total) = best
            .iter()
            .copied()
            .enumerate()
            .filter(|(_, e)| e.cost.is_finite())
            .fold(None, |acc: Option<(usize, Entry)>, (a, e)| match acc {
                Some((_, b)) if !better(&e, &b) => acc,
                _ => Some((a, e)),
            })?;
        let mut states = vec![[0usize; 2]; tables.len()];
        for l in (0..tables.len()).rev() {
            let p = back[l][a];
            states[l] = match l {
                0 => [p, a],
                _ => [link(tables[l - 1], tables[l])?[p], a],
            };
            a = p;
        }
        Some((total, states))
    }

    /// The states before a layer, as numbers: of the `after` states the layer before leaves,
    /// those `keep` keeps (the first if none), with a state it cannot leave when `extra`, in
    /// the order of `keys`. A state dropped links to none (`usize::MAX` in [`link`]).
    fn linked_before(after: usize, keep: &[bool], extra: bool, keys: &[u32]) -> Vec<usize> {
        let mut ids: Vec<usize> = (0..after).filter(|&i| keep[i]).collect();
        if ids.is_empty() {
            ids.push(0);
        }
        if extra {
            ids.push(after + 7);
        }
        ids.sort_by_key(|&i| keys[i.min(after)]);
        ids
    }

    /// Chains of one to four layers with one to three states at each boundary, where a
    /// layer may take only some of the states the one before leaves, in any order, and
    /// states that one cannot leave.
    fn chain() -> impl Strategy<Value = Vec<LayerTable>> {
        vec(1usize..4, 2..6)
            .prop_flat_map(|widths| {
                let links: Vec<_> = widths[1..widths.len() - 1]
                    .iter()
                    .map(|&w| {
                        (
                            vec(any::<bool>(), w),
                            any::<bool>(),
                            vec(any::<u32>(), w + 1),
                        )
                    })
                    .collect();
                (Just(widths), links)
            })
            .prop_flat_map(|(widths, links)| {
                let mut befores = vec![(0..widths[0]).collect::<Vec<usize>>()];
                for (w, (keep, extra, keys)) in widths[1..].iter().zip(&links) {
                    befores.push(linked_before(*w, keep, *extra, keys));
                }
                befores
                    .into_iter()
                    .zip(&widths[1..])
                    .map(|(before, &after)| {
                        vec(entry(), before.len() * after)
                            .prop_map(move |entries| table_from(before.clone(), after, entries))
                    })
                    .collect::<Vec<_>>()
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1024))]

        /// [`finish`] is the fold of [`Entry::min`] over the states, and over the states
        /// recomputed, bit for bit.
        #[test]
        fn finish_is_the_cheapest_state_plain_and_recomputed(best in vec(entry(), 0..12)) {
            let [plain, recomputed] = finish(&best);
            let fold = |it: &mut dyn Iterator<Item = Entry>| it.fold(Entry::NONE, Entry::min);
            prop_assert_eq!(bits(&plain), bits(&fold(&mut best.iter().copied())));
            prop_assert_eq!(
                bits(&recomputed),
                bits(&fold(&mut best.iter().map(|e| e.recomputed())))
            );
        }

        /// [`start`] is, per state after the layer, the fold of [`Entry::min`] over the
        /// states before it.
        #[test]
        fn start_is_the_cheapest_entry_of_each_column(
            (before, after, entries) in (1usize..5, 0usize..5).prop_flat_map(|(b, a)| {
                (Just(b), Just(a), vec(entry(), b * a))
            })
        ) {
            let t = table(before, after, entries);
            let got: Vec<[u64; 9]> = start(&t).iter().map(bits).collect();
            let want: Vec<[u64; 9]> = (0..after)
                .map(|a| (0..before).map(|b| t.entry(b, a)).fold(Entry::NONE, Entry::min))
                .map(|e| bits(&e))
                .collect();
            prop_assert_eq!(got, want);
        }

        /// Comparing the sums' cost and memory before summing whole entries finds the same
        /// path and the same entry as summing every candidate.
        #[test]
        fn best_path_agrees_with_summing_every_entry(tables in chain()) {
            let refs: Vec<&LayerTable> = tables.iter().collect();
            let got = best_path(&refs).expect("the states link");
            let want = best_path_summing_every_entry(&refs);
            prop_assert_eq!(
                got.as_ref().map(|(e, s)| (bits(e), s.clone())),
                want.as_ref().map(|(e, s)| (bits(e), s.clone()))
            );
        }
    }
}
