//! An agent stream's outbound queue: the messages the core sends an
//! attached agent (Registered, Assign, Cancel, Steal, Lease, LogRequest,
//! and the status that ends the stream), read by the stream's response
//! body in [`crate::server`].
//!
//! The queue is unbounded (the core never waits for an agent) and holds
//! each message boxed, in a linked queue (futures-channel's): an idle
//! queue is its shared state and an empty stub node, about 100 bytes, and
//! a message costs a node and its box while it is queued. A tokio mpsc
//! channel allocates its slots 32 at a time, in blocks sized by the
//! element type, and the first block comes with the channel: with
//! `Result<DispatcherMessage, Status>` inline that block was 13 KB for
//! every attached agent, boxed 512 bytes, and with the channel's own
//! state 800 bytes per agent, idle.
//!
//! The core queues a plain job's `Assign` as the job's shared record
//! ([`ToAgent::Assign`], [`AgentTx::send_to_agent`]); the proto is built
//! where the stream reads it, on the stream's task: the core thread, the
//! dispatcher's bottleneck, does not write the id and the owner at every
//! start. The spec is not copied at all: the proto's `Assign` shares the
//! record's (`proto::assign::SharedSpec`).
//!
//! An AttachMany stream (a relay's, many nodes) has one queue for all its
//! nodes: each node's [`AgentTx`] is a clone of the stream's sender
//! tagged with the node's slot ([`AgentTx::for_slot`]), no allocation of
//! its own, and the stream's response body turns the queue into
//! `RelayReply` frames ([`AgentRx::into_relay_stream`]), every message
//! ready at once in one frame.

use std::collections::HashMap;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures_channel::mpsc;
use proto::v1::{
    DispatcherMessage, NodeReply, RelayReply, SessionEnded, dispatcher_message, node_reply,
};
use tokio_stream::{Stream, StreamExt};
use tonic::Status;

use crate::cluster::ToAgent;

/// What the stream carries: a message, or the status that ends it.
pub type Item = Result<DispatcherMessage, Status>;

/// The slot of a queue's whole stream: an Attach stream's one node, or
/// an AttachMany stream itself (its `Err` ends the stream).
pub const STREAM: u32 = u32::MAX;

/// An item and whose it is: the node's slot and the core's session of
/// it (0: none yet, or not known to the sender).
#[derive(Debug)]
struct Tagged {
    slot: u32,
    session: u64,
    item: Queued,
}

/// At most this many node messages in one RelayReply frame.
pub const MAX_REPLIES_PER_FRAME: usize = 1024;

/// A RelayReply frame takes no more messages once it is this large
/// (encoded): the stream's encode buffer grows to its largest frame and
/// keeps that size for the stream's life, so frames stay small however
/// many nodes' messages are ready (a single larger message goes alone).
pub const MAX_FRAME_BYTES: usize = 64 << 10;

/// The stream ended: its agent went away (or the stream was replaced).
#[derive(Debug, thiserror::Error)]
#[error("the agent's stream has ended")]
pub struct Closed;

/// What the queue holds: an item, or a cluster message with the trace
/// context its `Assign` carries, built into the item when it is read.
#[derive(Debug)]
enum Queued {
    Item(Item),
    Agent(ToAgent, Option<HashMap<String, String>>),
}

impl Queued {
    fn into_item(self) -> Item {
        match self {
            Queued::Item(item) => item,
            Queued::Agent(msg, carrier) => {
                let mut msg = msg.into_message();
                if let Some(carrier) = carrier
                    && let Some(dispatcher_message::Msg::Assign(a)) = msg.msg.as_mut()
                {
                    a.trace_context = carrier;
                }
                Ok(msg)
            }
        }
    }
}

/// The core's end of one agent's outbound queue (of one node's slot on
/// an AttachMany stream's queue).
#[derive(Clone, Debug)]
pub struct AgentTx {
    tx: mpsc::UnboundedSender<Box<Tagged>>,
    slot: u32,
    session: u64,
}

