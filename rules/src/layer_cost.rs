//! What one layer costs on one device under a tensor-parallel configuration: kernel time and
//! communication per micro-batch, activations kept for the backward pass under each
//! recomputation mode, parameters held.

use crate::cluster::{Device, Link};
use crate::cost::{collective_time, kernel_time, op_traffic};
use crate::graph::{DType, Graph, LayerKind, OpId, OpKind, TensorId, TensorKind};
use crate::tensor_parallel::{
    Phase, TpConfig, collectives, gemm_shape, op_device_flops, stored_bytes, stored_elements,
    tensor_bytes_in_op,
};

/// How the framework runs kernels, beyond what the hardware determines.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KernelOptions {
    /// Dtype of weights and activations.
    pub dtype: DType,
    /// Bytes per element of the gradient buffer weight gradients accumulate into across
    /// micro-batches.
    pub grad_buffer_bytes: f64,
    /// Weight-gradient products accumulate straight into the gradient buffer
    /// (Megatron-LM's `--gradient-accumulation-fusion`); otherwise every micro-batch adds
    /// each fresh weight gradient to the buffer in a separate kernel.
    pub grad_accumulation_fusion: bool,
}
use std::collections::{HashMap, HashSet};

/// Costs of one layer per micro-batch on one device.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerCost {
    /// Role of the layer.
    pub kind: LayerKind,
    /// Forward kernel time, s.
    pub fwd_compute: f64,
    /// Forward tensor-parallel communication, s.
    pub fwd_comm: f64,
    /// Backward kernel time, s.
    pub bwd_compute: f64,
    /// Backward tensor-parallel communication not hidden behind compute, s.
    pub bwd_comm: f64,
    /// Forward kernel time of the attention-core ops (what selective recomputation re-runs), s.
    pub attention_core_compute: f64,
    /// Forward FLOPs of the whole layer (all ranks together).
    pub fwd_flops: f64,
    /// Backward FLOPs of the whole layer.
    pub bwd_flops: f64,
    /// Forward FLOPs of the attention core.
    pub attention_core_flops: f64,
    /// Activations kept for the backward pass without recomputation, bytes per device.
    pub saved: f64,
    /// Activations kept under selective recomputation (attention-core outputs dropped).
    pub saved_selective: f64,
    /// The layer's input, the only activation kept under full recomputation, bytes per device.
    pub checkpoint: f64,
    /// Largest activation gradient of the backward pass, bytes per device.
    pub grad_working: f64,
    /// Parameters the layer owns, elements per device.
    pub params: f64,
    /// Parameters the layer reads but another layer owns (a tied output embedding), as
    /// (owning layer, elements per device).
    pub borrowed_params: Vec<(usize, f64)>,
    /// Size of the activation entering the layer, bytes (unsharded).
    pub input_bytes: f64,
}

