//! The exact combinatorial solver: variable elimination (bucket elimination) along a min-fill
//! order. Transformer layer graphs are chains with short skip connections (residuals, saved
//! activations, weight updates), so the factors stay small.
//!
//! 1. Min-sum elimination of the objective alone. If that optimum fits the budget it is the
//!    answer (the usual case: a budget is there to exclude plans, not to shape them).
//! 2. Otherwise the leanest plan (memory is a sum over variables) either does not fit (the
//!    problem is infeasible) or starts a walk along the lower convex hull of (cost, memory) with the
//!    Lagrangian `cost + λ·memory` gives the best hull plan that fits (an upper bound) and
//!    the dual bound. When they meet, that plan is optimal.
//! 3. Otherwise the same elimination carries, per factor entry, a Pareto front of (cost,
//!    memory) points. Points that cannot lead to a plan that fits, or to one better than the
//!    upper bound, are dropped: the rest of the problem is bounded below by "outside" messages
//!    of the min-sum passes (objective, memory, Lagrangian). The cheapest point of the final
//!    front is the optimum; each point remembers how it was formed, so the assignment is read
//!    back without a second search.

use super::problem::{Assignment, Problem, within_budget};

/// Largest number of entries of any factor the elimination would build, along the order.
fn order_and_width(p: &Problem) -> (Vec<usize>, f64) {
    order_and_width_keeping(p, &[])
}

/// The min-fill order of every variable except those in `keep`, and the largest factor it
/// builds (the final table over `keep` included).
fn order_and_width_keeping(p: &Problem, keep: &[usize]) -> (Vec<usize>, f64) {
    let n = p.vars.len();
    let k: Vec<f64> = (0..n).map(|v| p.k(v) as f64).collect();
    let mut adj: Vec<std::collections::BTreeSet<usize>> = vec![Default::default(); n];
    for e in &p.edges {
        adj[e.u].insert(e.v);
        adj[e.v].insert(e.u);
    }
    let mut alive = vec![true; n];
    let mut order = Vec::with_capacity(n);
    let mut width: f64 = keep.iter().map(|&v| k[v]).product();
    for _ in 0..n {
        // Min-fill, ties by the size of the factor made, then by index.
        let mut best: Option<(usize, f64, usize)> = None;
        for v in (0..n).filter(|&v| alive[v] && !keep.contains(&v)) {
            let nb: Vec<usize> = adj[v].iter().copied().filter(|&u| alive[u]).collect();
            let mut fill = 0;
            for (i, &a) in nb.iter().enumerate() {
                for &b in &nb[i + 1..] {
                    if !adj[a].contains(&b) {
                        fill += 1;
                    }
                }
            }
            let size: f64 = nb.iter().map(|&u| k[u]).product::<f64>() * k[v];
            if best.is_none_or(|(f, s, _)| (fill, size) < (f, s)) {
                best = Some((fill, size, v));
            }
        }
        let Some((_, size, v)) = best else {
            break;
        };
        width = width.max(size);
        let nb: Vec<usize> = adj[v].iter().copied().filter(|&u| alive[u]).collect();
        for (i, &a) in nb.iter().enumerate() {
            for &b in &nb[i + 1..] {
                adj[a].insert(b);
                adj[b].insert(a);
            }
        }
        alive[v] = false;
        order.push(v);
    }
    (order, width)
}

/// Factor entries (the product of the domains in a factor's scope, eliminated variable
/// included) the elimination would need at most, along its order.
pub fn width(p: &Problem) -> f64 {
    order_and_width(p).1
}

/// What an elimination along the min-fill order builds, in factor entries.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Size {
    /// Entries of every factor the min-sum pass makes and keeps until the plans are read
    /// back (what bounds its memory: an f64 and a u32 each).
    pub stored: f64,
    /// Additions the pass runs: every bucket's entries times its members.
    pub work: f64,
}

/// An elimination of every variable of a problem except some kept ones, planned along the
/// min-fill order but not run: its [`Size`] decides whether to run it, and it runs with
/// [`marginal_planned`] on that problem or any other of the same variables, domain sizes and
/// edges (e.g. the problem with other values pinned).
pub struct Planned(Elimination);

