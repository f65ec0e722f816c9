//! The relay's side of `AgentService.AttachMany`: one stream to the
//! leading dispatcher carrying many nodes' sessions, each on a *slot*
//! (see `agent.proto`). Used by the `dispatch-relay` process
//! ([`crate::server`]) and by the load generator's in-process relays
//! (`--nodes-per-stream`).
//!
//! A node's session: [`Upstream::open`] gives it the lowest free slot and
//! a [`NodeSender`] for its messages (Register first); what the dispatcher
//! answers on that slot comes on its [`NodeRx`]. The stream task tags the
//! messages with their slot and sends every message ready at once as one
//! `RelayMessage` frame of at most [`MAX_FRAME_BYTES`] (the dispatcher
//! reads a stream into a buffer that keeps the size of its largest
//! frame), and hands each `NodeReply` to its slot's session: `ended` ends
//! that session (its `NodeRx` yields the status, then nothing). Dropping
//! the `NodeSender` detaches the node (Detach); the slot is reused once
//! the dispatcher confirmed it with `ended`.
//!
//! Backpressure: the nodes' messages go through one bounded queue
//! ([`Config::queue`] messages) that only the connected stream drains, so
//! a slow or absent dispatcher makes [`NodeSender::send`] wait, and the
//! relay stops reading its agents' streams (HTTP/2 flow control then
//! holds the agents). The dispatcher's messages to a node are never held
//! up by another node: each session's queue is unbounded, as the
//! dispatcher's own per-agent queue is.
//!
//! Leader following: the stream goes to the first of
//! [`Config::dispatchers`] that takes it; a follower's answer names the
//! leader (`proto::endpoints`), which is tried at once. When the stream
//! breaks, or the dispatcher ends a session with UNAVAILABLE (it stops
//! or steps down), every session on the stream ends with UNAVAILABLE and
//! the stream is opened again, to the leader: the agents see a clean
//! disconnect, reconnect and register again listing the jobs they run
//! (the dispatcher reconciles them), as after a broken Attach stream.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use proto::client_security::ClientTls;
use proto::endpoints::{Endpoints, NoEndpoints};
use proto::v1::agent_service_client::AgentServiceClient;
use proto::v1::{
    AgentMessage, Detach, DispatcherMessage, NodeMessage, RelayMessage, node_message, node_reply,
};
use tokio::sync::{mpsc, watch};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::{Code, Status};

/// A frame takes no more messages once it is this large (encoded): the
/// dispatcher reads a stream into a buffer that keeps the size of its
/// largest frame (~160 KiB per stream for 64-KiB frames, 163 B per node
/// at 1,000 nodes per stream: docs/BENCHMARKS.md, "mem4").
pub const MAX_FRAME_BYTES: usize = 16 << 10;

/// The longest wait between attempts to open the stream: a follower's
/// hint may name a leader that just died, and the agents' registrations
/// wait meanwhile (the new leader gives nodes only so long to come back).
const MAX_BACKOFF: Duration = Duration::from_millis(500);

/// Slots one stream may use (the dispatcher's `MAX_SLOTS`).
pub const MAX_SLOTS: usize = 65_536;

/// What a node's session reads: the dispatcher's messages, or the status
/// its session ended with (boxed: an idle session's queue then costs a
/// block of pointers, not of messages).
pub type NodeRx = mpsc::UnboundedReceiver<Box<Result<DispatcherMessage, Status>>>;
type NodeTx = mpsc::UnboundedSender<Box<Result<DispatcherMessage, Status>>>;

/// Where the relay's stream goes and how.
#[derive(Debug, Clone)]
pub struct Config {
    /// The dispatchers' URLs (replicas: the leader is followed).
    pub dispatchers: Vec<String>,
    /// TLS to the dispatchers (the relay's client certificate names the
    /// nodes it may register, see the crate's documentation).
    pub tls: ClientTls,
    /// Messages from the nodes that may wait for the stream.
    pub queue: usize,
}

