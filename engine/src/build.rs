//! `autopar build`: plan every target of the workspace (in parallel) and write the plans,
//! reusing every result whose inputs are unchanged.
//!
//! A target's plan is looked up under the key of its inputs as written (model without names,
//! cluster, training options, search space, profile measurements). On a miss, the layer costs
//! the search reads are looked up one by one under their own keys (identical blocks share one),
//! then the search result under a key of those costs: when a change (a profile entry no layer
//! reads, say) leaves every cost as it was, the stored search result is reused. Only what is
//! missing is solved.

use crate::cache::{Cache, Counts, Source, kind};
use crate::error::EngineError;
use crate::layer_costs::CachedCosts;
use crate::pipeline::{CachedTables, table_slot};
use crate::plans::{remove_output, write_plan, write_trace};
use crate::record::{
    BuildRecord, PlanRecord, StagesRecord, TableRecord, layer_reasons, plan_reasons, read_record,
    stages_reasons, table_reasons, write_record,
};
use crate::workspace::{Target, Workspace};
use autopar_rules::canonical::{Digest, KeyParts};
use autopar_rules::cost::cluster::GIB;
use autopar_rules::cost::layer_cost::{LayerCost, LayerCostContext, Pricing};
use autopar_rules::model::frontend::LowerOptions;
use autopar_rules::plan::estimate::{CostSource, Estimator};
use autopar_rules::plan::format::{Plan, PlanModel, SizeStep};
use autopar_rules::plan::ilp::{self, IlpCandidate, IlpPlan, Space};
use autopar_rules::plan::layout::LayoutError;
use autopar_rules::plan::search::{SearchResult, layer_cost_digest, search};
use autopar_rules::solve::pipeline::{
    DEFAULT_MAX_EXACT_ENTRIES, MAX_RANGE_PRICES, MAX_TABLES, PipelineError, PipelineOptions,
    decode_pipeline, price_pipeline_with, search_size, table_requests,
};
use autopar_rules::solve::schedule::{chrome_trace, simulate, trace_spec};
use autopar_store::EntryMeta;
use rayon::prelude::*;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How many layouts a plan lists: the chosen one and the runners-up.
pub const LAYOUTS_KEPT: usize = 6;

/// A target that got a plan.
#[derive(Debug, Clone)]
pub struct Planned {
    /// The plan.
    pub plan: Plan,
    /// Where it was written.
    pub path: PathBuf,
    /// Where the simulated timeline of its pipeline was written.
    pub trace: PathBuf,
}

/// What happened to one target.
#[derive(Debug, Clone)]
pub enum TargetResult {
    /// A layout fits; the plan was written.
    Planned(Box<Planned>),
    /// No layout can run or fits; the reason says which constraint failed.
    Infeasible {
        /// Why.
        reason: String,
    },
}

/// One target's outcome.
#[derive(Debug, Clone)]
pub struct TargetOutcome {
    /// Target name.
    pub name: String,
    /// Plan or reason.
    pub result: TargetResult,
    /// Layouts priced.
    pub layouts: usize,
    /// Where the plan came from.
    pub source: Source,
    /// Wall time of this target.
    pub elapsed: Duration,
}

/// Result of a build.
#[derive(Debug, Clone)]
pub struct BuildReport {
    /// One outcome per target built, in workspace order.
    pub outcomes: Vec<TargetOutcome>,
    /// Results asked for and where they came from.
    pub counts: Counts,
    /// The same per kind of result (`sharding`, `stages`, `layer-cost`, `search`, `plan`).
    pub kinds: std::collections::BTreeMap<&'static str, Counts>,
    /// Wall time of the build.
    pub elapsed: Duration,
}

impl BuildReport {
    /// Number of targets that got a plan.
    pub fn planned(&self) -> usize {
        self.outcomes
            .iter()
            .filter(|o| matches!(o.result, TargetResult::Planned(_)))
            .count()
    }
}

/// Progress events, for a progress bar or log lines.
#[derive(Debug, Clone, Copy)]
pub enum Progress<'a> {
    /// A build of this many targets starts.
    Begin(usize),
    /// One target is done.
    Done(&'a TargetOutcome),
}

