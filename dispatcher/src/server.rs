//! The gRPC services: JobService and NodeService for clients,
//! AgentService for agents, plus health checking and server reflection
//! (v1 and v1alpha). Handlers only translate between the wire and the
//! core's commands, after the access checks: each client call passes
//! [`Access::check`] (bearer tokens and roles, see [`crate::auth`]) and
//! jobs outside the caller's scope are answered as missing; an agent's
//! Attach passes [`crate::tls::authorize_agent`] when client certificates
//! are required. Message sizes and the submission rate are the services'
//! [`Limits`]. Only the leader serves: each handler asks the [`Gate`]
//! for the core, which a follower answers with UNAVAILABLE naming the
//! leader.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use proto::v1::agent_service_server::{AgentService, AgentServiceServer};
use proto::v1::job_service_server::{JobService, JobServiceServer};
use proto::v1::node_service_server::{NodeService, NodeServiceServer};
use proto::v1::{
    AgentMessage, CancelJobRequest, DispatcherMessage, GetJobRequest, GetNodeRequest, Job,
    JobEvent, ListJobsRequest, ListJobsResponse, ListNodesRequest, ListNodesResponse, LogChunk,
    Node, NodeActionRequest, RelayMessage, RelayReply, StreamLogsRequest, SubmitJobRequest,
    SubmitJobResponse, SubmitJobsRequest, SubmitJobsResponse, WatchJobsRequest, agent_message,
};
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

use crate::auth::{Access, Action, Scope};
use crate::core::Command;
use crate::gate::{Gate, Role};
use crate::limits::{Limits, SubmitLimiter, client_key};
#[cfg(test)]
use crate::session::MAX_STATUS_MESSAGE_BYTES;
use crate::session::{Refused, Session, bounded, inbound_error};
use crate::store::NodeAdmin;

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// The W3C Trace Context headers of a request (`traceparent`,
/// `tracestate`), for the submitted jobs' traces to continue the caller's.
/// A malformed value is ignored (the job gets a trace of its own).
fn trace_context(md: &tonic::metadata::MetadataMap) -> std::collections::HashMap<String, String> {
    ["traceparent", "tracestate"]
        .into_iter()
        .filter_map(|k| Some((k.to_string(), md.get(k)?.to_str().ok()?.to_string())))
        .collect()
}

/// Client-facing job service.
#[derive(Clone)]
pub struct Jobs {
    gate: Gate,
    access: Access,
    /// Per-client submission rate ([`Limits::submit_limiter`]).
    submit: Arc<SubmitLimiter>,
}

/// The answer for a job that does not exist or is outside the caller's
/// scope: the same, so a user learns nothing of other users' jobs.
fn no_job(id: &str) -> Status {
    Status::not_found(format!("id: no job {id:?}"))
}

impl Jobs {
    /// Admit `specs` submissions from the request's client (`identity`:
    /// its authenticated user, "" without tokens), or refuse.
    fn admit<T>(&self, req: &Request<T>, identity: &str, specs: usize) -> Result<(), Status> {
        self.submit
            .admit(&client_key(req, identity), specs, Instant::now())
    }

    /// Whether job (or array) `id` is within `scope`; NOT_FOUND otherwise.
    async fn check_scope(&self, scope: &Scope, id: &str) -> Result<(), Status> {
        if *scope == Scope::All {
            return Ok(());
        }
        let owner = match self
            .gate
            .core()?
            .call(|reply| Command::Get {
                id: id.to_string(),
                reply,
            })
            .await
        {
            Ok(job) => job.owner,
            Err(s) if s.code() == tonic::Code::NotFound => {
                // An array id: its elements share its owner.
                let req = ListJobsRequest {
                    array_id: id.to_string(),
                    page_size: 1,
                    ..Default::default()
                };
                let (page, _) = self
                    .gate
                    .core()?
                    .call(|reply| Command::List { req, reply })
                    .await?;
                match page.into_iter().next() {
                    Some(job) => job.owner,
                    None => return Err(no_job(id)),
                }
            }
            Err(s) => return Err(s),
        };
        if scope.covers(&owner) {
            Ok(())
        } else {
            Err(no_job(id))
        }
    }
}

