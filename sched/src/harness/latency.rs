//! Seed 004's experiment: a latency-sensitive class beside a batch load.
//! As in Shrikanth Hegde's runs in the seed's thread (one cgroup of
//! latency-sensitive wakers, one of hackbench), the machine runs
//! hackbench (the batch class, which "mainly wants to run longer slice to
//! move forward") and a set of periodic tasks with latency-nice -20 (the
//! latency class: schbench-like, sleep a jittered period, wake, run a short
//! burst). It measures, in one run per configuration:
//!
//! - wake-to-run latency percentiles of each class (the harness records
//!   every wakeup's latency);
//! - batch throughput: hackbench messages per simulated second up to the
//!   exit of its last task (the seed's risk: hackbench regressed up to 50%
//!   with latency-nice).
//!
//! [`run_comparison`] runs latency-nice off, on, and on with the batch
//! class at latency-nice +19 (longer slices, later picks), with every
//! other constant shared.

use std::sync::Arc;

use super::hackbench::Hackbench;
use super::{Harness, HarnessConfig, HarnessError, RunStats, Step, StepCx, Workload};
use crate::config::SchedConfig;
use crate::sched::Sched;
use crate::task::{TaskId, TaskSpec};
use crate::topology::Topology;

/// Parameters of one run.
#[derive(Clone, Debug, PartialEq)]
pub struct LatencyParams {
    /// Topology spec.
    pub topology: String,
    /// Hackbench groups (the batch class).
    pub groups: usize,
    /// Senders and receivers per group.
    pub fds: usize,
    /// Hackbench rounds per sender.
    pub loops: u64,
    /// Hackbench pipe capacity in messages.
    pub pipe_capacity: u32,
    /// Tasks of the latency class.
    pub nr_latency: usize,
    /// Mean sleep of a latency task between bursts, ns.
    pub period_ns: u64,
    /// Mean burst of a latency task, ns.
    pub burst_ns: u64,
    /// Latency-nice of the latency class.
    pub latency_nice: i32,
    /// Spread of every cost and period, `+-` this fraction.
    pub jitter: f64,
    /// Harness settings.
    pub harness: HarnessConfig,
}

impl Default for LatencyParams {
    fn default() -> Self {
        Self {
            topology: "1s:4c:2t".to_string(),
            groups: 1,
            fds: 10,
            loops: 400,
            pipe_capacity: 64,
            nr_latency: 8,
            period_ns: 2_000_000,
            burst_ns: 100_000,
            latency_nice: -20,
            jitter: 0.5,
            harness: HarnessConfig::default(),
        }
    }
}

/// Outcome of one run.
#[derive(Clone, Debug, PartialEq)]
pub struct LatencyResult {
    /// Latency-nice honoured (`SchedConfig::latency`).
    pub latency_on: bool,
    /// Latency-nice of the batch class.
    pub batch_latency_nice: i32,
    /// Latency-class wake-to-run latency: median and 99th percentile, ns.
    pub lat_p50_ns: u64,
    /// See `lat_p50_ns`.
    pub lat_p99_ns: u64,
    /// Latency-class 99.9th percentile, ns (the tail beyond p99).
    pub lat_p999_ns: u64,
    /// Batch-class wake-to-run latency: median and 99th percentile, ns.
    pub batch_p50_ns: u64,
    /// See `batch_p50_ns`.
    pub batch_p99_ns: u64,
    /// Wakeups measured per class (latency, batch).
    pub samples: (usize, usize),
    /// Hackbench messages read.
    pub messages: u64,
    /// Simulated time when the last hackbench task exited, ns.
    pub batch_elapsed_ns: u64,
    /// The run's measurements.
    pub run: RunStats,
    /// Conservation problems (empty when the run is consistent).
    pub problems: Vec<String>,
}

impl LatencyResult {
    /// Hackbench messages per simulated second.
    pub fn batch_throughput(&self) -> f64 {
        if self.batch_elapsed_ns == 0 {
            0.0
        } else {
            self.messages as f64 * 1e9 / self.batch_elapsed_ns as f64
        }
    }
}

/// Hackbench for tasks `0..nr_batch`, periodic latency tasks after them.
struct Mix {
    hb: Hackbench,
    nr_batch: usize,
    batch_exited: usize,
    batch_end: u64,
    period_ns: u64,
    burst_ns: u64,
    jitter: f64,
    /// Per latency task: its next step is a burst (it just woke).
    awake: Vec<bool>,
}

impl Workload for Mix {
    fn step(&mut self, task: TaskId, cx: &mut StepCx<'_>) -> Step {
        let Ok(i) = usize::try_from(task.0) else {
            return Step::Exit;
        };
        if i < self.nr_batch {
            let s = self.hb.step(task, cx);
            if s == Step::Exit {
                self.batch_exited += 1;
                if self.batch_exited == self.nr_batch {
                    self.batch_end = cx.now();
                }
            }
            return s;
        }
        let Some(awake) = self.awake.get_mut(i - self.nr_batch) else {
            return Step::Exit;
        };
        if self.batch_exited == self.nr_batch {
            return Step::Exit;
        }
        *awake = !*awake;
        if *awake {
            Step::Sleep(cx.rng().jitter(self.period_ns, self.jitter))
        } else {
            Step::Run(cx.rng().jitter(self.burst_ns, self.jitter))
        }
    }
}

