//! Training runtimes: the software a layout runs on, and what of it the cost model prices.
//!
//! Two runs of one layout differ by runtime: which attention kernel runs, whether weight
//! gradients accumulate inside their products, in what dtype gradients are reduced, which
//! data-parallel communication overlaps computation, which precision the runtime's recipes use.
//! A preset sets those [`TrainingOptions`] fields the way each runtime's defaults (or, for
//! `megatron-2021` and `nemo`, the published scripts and recipes) set them; a flag or column
//! given explicitly wins.
//!
//! | runtime            | precision | attention | wgrad fusion | grads reduced in | grad reduce overlapped | param gather overlapped | TP comm overlapped | ZeRO-3 backward prefetch | loss | RMSNorm, RoPE, SwiGLU |
//! |--------------------|-----------|-----------|--------------|------------------|------------------------|-------------------------|--------------------|------|------|------|
//! | megatron-core      | bf16      | auto (`--attention-backend auto`: cuDNN on Hopper, flash-attn on Ampere) | yes          | fp32 (bf16 sets `--accumulate-allreduce-grads-in-fp32`) | no (`--overlap-grad-reduce` is opt-in) | no (`--overlap-param-gather` is opt-in) | no (`--tp-comm-overlap` is opt-in) | pre | fused | fused |
//! | nemo               | bf16      | auto (as Megatron-Core) | yes          | fp32 (`grad_reduce_in_fp32=True` in its recipes' DDP config) | yes (`overlap_grad_reduce=True`) | yes (`overlap_param_gather=True`) | yes (userbuffers, with SP) | pre | fused | fused |
//! | megatron-deepspeed | bf16      | unfused   | yes          | bf16 (DeepSpeed's `communication_data_type` follows the precision) | no | no | no | pre (ZeRO-3's prefetch) | fused | fused |
//! | megatron-2021      | fp16      | unfused   | no           | fp16 | no | no | no | pre | fused | fused |
//! | torchtitan         | bf16      | flash (`F.scaled_dot_product_attention`, FlashAttention-2 first) | no           | fp32 (FSDP2 `MixedPrecisionPolicy`, `mixed_precision_reduce = "float32"`) | yes (FSDP reduce-scatters each layer in the backward) | yes (FSDP prefetches) | no | pre (FSDP2 prefetches in reverse forward order) | unfused, fp32 (`cross_entropy(pred.float())`) | eager |
//! | llm-foundry        | bf16      | flash-triton (`attn_impl: triton`) | no           | bf16 (FSDP `mixed_precision: PURE`) | yes | yes | no | pre (Composer's default is `BACKWARD_POST`: see [`Runtime::backward_prefetch`]) | fused | fused |
//!
//! A fused loss (Megatron-LM's vocabulary-parallel cross-entropy, which overwrites its saved
//! softmax with the gradient) holds nothing beyond that softmax; torchtitan's unfused one
//! holds two more fp32 tensors the size of the logits during its backward
//! ([`TrainingOptions::fp32_loss`]; `fp32_loss` as a target key, flag or runs column sets it
//! for any runtime). llm-foundry is priced with a fused loss; its published
//! runs give no memory to check that against.
//!
//! The attention kernel matters most on Hopper, where FlashAttention-2 (an Ampere kernel)
//! reaches about 0.33 of the peak and cuDNN's fused attention 0.53
//! ([`crate::cost::cluster::preset`]). Transformer Engine, under Megatron-Core and NeMo,
//! prefers cuDNN there; PyTorch's `scaled_dot_product_attention`, under torchtitan, tries
//! its flash backend (FlashAttention-2) first on every GPU.
//!
//! Weight-gradient accumulation fusion is Megatron's `--gradient-accumulation-fusion`
//! (default on); Megatron-LM's SC'21 scripts (`run_table_1.sh`) predate it, and autograd in
//! torchtitan and Composer adds each micro-batch's gradient with a separate kernel. Flash
//! attention in Megatron-DeepSpeed is `--use-flash-attn-v2`, opt in. Tensor-parallel
//! communication overlaps the products only in NeMo, whose recipes turn on Transformer
//! Engine's userbuffers ([`Runtime::tp_comm_overlap`]); Megatron-Core's `--tp-comm-overlap`
//! is off by default.

use crate::cost::memory::Precision;
use crate::model::frontend::Attention;
use crate::plan::layout::{BackwardPrefetch, TrainingOptions};
use serde::{Deserialize, Serialize};

