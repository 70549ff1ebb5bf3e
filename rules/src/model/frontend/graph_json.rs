//! The op-graph file format (`autopar-graph/1`) for models that are not plain transformers.
//!
//! A file lists tensors (shapes may use the symbols `"b"` for the micro-batch size and `"s"` for
//! the sequence length) and layers of forward ops; autopar derives the backward pass, FLOPs,
//! saved activations and tensor-parallel communication itself. The format is documented in
//! `docs/graph-format.md`.

use super::locate::{PathSeg, item_offsets, locate, offset_of};
use crate::error::FieldError;
use crate::limits;
use crate::model::graph::{
    DType, FlashKernel, Graph, GraphBuilder, LayerKind, OpKind, Split, TensorKind,
};
use serde::Deserialize;

/// Value of the `format` field this reader accepts.
pub const GRAPH_FORMAT: &str = "autopar-graph/1";

/// A dimension of a tensor in a graph file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dim {
    /// A fixed size.
    Fixed(u64),
    /// The micro-batch size (`"b"`).
    Batch,
    /// The sequence length (`"s"`).
    Seq,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct TensorSpec {
    name: String,
    shape: Vec<Dim>,
    kind: TensorKind,
    /// `None`: floating point in the precision of the target.
    dtype: Option<DType>,
    split: Split,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct OpSpec {
    name: String,
    kind: OpKind,
    inputs: Vec<usize>,
    outputs: Vec<usize>,
    attention_core: bool,
    /// Byte offset of the op in the file, for errors found while lowering.
    offset: Option<usize>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct LayerSpec {
    name: String,
    kind: LayerKind,
    ops: Vec<OpSpec>,
}

/// A parsed, validated graph file, instantiated into a [`Graph`] per micro-batch size and
/// sequence length by [`GraphSpec::lower`].
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct GraphSpec {
    /// Model name from the file.
    pub name: String,
    /// Longest sequence the model supports, if the file says.
    pub max_seq: Option<u64>,
    tensors: Vec<TensorSpec>,
    layers: Vec<LayerSpec>,
    unknown_kinds: Vec<UnknownKind>,
}

/// An op whose kind autopar does not know, read as [`OpKind::Opaque`]: the caller warns.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct UnknownKind {
    /// The field, as in a [`FieldError`] (`layers[1].ops[0].kind`).
    pub field: String,
    /// The kind the file names.
    pub kind: String,
    /// Byte offset of the op in the file.
    pub offset: Option<usize>,
}

impl UnknownKind {
    /// What autopar does with the op, naming the known kind the file most likely meant when
    /// one is a typo away, and the kinds it knows.
    pub fn describe(&self) -> String {
        let nearest = OP_KINDS
            .split(", ")
            .map(|k| (strsim::damerau_levenshtein(k, &self.kind), k))
            .min()
            .filter(|&(d, _)| d <= 2);
        let hint = match nearest {
            Some((_, k)) => format!(" (did you mean \"{k}\"?)"),
            None => String::new(),
        };
        format!(
            "unknown op kind \"{}\"{hint}: run as an opaque op, never split inside (at most \
             along the batch), priced by the bytes it moves; the kinds autopar knows are \
             {OP_KINDS}",
            self.kind
        )
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileGraph {
    format: String,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    max_seq: Option<u64>,
    tensors: Vec<FileTensor>,
    #[serde(default)]
    layers: Option<Vec<FileLayer>>,
    #[serde(default)]
    ops: Option<Vec<FileOp>>,
    #[serde(default)]
    layer_count: Option<u64>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum FileDim {
    Int(u64),
    Sym(String),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileTensor {
    name: String,
    shape: Vec<FileDim>,
    #[serde(default)]
    kind: Option<String>,
    #[serde(default)]
    dtype: Option<String>,
    #[serde(default)]
    split: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileLayer {
    name: String,
    #[serde(default)]
    kind: Option<String>,
    ops: Vec<FileOp>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileOp {
    name: String,
    kind: String,
    inputs: Vec<String>,
    outputs: Vec<String>,
    #[serde(default)]
    transpose_b: bool,
    #[serde(default)]
    causal: Option<bool>,
    #[serde(default)]
    kernel: Option<String>,
    #[serde(default)]
    attention_core: bool,
}

const OP_KINDS: &str = "embedding, matmul, batch_matmul, layernorm, rmsnorm, softmax, gelu, \
                        silu, swiglu, add, mul, dropout, dropout_add, rope, flash_attention, \
                        cross_entropy, slice, transpose, opaque";

struct Ctx<'a> {
    text: &'a str,
}

impl Ctx<'_> {
    fn err(
        &self,
        path: &[PathSeg<'_>],
        expected: impl Into<String>,
        found: impl Into<String>,
    ) -> FieldError {
        FieldError::new(render(path), expected, found).at(locate(self.text, path))
    }
}

fn render(path: &[PathSeg<'_>]) -> String {
    let mut s = String::new();
    for seg in path {
        match seg {
            PathSeg::Key(k) => {
                if !s.is_empty() {
                    s.push('.');
                }
                s.push_str(k);
            }
            PathSeg::Index(i) => s.push_str(&format!("[{i}]")),
        }
    }
    s
}

fn parse_dtype(s: &str) -> Option<DType> {
    Some(match s {
        "f32" => DType::F32,
        "bf16" => DType::Bf16,
        "f16" => DType::F16,
        "i32" => DType::I32,
        "u8" => DType::U8,
        _ => return None,
    })
}

fn parse_op_kind(s: &str, transpose_b: bool, causal: bool, kernel: FlashKernel) -> Option<OpKind> {
    Some(match s {
        "embedding" => OpKind::Embedding,
        "matmul" => OpKind::MatMul { transpose_b },
        "batch_matmul" => OpKind::BatchMatMul { transpose_b },
        "layernorm" => OpKind::LayerNorm,
        "rmsnorm" => OpKind::RmsNorm,
        "softmax" => OpKind::Softmax,
        "gelu" => OpKind::Gelu,
        "silu" => OpKind::Silu,
        "swiglu" => OpKind::SwiGlu,
        "add" => OpKind::Add,
        "mul" => OpKind::Mul,
        "dropout" => OpKind::Dropout,
        "dropout_add" => OpKind::DropoutAdd,
        "rope" => OpKind::Rope,
        "flash_attention" => OpKind::FlashAttention { causal, kernel },
        "cross_entropy" => OpKind::CrossEntropy,
        "slice" => OpKind::Slice,
        "transpose" => OpKind::Transpose,
        // Whether it runs per sample is decided once its operands are known.
        "opaque" => OpKind::Opaque { batched: false },
        _ => return None,
    })
}

/// An opaque op's kind from its operands' and results' tensors: batched when axis 0 of every
/// one but the parameters is the micro-batch (`"b"`).
fn opaque_kind(tensors: &[TensorSpec], inputs: &[usize], outputs: &[usize]) -> OpKind {
    let batched = inputs
        .iter()
        .chain(outputs)
        .map(|&t| &tensors[t])
        .filter(|t| t.kind != TensorKind::Parameter)
        .all(|t| t.shape.first() == Some(&Dim::Batch));
    OpKind::Opaque { batched }
}

/// Micro-batch size and sequence length used to check a file's shapes when it is read: distinct
/// primes, so a literal that only matches a symbol by accident is caught.
const CHECK_BATCH: u64 = 3;
const CHECK_SEQ: u64 = 7;

/// Parses and validates a graph file.
pub fn parse_graph_file(text: &str) -> Result<GraphSpec, FieldError> {
    let file: FileGraph = serde_json::from_str(text).map_err(|e| {
        FieldError::new(
            "(document)",
            "an autopar-graph/1 JSON document",
            e.to_string(),
        )
        .at(Some(offset_of(text, e.line(), e.column())))
    })?;
    let cx = Ctx { text };
    if file.format != GRAPH_FORMAT {
        return Err(cx.err(
            &[PathSeg::Key("format")],
            format!("\"{GRAPH_FORMAT}\""),
            format!("\"{}\"", file.format),
        ));
    }
    let mut tensors = Vec::with_capacity(file.tensors.len());
    let mut by_name = std::collections::HashMap::new();
    for (i, t) in file.tensors.iter().enumerate() {
        let at = |k| [PathSeg::Key("tensors"), PathSeg::Index(i), PathSeg::Key(k)];
        if by_name.insert(t.name.as_str(), i).is_some() {
            return Err(cx.err(
                &at("name"),
                "a tensor name not used before",
                format!("\"{}\" again", t.name),
            ));
        }
        let kind = match t.kind.as_deref() {
            None | Some("activation") => TensorKind::Activation,
            Some("input") => TensorKind::Input,
            Some("parameter") => TensorKind::Parameter,
            Some(other) => {
                return Err(cx.err(
                    &at("kind"),
                    "one of input, parameter, activation",
                    format!("\"{other}\""),
                ));
            }
        };
        let mut shape = Vec::with_capacity(t.shape.len());
        for (d, dim) in t.shape.iter().enumerate() {
            let path = [
                PathSeg::Key("tensors"),
                PathSeg::Index(i),
                PathSeg::Key("shape"),
                PathSeg::Index(d),
            ];
            shape.push(match dim {
                FileDim::Int(0) => {
                    return Err(cx.err(&path, "a positive size, \"b\" or \"s\"", "0"));
                }
                FileDim::Int(n) if *n > limits::MAX_DIM => {
                    return Err(cx.err(
                        &path,
                        format!("a size up to {}", limits::MAX_DIM),
                        n.to_string(),
                    ));
                }
                FileDim::Int(n) => Dim::Fixed(*n),
                FileDim::Sym(s) if s == "b" || s == "s" => {
                    if kind == TensorKind::Parameter {
                        return Err(cx.err(
                            &path,
                            "a fixed size (parameters do not depend on the batch)",
                            format!("\"{s}\""),
                        ));
                    }
                    if s == "b" { Dim::Batch } else { Dim::Seq }
                }
                FileDim::Sym(s) => {
                    return Err(cx.err(
                        &path,
                        "a positive size, \"b\" or \"s\"",
                        format!("\"{s}\""),
                    ));
                }
            });
        }
        let dtype = match &t.dtype {
            None => None,
            Some(s) => Some(parse_dtype(s).ok_or_else(|| {
                cx.err(
                    &at("dtype"),
                    "one of f32, bf16, f16, i32, u8",
                    format!("\"{s}\""),
                )
            })?),
        };
        let seq_axis = shape.iter().position(|d| *d == Dim::Seq);
        let split = match t.split.as_deref() {
            None if kind == TensorKind::Activation => {
                seq_axis.map_or(Split::None, |a| Split::Sequence(a as u8))
            }
            None | Some("none") => Split::None,
            Some(s) => {
                let bad = || {
                    cx.err(
                        &at("split"),
                        format!(
                            "\"none\", \"sequence\", \"sequence:AXIS\" or \"model:AXIS\" with AXIS below {}",
                            shape.len()
                        ),
                        format!("\"{s}\""),
                    )
                };
                let (class, axis) = match s.split_once(':') {
                    Some((c, a)) => (c, Some(a.parse::<usize>().map_err(|_| bad())?)),
                    None => (s, None),
                };
                let axis = match (class, axis) {
                    ("sequence", None) => seq_axis.ok_or_else(bad)?,
                    (_, Some(a)) if a < shape.len() => a,
                    _ => return Err(bad()),
                };
                match class {
                    "sequence" => Split::Sequence(axis as u8),
                    "model" => Split::Model(axis as u8),
                    _ => return Err(bad()),
                }
            }
        };
        tensors.push(TensorSpec {
            name: t.name.clone(),
            shape,
            kind,
            dtype,
            split,
        });
    }
    let parse_op = |op: &FileOp,
                    base: &[PathSeg<'_>],
                    offset: Option<usize>|
     -> Result<(OpSpec, Option<UnknownKind>), FieldError> {
        let with = |k| {
            let mut p = base.to_vec();
            p.push(PathSeg::Key(k));
            p
        };
        let kernel = match op.kernel.as_deref() {
            None | Some("cuda") => FlashKernel::Cuda,
            Some("triton") => FlashKernel::Triton,
            Some("cudnn") => FlashKernel::Cudnn,
            Some("auto") => FlashKernel::Auto,
            Some(other) => {
                return Err(cx.err(
                    &with("kernel"),
                    "cuda, triton, cudnn or auto",
                    format!("\"{other}\""),
                ));
            }
        };
        let known = parse_op_kind(&op.kind, op.transpose_b, op.causal.unwrap_or(true), kernel);
        let unknown = known.is_none().then(|| UnknownKind {
            field: render(&with("kind")),
            kind: op.kind.clone(),
            offset,
        });
        let resolve = |names: &[String], field: &'static str| -> Result<Vec<usize>, FieldError> {
            names
                .iter()
                .enumerate()
                .map(|(j, n)| {
                    by_name.get(n.as_str()).copied().ok_or_else(|| {
                        let mut p = with(field);
                        p.push(PathSeg::Index(j));
                        cx.err(
                            &p,
                            "the name of a tensor listed in `tensors`",
                            format!("\"{n}\""),
                        )
                    })
                })
                .collect()
        };
        let inputs = resolve(&op.inputs, "inputs")?;
        let outputs = resolve(&op.outputs, "outputs")?;
        let kind = match known {
            Some(OpKind::Opaque { .. }) | None => opaque_kind(&tensors, &inputs, &outputs),
            Some(k) => k,
        };
        Ok((
            OpSpec {
                name: op.name.clone(),
                kind,
                inputs,
                outputs,
                attention_core: op.attention_core,
                offset,
            },
            unknown,
        ))
    };
    let mut layers = Vec::new();
    let mut flat = None;
    let mut unknown_kinds = Vec::new();
    // Bounds that keep lowering and clustering within seconds and a few hundred MiB.
    let op_count = match (&file.layers, &file.ops) {
        (Some(ls), _) => ls.iter().map(|l| l.ops.len()).sum(),
        (None, Some(ops)) => ops.len(),
        (None, None) => 0,
    };
    if let Some(ls) = &file.layers
        && ls.len() as u64 > limits::MAX_LAYERS
    {
        return Err(cx.err(
            &[PathSeg::Key("layers")],
            format!("at most {} layers", limits::MAX_LAYERS),
            format!("{} layers", ls.len()),
        ));
    }
    if op_count > limits::MAX_GRAPH_OPS {
        return Err(cx.err(
            &[PathSeg::Key(if file.layers.is_some() {
                "layers"
            } else {
                "ops"
            })],
            format!("at most {} ops", limits::MAX_GRAPH_OPS),
            format!("{op_count} ops"),
        ));
    }
    if file.layers.is_none() && op_count > limits::MAX_CLUSTERED_OPS {
        return Err(cx.err(
            &[PathSeg::Key("ops")],
            format!(
                "at most {} ops in a flat list (group larger models into `layers`)",
                limits::MAX_CLUSTERED_OPS
            ),
            format!("{op_count} ops"),
        ));
    }
    if let Some(n) = file.layer_count
        && n > limits::MAX_CLUSTERED_LAYERS
    {
        return Err(cx.err(
            &[PathSeg::Key("layer_count")],
            format!(
                "at most {} layers (give `layers` to use more)",
                limits::MAX_CLUSTERED_LAYERS
            ),
            n.to_string(),
        ));
    }
    match (&file.layers, &file.ops) {
        (Some(file_layers), None) => {
            if file.layer_count.is_some() {
                return Err(cx.err(
                    &[PathSeg::Key("layer_count")],
                    "no `layer_count` when `layers` are given (it sizes the clustering of `ops`)",
                    "a `layer_count`",
                ));
            }
            // Where each op is, for errors found later, in one pass over the text.
            let layer_offsets = item_offsets(text, None, &[PathSeg::Key("layers")]);
            for (li, l) in file_layers.iter().enumerate() {
                let op_offsets = layer_offsets
                    .get(li)
                    .map(|&at| item_offsets(text, Some(at), &[PathSeg::Key("ops")]))
                    .unwrap_or_default();
                let kind = match l.kind.as_deref() {
                    None | Some("block") => LayerKind::Block,
                    Some("embedding") => LayerKind::Embedding,
                    Some("head") => LayerKind::Head,
                    Some(other) => {
                        return Err(cx.err(
                            &[
                                PathSeg::Key("layers"),
                                PathSeg::Index(li),
                                PathSeg::Key("kind"),
                            ],
                            "one of embedding, block, head",
                            format!("\"{other}\""),
                        ));
                    }
                };
                let mut ops = Vec::with_capacity(l.ops.len());
                for (oi, op) in l.ops.iter().enumerate() {
                    let base = [
                        PathSeg::Key("layers"),
                        PathSeg::Index(li),
                        PathSeg::Key("ops"),
                        PathSeg::Index(oi),
                    ];
                    let (op, unknown) = parse_op(op, &base, op_offsets.get(oi).copied())?;
                    ops.push(op);
                    unknown_kinds.extend(unknown);
                }
                layers.push(LayerSpec {
                    name: l.name.clone(),
                    kind,
                    ops,
                });
            }
        }
        (None, Some(file_ops)) => {
            let mut ops = Vec::with_capacity(file_ops.len());
            let op_offsets = item_offsets(text, None, &[PathSeg::Key("ops")]);
            for (oi, op) in file_ops.iter().enumerate() {
                let base = [PathSeg::Key("ops"), PathSeg::Index(oi)];
                let (op, unknown) = parse_op(op, &base, op_offsets.get(oi).copied())?;
                ops.push(op);
                unknown_kinds.extend(unknown);
            }
            flat = Some(ops);
        }
        (Some(_), Some(_)) => {
            return Err(cx.err(
                &[PathSeg::Key("ops")],
                "either `layers` or a flat `ops` list, not both",
                "both",
            ));
        }
        (None, None) => {
            return Err(FieldError::new(
                "layers",
                "`layers` (ops grouped into layers) or `ops` (a flat list autopar clusters)",
                "neither",
            ));
        }
    }
    // An opaque op writes whole results on every tensor-parallel rank: they are not stored in
    // sequence shards, and a file that declares such a split on one is refused.
    let opaque = layers
        .iter()
        .flat_map(|l| &l.ops)
        .chain(flat.iter().flatten())
        .filter(|o| matches!(o.kind, OpKind::Opaque { .. }));
    for &t in opaque.flat_map(|o| &o.outputs) {
        if let Split::Sequence(_) = tensors[t].split {
            if file.tensors[t].split.is_some() {
                return Err(cx.err(
                    &[
                        PathSeg::Key("tensors"),
                        PathSeg::Index(t),
                        PathSeg::Key("split"),
                    ],
                    "\"none\" or \"model:AXIS\": an opaque op writes whole results, which are \
                     never kept in sequence shards",
                    format!(
                        "\"{}\"",
                        file.tensors[t].split.as_deref().unwrap_or_default()
                    ),
                ));
            }
            tensors[t].split = Split::None;
        }
    }
    let mut spec = GraphSpec {
        name: file.name.unwrap_or_else(|| "graph".to_string()),
        max_seq: file.max_seq,
        tensors,
        layers,
        unknown_kinds,
    };
    if let Some(ops) = flat {
        spec.layers = cluster_ops(&spec, ops, file.layer_count, &cx)?;
    }
    spec.lower(CHECK_BATCH, CHECK_SEQ, DType::Bf16)?;
    Ok(spec)
}

/// Most layers a flat op list is clustered into by default.
pub const DEFAULT_MAX_LAYERS: usize = 32;

/// Groups a flat op list into layers with the clustering DP ([`crate::model::layering`]): `count`
/// layers, by default one per heavy op (matrix products, attention) up to
/// [`DEFAULT_MAX_LAYERS`]. Costs are those of one sequence of the model's longest length (or
/// 2048 tokens); the clustering only compares FLOPs and bytes, which scale together.
fn cluster_ops(
    spec: &GraphSpec,
    ops: Vec<OpSpec>,
    count: Option<u64>,
    cx: &Ctx<'_>,
) -> Result<Vec<LayerSpec>, FieldError> {
    let single = GraphSpec {
        layers: vec![LayerSpec {
            name: "all".into(),
            kind: LayerKind::Block,
            ops,
        }],
        ..spec.clone()
    };
    let seq = spec.max_seq.unwrap_or(2048).clamp(1, limits::MAX_SEQ);
    let g = single.lower(1, seq, DType::Bf16)?;
    let costs = crate::model::layering::op_costs(&g);
    let heavy = costs.iter().filter(|c| c.heavy).count();
    let layers = match count {
        Some(n) if n == 0 || n as usize > costs.len() => {
            return Err(cx.err(
                &[PathSeg::Key("layer_count")],
                format!("between 1 and the {} ops", costs.len()),
                n.to_string(),
            ));
        }
        Some(n) => n as usize,
        None => heavy.clamp(1, DEFAULT_MAX_LAYERS).min(costs.len()),
    };
    let clustering = crate::model::layering::cluster(&costs, layers, 0.0).map_err(|e| {
        cx.err(
            &[PathSeg::Key("layer_count")],
            "a number of layers the ops can be cut into",
            e.to_string(),
        )
    })?;
    let mut ops = single.layers.into_iter().flat_map(|l| l.ops);
    Ok(clustering
        .ranges
        .iter()
        .enumerate()
        .map(|(r, &(i, k))| LayerSpec {
            name: format!("cluster{r}"),
            kind: LayerKind::Block,
            ops: ops.by_ref().take(k - i + 1).collect(),
        })
        .collect())
}

impl GraphSpec {
    /// The graph without names: tensors by index with shapes (`"b"`, `"s"` or sizes), kinds,
    /// dtypes and splits; layers with their kinds and ops.
    pub fn canonical_json(&self) -> serde_json::Value {
        let dim = |d: &Dim| match d {
            Dim::Fixed(n) => serde_json::json!(n),
            Dim::Batch => serde_json::json!("b"),
            Dim::Seq => serde_json::json!("s"),
        };
        serde_json::json!({
            "max_seq": self.max_seq,
            "tensors": self.tensors.iter().map(|t| serde_json::json!({
                "shape": t.shape.iter().map(dim).collect::<Vec<_>>(),
                "kind": t.kind,
                "dtype": t.dtype,
                "split": t.split,
            })).collect::<Vec<_>>(),
            "layers": self.layers.iter().map(|l| serde_json::json!({
                "kind": l.kind,
                "ops": l.ops.iter().map(|o| serde_json::json!({
                    "kind": o.kind,
                    "inputs": o.inputs,
                    "outputs": o.outputs,
                    "attention_core": o.attention_core,
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
        })
    }

    /// Names of the layers, in order.
    pub fn layer_names(&self) -> Vec<String> {
        self.layers.iter().map(|l| l.name.clone()).collect()
    }

    /// The ops whose kinds autopar does not know, in file order: read as [`OpKind::Opaque`],
    /// for the caller to warn of.
    pub fn unknown_kinds(&self) -> &[UnknownKind] {
        &self.unknown_kinds
    }

    /// Instantiates the graph for micro-batch size `b`, sequence length `s` and floating-point
    /// dtype `dtype`, deriving the backward pass.
    pub fn lower(&self, b: u64, s: u64, dtype: DType) -> Result<Graph, FieldError> {
        self.lower_with(b, s, dtype, false)
    }

    /// [`GraphSpec::lower`], with the products with a weight of `block` layers on the FP8
    /// tensor cores when `fp8` ([`GraphBuilder::fp8`]).
    pub fn lower_with(&self, b: u64, s: u64, dtype: DType, fp8: bool) -> Result<Graph, FieldError> {
        let mut g = GraphBuilder::new(&self.name, b, s);
        g.fp8(fp8);
        let ids: Vec<_> = self
            .tensors
            .iter()
            .map(|t| {
                let shape = t
                    .shape
                    .iter()
                    .map(|d| match d {
                        Dim::Fixed(n) => *n,
                        Dim::Batch => b,
                        Dim::Seq => s,
                    })
                    .collect();
                g.tensor(&t.name, shape, t.dtype.unwrap_or(dtype), t.kind, t.split)
            })
            .collect();
        for layer in &self.layers {
            g.begin_layer(&layer.name, layer.kind);
            for op in &layer.ops {
                let ins: Vec<_> = op.inputs.iter().map(|&i| ids[i]).collect();
                let outs: Vec<_> = op.outputs.iter().map(|&i| ids[i]).collect();
                let id = g.op(&op.name, op.kind, &ins, &outs).map_err(|e| {
                    FieldError::new(
                        format!("op `{}`", op.name),
                        "operands that fit the op kind",
                        e.message,
                    )
                    .at(op.offset)
                })?;
                if op.attention_core {
                    g.set_attention_core(id);
                }
            }
        }
        g.finish()
            .map_err(|e| FieldError::new(e.op, "a complete training graph", e.message))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::frontend::locate::line_col;
    use crate::model::graph::{Pass, TensorId};
    use proptest::prelude::*;

    pub(crate) const MLP: &str = r#"{
  "format": "autopar-graph/1",
  "name": "tiny-mlp",
  "tensors": [
    {"name": "tokens", "shape": ["b", "s"], "kind": "input", "dtype": "i32"},
    {"name": "labels", "shape": ["b", "s"], "kind": "input", "dtype": "i32"},
    {"name": "emb", "shape": [1000, 64], "kind": "parameter", "split": "model:0"},
    {"name": "x", "shape": ["b", "s", 64]},
    {"name": "w1", "shape": [64, 256], "kind": "parameter", "split": "model:1"},
    {"name": "h", "shape": ["b", "s", 256], "split": "model:2"},
    {"name": "a", "shape": ["b", "s", 256], "split": "model:2"},
    {"name": "w2", "shape": [256, 64], "kind": "parameter", "split": "model:0"},
    {"name": "y", "shape": ["b", "s", 64]},
    {"name": "wo", "shape": [64, 1000], "kind": "parameter", "split": "model:1"},
    {"name": "logits", "shape": ["b", "s", 1000], "split": "model:2"},
    {"name": "loss", "shape": [1], "dtype": "f32"}
  ],
  "layers": [
    {"name": "embed", "kind": "embedding", "ops": [
      {"name": "lookup", "kind": "embedding", "inputs": ["tokens", "emb"], "outputs": ["x"]}]},
    {"name": "mlp", "ops": [
      {"name": "fc1", "kind": "matmul", "inputs": ["x", "w1"], "outputs": ["h"]},
      {"name": "act", "kind": "gelu", "inputs": ["h"], "outputs": ["a"]},
      {"name": "fc2", "kind": "matmul", "inputs": ["a", "w2"], "outputs": ["y"]}]},
    {"name": "out", "kind": "head", "ops": [
      {"name": "proj", "kind": "matmul", "inputs": ["y", "wo"], "outputs": ["logits"]},
      {"name": "ce", "kind": "cross_entropy", "inputs": ["logits", "labels"], "outputs": ["loss"]}]}
  ]
}"#;

    #[test]
    fn lowers_with_backward_and_symbols() {
        let spec = parse_graph_file(MLP).expect("valid graph");
        let g = spec.lower(2, 16, DType::Bf16).expect("lowers");
        assert_eq!(g.layers.len(), 3);
        assert_eq!(
            g.parameter_count(),
            1000 * 64 + 64 * 256 + 256 * 64 + 64 * 1000
        );
        // fc1: 2·(b·s)·64·256 forward, twice that backward (dgrad + wgrad).
        let fc1 = 2.0 * 32.0 * 64.0 * 256.0;
        let mlp = &g.layers[1];
        let fwd: f64 = mlp.forward.iter().map(|&o| g.op(o).flops).sum();
        assert!(fwd > 2.0 * fc1 && fwd < 2.0 * fc1 + 1e5, "{fwd}");
        let x = g.tensors.iter().find(|t| t.name == "x").expect("x");
        assert_eq!(x.split, Split::Sequence(1));
        assert_eq!(x.shape, vec![2, 16, 64]);
    }

    /// A small attention graph: a trained query and given keys and values into one fused
    /// attention op, with `attrs` on it, and a loss on its output.
    fn attention_graph(attrs: &str) -> String {
        format!(
            r#"{{
  "format": "autopar-graph/1",
  "name": "attn",
  "tensors": [
    {{"name": "q", "shape": [2, 4, 8, 16], "kind": "parameter"}},
    {{"name": "k", "shape": [2, 4, 8, 16], "kind": "input"}},
    {{"name": "v", "shape": [2, 4, 8, 16], "kind": "input"}},
    {{"name": "labels", "shape": [2, 4, 8], "kind": "input", "dtype": "i32"}},
    {{"name": "o", "shape": [2, 4, 8, 16]}},
    {{"name": "loss", "shape": [1], "dtype": "f32"}}
  ],
  "layers": [
    {{"name": "core", "ops": [
      {{"name": "attn", "kind": "flash_attention", "inputs": ["q", "k", "v"], "outputs": ["o"]{attrs}}},
      {{"name": "ce", "kind": "cross_entropy", "inputs": ["o", "labels"], "outputs": ["loss"]}}]}}
  ]
}}"#
        )
    }

    #[test]
    fn the_attention_kernel_is_read_and_checked() {
        let kind = |attrs: &str| {
            let g = parse_graph_file(&attention_graph(attrs))
                .expect("valid graph")
                .lower(1, 8, DType::Bf16)
                .expect("lowers");
            g.op(g.layers[0].forward[0]).kind
        };
        let flash = |causal, kernel| OpKind::FlashAttention { causal, kernel };
        assert_eq!(kind(""), flash(true, FlashKernel::Cuda));
        assert_eq!(
            kind(r#", "kernel": "cuda""#),
            flash(true, FlashKernel::Cuda)
        );
        assert_eq!(
            kind(r#", "kernel": "triton", "causal": false"#),
            flash(false, FlashKernel::Triton)
        );
        assert_eq!(
            kind(r#", "kernel": "cudnn""#),
            flash(true, FlashKernel::Cudnn)
        );
        assert_eq!(
            kind(r#", "kernel": "auto""#),
            flash(true, FlashKernel::Auto)
        );
        let e =
            parse_graph_file(&attention_graph(r#", "kernel": "fa3""#)).expect_err("no such kernel");
        assert_eq!(e.field, "layers[0].ops[0].kernel");
        assert_eq!(e.expected, "cuda, triton, cudnn or auto");
        assert_eq!(e.found, "\"fa3\"");
    }

    #[test]
    fn unknown_kinds_are_opaque_ops_with_a_warning() {
        let text = MLP
            .replace(r#""kind": "gelu""#, r#""kind": "fused_gelu""#)
            .replace(
                r#""name": "fc2", "kind": "matmul""#,
                r#""name": "fc2", "kind": "matmull""#,
            );
        let spec = parse_graph_file(&text).expect("unknown kinds are read");
        let unknown = spec.unknown_kinds();
        let fields: Vec<&str> = unknown.iter().map(|u| u.field.as_str()).collect();
        assert_eq!(fields, ["layers[1].ops[1].kind", "layers[1].ops[2].kind"]);
        let (line, _) = line_col(&text, unknown[1].offset.expect("located"));
        let fc2 = text
            .lines()
            .position(|l| l.contains("\"fc2\""))
            .expect("fc2")
            + 1;
        assert_eq!(line, fc2);
        assert!(!unknown[0].describe().contains("did you mean"));
        assert!(
            unknown[1]
                .describe()
                .contains(r#"unknown op kind "matmull" (did you mean "matmul"?)"#),
            "{}",
            unknown[1].describe()
        );
        let g = spec.lower(2, 16, DType::Bf16).expect("lowers");
        let op = |name: &str| g.ops.iter().find(|o| o.name == name).expect(name);
        // Every operand but the weight has the batch on axis 0.
        assert_eq!(op("act").kind, OpKind::Opaque { batched: true });
        assert_eq!(op("act").flops, 0.0);
        let (fc2, grad) = (op("fc2"), op("fc2.grad"));
        assert_eq!(grad.kind, fc2.kind);
        assert_eq!(grad.pass, Pass::Backward);
        // The backward reads the result's gradient and every input; it writes the gradients
        // of the activation and of the weight.
        let names = |ids: &[TensorId]| -> Vec<&str> {
            ids.iter().map(|&t| g.tensor(t).name.as_str()).collect()
        };
        assert_eq!(names(&grad.inputs), ["dy", "a", "w2"]);
        assert_eq!(names(&grad.outputs), ["da", "dw2"]);
        assert_eq!(names(&fc2.saves), ["a"]);
        // "opaque" is a kind autopar knows: no warning.
        let declared = MLP.replace(r#""kind": "gelu""#, r#""kind": "opaque""#);
        let spec = parse_graph_file(&declared).expect("valid graph");
        assert!(spec.unknown_kinds().is_empty());
        // An operand without the batch on axis 0: never split at all.
        let unbatched = declared.replace(
            r#"{"name": "a", "shape": ["b", "s", 256]"#,
            r#"{"name": "a", "shape": ["s", "b", 256]"#,
        );
        let text = unbatched.replace(r#""inputs": ["a", "w2"]"#, r#""inputs": ["h", "w2"]"#);
        let g = parse_graph_file(&text)
            .expect("valid graph")
            .lower(2, 16, DType::Bf16)
            .expect("lowers");
        let act = g.ops.iter().find(|o| o.name == "act").expect("act");
        assert_eq!(act.kind, OpKind::Opaque { batched: false });
    }

    #[test]
    fn an_opaque_ops_results_are_never_in_sequence_shards() {
        // `y` would be split on its "s" axis by default; written by an opaque op it is whole.
        let text = MLP.replace(
            r#""name": "fc2", "kind": "matmul""#,
            r#""name": "fc2", "kind": "opaque""#,
        );
        let g = parse_graph_file(&text)
            .expect("valid graph")
            .lower(2, 16, DType::Bf16)
            .expect("lowers");
        let y = g.tensors.iter().find(|t| t.name == "y").expect("y");
        assert_eq!(y.split, Split::None);
        let declared = text.replace(
            r#"{"name": "y", "shape": ["b", "s", 64]}"#,
            r#"{"name": "y", "shape": ["b", "s", 64], "split": "sequence"}"#,
        );
        let e = parse_graph_file(&declared).expect_err("a sequence split on a whole result");
        assert_eq!(e.field, "tensors[8].split");
        assert!(
            e.expected.contains("an opaque op writes whole results"),
            "{e}"
        );
        let (line, _) = line_col(&declared, e.offset.expect("located"));
        let y_line = declared
            .lines()
            .position(|l| l.contains(r#""name": "y""#))
            .expect("y");
        assert_eq!(line, y_line + 1);
    }

    #[test]
    fn unknown_tensor_is_located() {
        let text = MLP.replace("\"inputs\": [\"h\"]", "\"inputs\": [\"hh\"]");
        let e = parse_graph_file(&text).expect_err("hh is not declared");
        assert_eq!(e.field, "layers[1].ops[1].inputs[0]");
        assert_eq!(e.found, "\"hh\"");
        let (line, _) = line_col(&text, e.offset.expect("located"));
        assert_eq!(line, 23);
    }

    #[test]
    fn shape_mismatch_is_reported_against_the_op() {
        let text = MLP.replace("[256, 64], \"kind\"", "[255, 64], \"kind\"");
        let e = parse_graph_file(&text).expect_err("w2 does not fit");
        assert_eq!(e.field, "op `fc2`");
        assert!(e.found.contains("rows of length 255"), "{e}");
    }

    #[test]
    fn unknown_key_and_bad_split_are_rejected() {
        let text = MLP.replace(
            "\"name\": \"tiny-mlp\"",
            "\"name\": \"tiny-mlp\", \"colour\": 1",
        );
        let e = parse_graph_file(&text).expect_err("unknown key");
        assert!(e.found.contains("unknown field `colour`"), "{e}");
        let text = MLP.replace("\"model:0\"}", "\"model:7\"}");
        assert_eq!(
            parse_graph_file(&text).expect_err("axis").field,
            "tensors[2].split"
        );
    }

    /// An embedding, `blocks` MLP blocks (64 -> 256 -> 64) and an output layer, as a flat op
    /// list.
    fn flat_mlp(blocks: usize, layer_count: Option<usize>) -> String {
        let mut tensors = vec![
            r#"{"name": "tokens", "shape": ["b", "s"], "kind": "input", "dtype": "i32"}"#
                .to_string(),
            r#"{"name": "labels", "shape": ["b", "s"], "kind": "input", "dtype": "i32"}"#
                .to_string(),
            r#"{"name": "emb", "shape": [1000, 64], "kind": "parameter"}"#.to_string(),
            r#"{"name": "x0", "shape": ["b", "s", 64]}"#.to_string(),
            r#"{"name": "wo", "shape": [64, 1000], "kind": "parameter"}"#.to_string(),
            r#"{"name": "logits", "shape": ["b", "s", 1000]}"#.to_string(),
            r#"{"name": "loss", "shape": [1], "dtype": "f32"}"#.to_string(),
        ];
        let mut ops = vec![
            r#"{"name": "lookup", "kind": "embedding", "inputs": ["tokens", "emb"], "outputs": ["x0"]}"#.to_string(),
        ];
        for i in 0..blocks {
            let j = i + 1;
            tensors.push(format!(
                r#"{{"name": "w1_{i}", "shape": [64, 256], "kind": "parameter"}}"#
            ));
            tensors.push(format!(
                r#"{{"name": "w2_{i}", "shape": [256, 64], "kind": "parameter"}}"#
            ));
            tensors.push(format!(r#"{{"name": "h{i}", "shape": ["b", "s", 256]}}"#));
            tensors.push(format!(r#"{{"name": "a{i}", "shape": ["b", "s", 256]}}"#));
            tensors.push(format!(r#"{{"name": "x{j}", "shape": ["b", "s", 64]}}"#));
            ops.push(format!(r#"{{"name": "fc1_{i}", "kind": "matmul", "inputs": ["x{i}", "w1_{i}"], "outputs": ["h{i}"]}}"#));
            ops.push(format!(
                r#"{{"name": "act{i}", "kind": "gelu", "inputs": ["h{i}"], "outputs": ["a{i}"]}}"#
            ));
            ops.push(format!(r#"{{"name": "fc2_{i}", "kind": "matmul", "inputs": ["a{i}", "w2_{i}"], "outputs": ["x{j}"]}}"#));
        }
        ops.push(format!(r#"{{"name": "proj", "kind": "matmul", "inputs": ["x{blocks}", "wo"], "outputs": ["logits"]}}"#));
        ops.push(r#"{"name": "ce", "kind": "cross_entropy", "inputs": ["logits", "labels"], "outputs": ["loss"]}"#.to_string());
        let count = layer_count.map_or(String::new(), |n| format!(",\n  \"layer_count\": {n}"));
        format!(
            "{{\n  \"format\": \"autopar-graph/1\",\n  \"tensors\": [\n    {}\n  ],\n  \"ops\": [\n    {}\n  ]{count}\n}}",
            tensors.join(",\n    "),
            ops.join(",\n    ")
        )
    }

    #[test]
    fn flat_op_lists_are_clustered_at_narrow_tensors() {
        // The output layer costs about two blocks: four layers of two blocks' FLOPs each.
        let spec = parse_graph_file(&flat_mlp(6, Some(4))).expect("valid graph");
        let g = spec.lower(2, 16, DType::Bf16).expect("lowers");
        assert_eq!(g.layers.len(), 4);
        assert_eq!(g.parameter_count(), 2 * 64_000 + 6 * 2 * 64 * 256);
        // Every layer after the first starts at a block's first matmul: what enters it is a
        // 64-wide activation, never a 256-wide one.
        for layer in &g.layers[1..] {
            let first = g.op(layer.forward[0]);
            assert!(
                first.name.starts_with("fc1_") || first.name == "proj",
                "{}",
                first.name
            );
        }
        // By default one layer per matrix product (2 per block, the output layer's).
        let spec = parse_graph_file(&flat_mlp(6, None)).expect("valid graph");
        assert_eq!(
            spec.lower(1, 8, DType::Bf16).expect("lowers").layers.len(),
            13
        );
    }

    #[test]
    fn flat_op_lists_reject_bad_layer_counts_and_mixed_forms() {
        let e = parse_graph_file(&flat_mlp(2, Some(0))).expect_err("zero layers");
        assert_eq!(e.field, "layer_count");
        assert_eq!(e.found, "0");
        let e = parse_graph_file(&flat_mlp(2, Some(99))).expect_err("more layers than ops");
        assert_eq!(e.expected, "between 1 and the 9 ops");
        let both = MLP.replacen("\"layers\": [", "\"ops\": [], \"layers\": [", 1);
        assert_eq!(parse_graph_file(&both).expect_err("both").field, "ops");
        let neither = MLP.replacen("\"layers\": [", "\"unused\": [", 1);
        assert!(parse_graph_file(&neither).is_err());
        let count_with_layers =
            MLP.replacen("\"layers\": [", "\"layer_count\": 2, \"layers\": [", 1);
        assert_eq!(
            parse_graph_file(&count_with_layers)
                .expect_err("count")
                .field,
            "layer_count"
        );
    }

    /// Parses `text`, and lowers what parses at a few batch sizes and sequence lengths, as a
    /// build would: neither may panic.
    fn parse_and_lower(text: &str) {
        if let Ok(spec) = parse_graph_file(text) {
            for (b, s) in [(1, 1), (2, 128), (8, 4096)] {
                if let Ok(g) = spec.lower(b, s, DType::Bf16) {
                    let _ = g.parameter_count();
                    let _ = crate::model::layering::op_costs(&g);
                }
            }
        }
    }

    proptest! {
        #[test]
        fn mutated_files_never_panic(pos in 0usize..2000, ch in proptest::char::any()) {
            let mut s: Vec<char> = MLP.chars().collect();
            let p = pos % s.len();
            s[p] = ch;
            let text: String = s.into_iter().collect();
            parse_and_lower(&text);
        }

        #[test]
        fn renumbered_files_never_panic(pos in 0usize..2000, digits in "[0-9]{1,22}") {
            // A number of the file replaced by another, up to far past every bound.
            let starts: Vec<usize> = MLP
                .char_indices()
                .filter(|&(i, c)| c.is_ascii_digit() && !MLP[..i].ends_with(|p: char| p.is_ascii_digit()))
                .map(|(i, _)| i)
                .collect();
            let at = starts[pos % starts.len()];
            let end = at + MLP[at..].find(|c: char| !c.is_ascii_digit()).unwrap_or(0);
            let text = format!("{}{digits}{}", &MLP[..at], &MLP[end..]);
            parse_and_lower(&text);
        }

        #[test]
        fn arbitrary_text_never_panics(text in "\\PC{0,300}") {
            parse_and_lower(&text);
        }
    }
}
