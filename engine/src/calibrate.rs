//! `autopar calibrate`: the device numbers that best explain a team's measured runs, fitted by
//! bounded least squares on log step time ([`autopar_rules::plan::calibration`]), judged on runs
//! held out of the fit, and written as a file a `[[cluster]]` reads (`calibration = FILE`).

use crate::error::EngineError;
use crate::runs::{MeasuredRun, MeasuredTime};
use crate::session::Session;
use crate::validate::{Resolved, layout_error, resolve, run_options};
use autopar_rules::cost::cluster::Device;
use autopar_rules::model::graph::Graph;
use autopar_rules::plan::accuracy::{mean_abs, relative_error};
use autopar_rules::plan::calibration::{KNOBS, Knob, log_squares, minimise};
use autopar_rules::plan::estimate::{Estimator, GraphKey};
use autopar_rules::plan::layout::TrainingOptions;
use rayon::prelude::*;
use serde::Serialize;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

/// Sweeps of coordinate descent for the fit on every run.
const SWEEPS: usize = 8;
/// Sweeps for each cross-validation fit, started from the full fit.
const FOLD_SWEEPS: usize = 1;
/// Runs up to which every run is held out on its own (leave-one-out); above, ten folds.
const LEAVE_ONE_OUT_MAX: usize = 40;
/// Folds of the cross-validation above [`LEAVE_ONE_OUT_MAX`] runs.
const FOLDS: usize = 10;
/// A knob moves the predicted times by less than this (relative, at a 5% step) on every run:
/// the runs do not determine it.
const MIN_SENSITIVITY: f64 = 1e-4;

/// One fitted number.
#[derive(Clone, Debug, Serialize)]
pub struct FittedKnob {
    /// Key of the number (a `workspace.toml` override key).
    pub key: &'static str,
    /// The value the fit started from: the preset's, with the overrides of the cluster of the
    /// file's first run on the device.
    pub preset: f64,
    /// The fitted value (the preset's when the runs do not determine it).
    pub fitted: f64,
    /// Least value allowed.
    pub lower: f64,
    /// Greatest value allowed.
    pub upper: f64,
    /// Whether the runs determine it (it was fitted).
    pub fitted_by_runs: bool,
    /// Why the range is what it is.
    pub source: &'static str,
}

/// One run's time under the preset, the fit, and the fit that did not see it.
#[derive(Clone, Debug, Serialize)]
pub struct CalibratedRun {
    /// Line of the runs file.
    pub line: usize,
    /// Model, as the file names it.
    pub model: String,
    /// Cluster, as the file names it.
    pub cluster: String,
    /// Measured step time, s.
    pub measured_s: f64,
    /// Predicted with its own cluster's numbers (the preset with that cluster's overrides), s.
    pub preset_s: f64,
    /// Predicted with the numbers fitted to every run, s.
    pub fitted_s: f64,
    /// Predicted with the numbers fitted to the other runs (its fold held out), s.
    pub held_out_s: f64,
}

/// What `autopar calibrate` found.
#[derive(Clone, Debug, Serialize)]
pub struct Calibration {
    /// The device preset the runs ran on.
    pub device: String,
    /// The numbers, fitted or not.
    pub knobs: Vec<FittedKnob>,
    /// Every run that ran (runs out of memory have no time to fit).
    pub runs: Vec<CalibratedRun>,
    /// Runs of the file left out: out of memory, or on another device.
    pub skipped: usize,
    /// `leave-one-out` or `10-fold`.
    pub cross_validation: String,
    /// Mean |time error| with the preset's numbers.
    pub preset_error: Option<f64>,
    /// Mean |time error| with the fitted numbers, on the runs they were fitted to.
    pub fitted_error: Option<f64>,
    /// Mean |time error| of each run predicted by a fit that did not see it.
    pub held_out_error: Option<f64>,
}

