//! Balancing layers and recomputation across pipeline stages under a memory cap (SAPP,
//! ALGORITHMS.md §4), as a mixed-integer program.
//!
//! Integer `x[c][j][r]`: body layers of recompute kind `r` in chunk `c` of stage `j`. Every
//! chunk holds at least one layer, the layers add up to `L`, and every stage fits:
//!
//! ```text
//! base_j + par * sum_{c,r} x + sum_{c,r} x * act_r * q_c <= cap   for every profile q of stage j
//! ```
//!
//! where `base_j` is the head memory on the first stage, the tail memory on the last and the
//! constant elsewhere (the decomposed head and tail include the constant), and a profile `q` is
//! a number of in-flight micro-batches per chunk at one of stage `j`'s possible peaks under
//! (interleaved) 1F1B ([`crate::solve::schedule::inflight_profiles`]). SAPP uses only the profile at
//! the end of the warm-up, which underestimates the peak when later chunks hold more
//! activations; one constraint per profile is exact. With `T_cj` the forward plus backward
//! time of chunk `(c, j)`, the objective is the end-to-end proxy
//!
//! ```text
//! sum_{c,j} T_cj / v + (m v - 1) * max_{c,j} T_cj
//! ```
//!
//! which for `v = 1` is `sum_j T_j + (m - 1) max_j T_j` (SAPP minimises only the maximum and
//! leaves ties arbitrary) and for equal chunks of time `t` is the exact interleaved pipeline
//! time `(m v + p - 1) t`, i.e. `(m + (p - 1)/v) T` with `T = v t` per stage.

mod decompose;
mod exact;
pub mod layers;

pub use decompose::{DecomposeError, MemoryRun, MemoryTerms, decompose};

use crate::solve::schedule::{PipelineSpec, Schedule, inflight_profiles};
use good_lp::solvers::microlp::MicroLpProblem;
use good_lp::{
    Expression, ResolutionError, Solution, SolutionStatus, SolverModel, Variable, WithTimeLimit,
    constraint, microlp, variable, variables,
};
use serde::{Deserialize, Serialize};

/// Number of recompute kinds.
pub const KINDS: usize = 5;

/// What a layer recomputes during its backward pass (SAPP's kinds).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RecomputeKind {
    /// Nothing.
    None,
    /// The attention core (selective recomputation).
    Selective,
    /// The communication (re-gathering sequence-parallel activations).
    Communication,
    /// Selective and communication.
    Both,
    /// The whole layer.
    Full,
}

impl RecomputeKind {
    /// All kinds, in index order.
    pub const ALL: [RecomputeKind; KINDS] = [
        RecomputeKind::None,
        RecomputeKind::Selective,
        RecomputeKind::Communication,
        RecomputeKind::Both,
        RecomputeKind::Full,
    ];

    /// Position in per-kind arrays.
    pub fn index(self) -> usize {
        self as usize
    }

    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            RecomputeKind::None => "none",
            RecomputeKind::Selective => "selective",
            RecomputeKind::Communication => "communication",
            RecomputeKind::Both => "both",
            RecomputeKind::Full => "full",
        }
    }
}

/// SAPP's default extra backward time of each kind, as a fraction of the backward time without
/// recomputation (MindSpore's pipeline-balance tool, `utils/recompute.py`): selective 4%,
/// communication 12.5%, both 16.5%, full 50% (one more forward, a third of forward + backward).
pub const SAPP_RECOMPUTE_COEF: [f64; KINDS] = [0.0, 0.04, 0.125, 0.165, 0.5];

/// Time and memory of a part placed on one stage only (embedding, output layer).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Extra {
    /// Forward time per micro-batch.
    pub forward: f64,
    /// Backward time per micro-batch.
    pub backward: f64,
}

