//! Derives the backward pass of a forward graph: one place that knows, for every op kind, which
//! backward kernels run, what they read and write, and how many FLOPs they cost.

use super::flops::{FLASH_BACKWARD_FLOPS_FACTOR, flops_per_element as fpe};
use super::{Graph, GraphError, Op, OpId, OpKind, Pass, Tensor, TensorId, TensorKind};
use std::collections::HashMap;

struct Autodiff<'g> {
    g: &'g mut Graph,
    /// Current gradient tensor of each activation or parameter.
    grads: HashMap<TensorId, TensorId>,
}

/// Appends the backward ops of `g`, in execution order (reverse of the forward pass).
///
/// Gradients start at the outputs nothing consumes (the loss). A tensor read by several ops gets
/// its gradient contributions summed by an `add` op; weight gradients are accumulated in place in
/// the gradient buffer, so they need none.
pub(super) fn differentiate(g: &mut Graph) -> Result<(), GraphError> {
    let forward: Vec<OpId> = (0..g.ops.len() as u32).map(OpId).collect();
    let mut consumed = vec![false; g.tensors.len()];
    for op in &g.ops {
        for &t in &op.inputs {
            consumed[t.0 as usize] = true;
        }
    }
    let mut ad = Autodiff {
        g,
        grads: HashMap::new(),
    };
    // Seed: every unconsumed output that depends on a parameter.
    for &o in &forward {
        for t in ad.g.op(o).outputs.clone() {
            let tensor = ad.g.tensor(t);
            if !consumed[t.0 as usize] && tensor.requires_grad {
                let seed = ad.grad_tensor(t, "seed");
                ad.grads.insert(t, seed);
            }
        }
    }
    if ad.grads.is_empty() {
        return Err(GraphError::new(
            &ad.g.name,
            "no output depends on a parameter, so there is nothing to train",
        ));
    }
    for &o in forward.iter().rev() {
        ad.backward_of(o)?;
    }
    Ok(())
}

