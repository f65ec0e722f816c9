//! The agent's supervisor: `agent shim --state-dir DIR`, **one process per
//! state directory** (per agent) that starts and supervises every job with a
//! cgroup, so that such a job costs one process, its own, instead of two
//! (a re-exec of the whole agent binary as its shim, then the job). What
//! the per-job shim ([`super::shim`]) guarantees, the supervisor keeps:
//!
//! - **Jobs outlive the agent, and so do their exit statuses.** The
//!   supervisor runs in its own session (the executor starts it with
//!   `setsid`), the jobs are its children, and it appends each exit to the
//!   job's `record` whether or not an agent is connected; a restarted
//!   agent's [`Executor::readopt`](super::Executor::readopt) finds the
//!   exits there and re-attaches the jobs still running, exactly as with
//!   shims (the `shim PID` line of a supervised job names the supervisor).
//! - **Every process is reaped.** It is a child subreaper
//!   (`PR_SET_CHILD_SUBREAPER`): on SIGCHLD it reaps every child with
//!   `wait4(-1)` and routes the status (and the resource usage) of each
//!   job's main process to that job; orphans re-parented to it are reaped
//!   and forgotten.
//! - **A job never outlives its main process.** A shim knows a job's
//!   escapees (a double fork that called `setsid`) as its own children; a
//!   shared supervisor cannot, so it takes only jobs with a cgroup, which
//!   holds every process of the job: once the main process has exited,
//!   whatever is left in the cgroup is killed (`cgroup.kill`) and the job
//!   ends when its cgroup is empty. Jobs without a cgroup keep a shim each
//!   (the executor chooses, [`super::Launcher`]).
//! - **The same child setup**: the job is forked and exec'd by
//!   [`super::shim::start_job_nowait`] (own session, born in its cgroup by
//!   `clone3(CLONE_INTO_CGROUP)` where the kernel allows, else entering it;
//!   CPUs pinned, rlimits, uid/gid), between clone and exec in this small
//!   single-threaded process. The thread does not wait for the exec: the
//!   child's exec report is read as any other pipe, so the next job starts
//!   while this one's child waits for a CPU or execs, and the `ok` goes out
//!   as soon as the report closes ([`LineSender`] writes a line at once).
//!   The same size-capped logs, timeout, cancel (SIGUSR1 after the
//!   agent wrote the job's `cancel` file: each job checks its own), lease
//!   fencing ([`super::lease`]), and SIGTERM / SIGINT to the supervisor
//!   cancel every job with its grace.
//!
//! The executor talks to it over `<state_dir>/supervisor.sock`, a Unix
//! stream of lines:
//! - to the executor: `hello PID` when it connects; `ok ID PID` or
//!   `err ID REASON` answering a start; `exit ID JSON` once that job's
//!   exit is in its `record`, with the exit as recorded there (so the
//!   executor need not read it back), or `exit ID` alone if recording it
//!   failed (the executor reads the record and finds the job lost);
//! - from the executor: `start ID` (the directory `jobs/ID` holds the
//!   spec, written by the executor).
//!
//! Normally one connection (the executor holding the state directory's
//! lock; the socket is the agent user's alone, mode 0600); lines go to
//! every connection. A job's `start` is refused once its `record` has a
//! `shim` line: a job runs at most once. The supervisor exits when it
//! has neither a job nor a connection; its diagnostics go to
//! `<state_dir>/supervisor.log`.

use std::collections::HashMap;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use nix::errno::Errno;
use nix::libc;
use nix::sys::prctl;
use nix::sys::wait::WaitStatus;
use nix::unistd::{Pid, getpid, getsid, setsid};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::net::UnixListener;
use tokio::net::unix::pipe;
use tokio::signal::unix::{Signal as SignalStream, SignalKind, signal};
use tokio::sync::{Notify, mpsc, oneshot, watch};
use tokio::time::Instant;

use super::cgroup;
use super::error::{ExecError, Result};
use super::group::{JobProcs, cpu_set};
use super::jobdir::{JobDir, RecordFile, read_json};
use super::logcap::CappedLog;
use super::procfs;
use super::shim::{
    PIPE_DRAIN_LIMIT, Started, TermReason, Termination, Usage, diag, exec_failed, exit_record,
    fence, set_diag_log, start_job_nowait, terminate,
};
use super::spec::{CancelRequest, JobExit, JobOutcome, ShimSpec, now_ms, validate_id};

