//! The exact combinatorial solver: variable elimination (bucket elimination) along a min-fill
//! order. Transformer layer graphs are chains with short skip connections (residuals, saved
//! activations, weight updates), so the factors stay small.
//!
//! With a memory budget every factor entry holds a Pareto front of (cost, memory) points
//! instead of one cost, pruned of dominated points and of points over the budget; the optimum
//! is the cheapest point of the final front, which makes the solver exact for the constrained
//! problem too. Each point remembers how it was formed, so the assignment is read back
//! without a second search.

use super::problem::{Assignment, Problem};

/// A (cost, memory) point and where it came from.
#[derive(Clone, Copy, Debug)]
struct Point {
    cost: f64,
    memory: f64,
    /// Index into the factor's provenance table (`u32::MAX` for original factors).
    origin: u32,
}

/// How a point of an eliminated factor was formed: the eliminated variable's value and the
/// point chosen in each factor that was combined.
#[derive(Clone, Debug)]
struct Origin {
    value: u32,
    parts: Vec<u32>,
}

struct Factor {
    /// Variables, in order; the entry of an assignment is mixed-radix in this order.
    scope: Vec<usize>,
    /// One Pareto front per entry.
    fronts: Vec<Vec<Point>>,
    origins: Vec<Origin>,
    /// For factors made by eliminating a variable: it, and the factors combined.
    made_from: Option<(usize, Vec<usize>)>,
}

/// Keeps the points no other beats on both cost and memory (and, with a budget, that fit),
/// sorted by cost; at most `cap` of them.
fn prune(mut pts: Vec<Point>, budget: Option<f64>, cap: usize) -> Option<Vec<Point>> {
    if let Some(b) = budget {
        pts.retain(|p| p.memory <= b * (1.0 + 1e-12) + 1e-9);
    }
    pts.sort_by(|a, b| {
        a.cost
            .total_cmp(&b.cost)
            .then(a.memory.total_cmp(&b.memory))
    });
    let mut out: Vec<Point> = Vec::with_capacity(pts.len().min(cap));
    for p in pts {
        if out
            .last()
            .is_none_or(|q: &Point| p.memory < q.memory - 1e-9)
        {
            out.push(p);
        }
    }
    (out.len() <= cap).then_some(out)
}

/// Entry index of an assignment of `scope` (values looked up in `value`).
fn entry(scope: &[usize], k: &[usize], value: &dyn Fn(usize) -> usize) -> usize {
    let mut idx = 0;
    for &v in scope {
        idx = idx * k[v] + value(v);
    }
    idx
}

