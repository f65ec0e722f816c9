//! Seed 001's experiment: smart wake-affine (`wake_wide`) on a fan-out
//! workload and on 1:1 ping-pong pairs, with the feature on and off.
//!
//! This module owns the two workloads and their runners.
//!
//! **Fan-out** ([`run_fanout`]), shaped like pgbench: one server task keeps
//! one request in flight per worker (a pgbench client per connection). It
//! sends a request to a worker (waking it), and when the worker's reply
//! comes back it sends that worker its next request. A worker serves a
//! request (`work_ns` of CPU), then writes a result record to one of the
//! `collectors` (round-robin per worker, like backends sharing WAL
//! writers or the reducers of a shuffle) and replies to the server, then
//! sleeps until its next request. The collectors give the workers their
//! own wakee flips: with seed 001's formula (`wakee.flips > factor &&
//! waker.flips > factor * wakee.flips`) a wakee that only ever wakes its
//! server would never be spread, however wide its server fans out. The
//! server costs `send + recv (+ server_ns)` per request, so it saturates
//! at 1 / 4 us = 250,000 requests/s with the default costs: beyond ~40
//! workers both arms sit on that plateau.
//!
//! **Ping-pong** ([`run_pingpong`]): pairs of tasks; A sends to B, B
//! serves (`work_ns`) and replies, A thinks (`think_ns`) and sends again.
//! Neither ever switches wakee, so `wake_wide` must never fire and the two
//! configurations must behave identically.
//!
//! All wakes are `WF_SYNC` (pipe and socket writes are). Tasks are forked
//! at time 0 and placed by the slow path. Both configurations share every
//! constant; only [`SchedConfig::wake_wide`] differs. The comparison runs
//! with cross-LLC stealing on in both arms ([`wake_wide_config`] says
//! why).

use std::collections::VecDeque;
use std::sync::Arc;

use super::pipe::{Pipe, ReadOutcome, WriteOutcome};
use super::{Harness, HarnessConfig, HarnessError, NSEC_PER_SEC, RunStats, Step, StepCx, Workload};
use crate::config::SchedConfig;
use crate::sched::Sched;
use crate::task::{TaskId, TaskSpec};
use crate::topology::Topology;

/// The engine settings of the comparison: defaults, with `wake_wide` as
/// given and cross-LLC stealing on (the same in both arms).
///
/// Why cross-LLC stealing: the engine has no periodic load balancer, the
/// mechanism that in the kernel spreads tasks back over the LLCs while
/// affine wakeups pull them toward the waker. Without one, a pile-up in
/// the waker's LLC is an absorbing state, and it is reached in both arms
/// during the warm-up, before any wakee has made the `factor + 1` flips
/// that `wake_wide` needs; the outcome then depends on the start
/// transient, not on the feature. `steal_cross_llc` (the per-domain LLC
/// masks proposed in seed 000's thread) is the engine's only mechanism
/// that moves tasks between LLCs, so it stands in for the balancer.
pub fn wake_wide_config(wake_wide: bool) -> SchedConfig {
    SchedConfig {
        wake_wide,
        steal_cross_llc: true,
        ..SchedConfig::default()
    }
}

/// Parameters of a fan-out run.
#[derive(Clone, Debug, PartialEq)]
pub struct FanoutParams {
    /// Topology spec; two LLCs ("2s:10c:2t") so that pulling wakees to the
    /// waker's LLC can leave the other one idle.
    pub topology: String,
    /// Worker tasks (the seed's "clients").
    pub workers: usize,
    /// Collector tasks.
    pub collectors: usize,
    /// Requests served in total.
    pub items: u64,
    /// CPU time of serving one request.
    pub work_ns: u64,
    /// CPU time the server spends per request besides the send and the
    /// receive (pgbench's client side: building the query, checking the
    /// result).
    pub server_ns: u64,
    /// CPU time of a collector per record (besides the receive).
    pub collect_ns: u64,
    /// Spread of every CPU cost, `+-` this fraction (uniform).
    pub jitter: f64,
    /// Harness settings.
    pub harness: HarnessConfig,
}

impl Default for FanoutParams {
    fn default() -> Self {
        Self {
            topology: "2s:10c:2t".to_string(),
            workers: 32,
            collectors: 4,
            items: 40_000,
            work_ns: 100_000,
            server_ns: 0,
            collect_ns: 2_000,
            jitter: 0.25,
            harness: HarnessConfig::default(),
        }
    }
}

