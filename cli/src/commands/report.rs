//! `autopar report TARGET [-o FILE]`: a target's plan as one self-contained HTML page.

use crate::Failure;
use crate::args::ReportArgs;
use crate::output::errln;
use autopar_engine::plans::write_text;
use autopar_engine::record::read_record;
use autopar_engine::session::Session;
use autopar_engine::workspace::Workspace;
use autopar_rules::plan::format::Plan;
use std::path::Path;

pub fn run(session: &Session, a: &ReportArgs) -> Result<(), Failure> {
    let ws = session.workspace()?;
    let plan = super::target_or_file_plan(&ws, Some(&a.target), None)?;
    let path = a
        .output
        .clone()
        .unwrap_or_else(|| ws.report_path(&a.target));
    write(&ws, &plan, &path)?;
    errln!("wrote {} (report of `{}`)", path.display(), plan.target);
    Ok(())
}

/// Writes the report of `plan` (a target of `ws`) to `path`, with what its last build
/// recomputed.
pub fn write(ws: &Workspace, plan: &Plan, path: &Path) -> Result<(), Failure> {
    let explain = read_record(&ws.root, &plan.target)
        .map(|record| super::explain::text(&plan.target, &record));
    let page = crate::report::html(plan, explain.as_deref());
    write_text(path, &page)?;
    Ok(())
}