impl Planned {
    /// Plans eliminating every variable of `p` except `keep`.
    pub fn keeping(p: &Problem, keep: &[usize]) -> Planned {
        let (order, _) = order_and_width_keeping(p, keep);
        Planned(Elimination::new(p, &order))
    }

    /// What it builds.
    pub fn size(&self) -> Size {
        self.0.size()
    }
}

/// Most points a front may keep before the problem is declared too big for this solver.
pub const FRONT_CAP: usize = 4096;

/// Why the exact solver declined.
#[derive(Debug, Clone, PartialEq)]
pub enum Declined {
    /// The elimination would build a factor of this many entries.
    TooWide(f64),
    /// A Pareto front grew past [`FRONT_CAP`].
    FrontTooLarge,
}

/// Most steps of the walk along the convex hull.
const HULL_STEPS: usize = 40;

/// One step of the elimination: variable `x` is eliminated from the factors `members`
/// (indices into the factor list: the problem's variables, then its edges, then the factors
/// made by earlier steps), making a factor over `scope`.
struct Bucket {
    x: usize,
    members: Vec<usize>,
    scope: Vec<usize>,
    /// Per member: its stride for each variable of `scope`, and for `x`.
    strides: Vec<(Vec<usize>, usize)>,
}

impl Bucket {
    /// Per member: its stride along the scope's last variable (0 when it does not hold it).
    fn along(&self) -> Vec<usize> {
        self.strides
            .iter()
            .map(|(stride, _)| stride.last().copied().unwrap_or(0))
            .collect()
    }
}

/// The elimination's structure, the same for every pass.
struct Elimination {
    /// Domain sizes.
    k: Vec<usize>,
    /// Scope of every factor (originals, then one per bucket).
    scopes: Vec<Vec<usize>>,
    buckets: Vec<Bucket>,
    /// Factors no bucket consumes: one made factor per connected component when every
    /// variable is eliminated; with some variables kept, every factor over kept ones only.
    roots: Vec<usize>,
}

impl Elimination {
    fn new(p: &Problem, order: &[usize]) -> Self {
        let n = p.vars.len();
        let k: Vec<usize> = (0..n).map(|v| p.k(v)).collect();
        let mut scopes: Vec<Vec<usize>> = (0..n)
            .map(|v| vec![v])
            .chain(p.edges.iter().map(|e| vec![e.u, e.v]))
            .collect();
        let mut live = vec![true; scopes.len()];
        let mut buckets = Vec::with_capacity(order.len());
        for &x in order {
            let members: Vec<usize> = (0..scopes.len())
                .filter(|&f| live[f] && scopes[f].contains(&x))
                .collect();
            let mut scope: Vec<usize> = members
                .iter()
                .flat_map(|&f| scopes[f].iter().copied())
                .filter(|&v| v != x)
                .collect();
            scope.sort_unstable();
            scope.dedup();
            let strides = members
                .iter()
                .map(|&f| {
                    let mut stride = vec![0usize; scope.len()];
                    let mut sx = 0;
                    let mut s = 1;
                    for &v in scopes[f].iter().rev() {
                        if v == x {
                            sx = s;
                        } else if let Some(i) = scope.iter().position(|&u| u == v) {
                            stride[i] = s;
                        }
                        s *= k[v];
                    }
                    (stride, sx)
                })
                .collect();
            for &f in &members {
                live[f] = false;
            }
            scopes.push(scope.clone());
            live.push(true);
            buckets.push(Bucket {
                x,
                members,
                scope,
                strides,
            });
        }
        let roots = (0..scopes.len()).filter(|&f| live[f]).collect();
        Elimination {
            k,
            scopes,
            buckets,
            roots,
        }
    }

    /// What this elimination builds.
    fn size(&self) -> Size {
        let mut size = Size {
            stored: 0.0,
            work: 0.0,
        };
        for b in &self.buckets {
            let entries: f64 = b.scope.iter().map(|&v| self.k[v] as f64).product();
            size.stored += entries;
            size.work += entries * self.k[b.x] as f64 * b.members.len() as f64;
        }
        size
    }

