//! Benchmark of the build system on the GPT-3 175B target of the default workspace, then on the
//! whole default workspace (the ILP space's tables and stage DPs included), then on the default
//! workspace with every target searching both spaces (`space = "both"`; GPT-3's 128 nodes with
//! `submeshes = "powers-of-two"`): a cold build, no-op rebuilds, and a rebuild after GPT-3
//! grows from 96 to 104 layers. Prints a table of wall time, results solved (all, then
//! `sharding` tables and `stages` DPs) and peak memory of each `autopar build` process.
//!
//! `cargo run --release -p autopar-tests --bin autopar-bench-incremental`

use autopar_tests::{TempWorkspace, repo_root};
use std::process::{Command, ExitCode};
use std::time::Instant;

/// Run as `autopar` itself when asked (so the benchmark times a separate process).
const AS_AUTOPAR: &str = "--as-autopar";

struct Row {
    phase: String,
    wall_s: f64,
    solved: u64,
    tables: u64,
    stages: u64,
    rss_mib: f64,
}

fn build(ws: &TempWorkspace, targets: &[&str]) -> Result<Row, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let start = Instant::now();
    let out = Command::new(exe)
        .args([AS_AUTOPAR, "build", "--json"])
        .args(targets)
        .current_dir(ws.path())
        .env_remove("AUTOPAR_CACHE_DIR")
        .output()
        .map_err(|e| e.to_string())?;
    let wall_s = start.elapsed().as_secs_f64();
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let j: serde_json::Value =
        serde_json::from_slice(&out.stdout).map_err(|e| format!("report is not JSON: {e}"))?;
    Ok(Row {
        phase: String::new(),
        wall_s,
        solved: j["solved"].as_u64().unwrap_or(0),
        tables: j["kinds"]["sharding"]["solved"].as_u64().unwrap_or(0),
        stages: j["kinds"]["stages"]["solved"].as_u64().unwrap_or(0),
        rss_mib: j["peak_rss_bytes"].as_f64().unwrap_or(f64::NAN) / (1024.0 * 1024.0),
    })
}

fn main() -> ExitCode {
    let mut args = std::env::args_os();
    let _ = args.next();
    if args.next().is_some_and(|a| a == AS_AUTOPAR) {
        let rest = std::iter::once("autopar".into()).chain(args);
        return autopar_cli::run(rest);
    }
    for (title, targets, every_space) in [
        (
            "autopar build gpt3-175b (128 x 8 A100-80GB)",
            &["gpt3-175b"][..],
            false,
        ),
        (
            "autopar build (every target of the default workspace)",
            &[][..],
            false,
        ),
        (
            "autopar build (every target of the default workspace, space = \"both\")",
            &[][..],
            true,
        ),
    ] {
        match phases(targets, every_space) {
            Ok(rows) => print(title, &rows),
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}

/// Cold build, five no-op rebuilds and the 96 -> 104 edit of `targets` (all when empty) in a
/// fresh copy of the default workspace (every target searching both spaces when
/// `every_space`).
fn phases(targets: &[&str], every_space: bool) -> Result<Vec<Row>, String> {
    let ws = TempWorkspace::default_copy();
    if every_space {
        ws.write("workspace.toml", &both_spaces(&ws.read("workspace.toml"))?);
    }
    let mut rows = Vec::new();
    let mut step = |phase: &str| -> Result<(), String> {
        let mut row = build(&ws, targets)?;
        row.phase = phase.to_string();
        rows.push(row);
        Ok(())
    };
    step("cold (empty cache)")?;
    for i in 1..=5 {
        step(&format!("no-op #{i}"))?;
    }
    let model = ws.read("models/gpt3-175b.json");
    ws.write(
        "models/gpt3-175b.json",
        &model.replace("\"n_layer\": 96", "\"n_layer\": 104"),
    );
    step("after 96 -> 104 layers")?;
    Ok(rows)
}

/// The workspace `text` with every target searching both spaces, and targets on more than 16
/// nodes using multi-node submeshes of 2, 4, 8 ... nodes only.
fn both_spaces(text: &str) -> Result<String, String> {
    let mut ws: toml::Table = toml::from_str(text).map_err(|e| e.to_string())?;
    let nodes: std::collections::HashMap<String, i64> = ws
        .get("cluster")
        .and_then(|c| c.as_array())
        .into_iter()
        .flatten()
        .filter_map(|c| {
            let name = c.get("name")?.as_str()?.to_string();
            Some((
                name,
                c.get("nodes").and_then(|n| n.as_integer()).unwrap_or(1),
            ))
        })
        .collect();
    let targets = ws
        .get_mut("target")
        .and_then(|t| t.as_array_mut())
        .ok_or("the workspace has no targets")?;
    for t in targets.iter_mut().filter_map(|t| t.as_table_mut()) {
        t.insert("space".into(), "both".into());
        let cluster = t.get("cluster").and_then(|c| c.as_str()).unwrap_or("");
        if nodes.get(cluster).is_some_and(|&n| n > 16) {
            let search = t
                .entry("search")
                .or_insert_with(|| toml::Table::new().into());
            if let Some(search) = search.as_table_mut() {
                search.insert("submeshes".into(), "powers-of-two".into());
            }
        }
    }
    toml::to_string(&ws).map_err(|e| e.to_string())
}

fn print(title: &str, rows: &[Row]) {
    println!("{title}, {}", repo_root().display());
    println!(
        "{:<24} {:>10} {:>8} {:>8} {:>8} {:>10}",
        "phase", "wall", "solved", "tables", "DPs", "peak RSS"
    );
    for r in rows {
        println!(
            "{:<24} {:>8.3} s {:>8} {:>8} {:>8} {:>6.1} MiB",
            r.phase, r.wall_s, r.solved, r.tables, r.stages, r.rss_mib
        );
    }
    let mut noop: Vec<f64> = rows
        .iter()
        .filter(|r| r.phase.starts_with("no-op"))
        .map(|r| r.wall_s)
        .collect();
    noop.sort_by(f64::total_cmp);
    if let Some(median) = noop.get(noop.len() / 2) {
        println!("no-op median: {median:.3} s\n");
    }
}
