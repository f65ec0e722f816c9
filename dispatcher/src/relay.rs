//! AttachMany: one stream carrying many nodes (a relay's, e.g. one per
//! rack), read by one task that dispatches each node's messages by slot
//! to that node's [`Session`], exactly as an Attach stream's reader does
//! for its one node. The answers go out through the stream's one queue,
//! each tagged with its slot ([`crate::outbound`]).
//!
//! Per node the stream keeps only its slot: a free slot, a Register
//! awaiting the core, or the live [`Session`] (the node's beat and last
//! load, shared with the core). No task, channel or buffer per node.
//!
//! Registers are sent to the core as they are read; their answers are
//! awaited together, before the next message of a node whose Register is
//! pending and at the end of each frame, so a frame of many Registers
//! waits for one commit, not one each.
//!
//! Bad input on a slot ends that slot only (`NodeReply.ended`, naming
//! the field): a slot at or over [`MAX_SLOTS`], a message on a slot with
//! no node, a Register on a slot whose node is live (which also ends that
//! node's session). What ends the whole stream: the stream breaks or
//! cannot be decoded, or the core stops; every node on it is then
//! disconnected, each as a lost Attach stream.

use std::sync::Arc;

use proto::v1::{AgentMessage, NodeMessage, RelayMessage, agent_message, node_message};
use tokio_stream::{Stream, StreamExt};
use tonic::Status;
use tonic::transport::CertificateDer;

use crate::core::{CoreHandle, now_ms};
use crate::outbound::AgentTx;
use crate::session::{Opening, Refused, Session};

/// Slots a stream may use: `0..MAX_SLOTS`. The stream's table of nodes is
/// indexed by slot, so a relay keeps its slots small.
pub const MAX_SLOTS: u32 = 65_536;

/// A slot of the stream.
#[derive(Debug, Default)]
enum Slot {
    /// No node.
    #[default]
    Free,
    /// Its Register is with the core ([`Relay::opening`]).
    Opening,
    /// A node's session.
    Live(Session),
}

/// The reader of one AttachMany stream.
pub struct Relay {
    core: CoreHandle,
    /// The stream's queue (its [`crate::outbound::STREAM`] sender; each
    /// node's is a clone tagged with its slot).
    tx: AgentTx,
    peer_certs: Option<Arc<Vec<CertificateDer<'static>>>>,
    require_cert: bool,
    slots: Vec<Slot>,
    /// Registers sent to the core, their answers awaited by
    /// [`Relay::settle`]: (index in its frame, slot, the answer to come).
    opening: Vec<(usize, u32, Opening)>,
    /// Where LoadReports are packed to be compared (one for all nodes).
    scratch: Vec<u8>,
}

impl Relay {
    /// The reader of a stream whose answers go to `tx`; `peer_certs` and
    /// `require_cert` as for Attach (the certificate must name each node).
    pub fn new(
        core: CoreHandle,
        tx: AgentTx,
        peer_certs: Option<Arc<Vec<CertificateDer<'static>>>>,
        require_cert: bool,
    ) -> Self {
        Self {
            core,
            tx,
            peer_certs,
            require_cert,
            slots: Vec::new(),
            opening: Vec::new(),
            scratch: Vec::new(),
        }
    }

    /// Read the stream until it ends; then every node on it is
    /// disconnected.
    pub async fn serve(
        mut self,
        mut inbound: impl Stream<Item = Result<RelayMessage, Status>> + Unpin,
    ) {
        let end = loop {
            match inbound.next().await {
                Some(Ok(frame)) => {
                    if let Err(status) = self.frame(frame).await {
                        break Some(status);
                    }
                }
                Some(Err(status)) => {
                    tracing::info!(%status, "relay stream error");
                    break Some(crate::server::inbound_error(&status));
                }
                None => break None,
            }
        };
        if let Some(status) = end {
            let _ = self.tx.send(Err(crate::server::bounded(status)));
        }
        self.close_all().await;
    }

    /// The nodes with a live session (tests, measurements).
    pub fn live(&self) -> usize {
        self.slots
            .iter()
            .filter(|s| matches!(s, Slot::Live(_)))
            .count()
    }

