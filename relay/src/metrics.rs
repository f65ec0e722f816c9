//! Prometheus metrics of the relay, the agent's way: off by default,
//! `dispatch-relay --metrics-listen ADDR` serves `GET /metrics` with
//! [`dispatch_telemetry::prom`]'s scrape server, and with OTLP on the same
//! registry is exported as OTel instruments ([`RelayMetrics::families`]).
//!
//! Nothing on the data path touches the registry: the stream task counts
//! in relaxed atomics ([`Upstream::stats`]) and a scrape reads them
//! ([`RelayMetrics`] is a `Collector` that refreshes its series from the
//! reading when gathered).
//!
//! Metric names (all prefixed `dispatch_relay_`):
//!
//! | name | type | labels |
//! |---|---|---|
//! | `dispatch_relay_agents` | gauge | |
//! | `dispatch_relay_upstream_connected` | gauge (0/1) | |
//! | `dispatch_relay_queue_depth` | gauge | |
//! | `dispatch_relay_queue_capacity` | gauge | |
//! | `dispatch_relay_frames_total` | counter | `direction` = up / down |
//! | `dispatch_relay_messages_total` | counter | `direction` = up / down |
//! | `dispatch_relay_bytes_total` | counter | `direction` = up / down |
//! | `dispatch_relay_reconnects_total` | counter | |
//! | `dispatch_relay_connect_failures_total` | counter | |

use std::sync::Mutex;

use dispatch_telemetry::{Family, add_families};
use prometheus::core::{Collector, Desc};
use prometheus::proto::{MetricFamily, MetricType};
use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts, Registry};

use crate::upstream::{Stats, Upstream};

/// The relay's metrics, read from its [`Upstream`] at each scrape.
pub struct RelayMetrics {
    /// The registry served on /metrics.
    pub registry: Registry,
    families: Vec<Family>,
}

/// The series, refreshed from the upstream's reading when gathered.
struct Series {
    upstream: Upstream,
    capacity: u64,
    agents: IntGauge,
    connected: IntGauge,
    queue_depth: IntGauge,
    queue_capacity: IntGauge,
    frames: IntCounterVec,
    messages: IntCounterVec,
    bytes: IntCounterVec,
    reconnects: IntCounter,
    connect_failures: IntCounter,
    /// The reading the counters were last brought to.
    last: Mutex<Stats>,
}

impl RelayMetrics {
    /// A fresh registry reading `upstream`, whose queue holds `capacity`
    /// messages (`--queue`).
    pub fn new(upstream: Upstream, capacity: usize) -> prometheus::Result<Self> {
        let gauge = |name: &str, help: &str| IntGauge::new(format!("dispatch_relay_{name}"), help);
        let by_direction = |name: &str, help: &str| {
            IntCounterVec::new(
                Opts::new(format!("dispatch_relay_{name}"), help),
                &["direction"],
            )
        };
        let series = Series {
            upstream,
            capacity: capacity as u64,
            agents: gauge(
                "agents",
                "Agents attached through the relay (live sessions on its stream).",
            )?,
            connected: gauge(
                "upstream_connected",
                "1 while the relay's AttachMany stream to a dispatcher is open, else 0.",
            )?,
            queue_depth: gauge(
                "queue_depth",
                "Agents' messages waiting for the stream to the dispatcher.",
            )?,
            queue_capacity: gauge(
                "queue_capacity",
                "Messages the queue holds before the relay stops reading its agents (--queue).",
            )?,
            frames: by_direction(
                "frames_total",
                "AttachMany frames: up (RelayMessage, to the dispatcher) and down (RelayReply).",
            )?,
            messages: by_direction(
                "messages_total",
                "Node messages carried in the frames (up: agents' messages and Detaches; down: replies and session ends).",
            )?,
            bytes: by_direction("bytes_total", "Encoded bytes of the frames.")?,
            reconnects: IntCounter::new(
                "dispatch_relay_reconnects_total",
                "Streams to a dispatcher opened after an earlier one broke (every agent reattached).",
            )?,
            connect_failures: IntCounter::new(
                "dispatch_relay_connect_failures_total",
                "Attempts to open the stream that failed (unreachable, refused, redirected to the leader).",
            )?,
            last: Mutex::new(Stats::default()),
        };
        for d in ["up", "down"] {
            series.frames.with_label_values(&[d]);
            series.messages.with_label_values(&[d]);
            series.bytes.with_label_values(&[d]);
        }
        let mut families = Vec::new();
        for g in [
            &series.agents,
            &series.connected,
            &series.queue_depth,
            &series.queue_capacity,
        ] {
            add_families(&mut families, g, MetricType::GAUGE);
        }
        for c in [&series.frames, &series.messages, &series.bytes] {
            add_families(&mut families, c, MetricType::COUNTER);
        }
        add_families(&mut families, &series.reconnects, MetricType::COUNTER);
        add_families(&mut families, &series.connect_failures, MetricType::COUNTER);
        let registry = Registry::new();
        registry.register(Box::new(series))?;
        Ok(Self { registry, families })
    }

