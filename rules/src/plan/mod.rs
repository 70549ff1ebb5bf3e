//! The plan: parallel layouts, pricing one layout, splitting its layers into stages, searching
//! a target's layouts, the runtimes a layout runs on, the plan file with the Megatron-LM
//! arguments that realise it, and how predictions compare with measured runs.

pub mod accuracy;
pub mod calibration;
pub mod estimate;
pub mod format;
pub mod ilp;
pub mod layout;
pub mod partition;
pub mod runtime;
pub mod search;
