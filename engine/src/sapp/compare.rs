//! Plans priced next to the balanced one, as SAPP's `-manual` and `-naive` options do: a plan
//! written in SAPP's output convention (`offset`, `recompute`, `select_recompute`,
//! `select_comm_recompute`, per chunk and stage), and the even split of the layers. Each is
//! simulated with the same memory model and schedule as the balanced plan, and reported
//! invalid, with the reasons, when it breaks the cap or cannot be a plan at all.

use super::{Reader, RecomputeSetting, SappInput};
use crate::error::EngineError;
use autopar_rules::solve::balance::{
    BalanceProblem, KINDS, SappLists, counts_from_sapp, even_split, sapp_lists,
};
use autopar_rules::solve::schedule::{Bubble, Schedule, simulate};
use std::path::Path;
use yaml_serde::Value;

/// What a plan of a balancing problem costs when simulated.
#[derive(Clone, Debug)]
pub struct Priced {
    /// Bubble decomposition.
    pub bubble: Bubble,
    /// End of the step, in the yaml's time unit.
    pub total_time: f64,
    /// Peak memory per stage: static memory plus the simulated activation peak.
    pub peak_memory: Vec<f64>,
    /// Forward + backward time of one micro-batch per stage, all chunks.
    pub stage_time: Vec<f64>,
    /// The balancer's objective for the plan.
    pub objective: f64,
}

/// A plan priced next to the balanced one.
#[derive(Clone, Debug)]
pub struct ComparedPlan {
    /// Its name: the manual file's key, or which naive split it is.
    pub name: String,
    /// Chunks per stage.
    pub interleave: usize,
    /// The plan in SAPP's lists, as given (or as the even split makes them).
    pub lists: SappLists,
    /// Its price; `None` when it cannot be simulated (an empty chunk, recompute counts that
    /// exceed a chunk, another number of layers).
    pub priced: Option<Priced>,
    /// Why it is not a valid plan (empty when it is).
    pub violations: Vec<String>,
}

/// Simulates `counts` of `problem` (which must be [`BalanceProblem::simulable`]).
pub fn price(
    problem: &BalanceProblem,
    counts: &[Vec<[u32; KINDS]>],
) -> Result<(Priced, autopar_rules::solve::schedule::Simulation), EngineError> {
    let (p, v) = (problem.stages, problem.interleave);
    let spec = problem.pipeline(counts, Schedule::OneFOneB);
    let simulation = simulate(&spec).map_err(|e| EngineError::Infeasible(e.to_string()))?;
    let stage_time = (0..p)
        .map(|j| {
            (0..v)
                .map(|c| spec.forward[c][j] + spec.backward[c][j])
                .sum()
        })
        .collect();
    let peak_memory = (0..p)
        .map(|j| {
            let layers: u32 = counts.iter().map(|c| c[j].iter().sum::<u32>()).sum();
            problem.base_memory(j)
                + f64::from(layers) * problem.memory.parameter
                + simulation.peak_activation[j]
        })
        .collect();
    let priced = Priced {
        bubble: simulation.bubble,
        total_time: simulation.makespan,
        peak_memory,
        stage_time,
        objective: problem.objective(counts),
    };
    Ok((priced, simulation))
}

/// Prices `counts` as a compared plan named `name`.
fn compared(
    problem: &BalanceProblem,
    name: String,
    lists: SappLists,
    counts: Result<Vec<Vec<[u32; KINDS]>>, Vec<String>>,
) -> Result<ComparedPlan, EngineError> {
    let interleave = problem.interleave;
    let counts = match counts {
        Ok(c) => c,
        Err(violations) => {
            return Ok(ComparedPlan {
                name,
                interleave,
                lists,
                priced: None,
                violations,
            });
        }
    };
    let violations = problem.violations(&counts);
    let priced = if problem.simulable(&counts) {
        Some(price(problem, &counts)?.0)
    } else {
        None
    };
    Ok(ComparedPlan {
        name,
        interleave,
        lists: sapp_lists(&counts, problem.layers),
        priced,
        violations,
    })
}

