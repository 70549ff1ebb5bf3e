//! Alpa's two levels together (ALGORITHMS.md §2 and §3): every distinct layer is solved once
//! per submesh and logical mesh for every boundary state (`intra::chain`), every range of
//! layers is priced by chaining those tables, and the stage DP (`inter`) chooses the stages,
//! their submeshes and logical meshes.
//!
//! What a stage costs is the intra-op objective of its range per micro-batch (forward,
//! backward, resharding, and the per-step gradient sync, optimizer and weight gathers spread
//! over the micro-batches). Its memory is that of the unconstrained optimum of the range with
//! the micro-batches 1F1B keeps in flight there: a stage whose optimum does not fit is not
//! used, even where a leaner sharding of it would fit (the tables carry no budget yet).
//!
//! Every range is also priced with every layer recomputed ([`Entry::recomputed`]): the stage
//! DP sees each logical mesh twice, and a stage it takes with recomputation is balanced
//! afterwards to recompute only the layers its memory needs
//! ([`crate::solve::balance::layers`]), which only lowers its cost.
//!
//! Tied weights (GPT-2's embedding and output layer) are not a chain: a stage holding both is
//! priced with two copies, as Megatron-LM keeps them on different stages, without the sum of
//! their gradients.

use super::balance::layers::{RecomputeChoice, least_recompute};
use super::inter::{self, InterError, RangeGroups, StageChoices, SubmeshChoices, submesh_choices};
use super::intra::chain::{self, ChainError, Crossings, Entry, LayerTable, TableSolver};
use super::intra::stage::{SolverChoice, StageOptions, StagePlan};
use crate::canonical::{Digest, KeyParts, digest};
use crate::cost::cluster::{Cluster, Device};
use crate::cost::layer_cost::LayerCostContext;
use crate::cost::memory::Precision;
use crate::cost::profile::{Profile, ProfileRead, kernel_name};
use crate::cost::sharding::Mesh;
use crate::model::graph::{Graph, TensorId};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// The largest factor the exact solver builds for a layer table by default (a few hundred MB
/// of f64 at most).
pub const DEFAULT_MAX_EXACT_ENTRIES: f64 = 4e6;

/// How the pipeline is searched.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PipelineOptions<'p> {
    /// Micro-batches per step `B`.
    pub microbatches: u64,
    /// Per-device memory budget, bytes.
    pub memory_budget: f64,
    /// Training precision.
    pub precision: Precision,
    /// Largest factor the exact solver may build.
    pub max_exact_entries: f64,
    /// Most work the layer tables of the search may take together, and one table's exact
    /// elimination alone ([`chain::MAX_TABLE_WORK`] in builds).
    pub max_table_work: f64,
    /// Multi-node submeshes only of a power-of-two number of nodes.
    pub powers_of_two: bool,
    /// The logical mesh shapes stages may use (`[a, b]`, Alpa's logical shape space); empty:
    /// every factorisation of every submesh.
    pub logical_meshes: &'p [[u64; 2]],
    /// Whether stages may recompute their layers (activation checkpointing).
    pub recompute: bool,
    /// See [`StageOptions::grad_accumulation_fusion`].
    pub grad_accumulation_fusion: bool,
    /// See [`StageOptions::grad_reduce_in_fp32`].
    pub grad_reduce_in_fp32: bool,
    /// See [`StageOptions::fp32_loss`].
    pub fp32_loss: bool,
    /// See [`StageOptions::tp_comm_overlap`].
    pub tp_comm_overlap: bool,
    /// Measured kernel times the layer tables read (see [`StageOptions::profile`]).
    pub profile: Option<&'p Profile>,
    /// What fills the layer tables ([`chain::layer_table_with`]): the exact elimination,
    /// D-Rec, or (`Auto`) the elimination with D-Rec for layers too large for it.
    pub solver: SolverChoice,
}

impl<'p> PipelineOptions<'p> {
    /// The intra-op options of a stage with `inflight` micro-batches in flight (no budget:
    /// the tables and the stage DP apply it).
    pub fn stage_options(&self, inflight: u64) -> StageOptions<'p> {
        StageOptions {
            microbatches: self.microbatches,
            inflight,
            memory_budget: None,
            precision: self.precision,
            max_exact_entries: self.max_exact_entries,
            max_table_work: self.max_table_work,
            grad_accumulation_fusion: self.grad_accumulation_fusion,
            grad_reduce_in_fp32: self.grad_reduce_in_fp32,
            fp32_loss: self.fp32_loss,
            tp_comm_overlap: self.tp_comm_overlap,
            profile: self.profile,
            solver: self.solver,
            ..StageOptions::default()
        }
    }
}