/// Parameters of a ping-pong run.
#[derive(Clone, Debug, PartialEq)]
pub struct PingpongParams {
    /// Topology spec.
    pub topology: String,
    /// Pairs of tasks.
    pub pairs: usize,
    /// Round trips per pair.
    pub rounds: u64,
    /// CPU time of B per round trip.
    pub work_ns: u64,
    /// CPU time of A per round trip.
    pub think_ns: u64,
    /// Spread of every CPU cost, `+-` this fraction (uniform).
    pub jitter: f64,
    /// Harness settings.
    pub harness: HarnessConfig,
}

impl Default for PingpongParams {
    fn default() -> Self {
        Self {
            topology: "2s:10c:2t".to_string(),
            pairs: 16,
            rounds: 2_000,
            work_ns: 50_000,
            think_ns: 10_000,
            jitter: 0.25,
            harness: HarnessConfig::default(),
        }
    }
}

/// Outcome of a fan-out or ping-pong run.
#[derive(Clone, Debug, PartialEq)]
pub struct WakeResult {
    /// Workers (fan-out) or pairs (ping-pong).
    pub clients: usize,
    /// `wake_wide` was on.
    pub wake_wide: bool,
    /// Work items completed (requests served, or round trips).
    pub completed: u64,
    /// Work items expected.
    pub expected: u64,
    /// The harness's measurements.
    pub run: RunStats,
    /// Problems found by the conservation checks (empty when sound).
    pub problems: Vec<String>,
}

impl WakeResult {
    /// Completed work items per simulated second.
    pub fn throughput(&self) -> f64 {
        if self.run.elapsed_ns == 0 {
            0.0
        } else {
            self.completed as f64 * NSEC_PER_SEC as f64 / self.run.elapsed_ns as f64
        }
    }

    /// Mean wakeup-to-run latency in microseconds.
    pub fn mean_wake_latency_us(&self) -> f64 {
        self.run.mean_wake_latency_ns() / 1e3
    }
}

// ----- fan-out -----

#[derive(Clone, Debug)]
struct Worker {
    /// A request is waiting to be served.
    request: bool,
    /// The server said there is no more work.
    closed: bool,
    /// Sleeping until a request (or close) comes.
    waiting: bool,
    /// Served a request; the result and the reply are still to be sent.
    emit: bool,
    /// Next collector (round-robin).
    next_collector: usize,
}

/// The fan-out workload. Task ids: 0 = server, `1..=workers` = workers,
/// then the collectors.
#[derive(Clone, Debug)]
pub struct Fanout {
    workers: Vec<Worker>,
    collectors: Vec<Pipe>,
    /// Replies waiting for the server, by worker index.
    replies: VecDeque<usize>,
    server_waiting: bool,
    /// Requests handed out.
    dispatched: u64,
    /// Initial requests sent (one per worker).
    primed: usize,
    /// Replies the server has handled.
    completed: u64,
    /// Workers told to exit.
    closed: usize,
    items: u64,
    work_ns: u64,
    server_ns: u64,
    collect_ns: u64,
    jitter: f64,
}

impl Fanout {
    /// The workload for `workers` workers and `collectors` collectors
    /// serving `items` requests.
    pub fn new(params: &FanoutParams) -> Self {
        let FanoutParams {
            workers,
            collectors,
            items,
            work_ns,
            server_ns,
            collect_ns,
            jitter,
            ..
        } = *params;
        let collectors = collectors.max(1);
        Self {
            workers: (0..workers)
                .map(|i| Worker {
                    request: false,
                    closed: false,
                    waiting: false,
                    emit: false,
                    next_collector: i % collectors,
                })
                .collect(),
            // Collector pipes never fill in practice; a writer would block
            // correctly if one did.
            collectors: (0..collectors)
                .map(|_| Pipe::new(1 << 20, workers as u32))
                .collect(),
            replies: VecDeque::with_capacity(workers),
            server_waiting: false,
            dispatched: 0,
            primed: 0,
            completed: 0,
            closed: 0,
            items,
            work_ns,
            server_ns,
            collect_ns,
            jitter,
        }
    }

