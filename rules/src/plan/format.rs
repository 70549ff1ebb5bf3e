//! The plan a build writes for a target (`plans/<target>.json`), and the Megatron-LM arguments
//! that realise it.

use crate::cost::cluster::{Cluster, GIB};
use crate::cost::context_parallel::{CpComm, hierarchical_inner};
use crate::cost::memory::Precision;
use crate::model::frontend::{Bias, Mlp, ModelDef, MoeConfig, MoeRouting, Norm, Position};
use crate::plan::estimate::{ChunkLayers, Estimate};
use crate::plan::ilp::{IlpPlan, Space, megatron_recompute, stage_blocks};
use crate::plan::layout::{Layout, Recompute, TrainingOptions};
use crate::plan::partition::Attempt;
use crate::plan::search::{SearchResult, WithoutCp};
use serde::{Deserialize, Serialize};

/// Version of the plan file layout.
pub const PLAN_SCHEMA: u32 = 3;

/// The model a plan is for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanModel {
    /// Workspace name of the model.
    pub name: String,
    /// Trained parameters (unpadded vocabulary).
    pub parameters: u64,
    /// Repeated blocks.
    pub blocks: u64,
}

/// A runner-up layout, for comparison.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Alternative {
    /// The layout.
    pub layout: Layout,
    /// Predicted step time, s.
    pub step_time_s: f64,
    /// Model FLOPs utilisation.
    pub mfu: f64,
    /// Peak memory per device, GiB.
    pub memory_per_device_gib: f64,
}

/// `x` rounded to four significant digits (a figure for a picture, not for arithmetic).
fn four_digits(x: f64) -> f64 {
    if x == 0.0 || !x.is_finite() {
        return x;
    }
    let scale = 10f64.powi(3 - x.abs().log10().floor() as i32);
    (x * scale).round() / scale
}

/// The best layout without context parallelism, when the target's space has it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WithoutCpBest {
    /// The fastest that fits (`None`: none fits).
    pub best: Option<Alternative>,
    /// When none fits: the memory per device the leanest needs, GiB.
    pub least_memory_gib: Option<f64>,
    /// Memory a device has for the plan, GiB.
    pub usable_gib: f64,
}

impl WithoutCpBest {
    fn of(w: &WithoutCp) -> WithoutCpBest {
        let least = w.least_memory.as_ref();
        WithoutCpBest {
            best: w.best.as_ref().map(Alternative::of),
            least_memory_gib: least.map(|e| e.memory.total / GIB),
            usable_gib: w
                .best
                .as_ref()
                .or(least)
                .map_or(0.0, |e| e.memory_capacity / GIB),
        }
    }
}

impl Alternative {
    fn of(e: &Estimate) -> Alternative {
        Alternative {
            layout: e.layout,
            step_time_s: e.step_time_s,
            mfu: e.mfu,
            memory_per_device_gib: e.memory.total / GIB,
        }
    }
}

/// How much of the space the search covered.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SearchStats {
    /// Layouts generated.
    pub candidates: usize,
    /// Layouts that can run.
    pub valid: usize,
    /// Valid layouts that fit in memory with their layers split evenly.
    pub feasible: usize,
    /// Layouts whose split was refined (DP, balancing, simulation).
    pub refined: usize,
    /// Whether refinement stopped at its cap rather than at its bound.
    pub refine_capped: bool,
}

/// A space's best plan, for comparison.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SpaceBest {
    /// Predicted step time, s.
    pub step_time_s: f64,
    /// Model FLOPs utilisation.
    pub mfu: f64,
    /// Peak memory per device, GiB.
    pub memory_per_device_gib: f64,
    /// The plan in one line.
    pub summary: String,
}

/// Each space's best plan (`None`: not searched, or nothing fits there).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Spaces {
    /// Megatron-LM's layouts.
    pub megatron: Option<SpaceBest>,
    /// The intra-op ILP with Alpa's stage DP.
    pub ilp: Option<SpaceBest>,
    /// Why the ILP space was not searched, when it was too large to search.
    pub ilp_not_searched: Option<String>,
    /// Why the ILP space, searched, has no plan (per micro-batch size).
    #[serde(default)]
    pub ilp_no_plan: Option<String>,
    /// The ILP space's best step time at each micro-batch size that has a pipeline (only the
    /// fastest is decoded into `ilp`).
    #[serde(default)]
    pub ilp_sizes: Vec<SizeStep>,
    /// The micro-batch sizes without a pipeline, with each one's reason, when other sizes
    /// have one (`ilp_no_plan` says it when none has).
    #[serde(default)]
    pub ilp_sizes_left_out: Option<String>,
}

