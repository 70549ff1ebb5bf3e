//! The JAX backend: a lowered program exported as a JAX program ([`program::python`]) and run
//! by XLA's SPMD partitioner with the Python that has JAX: on virtual CPU devices here, on GPUs
//! through CUDA and NCCL (DESIGN.md "Executor").
//!
//! The program prints one JSON line per step; with `--dump` it writes the losses, the first
//! step's gradients and the weights after its update, which [`Snapshot`]s compare with the
//! single-device run of the same program and with the CPU executor; with `--hlo` it writes
//! every compiled function's HLO, whose collectives [`hlo::collectives`] counts.

pub mod hlo;
pub mod profile;
pub mod program;

use super::tensor::Tensor;
use super::{ExecError, RunResult, Snapshot};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Environment variable naming the Python that has JAX.
pub const PYTHON_ENV: &str = "AUTOPAR_PYTHON";

/// The Python that runs exported programs: `flag`, else `$AUTOPAR_PYTHON`, else `python3`.
pub fn interpreter(flag: Option<&Path>) -> PathBuf {
    flag.map(Path::to_path_buf)
        .or_else(|| std::env::var_os(PYTHON_ENV).map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from("python3"))
}

/// How to get JAX, for the errors that say it is missing.
fn install_hint(python: &Path) -> String {
    format!(
        "install it with `{} -m pip install jax` (CPU; `jax[cuda12]` on NVIDIA GPUs), or name a \
         Python that has it with --python or {PYTHON_ENV}",
        python.display()
    )
}

/// The version of JAX that `python` imports, or why it cannot run exported programs.
pub fn probe(python: &Path) -> Result<String, ExecError> {
    let out = Command::new(python)
        .args(["-c", "import numpy, jax; print(jax.__version__)"])
        .output()
        .map_err(|e| {
            ExecError::Unavailable(format!(
                "--backend jax cannot start `{}`: {e}; {}",
                python.display(),
                install_hint(python)
            ))
        })?;
    if out.status.success() {
        return Ok(String::from_utf8_lossy(&out.stdout).trim().to_string());
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    let missing = stderr
        .lines()
        .find_map(|l| l.split("No module named ").nth(1))
        .map(|m| m.trim().trim_matches('\'').to_string());
    Err(ExecError::Unavailable(match missing {
        Some(m) => format!(
            "--backend jax needs the Python package `{m}`, which `{}` does not have; {}",
            python.display(),
            install_hint(python)
        ),
        None => format!(
            "`{}` cannot import JAX: {}; {}",
            python.display(),
            stderr.trim().lines().last().unwrap_or("no message"),
            install_hint(python)
        ),
    }))
}

/// What one run of an exported program printed and wrote.
#[derive(Debug)]
pub struct ProgramRun {
    /// Losses and step times (the program's own clock around each step).
    pub result: RunResult,
    /// XLA's platform (`cpu`, `gpu`).
    pub platform: String,
    /// Losses, first-step gradients and weights, when dumped.
    pub snapshot: Option<Snapshot>,
}

/// Options of one run of an exported program.
pub struct Invocation<'a> {
    /// The Python with JAX.
    pub python: &'a Path,
    /// The program.
    pub script: &'a Path,
    /// Steps.
    pub steps: usize,
    /// Seed of weights and data.
    pub seed: u64,
    /// Every stage on one device.
    pub single: bool,
    /// Write a snapshot here (`PATH.json`, `PATH.bin`).
    pub dump: Option<&'a Path>,
    /// Dump every function's HLO after XLA's SPMD partitioner into this folder.
    pub hlo: Option<&'a Path>,
}

/// Runs an exported program and reads what it printed and dumped.
pub fn run(inv: &Invocation) -> Result<ProgramRun, ExecError> {
    let mut cmd = Command::new(inv.python);
    cmd.arg(inv.script)
        .args(["--steps", &inv.steps.to_string()])
        .args(["--seed", &inv.seed.to_string()]);
    if inv.single {
        cmd.arg("--single");
    }
    if let Some(d) = inv.dump {
        cmd.arg("--dump").arg(d);
    }
    if let Some(h) = inv.hlo {
        cmd.arg("--hlo").arg(h);
    }
    tracing::debug!(?cmd, "running the JAX program");
    let out = cmd.output().map_err(|e| {
        ExecError::Unavailable(format!("cannot start `{}`: {e}", inv.python.display()))
    })?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(15).collect();
        return Err(ExecError::Panic(format!(
            "the JAX program {} failed ({}):\n{}",
            inv.script.display(),
            out.status,
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        )));
    }
    let mut result = RunResult {
        losses: Vec::new(),
        step_times: Vec::new(),
        phases: Vec::new(),
    };
    let mut platform = String::new();
    for line in stdout.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        match v["event"].as_str() {
            Some("start") => platform = v["backend"].as_str().unwrap_or_default().to_string(),
            Some("step") => {
                result.losses.push(v["loss"].as_f64().unwrap_or(f64::NAN));
                result
                    .step_times
                    .push(v["time_s"].as_f64().unwrap_or(f64::NAN));
                result.phases.push(Default::default());
            }
            _ => {}
        }
    }
    if result.losses.len() != inv.steps {
        return Err(ExecError::Panic(format!(
            "the JAX program {} printed {} step(s) of {}",
            inv.script.display(),
            result.losses.len(),
            inv.steps
        )));
    }
    let snapshot = inv.dump.map(read_snapshot).transpose()?;
    Ok(ProgramRun {
        result,
        platform,
        snapshot,
    })
}

/// One tensor of a dump's index.
#[derive(serde::Deserialize)]
struct Entry {
    kind: String,
    name: String,
    shape: Vec<usize>,
    offset: usize,
}

#[derive(serde::Deserialize)]
struct Index {
    losses: Vec<f64>,
    tensors: Vec<Entry>,
}

fn with_ext(path: &Path, ext: &str) -> PathBuf {
    let mut s = path.as_os_str().to_os_string();
    s.push(ext);
    PathBuf::from(s)
}

/// A program's dump: `PATH.json` (losses and an index) and `PATH.bin` (little-endian f32).
pub fn read_snapshot(path: &Path) -> Result<Snapshot, ExecError> {
    let bad =
        |why: String| ExecError::Panic(format!("the JAX program's dump {}: {why}", path.display()));
    let index: Index = std::fs::read(with_ext(path, ".json"))
        .map_err(|e| bad(e.to_string()))
        .and_then(|b| serde_json::from_slice(&b).map_err(|e| bad(e.to_string())))?;
    let bytes = std::fs::read(with_ext(path, ".bin")).map_err(|e| bad(e.to_string()))?;
    let floats: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let mut snap = Snapshot {
        losses: index.losses,
        grads: Vec::new(),
        params: Vec::new(),
    };
    for e in index.tensors {
        let n: usize = e.shape.iter().product();
        let data = floats
            .get(e.offset..e.offset + n)
            .ok_or_else(|| bad(format!("`{}` lies past the end of the data", e.name)))?
            .to_vec();
        let t = Tensor {
            shape: e.shape,
            data,
        };
        match e.kind.as_str() {
            "grad" => snap.grads.push((e.name, t)),
            _ => snap.params.push((e.name, t)),
        }
    }
    Ok(snap)
}