/// The stream's end of the queue.
#[derive(Debug)]
pub struct AgentRx(mpsc::UnboundedReceiver<Box<Tagged>>);

/// A new queue.
pub fn channel() -> (AgentTx, AgentRx) {
    let (tx, rx) = mpsc::unbounded();
    (
        AgentTx {
            tx,
            slot: STREAM,
            session: 0,
        },
        AgentRx(rx),
    )
}

impl AgentTx {
    /// Queue `item` for the agent; [`Closed`] once its stream has ended.
    pub fn send(&self, item: Item) -> Result<(), Closed> {
        self.tx
            .unbounded_send(Box::new(Tagged {
                slot: self.slot,
                session: self.session,
                item: Queued::Item(item),
            }))
            .map_err(|_| Closed)
    }

    /// Queue a cluster message; an `Assign` gets `trace_context` (when
    /// given) as it is built, on the stream's side.
    pub fn send_to_agent(
        &self,
        msg: ToAgent,
        trace_context: Option<HashMap<String, String>>,
    ) -> Result<(), Closed> {
        self.tx
            .unbounded_send(Box::new(Tagged {
                slot: self.slot,
                session: self.session,
                item: Queued::Agent(msg, trace_context),
            }))
            .map_err(|_| Closed)
    }

    /// The sender of node `slot` on this (AttachMany) stream's queue: what
    /// it sends reaches the relay tagged with the slot, and an `Err` ends
    /// only that node's session (`NodeReply.ended`).
    pub fn for_slot(&self, slot: u32) -> AgentTx {
        AgentTx {
            tx: self.tx.clone(),
            slot,
            session: 0,
        }
    }

    /// This sender, its messages tagged with the core's `session` of the
    /// node. On an AttachMany stream a session's messages reach the relay
    /// only from its Registered to its end: what a batch stored late
    /// still sends to a session that has ended is dropped, so it never
    /// reaches a node registered on the slot since.
    pub fn in_session(self, session: u64) -> AgentTx {
        AgentTx { session, ..self }
    }

    /// The slot this sender tags ([`STREAM`] for the whole stream).
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// The core's session this sender tags (0: none).
    pub fn session(&self) -> u64 {
        self.session
    }
}

impl AgentRx {
    /// The next queued item (None once every sender is gone).
    pub async fn recv(&mut self) -> Option<Item> {
        self.0.next().await.map(|t| t.item.into_item())
    }

    /// The next queued item and its slot.
    pub async fn recv_tagged(&mut self) -> Option<(u32, Item)> {
        self.0.next().await.map(|t| (t.slot, t.item.into_item()))
    }

    /// The queue as an Attach stream's response body.
    pub fn into_stream(self) -> impl Stream<Item = Item> + Send + 'static {
        self.0.map(|t| t.item.into_item())
    }

    /// The queue as an AttachMany stream's response body: each frame holds
    /// every node message ready (up to [`MAX_REPLIES_PER_FRAME`]), a
    /// node's `Err` becomes its `ended`, and an `Err` of [`STREAM`] ends
    /// the stream (after the frame before it).
    pub fn into_relay_stream(
        self,
    ) -> impl Stream<Item = Result<RelayReply, Status>> + Send + 'static {
        RelayFrames {
            rx: self.0,
            live: Vec::new(),
            end: None,
            done: false,
        }
    }
}

/// One node's queued item as the relay's reply.
fn node_reply(slot: u32, item: Item) -> NodeReply {
    let msg = match item {
        Ok(m) => node_reply::Msg::Message(m),
        Err(status) => node_reply::Msg::Ended(SessionEnded {
            code: status.code() as i32,
            message: status.message().to_string(),
        }),
    };
    NodeReply {
        slot,
        msg: Some(msg),
    }
}

