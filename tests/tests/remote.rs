//! The team remote cache on loopback: two teammates share results through `autopar cache
//! serve` and through nginx with WebDAV PUT; failures of every kind never fail a build; tokens;
//! a corrupt blob on the server; rejected uploads; concurrent load; graceful shutdown.

use autopar_tests::serve::{Server, http};
use autopar_tests::{Run, SMALL_WORKSPACE, TempWorkspace, binary, warnings};
use serde_json::Value;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn sha256_hex(bytes: &[u8]) -> String {
    autopar_engine::server::sha256_hex(bytes)
}

fn build(ws: &TempWorkspace, remote: &str, env: &[(&str, &str)]) -> Run {
    let out = Command::new(binary())
        .args(["--remote-cache", remote, "build", "--json"])
        .current_dir(ws.path())
        .env_remove("AUTOPAR_REMOTE_TOKEN")
        .env_remove("AUTOPAR_CACHE_DIR")
        .env_remove("RUST_LOG")
        .envs(env.iter().copied())
        .output()
        .expect("autopar runs");
    Run::from(out)
}

fn field(r: &Run, k: &str) -> u64 {
    assert_eq!(r.code, 0, "{}", r.stderr);
    r.json()[k]
        .as_u64()
        .unwrap_or_else(|| panic!("{k} in {}", r.stdout))
}

/// Teammate A builds and uploads; teammate B, with an empty local cache, solves nothing.
fn teammates_share(remote: &str) {
    let a = TempWorkspace::with_toml(SMALL_WORKSPACE);
    let b = TempWorkspace::with_toml(SMALL_WORKSPACE);
    let first = build(&a, remote, &[]);
    assert!(field(&first, "solved") > 2, "{}", first.stdout);
    assert_eq!(field(&first, "hits_remote"), 0);
    let second = build(&b, remote, &[]);
    assert_eq!(field(&second, "solved"), 0, "{}", second.stderr);
    assert_eq!(
        field(&second, "hits_remote"),
        2,
        "both plans from the remote"
    );
    assert_eq!(a.read("plans/tiny.json"), b.read("plans/tiny.json"));
    // The remote hits were kept locally: offline, B still solves nothing.
    let offline = b.run(&["build", "--json"]);
    assert_eq!(field(&offline, "solved"), 0);
    assert_eq!(field(&offline, "hits_local"), 2);
}

#[test]
fn two_teammates_share_results_through_the_built_in_server() {
    let server = Server::start(&[]);
    teammates_share(&server.url());
    let s = server.status();
    assert!(s["uploads"].as_u64().expect("uploads") > 0, "{s}");
    assert_eq!(s["rejects"], 0);
}

/// nginx with WebDAV PUT, as a team might already run it.
struct Nginx {
    child: Child,
    dir: tempfile::TempDir,
    port: u16,
}

impl Nginx {
    fn start() -> Option<Nginx> {
        let nginx = ["/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/bin/nginx"]
            .into_iter()
            .map(PathBuf::from)
            .find(|p| p.exists())?;
        let dir = tempfile::tempdir().expect("dir");
        let data = dir.path().join("data");
        let tmp = dir.path().join("tmp");
        std::fs::create_dir_all(&data).expect("data");
        std::fs::create_dir_all(&tmp).expect("tmp");
        // Workers may run as another user.
        for d in [dir.path(), &data, &tmp] {
            use std::os::unix::fs::PermissionsExt;
            let _ = std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o777));
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let d = dir.path().display();
        let conf = format!(
            "daemon off;\nworker_processes 1;\npid {d}/nginx.pid;\nerror_log {d}/error.log;\n\
             events {{ worker_connections 128; }}\nhttp {{\n  access_log off;\n\
             client_body_temp_path {d}/tmp;\n  proxy_temp_path {d}/tmp;\n  fastcgi_temp_path {d}/tmp;\n\
             uwsgi_temp_path {d}/tmp;\n  scgi_temp_path {d}/tmp;\n  server {{\n\
             listen 127.0.0.1:{port};\n    location / {{\n      root {d}/data;\n\
             dav_methods PUT;\n      create_full_put_path on;\n      dav_access user:rw group:rw all:rw;\n\
             client_max_body_size 256m;\n    }}\n  }}\n}}\n"
        );
        let conf_path = dir.path().join("nginx.conf");
        std::fs::write(&conf_path, conf).expect("config");
        let child = Command::new(nginx)
            .arg("-c")
            .arg(&conf_path)
            .arg("-p")
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nginx starts");
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "nginx did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        Some(Nginx { child, dir, port })
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = &self.dir;
    }
}

