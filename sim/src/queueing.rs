//! The validation mode: the simulator's own event loop and baseline
//! policies on queueing models with known answers (service rate mu = 1,
//! one CPU per node, exponential work, Poisson arrivals), so tests can hold
//! the simulator to closed forms.
//!
//! * M/M/1 (one server): mean response `1 / (mu - lambda)`.
//! * The supermarket model (n servers, each arrival joins the shortest of
//!   `d` queues sampled at random, FIFO): as n grows the mean response
//!   tends to `sum_{i>=1} lambda^((d^i - d)/(d - 1))` (Mitzenmacher;
//!   Vvedenskaya, Dobrushin and Karpelevich). For d = 1 every server is an
//!   independent M/M/1 queue at load lambda: `1 / (1 - lambda)`, the
//!   limit of the sum as d -> 1.

use serde::Serialize;

use crate::US_PER_S;
use crate::dist::{Arrivals, Choice, Durations};
use crate::engine::{SimConfig, simulate};
use crate::error::{Result, SimError};
use crate::layout::Layout;
use crate::metrics;
use crate::policy::PolicySpec;
use crate::workload::{SyntheticParams, synthetic};

/// M/M/1 mean response time.
pub fn mm1_mean_response(lambda: f64, mu: f64) -> f64 {
    1.0 / (mu - lambda)
}

/// The supermarket model's limiting mean response time (mu = 1).
pub fn supermarket_limit(lambda: f64, d: u32) -> f64 {
    if d <= 1 {
        return 1.0 / (1.0 - lambda);
    }
    let d = d as f64;
    let mut sum = 0.0;
    for i in 1..64 {
        let e = (d.powi(i) - d) / (d - 1.0);
        let term = lambda.powf(e);
        sum += term;
        if term < 1e-15 {
            break;
        }
    }
    sum
}

/// A validation run.
#[derive(Clone, Debug, PartialEq)]
pub struct QueueingParams {
    /// Servers (1 = M/M/1).
    pub servers: usize,
    /// Arrival rate per server (= load, mu = 1).
    pub load: f64,
    /// Queues sampled per arrival.
    pub d: u32,
    /// Arrivals stop after this many service times.
    pub horizon: f64,
    /// Jobs arriving before this are not measured (warm-up).
    pub warmup: f64,
    /// Seed.
    pub seed: u64,
}

/// Its outcome.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct QueueingResult {
    /// "M/M/1" or "supermarket".
    pub model: String,
    /// Servers.
    pub servers: usize,
    /// Load per server.
    pub load: f64,
    /// Choices.
    pub d: u32,
    /// Jobs measured.
    pub jobs: u64,
    /// Simulated mean response.
    pub measured: f64,
    /// The closed form.
    pub closed_form: f64,
    /// (measured - closed form) / closed form.
    pub rel_error: f64,
}

/// Simulate the model and compare with its closed form.
pub fn run(p: &QueueingParams) -> Result<QueueingResult> {
    if p.servers == 0 || !(p.load > 0.0 && p.load < 1.0) || p.d == 0 || p.horizon <= p.warmup {
        return Err(SimError::Workload(
            "validation needs servers >= 1, 0 < load < 1, d >= 1, horizon > warmup".into(),
        ));
    }
    let layout = Layout::new(&format!("1z:1r:{}n", p.servers), "1s:1c:1t")?;
    let jobs = (p.load * p.servers as f64 * p.horizon).round() as usize;
    let params = SyntheticParams {
        jobs,
        load: p.load,
        arrivals: Arrivals::Poisson,
        durations: Durations::Exp { mean: 1.0 },
        cpus: Choice::constant(1),
        latency_frac: 0.0,
        fanout_prob: 0.0,
        fanout_k: 0,
        pipeline_prob: 0.0,
        pipeline_len: 1,
        limit_overestimate: None,
        seed: p.seed,
    };
    let w = synthetic(&params, layout.capacity(), 1)?;
    let policy = if p.d == 1 {
        PolicySpec::parse("random")?
    } else {
        PolicySpec::parse(&format!("pod:{}", p.d))?
    };
    let cfg = SimConfig {
        sample_us: (p.horizon * US_PER_S as f64) as u64,
        seed: p.seed,
        ..SimConfig::default()
    };
    let out = simulate(&layout, &w, &policy, &cfg, &mut |_| {})?;
    let rep = metrics::report(out, &w, &layout, (p.warmup * US_PER_S as f64) as u64);
    let (model, closed_form) = if p.servers == 1 {
        ("M/M/1", mm1_mean_response(p.load, 1.0))
    } else {
        ("supermarket", supermarket_limit(p.load, p.d))
    };
    Ok(QueueingResult {
        model: model.into(),
        servers: p.servers,
        load: p.load,
        d: p.d,
        jobs: rep.jobs,
        measured: rep.resp_mean_s,
        closed_form,
        rel_error: (rep.resp_mean_s - closed_form) / closed_form,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closed_forms() {
        assert!((mm1_mean_response(0.5, 1.0) - 2.0).abs() < 1e-12);
        assert!((supermarket_limit(0.9, 1) - 10.0).abs() < 1e-9);
        // 1 + 0.9^2 + 0.9^6 + 0.9^14 + 0.9^30 + ...
        let d2 = 1.0 + 0.81 + 0.9f64.powi(6) + 0.9f64.powi(14) + 0.9f64.powi(30) + 0.9f64.powi(62);
        assert!((supermarket_limit(0.9, 2) - d2).abs() < 1e-3);
        assert!(supermarket_limit(0.9, 3) < supermarket_limit(0.9, 2));
    }
}
