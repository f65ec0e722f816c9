//! Prometheus metrics of the dispatcher.
//!
//! Off by default: `dispatcher --http-listen ADDR` (or its older name
//! `--metrics-listen`) builds the core with [`Metrics`] as an
//! [`Observer`] and serves `GET /metrics` beside the web page
//! ([`crate::web::router`]). The core thread samples the cluster into the
//! registry on every tick and records placements as they happen; every
//! metric is an atomic, so a scrape never blocks the core and the core
//! never waits on a scrape.
//!
//! | name | type | labels |
//! |---|---|---|
//! | `dispatch_jobs` | gauge | `state` (pending, assigned, running, succeeded, ...), `class` = latency / normal |
//! | `dispatch_nodes` | gauge | `state` = ready / down / disconnected / draining / cordoned |
//! | `dispatch_placement_seconds` | histogram | time the core spent placing a submitted job |
//! | `dispatch_placements_total` | counter | jobs sent to a node (PENDING -> ASSIGNED) |
//! | `dispatch_steals_total` | counter | `level` = node (same host group) / rack / zone (cross-rack) |
//! | `dispatch_steal_failures_total` | counter | |
//! | `dispatch_busy_skip_total` | counter | |
//! | `dispatch_overload_mask_weight` | gauge | `rack` (zone/rack) |
//! | `dispatch_utilization` | gauge | `level` = cluster / zone / rack, `domain` |
//! | `dispatch_agent_heartbeat_lag_seconds` | gauge | `node` |
//! | `dispatch_schedstat_total` | counter | `stat` = every schedstats field |
//! | `dispatch_leader` | gauge | 1 while this dispatcher leads (always with the embedded store), 0 on a follower |
//!
//! The cluster-sampled gauges (`dispatch_jobs`, `dispatch_nodes`,
//! `dispatch_overload_mask_weight`, `dispatch_utilization`,
//! `dispatch_agent_heartbeat_lag_seconds`) describe the cluster only on
//! the leader: when a replica steps down they are cleared
//! ([`Metrics::set_leader`]), so a follower exports `dispatch_leader 0`
//! and no stale cluster state. Counters stay: they count what this
//! process did.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Mutex;

use dispatch_telemetry::{EngineCounters, Family, add_families};
use prometheus::proto::MetricType;
use prometheus::{
    GaugeVec, Histogram, HistogramOpts, IntCounter, IntGauge, IntGaugeVec, Opts, Registry,
};
use proto::v1::{JobEvent, JobState};

use crate::cluster::{Cluster, Move, MoveKind};
use crate::observe::Observer;

/// The dispatcher's metrics.
pub struct Metrics {
    /// The registry served on /metrics.
    pub registry: Registry,
    jobs: IntGaugeVec,
    nodes: IntGaugeVec,
    placement_seconds: Histogram,
    placements: IntCounter,
    overload: IntGaugeVec,
    utilization: GaugeVec,
    heartbeat_lag: GaugeVec,
    leader: IntGauge,
    engine: EngineCounters,
    /// Series set at the last sample, to drop those that went away.
    seen: Mutex<Seen>,
    /// Jobs by (state, class), kept from events between full recounts.
    counts: Mutex<JobCounts>,
    families: Vec<Family>,
}

/// Jobs are counted from the batch's events; a full recount (O(jobs), on
/// the core) happens at most this often, to start and to correct drift.
const RECOUNT_MS: i64 = 30_000;

#[derive(Default)]
struct JobCounts {
    by: HashMap<(i32, &'static str), i64>,
    last_full_ms: Option<i64>,
}

#[derive(Default)]
struct Seen {
    racks: HashSet<String>,
    domains: HashSet<(String, String)>,
    /// Each connected node's heartbeat-lag series (its handle, so a tick
    /// neither looks the series up nor copies the name again) and the
    /// sample that last set it.
    nodes: HashMap<String, (prometheus::Gauge, u64)>,
    /// Samples taken.
    samples: u64,
}

/// The short name of a job state (`JOB_STATE_RUNNING` -> `running`).
pub fn state_name(state: JobState) -> String {
    state
        .as_str_name()
        .trim_start_matches("JOB_STATE_")
        .to_ascii_lowercase()
}

/// A job's latency class: `latency` (latency_nice < 0) or `normal`.
pub fn class_of(job: &proto::v1::Job) -> &'static str {
    match &job.spec {
        Some(spec) if spec.latency_nice < 0 => "latency",
        _ => "normal",
    }
}

