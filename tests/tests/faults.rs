//! The cache never takes a build down and never serves a wrong plan (DESIGN.md "Failure
//! model"). Each case damages the local cache or its disk the way real machines do, then
//! builds the default workspace and asserts: exit 0, plans and traces byte-identical to a clean
//! build's, no panic, and the fault named in a warning whenever it reached anything the cache
//! reads. (Damage sled never reads, such as a byte of a log page it had already superseded,
//! changes nothing, and the build then finds every result where it left it.)
//!
//! The faults of a remote cache are in `remote_faults.rs`, which times them alone.

use autopar_tests::{
    Run, TempWorkspace, assert_no_panic, assert_reference_plans, reference, warnings,
};
use serde_json::Value;
use std::path::Path;
use std::time::Duration;

fn solved(r: &Run) -> u64 {
    serde_json::from_str::<Value>(&r.stdout)
        .ok()
        .and_then(|v| v["solved"].as_u64())
        .unwrap_or_else(|| panic!("no summary in:\n{}\n{}", r.stdout, r.stderr))
}

/// A build of `ws` that must succeed with the reference plans and no panic.
fn build_ok(ws: &TempWorkspace, case: &str, env: &[(&str, &str)]) -> Run {
    let out = std::process::Command::new(autopar_tests::binary())
        .args(["build", "--json"])
        .current_dir(ws.path())
        .env_remove("AUTOPAR_WORKSPACE")
        .env_remove("AUTOPAR_CACHE_DIR")
        .env_remove("RUST_LOG")
        .envs(env.iter().copied())
        .output()
        .expect("autopar runs");
    let r = Run::from(out);
    assert_no_panic(&r, case);
    assert_eq!(r.code, 0, "{case}: exit code\n{}", r.stderr);
    assert_reference_plans(ws.path(), case);
    r
}

#[test]
fn killing_a_cold_build_at_twenty_points_never_costs_a_plan() {
    let (_, took) = reference();
    let points = 20u32;
    for i in 0..points {
        // Spread over the whole cold build, from its first moments to its last.
        let at = took.mul_f64(f64::from(i) / f64::from(points - 1));
        let ws = TempWorkspace::default_copy();
        let mut child = ws.spawn(&["build"]);
        std::thread::sleep(at);
        let _ = child.kill();
        let _ = child.wait();
        let case = format!("kill -9 after {} ms", at.as_millis());
        build_ok(&ws, &case, &[]);
        // What the killed build stored is intact: nothing damaged, nothing moved aside. A
        // write the kill interrupted may leave a record file or temporary file that no entry
        // points to (an orphan, which verify removes); nothing else may be removed.
        let v = ws.run(&["cache", "verify", "--json"]);
        assert_eq!(v.code, 0, "{case}: {}", v.stderr);
        let report = v.json();
        for count in ["damaged", "other_key", "old_layout"] {
            assert_eq!(report[count], 0, "{case}: {report}");
        }
        assert_eq!(report["removed"], report["orphans"], "{case}: {report}");
        assert_eq!(
            report["repairs"].as_array().map(Vec::len),
            Some(0),
            "{case}"
        );
        // And a third build solves nothing.
        assert_eq!(solved(&build_ok(&ws, &case, &[])), 0, "{case}");
    }
}

/// How a file of the cache is damaged.
#[derive(Clone, Copy, Debug)]
enum Damage {
    /// 16 bytes inverted at this fraction of the file.
    Flip(f64),
    /// Cut to half its length.
    Half,
    /// Emptied.
    Empty,
    /// Replaced by a directory.
    Directory,
}

fn damage(path: &Path, how: Damage) {
    let bytes = std::fs::read(path).expect("read a cache file");
    match how {
        Damage::Flip(at) => {
            let mut b = bytes;
            let start = ((b.len() as f64 * at) as usize).min(b.len().saturating_sub(16));
            for x in b.iter_mut().skip(start).take(16) {
                *x ^= 0xff;
            }
            std::fs::write(path, b).expect("write");
        }
        Damage::Half => std::fs::write(path, &bytes[..bytes.len() / 2]).expect("write"),
        Damage::Empty => std::fs::write(path, b"").expect("write"),
        Damage::Directory => {
            std::fs::remove_file(path).expect("remove");
            std::fs::create_dir(path).expect("directory");
        }
    }
}

