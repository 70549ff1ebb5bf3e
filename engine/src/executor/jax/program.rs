//! A lowered program written as a JAX program: the plan's meshes, every value's sharding, the
//! model's chunks as jax.numpy functions and the schedule's order, followed by the runtime
//! (`runtime.py`) that every exported plan shares.
//!
//! The lowering's values keep their names and ids, so the program's weights and data are the
//! CPU executor's (the same splitmix64 noise of the same ids), and its shardings are the
//! lowering's placements: a mesh axis that splits a tensor axis becomes that axis's entry of a
//! `PartitionSpec`, a partial sum is left for XLA to complete where the next constraint says.
//! A value split in parts (the fused QKV projection, SwiGLU's two halves) is stored piece-major
//! (piece `r` holds slice `r` of every part, contiguously) so that a plain `PartitionSpec`
//! gives every device the slices the plan gives it, as Megatron-LM's interleaved QKV layout
//! does.

use crate::executor::ExecError;
use crate::executor::attention::Keys;
use crate::executor::kernels::Kernel;
use crate::executor::lower::{Action, ChunkCode, Init, Program, Role};
use crate::executor::placement::{Conversion, Placement, State};
use autopar_rules::model::graph::{Graph, OpKind, TensorId};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write;

/// The model's ops in jax.numpy, shared by exported programs and the profiler.
pub const OPS: &str = include_str!("ops.py");

/// The runtime every exported program ends with: data, weights, the pipeline driver, Adam.
pub const RUNTIME: &str = include_str!("runtime.py");

/// The generator's, the ops' and the runtime's source: part of an exported program's cache
/// key, so that a changed exporter never serves a program it would no longer write.
pub const SOURCE: [&str; 3] = [include_str!("program.rs"), OPS, RUNTIME];

/// Names the runtime defines, which a value's variable must not shadow.
const RESERVED: &[&str] = &[
    "p",
    "recv",
    "fed",
    "shard",
    "np",
    "jnp",
    "jax",
    "embedding",
    "matmul",
    "batch_matmul",
    "layer_norm",
    "rms_norm",
    "causal_softmax",
    "gelu",
    "silu",
    "swiglu",
    "rope",
    "attention",
    "ring_attention",
    "cross_entropy",
    "split",
    "positions",
    "noise",
    "P",
    "Mesh",
    "NamedSharding",
];

const KEYWORDS: &[&str] = &[
    "False", "None", "True", "and", "as", "assert", "async", "await", "break", "class", "continue",
    "def", "del", "elif", "else", "except", "finally", "for", "from", "global", "if", "import",
    "in", "is", "lambda", "nonlocal", "not", "or", "pass", "raise", "return", "try", "while",
    "with", "yield",
];

fn err(message: impl Into<String>) -> ExecError {
    ExecError::Lower(message.into())
}

/// How a value split in parts is stored: the axis, the parts' whole lengths and the pieces
/// (devices) it is split into.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Storage {
    axis: usize,
    parts: Vec<usize>,
    pieces: usize,
}

/// How a value placed by `placement` on `mesh` is stored: piece-major when a tensor axis is
/// split in parts, `None` when plainly; an error for what the storage cannot hold.
fn storage(placement: &Placement, mesh: &[usize]) -> Result<Option<Storage>, String> {
    let mut found: Option<Storage> = None;
    for (a, s) in placement.0.iter().enumerate() {
        let State::Split { axis, parts } = s else {
            continue;
        };
        if parts.len() < 2 {
            continue;
        }
        let n = mesh.get(a).copied().unwrap_or(1);
        match &mut found {
            // A second mesh axis splitting the same parts (listed as that group holds them):
            // the pieces multiply, major first.
            Some(st) if st.axis == *axis => st.pieces *= n,
            Some(_) => return Err("two tensor axes split in parts".into()),
            None => {
                found = Some(Storage {
                    axis: *axis,
                    parts: parts.clone(),
                    pieces: n,
                })
            }
        }
    }
    // A split in parts must be the only split of its axis.
    if let Some(st) = &found {
        let others = placement.0.iter().any(
            |s| matches!(s, State::Split { axis, parts } if *axis == st.axis && parts.len() < 2),
        );
        if others {
            return Err("an axis split in parts together with another split".into());
        }
    }
    Ok(found)
}

/// Per tensor axis, the mesh axes that split it, major first (`m0`, `m1`, ...; `data` for
/// Megatron-LM's replicas).
type Entries = Vec<Vec<String>>;

/// A placement as a `PartitionSpec`'s entries, `None` when a mesh axis holds a partial sum
/// (left for XLA to complete where the next constraint asks).
fn entries(placement: &Placement) -> Option<Entries> {
    if placement.0.contains(&State::Partial) {
        return None;
    }
    let rank = placement
        .0
        .iter()
        .filter_map(State::axis)
        .max()
        .map_or(0, |a| a + 1);
    Some(
        (0..rank)
            .map(|t| {
                placement
                    .0
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| s.axis() == Some(t))
                    .map(|(a, _)| format!("m{a}"))
                    .collect()
            })
            .collect(),
    )
}

