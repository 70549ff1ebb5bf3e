//! The executor: lowers a plan into per-device programs and runs them (DESIGN.md "Executor").
//!
//! [`lower::lower`] turns a model graph and a parallel layout (data, tensor and pipeline
//! degrees, interleaved chunks, sequence parallelism, ZeRO; or an intra-op plan's stages on
//! their logical meshes with every tensor's placement) into a [`Program`]. The CPU
//! backend ([`run_program`]) runs it with one thread per virtual device on synthetic data and
//! random weights; [`check`] compares a sharded run with the single-device run of the same
//! model, loss and every gradient. The CUDA backend is probed by [`cuda::probe`].

pub mod attention;
pub mod comm;
pub mod cpu;
pub mod cuda;
pub mod jax;
pub mod kernels;
pub mod lower;
pub mod measure;
pub mod moe;
pub mod placement;
pub mod tensor;

pub use lower::{ExecLayout, Program, lower};

use autopar_rules::model::graph::Graph;
pub use cpu::Phases;
use cpu::{Coord, Device, DeviceReport, rank_of};
use placement::{Placement, assemble};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Arc;
use tensor::Tensor;

/// Device name of profiles measured by the CPU backend: they apply to clusters of
/// `preset = "cpu"`.
pub const CPU_DEVICE: &str = "cpu";

/// Backends `autopar run` knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// Threads on the host, f32.
    Cpu,
    /// NVIDIA GPUs through CUDA, cuBLAS, NVRTC and NCCL.
    Cuda,
    /// The plan exported as a JAX program and run by XLA (virtual CPU devices, or GPUs).
    Jax,
}

impl Backend {
    /// Name as written on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Cuda => "cuda",
            Backend::Jax => "jax",
        }
    }
}

/// Why a program cannot be lowered or run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ExecError {
    /// The layout or model cannot be lowered.
    #[error("cannot lower the plan: {0}")]
    Lower(String),
    /// Another device failed, so this one stopped.
    #[error("stopped because another device failed")]
    Aborted,
    /// A device thread panicked (a bug).
    #[error("a device failed unexpectedly: {0}")]
    Panic(String),
    /// The requested backend cannot run on this machine.
    #[error("{0}")]
    Unavailable(String),
    /// The plan's model is too large for the backend's memory.
    #[error("{0}")]
    TooLarge(String),
    /// The backend has no kernel for an op signature (it is left to the analytic model).
    #[error("no kernel for {0}")]
    NoKernel(String),
}

/// Options of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunOptions {
    /// Training steps.
    pub steps: usize,
    /// Seed of weights and data.
    pub seed: u64,
    /// Keep gradients and parameters for a comparison with the reference.
    pub check: bool,
}

/// What a run measured.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunResult {
    /// Mean loss of every step (over every micro-batch of every replica).
    pub losses: Vec<f64>,
    /// Wall time of every step (slowest device), s.
    pub step_times: Vec<f64>,
    /// Where the time of every step went on its slowest device.
    pub phases: Vec<Phases>,
}

/// The median of `values` (the mean of the middle two of an even count; 0 when empty).
pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => 0.0,
        _ if n % 2 == 1 => values[n / 2],
        _ => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// The median of `values` leaving out the first (warm-up) when there are several.
fn median_after_warmup(values: impl Iterator<Item = f64>) -> f64 {
    let mut t: Vec<f64> = values.collect();
    if t.len() > 1 {
        t.remove(0);
    }
    median(t)
}

impl RunResult {
    /// Median step time, s, leaving out the first step (warm-up) when there are several.
    pub fn median_step_time(&self) -> f64 {
        median_after_warmup(self.step_times.iter().copied())
    }

    /// Median of each phase over the same steps.
    pub fn median_phases(&self) -> Phases {
        let of = |f: fn(&Phases) -> f64| median_after_warmup(self.phases.iter().map(f));
        Phases {
            forward: of(|p| p.forward),
            backward: of(|p| p.backward),
            communication: of(|p| p.communication),
            optimizer: of(|p| p.optimizer),
        }
    }
}

/// A sharded run compared with the single-device run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CheckReport {
    /// Largest relative difference of a step's loss.
    pub loss_rel: f64,
    /// Largest relative difference (L2 norm of the difference over the norm) of a gradient of
    /// the first step.
    pub grad_rel: f64,
    /// The parameter whose gradient differs most.
    pub worst_grad: String,
    /// Largest relative difference of a parameter after the first update.
    pub param_rel: f64,
    /// Gradients compared.
    pub compared: usize,
    /// The tolerance.
    pub tolerance: f64,
    /// Whether every difference is within the tolerance.
    pub passed: bool,
    /// The reference run.
    pub reference: RunResult,
}

/// Relative tolerance of a check (the 1e-4).
pub const CHECK_TOLERANCE: f64 = 1e-4;

