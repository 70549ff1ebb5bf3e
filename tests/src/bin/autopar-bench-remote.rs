//! Load benchmark of `autopar cache serve` on loopback: 32 clients x 500 mixed requests
//! (uploads, reads of uploaded blobs, lookups of missing entries), each on its own connection.
//! Prints requests per second and latency percentiles.
//!
//! `cargo run --release -p autopar-tests --bin autopar-bench-remote [-- CLIENTS REQUESTS]`

use std::io::BufRead;
use std::process::{Command, ExitCode, Stdio};

const AS_AUTOPAR: &str = "--as-autopar";

fn main() -> ExitCode {
    let mut args = std::env::args_os();
    let _ = args.next();
    let first = args.next();
    if first.as_ref().is_some_and(|a| a == AS_AUTOPAR) {
        let rest = std::iter::once("autopar".into()).chain(args);
        return autopar_cli::run(rest);
    }
    let number = |a: Option<std::ffi::OsString>, default: usize| {
        a.and_then(|a| a.to_str().and_then(|s| s.parse().ok()))
            .unwrap_or(default)
    };
    let clients = number(first, 32);
    let per_client = number(args.next(), 500);
    let Ok(exe) = std::env::current_exe() else {
        eprintln!("error: cannot find this executable");
        return ExitCode::FAILURE;
    };
    let Ok(dir) = tempfile::tempdir() else {
        eprintln!("error: no temporary directory");
        return ExitCode::FAILURE;
    };
    let dir_arg = dir.path().display().to_string();
    let child = Command::new(exe)
        .args([
            AS_AUTOPAR,
            "cache",
            "serve",
            "--dir",
            &dir_arg,
            "--listen",
            "127.0.0.1:0",
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
    let Some(addr) = line.trim().rsplit("http://").next().map(str::to_string) else {
        eprintln!("error: the server did not say where it listens");
        let _ = child.kill();
        return ExitCode::FAILURE;
    };
    let r = autopar_tests::load::run(&addr, clients, per_client);
    let _ = child.kill();
    let _ = child.wait();
    println!(
        "autopar cache serve on loopback, {clients} clients x {per_client} requests (PUT / GET / HEAD-miss, one connection each)"
    );
    println!(
        "{:<10} {:<8} {:>8} {:>9} {:>10} {:>10} {:>10}",
        "requests", "errors", "wall", "req/s", "p50", "p99", "max"
    );
    let ms = |q: f64| r.quantile(q) * 1e3;
    println!(
        "{:<10} {:<8} {:>6.2} s {:>9.0} {:>7.2} ms {:>7.2} ms {:>7.2} ms",
        r.requests,
        r.errors,
        r.seconds,
        r.rate(),
        ms(0.5),
        ms(0.99),
        ms(1.0)
    );
    if r.errors == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
