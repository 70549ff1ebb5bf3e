//! `autopar whatif TARGET [layout flags]`: a layout beside the target's plan.

use super::print_json;
use crate::Failure;
use crate::args::WhatifArgs;
use crate::output::out;
use autopar_engine::session::Session;
use autopar_engine::whatif::{time_components, whatif};
use autopar_rules::cost::cluster::GIB;
use autopar_rules::plan::layout::Layout;
use std::fmt::Write;

pub fn run(session: &Session, a: &WhatifArgs) -> Result<(), Failure> {
    let ws = session.workspace()?;
    let plan = super::target_or_file_plan(&ws, Some(&a.target), None)?;
    let p = plan.estimate.layout;
    let (tp, pp) = (a.tp.unwrap_or(p.tp), a.pp.unwrap_or(p.pp));
    let gpus = plan.cluster.gpus();
    let dp = match a.dp {
        Some(dp) => dp,
        None if (tp, pp) == (p.tp, p.pp) => p.dp,
        None if gpus % (tp * pp) == 0 => gpus / (tp * pp),
        None => {
            return Err(Failure::Input(anyhow::anyhow!(
                "--tp {tp} x --pp {pp}: expected a product that divides the {gpus} GPUs of `{}`, \
                 found {}; pass --dp, or a tp and pp that fit",
                plan.cluster.name,
                tp * pp
            )));
        }
    };
    let layout = Layout {
        tp,
        pp,
        dp,
        micro_batch: a.mbs.unwrap_or(p.micro_batch),
        global_batch: p.global_batch,
        // Interleaving needs stages: without them the plan's chunks per stage do not carry.
        interleave: a.vp.unwrap_or(if pp == 1 { 1 } else { p.interleave }),
        // Sequence parallelism lives in the tensor-parallel group.
        sequence_parallel: a.sp.unwrap_or(p.sequence_parallel && tp > 1),
        recompute: a.recompute.map_or(p.recompute, Into::into),
        zero: a.zero.unwrap_or(p.zero),
    };
    let w = whatif(&ws, &a.target, &plan, &layout)?;
    if a.json {
        return print_json(&w);
    }
    let mut s = String::new();
    let (pl, al) = (&w.plan, &w.alternative);
    let _ = writeln!(
        s,
        "whatif {}: {} against the plan's {} ({} x {} {})",
        a.target,
        al.layout.describe(),
        pl.layout.describe(),
        plan.cluster.nodes,
        plan.cluster.gpus_per_node,
        plan.cluster.device.name
    );
    let _ = writeln!(
        s,
        "  {:<32} {:>12} {:>12} {:>12}",
        "", "plan", "what-if", "delta"
    );
    let row = |s: &mut String, name: &str, a: f64, b: f64, unit: &str| {
        let _ = writeln!(
            s,
            "  {name:<32} {:>10.3}{unit} {:>10.3}{unit} {:>+10.3}{unit}",
            a,
            b,
            b - a
        );
    };
    row(&mut s, "step", pl.step_time_s, al.step_time_s, " s");
    for ((name, a), (_, b)) in time_components(&pl.time)
        .into_iter()
        .zip(time_components(&al.time))
    {
        row(&mut s, name, a, b, " s");
    }
    let m = |x: f64| x / GIB;
    for (name, a, b) in [
        ("weights", pl.memory.weights, al.memory.weights),
        ("gradients", pl.memory.grads, al.memory.grads),
        ("optimizer states", pl.memory.optimizer, al.memory.optimizer),
        ("activations", pl.memory.activations, al.memory.activations),
        ("workspace", pl.memory.workspace, al.memory.workspace),
    ] {
        row(&mut s, &format!("memory: {name}"), m(a), m(b), "G");
    }
    row(
        &mut s,
        "memory per device",
        pl.memory_per_device_gib,
        al.memory_per_device_gib,
        "G",
    );
    let _ = writeln!(
        s,
        "  {:<32} {:>12} {:>12}   of {:.1} GiB usable",
        "fits",
        if pl.fits { "yes" } else { "no" },
        if al.fits { "yes" } else { "no" },
        al.memory_capacity / GIB
    );
    if let Some(t) = w.plan_ilp_step_time_s {
        let _ = writeln!(
            s,
            "  the plan chose the ILP space's pipeline, {t:.3} s per step; its best Megatron-LM \
             layout is compared here"
        );
    }
    let _ = writeln!(s, "  => {}", w.reason);
    out!("{s}");
    Ok(())
}
