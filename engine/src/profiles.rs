//! Profiles for a target: the template of what to measure, and measuring it on a backend
//! (`autopar profile run`).

use crate::EngineError;
use crate::executor::measure::{OpBench, time_collective};
use crate::executor::{Backend, CPU_DEVICE, ExecError};
use crate::executor::{cuda, jax};
use crate::workspace::{Target, Workspace};
use autopar_rules::cost::profile::{EntryId, OpSignature, Profile};
use autopar_rules::plan::estimate::Estimator;
use autopar_rules::plan::search::pricing_combinations;
use std::path::Path;
use std::time::Instant;

/// Every kernel and tensor-parallel collective `t`'s search prices, with the times the
/// analytic model gives them: measure these and put the results in a profile.
pub fn template(ws: &Workspace, t: &Target) -> Profile {
    let model = &ws.models[t.model];
    let cluster = &ws.clusters[t.cluster];
    let est = Estimator::new(&model.name, &model.def, cluster, t.options);
    let mut out = Profile::new(cluster.device.name.clone());
    for key in pricing_combinations(&t.search, cluster.gpus(), t.global_batch) {
        // Combinations that cannot run have nothing to measure.
        if let Ok(p) = est.modelled_profile(key) {
            out = out.overlaid(&p);
        }
    }
    out
}

/// What `model` on `cluster` runs: the union of the templates of every target that trains
/// that model on that cluster, and those targets' names.
pub fn model_template(
    ws: &Workspace,
    model: &str,
    cluster: &str,
) -> Result<(Profile, Vec<String>), EngineError> {
    // The position of `name` among the workspace's `names` of one kind.
    let index = |what: &'static str, name: &str, names: Vec<&str>| {
        names
            .iter()
            .position(|&n| n == name)
            .ok_or_else(|| EngineError::Unknown {
                what,
                name: name.to_string(),
                expected: format!("one of the workspace's: {}", names.join(", ")),
            })
    };
    let m = index(
        "model",
        model,
        ws.models.iter().map(|m| m.name.as_str()).collect(),
    )?;
    let c = index(
        "cluster",
        cluster,
        ws.clusters.iter().map(|c| c.name.as_str()).collect(),
    )?;
    let targets: Vec<&Target> = ws
        .targets
        .iter()
        .filter(|t| t.model == m && t.cluster == c)
        .collect();
    if targets.is_empty() {
        let mut pairs: Vec<String> = ws
            .targets
            .iter()
            .map(|t| {
                format!(
                    "{} on {}",
                    ws.models[t.model].name, ws.clusters[t.cluster].name
                )
            })
            .collect();
        pairs.sort();
        pairs.dedup();
        return Err(EngineError::Unknown {
            what: "model and cluster pair",
            name: format!("{model} on {cluster}"),
            expected: format!(
                "the model and cluster of a [[target]] (their sequence length, batch and search \
                 space say which shapes run): {}",
                pairs.join(", ")
            ),
        });
    }
    let mut out = Profile::new(ws.clusters[c].device.name.clone());
    for t in &targets {
        out = out.overlaid(&template(ws, t));
    }
    Ok((out, targets.iter().map(|t| t.name.clone()).collect()))
}

/// One entry `profile run` could not measure, and why (the analytic model keeps pricing it).
#[derive(Clone, Debug, PartialEq)]
pub struct Skipped {
    /// The entry.
    pub entry: EntryId,
    /// Why.
    pub reason: String,
}

/// What `profile run` measured.
#[derive(Clone, Debug)]
pub struct Measured {
    /// The measurements, on the backend's device.
    pub profile: Profile,
    /// The same entries priced by the analytic model for the cluster's device.
    pub modelled: Profile,
    /// Entries with no kernel on the backend.
    pub skipped: Vec<Skipped>,
    /// Targets whose shapes were measured.
    pub targets: Vec<String>,
    /// The matrix product that ran fastest, with its rate in FLOP/s.
    pub fastest_product: Option<(OpSignature, f64)>,
    /// Wall time of the measurements, s.
    pub seconds: f64,
}

impl Measured {
    /// Whether the modelled times are for the device the measurements were taken on, so the
    /// two compare.
    pub fn compares_with_model(&self) -> bool {
        self.modelled.device == self.profile.device
    }
}

/// Keeps `sig` as the fastest product so far when its `flops` in `seconds` beat it.
fn note_product(
    fastest: &mut Option<(OpSignature, f64)>,
    sig: &OpSignature,
    flops: Option<f64>,
    seconds: f64,
) {
    if let Some(flops) = flops {
        let rate = flops / seconds.max(f64::MIN_POSITIVE);
        if fastest.as_ref().is_none_or(|(_, r)| rate > *r) {
            *fastest = Some((sig.clone(), rate));
        }
    }
}

