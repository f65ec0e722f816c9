//! The agent's runtime: the stream to the dispatcher, glued to the local
//! scheduler ([`crate::local`]) and the executor ([`crate::exec`]).
//!
//! One task owns everything mutable and reacts, in a single `select!`, to:
//! dispatcher messages (Assign, Cancel, Steal, LogRequest), job exits from
//! the executor, the answers of starting shims, the scheduler tick (time
//! slices), and the report timer (LoadReport, which is also the
//! heartbeat).
//!
//! The loop never waits for a shim: each start runs on its own task and
//! its answer comes back as a message, so a burst of Assigns starts every
//! job there are CPUs for at once. Until its shim answers, a job counts as
//! started for the local scheduler but is unknown to the executor; what
//! the loop asks of it meanwhile (re-pin, stop or continue after a fence,
//! cancel, and its exit if that is delivered first) waits in [`Starting`]
//! and is carried out, in that order, after the start is reported. A
//! reconnect in that window lists it nowhere, like a job still queued
//! here: the dispatcher re-sends its Assign, which the agent ignores.
//! Job statuses of one turn of the loop (plus the exits and answers that
//! are already waiting) leave as one `StatusBatch` when the dispatcher
//! takes them, which it commits together. On a broken stream it
//! reconnects with backoff and registers again, listing every job it runs
//! or recently finished, so the dispatcher can reconcile; jobs keep
//! running meanwhile.
//!
//! The agent holds a lease from the leader (see `agent.proto`): each
//! LoadReport is numbered and the grant that answers it extends the lease
//! to the report's send time plus `lease_ms`, on `CLOCK_BOOTTIME`. The
//! deadline goes to the shims through [`crate::exec::lease`]; each shim
//! stops its job once the deadline passes, which fences the node even
//! when this process is the one that stalled. While the lease has run out
//! the agent sends no SIGCONT of its own (time slices); the first grant
//! after it continues every started job that is not sliced out.
//!
//! Synthetic topologies (`--topology 2s:8c:2t`) are scheduled as given and
//! mapped onto the real CPUs for pinning (synthetic CPU `i` runs on the
//! `i mod n`-th allowed real CPU), which the log says at start.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use proto::v1::agent_service_client::AgentServiceClient;
use proto::v1::{
    AgentMessage, CpuLoad, DispatcherMessage, JobSpec, JobState, JobStatus, LoadReport, LogData,
    LogRequest, LogStream, NodeLoad, Register, SharedSpec, StatusBatch, StealReply, agent_message,
    dispatcher_message,
};
use sched::{Align, Policy};
use tokio::sync::{mpsc, watch};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::exec::lease::{self, LeaseFile};
use crate::exec::{ExecConfig, Executor, JobExec, JobExit, JobOutcome, ShutdownMode};
use crate::local::{Action, LocalConfig, LocalJob, LocalScheduler};
use crate::topology::MachineTopology;

/// How the agent runs.
#[derive(Clone, Debug)]
pub struct AgentOptions {
    /// Dispatcher URLs, tried in order.
    pub dispatchers: Vec<String>,
    /// How the dispatcher is verified (`https://` URLs) and this agent's
    /// client certificate.
    pub tls: proto::client_security::ClientTls,
    /// This node's name.
    pub node: String,
    /// Labels (zone, rack, ...).
    pub labels: HashMap<String, String>,
    /// The machine (real or synthetic).
    pub machine: MachineTopology,
    /// Real CPUs jobs may be pinned to (synthetic CPUs map onto these).
    pub real_cpus: Vec<u32>,
    /// Memory offered to jobs, bytes (0 = unknown).
    pub memory_bytes: u64,
    /// The executor's configuration (state directory, logs, users).
    pub exec: ExecConfig,
    /// The local scheduler's configuration.
    pub local: LocalConfig,
    /// Runnable jobs per CPU announced to the dispatcher when the local
    /// scheduler oversubscribes.
    pub oversubscribe: u32,
    /// Scheduler tick.
    pub tick: Duration,
    /// Finished jobs' directories (logs) are kept this long.
    pub retention: Duration,
}

/// The local id of a dispatcher job attempt (an executor job directory).
fn local_id(job_id: &str, attempt: u32) -> String {
    format!("{job_id}_a{attempt}")
}

