//! Models and layouts for the executor tests.

use autopar_engine::executor::ExecLayout;
use autopar_engine::executor::placement::{Placement, State};
use autopar_engine::workspace;
use autopar_rules::cost::profile::{EntryId, Profile, parse_profile};
use autopar_rules::model::frontend::{
    Attention, Bias, LowerOptions, Milli, Mlp, ModelDef, MoeConfig, MoeRouting, Norm, Position,
    TransformerConfig,
};
use autopar_rules::model::graph::{DType, Graph, Split, TensorKind};
use std::collections::BTreeMap;

/// The shipped `tiny-llama` model of the default workspace (4 blocks, hidden 256, 8 heads over
/// 2 key/value heads, SwiGLU, RMSNorm, rotary positions), lowered at micro-batch `mb` and
/// sequence `seq` with its vocabulary padded for `tp` ranks.
pub fn tiny_llama(mb: u64, seq: u64, tp: u64) -> Graph {
    let ws = workspace::load(&crate::repo_root().join("workspace.toml")).expect("workspace");
    let def = &ws.model("tiny-llama").expect("tiny-llama is shipped").def;
    lower(def, mb, seq, tp, Attention::Flash)
}

/// A small GPT (learned positions, LayerNorm, GeLU, biases, dropout, tied embeddings, unfused
/// attention): every op kind the LLaMA model does not use.
pub fn tiny_gpt(mb: u64, seq: u64, tp: u64) -> Graph {
    let def = ModelDef::Transformer(TransformerConfig {
        hidden: 64,
        layers: 2,
        heads: 4,
        kv_heads: 4,
        head_dim: 16,
        ffn_hidden: 256,
        vocab: 250,
        max_seq: 64,
        mlp: Mlp::Gelu,
        norm: Norm::LayerNorm,
        position: Position::Learned,
        tied_embeddings: true,
        bias: Bias::All,
        dropout: true,
        moe: None,
        mla: None,
        qk_norm: false,
    });
    lower(&def, mb, seq, tp, Attention::Unfused)
}

/// A small mixture-of-experts LLaMA: 2 blocks of width 64 routing every token to 2 of 4
/// SwiGLU experts of width 96, each expert's buffer holding `capacity` times the balanced
/// share of tokens (dropped past it when `drop`).
pub fn tiny_moe(mb: u64, seq: u64, tp: u64, capacity: f64, drop: bool) -> Graph {
    let def = ModelDef::Transformer(TransformerConfig {
        hidden: 64,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        ffn_hidden: 128,
        vocab: 250,
        max_seq: 128,
        mlp: Mlp::SwiGlu,
        norm: Norm::RmsNorm,
        position: Position::Rope,
        tied_embeddings: false,
        bias: Bias::None,
        dropout: false,
        moe: Some(MoeConfig {
            experts: 4,
            top_k: 2,
            expert_ffn: 96,
            shared_ffn: 0,
            dense_layers: 0,
            router_bias: false,
            routing: MoeRouting {
                factor: Milli((capacity * 1000.0) as u64),
                drop_tokens: drop,
            },
        }),
        mla: None,
        qk_norm: false,
    });
    lower(&def, mb, seq, tp, Attention::Flash)
}

fn lower(def: &ModelDef, mb: u64, seq: u64, tp: u64, attention: Attention) -> Graph {
    def.lower(
        "test",
        &LowerOptions {
            micro_batch: mb,
            seq,
            dtype: DType::F32,
            attention,
            vocab_multiple: 8 * tp,
            eager_elementwise: false,
            fp8: false,
        },
    )
    .expect("lowers")
}

/// A layout with `chunks[stage][chunk]` layer ranges.
pub fn layout(
    dp: usize,
    tp: usize,
    sp: bool,
    zero: u8,
    microbatches: usize,
    chunks: Vec<Vec<(usize, usize)>>,
) -> ExecLayout {
    ExecLayout {
        tp,
        pp: chunks.len(),
        dp,
        sequence_parallel: sp,
        zero,
        chunks,
        ..ExecLayout::single(0, microbatches)
    }
}

/// How a test places a model's tensors on a two-axis logical mesh.
#[derive(Clone, Debug, Default)]
pub struct MeshScheme {
    /// Mesh axis splitting the batch of every activation and input (data parallelism).
    pub batch: Option<usize>,
    /// Mesh axes splitting each tensor along its Megatron-LM split (two: `S01`).
    pub model: Vec<usize>,
    /// Mesh axis splitting every matrix weight along its other axis (2D weights).
    pub cross: Option<usize>,
}

