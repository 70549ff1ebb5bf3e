//! Plausibility bounds on inputs. Anything beyond them is certainly a typo, and accepting it
//! would overflow size arithmetic or make a search run for hours; validators reject it with a
//! message instead.

/// Most GPUs in a cluster.
pub const MAX_GPUS: u64 = 1 << 20;
/// Most transformer blocks.
pub const MAX_LAYERS: u64 = 4096;
/// Largest model width, FFN width, head count or head width.
pub const MAX_WIDTH: u64 = 1 << 24;
/// Largest vocabulary.
pub const MAX_VOCAB: u64 = 1 << 26;
/// Longest sequence.
pub const MAX_SEQ: u64 = 1 << 24;
/// Largest global batch (sequences per step).
pub const MAX_BATCH: u64 = 1 << 30;
/// Largest fixed dimension in a graph file.
pub const MAX_DIM: u64 = 1 << 32;
/// Most ops in a graph file (eight per layer of the deepest model).
pub const MAX_GRAPH_OPS: usize = 1 << 15;
/// Most ops of a flat `ops` list that autopar clusters into layers: the clustering DP holds
/// a table of every pair of ops and its work grows with their square times the layers.
pub const MAX_CLUSTERED_OPS: usize = 4096;
/// Most layers a flat `ops` list is clustered into.
pub const MAX_CLUSTERED_LAYERS: u64 = 128;
/// Most entries of the stage-construction DP's table (8 bytes each: 1 GiB).
pub const MAX_DP_ENTRIES: u64 = 1 << 27;
/// Longest measured time of one kernel or collective, µs (one hour).
pub const MAX_MEASURED_US: f64 = 3.6e9;
