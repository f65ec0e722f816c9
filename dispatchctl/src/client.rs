//! The connection to the dispatcher: the two gRPC service clients over one
//! channel, error mapping (unreachable vs. refused by the server) and the
//! calls the commands share (listing every page, node actions).
//!
//! With several replicas (`--server URL,URL,...`) the client finds the
//! leader through `proto::endpoints` (follow a follower's hint, rotate past
//! dead replicas), at start ([`Client::connect_leader`]) and again when a
//! long-lived stream breaks ([`Client::find_leader`]).

use std::time::Duration;

use proto::client_security::{AuthChannel, Bearer, ClientTls};
use proto::endpoints::{Endpoints, LeaderChannel, should_failover};
use proto::v1 as pb;
use proto::v1::job_service_client::JobServiceClient;
use proto::v1::node_service_client::NodeServiceClient;
use tonic::transport::Channel;
use tonic::{Code, Status};

use crate::{Error, Result};

/// How long to wait for the TCP + HTTP/2 connection.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Nodes per ListNodes page ([`Client::list_nodes`]).
pub const NODE_PAGE: u32 = 500;

/// Largest message accepted from the dispatcher (a 10,000-job page).
const MAX_MESSAGE: usize = 256 << 20;

/// A connected client of the dispatcher's JobService and NodeService.
#[derive(Clone)]
pub struct Client {
    addr: String,
    /// How to find the leader again.
    search: LeaderSearch,
    /// `dispatch.v1.JobService`.
    pub jobs: JobServiceClient<AuthChannel>,
    /// `dispatch.v1.NodeService`.
    pub nodes: NodeServiceClient<AuthChannel>,
}

/// What [`Client::find_leader`] needs: the configured URLs and the
/// connection settings.
#[derive(Clone)]
struct LeaderSearch {
    addrs: String,
    tls: ClientTls,
    bearer: Bearer,
}

/// Finds the leader among `endpoints` (LeaderChannel: hints followed at
/// once, rotations for up to `patience`): the URL and a channel to it.
/// Any answer but UNAVAILABLE (or a broken connection) to `GetJob("")`
/// comes from the leader (an empty id is simply not found there).
async fn locate(
    endpoints: Endpoints,
    patience: Duration,
    tls: &ClientTls,
    bearer: &Bearer,
) -> (String, std::result::Result<Channel, Status>) {
    let mut leader = LeaderChannel::new(endpoints, patience).with_tls(tls.clone());
    let found = leader
        .call(|channel| {
            let bearer = bearer.clone();
            async move {
                let probe = pb::GetJobRequest { id: String::new() };
                let mut jobs = JobServiceClient::with_interceptor(channel.clone(), bearer);
                match jobs.get_job(probe).await {
                    Err(s) if should_failover(&s) => Err(s),
                    // A connection that broke under the probe is no answer.
                    Err(s) if is_disconnect(&s) => Err(Status::unavailable(status_cause(&s))),
                    _ => Ok(channel),
                }
            }
        })
        .await;
    (leader.current().to_string(), found)
}

/// [`Error::Unreachable`], with a hint when a plain-text URL may be
/// talking to a TLS port (the connection opens, then breaks).
fn unreachable(addr: &str, cause: String) -> Error {
    // What an HTTP/2 client sees when a TLS server drops its cleartext
    // bytes: the connection opened, then the protocol broke.
    let broke = ["frame", "h2 protocol", "connection closed", "broken pipe"]
        .iter()
        .any(|w| cause.contains(w));
    let cause = if addr.starts_with("http://") && broke {
        format!("{cause}; if it serves TLS, use an https:// URL with --tls-ca")
    } else {
        cause
    };
    Error::Unreachable {
        addr: addr.to_string(),
        cause,
    }
}

/// Node administration calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeOp {
    Drain,
    Cordon,
    Uncordon,
}

