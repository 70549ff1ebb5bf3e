//! Load benchmark of `autopar cache serve` on loopback: 32 clients, each on a keep-alive
//! connection, for 60 s, uploading blobs of 1 KiB to 1 MiB (log-uniform), reading back blobs
//! they uploaded and looking up missing entries (see `autopar_tests::load`). Prints requests
//! per second, latency percentiles, errors (every answer is checked) and the server's resident
//! memory before, at its peak and after. Exits 1 on any error.
//!
//! `cargo run --release -p autopar-tests --bin autopar-bench-remote [-- SECONDS [CLIENTS]]`

use autopar_tests::load::{Length, Mix, run};
use std::io::BufRead;
use std::process::{Command, ExitCode, Stdio};
use std::time::Duration;

const AS_AUTOPAR: &str = "--as-autopar";

/// A field of `/proc/PID/status`, bytes.
fn memory(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / f64::from(1 << 20))
}

fn main() -> ExitCode {
    let mut args = std::env::args_os();
    let _ = args.next();
    let first = args.next();
    if first.as_ref().is_some_and(|a| a == AS_AUTOPAR) {
        let rest = std::iter::once("autopar".into()).chain(args);
        return autopar_cli::run(rest);
    }
    let number = |a: Option<std::ffi::OsString>, default: u64| {
        a.and_then(|a| a.to_str().and_then(|s| s.parse().ok()))
            .unwrap_or(default)
    };
    let seconds = number(first, 60);
    let clients = number(args.next(), 32) as usize;
    let Ok(exe) = std::env::current_exe() else {
        eprintln!("error: cannot find this executable");
        return ExitCode::FAILURE;
    };
    let Ok(dir) = tempfile::tempdir() else {
        eprintln!("error: no temporary directory");
        return ExitCode::FAILURE;
    };
    let dir_arg = dir.path().display().to_string();
    // A total of 2 GiB: the run uploads more than that, so eviction runs too.
    let child = Command::new(exe)
        .args([
            AS_AUTOPAR,
            "cache",
            "serve",
            "--dir",
            &dir_arg,
            "--listen",
            "127.0.0.1:0",
            "--max-size",
            "2G",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn();
    let Ok(mut child) = child else {
        eprintln!("error: the server did not start");
        return ExitCode::FAILURE;
    };
    let mut line = String::new();
    if let Some(out) = child.stdout.take() {
        let _ = std::io::BufReader::new(out).read_line(&mut line);
    }
    let Some(addr) = line.trim().rsplit("://").next().map(str::to_string) else {
        eprintln!("error: the server did not say where it listens");
        let _ = child.kill();
        return ExitCode::FAILURE;
    };
    let pid = child.id();
    let before = memory(pid, "VmRSS:");
    let load = std::thread::spawn(move || {
        run(
            &addr,
            Mix {
                clients,
                length: Length::Time(Duration::from_secs(seconds)),
                min_blob: 1 << 10,
                max_blob: 1 << 20,
            },
        )
    });
    // The server's memory at each quarter of the run: flat once its buffers are warm.
    let mut quarters = Vec::new();
    for _ in 0..4 {
        std::thread::sleep(Duration::from_secs_f64(seconds as f64 / 4.0));
        quarters.push(mib(memory(pid, "VmRSS:")));
    }
    let Ok(r) = load.join() else {
        eprintln!("error: the load generator failed");
        let _ = child.kill();
        return ExitCode::FAILURE;
    };
    let (after, peak) = (memory(pid, "VmRSS:"), memory(pid, "VmHWM:"));
    let _ = child.kill();
    let _ = child.wait();
    println!(
        "autopar cache serve on loopback: {clients} clients on keep-alive connections for {seconds} s, \
         uploads of 1 KiB-1 MiB (log-uniform), reads of their blobs, lookups of missing keys"
    );
    println!(
        "{:<10} {:<7} {:>9} {:>10} {:>10} {:>10} {:>10} {:>24}",
        "requests", "errors", "req/s", "MiB/s", "p50", "p99", "max", "server RSS before/peak/after"
    );
    let ms = |q: f64| r.quantile(q) * 1e3;
    println!(
        "{:<10} {:<7} {:>9.0} {:>10.1} {:>7.2} ms {:>7.2} ms {:>7.1} ms {:>8} / {} / {}",
        r.requests,
        r.errors,
        r.rate(),
        r.bytes as f64 / f64::from(1 << 20) / r.seconds,
        ms(0.5),
        ms(0.99),
        ms(1.0),
        mib(before),
        mib(peak),
        mib(after)
    );
    println!(
        "server RSS at each quarter of the run: {}",
        quarters.join(" / ")
    );
    if r.errors == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