/// Selects the targets named (all when `names` is empty), in workspace order.
pub fn select<'w>(ws: &'w Workspace, names: &[String]) -> Result<Vec<&'w Target>, EngineError> {
    for n in names {
        if ws.target(n).is_none() {
            return Err(EngineError::Unknown {
                what: "target",
                name: n.clone(),
                expected: format!(
                    "a target of {} ({})",
                    ws.file.display(),
                    ws.targets
                        .iter()
                        .map(|t| t.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            });
        }
    }
    Ok(ws
        .targets
        .iter()
        .filter(|t| names.is_empty() || names.contains(&t.name))
        .collect())
}

/// Peak resident memory of this process so far, bytes (Linux; `None` elsewhere).
pub fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The components of a target's key: what its plan depends on, as the workspace states it
/// (never names or file paths).
pub fn target_parts(ws: &Workspace, t: &Target) -> KeyParts {
    let model = &ws.models[t.model];
    let cluster = &ws.clusters[t.cluster];
    KeyParts::new("plan")
        .with("model", &model.def.canonical_json())
        .with(
            "cluster",
            &(
                cluster.nodes,
                cluster.gpus_per_node,
                &cluster.device,
                &cluster.network,
            ),
        )
        .with("training", &t.options)
        .with("search", &(&t.search, t.global_batch, LAYOUTS_KEPT))
        .with("ilp", &t.ilp)
        .with("profile", &profile_entries(t))
}

fn profile_entries(t: &Target) -> Vec<(autopar_rules::cost::profile::EntryId, f64)> {
    t.profile.as_ref().map(|p| p.entries()).unwrap_or_default()
}

/// The key of a search result: the target's components, with the layer costs the search reads
/// in place of the profile (which only matters through them).
fn search_parts(target: &KeyParts, layer_costs: Digest) -> KeyParts {
    let mut parts = KeyParts::new("search");
    for (name, d) in &target.parts {
        if name != "rules" && name != "profile" && name != "ilp" {
            parts = parts.with_digest(name, *d);
        }
    }
    parts.with_digest("layer costs", layer_costs)
}

/// Plans the selected targets in parallel through `cache` and writes their plans; stale plans
/// of targets that became infeasible are removed so no file describes a plan that no longer
/// holds. The cache is flushed before returning, so what the build solved survives it.
pub fn build(
    ws: &Workspace,
    names: &[String],
    cache: &Cache,
    progress: &(dyn Fn(Progress<'_>) + Sync),
) -> Result<BuildReport, EngineError> {
    let start = Instant::now();
    let targets = select(ws, names)?;
    cache.reset_counts();
    progress(Progress::Begin(targets.len()));
    let outcomes = targets
        .par_iter()
        .map(|t| {
            let outcome = plan_target(ws, t, cache)?;
            progress(Progress::Done(&outcome));
            Ok(outcome)
        })
        .collect::<Result<Vec<_>, EngineError>>();
    cache.flush();
    Ok(BuildReport {
        outcomes: outcomes?,
        counts: cache.counts(),
        kinds: cache.kind_counts(),
        elapsed: start.elapsed(),
    })
}

fn plan_target(ws: &Workspace, t: &Target, cache: &Cache) -> Result<TargetOutcome, EngineError> {
    let start = Instant::now();
    let model = &ws.models[t.model];
    let cluster = &ws.clusters[t.cluster];
    let span = tracing::info_span!("target", name = %t.name);
    let _enter = span.enter();
    let parts = target_parts(ws, t);
    let key = parts.key();
    let previous = read_record(&ws.root, &t.name);
    let costs = CachedCosts::new(cache, &model.name);
    let est = Estimator::new(&model.name, &model.def, cluster, t.options)
        .with_costs(&costs)
        .with_profile(t.profile.as_deref());
    let megatron = || match cache.lookup_indexed::<SearchResult>(kind::PLAN, key) {
        Some((found, source)) => (found, source, false),
        None => {
            let value =
                search_parts(&parts, layer_cost_digest(&est, &t.search, t.global_batch)).key();
            let found = match cache.lookup::<SearchResult>(kind::SEARCH, value) {
                Some((found, source)) => (found, source, true),
                None => {
                    let r = search(&est, &t.search, t.global_batch, LAYOUTS_KEPT);
                    let meta = EntryMeta {
                        kind: "search".into(),
                        description: format!(
                            "plan search of {} on {}",
                            model.name, cluster.device.name
                        ),
                        ..EntryMeta::default()
                    };
                    cache.put(value, &r, &meta);
                    cache.record(kind::SEARCH, Source::Solved);
                    tracing::info!(
                        candidates = r.candidates,
                        valid = r.valid,
                        feasible = r.feasible,
                        refined = r.refined,
                        "searched"
                    );
                    (r, Source::Solved, false)
                }
            };
            let meta = EntryMeta {
                kind: "plan-index".into(),
                description: format!("target {} -> its search result", t.name),
                ..EntryMeta::default()
            };
            cache.put(key, &value, &meta);
            found
        }
    };
    // The ILP space does not read the Megatron-LM search: the two run side by side.
    let ilp = || match t.ilp.space {
        Space::Megatron => IlpOutcome::default(),
        _ => ilp_search(ws, t, cache, &parts, est.capacity(), previous.as_ref()),
    };
    let ((mut result, source, reused_after_change), ilp) =
        rayon::join(|| span.in_scope(megatron), || span.in_scope(ilp));
    if let Some(names) = model.def.layer_names() {
        rename_layers(&mut result, &names);
    }
    let mut layers = costs.take_records();
    for l in &mut layers {
        if l.source == Source::Solved {
            let old = previous
                .as_ref()
                .and_then(|p| p.layers.iter().find(|o| o.slot == l.slot));
            l.reasons = layer_reasons(old, l);
        }
    }
    let mut plan_record = PlanRecord {
        parts,
        model: model.def.canonical_json(),
        profile: profile_entries(t),
        source,
        reused_after_change,
        reasons: Vec::new(),
    };
    if source == Source::Solved || reused_after_change {
        plan_record.reasons = plan_reasons(previous.as_ref().map(|p| &p.plan), &plan_record);
    }
    let path = ws.plan_path(&t.name);
    let trace = ws.trace_path(&t.name);
    let IlpOutcome {
        best,
        tried,
        not_searched,
        records: ilp_records,
        sizes,
    } = ilp;
    let planned = plan_from(ws, t, &est, &result).and_then(|mut plan| {
        if let Some(why) = not_searched {
            if t.ilp.space == Space::Ilp {
                return Err(why);
            }
            plan.spaces.ilp_not_searched = Some(why);
            return Ok(plan);
        }
        // Sizes that failed for the same reason are named together.
        let mut reasons: Vec<(Vec<String>, &str)> = Vec::new();
        for (mb, why) in &tried {
            match reasons.iter_mut().find(|(_, w)| *w == why.as_str()) {
                Some((sizes, _)) => sizes.push(mb.to_string()),
                None => reasons.push((vec![mb.to_string()], why)),
            }
        }
        let why_none = reasons
            .iter()
            .map(|(sizes, why)| {
                let s = if sizes.len() > 1 { "s" } else { "" };
                format!("micro-batch size{s} {}: {why}", sizes.join(", "))
            })
            .collect::<Vec<_>>()
            .join("; ");
        let searched = t.ilp.space != Space::Megatron;
        let no_plan =
            (searched && best.is_none()).then(|| format!("the ILP space has no plan: {why_none}"));
        // A size left out is said even when another size has a plan: never a silent cut.
        let left_out = (best.is_some() && !reasons.is_empty()).then(|| why_none.clone());
        match plan.with_ilp(&model.def, best, t.ilp.space) {
            Some(mut plan) => {
                plan.spaces.ilp_no_plan = no_plan;
                plan.spaces.ilp_sizes = sizes;
                plan.spaces.ilp_sizes_left_out = left_out;
                Ok(plan)
            }
            None => Err(format!(
                "the ILP space has no plan (`space = \"ilp\"`): {why_none}"
            )),
        }
    });
    let outcome = match planned {
        Ok(plan) => {
            write_outputs(&path, &trace, t, &plan)?;
            TargetResult::Planned(Box::new(Planned { plan, path, trace }))
        }
        Err(reason) => {
            remove_output(&path)?;
            remove_output(&trace)?;
            remove_output(&ws.report_path(&t.name))?;
            TargetResult::Infeasible { reason }
        }
    };
    let record = BuildRecord {
        target: t.name.clone(),
        time_ms: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64),
        plan: plan_record,
        layers,
        ilp: ilp_records,
    };
    if let Err(e) = write_record(&ws.root, &record, previous.as_ref()) {
        tracing::warn!(error = %e, "could not record the build for `explain`");
    }
    Ok(TargetOutcome {
        name: t.name.clone(),
        result: outcome,
        layouts: result.candidates,
        source,
        elapsed: start.elapsed(),
    })
}

/// What the ILP space found for a target.
#[derive(Debug, Clone, Default)]
struct IlpOutcome {
    /// The fastest pipeline over the micro-batch sizes.
    best: Option<IlpPlan>,
    /// Why each micro-batch size that gave no pipeline gave none.
    tried: Vec<(u64, String)>,
    /// Why the space was not searched at all.
    not_searched: Option<String>,
    /// What each stage DP did, for `explain`.
    records: Vec<StagesRecord>,
    /// The best step time at each size that has a pipeline.
    sizes: Vec<SizeStep>,
}

/// The per-device budget of the ILP space's stages: the runtime's reserve is not part of the
/// intra-op model's memory.
fn ilp_budget(ws: &Workspace, t: &Target, capacity: f64) -> f64 {
    capacity - ws.clusters[t.cluster].device.reserved_bytes
}

/// What every stage DP of a target reads, whatever its micro-batch size: the target's
/// components (`target`) but its search spaces. The profile stays: tables key exactly the
/// entries they may read, and the DP is cheap beside them.
fn stages_base(target: &KeyParts) -> KeyParts {
    let mut parts = KeyParts::new("stages");
    for (name, d) in &target.parts {
        if name != "rules" && name != "search" && name != "ilp" {
            parts = parts.with_digest(name, *d);
        }
    }
    parts
}

/// The components of the key of the stage DP at micro-batch size `mb`.
fn stages_parts(base: &KeyParts, t: &Target, mb: u64, budget: f64) -> KeyParts {
    base.clone()
        .with("batch", &(t.global_batch, mb))
        .with("submeshes", &t.ilp.powers_of_two)
        .with("logical_meshes", &t.ilp.logical_meshes)
        .with("recompute", &t.ilp.recompute)
        .with("solver", &t.ilp.solver)
        .with("budget", &budget.to_bits())
}

/// The stage DP's options at micro-batch size `mb`.
fn ilp_options(t: &Target, mb: u64, budget: f64) -> PipelineOptions<'_> {
    PipelineOptions {
        microbatches: t.global_batch / mb,
        memory_budget: budget,
        precision: t.options.precision,
        max_exact_entries: DEFAULT_MAX_EXACT_ENTRIES,
        max_table_work: autopar_rules::solve::intra::chain::MAX_TABLE_WORK,
        powers_of_two: t.ilp.powers_of_two,
        logical_meshes: &t.ilp.logical_meshes,
        recompute: t.ilp.recompute,
        grad_accumulation_fusion: t.options.grad_accumulation_fusion,
        grad_reduce_in_fp32: t.options.grad_reduce_in_fp32,
        fp32_loss: t.options.fp32_loss,
        tp_comm_overlap: t.options.tp_comm_overlap,
        profile: t.profile.as_deref(),
        solver: t.ilp.solver,
    }
}

/// The tables the previous build's DP at this size read, carried into this build's record
/// when the DP's result is found under the same key (its tables are not asked for again).
fn carried_tables(previous: Option<&BuildRecord>, rec: &StagesRecord) -> Vec<TableRecord> {
    previous
        .and_then(|p| p.stages(rec.micro_batch))
        .filter(|old| old.parts.key() == rec.parts.key())
        .map(|old| {
            old.tables
                .iter()
                .map(|t| TableRecord {
                    source: rec.source,
                    reasons: Vec::new(),
                    ..t.clone()
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Alpa's two levels for every micro-batch size of the target's ILP space, each through the
/// cache (kind `stages`) under the key of exactly what it reads; its layer tables are cached
/// apart (kind `sharding`) and shared with every other target and model. `target`: the
/// components of the target's key ([`target_parts`]).
fn ilp_search(
    ws: &Workspace,
    t: &Target,
    cache: &Cache,
    target: &KeyParts,
    capacity: f64,
    previous: Option<&BuildRecord>,
) -> IlpOutcome {
    let model = &ws.models[t.model];
    let cluster = &ws.clusters[t.cluster];
    let budget = ilp_budget(ws, t, capacity);
    let mut out = IlpOutcome::default();
    let base = stages_base(target);
    // Each size's stage DP found in the cache, or missing.
    let looked: Vec<(StagesRecord, Option<Result<IlpCandidate, String>>)> = t
        .ilp
        .micro_batch
        .iter()
        .map(|&mb| {
            let parts = stages_parts(&base, t, mb, budget);
            let mut rec = StagesRecord {
                micro_batch: mb,
                parts,
                source: Source::Solved,
                reasons: Vec::new(),
                tables: Vec::new(),
                past_work_bound: None,
            };
            let found = cache
                .lookup::<Result<IlpCandidate, String>>(kind::STAGES, rec.parts.key())
                .map(|(found, source)| {
                    rec.source = source;
                    rec.tables = carried_tables(previous, &rec);
                    found
                });
            (rec, found)
        })
        .collect();
    // Too large a search is left out, and the plan says so (never a silent cut); asked only
    // when something must be solved (a rebuild that finds every result lowers nothing).
    if looked.iter().any(|(_, found)| found.is_none())
        && let Some(why) = ilp_left_out(ws, t)
    {
        out.not_searched = Some(why);
        return out;
    }
    // The missing sizes are solved side by side (each stage DP runs on one thread).
    let results: Vec<(StagesRecord, Result<IlpCandidate, String>)> = looked
        .into_par_iter()
        .map(|(mut rec, found)| {
            if let Some(found) = found {
                return (rec, found);
            }
            let mb = rec.micro_batch;
            let source = CachedTables::new(cache, &model.name);
            let (solved, verdict) = ilp_candidate(ws, t, cache, &source, mb, budget);
            rec.past_work_bound = verdict;
            let meta = EntryMeta {
                kind: "stages".into(),
                description: format!(
                    "stage DP of {} on {}, micro-batch {mb}",
                    model.name, cluster.device.name
                ),
                ..EntryMeta::default()
            };
            cache.put(rec.parts.key(), &solved, &meta);
            cache.record(kind::STAGES, Source::Solved);
            rec.reasons = stages_reasons(previous, &rec);
            let old = previous.and_then(|p| p.stages(mb));
            rec.tables = source.into_records();
            for table in &mut rec.tables {
                if table.source == Source::Solved {
                    let was = old.and_then(|o| o.tables.iter().find(|w| w.slot == table.slot));
                    table.reasons = table_reasons(was, table);
                }
            }
            (rec, solved)
        })
        .collect();
    // The fastest size (the first of equals) is the only one decoded.
    let mut best: Option<(KeyParts, IlpCandidate)> = None;
    for (rec, found) in results {
        match found {
            Ok(c) => {
                out.sizes.push(SizeStep {
                    micro_batch: c.micro_batch,
                    step_time_s: c.step_time_s,
                });
                if best
                    .as_ref()
                    .is_none_or(|(_, b)| c.step_time_s < b.step_time_s)
                {
                    best = Some((rec.parts.clone(), c));
                }
            }
            Err(why) => out.tried.push((rec.micro_batch, why)),
        }
        out.records.push(rec);
    }
    if let Some((parts, c)) = best {
        let mb = c.micro_batch;
        match decoded(ws, t, cache, &parts, c, budget) {
            Ok(plan) => out.best = Some(plan),
            Err(why) => out.tried.push((mb, why)),
        }
    }
    out
}

/// The key of the decoded stages of the stage DP stored under `stages`.
fn decode_key(stages: &KeyParts) -> Digest {
    KeyParts::new("decode")
        .with_digest("stages", stages.key())
        .key()
}

/// The plan of the winning size's pipeline `c` (whose stage DP is stored under `stages`):
/// every stage decoded and compared with Megatron-LM's sharding, looked up first.
fn decoded(
    ws: &Workspace,
    t: &Target,
    cache: &Cache,
    stages: &KeyParts,
    c: IlpCandidate,
    budget: f64,
) -> Result<IlpPlan, String> {
    let key = decode_key(stages);
    let model = &ws.models[t.model];
    let cluster = &ws.clusters[t.cluster];
    let mb = c.micro_batch;
    let meta = || EntryMeta {
        kind: "decode".into(),
        description: format!(
            "stages of {} on {}, micro-batch {mb}, decoded",
            model.name, cluster.device.name
        ),
        ..EntryMeta::default()
    };
    let decode = || -> Result<IlpPlan, String> {
        let graph = ilp_lower(ws, t, mb)?;
        let opts = ilp_options(t, mb, budget);
        // The tables were read (and counted) when the size was priced.
        let source = CachedTables::uncounted(cache, &model.name);
        let started = Instant::now();
        let pipeline = decode_pipeline(&graph, cluster, opts, &source, c.pipeline)
            .map_err(|e| e.to_string())?;
        let decoded_s = started.elapsed().as_secs_f64();
        let plan = ilp::price(&graph, cluster, mb, opts, &pipeline).map_err(|e| e.to_string());
        tracing::debug!(
            micro_batch = mb,
            decode_s = decoded_s,
            compare_s = started.elapsed().as_secs_f64() - decoded_s,
            "decoded the ILP space's fastest pipeline"
        );
        plan
    };
    cache.get_or_solve(kind::DECODE, key, meta, decode).0
}

/// Why the target's ILP space is left out: a model it does not cover, or a search too large
/// to run (`None` when it is searched).
fn ilp_left_out(ws: &Workspace, t: &Target) -> Option<String> {
    let graph = ilp_lower(ws, t, 1).ok()?;
    if let Some(op) = graph.first_megatron_only_op() {
        return Some(format!(
            "the ILP space was not searched: the intra-op ILP does not model `{}` ({}) yet, \
             so mixture-of-experts and multi-head latent attention models are planned in the \
             Megatron-LM space",
            op.name,
            op.kind.name()
        ));
    }
    let (tables, ranges) = search_size(
        &graph,
        &ws.clusters[t.cluster],
        t.ilp.powers_of_two,
        &t.ilp.logical_meshes,
    );
    (tables > MAX_TABLES || ranges > MAX_RANGE_PRICES).then(|| {
        format!(
            "the ILP space was not searched: {tables} layer tables (at most {MAX_TABLES}) and \
             {ranges} range prices (at most {MAX_RANGE_PRICES}) per micro-batch size; use \
             `submeshes = \"powers-of-two\"` or `space = \"megatron\"`"
        )
    })
}

/// The ILP space's pipeline for micro-batches of `mb` sequences, priced and simulated; the
/// reason when there is none. With it, where the verdict that the size's layer tables pass
/// the work bound came from, when they do.
fn ilp_candidate(
    ws: &Workspace,
    t: &Target,
    cache: &Cache,
    source: &CachedTables<'_>,
    mb: u64,
    budget: f64,
) -> (Result<IlpCandidate, String>, Option<Source>) {
    let model = &ws.models[t.model];
    let cluster = &ws.clusters[t.cluster];
    let graph = match ilp_lower(ws, t, mb) {
        Ok(graph) => graph,
        Err(e) => return (Err(e), None),
    };
    let opts = ilp_options(t, mb, budget);
    // Whether the tables pass the work bound depends on them alone: once found, the verdict
    // is kept under their keys, and an edit that leaves them (a layer count) neither solves
    // nor reads one of them again.
    let work_key = table_work_key(&graph, cluster, opts);
    let too_much = PipelineError::TooMuchWork {
        max: opts.max_table_work,
    };
    if let Some((_, found)) = cache.lookup::<f64>(kind::TABLE_WORK, work_key) {
        return (Err(too_much.to_string()), Some(found));
    }
    let started = Instant::now();
    let priced = price_pipeline_with(&graph, cluster, opts, source);
    let past = matches!(priced, Err(PipelineError::TooMuchWork { .. }));
    if past {
        let meta = EntryMeta {
            kind: kind::TABLE_WORK.into(),
            description: format!(
                "layer tables of {} on {}, micro-batch {mb}: past the work bound",
                model.name, cluster.device.name
            ),
            ..EntryMeta::default()
        };
        cache.put(work_key, &opts.max_table_work, &meta);
        cache.record(kind::TABLE_WORK, Source::Solved);
    }
    let verdict = past.then_some(Source::Solved);
    let pipeline = match priced {
        Ok(pipeline) => pipeline,
        Err(e) => return (Err(e.to_string()), verdict),
    };
    tracing::debug!(
        micro_batch = mb,
        stages = pipeline.stages.len(),
        seconds = started.elapsed().as_secs_f64(),
        "priced the ILP space's pipeline"
    );
    let candidate = ilp::candidate(&graph, cluster, mb, opts, pipeline);
    (candidate.map_err(|e| e.to_string()), verdict)
}

/// The key of the verdict that the layer tables `graph`'s search reads at these options pass
/// the work bound: the keys of every one of them (each holds the bound).
fn table_work_key(
    graph: &autopar_rules::model::graph::Graph,
    cluster: &autopar_rules::cost::cluster::Cluster,
    opts: PipelineOptions,
) -> Digest {
    let mut tables: Vec<Digest> = table_requests(graph, cluster, opts)
        .iter()
        .map(|r| r.key.key())
        .collect();
    tables.sort_unstable();
    tables.dedup();
    KeyParts::new("table-work").with("tables", &tables).key()
}

/// The target's model lowered as the ILP space lowers it ([`ilp::lower_options`]), with
/// micro-batches of `mb` sequences.
fn ilp_lower(
    ws: &Workspace,
    t: &Target,
    mb: u64,
) -> Result<autopar_rules::model::graph::Graph, String> {
    let model = &ws.models[t.model];
    let cluster = &ws.clusters[t.cluster];
    let options = ilp::lower_options(
        &t.options,
        cluster.gpus_per_node,
        mb,
        t.options.precision.dtype(),
    );
    model
        .def
        .lower(&model.name, &options)
        .map_err(|e| e.to_string())
}

/// Writes the plan and its timeline, leaving files that already say the same untouched.
fn write_outputs(
    path: &std::path::Path,
    trace: &std::path::Path,
    t: &Target,
    plan: &Plan,
) -> Result<(), EngineError> {
    let mut json = serde_json::to_vec_pretty(plan).map_err(|e| EngineError::Encode {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    json.push(b'\n');
    let unchanged = std::fs::read(path).is_ok_and(|old| old == json) && trace.exists();
    if unchanged {
        // What a build killed while writing them left behind goes, even when they stay.
        autopar_store::remove_partials(path);
        autopar_store::remove_partials(trace);
        return Ok(());
    }
    write_plan(path, plan)?;
    // The estimate was simulated when refined, so this cannot fail.
    let spec = plan.estimate.pipeline_spec();
    let shown = trace_spec(&spec);
    let sim = simulate(&shown).map_err(|e| EngineError::Layout(LayoutError::Schedule(e)))?;
    let mut title = format!("{}: {}", t.name, plan.estimate.layout.describe());
    if shown.microbatches < spec.microbatches {
        title += &format!(
            " (a step of {} of its {} micro-batches: the others repeat the steady state)",
            shown.microbatches, spec.microbatches
        );
    }
    write_trace(trace, &chrome_trace(&sim, &title))
}

/// A graph file's layer names, which the stored result (keyed without names) may not carry.
fn rename_layers(result: &mut SearchResult, names: &[String]) {
    let name = |i: usize| names.get(i).cloned().unwrap_or_default();
    for e in result
        .ranked
        .iter_mut()
        .chain(result.least_memory.iter_mut())
    {
        for stage in &mut e.stages {
            for c in &mut stage.chunks {
                c.first_name = name(c.first);
                c.last_name = name(c.last);
            }
        }
    }
}

/// What a build would do for one target, found without solving anything.
#[derive(Debug, Clone)]
pub struct DryRun {
    /// Target name.
    pub name: String,
    /// The plan is stored under the target's key.
    pub plan_cached: bool,
    /// The search result would be reused (every layer cost it reads is unchanged).
    pub search_cached: bool,
    /// Distinct layer costs the search reads that are stored.
    pub layers_cached: usize,
    /// Distinct layer costs that would be solved.
    pub layers_to_solve: usize,
    /// Why the plan would be recomputed, from the last build's record.
    pub reasons: Vec<String>,
    /// The ILP space's stage DPs, one per micro-batch size (none for `space = "megatron"`).
    pub ilp: Vec<StagesDryRun>,
    /// Why the ILP space would not be searched at all.
    pub ilp_not_searched: Option<String>,
    /// Whether the fastest size's decoded stages are stored (`None`: none would be decoded).
    pub ilp_decode_cached: Option<bool>,
}

/// What a build would do for one micro-batch size of a target's ILP space.
#[derive(Debug, Clone)]
pub struct StagesDryRun {
    /// Sequences per micro-batch.
    pub micro_batch: u64,
    /// The stage DP's result is stored: nothing below would run.
    pub cached: bool,
    /// Why the DP would re-run, from the last build's record.
    pub reasons: Vec<String>,
    /// Layer tables the DP reads that are stored.
    pub tables_cached: usize,
    /// Layer tables that would be solved (intra-op ILP solves): slot, and why.
    pub tables_to_solve: Vec<(String, Vec<String>)>,
    /// The tables are known to need more work than a search may spend (the verdict is
    /// stored): the size would stop at once, no table read or solved.
    pub past_work_bound: bool,
}

/// A [`CostSource`] that only looks: stored costs are returned, missing ones are counted and
/// stand in as zeros (the search is never run on them).
struct Probe<'c> {
    cache: &'c Cache,
    seen: Mutex<std::collections::HashMap<Digest, bool>>,
}

impl CostSource for Probe<'_> {
    fn layer_costs(&self, ctx: &LayerCostContext<'_>, p: &Pricing<'_>) -> Vec<LayerCost> {
        (0..ctx.graph().layers.len())
            .map(|li| {
                let key = ctx.key_parts(li, p).key();
                let found: Option<LayerCost> = self.cache.peek(key);
                let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
                seen.insert(key, found.is_some());
                match found {
                    Some(mut c) => {
                        c.borrowed_params = ctx.borrowed(li, p.tp);
                        c
                    }
                    None => LayerCost::empty(ctx.graph().layers[li].kind),
                }
            })
            .collect()
    }
}

/// What `build` would solve for the selected targets, solving nothing and writing nothing.
pub fn dry_run(
    ws: &Workspace,
    names: &[String],
    cache: &Cache,
) -> Result<Vec<DryRun>, EngineError> {
    let targets = select(ws, names)?;
    Ok(targets
        .iter()
        .map(|t| {
            let model = &ws.models[t.model];
            let cluster = &ws.clusters[t.cluster];
            let parts = target_parts(ws, t);
            let previous = read_record(&ws.root, &t.name);
            let probe = Probe {
                cache,
                seen: Mutex::new(std::collections::HashMap::new()),
            };
            let est = Estimator::new(&model.name, &model.def, cluster, t.options)
                .with_costs(&probe)
                .with_profile(t.profile.as_deref());
            let (ilp, ilp_not_searched, ilp_decode_cached) =
                ilp_dry_run(ws, t, cache, &parts, est.capacity(), previous.as_ref());
            let plan_cached = cache
                .peek::<Digest>(parts.key())
                .is_some_and(|v| cache.contains(v));
            let mut out = DryRun {
                name: t.name.clone(),
                plan_cached,
                search_cached: plan_cached,
                layers_cached: 0,
                layers_to_solve: 0,
                reasons: Vec::new(),
                ilp,
                ilp_not_searched,
                ilp_decode_cached,
            };
            if plan_cached {
                return out;
            }
            let digest = layer_cost_digest(&est, &t.search, t.global_batch);
            let seen = probe.seen.into_inner().unwrap_or_else(|e| e.into_inner());
            out.layers_cached = seen.values().filter(|&&hit| hit).count();
            out.layers_to_solve = seen.len() - out.layers_cached;
            out.search_cached =
                out.layers_to_solve == 0 && cache.contains(search_parts(&parts, digest).key());
            out.reasons = plan_reasons(previous.as_ref().map(|p| &p.plan), &current(ws, t, parts));
            out
        })
        .collect())
}

/// What [`ilp_search`] would do for `t`, looking only: each stage DP that is not stored, with
/// the layer tables it would solve and why; why the space would not be searched; and whether
/// the fastest size's decoded stages are stored (`None`: nothing would be decoded).
fn ilp_dry_run(
    ws: &Workspace,
    t: &Target,
    cache: &Cache,
    target: &KeyParts,
    capacity: f64,
    previous: Option<&BuildRecord>,
) -> (Vec<StagesDryRun>, Option<String>, Option<bool>) {
    let mut out = Vec::new();
    if t.ilp.space == Space::Megatron {
        return (out, None, None);
    }
    let cluster = &ws.clusters[t.cluster];
    let budget = ilp_budget(ws, t, capacity);
    let base = stages_base(target);
    let mut too_large: Option<Option<String>> = None;
    for &mb in &t.ilp.micro_batch {
        let parts = stages_parts(&base, t, mb, budget);
        let mut dry = StagesDryRun {
            micro_batch: mb,
            cached: cache.contains(parts.key()),
            reasons: Vec::new(),
            tables_cached: 0,
            tables_to_solve: Vec::new(),
            past_work_bound: false,
        };
        if !dry.cached {
            if let Some(why) = too_large.get_or_insert_with(|| ilp_left_out(ws, t)) {
                return (out, Some(why.clone()), None);
            }
            let rec = StagesRecord {
                micro_batch: mb,
                parts,
                source: Source::Solved,
                reasons: Vec::new(),
                tables: Vec::new(),
                past_work_bound: None,
            };
            dry.reasons = stages_reasons(previous, &rec);
            // A model that does not lower has no tables; the build says why.
            if let Ok(graph) = ilp_lower(ws, t, mb) {
                let old = previous.and_then(|p| p.stages(mb));
                let opts = ilp_options(t, mb, budget);
                dry.past_work_bound = cache.contains(table_work_key(&graph, cluster, opts));
                let requests = match dry.past_work_bound {
                    true => Vec::new(),
                    false => table_requests(&graph, cluster, opts),
                };
                for r in requests {
                    if cache.contains(r.key.key()) {
                        dry.tables_cached += 1;
                        continue;
                    }
                    let table = TableRecord {
                        slot: table_slot(&graph, r.layer, r.mesh.logical),
                        parts: r.key,
                        reads: r.reads,
                        source: Source::Solved,
                        reasons: Vec::new(),
                        solver: None,
                    };
                    let was = old.and_then(|o| o.tables.iter().find(|w| w.slot == table.slot));
                    let reasons = table_reasons(was, &table);
                    dry.tables_to_solve.push((table.slot, reasons));
                }
            }
        }
        out.push(dry);
    }
    // A size's DP that re-runs is decoded under a new key when it wins; with every DP
    // stored, the fastest is known (the first of equals, as the build picks it).
    let decode_cached = match out.iter().all(|d| d.cached) {
        false => Some(false),
        true => {
            let mut best: Option<(f64, KeyParts)> = None;
            for &mb in &t.ilp.micro_batch {
                let parts = stages_parts(&base, t, mb, budget);
                if let Some(Ok(c)) = cache.peek::<Result<IlpCandidate, String>>(parts.key())
                    && best.as_ref().is_none_or(|(b, _)| c.step_time_s < *b)
                {
                    best = Some((c.step_time_s, parts));
                }
            }
            best.map(|(_, parts)| cache.contains(decode_key(&parts)))
        }
    };
    (out, None, decode_cached)
}

/// The record a build of `t` (whose key has `parts`) would keep for its plan, before it knows
/// where the plan comes from.
fn current(ws: &Workspace, t: &Target, parts: KeyParts) -> PlanRecord {
    PlanRecord {
        parts,
        model: ws.models[t.model].def.canonical_json(),
        profile: profile_entries(t),
        source: Source::Solved,
        reused_after_change: false,
        reasons: Vec::new(),
    }
}

/// Why the stored plan of `t` no longer matches the workspace (the model, cluster, training
/// options, search space, profiles or planning rules changed since the build that wrote it);
/// `None` when it matches, or when no build record says what it was built from.
pub fn stale(ws: &Workspace, t: &Target) -> Option<Vec<String>> {
    let previous = read_record(&ws.root, &t.name)?;
    let now = current(ws, t, target_parts(ws, t));
    (previous.plan.parts.key() != now.parts.key()).then(|| plan_reasons(Some(&previous.plan), &now))
}

fn plan_from(
    ws: &Workspace,
    t: &Target,
    est: &Estimator<'_>,
    result: &SearchResult,
) -> Result<Plan, String> {
    let model = &ws.models[t.model];
    let cluster = &ws.clusters[t.cluster];
    // The model as published: unpadded vocabulary, one sequence.
    let g = model
        .def
        .lower(
            &model.name,
            &LowerOptions {
                micro_batch: 1,
                seq: t.options.seq,
                dtype: t.options.precision.dtype(),
                attention: t.options.attention,
                vocab_multiple: 1,
                eager_elementwise: t.options.eager_elementwise,
                fp8: t.options.fp8,
            },
        )
        .map_err(|e| e.to_string())?;
    let plan_model = PlanModel {
        name: model.name.clone(),
        parameters: g.parameter_count(),
        blocks: g.block_layers().len() as u64,
    };
    if let Some(plan) =
        Plan::from_search(&t.name, plan_model, &model.def, cluster, t.options, result)
    {
        return Ok(plan);
    }
    Err(infeasibility(t, est, result))
}

/// Says which constraint failed when no layout is chosen.
fn infeasibility(t: &Target, est: &Estimator<'_>, r: &SearchResult) -> String {
    let c = est.cluster();
    if r.candidates == 0 {
        return format!(
            "the search space is empty: no allowed combination of tp {:?}, pp, dp and micro-batch \
             {:?} splits a global batch of {} over {} GPUs",
            t.search.tp,
            t.search.micro_batch,
            t.global_batch,
            c.gpus()
        );
    }
    if let Some(e) = &r.least_memory {
        let s = &e.stages[e.peak_memory_stage];
        let m = &s.memory;
        let headroom = est.options().memory_headroom;
        return format!(
            "no layout fits in memory: the smallest of the {} valid layouts ({}) needs {:.1} GiB \
             per device on stage {} (weights {:.1}, grads {:.1}, optimizer {:.1}, activations \
             {:.1}, workspace {:.1}), the {} has {:.1} GiB usable ({:.1} GiB less {:.0}% headroom)",
            r.valid,
            e.layout.describe(),
            m.total / GIB,
            s.index,
            m.weights / GIB,
            m.grads / GIB,
            m.optimizer / GIB,
            m.activations / GIB,
            m.workspace / GIB,
            c.device.name,
            e.memory_capacity / GIB,
            c.device.hbm_bytes / GIB,
            headroom * 100.0
        );
    }
    match &r.first_rejection {
        Some((layout, why)) => format!(
            "none of the {} candidate layouts can run; the first ({}) fails because {why}",
            r.candidates,
            layout.describe()
        ),
        None => format!("none of the {} candidate layouts can run", r.candidates),
    }
}