    /// Number of tasks.
    pub fn nr_tasks(&self) -> usize {
        1 + self.workers.len() + self.collectors.len()
    }

    /// Requests served (replies handled by the server).
    pub fn completed(&self) -> u64 {
        self.completed
    }

    /// Records written to and read by the collectors.
    pub fn records(&self) -> (u64, u64) {
        self.collectors
            .iter()
            .fold((0, 0), |(w, r), p| (w + p.written, r + p.read))
    }

    fn worker_id(i: usize) -> TaskId {
        TaskId(1 + i as u64)
    }

    fn collector_id(&self, c: usize) -> TaskId {
        TaskId((1 + self.workers.len() + c) as u64)
    }

    /// Give worker `i` a request, or tell it to exit when all are handed
    /// out.
    fn dispatch(&mut self, i: usize, cx: &mut StepCx<'_>) {
        let w = &mut self.workers[i];
        if self.dispatched < self.items {
            self.dispatched += 1;
            w.request = true;
        } else {
            w.closed = true;
            self.closed += 1;
        }
        if std::mem::take(&mut w.waiting) {
            cx.wake(Self::worker_id(i));
        }
    }

    fn server(&mut self, cx: &mut StepCx<'_>) -> Step {
        let (send, recv) = (cx.costs().send_ns, cx.costs().recv_ns);
        if self.primed < self.workers.len() {
            let i = self.primed;
            self.primed += 1;
            self.dispatch(i, cx);
            return Step::Run(cx.rng().jitter(send, self.jitter));
        }
        if let Some(i) = self.replies.pop_front() {
            self.completed += 1;
            self.dispatch(i, cx);
            let cost = recv + self.server_ns + send;
            return Step::Run(cx.rng().jitter(cost, self.jitter));
        }
        if self.closed == self.workers.len() {
            return Step::Exit;
        }
        self.server_waiting = true;
        Step::Block
    }

    fn worker(&mut self, i: usize, cx: &mut StepCx<'_>) -> Step {
        let (send, recv) = (cx.costs().send_ns, cx.costs().recv_ns);
        let me = Self::worker_id(i);
        let nc = self.collectors.len();
        if self.workers[i].emit {
            let c = self.workers[i].next_collector;
            match self.collectors[c].write(me) {
                WriteOutcome::Done(wakes) => {
                    for w in wakes.into_iter().flatten() {
                        cx.wake(w);
                    }
                }
                WriteOutcome::Wait => return Step::Block,
            }
            let w = &mut self.workers[i];
            w.emit = false;
            w.next_collector = (c + 1) % nc;
            self.replies.push_back(i);
            if std::mem::take(&mut self.server_waiting) {
                cx.wake(TaskId(0));
            }
            return Step::Run(cx.rng().jitter(2 * send, self.jitter));
        }
        let w = &mut self.workers[i];
        if std::mem::take(&mut w.request) {
            w.emit = true;
            return Step::Run(cx.rng().jitter(recv + self.work_ns, self.jitter));
        }
        if w.closed {
            for c in 0..nc {
                if let Some(r) = self.collectors[c].close_writer() {
                    cx.wake(r);
                }
            }
            return Step::Exit;
        }
        w.waiting = true;
        Step::Block
    }

    fn collector(&mut self, c: usize, cx: &mut StepCx<'_>) -> Step {
        let me = self.collector_id(c);
        match self.collectors[c].read(me) {
            ReadOutcome::Done { wake, .. } => {
                if let Some(w) = wake {
                    cx.wake(w);
                }
                let cost = cx.costs().recv_ns + self.collect_ns;
                Step::Run(cx.rng().jitter(cost, self.jitter))
            }
            ReadOutcome::Wait => Step::Block,
            ReadOutcome::Eof => Step::Exit,
        }
    }
}

impl Workload for Fanout {
    fn step(&mut self, task: TaskId, cx: &mut StepCx<'_>) -> Step {
        let Ok(i) = usize::try_from(task.0) else {
            return Step::Exit;
        };
        let nw = self.workers.len();
        match i {
            0 => self.server(cx),
            i if i <= nw => self.worker(i - 1, cx),
            i if i <= nw + self.collectors.len() => self.collector(i - 1 - nw, cx),
            _ => Step::Exit,
        }
    }
}

