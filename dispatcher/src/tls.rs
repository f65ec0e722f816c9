//! The dispatcher's side of TLS and the certificates it can make.
//!
//! - [`server_config`]: the server TLS configuration from PEM files. With
//!   a client CA, client certificates are *optional at the TLS layer* and
//!   verified when presented (a certificate from another CA, or expired,
//!   fails the handshake): one port serves dispatchctl (bearer tokens, no
//!   certificate) and agents. [`authorize_agent`] is then the check the
//!   AgentService makes: no verified certificate, no Attach
//!   (UNAUTHENTICATED); a certificate whose names do not include the node
//!   it registers as, no Attach (PERMISSION_DENIED).
//! - [`Pki`]: a small certificate authority kept in a directory (rcgen):
//!   `ca.pem`/`ca.key`, server certificates, agent client certificates.
//!   `--dev-tls DIR` ([`ensure_dev_tls`]) and `dispatcher gen-certs` both
//!   issue through it, so tests use the operators' code path.

use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use tonic::Status;
use tonic::transport::{Certificate, Identity, ServerTlsConfig};

/// Why TLS material could not be read, parsed or made.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("cannot read the {what} {path}: {source}")]
    Read {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    /// A file could not be written.
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A file is not what it should be.
    #[error("the {what} {path} is not usable: {why}")]
    Bad {
        what: &'static str,
        path: PathBuf,
        why: String,
    },
    /// rcgen could not make a key or certificate.
    #[error("making the {what}: {source}")]
    Generate { what: String, source: rcgen::Error },
    /// A certificate could not be parsed.
    #[error("cannot parse the certificate: {0}")]
    Parse(String),
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })
}

fn read_pem(what: &'static str, path: &Path, label: &str) -> Result<Vec<u8>, TlsError> {
    let bytes = read(what, path)?;
    if !String::from_utf8_lossy(&bytes).contains(&format!("-----BEGIN {label}")) {
        return Err(TlsError::Bad {
            what,
            path: path.to_path_buf(),
            why: format!("no PEM block \"{label}\""),
        });
    }
    Ok(bytes)
}

/// The server's TLS files (`--tls-cert`, `--tls-key`, `--tls-client-ca`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerTlsFiles {
    /// PEM certificate chain of the dispatcher.
    pub cert: PathBuf,
    /// PEM private key of `cert`.
    pub key: PathBuf,
    /// PEM CA certificate(s) agents' client certificates must chain to;
    /// when set, agents must present one.
    pub client_ca: Option<PathBuf>,
}

/// The tonic server configuration for `files`: the dispatcher's identity
/// and, with a client CA, optional-but-verified client certificates.
pub fn server_config(files: &ServerTlsFiles) -> Result<ServerTlsConfig, TlsError> {
    let cert = read_pem("TLS certificate (--tls-cert)", &files.cert, "CERTIFICATE")?;
    let key = read_pem("TLS key (--tls-key)", &files.key, "")?;
    if !String::from_utf8_lossy(&key).contains("PRIVATE KEY-----") {
        return Err(TlsError::Bad {
            what: "TLS key (--tls-key)",
            path: files.key.clone(),
            why: "no PEM private key".into(),
        });
    }
    let mut cfg = ServerTlsConfig::new().identity(Identity::from_pem(cert, key));
    if let Some(ca) = &files.client_ca {
        let ca = read_pem("client CA (--tls-client-ca)", ca, "CERTIFICATE")?;
        cfg = cfg
            .client_ca_root(Certificate::from_pem(ca))
            .client_auth_optional(true);
    }
    Ok(cfg)
}

/// The names a certificate is for: its subject common names, then its
/// DNS subject alternative names (`proto::peer::cert_names`, which the
/// relay applies too).
pub fn cert_names(der: &[u8]) -> Result<Vec<String>, TlsError> {
    proto::peer::cert_names(der).map_err(TlsError::Parse)
}

