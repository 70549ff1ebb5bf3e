//! `autopar export`: a plan as the launch configuration of the framework a team runs, in that
//! framework's own names: Megatron-LM's `pretrain_gpt.py` script, NeMo's (Megatron-Core) model
//! YAML, torchtitan's job TOML, DeepSpeed's config JSON and Megatron-DeepSpeed's script.
//!
//! Every export realises the plan's launch layout (`Plan::launch_layout`: the ILP pipeline when
//! Megatron-LM can express it, else the best Megatron-LM layout). Whatever a framework cannot
//! express (a dimension, sharding mode or split it lacks) is an error naming it, never dropped.
//! The names were checked against each framework's source: Megatron-LM's `arguments.py`,
//! NeMo's `megatron_gpt_config.yaml` (the auto-configurator's base configs), torchtitan's
//! `JobConfig` (`torchtitan/config/job_config.py`), DeepSpeed's config keys and
//! Megatron-DeepSpeed's `arguments.py`.

use crate::EngineError;
use autopar_rules::cost::context_parallel::CpComm;
use autopar_rules::cost::memory::Precision;
use autopar_rules::model::frontend::{Bias, Mlp, ModelDef, Norm, Position, TransformerConfig};
use autopar_rules::plan::format::{LaunchLayout, Plan, layout_args, secs, shell_quote};
use autopar_rules::plan::ilp::Space;
use autopar_rules::plan::layout::Recompute;
use serde_json::{Value, json};

/// A framework `export` writes for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Framework {
    /// Megatron-LM: a `torchrun ... pretrain_gpt.py` script, one argument per line.
    Megatron,
    /// NeMo with Megatron-Core models: the model YAML.
    Nemo,
    /// torchtitan: the job TOML.
    Torchtitan,
    /// DeepSpeed: the config JSON (`train_batch_size`, ZeRO stage, precision).
    Deepspeed,
    /// Megatron-DeepSpeed: the `pretrain_gpt.py` script that reads that JSON.
    MegatronDeepspeed,
}

impl Framework {
    /// The framework's name, as the command line writes it.
    pub fn name(self) -> &'static str {
        match self {
            Framework::Megatron => "megatron",
            Framework::Nemo => "nemo",
            Framework::Torchtitan => "torchtitan",
            Framework::Deepspeed => "deepspeed",
            Framework::MegatronDeepspeed => "megatron-deepspeed",
        }
    }
}

/// What to export of a plan.
#[derive(Clone, Debug)]
pub struct ExportOptions {
    /// The framework.
    pub framework: Framework,
    /// Export the plan's best Megatron-LM layout where the plan chose an ILP pipeline that
    /// Megatron-LM cannot express (else that is an error saying why).
    pub megatron_layout: bool,
    /// The DeepSpeed config file Megatron-DeepSpeed's script names.
    pub deepspeed_config: String,
}

/// Why a framework other than torchtitan cannot run torchtitan's op policy.
const OP_POLICY: &str = "torchtitan's `op` policy of selective activation checkpointing \
    (`selective-op`); Megatron-LM's recomputation is selective (the attention core) or full \
    (whole blocks)";

fn cannot(framework: Framework, what: impl Into<String>) -> EngineError {
    EngineError::Inexpressible {
        framework: framework.name(),
        what: what.into(),
    }
}

/// The launch layout an export realises, or why the plan has none.
fn launch(plan: &Plan, o: &ExportOptions) -> Result<LaunchLayout, EngineError> {
    if o.framework == Framework::Megatron
        && plan.estimate.layout.recompute == Recompute::SelectiveOp
    {
        return Err(cannot(o.framework, OP_POLICY));
    }
    if plan.space == Space::Ilp && !plan.megatron_expressible && !o.megatron_layout {
        let why = plan
            .ilp
            .as_ref()
            .and_then(|p| p.not_megatron.clone())
            .unwrap_or_else(|| "it is not one of Megatron-LM's layouts".into());
        return Err(cannot(
            o.framework,
            format!(
                "the plan chose an ILP pipeline that Megatron-LM's layouts cannot express ({why}); \
                 `--megatron-layout` exports the plan's best Megatron-LM layout instead ({}, \
                 predicted {} against the ILP pipeline's {})",
                plan.estimate.layout.describe(),
                secs(plan.estimate.step_time_s),
                secs(plan.step_time_s())
            ),
        ));
    }
    Ok(if plan.space == Space::Ilp && !plan.megatron_expressible {
        LaunchLayout::of_estimate(&plan.estimate)
    } else {
        plan.launch_layout()
    })
}

