//! `--nodes-per-stream N`: fake agents attached through an in-process
//! relay, N nodes on one `AgentService.AttachMany` stream (its own HTTP/2
//! connection), as a rack's relay would hold one stream for its nodes.
//!
//! Each fake agent's session is unchanged (`agents::session`): it sends
//! and reads `AgentMessage` / `DispatcherMessage` as on Attach, through a
//! node slot of the relay instead of a stream of its own. The relay
//! gives each node the lowest free slot, tags its messages with it, sends
//! every message ready at once as one `RelayMessage` frame, and hands each
//! `NodeReply` to its slot's session (`ended` ends that session, which
//! reconnects through the relay as it would on a broken stream). A session
//! that ends on the agent's side is detached; its slot is reused once the
//! dispatcher confirmed the Detach. When the AttachMany stream breaks,
//! every session on it ends and the relay opens a new stream.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use proto::v1::agent_service_client::AgentServiceClient;
use proto::v1::{
    AgentMessage, Detach, DispatcherMessage, NodeMessage, RelayMessage, node_message, node_reply,
};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::Status;

/// A frame takes no more messages once it is this large (encoded): the
/// dispatcher reads a stream into a buffer that keeps the size of its
/// largest frame.
const MAX_FRAME_BYTES: usize = 64 << 10;

/// What a node's session reads: the dispatcher's messages, or the status
/// its session ended with.
pub type NodeRx = mpsc::UnboundedReceiver<Result<DispatcherMessage, Status>>;

enum Slot {
    Free,
    Live {
        generation: u64,
        tx: mpsc::UnboundedSender<Result<DispatcherMessage, Status>>,
    },
    /// Detached, awaiting the dispatcher's `ended`.
    Draining {
        generation: u64,
    },
}

#[derive(Default)]
struct Slots {
    slots: Vec<Slot>,
    next_generation: u64,
}

impl Slots {
    fn live(&self, slot: u32, generation: u64) -> bool {
        matches!(self.slots.get(slot as usize), Some(Slot::Live { generation: g, .. }) if *g == generation)
    }
}

/// One relay: one AttachMany stream (reopened when it breaks).
#[derive(Clone)]
pub struct Relay {
    slots: Arc<Mutex<Slots>>,
    /// (slot, generation, message) to the stream.
    to_stream: mpsc::UnboundedSender<(u32, u64, node_message::Msg)>,
}

fn lock(s: &Mutex<Slots>) -> std::sync::MutexGuard<'_, Slots> {
    s.lock().unwrap_or_else(|e| e.into_inner())
}

impl Relay {
    /// A relay to the dispatcher at `url`, its stream opened now and again
    /// whenever it breaks.
    pub fn start(url: String) -> Self {
        let (to_stream, from_nodes) = mpsc::unbounded_channel();
        let relay = Self {
            slots: Arc::new(Mutex::new(Slots::default())),
            to_stream,
        };
        tokio::spawn(relay.clone().run(url, from_nodes));
        relay
    }

    /// A node's session through the relay: the sender of its messages
    /// (Register first; dropping it detaches the node) and what the
    /// dispatcher sends it.
    pub fn attach(&self) -> (mpsc::UnboundedSender<AgentMessage>, NodeRx) {
        let (tx, rx) = mpsc::unbounded_channel();
        let (slot, generation) = {
            let mut s = lock(&self.slots);
            s.next_generation += 1;
            let generation = s.next_generation;
            let slot = match s.slots.iter().position(|x| matches!(x, Slot::Free)) {
                Some(i) => i,
                None => {
                    s.slots.push(Slot::Free);
                    s.slots.len() - 1
                }
            };
            s.slots[slot] = Slot::Live { generation, tx };
            (slot as u32, generation)
        };
        let (out, mut from_agent) = mpsc::unbounded_channel::<AgentMessage>();
        let relay = self.clone();
        tokio::spawn(async move {
            while let Some(m) = from_agent.recv().await {
                let _ = relay
                    .to_stream
                    .send((slot, generation, node_message::Msg::Message(m)));
            }
            // The agent's session ended: detach its node unless the
            // dispatcher ended it already.
            let mut s = lock(&relay.slots);
            if s.live(slot, generation) {
                s.slots[slot as usize] = Slot::Draining { generation };
                let _ =
                    relay
                        .to_stream
                        .send((slot, generation, node_message::Msg::Detach(Detach {})));
            }
        });
        (out, rx)
    }

