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

    /// Bytes per parameter of (weights, gradients, optimizer states) with Adam:
    /// mixed precision keeps 16-bit weights and gradients plus fp32 master weights, momentum
    /// and variance (2 + 2 + 12 = 16 bytes); fp32 keeps fp32 weights, gradients and the two
    /// moments (4 + 4 + 8 = 16 bytes).
    pub fn state_bytes(self) -> (f64, f64, f64) {
        match self {
            Precision::Bf16 | Precision::Fp16 => (2.0, 2.0, 12.0),
            Precision::Fp32 => (4.0, 4.0, 8.0),
        }
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

/// Model states of `params` parameters on a device with data-parallel degree `dp` under ZeRO
/// stage `zero`: stage 1 shards the optimizer states over the data-parallel group, stage 2 also
/// the gradients, stage 3 also the weights.
///
/// Mixed precision: plain 16 Ψ; ZeRO-1 4 Ψ + 12 Ψ/d; ZeRO-2 2 Ψ + 14 Ψ/d; ZeRO-3 16 Ψ/d.
pub fn model_states(params: f64, precision: Precision, zero: u8, dp: u64) -> ModelStates {
    let (w, g, o) = precision.state_bytes();
    let d = dp.max(1) as f64;
    let shard = |stage: u8, bytes: f64| {
        if zero >= stage {
            bytes * params / d
        } else {
            bytes * params
        }
    };
    ModelStates {
        weights: shard(3, w),
        grads: shard(2, g),
        optimizer: shard(1, o),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_stages_match_the_paper() {
        let psi = 1e9;
        let d = 64;
        let total = |z| {
            let s = model_states(psi, Precision::Bf16, z, d);
            s.weights + s.grads + s.optimizer
        };
        let df = d as f64;
        assert_eq!(total(0), 16.0 * psi);
        assert_eq!(total(1), 4.0 * psi + 12.0 * psi / df);
        assert_eq!(total(2), 2.0 * psi + 14.0 * psi / df);
        assert_eq!(total(3), 16.0 * psi / df);
        let s = model_states(psi, Precision::Fp32, 0, d);
        assert_eq!((s.weights, s.grads, s.optimizer), (4e9, 4e9, 8e9));
    }
}