/// Why no pipeline was found.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PipelineError {
    /// A layer table could not be built.
    #[error(transparent)]
    Chain(#[from] ChainError),
    /// The stage DP found no solution.
    #[error(transparent)]
    Inter(#[from] InterError),
    /// The layer tables need more work than one search may spend.
    #[error(
        "its layer tables need more than {max:.0e} units of work (cost entries and additions \
         of the exact eliminations), so the ILP space was not searched at this size; \
         `submeshes = \"powers-of-two\"` or `logical_meshes` under [target.search], or \
         `solver = \"drec\"`, make it smaller"
    )]
    TooMuchWork {
        /// [`PipelineOptions::max_table_work`].
        max: f64,
    },
}

/// A submesh and one logical mesh of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MeshChoice {
    /// Physical shape: hosts x devices per host.
    pub submesh: (u64, u64),
    /// Logical mesh over those devices.
    pub logical: [u64; 2],
}

/// A stage the stage DP chose, priced from its layers' tables (its ops not yet decoded).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PricedStage {
    /// Layers `start..end`.
    pub layers: [usize; 2],
    /// Where it runs.
    pub mesh: MeshChoice,
    /// Objective per micro-batch, s.
    pub cost: f64,
    /// Of `cost`, the forward pass per micro-batch (without recomputation), s.
    pub forward: f64,
    /// Of `cost`, the backward pass per micro-batch (without recomputation), s.
    pub backward: f64,
    /// Per-step terms (gradient synchronisation, optimizer, updated-weight gathers), s per
    /// step (`cost` holds them divided by the micro-batches).
    pub step: f64,
    /// Of `step`, the collectives, s.
    pub sync: f64,
    /// Micro-batches in flight under 1F1B.
    pub inflight: u64,
    /// Memory per device with those in flight, bytes.
    pub memory: f64,
    /// Layers recomputed in the backward pass (balanced: the fewest seconds of
    /// recomputation that fit the budget).
    pub recomputed: Vec<usize>,
    /// Of `cost`, the recomputation, s.
    pub recompute_s: f64,
    /// Activations kept per micro-batch in flight, bytes.
    pub activations: f64,
    /// Per layer, the `before` and `after` boundary states of the path priced: what
    /// decoding the stage pins.
    pub states: Vec<[usize; 2]>,
}

/// A stage of the pipeline, decoded.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PipelineStage {
    /// The stage as priced.
    #[serde(flatten)]
    pub priced: PricedStage,
    /// The intra-op plan reaching its cost without recomputation: every op's and
    /// parameter's specs on the logical mesh, with its micro-batches in flight.
    pub plan: StagePlan,
    /// Per layer of the stage, what filled the table that priced it (empty in a record
    /// written before solvers were recorded).
    #[serde(default)]
    pub solvers: Vec<TableSolver>,
}

/// A pipeline the stage DP found: its stages, `S` as priced ([`PricedPipeline`]) or decoded
/// ([`PipelinePlan`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Pipeline<S> {
    /// `sum of stage costs + (B - 1) * largest`, s per step.
    pub step: f64,
    /// The stages, in order.
    pub stages: Vec<S>,
    /// Layer tables solved (distinct layers x mesh choices).
    pub tables: usize,
    /// Eliminations the tables took when they were solved.
    pub solves: usize,
    /// Mesh choices considered.
    pub meshes: usize,
    /// Layers left off a mesh choice because their table was too large to fill (for the
    /// exact elimination, or for D-Rec's pins): no stage on that mesh choice holds them.
    pub skipped: Vec<Skipped>,
}

/// The pipeline priced and balanced, before its stages are decoded.
pub type PricedPipeline = Pipeline<PricedStage>;

/// The pipeline with every stage decoded.
pub type PipelinePlan = Pipeline<PipelineStage>;

/// A layer whose table on a mesh choice could not be solved.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Skipped {
    /// The mesh choice.
    pub mesh: MeshChoice,
    /// The layer's name (the first of its class).
    pub layer: String,
    /// Why.
    pub reason: String,
}

/// The divisors of `n`, increasing, found up to its square root (the search sizes every
/// submesh of clusters of up to a million devices).
pub fn divisors(n: u64) -> Vec<u64> {
    let mut small = Vec::new();
    let mut large = Vec::new();
    let mut d = 1;
    while d * d <= n {
        if n % d == 0 {
            small.push(d);
            if d * d != n {
                large.push(n / d);
            }
        }
        d += 1;
    }
    small.extend(large.into_iter().rev());
    small
}

/// Every logical mesh `a x b` of `devices` devices (axis 1 over consecutive devices), by
/// increasing `a`.
pub fn logical_meshes(devices: u64) -> Vec<[u64; 2]> {
    divisors(devices)
        .into_iter()
        .map(|a| [a, devices / a])
        .collect()
}

