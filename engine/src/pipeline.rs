//! `autopar solve pipeline`: Alpa's two levels on a model and a cluster (per-layer intra-op
//! tables chained into stage costs, then the stage DP), for one micro-batch size.

use crate::cache::{Cache, Counts, Source, kind};
use crate::error::EngineError;
use crate::record::TableRecord;
use crate::session::Session;
use crate::sharding::lower_model;
use autopar_rules::canonical::{Digest, KeyParts, digest};
use autopar_rules::cost::cluster::Device;
use autopar_rules::cost::cluster::{Cluster, GIB};
use autopar_rules::cost::memory::Precision;
use autopar_rules::cost::profile::{EntryId, ProfileRead};
use autopar_rules::cost::sharding::Mesh;
use autopar_rules::model::frontend::Attention;
use autopar_rules::model::graph::Graph;
use autopar_rules::plan::runtime::Runtime;
use autopar_rules::solve::intra::chain::{
    ChainError, Crossings, LayerTable, decode_layer, layer_names, layer_table_with,
};
use autopar_rules::solve::intra::stage::{SolverChoice, StageOptions, StagePlan};
use autopar_rules::solve::pipeline::{
    DEFAULT_MAX_EXACT_ENTRIES, PipelineError, PipelineOptions, PipelinePlan, TableSource,
    decode_pipeline, layer_table_key, price_pipeline_with,
};
use autopar_store::EntryMeta;
use std::sync::Mutex;
use std::time::Instant;

/// What `solve pipeline` is asked.
#[derive(Clone, Debug)]
pub struct PipelineRequest {
    /// Workspace model name or model file.
    pub model: String,
    /// Workspace cluster name, `PRESET:NODESxGPUS` or `NODE-PRESET:NODES`.
    pub cluster: String,
    /// Sequences per micro-batch.
    pub micro_batch: u64,
    /// Sequences per step.
    pub global_batch: u64,
    /// Tokens per sequence (`None`: the model's maximum).
    pub seq: Option<u64>,
    /// Precision.
    pub precision: Precision,
    /// Attention implementation.
    pub attention: Attention,
    /// Per-device memory budget, GiB (`None`: the device's memory less 10%).
    pub memory_gib: Option<f64>,
    /// Multi-node submeshes only of a power-of-two number of nodes.
    pub powers_of_two: bool,
    /// The logical mesh shapes stages may use; empty: all.
    pub logical_meshes: Vec<[u64; 2]>,
    /// Whether stages may recompute their layers.
    pub recompute: bool,
    /// What fills the layer tables.
    pub solver: SolverChoice,
}

/// What `solve pipeline` found.
#[derive(Clone, Debug)]
pub struct PipelineResult {
    /// Model name.
    pub model: String,
    /// The cluster.
    pub cluster: Cluster,
    /// Sequence length used.
    pub seq: u64,
    /// Micro-batches per step.
    pub microbatches: u64,
    /// Per-device budget, bytes.
    pub budget: f64,
    /// Every layer's name.
    pub layer_names: Vec<String>,
    /// The pipeline.
    pub plan: PipelinePlan,
    /// Time to find it, s.
    pub seconds: f64,
    /// Layer tables asked of the cache: hits per level and solves.
    pub tables: Counts,
}

/// Layer tables through a [`Cache`]: looked up in memory, the local store and the remote
/// under [`table_key`], solved and stored on a miss; what each request did is recorded.
pub struct CachedTables<'c> {
    cache: &'c Cache,
    model: String,
    records: Mutex<Vec<TableRecord>>,
    /// Tables found are neither counted nor recorded (read a second time).
    uncounted: bool,
}

impl<'c> CachedTables<'c> {
    /// Tables of model `model` (named in descriptions) through `cache`.
    pub fn new(cache: &'c Cache, model: &str) -> Self {
        CachedTables {
            cache,
            model: model.to_string(),
            records: Mutex::new(Vec::new()),
            uncounted: false,
        }
    }

    /// [`CachedTables::new`] for tables already read and counted once in this build: those
    /// found are not counted again (a missing one is looked up and solved as usual).
    pub fn uncounted(cache: &'c Cache, model: &str) -> Self {
        CachedTables {
            uncounted: true,
            ..CachedTables::new(cache, model)
        }
    }

