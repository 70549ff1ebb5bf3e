//! FLOP counts of the ops whose cost is not a matrix product, shared by the forward builder
//! and autodiff.

/// FLOPs per element of the non-matmul ops, forward pass. These ops are bound by memory
/// bandwidth on every GPU autopar models, so the counts only feed FLOP totals; they follow the
/// usual operation counting (one per add, multiply, compare, exp; GeLU's tanh form ~8).
pub(super) mod flops_per_element {
    /// LayerNorm: mean, variance, normalise, scale, shift.
    pub const LAYER_NORM: f64 = 8.0;
    /// RMSNorm: square, mean, rsqrt-scale, gain.
    pub const RMS_NORM: f64 = 4.0;
    /// Softmax with scale and mask: scale, mask, max, subtract, exp, sum, divide.
    pub const SOFTMAX: f64 = 7.0;
    /// GeLU, tanh approximation.
    pub const GELU: f64 = 8.0;
    /// SiLU: exp, add, divide, multiply.
    pub const SILU: f64 = 4.0;
    /// SwiGLU per output element: SiLU of the gate plus one product.
    pub const SWIGLU: f64 = 5.0;
    /// Dropout: compare against a random draw, multiply by the scaled mask.
    pub const DROPOUT: f64 = 2.0;
    /// Rotary embedding: two products and one add per element.
    pub const ROPE: f64 = 3.0;
    /// Cross-entropy per logit: max, subtract, exp, sum, log.
    pub const CROSS_ENTROPY: f64 = 5.0;
    /// Backward passes of elementwise ops: about twice their forward count.
    pub const BACKWARD_FACTOR: f64 = 2.0;
}

/// FlashAttention's backward pass runs five matrix products for the forward pass's two.
pub(super) const FLASH_BACKWARD_FLOPS_FACTOR: f64 = 2.5;
