//! Fault injection for the failure tests (cargo feature `fault-injection`, which only the test
//! crate enables): makes every write of the local store fail as a full or read-only disk would,
//! or its database fail as a damaged one does in the middle of a build, so that what a build
//! does then can be tested on any machine, as any user.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

/// A fault the local store simulates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Every write fails with this error (`StorageFull` for a full disk, `ReadOnlyFilesystem`
    /// or `PermissionDenied` for a read-only one); reads work.
    WritesFail(std::io::ErrorKind),
    /// The `n`-th call into the database (counting from 1) fails as sled does on damaged
    /// pages, once; the calls before and after it work.
    DamagedAt(u64),
}

/// Calls into the database so far, for [`Fault::DamagedAt`].
static CALLS: AtomicU64 = AtomicU64::new(0);

static FAULT: OnceLock<Fault> = OnceLock::new();

/// Turns `fault` on for the rest of the process (the first call wins).
pub fn inject(fault: Fault) {
    let _ = FAULT.set(fault);
}

/// The error an injected fault makes a write fail with, if any.
pub(crate) fn write_error() -> Option<std::io::Error> {
    match FAULT.get() {
        Some(Fault::WritesFail(kind)) => Some(std::io::Error::from(*kind)),
        _ => None,
    }
}

/// Whether the call into the database about to be made is the one an injected fault damages.
pub(crate) fn damaged_now() -> bool {
    match FAULT.get() {
        Some(Fault::DamagedAt(n)) => CALLS.fetch_add(1, Ordering::Relaxed) + 1 == *n,
        _ => false,
    }
}
