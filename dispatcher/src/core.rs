//! The core: one thread that owns the [`Cluster`] and the store (which
//! commits on a thread of its own, [`Committer`]), and the protocol by
//! which everything else talks to it.
//!
//! gRPC handlers send [`Command`]s and await a reply. The core takes a
//! batch of commands at a time, applies each to the cluster (which only
//! records effects), then:
//!
//! 1. commits all store writes of the batch in one durable transaction;
//! 2. only then replies to the callers, sends messages to agents and
//!    publishes job events.
//!
//! A batch takes every agent command waiting, then the clients' commands
//! in order up to [`JOBS_PER_BATCH`] new jobs; the rest wait for the next
//! batches (statuses free the room new jobs need, and a flood of
//! submissions waits as commands rather than deep engine queues).
//!
//! The commit runs on the store's thread while the core applies the next
//! batch, if commands are waiting (else the core waits for it): a batch is
//! released once it is stored, before the next one's commit starts, so
//! batches are stored and released in order. A batch with a Watch, and the
//! tick, wait for the batch in flight to be released first (a new watcher
//! gets no event of a batch its snapshot shows; observers sample after the
//! events they were told of).
//!
//! Reads (Get, List, Watch, the node queries) wait for the commit as
//! writes do, since they may show what earlier commands of the same batch
//! changed: nothing a failed commit drops is ever shown. So nothing is
//! acknowledged or shown before it is persisted, and the batch makes that
//! cheap (one fsync for many submissions). If a commit fails the
//! core cannot keep its promise and stops: with the embedded store the
//! dispatcher exits and a restart recovers from the store; with etcd the
//! replica steps down ([`crate::ha`]) and whichever replica leads next
//! recovers from etcd. Either way agents re-report their jobs.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use proto::v1::{
    DispatcherMessage, Job, JobEvent, JobSpec, ListJobsRequest, ListNodesResponse, LogChunk,
    LogRequest, Node, Register, Registered, StreamLogsRequest, agent_message, dispatcher_message,
};
use tokio::sync::{broadcast, mpsc, oneshot};
use tonic::Status;

use crate::beats::{Beat, Beats, FLUSH_MS, Link, Reporter};
use crate::cluster::listing::NodeCopy;
use crate::cluster::{Cluster, Effects, JobChange, JobKey, JobRecord, NodeName, ToAgent};
use crate::list_worker::ListWorker;
use crate::observe::Observers;
use crate::store::committer::Committer;
use crate::store::{NodeAdmin, Store, StoreError};

/// Unix time in milliseconds.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Outbound half of an agent's stream.
pub use crate::outbound::AgentTx;
/// Outbound half of a log stream.
pub type LogTx = mpsc::UnboundedSender<Result<LogChunk, Status>>;

type Reply<T> = oneshot::Sender<Result<T, Status>>;

/// Ceiling of the measured steal cost (the kernel's migration cost).
const MAX_STEAL_COST_NS: u64 = 500_000;

/// New jobs a batch takes from the clients' submissions (at least one
/// call's): about 40 ms of the core's work at 20 us a job, so agents'
/// statuses are applied, and the room they free reused, every few tens of
/// milliseconds however many submissions wait.
const JOBS_PER_BATCH: usize = 2048;

/// The least time between two engine rebuilds that only registrations
/// asked for ([`Core::settle_deferred`]): a burst of registrations (a
/// relay attaching its thousands of nodes) rebuilds the node engine, O(n)
/// each time, about once a second (the tick settles too) rather than
/// after every batch (~155 rebuilds for 10,000 nodes, ~500 MB of large
/// blocks allocated and freed whose pages stay resident, ~300 B of RSS per
/// node more at 200 ms than at 1 s: docs/BENCHMARKS.md, "mem3" and
/// "mem4"). Jobs already waiting reach the new nodes within that second;
/// any other command (a submission) settles at once.
const REBUILD_EVERY: Duration = Duration::from_millis(1000);

/// A request to the core.
pub enum Command {
    /// SubmitJob / SubmitJobs.
    Submit {
        /// The specs.
        specs: Vec<JobSpec>,
        /// From SubmitJobs (errors name `specs[i]`).
        batch: bool,
        /// The request's W3C trace context (`traceparent`, `tracestate`
        /// metadata), empty if none: the jobs' traces continue it.
        trace_context: HashMap<String, String>,
        /// The submitting user (the jobs' owner; empty without tokens).
        owner: String,
        /// Reply: the table's records of the jobs created, shared (the
        /// server builds their protos, off the core).
        reply: Reply<Vec<Arc<JobRecord>>>,
    },
    /// CancelJob.
    Cancel {
        /// Job or array id.
        id: String,
        /// Reply.
        reply: Reply<Job>,
    },
    /// GetJob.
    Get {
        /// Job id.
        id: String,
        /// Reply.
        reply: Reply<Job>,
    },
    /// ListJobs.
    List {
        /// The request.
        req: ListJobsRequest,
        /// Reply: a page and the next token.
        reply: Reply<(Vec<Job>, String)>,
    },
    /// WatchJobs: the current state of matching jobs and a subscription
    /// taken at the same instant, so no change is missed.
    Watch {
        /// Ids (all when empty).
        ids: Vec<String>,
        /// Send current states first.
        include_current: bool,
        /// Reply.
        reply: Reply<(Vec<Job>, broadcast::Receiver<JobEvent>)>,
    },
    /// StreamLogs.
    Logs {
        /// The request.
        req: StreamLogsRequest,
        /// Where chunks go.
        tx: LogTx,
        /// Reply when the request reached the agent (or failed).
        reply: Reply<()>,
    },
    /// ListNodes.
    Nodes {
        /// Nodes named after this one (all when empty).
        after: String,
        /// At most this many nodes (all when 0).
        page_size: u32,
        /// Reply.
        reply: Reply<ListNodesResponse>,
    },
    /// GetNode.
    Node {
        /// Node name.
        name: String,
        /// Reply.
        reply: Reply<Node>,
    },
    /// Drain / cordon / uncordon.
    NodeAdmin {
        /// Node name.
        name: String,
        /// New state.
        admin: NodeAdmin,
        /// Reply.
        reply: Reply<Node>,
    },
    /// An agent opened its stream and registered.
    Attach {
        /// Its registration.
        register: Box<Register>,
        /// Where to send it messages.
        tx: AgentTx,
        /// Reply: the session number and the stream's [`Beat`], where its
        /// reader leaves liveness and LoadReports for the core.
        reply: Reply<(u64, Arc<Beat>)>,
    },
    /// Agents' beats were queued ([`Beats`]): wakes the core, which
    /// applies them at most every [`crate::beats::FLUSH_MS`].
    Beats,
    /// A message from an agent's stream (not a LoadReport: those go
    /// through its [`Beat`]).
    FromAgent {
        /// Node name.
        node: String,
        /// Session from Attach.
        session: u64,
        /// The message.
        msg: agent_message::Msg,
    },
    /// An agent's stream ended.
    Detach {
        /// Node name.
        node: String,
        /// Session from Attach.
        session: u64,
    },
    /// Stop the core (tests, shutdown).
    Shutdown,
}

impl Command {
    /// Sent by an agent's stream (its commands keep their order among
    /// themselves; the clients' may be held back behind them).
    fn is_agents(&self) -> bool {
        matches!(
            self,
            Command::Attach { .. }
                | Command::FromAgent { .. }
                | Command::Detach { .. }
                | Command::Beats
        )
    }

    /// Applied without settling the cluster first ([`Core::settle`]):
    /// registrations and load reports, which never read the node engine
    /// unless they bring a node back (which settles first itself).
    fn defers_settle(&self) -> bool {
        matches!(
            self,
            Command::Attach { .. }
                | Command::Beats
                | Command::FromAgent {
                    msg: agent_message::Msg::Load(_),
                    ..
                }
        )
    }

    /// The jobs a submission creates (array elements and gang members
    /// each a job; what a bad spec would create counts too).
    fn new_jobs(&self) -> usize {
        match self {
            Command::Submit { specs, .. } => specs
                .iter()
                .map(|s| s.array_count.max(s.nodes).max(1) as usize)
                .sum(),
            _ => 0,
        }
    }
}

/// How callers reach the core.
#[derive(Clone)]
pub struct CoreHandle {
    tx: std_mpsc::Sender<Command>,
    beats: Arc<Beats>,
}

impl CoreHandle {
    /// Send a command and await its reply.
    pub async fn call<T>(&self, make: impl FnOnce(Reply<T>) -> Command) -> Result<T, Status> {
        self.ask(make)?.reply().await?
    }

    /// Send a command now, its reply to be awaited later (several asked
    /// in a row are applied in that order, in as few batches as they
    /// arrive in). Err: the core has stopped.
    pub fn ask<T>(&self, make: impl FnOnce(Reply<T>) -> Command) -> Result<Asked<T>, Status> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(make(reply)).map_err(|_| stopped())?;
        Ok(Asked(rx))
    }

    /// Send a command that has no reply.
    pub fn send(&self, cmd: Command) {
        let _ = self.tx.send(cmd);
    }

    /// The reader of an attached stream's beat: its LoadReports and
    /// liveness reach the core through it, not as commands.
    pub fn reporter(&self, beat: Arc<Beat>) -> Reporter {
        Reporter::new(beat)
    }

    /// A LoadReport read from an attached stream at `now_ms` (`scratch`:
    /// the stream reader's buffer to pack it in).
    pub fn report(
        &self,
        reporter: &mut Reporter,
        report: proto::v1::LoadReport,
        now_ms: i64,
        scratch: &mut Vec<u8>,
    ) {
        let load = report.load.unwrap_or_default();
        if reporter.report(&self.beats, load, report.seq, now_ms, scratch) {
            self.send(Command::Beats);
        }
    }
}

/// A command sent by [`CoreHandle::ask`], its reply to come.
pub struct Asked<T>(oneshot::Receiver<Result<T, Status>>);

impl<T> Asked<T> {
    /// The core's reply; the outer Err: the core stopped without one.
    pub async fn reply(self) -> Result<Result<T, Status>, Status> {
        self.0.await.map_err(|_| stopped())
    }

