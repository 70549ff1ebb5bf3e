//! `autopar build [TARGET...] [--json]`.

use super::print_json;
use crate::Failure;
use crate::args::BuildArgs;
use crate::output::{errln, outln};
use crate::progress::Reporter;
use crate::render;
use autopar_engine::build::{TargetResult, build, dry_run};
use autopar_engine::cache::{self, Cache, RemoteFlags};
use autopar_engine::session::Session;
use autopar_engine::workspace::Workspace;
use serde_json::json;
use std::path::Path;

pub fn run(
    session: &Session,
    args: &BuildArgs,
    cache_dir: Option<&Path>,
    remote: &RemoteFlags,
) -> Result<(), Failure> {
    let ws = session.workspace()?;
    if args.dry_run {
        // What is known locally; the remote is not asked.
        let cache = Cache::open(&cache::cache_dir(cache_dir, &ws));
        return dry(&ws, args, &cache);
    }
    let cache = open_cache(&ws, cache_dir, remote)?;
    run_with(&ws, &args.targets, args.json, args.report, &cache)
}

/// The cache a build of `ws` uses: the local store, and the remote when one is configured.
pub fn open_cache(
    ws: &Workspace,
    cache_dir: Option<&Path>,
    remote: &RemoteFlags,
) -> Result<Cache, Failure> {
    let cache = Cache::open(&cache::cache_dir(cache_dir, ws));
    Ok(match cache::remote_config(remote, ws)? {
        Some(cfg) => cache.with_remote(cfg),
        None => cache,
    })
}

/// One build of `targets` through `cache`, reported as `build` does (with each planned
/// target's HTML page when `pages`).
pub fn run_with(
    ws: &Workspace,
    targets: &[String],
    json_out: bool,
    pages: bool,
    cache: &Cache,
) -> Result<(), Failure> {
    let reporter = Reporter::new(json_out);
    let report = build(ws, targets, cache, &|p| reporter.event(p));
    reporter.finish();
    // The plans are written; what the summary counts includes the uploads dropped at exit.
    cache.finish_uploads(cache::UPLOAD_DEADLINE);
    let report = report?;
    let mut written = Vec::new();
    if pages {
        for o in &report.outcomes {
            if let TargetResult::Planned(p) = &o.result {
                let path = ws.report_path(&o.name);
                super::report::write(ws, &p.plan, &path)?;
                written.push(path);
            }
        }
    }
    let c = report.counts;
    let planned = report.planned();
    let failed = report.outcomes.len() - planned;
    if json_out {
        let targets: Vec<_> = report
            .outcomes
            .iter()
            .map(|o| match &o.result {
                TargetResult::Planned(p) => {
                    let e = &p.plan.estimate;
                    json!({
                        "name": o.name,
                        "status": "planned",
                        "plan": p.path,
                        "trace": p.trace,
                        "partition": e.partition,
                        "bubble": e.bubble,
                        "layout": e.layout,
                        "step_time_s": p.plan.step_time_s(),
                        "space": p.plan.space,
                        "spaces": p.plan.spaces,
                        "megatron_expressible": p.plan.megatron_expressible,
                        "tokens_per_s": p.plan.tokens_per_s(),
                        "tflops_per_gpu": e.tflops_per_gpu,
                        "mfu": p.plan.mfu(),
                        "memory_per_device_gib": p.plan.memory_per_device_gib(),
                        "fits": p.plan.fits(),
                        "layouts": o.layouts,
                        "source": o.source,
                        "elapsed_s": o.elapsed.as_secs_f64(),
                        "report": pages.then(|| ws.report_path(&o.name)),
                    })
                }
                TargetResult::Infeasible { reason } => json!({
                    "name": o.name,
                    "status": "infeasible",
                    "reason": reason,
                    "layouts": o.layouts,
                    "elapsed_s": o.elapsed.as_secs_f64(),
                }),
            })
            .collect();
        let kinds: serde_json::Map<String, serde_json::Value> = report
            .kinds
            .iter()
            .map(|(k, c)| {
                (
                    k.to_string(),
                    json!({
                        "total": c.total,
                        "hits_memory": c.memory,
                        "hits_local": c.local,
                        "hits_remote": c.remote,
                        "solved": c.solved,
                    }),
                )
            })
            .collect();
        print_json(&json!({
            "targets": targets,
            "kinds": kinds,
            "planned": planned,
            "infeasible": failed,
            "solves_total": c.total,
            "hits_memory": c.memory,
            "hits_local": c.local,
            "hits_remote": c.remote,
            "solved": c.solved,
            "remote": cache.remote_stats(),
            "elapsed_s": report.elapsed.as_secs_f64(),
            "peak_rss_bytes": autopar_engine::build::peak_rss(),
        }))?;
    } else {
        for o in &report.outcomes {
            match &o.result {
                TargetResult::Planned(p) => {
                    outln!("{}", render::plan(&p.plan, Some(&p.path), Some(&p.trace)))
                }
                TargetResult::Infeasible { reason } => {
                    errln!("error: target {} is infeasible: {reason}", o.name)
                }
            }
        }
        for path in &written {
            outln!("report    {}", path.display());
        }
        outln!(
            "built {} target{}: {planned} planned, {failed} infeasible",
            report.outcomes.len(),
            if report.outcomes.len() == 1 { "" } else { "s" },
        );
        // With a remote, its misses and errors are counted on the same line, and the uploads
        // it did not get.
        let remote = match cache.remote_stats() {
            Some(r) => {
                let mut counts = format!("{} misses, {} errors", r.misses, r.errors);
                if r.rejected > 0 {
                    counts += &format!(", {} rejected", r.rejected);
                }
                if r.uploads_dropped > 0 {
                    counts += &format!(", {} uploads dropped", r.uploads_dropped);
                }
                // Only a wait that a user would notice.
                if r.waited_ms >= 100 {
                    counts += &format!(", waited {:.1} s", r.waited_ms as f64 / 1e3);
                }
                format!("{} remote hits ({counts})", c.remote)
            }
            None => format!("{} remote hits", c.remote),
        };
        outln!(
            "solves: {} total, {} memory hits, {} local hits, {remote}, {} solved in {:.2} s{}",
            c.total,
            c.memory,
            c.local,
            c.solved,
            report.elapsed.as_secs_f64(),
            autopar_engine::build::peak_rss().map_or(String::new(), |b| format!(
                ", peak memory {}",
                render::bytes(b as f64)
            ))
        );
        for (k, c) in &report.kinds {
            outln!(
                "  {k:<11} {:>6} total, {} memory hits, {} local hits, {} remote hits, {} solved",
                c.total,
                c.memory,
                c.local,
                c.remote,
                c.solved
            );
        }
    }
    match (planned, failed) {
        (_, 0) => Ok(()),
        (0, _) => Err(Failure::Failed(anyhow::anyhow!(
            "no target could be planned"
        ))),
        _ => Err(Failure::Partial),
    }
}

