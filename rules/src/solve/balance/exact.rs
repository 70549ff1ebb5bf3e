//! Exact combinatorial solvers for the balancing problem, used instead of the MILP where the
//! structure allows (they prove optimality in milliseconds where branch and bound may not).
//!
//! * One chunk per stage, any recompute kinds: a stage's cheapest allocation of `n` layers that
//!   fits its memory does not depend on the bound on stage time, and the Pareto fronts of
//!   (time, activation) over allocations of `n` identical layers are the same for every stage
//!   (a stage only scales activations by its in-flight count). A DP over stages then gives the
//!   minimum sum under a bound, searched with [`crate::solve::bottleneck::minimize`].
//! * Megatron-LM's expressible recomputation (one base kind, plus the same number `N` of fully
//!   recomputed layers in every chunk), any interleaving: given `N` the sum of chunk times is
//!   fixed, so only the largest chunk time matters; the smallest feasible bound is found by
//!   bisection, each stage's capacity under a bound by enumerating its chunks' layer counts
//!   against every in-flight profile (any total up to the capacity is reachable, as removing
//!   layers keeps a stage feasible).

use super::{BalancePlan, BalanceProblem, KINDS, RecomputeKind, SolveStatus};
use crate::solve::bottleneck;

/// An allocation of some layers over kinds, with its total time and activation per micro-batch.
#[derive(Clone, Copy, Debug)]
struct Point {
    time: f64,
    act: f64,
    counts: [u32; KINDS],
}

/// Keeps the points no other point beats on both time and activation, sorted by time.
fn pareto(mut points: Vec<Point>) -> Vec<Point> {
    points.sort_by(|a, b| a.time.total_cmp(&b.time).then(a.act.total_cmp(&b.act)));
    let mut out: Vec<Point> = Vec::with_capacity(points.len());
    for p in points {
        if out.last().is_none_or(|q| p.act < q.act) {
            out.push(p);
        }
    }
    out
}

/// Pareto fronts of allocations of `0..=max_layers` layers over `kinds`: every optimal
/// allocation of `n` layers is an optimal allocation of `n - 1` plus one layer.
fn fronts(problem: &BalanceProblem, kinds: &[usize], max_layers: usize) -> Vec<Vec<Point>> {
    let mut out = vec![vec![Point {
        time: 0.0,
        act: 0.0,
        counts: [0; KINDS],
    }]];
    for n in 1..=max_layers {
        let mut next = Vec::with_capacity(out[n - 1].len() * kinds.len());
        for p in &out[n - 1] {
            for &k in kinds {
                let mut counts = p.counts;
                counts[k] += 1;
                next.push(Point {
                    time: p.time + problem.forward + problem.backward[k],
                    act: p.act + problem.act(k),
                    counts,
                });
            }
        }
        out.push(pareto(next));
    }
    out
}

/// Extra time of chunk `(c, j)`: the head on the first chunk of the first stage, the tail on
/// the last chunk of the last stage.
fn extra(problem: &BalanceProblem, c: usize, j: usize) -> f64 {
    let mut e = 0.0;
    if c == 0 && j == 0 {
        e += problem.head.forward + problem.head.backward;
    }
    if c == problem.interleave - 1 && j == problem.stages - 1 {
        e += problem.tail.forward + problem.tail.backward;
    }
    e
}

/// A stage's fastest fitting allocation: its time and counts per kind.
type Choice = (f64, [u32; KINDS]);

