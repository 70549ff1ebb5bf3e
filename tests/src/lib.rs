//! Helpers for autopar's end-to-end tests, and published reference data they compare against.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

pub mod executor;
pub mod graphs;
pub mod load;
pub mod megatron;
pub mod misbehave;
pub mod mosaicml;
pub mod serve;
pub mod sharding;

/// Root of the repository.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map_or_else(|| PathBuf::from(".."), Path::to_path_buf)
}

/// Two small models (an inline transformer and GPT-2 small) with one target each on a 2-GPU
/// H100 node: quick to build, and enough to tell results two targets share from their own.
/// Megatron-LM's space only, so that the counts of a build's results are those of its layer
/// costs and searches (`tests/tests/spaces.rs` counts the ILP space's).
pub const SMALL_WORKSPACE: &str = r#"
[[model]]
name = "tiny"
transformer = { hidden = 512, layers = 4, heads = 8, ffn_hidden = 2048, vocab = 32000, max_seq = 1024 }

[[model]]
name = "gpt2"
hf_config = "models/gpt2-small.json"

[[cluster]]
name = "one"
preset = "h100-sxm"
nodes = 1
gpus_per_node = 2

[[target]]
name = "tiny"
model = "tiny"
cluster = "one"
global_batch = 8
space = "megatron"
[target.search]
micro_batch = [1]

[[target]]
name = "gpt2"
model = "gpt2"
cluster = "one"
global_batch = 8
space = "megatron"
[target.search]
micro_batch = [1, 2]
"#;

/// A private copy of the default workspace (workspace.toml and models/) in a temporary
/// directory, so tests can build and edit without touching the repository.
pub struct TempWorkspace {
    dir: tempfile::TempDir,
}

impl TempWorkspace {
    /// Copies the default workspace with the files it reads.
    pub fn default_copy() -> Self {
        let dir = tempfile::tempdir().expect("temporary directory");
        let root = repo_root();
        std::fs::copy(
            root.join("workspace.toml"),
            dir.path().join("workspace.toml"),
        )
        .expect("copy workspace.toml");
        // The files the default workspace reads: models and measured profiles.
        for sub in ["models", "profiles"] {
            let to = dir.path().join(sub);
            std::fs::create_dir_all(&to).expect("directory");
            for entry in std::fs::read_dir(root.join(sub)).expect("read directory") {
                let entry = entry.expect("entry");
                std::fs::copy(entry.path(), to.join(entry.file_name())).expect("copy file");
            }
        }
        TempWorkspace { dir }
    }

    /// An empty directory with the given workspace.toml and the shipped models.
    pub fn with_toml(toml: &str) -> Self {
        let ws = Self::default_copy();
        ws.write("workspace.toml", toml);
        ws
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Writes a file relative to the workspace.
    pub fn write(&self, rel: &str, text: &str) {
        let p = self.dir.path().join(rel);
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent).expect("parent");
        }
        std::fs::write(p, text).expect("write");
    }

    /// Reads a file relative to the workspace.
    pub fn read(&self, rel: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(rel)).expect("read")
    }

    /// Runs autopar in the workspace directory.
    pub fn run(&self, args: &[&str]) -> Run {
        run_in(self.path(), args)
    }

    /// Starts autopar in the workspace directory without waiting for it.
    pub fn spawn(&self, args: &[&str]) -> std::process::Child {
        spawn_in(self.path(), args)
    }
}

/// Output of one autopar process.
#[derive(Debug)]
pub struct Run {
    /// Exit code (-1 if killed by a signal).
    pub code: i32,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
}

impl From<Output> for Run {
    fn from(out: Output) -> Self {
        Run {
            code: out.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }
}

impl Run {
    /// Standard output parsed as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| {
            panic!(
                "stdout is not JSON ({e}):\n{}\nstderr:\n{}",
                self.stdout, self.stderr
            )
        })
    }
}

/// The `autopar-e2e` binary of this package: cargo builds it next to the directory holding the
/// test executables (`target/<profile>/deps/..`).
pub fn binary() -> PathBuf {
    let exe = std::env::current_exe().expect("path of the test executable");
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("test executable lives in target/<profile>/deps");
    let bin = dir.join(format!("autopar-e2e{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.exists(),
        "{} is missing: run the tests through cargo, which builds it",
        bin.display()
    );
    bin
}

/// Starts the autopar binary with `args` in directory `dir`, stdout piped, without waiting.
pub fn spawn_in(dir: &Path, args: &[&str]) -> std::process::Child {
    Command::new(binary())
        .args(args)
        .current_dir(dir)
        .env_remove("AUTOPAR_WORKSPACE")
        .env_remove("AUTOPAR_CACHE_DIR")
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("autopar starts")
}

/// Runs the autopar binary with `args` in directory `dir`.
pub fn run_in(dir: &Path, args: &[&str]) -> Run {
    let out: Output = Command::new(binary())
        .args(args)
        .current_dir(dir)
        .env_remove("AUTOPAR_WORKSPACE")
        .env_remove("AUTOPAR_CACHE_DIR")
        .env_remove("RUST_LOG")
        .output()
        .expect("autopar runs");
    Run::from(out)
}

/// The plans and traces under `dir/plans`, by file name.
pub fn plans_of(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir.join("plans"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            (name, std::fs::read(e.path()).expect("read a plan"))
        })
        .collect()
}

/// What a clean build of the default workspace writes (plans and traces), and how long that
/// cold build took: the reference every failure test compares with.
pub fn reference() -> &'static (BTreeMap<String, Vec<u8>>, std::time::Duration) {
    static REFERENCE: OnceLock<(BTreeMap<String, Vec<u8>>, std::time::Duration)> = OnceLock::new();
    REFERENCE.get_or_init(|| {
        let ws = TempWorkspace::default_copy();
        let start = std::time::Instant::now();
        let r = ws.run(&["build"]);
        let took = start.elapsed();
        assert_eq!(r.code, 0, "the reference build: {}", r.stderr);
        let plans = plans_of(ws.path());
        assert_eq!(plans.len(), 34, "17 plans and their traces");
        (plans, took)
    })
}

/// Asserts that `dir` holds exactly the reference build's plans and traces, byte for byte.
pub fn assert_reference_plans(dir: &Path, case: &str) {
    let (expected, _) = reference();
    let found = plans_of(dir);
    assert_eq!(
        found.keys().collect::<Vec<_>>(),
        expected.keys().collect::<Vec<_>>(),
        "{case}: the same plan files"
    );
    for (name, bytes) in expected {
        assert!(
            found.get(name) == Some(bytes),
            "{case}: {name} differs from a clean build's"
        );
    }
}

/// Asserts that a run ended without a panic (exit 101, or the panic message).
pub fn assert_no_panic(r: &Run, case: &str) {
    assert_ne!(r.code, 101, "{case}: panicked:\n{}", r.stderr);
    assert!(
        !r.stderr.contains("panicked"),
        "{case}: panicked:\n{}",
        r.stderr
    );
}

/// The warning lines of a run's standard error.
pub fn warnings(r: &Run) -> Vec<&str> {
    r.stderr.lines().filter(|l| l.contains("WARN")).collect()
}