/// The ILP space's best pipeline at one micro-batch size.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SizeStep {
    /// Sequences per micro-batch.
    pub micro_batch: u64,
    /// Predicted step time, s.
    pub step_time_s: f64,
}

/// A parallel-training plan for one target.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// [`PLAN_SCHEMA`].
    pub schema: u32,
    /// [`crate::RULES_VERSION`] of the rules that made the plan.
    pub rules_version: String,
    /// Target name.
    pub target: String,
    /// The model.
    pub model: PlanModel,
    /// The cluster, with every device number the plan was priced with.
    pub cluster: Cluster,
    /// Training options.
    pub training: TrainingOptions,
    /// The space the plan comes from: `megatron` (the layout in `estimate`) or `ilp` (the
    /// pipeline in `ilp`), whichever is faster among those searched.
    pub space: Space,
    /// Each space's best.
    pub spaces: Spaces,
    /// Whether Megatron-LM can run the chosen plan (`megatron_args` realise it); when the
    /// ILP plan wins and Megatron-LM cannot, `megatron_args` run the best Megatron-LM layout
    /// and `ilp.not_megatron` says why the plan itself is out of its reach.
    pub megatron_expressible: bool,
    /// The best Megatron-LM layout, priced (the plan itself when `space` is `megatron`).
    pub estimate: Estimate,
    /// The ILP space's best pipeline: per stage its submesh, logical mesh and every op's
    /// specs, with the differences from Megatron-LM's sharding.
    pub ilp: Option<IlpPlan>,
    /// The next best layouts.
    pub alternatives: Vec<Alternative>,
    /// When the search had context-parallel degrees: its best without context parallelism.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub without_cp: Option<WithoutCpBest>,
    /// Every layout the search could run, as screened: `[step time s, memory per device GiB]`
    /// to four significant digits (the report's scatter of the space).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub searched: Vec<[f64; 2]>,
    /// Search coverage.
    pub search: SearchStats,
    /// How each way of splitting the layers did for the chosen layout.
    pub partitions: Vec<Attempt>,
    /// Megatron-LM `pretrain_gpt.py` arguments realising the chosen plan: the ILP pipeline
    /// when it won and Megatron-LM can express it, else the best Megatron-LM layout.
    pub megatron_args: Vec<String>,
    /// A launch line with the process layout.
    pub launch: String,
}

impl Plan {
    /// Builds the plan from a search whose best layout exists.
    pub fn from_search(
        target: &str,
        model: PlanModel,
        def: &ModelDef,
        cluster: &Cluster,
        training: TrainingOptions,
        result: &SearchResult,
    ) -> Option<Plan> {
        let best = result.best()?.clone();
        let args = megatron_args(def, &best, &training, cluster.gpus_per_node);
        let launch = launch_line(cluster, &args);
        Some(Plan {
            schema: PLAN_SCHEMA,
            rules_version: crate::RULES_VERSION.to_string(),
            target: target.to_string(),
            model,
            cluster: cluster.clone(),
            training,
            space: Space::Megatron,
            spaces: Spaces {
                megatron: Some(SpaceBest {
                    step_time_s: best.step_time_s,
                    mfu: best.mfu,
                    memory_per_device_gib: best.memory_per_device_gib,
                    summary: best.layout.describe(),
                }),
                ilp: None,
                ilp_not_searched: None,
                ilp_no_plan: None,
                ilp_sizes: Vec::new(),
                ilp_sizes_left_out: None,
            },
            megatron_expressible: true,
            ilp: None,
            alternatives: result.ranked.iter().skip(1).map(Alternative::of).collect(),
            without_cp: result.without_cp.as_ref().map(WithoutCpBest::of),
            searched: result.points.iter().map(|p| p.map(four_digits)).collect(),
            search: SearchStats {
                candidates: result.candidates,
                valid: result.valid,
                feasible: result.feasible,
                refined: result.refined,
                refine_capped: result.refine_capped,
            },
            partitions: result.best_attempts.clone(),
            estimate: best,
            megatron_args: args,
            launch,
        })
    }
}

