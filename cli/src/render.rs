//! Human-readable rendering of estimates, plans and graphs.

use autopar_engine::sharding::ShardingResult;
use autopar_rules::cost::cluster::{Cluster, GIB, Network};
use autopar_rules::model::frontend::Attention;
use autopar_rules::model::graph::{GraphSummary, Pass};
use autopar_rules::plan::estimate::{Chunk, Estimate, MemoryBreakdown};
use autopar_rules::plan::format::{Plan, shell_quote};
use autopar_rules::plan::ilp::{IlpPlan, SolverSpan, Space, spans};
use autopar_rules::plan::layout::{Layout, Recompute, TrainingOptions};
use autopar_rules::plan::partition::Attempt;
use autopar_rules::solve::intra::chain::TableSolver;
use std::fmt::Write;

/// Two priced layouts side by side, component by component: step, time components, memory by
/// component and per device, whether each fits.
pub fn comparison(
    s: &mut String,
    (left, a): (&str, &autopar_engine::whatif::Components),
    (right, b): (&str, &autopar_engine::whatif::Components),
) {
    use autopar_engine::whatif::{memory_components, time_components};
    // Every row's label, values and unit, so the label column fits the longest label.
    let mut rows: Vec<(String, f64, f64, &str)> =
        vec![("step".into(), a.step_time_s, b.step_time_s, " s")];
    for ((name, x), (_, y)) in time_components(&a.time)
        .into_iter()
        .zip(time_components(&b.time))
    {
        rows.push((name.into(), x, y, " s"));
    }
    for ((name, x), (_, y)) in memory_components(&a.memory)
        .into_iter()
        .zip(memory_components(&b.memory))
    {
        rows.push((format!("memory: {name}"), x / GIB, y / GIB, "G"));
    }
    rows.push((
        "memory per device".into(),
        a.memory_per_device_gib,
        b.memory_per_device_gib,
        "G",
    ));
    let w = rows.iter().map(|r| r.0.len()).max().unwrap_or(0);
    let _ = writeln!(s, "  {:<w$} {:>12} {:>12} {:>12}", "", left, right, "delta");
    for (name, x, y, unit) in &rows {
        let _ = writeln!(
            s,
            "  {name:<w$} {x:>10.3}{unit} {y:>10.3}{unit} {:>+10.3}{unit}",
            y - x
        );
    }
    let yes = |f: bool| if f { "yes" } else { "no" };
    let _ = writeln!(
        s,
        "  {:<w$} {:>12} {:>12}   of {:.1} and {:.1} GiB usable",
        "fits",
        yes(a.fits),
        yes(b.fits),
        a.memory_capacity / GIB,
        b.memory_capacity / GIB
    );
}
use std::path::Path;

