//! HuggingFace `config.json` files as transformers: GPT-2, the LLaMA/Mistral/Qwen2/Qwen3
//! family, and the mixture-of-experts models Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V2/V3
//! (with multi-head latent attention).

use super::locate::{PathSeg, locate, offset_of};
use super::transformer::{
    Bias, MlaConfig, Mlp, MoeConfig, MoeRouting, Norm, Position, TransformerConfig,
    TransformerConfigError, TransformerField,
};
use crate::error::FieldError;
use serde_json::{Map, Value};

/// Architecture families this reader understands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    /// `model_type = "gpt2"`: `n_embd`, `n_layer`, `n_head`, `n_positions`, `vocab_size`.
    Gpt2,
    /// `llama`, `mistral`, `qwen2`, `qwen3`: `hidden_size`, `intermediate_size`,
    /// `num_attention_heads`, `num_key_value_heads`, `num_hidden_layers`, `vocab_size`,
    /// `max_position_embeddings`.
    Llama { qwen2: bool, qwen3: bool },
    /// `mixtral`: LLaMA's fields plus `num_local_experts` and `num_experts_per_tok`; each
    /// expert is an MLP of `intermediate_size`.
    Mixtral,
    /// `qwen2_moe`, `qwen3_moe`: `num_experts`, `num_experts_per_tok`, `moe_intermediate_size`,
    /// and for Qwen2-MoE `shared_expert_intermediate_size`.
    QwenMoe { qwen3: bool },
    /// `deepseek_v2`, `deepseek_v3`: `n_routed_experts`, `n_shared_experts`,
    /// `moe_intermediate_size`, `first_k_dense_replace`, and MLA's `q_lora_rank`,
    /// `kv_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`.
    DeepSeek,
}

const FAMILIES: &str = "one of gpt2, llama, mistral, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe, deepseek_v2, deepseek_v3";

struct Reader<'a> {
    text: &'a str,
    obj: &'a Map<String, Value>,
}

impl Reader<'_> {
    fn err(&self, key: &str, expected: impl Into<String>, found: impl Into<String>) -> FieldError {
        FieldError::new(key, expected, found).at(locate(self.text, &[PathSeg::Key(key)]))
    }

    fn missing(&self, key: &str) -> FieldError {
        FieldError::new(key, "a positive integer", "nothing (the field is missing)")
    }

    /// An optional non-negative integer (`null` counts as absent).
    fn opt_u64(&self, key: &str) -> Result<Option<u64>, FieldError> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .map(Some)
                .ok_or_else(|| self.err(key, "a non-negative integer", describe(v))),
        }
    }

    fn u64(&self, key: &str) -> Result<u64, FieldError> {
        self.opt_u64(key)?.ok_or_else(|| self.missing(key))
    }

    fn opt_f64(&self, key: &str) -> Result<Option<f64>, FieldError> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.err(key, "a number", describe(v))),
        }
    }

    fn opt_bool(&self, key: &str) -> Result<Option<bool>, FieldError> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.err(key, "true or false", describe(v))),
        }
    }

    fn opt_str(&self, key: &str) -> Result<Option<&str>, FieldError> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.err(key, "a string", describe(v))),
        }
    }
}

/// Short rendering of a JSON value for "found ..." messages.
fn describe(v: &Value) -> String {
    let s = v.to_string();
    let short: String = s.chars().take(40).collect();
    let kind = match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    };
    if short.len() < s.len() {
        format!("{kind} {short}...")
    } else {
        format!("{kind} {short}")
    }
}

