//! D-Rec's layer tables: for layers whose exact elimination is too large, or when a target
//! asks for D-Rec, the table is filled by D-Rec ([`crate::solve::intra::drec`]) run once per
//! pinned pair of boundary states, instead of by an elimination over every pair.
//!
//! D-Rec answers only for the states it is pinned to, and pinning every pair of states would
//! take tens of thousands of runs on a 2D mesh. So each boundary's states are narrowed to
//! those where every gradient crossing it has the spec of the activation it is the gradient
//! of (a tensor of the same shape crossing the other way; paired in id order, the same on both
//! sides of the boundary), as Megatron-LM's layouts and Alpa's plans keep them. D-Rec then
//! runs on the layer's own problem:
//! * once per such state before the layer and such state after it: each activation entering
//!   (or any tensor crossing before the layer with no pair) pinned to a spec, each gradient
//!   the layer sends back limited to the strategies making its activation's spec, and alike
//!   after the layer;
//! * once per state before the layer with the one after left to D-Rec, each gradient coming
//!   back then given its activation's spec;
//! * once free of pins, the specs entering the layer then given those of their gradients.
//!
//! Every state after a layer is a pinned state before the next, so a path always exists
//! through tables whose pins all have a plan. Each entry keeps the plan that reached it, which
//! decoding reads back. The entries are D-Rec's costs, not proven optimal: upper bounds of the
//! exact table's entries for the same states.

use super::{Bounded, ChainError, Entry, LayerTable, States, TableSolver};
use crate::cost::sharding::Spec;
use crate::model::graph::{Graph, TensorId};
use crate::solve::intra::drec::{self, Cut};
use rayon::prelude::*;

/// Most D-Rec runs one table takes: a block's activation has 3 specs on a 1D mesh and 9 to 16
/// on a 2D one (micro-batch 1 or more), so its table takes 13, 91 or 273 runs.
pub const MAX_DREC_RUNS: usize = 1024;

/// Pairs of tensors crossing one boundary: each tensor crossing backward (a gradient), as an
/// index into `side`, with the first unpaired tensor of the same shape crossing forward (its
/// activation), both taken in `side`'s order (ids).
fn pairs(graph: &Graph, side: &[TensorId], forward: impl Fn(TensorId) -> bool) -> Vec<[usize; 2]> {
    let mut used = vec![false; side.len()];
    let mut out = Vec::new();
    for (g, &t) in side.iter().enumerate() {
        if forward(t) {
            continue;
        }
        let shape = &graph.tensor(t).shape;
        let partner = (0..side.len())
            .find(|&f| !used[f] && forward(side[f]) && graph.tensor(side[f]).shape == *shape);
        if let Some(f) = partner {
            used[f] = true;
            out.push([g, f]);
        }
    }
    out
}

