//! A parallel layout (the knobs a Megatron-LM user sets by hand) and the options of a training
//! run it is priced for.

use crate::cost::context_parallel::{CpComm, CpConfig};
use crate::cost::memory::Precision;
use crate::error::FieldError;
use crate::model::frontend::{Attention, MoeRouting};
use serde::{Deserialize, Serialize};

/// Activation recomputation policy of the transformer blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    /// Keep every activation the backward pass needs.
    None,
    /// Re-run the attention core (Korthikanti et al. 2022) instead of storing its outputs.
    Selective,
    /// Keep only each block's input; re-run the whole block forward during backward.
    Full,
    /// torchtitan's selective activation checkpointing with its `op` policy
    /// (`[activation_checkpoint] mode = "selective"`, `selective_ac_option = "op"`): keep each
    /// block's input, the attention kernel's output and every other linear layer's output
    /// (counting the block's matrix products in order: the first, third, ... are kept), and
    /// re-run the rest of the block forward during backward.
    #[serde(rename = "selective-op")]
    SelectiveOp,
}

impl Recompute {
    /// Name as written on the command line and in files.
    pub fn name(self) -> &'static str {
        match self {
            Recompute::None => "none",
            Recompute::Selective => "selective",
            Recompute::Full => "full",
            Recompute::SelectiveOp => "selective-op",
        }
    }

    /// Parses `none`, `selective`, `full` or `selective-op`.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "none" => Recompute::None,
            "selective" => Recompute::Selective,
            "full" => Recompute::Full,
            "selective-op" => Recompute::SelectiveOp,
            _ => return None,
        })
    }
}

/// When a fully sharded (ZeRO-3) runtime all-gathers a block's weights for its backward pass,
/// relative to the gradients of the block after it (PyTorch FSDP's `backward_prefetch`,
/// Composer's `fsdp_config.backward_prefetch`; the PyTorch docs' `BackwardPrefetch`).
///
/// The gathers and the gradients' reduce-scatters share one process group, so they run one
/// after the other; what decides the exposed time is whether the next gather is queued before
/// the block's gradients are computed, after them, or only when autograd reaches the block.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackwardPrefetch {
    /// `BACKWARD_PRE`: the next block's gather is issued before this block's gradients are
    /// computed, and both collectives hide behind that compute (DeepSpeed's ZeRO-3 prefetch,
    /// FSDP2's default of prefetching in reverse forward order).
    #[default]
    Pre,
    /// `BACKWARD_POST`: the next block's gather is issued once this block's gradients are
    /// computed, ahead of their reduce-scatter; each block waits for its own gather, and the
    /// reduce-scatter hides behind the next block's compute (Composer's default).
    Post,
    /// No prefetch: a block's gather is issued when autograd reaches it, queued behind the
    /// previous block's reduce-scatter, and the compute waits for both.
    None,
}

impl BackwardPrefetch {
    /// Every setting, in the order of the PyTorch docs.
    pub const ALL: [BackwardPrefetch; 3] = [
        BackwardPrefetch::Pre,
        BackwardPrefetch::Post,
        BackwardPrefetch::None,
    ];

    /// Name as written on the command line and in files.
    pub fn name(self) -> &'static str {
        match self {
            BackwardPrefetch::Pre => "pre",
            BackwardPrefetch::Post => "post",
            BackwardPrefetch::None => "none",
        }
    }

    /// Parses `pre`, `post` or `none`.
    pub fn parse(s: &str) -> Option<Self> {
        BackwardPrefetch::ALL.into_iter().find(|b| b.name() == s)
    }

    /// Every name, comma-separated (for error messages).
    pub fn names() -> String {
        BackwardPrefetch::ALL.map(BackwardPrefetch::name).join(", ")
    }

    /// Seconds a block's backward waits on its ZeRO-3 collectives per micro-batch: the
    /// gather `gather` of its weights, the gather `regather` again for a recomputed forward,
    /// and the reduce-scatter `reduce` of its gradients, beside `compute` seconds of its
    /// backward (recomputation included).
    pub fn exposed(self, gather: f64, regather: f64, reduce: f64, compute: f64) -> f64 {
        match self {
            BackwardPrefetch::Pre => (gather + regather + reduce - compute).max(0.0),
            BackwardPrefetch::Post => gather + (regather + reduce - compute).max(0.0),
            BackwardPrefetch::None => gather + regather + reduce,
        }
    }
}