/// Per layer: the hash of what its tables depend on in the model (its canonical form and the
/// shapes of the tensors crossing its edges). Layers with the same identity have the same
/// tables, in this model or any other.
pub fn layer_identities(graph: &Graph) -> Vec<Digest> {
    let ctx = LayerCostContext::new(graph);
    let crossing = chain::crossing_shapes(graph);
    (0..graph.layers.len())
        .map(|l| digest(&(ctx.canonical(l), &crossing[l])))
        .collect()
}

/// Layer `l`'s class: the first layer with the same identity.
pub fn layer_classes(graph: &Graph) -> Vec<usize> {
    classes_of(&layer_identities(graph))
}

fn classes_of(identities: &[Digest]) -> Vec<usize> {
    let mut first: HashMap<Digest, usize> = HashMap::new();
    identities
        .iter()
        .enumerate()
        .map(|(l, id)| *first.entry(*id).or_insert(l))
        .collect()
}

/// The components of a layer table's cache key: exactly what the table depends on, with
/// `reads` the measured kernels it may read ([`profile_reads`]).
pub fn table_key(
    identity: Digest,
    mesh: &Mesh,
    device: &Device,
    opts: &StageOptions<'_>,
    reads: &[ProfileRead],
) -> KeyParts {
    // The problem reads the links only through the mesh.
    let device = device.compute_part();
    let parts = KeyParts::new("layer-table")
        .with_digest("layer", identity)
        .with("mesh", mesh)
        .with("device", &device)
        .with(
            "options",
            &(
                opts.microbatches,
                opts.inflight,
                opts.memory_budget,
                opts.precision,
                opts.max_exact_entries,
                opts.max_table_work,
                opts.grad_accumulation_fusion,
                opts.grad_reduce_in_fp32,
                opts.solver,
            ),
        )
        .with("profile", reads);
    // Only when set: a fused loss, whatever the runtime, keeps the key it always had; so does
    // communication that userbuffers do not overlap.
    let when = |parts: KeyParts, name: &str, on: bool| {
        if on { parts.with(name, &true) } else { parts }
    };
    let parts = when(parts, "fp32_loss", opts.fp32_loss);
    when(parts, "tp_comm_overlap", opts.tp_comm_overlap)
}

/// The key of layer `layer`'s table on `mesh` ([`table_key`]) and the measurements it may
/// read ([`profile_reads`]), which the key holds.
pub fn layer_table_key(
    graph: &Graph,
    layer: usize,
    identity: Digest,
    mesh: &Mesh,
    device: &Device,
    opts: &StageOptions<'_>,
) -> (KeyParts, Vec<ProfileRead>) {
    let reads = profile_reads(graph, layer, mesh, opts);
    (table_key(identity, mesh, device, opts, &reads), reads)
}

/// The measurements layer `layer`'s table on `mesh` may read: every kernel of the options'
/// profile whose name, pass and dtype are one of the layer's ops' and whose operands tile that
/// op's on the mesh, and every collective on a group of one mesh axis over that axis's link (a
/// superset of what any strategy reads, so a key holding them is never stale), ordered by
/// entry.
pub fn profile_reads(
    graph: &Graph,
    layer: usize,
    mesh: &Mesh,
    opts: &StageOptions<'_>,
) -> Vec<ProfileRead> {
    let Some(profile) = opts.profile else {
        return Vec::new();
    };
    let l = &graph.layers[layer];
    let shapes = |ts: &[TensorId]| -> Vec<&[u64]> {
        ts.iter()
            .map(|&t| graph.tensor(t).shape.as_slice())
            .collect()
    };
    let mut reads: Vec<ProfileRead> = l
        .forward
        .iter()
        .chain(&l.backward)
        .flat_map(|&o| {
            let op = graph.op(o);
            profile.tilings(
                &kernel_name(op.kind),
                op.pass,
                opts.precision.dtype(),
                (&shapes(&op.inputs), &shapes(&op.outputs)),
                mesh.shape,
            )
        })
        .collect();
    for a in 0..2 {
        if mesh.shape[a] > 1 {
            reads.extend(profile.collective_points(mesh.shape[a], mesh.links[a].internode()));
        }
    }
    reads.sort_by(|a, b| a.entry.cmp(&b.entry));
    reads.dedup_by(|a, b| a.entry == b.entry);
    reads
}

/// Where layer tables come from: solved here, or through a cache.
pub trait TableSource: Sync {
    /// The table of layer `layer` of `graph` (whose identity is `identity`, whose crossings
    /// are `crossings`) on `mesh`.
    #[allow(clippy::too_many_arguments)]
    fn table(
        &self,
        graph: &Graph,
        crossings: &Crossings,
        layer: usize,
        identity: Digest,
        mesh: Mesh,
        device: &Device,
        opts: StageOptions,
    ) -> Result<LayerTable, ChainError>;

