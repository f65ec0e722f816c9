//! The simulation of one policy on one workload, on the harness's event
//! loop ([`EventQueue`] and [`drive`]).
//!
//! Events: `Arrive` (the next batch of jobs that arrive by time: all root
//! jobs with the same submission time), `Finish` (a job's run time is
//! over), `Tick` (the policy's periodic work, for the dispatcher its
//! `Cluster::tick`) and `Sample` (active nodes over time). A finished job
//! frees its CPUs in the policy (and, in CPU-level mode, in its node's
//! local scheduler), then releases its children as one batch with itself as
//! waker. Jobs start when the policy says so (or, in CPU-level mode, when
//! the node's local scheduler starts them) and end `duration` later.
//!
//! The simulator keeps its own view of each node's busy CPUs (from starts
//! and ends), the same for every policy, for utilization and packing.
//! Wall time spent inside the policy is measured around each call, except
//! the periodic tick's, sampled one call in [`TICK_SAMPLE`] and scaled: a
//! long trace ticks tens of millions of times, and two clock reads per
//! tick were some 15% of a KTH-SP2 replay's CPU.
//!
//! A gang (a job with `nodes` > 1) is one job whose members the policy
//! starts on distinct nodes in one call (a partial start, or two members
//! on one node, ends the run with an error): it starts when they do, holds
//! `cpus` on each member's node, and ends on all of them at once. Samples
//! also count racks with no active node (the fragmentation metric).

use std::collections::HashMap;
use std::time::Instant;

use sched::harness::{EventQueue, drive};

use crate::US_PER_S;

/// One tick call in this many is timed; its time counts this many times
/// in the policy's wall time (`sched_wall_s`).
pub const TICK_SAMPLE: u64 = 16;
use crate::cpu::{CpuLevel, CpuStart, CpuStats};

use crate::error::{Result, SimError};
use crate::layout::Layout;
use crate::policy::{self, Counters, Move, Placer, PolicySpec, Started, SubmitReq};
use crate::workload::Workload;

/// Settings of a run.
#[derive(Clone, Debug, PartialEq)]
pub struct SimConfig {
    /// Period of the policy's tick (the dispatcher core ticks every
    /// `heartbeat / 2`, at most 1 s), µs.
    pub tick_us: u64,
    /// Period of the active-node samples, µs; 0 = about 500 samples over
    /// the arrivals.
    pub sample_us: u64,
    /// Run each node's agent local scheduler (CPU-level placement).
    pub cpu_level: bool,
    /// Seed of the baselines' probes.
    pub seed: u64,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            tick_us: US_PER_S,
            sample_us: 0,
            cpu_level: false,
            seed: 1,
        }
    }
}

/// What happened to one job. Times in µs; `u64::MAX` = never.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JobRecord {
    /// Submitted (arrived, or released by its parent).
    pub submit: u64,
    /// The policy placed it on a node to run.
    pub assigned: u64,
    /// It started running.
    pub start: u64,
    /// It ended.
    pub end: u64,
    /// Its node.
    pub node: u32,
    /// A steal brought it to its node.
    pub moved: Move,
}

impl Default for JobRecord {
    fn default() -> Self {
        Self {
            submit: u64::MAX,
            assigned: u64::MAX,
            start: u64::MAX,
            end: u64::MAX,
            node: u32::MAX,
            moved: Move::None,
        }
    }
}

/// One sample of the cluster's state.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    /// Time, µs.
    pub t_us: u64,
    /// Nodes running at least one job.
    pub active_nodes: u32,
    /// CPUs busy.
    pub busy_cpus: u64,
    /// Racks none of whose nodes runs a job.
    pub free_racks: u32,
}

/// The raw outcome of a run.
#[derive(Clone, Debug)]
pub struct RunOutput {
    /// The policy's name.
    pub policy: String,
    /// Per job.
    pub records: Vec<JobRecord>,
    /// The policy's counters.
    pub counters: Counters,
    /// CPU-level measurements, in CPU-level mode.
    pub cpu: Option<CpuStats>,
    /// Active nodes over time.
    pub samples: Vec<Sample>,
    /// Racks of the cluster.
    pub racks: u32,
    /// Each finished gang's member nodes, in its finish order.
    pub gang_members: Vec<(u32, Vec<u32>)>,
    /// Integral of active nodes over time, node-µs.
    pub active_node_us: f64,
    /// Events handled.
    pub events: u64,
    /// Wall time of the run (setup excluded), seconds.
    pub wall_s: f64,
    /// Wall time building the policy (registering nodes), seconds.
    pub setup_s: f64,
    /// Wall time inside the policy's calls, seconds (the ticks' estimated
    /// from one call in [`TICK_SAMPLE`]).
    pub sched_wall_s: f64,
    /// Wall time inside the node schedulers (CPU-level mode), seconds.
    pub cpu_wall_s: f64,
    /// Placement decisions asked of the policy (jobs submitted).
    pub decisions: u64,
    /// Jobs submitted but never finished (a policy that could not place
    /// them).
    pub unfinished: u64,
}