/// Exact solver for one chunk per stage. `None` if no assignment fits.
pub(super) fn single_chunk(problem: &BalanceProblem) -> Option<BalancePlan> {
    let (p, m, l) = (problem.stages, problem.microbatches, problem.layers);
    let full = RecomputeKind::Full.index();
    let allowed: Vec<usize> = (0..KINDS).filter(|&k| problem.allowed[k]).collect();
    // With a uniform full count, the free kinds exclude full and N is enumerated.
    let (free, full_counts): (Vec<usize>, Vec<usize>) =
        if problem.uniform_full && problem.allowed[full] {
            (
                allowed.iter().copied().filter(|&k| k != full).collect(),
                (0..=l / p).collect(),
            )
        } else {
            (allowed.clone(), vec![0])
        };
    let f = fronts(problem, &free, l);
    let mut best: Option<(f64, Vec<[u32; KINDS]>)> = None;
    for &n_full in &full_counts {
        // best[j][n]: the fastest allocation of n layers on stage j that fits, with its time.
        let mut table: Vec<Vec<Option<Choice>>> = vec![vec![None; l + 1]; p];
        for (j, row) in table.iter_mut().enumerate() {
            // One chunk: a single profile, min(p - j, m) micro-batches.
            let infl = problem.profiles(j).first().map_or(1, |q| q[0]).max(1) as f64;
            let room = problem.memory_cap - problem.base_memory(j);
            for (n, slot) in row.iter_mut().enumerate().skip(n_full.max(1)) {
                let rest = n - n_full;
                if free.is_empty() && rest > 0 {
                    continue;
                }
                let full_time = n_full as f64 * (problem.forward + problem.backward[full]);
                let full_act = n_full as f64 * problem.act(full);
                // At least one micro-batch is in flight on every stage.
                let budget = (room - n as f64 * problem.memory.parameter) / infl;
                // Fronts are sorted by time with activation decreasing: the first that fits
                // is the fastest.
                let front = &f[rest];
                let idx = front.partition_point(|pt| pt.act + full_act > budget * (1.0 + 1e-12));
                if let Some(pt) = front.get(idx) {
                    let mut counts = pt.counts;
                    counts[full] += n_full as u32;
                    *slot = Some((pt.time + full_time + extra(problem, 0, j), counts));
                }
            }
        }
        let bounds = bottleneck::candidates(table.iter().flatten().flatten().map(|&(t, _)| t));
        let found = bottleneck::minimize(&bounds, m as f64 - 1.0, 0.0, |tau| {
            // D[j][u]: least sum of stage times placing u layers on stages 0..j.
            let inf = f64::INFINITY;
            let mut d = vec![vec![inf; l + 1]; p + 1];
            let mut arg = vec![vec![0usize; l + 1]; p + 1];
            d[0][0] = 0.0;
            for j in 0..p {
                for u in 0..=l {
                    if d[j][u] == inf {
                        continue;
                    }
                    for n in 1..=l - u {
                        if let Some((t, _)) = table[j][n]
                            && t <= tau
                            && d[j][u] + t < d[j + 1][u + n]
                        {
                            d[j + 1][u + n] = d[j][u] + t;
                            arg[j + 1][u + n] = n;
                        }
                    }
                }
            }
            if d[p][l] == inf {
                return None;
            }
            let mut counts = vec![[0u32; KINDS]; p];
            let (mut u, mut max) = (l, 0.0f64);
            for j in (0..p).rev() {
                let n = arg[j + 1][u];
                let (t, c) = table[j][n]?;
                counts[j] = c;
                max = max.max(t);
                u -= n;
            }
            Some(bottleneck::Bounded {
                sum: d[p][l],
                max,
                solution: counts,
            })
        });
        if let Some(b) = found
            && best.as_ref().is_none_or(|(t, _)| b.total < *t)
        {
            best = Some((b.total, b.solution));
        }
    }
    let (objective, counts) = best?;
    Some(BalancePlan {
        counts: vec![counts],
        objective,
        status: SolveStatus::Optimal,
        lower_bound: Some(objective),
    })
}

/// Most chunk-count combinations the uniform-block solver enumerates per stage; beyond it the
/// MILP takes over.
const MAX_COMBINATIONS: usize = 1 << 26;

/// Whether the problem has Megatron-LM's expressible shape (at most one kind besides full, the
/// full count uniform over chunks) and is small enough to enumerate.
pub(super) fn is_uniform_block(problem: &BalanceProblem) -> bool {
    let full = RecomputeKind::Full.index();
    let per_chunk = problem
        .layers
        .saturating_sub(problem.stages * problem.interleave)
        + 1;
    let combos = (1..problem.interleave).try_fold(1usize, |acc, _| acc.checked_mul(per_chunk));
    problem.uniform_full
        && (0..KINDS)
            .filter(|&k| k != full && problem.allowed[k])
            .count()
            <= 1
        && combos.is_some_and(|c| c <= MAX_COMBINATIONS)
}