/// Copies the directory `from` to `to`.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("directory");
    for e in std::fs::read_dir(from).expect("list").flatten() {
        let target = to.join(e.file_name());
        if e.path().is_dir() {
            copy_dir(&e.path(), &target);
        } else {
            std::fs::copy(e.path(), target).expect("copy");
        }
    }
}

#[test]
fn damage_to_any_file_of_the_cache_never_changes_a_plan() {
    // A complete cache, opened twice so that sled has written a snapshot too.
    let source = TempWorkspace::default_copy();
    build_ok(&source, "first build", &[]);
    build_ok(&source, "second build", &[]);
    let pristine = source.path().join(".autopar/cache");
    let mut names: Vec<String> = std::fs::read_dir(&pristine)
        .expect("cache directory")
        .flatten()
        .filter(|e| e.path().is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    for kind in ["db", "conf", "snap.", "autopar.seal"] {
        assert!(
            names.iter().any(|n| n.starts_with(kind)),
            "the cache has a `{kind}` file: {names:?}"
        );
    }
    let damages = [
        Damage::Flip(0.1),
        Damage::Flip(0.5),
        Damage::Flip(0.9),
        Damage::Half,
        Damage::Empty,
        Damage::Directory,
    ];
    let mut named = 0;
    for name in &names {
        for how in damages {
            let case = format!("{name}: {how:?}");
            let ws = TempWorkspace::default_copy();
            let cache = ws.path().join(".autopar/cache");
            copy_dir(&pristine, &cache);
            damage(&cache.join(name), how);
            let r = build_ok(&ws, &case, &[]);
            let warned = warnings(&r).iter().any(|w| w.contains("cache"));
            // A warning, unless the damage touched nothing the cache reads.
            assert!(
                warned || solved(&r) == 0,
                "{case}: results were lost without a warning:\n{}",
                r.stderr
            );
            named += usize::from(warned);
            // The next build finds its results again.
            assert_eq!(
                solved(&build_ok(&ws, &case, &[])),
                0,
                "{case}: rebuilt after:\n{}",
                r.stderr
            );
        }
    }
    eprintln!(
        "{} kinds of damage to {} files: {named} named in a warning, the rest touched nothing \
         the cache reads",
        damages.len(),
        names.len()
    );
    assert!(
        named * 4 >= names.len() * damages.len() * 3,
        "most damage is named: {named} of {}",
        names.len() * damages.len()
    );
}

#[test]
fn damage_found_in_the_middle_of_a_build_keeps_what_still_verifies() {
    // The reference plans, from an undamaged cold build.
    let reference = TempWorkspace::default_copy();
    build_ok(&reference, "reference", &[]);
    let plans = |ws: &TempWorkspace| -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = std::fs::read_dir(ws.path().join("plans"))
            .expect("plans")
            .flatten()
            .map(|e| {
                let text = std::fs::read_to_string(e.path()).expect("plan");
                (e.file_name().to_string_lossy().into_owned(), text)
            })
            .collect();
        out.sort();
        out
    };
    // The database fails as a damaged one does at its N-th call: in a cold build (after some
    // results were written) and in a warm one (after some were read). Whatever the build
    // wrote or read before is still found by the next build.
    let warm = TempWorkspace::default_copy();
    build_ok(&warm, "warm cache", &[]);
    for (cold, at) in [(true, 40), (true, 400), (false, 5), (false, 40)] {
        let case = format!(
            "{} build damaged at call {at}",
            if cold { "cold" } else { "warm" }
        );
        let ws = TempWorkspace::default_copy();
        if !cold {
            copy_dir(
                &warm.path().join(".autopar/cache"),
                &ws.path().join(".autopar/cache"),
            );
        }
        let fault = format!("damaged-at:{at}");
        let r = build_ok(&ws, &case, &[("AUTOPAR_E2E_FAULT", &fault)]);
        let w = warnings(&r);
        assert_eq!(w.len(), 1, "{case}: one warning:\n{}", r.stderr);
        assert!(
            w[0].contains("corrupt") && w[0].contains("kept="),
            "{case}: {}",
            w[0]
        );
        assert_eq!(plans(&ws), plans(&reference), "{case}: plans");
        assert_eq!(solved(&build_ok(&ws, &case, &[])), 0, "{case}: rebuilt");
    }
}

