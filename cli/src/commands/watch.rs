//! `autopar watch`: build, then rebuild whenever the workspace file or a file it reads changes.
//! Results stay in memory between builds; the local store is opened for each build only, so
//! other `autopar` commands can use it while `watch` waits.

use super::build::run_with;
use crate::Failure;
use crate::args::WatchArgs;
use crate::output::{errln, outln};
use autopar_engine::cache::{Cache, Memory, RemoteFlags, cache_dir, remote_config};
use autopar_engine::session::Session;
use std::path::Path;
use std::time::Duration;

pub fn run(
    session: &mut Session,
    args: &WatchArgs,
    cache: Option<&Path>,
    remote: &RemoteFlags,
) -> Result<(), Failure> {
    let memory = Memory::default();
    let mut keys = session.target_keys();
    build_once(session, args, cache, remote, &memory);
    loop {
        std::thread::sleep(Duration::from_millis(args.interval_ms));
        let changed = session.refresh();
        if changed.is_empty() {
            continue;
        }
        for p in &changed {
            errln!("changed: {}", p.display());
        }
        let now = session.target_keys();
        if now == keys && session.workspace().is_ok() {
            outln!("no target's inputs changed; nothing to rebuild");
            continue;
        }
        keys = now;
        build_once(session, args, cache, remote, &memory);
    }
}

fn build_once(
    session: &Session,
    args: &WatchArgs,
    dir: Option<&Path>,
    remote: &RemoteFlags,
    memory: &Memory,
) {
    let result = session.workspace().map_err(Failure::from).and_then(|ws| {
        let mut cache = Cache::open_with_memory(&cache_dir(dir, &ws), memory.clone());
        if let Some(cfg) = remote_config(remote, &ws)? {
            cache = cache.with_remote(cfg);
        }
        run_with(&ws, &args.targets, false, false, &cache)
    });
    match result {
        Ok(()) | Err(Failure::Partial) => {}
        Err(Failure::Input(e)) | Err(Failure::Failed(e)) => errln!("error: {e:#}"),
    }
    outln!("watching for changes (Ctrl-C to stop)");
}
