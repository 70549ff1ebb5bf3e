//! `autopar cache serve`: a small remote cache for teams without one, speaking the subset of
//! the Bazel HTTP cache that autopar's client uses: `GET`/`HEAD`/`PUT` on
//! `[/{instance}]/ac/<64 hex>` (an `ActionResult`, validated) and `[/{instance}]/cas/<sha256>`
//! (any bytes, whose SHA-256 must be the name), and `GET /status` (counters, never keys).
//!
//! What bazel-remote offers a team, in a few hundred lines:
//! - blobs are files under the directory; uploads stream to disk while hashed (see
//!   [`blobs`]), so memory per upload is bounded, and the bytes of uploads in progress are
//!   capped in total (`--max-inflight`); a size limit per blob and in total, past which the
//!   least recently used entries are evicted;
//! - bearer tokens with `read` or `readwrite` scope and htpasswd users (HTTP basic auth),
//!   anonymous reads only when allowed;
//! - TLS with rustls (`--tls-cert`, `--tls-key`);
//! - every connection has an idle timeout on reads and writes, and a deadline for its request
//!   headers, so stalled or trickling clients are dropped;
//! - SIGINT or SIGTERM stops accepting, lets the requests in flight (uploads included) finish
//!   for up to [`SHUTDOWN_GRACE`], and exits; an upload cut short leaves no blob behind.

mod auth;
mod blobs;

pub use crate::reapi::sha256_hex;
pub use auth::{Scope, Token, User, parse_htpasswd, parse_tokens};
pub use blobs::MIN_UPLOAD_RATE;

use crate::StoreError;
use auth::Credentials;
use axum::Router;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use blobs::Index;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use serde::Serialize;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long requests in flight may take to finish after SIGTERM.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

/// PEM-encoded certificate chain and private key for TLS.
#[derive(Clone)]
pub struct TlsPem {
    /// The certificate chain, leaf first.
    pub cert: Vec<u8>,
    /// The private key.
    pub key: Vec<u8>,
}

impl std::fmt::Debug for TlsPem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the key.
        write!(f, "TlsPem")
    }
}

/// How to run the server.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// Directory holding the blobs.
    pub dir: PathBuf,
    /// Address to listen on (`127.0.0.1:9092`; port 0 picks a free one).
    pub listen: String,
    /// Accepted bearer tokens.
    pub tokens: Vec<Token>,
    /// Accepted basic-auth users (read and write). With neither tokens nor users, everyone
    /// may read and write.
    pub users: Vec<User>,
    /// Reads without credentials are allowed even when tokens or users are configured.
    pub allow_anonymous_read: bool,
    /// Largest blob accepted, bytes.
    pub max_blob: u64,
    /// Largest total, bytes; least recently used entries are evicted past it.
    pub max_total: u64,
    /// Most bytes of uploads in progress at once (one upload is always admitted).
    pub max_inflight: u64,
    /// A connection that sends or takes nothing for this long is closed; so is one whose
    /// request headers take longer.
    pub idle_timeout: Duration,
    /// Serve HTTPS with this certificate and key.
    pub tls: Option<TlsPem>,
}

/// Counters served at `/status`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ServerStatus {
    /// Entries stored.
    pub entries: u64,
    /// Their bytes.
    pub bytes: u64,
    /// The total limit.
    pub max_bytes: u64,
    /// GET/HEAD that found the entry.
    pub hits: u64,
    /// GET/HEAD that did not.
    pub misses: u64,
    /// PUTs stored.
    pub uploads: u64,
    /// Requests refused (authorization, size, hash, malformed, stalled, busy).
    pub rejects: u64,
    /// Entries evicted for space.
    pub evictions: u64,
    /// Bytes of uploads in progress.
    pub inflight_bytes: u64,
}

struct Shared {
    cfg: ServeConfig,
    credentials: Credentials,
    index: Mutex<Index>,
    inflight: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    uploads: AtomicU64,
    rejects: AtomicU64,
    evictions: AtomicU64,
}

impl Shared {
    fn index(&self) -> std::sync::MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn status(&self) -> ServerStatus {
        let idx = self.index();
        ServerStatus {
            entries: idx.len() as u64,
            bytes: idx.total,
            max_bytes: self.cfg.max_total,
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            uploads: self.uploads.load(Ordering::Relaxed),
            rejects: self.rejects.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
            inflight_bytes: self.inflight.load(Ordering::Relaxed),
        }
    }

    fn reject(&self, status: StatusCode, why: &str) -> Response {
        self.rejects.fetch_add(1, Ordering::Relaxed);
        (status, format!("{why}\n")).into_response()
    }

