//! The part of the Remote Execution API that the Bazel HTTP cache stores in its action cache:
//! an `ActionResult` whose output file points at a blob in the CAS. Field numbers follow
//! `build/bazel/remote/execution/v2/remote_execution.proto`, so bazel-remote and other stock
//! servers accept and validate what autopar writes.

use prost::Message;
use sha2::{Digest as _, Sha256};

/// `build.bazel.remote.execution.v2.Digest`.
#[derive(Clone, PartialEq, Message)]
pub struct Digest {
    /// Lower-case hex SHA-256 of the blob.
    #[prost(string, tag = "1")]
    pub hash: String,
    /// Size of the blob in bytes.
    #[prost(int64, tag = "2")]
    pub size_bytes: i64,
}

/// `build.bazel.remote.execution.v2.OutputFile` (the fields autopar uses).
#[derive(Clone, PartialEq, Message)]
pub struct OutputFile {
    /// Path of the output, relative to the action's working directory.
    #[prost(string, tag = "1")]
    pub path: String,
    /// The blob holding the file's contents.
    #[prost(message, optional, tag = "2")]
    pub digest: Option<Digest>,
    /// Whether the file is executable.
    #[prost(bool, tag = "4")]
    pub is_executable: bool,
}

/// `build.bazel.remote.execution.v2.ActionResult` (the fields autopar uses).
#[derive(Clone, PartialEq, Message)]
pub struct ActionResult {
    /// Output files.
    #[prost(message, repeated, tag = "2")]
    pub output_files: Vec<OutputFile>,
    /// Exit code of the action (0).
    #[prost(int32, tag = "4")]
    pub exit_code: i32,
}

/// Lower-case hex SHA-256 of `bytes`: the CAS name of a blob.
pub fn sha256_hex(bytes: &[u8]) -> String {
    crate::hex(&Sha256::digest(bytes))
}

/// The action-cache entry for a result whose bytes are `blob` (stored in the CAS).
pub fn action_result(kind: &str, blob: &[u8]) -> Vec<u8> {
    ActionResult {
        output_files: vec![OutputFile {
            path: format!("autopar/{kind}"),
            digest: Some(Digest {
                hash: sha256_hex(blob),
                size_bytes: blob.len() as i64,
            }),
            is_executable: false,
        }],
        exit_code: 0,
    }
    .encode_to_vec()
}

/// The CAS blob an action-cache entry points at: (SHA-256 hex, size), if the entry is a
/// well-formed `ActionResult` with one.
pub fn blob_of(action_result: &[u8]) -> Option<(String, u64)> {
    let r = ActionResult::decode(action_result).ok()?;
    let d = r.output_files.first()?.digest.as_ref()?;
    let well_formed = d.hash.len() == 64 && d.hash.bytes().all(|b| b.is_ascii_hexdigit());
    (well_formed && d.size_bytes >= 0).then(|| (d.hash.to_ascii_lowercase(), d.size_bytes as u64))
}

/// Whether `bytes` decode as an `ActionResult` (what the server accepts under `/ac/`).
pub fn is_action_result(bytes: &[u8]) -> bool {
    ActionResult::decode(bytes).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn action_results_point_at_their_blob() {
        let ac = action_result("plan", b"hello");
        let (hash, size) = blob_of(&ac).expect("well formed");
        assert_eq!(
            hash,
            "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
        );
        assert_eq!(size, 5);
        assert!(is_action_result(&ac));
        assert!(blob_of(b"\xff\xff not a proto").is_none());
    }
}
