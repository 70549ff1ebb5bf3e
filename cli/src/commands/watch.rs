//! `autopar watch`: build, then rebuild whenever the workspace file or a file it reads changes,
//! keeping every result in memory between builds.

use super::build::run_with;
use crate::Failure;
use crate::args::WatchArgs;
use autopar_engine::cache::{Cache, cache_dir};
use autopar_engine::session::Session;
use std::path::Path;
use std::time::Duration;

pub fn run(session: &mut Session, args: &WatchArgs, cache: Option<&Path>) -> Result<(), Failure> {
    let ws = session.workspace()?;
    let cache = Cache::open(&cache_dir(cache, &ws));
    let mut keys = session.target_keys();
    build_once(session, args, &cache);
    loop {
        std::thread::sleep(Duration::from_millis(args.interval_ms));
        let changed = session.refresh();
        if changed.is_empty() {
            continue;
        }
        for p in &changed {
            eprintln!("changed: {}", p.display());
        }
        let now = session.target_keys();
        if now == keys && session.workspace().is_ok() {
            println!("no target's inputs changed; nothing to rebuild");
            continue;
        }
        keys = now;
        build_once(session, args, &cache);
    }
}

fn build_once(session: &Session, args: &WatchArgs, cache: &Cache) {
    let result = session
        .workspace()
        .map_err(Failure::from)
        .and_then(|ws| run_with(&ws, &args.targets, false, cache));
    match result {
        Ok(()) | Err(Failure::Partial) => {}
        Err(Failure::Input(e)) | Err(Failure::Failed(e)) => eprintln!("error: {e:#}"),
    }
    println!("watching for changes (Ctrl-C to stop)");
}