/// The socket's file name in the state directory.
pub(crate) const SOCKET: &str = "supervisor.sock";

/// How long the supervisor waits, idle, for a first connection.
const IDLE_CHECK: Duration = Duration::from_secs(5);

/// Entry point of `agent shim --state-dir DIR`.
pub fn main(state_dir: &Path) -> ExitCode {
    set_diag_log(state_dir.join("supervisor.log"));
    match run(state_dir) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            diag(format_args!(
                "agent supervisor {}: {err}",
                state_dir.display()
            ));
            ExitCode::FAILURE
        }
    }
}

fn run(state_dir: &Path) -> Result<()> {
    let me = getpid();
    if getsid(None).ok() != Some(me) {
        setsid().map_err(|e| ExecError::sys("setsid", "the supervisor", e))?;
    }
    prctl::set_child_subreaper(true)
        .map_err(|e| ExecError::sys("prctl(PR_SET_CHILD_SUBREAPER)", "the supervisor", e))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| ExecError::io("start the tokio runtime in", state_dir, e))?;
    runtime.block_on(serve(state_dir, me.as_raw()))
}

/// How a job's main process ended, from `wait4`.
struct MainExit {
    status: WaitStatus,
    usage: Usage,
}

/// The supervisor's state, shared by its tasks (one thread).
struct Sup {
    jobs_dir: PathBuf,
    me: i32,
    /// Main pid of each running job -> where its status goes.
    waiting: Mutex<HashMap<i32, oneshot::Sender<MainExit>>>,
    /// Jobs started and not yet recorded as ended.
    running: AtomicUsize,
    /// The connections' outgoing lines (normally one: the executor's).
    conns: Mutex<Vec<LineSender>>,
    /// Poked when a job ends or the connection closes.
    idle: Notify,
    /// The state directory's lease file, and the latest deadline any job
    /// read from it ([`super::lease::LeaseFile::sharing`]).
    lease: PathBuf,
    lease_seen: Arc<std::sync::atomic::AtomicU64>,
    /// Bumped on SIGUSR1: jobs look for their `cancel` file.
    cancels: watch::Sender<u64>,
    /// Set on SIGTERM / SIGINT: every job is cancelled.
    terms: watch::Sender<bool>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // One thread, and every update is a single assignment.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Sup {
    /// To every connection: each reader ignores ids it did not ask for.
    fn send(&self, line: String) {
        for out in lock(&self.conns).iter() {
            let _ = out.send(line.clone());
        }
    }

    fn is_idle(&self) -> bool {
        self.running.load(Ordering::SeqCst) == 0 && lock(&self.conns).is_empty()
    }
}

async fn serve(state_dir: &Path, me: i32) -> Result<()> {
    let sig = |kind: SignalKind, name: &'static str| {
        signal(kind).map_err(|e| ExecError::io("install a handler for", name, e))
    };
    // Handlers first: no SIGCHLD or cancel may be missed.
    let sigchld = sig(SignalKind::child(), "SIGCHLD")?;
    let sigusr1 = sig(SignalKind::user_defined1(), "SIGUSR1")?;
    let sigterm = sig(SignalKind::terminate(), "SIGTERM")?;
    let sigint = sig(SignalKind::interrupt(), "SIGINT")?;
    let sighup = sig(SignalKind::hangup(), "SIGHUP")?;

    let sock = state_dir.join(SOCKET);
    // Only an executor holding the state directory's lock starts a
    // supervisor, after it found no live one on the socket: a file there
    // is a dead supervisor's.
    match std::fs::remove_file(&sock) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            return Err(ExecError::io("remove the stale socket", &sock, e));
        }
        _ => {}
    }
    let listener = UnixListener::bind(&sock).map_err(|e| ExecError::io("bind", &sock, e))?;
    // Only the agent's user may ask for starts.
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| ExecError::io("chmod 0600", &sock, e))?;
    }
    let sup = Arc::new(Sup {
        jobs_dir: state_dir.join("jobs"),
        lease: state_dir.join("lease"),
        lease_seen: Arc::default(),
        me,
        waiting: Mutex::new(HashMap::new()),
        running: AtomicUsize::new(0),
        conns: Mutex::new(Vec::new()),
        idle: Notify::new(),
        cancels: watch::Sender::new(0),
        terms: watch::Sender::new(false),
    });
    tokio::spawn(reaper(Arc::clone(&sup), sigchld));
    tokio::spawn(signals(Arc::clone(&sup), sigusr1, sigterm, sigint, sighup));
    ready();

    let mut check = tokio::time::interval_at(Instant::now() + IDLE_CHECK, IDLE_CHECK);
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let (rd, wr) = stream.into_split();
                    let out = LineSender::new(wr);
                    let _ = out.send(format!("hello {}\n", sup.me));
                    // Added here, not in the task: the idle check never
                    // misses an accepted connection.
                    lock(&sup.conns).push(out.clone());
                    tokio::spawn(connection(Arc::clone(&sup), rd, out));
                }
                Err(e) => {
                    diag(format_args!("accept on {}: {e}", sock.display()));
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            () = sup.idle.notified() => if sup.is_idle() {
                return Ok(());
            },
            _ = check.tick() => if sup.is_idle() {
                return Ok(());
            },
        }
    }
}