impl Plan {
    /// The plan with the ILP space's best recorded (`None`: searched and nothing fits) and
    /// the winner chosen among the spaces `space` allows: the faster, Megatron-LM's on a tie.
    /// `None` when `space` is `ilp` and the ILP space has no plan.
    pub fn with_ilp(mut self, def: &ModelDef, ilp: Option<IlpPlan>, space: Space) -> Option<Plan> {
        let gpus = self.cluster.gpus() as f64;
        let peak = match self.training.precision {
            Precision::Fp32 => self.cluster.device.peak_fp32_flops,
            _ => self.cluster.device.peak_bf16_flops,
        };
        self.spaces.ilp = ilp.as_ref().map(|p| SpaceBest {
            step_time_s: p.step_time_s,
            mfu: self.estimate.model_flops_per_step / p.step_time_s / gpus / peak,
            memory_per_device_gib: p.memory_per_device_gib,
            summary: p.describe(),
        });
        let ilp_wins = match (space, &ilp) {
            (Space::Megatron, _) | (Space::Both, None) => false,
            (Space::Ilp, None) => return None,
            (Space::Ilp, Some(_)) => true,
            (Space::Both, Some(p)) => p.step_time_s < self.estimate.step_time_s,
        };
        if ilp_wins {
            self.space = Space::Ilp;
            let args = ilp.as_ref().and_then(|p| {
                ilp_megatron_args(
                    def,
                    p,
                    self.estimate.layout.global_batch,
                    &self.training,
                    self.cluster.gpus_per_node,
                )
            });
            self.megatron_expressible = args.is_some();
            // Megatron-LM runs the plan itself when it can.
            if let Some(args) = args {
                self.launch = launch_line(&self.cluster, &args);
                self.megatron_args = args;
            }
        }
        self.ilp = ilp;
        Some(self)
    }

    /// The layout the plan's `megatron_args` launch: the ILP pipeline when it won and
    /// Megatron-LM can express it, else the best Megatron-LM layout.
    pub fn launch_layout(&self) -> LaunchLayout {
        let ilp = match (&self.space, &self.ilp) {
            (Space::Ilp, Some(p)) if self.megatron_expressible => {
                LaunchLayout::of_ilp(p, self.estimate.layout.global_batch)
            }
            _ => None,
        };
        ilp.unwrap_or_else(|| LaunchLayout::of_estimate(&self.estimate))
    }

    /// Predicted step time of the chosen plan, s.
    pub fn step_time_s(&self) -> f64 {
        match (&self.space, &self.ilp) {
            (Space::Ilp, Some(p)) => p.step_time_s,
            _ => self.estimate.step_time_s,
        }
    }

    /// Peak memory per device of the chosen plan, GiB.
    pub fn memory_per_device_gib(&self) -> f64 {
        match (&self.space, &self.ilp) {
            (Space::Ilp, Some(p)) => p.memory_per_device_gib,
            _ => self.estimate.memory_per_device_gib,
        }
    }

    /// Model FLOPs utilisation of the chosen plan (as [`Plan::with_ilp`] recorded it for the
    /// ILP space).
    pub fn mfu(&self) -> f64 {
        match (&self.space, &self.spaces.ilp) {
            (Space::Ilp, Some(b)) => b.mfu,
            _ => self.estimate.mfu,
        }
    }

    /// Whether the chosen plan fits: an ILP pipeline's stages all met their memory condition.
    pub fn fits(&self) -> bool {
        self.space == Space::Ilp || self.estimate.fits
    }

    /// Tokens per second of the chosen plan (the same tokens per step in both spaces).
    pub fn tokens_per_s(&self) -> f64 {
        self.estimate.tokens_per_s * self.estimate.step_time_s / self.step_time_s()
    }
}

