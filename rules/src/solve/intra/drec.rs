//! D-Rec (Wang et al., Euro-Par 2021, "Efficient and Systematic Partitioning of Large and
//! Deep Neural Networks for Parallelization"; MindSpore's `recursive_programming` search
//! mode): a linear-time sharding heuristic, run on the same problem the exact solver and the
//! ILP solve (ALGORITHMS.md §3).
//!
//! Two recursions:
//! * **over the device hierarchy**: the mesh axes are cut one after the other, the slowest
//!   link first (across nodes, then inside a node). On each level every variable fixes what
//!   it cuts on that axis, keeping what it cut on the levels before and leaving the later
//!   axes uncut, so a level's costs are those of its local shapes;
//! * **over the operators**, in a fixed order: the heaviest first, then always the heaviest
//!   of those next to one already placed (the paper's neighbourhood order; the heaviest
//!   overall when no placed variable has an unplaced neighbour). Each takes the cut of least
//!   cost given its neighbours, never looking back: an edge to a neighbour placed on this
//!   level counts as it stands, one to a neighbour not placed yet counts what it would make
//!   that neighbour pay at least (the weight left whole by a row split costs its gradient's
//!   synchronisation, which autopar's problem puts on the edge to the parameter, where the
//!   paper counts it as the operator's own). An operator cuts some dimension on every level
//!   where one divides (every op is partitioned over all devices, as in the paper); where
//!   none does it stays replicated on that axis, and the solver says so.
//!
//! Costs are the problem's: each strategy's kernel on its tile (the roofline of FLOPs and
//! bytes) and the bytes its collectives and redistributions move over each level's links.
//! The paper prices bytes alone; on autopar's transformer blocks that left D-Rec 1% to 32%
//! above the optimum (GPT-3 175B and LLaMA-2 70B blocks on 1x8, 2x4, 4x8 and 8x1 H100
//! meshes), against 0% to 11% with the kernels counted, because an operator cut is then
//! weighed against what it saves.
//!
//! Passes the paper does not have follow. When the plan does not fit the memory budget
//! (the paper's cost model has no memory), a repair moves variables to leaner strategies, the
//! least extra cost per byte saved first, until it fits. Then a bounded local refinement
//! ([`REFINE_SWEEPS`] sweeps) lets each variable, then each edge's two ends together, take
//! what lowers the objective with the rest as it stands, within the budget (above
//! [`POLISH_VARIABLES`] variables, only the [`REFINED_RUNS`] best greedy plans of the level
//! orders below are refined). On problems of at most [`POLISH_VARIABLES`] variables a polish
//! follows ([`POLISH_SWEEPS`] sweeps): windows
//! of [`WINDOW`] consecutive variables in D-Rec's order, then forests covering every
//! variable, each solved exactly with the rest as it stands, so that a path or a cycle of
//! variables moves together (on the default models' blocks this took D-Rec from 27.5% above
//! the optimum at worst to 9.2%).
//!
//! The levels are cut in the given order and, with two levels, also in the reverse order
//! (inside nodes first): a cut chosen along the slower axis cannot see that the cut chosen
//! along the other axis later makes a neighbour's conversion a gather, and the reverse order
//! sees it from the other side (GPT-3 175B's block on 2x4: 27.5% above the optimum cutting
//! across nodes first, 2.6% with both orders tried).
//!
//! Time: one sweep per level over every strategy of every variable and its edges, and each
//! refinement sweep over every edge's table at most (a bound skips the rows of a table that
//! cannot improve, and edges whose ends have not changed are skipped whole): O(levels x sum
//! of edge tables x degree), plus the order's heap, O((V + E) log V). The solver's arrays are
//! flat (edges per variable, cuts per strategy), since a greedy level or a sweep that reads
//! one small allocation per variable waits on memory more than it computes; two level orders
//! that start with the same level share that level's pass. The polish adds, per
//! sweep, one exact solve per window (each of a bounded size, so linear in the problem) and
//! one pass over every edge's table per forest. No optimality is proven: D-Rec's plans are
//! reported as not optimal, and the `drec` tests and benchmark measure the gap.

use super::problem::Problem;
use rayon::prelude::*;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// What cutting a strategy makes on one mesh axis: `0` for nothing cut, else any code that
/// is equal for strategies cutting the same way.
pub type Cut = u16;

/// A D-Rec problem.
pub struct Input<'a> {
    /// The problem: costs per strategy and pair of strategies, memory and budget.
    pub problem: &'a Problem,
    /// Per variable, per strategy, per mesh axis: what it cuts.
    pub cuts: &'a [Vec<[Cut; 2]>],
    /// Per variable: whether it must cut something on every level where it can (operators);
    /// otherwise it takes whatever costs least (parameters' and entering tensors' layouts).
    pub forced: &'a [bool],
    /// The mesh axes to cut, in order (the slowest link first; axes of one device left out).
    pub levels: &'a [usize],
    /// Whether the final polish also solves every variable's neighbourhood
    /// ([`neighbourhoods`], on problems of at most [`NEIGHBOURHOOD_VARIABLES`]): a whole
    /// range's solve does; a layer table's many pinned runs do not, for their time.
    pub neighbourhoods: bool,
}

/// What D-Rec chose.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    /// Strategy per variable.
    pub choice: Vec<usize>,
    /// (variable, mesh axis) of every forced variable that nothing could cut on that axis:
    /// it stays replicated there.
    pub uncut: Vec<(usize, usize)>,
    /// Mesh axes no operator cuts in the plan (the range replicated across them).
    pub skipped: Vec<usize>,
    /// Variables the repair moved to a leaner strategy.
    pub repaired: usize,
    /// Whether the budget bound: the plan was repaired, or the refinement left a better move
    /// that did not fit.
    pub bound: bool,
}

/// Per variable, its edges: (edge index, the edge's other end, whether the variable is the
/// edge's `u`), in edge order; all in one buffer (`inc[v]` reads variable `v`'s), which a
/// solve walks many times.
struct Incidence {
    start: Vec<usize>,
    list: Vec<(usize, usize, bool)>,
}

impl Incidence {
    fn new(p: &Problem) -> Incidence {
        let n = p.vars.len();
        let mut start = vec![0usize; n + 1];
        for e in &p.edges {
            start[e.u + 1] += 1;
            start[e.v + 1] += 1;
        }
        for v in 0..n {
            start[v + 1] += start[v];
        }
        let mut next = start.clone();
        let mut list = vec![(0, 0, false); start[n]];
        for (i, e) in p.edges.iter().enumerate() {
            for (end, there, is_u) in [(e.u, e.v, true), (e.v, e.u, false)] {
                list[next[end]] = (i, there, is_u);
                next[end] += 1;
            }
        }
        Incidence { start, list }
    }
}

impl std::ops::Index<usize> for Incidence {
    type Output = [(usize, usize, bool)];

    fn index(&self, v: usize) -> &[(usize, usize, bool)] {
        &self.list[self.start[v]..self.start[v + 1]]
    }
}

/// Per variable, per strategy, what it cuts on each mesh axis ([`Input::cuts`]) in one
/// buffer (`cuts[v]` reads variable `v`'s): every greedy level reads them all, and one
/// allocation per variable cost each level a cache miss per variable.
#[derive(Default)]
struct Strategies {
    start: Vec<usize>,
    cuts: Vec<[Cut; 2]>,
}

impl Strategies {
    fn new(cuts: &[Vec<[Cut; 2]>]) -> Strategies {
        let mut start = Vec::with_capacity(cuts.len() + 1);
        let mut flat = Vec::with_capacity(cuts.iter().map(Vec::len).sum());
        for c in cuts {
            start.push(flat.len());
            flat.extend_from_slice(c);
        }
        start.push(flat.len());
        Strategies { start, cuts: flat }
    }

    /// Strategies of variable `v`.
    fn k(&self, v: usize) -> usize {
        self.start[v + 1] - self.start[v]
    }

    /// Variables (none before any cuts are read).
    fn len(&self) -> usize {
        self.start.len().saturating_sub(1)
    }
}

impl std::ops::Index<usize> for Strategies {
    type Output = [[Cut; 2]];

    fn index(&self, v: usize) -> &[[Cut; 2]] {
        &self.cuts[self.start[v]..self.start[v + 1]]
    }
}

