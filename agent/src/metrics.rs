//! Prometheus metrics of the agent, and the scrape endpoint shared with the
//! dispatcher.
//!
//! Off by default: `agent run --metrics-listen ADDR` installs the agent's
//! [`AgentMetrics`] (see [`install`]) and serves `GET /metrics` in the text
//! exposition format. The agent loop samples the local scheduler into the
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
//! With OTLP on ([`crate::telemetry`]) the same registry is exported as
//! OTel instruments ([`AgentMetrics::families`]), so there is one set of
//! metrics whichever way it is read.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock};

use prometheus::core::Collector;
use prometheus::proto::MetricType;
use prometheus::{
    Encoder, GaugeVec, IntCounter, IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder,
};
use sched::Schedstats;

use crate::local::LocalScheduler;

/// A metric family: name, help and type. Listed at registration, because
/// a gather leaves out labelled families that have no series yet, while
/// an OTel instrument must be created up front.
pub type Family = (String, String, MetricType);

/// The families of `collector`, of type `ty`, appended to `out`.
pub fn add_families(out: &mut Vec<Family>, collector: &dyn Collector, ty: MetricType) {
    for d in collector.desc() {
        out.push((d.fq_name.clone(), d.help.clone(), ty));
    }
}

/// Every schedstats field by name, in declaration order.
pub fn schedstat_fields(s: &Schedstats) -> [(&'static str, u64); 21] {
    [
        ("sis_easy", s.sis_easy),
        ("sis_core", s.sis_core),
        ("sis_cpu", s.sis_cpu),
        ("sis_none", s.sis_none),
        ("sis_scanned", s.sis_scanned),
        ("steal", s.steal),
        ("steal_fail", s.steal_fail),
        ("steal_smt", s.steal_smt),
        ("steal_cross_llc", s.steal_cross_llc),
        ("steal_scanned", s.steal_scanned),
        ("steal_skip_avg_idle", s.steal_skip_avg_idle),
        ("steal_skip_node_limit", s.steal_skip_node_limit),
        ("busy_skip", s.busy_skip),
        ("wake_affine", s.wake_affine),
        ("wake_wide", s.wake_wide),
        ("pack_placed", s.pack_placed),
        ("find_idlest", s.find_idlest),
        ("nr_migrations", s.nr_migrations),
        ("nr_preemptions", s.nr_preemptions),
        ("latency_picks", s.latency_picks),
        ("nr_switches", s.nr_switches),
    ]
}

/// Turns the engine's monotonic schedstats into Prometheus counters. An
/// engine may be rebuilt (the dispatcher's, when the node set changes), so
/// a value below the last one seen counts as a restart from zero.
pub struct EngineCounters {
    /// `<prefix>_schedstat_total{stat}`.
    pub schedstat: IntCounterVec,
    /// `<prefix>_steals_total{level}`.
    pub steals: IntCounterVec,
    /// `<prefix>_steal_failures_total`.
    pub steal_failures: IntCounter,
    /// `<prefix>_busy_skip_total`.
    pub busy_skip: IntCounter,
    levels: [&'static str; 3],
    last: Mutex<Schedstats>,
}

fn delta(new: u64, old: u64) -> u64 {
    if new >= old { new - old } else { new }
}

impl EngineCounters {
    /// Register the counters as `<prefix>_...`; `levels` names the steal
    /// levels (SMT sibling, same LLC, cross-LLC).
    pub fn new(
        registry: &Registry,
        prefix: &str,
        levels: [&'static str; 3],
    ) -> prometheus::Result<Self> {
        let schedstat = IntCounterVec::new(
            Opts::new(
                format!("{prefix}_schedstat_total"),
                "Engine schedstats (seed 000 patch 10 fields and the engine's own), by name.",
            ),
            &["stat"],
        )?;
        let steals = IntCounterVec::new(
            Opts::new(
                format!("{prefix}_steals_total"),
                "Tasks stolen by idle leaves, by the level the victim shares with the thief.",
            ),
            &["level"],
        )?;
        let steal_failures = IntCounter::new(
            format!("{prefix}_steal_failures_total"),
            "Steal attempts that found overloaded leaves but no migratable task.",
        )?;
        let busy_skip = IntCounter::new(
            format!("{prefix}_busy_skip_total"),
            "Idle searches skipped because the domain was flagged fully busy.",
        )?;
        registry.register(Box::new(schedstat.clone()))?;
        registry.register(Box::new(steals.clone()))?;
        registry.register(Box::new(steal_failures.clone()))?;
        registry.register(Box::new(busy_skip.clone()))?;
        // Show every series from the first scrape, at zero.
        for (name, _) in schedstat_fields(&Schedstats::default()) {
            schedstat.with_label_values(&[name]);
        }
        for level in levels {
            steals.with_label_values(&[level]);
        }
        Ok(Self {
            schedstat,
            steals,
            steal_failures,
            busy_skip,
            levels,
            last: Mutex::new(Schedstats::default()),
        })
    }

    /// The families of these counters.
    pub fn families(&self) -> Vec<Family> {
        let mut out = Vec::new();
        add_families(&mut out, &self.schedstat, MetricType::COUNTER);
        add_families(&mut out, &self.steals, MetricType::COUNTER);
        add_families(&mut out, &self.steal_failures, MetricType::COUNTER);
        add_families(&mut out, &self.busy_skip, MetricType::COUNTER);
        out
    }

    /// Add what changed since the last sample.
    pub fn sample(&self, now: &Schedstats) {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        for ((name, new), (_, old)) in schedstat_fields(now)
            .into_iter()
            .zip(schedstat_fields(&last))
        {
            let d = delta(new, old);
            if d > 0 {
                self.schedstat.with_label_values(&[name]).inc_by(d);
            }
        }
        let same_llc = |s: &Schedstats| {
            s.steal
                .saturating_sub(s.steal_smt)
                .saturating_sub(s.steal_cross_llc)
        };
        let d = [
            delta(now.steal_smt, last.steal_smt),
            delta(same_llc(now), same_llc(&last)),
            delta(now.steal_cross_llc, last.steal_cross_llc),
        ];
        for (level, d) in self.levels.iter().zip(d) {
            if d > 0 {
                self.steals.with_label_values(&[level]).inc_by(d);
            }
        }
        self.steal_failures
            .inc_by(delta(now.steal_fail, last.steal_fail));
        self.busy_skip.inc_by(delta(now.busy_skip, last.busy_skip));
        *last = *now;
    }
}

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

/// The registry in the Prometheus text exposition format.
pub fn render(registry: &Registry) -> String {
    let mut buf = Vec::new();
    if let Err(err) = TextEncoder::new().encode(&registry.gather(), &mut buf) {
        tracing::warn!(%err, "encoding metrics");
    }
    String::from_utf8(buf).unwrap_or_default()
}

/// Serve `GET /metrics` for `registry` on `listener` until the task is
/// dropped or the listener fails.
pub async fn serve(listener: tokio::net::TcpListener, registry: Registry) -> std::io::Result<()> {
    use axum::http::header::CONTENT_TYPE;
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let registry = registry.clone();
            async move {
                (
                    [(CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
                    render(&registry),
                )
            }
        }),
    );
    axum::serve(listener, app).await
}

/// Bind `addr` and serve `registry` on it in a background task; returns the
/// bound address.
pub async fn spawn_server(addr: SocketAddr, registry: Registry) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    tokio::spawn(async move {
        if let Err(err) = serve(listener, registry).await {
            tracing::error!(%err, "the metrics endpoint stopped");
        }
    });
    Ok(bound)
}