/// [`AgentRx::into_relay_stream`].
struct RelayFrames {
    rx: mpsc::UnboundedReceiver<Box<Tagged>>,
    /// Per slot, the session whose messages pass (0: none): set by its
    /// Registered, cleared by its end.
    live: Vec<u64>,
    /// The stream's ending status, held while the frame before it goes.
    end: Option<Status>,
    done: bool,
}

impl RelayFrames {
    /// Whether a node's item reaches the relay: a Registered opens its
    /// session on the slot, the session's messages pass while it is the
    /// slot's, its end passes once (and closes it); an end of no session
    /// (a refused Register, a protocol error on a free slot) passes.
    fn passes(&mut self, slot: u32, session: u64, item: &Item) -> bool {
        let i = slot as usize;
        if self.live.len() <= i {
            self.live.resize(i + 1, 0);
        }
        let live = &mut self.live[i];
        match item {
            Ok(DispatcherMessage {
                msg: Some(dispatcher_message::Msg::Registered(_)),
            }) => {
                *live = session;
                true
            }
            Ok(_) => session != 0 && *live == session,
            Err(_) if session == 0 => true,
            Err(_) if *live == session => {
                *live = 0;
                true
            }
            Err(_) => false,
        }
    }
}

impl Stream for RelayFrames {
    type Item = Result<RelayReply, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.done {
            return Poll::Ready(None);
        }
        if let Some(status) = self.end.take() {
            self.done = true;
            return Poll::Ready(Some(Err(status)));
        }
        let mut frame = RelayReply::default();
        let mut bytes = 0;
        while frame.nodes.len() < MAX_REPLIES_PER_FRAME && bytes < MAX_FRAME_BYTES {
            match Pin::new(&mut self.rx).poll_next(cx) {
                Poll::Ready(Some(t)) => {
                    let Tagged {
                        slot,
                        session,
                        item,
                    } = *t;
                    let item = item.into_item();
                    match (slot, item) {
                        (STREAM, Err(status)) => {
                            if frame.nodes.is_empty() {
                                self.done = true;
                                return Poll::Ready(Some(Err(status)));
                            }
                            self.end = Some(status);
                            break;
                        }
                        // Nothing addresses the stream itself but its end.
                        (STREAM, Ok(_)) => {}
                        (slot, item) => {
                            if self.passes(slot, session, &item) {
                                let reply = node_reply(slot, item);
                                bytes += prost::Message::encoded_len(&reply) + 4;
                                frame.nodes.push(reply);
                            }
                        }
                    }
                }
                Poll::Ready(None) => {
                    if frame.nodes.is_empty() {
                        self.done = true;
                        return Poll::Ready(None);
                    }
                    break;
                }
                Poll::Pending => {
                    if frame.nodes.is_empty() {
                        return Poll::Pending;
                    }
                    break;
                }
            }
        }
        Poll::Ready(Some(Ok(frame)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::v1::{Registered, dispatcher_message};
    use tokio_stream::StreamExt;

    #[tokio::test]
    async fn messages_and_the_ending_status_arrive_in_order() {
        let (tx, rx) = channel();
        let hello = DispatcherMessage {
            msg: Some(dispatcher_message::Msg::Registered(Registered::default())),
        };
        tx.send(Ok(hello.clone())).unwrap();
        tx.send(Err(Status::aborted("replaced"))).unwrap();
        drop(tx);
        let got: Vec<Item> = rx.into_stream().collect().await;
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].as_ref().unwrap(), &hello);
        assert_eq!(got[1].as_ref().unwrap_err().message(), "replaced");
    }

