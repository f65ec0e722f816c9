//! Model-based test of the dispatcher's job lifecycle: the pure `Cluster`
//! is driven the way the core drives it, by random sequences of user
//! actions (submit, cancel), agent behaviour (start, finish, honour
//! cancels, answer steals, die with or without their jobs, stall, come
//! back and re-register with what they run) and dispatcher restarts
//! (rebuilt from the writes it committed, exactly as the store holds them;
//! sometimes a crash loses the last batch before its commit). Each
//! scenario runs against an in-memory image of the store and, fewer of
//! them, against the real embedded (redb) store in a temporary directory,
//! whose restarts reload what redb committed.
//!
//! A small world beside it plays the agents (which job attempts each node
//! holds) and a model of what was promised to users (every acknowledged
//! job, every acknowledged cancel). After every step it checks:
//! - no acknowledged job disappears, from memory or from the store, and the
//!   store holds each job's state, node and attempt as memory does;
//! - terminal states are final;
//! - at most one live copy of a job's current attempt exists in the world,
//!   on the node the dispatcher's phase for it holds, and an Assign always
//!   matches the dispatcher's record;
//! - a stale copy an agent reports running is cancelled at once;
//! - an acknowledged cancel is honoured: a pending job ends CANCELLED at
//!   once, a placed one gets a Cancel on its node, and the job is never
//!   started again;
//! - after a final drain (every agent back and finishing its work) every
//!   job is terminal and no agent holds a copy.

use std::collections::{BTreeMap, HashMap, VecDeque};

use dispatcher::cluster::{Cluster, ClusterConfig, Effects};
use dispatcher::store::embedded::EmbeddedStore;
use dispatcher::store::{NodeAdmin, Snapshot, Store, StoreError, Write};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use proto::v1::{
    Job, JobSpec, JobState, JobStatus, NodeLoad, Register, StealReply, dispatcher_message::Msg,
};

const NODES: usize = 3;
/// The restore grace of the binary: heartbeat x missed heartbeats x 2.
const GRACE_MS: i64 = 1000 * 3 * 2;

/// One step of a scenario.
#[derive(Clone, Debug)]
enum Op {
    /// A user submits `n` specs in one call (`array` > 1 makes each an
    /// array).
    Submit {
        n: usize,
        cpus: u32,
        retries: u32,
        array: u32,
    },
    /// A user cancels the `pick`-th acknowledged job (or its array).
    Cancel { pick: usize, whole_array: bool },
    /// An agent moves one of its copies on: honour a cancel, start it, or
    /// finish it (`fail`: non-zero exit).
    AgentStep {
        node: usize,
        pick: usize,
        fail: bool,
    },
    /// Time passes; every live agent sends its heartbeat, then the
    /// dispatcher ticks (overdue nodes go DOWN, agent steals are asked).
    Tick { ms: i64 },
    /// An agent process dies; its jobs survive (they run under shims) or
    /// not (the machine rebooted).
    AgentDies { node: usize, jobs_survive: bool },
    /// An agent stops sending (its stream stays open).
    AgentStalls { node: usize },
    /// An agent comes back: restarts and re-registers, un-stalls, or
    /// reconnects to a restarted dispatcher.
    AgentReturns { node: usize },
    /// The dispatcher restarts from its store.
    Restart,
}

/// A step, and whether the dispatcher crashes before committing it.
#[derive(Clone, Debug)]
struct Step {
    op: Op,
    crash_before_commit: bool,
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1usize..4, 1u32..3, 0u32..3, prop_oneof![3 => Just(0u32), 1 => 2u32..4])
            .prop_map(|(n, cpus, retries, array)| Op::Submit { n, cpus, retries, array }),
        2 => (any::<usize>(), any::<bool>())
            .prop_map(|(pick, whole_array)| Op::Cancel { pick, whole_array }),
        8 => (0..NODES, any::<usize>(), prop::bool::weighted(0.2))
            .prop_map(|(node, pick, fail)| Op::AgentStep { node, pick, fail }),
        4 => prop_oneof![Just(200i64), Just(1000i64), Just(2500i64)].prop_map(|ms| Op::Tick { ms }),
        1 => (0..NODES, any::<bool>())
            .prop_map(|(node, jobs_survive)| Op::AgentDies { node, jobs_survive }),
        1 => (0..NODES).prop_map(|node| Op::AgentStalls { node }),
        2 => (0..NODES).prop_map(|node| Op::AgentReturns { node }),
        1 => Just(Op::Restart),
    ]
}