#[test]
fn a_full_disk_costs_the_cache_not_the_build() {
    let ws = TempWorkspace::default_copy();
    // Every write fails with ENOSPC (the store's fault-injection hook), reads work.
    let r = build_ok(&ws, "full disk", &[("AUTOPAR_E2E_FAULT", "enospc")]);
    let w = warnings(&r);
    assert_eq!(w.len(), 1, "one warning:\n{}", r.stderr);
    assert!(w[0].contains("no storage space"), "{}", w[0]);
    assert!(solved(&r) > 0);
    // A second run still has nothing cached, and says so once again.
    let again = build_ok(&ws, "full disk again", &[("AUTOPAR_E2E_FAULT", "enospc")]);
    assert_eq!(warnings(&again).len(), 1, "{}", again.stderr);
    // With the disk back, the build fills the cache.
    build_ok(&ws, "disk freed", &[]);
    assert_eq!(solved(&build_ok(&ws, "cached", &[])), 0);
}

/// Runs `sh -c script` in a private mount namespace, if this machine allows one.
fn in_mount_namespace(script: &str) -> Option<std::process::Output> {
    let probe = std::process::Command::new("unshare")
        .args(["-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"])
        .output()
        .ok()?;
    if !probe.status.success() {
        return None;
    }
    std::process::Command::new("unshare")
        .args(["-m", "sh", "-c", script])
        .output()
        .ok()
}

#[test]
fn a_real_full_disk_costs_the_cache_not_the_build() {
    // A 1 MiB tmpfs holds half of the default workspace's cache: sled itself runs out of space.
    let ws = TempWorkspace::default_copy();
    let mount = tempfile::tempdir().expect("mount point");
    let script = format!(
        "mount -t tmpfs -o size=1m tmpfs {m} && cd {w} && {bin} --cache-dir {m}/cache build --json",
        m = mount.path().display(),
        w = ws.path().display(),
        bin = autopar_tests::binary().display()
    );
    let Some(out) = in_mount_namespace(&script) else {
        eprintln!("skipping: no private mount namespace here (the injected ENOSPC test ran)");
        return;
    };
    let r = Run::from(out);
    assert_no_panic(&r, "tmpfs full");
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_reference_plans(ws.path(), "tmpfs full");
    let w = warnings(&r);
    assert_eq!(w.len(), 1, "{}", r.stderr);
    assert!(w[0].contains("No space left on device"), "{}", w[0]);
}

#[cfg(unix)]
#[test]
fn a_read_only_cache_directory_costs_the_cache_not_the_build() {
    use std::os::unix::fs::PermissionsExt;
    let ws = TempWorkspace::default_copy();
    build_ok(&ws, "fill the cache", &[]);
    let cache = ws.path().join(".autopar/cache");
    let set = |p: &Path, mode: u32| {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).expect("chmod");
    };
    // Everything else stays writable for whoever runs the build.
    for dir in [
        ws.path(),
        &ws.path().join("plans"),
        &ws.path().join(".autopar"),
    ] {
        set(dir, 0o777);
    }
    for e in std::fs::read_dir(ws.path().join("plans"))
        .expect("plans")
        .flatten()
    {
        set(&e.path(), 0o666);
    }
    let builds = ws.path().join(".autopar/builds");
    set(&builds, 0o777);
    for e in std::fs::read_dir(&builds).expect("records").flatten() {
        set(&e.path(), 0o666);
    }
    for e in std::fs::read_dir(&cache).expect("cache").flatten() {
        set(&e.path(), if e.path().is_dir() { 0o555 } else { 0o444 });
    }
    set(&cache, 0o555);
    // Permissions bind everyone but root: as root, the build runs as `nobody`.
    let root = std::process::Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"0\n"));
    let mut cmd = if root {
        let mut c = std::process::Command::new("setpriv");
        c.args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(autopar_tests::binary());
        c
    } else {
        std::process::Command::new(autopar_tests::binary())
    };
    let out = cmd
        .args(["build", "--json"])
        .current_dir(ws.path())
        .env_remove("AUTOPAR_CACHE_DIR")
        .env_remove("RUST_LOG")
        .output();
    let r = match out {
        Ok(o) if !(root && o.status.code() == Some(127)) => Run::from(o),
        // No setpriv (or it cannot run the binary): the injected read-only fault instead.
        _ => build_ok(
            &ws,
            "read-only (injected)",
            &[("AUTOPAR_E2E_FAULT", "erofs")],
        ),
    };
    for e in std::fs::read_dir(&cache).expect("cache").flatten() {
        set(&e.path(), if e.path().is_dir() { 0o755 } else { 0o644 });
    }
    set(&cache, 0o755);
    assert_no_panic(&r, "read-only cache");
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_reference_plans(ws.path(), "read-only cache");
    let w = warnings(&r);
    assert_eq!(w.len(), 1, "one warning:\n{}", r.stderr);
    assert!(
        w[0].contains("local cache") || w[0].contains("Read-only"),
        "{}",
        w[0]
    );
    // The cache is as it was: readable again, and complete.
    assert_eq!(solved(&build_ok(&ws, "permissions back", &[])), 0);
}

