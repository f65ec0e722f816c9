//! The job shim: `agent shim --job-dir DIR`, one process per job, started by
//! the executor and independent of it afterwards (containerd-shim style),
//! so jobs survive an agent restart and their exit status is never lost.
//!
//! Why a re-exec of the agent binary rather than a bare fork: the agent is
//! a multi-threaded tokio process, and a forked child of such a process may
//! only make async-signal-safe calls until it execs; the shim must allocate,
//! parse JSON, run timers and loop on `waitpid` for as long as the job
//! lives. A fresh image has none of the parent's locks, threads or file
//! descriptors (everything the agent opens is close-on-exec), shows up in
//! `ps` as `agent shim --job-dir ...`, which is also how a restarted agent
//! recognises it, and keeps running the old binary's inode across upgrades.
//!
//! What the shim does, in order:
//! 1. reads the `spec` line of `record`; becomes a session leader (`setsid`, the executor
//!    also does it between fork and exec) and a child subreaper
//!    (`PR_SET_CHILD_SUBREAPER`), appends `shim PID` to the job's `record`
//!    (see `jobdir.rs`), pins itself to the
//!    job's CPUs (`sched_setaffinity`; the job inherits the mask);
//! 2. forks the job; between fork and exec the child calls `setsid` (its
//!    own session and process group, pgid = its pid), enters its cgroup,
//!    applies the rlimits, and when configured drops to the unprivileged
//!    uid/gid (`setgroups`, `setgid`, `setuid`, in that order) before
//!    exec'ing the command with a clean environment, cwd, stdin from
//!    `/dev/null` and stdout/stderr into pipes read by the shim;
//! 3. appends `job PID STARTTIME` to `record`, then answers the executor on its stdout (`ok <pid>` or
//!    `err <reason>`; the only thing it ever writes there) and points its
//!    stdout at `/dev/null`;
//! 4. copies the pipes into `stdout`/`stderr` (created on the first byte)
//!    under the size cap, reaps
//!    every child (`waitpid(-1)` on SIGCHLD, so double-forked grandchildren
//!    re-parented to it are reaped too), enforces the timeout, and obeys
//!    cancel requests (SIGUSR1 after the agent wrote `cancel`; SIGTERM or
//!    SIGINT to the shim itself count as a cancel with the job's grace):
//!    SIGTERM + SIGCONT to the job (a stopped job must run to see the
//!    TERM), SIGKILL to everything after the grace;
//!    While the job runs it also obeys the agent's lease
//!    ([`super::lease`]): once the deadline in the lease file has passed
//!    it SIGSTOPs the job (once per deadline; the agent continues it when
//!    a renewal comes), so a node whose agent stalls fences its jobs;
//! 5. when the job's main process has exited, SIGKILLs whatever is left of
//!    the job and reaps until `ECHILD`: a job never outlives its main
//!    process, so nothing is orphaned;
//! 6. appends `exit {JSON}` to `record` (outcome, exit code or signal,
//!    times, truncation flags, CPU time from `getrusage(RUSAGE_CHILDREN)`)
//!    and exits.
//!
//! Its diagnostics go to `shim.log` in the job directory, created on the
//! first one ([`diag`]); anything else on its stderr (a panic) goes where
//! the agent's stderr goes.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sched::{CpuSet, sched_setaffinity};
use nix::sys::prctl;
use nix::sys::resource::{Resource, UsageWho, getrusage};
use nix::sys::signal::Signal;
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::{Gid, Pid, Uid, getpid, getsid, setgid, setgroups, setsid, setuid};
use tokio::net::unix::pipe;
use tokio::signal::unix::{SignalKind, signal};
use tokio::time::Instant;

use super::cgroup;
use super::clone3::{self, ExecImage, SpawnError};
use super::error::{ExecError, Result};
use super::group::{JobProcs, cpu_set};
use super::jobdir::{JobDir, read_json};
use super::lease::LeaseFile;
use super::logcap::{CappedLog, LogStats};
use super::procfs;
use super::spec::{CancelRequest, DEFAULT_PATH, JobExec, JobExit, JobOutcome, ShimSpec, now_ms};
use super::vmclone;

/// How long the shim waits for the job's pipes to reach EOF after every
/// process of the job has been reaped (only a process outside the job that
/// was handed the pipe could hold them open).
pub(crate) const PIPE_DRAIN_LIMIT: Duration = Duration::from_secs(5);

