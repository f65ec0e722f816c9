//! The client side of the dispatcher's transport security, in one place
//! for every client (the agent, dispatchctl, the end-to-end tests):
//! [`endpoint`] turns a URL into a tonic [`Endpoint`] that, for
//! `https://`, verifies the dispatcher against a given CA and may present
//! a client certificate (agents do); [`Bearer`] attaches a token to every
//! call; [`load_token`] reads one from a file or a variable.
//!
//! Rules: an `https://` URL needs a CA (there are no built-in roots: a
//! dispatcher is verified against the operator's CA only); TLS options
//! with an `http://` URL are an error, not a silent downgrade.

use std::path::{Path, PathBuf};

use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic::{Request, Status};

/// A channel whose every call carries the [`Bearer`] token (if any).
pub type AuthChannel = InterceptedService<Channel, Bearer>;

/// How a client verifies the dispatcher and, optionally, proves who it is.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClientTls {
    /// PEM file of the CA certificate(s) the dispatcher's certificate must
    /// chain to. Required for `https://` URLs.
    pub ca: Option<PathBuf>,
    /// PEM file of this client's certificate chain (agents: issued for the
    /// node's name).
    pub cert: Option<PathBuf>,
    /// PEM file of the private key of `cert`.
    pub key: Option<PathBuf>,
    /// The name the dispatcher's certificate must carry, when it differs
    /// from the URL's host.
    pub domain: Option<String>,
}

impl ClientTls {
    /// Whether any TLS option is set.
    pub fn is_set(&self) -> bool {
        self.ca.is_some() || self.cert.is_some() || self.key.is_some() || self.domain.is_some()
    }
}

/// Why a secure endpoint or a token could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SecurityError {
    /// The URL does not parse.
    #[error("invalid dispatcher URL {url:?}: {cause}")]
    BadUrl { url: String, cause: String },
    /// A certificate, key or token file could not be read.
    #[error("cannot read the {what} {path}: {source}")]
    Read {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    /// `https://` without a CA to verify the dispatcher with.
    #[error(
        "{url} uses https:// but no CA certificate was given to verify the dispatcher \
         (--tls-ca FILE, or DISPATCH_TLS_CA)"
    )]
    HttpsWithoutCa { url: String },
    /// TLS options with a plain-text URL.
    #[error("TLS options were given but {url} is not https://; use an https:// URL")]
    TlsWithPlainUrl { url: String },
    /// Only one of certificate and key.
    #[error("a client certificate needs both --tls-cert and --tls-key")]
    HalfIdentity,
    /// tonic refused the TLS configuration.
    #[error("TLS configuration for {url}: {cause}")]
    Tls { url: String, cause: String },
    /// The token is empty or not a valid header value.
    #[error("the bearer token {0}")]
    BadToken(&'static str),
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, SecurityError> {
    std::fs::read(path).map_err(|source| SecurityError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })
}

/// The endpoint for `url`: plain for `http://`, TLS verified against
/// `tls.ca` (with `tls.cert`/`tls.key` as the client's identity when set)
/// for `https://`. Callers add their own timeouts and options.
pub fn endpoint(url: &str, tls: &ClientTls) -> Result<Endpoint, SecurityError> {
    let endpoint = Endpoint::from_shared(url.to_string()).map_err(|e| SecurityError::BadUrl {
        url: url.to_string(),
        cause: e.to_string(),
    })?;
    if endpoint.uri().scheme_str() != Some("https") {
        if tls.is_set() {
            return Err(SecurityError::TlsWithPlainUrl {
                url: url.to_string(),
            });
        }
        return Ok(endpoint);
    }
    let ca = tls
        .ca
        .as_deref()
        .ok_or_else(|| SecurityError::HttpsWithoutCa {
            url: url.to_string(),
        })?;
    let mut cfg =
        ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read("CA certificate", ca)?));
    match (&tls.cert, &tls.key) {
        (Some(cert), Some(key)) => {
            cfg = cfg.identity(Identity::from_pem(
                read("client certificate", cert)?,
                read("client key", key)?,
            ));
        }
        (None, None) => {}
        _ => return Err(SecurityError::HalfIdentity),
    }
    if let Some(domain) = &tls.domain {
        cfg = cfg.domain_name(domain.clone());
    }
    endpoint.tls_config(cfg).map_err(|e| SecurityError::Tls {
        url: url.to_string(),
        cause: e.to_string(),
    })
}

