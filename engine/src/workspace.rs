//! `workspace.toml`: the models, clusters and targets of a team, read and checked.

use crate::diagnostic::Diagnostic;
use crate::error::EngineError;
use autopar_rules::cost::cluster::{
    Cluster, DEVICE_FIELDS, Device, Network, cluster_preset_names, node_preset, preset,
};
use autopar_rules::cost::context_parallel::CpComm;
use autopar_rules::cost::memory::Precision;
use autopar_rules::cost::profile::{Profile, parse_profile};
use autopar_rules::limits;
use autopar_rules::model::frontend::{
    Attention, Bias, GRAPH_FORMAT, GraphSpec, Milli, Mlp, ModelDef, MoeConfig, MoeRouting, Norm,
    Position, TransformerConfig, UnknownKind, canonical_field_name, parse_graph_file,
    parse_hf_config,
};
use autopar_rules::plan::ilp::{IlpSearch, Space};
use autopar_rules::plan::layout::{BackwardPrefetch, Recompute, TrainingOptions};
use autopar_rules::plan::runtime::{GivenSettings, Runtime};
use autopar_rules::plan::search::SearchSpace;
use autopar_rules::solve::inter::submesh_choices;
use autopar_rules::solve::intra::stage::SolverChoice;
use serde::{Deserialize, Deserializer};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use toml::Spanned;

/// File name looked up in the current directory when no `--workspace` is given.
pub const DEFAULT_WORKSPACE: &str = "workspace.toml";

/// A model of the workspace.
#[derive(Clone, Debug)]
pub struct Model {
    /// Name used by targets.
    pub name: String,
    /// The architecture.
    pub def: ModelDef,
    /// Where it came from (a path, or `inline`), for reports.
    pub source: String,
}

/// A training target: a model on a cluster with a batch and what the search may use.
#[derive(Clone, Debug)]
pub struct Target {
    /// Name; the plan is written to `<plans>/<name>.json`.
    pub name: String,
    /// Index into [`Workspace::models`].
    pub model: usize,
    /// Index into [`Workspace::clusters`].
    pub cluster: usize,
    /// Sequences per optimizer step.
    pub global_batch: u64,
    /// Sequence length, precision, memory headroom and kernel options.
    pub options: TrainingOptions,
    /// Values each layout dimension may take.
    pub search: SearchSpace,
    /// What the intra-op (ILP) space searches, and which space the plan comes from.
    pub ilp: IlpSearch,
    /// Indices into [`Workspace::profiles`]: the cluster's, then the target's own.
    pub profiles: Vec<usize>,
    /// Their measurements overlaid in that order (later files win); `None` without profiles.
    pub profile: Option<Arc<Profile>>,
}

/// The `[cache]` table: where results are kept and shared. Command-line flags and
/// environment variables take precedence over it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CacheSettings {
    /// Local cache directory (resolved against the workspace directory).
    pub dir: Option<PathBuf>,
    /// Remote cache base URL.
    pub remote: Option<String>,
    /// `"rw"` or `"ro"`.
    pub remote_mode: Option<String>,
    /// File holding the remote cache's bearer token (resolved against the workspace directory).
    pub token_file: Option<PathBuf>,
    /// Remote read timeout, ms.
    pub timeout_ms: Option<u64>,
    /// Remote connect timeout, ms.
    pub connect_timeout_ms: Option<u64>,
    /// Instance prefix on the remote.
    pub instance: Option<String>,
    /// PEM file of the certificates to trust for an `https` remote (resolved against the
    /// workspace directory).
    pub ca_file: Option<PathBuf>,
}

/// A profile of the workspace: measured costs from a file.
#[derive(Clone, Debug)]
pub struct NamedProfile {
    /// Name clusters and targets refer to.
    pub name: String,
    /// The file.
    pub path: PathBuf,
    /// Its measurements.
    pub profile: Arc<Profile>,
}

/// A loaded, validated workspace.
#[derive(Clone, Debug)]
pub struct Workspace {
    /// The `workspace.toml` file.
    pub file: PathBuf,
    /// Directory of the file; relative paths in it are relative to this.
    pub root: PathBuf,
    /// Directory plans are written to.
    pub plans_dir: PathBuf,
    /// `[cache]` settings.
    pub cache: CacheSettings,
    /// Profiles in file order.
    pub profiles: Vec<NamedProfile>,
    /// Profiles each cluster uses (indices into `profiles`), by cluster index.
    pub cluster_profiles: Vec<Vec<usize>>,
    /// Every file the workspace was read from: the workspace file, model and profile files.
    pub inputs: Vec<PathBuf>,
    /// Models in file order.
    pub models: Vec<Model>,
    /// Clusters in file order.
    pub clusters: Vec<Cluster>,
    /// Targets in file order.
    pub targets: Vec<Target>,
}

impl Workspace {
    /// The model called `name`.
    pub fn model(&self, name: &str) -> Option<&Model> {
        self.models.iter().find(|m| m.name == name)
    }

    /// The model a stored plan trains, which the workspace must still declare.
    pub fn plan_model(
        &self,
        plan: &autopar_rules::plan::format::Plan,
    ) -> Result<&Model, EngineError> {
        self.model(&plan.model.name)
            .ok_or_else(|| EngineError::Unknown {
                what: "model",
                name: plan.model.name.clone(),
                expected: "the plan's model to be declared in the workspace".into(),
            })
    }

    /// The cluster called `name`.
    pub fn cluster(&self, name: &str) -> Option<&Cluster> {
        self.clusters.iter().find(|c| c.name == name)
    }

    /// The measurements of the cluster called `name` (its `profiles`, overlaid in order), with
    /// the profile names; `None` when it has none.
    pub fn cluster_profile(&self, name: &str) -> Option<(Vec<String>, Profile)> {
        let c = self.clusters.iter().position(|c| c.name == name)?;
        let used = &self.cluster_profiles[c];
        let names = used
            .iter()
            .map(|&i| self.profiles[i].name.clone())
            .collect();
        overlay(&self.profiles, used).map(|p| (names, p))
    }

    /// The target called `name`.
    pub fn target(&self, name: &str) -> Option<&Target> {
        self.targets.iter().find(|t| t.name == name)
    }