/// The launch line of Megatron-LM's `pretrain_gpt.py` with `args` on `cluster`.
fn launch_line(cluster: &Cluster, args: &[String]) -> String {
    format!(
        "torchrun --nnodes {} --nproc-per-node {} pretrain_gpt.py {}",
        cluster.nodes,
        cluster.gpus_per_node,
        args.iter()
            .map(|a| shell_quote(a))
            .collect::<Vec<_>>()
            .join(" ")
    )
}

/// A duration for a reader: `13.92 s` from a second up, else `291.8 ms`.
pub fn secs(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.2} s")
    } else {
        format!("{:.1} ms", s * 1e3)
    }
}

/// `arg` as one shell word: unchanged when it holds only characters no shell interprets, else
/// in single quotes.
pub fn shell_quote(arg: &str) -> String {
    let plain = !arg.is_empty()
        && arg
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c));
    if plain {
        arg.to_string()
    } else {
        format!("'{}'", arg.replace('\'', "'\\''"))
    }
}

/// Accumulates `--flag` and `--key value` arguments.
#[derive(Default)]
struct Args(Vec<String>);

impl Args {
    fn flag(&mut self, name: &str) {
        self.0.push(format!("--{name}"));
    }

    fn kv(&mut self, name: &str, value: impl ToString) {
        self.flag(name);
        self.0.push(value.to_string());
    }
}

/// Megatron-LM's `--pipeline-model-parallel-layout` for chunks that differ from its default
/// even split (`None` when they do not): virtual stages in order, separated by `|`, each an
/// `E` for the embedding, `t` per transformer block and `L` for the output layer and loss;
/// runs of equal stages are written `(stage|)*k`.
pub fn pipeline_layout(chunks: &[ChunkLayers], blocks: &[usize], layers: usize) -> Option<String> {
    let total: usize = blocks.iter().sum();
    let n = chunks.len();
    if n > 0 && total % n == 0 && blocks.iter().all(|&b| b == total / n) {
        return None;
    }
    let token = |k: usize| {
        let mut t = String::new();
        if chunks[k].first == 0 {
            t.push('E');
        }
        match blocks[k] {
            0 => {}
            1 => t.push('t'),
            b => t.push_str(&format!("t*{b}")),
        }
        if chunks[k].last + 1 == layers {
            t.push('L');
        }
        t
    };
    let tokens: Vec<String> = (0..n).map(token).collect();
    let mut out = String::new();
    let mut k = 0;
    // The last stage is written alone: a group ends with a separator.
    while k + 1 < n {
        let run = tokens[k..n - 1]
            .iter()
            .take_while(|t| **t == tokens[k])
            .count();
        if run >= 3 {
            out.push_str(&format!("({}|)*{run},", tokens[k]));
        } else {
            for t in &tokens[k..k + run] {
                out.push_str(t);
                out.push('|');
            }
        }
        k += run;
    }
    out.push_str(&tokens[n - 1]);
    Some(out)
}

/// A Megatron-LM layout with the layers of every virtual stage: what a launch of Megatron-LM
/// (or a framework built on its layouts) configures.
#[derive(Clone, Debug, PartialEq)]
pub struct LaunchLayout {
    /// Degrees, batch, interleaving, sequence parallelism, recomputation, ZeRO.
    pub layout: Layout,
    /// Layers of every virtual stage, in order (`chunk * pp + stage`).
    pub chunks: Vec<ChunkLayers>,
    /// Transformer blocks of every virtual stage.
    pub blocks: Vec<usize>,
    /// Under full recomputation: every block is recomputed (else the first
    /// `chunks[k].full_recompute` blocks of each virtual stage).
    pub every_block_recomputed: bool,
}

impl LaunchLayout {
    /// The layout of a priced Megatron-LM layout.
    pub fn of_estimate(e: &Estimate) -> LaunchLayout {
        let chunks = e.assignment();
        let (p, v) = (e.stages.len(), e.layout.interleave as usize);
        let blocks = (0..p * v)
            .map(|k| e.stages[k % p].chunks[k / p].blocks)
            .collect();
        let every_block_recomputed = e
            .stages
            .iter()
            .flat_map(|s| &s.chunks)
            .all(|c| c.full_recompute == c.blocks);
        LaunchLayout {
            layout: e.layout,
            chunks,
            blocks,
            every_block_recomputed,
        }
    }

