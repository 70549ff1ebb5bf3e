//! Fault injection for the failure tests (cargo feature `fault-injection`, which only the test
//! crate enables): makes every write of the local store fail as a full or read-only disk would,
//! so that what a build does on such a disk can be tested on any machine, as any user.

use std::sync::OnceLock;

/// A fault the local store simulates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Every write fails with this error (`StorageFull` for a full disk, `ReadOnlyFilesystem`
    /// or `PermissionDenied` for a read-only one); reads work.
    WritesFail(std::io::ErrorKind),
}

static FAULT: OnceLock<Fault> = OnceLock::new();

/// Turns `fault` on for the rest of the process (the first call wins).
pub fn inject(fault: Fault) {
    let _ = FAULT.set(fault);
}

/// The error an injected fault makes a write fail with, if any.
pub(crate) fn write_error() -> Option<std::io::Error> {
    FAULT
        .get()
        .map(|Fault::WritesFail(kind)| std::io::Error::from(*kind))
}
