//! The relay's agent-facing `AgentService`: an agent's `Attach` stream
//! becomes a node of the relay's one AttachMany stream
//! ([`crate::upstream`]), exactly as the dispatcher would serve it.
//!
//! An Attach: its first message must be Register (INVALID_ARGUMENT
//! naming `register` / `register.node` otherwise); with agent TLS the
//! agent's verified certificate must name the node ([`crate::tls`]). The
//! Register goes up the node's slot and the Attach answers once the
//! dispatcher did: its Registered opens the agent's stream, its refusal
//! (`ended`) is the Attach's status. Then the agent's messages go up
//! (waiting while the relay's queue is full: the agent is held by HTTP/2
//! flow control) and the dispatcher's come down. The node's session ends
//! when the agent's stream ends (Detach), when the dispatcher ends it
//! (the agent's stream ends with that status) or when the relay's stream
//! breaks (UNAVAILABLE): the agent reconnects and registers again.
//!
//! AttachMany is not served: relays do not chain (UNIMPLEMENTED).

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use proto::v1::agent_service_server::AgentService;
use proto::v1::{AgentMessage, DispatcherMessage, RelayMessage, RelayReply, agent_message};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

use crate::upstream::{OpenError, Upstream};

/// Longest node name an agent may register as (the dispatcher's limit).
pub const MAX_NODE_NAME_BYTES: usize = 253;

/// How long an Attach waits for the dispatcher's answer to its Register
/// (the agent itself gives up after 9 s).
pub const REGISTER_TIMEOUT: Duration = Duration::from_secs(8);

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// The relay's AgentService.
#[derive(Clone)]
pub struct Relay {
    upstream: Upstream,
    /// Agents must present a verified client certificate naming their node.
    require_client_cert: bool,
}

impl Relay {
    /// Agents' sessions carried by `upstream`.
    pub fn new(upstream: Upstream, require_client_cert: bool) -> Self {
        Self {
            upstream,
            require_client_cert,
        }
    }

    async fn attach_stream(
        &self,
        req: Request<Streaming<AgentMessage>>,
    ) -> Result<Response<BoxStream<DispatcherMessage>>, Status> {
        let peer_certs = crate::tls::peer_certs(&req);
        let mut inbound = req.into_inner();
        let first = inbound.message().await?.ok_or_else(|| {
            Status::invalid_argument("register: the stream ended before Register")
        })?;
        let Some(agent_message::Msg::Register(register)) = first.msg else {
            return Err(Status::invalid_argument(
                "register: the first message must be Register",
            ));
        };
        if register.node.is_empty() {
            return Err(Status::invalid_argument("register.node: empty"));
        }
        if register.node.len() > MAX_NODE_NAME_BYTES {
            return Err(Status::invalid_argument(format!(
                "register.node: {} bytes, over the limit of {MAX_NODE_NAME_BYTES}",
                register.node.len()
            )));
        }
        if self.require_client_cert {
            crate::tls::authorize_agent(peer_certs.as_deref().map(Vec::as_slice), &register.node)?;
        }
        let node = register.node.clone();
        let (sender, mut rx) = self.upstream.open().map_err(|e| match e {
            OpenError::Full => Status::resource_exhausted(e.to_string()),
        })?;
        sender
            .send(AgentMessage {
                msg: Some(agent_message::Msg::Register(register)),
            })
            .await
            .map_err(|e| Status::unavailable(format!("relay: {e}")))?;
        let first = tokio::time::timeout(REGISTER_TIMEOUT, rx.recv())
            .await
            .map_err(|_| {
                Status::unavailable("relay: the dispatcher did not answer the Register in time")
            })?
            .ok_or_else(|| Status::unavailable("relay: the node's session ended"))?;
        let first = (*first)?;
        tracing::info!(%node, slot = sender.slot(), "agent attached through the relay");
        // The agent's messages go up until its stream ends or the session
        // ends; dropping the sender then detaches the node.
        let reader = tokio::spawn(async move {
            loop {
                match inbound.next().await {
                    Some(Ok(m)) => {
                        if sender.send(m).await.is_err() {
                            break;
                        }
                    }
                    Some(Err(status)) => {
                        tracing::info!(%node, %status, "agent stream error");
                        break;
                    }
                    None => break,
                }
            }
            tracing::debug!(%node, "agent detached");
        });
        let guard = Arc::new(AbortOnDrop(reader));
        // The dispatcher's messages; the first error ends the stream.
        let down = tokio_stream::once(Ok(first))
            .chain(tokio_stream::wrappers::UnboundedReceiverStream::new(rx).map(|b| *b));
        let mut ended = false;
        let down = down
            .take_while(move |r| {
                let go = !ended;
                ended |= r.is_err();
                go
            })
            .map(move |r| {
                let _keep = &guard;
                r
            });
        Ok(Response::new(Box::pin(down)))
    }
}

/// Ends the agent's reader when its response stream is dropped (the agent
/// went away, or the session ended).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[tonic::async_trait]
impl AgentService for Relay {
    type AttachStream = BoxStream<DispatcherMessage>;

    async fn attach(
        &self,
        req: Request<Streaming<AgentMessage>>,
    ) -> Result<Response<Self::AttachStream>, Status> {
        self.attach_stream(req).await
    }

    type AttachManyStream = BoxStream<RelayReply>;

    async fn attach_many(
        &self,
        _req: Request<Streaming<RelayMessage>>,
    ) -> Result<Response<Self::AttachManyStream>, Status> {
        Err(Status::unimplemented(
            "AttachMany: a relay takes agents' Attach streams; point relays at a dispatcher",
        ))
    }
}