fn step_strategy() -> impl Strategy<Value = Step> {
    (op_strategy(), prop::bool::weighted(0.04)).prop_map(|(op, crash_before_commit)| Step {
        op,
        crash_before_commit,
    })
}

/// One attempt of a job as an agent holds it.
#[derive(Clone, Debug)]
struct Copy {
    id: String,
    attempt: u32,
    running: bool,
    cancel_requested: bool,
}

/// What an agent sends on its stream.
#[derive(Clone, Debug)]
enum AgentMsg {
    Status(JobStatus),
    Steal(StealReply),
}

/// One node's agent.
#[derive(Debug)]
struct Agent {
    name: String,
    oversubscribe: u32,
    /// The process is up.
    alive: bool,
    /// Its stream to the current dispatcher is open.
    connected: bool,
    /// It sends nothing (the stream stays open).
    stalled: bool,
    copies: Vec<Copy>,
    /// Finished attempts, reported again on every Register (the agent's
    /// "recently finished" list).
    finished: Vec<JobStatus>,
    /// Messages not yet sent (while stalled).
    outbox: VecDeque<AgentMsg>,
}

impl Agent {
    fn sending(&self) -> bool {
        self.alive && self.connected && !self.stalled
    }

    fn register_msg(&self) -> Register {
        // As the real agent: running attempts and recently finished ones;
        // jobs held unstarted are not reported (the dispatcher resends
        // their Assign).
        let mut jobs: Vec<JobStatus> = self
            .copies
            .iter()
            .filter(|c| c.running)
            .map(|c| status(&c.id, c.attempt, JobState::Running))
            .collect();
        jobs.extend(self.finished.iter().cloned());
        let mut labels = HashMap::new();
        labels.insert("topology.kubernetes.io/zone".to_string(), "z1".to_string());
        labels.insert("dispatch.io/rack".to_string(), "r1".to_string());
        Register {
            node: self.name.clone(),
            labels,
            topology: Some(engine_proto::topology(
                &sched::Topology::from_spec("1s:2c:1t").expect("a valid spec"),
            )),
            jobs,
            oversubscribe: self.oversubscribe,
            ..Default::default()
        }
    }
}

fn status(id: &str, attempt: u32, state: JobState) -> JobStatus {
    JobStatus {
        job_id: id.to_string(),
        attempt,
        state: state as i32,
        ..Default::default()
    }
}

/// What the store holds, applied write by write as the embedded store
/// applies a commit.
#[derive(Debug, Default)]
struct StoreImage {
    jobs: BTreeMap<String, Job>,
    node_admin: HashMap<String, NodeAdmin>,
    next_job: u64,
}

impl StoreImage {
    fn apply(&mut self, writes: &[Write]) {
        for w in writes {
            match w {
                Write::PutJob(job) => {
                    self.jobs.insert(job.id(), job.to_proto());
                }
                Write::DeleteJob(key) => {
                    self.jobs.remove(&key.to_string());
                }
                Write::PutNodeAdmin(name, admin) => {
                    self.node_admin.insert(name.clone(), *admin);
                }
                Write::PutNextJob(n) => self.next_job = *n,
            }
        }
    }
}

impl Store for StoreImage {
    fn load(&self) -> Result<Snapshot, StoreError> {
        Ok(Snapshot {
            jobs: self.jobs.values().cloned().collect(),
            node_admin: self.node_admin.clone(),
            next_job: self.next_job,
        })
    }

    fn commit(&mut self, writes: &[Write]) -> Result<(), StoreError> {
        self.apply(writes);
        Ok(())
    }
}

/// Which store the dispatcher commits to.
#[derive(Clone, Copy, Debug)]
enum Backing {
    /// [`StoreImage`], in memory.
    Image,
    /// The embedded redb store in a temporary directory.
    Redb,
}

/// A store and the directory it lives in (removed when dropped).
struct TestStore {
    store: Box<dyn Store>,
    _dir: Option<tempfile::TempDir>,
}

impl TestStore {
    fn new(backing: Backing) -> Self {
        match backing {
            Backing::Image => Self {
                store: Box::new(StoreImage::default()),
                _dir: None,
            },
            Backing::Redb => {
                let dir = tempfile::tempdir().expect("a temporary directory");
                let store = EmbeddedStore::open(dir.path()).expect("the embedded store opens");
                Self {
                    store: Box::new(store),
                    _dir: Some(dir),
                }
            }
        }
    }