impl Config {
    /// Plain text to `url`, the default queue.
    pub fn plain(url: impl Into<String>) -> Self {
        Self {
            dispatchers: vec![url.into()],
            tls: ClientTls::default(),
            queue: 4096,
        }
    }
}

/// Why a node could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// Every slot of the stream is taken.
    #[error("the relay carries its maximum of {MAX_SLOTS} nodes")]
    Full,
}

enum Slot {
    Free,
    Live {
        generation: u64,
        tx: NodeTx,
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
    live: usize,
}

impl Slots {
    fn live(&self, slot: u32, generation: u64) -> bool {
        matches!(self.slots.get(slot as usize), Some(Slot::Live { generation: g, .. }) if *g == generation)
    }
}

fn lock(s: &Mutex<Slots>) -> std::sync::MutexGuard<'_, Slots> {
    s.lock().unwrap_or_else(|e| e.into_inner())
}

/// What went through the relay's stream since it started: counters only
/// the stream task writes (relaxed atomics, read by scrapes).
#[derive(Default)]
struct Counters {
    frames_up: AtomicU64,
    messages_up: AtomicU64,
    bytes_up: AtomicU64,
    frames_down: AtomicU64,
    messages_down: AtomicU64,
    bytes_down: AtomicU64,
    reconnects: AtomicU64,
    connect_failures: AtomicU64,
}

/// A reading of the relay's state and counters ([`Upstream::stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Nodes whose sessions are live ([`Upstream::live_nodes`]).
    pub agents: u64,
    /// The stream to a dispatcher is open.
    pub connected: bool,
    /// Messages of the nodes waiting for the stream (at most
    /// [`Config::queue`]).
    pub queue_depth: u64,
    /// `RelayMessage` frames sent up, the node messages (Detaches
    /// included) they carried and their encoded bytes.
    pub frames_up: u64,
    /// See `frames_up`.
    pub messages_up: u64,
    /// See `frames_up`.
    pub bytes_up: u64,
    /// `RelayReply` frames received, their node replies and encoded bytes.
    pub frames_down: u64,
    /// See `frames_down`.
    pub messages_down: u64,
    /// See `frames_down`.
    pub bytes_down: u64,
    /// Streams opened after an earlier one broke.
    pub reconnects: u64,
    /// Attempts to open the stream that failed (refused, unreachable, a
    /// follower's redirect).
    pub connect_failures: u64,
}

/// One relay's stream (reopened when it breaks) and its nodes.
#[derive(Clone)]
pub struct Upstream {
    slots: Arc<Mutex<Slots>>,
    counters: Arc<Counters>,
    /// (slot, generation, message): the nodes' messages, bounded.
    to_stream: mpsc::Sender<(u32, u64, AgentMessage)>,
    /// Detaches (slot, generation): never waits, so a drop can send it.
    detaches: mpsc::UnboundedSender<(u32, u64)>,
    connected: watch::Receiver<Option<String>>,
}

/// A node's sender: its messages go up its slot while its session lives;
/// dropping it detaches the node.
pub struct NodeSender {
    upstream: Upstream,
    slot: u32,
    generation: u64,
}

/// The node's session ended (the dispatcher ended it, or the stream broke).
#[derive(Debug, thiserror::Error)]
#[error("the node's session through the relay has ended")]
pub struct Gone;

impl NodeSender {
    /// Queue `m` for the dispatcher, waiting while the relay's queue is
    /// full (backpressure).
    pub async fn send(&self, m: AgentMessage) -> Result<(), Gone> {
        if !lock(&self.upstream.slots).live(self.slot, self.generation) {
            return Err(Gone);
        }
        self.upstream
            .to_stream
            .send((self.slot, self.generation, m))
            .await
            .map_err(|_| Gone)
    }

    /// The node's slot on the stream.
    pub fn slot(&self) -> u32 {
        self.slot
    }
}

