//! Seed 000's experiment: `hackbench <groups> process <loops>` on a
//! 1-socket x 10-core x 2-thread machine, with stealing on and off.
//!
//! This module owns the hackbench workload and its runner. As in
//! hackbench.c: each group has `fds` receivers and `fds` senders (20 + 20);
//! each receiver owns one pipe, which all senders of its group write to;
//! every sender writes `loops` rounds of one message to each receiver of
//! its group, receiver by receiver; every receiver reads `fds x loops`
//! messages, then exits. Pipes are bounded ([`HackbenchParams::pipe_capacity`]):
//! readers block when their pipe is empty, writers when it is full, with
//! the kernel's pipe wakeups (see [`super::pipe`]), all `WF_SYNC`. Tasks are
//! forked at time 0 in hackbench's order (per group, receivers, then
//! senders) and placed by the slow path.
//!
//! The steal-on and steal-off runs share every constant; only
//! [`SchedConfig::steal`] differs.

use std::sync::Arc;

use super::pipe::{Pipe, ReadOutcome, WriteOutcome};
use super::{Harness, HarnessConfig, HarnessError, RunStats, Step, StepCx, Workload};
use crate::config::SchedConfig;
use crate::sched::Sched;
use crate::task::{TaskId, TaskSpec};
use crate::topology::Topology;

/// The seed's `sched_wakeup_granularity_ns=15000000`.
pub const SEED_WAKEUP_GRANULARITY: u64 = 15_000_000;

/// Parameters of one hackbench run.
#[derive(Clone, Debug, PartialEq)]
pub struct HackbenchParams {
    /// Topology spec (seed 000: "1s:10c:2t").
    pub topology: String,
    /// Number of groups.
    pub groups: usize,
    /// Rounds per sender (the seed runs 100000; the harness needs far
    /// fewer for the same shape).
    pub loops: u64,
    /// Senders and receivers per group (hackbench's 20 file descriptors).
    pub fds: usize,
    /// Messages a pipe holds before writers block. A real 64 KiB pipe holds
    /// ~650 100-byte messages; a smaller buffer makes senders block and
    /// wake as they do once readers fall behind.
    pub pipe_capacity: u32,
    /// Spread of each send and receive cost, `+-` this fraction (uniform):
    /// real syscall costs vary with cache state, and identical costs would
    /// lock tasks into artificial lockstep.
    pub jitter: f64,
    /// Harness settings (tick, costs, PRNG seed).
    pub harness: HarnessConfig,
}

impl Default for HackbenchParams {
    fn default() -> Self {
        Self {
            topology: "1s:10c:2t".to_string(),
            groups: 1,
            loops: 1000,
            fds: 20,
            pipe_capacity: 640,
            jitter: 0.25,
            harness: HarnessConfig::default(),
        }
    }
}

/// The seed's engine settings: defaults with `sched_wakeup_granularity_ns`
/// = 15 ms, and `steal` as given.
pub fn seed_config(steal: bool) -> SchedConfig {
    SchedConfig {
        steal,
        wakeup_granularity: SEED_WAKEUP_GRANULARITY,
        ..SchedConfig::default()
    }
}

/// Outcome of one hackbench run.
#[derive(Clone, Debug, PartialEq)]
pub struct HackbenchResult {
    /// Groups run.
    pub groups: usize,
    /// Loops run.
    pub loops: u64,
    /// Stealing was on.
    pub steal: bool,
    /// Leaves of the topology (CPUs).
    pub nr_leaves: usize,
    /// Messages written.
    pub messages_sent: u64,
    /// Messages read.
    pub messages_received: u64,
    /// Messages hackbench should move (`groups x fds x fds x loops`).
    pub messages_expected: u64,
    /// The harness's measurements.
    pub run: RunStats,
    /// Problems found by the conservation check (empty when sound).
    pub problems: Vec<String>,
}

#[derive(Clone, Debug)]
enum Role {
    Receiver {
        pipe: usize,
        left: u64,
    },
    Sender {
        /// First pipe of the sender's group.
        pipes: usize,
        /// Next receiver index within the group.
        next: usize,
        left: u64,
    },
}

/// The hackbench workload: one role per task id.
#[derive(Clone, Debug)]
pub struct Hackbench {
    roles: Vec<Role>,
    pipes: Vec<Pipe>,
    fds: usize,
    jitter: f64,
}

