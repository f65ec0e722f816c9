//! The executor API the local scheduler drives: [`Executor`] spawns jobs
//! through shims, signals, re-pins and cancels them, watches their shims,
//! delivers every exit once per executor on a channel, re-adopts jobs
//! after an agent restart and shuts down as configured.
//!
//! One executor owns a state directory (an exclusive `flock` on
//! `<state_dir>/lock`); each job lives in `<state_dir>/jobs/<id>/` (see
//! the table in `jobdir.rs`). Exit delivery is at least once across
//! restarts: a finished job's directory stays, and every new executor's
//! [`Executor::readopt`] reports it again, until the consumer calls
//! [`Executor::ack`] (keep the logs) or [`Executor::remove`] (delete them).

use std::collections::{HashMap, VecDeque};
use std::fs::{self, File, OpenOptions, TryLockError};
use std::io;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::{Pid, geteuid};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;

use super::cgroup::{self, CgroupPool, CgroupSupport, Limits};
use super::error::{ExecError, Result};
use super::group::JobProcs;
use super::jobdir::{JobDir, write_json};
use super::procfs;
use super::spares::Spares;
use super::spec::{
    CancelRequest, JobExec, JobExit, JobOutcome, RunAs, SPEC_VERSION, ShimSpec, validate_cpus,
    validate_id,
};
use super::supervisor::{self, LineSender};

/// What [`Executor::shutdown`] does with running jobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ShutdownMode {
    /// Cancel every job (SIGTERM, SIGKILL after `shutdown_grace`) and wait
    /// for their exits.
    #[default]
    KillJobs,
    /// Leave jobs running under their shims; a later executor on the same
    /// state directory re-adopts them with [`Executor::readopt`].
    LeaveRunning,
}

/// How jobs are started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Launcher {
    /// Every job under a shim of its own (`agent shim --job-dir DIR`): two
    /// processes per job (the agent binary re-executed, then the job).
    Shim,
    /// The default. Jobs with a cgroup as direct children of the agent's
    /// one supervisor process ([`supervisor`]): one process per job. A job
    /// without a cgroup (no cgroup v2 root could be made or was
    /// configured, or its creation failed) still gets a shim, which alone
    /// can tell its escaped processes apart.
    #[default]
    Supervisor,
}

/// Configuration of an [`Executor`].
#[derive(Debug, Clone)]
pub struct ExecConfig {
    /// Directory for the lock and the job directories (created if needed).
    pub state_dir: PathBuf,
    /// Cap on each of a job's `stdout` and `stderr` files, bytes.
    pub log_cap_bytes: u64,
    /// The unprivileged uid/gid jobs run as when the agent runs as root.
    /// Ignored (with a warning) when the agent is not root.
    pub run_as: Option<(u32, u32)>,
    /// Allow jobs to run as root (when the agent is root and `run_as` is
    /// unset or uid 0). Off by default: such spawns are refused.
    pub allow_root: bool,
    /// Owner-specific uid:gid (when the agent is root); owners not in the
    /// map run as `run_as`.
    pub user_map: super::UserMap,
    /// A cgroup v2 directory under which to create one cgroup per job
    /// (see `cgroup.rs`); `None`: no cgroups.
    pub cgroup_root: Option<PathBuf>,
    /// What [`Executor::shutdown`] does with running jobs.
    pub shutdown: ShutdownMode,
    /// Grace between SIGTERM and SIGKILL on `KillJobs` shutdown.
    pub shutdown_grace: Duration,
    /// The binary that runs the shim as `<shim_exe> shim --job-dir DIR`:
    /// the agent binary itself.
    pub shim_exe: PathBuf,
    /// How long [`Executor::spawn`] waits for the shim's answer.
    pub shim_start_timeout: Duration,
    /// How often the shim of a re-adopted job (not a child of this
    /// process) is checked.
    pub adopt_poll_interval: Duration,
    /// Shims, or the supervisor where jobs have cgroups.
    pub launcher: Launcher,
}

impl ExecConfig {
    /// Defaults: 64 MiB log cap, no `run_as`, root refused, no cgroups,
    /// `KillJobs` with a 10 s grace, this executable as the shim.
    pub fn new(state_dir: impl Into<PathBuf>) -> Self {
        ExecConfig {
            state_dir: state_dir.into(),
            log_cap_bytes: 64 << 20,
            run_as: None,
            allow_root: false,
            user_map: super::UserMap::default(),
            cgroup_root: None,
            shutdown: ShutdownMode::KillJobs,
            shutdown_grace: Duration::from_secs(10),
            // /proc/self/exe resolves in the forked child, which is still
            // this binary: a working fallback.
            shim_exe: std::env::current_exe().unwrap_or_else(|_| PathBuf::from("/proc/self/exe")),
            shim_start_timeout: Duration::from_secs(30),
            adopt_poll_interval: Duration::from_millis(100),
            launcher: Launcher::default(),
        }
    }
}

/// Where a job is in its life.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobState {
    /// Its shim runs; `stopped` after [`Executor::stop`] until
    /// [`Executor::cont`].
    Running {
        /// Stopped with SIGSTOP.
        stopped: bool,
    },
    /// It ended.
    Finished(JobExit),
}

/// A snapshot of one job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobStatus {
    /// The job.
    pub id: String,
    /// Its directory (logs: `stdout`, `stderr`, created on the first byte).
    pub dir: PathBuf,
    /// Pid of its first process, which is also its process group id.
    pub pid: Option<u32>,
    /// Pid of its shim.
    pub shim_pid: Option<u32>,
    /// The CPUs it is pinned to.
    pub cpus: Vec<u32>,
    /// Its cgroup, if it has one.
    pub cgroup: Option<PathBuf>,
    /// Running or finished.
    pub state: JobState,
}

/// What [`Executor::readopt`] found in the state directory. Every exit in
/// `exited` and `lost` is also delivered on the exit channel.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReadoptReport {
    /// Jobs whose shim still runs: watched again.
    pub reattached: Vec<String>,
    /// Jobs that finished (an `exit` in their `record`) without an `ack`.
    pub exited: Vec<String>,
    /// Jobs whose shim is gone without a status: their leftovers were
    /// killed and the exit is [`JobOutcome::Lost`].
    pub lost: Vec<String>,
    /// Directories that could not be read (warned about, left alone).
    pub skipped: Vec<String>,
}

/// A started job: its pids and paths, and a way to wait for its exit.
#[derive(Debug, Clone)]
pub struct JobHandle {
    id: String,
    pid: u32,
    shim_pid: u32,
    dir: PathBuf,
    cgroup: Option<PathBuf>,
    exit: watch::Receiver<Option<JobExit>>,
}

