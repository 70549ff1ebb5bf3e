//! Per-device memory: model states by ZeRO stage and precision (ALGORITHMS.md §5).

use serde::{Deserialize, Serialize};

/// Numeric precision of training.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// bf16 weights and activations, fp32 master weights and Adam moments.
    Bf16,
    /// fp16 weights and activations, fp32 master weights and Adam moments (loss scaling).
    Fp16,
    /// fp32 throughout.
    Fp32,
}

impl Precision {
    /// Element type of weights and activations.
    pub fn dtype(self) -> crate::model::graph::DType {
        match self {
            Precision::Bf16 => crate::model::graph::DType::Bf16,
            Precision::Fp16 => crate::model::graph::DType::F16,
            Precision::Fp32 => crate::model::graph::DType::F32,
        }
    }

    /// Name as written in files.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
            Precision::Fp32 => "fp32",
        }
    }

    /// Bytes an optimizer step reads and writes per parameter it updates, as Megatron-LM's
    /// step runs: the gradient norm for clipping reads the gradient (4, fp32 main gradients);
    /// Adam reads master weight, gradient, momentum and variance and writes back three of them
    /// (28); mixed precision then copies the master weight to the working weight (4 + 2).
    pub fn optimizer_traffic(self) -> f64 {
        match self {
            Precision::Bf16 | Precision::Fp16 => 4.0 + 28.0 + 6.0,
            Precision::Fp32 => 4.0 + 28.0,
        }
    }
}

/// Bytes per weight that FP8 training keeps besides the weight itself: Transformer Engine's
/// linear layers cast each weight to FP8 once per step (on the first micro-batch) and keep the
/// copy and its transpose for every micro-batch's products (`weight_fp8`, `weight_t_fp8`).
pub const FP8_WEIGHT_COPY_BYTES: f64 = 2.0;

/// Bytes per parameter that Adam training keeps: working weights, the gradient buffer the
/// backward accumulates into (and the data-parallel collectives move), and the optimizer's own
/// states.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct StateBytes {
    /// Working weights.
    pub weights: f64,
    /// Gradient buffer, and bytes per element of the gradient collectives.
    pub grads: f64,
    /// Optimizer states: fp32 master weights, Adam's two moments, and an fp32 copy of 16-bit
    /// gradients when the buffer is not fp32 already.
    pub optimizer: f64,
}

impl StateBytes {
    /// The bytes of `precision`, with gradients accumulated and reduced in fp32 or not.
    ///
    /// These are Megatron-LM's counts (README, "Distributed optimizer": 20 bytes per parameter
    /// for fp16 weights and gradients, 18 for bf16 weights with fp32 gradients, 16 for fp32),
    /// which DeepSpeed's ZeRO optimizers share: its 16-bit optimizers copy the reduced
    /// gradients into fp32 partitions before the step (the ZeRO paper's 16 bytes leave that
    /// copy out).
    pub fn of(precision: Precision, grads_in_fp32: bool) -> StateBytes {
        match (precision, grads_in_fp32) {
            (Precision::Fp32, _) => StateBytes {
                weights: 4.0,
                grads: 4.0,
                optimizer: 8.0,
            },
            (_, true) => StateBytes {
                weights: 2.0,
                grads: 4.0,
                optimizer: 12.0,
            },
            (_, false) => StateBytes {
                weights: 2.0,
                grads: 2.0,
                optimizer: 16.0,
            },
        }
    }

    /// Bytes per parameter in all.
    pub fn total(self) -> f64 {
        self.weights + self.grads + self.optimizer
    }
}

/// Model states on one device, bytes.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelStates {
    /// Working weights.
    pub weights: f64,
    /// Gradients.
    pub grads: f64,
    /// Optimizer states (master weights and moments).
    pub optimizer: f64,
}

/// The backward transient of PyTorch's unfused cross-entropy on fp32 logits (torchtitan's
/// loss), given the bytes of the fp32 log-probabilities it saved: `log_softmax`'s backward
/// holds its output gradient and writes its input gradient, both fp32 and as large.
pub fn fp32_loss_working(saved_probs: f64) -> f64 {
    2.0 * saved_probs
}

/// Model states of `params` parameters on a device with data-parallel degree `dp` under ZeRO
/// stage `zero`: stage 1 shards the optimizer states over the data-parallel group (Megatron-LM's
/// distributed optimizer), stage 2 also the gradients, stage 3 everything.
///
/// bf16 with fp32 gradients: plain 18 Ψ; ZeRO-1 6 Ψ + 12 Ψ/d; ZeRO-2 2 Ψ + 16 Ψ/d. 16-bit
/// gradients: 20 Ψ; 4 Ψ + 16 Ψ/d; 2 Ψ + 18 Ψ/d. ZeRO-3 keeps 16 Ψ/d whatever the precision:
/// FSDP and ZeRO-3 hold one persistent copy of each weight, the fp32 master (the 16-bit
/// working weights of a layer are gathered for it and freed), its fp32 gradient shard and the
/// two moments.
pub fn model_states(params: f64, bytes: StateBytes, zero: u8, dp: u64) -> ModelStates {
    let d = dp.max(1) as f64;
    if zero >= 3 {
        let (w, g) = (bytes.weights, bytes.grads);
        return ModelStates {
            weights: w * params / d,
            grads: g * params / d,
            optimizer: (16.0 - w - g) * params / d,
        };
    }
    let shard = |stage: u8, b: f64| {
        if zero >= stage {
            b * params / d
        } else {
            b * params
        }
    };
    ModelStates {
        weights: bytes.weights * params,
        grads: shard(2, bytes.grads),
        optimizer: shard(1, bytes.optimizer),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_stages_match_megatron_lms_table() {
        let psi = 1e9;
        let d = 64;
        let df = d as f64;
        let total = |precision, fp32_grads, z| {
            let s = model_states(psi, StateBytes::of(precision, fp32_grads), z, d);
            s.weights + s.grads + s.optimizer
        };
        let close = |a: f64, b: f64| (a - b).abs() < 1e-6 * b;
        // Megatron-LM's README: non-distributed and distributed optimizer.
        assert!(close(total(Precision::Fp16, false, 0), 20.0 * psi));
        assert!(close(
            total(Precision::Fp16, false, 1),
            4.0 * psi + 16.0 * psi / df
        ));
        assert!(close(total(Precision::Bf16, true, 0), 18.0 * psi));
        assert!(close(
            total(Precision::Bf16, true, 1),
            6.0 * psi + 12.0 * psi / df
        ));
        assert!(close(total(Precision::Fp32, true, 0), 16.0 * psi));
        assert!(close(
            total(Precision::Fp32, false, 1),
            8.0 * psi + 8.0 * psi / df
        ));
        // ZeRO-2 shards the gradients too; ZeRO-3 (FSDP) 16 bytes, all sharded.
        assert!(close(
            total(Precision::Bf16, true, 2),
            2.0 * psi + 16.0 * psi / df
        ));
        assert!(close(
            total(Precision::Bf16, false, 2),
            2.0 * psi + 18.0 * psi / df
        ));
        for (p, g) in [
            (Precision::Bf16, true),
            (Precision::Fp16, false),
            (Precision::Fp32, true),
        ] {
            assert!(close(total(p, g, 3), 16.0 * psi / df));
        }
        let s = model_states(psi, StateBytes::of(Precision::Fp32, false), 0, d);
        assert_eq!((s.weights, s.grads, s.optimizer), (4e9, 4e9, 8e9));
    }
}