/// Where [`diag`] writes: the job directory's `shim.log`.
static DIAG_LOG: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();

/// Send [`diag`]'s lines to `path` (first call wins).
pub(crate) fn set_diag_log(path: std::path::PathBuf) {
    let _ = DIAG_LOG.set(path);
}

/// Append one diagnostic line to `shim.log` (created by the first one);
/// to stderr when there is no job directory or it cannot be written.
pub(crate) fn diag(msg: impl std::fmt::Display) {
    let line = format!("{msg}\n");
    let written = DIAG_LOG.get().is_some_and(|path| {
        File::options()
            .create(true)
            .append(true)
            .open(path)
            .and_then(|mut f| f.write_all(line.as_bytes()))
            .is_ok()
    });
    if !written {
        eprint!("{line}");
    }
}

/// Entry point of `agent shim --job-dir DIR`.
pub fn main(job_dir: &Path) -> ExitCode {
    let _ = DIAG_LOG.set(JobDir::new(job_dir).shim_log());
    let mut handshake = Handshake { done: false };
    match run(job_dir, &mut handshake) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            diag(format_args!("agent shim {}: {err}", job_dir.display()));
            handshake.fail(&start_failure(&err));
            ExitCode::FAILURE
        }
    }
}

/// Why the job did not start, without the job-id prefix the executor adds.
fn start_failure(err: &ExecError) -> String {
    match err {
        ExecError::StartFailed { reason, .. } => reason.clone(),
        other => other.to_string(),
    }
}

/// The one-line answer to the executor on the shim's stdout.
struct Handshake {
    done: bool,
}

impl Handshake {
    fn ok(&mut self, pid: i32) {
        self.done = true;
        let mut out = io::stdout().lock();
        // The executor may have given up waiting (and closed its end): that
        // is its business, the job runs on.
        let _ = writeln!(out, "ok {pid}").and_then(|()| out.flush());
        drop(out);
        // Nothing else may go to the executor's pipe: point stdout at
        // /dev/null. (Rust ignores SIGPIPE, so a closed pipe would only
        // give write errors; this keeps them away too.)
        match File::options().write(true).open("/dev/null") {
            Ok(null) => {
                if let Err(e) = nix::unistd::dup2_stdout(&null) {
                    diag(format_args!("dup2 /dev/null onto stdout: {e}"));
                }
            }
            Err(e) => diag(format_args!("open /dev/null: {e}")),
        }
    }

    fn fail(&mut self, reason: &str) {
        if !self.done {
            self.done = true;
            let mut out = io::stdout().lock();
            let _ = writeln!(out, "err {}", reason.replace('\n', " "));
            let _ = out.flush();
        }
    }
}

fn run(dir: &Path, handshake: &mut Handshake) -> Result<()> {
    let jd = JobDir::new(dir);
    let spec: ShimSpec = jd.read_record()?.spec.ok_or_else(|| {
        ExecError::io(
            "read",
            jd.record(),
            io::Error::new(io::ErrorKind::NotFound, "no spec line"),
        )
    })?;
    let me = getpid();
    if getsid(None).ok() != Some(me) {
        setsid().map_err(|e| ExecError::sys("setsid", "the shim", e))?;
    }
    prctl::set_child_subreaper(true)
        .map_err(|e| ExecError::sys("prctl(PR_SET_CHILD_SUBREAPER)", "the shim", e))?;
    jd.record_shim(me.as_raw())?;
    let set = cpu_set(&spec.job.cpus)?;
    sched_setaffinity(Pid::from_raw(0), &set)
        .map_err(|e| ExecError::sys("sched_setaffinity", "the shim", e))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| ExecError::io("start the tokio runtime in", dir, e))?;
    runtime.block_on(supervise(&jd, &spec, handshake))
}

/// A started job: its pid and the pipes of its output.
pub(crate) struct Started {
    pub pid: i32,
    pub stdout: OwnedFd,
    pub stderr: OwnedFd,
    /// From [`start_job_nowait`]: `Some` while the exec is not known to
    /// have happened; this pipe, read to its end, says whether it did
    /// ([`exec_failed`]).
    pub exec_report: Option<OwnedFd>,
    /// The memory a child cloned with `CLONE_VM` may use until its exec:
    /// released once `exec_report` has been read to its end, leaked if
    /// dropped before ([`vmclone::Hold`]).
    pub exec_hold: Option<vmclone::Hold>,
}

