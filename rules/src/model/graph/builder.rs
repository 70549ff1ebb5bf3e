//! Building the forward part of a graph, with the shape rules and FLOP counts of every op kind.

use super::flops::flops_per_element;
use super::{
    DType, Graph, GraphError, Layer, LayerKind, Op, OpId, OpKind, Pass, Split, Tensor, TensorId,
    TensorKind,
};

/// Builds a [`Graph`]: declare tensors, open layers, add forward ops; `finish` adds the backward.
#[derive(Debug)]
pub struct GraphBuilder {
    graph: Graph,
    produced: Vec<bool>,
    eager_elementwise: bool,
    fp8: bool,
}

impl GraphBuilder {
    /// A new, empty graph for one micro-batch of `micro_batch` sequences of `seq` tokens.
    pub fn new(name: impl Into<String>, micro_batch: u64, seq: u64) -> Self {
        GraphBuilder {
            graph: Graph {
                name: name.into(),
                micro_batch,
                seq,
                tensors: Vec::new(),
                ops: Vec::new(),
                layers: Vec::new(),
            },
            produced: Vec::new(),
            eager_elementwise: false,
            fp8: false,
        }
    }

    /// Runs the products with a weight that transformer blocks add from now on on the FP8
    /// tensor cores ([`Op::fp8`]), as Transformer Engine's linear layers do under FP8
    /// training; embeddings, the output layer and the attention core stay in the graph's dtype.
    pub fn fp8(&mut self, fp8: bool) {
        self.fp8 = fp8;
    }

    /// Marks the ops added from now on whose kind eager PyTorch runs as a composite of
    /// elementwise kernels ([`OpKind::has_eager_composite`]) as run that way.
    pub fn eager_elementwise(&mut self, eager: bool) {
        self.eager_elementwise = eager;
    }

    /// Starts a new layer; ops added from now on belong to it.
    pub fn begin_layer(&mut self, name: impl Into<String>, kind: LayerKind) {
        self.graph.layers.push(Layer {
            name: name.into(),
            kind,
            forward: Vec::new(),
            backward: Vec::new(),
        });
    }

    /// Declares a tensor. Inputs and parameters count as available at once; activations must be
    /// produced by exactly one op before they are read.
    pub fn tensor(
        &mut self,
        name: impl Into<String>,
        shape: Vec<u64>,
        dtype: DType,
        kind: TensorKind,
        split: Split,
    ) -> TensorId {
        let id = TensorId(self.graph.tensors.len() as u32);
        let requires_grad = kind == TensorKind::Parameter;
        let available = matches!(kind, TensorKind::Input | TensorKind::Parameter);
        self.graph.tensors.push(Tensor {
            name: name.into(),
            shape,
            dtype,
            kind,
            split,
            requires_grad,
        });
        self.produced.push(available);
        id
    }

    /// Shape of a declared tensor.
    pub fn shape(&self, id: TensorId) -> &[u64] {
        &self.graph.tensors[id.0 as usize].shape
    }

