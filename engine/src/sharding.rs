//! `solve sharding`: the intra-op pass on a layer range of a model, with the arguments the
//! command line gives (model and cluster names, `AxB` meshes, `I..J` ranges).

use crate::error::EngineError;
use crate::session::Session;
use crate::workspace::DEFAULT_VOCAB_MULTIPLE;
use autopar_rules::cost::cluster::{Cluster, GIB, cluster_preset_names, node_preset, preset};
use autopar_rules::cost::memory::Precision;
use autopar_rules::cost::sharding::Mesh;
use autopar_rules::model::frontend::{Attention, LowerOptions, ModelDef};
use autopar_rules::model::graph::{Graph, LayerKind};
use autopar_rules::plan::layout::LayoutError;
use autopar_rules::plan::runtime::Runtime;
use autopar_rules::solve::intra::chain::{compose, range_tables};
use autopar_rules::solve::intra::stage::{
    IntraError, SolverChoice, StageModel, StageOptions, StagePlan,
};
use serde::Serialize;
use std::ops::Range;
use std::time::Instant;

/// Preset a mesh runs on when no cluster is named.
pub const DEFAULT_PRESET: &str = "h100-sxm";

/// What `solve sharding` is asked.
#[derive(Clone, Debug)]
pub struct ShardingRequest {
    /// Workspace model name or model file.
    pub model: String,
    /// Workspace cluster name, `PRESET:NODESxGPUS`, or a preset name (sized to the mesh);
    /// `None`: [`DEFAULT_PRESET`].
    pub cluster: Option<String>,
    /// `AxB`.
    pub mesh: String,
    /// `I..J`, `I..=J` or `I`; `None`: the first transformer block.
    pub layers: Option<String>,
    /// Sequences per micro-batch.
    pub micro_batch: u64,
    /// Tokens per sequence (`None`: the model's maximum).
    pub seq: Option<u64>,
    /// Precision.
    pub precision: Precision,
    /// Attention implementation.
    pub attention: Attention,
    /// Per-device memory budget, GiB (`None`: the device's memory).
    pub memory_gib: Option<f64>,
    /// Micro-batches per step.
    pub microbatches: u64,
    /// Micro-batches in flight at the memory peak.
    pub inflight: u64,
    /// Solver.
    pub solver: SolverChoice,
    /// ILP time limit, s.
    pub time_limit: f64,
    /// Also compose the range from per-layer boundary tables.
    pub chain: bool,
}

/// What `solve sharding` found.
#[derive(Clone, Debug)]
pub struct ShardingResult {
    /// Model name.
    pub model: String,
    /// The cluster the mesh sits on.
    pub cluster: Cluster,
    /// Sequence length used.
    pub seq: u64,
    /// Names of the layers solved.
    pub layer_names: Vec<String>,
    /// The plan.
    pub plan: StagePlan,
    /// The range composed from per-layer tables, when asked for; why not, when it is not a
    /// chain or a table is too wide.
    pub chain: Option<Result<ChainReport, String>>,
}

/// The range's cost composed from per-layer boundary tables (`--chain`).
#[derive(Clone, Debug, Serialize)]
pub struct ChainReport {
    /// Least objective of the range, s per micro-batch (the budget not applied).
    pub objective: f64,
    /// Memory per device of the plan reaching it, GiB.
    pub memory_gib: f64,
    /// Per layer: boundary states before and after it, and eliminations run.
    pub layers: Vec<ChainLayer>,
    /// Time to build and chain the tables, s.
    pub seconds: f64,
}

/// One layer's table in a [`ChainReport`].
#[derive(Clone, Debug, Serialize)]
pub struct ChainLayer {
    /// Layer index.
    pub layer: usize,
    /// Boundary states with the previous layer.
    pub states_before: usize,
    /// Boundary states with the next layer.
    pub states_after: usize,
    /// Eliminations run to fill the table.
    pub solves: usize,
}

/// Parses `AxB` (also `A×B`), the value of `flag`.
pub fn parse_mesh(s: &str, flag: &'static str) -> Result<(u64, u64), EngineError> {
    let bad = |why: &str| EngineError::Argument {
        flag,
        expected: "AxB with A, B >= 1 (A nodes of B GPUs, e.g. 2x4)".into(),
        found: format!("`{s}` ({why})"),
    };
    let (a, b) = s.split_once(['x', 'X', '×']).ok_or_else(|| bad("no `x`"))?;
    let num = |t: &str| -> Result<u64, EngineError> {
        let n: u64 = t.trim().parse().map_err(|_| bad("not a whole number"))?;
        if n == 0 || n > autopar_rules::limits::MAX_GPUS {
            return Err(bad("out of range"));
        }
        Ok(n)
    };
    Ok((num(a)?, num(b)?))
}

