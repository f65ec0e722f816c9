//! Idle stealing (seed 000 patches 7-9): when a leaf goes idle and the
//! normal path found nothing, take the first migratable waiting task of an
//! overloaded leaf: SMT siblings first "to preserve cache warmth", then the
//! LLC's overload mask from the stealer's own position with wrap-around.
//!
//! Gates, in the seed's order: the STEAL feature; node-limit gating (no
//! stealing when NUMA nodes, cluster: zones, exceed the limit); the
//! stealer's `avg_idle` must be at least the steal cost. A task is
//! migratable (`can_migrate_task_llc`) when it is waiting, not running,
//! and its affinity allows the stealer (and, with capacities, it fits).
//!
//! Beyond the seed, off by default: stealing one level up, from the other
//! LLCs under the LLC's parent domain, through the per-domain list of LLC
//! masks Steve Sistare proposed in the thread ([`Topology::llc_siblings`]).
//!
//! [`Topology::llc_siblings`]: crate::topology::Topology::llc_siblings

use crate::sched::Sched;
use crate::task::{TaskId, TaskState};
use crate::topology::LeafId;

impl Sched {
    /// `try_steal`: the idle leaf `dst` takes one waiting task from an
    /// overloaded leaf. Returns the stolen task.
    pub fn try_steal(&mut self, dst: LeafId, now: u64) -> Option<TaskId> {
        if !self.config.steal || !self.rqs[dst].is_idle() {
            return None;
        }
        if !self.steal_llc_allowed {
            self.stats.steal_skip_node_limit += 1;
            return None;
        }
        if self.rqs[dst].avg_idle < self.config.steal_cost {
            self.stats.steal_skip_avg_idle += 1;
            return None;
        }
        let topo = self.topo.clone();
        let mut found_overloaded = false;

        // First try overloaded leaves on the same core, for cache warmth.
        for &src in topo.smt_siblings(dst) {
            if src != dst && self.overload.test(&topo, src) {
                found_overloaded = true;
                self.stats.steal_scanned += 1;
                if let Some(p) = self.steal_from(dst, src, now) {
                    self.stats.steal_smt += 1;
                    return Some(p);
                }
            }
        }

        // Accept any suitable task in the LLC.
        let llc = topo.llc_of(dst);
        let candidates: Vec<LeafId> = self
            .overload
            .iter_wrap(&topo, llc, topo.llc_pos(dst))
            .collect();
        for src in candidates {
            if src == dst {
                continue;
            }
            found_overloaded = true;
            self.stats.steal_scanned += 1;
            if let Some(p) = self.steal_from(dst, src, now) {
                return Some(p);
            }
        }

        // One level up: the other LLCs of the parent domain.
        if self.config.steal_cross_llc {
            if !self.steal_cross_allowed[llc] {
                self.stats.steal_skip_node_limit += 1;
            } else {
                let sibs = topo.llc_siblings(llc);
                let me = sibs.iter().position(|&x| x == llc).unwrap_or(0);
                for i in 1..sibs.len() {
                    let other = sibs[(me + i) % sibs.len()];
                    let candidates: Vec<LeafId> =
                        self.overload.iter_wrap(&topo, other, 0).collect();
                    for src in candidates {
                        found_overloaded = true;
                        self.stats.steal_scanned += 1;
                        if let Some(p) = self.steal_from(dst, src, now) {
                            self.stats.steal_cross_llc += 1;
                            return Some(p);
                        }
                    }
                }
            }
        }

        if found_overloaded {
            self.stats.steal_fail += 1;
        }
        None
    }

    /// `steal_from`: migrate the first migratable waiting task of `src`, in
    /// next-to-run order, to `dst`.
    fn steal_from(&mut self, dst: LeafId, src: LeafId, now: u64) -> Option<TaskId> {
        if dst == src || !self.rqs[src].is_overloaded() {
            return None;
        }
        let p = self.detach_next_task(src, dst)?;
        self.migrate_queued(p, src, dst, now);
        self.stats.steal += 1;
        Some(p)
    }

    /// `detach_next_task`: the first waiting task of `src`, in next-to-run
    /// order, that may move to `dst`.
    fn detach_next_task(&self, src: LeafId, dst: LeafId) -> Option<TaskId> {
        self.next_to_run_order(src)
            .into_iter()
            .find(|&p| self.can_migrate_task_llc(p, src, dst))
    }

    /// `can_migrate_task_llc`: waiting on `src` (never running), allowed on
    /// `dst`, and fitting there.
    pub fn can_migrate_task_llc(&self, p: TaskId, src: LeafId, dst: LeafId) -> bool {
        let Some(t) = self.tasks.get(&p) else {
            return false;
        };
        t.state == TaskState::Queued(src)
            && t.allowed(dst)
            && t.demand <= self.rqs[dst].room(t.align)
    }
}