impl Hackbench {
    /// The workload for `groups` groups of `fds` + `fds` tasks; task ids are
    /// `0..groups * 2 * fds`, per group receivers first.
    pub fn new(groups: usize, fds: usize, loops: u64, pipe_capacity: u32, jitter: f64) -> Self {
        let mut roles = Vec::with_capacity(groups * 2 * fds);
        let mut pipes = Vec::with_capacity(groups * fds);
        for g in 0..groups {
            for r in 0..fds {
                roles.push(Role::Receiver {
                    pipe: g * fds + r,
                    left: fds as u64 * loops,
                });
                pipes.push(Pipe::new(pipe_capacity, fds as u32));
            }
            for _ in 0..fds {
                roles.push(Role::Sender {
                    pipes: g * fds,
                    next: 0,
                    left: fds as u64 * loops,
                });
            }
        }
        Self {
            roles,
            pipes,
            fds,
            jitter,
        }
    }

    /// Number of tasks.
    pub fn nr_tasks(&self) -> usize {
        self.roles.len()
    }

    /// Messages written and read over all pipes.
    pub fn messages(&self) -> (u64, u64) {
        self.pipes
            .iter()
            .fold((0, 0), |(w, r), p| (w + p.written, r + p.read))
    }
}

impl Workload for Hackbench {
    fn step(&mut self, task: TaskId, cx: &mut StepCx<'_>) -> Step {
        let Some(role) = usize::try_from(task.0)
            .ok()
            .and_then(|i| self.roles.get_mut(i))
        else {
            return Step::Exit;
        };
        match role {
            Role::Receiver { pipe, left } => {
                if *left == 0 {
                    return Step::Exit;
                }
                match self.pipes[*pipe].read(task) {
                    ReadOutcome::Done { wake, .. } => {
                        *left -= 1;
                        if let Some(w) = wake {
                            cx.wake(w);
                        }
                        let cost = cx.costs().recv_ns;
                        Step::Run(cx.rng().jitter(cost, self.jitter))
                    }
                    ReadOutcome::Wait => Step::Block,
                    ReadOutcome::Eof => Step::Exit,
                }
            }
            Role::Sender { pipes, next, left } => {
                if *left == 0 {
                    return Step::Exit;
                }
                match self.pipes[*pipes + *next].write(task) {
                    WriteOutcome::Done(wakes) => {
                        *left -= 1;
                        *next = (*next + 1) % self.fds;
                        for w in wakes.into_iter().flatten() {
                            cx.wake(w);
                        }
                        let cost = cx.costs().send_ns;
                        Step::Run(cx.rng().jitter(cost, self.jitter))
                    }
                    WriteOutcome::Wait => Step::Block,
                }
            }
        }
    }
}

/// Run hackbench once with engine configuration `config` (capacity 1 per
/// leaf).
pub fn run(
    params: &HackbenchParams,
    config: &SchedConfig,
) -> Result<HackbenchResult, HarnessError> {
    let topo = Arc::new(Topology::from_spec(&params.topology)?);
    let nr_leaves = topo.nr_leaves();
    let sched = Sched::new(topo, 1, config.clone());
    let fds = params.fds.max(1);
    let workload = Hackbench::new(
        params.groups,
        fds,
        params.loops,
        params.pipe_capacity,
        params.jitter,
    );
    let n = workload.nr_tasks();
    let mut h = Harness::new(sched, workload, params.harness.clone());
    for _ in 0..n {
        let id = h.next_id();
        h.add_task(TaskSpec::new(id))?;
        h.start_at(id, 0);
    }
    let run = h.run();
    let (sent, received) = h.workload().messages();
    let expected = params.groups as u64 * (fds * fds) as u64 * params.loops;
    let mut problems = super::check_conservation(&run, h.sched());
    if sent != expected || received != expected {
        problems.push(format!(
            "messages: {sent} sent, {received} received, {expected} expected"
        ));
    }
    Ok(HackbenchResult {
        groups: params.groups,
        loops: params.loops,
        steal: config.steal,
        nr_leaves,
        messages_sent: sent,
        messages_received: received,
        messages_expected: expected,
        run,
        problems,
    })
}

/// Run the seed's comparison: for each group count, baseline (steal off)
/// and new (steal on), with [`seed_config`]. Returns `(baseline, new)`.
pub fn run_comparison(
    params: &HackbenchParams,
    groups: &[usize],
) -> Result<(Vec<HackbenchResult>, Vec<HackbenchResult>), HarnessError> {
    let mut base = Vec::with_capacity(groups.len());
    let mut new = Vec::with_capacity(groups.len());
    for &g in groups {
        let p = HackbenchParams {
            groups: g,
            ..params.clone()
        };
        base.push(run(&p, &seed_config(false))?);
        new.push(run(&p, &seed_config(true))?);
    }
    Ok((base, new))
}
