//! The shipped `autopar` entry point, built inside this package so that cargo hands its path to
//! the integration tests (`CARGO_BIN_EXE_autopar-e2e`): the tests run the real binary as a
//! process, exit codes and all.
//!
//! One addition for the failure tests: `AUTOPAR_E2E_FAULT=enospc` (or `erofs`) makes every
//! write of the local cache fail as a full (or read-only) disk would, and
//! `AUTOPAR_E2E_FAULT=damaged-at:N` makes the N-th call into the cache's database fail as a
//! damaged database does.

fn main() -> std::process::ExitCode {
    use autopar_store::fault::{Fault, inject};
    use std::io::ErrorKind;
    match std::env::var("AUTOPAR_E2E_FAULT").as_deref() {
        Ok("enospc") => inject(Fault::WritesFail(ErrorKind::StorageFull)),
        Ok("erofs") => inject(Fault::WritesFail(ErrorKind::ReadOnlyFilesystem)),
        Ok(other) => {
            if let Some(n) = other
                .strip_prefix("damaged-at:")
                .and_then(|n| n.parse().ok())
            {
                inject(Fault::DamagedAt(n));
            }
        }
        _ => {}
    }
    autopar_cli::main()
}