/// A balancing instance.
#[derive(Clone, Debug, PartialEq)]
pub struct BalanceProblem {
    /// Pipeline stages `p`.
    pub stages: usize,
    /// Chunks per stage `v`.
    pub interleave: usize,
    /// Micro-batches `m`.
    pub microbatches: usize,
    /// Body layers `L`.
    pub layers: usize,
    /// Forward time of a body layer per micro-batch.
    pub forward: f64,
    /// Backward time of a body layer per micro-batch, recomputation included, per kind.
    pub backward: [f64; KINDS],
    /// Head on the first chunk of the first stage.
    pub head: Extra,
    /// Tail on the last chunk of the last stage.
    pub tail: Extra,
    /// Memory terms (activations of kinds not allowed are ignored).
    pub memory: MemoryTerms,
    /// Recompute kinds the plan may use.
    pub allowed: [bool; KINDS],
    /// Memory cap per stage.
    pub memory_cap: f64,
    /// Require the same number of fully recomputed layers in every chunk (Megatron-LM's
    /// `--recompute-method block --recompute-num-layers N` recomputes the first `N` layers of
    /// each chunk).
    pub uniform_full: bool,
    /// Solver time limit, s.
    pub time_limit: f64,
}

/// Whether the solver proved the plan optimal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SolveStatus {
    /// Proven optimal.
    Optimal,
    /// The time limit stopped the search; the plan is the best found, not proven optimal.
    TimeLimit,
}

/// A balanced assignment.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BalancePlan {
    /// `counts[c][j][r]`: layers of kind `r` in chunk `c` of stage `j`.
    pub counts: Vec<Vec<[u32; KINDS]>>,
    /// Value of the objective (time unit of the problem).
    pub objective: f64,
    /// Optimality.
    pub status: SolveStatus,
    /// A proven lower bound on the objective of any plan: the objective itself when optimal,
    /// the continuous relaxation's optimum when the time limit stopped the search.
    pub lower_bound: Option<f64>,
}

/// Why balancing failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BalanceError {
    /// Sizes that cannot work.
    #[error("{0}")]
    Shape(String),
    /// No assignment fits the memory cap.
    #[error("{0}")]
    Infeasible(String),
    /// The solver failed.
    #[error("the MILP solver failed: {0}")]
    Solver(String),
}

impl BalanceProblem {
    /// Whether the sizes can make a plan at all: positive sizes, a layer for every chunk,
    /// micro-batches that interleaving can schedule, an allowed kind with known memory.
    pub fn check(&self) -> Result<(), BalanceError> {
        let (p, v) = (self.stages, self.interleave);
        if p == 0 || v == 0 || self.microbatches == 0 {
            return Err(BalanceError::Shape(
                "stages, interleave and micro-batches must be positive".into(),
            ));
        }
        if self.layers < p * v {
            return Err(BalanceError::Shape(format!(
                "{} layers cannot give each of the {p} x {v} chunks at least one",
                self.layers
            )));
        }
        if v > 1 && self.microbatches % p != 0 {
            return Err(BalanceError::Shape(format!(
                "interleaving needs the {} micro-batches to be a multiple of the {p} stages",
                self.microbatches
            )));
        }
        if !self.allowed.iter().any(|&a| a) {
            return Err(BalanceError::Shape("no recompute kind is allowed".into()));
        }
        for (k, &a) in self.allowed.iter().enumerate() {
            if a && self.memory.activation[k].is_none() {
                return Err(BalanceError::Shape(format!(
                    "the activation memory of recompute kind `{}` is unknown",
                    RecomputeKind::ALL[k].name()
                )));
            }
        }
        Ok(())
    }

    /// Memory of stage `j` that does not depend on layers: head, tail or constant.
    pub fn base_memory(&self, j: usize) -> f64 {
        let p = self.stages;
        let m = &self.memory;
        match (j == 0, j == p - 1) {
            (true, true) => m.head + m.tail - m.constant,
            (true, false) => m.head,
            (false, true) => m.tail,
            (false, false) => m.constant,
        }
    }

    fn act(&self, k: usize) -> f64 {
        self.memory.activation[k].unwrap_or(0.0)
    }

