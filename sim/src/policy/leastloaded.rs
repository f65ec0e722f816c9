//! The Kubernetes-like baseline: LeastAllocated scoring on CPU (the node
//! with the most free CPUs among those where the job fits now; ties to the
//! lowest-numbered node), and a central pending queue for jobs that fit
//! nowhere, ordered latency class first (a PriorityClass) then by
//! arrival, retried whenever CPUs free up. A pending job does not block
//! later ones that fit (the scheduler moves on to the next pod).
//!
//! A max segment tree over free CPUs gives the choice in O(log n) and the
//! pending queue is bucketed by CPU count, so a retry costs O(sizes).
//!
//! Gangs (a coscheduling plugin's all-or-nothing PodGroup, without its
//! reservation): a gang of N members starts when N distinct nodes each
//! have room for a member, on the N with the most free CPUs (ties to the
//! lowest-numbered), all at once. Gangs wait in one FIFO: the oldest gang
//! that does not fit holds back the later gangs but not single jobs. When
//! CPUs free up, the waiting gangs are tried before the pending single
//! jobs. A gang attempt scans every node: O(n log n). A gang's end frees
//! all its members before anything is placed again (the simulator reports
//! it member by member; placing on the first freed node would see a
//! cluster state that never existed).
//!
//! GPUs (Kubernetes' extended resource `nvidia.com/gpu`): a job asking for
//! GPUs may go only to a node with that many GPUs free (NodeResourcesFit's
//! filter); among those, the most free CPUs as for any job (GPUs are not
//! scored). A GPU job that fits nowhere waits in its own pending set, in
//! the same (class, arrival) order; since only the node where a job ended
//! changed, a retry tries the waiting GPU jobs on that node alone. Gangs
//! do not ask for GPUs.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use super::{Counters, Move, Placer, Started, SubmitReq};
use crate::error::Result;
use crate::layout::Layout;

/// Max segment tree over per-node free CPUs; `argmax` is the lowest index
/// among the maxima.
struct MaxTree {
    size: usize,
    t: Vec<u32>,
}

impl MaxTree {
    fn new(values: &[u32]) -> Self {
        let size = values.len().next_power_of_two().max(1);
        let mut t = vec![0; 2 * size];
        t[size..size + values.len()].copy_from_slice(values);
        for i in (1..size).rev() {
            t[i] = t[2 * i].max(t[2 * i + 1]);
        }
        Self { size, t }
    }

    fn max(&self) -> u32 {
        self.t[1]
    }

    fn argmax(&self) -> usize {
        let mut i = 1;
        while i < self.size {
            i = if self.t[2 * i] >= self.t[2 * i + 1] {
                2 * i
            } else {
                2 * i + 1
            };
        }
        i - self.size
    }

    fn get(&self, leaf: usize) -> u32 {
        self.t[self.size + leaf]
    }

    fn set(&mut self, leaf: usize, v: u32) {
        let mut i = self.size + leaf;
        self.t[i] = v;
        while i > 1 {
            i /= 2;
            self.t[i] = self.t[2 * i].max(self.t[2 * i + 1]);
        }
    }
}

/// A pending job's order: (not latency class, arrival), then its index.
type PendingKey = ((bool, u64), u32);

pub(super) struct LeastLoaded {
    free: MaxTree,
    /// Pending jobs by CPU count: ((not latency, arrival), job).
    pending: BTreeMap<u32, BTreeSet<PendingKey>>,
    seq: u64,
    cpus_of: Vec<u32>,
    /// Members of each running gang not yet reported finished.
    members_left: Vec<u32>,
    visits: u64,
    /// Nodes of the cluster.
    nodes: usize,
    /// Waiting gangs, oldest first: (job, CPUs per member, members).
    gangs: VecDeque<(u32, u32, u32)>,
    /// Scratch: (free CPUs, node) of the nodes with room for a member.
    room: Vec<(u32, u32)>,
    /// Free GPUs per node.
    gpus_free: Vec<u32>,
    /// GPUs of each job.
    gpus_of: Vec<u32>,
    /// Waiting GPU jobs: ((not latency, arrival), job).
    gpu_pending: BTreeSet<PendingKey>,
    /// Nodes where jobs ended since the last drain.
    freed: Vec<usize>,
}

