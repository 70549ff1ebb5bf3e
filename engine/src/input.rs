//! Reading the files a user points autopar at: only regular files, and only up to a size no
//! real input comes near, so that `hf_config = "/dev/zero"`, a named pipe or a runaway file
//! is refused with a message instead of read without bound.

use crate::error::EngineError;
use std::io::Read;
use std::path::Path;

/// Largest input file read, bytes. The largest real inputs (a graph file listing every op of a
/// large model, a profile of every kernel) are a few MiB.
pub const MAX_INPUT_BYTES: u64 = 64 << 20;

/// The text of `path`, which must be a regular file of at most [`MAX_INPUT_BYTES`] of UTF-8.
pub fn read_text(path: &Path) -> Result<String, EngineError> {
    read_capped(path).map_err(|source| EngineError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// [`read_text`] with the bare I/O error (for callers that keep it as text).
pub fn read_capped(path: &Path) -> std::io::Result<String> {
    use std::io::{Error, ErrorKind};
    // `stat` first: opening a named pipe would block until a writer comes.
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        let what = if meta.is_dir() {
            "a directory"
        } else {
            "not a regular file (a device, pipe or socket)"
        };
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!("it is {what}; expected a regular file"),
        ));
    }
    let too_big = |n: u64| {
        Error::new(
            ErrorKind::InvalidData,
            format!("it holds {n} bytes or more; input files are limited to {MAX_INPUT_BYTES}"),
        )
    };
    if meta.len() > MAX_INPUT_BYTES {
        return Err(too_big(meta.len()));
    }
    let mut text = String::new();
    std::fs::File::open(path)?
        .take(MAX_INPUT_BYTES + 1)
        .read_to_string(&mut text)?;
    if text.len() as u64 > MAX_INPUT_BYTES {
        return Err(too_big(text.len() as u64));
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_directories_and_huge_files_are_refused() {
        let e = read_capped(Path::new("/dev/zero")).expect_err("a device");
        assert!(e.to_string().contains("not a regular file"), "{e}");
        let dir = tempfile::tempdir().expect("tempdir");
        let e = read_capped(dir.path()).expect_err("a directory");
        assert!(e.to_string().contains("a directory"), "{e}");
        let big = dir.path().join("big.json");
        let f = std::fs::File::create(&big).expect("create");
        f.set_len(MAX_INPUT_BYTES + 1).expect("sparse file");
        let e = read_capped(&big).expect_err("too big");
        assert!(e.to_string().contains("limited to"), "{e}");
        let ok = dir.path().join("ok.json");
        std::fs::write(&ok, "{}").expect("write");
        assert_eq!(read_capped(&ok).expect("reads"), "{}");
    }
}