/// What every run of one solve shares.
struct Shared {
    /// Per variable, its edges.
    inc: Incidence,
    /// What each strategy cuts ([`Input::cuts`]; empty where no greedy pass runs).
    cuts: Strategies,
    /// D-Rec's operator order ([`order`]).
    order: Vec<usize>,
    /// Per edge, the least and the largest entry of its table (the refinement's bounds).
    range: Vec<(f64, f64)>,
    /// Forests covering every variable, for the polish ([`forests`]; none on problems it
    /// does not polish).
    forests: Vec<Vec<usize>>,
    /// Neighbourhoods of the variables, for the final polish ([`neighbourhoods`]; none on
    /// problems of more than [`NEIGHBOURHOOD_VARIABLES`]).
    balls: Vec<Vec<usize>>,
}

impl Shared {
    fn new(p: &Problem, neighbours: bool) -> Shared {
        // The edge lists and the variables by weight are independent; the order follows from
        // both, sequentially, and the tables' ranges are read meanwhile, once per table that
        // edges share.
        let (inc, heaviest) = rayon::join(|| Incidence::new(p), || heaviest(p));
        let (order, range) = rayon::join(
            || order(&inc, &heaviest),
            || {
                let mut known: HashMap<*const f64, (f64, f64)> = HashMap::new();
                p.edges
                    .iter()
                    .map(|e| {
                        *known.entry(e.cost.as_ptr()).or_insert_with(|| {
                            let lo = least(e.cost.iter().copied());
                            let hi = -least(e.cost.iter().map(|x| -x));
                            (lo, hi)
                        })
                    })
                    .collect()
            },
        );
        let mut shared = Shared {
            cuts: Strategies::default(),
            inc,
            order,
            range,
            forests: Vec::new(),
            balls: Vec::new(),
        };
        if p.vars.len() <= POLISH_VARIABLES {
            shared.forests = forests(p, &shared);
        }
        if neighbours && p.vars.len() <= NEIGHBOURHOOD_VARIABLES {
            shared.balls = neighbourhoods(p, &shared);
        }
        shared
    }
}

/// Edge `e`'s table seen from one end (`is_u`: from `u`): row `c` holds what the edge costs
/// with that end on `c`, per strategy of the other end (a column of the stored table when
/// seen from `v`).
fn seen(p: &Problem, e: usize, is_u: bool) -> Table<'_> {
    let edge = &p.edges[e];
    let (end, there) = if is_u {
        (edge.u, edge.v)
    } else {
        (edge.v, edge.u)
    };
    Table::new(&edge.cost, is_u, p.k(end), p.k(there))
}

/// An edge's table seen from one end: a row per strategy of that end.
#[derive(Clone, Copy)]
struct Table<'p> {
    cost: &'p [f64],
    /// Step between rows, and along a row.
    across: usize,
    along: usize,
    /// Strategies of the other end.
    width: usize,
}

impl<'p> Table<'p> {
    /// An edge's table `cost` seen from one end (`is_u`: from `u`), that end with `k_end`
    /// strategies and the other with `k_other` ([`seen`] with the counts known: hot loops
    /// take them from their own rows rather than read every variable's).
    fn new(cost: &'p [f64], is_u: bool, k_end: usize, k_other: usize) -> Table<'p> {
        if is_u {
            Table {
                cost,
                across: k_other,
                along: 1,
                width: k_other,
            }
        } else {
            Table {
                cost,
                across: 1,
                along: k_end,
                width: k_other,
            }
        }
    }

    /// The edge's cost per strategy of the other end, this end on `c`.
    fn row(self, c: usize) -> impl Iterator<Item = f64> + 'p {
        self.cost[c * self.across..]
            .iter()
            .step_by(self.along)
            .take(self.width)
            .copied()
    }

    fn at(self, c: usize, w: usize) -> f64 {
        self.cost[c * self.across + w * self.along]
    }
}

/// The least of `xs` (infinity when empty) by plain comparisons: costs hold no NaN, and
/// `f64::min` pays for them in D-Rec's innermost loops.
fn least(xs: impl Iterator<Item = f64>) -> f64 {
    xs.fold(f64::INFINITY, |m, x| if x < m { x } else { m })
}

/// [`least`] with four independent running minima: each comparison waits on the one four
/// elements back rather than the one before, which the refinement's rows are long enough to
/// gain from.
fn least4(mut xs: impl Iterator<Item = f64>) -> f64 {
    let mut lanes = [f64::INFINITY; 4];
    'all: loop {
        for slot in &mut lanes {
            let Some(x) = xs.next() else {
                break 'all;
            };
            *slot = if x < *slot { x } else { *slot };
        }
    }
    least(lanes.into_iter())
}

/// Every variable by weight (its costliest strategy), the heaviest first and the lowest
/// index on a tie (keys are distinct, so an unstable sort gives the same).
fn heaviest(p: &Problem) -> Vec<usize> {
    // Costs hold no NaN: plain comparisons.
    let weight: Vec<f64> = p
        .vars
        .iter()
        .map(|v| v.cost.iter().fold(0.0, |m, &x| if x > m { x } else { m }))
        .collect();
    let mut heaviest: Vec<usize> = (0..p.vars.len()).collect();
    heaviest.sort_unstable_by(|&a, &b| weight[b].total_cmp(&weight[a]).then(a.cmp(&b)));
    heaviest
}

/// The operator order: heaviest first ([`heaviest`]), then by neighbourhood.
fn order(inc: &Incidence, heaviest: &[usize]) -> Vec<usize> {
    let n = heaviest.len();
    // A variable's rank by weight is its key in the heap, which holds the unplaced
    // neighbours of placed variables, each once.
    let mut rank = vec![0usize; n];
    for (r, &v) in heaviest.iter().enumerate() {
        rank[v] = r;
    }
    let mut next = heaviest.iter();
    let mut heap: BinaryHeap<Reverse<usize>> = BinaryHeap::new();
    // Placed, or waiting in the heap.
    let mut seen = vec![false; n];
    let mut out = Vec::with_capacity(n);
    loop {
        let var = match heap.pop() {
            Some(Reverse(r)) => heaviest[r],
            // No placed variable has an unplaced neighbour: the heaviest left.
            None => match next.find(|&&v| !seen[v]) {
                Some(&v) => v,
                None => break,
            },
        };
        seen[var] = true;
        out.push(var);
        for &(_, w, _) in &inc[var] {
            if !seen[w] {
                seen[w] = true;
                heap.push(Reverse(rank[w]));
            }
        }
    }
    out
}

/// Prices of memory the greedy pass tries when its plan at price 0 is over the budget, as
/// multiples of that plan's cost per byte.
const MEMORY_PRICES: [f64; 8] = [1.0 / 64.0, 1.0 / 16.0, 0.25, 1.0, 4.0, 16.0, 64.0, 256.0];

/// Runs D-Rec once for every subset of the levels (each mesh axis cut by every operator, or
/// by none: the whole range replicated across it), two levels in both orders (at most 5
/// runs, in parallel; above [`POLISH_VARIABLES`] only the [`REFINED_RUNS`] best greedy plans
/// are refined), and keeps the plan of least objective, the one cutting more levels on a
/// tie, then the given order; `None` when not even the leanest plan fits the budget.
///
/// Each run's plan is polished ([`polish`]), and the winner once more with every
/// variable's neighbourhood among the windows. When the budget binds (the greedy plan is over
/// it, or it stops the refinement), the greedy pass runs again with memory priced into every
/// strategy's cost at each of [`MEMORY_PRICES`] (a Lagrangian relaxation of the budget, as
/// the exact solver's bounds use), each plan repaired and refined under the true objective;
/// on problems the polish takes, each price's plan is also polished under the priced
/// objective before its repair ([`priced`]). The best of all is polished and wins.
pub fn solve(input: &Input) -> Option<Outcome> {
    let p = input.problem;
    // Every run's repair ends within the budget when the leanest plan does.
    if p.memory_budget.is_some() && !p.fits(p.leanest().memory) {
        return None;
    }
    let (mut shared, cuts) = rayon::join(
        || Shared::new(p, input.neighbourhoods),
        || Strategies::new(input.cuts),
    );
    shared.cuts = cuts;
    let first = masks(input, &shared, 0.0)?;
    if !first.1.bound {
        // Its run was polished already; only the neighbourhoods are new to it.
        return Some(if shared.balls.is_empty() {
            first.1
        } else {
            polished(input, &shared, first.1, &shared.balls)
        });
    }
    let (cost, memory) = p.evaluate(&first.1.choice);
    let per_byte = cost / memory.max(f64::MIN_POSITIVE);
    let mut best = first;
    for price in MEMORY_PRICES {
        let run = masks(input, &shared, price * per_byte)?;
        if run.0 < best.0 {
            best = run;
        }
        if p.vars.len() <= POLISH_VARIABLES {
            let run = priced(input, &shared, price * per_byte)?;
            if run.0 < best.0 {
                best = run;
            }
        }
    }
    Some(polished(input, &shared, best.1, &shared.balls))
}

