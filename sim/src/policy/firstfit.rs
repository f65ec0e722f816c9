//! The Slurm-like baseline (`first-fit`): what an experienced Slurm user
//! gets from `SchedulerType=sched/backfill`, `SelectType=select/cons_tres`
//! and `TopologyPlugin=topology/tree` with the racks as leaf switches. It
//! is a comparison, not one of our algorithms, and borrows nothing from
//! the engine.
//!
//! * One priority queue for every job, single or gang: latency class
//!   first (a higher priority), then arrival (priority/basic is FIFO).
//! * The main scheduler walks the queue in priority order and starts each
//!   job that fits now; it stops at the first job that does not (in Slurm,
//!   once a job of a partition is left pending no lower-priority job of
//!   that partition is started by the main loop).
//! * Node selection (topology/tree's best fit on leaf switches): among the
//!   nodes with room for a member, racks are taken so that the job spans
//!   as few racks as possible: while the members left do not fit in one
//!   rack, the rack with the most nodes with room (lowest-numbered on a
//!   tie); then the rack with the fewest nodes with room that still holds
//!   the rest (best fit). Within a rack, the lowest-numbered nodes (the
//!   node order of a one-dimensional Slurm cluster). A single job is a
//!   gang of one: the best-fit rack's lowest-numbered node with room.
//! * EASY backfill (sched/backfill, reduced to one reservation): when the
//!   queue's head cannot start, its start time ("shadow time") is found by
//!   freeing the running jobs' CPUs in the order of their time limits'
//!   ends (a job without a limit ends "never") until the head fits, and
//!   the nodes it would get then are reserved. A later job (at most
//!   [`BF_MAX_JOB_TEST`] of them, Slurm's `bf_max_job_test` default) may
//!   start now if it fits and either its time limit ends by the shadow
//!   time or it only uses CPUs the head will not need at the shadow time.
//!
//! Departures from Slurm, for a simulator: the backfill pass runs on every
//! event instead of every `bf_interval` (30 s), Slurm's backfill plans a
//! reservation for every job it tests (not only the head), and zones are
//! not a switch level here (a job is placed across the whole cluster with
//! the fewest racks). Memory, GPUs and whole-node allocation
//! (select/linear) are not modelled: a node is shared by CPU count, as
//! cons_tres does.

use std::collections::BTreeSet;

use super::{Counters, Move, Placer, Started, SubmitReq};
use crate::error::{Result, SimError};
use crate::layout::Layout;

/// Jobs behind the head that one backfill pass tests (Slurm's
/// `bf_max_job_test` default).
pub const BF_MAX_JOB_TEST: usize = 500;

/// Queue order: (not latency class, arrival sequence, job).
type QueueKey = (bool, u64, u32);

#[derive(Clone, Copy, Debug, Default)]
struct Req {
    cpus: u32,
    nodes: u32,
    limit_us: Option<u64>,
    /// Members still running (0 when not running).
    running: u32,
    /// End of its time limit while running (`u64::MAX` = no limit).
    est_end: u64,
}

/// The nodes a job of `nodes` members of `cpus` CPUs gets where node `n`
/// has `avail(n)` CPUs free, the fewest racks first (see the module
/// comment), written to `out` in node order; false (and `out` left empty)
/// when fewer than `nodes` nodes have room. `per_rack` and `racks_by` are
/// scratch.
fn select(
    rack_of: &[u32],
    nr_racks: usize,
    cpus: u32,
    nodes: u32,
    avail: impl Fn(usize) -> u32,
    per_rack: &mut Vec<u32>,
    out: &mut Vec<u32>,
) -> bool {
    out.clear();
    per_rack.clear();
    per_rack.resize(nr_racks, 0);
    let mut total = 0u32;
    for (n, &r) in rack_of.iter().enumerate() {
        if avail(n) >= cpus {
            per_rack[r as usize] += 1;
            total += 1;
        }
    }
    if total < nodes {
        return false;
    }
    // Choose racks: the largest while the rest fits in none, then the best
    // fit. `take[r]` = nodes taken from rack r.
    let mut take = vec![0u32; nr_racks];
    let mut left = nodes;
    while left > 0 {
        let best_fit = (0..nr_racks)
            .filter(|&r| take[r] == 0 && per_rack[r] >= left)
            .min_by_key(|&r| (per_rack[r], r));
        if let Some(r) = best_fit {
            take[r] = left;
            left = 0;
        } else {
            let Some(r) = (0..nr_racks)
                .filter(|&r| take[r] == 0 && per_rack[r] > 0)
                .max_by_key(|&r| (per_rack[r], std::cmp::Reverse(r)))
            else {
                return false;
            };
            take[r] = per_rack[r];
            left -= per_rack[r];
        }
    }
    for (n, &r) in rack_of.iter().enumerate() {
        let t = &mut take[r as usize];
        if *t > 0 && avail(n) >= cpus {
            out.push(n as u32);
            *t -= 1;
        }
    }
    true
}