impl JobHandle {
    /// The job's id.
    pub fn id(&self) -> &str {
        &self.id
    }
    /// Pid of the job's first process (= its process group id).
    pub fn pid(&self) -> u32 {
        self.pid
    }
    /// Pid of its shim.
    pub fn shim_pid(&self) -> u32 {
        self.shim_pid
    }
    /// Its directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
    /// The file its stdout goes to (readable while it runs; created on its
    /// first byte, so a missing file is an empty log).
    pub fn stdout_path(&self) -> PathBuf {
        self.dir.join("stdout")
    }
    /// The file its stderr goes to (like [`JobHandle::stdout_path`]).
    pub fn stderr_path(&self) -> PathBuf {
        self.dir.join("stderr")
    }
    /// Its cgroup, if it has one.
    pub fn cgroup(&self) -> Option<&Path> {
        self.cgroup.as_deref()
    }
    /// The exit, if it has been observed.
    pub fn try_exit(&self) -> Option<JobExit> {
        self.exit.borrow().clone()
    }
    /// Wait for the job's exit.
    pub async fn wait(&mut self) -> Result<JobExit> {
        loop {
            if let Some(exit) = self.exit.borrow_and_update().clone() {
                return Ok(exit);
            }
            if self.exit.changed().await.is_err() {
                return self
                    .exit
                    .borrow()
                    .clone()
                    .ok_or_else(|| ExecError::ExecutorGone(self.id.clone()));
            }
        }
    }
}

/// One tracked job.
#[derive(Debug)]
struct Job {
    dir: JobDir,
    pid: Option<i32>,
    shim_pid: Option<i32>,
    cpus: Vec<u32>,
    cgroup: Option<PathBuf>,
    /// The cgroup is a slot of the pool with these limits: it goes back
    /// to the pool when the job ends (`None`: removed).
    slot: Option<Limits>,
    stopped: bool,
    /// A cancel was asked for ([`Executor::cancel`]): [`Executor::cont`]
    /// leaves the job as it is. Its termination continues it, SIGTERM
    /// first, once the shim or supervisor has read the request; a stopped
    /// job continued before that could run its next step (a stale copy,
    /// fenced while its node was cut off and retried elsewhere, would
    /// leave its output twice).
    cancelling: bool,
    exit_tx: watch::Sender<Option<JobExit>>,
    monitor: Option<JoinHandle<()>>,
    /// Run by the supervisor (`shim_pid` is the supervisor's, shared with
    /// other jobs): its processes are those of its process group and its
    /// cgroup, never the children of `shim_pid`.
    supervised: bool,
}

impl Job {
    fn exit(&self) -> Option<JobExit> {
        self.exit_tx.borrow().clone()
    }

    /// The job's processes, if it is running and its shim is the one we
    /// know (checked against /proc, against pid reuse).
    fn running_procs(&self, id: &str) -> Result<JobProcs<'_>> {
        let not_running = || ExecError::NotRunning(id.to_owned());
        if self.exit().is_some() {
            return Err(not_running());
        }
        let (Some(pgid), Some(shim)) = (self.pid, self.shim_pid) else {
            return Err(not_running());
        };
        if !procfs::is_shim_for(shim, self.dir.path()) {
            return Err(not_running());
        }
        Ok(JobProcs {
            pgid,
            shim: (!self.supervised).then_some(shim),
            cgroup: self.cgroup.as_deref(),
        })
    }

    fn status(&self, id: &str) -> JobStatus {
        let to_u32 = |p: Option<i32>| p.and_then(|p| u32::try_from(p).ok());
        JobStatus {
            id: id.to_owned(),
            dir: self.dir.path().to_owned(),
            pid: to_u32(self.pid),
            shim_pid: to_u32(self.shim_pid),
            cpus: self.cpus.clone(),
            cgroup: self.cgroup.clone(),
            state: match self.exit() {
                Some(exit) => JobState::Finished(exit),
                None => JobState::Running {
                    stopped: self.stopped,
                },
            },
        }
    }
}

/// State shared with the monitor tasks.
#[derive(Debug)]
struct Shared {
    jobs: Mutex<HashMap<String, Job>>,
    exits_tx: mpsc::UnboundedSender<JobExit>,
    /// Empty job cgroups for the next jobs (with a cgroup root).
    pool: Option<CgroupPool>,
}

impl Shared {
    fn jobs(&self) -> MutexGuard<'_, HashMap<String, Job>> {
        // A panic while holding the lock leaves consistent data (every
        // update is a single assignment), so poisoning is ignored.
        self.jobs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Deliver a job's exit, once (a supervised job's exit may be seen
    /// both by the supervisor's message and by a re-adopted job's poll).
    fn finish(&self, id: &str, exit: JobExit) {
        self.finish_then(id, exit, || ());
    }

    /// [`Shared::finish`], running `then` under the jobs' lock just
    /// before the exit is set, if this call delivers it: its result, or
    /// `None` if the exit was delivered before (by another caller, who
    /// ran its own `then`).
    fn finish_then<T>(&self, id: &str, exit: JobExit, then: impl FnOnce() -> T) -> Option<T> {
        let done = {
            let mut jobs = self.jobs();
            match jobs.get_mut(id) {
                Some(job) if job.exit().is_some() => return None,
                Some(job) => {
                    let done = then();
                    job.stopped = false;
                    job.exit_tx.send_replace(Some(exit.clone()));
                    done
                }
                None => then(),
            }
        };
        // Nobody listening is fine: the exit stays on disk.
        let _ = self.exits_tx.send(exit);
        Some(done)
    }
}

/// How a monitor learns that a shim has gone.
enum ShimWatch {
    /// Our child: wait for it.
    Child(tokio::process::Child),
    /// Someone else's (re-adopted): poll /proc and the `record`.
    Adopted(Option<i32>, Duration),
}

/// Runs jobs through shims; see the module documentation.
#[derive(Debug)]
pub struct Executor {
    cfg: ExecConfig,
    jobs_dir: PathBuf,
    /// Recycled job directories (none if the pool could not be opened).
    spares: Option<Spares>,
    /// Acked jobs whose directories stay (they hold output), oldest
    /// first, with when they were acked (or found acked by `readopt`):
    /// removed by [`Executor::prune_kept`].
    kept: Mutex<VecDeque<(Instant, String)>>,
    cgroup: Option<CgroupSupport>,
    shared: Arc<Shared>,
    exits_rx: Mutex<Option<mpsc::UnboundedReceiver<JobExit>>>,
    shut_down: AtomicBool,
    /// The connection to the supervisor, once a supervised job started.
    link: tokio::sync::Mutex<Option<Link>>,
    /// The cgroup root made for this state directory (none configured),
    /// removed on shutdown once empty.
    auto_root: Option<PathBuf>,
    _lock: File,
}

/// How long [`Executor::new`] waits for the state directory's lock before
/// it reports [`ExecError::StateDirLocked`].
const LOCK_PATIENCE: Duration = Duration::from_secs(1);
/// How often it tries the lock meanwhile.
const LOCK_RETRY: Duration = Duration::from_millis(5);

