//! Progress: a bar on a terminal; for builds one plain line per target otherwise (CI logs).

use crate::output::errln;
use autopar_engine::build::{Progress, TargetResult};
use autopar_engine::cache::Source;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;

/// A progress bar drawn with `template` on stderr when it is a terminal; `None` otherwise.
pub fn bar(template: &str) -> Option<ProgressBar> {
    std::io::stderr().is_terminal().then(|| {
        let bar = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr());
        let style =
            ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar());
        bar.set_style(style);
        bar.enable_steady_tick(std::time::Duration::from_millis(100));
        bar
    })
}

/// Reports build progress on stderr.
pub struct Reporter {
    bar: Option<ProgressBar>,
}

impl Reporter {
    /// A bar when stderr is a terminal and `quiet` is false; plain lines otherwise.
    pub fn new(quiet: bool) -> Self {
        let bar = if quiet {
            None
        } else {
            bar("{spinner} planning [{bar:30}] {pos}/{len} targets {msg}")
        };
        Reporter { bar }
    }

    /// Handles one progress event.
    pub fn event(&self, p: Progress<'_>) {
        match (p, &self.bar) {
            (Progress::Begin(n), Some(bar)) => bar.set_length(n as u64),
            (Progress::Begin(_), None) => {}
            (Progress::Done(o), Some(bar)) => {
                bar.set_message(o.name.clone());
                bar.inc(1);
            }
            (Progress::Done(o), None) => {
                let status = match &o.result {
                    TargetResult::Planned(_) => "planned",
                    TargetResult::Infeasible { .. } => "infeasible",
                };
                let how = match o.source {
                    Source::Solved => format!("{} layouts searched", o.layouts),
                    other => format!("cached in {}", other.name()),
                };
                errln!(
                    "{status} {} ({how}, {:.2} s)",
                    o.name,
                    o.elapsed.as_secs_f64()
                );
            }
        }
    }

    /// Removes the bar.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
