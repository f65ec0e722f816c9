//! Labels of this node's Kubernetes Node object, read from the API server
//! with the pod's in-cluster service account (`agent run
//! --k8s-node-labels KEY,...`).
//!
//! A DaemonSet pod cannot see its node's labels through the downward API,
//! so the agent asks the API server itself: one `GET /api/v1/nodes/NAME`
//! over HTTPS, authenticated by the mounted service-account token and
//! checked against the mounted cluster CA. The agent's ServiceAccount
//! needs `get` on `nodes` (the Helm chart's ClusterRole grants exactly
//! that). This module owns that call and nothing else: the caller decides
//! what to do with the labels.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};
use tokio_rustls::rustls::{self, RootCertStore};

/// Where Kubernetes mounts a pod's service-account credentials.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// Bound on the whole request (connect, TLS, response).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);
/// Bound on a Node object's size: a node's JSON is a few tens of KiB.
const MAX_BODY_BYTES: usize = 4 << 20;

/// Why the node's labels could not be read.
#[derive(Debug, thiserror::Error)]
pub enum K8sError {
    #[error(
        "{0} is not set: --k8s-node-labels works only inside a Kubernetes pod (in-cluster service account)"
    )]
    NotInCluster(&'static str),
    #[error("{var}={value:?} is not a port number")]
    BadPort { var: &'static str, value: String },
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the service-account token in {0} is empty")]
    EmptyToken(PathBuf),
    #[error("the cluster CA {path}: {reason}")]
    BadCa { path: PathBuf, reason: String },
    #[error("{host:?} is not a valid TLS server name")]
    BadServerName { host: String },
    #[error("connecting to the API server at {addr}: {source}")]
    Connect {
        addr: String,
        source: std::io::Error,
    },
    #[error("TLS handshake with the API server at {addr}: {source}")]
    Tls {
        addr: String,
        source: std::io::Error,
    },
    #[error("HTTP exchange with the API server: {0}")]
    Http(#[from] hyper::Error),
    #[error("building the request: {0}")]
    Request(#[from] hyper::http::Error),
    #[error("the API server sent more than {MAX_BODY_BYTES} bytes for node {node}")]
    TooLarge { node: String },
    #[error("no answer from the API server within {0:?}")]
    Timeout(Duration),
    #[error("GET node {node}: HTTP {status}{hint}: {body}")]
    Status {
        node: String,
        status: u16,
        hint: &'static str,
        body: String,
    },
    #[error("node {node}: the API server's answer is not a Node object: {reason}")]
    BadNode { node: String, reason: String },
}

/// How to reach and authenticate to the API server.
#[derive(Clone)]
pub struct ApiServer {
    /// Host name or IP address (IPv6 without brackets).
    pub host: String,
    pub port: u16,
    /// Bearer token.
    pub token: String,
    /// Trusted CA certificates (PEM) for the API server's certificate.
    pub ca_pem: Vec<u8>,
    /// Where `ca_pem` came from, for error messages.
    pub ca_path: PathBuf,
}

impl std::fmt::Debug for ApiServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the token.
        f.debug_struct("ApiServer")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("ca_path", &self.ca_path)
            .finish_non_exhaustive()
    }
}

impl ApiServer {
    /// The in-cluster configuration: `KUBERNETES_SERVICE_HOST`,
    /// `KUBERNETES_SERVICE_PORT` and the credentials under
    /// [`SERVICE_ACCOUNT_DIR`].
    pub fn in_cluster() -> Result<Self, K8sError> {
        Self::from_env_and_dir(|k| std::env::var(k).ok(), Path::new(SERVICE_ACCOUNT_DIR))
    }

    /// [`Self::in_cluster`] with the environment and the credentials
    /// directory given (for tests).
    pub fn from_env_and_dir(
        env: impl Fn(&str) -> Option<String>,
        dir: &Path,
    ) -> Result<Self, K8sError> {
        const HOST: &str = "KUBERNETES_SERVICE_HOST";
        const PORT: &str = "KUBERNETES_SERVICE_PORT";
        let host = env(HOST)
            .filter(|h| !h.is_empty())
            .ok_or(K8sError::NotInCluster(HOST))?;
        let port_text = env(PORT)
            .filter(|p| !p.is_empty())
            .ok_or(K8sError::NotInCluster(PORT))?;
        let port = port_text.parse().map_err(|_| K8sError::BadPort {
            var: PORT,
            value: port_text.clone(),
        })?;
        let read = |name: &str| {
            let path = dir.join(name);
            std::fs::read(&path).map_err(|source| K8sError::Read { path, source })
        };
        let token = String::from_utf8_lossy(&read("token")?).trim().to_string();
        if token.is_empty() {
            return Err(K8sError::EmptyToken(dir.join("token")));
        }
        Ok(ApiServer {
            host,
            port,
            token,
            ca_pem: read("ca.crt")?,
            ca_path: dir.join("ca.crt"),
        })
    }

    /// `host:port`, with brackets around an IPv6 address.
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    fn tls_connector(&self) -> Result<TlsConnector, K8sError> {
        let bad = |reason: String| K8sError::BadCa {
            path: self.ca_path.clone(),
            reason,
        };
        let mut roots = RootCertStore::empty();
        let mut count = 0;
        for cert in CertificateDer::pem_slice_iter(&self.ca_pem) {
            let cert = cert.map_err(|e| bad(format!("not PEM certificates: {e}")))?;
            roots
                .add(cert)
                .map_err(|e| bad(format!("unusable certificate: {e}")))?;
            count += 1;
        }
        if count == 0 {
            return Err(bad("no certificate in the file".to_string()));
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| bad(format!("TLS configuration: {e}")))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(TlsConnector::from(Arc::new(config)))
    }

    /// Every label of the Node named `node`.
    pub async fn node_labels(&self, node: &str) -> Result<BTreeMap<String, String>, K8sError> {
        match tokio::time::timeout(REQUEST_TIMEOUT, self.get_node(node)).await {
            Ok(result) => result,
            Err(_) => Err(K8sError::Timeout(REQUEST_TIMEOUT)),
        }
    }

    async fn get_node(&self, node: &str) -> Result<BTreeMap<String, String>, K8sError> {
        let addr = self.authority();
        let connector = self.tls_connector()?;
        let server_name =
            ServerName::try_from(self.host.clone()).map_err(|_| K8sError::BadServerName {
                host: self.host.clone(),
            })?;
        let tcp = tokio::net::TcpStream::connect((self.host.as_str(), self.port))
            .await
            .map_err(|source| K8sError::Connect {
                addr: addr.clone(),
                source,
            })?;
        let tls = connector
            .connect(server_name, tcp)
            .await
            .map_err(|source| K8sError::Tls {
                addr: addr.clone(),
                source,
            })?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await?;
        let conn = tokio::spawn(conn);
        let request = hyper::Request::get(format!("/api/v1/nodes/{}", path_segment(node)))
            .header(hyper::header::HOST, &addr)
            .header(hyper::header::ACCEPT, "application/json")
            .header(
                hyper::header::AUTHORIZATION,
                format!("Bearer {}", self.token),
            )
            .header(hyper::header::USER_AGENT, "dispatch-agent")
            .body(Empty::<Bytes>::new())?;
        let response = sender.send_request(request).await?;
        let status = response.status().as_u16();
        let mut body = response.into_body();
        let mut bytes = Vec::new();
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame?.into_data() {
                if bytes.len() + data.len() > MAX_BODY_BYTES {
                    conn.abort();
                    return Err(K8sError::TooLarge {
                        node: node.to_string(),
                    });
                }
                bytes.extend_from_slice(&data);
            }
        }
        conn.abort();
        if status != 200 {
            return Err(K8sError::Status {
                node: node.to_string(),
                status,
                hint: status_hint(status),
                body: api_message(&bytes),
            });
        }
        parse_node_labels(node, &bytes)
    }
}