/// Fits the device numbers to the runs of `file` (on `device` only, when given).
pub fn calibrate(
    session: &Session,
    file: &Path,
    runs: &[MeasuredRun],
    device: Option<&str>,
) -> Result<Calibration, EngineError> {
    let Resolved { models, clusters } = resolve(session, file, runs)?;
    let device_of = |r: &MeasuredRun| clusters[r.cluster.as_str()].0.device.name.clone();
    let mut devices: Vec<String> = runs.iter().map(device_of).collect();
    devices.sort();
    devices.dedup();
    let device = match (device, devices.as_slice()) {
        (Some(d), _) if devices.iter().any(|x| x == d) => d.to_string(),
        (Some(d), _) => {
            return Err(EngineError::Argument {
                flag: "--device",
                expected: format!("a device the runs ran on ({})", devices.join(", ")),
                found: d.to_string(),
            });
        }
        (None, [one]) => one.clone(),
        (None, _) => {
            return Err(EngineError::Argument {
                flag: "--device",
                expected: format!(
                    "one device to fit (the runs ran on {}; the numbers are a device's)",
                    devices.join(", ")
                ),
                found: "nothing".into(),
            });
        }
    };
    let used: Vec<&MeasuredRun> = runs
        .iter()
        .filter(|r| device_of(r) == device && matches!(r.step_time, MeasuredTime::Seconds(_)))
        .collect();
    if used.len() < 2 {
        return Err(EngineError::Argument {
            flag: "RUNS",
            expected: format!("at least two runs on {device} that ran"),
            found: format!("{}", used.len()),
        });
    }
    let measured: Vec<f64> = used
        .iter()
        .map(|r| match r.step_time {
            MeasuredTime::Seconds(t) => t,
            MeasuredTime::OutOfMemory => f64::NAN,
        })
        .collect();
    // One device per run's cluster; the knobs act on a copy of it.
    let base: Vec<Device> = used
        .iter()
        .map(|r| clusters[r.cluster.as_str()].0.device.clone())
        .collect();
    let knobs: Vec<Knob> = KNOBS.to_vec();
    let bounds: Vec<(f64, f64)> = knobs
        .iter()
        .map(|k| (k.lower, k.upper_on(&device)))
        .collect();
    // The fit starts from the first run's cluster's numbers (clusters of one device differ only
    // by their overrides); the preset column prices each run with its own cluster's.
    let start: Vec<f64> = knobs.iter().map(|k| k.get(&base[0])).collect();
    // Each run's options and lowered graphs, prepared once: only the device changes below.
    let prepared: Vec<(TrainingOptions, Graphs)> = used
        .par_iter()
        .map(|r| {
            let (name, def) = &models[r.model.as_str()];
            let (cluster, profile) = &clusters[r.cluster.as_str()];
            let opts = run_options(file, r, def)?;
            let est = Estimator::new(name, def, cluster, opts).with_profile(profile.as_ref());
            r.price(&est).map_err(|e| layout_error(file, r, e))?;
            Ok((opts, est.graphs()))
        })
        .collect::<Result<_, EngineError>>()?;
    // Step times of runs `which` with the numbers `x` on every run's device (`None`: each
    // run's cluster as it is).
    let predict_with = |x: Option<&[f64]>, which: &[usize]| -> Result<Vec<f64>, EngineError> {
        which
            .par_iter()
            .map(|&i| {
                let r = used[i];
                let (name, def) = &models[r.model.as_str()];
                let (cluster, profile) = &clusters[r.cluster.as_str()];
                let mut c = cluster.clone();
                c.device = base[i].clone();
                for (k, &v) in knobs.iter().zip(x.unwrap_or_default()) {
                    k.set(&mut c.device, v);
                }
                let (opts, graphs) = &prepared[i];
                let est = Estimator::new(name, def, &c, *opts)
                    .with_profile(profile.as_ref())
                    .with_graphs(graphs.clone());
                r.price(&est)
                    .map(|e| e.step_time_s)
                    .map_err(|e| layout_error(file, r, e))
            })
            .collect()
    };
    let predict = |x: &[f64], which: &[usize]| predict_with(Some(x), which);
    let all: Vec<usize> = (0..used.len()).collect();
    // Pricing errors (a layout that cannot run) surface here, before any fitting.
    let preset = predict_with(None, &all)?;
    let at_start = predict(&start, &all)?;
    let objective = |which: Vec<usize>| {
        let want: Vec<f64> = which.iter().map(|&i| measured[i]).collect();
        move |x: &[f64]| match predict(x, &which) {
            Ok(p) => log_squares(&p, &want),
            Err(_) => f64::INFINITY,
        }
    };
    // A knob the runs do not feel stays at the preset; at most one fewer knob than runs.
    let mut sensitivity: Vec<(usize, f64)> = Vec::new();
    for i in 0..knobs.len() {
        let mut x = start.clone();
        let up = start[i] * 1.05;
        x[i] = if up <= bounds[i].1 {
            up
        } else {
            start[i] / 1.05
        };
        let moved = predict(&x, &all)?;
        let s = moved
            .iter()
            .zip(&at_start)
            .map(|(a, b)| (a / b).ln().abs())
            .fold(0.0, f64::max);
        if s > MIN_SENSITIVITY {
            sensitivity.push((i, s));
        }
    }
    sensitivity.sort_by(|a, b| b.1.total_cmp(&a.1));
    sensitivity.truncate(used.len() - 1);
    let mut active = vec![false; knobs.len()];
    for &(i, _) in &sensitivity {
        active[i] = true;
    }
    let (fitted, _) = minimise(&objective(all.clone()), &start, &bounds, &active, SWEEPS);
    let fitted_times = predict(&fitted, &all)?;
    // Cross-validation: each run predicted by a fit to the others (or to the other folds).
    let n = used.len();
    let (folds, cross_validation) = if n <= LEAVE_ONE_OUT_MAX {
        (n, "leave-one-out".to_string())
    } else {
        (FOLDS, format!("{FOLDS}-fold"))
    };
    let mut held_out = vec![f64::NAN; n];
    for f in 0..folds {
        let test: Vec<usize> = (0..n).filter(|i| i % folds == f).collect();
        let train: Vec<usize> = (0..n).filter(|i| i % folds != f).collect();
        let (x, _) = minimise(&objective(train), &fitted, &bounds, &active, FOLD_SWEEPS);
        for (i, t) in test.iter().zip(predict(&x, &test)?) {
            held_out[*i] = t;
        }
    }
    let error = |p: &[f64]| -> Option<f64> {
        let e: Vec<f64> = p
            .iter()
            .zip(&measured)
            .map(|(p, m)| relative_error(*p, *m))
            .collect();
        mean_abs(&e)
    };
    Ok(Calibration {
        knobs: knobs
            .iter()
            .enumerate()
            .map(|(i, k)| FittedKnob {
                key: k.key,
                preset: start[i],
                fitted: fitted[i],
                lower: bounds[i].0,
                upper: bounds[i].1,
                fitted_by_runs: active[i],
                source: k.source,
            })
            .collect(),
        runs: used
            .iter()
            .enumerate()
            .map(|(i, r)| CalibratedRun {
                line: r.line,
                model: r.model.clone(),
                cluster: r.cluster.clone(),
                measured_s: measured[i],
                preset_s: preset[i],
                fitted_s: fitted_times[i],
                held_out_s: held_out[i],
            })
            .collect(),
        skipped: runs.len() - n,
        cross_validation,
        preset_error: error(&preset),
        fitted_error: error(&fitted_times),
        held_out_error: error(&held_out),
        device,
    })
}