    /// Path of the plan file of target `name`.
    pub fn plan_path(&self, name: &str) -> PathBuf {
        self.plans_dir.join(format!("{name}.json"))
    }

    /// Where the simulated pipeline timeline of target `name` goes (Chrome trace JSON, for
    /// `chrome://tracing` or Perfetto).
    pub fn trace_path(&self, name: &str) -> PathBuf {
        self.plans_dir.join(format!("{name}.trace.json"))
    }

    /// Where the HTML report of target `name` goes (`autopar report`, `build --report`).
    pub fn report_path(&self, name: &str) -> PathBuf {
        self.plans_dir.join(format!("{name}.html"))
    }
}

/// A positive integer (zero and negatives are rejected with a clear message).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Positive(u64);

impl<'de> Deserialize<'de> for Positive {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Positive;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a positive integer")
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Positive, E> {
                if v > 0 {
                    Ok(Positive(v as u64))
                } else {
                    Err(E::invalid_value(serde::de::Unexpected::Signed(v), &self))
                }
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Positive, E> {
                if v > 0 {
                    Ok(Positive(v))
                } else {
                    Err(E::invalid_value(serde::de::Unexpected::Unsigned(v), &self))
                }
            }
        }
        d.deserialize_u64(V)
    }
}

/// A ZeRO stage, 0 to 3.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ZeroStage(u8);