/// Parses a layer range against a graph of `layers` layers: `I..J` (J excluded), `I..=J`, or
/// one index `I`.
pub fn parse_layers(s: &str, layers: usize) -> Result<Range<usize>, EngineError> {
    let bad = |why: String| EngineError::Argument {
        flag: "--layers",
        expected: format!("I..J, I..=J or I within the model's layers 0..{layers}"),
        found: format!("`{s}` ({why})"),
    };
    let num = |t: &str| -> Result<usize, EngineError> {
        t.trim()
            .parse()
            .map_err(|_| bad(format!("`{t}` is not a layer index")))
    };
    let range = if let Some((a, b)) = s.split_once("..=") {
        num(a)?..num(b)?.saturating_add(1)
    } else if let Some((a, b)) = s.split_once("..") {
        num(a)?..num(b)?
    } else {
        let i = num(s)?;
        i..i.saturating_add(1)
    };
    if range.start >= range.end || range.end > layers {
        return Err(bad("an empty range or one past the last layer".into()));
    }
    Ok(range)
}

/// The cluster a mesh `a x b` runs on.
fn cluster_for(
    session: &Session,
    arg: Option<&str>,
    a: u64,
    b: u64,
) -> Result<Cluster, EngineError> {
    let name = arg.unwrap_or(DEFAULT_PRESET);
    let bare = !name.contains(':') && (preset(name).is_some() || node_preset(name).is_some());
    match bare {
        true => {
            // A bare preset: as many nodes (of 8 GPUs for a device) as the mesh needs.
            let gpn = node_preset(name).map_or(8, |n| n.gpus_per_node);
            let nodes = if b <= gpn { a } else { (a * b).div_ceil(gpn) };
            Cluster::from_preset(&format!("{name}:{nodes}x{gpn}"), name, nodes, Some(gpn)).map_err(
                |reason| EngineError::Argument {
                    flag: "--cluster",
                    expected: format!("a cluster for mesh {a}x{b}"),
                    found: reason,
                },
            )
        }
        false => session.cluster(name).map_err(|e| match e {
            EngineError::Unknown {
                what,
                name,
                expected,
            } => EngineError::Unknown {
                what,
                name,
                expected: format!("{expected}, or a preset name ({})", cluster_preset_names()),
            },
            e => e,
        }),
    }
}

/// Lowers model `def` for micro-batches of `micro_batch` sequences of `seq` tokens (the
/// model's maximum when `None`), its vocabulary padded for `devices`; returns the sequence
/// length used and the graph.
pub(crate) fn lower_model(
    name: &str,
    def: &ModelDef,
    micro_batch: u64,
    seq: Option<u64>,
    precision: Precision,
    attention: Attention,
    devices: u64,
) -> Result<(u64, Graph), EngineError> {
    let seq = seq.or(def.max_seq()).ok_or_else(|| EngineError::Argument {
        flag: "--seq",
        expected: "a sequence length (the model does not declare max_seq)".into(),
        found: "nothing".into(),
    })?;
    let opts = LowerOptions {
        micro_batch,
        seq,
        dtype: precision.dtype(),
        attention,
        vocab_multiple: DEFAULT_VOCAB_MULTIPLE * devices,
        // Elementwise kernels as the default runtime runs them.
        eager_elementwise: Runtime::default().eager_elementwise(),
        fp8: false,
    };
    let graph = def
        .lower(name, &opts)
        .map_err(|e| EngineError::Layout(LayoutError::Model(e)))?;
    if let Some(op) = graph.first_megatron_only_op() {
        return Err(EngineError::Argument {
            flag: "MODEL",
            expected: "a model the intra-op ILP covers (mixture-of-experts and multi-head \
                       latent attention models are planned in the Megatron-LM space: `autopar \
                       estimate`, `autopar build` with space = \"megatron\")"
                .into(),
            found: format!("`{name}` with `{}` ({})", op.name, op.kind.name()),
        });
    }
    Ok((seq, graph))
}

