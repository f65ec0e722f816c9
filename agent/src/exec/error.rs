//! The executor's error type. Every variant names what failed: the file and
//! the operation for I/O, the system call and its target for syscalls, the
//! job for everything job-specific.

use std::io;
use std::path::PathBuf;

use nix::errno::Errno;
use thiserror::Error;

/// Why an executor operation failed.
#[derive(Debug, Error)]
pub enum ExecError {
    /// A file or directory operation failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done ("create", "read", "rename", ...).
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A system call failed.
    #[error("{call} on {target}: {source}")]
    Sys {
        /// The system call, e.g. `sched_setaffinity` or `kill(SIGSTOP)`.
        call: &'static str,
        /// What it was applied to, e.g. `tid 1234 of job j1`.
        target: String,
        /// The errno.
        #[source]
        source: Errno,
    },
    /// A JSON file of a job directory could not be parsed or written.
    #[error("{path}: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The serde error.
        #[source]
        source: serde_json::Error,
    },
    /// A job id that cannot name a directory.
    #[error(
        "invalid job id {0:?}: use 1-128 characters from [A-Za-z0-9._-], not starting with '.'"
    )]
    InvalidId(String),
    /// A job description the executor cannot run.
    #[error("job {id}: {reason}")]
    InvalidSpec {
        /// The job.
        id: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A CPU list that cannot be used for pinning.
    #[error("invalid CPU list {cpus:?}: {reason}")]
    InvalidCpus {
        /// The list as given.
        cpus: Vec<u32>,
        /// What is wrong with it.
        reason: String,
    },
    /// A job with this id is tracked or has a directory in the state dir.
    #[error("job {0} already exists (its directory is still in the state dir: remove() it first)")]
    AlreadyExists(String),
    /// No job with this id is known.
    #[error("unknown job {0}")]
    UnknownJob(String),
    /// The job has finished (or is finishing): nothing left to signal.
    #[error("job {0} is not running")]
    NotRunning(String),
    /// The job has not finished yet: its directory cannot be removed.
    #[error("job {0} is still running")]
    StillRunning(String),
    /// The agent runs as root and neither an unprivileged `run_as` nor
    /// `allow_root` is configured.
    #[error(
        "refusing to run job {0} as root: configure run_as with an unprivileged uid/gid, or set allow_root"
    )]
    RefuseRoot(String),
    /// The shim reported that the job could not be started.
    #[error("job {id}: could not start: {reason}")]
    StartFailed {
        /// The job.
        id: String,
        /// The shim's explanation (failed step and errno).
        reason: String,
    },
    /// The shim did not report within the configured start timeout.
    #[error("job {id}: the shim did not report within {secs:.1}s")]
    ShimTimeout {
        /// The job.
        id: String,
        /// The timeout.
        secs: f64,
    },
    /// Another executor holds the state directory's lock.
    #[error("state directory {0} is locked by another executor")]
    StateDirLocked(PathBuf),
    /// `spawn` after `shutdown`.
    #[error("the executor is shut down")]
    ShutDown,
    /// The executor was dropped before the job's exit was observed.
    #[error("the executor was dropped before job {0} exited")]
    ExecutorGone(String),
}

/// Shorthand for the executor's results.
pub type Result<T, E = ExecError> = std::result::Result<T, E>;

impl ExecError {
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        ExecError::Io {
            op,
            path: path.into(),
            source,
        }
    }

    pub(crate) fn sys(call: &'static str, target: impl Into<String>, source: Errno) -> Self {
        ExecError::Sys {
            call,
            target: target.into(),
            source,
        }
    }
}
