//! The GPU presets' matmul efficiencies are not microbenchmark numbers but a fit to published
//! end-to-end runs by a fixed rule (`rules/src/cost/cluster.rs`, `AMPERE_MATMUL_EFFICIENCY`): this
//! repeats the fit on MosaicML's MPT throughput tables and checks that the shipped constants
//! are its result, then prints every published row's error with the shipped constants. Run
//! with `--nocapture` to see the tables.

use autopar_engine::executor::median;
use autopar_rules::cost::cluster::{AMPERE_MATMUL_EFFICIENCY, HOPPER_MATMUL_EFFICIENCY};
use autopar_tests::TempWorkspace;
use autopar_tests::mosaicml::{ROWS, Row};

/// The published runs on GPUs of one generation (the presets that share a matmul efficiency).
fn rows_on(gpus: &[&str]) -> Vec<Row> {
    ROWS.iter()
        .filter(|r| gpus.contains(&r.gpu))
        .copied()
        .collect()
}

/// Name of the cluster of `row`'s nodes in the calibration workspace.
fn cluster_name(row: &Row) -> String {
    format!("{}-{}x8", row.gpu, row.nodes())
}

/// Writes a workspace with a cluster for every (GPU, node count) of `rows`, with the matmul
/// efficiency overridden when `efficiency` is given.
fn write_workspace(ws: &TempWorkspace, rows: &[Row], efficiency: Option<f64>) {
    let mut toml = String::new();
    let mut seen = Vec::new();
    for row in rows {
        let name = cluster_name(row);
        if seen.contains(&name) {
            continue;
        }
        toml += &format!(
            "[[cluster]]\nname = \"{name}\"\npreset = \"{}\"\nnodes = {}\ngpus_per_node = 8\n",
            row.gpu,
            row.nodes()
        );
        if let Some(e) = efficiency {
            toml += &format!("overrides = {{ matmul_efficiency = {e} }}\n");
        }
        toml += "\n";
        seen.push(name);
    }
    ws.write("workspace.toml", &toml);
}

/// Relative error of autopar's tokens/s per GPU against the published figure, per row.
fn errors(ws: &TempWorkspace, rows: &[Row], efficiency: Option<f64>) -> Vec<f64> {
    write_workspace(ws, rows, efficiency);
    rows.iter()
        .map(|row| {
            let model = row.model.path();
            let mut args = vec!["estimate".to_string()];
            args.extend(row.estimate_args(&model, &cluster_name(row)));
            args.push("--json".into());
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let r = ws.run(&args);
            assert_eq!(r.code, 0, "{args:?}: {}", r.stderr);
            let j = r.json();
            let tokens = j["tokens_per_s"].as_f64().expect("tokens_per_s");
            tokens / row.gpus as f64 / row.tokens_per_gpu - 1.0
        })
        .collect()
}

/// The calibration rule: the matmul efficiency at which the median error of the calibration
/// rows is zero, found by bisection (predicted throughput grows with the efficiency).
fn fit(ws: &TempWorkspace, rows: &[Row]) -> f64 {
    let rows: Vec<Row> = rows.iter().filter(|r| r.calibrates()).copied().collect();
    let (mut lo, mut hi) = (0.3, 1.0);
    while hi - lo > 1e-3 {
        let mid = (lo + hi) / 2.0;
        if median(errors(ws, &rows, Some(mid))) > 0.0 {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    (lo + hi) / 2.0
}

/// How the residuals are summarised: a name and which rows belong.
type Group = (&'static str, fn(&Row) -> bool);

/// The fit's rows, and the two kinds of rows it leaves out.
const GROUPS: [Group; 3] = [
    ("7B+ with checkpointing (the fit)", Row::calibrates),
    ("7B+ without checkpointing", |r| {
        r.model.params >= 7e9 && !r.checkpointing
    }),
    ("under 7B", |r| r.model.params < 7e9),
];

/// Prints every row's error with the shipped constants, and the median per group; returns the
/// median error of the calibration rows.
fn report(ws: &TempWorkspace, rows: &[Row]) -> f64 {
    let errs = errors(ws, rows, None);
    println!(
        "{:<9} {:<9} {:>5} {:>5} {:>4} {:>5} {:>5} {:>10} {:>10} {:>7}",
        "gpu", "model", "seq", "gpus", "mbs", "gbs", "ckpt", "published", "autopar", "err"
    );
    for (row, err) in rows.iter().zip(&errs) {
        println!(
            "{:<9} {:<9} {:>5} {:>5} {:>4} {:>5} {:>5} {:>10.0} {:>10.0} {:>+6.1}%{}",
            row.gpu,
            row.model.name,
            row.seq,
            row.gpus,
            row.micro_batch,
            row.global_batch,
            if row.checkpointing { "yes" } else { "no" },
            row.tokens_per_gpu,
            row.tokens_per_gpu * (1.0 + err),
            err * 100.0,
            if row.calibrates() { "  (fit)" } else { "" }
        );
    }
    let group = |keep: fn(&Row) -> bool| -> (usize, f64) {
        let e: Vec<f64> = rows
            .iter()
            .zip(&errs)
            .filter(|(r, _)| keep(r))
            .map(|(_, &e)| e)
            .collect();
        (e.len(), median(e))
    };
    for (name, keep) in GROUPS {
        let (n, m) = group(keep);
        println!("median error, {name}: {:+.1}% ({n} rows)", m * 100.0);
    }
    group(Row::calibrates).1
}

/// The fit for one generation reproduces its shipped constant, and the shipped constant
/// centres the calibration rows.
fn check(gpus: &[&str], shipped: f64) {
    let ws = TempWorkspace::default_copy();
    let rows = rows_on(gpus);
    let fitted = fit(&ws, &rows);
    println!("{gpus:?}: fitted matmul efficiency {fitted:.3}, shipped {shipped}");
    assert!((fitted - shipped).abs() <= 0.01, "{fitted} vs {shipped}");
    let centre = report(&ws, &rows);
    assert!(centre.abs() <= 0.03, "{centre}");
}

#[test]
fn ampere_matmul_efficiency_is_the_fit_to_mosaicml_a100_runs() {
    check(&["a100-80g", "a100-40g"], AMPERE_MATMUL_EFFICIENCY);
}

#[test]
fn hopper_matmul_efficiency_is_the_fit_to_mosaicml_h100_runs() {
    check(&["h100-sxm"], HOPPER_MATMUL_EFFICIENCY);
}