impl Drop for NodeSender {
    fn drop(&mut self) {
        let mut s = lock(&self.upstream.slots);
        if s.live(self.slot, self.generation) {
            s.slots[self.slot as usize] = Slot::Draining {
                generation: self.generation,
            };
            s.live -= 1;
            let _ = self.upstream.detaches.send((self.slot, self.generation));
        }
    }
}

/// The nodes' queue as the stream task reads it: (slot, generation,
/// message).
type FromNodes = mpsc::Receiver<(u32, u64, AgentMessage)>;
/// Detaches (slot, generation) as the stream task reads them.
type Detached = mpsc::UnboundedReceiver<(u32, u64)>;

impl Upstream {
    /// A relay to `config.dispatchers`, its stream opened now and again
    /// whenever it breaks.
    pub fn start(config: Config) -> Result<Self, NoEndpoints> {
        let (runner, from_nodes, detached) = Self::parts(config)?;
        let up = runner.up.clone();
        tokio::spawn(runner.run(from_nodes, detached));
        Ok(up)
    }

    /// The relay and its stream task, not started: [`Self::start`] spawns
    /// the task; the unit tests drive it by hand.
    fn parts(config: Config) -> Result<(Runner, FromNodes, Detached), NoEndpoints> {
        let endpoints = Endpoints::new(config.dispatchers.clone())?;
        let (to_stream, from_nodes) = mpsc::channel(config.queue.max(1));
        let (detaches, detached) = mpsc::unbounded_channel();
        let (connected_tx, connected) = watch::channel(None);
        let up = Self {
            slots: Arc::new(Mutex::new(Slots::default())),
            counters: Arc::default(),
            to_stream,
            detaches,
            connected,
        };
        let runner = Runner {
            up,
            tls: config.tls,
            endpoints,
            connected: connected_tx,
            opened_before: false,
        };
        Ok((runner, from_nodes, detached))
    }

    /// An upstream whose stream task is not started, for other modules'
    /// unit tests: nothing drains its queue nor ends its sessions while
    /// the returned guard lives.
    #[cfg(test)]
    pub(crate) fn unstarted(config: Config) -> (Self, Box<dyn std::any::Any>) {
        let (runner, from_nodes, detached) = Self::parts(config).expect("a URL");
        (runner.up.clone(), Box::new((runner, from_nodes, detached)))
    }

    /// The relay's state now and its counters since it started.
    pub fn stats(&self) -> Stats {
        let c = &*self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Stats {
            agents: self.live_nodes() as u64,
            connected: self.connected.borrow().is_some(),
            queue_depth: (self.to_stream.max_capacity() - self.to_stream.capacity()) as u64,
            frames_up: get(&c.frames_up),
            messages_up: get(&c.messages_up),
            bytes_up: get(&c.bytes_up),
            frames_down: get(&c.frames_down),
            messages_down: get(&c.messages_down),
            bytes_down: get(&c.bytes_down),
            reconnects: get(&c.reconnects),
            connect_failures: get(&c.connect_failures),
        }
    }

    /// The dispatcher the stream is open to, if it is.
    pub fn connected(&self) -> watch::Receiver<Option<String>> {
        self.connected.clone()
    }

    /// The nodes whose sessions are live (opened, not ended nor detached).
    pub fn live_nodes(&self) -> usize {
        lock(&self.slots).live
    }

    /// A node's session: the sender of its messages (Register first) and
    /// what the dispatcher sends it.
    pub fn open(&self) -> Result<(NodeSender, NodeRx), OpenError> {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut s = lock(&self.slots);
        let slot = match s.slots.iter().position(|x| matches!(x, Slot::Free)) {
            Some(i) => i,
            None if s.slots.len() < MAX_SLOTS => {
                s.slots.push(Slot::Free);
                s.slots.len() - 1
            }
            None => return Err(OpenError::Full),
        };
        s.next_generation += 1;
        let generation = s.next_generation;
        s.slots[slot] = Slot::Live { generation, tx };
        s.live += 1;
        let sender = NodeSender {
            upstream: self.clone(),
            slot: slot as u32,
            generation,
        };
        Ok((sender, rx))
    }

