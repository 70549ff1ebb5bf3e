//! A real Bazel client against `autopar cache serve`: the server speaks the Bazel HTTP cache
//! protocol well enough that Bazel stores an action's result, and after `clean --expunge` gets
//! it back as a remote cache hit instead of running the action again.
//!
//! Bazel comes from the npm package `@bazel/bazel-linux_x64` 2.1.0, a binary that runs
//! offline; `.ci/run` installs it and names it in `AUTOPAR_BAZEL`.

use autopar_tests::serve::Server;
use std::path::Path;
use std::process::Command;

/// Runs Bazel in `ws` with its output root under `root`; returns (success, stderr).
fn bazel(bin: &Path, root: &Path, ws: &Path, args: &[&str]) -> (bool, String) {
    let out = Command::new(bin)
        .current_dir(ws)
        // Bazel keeps its server's state under HOME; a test's own.
        .env("HOME", root.join("home"))
        .arg(format!("--output_user_root={}", root.join("out").display()))
        .args(args)
        .output()
        .expect("bazel runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn bazel_gets_a_remote_cache_hit_from_autopar_cache_serve() {
    let Some(bin) = std::env::var_os("AUTOPAR_BAZEL").filter(|p| Path::new(p).is_file()) else {
        eprintln!(
            "skipped: AUTOPAR_BAZEL does not name a Bazel binary (npm install \
             @bazel/bazel-linux_x64@2.1.0; .ci/run installs it)"
        );
        return;
    };
    let bin = Path::new(&bin);
    let server = Server::start(&[]);
    let root = tempfile::tempdir().expect("bazel root");
    let ws = tempfile::tempdir().expect("bazel workspace");
    std::fs::create_dir_all(root.path().join("home")).expect("home");
    std::fs::write(ws.path().join("WORKSPACE"), "").expect("WORKSPACE");
    std::fs::write(
        ws.path().join("BUILD"),
        "genrule(\n    name = \"hello\",\n    outs = [\"hello.txt\"],\n    \
         cmd = \"echo cached by autopar > $@\",\n)\n",
    )
    .expect("BUILD");
    let remote = format!("--remote_cache={}", server.url());
    // Run actions without Bazel's sandbox, which some CI containers do not allow.
    let build = [
        "build",
        "//:hello",
        "--spawn_strategy=local",
        remote.as_str(),
    ];
    let (ok, first) = bazel(bin, root.path(), ws.path(), &build);
    assert!(ok, "first build:\n{first}");
    assert!(!first.contains("remote cache hit"), "{first}");
    // The action's result and its output are in the server's directory now.
    let stored = |sub: &str| {
        std::fs::read_dir(server.dir.path().join(sub))
            .map(|d| d.count())
            .unwrap_or(0)
    };
    assert!(stored("ac") >= 1 && stored("cas") >= 1, "nothing uploaded");
    let (ok, clean) = bazel(bin, root.path(), ws.path(), &["clean", "--expunge"]);
    assert!(ok, "clean:\n{clean}");
    let (ok, second) = bazel(bin, root.path(), ws.path(), &build);
    assert!(ok, "second build:\n{second}");
    assert!(
        second.contains("1 remote cache hit"),
        "expected a remote cache hit:\n{second}"
    );
    let out = std::fs::read_to_string(ws.path().join("bazel-bin/hello.txt")).expect("output");
    assert_eq!(out, "cached by autopar\n");
    // Bazel's server would outlive the test otherwise.
    let _ = bazel(bin, root.path(), ws.path(), &["shutdown"]);
}