/// Parses a HuggingFace `config.json` into a transformer architecture.
///
/// Only the fields that determine cost and memory are read; everything else (token ids, init
/// ranges, rope scaling) is ignored, as HuggingFace configs carry many such keys.
pub fn parse_hf_config(text: &str) -> Result<TransformerConfig, FieldError> {
    let value: Value = serde_json::from_str(text).map_err(|e| {
        FieldError::new("(document)", "a JSON object", format!("invalid JSON: {e}"))
            .at(Some(offset_of(text, e.line(), e.column())))
    })?;
    let Some(obj) = value.as_object() else {
        return Err(FieldError::new("(document)", "a JSON object", describe(&value)).at(Some(0)));
    };
    let r = Reader { text, obj };
    let family = match r.opt_str("model_type")? {
        Some("gpt2") => Family::Gpt2,
        Some(t @ ("llama" | "mistral" | "qwen2" | "qwen3")) => Family::Llama {
            qwen2: t == "qwen2",
            qwen3: t == "qwen3",
        },
        Some("mixtral") => Family::Mixtral,
        Some(t @ ("qwen2_moe" | "qwen3_moe")) => Family::QwenMoe {
            qwen3: t == "qwen3_moe",
        },
        Some("deepseek_v2" | "deepseek_v3") => Family::DeepSeek,
        Some(other) => {
            return Err(r.err("model_type", FAMILIES, format!("\"{other}\"")));
        }
        None if obj.contains_key("n_embd") => Family::Gpt2,
        None if obj.contains_key("hidden_size") => Family::Llama {
            qwen2: false,
            qwen3: false,
        },
        None => {
            return Err(FieldError::new(
                "model_type",
                "a GPT-2 (n_embd, n_layer, ...) or LLaMA-style (hidden_size, ...) config",
                "neither model_type nor n_embd nor hidden_size",
            ));
        }
    };
    // A dense family's code ignores expert fields; a config that has them is mislabelled.
    if matches!(family, Family::Gpt2 | Family::Llama { .. }) {
        for key in ["num_local_experts", "num_experts", "n_routed_experts"] {
            if let Some(n) = r.opt_u64(key)?
                && n > 1
            {
                return Err(r.err(
                    key,
                    "no experts under a dense model_type (mixture-of-experts configs say \
                     mixtral, qwen2_moe, qwen3_moe, deepseek_v2 or deepseek_v3)",
                    n.to_string(),
                ));
            }
        }
    }
    let (config, names): (TransformerConfig, fn(TransformerField) -> &'static str) = match family {
        Family::Gpt2 => (gpt2(&r)?, gpt2_name),
        Family::Llama { qwen2, qwen3 } => (llama(&r, qwen2, qwen3)?, llama_name),
        Family::Mixtral => (mixtral(&r)?, mixtral_name),
        Family::QwenMoe { qwen3 } => (qwen_moe(&r, qwen3)?, qwen_moe_name),
        Family::DeepSeek => (deepseek(&r)?, deepseek_name),
    };
    config.validate().map_err(|e| located(&r, e, names))?;
    Ok(config)
}

fn located(
    r: &Reader<'_>,
    e: TransformerConfigError,
    names: fn(TransformerField) -> &'static str,
) -> FieldError {
    let key = names(e.field);
    let offset = locate(r.text, &[PathSeg::Key(key)]);
    e.into_field_error(|f| names(f).to_string()).at(offset)
}

fn gpt2_name(f: TransformerField) -> &'static str {
    match f {
        TransformerField::Hidden | TransformerField::HeadDim => "n_embd",
        TransformerField::Layers => "n_layer",
        TransformerField::Heads | TransformerField::KvHeads => "n_head",
        TransformerField::FfnHidden => "n_inner",
        TransformerField::Vocab => "vocab_size",
        TransformerField::MaxSeq => "n_positions",
        TransformerField::Experts | TransformerField::TopK | TransformerField::ExpertFfn => {
            "model_type"
        }
    }
}

fn llama_name(f: TransformerField) -> &'static str {
    match f {
        TransformerField::Hidden => "hidden_size",
        TransformerField::Layers => "num_hidden_layers",
        TransformerField::Heads => "num_attention_heads",
        TransformerField::KvHeads => "num_key_value_heads",
        TransformerField::HeadDim => "head_dim",
        TransformerField::FfnHidden => "intermediate_size",
        TransformerField::Vocab => "vocab_size",
        TransformerField::MaxSeq => "max_position_embeddings",
        TransformerField::Experts | TransformerField::TopK | TransformerField::ExpertFfn => {
            "model_type"
        }
    }
}

fn mixtral_name(f: TransformerField) -> &'static str {
    match f {
        TransformerField::Experts => "num_local_experts",
        TransformerField::TopK => "num_experts_per_tok",
        TransformerField::ExpertFfn => "intermediate_size",
        f => llama_name(f),
    }
}