/// Exact solver for the uniform-block shape, any interleaving. `None` if nothing fits.
pub(super) fn uniform_block(problem: &BalanceProblem) -> Option<BalancePlan> {
    let (p, v, m, l) = (
        problem.stages,
        problem.interleave,
        problem.microbatches,
        problem.layers,
    );
    let full = RecomputeKind::Full.index();
    let base = (0..KINDS).find(|&k| k != full && problem.allowed[k]);
    let t_of = |k: usize| problem.forward + problem.backward[k];
    let chunks = p * v;
    let full_counts: Vec<usize> = match (base, problem.allowed[full]) {
        (Some(_), true) => (0..=l / chunks).collect(),
        (Some(_), false) => vec![0],
        // Only full recomputation: every chunk holds exactly N layers.
        (None, _) if l % chunks == 0 => vec![l / chunks],
        (None, _) => return None,
    };
    let profiles: Vec<Vec<Vec<u32>>> = (0..p).map(|j| problem.profiles(j)).collect();
    let mut extras: Vec<f64> = (0..v)
        .flat_map(|c| (0..p).map(move |j| extra(problem, c, j)))
        .collect();
    extras.sort_by(f64::total_cmp);
    extras.dedup();
    let kappa = (m * v - 1) as f64;
    let mut best: Option<(f64, usize, f64)> = None;
    for &n_full in &full_counts {
        let shape = Uniform {
            problem,
            base,
            n_full,
            profiles: &profiles,
        };
        let lo = n_full.max(1);
        // A chunk's time depends on its chunk only through the head's and tail's extra time:
        // the candidates are the times of each distinct extra, not of each of the p v chunks.
        let shape_ref = &shape;
        let bounds = bottleneck::candidates(
            extras
                .iter()
                .flat_map(|&e| (lo..=l).map(move |n| shape_ref.time_with(e, n))),
        );
        let sum_t = match base {
            Some(b) => {
                (l - n_full * chunks) as f64 * t_of(b) + (n_full * chunks) as f64 * t_of(full)
            }
            None => l as f64 * t_of(full),
        } + extra(problem, 0, 0)
            + if chunks > 1 {
                extra(problem, v - 1, p - 1)
            } else {
                0.0
            };
        // Memory alone rules this number of recomputed layers out.
        if shape.memory_capacity_bound() < l {
            continue;
        }
        // Without memory limits the chunks could hold L layers from this bound on: no plan
        // with this many recomputed layers does better than it. Both this bound and the sum
        // grow with the number of recomputed layers, so once it cannot win, no larger
        // number can.
        let time_only = first_true(&bounds, |t| shape.time_capacity(t) >= l);
        if let (Some(&tau_lb), Some((best_objective, _, _))) = (bounds.get(time_only), best)
            && sum_t / v as f64 + kappa * tau_lb >= best_objective
        {
            break;
        }
        // Smallest bound whose capacities reach L (feasibility is monotone in the bound).
        let first = first_true(&bounds[time_only.min(bounds.len())..], |t| shape.fits(t))
            + time_only.min(bounds.len());
        let Some(&tau) = bounds.get(first) else {
            continue;
        };
        let objective = sum_t / v as f64 + kappa * tau;
        if best.is_none_or(|(o, _, _)| objective < o) {
            best = Some((objective, n_full, tau));
        }
    }
    let (objective, n_full, tau) = best?;
    let shape = Uniform {
        problem,
        base,
        n_full,
        profiles: &profiles,
    };
    let counts = shape.assign(tau)?;
    debug_assert!(
        (problem.objective(&counts) - objective).abs() <= 1e-9 * objective.abs().max(1.0)
    );
    let objective = problem.objective(&counts);
    Some(BalancePlan {
        objective,
        counts,
        status: SolveStatus::Optimal,
        lower_bound: Some(objective),
    })
}