    /// One record per table asked for, ordered by slot.
    pub fn into_records(self) -> Vec<TableRecord> {
        let mut records = self.records.into_inner().unwrap_or_else(|e| e.into_inner());
        records.sort_by(|a, b| a.slot.cmp(&b.slot));
        records
    }

    fn note(
        &self,
        slot: String,
        parts: KeyParts,
        reads: Vec<ProfileRead>,
        source: Source,
        table: Option<&LayerTable>,
    ) {
        let record = TableRecord {
            slot,
            parts,
            reads,
            source,
            reasons: Vec::new(),
            solver: table.map(|t| t.solver),
        };
        self.records
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(record);
    }
}

/// How records name a layer table: its layer (the first of its class) and logical mesh.
pub(crate) fn table_slot(graph: &Graph, layer: usize, logical: [u64; 2]) -> String {
    format!(
        "{} · mesh {}x{}",
        graph.layers[layer].name, logical[0], logical[1]
    )
}

impl TableSource for CachedTables<'_> {
    fn table(
        &self,
        graph: &Graph,
        crossings: &Crossings,
        layer: usize,
        identity: Digest,
        mesh: Mesh,
        device: &Device,
        opts: StageOptions,
    ) -> Result<LayerTable, ChainError> {
        let (parts, reads) = layer_table_key(graph, layer, identity, &mesh, device, &opts);
        let key = parts.key();
        let slot = table_slot(graph, layer, mesh.shape);
        if self.uncounted
            && let Some(t) = self.cache.peek::<LayerTable>(key)
        {
            return Ok(t);
        }
        if let Some((t, source)) = self.cache.lookup::<LayerTable>(kind::SHARDING, key) {
            self.note(slot, parts, reads, source, Some(&t));
            return Ok(t);
        }
        let started = Instant::now();
        let solved = layer_table_with(graph, crossings, layer, mesh, device, opts);
        tracing::debug!(
            layer = %graph.layers[layer].name,
            mesh = ?mesh.shape,
            eliminations = solved.as_ref().map_or(0, |t| t.solves),
            work = solved.as_ref().map_or(0.0, |t| t.work),
            states = ?solved.as_ref().map_or((0, 0), |t| (t.before.len(), t.after.len())),
            seconds = started.elapsed().as_secs_f64(),
            "solved layer table"
        );
        self.cache.record(kind::SHARDING, Source::Solved);
        // What `profile diff` matches against the entries it changes.
        let mut read_signatures: Vec<[u8; 32]> = reads
            .iter()
            .map(|r| match &r.entry {
                EntryId::Op(sig) => digest(sig).0,
                EntryId::Collective(sig, _) => digest(sig).0,
            })
            .collect();
        read_signatures.dedup();
        self.note(slot, parts, reads, Source::Solved, solved.as_ref().ok());
        if let Ok(t) = &solved {
            let meta = EntryMeta {
                kind: "layer-table".into(),
                description: format!(
                    "{} ({}) of {} on mesh {}x{} of {}",
                    graph.layers[layer].name,
                    graph.layers[layer].kind.name(),
                    self.model,
                    mesh.shape[0],
                    mesh.shape[1],
                    device.name
                ),
                reads: read_signatures,
                ..EntryMeta::default()
            };
            self.cache.put(key, t, &meta);
        }
        solved
    }

    /// Looked up under the key of its table, its states and the names it holds, decoded and
    /// stored on a miss: after an edit that moves the stages but not their layers' tables and
    /// states (a model's layer count), every block's plan is found again.
    fn layer_plan(
        &self,
        graph: &Graph,
        crossings: &Crossings,
        layer: usize,
        identity: Digest,
        mesh: Mesh,
        device: &Device,
        opts: StageOptions,
        table: &LayerTable,
        state: [usize; 2],
    ) -> Result<StagePlan, ChainError> {
        let (table_parts, _) = layer_table_key(graph, layer, identity, &mesh, device, &opts);
        let key = KeyParts::new("layer-plan")
            .with_digest("table", table_parts.key())
            .with("states", &state)
            .with_digest("names", layer_names(graph, layer))
            .key();
        if let Some((plan, _)) = self.cache.lookup::<StagePlan>(kind::LAYER_PLAN, key) {
            return Ok(plan);
        }
        let plan = decode_layer(graph, crossings, layer, mesh, device, opts, table, state)?;
        self.cache.record(kind::LAYER_PLAN, Source::Solved);
        let meta = EntryMeta {
            kind: "layer-plan".into(),
            description: format!(
                "{} of {} on mesh {}x{} of {}, boundary states {} and {}, decoded",
                graph.layers[layer].name,
                self.model,
                mesh.shape[0],
                mesh.shape[1],
                device.name,
                state[0],
                state[1]
            ),
            ..EntryMeta::default()
        };
        self.cache.put(key, &plan, &meta);
        Ok(plan)
    }
}