/// D-Rec's plan for `cost + lambda * memory` with no budget, polished under that objective;
/// then repaired, refined and polished under the true objective and the budget, with its
/// objective. The polish under the true objective keeps the budget, so it cannot trade
/// memory between distant parts of the range; under the priced one there is no budget, and
/// it can (GPT-2 small's block on 2x1 under a binding budget, where the optimum splits only
/// the MLP: 25.5% above the optimum with the priced greedy pass alone, 0% with this).
fn priced(input: &Input, shared: &Shared, lambda: f64) -> Option<(f64, Outcome)> {
    let p = input.problem;
    let relaxed = Problem {
        vars: p
            .vars
            .iter()
            .map(|v| super::problem::Var {
                cost: v
                    .cost
                    .iter()
                    .zip(&v.memory)
                    .map(|(c, m)| c + lambda * m)
                    .collect(),
                memory: v.memory.clone(),
            })
            .collect(),
        edges: p.edges.clone(),
        memory_budget: None,
    };
    let (_, out) = masks(
        &Input {
            problem: &relaxed,
            ..*input
        },
        shared,
        0.0,
    )?;
    let mut choice = out.choice;
    let mut locals = Locals::new(p, &choice);
    let repaired = repair(p, shared, &mut choice, &mut locals)?;
    let blocked = refine(p, shared, &mut choice, &mut locals);
    let out = polished(
        input,
        shared,
        Outcome {
            choice,
            uncut: out.uncut,
            skipped: Vec::new(),
            repaired,
            bound: repaired > 0 || blocked,
        },
        &[],
    );
    Some((p.evaluate(&out.choice).0, out))
}

/// [`recurse`] for every subset and order of the levels, with memory priced at `lambda` per
/// byte in the greedy pass (each plan polished at price 0): the best plan and its objective.
fn masks(input: &Input, shared: &Shared, lambda: f64) -> Option<(f64, Outcome)> {
    let p = input.problem;
    // The least objective first, then more levels cut, then the given order.
    let rank = |a: &(f64, u32, bool), b: &(f64, u32, bool)| {
        a.0.total_cmp(&b.0).then(b.1.cmp(&a.1)).then(a.2.cmp(&b.2))
    };
    type Run = ((f64, u32, bool), Outcome, Option<Locals>);
    let mut runs: Vec<Run> = greedy_runs(input, shared, lambda)
        .into_par_iter()
        .map(|(mask, reversed, plan)| {
            let (out, locals) = repaired(input, shared, plan)?;
            Some(((p.evaluate(&out.choice).0, mask, reversed), out, locals))
        })
        .collect::<Option<Vec<_>>>()?;
    // Above the polish's size only the best repaired greedy plans are refined (see
    // `REFINED_RUNS`); below it every run is, then polished.
    let big = p.vars.len() > POLISH_VARIABLES;
    if big {
        runs.sort_by(|a, b| rank(&a.0, &b.0));
        runs.truncate(REFINED_RUNS);
    }
    let runs: Vec<((f64, u32, bool), Outcome)> = runs
        .into_par_iter()
        .map(|((_, mask, reversed), mut out, locals)| {
            let mut locals = locals.unwrap_or_else(|| Locals::new(p, &out.choice));
            out.bound |= refine(p, shared, &mut out.choice, &mut locals);
            if lambda == 0.0 && !big {
                out = polished(input, shared, out, &[]);
            } else {
                out.skipped = skipped(input, shared, &out.choice);
            }
            ((p.evaluate(&out.choice).0, mask, reversed), out)
        })
        .collect();
    runs.into_iter()
        .min_by(|a, b| rank(&a.0, &b.0))
        .map(|((cost, _, _), out)| (cost, out))
}

/// A greedy plan: the strategy per variable, and the (variable, mesh axis) pairs of forced
/// variables nothing could cut.
type Greedy = (Vec<usize>, Vec<(usize, usize)>);

/// D-Rec's greedy pass ([`level`]) for every subset of the levels, in the given order and
/// (two levels) reversed, in parallel: (subset's mask, whether reversed, plan). Cutting one
/// of two levels alone and cutting it before the other share their first pass when every
/// variable starts uncut on both axes (the other axis then stays uncut in both).
fn greedy_runs(input: &Input, shared: &Shared, lambda: f64) -> Vec<(u32, bool, Greedy)> {
    let start = replicated(shared);
    let levels = input.levels;
    let all_uncut = || (0..start.len()).all(|v| shared.cuts[v][start[v]] == [0, 0]);
    if let [a, b] = *levels
        && all_uncut()
    {
        // One level alone (mask 1 or 2), then both with it first.
        let pair = |first: usize, second: usize, mask: u32, reversed: bool| {
            let mut plan = (start.clone(), Vec::new());
            level(input, shared, lambda, &mut plan, first, &[second]);
            let alone = plan.clone();
            level(input, shared, lambda, &mut plan, second, &[]);
            [(mask, false, alone), (3, reversed, plan)]
        };
        let (ab, ba) = rayon::join(|| pair(a, b, 1, false), || pair(b, a, 2, true));
        return std::iter::once((0, false, (start.clone(), Vec::new())))
            .chain(ab)
            .chain(ba)
            .collect();
    }
    let all = levels.len();
    let mut orders: Vec<(u32, bool, Vec<usize>)> = Vec::new();
    for mask in 0..1u32 << all {
        let subset: Vec<usize> = (0..all)
            .filter(|i| mask & (1 << i) != 0)
            .map(|i| levels[i])
            .collect();
        if subset.len() == 2 {
            orders.push((mask, true, subset.iter().rev().copied().collect()));
        }
        orders.push((mask, false, subset));
    }
    orders
        .into_par_iter()
        .map(|(mask, reversed, subset)| {
            let mut plan = (start.clone(), Vec::new());
            for (i, &axis) in subset.iter().enumerate() {
                level(input, shared, lambda, &mut plan, axis, &subset[i + 1..]);
            }
            (mask, reversed, plan)
        })
        .collect()
}

/// Runs of [`masks`] refined on problems above [`POLISH_VARIABLES`]: the repaired greedy
/// plans of least objective. Refining costs each run several times its greedy pass, and on
/// the generated graphs of 5,000 and 20,000 ops (transformer, MLP and U-Net, on 1x8 and
/// 2x4) the plan that won after refining every run was always the best greedy one; two
/// runs refine in parallel in the time of one on two cores.
pub const REFINED_RUNS: usize = 2;

/// A greedy plan repaired to fit the budget, with its local costs when the repair needed
/// them (under a budget; without one nothing moves, and only the runs refined build them).
fn repaired(
    input: &Input,
    shared: &Shared,
    (mut choice, uncut): Greedy,
) -> Option<(Outcome, Option<Locals>)> {
    let p = input.problem;
    let mut locals = None;
    let mut repaired = 0;
    if p.memory_budget.is_some() {
        let l = locals.insert(Locals::new(p, &choice));
        repaired = repair(p, shared, &mut choice, l)?;
    }
    Some((
        Outcome {
            choice,
            uncut,
            skipped: Vec::new(),
            repaired,
            bound: repaired > 0,
        },
        locals,
    ))
}

/// Every variable's replicated strategy (uncut on every axis; its first strategy when it
/// has none), where the greedy pass starts.
fn replicated(shared: &Shared) -> Vec<usize> {
    (0..shared.cuts.len())
        .map(|v| {
            shared.cuts[v]
                .iter()
                .position(|&c| c == [0, 0])
                .unwrap_or(0)
        })
        .collect()
}