/// `placement` after the conversions `convs`, each setting the state along its mesh axis.
fn converted(placement: &Placement, convs: &[Conversion]) -> Placement {
    let mut out = placement.clone();
    for c in convs {
        let state = match c {
            Conversion::Slice { to, .. }
            | Conversion::ReduceScatter { to, .. }
            | Conversion::AllToAll { to, .. } => to.clone(),
            Conversion::AllGather { .. } | Conversion::AllReduce { .. } => State::Replicated,
        };
        for a in c.axes() {
            if let Some(s) = out.0.get_mut(a) {
                *s = state.clone();
            }
        }
    }
    out
}

/// Entries as a Python tuple (trailing axes replicated).
fn render(entries: &Entries) -> String {
    let items: Vec<String> = entries
        .iter()
        .map(|axes| match axes.len() {
            0 => "None".to_string(),
            1 => quoted(&axes[0]),
            _ => format!(
                "({})",
                axes.iter()
                    .map(|a| quoted(a))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        })
        .collect();
    match items.len() {
        1 => format!("({},)", items[0]),
        _ => format!("({})", items.join(", ")),
    }
}

/// The spec of a weight's optimizer states: the placement an intra-op plan gave them, and under
/// ZeRO over Megatron-LM's `dp` replicas also split along the `data` axis (the first tensor axis
/// that divides evenly; Megatron-LM's distributed optimizer cuts the flat buffer instead, which
/// moves the same bytes).
fn state_entries(
    placement: &Placement,
    shape: &[usize],
    mesh: &[usize],
    dp: usize,
    zero: u8,
) -> Option<Entries> {
    let mut e = entries(placement)?;
    if zero == 0 || dp <= 1 {
        return Some(e);
    }
    let axis = (0..shape.len()).find(|&t| {
        let pieces: usize = placement
            .0
            .iter()
            .enumerate()
            .filter(|(_, s)| s.axis() == Some(t))
            .map(|(a, _)| mesh.get(a).copied().unwrap_or(1))
            .product();
        shape[t] % (pieces * dp) == 0
    })?;
    e.resize(e.len().max(axis + 1), Vec::new());
    e[axis].insert(0, "data".into());
    Some(e)
}

/// Writes a Python dict literal `NAME = {...}` of `entries` (values already Python source),
/// after `comment` (one or more comment lines).
fn write_dict(src: &mut String, comment: &str, name: &str, entries: &BTreeMap<String, String>) {
    let _ = writeln!(src, "{comment}\n{name} = {{");
    for (k, v) in entries {
        let _ = writeln!(src, "    {}: {v},", quoted(k));
    }
    let _ = writeln!(src, "}}");
}

/// Per chunk, the names of the values `of` lists, as a Python list of lists.
fn per_chunk(prog: &Program, of: impl Fn(&ChunkCode) -> &[u32]) -> String {
    py_list(
        prog.chunks
            .iter()
            .map(|c| py_list(of(c).iter().map(|&v| quoted(&prog.values[v as usize].name)))),
    )
}

fn py_list<T: std::fmt::Display>(items: impl IntoIterator<Item = T>) -> String {
    let v: Vec<String> = items.into_iter().map(|x| x.to_string()).collect();
    format!("[{}]", v.join(", "))
}

fn quoted(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| format!("{s:?}"))
}

/// A Python literal of an f32 that reads back as the same f32.
fn f32_literal(x: f32) -> String {
    format!("np.float32({x:?})")
}

/// The plan-specific part's variable names: a value's name made an identifier, unique.
struct Names {
    of: HashMap<u32, String>,
    used: BTreeSet<String>,
}

impl Names {
    fn new() -> Names {
        Names {
            of: HashMap::new(),
            used: BTreeSet::new(),
        }
    }

    fn var(&mut self, v: u32, name: &str) -> String {
        if let Some(n) = self.of.get(&v) {
            return n.clone();
        }
        let mut id: String = name
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        if id.is_empty() || id.starts_with(|c: char| c.is_ascii_digit()) {
            id.insert(0, '_');
        }
        if RESERVED.contains(&id.as_str())
            || KEYWORDS.contains(&id.as_str())
            || self.used.contains(&id)
            || id
                .chars()
                .all(|c| c.is_ascii_uppercase() || c == '_' || c.is_ascii_digit())
        {
            id = format!("{id}_{v}");
        }
        self.used.insert(id.clone());
        self.of.insert(v, id.clone());
        id
    }
}

/// What the exported program says about the plan in its docstring.
pub struct Header<'a> {
    /// Target name.
    pub target: &'a str,
    /// One-line description of the layout.
    pub layout: &'a str,
    /// The cluster the plan is for.
    pub cluster: &'a str,
    /// The predicted step time on it, s.
    pub predicted_step_time_s: f64,
}

