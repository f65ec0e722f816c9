//! "Ours": the dispatcher's [`Cluster`] itself, driven as the dispatcher
//! core drives it — agents register (zone and rack labels, the node's CPU
//! topology), jobs are submitted as `JobSpec`s (CPUs, latency_nice, the
//! waker's job id, the pack policy when asked), `Assign` messages in
//! [`Effects::to_agents`] say which jobs start where, a terminal
//! `JobStatus` frees a job's node (which starts or steals queued jobs), and
//! `tick` runs periodically (lazy busy flags). Feature switches go through
//! `ClusterConfig::engine`. Which jobs start where, and whether a steal
//! brought them there and how far, are read from the placement
//! [`Move`](dispatcher::cluster::Move)s in [`Effects::moves`].
//!
//! A gang is submitted as one spec with `nodes: N` (within any; with
//! `+rack` / `+rackpref`, within rack, required / preferred, when it fits
//! in one): the
//! dispatcher's gang pass (`Cluster::schedule_gangs`, `sched::gang`)
//! decides when and where its members `j-N.i` start; each member's end is
//! reported on its own node under its own id.

use std::collections::HashMap;

use dispatcher::cluster::{Cluster, ClusterConfig, Effects, JobKey, MoveKind, StealLevel, Via};
use proto::v1::{JobSpec, JobState, JobStatus, PlacementPolicy, Within};
use sched::NodeLimitScope;

use super::{Counters, Move, OursFlags, Placer, Started, SubmitReq};
use crate::error::{Result, SimError};
use crate::layout::Layout;

/// Agents report every 2^40 ms: nodes never miss heartbeats in a run.
const HEARTBEAT_MS: u64 = 1 << 40;

/// The longest `timeout_ms` the API accepts (a year).
const MAX_TIMEOUT_MS: u64 = 365 * 24 * 3600 * 1000;

/// Jobs per `submit` call (the API's limit).
const MAX_SPECS: usize = 10_000;

/// The dispatcher's `Cluster` as a [`Placer`].
pub struct OursPlacer {
    cluster: Cluster,
    fx: Effects,
    flags: OursFlags,
    tick_us: u64,
    /// Dispatcher job number of each workload job (0 = not submitted).
    dnum: Vec<u64>,
    /// Workload job of each dispatcher job number.
    job_of: Vec<u32>,
    cross_rack: u64,
    cross_zone: u64,
    same_rack: u64,
    specs: Vec<JobSpec>,
    /// The member of each running gang on a node: (workload job, node).
    member_on: HashMap<(u32, u32), JobKey>,
    /// Nodes per rack (`+rack` asks a rack only of gangs that fit one).
    per_rack: usize,
    /// Start time (ms, at least 1) of each started workload job: sent
    /// with its end as an agent does (`JobStatus.time_ms`), so the
    /// dispatcher knows its run time.
    start_ms: Vec<i64>,
}

fn ms(us: u64) -> i64 {
    (us / 1000) as i64
}

