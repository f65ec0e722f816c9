//! Fake agents: real gRPC clients of `AgentService.Attach` that behave on
//! the wire like `agent::runtime` but start no process.
//!
//! Each fake agent registers a synthetic topology (built by the agent's
//! own parser, `agent::topology::synthetic`) with zone and rack labels,
//! sends a `LoadReport` every report period (staggered across agents),
//! and "runs" an assigned job on a timer: it models the node's CPUs as a
//! busy bitmap, starts a job on the lowest free CPUs when it fits (JobStatus
//! RUNNING with those CPUs), holds it unstarted otherwise (possible only
//! when it registers with `oversubscribe > 1`), and reports SUCCEEDED when
//! the job's duration has passed. The duration is what the job would
//! sleep: `command = ["sleep", SECONDS]`. As the real agent does, it ignores
//! a re-sent Assign, answers Cancel (CANCELLED, or the final status again),
//! gives back an unstarted job on Steal (`released`), says it has no logs
//! on LogRequest, and on a broken stream reconnects with backoff and
//! registers again listing its running and finished jobs.
//!
//! What it does not model: time-slicing of oversubscribed CPUs and
//! alignment within the node (a job takes the lowest free CPUs), so its
//! reports never mark a CPU overloaded.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use proto::v1::agent_service_client::AgentServiceClient;
use proto::v1::{
    AgentMessage, CpuLoad, FreeSummary, JobState, JobStatus, LoadReport, LogData, NodeLoad,
    Register, StealReply, agent_message, dispatcher_message,
};
use sched::idhash::IdMap;
use tokio::sync::{Semaphore, mpsc, watch};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::transport::Channel;

use crate::latency::{Kind, Latencies};

/// The env variable of a load-generator job holding its scheduled submit
/// time, microseconds since the run's base instant.
pub const SUBMIT_ENV: &str = "LOADGEN_SUBMIT_US";

/// Finished jobs an agent remembers (for re-sent Assigns and Cancels, and
/// for re-registration).
const FINISHED_KEPT: usize = 256;

/// A synthetic machine shape, shared by every node of that shape.
pub struct Shape {
    /// The topology as registered.
    pub topology: proto::v1::Topology,
    /// CPU ids, in the order of the busy bitmap.
    cpu_ids: Vec<u32>,
    /// Per level (core, LLC, NUMA node, package): groups of bitmap indexes.
    levels: [Vec<Vec<usize>>; 4],
}

impl Shape {
    /// Build a shape from a topology spec such as `2s:16c:2t`.
    pub fn parse(spec: &str) -> Result<Self> {
        let machine =
            agent::topology::synthetic(spec).with_context(|| format!("topology shape {spec}"))?;
        let topology = agent::runtime::topology_proto(&machine);
        let cpu_ids = topology.cpus.clone();
        let index: HashMap<u32, usize> = cpu_ids.iter().enumerate().map(|(i, &c)| (c, i)).collect();
        let groups = |g: &[proto::v1::CpuGroup]| -> Vec<Vec<usize>> {
            g.iter()
                .map(|grp| {
                    grp.cpus
                        .iter()
                        .filter_map(|c| index.get(c).copied())
                        .collect()
                })
                .collect()
        };
        let levels = [
            groups(&topology.smt),
            groups(&topology.llc),
            groups(&topology.numa),
            groups(&topology.package),
        ];
        Ok(Self {
            topology,
            cpu_ids,
            levels,
        })
    }

    /// CPUs of the shape.
    pub fn nr_cpus(&self) -> usize {
        self.cpu_ids.len()
    }

    /// Free CPUs per alignment level given a busy bitmap: the most free
    /// CPUs inside one domain of each level.
    fn free_summary(&self, busy: &[bool]) -> FreeSummary {
        let best = |groups: &Vec<Vec<usize>>| -> u32 {
            groups
                .iter()
                .map(|g| g.iter().filter(|&&i| !busy[i]).count() as u32)
                .max()
                .unwrap_or(0)
        };
        FreeSummary {
            core: best(&self.levels[0]),
            llc: best(&self.levels[1]),
            numa: best(&self.levels[2]),
            package: best(&self.levels[3]),
            any: busy.iter().filter(|b| !**b).count() as u32,
        }
    }
}

