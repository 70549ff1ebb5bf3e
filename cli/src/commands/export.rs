//! `autopar export TARGET|--plan FILE --format F [-o FILE]`: a plan as a framework's launch
//! configuration.

use crate::Failure;
use crate::args::ExportArgs;
use crate::output::{errln, out};
use autopar_engine::export::{ExportOptions, export};
use autopar_engine::session::Session;

pub fn run(session: &Session, a: &ExportArgs) -> Result<(), Failure> {
    let ws = session.workspace()?;
    let plan = super::target_or_file_plan(&ws, a.target.as_deref(), a.plan.as_deref())?;
    let model = ws.plan_model(&plan)?;
    let opts = ExportOptions {
        framework: a.format.into(),
        megatron_layout: a.megatron_layout,
        deepspeed_config: a.deepspeed_config.clone(),
    };
    let text = export(&plan, &model.def, &opts)?;
    match &a.output {
        Some(path) => {
            std::fs::write(path, &text).map_err(|e| {
                Failure::Failed(anyhow::anyhow!("cannot write {}: {e}", path.display()))
            })?;
            errln!(
                "wrote {} ({} launch configuration of `{}`)",
                path.display(),
                opts.framework.name(),
                plan.target
            );
        }
        None => out!("{text}"),
    }
    Ok(())
}