/// What to tell the operator for the usual failures.
fn status_hint(status: u16) -> &'static str {
    match status {
        401 => " (the service-account token was refused)",
        403 => {
            " (the agent's ServiceAccount needs `get` on `nodes`: a ClusterRole and binding, as the Helm chart makes)"
        }
        404 => {
            " (no such Node: --node-name must be the Kubernetes node name, e.g. from spec.nodeName)"
        }
        _ => "",
    }
}

/// The `message` of a Kubernetes `Status` answer, else the body's start.
fn api_message(body: &[u8]) -> String {
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(body)
        && let Some(m) = v.get("message").and_then(|m| m.as_str())
    {
        return m.to_string();
    }
    let text = String::from_utf8_lossy(body);
    text.chars().take(200).collect()
}

/// Percent-encodes a node name for a URL path segment (node names are DNS
/// subdomains, so this only matters for names the API server would refuse).
fn path_segment(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The labels of a Node object (`metadata.labels`; none is an empty map).
pub fn parse_node_labels(node: &str, body: &[u8]) -> Result<BTreeMap<String, String>, K8sError> {
    let bad = |reason: String| K8sError::BadNode {
        node: node.to_string(),
        reason,
    };
    let v: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| bad(format!("invalid JSON: {e}")))?;
    if v.get("kind").and_then(|k| k.as_str()) != Some("Node") {
        return Err(bad(format!(
            "kind is {}",
            v.get("kind")
                .map_or("missing".to_string(), |k| k.to_string())
        )));
    }
    let mut labels = BTreeMap::new();
    match v.pointer("/metadata/labels") {
        None | Some(serde_json::Value::Null) => {}
        Some(serde_json::Value::Object(map)) => {
            for (k, val) in map {
                let val = val
                    .as_str()
                    .ok_or_else(|| bad(format!("label {k:?} is not a string")))?;
                labels.insert(k.clone(), val.to_string());
            }
        }
        Some(other) => return Err(bad(format!("metadata.labels is {other}"))),
    }
    Ok(labels)
}