#[test]
fn a_cache_dir_pointing_at_other_files_is_left_alone() {
    let ws = TempWorkspace::default_copy();
    let other = ws.path().join("notes");
    std::fs::create_dir_all(&other).expect("directory");
    std::fs::write(other.join("db"), [0x5a; 8192]).expect("a file named db");
    std::fs::write(other.join("todo.txt"), b"mine").expect("a file of the user's");
    let out = std::process::Command::new(autopar_tests::binary())
        .args(["--cache-dir", "notes", "build", "--json"])
        .current_dir(ws.path())
        .env_remove("RUST_LOG")
        .output()
        .expect("runs");
    let r = Run::from(out);
    assert_no_panic(&r, "foreign cache dir");
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_reference_plans(ws.path(), "foreign cache dir");
    assert!(
        r.stderr.contains("working without the local cache"),
        "{}",
        r.stderr
    );
    assert_eq!(
        std::fs::read(other.join("todo.txt")).expect("still there"),
        b"mine"
    );
    assert_eq!(
        std::fs::read(other.join("db")).expect("untouched"),
        [0x5a; 8192]
    );
}

#[test]
fn a_reader_that_goes_away_costs_neither_the_build_nor_the_cache() {
    // `autopar -vv build 2>&1 | head`: both pipes close while the build writes to them, the
    // storage crate's debug lines among them (logged from inside the store's boundary, where
    // a panic would read as a damaged database and move it aside).
    let ws = TempWorkspace::default_copy();
    let targets = ["tiny-llama", "tiny-llama-cpu-ilp"];
    let mut child = ws.spawn(&[&["-vv", "build"][..], &targets[..]].concat());
    drop(child.stdout.take());
    drop(child.stderr.take());
    let status = child.wait().expect("the build ends");
    assert!(status.success(), "exit status {status}");
    let aside: Vec<_> = std::fs::read_dir(ws.path().join(".autopar"))
        .expect(".autopar exists")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("corrupt"))
        .collect();
    assert!(
        aside.is_empty(),
        "a healthy cache was moved aside: {aside:?}"
    );
    let again = ws.run(&[&["build", "--json"][..], &targets[..]].concat());
    assert_eq!(again.code, 0, "{}", again.stderr);
    assert_eq!(solved(&again), 0, "{}", again.stderr);
    assert!(warnings(&again).is_empty(), "{}", again.stderr);
}

#[test]
fn a_busy_cache_is_waited_for_and_then_worked_around() {
    // Two builds on one cache serialise: the second waits for the first's lock. The first
    // plans two targets (seconds), well inside the wait however busy the machine is; the whole
    // workspace can take longer than the wait in a debug build beside other tests.
    let ws = TempWorkspace::default_copy();
    let first = ws.spawn(&["build", "gpt3-175b", "llama2-70b"]);
    std::thread::sleep(Duration::from_millis(50));
    let second = build_ok(&ws, "second of two", &[]);
    let first = first.wait_with_output().expect("first ends");
    assert!(first.status.success());
    assert!(warnings(&second).is_empty(), "{}", second.stderr);
}

