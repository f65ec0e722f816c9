//! Who is at the other end of a TLS connection, for the servers agents
//! attach to (the dispatcher and `dispatch-relay`): the names a client
//! certificate is for, and the one admission rule both apply, that a node
//! registers only under a name its verified certificate carries.

use std::sync::Arc;

use tonic::Status;
use tonic::transport::CertificateDer;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};

/// The names a certificate (DER) is for: its subject common names, then
/// its DNS subject alternative names not already among them.
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

/// An agent may register as `node` only with a verified client
/// certificate (leaf first in `peer_certs`) naming it. `server` names
/// whose client CA signs agents' certificates ("dispatcher's", "relay's")
/// and `field` the request field the refusal names.
pub fn authorize_node(
    peer_certs: Option<&[CertificateDer<'static>]>,
    node: &str,
    server: &str,
    field: &str,
) -> Result<(), Status> {
    let leaf = peer_certs.and_then(|c| c.first()).ok_or_else(|| {
        Status::unauthenticated(format!(
            "agents must present a client certificate signed by the {server} client CA \
             (agent --tls-cert/--tls-key)"
        ))
    })?;
    let names = cert_names(leaf)
        .map_err(|e| Status::unauthenticated(format!("the client certificate: {e}")))?;
    if names.iter().any(|n| n == node) {
        Ok(())
    } else {
        Err(Status::permission_denied(format!(
            "{field}: the client certificate is for {names:?}, not {node:?}; a node can only \
             register as itself"
        )))
    }
}

/// The verified peer certificates of a request served over TLS (`None` on
/// a plain-text connection or when the client presented none).
pub fn peer_certs<T>(req: &tonic::Request<T>) -> Option<Arc<Vec<CertificateDer<'static>>>> {
    req.extensions()
        .get::<TlsConnectInfo<TcpConnectInfo>>()
        .and_then(|i| i.peer_certs())
}
