//! `autopar report`: a plan as one self-contained HTML page, charts drawn as inline SVG (no
//! script, no style sheet or font fetched from anywhere): the step-time breakdown, memory per
//! stage against capacity, the simulated pipeline schedule, the layouts searched, the layer
//! split per stage and what the last build recomputed.

use crate::render::{layout_line, secs, thousands};
use autopar_engine::whatif::{Components, memory_components, time_components};
use autopar_rules::cost::cluster::GIB;
use autopar_rules::plan::estimate::{Estimate, MemoryBreakdown, TimeBreakdown};
use autopar_rules::plan::format::Plan;
use autopar_rules::plan::ilp::Space;
use autopar_rules::solve::schedule::{BlockKind, Simulation, shown_spec, simulate};
use std::fmt::Write;

/// Most blocks the schedule chart draws (the page stays light; the trace file has the rest).
const MAX_DRAWN_BLOCKS: usize = 4096;

/// Chart width, px.
const WIDTH: f64 = 960.0;

/// Colours of the time and memory components, in their order.
const PALETTE: [&str; 8] = [
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#9c755f",
];

/// Text for HTML: `&`, `<`, `>` and quotes escaped.
fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
        .replace('\'', "&#39;")
}

/// The report of `plan`; `explain`: what the last build recomputed, as `autopar explain` says.
pub fn html(plan: &Plan, explain: Option<&str>) -> String {
    let e = &plan.estimate;
    let mut s = String::new();
    let title = format!("autopar plan: {}", plan.target);
    let _ = write!(
        s,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <title>{}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n<h1>{}</h1>\n",
        esc(&title),
        esc(&title)
    );
    summary(&mut s, plan);
    // The step and memory charts show the plan as chosen: an ILP plan's own pipeline.
    let chosen = Components::of_plan(plan);
    let _ = writeln!(s, "<h2>Step time</h2>");
    step_breakdown(&mut s, &chosen.time);
    let _ = writeln!(s, "<h2>Memory per device, by stage</h2>");
    memory_bars(
        &mut s,
        &chosen.stage_memory,
        &chosen.memory,
        chosen.memory_capacity,
    );
    let _ = writeln!(s, "<h2>Pipeline schedule</h2>");
    schedule(&mut s, e);
    let _ = writeln!(s, "<h2>Layouts searched</h2>");
    scatter(&mut s, plan);
    let _ = writeln!(s, "<h2>Layers per stage</h2>");
    split_table(&mut s, e);
    if let Some(text) = explain {
        let _ = writeln!(
            s,
            "<h2>What the last build recomputed</h2>\n<pre>{}</pre>",
            esc(text)
        );
    }
    let _ = writeln!(
        s,
        "<footer>autopar {} · rules {}</footer>\n</body>\n</html>",
        env!("CARGO_PKG_VERSION"),
        esc(&plan.rules_version)
    );
    s
}

