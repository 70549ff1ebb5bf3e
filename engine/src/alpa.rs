//! Alpa's profiled stage costs as JSON (`num_microbatches`, `submesh_choices`,
//! `compute_cost[L][L][S][C]`, `max_n_succ_stages[L][L][S][C]`, `num_devices` or `num_hosts` and
//! `devices_per_host`), so that costs profiled elsewhere can be planned by `solve stages`.
//! Entries that are `null`, negative, or have an end before their start are infeasible.

use crate::diagnostic::Diagnostic;
use crate::error::EngineError;
use autopar_rules::model::frontend::locate::{PathSeg, locate};
use autopar_rules::solve::inter::{
    InterError, StageOptions, StagePlan, StageProblem, place, solve,
};
use serde::Deserialize;
use std::path::Path;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStages {
    num_microbatches: u64,
    submesh_choices: Vec<(u64, u64)>,
    compute_cost: Vec<Vec<Vec<Vec<Option<f64>>>>>,
    max_n_succ_stages: Vec<Vec<Vec<Vec<Option<f64>>>>>,
    #[serde(default)]
    num_devices: Option<u64>,
    #[serde(default)]
    num_hosts: Option<u64>,
    #[serde(default)]
    devices_per_host: Option<u64>,
}

/// The solved instance, with the device ranges of each stage when the cluster shape is known.
#[derive(Clone, Debug)]
pub struct StagesReport {
    /// The plan.
    pub plan: StagePlan,
    /// Submesh shapes, by index.
    pub submeshes: Vec<(u64, u64)>,
    /// Per stage: (first device, devices) on a `hosts x devices_per_host` cluster.
    pub placement: Option<Vec<(u64, u64)>>,
}

/// Reads an instance and solves it.
pub fn solve_stages(file: &Path) -> Result<StagesReport, EngineError> {
    let text = crate::input::read_text(file)?;
    solve_text(file, &text)
}

/// Solves the instance `text`, the contents of `file` (named in errors).
pub fn solve_text(file: &Path, text: &str) -> Result<StagesReport, EngineError> {
    let raw: RawStages = serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_str(
        text,
    ))
    .map_err(|e| {
        let field = e.path().to_string();
        EngineError::config(Diagnostic::from_json(file, text, &field, e.inner()))
    })?;
    let err = |path: &[PathSeg<'_>], field: String, expected: String, found: String| {
        EngineError::config(Diagnostic::at(
            file,
            text,
            locate(text, path),
            field,
            expected,
            found,
        ))
    };
    let l = raw.compute_cost.len();
    let s = raw.submesh_choices.len();
    let c = raw
        .compute_cost
        .first()
        .and_then(|row| row.first())
        .and_then(|cell| cell.first())
        .map_or(0, Vec::len);
    // Both tables must be L x L x S x C.
    for (name, table) in [
        ("compute_cost", &raw.compute_cost),
        ("max_n_succ_stages", &raw.max_n_succ_stages),
    ] {
        if table.len() != l {
            return Err(err(
                &[PathSeg::Key(name)],
                name.into(),
                format!("{l} rows (one per first layer)"),
                format!("{} rows", table.len()),
            ));
        }
        for (k, row) in table.iter().enumerate() {
            if row.len() != l {
                return Err(err(
                    &[PathSeg::Key(name), PathSeg::Index(k)],
                    format!("{name}[{k}]"),
                    format!("{l} entries (one per last layer)"),
                    format!("{} entries", row.len()),
                ));
            }
            for (i, cell) in row.iter().enumerate() {
                if cell.len() != s || cell.iter().any(|x| x.len() != c) {
                    return Err(err(
                        &[PathSeg::Key(name), PathSeg::Index(k), PathSeg::Index(i)],
                        format!("{name}[{k}][{i}]"),
                        format!("{s} submesh entries of {c} configurations each"),
                        format!(
                            "{} entries of sizes {:?}",
                            cell.len(),
                            cell.iter().map(Vec::len).collect::<Vec<_>>()
                        ),
                    ));
                }
            }
        }
    }
    let devices = match (raw.num_devices, raw.num_hosts, raw.devices_per_host) {
        (Some(d), None, None) => d,
        (None, Some(h), Some(m)) => h.saturating_mul(m),
        (Some(d), Some(h), Some(m)) if d == h.saturating_mul(m) => d,
        _ => {
            return Err(err(
                &[PathSeg::Key("num_devices")],
                "num_devices".into(),
                "num_devices, or num_hosts and devices_per_host (consistent if both)".into(),
                format!(
                    "num_devices {:?}, num_hosts {:?}, devices_per_host {:?}",
                    raw.num_devices, raw.num_hosts, raw.devices_per_host
                ),
            ));
        }
    };
    let flat = |t: &Vec<Vec<Vec<Vec<Option<f64>>>>>, missing: f64| -> Vec<f64> {
        t.iter()
            .flatten()
            .flatten()
            .flatten()
            .map(|x| x.unwrap_or(missing))
            .collect()
    };
    let max_succ: Vec<i64> = flat(&raw.max_n_succ_stages, -1.0)
        .into_iter()
        .map(|x| {
            if x.is_finite() {
                x.floor().clamp(-1.0, i64::MAX as f64) as i64
            } else {
                -1
            }
        })
        .collect();
    let problem = StageProblem {
        layers: l,
        submeshes: raw.submesh_choices.clone(),
        configs: c,
        cost: flat(&raw.compute_cost, f64::INFINITY),
        max_succ,
        devices,
        microbatches: raw.num_microbatches,
    };
    let plan = solve(problem, StageOptions::default()).map_err(|e| match e {
        InterError::Shape(why) => err(
            &[],
            "(document)".into(),
            "a well-formed instance".into(),
            why,
        ),
        InterError::TooLarge {
            layers,
            devices,
            entries,
            limit,
        } => {
            let key = if raw.num_devices.is_some() {
                "num_devices"
            } else {
                "num_hosts"
            };
            err(
                &[PathSeg::Key(key)],
                key.into(),
                format!(
                    "a device count whose DP table over {layers} layers has at most {limit} entries"
                ),
                format!("{devices} devices ({entries} entries)"),
            )
        }
        infeasible @ InterError::Infeasible { .. } => {
            EngineError::Infeasible(infeasible.to_string())
        }
    })?;
    let placement = match (raw.num_hosts, raw.devices_per_host) {
        (Some(h), Some(m)) => {
            let shapes: Vec<(u64, u64)> = plan
                .stages
                .iter()
                .map(|st| raw.submesh_choices[st.submesh])
                .collect();
            place(&shapes, h, m)
        }
        _ => None,
    };
    Ok(StagesReport {
        plan,
        submeshes: raw.submesh_choices,
        placement,
    })
}