    /// Index of the factor bucket `b` makes.
    fn made(&self, b: usize) -> usize {
        self.scopes.len() - self.buckets.len() + b
    }

    /// Calls `f(entry, bases)` for every entry of bucket `b`'s scope (last variable fastest),
    /// with each member's index at that entry and `x = 0`.
    fn for_each_entry(&self, b: usize, mut f: impl FnMut(usize, &[usize])) {
        let bucket = &self.buckets[b];
        let row = bucket.scope.last().map_or(1, |&v| self.k[v]);
        let along = bucket.along();
        let mut at = vec![0usize; bucket.members.len()];
        self.for_each_row(b, |first, bases| {
            for j in 0..row {
                for ((a, &base), &s) in at.iter_mut().zip(bases).zip(&along) {
                    *a = base + j * s;
                }
                f(first + j, &at);
            }
        });
    }

    /// [`Elimination::for_each_entry`] a row at a time: calls `f(first, bases)` for every
    /// value of bucket `b`'s scope but its last variable, with the row's first entry and each
    /// member's index there (last variable and `x` at 0).
    fn for_each_row(&self, b: usize, mut f: impl FnMut(usize, &[usize])) {
        let bucket = &self.buckets[b];
        let outer = bucket.scope.len().saturating_sub(1);
        let ks: Vec<usize> = bucket.scope[..outer].iter().map(|&v| self.k[v]).collect();
        let row = bucket.scope.last().map_or(1, |&v| self.k[v]);
        let rows: usize = ks.iter().product();
        let mut values = vec![0usize; ks.len()];
        let mut bases = vec![0usize; bucket.members.len()];
        for r in 0..rows {
            f(r * row, &bases);
            for i in (0..ks.len()).rev() {
                values[i] += 1;
                if values[i] < ks[i] {
                    for (base, (stride, _)) in bases.iter_mut().zip(&bucket.strides) {
                        *base += stride[i];
                    }
                    break;
                }
                values[i] = 0;
                for (base, (stride, _)) in bases.iter_mut().zip(&bucket.strides) {
                    *base -= (ks[i] - 1) * stride[i];
                }
            }
        }
    }

    /// Entry of factor `f` under the assignment `choice`.
    fn entry(&self, f: usize, choice: &[usize]) -> usize {
        self.scopes[f]
            .iter()
            .fold(0, |idx, &v| idx * self.k[v] + choice[v])
    }
}

/// Sets (`first`) or adds to `sums[j]` the value `values[at + j * along]` for every `j`.
#[inline]
fn add_row(sums: &mut [f64], values: &[f64], at: usize, along: usize, first: bool) {
    let n = sums.len();
    match (along, first) {
        (0, true) => sums.fill(values[at]),
        (0, false) => {
            let v = values[at];
            sums.iter_mut().for_each(|s| *s += v);
        }
        (1, true) => sums.copy_from_slice(&values[at..at + n]),
        (1, false) => {
            for (s, &v) in sums.iter_mut().zip(&values[at..at + n]) {
                *s += v;
            }
        }
        (_, true) => {
            for (j, s) in sums.iter_mut().enumerate() {
                *s = values[at + j * along];
            }
        }
        (_, false) => {
            for (j, s) in sums.iter_mut().enumerate() {
                *s += values[at + j * along];
            }
        }
    }
}

/// A min-sum pass: every factor's values, and per made factor its variable's best value at
/// each entry.
struct Pass {
    values: Vec<Vec<f64>>,
    argmin: Vec<Vec<u32>>,
}