/// The AgentService's admission check, given the request's verified peer
/// certificates (leaf first; `None` on a plain-text connection or when the
/// agent presented none) and the node name it registers as.
pub fn authorize_agent(
    peer_certs: Option<&[tonic::transport::CertificateDer<'static>]>,
    node: &str,
) -> Result<(), Status> {
    proto::peer::authorize_node(peer_certs, node, "dispatcher's", "node")
}

pub use proto::peer::peer_certs;

/// How long an issued certificate is valid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Validity {
    /// Valid from this many days before now (0: from now).
    pub backdate_days: u32,
    /// Valid for this many days from its start.
    pub days: u32,
}

impl Default for Validity {
    fn default() -> Self {
        Validity {
            backdate_days: 0,
            days: 365,
        }
    }
}

impl Validity {
    fn apply(self, params: &mut CertificateParams) {
        let start = time::OffsetDateTime::now_utc()
            - time::Duration::days(i64::from(self.backdate_days))
            - time::Duration::minutes(5); // clock skew between machines
        params.not_before = start;
        params.not_after = start + time::Duration::days(i64::from(self.days));
    }
}

/// A certificate and key written as PEM files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IssuedCert {
    /// The certificate.
    pub cert: PathBuf,
    /// Its private key (mode 0600).
    pub key: PathBuf,
}

/// A certificate authority kept in a directory as `ca.pem` and `ca.key`.
pub struct Pki {
    dir: PathBuf,
    ca_pem: String,
    ca_key: KeyPair,
}

const CA_CERT: &str = "ca.pem";
const CA_KEY: &str = "ca.key";

fn write_file(path: &Path, contents: &[u8], private: bool) -> Result<(), TlsError> {
    let err = |source| TlsError::Write {
        path: path.to_path_buf(),
        source,
    };
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(if private { 0o600 } else { 0o644 })
        .open(path)
        .map_err(err)?;
    f.write_all(contents).map_err(err)
}

fn generate(what: &str) -> Result<KeyPair, TlsError> {
    KeyPair::generate().map_err(|source| TlsError::Generate {
        what: format!("key for the {what}"),
        source,
    })
}

impl Pki {
    /// The CA in `dir`, created (with the directory) when `ca.pem` is
    /// missing.
    pub fn open_or_create(dir: &Path) -> Result<Pki, TlsError> {
        std::fs::create_dir_all(dir).map_err(|source| TlsError::Write {
            path: dir.to_path_buf(),
            source,
        })?;
        let (cert_path, key_path) = (dir.join(CA_CERT), dir.join(CA_KEY));
        if cert_path.exists() {
            let ca_pem = String::from_utf8_lossy(&read("CA certificate", &cert_path)?).into_owned();
            let key_pem = String::from_utf8_lossy(&read("CA key", &key_path)?).into_owned();
            let ca_key = KeyPair::from_pem(&key_pem).map_err(|e| TlsError::Bad {
                what: "CA key",
                path: key_path.clone(),
                why: e.to_string(),
            })?;
            // Check now that the pair can issue.
            Issuer::from_ca_cert_pem(&ca_pem, &ca_key).map_err(|e| TlsError::Bad {
                what: "CA certificate",
                path: cert_path.clone(),
                why: e.to_string(),
            })?;
            return Ok(Pki {
                dir: dir.to_path_buf(),
                ca_pem,
                ca_key,
            });
        }
        let ca_key = generate("CA")?;
        let mut params = CertificateParams::default();
        // A distinct name per CA: a certificate from another local CA then
        // fails as "unknown issuer", not as a bad signature.
        let tag: String = random_token()?.chars().take(8).collect();
        params
            .distinguished_name
            .push(DnType::CommonName, format!("dispatch local CA {tag}"));
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        Validity {
            backdate_days: 0,
            days: 3650,
        }
        .apply(&mut params);
        let cert = params
            .self_signed(&ca_key)
            .map_err(|source| TlsError::Generate {
                what: "CA certificate".into(),
                source,
            })?;
        write_file(&key_path, ca_key.serialize_pem().as_bytes(), true)?;
        write_file(&cert_path, cert.pem().as_bytes(), false)?;
        Ok(Pki {
            dir: dir.to_path_buf(),
            ca_pem: cert.pem(),
            ca_key,
        })
    }

