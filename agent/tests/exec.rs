//! The process executor against real processes: shims, process groups,
//! pinning, signals, logs, limits, users, re-adoption and cgroups, checked
//! from /proc. No mocks. Every test uses its own temporary state directory
//! and kills what it started, even when it fails.
//!
//! Runs as root (CI) and as an ordinary user; root-only checks (switching
//! to uid 65534, refusing root) say when they are skipped. Waits poll with
//! small sleeps and generous limits for a loaded 2-CPU machine; no test
//! asserts how fast anything is.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use agent::exec::{
    ExecConfig, ExecError, Executor, JobExec, JobExit, JobHandle, JobOutcome, JobState, Launcher,
    RlimitResource, ShutdownMode, cgroup,
    devices::{DenyList, DeviceNode},
};
use nix::sched::{CpuSet, sched_getaffinity};
use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::{Pid, geteuid};
use tempfile::TempDir;

/// Limit for anything to happen (a job to start, exit, be seen in /proc).
const PATIENCE: Duration = Duration::from_secs(60);

/// The value of the first complete `KEY VALUE` line of a job's `record`
/// (the executor's append-only file: `shim PID`, `job PID STARTTIME`,
/// `exit {JSON}`, ...).
fn record_line(job_dir: &Path, key: &str) -> Option<String> {
    let text = fs::read_to_string(job_dir.join("record")).ok()?;
    let complete = &text[..text.rfind('\n')?];
    complete.lines().find_map(|l| {
        l.strip_prefix(key)
            .and_then(|rest| rest.strip_prefix(' '))
            .map(str::to_owned)
    })
}

/// A pid from the job's `record`: `shim` or `job` (its first field).
fn record_pid(job_dir: &Path, key: &str) -> Option<i32> {
    record_line(job_dir, key)?.split(' ').next()?.parse().ok()
}

fn is_root() -> bool {
    geteuid().is_root()
}

fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_max_level(tracing::Level::INFO)
        .try_init();
}

/// The CPUs this test process may use (the machine may have more).
fn allowed_cpus() -> Vec<u32> {
    let set = sched_getaffinity(Pid::from_raw(0)).expect("sched_getaffinity");
    (0..CpuSet::count())
        .filter(|&i| set.is_set(i).unwrap_or(false))
        .map(|i| i as u32)
        .collect()
}

/// Two CPUs to move jobs between (the same one twice on a 1-CPU box).
fn two_cpus() -> (u32, u32) {
    let cpus = allowed_cpus();
    (cpus[0], *cpus.last().expect("at least one CPU"))
}

fn config(state_dir: &Path) -> ExecConfig {
    let mut cfg = ExecConfig::new(state_dir);
    cfg.shim_exe = PathBuf::from(env!("CARGO_BIN_EXE_agent"));
    // As root, jobs run as nobody (the executor refuses root by default).
    cfg.run_as = is_root().then_some((65534, 65534));
    cfg.shim_start_timeout = PATIENCE;
    cfg.log_cap_bytes = 1 << 20;
    cfg.shutdown = ShutdownMode::LeaveRunning;
    cfg.adopt_poll_interval = Duration::from_millis(50);
    // The shim (what every job without a cgroup gets, and `--launcher shim`):
    // these tests look at its process layout (the shim pinned with its
    // job, the job's escapees as the shim's children). The supervisor has
    // the `supervis*` tests below.
    cfg.launcher = Launcher::Shim;
    cfg
}

fn sh(id: &str, script: &str, cpus: Vec<u32>) -> JobExec {
    JobExec::new(id, "/bin/sh", cpus).args(["-c", script])
}

/// A state directory whose jobs are killed when the test ends, however it
/// ends.
struct Fixture {
    dir: TempDir,
}

impl Fixture {
    fn new() -> Self {
        init_tracing();
        Fixture {
            dir: tempfile::tempdir().expect("tempdir"),
        }
    }
    fn path(&self) -> &Path {
        self.dir.path()
    }
    fn executor(&self) -> Executor {
        Executor::new(config(self.path())).expect("Executor::new")
    }
    /// Print what the state directory holds that tells why a test failed
    /// (its supervisor's log, each job's record and shim log): a failure
    /// seen once in CI is then readable from its output.
    fn dump(&self) {
        let show = |path: &Path| {
            if let Ok(text) = fs::read_to_string(path) {
                eprintln!("--- {}:\n{text}", path.display());
            }
        };
        show(&self.path().join("supervisor.log"));
        let Ok(entries) = fs::read_dir(self.path().join("jobs")) else {
            return;
        };
        for entry in entries.flatten() {
            show(&entry.path().join("record"));
            show(&entry.path().join("shim.log"));
        }
    }
    fn executor_with(&self, f: impl FnOnce(&mut ExecConfig)) -> Executor {
        let mut cfg = config(self.path());
        f(&mut cfg);
        Executor::new(cfg).expect("Executor::new")
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.dump();
        }
        let Ok(entries) = fs::read_dir(self.path().join("jobs")) else {
            return;
        };
        for entry in entries.flatten() {
            let read = |key: &str| record_pid(&entry.path(), key);
            if let Some(pgid) = read("job")
                && stat(pgid).is_some_and(|s| s.session == pgid)
            {
                let _ = killpg(Pid::from_raw(pgid), Signal::SIGKILL);
            }
            if let Some(shim) = read("shim")
                && fs::read(format!("/proc/{shim}/cmdline"))
                    .is_ok_and(|c| c.windows(4).any(|w| w == b"shim"))
            {
                let _ = kill(Pid::from_raw(shim), Signal::SIGKILL);
            }
        }
    }
}

/// A job script that waits until its shell gets SIGUSR1, then runs `then`
/// (signals need no shared directory the job's user could not reach).
fn gated(then: &str) -> String {
    format!("trap '{then}' USR1; while :; do sleep 0.05; done")
}

