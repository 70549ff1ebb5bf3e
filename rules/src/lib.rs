//! Pure planning logic of autopar: the model IR and its frontends, the hardware and cost model,
//! memory and pipeline-schedule formulas, layout pricing and search, and the plan format.
//!
//! Nothing here does I/O or keeps global state: parsers take text, results are values.

pub mod canonical;
pub mod cost;
pub mod error;
pub mod limits;
pub mod model;
pub mod plan;
pub mod solve;

/// Version salt of the planning rules: changes whenever a rule's results change meaning.
pub const RULES_VERSION: &str = "autopar-rules/31";
