//! Prometheus metrics of the dispatcher.
//!
//! Off by default: `dispatcher --http-listen ADDR` (or its older name
//! `--metrics-listen`) builds the core with [`Metrics`] as an
//! [`Observer`] and serves `GET /metrics` beside the web page
//! ([`crate::web::router`]). On every tick the core copies what the
//! cluster-sampled series need ([`Metrics::copy`]: plain numbers, names in
//! one buffer) and hands the copy to the `dispatch-metrics` thread
//! ([`crate::offcore::Handoff`]), which sets the series (thousands of
//! label lookups at 10,000 nodes) off the core; placements are recorded
//! as they happen. Every metric is an atomic, so a scrape never blocks
//! the core and the core never waits on a scrape.
//!
//! | name | type | labels |
//! |---|---|---|
//! | `dispatch_jobs` | gauge | `state` (pending, assigned, running, succeeded, ...), `class` = latency / normal |
//! | `dispatch_nodes` | gauge | `state` = ready / down / disconnected / draining / cordoned |
//! | `dispatch_placement_seconds` | histogram | time the core spent placing a submitted job |
//! | `dispatch_placements_total` | counter | jobs sent to a node (PENDING -> ASSIGNED) |
//! | `dispatch_store_commit_seconds` | histogram | one batch's commit on the store's thread (its count: commits) |
//! | `dispatch_store_writes_total` | counter | records handed to the store's commits |
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
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use dispatch_telemetry::{EngineCounters, Family, add_families};
use prometheus::proto::MetricType;
use prometheus::{
    GaugeVec, Histogram, HistogramOpts, IntCounter, IntGauge, IntGaugeVec, Opts, Registry,
};
use proto::v1::{JobEvent, JobState};

use crate::cluster::{Cluster, Move, MoveKind};
use crate::observe::Observer;
use crate::offcore::{Handoff, Names, Span};

/// The dispatcher's metrics.
pub struct Metrics {
    /// The registry served on /metrics.
    pub registry: Registry,
    placement_seconds: Histogram,
    placements: IntCounter,
    commit_seconds: Histogram,
    store_writes: IntCounter,
    leader: IntGauge,
    /// The cluster-sampled series, shared with the sampler thread.
    sampled: Arc<Sampled>,
    /// Copies of the cluster on their way to the `dispatch-metrics`
    /// thread.
    sampler: Handoff<SampleCopy>,
    families: Vec<Family>,
}

/// The series sampled from the cluster and their bookkeeping: set by the
/// `dispatch-metrics` thread from the core's [`SampleCopy`]s (or at once
/// by [`Metrics::sample`]).
struct Sampled {
    jobs: IntGaugeVec,
    nodes: IntGaugeVec,
    overload: IntGaugeVec,
    utilization: GaugeVec,
    heartbeat_lag: GaugeVec,
    engine: EngineCounters,
    /// Bumped (under `seen`'s lock) when the replica steps down: a copy
    /// of the previous term is not applied.
    term: AtomicU64,
    /// Series set at the last sample, to drop those that went away.
    seen: Mutex<Seen>,
    /// Jobs by (state, class), kept from events between full recounts.
    counts: Mutex<JobCounts>,
}

/// One node as the core copies it for a metrics sample: numbers and
/// ranges into [`SampleCopy::text`].
struct NodeSample {
    name: Span,
    zone: Span,
    rack: Span,
    state: &'static str,
    busy: u32,
    cpus: u32,
    connected: bool,
    last_heartbeat_ms: i64,
}

/// What the core copies out of the cluster for one metrics sample (plain
/// numbers, names end to end in one buffer): the series themselves are
/// set off the core.
pub struct SampleCopy {
    term: u64,
    now_ms: i64,
    text: Names,
    nodes: Vec<NodeSample>,
    /// Each rack of the node-level engine (`zone/rack` in `text`) and the
    /// weight of its overload mask.
    overload: Vec<(Span, i64)>,
    stats: Option<sched::Schedstats>,
}