impl Executor {
    /// Open (create) the state directory, lock it, probe cgroups. Needs no
    /// runtime; `spawn` and `readopt` run on tokio.
    pub fn new(mut cfg: ExecConfig) -> Result<Executor> {
        fs::create_dir_all(&cfg.state_dir)
            .map_err(|e| ExecError::io("create", &cfg.state_dir, e))?;
        cfg.state_dir = cfg
            .state_dir
            .canonicalize()
            .map_err(|e| ExecError::io("resolve", &cfg.state_dir, e))?;
        let lock_path = cfg.state_dir.join("lock");
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| ExecError::io("open", &lock_path, e))?;
        // An flock belongs to the open file, and a child forked anywhere in
        // this process holds a copy of every descriptor until its exec: an
        // executor dropped just before this one may leave its lock held for
        // those few milliseconds. Only a lock held for longer is another
        // executor's.
        let mut patience = LOCK_PATIENCE;
        loop {
            match lock.try_lock() {
                Ok(()) => break,
                Err(TryLockError::WouldBlock) if !patience.is_zero() => {
                    std::thread::sleep(LOCK_RETRY);
                    patience = patience.saturating_sub(LOCK_RETRY);
                }
                Err(TryLockError::WouldBlock) => {
                    return Err(ExecError::StateDirLocked(cfg.state_dir.clone()));
                }
                Err(TryLockError::Error(e)) => return Err(ExecError::io("flock", &lock_path, e)),
            }
        }
        let jobs_dir = cfg.state_dir.join("jobs");
        fs::create_dir_all(&jobs_dir).map_err(|e| ExecError::io("create", &jobs_dir, e))?;
        let spares = Spares::open(&cfg.state_dir)
            .inspect_err(|e| tracing::warn!(error = %e, "job directories are not recycled"))
            .ok();

