//! `autopar whatif`: a layout the user has in mind, priced for a target's model, cluster,
//! batch, training options and profile exactly as the build priced the target's plan, and set
//! beside the plan component by component.

use crate::EngineError;
use crate::workspace::Workspace;
use autopar_rules::plan::estimate::{Estimate, Estimator, MemoryBreakdown, TimeBreakdown};
use autopar_rules::plan::format::Plan;
use autopar_rules::plan::ilp::Space;
use autopar_rules::plan::layout::Layout;
use serde::Serialize;

/// The plan as it was chosen and the alternative, priced alike.
#[derive(Clone, Debug, Serialize)]
pub struct WhatIf {
    /// The plan as the build chose it: its ILP pipeline's components when it chose the ILP
    /// space, else its Megatron-LM layout's.
    pub plan: Components,
    /// The plan's Megatron-LM layout as the build priced it (for an ILP plan, the best
    /// Megatron-LM layout; the flags left out of `whatif` come from it).
    pub plan_layout: Estimate,
    /// The alternative layout, balanced and simulated as the build refines a layout.
    pub alternative: Estimate,
    /// Alternative less plan.
    pub delta: Delta,
    /// The main reason for the difference, in one line.
    pub reason: String,
}

/// A plan's or a layout's step and memory, component by component.
#[derive(Clone, Debug, Serialize)]
pub struct Components {
    /// Which space it comes from.
    pub space: Space,
    /// What is priced, in one line: a Megatron-LM layout, or the ILP pipeline.
    pub describe: String,
    /// Step time, s.
    pub step_time_s: f64,
    /// Where the step goes; the parts add up to it. For the ILP space, the tensor-parallel
    /// communication row holds the stage's op collectives and resharding.
    pub time: TimeBreakdown,
    /// Memory of the most loaded device, by component, bytes.
    pub memory: MemoryBreakdown,
    /// Memory of each stage's devices, by component, bytes.
    pub stage_memory: Vec<MemoryBreakdown>,
    /// Memory per device, GiB.
    pub memory_per_device_gib: f64,
    /// Usable memory per device, bytes.
    pub memory_capacity: f64,
    /// Whether it fits.
    pub fits: bool,
}

impl Components {
    /// A Megatron-LM layout's.
    pub fn of_estimate(e: &Estimate) -> Self {
        Components {
            space: Space::Megatron,
            describe: e.layout.describe(),
            step_time_s: e.step_time_s,
            time: e.time,
            memory: e.memory,
            stage_memory: e.stages.iter().map(|st| st.memory).collect(),
            memory_per_device_gib: e.memory_per_device_gib,
            memory_capacity: e.memory_capacity,
            fits: e.fits,
        }
    }

    /// The plan as the build chose it: its ILP pipeline when it chose the ILP space and the
    /// plan file records the pipeline's components, else its Megatron-LM layout.
    pub fn of_plan(plan: &Plan) -> Self {
        let ilp = plan
            .ilp
            .as_ref()
            .filter(|_| plan.space == Space::Ilp)
            .and_then(|p| {
                let stages: Option<Vec<MemoryBreakdown>> =
                    p.stages.iter().map(|s| s.memory).collect();
                Some((p, p.time()?, p.memory()?, stages?))
            });
        match ilp {
            Some((p, time, memory, stage_memory)) => Components {
                space: Space::Ilp,
                describe: format!("the ILP pipeline, {}", p.describe()),
                step_time_s: p.step_time_s,
                time,
                memory,
                stage_memory,
                memory_per_device_gib: p.memory_per_device_gib,
                memory_capacity: plan.estimate.memory_capacity,
                fits: true,
            },
            None => Components::of_estimate(&plan.estimate),
        }
    }
}

/// Alternative less plan, component by component.
#[derive(Clone, Debug, Serialize)]
pub struct Delta {
    /// Step time, s.
    pub step_time_s: f64,
    /// Per time component, s.
    pub time: TimeBreakdown,
    /// Per memory component of the most loaded device, bytes.
    pub memory: MemoryBreakdown,
    /// Memory per device, GiB.
    pub memory_per_device_gib: f64,
}