/// Tell the executor that the socket is bound (`ready` on stdout, the only
/// line ever written there), then point stdout at /dev/null.
fn ready() {
    let mut out = io::stdout().lock();
    let _ = writeln!(out, "ready").and_then(|()| out.flush());
    drop(out);
    match std::fs::File::options().write(true).open("/dev/null") {
        Ok(null) => {
            if let Err(e) = nix::unistd::dup2_stdout(&null) {
                diag(format_args!("dup2 /dev/null onto stdout: {e}"));
            }
        }
        Err(e) => diag(format_args!("open /dev/null: {e}")),
    }
}

/// Reap every child on each SIGCHLD.
async fn reaper(sup: Arc<Sup>, mut sigchld: SignalStream) {
    loop {
        reap(&sup);
        if sigchld.recv().await.is_none() {
            return;
        }
    }
}

/// `wait4(-1, WNOHANG)` until nothing is left to reap; a job's main process
/// goes to its job, anything else (an orphan re-parented here) is dropped.
fn reap(sup: &Sup) {
    loop {
        let mut status: libc::c_int = 0;
        let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
        // Safety: wait4 writes into the two out-parameters, both valid for
        // the call; a zeroed rusage is a valid value whatever it writes.
        let pid = unsafe { libc::wait4(-1, &mut status, libc::WNOHANG, usage.as_mut_ptr()) };
        if pid == 0 {
            return;
        }
        if pid < 0 {
            match Errno::last() {
                Errno::EINTR => continue,
                Errno::ECHILD => return,
                e => {
                    diag(format_args!("wait4: {e}"));
                    return;
                }
            }
        }
        // Safety: zero-initialised, then possibly filled in by wait4.
        let usage = unsafe { usage.assume_init() };
        let Some(tx) = lock(&sup.waiting).remove(&pid) else {
            continue;
        };
        let Ok(status) = WaitStatus::from_raw(Pid::from_raw(pid), status) else {
            diag(format_args!("wait4: undecodable status {status} of {pid}"));
            continue;
        };
        let ms = |t: libc::timeval| u64::try_from(t.tv_sec * 1000 + t.tv_usec / 1000).unwrap_or(0);
        let _ = tx.send(MainExit {
            status,
            usage: (
                ms(usage.ru_utime),
                ms(usage.ru_stime),
                u64::try_from(usage.ru_maxrss).unwrap_or(0),
            ),
        });
    }
}

async fn signals(
    sup: Arc<Sup>,
    mut usr1: SignalStream,
    mut term: SignalStream,
    mut int: SignalStream,
    mut hup: SignalStream,
) {
    loop {
        tokio::select! {
            _ = usr1.recv() => sup.cancels.send_modify(|g| *g += 1),
            _ = term.recv() => {
                diag("SIGTERM: cancelling every job");
                sup.terms.send_replace(true);
            }
            _ = int.recv() => {
                diag("SIGINT: cancelling every job");
                sup.terms.send_replace(true);
            }
            _ = hup.recv() => {}
        }
    }
}

