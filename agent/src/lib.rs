//! The node agent: hardware topology discovery, process execution, and the
//! local scheduler on the `sched` engine.
//!
//! Module ownership: [`topology`] is the only module that reads `/sys`;
//! [`k8s`] is the only one that talks to the Kubernetes API server;
//! [`gpus`] hands the machine's GPUs to jobs.

pub mod exec;
pub mod gpus;
pub mod k8s;
pub mod local;
pub mod metrics;
pub mod runtime;
pub mod telemetry;
pub mod topology;