#[tonic::async_trait]
impl JobService for Jobs {
    async fn submit_job(
        &self,
        req: Request<SubmitJobRequest>,
    ) -> Result<Response<SubmitJobResponse>, Status> {
        let owner = self.access.check(req.metadata(), Action::Submit)?.owner;
        self.admit(&req, &owner, 1)?;
        let trace_context = trace_context(req.metadata());
        let spec = req
            .into_inner()
            .spec
            .ok_or_else(|| Status::invalid_argument("spec: missing"))?;
        let jobs = self
            .gate
            .core()?
            .call(|reply| Command::Submit {
                specs: vec![spec],
                batch: false,
                trace_context,
                owner,
                reply,
            })
            .await?;
        let mut reply = SubmitJobResponse::default();
        for job in &jobs {
            reply.encoded.push(|buf| job.encode_proto(buf));
        }
        Ok(Response::new(reply))
    }

    async fn submit_jobs(
        &self,
        req: Request<SubmitJobsRequest>,
    ) -> Result<Response<SubmitJobsResponse>, Status> {
        let owner = self.access.check(req.metadata(), Action::Submit)?.owner;
        self.admit(&req, &owner, req.get_ref().specs.len())?;
        let trace_context = trace_context(req.metadata());
        let specs = req.into_inner().specs;
        tracing::debug!(target: "lat", n = specs.len(), "submit rpc received");
        let jobs = self
            .gate
            .core()?
            .call(|reply| Command::Submit {
                specs,
                batch: true,
                trace_context,
                owner,
                reply,
            })
            .await?;
        // Encoded from the shared records, off the core: no `Job` copy
        // of each spec (proto's `reply` module).
        let mut reply = SubmitJobsResponse::default();
        for job in &jobs {
            reply.encoded.push(|buf| job.encode_proto(buf));
        }
        Ok(Response::new(reply))
    }

    async fn get_job(&self, req: Request<GetJobRequest>) -> Result<Response<Job>, Status> {
        let scope = self.access.check(req.metadata(), Action::ReadJobs)?.scope;
        let id = req.into_inner().id;
        let job = self
            .gate
            .core()?
            .call(|reply| Command::Get {
                id: id.clone(),
                reply,
            })
            .await?;
        if !scope.covers(&job.owner) {
            return Err(no_job(&id));
        }
        Ok(Response::new(job))
    }

    async fn list_jobs(
        &self,
        req: Request<ListJobsRequest>,
    ) -> Result<Response<ListJobsResponse>, Status> {
        let scope = self.access.check(req.metadata(), Action::ReadJobs)?.scope;
        let mut req = req.into_inner();
        if let Scope::Own(user) = scope {
            req.owner = user;
        }
        let (jobs, next_page_token) = self
            .gate
            .core()?
            .call(|reply| Command::List { req, reply })
            .await?;
        Ok(Response::new(ListJobsResponse {
            jobs,
            next_page_token,
        }))
    }

    async fn cancel_job(&self, req: Request<CancelJobRequest>) -> Result<Response<Job>, Status> {
        let scope = self.access.check(req.metadata(), Action::Cancel)?.scope;
        let id = req.into_inner().id;
        self.check_scope(&scope, &id).await?;
        Ok(Response::new(
            self.gate
                .core()?
                .call(|reply| Command::Cancel { id, reply })
                .await?,
        ))
    }

    type WatchJobsStream = BoxStream<JobEvent>;

