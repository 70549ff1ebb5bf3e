//! autopar's engine: loads the workspace, resolves names, plans targets in parallel and writes
//! plans. The planning itself is pure logic in `autopar-rules`; durable output goes through
//! `autopar-store`.

pub mod alpa;
pub mod build;
pub mod cache;
pub mod calibrate;
pub mod db;
pub mod diagnostic;
pub mod error;
pub mod executor;
pub mod export;
pub mod input;
pub mod layer_costs;
pub mod pipeline;
pub mod plans;
pub mod profiles;
pub mod record;
pub mod run;
pub mod runs;
pub mod sapp;
pub mod session;
pub mod sharding;
pub mod validate;
pub mod whatif;
pub mod workspace;

pub use autopar_store::server;
pub use error::EngineError;