/// [`measure`] through XLA: every entry the CPU backend would time, as the same computation,
/// timed by one JAX process on the devices it sees (the profile's device is theirs).
fn measure_jax(
    modelled: Profile,
    targets: Vec<String>,
    python: Option<&Path>,
    progress: &mut dyn FnMut(usize, usize, &EntryId),
) -> Result<Measured, EngineError> {
    let python = jax::interpreter(python);
    jax::probe(&python)?;
    let start = Instant::now();
    let entries = modelled.entries();
    let mut skipped = Vec::new();
    // (entry, its work for the profiler, the FLOPs of a product)
    let mut work = Vec::new();
    for (i, (entry, _)) in entries.iter().enumerate() {
        progress(i, entries.len(), entry);
        match entry {
            EntryId::Op(sig) => match OpBench::new(sig) {
                Ok(b) => work.push((entry, b.jax_work(), b.product_flops())),
                Err(e @ (ExecError::NoKernel(_) | ExecError::TooLarge(_))) => {
                    skipped.push(Skipped {
                        entry: entry.clone(),
                        reason: e.to_string(),
                    })
                }
                Err(e) => return Err(e.into()),
            },
            EntryId::Collective(sig, bytes) => work.push((
                entry,
                serde_json::json!({
                    "collective": sig.collective,
                    "ranks": sig.ranks,
                    "bytes": bytes,
                }),
                None,
            )),
        }
    }
    let devices = entries
        .iter()
        .filter_map(|(e, _)| match e {
            EntryId::Collective(sig, _) => usize::try_from(sig.ranks).ok(),
            EntryId::Op(_) => None,
        })
        .max()
        .unwrap_or(1);
    let list: Vec<serde_json::Value> = work.iter().map(|(_, w, _)| w.clone()).collect();
    let timed = jax::profile::time(&python, &list, devices)?;
    let mut profile = Profile::new(jax::profile::device_name(
        &timed.platform,
        &timed.device_kind,
    )?);
    let mut fastest_product: Option<(OpSignature, f64)> = None;
    for ((entry, _, flops), result) in work.into_iter().zip(timed.results) {
        match (entry, result) {
            (EntryId::Op(sig), Ok(seconds)) => {
                note_product(&mut fastest_product, sig, flops, seconds);
                profile.insert_op(sig.clone(), seconds * 1e6);
            }
            (EntryId::Collective(sig, bytes), Ok(seconds)) => {
                profile.insert_collective(*sig, *bytes, seconds * 1e6)
            }
            (_, Err(reason)) => skipped.push(Skipped {
                entry: entry.clone(),
                reason,
            }),
        }
    }
    Ok(Measured {
        profile,
        modelled,
        skipped,
        targets,
        fastest_product,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// Measures every entry of `model` on `cluster`'s template on `backend`; `progress` is told
/// each entry before it is measured, with its index and the count.
pub fn measure(
    ws: &Workspace,
    model: &str,
    cluster: &str,
    backend: Backend,
    python: Option<&Path>,
    progress: &mut dyn FnMut(usize, usize, &EntryId),
) -> Result<Measured, EngineError> {
    let (modelled, targets) = model_template(ws, model, cluster)?;
    match backend {
        Backend::Cpu => {}
        Backend::Cuda => cuda::probe()?,
        Backend::Jax => return measure_jax(modelled, targets, python, progress),
    }
    let start = Instant::now();
    let entries = modelled.entries();
    let mut profile = Profile::new(CPU_DEVICE);
    let mut skipped = Vec::new();
    let mut fastest_product: Option<(OpSignature, f64)> = None;
    for (i, (entry, _)) in entries.iter().enumerate() {
        progress(i, entries.len(), entry);
        let measured = match entry {
            EntryId::Op(sig) => OpBench::new(sig).and_then(|b| {
                let t = b.time()?;
                note_product(&mut fastest_product, sig, b.product_flops(), t.seconds);
                profile.insert_op(sig.clone(), t.seconds * 1e6);
                Ok(())
            }),
            EntryId::Collective(sig, bytes) => {
                time_collective(sig.collective, sig.ranks as usize, *bytes)
                    .map(|t| profile.insert_collective(*sig, *bytes, t.seconds * 1e6))
            }
        };
        match measured {
            Ok(()) => {}
            Err(e @ (ExecError::NoKernel(_) | ExecError::TooLarge(_))) => skipped.push(Skipped {
                entry: entry.clone(),
                reason: e.to_string(),
            }),
            Err(e) => return Err(e.into()),
        }
    }
    Ok(Measured {
        profile,
        modelled,
        skipped,
        targets,
        fastest_product,
        seconds: start.elapsed().as_secs_f64(),
    })
}