/// Costs of every layer of `g` on `device`, with tensor-parallel groups on `tp_link`.
pub fn layer_costs(
    g: &Graph,
    tp: TpConfig,
    device: &Device,
    kernels: &KernelOptions,
    tp_link: Link,
) -> Vec<LayerCost> {
    let dtype = kernels.dtype;
    let owned = g.owned_parameters();
    // Which op produced each activation, including the implicit ones (dropout masks).
    let mut producer: HashMap<TensorId, OpId> = HashMap::new();
    let mut savers: HashMap<TensorId, Vec<OpId>> = HashMap::new();
    for layer in &g.layers {
        for &o in &layer.forward {
            let op = g.op(o);
            for &t in op.outputs.iter().chain(&op.saves) {
                if !op.inputs.contains(&t) {
                    producer.entry(t).or_insert(o);
                }
            }
            for &t in &op.saves {
                savers.entry(t).or_default().push(o);
            }
        }
    }
    let is_core = |o: OpId| g.op(o).attention_core;
    let op_time = |o: OpId| {
        let op = g.op(o);
        let flops = op_device_flops(g, op, tp);
        let mut bytes = op_traffic(op, |t| tensor_bytes_in_op(g, op, t, tp));
        let mut accumulate = 0.0;
        for &t in &op.outputs {
            let tensor = g.tensor(t);
            if tensor.kind != TensorKind::WeightGradient {
                continue;
            }
            let elements = stored_elements(g, t, tp);
            let fresh = tensor.dtype.bytes() as f64;
            let buffer = 2.0 * kernels.grad_buffer_bytes;
            if kernels.grad_accumulation_fusion && op.kind.is_matmul() {
                // The product reads and writes the buffer instead of writing a fresh gradient.
                bytes += elements * (buffer - fresh);
            } else {
                accumulate += kernel_time(
                    OpKind::Add,
                    elements,
                    elements * (fresh + buffer),
                    device,
                    dtype,
                    None,
                );
            }
        }
        kernel_time(op.kind, flops, bytes, device, dtype, gemm_shape(g, op, tp)) + accumulate
    };
    g.layers
        .iter()
        .enumerate()
        .map(|(li, layer)| {
            let mut c = LayerCost {
                kind: layer.kind,
                fwd_compute: 0.0,
                fwd_comm: 0.0,
                bwd_compute: 0.0,
                bwd_comm: 0.0,
                attention_core_compute: 0.0,
                fwd_flops: 0.0,
                bwd_flops: 0.0,
                attention_core_flops: 0.0,
                saved: 0.0,
                saved_selective: 0.0,
                checkpoint: 0.0,
                grad_working: 0.0,
                params: 0.0,
                borrowed_params: Vec::new(),
                input_bytes: 0.0,
            };
            for &o in &layer.forward {
                let op = g.op(o);
                let t = op_time(o);
                c.fwd_compute += t;
                c.fwd_flops += op.flops;
                if op.attention_core {
                    c.attention_core_compute += t;
                    c.attention_core_flops += op.flops;
                }
                for coll in collectives(g, op, tp) {
                    let ct = collective_time(coll.kind, tp.t, coll.bytes, tp_link);
                    match coll.phase {
                        Phase::Forward => c.fwd_comm += ct,
                        Phase::Backward => c.bwd_comm += ct,
                        // Overlapped with the input-gradient product, which costs about what
                        // the forward product did.
                        Phase::BackwardOverlapped => c.bwd_comm += (ct - t).max(0.0),
                    }
                }
            }
            for &o in &layer.backward {
                let op = g.op(o);
                c.bwd_compute += op_time(o);
                c.bwd_flops += op.flops;
                for &t in &op.outputs {
                    if g.tensor(t).kind == TensorKind::Gradient {
                        c.grad_working = c.grad_working.max(stored_bytes(g, t, tp));
                    }
                }
            }
            let saved = g.saved_activations(li);
            let recomputable: HashSet<TensorId> = saved
                .iter()
                .copied()
                .filter(|t| {
                    producer.get(t).is_some_and(|&p| is_core(p))
                        && savers.get(t).is_some_and(|s| s.iter().all(|&o| is_core(o)))
                })
                .collect();
            for &t in &saved {
                let b = stored_bytes(g, t, tp);
                c.saved += b;
                if !recomputable.contains(&t) {
                    c.saved_selective += b;
                }
            }
            for t in g.layer_inputs(li) {
                c.checkpoint += stored_bytes(g, t, tp);
                c.input_bytes += g.tensor(t).bytes() as f64;
            }
            c.params = owned[li].iter().map(|&t| stored_elements(g, t, tp)).sum();
            c.borrowed_params = g
                .borrowed_parameters(li, &owned)
                .iter()
                .filter_map(|&t| {
                    let owner = owned.iter().position(|o| o.contains(&t))?;
                    Some((owner, stored_elements(g, t, tp)))
                })
                .collect();
            c
        })
        .collect()
}