#[test]
fn two_teammates_share_results_through_nginx_webdav() {
    let Some(nginx) = Nginx::start() else {
        eprintln!("skipping: nginx is not installed (.ci/run installs it)");
        return;
    };
    teammates_share(&format!("http://127.0.0.1:{}", nginx.port));
}

#[test]
fn an_unreachable_or_stopped_server_never_fails_a_build() {
    // Nothing listens on a port just released.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port();
    let ws = TempWorkspace::with_toml(SMALL_WORKSPACE);
    let r = build(&ws, &format!("http://127.0.0.1:{port}"), &[]);
    assert!(field(&r, "solved") > 2);
    assert_eq!(warnings(&r).len(), 1, "{}", r.stderr);
    assert!(r.stderr.contains("continuing without it"), "{}", r.stderr);
    // The first failure suspends the remote; the lookups already in flight fail too (one per
    // build thread), one probe confirms it is down, and nothing more is asked.
    let errors = r.json()["remote"]["errors"].as_u64().expect("errors");
    let threads = std::thread::available_parallelism().map_or(2, usize::from) as u64;
    assert!((2..=threads + 1).contains(&errors), "{errors} errors");
    // A server that goes away in the middle of a build.
    let server = Server::start(&[]);
    let url = server.url();
    let big = TempWorkspace::default_copy();
    let child = Command::new(binary())
        .args(["--remote-cache", &url, "build", "--json"])
        .current_dir(big.path())
        .env_remove("AUTOPAR_CACHE_DIR")
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("build starts");
    std::thread::sleep(Duration::from_millis(300));
    drop(server);
    let out = child.wait_with_output().expect("build ends");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let warns = stderr.lines().filter(|l| l.contains("WARN")).count();
    assert!(warns <= 1, "{stderr}");
    let report: Value = serde_json::from_slice(&out.stdout).expect("report");
    assert_eq!(report["planned"], 17);
}

#[test]
fn tokens_scope_reads_and_writes() {
    let tokens = tempfile::NamedTempFile::new().expect("tokens file");
    std::fs::write(
        tokens.path(),
        "# team tokens\nread reader-token\nreadwrite writer-token\n",
    )
    .expect("write tokens");
    let tokens_path = tokens.path().display().to_string();
    let server = Server::start(&["--tokens", &tokens_path]);
    let url = server.url();
    let a = TempWorkspace::with_toml(SMALL_WORKSPACE);
    let wrote = build(&a, &url, &[("AUTOPAR_REMOTE_TOKEN", "writer-token")]);
    assert!(field(&wrote, "solved") > 2);
    assert!(warnings(&wrote).is_empty(), "{}", wrote.stderr);
    // A reader reads everything, and cannot write what it solves.
    let larger_batch = SMALL_WORKSPACE.replace(
        "global_batch = 8\nspace = \"megatron\"\n[target.search]\nmicro_batch = [1]\n",
        "global_batch = 16\nspace = \"megatron\"\n[target.search]\nmicro_batch = [1]\n",
    );
    assert_ne!(larger_batch, SMALL_WORKSPACE, "tiny's batch changes");
    let b = TempWorkspace::with_toml(&larger_batch);
    let read = build(&b, &url, &[("AUTOPAR_REMOTE_TOKEN", "reader-token")]);
    // gpt2's plan, and tiny's 9 layer costs (the batch changed, the layers did not).
    assert_eq!(field(&read, "hits_remote"), 10, "{}", read.stdout);
    assert_eq!(field(&read, "solved"), 1, "tiny's search for the new batch");
    assert_eq!(warnings(&read).len(), 1, "{}", read.stderr);
    assert!(
        read.stderr.contains("refuses writes (HTTP 403)"),
        "{}",
        read.stderr
    );
    // No token, no anonymous reads: refused, and the build goes on alone.
    let c = TempWorkspace::with_toml(SMALL_WORKSPACE);
    let none = build(&c, &url, &[]);
    assert_eq!(field(&none, "hits_remote"), 0);
    assert!(
        none.stderr.contains("refuses reads (HTTP 401)"),
        "{}",
        none.stderr
    );
    assert!(server.status()["rejects"].as_u64().expect("rejects") >= 2);
    // With anonymous reads allowed, a stranger reads what the team wrote.
    let (_, dir) = server.stop();
    let open = Server::start_in(dir, &["--tokens", &tokens_path, "--allow-anonymous-read"]);
    let d = TempWorkspace::with_toml(SMALL_WORKSPACE);
    let anon = build(&d, &open.url(), &[("AUTOPAR_REMOTE_TOKEN", "wrong")]);
    assert_eq!(field(&anon, "hits_remote"), 2, "{}", anon.stderr);
}

