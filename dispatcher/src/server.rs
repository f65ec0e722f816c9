//! The gRPC services: JobService and NodeService for clients,
//! AgentService for agents, plus health checking and server reflection
//! (v1 and v1alpha). Handlers only translate between the wire and the
//! core's commands.

use std::net::SocketAddr;
use std::pin::Pin;

use proto::v1::agent_service_server::{AgentService, AgentServiceServer};
use proto::v1::job_service_server::{JobService, JobServiceServer};
use proto::v1::node_service_server::{NodeService, NodeServiceServer};
use proto::v1::{
    AgentMessage, CancelJobRequest, DispatcherMessage, GetJobRequest, GetNodeRequest, Job,
    JobEvent, ListJobsRequest, ListJobsResponse, ListNodesRequest, ListNodesResponse, LogChunk,
    Node, NodeActionRequest, StreamLogsRequest, SubmitJobRequest, SubmitJobResponse,
    SubmitJobsRequest, SubmitJobsResponse, WatchJobsRequest, agent_message,
};
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

use crate::core::{Command, CoreHandle};
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
    core: CoreHandle,
}

#[tonic::async_trait]
impl JobService for Jobs {
    async fn submit_job(
        &self,
        req: Request<SubmitJobRequest>,
    ) -> Result<Response<SubmitJobResponse>, Status> {
        let trace_context = trace_context(req.metadata());
        let spec = req
            .into_inner()
            .spec
            .ok_or_else(|| Status::invalid_argument("spec: missing"))?;
        let jobs = self
            .core
            .call(|reply| Command::Submit {
                specs: vec![spec],
                batch: false,
                trace_context,
                reply,
            })
            .await?;
        Ok(Response::new(SubmitJobResponse { jobs }))
    }

    async fn submit_jobs(
        &self,
        req: Request<SubmitJobsRequest>,
    ) -> Result<Response<SubmitJobsResponse>, Status> {
        let trace_context = trace_context(req.metadata());
        let specs = req.into_inner().specs;
        let jobs = self
            .core
            .call(|reply| Command::Submit {
                specs,
                batch: true,
                trace_context,
                reply,
            })
            .await?;
        Ok(Response::new(SubmitJobsResponse { jobs }))
    }

    async fn get_job(&self, req: Request<GetJobRequest>) -> Result<Response<Job>, Status> {
        let id = req.into_inner().id;
        Ok(Response::new(
            self.core.call(|reply| Command::Get { id, reply }).await?,
        ))
    }

    async fn list_jobs(
        &self,
        req: Request<ListJobsRequest>,
    ) -> Result<Response<ListJobsResponse>, Status> {
        let req = req.into_inner();
        let (jobs, next_page_token) = self.core.call(|reply| Command::List { req, reply }).await?;
        Ok(Response::new(ListJobsResponse {
            jobs,
            next_page_token,
        }))
    }

    async fn cancel_job(&self, req: Request<CancelJobRequest>) -> Result<Response<Job>, Status> {
        let id = req.into_inner().id;
        Ok(Response::new(
            self.core
                .call(|reply| Command::Cancel { id, reply })
                .await?,
        ))
    }

    type WatchJobsStream = BoxStream<JobEvent>;

