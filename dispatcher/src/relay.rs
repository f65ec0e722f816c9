//! AttachMany: one stream carrying many nodes (a relay's, e.g. one per
//! rack), read by one task that dispatches each node's messages by slot
//! to that node's [`Session`], exactly as an Attach stream's reader does
//! for its one node. The answers go out through the stream's one queue,
//! each tagged with its slot ([`crate::outbound`]).
//!
//! Per node the stream keeps only its slot (24 bytes): free, a Register
//! awaiting the core (boxed), or the live [`Session`] (the node's beat
//! and last load, shared with the core). No task, channel or buffer per
//! node.
//!
//! A Register is sent to the core as it is read and its answer (after the
//! batch's commit) is awaited beside the stream, not in its way: the
//! other nodes' messages go on meanwhile. What the registering node sends
//! before its answer is held on its slot (the only per-node buffer, for
//! that moment) and handled, in order, once it is attached.
//!
//! Bad input on a slot ends that slot only (`NodeReply.ended`, naming
//! the field): a slot at or over [`MAX_SLOTS`], a message on a slot with
//! no node, a Register on a slot whose node is live (which also ends that
//! node's session). What ends the whole stream: the stream breaks or
//! cannot be decoded, or the core stops; every node on it is then
//! disconnected, each as a lost Attach stream.

use std::sync::Arc;
use std::task::{Context, Poll};

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

/// Registers of one stream awaiting the core's answer before the stream
/// reads its next frame. Each holds its decoded message, and what its
/// node sent meanwhile (its first LoadReport), ~4 KB, until the core has
/// it: without a bound a relay that attaches thousands of nodes at once
/// has them all decoded and waiting on the core at once, and the
/// allocator's pages they filled stay resident under the long-lived
/// records allocated among them (RSS ~2x the heap per relayed node).
/// The bound leaves a frame's worth and more in flight, which is all the
/// core's batched commit takes at a time.
const MAX_OPENING: usize = 128;

/// A slot of the stream: 24 bytes (the live session's two pointers and
/// the tag; an opening slot's state is boxed, for the moment it lasts).
#[derive(Default)]
enum Slot {
    /// No node.
    #[default]
    Free,
    /// Its Register is with the core.
    Opening(Box<Registering>),
    /// A node's session.
    Live(Session),
}