    /// One frame of the relay's, its node messages in order. Err: the
    /// stream ends with this status (the core stopped).
    pub async fn frame(&mut self, frame: RelayMessage) -> Result<(), Status> {
        let now = now_ms();
        for (i, NodeMessage { slot, msg }) in frame.nodes.into_iter().enumerate() {
            if slot >= MAX_SLOTS {
                self.end_slot(
                    slot,
                    0,
                    Status::invalid_argument(format!(
                        "nodes[{i}].slot: {slot}, at most {}",
                        MAX_SLOTS - 1
                    )),
                );
                continue;
            }
            let s = slot as usize;
            if self.slots.len() <= s {
                self.slots.resize_with(s + 1, Slot::default);
            }
            if matches!(self.slots[s], Slot::Opening) {
                self.settle().await?;
            }
            match msg {
                Some(node_message::Msg::Detach(_)) => self.detach(slot),
                Some(node_message::Msg::Message(AgentMessage {
                    msg: Some(agent_message::Msg::Register(register)),
                })) => self.register(i, slot, register)?,
                Some(node_message::Msg::Message(AgentMessage { msg })) => {
                    match &mut self.slots[s] {
                        Slot::Live(session) => {
                            session.handle(&self.core, msg, now, &mut self.scratch)
                        }
                        _ if msg.is_none() => {}
                        _ => self.end_slot(
                            slot,
                            0,
                            Status::invalid_argument(format!(
                                "nodes[{i}].slot: {slot} has no node on this stream \
                                 (a node's first message is Register)"
                            )),
                        ),
                    }
                }
                // An empty message: the node is alive.
                None => {
                    if let Slot::Live(session) = &mut self.slots[s] {
                        session.handle(&self.core, None, now, &mut self.scratch);
                    }
                }
            }
        }
        self.settle().await
    }

    /// Tell the relay that `slot`'s session (`session`, 0 for none) ended
    /// with `status`.
    fn end_slot(&self, slot: u32, session: u64, status: Status) {
        let _ = self.tx.for_slot(slot).in_session(session).send(Err(status));
    }

    /// The relay's Detach of `slot`: its node is disconnected, as when an
    /// Attach stream breaks, and the relay is answered `ended` CANCELLED
    /// (after which nothing more of that session comes on the slot).
    fn detach(&mut self, slot: u32) {
        if let Slot::Live(session) = std::mem::take(&mut self.slots[slot as usize]) {
            self.end_slot(
                slot,
                session.id(),
                Status::cancelled(format!("node {}: detached by the relay", session.node())),
            );
            session.close(&self.core);
        }
    }

    /// A Register on `slot` (the frame's `i`th message).
    fn register(
        &mut self,
        i: usize,
        slot: u32,
        register: proto::v1::Register,
    ) -> Result<(), Status> {
        let s = slot as usize;
        if let Slot::Live(old) = std::mem::take(&mut self.slots[s]) {
            // A session the core ended by itself (its node registered
            // elsewhere) is gone already; a live one is a relay's error.
            if !old.ended_by_core() {
                let (node, id) = (old.node().to_string(), old.id());
                old.close(&self.core);
                self.end_slot(
                    slot,
                    id,
                    Status::invalid_argument(format!(
                        "nodes[{i}].slot: Register on slot {slot}, in use by node {node:?}; \
                         both refused and its session ends (Detach a slot before reusing it)"
                    )),
                );
                return Ok(());
            }
        }
        let certs = self.peer_certs.as_deref().map(Vec::as_slice);
        let tx = self.tx.for_slot(slot);
        match Session::open(&self.core, register, tx, certs, self.require_cert) {
            Ok(opening) => {
                self.slots[s] = Slot::Opening;
                self.opening.push((i, slot, opening));
                Ok(())
            }
            Err(Refused::Node(status)) => {
                self.end_slot(slot, 0, node_status(i, status));
                Ok(())
            }
            Err(Refused::Stopped(status)) => Err(status),
        }
    }

    /// Await the answers to the Registers sent: each slot becomes live,
    /// or free again with its refusal told. Err: the core stopped.
    async fn settle(&mut self) -> Result<(), Status> {
        for (i, slot, opening) in std::mem::take(&mut self.opening) {
            let s = slot as usize;
            match opening.attached(&self.core).await {
                Ok(session) => self.slots[s] = Slot::Live(session),
                Err(Refused::Node(status)) => {
                    self.slots[s] = Slot::Free;
                    self.end_slot(slot, 0, node_status(i, status));
                }
                Err(Refused::Stopped(status)) => {
                    self.slots[s] = Slot::Free;
                    return Err(status);
                }
            }
        }
        Ok(())
    }

    /// The stream ended: every node on it is disconnected.
    async fn close_all(&mut self) {
        let _ = self.settle().await;
        for slot in std::mem::take(&mut self.slots) {
            if let Slot::Live(session) = slot {
                session.close(&self.core);
            }
        }
    }
}

/// A node's refusal as told to the relay: which message it answers.
fn node_status(i: usize, status: Status) -> Status {
    Status::new(
        status.code(),
        format!("nodes[{i}].message: {}", status.message()),
    )
}
