//! The dispatcher: accepts jobs over gRPC, keeps the cluster's nodes and
//! jobs, places jobs on nodes with the `sched` engine (leaves = nodes), and
//! drives agents over their streams.
//!
//! - [`spec`]: job-spec validation (errors name the field).
//! - [`store`]: durable state (embedded redb by default, or etcd).
//! - [`record`]: a job's key and its compact record, kept by the job
//!   table (`cluster::jobs`) and encoded by the store.
//! - [`ha`]: leader election among replicas on etcd; [`gate`]: the role
//!   it drives, which makes followers redirect.
//! - [`auth`]: bearer tokens and roles; [`tls`]: server TLS, agent
//!   certificates and the local CA.
//! - [`beats`]: agents' liveness and LoadReports, aggregated per stream
//!   off the core and applied by it in batches; [`outbound`]: each
//!   agent stream's queue of messages from the core; [`session`]: one
//!   node's session on a stream, shared by Attach and AttachMany, whose
//!   many-node reader is [`relay`].
//! - [`core`]: the thread that owns the cluster and the store; it reports
//!   to the [`observe::Observers`] it is built with ([`metrics`], [`web`],
//!   [`telemetry`]). [`offcore`]: the one-slot hand-off by which the web
//!   snapshot and the metrics sample are finished off the core.
//! - [`allocator`]: the processes' global allocator (mimalloc, by its
//!   plain entry points for word-aligned requests).

pub mod allocator;
pub mod auth;
pub mod beats;
pub mod cluster;
pub mod core;
pub mod gate;
pub mod ha;
pub mod idle;
pub mod limits;
pub mod list_worker;
pub mod metrics;
pub mod observe;
pub mod offcore;
pub mod outbound;
pub mod record;
pub mod relay;
pub mod server;
pub mod session;
pub mod spec;
pub mod store;
pub mod telemetry;
pub mod tls;
pub mod web;
