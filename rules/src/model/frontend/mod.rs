//! Model sources lowered to the op graph: HuggingFace configs, inline transformer fields and the
//! generic graph file format.

mod graph_json;
mod hf;
pub mod locate;
mod transformer;

pub use graph_json::{Dim, GRAPH_FORMAT, GraphSpec, UnknownKind, parse_graph_file};
pub use hf::parse_hf_config;
pub use transformer::{
    Attention, Bias, LowerOptions, Milli, MlaConfig, Mlp, MoeConfig, MoeRouting, Norm, Position,
    TransformerConfig, TransformerConfigError, TransformerField,
};

use crate::error::FieldError;
use crate::model::graph::Graph;

/// A model architecture, whatever file it came from.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ModelDef {
    /// A decoder-only transformer.
    Transformer(TransformerConfig),
    /// An arbitrary op graph.
    Graph(GraphSpec),
}

/// Canonical name of a transformer field, as written inline in `workspace.toml`.
pub fn canonical_field_name(f: TransformerField) -> &'static str {
    match f {
        TransformerField::Hidden => "hidden",
        TransformerField::Layers => "layers",
        TransformerField::Heads => "heads",
        TransformerField::KvHeads => "kv_heads",
        TransformerField::HeadDim => "head_dim",
        TransformerField::FfnHidden => "ffn_hidden",
        TransformerField::Vocab => "vocab",
        TransformerField::MaxSeq => "max_seq",
        TransformerField::Experts => "experts",
        TransformerField::TopK => "top_k",
        TransformerField::ExpertFfn => "expert_ffn",
    }
}

impl ModelDef {
    /// Lowers the model to its op graph. `opts.attention` and `opts.vocab_multiple` only apply to
    /// transformers; a graph file spells out its own ops.
    pub fn lower(&self, name: &str, opts: &LowerOptions) -> Result<Graph, FieldError> {
        match self {
            ModelDef::Transformer(c) => c
                .lower(name, opts)
                .map_err(|e| FieldError::new(e.op, "a well-formed transformer", e.message)),
            ModelDef::Graph(spec) => {
                spec.lower_with(opts.micro_batch, opts.seq, opts.dtype, opts.fp8)
            }
        }
    }

    /// The model with its mixture-of-experts layers routing as `routing` says (`None` for a
    /// model without them).
    pub fn with_routing(&self, routing: MoeRouting) -> Option<ModelDef> {
        match self {
            ModelDef::Transformer(c) => c.moe.map(|m| {
                ModelDef::Transformer(TransformerConfig {
                    moe: Some(MoeConfig { routing, ..m }),
                    ..c.clone()
                })
            }),
            ModelDef::Graph(_) => None,
        }
    }

    /// Longest sequence the model supports, when it has a learned position table or its file
    /// says so.
    pub fn max_seq(&self) -> Option<u64> {
        match self {
            ModelDef::Transformer(c) => Some(c.max_seq),
            ModelDef::Graph(g) => g.max_seq,
        }
    }

    /// Whether sequences longer than [`ModelDef::max_seq`] are impossible (a learned position
    /// table has no rows for them), rather than merely beyond the trained context.
    pub fn max_seq_is_hard(&self) -> bool {
        match self {
            ModelDef::Transformer(c) => c.position == Position::Learned,
            ModelDef::Graph(_) => true,
        }
    }

    /// The architecture without names (the model's, its layers', ops' and tensors'): what
    /// plans depend on, as a JSON value whose fields `explain` can compare.
    pub fn canonical_json(&self) -> serde_json::Value {
        match self {
            ModelDef::Transformer(c) => {
                serde_json::json!({ "transformer": serde_json::to_value(c).unwrap_or_default() })
            }
            ModelDef::Graph(g) => serde_json::json!({ "graph": g.canonical_json() }),
        }
    }

    /// Layer names a graph file gives (they appear in plans but are no part of any key);
    /// `None` for transformers, whose layer names follow from their structure.
    pub fn layer_names(&self) -> Option<Vec<String>> {
        match self {
            ModelDef::Transformer(_) => None,
            ModelDef::Graph(g) => Some(g.layer_names()),
        }
    }

    /// The transformer architecture, if this is one.
    pub fn transformer(&self) -> Option<&TransformerConfig> {
        match self {
            ModelDef::Transformer(c) => Some(c),
            ModelDef::Graph(_) => None,
        }
    }
}