    /// [`Self::reply`], polled (ready once: not to be polled again).
    pub fn poll_reply(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<Result<T, Status>, Status>> {
        std::pin::Pin::new(&mut self.0)
            .poll(cx)
            .map(|r| r.map_err(|_| stopped()))
    }
}

fn stopped() -> Status {
    Status::unavailable("the dispatcher is shutting down or stepped down as leader; retry")
}

/// What the core does when a commit fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnStoreFailure {
    /// Exit the process (the single embedded-store dispatcher: a restart
    /// recovers from the store).
    ExitProcess,
    /// Stop the core and return the error (a replica that steps down).
    Stop,
}

/// Why the core's thread ended.
#[derive(Debug)]
pub enum CoreExit {
    /// [`Command::Shutdown`], or every handle was dropped.
    Shutdown,
    /// A commit failed; nothing of that batch was acknowledged.
    StoreFailed(StoreError),
}

/// Start the core on its own thread, reporting to `observers`; returns
/// the handle and the thread.
pub fn spawn(
    cluster: Cluster,
    store: Box<dyn Store>,
    on_failure: OnStoreFailure,
    observers: Observers,
) -> (CoreHandle, std::thread::JoinHandle<CoreExit>) {
    let (tx, rx) = std_mpsc::channel();
    let beats = Arc::new(Beats::default());
    let handle = CoreHandle {
        tx,
        beats: beats.clone(),
    };
    let thread = std::thread::Builder::new()
        .name("dispatch-core".into())
        .spawn(move || Core::new(cluster, store, on_failure, observers, beats).run(rx))
        .unwrap_or_else(|e| panic!("cannot start the core thread: {e}"));
    (handle, thread)
}

struct Core {
    cluster: Cluster,
    /// The store, on its own thread.
    store: Committer,
    events: broadcast::Sender<JobEvent>,
    /// The attached nodes' links (their beats), by node name; FxHash, as
    /// the engine's maps of node names: every agent message and every
    /// batch's agent messages look a node up here.
    agents: HashSet<Link, std::hash::BuildHasherDefault<sched::idhash::IdHasher>>,
    next_session: u64,
    logs: HashMap<u64, (String, LogTx)>,
    next_log: u64,
    /// Measured cost of a node-level steal, ns (moving average).
    steal_cost: u64,
    on_failure: OnStoreFailure,
    observers: Observers,
    /// Agents' queued beats.
    beats: Arc<Beats>,
    /// This batch's ListNodes calls (the name a page starts after, the page
    /// size, the reply): answered from copies of the nodes taken after the
    /// batch's commands ([`Core::list_nodes`]).
    listings: Vec<(String, u32, Reply<ListNodesResponse>)>,
    /// Builds the listings' views off the core.
    list_worker: ListWorker,
    /// Clients' commands taken from the queue and held for a later batch
    /// ([`Core::next_batch`]), in order.
    held: VecDeque<Command>,
    /// How many commands the last batch took (the next one's room, so a
    /// batch's vector is not grown, and its commands moved, a push at a
    /// time; capped like [`Effects::with_room`]'s).
    batch_room: usize,
    /// Attached nodes whose beat was told they are DOWN.
    told_down: HashSet<String>,
    /// When [`Core::settle`] last rebuilt the node engine (None: never).
    rebuilt_at: Option<Instant>,
}

/// What a batch releases once it is stored ([`Core::release`]).
struct Release {
    /// Replies to its calls.
    replies: Vec<Deferred>,
    /// Its job events (empty when nothing observes or watches them).
    events: Vec<JobEvent>,
    /// The pending reason of each event for the watchers (empty when none
    /// was watching at the batch's end: the events go to observers only).
    reasons: Vec<Option<proto::v1::PendingReason>>,
    /// Its placements and steals.
    moves: Vec<crate::cluster::Move>,
    /// Its agent messages, each with its node's stream at the batch's end.
    to_agents: Vec<(AgentTx, ToAgent)>,
}

/// A reply to send once the batch is committed.
/// Called with `None` when the batch was committed, else with the status
/// to answer instead.
type Deferred = Box<dyn FnOnce(Option<&Status>) + Send>;

fn defer<T: Send + 'static>(reply: Reply<T>, result: Result<T, Status>) -> Deferred {
    Box::new(move |failed| {
        let r = match failed {
            None => result,
            Some(status) => Err(status.clone()),
        };
        let _ = reply.send(r);
    })
}

/// The answer to callers whose batch could not be committed.
fn commit_failure(err: &StoreError) -> Status {
    match err {
        StoreError::Fenced(_) => Status::unavailable(
            "this dispatcher lost its leadership before the change was stored; nothing was \
             changed: retry on the leader",
        ),
        StoreError::Backend(_) | StoreError::Corrupt { .. } => Status::unavailable(format!(
            "the store failed ({err}); the change may or may not have been stored: check \
             before retrying"
        )),
    }
}

impl Core {
    fn new(
        mut cluster: Cluster,
        store: Box<dyn Store>,
        on_failure: OnStoreFailure,
        observers: Observers,
        beats: Arc<Beats>,
    ) -> Self {
        cluster.limit_stored_spec_bytes(store.max_spec_bytes());
        let (events, _) = broadcast::channel(65_536);
        let store = Committer::spawn(store).unwrap_or_else(|e| panic!("{e}"));
        Self {
            cluster,
            store,
            events,
            agents: HashSet::default(),
            next_session: 1,
            logs: HashMap::new(),
            next_log: 1,
            steal_cost: 0,
            on_failure,
            observers,
            beats,
            listings: Vec::new(),
            list_worker: ListWorker::default(),
            held: VecDeque::new(),
            batch_room: 0,
            told_down: HashSet::new(),
            rebuilt_at: None,
        }
    }

    /// Apply the cluster's deferred work ([`Cluster::settle`]: the node
    /// engine's rebuild after registrations, its placements and the idle
    /// balance) if there is any. The core settles before every command but
    /// a registration or a load report, before a node comes back, before
    /// its tick (and the observers' samples), and otherwise once
    /// [`REBUILD_EVERY`] has passed since the last rebuild: so every
    /// command that reads or places sees the engine as it was when the
    /// core settled after every batch, and a burst of registrations
    /// alone rebuilds a few times a second.
    fn settle(&mut self, now: i64, fx: &mut Effects) {
        if self.cluster.node_engine().is_dirty() {
            self.cluster.settle(now, fx);
            self.rebuilt_at = Some(Instant::now());
        }
    }

    /// When the deferred settle is due (None: nothing to settle): at once
    /// after a quiet spell (a lone node registering is placed on at the
    /// end of its batch), else [`REBUILD_EVERY`] after the last rebuild.
    fn settle_due(&self) -> Option<Instant> {
        if !self.cluster.node_engine().is_dirty() {
            return None;
        }
        Some(
            self.rebuilt_at
                .map_or_else(Instant::now, |at| at + REBUILD_EVERY),
        )
    }

    /// Ends every agent and log stream with `status` (the core stops).
    fn close_streams(&mut self, status: &Status) {
        for link in self.agents.drain() {
            let _ = link.tx.send(Err(status.clone()));
        }
        for (_, (_, tx)) in self.logs.drain() {
            let _ = tx.send(Err(status.clone()));
        }
    }

