//! Generated op-graph files (`autopar-graph/1`) of any size, for the D-Rec tests and
//! benchmark: stacked transformer blocks, stacked MLP blocks, and U-Net-like units whose
//! encoder outputs skip to the decoder (several branches meeting at each add).

use serde_json::{Value, json};

/// Width of the residual stream.
const HIDDEN: u64 = 1024;
/// Attention heads of the transformer blocks (head width `HIDDEN / HEADS`).
const HEADS: u64 = 16;
/// Vocabulary of the embedding and the head.
const VOCAB: u64 = 32768;

/// A generated graph's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Pre-norm transformer blocks: norm, fused QKV, split, attention, projection, residual,
    /// norm, MLP up, GELU, MLP down, residual (11 forward ops each).
    Transformer,
    /// Norm, up, GELU, down, residual (5 forward ops each).
    Mlp,
    /// Encoder of 4 levels (matmul halving the width, GELU) and decoder of 4 levels (matmul
    /// doubling it, add of the encoder's output at that width, GELU): 20 forward ops each.
    UNet,
}

impl Family {
    /// Forward ops per unit.
    pub fn ops_per_unit(self) -> usize {
        match self {
            Family::Transformer => 11,
            Family::Mlp => 5,
            Family::UNet => 20,
        }
    }

    /// Name in tables.
    pub fn name(self) -> &'static str {
        match self {
            Family::Transformer => "transformer",
            Family::Mlp => "mlp",
            Family::UNet => "unet",
        }
    }
}

struct Writer {
    tensors: Vec<Value>,
    layers: Vec<Value>,
    ops: Vec<Value>,
}

impl Writer {
    fn tensor(&mut self, name: &str, shape: Value) -> String {
        self.tensors.push(json!({"name": name, "shape": shape}));
        name.to_string()
    }

    fn param(&mut self, name: &str, shape: Value) -> String {
        self.tensors
            .push(json!({"name": name, "shape": shape, "kind": "parameter"}));
        name.to_string()
    }

    fn op(&mut self, name: &str, kind: &str, inputs: &[&str], outputs: &[&str]) {
        self.ops
            .push(json!({"name": name, "kind": kind, "inputs": inputs, "outputs": outputs}));
    }

    fn layer(&mut self, name: &str, kind: &str) {
        let ops = std::mem::take(&mut self.ops);
        self.layers
            .push(json!({"name": name, "kind": kind, "ops": ops}));
    }
}

/// A graph file of `units` units of `family` between an embedding and a head (norm, output
/// matmul, cross-entropy), one layer per unit: `units x ops_per_unit + 4` forward ops.
pub fn graph_file(family: Family, units: usize) -> String {
    let h = HIDDEN;
    let mut w = Writer {
        tensors: vec![
            json!({"name": "tokens", "shape": ["b", "s"], "kind": "input", "dtype": "i32"}),
            json!({"name": "labels", "shape": ["b", "s"], "kind": "input", "dtype": "i32"}),
        ],
        layers: Vec::new(),
        ops: Vec::new(),
    };
    let table = w.param("embedding", json!([VOCAB, h]));
    let mut x = w.tensor("x0", json!(["b", "s", h]));
    w.op("lookup", "embedding", &["tokens", &table], &[&x]);
    w.layer("embed", "embedding");
    for u in 0..units {
        x = match family {
            Family::Transformer => transformer_block(&mut w, u, &x),
            Family::Mlp => mlp_block(&mut w, u, &x),
            Family::UNet => unet_unit(&mut w, u, &x),
        };
        w.layer(&format!("unit{u}"), "block");
    }
    let norm = w.param("final_norm.weight", json!([h]));
    let xn = w.tensor("xn", json!(["b", "s", h]));
    w.op("final_norm", "rmsnorm", &[&x, &norm], &[&xn]);
    let out = w.param("output.weight", json!([h, VOCAB]));
    let logits = w.tensor("logits", json!(["b", "s", VOCAB]));
    w.op("output", "matmul", &[&xn, &out], &[&logits]);
    w.tensors
        .push(json!({"name": "loss", "shape": [1], "dtype": "f32"}));
    w.op("loss", "cross_entropy", &[&logits, "labels"], &["loss"]);
    w.layer("head", "head");
    json!({
        "format": "autopar-graph/1",
        "name": format!("{}-{units}", family.name()),
        "max_seq": 2048,
        "tensors": w.tensors,
        "layers": w.layers,
    })
    .to_string()
}

