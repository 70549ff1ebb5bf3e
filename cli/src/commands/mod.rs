//! One module per command.

mod build;
mod estimate;
mod graph;
mod plan;
mod solve;

use crate::Failure;
use crate::args::{Cli, Command, PlanCommand, SolveCommand};
use autopar_engine::session::Session;

/// Runs the parsed command.
pub fn dispatch(cli: &Cli) -> Result<(), Failure> {
    let session = Session::new(cli.workspace.clone());
    match &cli.command {
        Command::Build(a) => build::run(&session, a),
        Command::Estimate(a) => estimate::run(&session, a),
        Command::Graph(a) => graph::run(&session, a),
        Command::Plan {
            command: PlanCommand::Show { target, json },
        } => plan::show(&session, target, *json),
        Command::Solve {
            command: SolveCommand::Stages { input, json },
        } => solve::stages(input, *json),
        Command::Solve {
            command: SolveCommand::Balance(a),
        } => solve::balance(a),
    }
}

/// Prints `value` as pretty JSON on stdout.
fn print_json(value: &impl serde::Serialize) -> Result<(), Failure> {
    let text = serde_json::to_string_pretty(value).map_err(|e| Failure::Failed(e.into()))?;
    println!("{text}");
    Ok(())
}
