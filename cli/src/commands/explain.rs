//! `autopar explain TARGET`: for every result the last build of a target recomputed, which
//! component of its key changed.

use super::print_json;
use crate::Failure;
use crate::output::out;
use autopar_engine::cache::Source;
use autopar_engine::record::{BuildRecord, read_record};
use autopar_engine::session::Session;
use autopar_rules::solve::intra::chain::TableSolver;
use std::fmt::Write;

pub fn run(session: &Session, target: &str, json: bool) -> Result<(), Failure> {
    let ws = session.workspace()?;
    autopar_engine::build::select(&ws, &[target.to_string()])?;
    let Some(record) = read_record(&ws.root, target) else {
        return Err(Failure::Failed(anyhow::anyhow!(
            "target `{target}` has no recorded build: run `autopar build {target}` first"
        )));
    };
    if json {
        return print_json(&record);
    }
    out!("{}", text(target, &record));
    Ok(())
}

/// What the last build of `target` (its `record`) recomputed and why, as `explain` prints it.
pub(crate) fn text(target: &str, record: &BuildRecord) -> String {
    let mut s = String::new();
    let solved: Vec<_> = record
        .layers
        .iter()
        .filter(|l| l.source == Source::Solved)
        .collect();
    let when = autopar_engine::record::utc(record.time_ms);
    let _ = writeln!(
        s,
        "{target}: last built {when}; plan {}, {} of {} distinct layer costs solved",
        match (record.plan.source, record.plan.reused_after_change) {
            (_, true) => "reused after its inputs changed".to_string(),
            (Source::Solved, _) => "searched".to_string(),
            (other, _) => format!("cached ({})", other.name()),
        },
        solved.len(),
        record.layers.len()
    );
    if !record.plan.reasons.is_empty() {
        let _ = writeln!(s, "  plan");
        for r in &record.plan.reasons {
            let _ = writeln!(s, "    {r}");
        }
        if record.plan.reused_after_change {
            let _ = writeln!(
                s,
                "    every layer cost the search reads came out the same: search result reused"
            );
        }
    }
    for l in solved {
        let _ = writeln!(s, "  layer cost {}", l.slot);
        for r in &l.reasons {
            let _ = writeln!(s, "    {r}");
        }
    }
    drec_tables(&mut s, record);
    for st in &record.ilp {
        let solved: Vec<_> = st
            .tables
            .iter()
            .filter(|t| t.source == Source::Solved)
            .collect();
        if st.source != Source::Solved {
            continue;
        }
        let counted = format!(
            "{} of {} layer tables solved",
            solved.len(),
            st.tables.len()
        );
        let tables = match st.past_work_bound {
            Some(Source::Solved) => format!(
                "{counted} before they passed the work bound (this size is left out, and the \
                 verdict is stored)"
            ),
            Some(found) => format!(
                "stopped at once by the stored verdict ({}) that its layer tables pass the \
                 work bound; none read",
                found.name()
            ),
            None => counted,
        };
        let _ = writeln!(
            s,
            "  ILP space, micro-batch {}: stage DP re-ran; {tables}",
            st.micro_batch
        );
        for r in &st.reasons {
            let _ = writeln!(s, "    {r}");
        }
        let tables = solved
            .iter()
            .map(|t| (t.slot.as_str(), t.reasons.as_slice()));
        for (why, slots) in tables_by_reason(tables) {
            let _ = writeln!(s, "    {} table(s): {why}", slots.len());
            let _ = writeln!(s, "      {}", slots.join(", "));
        }
    }
    let ilp_recomputed = record.ilp.iter().any(|st| st.source == Source::Solved);
    if record.plan.reasons.is_empty()
        && record.layers.iter().all(|l| l.source != Source::Solved)
        && !ilp_recomputed
    {
        let _ = writeln!(s, "  nothing was recomputed");
    }
    s
}

/// Layer tables named in the line on D-Rec's (`--json` has them all).
const DREC_TABLES_NAMED: usize = 6;

/// Which solver filled the layer tables the ILP space's stage DPs read: D-Rec's are not
/// proven optimal. One line for every size, the tables named once.
fn drec_tables(s: &mut String, record: &BuildRecord) {
    let tables = record.ilp.iter().flat_map(|st| &st.tables);
    let total = tables.clone().count();
    let mut drec: Vec<&str> = tables
        .filter(|t| t.solver == Some(TableSolver::Drec))
        .map(|t| t.slot.as_str())
        .collect();
    let count = drec.len();
    if count == 0 {
        return;
    }
    if count == total {
        let _ = writeln!(
            s,
            "  ILP space: every layer table ({total}) filled by D-Rec (heuristic, not proven \
             optimal)"
        );
        return;
    }
    drec.sort_unstable();
    drec.dedup();
    let more = drec.len().saturating_sub(DREC_TABLES_NAMED);
    drec.truncate(DREC_TABLES_NAMED);
    let _ = writeln!(
        s,
        "  ILP space: {count} of {total} layer tables filled by D-Rec (heuristic, not proven \
         optimal; too large to eliminate), the rest exactly: {}{}",
        drec.join(", "),
        if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        }
    );
}

/// Reasons named per table in text (`--json` has them all).
const REASONS_NAMED: usize = 2;

/// Layer tables grouped by why they were (or would be) solved, in order of first appearance.
pub(crate) fn tables_by_reason<'a>(
    tables: impl Iterator<Item = (&'a str, &'a [String])>,
) -> Vec<(String, Vec<&'a str>)> {
    let mut groups: Vec<(String, Vec<&'a str>)> = Vec::new();
    for (slot, reasons) in tables {
        // A new profile changes dozens of entries per table: the first few stand for them.
        let why = match reasons.len() {
            n if n > REASONS_NAMED => format!(
                "{}; and {} more",
                reasons[..REASONS_NAMED].join("; "),
                n - REASONS_NAMED
            ),
            _ => reasons.join("; "),
        };
        match groups.iter_mut().find(|(w, _)| *w == why) {
            Some((_, slots)) => slots.push(slot),
            None => groups.push((why, vec![slot])),
        }
    }
    groups
}