#[test]
fn a_poisoned_remote_never_serves_a_plan() {
    use autopar_tests::serve::{Server, http};
    let tokens = tempfile::NamedTempFile::new().expect("tokens file");
    std::fs::write(tokens.path(), "readwrite team-token\n").expect("write tokens");
    let tokens_path = tokens.path().display().to_string();
    let server = Server::start(&["--tokens", &tokens_path]);
    let remote_build = |ws: &TempWorkspace| -> Run {
        let out = std::process::Command::new(autopar_tests::binary())
            .args(["--remote-cache", &server.url(), "build", "--json"])
            .current_dir(ws.path())
            .env("AUTOPAR_REMOTE_TOKEN", "team-token")
            .env_remove("AUTOPAR_CACHE_DIR")
            .env_remove("RUST_LOG")
            .output()
            .expect("autopar runs");
        Run::from(out)
    };
    let teammate = TempWorkspace::default_copy();
    let first = remote_build(&teammate);
    assert_eq!(first.code, 0, "{}", first.stderr);
    // Anyone with a read-write token re-uploads every action-cache entry under the next key:
    // each is a valid ActionResult pointing at an intact blob, of another result.
    let ac = server.dir.path().join("ac");
    let mut keys: Vec<String> = std::fs::read_dir(&ac)
        .expect("ac entries")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with('.'))
        .collect();
    keys.sort();
    assert!(keys.len() > 300, "{} entries uploaded", keys.len());
    let bodies: Vec<Vec<u8>> = keys
        .iter()
        .map(|k| std::fs::read(ac.join(k)).expect("entry"))
        .collect();
    let auth = [("Authorization", "Bearer team-token")];
    for (i, k) in keys.iter().enumerate() {
        let body = &bodies[(i + 1) % keys.len()];
        let (code, _) = http(&server.addr, "PUT", &format!("/ac/{k}"), &auth, body);
        assert_eq!(
            code, 200,
            "the server takes any valid ActionResult under any key"
        );
    }
    // A new teammate builds against the poisoned remote: nothing from it is used.
    let ws = TempWorkspace::default_copy();
    let r = remote_build(&ws);
    assert_no_panic(&r, "poisoned remote");
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_reference_plans(ws.path(), "poisoned remote");
    let report = r.json();
    assert_eq!(report["hits_remote"], 0, "{report}");
    assert!(
        report["remote"]["rejected"].as_u64().unwrap_or(0) > 300,
        "{report}"
    );
    let w = warnings(&r);
    assert!(
        !w.is_empty() && w.len() <= 10,
        "a warning per key, ten at most: {w:?}"
    );
    assert!(
        w.iter()
            .all(|l| l.contains("not the result of this key") && l.contains("key=")),
        "{w:?}"
    );
    assert!(r.stdout.contains("\"rejected\""), "{}", r.stdout);
    // Nothing wrong was kept locally: offline, the plans are right and nothing is damaged.
    let offline = build_ok(&ws, "offline after the poisoned build", &[]);
    assert_eq!(solved(&offline), 0);
    let v = ws.run(&["cache", "verify", "--json"]);
    assert_eq!(v.json()["removed"], 0, "{}", v.stdout);
}

#[test]
fn cache_verify_reports_and_repairs_the_same_damage() {
    let source = TempWorkspace::default_copy();
    build_ok(&source, "fill", &[]);
    build_ok(&source, "seal", &[]);
    let pristine = source.path().join(".autopar/cache");
    let verify = |ws: &TempWorkspace| -> Value {
        let r = ws.run(&["cache", "verify", "--json"]);
        assert_no_panic(&r, "verify");
        assert_eq!(r.code, 0, "{}", r.stderr);
        r.json()
    };
    // A truncated log: sled either notices (moved aside) or loses entries in silence, which
    // the seal names.
    let ws = TempWorkspace::default_copy();
    let cache = ws.path().join(".autopar/cache");
    copy_dir(&pristine, &cache);
    damage(&cache.join("db"), Damage::Half);
    let report = verify(&ws);
    let lost = report["damage"].as_array().is_some_and(|d| {
        d.iter()
            .any(|d| d.as_str().is_some_and(|d| d.contains("lost")))
    });
    let moved = report["repairs"].as_array().is_some_and(|r| !r.is_empty());
    assert!(lost || moved, "{report}");
    // A settings file replaced by a directory: the database is moved aside and replaced.
    let ws = TempWorkspace::default_copy();
    let cache = ws.path().join(".autopar/cache");
    copy_dir(&pristine, &cache);
    damage(&cache.join("conf"), Damage::Directory);
    let report = verify(&ws);
    let repairs = report["repairs"].as_array().cloned().unwrap_or_default();
    assert_eq!(repairs.len(), 1, "{report}");
    let moved = repairs[0]["moved_to"].as_str().expect("where it went");
    assert!(ws.path().join(moved).is_dir(), "{moved}");
    // Repaired: a second verify finds nothing, and a build fills the new cache.
    let again = verify(&ws);
    assert_eq!(
        again["repairs"].as_array().map(Vec::len),
        Some(0),
        "{again}"
    );
    assert_eq!(again["damage"].as_array().map(Vec::len), Some(0), "{again}");
    build_ok(&ws, "after verify", &[]);
    assert_eq!(solved(&build_ok(&ws, "cached again", &[])), 0);
}