impl Client {
    /// Connects now, so that an unreachable dispatcher is reported before
    /// anything else happens. `tls` verifies an `https://` dispatcher;
    /// `bearer` goes with every call.
    pub async fn connect(addr: &str, tls: &ClientTls, bearer: Bearer) -> Result<Self> {
        let unreachable = |cause: String| unreachable(addr, cause);
        let endpoint = proto::client_security::endpoint(addr, tls)?
            .connect_timeout(CONNECT_TIMEOUT)
            .tcp_nodelay(true);
        let channel = match tokio::time::timeout(CONNECT_TIMEOUT, endpoint.connect()).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return Err(unreachable(error_cause(&e))),
            Err(_) => return Err(unreachable("timed out".to_string())),
        };
        let mut client = Client::from_channel(addr, channel, bearer);
        client.search.tls = tls.clone();
        Ok(client)
    }

    /// Connects to the leader among `addrs` (`URL[,URL...]`): follows a
    /// follower's `dispatch-leader` hint and rotates past unreachable
    /// replicas (proto::endpoints). When none answers, reports the first
    /// unreachable one as [`Client::connect`] does.
    pub async fn connect_leader(addrs: &str, tls: &ClientTls, bearer: Bearer) -> Result<Self> {
        let endpoints =
            Endpoints::new([addrs]).map_err(|e| Error::Usage(format!("--server: {e}")))?;
        let patience = if endpoints.urls().len() > 1 {
            CONNECT_TIMEOUT
        } else {
            Duration::ZERO
        };
        let (url, found) = locate(endpoints, patience, tls, &bearer).await;
        let mut client = match found {
            Ok(channel) => Client::from_channel(&url, channel, bearer.clone()),
            Err(_) => Client::connect(&url, tls, bearer.clone()).await?,
        };
        client.search = LeaderSearch {
            addrs: addrs.to_string(),
            tls: tls.clone(),
            bearer,
        };
        Ok(client)
    }

    /// Finds the leader again after a stream or call to this client's
    /// dispatcher broke (a failover, a restart), trying for up to
    /// `patience`: the configured URLs (and the one in use, which may have
    /// been learnt from a hint), hints followed at once. On success the
    /// client talks to the leader from then on; else the last
    /// UNAVAILABLE.
    pub async fn find_leader(&mut self, patience: Duration) -> std::result::Result<(), Status> {
        let search = self.search.clone();
        let endpoints = Endpoints::new([search.addrs.as_str(), self.addr.as_str()])
            .map_err(|e| Status::invalid_argument(format!("--server: {e}")))?;
        let (url, found) = locate(endpoints, patience, &search.tls, &search.bearer).await;
        let channel = found?;
        *self = Client::from_channel(&url, channel, search.bearer.clone());
        self.search = search;
        Ok(())
    }

    /// The configured dispatcher URLs (for messages).
    pub fn servers(&self) -> &str {
        &self.search.addrs
    }

    /// A client over an existing channel (e.g. a lazily connected one);
    /// [`Client::find_leader`] reconnects to `addr` in plain text.
    pub fn from_channel(addr: &str, channel: Channel, bearer: Bearer) -> Self {
        Client {
            addr: addr.to_string(),
            search: LeaderSearch {
                addrs: addr.to_string(),
                tls: ClientTls::default(),
                bearer: bearer.clone(),
            },
            jobs: JobServiceClient::with_interceptor(channel.clone(), bearer.clone())
                .max_decoding_message_size(MAX_MESSAGE),
            nodes: NodeServiceClient::with_interceptor(channel, bearer)
                .max_decoding_message_size(MAX_MESSAGE),
        }
    }

    /// The dispatcher's address.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Maps a status from a call: a lost connection (see
    /// [`is_disconnect`]) is [`Error::Unreachable`] (exit 2); anything else
    /// is the dispatcher's answer (exit 1).
    pub fn error(&self, status: Status) -> Error {
        if is_disconnect(&status) {
            unreachable(&self.addr, status_cause(&status))
        } else {
            Error::Rpc(status)
        }
    }

    /// Submits one spec (an array when `spec.array_count > 1`). A trace
    /// context in the environment (`TRACEPARENT`, `TRACESTATE`: OTel's
    /// environment carrier, set by a traced shell script or CI step) goes
    /// along as W3C metadata, so the job's trace continues the caller's.
    pub async fn submit(&mut self, spec: pb::JobSpec) -> Result<Vec<pb::Job>> {
        let mut req = tonic::Request::new(pb::SubmitJobRequest { spec: Some(spec) });
        for (var, header) in [("TRACEPARENT", "traceparent"), ("TRACESTATE", "tracestate")] {
            if let Some(value) = std::env::var(var)
                .ok()
                .and_then(|v| tonic::metadata::MetadataValue::try_from(v.trim()).ok())
            {
                req.metadata_mut().insert(header, value);
            }
        }
        match self.jobs.submit_job(req).await {
            Ok(r) => Ok(r.into_inner().jobs),
            Err(s) => Err(self.error(s)),
        }
    }

    /// One job.
    pub async fn get_job(&mut self, id: &str) -> Result<pb::Job> {
        let req = pb::GetJobRequest { id: id.to_string() };
        match self.jobs.get_job(req).await {
            Ok(r) => Ok(r.into_inner()),
            Err(s) => Err(self.error(s)),
        }
    }

    /// Cancels one job (or array).
    pub async fn cancel_job(&mut self, id: &str) -> Result<pb::Job> {
        let req = pb::CancelJobRequest { id: id.to_string() };
        match self.jobs.cancel_job(req).await {
            Ok(r) => Ok(r.into_inner()),
            Err(s) => Err(self.error(s)),
        }
    }

    /// Every job matching `filter`, following page tokens, stopping after
    /// `limit` jobs when given. `filter.page_token` is ignored.
    pub async fn list_all_jobs(
        &mut self,
        filter: &pb::ListJobsRequest,
        limit: Option<u64>,
    ) -> Result<Vec<pb::Job>> {
        let mut jobs = Vec::new();
        let mut token = String::new();
        loop {
            let want = limit.map(|l| l.saturating_sub(jobs.len() as u64));
            let page_size = match want {
                Some(w) => w.clamp(1, 1000) as u32,
                None if filter.page_size > 0 => filter.page_size,
                None => 1000,
            };
            let req = pb::ListJobsRequest {
                page_size,
                page_token: token.clone(),
                ..filter.clone()
            };
            let page = match self.jobs.list_jobs(req).await {
                Ok(r) => r.into_inner(),
                Err(s) => return Err(self.error(s)),
            };
            jobs.extend(page.jobs);
            if let Some(l) = limit
                && jobs.len() as u64 >= l
            {
                jobs.truncate(l as usize);
                return Ok(jobs);
            }
            // An unchanged token would loop forever: treat it as the end.
            if page.next_page_token.is_empty() || page.next_page_token == token {
                return Ok(jobs);
            }
            token = page.next_page_token;
        }
    }

    /// All nodes, sorted by name, read in pages of [`NODE_PAGE`] (as
    /// kubectl reads in chunks of 500), so that no single answer carries a
    /// whole large cluster.
    pub async fn list_nodes(&mut self) -> Result<Vec<pb::Node>> {
        let mut nodes = Vec::new();
        let mut token = String::new();
        loop {
            let req = pb::ListNodesRequest {
                page_size: NODE_PAGE,
                page_token: token.clone(),
            };
            let page = match self.nodes.list_nodes(req).await {
                Ok(r) => r.into_inner(),
                Err(s) => return Err(self.error(s)),
            };
            nodes.extend(page.nodes);
            // An unchanged token would loop forever: treat it as the end.
            if page.next_page_token.is_empty() || page.next_page_token == token {
                return Ok(nodes);
            }
            token = page.next_page_token;
        }
    }

    /// One node.
    pub async fn get_node(&mut self, name: &str) -> Result<pb::Node> {
        let req = pb::GetNodeRequest {
            name: name.to_string(),
        };
        match self.nodes.get_node(req).await {
            Ok(r) => Ok(r.into_inner()),
            Err(s) => Err(self.error(s)),
        }
    }

    /// Drain, cordon or uncordon a node.
    pub async fn node_op(&mut self, op: NodeOp, name: &str) -> Result<pb::Node> {
        let req = pb::NodeActionRequest {
            name: name.to_string(),
        };
        let r = match op {
            NodeOp::Drain => self.nodes.drain_node(req).await,
            NodeOp::Cordon => self.nodes.cordon_node(req).await,
            NodeOp::Uncordon => self.nodes.uncordon_node(req).await,
        };
        r.map(tonic::Response::into_inner)
            .map_err(|s| self.error(s))
    }
}