/// Degrees and knobs of data, tensor and pipeline parallelism for one training run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Layout {
    /// Tensor-parallel degree.
    pub tp: u64,
    /// Pipeline-parallel degree (stages).
    pub pp: u64,
    /// Data-parallel degree.
    pub dp: u64,
    /// Sequences per micro-batch.
    pub micro_batch: u64,
    /// Sequences per optimizer step.
    pub global_batch: u64,
    /// Model chunks per pipeline stage (interleaved 1F1B when above 1).
    pub interleave: u64,
    /// Sequence parallelism in the tensor-parallel group.
    pub sequence_parallel: bool,
    /// Activation recomputation.
    pub recompute: Recompute,
    /// ZeRO stage (0 = plain data parallelism).
    pub zero: u8,
    /// Context-parallel degree: ranks each sequence is split over (1: none).
    #[serde(default = "one")]
    pub cp: u64,
    /// How context-parallel ranks exchange keys and values.
    #[serde(default)]
    pub cp_comm: CpComm,
    /// Expert-parallel degree of the mixture-of-experts layers (1: every rank holds every
    /// expert).
    #[serde(default = "one")]
    pub ep: u64,
    /// Expert tensor-parallel degree: ranks each expert's width is split over (Megatron-Core's
    /// `--expert-tensor-parallel-size`; its default is tp).
    #[serde(default = "one")]
    pub etp: u64,
}

fn one() -> u64 {
    1
}

impl Layout {
    /// The context-parallel part.
    pub fn cp_config(&self) -> CpConfig {
        CpConfig {
            c: self.cp,
            comm: self.cp_comm,
        }
    }

    /// Ranks holding the same weights of a stage, over which gradients are reduced and
    /// optimizer states sharded: data- and context-parallel together (Megatron-Core's
    /// `data_parallel_group_with_cp`).
    pub fn grad_ranks(&self) -> u64 {
        self.dp.saturating_mul(self.cp)
    }

    /// GPUs of one pipeline stage: tp x cp x dp.
    pub fn stage_ranks(&self) -> u64 {
        self.tp.saturating_mul(self.cp).saturating_mul(self.dp)
    }

    /// Ranks holding the same routed experts, over which their gradients are reduced and
    /// optimizer states sharded: the expert data-parallel degree, `tp x cp x dp / (etp x ep)`
    /// under MoE parallel folding.
    pub fn expert_grad_ranks(&self) -> u64 {
        (self.stage_ranks() / self.ep.saturating_mul(self.etp).max(1)).max(1)
    }

    /// Whether the layout divides experts (expert or expert tensor parallelism).
    pub fn has_expert_parallelism(&self) -> bool {
        self.ep > 1 || self.etp > 1
    }

    /// Micro-batches per pipeline per step.
    pub fn num_microbatches(&self) -> u64 {
        self.global_batch / self.micro_batch.saturating_mul(self.dp).max(1)
    }

    /// Compact one-line description, e.g. `tp8 pp16 dp8 mb1 v2 sp rc=selective zero1`, with
    /// `cp4(p2p)` after tp under context parallelism and `ep8 etp1` after that under expert
    /// parallelism.
    pub fn describe(&self) -> String {
        let cp = if self.cp > 1 {
            format!(" cp{}({})", self.cp, self.cp_comm.name())
        } else {
            String::new()
        };
        let ep = if self.has_expert_parallelism() {
            format!(" ep{} etp{}", self.ep, self.etp)
        } else {
            String::new()
        };
        format!(
            "tp{}{cp}{ep} pp{} dp{} mb{} v{}{} rc={} zero{}",
            self.tp,
            self.pp,
            self.dp,
            self.micro_batch,
            self.interleave,
            if self.sequence_parallel { " sp" } else { "" },
            self.recompute.name(),
            self.zero
        )
    }
}