impl LeastLoaded {
    pub(super) fn new(layout: &Layout) -> Self {
        let caps: Vec<u32> = (0..layout.nr_nodes() as u32)
            .map(|i| layout.cpus(i))
            .collect();
        Self {
            free: MaxTree::new(&caps),
            pending: BTreeMap::new(),
            seq: 0,
            cpus_of: Vec::new(),
            members_left: Vec::new(),
            visits: 0,
            nodes: caps.len(),
            gangs: VecDeque::new(),
            room: Vec::new(),
            gpus_free: (0..layout.nr_nodes() as u32)
                .map(|i| layout.gpus(i))
                .collect(),
            gpus_of: Vec::new(),
            gpu_pending: BTreeSet::new(),
            freed: Vec::new(),
        }
    }

    /// Start GPU job `job` on the node with the most free CPUs among those
    /// with `cpus` CPUs and `gpus` GPUs free; false when none has.
    fn try_gpu(&mut self, job: u32, cpus: u32, gpus: u32, out: &mut Vec<Started>) -> bool {
        self.visits += self.nodes as u64;
        let best = (0..self.nodes)
            .filter(|&n| self.gpus_free[n] >= gpus && self.free.get(n) >= cpus)
            .max_by_key(|&n| (self.free.get(n), std::cmp::Reverse(n)));
        let Some(n) = best else {
            return false;
        };
        self.take_gpu(job, n, cpus, gpus, out);
        true
    }

    fn take_gpu(&mut self, job: u32, n: usize, cpus: u32, gpus: u32, out: &mut Vec<Started>) {
        self.gpus_free[n] -= gpus;
        let f = self.free.get(n);
        self.free.set(n, f - cpus);
        out.push(Started {
            job,
            node: n as u32,
            moved: Move::None,
        });
    }

    fn start(&mut self, job: u32, cpus: u32, out: &mut Vec<Started>) {
        let node = self.free.argmax();
        self.visits += (self.free.size.trailing_zeros() + 1) as u64;
        let f = self.free.get(node);
        self.free.set(node, f - cpus);
        out.push(Started {
            job,
            node: node as u32,
            moved: Move::None,
        });
    }

    /// Start gang `job` on the `nodes` least-loaded nodes with room for
    /// `cpus`, all members at once; false (nothing taken) when fewer
    /// nodes have room.
    fn try_gang(&mut self, job: u32, cpus: u32, nodes: u32, out: &mut Vec<Started>) -> bool {
        if self.free.max() < cpus {
            return false;
        }
        self.visits += self.nodes as u64;
        self.room.clear();
        for node in 0..self.nodes {
            let f = self.free.get(node);
            if f >= cpus {
                self.room.push((f, node as u32));
            }
        }
        if self.room.len() < nodes as usize {
            return false;
        }
        self.room
            .sort_unstable_by_key(|&(f, node)| (std::cmp::Reverse(f), node));
        for k in 0..nodes as usize {
            let (f, node) = self.room[k];
            self.free.set(node as usize, f - cpus);
            out.push(Started {
                job,
                node,
                moved: Move::None,
            });
        }
        true
    }

    /// Start waiting gangs in FIFO order while the oldest fits.
    fn drain_gangs(&mut self, out: &mut Vec<Started>) {
        while let Some(&(job, cpus, nodes)) = self.gangs.front() {
            if !self.try_gang(job, cpus, nodes, out) {
                return;
            }
            self.gangs.pop_front();
        }
    }