/// One fake node to attach.
pub struct NodePlan {
    /// Node name.
    pub name: String,
    /// Zone and rack labels.
    pub labels: HashMap<String, String>,
    /// Its machine.
    pub shape: Arc<Shape>,
    /// Delay of its first report after registering (stagger).
    pub report_offset: Duration,
}

/// Where a fake agent gets its HTTP/2 connection.
#[derive(Clone)]
pub enum Connection {
    /// Its own connection to this URL, opened at every (re)connect, as a
    /// real agent does.
    Own(String),
    /// A channel shared with other fake agents (many streams on one
    /// HTTP/2 connection).
    Shared(Channel),
    /// A node slot of a relay's AttachMany stream (`--nodes-per-stream`).
    Relay(relay::upstream::Upstream),
}

/// What a session reads: its Attach stream, or its slot of a relay.
enum Inbound {
    Stream(Box<tonic::Streaming<proto::v1::DispatcherMessage>>),
    Relay(relay::upstream::NodeRx),
}

impl Inbound {
    async fn message(&mut self) -> Result<Option<proto::v1::DispatcherMessage>, tonic::Status> {
        match self {
            Inbound::Stream(s) => s.message().await,
            Inbound::Relay(rx) => rx.recv().await.map(|b| *b).transpose(),
        }
    }
}

/// Settings and shared state of all fake agents.
pub struct Fleet {
    /// Report period (None: no heartbeats at all, the baseline).
    pub report_every: Option<Duration>,
    /// Announced runnable jobs per CPU.
    pub oversubscribe: u32,
    /// The run's base instant (job submit times are relative to it).
    pub base: Instant,
    /// Latency histograms.
    pub latencies: Arc<Latencies>,
    /// Counters.
    pub stats: AgentStats,
    /// Bounds concurrent connects + registrations (the connect storm).
    pub connect_gate: Semaphore,
}

/// Counters over all fake agents.
#[derive(Default)]
pub struct AgentStats {
    /// Agents registered at least once.
    pub registered: AtomicU64,
    /// LoadReports sent.
    pub reports: AtomicU64,
    /// Assigns received (not counting duplicates).
    pub assigns: AtomicU64,
    /// Assigns of jobs the load generator did not submit.
    pub foreign_assigns: AtomicU64,
    /// Terminal statuses sent for load-generator jobs, by state.
    pub succeeded: AtomicU64,
    pub failed: AtomicU64,
    pub cancelled: AtomicU64,
    /// Steal requests received, and those answered `released`.
    pub steals: AtomicU64,
    pub steals_released: AtomicU64,
    /// Streams that broke (each is followed by a reconnect).
    pub stream_errors: AtomicU64,
    /// The last stream error.
    pub last_error: Mutex<Option<String>>,
}

impl AgentStats {
    /// Terminal statuses sent for load-generator jobs.
    pub fn finished(&self) -> u64 {
        self.succeeded.load(Ordering::Relaxed)
            + self.failed.load(Ordering::Relaxed)
            + self.cancelled.load(Ordering::Relaxed)
    }
}

