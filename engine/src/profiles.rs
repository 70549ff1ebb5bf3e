//! Profiles for a target: the template of what to measure, and measuring it on a backend
//! (`autopar profile run`).

use crate::EngineError;
use crate::executor::cuda;
use crate::executor::measure::{OpBench, time_collective};
use crate::executor::{Backend, CPU_DEVICE, ExecError};
use crate::workspace::{Target, Workspace};
use autopar_rules::cost::profile::{EntryId, OpSignature, Profile};
use autopar_rules::plan::estimate::Estimator;
use autopar_rules::plan::search::pricing_combinations;
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

/// Measures every entry of `model` on `cluster`'s template on `backend`; `progress` is told
/// each entry before it is measured, with its index and the count.
pub fn measure(
    ws: &Workspace,
    model: &str,
    cluster: &str,
    backend: Backend,
    progress: &mut dyn FnMut(usize, usize, &EntryId),
) -> Result<Measured, EngineError> {
    let (modelled, targets) = model_template(ws, model, cluster)?;
    match backend {
        Backend::Cpu => {}
        Backend::Cuda => cuda::probe()?,
        Backend::Jax => {
            return Err(ExecError::Unavailable(
                "`profile run --backend jax` does not time kernels through XLA yet; measure with \
                 --backend cpu, or run a plan with `autopar run TARGET --backend jax`"
                    .into(),
            )
            .into());
        }
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
                if let Some(flops) = b.product_flops() {
                    let rate = flops / t.seconds.max(f64::MIN_POSITIVE);
                    if fastest_product.as_ref().is_none_or(|(_, r)| rate > *r) {
                        fastest_product = Some((sig.clone(), rate));
                    }
                }
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