/// The transformer a framework builds, or why the model is not one.
fn transformer<'a>(
    def: &'a ModelDef,
    plan: &Plan,
    framework: Framework,
) -> Result<&'a TransformerConfig, EngineError> {
    def.transformer().ok_or_else(|| {
        cannot(
            framework,
            format!(
                "model `{}` is an op graph, not a transformer its model classes build",
                plan.model.name
            ),
        )
    })
}

/// The plan exported for `o.framework`: the file's text.
pub fn export(plan: &Plan, def: &ModelDef, o: &ExportOptions) -> Result<String, EngineError> {
    let l = launch(plan, o)?;
    match o.framework {
        Framework::Megatron => Ok(megatron_script(plan, &l, def)),
        Framework::Nemo => nemo(plan, &l, transformer(def, plan, o.framework)?),
        Framework::Torchtitan => torchtitan(plan, &l, transformer(def, plan, o.framework)?),
        Framework::Deepspeed => deepspeed_config(plan, def, &l),
        Framework::MegatronDeepspeed => {
            megatron_deepspeed(plan, &l, transformer(def, plan, o.framework)?, o)
        }
    }
}

/// A header naming the plan, as comment lines starting with `mark`.
fn header(plan: &Plan, l: &LaunchLayout, mark: &str) -> String {
    format!(
        "{mark} autopar plan of target `{}`: {} on {} ({} x {} {}), {} x {} tokens per step, \
         predicted {} per step\n",
        plan.target,
        l.layout.describe(),
        plan.cluster.name,
        plan.cluster.nodes,
        plan.cluster.gpus_per_node,
        plan.cluster.device.name,
        l.layout.global_batch,
        plan.training.seq,
        secs(if l.layout == plan.estimate.layout {
            plan.estimate.step_time_s
        } else {
            plan.step_time_s()
        })
    )
}

/// `torchrun` over the cluster's nodes running `script` with `args`, one per line.
fn torchrun(plan: &Plan, script: &str, args: &[String]) -> String {
    let mut lines = vec![
        "torchrun".to_string(),
        format!("--nnodes {}", plan.cluster.nodes),
        format!("--nproc-per-node {}", plan.cluster.gpus_per_node),
        "--node-rank \"${NODE_RANK:-0}\"".to_string(),
        "--master-addr \"${MASTER_ADDR:-localhost}\"".to_string(),
        "--master-port \"${MASTER_PORT:-6000}\"".to_string(),
        script.to_string(),
    ];
    // Each flag on its line with its values (one, or several for `nargs='+'`).
    let mut i = 0;
    while i < args.len() {
        let mut line = args[i].clone();
        i += 1;
        while let Some(v) = args.get(i).filter(|v| !v.starts_with("--")) {
            line.push(' ');
            line.push_str(&shell_quote(v));
            i += 1;
        }
        lines.push(line);
    }
    lines.push("\"$@\"".to_string());
    lines.join(" \\\n  ")
}

fn script(plan: &Plan, l: &LaunchLayout, body: String) -> String {
    format!(
        "#!/usr/bin/env bash\n{}# Run on every node with NODE_RANK, MASTER_ADDR and MASTER_PORT set; \
         data, tokenizer and checkpoint arguments follow as extra arguments.\nset -euo pipefail\n\
         {body}\n",
        header(plan, l, "#")
    )
}

fn megatron_script(plan: &Plan, l: &LaunchLayout, def: &ModelDef) -> String {
    let args = layout_args(def, l, &plan.training, plan.cluster.gpus_per_node);
    script(plan, l, torchrun(plan, "pretrain_gpt.py", &args))
}