#[test]
fn a_corrupted_blob_on_the_server_is_detected_and_not_kept() {
    let server = Server::start(&[]);
    let a = TempWorkspace::with_toml(SMALL_WORKSPACE);
    let first = field(&build(&a, &server.url(), &[]), "solved");
    // Damage every blob on the server's disk.
    let cas = server.dir.path().join("cas");
    for e in std::fs::read_dir(&cas).expect("cas").flatten() {
        let mut bytes = std::fs::read(e.path()).expect("read");
        if let Some(b) = bytes.last_mut() {
            *b ^= 0x5a;
        }
        std::fs::write(e.path(), bytes).expect("write");
    }
    let b = TempWorkspace::with_toml(SMALL_WORKSPACE);
    let r = build(&b, &server.url(), &[]);
    assert_eq!(field(&r, "hits_remote"), 0);
    assert_eq!(field(&r, "solved"), first, "everything recomputed");
    assert!(r.stderr.contains("does not match its hash"), "{}", r.stderr);
    let stats = b.run(&["cache", "stats", "--json"]).json();
    let kinds: Vec<&str> = stats["kinds"]
        .as_array()
        .expect("kinds")
        .iter()
        .map(|k| k[0].as_str().expect("kind"))
        .collect();
    assert!(
        !kinds.contains(&"remote"),
        "nothing from the remote was kept: {kinds:?}"
    );
}

#[test]
fn bad_uploads_are_rejected() {
    let server = Server::start(&["--max-blob", "1K"]);
    let addr = server.addr.clone();
    let body = b"some result bytes";
    let good = sha256_hex(body);
    assert_eq!(
        http(&addr, "PUT", &format!("/cas/{good}"), &[], body).0,
        200
    );
    assert_eq!(
        http(&addr, "GET", &format!("/cas/{good}"), &[], b""),
        (200, body.to_vec())
    );
    let (code, _) = http(&addr, "HEAD", &format!("/cas/{good}"), &[], b"");
    assert_eq!(code, 200);
    // The body's hash is not its name.
    let wrong = sha256_hex(b"something else");
    assert_eq!(
        http(&addr, "PUT", &format!("/cas/{wrong}"), &[], body).0,
        400
    );
    // Larger than --max-blob.
    let big = vec![7u8; 2048];
    assert_eq!(
        http(
            &addr,
            "PUT",
            &format!("/cas/{}", sha256_hex(&big)),
            &[],
            &big
        )
        .0,
        413
    );
    // An action-cache entry that is not an ActionResult.
    let key = "ab".repeat(32);
    assert_eq!(
        http(&addr, "PUT", &format!("/ac/{key}"), &[], b"\xff\xff\xff").0,
        400
    );
    // Not a key.
    assert_eq!(http(&addr, "GET", "/cas/nothex", &[], b"").0, 404);
    assert_eq!(http(&addr, "GET", &format!("/ac/{key}"), &[], b"").0, 404);
    let s = server.status();
    assert_eq!(s["rejects"], 3, "{s}");
    assert_eq!(s["uploads"], 1);
    assert_eq!(s["entries"], 1);
}

