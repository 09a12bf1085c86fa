//! TLS with rustls and the `ring` provider, TLS 1.2 and 1.3 only.
//!
//! * The proxy listener: [`server_config`] builds a config whose certificate comes from a
//!   [`CertResolver`], re-read by [`CertResolver::reload`] when its files change. A new
//!   certificate that fails to load leaves the old one serving. ALPN offers `h2` and
//!   `http/1.1`; with a `client_ca_file`, client certificates are verified (mutual TLS).
//! * The upstream: [`client_config`] verifies against the webpki roots or `ca_file`, sends a
//!   client certificate when configured, and skips verification only with
//!   `insecure_skip_verify` (warned at every start by the config notes).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arc_swap::ArcSwap;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig, SignatureScheme};

/// Why a certificate, key or TLS config could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A file holds no usable certificate.
    #[error("{path}: no PEM certificate in it ({why})")]
    Cert {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        why: String,
    },
    /// A file holds no usable private key.
    #[error("{path}: no usable PEM private key in it ({why})")]
    Key {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        why: String,
    },
    /// The private key does not belong to the certificate.
    #[error("the private key does not match the certificate")]
    Mismatch,
    /// rustls refused the configuration.
    #[error("TLS configuration: {0}")]
    Config(#[from] rustls::Error),
    /// The client-certificate verifier could not be built.
    #[error("client CA: {0}")]
    Verifier(String),
}

/// The `ring` crypto provider every TLS config here uses.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Make `ring` the process default too, for libraries that build their own configs (the Redis
/// client). Idempotent.
pub fn install_default_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// TLS 1.3 and 1.2 only.
static VERSIONS: &[&rustls::SupportedProtocolVersion] = &[&rustls::version::TLS13, &rustls::version::TLS12];

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// Every certificate in a PEM file (at least one).
pub fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Cert {
            path: path.to_path_buf(),
            why: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::Cert {
            path: path.to_path_buf(),
            why: "the file is empty or holds something else".into(),
        });
    }
    Ok(certs)
}

/// The private key in a PEM file (PKCS#8, PKCS#1 or SEC1).
pub fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let pem = read(path)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| TlsError::Key {
        path: path.to_path_buf(),
        why: e.to_string(),
    })
}

/// A certificate chain and its private key, checked to belong together.
pub fn load_certified_key(cert: &Path, key: &Path) -> Result<CertifiedKey, TlsError> {
    let certs = load_certs(cert)?;
    let key_der = load_key(key)?;
    let signing = provider()
        .key_provider
        .load_private_key(key_der)
        .map_err(|e| TlsError::Key {
            path: key.to_path_buf(),
            why: e.to_string(),
        })?;
    let ck = CertifiedKey::new(certs, signing);
    match ck.keys_match() {
        Ok(()) | Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::Unknown)) => Ok(ck),
        Err(rustls::Error::InconsistentKeys(_)) => Err(TlsError::Mismatch),
        Err(e) => Err(TlsError::Cert {
            path: cert.to_path_buf(),
            why: e.to_string(),
        }),
    }
}

/// A root store holding every certificate of a PEM bundle.
pub fn load_roots(path: &Path) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for c in load_certs(path)? {
        roots.add(c).map_err(|e| TlsError::Cert {
            path: path.to_path_buf(),
            why: e.to_string(),
        })?;
    }
    Ok(roots)
}

/// The listener's certificate, swapped whole when its files change. Handshakes load it once
/// (an `ArcSwap` load, no lock).
#[derive(Debug)]
pub struct CertResolver {
    /// The chain and key now served.
    current: ArcSwap<CertifiedKey>,
    /// PEM chain.
    cert_file: PathBuf,
    /// PEM key.
    key_file: PathBuf,
}

impl CertResolver {
    /// Load the certificate and key.
    pub fn load(cert_file: &Path, key_file: &Path) -> Result<Self, TlsError> {
        let ck = load_certified_key(cert_file, key_file)?;
        Ok(CertResolver {
            current: ArcSwap::from_pointee(ck),
            cert_file: cert_file.to_path_buf(),
            key_file: key_file.to_path_buf(),
        })
    }