    /// In-flight micro-batches per chunk at each possible peak of stage `j`.
    pub fn profiles(&self, j: usize) -> Vec<Vec<u32>> {
        inflight_profiles(
            Schedule::OneFOneB,
            j,
            self.stages,
            self.interleave,
            self.microbatches,
        )
    }

    /// Activations one micro-batch keeps in chunk `(c, j)` given its counts per kind.
    fn chunk_activation(&self, n: &[u32; KINDS]) -> f64 {
        (0..KINDS).map(|k| n[k] as f64 * self.act(k)).sum()
    }

    /// Memory model of stage `j` for `counts` (`[c][j][r]`): its worst profile.
    pub fn stage_memory(&self, counts: &[Vec<[u32; KINDS]>], j: usize) -> f64 {
        let layers: u32 = counts
            .iter()
            .map(|chunk| chunk[j].iter().sum::<u32>())
            .sum();
        let act = self
            .profiles(j)
            .iter()
            .map(|q| {
                q.iter()
                    .zip(counts)
                    .map(|(&n, chunk)| n as f64 * self.chunk_activation(&chunk[j]))
                    .sum::<f64>()
            })
            .fold(0.0, f64::max);
        self.base_memory(j) + layers as f64 * self.memory.parameter + act
    }

    /// Forward and backward time of chunk `(c, j)`.
    fn chunk_times(&self, counts: &[Vec<[u32; KINDS]>], c: usize, j: usize) -> (f64, f64, f64) {
        let (p, v) = (self.stages, self.interleave);
        let n: [u32; KINDS] = counts[c][j];
        let mut f = n.iter().sum::<u32>() as f64 * self.forward;
        let mut b: f64 = (0..KINDS).map(|k| n[k] as f64 * self.backward[k]).sum();
        let rec: f64 = (0..KINDS)
            .map(|k| n[k] as f64 * (self.backward[k] - self.backward[0]))
            .sum();
        if c == 0 && j == 0 {
            f += self.head.forward;
            b += self.head.backward;
        }
        if c == v - 1 && j == p - 1 {
            f += self.tail.forward;
            b += self.tail.backward;
        }
        (f, b, rec)
    }

    /// The proxy objective of `counts`.
    pub fn objective(&self, counts: &[Vec<[u32; KINDS]>]) -> f64 {
        let (p, v, m) = (self.stages, self.interleave, self.microbatches);
        let (mut sum, mut max) = (0.0, 0.0f64);
        for c in 0..v {
            for j in 0..p {
                let (f, b, _) = self.chunk_times(counts, c, j);
                sum += f + b;
                max = max.max(f + b);
            }
        }
        sum / v as f64 + (m * v - 1) as f64 * max
    }

    /// Whether `counts` satisfies every constraint.
    pub fn feasible(&self, counts: &[Vec<[u32; KINDS]>]) -> bool {
        let (p, v) = (self.stages, self.interleave);
        let total: u32 = counts.iter().flatten().flatten().sum();
        let chunks_ok = counts.len() == v
            && counts
                .iter()
                .all(|chunk| chunk.len() == p && chunk.iter().all(|n| n.iter().sum::<u32>() >= 1));
        let kinds_ok = counts
            .iter()
            .flatten()
            .all(|n| (0..KINDS).all(|k| self.allowed[k] || n[k] == 0));
        let full = RecomputeKind::Full.index();
        let uniform_ok = !self.uniform_full
            || counts
                .iter()
                .flatten()
                .all(|n| n[full] == counts[0][0][full]);
        chunks_ok
            && kinds_ok
            && uniform_ok
            && total as usize == self.layers
            && (0..p).all(|j| self.stage_memory(counts, j) <= self.memory_cap * (1.0 + 1e-9))
    }