/// Fork and exec the job, and wait for the exec: [`start_job_nowait`],
/// then its exec report read here (a failed exec is reaped and returned as
/// the error).
pub(crate) fn start_job(
    spec: &ShimSpec,
    pin: Option<CpuSet>,
    need_cgroup: bool,
) -> Result<Started> {
    let mut started = start_job_nowait(spec, pin, need_cgroup)?;
    let Some(report) = started.exec_report.take() else {
        return Ok(started);
    };
    let mut bytes = Vec::new();
    let read = File::from(report).read_to_end(&mut bytes);
    if read.is_ok()
        && let Some(hold) = started.exec_hold.take()
    {
        hold.release();
    }
    match exec_failed(&spec.job, &bytes) {
        None => Ok(started),
        Some(e) => {
            let _ = nix::sys::wait::waitpid(Pid::from_raw(started.pid), None);
            Err(e)
        }
    }
}

/// The start failure that a child's exec report (its
/// [`Started::exec_report`] read to the end) tells of, if any; the child
/// has then exited and is the caller's to reap.
pub(crate) fn exec_failed(job: &JobExec, report: &[u8]) -> Option<ExecError> {
    match clone3::exec_report(report) {
        Ok(()) => None,
        Err(SpawnError::Failed { step, errno }) => Some(step_failed(job, step, errno)),
        Err(other) => Some(ExecError::StartFailed {
            id: job.id.clone(),
            reason: format!("{other:?}"),
        }),
    }
}

fn step_failed(job: &JobExec, step: String, errno: Errno) -> ExecError {
    let step = if step.is_empty() {
        format!("exec {}", job.command)
    } else {
        step
    };
    let e = io::Error::from_raw_os_error(errno as i32);
    ExecError::StartFailed {
        id: job.id.clone(),
        reason: format!("{step}: {e}"),
    }
}