/// Release a [`gated`] job whose shell is `pid`, once its trap is set: a
/// SIGUSR1 that came earlier (the shell not yet exec'd or not yet past
/// `trap`) would kill it or be lost.
fn open_gate(pid: u32) {
    let start = Instant::now();
    while !(comm(pid as i32) == "sh" && signal_in(pid as i32, "SigCgt", Signal::SIGUSR1)) {
        assert!(
            start.elapsed() < PATIENCE,
            "the gated job never set its trap"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    kill(Pid::from_raw(pid as i32), Signal::SIGUSR1).expect("signal the gated job");
}

/// Whether `sig` is in the signal mask `field` of /proc/<pid>/status
/// (`SigCgt`: caught; `SigPnd`/`ShdPnd`: pending for the thread/process).
fn signal_in(pid: i32, field: &str, sig: Signal) -> bool {
    proc_status(&format!("/proc/{pid}/status"), field)
        .and_then(|v| u64::from_str_radix(&v, 16).ok())
        .is_some_and(|mask| mask & (1 << (sig as i32 - 1)) != 0)
}

/// Whether every process of process group `pgid` is stopped: in state T,
/// or with SIGSTOP pending. The second is a shell in `vfork()` whose
/// child the group stop caught before it exec'd: the parent waits for the
/// child uninterruptibly (state D) and takes its own stop only when the
/// child goes on. dash starts `sleep` that way; under load the child
/// often waits for a CPU before its exec, and a check for state T alone
/// waited for ever (the flake of `readopts_after_the_agent_process_exits`).
fn group_stopped(pgid: i32) -> bool {
    let members: Vec<i32> = all_pids()
        .into_iter()
        .filter(|&p| stat(p).is_some_and(|s| s.pgrp == pgid && s.state != 'Z'))
        .collect();
    !members.is_empty()
        && members.iter().all(|&p| {
            stat(p).is_some_and(|s| s.state == 'T')
                || signal_in(p, "ShdPnd", Signal::SIGSTOP)
                || signal_in(p, "SigPnd", Signal::SIGSTOP)
        })
}

#[derive(Debug, Clone, Copy)]
struct Stat {
    state: char,
    ppid: i32,
    pgrp: i32,
    session: i32,
    utime: u64,
    starttime: u64,
}

/// /proc/<pid>/stat, parsed here independently of the executor.
fn stat(pid: i32) -> Option<Stat> {
    let text = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest: Vec<&str> = text[text.rfind(')')? + 1..].split_whitespace().collect();
    Some(Stat {
        state: rest[0].chars().next()?,
        ppid: rest[1].parse().ok()?,
        pgrp: rest[2].parse().ok()?,
        session: rest[3].parse().ok()?,
        utime: rest[11].parse().ok()?,
        starttime: rest[19].parse().ok()?,
    })
}

fn proc_status(path: &str, field: &str) -> Option<String> {
    let text = fs::read_to_string(path).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .map(|v| v.trim().to_owned())
}

fn all_pids() -> Vec<i32> {
    fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Live processes of the job: its process group and its shim's children.
fn job_pids(pgid: i32, shim: i32) -> BTreeSet<i32> {
    all_pids()
        .into_iter()
        .filter(|&p| stat(p).is_some_and(|s| (s.pgrp == pgid || s.ppid == shim) && s.state != 'Z'))
        .collect()
}

fn tids(pid: i32) -> Vec<i32> {
    fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

fn thread_cpus(pid: i32, tid: i32) -> Option<String> {
    proc_status(
        &format!("/proc/{pid}/task/{tid}/status"),
        "Cpus_allowed_list",
    )
}

fn comm(pid: i32) -> String {
    fs::read_to_string(format!("/proc/{pid}/comm"))
        .unwrap_or_default()
        .trim()
        .to_owned()
}

/// Whether the process identified by (pid, start time) no longer exists
/// (reaped; a zombie still counts as existing unless `zombie_ok`).
fn gone(pid: i32, starttime: u64, zombie_ok: bool) -> bool {
    match stat(pid) {
        None => true,
        Some(s) => s.starttime != starttime || (zombie_ok && s.state == 'Z'),
    }
}

async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let start = Instant::now();
    while !check() {
        assert!(start.elapsed() < PATIENCE, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Remove a test's cgroup root once its job cgroups are gone. The kernel
/// answers EBUSY for a moment after a child cgroup's rmdir (its
/// controllers go offline asynchronously), so EBUSY is retried; any other
/// error, or EBUSY past the patience, fails the test.
async fn remove_test_root(root: &Path) {
    let start = Instant::now();
    loop {
        match fs::remove_dir(root) {
            Ok(()) => return,
            Err(e)
                if e.raw_os_error() == Some(nix::errno::Errno::EBUSY as i32)
                    && start.elapsed() < PATIENCE =>
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("remove the test's cgroup root {}: {e}", root.display()),
        }
    }
}

async fn wait_exit(handle: &mut JobHandle) -> JobExit {
    tokio::time::timeout(PATIENCE, handle.wait())
        .await
        .unwrap_or_else(|_| panic!("job {} did not exit", handle.id()))
        .expect("exit")
}

async fn next_exit(rx: &mut tokio::sync::mpsc::UnboundedReceiver<JobExit>) -> JobExit {
    tokio::time::timeout(PATIENCE, rx.recv())
        .await
        .expect("no exit event in time")
        .expect("exit channel closed")
}

/// Not a test of its own: the body of a multi-threaded job. Run as a job
/// with `EXEC_TEST_THREAD_HELPER=1`, it starts 3 threads and sleeps; in a
/// normal test run it returns at once.
#[test]
fn thread_helper() {
    if std::env::var_os("EXEC_TEST_THREAD_HELPER").is_none() {
        return;
    }
    for _ in 0..3 {
        std::thread::spawn(|| std::thread::sleep(Duration::from_secs(60)));
    }
    std::thread::sleep(Duration::from_secs(60));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pins_and_repins_every_process_of_the_job() {
    let fx = Fixture::new();
    let exec = fx.executor();
    let (a, b) = two_cpus();
    let mut h = exec
        .spawn(sh("pin", "sleep 30 & sleep 30 & wait", vec![a]))
        .await
        .expect("spawn");
    let (pgid, shim) = (h.pid() as i32, h.shim_pid() as i32);
    eventually("sh and its two sleeps", || job_pids(pgid, shim).len() == 3).await;
    let procs = job_pids(pgid, shim);
    let check_all = |want: u32| {
        for &pid in procs.iter().chain([shim].iter()) {
            let threads = tids(pid);
            assert!(!threads.is_empty(), "pid {pid} vanished");
            for tid in threads {
                assert_eq!(
                    thread_cpus(pid, tid).as_deref(),
                    Some(want.to_string().as_str()),
                    "thread {tid} of pid {pid} ({})",
                    comm(pid)
                );
            }
        }
    };
    check_all(a);
    let pinned = exec.repin("pin", &[b]).expect("repin");
    assert!(
        pinned >= 4,
        "pinned {pinned} threads: 3 processes and the shim"
    );
    check_all(b);
    assert_eq!(exec.status("pin").unwrap().cpus, vec![b]);
    exec.cancel("pin", Duration::ZERO).unwrap();
    assert_eq!(wait_exit(&mut h).await.outcome, JobOutcome::Cancelled);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repins_every_thread_of_a_multithreaded_job() {
    let fx = Fixture::new();
    // The job is this test binary, which the unprivileged run_as user may
    // not be able to reach (a target dir under /root): run it as ourselves.
    let exec = fx.executor_with(|c| {
        c.run_as = None;
        c.allow_root = true;
    });
    let (a, b) = two_cpus();
    let me = std::env::current_exe().unwrap();
    let job = JobExec::new("threads", me.to_string_lossy(), vec![a])
        .args([
            "--exact",
            "thread_helper",
            "--test-threads=1",
            "--nocapture",
        ])
        .env("EXEC_TEST_THREAD_HELPER", "1");
    let mut h = exec.spawn(job).await.expect("spawn");
    let pid = h.pid() as i32;
    // main thread + libtest's test thread + 3
    eventually("5 threads", || tids(pid).len() >= 5).await;
    for tid in tids(pid) {
        assert_eq!(thread_cpus(pid, tid), Some(a.to_string()), "tid {tid}");
    }
    exec.repin("threads", &[b]).expect("repin");
    for tid in tids(pid) {
        assert_eq!(thread_cpus(pid, tid), Some(b.to_string()), "tid {tid}");
    }
    exec.cancel("threads", Duration::ZERO).unwrap();
    assert_eq!(wait_exit(&mut h).await.outcome, JobOutcome::Cancelled);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_exit_codes_signals_and_start_failures() {
    let fx = Fixture::new();
    let exec = fx.executor();
    let cpus = allowed_cpus();

    let mut h = exec
        .spawn(sh("code", "exit 7", cpus.clone()))
        .await
        .unwrap();
    let exit = wait_exit(&mut h).await;
    assert_eq!(exit.outcome, JobOutcome::Exited(7));
    assert_eq!((exit.exit_code, exit.signal), (Some(7), None));
    assert!(exit.ended_at_ms >= exit.started_at_ms);
    let on_disk: JobExit = serde_json::from_str(&record_line(h.dir(), "exit").unwrap()).unwrap();
    assert_eq!(on_disk, exit);

    let mut h = exec
        .spawn(sh("sig", "kill -KILL $$", cpus.clone()))
        .await
        .unwrap();
    let exit = wait_exit(&mut h).await;
    assert_eq!(exit.outcome, JobOutcome::Signaled(9));
    assert_eq!((exit.exit_code, exit.signal), (None, Some(9)));

    let err = exec
        .spawn(JobExec::new(
            "missing",
            "/nonexistent/program",
            cpus.clone(),
        ))
        .await
        .expect_err("a missing program cannot start");
    match &err {
        ExecError::StartFailed { id, reason } => {
            assert_eq!(id, "missing");
            assert!(reason.contains("exec /nonexistent/program"), "{reason}");
        }
        other => panic!("unexpected error {other}"),
    }
    // Nothing is left behind: the id can be used again.
    assert!(!fx.path().join("jobs/missing").exists());
    let mut h = exec
        .spawn(JobExec::new("missing", "/bin/true", cpus))
        .await
        .unwrap();
    assert_eq!(wait_exit(&mut h).await.outcome, JobOutcome::Exited(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn captures_output_live_and_caps_it() {
    let fx = Fixture::new();
    let exec = fx.executor_with(|c| c.log_cap_bytes = 1000);
    let cpus = allowed_cpus();

    // Readable while the job runs.
    let mut h = exec
        .spawn(sh(
            "live",
            "echo out; echo err >&2; exec sleep 30",
            cpus.clone(),
        ))
        .await
        .unwrap();
    eventually("stdout and stderr while running", || {
        fs::read_to_string(h.stdout_path()).is_ok_and(|s| s == "out\n")
            && fs::read_to_string(h.stderr_path()).is_ok_and(|s| s == "err\n")
    })
    .await;
    assert!(matches!(
        exec.status("live").unwrap().state,
        JobState::Running { .. }
    ));
    exec.cancel("live", Duration::ZERO).unwrap();
    let exit = wait_exit(&mut h).await;
    assert_eq!((exit.stdout_bytes, exit.stderr_bytes), (4, 4));
    assert!(!exit.stdout_truncated && !exit.stderr_truncated);

    // Capped, with the truncation noted.
    let mut h = exec
        .spawn(sh(
            "capped",
            "head -c 5000 /dev/zero | tr '\\000' x; echo tail >&2; exit 3",
            cpus,
        ))
        .await
        .unwrap();
    let exit = wait_exit(&mut h).await;
    assert_eq!(exit.outcome, JobOutcome::Exited(3));
    let out = fs::read(h.stdout_path()).unwrap();
    assert_eq!(out.len(), 1000);
    assert!(out.iter().all(|&c| c == b'x'));
    assert!(exit.stdout_truncated && exit.stdout_bytes == 1000);
    assert!(h.dir().join("stdout.truncated").exists());
    assert_eq!(fs::read_to_string(h.stderr_path()).unwrap(), "tail\n");
    assert!(!exit.stderr_truncated && !h.dir().join("stderr.truncated").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_terms_then_kills_the_whole_group_and_grandchildren() {
    let fx = Fixture::new();
    let exec = fx.executor();
    // Everything ignores SIGTERM; one grandchild double-forks inside the
    // group, another also leaves the group and the session (setsid).
    let script = r#"trap "" TERM; (sleep 300 &); (setsid sleep 301 &); sleep 60"#;
    let mut h = exec
        .spawn(sh("cancel", script, allowed_cpus()))
        .await
        .unwrap();
    let (pgid, shim) = (h.pid() as i32, h.shim_pid() as i32);
    eventually("sh and three sleeps (two re-parented to the shim)", || {
        let pids = job_pids(pgid, shim);
        pids.len() == 4
            && pids.iter().filter(|&&p| comm(p) == "sleep").count() == 3
            && pids
                .iter()
                .any(|&p| stat(p).is_some_and(|s| s.pgrp != pgid))
    })
    .await;
    let victims: Vec<(i32, u64)> = job_pids(pgid, shim)
        .into_iter()
        .filter_map(|p| Some((p, stat(p)?.starttime)))
        .collect();

    let grace = Duration::from_millis(1500);
    let asked = Instant::now();
    exec.cancel("cancel", grace).unwrap();
    let exit = wait_exit(&mut h).await;
    // SIGTERM was ignored, so only the SIGKILL after the grace ended it.
    assert!(asked.elapsed() >= grace, "killed before the grace period");
    assert_eq!(exit.outcome, JobOutcome::Cancelled);
    assert_eq!(exit.signal, Some(9));
    for (pid, start) in victims {
        assert!(
            gone(pid, start, false),
            "pid {pid} ({}) survived",
            comm(pid)
        );
    }
    assert!(job_pids(pgid, shim).is_empty());
    assert!(exec.cancel("cancel", grace).is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_and_cont_a_cpu_spinner() {
    let fx = Fixture::new();
    let exec = fx.executor();
    let (a, _) = two_cpus();
    let mut h = exec
        .spawn(sh("spin", "while :; do :; done", vec![a]))
        .await
        .unwrap();
    let pid = h.pid() as i32;
    eventually("the spinner uses CPU", || {
        stat(pid).is_some_and(|s| s.utime > 0)
    })
    .await;

    exec.stop("spin").unwrap();
    eventually("state T", || stat(pid).is_some_and(|s| s.state == 'T')).await;
    assert_eq!(
        exec.status("spin").unwrap().state,
        JobState::Running { stopped: true }
    );
    let before = stat(pid).unwrap().utime;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = stat(pid).unwrap();
    assert_eq!(after.state, 'T');
    assert_eq!(after.utime, before, "a stopped job must not run");

    exec.cont("spin").unwrap();
    eventually("running again", || {
        stat(pid).is_some_and(|s| s.state != 'T' && s.utime > before)
    })
    .await;
    assert_eq!(
        exec.status("spin").unwrap().state,
        JobState::Running { stopped: false }
    );

    // A stopped job can still be cancelled (SIGTERM is followed by SIGCONT).
    exec.stop("spin").unwrap();
    eventually("stopped again", || {
        stat(pid).is_some_and(|s| s.state == 'T')
    })
    .await;
    exec.cancel("spin", Duration::from_secs(30)).unwrap();
    let exit = wait_exit(&mut h).await;
    assert_eq!(exit.outcome, JobOutcome::Cancelled);
    assert_eq!(
        exit.signal,
        Some(15),
        "ended by the SIGTERM, not the SIGKILL"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeout_terminates_the_group() {
    let fx = Fixture::new();
    let exec = fx.executor();
    let job = sh(
        "slow",
        r#"trap "" TERM; sleep 60 & sleep 60"#,
        allowed_cpus(),
    )
    .timeout(Duration::from_secs(1), Duration::from_millis(300));
    let mut h = exec.spawn(job).await.unwrap();
    let (pgid, shim) = (h.pid() as i32, h.shim_pid() as i32);
    eventually("sh and two sleeps", || job_pids(pgid, shim).len() == 3).await;
    let victims: Vec<(i32, u64)> = job_pids(pgid, shim)
        .into_iter()
        .filter_map(|p| Some((p, stat(p)?.starttime)))
        .collect();
    let exit = wait_exit(&mut h).await;
    assert_eq!(exit.outcome, JobOutcome::TimedOut);
    assert_eq!(exit.signal, Some(9));
    for (pid, start) in victims {
        assert!(gone(pid, start, false), "pid {pid} survived the timeout");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_as_the_configured_user_and_refuses_root() {
    let fx = Fixture::new();
    let cpus = allowed_cpus();
    let uid_of = |pid: u32| {
        let path = format!("/proc/{pid}/status");
        (
            proc_status(&path, "Uid"),
            proc_status(&path, "Gid"),
            proc_status(&path, "Groups"),
        )
    };
    if !is_root() {
        // Not root: run_as is ignored and jobs run as this user.
        let exec = fx.executor_with(|c| c.run_as = Some((65534, 65534)));
        let mut h = exec.spawn(sh("me", "exec sleep 30", cpus)).await.unwrap();
        let me = geteuid().as_raw();
        let (uid, _, _) = uid_of(h.pid());
        assert_eq!(uid, Some(format!("{me}\t{me}\t{me}\t{me}")));
        exec.cancel("me", Duration::ZERO).unwrap();
        wait_exit(&mut h).await;
        eprintln!("not root: the uid switch and the root refusal are not exercised");
        return;
    }
    {
        let exec = fx.executor();
        let mut h = exec
            .spawn(sh("nobody", "exec sleep 30", cpus.clone()))
            .await
            .unwrap();
        let (uid, gid, groups) = uid_of(h.pid());
        assert_eq!(uid.as_deref(), Some("65534\t65534\t65534\t65534"));
        assert_eq!(gid.as_deref(), Some("65534\t65534\t65534\t65534"));
        assert_eq!(groups.as_deref(), Some("65534"));
        // The shim itself stays root (it must manage the job's cgroup and
        // write its status).
        let (shim_uid, _, _) = uid_of(h.shim_pid());
        assert_eq!(shim_uid.as_deref(), Some("0\t0\t0\t0"));
        exec.cancel("nobody", Duration::ZERO).unwrap();
        wait_exit(&mut h).await;
    }
    for run_as in [None, Some((0, 0))] {
        let exec = fx.executor_with(|c| c.run_as = run_as);
        let err = exec
            .spawn(sh("root", "exit 0", cpus.clone()))
            .await
            .expect_err("root must be refused");
        assert!(
            matches!(err, ExecError::RefuseRoot(ref id) if id == "root"),
            "{err}"
        );
        assert!(!fx.path().join("jobs/root").exists());
    }
    let exec = fx.executor_with(|c| {
        c.run_as = None;
        c.allow_root = true;
    });
    let mut h = exec.spawn(sh("root", "exec sleep 30", cpus)).await.unwrap();
    let (uid, _, _) = uid_of(h.pid());
    assert_eq!(uid.as_deref(), Some("0\t0\t0\t0"));
    exec.cancel("root", Duration::ZERO).unwrap();
    wait_exit(&mut h).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readopts_a_running_job_after_the_executor_is_dropped() {
    let fx = Fixture::new();
    let (a, b) = two_cpus();
    let (pid, shim) = {
        let exec = fx.executor();
        let h = exec
            .spawn(sh("re", &gated("exit 5"), vec![a]))
            .await
            .unwrap();
        (h.pid() as i32, h.shim_pid() as i32)
        // dropped without shutdown: an agent crash
    };
    assert!(
        stat(shim).is_some_and(|s| s.state != 'Z'),
        "the shim must outlive the executor"
    );
    assert!(stat(pid).is_some_and(|s| s.state != 'Z'), "so must the job");

    let exec = fx.executor();
    let mut exits = exec.take_exits().unwrap();
    let report = exec.readopt().await.unwrap();
    assert_eq!(report.reattached, vec!["re".to_owned()]);
    assert!(report.exited.is_empty() && report.lost.is_empty());
    let status = exec.status("re").unwrap();
    assert_eq!(status.pid, Some(pid as u32));
    assert_eq!(status.state, JobState::Running { stopped: false });
    // The re-adopted job is under control.
    exec.repin("re", &[b]).unwrap();
    assert_eq!(
        proc_status(&format!("/proc/{pid}/status"), "Cpus_allowed_list"),
        Some(b.to_string())
    );
    let mut h = exec.handle("re").unwrap();

    open_gate(pid as u32);
    let exit = next_exit(&mut exits).await;
    assert_eq!(
        (exit.id.as_str(), &exit.outcome),
        ("re", &JobOutcome::Exited(5))
    );
    assert_eq!(wait_exit(&mut h).await, exit);
}

/// Not a test of its own: an agent process for
/// `readopts_after_the_agent_process_exits`. With `EXEC_TEST_AGENT_HELPER`
/// set to a state directory, it starts a gated job there and exits without
/// shutting the executor down; in a normal test run it returns at once.
#[test]
fn agent_helper() {
    let Some(state) = std::env::var_os("EXEC_TEST_AGENT_HELPER") else {
        return;
    };
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let exec = Executor::new(config(Path::new(&state))).unwrap();
        exec.spawn(sh("restart", &gated("exit 6"), allowed_cpus()))
            .await
            .unwrap();
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readopts_after_the_agent_process_exits() {
    let fx = Fixture::new();
    let helper = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "agent_helper", "--test-threads=1", "--quiet"])
        .env("EXEC_TEST_AGENT_HELPER", fx.path())
        .stdout(std::process::Stdio::null())
        .status()
        .expect("run the helper agent");
    assert!(helper.success());
    let dir = fx.path().join("jobs/restart");
    let read = |key: &str| -> i32 { record_pid(&dir, key).unwrap() };
    let (pid, shim) = (read("job"), read("shim"));
    // The agent that started it is gone; the shim is nobody's child here.
    let shim_stat = stat(shim).expect("the shim outlives its agent");
    assert_ne!(shim_stat.ppid, std::process::id() as i32);

    let exec = fx.executor();
    let mut exits = exec.take_exits().unwrap();
    let report = exec.readopt().await.unwrap();
    assert_eq!(report.reattached, vec!["restart".to_owned()]);
    exec.stop("restart").unwrap();
    eventually("stopped", || group_stopped(pid)).await;
    exec.cont("restart").unwrap();
    open_gate(pid as u32);
    let exit = next_exit(&mut exits).await;
    assert_eq!(exit.outcome, JobOutcome::Exited(6));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_an_exit_that_happened_while_no_executor_ran() {
    let fx = Fixture::new();
    let (pid, dir) = {
        let exec = fx.executor();
        let h = exec
            .spawn(sh("offline", &gated("exit 4"), allowed_cpus()))
            .await
            .unwrap();
        exec.shutdown().await.unwrap(); // LeaveRunning
        assert!(matches!(
            exec.spawn(sh("late", "exit 0", allowed_cpus())).await,
            Err(ExecError::ShutDown)
        ));
        (h.pid(), h.dir().to_owned())
    };
    open_gate(pid);
    eventually("the exit recorded by the shim alone", || {
        record_line(&dir, "exit").is_some()
    })
    .await;

    {
        let exec = fx.executor();
        let mut exits = exec.take_exits().unwrap();
        let report = exec.readopt().await.unwrap();
        assert_eq!(report.exited, vec!["offline".to_owned()]);
        assert!(report.reattached.is_empty());
        let exit = next_exit(&mut exits).await;
        assert_eq!(exit.outcome, JobOutcome::Exited(4));
        // Until acked, every new executor reports it again.
        exec.ack("offline").unwrap();
    }
    let exec = fx.executor();
    let mut exits = exec.take_exits().unwrap();
    let report = exec.readopt().await.unwrap();
    assert!(
        report.exited.is_empty(),
        "acked exits are not reported again"
    );
    assert!(exits.try_recv().is_err());
    // It wrote nothing: its directory, the record alone, became a spare
    // (`acked_directories_are_recycled_unless_they_hold_output`).
    assert!(!dir.exists());
    assert!(exec.status("offline").is_err());
}

/// A finished job's directory that holds only its record becomes the next
/// job's (the same directory, its record started again, so no inode is
/// allocated); one with output stays, readable, until `prune_kept` removes
/// it a retention after its ack (or after the start of an executor that
/// found it acked).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acked_directories_are_recycled_unless_they_hold_output() {
    use std::os::unix::fs::MetadataExt;
    let fx = Fixture::new();
    let exec = fx.executor();
    let mut quiet = exec
        .spawn(sh("quiet", "exit 3", allowed_cpus()))
        .await
        .unwrap();
    assert_eq!(wait_exit(&mut quiet).await.outcome, JobOutcome::Exited(3));
    let quiet_dir = fx.path().join("jobs/quiet");
    let inode = fs::metadata(&quiet_dir).unwrap().ino();
    exec.ack("quiet").unwrap();
    assert!(!quiet_dir.exists());
    assert!(exec.status("quiet").is_err());

    let mut next = exec
        .spawn(sh("next", "exit 5", allowed_cpus()))
        .await
        .unwrap();
    assert_eq!(wait_exit(&mut next).await.outcome, JobOutcome::Exited(5));
    let next_dir = fx.path().join("jobs/next");
    assert_eq!(fs::metadata(&next_dir).unwrap().ino(), inode);
    let record = fs::read_to_string(next_dir.join("record")).unwrap();
    assert!(
        !record.contains("quiet") && record.contains("\"next\""),
        "{record}"
    );
    assert!(matches!(
        exec.status("next").unwrap().state,
        JobState::Finished(JobExit {
            outcome: JobOutcome::Exited(5),
            ..
        })
    ));

    let mut loud = exec
        .spawn(sh("loud", "echo hi", allowed_cpus()))
        .await
        .unwrap();
    assert_eq!(wait_exit(&mut loud).await.outcome, JobOutcome::Exited(0));
    exec.ack("loud").unwrap();
    let loud_dir = fx.path().join("jobs/loud");
    assert_eq!(fs::read_to_string(loud_dir.join("stdout")).unwrap(), "hi\n");
    let record = fs::read_to_string(loud_dir.join("record")).unwrap();
    assert!(record.lines().any(|l| l == "acked"), "{record}");
    assert!(matches!(
        exec.status("loud").unwrap().state,
        JobState::Finished(JobExit {
            outcome: JobOutcome::Exited(0),
            ..
        })
    ));
    assert_eq!(exec.prune_kept(Duration::from_secs(3600), 10), 0);
    assert!(loud_dir.exists());
    assert_eq!(exec.prune_kept(Duration::ZERO, 10), 1);
    assert!(!loud_dir.exists());
    assert!(exec.status("loud").is_err());

    // Acked by an earlier executor: pruned by the next one after readopt.
    let mut again = exec
        .spawn(sh("again", "echo hi", allowed_cpus()))
        .await
        .unwrap();
    assert_eq!(wait_exit(&mut again).await.outcome, JobOutcome::Exited(0));
    exec.ack("again").unwrap();
    drop(exec);
    let exec = fx.executor();
    exec.readopt().await.unwrap();
    let again_dir = fx.path().join("jobs/again");
    assert!(again_dir.exists());
    assert_eq!(exec.prune_kept(Duration::ZERO, 10), 1);
    assert!(!again_dir.exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_with_kill_jobs_leaves_nothing() {
    let fx = Fixture::new();
    let exec = fx.executor_with(|c| {
        c.shutdown = ShutdownMode::KillJobs;
        c.shutdown_grace = Duration::from_millis(500);
    });
    let mut exits = exec.take_exits().unwrap();
    let mut victims = Vec::new();
    for id in ["k1", "k2"] {
        let h = exec
            .spawn(sh(id, "sleep 60 & sleep 60", allowed_cpus()))
            .await
            .unwrap();
        let (pgid, shim) = (h.pid() as i32, h.shim_pid() as i32);
        eventually("two sleeps", || job_pids(pgid, shim).len() == 3).await;
        victims.extend(
            job_pids(pgid, shim)
                .into_iter()
                .chain([shim])
                .filter_map(|p| Some((p, stat(p)?.starttime))),
        );
    }
    exec.shutdown().await.unwrap();
    let mut ids = vec![next_exit(&mut exits).await, next_exit(&mut exits).await]
        .into_iter()
        .map(|e| {
            assert_eq!(e.outcome, JobOutcome::Cancelled);
            e.id
        })
        .collect::<Vec<_>>();
    ids.sort();
    assert_eq!(ids, ["k1", "k2"]);
    for (pid, start) in victims {
        // The shims are the executor's children, reaped by tokio.
        eventually("every job process and shim gone", || gone(pid, start, true)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shim_killed_outright_loses_the_job_but_leaves_no_orphan() {
    let fx = Fixture::new();
    let exec = fx.executor();
    let mut h = exec
        .spawn(sh("orphan", "sleep 60 & sleep 60", allowed_cpus()))
        .await
        .unwrap();
    let (pgid, shim) = (h.pid() as i32, h.shim_pid() as i32);
    eventually("two sleeps", || job_pids(pgid, shim).len() == 3).await;
    let victims: Vec<(i32, u64)> = job_pids(pgid, shim)
        .into_iter()
        .filter_map(|p| Some((p, stat(p)?.starttime)))
        .collect();
    kill(Pid::from_raw(shim), Signal::SIGKILL).unwrap();
    let exit = wait_exit(&mut h).await;
    assert!(matches!(exit.outcome, JobOutcome::Lost(_)), "{exit:?}");
    for (pid, start) in victims {
        // Re-parented to init, which reaps them in its own time.
        eventually("the job's processes killed", || gone(pid, start, true)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn applies_rlimits() {
    let fx = Fixture::new();
    let exec = fx.executor();
    let job = sh("limits", "exec sleep 30", allowed_cpus())
        .rlimit(RlimitResource::Nofile, 123, 456)
        .rlimit(RlimitResource::Core, 0, 0);
    let mut h = exec.spawn(job).await.unwrap();
    let limits = fs::read_to_string(format!("/proc/{}/limits", h.pid())).unwrap();
    let row = |name: &str| -> Vec<String> {
        let line = limits
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("no {name} in limits"));
        line[name.len()..]
            .split_whitespace()
            .map(str::to_owned)
            .collect()
    };
    assert_eq!(row("Max open files")[..2], ["123", "456"]);
    assert_eq!(row("Max core file size")[..2], ["0", "0"]);
    exec.cancel("limits", Duration::ZERO).unwrap();
    wait_exit(&mut h).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejects_bad_requests_with_typed_errors() {
    let fx = Fixture::new();
    let exec = fx.executor();
    let cpus = allowed_cpus();
    assert!(matches!(
        exec.spawn(sh("../escape", "exit 0", cpus.clone())).await,
        Err(ExecError::InvalidId(_))
    ));
    assert!(matches!(
        exec.spawn(sh("nocpu", "exit 0", vec![])).await,
        Err(ExecError::InvalidCpus { .. })
    ));
    assert!(matches!(
        Executor::new(config(fx.path())),
        Err(ExecError::StateDirLocked(_))
    ));
    assert!(matches!(exec.stop("nope"), Err(ExecError::UnknownJob(_))));

    let mut h = exec
        .spawn(sh("dup", "exec sleep 30", cpus.clone()))
        .await
        .unwrap();
    assert!(matches!(
        exec.spawn(sh("dup", "exit 0", cpus.clone())).await,
        Err(ExecError::AlreadyExists(_))
    ));
    assert!(matches!(
        exec.remove("dup"),
        Err(ExecError::StillRunning(_))
    ));
    assert!(matches!(
        exec.repin("dup", &[u32::MAX]),
        Err(ExecError::InvalidCpus { .. })
    ));
    exec.cancel("dup", Duration::ZERO).unwrap();
    wait_exit(&mut h).await;
    assert!(matches!(exec.stop("dup"), Err(ExecError::NotRunning(_))));
    assert!(matches!(
        exec.repin("dup", &cpus),
        Err(ExecError::NotRunning(_))
    ));
}

/// In CI (the `CI` environment variable is set) a cgroup prerequisite the
/// CI machine provides must be there: its absence fails the test, naming
/// what is missing. Elsewhere the test says what it did not exercise.
fn missing_cgroup_part(what: &str) {
    assert!(
        std::env::var_os("CI").is_none(),
        "CI provides cgroups but {what}"
    );
    eprintln!("cgroup part not exercised: {what}");
}

/// The cgroup v1 hierarchy `controller` is bound to (`/proc/cgroups`), if
/// any: a controller bound to v1 cannot be offered to any cgroup2 directory
/// (a hybrid host, like the CI machines: v1 `cpuset`, `memory`, ... next to
/// a controller-less cgroup2 tree at `/sys/fs/cgroup/unified`).
fn v1_hierarchy(controller: &str) -> Option<u32> {
    fs::read_to_string("/proc/cgroups")
        .ok()?
        .lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            let mut f = l.split_whitespace();
            (f.next()? == controller).then(|| f.next()?.parse().ok())?
        })
        .filter(|&h| h != 0)
}

/// What the agent's cgroup code needs: a cgroup2 hierarchy and, under it,
/// a directory it may create and write (`cgroup.procs`, `cgroup.kill`);
/// `cpuset` and `memory` offered to it for the limits. The first two are
/// required in CI; a controller is required wherever the kernel could
/// offer it to cgroup2 (not bound to a v1 hierarchy).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_cgroup_per_job_where_cgroup_v2_is_writable() {
    let fx = Fixture::new();
    let (a, b) = two_cpus();
    let (Some(mount), Some(own)) = (cgroup::cgroup2_mount(), cgroup::own_cgroup()) else {
        missing_cgroup_part(
            "no cgroup2 hierarchy is mounted (/proc/self/mountinfo) or this process has no cgroup2 path (/proc/self/cgroup)",
        );
        return;
    };
    let root = mount
        .join(own.strip_prefix("/").unwrap_or(&own))
        .join(format!("agent-exec-test-{}", std::process::id()));
    let exec = fx.executor_with(|c| c.cgroup_root = Some(root.clone()));
    let Some(support) = exec.cgroup_support().cloned() else {
        missing_cgroup_part(&format!(
            "{} is not a usable cgroup2 directory (see the warning above: not creatable or cgroup.procs not writable)",
            root.display()
        ));
        return;
    };
    for (controller, enabled) in [("cpuset", support.cpuset), ("memory", support.memory)] {
        if enabled {
            continue;
        }
        match v1_hierarchy(controller) {
            Some(h) => eprintln!(
                "{controller} not exercised: bound to cgroup v1 hierarchy {h} (/proc/cgroups), so no cgroup2 directory can have it"
            ),
            None => missing_cgroup_part(&format!(
                "the {controller} controller is free of cgroup v1 yet not offered to {}: enable it in {}",
                root.display(),
                root.parent()
                    .unwrap_or(&root)
                    .join("cgroup.subtree_control")
                    .display()
            )),
        }
    }
    eprintln!("cgroups: {support:?}");
    let mut h = exec
        // One child leaves the job's process group and session (setsid):
        // only the job's cgroup still knows it belongs to the job.
        .spawn(sh("cg", "sleep 30 & setsid sleep 30 & wait", vec![a]).memory_max(256 << 20))
        .await
        .unwrap();
    let (pgid, shim) = (h.pid() as i32, h.shim_pid() as i32);
    let cg = h.cgroup().expect("the job has a cgroup").to_owned();
    assert_eq!(cg.parent(), Some(root.as_path()), "under the root");
    // Three processes, one of them out of the group: the setsid child is
    // counted from its fork, before it has called setsid(2).
    eventually("three processes in the job's cgroup, one escaped", || {
        fs::read_to_string(cg.join("cgroup.procs")).is_ok_and(|s| {
            let pids: Vec<i32> = s
                .split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect();
            pids.len() == 3
                && pids
                    .iter()
                    .any(|&p| stat(p).is_some_and(|st| st.pgrp != pgid))
        })
    })
    .await;
    let members: BTreeSet<i32> = fs::read_to_string(cg.join("cgroup.procs"))
        .unwrap()
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect();
    let escaped: BTreeSet<i32> = members
        .iter()
        .copied()
        .filter(|&p| stat(p).is_some_and(|s| s.pgrp != pgid))
        .collect();
    assert_eq!(escaped.len(), 1, "the setsid child left the process group");
    assert_eq!(
        members
            .difference(&escaped)
            .copied()
            .collect::<BTreeSet<_>>(),
        job_pids(pgid, shim)
    );
    assert!(
        !members.contains(&shim),
        "the shim stays outside the job's cgroup"
    );
    if support.cpuset {
        assert_eq!(
            fs::read_to_string(cg.join("cpuset.cpus")).unwrap().trim(),
            a.to_string()
        );
    }
    if support.memory {
        assert_eq!(
            fs::read_to_string(cg.join("memory.max")).unwrap().trim(),
            (256u64 << 20).to_string()
        );
    }
    exec.repin("cg", &[b]).unwrap();
    for pid in &members {
        for tid in tids(*pid) {
            assert_eq!(thread_cpus(*pid, tid), Some(b.to_string()));
        }
    }
    if support.cpuset {
        assert_eq!(
            fs::read_to_string(cg.join("cpuset.cpus")).unwrap().trim(),
            b.to_string()
        );
    }
    exec.cancel("cg", Duration::ZERO).unwrap();
    assert_eq!(wait_exit(&mut h).await.outcome, JobOutcome::Cancelled);
    // Killed through the cgroup although no signal to the process group
    // reaches it.
    let escapee = *escaped.first().unwrap();
    eventually("the setsid child killed with its job", || {
        stat(escapee).is_none_or(|s| s.state == 'Z')
    })
    .await;
    assert!(
        empty_or_gone(&cg),
        "the job's cgroup is empty after its exit (kept for the next job) or removed"
    );
    // Killed through `cgroup.kill`, it is never reused: the agent removes
    // it, after the exit is reported (the kernel may answer EBUSY for a
    // moment after the last process is gone, which the agent retries).
    eventually("the killed job's cgroup removed by the agent", || {
        !cg.exists()
    })
    .await;
    drop(exec);
    remove_test_root(&root).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_jobs_without_a_cgroup_when_the_root_is_unusable() {
    let fx = Fixture::new();
    let not_cgroup = tempfile::tempdir().unwrap();
    let exec = fx.executor_with(|c| c.cgroup_root = Some(not_cgroup.path().to_owned()));
    assert!(exec.cgroup_support().is_none());
    let mut h = exec
        .spawn(sh("nocg", "exit 0", allowed_cpus()).memory_max(1 << 30))
        .await
        .expect("a job never fails for lack of cgroups");
    assert!(h.cgroup().is_none());
    assert_eq!(wait_exit(&mut h).await.outcome, JobOutcome::Exited(0));
}

/// A fresh cgroup2 root for one supervisor test (the supervisor takes only
/// jobs with a cgroup), under this process's own cgroup; `None` (said,
/// and a failure in CI) where none can be made.
fn supervisor_cgroup_root(test: &str) -> Option<PathBuf> {
    let (Some(mount), Some(own)) = (cgroup::cgroup2_mount(), cgroup::own_cgroup()) else {
        missing_cgroup_part("no cgroup2 hierarchy, so no supervised jobs");
        return None;
    };
    let root = mount
        .join(own.strip_prefix("/").unwrap_or(&own))
        .join(format!("agent-sup-test-{test}-{}", std::process::id()));
    if cgroup::CgroupSupport::probe(&root).is_err() {
        missing_cgroup_part(&format!("{} is not usable", root.display()));
        return None;
    }
    Some(root)
}

/// `cgroup::remove_tree` takes a whole tree of cgroups away, with a
/// process still running two levels down: the process is killed, every
/// cgroup is gone, and a second call (nothing left) is fine.
#[test]
fn a_cgroup_tree_goes_with_what_still_runs_in_it() {
    use std::os::unix::process::ExitStatusExt;
    let Some(root) = supervisor_cgroup_root("tree") else {
        return;
    };
    let nested = root.join("slot-1").join("inner");
    fs::create_dir_all(&nested).unwrap();
    fs::create_dir(root.join("slot-0")).unwrap();
    // Its own output, so that a failure here does not leave the test
    // binary's pipes held open by a `sleep` for its whole length.
    let mut child = std::process::Command::new("sleep")
        .arg("1000")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let pid = i32::try_from(child.id()).unwrap();
    // Killed on the way out should an assertion fail before the tree's
    // removal did.
    struct Reap(i32);
    impl Drop for Reap {
        fn drop(&mut self) {
            let _ = kill(Pid::from_raw(self.0), Signal::SIGKILL);
        }
    }
    let _reap = Reap(pid);
    fs::write(nested.join("cgroup.procs"), pid.to_string()).unwrap();
    let inside = fs::read_to_string(nested.join("cgroup.procs")).unwrap();
    assert_eq!(inside.trim(), pid.to_string());

    cgroup::remove_tree(&root, Duration::from_secs(10)).unwrap();
    assert!(!root.exists(), "{} is left", root.display());
    let status = child.wait().unwrap();
    assert_eq!(status.signal(), Some(Signal::SIGKILL as i32), "{status:?}");
    cgroup::remove_tree(&root, Duration::from_secs(1)).unwrap();
}

fn empty_or_gone(cgroup: &Path) -> bool {
    fs::read_to_string(cgroup.join("cgroup.procs")).map_or(true, |s| s.trim().is_empty())
}

/// A job's cgroup is taken from the pool when the last job left one: the
/// next job gets it with its own limits (`memory.max` back to `max` after
/// a job that had one) and nothing of the last job in it; a cgroup in
/// which something was killed (`cgroup.kill`: here the first job's
/// leftover `sleep`) is not reused, and the job after it runs (on this
/// machine's kernel a child cloned into a once-killed cgroup is killed at
/// birth).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reused_job_cgroup_has_the_new_jobs_limits_and_nothing_else() {
    let fx = Fixture::new();
    let Some(root) = supervisor_cgroup_root("reuse") else {
        return;
    };
    if !is_root() {
        eprintln!(
            "cgroup reuse not exercised: jobs run as the agent's user, whose cgroups are never reused"
        );
        return;
    }
    let (a, b) = two_cpus();
    let exec = supervised(&fx, &root);
    let support = exec.cgroup_support().cloned().unwrap();
    let mut first = exec
        .spawn(sh("first", "exit 0", vec![a]).memory_max(256 << 20))
        .await
        .unwrap();
    let cg = first.cgroup().unwrap().to_owned();
    assert_eq!(wait_exit(&mut first).await.outcome, JobOutcome::Exited(0));
    exec.ack("first").unwrap();
    let mut second = exec
        .spawn(sh("second", &gated("exit 0"), vec![b]))
        .await
        .unwrap();
    assert_eq!(
        second.cgroup(),
        Some(cg.as_path()),
        "the first job's cgroup, reused"
    );
    // The second job's shell and, at times, the `sleep` its gate loop
    // runs: nothing else (a process of the first job would have another
    // parent). A child gone between the two reads has no status to show.
    let second_pid = second.pid().to_string();
    let procs: Vec<String> = fs::read_to_string(cg.join("cgroup.procs"))
        .unwrap()
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    assert!(
        procs.contains(&second_pid),
        "the second job in its cgroup: {procs:?}"
    );
    for pid in procs.iter().filter(|p| **p != second_pid) {
        if let Some(parent) = proc_status(&format!("/proc/{pid}/status"), "PPid") {
            assert_eq!(parent, second_pid, "the second job alone: {procs:?}");
        }
    }
    if support.memory {
        assert_eq!(
            fs::read_to_string(cg.join("memory.max")).unwrap().trim(),
            "max"
        );
    }
    if support.cpuset {
        assert_eq!(
            fs::read_to_string(cg.join("cpuset.cpus")).unwrap().trim(),
            b.to_string()
        );
    }
    assert_eq!(
        proc_status(
            &format!("/proc/{}/status", second.pid()),
            "Cpus_allowed_list"
        ),
        Some(b.to_string())
    );
    open_gate(second.pid());
    assert_eq!(wait_exit(&mut second).await.outcome, JobOutcome::Exited(0));
    exec.ack("second").unwrap();
    // A leftover killed through the cgroup after the main process.
    let mut third = exec
        .spawn(sh("third", "sleep 30 & exit 0", vec![a]))
        .await
        .unwrap();
    assert_eq!(third.cgroup(), Some(cg.as_path()));
    let exit = wait_exit(&mut third).await;
    assert_eq!(exit.outcome, JobOutcome::Exited(0));
    assert!(exit.cgroup_killed, "{exit:?}");
    exec.ack("third").unwrap();
    let mut fourth = exec.spawn(sh("fourth", "exit 7", vec![a])).await.unwrap();
    assert_ne!(
        fourth.cgroup(),
        Some(cg.as_path()),
        "a killed cgroup is not reused"
    );
    assert_eq!(wait_exit(&mut fourth).await.outcome, JobOutcome::Exited(7));
    exec.shutdown().await.unwrap();
    drop(exec);
    eventually("free and killed cgroups removed", || {
        fs::read_dir(&root).is_ok_and(|d| d.flatten().all(|e| !e.path().is_dir()))
    })
    .await;
    remove_test_root(&root).await;
}

fn supervised(fx: &Fixture, root: &Path) -> Executor {
    let root = root.to_owned();
    fx.executor_with(move |c| {
        c.launcher = Launcher::Supervisor;
        c.cgroup_root = Some(root);
    })
}

/// The supervisor's pid (from a job's `shim` line) and its command line.
fn cmdline(pid: i32) -> Vec<String> {
    fs::read(format!("/proc/{pid}/cmdline"))
        .unwrap_or_default()
        .split(|&b| b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn supervised_jobs_are_one_process_each_under_one_supervisor() {
    let fx = Fixture::new();
    let Some(root) = supervisor_cgroup_root("one") else {
        return;
    };
    let (a, _) = two_cpus();
    let exec = supervised(&fx, &root);
    let mut ok = exec
        .spawn(sh("ok", "echo out; echo err >&2; exit 0", vec![a]))
        .await
        .unwrap();
    let mut three = exec.spawn(sh("three", "exit 3", vec![a])).await.unwrap();
    let mut killed = exec
        .spawn(sh("killed", "kill -9 $$", allowed_cpus()))
        .await
        .unwrap();
    let mut gated_job = exec
        .spawn(sh("pinned", &gated("exit 0"), vec![a]))
        .await
        .unwrap();
    let sup = ok.shim_pid() as i32;
    for h in [&three, &killed, &gated_job] {
        assert_eq!(h.shim_pid() as i32, sup, "one supervisor for every job");
    }
    let args = cmdline(sup);
    assert_eq!(args.get(1).map(String::as_str), Some("shim"));
    assert!(args.iter().any(|a| a == "--state-dir"), "{args:?}");
    // The job itself is the supervisor's child: no shim in between.
    let pid = gated_job.pid() as i32;
    let st = stat(pid).unwrap();
    assert_eq!(st.ppid, sup, "the job's parent is the supervisor");
    assert_eq!(
        (st.pgrp, st.session),
        (pid, pid),
        "its own session and group"
    );
    assert_eq!(
        proc_status(&format!("/proc/{pid}/status"), "Cpus_allowed_list"),
        Some(a.to_string()),
        "pinned between fork and exec"
    );
    let cg = gated_job.cgroup().unwrap().to_owned();
    assert!(
        fs::read_to_string(cg.join("cgroup.procs"))
            .unwrap()
            .split_whitespace()
            .any(|p| p == pid.to_string()),
        "in its cgroup"
    );
    assert_eq!(wait_exit(&mut ok).await.outcome, JobOutcome::Exited(0));
    assert_eq!(fs::read_to_string(ok.stdout_path()).unwrap(), "out\n");
    assert_eq!(fs::read_to_string(ok.stderr_path()).unwrap(), "err\n");
    assert_eq!(wait_exit(&mut three).await.outcome, JobOutcome::Exited(3));
    assert_eq!(
        wait_exit(&mut killed).await.outcome,
        JobOutcome::Signaled(9)
    );
    open_gate(pid as u32);
    assert_eq!(
        wait_exit(&mut gated_job).await.outcome,
        JobOutcome::Exited(0)
    );
    assert!(
        empty_or_gone(&cg),
        "the job's cgroup is empty after its exit (kept for the next job) or removed"
    );
    let err = exec
        .spawn(JobExec::new("nope", "/nonexistent/cmd", vec![a]))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, ExecError::StartFailed { reason, .. } if reason.contains("exec")),
        "{err}"
    );
    // A job runs at most once: a second start of it is refused.
    use std::io::{BufRead, BufReader, Write};
    let mut conn =
        std::os::unix::net::UnixStream::connect(fx.path().join("supervisor.sock")).unwrap();
    conn.write_all(b"start three\n").unwrap();
    let mut lines = BufReader::new(conn).lines();
    assert_eq!(lines.next().unwrap().unwrap(), format!("hello {sup}"));
    let answer = lines.next().unwrap().unwrap();
    assert!(answer.starts_with("err three "), "{answer}");
    let mut after = exec.spawn(sh("after", "exit 4", vec![a])).await.unwrap();
    assert_eq!(after.shim_pid() as i32, sup);
    let delivered = wait_exit(&mut after).await;
    assert_eq!(delivered.outcome, JobOutcome::Exited(4));
    // Lines go to every connection: this one sees the job's end too, as
    // `exit ID JSON`, the exit the executor delivered (read from the line,
    // not the record).
    let told = tokio::task::spawn_blocking(move || {
        lines
            .map_while(Result::ok)
            .find_map(|l| l.strip_prefix("exit after").map(|r| r.trim().to_owned()))
    })
    .await
    .unwrap()
    .expect("an exit line for the job");
    let told: JobExit = serde_json::from_str(&told).unwrap();
    assert_eq!(told, delivered);
    drop(exec);
    // No job and no executor: the supervisor exits.
    eventually("the idle supervisor exits", || {
        stat(sup).is_none_or(|s| s.state == 'Z')
    })
    .await;
    remove_test_root(&root).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn supervised_cancel_and_timeout_reach_escapees_through_the_cgroup() {
    let fx = Fixture::new();
    let Some(root) = supervisor_cgroup_root("cancel") else {
        return;
    };
    let exec = supervised(&fx, &root);
    let script = r#"trap "" TERM; (sleep 300 &); (setsid sleep 301 &); sleep 60"#;
    let mut h = exec
        .spawn(sh("cancel", script, allowed_cpus()))
        .await
        .unwrap();
    let cg = h.cgroup().unwrap().to_owned();
    let members = || -> Vec<i32> {
        fs::read_to_string(cg.join("cgroup.procs"))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect()
    };
    eventually(
        "sh and three sleeps in the cgroup, one out of the group",
        || {
            let m = members();
            m.len() == 4
                && m.iter()
                    .any(|&p| stat(p).is_some_and(|s| s.pgrp != h.pid() as i32))
        },
    )
    .await;
    let victims: Vec<(i32, u64)> = members()
        .into_iter()
        .filter_map(|p| Some((p, stat(p)?.starttime)))
        .collect();
    let grace = Duration::from_millis(1000);
    let asked = Instant::now();
    exec.cancel("cancel", grace).unwrap();
    let exit = wait_exit(&mut h).await;
    assert!(asked.elapsed() >= grace, "killed before the grace period");
    assert_eq!(
        (exit.outcome, exit.signal),
        (JobOutcome::Cancelled, Some(9))
    );
    for (pid, start) in victims {
        eventually("every process of the job gone", || gone(pid, start, true)).await;
    }
    let mut t = exec
        .spawn(
            sh("slow", "sleep 60", allowed_cpus())
                .timeout(Duration::from_millis(300), Duration::from_millis(300)),
        )
        .await
        .unwrap();
    assert_eq!(wait_exit(&mut t).await.outcome, JobOutcome::TimedOut);
    drop(exec);
    eventually("the job cgroups removed", || {
        fs::read_dir(&root).is_ok_and(|d| d.flatten().all(|e| !e.path().is_dir()))
    })
    .await;
    remove_test_root(&root).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn supervised_jobs_outlive_the_executor_and_are_readopted() {
    let fx = Fixture::new();
    let Some(root) = supervisor_cgroup_root("readopt") else {
        return;
    };
    let (a, b) = two_cpus();
    let (pid, quick_pid, sup) = {
        let exec = supervised(&fx, &root);
        let h = exec
            .spawn(sh("stays", &gated("exit 5"), vec![a]))
            .await
            .unwrap();
        let q = exec
            .spawn(sh("quick", &gated("exit 7"), vec![a]))
            .await
            .unwrap();
        (h.pid(), q.pid(), h.shim_pid() as i32)
        // dropped without shutdown: an agent crash
    };
    // With no executor connected, one job ends: the supervisor records it.
    open_gate(quick_pid);
    let quick_dir = fx.path().join("jobs/quick");
    eventually("the exit recorded by the supervisor alone", || {
        record_line(&quick_dir, "exit").is_some()
    })
    .await;
    assert!(
        stat(sup).is_some_and(|s| s.state != 'Z'),
        "the supervisor outlives the executor"
    );

    let exec = supervised(&fx, &root);
    let mut exits = exec.take_exits().unwrap();
    let report = exec.readopt().await.unwrap();
    assert_eq!(report.reattached, vec!["stays".to_owned()]);
    assert_eq!(report.exited, vec!["quick".to_owned()]);
    assert_eq!(next_exit(&mut exits).await.outcome, JobOutcome::Exited(7));
    exec.ack("quick").unwrap();
    exec.stop("stays").unwrap();
    eventually("stopped", || group_stopped(pid as i32)).await;
    exec.cont("stays").unwrap();
    exec.repin("stays", &[b]).unwrap();
    assert_eq!(
        proc_status(&format!("/proc/{pid}/status"), "Cpus_allowed_list"),
        Some(b.to_string())
    );
    // A new job goes to the same supervisor.
    let mut more = exec.spawn(sh("more", "exit 0", vec![a])).await.unwrap();
    assert_eq!(more.shim_pid() as i32, sup);
    assert_eq!(wait_exit(&mut more).await.outcome, JobOutcome::Exited(0));
    open_gate(pid);
    let exit = loop {
        let e = next_exit(&mut exits).await;
        if e.id == "stays" {
            break e;
        }
    };
    assert_eq!(exit.outcome, JobOutcome::Exited(5));
    drop(exec);
    eventually("the job cgroups removed", || {
        fs::read_dir(&root).is_ok_and(|d| d.flatten().all(|e| !e.path().is_dir()))
    })
    .await;
    remove_test_root(&root).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_supervisor_killed_outright_loses_its_jobs_but_leaves_no_orphan() {
    let fx = Fixture::new();
    let Some(root) = supervisor_cgroup_root("killed") else {
        return;
    };
    let exec = supervised(&fx, &root);
    let mut h = exec
        .spawn(sh(
            "orphan",
            "sleep 60 & setsid sleep 60 & sleep 60",
            allowed_cpus(),
        ))
        .await
        .unwrap();
    let cg = h.cgroup().unwrap().to_owned();
    let sup = h.shim_pid() as i32;
    eventually("four processes in the cgroup", || {
        fs::read_to_string(cg.join("cgroup.procs")).is_ok_and(|s| s.split_whitespace().count() == 4)
    })
    .await;
    let victims: Vec<(i32, u64)> = fs::read_to_string(cg.join("cgroup.procs"))
        .unwrap()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .filter_map(|p| Some((p, stat(p)?.starttime)))
        .collect();
    kill(Pid::from_raw(sup), Signal::SIGKILL).unwrap();
    let exit = wait_exit(&mut h).await;
    assert!(matches!(exit.outcome, JobOutcome::Lost(_)), "{exit:?}");
    for (pid, start) in victims {
        eventually("the job's processes killed", || gone(pid, start, true)).await;
    }
    // The next job starts a new supervisor.
    let mut next = exec
        .spawn(sh("next", "exit 0", allowed_cpus()))
        .await
        .unwrap();
    assert_ne!(next.shim_pid() as i32, sup);
    assert_eq!(wait_exit(&mut next).await.outcome, JobOutcome::Exited(0));
    drop(exec);
    eventually("the job cgroups removed", || {
        fs::read_dir(&root).is_ok_and(|d| d.flatten().all(|e| !e.path().is_dir()))
    })
    .await;
    remove_test_root(&root).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_supervisor_launcher_makes_a_cgroup_root_per_state_dir() {
    let fx = Fixture::new();
    if supervisor_cgroup_root("probe").is_some_and(|r| fs::remove_dir(r).is_ok()) {
        let exec = fx.executor_with(|c| {
            c.launcher = Launcher::Supervisor;
            c.shutdown = ShutdownMode::KillJobs;
        });
        let state = fx.path().canonicalize().unwrap();
        let root = cgroup::state_dir_root(&state).unwrap();
        let support = exec.cgroup_support().expect("a cgroup root of its own");
        assert_eq!(support.root, root);
        let other = tempfile::tempdir().unwrap();
        assert_ne!(cgroup::state_dir_root(other.path()), Some(root.clone()));
        let mut h = exec
            .spawn(sh("auto", "exit 0", allowed_cpus()))
            .await
            .unwrap();
        assert_eq!(h.cgroup().and_then(Path::parent), Some(root.as_path()));
        assert_eq!(wait_exit(&mut h).await.outcome, JobOutcome::Exited(0));
        exec.shutdown().await.unwrap();
        assert!(!root.exists(), "removed on shutdown once empty");
    }
}

/// A job's cgroup denies it the device nodes in its `deny_devices` (the
/// GPUs it does not hold) through a BPF device program: opening
/// `/dev/null` (c 1:3) fails with EPERM inside the job while `/dev/zero`
/// (c 1:5) opens, and a job without rules opens both. Required in CI
/// (root, cgroup2, BPF); said and skipped elsewhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jobs_cgroup_denies_it_the_devices_it_does_not_hold() {
    let fx = Fixture::new();
    let Some(root) = supervisor_cgroup_root("devices") else {
        return;
    };
    let exec = fx.executor_with({
        let root = root.clone();
        move |c| c.cgroup_root = Some(root)
    });
    let support = exec.cgroup_support().cloned().expect("probed above");
    if !support.devices {
        missing_cgroup_part("BPF device programs cannot be loaded (see the warning above)");
        return;
    }
    let (a, _) = two_cpus();
    let script = "for d in /dev/null /dev/zero; do \
                  if (exec 3<$d); then echo \"$d open\"; \
                  else echo \"$d denied\"; fi; done";
    let mut confined = sh("dev-confined", script, vec![a]);
    confined.deny_devices = DenyList::new(vec![DeviceNode::char(1, 3)]);
    let mut free = sh("dev-free", script, vec![a]);
    free.deny_devices = DenyList::default();
    for (job, want) in [
        (confined, "/dev/null denied\n/dev/zero open\n"),
        (free, "/dev/null open\n/dev/zero open\n"),
    ] {
        let id = job.id.clone();
        let mut h = exec.spawn(job).await.unwrap();
        assert!(h.cgroup().is_some(), "{id} has a cgroup");
        assert_eq!(wait_exit(&mut h).await.outcome, JobOutcome::Exited(0));
        assert_eq!(fs::read_to_string(h.stdout_path()).unwrap(), want, "{id}");
    }
    drop(exec);
    remove_test_root(&root).await;
}
