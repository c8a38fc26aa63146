//! TLS flags (names as etcd's): `leasecore serve`'s listener certificates and the client
//! commands' `--cacert`/`--cert`/`--key`. Flattened argument groups, so that `main.rs`
//! carries only one-line hooks; the PEM loading and rustls configs live in `leasecore::tls`.
//!
//! Every flag reads an environment variable too (`LEASECORE_*`), like the other flags.

use std::path::PathBuf;

use clap::Args;
use leasecore::client::ClientError;
use leasecore::node::NodeConfig;
use leasecore::tls::{ClientTls, PeerTls, ServerTls, TlsError};

#[derive(Args, Debug)]
pub struct ServeTlsArgs {
    /// Certificate (PEM chain) of the client listener: clients connect with https.
    #[arg(long, env = "LEASECORE_CERT_FILE")]
    pub cert_file: Option<PathBuf>,
    /// Private key (PEM) of --cert-file.
    #[arg(long, env = "LEASECORE_KEY_FILE")]
    pub key_file: Option<PathBuf>,
    /// CA (PEM) that client certificates are checked against.
    #[arg(long, env = "LEASECORE_TRUSTED_CA_FILE")]
    pub trusted_ca_file: Option<PathBuf>,
    /// Require every client to present a certificate from --trusted-ca-file (refused at the
    /// TLS handshake otherwise).
    #[arg(
        long,
        env = "LEASECORE_CLIENT_CERT_AUTH",
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub client_cert_auth: bool,
    /// Certificate (PEM chain) of the peer listener, also presented to peers when calling
    /// them. Peer TLS is mutual and needs all three --peer-* files; every node of a cluster
    /// must have it on (or off).
    #[arg(long, env = "LEASECORE_PEER_CERT_FILE")]
    pub peer_cert_file: Option<PathBuf>,
    /// Private key (PEM) of --peer-cert-file.
    #[arg(long, env = "LEASECORE_PEER_KEY_FILE")]
    pub peer_key_file: Option<PathBuf>,
    /// The peer CA (PEM): peers must present a certificate from it, and peers' listeners are
    /// trusted only if theirs is from it.
    #[arg(long, env = "LEASECORE_PEER_TRUSTED_CA_FILE")]
    pub peer_trusted_ca_file: Option<PathBuf>,
}

impl ServeTlsArgs {
    /// Put these settings into `cfg` (the files are read when the node starts).
    pub fn apply(self, cfg: &mut NodeConfig) -> Result<(), TlsError> {
        cfg.client_tls = ServerTls::client_side(
            self.cert_file,
            self.key_file,
            self.trusted_ca_file,
            self.client_cert_auth,
        )?;
        cfg.peer_tls = PeerTls::from_flags(
            self.peer_cert_file,
            self.peer_key_file,
            self.peer_trusted_ca_file,
        )?;
        Ok(())
    }
}

#[derive(Args, Clone, Debug)]
pub struct ClientTlsArgs {
    /// CA (PEM) to verify https endpoints with (default: the system's trust store).
    #[arg(
        long = "cacert",
        id = "tls_cacert",
        global = true,
        env = "LEASECORE_CACERT"
    )]
    pub cacert: Option<PathBuf>,
    /// Client certificate (PEM) to present (for servers with --client-cert-auth).
    #[arg(long = "cert", id = "tls_cert", global = true, env = "LEASECORE_CERT")]
    pub cert: Option<PathBuf>,
    /// Private key (PEM) of --cert.
    // Its own id: `kv get KEY` has a positional named `key`.
    #[arg(long = "key", id = "tls_key", global = true, env = "LEASECORE_KEY")]
    pub key: Option<PathBuf>,
}

impl ClientTlsArgs {
    /// Make every client this process builds use these settings (a no-op without them).
    pub fn install(&self) -> Result<(), ClientError> {
        let tls = ClientTls::from_flags(self.cacert.clone(), self.cert.clone(), self.key.clone())
            .map_err(|e| ClientError::Usage(e.to_string()))?;
        match tls {
            Some(tls) => leasecore::client::use_tls(&tls),
            None => Ok(()),
        }
    }
}