/// An estimator's lowered graphs.
type Graphs = HashMap<GraphKey, Arc<Graph>>;

/// The calibration file for `c`: the device and the fitted numbers, with what they achieve in
/// comments. A `[[cluster]]` with `calibration = "FILE"` and the same device reads it.
pub fn file_text(c: &Calibration, runs_file: &Path) -> String {
    let pct = |e: Option<f64>| e.map_or("n/a".to_string(), |e| format!("{:.1}%", e * 100.0));
    let mut out = format!(
        "# Written by `autopar calibrate {}`: device numbers fitted to {} measured runs on {}\n\
         # by least squares on log step time, within physical ranges. Mean |time error|: {} with\n\
         # the preset's numbers, {} fitted, {} on runs held out of the fit ({}).\n\
         # Attach it to a cluster of this device: `calibration = \"<this file>\"` in its\n\
         # [[cluster]]; the cluster's own `overrides` still win.\n\
         device = \"{}\"\n\n[overrides]\n",
        runs_file.display(),
        c.runs.len(),
        c.device,
        pct(c.preset_error),
        pct(c.fitted_error),
        pct(c.held_out_error),
        c.cross_validation,
        c.device
    );
    for k in c.knobs.iter().filter(|k| k.fitted_by_runs) {
        out += &format!("{} = {}\n", k.key, round(k.fitted));
    }
    out
}

/// `v` to 6 significant digits, as written in the file.
fn round(v: f64) -> f64 {
    if v == 0.0 || !v.is_finite() {
        return v;
    }
    let scale = 10f64.powi(5 - v.abs().log10().floor() as i32);
    (v * scale).round() / scale
}
