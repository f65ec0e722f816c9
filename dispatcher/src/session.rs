//! One node's session on an agent stream, from its Register to its end:
//! the part of an agent stream's reader that is per node, used by both
//! AgentService RPCs. An Attach stream is one session; an AttachMany
//! stream (a relay's) is a session per slot, all read by the stream's
//! one reader task ([`crate::relay`]).
//!
//! A session holds no task, channel or buffer of its own: its
//! [`Reporter`] (the node's beat, shared with the core, and its last
//! load, packed, shared with the core as the node's load). What it sends
//! the core goes as commands in the stream's order, its LoadReports
//! through its beat ([`crate::beats`]); the core answers through the
//! stream's outbound queue ([`crate::outbound`]), tagged with the slot.

use std::sync::Arc;

use proto::v1::{Register, agent_message};
use tonic::Status;
use tonic::transport::CertificateDer;

use crate::beats::{Beat, Reporter};
use crate::core::{Asked, Command, CoreHandle};
use crate::outbound::AgentTx;

/// Longest node name an agent may register as: a DNS name's limit, which
/// holds Kubernetes node names and host names.
pub const MAX_NODE_NAME_BYTES: usize = 253;

/// Longest status message the agents' stream ends with. A status travels
/// in an HTTP/2 header; one larger than the peer's header list limit
/// (16 KiB in hyper) is refused by the peer's HTTP/2 layer, which resets
/// the stream with PROTOCOL_ERROR and loses the status. Messages that
/// echo what the agent sent are cut to this size.
pub(crate) const MAX_STATUS_MESSAGE_BYTES: usize = 1024;

/// `status` with its message cut to [`MAX_STATUS_MESSAGE_BYTES`] (at a
/// character boundary, saying how long it was).
pub(crate) fn bounded(status: Status) -> Status {
    let msg = status.message();
    if msg.len() <= MAX_STATUS_MESSAGE_BYTES {
        return status;
    }
    let mut end = MAX_STATUS_MESSAGE_BYTES;
    while !msg.is_char_boundary(end) {
        end -= 1;
    }
    Status::new(
        status.code(),
        format!("{}... (cut from {} bytes)", &msg[..end], msg.len()),
    )
}

/// Why the agents' stream ends when reading it failed: the agent sent a
/// message the server could not decode (tonic says INTERNAL) or one over
/// the size limit (OUT_OF_RANGE). Told back to the agent, naming the
/// stream, as its error rather than the server's.
pub(crate) fn inbound_error(status: &Status) -> Status {
    let code = match status.code() {
        tonic::Code::Internal | tonic::Code::Unknown => tonic::Code::InvalidArgument,
        code => code,
    };
    bounded(Status::new(
        code,
        format!("agent stream: {}", status.message()),
    ))
}

/// A node's session: what its stream's reader keeps of it.
#[derive(Debug)]
pub struct Session {
    reporter: Reporter,
}

/// A Register sent to the core, its answer to come ([`Opening::attached`]).
pub struct Opening(Asked<(u64, Arc<Beat>)>);

/// Why a session did not open.
#[derive(Debug)]
pub enum Refused {
    /// The Register was refused (the node's own error: its name, its
    /// certificate, its registration): the stream's other nodes go on.
    Node(Status),
    /// The core has stopped (shutdown, step-down): the stream ends.
    Stopped(Status),
}

impl Refused {
    /// The status, whichever it is.
    pub fn into_status(self) -> Status {
        match self {
            Refused::Node(s) | Refused::Stopped(s) => s,
        }
    }
}

impl Session {
    /// Check `register` (its name; with `require_cert`, that `peer_certs`'
    /// certificate names the node) and ask the core to attach the node,
    /// its messages to go out through `tx`. The core applies it in the
    /// order of the stream's commands; await [`Opening::attached`] before
    /// sending any of the node's messages.
    pub fn open(
        core: &CoreHandle,
        register: Box<Register>,
        tx: AgentTx,
        peer_certs: Option<&[CertificateDer<'static>]>,
        require_cert: bool,
    ) -> Result<Opening, Refused> {
        if register.node.len() > MAX_NODE_NAME_BYTES {
            return Err(Refused::Node(Status::invalid_argument(format!(
                "register.node: {} bytes, at most {MAX_NODE_NAME_BYTES}",
                register.node.len()
            ))));
        }
        if require_cert {
            let node = register.node.as_str();
            crate::tls::authorize_agent(peer_certs, node)
                .inspect_err(|status| tracing::warn!(%node, %status, "agent refused"))
                .map_err(Refused::Node)?;
        }
        core.ask(|reply| Command::Attach {
            register,
            tx,
            reply,
        })
        .map(Opening)
        .map_err(Refused::Stopped)
    }

    /// The node's name.
    pub fn node(&self) -> &str {
        &self.reporter.beat().node
    }

    /// The core's session number.
    pub fn id(&self) -> u64 {
        self.reporter.beat().session()
    }

    /// Whether the core ended the session by itself (the node registered
    /// again elsewhere): its reader may drop it without a Detach.
    pub fn ended_by_core(&self) -> bool {
        self.reporter.beat().is_ended()
    }

    /// A message of the node's arrived at `now_ms` (`None`: an empty
    /// one, which still says the node is alive): a LoadReport goes to
    /// its beat (packed in the reader's `scratch`), the rest to the core
    /// as a command, in order.
    pub fn handle(
        &mut self,
        core: &CoreHandle,
        msg: Option<agent_message::Msg>,
        now_ms: i64,
        scratch: &mut Vec<u8>,
    ) {
        self.reporter.alive(now_ms);
        match msg {
            Some(agent_message::Msg::Load(report)) => {
                core.report(&mut self.reporter, report, now_ms, scratch)
            }
            Some(msg) => core.send(Command::FromAgent {
                node: self.node().to_string(),
                session: self.id(),
                msg,
            }),
            None => {}
        }
    }

    /// The session ends: the node is disconnected, as when its stream
    /// breaks (its lease runs out, then its jobs are retried elsewhere).
    pub fn close(self, core: &CoreHandle) {
        core.send(Command::Detach {
            node: self.node().to_string(),
            session: self.id(),
        });
    }
}

impl Opening {
    /// The session, once the core attached the node (its Registered is
    /// queued on the stream before this returns).
    pub async fn attached(mut self, core: &CoreHandle) -> Result<Session, Refused> {
        std::future::poll_fn(|cx| self.poll_attached(cx, core)).await
    }

    /// [`Self::attached`], polled (ready once: not to be polled again).
    pub fn poll_attached(
        &mut self,
        cx: &mut std::task::Context<'_>,
        core: &CoreHandle,
    ) -> std::task::Poll<Result<Session, Refused>> {
        self.0.poll_reply(cx).map(|r| match r {
            Ok(Ok((_session, beat))) => Ok(Session {
                reporter: core.reporter(beat),
            }),
            Ok(Err(status)) => Err(Refused::Node(status)),
            Err(stopped) => Err(Refused::Stopped(stopped)),
        })
    }
}