/// NeMo's Megatron-Core GPT model YAML (`trainer` and `model`).
fn nemo(plan: &Plan, l: &LaunchLayout, c: &TransformerConfig) -> Result<String, EngineError> {
    let f = Framework::Nemo;
    let lay = &l.layout;
    if c.mla.is_some() {
        return Err(cannot(
            f,
            "multi-head latent attention; NeMo's megatron_gpt_config has no MLA fields (NeMo 2 \
             builds DeepSeek models from its Python recipes)",
        ));
    }
    if let Some(split) = l.pipeline_layout() {
        return Err(cannot(
            f,
            format!(
                "the stages hold different numbers of layers ({split} in Megatron-LM's \
                 pipeline layout); NeMo's model config splits the layers evenly"
            ),
        ));
    }
    if lay.zero >= 3 {
        return Err(cannot(
            f,
            "ZeRO-3 (weights sharded over data-parallel ranks); NeMo's Megatron-Core GPT config \
             shards optimizer states and gradients (distributed_fused_adam) only",
        ));
    }
    if c.bias == Bias::Qkv {
        return Err(cannot(
            f,
            "a bias on the query/key/value projection only; the config's `bias` applies to \
             every linear layer",
        ));
    }
    let (granularity, method, layers) = match lay.recompute {
        Recompute::None => (Value::Null, Value::Null, Value::Null),
        Recompute::Selective => (json!("selective"), Value::Null, Value::Null),
        Recompute::Full if l.every_block_recomputed => (json!("full"), json!("uniform"), json!(1)),
        Recompute::Full => (
            json!("full"),
            json!("block"),
            json!(l.chunks.iter().map(|k| k.full_recompute).max().unwrap_or(0)),
        ),
        Recompute::SelectiveOp => return Err(cannot(f, OP_POLICY)),
    };
    let precision = match plan.training.precision {
        Precision::Bf16 => json!("bf16"),
        Precision::Fp16 => json!(16),
        Precision::Fp32 => json!(32),
    };
    let distributed = lay.zero >= 1;
    let mut optim = json!({
        "name": if distributed { "distributed_fused_adam" } else { "fused_adam" },
    });
    if distributed {
        optim["overlap_grad_sync"] = json!(plan.training.overlap_grad_reduce);
        optim["overlap_param_sync"] = json!(plan.training.overlap_param_gather);
    }
    let doc = json!({
        "trainer": {
            "num_nodes": plan.cluster.nodes,
            "devices": plan.cluster.gpus_per_node,
            "accelerator": "gpu",
            "precision": precision,
        },
        "model": {
            "mcore_gpt": true,
            "micro_batch_size": lay.micro_batch,
            "global_batch_size": lay.global_batch,
            "tensor_model_parallel_size": lay.tp,
            "pipeline_model_parallel_size": lay.pp,
            "virtual_pipeline_model_parallel_size":
                if lay.interleave > 1 { json!(lay.interleave) } else { Value::Null },
            "context_parallel_size": lay.cp,
            "cp_comm_type": lay.cp_comm.name(),
            "expert_model_parallel_size": lay.ep,
            "expert_tensor_parallel_size": if c.moe.is_some() { json!(lay.etp) } else { Value::Null },
            "sequence_parallel": lay.sequence_parallel,
            "encoder_seq_length": plan.training.seq,
            "max_position_embeddings": c.max_seq.max(plan.training.seq),
            "num_layers": c.layers,
            "hidden_size": c.hidden,
            "ffn_hidden_size": c.ffn_hidden,
            "num_attention_heads": c.heads,
            "num_query_groups": c.kv_heads,
            "kv_channels": if c.head_dim * c.heads != c.hidden { json!(c.head_dim) } else { Value::Null },
            "normalization": match c.norm { Norm::RmsNorm => "rmsnorm", Norm::LayerNorm => "layernorm" },
            "activation": match c.mlp { Mlp::SwiGlu => "fast-swiglu", Mlp::Gelu => "gelu" },
            "position_embedding_type": match c.position { Position::Rope => "rope", Position::Learned => "learned_absolute" },
            "share_embeddings_and_output_weights": c.tied_embeddings,
            "bias": c.bias == Bias::All,
            "hidden_dropout": if c.dropout { json!(0.1) } else { json!(0.0) },
            "attention_dropout": if c.dropout { json!(0.1) } else { json!(0.0) },
            "make_vocab_size_divisible_by": plan.training.vocab_multiple,
            "gradient_accumulation_fusion": plan.training.grad_accumulation_fusion,
            "transformer_engine": true,
            "fp8": plan.training.fp8,
            "fp8_hybrid": plan.training.fp8,
            "ub_tp_comm_overlap": plan.training.overlaps_tp_comm(&l.layout),
            "use_flash_attention":
                plan.training.attention.flash_kernel().is_some(),
            "activations_checkpoint_granularity": granularity,
            "activations_checkpoint_method": method,
            "activations_checkpoint_num_layers": layers,
            "optim": optim,
        },
    });
    let mut doc = doc;
    if let Some(m) = &c.moe {
        let routing = plan.training.moe_routing;
        let model = &mut doc["model"];
        model["num_moe_experts"] = json!(m.experts);
        model["moe_router_topk"] = json!(m.top_k);
        model["moe_ffn_hidden_size"] = json!(m.expert_ffn);
        model["moe_grouped_gemm"] = json!(true);
        model["moe_token_dispatcher_type"] = json!("alltoall");
        if m.shared_ffn > 0 {
            model["moe_shared_expert_intermediate_size"] = json!(m.shared_ffn);
        }
        if m.dense_layers > 0 {
            // One entry per block: 0 dense, 1 MoE (Megatron-Core's `moe_layer_freq` list).
            let freq: Vec<u64> = (0..c.layers)
                .map(|i| u64::from(m.is_moe_block(i)))
                .collect();
            model["moe_layer_freq"] = json!(freq);
        }
        if routing.drop_tokens {
            model["moe_expert_capacity_factor"] = json!(routing.factor.get());
            model["moe_token_drop_policy"] = json!("probs");
        }
    }
    let yaml = yaml_serde::to_string(&doc).map_err(|e| cannot(f, format!("YAML: {e}")))?;
    Ok(format!("{}{yaml}", header(plan, l, "#")))
}