    /// The layout of an ILP pipeline that Megatron-LM can express (every stage on the same
    /// logical mesh, sharded as one of Megatron-LM's layouts of it), with its stages' layers;
    /// `None` when it cannot.
    pub fn of_ilp(p: &IlpPlan, global_batch: u64) -> Option<LaunchLayout> {
        let first = p.stages.first()?;
        let (tp, dp) = (first.megatron.tensor_parallel, first.megatron.data_parallel);
        if !p.megatron_expressible || dp == 0 || p.micro_batch % dp != 0 {
            return None;
        }
        let layers = p.stages.last()?.layers[1];
        let recompute = megatron_recompute(&p.stages, layers).ok()?;
        // The embedding is the first layer and the output layer the last; the others are
        // blocks.
        let blocks: Vec<usize> = p.stages.iter().map(|s| stage_blocks(s, layers)).collect();
        let chunks: Vec<ChunkLayers> = p
            .stages
            .iter()
            .zip(&blocks)
            .map(|(s, &b)| ChunkLayers {
                first: s.layers[0],
                last: s.layers[1] - 1,
                full_recompute: recompute.min(b),
            })
            .collect();
        let every_block_recomputed = recompute > 0
            && chunks
                .iter()
                .zip(&blocks)
                .all(|(c, &b)| c.full_recompute == b);
        let layout = Layout {
            tp,
            // The intra-op space has no context or expert parallelism.
            cp: 1,
            cp_comm: Default::default(),
            ep: 1,
            etp: 1,
            pp: p.stages.len() as u64,
            dp,
            micro_batch: p.micro_batch / dp,
            global_batch,
            interleave: 1,
            sequence_parallel: first.megatron.sequence_parallel,
            recompute: if recompute > 0 {
                Recompute::Full
            } else {
                Recompute::None
            },
            zero: u8::from(
                p.stages
                    .iter()
                    .flat_map(|s| &s.parameters)
                    .any(|w| w.states != w.weight),
            ),
        };
        Some(LaunchLayout {
            layout,
            chunks,
            blocks,
            every_block_recomputed,
        })
    }

    /// Megatron-LM's `--pipeline-model-parallel-layout` when the split is not its default even
    /// one.
    pub fn pipeline_layout(&self) -> Option<String> {
        let layers = self.chunks.last().map_or(0, |c| c.last + 1);
        pipeline_layout(&self.chunks, &self.blocks, layers)
    }
}

/// Megatron-LM command-line arguments for the estimate's layout and split. The parallel knobs
/// are always given; the architecture flags, the custom pipeline layout and block-wise
/// recomputation only for transformers (a graph file is not a Megatron-LM GPT model).
pub fn megatron_args(
    def: &ModelDef,
    e: &Estimate,
    opts: &TrainingOptions,
    gpus_per_node: u64,
) -> Vec<String> {
    layout_args(def, &LaunchLayout::of_estimate(e), opts, gpus_per_node)
}

/// Megatron-LM command-line arguments running an ILP pipeline that Megatron-LM can express;
/// `None` when it cannot.
pub fn ilp_megatron_args(
    def: &ModelDef,
    p: &IlpPlan,
    global_batch: u64,
    opts: &TrainingOptions,
    gpus_per_node: u64,
) -> Option<Vec<String>> {
    LaunchLayout::of_ilp(p, global_batch).map(|l| layout_args(def, &l, opts, gpus_per_node))
}

