//! `autopar graph MODEL`: the op graph of a model.

use super::print_json;
use crate::Failure;
use crate::args::GraphArgs;
use crate::output::out;
use crate::render;
use autopar_engine::session::Session;
use autopar_rules::cost::memory::Precision;
use autopar_rules::model::frontend::{Attention, LowerOptions};

/// Sequence length used for graph files that declare no `max_seq`.
const FALLBACK_SEQ: u64 = 2048;

pub fn run(session: &Session, a: &GraphArgs) -> Result<(), Failure> {
    let (name, def) = session.model(&a.model)?;
    let seq = a
        .model_options
        .seq
        .or_else(|| def.max_seq())
        .unwrap_or(FALLBACK_SEQ);
    let precision: Precision = a.model_options.precision();
    let attention: Attention = a.model_options.attention();
    let g = def
        .lower(
            &name,
            &LowerOptions {
                micro_batch: a.mbs.max(1),
                seq,
                dtype: precision.dtype(),
                attention,
                vocab_multiple: 1,
                eager_elementwise: a.model_options.runtime.eager_elementwise(),
                fp8: false,
            },
        )
        .map_err(|e| Failure::Input(anyhow::anyhow!("model `{name}`: {e}")))?;
    let summary = g.summary();
    if a.json {
        print_json(&summary)
    } else {
        out!(
            "{}",
            render::graph(&summary, precision.name(), attention.name())
        );
        Ok(())
    }
}