fn harness_for<W: Workload>(
    topology: &str,
    config: &SchedConfig,
    workload: W,
    nr_tasks: usize,
    hc: &HarnessConfig,
) -> Result<Harness<W>, HarnessError> {
    let topo = Arc::new(Topology::from_spec(topology)?);
    let sched = Sched::new(topo, 1, config.clone());
    let mut h = Harness::new(sched, workload, hc.clone());
    for _ in 0..nr_tasks {
        let id = h.next_id();
        h.add_task(TaskSpec::new(id))?;
        h.start_at(id, 0);
    }
    Ok(h)
}

/// Run the fan-out workload once with `config`.
pub fn run_fanout(params: &FanoutParams, config: &SchedConfig) -> Result<WakeResult, HarnessError> {
    let workload = Fanout::new(params);
    let n = workload.nr_tasks();
    let mut h = harness_for(&params.topology, config, workload, n, &params.harness)?;
    let run = h.run();
    let completed = h.workload().completed();
    let (written, read) = h.workload().records();
    let mut problems = super::check_conservation(&run, h.sched());
    if completed != params.items || written != params.items || read != params.items {
        problems.push(format!(
            "items: {completed} served, {written} records written, {read} read, {} expected",
            params.items
        ));
    }
    Ok(WakeResult {
        clients: params.workers,
        wake_wide: config.wake_wide,
        completed,
        expected: params.items,
        run,
        problems,
    })
}

// ----- ping-pong -----

/// The ping-pong workload. Task ids: `2p` = A of pair `p`, `2p + 1` = B.
#[derive(Clone, Debug)]
pub struct Pingpong {
    /// Per pair: A -> B and B -> A.
    to_b: Vec<Pipe>,
    to_a: Vec<Pipe>,
    /// Per pair: requests A still has to send.
    left: Vec<u64>,
    /// Per pair: A has sent and waits for the reply.
    awaiting: Vec<bool>,
    /// Per pair: B has served a request and must reply.
    reply_due: Vec<bool>,
    round_trips: u64,
    work_ns: u64,
    think_ns: u64,
    jitter: f64,
}

impl Pingpong {
    /// `pairs` pairs doing `rounds` round trips each.
    pub fn new(pairs: usize, rounds: u64, work_ns: u64, think_ns: u64, jitter: f64) -> Self {
        Self {
            to_b: (0..pairs).map(|_| Pipe::new(1, 1)).collect(),
            to_a: (0..pairs).map(|_| Pipe::new(1, 1)).collect(),
            left: vec![rounds; pairs],
            awaiting: vec![false; pairs],
            reply_due: vec![false; pairs],
            round_trips: 0,
            work_ns,
            think_ns,
            jitter,
        }
    }

    /// Number of tasks.
    pub fn nr_tasks(&self) -> usize {
        2 * self.to_b.len()
    }

    /// Round trips completed.
    pub fn round_trips(&self) -> u64 {
        self.round_trips
    }

    fn a(&mut self, p: usize, cx: &mut StepCx<'_>) -> Step {
        let me = TaskId(2 * p as u64);
        let (send, recv) = (cx.costs().send_ns, cx.costs().recv_ns);
        if self.awaiting[p] {
            return match self.to_a[p].read(me) {
                ReadOutcome::Done { wake, .. } => {
                    if let Some(w) = wake {
                        cx.wake(w);
                    }
                    self.awaiting[p] = false;
                    self.round_trips += 1;
                    Step::Run(cx.rng().jitter(recv + self.think_ns, self.jitter))
                }
                ReadOutcome::Wait => Step::Block,
                ReadOutcome::Eof => Step::Exit,
            };
        }
        if self.left[p] == 0 {
            if let Some(r) = self.to_b[p].close_writer() {
                cx.wake(r);
            }
            return Step::Exit;
        }
        match self.to_b[p].write(me) {
            WriteOutcome::Done(wakes) => {
                for w in wakes.into_iter().flatten() {
                    cx.wake(w);
                }
                self.left[p] -= 1;
                self.awaiting[p] = true;
                Step::Run(cx.rng().jitter(send, self.jitter))
            }
            WriteOutcome::Wait => Step::Block,
        }
    }