/// The wanted labels that the node has, and the wanted keys it lacks.
pub fn select_labels(
    all: &BTreeMap<String, String>,
    wanted: &[String],
) -> (BTreeMap<String, String>, Vec<String>) {
    let mut found = BTreeMap::new();
    let mut missing = Vec::new();
    for key in wanted {
        match all.get(key) {
            Some(v) => {
                found.insert(key.clone(), v.clone());
            }
            None => missing.push(key.clone()),
        }
    }
    (found, missing)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const NODE: &str = r#"{"kind":"Node","apiVersion":"v1","metadata":{"name":"n1",
        "labels":{"topology.kubernetes.io/zone":"eu-1a","dispatch.io/rack":"r7","kubernetes.io/hostname":"n1"}},
        "status":{"capacity":{"cpu":"8"}}}"#;

    #[test]
    fn parses_labels_of_a_node() {
        let labels = parse_node_labels("n1", NODE.as_bytes()).unwrap();
        assert_eq!(labels["topology.kubernetes.io/zone"], "eu-1a");
        assert_eq!(labels["dispatch.io/rack"], "r7");
        assert_eq!(labels.len(), 3);
        let bare = parse_node_labels("n1", br#"{"kind":"Node","metadata":{"name":"n1"}}"#).unwrap();
        assert!(bare.is_empty());
    }

    #[test]
    fn refuses_what_is_not_a_node() {
        let status = br#"{"kind":"Status","apiVersion":"v1","status":"Failure","message":"nodes \"n1\" is forbidden"}"#;
        let err = parse_node_labels("n1", status).unwrap_err().to_string();
        assert!(err.contains("kind is \"Status\""), "{err}");
        assert!(parse_node_labels("n1", b"<html>").is_err());
        let err = parse_node_labels("n1", br#"{"kind":"Node","metadata":{"labels":{"a":1}}}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("label \"a\" is not a string"), "{err}");
    }

    #[test]
    fn selects_wanted_labels_and_reports_missing_ones() {
        let all = parse_node_labels("n1", NODE.as_bytes()).unwrap();
        let wanted = vec![
            "topology.kubernetes.io/zone".to_string(),
            "example.com/rack".to_string(),
        ];
        let (found, missing) = select_labels(&all, &wanted);
        assert_eq!(
            found.into_iter().collect::<Vec<_>>(),
            vec![(
                "topology.kubernetes.io/zone".to_string(),
                "eu-1a".to_string()
            )]
        );
        assert_eq!(missing, vec!["example.com/rack".to_string()]);
    }

    #[test]
    fn in_cluster_config_needs_the_environment_and_the_credentials() {
        let dir = tempfile::tempdir().unwrap();
        let env = |vars: &'static [(&'static str, &'static str)]| {
            let m: HashMap<&str, &str> = vars.iter().copied().collect();
            move |k: &str| m.get(k).map(|v| v.to_string())
        };
        let err = ApiServer::from_env_and_dir(env(&[]), dir.path()).unwrap_err();
        assert!(matches!(
            err,
            K8sError::NotInCluster("KUBERNETES_SERVICE_HOST")
        ));
        let err = ApiServer::from_env_and_dir(
            env(&[
                ("KUBERNETES_SERVICE_HOST", "10.0.0.1"),
                ("KUBERNETES_SERVICE_PORT", "https"),
            ]),
            dir.path(),
        )
        .unwrap_err();
        assert!(matches!(err, K8sError::BadPort { .. }), "{err}");
        let ok_env = env(&[
            ("KUBERNETES_SERVICE_HOST", "fd00::1"),
            ("KUBERNETES_SERVICE_PORT", "443"),
        ]);
        let err = ApiServer::from_env_and_dir(&ok_env, dir.path()).unwrap_err();
        assert!(matches!(err, K8sError::Read { .. }), "{err}");
        std::fs::write(dir.path().join("token"), " \n").unwrap();
        let err = ApiServer::from_env_and_dir(&ok_env, dir.path()).unwrap_err();
        assert!(matches!(err, K8sError::EmptyToken(_)), "{err}");
        std::fs::write(dir.path().join("token"), "abc\n").unwrap();
        std::fs::write(dir.path().join("ca.crt"), "not a cert").unwrap();
        let api = ApiServer::from_env_and_dir(&ok_env, dir.path()).unwrap();
        assert_eq!(api.token, "abc");
        assert_eq!(api.authority(), "[fd00::1]:443");
        assert!(
            !format!("{api:?}").contains("abc"),
            "Debug must not print the token"
        );
        assert!(matches!(api.tls_connector(), Err(K8sError::BadCa { .. })));
    }

    #[test]
    fn encodes_path_segments() {
        assert_eq!(path_segment("node-1.example.com"), "node-1.example.com");
        assert_eq!(path_segment("a/b c"), "a%2Fb%20c");
    }

    /// A real HTTPS server on loopback playing the API server: it checks
    /// the bearer token and the path, and answers like kube-apiserver.
    struct FakeApi {
        port: u16,
        ca_pem: String,
        requests: tokio::sync::mpsc::UnboundedReceiver<String>,
    }

    async fn api_server(token: &'static str) -> FakeApi {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = ca_params.self_signed(&ca_key).unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let params =
            rcgen::CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])
                .unwrap();
        let issuer = rcgen::Issuer::new(ca_params, &ca_key);
        let cert = params.signed_by(&key, &issuer).unwrap();
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der()).unwrap(),
        )
        .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                let tx = tx.clone();
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 4096];
                    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                        match tls.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    let head = String::from_utf8_lossy(&buf).to_string();
                    let _ = tx.send(head.clone());
                    let path = head.split_whitespace().nth(1).unwrap_or("").to_string();
                    let authorized = head
                        .lines()
                        .any(|l| l.eq_ignore_ascii_case(&format!("authorization: Bearer {token}")));
                    let (status, body) = if !authorized {
                        (
                            "401 Unauthorized",
                            r#"{"kind":"Status","message":"Unauthorized"}"#.to_string(),
                        )
                    } else if path == "/api/v1/nodes/n1" {
                        ("200 OK", NODE.to_string())
                    } else if path == "/api/v1/nodes/secret" {
                        ("403 Forbidden", r#"{"kind":"Status","message":"nodes \"secret\" is forbidden: User \"system:serviceaccount:jobs:agent\" cannot get resource \"nodes\""}"#.to_string())
                    } else {
                        (
                            "404 Not Found",
                            r#"{"kind":"Status","message":"nodes not found"}"#.to_string(),
                        )
                    };
                    // Chunked, as kube-apiserver answers.
                    let response = format!(
                        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{body}\r\n0\r\n\r\n",
                        body.len()
                    );
                    let _ = tls.write_all(response.as_bytes()).await;
                    let _ = tls.shutdown().await;
                });
            }
        });
        FakeApi {
            port,
            ca_pem: ca.pem(),
            requests: rx,
        }
    }

    fn client(api: &FakeApi, token: &str, ca_pem: &str) -> ApiServer {
        ApiServer {
            host: "127.0.0.1".to_string(),
            port: api.port,
            token: token.to_string(),
            ca_pem: ca_pem.as_bytes().to_vec(),
            ca_path: PathBuf::from("ca.crt"),
        }
    }

    #[tokio::test]
    async fn reads_the_node_labels_over_https_with_the_token() {
        let mut api = api_server("t0ken").await;
        let labels = client(&api, "t0ken", &api.ca_pem)
            .node_labels("n1")
            .await
            .unwrap();
        assert_eq!(labels["dispatch.io/rack"], "r7");
        let head = api.requests.recv().await.unwrap();
        assert!(
            head.starts_with("GET /api/v1/nodes/n1 HTTP/1.1\r\n"),
            "{head}"
        );
        assert!(
            head.to_ascii_lowercase()
                .contains("accept: application/json"),
            "{head}"
        );
    }

    #[tokio::test]
    async fn reports_refusals_with_the_api_servers_message_and_a_hint() {
        let api = api_server("t0ken").await;
        let err = client(&api, "wrong", &api.ca_pem)
            .node_labels("n1")
            .await
            .unwrap_err();
        assert!(matches!(err, K8sError::Status { status: 401, .. }), "{err}");
        let err = client(&api, "t0ken", &api.ca_pem)
            .node_labels("secret")
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("HTTP 403"), "{err}");
        assert!(err.contains("needs `get` on `nodes`"), "{err}");
        assert!(err.contains("cannot get resource"), "{err}");
        let err = client(&api, "t0ken", &api.ca_pem)
            .node_labels("n2")
            .await
            .unwrap_err();
        assert!(matches!(err, K8sError::Status { status: 404, .. }), "{err}");
    }

    #[tokio::test]
    async fn refuses_a_server_the_ca_did_not_sign() {
        let api = api_server("t0ken").await;
        let other = api_server("t0ken").await;
        let err = client(&api, "t0ken", &other.ca_pem)
            .node_labels("n1")
            .await
            .unwrap_err();
        assert!(matches!(err, K8sError::Tls { .. }), "{err}");
    }

    #[tokio::test]
    async fn reports_a_closed_port() {
        let api = api_server("t").await;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        let mut closed = client(&api, "t", &api.ca_pem);
        closed.port = port;
        let err = closed.node_labels("n1").await.unwrap_err();
        assert!(matches!(err, K8sError::Connect { .. }), "{err}");
        // An empty CA file is refused before any connection.
        closed.ca_pem.clear();
        let err = closed.node_labels("n1").await.unwrap_err();
        assert!(matches!(err, K8sError::BadCa { .. }), "{err}");
    }
}
