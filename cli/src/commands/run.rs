//! `autopar run TARGET|--plan FILE`: execute a plan and compare with its prediction.

use super::print_json;
use crate::Failure;
use crate::args::RunArgs;
use crate::output::out;
use crate::render;
use autopar_engine::cache::{Cache, cache_dir};
use autopar_engine::executor::Backend;
use autopar_engine::executor::RunOptions;
use autopar_engine::run::{RunOutcome, run_plan};
use autopar_engine::session::Session;
use std::path::Path;

pub fn run(session: &Session, a: &RunArgs, dir: Option<&Path>) -> Result<(), Failure> {
    let ws = session.workspace()?;
    // Running a plan of other inputs would measure one thing against the prediction for
    // another: a stale target plan is refused.
    let plan = super::target_or_file_plan(&ws, a.target.as_deref(), a.plan.as_deref())?;
    let backend = Backend::from(a.backend);
    let cache = Cache::open(&cache_dir(dir, &ws));
    let opts = RunOptions {
        steps: a.steps as usize,
        seed: a.seed,
        check: a.check,
    };
    tracing::info!(target = %plan.target, backend = backend.name(), "running");
    let outcome = run_plan(&ws, &cache, &plan, backend, &opts, a.python.as_deref())?;
    cache.flush();
    if a.json {
        print_json(&outcome)?;
    } else {
        out!("{}", render::run(&outcome));
    }
    failed_check(&outcome)
}

/// A check that found a difference fails the command.
fn failed_check(o: &RunOutcome) -> Result<(), Failure> {
    let cpu = o.jax.as_ref().and_then(|j| j.cpu_check.as_ref());
    let checks = [
        (o.check.as_ref(), "the single-device run"),
        (cpu, "autopar's CPU executor"),
    ];
    match checks
        .into_iter()
        .find(|(c, _)| c.is_some_and(|c| !c.passed))
    {
        Some((Some(c), against)) => Err(Failure::Failed(anyhow::anyhow!(
            "the sharded run differs from {against} by more than {:.0e} (loss {:.1e}, gradient \
             {:.1e} at `{}`, weights {:.1e})",
            c.tolerance,
            c.loss_rel,
            c.grad_rel,
            c.worst_grad,
            c.param_rel
        ))),
        _ => Ok(()),
    }
}