/// Fork and exec the job. Everything the child needs is prepared here, so
/// that between fork and exec it only makes system calls. `pin`: CPUs the
/// child pins itself to (the shim pins itself instead, and the job
/// inherits its mask). `need_cgroup`: a job whose cgroup cannot be
/// entered does not start (the supervisor tells jobs apart by their
/// cgroups); otherwise it runs outside it, with a diagnostic. A job born
/// in its cgroup by `clone3` is returned at once, with its
/// [`Started::exec_report`] to read; the other ways wait for the exec.
pub(crate) fn start_job_nowait(
    spec: &ShimSpec,
    pin: Option<CpuSet>,
    need_cgroup: bool,
) -> Result<Started> {
    let job = &spec.job;
    let cgroup_procs = match &spec.cgroup {
        Some(cg) => match cgroup::open_procs(cg) {
            Ok(f) => Some(f),
            Err(e) if need_cgroup => {
                return Err(ExecError::StartFailed {
                    id: job.id.clone(),
                    reason: format!("cannot enter its cgroup: {e}"),
                });
            }
            Err(e) => {
                diag(format_args!(
                    "running job {} outside its cgroup: {e}",
                    job.id
                ));
                None
            }
        },
        None if need_cgroup => {
            return Err(ExecError::StartFailed {
                id: job.id.clone(),
                reason: "a supervised job needs a cgroup".into(),
            });
        }
        None => None,
    };
    let limits: Vec<(Resource, u64, u64)> = job
        .rlimits
        .iter()
        .map(|l| (l.resource.to_nix(), l.soft, l.hard))
        .collect();
    let ids = spec
        .run_as
        .map(|r| (Uid::from_raw(r.uid), Gid::from_raw(r.gid)));
    // Born in its cgroup where the kernel can (no migration: see clone3.rs),
    // else the cgroup.procs write below.
    if let (Some(cg), Some(_)) = (&spec.cgroup, &cgroup_procs) {
        let failed = |reason: String| ExecError::StartFailed {
            id: job.id.clone(),
            reason,
        };
        let cwd = job.cwd.as_deref().unwrap_or(Path::new("/"));
        let image = || {
            ExecImage::new(&job.command, &job.args, &job.env, DEFAULT_PATH, cwd)
                .map_err(|e| failed(format!("exec {}: {e}", job.command)))
        };
        // Sharing this process's memory until the exec where this build
        // and the kernel can (no page tables copied: see vmclone.rs), else
        // a fork-style clone.
        static VM_REFUSED: std::sync::atomic::AtomicBool =
            std::sync::atomic::AtomicBool::new(false);
        if vmclone::AVAILABLE && !VM_REFUSED.load(Ordering::Relaxed) {
            let plan = vmclone::ChildPlan {
                pin: pin.as_ref().map(|set| {
                    vmclone::raw_cpu_set(
                        (0..CpuSet::count()).filter(|&c| set.is_set(c).unwrap_or(false)),
                    )
                }),
                limits: limits
                    .iter()
                    .map(|&(r, soft, hard)| (r as u32, soft, hard))
                    .collect(),
                ids: ids.map(|(u, g)| (u.as_raw(), g.as_raw())),
            };
            match vmclone::clone_vm_into_cgroup(cg, image()?, plan) {
                Ok((c, hold)) => {
                    return Ok(Started {
                        pid: c.pid,
                        stdout: c.stdout,
                        stderr: c.stderr,
                        exec_report: Some(c.report),
                        exec_hold: Some(hold),
                    });
                }
                Err(SpawnError::Failed { step, errno }) => {
                    return Err(step_failed(job, step, errno));
                }
                Err(SpawnError::Setup(e)) => {
                    return Err(failed(format!("pipes for the job: {e}")));
                }
                Err(SpawnError::Unsupported(e)) => {
                    if !VM_REFUSED.swap(true, Ordering::Relaxed) {
                        diag(format_args!(
                            "clone3 with CLONE_VM refused ({e}): jobs are cloned fork-style"
                        ));
                    }
                }
            }
        }
        let setup = |report: &OwnedFd| child_setup(report, None, pin.as_ref(), &limits, ids);
        // Safety: `child_setup` only makes async-signal-safe system calls
        // on data built before the clone (see the `pre_exec` below).
        // Built here, not before the CLONE_VM start, which takes its own.
        let image = image()?;
        match unsafe { clone3::clone_into_cgroup(cg, &image, &setup) } {
            Ok(c) => {
                return Ok(Started {
                    pid: c.pid,
                    stdout: c.stdout,
                    stderr: c.stderr,
                    exec_report: Some(c.report),
                    exec_hold: None,
                });
            }
            Err(SpawnError::Failed { step, errno }) => return Err(step_failed(job, step, errno)),
            Err(SpawnError::Setup(e)) => return Err(failed(format!("pipes for the job: {e}"))),
            Err(SpawnError::Unsupported(e)) => {
                static SAID: std::sync::atomic::AtomicBool =
                    std::sync::atomic::AtomicBool::new(false);
                if !SAID.swap(true, Ordering::Relaxed) {
                    diag(format_args!(
                        "clone3 into a cgroup unavailable ({e}): jobs enter their cgroups by cgroup.procs"
                    ));
                }
            }
        }
    }
    // The child reports which step failed through this pipe; exec closes it.
    let (err_read, err_write) = nix::unistd::pipe2(OFlag::O_CLOEXEC)
        .map_err(|e| ExecError::sys("pipe2", format!("job {}", job.id), e))?;

    let mut cmd = Command::new(&job.command);
    cmd.args(&job.args)
        .env_clear()
        .envs(&job.env)
        .current_dir(job.cwd.as_deref().unwrap_or(Path::new("/")))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if !job.env.contains_key("PATH") {
        cmd.env("PATH", DEFAULT_PATH);
    }
    let setup = move || {
        child_setup(
            &err_write,
            cgroup_procs.as_ref(),
            pin.as_ref(),
            &limits,
            ids,
        )
    };
    // Safety: `setup` runs in the forked child before exec. It only calls
    // async-signal-safe system calls (setsid, write, sched_setaffinity,
    // setrlimit, setgroups, setgid, setuid) through nix wrappers that do
    // not allocate, on data
    // (file descriptors, a Vec built before the fork) that it only reads; it
    // takes no locks and does not touch the parent's tokio state.
    unsafe {
        cmd.pre_exec(setup);
    }
    let spawned = cmd.spawn();
    drop(cmd); // closes our copy of err_write (owned by the closure)
    match spawned {
        Ok(mut child) => {
            let (Some(out), Some(err)) = (child.stdout.take(), child.stderr.take()) else {
                return Err(ExecError::StartFailed {
                    id: job.id.clone(),
                    reason: "no pipes for stdout/stderr".into(),
                });
            };
            let pid = i32::try_from(child.id()).unwrap_or(i32::MAX);
            Ok(Started {
                pid,
                stdout: out.into(),
                stderr: err.into(),
                exec_report: None,
                exec_hold: None,
            })
        }
        Err(e) => {
            let mut step = String::new();
            let _ = File::from(err_read).read_to_string(&mut step);
            let step = if step.is_empty() {
                format!("exec {}", job.command)
            } else {
                step
            };
            Err(ExecError::StartFailed {
                id: job.id.clone(),
                reason: format!("{step}: {e}"),
            })
        }
    }
}