impl Pass {
    /// Minimises `cost + lambda * memory`.
    fn run(p: &Problem, el: &Elimination, lambda: f64) -> Pass {
        let mut values: Vec<Vec<f64>> = p
            .vars
            .iter()
            .map(|var| {
                var.cost
                    .iter()
                    .zip(&var.memory)
                    .map(|(c, m)| c + lambda * m)
                    .collect()
            })
            .chain(p.edges.iter().map(|e| e.cost.to_vec()))
            .collect();
        let mut argmin = Vec::with_capacity(el.buckets.len());
        let mut sums: Vec<f64> = Vec::new();
        for (b, bucket) in el.buckets.iter().enumerate() {
            let kx = el.k[bucket.x];
            let entries: usize = bucket.scope.iter().map(|&v| el.k[v]).product();
            let mut out = vec![f64::INFINITY; entries];
            let mut arg = vec![0u32; entries];
            // A row of entries at a time (the scope's last variable, fastest): for each value
            // of x, every member's values along the row are added at once, contiguous when the
            // member's own last variable is the row's. Per entry the sums and the choice are
            // those of one entry at a time: members added in order, the first least x kept.
            let row = bucket.scope.last().map_or(1, |&v| el.k[v]);
            let along = bucket.along();
            sums.resize(row, 0.0);
            el.for_each_row(b, |first, bases| {
                let out = &mut out[first..first + row];
                let arg = &mut arg[first..first + row];
                for x in 0..kx {
                    for (m, (((&f, &base), (_, sx)), &along)) in bucket
                        .members
                        .iter()
                        .zip(bases)
                        .zip(&bucket.strides)
                        .zip(&along)
                        .enumerate()
                    {
                        add_row(&mut sums, &values[f], base + x * sx, along, m == 0);
                    }
                    for ((o, a), &s) in out.iter_mut().zip(arg.iter_mut()).zip(&sums) {
                        if s < *o {
                            *o = s;
                            *a = x as u32;
                        }
                    }
                }
            });
            values.push(out);
            argmin.push(arg);
        }
        Pass { values, argmin }
    }

    /// The optimal assignment, read back in reverse elimination order.
    fn assignment(&self, p: &Problem, el: &Elimination) -> Assignment {
        let mut choice = vec![0usize; p.vars.len()];
        self.complete(el, &mut choice);
        let (cost, memory) = p.evaluate(&choice);
        Assignment {
            choice,
            cost,
            memory,
        }
    }

    /// Sets every eliminated variable of `choice` to its best value given the variables not
    /// eliminated (all of them when every variable is eliminated).
    fn complete(&self, el: &Elimination, choice: &mut [usize]) {
        for (b, bucket) in el.buckets.iter().enumerate().rev() {
            let idx = el.entry(el.made(b), choice);
            choice[bucket.x] = self.argmin[b][idx] as usize;
        }
    }

    /// The optimum of this pass's weight.
    fn optimum(&self, el: &Elimination) -> f64 {
        el.roots.iter().map(|&r| self.values[r][0]).sum()
    }

    /// Per made factor and entry, the least weight of all factors outside its subtree (what
    /// the rest of the problem adds to any point of that entry); empty for original factors.
    fn outside(&self, el: &Elimination) -> Vec<Vec<f64>> {
        let mut out: Vec<Vec<f64>> = vec![Vec::new(); el.scopes.len()];
        let total = self.optimum(el);
        for &r in &el.roots {
            out[r] = vec![total - self.values[r][0]];
        }
        let first_made = el.scopes.len() - el.buckets.len();
        for (b, bucket) in el.buckets.iter().enumerate().rev() {
            let t = el.made(b);
            let (lower, upper) = out.split_at_mut(t);
            let above = &upper[0];
            for &f in bucket.members.iter().filter(|&&f| f >= first_made) {
                lower[f] = vec![f64::INFINITY; self.values[f].len()];
            }
            let kx = el.k[bucket.x];
            el.for_each_entry(b, |e, bases| {
                for xv in 0..kx {
                    let mut h = above[e];
                    for ((&f, &base), (_, sx)) in
                        bucket.members.iter().zip(bases).zip(&bucket.strides)
                    {
                        h += self.values[f][base + xv * sx];
                    }
                    for ((&f, &base), (_, sx)) in
                        bucket.members.iter().zip(bases).zip(&bucket.strides)
                    {
                        if f >= first_made {
                            let i = base + xv * sx;
                            let rest = h - self.values[f][i];
                            if rest < lower[f][i] {
                                lower[f][i] = rest;
                            }
                        }
                    }
                }
            });
        }
        out
    }
}