    fn snapshot(&self) -> Snapshot {
        self.store.load().expect("the store loads")
    }
}

/// What users were promised about one job.
#[derive(Clone, Debug, Default)]
struct Promise {
    /// The terminal state once one was seen.
    terminal: Option<i32>,
    /// A cancel was acknowledged while the job was not terminal, at this
    /// attempt.
    cancelled_at_attempt: Option<u32>,
}

/// The node of a placed job ("" for a PENDING one).
fn placed(j: &Job) -> &str {
    if j.state == JobState::Pending as i32 {
        ""
    } else {
        &j.node
    }
}

fn is_terminal(state: i32) -> bool {
    matches!(
        JobState::try_from(state),
        Ok(JobState::Succeeded | JobState::Failed | JobState::Cancelled | JobState::Lost)
    )
}

fn state_name(state: i32) -> String {
    JobState::try_from(state).map_or(format!("{state}"), |s| format!("{s:?}"))
}

struct World {
    cluster: Cluster,
    store: TestStore,
    agents: Vec<Agent>,
    now: i64,
    promises: BTreeMap<String, Promise>,
    /// Acknowledged ids in order, for picking.
    order: Vec<String>,
    log: Vec<String>,
}

fn fresh_cluster() -> Cluster {
    Cluster::new(ClusterConfig::default())
}

impl World {
    fn new(oversubscribe: [u32; NODES], backing: Backing) -> Self {
        let agents = (0..NODES)
            .map(|i| Agent {
                name: format!("n{i}"),
                oversubscribe: oversubscribe[i],
                alive: true,
                connected: false,
                stalled: false,
                copies: Vec::new(),
                finished: Vec::new(),
                outbox: VecDeque::new(),
            })
            .collect();
        let mut w = World {
            cluster: fresh_cluster(),
            store: TestStore::new(backing),
            agents,
            now: 1_000,
            promises: BTreeMap::new(),
            order: Vec::new(),
            log: Vec::new(),
        };
        for i in 0..NODES {
            w.connect(i, false);
        }
        w
    }

    /// Agent `i` opens a stream and registers.
    fn connect(&mut self, i: usize, crash: bool) {
        let reg = self.agents[i].register_msg();
        let a = &mut self.agents[i];
        a.connected = true;
        a.stalled = false;
        a.outbox.clear();
        // What it reported running, to check stale ones get cancelled.
        let running: Vec<(String, u32)> = reg
            .jobs
            .iter()
            .filter(|s| s.state == JobState::Running as i32)
            .map(|s| (s.job_id.clone(), s.attempt))
            .collect();
        let mut fx = Effects::default();
        self.cluster
            .register(reg, self.now, &mut fx)
            .expect("a valid Register");
        self.cluster.settle(self.now, &mut fx);
        if crash {
            self.crash();
            return;
        }
        let name = self.agents[i].name.clone();
        self.expect_stale_cancelled(&name, &running, &fx);
        self.commit(fx);
    }

    /// Every attempt `node` reported running that the dispatcher does not
    /// hold as that node's current attempt must be cancelled in `fx`.
    fn expect_stale_cancelled(&mut self, node: &str, running: &[(String, u32)], fx: &Effects) {
        for (id, attempt) in running {
            let current = self
                .cluster
                .get_job(id)
                .ok()
                .filter(|j| j.attempt == *attempt && j.node == node && !is_terminal(j.state));
            if current.is_some() {
                continue;
            }
            let cancelled = fx.to_agents.iter().any(|(n, m)| {
                n == node
                    && matches!(&m.message().msg, Some(Msg::Cancel(c)) if &c.job_id == id && c.attempt == *attempt)
            });
            if !cancelled {
                self.log.push(format!(
                    "VIOLATION: {node} reported stale {id}#{attempt} running and got no Cancel"
                ));
            }
        }
    }

    /// The dispatcher crashes: the batch in progress is lost (nothing was
    /// committed, acknowledged or sent), and it restarts from the store.
    fn crash(&mut self) {
        self.log.push("  crash before commit".into());
        self.restart();
    }