#[test]
fn concurrent_clients_see_no_errors() {
    let server = Server::start(&[]);
    let mix = autopar_tests::load::Mix {
        clients: 32,
        length: autopar_tests::load::Length::Requests(200),
        min_blob: 1 << 10,
        max_blob: 1 << 18,
    };
    let r = autopar_tests::load::run(&server.addr, mix);
    assert_eq!(r.errors, 0, "{} errors of {}", r.errors, r.requests);
    assert_eq!(r.requests, 32 * 200);
}

#[test]
fn graceful_shutdown_keeps_what_it_acknowledged() {
    let server = Server::start(&["--max-size", "1M"]);
    let addr = server.addr.clone();
    let mut names = Vec::new();
    for i in 0..20u8 {
        let body = vec![i; 100];
        let name = sha256_hex(&body);
        assert_eq!(
            http(&addr, "PUT", &format!("/cas/{name}"), &[], &body).0,
            200
        );
        names.push((name, body));
    }
    let (clean, dir) = server.stop();
    assert!(clean, "exits cleanly on SIGTERM");
    let again = Server::start_in(dir, &[]);
    assert_eq!(again.status()["entries"], 20);
    for (name, body) in &names {
        assert_eq!(
            &http(&again.addr, "GET", &format!("/cas/{name}"), &[], b"").1,
            body
        );
    }
}

#[test]
fn instances_partition_the_remote() {
    let server = Server::start(&[]);
    let url = server.url();
    let run = |ws: &TempWorkspace, instance: &str| -> Run {
        let out = Command::new(binary())
            .args([
                "--remote-cache",
                &url,
                "--remote-instance",
                instance,
                "build",
                "--json",
            ])
            .current_dir(ws.path())
            .env_remove("AUTOPAR_REMOTE_TOKEN")
            .env_remove("AUTOPAR_CACHE_DIR")
            .env_remove("RUST_LOG")
            .output()
            .expect("autopar runs");
        Run::from(out)
    };
    let a = TempWorkspace::with_toml(SMALL_WORKSPACE);
    assert!(field(&run(&a, "team-a"), "solved") > 2);
    let other = TempWorkspace::with_toml(SMALL_WORKSPACE);
    assert_eq!(
        field(&run(&other, "team-b"), "hits_remote"),
        0,
        "another instance"
    );
    let same = TempWorkspace::with_toml(SMALL_WORKSPACE);
    assert_eq!(field(&run(&same, "team-a"), "hits_remote"), 2);
    assert!(server.dir.path().join("team-a/ac").is_dir());
}

/// A certificate authority and a certificate it signed for 127.0.0.1: (CA PEM, leaf chain PEM,
/// leaf key PEM).
fn team_ca() -> (String, String, String) {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, KeyUsagePurpose};
    let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_key = KeyPair::generate().expect("CA key");
    let ca_cert = ca.self_signed(&ca_key).expect("CA certificate");
    let issuer = Issuer::new(ca, ca_key);
    let leaf = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])
        .expect("leaf parameters");
    let leaf_key = KeyPair::generate().expect("leaf key");
    let leaf_cert = leaf
        .signed_by(&leaf_key, &issuer)
        .expect("leaf certificate");
    (ca_cert.pem(), leaf_cert.pem(), leaf_key.serialize_pem())
}