    fn run(mut self, rx: std_mpsc::Receiver<Command>) -> CoreExit {
        let tick = Duration::from_millis(
            (self.cluster.config().heartbeat_interval_ms / 2).clamp(10, 1000),
        );
        let mut next_tick = Instant::now() + tick;
        let flush = Duration::from_millis(FLUSH_MS);
        let mut next_flush = Instant::now();
        // The batch whose commit runs on the store's thread while the next
        // one is applied; released once it is stored.
        let mut in_flight: Option<Release> = None;
        let mut fx_sizes = [0; 4];
        let mut replies_room = 0;
        loop {
            let first = if in_flight.is_some() {
                // Commands wait: apply them while the commit runs. None:
                // release the batch in flight as soon as it is stored.
                let next = rx.try_recv();
                if next.is_err() && self.held.is_empty() {
                    if let Err(exit) = self.settle_commit(&mut in_flight, &mut Vec::new()) {
                        return exit;
                    }
                    if matches!(next, Err(std_mpsc::TryRecvError::Disconnected)) {
                        self.close_streams(&stopped());
                        return CoreExit::Shutdown;
                    }
                    continue;
                }
                next.ok()
            } else {
                let until = if !self.held.is_empty() {
                    Instant::now()
                } else if self.beats.pending() {
                    next_tick.min(next_flush)
                } else {
                    next_tick
                };
                let until = match self.settle_due() {
                    Some(due) => until.min(due),
                    None => until,
                };
                let wait = until.saturating_duration_since(Instant::now());
                if !wait.is_zero() {
                    crate::idle::idle();
                }
                match rx.recv_timeout(wait) {
                    Ok(cmd) => Some(cmd),
                    Err(std_mpsc::RecvTimeoutError::Timeout) => None,
                    Err(std_mpsc::RecvTimeoutError::Disconnected) => {
                        self.close_streams(&stopped());
                        return CoreExit::Shutdown;
                    }
                }
            };
            let batch = self.next_batch(first, &rx);
            // A watcher subscribing in this batch gets the events of the
            // batches after the state it is shown: the batch in flight
            // publishes its events first.
            let subscribes = batch.iter().any(|c| matches!(c, Command::Watch { .. }));
            if in_flight.is_some()
                && subscribes
                && let Err(exit) = self.settle_commit(&mut in_flight, &mut Vec::new())
            {
                return exit;
            }
            let mut fx = Effects::with_room(fx_sizes);
            // Events are recorded only for someone: a watcher (one that
            // subscribes in this batch gets the changes after its place
            // in it) or an observer.
            fx.drop_events =
                !subscribes && self.events.receiver_count() == 0 && self.observers.is_empty();
            let mut replies: Vec<Deferred> = Vec::with_capacity(replies_room);
            let now = now_ms();
            let mut stop = false;
            let mut batch = batch.into_iter().peekable();
            while let Some(cmd) = batch.next() {
                if matches!(cmd, Command::Shutdown) {
                    stop = true;
                    continue;
                }
                // A run of submissions goes in at once (`apply_submits`).
                if matches!(cmd, Command::Submit { .. })
                    && matches!(batch.peek(), Some(Command::Submit { .. }))
                {
                    let mut run = vec![cmd];
                    while let Some(next) = batch.next_if(|c| matches!(c, Command::Submit { .. })) {
                        run.push(next);
                    }
                    self.settle(now, &mut fx);
                    self.apply_submits(run, now, &mut fx, &mut replies);
                    continue;
                }
                // Steals happen when a job's end frees a node: time those
                // agent messages. The whole message's cost, shared by its
                // steals, is an upper bound, conservative like the seed's
                // 10 us; capped so that a slow outlier cannot switch
                // stealing off for good (no steals, no new samples).
                let measured = matches!(cmd, Command::FromAgent { .. });
                let steals = self.cluster.steals();
                if !cmd.defers_settle() {
                    self.settle(now, &mut fx);
                }
                let started = Instant::now();
                self.apply(cmd, now, &mut fx, &mut replies);
                let stolen = self.cluster.steals().saturating_sub(steals);
                if measured
                    && let Some(sample) = (started.elapsed().as_nanos() as u64).checked_div(stolen)
                {
                    let sample = sample.min(MAX_STEAL_COST_NS);
                    self.steal_cost = if self.steal_cost == 0 {
                        sample
                    } else {
                        (7 * self.steal_cost + sample) / 8
                    };
                }
            }
            self.list_nodes(&mut replies);
            if self.beats.pending() && Instant::now() >= next_flush {
                self.apply_beats(now, &mut fx);
                next_flush = Instant::now() + flush;
            }
            if self.settle_due().is_some_and(|due| Instant::now() >= due) {
                self.settle(now, &mut fx);
            }
            if Instant::now() >= next_tick {
                self.settle(now, &mut fx);
                // Observers sample the cluster after the events they were
                // told of: the batch in flight is released first.
                if let Err(exit) = self.settle_commit(&mut in_flight, &mut replies) {
                    return exit;
                }
                if self.steal_cost > 0 {
                    self.cluster.set_steal_cost(self.steal_cost);
                }
                self.refresh_liveness(now, &mut fx);
                self.cluster.tick(now, &mut fx);
                self.tell_down();
                self.observers.tick(&self.cluster, now);
                next_tick = Instant::now() + tick;
            }
            // The previous batch is stored by now, or soon: released before
            // this one's commit starts, so batches are released in order.
            if let Err(exit) = self.settle_commit(&mut in_flight, &mut replies) {
                return exit;
            }
            self.cluster.write_back(&mut fx);
            // The next batch's effects get this one's room.
            fx_sizes = fx.sizes();
            replies_room = replies.len().min(4096);
            let writes = std::mem::take(&mut fx.writes);
            let release = self.seal(fx, replies, now);
            if let Err(err) = self.store.start(writes) {
                return self.store_failed(err, release.replies);
            }
            in_flight = Some(release);
            if stop {
                if let Err(exit) = self.settle_commit(&mut in_flight, &mut Vec::new()) {
                    return exit;
                }
                self.close_streams(&stopped());
                return CoreExit::Shutdown;
            }
        }
    }

    /// The next batch: every agent command waiting (up to 4096 commands
    /// taken from the queue), then the clients' commands in their order,
    /// held back from the first Submit that would bring the batch past
    /// [`JOBS_PER_BATCH`] new jobs (one client command at least). Agents'
    /// statuses free the room new jobs need, and they are never held up by
    /// a flood of submissions; the submissions wait as commands, in order,
    /// not as jobs queued in the engine, whose placements cost more the
    /// deeper its queues are.
    fn next_batch(
        &mut self,
        first: Option<Command>,
        rx: &std_mpsc::Receiver<Command>,
    ) -> Vec<Command> {
        let mut batch = Vec::with_capacity(self.batch_room);
        let mut taken = 0;
        let mut next = first;
        loop {
            if let Some(cmd) = next.take() {
                taken += 1;
                if cmd.is_agents() {
                    batch.push(cmd);
                } else {
                    self.held.push_back(cmd);
                }
            }
            if taken >= 4096 {
                break;
            }
            match rx.try_recv() {
                Ok(cmd) => next = Some(cmd),
                Err(_) => break,
            }
        }
        let mut jobs = 0;
        let mut clients = 0;
        while let Some(cmd) = self.held.front() {
            let n = cmd.new_jobs();
            if clients > 0 && jobs + n > JOBS_PER_BATCH {
                break;
            }
            jobs += n;
            clients += 1;
            batch.extend(self.held.pop_front());
        }
        self.batch_room = batch.len().min(4096);
        batch
    }

    /// What a batch releases once it is stored: the events observers and
    /// watchers get (built now, with the pending reasons as the batch left
    /// the jobs), and each agent message with the stream its node had at
    /// the batch's end.
    fn seal(&mut self, mut fx: Effects, replies: Vec<Deferred>, now: i64) -> Release {
        // An attempt assigned and taken back within the batch is not sent.
        self.cluster.drop_taken_back_assigns(&mut fx);
        // The batch's job changes carry shared records: materialised here,
        // once, as the events observers and watchers get, and only when
        // someone gets them (a copy of every record each transition was a
        // sixth of the core's work per job).
        let watched = self.events.receiver_count() > 0;
        let events: Vec<JobEvent> = if watched || !self.observers.is_empty() {
            fx.events.iter().map(JobChange::to_event).collect()
        } else {
            Vec::new()
        };
        let reasons = if watched {
            let mut why = self.cluster.explainer(now);
            events
                .iter()
                .map(|ev| {
                    // The reason describes the job now: only an event of
                    // the state the job is still in carries it.
                    let job = ev.job.as_ref()?;
                    if self.cluster.phase(&job.id).map(|p| p.state() as i32) != Some(job.state) {
                        return None;
                    }
                    why.reason_of(JobKey::parse(&job.id)?)
                })
                .collect()
        } else {
            Vec::new()
        };
        if tracing::enabled!(target: "lat", tracing::Level::DEBUG) {
            for (_, msg) in &fx.to_agents {
                if let Some(job) = msg.assigned_id() {
                    tracing::debug!(target: "lat", %job, "assign sealed");
                }
            }
        }
        let to_agents = fx
            .to_agents
            .into_iter()
            .filter_map(|(node, msg)| Some((self.agents.get(node.as_str())?.tx.clone(), msg)))
            .collect();
        Release {
            replies,
            events,
            reasons,
            moves: fx.moves,
            to_agents,
        }
    }

    /// Wait for the batch in flight to be stored, then release it. When the
    /// commit failed, its callers and those of `current` (a batch applied
    /// since, never to be committed) are answered with the failure and the
    /// core stops.
    fn settle_commit(
        &mut self,
        in_flight: &mut Option<Release>,
        current: &mut Vec<Deferred>,
    ) -> Result<(), CoreExit> {
        let Some(release) = in_flight.take() else {
            return Ok(());
        };
        let waited = self.store.wait();
        for s in self.store.take_stored() {
            self.observers.stored(s.writes, s.seconds);
        }
        if let Err(err) = waited {
            let mut replies = release.replies;
            replies.append(current);
            return Err(self.store_failed(err, replies));
        }
        self.release(release);
        Ok(())
    }

    /// A commit failed: nothing of its batch (nor of any later one) was
    /// acknowledged; the callers get the failure, the streams end, and the
    /// core exits or stops.
    fn store_failed(&mut self, err: StoreError, replies: Vec<Deferred>) -> CoreExit {
        let status = commit_failure(&err);
        for r in replies {
            r(Some(&status));
        }
        self.close_streams(&status);
        if self.on_failure == OnStoreFailure::ExitProcess {
            tracing::error!(%err, "store commit failed: exiting so a restart recovers from the store");
            std::process::exit(70);
        }
        tracing::error!(%err, "store commit failed: the core stops");
        CoreExit::StoreFailed(err)
    }

    /// A stored batch: its replies, then its events to the observers, its
    /// agent messages, and its events to the watchers.
    fn release(&mut self, r: Release) {
        for reply in r.replies {
            reply(None);
        }
        // Observers first: an Assign carries its job's `run` span context,
        // which the batch's events open.
        self.observers.committed(&r.events);
        self.observers.moved(&r.moves);
        let lat = tracing::enabled!(target: "lat", tracing::Level::DEBUG);
        for (tx, msg) in r.to_agents {
            // An Assign carries its job's trace context; a plain job's is
            // built on the stream's side (`outbound`), with the context.
            let job = (lat || !self.observers.is_empty())
                .then(|| msg.assigned_id().map(|id| id.into_owned()))
                .flatten();
            let carrier = job
                .as_deref()
                .and_then(|id| self.observers.trace_context(id));
            if let Some(job) = &job {
                tracing::debug!(target: "lat", %job, "assign sent");
            }
            let _ = tx.send_to_agent(msg, carrier);
        }
        if !r.reasons.is_empty() {
            for (mut ev, reason) in r.events.into_iter().zip(r.reasons) {
                if let Some(job) = ev.job.as_mut() {
                    job.pending_reason = reason;
                }
                let _ = self.events.send(ev);
            }
        }
    }

    /// A run of Submit commands (two or more in a row in a batch), each
    /// answered on its own as [`Core::apply`] would, applied by
    /// [`Cluster::submit_each`]: every submission checked and created,
    /// then every job placed, which runs each step's code for all the
    /// jobs in a row instead of one job's whole way at a time. The run's
    /// time is shared among its submissions by their number of specs.
    fn apply_submits(
        &mut self,
        run: Vec<Command>,
        now: i64,
        fx: &mut Effects,
        replies: &mut Vec<Deferred>,
    ) {
        let mut subs = Vec::with_capacity(run.len());
        let mut answers = Vec::with_capacity(run.len());
        for cmd in run {
            if let Command::Submit {
                specs,
                batch,
                trace_context,
                owner,
                reply,
            } = cmd
            {
                answers.push((specs.len(), trace_context, reply));
                subs.push((owner, specs, batch));
            }
        }
        let total: usize = answers.iter().map(|a| a.0).sum();
        let started = Instant::now();
        let results = self.cluster.submit_each(
            subs.iter_mut()
                .map(|(owner, specs, batch)| (owner.as_str(), std::mem::take(specs), *batch)),
            now,
            fx,
        );
        let secs = started.elapsed().as_secs_f64();
        for ((n, trace_context, reply), r) in answers.into_iter().zip(results) {
            let share = secs * n as f64 / total.max(1) as f64;
            self.answer_submit((n, share), r, &trace_context, reply, replies);
        }
    }

