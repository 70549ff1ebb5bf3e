//! `autopar calibrate`: device numbers fitted to measured runs, the file a cluster reads, the
//! results its edits invalidate, and bad input.

use autopar_tests::{Run, TempWorkspace};
use serde_json::Value;

/// A workspace whose `truth` cluster is an A100 node with a matmul efficiency of 0.6 (what the
/// synthetic runs below were "measured" on), and a 2-node `pair` cluster that may read a
/// calibration file.
fn workspace(pair_extra: &str) -> String {
    format!(
        r#"[[model]]
name = "gpt"
hf_config = "models/gpt-1.7b.json"

[[model]]
name = "small"
hf_config = "models/gpt2-small.json"

[[cluster]]
name = "truth"
preset = "a100-80g"
nodes = 1
gpus_per_node = 8
overrides = {{ matmul_efficiency = 0.6 }}

[[cluster]]
name = "pair"
preset = "dgx-a100"
nodes = 2
{pair_extra}

[[target]]
name = "small"
model = "small"
cluster = "pair"
global_batch = 64
seq_len = 1024
"#
    )
}

/// Layouts of the synthetic runs: (tp, pp, mbs, recompute).
const LAYOUTS: [(u64, u64, u64, &str); 6] = [
    (1, 1, 4, "full"),
    (2, 1, 8, "none"),
    (4, 1, 8, "none"),
    (8, 1, 16, "none"),
    (2, 2, 4, "selective"),
    (1, 2, 2, "full"),
];

