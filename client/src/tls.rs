//! Client-side TLS: PEM files in, a rustls `ClientConfig` out (`--cacert`, `--cert`, `--key`),
//! and the PEM loading the server's TLS shares.
//!
//! The crypto provider is aws-lc-rs, the one reqwest's `rustls` feature brings ([`provider`]).
//! Without a CA file, servers are verified against the platform's trust store.
//!
//! # What it must not do
//! Fall back to plaintext, or to trusting anything, when a file is bad: building fails and
//! says which file and why.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::crypto::CryptoProvider;
use rustls::{ClientConfig, RootCertStore};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use thiserror::Error;

/// The crypto provider of every TLS config here.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// Why a TLS configuration could not be built.
#[derive(Debug, Error)]
pub enum TlsError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: no PEM certificate in it")]
    NoCertificate { path: PathBuf },
    #[error("{path}: no PEM private key in it (PKCS#8, PKCS#1 or SEC1)")]
    NoKey { path: PathBuf },
    #[error("{path}: malformed PEM: {detail}")]
    Pem { path: PathBuf, detail: String },
    #[error("{path}: not a usable CA certificate: {detail}")]
    Ca { path: PathBuf, detail: String },
    #[error("the private key in {key} does not belong to the certificate in {cert}")]
    KeyMismatch { cert: PathBuf, key: PathBuf },
    #[error("certificate {cert} with key {key}: {detail}")]
    Identity {
        cert: PathBuf,
        key: PathBuf,
        detail: String,
    },
    #[error("{0}")]
    Usage(String),
    #[error("building the TLS configuration: {0}")]
    Build(String),
}

/// A certificate chain and its private key, as files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdentityFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// What an outgoing TLS client uses.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClientTls {
    /// Trust only these CAs (none: the platform's trust store).
    pub ca: Option<PathBuf>,
    /// Present this certificate (mutual TLS).
    pub identity: Option<IdentityFiles>,
}

impl ClientTls {
    /// From the client flags (`--cacert`, `--cert`, `--key`); `None` when none is given.
    pub fn from_flags(
        ca: Option<PathBuf>,
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
    ) -> Result<Option<ClientTls>, TlsError> {
        let identity = match (cert, key) {
            (None, None) => None,
            (Some(cert), Some(key)) => Some(IdentityFiles { cert, key }),
            _ => return Err(TlsError::Usage("--cert and --key go together".into())),
        };
        if ca.is_none() && identity.is_none() {
            return Ok(None);
        }
        Ok(Some(ClientTls { ca, identity }))
    }

    /// Every file this config reads (watched for reload).
    pub fn files(&self) -> Vec<PathBuf> {
        let mut f: Vec<PathBuf> = self.ca.iter().cloned().collect();
        if let Some(id) = &self.identity {
            f.push(id.cert.clone());
            f.push(id.key.clone());
        }
        f
    }

    /// Load the files and build the rustls config.
    pub fn build(&self) -> Result<ClientConfig, TlsError> {
        let builder = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Build(e.to_string()))?;
        let builder = match &self.ca {
            Some(ca) => builder.with_root_certificates(load_roots(ca)?),
            None => {
                use rustls_platform_verifier::BuilderVerifierExt;
                builder
                    .with_platform_verifier()
                    .map_err(|e| TlsError::Build(format!("the platform trust store: {e}")))?
            }
        };
        let mut config = match &self.identity {
            Some(id) => {
                let (certs, key) = load_identity(id)?;
                builder
                    .with_client_auth_cert(certs, key)
                    .map_err(|e| identity_error(id, e))?
            }
            None => builder.with_no_client_auth(),
        };
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(config)
    }
}

/// A client config that trusts no certificate: for clients that speak plain http only (the
/// plaintext peer client), and the fallback of a user client on a host without a system trust
/// store (a `FROM scratch` container: reqwest's default would fail to build at all there;
/// with this, http works and https without `--cacert` fails at the handshake).
pub fn trust_nothing() -> ClientConfig {
    let mut config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("the provider supports the default protocol versions")
        .with_root_certificates(RootCertStore::empty())
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    config
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// The certificates in a PEM file (at least one).
pub fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Pem {
            path: path.to_path_buf(),
            detail: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            path: path.to_path_buf(),
        });
    }
    Ok(certs)
}

/// The private key in a PEM file.
pub fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let pem = read(path)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| match e {
        rustls_pki_types::pem::Error::NoItemsFound => TlsError::NoKey {
            path: path.to_path_buf(),
        },
        e => TlsError::Pem {
            path: path.to_path_buf(),
            detail: e.to_string(),
        },
    })
}

/// A certificate chain and its key.
pub fn load_identity(
    id: &IdentityFiles,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), TlsError> {
    Ok((load_certs(&id.cert)?, load_key(&id.key)?))
}

/// A root store of the CA certificates in a PEM file.
pub fn load_roots(path: &Path) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in load_certs(path)? {
        roots.add(cert).map_err(|e| TlsError::Ca {
            path: path.to_path_buf(),
            detail: e.to_string(),
        })?;
    }
    Ok(roots)
}

/// A rustls identity error, naming the files.
pub fn identity_error(id: &IdentityFiles, e: rustls::Error) -> TlsError {
    match e {
        rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch) => {
            TlsError::KeyMismatch {
                cert: id.cert.clone(),
                key: id.key.clone(),
            }
        }
        e => TlsError::Identity {
            cert: id.cert.clone(),
            key: id.key.clone(),
            detail: e.to_string(),
        },
    }
}
