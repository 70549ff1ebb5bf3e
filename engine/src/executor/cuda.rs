//! The CUDA backend's preconditions: which of the libraries it loads at run time are present.
//!
//! The libraries are looked up as the dynamic loader would find them (`LD_LIBRARY_PATH`, the
//! loader cache, the usual system and CUDA directories) before anything is loaded, so a machine
//! without a GPU gets a message naming what is missing instead of a failure inside a binding.

use super::ExecError;
use std::path::{Path, PathBuf};

/// A library the CUDA backend needs, with the file names it is looked up under.
#[derive(Clone, Copy, Debug)]
pub struct Library {
    /// What it is for.
    pub purpose: &'static str,
    /// File names, in order of preference.
    pub names: &'static [&'static str],
}

/// Everything the CUDA backend loads.
pub const LIBRARIES: &[Library] = &[
    Library {
        purpose: "the CUDA driver (libcuda, installed with the NVIDIA driver)",
        names: &["libcuda.so.1", "libcuda.so"],
    },
    Library {
        purpose: "cuBLAS (matrix products)",
        names: &["libcublas.so.12", "libcublas.so.11", "libcublas.so"],
    },
    Library {
        purpose: "NVRTC (run-time kernel compilation)",
        names: &["libnvrtc.so.12", "libnvrtc.so.11.2", "libnvrtc.so"],
    },
    Library {
        purpose: "NCCL (collectives between GPUs)",
        names: &["libnccl.so.2", "libnccl.so"],
    },
];

/// Directories searched besides `LD_LIBRARY_PATH`.
const SYSTEM_DIRS: &[&str] = &[
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
    "/usr/local/cuda/lib64",
    "/usr/local/cuda/targets/x86_64-linux/lib",
    "/usr/lib/wsl/lib",
];

/// Where `name` is, if anywhere the loader would look.
fn find(name: &str, dirs: &[PathBuf]) -> Option<PathBuf> {
    dirs.iter().map(|d| d.join(name)).find(|p| p.exists())
}

fn search_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("LD_LIBRARY_PATH")
        .map(|v| std::env::split_paths(&v).collect())
        .unwrap_or_default();
    dirs.extend(SYSTEM_DIRS.iter().map(PathBuf::from));
    // Directories named in the loader's configuration (e.g. /etc/ld.so.conf.d/*.conf).
    if let Ok(entries) = std::fs::read_dir("/etc/ld.so.conf.d") {
        for e in entries.flatten() {
            if let Ok(text) = std::fs::read_to_string(e.path()) {
                dirs.extend(
                    text.lines()
                        .map(str::trim)
                        .filter(|l| l.starts_with('/'))
                        .map(PathBuf::from),
                );
            }
        }
    }
    dirs
}

/// The libraries found and the ones missing.
pub fn locate() -> (Vec<PathBuf>, Vec<Library>) {
    let dirs = search_dirs();
    let mut found = Vec::new();
    let mut missing = Vec::new();
    for lib in LIBRARIES {
        match lib.names.iter().find_map(|n| find(n, &dirs)) {
            Some(p) => found.push(p),
            None => missing.push(*lib),
        }
    }
    (found, missing)
}

/// Whether `--backend cuda` can run here; the error says what is missing.
pub fn probe() -> Result<(), ExecError> {
    let (found, missing) = locate();
    if !missing.is_empty() {
        let list: Vec<String> = missing
            .iter()
            .map(|l| format!("{} ({})", l.purpose, l.names.join(" or ")))
            .collect();
        return Err(ExecError::Unavailable(format!(
            "--backend cuda needs libraries this machine does not have: {}; searched \
             LD_LIBRARY_PATH, /etc/ld.so.conf.d and the usual system and CUDA directories. \
             Run with --backend cpu, or on a machine with an NVIDIA GPU and driver",
            list.join(", ")
        )));
    }
    let names: Vec<String> = found.iter().map(|p| display(p)).collect();
    Err(ExecError::Unavailable(format!(
        "the CUDA libraries are present ({}), but this build of autopar has no CUDA kernels \
         yet: only --backend cpu runs plans",
        names.join(", ")
    )))
}

fn display(p: &Path) -> String {
    p.display().to_string()
}
