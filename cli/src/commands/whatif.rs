//! `autopar whatif TARGET [layout flags]`: a layout beside the target's plan.

use super::print_json;
use crate::Failure;
use crate::args::WhatifArgs;
use crate::output::out;
use crate::render;
use autopar_engine::session::Session;
use autopar_engine::whatif::{Components, whatif};
use autopar_rules::plan::ilp::Space;
use autopar_rules::plan::layout::Layout;
use std::fmt::Write;

pub fn run(session: &Session, a: &WhatifArgs) -> Result<(), Failure> {
    let ws = session.workspace()?;
    let plan = super::target_or_file_plan(&ws, Some(&a.target), None)?;
    // Flags left out keep the plan's Megatron-LM layout (an ILP plan's best one).
    let p = plan.estimate.layout;
    let (tp, pp, cp) = (
        a.tp.unwrap_or(p.tp),
        a.pp.unwrap_or(p.pp),
        a.cp.unwrap_or(p.cp),
    );
    let gpus = plan.cluster.gpus();
    let dp = match a.dp {
        Some(dp) => dp,
        None if (tp, pp, cp) == (p.tp, p.pp, p.cp) => p.dp,
        None if gpus % (tp * cp * pp) == 0 => gpus / (tp * cp * pp),
        None => {
            return Err(Failure::Input(anyhow::anyhow!(
                "--tp {tp} x --cp {cp} x --pp {pp}: expected a product that divides the {gpus} \
                 GPUs of `{}`, found {}; pass --dp, or degrees that fit",
                plan.cluster.name,
                tp * cp * pp
            )));
        }
    };
    let layout = Layout {
        cp,
        cp_comm: a.cp_comm_type.map_or(p.cp_comm, Into::into),
        ep: a.ep.unwrap_or(p.ep),
        etp: a.etp.unwrap_or(p.etp),
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
    let al = Components::of_estimate(&w.alternative);
    let _ = writeln!(
        s,
        "whatif {}: {} against the plan: {} ({} x {} {})",
        a.target,
        al.describe,
        w.plan.describe,
        plan.cluster.nodes,
        plan.cluster.gpus_per_node,
        plan.cluster.device.name
    );
    render::comparison(&mut s, ("plan", &w.plan), ("what-if", &al));
    if w.plan.space == Space::Ilp {
        let _ = writeln!(
            s,
            "  (the ILP pipeline's intra-stage communication is its op collectives and \
             resharding; its best Megatron-LM layout, {}, takes {:.3} s)",
            w.plan_layout.layout.describe(),
            w.plan_layout.step_time_s
        );
    }
    let _ = writeln!(s, "  => {}", w.reason);
    out!("{s}");
    Ok(())
}