    /// Layer `layer`'s plan on `mesh` with its boundaries pinned to the states `state` of its
    /// `table` (from [`TableSource::table`] with the same arguments): [`chain::decode_layer`],
    /// here or through a cache.
    #[allow(clippy::too_many_arguments)]
    fn layer_plan(
        &self,
        graph: &Graph,
        crossings: &Crossings,
        layer: usize,
        _identity: Digest,
        mesh: Mesh,
        device: &Device,
        opts: StageOptions,
        table: &LayerTable,
        state: [usize; 2],
    ) -> Result<StagePlan, ChainError> {
        chain::decode_layer(graph, crossings, layer, mesh, device, opts, table, state)
    }
}

/// Solves every table.
pub struct Solve;

impl TableSource for Solve {
    fn table(
        &self,
        graph: &Graph,
        crossings: &Crossings,
        layer: usize,
        _identity: Digest,
        mesh: Mesh,
        device: &Device,
        opts: StageOptions,
    ) -> Result<LayerTable, ChainError> {
        chain::layer_table_with(graph, crossings, layer, mesh, device, opts)
    }
}

/// Most layer tables one pipeline search solves (distinct layers x mesh choices) before the
/// build leaves the ILP space out, saying so: each is an exact solve of its own.
pub const MAX_TABLES: u64 = 20_000;

/// Most range prices one pipeline search considers (layers^2 x mesh choices) before the build
/// leaves the ILP space out, saying so: GPT-3 175B on every submesh of 128 nodes is 1.7e7.
/// Ranges holding the same sequence of layers are priced once, but the stage DP still reads
/// every range on every submesh.
pub const MAX_RANGE_PRICES: u64 = 20_000_000;

/// A range's stage cost per micro-batch and the most stages that may follow it, without
/// recomputation and with every layer recomputed.
type RangePrice = [(f64, i64); 2];

/// No stage.
const UNPRICED: RangePrice = [(f64::INFINITY, -1); 2];

/// Submeshes (hosts x devices per host), and the logical meshes of each.
type MeshChoices = (Vec<(u64, u64)>, Vec<Vec<[u64; 2]>>);

/// The mesh choices the search considers: every submesh (Alpa's shapes) with each of its
/// logical meshes, only those of `logical` when it names any (a submesh left with none is
/// left out).
fn mesh_choices(cluster: &Cluster, powers_of_two: bool, logical: &[[u64; 2]]) -> MeshChoices {
    let mut submeshes = Vec::new();
    let mut configs = Vec::new();
    for (n, m) in submesh_choices(cluster.nodes, cluster.gpus_per_node, powers_of_two) {
        let shapes: Vec<[u64; 2]> = logical_meshes(n * m)
            .into_iter()
            .filter(|l| logical.is_empty() || logical.contains(l))
            .collect();
        if !shapes.is_empty() {
            submeshes.push((n, m));
            configs.push(shapes);
        }
    }
    (submeshes, configs)
}

/// The first layer of every class: the layers whose tables are solved.
fn distinct_layers(classes: &[usize]) -> Vec<usize> {
    (0..classes.len()).filter(|&l| classes[l] == l).collect()
}

/// The size of the search [`plan_pipeline_with`] would run: layer tables and range prices.
pub fn search_size(
    graph: &Graph,
    cluster: &Cluster,
    powers_of_two: bool,
    logical: &[[u64; 2]],
) -> (u64, u64) {
    let (_, configs) = mesh_choices(cluster, powers_of_two, logical);
    let meshes: u64 = configs.iter().map(|c| c.len() as u64).sum();
    let distinct = distinct_layers(&layer_classes(graph)).len() as u64;
    let layers = graph.layers.len() as u64;
    (
        distinct.saturating_mul(meshes),
        layers.saturating_mul(layers).saturating_mul(meshes),
    )
}

/// One layer table the search asks its [`TableSource`] for.
#[derive(Clone, Debug)]
pub struct TableRequest {
    /// Where the table's layer would run.
    pub mesh: MeshChoice,
    /// The layer (the first of its class).
    pub layer: usize,
    /// The table's cache key.
    pub key: KeyParts,
    /// The profile measurements it may read (part of the key).
    pub reads: Vec<ProfileRead>,
}

/// Every layer table [`plan_pipeline_with`] asks for, in its order, with its key: what a
/// dry run looks up to say how many would be solved.
pub fn table_requests(
    graph: &Graph,
    cluster: &Cluster,
    opts: PipelineOptions,
) -> Vec<TableRequest> {
    let (submeshes, configs) = mesh_choices(cluster, opts.powers_of_two, opts.logical_meshes);
    let identities = layer_identities(graph);
    let stage_opts = opts.stage_options(1);
    jobs(&configs, &distinct_layers(&classes_of(&identities)))
        .into_iter()
        .map(|(s, c, l)| {
            let mesh = Mesh::logical(cluster, submeshes[s], configs[s][c]);
            let (key, reads) =
                layer_table_key(graph, l, identities[l], &mesh, &cluster.device, &stage_opts);
            TableRequest {
                mesh: MeshChoice {
                    submesh: submeshes[s],
                    logical: configs[s][c],
                },
                layer: l,
                key,
                reads,
            }
        })
        .collect()
}