impl OursPlacer {
    /// Register every node of `layout` with a dispatcher configured by
    /// `flags`.
    pub fn new(layout: &Layout, flags: OursFlags, tick_us: u64) -> Result<Self> {
        let mut cfg = ClusterConfig {
            heartbeat_interval_ms: HEARTBEAT_MS,
            // Every job kept, as before the retention: a waker job's node
            // is looked up however long ago it ended.
            retention: dispatcher::cluster::Retention::KEEP_ALL,
            ..ClusterConfig::default()
        };
        cfg.engine.steal = flags.steal;
        cfg.engine.steal_cross_llc = flags.cross_rack;
        cfg.engine.wake_wide = flags.wake_wide;
        cfg.engine.latency = flags.latency;
        cfg.engine.busy_skip = flags.busy_skip;
        cfg.engine.backfill = flags.backfill;
        cfg.engine.idle_balance = flags.idle_balance;
        cfg.engine.pull_longest_wait = flags.pull_oldest;
        cfg.engine.latency_pull = flags.latency_pull;
        cfg.engine.domain_reservation = flags.domain_reservation;
        cfg.engine.domain_fifo = flags.domain_fifo;
        cfg.engine.shortest_limit_first = flags.shortest_limit_first;
        cfg.engine.deadline_order = flags.deadline_order;
        cfg.engine.limit_aging = flags.limit_aging;
        cfg.engine.widest_first = flags.widest_first;
        cfg.predict = flags.predict;
        cfg.owner_wake = flags.owner_wake;
        if let Some(limit) = flags.node_limit {
            cfg.engine.node_limit_scope = NodeLimitScope::Global;
            cfg.engine.steal_node_limit = limit;
        }
        let mut cluster = Cluster::new(cfg);
        let mut fx = Effects::default();
        for node in 0..layout.nr_nodes() as u32 {
            cluster
                .register(layout.register(node), 0, &mut fx)
                .map_err(|s| SimError::Dispatcher {
                    what: "register",
                    message: s.message().to_string(),
                })?;
        }
        cluster.settle(0, &mut fx);
        // Nobody watches the simulated dispatcher: no events are recorded.
        fx = Effects {
            drop_events: true,
            ..Effects::default()
        };
        Ok(Self {
            cluster,
            fx,
            flags,
            tick_us,
            dnum: Vec::new(),
            job_of: vec![u32::MAX],
            cross_rack: 0,
            cross_zone: 0,
            same_rack: 0,
            specs: Vec::new(),
            member_on: HashMap::new(),
            per_rack: layout.nodes_per_rack,
            start_ms: Vec::new(),
        })
    }

    /// The dispatcher (for tests and reports).
    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }

    fn job_id(&self, job: u32) -> String {
        JobKey::single(self.dnum.get(job as usize).copied().unwrap_or(0)).to_string()
    }

    /// Turn the placements of one call into starts.
    fn drain(&mut self, now: u64, out: &mut Vec<Started>) {
        // Nothing is stored or watched here.
        self.fx.writes.clear();
        self.fx.dirty.clear();
        self.fx.events.clear();
        self.fx.to_agents.clear();
        for m in self.fx.moves.drain(..) {
            let MoveKind::Placed { via, .. } = m.kind else {
                continue;
            };
            let job = self.job_of.get(m.job.number() as usize).copied();
            let (Some(job), Some(node)) = (job, Layout::node_index(&m.to)) else {
                continue;
            };
            let moved = match via {
                Via::Stolen { level, .. } => match level {
                    StealLevel::SameRack => Move::SameRack,
                    StealLevel::SameZone => Move::CrossRack,
                    StealLevel::OtherZone => Move::CrossZone,
                },
                Via::Placed(_) | Via::Waited(_) | Via::Restored => Move::None,
            };
            match moved {
                Move::SameRack => self.same_rack += 1,
                Move::CrossRack => self.cross_rack += 1,
                Move::CrossZone => self.cross_zone += 1,
                Move::None => {}
            }
            if !m.job.is_single() {
                self.member_on.insert((job, node), m.job);
            }
            let i = job as usize;
            if self.start_ms.len() <= i {
                self.start_ms.resize(i + 1, 0);
            }
            self.start_ms[i] = ms(now).max(1);
            out.push(Started { job, node, moved });
        }
    }
}