/// Per chunk and stage: layers from the offsets, and the cumulative recompute counts
/// (`full`, `select`, `comm`) turned into counts per kind; or why they are not a plan.
fn counts_of(
    layers: usize,
    p: usize,
    lists: &SappLists,
) -> Result<Vec<Vec<[u32; KINDS]>>, Vec<String>> {
    let v = lists.offset.len();
    let even = even_split(layers, p * v);
    let mut why = Vec::new();
    let mut counts = vec![vec![[0u32; KINDS]; p]; v];
    let total: i64 = lists.offset.iter().flatten().sum();
    if total != 0 {
        why.push(format!(
            "the offsets add up to {total}, not 0: the chunks would hold {} layers, the model \
             has {layers}",
            layers as i64 + total
        ));
    }
    for c in 0..v {
        for j in 0..p {
            let n = even[c * p + j] as i64 + lists.offset[c][j];
            if n < 1 {
                why.push(format!(
                    "chunk {c} of stage {j} would hold {n} layers (offset {})",
                    lists.offset[c][j]
                ));
                continue;
            }
            let n = u32::try_from(n).unwrap_or(u32::MAX);
            match counts_from_sapp(
                n,
                lists.recompute[c][j],
                lists.select_recompute[c][j],
                lists.select_comm_recompute[c][j],
            ) {
                Ok(k) => counts[c][j] = k,
                Err(e) => why.push(format!("chunk {c} of stage {j}: {e}")),
            }
        }
    }
    if why.is_empty() { Ok(counts) } else { Err(why) }
}

/// How a recompute list is written: counts per chunk and stage, or every layer.
enum Written {
    /// Counts (`[chunk][stage]`).
    Counts(Vec<Vec<i64>>),
    /// `true`: every layer of every chunk.
    All,
}

/// Reads a list of SAPP's plan convention: `0`/`false`, `true` (`all_allowed`), a list of `p`
/// integers (one chunk), or `v` lists of `p` integers.
fn read_list(
    r: &Reader<'_>,
    field: &str,
    value: Option<&Value>,
    p: usize,
    v: usize,
    all_allowed: bool,
) -> Result<Written, EngineError> {
    let expected = if all_allowed {
        format!("0, false, true, a list of {p} integers or {v} such lists (one per chunk)")
    } else {
        format!("0, a list of {p} integers or {v} such lists (one per chunk)")
    };
    let shown = |x: &Value| {
        yaml_serde::to_string(x)
            .unwrap_or_default()
            .trim()
            .to_string()
    };
    let ints = |l: &[Value]| -> Option<Vec<i64>> {
        let out: Option<Vec<i64>> = l.iter().map(Value::as_i64).collect();
        out.filter(|o| o.len() == p)
    };
    match value {
        None | Some(Value::Bool(false)) => Ok(Written::Counts(vec![vec![0; p]; v])),
        Some(Value::Number(n)) if n.as_i64() == Some(0) => Ok(Written::Counts(vec![vec![0; p]; v])),
        Some(Value::Bool(true)) if all_allowed => Ok(Written::All),
        Some(Value::Sequence(l)) if l.iter().all(Value::is_sequence) && !l.is_empty() => {
            let rows: Option<Vec<Vec<i64>>> = l
                .iter()
                .map(|x| x.as_sequence().and_then(|s| ints(s)))
                .collect();
            match rows {
                Some(rows) if rows.len() == v => Ok(Written::Counts(rows)),
                _ => Err(r.err(field, expected, shown(value.unwrap_or(&Value::Null)))),
            }
        }
        Some(Value::Sequence(l)) if v == 1 => match ints(l) {
            Some(row) => Ok(Written::Counts(vec![row])),
            None => Err(r.err(field, expected, shown(value.unwrap_or(&Value::Null)))),
        },
        Some(other) => Err(r.err(field, expected, shown(other))),
    }
}

/// One plan of a manual file, before it is checked against the problem.
struct Written4 {
    name: String,
    interleave: usize,
    offset: Vec<Vec<i64>>,
    recompute: [Written; 3],
}

const PLAN_KEYS: [&str; 7] = [
    "offset",
    "recompute",
    "select_recompute",
    "select_comm_recompute",
    "interleave_num",
    "show",
    "file_name",
];

