//! `autopar solve stages` and `autopar solve balance`: the planning passes on numbers users
//! bring (Alpa's profiled stage costs, SAPP's measured profiles).

use super::print_json;
use crate::Failure;
use crate::args::{BalanceArgs, PipelineArgs, ShardingArgs, ShardingSolverArg, TableSolverArg};
use crate::output::{errln, outln};
use autopar_engine::alpa::solve_stages;
use autopar_engine::cache::{Cache, RemoteFlags, UPLOAD_DEADLINE};
use autopar_engine::pipeline::{PipelineRequest, solve_pipeline};
use autopar_engine::plans::write_trace;
use autopar_engine::sapp::{BalanceOptions, ComparedPlan, solve_balance};
use autopar_engine::session::Session;
use autopar_engine::sharding::{ShardingRequest, parse_mesh, solve_sharding};
use autopar_rules::cost::cluster::GIB;
use autopar_rules::solve::balance::{KINDS, RecomputeKind, SappLists};
use autopar_rules::solve::intra::stage::SolverChoice;
use autopar_rules::solve::schedule::{Bubble, chrome_trace};
use serde_json::json;
use std::path::Path;

pub fn stages(input: &Path, json: bool) -> Result<(), Failure> {
    let r = solve_stages(input)?;
    let list: Vec<[usize; 4]> = r
        .plan
        .stages
        .iter()
        .map(|s| [s.start, s.end, s.submesh, s.config])
        .collect();
    if json {
        return print_json(&json!({ "cost": r.plan.cost, "stages": list }));
    }
    outln!(
        "cost {:.6} (sum of stage costs + (B - 1) x max), {} stages, {} t_max bounds evaluated",
        r.plan.cost,
        r.plan.stages.len(),
        r.plan.bounds_evaluated
    );
    outln!(
        "{:>5} {:>12} {:>10} {:>7} {:>12} {:>16}",
        "stage",
        "layers",
        "submesh",
        "config",
        "cost",
        "devices"
    );
    for (q, s) in r.plan.stages.iter().enumerate() {
        let (n, m) = r.submeshes[s.submesh];
        let devices = r.placement.as_ref().map_or(String::new(), |p| {
            let (first, count) = p[q];
            format!("{first}..{}", first + count - 1)
        });
        outln!(
            "{:>5} {:>12} {:>10} {:>7} {:>12.6} {:>16}",
            q,
            format!("{}..={}", s.start, s.end),
            format!("{n}x{m} (#{})", s.submesh),
            s.config,
            s.cost,
            devices
        );
    }
    Ok(())
}