    /// Name, help and type of every family, for bridging to OTLP.
    pub fn families(&self) -> Vec<Family> {
        self.families.clone()
    }
}

impl Series {
    /// Bring every series to the upstream's reading now.
    fn refresh(&self) {
        let now = self.upstream.stats();
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        self.agents.set(now.agents as i64);
        self.connected.set(i64::from(now.connected));
        self.queue_depth.set(now.queue_depth as i64);
        self.queue_capacity.set(self.capacity as i64);
        let up = |c: &IntCounterVec, new: u64, old: u64, dir: &str| {
            c.with_label_values(&[dir]).inc_by(new.saturating_sub(old));
        };
        up(&self.frames, now.frames_up, last.frames_up, "up");
        up(&self.frames, now.frames_down, last.frames_down, "down");
        up(&self.messages, now.messages_up, last.messages_up, "up");
        up(
            &self.messages,
            now.messages_down,
            last.messages_down,
            "down",
        );
        up(&self.bytes, now.bytes_up, last.bytes_up, "up");
        up(&self.bytes, now.bytes_down, last.bytes_down, "down");
        self.reconnects
            .inc_by(now.reconnects.saturating_sub(last.reconnects));
        self.connect_failures
            .inc_by(now.connect_failures.saturating_sub(last.connect_failures));
        *last = now;
    }

    fn collectors(&self) -> [&dyn Collector; 9] {
        [
            &self.agents,
            &self.connected,
            &self.queue_depth,
            &self.queue_capacity,
            &self.frames,
            &self.messages,
            &self.bytes,
            &self.reconnects,
            &self.connect_failures,
        ]
    }
}

impl Collector for Series {
    fn desc(&self) -> Vec<&Desc> {
        self.collectors()
            .into_iter()
            .flat_map(|c| c.desc())
            .collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.refresh();
        self.collectors()
            .into_iter()
            .flat_map(|c| c.collect())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::upstream::Config;

    fn value(text: &str, series: &str) -> i64 {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {series} in\n{text}"))
    }

    /// A scrape reads the upstream at that moment (agents attached, the
    /// queue's depth, no stream); every family is there from the
    /// first scrape, and bridged.
    #[tokio::test]
    async fn a_scrape_reads_the_upstream_now() {
        // Not started: nothing drains the queue nor ends the sessions.
        let (up, _task) = Upstream::unstarted(Config::plain("http://127.0.0.1:1"));
        let m = RelayMetrics::new(up.clone(), 4096).expect("registry");
        let text = dispatch_telemetry::render(&m.registry);
        assert_eq!(value(&text, "dispatch_relay_agents"), 0);
        assert_eq!(value(&text, "dispatch_relay_upstream_connected"), 0);
        assert_eq!(value(&text, "dispatch_relay_queue_capacity"), 4096);
        assert_eq!(
            value(&text, "dispatch_relay_frames_total{direction=\"up\"}"),
            0
        );
        let (a, _arx) = up.open().expect("slot");
        let (_b, _brx) = up.open().expect("slot");
        a.send(Default::default()).await.expect("queued");
        let text = dispatch_telemetry::render(&m.registry);
        assert_eq!(value(&text, "dispatch_relay_agents"), 2);
        assert_eq!(
            value(&text, "dispatch_relay_queue_depth"),
            1,
            "no stream drains it"
        );
        drop(a);
        let text = dispatch_telemetry::render(&m.registry);
        assert_eq!(value(&text, "dispatch_relay_agents"), 1);
        let names: Vec<_> = m.families().into_iter().map(|f| f.0).collect();
        for name in [
            "dispatch_relay_agents",
            "dispatch_relay_frames_total",
            "dispatch_relay_reconnects_total",
        ] {
            assert!(names.iter().any(|n| n == name), "{name} not in {names:?}");
            assert!(
                text.contains(&format!("# TYPE {name} ")),
                "{name} not scraped"
            );
        }
    }
}