/// The global order of the forward and backward passes that every stage's action list allows,
/// each stage running its list in order (a receive waits for its send).
fn order(prog: &Program) -> Result<Vec<(char, usize, usize)>, ExecError> {
    let mut at = vec![0usize; prog.stages.len()];
    let mut sent_act = BTreeSet::new();
    let mut sent_grad = BTreeSet::new();
    let mut out = Vec::new();
    loop {
        let mut progress = false;
        for (s, actions) in prog.stages.iter().enumerate() {
            while let Some(a) = actions.get(at[s]) {
                match *a {
                    Action::RecvActivations { chunk, microbatch } => {
                        if !sent_act.contains(&(chunk.wrapping_sub(1), microbatch)) {
                            break;
                        }
                    }
                    Action::RecvGradients { chunk, microbatch } => {
                        if !sent_grad.contains(&(chunk + 1, microbatch)) {
                            break;
                        }
                    }
                    Action::SendActivations { chunk, microbatch } => {
                        sent_act.insert((chunk, microbatch));
                    }
                    Action::SendGradients { chunk, microbatch } => {
                        sent_grad.insert((chunk, microbatch));
                    }
                    Action::Forward { chunk, microbatch } => out.push(('F', chunk, microbatch)),
                    Action::Backward { chunk, microbatch } => out.push(('B', chunk, microbatch)),
                    Action::SyncTied | Action::SyncGradients | Action::OptimizerStep => {}
                }
                at[s] += 1;
                progress = true;
            }
        }
        if at.iter().zip(&prog.stages).all(|(&i, a)| i >= a.len()) {
            return Ok(out);
        }
        if !progress {
            return Err(err(
                "the schedule's action lists wait on each other (a lowering bug)",
            ));
        }
    }
}

/// The imports every generated script starts with, XLA's options set first: `devices`
/// virtual CPU devices (where JAX runs on the CPU), and with `--hlo DIR` every function's HLO
/// after the SPMD partitioner dumped into DIR.
pub(super) fn imports(devices: usize) -> String {
    format!(
        "import argparse\nimport json\nimport os\nimport sys\nimport time\n\n\
         DEVICES = {devices}\n\n\n\
         def xla_flags():\n    \
             \"\"\"XLA's options, read when JAX starts: on CPU, DEVICES virtual devices; with --hlo DIR,\n    \
             every function's HLO after the SPMD partitioner, dumped into DIR.\"\"\"\n    \
             flags = os.environ.get(\"XLA_FLAGS\", \"\")\n    \
             if \"xla_force_host_platform_device_count\" not in flags:\n        \
                 flags += f\" --xla_force_host_platform_device_count={{DEVICES}}\"\n    \
             if \"--hlo\" in sys.argv[:-1]:\n        \
                 where = sys.argv[sys.argv.index(\"--hlo\") + 1]\n        \
                 flags += (f\" --xla_dump_to={{where}} --xla_dump_hlo_pass_re=spmd-partitioning\"\n                  \
                           \" --xla_dump_hlo_module_re=jit_(forward|backward|update)_\")\n    \
             os.environ[\"XLA_FLAGS\"] = flags.strip()\n\n\n\
         xla_flags()\n\
         import numpy as np\nimport jax\nimport jax.numpy as jnp\nfrom jax.sharding import Mesh, NamedSharding, PartitionSpec as P\n"
    )
}

/// The forward op of the graph that writes value `v`, when `v` is a graph tensor.
fn writer(graph: &Graph, v: u32) -> Option<&autopar_rules::model::graph::Op> {
    graph
        .ops
        .iter()
        .find(|o| o.grad_of.is_none() && o.outputs.contains(&TensorId(v)))
}

/// Per step of virtual stage `chunk`, the recomputed region it belongs to: its layer, and
/// whether only the layer's attention core is recomputed (selective recomputation); `None`
/// for steps whose activations are kept. A step writing only values the lowering introduced
/// goes with the step before it.
pub fn recompute_keys(graph: &Graph, prog: &Program, chunk: usize) -> Vec<Option<(u32, bool)>> {
    let l = &prog.layout;
    let mut key = None;
    let Some(code) = prog.chunks.get(chunk) else {
        return Vec::new();
    };
    code.steps
        .iter()
        .map(|step| {
            key = match step.outputs.first().and_then(|&o| writer(graph, o)) {
                Some(op) if l.recomputed.contains(&(op.layer as usize)) => Some((op.layer, false)),
                Some(op) if l.recompute_attention && op.attention_core => Some((op.layer, true)),
                Some(_) => None,
                None => key,
            };
            key
        })
        .collect()
}