    /// Why `counts` is not a plan of this problem, each reason in words (empty when it is
    /// one): the wrong number of chunks or stages, an empty chunk, another number of layers
    /// than the model's, a recompute kind whose activation memory the measurements do not
    /// determine, a stage above the memory cap. Only a plan of the right shape whose chunks
    /// all hold a layer can be simulated; the other reasons leave it priced but invalid.
    pub fn violations(&self, counts: &[Vec<[u32; KINDS]>]) -> Vec<String> {
        let (p, v) = (self.stages, self.interleave);
        if counts.len() != v || counts.iter().any(|c| c.len() != p) {
            return vec![format!(
                "the plan has {} chunk(s) of {:?} stage(s), the problem {v} of {p}",
                counts.len(),
                counts.iter().map(Vec::len).collect::<Vec<_>>()
            )];
        }
        let mut why = Vec::new();
        for (c, chunk) in counts.iter().enumerate() {
            for (j, n) in chunk.iter().enumerate() {
                if n.iter().sum::<u32>() == 0 {
                    why.push(format!("chunk {c} of stage {j} holds no layer"));
                }
            }
        }
        let total: u64 = counts
            .iter()
            .flatten()
            .flatten()
            .map(|&n| u64::from(n))
            .sum();
        if total != self.layers as u64 {
            why.push(format!(
                "the chunks hold {total} layers, the model has {}",
                self.layers
            ));
        }
        for k in 0..KINDS {
            let used = counts.iter().flatten().any(|n| n[k] > 0);
            if used && !self.allowed[k] {
                why.push(format!(
                    "it uses `{}` recomputation, whose activation memory the measurements do \
                     not determine",
                    RecomputeKind::ALL[k].name()
                ));
            }
        }
        if why.is_empty() {
            for j in 0..p {
                let need = self.stage_memory(counts, j);
                if need > self.memory_cap * (1.0 + 1e-9) {
                    why.push(format!(
                        "stage {j} needs {need:.0}, more than the cap of {:.0}",
                        self.memory_cap
                    ));
                }
            }
        }
        why
    }

    /// Whether `counts` can be simulated: the problem's shape, a layer in every chunk.
    pub fn simulable(&self, counts: &[Vec<[u32; KINDS]>]) -> bool {
        counts.len() == self.interleave
            && counts
                .iter()
                .all(|c| c.len() == self.stages && c.iter().all(|n| n.iter().sum::<u32>() > 0))
    }

    /// The pipeline of `counts` for the simulator (times per chunk, activations per micro-batch).
    pub fn pipeline(&self, counts: &[Vec<[u32; KINDS]>], schedule: Schedule) -> PipelineSpec {
        let (p, v) = (self.stages, self.interleave);
        let mut spec = PipelineSpec {
            schedule,
            microbatches: self.microbatches,
            forward: vec![vec![0.0; p]; v],
            backward: vec![vec![0.0; p]; v],
            recompute: vec![vec![0.0; p]; v],
            activation: vec![vec![0.0; p]; v],
        };
        for c in 0..v {
            for j in 0..p {
                let (f, b, rec) = self.chunk_times(counts, c, j);
                spec.forward[c][j] = f;
                spec.backward[c][j] = b;
                spec.recompute[c][j] = rec;
                spec.activation[c][j] = (0..KINDS)
                    .map(|k| counts[c][j][k] as f64 * self.act(k))
                    .sum();
            }
        }
        spec
    }
}

