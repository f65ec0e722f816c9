//! The agent's loop ([`agent::runtime::run`]) against a scripted
//! dispatcher: a real `AgentService` gRPC server on loopback that answers
//! the agent's Register, sends it Assigns and Cancels, and records every
//! message it gets back. Jobs run for real under the agent binary's shim,
//! started through a wrapper that holds each shim for a moment before it
//! runs, so that whether the loop waits for one shim before starting the
//! next shows in how many were starting at the same time.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::time::Duration;

use agent::exec::{ExecConfig, ShutdownMode};
use agent::local::LocalConfig;
use agent::runtime::{AgentOptions, run};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use proto::v1::agent_service_server::{AgentService, AgentServiceServer};
use proto::v1::{
    AgentMessage, Assign, Cancel, DispatcherMessage, JobSpec, JobState, JobStatus, Registered,
    agent_message, dispatcher_message,
};
use tokio::sync::{Mutex, mpsc, watch};
use tokio_stream::wrappers::{TcpListenerStream, UnboundedReceiverStream};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

const PATIENCE: Duration = Duration::from_secs(60);

/// What the agent sent: each job status in arrival order, and how many
/// messages carried them.
#[derive(Default)]
struct Seen {
    statuses: Vec<JobStatus>,
    single: usize,
    batches: usize,
    /// The number of the last LoadReport that asked for a lease.
    lease_seq: u64,
    /// Streams the agent attached.
    registers: usize,
}

/// The scripted dispatcher: one agent stream at a time.
struct Scripted {
    /// Messages to the agent, one script per Attach in order; a stream
    /// ends (an error, as a cut connection) when its script's sender is
    /// dropped.
    to_agent: Mutex<std::collections::VecDeque<mpsc::UnboundedReceiver<DispatcherMessage>>>,
    seen: std::sync::Arc<std::sync::Mutex<Seen>>,
    batches: bool,
    /// The lease granted with `Registered` (0: none); renewed only when
    /// the script sends a `Lease`.
    lease_ms: u64,
}

type BoxStream = Pin<Box<dyn Stream<Item = Result<DispatcherMessage, Status>> + Send>>;

#[tonic::async_trait]
impl AgentService for Scripted {
    type AttachStream = BoxStream;
    type AttachManyStream =
        Pin<Box<dyn Stream<Item = Result<proto::v1::RelayReply, Status>> + Send>>;

    async fn attach_many(
        &self,
        _req: Request<Streaming<proto::v1::RelayMessage>>,
    ) -> Result<Response<Self::AttachManyStream>, Status> {
        Err(Status::unimplemented("the agent never relays"))
    }

    async fn attach(
        &self,
        req: Request<Streaming<AgentMessage>>,
    ) -> Result<Response<BoxStream>, Status> {
        let mut inbound = req.into_inner();
        match inbound.message().await? {
            Some(AgentMessage {
                msg: Some(agent_message::Msg::Register(_)),
            }) => {}
            _ => return Err(Status::invalid_argument("Register first")),
        }
        let Some(mut script) = self.to_agent.lock().await.pop_front() else {
            return Err(Status::unavailable("no script left for another stream"));
        };
        self.seen.lock().unwrap().registers += 1;
        let (tx, rx) = mpsc::unbounded_channel();
        let _ = tx.send(Ok(DispatcherMessage {
            msg: Some(dispatcher_message::Msg::Registered(Registered {
                heartbeat_interval_ms: 1000,
                lease_ms: self.lease_ms,
                status_batches: self.batches,
            })),
        }));
        let out = tx.clone();
        tokio::spawn(async move {
            while let Some(msg) = script.recv().await {
                if out.send(Ok(msg)).is_err() {
                    return;
                }
            }
            let _ = out.send(Err(Status::unavailable("the script cut the stream")));
        });
        let seen = self.seen.clone();
        tokio::spawn(async move {
            while let Some(Ok(m)) = inbound.next().await {
                let mut seen = seen.lock().unwrap();
                match m.msg {
                    Some(agent_message::Msg::Status(s)) => {
                        seen.single += 1;
                        seen.statuses.push(s);
                    }
                    Some(agent_message::Msg::Statuses(b)) => {
                        seen.batches += 1;
                        seen.statuses.extend(b.statuses);
                    }
                    Some(agent_message::Msg::Load(l)) if l.seq != 0 => seen.lease_seq = l.seq,
                    _ => {}
                }
            }
            drop(tx);
        });
        Ok(Response::new(Box::pin(UnboundedReceiverStream::new(rx))))
    }
}

