//! `autopar run --plan FILE` reads files users hand it: a plan edited by hand, truncated, or of
//! another model. Reading, preparing and lowering such a plan returns a result or an error and
//! never panics, and what it accepts stays within the CPU backend's budget.

use autopar_engine::build::build;
use autopar_engine::cache::Cache;
use autopar_engine::executor::lower;
use autopar_engine::plans::parse_plan;
use autopar_engine::run::{CPU_STATE_LIMIT, prepare};
use autopar_engine::workspace::{Workspace, load};
use proptest::prelude::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The default workspace and the text of the plan it builds for `tiny-llama-3d` (every kind of
/// parallelism at once), built once for all cases.
fn fixture() -> &'static (tempfile::TempDir, Workspace, String) {
    static FIXTURE: OnceLock<(tempfile::TempDir, Workspace, String)> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let dir = tempfile::tempdir().expect("temporary directory");
        std::fs::copy(
            root.join("workspace.toml"),
            dir.path().join("workspace.toml"),
        )
        .expect("workspace");
        for sub in ["models", "profiles"] {
            std::fs::create_dir_all(dir.path().join(sub)).expect("directory");
            for e in std::fs::read_dir(root.join(sub)).expect("shipped files") {
                let e = e.expect("entry");
                std::fs::copy(e.path(), dir.path().join(sub).join(e.file_name())).expect("copy");
            }
        }
        let ws = load(&dir.path().join("workspace.toml")).expect("default workspace");
        build(
            &ws,
            &["tiny-llama-3d".to_string()],
            &Cache::in_memory(),
            &|_| {},
        )
        .expect("build");
        let text = std::fs::read_to_string(ws.plan_path("tiny-llama-3d")).expect("plan");
        (dir, ws, text)
    })
}

/// Paths to every number of a JSON value.
fn numbers(v: &Value, at: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                at.push(k.clone());
                numbers(x, at, out);
                at.pop();
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                at.push(i.to_string());
                numbers(x, at, out);
                at.pop();
            }
        }
        Value::Number(_) => out.push(at.clone()),
        _ => {}
    }
}

fn slot<'v>(v: &'v mut Value, path: &[String]) -> &'v mut Value {
    path.iter().fold(v, |v, k| match v {
        Value::Object(m) => m.get_mut(k).expect("key"),
        Value::Array(a) => &mut a[k.parse::<usize>().expect("index")],
        _ => unreachable!("a path leads through objects and arrays"),
    })
}

/// Reads, prepares and lowers `text`; panics only on a bug.
fn check(ws: &Workspace, text: &str) {
    let path = PathBuf::from("edited.json");
    let Ok(plan) = parse_plan("tiny-llama-3d", &path, text) else {
        return;
    };
    let Ok(autopar_engine::run::Prepared { graph, layout, .. }) = prepare(ws, &plan) else {
        return;
    };
    let params = graph.parameter_count() as f64 * 16.0 * layout.dp as f64;
    assert!(params <= CPU_STATE_LIMIT, "prepare accepted {params} bytes");
    let _ = lower(&graph, &layout);
}

#[test]
fn the_unedited_plan_lowers() {
    let (_, ws, text) = fixture();
    let plan = parse_plan("tiny-llama-3d", Path::new("p.json"), text).expect("plan");
    let prepared = prepare(ws, &plan).expect("prepare");
    let (graph, layout) = (prepared.graph, prepared.layout);
    assert_eq!(layout.devices(), 8);
    lower(&graph, &layout).expect("lower");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn edited_numbers_never_panic(which in any::<prop::sample::Index>(), value in prop_oneof![
        Just(0i64), Just(1), Just(2), Just(3), Just(7), Just(-1), Just(1_000_000_007),
        Just(i64::MAX), any::<i64>()
    ]) {
        let (_, ws, text) = fixture();
        let mut v: Value = serde_json::from_str(text).expect("json");
        let mut paths = Vec::new();
        numbers(&v, &mut Vec::new(), &mut paths);
        let path = which.get(&paths).clone();
        *slot(&mut v, &path) = Value::from(value);
        check(ws, &v.to_string());
    }

    #[test]
    fn removed_or_retyped_fields_never_panic(which in any::<prop::sample::Index>(), retype in any::<bool>()) {
        let (_, ws, text) = fixture();
        let mut v: Value = serde_json::from_str(text).expect("json");
        let mut paths = Vec::new();
        numbers(&v, &mut Vec::new(), &mut paths);
        let path = which.get(&paths).clone();
        let (last, parent) = path.split_last().expect("non-empty path");
        match slot(&mut v, parent) {
            Value::Object(m) if !retype => {
                m.remove(last);
            }
            other => *slot(other, std::slice::from_ref(last)) = Value::from("x"),
        }
        check(ws, &v.to_string());
    }

    #[test]
    fn truncated_text_never_panics(cut in 0usize..100_000) {
        let (_, ws, text) = fixture();
        let mut cut = cut % text.len();
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        check(ws, &text[..cut]);
    }
}