/// A table to solve: submesh, logical mesh of it, layer (indices).
type Job = (usize, usize, usize);

/// Every distinct layer on every mesh choice.
fn jobs(configs: &[Vec<[u64; 2]>], distinct: &[usize]) -> Vec<Job> {
    (0..configs.len())
        .flat_map(|s| (0..configs[s].len()).map(move |c| (s, c)))
        .flat_map(|(s, c)| distinct.iter().map(move |&l| (s, c, l)))
        .collect()
}

/// The stage costs of every range on every mesh choice, and Alpa's DP over them, solving
/// every table.
pub fn plan_pipeline(
    graph: &Graph,
    cluster: &Cluster,
    opts: PipelineOptions,
) -> Result<PipelinePlan, PipelineError> {
    plan_pipeline_with(graph, cluster, opts, &Solve)
}

/// [`plan_pipeline`] with the tables from `source`.
pub fn plan_pipeline_with(
    graph: &Graph,
    cluster: &Cluster,
    opts: PipelineOptions,
    source: &dyn TableSource,
) -> Result<PipelinePlan, PipelineError> {
    let priced = price_pipeline_with(graph, cluster, opts, source)?;
    decode_pipeline(graph, cluster, opts, source, priced)
}

/// The stage costs of every range on every mesh choice from the tables of `source`, Alpa's
/// DP over them, and the balancing of the stages it chose: the pipeline priced, its stages
/// not decoded (what comparing micro-batch sizes needs).
pub fn price_pipeline_with(
    graph: &Graph,
    cluster: &Cluster,
    opts: PipelineOptions,
    source: &dyn TableSource,
) -> Result<PricedPipeline, PipelineError> {
    let (submeshes, configs) = mesh_choices(cluster, opts.powers_of_two, opts.logical_meshes);
    let identities = layer_identities(graph);
    let classes = classes_of(&identities);
    let stage_opts = opts.stage_options(1);
    let crossings = Crossings::of(graph);
    let jobs = jobs(&configs, &distinct_layers(&classes));
    // The work of the tables filled so far: once it passes the bound, the tables not started
    // are left, and the search stops. Whether it stops depends on the tables' total alone, not
    // on the order the threads fill them in: a table's work is fixed, so a total past the
    // bound is passed either by the tables filled first or, at the latest, by all of them.
    let work = std::sync::Mutex::new(0.0f64);
    let spent = || *work.lock().unwrap_or_else(|e| e.into_inner());
    let solved: Vec<(Job, Result<LayerTable, ChainError>)> = jobs
        .par_iter()
        .filter_map(|&(s, c, l)| {
            if spent() > opts.max_table_work {
                return None;
            }
            let mesh = Mesh::logical(cluster, submeshes[s], configs[s][c]);
            let t = source.table(
                graph,
                &crossings,
                l,
                identities[l],
                mesh,
                &cluster.device,
                stage_opts,
            );
            if let Ok(t) = &t {
                *work.lock().unwrap_or_else(|e| e.into_inner()) += t.work;
            }
            Some(((s, c, l), t))
        })
        .collect();
    if spent() > opts.max_table_work {
        return Err(PipelineError::TooMuchWork {
            max: opts.max_table_work,
        });
    }
    // A table too large to fill takes its layer off that mesh choice (every range holding
    // it), and the plan says so; any other failure is an error.
    let mut skipped = Vec::new();
    let mut tables: HashMap<Job, LayerTable> = HashMap::new();
    for ((s, c, l), t) in solved {
        match t {
            Ok(t) => {
                tables.insert((s, c, l), t);
            }
            Err(
                e @ (ChainError::TooWide(_)
                | ChainError::TooManyRuns { .. }
                | ChainError::TooMuchWork { .. }),
            ) => skipped.push(Skipped {
                mesh: MeshChoice {
                    submesh: submeshes[s],
                    logical: configs[s][c],
                },
                layer: graph.layers[l].name.clone(),
                reason: e.to_string(),
            }),
            Err(e) => return Err(e.into()),
        }
    }
    let solves = tables.values().map(|t| t.solves).sum();
    // Alpa's tables, inclusive ends, with configuration `2 m + r` logical mesh `m` with
    // (r = 1) or without every layer of the stage recomputed; built one submesh per task
    // (its logical meshes' ranges priced in parallel) and kept only as the configurations the
    // stage DP can use ([`SubmeshChoices`]), one set per sequence of layer classes the ranges
    // hold ([`Sequences`]), never as the dense tables of every mesh choice and range.
    let seqs = Sequences::of(&classes);
    let per_submesh: Vec<SubmeshChoices> = (0..submeshes.len())
        .into_par_iter()
        .map(|s| {
            // Per logical mesh, per sequence: the stage's cost and how many stages may follow
            // it, without and with recomputation (32 bytes a sequence).
            let priced: Vec<Vec<RangePrice>> = (0..configs[s].len())
                .into_par_iter()
                .map(|c| range_prices(&seqs, &|class| tables.get(&(s, c, class)), opts))
                .collect::<Result<_, ChainError>>()?;
            Ok(SubmeshChoices::new(&seqs.groups, |g, out| {
                for (c, sequences) in priced.iter().enumerate() {
                    for (r, &(t, succ)) in sequences[g].iter().enumerate() {
                        out.push((t, succ, (2 * c + r) as u32));
                    }
                }
            }))
        })
        .collect::<Result<_, ChainError>>()?;
    let problem = StageChoices::new(
        &seqs.groups,
        &submeshes,
        &per_submesh,
        cluster.gpus(),
        opts.microbatches,
    )?;
    drop(per_submesh);
    let plan = inter::solve_choices(problem, inter::StageOptions::default())?;
    let count = plan.stages.len();
    let b = opts.microbatches.max(1) as f64;
    let stages = plan
        .stages
        .par_iter()
        .enumerate()
        .map(|(j, st)| {
            let (config, recompute) = (st.config / 2, st.config % 2 == 1);
            let inflight = ((count - j) as u64).min(opts.microbatches.max(1));
            // The chosen stage's range chained again for its memory and its path.
            let range: Vec<&LayerTable> = (st.start..=st.end)
                .map(|l| {
                    tables
                        .get(&(st.submesh, config, classes[l]))
                        .ok_or(ChainError::Mismatch(l, l))
                })
                .collect::<Result<_, _>>()?;
            // The path the DP priced: the best without recomputation, its last state the
            // best recomputed when the stage recomputes.
            let ending = |e: Entry| if recompute { e.recomputed() } else { e };
            let (e, states) = chain::best_path_ending(&range, ending)?
                .ok_or(ChainError::Mismatch(st.start, st.end + 1))?;
            // Balancing: of a stage the DP priced with every layer recomputed, only the
            // layers memory needs are recomputed.
            let per_layer: Vec<Entry> = range
                .iter()
                .zip(&states)
                .map(|(t, &[b, a])| t.entry(b, a))
                .collect();
            let every = |r: bool| vec![r; per_layer.len()];
            let balanced = if recompute {
                // The DP checked that recomputing every layer fits; only rounding in the
                // order of the sums could say otherwise here.
                least_recompute(&per_layer, inflight, opts.memory_budget).unwrap_or_else(|| {
                    RecomputeChoice::of(&per_layer, inflight, every(true), false)
                })
            } else {
                RecomputeChoice::of(&per_layer, inflight, every(false), true)
            };
            Ok(PricedStage {
                layers: [st.start, st.end + 1],
                mesh: MeshChoice {
                    submesh: submeshes[st.submesh],
                    logical: configs[st.submesh][config],
                },
                cost: e.cost + balanced.seconds,
                forward: e.forward,
                backward: e.cost - e.forward - e.step / b,
                step: e.step,
                sync: e.sync,
                inflight,
                memory: balanced.memory,
                recomputed: (st.start..=st.end)
                    .zip(&balanced.recomputed)
                    .filter(|(_, r)| **r)
                    .map(|(l, _)| l)
                    .collect(),
                recompute_s: balanced.seconds,
                activations: balanced.activations,
                states,
            })
        })
        .collect::<Result<Vec<PricedStage>, ChainError>>()?;
    let slowest = stages.iter().map(|s| s.cost).fold(0.0, f64::max);
    Ok(Pipeline {
        step: stages.iter().map(|s| s.cost).sum::<f64>() + (b - 1.0) * slowest,
        stages,
        tables: tables.len(),
        solves,
        meshes: configs.iter().map(Vec::len).sum(),
        skipped,
    })
}

