//! The relay's TLS: serving agents (its own server certificate; with a
//! client CA, agents must present a certificate naming the node they
//! register as, the same rule as the dispatcher's `tls::authorize_agent`)
//! and, towards the dispatcher, the relay's client certificate
//! (`proto::client_security`), which must name every node the relay
//! registers: the dispatcher checks each Register on AttachMany against
//! it.

use std::path::Path;
use std::sync::Arc;

use tonic::Status;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
use tonic::transport::{Certificate, CertificateDer, Identity, ServerTlsConfig};

/// The relay's server TLS from PEM files; with `client_ca`, client
/// certificates are verified when presented.
pub fn server_config(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
) -> anyhow::Result<ServerTlsConfig> {
    use anyhow::Context as _;
    let read = |what: &str, p: &Path| {
        std::fs::read(p).with_context(|| format!("cannot read the {what} {}", p.display()))
    };
    let mut cfg = ServerTlsConfig::new().identity(Identity::from_pem(
        read("TLS certificate (--tls-cert)", cert)?,
        read("TLS key (--tls-key)", key)?,
    ));
    if let Some(ca) = client_ca {
        cfg = cfg
            .client_ca_root(Certificate::from_pem(read(
                "client CA (--tls-client-ca)",
                ca,
            )?))
            .client_auth_optional(true);
    }
    Ok(cfg)
}

/// The names a certificate is for: its subject common names, then its
/// DNS subject alternative names.
pub fn cert_names(der: &[u8]) -> Result<Vec<String>, String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).map_err(|e| e.to_string())?;
    let mut names: Vec<String> = cert
        .subject()
        .iter_common_name()
        .filter_map(|cn| cn.as_str().ok())
        .map(str::to_string)
        .collect();
    if let Some(san) = cert.subject_alternative_name().map_err(|e| e.to_string())? {
        for name in &san.value.general_names {
            if let x509_parser::extensions::GeneralName::DNSName(dns) = name
                && !names.iter().any(|n| n == dns)
            {
                names.push((*dns).to_string());
            }
        }
    }
    Ok(names)
}

/// An agent may attach as `node` only with a verified certificate naming
/// it.
pub fn authorize_agent(
    peer_certs: Option<&[CertificateDer<'static>]>,
    node: &str,
) -> Result<(), Status> {
    let leaf = peer_certs.and_then(|c| c.first()).ok_or_else(|| {
        Status::unauthenticated(
            "agents must present a client certificate signed by the relay's client CA \
             (agent --tls-cert/--tls-key)",
        )
    })?;
    let names = cert_names(leaf)
        .map_err(|e| Status::unauthenticated(format!("the client certificate: {e}")))?;
    if names.iter().any(|n| n == node) {
        Ok(())
    } else {
        Err(Status::permission_denied(format!(
            "register.node: the client certificate is for {names:?}, not {node:?}; a node \
             can only register as itself"
        )))
    }
}

/// The verified peer certificates of a request served over TLS.
pub fn peer_certs<T>(req: &tonic::Request<T>) -> Option<Arc<Vec<CertificateDer<'static>>>> {
    req.extensions()
        .get::<TlsConnectInfo<TcpConnectInfo>>()
        .and_then(|i| i.peer_certs())
}