    /// A submission of `n` specs applied in `secs`: traced, observed, and
    /// its answer deferred to the batch's commit.
    fn answer_submit(
        &self,
        (n, secs): (usize, f64),
        r: Result<Vec<Arc<JobRecord>>, Status>,
        trace_context: &HashMap<String, String>,
        reply: Reply<Vec<Arc<JobRecord>>>,
        replies: &mut Vec<Deferred>,
    ) {
        let created = r.as_deref().unwrap_or_default();
        if let (Some(first), Some(last)) = (created.first(), created.last()) {
            tracing::debug!(target: "lat", first = %first.id(), last = %last.id(), "submit applied");
        }
        self.observers.submitted(n, secs, created, trace_context);
        replies.push(defer(reply, r));
    }

    fn apply(&mut self, cmd: Command, now: i64, fx: &mut Effects, replies: &mut Vec<Deferred>) {
        match cmd {
            Command::Submit {
                specs,
                batch,
                trace_context,
                owner,
                reply,
            } => {
                let (n, started) = (specs.len(), Instant::now());
                let r = self.cluster.submit_as(&owner, specs, batch, now, fx);
                let secs = started.elapsed().as_secs_f64();
                self.answer_submit((n, secs), r, &trace_context, reply, replies);
            }
            Command::Cancel { id, reply } => {
                let r = self.cluster.cancel(&id, now, fx);
                replies.push(defer(reply, r));
            }
            // Reads answer after the commit too: they may show what this
            // batch changed, which a failed commit drops.
            // Pending reasons are computed here, when read, never stored.
            Command::Get { id, reply } => {
                let r = self.cluster.get_job(&id).map(|mut job| {
                    self.cluster.explainer(now).fill(&mut job);
                    job
                });
                replies.push(defer(reply, r));
            }
            Command::List { req, reply } => {
                let r = self.cluster.list_jobs(&req).map(|(mut jobs, next)| {
                    let mut why = self.cluster.explainer(now);
                    jobs.iter_mut().for_each(|j| why.fill(j));
                    (jobs, next)
                });
                replies.push(defer(reply, r));
            }
            Command::Watch {
                ids,
                include_current,
                reply,
            } => {
                let current = if include_current {
                    let mut jobs = self.cluster.jobs_matching(&ids);
                    let mut why = self.cluster.explainer(now);
                    jobs.iter_mut().for_each(|j| why.fill(j));
                    jobs
                } else {
                    Vec::new()
                };
                replies.push(defer(reply, Ok((current, self.events.subscribe()))));
            }
            Command::Logs { req, tx, reply } => {
                let _ = reply.send(self.start_logs(req, tx));
            }
            // Listed after the batch's commands (list_nodes): the nodes as
            // committed with this batch.
            Command::Nodes {
                after,
                page_size,
                reply,
            } => self.listings.push((after, page_size, reply)),
            Command::Node { name, reply } => {
                replies.push(defer(
                    reply,
                    self.cluster.node(&name).map(|n| self.cluster.node_proto(n)),
                ));
            }
            Command::NodeAdmin { name, admin, reply } => {
                let r = self.cluster.set_node_admin(&name, admin, now, fx);
                replies.push(defer(reply, r));
            }
            Command::Attach {
                register,
                tx,
                reply,
            } => {
                let node = register.node.clone();
                match self.cluster.register(*register, now, fx) {
                    Ok(heartbeat_interval_ms) => {
                        let session = self.next_session;
                        self.next_session += 1;
                        let tx = tx.in_session(session);
                        let hello = DispatcherMessage {
                            msg: Some(dispatcher_message::Msg::Registered(Registered {
                                heartbeat_interval_ms,
                                lease_ms: self.cluster.config().agent_lease_ms(),
                                // A batch is applied here like its
                                // statuses one by one, in this batch of
                                // commands: one store commit.
                                status_batches: true,
                            })),
                        };
                        let _ = tx.send(Ok(hello));
                        let beat = self.beats.beat(&node, session, tx, now);
                        if let Some(old) = self.agents.replace(Link(beat.clone())) {
                            old.set_ended();
                            let _ = old.tx.send(Err(Status::aborted(
                                "another agent registered with this node name",
                            )));
                        }
                        tracing::info!(%node, session, "agent attached");
                        // The agent cannot report before it reads its
                        // Registered, which reaches it with this reply,
                        // after the batch's commit: its heartbeat clock
                        // starts at the release (on this thread, before
                        // any later tick checks it), not at `now`. A
                        // commit that stalls past the heartbeat deadline
                        // (an fsync behind a flood of dirty pages) would
                        // otherwise mark DOWN, and retry the jobs of, a
                        // node that was only waiting for the dispatcher.
                        let answered = Arc::clone(&beat);
                        let attached = defer(reply, Ok((session, beat)));
                        replies.push(Box::new(move |failed| {
                            if failed.is_none() {
                                answered.alive(now_ms());
                            }
                            attached(failed);
                        }));
                    }
                    Err(status) => {
                        let _ = reply.send(Err(status));
                    }
                }
            }
            Command::FromAgent { node, session, msg } => {
                if self.agents.get(node.as_str()).map(|l| l.session()) != Some(session) {
                    return;
                }
                match msg {
                    agent_message::Msg::Register(_) => {}
                    agent_message::Msg::Load(report) => {
                        self.cluster
                            .load_report(&node, report.load.unwrap_or_default(), now, fx);
                        // Renew the agent's lease; it goes out after this
                        // batch's commit, so only a leader that can still
                        // write grants one.
                        if report.seq != 0 {
                            let lease = proto::v1::Lease {
                                seq: report.seq,
                                lease_ms: self.cluster.config().agent_lease_ms(),
                            };
                            fx.to_agents.push((
                                node.into(),
                                DispatcherMessage {
                                    msg: Some(dispatcher_message::Msg::Lease(lease)),
                                }
                                .into(),
                            ));
                        }
                    }
                    agent_message::Msg::Status(status) => {
                        self.cluster.load_report_time(&node, now);
                        self.cluster.job_status(&node, status, now, fx);
                    }
                    agent_message::Msg::Statuses(batch) => {
                        self.cluster.load_report_time(&node, now);
                        self.cluster.job_statuses(&node, batch.statuses, now, fx);
                    }
                    agent_message::Msg::Log(data) => self.forward_log(data),
                    agent_message::Msg::StealReply(reply) => {
                        self.cluster.steal_reply(&node, reply, now, fx);
                    }
                }
            }
            Command::Beats => {}
            Command::Detach { node, session } => {
                if self.agents.get(node.as_str()).map(|l| l.session()) == Some(session) {
                    // What the stream said before it ended counts, as
                    // when every report was a command ahead of this one.
                    if let Some(link) = self.agents.take(node.as_str()) {
                        if let Some(load) = link.take().load {
                            self.cluster.load_report(&node, load, now, fx);
                        }
                        self.account_liveness(&node, link.last_ms());
                    }
                    self.cluster.disconnected(&node);
                    tracing::info!(%node, session, "agent detached");
                    // Log streams served by this agent end.
                    self.logs.retain(|_, (n, tx)| {
                        if *n == node {
                            let _ = tx.send(Err(Status::unavailable(format!(
                                "node {node} disconnected"
                            ))));
                            false
                        } else {
                            true
                        }
                    });
                }
            }
            Command::Shutdown => {}
        }
    }

    /// Apply the queued beats: changed loads, DOWN nodes reporting again
    /// (revived as by a LoadReport command), leases (sent after this
    /// batch's commit). Beats of a replaced or ended stream are dropped,
    /// as its commands were.
    fn apply_beats(&mut self, now: i64, fx: &mut Effects) {
        for beat in self.beats.drain() {
            let pending = beat.take();
            let Some(link) = self.agents.get(&*beat.node) else {
                continue;
            };
            if link.session() != beat.session() {
                continue;
            }
            let report_ms = beat.last_report_ms();
            let Ok(n) = self.cluster.node(&beat.node) else {
                continue;
            };
            let revive = n.down && report_ms > link.applied_report_ms();
            if pending.load.is_some() || revive {
                let load = pending.load.unwrap_or_else(|| n.load.clone());
                if revive && self.cluster.node_engine().is_dirty() {
                    // A node coming back is placed on at once, by the
                    // engine as the last batch would have left it
                    // ([`Core::settle`], its fields borrowed apart).
                    self.cluster.settle(now, fx);
                    self.rebuilt_at = Some(Instant::now());
                }
                self.cluster.load_report(&beat.node, load, now, fx);
                link.set_applied_report_ms(report_ms);
            }
            // Renew the agent's lease; it goes out after this batch's
            // commit, so only a leader that can still write grants one.
            if pending.lease_seq != 0 {
                let lease = proto::v1::Lease {
                    seq: pending.lease_seq,
                    lease_ms: self.cluster.config().agent_lease_ms(),
                };
                fx.to_agents.push((
                    NodeName::from(&*beat.node),
                    DispatcherMessage {
                        msg: Some(dispatcher_message::Msg::Lease(lease)),
                    }
                    .into(),
                ));
            }
        }
    }

