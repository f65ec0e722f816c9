//! What a job is and how it ended: [`JobExec`] (the request the local
//! scheduler passes to [`Executor::spawn`](super::Executor::spawn)),
//! [`JobExit`] / [`JobOutcome`] (the result), and the on-disk forms the
//! agent and the shim exchange through the job directory (the `spec` line,
//! the `exit` line of `record`, `cancel`). Validation of outside input lives here too.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nix::sys::resource::Resource;
use serde::{Deserialize, Serialize};

use super::devices::DenyList;
use super::error::{ExecError, Result};

/// Grace period between SIGTERM and SIGKILL when a job times out (and when
/// the shim itself receives SIGTERM), unless the job sets its own.
pub const DEFAULT_KILL_GRACE: Duration = Duration::from_secs(10);

/// The `PATH` given to a job whose environment does not set one (the job
/// otherwise starts from an empty environment).
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// `RLIM_INFINITY`: no limit.
pub const RLIM_INFINITY: u64 = u64::MAX;

/// One job to run: a command with its arguments, environment, working
/// directory, the CPUs the scheduler chose and the limits to apply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobExec {
    /// Unique id; names the job directory (and cgroup), so 1-128
    /// characters from `[A-Za-z0-9._-]`, not starting with a dot.
    pub id: String,
    /// Program to run: a path, or a name looked up in the job's `PATH`.
    pub command: String,
    /// Arguments (without argv\[0\]).
    pub args: Vec<String>,
    /// The job's whole environment: it starts empty, then gets these
    /// variables, then [`DEFAULT_PATH`] if `PATH` is not among them.
    pub env: BTreeMap<String, String>,
    /// Working directory; `/` when unset.
    pub cwd: Option<PathBuf>,
    /// CPUs to pin the job to (non-empty).
    pub cpus: Vec<u32>,
    /// Resource limits set in the job's process before exec.
    pub rlimits: Vec<Rlimit>,
    /// cgroup v2 `memory.max` in bytes, where the memory controller is
    /// available (otherwise a warning is logged and no limit applies).
    pub memory_max: Option<u64>,
    /// Wall-clock limit from the start (stopped time counts): SIGTERM, then
    /// SIGKILL after `kill_grace`; the outcome is [`JobOutcome::TimedOut`].
    pub timeout: Option<Duration>,
    /// Grace between SIGTERM and SIGKILL on timeout.
    pub kill_grace: Duration,
    /// Who submitted it (the dispatcher's `Job.owner`; empty when
    /// unknown): picks the uid it runs as through the user map.
    #[serde(default)]
    pub owner: String,
    /// Device nodes the job may not open (the GPUs it does not hold):
    /// enforced through its cgroup where it has one and BPF device
    /// programs can be loaded (see `devices.rs`), else a warning.
    #[serde(default)]
    pub deny_devices: DenyList,
}

impl JobExec {
    /// A job running `command` on `cpus`, with no arguments, no
    /// environment, cwd `/`, no limits and no timeout.
    pub fn new(id: impl Into<String>, command: impl Into<String>, cpus: Vec<u32>) -> Self {
        JobExec {
            id: id.into(),
            command: command.into(),
            args: Vec::new(),
            env: BTreeMap::new(),
            cwd: None,
            cpus,
            rlimits: Vec::new(),
            memory_max: None,
            timeout: None,
            kill_grace: DEFAULT_KILL_GRACE,
            owner: String::new(),
            deny_devices: DenyList::default(),
        }
    }

    /// Append arguments.
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Set one environment variable.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.insert(key.into(), value.into());
        self
    }

    /// Set the working directory.
    pub fn cwd(mut self, cwd: impl Into<PathBuf>) -> Self {
        self.cwd = Some(cwd.into());
        self
    }

    /// Add a resource limit.
    pub fn rlimit(mut self, resource: RlimitResource, soft: u64, hard: u64) -> Self {
        self.rlimits.push(Rlimit {
            resource,
            soft,
            hard,
        });
        self
    }

    /// Set `memory.max` (bytes).
    pub fn memory_max(mut self, bytes: u64) -> Self {
        self.memory_max = Some(bytes);
        self
    }

    /// Set the timeout and the grace between SIGTERM and SIGKILL.
    pub fn timeout(mut self, timeout: Duration, kill_grace: Duration) -> Self {
        self.timeout = Some(timeout);
        self.kill_grace = kill_grace;
        self
    }

    /// Check everything that comes from outside before anything is created.
    pub(crate) fn validate(&self) -> Result<()> {
        validate_id(&self.id)?;
        let bad = |reason: String| ExecError::InvalidSpec {
            id: self.id.clone(),
            reason,
        };
        if self.command.is_empty() {
            return Err(bad("empty command".into()));
        }
        let nul = |s: &str| s.contains('\0');
        if nul(&self.command) || self.args.iter().any(|a| nul(a)) {
            return Err(bad("command or argument contains a NUL byte".into()));
        }
        for (k, v) in &self.env {
            if k.is_empty() || k.contains('=') || nul(k) || nul(v) {
                return Err(bad(format!(
                    "environment variable {k:?}: names must be non-empty without '=' or NUL, values without NUL"
                )));
            }
        }
        if let Some(cwd) = &self.cwd
            && !cwd.is_absolute()
        {
            return Err(bad(format!("cwd {} is not absolute", cwd.display())));
        }
        validate_cpus(&self.cpus)?;
        for limit in &self.rlimits {
            if limit.soft > limit.hard {
                return Err(bad(format!(
                    "rlimit {:?}: soft {} above hard {}",
                    limit.resource, limit.soft, limit.hard
                )));
            }
        }
        if self.memory_max == Some(0) {
            return Err(bad("memory_max of 0 bytes".into()));
        }
        Ok(())
    }
}