#[test]
fn tls_and_basic_auth_let_a_team_share_beyond_one_host() {
    let (ca, cert, key) = team_ca();
    let files = tempfile::tempdir().expect("files");
    let path = |name: &str, text: &str| {
        let p = files.path().join(name);
        std::fs::write(&p, text).expect("write");
        p.display().to_string()
    };
    let (ca_file, cert_file, key_file) = (
        path("ca.pem", &ca),
        path("cert.pem", &cert),
        path("key.pem", &key),
    );
    // `htpasswd -nbs bob hunter2`.
    let users = path("users", "bob:{SHA}87u9ZqY9S/F0eUBXjsPQEDUw4h0=\n");
    let server = Server::start(&[
        "--tls-cert",
        &cert_file,
        "--tls-key",
        &key_file,
        "--htpasswd",
        &users,
    ]);
    let run = |ws: &TempWorkspace, url: &str, ca: Option<&str>| -> Run {
        let mut args = vec!["--remote-cache", url];
        if let Some(ca) = ca {
            args.extend(["--remote-ca-file", ca]);
        }
        args.extend(["build", "--json"]);
        ws.run(&args)
    };
    let url = format!("https://bob:hunter2@{}", server.addr);
    let a = TempWorkspace::with_toml(SMALL_WORKSPACE);
    let first = run(&a, &url, Some(&ca_file));
    assert!(field(&first, "solved") > 2);
    assert!(warnings(&first).is_empty(), "{}", first.stderr);
    let b = TempWorkspace::with_toml(SMALL_WORKSPACE);
    let second = run(&b, &url, Some(&ca_file));
    assert_eq!(field(&second, "hits_remote"), 2, "{}", second.stderr);
    assert_eq!(a.read("plans/tiny.json"), b.read("plans/tiny.json"));
    // The password never reaches a message.
    let c = TempWorkspace::with_toml(SMALL_WORKSPACE);
    let wrong = run(
        &c,
        &format!("https://bob:hunter3@{}", server.addr),
        Some(&ca_file),
    );
    assert_eq!(field(&wrong, "hits_remote"), 0);
    assert!(
        wrong.stderr.contains("refuses reads (HTTP 401)"),
        "{}",
        wrong.stderr
    );
    assert!(!wrong.stderr.contains("hunter3"), "{}", wrong.stderr);
    // Without the team's CA the certificate is not trusted: the build goes on alone.
    let d = TempWorkspace::with_toml(SMALL_WORKSPACE);
    let untrusted = run(&d, &url, None);
    assert_eq!(field(&untrusted, "hits_remote"), 0);
    assert!(
        untrusted.stderr.contains("continuing without it"),
        "{}",
        untrusted.stderr
    );
    // Plain HTTP to the TLS port gets nowhere either.
    let e = TempWorkspace::with_toml(SMALL_WORKSPACE);
    let plain = run(&e, &format!("http://{}", server.addr), None);
    assert_eq!(field(&plain, "hits_remote"), 0);
}

/// Peak resident memory of process `pid`, bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}

#[test]
fn uploads_stream_to_disk_and_their_bytes_in_flight_are_capped() {
    let server = Server::start(&["--max-inflight", "96M"]);
    let before = peak_rss(server.pid());
    // Four 32 MiB uploads at once: the server holds a frame of each, not the blobs.
    let blobs: Vec<Vec<u8>> = (0..4u8)
        .map(|i| {
            (0..32u32 << 20)
                .map(|x| (x as u8) ^ i.wrapping_mul(31))
                .collect()
        })
        .collect();
    let handles: Vec<_> = blobs
        .iter()
        .map(|b| {
            let (addr, body) = (server.addr.clone(), b.clone());
            std::thread::spawn(move || {
                let name = sha256_hex(&body);
                http(&addr, "PUT", &format!("/cas/{name}"), &[], &body).0
            })
        })
        .collect();
    let codes: Vec<u16> = handles
        .into_iter()
        .map(|h| h.join().expect("upload"))
        .collect();
    // 96 MiB in flight at most: three at once, a fourth may be told to retry.
    assert!(
        codes.iter().filter(|&&c| c == 200).count() >= 3,
        "{codes:?}"
    );
    assert!(codes.iter().all(|&c| c == 200 || c == 503), "{codes:?}");
    let grew = peak_rss(server.pid()).saturating_sub(before);
    assert!(
        grew < 48 << 20,
        "the server grew by {} MiB for 128 MiB of uploads",
        grew >> 20
    );
    for b in &blobs {
        let (code, body) = http(
            &server.addr,
            "GET",
            &format!("/cas/{}", sha256_hex(b)),
            &[],
            b"",
        );
        if code == 200 {
            assert!(body == *b, "a blob comes back as it went");
        }
    }
    assert_eq!(server.status()["inflight_bytes"], 0);
}