fn allowed_cpus() -> Vec<u32> {
    use nix::sched::{CpuSet, sched_getaffinity};
    let set = sched_getaffinity(nix::unistd::Pid::from_raw(0)).expect("sched_getaffinity");
    (0..CpuSet::count())
        .filter(|&i| set.is_set(i).unwrap_or(false))
        .map(|i| i as u32)
        .collect()
}

/// A shim wrapper: marks itself in flight for `hold`, records how many
/// shims were in flight at the end of it, then becomes the real shim.
fn slow_shim(dir: &Path, hold: &str) -> PathBuf {
    let inflight = dir.join("inflight");
    fs::create_dir_all(&inflight).unwrap();
    let script = dir.join("slow-shim");
    fs::write(
        &script,
        format!(
            "#!/bin/sh\nPATH=/usr/sbin:/usr/bin:/sbin:/bin\nmkdir '{i}/'$$\nsleep {hold}\nls '{i}' | wc -l >> '{o}'\nrmdir '{i}/'$$\nexec '{agent}' \"$@\"\n",
            i = inflight.display(),
            o = dir.join("overlap").display(),
            agent = env!("CARGO_BIN_EXE_agent"),
        ),
    )
    .unwrap();
    fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).unwrap();
    script
}

fn assign(id: &str, command: &[&str]) -> DispatcherMessage {
    DispatcherMessage {
        msg: Some(dispatcher_message::Msg::Assign(Assign {
            job_id: id.to_string(),
            attempt: 1,
            spec: Some(
                JobSpec {
                    command: command.iter().map(|s| s.to_string()).collect(),
                    cpus: 1,
                    ..Default::default()
                }
                .into(),
            ),
            ..Default::default()
        })),
    }
}

/// Start the scripted dispatcher and an agent on it; returns the script's
/// sender, what the dispatcher saw, and the agent's stop switch and task.
async fn start(
    dir: &Path,
    batches: bool,
    hold: &str,
) -> (
    mpsc::UnboundedSender<DispatcherMessage>,
    std::sync::Arc<std::sync::Mutex<Seen>>,
    watch::Sender<bool>,
    tokio::task::JoinHandle<anyhow::Result<()>>,
) {
    start_with_lease(dir, batches, hold, 0).await
}

/// [`start`], with a lease of `lease_ms` granted at registration.
async fn start_with_lease(
    dir: &Path,
    batches: bool,
    hold: &str,
    lease_ms: u64,
) -> (
    mpsc::UnboundedSender<DispatcherMessage>,
    std::sync::Arc<std::sync::Mutex<Seen>>,
    watch::Sender<bool>,
    tokio::task::JoinHandle<anyhow::Result<()>>,
) {
    let (mut scripts, seen, stop, task) = start_streams(dir, batches, hold, lease_ms, 1).await;
    (scripts.remove(0), seen, stop, task)
}