pub(super) struct FirstFit {
    cap: Vec<u32>,
    free: Vec<u32>,
    rack_of: Vec<u32>,
    nr_racks: usize,
    queue: BTreeSet<QueueKey>,
    seq: u64,
    jobs: Vec<Req>,
    /// Running jobs by the end of their time limit.
    ends: BTreeSet<(u64, u32)>,
    /// Nodes of each running job.
    nodes_of: Vec<Vec<u32>>,
    visits: u64,
    per_rack: Vec<u32>,
    pick: Vec<u32>,
}

impl FirstFit {
    pub(super) fn new(layout: &Layout) -> Self {
        let n = layout.nr_nodes() as u32;
        let cap: Vec<u32> = (0..n).map(|i| layout.cpus(i)).collect();
        let rack_of: Vec<u32> = (0..n).map(|i| layout.rack_of(i)).collect();
        let nr_racks = rack_of.iter().max().map_or(0, |&r| r as usize + 1);
        Self {
            free: cap.clone(),
            cap,
            rack_of,
            nr_racks,
            queue: BTreeSet::new(),
            seq: 0,
            jobs: Vec::new(),
            ends: BTreeSet::new(),
            nodes_of: Vec::new(),
            visits: 0,
            per_rack: Vec::new(),
            pick: Vec::new(),
        }
    }

    /// Pick nodes for `job` where node n has `avail[n]` free (into
    /// `self.pick`).
    fn pick_on(&mut self, job: u32, avail: &[u32]) -> bool {
        let r = self.jobs[job as usize];
        self.visits += avail.len() as u64;
        select(
            &self.rack_of,
            self.nr_racks,
            r.cpus,
            r.nodes,
            |n| avail[n],
            &mut self.per_rack,
            &mut self.pick,
        )
    }

    /// Start `job` on `self.pick`.
    fn start(&mut self, now: u64, job: u32, out: &mut Vec<Started>) {
        let r = &mut self.jobs[job as usize];
        r.running = r.nodes;
        r.est_end = r.limit_us.map_or(u64::MAX, |l| now.saturating_add(l));
        let (cpus, est_end) = (r.cpus, r.est_end);
        for &n in &self.pick {
            self.free[n as usize] -= cpus;
            out.push(Started {
                job,
                node: n,
                moved: Move::None,
            });
        }
        let i = job as usize;
        if self.nodes_of.len() <= i {
            self.nodes_of.resize(i + 1, Vec::new());
        }
        self.nodes_of[i] = std::mem::take(&mut self.pick);
        self.ends.insert((est_end, job));
    }

