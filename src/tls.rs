//! TLS configuration: PEM files in, rustls `ServerConfig` / `ClientConfig` out, and the
//! reloader that rebuilds them when the files change or on SIGHUP.
//!
//! Two sides, each optional, each with its own files (names as etcd's flags):
//! - the **client listener** ([`ServerTls::client_side`]): `--cert-file`/`--key-file`, and with
//!   `--client-cert-auth` every client must present a certificate signed by
//!   `--trusted-ca-file` (without it, a presented certificate is checked against that CA but
//!   none is required);
//! - the **peer side** ([`PeerTls`]): `--peer-cert-file`/`--peer-key-file`/
//!   `--peer-trusted-ca-file`, all three or none. Peer TLS is always mutual: the peer listener
//!   demands a certificate from the peer CA, and the outgoing peer client presents the node's
//!   peer certificate and trusts only the peer CA.
//!
//! The crypto provider is aws-lc-rs, the one reqwest's `rustls` feature brings ([`provider`]).
//!
//! # Reload
//! [`Reloadable`] holds the current config behind an `ArcSwap`: a new connection loads it
//! without a lock, a reload swaps it whole. [`run_reloader`] polls the files' modification
//! times (every [`RELOAD_POLL`]) and listens for SIGHUP; a rebuild that fails is logged and the
//! old config stays in force. Connections already open keep the config they started with.
//!
//! # What it must not do
//! Hold a lock across an await; fall back to plaintext when a TLS file is bad (a node with a
//! broken TLS file refuses to start; a broken reload keeps the old config).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
pub use leasecore_client::tls::{
    ClientTls, IdentityFiles, TlsError, identity_error, load_certs, load_identity, load_roots,
    provider, trust_nothing,
};
use rustls::ServerConfig;
use rustls::server::WebPkiClientVerifier;
use tokio_util::sync::CancellationToken;

/// How often the reloader looks at the files' modification times.
pub const RELOAD_POLL: Duration = Duration::from_secs(2);

/// What a TLS listener serves with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerTls {
    pub identity: IdentityFiles,
    /// The CA client certificates are checked against.
    pub client_ca: Option<PathBuf>,
    /// Refuse clients without a certificate from `client_ca` at the handshake.
    pub require_client_cert: bool,
}

/// The peer side: mutual TLS with one CA, both directions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerTls {
    pub identity: IdentityFiles,
    pub ca: PathBuf,
}

impl ServerTls {
    /// The client listener's TLS from the serve flags; `None` when client TLS is off.
    pub fn client_side(
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
        trusted_ca: Option<PathBuf>,
        client_cert_auth: bool,
    ) -> Result<Option<ServerTls>, TlsError> {
        match (cert, key) {
            (None, None) if trusted_ca.is_none() && !client_cert_auth => Ok(None),
            (None, None) => Err(TlsError::Usage(
                "--trusted-ca-file and --client-cert-auth need --cert-file and --key-file".into(),
            )),
            (Some(cert), Some(key)) => {
                if client_cert_auth && trusted_ca.is_none() {
                    return Err(TlsError::Usage(
                        "--client-cert-auth needs --trusted-ca-file".into(),
                    ));
                }
                Ok(Some(ServerTls {
                    identity: IdentityFiles { cert, key },
                    client_ca: trusted_ca,
                    require_client_cert: client_cert_auth,
                }))
            }
            _ => Err(TlsError::Usage(
                "--cert-file and --key-file go together".into(),
            )),
        }
    }

    /// Every file this config reads (watched for reload).
    pub fn files(&self) -> Vec<PathBuf> {
        let mut f = vec![self.identity.cert.clone(), self.identity.key.clone()];
        f.extend(self.client_ca.clone());
        f
    }

    /// Load the files and build the rustls config.
    pub fn build(&self) -> Result<ServerConfig, TlsError> {
        let provider = provider();
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Build(e.to_string()))?;
        let builder = match &self.client_ca {
            Some(ca) => {
                let roots = Arc::new(load_roots(ca)?);
                let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider);
                let verifier = if self.require_client_cert {
                    verifier
                } else {
                    verifier.allow_unauthenticated()
                };
                let verifier = verifier.build().map_err(|e| TlsError::Ca {
                    path: ca.clone(),
                    detail: e.to_string(),
                })?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let (certs, key) = load_identity(&self.identity)?;
        let mut config = builder
            .with_single_cert(certs, key)
            .map_err(|e| identity_error(&self.identity, e))?;
        // The listeners speak HTTP/1.1 only.
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(config)
    }
}

impl PeerTls {
    /// The peer side from the serve flags: all three or none.
    pub fn from_flags(
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
        ca: Option<PathBuf>,
    ) -> Result<Option<PeerTls>, TlsError> {
        match (cert, key, ca) {
            (None, None, None) => Ok(None),
            (Some(cert), Some(key), Some(ca)) => Ok(Some(PeerTls {
                identity: IdentityFiles { cert, key },
                ca,
            })),
            _ => Err(TlsError::Usage(
                "peer TLS is mutual: give all of --peer-cert-file, --peer-key-file and \
                 --peer-trusted-ca-file, or none"
                    .into(),
            )),
        }
    }