/// Settings of a training run that are not layout knobs.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainingOptions {
    /// Tokens per sequence.
    pub seq: u64,
    /// Numeric precision.
    pub precision: Precision,
    /// Attention-core implementation.
    pub attention: Attention,
    /// Fraction of device memory kept free for allocator fragmentation.
    pub memory_headroom: f64,
    /// Vocabulary padding multiple per tensor-parallel rank (Megatron-LM's
    /// `--make-vocab-size-divisible-by`, default 128).
    pub vocab_multiple: u64,
    /// Weight gradients accumulate inside the weight-gradient products (Megatron-LM's
    /// `--gradient-accumulation-fusion`, its default since 2022).
    pub grad_accumulation_fusion: bool,
    /// Gradients accumulate and are reduced in fp32 (Megatron-LM's
    /// `--accumulate-allreduce-grads-in-fp32`, which bf16 turns on; FSDP's `reduce_dtype`).
    #[serde(default)]
    pub grad_reduce_in_fp32: bool,
    /// The data-parallel gradient reduction runs during the last micro-batch's backward
    /// (Megatron-Core's `--overlap-grad-reduce`; FSDP's per-layer reduce-scatter).
    #[serde(default)]
    pub overlap_grad_reduce: bool,
    /// Under a sharded optimizer, the all-gather of the updated weights runs during the next
    /// step's forward (Megatron-Core's `--overlap-param-gather`; FSDP's prefetch).
    #[serde(default)]
    pub overlap_param_gather: bool,
    /// How many tokens the busiest expert of a mixture-of-experts layer gets, and whether
    /// tokens past its capacity are dropped (ignored for dense models).
    #[serde(default)]
    pub moe_routing: MoeRouting,
    /// The loss is PyTorch's unfused `cross_entropy` on logits cast to fp32 (torchtitan's
    /// `cross_entropy_loss`), not a fused kernel that overwrites its saved softmax with the
    /// gradient (Megatron-LM's vocabulary-parallel cross-entropy): the loss's backward holds
    /// two more fp32 tensors the size of the logits (`log_softmax`'s output gradient and its
    /// input gradient) beside the saved fp32 log-probabilities.
    #[serde(default)]
    pub fp32_loss: bool,
    /// RMSNorm, RoPE and SwiGLU run as eager PyTorch composites of elementwise kernels
    /// (torchtitan's `RMSNorm`, `apply_rotary_emb` and `FeedForward` without
    /// `torch.compile`), not as the fused kernels Megatron-LM and Transformer Engine run: each
    /// moves several times the bytes ([`crate::cost::analytic::eager_traffic_factor`]).
    #[serde(default)]
    pub eager_elementwise: bool,
    /// Transformer Engine's FP8 training (Megatron-LM's `--fp8-format hybrid`, NeMo's
    /// `fp8: hybrid`): every product of a transformer block with a weight (the attention's
    /// projections, the MLP's, a routed expert's) runs on the FP8 tensor cores, forward and
    /// backward, after a cast of its operand; it keeps an FP8 copy of its input for the backward
    /// pass, and each weight an FP8 copy and its transpose, cast once per step. Embeddings, the
    /// output layer, attention and the optimizer stay in `precision`. Needs a device with FP8
    /// tensor cores ([`crate::cost::cluster::Device::peak_fp8_flops`]).
    #[serde(default)]
    pub fp8: bool,
    /// Transformer Engine's userbuffers overlap the tensor-parallel all-gathers and
    /// reduce-scatters of sequence parallelism with the products next to them (Megatron-Core's
    /// `--tp-comm-overlap`, NeMo's `tp_comm_overlap`; [`crate::cost::tp_comm_overlap`]).
    /// Nothing changes without sequence parallelism: an all-reduce is never overlapped.
    #[serde(default)]
    pub tp_comm_overlap: bool,
    /// When a fully sharded (ZeRO-3) runtime gathers each block's weights for its backward
    /// pass ([`BackwardPrefetch`]).
    #[serde(default)]
    pub backward_prefetch: BackwardPrefetch,
}

impl TrainingOptions {
    /// Whether userbuffers overlap layout `l`'s tensor-parallel communication: asked for, and
    /// with sequence parallelism over a group of more than one rank (Megatron-Core refuses
    /// `--tp-comm-overlap` without it).
    pub fn overlaps_tp_comm(&self, l: &Layout) -> bool {
        self.tp_comm_overlap && l.tp > 1 && l.sequence_parallel
    }

    /// Bytes per parameter of weights, gradients and optimizer states.
    pub fn state_bytes(&self) -> crate::cost::memory::StateBytes {
        crate::cost::memory::StateBytes::of(self.precision, self.grad_reduce_in_fp32)
    }

    /// The precision in words: its name, with FP8 products when [`TrainingOptions::fp8`].
    pub fn precision_label(&self) -> String {
        if self.fp8 {
            format!("{} with FP8 products", self.precision.name())
        } else {
            self.precision.name().to_string()
        }
    }
}