    /// This batch's ListNodes calls: one copy of every node for the calls
    /// that list them all, and of its page's nodes for each paged call,
    /// taken here after the batch's commands; the views are built off the
    /// core once the batch is committed (a failed commit answers its error
    /// instead, as for every reply of the batch).
    fn list_nodes(&mut self, replies: &mut Vec<Deferred>) {
        let mut every_node: Option<Arc<Vec<NodeCopy>>> = None;
        for (after, page_size, reply) in std::mem::take(&mut self.listings) {
            let (copies, next) = if page_size == 0 && after.is_empty() {
                let all = every_node.get_or_insert_with(|| Arc::new(self.cluster.node_copies()));
                (Arc::clone(all), String::new())
            } else {
                let (page, next) = self.cluster.node_copies_page(&after, page_size as usize);
                (Arc::new(page), next)
            };
            let worker = self.list_worker.sender();
            replies.push(Box::new(move |failed: Option<&Status>| match failed {
                None => worker.send(copies, next, reply),
                Some(status) => {
                    let _ = reply.send(Err(status.clone()));
                }
            }));
        }
    }

    /// `node`'s last message arrived at `last_ms`: its heartbeat time
    /// moves there (never back).
    fn account_liveness(&mut self, node: &str, last_ms: i64) {
        if self
            .cluster
            .node(node)
            .is_ok_and(|n| last_ms > n.last_heartbeat_ms)
        {
            self.cluster.load_report_time(node, last_ms);
        }
    }

    /// Before the tick's heartbeat deadline check: every attached node's
    /// heartbeat time from its stream's last message (one pass over the
    /// nodes, a hash lookup each), and a DOWN node that sent a LoadReport
    /// since it was last accounted for comes back (the beat was not queued
    /// if the report changed nothing and came before the core said the node
    /// was DOWN).
    fn refresh_liveness(&mut self, now: i64, fx: &mut Effects) {
        for node in &self.told_down {
            let Some(link) = self.agents.get(node.as_str()) else {
                continue;
            };
            let report_ms = link.last_report_ms();
            let Ok(n) = self.cluster.node(node) else {
                continue;
            };
            if n.down && report_ms > link.applied_report_ms() {
                let load = n.load.clone();
                self.cluster.load_report(node, load, now, fx);
            }
        }
        // A `Link` hashes and compares its node's name, which never
        // changes; its interior mutability is the beat's atomics.
        #[allow(clippy::mutable_key_type)]
        let agents = &self.agents;
        self.cluster.heard_from(|node| {
            let link = agents.get(node)?;
            // Every report so far is accounted for: only a later one
            // revives the node if this tick marks it DOWN. (Not for a node
            // DOWN already: a report read since the pass above revives it
            // when its queued beat is applied.)
            if !link.is_down() {
                link.set_applied_report_ms(link.applied_report_ms().max(link.last_report_ms()));
            }
            Some(link.last_ms())
        });
    }

    /// After the tick: each stream learns whether its node is DOWN, so
    /// that its next LoadReport is queued (and revives it) even if it
    /// changes nothing. One pass over the nodes; only DOWN ones, and those
    /// told so before, are looked up.
    fn tell_down(&mut self) {
        let down: HashSet<String> = self
            .cluster
            .nodes()
            .filter(|n| n.down && self.agents.contains(n.name.as_str()))
            .map(|n| n.name.to_string())
            .collect();
        for node in self.told_down.difference(&down) {
            if let Some(link) = self.agents.get(node.as_str()) {
                link.set_down(false);
            }
        }
        for node in &down {
            if let Some(link) = self.agents.get(node.as_str()) {
                link.set_down(true);
            }
        }
        self.told_down = down;
    }

    /// A spec the store could not hold in one record, as the caller's
    /// error (naming `spec` or `specs[i]`).
    fn start_logs(&mut self, req: StreamLogsRequest, tx: LogTx) -> Result<(), Status> {
        let job = self.cluster.get_job(&req.id)?;
        if job.node.is_empty() || job.state == proto::v1::JobState::Pending as i32 {
            return Err(Status::failed_precondition(format!(
                "id: job {} has not started on a node yet",
                req.id
            )));
        }
        let link = self.agents.get(job.node.as_str()).ok_or_else(|| {
            Status::unavailable(format!(
                "node {} holding the logs of {} is not connected",
                job.node, req.id
            ))
        })?;
        let request_id = self.next_log;
        self.next_log += 1;
        let msg = DispatcherMessage {
            msg: Some(dispatcher_message::Msg::LogRequest(LogRequest {
                request_id,
                job_id: req.id.clone(),
                stream: req.stream,
                offset: req.offset,
                follow: req.follow,
            })),
        };
        link.tx
            .send(Ok(msg))
            .map_err(|_| Status::unavailable(format!("node {} is not connected", job.node)))?;
        self.logs.insert(request_id, (job.node, tx));
        Ok(())
    }