/// Balances layers and recomputation: exactly with a combinatorial solver when the problem has
/// one chunk per stage or Megatron-LM's uniform-block shape, otherwise with the MILP (whose
/// time limit may stop it short of a proof; the plan's status says so). The MILP starts from
/// `initial` (`[c][j][r]`) if it is feasible, else from the best plan of the uniform-block
/// shape (solved exactly for each base kind), which it can only improve on; if the time limit
/// comes before the MILP finds anything better, that plan is returned.
pub fn balance(
    problem: &BalanceProblem,
    initial: Option<&[Vec<[u32; KINDS]>]>,
) -> Result<BalancePlan, BalanceError> {
    problem.check()?;
    let exact = if exact::is_uniform_block(problem) {
        Some(exact::uniform_block(problem))
    } else if problem.interleave == 1 {
        Some(exact::single_chunk(problem))
    } else {
        None
    };
    match exact {
        Some(Some(plan)) if problem.feasible(&plan.counts) => Ok(plan),
        Some(Some(_)) => Err(BalanceError::Solver(
            "the exact solver produced an assignment that violates the constraints".into(),
        )),
        Some(None) => Err(infeasible(problem)),
        None => {
            let seed: Option<BalancePlan> = match initial.filter(|c| problem.feasible(c)) {
                Some(c) => Some(BalancePlan {
                    counts: c.to_vec(),
                    objective: problem.objective(c),
                    status: SolveStatus::TimeLimit,
                    lower_bound: None,
                }),
                None => uniform_block_seed(problem),
            };
            if seed.is_none() && least_memory_kind_is_a_base(problem) {
                // The uniform-block search covered every split with every layer of the kind
                // keeping the least activation memory; any other kind keeps more, so nothing
                // fits.
                return Err(infeasible(problem));
            }
            let solved = milp(problem, seed.as_ref().map(|s| s.counts.as_slice()));
            let mut plan = match (solved, seed) {
                (Ok(plan), Some(s)) if s.objective < plan.objective => s,
                (Ok(plan), _) => plan,
                // Nothing better within the time limit: the starting point stands.
                (Err(BalanceError::Solver(_)), Some(s)) => s,
                (Err(e), None) | (Err(e), Some(_)) => return Err(e),
            };
            if plan.status == SolveStatus::TimeLimit {
                plan.lower_bound = relaxation_bound(problem);
            }
            Ok(plan)
        }
    }
}

/// Whether the allowed kind keeping the least activation memory is not full recomputation (or
/// full recomputation is not allowed), so that the uniform-block search with it as the base
/// kind tries the least memory of every split.
fn least_memory_kind_is_a_base(problem: &BalanceProblem) -> bool {
    let full = RecomputeKind::Full.index();
    let least = (0..KINDS).filter(|&k| problem.allowed[k]).min_by(|&a, &b| {
        problem
            .act(a)
            .total_cmp(&problem.act(b))
            .then((a == full).cmp(&(b == full)))
    });
    let probe = |k: usize| {
        let mut restricted = problem.clone();
        restricted.allowed = [false; KINDS];
        restricted.allowed[k] = true;
        restricted.uniform_full = true;
        exact::is_uniform_block(&restricted)
    };
    least.is_some_and(|k| k != full && probe(k))
}

/// The best plan of Megatron-LM's uniform-block shape (one base kind everywhere, the same number
/// of fully recomputed layers in every chunk), solved exactly for each allowed base kind: a
/// feasible starting point for the MILP. Its status is `TimeLimit` (not proven for the full
/// problem).
fn uniform_block_seed(problem: &BalanceProblem) -> Option<BalancePlan> {
    let full = RecomputeKind::Full.index();
    (0..KINDS)
        .filter(|&k| k != full && problem.allowed[k])
        .filter_map(|base| {
            let mut restricted = problem.clone();
            restricted.allowed = [false; KINDS];
            restricted.allowed[base] = true;
            restricted.allowed[full] = problem.allowed[full];
            restricted.uniform_full = true;
            if !exact::is_uniform_block(&restricted) {
                return None;
            }
            exact::uniform_block(&restricted).filter(|plan| problem.feasible(&plan.counts))
        })
        .min_by(|a, b| a.objective.total_cmp(&b.objective))
        .map(|plan| BalancePlan {
            status: SolveStatus::TimeLimit,
            lower_bound: None,
            ..plan
        })
}

/// The balancing program built for microlp: the model and the variables a plan is read from.
struct Program {
    model: MicroLpProblem,
    /// `x[c][j][k]`, for allowed kinds.
    x: Vec<Vec<[Option<Variable>; KINDS]>>,
    /// The uniform number of fully recomputed layers per chunk, when required.
    full_count: Option<Variable>,
    /// The largest chunk time.
    tau: Variable,
    /// The objective, in units of `t_unit`.
    objective: Expression,
    /// Time unit of the model: a body layer's forward + backward.
    t_unit: f64,
}