    fn b(&mut self, p: usize, cx: &mut StepCx<'_>) -> Step {
        let me = TaskId(2 * p as u64 + 1);
        let (send, recv) = (cx.costs().send_ns, cx.costs().recv_ns);
        if self.reply_due[p] {
            return match self.to_a[p].write(me) {
                WriteOutcome::Done(wakes) => {
                    for w in wakes.into_iter().flatten() {
                        cx.wake(w);
                    }
                    self.reply_due[p] = false;
                    Step::Run(cx.rng().jitter(send, self.jitter))
                }
                WriteOutcome::Wait => Step::Block,
            };
        }
        match self.to_b[p].read(me) {
            ReadOutcome::Done { wake, .. } => {
                if let Some(w) = wake {
                    cx.wake(w);
                }
                self.reply_due[p] = true;
                Step::Run(cx.rng().jitter(recv + self.work_ns, self.jitter))
            }
            ReadOutcome::Wait => Step::Block,
            ReadOutcome::Eof => {
                if let Some(r) = self.to_a[p].close_writer() {
                    cx.wake(r);
                }
                Step::Exit
            }
        }
    }
}

impl Workload for Pingpong {
    fn step(&mut self, task: TaskId, cx: &mut StepCx<'_>) -> Step {
        let Ok(i) = usize::try_from(task.0) else {
            return Step::Exit;
        };
        let p = i / 2;
        if p >= self.to_b.len() {
            return Step::Exit;
        }
        if i % 2 == 0 {
            self.a(p, cx)
        } else {
            self.b(p, cx)
        }
    }
}

/// Run the ping-pong workload once with `config`.
pub fn run_pingpong(
    params: &PingpongParams,
    config: &SchedConfig,
) -> Result<WakeResult, HarnessError> {
    let workload = Pingpong::new(
        params.pairs,
        params.rounds,
        params.work_ns,
        params.think_ns,
        params.jitter,
    );
    let n = workload.nr_tasks();
    let mut h = harness_for(&params.topology, config, workload, n, &params.harness)?;
    let run = h.run();
    let completed = h.workload().round_trips();
    let expected = params.pairs as u64 * params.rounds;
    let mut problems = super::check_conservation(&run, h.sched());
    if completed != expected {
        problems.push(format!("round trips: {completed} of {expected}"));
    }
    Ok(WakeResult {
        clients: params.pairs,
        wake_wide: config.wake_wide,
        completed,
        expected,
        run,
        problems,
    })
}

/// Run `run` for each size with `wake_wide` off and on over `config`;
/// returns `(base, wake_wide)`.
fn off_and_on<P>(
    sizes: &[usize],
    config: &SchedConfig,
    mut run: impl FnMut(usize, &SchedConfig) -> Result<P, HarnessError>,
) -> Result<(Vec<P>, Vec<P>), HarnessError> {
    let off = SchedConfig {
        wake_wide: false,
        ..config.clone()
    };
    let on = SchedConfig {
        wake_wide: true,
        ..config.clone()
    };
    let mut base = Vec::with_capacity(sizes.len());
    let mut wide = Vec::with_capacity(sizes.len());
    for &n in sizes {
        base.push(run(n, &off)?);
        wide.push(run(n, &on)?);
    }
    Ok((base, wide))
}

/// Fan-out with `wake_wide` off and on over `config` (see
/// [`wake_wide_config`]), for each worker count. Returns `(base,
/// wake_wide)`.
pub fn fanout_comparison(
    params: &FanoutParams,
    workers: &[usize],
    config: &SchedConfig,
) -> Result<(Vec<WakeResult>, Vec<WakeResult>), HarnessError> {
    off_and_on(workers, config, |w, c| {
        run_fanout(
            &FanoutParams {
                workers: w,
                ..params.clone()
            },
            c,
        )
    })
}

/// Ping-pong with `wake_wide` off and on over `config`, for each pair
/// count. Returns `(base, wake_wide)`.
pub fn pingpong_comparison(
    params: &PingpongParams,
    pairs: &[usize],
    config: &SchedConfig,
) -> Result<(Vec<WakeResult>, Vec<WakeResult>), HarnessError> {
    off_and_on(pairs, config, |n, c| {
        run_pingpong(
            &PingpongParams {
                pairs: n,
                ..params.clone()
            },
            c,
        )
    })
}