    /// Adds a forward op to the current layer after checking its operands against its kind.
    pub fn op(
        &mut self,
        name: impl Into<String>,
        kind: OpKind,
        inputs: &[TensorId],
        outputs: &[TensorId],
    ) -> Result<OpId, GraphError> {
        let name = name.into();
        let Some(layer) = self.graph.layers.len().checked_sub(1) else {
            return Err(GraphError::new(
                name,
                "op added before any layer was opened",
            ));
        };
        for &t in inputs.iter().chain(outputs) {
            if t.0 as usize >= self.graph.tensors.len() {
                return Err(GraphError::new(&name, format!("unknown tensor id {}", t.0)));
            }
        }
        for &t in inputs {
            if !self.produced[t.0 as usize] {
                let tn = &self.graph.tensors[t.0 as usize].name;
                return Err(GraphError::new(
                    &name,
                    format!("reads `{tn}` before any op produces it"),
                ));
            }
        }
        for &t in outputs {
            let tensor = &self.graph.tensors[t.0 as usize];
            if tensor.kind != TensorKind::Activation {
                return Err(GraphError::new(
                    &name,
                    format!(
                        "writes `{}`, which is declared as {:?}, not an activation",
                        tensor.name, tensor.kind
                    ),
                ));
            }
            if self.produced[t.0 as usize] {
                return Err(GraphError::new(
                    &name,
                    format!(
                        "writes `{}`, which another op already produced",
                        tensor.name
                    ),
                ));
            }
        }
        let (flops, mut saves) = self.forward_rules(&name, kind, inputs, outputs)?;
        let fp8 = self.fp8
            && self.graph.layers[layer].kind == LayerKind::Block
            && kind.is_matmul()
            && self.t(inputs[1]).kind == TensorKind::Parameter;
        if fp8 {
            // Transformer Engine keeps the FP8 copy of the input it cast (its `inputmat` or
            // `inputmat_t`, one byte per element) for the weight gradient, not the input.
            for t in saves.iter_mut() {
                if self.t(*t).kind == TensorKind::Activation {
                    *t = self.implicit(format!("{name}.input_fp8"), *t, DType::F8);
                }
            }
        }
        let requires_grad = inputs
            .iter()
            .any(|&t| self.graph.tensors[t.0 as usize].requires_grad);
        for &t in outputs {
            self.produced[t.0 as usize] = true;
            // Integer results (a router's expert indices) carry no gradient.
            let float = !matches!(
                self.graph.tensors[t.0 as usize].dtype,
                DType::I32 | DType::U8
            );
            self.graph.tensors[t.0 as usize].requires_grad = requires_grad && float;
        }
        let id = OpId(self.graph.ops.len() as u32);
        self.graph.ops.push(Op {
            name,
            kind,
            pass: Pass::Forward,
            inputs: inputs.to_vec(),
            outputs: outputs.to_vec(),
            saves,
            layer: layer as u32,
            attention_core: false,
            eager: self.eager_elementwise && kind.has_eager_composite(),
            fp8,
            flops,
            grad_of: None,
        });
        self.graph.layers[layer].forward.push(id);
        Ok(id)
    }

    /// Marks an op as part of the attention core (re-run by selective recomputation).
    pub fn set_attention_core(&mut self, op: OpId) {
        self.graph.ops[op.0 as usize].attention_core = true;
    }

    /// Validates the whole graph and derives its backward pass.
    pub fn finish(mut self) -> Result<Graph, GraphError> {
        if self.graph.layers.is_empty() {
            return Err(GraphError::new(&self.graph.name, "the graph has no layers"));
        }
        if let Some(l) = self.graph.layers.iter().find(|l| l.forward.is_empty()) {
            return Err(GraphError::new(&l.name, "layer has no ops"));
        }
        for (i, t) in self.graph.tensors.iter().enumerate() {
            if t.kind == TensorKind::Activation && !self.produced[i] {
                return Err(GraphError::new(
                    &t.name,
                    "activation is declared but no op produces it",
                ));
            }
        }
        super::autodiff::differentiate(&mut self.graph)?;
        Ok(self.graph)
    }

    fn t(&self, id: TensorId) -> &Tensor {
        &self.graph.tensors[id.0 as usize]
    }

    fn numel(&self, id: TensorId) -> u64 {
        self.t(id).elements()
    }

    /// Adds an implicit activation (dropout mask, softmax probabilities of a loss).
    fn implicit(&mut self, name: String, like: TensorId, dtype: DType) -> TensorId {
        let (shape, split) = {
            let t = self.t(like);
            (t.shape.clone(), t.split)
        };
        let id = self.tensor(name, shape, dtype, TensorKind::Activation, split);
        self.produced[id.0 as usize] = true;
        id
    }

