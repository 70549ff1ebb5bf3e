//! `autopar plan show TARGET`.

use super::print_json;
use crate::Failure;
use crate::output::out;
use crate::render;
use autopar_engine::build::stale;
use autopar_engine::plans::read_plan;
use autopar_engine::session::Session;

pub fn show(session: &Session, target: &str, json: bool) -> Result<(), Failure> {
    let ws = session.workspace()?;
    let path = ws.plan_path(target);
    let plan = read_plan(target, &path)?;
    // A stored plan is shown as it is, with a word when the workspace has moved on from it.
    if let Some(reasons) = ws.target(target).and_then(|t| stale(&ws, t)) {
        eprintln!(
            "warning: the plan of `{target}` is out of date ({}): `autopar build {target}` \
             replaces it",
            reasons.join("; ")
        );
    }
    if json {
        print_json(&plan)
    } else {
        let trace = ws.trace_path(target);
        let trace = trace.exists().then_some(trace.as_path());
        out!("{}", render::plan(&plan, Some(&path), trace));
        Ok(())
    }
}