/// One level of D-Rec's greedy pass: every variable, in D-Rec's order, fixes what it cuts
/// on mesh axis `axis` (an operator cuts something if it can), keeping what it cut on the
/// levels before and leaving the `later` axes uncut, given its neighbours placed so far on
/// this level; memory is priced at `lambda` per byte. Updates `plan`'s choice and adds the
/// operators nothing could cut on this axis to its uncut list.
fn level(
    input: &Input,
    shared: &Shared,
    lambda: f64,
    (choice, uncut): &mut Greedy,
    axis: usize,
    later: &[usize],
) {
    let p = input.problem;
    let (inc, order) = (&shared.inc, &shared.order);
    // Memory priced in, when it is (read only then).
    let own = |v: usize, c: usize| {
        let cost = p.vars[v].cost[c];
        if lambda == 0.0 {
            cost
        } else {
            cost + lambda * p.vars[v].memory[c]
        }
    };
    let n = p.vars.len();
    let mut done = vec![false; n];
    // Per variable, the strategies it may take on this level: what it cut on the levels
    // before kept, the later axes uncut, and (an operator) a cut on this axis if any.
    // All in one buffer: variable `v`'s are `list[start[v]..start[v + 1]]`.
    let mut start = Vec::with_capacity(n + 1);
    let mut list = Vec::with_capacity(n);
    for v in 0..n {
        start.push(list.len());
        let cuts = &shared.cuts[v];
        let now = cuts[choice[v]];
        // Per mesh axis, what a strategy must cut there: this level's axis anything,
        // later axes nothing, axes cut before (or left out) what they have.
        let want = [0, 1].map(|a| {
            if a == axis {
                None
            } else if later.contains(&a) {
                Some(0)
            } else {
                Some(now[a])
            }
        });
        let keeps = |cut: &[Cut; 2]| (0..2).all(|a| want[a].is_none_or(|x| cut[a] == x));
        list.extend((0..cuts.len()).filter(|&c| keeps(&cuts[c])));
        // An operator cuts this axis if any of those strategies does.
        if input.forced[v] {
            if list[start[v]..].iter().any(|&c| cuts[c][axis] != 0) {
                let mut kept = start[v];
                for i in start[v]..list.len() {
                    if cuts[list[i]][axis] != 0 {
                        list[kept] = list[i];
                        kept += 1;
                    }
                }
                list.truncate(kept);
            } else {
                uncut.push((v, axis));
            }
        }
        // A variable limited to strategies that cut a later axis (its replicated one
        // not allowed) keeps what it has.
        if list.len() == start[v] {
            list.push(choice[v]);
        }
    }
    start.push(list.len());
    let reachable = |v: usize| &list[start[v]..start[v + 1]];
    // Each strategy's own cost, beside `list`.
    let owns: Vec<f64> = (0..n)
        .flat_map(|v| reachable(v).iter().map(move |&c| own(v, c)))
        .collect();
    let owned = |v: usize| &owns[start[v]..start[v + 1]];
    let alone: Vec<f64> = (0..n).map(|w| least(owned(w).iter().copied())).collect();
    // Per candidate of the variable being placed, its cost: its own, then edge by edge
    // (each edge's table and its other end read once for all candidates).
    let mut sums: Vec<f64> = Vec::new();
    for &v in order {
        let candidates = reachable(v);
        sums.clear();
        sums.extend_from_slice(owned(v));
        let k = shared.cuts.k(v);
        for &(e, w, is_u) in &inc[v] {
            let table = Table::new(&p.edges[e].cost, is_u, k, shared.cuts.k(w));
            if done[w] {
                let x = choice[w];
                for (sum, &c) in sums.iter_mut().zip(candidates) {
                    *sum += table.at(c, x);
                }
            } else {
                // A neighbour not placed yet: what the edge makes it pay at least, its own
                // cost included, over what it would pay alone.
                let (there, paid) = (reachable(w), owned(w));
                for (sum, &c) in sums.iter_mut().zip(candidates) {
                    *sum +=
                        least(there.iter().zip(paid).map(|(&x, &o)| table.at(c, x) + o)) - alone[w];
                }
            }
        }
        // The least cost, then the least memory (read only on a tie).
        let memory = &p.vars[v].memory;
        let mut best: Option<(usize, f64)> = None;
        for (&c, &cost) in candidates.iter().zip(&sums) {
            let take = match best {
                None => true,
                Some((b, least)) => cost < least || (cost == least && memory[c] < memory[b]),
            };
            if take {
                best = Some((c, cost));
            }
        }
        let best = best.map_or(choice[v], |(c, _)| c);
        choice[v] = best;
        done[v] = true;
    }
}

/// The mesh axes of `input`'s levels that no operator of `choice` cuts.
fn skipped(input: &Input, shared: &Shared, choice: &[usize]) -> Vec<usize> {
    input
        .levels
        .iter()
        .copied()
        .filter(|&a| {
            (0..choice.len()).all(|v| !input.forced[v] || shared.cuts[v][choice[v]][a] == 0)
        })
        .collect()
}

/// [`polish`] (with `balls` among its windows), then the axes the polished plan leaves uncut.
fn polished(input: &Input, shared: &Shared, out: Outcome, balls: &[Vec<usize>]) -> Outcome {
    let mut out = polish(input.problem, shared, out, balls);
    out.skipped = skipped(input, shared, &out.choice);
    out
}

/// Sweeps limit of [`refine`].
pub const REFINE_SWEEPS: usize = 4;

/// Per variable and strategy, its cost with every neighbour as it stands (its own cost plus
/// its edges), kept up to date as variables move.
struct Locals {
    /// Start of each variable's row in `cost`.
    start: Vec<usize>,
    cost: Vec<f64>,
}

impl Locals {
    /// Every row, summed edge by edge in index order (each slot adds its edges in the order
    /// of its variable's incidence list, which is also by index).
    fn new(p: &Problem, choice: &[usize]) -> Locals {
        let mut start = Vec::with_capacity(p.vars.len() + 1);
        let mut cost = Vec::with_capacity(p.vars.iter().map(|v| v.cost.len()).sum());
        for var in &p.vars {
            start.push(cost.len());
            cost.extend_from_slice(&var.cost);
        }
        start.push(cost.len());
        for e in &p.edges {
            let (nu, nv) = (choice[e.u], choice[e.v]);
            // Each end's row gains the edge with the other end as it stands: the other end's
            // row of the table seen from it.
            let (ku, kv) = (start[e.u + 1] - start[e.u], start[e.v + 1] - start[e.v]);
            let (from_v, from_u) = (
                Table::new(&e.cost, false, kv, ku),
                Table::new(&e.cost, true, ku, kv),
            );
            for (end, table, there) in [(e.u, from_v, nv), (e.v, from_u, nu)] {
                for (slot, x) in cost[start[end]..start[end + 1]]
                    .iter_mut()
                    .zip(table.row(there))
                {
                    *slot += x;
                }
            }
        }
        Locals { start, cost }
    }

    fn row(&self, v: usize) -> &[f64] {
        &self.cost[self.start[v]..self.start[v + 1]]
    }

    /// Moves `v` from `from` to `to`: each neighbour's row sees its edge change.
    fn moved(&mut self, p: &Problem, shared: &Shared, v: usize, from: usize, to: usize) {
        let k = self.start[v + 1] - self.start[v];
        for &(e, w, is_u) in &shared.inc[v] {
            let row = &mut self.cost[self.start[w]..self.start[w + 1]];
            let table = Table::new(&p.edges[e].cost, is_u, k, row.len());
            let (old, new) = (table.row(from), table.row(to));
            for ((slot, a), b) in row.iter_mut().zip(old).zip(new) {
                *slot += b - a;
            }
        }
    }
}