        let root = geteuid().is_root();
        match cfg.run_as {
            Some((uid, gid)) if !root => tracing::warn!(
                uid,
                gid,
                "not running as root: run_as is ignored, jobs run as the agent's user"
            ),
            Some((0, _)) | None if root && !cfg.allow_root => tracing::warn!(
                "running as root without an unprivileged run_as and without allow_root: every spawn will be refused"
            ),
            _ => {}
        }
        // The supervisor takes only jobs with a cgroup: without a
        // configured root it makes one for this state directory.
        let auto_root = (cfg.cgroup_root.is_none() && cfg.launcher == Launcher::Supervisor)
            .then(|| cgroup::state_dir_root(&cfg.state_dir))
            .flatten();
        let cgroup = match cfg.cgroup_root.as_ref().or(auto_root.as_ref()) {
            None => {
                tracing::info!("no cgroup root configured: jobs get no cgroup");
                None
            }
            Some(root) => match CgroupSupport::probe(root) {
                Ok(support) => {
                    tracing::info!(
                        root = %support.root.display(),
                        cpuset = support.cpuset,
                        memory = support.memory,
                        "one cgroup v2 per job"
                    );
                    Some(support)
                }
                Err(reason) if auto_root.is_some() => {
                    tracing::info!(%reason, "no cgroup for jobs: each runs under a shim");
                    None
                }
                Err(reason) => {
                    tracing::warn!(%reason, "jobs get no cgroup");
                    None
                }
            },
        };
        let auto_root = auto_root.filter(|_| cgroup.is_some());
        let pool = cgroup.as_ref().map(CgroupPool::open);
        let (exits_tx, exits_rx) = mpsc::unbounded_channel();
        Ok(Executor {
            cfg,
            jobs_dir,
            spares,
            kept: Mutex::new(VecDeque::new()),
            cgroup,
            shared: Arc::new(Shared {
                jobs: Mutex::new(HashMap::new()),
                exits_tx,
                pool,
            }),
            exits_rx: Mutex::new(Some(exits_rx)),
            shut_down: AtomicBool::new(false),
            link: tokio::sync::Mutex::new(None),
            auto_root,
            _lock: lock,
        })
    }

    /// The configuration (with the state directory made absolute).
    pub fn config(&self) -> &ExecConfig {
        &self.cfg
    }

    /// What job cgroups get on this machine (`None`: no cgroups; the
    /// reason was logged by [`Executor::new`]).
    pub fn cgroup_support(&self) -> Option<&CgroupSupport> {
        self.cgroup.as_ref()
    }

    /// The channel of job exits: every exit this executor observes, once,
    /// including those found by [`Executor::readopt`]. `None` after the
    /// first call.
    pub fn take_exits(&self) -> Option<mpsc::UnboundedReceiver<JobExit>> {
        self.exits_rx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }

    /// The identity `job` runs as: its owner's entry in the user map,
    /// else `run_as`; uid 0 only with `allow_root`.
    fn resolve_run_as(&self, job: &JobExec) -> Result<Option<RunAs>> {
        if !geteuid().is_root() {
            return Ok(None);
        }
        let id = &job.id;
        let mapped = (!job.owner.is_empty())
            .then(|| self.cfg.user_map.lookup(&job.owner))
            .flatten();
        match mapped.or(self.cfg.run_as) {
            Some((uid, gid)) if uid != 0 => Ok(Some(RunAs { uid, gid })),
            Some((uid, gid)) if self.cfg.allow_root => Ok(Some(RunAs { uid, gid })),
            None if self.cfg.allow_root => Ok(None),
            _ => Err(ExecError::RefuseRoot(id.to_owned())),
        }
    }

    /// Start a job and return once it runs (its shim has forked and exec'd
    /// it) or could not start.
    pub async fn spawn(&self, job: JobExec) -> Result<JobHandle> {
        if self.shut_down.load(Ordering::SeqCst) {
            return Err(ExecError::ShutDown);
        }
        job.validate()?;
        let run_as = self.resolve_run_as(&job)?;
        if self.shared.jobs().contains_key(&job.id) {
            return Err(ExecError::AlreadyExists(job.id));
        }
        let dir = JobDir::new(self.jobs_dir.join(&job.id));
        let made = match &self.spares {
            Some(spares) => spares.make(dir.path()),
            None => fs::create_dir(dir.path()),
        };
        match made {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                return Err(ExecError::AlreadyExists(job.id));
            }
            Err(e) => return Err(ExecError::io("create", dir.path(), e)),
        }
        tracing::debug!(target: "lat", job = %job.id, "dir made");
        let result = self.start(&job, run_as, &dir).await;
        if result.is_err() {
            let _ = fs::remove_dir_all(dir.path());
        }
        result
    }

    async fn start(&self, job: &JobExec, run_as: Option<RunAs>, dir: &JobDir) -> Result<JobHandle> {
        let id = job.id.as_str();
        // A pooled cgroup only where nothing but the agent can have changed
        // it (see `CgroupPool`): no device program, and a job user who
        // cannot write its files.
        let me = geteuid().as_raw();
        let pool = self.shared.pool.as_ref().filter(|_| {
            job.deny_devices.is_empty() && run_as.is_some_and(|r| r.uid != 0 && r.uid != me)
        });
        let (cgroup, slot) = match &self.cgroup {
            Some(support) => {
                let made = match pool {
                    Some(pool) => pool
                        .take(support, id, &job.cpus, job.memory_max)
                        .map(|(path, limits)| (path, Some(limits))),
                    None => support
                        .create_job(id, &job.cpus, job.memory_max, &job.deny_devices)
                        .map(|path| (path, None)),
                };
                match made {
                    Ok((path, slot)) => (Some(path), slot),
                    Err(e) => {
                        tracing::warn!(job = id, error = %e, "running the job without a cgroup");
                        (None, None)
                    }
                }
            }
            None => {
                if job.memory_max.is_some() {
                    tracing::warn!(job = id, "memory_max not enforced: no cgroup");
                }
                if !job.deny_devices.is_empty() {
                    tracing::warn!(
                        job = id,
                        "GPUs not held by the job are not denied to it: no cgroup"
                    );
                }
                (None, None)
            }
        };
        tracing::debug!(target: "lat", job = id, "cgroup made");
        let result = if self.cfg.launcher == Launcher::Supervisor && cgroup.is_some() {
            self.start_supervised(job, run_as, dir, cgroup.clone(), slot)
                .await
        } else {
            self.start_shim(job, run_as, dir, cgroup.clone(), slot)
                .await
        };
        if result.is_err()
            && let Some(cg) = &cgroup
            && let Err(e) = cgroup::remove(cg).await
        {
            tracing::warn!(job = id, error = %e, "could not remove the job's cgroup");
        }
        result
    }

    /// `<shim_exe> shim FLAG DIR` (a job's shim or the supervisor) in its
    /// own session, with an empty environment, stdout piped for its
    /// answer.
    fn shim_command(&self, flag: &str, dir: &Path) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(&self.cfg.shim_exe);
        cmd.arg("shim")
            .arg(flag)
            .arg(dir)
            .env_clear()
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(false);
        // Safety: runs in the forked child before exec and only calls
        // setsid(2), which is async-signal-safe; it allocates nothing (the
        // error path builds an io::Error from an errno, no allocation).
        unsafe {
            cmd.pre_exec(|| nix::unistd::setsid().map(drop).map_err(io::Error::from));
        }
        cmd
    }

    /// The record's first line for `job`: what its shim, or the
    /// supervisor (`supervised`), needs to run it.
    fn shim_spec(
        &self,
        job: &JobExec,
        run_as: Option<RunAs>,
        cgroup: Option<PathBuf>,
        supervised: bool,
    ) -> ShimSpec {
        ShimSpec {
            version: SPEC_VERSION,
            job: job.clone(),
            run_as,
            log_cap_bytes: self.cfg.log_cap_bytes,
            cgroup,
            lease: Some(self.lease().path().to_path_buf()),
            supervised,
        }
    }

    async fn start_shim(
        &self,
        job: &JobExec,
        run_as: Option<RunAs>,
        dir: &JobDir,
        cgroup: Option<PathBuf>,
        slot: Option<Limits>,
    ) -> Result<JobHandle> {
        let id = job.id.clone();
        let spec = self.shim_spec(job, run_as, cgroup.clone(), false);
        dir.create_record(&spec)?;
        let log_path = dir.shim_log();
        let mut cmd = self.shim_command("--job-dir", dir.path());
        let mut child = cmd
            .spawn()
            .map_err(|e| ExecError::io("start the shim", &self.cfg.shim_exe, e))?;
        let shim_pid = child.id().and_then(|p| i32::try_from(p).ok()).unwrap_or(0);
        let Some(stdout) = child.stdout.take() else {
            return Err(ExecError::StartFailed {
                id,
                reason: "no pipe to the shim".into(),
            });
        };
        let mut line = String::new();
        let answer = tokio::time::timeout(
            self.cfg.shim_start_timeout,
            BufReader::new(stdout).read_line(&mut line),
        )
        .await;
        let pid = match answer {
            Ok(Ok(_)) if line.starts_with("ok ") => line[3..].trim().parse::<i32>().ok(),
            Ok(_) => None,
            Err(_elapsed) => {
                // A hung shim: kill it and whatever it may have started.
                let _ = child.start_kill();
                if let Ok(Some(pgid)) = dir.read_record().map(|r| r.pid) {
                    JobProcs {
                        pgid,
                        shim: None,
                        cgroup: cgroup.as_deref(),
                    }
                    .kill_all();
                }
                let _ = tokio::time::timeout(Duration::from_secs(5), child.wait()).await;
                return Err(ExecError::ShimTimeout {
                    id,
                    secs: self.cfg.shim_start_timeout.as_secs_f64(),
                });
            }
        };
        let Some(pid) = pid else {
            let _ = tokio::time::timeout(Duration::from_secs(5), child.wait()).await;
            let reason = match line.strip_prefix("err ") {
                Some(reason) => reason.trim().to_owned(),
                None => {
                    let log = fs::read_to_string(&log_path).unwrap_or_default();
                    format!(
                        "the shim exited without answering: {}",
                        log.trim()
                            .lines()
                            .last()
                            .unwrap_or("(no shim.log: see the agent's log)")
                    )
                }
            };
            return Err(ExecError::StartFailed { id, reason });
        };

        let (exit_tx, exit_rx) = watch::channel(None);
        self.shared.jobs().insert(
            id.clone(),
            Job {
                dir: dir.clone(),
                pid: Some(pid),
                shim_pid: Some(shim_pid),
                cpus: job.cpus.clone(),
                cgroup: cgroup.clone(),
                slot,
                stopped: false,
                cancelling: false,
                exit_tx,
                monitor: None,
                supervised: false,
            },
        );
        self.start_monitor(&id, ShimWatch::Child(child));
        Ok(JobHandle {
            id,
            pid: u32::try_from(pid).unwrap_or(0),
            shim_pid: u32::try_from(shim_pid).unwrap_or(0),
            dir: dir.path().to_owned(),
            cgroup,
            exit: exit_rx,
        })
    }

    /// Start a job through the supervisor: the spec into its `record`,
    /// `start ID` to the supervisor, and its answer. The job is tracked
    /// from the moment the answer is read (by the link's reader, before
    /// the job's `exit` can be read).
    async fn start_supervised(
        &self,
        job: &JobExec,
        run_as: Option<RunAs>,
        dir: &JobDir,
        cgroup: Option<PathBuf>,
        slot: Option<Limits>,
    ) -> Result<JobHandle> {
        let id = job.id.clone();
        let spec = self.shim_spec(job, run_as, cgroup.clone(), true);
        dir.create_record(&spec)?;
        tracing::debug!(target: "lat", job = %id, "record written");
        let (sup_pid, tx, pending) = self.link().await?;
        let (reply_tx, reply_rx) = oneshot::channel();
        lock(&pending).insert(
            id.clone(),
            PendingStart {
                dir: dir.clone(),
                cpus: job.cpus.clone(),
                cgroup: cgroup.clone(),
                slot,
                reply: reply_tx,
            },
        );
        let gone = |id: String| ExecError::StartFailed {
            id,
            reason: "the supervisor went away before answering".into(),
        };
        if tx
            .send(format!(
                "start {id}
"
            ))
            .is_err()
        {
            lock(&pending).remove(&id);
            return Err(gone(id));
        }
        tracing::debug!(target: "lat", job = %id, "start line sent");
        let answer = tokio::time::timeout(self.cfg.shim_start_timeout, reply_rx).await;
        tracing::debug!(target: "lat", job = %id, "start answer taken");
        match answer {
            Ok(Ok(Ok((pid, exit)))) => Ok(JobHandle {
                id,
                pid: u32::try_from(pid).unwrap_or(0),
                shim_pid: u32::try_from(sup_pid).unwrap_or(0),
                dir: dir.path().to_owned(),
                cgroup,
                exit,
            }),
            Ok(Ok(Err(reason))) => Err(ExecError::StartFailed { id, reason }),
            Ok(Err(_)) => Err(gone(id)),
            Err(_elapsed) => {
                lock(&pending).remove(&id);
                Err(ExecError::ShimTimeout {
                    id,
                    secs: self.cfg.shim_start_timeout.as_secs_f64(),
                })
            }
        }
    }

    /// The live connection to the supervisor: the current one, else a
    /// new one to a supervisor that still runs (started by an earlier
    /// executor on this state directory), else to one started now.
    async fn link(&self) -> Result<(i32, LineSender, Pending)> {
        let mut guard = self.link.lock().await;
        if let Some(link) = guard.as_ref()
            && link.alive.load(Ordering::SeqCst)
        {
            return Ok((link.pid, link.tx.clone(), Arc::clone(&link.pending)));
        }
        *guard = None;
        let sock = self.cfg.state_dir.join(supervisor::SOCKET);
        let (pid, stream) = match connect(&sock).await {
            Ok(found) => found,
            Err(_) => {
                self.start_supervisor().await?;
                connect(&sock).await?
            }
        };
        let link = Link::new(Arc::clone(&self.shared), pid, stream);
        let parts = (link.pid, link.tx.clone(), Arc::clone(&link.pending));
        *guard = Some(link);
        Ok(parts)
    }

    /// Start `agent shim --state-dir DIR` in its own session and wait until
    /// its socket is bound.
    async fn start_supervisor(&self) -> Result<()> {
        let mut cmd = self.shim_command("--state-dir", &self.cfg.state_dir);
        let mut child = cmd
            .spawn()
            .map_err(|e| ExecError::io("start the supervisor", &self.cfg.shim_exe, e))?;
        let stdout = child.stdout.take();
        let mut line = String::new();
        let answer = match stdout {
            Some(out) => {
                tokio::time::timeout(
                    self.cfg.shim_start_timeout,
                    BufReader::new(out).read_line(&mut line),
                )
                .await
            }
            None => Ok(Ok(0)),
        };
        // Reap it whenever it exits (it outlives this executor otherwise).
        let ready = matches!(answer, Ok(Ok(_))) && line.trim() == "ready";
        if !ready {
            let _ = child.start_kill();
        }
        tokio::spawn(async move {
            let _ = child.wait().await;
        });
        if ready {
            Ok(())
        } else {
            Err(ExecError::io(
                "start the supervisor on",
                &self.cfg.state_dir,
                io::Error::other(format!(
                    "no 'ready' from it (got {:?}; see supervisor.log)",
                    line.trim()
                )),
            ))
        }
    }

    fn start_monitor(&self, id: &str, shim: ShimWatch) {
        let mut jobs = self.shared.jobs();
        let Some(job) = jobs.get_mut(id) else {
            return;
        };
        let task = monitor(
            Arc::clone(&self.shared),
            id.to_owned(),
            job.dir.clone(),
            job.pid,
            job.cgroup.clone(),
            job.slot.clone(),
            shim,
        );
        job.monitor = Some(tokio::spawn(task));
    }

    fn with_job<T>(&self, id: &str, f: impl FnOnce(&mut Job) -> Result<T>) -> Result<T> {
        let mut jobs = self.shared.jobs();
        let job = jobs
            .get_mut(id)
            .ok_or_else(|| ExecError::UnknownJob(id.to_owned()))?;
        f(job)
    }

    fn signal(&self, id: &str, sig: Signal) -> Result<()> {
        self.with_job(id, |job| {
            if sig == Signal::SIGCONT && job.cancelling {
                job.running_procs(id)?;
                return Ok(());
            }
            let n = job.running_procs(id)?.signal(sig)?;
            if n == 0 {
                return Err(ExecError::NotRunning(id.to_owned()));
            }
            match sig {
                Signal::SIGSTOP => job.stopped = true,
                Signal::SIGCONT => job.stopped = false,
                _ => {}
            }
            Ok(())
        })
    }

    /// The lease file its shims obey ([`super::lease`]).
    pub fn lease(&self) -> super::lease::LeaseFile {
        super::lease::LeaseFile::new(self.cfg.state_dir.join("lease"))
    }

    /// SIGSTOP the whole job (its process group and any escaped process).
    pub fn stop(&self, id: &str) -> Result<()> {
        self.signal(id, Signal::SIGSTOP)
    }

    /// SIGCONT the whole job; nothing for a job being cancelled (see
    /// `Job::cancelling`).
    pub fn cont(&self, id: &str) -> Result<()> {
        self.signal(id, Signal::SIGCONT)
    }

    /// Pin every thread of every process of the job (and its shim) to
    /// `cpus`, and its cgroup's `cpuset.cpus` when it has one. Returns the
    /// number of threads pinned.
    pub fn repin(&self, id: &str, cpus: &[u32]) -> Result<usize> {
        validate_cpus(cpus)?;
        self.with_job(id, |job| {
            if let Some(slot) = job.slot.as_mut() {
                // `cpuset.cpus` may be written even if the pin fails: the
                // next job in this cgroup writes its own.
                slot.cpus = None;
            }
            let n = job.running_procs(id)?.pin(cpus, id)?;
            job.cpus = cpus.to_vec();
            if let Err(e) = job.dir.record_cpus(cpus) {
                tracing::warn!(job = id, error = %e, "re-pinned, but could not record the CPUs");
            }
            Ok(n)
        })
    }

    /// Cancel a job: SIGTERM (and SIGCONT) to the whole job now, SIGKILL
    /// to everything left after `grace`. Returns at once; the exit
    /// ([`JobOutcome::Cancelled`]) arrives on the channel. The shim carries
    /// out the escalation, so it completes even if the agent stops.
    pub fn cancel(&self, id: &str, grace: Duration) -> Result<()> {
        self.with_job(id, |job| {
            job.running_procs(id)?;
            let Some(shim) = job.shim_pid else {
                return Err(ExecError::NotRunning(id.to_owned()));
            };
            let grace_ms = u64::try_from(grace.as_millis()).unwrap_or(u64::MAX);
            write_json(&job.dir.cancel(), &CancelRequest { grace_ms })?;
            job.cancelling = true;
            kill(Pid::from_raw(shim), Signal::SIGUSR1)
                .map_err(|e| ExecError::sys("kill(SIGUSR1)", format!("shim {shim} of job {id}"), e))
        })
    }

    /// A snapshot of one job: tracked, or finished on disk.
    pub fn status(&self, id: &str) -> Result<JobStatus> {
        if let Some(job) = self.shared.jobs().get(id) {
            return Ok(job.status(id));
        }
        validate_id(id).map_err(|_| ExecError::UnknownJob(id.to_owned()))?;
        let dir = JobDir::new(self.jobs_dir.join(id));
        let record = dir.read_record()?;
        let exit: JobExit = record
            .exit
            .ok_or_else(|| ExecError::UnknownJob(id.to_owned()))?;
        let spec = record.spec;
        let to_u32 = |p: Option<i32>| p.and_then(|p| u32::try_from(p).ok());
        Ok(JobStatus {
            id: id.to_owned(),
            dir: dir.path().to_owned(),
            pid: to_u32(record.pid),
            shim_pid: to_u32(record.shim_pid),
            cpus: record
                .cpus
                .or_else(|| spec.as_ref().map(|s| s.job.cpus.clone()))
                .unwrap_or_default(),
            cgroup: spec.and_then(|s| s.cgroup),
            state: JobState::Finished(exit),
        })
    }

    /// Snapshots of every tracked job, sorted by id.
    pub fn list(&self) -> Vec<JobStatus> {
        let mut out: Vec<JobStatus> = self
            .shared
            .jobs()
            .iter()
            .map(|(id, job)| job.status(id))
            .collect();
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out
    }

    /// A handle on a tracked job (for instance a re-adopted one).
    pub fn handle(&self, id: &str) -> Result<JobHandle> {
        self.with_job(id, |job| {
            Ok(JobHandle {
                id: id.to_owned(),
                pid: job.pid.and_then(|p| u32::try_from(p).ok()).unwrap_or(0),
                shim_pid: job
                    .shim_pid
                    .and_then(|p| u32::try_from(p).ok())
                    .unwrap_or(0),
                dir: job.dir.path().to_owned(),
                cgroup: job.cgroup.clone(),
                exit: job.exit_tx.subscribe(),
            })
        })
    }

    /// Mark a finished job's exit as consumed: later `readopt`s skip it.
    /// Its directory stays if it holds logs or a diagnostic; one that
    /// holds only its record becomes a spare for a later job
    /// ([`Spares`]). Stops tracking it.
    pub fn ack(&self, id: &str) -> Result<()> {
        let dir = self.finished_dir(id)?;
        let recycled = self.spares.as_ref().is_some_and(|s| {
            s.recycle(dir.path())
                .inspect_err(|e| tracing::warn!(job = id, error = %e, "job directory not recycled"))
                .unwrap_or(false)
        });
        if !recycled {
            dir.record_acked()?;
            self.kept_queue().push_back((Instant::now(), id.to_owned()));
        }
        self.shared.jobs().remove(id);
        Ok(())
    }

    fn kept_queue(&self) -> MutexGuard<'_, VecDeque<(Instant, String)>> {
        // Every update is a single push or pop.
        self.kept.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Remove the directories (logs included) of acked jobs acked at
    /// least `keep` ago, at most `most` of them, oldest first; the number
    /// removed. A directory already gone is skipped.
    pub fn prune_kept(&self, keep: Duration, most: usize) -> usize {
        let mut removed = 0;
        while removed < most {
            let id = {
                let mut kept = self.kept_queue();
                match kept.front() {
                    Some((at, _)) if at.elapsed() >= keep => kept.pop_front().map(|(_, id)| id),
                    _ => None,
                }
            };
            let Some(id) = id else { break };
            let path = self.jobs_dir.join(&id);
            match fs::remove_dir_all(&path) {
                Ok(()) => removed += 1,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(job = %id, error = %e, "job directory not removed");
                }
            }
        }
        removed
    }

    /// Delete a finished job's directory (logs included) and stop tracking
    /// it; its id can be used again.
    pub fn remove(&self, id: &str) -> Result<()> {
        let dir = self.finished_dir(id)?;
        fs::remove_dir_all(dir.path()).map_err(|e| ExecError::io("remove", dir.path(), e))?;
        self.shared.jobs().remove(id);
        Ok(())
    }

    fn finished_dir(&self, id: &str) -> Result<JobDir> {
        match self.status(id)?.state {
            JobState::Finished(_) => Ok(JobDir::new(self.jobs_dir.join(id))),
            JobState::Running { .. } => Err(ExecError::StillRunning(id.to_owned())),
        }
    }

    /// Scan the state directory for jobs this executor does not track:
    /// re-attach those whose shim still runs, report (on the exit channel)
    /// those that finished while no executor watched and have not been
    /// acked, and clean up after shims that vanished without a status.
    pub async fn readopt(&self) -> Result<ReadoptReport> {
        let mut report = ReadoptReport::default();
        let entries =
            fs::read_dir(&self.jobs_dir).map_err(|e| ExecError::io("list", &self.jobs_dir, e))?;
        let mut names: Vec<String> = entries
            .filter_map(|e| e.ok())
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .filter_map(|e| e.file_name().into_string().ok())
            .collect();
        names.sort();
        for id in names {
            if validate_id(&id).is_err() || self.shared.jobs().contains_key(&id) {
                continue;
            }
            let dir = JobDir::new(self.jobs_dir.join(&id));
            let mut record = match dir.read_record() {
                Ok(r) if r.acked => {
                    // Removed a retention after this start.
                    self.kept_queue().push_back((Instant::now(), id));
                    continue;
                }
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(job = %id, error = %e, "unreadable job record; left alone");
                    report.skipped.push(id);
                    continue;
                }
            };
            let Some(spec) = record.spec.take() else {
                tracing::warn!(job = %id, dir = %dir.path().display(), "no spec in the record: the job never started; left alone");
                report.skipped.push(id);
                continue;
            };
            let shim_pid = record.shim_pid;
            let alive =
                |shim: Option<i32>| shim.is_some_and(|p| procfs::is_shim_for(p, dir.path()));
            // A shim still starting: give it the start timeout to record the job.
            let deadline = tokio::time::Instant::now() + self.cfg.shim_start_timeout;
            while record.pid.is_none()
                && alive(shim_pid)
                && record.exit.is_none()
                && tokio::time::Instant::now() < deadline
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
                record = dir.read_record().unwrap_or(record);
            }
            let pid = record.pid;
            let finished = record.exit.is_some();
            let running = !finished && alive(shim_pid);
            if finished {
                report.exited.push(id.clone());
            } else if running {
                report.reattached.push(id.clone());
            } else {
                report.lost.push(id.clone());
            }
            let stopped = running && pid.is_some_and(procfs::is_stopped);
            let cpus = record.cpus.unwrap_or_else(|| spec.job.cpus.clone());
            // A cancel asked for before the agent restarted.
            let cancelling = dir.cancel().exists();
            let (exit_tx, _) = watch::channel(None);
            self.shared.jobs().insert(
                id.clone(),
                Job {
                    dir,
                    pid,
                    shim_pid,
                    cpus,
                    cgroup: spec.cgroup.clone(),
                    // Its limits are not known: removed at its end.
                    slot: None,
                    stopped,
                    cancelling,
                    exit_tx,
                    monitor: None,
                    supervised: spec.supervised,
                },
            );
            self.start_monitor(
                &id,
                ShimWatch::Adopted(shim_pid, self.cfg.adopt_poll_interval),
            );
        }
        Ok(report)
    }

    /// Shut down as configured: with `KillJobs`, cancel every running job
    /// with `shutdown_grace` and wait for their exits (delivered on the
    /// channel); with `LeaveRunning`, stop watching and leave the shims to
    /// their jobs. Either way no process is orphaned: a job without its
    /// shim is killed. Later spawns fail.
    pub async fn shutdown(&self) -> Result<()> {
        self.shut_down.store(true, Ordering::SeqCst);
        if self.cfg.shutdown == ShutdownMode::KillJobs {
            let running: Vec<String> = self
                .shared
                .jobs()
                .iter()
                .filter(|(_, j)| j.exit().is_none())
                .map(|(id, _)| id.clone())
                .collect();
            let mut waits = Vec::new();
            for id in running {
                match self.cancel(&id, self.cfg.shutdown_grace) {
                    Ok(()) | Err(ExecError::NotRunning(_)) => {}
                    Err(e) => tracing::warn!(job = %id, error = %e, "cancel on shutdown failed"),
                }
                if let Ok(h) = self.handle(&id) {
                    waits.push(h);
                }
            }
            let limit = self.cfg.shutdown_grace + self.cfg.shim_start_timeout;
            for mut h in waits {
                if tokio::time::timeout(limit, h.wait()).await.is_err() {
                    tracing::warn!(
                        job = h.id(),
                        "no exit after the shutdown grace: killing it and its shim"
                    );
                    let procs = JobProcs {
                        pgid: i32::try_from(h.pid()).unwrap_or(0),
                        shim: None,
                        cgroup: h.cgroup(),
                    };
                    if procs.pgid > 0 {
                        procs.kill_all();
                    }
                    let supervised = self.shared.jobs().get(h.id()).is_some_and(|j| j.supervised);
                    if let Ok(shim) = i32::try_from(h.shim_pid())
                        && shim > 0
                        && !supervised
                        && procfs::is_shim_for(shim, h.dir())
                    {
                        let _ = kill(Pid::from_raw(shim), Signal::SIGKILL);
                    }
                }
            }
        }
        self.abort_monitors();
        // Closing the connection lets the supervisor exit once its jobs
        // (none with KillJobs) have ended.
        self.link.lock().await.take();
        if let Some(pool) = &self.shared.pool {
            pool.close();
        }
        if let Some(root) = &self.auto_root {
            // Busy while jobs were left running: the next agent reuses it.
            let _ = fs::remove_dir(root);
        }
        Ok(())
    }

    fn abort_monitors(&self) {
        for job in self.shared.jobs().values_mut() {
            if let Some(task) = job.monitor.take() {
                task.abort();
            }
        }
    }
}