/// Index of the first `x` in `sorted` with `pred(x)`, for a `pred` that is monotone (false,
/// then true); `sorted.len()` if none. Galloping from the bottom: the answer is usually near
/// the smallest bounds, where `pred` is cheap, and large bounds (slow to check) are only
/// probed when needed.
fn first_true(sorted: &[f64], pred: impl Fn(f64) -> bool) -> usize {
    let (mut lo, mut step) = (0usize, 1usize);
    // Invariant: every index below `lo` is false.
    loop {
        let probe = lo + step - 1;
        if probe >= sorted.len() {
            let hi = sorted.len();
            return lo + sorted[lo..hi].partition_point(|&t| !pred(t));
        }
        if pred(sorted[probe]) {
            return lo + sorted[lo..probe].partition_point(|&t| !pred(t));
        }
        lo = probe + 1;
        step *= 2;
    }
}

/// The uniform-block shape for one full count `n_full`.
struct Uniform<'a> {
    problem: &'a BalanceProblem,
    base: Option<usize>,
    n_full: usize,
    profiles: &'a [Vec<Vec<u32>>],
}

impl Uniform<'_> {
    fn full(&self) -> usize {
        RecomputeKind::Full.index()
    }

    /// Layers chunk `c` of stage `j` can take beyond the minimum when every chunk holds the
    /// minimum: the least over profiles of what is left divided by what a layer of the chunk
    /// costs under the profile.
    fn spare_layers(&self, j: usize, c: usize) -> usize {
        let pr = self.problem;
        let lo = self.n_full.max(1);
        let (alpha, beta) = self.activation_line();
        let room = pr.memory_cap * (1.0 + 1e-12) - pr.base_memory(j);
        let mut spare = usize::MAX;
        for q in &self.profiles[j] {
            let used: f64 = q
                .iter()
                .map(|&k| lo as f64 * pr.memory.parameter + k as f64 * (alpha + beta * lo as f64))
                .sum();
            let per_layer = pr.memory.parameter + q[c] as f64 * beta;
            if per_layer > 0.0 {
                let extra = ((room - used) / per_layer).floor().max(0.0);
                spare = spare.min(extra.min(pr.layers as f64) as usize);
            }
        }
        spare.min(pr.layers)
    }

    /// An upper bound on the layers the stages can hold together, whatever the bound on
    /// time: each stage's minimum plus what its cheapest chunk could add alone.
    fn memory_capacity_bound(&self) -> usize {
        let pr = self.problem;
        let lo = self.n_full.max(1);
        let mut total = 0usize;
        for j in 0..pr.stages {
            if !self.fits_memory(j, &vec![lo; pr.interleave]) {
                return 0;
            }
            let extra: usize = (0..pr.interleave)
                .map(|c| self.spare_layers(j, c))
                .max()
                .unwrap_or(0);
            total = total.saturating_add(pr.interleave * lo + extra);
        }
        total
    }

    /// Layers all chunks can hold under bound `tau`, memory aside.
    fn time_capacity(&self, tau: f64) -> usize {
        let pr = self.problem;
        let lo = self.n_full.max(1);
        let mut total = 0;
        for c in 0..pr.interleave {
            for j in 0..pr.stages {
                if self.chunk_time(c, j, lo) > tau {
                    return 0;
                }
                let mut n = lo;
                while self.base.is_some() && n < pr.layers && self.chunk_time(c, j, n + 1) <= tau {
                    n += 1;
                }
                total += n;
            }
        }
        total
    }

    fn chunk_time(&self, c: usize, j: usize, n: usize) -> f64 {
        self.time_with(extra(self.problem, c, j), n)
    }

    /// The time of a chunk of `n` layers whose head or tail adds `extra`.
    fn time_with(&self, extra: f64, n: usize) -> f64 {
        let pr = self.problem;
        let tb = self.base.map_or(0.0, |b| pr.forward + pr.backward[b]);
        let tf = pr.forward + pr.backward[self.full()];
        (n - self.n_full) as f64 * tb + self.n_full as f64 * tf + extra
    }

    fn counts_of(&self, n: usize) -> [u32; KINDS] {
        let mut counts = [0u32; KINDS];
        counts[self.full()] = self.n_full as u32;
        if let Some(b) = self.base {
            counts[b] = (n - self.n_full) as u32;
        }
        counts
    }

    /// Whether chunk counts `n` fit stage `j`'s memory under every profile.
    fn fits_memory(&self, j: usize, n: &[usize]) -> bool {
        let pr = self.problem;
        let (alpha, beta) = self.activation_line();
        let params = n.iter().sum::<usize>() as f64 * pr.memory.parameter;
        let room = pr.memory_cap * (1.0 + 1e-12) - pr.base_memory(j) - params;
        self.profiles[j].iter().all(|q| {
            let act: f64 = q
                .iter()
                .zip(n)
                .map(|(&k, &nc)| k as f64 * (alpha + beta * nc as f64))
                .sum();
            act <= room
        })
    }

    /// A chunk of `n >= n_full` layers keeps `alpha + beta n` activation bytes per
    /// micro-batch: `n_full` fully recomputed layers, the rest of the base kind.
    fn activation_line(&self) -> (f64, f64) {
        let pr = self.problem;
        let beta = self.base.map_or(0.0, |b| pr.act(b));
        (self.n_full as f64 * (pr.act(self.full()) - beta), beta)
    }

    /// The largest feasible chunk counts of stage `j` under bound `tau` (most layers; among
    /// equals, the first found), with the minimum counts; `None` if even the minimum fails.
    ///
    /// A chunk of `n` layers keeps `alpha + beta n` activation bytes per micro-batch, so each
    /// in-flight profile is a linear constraint. The first `v - 1` chunks are enumerated (an
    /// odometer that carries as soon as a prefix alone breaks memory, since more layers never
    /// help), and the last takes the most every profile leaves room for.
    fn capacity(&self, j: usize, tau: f64) -> Option<(usize, Vec<usize>)> {
        let pr = self.problem;
        let v = pr.interleave;
        let lo = self.n_full.max(1);
        let mut hi = vec![lo; v];
        for (c, h) in hi.iter_mut().enumerate() {
            if self.chunk_time(c, j, lo) > tau {
                return None;
            }
            // Without a base kind every layer is recomputed: chunks hold exactly n_full.
            while self.base.is_some() && *h < pr.layers && self.chunk_time(c, j, *h + 1) <= tau {
                *h += 1;
            }
        }
        let min = vec![lo; v];
        if !self.fits_memory(j, &min) {
            return None;
        }
        // Memory does not bind: every chunk takes what the bound allows.
        if self.fits_memory(j, &hi) {
            return Some((min.iter().sum(), hi));
        }
        // No chunk can take more than memory leaves it with the others at their minimum.
        for (c, h) in hi.iter_mut().enumerate() {
            *h = (*h).min(lo + self.spare_layers(j, c));
        }
        let (alpha, beta) = self.activation_line();
        let room = pr.memory_cap * (1.0 + 1e-12) - pr.base_memory(j);
        let profiles = &self.profiles[j];
        // Memory of the first v - 1 chunks under each profile.
        let prefix_memory = |n: &[usize], q: &[u32]| -> f64 {
            n.iter()
                .zip(q)
                .take(v - 1)
                .map(|(&nc, &k)| {
                    nc as f64 * pr.memory.parameter + k as f64 * (alpha + beta * nc as f64)
                })
                .sum()
        };
        // The most layers the last chunk can take after the prefix, if at least `lo`.
        let last_chunk = |n: &[usize]| -> Option<usize> {
            let mut most = hi[v - 1] as f64;
            for q in profiles {
                let k = q[v - 1] as f64;
                let rem = room - prefix_memory(n, q) - k * alpha;
                let per_layer = pr.memory.parameter + k * beta;
                if per_layer > 0.0 {
                    most = most.min((rem / per_layer).floor());
                } else if rem < 0.0 {
                    return None;
                }
            }
            (most >= lo as f64).then_some(most as usize)
        };
        let mut best = min.clone();
        let mut cur = min.clone();
        loop {
            let ok = match last_chunk(&cur) {
                Some(last) => {
                    cur[v - 1] = last;
                    // Rounding in the closed form: confirm, one layer less at most.
                    if self.fits_memory(j, &cur) {
                        true
                    } else if last > lo {
                        cur[v - 1] = last - 1;
                        self.fits_memory(j, &cur)
                    } else {
                        false
                    }
                }
                None => false,
            };
            if ok && cur.iter().sum::<usize>() > best.iter().sum::<usize>() {
                best.clone_from(&cur);
            }
            // Next prefix in odometer order. After a prefix that fails, every prefix up to
            // the next increment of the digit above its lowest raised digit is larger
            // componentwise and fails too: skip them.
            let mut c = 0;
            if !ok {
                match (0..v - 1).find(|&d| cur[d] > lo) {
                    Some(d) => {
                        cur[d] = lo;
                        c = d + 1;
                    }
                    None => return Some((min.iter().sum(), best)),
                }
            }
            loop {
                if c + 1 >= v {
                    return Some((min.iter().sum(), best));
                }
                if cur[c] < hi[c] {
                    cur[c] += 1;
                    break;
                }
                cur[c] = lo;
                c += 1;
            }
        }
    }

    fn fits(&self, tau: f64) -> bool {
        let l = self.problem.layers;
        let (mut min, mut max) = (0usize, 0usize);
        for j in 0..self.problem.stages {
            let Some((a, most)) = self.capacity(j, tau) else {
                return false;
            };
            min += a;
            max += most.iter().sum::<usize>();
        }
        min <= l && l <= max
    }

    /// An assignment under `tau`: each stage's total grows from its minimum one layer at a time
    /// on the stage with the smallest time, then each stage trims its largest feasible counts
    /// down to its total, taking layers from its slowest chunk first.
    fn assign(&self, tau: f64) -> Option<Vec<Vec<[u32; KINDS]>>> {
        let pr = self.problem;
        let (p, v) = (pr.stages, pr.interleave);
        let caps: Vec<(usize, Vec<usize>)> = (0..p)
            .map(|j| self.capacity(j, tau))
            .collect::<Option<_>>()?;
        let mut totals: Vec<usize> = caps.iter().map(|(min, _)| *min).collect();
        let mut left = pr.layers.checked_sub(totals.iter().sum())?;
        // A stage's time for `n` layers: its chunks' times with the extra layers anywhere (the
        // base kind costs the same in every chunk).
        let lo = self.n_full.max(1);
        let stage_time = |j: usize, n: usize| {
            (0..v).map(|c| self.chunk_time(c, j, lo)).sum::<f64>()
                + self.chunk_time(0, j, lo + n - v * lo)
                - self.chunk_time(0, j, lo)
        };
        while left > 0 {
            let j = (0..p)
                .filter(|&j| totals[j] < caps[j].1.iter().sum::<usize>())
                .min_by(|&a, &b| stage_time(a, totals[a]).total_cmp(&stage_time(b, totals[b])))?;
            totals[j] += 1;
            left -= 1;
        }
        let mut counts = vec![vec![[0u32; KINDS]; p]; v];
        for j in 0..p {
            let mut n = caps[j].1.clone();
            while n.iter().sum::<usize>() > totals[j] {
                let c = (0..v).filter(|&c| n[c] > lo).max_by(|&a, &b| {
                    self.chunk_time(a, j, n[a])
                        .total_cmp(&self.chunk_time(b, j, n[b]))
                })?;
                n[c] -= 1;
            }
            for c in 0..v {
                counts[c][j] = self.counts_of(n[c]);
            }
        }
        Some(counts)
    }
}

#[cfg(test)]
mod tests {
    use super::first_true;

    #[test]
    fn galloping_finds_the_first_true() {
        let xs: Vec<f64> = (0..37).map(f64::from).collect();
        for threshold in 0..=38 {
            let got = first_true(&xs, |x| x >= threshold as f64);
            assert_eq!(got, threshold.min(37) as usize, "threshold {threshold}");
        }
        assert_eq!(first_true(&[], |_| true), 0);
    }
}