/// Runtime settings given explicitly (a target key, a flag, a runs column), each winning over
/// the runtime's default.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GivenSettings {
    /// Weight-gradient accumulation fusion.
    pub grad_accumulation_fusion: Option<bool>,
    /// Gradients accumulated and reduced in fp32.
    pub grad_reduce_in_fp32: Option<bool>,
    /// The gradient reduction overlapped with the backward.
    pub overlap_grad_reduce: Option<bool>,
    /// The weight all-gather overlapped with the forward.
    pub overlap_param_gather: Option<bool>,
    /// The loss is PyTorch's unfused cross-entropy on fp32 logits.
    pub fp32_loss: Option<bool>,
    /// RMSNorm, RoPE and SwiGLU run as eager PyTorch composites of elementwise kernels.
    pub eager_elementwise: Option<bool>,
    /// The blocks' products with a weight run in FP8 ([`TrainingOptions::fp8`]).
    pub fp8: Option<bool>,
    /// Tensor-parallel communication overlapped with the products
    /// ([`TrainingOptions::tp_comm_overlap`]).
    pub tp_comm_overlap: Option<bool>,
    /// When ZeRO-3 gathers each block's weights for its backward
    /// ([`TrainingOptions::backward_prefetch`]).
    pub backward_prefetch: Option<BackwardPrefetch>,
}

/// A training runtime whose defaults a layout is priced with (Megatron-Core where none is
/// named).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Runtime {
    /// Megatron-LM with Megatron-Core (2023 on).
    #[default]
    MegatronCore,
    /// NVIDIA NeMo (Megatron-Core underneath).
    Nemo,
    /// Microsoft's Megatron-DeepSpeed fork.
    MegatronDeepspeed,
    /// Megatron-LM as of its 2021 paper (fp16, unfused attention).
    #[serde(rename = "megatron-2021")]
    Megatron2021,
    /// PyTorch's torchtitan (FSDP2, DTensor tensor parallelism).
    Torchtitan,
    /// MosaicML's llm-foundry (Composer, PyTorch FSDP).
    LlmFoundry,
}

impl Runtime {
    /// Every runtime, in the order of the table above.
    pub const ALL: [Runtime; 6] = [
        Runtime::MegatronCore,
        Runtime::Nemo,
        Runtime::MegatronDeepspeed,
        Runtime::Megatron2021,
        Runtime::Torchtitan,
        Runtime::LlmFoundry,
    ];

