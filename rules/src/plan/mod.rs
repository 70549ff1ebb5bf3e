//! The plan: parallel layouts, pricing one layout, splitting its layers into stages, searching
//! a target's layouts, and the plan file with the Megatron-LM arguments that realise it.

pub mod estimate;
pub mod format;
pub mod ilp;
pub mod layout;
pub mod partition;
pub mod search;
