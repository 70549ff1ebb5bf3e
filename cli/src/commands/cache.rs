//! `autopar cache stats|verify|gc` and `autopar clean`.

use super::print_json;
use crate::Failure;
use crate::output::outln;
use crate::render;
use autopar_engine::cache::LocalCache;
use autopar_engine::cache::cache_dir;
use autopar_engine::server;
use autopar_engine::session::Session;
use std::path::Path;

fn open(session: &Session, dir: Option<&Path>) -> Result<LocalCache, Failure> {
    let ws = session.workspace()?;
    let dir = cache_dir(dir, &ws);
    LocalCache::open(&dir, autopar_engine::cache::LOCK_WAIT)
        .map_err(|e| Failure::Failed(anyhow::Error::new(e)))
}

pub fn stats(session: &Session, dir: Option<&Path>, json: bool) -> Result<(), Failure> {
    let cache = open(session, dir)?;
    let s = cache
        .stats()
        .map_err(|e| Failure::Failed(anyhow::Error::new(e)))?;
    if json {
        return print_json(&s);
    }
    outln!(
        "{}: {} entries, {} of results, {} on disk",
        cache.path().display(),
        s.entries,
        render::bytes(s.bytes as f64),
        render::bytes(s.disk_bytes as f64)
    );
    for (kind, n, bytes) in &s.kinds {
        outln!(
            "  {kind:<12} {n:>8} entries {:>12}",
            render::bytes(*bytes as f64)
        );
    }
    Ok(())
}

pub fn verify(session: &Session, dir: Option<&Path>, json: bool) -> Result<(), Failure> {
    let cache = open(session, dir)?;
    let r = cache
        .verify()
        .map_err(|e| Failure::Failed(anyhow::Error::new(e)))?;
    if json {
        return print_json(&r);
    }
    outln!(
        "{}: {} entries checked, {} corrupt removed ({} damaged, {} of another key, {} of an \
         earlier autopar, {} incomplete)",
        cache.path().display(),
        r.checked,
        r.removed,
        r.damaged,
        r.other_key,
        r.old_layout,
        r.orphans
    );
    for repair in &r.repairs {
        outln!(
            "  the database was damaged ({}); moved aside to {} and replaced by a new one{}",
            repair.reason,
            repair.moved_to.display(),
            match repair.kept {
                0 => String::new(),
                n => format!(" holding the {n} entries that still verified"),
            }
        );
    }
    for damage in &r.damage {
        outln!("  since the last build, {damage}");
    }
    Ok(())
}

/// `500M`, `2G`, `1048576` -> bytes.
fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let (digits, scale) = match s.chars().last()?.to_ascii_uppercase() {
        'K' => (&s[..s.len() - 1], 1u64 << 10),
        'M' => (&s[..s.len() - 1], 1 << 20),
        'G' => (&s[..s.len() - 1], 1 << 30),
        'T' => (&s[..s.len() - 1], 1 << 40),
        _ => (s, 1),
    };
    let x: f64 = digits.trim().parse().ok()?;
    (x.is_finite() && x >= 0.0).then_some((x * scale as f64) as u64)
}

pub fn gc(session: &Session, dir: Option<&Path>, max_size: &str) -> Result<(), Failure> {
    let Some(max) = parse_size(max_size) else {
        return Err(Failure::Input(anyhow::anyhow!(
            "--max-size: expected a size such as 500M or 2G, found `{max_size}`"
        )));
    };
    let cache = open(session, dir)?;
    let r = cache
        .gc(max)
        .map_err(|e| Failure::Failed(anyhow::Error::new(e)))?;
    outln!(
        "{}: removed {} entries ({}), {} left",
        cache.path().display(),
        r.removed,
        render::bytes(r.freed as f64),
        render::bytes(r.remaining as f64)
    );
    Ok(())
}

