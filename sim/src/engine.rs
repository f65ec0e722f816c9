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
//! Wall time spent inside the policy is measured around each call.

use std::time::Instant;

use sched::harness::{EventQueue, drive};

use crate::US_PER_S;
use crate::cpu::{CpuLevel, CpuStart, CpuStats};
use crate::error::Result;
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
    /// Integral of active nodes over time, node-µs.
    pub active_node_us: f64,
    /// Events handled.
    pub events: u64,
    /// Wall time of the run (setup excluded), seconds.
    pub wall_s: f64,
    /// Wall time building the policy (registering nodes), seconds.
    pub setup_s: f64,
    /// Wall time inside the policy's calls, seconds.
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
            if after == 0 {
                self.active -= 1;
            } else {
                self.active += 1;
            }
        }
        self.node_busy[n] = after;
        self.busy_cpus = (self.busy_cpus as i64 + delta).max(0) as u64;
    }

    fn begin(&mut self, now: u64, job: u32, node: u32, q: &mut EventQueue<Ev>) {
        let j = &self.w.jobs[job as usize];
        let r = &mut self.records[job as usize];
        r.start = now;
        r.node = node;
        self.running += 1;
        self.set_busy(now, node, j.cpus as i64);
        q.push(now + j.duration_us, Ev::Finish(job));
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
                    latency: j.latency,
                    waker,
                    limit_us: j.limit_us,
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
                let t = Instant::now();
                let r = self.placer.tick(now, &mut self.started);
                self.sched_wall += t.elapsed().as_secs_f64();
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