/// One executor's connection: its `start` lines in, our lines out.
async fn connection(sup: Arc<Sup>, rd: tokio::net::unix::OwnedReadHalf, out: LineSender) {
    let mut lines = BufReader::new(rd).lines();
    loop {
        match lines.next_line().await {
            Ok(Some(line)) => match line.split_once(' ') {
                Some(("start", id)) => {
                    sup.running.fetch_add(1, Ordering::SeqCst);
                    tokio::spawn(job(Arc::clone(&sup), id.trim().to_owned()));
                }
                _ => diag(format_args!("unknown request from the executor: {line:?}")),
            },
            Ok(None) => break,
            Err(e) => {
                diag(format_args!("reading from the executor: {e}"));
                break;
            }
        }
    }
    lock(&sup.conns).retain(|c| !c.same(&out));
    sup.idle.notify_one();
}

/// A started job.
struct Launched {
    jd: JobDir,
    rec: RecordFile,
    spec: ShimSpec,
    pid: i32,
    main: oneshot::Receiver<MainExit>,
    out: tokio::task::JoinHandle<()>,
    err: tokio::task::JoinHandle<()>,
    out_stats: Arc<super::logcap::LogStats>,
    err_stats: Arc<super::logcap::LogStats>,
    started_at_ms: u64,
}

/// Start one job, answer the executor, supervise the job to its end.
async fn job(sup: Arc<Sup>, id: String) {
    let launched = match launch(&sup, &id) {
        Ok(cloned) => confirm(&sup, &id, cloned).await,
        Err(e) => Err(e),
    };
    match launched {
        Ok(l) => {
            sup.send(format!("ok {id} {}\n", l.pid));
            match supervise(&sup, l).await {
                Ok(json) => sup.send(format!("exit {id} {json}\n")),
                Err(e) => {
                    diag(format_args!("job {id}: {e}"));
                    sup.send(format!("exit {id}\n"));
                }
            }
        }
        Err(e) => {
            let reason = match e {
                ExecError::StartFailed { reason, .. } => reason,
                other => other.to_string(),
            };
            sup.send(format!("err {id} {}\n", reason.replace('\n', " ")));
        }
    }
    sup.running.fetch_sub(1, Ordering::SeqCst);
    sup.idle.notify_one();
}

/// A job cloned (and its pid registered with the reaper) whose exec may
/// not have happened yet.
struct Cloned {
    jd: JobDir,
    rec: RecordFile,
    spec: ShimSpec,
    started: Started,
    main: oneshot::Receiver<MainExit>,
    out_log: CappedLog,
    err_log: CappedLog,
    started_at_ms: u64,
}

/// Everything up to the job's process cloned, its pid known to the
/// reaper. No await between the clone and the registration of its pid:
/// the reaper runs on this same thread, so it cannot reap the job before
/// it is known. The exec is awaited by [`confirm`], so that the next
/// job's start does not wait for this one's exec (the child may wait for
/// a CPU before it gets there).
fn launch(sup: &Sup, id: &str) -> Result<Cloned> {
    validate_id(id)?;
    let jd = JobDir::new(sup.jobs_dir.join(id));
    // One open for the whole job: the spec read, then each line appended.
    let mut rec = jd.open_record()?;
    let record = rec.read()?;
    if record.shim_pid.is_some() {
        // Started once already: a job runs at most once.
        return Err(ExecError::StartFailed {
            id: id.to_owned(),
            reason: "it was started before".into(),
        });
    }
    let spec = record.spec.ok_or_else(|| {
        ExecError::io(
            "read",
            jd.record(),
            io::Error::new(io::ErrorKind::NotFound, "no spec line"),
        )
    })?;
    if !spec.supervised || spec.job.id != id {
        return Err(ExecError::StartFailed {
            id: id.to_owned(),
            reason: "its spec is not one for the supervisor".into(),
        });
    }
    rec.record_shim(sup.me)?;
    let started_at_ms = now_ms();
    let out_log = CappedLog::lazy(
        &jd.stdout(),
        spec.log_cap_bytes,
        jd.truncated_marker("stdout"),
    );
    let err_log = CappedLog::lazy(
        &jd.stderr(),
        spec.log_cap_bytes,
        jd.truncated_marker("stderr"),
    );
    let started = cpu_set(&spec.job.cpus).and_then(|set| start_job_nowait(&spec, Some(set), true));
    let started = match started {
        Ok(s) => s,
        Err(e) => return Err(start_failed(&rec, id, e)),
    };
    let (tx, main) = oneshot::channel();
    lock(&sup.waiting).insert(started.pid, tx);
    Ok(Cloned {
        jd,
        rec,
        spec,
        started,
        main,
        out_log,
        err_log,
        started_at_ms,
    })
}