/// torchtitan's job TOML: `[parallelism]`, `[training]`, `[activation_checkpoint]`.
fn torchtitan(plan: &Plan, l: &LaunchLayout, c: &TransformerConfig) -> Result<String, EngineError> {
    let f = Framework::Torchtitan;
    let lay = &l.layout;
    let llama = c.mlp == Mlp::SwiGlu
        && c.norm == Norm::RmsNorm
        && c.position == Position::Rope
        && !c.tied_embeddings
        && c.bias == Bias::None;
    if !llama {
        return Err(cannot(
            f,
            format!(
                "model `{}` is not LLaMA-shaped (SwiGLU, RMSNorm, rotary positions, untied \
                 embeddings, no biases); torchtitan trains its own model classes",
                plan.model.name
            ),
        ));
    }
    // torchtitan's MoE models: DeepSeek-V3's (MLA, shared experts) and Qwen3's (per-head
    // q/k norms); it has no Mixtral-style one.
    let model_name = match (&c.moe, &c.mla, c.qk_norm) {
        (None, None, _) => "llama3",
        (Some(_), Some(_), _) => "deepseek_v3",
        (Some(_), None, true) => "qwen3",
        (None, Some(_), _) | (Some(_), None, false) => {
            return Err(cannot(
                f,
                format!(
                    "model `{}`: torchtitan's mixture-of-experts models are DeepSeek-V3's (with \
                     multi-head latent attention) and Qwen3's (with q/k norms); it has none of \
                     this architecture",
                    plan.model.name
                ),
            ));
        }
    };
    let (replicate, shard) = match lay.zero {
        _ if lay.dp == 1 => (1, 1),
        0 => (lay.dp, 1),
        3 => (1, lay.dp),
        z => {
            return Err(cannot(
                f,
                format!(
                    "ZeRO-{z} over {} data-parallel ranks; torchtitan replicates weights (DDP) or \
                     shards weights, gradients and optimizer states together (FSDP, ZeRO-3)",
                    lay.dp
                ),
            ));
        }
    };
    if lay.tp > 1 && !lay.sequence_parallel {
        return Err(cannot(
            f,
            format!(
                "tensor parallelism of {} without sequence parallelism; torchtitan's tensor \
                 parallelism always shards the norms along the sequence",
                lay.tp
            ),
        ));
    }
    if plan.training.precision == Precision::Fp16 {
        return Err(cannot(
            f,
            "fp16 training; torchtitan's mixed precision is bfloat16 or float32",
        ));
    }
    refuse_transformer_engine(plan, l, f)?;
    if !plan.training.grad_reduce_in_fp32 && plan.training.precision == Precision::Bf16 {
        return Err(cannot(
            f,
            "gradients reduced in bf16; torchtitan reduces in float32 (`mixed_precision_reduce`)",
        ));
    }
    let mode = match lay.recompute {
        Recompute::None => "none",
        Recompute::SelectiveOp => "selective",
        Recompute::Selective => {
            return Err(cannot(
                f,
                "Megatron-LM's selective recomputation (the attention core re-run from its \
                 inputs); torchtitan's selective checkpointing keeps the attention output and \
                 re-runs every other linear layer instead (`selective-op`, which `estimate` and \
                 `validate` price), a different plan",
            ));
        }
        Recompute::Full if l.every_block_recomputed => "full",
        Recompute::Full => {
            return Err(cannot(
                f,
                "full recomputation of the first blocks of each stage only; torchtitan's full \
                 activation checkpointing wraps every block",
            ));
        }
    };
    // Each virtual stage after the first starts at its first block (`layers.N`); the
    // embedding is always on the first and the output layer on the last.
    let mut split_points = Vec::new();
    for (k, chunk) in l.chunks.iter().enumerate().skip(1) {
        if l.blocks[k] == 0 {
            return Err(cannot(
                f,
                format!(
                    "virtual stage {k} holds no transformer block (layers {}..={}); torchtitan \
                     splits the model at blocks",
                    chunk.first, chunk.last
                ),
            ));
        }
        split_points.push(format!("layers.{}", chunk.first.saturating_sub(1)));
    }
    let mut parallelism = toml::Table::new();
    let int = |v: u64| toml::Value::Integer(v as i64);
    parallelism.insert("data_parallel_replicate_degree".into(), int(replicate));
    parallelism.insert("data_parallel_shard_degree".into(), int(shard));
    parallelism.insert("tensor_parallel_degree".into(), int(lay.tp));
    parallelism.insert("pipeline_parallel_degree".into(), int(lay.pp));
    parallelism.insert("context_parallel_degree".into(), int(lay.cp));
    if lay.cp > 1 {
        // torchtitan's ring attention passes the key/value shards round by all-to-all or
        // gathers them all; it has no head-split (Ulysses) mode.
        let rotate = match lay.cp_comm {
            CpComm::P2p => "alltoall",
            CpComm::AllGather => "allgather",
            CpComm::A2a | CpComm::A2aP2p => {
                return Err(cannot(
                    f,
                    format!(
                        "context parallelism with cp_comm = \"{}\" (DeepSpeed-Ulysses' head split); torchtitan's context parallelism is ring attention only",
                        lay.cp_comm.name()
                    ),
                ));
            }
        };
        parallelism.insert(
            "context_parallel_rotate_method".into(),
            toml::Value::String(rotate.into()),
        );
    }
    // torchtitan folds expert parallelism onto the data-shard and context ranks, and onto the
    // tensor ranks too when experts are not tensor-parallel (`expert_tensor_parallel_degree`
    // of 1 or tp).
    let ep_over = match lay.etp {
        e if e == lay.tp => shard * lay.cp,
        1 => shard * lay.cp * lay.tp,
        e => {
            return Err(cannot(
                f,
                format!(
                    "expert tensor parallelism of {e} under tensor parallelism of {}; torchtitan's \
                     is 1 or the tensor-parallel degree",
                    lay.tp
                ),
            ));
        }
    };
    if lay.ep > 1 && ep_over % lay.ep != 0 {
        return Err(cannot(
            f,
            format!(
                "expert parallelism of {} over {ep_over} ranks; torchtitan borrows the expert \
                 ranks from the data-shard and context ranks (and the tensor ranks when experts \
                 are not tensor-parallel), which need ZeRO-3 sharding here",
                lay.ep
            ),
        ));
    }
    parallelism.insert("expert_parallel_degree".into(), int(lay.ep));
    if c.moe.is_some() {
        parallelism.insert("expert_tensor_parallel_degree".into(), int(lay.etp));
    }
    // torchtitan sizes a step by `training.local_batch_size`; with pipelining it cuts that into
    // micro-batches of `pipeline_parallel_microbatch_size`, without it accumulates gradients
    // up to `training.global_batch_size`.
    let local = if lay.pp > 1 {
        lay.global_batch / lay.dp.max(1)
    } else {
        lay.micro_batch
    };
    if lay.pp > 1 {
        parallelism.insert(
            "pipeline_parallel_schedule".into(),
            toml::Value::String(
                if lay.interleave > 1 {
                    "Interleaved1F1B"
                } else {
                    "1F1B"
                }
                .into(),
            ),
        );
        parallelism.insert(
            "pipeline_parallel_microbatch_size".into(),
            int(lay.micro_batch),
        );
        parallelism.insert(
            "pipeline_parallel_split_points".into(),
            toml::Value::Array(split_points.into_iter().map(toml::Value::String).collect()),
        );
    }
    let mut training = toml::Table::new();
    training.insert("local_batch_size".into(), int(local));
    training.insert("global_batch_size".into(), int(lay.global_batch));
    training.insert("seq_len".into(), int(plan.training.seq));
    training.insert(
        "mixed_precision_param".into(),
        toml::Value::String(
            if plan.training.precision == Precision::Fp32 {
                "float32"
            } else {
                "bfloat16"
            }
            .into(),
        ),
    );
    training.insert(
        "mixed_precision_reduce".into(),
        toml::Value::String("float32".into()),
    );
    let mut ac = toml::Table::new();
    ac.insert("mode".into(), toml::Value::String(mode.into()));
    if mode == "selective" {
        ac.insert(
            "selective_ac_option".into(),
            toml::Value::String("op".into()),
        );
    }
    let mut model = toml::Table::new();
    model.insert("name".into(), toml::Value::String(model_name.into()));
    model.insert(
        "flavor".into(),
        toml::Value::String(plan.model.name.clone()),
    );
    let mut doc = toml::Table::new();
    doc.insert("model".into(), toml::Value::Table(model));
    doc.insert("training".into(), toml::Value::Table(training));
    doc.insert("parallelism".into(), toml::Value::Table(parallelism));
    doc.insert("activation_checkpoint".into(), toml::Value::Table(ac));
    let text = toml::to_string(&doc).map_err(|e| cannot(f, format!("TOML: {e}")))?;
    Ok(format!(
        "{}# Register the flavor `{}` with torchtitan's {model_name} model arguments: dim = {}, \
         n_layers = {}, n_heads = {}, n_kv_heads = {}, vocab_size = {}, ffn hidden = {}{}.\n\
         # Launch with `NGPU={} ./run_train.sh` on each of the {} node(s).\n{text}",
        header(plan, l, "#"),
        plan.model.name,
        c.hidden,
        c.layers,
        c.heads,
        c.kv_heads,
        c.vocab,
        c.ffn_hidden,
        c.moe.map_or(String::new(), |m| format!(
            ", {} experts (top-{}) of hidden {}{}",
            m.experts,
            m.top_k,
            m.expert_ffn,
            if m.shared_ffn > 0 {
                format!(", shared experts of hidden {}", m.shared_ffn)
            } else {
                String::new()
            }
        )),
        plan.cluster.gpus_per_node,
        plan.cluster.nodes
    ))
}

