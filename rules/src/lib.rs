//! Pure planning logic of autopar: the model IR and its frontends, the hardware and cost model,
//! memory and pipeline-schedule formulas, layout pricing and search, and the plan format.
//!
//! Nothing here does I/O or keeps global state: parsers take text, results are values.

pub mod balance;
pub mod bottleneck;
pub mod canonical;
pub mod cluster;
pub mod cost;
pub mod error;
pub mod estimate;
pub mod frontend;
pub mod graph;
pub mod inter;
pub mod intra;
pub mod layer_cost;
pub mod layering;
pub mod layout;
pub mod limits;
pub mod memory;
pub mod partition;
pub mod plan;
pub mod profile;
pub mod schedule;
pub mod search;
pub mod sharding;
pub mod tensor_parallel;

/// Version salt of the planning rules: changes whenever a rule's results change meaning.
pub const RULES_VERSION: &str = "autopar-rules/2";