impl Drop for Executor {
    /// Dropping without [`Executor::shutdown`] is an agent crash as far as
    /// jobs are concerned: they keep running under their shims. The free
    /// slots of the cgroup pool (no job's) are removed.
    fn drop(&mut self) {
        self.abort_monitors();
        if let Some(pool) = &self.shared.pool {
            pool.close();
        }
    }
}

/// Watch one shim until it is gone, then collect the job's exit.
async fn monitor(
    shared: Arc<Shared>,
    id: String,
    dir: JobDir,
    pid: Option<i32>,
    cgroup: Option<PathBuf>,
    slot: Option<Limits>,
    shim: ShimWatch,
) {
    let poll = match shim {
        ShimWatch::Child(mut child) => match child.wait().await {
            Ok(_) => None,
            Err(e) => {
                tracing::warn!(job = %id, error = %e, "waiting for the shim; polling instead");
                let pid = child.id().and_then(|p| i32::try_from(p).ok());
                Some((pid, Duration::from_millis(100)))
            }
        },
        ShimWatch::Adopted(shim_pid, every) => Some((shim_pid, every)),
    };
    if let Some((shim_pid, every)) = poll {
        while !dir.read_record().is_ok_and(|r| r.exit.is_some())
            && shim_pid.is_some_and(|p| procfs::is_shim_for(p, dir.path()))
        {
            tokio::time::sleep(every).await;
        }
    }
    finish_job(shared, id, dir, pid, cgroup, slot, None).await;
}