/// Refuses a mixture-of-experts model: the DeepSpeed export writes Megatron-DeepSpeed's dense
/// GPT, and DeepSpeed-MoE's experts differ from Megatron-Core's (no expert tensor parallelism
/// beside tp, its own expert interval and capacity rules).
fn dense_for_deepspeed(
    plan: &Plan,
    c: Option<&TransformerConfig>,
    f: Framework,
) -> Result<(), EngineError> {
    match c {
        Some(c) if c.moe.is_some() || c.mla.is_some() => Err(cannot(
            f,
            format!(
                "model `{}` has mixture-of-experts layers or multi-head latent attention; the \
                 DeepSpeed export writes Megatron-DeepSpeed's dense GPT (export it as megatron \
                 or nemo)",
                plan.model.name
            ),
        )),
        _ => Ok(()),
    }
}

/// Checks what DeepSpeed's pipeline engine cannot run.
fn deepspeed_layout(l: &LaunchLayout, f: Framework) -> Result<(), EngineError> {
    let lay = &l.layout;
    if lay.cp > 1 && lay.cp_comm != CpComm::A2a {
        return Err(cannot(
            f,
            format!(
                "context parallelism with cp_comm = \"{}\"; DeepSpeed splits sequences only by \
                 DeepSpeed-Ulysses' all-to-all (cp_comm = \"a2a\")",
                lay.cp_comm.name()
            ),
        ));
    }
    if lay.interleave > 1 {
        return Err(cannot(
            f,
            format!(
                "{} model chunks per stage (interleaved 1F1B); DeepSpeed's pipeline engine runs \
                 one chunk per stage",
                lay.interleave
            ),
        ));
    }
    if lay.pp > 1 && lay.zero >= 2 {
        return Err(cannot(
            f,
            format!(
                "ZeRO-{} with {} pipeline stages; DeepSpeed's pipeline engine supports ZeRO-0 \
                 and ZeRO-1 only",
                lay.zero, lay.pp
            ),
        ));
    }
    if let Some(split) = l.pipeline_layout() {
        return Err(cannot(
            f,
            format!(
                "the stages hold different numbers of layers ({split}); DeepSpeed's pipeline \
                 engine partitions layers by a method (uniform, parameters), not by counts"
            ),
        ));
    }
    Ok(())
}