impl<'de> Deserialize<'de> for ZeroStage {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = ZeroStage;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a ZeRO stage: 0, 1, 2 or 3")
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<ZeroStage, E> {
                if (0..=3).contains(&v) {
                    Ok(ZeroStage(v as u8))
                } else {
                    Err(E::invalid_value(serde::de::Unexpected::Signed(v), &self))
                }
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<ZeroStage, E> {
                self.visit_i64(v.min(i64::MAX as u64) as i64)
            }
        }
        d.deserialize_u64(V)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    #[serde(default)]
    workspace: Option<RawSettings>,
    #[serde(default)]
    model: Vec<Spanned<RawModel>>,
    #[serde(default)]
    cluster: Vec<Spanned<RawCluster>>,
    #[serde(default)]
    target: Vec<Spanned<RawTarget>>,
    #[serde(default)]
    profile: Vec<Spanned<RawProfile>>,
    #[serde(default)]
    cache: Option<RawCache>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCache {
    #[serde(default)]
    dir: Option<String>,
    #[serde(default)]
    remote: Option<Spanned<String>>,
    #[serde(default)]
    remote_mode: Option<Spanned<String>>,
    #[serde(default)]
    token_file: Option<String>,
    #[serde(default)]
    timeout_ms: Option<Positive>,
    #[serde(default)]
    connect_timeout_ms: Option<Positive>,
    #[serde(default)]
    instance: Option<Spanned<String>>,
    #[serde(default)]
    ca_file: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSettings {
    #[serde(default)]
    plans: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProfile {
    name: Spanned<String>,
    file: Spanned<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawModel {
    name: Spanned<String>,
    #[serde(default)]
    hf_config: Option<Spanned<String>>,
    #[serde(default)]
    graph: Option<Spanned<String>>,
    #[serde(default)]
    transformer: Option<Spanned<RawTransformer>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTransformer {
    hidden: Positive,
    layers: Positive,
    heads: Positive,
    #[serde(default)]
    kv_heads: Option<Positive>,
    #[serde(default)]
    head_dim: Option<Positive>,
    ffn_hidden: Positive,
    vocab: Positive,
    max_seq: Positive,
    #[serde(default)]
    mlp: Option<Mlp>,
    #[serde(default)]
    norm: Option<Norm>,
    #[serde(default)]
    position: Option<Position>,
    #[serde(default)]
    tied_embeddings: Option<bool>,
    #[serde(default)]
    bias: Option<Bias>,
    #[serde(default)]
    dropout: Option<bool>,
    /// Routed experts of every block from `dense_layers` on (a mixture-of-experts model).
    #[serde(default)]
    experts: Option<Positive>,
    /// Experts each token is routed to.
    #[serde(default)]
    top_k: Option<Positive>,
    /// Inner width of one routed expert (default `ffn_hidden`).
    #[serde(default)]
    expert_ffn: Option<Positive>,
    /// Inner width of the shared experts (default none).
    #[serde(default)]
    shared_ffn: Option<Positive>,
    /// Blocks that keep the dense MLP before the first MoE block (default 0).
    #[serde(default)]
    dense_layers: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCluster {
    name: Spanned<String>,
    preset: Spanned<String>,
    nodes: Spanned<Positive>,
    /// Required for a device preset; a node preset carries its own.
    #[serde(default)]
    gpus_per_node: Option<Spanned<Positive>>,
    /// Network adapters per node, replacing the preset's.
    #[serde(default)]
    nics_per_node: Option<Spanned<Positive>>,
    /// Line rate of one adapter in Gb/s, replacing the preset's.
    #[serde(default)]
    nic_gbits: Option<Spanned<f64>>,
    /// A file of device numbers `autopar calibrate` fitted, applied before `overrides`.
    #[serde(default)]
    calibration: Option<Spanned<String>>,
    /// Device numbers replacing the preset's, checked against [`DEVICE_FIELDS`].
    #[serde(default)]
    overrides: BTreeMap<String, Spanned<f64>>,
    #[serde(default)]
    profiles: Vec<Spanned<String>>,
}

/// A calibration file (`autopar calibrate -o FILE`).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCalibration {
    device: Spanned<String>,
    #[serde(default)]
    overrides: BTreeMap<String, Spanned<f64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTarget {
    name: Spanned<String>,
    model: Spanned<String>,
    cluster: Spanned<String>,
    global_batch: Spanned<Positive>,
    #[serde(default)]
    seq_len: Option<Spanned<Positive>>,
    #[serde(default)]
    precision: Option<Precision>,
    #[serde(default)]
    memory_headroom: Option<Spanned<f64>>,
    #[serde(default)]
    attention: Option<Attention>,
    #[serde(default)]
    moe_capacity_factor: Option<Spanned<f64>>,
    #[serde(default)]
    moe_load_imbalance: Option<Spanned<f64>>,
    #[serde(default)]
    grad_accumulation_fusion: Option<bool>,
    #[serde(default)]
    grad_reduce_in_fp32: Option<bool>,
    #[serde(default)]
    overlap_grad_reduce: Option<bool>,
    #[serde(default)]
    overlap_param_gather: Option<bool>,
    #[serde(default)]
    fp32_loss: Option<bool>,
    #[serde(default)]
    eager_elementwise: Option<bool>,
    #[serde(default)]
    fp8: Option<Spanned<bool>>,
    #[serde(default)]
    tp_comm_overlap: Option<bool>,
    #[serde(default)]
    backward_prefetch: Option<BackwardPrefetch>,
    #[serde(default)]
    runtime: Option<Runtime>,
    #[serde(default)]
    vocab_multiple: Option<Positive>,
    #[serde(default)]
    space: Option<Space>,
    #[serde(default)]
    solver: Option<TableSolverName>,
    #[serde(default)]
    search: Option<RawSearch>,
    #[serde(default)]
    profiles: Vec<Spanned<String>>,
}

/// `target.solver`: what fills the ILP space's layer tables.
#[derive(Clone, Copy, Deserialize)]
#[serde(rename_all = "lowercase")]
enum TableSolverName {
    /// The exact elimination; D-Rec for a layer too large for it.
    Auto,
    /// The exact elimination only.
    Exact,
    /// D-Rec for every layer.
    Drec,
}

impl TableSolverName {
    fn choice(self) -> SolverChoice {
        match self {
            TableSolverName::Auto => SolverChoice::Auto,
            TableSolverName::Exact => SolverChoice::Exact,
            TableSolverName::Drec => SolverChoice::Drec,
        }
    }
}

/// `target.search.submeshes`: which multi-node submeshes the stage DP may use.
#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "kebab-case")]
enum Submeshes {
    All,
    PowersOfTwo,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSearch {
    #[serde(default)]
    tp: Option<Spanned<Vec<Positive>>>,
    #[serde(default)]
    pp: Option<Spanned<Vec<Positive>>>,
    #[serde(default)]
    dp: Option<Spanned<Vec<Positive>>>,
    #[serde(default)]
    micro_batch: Option<Spanned<Vec<Positive>>>,
    #[serde(default)]
    interleave: Option<Spanned<Vec<Positive>>>,
    #[serde(default)]
    sequence_parallel: Option<Spanned<Vec<bool>>>,
    #[serde(default)]
    recompute: Option<Spanned<Vec<Recompute>>>,
    #[serde(default)]
    zero: Option<Spanned<Vec<ZeroStage>>>,
    #[serde(default)]
    cp: Option<Spanned<Vec<Positive>>>,
    #[serde(default)]
    cp_comm: Option<Spanned<Vec<CpComm>>>,
    #[serde(default)]
    ep: Option<Spanned<Vec<Positive>>>,
    #[serde(default)]
    etp: Option<Spanned<Vec<Positive>>>,
    #[serde(default)]
    ilp_micro_batch: Option<Spanned<Vec<Positive>>>,
    #[serde(default)]
    submeshes: Option<Submeshes>,
    #[serde(default)]
    logical_meshes: Option<Spanned<Vec<Spanned<String>>>>,
}

/// Default memory headroom: the PyTorch caching allocator fragments; keeping a tenth of the
/// device free is the usual margin for a plan that must not OOM.
pub const DEFAULT_MEMORY_HEADROOM: f64 = 0.1;

/// Megatron-LM's default `--make-vocab-size-divisible-by`.
pub const DEFAULT_VOCAB_MULTIPLE: u64 = 128;

/// Reads a file the workspace refers to.
pub type ReadFile<'a> = &'a dyn Fn(&Path) -> std::io::Result<String>;

struct Loader<'a> {
    file: &'a Path,
    text: &'a str,
    root: &'a Path,
    read: ReadFile<'a>,
    read_files: std::cell::RefCell<Vec<PathBuf>>,
}

impl Loader<'_> {
    fn diag(
        &self,
        offset: usize,
        field: &str,
        expected: impl Into<String>,
        found: impl Into<String>,
    ) -> EngineError {
        EngineError::config(Diagnostic::at(
            self.file,
            self.text,
            Some(offset),
            field,
            expected,
            found,
        ))
    }

    /// Offset of `key = ...` inside the span (an inline table), or the span's start.
    fn key_in(&self, span: std::ops::Range<usize>, key: &str) -> usize {
        let inner = self.text.get(span.clone()).unwrap_or("");
        let mut from = 0;
        while let Some(pos) = inner[from..].find(key) {
            let at = from + pos;
            let before_ok = at == 0
                || !inner.as_bytes()[at - 1].is_ascii_alphanumeric()
                    && inner.as_bytes()[at - 1] != b'_';
            let after = inner[at + key.len()..].trim_start();
            if before_ok && after.starts_with('=') {
                return span.start + at;
            }
            from = at + key.len();
        }
        span.start
    }

    fn model(&self, raw: &Spanned<RawModel>) -> Result<Model, EngineError> {
        let m = raw.get_ref();
        let name = m.name.get_ref().clone();
        let (def, source) = match (&m.hf_config, &m.graph, &m.transformer) {
            (Some(path), None, None) => (
                self.model_file(path, "model.hf_config", false)?,
                path.get_ref().clone(),
            ),
            (None, Some(path), None) => (
                self.model_file(path, "model.graph", true)?,
                path.get_ref().clone(),
            ),
            (None, None, Some(t)) => (
                ModelDef::Transformer(self.inline_transformer(t)?),
                "inline".to_string(),
            ),
            (a, b, c) => {
                let n = [a.is_some(), b.is_some(), c.is_some()]
                    .iter()
                    .filter(|&&x| x)
                    .count();
                return Err(self.diag(
                    raw.span().start,
                    "model",
                    "exactly one of hf_config, graph, transformer",
                    format!(
                        "{} in model `{name}`",
                        if n == 0 {
                            "none".to_string()
                        } else {
                            format!("{n} of them")
                        }
                    ),
                ));
            }
        };
        Ok(Model { name, def, source })
    }

    fn inline_transformer(
        &self,
        t: &Spanned<RawTransformer>,
    ) -> Result<TransformerConfig, EngineError> {
        let r = t.get_ref();
        let located = |e: autopar_rules::model::frontend::TransformerConfigError| {
            let key = canonical_field_name(e.field);
            self.diag(
                self.key_in(t.span(), key),
                &format!("model.transformer.{key}"),
                e.expected,
                e.found,
            )
        };
        let head_dim = match r.head_dim {
            Some(d) => d.0,
            None => TransformerConfig::default_head_dim(r.hidden.0, r.heads.0).map_err(located)?,
        };
        let config = TransformerConfig {
            hidden: r.hidden.0,
            layers: r.layers.0,
            heads: r.heads.0,
            kv_heads: r.kv_heads.map_or(r.heads.0, |k| k.0),
            head_dim,
            ffn_hidden: r.ffn_hidden.0,
            vocab: r.vocab.0,
            max_seq: r.max_seq.0,
            mlp: r.mlp.unwrap_or(Mlp::Gelu),
            norm: r.norm.unwrap_or(Norm::LayerNorm),
            position: r.position.unwrap_or(Position::Learned),
            tied_embeddings: r.tied_embeddings.unwrap_or(true),
            bias: r.bias.unwrap_or(Bias::All),
            dropout: r.dropout.unwrap_or(false),
            moe: None,
            mla: None,
            qk_norm: false,
        };
        let config = match (r.experts, r.top_k) {
            (None, None) => config,
            (Some(e), k) => TransformerConfig {
                moe: Some(MoeConfig {
                    experts: e.0,
                    top_k: k.map_or(1, |k| k.0),
                    expert_ffn: r.expert_ffn.map_or(r.ffn_hidden.0, |f| f.0),
                    shared_ffn: r.shared_ffn.map_or(0, |f| f.0),
                    dense_layers: r.dense_layers.unwrap_or(0),
                    router_bias: false,
                    routing: MoeRouting::default(),
                }),
                ..config
            },
            (None, Some(_)) => {
                return Err(self.diag(
                    self.key_in(t.span(), "top_k"),
                    "model.transformer.top_k",
                    "top_k only with experts (a mixture-of-experts model)",
                    "top_k without experts",
                ));
            }
        };
        config.validate().map_err(located)?;
        Ok(config)
    }

    fn model_file(
        &self,
        path: &Spanned<String>,
        field: &str,
        graph: bool,
    ) -> Result<ModelDef, EngineError> {
        let full = self.root.join(path.get_ref());
        self.read_files.borrow_mut().push(full.clone());
        let text = (self.read)(&full).map_err(|e| {
            self.diag(
                path.span().start,
                field,
                "a readable file (relative to the workspace)",
                format!("`{}` ({e})", path.get_ref()),
            )
        })?;
        parse_model_text(&full, &text, Some(graph))
    }

    fn profile(&self, raw: &Spanned<RawProfile>) -> Result<NamedProfile, EngineError> {
        let p = raw.get_ref();
        let full = self.root.join(p.file.get_ref());
        self.read_files.borrow_mut().push(full.clone());
        let text = (self.read)(&full).map_err(|e| {
            self.diag(
                p.file.span().start,
                "profile.file",
                "a readable profile file (relative to the workspace)",
                format!("`{}` ({e})", p.file.get_ref()),
            )
        })?;
        let profile = parse_profile(&text)
            .map_err(|e| EngineError::config(Diagnostic::from_field(&full, &text, e, "")))?;
        Ok(NamedProfile {
            name: p.name.get_ref().clone(),
            path: full,
            profile: Arc::new(profile),
        })
    }

    /// Resolves profile names of a cluster or target, checking each was measured on `device`.
    fn attach(
        &self,
        names: &[Spanned<String>],
        field: &str,
        profiles: &[NamedProfile],
        device: &str,
    ) -> Result<Vec<usize>, EngineError> {
        names
            .iter()
            .map(|n| {
                let i = profiles
                    .iter()
                    .position(|p| p.name == *n.get_ref())
                    .ok_or_else(|| {
                        self.diag(
                            n.span().start,
                            field,
                            if profiles.is_empty() {
                                "the name of a [[profile]] (none are declared)".to_string()
                            } else {
                                format!(
                                    "one of the [[profile]] names: {}",
                                    profiles
                                        .iter()
                                        .map(|p| p.name.as_str())
                                        .collect::<Vec<_>>()
                                        .join(", ")
                                )
                            },
                            format!("\"{}\"", n.get_ref()),
                        )
                    })?;
                if profiles[i].profile.device != device {
                    return Err(self.diag(
                        n.span().start,
                        field,
                        format!("a profile measured on {device}"),
                        format!(
                            "\"{}\", measured on {}",
                            n.get_ref(),
                            profiles[i].profile.device
                        ),
                    ));
                }
                Ok(i)
            })
            .collect()
    }

    fn cluster(&self, raw: &Spanned<RawCluster>) -> Result<Cluster, EngineError> {
        let c = raw.get_ref();
        let name = c.preset.get_ref();
        if preset(name).is_none() && node_preset(name).is_none() {
            return Err(self.diag(
                c.preset.span().start,
                "cluster.preset",
                format!("one of {}", cluster_preset_names()),
                format!("\"{name}\""),
            ));
        }
        if c.gpus_per_node.is_none() && node_preset(name).is_none() {
            return Err(self.diag(
                raw.span().start,
                "cluster.gpus_per_node",
                format!(
                    "a positive integer (`{name}` is a device preset; a node preset such as \
                     dgx-a100 carries its own)"
                ),
                "nothing".to_string(),
            ));
        }
        let mut cluster = Cluster::from_preset(
            c.name.get_ref(),
            name,
            c.nodes.get_ref().0,
            c.gpus_per_node.as_ref().map(|g| g.get_ref().0),
        )
        .map_err(|reason| {
            self.diag(
                c.nodes.span().start,
                "cluster.nodes",
                format!("at most {} GPUs in all", limits::MAX_GPUS),
                reason,
            )
        })?;
        if let Some(file) = &c.calibration {
            self.calibration(file, &mut cluster.device)?;
        }
        for (key, value) in &c.overrides {
            set_device_number(&mut cluster.device, key, *value.get_ref()).map_err(
                |(expected, found)| {
                    self.diag(
                        value.span().start,
                        &format!("cluster.overrides.{key}"),
                        expected,
                        found,
                    )
                },
            )?;
        }
        if let Some(n) = &c.nics_per_node {
            cluster.network.nics_per_node = n.get_ref().0;
        }
        if let Some(g) = &c.nic_gbits {
            let v = *g.get_ref();
            if !(v.is_finite() && v > 0.0) {
                return Err(self.diag(
                    g.span().start,
                    "cluster.nic_gbits",
                    "a positive line rate in Gb/s (e.g. 200 for HDR InfiniBand)".to_string(),
                    v.to_string(),
                ));
            }
            cluster.network.nic_bandwidth = v * Network::GBIT;
        }
        Ok(cluster)
    }

    /// Applies the calibration file `file` (relative to the workspace) to `device`, whose
    /// preset it must name.
    fn calibration(&self, file: &Spanned<String>, device: &mut Device) -> Result<(), EngineError> {
        let full = self.root.join(file.get_ref());
        self.read_files.borrow_mut().push(full.clone());
        let text = (self.read)(&full).map_err(|e| {
            self.diag(
                file.span().start,
                "cluster.calibration",
                "a readable calibration file (relative to the workspace)",
                format!("`{}` ({e})", file.get_ref()),
            )
        })?;
        let raw: RawCalibration = toml::from_str(&text)
            .map_err(|e| EngineError::config(Diagnostic::from_toml(&full, &text, &e)))?;
        let at = |offset: usize, field: &str, expected: String, found: String| {
            EngineError::config(Diagnostic::at(
                &full,
                &text,
                Some(offset),
                field,
                expected,
                found,
            ))
        };
        if *raw.device.get_ref() != device.name {
            return Err(at(
                raw.device.span().start,
                "device",
                format!("the cluster's device `{}`", device.name),
                format!("\"{}\"", raw.device.get_ref()),
            ));
        }
        for (key, value) in &raw.overrides {
            set_device_number(device, key, *value.get_ref()).map_err(|(expected, found)| {
                at(
                    value.span().start,
                    &format!("overrides.{key}"),
                    expected,
                    found,
                )
            })?;
        }
        Ok(())
    }

    fn target(
        &self,
        raw: &Spanned<RawTarget>,
        models: &[Model],
        clusters: &[Cluster],
        profiles: &[NamedProfile],
        cluster_profiles: &[Vec<usize>],
    ) -> Result<Target, EngineError> {
        let t = raw.get_ref();
        let find = |what: &str, name: &Spanned<String>, names: Vec<&str>| {
            names
                .iter()
                .position(|n| *n == name.get_ref())
                .ok_or_else(|| {
                    self.diag(
                        name.span().start,
                        &format!("target.{what}"),
                        if names.is_empty() {
                            format!("the name of a [[{what}]] (none are declared)")
                        } else {
                            format!("one of the [[{what}]] names: {}", names.join(", "))
                        },
                        format!("\"{}\"", name.get_ref()),
                    )
                })
        };
        let model = find(
            "model",
            &t.model,
            models.iter().map(|m| m.name.as_str()).collect(),
        )?;
        let cluster = find(
            "cluster",
            &t.cluster,
            clusters.iter().map(|c| c.name.as_str()).collect(),
        )?;
        let def = &models[model].def;
        let seq = match (&t.seq_len, def.max_seq()) {
            (Some(s), _) => s.get_ref().0,
            (None, Some(max)) => max,
            (None, None) => {
                return Err(self.diag(
                    raw.span().start,
                    "target.seq_len",
                    "a sequence length (the model does not declare max_seq)",
                    "nothing (the field is missing)",
                ));
            }
        };
        for (field, value, max) in [
            (
                "target.global_batch",
                Some(&t.global_batch),
                limits::MAX_BATCH,
            ),
            ("target.seq_len", t.seq_len.as_ref(), limits::MAX_SEQ),
        ] {
            if let Some(v) = value
                && v.get_ref().0 > max
            {
                return Err(self.diag(
                    v.span().start,
                    field,
                    format!("a positive integer up to {max}"),
                    v.get_ref().0.to_string(),
                ));
            }
        }
        let global_batch = t.global_batch.get_ref().0;
        if let (Some(max), Some(s)) = (def.max_seq(), &t.seq_len)
            && def.max_seq_is_hard()
            && seq > max
        {
            let what = match def {
                ModelDef::Transformer(_) => "the model's learned position table",
                ModelDef::Graph(_) => "the graph file's max_seq",
            };
            return Err(self.diag(
                s.span().start,
                "target.seq_len",
                format!("at most {max} ({what})"),
                seq.to_string(),
            ));
        }
        let headroom = match &t.memory_headroom {
            None => DEFAULT_MEMORY_HEADROOM,
            Some(h) if (0.0..1.0).contains(h.get_ref()) => *h.get_ref(),
            Some(h) => {
                return Err(self.diag(
                    h.span().start,
                    "target.memory_headroom",
                    "a fraction in [0, 1)",
                    h.get_ref().to_string(),
                ));
            }
        };
        let gpus_per_node = clusters[cluster].gpus_per_node;
        let experts = def.transformer().and_then(|c| c.moe).map(|m| m.experts);
        let mut search = match experts {
            Some(e) => SearchSpace::default_for_experts(gpus_per_node, clusters[cluster].gpus(), e),
            None => SearchSpace::default_for(gpus_per_node),
        };
        let moe_routing = self.moe_routing(t, experts.is_some())?;
        let mut ilp = IlpSearch::default_for(gpus_per_node, global_batch);
        if let Some(space) = t.space {
            ilp.space = space;
        }
        if let Some(solver) = t.solver {
            ilp.solver = solver.choice();
        }
        if let Some(s) = &t.search {
            self.search(s, &mut search)?;
            if let Some(v) = nonempty(self, &s.ilp_micro_batch, "ilp_micro_batch")? {
                let v: Vec<u64> = v.into_iter().map(|p| p.0).collect();
                if let (Some(&bad), Some(list)) = (
                    v.iter().find(|&&m| global_batch % m != 0),
                    &s.ilp_micro_batch,
                ) {
                    return Err(self.diag(
                        list.span().start,
                        "target.search.ilp_micro_batch",
                        format!("divisors of the global batch {global_batch}"),
                        bad.to_string(),
                    ));
                }
                ilp.micro_batch = v;
            }
            if let Some(m) = s.submeshes {
                ilp.powers_of_two = matches!(m, Submeshes::PowersOfTwo);
            }
            if let Some(list) = nonempty(self, &s.logical_meshes, "logical_meshes")? {
                // Each shape must lay out one of the cluster's submeshes (Alpa's shapes).
                let c = &clusters[cluster];
                let sizes: Vec<u64> = submesh_choices(c.nodes, c.gpus_per_node, ilp.powers_of_two)
                    .iter()
                    .map(|&(n, m)| n * m)
                    .collect();
                let expected = format!(
                    "logical mesh shapes `AxB` of a submesh of cluster `{}` (A x B one of {} \
                     devices, e.g. \"1x{}\")",
                    c.name,
                    sizes
                        .iter()
                        .map(u64::to_string)
                        .collect::<Vec<_>>()
                        .join(", "),
                    c.gpus_per_node
                );
                ilp.logical_meshes = list
                    .iter()
                    .map(|m| {
                        crate::sharding::parse_mesh(m.get_ref(), "logical_meshes")
                            .ok()
                            .filter(|(a, b)| sizes.contains(&(a * b)))
                            .map(|(a, b)| [a, b])
                            .ok_or_else(|| {
                                self.diag(
                                    m.span().start,
                                    "target.search.logical_meshes",
                                    expected.clone(),
                                    format!("\"{}\"", m.get_ref()),
                                )
                            })
                    })
                    .collect::<Result<_, _>>()?;
            }
            // The ILP space recomputes whole layers: Megatron-LM's full recomputation.
            ilp.recompute = search.recompute.contains(&Recompute::Full);
        }
        let mut used = cluster_profiles[cluster].clone();
        used.extend(self.attach(
            &t.profiles,
            "target.profiles",
            profiles,
            &clusters[cluster].device.name,
        )?);
        let profile = overlay(profiles, &used);
        // The runtime's defaults, where the target does not set a field itself.
        let runtime = t.runtime.unwrap_or_default();
        let mut options = runtime.options(
            seq,
            t.precision,
            t.attention,
            headroom,
            t.vocab_multiple.map_or(DEFAULT_VOCAB_MULTIPLE, |v| v.0),
            GivenSettings {
                grad_accumulation_fusion: t.grad_accumulation_fusion,
                grad_reduce_in_fp32: t.grad_reduce_in_fp32,
                overlap_grad_reduce: t.overlap_grad_reduce,
                overlap_param_gather: t.overlap_param_gather,
                fp32_loss: t.fp32_loss,
                eager_elementwise: t.eager_elementwise,
                fp8: t.fp8.as_ref().map(|f| *f.get_ref()),
                tp_comm_overlap: t.tp_comm_overlap,
                backward_prefetch: t.backward_prefetch,
            },
        );
        let device = &clusters[cluster].device;
        if let Some(f) = t.fp8.as_ref().filter(|f| *f.get_ref())
            && !device.has_fp8()
        {
            return Err(self.diag(
                f.span().start,
                "target.fp8",
                format!(
                    "a cluster whose GPUs have FP8 tensor cores (h100-sxm, h200), or \
                     `peak_fp8_tflops` in the cluster's overrides; `{}`'s {} have none",
                    clusters[cluster].name, device.name
                ),
                "true",
            ));
        }
        options.moe_routing = moe_routing;
        Ok(Target {
            name: t.name.get_ref().clone(),
            model,
            cluster,
            global_batch,
            profiles: used,
            profile: profile.map(Arc::new),
            options,
            search,
            ilp,
        })
    }

    /// `target.moe_capacity_factor` (tokens past it dropped) or `target.moe_load_imbalance`
    /// (dropless: the busiest expert's tokens over the mean), at most one, and only for a
    /// model with experts.
    fn moe_routing(&self, t: &RawTarget, moe: bool) -> Result<MoeRouting, EngineError> {
        let given = [
            ("moe_capacity_factor", &t.moe_capacity_factor, true),
            ("moe_load_imbalance", &t.moe_load_imbalance, false),
        ];
        let mut routing = MoeRouting::default();
        let mut seen: Option<&str> = None;
        for (key, value, drop_tokens) in given {
            let Some(v) = value else { continue };
            let field = format!("target.{key}");
            if !moe {
                return Err(self.diag(
                    v.span().start,
                    &field,
                    "no router setting: the model has no mixture-of-experts layers",
                    v.get_ref().to_string(),
                ));
            }
            if let Some(other) = seen {
                return Err(self.diag(
                    v.span().start,
                    &field,
                    format!("either {other} (tokens dropped) or {key} (dropless), not both"),
                    "both",
                ));
            }
            let x = *v.get_ref();
            let lowest = if drop_tokens { 0.0 } else { 1.0 };
            let factor = Milli::of(x).filter(|_| x >= lowest && x <= 100.0);
            let Some(factor) = factor else {
                return Err(self.diag(
                    v.span().start,
                    &field,
                    if drop_tokens {
                        "a capacity factor above 0 and at most 100"
                    } else {
                        "a ratio from 1 (a perfectly balanced router) to 100"
                    },
                    x.to_string(),
                ));
            };
            routing = MoeRouting {
                factor,
                drop_tokens,
            };
            seen = Some(key);
        }
        Ok(routing)
    }

    fn search(&self, s: &RawSearch, out: &mut SearchSpace) -> Result<(), EngineError> {
        let ints =
            |v: Option<Vec<Positive>>| v.map(|l| l.into_iter().map(|p| p.0).collect::<Vec<_>>());
        if let Some(v) = ints(nonempty(self, &s.tp, "tp")?) {
            out.tp = v;
        }
        if let Some(v) = ints(nonempty(self, &s.pp, "pp")?) {
            out.pp = Some(v);
        }
        if let Some(v) = ints(nonempty(self, &s.dp, "dp")?) {
            out.dp = Some(v);
        }
        if let Some(v) = ints(nonempty(self, &s.micro_batch, "micro_batch")?) {
            out.micro_batch = v;
        }
        if let Some(v) = ints(nonempty(self, &s.interleave, "interleave")?) {
            out.interleave = v;
        }
        if let Some(v) = nonempty(self, &s.sequence_parallel, "sequence_parallel")? {
            out.sequence_parallel = v;
        }
        if let Some(v) = nonempty(self, &s.recompute, "recompute")? {
            // The search and its plans speak Megatron-LM's kinds; torchtitan's op policy is
            // priced by `estimate`, `whatif` and `validate`.
            if let (true, Some(list)) = (v.contains(&Recompute::SelectiveOp), &s.recompute) {
                return Err(self.diag(
                    list.span().start,
                    "target.search.recompute",
                    "none, selective or full (the search plans Megatron-LM's recomputation; \
                     price torchtitan's `selective-op` with `estimate --recompute selective-op`)",
                    "\"selective-op\"",
                ));
            }
            out.recompute = v;
        }
        if let Some(v) = nonempty(self, &s.zero, "zero")? {
            out.zero = v.into_iter().map(|z| z.0).collect();
        }
        if let Some(v) = ints(nonempty(self, &s.cp, "cp")?) {
            out.cp = v;
        }
        if let Some(v) = nonempty(self, &s.cp_comm, "cp_comm")? {
            out.cp_comm = v;
        }
        if let Some(v) = ints(nonempty(self, &s.ep, "ep")?) {
            out.ep = v;
        }
        if let Some(v) = ints(nonempty(self, &s.etp, "etp")?) {
            out.etp = v;
        }
        Ok(())
    }
}

/// The list under `target.search.<key>`; an error for an empty one.
fn nonempty<T: Clone>(
    l: &Loader<'_>,
    v: &Option<Spanned<Vec<T>>>,
    key: &str,
) -> Result<Option<Vec<T>>, EngineError> {
    match v {
        None => Ok(None),
        Some(list) if list.get_ref().is_empty() => Err(l.diag(
            list.span().start,
            &format!("target.search.{key}"),
            "a list with at least one value",
            "an empty list",
        )),
        Some(list) => Ok(Some(list.get_ref().clone())),
    }
}

/// Parses a model file: an `autopar-graph/1` graph or a HuggingFace config. `graph` forces the
/// format; `None` detects it from the file's `format` field.
pub fn parse_model_text(
    path: &Path,
    text: &str,
    graph: Option<bool>,
) -> Result<ModelDef, EngineError> {
    let is_graph = graph.unwrap_or_else(|| {
        serde_json::from_str::<serde_json::Value>(text)
            .ok()
            .and_then(|v| {
                v.get("format")
                    .and_then(|f| f.as_str())
                    .map(|f| f == GRAPH_FORMAT)
            })
            .unwrap_or(false)
    });
    let result = if is_graph {
        parse_graph_file(text).map(|spec| {
            warn_unknown_kinds(path, text, &spec);
            ModelDef::Graph(spec)
        })
    } else {
        parse_hf_config(text).map(ModelDef::Transformer)
    };
    result.map_err(|e| EngineError::config(Diagnostic::from_field(path, text, e, "")))
}

/// Warns once per op kind of a graph file that autopar does not know, at its first op, with
/// how many ops have it.
fn warn_unknown_kinds(path: &Path, text: &str, spec: &GraphSpec) {
    let mut first: Vec<(&UnknownKind, usize)> = Vec::new();
    for u in spec.unknown_kinds() {
        match first.iter_mut().find(|(f, _)| f.kind == u.kind) {
            Some((_, n)) => *n += 1,
            None => first.push((u, 1)),
        }
    }
    for (u, n) in first {
        let at = Diagnostic::at(path, text, u.offset, &u.field, "", "");
        let place = match (at.line, at.column) {
            (Some(l), Some(c)) => format!("{}:{l}:{c}", path.display()),
            _ => path.display().to_string(),
        };
        let others = match n {
            1 => String::new(),
            n => format!(" ({} more ops of this kind)", n - 1),
        };
        tracing::warn!("{place}: field `{}`{others}: {}", u.field, u.describe());
    }
}

/// Whether `rel`, a path from the workspace file, names a place inside the workspace directory
/// `root`: relative, never climbing above it with `..`, and, where it already exists, not
/// leading out through a symbolic link.
fn within(root: &Path, rel: &Path) -> bool {
    use std::path::Component;
    let mut depth = 0i64;
    for c in rel.components() {
        match c {
            Component::Normal(_) => depth += 1,
            Component::CurDir => {}
            Component::ParentDir => depth -= 1,
            Component::RootDir | Component::Prefix(_) => return false,
        }
        if depth < 0 {
            return false;
        }
    }
    let base = if root.as_os_str().is_empty() {
        Path::new(".")
    } else {
        root
    };
    // The deepest part of the path that exists decides where the rest will be created.
    let target = base.join(rel);
    let Some(existing) = target.ancestors().find(|a| a.exists()) else {
        return true;
    };
    match (base.canonicalize(), existing.canonicalize()) {
        (Ok(b), Ok(p)) => p.starts_with(b),
        _ => false,
    }
}

/// A target name becomes a file name: keep it to letters, digits, `.`, `_` and `-`.
fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

/// Sets the device number `key` (an override key, in its user units) to `v`; or what was
/// expected and what was found.
fn set_device_number(device: &mut Device, key: &str, v: f64) -> Result<(), (String, String)> {
    let Some(field) = DEVICE_FIELDS.iter().find(|f| f.key == key) else {
        let known: Vec<&str> = DEVICE_FIELDS.iter().map(|f| f.key).collect();
        let expected = if key == "internode_gbps" {
            // The key of earlier versions: the network is now the node's.
            "the cluster's `nics_per_node` and `nic_gbits` (adapters per node and Gb/s each) in \
             place of a per-GPU network bandwidth"
                .to_string()
        } else {
            format!("one of {}", known.join(", "))
        };
        return Err((expected, format!("unknown field `{key}`")));
    };
    if !field.domain.contains(v) {
        return Err((field.domain.expected(field.unit), v.to_string()));
    }
    *(field.field)(device) = v * field.scale;
    Ok(())
}

/// `profiles[used]` overlaid in order (later files win); `None` when `used` is empty.
fn overlay(profiles: &[NamedProfile], used: &[usize]) -> Option<Profile> {
    used.iter().fold(None, |acc, &i| {
        Some(match acc {
            None => (*profiles[i].profile).clone(),
            Some(a) => a.overlaid(&profiles[i].profile),
        })
    })
}

/// Reads and validates the workspace file at `path`.
pub fn load(path: &Path) -> Result<Workspace, EngineError> {
    let text = crate::input::read_text(path)?;
    load_str(path, &text)
}

/// Validates workspace text as if read from `path`, reading the files it refers to from disk.
pub fn load_str(path: &Path, text: &str) -> Result<Workspace, EngineError> {
    load_with(path, text, &crate::input::read_capped)
}

/// Validates workspace text as if read from `path`, reading the files it refers to with
/// `read` (so an incremental database can track them).
pub fn load_with(path: &Path, text: &str, read: ReadFile<'_>) -> Result<Workspace, EngineError> {
    let raw: RawFile = toml::from_str(text)
        .map_err(|e| EngineError::config(Diagnostic::from_toml(path, text, &e)))?;
    // A bare file name has an empty parent: paths relative to it stay relative.
    let root = path.parent().map_or_else(PathBuf::new, Path::to_path_buf);
    let l = Loader {
        file: path,
        text,
        root: &root,
        read,
        read_files: std::cell::RefCell::new(vec![path.to_path_buf()]),
    };
    // Names: non-empty, unique per kind; target names must be usable as file names.
    for (kind, names) in [
        (
            "model",
            raw.model
                .iter()
                .map(|m| &m.get_ref().name)
                .collect::<Vec<_>>(),
        ),
        (
            "cluster",
            raw.cluster.iter().map(|c| &c.get_ref().name).collect(),
        ),
        (
            "target",
            raw.target.iter().map(|t| &t.get_ref().name).collect(),
        ),
        (
            "profile",
            raw.profile.iter().map(|p| &p.get_ref().name).collect(),
        ),
    ] {
        for (i, n) in names.iter().enumerate() {
            if !valid_name(n.get_ref()) {
                return Err(l.diag(
                    n.span().start,
                    &format!("{kind}.name"),
                    "a name of letters, digits, '.', '_' or '-'",
                    format!("\"{}\"", n.get_ref()),
                ));
            }
            if names[..i].iter().any(|m| m.get_ref() == n.get_ref()) {
                return Err(l.diag(
                    n.span().start,
                    &format!("{kind}.name"),
                    format!("a name not used by another [[{kind}]]"),
                    format!("\"{}\" again", n.get_ref()),
                ));
            }
        }
    }
    let models = raw
        .model
        .iter()
        .map(|m| l.model(m))
        .collect::<Result<Vec<_>, _>>()?;
    let clusters = raw
        .cluster
        .iter()
        .map(|c| l.cluster(c))
        .collect::<Result<Vec<_>, _>>()?;
    let profiles = raw
        .profile
        .iter()
        .map(|p| l.profile(p))
        .collect::<Result<Vec<_>, _>>()?;
    let cluster_profiles = raw
        .cluster
        .iter()
        .zip(&clusters)
        .map(|(raw, c)| {
            l.attach(
                &raw.get_ref().profiles,
                "cluster.profiles",
                &profiles,
                &c.device.name,
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    let targets = raw
        .target
        .iter()
        .map(|t| l.target(t, &models, &clusters, &profiles, &cluster_profiles))
        .collect::<Result<Vec<_>, _>>()?;
    let settings = raw.workspace.unwrap_or(RawSettings { plans: None });
    let plans = match settings.plans {
        None => "plans".to_string(),
        Some(p) if within(&root, Path::new(p.get_ref())) => p.into_inner(),
        Some(p) => {
            return Err(l.diag(
                p.span().start,
                "workspace.plans",
                "a directory inside the workspace (a relative path without `..` leading out; \
                 `--plans-dir` on the command line may name any directory)",
                format!("\"{}\"", p.get_ref()),
            ));
        }
    };
    let cache = match raw.cache {
        None => CacheSettings::default(),
        Some(c) => {
            if let Some(m) = &c.remote_mode
                && !matches!(m.get_ref().as_str(), "rw" | "ro")
            {
                return Err(l.diag(
                    m.span().start,
                    "cache.remote_mode",
                    "\"rw\" or \"ro\"",
                    format!("\"{}\"", m.get_ref()),
                ));
            }
            if let Some(u) = &c.remote
                && !(u.get_ref().starts_with("http://") || u.get_ref().starts_with("https://"))
            {
                return Err(l.diag(
                    u.span().start,
                    "cache.remote",
                    "an http:// or https:// URL",
                    format!("\"{}\"", u.get_ref()),
                ));
            }
            if let Some(i) = &c.instance
                && !valid_name(i.get_ref())
            {
                return Err(l.diag(
                    i.span().start,
                    "cache.instance",
                    "a name of letters, digits, '.', '_' or '-'",
                    format!("\"{}\"", i.get_ref()),
                ));
            }
            CacheSettings {
                dir: c.dir.map(|d| root.join(d)),
                remote: c.remote.map(|u| u.into_inner()),
                remote_mode: c.remote_mode.map(|m| m.into_inner()),
                token_file: c.token_file.map(|f| root.join(f)),
                timeout_ms: c.timeout_ms.map(|t| t.0),
                connect_timeout_ms: c.connect_timeout_ms.map(|t| t.0),
                instance: c.instance.map(|i| i.into_inner()),
                ca_file: c.ca_file.map(|f| root.join(f)),
            }
        }
    };
    let inputs = l.read_files.into_inner();
    Ok(Workspace {
        file: path.to_path_buf(),
        plans_dir: root.join(plans),
        cache,
        root,
        models,
        clusters,
        targets,
        profiles,
        cluster_profiles,
        inputs,
    })
}