    /// Checks operand shapes for `kind`; returns (forward FLOPs, tensors saved for backward).
    fn forward_rules(
        &mut self,
        name: &str,
        kind: OpKind,
        inputs: &[TensorId],
        outputs: &[TensorId],
    ) -> Result<(f64, Vec<TensorId>), GraphError> {
        use flops_per_element as fpe;
        let arity = |n_in: &[usize], n_out: usize| -> Result<(), GraphError> {
            if !n_in.contains(&inputs.len()) || outputs.len() != n_out {
                return Err(GraphError::new(
                    name,
                    format!(
                        "{} takes {} input(s) and {} output(s), found {} and {}",
                        kind.name(),
                        n_in.iter()
                            .map(|n| n.to_string())
                            .collect::<Vec<_>>()
                            .join(" or "),
                        n_out,
                        inputs.len(),
                        outputs.len()
                    ),
                ));
            }
            Ok(())
        };
        let same_shape = |a: TensorId, b: TensorId| -> Result<(), GraphError> {
            if self.t(a).shape != self.t(b).shape {
                return Err(GraphError::new(
                    name,
                    format!(
                        "`{}` has shape {:?} but `{}` has shape {:?}; {} needs equal shapes",
                        self.t(a).name,
                        self.t(a).shape,
                        self.t(b).name,
                        self.t(b).shape,
                        kind.name()
                    ),
                ));
            }
            Ok(())
        };
        let act = |id: TensorId| self.t(id).kind == TensorKind::Activation;
        match kind {
            OpKind::MatMul { transpose_b } => {
                arity(&[2, 3], 1)?;
                let (x, w, y) = (inputs[0], inputs[1], outputs[0]);
                let ws = self.t(w).shape.clone();
                if ws.len() != 2 {
                    return Err(GraphError::new(
                        name,
                        format!("weight `{}` must be 2-D, found {:?}", self.t(w).name, ws),
                    ));
                }
                let (k, n) = if transpose_b {
                    (ws[1], ws[0])
                } else {
                    (ws[0], ws[1])
                };
                let xn = self.numel(x);
                if k == 0 || xn % k != 0 {
                    return Err(GraphError::new(
                        name,
                        format!(
                            "input `{}` ({} elements) is not a whole number of rows of length {k}",
                            self.t(x).name,
                            xn
                        ),
                    ));
                }
                let rows = xn / k;
                if self.numel(y) != rows.saturating_mul(n) {
                    return Err(GraphError::new(
                        name,
                        format!(
                            "output `{}` should have {} x {} = {} elements, found {}",
                            self.t(y).name,
                            rows,
                            n,
                            rows.saturating_mul(n),
                            self.numel(y)
                        ),
                    ));
                }
                if let Some(&b) = inputs.get(2)
                    && self.numel(b) != n
                {
                    return Err(GraphError::new(
                        name,
                        format!("bias `{}` should have {n} elements", self.t(b).name),
                    ));
                }
                let mut flops = 2.0 * rows as f64 * k as f64 * n as f64;
                if inputs.len() == 3 {
                    flops += rows as f64 * n as f64;
                }
                let saves = if self.t(w).requires_grad && act(x) {
                    vec![x]
                } else {
                    vec![]
                };
                Ok((flops, saves))
            }
            OpKind::BatchMatMul { transpose_b } => {
                arity(&[2], 1)?;
                let (a, b, c) = (inputs[0], inputs[1], outputs[0]);
                let (sa, sb, sc) = (
                    self.t(a).shape.clone(),
                    self.t(b).shape.clone(),
                    self.t(c).shape.clone(),
                );
                let r = sa.len();
                if r < 2 || sb.len() != r || sc.len() != r {
                    return Err(GraphError::new(
                        name,
                        format!("operands must have equal rank >= 2, found {sa:?}, {sb:?}, {sc:?}"),
                    ));
                }
                let (m, k) = (sa[r - 2], sa[r - 1]);
                let (kb, n) = if transpose_b {
                    (sb[r - 1], sb[r - 2])
                } else {
                    (sb[r - 2], sb[r - 1])
                };
                let lead_ok = (0..r - 2).all(|i| sb[i] > 0 && sa[i] % sb[i] == 0 && sc[i] == sa[i]);
                if kb != k || sc[r - 2] != m || sc[r - 1] != n || !lead_ok {
                    return Err(GraphError::new(
                        name,
                        format!(
                            "shapes {sa:?} x {sb:?}{} -> {sc:?} do not multiply",
                            if transpose_b { "^T" } else { "" }
                        ),
                    ));
                }
                let flops = 2.0 * self.numel(c) as f64 * k as f64;
                let mut saves = Vec::new();
                if self.t(b).requires_grad && act(a) {
                    saves.push(a);
                }
                if self.t(a).requires_grad && act(b) {
                    saves.push(b);
                }
                Ok((flops, saves))
            }
            OpKind::Embedding => {
                arity(&[2], 1)?;
                let (ids, table, y) = (inputs[0], inputs[1], outputs[0]);
                let ts = self.t(table).shape.clone();
                if !matches!(self.t(ids).dtype, DType::I32) || ts.len() != 2 {
                    return Err(GraphError::new(
                        name,
                        "embedding takes integer ids and a 2-D table [vocab, hidden]",
                    ));
                }
                if self.numel(y) != self.numel(ids).saturating_mul(ts[1]) {
                    return Err(GraphError::new(
                        name,
                        format!(
                            "output `{}` should have {} x {} elements",
                            self.t(y).name,
                            self.numel(ids),
                            ts[1]
                        ),
                    ));
                }
                Ok((0.0, vec![]))
            }
            OpKind::LayerNorm | OpKind::RmsNorm => {
                let n_params = if kind == OpKind::LayerNorm { 2 } else { 1 };
                arity(&[1 + n_params], 1)?;
                let (x, y) = (inputs[0], outputs[0]);
                same_shape(x, y)?;
                let last = self.t(x).shape.last().copied().unwrap_or(0);
                for &p in &inputs[1..] {
                    if self.numel(p) != last {
                        return Err(GraphError::new(
                            name,
                            format!(
                                "`{}` should have {last} elements (the normalised axis)",
                                self.t(p).name
                            ),
                        ));
                    }
                }
                let per = if kind == OpKind::LayerNorm {
                    fpe::LAYER_NORM
                } else {
                    fpe::RMS_NORM
                };
                Ok((per * self.numel(x) as f64, vec![x]))
            }
            OpKind::Softmax => {
                arity(&[1], 1)?;
                same_shape(inputs[0], outputs[0])?;
                Ok((
                    fpe::SOFTMAX * self.numel(inputs[0]) as f64,
                    vec![outputs[0]],
                ))
            }
            OpKind::Gelu | OpKind::Silu => {
                arity(&[1], 1)?;
                same_shape(inputs[0], outputs[0])?;
                let per = if kind == OpKind::Gelu {
                    fpe::GELU
                } else {
                    fpe::SILU
                };
                Ok((per * self.numel(inputs[0]) as f64, vec![inputs[0]]))
            }
            OpKind::SwiGlu => {
                arity(&[1], 1)?;
                let (x, y) = (inputs[0], outputs[0]);
                if self.numel(x) != self.numel(y).saturating_mul(2) {
                    return Err(GraphError::new(
                        name,
                        "swiglu input must be twice as wide as its output (gate and up halves)",
                    ));
                }
                Ok((fpe::SWIGLU * self.numel(y) as f64, vec![x]))
            }
            OpKind::Add | OpKind::Mul => {
                arity(&[2], 1)?;
                same_shape(inputs[0], outputs[0])?;
                same_shape(inputs[1], outputs[0])?;
                let saves = if kind == OpKind::Mul {
                    inputs.iter().copied().filter(|&t| act(t)).collect()
                } else {
                    vec![]
                };
                Ok((self.numel(outputs[0]) as f64, saves))
            }
            OpKind::Dropout | OpKind::DropoutAdd => {
                let n_in = if kind == OpKind::Dropout { 1 } else { 2 };
                arity(&[n_in], 1)?;
                for &x in inputs {
                    same_shape(x, outputs[0])?;
                }
                let mask = self.implicit(format!("{name}.mask"), outputs[0], DType::U8);
                let per = fpe::DROPOUT + (n_in - 1) as f64;
                Ok((per * self.numel(outputs[0]) as f64, vec![mask]))
            }
            OpKind::Rope => {
                arity(&[1], 1)?;
                same_shape(inputs[0], outputs[0])?;
                Ok((fpe::ROPE * self.numel(inputs[0]) as f64, vec![]))
            }
            OpKind::FlashAttention { causal, .. } => {
                arity(&[3], 1)?;
                let (q, k, v, o) = (inputs[0], inputs[1], inputs[2], outputs[0]);
                let (sq, sk) = (self.t(q).shape.clone(), self.t(k).shape.clone());
                let (sv, so) = (self.t(v).shape.clone(), self.t(o).shape.clone());
                // Values may be narrower than queries and keys (MLA: 192 against 128).
                let ok = sq.len() == 4
                    && sk.len() == 4
                    && sv.len() == 4
                    && sv[..3] == sk[..3]
                    && so[..] == [sq[0], sq[1], sq[2], sv[3]]
                    && sk[1] > 0
                    && sq[0] == sk[0]
                    && sq[1] % sk[1] == 0
                    && sq[3] == sk[3];
                if !ok {
                    return Err(GraphError::new(
                        name,
                        format!(
                            "flash_attention takes q [b, heads, s, d], k [b, groups, s, d] and \
                             v [b, groups, s, dv] with groups dividing heads, and gives \
                             [b, heads, s, dv], found {sq:?}, {sk:?}, {sv:?} -> {so:?}"
                        ),
                    ));
                }
                // Scores (q . k) and context (p . v): 2 FLOPs per multiply-add each.
                let full = 2.0
                    * [sq[0], sq[1], sq[2], sk[2]]
                        .iter()
                        .map(|&d| d as f64)
                        .product::<f64>()
                    * (sq[3] + sv[3]) as f64;
                let flops = if causal { full / 2.0 } else { full };
                Ok((flops, vec![q, k, v, o]))
            }
            OpKind::CrossEntropy => {
                arity(&[2], 1)?;
                let (logits, labels) = (inputs[0], inputs[1]);
                let vocab = self.t(logits).shape.last().copied().unwrap_or(0);
                if vocab == 0
                    || self.numel(labels).saturating_mul(vocab) != self.numel(logits)
                    || !matches!(self.t(labels).dtype, DType::I32)
                {
                    return Err(GraphError::new(
                        name,
                        "cross_entropy takes logits [.., vocab] and integer labels [..]",
                    ));
                }
                let probs = self.implicit(format!("{name}.probs"), logits, DType::F32);
                Ok((fpe::CROSS_ENTROPY * self.numel(logits) as f64, vec![probs]))
            }
            OpKind::Transpose => {
                arity(&[1], 1)?;
                if self.numel(inputs[0]) != self.numel(outputs[0]) {
                    return Err(GraphError::new(
                        name,
                        "transpose keeps the number of elements of its input",
                    ));
                }
                Ok((0.0, vec![]))
            }
            OpKind::Slice => {
                if inputs.len() != 1 || outputs.is_empty() {
                    return Err(GraphError::new(
                        name,
                        "slice takes one input and at least one output",
                    ));
                }
                let total: u64 = outputs.iter().map(|&t| self.numel(t)).sum();
                if total != self.numel(inputs[0]) {
                    return Err(GraphError::new(
                        name,
                        format!(
                            "outputs hold {total} elements but the input `{}` has {}",
                            self.t(inputs[0]).name,
                            self.numel(inputs[0])
                        ),
                    ));
                }
                Ok((0.0, vec![]))
            }
            OpKind::Concat => {
                if inputs.is_empty() || outputs.len() != 1 {
                    return Err(GraphError::new(
                        name,
                        "concat takes at least one input and one output",
                    ));
                }
                let out = self.t(outputs[0]).shape.clone();
                let r = out.len();
                let mut last = 0u64;
                for &x in inputs {
                    let xs = &self.t(x).shape;
                    let fits =
                        xs.len() == r && r > 0 && (0..r - 1).all(|i| xs[i] == out[i] || xs[i] == 1);
                    if !fits {
                        return Err(GraphError::new(
                            name,
                            format!(
                                "input `{}` {xs:?} does not join into {out:?} along the last axis",
                                self.t(x).name
                            ),
                        ));
                    }
                    last = last.saturating_add(xs[r - 1]);
                }
                if out.last() != Some(&last) {
                    return Err(GraphError::new(
                        name,
                        format!("the inputs' last axes add up to {last}, the output's is {out:?}"),
                    ));
                }
                Ok((0.0, vec![]))
            }
            OpKind::MoeRouter => {
                arity(&[1], 2)?;
                let (scores, gates, idx) = (inputs[0], outputs[0], outputs[1]);
                let ss = self.t(scores).shape.clone();
                let (gs, is) = (self.t(gates).shape.clone(), self.t(idx).shape.clone());
                let r = ss.len();
                let ok = r >= 1
                    && gs.len() == r
                    && is == gs
                    && gs[..r - 1] == ss[..r - 1]
                    && gs[r - 1] >= 1
                    && gs[r - 1] <= ss[r - 1]
                    && self.t(idx).dtype == DType::I32;
                if !ok {
                    return Err(GraphError::new(
                        name,
                        format!(
                            "moe_router takes scores [.., experts] and gives gates and i32                              indices [.., k] with k at most the experts, found {ss:?} -> {gs:?}, {is:?}"
                        ),
                    ));
                }
                // Softmax (or sigmoid) over the experts, then a top-k pass over them.
                let flops = (fpe::SOFTMAX + 1.0) * self.numel(scores) as f64;
                Ok((flops, vec![scores, gates, idx]))
            }
            OpKind::MoeDispatch => {
                arity(&[2], 1)?;
                let (x, idx, y) = (inputs[0], inputs[1], outputs[0]);
                let (xs, is, ys) = (
                    self.t(x).shape.clone(),
                    self.t(idx).shape.clone(),
                    self.t(y).shape.clone(),
                );
                let ok = xs.len() >= 2
                    && is.len() == xs.len()
                    && is[..is.len() - 1] == xs[..xs.len() - 1]
                    && ys.len() == 3
                    && ys[2] == xs[xs.len() - 1]
                    && self.t(idx).dtype == DType::I32;
                if !ok {
                    return Err(GraphError::new(
                        name,
                        format!(
                            "moe_dispatch takes tokens [.., h] and i32 indices [.., k] and gives                              [experts, capacity, h], found {xs:?}, {is:?} -> {ys:?}"
                        ),
                    ));
                }
                Ok((0.0, vec![idx]))
            }
            OpKind::MoeCombine => {
                arity(&[3], 1)?;
                let (y, gates, idx, out) = (inputs[0], inputs[1], inputs[2], outputs[0]);
                let (ys, gs, is, os) = (
                    self.t(y).shape.clone(),
                    self.t(gates).shape.clone(),
                    self.t(idx).shape.clone(),
                    self.t(out).shape.clone(),
                );
                let ok = ys.len() == 3
                    && gs == is
                    && os.len() == gs.len()
                    && os.len() >= 2
                    && os[..os.len() - 1] == gs[..gs.len() - 1]
                    && os[os.len() - 1] == ys[2]
                    && self.t(idx).dtype == DType::I32;
                if !ok {
                    return Err(GraphError::new(
                        name,
                        format!(
                            "moe_combine takes expert outputs [experts, capacity, h], gates and                              i32 indices [.., k] and gives [.., h], found {ys:?}, {gs:?}, {is:?} -> {os:?}"
                        ),
                    ));
                }
                // A multiply-add per chosen expert and feature of every token.
                let flops = 2.0 * self.numel(gates) as f64 * ys[2] as f64;
                Ok((flops, vec![y, gates, idx]))
            }
            OpKind::Opaque { .. } => {
                if outputs.is_empty() {
                    return Err(GraphError::new(
                        name,
                        "an opaque op needs at least one output",
                    ));
                }
                // Nothing is known of its arithmetic; its backward reads the forward inputs.
                Ok((0.0, inputs.iter().copied().filter(|&t| act(t)).collect()))
            }
            OpKind::EmbeddingGrad => Err(GraphError::new(
                name,
                "embedding_grad is a backward op and cannot be added to the forward graph",
            )),
        }
    }
}