/// [`start_with_lease`], with a script for each of `streams` attaches:
/// dropping one's sender cuts its stream, and the agent attaches again.
async fn start_streams(
    dir: &Path,
    batches: bool,
    hold: &str,
    lease_ms: u64,
    streams: usize,
) -> (
    Vec<mpsc::UnboundedSender<DispatcherMessage>>,
    std::sync::Arc<std::sync::Mutex<Seen>>,
    watch::Sender<bool>,
    tokio::task::JoinHandle<anyhow::Result<()>>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (scripts, to_agent): (Vec<_>, _) = (0..streams).map(|_| mpsc::unbounded_channel()).unzip();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Seen::default()));
    let service = Scripted {
        to_agent: Mutex::new(to_agent),
        seen: seen.clone(),
        batches,
        lease_ms,
    };
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(AgentServiceServer::new(service))
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    let mut exec = ExecConfig::new(dir.join("state"));
    exec.shim_exe = slow_shim(dir, hold);
    // Shims, one per job, each held: the supervisor would be held once.
    exec.launcher = agent::exec::Launcher::Shim;
    exec.run_as = nix::unistd::geteuid().is_root().then_some((65534, 65534));
    exec.shim_start_timeout = PATIENCE;
    exec.shutdown = ShutdownMode::KillJobs;
    exec.shutdown_grace = Duration::from_millis(200);
    let opts = AgentOptions {
        dispatchers: vec![url],
        tls: Default::default(),
        node: "n0".into(),
        labels: HashMap::new(),
        machine: agent::topology::synthetic("1s:4c:2t").unwrap(),
        real_cpus: allowed_cpus(),
        memory_bytes: 0,
        exec,
        local: LocalConfig::default(),
        oversubscribe: 1,
        tick: Duration::from_millis(10),
        retention: Duration::from_secs(3600),
    };
    let (stop, stop_rx) = watch::channel(false);
    let task = tokio::spawn(run(opts, stop_rx));
    (scripts, seen, stop, task)
}

/// Wait until `done` holds for what the dispatcher saw.
async fn wait_for(seen: &std::sync::Mutex<Seen>, what: &str, done: impl Fn(&Seen) -> bool) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !done(&seen.lock().unwrap()) {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn is_terminal(s: &JobStatus) -> bool {
    s.state != JobState::Running as i32
}

/// Every job's states in arrival order.
fn by_job(seen: &Seen) -> BTreeMap<String, Vec<i32>> {
    let mut out: BTreeMap<String, Vec<i32>> = BTreeMap::new();
    for s in &seen.statuses {
        out.entry(s.job_id.clone()).or_default().push(s.state);
    }
    out
}

/// Eight jobs at once on eight CPUs, each shim held for a second before it
/// runs: the loop starts them all without waiting for any shim (several
/// shims are in flight together), reports each start before its end and
/// each end once, and a cancel that comes while the shim starts is carried
/// out once it answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starts_jobs_without_waiting_for_each_shim() {
    let dir = tempfile::tempdir().unwrap();
    let (script, seen, stop, task) = start(dir.path(), true, "1").await;
    for i in 0..7 {
        script.send(assign(&format!("j-{i}"), &["true"])).unwrap();
    }
    script.send(assign("j-7", &["sleep", "30"])).unwrap();
    // Before its shim can have answered (held a second).
    script
        .send(DispatcherMessage {
            msg: Some(dispatcher_message::Msg::Cancel(Cancel {
                job_id: "j-7".into(),
                attempt: 1,
            })),
        })
        .unwrap();
    wait_for(&seen, "eight jobs ended", |s| {
        s.statuses.iter().filter(|s| is_terminal(s)).count() >= 8
    })
    .await;
    // Nothing more comes for them.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _ = stop.send(true);
    task.await.unwrap().unwrap();

    let seen = seen.lock().unwrap();
    let jobs = by_job(&seen);
    assert_eq!(jobs.len(), 8, "{jobs:?}");
    for (id, states) in &jobs {
        let end = if id == "j-7" {
            JobState::Cancelled
        } else {
            JobState::Succeeded
        };
        assert_eq!(
            states,
            &vec![JobState::Running as i32, end as i32],
            "job {id}: its start, then its end, each once"
        );
    }
    let overlap = fs::read_to_string(dir.path().join("overlap")).unwrap();
    let most = overlap
        .lines()
        .filter_map(|l| l.trim().parse::<u32>().ok())
        .max()
        .unwrap_or(0);
    assert!(
        most >= 2,
        "at most {most} shim(s) starting at a time: the loop waited for each (counts: {overlap:?})"
    );
    assert!(seen.single + seen.batches > 0);
}

