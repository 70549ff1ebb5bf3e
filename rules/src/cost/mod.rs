//! The cost model: devices and clusters, measured profiles, the analytic kernel and collective
//! costs, sharding specs and their resharding collectives, memory per device, what a layer
//! costs under Megatron-LM's tensor and context parallelism, and which of its tensor-parallel
//! communication Transformer Engine's userbuffers hide.

pub mod analytic;
pub mod cluster;
pub mod context_parallel;
pub mod layer_cost;
pub mod memory;
pub mod profile;
pub mod sharding;
pub mod tensor_parallel;
pub mod tp_comm_overlap;