#[test]
fn stalled_clients_are_dropped_and_names_are_checked() {
    let server = Server::start(&["--idle-timeout-ms", "400"]);
    let key = "ab".repeat(32);
    // Uploads that send their headers and stall, and requests whose headers never end.
    let mut stalled: Vec<TcpStream> = (0..100)
        .map(|_| {
            let mut s = TcpStream::connect(&server.addr).expect("connect");
            let head =
                format!("PUT /cas/{key} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n");
            s.write_all(head.as_bytes()).expect("head");
            s
        })
        .collect();
    for _ in 0..20 {
        let mut s = TcpStream::connect(&server.addr).expect("connect");
        s.write_all(b"GET /cas/ab").expect("part of a head");
        stalled.push(s);
    }
    std::thread::sleep(Duration::from_millis(1500));
    for s in &mut stalled {
        s.set_read_timeout(Some(Duration::from_millis(500)))
            .expect("timeout");
        let mut buf = Vec::new();
        // Closed by the server: whatever it said, the stream ends.
        assert!(s.read_to_end(&mut buf).is_ok(), "the server closed it");
        assert!(
            buf.is_empty() || buf.starts_with(b"HTTP/1.1 408"),
            "{}",
            String::from_utf8_lossy(&buf)
        );
    }
    // The server still serves, and refuses an instance name no file system takes.
    let long = "x".repeat(300);
    let (code, body) = http(
        &server.addr,
        "PUT",
        &format!("/{long}/cas/{key}"),
        &[],
        b"x",
    );
    assert_eq!(code, 400, "{}", String::from_utf8_lossy(&body));
    assert!(String::from_utf8_lossy(&body).contains("instance name"));
    // `/status` has counters and nothing else: no key is ever listed.
    let status = server.status();
    let fields: Vec<&str> = status
        .as_object()
        .expect("an object")
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(
        fields,
        [
            "bytes",
            "entries",
            "evictions",
            "hits",
            "inflight_bytes",
            "max_bytes",
            "misses",
            "rejects",
            "uploads"
        ]
    );
    assert!(
        status["rejects"].as_u64().expect("rejects") >= 101,
        "{status}"
    );
}

#[test]
fn a_stop_signal_lets_an_upload_in_flight_finish() {
    let server = Server::start(&[]);
    let body: Vec<u8> = (0..4u32 << 20).map(|x| (x % 251) as u8).collect();
    let name = sha256_hex(&body);
    let mut s = TcpStream::connect(&server.addr).expect("connect");
    let head = format!(
        "PUT /cas/{name} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).expect("head");
    let (first, rest) = body.split_at(body.len() / 3);
    s.write_all(first).expect("a third");
    std::thread::sleep(Duration::from_millis(200));
    let pid = server.pid();
    let _ = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
    std::thread::sleep(Duration::from_millis(200));
    s.write_all(rest).expect("the rest, after the signal");
    let mut answer = Vec::new();
    let _ = s.read_to_end(&mut answer);
    assert!(
        answer.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&answer)
    );
    let (clean, dir) = server.stop();
    assert!(clean, "exits cleanly once the upload is done");
    let stored = std::fs::read(dir.path().join("cas").join(&name)).expect("the blob is there");
    assert!(stored == body, "whole");
    let leftovers: Vec<_> = std::fs::read_dir(dir.path().join("cas"))
        .expect("cas")
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "no temporary file is left");
}