/// The HTTP/2 channel every fake agent and client of the load generator
/// uses, from the clients' shared endpoint builder: plaintext (`http://`),
/// as the dispatcher serves by default. The one place a TLS configuration
/// (`ClientTls`) would go.
pub async fn connect(url: &str) -> Result<Channel> {
    let plaintext = proto::client_security::ClientTls::default();
    proto::client_security::endpoint(url, &plaintext)?
        .connect_timeout(Duration::from_secs(10))
        .tcp_nodelay(true)
        .connect()
        .await
        .with_context(|| format!("connecting to {url}"))
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

type JobKey = (String, u32);

struct Queued {
    key: JobKey,
    cpus: u32,
    run_for: Duration,
    ours: bool,
}

struct Running {
    cpus: Vec<usize>,
    ours: bool,
}

/// One fake agent's state; survives reconnects.
struct FakeAgent {
    plan: NodePlan,
    fleet: Arc<Fleet>,
    busy: Vec<bool>,
    running: IdMap<JobKey, Running>,
    /// Assigned but not started (no room): what Steal may take back.
    queued: VecDeque<Queued>,
    /// When running jobs end.
    ends: BinaryHeap<Reverse<(Instant, JobKey)>>,
    /// Recently finished jobs and their final status.
    finished: VecDeque<(JobKey, JobStatus)>,
    out: Option<mpsc::UnboundedSender<AgentMessage>>,
}

impl FakeAgent {
    fn new(plan: NodePlan, fleet: Arc<Fleet>) -> Self {
        let n = plan.shape.nr_cpus();
        Self {
            plan,
            fleet,
            busy: vec![false; n],
            running: IdMap::default(),
            queued: VecDeque::new(),
            ends: BinaryHeap::new(),
            finished: VecDeque::new(),
            out: None,
        }
    }

    fn send(&self, msg: agent_message::Msg) {
        if let Some(out) = &self.out {
            let _ = out.send(AgentMessage { msg: Some(msg) });
        }
    }

    fn status(&self, key: &JobKey, state: JobState, cpus: &[usize], message: &str) -> JobStatus {
        JobStatus {
            job_id: key.0.clone(),
            attempt: key.1,
            state: state as i32,
            cpus: cpus.iter().map(|&i| self.plan.shape.cpu_ids[i]).collect(),
            exit_code: 0,
            signal: 0,
            message: message.to_string(),
            time_ms: now_ms(),
            gpus: Vec::new(),
        }
    }

    fn knows(&self, key: &JobKey) -> bool {
        self.running.contains_key(key)
            || self.queued.iter().any(|q| &q.key == key)
            || self.finished.iter().any(|(k, _)| k == key)
    }

    fn free(&self) -> usize {
        self.busy.iter().filter(|b| !**b).count()
    }

    fn finish(&mut self, key: JobKey, state: JobState, cpus: &[usize], message: &str, ours: bool) {
        let st = self.status(&key, state, cpus, message);
        if ours {
            let counter = match state {
                JobState::Succeeded => &self.fleet.stats.succeeded,
                JobState::Cancelled => &self.fleet.stats.cancelled,
                _ => &self.fleet.stats.failed,
            };
            counter.fetch_add(1, Ordering::Relaxed);
        }
        self.send(agent_message::Msg::Status(st.clone()));
        self.finished.push_back((key, st));
        if self.finished.len() > FINISHED_KEPT {
            self.finished.pop_front();
        }
    }

    fn on_assign(&mut self, a: proto::v1::Assign) {
        let key = (a.job_id, a.attempt);
        if self.knows(&key) {
            return; // a re-sent Assign after a reconnect
        }
        self.fleet.stats.assigns.fetch_add(1, Ordering::Relaxed);
        let spec = a.spec.unwrap_or_default();
        let submitted = spec.env.get(SUBMIT_ENV).and_then(|v| v.parse::<u64>().ok());
        let ours = submitted.is_some();
        match submitted {
            Some(us) => {
                let now = self.fleet.base.elapsed();
                let took = now.saturating_sub(Duration::from_micros(us));
                self.fleet.latencies.record(Kind::Assign, took);
            }
            None => {
                self.fleet
                    .stats
                    .foreign_assigns
                    .fetch_add(1, Ordering::Relaxed);
            }
        }
        let run_for = sleep_duration(&spec.command);
        let cpus = spec.cpus.max(1);
        if cpus as usize > self.busy.len() {
            let msg = format!(
                "could not start: needs {cpus} CPUs, the node has {}",
                self.busy.len()
            );
            self.finish(key, JobState::Failed, &[], &msg, ours);
            return;
        }
        self.queued.push_back(Queued {
            key,
            cpus,
            run_for,
            ours,
        });
        self.start_queued();
    }

    /// Start waiting jobs in order while the first fits.
    fn start_queued(&mut self) {
        while let Some(q) = self.queued.front() {
            if (q.cpus as usize) > self.free() {
                break;
            }
            let Some(q) = self.queued.pop_front() else {
                break;
            };
            let mut taken = Vec::with_capacity(q.cpus as usize);
            for (i, b) in self.busy.iter_mut().enumerate() {
                if taken.len() == q.cpus as usize {
                    break;
                }
                if !*b {
                    *b = true;
                    taken.push(i);
                }
            }
            let st = self.status(&q.key, JobState::Running, &taken, "");
            self.send(agent_message::Msg::Status(st));
            self.ends
                .push(Reverse((Instant::now() + q.run_for, q.key.clone())));
            self.running.insert(
                q.key,
                Running {
                    cpus: taken,
                    ours: q.ours,
                },
            );
        }
    }

    fn release(&mut self, cpus: &[usize]) {
        for &i in cpus {
            self.busy[i] = false;
        }
    }

    /// Jobs whose time is up end SUCCEEDED.
    fn end_due(&mut self, now: Instant) {
        while let Some(Reverse((at, _))) = self.ends.peek() {
            if *at > now {
                break;
            }
            let Some(Reverse((_, key))) = self.ends.pop() else {
                break;
            };
            // Absent when it was cancelled meanwhile.
            if let Some(r) = self.running.remove(&key) {
                self.release(&r.cpus);
                self.finish(key, JobState::Succeeded, &r.cpus, "", r.ours);
            }
        }
        self.start_queued();
    }

    fn on_cancel(&mut self, key: JobKey) {
        if let Some(r) = self.running.remove(&key) {
            self.release(&r.cpus);
            self.finish(key, JobState::Cancelled, &r.cpus, "cancelled", r.ours);
            self.start_queued();
        } else if let Some(pos) = self.queued.iter().position(|q| q.key == key) {
            let ours = self.queued.remove(pos).is_some_and(|q| q.ours);
            self.finish(
                key,
                JobState::Cancelled,
                &[],
                "cancelled before it started",
                ours,
            );
        } else if let Some((_, st)) = self.finished.iter().find(|(k, _)| *k == key) {
            let st = st.clone();
            self.send(agent_message::Msg::Status(st));
        }
    }

    fn on_steal(&mut self, key: JobKey) {
        self.fleet.stats.steals.fetch_add(1, Ordering::Relaxed);
        let released = match self.queued.iter().position(|q| q.key == key) {
            Some(pos) => {
                self.queued.remove(pos);
                true
            }
            None => false,
        };
        if released {
            self.fleet
                .stats
                .steals_released
                .fetch_add(1, Ordering::Relaxed);
        }
        self.send(agent_message::Msg::StealReply(StealReply {
            job_id: key.0,
            attempt: key.1,
            released,
        }));
    }

    fn load(&self) -> NodeLoad {
        let shape = &self.plan.shape;
        let waiting = self.queued.len() as u32;
        NodeLoad {
            cpus: self
                .busy
                .iter()
                .enumerate()
                .map(|(i, &busy)| CpuLoad {
                    cpu: shape.cpu_ids[i],
                    busy,
                    runnable: busy as u32,
                })
                .collect(),
            overloaded: Vec::new(),
            // No real idle periods to measure: report the kernel's default
            // migration cost, so the dispatcher's steal gate sees a
            // plausible value.
            avg_idle_ns: 500_000,
            free: Some(shape.free_summary(&self.busy)),
            running_jobs: self.running.len() as u32,
            waiting_jobs: waiting,
            // The real agent's schedstat names, so reports have its size.
            schedstats: dispatch_telemetry::schedstat_fields(&sched::Schedstats::default())
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
        }
    }

    fn register_msg(&self) -> Register {
        let mut jobs: Vec<JobStatus> = self
            .running
            .iter()
            .map(|(k, r)| self.status(k, JobState::Running, &r.cpus, ""))
            .collect();
        jobs.extend(self.finished.iter().map(|(_, st)| st.clone()));
        Register {
            node: self.plan.name.clone(),
            labels: self.plan.labels.clone(),
            topology: Some(self.plan.shape.topology.clone()),
            memory_bytes: self.plan.shape.nr_cpus() as u64 * (4 << 30),
            jobs,
            version: concat!("loadgen-", env!("CARGO_PKG_VERSION")).to_string(),
            oversubscribe: self.fleet.oversubscribe,
            devices: Vec::new(),
        }
    }
}

/// What a job would sleep: `["sleep", SECONDS]`, else nothing.
fn sleep_duration(command: &[String]) -> Duration {
    match command {
        [prog, secs, ..] if prog == "sleep" => secs
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s >= 0.0)
            .map_or(Duration::ZERO, Duration::from_secs_f64),
        _ => Duration::ZERO,
    }
}