    fn restart(&mut self) {
        let mut c = fresh_cluster();
        c.restore(self.store.snapshot(), self.now, GRACE_MS);
        self.cluster = c;
        for a in &mut self.agents {
            // Every stream closed; in-flight messages are lost (the next
            // Register reports what matters).
            a.connected = false;
            a.stalled = false;
            a.outbox.clear();
        }
    }

    /// Commit a batch as the core does: store writes first, then agent
    /// messages (dropped for nodes without an open stream, and the
    /// Assigns of attempts the batch took back dropped, as the core's
    /// `seal` does).
    fn commit(&mut self, mut fx: Effects) {
        self.cluster.drop_taken_back_assigns(&mut fx);
        self.cluster.write_back(&mut fx);
        if !fx.writes.is_empty() {
            self.store
                .store
                .commit(&fx.writes)
                .expect("the store commits");
        }
        for (node, msg) in fx.to_agents {
            let Some(i) = self.agents.iter().position(|a| a.name == node) else {
                self.log
                    .push(format!("VIOLATION: message to unknown node {node}"));
                continue;
            };
            if !(self.agents[i].alive && self.agents[i].connected) {
                continue;
            }
            match msg.into_message().msg {
                Some(Msg::Assign(assign)) => {
                    self.check_assign(&node, &assign.job_id, assign.attempt);
                    let a = &mut self.agents[i];
                    if !a
                        .copies
                        .iter()
                        .any(|c| c.id == assign.job_id && c.attempt == assign.attempt)
                    {
                        a.copies.push(Copy {
                            id: assign.job_id,
                            attempt: assign.attempt,
                            running: false,
                            cancel_requested: false,
                        });
                    }
                }
                Some(Msg::Cancel(cancel)) => {
                    for c in &mut self.agents[i].copies {
                        if c.id == cancel.job_id && c.attempt == cancel.attempt {
                            c.cancel_requested = true;
                        }
                    }
                }
                Some(Msg::Steal(steal)) => {
                    let a = &mut self.agents[i];
                    let pos = a.copies.iter().position(|c| {
                        c.id == steal.job_id && c.attempt == steal.attempt && !c.running
                    });
                    if let Some(p) = pos {
                        a.copies.remove(p);
                    }
                    a.outbox.push_back(AgentMsg::Steal(StealReply {
                        job_id: steal.job_id,
                        attempt: steal.attempt,
                        released: pos.is_some(),
                    }));
                }
                _ => {}
            }
        }
    }

    /// An Assign must match the dispatcher's record and never restart a
    /// job whose cancel was acknowledged.
    fn check_assign(&mut self, node: &str, id: &str, attempt: u32) {
        let Ok(job) = self.cluster.get_job(id) else {
            self.log
                .push(format!("VIOLATION: Assign of unknown job {id} to {node}"));
            return;
        };
        if job.attempt != attempt || job.node != node || job.state != JobState::Assigned as i32 {
            self.log.push(format!(
                "VIOLATION: Assign {id}#{attempt} to {node} but the dispatcher has #{} on {:?} {}",
                job.attempt,
                job.node,
                state_name(job.state)
            ));
        }
        if let Some(at) = self.promises.get(id).and_then(|p| p.cancelled_at_attempt)
            && attempt > at
        {
            self.log.push(format!(
                "VIOLATION: {id} cancelled at attempt {at} was started again as #{attempt}"
            ));
        }
    }

    /// Send an agent's queued messages, in order.
    fn flush(&mut self, i: usize) {
        while self.agents[i].sending() {
            let Some(msg) = self.agents[i].outbox.pop_front() else {
                break;
            };
            let node = self.agents[i].name.clone();
            let mut fx = Effects::default();
            match msg {
                AgentMsg::Status(st) => {
                    let stale_running = st.state == JobState::Running as i32;
                    let reported = (st.job_id.clone(), st.attempt);
                    self.cluster.load_report_time(&node, self.now);
                    self.cluster.job_status(&node, st, self.now, &mut fx);
                    self.cluster.settle(self.now, &mut fx);
                    if stale_running {
                        self.expect_stale_cancelled(&node, &[reported], &fx);
                    }
                }
                AgentMsg::Steal(reply) => {
                    self.cluster.steal_reply(&node, reply, self.now, &mut fx);
                    self.cluster.settle(self.now, &mut fx);
                }
            }
            self.commit(fx);
        }
    }