pub fn balance(a: &BalanceArgs) -> Result<(), Failure> {
    if !(a.memory_mb.is_finite() && a.memory_mb > 0.0) {
        return Err(Failure::Input(anyhow::anyhow!(
            "-mem: expected a positive memory cap in MB, found {}",
            a.memory_mb
        )));
    }
    let opts = BalanceOptions {
        stages: a.stages as usize,
        microbatches: a.microbatches as usize,
        interleave: a.interleave as usize,
        memory_mb: a.memory_mb,
        time_limit: a.time_limit.max(0.01),
        manual: a.manual.clone(),
        naive: a.naive,
    };
    let r = solve_balance(&a.sapp, &opts)?;
    if let Some(path) = &a.trace {
        let trace = chrome_trace(&r.simulation, "autopar solve balance");
        write_trace(path, &trace)?;
    }
    let b = &r.bubble;
    if a.json {
        return print_json(&json!({
            "offset": r.lists.offset,
            "recompute": r.lists.recompute,
            "select_recompute": r.lists.select_recompute,
            "select_comm_recompute": r.lists.select_comm_recompute,
            "real": b.real,
            "ideal": b.ideal,
            "imbalance": b.imbalance,
            "recompute_ratio": b.recompute,
            "total_time": r.simulation.makespan,
            "peak_memory_mb": r.peak_memory,
            "objective": r.plan.objective,
            "status": r.plan.status,
            "lower_bound": r.plan.lower_bound,
            "memory_terms": r.terms,
            "solve_seconds": r.solve_seconds,
            "compared": r.compared.iter().map(compared_json).collect::<Vec<_>>(),
            "non_interleaved": r.non_interleaved.as_ref().map(|(lists, q)| json!({
                "offset": lists.offset,
                "recompute": lists.recompute,
                "select_recompute": lists.select_recompute,
                "select_comm_recompute": lists.select_comm_recompute,
                "real": q.bubble.real,
                "ideal": q.bubble.ideal,
                "imbalance": q.bubble.imbalance,
                "recompute_ratio": q.bubble.recompute,
                "total_time": q.total_time,
                "peak_memory_mb": q.peak_memory,
            })),
        }));
    }
    let t = &r.terms;
    let acts: Vec<String> = RecomputeKind::ALL
        .iter()
        .filter_map(|k| t.activation[k.index()].map(|x| format!("{} {x:.2}", k.name())))
        .collect();
    outln!(
        "memory terms (MB): const {:.2} · per layer {:.2} · activations {} · head {:.2} · tail {:.2}",
        t.constant,
        t.parameter,
        acts.join(", "),
        t.head,
        t.tail
    );
    outln!(
        "balanced {} layers over {} stages x {} chunks, {} micro-batches, cap {} MB: {} in {:.2} s",
        r.problem.layers,
        a.stages,
        a.interleave,
        a.microbatches,
        a.memory_mb,
        match (r.plan.status, r.plan.lower_bound) {
            (autopar_rules::solve::balance::SolveStatus::Optimal, _) => "optimal".to_string(),
            (autopar_rules::solve::balance::SolveStatus::TimeLimit, Some(bound)) if bound > 0.0 =>
                format!(
                    "time limit reached (best found, at most {:.1}% above the LP relaxation's \
                     lower bound)",
                    (r.plan.objective / bound - 1.0) * 100.0
                ),
            (autopar_rules::solve::balance::SolveStatus::TimeLimit, _) =>
                "time limit reached (best found, not proven optimal)".to_string(),
        },
        r.solve_seconds
    );
    outln!("To put in yaml configuration:");
    print_lists(&r.lists);
    outln!(
        "{:>5} {:>6} {}  {:>10} {:>10}",
        "stage",
        "layers",
        RecomputeKind::ALL
            .map(|k| format!(" {:>6}", &k.name()[..k.name().len().min(6)]))
            .join(""),
        "time/mb",
        "peak MB"
    );
    for j in 0..a.stages as usize {
        let mut per_kind = [0u32; KINDS];
        for chunk in &r.plan.counts {
            for (k, n) in chunk[j].iter().enumerate() {
                per_kind[k] += n;
            }
        }
        outln!(
            "{:>5} {:>6} {}  {:>10.1} {:>10.0}",
            j,
            per_kind.iter().sum::<u32>(),
            per_kind.map(|n| format!(" {n:>6}")).join(""),
            r.stage_time[j],
            r.peak_memory[j]
        );
    }
    outln!("bubble    real    =  ideal   + imbalance + recompute");
    outln!(
        "        {:>7.4}  = {:>7.4}  + {:>7.4}   + {:>7.4}",
        b.real,
        b.ideal,
        b.imbalance,
        b.recompute
    );
    outln!(
        "total time {:.1} (time units of the yaml)",
        r.simulation.makespan
    );
    if let Some((lists, q)) = &r.non_interleaved {
        outln!(
            "note: one chunk per stage does better under the same cap: real bubble {:.4} \
             (ideal {:.4} + imbalance {:.4} + recompute {:.4}), total time {:.1}, against {:.4} \
             and {:.1} interleaved; its plan:",
            q.bubble.real,
            q.bubble.ideal,
            q.bubble.imbalance,
            q.bubble.recompute,
            q.total_time,
            b.real,
            r.simulation.makespan
        );
        print_lists(lists);
    }
    if !r.compared.is_empty() {
        outln!("compared under the same cap, simulated the same way:");
        outln!(
            "  {:<48} {:>3} {:>8} {:>8} {:>9} {:>9} {:>11} {:>9}",
            "plan",
            "v",
            "real",
            "ideal",
            "imbalance",
            "recompute",
            "total time",
            "peak MB"
        );
        let row = |name: &str, v: usize, q: &Bubble, total: f64, peak: f64| {
            outln!(
                "  {name:<48} {v:>3} {:>8.4} {:>8.4} {:>9.4} {:>9.4} {total:>11.1} {peak:>9.0}",
                q.real,
                q.ideal,
                q.imbalance,
                q.recompute
            );
        };
        let most = |l: &[f64]| l.iter().copied().fold(0.0, f64::max);
        row(
            "autopar (balanced)",
            a.interleave as usize,
            b,
            r.simulation.makespan,
            most(&r.peak_memory),
        );
        for c in &r.compared {
            match &c.priced {
                Some(q) => row(
                    &c.name,
                    c.interleave,
                    &q.bubble,
                    q.total_time,
                    most(&q.peak_memory),
                ),
                None => outln!(
                    "  {:<48} {:>3} {:>8}",
                    c.name,
                    c.interleave,
                    "not simulated"
                ),
            }
            if c.violations.is_empty() {
                continue;
            }
            outln!("    INVALID: {}", c.violations.join("; "));
        }
        for c in &r.compared {
            outln!("{}:", c.name);
            print_lists(&c.lists);
        }
    }
    if let Some(path) = &a.trace {
        outln!("trace {}", path.display());
    }
    Ok(())
}