/// A start that failed: its exit in the record (if no executor is
/// listening any more, readopt() reports it from there), and the error.
fn start_failed(rec: &RecordFile, id: &str, e: ExecError) -> ExecError {
    let reason = match &e {
        ExecError::StartFailed { reason, .. } => reason.clone(),
        other => other.to_string(),
    };
    match rec.record_exit(&JobExit::bare(id, JobOutcome::StartFailed(reason))) {
        Ok(_) => e,
        Err(write) => write,
    }
}

/// Wait (without blocking the thread) for the cloned job's exec, then
/// record it and watch its pipes: the job runs.
async fn confirm(sup: &Sup, id: &str, c: Cloned) -> Result<Launched> {
    let Cloned {
        jd,
        rec,
        spec,
        mut started,
        main,
        out_log,
        err_log,
        started_at_ms,
    } = c;
    let pid = started.pid;
    if let Some(report) = started.exec_report.take() {
        let mut bytes = Vec::new();
        let read = match receiver(report) {
            Ok(mut rx) => rx.read_to_end(&mut bytes).await.map(drop),
            Err(e) => Err(e),
        };
        if read.is_ok()
            && let Some(hold) = started.exec_hold.take()
        {
            hold.release();
        }
        let failed = match read {
            Ok(()) => exec_failed(&spec.job, &bytes),
            Err(e) => Some(ExecError::io("read the exec report of", jd.path(), e)),
        };
        if let Some(e) = failed {
            // The child has exited (or is killed here, its report unread):
            // the reaper reaps it and finds nobody waiting.
            if read_failed(&e) {
                JobProcs {
                    pgid: pid,
                    shim: None,
                    cgroup: spec.cgroup.as_deref(),
                }
                .kill_all();
            }
            lock(&sup.waiting).remove(&pid);
            return Err(start_failed(&rec, id, e));
        }
    }
    let (out_stats, err_stats) = (out_log.stats(), err_log.stats());
    let starttime = procfs::stat(pid).map_or(0, |st| st.starttime);
    let pumps = rec.record_job(pid, starttime).and_then(|()| {
        let pump = |fd, log: CappedLog| -> Result<_> {
            let rx = receiver(fd)
                .map_err(|e| ExecError::io("watch the output pipe of", jd.path(), e))?;
            Ok(tokio::spawn(log.pump(rx)))
        };
        Ok((
            pump(started.stdout, out_log)?,
            pump(started.stderr, err_log)?,
        ))
    });
    match pumps {
        Ok((out, err)) => Ok(Launched {
            jd,
            rec,
            spec,
            pid,
            main,
            out,
            err,
            out_stats,
            err_stats,
            started_at_ms,
        }),
        Err(e) => {
            // Unsupervised, the job must not run: its cgroup holds all of it.
            JobProcs {
                pgid: pid,
                shim: None,
                cgroup: spec.cgroup.as_deref(),
            }
            .kill_all();
            lock(&sup.waiting).remove(&pid);
            let reason = e.to_string();
            let _ = rec.record_exit(&JobExit::bare(id, JobOutcome::StartFailed(reason)));
            Err(e)
        }
    }
}

/// A tokio receiver on a pipe's read end from [`start_job_nowait`]: made
/// non-blocking with one `fcntl` (its only status flag is the access
/// mode, which `F_SETFL` leaves alone) instead of tokio's checked
/// conversion, which first asks `fstat` whether it is a pipe and
/// `F_GETFL` for its flags: three pipes per job, six system calls.
fn receiver(fd: std::os::fd::OwnedFd) -> io::Result<pipe::Receiver> {
    use nix::fcntl::{F_SETFL, OFlag, fcntl};
    fcntl(&fd, F_SETFL(OFlag::O_NONBLOCK)).map_err(io::Error::from)?;
    pipe::Receiver::from_owned_fd_unchecked(fd)
}

