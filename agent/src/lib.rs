//! The node agent: hardware topology discovery, process execution, and the
//! local scheduler on the `sched` engine.
//!
//! Module ownership: [`topology`] is the only module that reads `/sys`.

pub mod exec;
pub mod local;
pub mod metrics;
pub mod runtime;
pub mod telemetry;
pub mod topology;