/// Local refinement under the objective, for at most [`REFINE_SWEEPS`] sweeps or until one
/// changes nothing: in D-Rec's order each variable takes the strategy that lowers the
/// objective most with every neighbour as it stands, then each edge's two ends take the pair
/// that does, the plan staying within the budget. Every move lowers the objective. Each
/// variable's cost per strategy is kept up to date as its neighbours move, so a sweep costs
/// each edge its two rows and the table rows a bound cannot rule out, plus the rows of the
/// moved variables' neighbours; an edge whose ends have not changed since it last had no
/// better pair is not read at all. Returns whether the budget stopped a move that would have
/// lowered the objective.
fn refine(p: &Problem, shared: &Shared, choice: &mut [usize], locals: &mut Locals) -> bool {
    let (inc, order) = (&shared.inc, &shared.order);
    // Memory is tracked only under a budget: without one every move fits, and reading each
    // strategy's memory cost a sweep a cache miss per variable and per edge.
    let budget = p.memory_budget.is_some();
    let mut memory = if budget { p.evaluate(choice).1 } else { 0.0 };
    let mem = |v: usize, c: usize| p.vars[v].memory[c];
    let mut blocked = false;
    let better = |cost: f64, than: f64| cost < than - 1e-15 * than.abs();
    // A clock ticking at every move; per variable, when its row or choice last changed; per
    // edge, when it was last found with no better pair (0: never).
    let mut clock = 1u64;
    let mut changed = vec![0u64; p.vars.len()];
    let mut settled = vec![0u64; p.edges.len()];
    // A move of `v` changes its choice and its neighbours' rows.
    let touch = |changed: &mut [u64], v: usize, clock: u64| {
        changed[v] = clock;
        for &(_, w, _) in &inc[v] {
            changed[w] = clock;
        }
    };
    for _ in 0..REFINE_SWEEPS {
        let mut changed_any = false;
        for &v in order {
            let now = choice[v];
            let row = locals.row(v);
            // Most variables have no better strategy: the row's least tells, without the
            // scan's dependent comparisons.
            if !better(least4(row.iter().copied()), row[now]) {
                continue;
            }
            let mut best = now;
            for (c, &cost) in row.iter().enumerate() {
                if better(cost, row[best]) {
                    if !budget || p.fits(memory - mem(v, now) + mem(v, c)) {
                        best = c;
                    } else {
                        blocked = true;
                    }
                }
            }
            if best != now {
                if budget {
                    memory += mem(v, best) - mem(v, now);
                }
                choice[v] = best;
                locals.moved(p, shared, v, now, best);
                clock += 1;
                touch(&mut changed, v, clock);
                changed_any = true;
            }
        }
        // Then each edge's two ends together, the rest as it stands: each end's row less
        // this edge, plus the edge. An edge found with no better pair stays so until a row
        // or choice at one of its ends changes: it is not read again until then.
        for (i, e) in p.edges.iter().enumerate() {
            let (u, v) = (e.u, e.v);
            if settled[i] > 0 && changed[u] <= settled[i] && changed[v] <= settled[i] {
                continue;
            }
            let (nu, nv) = (choice[u], choice[v]);
            let (lu, lv) = (locals.row(u), locals.row(v));
            let kv = lv.len();
            // What the plan holds besides the two ends (read only under a budget).
            let base = || memory - mem(u, nu) - mem(v, nv);
            let now = lu[nu] + lv[nv] - e.cost[nu * kv + nv];
            let mut best = (nu, nv, now);
            let mut held = false;
            // Every pair of a row `cu` costs at least that row less the edge, plus the least
            // of `v`'s row less the edge, plus the table's least entry: rows that cannot beat
            // the best so far, by a margin far above rounding, are not read.
            let (floor, ceil) = shared.range[i];
            // The edge per strategy of `u` with `v` as it stands, and per strategy of `v`
            // with `u` as it stands.
            let column = Table::new(&e.cost, false, kv, lu.len()).row(nv);
            let rows = e.cost.chunks_exact(kv);
            let row_nu = &e.cost[nu * kv..(nu + 1) * kv];
            // The least of `v`'s row less the edge, and the largest magnitude in `v`'s row
            // (both exact in any order: four lanes, for the comparisons' latency).
            let rest_v = least4(lv.iter().zip(row_nu).map(|(&b, &x)| b - x));
            let top_v = -least4(lv.iter().map(|b| -b.abs()));
            for (cu, ((&a, x), pairs)) in lu.iter().zip(column).zip(rows).enumerate() {
                let margin = 1e-9 * (a.abs() + top_v + ceil.abs());
                let a = a - x;
                if a + rest_v + floor - margin >= best.2 {
                    continue;
                }
                // The row's least first (the same sums as the scan's, so the same verdict):
                // most rows the bound lets through hold no better pair.
                let pair = |((&b, &y), &z): ((&f64, &f64), &f64)| a + b - y + z;
                if !better(least4(lv.iter().zip(row_nu).zip(pairs).map(pair)), best.2) {
                    continue;
                }
                for (cv, entry) in lv.iter().zip(row_nu).zip(pairs).enumerate() {
                    let cost = pair(entry);
                    if better(cost, best.2) {
                        if !budget || p.fits(base() + mem(u, cu) + mem(v, cv)) {
                            best = (cu, cv, cost);
                        } else {
                            held = true;
                        }
                    }
                }
            }
            blocked |= held;
            if (best.0, best.1) != (nu, nv) {
                if budget {
                    memory = base() + mem(u, best.0) + mem(v, best.1);
                }
                choice[u] = best.0;
                locals.moved(p, shared, u, nu, best.0);
                choice[v] = best.1;
                locals.moved(p, shared, v, nv, best.1);
                clock += 1;
                touch(&mut changed, u, clock);
                touch(&mut changed, v, clock);
                changed_any = true;
            } else if !held {
                settled[i] = clock;
            }
        }
        if !changed_any {
            break;
        }
    }
    blocked
}

/// Sweeps limit of [`polish`].
pub const POLISH_SWEEPS: usize = 4;

/// Largest problem (variables) that [`polish`] polishes. Its exact moves cost several times
/// what the greedy pass pays for the same variables (20,000-op graphs on 2x4 meshes took
/// 3.3 s polished against 0.4 s): past this size, where `auto` hands whole ranges to D-Rec
/// for its speed, D-Rec's plan is the refined greedy one. Transformer blocks (the build's
/// layer tables) have tens of variables.
pub const POLISH_VARIABLES: usize = super::stage::AUTO_DREC_VARIABLES;

/// Exact moves of many variables together, for at most [`POLISH_SWEEPS`] sweeps or until one
/// changes nothing (problems of at most [`POLISH_VARIABLES`] variables): windows of
/// [`WINDOW`] consecutive variables in D-Rec's order, then `balls` (the final polish's
/// neighbourhoods, [`neighbourhoods`]), then forests covering every variable, each solved
/// exactly with the rest as it stands. The refinement's single and paired moves cannot move a
/// path of variables whose every partial move costs more (an attention's split, its rotary
/// embeddings and its core cut along heads together), nor a cycle. Every move lowers the
/// objective and keeps the budget. With `balls`, a first sweep solves them alone, and the
/// windows and forests run again only if one moved.
fn polish(p: &Problem, shared: &Shared, mut out: Outcome, balls: &[Vec<usize>]) -> Outcome {
    if p.vars.len() > POLISH_VARIABLES {
        return out;
    }
    let mut locals = Locals::new(p, &out.choice);
    let mut memory = p.evaluate(&out.choice).1;
    let order = &shared.order;
    // Windows tile the order; odd sweeps shift them by half a window, so that every pair of
    // neighbours in the order shares a window in some sweep.
    let tiles = |shift: usize| -> Vec<usize> {
        std::iter::once(0)
            .chain((shift..order.len()).step_by(WINDOW).filter(|&a| a > 0))
            .collect()
    };
    let starts = [tiles(0), tiles(WINDOW / 2)];
    // A clock ticking at every move; per variable, when it or a neighbour last moved; per
    // window, when it was last solved (0: never). A window none of whose variables' rows
    // changed since it was solved would find nothing new.
    let mut clock = 1u64;
    let mut changed = vec![0u64; p.vars.len()];
    let mut solved = [vec![0u64; starts[0].len()], vec![0u64; starts[1].len()]];
    let mut balls_solved = vec![0u64; balls.len()];
    // Marks the variables of `members` that moved, and their neighbours.
    let touch =
        |changed: &mut [u64], members: &[usize], before: &[usize], choice: &[usize], clock: u64| {
            for (&v, &was) in members.iter().zip(before) {
                if choice[v] != was {
                    changed[v] = clock;
                    for &(_, w, _) in &shared.inc[v] {
                        changed[w] = clock;
                    }
                }
            }
        };
    // With neighbourhoods, a first sweep of them alone: the plans it polishes have been
    // polished by windows and forests already, and usually nothing moves.
    let first = if balls.is_empty() { 1 } else { 0 };
    for sweep in first..=POLISH_SWEEPS {
        let mut moved = false;
        let alone = sweep == 0;
        // Full sweeps 1, 2, ... take the tiles, then the shifted ones, in turn.
        let tiling = (sweep + 1) % 2;
        let (starts, solved) = (&starts[tiling], &mut solved[tiling]);
        // Solves one window unless none of its variables' rows changed since `at`, when it
        // was last solved; returns whether it moved.
        let mut window = |members: &[usize], at: &mut u64| -> bool {
            if *at > 0 && members.iter().all(|&v| changed[v] <= *at) {
                return false;
            }
            let before: Vec<usize> = members.iter().map(|&v| out.choice[v]).collect();
            let m = window_pass(
                p,
                shared,
                members,
                &mut out.choice,
                &mut locals,
                &mut memory,
            );
            if m {
                clock += 1;
                touch(&mut changed, members, &before, &out.choice, clock);
            }
            *at = clock;
            m
        };
        for (w, &at) in starts.iter().enumerate().filter(|_| !alone) {
            let end = starts.get(w + 1).copied().unwrap_or(order.len());
            moved |= window(&order[at..end], &mut solved[w]);
        }
        for (members, at) in balls.iter().zip(balls_solved.iter_mut()) {
            moved |= window(members, at);
        }
        for members in shared.forests.iter().filter(|_| !alone) {
            let before: Vec<usize> = members.iter().map(|&v| out.choice[v]).collect();
            let (m, held) = forest_pass(
                p,
                shared,
                members,
                &mut out.choice,
                &mut locals,
                &mut memory,
            );
            if m {
                clock += 1;
                touch(&mut changed, members, &before, &out.choice, clock);
                moved = true;
            }
            out.bound |= held;
        }
        if !moved {
            break;
        }
    }
    out
}