    /// Re-read the files; on success the new certificate serves the next handshakes. On failure
    /// the old one keeps serving and the error is returned (to be logged and counted).
    pub fn reload(&self) -> Result<(), TlsError> {
        let ck = load_certified_key(&self.cert_file, &self.key_file)?;
        self.current.store(Arc::new(ck));
        Ok(())
    }

    /// The files to watch.
    pub fn files(&self) -> [PathBuf; 2] {
        [self.cert_file.clone(), self.key_file.clone()]
    }

    /// The DER of the end-entity certificate now served (tests, logs).
    pub fn serving(&self) -> Option<CertificateDer<'static>> {
        self.current.load().cert.first().cloned()
    }
}

impl ResolvesServerCert for CertResolver {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.load_full())
    }
}

/// The `notAfter` of a DER X.509 certificate, unix seconds; `None` when it does not parse.
/// Reads only the path to it: Certificate → tbsCertificate → (version) serial, signature,
/// issuer → validity → notAfter (UTCTime or GeneralizedTime, in UTC).
pub fn not_after(der: &[u8]) -> Option<u64> {
    /// One DER element at the start of `b`: (tag, contents, rest).
    fn tlv(b: &[u8]) -> Option<(u8, &[u8], &[u8])> {
        let (&tag, b) = b.split_first()?;
        let (&first, mut b) = b.split_first()?;
        let len = if first < 0x80 {
            usize::from(first)
        } else {
            let n = usize::from(first & 0x7f);
            if n == 0 || n > 4 || b.len() < n {
                return None;
            }
            let len = b[..n].iter().fold(0usize, |a, &x| (a << 8) | usize::from(x));
            b = &b[n..];
            len
        };
        (b.len() >= len).then(|| (tag, &b[..len], &b[len..]))
    }
    let (_, cert, _) = tlv(der)?;
    let (_, tbs, _) = tlv(cert)?;
    let mut rest = tbs;
    if rest.first() == Some(&0xa0) {
        rest = tlv(rest)?.2; // version
    }
    for _ in 0..3 {
        rest = tlv(rest)?.2; // serial, signature algorithm, issuer
    }
    let (_, validity, _) = tlv(rest)?;
    let (_, _, after) = tlv(validity)?; // notBefore
    let (tag, t, _) = tlv(after)?;
    let t = std::str::from_utf8(t).ok()?.strip_suffix('Z')?;
    let num = |s: &str| s.parse::<i64>().ok();
    let (year, rest) = match tag {
        0x17 => {
            let yy = num(t.get(..2)?)?;
            (if yy < 50 { 2000 + yy } else { 1900 + yy }, t.get(2..)?)
        }
        0x18 => (num(t.get(..4)?)?, t.get(4..)?),
        _ => return None,
    };
    let (mo, d, h, mi, se) = (
        num(rest.get(0..2)?)?,
        num(rest.get(2..4)?)?,
        num(rest.get(4..6)?)?,
        num(rest.get(6..8)?)?,
        num(rest.get(8..10)?)?,
    );
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if mo <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (mo + if mo > 2 { -3 } else { 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    u64::try_from(days * 86_400 + h * 3600 + mi * 60 + se).ok()
}

/// The listener's rustls config (ALPN h2 + http/1.1) and the resolver to reload.
pub fn server_config(t: &ListenerTls) -> Result<(Arc<ServerConfig>, Arc<CertResolver>), TlsError> {
    let p = provider();
    let resolver = Arc::new(CertResolver::load(&t.cert_file, &t.key_file)?);
    let builder = ServerConfig::builder_with_provider(p.clone()).with_protocol_versions(VERSIONS)?;
    let builder = match &t.client_ca_file {
        Some(ca) => {
            let roots = Arc::new(load_roots(ca)?);
            let v = WebPkiClientVerifier::builder_with_provider(roots, p);
            let v = match t.client_auth {
                ClientAuth::Required => v,
                ClientAuth::Optional => v.allow_unauthenticated(),
            };
            builder.with_client_cert_verifier(v.build().map_err(|e| TlsError::Verifier(e.to_string()))?)
        }
        None => builder.with_no_client_auth(),
    };
    let mut cfg = builder.with_cert_resolver(resolver.clone());
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok((Arc::new(cfg), resolver))
}

/// The upstream client's rustls config: ALPN offering `alpn` (`http/1.1`, `h2`, or both as
/// `upstream.protocol` says), SNI on, verification against `ca_file` or the webpki roots unless
/// `insecure_skip_verify`.
pub fn client_config(t: &UpstreamTls, alpn: &[&[u8]]) -> Result<Arc<ClientConfig>, TlsError> {
    let p = provider();
    let builder = ClientConfig::builder_with_provider(p.clone()).with_protocol_versions(VERSIONS)?;
    let builder = if t.insecure_skip_verify {
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(NoVerify(p)))
    } else {
        let roots = match &t.ca_file {
            Some(ca) => load_roots(ca)?,
            None => RootCertStore {
                roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
            },
        };
        builder.with_root_certificates(roots)
    };
    let mut cfg = match &t.client_cert {
        Some((cert, key)) => builder.with_client_auth_cert(load_certs(cert)?, load_key(key)?)?,
        None => builder.with_no_client_auth(),
    };
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(cfg))
}