/// Builds the program; `integer` false gives its continuous relaxation.
fn program(problem: &BalanceProblem, integer: bool) -> Program {
    let (p, v, m, l) = (
        problem.stages,
        problem.interleave,
        problem.microbatches,
        problem.layers,
    );
    // Scale times by a body layer's forward + backward and memory by the cap, so the solver
    // sees coefficients of order one.
    let t_unit = (problem.forward + problem.backward[0]).max(f64::MIN_POSITIVE);
    let m_unit = problem.memory_cap.abs().max(f64::MIN_POSITIVE);
    let count = || {
        let var = variable().min(0).max(l as f64);
        if integer { var.integer() } else { var }
    };
    let mut vars = variables!();
    let mut x = vec![vec![[None::<Variable>; KINDS]; p]; v];
    for chunk in x.iter_mut() {
        for stage in chunk.iter_mut() {
            for (k, slot) in stage.iter_mut().enumerate() {
                if problem.allowed[k] {
                    *slot = Some(vars.add(count()));
                }
            }
        }
    }
    let full_count = (problem.uniform_full && problem.allowed[RecomputeKind::Full.index()])
        .then(|| vars.add(count()));
    let tau = vars.add(variable().min(0));
    let sum_of = |c: usize, j: usize, coef: &dyn Fn(usize) -> f64| -> Expression {
        let mut e = Expression::default();
        for (k, slot) in x[c][j].iter().enumerate() {
            if let Some(var) = slot {
                e.add_mul(coef(k), *var);
            }
        }
        e
    };
    let chunk_time = |c: usize, j: usize| -> Expression {
        let mut e = sum_of(c, j, &|k| (problem.forward + problem.backward[k]) / t_unit);
        if c == 0 && j == 0 {
            e += (problem.head.forward + problem.head.backward) / t_unit;
        }
        if c == v - 1 && j == p - 1 {
            e += (problem.tail.forward + problem.tail.backward) / t_unit;
        }
        e
    };
    let mut objective = Expression::default();
    for c in 0..v {
        for j in 0..p {
            objective += chunk_time(c, j) * (1.0 / v as f64);
        }
    }
    objective += tau * (m * v - 1) as f64;
    let mut model = vars.minimise(objective.clone()).using(microlp);
    model = model.with_time_limit(problem.time_limit.max(0.01));
    let mut all_layers = Expression::default();
    for (c, chunk) in x.iter().enumerate() {
        for (j, slots) in chunk.iter().enumerate() {
            let layers = sum_of(c, j, &|_| 1.0);
            all_layers += layers.clone();
            model.add_constraint(constraint!(layers >= 1));
            model.add_constraint(constraint!(chunk_time(c, j) <= tau));
            if let (Some(n), Some(fx)) = (full_count, slots[RecomputeKind::Full.index()]) {
                model.add_constraint(constraint!(fx == n));
            }
        }
    }
    model.add_constraint(constraint!(all_layers == l as f64));
    for j in 0..p {
        let room = (problem.memory_cap - problem.base_memory(j)) / m_unit;
        for q in problem.profiles(j) {
            let mut mem = Expression::default();
            for (c, &infl) in q.iter().enumerate() {
                let infl = infl as f64;
                mem += sum_of(c, j, &|k| {
                    (problem.memory.parameter + problem.act(k) * infl) / m_unit
                });
            }
            model.add_constraint(constraint!(mem <= room));
        }
    }
    Program {
        model,
        x,
        full_count,
        tau,
        objective,
        t_unit,
    }
}

/// The continuous relaxation's optimum: no plan has a smaller objective. `None` if the
/// relaxation is infeasible or the solver fails.
pub(crate) fn relaxation_bound(problem: &BalanceProblem) -> Option<f64> {
    problem.check().ok()?;
    let prog = program(problem, false);
    let solution = prog.model.solve().ok()?;
    Some(solution.eval(&prog.objective) * prog.t_unit)
}