impl Autodiff<'_> {
    fn grad_tensor(&mut self, of: TensorId, tag: &str) -> TensorId {
        let t = self.g.tensor(of).clone();
        let id = TensorId(self.g.tensors.len() as u32);
        let name = if tag.is_empty() {
            format!("d{}", t.name)
        } else {
            format!("d{}.{tag}", t.name)
        };
        let kind = if t.kind == TensorKind::Parameter {
            TensorKind::WeightGradient
        } else {
            TensorKind::Gradient
        };
        self.g.tensors.push(Tensor {
            name,
            kind,
            requires_grad: false,
            ..t
        });
        id
    }

    fn emit(
        &mut self,
        fwd: OpId,
        suffix: &str,
        kind: OpKind,
        inputs: Vec<TensorId>,
        outputs: Vec<TensorId>,
        flops: f64,
    ) {
        let f = self.g.op(fwd).clone();
        let id = OpId(self.g.ops.len() as u32);
        self.g.ops.push(Op {
            name: format!("{}.{suffix}", f.name),
            kind,
            pass: Pass::Backward,
            inputs,
            outputs,
            saves: Vec::new(),
            layer: f.layer,
            attention_core: f.attention_core,
            eager: f.eager,
            // The products of an FP8 linear layer (its input and weight gradients) run in FP8.
            fp8: f.fp8 && kind.is_matmul(),
            flops,
            grad_of: Some(fwd),
        });
        self.g.layers[f.layer as usize].backward.push(id);
    }

    /// Records `grad` as (a contribution to) the gradient of `of`.
    fn contribute(&mut self, fwd: OpId, of: TensorId, grad: TensorId) {
        let Some(&prev) = self.grads.get(&of) else {
            self.grads.insert(of, grad);
            return;
        };
        if self.g.tensor(of).kind == TensorKind::Parameter {
            // Weight gradients accumulate in place in the gradient buffer.
            return;
        }
        let sum = self.grad_tensor(of, "sum");
        let n = self.g.tensor(of).elements() as f64;
        self.emit(
            fwd,
            &format!("accumulate.{}", self.g.tensor(of).name),
            OpKind::Add,
            vec![prev, grad],
            vec![sum],
            n,
        );
        self.grads.insert(of, sum);
    }

    /// A fresh gradient tensor for `of` if it requires a gradient.
    fn new_grad(&mut self, of: TensorId) -> Option<TensorId> {
        self.g
            .tensor(of)
            .requires_grad
            .then(|| self.grad_tensor(of, ""))
    }

    /// One backward op `(suffix, kind)` of forward op `o` (`op`) reading `reads` and writing
    /// the gradient of every input of `op` that needs one, if any does.
    fn input_grads_at_once(
        &mut self,
        o: OpId,
        op: &Op,
        (suffix, kind): (&str, OpKind),
        reads: Vec<TensorId>,
        flops: f64,
    ) {
        let pairs: Vec<(TensorId, TensorId)> = op
            .inputs
            .iter()
            .filter_map(|&t| Some((t, self.new_grad(t)?)))
            .collect();
        if pairs.is_empty() {
            return;
        }
        let outs = pairs.iter().map(|&(_, dt)| dt).collect();
        self.emit(o, suffix, kind, reads, outs, flops);
        for (t, dt) in pairs {
            self.contribute(o, t, dt);
        }
    }

    fn backward_of(&mut self, o: OpId) -> Result<(), GraphError> {
        let op = self.g.op(o).clone();
        let dys: Vec<TensorId> = op
            .outputs
            .iter()
            .filter_map(|t| self.grads.get(t).copied())
            .collect();
        let Some(&dy) = dys.first() else {
            return Ok(()); // no gradient reaches this op's outputs
        };
        let x = op.inputs.first().copied();
        let numel = |g: &Graph, t: TensorId| g.tensor(t).elements() as f64;
        match op.kind {
            OpKind::MatMul { transpose_b } => {
                let (x, w) = (op.inputs[0], op.inputs[1]);
                if let Some(dx) = self.new_grad(x) {
                    self.emit(
                        o,
                        "dgrad",
                        OpKind::MatMul {
                            transpose_b: !transpose_b,
                        },
                        vec![dy, w],
                        vec![dx],
                        op.flops,
                    );
                    self.contribute(o, x, dx);
                }
                if let Some(dw) = self.new_grad(w) {
                    let mut outs = vec![dw];
                    if let Some(&b) = op.inputs.get(2)
                        && let Some(db) = self.new_grad(b)
                    {
                        outs.push(db);
                        self.contribute(o, b, db);
                    }
                    self.emit(
                        o,
                        "wgrad",
                        OpKind::MatMul { transpose_b },
                        vec![x, dy],
                        outs,
                        op.flops,
                    );
                    self.contribute(o, w, dw);
                }
            }
            OpKind::BatchMatMul { transpose_b } => {
                let (a, b) = (op.inputs[0], op.inputs[1]);
                if let Some(da) = self.new_grad(a) {
                    self.emit(
                        o,
                        "grad_a",
                        OpKind::BatchMatMul {
                            transpose_b: !transpose_b,
                        },
                        vec![dy, b],
                        vec![da],
                        op.flops,
                    );
                    self.contribute(o, a, da);
                }
                if let Some(db) = self.new_grad(b) {
                    self.emit(
                        o,
                        "grad_b",
                        OpKind::BatchMatMul { transpose_b: false },
                        vec![a, dy],
                        vec![db],
                        op.flops,
                    );
                    self.contribute(o, b, db);
                }
            }
            OpKind::Embedding => {
                let (ids, table) = (op.inputs[0], op.inputs[1]);
                if let Some(dt) = self.new_grad(table) {
                    let n = numel(self.g, dy);
                    self.emit(o, "grad", OpKind::EmbeddingGrad, vec![ids, dy], vec![dt], n);
                    self.contribute(o, table, dt);
                }
            }
            OpKind::LayerNorm | OpKind::RmsNorm => {
                let x = op.inputs[0];
                let mut outs = Vec::new();
                let dx = self.new_grad(x);
                outs.extend(dx);
                let mut param_grads = Vec::new();
                for &p in &op.inputs[1..] {
                    if let Some(dp) = self.new_grad(p) {
                        outs.push(dp);
                        param_grads.push((p, dp));
                    }
                }
                let per = if op.kind == OpKind::LayerNorm {
                    fpe::LAYER_NORM
                } else {
                    fpe::RMS_NORM
                };
                let mut inputs = vec![x, dy];
                inputs.extend_from_slice(&op.inputs[1..]);
                let n = numel(self.g, x);
                self.emit(
                    o,
                    "grad",
                    op.kind,
                    inputs,
                    outs,
                    per * fpe::BACKWARD_FACTOR * n,
                );
                if let Some(dx) = dx {
                    self.contribute(o, x, dx);
                }
                for (p, dp) in param_grads {
                    self.contribute(o, p, dp);
                }
            }
            OpKind::Softmax
            | OpKind::Gelu
            | OpKind::Silu
            | OpKind::SwiGlu
            | OpKind::Rope
            | OpKind::Transpose
            | OpKind::Dropout => {
                let Some(x) = x else { return Ok(()) };
                if let Some(dx) = self.new_grad(x) {
                    // What each backward kernel reads besides the output gradient.
                    let saved: Vec<TensorId> = match op.kind {
                        OpKind::Softmax | OpKind::Dropout => op.saves.clone(),
                        OpKind::Rope | OpKind::Transpose => vec![],
                        _ => vec![x],
                    };
                    let mut inputs = vec![dy];
                    inputs.extend(saved);
                    let n = numel(self.g, x);
                    let per = match op.kind {
                        OpKind::Softmax => fpe::SOFTMAX,
                        OpKind::Gelu => fpe::GELU,
                        OpKind::Silu => fpe::SILU,
                        OpKind::SwiGlu => fpe::SWIGLU / 2.0,
                        OpKind::Rope => fpe::ROPE,
                        OpKind::Transpose => 0.0,
                        _ => fpe::DROPOUT,
                    };
                    self.emit(
                        o,
                        "grad",
                        op.kind,
                        inputs,
                        vec![dx],
                        per * fpe::BACKWARD_FACTOR * n,
                    );
                    self.contribute(o, x, dx);
                }
            }
            OpKind::Add => {
                // The gradient of a sum is the output gradient itself, for both operands.
                for &t in &op.inputs {
                    if self.g.tensor(t).requires_grad {
                        self.contribute(o, t, dy);
                    }
                }
            }
            OpKind::DropoutAdd => {
                let (x, residual) = (op.inputs[0], op.inputs[1]);
                if self.g.tensor(residual).requires_grad {
                    self.contribute(o, residual, dy);
                }
                if let Some(dx) = self.new_grad(x) {
                    let mut inputs = vec![dy];
                    inputs.extend(op.saves.iter().copied());
                    let n = numel(self.g, x);
                    self.emit(
                        o,
                        "grad",
                        OpKind::Dropout,
                        inputs,
                        vec![dx],
                        fpe::DROPOUT * fpe::BACKWARD_FACTOR * n,
                    );
                    self.contribute(o, x, dx);
                }
            }
            OpKind::Mul => {
                let (a, b) = (op.inputs[0], op.inputs[1]);
                let da = self.new_grad(a);
                let db = self.new_grad(b);
                let outs: Vec<TensorId> = da.iter().chain(db.iter()).copied().collect();
                if !outs.is_empty() {
                    let flops = numel(self.g, a) * outs.len() as f64;
                    self.emit(o, "grad", OpKind::Mul, vec![a, b, dy], outs, flops);
                }
                if let Some(da) = da {
                    self.contribute(o, a, da);
                }
                if let Some(db) = db {
                    self.contribute(o, b, db);
                }
            }
            OpKind::FlashAttention { .. } => {
                let mut reads = op.inputs.clone();
                reads.push(op.outputs[0]);
                reads.push(dy);
                let flops = op.flops * FLASH_BACKWARD_FLOPS_FACTOR;
                self.input_grads_at_once(o, &op, ("grad", op.kind), reads, flops);
            }
            OpKind::CrossEntropy => {
                let (logits, labels) = (op.inputs[0], op.inputs[1]);
                if let Some(dl) = self.new_grad(logits) {
                    let mut inputs = op.saves.clone();
                    inputs.push(labels);
                    let n = numel(self.g, logits);
                    self.emit(
                        o,
                        "grad",
                        OpKind::CrossEntropy,
                        inputs,
                        vec![dl],
                        fpe::BACKWARD_FACTOR * n,
                    );
                    self.contribute(o, logits, dl);
                }
            }
            OpKind::Slice => {
                let x = op.inputs[0];
                if let Some(dx) = self.new_grad(x) {
                    let parts: Vec<TensorId> = op
                        .outputs
                        .iter()
                        .filter_map(|t| self.grads.get(t).copied())
                        .collect();
                    self.emit(o, "assemble", OpKind::Slice, parts, vec![dx], 0.0);
                    self.contribute(o, x, dx);
                }
            }
            OpKind::Opaque { .. } => {
                // Unknown semantics: one backward op reads every output gradient and every
                // forward input.
                let mut reads = dys.clone();
                reads.extend(op.inputs.iter().copied());
                self.input_grads_at_once(o, &op, ("grad", op.kind), reads, 0.0);
            }
            OpKind::Concat => {
                // A broadcast input's gradient sums the output gradient over the broadcast axes.
                let out_n = numel(self.g, op.outputs[0]);
                let out_last = *self.g.tensor(op.outputs[0]).shape.last().unwrap_or(&1) as f64;
                let flops: f64 = op
                    .inputs
                    .iter()
                    .filter(|&&t| self.g.tensor(t).requires_grad)
                    .map(|&t| {
                        let last = *self.g.tensor(t).shape.last().unwrap_or(&0) as f64;
                        let whole = out_n * last / out_last;
                        if numel(self.g, t) < whole { whole } else { 0.0 }
                    })
                    .sum();
                self.input_grads_at_once(o, &op, ("split", OpKind::Slice), vec![dy], flops);
            }
            OpKind::MoeRouter => {
                let scores = op.inputs[0];
                if let Some(ds) = self.new_grad(scores) {
                    let mut inputs = vec![dy];
                    inputs.extend(op.saves.iter().copied());
                    let n = numel(self.g, scores);
                    self.emit(
                        o,
                        "grad",
                        OpKind::MoeRouter,
                        inputs,
                        vec![ds],
                        fpe::SOFTMAX * fpe::BACKWARD_FACTOR * n,
                    );
                    self.contribute(o, scores, ds);
                }
            }
            OpKind::MoeDispatch => {
                // Each token's gradient sums those of its copies: a combine without gates.
                let (x, idx) = (op.inputs[0], op.inputs[1]);
                if let Some(dx) = self.new_grad(x) {
                    let copies =
                        numel(self.g, idx) * *self.g.tensor(x).shape.last().unwrap_or(&0) as f64;
                    self.emit(
                        o,
                        "grad",
                        OpKind::MoeCombine,
                        vec![dy, idx],
                        vec![dx],
                        copies,
                    );
                    self.contribute(o, x, dx);
                }
            }
            OpKind::MoeCombine => {
                // The experts' outputs get the gate-weighted token gradients (a dispatch), the
                // gates each a dot product of the token gradient with their expert's output.
                let (y, gates, idx) = (op.inputs[0], op.inputs[1], op.inputs[2]);
                let dy_e = self.new_grad(y);
                let dg = self.new_grad(gates);
                let outs: Vec<TensorId> = dy_e.iter().chain(dg.iter()).copied().collect();
                if !outs.is_empty() {
                    let h = *self.g.tensor(y).shape.last().unwrap_or(&0) as f64;
                    let flops = numel(self.g, gates) * h * (outs.len() as f64 + 1.0);
                    self.emit(
                        o,
                        "grad",
                        OpKind::MoeDispatch,
                        vec![dy, y, gates, idx],
                        outs,
                        flops,
                    );
                }
                if let Some(d) = dy_e {
                    self.contribute(o, y, d);
                }
                if let Some(d) = dg {
                    self.contribute(o, gates, d);
                }
            }
            OpKind::EmbeddingGrad => {
                return Err(GraphError::new(
                    &op.name,
                    "embedding_grad cannot appear in a forward graph",
                ));
            }
        }
        Ok(())
    }
}
