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

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, VecDeque};
    use std::time::Duration;

    use proto::v1::{
        DispatcherMessage, JobSpec, LoadReport, NodeReply, Register, RelayReply,
        dispatcher_message, node_reply,
    };
    use sched::Topology;

    use super::*;
    use crate::cluster::{Cluster, ClusterConfig};
    use crate::core::{Command, CoreExit, OnStoreFailure, spawn};
    use crate::observe::Observers;
    use crate::store::embedded::EmbeddedStore;

    fn register(node: &str) -> Register {
        Register {
            node: node.into(),
            topology: Some(engine_proto::topology(
                &Topology::from_spec("1s:2c:1t").unwrap(),
            )),
            ..Default::default()
        }
    }

    fn msg(slot: u32, m: agent_message::Msg) -> NodeMessage {
        NodeMessage {
            slot,
            msg: Some(node_message::Msg::Message(AgentMessage { msg: Some(m) })),
        }
    }

    fn reg(slot: u32, node: &str) -> NodeMessage {
        msg(slot, agent_message::Msg::Register(register(node)))
    }

    fn load(slot: u32, seq: u64) -> NodeMessage {
        msg(
            slot,
            agent_message::Msg::Load(LoadReport {
                load: Some(Default::default()),
                seq,
            }),
        )
    }

    fn detach(slot: u32) -> NodeMessage {
        NodeMessage {
            slot,
            msg: Some(node_message::Msg::Detach(proto::v1::Detach {})),
        }
    }

    fn frame(nodes: Vec<NodeMessage>) -> RelayMessage {
        RelayMessage { nodes }
    }

    /// The relay's side: the replies, one node message at a time.
    struct Replies {
        frames: std::pin::Pin<Box<dyn Stream<Item = Result<RelayReply, Status>> + Send>>,
        buf: VecDeque<NodeReply>,
    }

    impl Replies {
        async fn next(&mut self) -> (u32, node_reply::Msg) {
            loop {
                if let Some(r) = self.buf.pop_front() {
                    return (r.slot, r.msg.unwrap());
                }
                let f = tokio::time::timeout(Duration::from_secs(5), self.frames.next())
                    .await
                    .expect("a reply within 5 s")
                    .expect("the stream goes on")
                    .expect("a frame, not the stream's end");
                self.buf.extend(f.nodes);
            }
        }

        /// The next reply of `slot` that is not a Lease (others' skipped).
        async fn next_of(&mut self, slot: u32) -> node_reply::Msg {
            loop {
                let (s, m) = self.next().await;
                let lease = matches!(
                    &m,
                    node_reply::Msg::Message(DispatcherMessage {
                        msg: Some(dispatcher_message::Msg::Lease(_))
                    })
                );
                if s == slot && !lease {
                    return m;
                }
            }
        }

        async fn lease_of(&mut self, slot: u32) -> u64 {
            loop {
                if let (s, node_reply::Msg::Message(m)) = self.next().await
                    && s == slot
                    && let Some(dispatcher_message::Msg::Lease(l)) = m.msg
                {
                    return l.seq;
                }
            }
        }
    }

    fn ended(m: &node_reply::Msg) -> Option<(tonic::Code, String)> {
        match m {
            node_reply::Msg::Ended(e) => Some((tonic::Code::from(e.code), e.message.clone())),
            _ => None,
        }
    }

    fn is_registered(m: &node_reply::Msg) -> bool {
        matches!(
            m,
            node_reply::Msg::Message(DispatcherMessage {
                msg: Some(dispatcher_message::Msg::Registered(_))
            })
        )
    }

    fn setup(
        dir: &std::path::Path,
    ) -> (
        CoreHandle,
        std::thread::JoinHandle<CoreExit>,
        Relay,
        Replies,
    ) {
        let store = EmbeddedStore::open(dir).unwrap();
        let (core, thread) = spawn(
            Cluster::new(ClusterConfig::default()),
            Box::new(store),
            OnStoreFailure::Stop,
            Observers::none(),
        );
        let (tx, rx) = crate::outbound::channel();
        let relay = Relay::new(core.clone(), tx, None, false);
        let replies = Replies {
            frames: Box::pin(rx.into_relay_stream()),
            buf: VecDeque::new(),
        };
        (core, thread, relay, replies)
    }

    /// Each node's messages reach its own session and the core's answers
    /// come back on its slot: Registered, the lease of its own report,
    /// and an Assign on the slot of the node the job was placed on.
    #[tokio::test]
    async fn each_slots_messages_reach_its_node_and_its_answers_its_slot() {
        let dir = tempfile::tempdir().unwrap();
        let (core, thread, mut relay, mut replies) = setup(dir.path());
        relay
            .frame(frame(vec![reg(0, "a"), reg(5, "b"), reg(2, "c")]))
            .await
            .unwrap();
        assert_eq!(relay.live(), 3);
        let mut slot_of = HashMap::new();
        for (slot, node) in [(0, "a"), (5, "b"), (2, "c")] {
            assert!(is_registered(&replies.next_of(slot).await));
            slot_of.insert(node.to_string(), slot);
        }
        // Leases per node: each report's seq answered on its own slot.
        relay
            .frame(frame(vec![load(0, 10), load(5, 50), load(2, 20)]))
            .await
            .unwrap();
        let mut leases = HashMap::new();
        for _ in 0..3 {
            if let (s, node_reply::Msg::Message(m)) = replies.next().await
                && let Some(dispatcher_message::Msg::Lease(l)) = m.msg
            {
                leases.insert(s, l.seq);
            }
        }
        assert_eq!(leases, HashMap::from([(0, 10), (5, 50), (2, 20)]));
        // A job: its Assign comes on the slot of the node it was placed on.
        let jobs = core
            .call(|reply| Command::Submit {
                specs: vec![JobSpec {
                    command: vec!["true".into()],
                    cpus: 1,
                    ..Default::default()
                }],
                batch: false,
                trace_context: HashMap::new(),
                owner: String::new(),
                reply,
            })
            .await
            .unwrap();
        let id = jobs[0].id();
        let (slot, m) = replies.next().await;
        let node_reply::Msg::Message(DispatcherMessage {
            msg: Some(dispatcher_message::Msg::Assign(a)),
        }) = m
        else {
            panic!("not an Assign: {m:?}");
        };
        assert_eq!(a.job_id, id);
        let job = core.call(|reply| Command::Get { id, reply }).await.unwrap();
        assert_eq!(
            slot_of[&job.node], slot,
            "the Assign of {job:?} came on slot {slot}"
        );
        core.send(Command::Shutdown);
        assert!(matches!(thread.join().unwrap(), CoreExit::Shutdown));
    }

    /// Bad input ends only the slot at fault, naming the field; the
    /// stream's other nodes keep their sessions and leases.
    #[tokio::test]
    async fn bad_input_ends_only_its_slot() {
        let dir = tempfile::tempdir().unwrap();
        let (core, thread, mut relay, mut replies) = setup(dir.path());
        relay
            .frame(frame(vec![reg(0, "a"), reg(1, "b")]))
            .await
            .unwrap();
        assert!(is_registered(&replies.next_of(0).await));
        assert!(is_registered(&replies.next_of(1).await));
        // A slot over the limit, a message on a slot with no node, a name
        // too long, a Register on a live slot.
        relay
            .frame(frame(vec![
                load(MAX_SLOTS, 1),
                load(7, 1),
                reg(3, &"x".repeat(300)),
                reg(0, "a2"),
            ]))
            .await
            .unwrap();
        let (code, m) = ended(&replies.next_of(MAX_SLOTS).await).unwrap();
        assert_eq!(code, tonic::Code::InvalidArgument);
        assert_eq!(m, "nodes[0].slot: 65536, at most 65535");
        let (code, m) = ended(&replies.next_of(7).await).unwrap();
        assert_eq!(code, tonic::Code::InvalidArgument);
        assert!(m.starts_with("nodes[1].slot: 7 has no node"), "{m}");
        let (code, m) = ended(&replies.next_of(3).await).unwrap();
        assert_eq!(code, tonic::Code::InvalidArgument);
        assert_eq!(m, "nodes[2].message: register.node: 300 bytes, at most 253");
        let (code, m) = ended(&replies.next_of(0).await).unwrap();
        assert_eq!(code, tonic::Code::InvalidArgument);
        assert!(
            m.contains("Register on slot 0, in use by node \"a\""),
            "{m}"
        );
        // Slot 0's node is gone (a message there has no node), slot 1's
        // goes on: its report is answered with its lease.
        relay
            .frame(frame(vec![load(0, 3), load(1, 4)]))
            .await
            .unwrap();
        assert!(ended(&replies.next_of(0).await).is_some());
        assert_eq!(replies.lease_of(1).await, 4);
        assert_eq!(relay.live(), 1);
        // Detach: answered CANCELLED; the slot takes a new node.
        relay
            .frame(frame(vec![detach(1), reg(1, "c")]))
            .await
            .unwrap();
        let (code, m) = ended(&replies.next_of(1).await).unwrap();
        assert_eq!(
            (code, m.as_str()),
            (tonic::Code::Cancelled, "node b: detached by the relay")
        );
        assert!(is_registered(&replies.next_of(1).await));
        relay.frame(frame(vec![load(1, 9)])).await.unwrap();
        assert_eq!(replies.lease_of(1).await, 9);
        // The node registering on another slot ends its first session
        // (aborted, as an Attach stream replaced); the slot is then free
        // for a Register without an error.
        relay.frame(frame(vec![reg(4, "c")])).await.unwrap();
        // (Registered first: the core answers the new session, then ends
        // the old.)
        assert!(is_registered(&replies.next_of(4).await));
        let (code, _) = ended(&replies.next_of(1).await).unwrap();
        assert_eq!(code, tonic::Code::Aborted);
        relay.frame(frame(vec![reg(1, "d")])).await.unwrap();
        assert!(is_registered(&replies.next_of(1).await));
        assert_eq!(relay.live(), 2);
        core.send(Command::Shutdown);
        assert!(matches!(thread.join().unwrap(), CoreExit::Shutdown));
    }
}