    /// [`Self::open`] with an unbounded sender (the load generator's fake
    /// agents send without awaiting): a task forwards its messages, and
    /// detaches the node when the sender is dropped.
    pub fn attach(&self) -> Result<(mpsc::UnboundedSender<AgentMessage>, NodeRx), OpenError> {
        let (sender, rx) = self.open()?;
        let (out, mut from_agent) = mpsc::unbounded_channel::<AgentMessage>();
        tokio::spawn(async move {
            while let Some(m) = from_agent.recv().await {
                if sender.send(m).await.is_err() {
                    break;
                }
            }
        });
        Ok((out, rx))
    }

    /// Every live session on a broken stream ends; every slot is free.
    fn fail_all(&self, why: &str) {
        let mut s = lock(&self.slots);
        for slot in s.slots.iter_mut() {
            if let Slot::Live { tx, .. } = slot {
                let _ = tx.send(Box::new(Err(Status::unavailable(why.to_string()))));
            }
            *slot = Slot::Free;
        }
        s.live = 0;
    }
}

/// The task that holds the stream.
struct Runner {
    up: Upstream,
    tls: ClientTls,
    endpoints: Endpoints,
    connected: watch::Sender<Option<String>>,
    /// A stream was open before (the next one is a reconnect).
    opened_before: bool,
}

/// How a stream ended.
enum Ended {
    /// Every sender is gone: the relay stops.
    Done,
    /// The stream broke or could not be opened.
    Failed(anyhow::Error),
}

