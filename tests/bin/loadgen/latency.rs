//! Latency histograms per kind of call (HDR histograms in microseconds,
//! 3 significant digits), shared by every task of the load generator, and
//! their summary rows.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;

/// What a latency sample measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// Attach opened and Register sent -> Registered received.
    Register,
    /// SubmitJob call (from its scheduled send time).
    SubmitJob,
    /// SubmitJobs call of a batch (from its scheduled send time).
    SubmitJobs,
    /// SubmitJob of an array of unplaceable jobs (the pending-memory step,
    /// before any node is attached).
    SubmitPending,
    /// GetJob call.
    GetJob,
    /// ListNodes call.
    ListNodes,
    /// A job's scheduled submit time -> its Assign received by a fake agent.
    Assign,
}

impl Kind {
    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Register => "Attach->Registered",
            Kind::SubmitJob => "SubmitJob",
            Kind::SubmitJobs => "SubmitJobs",
            Kind::SubmitPending => "SubmitJob, arrays of 1000 pending",
            Kind::GetJob => "GetJob",
            Kind::ListNodes => "ListNodes",
            Kind::Assign => "submit->Assign",
        }
    }
}

/// Longest latency a histogram holds (longer samples are clamped): 1 hour.
const MAX_US: u64 = 3_600_000_000;

struct Entry {
    hist: Histogram<u64>,
    errors: u64,
    last_error: Option<String>,
}

impl Entry {
    fn new() -> Self {
        Self {
            // 1 us .. 1 h at 3 significant digits: bounds are constants.
            hist: Histogram::new_with_bounds(1, MAX_US, 3)
                .unwrap_or_else(|e| panic!("constant histogram bounds are valid: {e}")),
            errors: 0,
            last_error: None,
        }
    }
}

/// All histograms of a run.
#[derive(Default)]
pub struct Latencies {
    entries: Mutex<BTreeMap<Kind, Entry>>,
}

impl Latencies {
    /// Record one successful call.
    pub fn record(&self, kind: Kind, took: Duration) {
        let us = (took.as_micros() as u64).clamp(1, MAX_US);
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let entry = entries.entry(kind).or_insert_with(Entry::new);
        // In bounds after the clamp, so this cannot fail.
        let _ = entry.hist.record(us);
    }

    /// Record one failed call.
    pub fn error(&self, kind: Kind, what: impl std::fmt::Display) {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let entry = entries.entry(kind).or_insert_with(Entry::new);
        entry.errors += 1;
        entry.last_error = Some(what.to_string());
    }

    /// Successful samples of `kind` so far.
    #[cfg(test)]
    pub fn count(&self, kind: Kind) -> u64 {
        let entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        entries.get(&kind).map_or(0, |e| e.hist.len())
    }

    /// One row per kind seen; `rate` divides the count by `seconds[kind]`
    /// (the phase the kind ran in).
    pub fn summary(&self, seconds: impl Fn(Kind) -> f64) -> Vec<LatencyRow> {
        let entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        entries
            .iter()
            .map(|(&kind, e)| {
                let ms = |q: f64| e.hist.value_at_quantile(q) as f64 / 1000.0;
                let secs = seconds(kind);
                LatencyRow {
                    kind: kind.name().to_string(),
                    count: e.hist.len(),
                    errors: e.errors,
                    rate_per_s: if secs > 0.0 {
                        e.hist.len() as f64 / secs
                    } else {
                        0.0
                    },
                    p50_ms: ms(0.5),
                    p99_ms: ms(0.99),
                    p999_ms: ms(0.999),
                    max_ms: e.hist.max() as f64 / 1000.0,
                    last_error: e.last_error.clone(),
                }
            })
            .collect()
    }
}

/// A summary of one kind.
#[derive(Clone, Debug, Serialize)]
pub struct LatencyRow {
    /// [`Kind::name`].
    pub kind: String,
    /// Successful calls.
    pub count: u64,
    /// Failed calls.
    pub errors: u64,
    /// Successful calls per second of the phase.
    pub rate_per_s: f64,
    /// Quantiles and maximum, milliseconds.
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
    /// The last error's message, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_come_from_the_samples() {
        let lat = Latencies::default();
        for ms in 1..=1000u64 {
            lat.record(Kind::GetJob, Duration::from_millis(ms));
        }
        lat.error(Kind::GetJob, "boom");
        let rows = lat.summary(|_| 10.0);
        assert_eq!(rows.len(), 1);
        let r = &rows[0];
        assert_eq!((r.kind.as_str(), r.count, r.errors), ("GetJob", 1000, 1));
        assert!((r.rate_per_s - 100.0).abs() < 1e-9);
        // 3 significant digits: within 0.1%.
        assert!((r.p50_ms - 500.0).abs() <= 0.5, "{}", r.p50_ms);
        assert!((r.p99_ms - 990.0).abs() <= 1.0, "{}", r.p99_ms);
        assert!((r.max_ms - 1000.0).abs() <= 1.0, "{}", r.max_ms);
        assert_eq!(r.last_error.as_deref(), Some("boom"));
    }

    #[test]
    fn samples_beyond_the_bounds_are_clamped_not_lost() {
        let lat = Latencies::default();
        lat.record(Kind::Assign, Duration::ZERO);
        lat.record(Kind::Assign, Duration::from_secs(10 * 3600));
        assert_eq!(lat.count(Kind::Assign), 2);
    }
}
