//! `dispatch-telemetry`: the observability plumbing the agent and the
//! dispatcher share, so neither imports the other for it.
//!
//! - [`otlp`]: the OTLP/gRPC trace and metric pipelines ([`Exporters`]),
//!   whether they are asked for ([`wanted`]), and the bridge that exports a
//!   Prometheus registry as OTel instruments ([`bridge_prometheus`]).
//! - [`trace_context`]: W3C Trace Context propagation ([`inject`],
//!   [`extract`]), the one format both processes put on the wire.
//! - [`prom`]: metric families ([`Family`]), the engine's schedstats as
//!   Prometheus counters ([`EngineCounters`]), rendering in the text
//!   exposition format ([`render`]) and the `/metrics` scrape server.
//!
//! What each process measures (its metric names, its spans) stays in that
//! process's crate; this crate knows no job, node or agent.

pub mod otlp;
pub mod prom;
pub mod trace_context;

pub use otlp::{Exporters, TelemetryError, bridge_prometheus, wanted};
pub use prom::{EngineCounters, Family, add_families, render, schedstat_fields};
pub use trace_context::{extract, inject};