    /// The peer listener's side: a certificate from the peer CA is required.
    pub fn server(&self) -> ServerTls {
        ServerTls {
            identity: self.identity.clone(),
            client_ca: Some(self.ca.clone()),
            require_client_cert: true,
        }
    }

    /// The outgoing side: present the peer certificate, trust only the peer CA.
    pub fn client(&self) -> ClientTls {
        ClientTls {
            ca: Some(self.ca.clone()),
            identity: Some(self.identity.clone()),
        }
    }
}

/// A TLS-built value (a rustls config, or a client made from one) that can be rebuilt from its
/// files and swapped for new connections.
pub struct Reloadable<T> {
    current: ArcSwap<T>,
    rebuild: Box<dyn Fn() -> Result<T, TlsError> + Send + Sync>,
    files: Vec<PathBuf>,
    what: &'static str,
    /// Successful and failed reloads, for `/metrics`.
    pub reloads: AtomicU64,
    pub reload_failures: AtomicU64,
}

impl<T> Reloadable<T> {
    /// Build once (an error here stops the start), remembering how to rebuild.
    pub fn new(
        what: &'static str,
        files: Vec<PathBuf>,
        rebuild: impl Fn() -> Result<T, TlsError> + Send + Sync + 'static,
    ) -> Result<Self, TlsError> {
        let first = rebuild()?;
        Ok(Reloadable {
            current: ArcSwap::from_pointee(first),
            rebuild: Box::new(rebuild),
            files,
            what,
            reloads: AtomicU64::new(0),
            reload_failures: AtomicU64::new(0),
        })
    }

    /// The config in force now.
    pub fn current(&self) -> Arc<T> {
        self.current.load_full()
    }

    /// Rebuild from the files; on failure keep the old one. Returns whether it swapped.
    pub fn reload(&self) -> bool {
        match (self.rebuild)() {
            Ok(next) => {
                self.current.store(Arc::new(next));
                self.reloads.fetch_add(1, Ordering::Relaxed);
                tracing::info!(what = self.what, "TLS configuration reloaded");
                true
            }
            Err(e) => {
                self.reload_failures.fetch_add(1, Ordering::Relaxed);
                tracing::error!(what = self.what, error = %e, "TLS reload failed; the previous configuration stays in force");
                false
            }
        }
    }
}

/// Something [`run_reloader`] can reload (type-erased [`Reloadable`]).
pub trait Reload: Send + Sync {
    /// What it is ("client listener", "peer listener", "peer client").
    fn what(&self) -> &'static str;
    fn files(&self) -> &[PathBuf];
    fn reload(&self) -> bool;
    /// Successful and failed reloads so far.
    fn counts(&self) -> (u64, u64);
}

impl<T: Send + Sync> Reload for Reloadable<T> {
    fn what(&self) -> &'static str {
        self.what
    }
    fn files(&self) -> &[PathBuf] {
        &self.files
    }
    fn reload(&self) -> bool {
        Reloadable::reload(self)
    }
    fn counts(&self) -> (u64, u64) {
        (
            self.reloads.load(Ordering::Relaxed),
            self.reload_failures.load(Ordering::Relaxed),
        )
    }
}

/// What a file looked like at one look: modification time and length (`None`: unreadable).
type Stamp = Option<(SystemTime, u64)>;

fn stamp(path: &Path) -> Stamp {
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len()))
}

fn stamps(r: &dyn Reload) -> Vec<Stamp> {
    r.files().iter().map(|f| stamp(f)).collect()
}

/// Reload every item whose files changed (polled every `poll`), and all of them on SIGHUP,
/// until `cancel` fires.
pub async fn run_reloader(items: Vec<Arc<dyn Reload>>, poll: Duration, cancel: CancellationToken) {
    if items.is_empty() {
        return;
    }
    let mut seen: Vec<Vec<Stamp>> = items.iter().map(|r| stamps(r.as_ref())).collect();
    #[cfg(unix)]
    let mut hup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(error = %e, "no SIGHUP handler: TLS files reload on change only");
            None
        }
    };
    let mut tick = tokio::time::interval(poll);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        #[cfg(unix)]
        let hup_fired = async {
            match hup.as_mut() {
                Some(s) => s.recv().await,
                None => std::future::pending().await,
            }
        };
        #[cfg(not(unix))]
        let hup_fired = std::future::pending::<Option<()>>();
        let all = tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => false,
            _ = hup_fired => true,
        };
        if all {
            tracing::info!("SIGHUP: reloading the TLS files");
        }
        for (item, last) in items.iter().zip(seen.iter_mut()) {
            let now = stamps(item.as_ref());
            if all || now != *last {
                // Remember the look before the rebuild: a file written again during it is
                // seen at the next poll. A failed rebuild is not retried until a file changes
                // (or SIGHUP): one error per change, not one every poll.
                *last = now;
                item.reload();
            }
        }
    }
}