/// Reads SAPP's `-manual` file: named plans (`manual1: {offset, recompute, select_recompute,
/// select_comm_recompute, interleave_num, show, file_name}`, SAPP's format; `show` and
/// `file_name` only steer SAPP's plots), or the four lists at the top level.
fn read_manual(
    file: &Path,
    text: &str,
    p: usize,
    default_interleave: usize,
) -> Result<Vec<Written4>, EngineError> {
    let r = Reader { file, text };
    let doc: Value = yaml_serde::from_str(text).map_err(|e| {
        EngineError::config(crate::diagnostic::Diagnostic::from_yaml(file, text, &e))
    })?;
    let Some(top) = doc.as_mapping() else {
        return Err(r.err(
            "(document)",
            "a mapping of plan names to plans, or a plan's lists",
            "something else",
        ));
    };
    let key_name = |k: &Value| k.as_str().map(str::to_string);
    let plans: Vec<(String, &yaml_serde::Mapping)> = if top.contains_key("offset") {
        vec![("manual".to_string(), top)]
    } else {
        let mut out = Vec::new();
        for (k, v) in top {
            let name =
                key_name(k).ok_or_else(|| r.err("(document)", "plan names", format!("{k:?}")))?;
            let m = v.as_mapping().ok_or_else(|| {
                r.err(
                    &name,
                    "a plan: offset, recompute, select_recompute, select_comm_recompute",
                    "something else",
                )
            })?;
            out.push((name, m));
        }
        out
    };
    if plans.is_empty() {
        return Err(r.err("(document)", "at least one plan", "none"));
    }
    let mut out = Vec::new();
    for (name, m) in plans {
        for k in m.keys() {
            let key = key_name(k).unwrap_or_default();
            if !PLAN_KEYS.contains(&key.as_str()) {
                return Err(r.err(
                    &format!("{name}.{key}"),
                    format!("one of {}", PLAN_KEYS.join(", ")),
                    format!("unknown field `{key}`"),
                ));
            }
        }
        let interleave = match m.get("interleave_num") {
            None => default_interleave,
            Some(x) => x
                .as_u64()
                .filter(|&i| (1..=64).contains(&i))
                .map(|i| i as usize)
                .ok_or_else(|| {
                    r.err(
                        &format!("{name}.interleave_num"),
                        "an integer in 1..=64",
                        format!("{x:?}"),
                    )
                })?,
        };
        let field = |f: &str| format!("{name}.{f}");
        let offset = match read_list(&r, &field("offset"), m.get("offset"), p, interleave, false)? {
            Written::Counts(c) => c,
            Written::All => vec![vec![0; p]; interleave],
        };
        let list = |f: &str| read_list(&r, &field(f), m.get(f), p, interleave, true);
        let recompute = [
            list("recompute")?,
            list("select_recompute")?,
            list("select_comm_recompute")?,
        ];
        for (f, w) in ["recompute", "select_recompute", "select_comm_recompute"]
            .iter()
            .zip(&recompute)
        {
            if let Written::Counts(c) = w
                && let Some(x) = c.iter().flatten().find(|&&x| x < 0)
            {
                return Err(r.err(&field(f), "counts of at least 0", x.to_string()));
            }
        }
        out.push(Written4 {
            name,
            interleave,
            offset,
            recompute,
        });
    }
    Ok(out)
}

/// The lists of a plan with `offset`, its recompute lists resolved (`true`: every layer of
/// each chunk, which needs the chunk sizes the offsets give).
fn resolve(layers: usize, p: usize, offset: Vec<Vec<i64>>, recompute: &[Written; 3]) -> SappLists {
    let v = offset.len();
    let even = even_split(layers, p * v);
    let size = |c: usize, j: usize| (even[c * p + j] as i64 + offset[c][j]).max(0);
    let resolve = |w: &Written| -> Vec<Vec<u32>> {
        (0..v)
            .map(|c| {
                (0..p)
                    .map(|j| {
                        let n = match w {
                            Written::All => size(c, j),
                            Written::Counts(rows) => rows[c][j],
                        };
                        u32::try_from(n).unwrap_or(u32::MAX)
                    })
                    .collect()
            })
            .collect()
    };
    SappLists {
        recompute: resolve(&recompute[0]),
        select_recompute: resolve(&recompute[1]),
        select_comm_recompute: resolve(&recompute[2]),
        offset,
    }
}

/// The problem `base` with `interleave` chunks per stage.
fn with_interleave(base: &BalanceProblem, interleave: usize) -> BalanceProblem {
    BalanceProblem {
        interleave,
        ..base.clone()
    }
}

