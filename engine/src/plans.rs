//! Plan files: written atomically, read back with their schema checked.

use crate::diagnostic::Diagnostic;
use crate::error::EngineError;
use autopar_rules::plan::format::{PLAN_SCHEMA, Plan};
use std::path::Path;

/// Writes `plan` as pretty JSON to `path`, atomically.
pub fn write_plan(path: &Path, plan: &Plan) -> Result<(), EngineError> {
    let mut json = serde_json::to_vec_pretty(plan).map_err(|e| EngineError::Encode {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    json.push(b'\n');
    autopar_store::write_atomic(path, &json)?;
    Ok(())
}

/// Writes `text` to `path`, atomically.
pub fn write_text(path: &Path, text: &str) -> Result<(), EngineError> {
    autopar_store::write_atomic(path, text.as_bytes())?;
    Ok(())
}

/// Whether [`write_text`] could write `path` (see [`autopar_store::check_writable`]).
pub fn check_writable(path: &Path) -> Result<(), EngineError> {
    autopar_store::check_writable(path)?;
    Ok(())
}

/// Writes a Chrome trace (`chrome://tracing`, Perfetto) to `path`, atomically.
pub fn write_trace(path: &Path, trace: &serde_json::Value) -> Result<(), EngineError> {
    let json = serde_json::to_vec(trace).map_err(|e| EngineError::Encode {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    autopar_store::write_atomic(path, &json)?;
    Ok(())
}

/// Removes the plan (or trace) at `path` if there is one.
pub fn remove_output(path: &Path) -> Result<(), EngineError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(EngineError::Read {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// Reads the plan of `target` from `path`.
pub fn read_plan(target: &str, path: &Path) -> Result<Plan, EngineError> {
    let text = match crate::input::read_capped(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(EngineError::NoPlan {
                target: target.to_string(),
                path: path.to_path_buf(),
            });
        }
        Err(source) => {
            return Err(EngineError::Read {
                path: path.to_path_buf(),
                source,
            });
        }
    };
    parse_plan(target, path, &text)
}

/// Reads a plan from `text`, the contents of `path` (named in errors), the plan of `target`
/// unless the text names another.
pub fn parse_plan(target: &str, path: &Path, text: &str) -> Result<Plan, EngineError> {
    let located = |field: &str, e: &serde_json::Error| {
        EngineError::config(Diagnostic::from_json(path, text, field, e))
    };
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| located(".", &e))?;
    let reason = match value.get("schema").and_then(serde_json::Value::as_u64) {
        Some(s) if s == u64::from(PLAN_SCHEMA) => None,
        Some(s) => {
            // A plan names its target; a file given by path may not be the target's.
            let target = value
                .get("target")
                .and_then(serde_json::Value::as_str)
                .unwrap_or(target);
            Some(format!(
                "plan schema {s} is not {PLAN_SCHEMA} (written by another version of autopar); \
                 rebuild it with `autopar build {target}`"
            ))
        }
        None => Some(format!(
            "expected an autopar plan (a JSON object with `schema`: {PLAN_SCHEMA}), found no \
             `schema` field"
        )),
    };
    if let Some(reason) = reason {
        return Err(EngineError::BadPlan {
            path: path.to_path_buf(),
            reason,
        });
    }
    // Deserialised from the text (not the value) so that an error has its line and field.
    let mut de = serde_json::Deserializer::from_str(text);
    serde_path_to_error::deserialize(&mut de).map_err(|e| located(&e.path().to_string(), e.inner()))
}