    /// The main scheduler, then one backfill pass.
    fn schedule(&mut self, now: u64, out: &mut Vec<Started>) {
        // Main loop: start in priority order until a job does not fit.
        let free = std::mem::take(&mut self.free);
        let mut head = None;
        let mut free = free;
        while let Some(&key) = self.queue.first() {
            if self.pick_on(key.2, &free) {
                self.queue.pop_first();
                self.free = free;
                self.start(now, key.2, out);
                free = std::mem::take(&mut self.free);
            } else {
                head = Some(key);
                break;
            }
        }
        self.free = free;
        let Some(head) = head else {
            return;
        };
        // The head's reservation: free the running jobs in the order of
        // their limits' ends until it fits.
        let mut proj = self.free.clone();
        let mut shadow = u64::MAX;
        let mut reserved = Vec::new();
        let ends: Vec<(u64, u32)> = self.ends.iter().copied().collect();
        let mut i = 0;
        while i < ends.len() {
            let t = ends[i].0;
            while i < ends.len() && ends[i].0 == t {
                let job = ends[i].1 as usize;
                let cpus = self.jobs[job].cpus;
                for &n in &self.nodes_of[job] {
                    proj[n as usize] += cpus;
                }
                i += 1;
            }
            if self.pick_on(head.2, &proj) {
                shadow = t;
                reserved = std::mem::take(&mut self.pick);
                break;
            }
        }
        // CPUs free at the shadow time that the head will not use.
        let head_cpus = self.jobs[head.2 as usize].cpus;
        let mut extra = proj;
        for &n in &reserved {
            extra[n as usize] -= head_cpus;
        }
        let candidates: Vec<QueueKey> = self
            .queue
            .iter()
            .skip(1)
            .take(BF_MAX_JOB_TEST)
            .copied()
            .collect();
        let mut both = vec![0u32; self.free.len()];
        for key in candidates {
            let job = key.2;
            let r = self.jobs[job as usize];
            let ends_by = r.limit_us.is_some_and(|l| now.saturating_add(l) <= shadow);
            let ok = if ends_by {
                let free = std::mem::take(&mut self.free);
                let ok = self.pick_on(job, &free);
                self.free = free;
                ok
            } else {
                for (b, (&f, &e)) in both.iter_mut().zip(self.free.iter().zip(&extra)) {
                    *b = f.min(e);
                }
                self.pick_on(job, &both)
            };
            if ok {
                if !ends_by {
                    for &n in &self.pick {
                        extra[n as usize] -= r.cpus;
                    }
                }
                self.queue.remove(&key);
                self.start(now, job, out);
            }
        }
    }
}

impl Placer for FirstFit {
    fn submit(&mut self, now: u64, jobs: &[SubmitReq], out: &mut Vec<Started>) -> Result<()> {
        let max_cap = self.cap.iter().copied().max().unwrap_or(0);
        for j in jobs {
            let fits = self.cap.iter().filter(|&&c| c >= j.cpus).count();
            if j.cpus > max_cap || (j.nodes as usize) > fits {
                return Err(SimError::Workload(format!(
                    "job {} ({} x {} CPUs) is larger than the cluster",
                    j.job, j.nodes, j.cpus
                )));
            }
            let i = j.job as usize;
            if self.jobs.len() <= i {
                self.jobs.resize(i + 1, Req::default());
            }
            self.jobs[i] = Req {
                cpus: j.cpus,
                nodes: j.nodes.max(1),
                limit_us: j.limit_us,
                running: 0,
                est_end: u64::MAX,
            };
            self.seq += 1;
            self.queue.insert((!j.latency, self.seq, j.job));
        }
        self.schedule(now, out);
        Ok(())
    }

    fn finished(&mut self, now: u64, job: u32, node: u32, out: &mut Vec<Started>) -> Result<()> {
        let Some(r) = self.jobs.get_mut(job as usize) else {
            return Ok(());
        };
        if r.running == 0 {
            return Ok(());
        }
        r.running -= 1;
        let (cpus, done, est_end) = (r.cpus, r.running == 0, r.est_end);
        if let Some(f) = self.free.get_mut(node as usize) {
            *f += cpus;
        }
        // A gang frees all its members before anything is placed again.
        if done {
            self.ends.remove(&(est_end, job));
            self.schedule(now, out);
        }
        Ok(())
    }