    async fn watch_jobs(
        &self,
        req: Request<WatchJobsRequest>,
    ) -> Result<Response<Self::WatchJobsStream>, Status> {
        let scope = self.access.check(req.metadata(), Action::ReadJobs)?.scope;
        let req = req.into_inner();
        let ids = req.ids.clone();
        let (current, mut rx) = self
            .gate
            .core()?
            .call(|reply| Command::Watch {
                ids: req.ids,
                include_current: req.include_current,
                reply,
            })
            .await?;
        let (tx, out) = mpsc::channel(1024);
        tokio::spawn(async move {
            for job in current.into_iter().filter(|j| scope.covers(&j.owner)) {
                let ev = JobEvent {
                    job: Some(job),
                    previous_state: 0,
                    time_ms: crate::core::now_ms(),
                };
                if tx.send(Ok(ev)).await.is_err() {
                    return;
                }
            }
            loop {
                match rx.recv().await {
                    Ok(ev) => {
                        let id = ev.job.as_ref().map(|j| j.id.as_str()).unwrap_or("");
                        let array = ev.job.as_ref().map(|j| j.array_id.as_str()).unwrap_or("");
                        let gang = ev.job.as_ref().map(|j| j.gang_id.as_str()).unwrap_or("");
                        if !ids.is_empty()
                            && !ids.iter().any(|x| {
                                x == id
                                    || (!array.is_empty() && x == array)
                                    || (!gang.is_empty() && x == gang)
                            })
                        {
                            continue;
                        }
                        if !scope.covers(ev.job.as_ref().map_or("", |j| j.owner.as_str())) {
                            continue;
                        }
                        if tx.send(Ok(ev)).await.is_err() {
                            return;
                        }
                    }
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        let _ = tx
                            .send(Err(Status::data_loss(format!(
                                "watcher fell {n} events behind; re-watch with include_current"
                            ))))
                            .await;
                        return;
                    }
                    Err(broadcast::error::RecvError::Closed) => {
                        // The core stopped (shutdown, or this replica
                        // stepped down): say so, so the watcher re-watches.
                        let _ = tx
                            .send(Err(Status::unavailable(
                                "the dispatcher stopped or stepped down as leader; re-watch",
                            )))
                            .await;
                        return;
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(out),
        )))
    }

    type StreamLogsStream = BoxStream<LogChunk>;

    async fn stream_logs(
        &self,
        req: Request<StreamLogsRequest>,
    ) -> Result<Response<Self::StreamLogsStream>, Status> {
        let scope = self.access.check(req.metadata(), Action::ReadJobs)?.scope;
        let req = req.into_inner();
        self.check_scope(&scope, &req.id).await?;
        let (tx, rx) = mpsc::unbounded_channel();
        self.gate
            .core()?
            .call(|reply| Command::Logs { req, tx, reply })
            .await?;
        Ok(Response::new(Box::pin(UnboundedReceiverStream::new(rx))))
    }
}

/// Client-facing node service.
#[derive(Clone)]
pub struct Nodes {
    gate: Gate,
    access: Access,
}

impl Nodes {
    async fn admin(
        &self,
        req: Request<NodeActionRequest>,
        admin: NodeAdmin,
    ) -> Result<Response<Node>, Status> {
        self.access.check(req.metadata(), Action::AdminNodes)?;
        let name = req.into_inner().name;
        if name.is_empty() {
            return Err(Status::invalid_argument("name: empty"));
        }
        Ok(Response::new(
            self.gate
                .core()?
                .call(|reply| Command::NodeAdmin { name, admin, reply })
                .await?,
        ))
    }
}

#[tonic::async_trait]
impl NodeService for Nodes {
    async fn list_nodes(
        &self,
        req: Request<ListNodesRequest>,
    ) -> Result<Response<ListNodesResponse>, Status> {
        self.access.check(req.metadata(), Action::ReadNodes)?;
        let ListNodesRequest {
            page_size,
            page_token,
        } = req.into_inner();
        Ok(Response::new(
            self.gate
                .core()?
                .call(|reply| Command::Nodes {
                    after: page_token,
                    page_size,
                    reply,
                })
                .await?,
        ))
    }

    async fn get_node(&self, req: Request<GetNodeRequest>) -> Result<Response<Node>, Status> {
        self.access.check(req.metadata(), Action::ReadNodes)?;
        let name = req.into_inner().name;
        Ok(Response::new(
            self.gate
                .core()?
                .call(|reply| Command::Node { name, reply })
                .await?,
        ))
    }

    async fn drain_node(&self, req: Request<NodeActionRequest>) -> Result<Response<Node>, Status> {
        self.admin(req, NodeAdmin::Draining).await
    }

    async fn cordon_node(&self, req: Request<NodeActionRequest>) -> Result<Response<Node>, Status> {
        self.admin(req, NodeAdmin::Cordoned).await
    }