/// The most useful words for why a connection failed: the kind of the
/// underlying I/O error (`connection refused`, `timed out`) when there is
/// one, else the innermost error's message.
pub fn error_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut innermost = e.to_string();
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            return io_cause(io);
        }
        innermost = err.to_string();
        cur = err.source();
    }
    innermost
}

fn io_cause(io: &std::io::Error) -> String {
    use std::io::ErrorKind as K;
    match io.kind() {
        K::ConnectionRefused => "connection refused".to_string(),
        K::TimedOut => "timed out".to_string(),
        K::ConnectionReset => "connection reset".to_string(),
        K::AddrNotAvailable => "address not available".to_string(),
        K::HostUnreachable => "host unreachable".to_string(),
        K::NetworkUnreachable => "network unreachable".to_string(),
        _ => io.to_string(),
    }
}

/// Whether a status means the connection failed rather than that the
/// dispatcher answered: UNAVAILABLE, or any status tonic made locally from
/// a transport error (those carry a source; statuses read off the wire do
/// not). A stream cut by a dying server, for instance, ends with UNKNOWN
/// "h2 protocol error: error reading a body from connection".
pub fn is_disconnect(status: &Status) -> bool {
    status.code() == Code::Unavailable || std::error::Error::source(status).is_some()
}

