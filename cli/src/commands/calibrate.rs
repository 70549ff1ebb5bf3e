//! `autopar calibrate RUNS -o FILE`: device numbers fitted to measured runs.

use super::print_json;
use crate::Failure;
use crate::args::CalibrateArgs;
use crate::output::outln;
use autopar_engine::calibrate::{calibrate, file_text};
use autopar_engine::plans::write_text;
use autopar_engine::runs;
use autopar_engine::session::Session;
use serde_json::json;

pub fn run(session: &Session, a: &CalibrateArgs) -> Result<(), Failure> {
    let measured = runs::load(&a.runs)?;
    let c = calibrate(session, &a.runs, &measured, a.device.as_deref())?;
    write_text(&a.output, &file_text(&c, &a.runs))?;
    if a.json {
        return print_json(&json!({
            "calibration": c,
            "written": a.output,
        }));
    }
    let pct = |e: Option<f64>| e.map_or("n/a".to_string(), |e| format!("{:.1}%", e * 100.0));
    outln!(
        "calibrated {} on {} runs of {}{}",
        c.device,
        c.runs.len(),
        a.runs.display(),
        if c.skipped > 0 {
            format!(" ({} left out: out of memory or another device)", c.skipped)
        } else {
            String::new()
        }
    );
    outln!(
        "  {:<22} {:>9} {:>9}  {:<15} note",
        "number",
        "preset",
        "fitted",
        "range"
    );
    for k in &c.knobs {
        let note = if !k.fitted_by_runs {
            "not determined by these runs (kept)".to_string()
        } else if (k.fitted - k.lower).abs() < 1e-6 || (k.fitted - k.upper).abs() < 1e-6 {
            format!("at the bound: {}", k.source)
        } else {
            String::new()
        };
        outln!(
            "  {:<22} {:>9.4} {:>9.4}  [{:<5}, {:<5}]  {note}",
            k.key,
            k.preset,
            k.fitted,
            k.lower,
            k.upper
        );
    }
    outln!(
        "  {:>5} {:<28} {:<16} {:>10} {:>17} {:>17} {:>17}",
        "line",
        "model",
        "cluster",
        "measured",
        "preset",
        "fitted",
        "held out"
    );
    let cell = |p: f64, m: f64| format!("{p:.3} ({:+.1}%)", (p / m - 1.0) * 100.0);
    for r in &c.runs {
        outln!(
            "  {:>5} {:<28} {:<16} {:>10.3} {:>17} {:>17} {:>17}",
            r.line,
            r.model,
            r.cluster,
            r.measured_s,
            cell(r.preset_s, r.measured_s),
            cell(r.fitted_s, r.measured_s),
            cell(r.held_out_s, r.measured_s)
        );
    }
    outln!(
        "mean |time error|: {} with the preset, {} fitted, {} held out ({})",
        pct(c.preset_error),
        pct(c.fitted_error),
        pct(c.held_out_error),
        c.cross_validation
    );
    outln!(
        "wrote {} (attach it to a cluster: calibration = \"{}\")",
        a.output.display(),
        a.output.display()
    );
    Ok(())
}
