//! `autopar build [TARGET...] [--json]`.

use super::print_json;
use crate::Failure;
use crate::args::BuildArgs;
use crate::progress::Reporter;
use crate::render;
use autopar_engine::build::{TargetResult, build};
use autopar_engine::session::Session;
use serde_json::json;

pub fn run(session: &Session, args: &BuildArgs) -> Result<(), Failure> {
    let ws = session.workspace()?;
    let reporter = Reporter::new(args.json);
    let report = build(ws, &args.targets, &|p| reporter.event(p));
    reporter.finish();
    let report = report?;
    let planned = report.planned();
    let failed = report.outcomes.len() - planned;
    if args.json {
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
                        "step_time_s": e.step_time_s,
                        "tokens_per_s": e.tokens_per_s,
                        "tflops_per_gpu": e.tflops_per_gpu,
                        "mfu": e.mfu,
                        "memory_per_device_gib": e.memory_per_device_gib,
                        "fits": e.fits,
                        "layouts": o.layouts,
                        "elapsed_s": o.elapsed.as_secs_f64(),
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
        print_json(&json!({
            "targets": targets,
            "planned": planned,
            "infeasible": failed,
            "elapsed_s": report.elapsed.as_secs_f64(),
        }))?;
    } else {
        for o in &report.outcomes {
            match &o.result {
                TargetResult::Planned(p) => {
                    println!("{}", render::plan(&p.plan, Some(&p.path), Some(&p.trace)))
                }
                TargetResult::Infeasible { reason } => {
                    eprintln!("error: target {} is infeasible: {reason}", o.name)
                }
            }
        }
        let layouts: usize = report.outcomes.iter().map(|o| o.layouts).sum();
        println!(
            "built {} target{}: {planned} planned, {failed} infeasible; {layouts} layouts priced in {:.2} s",
            report.outcomes.len(),
            if report.outcomes.len() == 1 { "" } else { "s" },
            report.elapsed.as_secs_f64()
        );
    }
    match (planned, failed) {
        (_, 0) => Ok(()),
        (0, _) => Err(Failure::Failed(anyhow::anyhow!(
            "no target could be planned"
        ))),
        _ => Err(Failure::Partial),
    }
}