/// `1234567` -> `1,234,567`.
pub fn thousands(x: f64) -> String {
    let s = format!("{:.0}", x.max(0.0));
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A count with an SI suffix: `1.75 B`, `618.3 M`.
pub fn si(x: f64) -> String {
    let (v, suffix) = if x >= 1e12 {
        (x / 1e12, " T")
    } else if x >= 1e9 {
        (x / 1e9, " B")
    } else if x >= 1e6 {
        (x / 1e6, " M")
    } else if x >= 1e3 {
        (x / 1e3, " k")
    } else {
        (x, "")
    };
    format!("{v:.2}{suffix}")
}

/// Bytes as GiB, or MiB, KiB or bytes when small.
pub fn bytes(b: f64) -> String {
    const KIB: f64 = 1024.0;
    if b >= GIB / 10.0 {
        format!("{:.1} GiB", b / GIB)
    } else if b >= KIB * KIB / 10.0 {
        format!("{:.1} MiB", b / (KIB * KIB))
    } else if b >= KIB {
        format!("{:.1} KiB", b / KIB)
    } else {
        format!("{b:.0} B")
    }
}

pub use autopar_rules::plan::format::secs;

/// The layout as a Megatron-LM user would say it; `partial`: under full recomputation of only
/// some blocks (Megatron-LM's block method), how many of each chunk.
pub fn layout_line(l: &Layout, microbatches: u64, partial: Option<usize>) -> String {
    let cp = if l.cp > 1 {
        format!(" · cp {} ({})", l.cp, l.cp_comm.name())
    } else {
        String::new()
    };
    let ep = if l.has_expert_parallelism() {
        format!(
            " · ep {} · etp {} (expert dp {})",
            l.ep,
            l.etp,
            l.expert_grad_ranks()
        )
    } else {
        String::new()
    };
    let mut s = format!(
        "tp {}{cp} · pp {} · dp {}{ep} · micro-batch {} ({} micro-batches)",
        l.tp, l.pp, l.dp, l.micro_batch, microbatches
    );
    if l.interleave > 1 {
        let _ = write!(s, " · interleave {}", l.interleave);
    }
    if l.sequence_parallel {
        s.push_str(" · sequence parallel");
    }
    if l.recompute != Recompute::None {
        let _ = write!(s, " · recompute {}", l.recompute.name());
    }
    if let Some(n) = partial {
        let _ = write!(s, " (the first {n} blocks of each chunk)");
    }
    if l.zero > 0 {
        let _ = write!(s, " · ZeRO-{}", l.zero);
    }
    s
}

fn memory_line(m: &MemoryBreakdown) -> String {
    format!(
        "weights {} · grads {} · optimizer {} · activations {} · workspace {}",
        bytes(m.weights),
        bytes(m.grads),
        bytes(m.optimizer),
        bytes(m.activations),
        bytes(m.workspace)
    )
}

/// The runtime settings a layout with ZeRO stage `zero` is priced with, in words.
pub fn runtime_settings(o: &TrainingOptions, zero: u8) -> String {
    let attention = match o.attention {
        Attention::Flash => "flash attention",
        Attention::FlashTriton => "flash attention in Triton",
        Attention::Fused => "cuDNN fused attention",
        Attention::Auto => "auto attention (cuDNN on Hopper, flash-attn on Ampere)",
        Attention::Unfused => "unfused attention",
    };
    let yes_no = |b: bool, yes: &'static str, no: &'static str| if b { yes } else { no };
    let reduced = if o.grad_reduce_in_fp32 {
        "gradients reduced in fp32".to_string()
    } else {
        format!("gradients reduced in {}", o.precision.name())
    };
    [
        attention,
        yes_no(
            o.eager_elementwise,
            "eager RMSNorm, RoPE and SwiGLU",
            "fused elementwise kernels",
        ),
        yes_no(
            o.grad_accumulation_fusion,
            "weight gradients accumulated in their products",
            "weight gradients added per micro-batch",
        ),
        &reduced,
        yes_no(
            o.overlap_grad_reduce,
            "reduction overlapped",
            "reduction after the backward",
        ),
        yes_no(o.fp32_loss, "unfused fp32 loss", "fused loss"),
    ]
    .into_iter()
    .map(str::to_string)
    // Said only when on: without it, no runtime overlaps tensor-parallel communication.
    .chain(
        o.tp_comm_overlap
            .then(|| "tensor-parallel communication overlapped (userbuffers)".to_string()),
    )
    // Only a fully sharded layout gathers weights for its backward.
    .chain((zero == 3).then(|| format!("backward prefetch {}", o.backward_prefetch.name())))
    .collect::<Vec<_>>()
    .join(" · ")
}

/// The body shared by `estimate` and plan reports.
pub fn estimate(out: &mut String, e: &Estimate) {
    let t = &e.time;
    // Full recomputation of only some blocks (Megatron-LM's block method) says how many.
    let chunks = || e.stages.iter().flat_map(|s| &s.chunks);
    let partial = (e.layout.recompute == Recompute::Full
        && chunks().any(|c| c.full_recompute < c.blocks))
    .then(|| chunks().map(|c| c.full_recompute).max().unwrap_or(0));
    let _ = writeln!(
        out,
        "  layout    {}",
        layout_line(&e.layout, e.num_microbatches, partial)
    );
    let _ = writeln!(
        out,
        "  step      {} · {} tokens/s · {:.1} TFLOP/s per GPU · MFU {:.1}%",
        secs(e.step_time_s),
        thousands(e.tokens_per_s),
        e.tflops_per_gpu,
        e.mfu * 100.0
    );
    let _ = writeln!(
        out,
        "  time      compute {} · recompute {} · {} comm {} · p2p {} · ZeRO comm {} · bubble {} \
         (ideal {:.1}%) · grad sync {} · optimizer {}",
        secs(t.compute),
        secs(t.recompute),
        match (e.layout.cp > 1, e.layout.has_expert_parallelism()) {
            (false, false) => "TP",
            (true, false) => "TP+CP",
            (false, true) => "TP+EP",
            (true, true) => "TP+CP+EP",
        },
        secs(t.tp_comm),
        secs(t.p2p),
        secs(t.zero_comm),
        secs(t.bubble),
        e.ideal_bubble * 100.0,
        secs(t.grad_sync),
        secs(t.optimizer)
    );
    let b = &e.bubble;
    let _ = writeln!(
        out,
        "  pipeline  {} · layers split {} · real bubble {:.1}% of compute = ideal {:.1}% + \
         imbalance {:.1}% + recompute {:.1}%{}",
        schedule_name(e),
        e.partition.name(),
        b.real * 100.0,
        b.ideal * 100.0,
        b.imbalance * 100.0,
        b.recompute * 100.0,
        if e.simulated { "" } else { " (closed form)" }
    );
    let _ = writeln!(
        out,
        "  memory    {} per device (stage {}) of {} usable: {}",
        bytes(e.memory.total),
        e.peak_memory_stage,
        bytes(e.memory_capacity),
        if e.fits { "fits" } else { "DOES NOT FIT" }
    );
    let _ = writeln!(out, "            {}", memory_line(&e.memory));
}

/// The schedule in words.
fn schedule_name(e: &Estimate) -> String {
    match (e.layout.pp, e.layout.interleave) {
        (1, _) => "no pipeline".to_string(),
        (_, 1) => "1F1B".to_string(),
        (_, v) => format!("interleaved 1F1B, {v} chunks per stage"),
    }
}

/// One chunk: its layer range, blocks and fully recomputed blocks.
fn chunk_cell(c: &Chunk) -> String {
    let range = if c.first == c.last {
        c.first_name.clone()
    } else {
        format!("{}..{}", c.first_name, c.last_name)
    };
    if c.full_recompute > 0 && c.full_recompute < c.blocks {
        format!(
            "{range} [{} blocks, {} recomputed]",
            c.blocks, c.full_recompute
        )
    } else {
        format!("{range} [{}]", c.blocks)
    }
}

/// Per-stage table.
pub fn stages(out: &mut String, e: &Estimate) {
    let _ = writeln!(
        out,
        "  stages    {:>3} {:>6} {:>11} {:>10} {:>9} {:>10}  layers [blocks]",
        "#", "blocks", "params/GPU", "time/mb", "in flight", "memory"
    );
    for s in &e.stages {
        let layers = s
            .chunks
            .iter()
            .map(chunk_cell)
            .collect::<Vec<_>>()
            .join(", ");
        let _ = writeln!(
            out,
            "            {:>3} {:>6} {:>11} {:>10} {:>9.1} {:>10}  {}",
            s.index,
            s.blocks,
            si(s.params),
            secs(s.per_microbatch_s),
            s.inflight_microbatches,
            bytes(s.memory.total),
            layers
        );
    }
}

/// How each way of splitting the layers did (nothing when none was tried).
pub fn attempts(out: &mut String, tried: &[Attempt]) {
    if tried.is_empty() {
        return;
    }
    let line = tried
        .iter()
        .map(|a| match a.step_time_s {
            Some(t) => format!(
                "{} {}{}",
                a.partition.name(),
                secs(t),
                if a.fits { "" } else { " (does not fit)" }
            ),
            None => format!("{} n/a ({})", a.partition.name(), a.note),
        })
        .collect::<Vec<_>>()
        .join(" · ");
    let _ = writeln!(out, "  splits    {line}");
}

/// Describes a cluster: `name (N x G device, K x R Gb/s per node)`.
pub fn cluster(c: &Cluster) -> String {
    let network = if c.nodes > 1 {
        format!(
            ", {} x {} Gb/s per node",
            c.network.nics_per_node,
            c.network.nic_bandwidth / Network::GBIT
        )
    } else {
        String::new()
    };
    format!(
        "{} ({} x {} {}{network})",
        c.name, c.nodes, c.gpus_per_node, c.device.name
    )
}

/// Wraps arguments into lines of at most `width` characters, keeping each flag with its value.
fn wrap_args(args: &[String], indent: &str, width: usize) -> String {
    let mut tokens: Vec<String> = Vec::new();
    for a in args {
        let word = shell_quote(a);
        match tokens.last_mut() {
            Some(t) if !a.starts_with("--") => {
                t.push(' ');
                t.push_str(&word);
            }
            _ => tokens.push(word),
        }
    }
    let mut lines: Vec<String> = Vec::new();
    for t in tokens {
        match lines.last_mut() {
            Some(l) if l.len() + 1 + t.len() <= width => {
                l.push(' ');
                l.push_str(&t);
            }
            _ => lines.push(t),
        }
    }
    lines.join(&format!(" \\\n{indent}"))
}

/// A whole plan, as `build` and `plan show` print it.
pub fn plan(p: &Plan, path: Option<&Path>, trace: Option<&Path>) -> String {
    let mut out = String::new();
    let e = &p.estimate;
    let _ = writeln!(
        out,
        "{}: {} ({} parameters, {} blocks) on {}, global batch {} x {} tokens, {}",
        p.target,
        p.model.name,
        si(p.model.parameters as f64),
        p.model.blocks,
        cluster(&p.cluster),
        e.layout.global_batch,
        p.training.seq,
        p.training.precision_label()
    );
    spaces(&mut out, p);
    if let Some(ilp) = &p.ilp {
        ilp_plan(&mut out, ilp);
    }
    // The arguments run the ILP plan when it won and Megatron-LM can express it.
    let args = format!(
        "  megatron  {}",
        wrap_args(&p.megatron_args, "            ", 96)
    );
    let ilp_args = p.space == Space::Ilp && p.megatron_expressible;
    if ilp_args {
        let _ = writeln!(out, "{args}");
    }
    if p.space == Space::Ilp {
        let _ = writeln!(out, "  the best Megatron-LM layout:");
    }
    estimate(&mut out, e);
    stages(&mut out, e);
    attempts(&mut out, &p.partitions);
    if !ilp_args {
        let _ = writeln!(out, "{args}");
    }
    if !p.alternatives.is_empty() {
        let _ = writeln!(out, "  next best");
        for a in &p.alternatives {
            let _ = writeln!(
                out,
                "            {:<44} {} · MFU {:.1}% · {:.1} GiB",
                a.layout.describe(),
                secs(a.step_time_s),
                a.mfu * 100.0,
                a.memory_per_device_gib
            );
        }
    }
    if let Some(w) = &p.without_cp {
        let line = match (&w.best, w.least_memory_gib) {
            (Some(a), _) => format!(
                "{} {} · MFU {:.1}% · {:.1} GiB ({})",
                a.layout.describe(),
                secs(a.step_time_s),
                a.mfu * 100.0,
                a.memory_per_device_gib,
                if a.step_time_s > e.step_time_s {
                    format!(
                        "context parallelism saves {:.1}%",
                        (1.0 - e.step_time_s / a.step_time_s) * 100.0
                    )
                } else {
                    "the plan has no context parallelism".into()
                }
            ),
            (None, Some(least)) => format!(
                "no layout fits: the leanest needs {least:.1} GiB per device of {:.1} GiB usable",
                w.usable_gib
            ),
            (None, None) => "no layout can run".into(),
        };
        let _ = writeln!(out, "  no cp     {line}");
    }
    let _ = writeln!(
        out,
        "  search    {} layouts: {} can run, {} fit split evenly; {} refined (DP, balance, \
         simulation){}",
        p.search.candidates,
        p.search.valid,
        p.search.feasible,
        p.search.refined,
        if p.search.refine_capped {
            ", stopped at the cap"
        } else {
            ""
        }
    );
    if let Some(path) = path {
        let _ = writeln!(out, "  plan      {}", path.display());
    }
    if let Some(trace) = trace {
        let _ = writeln!(
            out,
            "  trace     {} (open in chrome://tracing or ui.perfetto.dev)",
            trace.display()
        );
    }
    out
}

/// Which space won and by how much.
fn spaces(out: &mut String, p: &Plan) {
    if let Some(why) = p
        .spaces
        .ilp_not_searched
        .as_ref()
        .or(p.spaces.ilp_no_plan.as_ref())
    {
        let _ = writeln!(out, "  space     megatron: {why}");
        return;
    }
    // Only Megatron-LM's space has a plan (the other was not asked for, or found none).
    let (Some(m), Some(i)) = (&p.spaces.megatron, &p.spaces.ilp) else {
        return;
    };
    let (won, lost) = match p.space {
        Space::Ilp => (("ilp", i), ("megatron", m)),
        _ => (("megatron", m), ("ilp", i)),
    };
    let expressible = if p.megatron_expressible {
        "Megatron-LM can run it".to_string()
    } else {
        format!(
            "Megatron-LM cannot run it: {}",
            p.ilp
                .as_ref()
                .and_then(|i| i.not_megatron.clone())
                .unwrap_or_default()
        )
    };
    let _ = writeln!(
        out,
        "  space     {} wins: {} vs {} {} ({:+.1}%); {expressible}",
        won.0,
        secs(won.1.step_time_s),
        lost.0,
        secs(lost.1.step_time_s),
        (won.1.step_time_s / lost.1.step_time_s - 1.0) * 100.0
    );
    if p.spaces.ilp_sizes.len() > 1 {
        let sizes: Vec<String> = p
            .spaces
            .ilp_sizes
            .iter()
            .map(|s| format!("{} {}", s.micro_batch, secs(s.step_time_s)))
            .collect();
        let _ = writeln!(out, "            ilp by micro-batch: {}", sizes.join(" · "));
    }
    if let Some(why) = &p.spaces.ilp_sizes_left_out {
        let _ = writeln!(out, "            ilp left out: {why}");
    }
}

/// The ILP space's pipeline: stages with their meshes, and how they differ from Megatron-LM.
fn ilp_plan(out: &mut String, p: &IlpPlan) {
    let _ = writeln!(
        out,
        "  ilp       {} · step {} (pipeline {}, grad sync {}, optimizer {}) · {:.1} GiB per device",
        p.describe(),
        secs(p.step_time_s),
        secs(p.pipeline_s),
        secs(p.grad_sync_s),
        secs(p.optimizer_s),
        p.memory_per_device_gib
    );
    let _ = writeln!(
        out,
        "            {:>5} {:<36} {:>8} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9}  vs Megatron-LM",
        "stage",
        "layers",
        "submesh",
        "logical",
        "fwd/mb",
        "bwd/mb",
        "in flight",
        "recompute",
        "memory"
    );
    for (j, s) in p.stages.iter().enumerate() {
        let m = &s.megatron;
        let vs = match &m.unavailable {
            Some(why) => format!("not expressible: {why}"),
            None if m.differences.is_empty() => format!(
                "same sharding ({})",
                if m.sequence_parallel { "SP" } else { "no SP" }
            ),
            None => format!(
                "{} ops/weights differ, saves {}/mb",
                m.differences.len(),
                secs(m.saves_s)
            ),
        };
        let _ = writeln!(
            out,
            "            {:>5} {:<36} {:>8} {:>8} {:>9} {:>9} {:>9} {:>9} {:>6.1} GiB  {vs}",
            j,
            format!(
                "{}..{} ({} .. {})",
                s.layers[0], s.layers[1], s.first_name, s.last_name
            ),
            format!("{}x{}", s.mesh.submesh.0, s.mesh.submesh.1),
            format!("{}x{}", s.mesh.logical[0], s.mesh.logical[1]),
            secs(s.forward_s),
            secs(s.backward_s),
            s.inflight,
            recomputed(s.recomputed.len(), s.layers[1] - s.layers[0]),
            s.memory_gib
        );
    }
    let solvers: Vec<StageSolvers> = p
        .stages
        .iter()
        .map(|s| (s.solvers.clone(), s.warnings.as_slice()))
        .collect();
    drec_lines(out, &solvers);
    // The differences, with repeated blocks' ops counted once per pattern.
    let mut groups: Vec<(String, String, String, usize)> = Vec::new();
    for d in p.stages.iter().flat_map(|s| &s.megatron.differences) {
        let name = block_pattern(&d.name);
        match groups
            .iter_mut()
            .find(|g| g.0 == name && g.1 == d.plan && g.2 == d.megatron)
        {
            Some(g) => g.3 += 1,
            None => groups.push((name, d.plan.clone(), d.megatron.clone(), 1)),
        }
    }
    const SHOWN: usize = 8;
    for (k, (name, plan, megatron, n)) in groups.iter().take(SHOWN).enumerate() {
        let _ = writeln!(
            out,
            "  {:<9} {name}{}: {plan} (Megatron-LM: {megatron})",
            if k == 0 { "differs" } else { "" },
            if *n > 1 {
                format!(" x{n}")
            } else {
                String::new()
            }
        );
    }
    if groups.len() > SHOWN {
        let _ = writeln!(
            out,
            "            ... and {} more (every op's specs: the plan's `ilp.stages[].ops`)",
            groups.len() - SHOWN
        );
    }
}

/// Per stage, its runs of layers by solver (in order) and D-Rec's warnings.
type StageSolvers<'a> = (Vec<SolverSpan>, &'a [String]);