/// The job's processes are gone (or its supervisor is): collect its exit,
/// remove its cgroup, deliver the exit. A pooled cgroup goes back to the
/// pool under the jobs' lock together with the exit: from then on the job
/// is no longer running for `stop`, `repin` or `cancel` (they check under
/// that lock), so none of them can reach the next job in that cgroup; and
/// only the caller that delivers the exit gives it back (a job's end may
/// be seen twice), so it is never pooled twice.
async fn finish_job(
    shared: Arc<Shared>,
    id: String,
    dir: JobDir,
    pid: Option<i32>,
    cgroup: Option<PathBuf>,
    slot: Option<Limits>,
    told: Option<JobExit>,
) {
    if let (Some(cg), Some(limits)) = (&cgroup, slot) {
        if !finish_pooled(&shared, &id, &dir, pid, cg, limits, told) {
            remove_cgroup(&id, cg).await;
        }
        return;
    }
    let exit = exit_of(told, &id, &dir, pid, cgroup.as_deref());
    if let Some(cg) = &cgroup {
        remove_cgroup(&id, cg).await;
    }
    shared.finish(&id, exit);
}

/// [`finish_job`] for a job in a slot of the pool, with no wait: false if
/// the caller must still remove the cgroup (not kept).
fn finish_pooled(
    shared: &Shared,
    id: &str,
    dir: &JobDir,
    pid: Option<i32>,
    cg: &Path,
    limits: Limits,
    told: Option<JobExit>,
) -> bool {
    let exit = exit_of(told, id, dir, pid, Some(cg));
    // Not after a kill through the cgroup (see `CgroupPool`), by whoever.
    let killed = cgroup::take_killed(cg);
    let clean = matches!(
        exit.outcome,
        JobOutcome::Exited(_) | JobOutcome::Signaled(_)
    ) && !exit.cgroup_killed
        && !killed;
    let keep = || {
        clean
            && shared
                .pool
                .as_ref()
                .is_some_and(|pool| pool.keep(cg, limits))
    };
    shared.finish_then(id, exit, keep) != Some(false)
}