/// The balancing MILP (any interleaving and kinds), solved with microlp under the time limit.
pub(crate) fn milp(
    problem: &BalanceProblem,
    initial: Option<&[Vec<[u32; KINDS]>]>,
) -> Result<BalancePlan, BalanceError> {
    problem.check()?;
    let (p, v) = (problem.stages, problem.interleave);
    let Program {
        mut model,
        x,
        full_count,
        tau,
        t_unit,
        ..
    } = program(problem, true);
    if let Some(init) = initial.filter(|c| problem.feasible(c)) {
        let mut start = Vec::new();
        for c in 0..v {
            for j in 0..p {
                for k in 0..KINDS {
                    if let Some(var) = x[c][j][k] {
                        start.push((var, init[c][j][k] as f64));
                    }
                }
            }
        }
        if let Some(n) = full_count {
            start.push((n, init[0][0][RecomputeKind::Full.index()] as f64));
        }
        let mut max = 0.0f64;
        for c in 0..v {
            for j in 0..p {
                let (f, b, _) = problem.chunk_times(init, c, j);
                max = max.max((f + b) / t_unit);
            }
        }
        start.push((tau, max));
        model = good_lp::WithInitialSolution::with_initial_solution(model, start);
    }
    let solution = match model.solve() {
        Ok(s) => s,
        Err(ResolutionError::Infeasible) => return Err(infeasible(problem)),
        Err(e) => return Err(BalanceError::Solver(e.to_string())),
    };
    let status = match solution.status() {
        SolutionStatus::Optimal => SolveStatus::Optimal,
        _ => SolveStatus::TimeLimit,
    };
    let counts: Vec<Vec<[u32; KINDS]>> = x
        .iter()
        .map(|chunk| {
            chunk
                .iter()
                .map(|stage| {
                    let mut n = [0u32; KINDS];
                    for (k, slot) in stage.iter().enumerate() {
                        if let Some(var) = slot {
                            n[k] = solution.value(*var).round().max(0.0) as u32;
                        }
                    }
                    n
                })
                .collect()
        })
        .collect();
    if !problem.feasible(&counts) {
        return Err(BalanceError::Solver(
            "the solver returned an assignment that violates the constraints".into(),
        ));
    }
    let objective = problem.objective(&counts);
    Ok(BalancePlan {
        lower_bound: (status == SolveStatus::Optimal).then_some(objective),
        objective,
        counts,
        status,
    })
}

/// Explains an infeasible instance: the least memory any stage needs with one layer per chunk
/// and the most memory-saving allowed kind, or the most layers the stages can hold together.
fn infeasible(problem: &BalanceProblem) -> BalanceError {
    let (p, v) = (problem.stages, problem.interleave);
    // Per chunk, the most micro-batches it ever holds (a bound for the explanation only).
    let most: Vec<Vec<f64>> = (0..p)
        .map(|j| {
            let profiles = problem.profiles(j);
            (0..v)
                .map(|c| profiles.iter().map(|q| q[c]).max().unwrap_or(0) as f64)
                .collect()
        })
        .collect();
    let cheapest = (0..KINDS)
        .filter(|&k| problem.allowed[k])
        .min_by(|&a, &b| problem.act(a).total_cmp(&problem.act(b)))
        .unwrap_or(0);
    let per_layer =
        |c: usize, j: usize| problem.memory.parameter + problem.act(cheapest) * most[j][c];
    let mut capacity = 0u64;
    for j in 0..p {
        let minimum: f64 = problem.base_memory(j) + (0..v).map(|c| per_layer(c, j)).sum::<f64>();
        if minimum > problem.memory_cap {
            return BalanceError::Infeasible(format!(
                "stage {j} needs {minimum:.1} with one layer per chunk even with `{}` \
                 recomputation, the cap is {:.1}",
                RecomputeKind::ALL[cheapest].name(),
                problem.memory_cap
            ));
        }
        // Extra layers go to the chunk where they cost least.
        let cheapest_chunk = (0..v)
            .map(|c| per_layer(c, j))
            .fold(f64::INFINITY, f64::min);
        capacity += v as u64 + ((problem.memory_cap - minimum) / cheapest_chunk).floor() as u64;
    }
    BalanceError::Infeasible(format!(
        "the {} layers do not fit: with `{}` recomputation the {p} stages hold at most \
         {capacity} within the cap of {:.1}",
        problem.layers,
        RecomputeKind::ALL[cheapest].name(),
        problem.memory_cap
    ))
}