impl Placer for OursPlacer {
    fn submit(&mut self, now: u64, jobs: &[SubmitReq], out: &mut Vec<Started>) -> Result<()> {
        // One submission per run of jobs of one user (the owner is the
        // submission's).
        for chunk in jobs
            .chunk_by(|a, b| a.user == b.user)
            .flat_map(|run| run.chunks(MAX_SPECS))
        {
            let owner = chunk
                .first()
                .and_then(|j| j.user)
                .map(|u| format!("u{u}"))
                .unwrap_or_default();
            let mut specs = std::mem::take(&mut self.specs);
            specs.clear();
            for j in chunk {
                specs.push(JobSpec {
                    command: vec!["sim".to_string()],
                    cpus: j.cpus,
                    gpus: j.gpus,
                    nodes: if j.nodes > 1 { j.nodes } else { 0 },
                    within: match (j.nodes > 1, self.flags.gang_rack) {
                        (false, _) => Within::Unspecified as i32,
                        (true, Some(_)) if j.nodes as usize <= self.per_rack => Within::Rack as i32,
                        (true, _) => Within::Any as i32,
                    },
                    within_preferred: j.nodes > 1
                        && j.nodes as usize <= self.per_rack
                        && self.flags.gang_rack == Some(true),
                    latency_nice: if j.latency { -10 } else { 0 },
                    waker: j.waker.map(|w| self.job_id(w)).unwrap_or_default(),
                    // Rounded up to whole ms; the API takes at most a year.
                    timeout_ms: j
                        .limit_us
                        .map_or(0, |l| l.div_ceil(1000).min(MAX_TIMEOUT_MS)),
                    policy: if self.flags.pack {
                        PlacementPolicy::Pack as i32
                    } else {
                        PlacementPolicy::Spread as i32
                    },
                    ..Default::default()
                });
            }
            let created = self
                .cluster
                .submit_as(&owner, specs, chunk.len() > 1, ms(now), &mut self.fx)
                .map_err(|s| SimError::Dispatcher {
                    what: "submit",
                    message: s.message().to_string(),
                })?;
            // A gang's members come back one by one (`j-N.0`, ...).
            let mut created = created.iter();
            for j in chunk {
                let job = created.next();
                for _ in 1..j.nodes {
                    created.next();
                }
                let n = job
                    .map(|job| job.key().number())
                    .ok_or_else(|| SimError::Dispatcher {
                        what: "submit",
                        message: "fewer jobs created than submitted".into(),
                    })?;
                let i = j.job as usize;
                if self.dnum.len() <= i {
                    self.dnum.resize(i + 1, 0);
                }
                self.dnum[i] = n;
                if self.job_of.len() <= n as usize {
                    self.job_of.resize(n as usize + 1, u32::MAX);
                }
                self.job_of[n as usize] = j.job;
            }
            // Moves name jobs by key: the map must be complete first.
            self.drain(now, out);
        }
        Ok(())
    }

    fn finished(&mut self, now: u64, job: u32, node: u32, out: &mut Vec<Started>) -> Result<()> {
        let job_id = match self.member_on.remove(&(job, node)) {
            Some(member) => member.to_string(),
            None => self.job_id(job),
        };
        let status = JobStatus {
            job_id,
            attempt: 1,
            state: JobState::Succeeded as i32,
            time_ms: self.start_ms.get(job as usize).copied().unwrap_or(0),
            ..Default::default()
        };
        self.cluster
            .job_status(&Layout::node_name(node), status, ms(now), &mut self.fx);
        self.drain(now, out);
        Ok(())
    }

    fn running(&mut self, now: u64, job: u32, node: u32, cpus: &[u32], out: &mut Vec<Started>) {
        let status = JobStatus {
            job_id: self.job_id(job),
            attempt: 1,
            state: JobState::Running as i32,
            cpus: cpus.to_vec(),
            ..Default::default()
        };
        self.cluster
            .job_status(&Layout::node_name(node), status, ms(now), &mut self.fx);
        // A corrected CPU model may let a queued job start.
        self.drain(now, out);
    }

    fn tick(&mut self, now: u64, out: &mut Vec<Started>) -> Result<()> {
        self.cluster.tick(ms(now), &mut self.fx);
        self.drain(now, out);
        Ok(())
    }

    fn tick_period(&self) -> Option<u64> {
        Some(self.tick_us)
    }

    fn counters(&self) -> Counters {
        let s = self
            .cluster
            .engine()
            .map(|e| *e.stats())
            .unwrap_or_default();
        Counters {
            steals: self.same_rack + self.cross_rack + self.cross_zone,
            cross_rack: self.cross_rack,
            cross_zone: self.cross_zone,
            visits: s.sis_scanned + s.steal_scanned,
            wake_affine: s.wake_affine,
            wake_wide: s.wake_wide,
            busy_skip: s.busy_skip,
            pack_placed: s.pack_placed,
            latency_picks: s.latency_picks,
        }
    }
}