#[derive(Clone, Copy, Debug)]
enum Ev {
    Arrive(u32),
    Finish(u32),
    Tick,
    Sample,
}

struct Sim<'a> {
    w: &'a Workload,
    placer: Box<dyn Placer>,
    cpu: Option<CpuLevel>,
    tick_us: Option<u64>,
    tick_armed: bool,
    sample_us: u64,
    records: Vec<JobRecord>,
    node_busy: Vec<u32>,
    active: u32,
    /// Rack of each node, active nodes of each rack, racks with none.
    rack_of: Vec<u32>,
    rack_active: Vec<u32>,
    free_racks: u32,
    /// Member nodes of each gang that has started.
    gang_nodes: HashMap<u32, Vec<u32>>,
    /// Gangs whose members started in the current `apply` round.
    gangs_begun: Vec<u32>,
    /// The first violation of the all-or-nothing contract.
    gang_error: Option<String>,
    gang_log: Vec<(u32, Vec<u32>)>,
    busy_cpus: u64,
    last_change: u64,
    active_area: f64,
    samples: Vec<Sample>,
    next_root: usize,
    outstanding: u64,
    running: u64,
    idle_ticks: u32,
    finished: u64,
    decisions: u64,
    sched_wall: f64,
    cpu_wall: f64,
    /// Tick calls so far (one in [`TICK_SAMPLE`] is timed).
    ticks: u64,
    events: u64,
    started: Vec<Started>,
    cpu_started: Vec<CpuStart>,
    reqs: Vec<SubmitReq>,
}

/// Jobs per arrival batch at most.
const MAX_BATCH: usize = 10_000;

