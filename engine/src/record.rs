//! What the last build of each target did, kept in `.autopar/builds/<target>.json` so that
//! `autopar explain` can say, for every result it recomputed, which part of its key changed.

use crate::cache::Source;
use crate::error::EngineError;
use autopar_rules::canonical::KeyParts;
use autopar_rules::cost::profile::{EntryId, ProfileRead};
use autopar_rules::solve::intra::chain::TableSolver;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// One layer cost a build asked for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerRecord {
    /// The first layer that asked, with its parallel setting (`layers.0 · mb 1 · tp 8 sp`).
    pub slot: String,
    /// Its key's components.
    pub parts: KeyParts,
    /// The profile measurements it read.
    pub reads: Vec<ProfileRead>,
    /// Where the cost came from.
    pub source: Source,
    /// Why it was recomputed (empty when it was not).
    pub reasons: Vec<String>,
}

/// The plan of a target in one build.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanRecord {
    /// Components of the target's key (what the plan depends on, as written).
    pub parts: KeyParts,
    /// The model without names, for field-level reasons.
    pub model: serde_json::Value,
    /// The target's profile measurements.
    pub profile: Vec<(EntryId, f64)>,
    /// Where the plan came from.
    pub source: Source,
    /// The inputs changed but every layer cost the search reads was unchanged, so the stored
    /// search result was reused.
    pub reused_after_change: bool,
    /// Why it was recomputed (empty when it was not).
    pub reasons: Vec<String>,
}

/// One layer table of the ILP space a stage DP read.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TableRecord {
    /// The layer (the first of its class) and the logical mesh (`layers.0 · mesh 2x4`).
    pub slot: String,
    /// Its key's components.
    pub parts: KeyParts,
    /// The profile measurements it may read.
    #[serde(default)]
    pub reads: Vec<ProfileRead>,
    /// Where the table came from; for a stage DP found in the cache, where that DP came from
    /// (its tables were not asked for again).
    pub source: Source,
    /// Why it was solved (empty when it was not).
    pub reasons: Vec<String>,
    /// What filled the table (`None`: it could not be filled, or the record predates it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub solver: Option<TableSolver>,
}

/// The ILP space's stage DP at one micro-batch size in one build.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StagesRecord {
    /// Sequences per micro-batch.
    pub micro_batch: u64,
    /// Its key's components.
    pub parts: KeyParts,
    /// Where the DP's result came from.
    pub source: Source,
    /// Why it re-ran (empty when it did not).
    pub reasons: Vec<String>,
    /// The layer tables it read.
    pub tables: Vec<TableRecord>,
    /// Whether the tables pass the work bound, and where that verdict came from: `solved`
    /// when this build's tables passed it, a cache level when a stored verdict stopped the
    /// DP before it read a table (`None`: within the bound, or the DP did not run).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub past_work_bound: Option<Source>,
}

/// What one build did for one target.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BuildRecord {
    /// Target name.
    pub target: String,
    /// When, ms since the Unix epoch.
    pub time_ms: u64,
    /// The plan.
    pub plan: PlanRecord,
    /// The distinct layer costs asked for (none when the plan was found by its key).
    pub layers: Vec<LayerRecord>,
    /// The ILP space's stage DPs, one per micro-batch size searched (none when the target
    /// searches Megatron-LM's layouts only).
    #[serde(default)]
    pub ilp: Vec<StagesRecord>,
}

impl BuildRecord {
    /// Whether `other` records the same build but for its time.
    pub fn same_build(&self, other: &BuildRecord) -> bool {
        self.target == other.target
            && self.plan == other.plan
            && self.layers == other.layers
            && self.ilp == other.ilp
    }

    /// The stage DP this build ran at micro-batch size `mb`.
    pub fn stages(&self, mb: u64) -> Option<&StagesRecord> {
        self.ilp.iter().find(|s| s.micro_batch == mb)
    }
}

/// Where the record of `target` lives under the workspace root.
pub fn record_path(root: &Path, target: &str) -> PathBuf {
    root.join(".autopar")
        .join("builds")
        .join(format!("{target}.json"))
}

/// The last build's record of `target`, if any (an unreadable record counts as none). Its
/// time is that of the last build that did the same (see [`write_record`]).
pub fn read_record(root: &Path, target: &str) -> Option<BuildRecord> {
    let path = record_path(root, target);
    let text = crate::input::read_capped(&path).ok()?;
    let mut record: BuildRecord = serde_json::from_str(&text).ok()?;
    let touched = std::fs::metadata(&path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_millis() as u64);
    record.time_ms = record.time_ms.max(touched);
    Some(record)
}