/// Attaches `authorization: Bearer TOKEN` to every call (nothing when
/// built without a token).
#[derive(Debug, Clone, Default)]
pub struct Bearer {
    header: Option<MetadataValue<Ascii>>,
}

impl Bearer {
    /// An interceptor for `token` (none: calls go without one).
    pub fn new(token: Option<&str>) -> Result<Self, SecurityError> {
        let Some(token) = token else {
            return Ok(Bearer::default());
        };
        if token.is_empty() {
            return Err(SecurityError::BadToken("is empty"));
        }
        let header = format!("Bearer {token}")
            .parse()
            .map_err(|_| SecurityError::BadToken("has characters not allowed in a header"))?;
        Ok(Bearer {
            header: Some(header),
        })
    }

    /// Whether a token is attached.
    pub fn has_token(&self) -> bool {
        self.header.is_some()
    }
}

impl Interceptor for Bearer {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        if let Some(h) = &self.header {
            req.metadata_mut().insert("authorization", h.clone());
        }
        Ok(req)
    }
}

/// The token from `file` (its content, surrounding whitespace trimmed)
/// or else from `value` (e.g. `DISPATCH_TOKEN`); `None` when neither is
/// given.
pub fn load_token(
    file: Option<&Path>,
    value: Option<&str>,
) -> Result<Option<String>, SecurityError> {
    if let Some(path) = file {
        let bytes = read("token file", path)?;
        let text = String::from_utf8_lossy(&bytes);
        let token = text.trim();
        if token.is_empty() {
            return Err(SecurityError::BadToken("file is empty"));
        }
        return Ok(Some(token.to_string()));
    }
    Ok(value
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(str::to_string))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_urls_stay_plain_and_refuse_tls_options() {
        assert!(endpoint("http://127.0.0.1:1", &ClientTls::default()).is_ok());
        let tls = ClientTls {
            ca: Some("/nonexistent".into()),
            ..ClientTls::default()
        };
        let err = endpoint("http://127.0.0.1:1", &tls).unwrap_err();
        assert!(
            matches!(err, SecurityError::TlsWithPlainUrl { .. }),
            "{err}"
        );
    }

    #[test]
    fn https_needs_a_readable_ca_and_a_whole_identity() {
        let err = endpoint("https://127.0.0.1:1", &ClientTls::default()).unwrap_err();
        assert!(err.to_string().contains("--tls-ca"), "{err}");
        let tls = ClientTls {
            ca: Some("/nonexistent/ca.pem".into()),
            ..ClientTls::default()
        };
        let err = endpoint("https://127.0.0.1:1", &tls).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/ca.pem"), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, "not checked until the handshake").unwrap();
        let tls = ClientTls {
            ca: Some(ca),
            cert: Some(dir.path().join("c.pem")),
            ..ClientTls::default()
        };
        let err = endpoint("https://127.0.0.1:1", &tls).unwrap_err();
        assert!(matches!(err, SecurityError::HalfIdentity), "{err}");
    }

    #[test]
    fn bearer_attaches_the_token_to_every_call() {
        let mut b = Bearer::new(Some("s3cret")).unwrap();
        let req = b.call(Request::new(())).unwrap();
        assert_eq!(
            req.metadata().get("authorization").unwrap(),
            "Bearer s3cret"
        );
        let mut none = Bearer::new(None).unwrap();
        assert!(none.call(Request::new(())).unwrap().metadata().is_empty());
        assert!(Bearer::new(Some("")).is_err());
        assert!(Bearer::new(Some("bad\ntoken")).is_err());
    }

    #[test]
    fn token_file_wins_over_the_variable() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("tok");
        std::fs::write(&f, "  from-file\n").unwrap();
        assert_eq!(
            load_token(Some(&f), Some("from-env")).unwrap().as_deref(),
            Some("from-file")
        );
        assert_eq!(
            load_token(None, Some("from-env")).unwrap().as_deref(),
            Some("from-env")
        );
        assert_eq!(load_token(None, Some("  ")).unwrap(), None);
        std::fs::write(&f, "\n").unwrap();
        assert!(load_token(Some(&f), None).is_err());
    }
}