    /// Every live session on a broken stream ends; every slot is free.
    fn fail_all(&self, why: &str) {
        let mut s = lock(&self.slots);
        for slot in s.slots.iter_mut() {
            if let Slot::Live { tx, .. } = slot {
                let _ = tx.send(Err(Status::unavailable(why.to_string())));
            }
            *slot = Slot::Free;
        }
    }

    async fn run(
        self,
        url: String,
        mut from_nodes: mpsc::UnboundedReceiver<(u32, u64, node_message::Msg)>,
    ) {
        loop {
            let why = match self.stream(&url, &mut from_nodes).await {
                Ok(()) => return,
                Err(e) => format!("relay stream: {e:#}"),
            };
            self.fail_all(&why);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// One AttachMany stream, until it breaks (Err) or every node sender
    /// is gone (Ok).
    async fn stream(
        &self,
        url: &str,
        from_nodes: &mut mpsc::UnboundedReceiver<(u32, u64, node_message::Msg)>,
    ) -> anyhow::Result<()> {
        let channel = crate::agents::connect(url).await?;
        let mut client = AgentServiceClient::new(channel)
            .max_decoding_message_size(64 << 20)
            .max_encoding_message_size(64 << 20);
        let (frames, rx) = mpsc::unbounded_channel();
        let mut inbound = client
            .attach_many(UnboundedReceiverStream::new(rx))
            .await?
            .into_inner();
        loop {
            tokio::select! {
                first = from_nodes.recv() => {
                    let Some(first) = first else { return Ok(()) };
                    let mut nodes = Vec::new();
                    let mut bytes = 0;
                    let mut next = Some(first);
                    while let Some((slot, generation, msg)) = next {
                        // Only the current session's messages (and the
                        // Detach of one draining) go out.
                        let current = {
                            let s = lock(&self.slots);
                            match s.slots.get(slot as usize) {
                                Some(Slot::Live { generation: g, .. }) => *g == generation,
                                Some(Slot::Draining { generation: g }) => *g == generation,
                                _ => false,
                            }
                        };
                        if current {
                            let m = NodeMessage { slot, msg: Some(msg) };
                            bytes += prost::Message::encoded_len(&m) + 4;
                            nodes.push(m);
                        }
                        if bytes >= MAX_FRAME_BYTES {
                            break;
                        }
                        next = from_nodes.try_recv().ok();
                    }
                    if !nodes.is_empty() {
                        frames.send(RelayMessage { nodes })?;
                    }
                }
                frame = inbound.next() => {
                    let frame = match frame {
                        Some(Ok(f)) => f,
                        Some(Err(status)) => anyhow::bail!("{status}"),
                        None => anyhow::bail!("the dispatcher closed the stream"),
                    };
                    let mut s = lock(&self.slots);
                    for r in frame.nodes {
                        let Some(slot) = s.slots.get_mut(r.slot as usize) else { continue };
                        match (r.msg, &*slot) {
                            (Some(node_reply::Msg::Message(m)), Slot::Live { tx, .. }) => {
                                let _ = tx.send(Ok(m));
                            }
                            (Some(node_reply::Msg::Ended(e)), Slot::Live { tx, .. }) => {
                                let _ = tx.send(Err(Status::new(e.code.into(), e.message)));
                                *slot = Slot::Free;
                            }
                            (Some(node_reply::Msg::Ended(_)), Slot::Draining { .. }) => {
                                *slot = Slot::Free;
                            }
                            _ => {}
                        }
                    }
                }
            }
        }
    }
}