/// Stores the record of a build (compact JSON: a target of the ILP space records every layer
/// table's key components, megabytes that every build reads and writes again). A build that
/// did exactly what the last one did (`previous`, as read; every rebuild after the first that
/// finds everything cached) only sets the file's time.
pub fn write_record(
    root: &Path,
    record: &BuildRecord,
    previous: Option<&BuildRecord>,
) -> Result<(), EngineError> {
    let path = record_path(root, &record.target);
    if previous.is_some_and(|p| p.same_build(record))
        && std::fs::File::options()
            .write(true)
            .open(&path)
            .and_then(|f| f.set_modified(std::time::SystemTime::now()))
            .is_ok()
    {
        return Ok(());
    }
    let json = serde_json::to_vec(record).map_err(|e| EngineError::Encode {
        path: path.clone(),
        reason: e.to_string(),
    })?;
    autopar_store::write_atomic(&path, &json)?;
    Ok(())
}

/// `ms` since the Unix epoch as `YYYY-MM-DD HH:MM:SS UTC`.
pub fn utc(ms: u64) -> String {
    let secs = ms / 1000;
    let (days, rest) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60
    )
}

fn us(t: f64) -> String {
    format!("{t} us")
}

/// How the profile measurements read changed: one line per entry.
pub fn read_changes(old: &[ProfileRead], new: &[ProfileRead]) -> Vec<String> {
    let a: BTreeMap<&EntryId, f64> = old.iter().map(|r| (&r.entry, r.time_us)).collect();
    let b: BTreeMap<&EntryId, f64> = new.iter().map(|r| (&r.entry, r.time_us)).collect();
    let mut out = Vec::new();
    for (e, &t) in &b {
        match a.get(e) {
            Some(&u) if u.to_bits() != t.to_bits() => {
                out.push(format!("profile entry {e}: {} -> {}", us(u), us(t)));
            }
            Some(_) => {}
            None => out.push(format!("profile entry {e} now measured: {}", us(t))),
        }
    }
    for (e, &u) in &a {
        if !b.contains_key(e) {
            out.push(format!(
                "profile entry {e} no longer measured (was {})",
                us(u)
            ));
        }
    }
    out
}

/// Fields of two JSON objects that differ, as `name: old -> new` (nested objects by path).
fn field_changes(
    path: &str,
    old: &serde_json::Value,
    new: &serde_json::Value,
    out: &mut Vec<String>,
) {
    match (old, new) {
        (serde_json::Value::Object(a), serde_json::Value::Object(b)) => {
            let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            for k in keys {
                let sub = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                let null = serde_json::Value::Null;
                field_changes(
                    &sub,
                    a.get(k).unwrap_or(&null),
                    b.get(k).unwrap_or(&null),
                    out,
                );
            }
        }
        (a, b) if a != b => {
            let short = |v: &serde_json::Value| {
                let s = v.to_string();
                if s.len() > 60 {
                    "(changed)".to_string()
                } else {
                    s
                }
            };
            out.push(format!("{path}: {} -> {}", short(a), short(b)));
        }
        _ => {}
    }
}

/// Why a result was recomputed, from the components of its key that changed between `old` and
/// `new`: `say` puts each component in words (the rules version is said here); a key that did
/// not change means the stored `what` went missing.
fn reasons(
    old: &KeyParts,
    new: &KeyParts,
    what: &str,
    mut say: impl FnMut(&str, &mut Vec<String>),
) -> Vec<String> {
    let mut out = Vec::new();
    for name in new.changed_since(old) {
        match name.as_str() {
            "rules" => out.push("autopar's planning rules changed (new version)".to_string()),
            other => say(other, &mut out),
        }
    }
    if out.is_empty() {
        // Same key but not found: the stored result was evicted or removed.
        out.push(format!(
            "inputs unchanged; the stored {what} was missing (evicted, cleaned or corrupt)"
        ));
    }
    out
}

/// Why a plan was recomputed, from the components of its key that changed.
pub fn plan_reasons(old: Option<&PlanRecord>, new: &PlanRecord) -> Vec<String> {
    let Some(old) = old else {
        return vec!["first build of this target (no earlier record)".to_string()];
    };
    reasons(&old.parts, &new.parts, "plan", |name, out| match name {
        "model" => {
            let mut fields = Vec::new();
            field_changes("", &old.model, &new.model, &mut fields);
            let model = |f: &String| {
                f.trim_start_matches("transformer.")
                    .trim_start_matches("graph.")
                    .to_string()
            };
            out.push(format!(
                "model edit: {}",
                fields.iter().map(model).collect::<Vec<_>>().join("; ")
            ));
        }
        "profile" => {
            let reads = |r: &PlanRecord| -> Vec<ProfileRead> {
                r.profile
                    .iter()
                    .map(|(e, t)| ProfileRead {
                        entry: e.clone(),
                        time_us: *t,
                    })
                    .collect()
            };
            out.extend(read_changes(&reads(old), &reads(new)));
        }
        "cluster" => out.push("cluster edit (shape or device numbers)".to_string()),
        "training" => out.push("training options changed".to_string()),
        // The ILP space's options are part of the search space (its default micro-batch
        // sizes follow the global batch), so both say the same once.
        "search" | "ilp" => {
            let why = "search space or global batch changed".to_string();
            if !out.contains(&why) {
                out.push(why);
            }
        }
        other => out.push(format!("{other} changed")),
    })
}