/// Why an UNAVAILABLE status happened: the transport's I/O error when
/// tonic kept it (`connection refused`), else the status message.
pub fn status_cause(status: &Status) -> String {
    match std::error::Error::source(status) {
        Some(src) => error_cause(src),
        None if status.message().is_empty() => "unavailable".to_string(),
        None => status.message().to_string(),
    }
}

/// `<message> [<code>]`, e.g. `spec.cpus: must be at least 1
/// [invalid_argument]`: the dispatcher's message names the bad field.
pub fn describe_status(s: &Status) -> String {
    let code = code_name(s.code());
    if s.message().is_empty() {
        format!("the dispatcher answered {code}")
    } else {
        format!("{} [{code}]", s.message())
    }
}

/// The gRPC code in snake_case.
pub fn code_name(c: Code) -> &'static str {
    match c {
        Code::Ok => "ok",
        Code::Cancelled => "cancelled",
        Code::Unknown => "unknown",
        Code::InvalidArgument => "invalid_argument",
        Code::DeadlineExceeded => "deadline_exceeded",
        Code::NotFound => "not_found",
        Code::AlreadyExists => "already_exists",
        Code::PermissionDenied => "permission_denied",
        Code::ResourceExhausted => "resource_exhausted",
        Code::FailedPrecondition => "failed_precondition",
        Code::Aborted => "aborted",
        Code::OutOfRange => "out_of_range",
        Code::Unimplemented => "unimplemented",
        Code::Internal => "internal",
        Code::Unavailable => "unavailable",
        Code::DataLoss => "data_loss",
        Code::Unauthenticated => "unauthenticated",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_read_well() {
        let s = Status::invalid_argument("spec.cpus: must be at least 1");
        assert_eq!(
            describe_status(&s),
            "spec.cpus: must be at least 1 [invalid_argument]"
        );
        assert_eq!(
            describe_status(&Status::not_found("")),
            "the dispatcher answered not_found"
        );
        assert_eq!(
            Error::Rpc(Status::not_found("job j-9 not found")).to_string(),
            "job j-9 not found [not_found]"
        );
    }

    #[test]
    fn causes_come_from_the_io_error() {
        #[derive(Debug)]
        struct Wrap(std::io::Error);
        impl std::fmt::Display for Wrap {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("transport error")
            }
        }
        impl std::error::Error for Wrap {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let e = Wrap(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert_eq!(error_cause(&e), "connection refused");
    }

    #[test]
    fn disconnects_are_told_from_answers() {
        // What tonic makes from a broken connection carries its cause.
        let broken = Status::from_error(Box::new(std::io::Error::from(
            std::io::ErrorKind::ConnectionReset,
        )));
        assert!(is_disconnect(&broken));
        assert_eq!(status_cause(&broken), "connection reset");
        assert!(is_disconnect(&Status::unavailable("down")));
        // Statuses the dispatcher sent, whatever their code, are answers.
        assert!(!is_disconnect(&Status::unknown("boom")));
        assert!(!is_disconnect(&Status::internal("bug")));
        assert!(!is_disconnect(&Status::not_found("job j-1 not found")));
    }

    #[tokio::test]
    async fn unavailable_maps_to_unreachable() {
        let channel = tonic::transport::Endpoint::from_static("http://127.0.0.1:1").connect_lazy();
        let c = Client::from_channel("http://127.0.0.1:1", channel, Bearer::default());
        let e = c.error(Status::unavailable("tcp connect error"));
        assert_eq!(e.exit_code(), crate::EXIT_UNREACHABLE);
        assert!(e.to_string().contains("(tcp connect error)"), "{e}");
        let e = c.error(Status::unavailable(
            "connection error detected: frame with invalid size",
        ));
        assert!(e.to_string().contains("use an https:// URL"), "{e}");
        let e = c.error(Status::invalid_argument("spec.nice: out of range"));
        assert_eq!(e.exit_code(), crate::EXIT_ERROR);
    }
}