/// Check a job id: it becomes a directory and a cgroup name.
pub(crate) fn validate_id(id: &str) -> Result<()> {
    let ok = !id.is_empty()
        && id.len() <= 128
        && !id.starts_with('.')
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(ExecError::InvalidId(id.to_owned()))
    }
}

/// Check a CPU list for pinning: non-empty, every id representable in a
/// `cpu_set_t`.
pub(crate) fn validate_cpus(cpus: &[u32]) -> Result<()> {
    let max = nix::sched::CpuSet::count();
    if cpus.is_empty() {
        return Err(ExecError::InvalidCpus {
            cpus: cpus.to_vec(),
            reason: "empty".into(),
        });
    }
    if let Some(cpu) = cpus.iter().find(|&&c| c as usize >= max) {
        return Err(ExecError::InvalidCpus {
            cpus: cpus.to_vec(),
            reason: format!("CPU {cpu} is beyond the {max} CPUs sched_setaffinity can name"),
        });
    }
    Ok(())
}

/// A resource limit (`setrlimit`), applied in the job's process before exec.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rlimit {
    /// Which resource.
    pub resource: RlimitResource,
    /// Soft limit ([`RLIM_INFINITY`] for none).
    pub soft: u64,
    /// Hard limit ([`RLIM_INFINITY`] for none).
    pub hard: u64,
}

/// The resources a job may be limited on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RlimitResource {
    /// `RLIMIT_AS`: address space bytes.
    As,
    /// `RLIMIT_CORE`: core file bytes.
    Core,
    /// `RLIMIT_CPU`: CPU seconds.
    Cpu,
    /// `RLIMIT_DATA`: data segment bytes.
    Data,
    /// `RLIMIT_FSIZE`: file size bytes.
    Fsize,
    /// `RLIMIT_MEMLOCK`: locked memory bytes.
    Memlock,
    /// `RLIMIT_NOFILE`: open file descriptors.
    Nofile,
    /// `RLIMIT_NPROC`: processes of the user.
    Nproc,
    /// `RLIMIT_STACK`: stack bytes.
    Stack,
}

impl RlimitResource {
    pub(crate) fn to_nix(self) -> Resource {
        match self {
            RlimitResource::As => Resource::RLIMIT_AS,
            RlimitResource::Core => Resource::RLIMIT_CORE,
            RlimitResource::Cpu => Resource::RLIMIT_CPU,
            RlimitResource::Data => Resource::RLIMIT_DATA,
            RlimitResource::Fsize => Resource::RLIMIT_FSIZE,
            RlimitResource::Memlock => Resource::RLIMIT_MEMLOCK,
            RlimitResource::Nofile => Resource::RLIMIT_NOFILE,
            RlimitResource::Nproc => Resource::RLIMIT_NPROC,
            RlimitResource::Stack => Resource::RLIMIT_STACK,
        }
    }
}

/// How a job ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobOutcome {
    /// The job's main process exited with this code.
    Exited(i32),
    /// The job's main process was killed by this signal (not by us).
    Signaled(i32),
    /// The job ran past its timeout and was terminated.
    TimedOut,
    /// The job was cancelled (`cancel`, executor shutdown with
    /// `KillJobs`, or SIGTERM to its shim).
    Cancelled,
    /// The shim could not start the command (reported here only when no
    /// agent was there to receive the error from `spawn`).
    StartFailed(String),
    /// The shim disappeared without writing a status (killed with SIGKILL,
    /// for instance); the job's processes were killed.
    Lost(String),
}