/// `insecure_skip_verify`: accepts any certificate, still checks handshake signatures.
#[derive(Debug)]
struct NoVerify(Arc<CryptoProvider>);

impl ServerCertVerifier for NoVerify {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// Does a listener with `client_ca_file` require a client certificate?
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientAuth {
    /// Clients without a certificate are served; one that sends a certificate must chain to
    /// the CA.
    Optional,
    /// Every client must present a certificate that chains to the CA.
    Required,
}

/// `tls:` on the proxy listener, validated.
#[derive(Debug, Clone)]
pub struct ListenerTls {
    /// PEM certificate chain (re-read when it changes).
    pub cert_file: PathBuf,
    /// PEM private key (re-read when it changes).
    pub key_file: PathBuf,
    /// Mutual TLS: the CA client certificates chain to.
    pub client_ca_file: Option<PathBuf>,
    /// Whether a client certificate is required (only with `client_ca_file`).
    pub client_auth: ClientAuth,
}

/// `upstream.tls:`, validated.
#[derive(Debug, Clone, Default)]
pub struct UpstreamTls {
    /// Trusted CA bundle instead of the webpki roots.
    pub ca_file: Option<PathBuf>,
    /// Client certificate chain and key (mutual TLS to the upstream).
    pub client_cert: Option<(PathBuf, PathBuf)>,
    /// Skip verification of the upstream's certificate (a warning at every start).
    pub insecure_skip_verify: bool,
    /// `upstream.tls.server_name`: the name sent as SNI and verified in the certificate of every
    /// https:// target (targets addressed by IP, or a name the certificate does not carry);
    /// `None`: each target's own host. Validated as a TLS server name.
    pub server_name: Option<String>,
}

#[cfg(test)]
mod expiry_tests {
    /// `notAfter` read from certificates made with rcgen, in UTCTime and GeneralizedTime.
    #[test]
    fn not_after_reads_the_certificates_validity() {
        for ((y, m, d), want) in [
            ((2030, 1, 2), 1_893_542_400u64),
            ((2021, 6, 1), 1_622_505_600),
            ((2051, 3, 1), 2_561_241_600),
        ] {
            let mut p = rcgen::CertificateParams::new(vec!["x".to_string()]).unwrap_or_default(); // allow-panic: test
            p.not_after = rcgen::date_time_ymd(y, m, d);
            let key = rcgen::KeyPair::generate();
            let cert = key.and_then(|k| p.self_signed(&k));
            let der = cert.map(|c| c.der().to_vec()).unwrap_or_default();
            assert_eq!(super::not_after(&der), Some(want), "{y}-{m}-{d}");
        }
        assert_eq!(super::not_after(b"not a certificate"), None);
    }
}