/// Covers the variables with forests, in D-Rec's order: each variable joins the first forest
/// in which its edges to the forest's variables reach distinct trees (so the forest's induced
/// edges stay a forest; a second edge to the same tree would close a cycle). Returns the
/// forests' variables, each in order.
fn forests(p: &Problem, shared: &Shared) -> Vec<Vec<usize>> {
    let n = p.vars.len();
    // Per variable, its forest (usize::MAX: none yet); per variable, its union-find parent
    // among the variables of its forest.
    let mut forest = vec![usize::MAX; n];
    let mut parent: Vec<usize> = (0..n).collect();
    fn root(parent: &mut [usize], mut v: usize) -> usize {
        while parent[v] != v {
            parent[v] = parent[parent[v]];
            v = parent[v];
        }
        v
    }
    let mut out: Vec<Vec<usize>> = Vec::new();
    for &v in &shared.order {
        let mut f = 0;
        loop {
            let mut trees: Vec<usize> = Vec::new();
            let mut cycle = false;
            for &(_, w, _) in &shared.inc[v] {
                if forest[w] == f {
                    let r = root(&mut parent, w);
                    if trees.contains(&r) {
                        cycle = true;
                        break;
                    }
                    trees.push(r);
                }
            }
            if !cycle {
                for r in trees {
                    parent[r] = v;
                }
                forest[v] = f;
                if out.len() == f {
                    out.push(Vec::new());
                }
                out[f].push(v);
                break;
            }
            f += 1;
        }
    }
    out
}

/// Per variable in D-Rec's order, the [`BALL`] variables nearest it along the edges (breadth
/// first), each set once: a move that must change a producer, its consumers and their
/// gradients together (a column-parallel product, its activation and the row-parallel
/// product after it, forward and backward) lies in one neighbourhood, though D-Rec's order
/// scatters it.
fn neighbourhoods(p: &Problem, shared: &Shared) -> Vec<Vec<usize>> {
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    let mut mark = vec![usize::MAX; p.vars.len()];
    for (i, &v) in shared.order.iter().enumerate() {
        let mut ball = vec![v];
        mark[v] = i;
        let mut at = 0;
        while at < ball.len() && ball.len() < BALL {
            for &(_, w, _) in &shared.inc[ball[at]] {
                if mark[w] != i && ball.len() < BALL {
                    mark[w] = i;
                    ball.push(w);
                }
            }
            at += 1;
        }
        let mut key = ball.clone();
        key.sort_unstable();
        if seen.insert(key) {
            out.push(ball);
        }
    }
    out
}

/// Variable `v`'s row in `locals` less its edges to the variables `inside` a group (their
/// choices as they stand): what `v` costs per strategy with everything outside the group as
/// it stands, before the group's own edges.
fn row_outside(
    p: &Problem,
    shared: &Shared,
    locals: &Locals,
    choice: &[usize],
    v: usize,
    inside: impl Fn(usize) -> bool,
) -> Vec<f64> {
    let mut row = locals.row(v).to_vec();
    for &(e, w, is_u) in &shared.inc[v] {
        if inside(w) {
            let table = seen(p, e, is_u);
            for (c, slot) in row.iter_mut().enumerate() {
                *slot -= table.at(c, choice[w]);
            }
        }
    }
    row
}

/// One exact pass over a forest of variables, the others as they stand: a min-sum dynamic
/// programme over each tree (each variable's row in `locals`, less its edges inside the
/// forest, plus those edges), which can move a whole path of variables together where moves
/// of one variable or one edge's two ends each cost more. Takes the best joint choice when
/// it lowers the objective and fits the budget; returns (whether it moved, whether the budget
/// stopped a better choice).
fn forest_pass(
    p: &Problem,
    shared: &Shared,
    members: &[usize],
    choice: &mut [usize],
    locals: &mut Locals,
    memory: &mut f64,
) -> (bool, bool) {
    let n = p.vars.len();
    let mut in_forest = vec![false; n];
    for &v in members {
        in_forest[v] = true;
    }
    // Each variable's own part: its row less the edges to other members (as they stand).
    let mut unary: Vec<Vec<f64>> = vec![Vec::new(); n];
    for &v in members {
        unary[v] = row_outside(p, shared, locals, choice, v, |w| in_forest[w]);
    }
    // Trees in breadth-first order from their first member; each non-root's edge to its
    // parent.
    let mut up: Vec<Option<(usize, usize, bool)>> = vec![None; n];
    let mut visited = vec![false; n];
    let mut bfs = Vec::with_capacity(members.len());
    for &r in members {
        if visited[r] {
            continue;
        }
        visited[r] = true;
        let first = bfs.len();
        bfs.push(r);
        let mut i = first;
        while i < bfs.len() {
            let v = bfs[i];
            i += 1;
            for &(e, w, is_u) in &shared.inc[v] {
                if in_forest[w] && !visited[w] {
                    visited[w] = true;
                    // Seen from `w`, the edge's other end is `v`.
                    up[w] = Some((v, e, !is_u));
                    bfs.push(w);
                }
            }
        }
    }
    // Leaves first: each variable's table (its part plus its children's messages) passes
    // to its parent, per strategy of the parent, the least over its own strategies.
    let mut acc = unary;
    let mut arg: Vec<Vec<usize>> = vec![Vec::new(); n];
    for &v in bfs.iter().rev() {
        let Some((parent, e, is_u)) = up[v] else {
            continue;
        };
        let table = seen(p, e, is_u);
        let kp = p.k(parent);
        let mut message = vec![f64::INFINITY; kp];
        let mut best = vec![0usize; kp];
        for (c, &a) in acc[v].iter().enumerate() {
            for (cp, x) in table.row(c).enumerate() {
                let cost = a + x;
                if cost < message[cp] {
                    (message[cp], best[cp]) = (cost, c);
                }
            }
        }
        for (slot, m) in acc[parent].iter_mut().zip(&message) {
            *slot += m;
        }
        arg[v] = best;
    }
    // Roots take their least; the rest follow their parents.
    let mut next = choice.to_vec();
    for &v in &bfs {
        match up[v] {
            None => {
                let row = &acc[v];
                let mut best = choice[v];
                for (c, &x) in row.iter().enumerate() {
                    if x < row[best] {
                        best = c;
                    }
                }
                next[v] = best;
            }
            Some((parent, _, _)) => next[v] = arg[v][next[parent]],
        }
    }
    // Judged on the whole objective, which also guards against the rounding of the rows.
    let (old, _) = p.evaluate(choice);
    let (new, new_memory) = p.evaluate(&next);
    if new >= old - 1e-12 * old.abs() {
        return (false, false);
    }
    if !p.fits(new_memory) {
        return (false, true);
    }
    for &v in members {
        if next[v] != choice[v] {
            locals.moved(p, shared, v, choice[v], next[v]);
            choice[v] = next[v];
        }
    }
    *memory = new_memory;
    (true, false)
}

