//! Benchmark of the build system on the GPT-3 175B target of the default workspace: a cold
//! build, no-op rebuilds, and a rebuild after the model grows from 96 to 104 layers. Prints a
//! table of wall time, results solved and peak memory of each `autopar build` process.
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
    rss_mib: f64,
}

fn build(ws: &TempWorkspace) -> Result<Row, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let start = Instant::now();
    let out = Command::new(exe)
        .args([AS_AUTOPAR, "build", "gpt3-175b", "--json"])
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
    let ws = TempWorkspace::default_copy();
    let mut rows = Vec::new();
    let mut step = |phase: &str| -> Result<(), String> {
        let mut row = build(&ws)?;
        row.phase = phase.to_string();
        rows.push(row);
        Ok(())
    };
    let result = (|| {
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
        Ok::<(), String>(())
    })();
    if let Err(e) = result {
        eprintln!("error: {e}");
        return ExitCode::FAILURE;
    }
    println!(
        "autopar build gpt3-175b (128 x 8 A100-80GB), {}",
        repo_root().display()
    );
    println!(
        "{:<24} {:>10} {:>8} {:>10}",
        "phase", "wall", "solved", "peak RSS"
    );
    for r in &rows {
        println!(
            "{:<24} {:>8.3} s {:>8} {:>6.1} MiB",
            r.phase, r.wall_s, r.solved, r.rss_mib
        );
    }
    let mut noop: Vec<f64> = rows
        .iter()
        .filter(|r| r.phase.starts_with("no-op"))
        .map(|r| r.wall_s)
        .collect();
    noop.sort_by(f64::total_cmp);
    println!("no-op median: {:.3} s", noop[noop.len() / 2]);
    ExitCode::SUCCESS
}