/// Fraction of device memory kept free when no budget is given (the build's default
/// `memory_headroom`).
const DEFAULT_HEADROOM: f64 = 0.1;

/// Lowers the model, solves every distinct layer on every submesh and logical mesh, and runs
/// the stage DP.
pub fn solve_pipeline(
    session: &Session,
    cache: &Cache,
    req: &PipelineRequest,
) -> Result<PipelineResult, EngineError> {
    let start = Instant::now();
    // Layer tables only: decoding also asks for each layer's plan.
    let tables_so_far = || {
        cache
            .kind_counts()
            .get(kind::SHARDING)
            .copied()
            .unwrap_or_default()
    };
    let before = tables_so_far();
    let (name, def) = session.model(&req.model)?;
    let cluster = session.cluster(&req.cluster)?;
    if req.micro_batch == 0 || req.global_batch == 0 || req.global_batch % req.micro_batch != 0 {
        return Err(EngineError::Argument {
            flag: "--gbs",
            expected: format!(
                "a positive multiple of the micro-batch size {}",
                req.micro_batch
            ),
            found: req.global_batch.to_string(),
        });
    }
    let budget = match req.memory_gib {
        Some(g) if g.is_finite() && g > 0.0 => g * GIB,
        Some(g) => {
            return Err(EngineError::Argument {
                flag: "--memory-gib",
                expected: "a positive number of GiB".into(),
                found: g.to_string(),
            });
        }
        None => cluster.device.hbm_bytes * (1.0 - DEFAULT_HEADROOM),
    };
    let (seq, graph) = lower_model(
        &name,
        &def,
        req.micro_batch,
        req.seq,
        req.precision,
        req.attention,
        cluster.gpus_per_node,
    )?;
    let microbatches = req.global_batch / req.micro_batch;
    let opts = PipelineOptions {
        // `solve pipeline` prices from the analytic model alone, like `solve sharding`.
        profile: None,
        microbatches,
        memory_budget: budget,
        precision: req.precision,
        max_exact_entries: DEFAULT_MAX_EXACT_ENTRIES,
        max_table_work: autopar_rules::solve::intra::chain::MAX_TABLE_WORK,
        powers_of_two: req.powers_of_two,
        logical_meshes: &req.logical_meshes,
        recompute: req.recompute,
        // Gradient buffers and their reduction as the default runtime keeps them.
        grad_accumulation_fusion: Runtime::default().grad_accumulation_fusion(),
        grad_reduce_in_fp32: Runtime::default().grad_reduce_in_fp32(req.precision),
        fp32_loss: Runtime::default().fp32_loss(),
        tp_comm_overlap: Runtime::default().tp_comm_overlap(),
        solver: req.solver,
    };
    let source = CachedTables::new(cache, &name);
    let infeasible = |e: PipelineError| EngineError::Infeasible(e.to_string());
    let priced = price_pipeline_with(&graph, &cluster, opts, &source).map_err(infeasible)?;
    // Decoding reads the chosen stages' tables again: counted once, above.
    let plan = decode_pipeline(
        &graph,
        &cluster,
        opts,
        &CachedTables::uncounted(cache, &name),
        priced,
    )
    .map_err(infeasible)?;
    let after = tables_so_far();
    Ok(PipelineResult {
        model: name,
        cluster,
        seq,
        microbatches,
        budget,
        layer_names: graph.layers.iter().map(|l| l.name.clone()).collect(),
        plan,
        seconds: start.elapsed().as_secs_f64(),
        tables: Counts {
            total: after.total - before.total,
            memory: after.memory - before.memory,
            local: after.local - before.local,
            remote: after.remote - before.remote,
            solved: after.solved - before.solved,
        },
    })
}