    async fn uncordon_node(
        &self,
        req: Request<NodeActionRequest>,
    ) -> Result<Response<Node>, Status> {
        self.admin(req, NodeAdmin::Ready).await
    }
}

/// The agents' stream.
#[derive(Clone)]
pub struct Agents {
    gate: Gate,
    /// Agents must present a verified client certificate naming the node
    /// they register as (`--tls-client-ca`).
    require_client_cert: bool,
}

pub use crate::session::MAX_NODE_NAME_BYTES;

impl Agents {
    async fn attach_stream(
        &self,
        req: Request<Streaming<AgentMessage>>,
    ) -> Result<Response<BoxStream<DispatcherMessage>>, Status> {
        // The stream stays with the core it attached to: if this replica
        // steps down, that core ends the stream and the agent moves on.
        let core = self.gate.core()?;
        let peer_certs = crate::tls::peer_certs(&req);
        let mut inbound = req.into_inner();
        let first = inbound
            .message()
            .await
            .map_err(|s| inbound_error(&s))?
            .ok_or_else(|| Status::invalid_argument("stream ended before Register"))?;
        let Some(agent_message::Msg::Register(register)) = first.msg else {
            return Err(Status::invalid_argument(
                "the first message must be Register",
            ));
        };
        let (tx, rx) = crate::outbound::channel();
        // Kept to end the stream with the reason when reading it fails.
        let failed = tx.clone();
        let certs = peer_certs.as_deref().map(Vec::as_slice);
        let mut session = Session::open(&core, register, tx, certs, self.require_client_cert)
            .map_err(Refused::into_status)?
            .attached(&core)
            .await
            .map_err(Refused::into_status)?;
        tokio::spawn(async move {
            // Liveness and LoadReports are aggregated here, per stream,
            // and reach the core in batches (crate::beats); the rest goes
            // to the core as commands, in the stream's order.
            let mut scratch = Vec::new();
            loop {
                match inbound.next().await {
                    Some(Ok(AgentMessage { msg })) => {
                        session.handle(&core, msg, crate::core::now_ms(), &mut scratch)
                    }
                    Some(Err(status)) => {
                        tracing::info!(node = %session.node(), %status, "agent stream error");
                        let _ = failed.send(Err(inbound_error(&status)));
                        break;
                    }
                    None => break,
                }
            }
            session.close(&core);
        });
        Ok(Response::new(Box::pin(rx.into_stream())))
    }

    /// AttachMany: the stream's one reader task ([`crate::relay`]) serves
    /// every node on it; the response is the stream's one outbound queue,
    /// framed per [`RelayReply`].
    fn attach_many_stream(
        &self,
        req: Request<Streaming<RelayMessage>>,
    ) -> Result<Response<BoxStream<RelayReply>>, Status> {
        let core = self.gate.core()?;
        let peer_certs = crate::tls::peer_certs(&req);
        let inbound = req.into_inner();
        let (tx, rx) = crate::outbound::channel();
        let relay = crate::relay::Relay::new(core, tx, peer_certs, self.require_client_cert);
        tokio::spawn(relay.serve(inbound));
        Ok(Response::new(Box::pin(rx.into_relay_stream())))
    }
}

#[tonic::async_trait]
impl AgentService for Agents {
    type AttachStream = BoxStream<DispatcherMessage>;

    /// An agent's stream: Register first, then its reports. Every refusal
    /// is a status small enough to reach the agent ([`bounded`]).
    async fn attach(
        &self,
        req: Request<Streaming<AgentMessage>>,
    ) -> Result<Response<Self::AttachStream>, Status> {
        self.attach_stream(req).await.map_err(bounded)
    }

    type AttachManyStream = BoxStream<RelayReply>;