const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:24px;max-width:1000px;color:#222}\
h1{font-size:22px}h2{font-size:17px;margin-top:28px}\
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}\
th{background:#f3f3f3}pre{background:#f6f6f6;padding:10px;font-size:12px;overflow-x:auto}\
.legend span{display:inline-block;margin-right:14px;font-size:12px}\
.legend i{display:inline-block;width:11px;height:11px;margin-right:4px;vertical-align:-1px}\
svg{display:block;margin:6px 0}svg text{font-size:11px;fill:#333}footer{margin-top:30px;font-size:11px;color:#777}";

fn summary(s: &mut String, plan: &Plan) {
    let e = &plan.estimate;
    let c = &plan.cluster;
    let rows = [
        (
            "model",
            format!(
                "{} ({:.2} B parameters, {} blocks)",
                plan.model.name,
                plan.model.parameters as f64 / 1e9,
                plan.model.blocks
            ),
        ),
        (
            "cluster",
            format!(
                "{} ({} x {} {})",
                c.name, c.nodes, c.gpus_per_node, c.device.name
            ),
        ),
        (
            "batch",
            format!(
                "{} sequences x {} tokens",
                e.layout.global_batch, plan.training.seq
            ),
        ),
        ("layout", layout_line(&e.layout, e.num_microbatches, None)),
        (
            "step",
            format!(
                "{} · {} tokens/s · {:.1} TFLOP/s per GPU · MFU {:.1}%",
                secs(e.step_time_s),
                thousands(e.tokens_per_s),
                e.tflops_per_gpu,
                e.mfu * 100.0
            ),
        ),
        (
            "memory",
            format!(
                "{:.1} GiB per device (stage {}) of {:.1} GiB usable{}",
                e.memory_per_device_gib,
                e.peak_memory_stage,
                e.memory_capacity / GIB,
                if e.fits { "" } else { ": does not fit" }
            ),
        ),
        (
            "space",
            match (&plan.space, &plan.ilp) {
                (Space::Ilp, Some(ilp)) => format!(
                    "the ILP space's pipeline wins: {}, {} per step; the step and memory charts \
                     show it, the schedule, layouts and layers per stage the best Megatron-LM \
                     layout",
                    ilp.describe(),
                    secs(ilp.step_time_s)
                ),
                _ => "Megatron-LM's layouts".into(),
            },
        ),
    ];
    let _ = writeln!(s, "<table>");
    for (k, v) in rows {
        let _ = writeln!(s, "<tr><th>{k}</th><td>{}</td></tr>", esc(&v));
    }
    let _ = writeln!(s, "</table>");
}

/// A legend of coloured boxes: colour, name, value.
fn legend(s: &mut String, items: &[(&str, &str, String)]) {
    let _ = write!(s, "<div class=\"legend\">");
    for (colour, name, value) in items {
        let _ = write!(
            s,
            "<span><i style=\"background:{colour}\"></i>{} {}</span>",
            esc(name),
            esc(value)
        );
    }
    let _ = writeln!(s, "</div>");
}

fn step_breakdown(s: &mut String, time: &TimeBreakdown) {
    let parts = time_components(time);
    let total: f64 = parts
        .iter()
        .map(|p| p.1)
        .sum::<f64>()
        .max(f64::MIN_POSITIVE);
    let h = 34.0;
    let _ = writeln!(
        s,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{h}\" \
         role=\"img\" aria-label=\"step time breakdown\">"
    );
    let mut x = 0.0;
    for (i, (name, v)) in parts.iter().enumerate() {
        let w = v / total * WIDTH;
        if w > 0.0 {
            let _ = writeln!(
                s,
                "<rect x=\"{x:.2}\" y=\"4\" width=\"{w:.2}\" height=\"26\" fill=\"{}\">\
                 <title>{}: {}</title></rect>",
                PALETTE[i],
                esc(name),
                secs(*v)
            );
        }
        x += w;
    }
    let _ = writeln!(s, "</svg>");
    let items: Vec<(&str, &str, String)> = parts
        .iter()
        .enumerate()
        .map(|(i, (n, v))| (PALETTE[i], *n, secs(*v)))
        .collect();
    legend(s, &items);
}

/// Stacked bars of each stage's memory by component against the usable `capacity` (bytes);
/// the legend gives the `peak` stage's figures.
fn memory_bars(s: &mut String, stages: &[MemoryBreakdown], peak: &MemoryBreakdown, capacity: f64) {
    let cap = capacity / GIB;
    let top = stages
        .iter()
        .map(|st| st.total / GIB)
        .fold(cap, f64::max)
        .max(f64::MIN_POSITIVE)
        * 1.08;
    let (h, left, bottom) = (240.0, 48.0, 22.0);
    let n = stages.len().max(1) as f64;
    let slot = (WIDTH - left) / n;
    let bar = (slot * 0.7).min(60.0);
    let y = |gib: f64| (h - bottom) * (1.0 - gib / top);
    let _ = writeln!(
        s,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{h}\" \
         role=\"img\" aria-label=\"memory per device by stage\">"
    );
    for k in 0..=4 {
        let g = top / 1.08 * k as f64 / 4.0;
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{g:.0} GiB</text>",
            left - 4.0,
            y(g) + 4.0
        );
    }
    for (j, st) in stages.iter().enumerate() {
        let x = left + slot * j as f64 + (slot - bar) / 2.0;
        let mut acc = 0.0;
        for (i, (name, b)) in memory_components(st).iter().enumerate() {
            let g = b / GIB;
            if g <= 0.0 {
                continue;
            }
            let _ = writeln!(
                s,
                "<rect x=\"{x:.2}\" y=\"{:.2}\" width=\"{bar:.2}\" height=\"{:.2}\" fill=\"{}\">\
                 <title>stage {j} {name}: {g:.2} GiB</title></rect>",
                y(acc + g),
                y(acc) - y(acc + g),
                PALETTE[i]
            );
            acc += g;
        }
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">stage {j}</text>",
            x + bar / 2.0,
            h - 6.0
        );
    }
    let _ = writeln!(
        s,
        "<line x1=\"{left}\" x2=\"{WIDTH}\" y1=\"{c:.2}\" y2=\"{c:.2}\" stroke=\"#c00\" \
         stroke-dasharray=\"6 4\"/><text x=\"{WIDTH}\" y=\"{:.2}\" text-anchor=\"end\" \
         fill=\"#c00\">usable {cap:.1} GiB</text>",
        y(cap) - 4.0,
        c = y(cap)
    );
    let _ = writeln!(s, "</svg>");
    // The legend's figures are the peak stage's.
    let items: Vec<(&str, &str, String)> = memory_components(peak)
        .iter()
        .enumerate()
        .map(|(i, (n, b))| (PALETTE[i], *n, format!("{:.1} GiB", b / GIB)))
        .collect();
    legend(s, &items);
}