fn transformer_block(w: &mut Writer, u: usize, x: &str) -> String {
    let (h, a, d) = (HIDDEN, HEADS, HIDDEN / HEADS);
    let p = |s: &str| format!("t{u}.{s}");
    let g1 = w.param(&p("norm1.weight"), json!([h]));
    let n1 = w.tensor(&p("n1"), json!(["b", "s", h]));
    w.op(&p("norm1"), "rmsnorm", &[x, &g1], &[&n1]);
    let wqkv = w.param(&p("qkv.weight"), json!([h, 3 * h]));
    let qkv = w.tensor(&p("qkv"), json!(["b", "s", 3 * h]));
    w.op(&p("qkv"), "matmul", &[&n1, &wqkv], &[&qkv]);
    let q = w.tensor(&p("q"), json!(["b", a, "s", d]));
    let k = w.tensor(&p("k"), json!(["b", a, "s", d]));
    let v = w.tensor(&p("v"), json!(["b", a, "s", d]));
    w.op(&p("split"), "slice", &[&qkv], &[&q, &k, &v]);
    let ctx = w.tensor(&p("ctx"), json!(["b", a, "s", d]));
    w.op(&p("attention"), "flash_attention", &[&q, &k, &v], &[&ctx]);
    let wo = w.param(&p("proj.weight"), json!([h, h]));
    let o = w.tensor(&p("o"), json!(["b", "s", h]));
    w.op(&p("proj"), "matmul", &[&ctx, &wo], &[&o]);
    let r1 = w.tensor(&p("r1"), json!(["b", "s", h]));
    w.op(&p("residual1"), "add", &[&o, x], &[&r1]);
    mlp_tail(w, &p(""), &r1, 4 * h)
}

fn mlp_block(w: &mut Writer, u: usize, x: &str) -> String {
    mlp_tail(w, &format!("m{u}."), x, 4 * HIDDEN)
}

/// Norm, up, GELU, down, residual add.
fn mlp_tail(w: &mut Writer, prefix: &str, x: &str, ffn: u64) -> String {
    let h = HIDDEN;
    let p = |s: &str| format!("{prefix}{s}");
    let g = w.param(&p("norm2.weight"), json!([h]));
    let n = w.tensor(&p("n2"), json!(["b", "s", h]));
    w.op(&p("norm2"), "rmsnorm", &[x, &g], &[&n]);
    let w1 = w.param(&p("up.weight"), json!([h, ffn]));
    let up = w.tensor(&p("up"), json!(["b", "s", ffn]));
    w.op(&p("up"), "matmul", &[&n, &w1], &[&up]);
    let act = w.tensor(&p("act"), json!(["b", "s", ffn]));
    w.op(&p("gelu"), "gelu", &[&up], &[&act]);
    let w2 = w.param(&p("down.weight"), json!([ffn, h]));
    let down = w.tensor(&p("down"), json!(["b", "s", h]));
    w.op(&p("down"), "matmul", &[&act, &w2], &[&down]);
    let out = w.tensor(&p("out"), json!(["b", "s", h]));
    w.op(&p("residual2"), "add", &[&down, x], &[&out]);
    out
}

fn unet_unit(w: &mut Writer, u: usize, x: &str) -> String {
    let p = |s: &str| format!("u{u}.{s}");
    let mut width = HIDDEN;
    let mut cur = x.to_string();
    // The encoder's output at each width, for the decoder's skip adds.
    let mut skips: Vec<(String, u64)> = vec![(cur.clone(), width)];
    for level in 0..4 {
        let next = width / 2;
        let wt = w.param(&p(&format!("down{level}.weight")), json!([width, next]));
        let y = w.tensor(&p(&format!("down{level}")), json!(["b", "s", next]));
        w.op(&p(&format!("down{level}")), "matmul", &[&cur, &wt], &[&y]);
        let a = w.tensor(&p(&format!("down{level}.act")), json!(["b", "s", next]));
        w.op(&p(&format!("down{level}.gelu")), "gelu", &[&y], &[&a]);
        cur = a;
        width = next;
        skips.push((cur.clone(), width));
    }
    skips.pop();
    for level in 0..4 {
        let (skip, next) = skips.pop().unwrap_or_else(|| (x.to_string(), HIDDEN));
        let wt = w.param(&p(&format!("up{level}.weight")), json!([width, next]));
        let y = w.tensor(&p(&format!("up{level}")), json!(["b", "s", next]));
        w.op(&p(&format!("up{level}")), "matmul", &[&cur, &wt], &[&y]);
        let s = w.tensor(&p(&format!("up{level}.skip")), json!(["b", "s", next]));
        w.op(&p(&format!("up{level}.add")), "add", &[&y, &skip], &[&s]);
        let a = w.tensor(&p(&format!("up{level}.act")), json!(["b", "s", next]));
        w.op(&p(&format!("up{level}.gelu")), "gelu", &[&s], &[&a]);
        cur = a;
        width = next;
    }
    cur
}

#[cfg(test)]
mod tests {
    use super::*;
    use autopar_rules::model::frontend::parse_graph_file;
    use autopar_rules::model::graph::DType;

    #[test]
    fn every_family_parses_and_lowers_with_the_ops_it_promises() {
        for family in [Family::Transformer, Family::Mlp, Family::UNet] {
            let text = graph_file(family, 3);
            let spec = parse_graph_file(&text).unwrap_or_else(|e| panic!("{family:?}: {e}"));
            let g = spec
                .lower(1, 256, DType::Bf16)
                .unwrap_or_else(|e| panic!("{family:?}: {e}"));
            let forward = g
                .ops
                .iter()
                .filter(|o| o.pass == autopar_rules::model::graph::Pass::Forward)
                .count();
            assert_eq!(forward, 3 * family.ops_per_unit() + 4, "{family:?}");
            assert_eq!(g.layers.len(), 5, "{family:?}");
        }
    }
}
