//! `autopar export TARGET|--plan FILE --format F [-o FILE]`: a plan as a framework's launch
//! configuration.

use crate::Failure;
use crate::args::ExportArgs;
use crate::output::{errln, out};
use autopar_engine::cache::{Cache, cache_dir};
use autopar_engine::export::{ExportOptions, export};
use autopar_engine::run::jax_program;
use autopar_engine::session::Session;
use std::path::Path;

pub fn run(session: &Session, a: &ExportArgs, dir: Option<&Path>) -> Result<(), Failure> {
    let ws = session.workspace()?;
    let plan = super::target_or_file_plan(&ws, a.target.as_deref(), a.plan.as_deref())?;
    let model = ws.plan_model(&plan)?;
    let Some(framework) = a.format.framework() else {
        // A JAX program: the plan's lowered program, written as Python.
        let cache = Cache::open(&cache_dir(dir, &ws));
        let program = jax_program(&ws, &cache, &plan)?;
        cache.flush();
        return write(a, &program.text, "JAX program", &plan.target);
    };
    let opts = ExportOptions {
        framework,
        megatron_layout: a.megatron_layout,
        deepspeed_config: a.deepspeed_config.clone(),
    };
    let text = export(&plan, &model.def, &opts)?;
    let what = format!("{} launch configuration", opts.framework.name());
    write(a, &text, &what, &plan.target)
}

/// Writes an export to `-o FILE`, or prints it.
fn write(a: &ExportArgs, text: &str, what: &str, target: &str) -> Result<(), Failure> {
    match &a.output {
        Some(path) => {
            std::fs::write(path, text).map_err(|e| {
                Failure::Failed(anyhow::anyhow!("cannot write {}: {e}", path.display()))
            })?;
            errln!("wrote {} ({what} of `{target}`)", path.display());
        }
        None => out!("{text}"),
    }
    Ok(())
}