fn qwen_moe_name(f: TransformerField) -> &'static str {
    match f {
        TransformerField::Experts => "num_experts",
        TransformerField::TopK => "num_experts_per_tok",
        TransformerField::ExpertFfn => "moe_intermediate_size",
        f => llama_name(f),
    }
}

fn deepseek_name(f: TransformerField) -> &'static str {
    match f {
        TransformerField::Experts => "n_routed_experts",
        TransformerField::HeadDim => "qk_nope_head_dim",
        f => qwen_moe_name(f),
    }
}

fn gpt2(r: &Reader<'_>) -> Result<TransformerConfig, FieldError> {
    let hidden = r.u64("n_embd")?;
    let heads = r.u64("n_head")?;
    let head_dim =
        TransformerConfig::default_head_dim(hidden, heads).map_err(|e| located(r, e, gpt2_name))?;
    let max_seq = match r.opt_u64("n_positions")? {
        Some(n) => n,
        None => r
            .opt_u64("n_ctx")?
            .ok_or_else(|| r.missing("n_positions"))?,
    };
    let act = r.opt_str("activation_function")?.unwrap_or("gelu_new");
    if !act.starts_with("gelu") {
        return Err(r.err(
            "activation_function",
            "a GeLU variant (gelu, gelu_new, gelu_fast, gelu_pytorch_tanh)",
            format!("\"{act}\""),
        ));
    }
    // GPT2Config defaults every dropout probability to 0.1.
    let mut dropout = false;
    for key in ["resid_pdrop", "embd_pdrop", "attn_pdrop"] {
        dropout |= r.opt_f64(key)?.unwrap_or(0.1) > 0.0;
    }
    Ok(TransformerConfig {
        hidden,
        layers: r.u64("n_layer")?,
        heads,
        kv_heads: heads,
        head_dim,
        ffn_hidden: r.opt_u64("n_inner")?.unwrap_or(4 * hidden),
        vocab: r.u64("vocab_size")?,
        max_seq,
        mlp: Mlp::Gelu,
        norm: Norm::LayerNorm,
        position: Position::Learned,
        tied_embeddings: r.opt_bool("tie_word_embeddings")?.unwrap_or(true),
        bias: Bias::All,
        dropout,
        moe: None,
        mla: None,
        qk_norm: false,
    })
}

fn llama(r: &Reader<'_>, qwen2: bool, qwen3: bool) -> Result<TransformerConfig, FieldError> {
    let hidden = r.u64("hidden_size")?;
    let heads = r.u64("num_attention_heads")?;
    let head_dim = match r.opt_u64("head_dim")? {
        Some(d) => d,
        None => TransformerConfig::default_head_dim(hidden, heads)
            .map_err(|e| located(r, e, llama_name))?,
    };
    let act = r.opt_str("hidden_act")?.unwrap_or("silu");
    if !matches!(act, "silu" | "swish" | "gelu" | "gelu_pytorch_tanh") {
        return Err(r.err(
            "hidden_act",
            "the activation of a gated MLP (silu, swish, gelu, gelu_pytorch_tanh)",
            format!("\"{act}\""),
        ));
    }
    // Qwen2 puts a bias on the q/k/v projections without saying so in its config.
    let bias = if r.opt_bool("mlp_bias")?.unwrap_or(false) {
        Bias::All
    } else if qwen2 || r.opt_bool("attention_bias")?.unwrap_or(false) {
        Bias::Qkv
    } else {
        Bias::None
    };
    Ok(TransformerConfig {
        hidden,
        layers: r.u64("num_hidden_layers")?,
        heads,
        kv_heads: r.opt_u64("num_key_value_heads")?.unwrap_or(heads),
        head_dim,
        ffn_hidden: r.u64("intermediate_size")?,
        vocab: r.u64("vocab_size")?,
        max_seq: r.u64("max_position_embeddings")?,
        mlp: Mlp::SwiGlu,
        norm: Norm::RmsNorm,
        position: Position::Rope,
        tied_embeddings: r.opt_bool("tie_word_embeddings")?.unwrap_or(false),
        bias,
        // LLaMA-family models pre-train without dropout.
        dropout: false,
        moe: None,
        mla: None,
        // Qwen3 normalises every query and key head (q_norm, k_norm).
        qk_norm: qwen3,
    })
}