/// The lines saying which layers D-Rec priced (not proven optimal), with its warnings once
/// each; nothing when the exact elimination priced them all.
fn drec_lines(out: &mut String, stages: &[StageSolvers]) {
    let is_drec = |span: &SolverSpan| span.solver == TableSolver::Drec;
    if !stages.iter().any(|(s, _)| s.iter().any(is_drec)) {
        return;
    }
    if stages.iter().all(|(s, _)| s.iter().all(is_drec)) {
        let _ = writeln!(
            out,
            "  solver    every layer priced by D-Rec (heuristic, not proven optimal)"
        );
    } else {
        for (j, (spans, _)) in stages.iter().enumerate() {
            let named: Vec<String> = spans
                .iter()
                .filter(|s| is_drec(s))
                .map(|s| format!("{}..{}", s.layers[0], s.layers[1]))
                .collect();
            if named.is_empty() {
                continue;
            }
            let _ = writeln!(
                out,
                "  solver    stage {j}: layers {} priced by D-Rec (heuristic, not proven \
                 optimal), the others exactly",
                named.join(", ")
            );
        }
    }
    let mut said: Vec<&String> = Vec::new();
    for w in stages.iter().flat_map(|(_, w)| w.iter()) {
        if !said.contains(&w) {
            said.push(w);
            let _ = writeln!(out, "  warning   {w}");
        }
    }
}