    fn forward_log(&mut self, data: proto::v1::LogData) {
        let Some((_, tx)) = self.logs.get(&data.request_id) else {
            return;
        };
        let mut done = data.eof;
        if !data.error.is_empty() {
            let _ = tx.send(Err(Status::not_found(data.error.clone())));
            done = true;
        } else if !data.data.is_empty() || data.truncated {
            let chunk = LogChunk {
                data: data.data,
                offset: data.offset,
                truncated: data.truncated,
            };
            if tx.send(Ok(chunk)).is_err() {
                done = true;
            }
        }
        if done {
            self.logs.remove(&data.request_id);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use proto::v1::{JobState, Register};
    use sched::Topology;

    use super::*;
    use crate::cluster::ClusterConfig;
    use crate::observe::Observer;
    use crate::store::Write;
    use crate::store::embedded::EmbeddedStore;

    const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    /// An observer that records what the core reports and hands out one
    /// trace context for every job.
    #[derive(Default)]
    struct Recorder {
        submitted: Mutex<Vec<usize>>,
        in_trace: Mutex<Vec<(String, String)>>,
        /// (job id, state) of every committed event, in order.
        committed: Mutex<Vec<(String, JobState)>>,
        /// Nodes the cluster had at each tick.
        ticks: Mutex<Vec<usize>>,
    }

    fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
        m.lock().unwrap_or_else(|e| e.into_inner())
    }

    impl Observer for Recorder {
        fn submitted(&self, jobs: usize, _seconds: f64) {
            lock(&self.submitted).push(jobs);
        }

        fn submitted_in_trace(&self, jobs: &[Arc<JobRecord>], carrier: &HashMap<String, String>) {
            for j in jobs {
                lock(&self.in_trace).push((j.id(), carrier["traceparent"].clone()));
            }
        }

        fn tick(&self, cluster: &Cluster, _now_ms: i64) {
            lock(&self.ticks).push(cluster.nodes().count());
        }

        fn committed(&self, events: &[JobEvent]) {
            for ev in events {
                if let Some(j) = &ev.job {
                    let state = JobState::try_from(j.state).unwrap_or_default();
                    lock(&self.committed).push((j.id.clone(), state));
                }
            }
        }

        /// Names the job, and whether its events were observed before its
        /// assignment asked for the context (they must be: telemetry opens
        /// the span the assignment names from them).
        fn trace_context(&self, job_id: &str) -> HashMap<String, String> {
            let seen = lock(&self.committed).iter().any(|(j, _)| j == job_id);
            let when = if seen { "after" } else { "before" };
            [(
                "traceparent".to_string(),
                format!("{job_id} {when} its events"),
            )]
            .into()
        }
    }

    fn spec() -> JobSpec {
        JobSpec {
            command: vec!["true".into()],
            cpus: 1,
            ..Default::default()
        }
    }

    /// A core on a default cluster, an embedded store in `dir`, no
    /// observers.
    fn spawn_default(dir: &tempfile::TempDir) -> (CoreHandle, std::thread::JoinHandle<CoreExit>) {
        spawn(
            Cluster::new(ClusterConfig::default()),
            Box::new(EmbeddedStore::open(dir.path()).unwrap()),
            OnStoreFailure::Stop,
            Observers::none(),
        )
    }

    /// Attach a node named `node` to `core`; its agent's receiving end.
    async fn attach(core: &CoreHandle, node: &str) -> crate::outbound::AgentRx {
        let (tx, agent) = crate::outbound::channel();
        core.call(|reply| Command::Attach {
            register: Box::new(register(node)),
            tx,
            reply,
        })
        .await
        .unwrap();
        agent
    }

    fn register(node: &str) -> Register {
        Register {
            node: node.into(),
            topology: Some(engine_proto::topology(
                &Topology::from_spec("1s:2c:1t").unwrap(),
            )),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn the_core_reports_to_the_observers_it_was_built_with() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(dir.path()).unwrap();
        let recorder = Arc::new(Recorder::default());
        let observers = Observers::none().with(recorder.clone());
        let (core, thread) = spawn(
            Cluster::new(ClusterConfig::default()),
            Box::new(store),
            OnStoreFailure::Stop,
            observers,
        );
        let mut agent = attach(&core, "n1").await;
        let trace: HashMap<String, String> =
            [("traceparent".to_string(), TRACEPARENT.to_string())].into();
        let jobs = core
            .call(|reply| Command::Submit {
                specs: vec![spec()],
                batch: false,
                trace_context: trace,
                owner: String::new(),
                reply,
            })
            .await
            .unwrap();
        let id = jobs[0].id();
        let assign = loop {
            let msg = agent.recv().await.unwrap().unwrap();
            if let Some(dispatcher_message::Msg::Assign(a)) = msg.msg {
                break a;
            }
        };
        assert_eq!(assign.job_id, id);
        // The assignment carries the observer's trace context, and the
        // observer saw the batch committed before the message left.
        assert_eq!(
            assign.trace_context["traceparent"],
            format!("{id} after its events")
        );
        assert!(
            lock(&recorder.committed).contains(&(id.clone(), JobState::Assigned)),
            "{:?}",
            lock(&recorder.committed)
        );
        assert_eq!(*lock(&recorder.submitted), [1]);
        assert_eq!(
            *lock(&recorder.in_trace),
            [(id.clone(), TRACEPARENT.to_string())]
        );
        // The tick (every 500 ms with the default heartbeat) samples the
        // cluster into the observers.
        let deadline = Instant::now() + Duration::from_secs(5);
        while lock(&recorder.ticks).is_empty() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(lock(&recorder.ticks).first(), Some(&1));
        core.send(Command::Shutdown);
        assert!(matches!(thread.join().unwrap(), CoreExit::Shutdown));
    }

    /// A store whose commits fail after `ok` of them succeeded.
    struct FailingStore {
        inner: EmbeddedStore,
        ok: usize,
    }

    impl Store for FailingStore {
        fn load(&self) -> Result<crate::store::Snapshot, StoreError> {
            self.inner.load()
        }

        fn commit(&mut self, writes: &[Write]) -> Result<(), StoreError> {
            if self.ok == 0 {
                return Err(StoreError::Backend("the disk is full".into()));
            }
            self.ok -= 1;
            self.inner.commit(writes)
        }
    }

    /// Where the answer to one command arrives.
    type Answer<T> = oneshot::Receiver<Result<T, Status>>;

    /// The replies of one batch: a submission, then every read of it.
    struct Reads {
        submit: Answer<Vec<Arc<JobRecord>>>,
        get: Answer<Job>,
        list: Answer<(Vec<Job>, String)>,
        watch: Answer<(Vec<Job>, broadcast::Receiver<JobEvent>)>,
    }

    /// Queue a submission of one job followed by a Get, a List and a Watch
    /// of it, so that the core takes them as one batch, then run the core
    /// on this thread until it stops.
    fn one_batch(store: Box<dyn Store>) -> (Reads, CoreExit) {
        let (tx, rx) = std_mpsc::channel();
        let (submit, s) = oneshot::channel();
        let (get, g) = oneshot::channel();
        let (list, l) = oneshot::channel();
        let (watch, w) = oneshot::channel();
        let commands = [
            Command::Submit {
                specs: vec![spec()],
                batch: false,
                trace_context: HashMap::new(),
                owner: String::new(),
                reply: submit,
            },
            Command::Get {
                id: "j-1".into(),
                reply: get,
            },
            Command::List {
                req: ListJobsRequest::default(),
                reply: list,
            },
            Command::Watch {
                ids: Vec::new(),
                include_current: true,
                reply: watch,
            },
            Command::Shutdown,
        ];
        for c in commands {
            tx.send(c).unwrap();
        }
        let core = Core::new(
            Cluster::new(ClusterConfig::default()),
            store,
            OnStoreFailure::Stop,
            Observers::none(),
            Arc::new(Beats::default()),
        );
        let exit = core.run(rx);
        let reads = Reads {
            submit: s,
            get: g,
            list: l,
            watch: w,
        };
        (reads, exit)
    }

    #[test]
    fn reads_in_a_batch_see_its_jobs_once_it_is_committed() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(dir.path()).unwrap();
        let (mut r, exit) = one_batch(Box::new(store));
        assert!(matches!(exit, CoreExit::Shutdown));
        assert_eq!(r.submit.try_recv().unwrap().unwrap()[0].id(), "j-1");
        assert_eq!(r.get.try_recv().unwrap().unwrap().id, "j-1");
        let (page, _) = r.list.try_recv().unwrap().unwrap();
        assert_eq!(page.len(), 1);
        let (current, _) = r.watch.try_recv().unwrap().unwrap();
        assert_eq!(current.len(), 1);
    }

    #[test]
    fn no_read_in_a_batch_whose_commit_fails_sees_the_dropped_job() {
        let dir = tempfile::tempdir().unwrap();
        let store = FailingStore {
            inner: EmbeddedStore::open(dir.path()).unwrap(),
            ok: 0,
        };
        let (mut r, exit) = one_batch(Box::new(store));
        assert!(matches!(exit, CoreExit::StoreFailed(_)));
        let unavailable = |s: &Status| s.code() == tonic::Code::Unavailable;
        let submit = r.submit.try_recv().unwrap();
        assert!(submit.as_ref().is_err_and(unavailable), "{submit:?}");
        let get = r.get.try_recv().unwrap();
        assert!(get.as_ref().is_err_and(unavailable), "Get saw {get:?}");
        let list = r.list.try_recv().unwrap();
        assert!(list.as_ref().is_err_and(unavailable), "List saw {list:?}");
        match r.watch.try_recv().unwrap() {
            Ok((current, _)) => panic!("Watch saw {current:?}"),
            Err(s) => assert!(unavailable(&s), "{s:?}"),
        }
        // Nothing of the batch was stored.
        let stored = EmbeddedStore::open(dir.path()).unwrap().load().unwrap();
        assert!(stored.jobs.is_empty());
    }

    /// `n` Gets whose answers nobody waits for: they fill a batch, so the
    /// commands queued after them make the next one.
    fn filler(n: usize) -> impl Iterator<Item = Command> {
        (0..n).map(|_| Command::Get {
            id: "j-1".into(),
            reply: oneshot::channel().0,
        })
    }

    fn submit_cmd(reply: Reply<Vec<Arc<JobRecord>>>) -> Command {
        Command::Submit {
            specs: vec![spec()],
            batch: false,
            trace_context: HashMap::new(),
            owner: String::new(),
            reply,
        }
    }

    /// Submissions in a row in one batch go in at once (`apply_submits`),
    /// each answered as if alone: a bad one gets its error naming the
    /// field and creates nothing; the others' jobs are created and stored,
    /// numbered in order; a later one may name an earlier one's job as its
    /// waker.
    #[test]
    fn a_run_of_submissions_is_answered_each() {
        let dir = tempfile::tempdir().unwrap();
        let (tx, rx) = std_mpsc::channel();
        let submit = |spec: JobSpec, reply| Command::Submit {
            specs: vec![spec],
            batch: false,
            trace_context: HashMap::new(),
            owner: String::new(),
            reply,
        };
        let (r1, mut a1) = oneshot::channel();
        let (r2, mut a2) = oneshot::channel();
        let (r3, mut a3) = oneshot::channel();
        tx.send(submit(spec(), r1)).unwrap();
        let bad = JobSpec {
            command: Vec::new(),
            ..spec()
        };
        tx.send(submit(bad, r2)).unwrap();
        let woken = JobSpec {
            waker: "j-1".into(),
            ..spec()
        };
        tx.send(submit(woken, r3)).unwrap();
        tx.send(Command::Shutdown).unwrap();
        let core = Core::new(
            Cluster::new(ClusterConfig::default()),
            Box::new(EmbeddedStore::open(dir.path()).unwrap()),
            OnStoreFailure::Stop,
            Observers::none(),
            Arc::new(Beats::default()),
        );
        assert!(matches!(core.run(rx), CoreExit::Shutdown));
        let ids = |r: Result<Vec<Arc<JobRecord>>, Status>| -> Vec<String> {
            r.unwrap().iter().map(|j| j.id()).collect()
        };
        assert_eq!(ids(a1.try_recv().unwrap()), ["j-1"]);
        let refused = a2.try_recv().unwrap().unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument);
        assert!(refused.message().contains("spec.command"), "{refused:?}");
        assert_eq!(ids(a3.try_recv().unwrap()), ["j-2"]);
        let stored = EmbeddedStore::open(dir.path()).unwrap().load().unwrap();
        let mut stored: Vec<_> = stored.jobs.iter().map(|j| j.id.clone()).collect();
        stored.sort();
        assert_eq!(stored, ["j-1", "j-2"]);
    }

    /// The next batch is applied while the previous one's commit runs; when
    /// that commit fails, the calls of both are answered with the failure
    /// (the later batch is never committed) and nothing is stored.
    #[test]
    fn a_failed_commit_also_fails_the_batch_applied_meanwhile() {
        let dir = tempfile::tempdir().unwrap();
        let store = FailingStore {
            inner: EmbeddedStore::open(dir.path()).unwrap(),
            ok: 0,
        };
        let (tx, rx) = std_mpsc::channel();
        let (submit, mut s) = oneshot::channel();
        let (get, mut g) = oneshot::channel();
        tx.send(submit_cmd(submit)).unwrap();
        filler(4095).for_each(|c| tx.send(c).unwrap());
        // The next batch: the job exists in memory, its commit is failing.
        tx.send(Command::Get {
            id: "j-1".into(),
            reply: get,
        })
        .unwrap();
        let core = Core::new(
            Cluster::new(ClusterConfig::default()),
            Box::new(store),
            OnStoreFailure::Stop,
            Observers::none(),
            Arc::new(Beats::default()),
        );
        assert!(matches!(core.run(rx), CoreExit::StoreFailed(_)));
        let unavailable = |s: &Status| s.code() == tonic::Code::Unavailable;
        let submit = s.try_recv().unwrap();
        assert!(submit.as_ref().is_err_and(unavailable), "{submit:?}");
        let get = g.try_recv().unwrap();
        assert!(get.as_ref().is_err_and(unavailable), "Get saw {get:?}");
        let stored = EmbeddedStore::open(dir.path()).unwrap().load().unwrap();
        assert!(stored.jobs.is_empty());
    }

    /// A batch takes every agent command waiting first, then the clients'
    /// commands in order up to `JOBS_PER_BATCH` new jobs (a larger first
    /// call whole); the rest wait, in order, for the next batches.
    #[test]
    fn batches_take_agents_first_and_a_bounded_number_of_new_jobs() {
        let dir = tempfile::tempdir().unwrap();
        let mut core = Core::new(
            Cluster::new(ClusterConfig::default()),
            Box::new(EmbeddedStore::open(dir.path()).unwrap()),
            OnStoreFailure::Stop,
            Observers::none(),
            Arc::new(Beats::default()),
        );
        let (tx, rx) = std_mpsc::channel();
        let array = |n: u32| Command::Submit {
            specs: vec![JobSpec {
                array_count: n,
                ..spec()
            }],
            batch: false,
            trace_context: HashMap::new(),
            owner: String::new(),
            reply: oneshot::channel().0,
        };
        let status = || Command::FromAgent {
            node: "n1".into(),
            session: 1,
            msg: agent_message::Msg::Status(proto::v1::JobStatus::default()),
        };
        for c in [
            array(3000),
            array(1000),
            status(),
            array(1000),
            array(48),
            array(1),
            Command::Get {
                id: "j-1".into(),
                reply: oneshot::channel().0,
            },
            status(),
        ] {
            tx.send(c).unwrap();
        }
        let shape = |b: Vec<Command>| -> Vec<String> {
            b.iter()
                .map(|c| match c {
                    Command::Submit { specs, .. } => format!("submit {}", specs[0].array_count),
                    Command::FromAgent { .. } => "status".into(),
                    Command::Get { .. } => "get".into(),
                    _ => "other".into(),
                })
                .collect()
        };
        let first = rx.try_recv().ok();
        assert_eq!(
            shape(core.next_batch(first, &rx)),
            ["status", "status", "submit 3000"]
        );
        assert_eq!(
            shape(core.next_batch(None, &rx)),
            ["submit 1000", "submit 1000", "submit 48"]
        );
        assert_eq!(shape(core.next_batch(None, &rx)), ["submit 1", "get"]);
        assert!(core.next_batch(None, &rx).is_empty());
    }

