//! Prometheus metrics of the agent.
//!
//! Off by default: `agent run --metrics-listen ADDR` installs the agent's
//! [`AgentMetrics`] (see [`install`]) and serves `GET /metrics` with
//! [`dispatch_telemetry::prom`]'s scrape server. The agent loop samples the local scheduler into the
//! registry on each load report ([`AgentMetrics::sample`]): gauges are
//! atomics, so a scrape never holds up the agent and the agent never waits
//! on a scrape.
//!
//! Metric names (all prefixed `dispatch_agent_`):
//!
//! | name | type | labels |
//! |---|---|---|
//! | `dispatch_agent_jobs` | gauge | `state` = running / waiting |
//! | `dispatch_agent_steals_total` | counter | `level` = smt / llc / cross_llc |
//! | `dispatch_agent_steal_failures_total` | counter | |
//! | `dispatch_agent_busy_skip_total` | counter | |
//! | `dispatch_agent_overload_mask_weight` | gauge | `llc` (index) |
//! | `dispatch_agent_utilization` | gauge | `domain` = `llc/<i>` or `machine` |
//! | `dispatch_agent_schedstat_total` | counter | `stat` = every schedstats field |
//!
//! With OTLP on ([`dispatch_telemetry::otlp`]) the same registry is exported as
//! OTel instruments ([`AgentMetrics::families`]), so there is one set of
//! metrics whichever way it is read.

use std::sync::{Arc, OnceLock};

use dispatch_telemetry::{EngineCounters, Family, add_families};
use prometheus::proto::MetricType;
use prometheus::{GaugeVec, IntGaugeVec, Opts, Registry};

use crate::local::LocalScheduler;

/// The agent's metrics.
pub struct AgentMetrics {
    /// The registry served on /metrics.
    pub registry: Registry,
    jobs: IntGaugeVec,
    overload: IntGaugeVec,
    utilization: GaugeVec,
    engine: EngineCounters,
}

impl AgentMetrics {
    /// A fresh registry with every agent metric.
    pub fn new() -> prometheus::Result<Self> {
        let registry = Registry::new();
        let jobs = IntGaugeVec::new(
            Opts::new("dispatch_agent_jobs", "Jobs on this node by local state."),
            &["state"],
        )?;
        let overload = IntGaugeVec::new(
            Opts::new(
                "dispatch_agent_overload_mask_weight",
                "Overloaded CPUs per LLC (weight of the LLC's overload mask).",
            ),
            &["llc"],
        )?;
        let utilization = GaugeVec::new(
            Opts::new(
                "dispatch_agent_utilization",
                "Fraction of CPUs busy, per LLC and for the whole machine.",
            ),
            &["domain"],
        )?;
        registry.register(Box::new(jobs.clone()))?;
        registry.register(Box::new(overload.clone()))?;
        registry.register(Box::new(utilization.clone()))?;
        let engine = EngineCounters::new(&registry, "dispatch_agent", ["smt", "llc", "cross_llc"])?;
        for state in ["running", "waiting"] {
            jobs.with_label_values(&[state]);
        }
        Ok(Self {
            registry,
            jobs,
            overload,
            utilization,
            engine,
        })
    }

    /// Name, help and type of every family, for bridging to OTLP.
    pub fn families(&self) -> Vec<Family> {
        let mut out = Vec::new();
        add_families(&mut out, &self.jobs, MetricType::GAUGE);
        add_families(&mut out, &self.overload, MetricType::GAUGE);
        add_families(&mut out, &self.utilization, MetricType::GAUGE);
        out.extend(self.engine.families());
        out
    }

    /// Copy the local scheduler's numbers into the registry.
    pub fn sample(&self, local: &LocalScheduler) {
        self.jobs
            .with_label_values(&["running"])
            .set(local.nr_running() as i64);
        self.jobs
            .with_label_values(&["waiting"])
            .set(local.nr_waiting() as i64);
        let engine = local.engine();
        let topo = engine.topology();
        let masks = engine.overload_masks();
        let (mut busy_all, mut n_all) = (0usize, 0usize);
        for (i, llc) in topo.llcs().iter().enumerate() {
            let idx = i.to_string();
            self.overload
                .with_label_values(&[idx.as_str()])
                .set(masks.weight(i) as i64);
            let busy = llc
                .members
                .iter()
                .filter(|&&l| !engine.rq(l).is_idle())
                .count();
            busy_all += busy;
            n_all += llc.members.len();
            self.utilization
                .with_label_values(&[format!("llc/{i}").as_str()])
                .set(busy as f64 / llc.members.len().max(1) as f64);
        }
        self.utilization
            .with_label_values(&["machine"])
            .set(busy_all as f64 / n_all.max(1) as f64);
        self.engine.sample(engine.stats());
    }
}

static AGENT_METRICS: OnceLock<Arc<AgentMetrics>> = OnceLock::new();

/// Install the process's agent metrics (once); the agent loop samples into
/// them from then on.
pub fn install(metrics: Arc<AgentMetrics>) {
    let _ = AGENT_METRICS.set(metrics);
}

/// The installed agent metrics, if any.
pub fn installed() -> Option<&'static Arc<AgentMetrics>> {
    AGENT_METRICS.get()
}
