//! One module per command.

mod build;
mod cache;
mod calibrate;
mod estimate;
mod explain;
mod export;
mod graph;
mod plan;
mod profile;
mod report;
mod run;
mod solve;
mod validate;
mod watch;
mod whatif;

use crate::Failure;
use crate::args::{
    CacheCommand, Cli, Command, PlanCommand, ProfileCommand, RemoteMode, SolveCommand,
};
use crate::output::{out, outln};
use autopar_engine::cache::{Mode, RemoteFlags};
use autopar_engine::session::Session;

/// Runs the parsed command.
pub fn dispatch(cli: &Cli) -> Result<(), Failure> {
    let mut session = Session::new(cli.workspace.clone()).with_plans_dir(cli.plans_dir.clone());
    let dir = cli.cache_dir.as_deref();
    let remote = RemoteFlags {
        url: cli.remote_cache.clone(),
        mode: cli.remote_cache_mode.map(|m| match m {
            RemoteMode::Rw => Mode::Rw,
            RemoteMode::Ro => Mode::Ro,
        }),
        token_file: cli.remote_token_file.clone(),
        timeout_ms: cli.remote_timeout_ms,
        connect_timeout_ms: cli.remote_connect_timeout_ms,
        instance: cli.remote_instance.clone(),
        ca_file: cli.remote_ca_file.clone(),
    };
    match &cli.command {
        Command::Build(a) => build::run(&session, a, dir, &remote),
        Command::Explain { target, json } => explain::run(&session, target, *json),
        Command::Cache { command } => match command {
            CacheCommand::Stats { json } => cache::stats(&session, dir, *json),
            CacheCommand::Verify { json } => cache::verify(&session, dir, *json),
            CacheCommand::Gc { max_size } => cache::gc(&session, dir, max_size),
            CacheCommand::Serve(a) => cache::serve(a),
        },
        Command::Clean { cache: all } => cache::clean(&session, dir, *all),
        Command::Profile { command } => match command {
            ProfileCommand::Diff { old, new, json } => {
                profile::diff(&session, dir, old, new, *json)
            }
            ProfileCommand::Template { target, output } => {
                profile::template(&session, target, output.as_deref())
            }
            ProfileCommand::Run(a) => profile::run(&session, a),
            ProfileCommand::Import {
                input,
                output,
                device,
            } => profile::import(input, output.as_deref(), device.as_deref()),
        },
        Command::Watch(a) => watch::run(&mut session, a, dir, &remote),
        Command::Estimate(a) => estimate::run(&session, a),
        Command::Run(a) => run::run(&session, a, dir),
        Command::Graph(a) => graph::run(&session, a),
        Command::Validate(a) => validate::run(&session, a),
        Command::Calibrate(a) => calibrate::run(&session, a),
        Command::Export(a) => export::run(&session, a, dir),
        Command::Whatif(a) => whatif::run(&session, a),
        Command::Report(a) => report::run(&session, a),
        Command::Completions { shell } => {
            // Into memory first: the generator panics on a write error (a closed pipe).
            let mut cmd = <Cli as clap::CommandFactory>::command();
            let name = cmd.get_name().to_string();
            let mut script = Vec::new();
            clap_complete::generate(*shell, &mut cmd, name, &mut script);
            out!("{}", String::from_utf8_lossy(&script));
            Ok(())
        }
        Command::Man => {
            let cmd = <Cli as clap::CommandFactory>::command();
            let mut page = Vec::new();
            clap_mangen::Man::new(cmd)
                .render(&mut page)
                .map_err(|e| Failure::Failed(e.into()))?;
            out!("{}", String::from_utf8_lossy(&page));
            Ok(())
        }
        Command::Plan {
            command: PlanCommand::Show { target, json },
        } => plan::show(&session, target, *json),
        Command::Plan {
            command: PlanCommand::Diff { a, b, json },
        } => plan::diff(a, b, *json),
        Command::Solve {
            command: SolveCommand::Stages { input, json },
        } => solve::stages(input, *json),
        Command::Solve {
            command: SolveCommand::Balance(a),
        } => solve::balance(a),
        Command::Solve {
            command: SolveCommand::Sharding(a),
        } => solve::sharding(&session, a),
        Command::Solve {
            command: SolveCommand::Pipeline(a),
        } => solve::pipeline(&session, a, dir, &remote),
    }
}

/// The plan of `target`, refused when the workspace has moved on from it, or the plan in `file`.
fn target_or_file_plan(
    ws: &autopar_engine::workspace::Workspace,
    target: Option<&str>,
    file: Option<&std::path::Path>,
) -> Result<autopar_rules::plan::format::Plan, Failure> {
    use autopar_engine::plans::read_plan;
    match (target, file) {
        (_, Some(file)) => {
            if !file.is_file() {
                return Err(Failure::Input(anyhow::anyhow!(
                    "--plan: expected a plan file, found nothing at {}",
                    file.display()
                )));
            }
            Ok(read_plan(&file.display().to_string(), file)?)
        }
        (Some(t), None) => {
            let Some(built) = ws.target(t) else {
                return Err(Failure::Input(anyhow::anyhow!(
                    "target `{t}` is not known: expected one of {}",
                    ws.targets
                        .iter()
                        .map(|t| t.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
            };
            let plan = read_plan(t, &ws.plan_path(t))?;
            // A plan of other inputs would be used as if it were this workspace's.
            if let Some(reasons) = autopar_engine::build::stale(ws, built) {
                return Err(Failure::Failed(anyhow::anyhow!(
                    "the plan of `{t}` is out of date ({}): run `autopar build {t}` first",
                    reasons.join("; ")
                )));
            }
            Ok(plan)
        }
        (None, None) => Err(Failure::Input(anyhow::anyhow!(
            "expected a target or --plan FILE, found neither"
        ))),
    }
}

/// Prints `value` as pretty JSON on stdout.
fn print_json(value: &impl serde::Serialize) -> Result<(), Failure> {
    let text = serde_json::to_string_pretty(value).map_err(|e| Failure::Failed(e.into()))?;
    outln!("{text}");
    Ok(())
}