/// Decodes every stage of `priced` (found by [`price_pipeline_with`] with the same graph,
/// cluster and options) with the tables of `source`: each layer solved again with its
/// boundary specs pinned to the path priced, so every op's and weight's specs are known.
/// Layers of one class pinned alike on one mesh choice have the same plan, in any stage:
/// each is solved once, with one micro-batch in flight, and renamed and rescaled for the
/// others.
pub fn decode_pipeline(
    graph: &Graph,
    cluster: &Cluster,
    opts: PipelineOptions,
    source: &dyn TableSource,
    priced: PricedPipeline,
) -> Result<PipelinePlan, PipelineError> {
    let identities = layer_identities(graph);
    let classes = classes_of(&identities);
    let crossings = Crossings::of(graph);
    let mesh = |m: &MeshChoice| Mesh::logical(cluster, m.submesh, m.logical);
    // The tables the stages read (they are built with one micro-batch in flight).
    let mut wanted: Vec<(MeshChoice, usize)> = priced
        .stages
        .iter()
        .flat_map(|st| {
            classes[st.layers[0]..st.layers[1]]
                .iter()
                .map(|&c| (st.mesh, c))
        })
        .collect();
    wanted.sort_unstable_by_key(|&(m, c)| (m.submesh, m.logical, c));
    wanted.dedup();
    let tables: HashMap<(MeshChoice, usize), LayerTable> = wanted
        .into_par_iter()
        .map(|(m, c)| {
            let t = source.table(
                graph,
                &crossings,
                c,
                identities[c],
                mesh(&m),
                &cluster.device,
                opts.stage_options(1),
            )?;
            Ok(((m, c), t))
        })
        .collect::<Result<_, ChainError>>()?;
    // Each distinct (mesh choice, class, states) decoded once, at the class's first layer (as
    // its table is built): the same layer whichever stages hold the class, so that a cache
    // finds the plan again when an edit moves the stages.
    type Pinned = (MeshChoice, usize, [usize; 2]);
    let mut pinned: Vec<Pinned> = priced
        .stages
        .iter()
        .flat_map(|st| {
            (st.layers[0]..st.layers[1])
                .zip(&st.states)
                .map(|(l, &state)| (st.mesh, classes[l], state))
        })
        .collect();
    pinned.sort_unstable_by_key(|&(m, c, state)| (m.submesh, m.logical, c, state));
    pinned.dedup();
    let decoded: HashMap<Pinned, StagePlan> = pinned
        .into_par_iter()
        .map(|(m, c, state)| {
            let plan = source.layer_plan(
                graph,
                &crossings,
                c,
                identities[c],
                mesh(&m),
                &cluster.device,
                opts.stage_options(1),
                &tables[&(m, c)],
                state,
            )?;
            Ok(((m, c, state), plan))
        })
        .collect::<Result<_, ChainError>>()?;
    let stages = priced
        .stages
        .into_par_iter()
        .map(|st| {
            let parts: Vec<StagePlan> = (st.layers[0]..st.layers[1])
                .zip(&st.states)
                .map(|(l, &state)| {
                    let plan = &decoded[&(st.mesh, classes[l], state)];
                    chain::moved(graph, plan.clone(), classes[l], l)
                })
                .collect();
            let plan = StagePlan::join(parts)
                .ok_or(ChainError::Mismatch(st.layers[0], st.layers[1]))?
                .with_inflight(1, st.inflight);
            let solvers = (st.layers[0]..st.layers[1])
                .map(|l| tables[&(st.mesh, classes[l])].solver)
                .collect();
            Ok(PipelineStage {
                priced: st,
                plan,
                solvers,
            })
        })
        .collect::<Result<Vec<PipelineStage>, ChainError>>()?;
    Ok(Pipeline {
        step: priced.step,
        stages,
        tables: priced.tables,
        solves: priced.solves,
        meshes: priced.meshes,
        skipped: priced.skipped,
    })
}

