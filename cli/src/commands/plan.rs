//! `autopar plan show TARGET` and `autopar plan diff A.json B.json`.

use super::print_json;
use crate::Failure;
use crate::output::{errln, out};
use crate::render;
use autopar_engine::build::stale;
use autopar_engine::plans::read_plan;
use autopar_engine::session::Session;

/// Two plan files side by side.
pub fn diff(a: &std::path::Path, b: &std::path::Path, json: bool) -> Result<(), Failure> {
    let read = |p: &std::path::Path| -> Result<_, Failure> {
        if !p.is_file() {
            return Err(Failure::Input(anyhow::anyhow!(
                "expected a plan file, found nothing at {}",
                p.display()
            )));
        }
        Ok(read_plan(&p.display().to_string(), p)?)
    };
    let (pa, pb) = (read(a)?, read(b)?);
    let d = autopar_engine::whatif::diff(&pa, &pb);
    if json {
        return print_json(&d);
    }
    let mut s = format!(
        "plan diff {} ({}) -> {} ({})\n",
        a.display(),
        pa.target,
        b.display(),
        pb.target
    );
    if d.inputs.is_empty() {
        s.push_str("  inputs    the same target, model, cluster, batch and training options\n");
    }
    for i in &d.inputs {
        s.push_str(&format!("  input     {i}\n"));
    }
    s.push_str(&format!(
        "  step      {:.3} s ({:?}) -> {:.3} s ({:?})\n  plans     {} -> {}\n",
        d.step_time_s[0],
        d.space[0],
        d.step_time_s[1],
        d.space[1],
        d.plans[0].describe,
        d.plans[1].describe
    ));
    render::comparison(&mut s, ("A", &d.plans[0]), ("B", &d.plans[1]));
    s.push_str(&format!("  => {}\n", d.reason));
    out!("{s}");
    Ok(())
}

pub fn show(session: &Session, target: &str, json: bool) -> Result<(), Failure> {
    let ws = session.workspace()?;
    let path = ws.plan_path(target);
    let plan = read_plan(target, &path)?;
    // A stored plan is shown as it is, with a word when the workspace has moved on from it.
    if let Some(reasons) = ws.target(target).and_then(|t| stale(&ws, t)) {
        errln!(
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