/// How many of a stage's layers are recomputed: `-`, `all` or a count.
fn recomputed(count: usize, layers: usize) -> String {
    match count {
        0 => "-".into(),
        n if n == layers => "all".into(),
        n => format!("{n} of {layers}"),
    }
}

/// `layers.12.mlp.fc1` as `layers.*.mlp.fc1`: the same op of every block.
fn block_pattern(name: &str) -> String {
    let parts: Vec<&str> = name.split('.').collect();
    parts
        .iter()
        .map(|p| {
            if !p.is_empty() && p.chars().all(|c| c.is_ascii_digit()) {
                "*"
            } else {
                p
            }
        })
        .collect::<Vec<_>>()
        .join(".")
}

/// A graph summary with its per-layer table and the ops of each distinct layer.
pub fn graph(g: &GraphSummary, precision: &str, attention: &str) -> String {
    let mut out = String::new();
    let layers: usize = g.groups.iter().map(|gr| gr.last - gr.first + 1).sum();
    let _ = writeln!(
        out,
        "{}: {} parameters{}, {} layers, {} ops (sequence {}, micro-batch {}, {}, {} attention)",
        g.name,
        si(g.parameters as f64),
        if g.active_parameters < g.parameters {
            format!(
                " ({} active per token, {} without the input embedding)",
                si(g.active_parameters as f64),
                si(g.active_parameters_without_input_embedding as f64)
            )
        } else {
            String::new()
        },
        layers,
        thousands(g.ops as f64),
        g.seq,
        g.micro_batch,
        precision,
        attention
    );
    let _ = writeln!(
        out,
        "FLOPs per token: forward {}FLOP, forward + backward {}FLOP",
        si(g.forward_flops_per_token),
        si(g.training_flops_per_token)
    );
    let _ = writeln!(
        out,
        "\n{:<12} {:<10} {:>10} {:>14} {:>14} {:>14} {:>5}",
        "layers", "kind", "params", "fwd FLOP", "bwd FLOP", "activations", "ops"
    );
    for gr in &g.groups {
        let range = if gr.first == gr.last {
            format!("{}", gr.first)
        } else {
            format!("{}-{}", gr.first, gr.last)
        };
        let l = &gr.layer;
        let _ = writeln!(
            out,
            "{:<12} {:<10} {:>10} {:>14} {:>14} {:>14} {:>5}",
            range,
            l.kind.name(),
            si(l.parameters as f64),
            si(l.forward_flops),
            si(l.backward_flops),
            bytes(l.saved_activation_bytes as f64),
            l.ops
        );
    }
    for gr in &g.groups {
        let count = gr.last - gr.first + 1;
        let _ = writeln!(
            out,
            "\nops of {} ({}{})",
            gr.layer.name,
            gr.layer.kind.name(),
            if count > 1 {
                format!(", same for layers {}-{}", gr.first, gr.last)
            } else {
                String::new()
            }
        );
        for op in &gr.ops {
            let shapes = |s: &[Vec<u64>]| {
                s.iter()
                    .map(|d| format!("{d:?}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            };
            let _ = writeln!(
                out,
                "  {:<48} {:<15} {:>9}  {} -> {}",
                op.name,
                op.kind,
                si(op.flops),
                shapes(&op.inputs),
                shapes(&op.outputs)
            );
        }
    }
    out
}

/// The plan of `autopar solve sharding`.
pub fn sharding(r: &ShardingResult, micro_batch: u64) -> String {
    let p = &r.plan;
    let mut out = String::new();
    let layers = if r.layer_names.len() == 1 {
        r.layer_names[0].clone()
    } else {
        format!(
            "{} .. {}",
            r.layer_names.first().map_or("", String::as_str),
            r.layer_names.last().map_or("", String::as_str)
        )
    };
    let _ = writeln!(
        out,
        "{} layers {}..{} ({layers}) on mesh {}x{} of {}, micro-batch {micro_batch} x {} tokens, {} micro-batch(es) per step",
        r.model,
        p.layers[0],
        p.layers[1],
        p.mesh[0],
        p.mesh[1],
        cluster(&r.cluster),
        r.seq,
        p.microbatches
    );
    let s = &p.solve;
    let status = if s.optimal {
        "optimal".to_string()
    } else if s.solver == "drec" {
        "heuristic, not proven optimal".to_string()
    } else {
        format!("time limit, gap {:.2}%", s.gap * 100.0)
    };
    let _ = writeln!(
        out,
        "solver {} ({status}) in {}: {} variables, {} strategies ({} undominated), {} edges, largest factor {}",
        s.solver,
        secs(s.seconds),
        s.variables,
        s.strategies,
        s.undominated,
        s.edges,
        thousands(s.width)
    );
    match &r.chain {
        Some(Ok(c)) => {
            let states: Vec<String> = c
                .layers
                .iter()
                .map(|l| format!("{}x{}", l.states_before, l.states_after))
                .collect();
            let solves: usize = c.layers.iter().map(|l| l.solves).sum();
            let _ = writeln!(
                out,
                "chained layer tables: objective {} per micro-batch (the range's: {}, difference {:.1e}), memory {:.2} GiB before the budget; {} tables (boundary states {}), {} eliminations in {}",
                secs(c.objective),
                secs(p.objective),
                (c.objective - p.objective).abs() / p.objective.abs().max(f64::MIN_POSITIVE),
                c.memory_gib,
                c.layers.len(),
                states.join(", "),
                solves,
                secs(c.seconds)
            );
        }
        Some(Err(why)) => {
            let _ = writeln!(out, "chained layer tables: not composed: {why}");
        }
        None => {}
    }
    let t = &p.per_microbatch;
    let _ = writeln!(
        out,
        "per micro-batch: forward {}, backward {} (compute {}, op collectives {}, resharding {})",
        secs(p.forward),
        secs(p.backward),
        secs(t.compute),
        secs(t.communication),
        secs(t.resharding)
    );
    let _ = writeln!(
        out,
        "per step: {} (gradient sync, optimizer, updated-weight gathers); objective {} per micro-batch",
        secs(p.step),
        secs(p.objective)
    );
    let m = &p.memory;
    let _ = writeln!(
        out,
        "memory per device: {} held{} (activations {}, weights {}, gradients {}, optimizer states {}); \
         {} at the backward's peak (its largest transient {})",
        bytes(m.total),
        m.budget
            .map(|b| format!(" of {}", bytes(b)))
            .unwrap_or_default(),
        bytes(m.activations),
        bytes(m.weights),
        bytes(m.gradients),
        bytes(m.optimizer),
        bytes(m.peak()),
        bytes(m.working)
    );
    let _ = writeln!(out);
    let width =
        |items: &mut dyn Iterator<Item = usize>, least: usize| items.max().unwrap_or(0).max(least);
    let wn = width(&mut p.ops.iter().map(|o| o.name.len()), 2);
    let wi = width(&mut p.ops.iter().map(|o| o.inputs.join(" ").len()), 6);
    let wo = width(&mut p.ops.iter().map(|o| o.outputs.join(" ").len()), 7);
    let _ = writeln!(
        out,
        "{:<wn$} {:<4} {:<wi$} {:<wo$} {:>9}",
        "op", "pass", "inputs", "outputs", "compute"
    );
    for o in &p.ops {
        let pass = match o.pass {
            Pass::Forward => "fwd",
            Pass::Backward => "bwd",
        };
        let _ = writeln!(
            out,
            "{:<wn$} {:<4} {:<wi$} {:<wo$} {:>9}",
            o.name,
            pass,
            o.inputs.join(" "),
            o.outputs.join(" "),
            secs(o.compute_seconds)
        );
    }
    let _ = writeln!(out);
    let wp = width(&mut p.parameters.iter().map(|q| q.name.len()), 9);
    let _ = writeln!(
        out,
        "{:<wp$} {:<16} {:<10} {:<10}",
        "parameter", "shape", "weight", "states"
    );
    for q in &p.parameters {
        let shape: Vec<String> = q.shape.iter().map(|d| d.to_string()).collect();
        let _ = writeln!(
            out,
            "{:<wp$} {:<16} {:<10} {}",
            q.name,
            shape.join("x"),
            q.weight,
            q.states
        );
    }
    let _ = writeln!(out);
    if p.collectives.is_empty() {
        let _ = writeln!(out, "no collectives");
    } else {
        let _ = writeln!(
            out,
            "{:<9} {:<15} {:>4} {:>10} {:>9} {:<16} tensor",
            "phase", "collective", "axis", "bytes", "time", "why"
        );
        for c in &p.collectives {
            let _ = writeln!(
                out,
                "{:<9} {:<15} {:>4} {:>10} {:>9} {:<16} {}",
                json_name(&c.phase),
                json_name(&c.kind),
                c.axis,
                bytes(c.bytes),
                secs(c.seconds),
                json_name(&c.reason),
                c.tensor
            );
        }
    }
    out
}

/// The serde name of a unit enum value.
fn json_name(v: &impl serde::Serialize) -> String {
    serde_json::to_value(v)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

/// The report of `autopar run`.
pub fn run(o: &autopar_engine::run::RunOutcome) -> String {
    let mut s = String::new();
    let l = &o.layout;
    // Under expert parallelism the stage's mesh holds `ep` data-parallel ranks' micro-batches.
    let per_rank = if l.ep > 1 {
        format!(" ({} per data-parallel rank)", o.micro_batch / l.ep.max(1))
    } else {
        String::new()
    };
    let _ = writeln!(
        s,
        "run {} ({}) on {}: {} virtual device(s), {}, micro-batch {} x {} tokens{per_rank}",
        o.target,
        o.model,
        o.backend.name(),
        o.devices,
        l.describe(),
        o.micro_batch,
        o.seq
    );
    if let Some(ilp) = &o.ilp {
        let _ = writeln!(
            s,
            "plan      the ILP space's pipeline ({}): every stage on its logical mesh, every op \
             placed as its specs say",
            ilp.summary
        );
    }
    let _ = writeln!(
        s,
        "program   {} in {} ({} kernels over {} virtual stage(s)), key {}",
        o.program.source,
        secs(o.program.seconds),
        o.program.steps_per_chunk.iter().sum::<usize>(),
        o.program.steps_per_chunk.len(),
        &o.program.key[..16.min(o.program.key.len())]
    );
    let _ = writeln!(s, "{:>6}  {:>10}  {:>12}", "step", "loss", "time");
    for (i, (loss, t)) in o.result.losses.iter().zip(&o.result.step_times).enumerate() {
        let _ = writeln!(s, "{:>6}  {:>10.6}  {:>12}", i + 1, loss, secs(*t));
    }
    let _ = writeln!(
        s,
        "step time measured {} (median{}) on {}; predicted {} on {}{}",
        secs(o.measured_step_time_s),
        if o.result.step_times.len() > 1 {
            ", first step left out"
        } else {
            ""
        },
        o.backend.name(),
        secs(o.predicted_step_time_s),
        o.cluster,
        if o.comparable && o.predicted_step_time_s > 0.0 {
            format!(
                ": error {:+.1}%",
                100.0
                    * (o.predicted_step_time_s / o.measured_step_time_s.max(f64::MIN_POSITIVE)
                        - 1.0)
            )
        } else if o.jax.is_some() {
            " (not compared: the cluster's profile times the CPU executor's kernels, not XLA's)"
                .to_string()
        } else if o.backend == autopar_engine::executor::Backend::Cpu && o.devices > o.host_cores {
            format!(
                " (not compared: {} virtual devices share this machine's {} cores)",
                o.devices, o.host_cores
            )
        } else {
            String::new()
        }
    );
    let m = o.result.median_phases();
    let p = &o.predicted_time;
    // The JAX program times whole steps only.
    if o.jax.is_none() {
        let _ = writeln!(
            s,
            "measured  forward + backward {} · communication {} · optimizer {}",
            secs(m.forward + m.backward),
            secs(m.communication),
            secs(m.optimizer)
        );
    }
    if o.plan_space == autopar_rules::plan::ilp::Space::Ilp {
        let _ = writeln!(
            s,
            "predicted pipeline {} (kernels, collectives and bubble) · gradient sync {} · \
             optimizer {}",
            secs(p.compute),
            secs(p.grad_sync),
            secs(p.optimizer)
        );
    } else {
        let _ = writeln!(
            s,
            "predicted compute {} · communication and bubble {} · optimizer {}",
            secs(p.compute + p.recompute),
            secs(p.tp_comm + p.p2p + p.zero_comm + p.bubble + p.grad_sync),
            secs(p.optimizer)
        );
    }
    let jax = o.jax.as_ref();
    if let Some(c) = &o.check {
        let against = if jax.is_some() {
            " (against the same program on one device)"
        } else {
            ""
        };
        let _ = writeln!(s, "check     {}{against}", check_line(c));
    }
    if let Some(j) = jax {
        if let Some(c) = &j.cpu_check {
            let _ = writeln!(
                s,
                "check     {} (against autopar's CPU executor on one device)",
                check_line(c)
            );
        }
        let _ = writeln!(
            s,
            "jax       JAX {} on {} ({}); program {}, key {}",
            j.jax_version,
            j.platform,
            j.python,
            j.program_source,
            &j.program_key[..16.min(j.program_key.len())]
        );
        let c = &j.collectives;
        let counts = |m: &autopar_engine::run::CollectiveCounts| {
            if m.is_empty() {
                "none".to_string()
            } else {
                m.iter()
                    .map(|(k, n)| format!("{n} {k}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        };
        let _ = writeln!(
            s,
            "collectives of one micro-batch per virtual stage, the plan's (+ gradients it \
             reduces once per step; + at most the recomputed layers' forward ones) against \
             XLA's: {}",
            if c.agree { "they agree" } else { "they differ" }
        );
        let none = autopar_engine::run::CollectiveCounts::new();
        for (i, ((p, d), x)) in c
            .planned
            .iter()
            .zip(&c.deferred)
            .zip(&c.compiled)
            .enumerate()
        {
            let r = c.recomputed.get(i).unwrap_or(&none);
            let _ = writeln!(
                s,
                "  virtual stage {i}: plan {}{}{} · XLA {}",
                counts(p),
                if d.is_empty() {
                    String::new()
                } else {
                    format!(" (+ {})", counts(d))
                },
                if r.is_empty() {
                    String::new()
                } else {
                    format!(" (+ at most {} recomputed)", counts(r))
                },
                counts(x)
            );
        }
    }
    s
}

/// One comparison's figures.
fn check_line(c: &autopar_engine::executor::CheckReport) -> String {
    format!(
        "{}: loss {:.1e} over {} step(s), gradients {:.1e} (worst `{}`, {} compared), weights \
         after one update {:.1e}; tolerance {:.0e}",
        if c.passed { "PASSED" } else { "FAILED" },
        c.loss_rel,
        c.reference.losses.len(),
        c.grad_rel,
        c.worst_grad,
        c.compared,
        c.param_rel,
        c.tolerance
    )
}

/// Peak FLOP/s of `device` for products computed in `dtype`.
fn peak_for(
    device: &autopar_rules::cost::cluster::Device,
    dtype: autopar_rules::model::graph::DType,
) -> f64 {
    match dtype {
        autopar_rules::model::graph::DType::F32 => device.peak_fp32_flops,
        _ => device.peak_bf16_flops,
    }
}

/// Measured entries, slowest first, with the analytic time for the cluster's device.
fn measured_rows(m: &autopar_engine::profiles::Measured) -> Vec<(String, f64, Option<f64>)> {
    // Modelled times are for the cluster's device: a comparison only when that was measured.
    let modelled: std::collections::HashMap<_, _> = if m.compares_with_model() {
        m.modelled.entries().into_iter().collect()
    } else {
        Default::default()
    };
    let mut rows: Vec<(String, f64, Option<f64>)> = m
        .profile
        .entries()
        .into_iter()
        .map(|(e, t)| {
            let model = modelled.get(&e).copied();
            (e.to_string(), t, model)
        })
        .collect();
    rows.sort_by(|a, b| b.1.total_cmp(&a.1));
    rows
}

/// `autopar profile run`'s summary.
pub fn profile_run(
    m: &autopar_engine::profiles::Measured,
    device: &autopar_rules::cost::cluster::Device,
    a: &crate::args::ProfileRunArgs,
    backend: autopar_engine::executor::Backend,
) -> String {
    let mut s = String::new();
    let (ops, colls) = m
        .profile
        .entries()
        .iter()
        .fold((0, 0), |(o, c), (e, _)| match e {
            autopar_rules::cost::profile::EntryId::Op(_) => (o + 1, c),
            autopar_rules::cost::profile::EntryId::Collective(..) => (o, c + 1),
        });
    let _ = writeln!(
        s,
        "profile of {} on {} (targets {}), measured on {}: {ops} kernels and {colls} collective sizes in {}",
        a.model,
        a.cluster,
        m.targets.join(", "),
        backend.name(),
        secs(m.seconds)
    );
    if !m.skipped.is_empty() {
        let _ = writeln!(
            s,
            "{} left to the analytic model (no {} kernel):",
            m.skipped.len(),
            backend.name()
        );
        for k in &m.skipped {
            let _ = writeln!(s, "  {}", k.reason);
        }
    }
    if let Some((sig, rate)) = &m.fastest_product {
        let peak = peak_for(device, sig.dtype);
        let _ = writeln!(
            s,
            "fastest matrix product {:.1} GFLOP/s = {:.0}% of the `{}` peak ({:.1} GFLOP/s): {sig}",
            rate / 1e9,
            100.0 * rate / peak,
            device.name,
            peak / 1e9
        );
    }
    let rows = measured_rows(m);
    let compared = m.compares_with_model();
    if !rows.is_empty() && a.top > 0 {
        let _ = if compared {
            writeln!(
                s,
                "{:>12}  {:>12}  {:>6}  slowest entries",
                "measured",
                format!("{} model", m.modelled.device),
                "ratio"
            )
        } else {
            writeln!(s, "{:>12}  slowest entries", "measured")
        };
        for (e, us, model) in rows.iter().take(a.top) {
            let t = format!("{us:.1} us");
            if !compared {
                let _ = writeln!(s, "{t:>12}  {e}");
                continue;
            }
            let (model, ratio) = match model {
                Some(x) if *x > 0.0 => (format!("{x:.1} us"), format!("{:.2}", us / x)),
                _ => ("-".into(), "-".into()),
            };
            let _ = writeln!(s, "{t:>12}  {model:>12}  {ratio:>6}  {e}");
        }
    }
    if !compared {
        let _ = writeln!(
            s,
            "note: the profile's device is `{}`; it applies to clusters with preset = \"{}\", not to `{}` ({})",
            m.profile.device, m.profile.device, a.cluster, m.modelled.device
        );
    }
    s
}

/// `autopar profile run`'s summary as JSON.
pub fn profile_run_json(
    m: &autopar_engine::profiles::Measured,
    device: &autopar_rules::cost::cluster::Device,
    a: &crate::args::ProfileRunArgs,
    backend: autopar_engine::executor::Backend,
) -> serde_json::Value {
    let fastest = m.fastest_product.as_ref().map(|(sig, rate)| {
        let peak = peak_for(device, sig.dtype);
        serde_json::json!({"entry": sig.to_string(), "flops_per_s": rate, "fraction_of_peak": rate / peak})
    });
    serde_json::json!({
        "model": a.model,
        "cluster": a.cluster,
        "backend": backend.name(),
        "device": m.profile.device,
        "cluster_device": m.modelled.device,
        "targets": m.targets,
        "seconds": m.seconds,
        "fastest_product": fastest,
        "skipped": m.skipped.iter().map(|k| serde_json::json!({"entry": k.entry.to_string(), "reason": k.reason})).collect::<Vec<_>>(),
        "entries": measured_rows(m).into_iter().map(|(e, t, model)| serde_json::json!({"entry": e, "measured_us": t, "modelled_us": model})).collect::<Vec<_>>(),
    })
}

/// `autopar solve pipeline`'s report.
pub fn pipeline(r: &autopar_engine::pipeline::PipelineResult, micro_batch: u64) -> String {
    let p = &r.plan;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} on {}, micro-batch {micro_batch} x {} tokens, {} micro-batches per step, {:.1} GiB per device",
        r.model,
        cluster(&r.cluster),
        r.seq,
        r.microbatches,
        r.budget / GIB
    );
    let _ = writeln!(
        out,
        "step {} = stage costs + (B - 1) x the largest; {} stage(s)",
        secs(p.step),
        p.stages.len()
    );
    let _ = writeln!(
        out,
        "  stage  layers                                     submesh  logical  cost/mb  in flight  recompute     memory"
    );
    for (j, s) in p.stages.iter().map(|s| &s.priced).enumerate() {
        let first = r.layer_names.get(s.layers[0]).map_or("", String::as_str);
        let last = r
            .layer_names
            .get(s.layers[1].saturating_sub(1))
            .map_or("", String::as_str);
        let names = if s.layers[1] == s.layers[0] + 1 {
            format!("{}..{} ({first})", s.layers[0], s.layers[1])
        } else {
            format!("{}..{} ({first} .. {last})", s.layers[0], s.layers[1])
        };
        let _ = writeln!(
            out,
            "  {j:>5}  {names:<42} {:>7}  {:>7}  {:>7}  {:>9}  {:>9}  {:>5.1} GiB",
            format!("{}x{}", s.mesh.submesh.0, s.mesh.submesh.1),
            format!("{}x{}", s.mesh.logical[0], s.mesh.logical[1]),
            secs(s.cost),
            s.inflight,
            recomputed(s.recomputed.len(), s.layers[1] - s.layers[0]),
            s.memory / GIB
        );
    }
    let solvers: Vec<StageSolvers> = p
        .stages
        .iter()
        .map(|s| {
            let spans = spans(s.priced.layers[0], &s.solvers);
            (spans, s.plan.solve.warnings.as_slice())
        })
        .collect();
    drec_lines(&mut out, &solvers);
    for k in &p.skipped {
        let _ = writeln!(
            out,
            "not searched: {} on submesh {}x{} as logical mesh {}x{}: {}",
            k.layer,
            k.mesh.submesh.0,
            k.mesh.submesh.1,
            k.mesh.logical[0],
            k.mesh.logical[1],
            k.reason
        );
    }
    let c = &r.tables;
    let _ = write!(
        out,
        "layer tables: {} ({} mesh choices x distinct layers): {} memory hits, {} local hits, {} remote hits, {} solved, in {}",
        p.tables,
        p.meshes,
        c.memory,
        c.local,
        c.remote,
        c.solved,
        secs(r.seconds)
    );
    out
}

/// A percentage with its sign, e.g. `+12.5%`.
fn signed_percent(x: f64) -> String {
    format!("{:+.1}%", x * 100.0)
}

/// A layout in a table cell: the degrees, then only the knobs that differ from their default.
fn layout_cell(l: &Layout) -> String {
    let mut s = format!("tp{}", l.tp);
    if l.cp > 1 {
        let _ = write!(s, " cp{}", l.cp);
    }
    if l.ep > 1 {
        let _ = write!(s, " ep{}", l.ep);
    }
    let _ = write!(s, " pp{} dp{} mb{}", l.pp, l.dp, l.micro_batch);
    if l.interleave > 1 {
        let _ = write!(s, " v{}", l.interleave);
    }
    if l.sequence_parallel {
        s.push_str(" sp");
    }
    if l.recompute != Recompute::None {
        let _ = write!(s, " rc={}", l.recompute.name());
    }
    if l.zero > 0 {
        let _ = write!(s, " zero{}", l.zero);
    }
    s
}

/// `autopar validate`'s report: every run, then the figures.
pub fn validation(file: &Path, v: &autopar_engine::validate::Validation) -> String {
    let mut out = format!(
        "{}: {} measured run{}\n\n",
        file.display(),
        v.runs.len(),
        if v.runs.len() == 1 { "" } else { "s" }
    );
    let _ = writeln!(
        out,
        "{:>5}  {:<14} {:<15} {:<40} {:>5} {:<18} {:>9} {:>10} {:>7} {:>7} {:>8} {:>7}",
        "line",
        "model",
        "cluster",
        "layout",
        "seq",
        "runtime",
        "measured",
        "predicted",
        "error",
        "memory",
        "predicted",
        "error"
    );
    let model_name = |m: &str| {
        Path::new(m)
            .file_stem()
            .map_or_else(|| m.to_string(), |s| s.to_string_lossy().into_owned())
    };
    for r in &v.runs {
        let measured = r
            .measured_step_time_s
            .map_or_else(|| "oom".to_string(), secs);
        let predicted = if r.predicted_oom {
            format!("{} oom", secs(r.predicted_step_time_s))
        } else {
            secs(r.predicted_step_time_s)
        };
        let _ = writeln!(
            out,
            "{:>5}  {:<14} {:<15} {:<40} {:>5} {:<18} {:>9} {:>10} {:>7} {:>7} {:>8} {:>7}",
            r.line,
            model_name(&r.model),
            r.cluster,
            match r.recompute_layers {
                // The blocks recomputed per stage, after the policy.
                Some(n) => layout_cell(&r.layout).replacen(" rc=full", &format!(" rc=full:{n}"), 1),
                None => layout_cell(&r.layout),
            },
            r.seq,
            if r.fp8 {
                format!("{} fp8", r.runtime)
            } else {
                r.runtime.to_string()
            },
            measured,
            predicted,
            r.time_error.map_or_else(|| "-".into(), signed_percent),
            r.measured_memory_gib
                .map_or_else(|| "-".into(), |m| format!("{m:.1}G")),
            format!("{:.1}G", r.predicted_memory_gib),
            r.memory_error.map_or_else(|| "-".into(), signed_percent),
        );
    }
    let ran = v.runs.iter().filter(|r| r.time_error.is_some()).count();
    let with_memory = v.runs.iter().filter(|r| r.memory_error.is_some()).count();
    out.push('\n');
    let _ = writeln!(
        out,
        "mean |time error|    {} over {ran} run{} that ran",
        v.mean_abs_error
            .map_or_else(|| "-".into(), |e| format!("{:.1}%", e * 100.0)),
        if ran == 1 { "" } else { "s" }
    );
    let _ = writeln!(
        out,
        "mean |memory error|  {}",
        v.memory_mean_abs_error.map_or_else(
            || "- (no run gives its memory)".into(),
            |e| format!("{:.1}% over {with_memory} runs", e * 100.0)
        )
    );
    let agreed = v
        .runs
        .iter()
        .filter(|r| r.measured_oom == r.predicted_oom)
        .count();
    let _ = writeln!(
        out,
        "out-of-memory verdicts agree on {agreed} of {} runs{}",
        v.runs.len(),
        v.oom_agreement
            .map_or_else(String::new, |a| format!(" ({:.0}%)", a * 100.0))
    );
    let ranked: Vec<_> = v.spearman.iter().filter(|g| g.spearman.is_some()).collect();
    let unranked = v.spearman.len() - ranked.len();
    if !ranked.is_empty() {
        out.push_str("rank correlation of time per token (Spearman), per model and cluster:\n");
        for g in &ranked {
            let _ = writeln!(
                out,
                "  {:<14} {:<15} {:>3} runs  {:+.2}  mean |error| {}",
                model_name(&g.model),
                g.cluster,
                g.runs,
                g.spearman.unwrap_or(f64::NAN),
                g.mean_abs_error
                    .map_or_else(|| "-".into(), |e| format!("{:.1}%", e * 100.0))
            );
        }
    }
    if unranked > 0 {
        let _ = writeln!(
            out,
            "{unranked} group{} of fewer than 3 runs (or all tied) ha{} no rank correlation",
            if unranked == 1 { "" } else { "s" },
            if unranked == 1 { "s" } else { "ve" }
        );
    }
    out
}
