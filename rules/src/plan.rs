//! The plan a build writes for a target (`plans/<target>.json`), and the Megatron-LM arguments
//! that realise it.

use crate::cluster::{Cluster, GIB};
use crate::estimate::Estimate;
use crate::frontend::{Attention, Bias, Mlp, ModelDef, Norm, Position};
use crate::layout::{Layout, Recompute, TrainingOptions};
use crate::memory::Precision;
use crate::search::SearchResult;
use serde::{Deserialize, Serialize};

/// Version of the plan file layout.
pub const PLAN_SCHEMA: u32 = 1;

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

/// How much of the space the search covered.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SearchStats {
    /// Layouts generated.
    pub candidates: usize,
    /// Layouts that can run.
    pub valid: usize,
    /// Valid layouts that fit in memory.
    pub feasible: usize,
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
    /// The chosen layout, priced.
    pub estimate: Estimate,
    /// The next best layouts.
    pub alternatives: Vec<Alternative>,
    /// Search coverage.
    pub search: SearchStats,
    /// Megatron-LM `pretrain_gpt.py` arguments realising the layout.
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
        let args = megatron_args(def, &best.layout, &training);
        let launch = format!(
            "torchrun --nnodes {} --nproc-per-node {} pretrain_gpt.py {}",
            cluster.nodes,
            cluster.gpus_per_node,
            args.join(" ")
        );
        Some(Plan {
            schema: PLAN_SCHEMA,
            rules_version: crate::RULES_VERSION.to_string(),
            target: target.to_string(),
            model,
            cluster: cluster.clone(),
            training,
            alternatives: result
                .ranked
                .iter()
                .skip(1)
                .map(|e| Alternative {
                    layout: e.layout,
                    step_time_s: e.step_time_s,
                    mfu: e.mfu,
                    memory_per_device_gib: e.memory.total / GIB,
                })
                .collect(),
            search: SearchStats {
                candidates: result.candidates,
                valid: result.valid,
                feasible: result.feasible,
            },
            estimate: best,
            megatron_args: args,
            launch,
        })
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

/// Megatron-LM command-line arguments for `layout`. The parallel knobs are always given; the
/// architecture flags only for transformers (a graph file is not a Megatron-LM GPT model).
pub fn megatron_args(def: &ModelDef, l: &Layout, opts: &TrainingOptions) -> Vec<String> {
    let mut a = Args::default();
    a.kv("tensor-model-parallel-size", l.tp);
    a.kv("pipeline-model-parallel-size", l.pp);
    a.kv("micro-batch-size", l.micro_batch);
    a.kv("global-batch-size", l.global_batch);
    a.kv("seq-length", opts.seq);
    if let Some(c) = def.transformer() {
        if l.interleave > 1 {
            a.kv(
                "num-layers-per-virtual-pipeline-stage",
                c.layers / (l.pp * l.interleave),
            );
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
        if opts.attention == Attention::Flash {
            a.flag("use-flash-attn");
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
            a.kv("recompute-method", "uniform");
            a.kv("recompute-num-layers", 1);
        }
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
    a.0
}