impl SampleCopy {
    /// Nodes copied.
    pub fn nodes(&self) -> usize {
        self.nodes.len()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
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
        // The CPU per job follows the number of commits (each an fsync
        // with the embedded store): the count and the time say how much
        // each commit carried and cost.
        let commit_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "dispatch_store_commit_seconds",
                "Time one batch's commit took on the store's thread (encoding, B-tree or etcd round trip, fsync); its count is the number of commits.",
            )
            .buckets(prometheus::exponential_buckets(1e-5, 2.0, 16)?),
        )?;
        let store_writes = IntCounter::new(
            "dispatch_store_writes_total",
            "Records handed to the store's commits (job and node writes, before only each record's last write in a commit is kept).",
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
        registry.register(Box::new(commit_seconds.clone()))?;
        registry.register(Box::new(store_writes.clone()))?;
        registry.register(Box::new(overload.clone()))?;
        registry.register(Box::new(utilization.clone()))?;
        registry.register(Box::new(heartbeat_lag.clone()))?;
        let engine = EngineCounters::new(&registry, "dispatch", ["node", "rack", "zone"])?;
        let mut families = Vec::new();
        add_families(&mut families, &jobs, MetricType::GAUGE);
        add_families(&mut families, &nodes, MetricType::GAUGE);
        add_families(&mut families, &placements, MetricType::COUNTER);
        add_families(&mut families, &store_writes, MetricType::COUNTER);
        add_families(&mut families, &overload, MetricType::GAUGE);
        add_families(&mut families, &utilization, MetricType::GAUGE);
        add_families(&mut families, &heartbeat_lag, MetricType::GAUGE);
        add_families(&mut families, &leader, MetricType::GAUGE);
        families.extend(engine.families());
        Self::zero_series(&jobs, &nodes);
        let sampled = Arc::new(Sampled {
            jobs,
            nodes,
            overload,
            utilization,
            heartbeat_lag,
            engine,
            term: AtomicU64::new(0),
            seen: Mutex::new(Seen::default()),
            counts: Mutex::new(JobCounts::default()),
        });
        let on_sampler = sampled.clone();
        Ok(Self {
            registry,
            placement_seconds,
            placements,
            commit_seconds,
            store_writes,
            leader,
            sampled,
            sampler: Handoff::new("dispatch-metrics", move |copy| on_sampler.apply(copy)),
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
        let s = &self.sampled;
        if leading {
            Self::zero_series(&s.jobs, &s.nodes);
            self.leader.set(1);
            return;
        }
        self.leader.set(0);
        let mut seen = lock(&s.seen);
        s.term.fetch_add(1, Ordering::AcqRel);
        s.jobs.reset();
        s.nodes.reset();
        s.overload.reset();
        s.utilization.reset();
        s.heartbeat_lag.reset();
        *seen = Seen::default();
        drop(seen);
        *lock(&s.counts) = JobCounts::default();
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
        let mut counts = lock(&self.sampled.counts);
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
        let counts = lock(&self.sampled.counts);
        let mut out: Vec<(JobState, &'static str, i64)> = counts
            .by
            .iter()
            .filter_map(|(&(s, class), &n)| Some((JobState::try_from(s).ok()?, class, n.max(0))))
            .collect();
        out.sort();
        out
    }

    /// Sample the cluster now, on the calling thread (the core's tick
    /// hands [`Metrics::copy`] to the sampler thread instead).
    pub fn sample(&self, cluster: &Cluster, now_ms: i64) {
        self.sampled.apply(self.copy(cluster, now_ms));
    }

    /// Wait until every copy handed to the sampler thread is applied
    /// (tests).
    pub fn wait_sampled(&self) {
        self.sampler.wait_done();
    }

    /// The core's part of a sample: recount the jobs when due (O(jobs), at
    /// most every [`RECOUNT_MS`]) and copy what the series need out of
    /// the cluster, O(nodes x CPUs per node) plain copies.
    pub fn copy(&self, cluster: &Cluster, now_ms: i64) -> SampleCopy {
        let mut counts = lock(&self.sampled.counts);
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
        drop(counts);
        let nr = cluster.nodes().size_hint().0;
        let mut c = SampleCopy {
            term: self.sampled.term.load(Ordering::Acquire),
            now_ms,
            text: Names::with_capacity(nr * 24),
            nodes: Vec::with_capacity(nr),
            overload: Vec::new(),
            stats: None,
        };
        for n in cluster.nodes() {
            let node = NodeSample {
                name: c.text.push(&[&n.name]),
                zone: c.text.push(&[n.zone()]),
                rack: c.text.push(&[n.rack()]),
                state: node_state(n),
                busy: n.busy_cpus(),
                cpus: n.cpu_topo().nr_leaves() as u32,
                connected: n.connected,
                last_heartbeat_ms: n.last_heartbeat_ms,
            };
            c.nodes.push(node);
        }
        // Overload-mask weight per rack: a rack is an LLC of the
        // node-level engine; the cluster maps each node to its leaf.
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
                let label = c.text.push(&[n.zone(), "/", n.rack()]);
                c.overload
                    .push((label, engine.overload_masks().weight(i) as i64));
            }
            c.stats = Some(*engine.stats());
        }
        c
    }
}

