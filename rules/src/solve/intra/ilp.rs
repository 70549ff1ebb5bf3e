//! The sharding ILP (ALGORITHMS.md §3), solved with good_lp's microlp backend.
//!
//! One-hot binaries `s_v` per variable with more than one strategy; each edge linearised with
//! variables `e_uv` in `[0, 1]` whose row sums equal `s_u` and column sums equal `s_v` (with
//! integral `s` this forces `e_uv` to the one pair chosen, so `e` need not be integer); the
//! memory budget as one linear constraint. Variables with one strategy are constants.

use super::problem::{Assignment, Problem};
use good_lp::{
    Expression, ResolutionError, Solution, SolutionStatus, SolverModel, Variable, WithTimeLimit,
    constraint, microlp, variable, variables,
};

/// How an ILP solve ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IlpStatus {
    /// Proven optimal.
    Optimal,
    /// Stopped by the time limit: the incumbent, not proven optimal.
    TimeLimit,
}

/// What the ILP found.
#[derive(Clone, Debug, PartialEq)]
pub struct IlpSolution {
    /// The assignment.
    pub assignment: Assignment,
    /// Optimality.
    pub status: IlpStatus,
    /// A lower bound on the optimum: the cost itself when proven optimal, else the LP
    /// relaxation's.
    pub bound: f64,
}

/// Why the ILP found nothing.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum IlpError {
    /// No assignment fits the budget.
    #[error("no sharding fits the memory budget")]
    Infeasible,
    /// The solver failed (or the time limit came before any solution).
    #[error("the ILP solver failed: {0}")]
    Solver(String),
}

/// Solves `p` with the ILP under `time_limit` seconds. A solve stopped by the time limit
/// returns its incumbent with the LP relaxation's optimum as the lower bound.
pub fn solve(p: &Problem, time_limit: f64) -> Result<IlpSolution, IlpError> {
    // Settled without the solver (microlp can fail on such models with a singular basis).
    let least = p.leanest().memory;
    if !p.fits(least) {
        return Err(IlpError::Infeasible);
    }
    let (status, values, _) = run(p, time_limit, false)?;
    let choice: Vec<usize> = values
        .iter()
        .map(|xs| {
            xs.iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .map_or(0, |(i, _)| i)
        })
        .collect();
    let (cost, memory) = p.evaluate(&choice);
    if !p.fits(memory) {
        return Err(IlpError::Solver(
            "the solver's assignment exceeds the memory budget".into(),
        ));
    }
    let (status, bound) = match status {
        SolutionStatus::Optimal => (IlpStatus::Optimal, cost),
        _ => {
            let bound = run(p, time_limit, true).map_or(f64::NEG_INFINITY, |(_, _, lp)| lp);
            (IlpStatus::TimeLimit, bound.min(cost))
        }
    };
    Ok(IlpSolution {
        assignment: Assignment {
            choice,
            cost,
            memory,
        },
        status,
        bound,
    })
}

/// Builds and solves the model (binary strategies, or relaxed to `[0, 1]`): the solver's
/// status, the strategy weights of every variable and the objective.
fn run(
    p: &Problem,
    time_limit: f64,
    relaxed: bool,
) -> Result<(SolutionStatus, Vec<Vec<f64>>, f64), IlpError> {
    let n = p.vars.len();
    // Scale the objective to order one for the solver.
    let scale = {
        let m = p
            .vars
            .iter()
            .flat_map(|v| v.cost.iter())
            .chain(p.edges.iter().flat_map(|e| e.cost.iter()))
            .fold(0.0f64, |a, &c| a.max(c.abs()));
        if m > 0.0 { 1.0 / m } else { 1.0 }
    };
    let mem_scale = p
        .memory_budget
        .map_or(1.0, |b| if b > 0.0 { 1.0 / b } else { 1.0 });
    let mut vars = variables!();
    let s: Vec<Option<Vec<Variable>>> = (0..n)
        .map(|v| {
            (p.k(v) > 1).then(|| {
                (0..p.k(v))
                    .map(|_| {
                        vars.add(if relaxed {
                            variable().min(0.0).max(1.0)
                        } else {
                            variable().binary()
                        })
                    })
                    .collect()
            })
        })
        .collect();
    // The indicator of strategy i of variable v: a variable, or the constant 1 (one strategy).
    let ind = |v: usize, i: usize| -> Expression {
        match &s[v] {
            Some(x) => Expression::from(x[i]),
            None => Expression::from(1.0),
        }
    };
    let mut objective = Expression::default();
    for (v, var) in p.vars.iter().enumerate() {
        for (i, &c) in var.cost.iter().enumerate() {
            objective += ind(v, i) * (c * scale);
        }
    }
    let mut edge_vars: Vec<Vec<Variable>> = Vec::with_capacity(p.edges.len());
    for e in &p.edges {
        let ev: Vec<Variable> = (0..e.cost.len())
            .map(|_| vars.add(variable().min(0.0).max(1.0)))
            .collect();
        for (x, &c) in ev.iter().zip(e.cost.iter()) {
            objective += *x * (c * scale);
        }
        edge_vars.push(ev);
    }
    let objective_value = objective.clone();
    let mut model = vars.minimise(objective).using(microlp);
    model = model.with_time_limit(time_limit.max(0.01));
    for xs in s.iter().flatten() {
        let mut sum = Expression::default();
        for x in xs {
            sum += *x;
        }
        model.add_constraint(constraint!(sum == 1));
    }
    for (e, ev) in p.edges.iter().zip(&edge_vars) {
        let (ku, kv) = (p.k(e.u), p.k(e.v));
        for i in 0..ku {
            let mut row = Expression::default();
            for j in 0..kv {
                row += ev[i * kv + j];
            }
            model.add_constraint(constraint!(row == ind(e.u, i)));
        }
        for j in 0..kv {
            let mut col = Expression::default();
            for i in 0..ku {
                col += ev[i * kv + j];
            }
            model.add_constraint(constraint!(col == ind(e.v, j)));
        }
    }
    if let Some(b) = p.memory_budget {
        let mut mem = Expression::default();
        for (v, var) in p.vars.iter().enumerate() {
            for (i, &m) in var.memory.iter().enumerate() {
                mem += ind(v, i) * (m * mem_scale);
            }
        }
        model.add_constraint(constraint!(mem <= b * mem_scale * (1.0 + 1e-9)));
    }
    let solution = match model.solve() {
        Ok(sol) => sol,
        Err(ResolutionError::Infeasible) => return Err(IlpError::Infeasible),
        Err(e) => return Err(IlpError::Solver(e.to_string())),
    };
    let values = (0..n)
        .map(|v| match &s[v] {
            Some(xs) => xs.iter().map(|&x| solution.value(x)).collect(),
            None => vec![1.0],
        })
        .collect();
    let value = solution.eval(&objective_value) / scale;
    Ok((solution.status(), values, value))
}