/// Between fork and exec, in the job's process. Only system calls.
fn child_setup(
    err_pipe: &OwnedFd,
    cgroup_procs: Option<&File>,
    pin: Option<&CpuSet>,
    limits: &[(Resource, u64, u64)],
    ids: Option<(Uid, Gid)>,
) -> io::Result<()> {
    let fail = |step: &'static str, errno: Errno| {
        let _ = nix::unistd::write(err_pipe, step.as_bytes());
        io::Error::from_raw_os_error(errno as i32)
    };
    setsid().map_err(|e| fail("setsid", e))?;
    if let Some(procs) = cgroup_procs {
        cgroup::enter_self(procs).map_err(|e| fail("write cgroup.procs", e))?;
    }
    if let Some(set) = pin {
        sched_setaffinity(Pid::from_raw(0), set).map_err(|e| fail("sched_setaffinity", e))?;
    }
    for &(resource, soft, hard) in limits {
        nix::sys::resource::setrlimit(resource, soft, hard).map_err(|e| fail("setrlimit", e))?;
    }
    if let Some((uid, gid)) = ids {
        setgroups(&[gid]).map_err(|e| fail("setgroups", e))?;
        setgid(gid).map_err(|e| fail("setgid", e))?;
        setuid(uid).map_err(|e| fail("setuid", e))?;
    }
    Ok(())
}

/// Why the shim is terminating the job.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Termination {
    pub outcome: TermReason,
    pub kill_at: Instant,
    pub killed: bool,
}

#[derive(Debug, Clone, Copy)]
pub(crate) enum TermReason {
    Cancelled,
    TimedOut,
}

