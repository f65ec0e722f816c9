//! The relay's TLS: serving agents (its own server certificate; with a
//! client CA, agents must present a certificate naming the node they
//! register as, the same rule as the dispatcher's `tls::authorize_agent`)
//! and, towards the dispatcher, the relay's client certificate
//! (`proto::client_security`), which must name every node the relay
//! registers: the dispatcher checks each Register on AttachMany against
//! it.

use std::path::Path;

use tonic::Status;
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

/// An agent may attach as `node` only with a verified certificate naming
/// it: the dispatcher's rule (`proto::peer::authorize_node`), with the
/// relay's client CA.
pub fn authorize_agent(
    peer_certs: Option<&[CertificateDer<'static>]>,
    node: &str,
) -> Result<(), Status> {
    proto::peer::authorize_node(peer_certs, node, "relay's", "register.node")
}

pub use proto::peer::peer_certs;