/// Megatron-LM's arguments for launch layout `launch` on nodes of `gpus_per_node` GPUs (which
/// set the levels of hierarchical context parallelism).
pub fn layout_args(
    def: &ModelDef,
    launch: &LaunchLayout,
    opts: &TrainingOptions,
    gpus_per_node: u64,
) -> Vec<String> {
    let (l, chunks) = (&launch.layout, &launch.chunks);
    let every_block_recomputed = launch.every_block_recomputed;
    let layout = launch.pipeline_layout();
    let mut a = Args::default();
    a.kv("tensor-model-parallel-size", l.tp);
    a.kv("pipeline-model-parallel-size", l.pp);
    if l.cp > 1 {
        a.kv("context-parallel-size", l.cp);
        a.kv("cp-comm-type", l.cp_comm.name());
        if l.cp_comm == CpComm::A2aP2p {
            let inner = hierarchical_inner(l.tp, l.cp, gpus_per_node);
            // Two values (argparse's `nargs='+'`): the all-to-all level, then the ring.
            a.kv("hierarchical-context-parallel-sizes", inner);
            a.0.push((l.cp / inner).to_string());
        }
    }
    a.kv("micro-batch-size", l.micro_batch);
    a.kv("global-batch-size", l.global_batch);
    a.kv("seq-length", opts.seq);
    if let Some(c) = def.transformer() {
        match &layout {
            Some(s) => a.kv("pipeline-model-parallel-layout", s),
            None if l.interleave > 1 => a.kv(
                "num-layers-per-virtual-pipeline-stage",
                c.layers / (l.pp * l.interleave),
            ),
            None => {}
        }
        a.kv("num-layers", c.layers);
        a.kv("hidden-size", c.hidden);
        a.kv("ffn-hidden-size", c.ffn_hidden);
        a.kv("num-attention-heads", c.heads);
        if c.head_dim * c.heads != c.hidden {
            a.kv("kv-channels", c.head_dim);
        }
        if c.kv_heads != c.heads {
            a.flag("group-query-attention");
            a.kv("num-query-groups", c.kv_heads);
        }
        a.kv("max-position-embeddings", c.max_seq.max(opts.seq));
        a.kv("make-vocab-size-divisible-by", opts.vocab_multiple);
        if c.mlp == Mlp::SwiGlu {
            a.flag("swiglu");
        }
        if c.norm == Norm::RmsNorm {
            a.kv("normalization", "RMSNorm");
        }
        if c.position == Position::Rope {
            a.kv("position-embedding-type", "rope");
        }
        if !c.tied_embeddings {
            a.flag("untie-embeddings-and-output-weights");
        }
        match c.bias {
            Bias::All => {}
            Bias::Qkv => {
                a.flag("disable-bias-linear");
                a.flag("add-qkv-bias");
            }
            Bias::None => a.flag("disable-bias-linear"),
        }
        if !c.dropout {
            a.kv("attention-dropout", "0.0");
            a.kv("hidden-dropout", "0.0");
        }
        // Megatron-LM has no Triton kernel; its CUDA flash attention holds the same memory.
        if opts.attention.flash_kernel().is_some() {
            a.flag("use-flash-attn");
        }
        if c.qk_norm {
            a.flag("qk-layernorm");
        }
        if let Some(m) = &c.mla {
            a.flag("multi-latent-attention");
            if m.q_lora_rank > 0 {
                a.kv("q-lora-rank", m.q_lora_rank);
            }
            a.kv("kv-lora-rank", m.kv_lora_rank);
            a.kv("qk-head-dim", m.qk_nope_head_dim);
            a.kv("qk-pos-emb-head-dim", m.qk_rope_head_dim);
            a.kv("v-head-dim", m.v_head_dim);
        }
        if let Some(m) = &c.moe {
            moe_args(&mut a, m, opts.moe_routing, (c.layers, c.ffn_hidden), l);
        }
    }
    match opts.precision {
        Precision::Bf16 => a.flag("bf16"),
        Precision::Fp16 => a.flag("fp16"),
        Precision::Fp32 => {}
    }
    if l.sequence_parallel {
        a.flag("sequence-parallel");
    }
    match l.recompute {
        Recompute::None => {}
        Recompute::Selective => a.kv("recompute-granularity", "selective"),
        Recompute::Full => {
            a.kv("recompute-granularity", "full");
            if every_block_recomputed {
                a.kv("recompute-method", "uniform");
                a.kv("recompute-num-layers", 1);
            } else {
                // The first N blocks of every chunk (the split gives every chunk the same N).
                let n = chunks.iter().map(|c| c.full_recompute).max().unwrap_or(0);
                a.kv("recompute-method", "block");
                a.kv("recompute-num-layers", n);
            }
        }
        // Megatron-LM has no such policy; no plan carries it (the workspace refuses it in a
        // search, and `estimate`, `whatif` and `validate` write no arguments).
        Recompute::SelectiveOp => {}
    }
    match l.zero {
        0 => {}
        // Megatron-LM's distributed optimizer shards optimizer states and gradients.
        1 | 2 => a.flag("use-distributed-optimizer"),
        // Megatron-Core's FSDP shards weights as well.
        _ => {
            a.flag("use-custom-fsdp");
            a.kv("data-parallel-sharding-strategy", "optim_grads_params");
        }
    }
    runtime_args(&mut a, l, opts);
    a.0
}