/// The MoE part every MoE family shares: `experts` and `expert_ffn` read from the named keys,
/// `num_experts_per_tok` as top-k.
fn moe_part(r: &Reader<'_>, experts: &str, ffn: &str) -> Result<MoeConfig, FieldError> {
    Ok(MoeConfig {
        experts: r.u64(experts)?,
        top_k: r.u64("num_experts_per_tok")?,
        expert_ffn: r.u64(ffn)?,
        shared_ffn: 0,
        dense_layers: 0,
        router_bias: false,
        routing: MoeRouting::default(),
    })
}

/// Refuses a config whose MoE blocks are not every block from some point on (Qwen's
/// `decoder_sparse_step` above 1 or `mlp_only_layers`, DeepSeek's `moe_layer_freq` above 1):
/// no published model of these families uses them.
fn every_block(r: &Reader<'_>, key: &str) -> Result<(), FieldError> {
    if let Some(n) = r.opt_u64(key)?
        && n > 1
    {
        return Err(r.err(
            key,
            "1 (every block from the first MoE block on is MoE)",
            n.to_string(),
        ));
    }
    Ok(())
}

fn mixtral(r: &Reader<'_>) -> Result<TransformerConfig, FieldError> {
    let mut c = llama(r, false, false)?;
    c.moe = Some(moe_part(r, "num_local_experts", "intermediate_size")?);
    Ok(c)
}

fn qwen_moe(r: &Reader<'_>, qwen3: bool) -> Result<TransformerConfig, FieldError> {
    // Qwen2-MoE has q/k/v biases like Qwen2; Qwen3-MoE has none and per-head q/k norms.
    let mut c = llama(r, !qwen3, qwen3)?;
    every_block(r, "decoder_sparse_step")?;
    if let Some(v) = r.obj.get("mlp_only_layers")
        && v.as_array().is_some_and(|a| !a.is_empty())
    {
        return Err(r.err(
            "mlp_only_layers",
            "an empty list (every block is MoE)",
            describe(v),
        ));
    }
    let mut moe = moe_part(r, "num_experts", "moe_intermediate_size")?;
    // Qwen2-MoE's shared expert also has a one-unit sigmoid gate (`shared_expert_gate`, h
    // weights per block), left out: under 1e-5 of the block's parameters and FLOPs.
    moe.shared_ffn = r.opt_u64("shared_expert_intermediate_size")?.unwrap_or(0);
    c.moe = Some(moe);
    Ok(c)
}