fn parse_local_id(id: &str) -> Option<(String, u32)> {
    let (job, attempt) = id.rsplit_once("_a")?;
    Some((job.to_string(), attempt.parse().ok()?))
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// The API's form of a machine topology.
pub fn topology_proto(m: &MachineTopology) -> proto::v1::Topology {
    engine_proto::topology_of_groups(
        m.cpu_ids(),
        [
            m.smt_groups(),
            m.llc_groups(),
            m.numa_groups(),
            m.package_groups(),
        ],
    )
}

/// This machine's host name (the default node name).
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

/// Total memory from /proc/meminfo, bytes.
pub fn memory_total() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// The agent's lease from the leader.
struct Lease {
    /// Granted length, ns; 0 = the dispatcher grants none.
    len_ns: u64,
    /// Where the shims read the deadline.
    file: LeaseFile,
    /// The deadline (`CLOCK_BOOTTIME` ns), `None` without a lease.
    deadline: Option<u64>,
    /// The deadline whose expiry was already logged.
    logged: Option<u64>,
    /// The last report number used.
    seq: u64,
    /// Reports awaiting their grant: (seq, send time).
    sent: VecDeque<(u64, u64)>,
    /// The jobs were fenced when a new stream's `Registered` renewed the
    /// lease: they stay stopped until the first grant on that stream. The
    /// dispatcher sends `Registered` before it reconciles the jobs the
    /// registration reported, so the Cancels of the attempts it retried
    /// elsewhere meanwhile come after it, and before any grant.
    fenced_until_grant: bool,
}

impl Lease {
    /// Reports remembered while their grants are outstanding: a grant for
    /// an older one would extend the lease by less than a newer one's.
    const MAX_OUTSTANDING: usize = 64;

    fn expired(&self) -> bool {
        self.deadline.is_some_and(|d| lease::now_ns() >= d)
    }

    /// Whether the agent keeps its started jobs stopped: the lease ran
    /// out, or a new stream has not yet had its first grant.
    fn fenced(&self) -> bool {
        self.expired() || self.fenced_until_grant
    }
}

struct Pending {
    spec: JobSpec,
    /// The job's owner (picks the uid through the user map).
    owner: String,
}

/// A job whose shim has been started and has not answered yet: what the
/// loop asked of it meanwhile, carried out when the answer comes (the
/// executor knows the job only from then on).
#[derive(Default)]
struct Starting {
    /// A cancel arrived.
    cancel: bool,
    /// The lease was renewed after it had run out: the shim may have
    /// fenced (stopped) the job, continue it.
    unfence: bool,
    /// Its exit, when the executor delivered it before the answer was
    /// handled (a job that ends at once).
    exit: Option<JobExit>,
}

/// A shim's answer: the job runs, or why it could not start.
type StartResult = (
    String,
    Vec<u32>,
    crate::exec::Result<crate::exec::JobHandle>,
);

/// What the executor reports to the loop: exits, and the answers of the
/// shims it is starting (each start runs on its own task, so the loop
/// starts many jobs at once and never waits for a shim).
struct Inbox {
    exits: mpsc::UnboundedReceiver<JobExit>,
    started: mpsc::UnboundedReceiver<StartResult>,
}

struct Agent {
    opts: AgentOptions,
    exec: Arc<Executor>,
    local: LocalScheduler,
    /// Local id -> what the dispatcher sent.
    jobs: HashMap<String, Pending>,
    /// Finished attempts not yet known to be reported: re-sent on register.
    recent: BTreeMap<String, (JobStatus, Instant)>,
    start: Instant,
    out: Option<mpsc::UnboundedSender<AgentMessage>>,
    /// Real CPUs each running job is pinned to now.
    pinned: HashMap<String, Vec<u32>>,
    /// The overloaded CPUs at the last report.
    last_overloaded: Vec<u32>,
    /// The jobs' spans (no-ops unless OTLP export is on).
    traces: crate::telemetry::JobTraces,
    /// The lease from the leader.
    lease: Lease,
    /// Started jobs the local scheduler has stopped (time-sliced out).
    sliced_out: HashSet<String>,
    /// Jobs whose shims are starting (see [`Starting`]).
    starting: HashMap<String, Starting>,
    /// Where the start tasks answer.
    started_tx: mpsc::UnboundedSender<StartResult>,
    /// Job statuses not yet sent: flushed once per turn of the loop, as one
    /// message when the dispatcher takes batches ([`Agent::flush`]).
    outbox: Vec<JobStatus>,
    /// The dispatcher said it takes `StatusBatch` (its `Registered`).
    batches: bool,
}

impl Agent {
    fn now_ns(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }

    fn real(&self, cpus: &[u32]) -> Vec<u32> {
        let n = self.opts.real_cpus.len().max(1);
        let mut out: Vec<u32> = cpus
            .iter()
            .map(|&c| {
                let idx = self
                    .opts
                    .machine
                    .cpu_ids()
                    .iter()
                    .position(|&x| x == c)
                    .unwrap_or(c as usize);
                self.opts.real_cpus.get(idx % n).copied().unwrap_or(0)
            })
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    fn send(&self, msg: agent_message::Msg) {
        if let Some(out) = &self.out {
            let _ = out.send(AgentMessage { msg: Some(msg) });
        }
    }

    fn send_status(
        &mut self,
        id: &str,
        state: JobState,
        cpus: Vec<u32>,
        exit: Option<&JobExit>,
        message: String,
    ) {
        let Some((job_id, attempt)) = parse_local_id(id) else {
            return;
        };
        let status = JobStatus {
            job_id,
            attempt,
            state: state as i32,
            cpus,
            exit_code: exit.and_then(|e| e.exit_code).unwrap_or(0),
            signal: exit.and_then(|e| e.signal).unwrap_or(0),
            message,
            time_ms: now_ms(),
            gpus: self.local.gpus_of(id),
        };
        if state != JobState::Running {
            self.recent
                .insert(id.to_string(), (status.clone(), Instant::now()));
        }
        self.outbox.push(status);
    }

    /// Send this turn's statuses: one `StatusBatch` when the dispatcher
    /// takes them (it applies a batch in one store commit), else one
    /// message each. Without a stream they are dropped, as a send on a
    /// broken one would be: the next Register lists running jobs, and
    /// `recent` holds the ends.
    fn flush(&mut self) {
        self.save_gpus();
        if self.outbox.is_empty() {
            return;
        }
        let statuses = std::mem::take(&mut self.outbox);
        tracing::debug!(target: "lat", n = statuses.len(), "statuses sent");
        if self.batches && statuses.len() > 1 {
            self.send(agent_message::Msg::Statuses(StatusBatch { statuses }));
        } else {
            for status in statuses {
                self.send(agent_message::Msg::Status(status));
            }
        }
    }

    /// Save the GPU holdings when they changed (see [`crate::gpus::Ledger`]).
    fn save_gpus(&mut self) {
        if self.local.gpu_pool_mut().take_changed() {
            let ledger = crate::gpus::Ledger::new(&self.opts.exec.state_dir);
            if let Err(err) = ledger.save(&self.local.gpu_pool().holdings()) {
                tracing::warn!(%err, "cannot save the GPU holdings");
            }
        }
    }

    fn carry_out(&mut self, actions: Vec<Action>) {
        for action in actions {
            match action {
                Action::Start { id, cpus } => self.start_job(&id, cpus),
                Action::Stop { id } => {
                    self.sliced_out.insert(id.clone());
                    // A starting job is stopped when its shim answers.
                    if !self.starting.contains_key(&id)
                        && let Err(err) = self.exec.stop(&id)
                    {
                        tracing::warn!(%id, %err, "cannot stop job");
                    }
                    self.traces.stopped(&id);
                }
                Action::Cont { id, cpus } => {
                    let topo = self.local.engine().topology();
                    self.traces.moved(&id, "continued", &cpus, topo);
                    let real = self.real(&cpus);
                    self.sliced_out.remove(&id);
                    if self.starting.contains_key(&id) {
                        // Pinned and left running when its shim answers.
                        self.pinned.insert(id.clone(), real);
                        continue;
                    }
                    // Re-pinning walks every thread of the job in /proc:
                    // only when the job comes back on other CPUs.
                    if self.pinned.get(&id) != Some(&real) {
                        if let Err(err) = self.exec.repin(&id, &real) {
                            tracing::warn!(%id, %err, "cannot re-pin job");
                        }
                        self.pinned.insert(id.clone(), real);
                    }
                    // Fenced: the job continues when the lease is renewed
                    // (a cancelled one by its termination only: the
                    // executor's `cont` leaves it).
                    if !self.lease.fenced()
                        && let Err(err) = self.exec.cont(&id)
                    {
                        tracing::warn!(%id, %err, "cannot continue job");
                    }
                }
                Action::Repin { id, cpus } => {
                    let topo = self.local.engine().topology();
                    self.traces.moved(&id, "migrated", &cpus, topo);
                    let real = self.real(&cpus);
                    if !self.starting.contains_key(&id)
                        && let Err(err) = self.exec.repin(&id, &real)
                    {
                        tracing::warn!(%id, %err, "cannot re-pin job");
                    }
                    self.pinned.insert(id.clone(), real);
                }
            }
        }
    }

    /// Start a job's shim on its own task and return at once: the answer
    /// comes back through [`Inbox::started`] ([`Agent::on_started`]), so
    /// the loop starts every job it has CPUs for without waiting for any
    /// shim. The job counts as started for the local scheduler from now.
    fn start_job(&mut self, id: &str, cpus: Vec<u32>) {
        let Some(p) = self.jobs.get(id) else {
            return;
        };
        let spec = &p.spec;
        let real = self.real(&cpus);
        let mut job = JobExec::new(
            id,
            spec.command.first().cloned().unwrap_or_default(),
            real.clone(),
        );
        job.args = spec.command.iter().skip(1).cloned().collect();
        job.env = spec
            .env
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        job.cwd = (!spec.cwd.is_empty()).then(|| PathBuf::from(&spec.cwd));
        job.memory_max = (spec.memory_bytes > 0).then_some(spec.memory_bytes);
        job.timeout = (spec.timeout_ms > 0).then(|| Duration::from_millis(spec.timeout_ms));
        job.owner = p.owner.clone();
        // The job's GPUs (chosen with its CPUs): CUDA_VISIBLE_DEVICES etc.
        let gpus = self.local.gpus_of(id);
        job.env.extend(self.local.gpu_pool().env(&gpus));
        job.deny_devices = self.local.gpu_pool().deny_for(&gpus);
        if let Some((job_id, attempt)) = parse_local_id(id) {
            let node = self.opts.node.clone();
            self.traces
                .starting(id, (&job_id, attempt), &node, &cpus, &real);
        }
        self.starting.insert(id.to_string(), Starting::default());
        self.pinned.insert(id.to_string(), real.clone());
        let exec = self.exec.clone();
        let tx = self.started_tx.clone();
        let id = id.to_string();
        tracing::debug!(target: "lat", job = %id, "start task spawned");
        tokio::spawn(async move {
            let result = exec.spawn(job).await;
            // The loop holds the receiver for as long as it runs.
            let _ = tx.send((id, real, result));
        });
    }

    /// A shim answered: report the start (or the failure), then carry out
    /// what the loop asked of the job meanwhile, in order (stop, re-pin,
    /// cancel, continue after a fence, its exit).
    fn on_started(&mut self, (id, real, result): StartResult) {
        let Some(starting) = self.starting.remove(&id) else {
            return;
        };
        let cpus = self
            .local
            .cpus_of(&id)
            .map(|c| c.to_vec())
            .unwrap_or_default();
        match result {
            Ok(_) => {
                self.traces.started(&id, Ok(()));
                tracing::debug!(%id, ?cpus, ?real, "job started");
                tracing::debug!(target: "lat", job = %id, "started");
                self.send_status(&id, JobState::Running, cpus, None, String::new());
                let wanted = self.pinned.get(&id).cloned().unwrap_or_default();
                if wanted != real
                    && let Err(err) = self.exec.repin(&id, &wanted)
                {
                    tracing::warn!(%id, %err, "cannot re-pin job");
                }
                if self.sliced_out.contains(&id) {
                    if let Err(err) = self.exec.stop(&id) {
                        tracing::warn!(%id, %err, "cannot stop job");
                    }
                } else if starting.unfence
                    && !starting.cancel
                    && !self.lease.fenced()
                    && let Err(err) = self.exec.cont(&id)
                {
                    tracing::warn!(%id, %err, "cannot continue job");
                }
                if starting.cancel
                    && let Err(err) = self.exec.cancel(&id, crate::exec::DEFAULT_KILL_GRACE)
                {
                    tracing::warn!(%id, %err, "cannot cancel job");
                }
                if let Some(exit) = starting.exit {
                    self.on_exit(exit);
                }
            }
            Err(err) => {
                tracing::warn!(%id, %err, "job failed to start");
                self.traces.started(&id, Err(&err.to_string()));
                let now = self.now_ns();
                let actions = self.local.job_exited(&id, now);
                self.jobs.remove(&id);
                self.pinned.remove(&id);
                self.sliced_out.remove(&id);
                self.send_status(
                    &id,
                    JobState::Failed,
                    cpus,
                    None,
                    format!("could not start: {err}"),
                );
                self.carry_out(actions);
            }
        }
    }

    fn on_assign(
        &mut self,
        job_id: String,
        attempt: u32,
        spec: JobSpec,
        owner: String,
        trace_context: &HashMap<String, String>,
    ) {
        let id = local_id(&job_id, attempt);
        tracing::debug!(target: "lat", job = %job_id, "assign received");
        if self.jobs.contains_key(&id) || self.recent.contains_key(&id) {
            return; // a re-sent Assign after a reconnect
        }
        self.traces.assigned(&id, trace_context);
        let local = LocalJob {
            id: id.clone(),
            cpus: spec.cpus.max(1),
            align: engine_proto::align(spec.alignment),
            policy: engine_proto::policy(spec.policy),
            nice: spec.nice,
            latency_nice: spec.latency_nice,
            gpus: spec.gpus,
        };
        self.jobs.insert(id.clone(), Pending { spec, owner });
        let now = self.now_ns();
        match self.local.submit(local, now) {
            Ok(actions) => self.carry_out(actions),
            Err(reason) => {
                self.jobs.remove(&id);
                self.traces.forget(&id);
                self.send_status(&id, JobState::Failed, Vec::new(), None, reason);
            }
        }
    }

    fn on_cancel(&mut self, job_id: &str, attempt: u32) {
        let id = local_id(job_id, attempt);
        if let Some(starting) = self.starting.get_mut(&id) {
            // The shim installs its cancel handler before it answers:
            // signal it then.
            starting.cancel = true;
        } else if self.local.is_started(&id) {
            if let Err(err) = self.exec.cancel(&id, crate::exec::DEFAULT_KILL_GRACE) {
                tracing::warn!(%id, %err, "cannot cancel job");
            }
            // The exit arrives through the executor's channel.
        } else if self.local.contains(&id) {
            let now = self.now_ns();
            let actions = self.local.job_exited(&id, now);
            self.jobs.remove(&id);
            self.traces.forget(&id);
            self.send_status(
                &id,
                JobState::Cancelled,
                Vec::new(),
                None,
                "cancelled before it started".into(),
            );
            self.carry_out(actions);
        } else if let Some((status, _)) = self.recent.get(&id) {
            // Already finished: say so again.
            let status = status.clone();
            self.outbox.push(status);
        } else if self.exec.status(&id).is_ok() {
            let _ = self.exec.cancel(&id, crate::exec::DEFAULT_KILL_GRACE);
        }
    }

    fn on_exit(&mut self, exit: JobExit) {
        let id = exit.id.clone();
        if let Some(starting) = self.starting.get_mut(&id) {
            // The monitor delivered the exit before the loop handled the
            // shim's answer: the start is reported first.
            starting.exit = Some(exit);
            return;
        }
        let now = self.now_ns();
        let cpus = self
            .local
            .cpus_of(&id)
            .map(|c| c.to_vec())
            .unwrap_or_default();
        let actions = self.local.job_exited(&id, now);
        self.jobs.remove(&id);
        self.pinned.remove(&id);
        self.sliced_out.remove(&id);
        let (state, message) = match &exit.outcome {
            JobOutcome::Exited(0) => (JobState::Succeeded, String::new()),
            JobOutcome::Exited(code) => (JobState::Failed, format!("exited with status {code}")),
            JobOutcome::Signaled(sig) => (JobState::Failed, format!("killed by signal {sig}")),
            JobOutcome::TimedOut => (JobState::Failed, "timeout".to_string()),
            JobOutcome::Cancelled => (JobState::Cancelled, "cancelled".to_string()),
            JobOutcome::StartFailed(e) => (JobState::Failed, format!("could not start: {e}")),
            JobOutcome::Lost(e) => (JobState::Failed, format!("lost on the node: {e}")),
        };
        tracing::debug!(%id, ?state, "job ended");
        self.traces.ended(
            &id,
            &state
                .as_str_name()
                .trim_start_matches("JOB_STATE_")
                .to_ascii_lowercase(),
            exit.exit_code.unwrap_or(0),
            exit.signal.unwrap_or(0),
            &message,
        );
        self.send_status(&id, state, cpus, Some(&exit), message);
        let _ = self.exec.ack(&id);
        self.carry_out(actions);
    }

    fn on_steal(&mut self, job_id: String, attempt: u32) {
        let id = local_id(&job_id, attempt);
        let released = self.local.contains(&id) && !self.local.is_started(&id);
        if released {
            let now = self.now_ns();
            let _ = self.local.job_exited(&id, now);
            self.jobs.remove(&id);
            self.traces.forget(&id);
        }
        self.send(agent_message::Msg::StealReply(StealReply {
            job_id,
            attempt,
            released,
        }));
    }

    /// Send a LoadReport (the heartbeat), numbered for its lease grant.
    fn send_load(&mut self) {
        let load = self.load();
        let mut seq = 0;
        if self.lease.len_ns > 0 {
            self.lease.seq += 1;
            seq = self.lease.seq;
            if self.lease.sent.len() == Lease::MAX_OUTSTANDING {
                self.lease.sent.pop_front();
            }
            // Taken before the report leaves, so never later than it.
            self.lease.sent.push_back((seq, lease::now_ns()));
        }
        self.send(agent_message::Msg::Load(LoadReport {
            load: Some(load),
            seq,
        }));
    }

    /// A new stream: the registration sent at `sent_ns` was answered with
    /// this lease length.
    fn lease_registered(&mut self, lease_ms: u64, sent_ns: u64) {
        self.lease.sent.clear();
        self.lease.len_ns = lease_ms.saturating_mul(1_000_000);
        let was_fenced = self.lease.fenced();
        self.lease.fenced_until_grant = false;
        if lease_ms == 0 {
            // No grants will come: nothing to wait for.
            self.lease.deadline = None;
            if let Err(err) = self.lease.file.clear() {
                tracing::warn!(%err, "cannot remove the lease file");
            }
            if was_fenced {
                self.unfence();
            }
            return;
        }
        self.extend(sent_ns.saturating_add(self.lease.len_ns));
        // Fenced jobs wait for the first grant (see `fenced_until_grant`):
        // a job the dispatcher retried elsewhere while this node was cut
        // off gets its Cancel first and is never continued.
        self.lease.fenced_until_grant = was_fenced;
    }

    /// A grant: the report it names was sent at most this long ago.
    fn on_lease(&mut self, grant: proto::v1::Lease) {
        let Some(pos) = self.lease.sent.iter().position(|&(s, _)| s == grant.seq) else {
            return; // not ours, or superseded
        };
        let (_, sent_ns) = self.lease.sent[pos];
        self.lease.sent.drain(..=pos);
        self.lease.len_ns = grant.lease_ms.saturating_mul(1_000_000);
        let was_fenced = self.lease.fenced();
        self.lease.fenced_until_grant = false;
        self.extend(sent_ns.saturating_add(self.lease.len_ns));
        if was_fenced && !self.lease.fenced() {
            self.unfence();
        }
    }

    /// Move the deadline to `deadline` if that is later. The file first,
    /// then (the caller's) SIGCONTs: a shim that stops its job after
    /// reading the old deadline reads again and sees this one.
    fn extend(&mut self, deadline: u64) {
        if self.lease.deadline.is_some_and(|d| d >= deadline) {
            return;
        }
        self.lease.deadline = Some(deadline);
        if let Err(err) = self.lease.file.write(deadline) {
            tracing::warn!(%err, path = %self.lease.file.path().display(), "cannot write the lease file");
        }
    }

    /// Continue every started job that is not sliced out, after the lease
    /// ran out (the shims stopped them).
    fn unfence(&mut self) {
        let ids: Vec<String> = self
            .jobs
            .keys()
            .filter(|id| self.local.is_started(id) && !self.sliced_out.contains(*id))
            .cloned()
            .collect();
        tracing::info!(jobs = ids.len(), "lease renewed: continuing fenced jobs");
        for id in ids {
            if let Some(starting) = self.starting.get_mut(&id) {
                starting.unfence = true;
            } else if let Err(err) = self.exec.cont(&id) {
                tracing::warn!(%id, %err, "cannot continue job");
            }
        }
    }

    /// Log once per deadline that the lease ran out (the shims fence).
    fn check_lease(&mut self) {
        if self.lease.expired() && self.lease.logged != self.lease.deadline {
            self.lease.logged = self.lease.deadline;
            tracing::warn!(
                jobs = self.pinned.len(),
                "no lease from a leader: the jobs are stopped until one is granted"
            );
        }
    }

    fn load(&self) -> NodeLoad {
        let free = self.local.free_summary();
        let stats = self.local.engine().stats();
        let schedstats = schedstats_report(stats);
        NodeLoad {
            cpus: self
                .local
                .cpu_loads()
                .into_iter()
                .map(|(cpu, busy, runnable)| CpuLoad {
                    cpu,
                    busy,
                    runnable,
                })
                .collect(),
            overloaded: self.local.overloaded(),
            avg_idle_ns: self.local.avg_idle(),
            free: Some(engine_proto::free_summary(free)),
            running_jobs: self.local.nr_running() as u32,
            waiting_jobs: self.local.nr_waiting() as u32,
            schedstats,
        }
    }

    fn register_msg(&mut self) -> Register {
        // Forget finished attempts older than the retention.
        let keep = self.opts.retention;
        self.recent.retain(|_, (_, t)| t.elapsed() < keep);
        let mut jobs: Vec<JobStatus> = Vec::new();
        for st in self.exec.list() {
            // A job whose exit this loop has not handled yet is neither
            // running for the executor nor in `recent`: it still counts
            // as running here (its end follows on this stream), or the
            // dispatcher would think it lost and run it again (found by
            // tests/faults_etcd.rs, leaders changing every second).
            let unreported = self.jobs.contains_key(&st.id) && !self.recent.contains_key(&st.id);
            if (matches!(st.state, crate::exec::JobState::Running { .. }) || unreported)
                && let Some((job_id, attempt)) = parse_local_id(&st.id)
            {
                let cpus = self
                    .local
                    .cpus_of(&st.id)
                    .map(|c| c.to_vec())
                    .unwrap_or_default();
                jobs.push(JobStatus {
                    job_id,
                    attempt,
                    state: JobState::Running as i32,
                    cpus,
                    time_ms: now_ms(),
                    gpus: self.local.gpus_of(&st.id),
                    ..Default::default()
                });
            }
        }
        jobs.extend(self.recent.values().map(|(s, _)| s.clone()));
        Register {
            node: self.opts.node.clone(),
            labels: self.opts.labels.clone(),
            topology: Some(topology_proto(&self.opts.machine)),
            memory_bytes: self.opts.memory_bytes,
            devices: crate::gpus::devices_proto(&self.opts.machine.devices),
            jobs,
            version: env!("CARGO_PKG_VERSION").to_string(),
            oversubscribe: if self.opts.local.oversubscribe {
                self.opts.oversubscribe.max(1)
            } else {
                1
            },
        }
    }

    /// Serve a log request on its own task.
    fn serve_log(&self, req: LogRequest) {
        let Some(out) = self.out.clone() else { return };
        let found = self
            .jobs
            .keys()
            .chain(self.recent.keys())
            .find(|id| parse_local_id(id).is_some_and(|(j, _)| j == req.job_id))
            .cloned()
            .or_else(|| {
                self.exec
                    .list()
                    .into_iter()
                    .map(|s| s.id)
                    .filter(|id| parse_local_id(id).is_some_and(|(j, _)| j == req.job_id))
                    .max()
            });
        let status = found.as_ref().and_then(|id| self.exec.status(id).ok());
        // A job that ended here and whose directory is gone was recycled
        // (`exec/spares.rs`): it wrote no output.
        let no_output = status.is_none()
            && found.as_ref().is_some_and(|id| {
                !self.jobs.contains_key(id)
                    && self
                        .recent
                        .get(id)
                        .is_some_and(|(_, t)| t.elapsed() < self.opts.retention)
            });
        let exec = self.exec.clone();
        tokio::spawn(async move {
            let reply = |data: Vec<u8>, offset: u64, eof: bool, error: String| AgentMessage {
                msg: Some(agent_message::Msg::Log(LogData {
                    request_id: req.request_id,
                    data,
                    offset,
                    truncated: false,
                    eof,
                    error,
                })),
            };
            if no_output {
                let _ = out.send(reply(Vec::new(), req.offset, true, String::new()));
                return;
            }
            let (Some(id), Some(status)) = (found, status) else {
                let _ = out.send(reply(
                    Vec::new(),
                    0,
                    true,
                    format!("no logs of job {} on this node", req.job_id),
                ));
                return;
            };
            let name = if req.stream == LogStream::Stderr as i32 {
                "stderr"
            } else {
                "stdout"
            };
            let path = status.dir.join(name);
            let mut offset = req.offset;
            loop {
                let chunk = read_chunk(&path, offset, 64 * 1024).await;
                match chunk {
                    Ok(data) if !data.is_empty() => {
                        let n = data.len() as u64;
                        if out.send(reply(data, offset, false, String::new())).is_err() {
                            return;
                        }
                        offset += n;
                        continue;
                    }
                    Ok(_) => {}
                    Err(err) => {
                        let _ = out.send(reply(
                            Vec::new(),
                            offset,
                            true,
                            format!("reading {}: {err}", path.display()),
                        ));
                        return;
                    }
                }
                let finished = !matches!(
                    exec.status(&id).map(|s| s.state),
                    Ok(crate::exec::JobState::Running { .. })
                );
                if !req.follow || finished {
                    // One more read after the end, then EOF.
                    if let Ok(data) = read_chunk(&path, offset, 64 * 1024).await
                        && !data.is_empty()
                    {
                        let n = data.len() as u64;
                        let _ = out.send(reply(data, offset, false, String::new()));
                        offset += n;
                        continue;
                    }
                    let _ = out.send(reply(Vec::new(), offset, true, String::new()));
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
    }
}

async fn read_chunk(path: &Path, offset: u64, max: usize) -> std::io::Result<Vec<u8>> {
    use tokio::io::{AsyncReadExt, AsyncSeekExt};
    let mut f = match tokio::fs::File::open(path).await {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    f.seek(std::io::SeekFrom::Start(offset)).await?;
    let mut buf = vec![0; max];
    let n = f.read(&mut buf).await?;
    buf.truncate(n);
    Ok(buf)
}

/// Run the agent until `stop` becomes true.
pub async fn run(opts: AgentOptions, mut stop: watch::Receiver<bool>) -> Result<()> {
    if opts.dispatchers.is_empty() {
        anyhow::bail!("no dispatcher address given");
    }
    let machine_cpus = opts.machine.cpu_ids();
    if machine_cpus.len() > opts.real_cpus.len() {
        tracing::info!(
            synthetic = machine_cpus.len(),
            real = opts.real_cpus.len(),
            "the topology has more CPUs than this machine: synthetic CPUs are mapped onto the real ones for pinning"
        );
    }
    let topo = Arc::new(
        opts.machine
            .to_sched()
            .context("building the engine topology")?,
    );
    let exec = Arc::new(Executor::new(opts.exec.clone()).context("starting the executor")?);
    let exits = exec
        .take_exits()
        .context("the executor's exit channel was already taken")?;
    let (started_tx, started) = mpsc::unbounded_channel();
    let mut inbox = Inbox { exits, started };
    // A lease left by a previous agent still binds the shims it started.
    let lease_file = exec.lease();
    let deadline = lease_file.read();
    let mut agent = Agent {
        lease: Lease {
            len_ns: 0,
            file: lease_file,
            deadline,
            logged: None,
            seq: 0,
            sent: VecDeque::new(),
            fenced_until_grant: false,
        },
        sliced_out: HashSet::new(),
        starting: HashMap::new(),
        started_tx,
        outbox: Vec::new(),
        batches: false,
        local: LocalScheduler::new(topo, opts.local.clone())
            .with_gpus(crate::gpus::GpuPool::new(&opts.machine)),
        opts,
        exec: exec.clone(),
        jobs: HashMap::new(),
        recent: BTreeMap::new(),
        start: Instant::now(),
        out: None,
        pinned: HashMap::new(),
        last_overloaded: Vec::new(),
        traces: crate::telemetry::JobTraces::default(),
    };
    // Jobs left running by a previous agent on this state directory.
    let report = exec.readopt().await.context("re-adopting jobs")?;
    // The GPUs re-adopted jobs hold (the ledger of the previous agent).
    let held_gpus = crate::gpus::Ledger::new(&agent.opts.exec.state_dir).load();
    for id in &report.reattached {
        if let (Ok(st), Some(_)) = (exec.status(id), parse_local_id(id)) {
            let local = LocalJob {
                id: id.clone(),
                cpus: st.cpus.len().max(1) as u32,
                align: Align::Any,
                policy: Policy::Spread,
                nice: 0,
                latency_nice: 0,
                gpus: held_gpus.get(id).map_or(0, |g| g.len() as u32),
            };
            let now = agent.now_ns();
            let gpus = held_gpus.get(id).cloned().unwrap_or_default();
            agent.local.adopt(local, &st.cpus, &gpus, now);
            agent.jobs.insert(
                id.clone(),
                Pending {
                    spec: JobSpec::default(),
                    owner: String::new(),
                },
            );
        }
    }
    if !report.reattached.is_empty() || !report.exited.is_empty() {
        tracing::info!(
            reattached = report.reattached.len(),
            exited = report.exited.len(),
            "re-adopted jobs"
        );
    }

    let mut backoff = Duration::from_millis(100);
    // Replicas: follow a follower's leader hint, else rotate (the shared
    // logic of proto::endpoints).
    let mut endpoints = proto::endpoints::Endpoints::new(agent.opts.dispatchers.clone())?;
    loop {
        if *stop.borrow() {
            break;
        }
        let url = endpoints.current().to_string();
        match session(&mut agent, &url, &mut inbox, &mut stop).await {
            Ok(()) => break,
            Err(err) => {
                if agent.out.take().is_some() {
                    // It had registered: a fresh failure, retry quickly.
                    endpoints.succeeded();
                    backoff = Duration::from_millis(100);
                }
                let next = endpoints.failed(err.downcast_ref::<tonic::Status>());
                if let proto::endpoints::Next::Redirected(leader) = &next {
                    tracing::info!(%url, %leader, "not the leader; following the hint");
                    backoff = Duration::from_millis(50);
                } else {
                    tracing::warn!(%url, "dispatcher stream: {err:#}; reconnecting in {backoff:?}");
                }
            }
        }
        // Keep handling exits and starts while disconnected.
        let deadline = tokio::time::Instant::now() + backoff;
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => break,
                Some(started) = inbox.started.recv() => agent.on_started(started),
                Some(exit) = inbox.exits.recv() => agent.on_exit(exit),
                _ = stop.changed() => break,
            }
            agent.outbox.clear(); // no stream: see `Agent::flush`
        }
        backoff = (backoff * 2).min(max_backoff(agent.lease.len_ns));
    }
    // Shims still starting: wait for their answers, so that the executor
    // tracks every job it is asked to shut down.
    let limit = tokio::time::Instant::now() + agent.opts.exec.shim_start_timeout;
    while !agent.starting.is_empty() {
        match tokio::time::timeout_at(limit, inbox.started.recv()).await {
            Ok(Some(started)) => agent.on_started(started),
            Ok(None) | Err(_) => break,
        }
    }
    exec.shutdown().await.context("stopping the executor")?;
    Ok(())
}

/// One connected session; returns Ok when asked to stop.
async fn session(
    agent: &mut Agent,
    url: &str,
    inbox: &mut Inbox,
    stop: &mut watch::Receiver<bool>,
) -> Result<()> {
    let endpoint = proto::endpoints::endpoint(url, &agent.opts.tls)
        .with_context(|| format!("dispatcher address {url}"))?;
    let channel = endpoint
        .connect()
        .await
        .with_context(|| format!("connecting to {url}"))?;
    let mut client = AgentServiceClient::new(channel).max_decoding_message_size(64 << 20);
    let (tx, rx) = mpsc::unbounded_channel();
    // Statuses from while there was no stream: the Register says it all.
    agent.outbox.clear();
    let register = agent.register_msg();
    let register_sent = lease::now_ns();
    let _ = tx.send(AgentMessage {
        msg: Some(agent_message::Msg::Register(Box::new(register))),
    });
    // A dispatcher that accepts connections but does not answer (paused)
    // must not hold the agent: bound the handshake.
    let (mut inbound, first) = tokio::time::timeout(proto::endpoints::CONNECT_TIMEOUT * 3, async {
        let mut inbound = client
            .attach(UnboundedReceiverStream::new(rx))
            .await
            .with_context(|| format!("attaching to {url}"))?
            .into_inner();
        let first = inbound.message().await.context("waiting for Registered")?;
        anyhow::Ok((inbound, first))
    })
    .await
    .with_context(|| format!("{url} did not answer the registration"))??;
    let interval = match first.and_then(|m| m.msg) {
        Some(dispatcher_message::Msg::Registered(r)) => {
            agent.lease_registered(r.lease_ms, register_sent);
            agent.batches = r.status_batches;
            Duration::from_millis(r.heartbeat_interval_ms.max(50))
        }
        _ => anyhow::bail!("the dispatcher did not answer Registered"),
    };
    agent.out = Some(tx);
    tracing::info!(%url, node = %agent.opts.node, "registered with the dispatcher");
    let mut tick = tokio::time::interval(agent.opts.tick);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut report = tokio::time::interval(interval / 2);
    report.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            msg = inbound.next() => {
                let msg = match msg {
                    Some(Ok(DispatcherMessage { msg: Some(m) })) => m,
                    Some(Ok(_)) => continue,
                    Some(Err(status)) => anyhow::bail!("stream error: {status}"),
                    None => anyhow::bail!("the dispatcher closed the stream"),
                };
                match msg {
                    dispatcher_message::Msg::Assign(a) => {
                        // Decoded: the message's own spec, no copy.
                        let spec = a.spec.map(SharedSpec::into_inner).unwrap_or_default();
                        agent.on_assign(a.job_id, a.attempt, spec, a.owner, &a.trace_context);
                    }
                    dispatcher_message::Msg::Cancel(c) => agent.on_cancel(&c.job_id, c.attempt),
                    dispatcher_message::Msg::Steal(s) => agent.on_steal(s.job_id, s.attempt),
                    dispatcher_message::Msg::LogRequest(r) => agent.serve_log(r),
                    dispatcher_message::Msg::Lease(l) => agent.on_lease(l),
                    dispatcher_message::Msg::Registered(_) => {}
                }
            }
            Some(started) = inbox.started.recv() => agent.on_started(started),
            Some(exit) = inbox.exits.recv() => agent.on_exit(exit),
            _ = tick.tick() => {
                let now = agent.now_ns();
                let actions = agent.local.tick(now);
                agent.carry_out(actions);
                agent.check_lease();
            }
            _ = report.tick() => {
                if let Some(metrics) = crate::metrics::installed() {
                    metrics.sample(&agent.local);
                }
                agent.send_load();
                // Logs of jobs that ended a retention ago (a bounded
                // number per report, so a backlog cannot stall the loop).
                agent.exec.prune_kept(agent.opts.retention, 64);
            }
            _ = stop.changed() => {
                if *stop.borrow() {
                    return Ok(());
                }
            }
        }
        // Whatever else is already waiting joins this turn's statuses:
        // exits and shim answers that came meanwhile (bounded, so a flood
        // of them cannot starve the stream), then one send.
        for _ in 0..256 {
            if let Ok(started) = inbox.started.try_recv() {
                agent.on_started(started);
            } else if let Ok(exit) = inbox.exits.try_recv() {
                agent.on_exit(exit);
            } else {
                break;
            }
        }
        agent.flush();
        // Report at once on every overload transition, not only on the
        // timer: the dispatcher's view of where work waits stays fresh.
        let overloaded = agent.local.overloaded();
        if overloaded != agent.last_overloaded {
            agent.last_overloaded = overloaded;
            agent.send_load();
        }
    }
}

/// The single-machine default: an agent for this machine (or a synthetic
/// one) attached to the dispatcher at `url`, with its state under `dir`.
pub async fn run_dev(
    url: String,
    tls: proto::client_security::ClientTls,
    dir: PathBuf,
    topology: Option<String>,
    stop: watch::Receiver<bool>,
) -> Result<()> {
    let reader = crate::topology::SysfsReader::host();
    let allowed = reader
        .default_allowed()
        .context("reading this process's CPU affinity")?;
    let real = reader
        .read(allowed.as_deref())
        .context("discovering this machine's topology")?;
    let machine = match &topology {
        Some(spec) => crate::topology::synthetic(spec)
            .with_context(|| format!("synthetic topology {spec}"))?,
        None => real.clone(),
    };
    let mut exec = ExecConfig::new(dir.join("jobs"));
    exec.shutdown = ShutdownMode::KillJobs;
    if nix::unistd::geteuid().is_root() {
        // Never run jobs as root by default: nobody/nogroup.
        exec.run_as = Some((65534, 65534));
    }
    let node = hostname();
    let opts = AgentOptions {
        dispatchers: vec![url],
        tls,
        node,
        labels: HashMap::new(),
        real_cpus: real.cpu_ids(),
        machine,
        memory_bytes: memory_total(),
        exec,
        local: LocalConfig {
            oversubscribe: true,
            ..LocalConfig::default()
        },
        oversubscribe: 2,
        tick: Duration::from_millis(10),
        retention: Duration::from_secs(3600),
    };
    run(opts, stop).await
}

/// The engine's schedstats as a load report carries them: every field, by
/// the names the metrics export (`dispatch_telemetry::schedstat_fields`,
/// the one list), so a new counter reaches the dispatcher without a second
/// list to forget. The proto map owns its keys: one short String each.
fn schedstats_report(stats: &sched::Schedstats) -> HashMap<String, u64> {
    dispatch_telemetry::schedstat_fields(stats)
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
}

/// The longest wait between two attempts to reach a dispatcher: 2 s, or a
/// quarter of the lease when that is shorter (at least 50 ms). Growing the
/// backoff past the lease would turn a short network cut into an outage
/// longer than the dispatcher's heartbeat deadline, after which it
/// retries the node's jobs elsewhere although they ran (faults_netcut saw
/// a 750 ms cut become 5 s and jobs run twice).
fn max_backoff(lease_ns: u64) -> Duration {
    let cap = Duration::from_secs(2);
    if lease_ns == 0 {
        return cap;
    }
    Duration::from_nanos(lease_ns / 4)
        .max(Duration::from_millis(50))
        .min(cap)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconnect_backoff_stays_under_the_lease() {
        // No lease known yet: the 2 s cap.
        assert_eq!(max_backoff(0), Duration::from_secs(2));
        // faults_netcut's 2 s lease: at most 500 ms between attempts.
        assert_eq!(max_backoff(2_000_000_000), Duration::from_millis(500));
        // A long lease keeps the 2 s cap; a tiny one the 50 ms floor.
        assert_eq!(max_backoff(60_000_000_000), Duration::from_secs(2));
        assert_eq!(max_backoff(1_000_000), Duration::from_millis(50));
        // Doubling from 100 ms never passes a quarter of the lease.
        let lease_ns = 2_000_000_000;
        let mut b = Duration::from_millis(100);
        for _ in 0..20 {
            b = (b * 2).min(max_backoff(lease_ns));
            assert!(b.as_nanos() <= u128::from(lease_ns) / 4, "{b:?}");
        }
    }

    /// Every field of `Schedstats`, read from its Debug output (not from
    /// the list under test), with its value.
    fn debug_fields(s: &sched::Schedstats) -> HashMap<String, u64> {
        let text = format!("{s:?}");
        let inner = text
            .split_once('{')
            .and_then(|(_, r)| r.rsplit_once('}'))
            .expect("a struct")
            .0;
        inner
            .split(',')
            .filter(|f| !f.trim().is_empty())
            .map(|f| {
                let (k, v) = f.split_once(':').expect("name: value");
                (k.trim().to_string(), v.trim().parse().expect("a counter"))
            })
            .collect()
    }

    #[test]
    fn load_reports_every_schedstat_with_its_value() {
        let s = sched::Schedstats {
            sis_core: 2,
            steal: 3,
            steal_skip_node_limit: 5,
            latency_pull: 7,
            nr_switches: 11,
            ..Default::default()
        };
        let want = debug_fields(&s);
        assert!(want.len() >= 22, "{want:?}");
        assert_eq!(schedstats_report(&s), want);
    }

    #[test]
    fn local_ids_round_trip() {
        assert_eq!(local_id("j-12.3", 2), "j-12.3_a2");
        assert_eq!(parse_local_id("j-12.3_a2"), Some(("j-12.3".to_string(), 2)));
        assert_eq!(parse_local_id("nope"), None);
    }

    #[test]
    fn topology_proto_matches_groups() {
        let m = crate::topology::synthetic("2s:2c:2t").unwrap();
        let t = topology_proto(&m);
        assert_eq!(t.cpus.len(), 8);
        assert_eq!(t.smt.len(), 4);
        assert_eq!(t.llc.len(), 2);
        assert_eq!(t.package.len(), 2);
    }
}