    async fn watch_jobs(
        &self,
        req: Request<WatchJobsRequest>,
    ) -> Result<Response<Self::WatchJobsStream>, Status> {
        let req = req.into_inner();
        let ids = req.ids.clone();
        let (current, mut rx) = self
            .core
            .call(|reply| Command::Watch {
                ids: req.ids,
                include_current: req.include_current,
                reply,
            })
            .await?;
        let (tx, out) = mpsc::channel(1024);
        tokio::spawn(async move {
            for job in current {
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
                        if !ids.is_empty()
                            && !ids
                                .iter()
                                .any(|x| x == id || (!array.is_empty() && x == array))
                        {
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
                    Err(broadcast::error::RecvError::Closed) => return,
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
        let req = req.into_inner();
        let (tx, rx) = mpsc::unbounded_channel();
        self.core
            .call(|reply| Command::Logs { req, tx, reply })
            .await?;
        Ok(Response::new(Box::pin(UnboundedReceiverStream::new(rx))))
    }
}

/// Client-facing node service.
#[derive(Clone)]
pub struct Nodes {
    core: CoreHandle,
}

impl Nodes {
    async fn admin(
        &self,
        req: Request<NodeActionRequest>,
        admin: NodeAdmin,
    ) -> Result<Response<Node>, Status> {
        let name = req.into_inner().name;
        if name.is_empty() {
            return Err(Status::invalid_argument("name: empty"));
        }
        Ok(Response::new(
            self.core
                .call(|reply| Command::NodeAdmin { name, admin, reply })
                .await?,
        ))
    }
}

#[tonic::async_trait]
impl NodeService for Nodes {
    async fn list_nodes(
        &self,
        _req: Request<ListNodesRequest>,
    ) -> Result<Response<ListNodesResponse>, Status> {
        let nodes = self.core.call(|reply| Command::Nodes { reply }).await?;
        Ok(Response::new(ListNodesResponse { nodes }))
    }

    async fn get_node(&self, req: Request<GetNodeRequest>) -> Result<Response<Node>, Status> {
        let name = req.into_inner().name;
        Ok(Response::new(
            self.core
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
    core: CoreHandle,
}

#[tonic::async_trait]
impl AgentService for Agents {
    type AttachStream = BoxStream<DispatcherMessage>;

    async fn attach(
        &self,
        req: Request<Streaming<AgentMessage>>,
    ) -> Result<Response<Self::AttachStream>, Status> {
        let mut inbound = req.into_inner();
        let first = inbound
            .message()
            .await?
            .ok_or_else(|| Status::invalid_argument("stream ended before Register"))?;
        let Some(agent_message::Msg::Register(register)) = first.msg else {
            return Err(Status::invalid_argument(
                "the first message must be Register",
            ));
        };
        let node = register.node.clone();
        let (tx, rx) = mpsc::unbounded_channel();
        let session = self
            .core
            .call(|reply| Command::Attach {
                register,
                tx,
                reply,
            })
            .await?;
        let core = self.core.clone();
        tokio::spawn(async move {
            loop {
                match inbound.next().await {
                    Some(Ok(AgentMessage { msg: Some(msg) })) => core.send(Command::FromAgent {
                        node: node.clone(),
                        session,
                        msg,
                    }),
                    Some(Ok(AgentMessage { msg: None })) => {}
                    Some(Err(status)) => {
                        tracing::info!(%node, %status, "agent stream error");
                        break;
                    }
                    None => break,
                }
            }
            core.send(Command::Detach { node, session });
        });
        Ok(Response::new(Box::pin(UnboundedReceiverStream::new(rx))))
    }
}

/// Serve every service on `addr` until `shutdown` resolves.
pub async fn serve(
    core: CoreHandle,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let (health_reporter, health) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<JobServiceServer<Jobs>>()
        .await;
    health_reporter
        .set_serving::<NodeServiceServer<Nodes>>()
        .await;
    health_reporter
        .set_serving::<AgentServiceServer<Agents>>()
        .await;
    let reflection_v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(proto::FILE_DESCRIPTOR_SET)
        .build_v1()
        .unwrap_or_else(|e| panic!("the compiled-in descriptor set is valid: {e}"));
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(proto::FILE_DESCRIPTOR_SET)
        .build_v1alpha()
        .unwrap_or_else(|e| panic!("the compiled-in descriptor set is valid: {e}"));
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    tonic::transport::Server::builder()
        .add_service(health)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(
            JobServiceServer::new(Jobs { core: core.clone() }).max_decoding_message_size(64 << 20),
        )
        .add_service(NodeServiceServer::new(Nodes { core: core.clone() }))
        .add_service(AgentServiceServer::new(Agents { core }).max_decoding_message_size(64 << 20))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
}

/// The address a listener is bound to, for printing.
pub fn local_addr(l: &tokio::net::TcpListener) -> Option<SocketAddr> {
    l.local_addr().ok()
}