/// A plan's lists in SAPP's yaml convention, ready to paste.
fn print_lists(lists: &SappLists) {
    outln!("        offset: {:?}", lists.offset);
    outln!("        recompute: {:?}", lists.recompute);
    outln!("        select_recompute: {:?}", lists.select_recompute);
    outln!(
        "        select_comm_recompute: {:?}",
        lists.select_comm_recompute
    );
}

/// A compared plan in `solve balance --json`.
fn compared_json(c: &ComparedPlan) -> serde_json::Value {
    let mut out = json!({
        "name": c.name,
        "interleave": c.interleave,
        "valid": c.violations.is_empty(),
        "violations": c.violations,
        "offset": c.lists.offset,
        "recompute": c.lists.recompute,
        "select_recompute": c.lists.select_recompute,
        "select_comm_recompute": c.lists.select_comm_recompute,
    });
    if let (Some(q), Some(map)) = (&c.priced, out.as_object_mut()) {
        for (k, v) in [
            ("real", json!(q.bubble.real)),
            ("ideal", json!(q.bubble.ideal)),
            ("imbalance", json!(q.bubble.imbalance)),
            ("recompute_ratio", json!(q.bubble.recompute)),
            ("total_time", json!(q.total_time)),
            ("peak_memory_mb", json!(q.peak_memory)),
            ("objective", json!(q.objective)),
        ] {
            map.insert(k.to_string(), v);
        }
    }
    out
}

