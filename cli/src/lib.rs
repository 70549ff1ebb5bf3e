//! The `autopar` command-line tool: argument parsing, output, progress, exit codes.
//!
//! Exit codes: 0 success; 1 a plan is infeasible or the command failed; 2 usage or input error
//! (the message names file, line, column, field, expected and found); 3 some targets planned and
//! some failed.

mod args;
mod commands;
mod logging;
mod output;
mod progress;
mod render;
mod report;

pub use args::Cli;

use autopar_engine::EngineError;
use clap::Parser;
use std::process::ExitCode;

/// How a command ended, beyond success.
#[derive(Debug)]
pub enum Failure {
    /// Bad usage or input (exit 2).
    Input(anyhow::Error),
    /// Infeasible or failed (exit 1).
    Failed(anyhow::Error),
    /// Some targets failed, others succeeded (exit 3); the failures were already reported.
    Partial,
}

impl From<EngineError> for Failure {
    fn from(e: EngineError) -> Self {
        if e.is_input_error() {
            Failure::Input(e.into())
        } else {
            Failure::Failed(e.into())
        }
    }
}

impl Failure {
    fn code(&self) -> u8 {
        match self {
            Failure::Input(_) => 2,
            Failure::Failed(_) => 1,
            Failure::Partial => 3,
        }
    }
}

/// Runs the command line `args` (including the program name); returns the exit code.
pub fn run<I, T>(args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    // SAPP users write -mb, -mem, -manual and -naive; clap's short flags are single letters.
    let args = args.into_iter().map(|a| {
        let a: std::ffi::OsString = a.into();
        match a.to_str() {
            Some("-mb") => "--mb".into(),
            Some("-mem") => "--mem".into(),
            Some("-manual") => "--manual".into(),
            Some("-naive") => "--naive".into(),
            _ => a,
        }
    });
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            // Help and version go to stdout with exit 0; usage errors to stderr with exit 2.
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
        }
    };
    logging::init(cli.verbose);
    match commands::dispatch(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            match &failure {
                Failure::Input(e) | Failure::Failed(e) => output::errln!("error: {e:#}"),
                Failure::Partial => {}
            }
            ExitCode::from(failure.code())
        }
    }
}

/// Entry point of the binary.
pub fn main() -> ExitCode {
    run(std::env::args_os())
}