fn schedule(s: &mut String, e: &Estimate) {
    let spec = e.pipeline_spec();
    let shown = shown_spec(&spec, MAX_DRAWN_BLOCKS);
    let sim: Simulation = match simulate(&shown) {
        Ok(sim) => sim,
        Err(err) => {
            let _ = writeln!(
                s,
                "<p>The schedule cannot be simulated: {}</p>",
                esc(&err.to_string())
            );
            return;
        }
    };
    let stages = sim.peak_activation.len().max(1);
    let (row, left, axis) = (26.0, 60.0, 20.0);
    let h = row * stages as f64 + axis;
    let span = sim.makespan.max(f64::MIN_POSITIVE);
    let x = |t: f64| left + t / span * (WIDTH - left);
    let _ = writeln!(
        s,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{h}\" \
         role=\"img\" aria-label=\"pipeline schedule\">"
    );
    for j in 0..stages {
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">stage {j}</text>",
            left - 6.0,
            row * j as f64 + row * 0.65
        );
    }
    for b in &sim.blocks {
        let (fill, letter) = match b.kind {
            BlockKind::Forward => (PALETTE[0], "F"),
            BlockKind::Backward => (PALETTE[4], "B"),
        };
        let _ = writeln!(
            s,
            "<rect x=\"{:.2}\" y=\"{:.1}\" width=\"{:.2}\" height=\"{:.1}\" fill=\"{fill}\" \
             stroke=\"#fff\" stroke-width=\"0.5\"><title>{letter}{} chunk {}: {} to {}</title></rect>",
            x(b.start),
            row * b.stage as f64 + 3.0,
            (x(b.end) - x(b.start)).max(0.5),
            row - 6.0,
            b.microbatch,
            b.chunk,
            secs(b.start),
            secs(b.end)
        );
    }
    let _ = writeln!(
        s,
        "<text x=\"{left}\" y=\"{:.1}\">0</text><text x=\"{WIDTH}\" y=\"{:.1}\" \
         text-anchor=\"end\">{}</text>",
        h - 4.0,
        h - 4.0,
        secs(sim.makespan)
    );
    let _ = writeln!(s, "</svg>");
    legend(
        s,
        &[
            (PALETTE[0], "forward", String::new()),
            (
                PALETTE[4],
                "backward (with its recomputation)",
                String::new(),
            ),
        ],
    );
    if shown.microbatches < spec.microbatches {
        let _ = writeln!(
            s,
            "<p>{} of the step's {} micro-batches shown (the trace file has more).</p>",
            shown.microbatches, spec.microbatches
        );
    }
}

