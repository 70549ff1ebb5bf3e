//! MindSpore SAPP's pipeline-balancing input (`pipeline_config`, `time_config`,
//! `recompute_config`, `memory_usage`), read with SAPP's meaning of every field, and the
//! `solve balance` computation on it: decompose the measured memory, balance, simulate.
//!
//! SAPP conventions kept: `time_config` values are forward + backward time per micro-batch of
//! the head, of one body layer and of the tail, the forward taking a third; recompute counts are
//! cumulative per stage (`select_recompute` counts layers recomputing the attention core whether
//! or not they also recompute communication); `true` means every layer of the stage; a list of
//! lists gives several measured runs; head and tail memory come from the first run.

mod compare;

pub use compare::{ComparedPlan, Priced};

use crate::diagnostic::Diagnostic;
use crate::error::EngineError;
use autopar_rules::solve::balance::{
    BalanceError, BalancePlan, BalanceProblem, Extra, KINDS, MemoryRun, MemoryTerms,
    SAPP_RECOMPUTE_COEF, SappLists, balance, counts_from_sapp, decompose, even_split, sapp_lists,
};
use autopar_rules::solve::schedule::{Bubble, Simulation};
use serde::Deserialize;
use std::path::Path;
use yaml_serde::Value;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSapp {
    pipeline_config: RawPipeline,
    time_config: RawTime,
    #[serde(default)]
    recompute_config: Option<RawRecompute>,
    memory_usage: RawMemory,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPipeline {
    pipeline_num: u32,
    num_layer: u32,
    #[serde(default)]
    offset: Option<Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTime {
    head: f64,
    body: f64,
    tail: f64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRecompute {
    #[serde(default)]
    recompute: Option<Value>,
    #[serde(default)]
    select_recompute: Option<Value>,
    #[serde(default)]
    select_comm_recompute: Option<Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMemory {
    head_memory: f64,
    tail_memory: f64,
    body_memories: RawBody,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBody {
    stage_id: Value,
    memories: Value,
}

/// A parsed SAPP input.
#[derive(Clone, Debug, PartialEq)]
pub struct SappInput {
    /// Body layers.
    pub layers: usize,
    /// Forward + backward time per micro-batch of head, body layer, tail.
    pub times: (f64, f64, f64),
    /// The measured runs.
    pub runs: Vec<MemoryRun>,
    /// The first run's `recompute`, `select_recompute` and `select_comm_recompute`, as written.
    pub recompute: [RecomputeSetting; 3],
}

/// One recompute list of the yaml, as written.
#[derive(Clone, Debug, PartialEq)]
pub enum RecomputeSetting {
    /// `false`, `0` or absent.
    None,
    /// `true`: every layer.
    All,
    /// Cumulative counts per stage.
    PerStage(Vec<i64>),
}

/// What `solve balance` computes.
#[derive(Clone, Debug)]
pub struct BalanceReport {
    /// Decomposed memory terms (MB).
    pub terms: MemoryTerms,
    /// The balancing problem solved.
    pub problem: BalanceProblem,
    /// The balanced plan.
    pub plan: BalancePlan,
    /// The plan in SAPP's yaml lists.
    pub lists: SappLists,
    /// The simulated step.
    pub simulation: Simulation,
    /// Peak memory per stage (MB): static memory plus the simulated activation peak.
    pub peak_memory: Vec<f64>,
    /// Forward + backward time of one micro-batch per stage, all chunks.
    pub stage_time: Vec<f64>,
    /// Bubble decomposition.
    pub bubble: Bubble,
    /// Wall time of the solver, s.
    pub solve_seconds: f64,
    /// Plans priced next to it (`--manual`, `--naive`), in order.
    pub compared: Vec<ComparedPlan>,
    /// With interleaving: the best plan of one chunk per stage under the same cap, when its
    /// bubble is smaller than the interleaved plan's.
    pub non_interleaved: Option<(SappLists, Priced)>,
}

/// Options of `solve balance` (SAPP's command-line flags).
#[derive(Clone, Debug)]
pub struct BalanceOptions {
    /// Pipeline stages to balance for (`-s`).
    pub stages: usize,
    /// Micro-batches (`-mb`).
    pub microbatches: usize,
    /// Chunks per stage (`-i`).
    pub interleave: usize,
    /// Memory cap per stage, MB (`-mem`).
    pub memory_mb: f64,
    /// Solver time limit, s (`-t`).
    pub time_limit: f64,
    /// SAPP's `-manual`: a file of plans to price next to the balanced one.
    pub manual: Option<std::path::PathBuf>,
    /// SAPP's `-naive`: price the even split too.
    pub naive: bool,
}

struct Reader<'a> {
    file: &'a Path,
    text: &'a str,
}

impl Reader<'_> {
    fn err(
        &self,
        field: &str,
        expected: impl Into<String>,
        found: impl Into<String>,
    ) -> EngineError {
        // Point at the field's key: the last path segment, first occurrence as `key:`.
        let key = field.rsplit('.').next().unwrap_or(field);
        let key = key.split('[').next().unwrap_or(key);
        let offset = self
            .text
            .match_indices(&format!("{key}:"))
            .map(|(i, _)| i)
            .find(|&i| {
                i == 0
                    || !self.text.as_bytes()[i - 1].is_ascii_alphanumeric()
                        && self.text.as_bytes()[i - 1] != b'_'
            });
        EngineError::config(Diagnostic::at(
            self.file, self.text, offset, field, expected, found,
        ))
    }

    /// `0`, a list of `p` integers, or a list of such lists (one per run).
    fn runs_of_ints(
        &self,
        field: &str,
        v: Option<&Value>,
        p: usize,
        runs: usize,
        all: &dyn Fn(usize, usize) -> i64,
    ) -> Result<Vec<Vec<i64>>, EngineError> {
        let ints = |list: &[Value]| -> Option<Vec<i64>> {
            list.iter().map(|x| x.as_i64()).collect::<Option<Vec<_>>>()
        };
        let expected =
            format!("0, false, true, a list of {p} integers or a list of {runs} such lists");
        let found = |v: &Value| {
            yaml_serde::to_string(v)
                .unwrap_or_default()
                .trim()
                .to_string()
        };
        let out = match v {
            None | Some(Value::Bool(false)) => vec![vec![0; p]; runs],
            Some(Value::Number(n)) if n.as_i64() == Some(0) => vec![vec![0; p]; runs],
            Some(Value::Bool(true)) => (0..runs)
                .map(|r| (0..p).map(|j| all(r, j)).collect())
                .collect(),
            Some(Value::Sequence(list)) if list.iter().all(Value::is_sequence) => {
                let mut out = Vec::new();
                for item in list {
                    let l = item.as_sequence().and_then(|s| ints(s));
                    match l {
                        Some(l) if l.len() == p => out.push(l),
                        _ => return Err(self.err(field, expected, found(item))),
                    }
                }
                if out.len() != runs {
                    return Err(self.err(
                        field,
                        format!("{runs} lists, one per measured run"),
                        format!("{} lists", out.len()),
                    ));
                }
                out
            }
            Some(Value::Sequence(list)) => match ints(list) {
                Some(l) if l.len() == p => vec![l; runs],
                _ => return Err(self.err(field, expected, found(v.unwrap_or(&Value::Null)))),
            },
            Some(other) => return Err(self.err(field, expected, found(other))),
        };
        Ok(out)
    }
}

fn count_runs(values: &[Option<&Value>]) -> usize {
    values
        .iter()
        .filter_map(|v| match v {
            Some(Value::Sequence(l)) if !l.is_empty() && l.iter().all(Value::is_sequence) => {
                Some(l.len())
            }
            _ => None,
        })
        .max()
        .unwrap_or(1)
}

/// Parses SAPP yaml text read from `file`.
pub fn parse(file: &Path, text: &str) -> Result<SappInput, EngineError> {
    let raw: RawSapp = yaml_serde::from_str(text)
        .map_err(|e| EngineError::config(Diagnostic::from_yaml(file, text, &e)))?;
    let r = Reader { file, text };
    let p = raw.pipeline_config.pipeline_num as usize;
    let layers = raw.pipeline_config.num_layer as usize;
    if p < 3 {
        return Err(r.err(
            "pipeline_config.pipeline_num",
            "at least 3 stages (first, last and middle stages are measured)",
            p.to_string(),
        ));
    }
    if layers < p {
        return Err(r.err(
            "pipeline_config.num_layer",
            format!("at least one layer per stage ({p})"),
            layers.to_string(),
        ));
    }
    let t = &raw.time_config;
    for (name, x) in [("head", t.head), ("body", t.body), ("tail", t.tail)] {
        if !(x.is_finite() && x >= 0.0) {
            return Err(r.err(
                &format!("time_config.{name}"),
                "a non-negative time",
                x.to_string(),
            ));
        }
    }
    let rc = raw.recompute_config.as_ref();
    let offset_v = raw.pipeline_config.offset.as_ref();
    let full_v = rc.and_then(|c| c.recompute.as_ref());
    let sel_v = rc.and_then(|c| c.select_recompute.as_ref());
    let comm_v = rc.and_then(|c| c.select_comm_recompute.as_ref());
    let body = &raw.memory_usage.body_memories;
    let runs = count_runs(&[offset_v, full_v, sel_v, comm_v, Some(&body.stage_id)]);
    let nass = even_split(layers, p);
    let offsets = r.runs_of_ints("pipeline_config.offset", offset_v, p, runs, &|_, _| 0)?;
    let stage_layers: Vec<Vec<i64>> = offsets
        .iter()
        .map(|o| o.iter().zip(&nass).map(|(o, &n)| n as i64 + o).collect())
        .collect();
    for (run, l) in stage_layers.iter().enumerate() {
        if l.iter().any(|&n| n < 1) || l.iter().sum::<i64>() != layers as i64 {
            return Err(r.err(
                "pipeline_config.offset",
                format!("offsets that keep every stage non-empty and sum to 0 ({layers} layers)"),
                format!("run {run}: stage layers {l:?}"),
            ));
        }
    }
    let all = |run: usize, j: usize| stage_layers[run][j];
    let full = r.runs_of_ints("recompute_config.recompute", full_v, p, runs, &all)?;
    let sel = r.runs_of_ints("recompute_config.select_recompute", sel_v, p, runs, &all)?;
    let comm = r.runs_of_ints(
        "recompute_config.select_comm_recompute",
        comm_v,
        p,
        runs,
        &all,
    )?;
    let ids = per_run_values(
        &r,
        "memory_usage.body_memories.stage_id",
        &body.stage_id,
        runs,
        "integer stage ids",
        Value::as_i64,
    )?;
    let mems = per_run_values(
        &r,
        "memory_usage.body_memories.memories",
        &body.memories,
        runs,
        "memories in MB",
        |x| x.as_f64().filter(|m| m.is_finite() && *m >= 0.0),
    )?;
    let mut memory_runs = Vec::with_capacity(runs);
    for run in 0..runs {
        if ids[run].len() != mems[run].len() {
            return Err(r.err(
                "memory_usage.body_memories.memories",
                format!("one memory per stage id ({})", ids[run].len()),
                format!("{} memories in run {run}", mems[run].len()),
            ));
        }
        let mut counts = Vec::with_capacity(p);
        for j in 0..p {
            let n = stage_layers[run][j] as u32;
            let get = |l: &Vec<Vec<i64>>| u32::try_from(l[run][j]).unwrap_or(u32::MAX);
            let c = counts_from_sapp(n, get(&full), get(&sel), get(&comm)).map_err(|why| {
                r.err(
                    "recompute_config",
                    "recompute counts within each stage",
                    format!("stage {j}: {why}"),
                )
            })?;
            counts.push(c);
        }
        let mut memories = Vec::new();
        if run == 0 {
            memories.push((0, raw.memory_usage.head_memory));
            memories.push((p - 1, raw.memory_usage.tail_memory));
        }
        for (&id, &m) in ids[run].iter().zip(&mems[run]) {
            if id <= 0 || id as usize >= p - 1 {
                return Err(r.err(
                    "memory_usage.body_memories.stage_id",
                    format!("middle stages 1..{}", p - 2),
                    id.to_string(),
                ));
            }
            memories.push((id as usize, m));
        }
        memory_runs.push(MemoryRun {
            stages: p,
            layers: stage_layers[run].iter().map(|&n| n as u32).collect(),
            counts,
            memories,
        });
    }
    let setting = |v: Option<&Value>, lists: &[Vec<i64>]| match v {
        Some(Value::Bool(true)) => RecomputeSetting::All,
        None | Some(Value::Bool(false)) => RecomputeSetting::None,
        Some(Value::Number(n)) if n.as_i64() == Some(0) => RecomputeSetting::None,
        Some(_) => RecomputeSetting::PerStage(lists[0].clone()),
    };
    Ok(SappInput {
        layers,
        times: (t.head, t.body, t.tail),
        runs: memory_runs,
        recompute: [
            setting(full_v, &full),
            setting(sel_v, &sel),
            setting(comm_v, &comm),
        ],
    })
}

/// A list of values, or a list of `runs` lists, each value read by `read` (`expected` says
/// what it accepts).
fn per_run_values<T>(
    r: &Reader<'_>,
    field: &str,
    v: &Value,
    runs: usize,
    expected: &str,
    read: impl Fn(&Value) -> Option<T>,
) -> Result<Vec<Vec<T>>, EngineError> {
    per_run(r, field, v, runs)?
        .iter()
        .map(|l| {
            l.iter()
                .map(|x| read(x).ok_or_else(|| r.err(field, expected, format!("{x:?}"))))
                .collect()
        })
        .collect()
}

/// A list, or a list of `runs` lists.
fn per_run<'v>(
    r: &Reader<'_>,
    field: &str,
    v: &'v Value,
    runs: usize,
) -> Result<Vec<&'v Vec<Value>>, EngineError> {
    match v {
        Value::Sequence(l) if !l.is_empty() && l.iter().all(Value::is_sequence) => {
            let out: Vec<&Vec<Value>> = l.iter().filter_map(Value::as_sequence).collect();
            if out.len() != runs {
                return Err(r.err(
                    field,
                    format!("{runs} lists, one per measured run"),
                    format!("{} lists", out.len()),
                ));
            }
            Ok(out)
        }
        Value::Sequence(l) if runs == 1 => Ok(vec![l]),
        other => Err(r.err(
            field,
            format!("a list (or {runs} lists, one per run)"),
            format!("{other:?}"),
        )),
    }
}

/// Reads, decomposes, balances and simulates: what `autopar solve balance` does.
pub fn solve_balance(file: &Path, opts: &BalanceOptions) -> Result<BalanceReport, EngineError> {
    let text = crate::input::read_text(file)?;
    let input = parse(file, &text)?;
    let terms = decompose(&input.runs).map_err(|e| {
        EngineError::config(Diagnostic::at(
            file,
            &text,
            None,
            "memory_usage",
            "measurements that determine the memory terms",
            e.to_string(),
        ))
    })?;
    let (head, body, tail) = input.times;
    // SAPP: forward a third of forward + backward; recomputation scales the backward.
    let mut backward = [0.0; KINDS];
    for (k, b) in backward.iter_mut().enumerate() {
        *b = 2.0 * body / 3.0 * (1.0 + SAPP_RECOMPUTE_COEF[k]);
    }
    let extra = |t: f64| Extra {
        forward: t / 3.0,
        backward: 2.0 * t / 3.0,
    };
    let mut allowed = [false; KINDS];
    for (k, a) in allowed.iter_mut().enumerate() {
        *a = terms.activation[k].is_some();
    }
    let problem = BalanceProblem {
        stages: opts.stages,
        interleave: opts.interleave,
        microbatches: opts.microbatches,
        layers: input.layers,
        forward: body / 3.0,
        backward,
        head: extra(head),
        tail: extra(tail),
        memory: terms,
        allowed,
        memory_cap: opts.memory_mb,
        uniform_full: false,
        time_limit: opts.time_limit,
    };
    let start = std::time::Instant::now();
    let plan = balance(&problem, None).map_err(|e| match e {
        // Sizes that cannot work are the command line's fault.
        BalanceError::Shape(why) => EngineError::Argument {
            flag: "-s/-mb/-i",
            expected: format!(
                "stages, micro-batches and interleaving that fit {} layers",
                input.layers
            ),
            found: why,
        },
        other => EngineError::Infeasible(other.to_string()),
    })?;
    let solve_seconds = start.elapsed().as_secs_f64();
    let (priced, simulation) = compare::price(&problem, &plan.counts)?;
    let mut compared = Vec::new();
    if let Some(path) = &opts.manual {
        compared.extend(compare::manual_plans(path, &problem)?);
    }
    if opts.naive {
        compared.extend(compare::naive_plans(&input, &problem)?);
    }
    // Interleaving shortens the ideal bubble but not always the step: compare with the best
    // plan of one chunk per stage under the same cap.
    let non_interleaved = if opts.interleave > 1 {
        let flat = BalanceProblem {
            interleave: 1,
            ..problem.clone()
        };
        match balance(&flat, None) {
            Ok(p1) => {
                let (q, _) = compare::price(&flat, &p1.counts)?;
                (q.bubble.real < priced.bubble.real)
                    .then(|| (sapp_lists(&p1.counts, input.layers), q))
            }
            Err(_) => None,
        }
    } else {
        None
    };
    Ok(BalanceReport {
        terms,
        lists: sapp_lists(&plan.counts, input.layers),
        bubble: priced.bubble,
        problem,
        plan,
        simulation,
        peak_memory: priced.peak_memory,
        stage_time: priced.stage_time,
        solve_seconds,
        compared,
        non_interleaved,
    })
}