/// A slot whose Register is with the core: what the relay sent for the
/// slot since waits here, in order, with its index in its frame.
struct Registering {
    opening: Opening,
    /// The Register's index in its frame.
    i: usize,
    held: Vec<(usize, node_message::Msg)>,
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
    /// The slots whose Register awaits the core's answer.
    opening: Vec<u32>,
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
            tokio::select! {
                // With MAX_OPENING Registers awaiting the core, the
                // next frame waits for their answers.
                msg = inbound.next(), if self.opening.len() < MAX_OPENING => match msg {
                    Some(Ok(frame)) => {
                        if let Err(status) = self.frame(frame) {
                            break Some(status);
                        }
                    }
                    Some(Err(status)) => {
                        tracing::info!(%status, "relay stream error");
                        break Some(crate::session::inbound_error(&status));
                    }
                    None => break None,
                },
                opened = std::future::poll_fn(|cx| self.poll_openings(cx)) => {
                    if let Err(status) = opened {
                        break Some(status);
                    }
                }
            }
        };
        if let Some(status) = end {
            let _ = self.tx.send(Err(crate::session::bounded(status)));
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
    pub fn frame(&mut self, frame: RelayMessage) -> Result<(), Status> {
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
            match msg {
                Some(msg) => self.node_message(i, slot, msg, now)?,
                // An empty message: the node is alive.
                None => {
                    if let Slot::Live(session) = &mut self.slots[s] {
                        session.handle(&self.core, None, now, &mut self.scratch);
                    }
                }
            }
        }
        Ok(())
    }

    /// The frame's `i`th message, for `slot` (within the table).
    fn node_message(
        &mut self,
        i: usize,
        slot: u32,
        msg: node_message::Msg,
        now: i64,
    ) -> Result<(), Status> {
        let s = slot as usize;
        if let Slot::Opening(r) = &mut self.slots[s] {
            r.held.push((i, msg));
            return Ok(());
        }
        match msg {
            node_message::Msg::Detach(_) => self.detach(slot),
            node_message::Msg::Message(AgentMessage {
                msg: Some(agent_message::Msg::Register(register)),
            }) => self.register(i, slot, register)?,
            node_message::Msg::Message(AgentMessage { msg }) => match &mut self.slots[s] {
                Slot::Live(session) => session.handle(&self.core, msg, now, &mut self.scratch),
                _ if msg.is_none() => {}
                _ => self.end_slot(
                    slot,
                    0,
                    Status::invalid_argument(format!(
                        "nodes[{i}].slot: {slot} has no node on this stream \
                         (a node's first message is Register)"
                    )),
                ),
            },
        }
        Ok(())
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
        register: Box<proto::v1::Register>,
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
                self.slots[s] = Slot::Opening(Box::new(Registering {
                    opening,
                    i,
                    held: Vec::new(),
                }));
                self.opening.push(slot);
                Ok(())
            }
            Err(Refused::Node(status)) => {
                self.end_slot(slot, 0, node_status(i, status));
                Ok(())
            }
            Err(Refused::Stopped(status)) => Err(status),
        }
    }

    /// Take the core's answers that came: each slot becomes live (and
    /// what it held is handled, in order) or free again with its refusal
    /// told. Ready when at least one came; Err: the core stopped.
    fn poll_openings(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Status>> {
        let mut done = Vec::new();
        let mut k = 0;
        while k < self.opening.len() {
            let slot = self.opening[k];
            let Slot::Opening(r) = &mut self.slots[slot as usize] else {
                self.opening.swap_remove(k);
                continue;
            };
            match r.opening.poll_attached(cx, &self.core) {
                Poll::Ready(r) => {
                    self.opening.swap_remove(k);
                    done.push((slot, r));
                }
                Poll::Pending => k += 1,
            }
        }
        if done.is_empty() {
            return Poll::Pending;
        }
        let now = now_ms();
        for (slot, r) in done {
            let Slot::Opening(registering) = std::mem::take(&mut self.slots[slot as usize]) else {
                continue;
            };
            let Registering { i, held, .. } = *registering;
            match r {
                Ok(session) => self.slots[slot as usize] = Slot::Live(session),
                Err(Refused::Node(status)) => self.end_slot(slot, 0, node_status(i, status)),
                Err(Refused::Stopped(status)) => return Poll::Ready(Err(status)),
            }
            for (i, msg) in held {
                if let Err(status) = self.node_message(i, slot, msg, now) {
                    return Poll::Ready(Err(status));
                }
            }
        }
        Poll::Ready(Ok(()))
    }

    /// Wait until no Register awaits the core's answer. Err: the core
    /// stopped.
    pub async fn settle(&mut self) -> Result<(), Status> {
        while !self.opening.is_empty() {
            std::future::poll_fn(|cx| self.poll_openings(cx)).await?;
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
        msg(slot, agent_message::Msg::Register(Box::new(register(node))))
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

    /// A frame, then every Register's answer.
    async fn feed(relay: &mut Relay, f: RelayMessage) -> Result<(), Status> {
        relay.frame(f)?;
        relay.settle().await
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

        /// The first reply (read so far or to come) that `want`s; the
        /// others stay for later.
        async fn find(&mut self, want: impl Fn(u32, &node_reply::Msg) -> bool) -> node_reply::Msg {
            loop {
                let at = self
                    .buf
                    .iter()
                    .position(|r| r.msg.as_ref().is_some_and(|m| want(r.slot, m)));
                if let Some(k) = at {
                    return self.buf.remove(k).and_then(|r| r.msg).unwrap();
                }
                let f = tokio::time::timeout(Duration::from_secs(5), self.frames.next())
                    .await
                    .expect("a reply within 5 s")
                    .expect("the stream goes on")
                    .expect("a frame, not the stream's end");
                self.buf.extend(f.nodes);
            }
        }

        /// The first reply of `slot` that is not a Lease.
        async fn next_of(&mut self, slot: u32) -> node_reply::Msg {
            self.find(|s, m| s == slot && lease(m).is_none()).await
        }

        /// The first Lease of `slot`: its seq.
        async fn lease_of(&mut self, slot: u32) -> u64 {
            let m = self.find(|s, m| s == slot && lease(m).is_some()).await;
            lease(&m).unwrap()
        }
    }

    fn lease(m: &node_reply::Msg) -> Option<u64> {
        match m {
            node_reply::Msg::Message(DispatcherMessage {
                msg: Some(dispatcher_message::Msg::Lease(l)),
            }) => Some(l.seq),
            _ => None,
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
        setup_with(EmbeddedStore::open(dir).unwrap())
    }

    /// A core on `store` and a relay attached to it, with its replies.
    fn setup_with(
        store: impl crate::store::Store,
    ) -> (
        CoreHandle,
        std::thread::JoinHandle<CoreExit>,
        Relay,
        Replies,
    ) {
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
    /// A stream's table costs 24 bytes a slot (issue 14: its nodes are
    /// most of a relayed node's bytes outside the cluster): the opening
    /// state is boxed, a live slot is the session's two pointers.
    #[test]
    fn a_slot_is_24_bytes() {
        assert_eq!(std::mem::size_of::<Slot>(), 24);
    }

    #[tokio::test]
    async fn each_slots_messages_reach_its_node_and_its_answers_its_slot() {
        let dir = tempfile::tempdir().unwrap();
        let (core, thread, mut relay, mut replies) = setup(dir.path());
        feed(
            &mut relay,
            frame(vec![reg(0, "a"), reg(5, "b"), reg(2, "c")]),
        )
        .await
        .unwrap();
        assert_eq!(relay.live(), 3);
        let mut slot_of = HashMap::new();
        for (slot, node) in [(0, "a"), (5, "b"), (2, "c")] {
            assert!(is_registered(&replies.next_of(slot).await));
            slot_of.insert(node.to_string(), slot);
        }
        // Leases per node: each report's seq answered on its own slot.
        feed(
            &mut relay,
            frame(vec![load(0, 10), load(5, 50), load(2, 20)]),
        )
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

    /// A store whose commits wait until the test opens its gate: the
    /// core's answers to Registers (sent after their commit) wait too.
    struct GatedStore {
        inner: EmbeddedStore,
        gate: Arc<(std::sync::Mutex<bool>, std::sync::Condvar)>,
    }

    impl crate::store::Store for GatedStore {
        fn load(&self) -> Result<crate::store::Snapshot, crate::store::StoreError> {
            self.inner.load()
        }

        fn commit(
            &mut self,
            writes: &[crate::store::Write],
        ) -> Result<(), crate::store::StoreError> {
            let (open, cv) = &*self.gate;
            let mut open = open.lock().unwrap();
            while !*open {
                open = cv.wait(open).unwrap();
            }
            drop(open);
            self.inner.commit(writes)
        }
    }

    /// With MAX_OPENING Registers awaiting the core, the stream's reader
    /// takes no further frame (what a relay sends waits in the
    /// transport, not decoded in the dispatcher); once the core answers
    /// it reads on and every node registers.
    #[tokio::test]
    async fn no_frame_is_read_while_max_opening_registers_await_the_core() {
        let dir = tempfile::tempdir().unwrap();
        let gate = Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new()));
        let store = GatedStore {
            inner: EmbeddedStore::open(dir.path()).unwrap(),
            gate: gate.clone(),
        };
        let (core, thread, relay, mut replies) = setup_with(store);
        let frames = 3;
        let per = MAX_OPENING as u32;
        let read = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = read.clone();
        let inbound = tokio_stream::iter((0..frames).map(move |f| {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok(frame(
                (0..per)
                    .map(|k| {
                        let slot = f * per + k;
                        reg(slot, &format!("n{slot}"))
                    })
                    .collect(),
            ))
        }))
        .chain(tokio_stream::pending());
        let served = tokio::spawn(relay.serve(inbound));
        // The first frame is read; then time for more to be, if they were.
        while read.load(std::sync::atomic::Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            read.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "frames read while {per} Registers await the core"
        );
        {
            let (open, cv) = &*gate;
            *open.lock().unwrap() = true;
            cv.notify_all();
        }
        let mut registered = std::collections::HashSet::new();
        while registered.len() < (frames * per) as usize {
            let (slot, m) = replies.next().await;
            if is_registered(&m) {
                registered.insert(slot);
            }
        }
        assert_eq!(
            read.load(std::sync::atomic::Ordering::SeqCst),
            frames as usize
        );
        served.abort();
        core.send(Command::Shutdown);
        assert!(matches!(thread.join().unwrap(), CoreExit::Shutdown));
    }

    /// What a node sends before the core answered its Register waits on
    /// its slot and is handled in order once it is attached; the other
    /// nodes' messages do not wait.
    #[tokio::test]
    async fn a_registering_nodes_messages_wait_for_its_answer_and_others_do_not() {
        let dir = tempfile::tempdir().unwrap();
        let (core, thread, mut relay, mut replies) = setup(dir.path());
        feed(&mut relay, frame(vec![reg(0, "a")])).await.unwrap();
        assert!(is_registered(&replies.next_of(0).await));
        // b registers and reports in one frame, and again in the next,
        // before its answer; a's report meanwhile is handled at once.
        relay
            .frame(frame(vec![reg(1, "b"), load(1, 11), load(0, 5)]))
            .unwrap();
        relay.frame(frame(vec![load(1, 12)])).unwrap();
        assert_eq!(relay.live(), 1, "b is not attached yet");
        assert_eq!(replies.lease_of(0).await, 5);
        relay.settle().await.unwrap();
        assert_eq!(relay.live(), 2);
        // b's Registered, then the lease of its latest held report.
        assert!(is_registered(&replies.next_of(1).await));
        assert_eq!(replies.lease_of(1).await, 12);
        // A Detach held behind a Register ends the session it opened.
        relay.frame(frame(vec![reg(2, "c"), detach(2)])).unwrap();
        relay.settle().await.unwrap();
        assert!(is_registered(&replies.next_of(2).await));
        let (code, _) = ended(&replies.next_of(2).await).unwrap();
        assert_eq!(code, tonic::Code::Cancelled);
        assert_eq!(relay.live(), 2);
        core.send(Command::Shutdown);
        assert!(matches!(thread.join().unwrap(), CoreExit::Shutdown));
    }

    /// Bad input ends only the slot at fault, naming the field; the
    /// stream's other nodes keep their sessions and leases.
    #[tokio::test]
    async fn bad_input_ends_only_its_slot() {
        let dir = tempfile::tempdir().unwrap();
        let (core, thread, mut relay, mut replies) = setup(dir.path());
        feed(&mut relay, frame(vec![reg(0, "a"), reg(1, "b")]))
            .await
            .unwrap();
        assert!(is_registered(&replies.next_of(0).await));
        assert!(is_registered(&replies.next_of(1).await));
        // A slot over the limit, a message on a slot with no node, a name
        // too long, a Register on a live slot.
        feed(
            &mut relay,
            frame(vec![
                load(MAX_SLOTS, 1),
                load(7, 1),
                reg(3, &"x".repeat(300)),
                reg(0, "a2"),
            ]),
        )
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
        feed(&mut relay, frame(vec![load(0, 3), load(1, 4)]))
            .await
            .unwrap();
        assert!(ended(&replies.next_of(0).await).is_some());
        assert_eq!(replies.lease_of(1).await, 4);
        assert_eq!(relay.live(), 1);
        // Detach: answered CANCELLED; the slot takes a new node.
        feed(&mut relay, frame(vec![detach(1), reg(1, "c")]))
            .await
            .unwrap();
        let (code, m) = ended(&replies.next_of(1).await).unwrap();
        assert_eq!(
            (code, m.as_str()),
            (tonic::Code::Cancelled, "node b: detached by the relay")
        );
        assert!(is_registered(&replies.next_of(1).await));
        feed(&mut relay, frame(vec![load(1, 9)])).await.unwrap();
        assert_eq!(replies.lease_of(1).await, 9);
        // The node registering on another slot ends its first session
        // (aborted, as an Attach stream replaced); the slot is then free
        // for a Register without an error.
        feed(&mut relay, frame(vec![reg(4, "c")])).await.unwrap();
        // (Registered first: the core answers the new session, then ends
        // the old.)
        assert!(is_registered(&replies.next_of(4).await));
        let (code, _) = ended(&replies.next_of(1).await).unwrap();
        assert_eq!(code, tonic::Code::Aborted);
        feed(&mut relay, frame(vec![reg(1, "d")])).await.unwrap();
        assert!(is_registered(&replies.next_of(1).await));
        assert_eq!(relay.live(), 2);
        core.send(Command::Shutdown);
        assert!(matches!(thread.join().unwrap(), CoreExit::Shutdown));
    }
}