/// Memory is a sum over variables (edges carry none), so its bounds need no pass: below a
/// factor, every variable eliminated in its subtree at its leanest; outside it, the scope's
/// variables as the entry sets them and every other variable at its leanest.
struct MemoryBounds {
    inside: Vec<f64>,
    outside: Vec<Vec<f64>>,
}

impl MemoryBounds {
    fn new(p: &Problem, el: &Elimination) -> Self {
        let least: Vec<f64> = p
            .vars
            .iter()
            .map(|v| v.memory.iter().copied().fold(f64::INFINITY, f64::min))
            .collect();
        let total: f64 = least.iter().sum();
        let first_made = el.scopes.len() - el.buckets.len();
        let mut inside = vec![0.0; el.scopes.len()];
        let mut outside = vec![Vec::new(); el.scopes.len()];
        for (b, bucket) in el.buckets.iter().enumerate() {
            let t = el.made(b);
            inside[t] = least[bucket.x]
                + bucket
                    .members
                    .iter()
                    .filter(|&&f| f >= first_made)
                    .map(|&f| inside[f])
                    .sum::<f64>();
            let others = total - inside[t] - bucket.scope.iter().map(|&v| least[v]).sum::<f64>();
            let entries: usize = bucket.scope.iter().map(|&v| el.k[v]).product();
            let mut values = vec![0usize; bucket.scope.len()];
            let mut out = Vec::with_capacity(entries);
            for _ in 0..entries {
                let scope: f64 = bucket
                    .scope
                    .iter()
                    .zip(&values)
                    .map(|(&v, &i)| p.vars[v].memory[i])
                    .sum();
                out.push(others + scope);
                for i in (0..values.len()).rev() {
                    values[i] += 1;
                    if values[i] < el.k[bucket.scope[i]] {
                        break;
                    }
                    values[i] = 0;
                }
            }
            outside[t] = out;
        }
        MemoryBounds { inside, outside }
    }
}

/// Limits every kept point must respect: it must still be able to fit the budget and to
/// reach an objective no worse than `upper`, given lower bounds on the rest of the problem.
/// (The objective alone is bounded only inside factors: its outside messages would cost a
/// pass and prune little beyond the Lagrangian's.)
struct Bounds<'a> {
    budget: f64,
    upper: f64,
    lambda: f64,
    /// The objective's pass: the least objective of any point of an entry.
    cost: &'a Pass,
    memory: MemoryBounds,
    /// The Lagrangian pass and its outside messages.
    lagrangian: (&'a Pass, Vec<Vec<f64>>),
}

/// Lower bounds on objective, memory and Lagrangian.
type Rest = (f64, f64, f64);

impl Bounds<'_> {
    fn outside(&self, f: usize, e: usize) -> Rest {
        (0.0, self.memory.outside[f][e], self.lagrangian.1[f][e])
    }

    /// Whether a point of entry `e` of factor `f` can be kept at all.
    fn entry_alive(&self, f: usize, e: usize) -> bool {
        let own = (
            self.cost.values[f][e],
            self.memory.inside[f],
            self.lagrangian.0.values[f][e],
        );
        self.keeps(own, self.outside(f, e))
    }

    /// Whether a point whose own (objective, memory, Lagrangian) is at least `own` can be
    /// kept when the rest adds at least `rest`.
    fn keeps(&self, own: Rest, rest: Rest) -> bool {
        let slack = |x: f64| x * (1.0 + 1e-9) + 1e-12;
        within_budget(own.1 + rest.1, self.budget)
            && own.0 + rest.0 <= slack(self.upper)
            && own.2 + rest.2 <= slack(self.upper + self.lambda * self.budget)
    }

    fn keeps_point(&self, c: f64, m: f64, rest: Rest) -> bool {
        self.keeps((c, m, c + self.lambda * m), rest)
    }
}

/// A (cost, memory) point and where it came from.
#[derive(Clone, Copy, Debug)]
struct Point {
    cost: f64,
    memory: f64,
    /// Index into the factor's provenance table (unused for original factors).
    origin: u32,
}