pub fn serve(a: &crate::args::ServeArgs) -> Result<(), Failure> {
    let size = |flag: &str, v: &str| {
        parse_size(v).filter(|&n| n > 0).ok_or_else(|| {
            Failure::Input(anyhow::anyhow!(
                "{flag}: expected a size such as 500M or 2G, found `{v}`"
            ))
        })
    };
    let max_total = size("--max-size", &a.max_size)?;
    let max_blob = size("--max-blob", &a.max_blob)?;
    let max_inflight = size("--max-inflight", &a.max_inflight)?;
    let tokens = credentials(
        a.tokens.as_deref(),
        server::parse_tokens,
        "`read <token>` or `readwrite <token>`",
    )?;
    let users = credentials(a.htpasswd.as_deref(), server::parse_htpasswd, "`user:hash`")?;
    let tls = match (&a.tls_cert, &a.tls_key) {
        (Some(cert), Some(key)) => Some(server::TlsPem {
            cert: autopar_engine::input::read_text(cert)?.into_bytes(),
            key: autopar_engine::input::read_text(key)?.into_bytes(),
        }),
        _ => None,
    };
    if let Some(pem) = &tls {
        server::check_tls(pem).map_err(|reason| {
            Failure::Input(anyhow::anyhow!(
                "--tls-cert {} --tls-key {}: {reason}",
                a.tls_cert
                    .as_deref()
                    .map_or(String::new(), |p| p.display().to_string()),
                a.tls_key
                    .as_deref()
                    .map_or(String::new(), |p| p.display().to_string())
            ))
        })?;
    }
    let scheme = if tls.is_some() { "https" } else { "http" };
    let cfg = server::ServeConfig {
        dir: a.dir.clone(),
        listen: a.listen.clone(),
        tokens,
        users,
        allow_anonymous_read: a.allow_anonymous_read,
        max_blob,
        max_total,
        max_inflight,
        idle_timeout: std::time::Duration::from_millis(a.idle_timeout_ms),
        tls,
    };
    let status = server::serve(cfg, |addr| {
        outln!("serving {} on {scheme}://{addr}", a.dir.display());
    })
    .map_err(|e| Failure::Failed(anyhow::Error::new(e)))?;
    outln!(
        "stopped: {} entries, {} hits, {} misses, {} uploads, {} rejected",
        status.entries,
        status.hits,
        status.misses,
        status.uploads,
        status.rejects
    );
    Ok(())
}

/// A credentials file's parser: its entries, or the line and message of the first bad one.
type Parser<T> = fn(&str) -> Result<Vec<T>, (usize, String)>;

/// The entries of a credentials file (`None`: no file, no entries), refused with the line of a
/// malformed one, or when the file holds none.
fn credentials<T>(path: Option<&Path>, parse: Parser<T>, line: &str) -> Result<Vec<T>, Failure> {
    let Some(path) = path else {
        return Ok(Vec::new());
    };
    let text = autopar_engine::input::read_text(path)?;
    let entries = parse(&text)
        .map_err(|(n, msg)| Failure::Input(anyhow::anyhow!("{}:{n}: {msg}", path.display())))?;
    if entries.is_empty() {
        return Err(Failure::Input(anyhow::anyhow!(
            "{}: expected at least one {line} line, found none",
            path.display()
        )));
    }
    Ok(entries)
}

pub fn clean(session: &Session, dir: Option<&Path>, with_cache: bool) -> Result<(), Failure> {
    let ws = session.workspace()?;
    let mut removed = 0;
    for t in &ws.targets {
        for path in [
            ws.plan_path(&t.name),
            ws.trace_path(&t.name),
            autopar_engine::record::record_path(&ws.root, &t.name),
        ] {
            if path.exists() {
                autopar_engine::plans::remove_output(&path)?;
                removed += 1;
            }
        }
    }
    outln!("removed {removed} plan, trace and record files");
    if with_cache {
        let cache = open(session, dir)?;
        let n = cache
            .clear()
            .map_err(|e| Failure::Failed(anyhow::Error::new(e)))?;
        outln!("emptied {} ({n} entries)", cache.path().display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1048576"), Some(1 << 20));
        assert_eq!(parse_size("500M"), Some(500 << 20));
        assert_eq!(parse_size("1.5k"), Some(1536));
        assert_eq!(parse_size("2G"), Some(2 << 30));
        assert_eq!(parse_size("x"), None);
        assert_eq!(parse_size("-1M"), None);
        assert_eq!(parse_size(""), None);
    }
}