/// Megatron-Core's mixture-of-experts arguments: the experts and router of `m` (in a model of
/// `layers` blocks whose dense MLP is `ffn_hidden` wide), the expert layout of `l` (MoE
/// parallel folding), grouped GEMMs and the all-to-all dispatcher the cost model prices, and
/// the capacity when `routing` drops tokens.
fn moe_args(
    a: &mut Args,
    m: &MoeConfig,
    routing: MoeRouting,
    (layers, ffn_hidden): (u64, u64),
    l: &Layout,
) {
    a.kv("num-experts", m.experts);
    a.kv("moe-router-topk", m.top_k);
    if m.expert_ffn != ffn_hidden {
        a.kv("moe-ffn-hidden-size", m.expert_ffn);
    }
    if m.shared_ffn > 0 {
        a.kv("moe-shared-expert-intermediate-size", m.shared_ffn);
    }
    if m.dense_layers > 0 {
        // A Python expression Megatron-LM evaluates: dense blocks first, then MoE blocks.
        a.kv(
            "moe-layer-freq",
            format!(
                "([0]*{}+[1]*{})",
                m.dense_layers,
                layers.saturating_sub(m.dense_layers)
            ),
        );
    }
    if m.router_bias {
        a.kv("moe-router-score-function", "sigmoid");
        a.flag("moe-router-enable-expert-bias");
    }
    a.flag("moe-grouped-gemm");
    a.kv("moe-token-dispatcher-type", "alltoall");
    if routing.drop_tokens {
        a.kv("moe-expert-capacity-factor", routing.factor.get());
        a.kv("moe-token-drop-policy", "probs");
    }
    a.kv("expert-model-parallel-size", l.ep);
    a.kv("expert-tensor-parallel-size", l.etp);
}