    /// Start pending jobs while one fits: each time the first (by class,
    /// then arrival) among the bucket heads that fit the largest free node.
    /// Waiting GPU jobs are tried on `self.freed` alone, the nodes where
    /// jobs ended since the last drain (the only ones where one may fit).
    fn drain(&mut self, out: &mut Vec<Started>) {
        self.drain_gangs(out);
        let freed = std::mem::take(&mut self.freed);
        loop {
            let room = self.free.max();
            // The first waiting GPU job that fits on a freed node, and the
            // freed node with the most free CPUs where it fits.
            let gpu = self.gpu_pending.iter().copied().find_map(|k| {
                let j = k.1 as usize;
                freed
                    .iter()
                    .copied()
                    .filter(|&n| {
                        self.gpus_free[n] >= self.gpus_of[j] && self.free.get(n) >= self.cpus_of[j]
                    })
                    .max_by_key(|&n| (self.free.get(n), std::cmp::Reverse(n)))
                    .map(|n| (k, n))
            });
            let mut best: Option<(u32, (bool, u64))> = None;
            for (&cpus, q) in self.pending.range(..=room) {
                if let Some(&(key, _)) = q.first()
                    && best.is_none_or(|b| key < b.1)
                {
                    best = Some((cpus, key));
                }
            }
            if let Some((g, n)) = gpu
                && best.is_none_or(|b| g.0 < b.1)
            {
                self.gpu_pending.remove(&g);
                let j = g.1 as usize;
                let (cpus, gpus) = (self.cpus_of[j], self.gpus_of[j]);
                self.take_gpu(g.1, n, cpus, gpus, out);
                continue;
            }
            let Some((cpus, _)) = best else {
                return;
            };
            let Some(q) = self.pending.get_mut(&cpus) else {
                return;
            };
            let Some((_, job)) = q.pop_first() else {
                return;
            };
            if q.is_empty() {
                self.pending.remove(&cpus);
            }
            self.start(job, cpus, out);
        }
    }
}

impl Placer for LeastLoaded {
    fn submit(&mut self, _now: u64, jobs: &[SubmitReq], out: &mut Vec<Started>) -> Result<()> {
        for j in jobs {
            let i = j.job as usize;
            if self.cpus_of.len() <= i {
                self.cpus_of.resize(i + 1, 0);
            }
            self.cpus_of[i] = j.cpus;
            if self.members_left.len() <= i {
                self.members_left.resize(i + 1, 0);
            }
            self.members_left[i] = j.nodes;
            if self.gpus_of.len() <= i {
                self.gpus_of.resize(i + 1, 0);
            }
            self.gpus_of[i] = if j.nodes > 1 { 0 } else { j.gpus };
            if j.gpus > 0 && j.nodes <= 1 {
                if !self.try_gpu(j.job, j.cpus, j.gpus, out) {
                    self.seq += 1;
                    self.gpu_pending.insert(((!j.latency, self.seq), j.job));
                }
            } else if j.nodes > 1 {
                self.gangs.push_back((j.job, j.cpus, j.nodes));
                self.drain_gangs(out);
            } else if self.free.max() >= j.cpus {
                self.start(j.job, j.cpus, out);
            } else {
                self.seq += 1;
                self.pending
                    .entry(j.cpus)
                    .or_default()
                    .insert(((!j.latency, self.seq), j.job));
            }
        }
        Ok(())
    }

    fn finished(&mut self, _now: u64, job: u32, node: u32, out: &mut Vec<Started>) -> Result<()> {
        let cpus = self.cpus_of.get(job as usize).copied().unwrap_or(0);
        let f = self.free.get(node as usize);
        self.free.set(node as usize, f + cpus);
        let gpus = self.gpus_of.get(job as usize).copied().unwrap_or(0);
        if let Some(g) = self.gpus_free.get_mut(node as usize) {
            *g += gpus;
        }
        if (node as usize) < self.nodes {
            self.freed.push(node as usize);
        }
        if let Some(left) = self.members_left.get_mut(job as usize) {
            *left = left.saturating_sub(1);
            if *left > 0 {
                return Ok(());
            }
        }
        self.drain(out);
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
    fn most_free_then_pending_in_class_order() {
        let l = Layout::new("1z:1r:2n", "1s:4c:1t").unwrap();
        let mut p = LeastLoaded::new(&l);
        let mut out = Vec::new();
        let req = |job, cpus, latency| SubmitReq {
            job,
            cpus,
            nodes: 1,
            latency,
            waker: None,
            limit_us: None,
            gpus: 0,
            user: None,
        };
        p.submit(0, &[req(0, 3, false), req(1, 2, false)], &mut out)
            .unwrap();
        assert_eq!((out[0].node, out[1].node), (0, 1));
        p.submit(
            0,
            &[req(2, 3, false), req(3, 3, true), req(4, 1, false)],
            &mut out,
        )
        .unwrap();
        assert_eq!(out.len(), 3, "only the 1-CPU job fits now");
        assert_eq!(out[2].node, 1);
        out.clear();
        p.finished(1, 0, 0, &mut out).unwrap();
        assert_eq!(out[0].job, 3, "latency class first");
        assert_eq!(out.len(), 1);
    }
}