    /// Agent `i` moves copy `pick` on by one stage.
    fn agent_step(&mut self, i: usize, pick: usize, fail: bool) {
        let a = &mut self.agents[i];
        if !a.alive || a.copies.is_empty() {
            return;
        }
        let p = pick % a.copies.len();
        let c = &mut a.copies[p];
        let st = if c.cancel_requested {
            Some(status(&c.id, c.attempt, JobState::Cancelled))
        } else if !c.running {
            c.running = true;
            let s = status(&c.id, c.attempt, JobState::Running);
            a.outbox.push_back(AgentMsg::Status(s));
            None
        } else if fail {
            Some(status(&c.id, c.attempt, JobState::Failed))
        } else {
            Some(status(&c.id, c.attempt, JobState::Succeeded))
        };
        if let Some(s) = st {
            a.copies.remove(p);
            a.finished.push(s.clone());
            a.outbox.push_back(AgentMsg::Status(s));
        }
        if !a.connected {
            // Nothing is sent without a stream; the next Register reports
            // running and finished attempts.
            a.outbox.clear();
        }
        self.flush(i);
    }

    fn tick(&mut self, ms: i64) {
        // Agents send what they have queued (steal replies) first.
        for i in 0..NODES {
            self.flush(i);
        }
        self.now += ms;
        let mut fx = Effects::default();
        for a in &self.agents {
            if a.sending() {
                self.cluster
                    .load_report(&a.name, NodeLoad::default(), self.now, &mut fx);
            }
        }
        self.cluster.tick(self.now, &mut fx);
        self.cluster.settle(self.now, &mut fx);
        self.commit(fx);
    }

    fn submit(&mut self, n: usize, cpus: u32, retries: u32, array: u32, crash: bool) {
        let specs = (0..n)
            .map(|_| JobSpec {
                command: vec!["true".into()],
                cpus,
                retries,
                array_count: array,
                ..Default::default()
            })
            .collect();
        let mut fx = Effects::default();
        let jobs = self
            .cluster
            .submit(specs, true, self.now, &mut fx)
            .expect("valid specs are accepted");
        self.cluster.settle(self.now, &mut fx);
        if crash {
            // Not committed, so not acknowledged: nothing was promised.
            self.crash();
            return;
        }
        self.commit(fx);
        for j in jobs {
            if self.promises.insert(j.id(), Promise::default()).is_some() {
                self.log
                    .push(format!("VIOLATION: id {} handed out twice", j.id()));
            }
            self.order.push(j.id());
        }
    }

    fn cancel(&mut self, pick: usize, whole_array: bool, crash: bool) {
        if self.order.is_empty() {
            return;
        }
        let id = self.order[pick % self.order.len()].clone();
        let target = match id.split_once('.') {
            Some((array, _)) if whole_array => array.to_string(),
            _ => id.clone(),
        };
        let affected: Vec<String> = if target == id {
            vec![id.clone()]
        } else {
            let prefix = format!("{target}.");
            self.order
                .iter()
                .filter(|x| x.starts_with(&prefix))
                .cloned()
                .collect()
        };
        let before: Vec<Job> = affected
            .iter()
            .map(|x| self.cluster.get_job(x).expect("an acknowledged job exists"))
            .collect();
        let mut fx = Effects::default();
        self.cluster
            .cancel(&target, self.now, &mut fx)
            .expect("cancelling a known job succeeds");
        self.cluster.settle(self.now, &mut fx);
        if crash {
            self.crash();
            return;
        }
        for b in &before {
            if is_terminal(b.state) {
                continue;
            }
            let after = self.cluster.get_job(&b.id).expect("still there");
            let connected = self
                .cluster
                .node(&b.node)
                .is_ok_and(|n| n.connected && !n.down);
            let honoured = if b.state == JobState::Pending as i32 || !connected {
                after.state == JobState::Cancelled as i32
            } else {
                fx.to_agents.iter().any(|(n, m)| {
                    n == &b.node
                        && matches!(&m.message().msg, Some(Msg::Cancel(c)) if c.job_id == b.id && c.attempt == b.attempt)
                })
            };
            if !honoured {
                self.log.push(format!(
                    "VIOLATION: cancel of {} ({} on {:?}) neither ended it nor told its node",
                    b.id,
                    state_name(b.state),
                    b.node
                ));
            }
            if let Some(p) = self.promises.get_mut(&b.id) {
                p.cancelled_at_attempt = Some(b.attempt);
            }
        }
        self.commit(fx);
    }

