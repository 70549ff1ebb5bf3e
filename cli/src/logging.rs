//! Log output through `tracing`, on stderr: `-v` raises the level, `RUST_LOG` overrides.

use std::io::IsTerminal;
use tracing_subscriber::EnvFilter;

/// Installs the global subscriber (once; later calls are ignored).
pub fn init(verbose: u8) {
    let level = match verbose {
        0 => "warn",
        1 => "info",
        2 => "debug",
        _ => "trace",
    };
    // The storage crate logs its own view of a damaged database; the store reports it in
    // autopar's words (one warning), so sled speaks only at debug level and above.
    let sled = if verbose >= 2 { level } else { "off" };
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(format!("{level},sled={sled}")));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        // Its default reports a failed write with `eprintln!`, which panics when stderr is a
        // closed pipe; the storage crate logs from inside the store's boundary, where a panic
        // reads as a damaged database.
        .log_internal_errors(false)
        .try_init();
}