/// A dispatcher that does not say it takes batches gets one message per
/// status; one that does gets the same statuses, batched or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sends_batches_only_to_a_dispatcher_that_takes_them() {
    for batches in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let (script, seen, stop, task) = start(dir.path(), batches, "0.2").await;
        for i in 0..8 {
            script.send(assign(&format!("j-{i}"), &["true"])).unwrap();
        }
        wait_for(&seen, "eight jobs ended", |s| {
            s.statuses.iter().filter(|s| is_terminal(s)).count() >= 8
        })
        .await;
        let _ = stop.send(true);
        task.await.unwrap().unwrap();
        let seen = seen.lock().unwrap();
        if !batches {
            assert_eq!(seen.batches, 0, "no StatusBatch without status_batches");
        }
        assert_eq!(
            seen.statuses.len(),
            16,
            "eight starts and eight ends, once each"
        );
        for (id, states) in by_job(&seen) {
            assert_eq!(
                states,
                vec![JobState::Running as i32, JobState::Succeeded as i32],
                "job {id}"
            );
        }
    }
}

/// The state letter of `/proc/<pid>/stat` (`T`: stopped).
fn proc_state(pid: i32) -> Option<char> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// A job `j-1` whose shell appends to `mark` each time it is continued
/// (a SIGCONT trap), once its shim has stopped it for the lapsed lease.
struct FencedJob {
    record: PathBuf,
    pid: i32,
    mark: PathBuf,
}

impl FencedJob {
    /// The pid on the record's `key` line (`job`, `shim`).
    fn record_pid(&self, key: &str) -> Option<i32> {
        record_pid(&self.record, key)
    }
}

fn record_pid(record: &Path, key: &str) -> Option<i32> {
    fs::read_to_string(record).ok().and_then(|r| {
        r.lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(' '))
            .and_then(|l| l.split(' ').next()?.parse::<i32>().ok())
    })
}