/// How a point of a made factor was formed: the eliminated variable's value and the point
/// chosen in each member factor.
#[derive(Clone, Debug)]
struct Origin {
    value: u32,
    parts: Vec<u32>,
}

/// A partial sum of points, one from each front combined so far.
type Partial = (f64, f64, Vec<u32>);

/// Sorts by cost and keeps the points no other beats on both cost and memory.
fn pareto(mut pts: Vec<Partial>) -> Vec<Partial> {
    pts.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)));
    let mut kept: Vec<Partial> = Vec::with_capacity(pts.len());
    for item in pts {
        if kept
            .last()
            .is_none_or(|q| item.1 < q.1 - 1e-9 * q.1.abs().max(1.0))
        {
            kept.push(item);
        }
    }
    kept
}

/// The Pareto front of the sums of one point from each of `fronts`, keeping only what
/// `bounds` allows given `outside` for the rest of the problem.
fn combine(fronts: &[&[Point]], outside: Rest, bounds: &Bounds) -> Result<Vec<Partial>, Declined> {
    // What the fronts not yet added contribute at least.
    let mut suffix = vec![(0.0, 0.0, 0.0); fronts.len() + 1];
    for (i, front) in fronts.iter().enumerate().rev() {
        let c = front.iter().map(|p| p.cost).fold(f64::INFINITY, f64::min);
        let m = front.iter().map(|p| p.memory).fold(f64::INFINITY, f64::min);
        let l = front
            .iter()
            .map(|p| p.cost + bounds.lambda * p.memory)
            .fold(f64::INFINITY, f64::min);
        let s = suffix[i + 1];
        suffix[i] = (s.0 + c, s.1 + m, s.2 + l);
    }
    let mut acc: Vec<Partial> = vec![(0.0, 0.0, Vec::new())];
    for (i, front) in fronts.iter().enumerate() {
        let s = suffix[i + 1];
        let rest = (outside.0 + s.0, outside.1 + s.1, outside.2 + s.2);
        let mut next = Vec::with_capacity(acc.len() * front.len());
        for (c, m, parts) in &acc {
            for (pi, pt) in front.iter().enumerate() {
                let (c, m) = (c + pt.cost, m + pt.memory);
                if bounds.keeps_point(c, m, rest) {
                    let mut parts = parts.clone();
                    parts.push(pi as u32);
                    next.push((c, m, parts));
                }
            }
        }
        acc = pareto(next);
        if acc.len() > FRONT_CAP {
            return Err(Declined::FrontTooLarge);
        }
    }
    Ok(acc)
}

/// The least cost of `p` for every joint choice of the variables `keep` (the memory budget
/// is not applied), with the memory of a plan that reaches it.
#[derive(Clone, Debug, PartialEq)]
pub struct Marginal {
    /// Domain size of each kept variable, in the order given.
    pub k: Vec<usize>,
    /// Per joint choice (row-major over the kept variables, the last fastest): least cost.
    pub cost: Vec<f64>,
    /// Per joint choice: memory of the plan that reaches that cost.
    pub memory: Vec<f64>,
}

/// Eliminates every variable of `p` except `keep` (distinct) and tabulates the least cost
/// for each joint choice of the kept ones: what a layer contributes to a chain of layers
/// whose only shared variables are its boundary specs (ALGORITHMS.md §3). Exact; the memory
/// budget is not applied (a caller adds memory along the chain).
pub fn marginal(p: &Problem, keep: &[usize], max_entries: f64) -> Result<Marginal, Declined> {
    let (k, values) = marginal_with(p, keep, max_entries, |choice| p.evaluate(choice))?;
    let (cost, memory) = values.into_iter().unzip();
    Ok(Marginal { k, cost, memory })
}

