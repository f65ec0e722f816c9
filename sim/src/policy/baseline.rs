//! The sampling baselines: random, power of d choices, and Sparrow batch
//! sampling, over per-node FIFO queues ([`NodeQueues`]): a job sent to a
//! node starts there when its CPUs are free and no earlier job waits
//! (head-of-line order, as a worker queue). With one CPU per node and
//! exponential work this is the supermarket model of the validation mode.

use std::collections::VecDeque;

use sched::harness::Rng;

use super::{Counters, Move, Placer, Started, SubmitReq};
use crate::error::{Result, SimError};
use crate::layout::Layout;

/// Per-node capacity, busy CPUs and FIFO queues.
#[derive(Clone, Debug)]
pub struct NodeQueues {
    cap: Vec<u32>,
    used: Vec<u32>,
    queued: Vec<u32>,
    queue: Vec<VecDeque<(u32, u32)>>,
}

impl NodeQueues {
    /// Empty nodes of the layout.
    pub fn new(layout: &Layout) -> Self {
        let n = layout.nr_nodes();
        Self {
            cap: (0..n as u32).map(|i| layout.cpus(i)).collect(),
            used: vec![0; n],
            queued: vec![0; n],
            queue: vec![VecDeque::new(); n],
        }
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.cap.len()
    }

    /// No nodes.
    pub fn is_empty(&self) -> bool {
        self.cap.is_empty()
    }

    /// Capacity of a node.
    pub fn cap(&self, node: u32) -> u32 {
        self.cap[node as usize]
    }

    /// Busy plus queued CPUs of a node (its load, before dividing by its
    /// capacity).
    pub fn demand(&self, node: u32) -> u64 {
        self.used[node as usize] as u64 + self.queued[node as usize] as u64
    }

    /// True when node `a` is strictly less loaded than node `b`
    /// (demand / capacity, compared without division).
    pub fn less_loaded(&self, a: u32, b: u32) -> bool {
        self.demand(a) * u64::from(self.cap(b)) < self.demand(b) * u64::from(self.cap(a))
    }

    /// Send a job to a node: start it if it can, else queue it.
    pub fn enqueue(&mut self, node: u32, job: u32, cpus: u32, out: &mut Vec<Started>) {
        let n = node as usize;
        if self.queue[n].is_empty() && self.used[n] + cpus <= self.cap[n] {
            self.used[n] += cpus;
            out.push(Started {
                job,
                node,
                moved: Move::None,
            });
        } else {
            self.queued[n] += cpus;
            self.queue[n].push_back((job, cpus));
        }
    }

    /// A job of `cpus` ended on `node`: start queued jobs that now fit, in
    /// order.
    pub fn release(&mut self, node: u32, cpus: u32, out: &mut Vec<Started>) {
        let n = node as usize;
        self.used[n] = self.used[n].saturating_sub(cpus);
        while let Some(&(job, c)) = self.queue[n].front() {
            if self.used[n] + c > self.cap[n] {
                break;
            }
            self.queue[n].pop_front();
            self.queued[n] -= c;
            self.used[n] += c;
            out.push(Started {
                job,
                node,
                moved: Move::None,
            });
        }
    }
}

/// Random (d = 1), power of d choices, or Sparrow batch sampling.
pub(super) struct Sampling {
    nodes: NodeQueues,
    d: u32,
    batch: bool,
    rng: Rng,
    cpus_of: Vec<u32>,
    probes: Vec<u32>,
    visits: u64,
}

impl Sampling {
    pub(super) fn new(layout: &Layout, d: u32, batch: bool, seed: u64) -> Self {
        Self {
            nodes: NodeQueues::new(layout),
            d: d.max(1),
            batch,
            rng: Rng::new(seed ^ 0x5A4D_504C_494E_4721),
            cpus_of: Vec::new(),
            probes: Vec::new(),
            visits: 0,
        }
    }

    /// A random node that can ever hold `cpus` (resampled a few times,
    /// then the first such node).
    fn sample(&mut self, cpus: u32) -> u32 {
        let n = self.nodes.len() as u64;
        for _ in 0..64 {
            let node = self.rng.below(n) as u32;
            self.visits += 1;
            if self.nodes.cap(node) >= cpus {
                return node;
            }
        }
        (0..n as u32)
            .find(|&i| self.nodes.cap(i) >= cpus)
            .unwrap_or(0)
    }

    fn remember(&mut self, job: u32, cpus: u32) {
        let i = job as usize;
        if self.cpus_of.len() <= i {
            self.cpus_of.resize(i + 1, 0);
        }
        self.cpus_of[i] = cpus;
    }
}

impl Placer for Sampling {
    fn submit(&mut self, _now: u64, jobs: &[SubmitReq], out: &mut Vec<Started>) -> Result<()> {
        if let Some(g) = jobs.iter().find(|j| j.nodes > 1) {
            return Err(SimError::Workload(format!(
                "job {} is a gang of {} nodes: the sampling baselines have no gang placement (use least-loaded or ours)",
                g.job, g.nodes
            )));
        }
        if self.batch && jobs.len() > 1 {
            // Sparrow: probe d x m nodes for the batch; each job takes the
            // least loaded probe not yet used by the batch.
            let max_cpus = jobs.iter().map(|j| j.cpus).max().unwrap_or(1);
            let m = jobs.len() * self.d as usize;
            let mut probes = std::mem::take(&mut self.probes);
            probes.clear();
            for _ in 0..m {
                probes.push(self.sample(max_cpus));
            }
            for j in jobs {
                let mut best: Option<usize> = None;
                for (k, &p) in probes.iter().enumerate() {
                    if p == u32::MAX || self.nodes.cap(p) < j.cpus {
                        continue;
                    }
                    if best.is_none_or(|b| self.nodes.less_loaded(p, probes[b])) {
                        best = Some(k);
                    }
                }
                let node = match best {
                    Some(k) => std::mem::replace(&mut probes[k], u32::MAX),
                    None => self.sample(j.cpus),
                };
                self.remember(j.job, j.cpus);
                self.nodes.enqueue(node, j.job, j.cpus, out);
            }
            self.probes = probes;
            return Ok(());
        }
        for j in jobs {
            let mut best = self.sample(j.cpus);
            for _ in 1..self.d {
                let c = self.sample(j.cpus);
                if self.nodes.less_loaded(c, best) {
                    best = c;
                }
            }
            self.remember(j.job, j.cpus);
            self.nodes.enqueue(best, j.job, j.cpus, out);
        }
        Ok(())
    }

    fn finished(&mut self, _now: u64, job: u32, node: u32, out: &mut Vec<Started>) -> Result<()> {
        let cpus = self.cpus_of.get(job as usize).copied().unwrap_or(0);
        self.nodes.release(node, cpus, out);
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

    #[test]
    fn node_queue_is_fifo_with_head_of_line() {
        let l = Layout::new("1z:1r:1n", "1s:4c:1t").unwrap();
        let mut q = NodeQueues::new(&l);
        let mut out = Vec::new();
        q.enqueue(0, 1, 3, &mut out);
        q.enqueue(0, 2, 2, &mut out);
        q.enqueue(0, 3, 1, &mut out);
        assert_eq!(out.len(), 1, "job 3 fits but waits behind job 2");
        assert_eq!(q.demand(0), 6);
        out.clear();
        q.release(0, 3, &mut out);
        let started: Vec<u32> = out.iter().map(|s| s.job).collect();
        assert_eq!(started, vec![2, 3]);
    }
}