/// Refuses a plan that needs Transformer Engine for framework `f`: FP8 training, priced as
/// Transformer Engine runs it (per-tensor scaling, FP8 copies of inputs and weights kept),
/// which only Megatron-LM and NeMo run (torchtitan's float8, torchao's, keeps other copies, and
/// DeepSpeed has no FP8 recipe); and tensor-parallel communication overlapped by its
/// userbuffers, which no other framework has.
fn refuse_transformer_engine(
    plan: &Plan,
    l: &LaunchLayout,
    f: Framework,
) -> Result<(), EngineError> {
    if plan.training.fp8 {
        return Err(cannot(
            f,
            "FP8 training as Transformer Engine runs it (Megatron-LM and NeMo); torchtitan's \
             float8 (torchao) keeps other copies and DeepSpeed has no FP8 recipe",
        ));
    }
    if plan.training.overlaps_tp_comm(&l.layout) {
        return Err(cannot(
            f,
            "tensor-parallel communication overlapped with the products by Transformer \
             Engine's userbuffers (Megatron-LM's `--tp-comm-overlap`, NeMo's \
             `ub_tp_comm_overlap`); set `tp_comm_overlap = false` on the target to plan \
             without it",
        ));
    }
    Ok(())
}

/// DeepSpeed's config JSON.
fn deepspeed_config(plan: &Plan, def: &ModelDef, l: &LaunchLayout) -> Result<String, EngineError> {
    let f = Framework::Deepspeed;
    refuse_transformer_engine(plan, l, f)?;
    dense_for_deepspeed(plan, def.transformer(), f)?;
    deepspeed_layout(l, f)?;
    let lay = &l.layout;
    let accumulation = lay.num_microbatches();
    let mut doc = json!({
        "train_batch_size": lay.micro_batch * accumulation * lay.dp,
        "train_micro_batch_size_per_gpu": lay.micro_batch,
        "gradient_accumulation_steps": accumulation,
        "zero_optimization": { "stage": lay.zero },
        "bf16": { "enabled": plan.training.precision == Precision::Bf16 },
        "fp16": { "enabled": plan.training.precision == Precision::Fp16 },
    });
    if plan.training.precision != Precision::Fp32 {
        // The dtype gradients are accumulated and reduced in (DeepSpeed's `data_types` and
        // `communication_data_type`).
        let dtype = match (plan.training.grad_reduce_in_fp32, plan.training.precision) {
            (true, _) => "fp32",
            (false, Precision::Fp16) => "fp16",
            (false, _) => "bf16",
        };
        doc["data_types"] = json!({ "grad_accum_dtype": dtype });
        doc["communication_data_type"] = json!(dtype);
    }
    serde_json::to_string_pretty(&doc)
        .map(|s| s + "\n")
        .map_err(|e| cannot(f, format!("JSON: {e}")))
}

