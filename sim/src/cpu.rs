//! CPU-level mode: each node runs the agent's [`LocalScheduler`] (the
//! engine at CPU level), which picks the CPUs of every job the policy sends
//! to the node — aligned idle CPUs for gangs, `select_task_rq` for 1-CPU
//! jobs — or makes it wait until they are free. A job's run time starts
//! when its node's scheduler starts it. Measured: the local wait, and how
//! compact multi-CPU jobs are (all CPUs in one LLC, in one NUMA node).

use agent::local::{Action, LocalConfig, LocalJob, LocalScheduler};
use sched::{Align, Policy};
use serde::Serialize;

use crate::layout::Layout;

/// CPU-level measurements.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct CpuStats {
    /// Jobs started by node schedulers.
    pub started: u64,
    /// Jobs that had to wait on their node for CPUs.
    pub waited: u64,
    /// Sum of those waits, µs.
    pub wait_us: u64,
    /// Jobs of more than one CPU.
    pub multi: u64,
    /// Of those, with all CPUs in one LLC.
    pub multi_one_llc: u64,
    /// Of those, with all CPUs in one NUMA node.
    pub multi_one_numa: u64,
    /// Jobs a node scheduler refused (larger than the node).
    pub refused: u64,
    /// Stop / continue / re-pin actions (time-slicing, steals).
    pub other_actions: u64,
}

/// One local scheduler per node.
pub struct CpuLevel {
    nodes: Vec<LocalScheduler>,
    assigned_at: Vec<u64>,
    stats: CpuStats,
}

/// A job a node scheduler started: (job, CPUs).
pub type CpuStart = (u32, Vec<u32>);

impl CpuLevel {
    /// A local scheduler for every node of `layout`.
    pub fn new(layout: &Layout) -> Self {
        let nodes = (0..layout.nr_nodes() as u32)
            .map(|n| LocalScheduler::new(layout.shape(n).topo.clone(), LocalConfig::default()))
            .collect();
        Self {
            nodes,
            assigned_at: Vec::new(),
            stats: CpuStats::default(),
        }
    }

    /// Measurements so far.
    pub fn stats(&self) -> CpuStats {
        self.stats
    }

    fn note(&mut self, node: u32, now: u64, actions: Vec<Action>, out: &mut Vec<CpuStart>) {
        for a in actions {
            match a {
                Action::Start { id, cpus } => {
                    let Ok(job) = id.parse::<u32>() else {
                        continue;
                    };
                    self.stats.started += 1;
                    let at = self.assigned_at.get(job as usize).copied().unwrap_or(now);
                    if now > at {
                        self.stats.waited += 1;
                        self.stats.wait_us += now - at;
                    }
                    if cpus.len() > 1 {
                        self.stats.multi += 1;
                        let topo = self.nodes[node as usize].engine().topology().clone();
                        let leaves: Vec<usize> = cpus
                            .iter()
                            .filter_map(|&c| topo.leaf_of_os_id(c as u64))
                            .collect();
                        if let Some(&first) = leaves.first() {
                            if leaves.iter().all(|&l| topo.share_llc(l, first)) {
                                self.stats.multi_one_llc += 1;
                            }
                            if leaves
                                .iter()
                                .all(|&l| topo.numa_of(l) == topo.numa_of(first))
                            {
                                self.stats.multi_one_numa += 1;
                            }
                        }
                    }
                    out.push((job, cpus));
                }
                Action::Stop { .. } | Action::Cont { .. } | Action::Repin { .. } => {
                    self.stats.other_actions += 1;
                }
            }
        }
    }

    /// The policy sent `job` to `node` at `now` (µs). Jobs the node starts
    /// now are appended to `out`; `false` when the node refused the job.
    pub fn assign(
        &mut self,
        now: u64,
        job: u32,
        node: u32,
        cpus: u32,
        latency: bool,
        out: &mut Vec<CpuStart>,
    ) -> bool {
        let i = job as usize;
        if self.assigned_at.len() <= i {
            self.assigned_at.resize(i + 1, 0);
        }
        self.assigned_at[i] = now;
        let lj = LocalJob {
            id: job.to_string(),
            cpus,
            align: Align::Any,
            policy: Policy::Spread,
            nice: 0,
            latency_nice: if latency { -10 } else { 0 },
            gpus: 0,
        };
        match self.nodes[node as usize].submit(lj, now * 1000) {
            Ok(actions) => {
                self.note(node, now, actions, out);
                true
            }
            Err(_) => {
                self.stats.refused += 1;
                false
            }
        }
    }

    /// `job` ended on `node`: jobs its CPUs let start are appended to `out`.
    pub fn exited(&mut self, now: u64, job: u32, node: u32, out: &mut Vec<CpuStart>) {
        let actions = self.nodes[node as usize].job_exited(&job.to_string(), now * 1000);
        self.note(node, now, actions, out);
    }
}