/// The `q`-quantile (0..=1) of `v` (sorted in place); 0 when empty.
fn quantile(v: &mut [u64], q: f64) -> u64 {
    if v.is_empty() {
        return 0;
    }
    v.sort_unstable();
    let idx = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
    v[idx]
}

/// One run with engine configuration `config` (capacity 1 per leaf) and
/// the batch class at `batch_latency_nice`.
pub fn run(
    params: &LatencyParams,
    config: &SchedConfig,
    batch_latency_nice: i32,
) -> Result<LatencyResult, HarnessError> {
    let topo = Arc::new(Topology::from_spec(&params.topology)?);
    let sched = Sched::new(topo, 1, config.clone());
    let fds = params.fds.max(1);
    let hb = Hackbench::new(
        params.groups,
        fds,
        params.loops,
        params.pipe_capacity,
        params.jitter,
    );
    let nr_batch = hb.nr_tasks();
    let workload = Mix {
        hb,
        nr_batch,
        batch_exited: 0,
        batch_end: 0,
        period_ns: params.period_ns,
        burst_ns: params.burst_ns,
        jitter: params.jitter,
        // The first step after the fork is a burst.
        awake: vec![false; params.nr_latency],
    };
    let mut h = Harness::new(sched, workload, params.harness.clone());
    h.record_wake_latencies();
    for i in 0..nr_batch + params.nr_latency {
        let id = h.next_id();
        let mut spec = TaskSpec::new(id);
        spec.latency_nice = if i < nr_batch {
            batch_latency_nice
        } else {
            params.latency_nice
        };
        h.add_task(spec)?;
        h.start_at(id, 0);
    }
    let run = h.run();
    let mut lat = Vec::new();
    let mut batch = Vec::new();
    for &(t, ns) in &run.wake_latencies {
        if (t as usize) < nr_batch {
            batch.push(ns);
        } else {
            lat.push(ns);
        }
    }
    let (_, received) = h.workload().hb.messages();
    let expected = params.groups as u64 * (fds * fds) as u64 * params.loops;
    let mut problems = super::check_conservation(&run, h.sched());
    if received != expected {
        problems.push(format!("messages: {received} read, {expected} expected"));
    }
    Ok(LatencyResult {
        latency_on: config.latency,
        batch_latency_nice,
        samples: (lat.len(), batch.len()),
        lat_p50_ns: quantile(&mut lat, 0.5),
        lat_p99_ns: quantile(&mut lat, 0.99),
        lat_p999_ns: quantile(&mut lat, 0.999),
        batch_p50_ns: quantile(&mut batch, 0.5),
        batch_p99_ns: quantile(&mut batch, 0.99),
        messages: received,
        batch_elapsed_ns: h.workload().batch_end,
        run,
        problems,
    })
}

/// The comparison, same constants in every run: latency-nice off; on;
/// on with the batch class at latency-nice +19.
pub fn run_comparison(params: &LatencyParams) -> Result<Vec<LatencyResult>, HarnessError> {
    let config = |latency| SchedConfig {
        latency,
        ..SchedConfig::default()
    };
    Ok(vec![
        run(params, &config(false), 0)?,
        run(params, &config(true), 0)?,
        run(params, &config(true), 19)?,
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> LatencyParams {
        LatencyParams {
            loops: 300,
            ..LatencyParams::default()
        }
    }

    #[test]
    fn quantiles() {
        let mut v = vec![5, 1, 4, 2, 3];
        assert_eq!(quantile(&mut v, 0.5), 3);
        assert_eq!(quantile(&mut v, 0.99), 5);
        assert_eq!(quantile(&mut [], 0.99), 0);
    }

    #[test]
    fn runs_are_consistent_and_measure_both_classes() {
        for r in run_comparison(&small()).unwrap() {
            assert!(r.problems.is_empty(), "{:?}", r.problems);
            assert!(r.samples.0 > 50 && r.samples.1 > 100, "{:?}", r.samples);
            assert!(r.batch_throughput() > 0.0);
        }
    }

    /// Seed 004's purpose: with latency-nice honoured, the latency class
    /// waits less than with it off, in the same simulated machine.
    #[test]
    fn latency_nice_shortens_the_latency_class_wait() {
        let rs = run_comparison(&small()).unwrap();
        assert!(
            rs[1].lat_p99_ns < rs[0].lat_p99_ns,
            "p99 on {} vs off {}",
            rs[1].lat_p99_ns,
            rs[0].lat_p99_ns
        );
    }
}