/// Largest number of entries of any factor the elimination would build, along the order.
fn order_and_width(p: &Problem) -> (Vec<usize>, f64) {
    let n = p.vars.len();
    let k: Vec<f64> = (0..n).map(|v| p.k(v) as f64).collect();
    let mut adj: Vec<std::collections::BTreeSet<usize>> = vec![Default::default(); n];
    for e in &p.edges {
        adj[e.u].insert(e.v);
        adj[e.v].insert(e.u);
    }
    let mut alive = vec![true; n];
    let mut order = Vec::with_capacity(n);
    let mut width = 1.0f64;
    for _ in 0..n {
        // Min-fill, ties by the size of the factor made, then by index.
        let mut best: Option<(usize, f64, usize)> = None;
        for v in (0..n).filter(|&v| alive[v]) {
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

/// Most points a front may keep before the problem is declared too big for this solver.
pub const FRONT_CAP: usize = 512;

/// Why the exact solver declined.
#[derive(Debug, Clone, PartialEq)]
pub enum Declined {
    /// The elimination would build a factor of this many entries.
    TooWide(f64),
    /// A Pareto front grew past [`FRONT_CAP`].
    FrontTooLarge,
}

/// Solves `p` exactly: `Ok(Some(..))` the optimum, `Ok(None)` nothing fits the budget,
/// `Err(..)` the problem is too large for this solver.
pub fn solve_checked(p: &Problem, max_entries: f64) -> Result<Option<Assignment>, Declined> {
    let n = p.vars.len();
    let k: Vec<usize> = (0..n).map(|v| p.k(v)).collect();
    let (order, w) = order_and_width(p);
    if w > max_entries {
        return Err(Declined::TooWide(w));
    }
    // The unconstrained optimum is also the constrained one when it fits, and finding it is
    // far cheaper than carrying Pareto fronts.
    let free = min_sum(p, &order);
    if p.fits(free.memory) {
        return Ok(Some(free));
    }
    let budget = p.memory_budget;
    let mut factors: Vec<Factor> = Vec::new();
    for (v, var) in p.vars.iter().enumerate() {
        factors.push(Factor {
            scope: vec![v],
            fronts: (0..k[v])
                .map(|i| {
                    vec![Point {
                        cost: var.cost[i],
                        memory: var.memory[i],
                        origin: u32::MAX,
                    }]
                })
                .collect(),
            origins: Vec::new(),
            made_from: None,
        });
    }
    for e in &p.edges {
        factors.push(Factor {
            scope: vec![e.u, e.v],
            fronts: e
                .cost
                .iter()
                .map(|&c| {
                    vec![Point {
                        cost: c,
                        memory: 0.0,
                        origin: u32::MAX,
                    }]
                })
                .collect(),
            origins: Vec::new(),
            made_from: None,
        });
    }
    let mut live: Vec<bool> = vec![true; factors.len()];
    let mut eliminated_by: Vec<usize> = vec![usize::MAX; n];
    for &x in &order {
        let bucket: Vec<usize> = (0..factors.len())
            .filter(|&f| live[f] && factors[f].scope.contains(&x))
            .collect();
        let mut scope: Vec<usize> = bucket
            .iter()
            .flat_map(|&f| factors[f].scope.iter().copied())
            .filter(|&v| v != x)
            .collect();
        scope.sort_unstable();
        scope.dedup();
        let entries: usize = scope.iter().map(|&v| k[v]).product();
        let mut fronts = Vec::with_capacity(entries);
        let mut origins: Vec<Origin> = Vec::new();
        let mut values = vec![0usize; n];
        for e in 0..entries {
            // Decode the entry into values of the scope (mixed radix, last fastest).
            let mut rest = e;
            for &v in scope.iter().rev() {
                values[v] = rest % k[v];
                rest /= k[v];
            }
            let mut candidates: Vec<Point> = Vec::new();
            for xv in 0..k[x] {
                values[x] = xv;
                // Minkowski sum of the bucket's fronts at this assignment.
                let mut acc: Vec<(f64, f64, Vec<u32>)> = vec![(0.0, 0.0, Vec::new())];
                for &f in &bucket {
                    let fac = &factors[f];
                    let idx = entry(&fac.scope, &k, &|v| values[v]);
                    let front = &fac.fronts[idx];
                    let mut next = Vec::with_capacity(acc.len() * front.len());
                    for (c, m, parts) in &acc {
                        for (pi, pt) in front.iter().enumerate() {
                            let mut parts = parts.clone();
                            parts.push(pi as u32);
                            next.push((c + pt.cost, m + pt.memory, parts));
                        }
                    }
                    // Prune partial sums the same way as fronts.
                    if let Some(b) = budget {
                        next.retain(|(_, m, _)| *m <= b * (1.0 + 1e-12) + 1e-9);
                    }
                    next.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)));
                    let mut kept: Vec<(f64, f64, Vec<u32>)> = Vec::with_capacity(next.len());
                    for item in next {
                        if kept.last().is_none_or(|q| item.1 < q.1 - 1e-9) {
                            kept.push(item);
                        }
                    }
                    if kept.len() > FRONT_CAP {
                        return Err(Declined::FrontTooLarge);
                    }
                    acc = kept;
                }
                for (c, m, parts) in acc {
                    origins.push(Origin {
                        value: xv as u32,
                        parts,
                    });
                    candidates.push(Point {
                        cost: c,
                        memory: m,
                        origin: (origins.len() - 1) as u32,
                    });
                }
            }
            let front = prune(candidates, budget, FRONT_CAP).ok_or(Declined::FrontTooLarge)?;
            fronts.push(front);
        }
        for &f in &bucket {
            live[f] = false;
        }
        eliminated_by[x] = factors.len();
        factors.push(Factor {
            scope,
            fronts,
            origins,
            made_from: Some((x, bucket)),
        });
        live.push(true);
    }
    // What is left: factors with empty scope, one per connected component. The budget
    // couples the components, so their fronts are summed before the cheapest point is taken.
    let roots: Vec<usize> = (0..factors.len()).filter(|&f| live[f]).collect();
    let mut acc: Vec<(f64, f64, Vec<u32>)> = vec![(0.0, 0.0, Vec::new())];
    for &r in &roots {
        let Some(front) = factors[r].fronts.first() else {
            return Ok(None);
        };
        let mut next = Vec::with_capacity(acc.len() * front.len());
        for (c, m, parts) in &acc {
            for (pi, pt) in front.iter().enumerate() {
                let mut parts = parts.clone();
                parts.push(pi as u32);
                next.push((c + pt.cost, m + pt.memory, parts));
            }
        }
        if let Some(b) = budget {
            next.retain(|(_, m, _)| *m <= b * (1.0 + 1e-12) + 1e-9);
        }
        next.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)));
        let mut kept: Vec<(f64, f64, Vec<u32>)> = Vec::with_capacity(next.len());
        for item in next {
            if kept.last().is_none_or(|q| item.1 < q.1 - 1e-9) {
                kept.push(item);
            }
        }
        if kept.len() > FRONT_CAP {
            return Err(Declined::FrontTooLarge);
        }
        acc = kept;
    }
    let Some((_, _, picks)) = acc.into_iter().next() else {
        return Ok(None);
    };
    let mut choice = vec![0usize; n];
    let mut assigned = vec![false; n];
    for (&r, &pick) in roots.iter().zip(&picks) {
        let best = factors[r].fronts[0][pick as usize];
        // Walk down the provenance.
        let mut stack: Vec<(usize, Point)> = vec![(r, best)];
        while let Some((f, pt)) = stack.pop() {
            let fac = &factors[f];
            let Some((x, bucket)) = &fac.made_from else {
                continue;
            };
            let origin = &fac.origins[pt.origin as usize];
            choice[*x] = origin.value as usize;
            assigned[*x] = true;
            for (&child, &pi) in bucket.iter().zip(&origin.parts) {
                let cf = &factors[child];
                if cf.scope.iter().any(|&v| !assigned[v]) {
                    return Ok(None);
                }
                let idx = entry(&cf.scope, &k, &|v| choice[v]);
                stack.push((child, cf.fronts[idx][pi as usize]));
            }
        }
    }
    let (cost, memory) = p.evaluate(&choice);
    if !p.fits(memory) {
        return Ok(None);
    }
    Ok(Some(Assignment {
        choice,
        cost,
        memory,
    }))
}

