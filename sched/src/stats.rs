//! Schedstats: counters of the engine's searches, steals and skips, named as
//! in seed 000 patch 10 (`/proc/schedstat` fields 10-16) where they exist
//! there.
//!
//! The engine does no I/O and reads no clock, so "time spent searching" is
//! kept as a count of leaves visited (`sis_scanned`, `steal_scanned`);
//! callers that want nanoseconds time the calls themselves.
//!
//! These are totals for observers (metrics, benchmarks). How one placement
//! was decided is not read from their differences: `select_task_rq`
//! reports it as a [`crate::select::Placement`].

/// Counters since the engine was built. All monotonic.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Schedstats {
    /// select_idle_sibling found target, prev or recently-used leaf idle
    /// (field 10, "easy").
    pub sis_easy: u64,
    /// select_idle_sibling searched and found an idle core (field 12).
    pub sis_core: u64,
    /// select_idle_sibling searched and found an idle leaf (field 11).
    pub sis_cpu: u64,
    /// select_idle_sibling found nothing idle (field 13).
    pub sis_none: u64,
    /// Leaves examined by idle searches (stand-in for field 14's time).
    pub sis_scanned: u64,
    /// Tasks stolen by an idle leaf (field 15).
    pub steal: u64,
    /// try_steal found overloaded leaves but no migratable task (field 16).
    pub steal_fail: u64,
    /// Steals from an SMT sibling (subset of `steal`).
    pub steal_smt: u64,
    /// Steals from another LLC, one level up (subset of `steal`).
    pub steal_cross_llc: u64,
    /// Leaves examined by steal searches.
    pub steal_scanned: u64,
    /// try_steal declined because avg_idle < steal cost.
    pub steal_skip_avg_idle: u64,
    /// try_steal declined because of node-limit gating.
    pub steal_skip_node_limit: u64,
    /// Idle searches skipped because the domain was flagged fully busy.
    pub busy_skip: u64,
    /// Wakeups placed near the waker (wake_affine chose this leaf).
    pub wake_affine: u64,
    /// Wakeups where wake_wide said spread.
    pub wake_wide: u64,
    /// Placements made by the pack policy.
    pub pack_placed: u64,
    /// Placements made by the slow path (find_idlest).
    pub find_idlest: u64,
    /// Tasks moved between leaves (steals and wakeups on another leaf).
    pub nr_migrations: u64,
    /// Tasks preempted (tick or wakeup preemption).
    pub nr_preemptions: u64,
    /// Tasks picked from the latency timeline ahead of the fair order.
    pub latency_picks: u64,
    /// Latency-sensitive tasks a leaf with room took from another leaf's
    /// queue to run first (`latency_pull`; a subset of `steal`).
    pub latency_pull: u64,
    /// Tasks moved to a leaf because they had waited longest in its
    /// domain (`domain_fifo`; a subset of `steal`).
    pub fifo_pull: u64,
    /// Times a task started running on a leaf.
    pub nr_switches: u64,
}