/// [`marginal`], reading each joint choice's best plan through `f` (the plan as one choice
/// per variable of `p`): the kept variables' domain sizes, and `f` of each entry's plan,
/// row-major over the kept variables. `max_entries` bounds the entries the pass stores
/// ([`Size::stored`]: its memory), the final table over `keep` included.
pub fn marginal_with<T>(
    p: &Problem,
    keep: &[usize],
    max_entries: f64,
    f: impl FnMut(&[usize]) -> T,
) -> Result<(Vec<usize>, Vec<T>), Declined> {
    marginal_planned(p, &Planned::keeping(p, keep), keep, max_entries, f)
}

/// [`marginal_with`] along an elimination already planned for `keep` on a problem shaped as
/// `p` ([`Planned`]).
pub fn marginal_planned<T>(
    p: &Problem,
    planned: &Planned,
    keep: &[usize],
    max_entries: f64,
    mut f: impl FnMut(&[usize]) -> T,
) -> Result<(Vec<usize>, Vec<T>), Declined> {
    let el = &planned.0;
    let kept: f64 = keep.iter().map(|&v| p.k(v) as f64).product();
    let stored = el.size().stored + kept;
    if stored > max_entries {
        return Err(Declined::TooWide(stored));
    }
    let pass = Pass::run(p, el, 0.0);
    let k: Vec<usize> = keep.iter().map(|&v| p.k(v)).collect();
    let entries: usize = k.iter().product();
    let mut out = Vec::with_capacity(entries);
    let mut choice = vec![0usize; p.vars.len()];
    let mut joint = vec![0usize; keep.len()];
    for _ in 0..entries {
        for (&v, &c) in keep.iter().zip(&joint) {
            choice[v] = c;
        }
        pass.complete(el, &mut choice);
        out.push(f(&choice));
        for i in (0..joint.len()).rev() {
            joint[i] += 1;
            if joint[i] < k[i] {
                break;
            }
            joint[i] = 0;
        }
    }
    Ok((k, out))
}

/// Solves `p` exactly: `Ok(Some(..))` the optimum, `Ok(None)` nothing fits the budget,
/// `Err(..)` the problem is too large for this solver.
pub fn solve_checked(p: &Problem, max_entries: f64) -> Result<Option<Assignment>, Declined> {
    let (order, w) = order_and_width(p);
    if w > max_entries {
        return Err(Declined::TooWide(w));
    }
    let el = Elimination::new(p, &order);
    let free_pass = Pass::run(p, &el, 0.0);
    let free = free_pass.assignment(p, &el);
    let Some(budget) = p.memory_budget.filter(|_| !p.fits(free.memory)) else {
        return Ok(Some(free));
    };
    let lean = p.leanest();
    if !p.fits(lean.memory) {
        return Ok(None);
    }
    let tol = |x: f64| 1e-9 * x.abs().max(1e-12);
    if lean.cost <= free.cost + tol(free.cost) {
        return Ok(Some(lean));
    }
    // Walk the lower convex hull between the best plan that fits and the best that does not.
    let (mut fits, mut over) = (lean, free);
    let (mut lambda, mut pass) = (0.0, None);
    for _ in 0..HULL_STEPS {
        let l = (fits.cost - over.cost) / (over.memory - fits.memory);
        if !(l.is_finite() && l > 0.0) {
            break;
        }
        let run = Pass::run(p, &el, l);
        let a = run.assignment(p, &el);
        let line = fits.cost + l * fits.memory;
        let below = a.cost + l * a.memory < line - tol(line);
        (lambda, pass) = (l, Some(run));
        if !below {
            break;
        }
        if p.fits(a.memory) {
            fits = a;
        } else {
            over = a;
        }
    }
    let lagrangian_pass = pass.as_ref().unwrap_or(&free_pass);
    // Every plan that fits costs at least the dual bound.
    let dual = lagrangian_pass.optimum(&el) - lambda * budget;
    if fits.cost <= dual + tol(dual) {
        return Ok(Some(fits));
    }
    let bounds = Bounds {
        budget,
        upper: fits.cost,
        lambda,
        cost: &free_pass,
        memory: MemoryBounds::new(p, &el),
        lagrangian: (lagrangian_pass, lagrangian_pass.outside(&el)),
    };
    Ok(Some(pareto_search(p, &el, &bounds)?.unwrap_or(fits)))
}