impl Runner {
    async fn run(mut self, mut from_nodes: FromNodes, mut detached: Detached) {
        let mut backoff = Duration::from_millis(100);
        loop {
            let url = self.endpoints.current().to_string();
            let mut opened = false;
            let err = match self
                .stream(&url, &mut from_nodes, &mut detached, &mut opened)
                .await
            {
                Ended::Done => return,
                Ended::Failed(e) => e,
            };
            let _ = self.connected.send(None);
            let why = format!("relay stream to {url}: {err:#}");
            self.up.fail_all(&why);
            if opened {
                self.endpoints.succeeded();
                backoff = Duration::from_millis(100);
            } else {
                self.up
                    .counters
                    .connect_failures
                    .fetch_add(1, Ordering::Relaxed);
            }
            match self.endpoints.failed(err.downcast_ref::<Status>()) {
                proto::endpoints::Next::Redirected(leader) => {
                    tracing::info!(%url, %leader, "not the leader; following the hint");
                    continue;
                }
                proto::endpoints::Next::Rotated { .. } => {
                    tracing::warn!("{why}; reconnecting in {backoff:?}");
                }
            }
            // Sessions opened meanwhile keep what they queued (their
            // Register goes on the next stream); what ended sessions had
            // queued is dropped when the stream reads it (`frame`).
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    /// One AttachMany stream, until it breaks or every sender is gone.
    async fn stream(
        &mut self,
        url: &str,
        from_nodes: &mut FromNodes,
        detached: &mut Detached,
        opened: &mut bool,
    ) -> Ended {
        let result: anyhow::Result<()> = async {
            let channel = proto::endpoints::endpoint(url, &self.tls)?
                .connect()
                .await
                .map_err(|e| anyhow::anyhow!("connecting to {url}: {e}"))?;
            let mut client = AgentServiceClient::new(channel)
                .max_decoding_message_size(64 << 20)
                .max_encoding_message_size(64 << 20);
            let (frames, rx) = mpsc::unbounded_channel();
            let mut inbound = client
                .attach_many(UnboundedReceiverStream::new(rx))
                .await?
                .into_inner();
            *opened = true;
            if std::mem::replace(&mut self.opened_before, true) {
                self.up.counters.reconnects.fetch_add(1, Ordering::Relaxed);
            }
            let _ = self.connected.send(Some(url.to_string()));
            tracing::info!(%url, "relay stream open");
            loop {
                tokio::select! {
                    first = from_nodes.recv() => {
                        let Some(first) = first else { return Ok(()) };
                        let frame = self.frame(Some(first), from_nodes, detached);
                        self.send_up(&frames, frame)?;
                    }
                    d = detached.recv() => {
                        let Some((slot, generation)) = d else { return Ok(()) };
                        let mut frame = self.frame(None, from_nodes, detached);
                        if matches!(lock(&self.up.slots).slots.get(slot as usize),
                            Some(Slot::Draining { generation: g }) if *g == generation)
                        {
                            frame.nodes.push(NodeMessage {
                                slot,
                                msg: Some(node_message::Msg::Detach(Detach {})),
                            });
                        }
                        self.send_up(&frames, frame)?;
                    }
                    frame = inbound.next() => {
                        let frame = match frame {
                            Some(Ok(f)) => f,
                            Some(Err(status)) => return Err(status.into()),
                            None => anyhow::bail!("the dispatcher closed the stream"),
                        };
                        let c = &self.up.counters;
                        c.frames_down.fetch_add(1, Ordering::Relaxed);
                        c.messages_down.fetch_add(frame.nodes.len() as u64, Ordering::Relaxed);
                        c.bytes_down.fetch_add(prost::Message::encoded_len(&frame) as u64, Ordering::Relaxed);
                        self.replies(frame)?;
                    }
                }
            }
        }
        .await;
        match result {
            Ok(()) => Ended::Done,
            Err(e) => Ended::Failed(e),
        }
    }

    /// Send `frame` up the stream unless it is empty, counting it.
    fn send_up(
        &self,
        frames: &mpsc::UnboundedSender<RelayMessage>,
        frame: RelayMessage,
    ) -> anyhow::Result<()> {
        if frame.nodes.is_empty() {
            return Ok(());
        }
        let c = &self.up.counters;
        c.frames_up.fetch_add(1, Ordering::Relaxed);
        c.messages_up
            .fetch_add(frame.nodes.len() as u64, Ordering::Relaxed);
        c.bytes_up.fetch_add(
            prost::Message::encoded_len(&frame) as u64,
            Ordering::Relaxed,
        );
        frames.send(frame)?;
        Ok(())
    }

    /// The messages ready now, at most [`MAX_FRAME_BYTES`], each only if
    /// its session is current (a message of an ended session is dropped;
    /// a Detach only for a slot draining that session).
    fn frame(
        &self,
        mut next: Option<(u32, u64, AgentMessage)>,
        from_nodes: &mut FromNodes,
        detached: &mut Detached,
    ) -> RelayMessage {
        let mut nodes = Vec::new();
        let mut bytes = 0;
        if next.is_none() {
            next = from_nodes.try_recv().ok();
        }
        let s = lock(&self.up.slots);
        while let Some((slot, generation, m)) = next {
            if s.live(slot, generation) {
                let m = NodeMessage {
                    slot,
                    msg: Some(node_message::Msg::Message(m)),
                };
                bytes += prost::Message::encoded_len(&m) + 4;
                nodes.push(m);
            }
            if bytes >= MAX_FRAME_BYTES {
                return RelayMessage { nodes };
            }
            next = from_nodes.try_recv().ok();
        }
        // Detaches after the messages (a detached slot's messages were
        // dropped above: it is no longer live).
        while bytes < MAX_FRAME_BYTES {
            let Ok((slot, generation)) = detached.try_recv() else {
                break;
            };
            if matches!(s.slots.get(slot as usize), Some(Slot::Draining { generation: g }) if *g == generation)
            {
                bytes += 8;
                nodes.push(NodeMessage {
                    slot,
                    msg: Some(node_message::Msg::Detach(Detach {})),
                });
            }
        }
        RelayMessage { nodes }
    }

    /// Hand each reply to its slot's session. A session ended UNAVAILABLE
    /// means the dispatcher stops or steps down: the whole stream is
    /// given up (Err), to be reopened to the leader.
    fn replies(&self, frame: proto::v1::RelayReply) -> anyhow::Result<()> {
        let mut s = lock(&self.up.slots);
        let mut stepping_down = None;
        for r in frame.nodes {
            let Some(slot) = s.slots.get_mut(r.slot as usize) else {
                continue;
            };
            let mut freed = false;
            match (r.msg, &*slot) {
                (Some(node_reply::Msg::Message(m)), Slot::Live { tx, .. }) => {
                    let _ = tx.send(Box::new(Ok(m)));
                }
                (Some(node_reply::Msg::Ended(e)), Slot::Live { tx, .. }) => {
                    let code = Code::from(e.code);
                    if code == Code::Unavailable {
                        stepping_down = Some(e.message.clone());
                    }
                    let _ = tx.send(Box::new(Err(Status::new(code, e.message))));
                    *slot = Slot::Free;
                    freed = true;
                }
                (Some(node_reply::Msg::Ended(e)), Slot::Draining { .. }) => {
                    if Code::from(e.code) == Code::Unavailable {
                        stepping_down = Some(e.message.clone());
                    }
                    *slot = Slot::Free;
                }
                _ => {}
            }
            if freed {
                s.live -= 1;
            }
        }
        match stepping_down {
            Some(why) => anyhow::bail!("the dispatcher ended sessions UNAVAILABLE: {why}"),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    //! The slot table and the framing without a dispatcher: an `Upstream`
    //! whose stream task is not started, its `Runner` driven by hand.

    use super::*;
    use proptest::prelude::*;
    use proto::v1::{
        LogData, NodeReply, RelayReply, SessionEnded, agent_message, dispatcher_message,
    };

    /// An upstream with its runner not spawned ([`Upstream::parts`]): the
    /// test reads the nodes' queue and makes frames itself.
    fn unstarted(queue: usize) -> (Runner, FromNodes, Detached) {
        Upstream::parts(Config {
            queue,
            ..Config::plain("http://127.0.0.1:1")
        })
        .expect("one URL")
    }

    /// A message of about `n` bytes encoded.
    fn log(n: usize, tag: u64) -> AgentMessage {
        AgentMessage {
            msg: Some(agent_message::Msg::Log(LogData {
                request_id: tag,
                data: vec![7; n],
                ..Default::default()
            })),
        }
    }

    fn tag_of(m: &NodeMessage) -> Option<u64> {
        match &m.msg {
            Some(node_message::Msg::Message(AgentMessage {
                msg: Some(agent_message::Msg::Log(l)),
            })) => Some(l.request_id),
            _ => None,
        }
    }

    fn ended(slot: u32, code: Code) -> RelayReply {
        RelayReply {
            nodes: vec![NodeReply {
                slot,
                msg: Some(node_reply::Msg::Ended(SessionEnded {
                    code: code as i32,
                    message: "bye".into(),
                })),
            }],
        }
    }

    #[tokio::test]
    async fn a_detached_slot_is_reused_only_once_the_dispatcher_ended_it() {
        let (r, _from, mut detached) = unstarted(16);
        let (a, _arx) = r.up.open().expect("slot");
        let (b, _brx) = r.up.open().expect("slot");
        assert_eq!((a.slot(), b.slot(), r.up.live_nodes()), (0, 1, 2));
        drop(a);
        assert_eq!(r.up.live_nodes(), 1);
        assert_eq!(detached.try_recv().ok(), Some((0, 1)));
        // Draining: not free yet.
        let (c, _crx) = r.up.open().expect("slot");
        assert_eq!(c.slot(), 2);
        r.replies(ended(0, Code::Ok)).expect("not stepping down");
        let (d, _drx) = r.up.open().expect("slot");
        assert_eq!(d.slot(), 0, "the lowest free slot, once confirmed");
        assert_eq!(r.up.live_nodes(), 3);
    }

    #[tokio::test]
    async fn replies_reach_their_slot_and_unavailable_gives_up_the_stream() {
        let (r, _from, _detached) = unstarted(16);
        let (a, mut arx) = r.up.open().expect("slot");
        let (b, mut brx) = r.up.open().expect("slot");
        let msg = DispatcherMessage {
            msg: Some(dispatcher_message::Msg::Cancel(Default::default())),
        };
        let frame = RelayReply {
            nodes: vec![
                NodeReply {
                    slot: b.slot(),
                    msg: Some(node_reply::Msg::Message(msg.clone())),
                },
                // A slot nobody holds: ignored.
                NodeReply {
                    slot: 9,
                    msg: Some(node_reply::Msg::Message(msg.clone())),
                },
            ],
        };
        r.replies(frame).expect("not stepping down");
        assert_eq!(brx.try_recv().expect("b's message").ok(), Some(msg));
        assert!(arx.try_recv().is_err(), "a got nothing");
        // The dispatcher ends a's session with INVALID_ARGUMENT: a only.
        r.replies(ended(a.slot(), Code::InvalidArgument))
            .expect("not stepping down");
        let got = arx.try_recv().expect("a's end");
        assert_eq!(
            got.as_ref().as_ref().err().map(|s| s.code()),
            Some(Code::InvalidArgument)
        );
        assert!(
            a.send(log(1, 1)).await.is_err(),
            "an ended session sends nothing"
        );
        assert_eq!(r.up.live_nodes(), 1);
        // UNAVAILABLE: the dispatcher steps down; the stream is given up.
        assert!(r.replies(ended(b.slot(), Code::Unavailable)).is_err());
    }

    #[tokio::test]
    async fn a_frame_stops_at_the_limit_and_keeps_the_rest_in_order() {
        let (r, mut from, mut detached) = unstarted(64);
        let (a, _arx) = r.up.open().expect("slot");
        // Four logs reach the limit, three do not.
        for tag in 0..6 {
            a.send(log(MAX_FRAME_BYTES * 5 / 16, tag))
                .await
                .expect("live");
        }
        let first = r.frame(None, &mut from, &mut detached);
        let bytes: usize = first
            .nodes
            .iter()
            .map(|m| prost::Message::encoded_len(m) + 4)
            .sum();
        assert!(
            bytes >= MAX_FRAME_BYTES && first.nodes.len() == 4,
            "{bytes} B in {}",
            first.nodes.len()
        );
        let second = r.frame(None, &mut from, &mut detached);
        let tags: Vec<_> = first
            .nodes
            .iter()
            .chain(&second.nodes)
            .filter_map(tag_of)
            .collect();
        assert_eq!(tags, vec![0, 1, 2, 3, 4, 5]);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Open,
        /// Node `i` (of those opened, modulo) sends a message of `n` bytes.
        Send(usize, usize),
        /// Node `i` is dropped (Detach).
        Drop(usize),
        /// The dispatcher ends node `i`'s session.
        End(usize),
        /// The stream task makes a frame.
        Frame,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            1 => Just(Op::Open),
            4 => (0usize..8, 0usize..30_000).prop_map(|(i, n)| Op::Send(i, n)),
            1 => (0usize..8).prop_map(Op::Drop),
            1 => (0usize..8).prop_map(Op::End),
            2 => Just(Op::Frame),
        ]
    }

    proptest! {
        /// Oracle: a message goes up exactly when its session is live at
        /// framing, in the order sent; a Detach exactly for a dropped node
        /// the dispatcher had not ended, after that frame's messages; no
        /// frame goes on past the limit by more than its last message; and
        /// the table's live count is the live sessions'.
        #[test]
        fn frames_carry_exactly_the_live_sessions_messages(ops in prop::collection::vec(op(), 1..80)) {
            let rt = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
            rt.block_on(async {
                let (r, mut from, mut detached) = unstarted(1024);
                // Per opened node: its sender (None once dropped), slot, and
                // the oracle's state.
                let mut nodes: Vec<(Option<NodeSender>, u32, NodeRx)> = Vec::new();
                let mut live: Vec<bool> = Vec::new();
                let mut ended_by_dispatcher: Vec<bool> = Vec::new();
                // Oracle of what the next frames carry: (slot, tag) sent
                // while live, and the Detaches due.
                let mut queued: Vec<(usize, u64)> = Vec::new();
                let mut detach_due: Vec<u32> = Vec::new();
                let mut tag = 0u64;
                for op in ops {
                    match op {
                        Op::Open => {
                            let (s, rx) = r.up.open().expect("slot");
                            let slot = s.slot();
                            nodes.push((Some(s), slot, rx));
                            live.push(true);
                            ended_by_dispatcher.push(false);
                        }
                        Op::Send(i, n) if !nodes.is_empty() => {
                            let i = i % nodes.len();
                            if let Some(s) = &nodes[i].0 {
                                tag += 1;
                                let sent = s.send(log(n, tag)).await.is_ok();
                                prop_assert_eq!(sent, live[i]);
                                if sent {
                                    queued.push((i, tag));
                                }
                            }
                        }
                        Op::Drop(i) if !nodes.is_empty() => {
                            let i = i % nodes.len();
                            if nodes[i].0.take().is_some() && live[i] {
                                live[i] = false;
                                detach_due.push(nodes[i].1);
                            }
                        }
                        Op::End(i) if !nodes.is_empty() => {
                            let i = i % nodes.len();
                            // The dispatcher ends a session it holds: live,
                            // or detached and not yet confirmed.
                            let draining = detach_due.contains(&nodes[i].1);
                            if (live[i] || draining) && !ended_by_dispatcher[i] {
                                r.replies(ended(nodes[i].1, Code::InvalidArgument)).expect("not stepping down");
                                ended_by_dispatcher[i] = true;
                                live[i] = false;
                                detach_due.retain(|&s| s != nodes[i].1);
                            }
                        }
                        Op::Frame => {
                            let f = r.frame(None, &mut from, &mut detached);
                            let mut bytes = 0;
                            let mut got_msgs = Vec::new();
                            let mut got_detaches = Vec::new();
                            for m in &f.nodes {
                                prop_assert!(bytes < MAX_FRAME_BYTES, "a message after the limit");
                                bytes += prost::Message::encoded_len(m) + 4;
                                match (&m.msg, tag_of(m)) {
                                    (_, Some(t)) => {
                                        prop_assert!(got_detaches.is_empty(), "a message after a Detach");
                                        got_msgs.push((m.slot, t));
                                    }
                                    (Some(node_message::Msg::Detach(_)), None) => got_detaches.push(m.slot),
                                    _ => prop_assert!(false, "unexpected {:?}", m),
                                }
                            }
                            // The messages: the oracle's queue, from the
                            // front, dropping those whose session is over.
                            let mut want = Vec::new();
                            let mut k = 0;
                            while k < queued.len() && want.len() < got_msgs.len() {
                                let (i, t) = queued[k];
                                if live[i] {
                                    want.push((nodes[i].1, t));
                                }
                                k += 1;
                            }
                            prop_assert_eq!(&got_msgs, &want);
                            if bytes < MAX_FRAME_BYTES {
                                // Under the limit: everything ready went,
                                // dead sessions' messages dropped, then
                                // every Detach due.
                                prop_assert!(queued[k..].iter().all(|&(i, _)| !live[i]), "a live message left behind");
                                queued.clear();
                                prop_assert_eq!(&got_detaches, &detach_due);
                                detach_due.clear();
                            } else {
                                queued.drain(..k);
                                prop_assert!(got_detaches.is_empty() || got_detaches.len() <= detach_due.len());
                                detach_due.drain(..got_detaches.len());
                            }
                        }
                        _ => {}
                    }
                    prop_assert_eq!(r.up.live_nodes(), live.iter().filter(|&&l| l).count());
                }
                Ok(())
            })?;
        }
    }
}