/// Why a layout cannot run a model on a cluster.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LayoutError {
    /// A degree or size is zero.
    #[error("{0} must be at least 1")]
    ZeroDegree(&'static str),
    /// The degrees do not use the cluster exactly.
    #[error("{degrees} = {product}, but the cluster has {gpus} GPUs")]
    DeviceCount {
        /// The degrees multiplied, e.g. `tp x pp x dp = 5 x 1 x 1`.
        degrees: String,
        /// Their product.
        product: u64,
        /// GPUs in the cluster.
        gpus: u64,
    },
    /// Expert parallelism cannot divide this model's experts or this stage's ranks this way.
    #[error("expert parallelism ep = {ep}, etp = {etp}: {why}")]
    ExpertParallel {
        /// The expert-parallel degree.
        ep: u64,
        /// The expert tensor-parallel degree.
        etp: u64,
        /// What does not divide, or what it needs.
        why: String,
    },
    /// Context parallelism cannot split this model's sequence or heads this way.
    #[error("context parallelism cp = {cp}: {why}")]
    ContextParallel {
        /// The degree.
        cp: u64,
        /// What does not divide, or what it needs.
        why: String,
    },
    /// The global batch does not split into micro-batches per replica.
    #[error(
        "global batch {global_batch} is not divisible by micro-batch x dp = {micro_batch} x {dp}"
    )]
    BatchSplit {
        /// Sequences per step.
        global_batch: u64,
        /// Sequences per micro-batch.
        micro_batch: u64,
        /// Data-parallel degree.
        dp: u64,
    },
    /// Fewer blocks than pipeline chunks.
    #[error(
        "{blocks} blocks cannot give each of the pp x interleave = {pp} x {interleave} chunks one"
    )]
    StageSplit {
        /// Repeated blocks of the model.
        blocks: u64,
        /// Pipeline stages.
        pp: u64,
        /// Chunks per stage.
        interleave: u64,
    },
    /// Interleaving constraints of Megatron-LM.
    #[error(
        "interleaving needs pp >= 2 and a number of micro-batches ({microbatches}) divisible by pp = {pp}"
    )]
    Interleave {
        /// Micro-batches per step.
        microbatches: u64,
        /// Pipeline stages.
        pp: u64,
    },
    /// Sequence parallelism without tensor parallelism.
    #[error("sequence parallelism needs tp > 1")]
    SequenceParallelWithoutTp,
    /// A dimension tensor parallelism splits is not divisible by the degree.
    #[error("tp = {tp} does not divide {what} ({count})")]
    TensorParallel {
        /// What is split.
        what: String,
        /// Its size.
        count: u64,
        /// The degree.
        tp: u64,
    },
    /// ZeRO stage out of range.
    #[error("ZeRO stage {0} does not exist (expected 0, 1, 2 or 3)")]
    ZeroStage(u8),
    /// FP8 training on a device without FP8 tensor cores.
    #[error(
        "fp8 needs FP8 tensor cores (Hopper or later: h100-sxm, h200), and {device} has none \
         (peak_fp8_tflops = 0)"
    )]
    Fp8Unsupported {
        /// The device.
        device: String,
    },
    /// The sequence is longer than the model's position table.
    #[error("sequence length {seq} exceeds the model's maximum of {max}")]
    Sequence {
        /// Requested length.
        seq: u64,
        /// The model's limit.
        max: u64,
    },
    /// The model failed to lower at this micro-batch size.
    #[error("the model does not lower: {0}")]
    Model(FieldError),
    /// A split of the layers into chunks that does not cover them.
    #[error("invalid split of the layers into chunks: {0}")]
    Assignment(String),
    /// The pipeline cannot be simulated.
    #[error("the pipeline cannot be simulated: {0}")]
    Schedule(crate::solve::schedule::ScheduleError),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backward_prefetch_names_parse_back() {
        for b in BackwardPrefetch::ALL {
            assert_eq!(BackwardPrefetch::parse(b.name()), Some(b));
            let json = serde_json::to_string(&b).expect("serialises");
            assert_eq!(json, format!("\"{}\"", b.name()));
        }
        assert_eq!(BackwardPrefetch::parse("backward_pre"), None);
        assert_eq!(BackwardPrefetch::names(), "pre, post, none");
    }

    /// Gather 3, regather 1, reduce-scatter 2 beside a backward of `compute`.
    #[test]
    fn backward_prefetch_exposes_what_its_order_cannot_hide() {
        let exposed = |b: BackwardPrefetch, compute| b.exposed(3.0, 1.0, 2.0, compute);
        // Prefetched: everything hides behind a long enough backward.
        assert_eq!(exposed(BackwardPrefetch::Pre, 10.0), 0.0);
        assert_eq!(exposed(BackwardPrefetch::Pre, 4.0), 2.0);
        // After the gradients: the block's own gather always waits; the rest hides.
        assert_eq!(exposed(BackwardPrefetch::Post, 10.0), 3.0);
        assert_eq!(exposed(BackwardPrefetch::Post, 1.0), 5.0);
        // No prefetch: nothing hides.
        assert_eq!(exposed(BackwardPrefetch::None, 10.0), 6.0);
        // Never less exposed with less prefetching, whatever the compute.
        for compute in [0.0, 1.0, 2.5, 4.0, 6.0, 10.0] {
            let [pre, post, none] = BackwardPrefetch::ALL.map(|b| exposed(b, compute));
            assert!(
                pre <= post && post <= none,
                "{compute}: {pre} {post} {none}"
            );
        }
    }
}