async fn supervise(jd: &JobDir, spec: &ShimSpec, handshake: &mut Handshake) -> Result<()> {
    let sig = |kind: SignalKind, name: &'static str| {
        signal(kind).map_err(|e| ExecError::io("install a handler for", name, e))
    };
    // Handlers first: a SIGCHLD or a cancel must not be missed.
    let mut sigchld = sig(SignalKind::child(), "SIGCHLD")?;
    let mut sigusr1 = sig(SignalKind::user_defined1(), "SIGUSR1")?;
    let mut sigterm = sig(SignalKind::terminate(), "SIGTERM")?;
    let mut sigint = sig(SignalKind::interrupt(), "SIGINT")?;
    let mut sighup = sig(SignalKind::hangup(), "SIGHUP")?;

    let job = &spec.job;
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
    let (out_stats, err_stats) = (out_log.stats(), err_log.stats());

    let started = match start_job(spec, None, false) {
        Ok(s) => s,
        Err(e) => {
            // If no agent is listening any more, readopt() reports this.
            let exit = JobExit::bare(&job.id, JobOutcome::StartFailed(start_failure(&e)));
            jd.record_exit(&exit)?;
            return Err(e);
        }
    };
    let pid = started.pid;
    let procs = JobProcs {
        pgid: pid,
        shim: Some(getpid().as_raw()),
        cgroup: spec.cgroup.as_deref(),
    };
    let pump = |fd: OwnedFd, log: CappedLog| -> Result<tokio::task::JoinHandle<()>> {
        let rx = pipe::Receiver::from_owned_fd(fd)
            .map_err(|e| ExecError::io("watch the output pipe of", jd.path(), e))?;
        Ok(tokio::spawn(log.pump(rx)))
    };
    // Start time 0 when it is already gone: nothing to misidentify.
    let starttime = procfs::stat(pid).map_or(0, |st| st.starttime);
    let tasks = jd.record_job(pid, starttime).and_then(|()| {
        let out_task = pump(started.stdout, out_log)?;
        let err_task = pump(started.stderr, err_log)?;
        Ok((out_task, err_task))
    });
    let (out_task, err_task) = match tasks {
        Ok(t) => t,
        Err(e) => {
            // Unsupervised, the job must not run: kill it and report.
            let mut main = None;
            loop {
                procs.kill_all();
                if reap(pid, &mut main) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let exit = JobExit::bare(&job.id, JobOutcome::StartFailed(start_failure(&e)));
            jd.record_exit(&exit)?;
            return Err(e);
        }
    };
    handshake.ok(pid);
    let timeout_at = job.timeout.map(|t| Instant::now() + t);
    let far = Instant::now() + Duration::from_secs(100 * 365 * 24 * 3600);
    let mut term: Option<Termination> = None;
    let mut main: Option<WaitStatus> = None;
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    let lease = spec.job_lease();
    // The deadline the job was last fenced on (stopped once per deadline).
    let mut fenced_on: Option<u64> = None;

    loop {
        let no_children = reap(pid, &mut main);
        if main.is_some() {
            if no_children {
                break;
            }
            // The main process is gone: nothing of the job may outlive it.
            procs.kill_all();
        }
        let kill_at = term.filter(|t| !t.killed).map(|t| t.kill_at);
        let running = main.is_none();
        // A job being terminated keeps running to see its SIGTERM.
        let lease_left = match &lease {
            Some(lease) if running && term.is_none() => {
                fence(lease, &procs, &mut fenced_on, &jd.cancel())
            }
            _ => None,
        };
        tokio::select! {
            _ = sigchld.recv() => {}
            _ = tokio::time::sleep(lease_left.unwrap_or_default()), if lease_left.is_some() => {}
            _ = tick.tick() => {}
            _ = sighup.recv() => {}
            _ = sigusr1.recv() => {
                let grace = read_json::<CancelRequest>(&jd.cancel())
                    .ok()
                    .flatten()
                    .map_or(job.kill_grace, |c| Duration::from_millis(c.grace_ms));
                if running {
                    terminate(&procs, &mut term, TermReason::Cancelled, grace);
                }
            }
            _ = sigterm.recv() => if running {
                terminate(&procs, &mut term, TermReason::Cancelled, job.kill_grace);
            },
            _ = sigint.recv() => if running {
                terminate(&procs, &mut term, TermReason::Cancelled, job.kill_grace);
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

    // Every process of the job is reaped: the pipes have no writer left.
    let drain = async {
        let _ = out_task.await;
        let _ = err_task.await;
    };
    if tokio::time::timeout(PIPE_DRAIN_LIMIT, drain).await.is_err() {
        diag(format_args!(
            "job output pipes still open after every process exited; stopped reading"
        ));
    }

    let mut exit = exit_record(
        job.id.clone(),
        main,
        term.map(|t| t.outcome),
        started_at_ms,
        &out_stats,
        &err_stats,
        children_usage(),
    );
    exit.cgroup_killed = spec.cgroup.as_deref().is_some_and(cgroup::take_killed);
    jd.record_exit(&exit)
}

/// Obey the lease: stop the job once its deadline has passed (once per
/// deadline: a renewal moves it, and the agent continues the job). Returns
/// how long until the deadline, `None` when there is none to wait for.
/// `cancel` is the job's cancel request file: a job whose cancel was asked
/// for is never continued here (its termination continues it, SIGTERM
/// first).
pub(crate) fn fence(
    lease: &LeaseFile,
    procs: &JobProcs<'_>,
    fenced_on: &mut Option<u64>,
    cancel: &Path,
) -> Option<Duration> {
    let deadline = lease.deadline()?;
    let now = super::lease::now_ns();
    if now < deadline {
        return Some(Duration::from_nanos(deadline - now));
    }
    if *fenced_on != Some(deadline) {
        *fenced_on = Some(deadline);
        diag(format_args!(
            "the agent's lease ran out: stopping the job until it is renewed"
        ));
        if let Err(e) = procs.signal(Signal::SIGSTOP) {
            diag(format_args!("{e}"));
        }
        // The agent writes a renewal before it continues fenced jobs: one
        // that came between the read above and this stop is seen here.
        // Not for a job being cancelled: the agent writes the request
        // before it takes the grant (a Cancel then a grant, in order) and
        // does not continue such a job; continued here, before this shim
        // reads the request, the job would run its next step (its SIGCONT
        // trap, in `fenced_jobs_wait_for_a_grant_after_a_new_registration`,
        // which CI once saw run this way under load).
        if let Some(renewed) = lease
            .read()
            .filter(|&d| d > super::lease::now_ns())
            .filter(|_| !cancel.exists())
        {
            diag(format_args!(
                "the lease was renewed meanwhile: continuing the job"
            ));
            let _ = procs.signal(Signal::SIGCONT);
            return Some(Duration::from_nanos(
                renewed.saturating_sub(super::lease::now_ns()),
            ));
        }
    }
    None
}

/// Start terminating the job: SIGTERM and SIGCONT now, SIGKILL after
/// `grace`. A second request can only bring the SIGKILL closer.
pub(crate) fn terminate(
    procs: &JobProcs<'_>,
    term: &mut Option<Termination>,
    reason: TermReason,
    grace: Duration,
) {
    let kill_at = Instant::now() + grace;
    match term {
        Some(t) => t.kill_at = t.kill_at.min(kill_at),
        None => {
            if let Err(e) = procs.signal(Signal::SIGTERM) {
                diag(format_args!("{e}"));
            }
            let _ = procs.signal(Signal::SIGCONT);
            *term = Some(Termination {
                outcome: reason,
                kill_at,
                killed: false,
            });
        }
    }
}

/// Reap every child that has exited; remember the main process's status.
/// Returns true when the shim has no child left (`ECHILD`).
fn reap(main_pid: i32, main: &mut Option<WaitStatus>) -> bool {
    loop {
        match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) => return false,
            Ok(status) => {
                if status.pid() == Some(Pid::from_raw(main_pid))
                    && matches!(status, WaitStatus::Exited(..) | WaitStatus::Signaled(..))
                {
                    *main = Some(status);
                }
            }
            Err(Errno::EINTR) => {}
            Err(Errno::ECHILD) => return true,
            Err(e) => {
                diag(format_args!("waitpid: {e}"));
                return false;
            }
        }
    }
}

/// CPU time and peak memory of a job: `(user ms, system ms, max RSS KiB)`.
pub(crate) type Usage = (u64, u64, u64);

/// The usage of everything this process has reaped (the shim's children
/// are its job's processes).
fn children_usage() -> Usage {
    match getrusage(UsageWho::RUSAGE_CHILDREN) {
        Ok(u) => {
            let ms = |t: nix::sys::time::TimeVal| {
                u64::try_from(t.tv_sec() * 1000 + t.tv_usec() / 1000).unwrap_or(0)
            };
            (
                ms(u.user_time()),
                ms(u.system_time()),
                u64::try_from(u.max_rss()).unwrap_or(0),
            )
        }
        Err(_) => (0, 0, 0),
    }
}

pub(crate) fn exit_record(
    id: String,
    main: Option<WaitStatus>,
    term: Option<TermReason>,
    started_at_ms: u64,
    out: &Arc<LogStats>,
    err: &Arc<LogStats>,
    usage: Usage,
) -> JobExit {
    let (exit_code, signal) = match main {
        Some(WaitStatus::Exited(_, code)) => (Some(code), None),
        Some(WaitStatus::Signaled(_, sig, _)) => (None, Some(sig as i32)),
        _ => (None, None),
    };
    let outcome = match (term, exit_code, signal) {
        (Some(TermReason::Cancelled), ..) => JobOutcome::Cancelled,
        (Some(TermReason::TimedOut), ..) => JobOutcome::TimedOut,
        (None, Some(code), _) => JobOutcome::Exited(code),
        (None, None, Some(sig)) => JobOutcome::Signaled(sig),
        (None, None, None) => JobOutcome::Lost("the main process was never reaped".into()),
    };
    let (user_cpu_ms, sys_cpu_ms, max_rss_kib) = usage;
    JobExit {
        id,
        outcome,
        exit_code,
        signal,
        started_at_ms,
        ended_at_ms: now_ms(),
        stdout_bytes: out.written.load(Ordering::Relaxed),
        stderr_bytes: err.written.load(Ordering::Relaxed),
        stdout_truncated: out.truncated.load(Ordering::Relaxed),
        stderr_truncated: err.truncated.load(Ordering::Relaxed),
        user_cpu_ms,
        sys_cpu_ms,
        max_rss_kib,
        cgroup_killed: false,
    }
}