    /// A watcher that subscribes while the previous batch's commit runs gets
    /// none of that batch's events (its state is in what the watcher is
    /// shown); a watcher from before gets them all, in order.
    #[test]
    fn a_new_watcher_gets_no_event_of_the_batch_in_flight() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(dir.path()).unwrap();
        let (tx, rx) = std_mpsc::channel();
        let watch = |reply| Command::Watch {
            ids: Vec::new(),
            include_current: true,
            reply,
        };
        let (w1, mut first) = oneshot::channel();
        let (w2, mut second) = oneshot::channel();
        tx.send(watch(w1)).unwrap();
        tx.send(submit_cmd(oneshot::channel().0)).unwrap();
        filler(4094).for_each(|c| tx.send(c).unwrap());
        // The next batch.
        tx.send(watch(w2)).unwrap();
        tx.send(submit_cmd(oneshot::channel().0)).unwrap();
        tx.send(Command::Shutdown).unwrap();
        let core = Core::new(
            Cluster::new(ClusterConfig::default()),
            Box::new(store),
            OnStoreFailure::Stop,
            Observers::none(),
            Arc::new(Beats::default()),
        );
        assert!(matches!(core.run(rx), CoreExit::Shutdown));
        let ids = |rx: &mut broadcast::Receiver<JobEvent>| {
            std::iter::from_fn(|| rx.try_recv().ok())
                .filter_map(|ev| ev.job.map(|j| j.id))
                .collect::<Vec<_>>()
        };
        let (current, mut events) = first.try_recv().unwrap().unwrap();
        assert!(current.is_empty());
        assert_eq!(ids(&mut events), ["j-1", "j-2"]);
        let (current, mut events) = second.try_recv().unwrap().unwrap();
        assert_eq!(
            current.iter().map(|j| j.id.as_str()).collect::<Vec<_>>(),
            ["j-1"]
        );
        assert_eq!(ids(&mut events), ["j-2"]);
    }

    /// Per commit that writes: the (job, state) of each job it writes.
    type Commits = Arc<Mutex<Vec<Vec<(String, JobState)>>>>;

    /// A store that records, for every commit that writes, the (job, state)
    /// of each job it writes, in order.
    struct CountingStore {
        inner: EmbeddedStore,
        commits: Commits,
    }

    impl Store for CountingStore {
        fn load(&self) -> Result<crate::store::Snapshot, StoreError> {
            self.inner.load()
        }

        fn commit(&mut self, writes: &[Write]) -> Result<(), StoreError> {
            if !writes.is_empty() {
                let jobs = writes
                    .iter()
                    .filter_map(|w| match w {
                        Write::PutJob(j) => {
                            Some((j.id(), JobState::try_from(j.state).unwrap_or_default()))
                        }
                        _ => None,
                    })
                    .collect();
                lock(&self.commits).push(jobs);
            }
            self.inner.commit(writes)
        }
    }

    /// An agent's StatusBatch: announced in Registered, applied like its
    /// statuses one by one and in order (each job RUNNING with the batch's
    /// start time, then SUCCEEDED), all in one store commit, which writes
    /// each job in its last state.
    #[tokio::test]
    async fn a_status_batch_is_applied_in_order_in_one_commit() {
        let dir = tempfile::tempdir().unwrap();
        let commits: Commits = Arc::new(Mutex::new(Vec::new()));
        let store = CountingStore {
            inner: EmbeddedStore::open(dir.path()).unwrap(),
            commits: commits.clone(),
        };
        let (core, thread) = spawn(
            Cluster::new(ClusterConfig::default()),
            Box::new(store),
            OnStoreFailure::Stop,
            Observers::none(),
        );
        let (tx, mut agent) = crate::outbound::channel();
        let (session, _beat) = core
            .call(|reply| Command::Attach {
                register: Box::new(register("n1")),
                tx,
                reply,
            })
            .await
            .unwrap();
        let jobs = core
            .call(|reply| Command::Submit {
                specs: vec![spec(), spec()],
                batch: false,
                trace_context: HashMap::new(),
                owner: String::new(),
                reply,
            })
            .await
            .unwrap();
        let mut registered = None;
        let mut assigned = Vec::new();
        while assigned.len() < 2 {
            match agent.recv().await.unwrap().unwrap().msg {
                Some(dispatcher_message::Msg::Registered(r)) => registered = Some(r),
                Some(dispatcher_message::Msg::Assign(a)) => assigned.push(a.job_id),
                _ => {}
            }
        }
        assert!(registered.is_some_and(|r| r.status_batches));
        let status = |id: &str, state: JobState, time_ms: i64| proto::v1::JobStatus {
            job_id: id.to_string(),
            attempt: 1,
            state: state as i32,
            cpus: vec![0],
            time_ms,
            ..Default::default()
        };
        let (a, b) = (jobs[0].id(), jobs[1].id());
        let (a, b) = (a.as_str(), b.as_str());
        let before = lock(&commits).len();
        core.send(Command::FromAgent {
            node: "n1".into(),
            session,
            msg: agent_message::Msg::Statuses(proto::v1::StatusBatch {
                statuses: vec![
                    status(a, JobState::Running, 1_000),
                    status(b, JobState::Running, 1_001),
                    status(a, JobState::Succeeded, 1_002),
                    status(b, JobState::Succeeded, 1_003),
                ],
            }),
        });
        for (id, start) in [(a, 1_000), (b, 1_001)] {
            let job = core
                .call(|reply| Command::Get {
                    id: id.to_string(),
                    reply,
                })
                .await
                .unwrap();
            assert_eq!(job.state, JobState::Succeeded as i32, "{id}");
            assert_eq!(job.start_time_ms, start, "{id}: RUNNING was applied first");
        }
        let commits = lock(&commits)[before..].to_vec();
        let ours: Vec<_> = commits
            .iter()
            .filter(|c| c.iter().any(|(id, _)| id == a || id == b))
            .collect();
        assert_eq!(ours.len(), 1, "one commit with the whole batch: {ours:?}");
        let mut written = ours[0].clone();
        written.sort();
        written.dedup();
        let want = |id: &str, state| (id.to_string(), state);
        assert_eq!(
            written,
            [want(a, JobState::Succeeded), want(b, JobState::Succeeded)],
            "each job as the batch left it"
        );
        core.send(Command::Shutdown);
        assert!(matches!(thread.join().unwrap(), CoreExit::Shutdown));
    }

    async fn node_of(core: &CoreHandle, name: &str) -> Node {
        core.call(|reply| Command::Node {
            name: name.to_string(),
            reply,
        })
        .await
        .unwrap()
    }

    /// Waits up to 5 s for `name` to be in `state`.
    async fn wait_state(core: &CoreHandle, name: &str, state: proto::v1::NodeState) -> Node {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let node = node_of(core, name).await;
            if node.state == state as i32 || Instant::now() > deadline {
                return node;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn busy_load(busy: bool) -> proto::v1::NodeLoad {
        proto::v1::NodeLoad {
            cpus: vec![proto::v1::CpuLoad {
                cpu: 0,
                busy,
                runnable: u32::from(busy),
            }],
            running_jobs: u32::from(busy),
            ..Default::default()
        }
    }

    /// Heartbeats through the stream's beat, never a command each: an
    /// unchanged LoadReport keeps the node up past the heartbeat deadline,
    /// silence marks it DOWN after it, an unchanged LoadReport from the
    /// still-open stream brings it back, a changed load reaches the node's
    /// view, and a report with a `seq` gets its lease.
    #[tokio::test]
    async fn heartbeats_reach_the_core_through_the_beat() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(dir.path()).unwrap();
        // 3 missed heartbeats: DOWN after 3 x HEARTBEAT_MS of silence, far
        // longer than the 50 ms between reports even on a loaded machine.
        let cfg = ClusterConfig {
            heartbeat_interval_ms: HEARTBEAT_MS,
            ..ClusterConfig::default()
        };
        let (core, thread) = spawn(
            Cluster::new(cfg),
            Box::new(store),
            OnStoreFailure::Stop,
            Observers::none(),
        );
        let (tx, mut agent) = crate::outbound::channel();
        let (_, beat) = core
            .call(|reply| Command::Attach {
                register: Box::new(register("n1")),
                tx,
                reply,
            })
            .await
            .unwrap();
        let mut reporter = core.reporter(beat);
        let report = |busy: bool, seq: u64| proto::v1::LoadReport {
            load: Some(busy_load(busy)),
            seq,
        };
        // A job on the node, no retries: LOST if the node is ever marked
        // DOWN (even if a later report revives it).
        let jobs = core
            .call(|reply| Command::Submit {
                specs: vec![spec()],
                batch: false,
                trace_context: HashMap::new(),
                owner: String::new(),
                reply,
            })
            .await
            .unwrap();
        // Unchanged reports every 50 ms for more than three deadlines.
        for _ in 0..(4 * HEARTBEAT_MS / 50) {
            core.report(&mut reporter, report(false, 0), now_ms(), &mut Vec::new());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let node = node_of(&core, "n1").await;
        assert_eq!(node.state, proto::v1::NodeState::Ready as i32, "{node:?}");
        assert!(
            now_ms() - node.last_heartbeat_ms < 3 * HEARTBEAT_MS as i64,
            "{node:?}"
        );
        let job = core
            .call(|reply| Command::Get {
                id: jobs[0].id(),
                reply,
            })
            .await
            .unwrap();
        assert_eq!(job.state, JobState::Assigned as i32, "{job:?}");
        // Silence: DOWN.
        let node = wait_state(&core, "n1", proto::v1::NodeState::Down).await;
        assert_eq!(node.state, proto::v1::NodeState::Down as i32, "{node:?}");
        // The same load again from the open stream: up again.
        core.report(&mut reporter, report(false, 0), now_ms(), &mut Vec::new());
        let node = wait_state(&core, "n1", proto::v1::NodeState::Ready).await;
        assert_eq!(node.state, proto::v1::NodeState::Ready as i32, "{node:?}");
        // A changed load is applied; a seq is answered with a lease.
        core.report(&mut reporter, report(true, 9), now_ms(), &mut Vec::new());
        let lease = loop {
            let msg = tokio::time::timeout(Duration::from_secs(5), agent.recv())
                .await
                .expect("a lease within 5 s")
                .unwrap()
                .unwrap();
            if let Some(dispatcher_message::Msg::Lease(l)) = msg.msg {
                break l;
            }
        };
        assert_eq!(lease.seq, 9);
        assert_eq!(lease.lease_ms, cfg_lease_ms());
        let node = node_of(&core, "n1").await;
        assert_eq!(node.load, Some(busy_load(true)));
        core.send(Command::Shutdown);
        assert!(matches!(thread.join().unwrap(), CoreExit::Shutdown));
    }

    /// The heartbeat interval of `heartbeats_reach_the_core_through_the_beat`.
    const HEARTBEAT_MS: u64 = 400;

    fn cfg_lease_ms() -> u64 {
        ClusterConfig {
            heartbeat_interval_ms: HEARTBEAT_MS,
            ..ClusterConfig::default()
        }
        .agent_lease_ms()
    }

    /// A store whose commit of a job turning RUNNING takes `stall` first
    /// (an fsync stuck behind a flood of dirty pages).
    struct StallingStore {
        inner: EmbeddedStore,
        stall: Duration,
    }

    impl Store for StallingStore {
        fn load(&self) -> Result<crate::store::Snapshot, StoreError> {
            self.inner.load()
        }

        fn commit(&mut self, writes: &[Write]) -> Result<(), StoreError> {
            let running = writes
                .iter()
                .any(|w| matches!(w, Write::PutJob(j) if j.state == JobState::Running as i32));
            if running {
                std::thread::sleep(self.stall);
            }
            self.inner.commit(writes)
        }
    }

    /// An agent cannot report before it reads its Registered, which the
    /// core releases only once the registration's batch is stored: when
    /// that commit stalls past the heartbeat deadline, the node's
    /// heartbeat clock starts at the answer, so the node is not marked
    /// DOWN (and its job not retried) for the dispatcher's own delay.
    /// Found by tests/faults_netcut.rs on a loaded CI machine: an agent's
    /// registration unanswered for 9 s, its node DOWN as soon as it was.
    #[tokio::test]
    async fn a_registration_answered_late_starts_the_heartbeat_clock_at_the_answer() {
        const BEAT_MS: u64 = 1000; // DOWN after 3 s of silence
        let dir = tempfile::tempdir().unwrap();
        let store = StallingStore {
            inner: EmbeddedStore::open(dir.path()).unwrap(),
            stall: Duration::from_millis(5 * BEAT_MS),
        };
        let cfg = ClusterConfig {
            heartbeat_interval_ms: BEAT_MS,
            ..ClusterConfig::default()
        };
        let (core, thread) = spawn(
            Cluster::new(cfg),
            Box::new(store),
            OnStoreFailure::Stop,
            Observers::none(),
        );
        let _first = attach(&core, "n1").await;
        let mut retried = spec();
        retried.retries = 1;
        let jobs = core
            .call(|reply| Command::Submit {
                specs: vec![retried],
                batch: false,
                trace_context: HashMap::new(),
                owner: String::new(),
                reply,
            })
            .await
            .unwrap();
        let id = jobs[0].id();
        // The agent reconnects and reports the job running: the batch
        // stores it RUNNING, and that commit stalls.
        let mut again = register("n1");
        again.jobs = vec![proto::v1::JobStatus {
            job_id: id.clone(),
            attempt: 1,
            state: JobState::Running as i32,
            cpus: vec![0],
            ..Default::default()
        }];
        let (tx, _second) = crate::outbound::channel();
        let asked = Instant::now();
        core.call(|reply| Command::Attach {
            register: Box::new(again),
            tx,
            reply,
        })
        .await
        .unwrap();
        assert!(
            asked.elapsed() >= Duration::from_millis(5 * BEAT_MS),
            "the answer waited for the stalled commit"
        );
        // Half the deadline after the answer, without a report: the core
        // ticked since (every BEAT_MS / 2), the node is still up.
        tokio::time::sleep(Duration::from_millis(3 * BEAT_MS / 2)).await;
        let node = node_of(&core, "n1").await;
        assert_eq!(node.state, proto::v1::NodeState::Ready as i32, "{node:?}");
        let job = core
            .call(|reply| Command::Get {
                id: id.clone(),
                reply,
            })
            .await
            .unwrap();
        assert_eq!(
            (job.state, job.attempt),
            (JobState::Running as i32, 1),
            "{job:?}"
        );
        // The deadline itself still holds: silence marks it DOWN.
        let node = wait_state(&core, "n1", proto::v1::NodeState::Down).await;
        assert_eq!(node.state, proto::v1::NodeState::Down as i32, "{node:?}");
        core.send(Command::Shutdown);
        assert!(matches!(thread.join().unwrap(), CoreExit::Shutdown));
    }

    /// ListNodes over many nodes, with a submission in the same batches:
    /// every node once, in name order, built off the core.
    #[tokio::test]
    async fn list_nodes_answers_every_node_in_name_order_whole_or_paged() {
        let dir = tempfile::tempdir().unwrap();
        let (core, thread) = spawn_default(&dir);
        let total = 263;
        let mut agents = Vec::new();
        for i in 0..total {
            agents.push(attach(&core, &format!("n{i:04}")).await);
        }
        let listing = core.call(|reply| Command::Nodes {
            after: String::new(),
            page_size: 0,
            reply,
        });
        let submit = core.call(|reply| Command::Submit {
            specs: vec![spec()],
            batch: false,
            trace_context: HashMap::new(),
            owner: String::new(),
            reply,
        });
        let (nodes, jobs) = tokio::join!(listing, submit);
        let nodes = nodes.unwrap();
        assert_eq!(nodes.next_page_token, "");
        let names: Vec<String> = nodes.nodes.into_iter().map(|n| n.name).collect();
        let want: Vec<String> = (0..total).map(|i| format!("n{i:04}")).collect();
        assert_eq!(names, want);
        assert_eq!(jobs.unwrap().len(), 1);
        // Paged: pages of 50 (the last one short) make up the same list,
        // two listings in one batch each get their own page.
        let mut paged = Vec::new();
        let mut token = String::new();
        loop {
            let page = core.call(|reply| Command::Nodes {
                after: token.clone(),
                page_size: 50,
                reply,
            });
            let again = core.call(|reply| Command::Nodes {
                after: token.clone(),
                page_size: 7,
                reply,
            });
            let (page, again) = tokio::join!(page, again);
            let (page, again) = (page.unwrap(), again.unwrap());
            assert!(page.nodes.len() <= 50 && again.nodes.len() <= 7);
            assert_eq!(page.nodes[..again.nodes.len()], again.nodes[..]);
            paged.extend(page.nodes.into_iter().map(|n| n.name));
            if page.next_page_token.is_empty() {
                break;
            }
            assert_eq!(Some(&page.next_page_token), paged.last());
            token = page.next_page_token;
        }
        assert_eq!(paged, want);
        // A page after a name no node has starts at the next name; after
        // the last node there is an empty page.
        let page = core
            .call(|reply| Command::Nodes {
                after: "n0100a".into(),
                page_size: 2,
                reply,
            })
            .await
            .unwrap();
        let names: Vec<&str> = page.nodes.iter().map(|n| n.name.as_str()).collect();
        assert_eq!(
            (names, page.next_page_token.as_str()),
            (vec!["n0101", "n0102"], "n0102")
        );
        let page = core
            .call(|reply| Command::Nodes {
                after: "n0262".into(),
                page_size: 2,
                reply,
            })
            .await
            .unwrap();
        assert!(page.nodes.is_empty() && page.next_page_token.is_empty());
        core.send(Command::Shutdown);
        assert!(matches!(thread.join().unwrap(), CoreExit::Shutdown));
    }

    /// A burst of registrations defers the engine's rebuild
    /// ([`REBUILD_EVERY`]), but placement never sees a stale node set:
    /// jobs submitted between registrations, and right after the burst,
    /// are placed on every node registered before them, none pending.
    #[tokio::test]
    async fn nodes_registered_in_a_burst_are_all_placeable_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let (core, thread) = spawn_default(&dir);
        let mut agents = Vec::new();
        let submit = async |jobs: usize| {
            core.call(|reply| Command::Submit {
                specs: vec![spec(); jobs],
                batch: false,
                trace_context: HashMap::new(),
                owner: String::new(),
                reply,
            })
            .await
            .unwrap()
        };
        let mut placed: HashMap<String, usize> = HashMap::new();
        // Two halves of 20 nodes, each registered one batch at a time (the
        // first rebuilds, the next ones are deferred), each followed by
        // as many jobs as its nodes have CPUs (2 each): every job lands on
        // a node of its half, the only ones with room.
        for half in 0..2 {
            for i in 0..20 {
                agents.push(attach(&core, &format!("n{half}-{i:02}")).await);
            }
            for job in submit(40).await {
                assert_eq!(job.state, JobState::Assigned as i32, "{:?}", job.reason);
                assert!(job.node.starts_with(&format!("n{half}-")), "{}", job.node);
                *placed.entry(job.node.to_string()).or_default() += 1;
            }
        }
        assert_eq!(placed.len(), 40, "{placed:?}");
        assert!(placed.values().all(|&n| n == 2), "{placed:?}");
        core.send(Command::Shutdown);
        assert!(matches!(thread.join().unwrap(), CoreExit::Shutdown));
    }
}