/// Runs `prog` on the CPU backend: every device's report, in rank order.
pub fn run_program(prog: &Program, opts: &RunOptions) -> Result<Vec<DeviceReport>, ExecError> {
    let fabric = Arc::new(comm::Fabric::default());
    let n = prog.layout.devices();
    let results: Vec<Result<DeviceReport, ExecError>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|me| {
                let fabric = fabric.clone();
                s.spawn(move || {
                    let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        Device::new(prog, opts, me, fabric.clone()).run()
                    }));
                    let out = match run {
                        Ok(r) => r,
                        Err(p) => Err(ExecError::Panic(panic_message(p.as_ref()))),
                    };
                    if out.is_err() {
                        fabric.fail();
                    }
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|p| Err(ExecError::Panic(panic_message(p.as_ref()))))
            })
            .collect()
    });
    // Report the failure that caused the others.
    if let Some(e) = results
        .iter()
        .filter_map(|r| r.as_ref().err())
        .find(|e| !matches!(e, ExecError::Aborted))
        .or_else(|| results.iter().filter_map(|r| r.as_ref().err()).next())
    {
        return Err(e.clone());
    }
    Ok(results.into_iter().filter_map(Result::ok).collect())
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic".into())
}

/// Loss and step times of a run from its devices' reports.
pub fn summarize(prog: &Program, reports: &[DeviceReport]) -> RunResult {
    let l = &prog.layout;
    let steps = reports.first().map_or(0, |r| r.step_times.len());
    let denom = (l.microbatches * l.dp) as f64;
    RunResult {
        losses: (0..steps)
            .map(|s| reports.iter().map(|r| r.loss_sums[s]).sum::<f64>() / denom)
            .collect(),
        step_times: (0..steps)
            .map(|s| reports.iter().map(|r| r.step_times[s]).fold(0.0, f64::max))
            .collect(),
        phases: (0..steps)
            .map(|s| {
                reports
                    .iter()
                    .max_by(|a, b| a.step_times[s].total_cmp(&b.step_times[s]))
                    .map_or_else(Phases::default, |r| r.phases[s])
            })
            .collect(),
    }
}

/// The whole gradient of every parameter at every step, assembled from the devices' pieces:
/// gathered and summed over each stage's mesh as its gradient was left placed, summed over
/// data-parallel replicas and over the stages that hold a copy (before synchronisation each
/// holds a partial sum).
fn whole_grads(prog: &Program, reports: &[DeviceReport], step: usize) -> BTreeMap<u32, Tensor> {
    let l = &prog.layout;
    let mut out: BTreeMap<u32, Tensor> = BTreeMap::new();
    for pp in 0..l.pp {
        for dp in 0..l.dp {
            let first = &reports[rank_of(prog, Coord { pp, dp, m: 0 })];
            let Some(grads) = first.grads.get(step) else {
                continue;
            };
            for &v in grads.keys() {
                let info = &prog.values[v as usize];
                let placement = info.grad_placement.as_ref().unwrap_or(&info.placement);
                let Some(whole) =
                    whole_of(prog, pp, dp, placement, |r| r.grads[step].get(&v), reports)
                else {
                    continue;
                };
                match out.get_mut(&v) {
                    Some(acc) => acc.add_assign(&whole),
                    None => {
                        out.insert(v, whole);
                    }
                }
            }
        }
    }
    out
}

/// A value's whole from the pieces that the devices of replica `dp` of stage `pp` hold in
/// `placement` (`None` when a device lacks its piece).
fn whole_of<'r>(
    prog: &Program,
    pp: usize,
    dp: usize,
    placement: &Placement,
    piece: impl Fn(&'r DeviceReport) -> Option<&'r Tensor>,
    reports: &'r [DeviceReport],
) -> Option<Tensor> {
    let mesh = prog.layout.mesh(pp);
    let pieces: Option<Vec<&Tensor>> = (0..prog.layout.stage_devices(pp))
        .map(|m| piece(&reports[rank_of(prog, Coord { pp, dp, m })]))
        .collect();
    Some(assemble(&pieces?, placement, &mesh))
}

/// Whole parameters after the run, from replica 0 of the first stage holding each.
fn whole_params(prog: &Program, reports: &[DeviceReport]) -> BTreeMap<u32, Tensor> {
    let l = &prog.layout;
    let mut out = BTreeMap::new();
    for pp in 0..l.pp {
        let first = &reports[rank_of(prog, Coord { pp, dp: 0, m: 0 })];
        for &v in first.params.keys() {
            if out.contains_key(&v) {
                continue;
            }
            let placement = &prog.values[v as usize].placement;
            if let Some(whole) = whole_of(prog, pp, 0, placement, |r| r.params.get(&v), reports) {
                out.insert(v, whole);
            }
        }
    }
    out
}

fn rel(a: &[f32], b: &[f32]) -> f64 {
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (x, y) in a.iter().zip(b) {
        diff += (*x as f64 - *y as f64).powi(2);
        norm += (*y as f64).powi(2);
    }
    if a.len() != b.len() {
        return f64::INFINITY;
    }
    diff.sqrt() / norm.sqrt().max(1e-30)
}