/// Variables per window of [`window_pass`].
const WINDOW: usize = 8;
/// Variables of a neighbourhood of the polish ([`neighbourhoods`]).
const BALL: usize = 12;
/// Largest problem (variables) whose final polish also solves every neighbourhood: blocks
/// and layer tables (tens of variables) and small graphs. One exact solve per variable
/// costs several times the rest of the polish (the 1,000-op generated graphs on 2x4: 0.4 to
/// 0.6 s against 30 to 90 ms).
const NEIGHBOURHOOD_VARIABLES: usize = 1_000;
/// Largest factor a window's exact solve may build; a wider window is left as it stands.
const WINDOW_ENTRIES: f64 = 2e5;

/// Solves a window of variables exactly (the exact solver, under what the budget leaves
/// them), the rest as they stand: each variable's row less its edges inside the window, plus
/// those edges. Takes the window's optimum when it lowers the objective; returns whether it
/// moved.
fn window_pass(
    p: &Problem,
    shared: &Shared,
    members: &[usize],
    choice: &mut [usize],
    locals: &mut Locals,
    memory: &mut f64,
) -> bool {
    let mut index = vec![usize::MAX; p.vars.len()];
    for (i, &v) in members.iter().enumerate() {
        index[v] = i;
    }
    let mut sub = Problem::default();
    let mut held = 0.0;
    let mut current = 0.0;
    for &v in members {
        let row = row_outside(p, shared, locals, choice, v, |w| index[w] != usize::MAX);
        current += row[choice[v]];
        held += p.vars[v].memory[choice[v]];
        sub.vars.push(super::problem::Var {
            cost: row,
            memory: p.vars[v].memory.clone(),
        });
    }
    for &v in members {
        for &(e, w, is_u) in &shared.inc[v] {
            if is_u && index[w] != usize::MAX {
                let edge = &p.edges[e];
                current += edge.cost[choice[edge.u] * p.k(edge.v) + choice[edge.v]];
                sub.edges.push(super::problem::Edge {
                    u: index[edge.u],
                    v: index[edge.v],
                    cost: edge.cost.clone(),
                });
            }
        }
    }
    sub.memory_budget = p.memory_budget.map(|b| b - (*memory - held));
    let Ok(Some(best)) = super::exact::solve_checked(&sub, WINDOW_ENTRIES) else {
        return false;
    };
    if best.cost >= current - 1e-12 * current.abs() {
        return false;
    }
    for (i, &v) in members.iter().enumerate() {
        if best.choice[i] != choice[v] {
            locals.moved(p, shared, v, choice[v], best.choice[i]);
            choice[v] = best.choice[i];
        }
    }
    *memory = *memory - held + best.memory;
    true
}