/// `build --dry-run`: what would be solved, per target.
fn dry(ws: &Workspace, args: &BuildArgs, cache: &Cache) -> Result<(), Failure> {
    let runs = dry_run(ws, &args.targets, cache)?;
    if args.json {
        let targets: Vec<_> = runs
            .iter()
            .map(|r| {
                let ilp: Vec<_> = r
                    .ilp
                    .iter()
                    .map(|s| {
                        json!({
                            "micro_batch": s.micro_batch,
                            "stages_cached": s.cached,
                            "reasons": s.reasons,
                            "past_work_bound": s.past_work_bound,
                            "tables_cached": s.tables_cached,
                            "tables_to_solve": s.tables_to_solve.len(),
                            "tables": s.tables_to_solve.iter().map(|(slot, why)| {
                                json!({ "slot": slot, "reasons": why })
                            }).collect::<Vec<_>>(),
                        })
                    })
                    .collect();
                json!({
                    "name": r.name,
                    "plan_cached": r.plan_cached,
                    "search_cached": r.search_cached,
                    "layer_costs_cached": r.layers_cached,
                    "layer_costs_to_solve": r.layers_to_solve,
                    "reasons": if r.plan_cached { Vec::new() } else { r.reasons.clone() },
                    "ilp": ilp,
                    "ilp_not_searched": r.ilp_not_searched,
                    "ilp_decode_cached": r.ilp_decode_cached,
                })
            })
            .collect();
        return print_json(&json!({ "targets": targets }));
    }
    for r in &runs {
        let ilp_cached = r.ilp.iter().all(|s| s.cached)
            && r.ilp_not_searched.is_none()
            && r.ilp_decode_cached != Some(false);
        if r.plan_cached && ilp_cached {
            outln!("{}: cached, nothing to solve", r.name);
            continue;
        }
        if r.plan_cached {
            outln!("{}: Megatron-LM layouts cached", r.name);
        } else {
            let search = if r.search_cached {
                "search result reused".to_string()
            } else {
                "search would run".to_string()
            };
            outln!(
                "{}: {search}; layer costs: {} to solve, {} cached",
                r.name,
                r.layers_to_solve,
                r.layers_cached
            );
            for reason in &r.reasons {
                outln!("  because {reason}");
            }
        }
        for s in &r.ilp {
            dry_stages(s);
        }
        if let Some(why) = &r.ilp_not_searched {
            outln!("  ILP space: {why}");
        }
        if r.ilp_decode_cached == Some(false) {
            outln!("  ILP space: the fastest size's stages would be decoded");
        }
    }
    Ok(())
}

/// Tables named one by one at most; the rest are counted.
const TABLES_NAMED: usize = 8;

/// One micro-batch size of a target's ILP space in `build --dry-run`'s text.
fn dry_stages(s: &autopar_engine::build::StagesDryRun) {
    if s.cached {
        outln!(
            "  ILP space, micro-batch {}: stage DP cached",
            s.micro_batch
        );
        return;
    }
    if s.past_work_bound {
        // No table is asked for: the list below is empty.
        outln!(
            "  ILP space, micro-batch {}: stage DP would run and stop at once: its layer tables \
             are known to need more work than a search may spend; none would be read or solved",
            s.micro_batch
        );
    } else {
        outln!(
            "  ILP space, micro-batch {}: stage DP would run; layer tables (ILP solves): {} to \
             solve, {} cached",
            s.micro_batch,
            s.tables_to_solve.len(),
            s.tables_cached
        );
    }
    for reason in &s.reasons {
        outln!("    because {reason}");
    }
    let tables = s
        .tables_to_solve
        .iter()
        .map(|(slot, why)| (slot.as_str(), why.as_slice()));
    for (why, slots) in super::explain::tables_by_reason(tables) {
        outln!("    {} table(s): {why}", slots.len());
        let more = slots.len().saturating_sub(TABLES_NAMED);
        let named = slots[..slots.len() - more].join(", ");
        if more > 0 {
            outln!("      {named} and {more} more (`--json` lists them all)");
        } else {
            outln!("      {named}");
        }
    }
}
