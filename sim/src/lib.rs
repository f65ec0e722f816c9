//! `sim`: a discrete-event simulator of the dispatcher at cluster scale.
//!
//! It drives the *real* placement code — the dispatcher's
//! [`dispatcher::cluster::Cluster`] (node-level `sched` engine, job
//! lifecycle, CPU model) and, with CPU-level mode, one
//! [`agent::local::LocalScheduler`] per node — against simple baseline
//! policies implemented here (random, Kubernetes-like least-loaded,
//! power-of-d choices, Sparrow batch sampling), on synthetic workloads and
//! real SWF traces, and reports utilization, makespan, response times,
//! slowdowns, steals, packing and scheduler cost per policy.
//!
//! The event loop is the engine harness's ([`sched::harness::EventQueue`]
//! and [`sched::harness::drive`]), the PRNG its SplitMix64
//! ([`sched::harness::Rng`]). Nothing here re-implements a mechanism of the
//! engine: "ours" is the dispatcher itself.
//!
//! Map (each module says what it owns):
//! - [`error`]: typed errors.
//! - [`dist`]: arrival processes, duration and size distributions.
//! - [`workload`]: the job model and the synthetic generator.
//! - [`swf`]: the Standard Workload Format reader (plain or gzip).
//! - [`alibaba`]: Alibaba's GPU cluster trace (node and pod lists).
//! - [`gpufrag`]: GPU allocation and fragmentation over a run.
//! - [`gangmix`]: gangs in a synthetic workload.
//! - [`layout`]: the simulated cluster (zones, racks, per-node topologies).
//! - [`policy`]: the `Placer` interface, the baselines and "ours".
//! - [`cpu`]: CPU-level mode (each node's agent local scheduler).
//! - [`engine`]: the simulation of one policy on one workload.
//! - [`metrics`]: per-policy results from the job records.
//! - [`report`]: tables, CSV and JSON.
//! - [`svg`]: hand-written SVG plots.
//! - [`queueing`]: the validation mode against queueing closed forms.
//! - [`hackbench`]: seed 000's message groups at CPU level.

pub mod alibaba;
pub mod cpu;
pub mod dist;
pub mod engine;
pub mod error;
pub mod gangmix;
pub mod gpufrag;
pub mod hackbench;
pub mod jobs_csv;
pub mod layout;
pub mod metrics;
pub mod policy;
pub mod queueing;
pub mod report;
pub mod saturation;
pub mod svg;
pub mod swf;
pub mod workload;

pub use error::{Result, SimError};

/// Microseconds per second: simulated time is kept in microseconds.
pub const US_PER_S: u64 = 1_000_000;