/// Moves variables to leaner strategies until `choice` fits the budget: in passes, each
/// over the variables in order of the least extra cost per byte saved (computed at the start
/// of the pass), each taking its own best such move as things stand (`locals` kept up to
/// date). Ends because every move saves memory and the all-leanest plan fits, which
/// [`solve`] checks first; `None` were no move left. Returns the number of moves.
fn repair(
    p: &Problem,
    shared: &Shared,
    choice: &mut [usize],
    locals: &mut Locals,
) -> Option<usize> {
    let Some(budget) = p.memory_budget else {
        return Some(0);
    };
    let mut memory = p.evaluate(choice).1;
    // The move of `v` of least extra cost per byte saved: (ratio, strategy, bytes saved).
    let best_move = |v: usize, choice: &[usize], locals: &Locals| -> Option<(f64, usize, f64)> {
        let row = locals.row(v);
        let (now_cost, now_mem) = (row[choice[v]], p.vars[v].memory[choice[v]]);
        (0..p.k(v))
            .filter(|&c| p.vars[v].memory[c] < now_mem)
            .map(|c| {
                let saved = now_mem - p.vars[v].memory[c];
                ((row[c] - now_cost) / saved, c, saved)
            })
            .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)))
    };
    let mut moves = 0;
    while !super::problem::within_budget(memory, budget) {
        let mut pass: Vec<(f64, usize)> = (0..p.vars.len())
            .filter_map(|v| best_move(v, choice, locals).map(|(r, _, _)| (r, v)))
            .collect();
        if pass.is_empty() {
            // Unreachable while the leanest plan fits; never loop.
            return None;
        }
        pass.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        for (_, v) in pass {
            if let Some((_, c, saved)) = best_move(v, choice, locals) {
                locals.moved(p, shared, v, choice[v], c);
                choice[v] = c;
                memory -= saved;
                moves += 1;
                if super::problem::within_budget(memory, budget) {
                    break;
                }
            }
        }
        // Recompute rather than trust the running sum's rounding.
        memory = p.evaluate(choice).1;
    }
    Some(moves)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::solve::intra::problem::testing::random;
    use crate::solve::intra::problem::{Edge, Var};
    use proptest::prelude::*;

    fn var(cost: &[f64], memory: &[f64]) -> Var {
        Var {
            cost: cost.to_vec(),
            memory: memory.to_vec(),
        }
    }

    /// Two operators on one axis: strategy 0 replicated (dear), 1 and 2 cutting dimensions 1
    /// and 2; redistribution costs 5 unless both cut alike.
    fn pair(budget: Option<f64>) -> (Problem, Vec<Vec<[Cut; 2]>>) {
        let p = Problem {
            vars: vec![
                var(&[20.0, 1.0, 2.0], &[4.0, 2.0, 2.0]),
                var(&[20.0, 3.0, 1.0], &[4.0, 2.0, 1.0]),
            ],
            edges: vec![Edge {
                u: 0,
                v: 1,
                cost: vec![0.0, 5.0, 5.0, 5.0, 0.0, 5.0, 5.0, 5.0, 0.0].into(),
            }],
            memory_budget: budget,
        };
        let cuts = vec![vec![[0, 0], [1, 0], [2, 0]]; 2];
        (p, cuts)
    }

    /// D-Rec on `p` with every variable forced or none, cutting `levels`.
    fn drec(
        p: &Problem,
        cuts: &[Vec<[Cut; 2]>],
        forced: bool,
        levels: &[usize],
    ) -> Option<Outcome> {
        solve(&Input {
            problem: p,
            cuts,
            forced: &vec![forced; p.vars.len()],
            levels,
            neighbourhoods: true,
        })
    }

    #[test]
    fn operators_cut_and_follow_their_placed_neighbours() {
        let (p, cuts) = pair(None);
        let out = drec(&p, &cuts, true, &[0]).expect("no budget");
        // Variable 1 is the heavier: placed first, it takes its cheapest cut (2); variable 0
        // follows it (2 + 0 < 1 + 5).
        assert_eq!(out.choice, vec![2, 2]);
        assert!(out.uncut.is_empty() && out.skipped.is_empty());
        assert_eq!(out.repaired, 0);
    }

    #[test]
    fn nothing_to_cut_stays_replicated_and_is_reported() {
        let p = Problem {
            vars: vec![var(&[1.0], &[1.0])],
            edges: vec![],
            memory_budget: None,
        };
        let out = drec(&p, &[vec![[0, 0]]], true, &[0, 1]).expect("no budget");
        assert_eq!(out.choice, vec![0]);
        assert_eq!(out.uncut, vec![(0, 0), (0, 1)]);
        assert_eq!(out.skipped, vec![0, 1]);
    }

    #[test]
    fn a_variable_without_its_replicated_strategy_keeps_what_it_is_allowed() {
        // Variable 0 may only cut axis 1 (a boundary pinned by a chain), variable 1 anything.
        let p = Problem {
            vars: vec![var(&[1.0], &[1.0]), var(&[3.0, 1.0, 2.0], &[1.0, 1.0, 1.0])],
            edges: vec![Edge {
                u: 0,
                v: 1,
                cost: vec![5.0, 5.0, 0.0].into(),
            }],
            memory_budget: None,
        };
        let cuts = vec![vec![[0, 1]], vec![[0, 0], [1, 0], [0, 1]]];
        let out = drec(&p, &cuts, true, &[0, 1]).expect("no budget");
        assert_eq!(out.choice, vec![0, 2]);
        let (cost, _) = p.evaluate(&out.choice);
        assert_eq!(cost, 3.0);
    }

    #[test]
    fn a_level_whose_cuts_cost_more_is_left_uncut() {
        // Cutting (strategies 1, 2) costs more than staying whole: no operator cuts the axis
        // (the run that skips the level finds it; the refinement of the run that cuts it
        // reaches it too).
        let (mut p, cuts) = pair(None);
        p.vars[0].cost[0] = 0.0;
        p.vars[1].cost[0] = 0.0;
        let out = drec(&p, &cuts, true, &[0]).expect("no budget");
        assert_eq!(out.choice, vec![0, 0]);
    }

    /// Three variables that must move together: each is cheaper on strategy 1, but any
    /// edge between different strategies costs 10. `edges` pairs the variables.
    fn stuck(edges: &[(usize, usize)]) -> (Problem, Outcome) {
        let p = Problem {
            vars: vec![var(&[2.0, 1.0], &[1.0, 1.0]); 3],
            edges: edges
                .iter()
                .map(|&(u, v)| Edge {
                    u,
                    v,
                    cost: vec![0.0, 10.0, 10.0, 0.0].into(),
                })
                .collect(),
            memory_budget: None,
        };
        let out = Outcome {
            choice: vec![0; 3],
            uncut: Vec::new(),
            skipped: Vec::new(),
            repaired: 0,
            bound: false,
        };
        (p, out)
    }

    #[test]
    fn the_polish_moves_paths_and_cycles_that_single_and_paired_moves_cannot() {
        for edges in [vec![(0, 1), (1, 2)], vec![(0, 1), (1, 2), (0, 2)]] {
            let (p, out) = stuck(&edges);
            let shared = Shared::new(&p, false);
            // The refinement alone is stuck at 6: every move of one or two variables costs
            // more.
            let mut choice = out.choice.clone();
            let mut locals = Locals::new(&p, &choice);
            assert!(!refine(&p, &shared, &mut choice, &mut locals));
            assert_eq!(choice, vec![0; 3]);
            // The polish moves all three (a window holds them, path or triangle).
            let polished = polish(&p, &shared, out, &[]);
            assert_eq!(polished.choice, vec![1; 3], "{edges:?}");
            assert_eq!(p.evaluate(&polished.choice).0, 3.0);
        }
        // The forests alone move a path, not a triangle (one of its variables is in a
        // second forest).
        let (p, _) = stuck(&[(0, 1), (1, 2)]);
        let shared = Shared::new(&p, false);
        let cover = forests(&p, &shared);
        assert_eq!(cover.len(), 1);
        let (mut choice, mut memory) = (vec![0; 3], 3.0);
        let mut locals = Locals::new(&p, &choice);
        let moved = forest_pass(
            &p,
            &shared,
            &cover[0],
            &mut choice,
            &mut locals,
            &mut memory,
        );
        assert_eq!((moved, choice), ((true, false), vec![1; 3]));
        let (p, _) = stuck(&[(0, 1), (1, 2), (0, 2)]);
        assert_eq!(forests(&p, &Shared::new(&p, false)).len(), 2);
    }

    #[test]
    fn the_polish_keeps_the_budget() {
        // Strategy 1 is cheaper but needs 2 bytes: 4 bytes allowed, so no more than one
        // variable could move, and none alone gains.
        let (mut p, out) = stuck(&[(0, 1), (1, 2)]);
        for v in &mut p.vars {
            v.memory = vec![1.0, 2.0];
        }
        p.memory_budget = Some(4.0);
        let polished = polish(&p, &Shared::new(&p, false), out, &[]);
        assert_eq!(polished.choice, vec![0; 3]);
    }

    #[test]
    fn above_the_polish_size_the_best_greedy_plans_are_refined() {
        // A chain of more variables than the polish takes, on two levels; a budget halfway.
        let n = POLISH_VARIABLES + 200;
        let cuts: Vec<Vec<[Cut; 2]>> = (0..n)
            .map(|_| vec![[0, 0], [1, 0], [0, 1], [1, 1], [2, 0]])
            .collect();
        let forced: Vec<bool> = (0..n).map(|v| v % 3 != 0).collect();
        // A chain, and an edge from each variable to one far away.
        let pairs: Vec<(usize, usize)> = (1..n)
            .flat_map(|v| [(v - 1, v), (v, (v * 7919 + 13) % n)])
            .collect();
        for (budget, seed) in [(1.5, 7), (1.5, 11), (0.5, 7)] {
            let p = random(&vec![5; n], pairs.clone(), budget, seed);
            let input = Input {
                problem: &p,
                cuts: &cuts,
                forced: &forced,
                levels: &[0, 1],
                neighbourhoods: false,
            };
            let out = solve(&input).expect("the leanest plan fits");
            let (cost, memory) = p.evaluate(&out.choice);
            assert!(p.fits(memory));
            // The best repaired greedy plan of the level orders, refined: D-Rec's plan is
            // the best of the refined ones, so never worse than this one.
            let (mut shared, strategies) = (Shared::new(&p, false), Strategies::new(&cuts));
            shared.cuts = strategies;
            let runs = greedy_runs(&input, &shared, 0.0);
            assert_eq!(runs.len(), 5);
            let (mut best, locals) = runs
                .into_iter()
                .map(|(_, _, plan)| repaired(&input, &shared, plan).expect("repaired"))
                .min_by(|a, b| {
                    p.evaluate(&a.0.choice)
                        .0
                        .total_cmp(&p.evaluate(&b.0.choice).0)
                })
                .expect("five runs");
            let mut locals = locals.unwrap_or_else(|| Locals::new(&p, &best.choice));
            refine(&p, &shared, &mut best.choice, &mut locals);
            let refined = p.evaluate(&best.choice).0;
            assert!(
                cost <= refined,
                "budget {budget}, seed {seed}: {cost} above the best greedy plan refined, \
                 {refined}"
            );
        }
    }

    #[test]
    fn a_plan_over_the_budget_is_repaired_or_refused() {
        // A budget of 2 is below the leanest plan's memory (2 + 1): refused.
        let (p, cuts) = pair(Some(2.0));
        assert_eq!(drec(&p, &cuts, false, &[0]), None);
        // Replication cheap and fat (memory 8) under a budget of 4.
        let (mut p, cuts) = pair(Some(4.0));
        p.vars[0].cost[0] = 0.0;
        p.vars[1].cost[0] = 0.0;
        let out = drec(&p, &cuts, false, &[0]).expect("the leanest plan fits");
        let (_, memory) = p.evaluate(&out.choice);
        assert!(memory <= 4.0, "{out:?}");
    }

    /// A random problem on a 2-axis mesh: per variable, strategies each cutting a dimension
    /// (0 = none, 1..=2) on each axis, one of them replicated.
    fn instance() -> impl Strategy<Value = (Problem, Vec<Vec<[Cut; 2]>>, Vec<bool>)> {
        (1usize..=6)
            .prop_flat_map(|n| {
                (
                    proptest::collection::vec(proptest::collection::vec(0u16..3, 2..=5), n),
                    proptest::collection::vec((0usize..n, 0usize..n), 0..=8),
                    proptest::collection::vec(any::<bool>(), n),
                    0.0f64..1.3,
                    any::<u64>(),
                )
            })
            .prop_map(|(codes, pairs, forced, budget_frac, seed)| {
                // Strategy 0 is replicated; the others cut by their codes.
                let cuts: Vec<Vec<[Cut; 2]>> = codes
                    .iter()
                    .map(|c| {
                        std::iter::once([0, 0])
                            .chain(c.iter().enumerate().map(|(i, &x)| [x, (i % 3) as Cut]))
                            .collect()
                    })
                    .collect();
                let ks: Vec<usize> = cuts.iter().map(Vec::len).collect();
                (random(&ks, pairs, budget_frac, seed), cuts, forced)
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        /// D-Rec finds a plan exactly when one fits, never one over the budget, never one
        /// below the optimum, and its objective is what it reports.
        #[test]
        fn drec_is_feasible_exactly_when_the_problem_is(
            (p, cuts, forced) in instance(),
        ) {
            let optimum = p.brute_force();
            let out = solve(&Input { problem: &p, cuts: &cuts, forced: &forced, levels: &[0, 1], neighbourhoods: true });
            prop_assert_eq!(optimum.is_some(), out.is_some());
            if let (Some(best), Some(out)) = (optimum, out) {
                let (cost, memory) = p.evaluate(&out.choice);
                prop_assert!(p.fits(memory), "{} over the budget", memory);
                prop_assert!(cost >= best.cost - 1e-9 * best.cost.abs());
                for (v, &c) in out.choice.iter().enumerate() {
                    prop_assert!(c < p.k(v));
                }
            }
        }
    }
}