/// A factor of the unconstrained elimination: one cost per entry of its scope, and for
/// factors made by eliminating a variable, that variable's best value per entry.
struct Table {
    scope: Vec<usize>,
    cost: Vec<f64>,
    made_from: Option<(usize, Vec<u32>)>,
}

/// The optimum ignoring the budget: plain min-sum bucket elimination along `order` (every
/// front a single point), then the choices read back in reverse elimination order.
fn min_sum(p: &Problem, order: &[usize]) -> Assignment {
    let n = p.vars.len();
    let k: Vec<usize> = (0..n).map(|v| p.k(v)).collect();
    let mut tables: Vec<Table> = p
        .vars
        .iter()
        .enumerate()
        .map(|(v, var)| Table {
            scope: vec![v],
            cost: var.cost.clone(),
            made_from: None,
        })
        .chain(p.edges.iter().map(|e| Table {
            scope: vec![e.u, e.v],
            cost: e.cost.clone(),
            made_from: None,
        }))
        .collect();
    let mut live = vec![true; tables.len()];
    let mut made: Vec<usize> = Vec::with_capacity(n);
    for &x in order {
        let bucket: Vec<usize> = (0..tables.len())
            .filter(|&f| live[f] && tables[f].scope.contains(&x))
            .collect();
        let mut scope: Vec<usize> = bucket
            .iter()
            .flat_map(|&f| tables[f].scope.iter().copied())
            .filter(|&v| v != x)
            .collect();
        scope.sort_unstable();
        scope.dedup();
        // Per bucket table: its stride for each variable of `scope`, and for `x`.
        let strides: Vec<(Vec<usize>, usize)> = bucket
            .iter()
            .map(|&f| {
                let t = &tables[f];
                let mut stride = vec![0usize; scope.len()];
                let mut sx = 0;
                let mut s = 1;
                for &v in t.scope.iter().rev() {
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
        let entries: usize = scope.iter().map(|&v| k[v]).product();
        let mut cost = vec![0.0; entries];
        let mut arg = vec![0u32; entries];
        let mut values = vec![0usize; scope.len()];
        let mut base = vec![0usize; bucket.len()];
        let mut sums = vec![0.0f64; k[x]];
        for e in 0..entries {
            for (b, (stride, _)) in base.iter_mut().zip(&strides) {
                *b = values.iter().zip(stride).map(|(v, s)| v * s).sum();
            }
            sums.iter_mut().for_each(|s| *s = 0.0);
            for ((&f, &b), (_, sx)) in bucket.iter().zip(&base).zip(&strides) {
                let t = &tables[f].cost;
                for (xv, s) in sums.iter_mut().enumerate() {
                    *s += t[b + xv * sx];
                }
            }
            let (best, c) = sums
                .iter()
                .enumerate()
                .fold(
                    (0, f64::INFINITY),
                    |acc, (i, &c)| if c < acc.1 { (i, c) } else { acc },
                );
            cost[e] = c;
            arg[e] = best as u32;
            // Next entry, last variable fastest.
            for i in (0..scope.len()).rev() {
                values[i] += 1;
                if values[i] < k[scope[i]] {
                    break;
                }
                values[i] = 0;
            }
        }
        for &f in &bucket {
            live[f] = false;
        }
        made.push(tables.len());
        tables.push(Table {
            scope,
            cost,
            made_from: Some((x, arg)),
        });
        live.push(true);
    }
    // Read back: the last eliminated variable's table has an empty or assigned scope.
    let mut choice = vec![0usize; n];
    for &f in made.iter().rev() {
        let t = &tables[f];
        if let Some((x, arg)) = &t.made_from {
            let idx = entry(&t.scope, &k, &|v| choice[v]);
            choice[*x] = arg[idx] as usize;
        }
    }
    let (cost, memory) = p.evaluate(&choice);
    Assignment {
        choice,
        cost,
        memory,
    }
}