/// The time components, named for a reader.
pub fn time_components(t: &TimeBreakdown) -> [(&'static str, f64); 8] {
    [
        ("compute", t.compute),
        ("recomputation", t.recompute),
        (
            "intra-stage communication (TP, CP, EP, resharding)",
            t.tp_comm,
        ),
        ("pipeline transfers", t.p2p),
        ("ZeRO communication", t.zero_comm),
        ("pipeline bubble", t.bubble),
        ("gradient synchronisation", t.grad_sync),
        ("the optimizer step", t.optimizer),
    ]
}

/// The memory components, named for a reader (without their total).
pub fn memory_components(m: &MemoryBreakdown) -> [(&'static str, f64); 5] {
    [
        ("weights", m.weights),
        ("gradients", m.grads),
        ("optimizer states", m.optimizer),
        ("activations", m.activations),
        ("workspace", m.workspace),
    ]
}

fn time_delta(a: &TimeBreakdown, b: &TimeBreakdown) -> TimeBreakdown {
    TimeBreakdown {
        compute: a.compute - b.compute,
        recompute: a.recompute - b.recompute,
        tp_comm: a.tp_comm - b.tp_comm,
        p2p: a.p2p - b.p2p,
        zero_comm: a.zero_comm - b.zero_comm,
        bubble: a.bubble - b.bubble,
        grad_sync: a.grad_sync - b.grad_sync,
        optimizer: a.optimizer - b.optimizer,
    }
}

fn memory_delta(a: &MemoryBreakdown, b: &MemoryBreakdown) -> MemoryBreakdown {
    MemoryBreakdown {
        weights: a.weights - b.weights,
        grads: a.grads - b.grads,
        optimizer: a.optimizer - b.optimizer,
        activations: a.activations - b.activations,
        workspace: a.workspace - b.workspace,
        total: a.total - b.total,
    }
}

/// The size of a time difference for a reader.
fn secs(s: f64) -> String {
    autopar_rules::plan::format::secs(s.abs())
}

/// The one-line reason: the alternative does not fit, or the component that moved most.
fn reason(plan: &Components, alt: &Components, d: &TimeBreakdown) -> String {
    let name = &alt.describe;
    if !alt.fits {
        return format!(
            "{name} does not fit: it needs {:.1} GiB per device, the device has {:.1} GiB usable",
            alt.memory_per_device_gib,
            alt.memory_capacity / autopar_rules::cost::cluster::GIB
        );
    }
    if alt.space == plan.space && alt.describe == plan.describe {
        return format!("{name} is the plan's own layout");
    }
    let (component, by) = time_components(d)
        .into_iter()
        .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))
        .unwrap_or(("compute", 0.0));
    let overall = alt.step_time_s - plan.step_time_s;
    format!(
        "{name} is {} {} the plan; its largest change: {} {} in {component}",
        secs(overall),
        if overall >= 0.0 {
            "slower than"
        } else {
            "faster than"
        },
        if by >= 0.0 { "spends" } else { "saves" },
        if by >= 0.0 {
            format!("{} more", secs(by))
        } else {
            secs(by)
        }
    )
}

/// `b` less `a`, and the main reason for the difference (`a` read as the plan).
pub fn compare(a: &Components, b: &Components) -> (Delta, String) {
    let time = time_delta(&b.time, &a.time);
    let reason = reason(a, b, &time);
    (
        Delta {
            step_time_s: b.step_time_s - a.step_time_s,
            time,
            memory: memory_delta(&b.memory, &a.memory),
            memory_per_device_gib: b.memory_per_device_gib - a.memory_per_device_gib,
        },
        reason,
    )
}

/// Two stored plans set side by side.
#[derive(Clone, Debug, Serialize)]
pub struct PlanDiff {
    /// The inputs that differ (target, model, cluster, batch, training options, space).
    pub inputs: Vec<String>,
    /// Each plan's predicted step time (its ILP pipeline's where it chose one), s.
    pub step_time_s: [f64; 2],
    /// Each plan's space.
    pub space: [autopar_rules::plan::ilp::Space; 2],
    /// Each plan as the build chose it (its ILP pipeline or its Megatron-LM layout).
    pub plans: [Components; 2],
    /// B less A.
    pub delta: Delta,
    /// The main reason for the difference (A read as the plan).
    pub reason: String,
}

/// Plan `b` against plan `a`.
pub fn diff(a: &Plan, b: &Plan) -> PlanDiff {
    let mut inputs = Vec::new();
    let mut differ = |what: &str, x: String, y: String| {
        if x != y {
            inputs.push(format!("{what}: {x} -> {y}"));
        }
    };
    differ("target", a.target.clone(), b.target.clone());
    differ("model", a.model.name.clone(), b.model.name.clone());
    let cluster = |p: &Plan| {
        format!(
            "{} ({} x {} {})",
            p.cluster.name, p.cluster.nodes, p.cluster.gpus_per_node, p.cluster.device.name
        )
    };
    differ("cluster", cluster(a), cluster(b));
    differ(
        "global batch",
        a.estimate.layout.global_batch.to_string(),
        b.estimate.layout.global_batch.to_string(),
    );
    // Each training option that differs, by its name in the plan file.
    if let (Ok(serde_json::Value::Object(x)), Ok(serde_json::Value::Object(y))) = (
        serde_json::to_value(a.training),
        serde_json::to_value(b.training),
    ) {
        for (k, v) in &x {
            let w = y.get(k).map_or_else(|| "-".to_string(), |w| w.to_string());
            differ(&format!("training.{k}"), v.to_string(), w);
        }
    }
    differ("space", format!("{:?}", a.space), format!("{:?}", b.space));
    let plans = [Components::of_plan(a), Components::of_plan(b)];
    let (delta, reason) = compare(&plans[0], &plans[1]);
    PlanDiff {
        inputs,
        step_time_s: [a.step_time_s(), b.step_time_s()],
        space: [a.space, b.space],
        plans,
        delta,
        reason,
    }
}

/// Prices `layout` for target `target` of `ws`, whose current plan is `plan`, and compares.
pub fn whatif(
    ws: &Workspace,
    target: &str,
    plan: &Plan,
    layout: &Layout,
) -> Result<WhatIf, EngineError> {
    let t = ws.target(target).ok_or_else(|| EngineError::Unknown {
        what: "target",
        name: target.to_string(),
        expected: "a target of the workspace".into(),
    })?;
    let model = ws.plan_model(plan)?;
    let est = Estimator::new(&model.name, &model.def, &plan.cluster, plan.training)
        .with_profile(t.profile.as_deref());
    let alternative = est.refine(layout)?.estimate;
    let chosen = Components::of_plan(plan);
    let (delta, reason) = compare(&chosen, &Components::of_estimate(&alternative));
    Ok(WhatIf {
        reason,
        delta,
        plan: chosen,
        plan_layout: plan.estimate.clone(),
        alternative,
    })
}