fn scatter(s: &mut String, plan: &Plan) {
    let e = &plan.estimate;
    let cap = e.memory_capacity / GIB;
    let chosen = [e.step_time_s, e.memory_per_device_gib];
    let next: Vec<[f64; 2]> = plan
        .alternatives
        .iter()
        .map(|a| [a.step_time_s, a.memory_per_device_gib])
        .collect();
    let all = plan.searched.iter().chain(&next).chain([&chosen]);
    let finite = |v: f64| v.is_finite() && v > 0.0;
    let (mut tmin, mut tmax, mut mmax) = (f64::INFINITY, 0.0f64, cap);
    for p in all {
        if finite(p[0]) && finite(p[1]) {
            tmin = tmin.min(p[0]);
            tmax = tmax.max(p[0]);
            mmax = mmax.max(p[1]);
        }
    }
    if !tmin.is_finite() {
        let _ = writeln!(s, "<p>No layout of the search could run.</p>");
        return;
    }
    // Step times often span orders of magnitude: a log axis when they do.
    let log = tmax / tmin > 20.0;
    let ty = |t: f64| if log { t.ln() } else { t };
    let (lo, hi) = (ty(tmin), ty(tmax));
    let range = (hi - lo).max(f64::MIN_POSITIVE);
    let (h, left, bottom) = (320.0, 60.0, 26.0);
    // Layouts far beyond the device (three times its memory) sit on the right edge.
    let mtop = mmax.min(3.0 * cap).max(chosen[1]) * 1.05;
    let beyond = plan.searched.iter().filter(|p| p[1] > mtop).count();
    let px = |gib: f64| left + gib.min(mtop) / mtop * (WIDTH - left - 10.0);
    let py = |t: f64| 8.0 + (h - bottom - 16.0) * (1.0 - (ty(t) - lo) / range);
    let _ = writeln!(
        s,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{h}\" \
         role=\"img\" aria-label=\"layouts searched: step time against memory\">"
    );
    for p in &plan.searched {
        if !(finite(p[0]) && finite(p[1])) {
            continue;
        }
        let fill = if p[1] <= cap { "#9aa7b8" } else { "#e8b4b4" };
        let _ = writeln!(
            s,
            "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"2\" fill=\"{fill}\"/>",
            px(p[1]),
            py(p[0])
        );
    }
    for p in &next {
        let _ = writeln!(
            s,
            "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"5\" fill=\"{}\"><title>next best: {} at \
             {:.1} GiB</title></circle>",
            px(p[1]),
            py(p[0]),
            PALETTE[1],
            secs(p[0]),
            p[1]
        );
    }
    let _ = writeln!(
        s,
        "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"7\" fill=\"{}\" stroke=\"#000\"><title>chosen: {} \
         at {:.1} GiB</title></circle>",
        px(chosen[1]),
        py(chosen[0]),
        PALETTE[2],
        esc(&e.layout.describe()),
        chosen[1]
    );
    let _ = writeln!(
        s,
        "<line x1=\"{c:.1}\" x2=\"{c:.1}\" y1=\"0\" y2=\"{:.1}\" stroke=\"#c00\" \
         stroke-dasharray=\"6 4\"/>",
        h - bottom,
        c = px(cap)
    );
    let _ = writeln!(
        s,
        "<text x=\"{left}\" y=\"{:.1}\">memory per device, GiB (0 to {mtop:.0}; dashed: usable \
         {cap:.1})</text><text x=\"4\" y=\"14\">{}</text><text x=\"4\" y=\"{:.1}\">{}</text>",
        h - 6.0,
        secs(tmax),
        h - bottom - 8.0,
        secs(tmin)
    );
    let _ = writeln!(s, "</svg>");
    let _ = writeln!(
        s,
        "<p>Step time ({} scale) against memory per device of the {} layouts that can run, as \
         screened (layers split evenly); grey: fits, pink: does not; orange: the next best and \
         red: the chosen layout, as refined.{}</p>",
        if log { "log" } else { "linear" },
        plan.searched.len(),
        if beyond > 0 {
            format!(
                " {beyond} layouts needing more than {mtop:.0} GiB are drawn at the right edge."
            )
        } else {
            String::new()
        }
    );
}

fn split_table(s: &mut String, e: &Estimate) {
    let _ = writeln!(
        s,
        "<table><tr><th>stage</th><th>chunks (layers, blocks, recomputed)</th><th>time per \
         micro-batch</th><th>in flight</th><th>memory</th></tr>"
    );
    for st in &e.stages {
        let chunks = st
            .chunks
            .iter()
            .map(|c| {
                format!(
                    "{}..{} ({} blocks{})",
                    c.first_name,
                    c.last_name,
                    c.blocks,
                    if c.full_recompute > 0 {
                        format!(", {} recomputed", c.full_recompute)
                    } else {
                        String::new()
                    }
                )
            })
            .collect::<Vec<_>>()
            .join("; ");
        let _ = writeln!(
            s,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{:.1}</td><td>{:.1} GiB</td></tr>",
            st.index,
            esc(&chunks),
            secs(st.per_microbatch_s),
            st.inflight_microbatches,
            st.memory.total / GIB
        );
    }
    let _ = writeln!(s, "</table>");
}
