//! `autopar profile diff`, `template`, `run` and `import`.

use super::print_json;
use crate::Failure;
use crate::args::ProfileRunArgs;
use crate::output::{err, errln, out, outln};
use crate::render;
use autopar_engine::EngineError;
use autopar_engine::cache::LocalCache;
use autopar_engine::cache::cache_dir;
use autopar_engine::diagnostic::Diagnostic;
use autopar_engine::executor::Backend;
use autopar_engine::session::Session;
use autopar_rules::canonical::digest;
use autopar_rules::cost::profile::{EntryId, Profile, import_profile, parse_profile};
use serde_json::json;
use std::path::Path;

/// A profile from a file, or a workspace profile by name.
fn load(session: &Session, arg: &str) -> Result<(Profile, Option<String>), Failure> {
    let path = Path::new(arg);
    if path.is_file() {
        let text = autopar_engine::input::read_text(path)?;
        let p = parse_profile(&text)
            .map_err(|e| EngineError::config(Diagnostic::from_field(path, &text, e, "")))?;
        // A file the workspace declares is that profile.
        let name = session.workspace().ok().and_then(|ws| {
            let full = std::fs::canonicalize(path).ok()?;
            ws.profiles
                .iter()
                .find(|p| std::fs::canonicalize(&p.path).ok().as_ref() == Some(&full))
                .map(|p| p.name.clone())
        });
        return Ok((p, name));
    }
    let ws = session.workspace()?;
    match ws.profiles.iter().find(|p| p.name == arg) {
        Some(p) => Ok(((*p.profile).clone(), Some(p.name.clone()))),
        None => Err(Failure::Input(anyhow::anyhow!(
            "profile `{arg}`: expected a profile file or one of the workspace's [[profile]] names ({}), found neither",
            ws.profiles
                .iter()
                .map(|p| p.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

/// The hash under which cached results record that they read an entry's signature.
fn signature_digest(e: &EntryId) -> [u8; 32] {
    match e {
        EntryId::Op(s) => digest(s).0,
        EntryId::Collective(s, _) => digest(s).0,
    }
}

pub fn diff(
    session: &Session,
    cache: Option<&Path>,
    old: &str,
    new: &str,
    json: bool,
) -> Result<(), Failure> {
    let (a, a_name) = load(session, old)?;
    let (b, b_name) = load(session, new)?;
    let d = a.diff(&b);
    let touched: Vec<[u8; 32]> = d.entries().map(signature_digest).collect();
    // Cached results whose inputs include a changed signature.
    let mut invalidated = Vec::new();
    if let Ok(ws) = session.workspace()
        && let Ok(local) =
            LocalCache::open(&cache_dir(cache, &ws), autopar_engine::cache::LOCK_WAIT)
        && let Ok(entries) = local.entries()
    {
        for (key, meta) in entries {
            if meta.reads.iter().any(|r| touched.contains(r)) {
                invalidated.push((key.hex(), meta.kind, meta.description));
            }
        }
    }
    invalidated.sort_by(|x, y| x.2.cmp(&y.2));
    // Targets that read either profile.
    let targets: Vec<String> = match session.workspace() {
        Ok(ws) => ws
            .targets
            .iter()
            .filter(|t| {
                t.profiles.iter().any(|&i| {
                    Some(&ws.profiles[i].name) == a_name.as_ref()
                        || Some(&ws.profiles[i].name) == b_name.as_ref()
                })
            })
            .map(|t| t.name.clone())
            .collect(),
        Err(_) => Vec::new(),
    };
    if json {
        return print_json(&json!({
            "changed": d.changed.iter().map(|(e, o, n)| json!({"entry": e.to_string(), "old_us": o, "new_us": n})).collect::<Vec<_>>(),
            "added": d.added.iter().map(|(e, t)| json!({"entry": e.to_string(), "time_us": t})).collect::<Vec<_>>(),
            "removed": d.removed.iter().map(|(e, t)| json!({"entry": e.to_string(), "time_us": t})).collect::<Vec<_>>(),
            "invalidates": invalidated.iter().map(|(k, kind, desc)| json!({"key": k, "kind": kind, "description": desc})).collect::<Vec<_>>(),
            "targets": targets,
        }));
    }
    outln!(
        "{} changed, {} added, {} removed",
        d.changed.len(),
        d.added.len(),
        d.removed.len()
    );
    for (e, o, n) in &d.changed {
        outln!("  changed  {e}: {o} us -> {n} us");
    }
    for (e, t) in &d.added {
        outln!("  added    {e}: {t} us");
    }
    for (e, t) in &d.removed {
        outln!("  removed  {e}: {t} us");
    }
    if invalidated.is_empty() {
        outln!("no cached result reads a changed entry");
    } else {
        outln!(
            "invalidates {} cached result{}:",
            invalidated.len(),
            if invalidated.len() == 1 { "" } else { "s" }
        );
        for (_, kind, desc) in &invalidated {
            outln!("  {kind:<11} {desc}");
        }
    }
    if !targets.is_empty() {
        outln!(
            "targets reading these profiles: {} (each re-plans only if a layer cost it reads changes)",
            targets.join(", ")
        );
    }
    Ok(())
}

pub fn import(input: &Path, output: Option<&Path>, device: Option<&str>) -> Result<(), Failure> {
    let text = autopar_engine::input::read_text(input)?;
    let p = import_profile(&text, device)
        .map_err(|e| EngineError::config(Diagnostic::from_field(input, &text, e, "")))?;
    let canonical = p.to_canonical_json();
    match output {
        Some(out) => {
            autopar_engine::plans::write_text(out, &canonical)?;
            errln!("wrote {} ({} measurements)", out.display(), p.len());
        }
        None => out!("{canonical}"),
    }
    Ok(())
}

pub fn template(session: &Session, target: &str, output: Option<&Path>) -> Result<(), Failure> {
    let ws = session.workspace()?;
    let t = autopar_engine::build::select(&ws, &[target.to_string()])?
        .first()
        .copied()
        .ok_or_else(|| Failure::Input(anyhow::anyhow!("no target `{target}`")))?;
    let p = autopar_engine::profiles::template(&ws, t);
    let text = p.to_canonical_json();
    match output {
        Some(out) => {
            autopar_engine::plans::write_text(out, &text)?;
            errln!(
                "wrote {} ({} kernels and collectives to measure)",
                out.display(),
                p.len()
            );
        }
        None => out!("{text}"),
    }
    Ok(())
}

pub fn run(session: &Session, a: &ProfileRunArgs) -> Result<(), Failure> {
    let ws = session.workspace()?;
    let backend = Backend::from(a.backend);
    // Found out now, not after the measurements.
    if let Some(path) = &a.output {
        autopar_engine::plans::check_writable(path).map_err(|e| Failure::Input(e.into()))?;
    }
    let bar = crate::progress::bar("{spinner} measuring [{bar:30}] {pos}/{len} {msg}");
    let mut progress = |i: usize, n: usize, e: &EntryId| {
        if let Some(bar) = &bar {
            bar.set_length(n as u64);
            bar.set_position(i as u64);
            bar.set_message(e.to_string());
        }
    };
    let measured = autopar_engine::profiles::measure(
        &ws,
        &a.model,
        &a.cluster,
        backend,
        a.python.as_deref(),
        &mut progress,
    )?;
    if let Some(bar) = &bar {
        bar.finish_and_clear();
    }
    // Measurements are compared with the model of the device they were taken on: the
    // cluster's (with its overrides) when that is it, else the backend's preset.
    let device = ws
        .cluster(&a.cluster)
        .map(|c| c.device.clone())
        .filter(|d| d.name == measured.profile.device)
        .or_else(|| autopar_rules::cost::cluster::preset(&measured.profile.device))
        .ok_or_else(|| {
            Failure::Failed(anyhow::anyhow!(
                "no device model named `{}`",
                measured.profile.device
            ))
        })?;
    let summary = if a.json {
        serde_json::to_string_pretty(&render::profile_run_json(&measured, &device, a, backend))
            .map_err(|e| Failure::Failed(e.into()))?
            + "\n"
    } else {
        render::profile_run(&measured, &device, a, backend)
    };
    let text = measured.profile.to_canonical_json();
    match &a.output {
        Some(path) => {
            autopar_engine::plans::write_text(path, &text)?;
            out!("{summary}");
            let wrote = format!(
                "wrote {} ({} measurements, device `{}`)",
                path.display(),
                measured.profile.len(),
                measured.profile.device
            );
            // Standard output stays one JSON document with --json.
            if a.json {
                errln!("{wrote}");
            } else {
                outln!("{wrote}");
            }
        }
        None => {
            err!("{summary}");
            out!("{text}");
        }
    }
    Ok(())
}