impl Sampled {
    /// Set the series from a copy (the sampler thread, or
    /// [`Metrics::sample`]), unless the replica stepped down since it was
    /// taken.
    fn apply(&self, c: SampleCopy) {
        let mut seen = lock(&self.seen);
        if self.term.load(Ordering::Acquire) != c.term {
            return;
        }
        // Jobs by state and class.
        let jobs = lock(&self.counts).by.clone();
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
        seen.samples += 1;
        let sample = seen.samples;
        for n in &c.nodes {
            *states.entry(n.state).or_default() += 1;
            let e = per_rack
                .entry((c.text.get(n.zone), c.text.get(n.rack)))
                .or_default();
            e.0 += n.busy as usize;
            e.1 += n.cpus as usize;
            if n.connected {
                let lag = (c.now_ms - n.last_heartbeat_ms).max(0) as f64 / 1000.0;
                let name = c.text.get(n.name);
                match seen.nodes.get_mut(name) {
                    Some((gauge, at)) => {
                        gauge.set(lag);
                        *at = sample;
                    }
                    None => {
                        let gauge = self.heartbeat_lag.with_label_values(&[name]);
                        gauge.set(lag);
                        seen.nodes.insert(name.to_string(), (gauge, sample));
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
        let mut racks = HashSet::new();
        for &(label, weight) in &c.overload {
            let rack = c.text.get(label);
            self.overload.with_label_values(&[rack]).set(weight);
            racks.insert(rack.to_string());
        }
        if let Some(stats) = &c.stats {
            self.engine.sample(stats);
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
        // quadratic, about 10^8 comparisons per tick.)
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

    fn stored(&self, writes: usize, seconds: f64) {
        self.commit_seconds.observe(seconds);
        self.store_writes.inc_by(writes as u64);
    }

    fn tick(&self, cluster: &Cluster, now_ms: i64) {
        self.sampler.hand(self.copy(cluster, now_ms));
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
        m.sampled
            .utilization
            .with_label_values(&["cluster", "all"])
            .set(0.5);
        m.sampled.heartbeat_lag.with_label_values(&["n1"]).set(1.0);
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

    /// The core's tick only copies; the series are set on the
    /// `dispatch-metrics` thread, and a copy taken before the replica
    /// stepped down is never applied (no stale series on a follower).
    #[test]
    fn the_tick_samples_off_the_core_and_a_stale_copy_is_dropped() {
        use crate::cluster::tests::register_node;
        use crate::cluster::{ClusterConfig, Effects};
        let m = Metrics::new().unwrap();
        m.set_leader(true);
        let mut c = Cluster::new(ClusterConfig::default());
        let mut fx = Effects::default();
        register_node(&mut c, "a", "1s:2c:1t", ("z1", "r1"), 1_000, &mut fx);
        c.settle(1_000, &mut fx);
        Observer::tick(&m, &c, 3_000);
        m.wait_sampled();
        let text = scrape(&m);
        assert!(
            text.contains("dispatch_agent_heartbeat_lag_seconds{node=\"a\"} 2"),
            "{text}"
        );
        assert!(text.contains("dispatch_nodes{state=\"ready\"} 1"), "{text}");
        assert!(
            text.contains("dispatch_utilization{domain=\"z1/r1\",level=\"rack\"} 0"),
            "{text}"
        );
        // A copy of the old term, applied after stepping down, sets nothing.
        let stale = m.copy(&c, 4_000);
        m.set_leader(false);
        m.sampled.apply(stale);
        let text = scrape(&m);
        assert!(
            !text.contains("dispatch_agent_heartbeat_lag_seconds{"),
            "{text}"
        );
        assert!(!text.contains("dispatch_nodes{"), "{text}");
        // The next term's copies apply again.
        m.set_leader(true);
        Observer::tick(&m, &c, 5_000);
        m.wait_sampled();
        assert!(
            scrape(&m).contains("dispatch_agent_heartbeat_lag_seconds{node=\"a\"} 4"),
            "{}",
            scrape(&m)
        );
    }
}
