//! The solvers: intra-operator sharding, Alpa's inter-operator stage DP, SAPP's balancing,
//! the pipeline schedules and their simulation, and `pipeline`: the intra-op tables feeding
//! the stage DP.

pub mod balance;
pub mod bottleneck;
pub mod inter;
pub mod intra;
pub mod pipeline;
pub mod schedule;