    /// A relay's stream of many nodes (see the proto and [`crate::relay`]).
    async fn attach_many(
        &self,
        req: Request<Streaming<RelayMessage>>,
    ) -> Result<Response<Self::AttachManyStream>, Status> {
        self.attach_many_stream(req).map_err(bounded)
    }
}

/// How the services are secured: TLS on the port, client checks, agent
/// checks. The default is plain text and open (the `--dev` default).
#[derive(Clone, Default)]
pub struct Security {
    /// Serve TLS with this configuration.
    pub tls: Option<tonic::transport::ServerTlsConfig>,
    /// Bearer tokens and roles for JobService and NodeService.
    pub access: Access,
    /// Agents must present a verified client certificate naming their
    /// node (needs `tls` with a client CA).
    pub require_agent_cert: bool,
}

/// Serve every service on `addr` until `shutdown` resolves, open, in
/// plain text and with the default limits.
pub async fn serve(
    gate: Gate,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    serve_secured(
        gate,
        listener,
        Security::default(),
        Limits::default(),
        shutdown,
    )
    .await
}

/// Serve every service on `addr` until `shutdown` resolves, secured as
/// `security` says and within `limits`. Health reports the three services
/// SERVING while `gate` leads and NOT_SERVING on a follower.
pub async fn serve_secured(
    gate: Gate,
    listener: tokio::net::TcpListener,
    security: Security,
    limits: Limits,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let (health_reporter, health) = tonic_health::server::health_reporter();
    let mut roles = gate.watch();
    tokio::spawn(async move {
        loop {
            let leads = matches!(&*roles.borrow_and_update(), Role::Leader(_));
            if leads {
                health_reporter
                    .set_serving::<JobServiceServer<Jobs>>()
                    .await;
                health_reporter
                    .set_serving::<NodeServiceServer<Nodes>>()
                    .await;
                health_reporter
                    .set_serving::<AgentServiceServer<Agents>>()
                    .await;
            } else {
                health_reporter
                    .set_not_serving::<JobServiceServer<Jobs>>()
                    .await;
                health_reporter
                    .set_not_serving::<NodeServiceServer<Nodes>>()
                    .await;
                health_reporter
                    .set_not_serving::<AgentServiceServer<Agents>>()
                    .await;
            }
            if roles.changed().await.is_err() {
                return;
            }
        }
    });
    let reflection_v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .unwrap_or_else(|e| panic!("the compiled-in descriptor set is valid: {e}"));
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()
        .unwrap_or_else(|e| panic!("the compiled-in descriptor set is valid: {e}"));
    let incoming = incoming(listener);
    // Message size limits (crate::limits): over them tonic answers
    // OUT_OF_RANGE / RESOURCE_EXHAUSTED before a handler runs.
    let (decode, encode, agent) = (
        limits.client_decode(),
        limits.client_encode(),
        limits.agent_message(),
    );
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = security.tls {
        builder = builder.tls_config(tls)?;
    }
    let access = security.access;
    builder
        .add_service(
            health
                .max_decoding_message_size(decode)
                .max_encoding_message_size(encode),
        )
        .add_service(
            reflection_v1
                .max_decoding_message_size(decode)
                .max_encoding_message_size(encode),
        )
        .add_service(
            reflection_v1alpha
                .max_decoding_message_size(decode)
                .max_encoding_message_size(encode),
        )
        .add_service(
            JobServiceServer::new(Jobs {
                gate: gate.clone(),
                access: access.clone(),
                submit: Arc::new(limits.submit_limiter()),
            })
            .max_decoding_message_size(decode)
            .max_encoding_message_size(encode),
        )
        .add_service(
            NodeServiceServer::new(Nodes {
                gate: gate.clone(),
                access,
            })
            .max_decoding_message_size(decode)
            .max_encoding_message_size(encode),
        )
        .add_service(
            AgentServiceServer::new(Agents {
                gate,
                require_client_cert: security.require_agent_cert,
            })
            .max_decoding_message_size(agent)
            .max_encoding_message_size(agent),
        )
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
}

/// The accepted connections of `listener`, each with `TCP_NODELAY` set.
/// Tonic's `tcp_nodelay` (on by default) applies only to the listeners it
/// binds itself, not to an incoming stream it is handed: without it every
/// accepted socket kept Nagle's algorithm, so a small message (an
/// `Assign`, a reply) written while an earlier one was unacknowledged
/// waited for the peer's delayed ACK, about 40 ms on Linux. The clients
/// (`proto::endpoints`) set it on their side already.
fn incoming(listener: tokio::net::TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))
}

/// The address a listener is bound to, for printing.
pub fn local_addr(l: &tokio::net::TcpListener) -> Option<SocketAddr> {
    l.local_addr().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_the_agents_stream_ends_with_fits_in_a_header() {
        let short = Status::permission_denied("node: no");
        assert_eq!(bounded(short.clone()).message(), short.message());
        // Two-byte characters across the cut: it falls on a boundary.
        let long = Status::invalid_argument(format!("x{}", "é".repeat(40_000)));
        let cut = bounded(long);
        assert_eq!(cut.code(), tonic::Code::InvalidArgument);
        assert!(cut.message().len() <= MAX_STATUS_MESSAGE_BYTES + 40);
        assert!(cut.message().ends_with("... (cut from 80001 bytes)"));
    }

    #[tokio::test]
    async fn accepted_connections_do_not_wait_for_delayed_acks() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut accepted = incoming(listener);
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let conn = accepted.next().await.unwrap().unwrap();
        assert!(conn.nodelay().unwrap(), "Nagle's algorithm is on");
    }

    #[test]
    fn a_stream_the_server_cannot_read_is_the_agents_error() {
        let decode = Status::internal("failed to decode Protobuf message: buffer underflow");
        let s = inbound_error(&decode);
        assert_eq!(s.code(), tonic::Code::InvalidArgument);
        assert_eq!(
            s.message(),
            "agent stream: failed to decode Protobuf message: buffer underflow"
        );
        let big = Status::out_of_range("decoded message length too large");
        assert_eq!(inbound_error(&big).code(), tonic::Code::OutOfRange);
    }
}
