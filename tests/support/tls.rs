//! TLS test parts: a certificate authority made with rcgen in a temp dir ([`Pki`]), an HTTPS
//! echo upstream ([`https_echo`]), and Redis over TLS with a password, standalone
//! ([`TlsRedis`]) and as a 6-node cluster ([`TlsRedisCluster`]).
//!
//! Nothing is mocked: the Redis servers are real `redis-server` processes with `--tls-port`;
//! if `redis-server` or `redis-cli` is missing the tests fail.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tempfile::TempDir;

use super::free_port;
use super::poll::eventually_blocking;

/// A test CA and the certificates it issued, as PEM files in a temp dir.
pub struct Pki {
    /// The CA (certificate and key).
    ca: CertifiedIssuer<'static, KeyPair>,
    /// Where the files are.
    pub dir: TempDir,
}

impl Pki {
    /// A new CA named `name`; its certificate is written to `ca.pem`.
    pub fn new(name: &str) -> Pki {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("ca.pem"), ca.pem()).unwrap();
        Pki { ca, dir }
    }

    /// The CA certificate file.
    pub fn ca_path(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// The CA certificate, PEM.
    pub fn ca_pem(&self) -> String {
        self.ca.pem()
    }

    /// A certificate for `names` (DNS names or IP addresses, as SANs), signed by the CA:
    /// (certificate PEM, key PEM). Good for server and client authentication.
    pub fn issue_pem(&self, names: &[&str]) -> (String, String) {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
        params
            .distinguished_name
            .push(DnType::CommonName, names.first().copied().unwrap_or("client"));
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        let cert = params.signed_by(&key, &self.ca).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    /// A certificate for `names` valid until `(year, month, day)` 00:00 UTC, written to
    /// `<file>.crt` and `<file>.key`: their paths.
    pub fn issue_until(&self, file: &str, names: &[&str], until: (i32, u8, u8)) -> (PathBuf, PathBuf) {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
        params
            .distinguished_name
            .push(DnType::CommonName, names.first().copied().unwrap_or("x"));
        params.not_before = rcgen::date_time_ymd(2020, 1, 1);
        params.not_after = rcgen::date_time_ymd(until.0, until.1, until.2);
        let cert = params.signed_by(&key, &self.ca).unwrap();
        let (cp, kp) = (
            self.dir.path().join(format!("{file}.crt")),
            self.dir.path().join(format!("{file}.key")),
        );
        std::fs::write(&cp, cert.pem()).unwrap();
        std::fs::write(&kp, key.serialize_pem()).unwrap();
        (cp, kp)
    }

    /// [`Pki::issue_pem`] written to `<file>.crt` and `<file>.key`: their paths.
    pub fn issue(&self, file: &str, names: &[&str]) -> (PathBuf, PathBuf) {
        let (c, k) = self.issue_pem(names);
        let (cp, kp) = (
            self.dir.path().join(format!("{file}.crt")),
            self.dir.path().join(format!("{file}.key")),
        );
        std::fs::write(&cp, c).unwrap();
        std::fs::write(&kp, k).unwrap();
        (cp, kp)
    }
}

/// The DER of the first certificate in a PEM file.
pub fn cert_der(path: &Path) -> CertificateDer<'static> {
    CertificateDer::pem_file_iter(path).unwrap().next().unwrap().unwrap()
}

/// A rustls server config from PEM files (ring provider); with `client_ca`, client
/// certificates are required.
pub fn server_config(cert: &Path, key: &Path, client_ca: Option<&Path>) -> Arc<rustls::ServerConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let certs: Vec<_> = CertificateDer::pem_file_iter(cert)
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let key = PrivateKeyDer::from_pem_file(key).unwrap();
    let b = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .unwrap();
    let b = match client_ca {
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in CertificateDer::pem_file_iter(ca).unwrap() {
                roots.add(c.unwrap()).unwrap();
            }
            b.with_client_cert_verifier(
                rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                    .build()
                    .unwrap(),
            )
        }
        None => b.with_no_client_auth(),
    };
    let mut cfg = b.with_single_cert(certs, key).unwrap();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Arc::new(cfg)
}

/// The echo upstream (`tollgate::demo::echo`) over TLS with `cert`/`key`, on a free port.
/// With `client_ca`, it requires a client certificate. Runs until the test ends.
pub async fn https_echo(cert: &Path, key: &Path, client_ca: Option<&Path>) -> SocketAddr {
    let acceptor = tokio_rustls::TlsAcceptor::from(server_config(cert, key, client_ca));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = l.accept().await else { continue };
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(stream).await else { return };
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tls), hyper::service::service_fn(tollgate::demo::echo))
                    .await;
            });
        }
    });
    addr
}

/// `redis-cli --tls --cacert <ca> -a <password> -p <port> <args>`, trimmed stdout.
pub fn tls_cli(ca: &Path, password: &str, port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["--tls", "--cacert"])
        .arg(ca)
        .args(["--no-auth-warning", "-a", password, "-p"])
        .arg(port.to_string())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("redis-cli must be installed (the Redis tests never skip)");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Spawn `redis-server` serving TLS only (`--port 0 --tls-port <port>`), with a password.
