//! Training runtimes: the software a layout runs on, and what of it the cost model prices.
//!
//! Two runs of one layout differ by runtime: which attention kernel runs, whether weight
//! gradients accumulate inside their products, which precision the runtime's recipes use. A
//! preset sets those [`TrainingOptions`] fields the way each runtime's defaults (or, for
//! `megatron-2021`, the published scripts) set them; a flag or column given explicitly wins.
//!
//! | runtime            | precision | attention | weight-grad accumulation fusion |
//! |--------------------|-----------|-----------|---------------------------------|
//! | megatron-core      | bf16      | flash     | yes (`--gradient-accumulation-fusion`, default) |
//! | nemo               | bf16      | flash     | yes (NeMo runs Megatron-Core)    |
//! | megatron-deepspeed | bf16      | unfused   | yes (flash is `--use-flash-attn-v2`, opt in) |
//! | megatron-2021      | fp16      | unfused   | no (Megatron-LM's SC'21 scripts, `run_table_1.sh`) |
//! | torchtitan         | bf16      | flash     | no (autograd adds each micro-batch's gradient) |
//! | llm-foundry        | bf16      | flash     | no (Composer + FSDP, Triton flash attention) |

use crate::cost::memory::Precision;
use crate::model::frontend::Attention;
use serde::{Deserialize, Serialize};

/// A training runtime whose defaults a layout is priced with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Runtime {
    /// Megatron-LM with Megatron-Core (2023 on).
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
            _ => Attention::Flash,
        }
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