/// Why a layer cost was recomputed.
pub fn layer_reasons(old: Option<&LayerRecord>, new: &LayerRecord) -> Vec<String> {
    let Some(old) = old else {
        return vec!["not asked for in the previous build".to_string()];
    };
    reasons(&old.parts, &new.parts, "cost", |name, out| match name {
        "profile" => out.extend(read_changes(&old.reads, &new.reads)),
        "subgraph" => out.push("the layer's ops or shapes changed (model edit)".into()),
        "device" | "link" => out.push("device numbers changed (cluster edit)".into()),
        "kernels" => out.push("kernel options changed (precision, gradient fusion)".into()),
        other => out.push(format!("{other} changed")),
    })
}

/// Why the ILP space's stage DP at one micro-batch size re-ran, from the components of its
/// key that changed since the previous build's DP at that size.
pub fn stages_reasons(previous: Option<&BuildRecord>, new: &StagesRecord) -> Vec<String> {
    let Some(previous) = previous else {
        return vec!["first build of this target (no earlier record)".to_string()];
    };
    let Some(old) = previous.stages(new.micro_batch) else {
        return vec![format!(
            "micro-batch size {} was not searched in the previous build",
            new.micro_batch
        )];
    };
    reasons(&old.parts, &new.parts, "stage DP", |name, out| {
        out.push(match name {
            "model" => "model edit".to_string(),
            "cluster" => "cluster edit (shape or device numbers)".to_string(),
            "training" => "training options changed".to_string(),
            "batch" => "global batch changed (micro-batches per step)".to_string(),
            "submeshes" => "submesh choices changed (`submeshes`)".to_string(),
            "logical_meshes" => "logical mesh shapes changed (`logical_meshes`)".to_string(),
            "budget" => "memory budget per device changed".to_string(),
            "recompute" => "recomputation allowed or not (`recompute`)".to_string(),
            "profile" => "the target's profile measurements changed".to_string(),
            other => format!("{other} changed"),
        })
    })
}

/// Why a layer table was solved, against the table of the same layer and mesh that the
/// previous build's DP at this micro-batch size read.
pub fn table_reasons(old: Option<&TableRecord>, new: &TableRecord) -> Vec<String> {
    let Some(old) = old else {
        return vec!["not read by the previous build's stage DP".to_string()];
    };
    reasons(&old.parts, &new.parts, "table", |name, out| match name {
        "profile" => out.extend(read_changes(&old.reads, &new.reads)),
        "layer" => out.push("the layer's ops or shapes changed (model edit)".to_string()),
        "mesh" => out.push("the mesh's link numbers changed (cluster network edit)".to_string()),
        "device" => out.push("device compute or memory numbers changed (cluster edit)".to_string()),
        "options" => {
            out.push("micro-batches per step, precision or solver options changed".to_string())
        }
        other => out.push(format!("{other} changed")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_build_like_the_last_keeps_its_record_and_moves_its_time() {
        let dir = tempfile::tempdir().expect("tempdir");
        let record = BuildRecord {
            target: "t".into(),
            time_ms: 1_000,
            plan: PlanRecord {
                parts: KeyParts::new("plan"),
                model: serde_json::json!({"layers": 2}),
                profile: Vec::new(),
                source: Source::Solved,
                reused_after_change: false,
                reasons: Vec::new(),
            },
            layers: Vec::new(),
            ilp: Vec::new(),
        };
        write_record(dir.path(), &record, None).expect("first write");
        let path = record_path(dir.path(), "t");
        let bytes = std::fs::read(&path).expect("record");
        let first = read_record(dir.path(), "t").expect("read back");
        assert!(first.same_build(&record));
        // The same build again (later): the bytes stay, the time moves.
        std::thread::sleep(std::time::Duration::from_millis(20));
        let again = BuildRecord {
            time_ms: 2_000,
            ..record.clone()
        };
        write_record(dir.path(), &again, Some(&first)).expect("second write");
        assert_eq!(std::fs::read(&path).expect("record"), bytes);
        let second = read_record(dir.path(), "t").expect("read back");
        assert!(
            second.time_ms > first.time_ms,
            "{} {}",
            second.time_ms,
            first.time_ms
        );
        // A different build is written in full.
        let cached = BuildRecord {
            plan: PlanRecord {
                source: Source::Local,
                ..record.plan.clone()
            },
            ..record
        };
        write_record(dir.path(), &cached, Some(&second)).expect("third write");
        let third = read_record(dir.path(), "t").expect("read back");
        assert!(third.same_build(&cached) && !third.same_build(&second));
    }

    #[test]
    fn dates() {
        assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc(951_782_400_000), "2000-02-29 00:00:00 UTC");
        assert_eq!(utc(1_795_268_437_000), "2026-11-21 13:40:37 UTC");
    }
}
