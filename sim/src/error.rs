//! Typed errors of the simulator library. The binary wraps them in
//! `anyhow` with context; nothing read from a file or the command line
//! panics.

use thiserror::Error;

/// What can go wrong while building or running a simulation.
#[derive(Debug, Error)]
pub enum SimError {
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A line of an SWF trace is malformed.
    #[error("{path}:{line}: {message}")]
    Swf {
        /// The trace.
        path: String,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// A field of a CSV trace (Alibaba's GPU trace) is malformed.
    #[error("{path}:{line}: column {column}: {message}")]
    Csv {
        /// The file.
        path: String,
        /// 1-based line number (1 = the header).
        line: usize,
        /// The column's name.
        column: String,
        /// What is wrong.
        message: String,
    },
    /// A specification string (policy, distribution, cluster) is malformed.
    #[error("bad {what} {spec:?}: {reason}")]
    BadSpec {
        /// What kind of spec.
        what: &'static str,
        /// The text given.
        spec: String,
        /// Why it was refused.
        reason: String,
    },
    /// A topology spec was refused by the engine.
    #[error(transparent)]
    Topology(#[from] sched::topology::TopologyError),
    /// The engine harness refused a run (hackbench).
    #[error(transparent)]
    Harness(#[from] sched::harness::HarnessError),
    /// The dispatcher refused a call.
    #[error("dispatcher refused {what}: {message}")]
    Dispatcher {
        /// The call.
        what: &'static str,
        /// Its status message.
        message: String,
    },
    /// The workload is inconsistent (a job released by a later job, ...).
    #[error("workload: {0}")]
    Workload(String),
}

/// Results of the library.
pub type Result<T> = std::result::Result<T, SimError>;

/// A [`SimError::BadSpec`].
pub(crate) fn bad_spec(what: &'static str, spec: &str, reason: impl Into<String>) -> SimError {
    SimError::BadSpec {
        what,
        spec: spec.to_string(),
        reason: reason.into(),
    }
}