/// What the runtime settings of `opts` take on Megatron-LM's command line, where they differ
/// from its defaults: weight-gradient accumulation fusion (on by default), the gradients'
/// reduction dtype (bf16 reduces in fp32 unless `--grad-reduce-in-bf16`; fp16 in fp16 unless
/// `--accumulate-allreduce-grads-in-fp32`), FP8 training (`--fp8-format hybrid`), and the
/// data-parallel overlaps (off by default).
fn runtime_args(a: &mut Args, l: &Layout, opts: &TrainingOptions) {
    if !opts.grad_accumulation_fusion {
        a.flag("no-gradient-accumulation-fusion");
    }
    // Transformer Engine's FP8 recipe: E4M3 forward, E5M2 gradients.
    if opts.fp8 {
        a.kv("fp8-format", "hybrid");
    }
    match (opts.precision, opts.grad_reduce_in_fp32) {
        (Precision::Bf16, false) => a.flag("grad-reduce-in-bf16"),
        (Precision::Fp16, true) => a.flag("accumulate-allreduce-grads-in-fp32"),
        _ => {}
    }
    if opts.overlap_grad_reduce && l.dp > 1 {
        a.flag("overlap-grad-reduce");
    }
    // The weights' all-gather exists only under a sharded optimizer.
    if opts.overlap_param_gather && l.dp > 1 && l.zero >= 1 {
        a.flag("overlap-param-gather");
    }
    if opts.overlaps_tp_comm(l) {
        a.flag("tp-comm-overlap");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunks(blocks: &[usize]) -> (Vec<ChunkLayers>, usize) {
        // Embedding, the blocks, the output layer.
        let mut out = Vec::new();
        let mut next = 1;
        for (k, &b) in blocks.iter().enumerate() {
            let first = if k == 0 { 0 } else { next };
            next += b;
            let last = if k + 1 == blocks.len() {
                next
            } else {
                next - 1
            };
            out.push(ChunkLayers {
                first,
                last,
                full_recompute: 0,
            });
        }
        (out, next + 1)
    }

    #[test]
    fn runtime_settings_become_megatron_flags_only_where_they_leave_its_defaults() {
        use crate::plan::runtime::{GivenSettings, Runtime};
        let layout = |dp: u64, zero: u8| Layout {
            cp: 1,
            cp_comm: Default::default(),
            ep: 1,
            etp: 1,
            tp: 1,
            pp: 1,
            dp,
            micro_batch: 1,
            global_batch: 8,
            interleave: 1,
            sequence_parallel: false,
            recompute: Recompute::None,
            zero,
        };
        let flags = |r: Runtime, dp: u64, zero: u8| -> Vec<String> {
            let mut a = Args::default();
            runtime_args(
                &mut a,
                &layout(dp, zero),
                &r.options(2048, None, None, 0.1, 128, GivenSettings::default()),
            );
            a.0
        };
        // Megatron-Core's defaults: nothing to say.
        assert!(flags(Runtime::MegatronCore, 8, 1).is_empty());
        // NeMo's recipes overlap both, the gather only with a sharded optimizer.
        assert_eq!(
            flags(Runtime::Nemo, 8, 1),
            ["--overlap-grad-reduce", "--overlap-param-gather"]
        );
        assert_eq!(flags(Runtime::Nemo, 8, 0), ["--overlap-grad-reduce"]);
        assert!(flags(Runtime::Nemo, 1, 1).is_empty());
        // NeMo's userbuffers, with sequence parallelism over a tensor-parallel group only.
        let nemo = Runtime::Nemo.options(2048, None, None, 0.1, 128, GivenSettings::default());
        for (tp, sp, want) in [(2, true, true), (2, false, false), (1, false, false)] {
            let mut a = Args::default();
            let l = Layout {
                tp,
                dp: 1,
                sequence_parallel: sp,
                ..layout(1, 0)
            };
            runtime_args(&mut a, &l, &nemo);
            assert_eq!(
                a.0.contains(&"--tp-comm-overlap".to_string()),
                want,
                "tp {tp} sp {sp}"
            );
        }
        // The 2021 scripts: no fusion, fp16 gradients (Megatron's fp16 default).
        assert_eq!(
            flags(Runtime::Megatron2021, 8, 0),
            ["--no-gradient-accumulation-fusion"]
        );
        // bf16 gradients reduced in bf16 say so.
        let given = GivenSettings {
            grad_reduce_in_fp32: Some(false),
            ..GivenSettings::default()
        };
        let o = Runtime::MegatronCore.options(2048, None, None, 0.1, 128, given);
        let mut a = Args::default();
        runtime_args(&mut a, &layout(8, 0), &o);
        assert_eq!(a.0, ["--grad-reduce-in-bf16"]);
    }

    #[test]
    fn pipeline_layout_is_megatron_syntax() {
        let (c, layers) = chunks(&[4, 4, 4, 4]);
        assert_eq!(pipeline_layout(&c, &[4, 4, 4, 4], layers), None);
        let (c, layers) = chunks(&[17, 15]);
        assert_eq!(
            pipeline_layout(&c, &[17, 15], layers).as_deref(),
            Some("Et*17|t*15L")
        );
        let b = [3, 2, 2, 2, 2, 2, 2, 3];
        let (c, layers) = chunks(&b);
        assert_eq!(
            pipeline_layout(&c, &b, layers).as_deref(),
            Some("Et*3|(t*2|)*6,t*3L")
        );
        let b = [1, 2, 2, 0];
        let (c, layers) = chunks(&b);
        assert_eq!(
            pipeline_layout(&c, &b, layers).as_deref(),
            Some("Et|t*2|t*2|L")
        );
    }

    #[test]
    fn shell_quoting() {
        assert_eq!(shell_quote("--bf16"), "--bf16");
        assert_eq!(shell_quote("Et*3|t*2L"), "'Et*3|t*2L'");
        assert_eq!(shell_quote("it's"), "'it'\\''s'");
        assert_eq!(shell_quote(""), "''");
    }
}