/// Whether a start failed because its exec report could not be read
/// (rather than because the child reported a failed step).
fn read_failed(e: &ExecError) -> bool {
    !matches!(e, ExecError::StartFailed { .. })
}

/// The shim's supervision loop for one job of many: the main process's
/// status comes from the reaper, and the job has ended when its cgroup is
/// empty.
async fn supervise(sup: &Sup, mut l: Launched) -> Result<String> {
    let job = &l.spec.job;
    let cg = l.spec.cgroup.clone();
    let procs = JobProcs {
        pgid: l.pid,
        shim: None,
        cgroup: cg.as_deref(),
    };
    let empty = || cg.as_deref().is_none_or(cgroup::is_empty);
    let timeout_at = job.timeout.map(|t| Instant::now() + t);
    let far = Instant::now() + Duration::from_secs(100 * 365 * 24 * 3600);
    let mut term: Option<Termination> = None;
    let mut main: Option<MainExit> = None;
    let mut main_lost = false;
    // Not at once: the loop's first turn has just looked at everything
    // the tick would (an immediate first tick made every job turn twice).
    let mut tick = tokio::time::interval_at(
        Instant::now() + Duration::from_millis(500),
        Duration::from_millis(500),
    );
    let lease = l.spec.job_lease().map(|f| {
        if f.path() == sup.lease {
            f.sharing(Arc::clone(&sup.lease_seen))
        } else {
            f
        }
    });
    let mut fenced_on: Option<u64> = None;
    let mut cancels = sup.cancels.subscribe();
    cancels.borrow_and_update();
    let mut terms = sup.terms.subscribe();
    let cancelled = |term: &mut Option<Termination>, grace| {
        terminate(&procs, term, TermReason::Cancelled, grace)
    };
    if *terms.borrow_and_update() {
        cancelled(&mut term, job.kill_grace);
    }

    loop {
        let ended = main.is_some() || main_lost;
        if ended {
            if empty() {
                break;
            }
            // The main process is gone: nothing of the job may outlive it.
            procs.kill_all();
        }
        let running = !ended;
        let kill_at = term.filter(|t| !t.killed).map(|t| t.kill_at);
        let lease_left = match &lease {
            Some(lease) if running && term.is_none() => {
                fence(lease, &procs, &mut fenced_on, &l.jd.cancel())
            }
            _ => None,
        };
        tokio::select! {
            m = &mut l.main, if running => match m {
                Ok(m) => main = Some(m),
                Err(_) => main_lost = true,
            },
            _ = tokio::time::sleep(Duration::from_millis(20)), if !running => {}
            _ = tokio::time::sleep(lease_left.unwrap_or_default()), if lease_left.is_some() => {}
            _ = tick.tick() => {}
            r = cancels.changed(), if running => if r.is_ok() {
                cancels.borrow_and_update();
                if let Ok(Some(c)) = read_json::<CancelRequest>(&l.jd.cancel()) {
                    cancelled(&mut term, Duration::from_millis(c.grace_ms));
                }
            },
            r = terms.changed(), if running => if r.is_ok() && *terms.borrow_and_update() {
                cancelled(&mut term, job.kill_grace);
            },
            _ = tokio::time::sleep_until(timeout_at.unwrap_or(far)),
                if running && term.is_none() && timeout_at.is_some() => {
                terminate(&procs, &mut term, TermReason::TimedOut, job.kill_grace);
            }
            _ = tokio::time::sleep_until(kill_at.unwrap_or(far)), if kill_at.is_some() => {
                procs.kill_all();
                if let Some(t) = term.as_mut() {
                    t.killed = true;
                }
            }
        }
    }
    let drain = async {
        let _ = (&mut l.out).await;
        let _ = (&mut l.err).await;
    };
    if tokio::time::timeout(PIPE_DRAIN_LIMIT, drain).await.is_err() {
        diag(format_args!(
            "job {}: output pipes still open after every process exited; stopped reading",
            job.id
        ));
        l.out.abort();
        l.err.abort();
    }
    let usage = main.as_ref().map_or((0, 0, 0), |m| m.usage);
    let mut exit = exit_record(
        job.id.clone(),
        main.map(|m| m.status),
        term.map(|t| t.outcome),
        l.started_at_ms,
        &l.out_stats,
        &l.err_stats,
        usage,
    );
    exit.cgroup_killed = cg.as_deref().is_some_and(cgroup::take_killed);
    l.rec.record_exit(&exit)
}