    /// Records a stored blob and evicts least recently used ones past the total limit.
    fn stored(&self, rel: PathBuf, size: u64) {
        let mut evict = Vec::new();
        {
            let mut idx = self.index();
            idx.insert(rel.clone(), size);
            while idx.total > self.cfg.max_total {
                let Some(victim) = idx.oldest() else { break };
                if victim == rel {
                    break;
                }
                idx.remove_entry(&victim);
                evict.push(victim);
            }
        }
        for victim in evict {
            self.evictions.fetch_add(1, Ordering::Relaxed);
            let _ = std::fs::remove_file(self.cfg.dir.join(victim));
        }
    }
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

/// Checks that `pem` makes a TLS identity (a certificate chain and its key), saying what is
/// wrong otherwise.
pub fn check_tls(pem: &TlsPem) -> Result<(), String> {
    tls_acceptor(pem).map(|_| ())
}

/// The TLS acceptor for `pem`.
fn tls_acceptor(pem: &TlsPem) -> Result<tokio_rustls::TlsAcceptor, String> {
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs = CertificateDer::pem_slice_iter(&pem.cert)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("the certificate file: {e}"))?;
    if certs.is_empty() {
        return Err("the certificate file holds no PEM certificate".into());
    }
    let key = PrivateKeyDer::from_pem_slice(&pem.key)
        .map_err(|e| format!("the key file holds no PEM private key ({e})"))?;
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let config = tokio_rustls::rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| format!("the certificate and key do not make a TLS identity: {e}"))?;
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

/// Serves one accepted connection: the idle timeout on its reads and writes, TLS when
/// configured, a deadline for request headers, and the graceful-shutdown watcher.
async fn connection(
    stream: tokio::net::TcpStream,
    app: Router,
    tls: Option<tokio_rustls::TlsAcceptor>,
    idle: Duration,
    watcher: hyper_util::server::graceful::Watcher,
) {
    let _ = stream.set_nodelay(true);
    let mut timed = tokio_io_timeout::TimeoutStream::new(stream);
    timed.set_read_timeout(Some(idle));
    timed.set_write_timeout(Some(idle));
    let timed = Box::pin(timed);
    let service = TowerToHyperService::new(app);
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(idle);
    match tls {
        Some(acceptor) => {
            if let Ok(Ok(stream)) = tokio::time::timeout(idle, acceptor.accept(timed)).await {
                let conn = http.serve_connection(TokioIo::new(stream), service);
                let _ = watcher.watch(conn).await;
            }
        }
        None => {
            let conn = http.serve_connection(TokioIo::new(timed), service);
            let _ = watcher.watch(conn).await;
        }
    }
}

/// Runs the server until SIGINT or SIGTERM; `ready` is called with the bound address once it
/// accepts connections.
pub fn serve(cfg: ServeConfig, ready: impl FnOnce(SocketAddr)) -> Result<ServerStatus, StoreError> {
    use crate::err;
    std::fs::create_dir_all(&cfg.dir).map_err(err("creating cache directory", &cfg.dir))?;
    let tls = match &cfg.tls {
        Some(pem) => Some(
            tls_acceptor(pem)
                .map_err(|e| err("setting up TLS for", &cfg.dir)(std::io::Error::other(e)))?,
        ),
        None => None,
    };
    let mut index = Index::default();
    for (rel, size) in blobs::scan(&cfg.dir) {
        index.insert(rel, size);
    }
    let shared = Arc::new(Shared {
        credentials: Credentials::new(cfg.tokens.clone(), cfg.users.clone()),
        cfg: cfg.clone(),
        index: Mutex::new(index),
        inflight: AtomicU64::new(0),
        hits: AtomicU64::new(0),
        misses: AtomicU64::new(0),
        uploads: AtomicU64::new(0),
        rejects: AtomicU64::new(0),
        evictions: AtomicU64::new(0),
    });
    let app = Router::new()
        .route("/status", get(blobs::status))
        .route("/{a}/{b}", any(blobs::blob))
        .route("/{a}/{b}/{c}", any(blobs::blob))
        .layer(axum::extract::DefaultBodyLimit::disable())
        .with_state(shared.clone());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(err("starting the server runtime", &cfg.dir))?;
    let listen = PathBuf::from(&cfg.listen);
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(&cfg.listen)
            .await
            .map_err(err("listening on", &listen))?;
        let addr = listener
            .local_addr()
            .map_err(err("listening on", &listen))?;
        ready(addr);
        let graceful = hyper_util::server::graceful::GracefulShutdown::new();
        let mut stop = std::pin::pin!(shutdown_signal());
        loop {
            tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => {
                        tokio::spawn(connection(
                            stream,
                            app.clone(),
                            tls.clone(),
                            cfg.idle_timeout,
                            graceful.watcher(),
                        ));
                    }
                    // Out of file descriptors, say: wait for connections to close.
                    Err(e) => {
                        tracing::warn!(error = %e, "accepting a connection failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
                _ = &mut stop => break,
            }
        }
        drop(listener);
        if tokio::time::timeout(SHUTDOWN_GRACE, graceful.shutdown())
            .await
            .is_err()
        {
            tracing::warn!(
                "requests still running {} s after the stop signal were dropped (their uploads \
                 are discarded)",
                SHUTDOWN_GRACE.as_secs()
            );
        }
        Ok::<(), StoreError>(())
    })?;
    Ok(shared.status())
}