/// Per-stage lists in SAPP's yaml convention, `[chunk][stage]`: layer offsets from the even
/// split, and cumulative recompute counts (`recompute` = full, `select_recompute` = selective +
/// both + full, `select_comm_recompute` = communication + both + full), so no list ever counts
/// more layers than its chunk holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SappLists {
    /// Layers minus the even split.
    pub offset: Vec<Vec<i64>>,
    /// Fully recomputed layers.
    pub recompute: Vec<Vec<u32>>,
    /// Layers recomputing the attention core.
    pub select_recompute: Vec<Vec<u32>>,
    /// Layers recomputing communication.
    pub select_comm_recompute: Vec<Vec<u32>>,
}

/// Even split of `layers` over `chunks` virtual stages in order: the last `layers % chunks`
/// get one more.
pub fn even_split(layers: usize, chunks: usize) -> Vec<u32> {
    let (q, r) = (layers / chunks, layers % chunks);
    (0..chunks)
        .map(|i| (q + usize::from(i >= chunks - r)) as u32)
        .collect()
}

/// Counts (`[c][j][r]`) in SAPP's cumulative convention.
pub fn sapp_lists(counts: &[Vec<[u32; KINDS]>], layers: usize) -> SappLists {
    let v = counts.len();
    let p = counts.first().map_or(0, Vec::len);
    let even = even_split(layers, p * v);
    let (s, co, b, f) = (1, 2, 3, 4);
    let map = |g: &dyn Fn(&[u32; KINDS], usize) -> i64| -> Vec<Vec<i64>> {
        (0..v)
            .map(|c| (0..p).map(|j| g(&counts[c][j], c * p + j)).collect())
            .collect()
    };
    let unsigned = |l: Vec<Vec<i64>>| -> Vec<Vec<u32>> {
        l.into_iter()
            .map(|r| r.into_iter().map(|x| x as u32).collect())
            .collect()
    };
    SappLists {
        offset: map(&|n, vs| n.iter().sum::<u32>() as i64 - even[vs] as i64),
        recompute: unsigned(map(&|n, _| n[f] as i64)),
        select_recompute: unsigned(map(&|n, _| (n[s] + n[b] + n[f]) as i64)),
        select_comm_recompute: unsigned(map(&|n, _| (n[co] + n[b] + n[f]) as i64)),
    }
}

/// Internal counts of one chunk from SAPP's cumulative counts: `full`, then `both = min(select,
/// comm) - full`, then the rest of `select` and `comm`, and `none` for what is left of `layers`.
pub fn counts_from_sapp(
    layers: u32,
    full: u32,
    select: u32,
    comm: u32,
) -> Result<[u32; KINDS], String> {
    if full > layers || select > layers || comm > layers {
        return Err(format!(
            "recompute counts ({full} full, {select} select, {comm} comm) exceed the chunk's \
             {layers} layers"
        ));
    }
    let both = select.min(comm).saturating_sub(full);
    let sel = select.saturating_sub(full + both);
    let com = comm.saturating_sub(full + both);
    let used = full + both + sel + com;
    if used > layers {
        return Err(format!(
            "{full} full, {select} select and {comm} comm recomputed layers need {used} layers, \
             the chunk has {layers}"
        ));
    }
    Ok([layers - used, sel, com, both, full])
}

#[cfg(test)]
mod tests;
