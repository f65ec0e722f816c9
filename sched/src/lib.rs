//! `sched`: the scheduling engine, one implementation of the Linux core
//! scheduler's mechanisms over a generic topology, used by the agent (leaf =
//! CPU, capacity 1), the dispatcher (leaf = node, capacity = its CPUs) and
//! the simulator alike.
//!
//! Invariant: the engine does no I/O, reads no clock and spawns no thread.
//! Callers pass time in; results come back as values and [`SchedEvent`]s.
//!
//! Map (each module says what it owns):
//! - [`topology`]: the domain tree and per-leaf shortcuts (`sd_llc`, ...).
//! - [`sparsemask`]: seed 000's reduced-contention bitmap, plain and atomic.
//! - [`weight`], [`task`], [`rq`]: weights, tasks, per-leaf run queues.
//! - [`sched`]: [`Sched`], the fair class and the state transitions.
//! - [`select`]: `select_task_rq`, `select_idle_sibling`, `find_idlest`;
//!   [`idlest`]: the per-domain index `find_idlest` descends on.
//! - [`wake`]: `record_wakee`, `wake_wide` (seed 001).
//! - [`steal`]: `try_steal` (seed 000).
//! - [`overload`], [`busy`], [`pack`]: overload masks, busy flags
//!   (seed 003), asymmetric packing (seed 002).
//! - [`alloc`]: k idle leaves aligned to a core, LLC, NUMA node or package,
//!   and the per-level free summary agents report.
//! - [`stats`], [`config`]: schedstats and tunables.
//! - [`idhash`]: the fast hasher of id-keyed maps on hot paths.
//! - [`harness`]: the discrete-event harness that reproduces the seeds'
//!   experiments on this engine (the simulator grows from it).

pub mod alloc;
pub mod busy;
pub mod config;
pub mod devices;
pub mod gang;
pub mod harness;
pub mod idhash;
pub mod idlest;
pub mod overload;
pub mod pack;
pub mod reserve;
pub mod rq;
pub mod sched;
pub mod select;
pub mod sparsemask;
pub mod stats;
pub mod steal;
pub mod task;
pub mod topology;
pub mod wake;
pub mod weight;

pub use alloc::{Align, FreeSummary};
pub use config::{NodeLimitScope, PackThreshold, Policy, SchedConfig, WidestFirst};
pub use sched::{Sched, SchedError, SchedEvent};
pub use select::{PlacePath, Placement, WakeChoice};
pub use stats::Schedstats;
pub use task::{LeafSet, Task, TaskId, TaskSpec, TaskState};
pub use topology::{LeafId, Topology, TopologyBuilder};