    fn counters(&self) -> Counters {
        Counters {
            visits: self.visits,
            ..Counters::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::US_PER_S;

    fn req(job: u32, cpus: u32, nodes: u32, limit_s: Option<u64>) -> SubmitReq {
        SubmitReq {
            job,
            cpus,
            nodes,
            latency: false,
            waker: None,
            limit_us: limit_s.map(|s| s * US_PER_S),
            gpus: 0,
            user: None,
        }
    }

    fn nodes_of(out: &[Started], job: u32) -> Vec<u32> {
        out.iter()
            .filter(|s| s.job == job)
            .map(|s| s.node)
            .collect()
    }

    /// Racks of 4 nodes; rack 0 has 3 free nodes, rack 1 has 4: a gang of
    /// 3 takes rack 0 (best fit), a gang of 4 (1 CPU each) rack 1; then no
    /// node has 2 CPUs free and a gang of 2 x 2 waits.
    #[test]
    fn gangs_take_the_best_fitting_rack() {
        let l = Layout::new("1z:2r:4n", "1s:2c:1t").unwrap();
        let mut p = FirstFit::new(&l);
        let mut out = Vec::new();
        p.submit(0, &[req(0, 2, 1, Some(100))], &mut out).unwrap();
        assert_eq!(nodes_of(&out, 0), vec![0]);
        p.submit(0, &[req(1, 2, 3, Some(100))], &mut out).unwrap();
        assert_eq!(nodes_of(&out, 1), vec![1, 2, 3], "best fit: rack 0");
        p.submit(0, &[req(2, 1, 4, Some(100))], &mut out).unwrap();
        assert_eq!(nodes_of(&out, 2), vec![4, 5, 6, 7]);
        p.submit(0, &[req(3, 2, 2, Some(100))], &mut out).unwrap();
        assert!(nodes_of(&out, 3).is_empty(), "no node has 2 free CPUs");
    }

    /// One 4-node rack, 1 CPU each. Job 0 holds node 0 until 100 s (its
    /// limit); the head (a gang of 4) reserves all nodes from 100 s. A
    /// 1-node job with a 50 s limit backfills; one with a 500 s limit does
    /// not (it would delay the head); a 1-node job without a limit does
    /// not either.
    #[test]
    fn easy_backfill_never_delays_the_head() {
        let l = Layout::new("1z:1r:4n", "1s:1c:1t").unwrap();
        let mut p = FirstFit::new(&l);
        let mut out = Vec::new();
        p.submit(0, &[req(0, 1, 1, Some(100))], &mut out).unwrap();
        p.submit(
            1,
            &[
                req(1, 1, 4, Some(10)),
                req(2, 1, 1, Some(500)),
                req(3, 1, 1, None),
                req(4, 1, 1, Some(50)),
            ],
            &mut out,
        )
        .unwrap();
        let started: Vec<u32> = out.iter().map(|s| s.job).collect();
        assert_eq!(started, vec![0, 4], "only the short job backfills");
        out.clear();
        p.finished(40 * US_PER_S, 4, out_node(&p, 4), &mut out)
            .unwrap();
        assert!(out.is_empty(), "the head still waits for node 0");
        p.finished(60 * US_PER_S, 0, 0, &mut out).unwrap();
        let started: Vec<u32> = out.iter().map(|s| s.job).collect();
        assert_eq!(started, vec![1, 1, 1, 1], "the head starts first");
    }

    fn out_node(p: &FirstFit, job: u32) -> u32 {
        p.nodes_of[job as usize][0]
    }

    /// The main loop stops at the first job that does not fit: a later
    /// small job starts only by backfill, i.e. when it does not delay the
    /// head.
    #[test]
    fn priority_order_with_latency_first() {
        let l = Layout::new("1z:1r:2n", "1s:2c:1t").unwrap();
        let mut p = FirstFit::new(&l);
        let mut out = Vec::new();
        p.submit(0, &[req(0, 2, 2, Some(10))], &mut out).unwrap();
        let mut lat = req(2, 2, 1, Some(10));
        lat.latency = true;
        p.submit(1, &[req(1, 2, 1, Some(10)), lat], &mut out)
            .unwrap();
        out.clear();
        p.finished(5 * US_PER_S, 0, 0, &mut out).unwrap();
        assert!(out.is_empty(), "a gang frees all its members first");
        p.finished(5 * US_PER_S, 0, 1, &mut out).unwrap();
        let started: Vec<u32> = out.iter().map(|s| s.job).collect();
        assert_eq!(started, vec![2, 1], "latency class first");
    }
}
