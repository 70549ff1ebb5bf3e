//! The simulated timeline as a Chrome trace (`chrome://tracing`, Perfetto): one track per
//! pipeline stage, one slice per forward or backward block.

use super::Schedule;
use super::simulate::{BlockKind, PipelineSpec, Simulation};
use serde_json::{Value, json};

/// Most blocks a trace shows (about 5 MiB of JSON; more only slows a viewer down).
pub const MAX_TRACE_BLOCKS: usize = 1 << 15;

/// The step `spec` describes, with fewer micro-batches when its timeline would have more than
/// [`MAX_TRACE_BLOCKS`] blocks: the same warm-up, steady state and drain, with as many
/// micro-batches modulo the stages (at least one round), so interleaving stays valid.
pub fn trace_spec(spec: &PipelineSpec) -> PipelineSpec {
    shown_spec(spec, MAX_TRACE_BLOCKS)
}

/// [`trace_spec`] for a picture of at most `max_blocks` blocks (at least one round of
/// micro-batches).
pub fn shown_spec(spec: &PipelineSpec, max_blocks: usize) -> PipelineSpec {
    let (v, p) = (spec.forward.len(), spec.forward.first().map_or(1, Vec::len));
    let per_microbatch = 2 * p.max(1) * v.max(1);
    let m = spec.microbatches;
    if m.saturating_mul(per_microbatch) <= max_blocks {
        return spec.clone();
    }
    let most = (max_blocks / per_microbatch).max(p);
    let round = if spec.schedule == Schedule::OneFOneB && v > 1 {
        p
    } else {
        1
    };
    PipelineSpec {
        microbatches: (most - most % round).max(round),
        ..spec.clone()
    }
}

/// The timeline of `sim` in the Trace Event Format, times in microseconds.
pub fn chrome_trace(sim: &Simulation, title: &str) -> Value {
    let stages = sim.peak_activation.len();
    let mut events: Vec<Value> = Vec::with_capacity(sim.blocks.len() + stages + 1);
    events.push(json!({
        "name": "process_name", "ph": "M", "pid": 0, "tid": 0,
        "args": { "name": title },
    }));
    for j in 0..stages {
        events.push(json!({
            "name": "thread_name", "ph": "M", "pid": 0, "tid": j,
            "args": { "name": format!("stage {j}") },
        }));
    }
    for b in &sim.blocks {
        let (letter, cat) = match b.kind {
            BlockKind::Forward => ("F", "forward"),
            BlockKind::Backward => ("B", "backward"),
        };
        events.push(json!({
            "name": format!("{letter}{} c{}", b.microbatch, b.chunk),
            "cat": cat,
            "ph": "X",
            "pid": 0,
            "tid": b.stage,
            "ts": b.start * 1e6,
            "dur": (b.end - b.start) * 1e6,
            "args": { "microbatch": b.microbatch, "chunk": b.chunk },
        }));
    }
    json!({ "traceEvents": events, "displayTimeUnit": "ms" })
}

#[cfg(test)]
mod tests {
    use super::super::{PipelineSpec, Schedule, simulate};
    use super::*;

    #[test]
    fn one_slice_per_block_and_one_track_per_stage() {
        let spec = PipelineSpec {
            schedule: Schedule::OneFOneB,
            microbatches: 4,
            forward: vec![vec![1e-3; 2]],
            backward: vec![vec![2e-3; 2]],
            recompute: vec![vec![0.0; 2]],
            activation: vec![vec![1.0; 2]],
        };
        let sim = simulate(&spec).expect("simulates");
        let trace = chrome_trace(&sim, "t");
        let events = trace["traceEvents"].as_array().expect("events");
        let slices: Vec<&Value> = events.iter().filter(|e| e["ph"] == "X").collect();
        assert_eq!(slices.len(), 2 * 4 * 2);
        assert_eq!(
            events.iter().filter(|e| e["name"] == "thread_name").count(),
            2
        );
        let last_end = slices
            .iter()
            .map(|e| e["ts"].as_f64().unwrap_or(0.0) + e["dur"].as_f64().unwrap_or(0.0))
            .fold(0.0, f64::max);
        assert!((last_end - sim.makespan * 1e6).abs() < 1e-6);
    }
}