impl Metrics {
    /// A fresh registry with every dispatcher metric.
    pub fn new() -> prometheus::Result<Self> {
        let registry = Registry::new();
        let jobs = IntGaugeVec::new(
            Opts::new("dispatch_jobs", "Jobs by state and latency class."),
            &["state", "class"],
        )?;
        let nodes = IntGaugeVec::new(Opts::new("dispatch_nodes", "Nodes by state."), &["state"])?;
        let placement_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "dispatch_placement_seconds",
                "Time the core spent validating and placing a submitted job (the batch's time shared by its jobs).",
            )
            .buckets(prometheus::exponential_buckets(1e-6, 4.0, 12)?),
        )?;
        let placements = IntCounter::new(
            "dispatch_placements_total",
            "Jobs placed on a node and sent to its agent (PENDING -> ASSIGNED).",
        )?;
        let overload = IntGaugeVec::new(
            Opts::new(
                "dispatch_overload_mask_weight",
                "Overloaded nodes per rack (weight of the rack's overload mask).",
            ),
            &["rack"],
        )?;
        let utilization = GaugeVec::new(
            Opts::new(
                "dispatch_utilization",
                "Fraction of CPUs held by jobs, per domain (the dispatcher's model).",
            ),
            &["level", "domain"],
        )?;
        let heartbeat_lag = GaugeVec::new(
            Opts::new(
                "dispatch_agent_heartbeat_lag_seconds",
                "Time since the node's agent last reported.",
            ),
            &["node"],
        )?;
        let leader = IntGauge::new(
            "dispatch_leader",
            "1 while this dispatcher is the leader (always with the embedded store), 0 on a follower replica.",
        )?;
        registry.register(Box::new(leader.clone()))?;
        registry.register(Box::new(jobs.clone()))?;
        registry.register(Box::new(nodes.clone()))?;
        registry.register(Box::new(placement_seconds.clone()))?;
        registry.register(Box::new(placements.clone()))?;
        registry.register(Box::new(overload.clone()))?;
        registry.register(Box::new(utilization.clone()))?;
        registry.register(Box::new(heartbeat_lag.clone()))?;
        let engine = EngineCounters::new(&registry, "dispatch", ["node", "rack", "zone"])?;
        let mut families = Vec::new();
        add_families(&mut families, &jobs, MetricType::GAUGE);
        add_families(&mut families, &nodes, MetricType::GAUGE);
        add_families(&mut families, &placements, MetricType::COUNTER);
        add_families(&mut families, &overload, MetricType::GAUGE);
        add_families(&mut families, &utilization, MetricType::GAUGE);
        add_families(&mut families, &heartbeat_lag, MetricType::GAUGE);
        add_families(&mut families, &leader, MetricType::GAUGE);
        families.extend(engine.families());
        Self::zero_series(&jobs, &nodes);
        Ok(Self {
            registry,
            jobs,
            nodes,
            placement_seconds,
            placements,
            overload,
            utilization,
            heartbeat_lag,
            leader,
            engine,
            seen: Mutex::new(Seen::default()),
            counts: Mutex::new(JobCounts::default()),
            families,
        })
    }

    /// The series every leader exports from its first scrape (at 0).
    fn zero_series(jobs: &IntGaugeVec, nodes: &IntGaugeVec) {
        for state in ["ready", "down", "disconnected", "draining", "cordoned"] {
            nodes.with_label_values(&[state]);
        }
        for class in ["latency", "normal"] {
            for state in [
                JobState::Pending,
                JobState::Assigned,
                JobState::Running,
                JobState::Succeeded,
                JobState::Failed,
                JobState::Cancelled,
                JobState::Lost,
            ] {
                jobs.with_label_values(&[state_name(state).as_str(), class]);
            }
        }
    }

    /// This dispatcher became the leader (`true`: `dispatch_leader 1`,
    /// the core samples the cluster from its next tick) or stopped leading
    /// (`false`, called once its core has stopped: `dispatch_leader 0`
    /// and every cluster-sampled gauge is dropped, so a follower exports
    /// nothing stale; the job counts are recounted in the next term).
    pub fn set_leader(&self, leading: bool) {
        if leading {
            Self::zero_series(&self.jobs, &self.nodes);
            self.leader.set(1);
            return;
        }
        self.leader.set(0);
        self.jobs.reset();
        self.nodes.reset();
        self.overload.reset();
        self.utilization.reset();
        self.heartbeat_lag.reset();
        *self.seen.lock().unwrap_or_else(|e| e.into_inner()) = Seen::default();
        *self.counts.lock().unwrap_or_else(|e| e.into_inner()) = JobCounts::default();
    }

    /// Name, help and type of every counter and gauge family (registered
    /// even before they have series), for bridging to OTLP.
    pub fn families(&self) -> &[Family] {
        &self.families
    }

    /// The core placed `n` submitted jobs in `seconds`.
    pub fn observe_submit(&self, n: usize, seconds: f64) {
        let each = seconds / n.max(1) as f64;
        for _ in 0..n {
            self.placement_seconds.observe(each);
        }
    }

    /// Job events of a committed batch.
    pub fn observe_events(&self, events: &[JobEvent]) {
        let mut counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        for ev in events {
            if let Some(job) = &ev.job {
                let class = class_of(job);
                if ev.previous_state != JobState::Unspecified as i32 {
                    *counts.by.entry((ev.previous_state, class)).or_default() -= 1;
                }
                *counts.by.entry((job.state, class)).or_default() += 1;
            }
        }
    }

    /// Placements and steals of a committed batch.
    pub fn observe_moves(&self, moves: &[Move]) {
        for m in moves {
            if matches!(m.kind, MoveKind::Placed { .. }) {
                self.placements.inc();
            }
        }
    }

    /// Jobs by (state, class), as counted at the last sample and from the
    /// events since; class is `latency` (latency_nice < 0) or `normal`.
    pub fn job_counts(&self) -> Vec<(JobState, &'static str, i64)> {
        let counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<(JobState, &'static str, i64)> = counts
            .by
            .iter()
            .filter_map(|(&(s, class), &n)| Some((JobState::try_from(s).ok()?, class, n.max(0))))
            .collect();
        out.sort();
        out
    }

    /// Sample the cluster (the core calls this on its tick).
    pub fn sample(&self, cluster: &Cluster, now_ms: i64) {
        // Jobs by state and class.
        let mut counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        if counts
            .last_full_ms
            .is_none_or(|t| now_ms - t >= RECOUNT_MS || now_ms < t)
        {
            counts.by.clear();
            for job in cluster.jobs_matching(&[]) {
                *counts.by.entry((job.state, class_of(&job))).or_default() += 1;
            }
            counts.last_full_ms = Some(now_ms);
        }
        let jobs = &counts.by;
        for class in ["latency", "normal"] {
            for s in 1..=16 {
                let Ok(state) = JobState::try_from(s) else {
                    continue;
                };
                let n = jobs.get(&(s, class)).copied().unwrap_or(0);
                self.jobs
                    .with_label_values(&[state_name(state).as_str(), class])
                    .set(n.max(0));
            }
        }
        drop(counts);
        // Nodes, utilization and heartbeat lag.
        let mut states: BTreeMap<&'static str, i64> = [
            ("ready", 0),
            ("down", 0),
            ("disconnected", 0),
            ("draining", 0),
            ("cordoned", 0),
        ]
        .into_iter()
        .collect();
        // Busy and all CPUs per (zone, rack), keyed by borrowed names: the
        // zone and cluster sums and the label strings are made per rack,
        // not per node.
        let mut per_rack: BTreeMap<(&str, &str), (usize, usize)> = BTreeMap::new();
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        seen.samples += 1;
        let sample = seen.samples;
        for n in cluster.nodes() {
            *states.entry(node_state(n)).or_default() += 1;
            let busy = n.cpu_busy.iter().filter(|&&b| b).count();
            let e = per_rack
                .entry((n.zone.as_str(), n.rack.as_str()))
                .or_default();
            e.0 += busy;
            e.1 += n.cpu_busy.len();
            if n.connected {
                let lag = (now_ms - n.last_heartbeat_ms).max(0) as f64 / 1000.0;
                match seen.nodes.get_mut(n.name.as_str()) {
                    Some((gauge, at)) => {
                        gauge.set(lag);
                        *at = sample;
                    }
                    None => {
                        let gauge = self.heartbeat_lag.with_label_values(&[n.name.as_str()]);
                        gauge.set(lag);
                        seen.nodes.insert(n.name.clone(), (gauge, sample));
                    }
                }
            }
        }
        let mut util: BTreeMap<(String, String), (usize, usize)> = BTreeMap::new();
        for (&(zone, rack), &(busy, cpus)) in &per_rack {
            for key in [
                ("cluster".to_string(), "all".to_string()),
                ("zone".to_string(), zone.to_string()),
                ("rack".to_string(), format!("{zone}/{rack}")),
            ] {
                let e = util.entry(key).or_default();
                e.0 += busy;
                e.1 += cpus;
            }
        }
        for (state, n) in states {
            self.nodes.with_label_values(&[state]).set(n);
        }
        for ((level, domain), (busy, cpus)) in &util {
            self.utilization
                .with_label_values(&[level.as_str(), domain.as_str()])
                .set(*busy as f64 / (*cpus).max(1) as f64);
        }
        // Overload-mask weight per rack: a rack is an LLC of the
        // node-level engine; the cluster maps each node to its leaf.
        let mut racks = HashSet::new();
        if let Some(engine) = cluster.engine() {
            let topo = engine.topology();
            let mut named = vec![false; topo.llcs().len()];
            for n in cluster.nodes() {
                let Some(leaf) = cluster
                    .engine_leaf(&n.name)
                    .filter(|&l| l < topo.nr_leaves())
                else {
                    continue;
                };
                let i = topo.llc_of(leaf);
                if std::mem::replace(&mut named[i], true) {
                    continue;
                }
                let rack = format!("{}/{}", n.zone, n.rack);
                self.overload
                    .with_label_values(&[rack.as_str()])
                    .set(engine.overload_masks().weight(i) as i64);
                racks.insert(rack);
            }
            self.engine.sample(engine.stats());
        }
        // Forget series of racks, domains and nodes that went away.
        for r in &seen.racks {
            if !racks.contains(r) {
                let _ = self.overload.remove_label_values(&[r.as_str()]);
            }
        }
        for (l, d) in &seen.domains {
            if !util.contains_key(&(l.clone(), d.clone())) {
                let _ = self
                    .utilization
                    .remove_label_values(&[l.as_str(), d.as_str()]);
            }
        }
        seen.nodes.retain(|n, (_, at)| {
            let kept = *at == sample;
            if !kept {
                let _ = self.heartbeat_lag.remove_label_values(&[n.as_str()]);
            }
            kept
        });
        // (Sets: at 10,000 nodes a list's `contains` per node was
        // quadratic, about 10^8 comparisons per tick on the core.)
        seen.racks = racks;
        seen.domains = util.into_keys().collect();
    }
}