    /// A job's `Assign` queued as its record is built where it is read,
    /// with the trace context the core gave it; other messages keep
    /// theirs.
    #[tokio::test]
    async fn an_assign_is_built_from_its_record_with_its_trace_context() {
        use crate::cluster::JobKey;
        use crate::record::JobRecord;
        use proto::v1::{Assign, JobSpec};
        use std::sync::Arc;
        let spec = JobSpec {
            command: vec!["true".into()],
            cpus: 3,
            ..Default::default()
        };
        let Some(key) = JobKey::parse("j-7") else {
            panic!("a job key");
        };
        let job = Arc::new(JobRecord::new(
            key,
            Arc::new(spec.clone()),
            "bob".into(),
            0,
            1,
        ));
        let carrier: HashMap<String, String> = [("traceparent".into(), "00-ab".into())].into();
        let (tx, mut rx) = channel();
        tx.send_to_agent(ToAgent::Assign(job.clone()), Some(carrier.clone()))
            .unwrap();
        tx.send_to_agent(ToAgent::Assign(job), None).unwrap();
        let lease = DispatcherMessage {
            msg: Some(dispatcher_message::Msg::Lease(proto::v1::Lease {
                seq: 4,
                lease_ms: 9,
            })),
        };
        tx.send_to_agent(ToAgent::Msg(lease.clone()), Some(carrier.clone()))
            .unwrap();
        let want = Assign {
            job_id: "j-7".into(),
            attempt: 1,
            spec: Some(spec.into()),
            owner: "bob".into(),
            trace_context: carrier,
        };
        let got = rx.recv().await.unwrap().unwrap();
        assert_eq!(got.msg, Some(dispatcher_message::Msg::Assign(want.clone())));
        let got = rx.recv().await.unwrap().unwrap();
        let untraced = Assign {
            trace_context: HashMap::new(),
            ..want
        };
        assert_eq!(got.msg, Some(dispatcher_message::Msg::Assign(untraced)));
        assert_eq!(rx.recv().await.unwrap().unwrap(), lease);
    }

    fn lease(seq: u64) -> DispatcherMessage {
        DispatcherMessage {
            msg: Some(dispatcher_message::Msg::Lease(proto::v1::Lease {
                seq,
                lease_ms: 1,
            })),
        }
    }

    #[tokio::test]
    async fn a_relay_frame_holds_every_ready_message_tagged_with_its_slot() {
        let (stream, rx) = channel();
        let (a, b) = (
            stream.for_slot(0).in_session(1),
            stream.for_slot(7).in_session(2),
        );
        a.send(Ok(registered())).unwrap();
        b.send(Ok(registered())).unwrap();
        a.send(Ok(lease(1))).unwrap();
        b.send(Ok(lease(2))).unwrap();
        b.send(Err(Status::aborted("replaced"))).unwrap();
        a.send(Ok(lease(3))).unwrap();
        // The stream's own end comes after the frame before it.
        stream.send(Err(Status::unavailable("stopping"))).unwrap();
        b.send(Ok(lease(4))).unwrap();
        drop((stream, a, b));
        let got: Vec<_> = rx.into_relay_stream().collect().await;
        assert_eq!(got.len(), 2, "{got:?}");
        let frame = got[0].as_ref().unwrap();
        let slots: Vec<u32> = frame.nodes.iter().map(|n| n.slot).collect();
        assert_eq!(slots, [0, 7, 0, 7, 7, 0]);
        assert_eq!(frame.nodes[3].msg, Some(node_reply::Msg::Message(lease(2))));
        assert_eq!(
            frame.nodes[4].msg,
            Some(node_reply::Msg::Ended(SessionEnded {
                code: tonic::Code::Aborted as i32,
                message: "replaced".into(),
            }))
        );
        let end = got[1].as_ref().unwrap_err();
        assert_eq!(end.code(), tonic::Code::Unavailable);
    }

    fn registered() -> DispatcherMessage {
        DispatcherMessage {
            msg: Some(dispatcher_message::Msg::Registered(Registered::default())),
        }
    }