fn deepseek(r: &Reader<'_>) -> Result<TransformerConfig, FieldError> {
    let hidden = r.u64("hidden_size")?;
    let heads = r.u64("num_attention_heads")?;
    let mla = MlaConfig {
        q_lora_rank: r.opt_u64("q_lora_rank")?.unwrap_or(0),
        kv_lora_rank: r.u64("kv_lora_rank")?,
        qk_nope_head_dim: r.u64("qk_nope_head_dim")?,
        qk_rope_head_dim: r.u64("qk_rope_head_dim")?,
        v_head_dim: r.u64("v_head_dim")?,
    };
    every_block(r, "moe_layer_freq")?;
    let mut moe = moe_part(r, "n_routed_experts", "moe_intermediate_size")?;
    moe.shared_ffn = r.opt_u64("n_shared_experts")?.unwrap_or(0) * moe.expert_ffn;
    moe.dense_layers = r.opt_u64("first_k_dense_replace")?.unwrap_or(0);
    // DeepSeek-V3's auxiliary-loss-free balancing adds a bias to the routing scores.
    moe.router_bias = r.opt_str("topk_method")? == Some("noaux_tc");
    let act = r.opt_str("hidden_act")?.unwrap_or("silu");
    if !matches!(act, "silu" | "swish") {
        return Err(r.err("hidden_act", "silu", format!("\"{act}\"")));
    }
    Ok(TransformerConfig {
        hidden,
        layers: r.u64("num_hidden_layers")?,
        heads,
        // Every head has its own keys and values once they are projected up from the latent.
        kv_heads: heads,
        head_dim: mla.qk_nope_head_dim + mla.qk_rope_head_dim,
        ffn_hidden: r.u64("intermediate_size")?,
        vocab: r.u64("vocab_size")?,
        max_seq: r.u64("max_position_embeddings")?,
        mlp: Mlp::SwiGlu,
        norm: Norm::RmsNorm,
        position: Position::Rope,
        tied_embeddings: r.opt_bool("tie_word_embeddings")?.unwrap_or(false),
        bias: if r.opt_bool("attention_bias")?.unwrap_or(false) {
            Bias::Qkv
        } else {
            Bias::None
        },
        dropout: false,
        moe: Some(moe),
        mla: Some(mla),
        qk_norm: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::frontend::locate::line_col;
    use proptest::prelude::*;

    const LLAMA: &str = r#"{
  "model_type": "llama",
  "hidden_size": 4096,
  "intermediate_size": 14336,
  "num_attention_heads": 32,
  "num_key_value_heads": 8,
  "num_hidden_layers": 32,
  "vocab_size": 128256,
  "max_position_embeddings": 8192
}"#;

    #[test]
    fn reads_llama_fields() {
        let c = parse_hf_config(LLAMA).expect("valid config");
        assert_eq!((c.hidden, c.kv_heads, c.head_dim), (4096, 8, 128));
        assert_eq!(
            (c.mlp, c.norm, c.position),
            (Mlp::SwiGlu, Norm::RmsNorm, Position::Rope)
        );
        assert!(!c.tied_embeddings);
    }

    #[test]
    fn heads_not_dividing_hidden_points_at_the_heads_field() {
        let text = LLAMA.replace("\"num_attention_heads\": 32", "\"num_attention_heads\": 30");
        let e = parse_hf_config(&text).expect_err("30 heads do not divide 4096");
        assert_eq!(e.field, "num_attention_heads");
        assert_eq!(e.found, "30");
        assert!(e.expected.contains("divides the hidden size 4096"), "{e}");
        assert_eq!(line_col(&text, e.offset.expect("located")), (5, 3));
    }

    #[test]
    fn wrong_type_names_field_and_value() {
        let text = LLAMA.replace("\"vocab_size\": 128256", "\"vocab_size\": \"big\"");
        let e = parse_hf_config(&text).expect_err("a string is not a vocabulary size");
        assert_eq!(e.field, "vocab_size");
        assert_eq!(e.found, "string \"big\"");
        assert_eq!(line_col(&text, e.offset.expect("located")).0, 8);
    }

    #[test]
    fn syntax_error_is_located() {
        let e = parse_hf_config("{\n  \"n_embd\": 768,\n  oops\n}").expect_err("not JSON");
        assert_eq!(e.field, "(document)");
        let text = "{\n  \"n_embd\": 768,\n  oops\n}";
        assert_eq!(line_col(text, e.offset.expect("located")).0, 3);
    }

    #[test]
    fn rejects_experts_under_dense_families_and_unknown_families() {
        let moe = LLAMA.replace("\"vocab_size\"", "\"num_local_experts\": 8, \"vocab_size\"");
        assert_eq!(
            parse_hf_config(&moe).expect_err("moe").field,
            "num_local_experts"
        );
        let t5 = LLAMA.replace("\"llama\"", "\"t5\"");
        assert_eq!(parse_hf_config(&t5).expect_err("t5").field, "model_type");
    }

    proptest! {
        #[test]
        fn arbitrary_text_never_panics(text in ".{0,300}") {
            let _ = parse_hf_config(&text);
        }

        #[test]
        fn mutated_configs_never_panic(pos in 0usize..300, ch in proptest::char::any()) {
            let mut s: Vec<char> = LLAMA.chars().collect();
            let p = pos % s.len();
            s[p] = ch;
            let text: String = s.into_iter().collect();
            let _ = parse_hf_config(&text);
        }

        #[test]
        fn any_numbers_never_panic(h in 0u64..100_000, a in 0u64..200, g in 0u64..200, l in 0u64..200) {
            let text = format!(
                r#"{{"model_type":"llama","hidden_size":{h},"intermediate_size":1,"num_attention_heads":{a},"num_key_value_heads":{g},"num_hidden_layers":{l},"vocab_size":10,"max_position_embeddings":8}}"#
            );
            if let Ok(c) = parse_hf_config(&text) {
                prop_assert!(c.heads % c.kv_heads == 0 && c.hidden % c.heads == 0);
            }
        }
    }
}