pub use crate::cluster::nodes::node_state;

impl Observer for Metrics {
    fn leading(&self, leading: bool) {
        self.set_leader(leading);
    }

    fn submitted(&self, jobs: usize, seconds: f64) {
        self.observe_submit(jobs, seconds);
    }

    fn tick(&self, cluster: &Cluster, now_ms: i64) {
        self.sample(cluster, now_ms);
    }

    fn committed(&self, events: &[JobEvent]) {
        self.observe_events(events);
    }

    fn moved(&self, moves: &[Move]) {
        self.observe_moves(moves);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scrape(m: &Metrics) -> String {
        dispatch_telemetry::render(&m.registry)
    }

    #[test]
    fn a_follower_exports_no_cluster_gauges() {
        let m = Metrics::new().unwrap();
        m.set_leader(true);
        m.utilization
            .with_label_values(&["cluster", "all"])
            .set(0.5);
        m.heartbeat_lag.with_label_values(&["n1"]).set(1.0);
        m.placements.inc();
        let text = scrape(&m);
        assert!(text.contains("dispatch_leader 1"), "{text}");
        assert!(text.contains("dispatch_jobs{"), "{text}");
        assert!(text.contains("dispatch_utilization{"), "{text}");
        m.set_leader(false);
        let text = scrape(&m);
        assert!(text.contains("dispatch_leader 0"), "{text}");
        for stale in [
            "dispatch_jobs{",
            "dispatch_nodes{",
            "dispatch_utilization{",
            "dispatch_agent_heartbeat_lag_seconds{",
        ] {
            assert!(
                !text.contains(stale),
                "{stale} after stepping down:\n{text}"
            );
        }
        // What this process did stays counted.
        assert!(text.contains("dispatch_placements_total 1"), "{text}");
        // Elected again: the job series are back at zero until sampled.
        m.set_leader(true);
        assert!(scrape(&m).contains("dispatch_jobs{class=\"normal\",state=\"running\"} 0"));
    }

    /// Each connected node has its heartbeat-lag series, kept across
    /// samples and updated in place; a node that disconnects loses it,
    /// and so do the utilization series of a rack that has no node left.
    #[test]
    fn heartbeat_lag_series_follow_the_connected_nodes() {
        use crate::cluster::tests::register_node;
        use crate::cluster::{ClusterConfig, Effects};
        let m = Metrics::new().unwrap();
        m.set_leader(true);
        let mut c = Cluster::new(ClusterConfig::default());
        let mut fx = Effects::default();
        register_node(&mut c, "a", "1s:2c:1t", ("z1", "r1"), 1_000, &mut fx);
        register_node(&mut c, "b", "1s:2c:1t", ("z1", "r2"), 1_000, &mut fx);
        c.settle(1_000, &mut fx);
        m.sample(&c, 3_000);
        let text = scrape(&m);
        assert!(
            text.contains("dispatch_agent_heartbeat_lag_seconds{node=\"a\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("dispatch_agent_heartbeat_lag_seconds{node=\"b\"} 2"),
            "{text}"
        );
        m.sample(&c, 4_000);
        let text = scrape(&m);
        assert!(
            text.contains("dispatch_agent_heartbeat_lag_seconds{node=\"a\"} 3"),
            "{text}"
        );
        c.disconnected("b");
        m.sample(&c, 5_000);
        let text = scrape(&m);
        assert!(
            text.contains("dispatch_agent_heartbeat_lag_seconds{node=\"a\"} 4"),
            "{text}"
        );
        assert!(!text.contains("node=\"b\""), "{text}");
        assert!(text.contains("domain=\"z1/r2\""), "{text}");
    }
}