/// D-Rec's table of the layer `b` describes (see the module's documentation).
pub(super) fn table(graph: &Graph, b: &Bounded) -> Result<LayerTable, ChainError> {
    let nb = b.before.len();
    let problem = b.model.problem();
    let makes = |t: TensorId| b.model.makes(t);
    // Before the layer the activations enter (the layer does not make them); after it the
    // layer makes them.
    let tied_before = pairs(graph, &b.before, |t| !makes(t));
    let tied_after = pairs(graph, &b.after, makes);
    let deciding = &b.deciding;
    // Every tensor crossing before the layer is pinned to each of its specs, but the
    // gradients tied to their activations.
    let pinned: Vec<usize> = (0..nb)
        .filter(|&i| !tied_before.iter().any(|&[g, _]| g == i))
        .collect();
    let specs_of = |i: usize| -> Vec<Spec> {
        let mut specs = deciding[i].1.clone();
        specs.sort_unstable();
        specs.dedup();
        specs
    };
    let domains: Vec<Vec<Spec>> = pinned.iter().map(|&i| specs_of(i)).collect();
    // After the layer, each activation sent on is pinned with its gradient coming back to
    // each spec they may share, and left to D-Rec once.
    let after_domains: Vec<Vec<Spec>> = tied_after.iter().map(|&[_, f]| specs_of(nb + f)).collect();
    let joint = |ds: &[Vec<Spec>]| ds.iter().map(|d| d.len() as f64).product::<f64>();
    let count = joint(&domains) * (joint(&after_domains) + 1.0);
    if count > MAX_DREC_RUNS as f64 {
        return Err(ChainError::TooManyRuns {
            runs: count,
            max: MAX_DREC_RUNS,
        });
    }
    // Each pin: the spec of every tensor crossing before the layer pinned.
    let pins = every_choice(&domains);
    let after_pins: Vec<Option<Vec<Spec>>> = every_choice(&after_domains)
        .into_iter()
        .map(Some)
        .chain([None])
        .collect();
    let before_state = |pin: &[Spec]| -> Vec<Spec> {
        (0..nb)
            .map(|i| {
                let from = tied_before
                    .iter()
                    .find(|&&[g, _]| g == i)
                    .map_or(i, |&[_, f]| f);
                let at = pinned.iter().position(|&p| p == from).unwrap_or(0);
                pin[at].clone()
            })
            .collect()
    };
    // Every state the table is pinned to before the layer is one of its states, even one
    // without a plan (its entries stay infinite), so the previous layer's tables meet it.
    let mut states = States::default();
    let pinned_states: Vec<usize> = pins
        .iter()
        .map(|pin| States::index(&mut states.before, before_state(pin)))
        .collect();
    let (cuts, forced) = b.model.drec_cuts();
    let levels = b.model.drec_levels();
    let everything: Vec<Vec<usize>> = (0..problem.vars.len())
        .map(|v| (0..problem.k(v)).collect())
        .collect();
    // D-Rec on the layer's own problem with each variable limited to `allowed`, the ties
    // `fix` held afterwards (each `[from, to]`: the tensor `to` enters the layer and takes the
    // spec the plan gives `from`), read as a plan of the bounded problem: its strategies,
    // entry and warnings; none when nothing fits or a tie cannot hold. Only a run free of
    // pins warns: a pinned one leaves ops uncut because of its pins, which says nothing of
    // the layer.
    type Run = (Vec<usize>, Entry, Vec<String>);
    let run = |allowed: &[Vec<usize>], fix: &[[usize; 2]]| -> Option<Run> {
        if allowed.iter().any(Vec::is_empty) {
            return None;
        }
        let restricted = problem.restricted(allowed);
        let within: Vec<Vec<[Cut; 2]>> = cuts
            .iter()
            .zip(allowed)
            .map(|(c, a)| a.iter().map(|&i| c[i]).collect())
            .collect();
        let outcome = drec::solve(&drec::Input {
            problem: &restricted,
            cuts: &within,
            forced,
            levels: &levels,
            neighbourhoods: false,
        })?;
        let mut choice: Vec<usize> = outcome
            .choice
            .iter()
            .zip(allowed)
            .map(|(&c, a)| a[c])
            .collect();
        for &[from, to] in fix {
            let spec = &deciding[from].1[choice[deciding[from].0]];
            let (var, specs) = &deciding[to];
            choice[*var] = specs.iter().position(|s| s == spec)?;
        }
        // The bounded problem's own variables for the tensors the layer makes: the spec its
        // plan makes.
        let mut full = choice;
        full.resize(b.p.vars.len(), 0);
        for (i, (slot, specs)) in b.spec_of.iter().enumerate() {
            let var = b.keep[*slot];
            if var >= problem.vars.len() {
                let spec = &deciding[i].1[full[deciding[i].0]];
                full[var] = specs.iter().position(|s| s == spec)?;
            }
        }
        if !b.p.evaluate(&full).0.is_finite() {
            return None;
        }
        let free = allowed
            .iter()
            .zip(&everything)
            .all(|(a, e)| a.len() == e.len());
        let warnings = match free {
            true => b.model.drec_warnings(&outcome),
            false => Vec::new(),
        };
        let entry = b.read(&full);
        Some((full, entry, warnings))
    };
    // After the layer, each gradient coming back takes the spec of its activation.
    let fix_after: Vec<[usize; 2]> = tied_after.iter().map(|&[g, f]| [nb + f, nb + g]).collect();
    let jobs: Vec<(usize, Option<&Vec<Spec>>)> = (0..pins.len())
        .flat_map(|p| after_pins.iter().map(move |a| (p, a.as_ref())))
        .collect();
    let mut runs: Vec<(Option<Run>, usize)> = jobs
        .par_iter()
        .map(|&(p, after)| {
            let mut allowed = everything.clone();
            for (i, spec) in before_state(&pins[p]).iter().enumerate() {
                let (var, specs) = &deciding[i];
                allowed[*var].retain(|&c| specs[c] == *spec);
            }
            let fix: &[[usize; 2]] = match after {
                Some(pinned_after) => {
                    for (&[g, f], spec) in tied_after.iter().zip(pinned_after) {
                        for i in [nb + g, nb + f] {
                            let (var, specs) = &deciding[i];
                            allowed[*var].retain(|&c| specs[c] == *spec);
                        }
                    }
                    &[]
                }
                None => &fix_after,
            };
            (run(&allowed, fix), pinned_states[p])
        })
        .collect();
    // One run free of pins too: D-Rec choosing the specs entering the layer itself often
    // finds a cheaper plan than any it finds pinned. Each activation entering then takes the
    // spec of its gradient sent back.
    if !pinned.is_empty() {
        let mut fix = fix_after.clone();
        fix.extend(tied_before.iter().map(|&[g, f]| [g, f]));
        if let Some(r) = run(&everything, &fix) {
            let before: Vec<Spec> = (0..nb)
                .map(|i| deciding[i].1[r.0[deciding[i].0]].clone())
                .collect();
            let state = States::index(&mut states.before, before);
            runs.push((Some(r), state));
        }
    }
    let solves = runs.len();
    let mut warnings: Vec<String> = Vec::new();
    let mut cells = Vec::new();
    let own = problem.vars.len();
    for (run, before) in runs {
        let Some((choice, entry, said)) = run else {
            continue;
        };
        let after: Vec<Spec> = b.spec_of[nb..]
            .iter()
            .map(|(slot, specs)| specs[choice[b.keep[*slot]]].clone())
            .collect();
        let after = States::index(&mut states.after, after);
        let plan = choice[..own].iter().map(|&c| c as u32).collect();
        cells.push((before, after, entry, Some(plan)));
        for w in said {
            if !warnings.contains(&w) {
                warnings.push(w);
            }
        }
    }
    // Building the problem prices its entries; each run reads them once more.
    let work = super::ENTRY_WORK * b.p.entries() * (1 + solves) as f64;
    let mut t = states.into_table(b.layer, (solves, work), TableSolver::Drec, cells);
    t.warnings = warnings;
    Ok(t)
}

/// Every joint choice of one spec from each of `domains`, the last fastest.
fn every_choice(domains: &[Vec<Spec>]) -> Vec<Vec<Spec>> {
    let mut out: Vec<Vec<Spec>> = vec![Vec::new()];
    for domain in domains {
        out = out
            .into_iter()
            .flat_map(|pin| {
                domain.iter().map(move |spec| {
                    let mut next = pin.clone();
                    next.push(spec.clone());
                    next
                })
            })
            .collect();
    }
    out
}