    /// Name as written in files and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Runtime::MegatronCore => "megatron-core",
            Runtime::Nemo => "nemo",
            Runtime::MegatronDeepspeed => "megatron-deepspeed",
            Runtime::Megatron2021 => "megatron-2021",
            Runtime::Torchtitan => "torchtitan",
            Runtime::LlmFoundry => "llm-foundry",
        }
    }

    /// The runtime named `s`.
    pub fn parse(s: &str) -> Option<Runtime> {
        Runtime::ALL.into_iter().find(|r| r.name() == s)
    }

    /// Every name, comma-separated (for error messages).
    pub fn names() -> String {
        Runtime::ALL.map(Runtime::name).join(", ")
    }

    /// The precision its recipes train in.
    pub fn precision(self) -> Precision {
        match self {
            Runtime::Megatron2021 => Precision::Fp16,
            _ => Precision::Bf16,
        }
    }

    /// The attention kernel it runs by default.
    pub fn attention(self) -> Attention {
        match self {
            Runtime::MegatronDeepspeed | Runtime::Megatron2021 => Attention::Unfused,
            Runtime::LlmFoundry => Attention::FlashTriton,
            Runtime::Torchtitan => Attention::Flash,
            Runtime::MegatronCore | Runtime::Nemo => Attention::Auto,
        }
    }

    /// Whether gradients are accumulated and reduced in fp32 when training in `precision`.
    pub fn grad_reduce_in_fp32(self, precision: Precision) -> bool {
        match self {
            Runtime::MegatronCore | Runtime::Nemo => precision != Precision::Fp16,
            Runtime::Torchtitan => true,
            Runtime::MegatronDeepspeed | Runtime::Megatron2021 | Runtime::LlmFoundry => {
                precision == Precision::Fp32
            }
        }
    }

    /// Whether the data-parallel gradient reduction overlaps the backward.
    pub fn overlap_grad_reduce(self) -> bool {
        matches!(
            self,
            Runtime::Nemo | Runtime::Torchtitan | Runtime::LlmFoundry
        )
    }

    /// Whether the all-gather of updated weights under a sharded optimizer overlaps the next
    /// forward.
    pub fn overlap_param_gather(self) -> bool {
        self.overlap_grad_reduce()
    }

    /// The training options of this runtime for sequences of `seq` tokens, in `precision`
    /// and with `attention` where given (else the runtime's), with `memory_headroom`,
    /// Megatron-LM's vocabulary padding of `vocab_multiple`, and the `given` settings over the
    /// runtime's.
    pub fn options(
        self,
        seq: u64,
        precision: Option<Precision>,
        attention: Option<Attention>,
        memory_headroom: f64,
        vocab_multiple: u64,
        given: GivenSettings,
    ) -> TrainingOptions {
        let precision = precision.unwrap_or(self.precision());
        TrainingOptions {
            seq,
            precision,
            attention: attention.unwrap_or(self.attention()),
            memory_headroom,
            vocab_multiple,
            grad_accumulation_fusion: given
                .grad_accumulation_fusion
                .unwrap_or(self.grad_accumulation_fusion()),
            grad_reduce_in_fp32: given
                .grad_reduce_in_fp32
                .unwrap_or(self.grad_reduce_in_fp32(precision)),
            overlap_grad_reduce: given
                .overlap_grad_reduce
                .unwrap_or(self.overlap_grad_reduce()),
            overlap_param_gather: given
                .overlap_param_gather
                .unwrap_or(self.overlap_param_gather()),
            moe_routing: Default::default(),
            fp32_loss: given.fp32_loss.unwrap_or(self.fp32_loss()),
            eager_elementwise: given.eager_elementwise.unwrap_or(self.eager_elementwise()),
            // No runtime trains in FP8 unless asked to (NeMo's and Megatron-LM's recipes
            // default to bf16; their FP8 runs pass `fp8`).
            fp8: given.fp8.unwrap_or(false),
            tp_comm_overlap: given.tp_comm_overlap.unwrap_or(self.tp_comm_overlap()),
            backward_prefetch: given.backward_prefetch.unwrap_or(self.backward_prefetch()),
        }
    }

    /// When a fully sharded (ZeRO-3) layout gathers each block's weights for its backward
    /// ([`BackwardPrefetch`]): FSDP2 (torchtitan) prefetches the next block's gather ahead of
    /// the current block's backward, and DeepSpeed's ZeRO-3 prefetches by its recorded trace.
    ///
    /// Composer's `FSDPConfig` defaults `backward_prefetch` to `'BACKWARD_POST'`, and
    /// llm-foundry's MPT recipes keep it, but llm-foundry is still priced with `pre`: its
    /// published runs are what the presets' matmul efficiencies are fitted to
    /// ([`crate::cost::cluster::AMPERE_MATMUL_EFFICIENCY`]), and pricing them with `post`
    /// moves that fit (0.75 to 0.76 on Ampere, 0.61 to 0.63 on Hopper), which makes every
    /// dataset fitted on neither faster and further from its measured times. Until that is
    /// resolved, `backward_prefetch = "post"` prices a Composer run as it is configured.
    pub fn backward_prefetch(self) -> BackwardPrefetch {
        BackwardPrefetch::Pre
    }

    /// Whether Transformer Engine's userbuffers overlap tensor-parallel communication with
    /// the products ([`TrainingOptions::tp_comm_overlap`]): NeMo's recipes add
    /// `MegatronCommOverlapCallback(tp_comm_overlap=True)` with a userbuffers configuration
    /// per model (`nemo/collections/llm/recipes/tp_overlap_configs/userbuffers.py`: GPT-3 20B
    /// at tp 2, GPT-3 175B and the 70B LLaMAs at tp 4); Megatron-Core's `--tp-comm-overlap` is
    /// off by default, and the other runtimes have no userbuffers.
    pub fn tp_comm_overlap(self) -> bool {
        matches!(self, Runtime::Nemo)
    }

    /// Whether RMSNorm, RoPE and SwiGLU run as eager PyTorch composites of elementwise
    /// kernels ([`TrainingOptions::eager_elementwise`]): torchtitan's default `norm_type =
    /// "rmsnorm"` (`x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)` on `x.float()`,
    /// then `.type_as(x) * weight`), its `apply_rotary_emb` (through `torch.view_as_complex`
    /// on fp32 copies) and its `FeedForward` (`w2(F.silu(w1(x)) * w3(x))`), in eager mode.
    pub fn eager_elementwise(self) -> bool {
        matches!(self, Runtime::Torchtitan)
    }

    /// Whether the loss is PyTorch's unfused cross-entropy on fp32 logits
    /// ([`TrainingOptions::fp32_loss`]): torchtitan's `cross_entropy_loss` calls
    /// `torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))`.
    pub fn fp32_loss(self) -> bool {
        matches!(self, Runtime::Torchtitan)
    }

    /// Whether weight gradients accumulate inside the weight-gradient products.
    pub fn grad_accumulation_fusion(self) -> bool {
        matches!(
            self,
            Runtime::MegatronCore | Runtime::Nemo | Runtime::MegatronDeepspeed
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_parses_back() {
        for r in Runtime::ALL {
            assert_eq!(Runtime::parse(r.name()), Some(r));
            let json = serde_json::to_string(&r).expect("serialises");
            assert_eq!(json, format!("\"{}\"", r.name()));
        }
        assert_eq!(Runtime::parse("megatron"), None);
    }
}