    /// The CA certificate file (what clients pass as `--tls-ca` and the
    /// dispatcher as `--tls-client-ca`).
    pub fn ca_cert(&self) -> PathBuf {
        self.dir.join(CA_CERT)
    }

    fn issue(
        &self,
        what: &str,
        names: &[String],
        eku: ExtendedKeyUsagePurpose,
        validity: Validity,
        out: &IssuedCert,
    ) -> Result<(), TlsError> {
        let gen_err = |source| TlsError::Generate {
            what: what.to_string(),
            source,
        };
        let mut params = CertificateParams::new(names.to_vec()).map_err(gen_err)?;
        if let Some(first) = names.first() {
            params
                .distinguished_name
                .push(DnType::CommonName, first.as_str());
        }
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![eku];
        params.use_authority_key_identifier_extension = true;
        validity.apply(&mut params);
        let issuer = Issuer::from_ca_cert_pem(&self.ca_pem, &self.ca_key).map_err(gen_err)?;
        let key = generate(what)?;
        let cert = params.signed_by(&key, &issuer).map_err(gen_err)?;
        write_file(&out.key, key.serialize_pem().as_bytes(), true)?;
        write_file(&out.cert, cert.pem().as_bytes(), false)
    }

    /// A server certificate for `names` (DNS names or IP addresses),
    /// written to `DIR/server.pem` and `DIR/server.key`.
    pub fn issue_server(
        &self,
        names: &[String],
        validity: Validity,
    ) -> Result<IssuedCert, TlsError> {
        let out = IssuedCert {
            cert: self.dir.join("server.pem"),
            key: self.dir.join("server.key"),
        };
        self.issue(
            "server certificate",
            names,
            ExtendedKeyUsagePurpose::ServerAuth,
            validity,
            &out,
        )?;
        Ok(out)
    }

    /// An agent's client certificate for node `node` (its common name and
    /// DNS name), written to `out_dir/agent-NODE.pem` and `.key`.
    pub fn issue_agent(
        &self,
        node: &str,
        validity: Validity,
        out_dir: &Path,
    ) -> Result<IssuedCert, TlsError> {
        if node.is_empty() || node.contains(['/', '\0']) || node.starts_with('.') {
            return Err(TlsError::Bad {
                what: "node name",
                path: PathBuf::from(node),
                why: "want a host-name-like name".into(),
            });
        }
        std::fs::create_dir_all(out_dir).map_err(|source| TlsError::Write {
            path: out_dir.to_path_buf(),
            source,
        })?;
        let out = agent_cert_paths(out_dir, node);
        self.issue(
            &format!("client certificate for node {node}"),
            &[node.to_string()],
            ExtendedKeyUsagePurpose::ClientAuth,
            validity,
            &out,
        )?;
        Ok(out)
    }
}

impl Pki {
    /// A relay's client certificate (`dispatch-relay --tls-cert`): its
    /// common name is `relay`, and it names every node in `nodes`, which
    /// [`authorize_agent`] then lets the relay register on AttachMany
    /// (and no other). Written to `out_dir/relay-RELAY.pem` and `.key`.
    pub fn issue_relay(
        &self,
        relay: &str,
        nodes: &[String],
        validity: Validity,
        out_dir: &Path,
    ) -> Result<IssuedCert, TlsError> {
        for name in std::iter::once(relay).chain(nodes.iter().map(String::as_str)) {
            if name.is_empty() || name.contains(['/', '\0']) || name.starts_with('.') {
                return Err(TlsError::Bad {
                    what: "relay or node name",
                    path: PathBuf::from(name),
                    why: "want a host-name-like name".into(),
                });
            }
        }
        std::fs::create_dir_all(out_dir).map_err(|source| TlsError::Write {
            path: out_dir.to_path_buf(),
            source,
        })?;
        let out = IssuedCert {
            cert: out_dir.join(format!("relay-{relay}.pem")),
            key: out_dir.join(format!("relay-{relay}.key")),
        };
        let mut names = vec![relay.to_string()];
        names.extend(nodes.iter().filter(|n| *n != relay).cloned());
        self.issue(
            &format!("client certificate for relay {relay}"),
            &names,
            ExtendedKeyUsagePurpose::ClientAuth,
            validity,
            &out,
        )?;
        Ok(out)
    }
}