/// Run one fake agent until `stop` becomes true.
pub async fn run(
    plan: NodePlan,
    conn: Connection,
    fleet: Arc<Fleet>,
    mut stop: watch::Receiver<bool>,
) {
    let mut agent = FakeAgent::new(plan, fleet.clone());
    let mut backoff = Duration::from_millis(100);
    let mut first = true;
    loop {
        if *stop.borrow() {
            return;
        }
        match session(&mut agent, &conn, first, &mut stop).await {
            Ok(()) => return,
            Err(err) => {
                fleet.stats.stream_errors.fetch_add(1, Ordering::Relaxed);
                let mut last = fleet
                    .stats
                    .last_error
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                *last = Some(format!("{}: {err:#}", agent.plan.name));
            }
        }
        if agent.out.take().is_some() {
            // It had registered: retry soon.
            backoff = Duration::from_millis(100);
            first = false;
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = stop.changed() => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// An Attach stream on `channel`, `register` its first message.
async fn attach_stream(
    channel: Channel,
    register: AgentMessage,
) -> Result<(mpsc::UnboundedSender<AgentMessage>, Inbound)> {
    let mut client = AgentServiceClient::new(channel).max_decoding_message_size(64 << 20);
    let (tx, rx) = mpsc::unbounded_channel();
    let _ = tx.send(register);
    let stream = client
        .attach(UnboundedReceiverStream::new(rx))
        .await
        .context("attaching")?
        .into_inner();
    Ok((tx, Inbound::Stream(Box::new(stream))))
}

/// One connected session; Ok when asked to stop.
async fn session(
    agent: &mut FakeAgent,
    conn: &Connection,
    first: bool,
    stop: &mut watch::Receiver<bool>,
) -> Result<()> {
    let fleet = agent.fleet.clone();
    let gate = if first {
        Some(fleet.connect_gate.acquire().await?)
    } else {
        None
    };
    let register = AgentMessage {
        msg: Some(agent_message::Msg::Register(Box::new(agent.register_msg()))),
    };
    let sent = Instant::now();
    let (tx, mut inbound) = match conn {
        Connection::Relay(relay) => {
            let (tx, rx) = relay.attach()?;
            let _ = tx.send(register);
            (tx, Inbound::Relay(rx))
        }
        Connection::Own(url) => attach_stream(connect(url).await?, register).await?,
        Connection::Shared(ch) => attach_stream(ch.clone(), register).await?,
    };

    match inbound
        .message()
        .await
        .context("waiting for Registered")?
        .and_then(|m| m.msg)
    {
        Some(dispatcher_message::Msg::Registered(_)) => {}
        _ => bail!("the dispatcher did not answer Registered"),
    }
    fleet.latencies.record(Kind::Register, sent.elapsed());
    if first {
        fleet.stats.registered.fetch_add(1, Ordering::Relaxed);
    }
    drop(gate);
    agent.out = Some(tx);
    let mut next_report = tokio::time::Instant::now() + agent.plan.report_offset;
    // Far enough never to fire, near enough not to overflow.
    let never = Duration::from_secs(86_400);
    loop {
        let next_end = agent
            .ends
            .peek()
            .map_or(Instant::now() + never, |Reverse((at, _))| *at);
        tokio::select! {
            msg = inbound.message() => {
                let msg = match msg {
                    Ok(Some(m)) => m.msg,
                    Ok(None) => bail!("the dispatcher closed the stream"),
                    Err(status) => bail!("stream error: {status}"),
                };
                match msg {
                    Some(dispatcher_message::Msg::Assign(a)) => agent.on_assign(a),
                    Some(dispatcher_message::Msg::Cancel(c)) => agent.on_cancel((c.job_id, c.attempt)),
                    Some(dispatcher_message::Msg::Steal(s)) => agent.on_steal((s.job_id, s.attempt)),
                    Some(dispatcher_message::Msg::LogRequest(r)) => {
                        agent.send(agent_message::Msg::Log(LogData {
                            request_id: r.request_id,
                            eof: true,
                            error: format!("no logs of job {}: the load generator's agents run no processes", r.job_id),
                            ..Default::default()
                        }));
                    }
                    // Fake agents report with seq 0: no lease, no fencing.
                    Some(dispatcher_message::Msg::Registered(_) | dispatcher_message::Msg::Lease(_))
                    | None => {}
                }
            }
            _ = tokio::time::sleep_until(next_end.into()) => agent.end_due(Instant::now()),
            _ = tokio::time::sleep_until(next_report), if fleet.report_every.is_some() => {
                let every = fleet.report_every.unwrap_or(never);
                let load = agent.load();
                agent.send(agent_message::Msg::Load(LoadReport { load: Some(load), seq: 0 }));
                fleet.stats.reports.fetch_add(1, Ordering::Relaxed);
                next_report += every;
                let now = tokio::time::Instant::now();
                if next_report < now {
                    // Fell behind (the machine is saturated): skip, as
                    // tokio's MissedTickBehavior::Skip does for the agent.
                    next_report = now + every;
                }
            }
            _ = stop.changed() => {
                if *stop.borrow() {
                    return Ok(());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fleet() -> Arc<Fleet> {
        Arc::new(Fleet {
            report_every: Some(Duration::from_secs(1)),
            oversubscribe: 2,
            base: Instant::now(),
            latencies: Arc::new(Latencies::default()),
            stats: AgentStats::default(),
            connect_gate: Semaphore::new(1),
        })
    }

    fn agent(spec: &str) -> (FakeAgent, mpsc::UnboundedReceiver<AgentMessage>) {
        let plan = NodePlan {
            name: "n0".into(),
            labels: HashMap::new(),
            shape: Arc::new(Shape::parse(spec).unwrap()),
            report_offset: Duration::ZERO,
        };
        let mut a = FakeAgent::new(plan, fleet());
        let (tx, rx) = mpsc::unbounded_channel();
        a.out = Some(tx);
        (a, rx)
    }

    fn assign(id: &str, cpus: u32, secs: &str) -> proto::v1::Assign {
        proto::v1::Assign {
            job_id: id.into(),
            attempt: 1,
            spec: Some(
                proto::v1::JobSpec {
                    command: vec!["sleep".into(), secs.into()],
                    cpus,
                    env: [(SUBMIT_ENV.to_string(), "0".to_string())].into(),
                    ..Default::default()
                }
                .into(),
            ),
            ..Default::default()
        }
    }

    fn statuses(rx: &mut mpsc::UnboundedReceiver<AgentMessage>) -> Vec<(String, JobState)> {
        let mut out = Vec::new();
        while let Ok(m) = rx.try_recv() {
            if let Some(agent_message::Msg::Status(s)) = m.msg {
                out.push((s.job_id, JobState::try_from(s.state).unwrap()));
            }
        }
        out
    }

    #[test]
    fn shapes_count_cpus_and_free_room_per_level() {
        let s = Shape::parse("2s:4c:2t").unwrap();
        assert_eq!(s.nr_cpus(), 16);
        let mut busy = vec![false; 16];
        let all = s.free_summary(&busy);
        assert_eq!((all.core, all.llc, all.package, all.any), (2, 8, 8, 16));
        busy[0] = true;
        let one = s.free_summary(&busy);
        assert_eq!((one.core, one.any), (2, 15));
        assert!(Shape::parse("nonsense").is_err());
    }

    #[test]
    fn jobs_start_when_they_fit_wait_otherwise_and_end_on_their_timer() {
        let (mut a, mut rx) = agent("1s:2c:1t");
        a.on_assign(assign("j-1", 2, "0"));
        a.on_assign(assign("j-2", 1, "0"));
        assert_eq!(statuses(&mut rx), vec![("j-1".into(), JobState::Running)]);
        assert_eq!(a.queued.len(), 1);
        // A re-sent Assign is ignored.
        a.on_assign(assign("j-1", 2, "0"));
        assert_eq!(a.fleet.stats.assigns.load(Ordering::Relaxed), 2);
        a.end_due(Instant::now());
        assert_eq!(
            statuses(&mut rx),
            vec![
                ("j-1".into(), JobState::Succeeded),
                ("j-2".into(), JobState::Running)
            ]
        );
        a.end_due(Instant::now());
        assert_eq!(statuses(&mut rx), vec![("j-2".into(), JobState::Succeeded)]);
        assert_eq!(a.free(), 2);
        assert_eq!(a.fleet.stats.succeeded.load(Ordering::Relaxed), 2);
        assert_eq!(a.fleet.latencies.count(Kind::Assign), 2);
    }

    #[test]
    fn steal_gives_back_only_unstarted_jobs() {
        let (mut a, mut rx) = agent("1s:1c:1t");
        a.on_assign(assign("j-1", 1, "60"));
        a.on_assign(assign("j-2", 1, "60"));
        a.on_steal(("j-1".into(), 1));
        a.on_steal(("j-2".into(), 1));
        let replies: Vec<(String, bool)> = std::iter::from_fn(|| rx.try_recv().ok())
            .filter_map(|m| match m.msg {
                Some(agent_message::Msg::StealReply(r)) => Some((r.job_id, r.released)),
                _ => None,
            })
            .collect();
        assert_eq!(
            replies,
            vec![("j-1".to_string(), false), ("j-2".to_string(), true)]
        );
        assert!(a.queued.is_empty());
    }

    #[test]
    fn cancel_frees_cpus_and_a_finished_job_repeats_its_status() {
        let (mut a, mut rx) = agent("1s:1c:1t");
        a.on_assign(assign("j-1", 1, "60"));
        a.on_cancel(("j-1".into(), 1));
        a.on_cancel(("j-1".into(), 1));
        assert_eq!(
            statuses(&mut rx),
            vec![
                ("j-1".into(), JobState::Running),
                ("j-1".into(), JobState::Cancelled),
                ("j-1".into(), JobState::Cancelled)
            ]
        );
        assert_eq!(a.free(), 1);
        // Cancelled once, reported twice: counted once.
        assert_eq!(a.fleet.stats.cancelled.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn too_big_jobs_fail_and_reports_describe_the_node() {
        let (mut a, mut rx) = agent("1s:2c:2t");
        a.on_assign(assign("j-1", 8, "1"));
        assert_eq!(statuses(&mut rx), vec![("j-1".into(), JobState::Failed)]);
        a.on_assign(assign("j-2", 1, "1"));
        let load = a.load();
        assert_eq!(load.cpus.len(), 4);
        assert_eq!(load.cpus.iter().filter(|c| c.busy).count(), 1);
        assert_eq!((load.running_jobs, load.free.unwrap().any), (1, 3));
        let reg = a.register_msg();
        assert_eq!(reg.jobs.len(), 2); // j-2 running, j-1 finished
    }

    #[test]
    fn sleep_durations_parse_or_are_zero() {
        let cmd = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            sleep_duration(&cmd(&["sleep", "1.5"])),
            Duration::from_millis(1500)
        );
        assert_eq!(sleep_duration(&cmd(&["sleep", "-1"])), Duration::ZERO);
        assert_eq!(sleep_duration(&cmd(&["true"])), Duration::ZERO);
    }
}