/// The distinct sequences of layer classes that the ranges of a model hold, as a trie whose
/// nodes are the ranges' groups ([`RangeGroups`]): a range's price on a mesh choice depends
/// on its sequence alone, and `[embedding, block x n, head]` has O(L) sequences, not O(L^2).
struct Sequences {
    /// Range `[k, i]`'s group: the node of `classes[k..=i]`.
    groups: RangeGroups,
    /// Per node, its sequence's last class.
    class: Vec<usize>,
    /// Per node, the nodes one class longer; and the nodes of one class.
    children: Vec<Vec<usize>>,
    roots: Vec<usize>,
}

impl Sequences {
    fn of(classes: &[usize]) -> Self {
        let groups = RangeGroups::by_sequence(classes);
        let mut class = Vec::with_capacity(groups.len());
        let mut children = vec![Vec::new(); groups.len()];
        let mut roots = Vec::new();
        for g in 0..groups.len() {
            let (k, i) = groups.range(g);
            class.push(classes[i]);
            // The parent: the same sequence less its last class.
            let parent = if i > k { groups.of(k, i - 1) } else { None };
            match parent {
                Some(parent) => children[parent].push(g),
                None => roots.push(g),
            }
        }
        Sequences {
            groups,
            class,
            children,
            roots,
        }
    }
}

