//! Prometheus plumbing both binaries share: metric families (for the OTLP
//! bridge), the engine's schedstats as counters ([`EngineCounters`]), the
//! text exposition format ([`render`]) and the `/metrics` scrape endpoint
//! ([`router`], [`spawn_server`]). Every metric is an atomic, so a scrape
//! never holds up the code that samples into the registry.

use std::net::SocketAddr;
use std::sync::Mutex;

use axum::http::header::CONTENT_TYPE;
use prometheus::core::Collector;
use prometheus::proto::MetricType;
use prometheus::{Encoder, IntCounter, IntCounterVec, Opts, Registry, TextEncoder};
use sched::Schedstats;

/// The content type of [`render`]'s output.
pub const CONTENT_TYPE_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

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
pub fn schedstat_fields(s: &Schedstats) -> [(&'static str, u64); 23] {
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
        ("latency_pull", s.latency_pull),
        ("fifo_pull", s.fifo_pull),
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
/// `GET /metrics` rendering `registry`: a router to serve alone or to
/// merge into a larger one (the dispatcher's web page).
pub fn router(registry: Registry) -> axum::Router {
    axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let registry = registry.clone();
            async move { ([(CONTENT_TYPE, CONTENT_TYPE_TEXT)], render(&registry)) }
        }),
    )
}

/// Serve `GET /metrics` for `registry` on `listener` until the task is
/// dropped or the listener fails.
pub async fn serve(listener: tokio::net::TcpListener, registry: Registry) -> std::io::Result<()> {
    axum::serve(listener, router(registry)).await
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

#[cfg(test)]
mod tests {
    use super::*;

    fn counter(text: &str, series: &str) -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {series} in\n{text}"))
    }

    /// Every field of `Schedstats` is exported (its `Debug` lists them):
    /// a counter added to the engine and forgotten here fails.
    #[test]
    fn schedstat_fields_name_every_field_in_order() {
        let debug = format!("{:?}", Schedstats::default());
        let declared: Vec<&str> = debug
            .split(['{', ',', '}'])
            .filter_map(|part| part.split_once(':').map(|(name, _)| name.trim()))
            .collect();
        let exported: Vec<&str> = schedstat_fields(&Schedstats::default())
            .iter()
            .map(|(name, _)| *name)
            .collect();
        assert_eq!(exported, declared);
    }

    #[test]
    fn engine_counters_add_deltas_and_survive_an_engine_rebuild() {
        let registry = Registry::new();
        let c = EngineCounters::new(&registry, "t", ["smt", "llc", "cross_llc"]).unwrap();
        // Every series is there from the first scrape, at zero.
        let text = render(&registry);
        assert_eq!(counter(&text, "t_steals_total{level=\"cross_llc\"}"), 0);
        assert_eq!(counter(&text, "t_schedstat_total{stat=\"nr_switches\"}"), 0);
        let s = Schedstats {
            steal: 5,
            steal_smt: 1,
            steal_cross_llc: 3,
            steal_fail: 2,
            ..Schedstats::default()
        };
        c.sample(&s);
        c.sample(&s);
        let text = render(&registry);
        assert_eq!(counter(&text, "t_steals_total{level=\"smt\"}"), 1);
        assert_eq!(counter(&text, "t_steals_total{level=\"llc\"}"), 1);
        assert_eq!(counter(&text, "t_steals_total{level=\"cross_llc\"}"), 3);
        assert_eq!(counter(&text, "t_steal_failures_total"), 2);
        // A rebuilt engine starts from zero: its new counts add on.
        c.sample(&Schedstats {
            steal: 1,
            steal_cross_llc: 1,
            ..Schedstats::default()
        });
        let text = render(&registry);
        assert_eq!(counter(&text, "t_steals_total{level=\"cross_llc\"}"), 4);
        assert_eq!(counter(&text, "t_schedstat_total{stat=\"steal\"}"), 6);
    }

    #[tokio::test]
    async fn the_scrape_server_serves_the_registry() {
        let registry = Registry::new();
        let c = IntCounter::new("t_hits_total", "Hits.").unwrap();
        registry.register(Box::new(c.clone())).unwrap();
        c.inc_by(7);
        let addr = spawn_server(SocketAddr::from(([127, 0, 0, 1], 0)), registry)
            .await
            .unwrap();
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut body = String::new();
        s.read_to_string(&mut body).await.unwrap();
        assert!(body.starts_with("HTTP/1.1 200"), "{body}");
        assert!(body.contains(CONTENT_TYPE_TEXT), "{body}");
        assert!(body.contains("t_hits_total 7"), "{body}");
    }
}