/// What a run computed, whole and by value name: the loss of every step, the gradients of the
/// first step (before any synchronisation, summed over the devices holding pieces of them) and
/// the weights after its update, in value order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Snapshot {
    /// Loss of every step.
    pub losses: Vec<f64>,
    /// Gradient of every parameter at the first step.
    pub grads: Vec<(String, Tensor)>,
    /// Every parameter after the first update.
    pub params: Vec<(String, Tensor)>,
}

/// The snapshot of a CPU run of `prog` (run with `check`).
pub fn snapshot(prog: &Program, reports: &[DeviceReport]) -> Snapshot {
    let named = |m: BTreeMap<u32, Tensor>| {
        m.into_iter()
            .map(|(v, t)| (prog.values[v as usize].name.clone(), t))
            .collect()
    };
    Snapshot {
        losses: summarize(prog, reports).losses,
        grads: named(whole_grads(prog, reports, 0)),
        params: named(whole_params(prog, reports)),
    }
}

/// The single-device program of `prog`'s graph: the reference a sharded run is compared with.
pub fn reference_program(graph: &Graph, prog: &Program) -> Result<Program, ExecError> {
    let l = &prog.layout;
    lower(
        graph,
        &ExecLayout {
            grad_accumulation_fusion: l.grad_accumulation_fusion,
            moe_drop: l.moe_drop,
            ..ExecLayout::single(graph.layers.len(), l.microbatches * l.dp)
        },
    )
}

/// `ours` set beside `theirs` (the reference): every step's loss, every gradient of the first
/// step, where both runs start from the same weights (the worst is the first of the largest
/// differences, in value order), and every weight after the first update. Later steps are
/// compared by their losses: Adam's normalisation amplifies rounding in near-zero gradients,
/// so later weights differ by more than rounding.
pub fn compare(ours: &Snapshot, theirs: &Snapshot, reference: RunResult) -> CheckReport {
    let loss_rel = ours
        .losses
        .iter()
        .zip(&theirs.losses)
        .map(|(a, b)| (a - b).abs() / b.abs().max(1e-30))
        .fold(
            if ours.losses.len() == theirs.losses.len() {
                0.0
            } else {
                f64::INFINITY
            },
            f64::max,
        );
    let find = |list: &[(String, Tensor)], name: &str| -> Option<Tensor> {
        list.iter().find(|(n, _)| n == name).map(|(_, t)| t.clone())
    };
    let (mut grad_rel, mut worst, mut compared) = (0.0f64, String::new(), 0);
    let mine: BTreeMap<&str, &Tensor> = ours.grads.iter().map(|(n, t)| (n.as_str(), t)).collect();
    for (name, g) in &theirs.grads {
        let r = mine
            .get(name.as_str())
            .map_or(f64::INFINITY, |x| rel(&x.data, &g.data));
        compared += 1;
        if r > grad_rel || worst.is_empty() {
            grad_rel = grad_rel.max(r);
            worst = name.clone();
        }
    }
    let param_rel = theirs
        .params
        .iter()
        .map(|(n, t)| find(&ours.params, n).map_or(f64::INFINITY, |x| rel(&x.data, &t.data)))
        .fold(0.0, f64::max);
    let passed =
        loss_rel <= CHECK_TOLERANCE && grad_rel <= CHECK_TOLERANCE && param_rel <= CHECK_TOLERANCE;
    CheckReport {
        loss_rel,
        grad_rel,
        worst_grad: worst,
        param_rel,
        compared,
        tolerance: CHECK_TOLERANCE,
        passed,
        reference,
    }
}

/// Runs `prog` and the single-device program of the same graph with the same seed, and
/// compares losses, every gradient of the first step and the parameters after it.
pub fn check(
    graph: &Graph,
    prog: &Program,
    opts: &RunOptions,
) -> Result<(RunResult, CheckReport), ExecError> {
    let opts = RunOptions {
        check: true,
        ..*opts
    };
    let reference = reference_program(graph, prog)?;
    let sharded = run_program(prog, &opts)?;
    let single = run_program(&reference, &opts)?;
    let theirs = summarize(&reference, &single);
    let report = compare(
        &snapshot(prog, &sharded),
        &snapshot(&reference, &single),
        theirs,
    );
    Ok((summarize(prog, &sharded), report))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(vec![]), 0.0);
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
    }

    #[test]
    fn step_time_leaves_out_the_warm_up() {
        let r = RunResult {
            losses: vec![1.0; 5],
            step_times: vec![9.0, 1.0, 2.0, 4.0, 3.0],
            phases: vec![Phases::default(); 5],
        };
        assert_eq!(r.median_step_time(), 2.5);
        let one = RunResult {
            step_times: vec![9.0],
            ..r
        };
        assert_eq!(one.median_step_time(), 9.0);
    }
}
