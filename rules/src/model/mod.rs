//! The model: frontends that read model definitions, the op graph they lower to (forward and
//! backward), and the clustering of ops into layers.

pub mod frontend;
pub mod graph;
pub mod layering;