/// Where [`Pki::issue_agent`] writes node `node`'s certificate in `dir`.
pub fn agent_cert_paths(dir: &Path, node: &str) -> IssuedCert {
    IssuedCert {
        cert: dir.join(format!("agent-{node}.pem")),
        key: dir.join(format!("agent-{node}.key")),
    }
}

/// What `--dev-tls DIR` uses: a CA, a server certificate for localhost,
/// the local node's agent certificate, and a token file with one admin
/// token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DevTls {
    /// The CA certificate.
    pub ca: PathBuf,
    /// The server certificate and key.
    pub server: IssuedCert,
    /// The local agent's client certificate and key.
    pub agent: IssuedCert,
    /// The token file (`--tokens`).
    pub tokens: PathBuf,
    /// A file holding just the admin token (for DISPATCH_TOKEN_FILE).
    pub admin_token: PathBuf,
}

/// Makes (or reuses, when present) the `--dev-tls` material in `dir` for
/// the local node `node`.
pub fn ensure_dev_tls(dir: &Path, node: &str) -> Result<DevTls, TlsError> {
    let pki = Pki::open_or_create(dir)?;
    let server = IssuedCert {
        cert: dir.join("server.pem"),
        key: dir.join("server.key"),
    };
    if !server.cert.exists() || !server.key.exists() {
        let names: Vec<String> = ["localhost", "127.0.0.1", "::1"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        pki.issue_server(&names, Validity::default())?;
    }
    let agent = agent_cert_paths(dir, node);
    if !agent.cert.exists() || !agent.key.exists() {
        pki.issue_agent(node, Validity::default(), dir)?;
    }
    let tokens = dir.join("tokens");
    let admin_token = dir.join("admin.token");
    if !tokens.exists() || !admin_token.exists() {
        let token = random_token()?;
        write_file(
            &tokens,
            format!("# TOKEN ROLE USER\n{token} admin admin\n").as_bytes(),
            true,
        )?;
        write_file(&admin_token, format!("{token}\n").as_bytes(), true)?;
    }
    Ok(DevTls {
        ca: pki.ca_cert(),
        server,
        agent,
        tokens,
        admin_token,
    })
}

/// 32 random bytes from the kernel, as hex.
pub fn random_token() -> Result<String, TlsError> {
    let mut bytes = [0u8; 32];
    let urandom = Path::new("/dev/urandom");
    let mut f = std::fs::File::open(urandom).map_err(|source| TlsError::Read {
        what: "random source",
        path: urandom.to_path_buf(),
        source,
    })?;
    std::io::Read::read_exact(&mut f, &mut bytes).map_err(|source| TlsError::Read {
        what: "random source",
        path: urandom.to_path_buf(),
        source,
    })?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn der_of(pem_path: &Path) -> Vec<u8> {
        let text = std::fs::read_to_string(pem_path).unwrap();
        let b64: String = text.lines().filter(|l| !l.starts_with("-----")).collect();
        decode_b64(&b64)
    }

    fn decode_b64(s: &str) -> Vec<u8> {
        const ALPHA: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut out = Vec::new();
        let (mut acc, mut bits) = (0u32, 0);
        for c in s.bytes().filter(|&c| c != b'=') {
            let v = ALPHA.iter().position(|&a| a == c).unwrap() as u32;
            acc = (acc << 6) | v;
            bits += 6;
            if bits >= 8 {
                bits -= 8;
                out.push((acc >> bits) as u8);
            }
        }
        out
    }

    #[test]
    fn dev_tls_is_made_once_and_reused() {
        let dir = tempfile::tempdir().unwrap();
        let a = ensure_dev_tls(dir.path(), "node-1").unwrap();
        let ca_before = std::fs::read(&a.ca).unwrap();
        let token_before = std::fs::read(&a.admin_token).unwrap();
        let b = ensure_dev_tls(dir.path(), "node-1").unwrap();
        assert_eq!(a, b);
        assert_eq!(std::fs::read(&b.ca).unwrap(), ca_before);
        assert_eq!(std::fs::read(&b.admin_token).unwrap(), token_before);
        let tokens = crate::auth::TokenTable::load(&a.tokens).unwrap();
        let token = String::from_utf8(token_before).unwrap();
        assert_eq!(
            tokens.lookup(token.trim()).map(|c| c.role),
            Some(crate::auth::Role::Admin)
        );
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(dir.path().join(CA_KEY))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o077, 0, "the CA key is private");
        // The server configuration accepts what was made.
        server_config(&ServerTlsFiles {
            cert: a.server.cert.clone(),
            key: a.server.key.clone(),
            client_ca: Some(a.ca.clone()),
        })
        .unwrap();
    }

    #[test]
    fn agent_certificates_name_their_node_and_only_it() {
        let dir = tempfile::tempdir().unwrap();
        let pki = Pki::open_or_create(dir.path()).unwrap();
        let issued = pki
            .issue_agent("rack1-n07", Validity::default(), &dir.path().join("out"))
            .unwrap();
        let der = der_of(&issued.cert);
        assert_eq!(cert_names(&der).unwrap(), vec!["rack1-n07"]);
        let chain = vec![tonic::transport::CertificateDer::from(der)];
        assert!(authorize_agent(Some(&chain), "rack1-n07").is_ok());
        let e = authorize_agent(Some(&chain), "rack1-n08").unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(e.message().contains("rack1-n08"), "{}", e.message());
        let e = authorize_agent(None, "rack1-n07").unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        assert!(
            pki.issue_agent("../x", Validity::default(), dir.path())
                .is_err()
        );
    }

    #[test]
    fn a_relays_certificate_names_its_nodes_and_only_them() {
        let dir = tempfile::tempdir().unwrap();
        let pki = Pki::open_or_create(dir.path()).unwrap();
        let nodes = vec!["n1".to_string(), "n2".to_string()];
        let issued = pki
            .issue_relay("rack1", &nodes, Validity::default(), dir.path())
            .unwrap();
        let der = der_of(&issued.cert);
        assert_eq!(cert_names(&der).unwrap(), vec!["rack1", "n1", "n2"]);
        let chain = vec![tonic::transport::CertificateDer::from(der)];
        assert!(authorize_agent(Some(&chain), "n2").is_ok());
        let e = authorize_agent(Some(&chain), "n3").unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(
            pki.issue_relay(
                "rack1",
                &["../n".to_string()],
                Validity::default(),
                dir.path()
            )
            .is_err()
        );
    }

    #[test]
    fn bad_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let junk = dir.path().join("junk.pem");
        std::fs::write(&junk, "hello").unwrap();
        let e = server_config(&ServerTlsFiles {
            cert: junk.clone(),
            key: junk.clone(),
            client_ca: None,
        })
        .unwrap_err();
        assert!(e.to_string().contains("junk.pem"), "{e}");
        assert!(e.to_string().contains("--tls-cert"), "{e}");
        let e = server_config(&ServerTlsFiles {
            cert: dir.path().join("missing.pem"),
            key: junk,
            client_ca: None,
        })
        .unwrap_err();
        assert!(e.to_string().contains("missing.pem"), "{e}");
    }
}
