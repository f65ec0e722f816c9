//! GPUs at cluster level: how many of a node's GPUs are free for a job
//! (the node's count from its agent's registration, minus the GPUs of the
//! other jobs queued, assigned or running there: the job table's
//! `gpus_on` index; the node's API view shows them, `listing.rs`), and placing again the
//! jobs that wait for free GPUs when some are freed.
//!
//! The node-level engine counts CPUs only; free GPUs act as a placement
//! filter beside the node selector (`NodeEngine::allowed_leaves`): a
//! job asking for `k` GPUs may go only to nodes with `k` free now, and
//! waits `Unplaced { GpusBusy }` (not in any node's queue) while none
//! has them. Which GPUs a job gets is the agent's choice (the NUMA nodes
//! of its CPUs first); the dispatcher counts them. A job queued on a node
//! holds that node's GPUs while it waits there, so two GPU jobs are never
//! sent to one node's last GPU, and a placed GPU job is pinned to its
//! node (`Sched::set_cpus_allowed_ptr` in `place`): its affinity was
//! computed from the GPUs free at placement, so a steal could otherwise
//! move it to a node whose GPUs were taken since (found by the proptest
//! below: 5 GPUs taken of 4).

use super::jobs::{JobKey, Phase, Unplaced};
use super::{Cluster, Effects};

impl Cluster {
    /// GPUs of `node` not taken by jobs other than `except`.
    pub(super) fn gpus_free_for(&self, node: &str, except: Option<JobKey>) -> u32 {
        let Some(n) = self.nodes.get(node) else {
            return 0;
        };
        let mut taken = self.jobs.gpus_on(node);
        if let Some(e) = except.and_then(|k| self.jobs.get(k))
            && e.phase().node() == Some(node)
        {
            taken = taken.saturating_sub(e.gpus());
        }
        n.gpus.saturating_sub(taken)
    }

    /// GPUs of `node` no job holds (queued, assigned or running there).
    pub fn gpus_free(&self, node: &str) -> u32 {
        self.gpus_free_for(node, None)
    }

    /// Once some job's GPUs left a node: place again, oldest first, the
    /// jobs waiting for free GPUs that some node can take now.
    pub(super) fn place_gpu_waiters(&mut self, now: i64, fx: &mut Effects) {
        if !self.jobs.take_gpus_freed() {
            return;
        }
        for key in self.jobs.unplaced() {
            let Some(e) = self.jobs.get(key) else {
                continue;
            };
            if !matches!(
                e.phase(),
                Phase::Unplaced {
                    why: Unplaced::GpusBusy { .. }
                }
            ) {
                continue;
            }
            let Some(spec) = e.job().spec.as_ref() else {
                continue;
            };
            // Only when it fits now: a job still waiting keeps its phase
            // (and its stored record) unchanged.
            let fits = self
                .engine
                .allowed_leaves(spec, &self.nodes, |n| self.gpus_free_for(n, Some(key)))
                .is_ok();
            if fits {
                self.place(key, now, fx);
            }
        }
    }
}
