//! `dispatch-telemetry`: the observability plumbing the agent, the
//! dispatcher and the relay share, so none imports another for it.
//!
//! - [`otlp`]: the OTLP/gRPC trace and metric pipelines ([`Exporters`]),
//!   whether they are asked for ([`wanted`]), and the bridge that exports a
//!   Prometheus registry as OTel instruments ([`bridge_prometheus`]).
//! - [`trace_context`]: W3C Trace Context propagation ([`inject`],
//!   [`extract`]), the one format both processes put on the wire.
//! - [`logging`]: every binary's log output ([`init_logging`]).
//! - [`prom`]: metric families ([`Family`]), the engine's schedstats as
//!   Prometheus counters ([`EngineCounters`]), rendering in the text
//!   exposition format ([`render`]) and the `/metrics` scrape server.
//!
//! What each process measures (its metric names, its spans) stays in that
//! process's crate; this crate knows no job, node or agent.

pub mod logging;
pub mod otlp;
pub mod prom;
pub mod trace_context;

pub use logging::{LogFormat, init_logging};
pub use otlp::{Exporters, TelemetryError, bridge_prometheus, wanted};
pub use prom::{EngineCounters, Family, add_families, render, schedstat_fields};
pub use trace_context::{extract, inject};