async fn remove_cgroup(id: &str, cg: &Path) {
    if let Err(e) = cgroup::remove(cg).await {
        tracing::warn!(job = %id, error = %e, "could not remove the job's cgroup");
    }
}

/// Finish a tracked, running job: at once where nothing is waited for (its
/// cgroup goes back to the pool), else on its own task. `told`: the exit
/// as the supervisor's `exit` line gave it (as it recorded it), else it is
/// read from the record.
fn spawn_finish(shared: &Arc<Shared>, id: &str, told: Option<JobExit>) {
    let info = shared
        .jobs()
        .get(id)
        .filter(|j| j.exit().is_none())
        .map(|j| (j.dir.clone(), j.pid, j.cgroup.clone(), j.slot.clone()));
    if let Some((dir, pid, Some(cg), Some(limits))) = &info {
        if !finish_pooled(shared, id, dir, *pid, cg, limits.clone(), told) {
            let (id, cg) = (id.to_owned(), cg.clone());
            tokio::spawn(async move { remove_cgroup(&id, &cg).await });
        }
        return;
    }
    if let Some((dir, pid, cgroup, slot)) = info {
        tokio::spawn(finish_job(
            Arc::clone(shared),
            id.to_owned(),
            dir,
            pid,
            cgroup,
            slot,
            told,
        ));
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A start waiting for the supervisor's answer: what the job's tracking
/// needs, and where the answer goes (the job's pid and exit watch).
#[derive(Debug)]
struct PendingStart {
    dir: JobDir,
    cpus: Vec<u32>,
    cgroup: Option<PathBuf>,
    slot: Option<Limits>,
    reply: oneshot::Sender<StartAnswer>,
}

/// The supervisor's answer to a start: the job's pid and its exit watch,
/// or why it did not start.
type StartAnswer = std::result::Result<(i32, watch::Receiver<Option<JobExit>>), String>;

/// The two halves of a connection to the supervisor.
type Halves = (
    BufReader<tokio::net::unix::OwnedReadHalf>,
    tokio::net::unix::OwnedWriteHalf,
);

type Pending = Arc<Mutex<HashMap<String, PendingStart>>>;

/// The executor's connection to the supervisor.
#[derive(Debug)]
struct Link {
    pid: i32,
    /// Lines to the supervisor.
    tx: LineSender,
    pending: Pending,
    /// False once the supervisor's side closed.
    alive: Arc<AtomicBool>,
    /// True once this side let go of the link (the executor dropped or
    /// shut down): an end of the connection after that is ours, not the
    /// supervisor's.
    closed: Arc<AtomicBool>,
    reader: JoinHandle<()>,
}

impl Link {
    fn new(shared: Arc<Shared>, pid: i32, stream: Halves) -> Link {
        let (rd, wr) = stream;
        let tx = LineSender::new(wr);
        let pending: Pending = Arc::default();
        let alive = Arc::new(AtomicBool::new(true));
        let closed = Arc::new(AtomicBool::new(false));
        let reader = tokio::spawn(read_link(
            shared,
            rd,
            pid,
            Arc::clone(&pending),
            Arc::clone(&alive),
            Arc::clone(&closed),
        ));
        Link {
            pid,
            tx,
            pending,
            alive,
            closed,
            reader,
        }
    }
}

impl Drop for Link {
    /// The flag first, then the abort, and only then (the fields dropped
    /// after this) the write half's close: an abort cannot stop a reader
    /// that is inside its poll, and a reader thread that loses its CPU
    /// there can come back to the end of the connection this close
    /// causes. It must not take that end for the supervisor's death and
    /// kill the jobs that are meant to outlive this executor.
    fn drop(&mut self) {
        self.closed.store(true, Ordering::SeqCst);
        self.reader.abort();
    }
}

/// Connect to the supervisor's socket and read its `hello PID`.
async fn connect(sock: &Path) -> Result<(i32, Halves)> {
    let stream = UnixStream::connect(sock)
        .await
        .map_err(|e| ExecError::io("connect to the supervisor at", sock, e))?;
    let (rd, wr) = stream.into_split();
    let mut rd = BufReader::new(rd);
    let mut line = String::new();
    let hello = tokio::time::timeout(Duration::from_secs(10), rd.read_line(&mut line)).await;
    let pid = match hello {
        Ok(Ok(_)) => line
            .strip_prefix("hello ")
            .and_then(|p| p.trim().parse::<i32>().ok()),
        _ => None,
    };
    match pid {
        Some(pid) => Ok((pid, (rd, wr))),
        None => Err(ExecError::io(
            "greet the supervisor at",
            sock,
            io::Error::other(format!("no hello (got {:?})", line.trim())),
        )),
    }
}

/// Read the supervisor's lines: answers to starts (the job is tracked
/// from here), exits; when it closes, every job it ran is finished from
/// its `record` (exit there, or lost).
async fn read_link(
    shared: Arc<Shared>,
    rd: BufReader<tokio::net::unix::OwnedReadHalf>,
    sup_pid: i32,
    pending: Pending,
    alive: Arc<AtomicBool>,
    closed: Arc<AtomicBool>,
) {
    let mut lines = rd.lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let mut parts = line.splitn(3, ' ');
        match (parts.next(), parts.next(), parts.next()) {
            (Some("ok"), Some(id), Some(pid)) => {
                tracing::debug!(target: "lat", job = id, "supervisor ok read");
                let Some(p) = lock(&pending).remove(id) else {
                    tracing::warn!(job = id, "the supervisor started a job nobody waits for");
                    continue;
                };
                let Ok(pid) = pid.trim().parse::<i32>() else {
                    let _ = p
                        .reply
                        .send(Err(format!("bad pid {pid:?} from the supervisor")));
                    continue;
                };
                let (exit_tx, exit_rx) = watch::channel(None);
                shared.jobs().insert(
                    id.to_owned(),
                    Job {
                        dir: p.dir,
                        pid: Some(pid),
                        shim_pid: Some(sup_pid),
                        cpus: p.cpus,
                        cgroup: p.cgroup,
                        slot: p.slot,
                        stopped: false,
                        cancelling: false,
                        exit_tx,
                        monitor: None,
                        supervised: true,
                    },
                );
                let _ = p.reply.send(Ok((pid, exit_rx)));
            }
            (Some("err"), Some(id), reason) => {
                if let Some(p) = lock(&pending).remove(id) {
                    let _ = p.reply.send(Err(reason.unwrap_or("").to_owned()));
                }
            }
            // `exit ID JSON` (the exit as recorded: no read of the record
            // per job), or `exit ID` from a supervisor older than that.
            (Some("exit"), Some(id), told) => {
                let told = told.and_then(|json| match serde_json::from_str::<JobExit>(json) {
                    Ok(exit) => Some(exit),
                    Err(e) => {
                        tracing::warn!(job = id, error = %e, "an undecodable exit from the supervisor; reading the record");
                        None
                    }
                });
                spawn_finish(&shared, id, told);
            }
            _ => tracing::warn!(line = %line, "unexpected line from the supervisor"),
        }
    }
    alive.store(false, Ordering::SeqCst);
    if closed.load(Ordering::SeqCst) {
        // This side closed the link: the supervisor goes on with its
        // jobs, for the next executor to readopt.
        return;
    }
    for (_, p) in lock(&pending).drain() {
        let _ = p.reply.send(Err("the supervisor exited".into()));
    }
    let orphans: Vec<String> = shared
        .jobs()
        .iter()
        .filter(|(_, j)| j.supervised && j.shim_pid == Some(sup_pid) && j.exit().is_none())
        .map(|(id, _)| id.clone())
        .collect();
    for id in orphans {
        spawn_finish(&shared, &id, None);
    }
}

/// `told` (the supervisor's copy of what it recorded) for job `id`, else
/// [`collect_exit`].
fn exit_of(
    told: Option<JobExit>,
    id: &str,
    dir: &JobDir,
    pid: Option<i32>,
    cgroup: Option<&Path>,
) -> JobExit {
    match told {
        Some(mut exit) => {
            exit.id = id.to_owned();
            exit
        }
        None => collect_exit(id, dir, pid, cgroup),
    }
}

/// The exit in the job's `record`; or, if the shim vanished without one,
/// kill what is left of the job and record it as lost.
fn collect_exit(id: &str, dir: &JobDir, pid: Option<i32>, cgroup: Option<&Path>) -> JobExit {
    let record = dir.read_record_without_spec();
    let (problem, recorded) = match record {
        Ok(rec) => match rec.exit {
            Some(mut exit) => {
                exit.id = id.to_owned();
                return exit;
            }
            None => (
                "the shim exited without recording an exit (see shim.log)".to_owned(),
                rec.starttime,
            ),
        },
        Err(e) => (format!("unreadable record: {e}"), None),
    };
    tracing::warn!(job = id, problem = %problem, "job lost; killing what is left of it");
    if let Some(cg) = cgroup {
        cgroup::kill_all(cg);
    }
    if let Some(pgid) = pid {
        // The group id can only have been reused if the whole group is
        // gone; a live leader must be the job's own (same start time).
        let ours = match procfs::stat(pgid) {
            Some(leader) => recorded == Some(leader.starttime),
            None => true,
        };
        if ours {
            let _ = killpg(Pid::from_raw(pgid), Signal::SIGKILL);
        }
    }
    let exit = JobExit::bare(id, JobOutcome::Lost(problem));
    if let Err(e) = dir.record_exit(&exit) {
        tracing::warn!(job = id, error = %e, "could not record the lost job");
    }
    exit
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shareable_across_tasks() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<Executor>();
        send_sync::<JobHandle>();
        send_sync::<ExecError>();
    }
}