/// Prices every plan of the manual file `file` on `base` (each with its own interleaving).
pub fn manual_plans(file: &Path, base: &BalanceProblem) -> Result<Vec<ComparedPlan>, EngineError> {
    let text = crate::input::read_text(file)?;
    let p = base.stages;
    let mut out = Vec::new();
    for w in read_manual(file, &text, p, base.interleave)? {
        let problem = with_interleave(base, w.interleave);
        let lists = resolve(base.layers, p, w.offset, &w.recompute);
        let counts = counts_of(base.layers, p, &lists);
        if let Err(why) = problem.check() {
            out.push(ComparedPlan {
                name: w.name,
                interleave: w.interleave,
                lists,
                priced: None,
                violations: vec![why.to_string()],
            });
            continue;
        }
        out.push(compared(&problem, w.name, lists, counts)?);
    }
    Ok(out)
}

/// SAPP's naive plans: the even split of the layers, under the recomputation the yaml
/// measured (its first run's lists, when they were written for this many stages and one
/// chunk), with no recomputation, and with every layer fully recomputed.
pub fn naive_plans(
    input: &SappInput,
    base: &BalanceProblem,
) -> Result<Vec<ComparedPlan>, EngineError> {
    let (p, v) = (base.stages, base.interleave);
    let layers = base.layers;
    let zero = vec![vec![0i64; p]; v];
    let mut out = Vec::new();
    // The yaml's settings: per-stage lists apply to this split only when written for it.
    let name = "naive (even split, the yaml's recomputation)".to_string();
    let per_stage = input
        .recompute
        .iter()
        .any(|r| matches!(r, RecomputeSetting::PerStage(_)));
    let measured = input.runs.first().map_or(p, |r| r.stages);
    if per_stage && (measured != p || v != 1) {
        out.push(ComparedPlan {
            name,
            interleave: v,
            lists: sapp_lists(&vec![vec![[0; KINDS]; p]; v], layers),
            priced: None,
            violations: vec![format!(
                "the yaml's recompute lists are per stage of its {measured} stages and one chunk; \
                 this split has {p} stages of {v} chunk(s)"
            )],
        });
    } else {
        let written = |r: &RecomputeSetting| match r {
            RecomputeSetting::None => Written::Counts(zero.clone()),
            RecomputeSetting::All => Written::All,
            RecomputeSetting::PerStage(l) => Written::Counts(vec![l.clone()]),
        };
        let [full, select, comm] = &input.recompute;
        let lists = resolve(
            layers,
            p,
            zero.clone(),
            &[written(full), written(select), written(comm)],
        );
        let counts = counts_of(layers, p, &lists);
        out.push(compared(base, name, lists, counts)?);
    }
    let none = || Written::Counts(zero.clone());
    for (name, full) in [
        ("naive (even split, no recomputation)", false),
        ("naive (even split, full recomputation)", true),
    ] {
        let recompute = if full {
            [Written::All, Written::All, Written::All]
        } else {
            [none(), none(), none()]
        };
        let lists = resolve(layers, p, zero.clone(), &recompute);
        let counts = counts_of(layers, p, &lists);
        out.push(compared(base, name.to_string(), lists, counts)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Any text is read as plans or refused with an input error: never a panic.
        #[test]
        fn any_manual_text_reads_or_is_refused(text in "[a-z0-9_:,\\[\\] \n-]{0,200}") {
            if let Err(e) = read_manual(Path::new("m.yaml"), &text, 4, 1) {
                prop_assert!(e.is_input_error(), "{e}");
            }
        }

        /// Plans written in SAPP's convention read back as counts that hold the model's layers
        /// in every chunk, or as the reasons they cannot.
        #[test]
        fn written_plans_become_counts_or_reasons(
            offset in proptest::collection::vec(-3i64..4, 4),
            select in proptest::collection::vec(0i64..6, 4),
            comm in proptest::collection::vec(0i64..6, 4),
        ) {
            let text = format!(
                "plan:\n  offset: {offset:?}\n  select_recompute: {select:?}\n  \
                 select_comm_recompute: {comm:?}\n"
            );
            let plans = read_manual(Path::new("m.yaml"), &text, 4, 1).expect("a plan");
            prop_assert_eq!(plans.len(), 1);
            let w = &plans[0];
            let lists = resolve(16, 4, w.offset.clone(), &w.recompute);
            match counts_of(16, 4, &lists) {
                Ok(counts) => {
                    let total: u32 = counts.iter().flatten().flatten().sum();
                    prop_assert_eq!(total, 16);
                    prop_assert_eq!(sapp_lists(&counts, 16), lists);
                }
                Err(why) => prop_assert!(!why.is_empty()),
            }
        }
    }
}