/// Lines to one side of the supervisor's socket. Both ends use it: the
/// supervisor to each connection, the executor to its supervisor. A line
/// is written at once when the socket takes it, with no hop through a
/// task (on the supervisor's one thread a writer task would run only
/// after every other task ready by then, e.g. the next jobs' starts);
/// what the socket does not take is queued, in order, for a writer task,
/// and later lines join the queue until it is written.
#[derive(Clone, Debug)]
pub(super) struct LineSender {
    inner: Arc<LineInner>,
    tx: mpsc::UnboundedSender<Vec<u8>>,
}

#[derive(Debug)]
struct LineInner {
    wr: tokio::net::unix::OwnedWriteHalf,
    /// True while lines wait in the queue or the writer is writing them:
    /// a new line must go behind them.
    queued: Mutex<bool>,
}

impl LineSender {
    /// A sender on `wr` and its writer task; the write half is closed once
    /// every clone of the sender is dropped and the queue is written.
    pub(super) fn new(wr: tokio::net::unix::OwnedWriteHalf) -> Self {
        let inner = Arc::new(LineInner {
            wr,
            queued: Mutex::new(false),
        });
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(write_queued(Arc::clone(&inner), rx));
        Self { inner, tx }
    }

    /// Send `line` (newline included); an error once the socket is broken
    /// or the writer gone.
    pub(super) fn send(&self, line: String) -> std::result::Result<(), ()> {
        let mut queued = lock(&self.inner.queued);
        let mut bytes = line.into_bytes();
        if !*queued {
            match self.inner.wr.try_write(&bytes) {
                Ok(n) if n == bytes.len() => return Ok(()),
                Ok(n) => {
                    bytes.drain(..n);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(_) => return Err(()),
            }
            *queued = true;
        }
        self.tx.send(bytes).map_err(drop)
    }

    /// Whether both are senders on the same connection.
    pub(super) fn same(&self, other: &LineSender) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

/// Write what [`LineSender::send`] queued, those queued meanwhile in one
/// write, until every sender is gone or the socket breaks.
async fn write_queued(inner: Arc<LineInner>, mut rx: mpsc::UnboundedReceiver<Vec<u8>>) {
    while let Some(mut buf) = rx.recv().await {
        while let Ok(more) = rx.try_recv() {
            buf.extend_from_slice(&more);
        }
        let mut done = 0;
        while done < buf.len() {
            if inner.wr.writable().await.is_err() {
                return;
            }
            match inner.wr.try_write(&buf[done..]) {
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(_) => return,
            }
        }
        // Senders queue only while holding this lock: with the queue empty
        // under it, the next line may be written directly again.
        let mut queued = lock(&inner.queued);
        if rx.is_empty() {
            *queued = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lines written directly and lines queued behind a full socket come
    /// out complete and in order, and the write half closes once the
    /// senders are gone.
    #[tokio::test(flavor = "current_thread")]
    async fn lines_keep_their_order_through_a_full_socket() {
        let (a, b) = tokio::net::UnixStream::pair().unwrap();
        let (_rd, wr) = a.into_split();
        let out = LineSender::new(wr);
        let copy = out.clone();
        // Far more than a socket buffer holds: most of them queue.
        let n = 50_000;
        for i in 0..n {
            let s = if i % 2 == 0 { &out } else { &copy };
            s.send(format!("line {i} {}\n", "x".repeat(i % 97)))
                .unwrap();
        }
        assert!(*lock(&out.inner.queued), "the socket filled up");
        assert!(out.same(&copy));
        drop((out, copy));
        let mut lines = BufReader::new(b).lines();
        for i in 0..n {
            let line = lines.next_line().await.unwrap().unwrap();
            assert_eq!(line, format!("line {i} {}", "x".repeat(i % 97)));
        }
        assert!(lines.next_line().await.unwrap().is_none(), "closed");
    }
}