    fn apply(&mut self, step: &Step) {
        self.log.push(format!("t={} {:?}", self.now, step));
        let crash = step.crash_before_commit;
        match step.op {
            Op::Submit {
                n,
                cpus,
                retries,
                array,
            } => self.submit(n, cpus, retries, array, crash),
            Op::Cancel { pick, whole_array } => self.cancel(pick, whole_array, crash),
            Op::AgentStep { node, pick, fail } => self.agent_step(node, pick, fail),
            Op::Tick { ms } => self.tick(ms),
            Op::AgentDies { node, jobs_survive } => {
                let a = &mut self.agents[node];
                if !a.alive {
                    return;
                }
                a.alive = false;
                a.stalled = false;
                a.outbox.clear();
                // Unstarted jobs lived only in the agent's memory.
                a.copies.retain(|c| jobs_survive && c.running);
                if !jobs_survive {
                    a.finished.clear();
                }
                if a.connected {
                    a.connected = false;
                    let name = a.name.clone();
                    self.cluster.disconnected(&name);
                }
            }
            Op::AgentStalls { node } => {
                if self.agents[node].sending() {
                    self.agents[node].stalled = true;
                }
            }
            Op::AgentReturns { node } => self.agent_returns(node, crash),
            Op::Restart => self.restart(),
        }
    }

    fn agent_returns(&mut self, i: usize, crash: bool) {
        let a = &mut self.agents[i];
        if !a.alive {
            a.alive = true;
            self.connect(i, crash);
        } else if !a.connected {
            self.connect(i, crash);
        } else if a.stalled {
            a.stalled = false;
            self.flush(i);
        }
    }

    /// The invariants that hold after every step.
    fn check(&mut self) -> Result<(), String> {
        if let Some(v) = self.log.iter().find(|l| l.starts_with("VIOLATION")) {
            return Err(v.clone());
        }
        self.cluster.check()?;
        let stored: HashMap<String, Job> = self
            .store
            .snapshot()
            .jobs
            .into_iter()
            .map(|j| (j.id.clone(), j))
            .collect();
        let mut current_copies: HashMap<(&str, u32), Vec<&str>> = HashMap::new();
        for a in &self.agents {
            for c in &a.copies {
                current_copies
                    .entry((c.id.as_str(), c.attempt))
                    .or_default()
                    .push(a.name.as_str());
            }
        }
        for (id, promise) in &mut self.promises {
            let job = self
                .cluster
                .get_job(id)
                .map_err(|e| format!("acknowledged job {id} is gone from memory: {e}"))?;
            let stored = stored
                .get(id)
                .ok_or_else(|| format!("acknowledged job {id} is not in the store"))?;
            // A PENDING job queued on a node shows that node in memory
            // only (a restart places it again): compare nodes of placed
            // jobs.
            if (stored.state, stored.attempt, placed(stored))
                != (job.state, job.attempt, placed(&job))
            {
                return Err(format!(
                    "{id}: memory has {} #{} on {:?}, the store {} #{} on {:?}",
                    state_name(job.state),
                    job.attempt,
                    job.node,
                    state_name(stored.state),
                    stored.attempt,
                    stored.node
                ));
            }
            match promise.terminal {
                Some(t) if t != job.state => {
                    return Err(format!(
                        "{id} was {} and is now {}: terminal states are final",
                        state_name(t),
                        state_name(job.state)
                    ));
                }
                None if is_terminal(job.state) => promise.terminal = Some(job.state),
                _ => {}
            }
            if !is_terminal(job.state) {
                let holders = current_copies
                    .get(&(id.as_str(), job.attempt))
                    .cloned()
                    .unwrap_or_default();
                if holders.len() > 1 {
                    return Err(format!(
                        "{id}#{} is held by {holders:?} at once",
                        job.attempt
                    ));
                }
                let phase = self.cluster.phase(id);
                if let Some(h) = holders.first()
                    && phase.and_then(|p| p.holds()) != Some(*h)
                {
                    return Err(format!(
                        "{id}#{} runs on {h} but the dispatcher has it in phase {phase:?}",
                        job.attempt,
                    ));
                }
            }
        }
        Ok(())
    }