/// Megatron-DeepSpeed's `pretrain_gpt.py` script reading the DeepSpeed config.
fn megatron_deepspeed(
    plan: &Plan,
    l: &LaunchLayout,
    c: &TransformerConfig,
    o: &ExportOptions,
) -> Result<String, EngineError> {
    let f = Framework::MegatronDeepspeed;
    refuse_transformer_engine(plan, l, f)?;
    dense_for_deepspeed(plan, Some(c), f)?;
    deepspeed_layout(l, f)?;
    let lay = &l.layout;
    let mut a: Vec<String> = Vec::new();
    let mut kv = |k: &str, v: String| {
        a.push(format!("--{k}"));
        a.push(v);
    };
    kv("tensor-model-parallel-size", lay.tp.to_string());
    kv("pipeline-model-parallel-size", lay.pp.to_string());
    kv("micro-batch-size", lay.micro_batch.to_string());
    kv("global-batch-size", lay.global_batch.to_string());
    kv("seq-length", plan.training.seq.to_string());
    kv("num-layers", c.layers.to_string());
    kv("hidden-size", c.hidden.to_string());
    kv("ffn-hidden-size", c.ffn_hidden.to_string());
    kv("num-attention-heads", c.heads.to_string());
    if c.kv_heads != c.heads {
        kv("num-key-value-heads", c.kv_heads.to_string());
    }
    kv(
        "max-position-embeddings",
        c.max_seq.max(plan.training.seq).to_string(),
    );
    kv(
        "make-vocab-size-divisible-by",
        plan.training.vocab_multiple.to_string(),
    );
    kv("deepspeed_config", o.deepspeed_config.clone());
    kv("zero-stage", lay.zero.to_string());
    let mut flags = vec!["--deepspeed".to_string()];
    if lay.pp == 1 {
        flags.push("--no-pipeline-parallel".into());
    }
    if c.mlp == Mlp::SwiGlu {
        flags.push("--swiglu".into());
    }
    if c.norm == Norm::RmsNorm {
        flags.extend(["--normalization".into(), "rmsnorm".into()]);
    }
    if c.position == Position::Rope {
        flags.extend([
            "--use-rotary-position-embeddings".into(),
            "--no-position-embedding".into(),
        ]);
    }
    if !c.tied_embeddings {
        flags.push("--untie-embeddings-and-output-weights".into());
    }
    match c.bias {
        Bias::All => {}
        Bias::None => flags.push("--disable-bias-linear".into()),
        Bias::Qkv => {
            return Err(cannot(f, "a bias on the query/key/value projection only"));
        }
    }
    match plan.training.precision {
        Precision::Bf16 => flags.push("--bf16".into()),
        Precision::Fp16 => flags.push("--fp16".into()),
        Precision::Fp32 => {}
    }
    if lay.sequence_parallel {
        flags.push("--sequence-parallel".into());
    }
    if lay.cp > 1 {
        flags.extend(["--ds-sequence-parallel-size".into(), lay.cp.to_string()]);
    }
    match lay.recompute {
        Recompute::None => {}
        Recompute::Full if l.every_block_recomputed => flags.extend([
            "--checkpoint-activations".into(),
            "--deepspeed-activation-checkpointing".into(),
        ]),
        Recompute::SelectiveOp => return Err(cannot(f, OP_POLICY)),
        Recompute::Selective | Recompute::Full => {
            return Err(cannot(
                f,
                format!(
                    "{} recomputation; Megatron-DeepSpeed checkpoints whole blocks, every block \
                     (`--checkpoint-activations`)",
                    if lay.recompute == Recompute::Selective {
                        "selective"
                    } else {
                        "partial full"
                    }
                ),
            ));
        }
    }
    a.extend(flags);
    Ok(script(plan, l, torchrun(plan, "pretrain_gpt.py", &a)))
}