/// Placements of the graph's tensors under `scheme`, by name; with `received_by`, also the
/// placements `NAME@STAGE` of every tensor as a stage on another mesh receives it.
pub fn mesh_placements(
    graph: &Graph,
    scheme: &MeshScheme,
    received_by: Option<usize>,
) -> BTreeMap<String, Placement> {
    let mut out = BTreeMap::new();
    for t in &graph.tensors {
        let shape: Vec<usize> = t.shape.iter().map(|&d| d as usize).collect();
        let whole = |axis: usize| State::Split {
            axis,
            parts: vec![shape[axis]],
        };
        let mut states = vec![State::Replicated; 2];
        let parameter = t.kind == TensorKind::Parameter;
        if let Some(b) = scheme.batch
            && !parameter
            && shape.len() > 1
            && shape[0] == graph.micro_batch as usize
        {
            states[b] = whole(0);
        }
        if let Split::Model(a) = t.split {
            for &m in &scheme.model {
                states[m] = whole(a as usize);
            }
            if let Some(c) = scheme.cross
                && parameter
                && shape.len() == 2
            {
                states[c] = whole(1 - a as usize);
            }
        }
        let name = match received_by {
            Some(stage) => format!("{}@{stage}", t.name),
            None => t.name.clone(),
        };
        out.insert(name, Placement(states));
    }
    out
}

/// Optimizer-state placements that shard every parameter further along mesh axis `axis` of
/// `mesh` where its weight is replicated on that axis (its first axis that divides).
pub fn sharded_states(
    graph: &Graph,
    placements: &BTreeMap<String, Placement>,
    mesh: &[usize],
    axis: usize,
) -> BTreeMap<String, Placement> {
    let mut out = BTreeMap::new();
    for t in graph
        .tensors
        .iter()
        .filter(|t| t.kind == TensorKind::Parameter)
    {
        let shape: Vec<usize> = t.shape.iter().map(|&d| d as usize).collect();
        let Some(weight) = placements.get(&t.name) else {
            continue;
        };
        if weight.0[axis] != State::Replicated {
            continue;
        }
        for d in 0..shape.len() {
            let mut states = weight.clone();
            states.0[axis] = State::Split {
                axis: d,
                parts: vec![shape[d]],
            };
            if states.misfit(&shape, mesh).is_none() {
                out.insert(t.name.clone(), states);
                break;
            }
        }
    }
    out
}

/// Placements of a pipeline whose stage `j` holds layers `stages[j].0` placed by scheme
/// `stages[j].1` (a tensor several stages read takes the last one's), with the placements
/// `NAME@j` of the values stage `j` receives.
pub fn staged_placements(
    graph: &Graph,
    stages: &[(std::ops::Range<usize>, MeshScheme)],
) -> BTreeMap<String, Placement> {
    let mut out = BTreeMap::new();
    for (j, (layers, scheme)) in stages.iter().enumerate() {
        let all = mesh_placements(graph, scheme, None);
        for layer in &graph.layers[layers.clone()] {
            for &oid in &layer.forward {
                let op = graph.op(oid);
                for t in op.inputs.iter().chain(&op.outputs) {
                    let name = &graph.tensor(*t).name;
                    out.insert(name.clone(), all[name].clone());
                }
            }
        }
        if j > 0 {
            out.extend(mesh_placements(graph, scheme, Some(j)));
        }
    }
    out
}

/// TOML to append to a workspace: a CPU cluster `cluster` of 2 devices, and the target
/// `tiny-cpu` on it (`tiny-llama` in fp32, 2 sequences of 32 tokens, micro-batch 1), whose
/// search prices tensor parallelism over 1 and 2 devices.
pub fn tiny_cpu_target(cluster: &str) -> String {
    format!(
        r#"
{}
[[target]]
name = "tiny-cpu"
model = "tiny-llama"
cluster = "{cluster}"
global_batch = 2
seq_len = 32
precision = "fp32"
[target.search]
micro_batch = [1]
"#,
        two_device_cluster(cluster)
    )
}

fn two_device_cluster(cluster: &str) -> String {
    format!("[[cluster]]\nname = \"{cluster}\"\npreset = \"cpu\"\nnodes = 1\ngpus_per_node = 2\n")
}

/// `toml` with the cluster `cluster` of [`tiny_cpu_target`] reading the profile `profile`
/// from `measured.json`.
pub fn attach_profile(toml: &str, cluster: &str, profile: &str) -> String {
    let plain = two_device_cluster(cluster);
    toml.replace(
        &plain,
        &format!("{plain}profiles = [\"{profile}\"]\n\n[[profile]]\nname = \"{profile}\"\nfile = \"measured.json\"\n"),
    )
}

/// The profile in `measured.json` of `ws`: asserts that it holds exactly the entries
/// `autopar profile template target` lists, each with a positive time.
pub fn measured_covers_template(ws: &crate::TempWorkspace, target: &str) -> Profile {
    let template = ws.run(&["profile", "template", target]);
    assert_eq!(template.code, 0, "{}", template.stderr);
    let want = parse_profile(&template.stdout).expect("template");
    let got = parse_profile(&ws.read("measured.json")).expect("profile");
    let keys = |p: &Profile| -> Vec<EntryId> { p.entries().into_iter().map(|(e, _)| e).collect() };
    assert_eq!(keys(&got), keys(&want));
    assert!(got.entries().iter().all(|(_, t)| *t > 0.0));
    got
}