impl Sim<'_> {
    fn set_busy(&mut self, now: u64, node: u32, delta: i64) {
        let n = node as usize;
        let before = self.node_busy[n];
        let after = (before as i64 + delta).max(0) as u32;
        if (before == 0) != (after == 0) {
            self.active_area += self.active as f64 * now.saturating_sub(self.last_change) as f64;
            self.last_change = now;
            let rack = self.rack_of[n] as usize;
            if after == 0 {
                self.active -= 1;
                self.rack_active[rack] -= 1;
                if self.rack_active[rack] == 0 {
                    self.free_racks += 1;
                }
            } else {
                self.active += 1;
                if self.rack_active[rack] == 0 {
                    self.free_racks -= 1;
                }
                self.rack_active[rack] += 1;
            }
        }
        self.node_busy[n] = after;
        self.busy_cpus = (self.busy_cpus as i64 + delta).max(0) as u64;
    }

    fn begin(&mut self, now: u64, job: u32, node: u32, q: &mut EventQueue<Ev>) {
        let j = &self.w.jobs[job as usize];
        let (cpus, nodes, duration) = (j.cpus, j.nodes, j.duration_us);
        if nodes > 1 {
            let members = self.gang_nodes.entry(job).or_default();
            if members.contains(&node) || members.len() >= nodes as usize {
                self.gang_error.get_or_insert(format!(
                    "gang job {job}: member started on node {node} after {members:?} (of {nodes})"
                ));
                return;
            }
            members.push(node);
            let first = members.len() == 1;
            let complete = members.len() == nodes as usize;
            self.gangs_begun.push(job);
            self.set_busy(now, node, cpus as i64);
            if first {
                let r = &mut self.records[job as usize];
                r.start = now;
                r.node = node;
                self.running += 1;
            }
            if complete {
                q.push(now + duration, Ev::Finish(job));
            }
            return;
        }
        let r = &mut self.records[job as usize];
        r.start = now;
        r.node = node;
        self.running += 1;
        self.set_busy(now, node, cpus as i64);
        q.push(now + duration, Ev::Finish(job));
    }

    /// Every gang whose members started in the last round must have all of
    /// them running.
    fn check_gangs(&mut self) {
        for job in self.gangs_begun.drain(..) {
            let nodes = self.w.jobs[job as usize].nodes as usize;
            let have = self.gang_nodes.get(&job).map_or(0, Vec::len);
            if have != nodes {
                self.gang_error
                    .get_or_insert(format!("gang job {job}: {have} of {nodes} members started"));
            }
        }
    }

    /// Apply the policy's decisions (and, in CPU-level mode, the node
    /// schedulers' starts, which may let the policy start more).
    fn apply(&mut self, now: u64, q: &mut EventQueue<Ev>) {
        loop {
            let started = std::mem::take(&mut self.started);
            if started.is_empty() && self.cpu_started.is_empty() {
                self.started = started;
                return;
            }
            for s in &started {
                let r = &mut self.records[s.job as usize];
                r.assigned = now;
                r.node = s.node;
                r.moved = s.moved;
                match self.cpu.as_mut() {
                    None => self.begin(now, s.job, s.node, q),
                    Some(cpu) => {
                        let j = &self.w.jobs[s.job as usize];
                        let t = Instant::now();
                        let ok = cpu.assign(
                            now,
                            s.job,
                            s.node,
                            j.cpus,
                            j.latency,
                            &mut self.cpu_started,
                        );
                        self.cpu_wall += t.elapsed().as_secs_f64();
                        if !ok {
                            self.begin(now, s.job, s.node, q);
                        }
                    }
                }
            }
            self.started = started;
            self.started.clear();
            self.check_gangs();
            let cpu_started = std::mem::take(&mut self.cpu_started);
            for (job, cpus) in &cpu_started {
                let node = self.records[*job as usize].node;
                self.begin(now, *job, node, q);
                let t = Instant::now();
                self.placer
                    .running(now, *job, node, cpus, &mut self.started);
                self.sched_wall += t.elapsed().as_secs_f64();
            }
            self.cpu_started = cpu_started;
            self.cpu_started.clear();
        }
    }

    fn submit(
        &mut self,
        now: u64,
        jobs: &[u32],
        waker: Option<u32>,
        q: &mut EventQueue<Ev>,
    ) -> Result<()> {
        for chunk in jobs.chunks(MAX_BATCH) {
            self.reqs.clear();
            for &job in chunk {
                let j = &self.w.jobs[job as usize];
                self.records[job as usize].submit = now;
                self.reqs.push(SubmitReq {
                    job,
                    cpus: j.cpus,
                    nodes: j.nodes,
                    latency: j.latency,
                    waker,
                    limit_us: j.limit_us,
                    gpus: self.w.gpus_of(job),
                    user: self.w.user_of(job),
                });
            }
            self.outstanding += chunk.len() as u64;
            self.decisions += chunk.len() as u64;
            if let Some(p) = self.tick_us
                && !self.tick_armed
            {
                // Ticks resume on the global grid.
                self.tick_armed = true;
                self.idle_ticks = 0;
                q.push((now / p + 1) * p, Ev::Tick);
            }
            let reqs = std::mem::take(&mut self.reqs);
            let t = Instant::now();
            let r = self.placer.submit(now, &reqs, &mut self.started);
            self.sched_wall += t.elapsed().as_secs_f64();
            self.reqs = reqs;
            r?;
            self.apply(now, q);
        }
        Ok(())
    }

    fn work_left(&self) -> bool {
        self.next_root < self.w.roots().len() || self.running > 0
    }

    fn handle(&mut self, now: u64, ev: Ev, q: &mut EventQueue<Ev>) -> Result<()> {
        self.events += 1;
        match ev {
            Ev::Arrive(i) => {
                let roots = self.w.roots();
                let i = i as usize;
                let t = self.w.jobs[roots[i] as usize].submit_us;
                let mut k = i;
                while k < roots.len()
                    && k - i < MAX_BATCH
                    && self.w.jobs[roots[k] as usize].submit_us == t
                {
                    k += 1;
                }
                self.next_root = k;
                if let Some(&next) = roots.get(k) {
                    q.push(self.w.jobs[next as usize].submit_us, Ev::Arrive(k as u32));
                }
                let batch: Vec<u32> = roots[i..k].to_vec();
                self.submit(now, &batch, None, q)?;
            }
            Ev::Finish(job) if self.w.jobs[job as usize].nodes > 1 => {
                let cpus = self.w.jobs[job as usize].cpus;
                let members = self.gang_nodes.remove(&job).unwrap_or_default();
                self.records[job as usize].end = now;
                for &node in &members {
                    self.set_busy(now, node, -(cpus as i64));
                }
                self.running -= 1;
                self.outstanding -= 1;
                self.finished += 1;
                self.idle_ticks = 0;
                for &node in &members {
                    let t = Instant::now();
                    let r = self.placer.finished(now, job, node, &mut self.started);
                    self.sched_wall += t.elapsed().as_secs_f64();
                    r?;
                }
                self.gang_log.push((job, members));
                self.apply(now, q);
                let children = self.w.children(job);
                if !children.is_empty() {
                    let children = children.to_vec();
                    self.submit(now, &children, Some(job), q)?;
                }
            }
            Ev::Finish(job) => {
                let j = &self.w.jobs[job as usize];
                let node = self.records[job as usize].node;
                self.records[job as usize].end = now;
                self.set_busy(now, node, -(j.cpus as i64));
                self.running -= 1;
                self.outstanding -= 1;
                self.finished += 1;
                self.idle_ticks = 0;
                if let Some(cpu) = self.cpu.as_mut() {
                    let t = Instant::now();
                    cpu.exited(now, job, node, &mut self.cpu_started);
                    self.cpu_wall += t.elapsed().as_secs_f64();
                }
                let t = Instant::now();
                let r = self.placer.finished(now, job, node, &mut self.started);
                self.sched_wall += t.elapsed().as_secs_f64();
                r?;
                self.apply(now, q);
                let children = self.w.children(job);
                if !children.is_empty() {
                    let children = children.to_vec();
                    self.submit(now, &children, Some(job), q)?;
                }
            }
            Ev::Tick => {
                let t = self.ticks.is_multiple_of(TICK_SAMPLE).then(Instant::now);
                self.ticks += 1;
                let r = self.placer.tick(now, &mut self.started);
                if let Some(t) = t {
                    self.sched_wall += t.elapsed().as_secs_f64() * TICK_SAMPLE as f64;
                }
                r?;
                self.apply(now, q);
                // NOHZ for the whole cluster: with no job running or
                // waiting a tick changes nothing, so ticks stop until the
                // next submission. Jobs that wait with nothing running
                // (no policy could place them) get ten more ticks.
                if self.running == 0 && self.outstanding > 0 {
                    self.idle_ticks += 1;
                }
                match self.tick_us {
                    Some(p)
                        if self.running > 0 || (self.outstanding > 0 && self.idle_ticks < 10) =>
                    {
                        q.push(now + p, Ev::Tick);
                    }
                    _ => self.tick_armed = false,
                }
            }
            Ev::Sample => {
                self.samples.push(Sample {
                    t_us: now,
                    active_nodes: self.active,
                    busy_cpus: self.busy_cpus,
                    free_racks: self.free_racks,
                });
                if self.work_left() {
                    q.push(now + self.sample_us, Ev::Sample);
                }
            }
        }
        Ok(())
    }
}