/// `prog` (lowered from `graph`) as a self-contained JAX program.
pub fn python(graph: &Graph, prog: &Program, header: &Header) -> Result<String, ExecError> {
    let l = &prog.layout;
    let meshes: Vec<Vec<usize>> = (0..l.pp).map(|j| l.mesh(j)).collect();
    let chunk_stage: Vec<usize> = prog.chunks.iter().map(|c| c.stage).collect();
    // Where every value lives: the stage of the first chunk that names it.
    let mut stage_of: HashMap<u32, usize> = HashMap::new();
    for code in &prog.chunks {
        let named = code
            .recv
            .iter()
            .chain(&code.inputs)
            .chain(&code.parameters)
            .chain(code.steps.iter().flat_map(|s| s.outputs.iter()));
        for &v in named {
            stage_of.entry(v).or_insert(code.stage);
        }
    }
    let mut specs = BTreeMap::new();
    let mut storages: HashMap<u32, Storage> = HashMap::new();
    for (&v, &stage) in &stage_of {
        let info = &prog.values[v as usize];
        match storage(&info.placement, &meshes[stage]) {
            Ok(Some(st)) => {
                storages.insert(v, st);
            }
            Ok(None) => {}
            Err(why) => return Err(err(format!("`{}` {}: {why}", info.name, info.placement))),
        }
        if let Some(e) = entries(&info.placement) {
            specs.insert(info.name.clone(), render(&e));
        }
    }
    let mut state_specs = BTreeMap::new();
    for (&v, &stage) in &stage_of {
        let info = &prog.values[v as usize];
        if !matches!(info.role, Role::Parameter { .. }) {
            continue;
        }
        let placement = info.state_placement.as_ref().unwrap_or(&info.placement);
        if let Some(e) = state_entries(placement, &info.shape, &meshes[stage], l.dp, l.zero)
            && Some(&e) != entries(&info.placement).as_ref()
        {
            state_specs.insert(info.name.clone(), render(&e));
        }
    }

    let mut src = String::new();
    let name = |v: u32| prog.values[v as usize].name.clone();
    let devices = l.devices();
    // `jax.checkpoint`ed regions written so far (their functions are numbered).
    let mut checkpoints = 0usize;
    // Header and imports: XLA's device count must be set before JAX is imported.
    let _ = writeln!(
        src,
        "#!/usr/bin/env python3\n\"\"\"autopar plan of target `{}`: {} ({} devices), predicted {:.4} s per step on `{}`.\n\n\
         Generated by autopar {} from the plan's lowered program; every value carries the plan's\n\
         sharding. Run it with `python3 {{this file}} [--steps N] [--seed S]`: on CPU, JAX makes\n\
         the {} devices virtual (XLA_FLAGS); on GPUs it runs through CUDA and NCCL; on several\n\
         hosts, set AUTOPAR_JAX_DISTRIBUTED=1 and JAX's coordinator variables\n\
         (jax.distributed.initialize). It prints one JSON line per step with its loss and time.\n\"\"\"",
        header.target,
        header.layout,
        devices,
        header.predicted_step_time_s,
        header.cluster,
        env!("CARGO_PKG_VERSION"),
        devices,
    );
    src.push_str(&imports(devices));
    let _ = writeln!(
        src,
        "# Data-parallel replicas of every stage, micro-batches per step, context-parallel ranks\n\
         # (the order sequences are stored in).\nDP = {}\nMICROBATCHES = {}\nCP = {}",
        l.dp, l.microbatches, l.cp
    );
    let _ = writeln!(
        src,
        "# The logical mesh of every pipeline stage (axes m0, m1, ...; each stage's devices also\n\
         # carry its data-parallel replicas on a leading `data` axis).\nMESHES = {}",
        py_list(meshes.iter().map(|m| py_list(m.iter())))
    );
    let _ = writeln!(
        src,
        "# The stage of every virtual stage (chunk).\nCHUNK_STAGE = {}",
        py_list(chunk_stage.iter())
    );
    // Parameters, by stage and chunk.
    let mut params = BTreeMap::new();
    let mut stage_params: Vec<BTreeSet<String>> = vec![BTreeSet::new(); l.pp];
    for code in &prog.chunks {
        for &v in &code.parameters {
            let info = &prog.values[v as usize];
            let init = match info.role {
                Role::Parameter { init: Init::Gain } => "gain",
                Role::Parameter { init: Init::Bias } => "bias",
                _ => "weight",
            };
            params.insert(
                info.name.clone(),
                format!("({v}, {}, \"{init}\")", py_tuple(&info.shape)),
            );
            stage_params[code.stage].insert(info.name.clone());
        }
    }
    write_dict(
        &mut src,
        "# Weights: value id (the seed of its noise), shape, initialisation.",
        "PARAMETERS",
        &params,
    );
    let _ = writeln!(
        src,
        "STAGE_PARAMETERS = {}",
        py_list(
            stage_params
                .iter()
                .map(|s| py_list(s.iter().map(|n| quoted(n))))
        )
    );
    let _ = writeln!(
        src,
        "CHUNK_PARAMETERS = {}",
        per_chunk(prog, |c| &c.parameters)
    );
    let mut inputs = BTreeMap::new();
    for code in &prog.chunks {
        for &v in &code.inputs {
            let info = &prog.values[v as usize];
            let bound = match info.role {
                Role::Input { bound: Some(b) } => b.to_string(),
                _ => "None".into(),
            };
            inputs.insert(
                info.name.clone(),
                format!("({v}, {}, {bound})", py_tuple(&info.shape)),
            );
        }
    }
    write_dict(
        &mut src,
        "# Fed inputs: value id, shape of one replica's micro-batch, bound of integer ids.",
        "INPUTS",
        &inputs,
    );
    let _ = writeln!(src, "CHUNK_INPUTS = {}", per_chunk(prog, |c| &c.inputs));
    let _ = writeln!(
        src,
        "# Activations each chunk receives, as it names them and as the chunk before names them.\n\
         CHUNK_RECV = {}\nCHUNK_RECV_FROM = {}",
        per_chunk(prog, |c| &c.recv),
        per_chunk(prog, |c| &c.recv_from)
    );
    write_dict(
        &mut src,
        "# Every value's sharding on its stage's mesh, one entry per tensor axis (trailing axes\n\
         # replicated); a value not named is left to XLA (a partial sum, completed where a later\n\
         # constraint asks).",
        "SPECS",
        &specs,
    );
    write_dict(
        &mut src,
        "# Optimizer states (Adam's moments) sharded further than their weights (ZeRO).",
        "STATE_SPECS",
        &state_specs,
    );
    let mut storage_lines = BTreeMap::new();
    for (&v, st) in &storages {
        storage_lines.insert(
            name(v),
            format!("({}, {}, {})", st.axis, py_list(st.parts.iter()), st.pieces),
        );
    }
    write_dict(
        &mut src,
        "# Values split in parts, stored piece-major: axis, whole parts, pieces.",
        "STORAGE",
        &storage_lines,
    );
    let _ = writeln!(
        src,
        "# Weights several stages hold, whose gradients are summed.\nTIED = {{{}}}",
        prog.tied
            .iter()
            .map(|t| format!("{}: {}", quoted(&name(t.value)), py_list(t.stages.iter())))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let _ = writeln!(src, "LOSS = {}", quoted(&name(prog.loss)));
    let _ = writeln!(
        src,
        "# Forward (F) and backward (B) passes of (chunk, micro-batch) in the schedule's order.\nORDER = {}\n",
        py_list(
            order(prog)?
                .iter()
                .map(|(k, c, m)| format!("(\"{k}\", {c}, {m})"))
        )
    );

    // The chunks.
    for (c, code) in prog.chunks.iter().enumerate() {
        let mut names = Names::new();
        let (first, last) = code.layers;
        let layers: Vec<&str> = graph.layers[first..=last.min(graph.layers.len() - 1)]
            .iter()
            .map(|x| x.name.as_str())
            .collect();
        let _ = writeln!(
            src,
            "\ndef chunk_{c}(p, recv, fed, shard):\n    \"\"\"Layers {first}-{last} ({}) on stage {} (mesh {:?}).\"\"\"",
            layers.join(", "),
            code.stage,
            meshes[code.stage]
        );
        let mut expr_of: HashMap<u32, String> = HashMap::new();
        for &v in &code.parameters {
            expr_of.insert(v, format!("p[{}]", quoted(&name(v))));
        }
        // What the chunk is fed and receives, held to its sharding (else XLA's propagation may
        // choose another and move it).
        for (&v, from) in code
            .inputs
            .iter()
            .map(|v| (v, "fed"))
            .chain(code.recv.iter().map(|v| (v, "recv")))
        {
            let var = names.var(v, &name(v));
            let _ = writeln!(src, "    {var} = {from}[{}]", quoted(&name(v)));
            if let Some(s) = specs.get(&name(v)) {
                let _ = writeln!(src, "    {var} = shard({var}, {s})");
            }
            expr_of.insert(v, var);
        }
        let mut region: Option<Region> = None;
        let keys = recompute_keys(graph, prog, c);
        // Where each value is last read: a region returns what is read after it.
        let mut last_read: HashMap<u32, usize> = HashMap::new();
        for (i, step) in code.steps.iter().enumerate() {
            for &v in &step.inputs {
                last_read.insert(v, i);
            }
        }
        for &v in code.send.iter().chain(std::iter::once(&prog.loss)) {
            last_read.insert(v, usize::MAX);
        }
        for (i, step) in code.steps.iter().enumerate() {
            let mut lines = String::new();
            // An operand the plan converts before the kernel reads it is read through a
            // constraint to that placement: XLA then inserts the plan's collective there, and
            // the backward pass keeps what the kernel read (as the plan's kernels do).
            let arg = |i: usize| -> Result<String, ExecError> {
                let v = *step.inputs.get(i).ok_or_else(|| {
                    err(format!(
                        "`{}` has fewer operands than its kernel reads",
                        step.name
                    ))
                })?;
                let e = expr_of.get(&v).cloned().ok_or_else(|| {
                    err(format!(
                        "`{}` reads `{}`, which chunk {c} neither receives nor computes",
                        step.name,
                        name(v)
                    ))
                })?;
                let convs = step.before.get(i).map_or(&[][..], Vec::as_slice);
                if convs.is_empty() {
                    return Ok(e);
                }
                let read = converted(&prog.values[v as usize].placement, convs);
                Ok(match entries(&read) {
                    Some(en) => format!("shard({e}, {})", render(&en)),
                    None => e,
                })
            };
            let st = |v: u32| storages.get(&v);
            let in_storage = |i: usize| step.inputs.get(i).and_then(|&v| st(v));
            let out_storage = |i: usize| step.outputs.get(i).and_then(|&v| st(v));
            let pieces = |i: usize| in_storage(i).map_or(1, |s| s.pieces);
            let refuse = |what: &str| {
                err(format!(
                    "`{}`: the JAX backend does not lower {what}",
                    step.name
                ))
            };
            // Which operand's storage each result keeps (None: plain).
            let expected_out = match &step.kernel {
                Kernel::MatMul { transpose_b, .. } => in_storage(1)
                    .filter(|s| s.axis == usize::from(!*transpose_b))
                    .map(|s| Storage {
                        axis: prog.values[step.outputs[0] as usize].shape.len() - 1,
                        ..s.clone()
                    }),
                Kernel::BiasAdd
                | Kernel::Add
                | Kernel::Mul
                | Kernel::Identity
                | Kernel::Gelu
                | Kernel::Silu => in_storage(0).cloned(),
                _ => None,
            };
            let reads_parts = match &step.kernel {
                Kernel::Slice { .. } | Kernel::SwiGlu => false,
                Kernel::MatMul { .. } => in_storage(0).is_some(),
                Kernel::BiasAdd | Kernel::Add | Kernel::Mul => {
                    in_storage(0) != in_storage(1)
                        || (step.inputs.len() > 2 && in_storage(2) != in_storage(0))
                }
                Kernel::Identity | Kernel::Gelu | Kernel::Silu => false,
                _ => step.inputs.iter().any(|&v| st(v).is_some()),
            };
            if reads_parts || out_storage(0) != expected_out.as_ref() {
                return Err(refuse("this split in parts"));
            }
            let call = match &step.kernel {
                Kernel::Embedding { .. } => {
                    let out = step.outputs[0];
                    let grad = converted(
                        &prog.values[out as usize].placement,
                        step.grad_before.first().map_or(&[][..], Vec::as_slice),
                    );
                    let table = &prog.values[step.inputs[1] as usize].placement;
                    match (entries(&grad), entries(table)) {
                        (Some(g), Some(t)) => format!(
                            "embedding({}, {}, shard, {}, {})",
                            arg(0)?,
                            arg(1)?,
                            render(&g),
                            render(&t)
                        ),
                        _ => format!("embedding({}, {})", arg(0)?, arg(1)?),
                    }
                }
                Kernel::MatMul { transpose_b, bias } => {
                    let t = if *transpose_b {
                        ", transpose_b=True"
                    } else {
                        ""
                    };
                    let b = if *bias {
                        format!(" + {}", arg(2)?)
                    } else {
                        String::new()
                    };
                    format!("matmul({}, {}{t}){b}", arg(0)?, arg(1)?)
                }
                Kernel::BiasAdd | Kernel::Add => format!("{} + {}", arg(0)?, arg(1)?),
                Kernel::Mul => format!("{} * {}", arg(0)?, arg(1)?),
                Kernel::BatchMatMul { transpose_b } => format!(
                    "batch_matmul({}, {}{})",
                    arg(0)?,
                    arg(1)?,
                    if *transpose_b {
                        ", transpose_b=True"
                    } else {
                        ""
                    }
                ),
                Kernel::LayerNorm => {
                    format!("layer_norm({}, {}, {})", arg(0)?, arg(1)?, arg(2)?)
                }
                Kernel::RmsNorm => format!("rms_norm({}, {})", arg(0)?, arg(1)?),
                Kernel::Softmax { scale } => {
                    format!("causal_softmax({}, {})", arg(0)?, f32_literal(*scale))
                }
                Kernel::Gelu => format!("gelu({})", arg(0)?),
                Kernel::Silu => format!("silu({})", arg(0)?),
                Kernel::SwiGlu => format!("swiglu({}, pieces={})", arg(0)?, pieces(0)),
                Kernel::Identity => format!("{}  # dropout, run with probability 0", arg(0)?),
                Kernel::Rope { .. } => format!("rope({})", arg(0)?),
                Kernel::Attention { scale, keys, .. } => {
                    let causal = writer(graph, step.outputs[0]).is_none_or(|o| {
                        !matches!(o.kind, OpKind::FlashAttention { causal: false, .. })
                    });
                    let causal = if causal { "" } else { ", causal=False" };
                    let (q, k, v, scale) = (arg(0)?, arg(1)?, arg(2)?, f32_literal(*scale));
                    if *keys == Keys::Ring {
                        // The ring runs over the kernel's group, which must be the mesh axes
                        // that split the queries' sequence (axis 2 of [b, h, s, d]), major
                        // first as the sharding and the CPU executor's groups order them.
                        let read = converted(
                            &prog.values[step.inputs[0] as usize].placement,
                            step.before.first().map_or(&[][..], Vec::as_slice),
                        );
                        let axes: Vec<String> =
                            step.kernel_axes.iter().map(|a| format!("m{a}")).collect();
                        if axes.is_empty()
                            || entries(&read).and_then(|e| e.get(2).cloned()) != Some(axes.clone())
                        {
                            return Err(refuse(
                                "a ring attention whose queries are not split along the sequence \
                                 over its ring's mesh axes",
                            ));
                        }
                        let axes: Vec<String> = axes.iter().map(|a| quoted(a)).collect();
                        format!(
                            "ring_attention({q}, {k}, {v}, {scale}, shard, ({},){causal})",
                            axes.join(", ")
                        )
                    } else {
                        format!("attention({q}, {k}, {v}, {scale}{causal})")
                    }
                }
                Kernel::CrossEntropy { .. } => {
                    format!("cross_entropy({}, {})", arg(0)?, arg(1)?)
                }
                Kernel::Slice { parts } => {
                    let rank = prog.values[step.inputs[0] as usize].shape.len();
                    let heads: Vec<String> = step
                        .outputs
                        .iter()
                        .map(|&o| {
                            let s = &prog.values[o as usize].shape;
                            if s.len() == rank + 1 {
                                s[1].to_string()
                            } else {
                                "None".into()
                            }
                        })
                        .collect();
                    format!(
                        "split({}, {}, pieces={}, heads={})",
                        arg(0)?,
                        py_list(parts.iter()),
                        pieces(0),
                        py_list(heads)
                    )
                }
                Kernel::Transpose { a, b } => format!("jnp.swapaxes({}, {a}, {b})", arg(0)?),
                Kernel::MoeRouter => {
                    let k = step
                        .outputs
                        .first()
                        .and_then(|&o| prog.values[o as usize].shape.last().copied())
                        .unwrap_or(1);
                    format!("moe_router({}, {k})", arg(0)?)
                }
                Kernel::MoeDispatch { drop } => {
                    let shape = &prog.values[step.outputs[0] as usize].shape;
                    format!(
                        "moe_dispatch({}, {}, {}, {}, {})",
                        arg(0)?,
                        arg(1)?,
                        arg(2)?,
                        py_tuple(shape),
                        if *drop { "True" } else { "False" }
                    )
                }
                Kernel::MoeCombine { drop } => format!(
                    "moe_combine({}, {}, {}, {})",
                    arg(0)?,
                    arg(1)?,
                    arg(2)?,
                    if *drop { "True" } else { "False" }
                ),
            };
            let outs: Vec<String> = step
                .outputs
                .iter()
                .map(|&o| names.var(o, &name(o)))
                .collect();
            let _ = writeln!(lines, "    {} = {call}", outs.join(", "));
            // What the kernel writes, where the plan converts it afterwards: held there first,
            // so that XLA converts it as the plan does. A row gather from a table split by rows
            // writes partial rows, completed where they are written (else XLA's propagation
            // shards the ids instead and gathers them); other partial sums are left to XLA.
            for (i, (&o, var)) in step.outputs.iter().zip(&outs).enumerate() {
                let (Some(state), Some(after)) = (step.out_states.get(i), step.after.get(i)) else {
                    continue;
                };
                let written = if state.0.contains(&State::Partial) {
                    matches!(step.kernel, Kernel::Embedding { .. }).then(|| state.completed())
                } else {
                    Some(state.clone())
                };
                if let Some(e) = written
                    .filter(|w| !after.is_empty() && *w != prog.values[o as usize].placement)
                    .and_then(|w| entries(&w))
                {
                    let _ = writeln!(lines, "    {var} = shard({var}, {})", render(&e));
                }
            }
            for (&o, var) in step.outputs.iter().zip(&outs) {
                if let Some(s) = specs.get(&name(o)) {
                    let _ = writeln!(lines, "    {var} = shard({var}, {s})");
                }
                expr_of.insert(o, var.clone());
            }
            // Steps the plan recomputes run inside one `jax.checkpoint`ed function per layer
            // (or attention core), so that the backward pass runs their forward again.
            match (&mut region, keys[i]) {
                (Some(r), Some(k)) if r.key == k => r.add(step, &lines),
                (_, k) => {
                    if let Some(done) = region.take() {
                        done.write(&mut src, &mut checkpoints, &expr_of, |v| {
                            last_read.get(&v).is_some_and(|&r| r >= i)
                        })?;
                    }
                    match k {
                        Some(k) => {
                            let mut r = Region::new(k, &graph.layers[k.0 as usize].name);
                            r.add(step, &lines);
                            region = Some(r);
                        }
                        None => src.push_str(&lines),
                    }
                }
            }
        }
        if let Some(done) = region.take() {
            done.write(&mut src, &mut checkpoints, &expr_of, |v| {
                last_read.get(&v) == Some(&usize::MAX)
            })?;
        }
        let returned: Vec<String> = if c + 1 == prog.chunks.len() {
            vec![format!(
                "{}: {}",
                quoted(&name(prog.loss)),
                expr_of
                    .get(&prog.loss)
                    .cloned()
                    .ok_or_else(|| err("the last chunk does not compute the loss"))?
            )]
        } else {
            code.send
                .iter()
                .map(|&v| {
                    expr_of
                        .get(&v)
                        .map(|e| format!("{}: {e}", quoted(&name(v))))
                        .ok_or_else(|| {
                            err(format!(
                                "chunk {c} sends `{}`, which it does not have",
                                name(v)
                            ))
                        })
                })
                .collect::<Result<_, _>>()?
        };
        let _ = writeln!(src, "    return {{{}}}", returned.join(", "));
    }
    let _ = writeln!(
        src,
        "\n\nCHUNKS = {}\n",
        py_list((0..prog.chunks.len()).map(|c| format!("chunk_{c}")))
    );
    src.push_str(OPS);
    src.push_str(RUNTIME);
    Ok(src)
}

/// Consecutive steps of one recomputed layer (or of one layer's attention core), written as a
/// function that `jax.checkpoint` wraps: its forward runs again in the backward pass, and only
/// its operands are kept.
struct Region {
    /// Layer, and whether only its attention core is recomputed.
    key: (u32, bool),
    /// The layer's name.
    layer: String,
    /// The steps' code, indented for the chunk's function.
    body: String,
    /// Values the steps read, in order.
    inputs: Vec<u32>,
    /// Values the steps write.
    outputs: Vec<u32>,
}

impl Region {
    fn new(key: (u32, bool), layer: &str) -> Region {
        Region {
            key,
            layer: layer.to_string(),
            body: String::new(),
            inputs: Vec::new(),
            outputs: Vec::new(),
        }
    }

    fn add(&mut self, step: &crate::executor::lower::Step, lines: &str) {
        for &v in &step.inputs {
            if !self.outputs.contains(&v) && !self.inputs.contains(&v) {
                self.inputs.push(v);
            }
        }
        self.outputs.extend(step.outputs.iter().copied());
        self.body.push_str(lines);
    }

    /// Writes the function and its call: `p` (the chunk's weights) and the variables it reads
    /// in, the values it writes that are `read_later` out, under the same names.
    fn write(
        self,
        src: &mut String,
        count: &mut usize,
        expr_of: &HashMap<u32, String>,
        read_later: impl Fn(u32) -> bool,
    ) -> Result<(), ExecError> {
        let var = |v: &u32| {
            expr_of
                .get(v)
                .cloned()
                .ok_or_else(|| err("a recomputed step reads a value the chunk does not have"))
        };
        let mut args = vec!["p".to_string()];
        for v in &self.inputs {
            let e = var(v)?;
            if e.starts_with("p[") || args.contains(&e) {
                continue;
            }
            if !e.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                return Err(err(format!(
                    "a recomputed step reads `{e}`, not a variable"
                )));
            }
            args.push(e);
        }
        let mut outs: Vec<String> = Vec::new();
        for v in self.outputs.iter().filter(|&&v| read_later(v)) {
            let e = var(v)?;
            if !outs.contains(&e) {
                outs.push(e);
            }
        }
        let n = *count;
        *count += 1;
        let what = if self.key.1 {
            "attention core"
        } else {
            "forward"
        };
        let _ = writeln!(
            src,
            "    def recomputed_{n}({}):\n        \"\"\"`{}`'s {what}, run again in the backward pass.\"\"\"",
            args.join(", "),
            self.layer
        );
        for line in self.body.lines() {
            let _ = writeln!(src, "    {line}");
        }
        if outs.is_empty() {
            return Err(err(format!(
                "`{}`'s recomputed steps write nothing read after them",
                self.layer
            )));
        }
        let _ = writeln!(
            src,
            "        return {},\n    {}, = jax.checkpoint(recomputed_{n})({})",
            outs.join(", "),
            outs.join(", "),
            args.join(", ")
        );
        Ok(())
    }
}

fn py_tuple(shape: &[usize]) -> String {
    match shape.len() {
        1 => format!("({},)", shape[0]),
        _ => format!(
            "({})",
            shape
                .iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}