    #[tokio::test]
    async fn an_ended_sessions_late_messages_never_reach_the_slots_next_node() {
        let (stream, rx) = channel();
        let old = stream.for_slot(3).in_session(10);
        old.send(Ok(registered())).unwrap();
        old.send(Ok(lease(1))).unwrap();
        // The relay detached it (the reader's end, tagged with its
        // session), then registered another node on the slot.
        old.send(Err(Status::cancelled("detached"))).unwrap();
        old.send(Ok(lease(2))).unwrap();
        let new = stream.for_slot(3).in_session(11);
        new.send(Ok(registered())).unwrap();
        // A batch stored late still sends to the old session.
        old.send(Ok(lease(3))).unwrap();
        old.send(Err(Status::aborted("late end"))).unwrap();
        new.send(Ok(lease(4))).unwrap();
        // A refused Register on a free slot (no session) passes.
        stream
            .for_slot(4)
            .send(Err(Status::invalid_argument("nodes[0].slot")))
            .unwrap();
        drop((stream, old, new));
        let got: Vec<_> = rx.into_relay_stream().collect().await;
        let nodes = &got[0].as_ref().unwrap().nodes;
        let seen: Vec<(u32, String)> = nodes
            .iter()
            .map(|n| {
                let what = match &n.msg {
                    Some(node_reply::Msg::Message(m)) => match &m.msg {
                        Some(dispatcher_message::Msg::Lease(l)) => format!("lease {}", l.seq),
                        Some(dispatcher_message::Msg::Registered(_)) => "registered".into(),
                        other => format!("{other:?}"),
                    },
                    Some(node_reply::Msg::Ended(e)) => format!("ended {}", e.message),
                    None => "none".into(),
                };
                (n.slot, what)
            })
            .collect();
        let want: Vec<(u32, String)> = [
            (3, "registered"),
            (3, "lease 1"),
            (3, "ended detached"),
            (3, "registered"),
            (3, "lease 4"),
            (4, "ended nodes[0].slot"),
        ]
        .into_iter()
        .map(|(s, w)| (s, w.to_string()))
        .collect();
        assert_eq!(seen, want);
    }

    #[tokio::test]
    async fn a_relay_frame_is_cut_at_its_limit() {
        let (stream, rx) = channel();
        let a = stream.for_slot(1).in_session(1);
        a.send(Ok(registered())).unwrap();
        for i in 0..MAX_REPLIES_PER_FRAME + 5 {
            a.send(Ok(lease(i as u64))).unwrap();
        }
        drop((stream, a));
        let sizes: Vec<usize> = rx
            .into_relay_stream()
            .map(|f| f.unwrap().nodes.len())
            .collect()
            .await;
        assert_eq!(sizes, [MAX_REPLIES_PER_FRAME, 6]);
    }

    #[tokio::test]
    async fn a_relay_frame_is_cut_at_its_size() {
        let (stream, rx) = channel();
        let a = stream.for_slot(1).in_session(1);
        a.send(Ok(registered())).unwrap();
        // Cancels of 1 KiB job ids: 64 KiB in about 64 of them.
        for i in 0..100 {
            a.send(Ok(DispatcherMessage {
                msg: Some(dispatcher_message::Msg::Cancel(proto::v1::Cancel {
                    job_id: format!("{i:01024}"),
                    attempt: 1,
                })),
            }))
            .unwrap();
        }
        drop((stream, a));
        let frames: Vec<RelayReply> = rx.into_relay_stream().map(|f| f.unwrap()).collect().await;
        assert_eq!(frames.iter().map(|f| f.nodes.len()).sum::<usize>(), 101);
        for f in &frames {
            let size = prost::Message::encoded_len(f);
            assert!(size < MAX_FRAME_BYTES + 1100, "a frame of {size} bytes");
        }
        assert!(frames.len() >= 2, "{} frames", frames.len());
    }

    #[tokio::test]
    async fn sending_to_an_ended_stream_is_an_error() {
        let (tx, mut rx) = channel();
        tx.send(Err(Status::cancelled("x"))).unwrap();
        assert!(rx.recv().await.unwrap().is_err());
        drop(rx);
        assert!(tx.send(Err(Status::cancelled("y"))).is_err());
    }
}