/// The exit of a job, as appended by its shim to `record` and
/// delivered on the executor's exit channel.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobExit {
    /// The job.
    pub id: String,
    /// How it ended.
    pub outcome: JobOutcome,
    /// Exit code of the main process, if it exited.
    pub exit_code: Option<i32>,
    /// Signal that killed the main process, if one did (including our
    /// SIGTERM/SIGKILL on cancel and timeout).
    pub signal: Option<i32>,
    /// Start, in milliseconds since the Unix epoch.
    pub started_at_ms: u64,
    /// End (every process of the job reaped), in ms since the Unix epoch.
    pub ended_at_ms: u64,
    /// Bytes written to `stdout` (at most the cap).
    pub stdout_bytes: u64,
    /// Bytes written to `stderr` (at most the cap).
    pub stderr_bytes: u64,
    /// The job wrote more than the cap to stdout; the rest was dropped.
    pub stdout_truncated: bool,
    /// The job wrote more than the cap to stderr; the rest was dropped.
    pub stderr_truncated: bool,
    /// User CPU time of all the job's processes (reaped), ms.
    pub user_cpu_ms: u64,
    /// System CPU time of all the job's processes (reaped), ms.
    pub sys_cpu_ms: u64,
    /// Largest resident set of any of the job's processes, KiB.
    pub max_rss_kib: u64,
    /// Something of the job was killed through its cgroup
    /// (`cgroup.kill`). Its cgroup is then never reused for another job:
    /// on some kernels (6.18 here) every later child cloned into a
    /// cgroup that was once killed is killed at birth.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cgroup_killed: bool,
}

impl JobExit {
    /// An exit with only an id and an outcome (for jobs that never ran or
    /// whose shim vanished).
    pub(crate) fn bare(id: &str, outcome: JobOutcome) -> Self {
        let now = now_ms();
        JobExit {
            id: id.to_owned(),
            outcome,
            exit_code: None,
            signal: None,
            started_at_ms: now,
            ended_at_ms: now,
            stdout_bytes: 0,
            stderr_bytes: 0,
            stdout_truncated: false,
            stderr_truncated: false,
            user_cpu_ms: 0,
            sys_cpu_ms: 0,
            max_rss_kib: 0,
            cgroup_killed: false,
        }
    }
}

/// The user and group a job runs as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct RunAs {
    pub uid: u32,
    pub gid: u32,
}

/// The `spec` line of `record`: everything the shim needs, resolved by the agent.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ShimSpec {
    /// Format version of this file.
    pub version: u32,
    pub job: JobExec,
    /// `None`: keep the shim's identity (agent not root, or `allow_root`).
    pub run_as: Option<RunAs>,
    pub log_cap_bytes: u64,
    /// The job's cgroup, created by the agent, if any.
    pub cgroup: Option<PathBuf>,
    /// The agent's lease file ([`super::lease`]): the shim stops the job
    /// once the lease it holds has run out.
    #[serde(default)]
    pub lease: Option<PathBuf>,
    /// Started by the agent's supervisor ([`super::supervisor`]), one
    /// process for many jobs, rather than by a shim of its own; such a job
    /// always has a cgroup, which is what tells its processes apart.
    #[serde(default)]
    pub supervised: bool,
}

impl ShimSpec {
    /// The lease the job runs under, if any.
    pub fn job_lease(&self) -> Option<super::lease::LeaseFile> {
        self.lease.as_ref().map(super::lease::LeaseFile::new)
    }
}

pub(crate) const SPEC_VERSION: u32 = 1;

/// `cancel`: written by the agent before it sends SIGUSR1 to the shim.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub(crate) struct CancelRequest {
    pub grace_ms: u64,
}

/// Milliseconds since the Unix epoch (0 if the clock is before it).
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids() {
        for ok in ["a", "job-1", "A.b_c-9", &"x".repeat(128)] {
            assert!(validate_id(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            ".",
            "..",
            ".hidden",
            "a/b",
            "a b",
            "é",
            &"x".repeat(129),
        ] {
            assert!(validate_id(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn specs() {
        let job = JobExec::new("j", "sleep", vec![0]).args(["1"]);
        assert!(job.validate().is_ok());
        assert!(JobExec::new("j", "", vec![0]).validate().is_err());
        assert!(JobExec::new("j", "sleep", vec![]).validate().is_err());
        assert!(
            JobExec::new("j", "sleep", vec![1 << 20])
                .validate()
                .is_err()
        );
        assert!(
            JobExec::new("j", "sleep", vec![0])
                .env("A=B", "c")
                .validate()
                .is_err()
        );
        assert!(
            JobExec::new("j", "sleep", vec![0])
                .cwd("relative")
                .validate()
                .is_err()
        );
        assert!(
            JobExec::new("j", "sleep", vec![0])
                .rlimit(RlimitResource::Nofile, 10, 5)
                .validate()
                .is_err()
        );
    }

    #[test]
    fn outcome_json_round_trip() {
        for outcome in [
            JobOutcome::Exited(3),
            JobOutcome::Signaled(9),
            JobOutcome::TimedOut,
            JobOutcome::Cancelled,
            JobOutcome::Lost("gone".into()),
        ] {
            let exit = JobExit::bare("j", outcome);
            let text = serde_json::to_string(&exit).unwrap();
            assert_eq!(serde_json::from_str::<JobExit>(&text).unwrap(), exit);
        }
    }
}