/// Bucket elimination of (cost, memory) Pareto fronts within `bounds`; `None` when nothing
/// beats the upper bound.
fn pareto_search(
    p: &Problem,
    el: &Elimination,
    bounds: &Bounds,
) -> Result<Option<Assignment>, Declined> {
    let single = |cost: f64, memory: f64| {
        vec![Point {
            cost,
            memory,
            origin: 0,
        }]
    };
    let mut fronts: Vec<Vec<Vec<Point>>> = p
        .vars
        .iter()
        .map(|var| {
            var.cost
                .iter()
                .zip(&var.memory)
                .map(|(&c, &m)| single(c, m))
                .collect()
        })
        .chain(
            p.edges
                .iter()
                .map(|e| e.cost.iter().map(|&c| single(c, 0.0)).collect()),
        )
        .collect();
    let mut origins: Vec<Vec<Origin>> = Vec::with_capacity(el.buckets.len());
    for (b, bucket) in el.buckets.iter().enumerate() {
        let t = el.made(b);
        let entries: usize = bucket.scope.iter().map(|&v| el.k[v]).product();
        let mut made: Vec<Vec<Point>> = Vec::with_capacity(entries);
        let mut made_origins: Vec<Origin> = Vec::new();
        let mut failure = None;
        el.for_each_entry(b, |e, bases| {
            if failure.is_some() {
                return;
            }
            if !bounds.entry_alive(t, e) {
                made.push(Vec::new());
                return;
            }
            let outside = bounds.outside(t, e);
            let mut candidates: Vec<Partial> = Vec::new();
            for xv in 0..el.k[bucket.x] {
                let members: Vec<&[Point]> = bucket
                    .members
                    .iter()
                    .zip(bases)
                    .zip(&bucket.strides)
                    .map(|((&f, &base), (_, sx))| fronts[f][base + xv * sx].as_slice())
                    .collect();
                match combine(&members, outside, bounds) {
                    Ok(sums) => candidates.extend(sums.into_iter().map(|(c, m, mut parts)| {
                        parts.push(xv as u32);
                        (c, m, parts)
                    })),
                    Err(d) => failure = Some(d),
                }
            }
            let front = pareto(candidates);
            if front.len() > FRONT_CAP {
                failure = Some(Declined::FrontTooLarge);
            }
            made.push(
                front
                    .into_iter()
                    .map(|(cost, memory, mut parts)| {
                        let value = parts.pop().unwrap_or(0);
                        made_origins.push(Origin { value, parts });
                        Point {
                            cost,
                            memory,
                            origin: (made_origins.len() - 1) as u32,
                        }
                    })
                    .collect(),
            );
        });
        if let Some(d) = failure {
            return Err(d);
        }
        fronts.push(made);
        origins.push(made_origins);
    }
    // The components' fronts are summed: the budget couples them.
    let roots: Vec<&[Point]> = el.roots.iter().map(|&r| fronts[r][0].as_slice()).collect();
    let Some((_, _, picks)) = combine(&roots, (0.0, 0.0, 0.0), bounds)?.into_iter().next() else {
        return Ok(None);
    };
    let first_made = el.scopes.len() - el.buckets.len();
    let mut choice = vec![0usize; p.vars.len()];
    let mut stack: Vec<(usize, Point)> = el
        .roots
        .iter()
        .zip(&picks)
        .map(|(&r, &pick)| (r, fronts[r][0][pick as usize]))
        .collect();
    // Parents are popped before their members, so every scope is assigned when read.
    while let Some((f, pt)) = stack.pop() {
        if f < first_made {
            continue;
        }
        let b = f - first_made;
        let bucket = &el.buckets[b];
        let origin = &origins[b][pt.origin as usize];
        choice[bucket.x] = origin.value as usize;
        for (&member, &pi) in bucket.members.iter().zip(&origin.parts) {
            let idx = el.entry(member, &choice);
            stack.push((member, fronts[member][idx][pi as usize]));
        }
    }
    let (cost, memory) = p.evaluate(&choice);
    Ok(Some(Assignment {
        choice,
        cost,
        memory,
    }))
}
