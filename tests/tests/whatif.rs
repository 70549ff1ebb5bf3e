//! `autopar whatif`: a layout priced as the build priced the target's plan, beside it.

use autopar_tests::TempWorkspace;

#[test]
fn a_layout_beside_the_plan_component_by_component() {
    let ws = TempWorkspace::default_copy();
    let b = ws.run(&["build", "tiny-llama-3d", "gpt3-175b"]);
    assert_eq!(b.code, 0, "{}", b.stderr);

    // The plan's own layout, priced again, is the plan to the last bit.
    let same = ws.run(&["whatif", "tiny-llama-3d", "--json"]);
    assert_eq!(same.code, 0, "{}", same.stderr);
    let j = same.json();
    assert_eq!(j["alternative"]["step_time_s"], j["plan"]["step_time_s"]);
    assert_eq!(j["delta"]["step_time_s"], 0.0);
    assert!(
        j["reason"]
            .as_str()
            .is_some_and(|r| r.contains("the plan's own layout"))
    );

    // Tensor parallelism of 1 at micro-batch 2: the flags left out keep the plan's, dp takes
    // the rest.
    let r = ws.run(&[
        "whatif",
        "tiny-llama-3d",
        "--tp",
        "1",
        "--mbs",
        "2",
        "--json",
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let j = r.json();
    let alt = &j["alternative"]["layout"];
    assert_eq!(
        (alt["tp"].as_u64(), alt["pp"].as_u64(), alt["dp"].as_u64()),
        (Some(1), Some(2), Some(4))
    );
    assert_eq!(alt["interleave"], j["plan_layout"]["layout"]["interleave"]);
    assert_eq!(j["plan"]["space"], "megatron");
    let step = |v: &serde_json::Value| v["step_time_s"].as_f64().unwrap_or(f64::NAN);
    let d = step(&j["alternative"]) - step(&j["plan"]);
    assert!(
        (step(&j["delta"]) - d).abs() <= 1e-12 * d.abs().max(1e-9),
        "{j}"
    );
    // The components add up to the step on both sides.
    let parts = |t: &serde_json::Value| -> f64 {
        [
            "compute",
            "recompute",
            "tp_comm",
            "p2p",
            "zero_comm",
            "bubble",
            "grad_sync",
            "optimizer",
        ]
        .iter()
        .map(|k| t[k].as_f64().unwrap_or(0.0))
        .sum()
    };
    for side in ["plan", "alternative"] {
        let total = parts(&j[side]["time"]);
        assert!(
            (total - step(&j[side])).abs() <= 1e-6 * total,
            "{side}: {j}"
        );
    }
    let text = ws.run(&["whatif", "tiny-llama-3d", "--tp", "1", "--mbs", "2"]);
    assert!(
        text.stdout
            .contains("intra-stage communication (TP, CP, EP, resharding)"),
        "{}",
        text.stdout
    );
    assert!(text.stdout.contains("=> tp1 pp2 dp4"), "{}", text.stdout);

    // Tensor parallelism of 8 without stages does not fit GPT-3 175B: said plainly.
    let big = ws.run(&["whatif", "gpt3-175b", "--tp", "8", "--pp", "1"]);
    assert_eq!(big.code, 0, "{}", big.stderr);
    assert!(
        big.stdout.contains("does not fit: it needs"),
        "{}",
        big.stdout
    );

    // Two plan files side by side.
    let same = ws.run(&[
        "plan",
        "diff",
        "plans/tiny-llama-3d.json",
        "plans/tiny-llama-3d.json",
        "--json",
    ]);
    assert_eq!(same.code, 0, "{}", same.stderr);
    assert_eq!(same.json()["inputs"], serde_json::json!([]));
    assert_eq!(same.json()["delta"]["step_time_s"], 0.0);
    let d = ws.run(&[
        "plan",
        "diff",
        "plans/tiny-llama-3d.json",
        "plans/gpt3-175b.json",
        "--json",
    ]);
    assert_eq!(d.code, 0, "{}", d.stderr);
    let j = d.json();
    let inputs: Vec<&str> = j["inputs"]
        .as_array()
        .expect("inputs")
        .iter()
        .filter_map(serde_json::Value::as_str)
        .collect();
    assert!(
        inputs.contains(&"model: tiny-llama -> gpt3-175b"),
        "{inputs:?}"
    );
    assert!(inputs.contains(&"training.seq: 128 -> 2048"), "{inputs:?}");
    let steps = j["step_time_s"].as_array().expect("steps");
    let (a, b) = (
        steps[0].as_f64().unwrap_or(0.0),
        steps[1].as_f64().unwrap_or(0.0),
    );
    assert!((j["delta"]["step_time_s"].as_f64().unwrap_or(0.0) - (b - a)).abs() < 1e-9);
    let text = ws.run(&[
        "plan",
        "diff",
        "plans/tiny-llama-3d.json",
        "plans/gpt3-175b.json",
    ]);
    assert!(text.stdout.contains("memory per device"), "{}", text.stdout);
    let missing = ws.run(&["plan", "diff", "plans/tiny-llama-3d.json", "nope.json"]);
    assert_eq!(missing.code, 2, "{}", missing.stderr);

    // Bad input.
    let odd = ws.run(&["whatif", "tiny-llama-3d", "--tp", "3"]);
    assert_eq!(odd.code, 2, "{}", odd.stderr);
    assert!(odd.stderr.contains("--tp 3"), "{}", odd.stderr);
    assert_eq!(ws.run(&["whatif", "nope"]).code, 2);
}

/// A plan of the ILP space is set beside the layout as the build chose it: its pipeline's
/// components (the slowest stage's kernels, op collectives with resharding, transfers, the
/// bubble, gradient synchronisation, optimizer; the most loaded stage's memory), which add up
/// to its step and its memory, not its best Megatron-LM layout's.
#[test]
fn an_ilp_plan_is_compared_as_chosen() {
    let ws = TempWorkspace::default_copy();
    let b = ws.run(&["build", "tiny-llama-cpu-stages"]);
    assert_eq!(b.code, 0, "{}", b.stderr);
    let plan: serde_json::Value =
        serde_json::from_str(&ws.read("plans/tiny-llama-cpu-stages.json")).expect("plan file");
    assert_eq!(plan["space"], "ilp");
    let r = ws.run(&["whatif", "tiny-llama-cpu-stages", "--json"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let j = r.json();
    let num = |v: &serde_json::Value| v.as_f64().unwrap_or(f64::NAN);
    assert_eq!(j["plan"]["space"], "ilp");
    assert_eq!(j["plan"]["step_time_s"], plan["ilp"]["step_time_s"]);
    assert_eq!(
        j["plan"]["memory_per_device_gib"],
        plan["ilp"]["memory_per_device_gib"]
    );
    let step = num(&j["plan"]["step_time_s"]);
    let parts: f64 = j["plan"]["time"]
        .as_object()
        .expect("time")
        .values()
        .map(num)
        .sum();
    assert!(
        (parts - step).abs() <= 1e-9 * step,
        "{parts} vs {step}: {j}"
    );
    let m = &j["plan"]["memory"];
    let sum: f64 = ["weights", "grads", "optimizer", "activations", "workspace"]
        .iter()
        .map(|k| num(&m[*k]))
        .sum();
    assert!((sum - num(&m["total"])).abs() <= 1e-6 * sum, "{j}");
    assert!(
        (num(&m["total"]) / (1u64 << 30) as f64 - num(&j["plan"]["memory_per_device_gib"])).abs()
            < 1e-9,
        "{j}"
    );
    // The alternative (the plan's best Megatron-LM layout, flags left out) less the ILP plan.
    let d = num(&j["alternative"]["step_time_s"]) - step;
    assert!((num(&j["delta"]["step_time_s"]) - d).abs() <= 1e-12, "{j}");
    assert_eq!(j["alternative"]["layout"], j["plan_layout"]["layout"]);
    let text = ws.run(&["whatif", "tiny-llama-cpu-stages"]);
    assert_eq!(text.code, 0, "{}", text.stderr);
    assert!(
        text.stdout
            .contains("against the plan: the ILP pipeline, micro-batch"),
        "{}",
        text.stdout
    );
}