/// Lowers the model, builds the problem of the layer range on the mesh and solves it.
pub fn solve_sharding(
    session: &Session,
    req: &ShardingRequest,
) -> Result<ShardingResult, EngineError> {
    let (name, def) = session.model(&req.model)?;
    let (a, b) = parse_mesh(&req.mesh, "--mesh")?;
    let cluster = cluster_for(session, req.cluster.as_deref(), a, b)?;
    let mesh = Mesh::on(&cluster, a, b).map_err(|why| EngineError::Argument {
        flag: "--mesh",
        expected: format!("a mesh that fits {}", cluster.name),
        found: why,
    })?;
    let (seq, graph) = lower_model(
        &name,
        &def,
        req.micro_batch,
        req.seq,
        req.precision,
        req.attention,
        a * b,
    )?;
    let layers = match &req.layers {
        Some(s) => parse_layers(s, graph.layers.len())?,
        None => {
            let first = graph
                .layers
                .iter()
                .position(|l| l.kind == LayerKind::Block)
                .unwrap_or(0);
            first..first + 1
        }
    };
    if let Some(m) = req.memory_gib
        && !(m.is_finite() && m > 0.0)
    {
        return Err(EngineError::Argument {
            flag: "--memory-gib",
            expected: "a positive number of GiB".into(),
            found: m.to_string(),
        });
    }
    if !(req.time_limit.is_finite() && req.time_limit > 0.0) {
        return Err(EngineError::Argument {
            flag: "--time-limit",
            expected: "a positive number of seconds".into(),
            found: req.time_limit.to_string(),
        });
    }
    let stage = StageOptions {
        microbatches: req.microbatches,
        inflight: req.inflight,
        // Without a budget given, what the device holds.
        memory_budget: Some(
            req.memory_gib
                .map_or(cluster.device.hbm_bytes, |g| g * (1u64 << 30) as f64),
        ),
        precision: req.precision,
        solver: req.solver,
        time_limit: req.time_limit,
        // Gradient buffers and their reduction as the default runtime keeps them.
        grad_accumulation_fusion: Runtime::default().grad_accumulation_fusion(),
        grad_reduce_in_fp32: Runtime::default().grad_reduce_in_fp32(req.precision),
        ..StageOptions::default()
    };
    let model = StageModel::build(&graph, layers.clone(), mesh, &cluster.device, stage)
        .map_err(intra_error)?;
    let plan = model.solve().map_err(intra_error)?;
    let chain = req.chain.then(|| {
        let start = Instant::now();
        let tables = range_tables(&graph, layers.clone(), mesh, &cluster.device, stage)
            .map_err(|e| e.to_string())?;
        let cost = compose(&tables).map_err(|e| e.to_string())?;
        Ok(ChainReport {
            objective: cost.cost,
            memory_gib: cost.memory / GIB,
            layers: tables
                .iter()
                .map(|t| ChainLayer {
                    layer: t.layer,
                    states_before: t.before.len(),
                    states_after: t.after.len(),
                    solves: t.solves,
                })
                .collect(),
            seconds: start.elapsed().as_secs_f64(),
        })
    });
    Ok(ShardingResult {
        model: name,
        cluster,
        seq,
        layer_names: graph.layers[layers]
            .iter()
            .map(|l| l.name.clone())
            .collect(),
        plan,
        chain,
    })
}

fn intra_error(e: IntraError) -> EngineError {
    match e {
        IntraError::Range { .. } => EngineError::Argument {
            flag: "--layers",
            expected: "a layer range of the model".into(),
            found: e.to_string(),
        },
        e => EngineError::Infeasible(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meshes_and_ranges_parse_or_say_why() {
        assert_eq!(parse_mesh("2x4", "--mesh").ok(), Some((2, 4)));
        assert_eq!(parse_mesh("1×8", "--mesh").ok(), Some((1, 8)));
        for bad in ["8", "0x8", "ax2", "2x", "-1x2"] {
            let e = parse_mesh(bad, "--mesh")
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(e.contains("--mesh") && e.contains(bad), "{bad}: {e}");
        }
        assert_eq!(parse_layers("1..3", 5).ok(), Some(1..3));
        assert_eq!(parse_layers("1..=3", 5).ok(), Some(1..4));
        assert_eq!(parse_layers("4", 5).ok(), Some(4..5));
        for bad in ["3..3", "5", "0..6", "x", "2..1"] {
            let e = parse_layers(bad, 5)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(e.contains("--layers") && e.contains("0..5"), "{bad}: {e}");
        }
    }
}