/// Assign `j-1` with its SIGCONT trap and wait until the lease (granted
/// at registration, never renewed by the script so far) has run out and
/// the shim has stopped it.
async fn fenced_trap_job(
    dir: &Path,
    script: &mpsc::UnboundedSender<DispatcherMessage>,
    seen: &std::sync::Mutex<Seen>,
) -> FencedJob {
    let marks = dir.join("marks");
    fs::create_dir(&marks).unwrap();
    fs::set_permissions(&marks, fs::Permissions::from_mode(0o777)).unwrap();
    let mark = marks.join("continued");
    let body = format!(
        "trap 'echo cont >> {}' CONT; while :; do sleep 0.05; done",
        mark.display()
    );
    script
        .send(assign("j-1", &["/bin/sh", "-c", &body]))
        .unwrap();
    wait_for(seen, "j-1 running", |s| {
        s.statuses.iter().any(|s| s.job_id == "j-1")
    })
    .await;
    let record = dir.join("state/jobs/j-1_a1/record");
    let deadline = tokio::time::Instant::now() + PATIENCE;
    let pid = loop {
        if let Some(pid) = record_pid(&record, "job")
            && proc_state(pid) == Some('T')
        {
            break pid;
        }
        assert!(tokio::time::Instant::now() < deadline, "j-1 never fenced");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    FencedJob { record, pid, mark }
}

/// Cancel `j-1` attempt 1 and grant the lease for report `seq` (60 s).
fn cancel_then_grant(script: &mpsc::UnboundedSender<DispatcherMessage>, seq: u64) {
    script
        .send(DispatcherMessage {
            msg: Some(dispatcher_message::Msg::Cancel(Cancel {
                job_id: "j-1".into(),
                attempt: 1,
            })),
        })
        .unwrap();
    script
        .send(DispatcherMessage {
            msg: Some(dispatcher_message::Msg::Lease(proto::v1::Lease {
                seq,
                lease_ms: 60_000,
            })),
        })
        .unwrap();
}

/// Wait for `j-1`'s end; it must have been Cancelled, its processes gone
/// and its SIGCONT trap never run.
async fn cancelled_and_never_continued(seen: &std::sync::Mutex<Seen>, fenced: &FencedJob) {
    wait_for(seen, "j-1 ended", |s| {
        s.statuses
            .iter()
            .any(|s| s.job_id == "j-1" && is_terminal(s))
    })
    .await;
    let jobs = by_job(&seen.lock().unwrap());
    assert_eq!(
        jobs["j-1"],
        vec![JobState::Running as i32, JobState::Cancelled as i32]
    );
    assert!(
        proc_state(fenced.pid).is_none_or(|s| s == 'Z'),
        "j-1 outlived its end"
    );
    assert!(
        !fenced.mark.exists(),
        "the cancelled job was continued before its SIGTERM: {:?}",
        fs::read_to_string(&fenced.mark)
    );
}

/// A job fenced by a lapsed lease, then cancelled, with a renewal right
/// behind the Cancel (a stale copy the dispatcher retried elsewhere while
/// its node was cut off, when the node comes back): the agent must not
/// continue it. Its termination continues it, SIGTERM first, so the job's
/// SIGCONT trap never runs; a continue of the agent's own, which comes
/// before the shim has read the cancel request, would run it. The shim is
/// held stopped from before the Cancel until after the renewal, so that
/// a continue of the agent's cannot lose the race to the shim's SIGTERM
/// (CI lost it the other way once, in `faults_stall`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_job_is_not_continued_when_the_lease_comes_back() {
    let dir = tempfile::tempdir().unwrap();
    let (script, seen, stop, task) = start_with_lease(dir.path(), true, "0", 300).await;
    let fenced = fenced_trap_job(dir.path(), &script, &seen).await;
    wait_for(&seen, "a LoadReport asking for a lease", |s| {
        s.lease_seq != 0
    })
    .await;
    let seq = seen.lock().unwrap().lease_seq;
    let shim = Pid::from_raw(
        fenced
            .record_pid("shim")
            .expect("the shim's pid in the record"),
    );
    kill(shim, Signal::SIGSTOP).unwrap();
    let lease_file = dir.path().join("state/lease");
    let lapsed = fs::read_to_string(&lease_file).unwrap();
    cancel_then_grant(&script, seq);
    // The renewal is in the file before any continue of the agent's.
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while fs::read_to_string(&lease_file).is_ok_and(|l| l == lapsed) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the lease never renewed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Time for a wrongly continued job to run its trap.
    tokio::time::sleep(Duration::from_millis(300)).await;
    kill(shim, Signal::SIGCONT).unwrap();
    cancelled_and_never_continued(&seen, &fenced).await;
    let _ = stop.send(true);
    task.await.unwrap().unwrap();
}

/// A job fenced while the agent's stream was down, which the dispatcher
/// retried elsewhere meanwhile: the new stream's `Registered` renews the
/// lease, but the jobs stay stopped until the first grant on that stream,
/// and the Cancel the dispatcher sends after `Registered` (it reconciles
/// the jobs the registration reported) comes before any grant. A continue
/// at `Registered` would run the job's SIGCONT trap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fenced_jobs_wait_for_a_grant_after_a_new_registration() {
    let dir = tempfile::tempdir().unwrap();
    let (mut scripts, seen, stop, task) = start_streams(dir.path(), true, "0", 300, 2).await;
    let second = scripts.pop().unwrap();
    let first = scripts.pop().unwrap();
    let fenced = fenced_trap_job(dir.path(), &first, &seen).await;
    let before = seen.lock().unwrap().lease_seq;
    // Cut the stream: the agent attaches again and gets a 300 ms lease
    // with `Registered`.
    drop(first);
    wait_for(&seen, "a second registration", |s| s.registers == 2).await;
    wait_for(&seen, "a LoadReport on the new stream", |s| {
        s.lease_seq > before
    })
    .await;
    // Time for a wrongly continued job to run its trap.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let seq = seen.lock().unwrap().lease_seq;
    cancel_then_grant(&second, seq);
    cancelled_and_never_continued(&seen, &fenced).await;
    let _ = stop.send(true);
    task.await.unwrap().unwrap();
}