/// Run `spec` on `workload` over `layout`. `progress` is called now and
/// then with the number of jobs finished.
pub fn simulate(
    layout: &Layout,
    workload: &Workload,
    spec: &PolicySpec,
    cfg: &SimConfig,
    progress: &mut dyn FnMut(u64),
) -> Result<RunOutput> {
    if cfg.cpu_level && workload.has_gangs() {
        return Err(SimError::Workload(
            "gangs are not simulated in CPU-level mode".into(),
        ));
    }
    if workload.gpus.iter().any(|&g| g > 0)
        && !matches!(
            spec.kind,
            policy::PolicyKind::LeastLoaded | policy::PolicyKind::Ours(_)
        )
    {
        return Err(SimError::Workload(format!(
            "policy {} does not place GPU jobs (least-loaded and ours do)",
            spec.name
        )));
    }
    let t_setup = Instant::now();
    let placer = policy::build(spec, layout, cfg.tick_us.max(1), cfg.seed)?;
    let cpu = cfg.cpu_level.then(|| CpuLevel::new(layout));
    let setup_s = t_setup.elapsed().as_secs_f64();
    let t_run = Instant::now();
    let roots = workload.roots();
    let last_submit = roots
        .last()
        .map_or(0, |&r| workload.jobs[r as usize].submit_us);
    let sample_us = if cfg.sample_us > 0 {
        cfg.sample_us
    } else {
        (last_submit / 500).max(US_PER_S)
    };
    let tick_us = placer.tick_period();
    let nr_racks = (layout.nr_nodes() as u32).div_ceil(layout.nodes_per_rack.max(1) as u32);
    let mut sim = Sim {
        w: workload,
        placer,
        cpu,
        tick_us,
        tick_armed: tick_us.is_some(),
        sample_us,
        records: vec![JobRecord::default(); workload.jobs.len()],
        node_busy: vec![0; layout.nr_nodes()],
        active: 0,
        rack_of: (0..layout.nr_nodes() as u32)
            .map(|n| layout.rack_of(n))
            .collect(),
        rack_active: vec![0; nr_racks as usize],
        free_racks: nr_racks,
        gang_nodes: HashMap::new(),
        gangs_begun: Vec::new(),
        gang_error: None,
        gang_log: Vec::new(),
        busy_cpus: 0,
        last_change: 0,
        active_area: 0.0,
        samples: Vec::new(),
        next_root: 0,
        outstanding: 0,
        running: 0,
        idle_ticks: 0,
        finished: 0,
        decisions: 0,
        sched_wall: 0.0,
        cpu_wall: 0.0,
        ticks: 0,
        events: 0,
        started: Vec::new(),
        cpu_started: Vec::new(),
        reqs: Vec::new(),
    };
    let mut q = EventQueue::new();
    if let Some(&first) = roots.first() {
        q.push(workload.jobs[first as usize].submit_us, Ev::Arrive(0));
    }
    if let Some(p) = tick_us {
        q.push(p, Ev::Tick);
    }
    q.push(0, Ev::Sample);
    let mut failure = None;
    let mut reported = 0;
    let end = drive(&mut q, None, |now, ev, q| {
        if failure.is_some() {
            return;
        }
        if let Err(e) = sim.handle(now, ev, q) {
            failure = Some(e);
        } else if let Some(e) = sim.gang_error.take() {
            failure = Some(SimError::Workload(format!(
                "policy {} broke all-or-nothing: {e}",
                spec.name
            )));
        }
        if sim.finished >= reported + 4096 {
            reported = sim.finished;
            progress(reported);
        }
    });
    if let Some(e) = failure {
        return Err(e);
    }
    progress(sim.finished);
    sim.active_area += sim.active as f64 * end.saturating_sub(sim.last_change) as f64;
    Ok(RunOutput {
        policy: spec.name.clone(),
        counters: sim.placer.counters(),
        cpu: sim.cpu.as_ref().map(CpuLevel::stats),
        records: sim.records,
        samples: sim.samples,
        racks: nr_racks,
        gang_members: sim.gang_log,
        active_node_us: sim.active_area,
        events: sim.events,
        wall_s: t_run.elapsed().as_secs_f64(),
        setup_s,
        sched_wall_s: sim.sched_wall,
        cpu_wall_s: sim.cpu_wall,
        decisions: sim.decisions,
        unfinished: sim.outstanding,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::racks_free_pct;
    use crate::workload::{Job, JobKind};

    fn job(submit_s: f64, duration_s: u64, cpus: u32, nodes: u32) -> Job {
        Job {
            submit_us: (submit_s * US_PER_S as f64) as u64,
            duration_us: duration_s * US_PER_S,
            limit_us: None,
            cpus,
            nodes,
            latency: false,
            after: None,
            group: 0,
            kind: JobKind::Single,
        }
    }

    fn workload(mut jobs: Vec<Job>) -> Workload {
        for (i, j) in jobs.iter_mut().enumerate() {
            j.group = i as u32;
        }
        Workload::new("t", jobs).unwrap()
    }

    fn run(layout: &Layout, w: &Workload, policy: &str) -> Result<RunOutput> {
        let cfg = SimConfig {
            sample_us: US_PER_S,
            ..SimConfig::default()
        };
        simulate(
            layout,
            w,
            &PolicySpec::parse(policy).unwrap(),
            &cfg,
            &mut |_| {},
        )
    }

    /// Replay the records (a gang on each of its members' nodes): no node
    /// ever holds more CPUs than it has.
    fn never_overfull(layout: &Layout, w: &Workload, out: &RunOutput) {
        let mut ev: Vec<(u64, i64, u32)> = Vec::new();
        for (i, (j, r)) in w.jobs.iter().zip(&out.records).enumerate() {
            let nodes = match out.gang_members.iter().find(|g| g.0 == i as u32) {
                Some((_, m)) => m.clone(),
                None => vec![r.node],
            };
            for n in nodes {
                ev.push((r.start, j.cpus as i64, n));
                ev.push((r.end, -(j.cpus as i64), n));
            }
        }
        ev.sort_by_key(|&(t, d, _)| (t, d));
        let mut busy = vec![0i64; layout.nr_nodes()];
        for (_, d, n) in ev {
            busy[n as usize] += d;
            assert!(busy[n as usize] <= layout.cpus(n) as i64, "{}", out.policy);
        }
    }

    /// Four 2-CPU nodes; two whole-node jobs run 0..10 s; a gang of 3
    /// arrives at 1 s: only two nodes are free, so under every policy with
    /// gang placement it starts at 10 s, all three members at once on
    /// distinct nodes, and ends at 15 s; the sampling baselines refuse it.
    #[test]
    fn a_gang_starts_all_members_together_under_each_policy() {
        let layout = Layout::new("1z:2r:2n", "1s:2c:1t").unwrap();
        let w = workload(vec![
            job(0.0, 10, 2, 1),
            job(0.0, 10, 2, 1),
            job(1.0, 5, 2, 3),
        ]);
        for policy in ["least-loaded", "ours"] {
            let out = run(&layout, &w, policy).unwrap();
            assert_eq!(out.unfinished, 0, "{policy}");
            let g = &out.records[2];
            assert_eq!(g.submit, US_PER_S, "{policy}");
            assert_eq!(g.start, 10 * US_PER_S, "{policy}: waits for 3 nodes");
            assert_eq!(g.end, 15 * US_PER_S, "{policy}");
            assert_eq!(out.gang_members.len(), 1, "{policy}");
            let mut m = out.gang_members[0].1.clone();
            m.sort_unstable();
            m.dedup();
            assert_eq!(m.len(), 3, "{policy}: distinct member nodes");
            never_overfull(&layout, &w, &out);
            // While the gang waited nothing of it ran: 4 busy CPUs (the
            // two singles), then 6 (the gang).
            for s in &out.samples {
                let want = match s.t_us / US_PER_S {
                    0 => s.busy_cpus, // the sample may precede the arrivals
                    1..=9 => 4,
                    10..=14 => 6,
                    _ => 0,
                };
                assert_eq!(s.busy_cpus, want, "{policy} at {}", s.t_us);
            }
        }
        for policy in ["random", "pod:2", "sparrow:2"] {
            let e = run(&layout, &w, policy).unwrap_err();
            assert!(e.to_string().contains("gang"), "{policy}: {e}");
        }
    }

    /// A gang as large as the cluster waits for the whole cluster while
    /// single jobs keep arriving, and its members still start together.
    #[test]
    fn a_whole_cluster_gang_never_starts_partially() {
        let layout = Layout::new("1z:2r:2n", "1s:2c:1t").unwrap();
        let mut jobs = vec![job(0.0, 4, 1, 1), job(0.5, 3, 2, 4)];
        for k in 0..6 {
            jobs.push(job(1.0 + k as f64, 2, 1, 1));
        }
        let w = workload(jobs);
        for policy in ["least-loaded", "ours"] {
            let out = run(&layout, &w, policy).unwrap();
            assert_eq!(out.unfinished, 0, "{policy}");
            assert_eq!(out.gang_members[0].1.len(), 4, "{policy}");
            never_overfull(&layout, &w, &out);
            let g = &out.records[1];
            assert!(g.start >= 4 * US_PER_S, "{policy}: {}", g.start);
            assert_eq!(g.end, g.start + 3 * US_PER_S, "{policy}");
        }
    }

    /// Two racks of two nodes; one 1-CPU job runs from 0.5 s to 10.5 s;
    /// samples every second from 0 to 11 s: at 0 and 11 both racks are
    /// free, at 1..=10 one is: (1 + 10 x 0.5 + 1) / 12 = 7/12.
    #[test]
    fn racks_free_on_a_hand_made_run() {
        let layout = Layout::new("1z:2r:2n", "1s:2c:1t").unwrap();
        let w = workload(vec![job(0.5, 10, 1, 1)]);
        let out = run(&layout, &w, "least-loaded").unwrap();
        assert_eq!(out.racks, 2);
        let free: Vec<u32> = out.samples.iter().map(|s| s.free_racks).collect();
        let mut want = vec![2];
        want.extend([1; 10]);
        want.push(2);
        assert_eq!(free, want);
        let pct = racks_free_pct(&out.samples, out.racks);
        assert!((pct - 100.0 * 7.0 / 12.0).abs() < 1e-9, "{pct}");
        assert_eq!(racks_free_pct(&[], 2), 0.0);
    }
}