fn estimate(ws: &TempWorkspace, cluster: &str, l: (u64, u64, u64, &str)) -> Value {
    let (tp, pp, mbs) = (l.0.to_string(), l.1.to_string(), l.2.to_string());
    let r = ws.run(&[
        "estimate",
        "--model",
        "gpt",
        "--cluster",
        cluster,
        "--tp",
        &tp,
        "--pp",
        &pp,
        "--mbs",
        &mbs,
        "--gbs",
        "256",
        "--recompute",
        l.3,
        "--memory-headroom",
        "0",
        "--json",
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    r.json()
}

/// Writes `runs.csv`: the layouts as the `truth` cluster prices them, recorded on the plain
/// preset.
fn synthetic_runs(ws: &TempWorkspace) {
    let mut csv = String::from("model,cluster,tp,pp,dp,mbs,gbs,recompute,step_time_s\n");
    for l in LAYOUTS {
        let t = estimate(ws, "truth", l)["step_time_s"]
            .as_f64()
            .expect("step time");
        let dp = 8 / (l.0 * l.1);
        csv += &format!(
            "gpt,a100-80g:1x8,{},{},{dp},{},256,{},{t}\n",
            l.0, l.1, l.2, l.3
        );
    }
    ws.write("runs.csv", &csv);
}

fn calibrate(ws: &TempWorkspace, extra: &[&str]) -> Run {
    let mut args = vec!["calibrate", "runs.csv", "-o", "cal.toml"];
    args.extend_from_slice(extra);
    ws.run(&args)
}

/// Runs made by the cost model itself with a matmul efficiency of 0.6 are explained again:
/// the fit lands on 0.6 and predicts every run, held out or not, within 0.5%.
#[test]
fn calibration_recovers_the_numbers_that_made_the_runs() {
    let ws = TempWorkspace::with_toml(&workspace(""));
    synthetic_runs(&ws);
    let r = calibrate(&ws, &["--json"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let out = r.json();
    let c = &out["calibration"];
    assert_eq!(c["device"], "a100-80g");
    assert_eq!(c["cross_validation"], "leave-one-out");
    assert_eq!(c["runs"].as_array().map(Vec::len), Some(LAYOUTS.len()));
    let f = |k: &str| c[k].as_f64().unwrap_or_else(|| panic!("{k} in {c}"));
    assert!(f("preset_error") > 0.05, "{c}");
    assert!(f("fitted_error") < 0.005, "{c}");
    assert!(f("held_out_error") < 0.005, "{c}");
    let knob = |key: &str| {
        c["knobs"]
            .as_array()
            .and_then(|k| k.iter().find(|k| k["key"] == key))
            .unwrap_or_else(|| panic!("{key} in {c}"))
            .clone()
    };
    let matmul = knob("matmul_efficiency");
    assert!(
        (matmul["fitted"].as_f64().expect("fitted") - 0.6).abs() < 0.01,
        "{matmul}"
    );
    // One node: the network between nodes moves no run.
    assert_eq!(knob("internode_efficiency")["fitted_by_runs"], false);
    let text = ws.read("cal.toml");
    assert!(text.contains("device = \"a100-80g\""), "{text}");
    assert!(text.contains("matmul_efficiency = 0.6"), "{text}");
    assert!(!text.contains("internode_efficiency"), "{text}");
}

/// Runs on two clusters of one device with different overrides: each run's preset column is
/// its own cluster's price, and one set of numbers is fitted to both.
#[test]
fn runs_on_clusters_with_different_overrides_keep_their_own_preset() {
    let ws = TempWorkspace::with_toml(&workspace(""));
    synthetic_runs(&ws);
    let csv = ws.read("runs.csv");
    // The first two runs name the `truth` cluster (matmul efficiency 0.6) instead of the preset.
    let mut lines: Vec<String> = csv.lines().map(str::to_string).collect();
    for line in lines.iter_mut().skip(1).take(2) {
        *line = line.replacen("a100-80g:1x8", "truth", 1);
    }
    ws.write("runs.csv", &(lines.join("\n") + "\n"));
    let out = calibrate(&ws, &["--json"]).json();
    let runs = out["calibration"]["runs"].as_array().expect("runs").clone();
    assert_eq!(runs.len(), LAYOUTS.len());
    for (run, l) in runs.iter().zip(LAYOUTS) {
        let cluster = run["cluster"].as_str().expect("cluster");
        let own = estimate(&ws, cluster, l)["step_time_s"]
            .as_f64()
            .expect("time");
        let preset = run["preset_s"].as_f64().expect("preset");
        assert!(
            (preset / own - 1.0).abs() < 1e-9,
            "{cluster}: {preset} vs {own}"
        );
    }
    // The runs on `truth` are its own prices: no error there under the preset column.
    let exact = |run: &Value| {
        let (p, m) = (run["preset_s"].as_f64(), run["measured_s"].as_f64());
        p.zip(m).map(|(p, m)| (p / m - 1.0).abs())
    };
    assert!(exact(&runs[0]).is_some_and(|e| e < 1e-6), "{}", runs[0]);
    assert!(exact(&runs[2]).is_some_and(|e| e > 0.05), "{}", runs[2]);
}

/// The written file, attached to a cluster, prices runs as the fit did.
#[test]
fn a_cluster_reading_the_file_prices_as_the_fit() {
    let ws = TempWorkspace::with_toml(&workspace(""));
    synthetic_runs(&ws);
    let out = calibrate(&ws, &["--json"]).json();
    let run = &out["calibration"]["runs"][1];
    let mut toml = workspace("");
    toml += "\n[[cluster]]\nname = \"fitted\"\npreset = \"a100-80g\"\nnodes = 1\n\
             gpus_per_node = 8\ncalibration = \"cal.toml\"\n";
    ws.write("workspace.toml", &toml);
    let e = estimate(&ws, "fitted", LAYOUTS[1]);
    let (got, want) = (
        e["step_time_s"].as_f64().expect("time"),
        run["fitted_s"].as_f64().expect("fitted"),
    );
    // The file keeps six significant digits.
    assert!((got / want - 1.0).abs() < 1e-4, "{got} vs {want}");
}

fn built(r: &Run) -> Value {
    assert_eq!(r.code, 0, "stdout:\n{}\nstderr:\n{}", r.stdout, r.stderr);
    r.json()
}

fn solved(j: &Value, kind: &str) -> u64 {
    j["kinds"][kind]["solved"].as_u64().unwrap_or(0)
}

/// The file's numbers are keys like any device number: a new network efficiency recomputes no
/// layer cost (tensor parallelism stays inside a node) but the search that reads the network;
/// a new matmul efficiency recomputes the layer costs.
#[test]
fn a_calibration_edit_invalidates_what_reads_the_numbers_it_changes() {
    let ws = TempWorkspace::with_toml(&workspace("calibration = \"cal.toml\""));
    let file = |internode: f64, matmul: f64| {
        format!(
            "device = \"a100-80g\"\n[overrides]\ninternode_efficiency = {internode}\n\
             matmul_efficiency = {matmul}\n"
        )
    };
    ws.write("cal.toml", &file(0.8, 0.7));
    let cold = built(&ws.run(&["build", "--json"]));
    assert!(solved(&cold, "layer-cost") > 0, "{cold}");
    let again = built(&ws.run(&["build", "--json"]));
    assert_eq!(
        solved(&again, "layer-cost") + solved(&again, "search"),
        0,
        "{again}"
    );

    ws.write("cal.toml", &file(0.6, 0.7));
    let network = built(&ws.run(&["build", "--json"]));
    assert_eq!(solved(&network, "layer-cost"), 0, "{network}");
    assert_eq!(solved(&network, "search"), 1, "{network}");

    ws.write("cal.toml", &file(0.6, 0.65));
    let compute = built(&ws.run(&["build", "--json"]));
    assert!(solved(&compute, "layer-cost") > 0, "{compute}");
}

/// Bad input names the file, line and field: a calibration file of another device, an
/// unknown number, a value out of range; runs on two devices without `--device`.
#[test]
fn bad_calibrations_are_located() {
    let ws = TempWorkspace::with_toml(&workspace("calibration = \"cal.toml\""));
    for (text, says) in [
        (
            "device = \"h100-sxm\"\n[overrides]\nmatmul_efficiency = 0.5\n",
            "cal.toml:1:10: field `device`: expected the cluster's device `a100-80g`, found \
             \"h100-sxm\"",
        ),
        (
            "device = \"a100-80g\"\n[overrides]\nmatmul = 0.5\n",
            "cal.toml:3:10: field `overrides.matmul`: expected one of sm_count",
        ),
        (
            "device = \"a100-80g\"\n[overrides]\nmatmul_efficiency = 1.5\n",
            "cal.toml:3:21: field `overrides.matmul_efficiency`: expected a fraction in (0, 1], \
             found 1.5",
        ),
    ] {
        ws.write("cal.toml", text);
        let r = ws.run(&["build"]);
        assert_eq!(r.code, 2, "{}", r.stdout);
        assert!(r.stderr.contains(says), "{says}\n{}", r.stderr);
    }
    ws.write("cal.toml", "device = \"a100-80g\"\n");
    ws.write(
        "runs.csv",
        "model,cluster,tp,pp,dp,mbs,gbs,step_time_s\n\
         gpt,a100-80g:1x8,8,1,1,8,64,1.0\n\
         gpt,h100-sxm:1x8,8,1,1,8,64,0.5\n",
    );
    let r = calibrate(&ws, &[]);
    assert_eq!(r.code, 2, "{}", r.stdout);
    assert!(
        r.stderr.contains("--device: expected one device to fit"),
        "{}",
        r.stderr
    );
    let r = calibrate(&ws, &["--device", "h100-sxm"]);
    assert_eq!(r.code, 2, "{}", r.stdout);
    assert!(
        r.stderr.contains("expected at least two runs on h100-sxm"),
        "{}",
        r.stderr
    );
}