fn spawn_tls_server(
    port: u16,
    dir: &Path,
    cert: &Path,
    key: &Path,
    ca: &Path,
    password: &str,
    extra: &[String],
) -> Child {
    Command::new("redis-server")
        .args(["--port", "0", "--tls-port"])
        .arg(port.to_string())
        .arg("--tls-cert-file")
        .arg(cert)
        .arg("--tls-key-file")
        .arg(key)
        .arg("--tls-ca-cert-file")
        .arg(ca)
        .args([
            "--tls-auth-clients",
            "no",
            "--requirepass",
            password,
            "--masterauth",
            password,
        ])
        .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .args(["--daemonize", "no", "--protected-mode", "no"])
        .arg("--logfile")
        .arg(format!("redis-{port}.log"))
        .args(extra)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-server must be installed (the Redis tests never skip)")
}

/// A standalone `redis-server` speaking only TLS, with a password. Killed on drop.
pub struct TlsRedis {
    child: Child,
    /// The TLS port.
    pub port: u16,
    /// The password.
    pub password: String,
    /// The CA its certificate chains to.
    pub pki: Pki,
}

impl TlsRedis {
    /// Start it (certificate for `localhost` and `127.0.0.1`) and wait until it answers PING
    /// over TLS with the password.
    pub fn start(password: &str) -> TlsRedis {
        let pki = Pki::new("redis test CA");
        let (cert, key) = pki.issue("redis", &["localhost", "127.0.0.1"]);
        for _ in 0..5 {
            let port = free_port();
            let mut child = spawn_tls_server(port, pki.dir.path(), &cert, &key, &pki.ca_path(), password, &[]);
            let ok = eventually_blocking(Duration::from_secs(5), || {
                matches!(child.try_wait(), Ok(Some(_))) || tls_cli(&pki.ca_path(), password, port, &["PING"]) == "PONG"
            }) && matches!(child.try_wait(), Ok(None));
            if ok {
                return TlsRedis {
                    child,
                    port,
                    password: password.to_owned(),
                    pki,
                };
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("redis-server with TLS did not start (logs in {:?})", pki.dir.path());
    }

    /// `rediss://127.0.0.1:<port>/`.
    pub fn url(&self) -> String {
        format!("rediss://127.0.0.1:{}/", self.port)
    }

    /// redis-cli over TLS with the password.
    pub fn cli(&self, args: &[&str]) -> String {
        tls_cli(&self.pki.ca_path(), &self.password, self.port, args)
    }
}

impl Drop for TlsRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A 6-node Redis Cluster (3 masters, 3 replicas) speaking only TLS (clients, replication and
/// the cluster bus), with a password. Killed on drop.
pub struct TlsRedisCluster {
    children: Vec<Child>,
    /// The nodes' TLS ports.
    pub ports: Vec<u16>,
    /// The password.
    pub password: String,
    /// The CA the nodes' certificate chains to.
    pub pki: Pki,
}

impl TlsRedisCluster {
    /// Start the nodes, create the cluster over TLS, and wait until every node reports
    /// `cluster_state:ok`.
    pub fn start(password: &str) -> TlsRedisCluster {
        let pki = Pki::new("redis cluster test CA");
        let (cert, key) = pki.issue("redis", &["localhost", "127.0.0.1"]);
        let mut ports: Vec<u16> = Vec::new();
        while ports.len() < 6 {
            let p = free_port();
            if p < 55_000 && !ports.contains(&p) && std::net::TcpListener::bind(("127.0.0.1", p + 10_000)).is_ok() {
                ports.push(p);
            }
        }
        let mut c = TlsRedisCluster {
            children: Vec::new(),
            ports: ports.clone(),
            password: password.to_owned(),
            pki,
        };
        for &p in &ports {
            let extra: Vec<String> = [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                &format!("nodes-{p}.conf"),
                "--cluster-node-timeout",
                "2000",
                "--tls-cluster",
                "yes",
                "--tls-replication",
                "yes",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            c.children.push(spawn_tls_server(
                p,
                c.pki.dir.path(),
                &cert,
                &key,
                &c.pki.ca_path(),
                password,
                &extra,
            ));
        }
        let ca = c.pki.ca_path();
        let up = eventually_blocking(Duration::from_secs(10), || {
            ports.iter().all(|&p| tls_cli(&ca, password, p, &["PING"]) == "PONG")
        });
        assert!(up, "TLS cluster nodes did not start (logs in {:?})", c.pki.dir.path());
        let addrs: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let out = Command::new("redis-cli")
            .args(["--tls", "--cacert"])
            .arg(&ca)
            .args(["--no-auth-warning", "-a", password, "--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("redis-cli must be installed (the Redis tests never skip)");
        assert!(
            out.status.success(),
            "redis-cli --tls --cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let healthy = eventually_blocking(Duration::from_secs(20), || {
            ports.iter().all(|&p| {
                let info = tls_cli(&ca, password, p, &["CLUSTER", "INFO"]);
                info.contains("cluster_state:ok") && info.contains("cluster_slots_ok:16384")
            })
        });
        assert!(
            healthy,
            "TLS cluster did not become healthy (logs in {:?})",
            c.pki.dir.path()
        );
        c
    }

    /// `rediss://127.0.0.1:<port>/` for every node.
    pub fn seed_urls(&self) -> Vec<String> {
        self.ports.iter().map(|p| format!("rediss://127.0.0.1:{p}/")).collect()
    }

    /// redis-cli over TLS with the password, against node `port`, following redirects (`-c`).
    pub fn cli(&self, port: u16, args: &[&str]) -> String {
        let mut a = vec!["-c"];
        a.extend_from_slice(args);
        tls_cli(&self.pki.ca_path(), &self.password, port, &a)
    }
}

impl Drop for TlsRedisCluster {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