/// Every sequence's [`RangePrice`] (per node of `seqs`) on one mesh choice whose layers of
/// class `c` have table `table(c)` (`None`: not placed there). The trie is walked depth
/// first, each node chained once from its parent's best entry per boundary state, so only the
/// current path's entries are held. Once a run of identical blocks reaches its steady state,
/// each further block costs time linear in the states ([`chain::steady`]).
fn range_prices<'t>(
    seqs: &Sequences,
    table: &dyn Fn(usize) -> Option<&'t LayerTable>,
    opts: PipelineOptions,
) -> Result<Vec<RangePrice>, ChainError> {
    let layers = seqs.groups.layers();
    let variants = if opts.recompute { 2 } else { 1 };
    let price = |best: &[Entry]| {
        let mut priced = UNPRICED;
        for (slot, e) in priced.iter_mut().zip(chain::finish(best)).take(variants) {
            if let Some(succ) = most_following(&e, opts, layers) {
                *slot = (e.cost, succ);
            }
        }
        priced
    };
    // Boundaries matched once per pair of neighbouring classes, rankings once per class.
    let mut links: HashMap<(usize, usize), Vec<usize>> = HashMap::new();
    let mut ranks: HashMap<usize, chain::Ranking> = HashMap::new();
    let mut out = vec![UNPRICED; seqs.class.len()];
    // The chained states of the current path by depth: `path[..depth]` are the ancestors of
    // the node at `depth` (the walk is depth first), and deeper frames only lend their
    // buffers to the next node at their depth. Nodes to visit with their depth.
    let mut path: Vec<Chained> = Vec::new();
    let mut stack: Vec<(usize, usize)> = seqs.roots.iter().rev().map(|&n| (n, 0)).collect();
    while let Some((n, depth)) = stack.pop() {
        let class = seqs.class[n];
        // A layer not placed on this mesh choice: no range holding it is.
        let Some(next) = table(class) else {
            continue;
        };
        if path.len() == depth {
            path.push(Chained::default());
        }
        let (before, here) = path.split_at_mut(depth);
        let made = &mut here[0];
        made.node = n;
        match before.last() {
            None => {
                made.chain.best = chain::start(next);
                made.chain.from.clear();
                made.steady = false;
            }
            Some(parent) => {
                let prev = seqs.class[parent.node];
                let link = match links.entry((prev, class)) {
                    std::collections::hash_map::Entry::Occupied(l) => l.into_mut(),
                    std::collections::hash_map::Entry::Vacant(slot) => {
                        let (_, i) = seqs.groups.range(n);
                        let prev = table(prev).ok_or(ChainError::Mismatch(i - 1, i))?;
                        slot.insert(chain::link(prev, next).ok_or(ChainError::Mismatch(i - 1, i))?)
                    }
                };
                let repeat = prev == class;
                let (best, from) = (&parent.chain.best, &parent.chain.from);
                if repeat && parent.steady {
                    chain::extend_along(best, from, link, next, &mut made.chain.best);
                    made.chain.from.clone_from(from);
                    made.steady = true;
                } else {
                    let rank = ranks.entry(class).or_insert_with(|| chain::ranking(next));
                    chain::extend_linked(best, link, next, rank, &mut made.chain);
                    made.steady = repeat && chain::steady(best, &made.chain.best);
                }
            }
        }
        out[n] = price(&made.chain.best);
        stack.extend(seqs.children[n].iter().rev().map(|&c| (c, depth + 1)));
    }
    Ok(out)
}

/// A sequence of layer classes chained ([`range_prices`]).
#[derive(Default)]
struct Chained {
    /// Its node.
    node: usize,
    /// Best entry per boundary state after the sequence's last layer, and per state the
    /// state of the parent's `best` its path comes from.
    chain: chain::Extension,
    /// Whether the last two layers are of one class and the chain is in its steady state:
    /// another layer of that class extends it along `chain.from`.
    steady: bool,
}

/// How many stages may follow a stage whose best plan is `e` (built with one micro-batch in
/// flight): it keeps `min(following + 1, B)` in flight under 1F1B. `None` when not even one
/// fits.
fn most_following(e: &Entry, opts: PipelineOptions, layers: usize) -> Option<i64> {
    if !(e.cost.is_finite() && e.memory <= opts.memory_budget) {
        return None;
    }
    let b = opts.microbatches.max(1);
    // No more than one stage per layer can follow.
    let unbounded = layers as i64;
    if e.activations <= 0.0 || e.memory_at(b, 1) <= opts.memory_budget {
        return Some(unbounded);
    }
    let inflight = ((opts.memory_budget - (e.memory - e.activations)) / e.activations).floor();
    Some(inflight as i64 - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logical_meshes_are_every_factorisation_in_order() {
        for devices in 1..=300u64 {
            let every: Vec<[u64; 2]> = (1..=devices)
                .filter(|a| devices % a == 0)
                .map(|a| [a, devices / a])
                .collect();
            assert_eq!(logical_meshes(devices), every, "{devices}");
        }
        // A submesh of the largest cluster: found without walking a million candidates.
        let big = logical_meshes(1 << 20);
        assert_eq!(big.len(), 21);
        assert_eq!(big.first(), Some(&[1, 1 << 20]));
        assert_eq!(big.last(), Some(&[1 << 20, 1]));
    }
}
