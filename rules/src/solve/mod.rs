//! The solvers: intra-operator sharding, Alpa's inter-operator stage DP, SAPP's balancing,
//! and the pipeline schedules and their simulation.

pub mod balance;
pub mod bottleneck;
pub mod inter;
pub mod intra;
pub mod schedule;