    /// Every agent comes back and works until everything is finished.
    fn drain(&mut self) -> Result<(), String> {
        self.log.push("drain".into());
        for i in 0..NODES {
            self.agent_returns(i, false);
            self.agent_returns(i, false);
            self.check()?;
        }
        for _round in 0..100 {
            // Agents answer steals, then start and finish everything they
            // hold at once (as a real agent with free CPUs does), then
            // time passes.
            for i in 0..NODES {
                self.flush(i);
            }
            for i in 0..NODES {
                while !self.agents[i].copies.is_empty() {
                    self.agent_step(i, 0, false);
                    self.check()?;
                }
            }
            self.tick(1000);
            self.check()?;
            let open = self
                .promises
                .keys()
                .filter(|id| {
                    self.cluster
                        .get_job(id)
                        .is_ok_and(|j| !is_terminal(j.state))
                })
                .count();
            if open == 0 && self.agents.iter().all(|a| a.copies.is_empty()) {
                return Ok(());
            }
        }
        let open: Vec<String> = self
            .promises
            .keys()
            .filter_map(|id| self.cluster.get_job(id).ok())
            .filter(|j| !is_terminal(j.state))
            .map(|j| {
                format!(
                    "{} {} on {:?}: {}",
                    j.id,
                    state_name(j.state),
                    j.node,
                    j.reason
                )
            })
            .collect();
        Err(format!("after the drain, jobs are not terminal: {open:?}"))
    }
}

fn run(oversubscribe: [u32; NODES], steps: &[Step], backing: Backing) -> Result<(), TestCaseError> {
    let mut w = World::new(oversubscribe, backing);
    let result = (|| {
        w.check()?;
        for step in steps {
            w.apply(step);
            w.check()?;
        }
        w.drain()
    })();
    result.map_err(|e| {
        let tail: Vec<&String> = w.log.iter().rev().take(40).collect();
        let tail: Vec<&String> = tail.into_iter().rev().collect();
        TestCaseError::fail(format!("{e}\nlast steps:\n{tail:#?}"))
    })
}

proptest! {
    // 256 cases, proptest's default; PROPTEST_CASES=N runs N (a soak).
    #![proptest_config(ProptestConfig {
        max_shrink_iters: 4096,
        ..ProptestConfig::default()
    })]

    #[test]
    fn the_dispatcher_keeps_its_promises(
        oversubscribe in [1u32..3, 1u32..3, 1u32..3],
        steps in prop::collection::vec(step_strategy(), 1..80),
    ) {
        run(oversubscribe, &steps, Backing::Image)?;
    }
}

proptest! {
    // Every commit is a durable redb transaction: fewer, shorter cases.
    #![proptest_config(ProptestConfig {
        cases: 24,
        max_shrink_iters: 1024,
        ..ProptestConfig::default()
    })]

    #[test]
    fn the_dispatcher_keeps_its_promises_on_the_embedded_store(
        oversubscribe in [1u32..3, 1u32..3, 1u32..3],
        steps in prop::collection::vec(step_strategy(), 1..60),
    ) {
        run(oversubscribe, &steps, Backing::Redb)?;
    }
}

/// A fixed scenario through every kind of step, so a plain run exercises
/// restart, crash and loss paths even before proptest's random ones.
#[test]
fn a_scenario_through_every_path() {
    let s = |op| Step {
        op,
        crash_before_commit: false,
    };
    let steps = vec![
        s(Op::Submit {
            n: 3,
            cpus: 1,
            retries: 1,
            array: 0,
        }),
        s(Op::AgentStep {
            node: 0,
            pick: 0,
            fail: false,
        }),
        s(Op::AgentDies {
            node: 0,
            jobs_survive: true,
        }),
        s(Op::Tick { ms: 2500 }),
        s(Op::Tick { ms: 2500 }),
        s(Op::Cancel {
            pick: 1,
            whole_array: false,
        }),
        s(Op::Restart),
        s(Op::AgentReturns { node: 0 }),
        s(Op::AgentReturns { node: 1 }),
        Step {
            op: Op::Submit {
                n: 1,
                cpus: 2,
                retries: 0,
                array: 3,
            },
            crash_before_commit: true,
        },
        s(Op::AgentStalls { node: 1 }),
        s(Op::Tick { ms: 2500 }),
        s(Op::Tick { ms: 2500 }),
        s(Op::AgentReturns { node: 1 }),
    ];
    run([1, 2, 1], &steps, Backing::Image).unwrap();
    run([1, 2, 1], &steps, Backing::Redb).unwrap();
}
