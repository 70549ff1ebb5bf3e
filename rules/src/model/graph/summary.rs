//! Human- and machine-readable summary of a graph (what `autopar graph` prints).

use super::{Graph, LayerKind, Pass, TensorId};
use serde::Serialize;

/// One op as listed in a summary.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct OpSummary {
    /// Op name.
    pub name: String,
    /// Op kind.
    pub kind: String,
    /// Forward or backward.
    pub pass: Pass,
    /// Input shapes.
    pub inputs: Vec<Vec<u64>>,
    /// Output shapes.
    pub outputs: Vec<Vec<u64>>,
    /// FLOPs of the op for one micro-batch.
    pub flops: f64,
}

/// Per-layer totals.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LayerSummary {
    /// Layer name.
    pub name: String,
    /// Layer role.
    pub kind: LayerKind,
    /// Parameters the layer owns.
    pub parameters: u64,
    /// Forward FLOPs per micro-batch.
    pub forward_flops: f64,
    /// Backward FLOPs per micro-batch.
    pub backward_flops: f64,
    /// Bytes of activations kept for the backward pass per micro-batch, unsharded.
    pub saved_activation_bytes: u64,
    /// Number of forward and backward ops.
    pub ops: usize,
}

/// A run of consecutive, structurally identical layers, with the ops of one of them.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LayerGroup {
    /// First layer index of the run.
    pub first: usize,
    /// Last layer index of the run (inclusive).
    pub last: usize,
    /// Totals of one layer of the run.
    pub layer: LayerSummary,
    /// Forward and backward ops of the first layer of the run.
    pub ops: Vec<OpSummary>,
}

/// Summary of a whole graph.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct GraphSummary {
    /// Model name.
    pub name: String,
    /// Micro-batch size of the instantiation.
    pub micro_batch: u64,
    /// Sequence length of the instantiation.
    pub seq: u64,
    /// Trained parameters.
    pub parameters: u64,
    /// Parameters one token's forward pass reads (fewer than `parameters` only with
    /// mixture-of-experts layers), input embedding tables counted whole.
    pub active_parameters: u64,
    /// The same without the input embedding tables (of which a token reads one row).
    pub active_parameters_without_input_embedding: u64,
    /// Forward FLOPs per token.
    pub forward_flops_per_token: f64,
    /// Forward + backward FLOPs per token (no recomputation).
    pub training_flops_per_token: f64,
    /// Number of ops (forward + backward).
    pub ops: usize,
    /// Runs of identical layers.
    pub groups: Vec<LayerGroup>,
}

impl Graph {
    /// Totals of one layer; `owned` is [`Graph::owned_parameters`].
    pub fn layer_summary(&self, li: usize, owned: &[Vec<TensorId>]) -> LayerSummary {
        let layer = &self.layers[li];
        let flops = |ids: &[super::OpId]| ids.iter().map(|&o| self.op(o).flops).sum::<f64>();
        LayerSummary {
            name: layer.name.clone(),
            kind: layer.kind,
            parameters: owned[li].iter().map(|&t| self.tensor(t).elements()).sum(),
            forward_flops: flops(&layer.forward),
            backward_flops: flops(&layer.backward),
            saved_activation_bytes: self
                .saved_activations(li)
                .iter()
                .map(|&t| self.tensor(t).bytes())
                .sum(),
            ops: layer.forward.len() + layer.backward.len(),
        }
    }

    /// Structural fingerprint of a layer: op kinds, FLOPs and tensor shapes, dtypes and splits,
    /// without names or ids. Two layers with equal fingerprints cost the same everywhere.
    pub fn layer_fingerprint(&self, li: usize) -> Vec<String> {
        let layer = &self.layers[li];
        layer
            .forward
            .iter()
            .chain(&layer.backward)
            .map(|&o| {
                let op = self.op(o);
                let shapes = |ids: &[TensorId]| {
                    ids.iter()
                        .map(|&t| {
                            let t = self.tensor(t);
                            format!("{:?}{:?}{:?}{:?}", t.shape, t.dtype, t.split, t.kind)
                        })
                        .collect::<Vec<_>>()
                        .join(",")
                };
                format!(
                    "{:?}|{:?}|{}|{}|{}|{}|{}",
                    op.kind,
                    op.pass,
                    op.attention_core,
                    op.flops.to_bits(),
                    shapes(&op.inputs),
                    shapes(&op.outputs),
                    shapes(&op.saves)
                )
            })
            .collect()
    }

    /// The summary `autopar graph` prints.
    pub fn summary(&self) -> GraphSummary {
        let tokens = (self.micro_batch * self.seq) as f64;
        let owned = self.owned_parameters();
        let active = self.active_parameter_counts();
        let mut groups: Vec<LayerGroup> = Vec::new();
        let mut prev: Option<Vec<String>> = None;
        for li in 0..self.layers.len() {
            let fp = self.layer_fingerprint(li);
            if prev.as_ref() == Some(&fp)
                && let Some(g) = groups.last_mut()
            {
                g.last = li;
                continue;
            }
            let layer = &self.layers[li];
            let ops = layer
                .forward
                .iter()
                .chain(&layer.backward)
                .map(|&o| {
                    let op = self.op(o);
                    let shapes = |ids: &[TensorId]| {
                        ids.iter().map(|&t| self.tensor(t).shape.clone()).collect()
                    };
                    OpSummary {
                        name: op.name.clone(),
                        kind: op.kind.name().to_string(),
                        pass: op.pass,
                        inputs: shapes(&op.inputs),
                        outputs: shapes(&op.outputs),
                        flops: op.flops,
                    }
                })
                .collect();
            groups.push(LayerGroup {
                first: li,
                last: li,
                layer: self.layer_summary(li, &owned),
                ops,
            });
            prev = Some(fp);
        }
        GraphSummary {
            name: self.name.clone(),
            micro_batch: self.micro_batch,
            seq: self.seq,
            parameters: self.parameter_count(),
            active_parameters: active.0,
            active_parameters_without_input_embedding: active.1,
            forward_flops_per_token: self.forward_flops() / tokens,
            training_flops_per_token: (self.forward_flops() + self.backward_flops()) / tokens,
            ops: self.ops.len(),
            groups,
        }
    }
}