pub fn sharding(session: &Session, a: &ShardingArgs) -> Result<(), Failure> {
    if !(a.time_limit.is_finite() && a.time_limit > 0.0) {
        return Err(Failure::Input(anyhow::anyhow!(
            "--time-limit: expected a positive number of seconds, found {}",
            a.time_limit
        )));
    }
    let req = ShardingRequest {
        model: a.model.clone(),
        cluster: Some(a.cluster.clone()),
        mesh: a.mesh.clone(),
        layers: a.layers.clone(),
        micro_batch: a.mbs,
        seq: a.model_options.seq,
        precision: a.model_options.precision(),
        attention: a.model_options.attention(),
        memory_gib: a.memory_gib,
        microbatches: a.microbatches,
        inflight: a.inflight,
        solver: match a.solver {
            ShardingSolverArg::Auto => SolverChoice::Auto,
            ShardingSolverArg::Exact => SolverChoice::Exact,
            ShardingSolverArg::Ilp => SolverChoice::Ilp,
            ShardingSolverArg::Drec => SolverChoice::Drec,
        },
        time_limit: a.time_limit,
        chain: a.chain,
    };
    let r = solve_sharding(session, &req)?;
    for w in &r.plan.solve.warnings {
        errln!("warning: {w}");
    }
    if a.json {
        let mut value = described(&r.plan, &r.model, &r.cluster.name, r.seq, a.mbs)?;
        if let Some(obj) = value.as_object_mut() {
            obj.insert("layer_names".into(), json!(r.layer_names));
            if let Some(chain) = &r.chain {
                let chain = match chain {
                    Ok(c) => serde_json::to_value(c).map_err(|e| Failure::Failed(e.into()))?,
                    Err(why) => json!({ "error": why }),
                };
                obj.insert("chain".into(), chain);
            }
        }
        return print_json(&value);
    }
    outln!("{}", crate::render::sharding(&r, a.mbs));
    Ok(())
}

/// `autopar solve pipeline`.
pub fn pipeline(
    session: &Session,
    a: &PipelineArgs,
    cache_dir: Option<&Path>,
    remote: &RemoteFlags,
) -> Result<(), Failure> {
    let req = PipelineRequest {
        model: a.model.clone(),
        cluster: a.cluster.clone(),
        micro_batch: a.mbs,
        global_batch: a.gbs,
        seq: a.model_options.seq,
        precision: a.model_options.precision(),
        attention: a.model_options.attention(),
        memory_gib: a.memory_gib,
        powers_of_two: a.powers_of_two,
        logical_meshes: a
            .logical_meshes
            .iter()
            .map(|m| parse_mesh(m, "--logical-meshes").map(|(x, y)| [x, y]))
            .collect::<Result<_, _>>()
            .map_err(Failure::from)?,
        recompute: !a.no_recompute,
        solver: match a.solver {
            TableSolverArg::Auto => SolverChoice::Auto,
            TableSolverArg::Exact => SolverChoice::Exact,
            TableSolverArg::Drec => SolverChoice::Drec,
        },
    };
    // The workspace's cache when there is a workspace; else `--cache-dir`, else memory only.
    let cache = match session.workspace() {
        Ok(ws) => super::build::open_cache(&ws, cache_dir, remote)?,
        Err(_) => cache_dir.map_or_else(Cache::in_memory, Cache::open),
    };
    let r = solve_pipeline(session, &cache, &req);
    cache.flush();
    cache.finish_uploads(UPLOAD_DEADLINE);
    let r = r?;
    if a.json {
        let mut value = described(&r.plan, &r.model, &r.cluster.name, r.seq, a.mbs)?;
        if let Some(obj) = value.as_object_mut() {
            obj.insert("microbatches".into(), json!(r.microbatches));
            obj.insert("memory_budget_gib".into(), json!(r.budget / GIB));
            obj.insert("seconds".into(), json!(r.seconds));
            obj.insert("cache".into(), json!(r.tables));
        }
        return print_json(&value);
    }
    outln!("{}", crate::render::pipeline(&r, a.mbs));
    Ok(())
}

/// `plan` as a JSON object with the model, cluster, sequence length and micro-batch size it
/// was solved for.
fn described(
    plan: &impl serde::Serialize,
    model: &str,
    cluster: &str,
    seq: u64,
    micro_batch: u64,
) -> Result<serde_json::Value, Failure> {
    let mut value = serde_json::to_value(plan).map_err(|e| Failure::Failed(e.into()))?;
    if let Some(obj) = value.as_object_mut() {
        obj.insert("model".into(), json!(model));
        obj.insert("cluster".into(), json!(cluster));
        obj.insert("seq".into(), json!(seq));
        obj.insert("micro_batch".into(), json!(micro_batch));
    }
    Ok(value)
}
