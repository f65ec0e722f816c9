//! Engine configuration: the kernel's sched features and sysctls that this
//! engine implements, with the seeds' defaults.

/// Where a task goes when there is room.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Policy {
    /// Idle core first, then idle leaf (the kernel's default).
    #[default]
    Spread,
    /// Asymmetric packing (seed 002): lowest-numbered core with room while
    /// the load is below the pack threshold.
    Pack,
}

/// Load below which the pack policy is active (seed 002).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PackThreshold {
    /// Pack while runnable demand < number of cores (the seed: "if there are
    /// more threads than SMT domains, asym_packing will not kick in").
    Cores,
    /// Pack while runnable demand < this fraction of total capacity.
    Fraction(f64),
}

/// Which waiting tasks of a steal domain's queue are served widest first
/// when room opens ([`SchedConfig::widest_first`]): among them, the task
/// that fits with the largest demand goes first, then the queue's own
/// order (shortest remaining limit, or deadline, or age).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WidestFirst {
    /// The queue's own order alone.
    #[default]
    Never,
    /// The overdue tier only ([`SchedConfig::limit_aging`]).
    Overdue,
    /// Every task (in each tier: the overdue tier still goes first).
    Always,
}

impl WidestFirst {
    /// The names a command line takes, in the variants' order.
    pub const NAMES: [&'static str; 3] = ["never", "overdue", "always"];
    const ALL: [WidestFirst; 3] = [
        WidestFirst::Never,
        WidestFirst::Overdue,
        WidestFirst::Always,
    ];

    /// The name a command line takes ([`WidestFirst::NAMES`]).
    pub fn as_str(self) -> &'static str {
        Self::NAMES[self as usize]
    }

    /// The scope named `name` ([`WidestFirst::as_str`]).
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|w| w.as_str() == name)
    }
}

/// How node-limit gating counts NUMA nodes (cluster: zones).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeLimitScope {
    /// Seed 000 patch 9: no stealing at all when the machine has more NUMA
    /// nodes than the limit.
    Global,
    /// Cluster form: a steal may search a domain only if it spans at most
    /// `limit` NUMA nodes (zones).
    Domain,
}

/// The engine's tunables. Times are nanoseconds of the caller's clock.
#[derive(Clone, Debug, PartialEq)]
pub struct SchedConfig {
    /// Steal from overloaded leaves when a leaf goes idle (sched feat STEAL).
    pub steal: bool,
    /// Also steal from the other LLCs under the LLC's parent domain
    /// (Steve Sistare's proposal in seed 000's thread). Off by default.
    pub steal_cross_llc: bool,
    /// Steal only if the leaf's average idle time is at least this
    /// (SCHED_STEAL_COST, 10 us in the seed).
    pub steal_cost: u64,
    /// Node-limit gating (sched_steal_node_limit, default 2).
    pub steal_node_limit: usize,
    /// How the node limit is applied.
    pub node_limit_scope: NodeLimitScope,
    /// Use wake_wide to stop pulling wakees to the waker (seed 001).
    pub wake_wide: bool,
    /// Consider the waker's leaf at all (SD_WAKE_AFFINE).
    pub wake_affine: bool,
    /// Honour latency-nice: the latency timeline (seed 004).
    pub latency: bool,
    /// Skip idle searches of domains flagged fully busy (seed 003).
    pub busy_skip: bool,
    /// Policy for tasks that do not choose one.
    pub default_policy: Policy,
    /// When the pack policy is active.
    pub pack_threshold: PackThreshold,
    /// Time-slice running tasks on ticks and preempt on wakeup. The agent
    /// time-slices; the dispatcher never preempts a started job.
    pub preempt: bool,
    /// sysctl_sched_latency: the period in which every runnable task runs.
    pub sched_latency: u64,
    /// sysctl_sched_min_granularity.
    pub min_granularity: u64,
    /// sysctl_sched_wakeup_granularity.
    pub wakeup_granularity: u64,
    /// sysctl_sched_migration_cost: avg_idle starts at twice this and is
    /// capped at twice this.
    pub migration_cost: u64,
    /// EASY backfill inside a leaf (not in the seeds; Slurm's backfill and
    /// the kernel's work conservation at leaf level). The head of a leaf's
    /// queue that cannot start gets a reservation computed from the running
    /// tasks' time limits ([`crate::Sched::reservation`]); later tasks start
    /// now only if they cannot delay it. With it, "overloaded" includes a
    /// leaf whose waiting work cannot start now (a head blocked by
    /// alignment or behind a reservation), and a leaf with spare capacity
    /// behind a blocked head steals what fits without delaying its head.
    /// Off by default: today's behaviour.
    pub backfill: bool,
    /// Let [`crate::Sched::idle_balance`] run: the periodic / nohz idle
    /// balance pass over leaves with room. Off by default: the call does
    /// nothing.
    pub idle_balance: bool,
    /// How a pulling leaf (a steal, or the idle-balance pass) chooses its
    /// source within one level of the search (SMT siblings, the LLC, the
    /// sibling LLCs). Off (seed 000): the first overloaded leaf from the
    /// puller's position with a task that fits. On: the overloaded leaf
    /// whose first task that fits has waited longest, latency class first
    /// (the kernel's `find_busiest_queue`, with "busiest" measured by run
    /// delay, `sched_info.last_queued`, rather than load: a leaf's load
    /// says how much waits there, not who has waited longest). The levels
    /// keep their order. Off by default.
    pub pull_longest_wait: bool,
    /// Seed 004's latency-first pick over the steal domain
    /// ([`crate::Sched::latency_pull`]): a leaf with room, before it starts
    /// its own next task or steals, takes the latency-sensitive task
    /// waiting on an overloaded leaf of its domain (SMT siblings, its LLC,
    /// the sibling LLCs when cross-LLC stealing is on) that can start on
    /// it now and that its own `pick_next_entity` would run first. The
    /// latency timeline is per leaf in the kernel, where a waiting task is
    /// microseconds from a CPU; a job queued on one node may wait hours
    /// while the node beside it frees room, so at cluster level the
    /// timeline is the domain's. Needs `latency` and `steal`; gated by
    /// node-limit gating like a steal. Off by default (the kernel's
    /// per-CPU behaviour).
    pub latency_pull: bool,
    /// With backfill: one reservation per steal domain, as global EASY
    /// keeps one per machine. Of the heads that wait in a leaf's steal
    /// domain (the LLC, or its parent domain when cross-LLC stealing is on
    /// and node-limit gating allows it; the leaf alone without stealing),
    /// only the one that has waited longest (its `queued_at`, then enqueue
    /// order) is protected by a [`crate::Reservation`]; every other leaf
    /// starts any waiting task that fits now, past its own blocked head.
    /// No starvation: a head that is passed over waits until it is the
    /// oldest of its domain, then no task may delay it. Off: every leaf
    /// protects its own head (per-leaf EASY). Off by default.
    pub domain_reservation: bool,
    /// With backfill: one queue per steal domain (the domains of
    /// `domain_reservation`). A leaf with spare capacity starts, before
    /// its own next task, the task that has waited longest in its domain
    /// among those that can start on it now (one waiting on another leaf
    /// moves there as a steal does), as EASY serves one queue in arrival
    /// order. Per-leaf queues otherwise serve their own heads first, so a
    /// job split over several nodes' queues waits for the slowest of
    /// them. Off by default.
    pub domain_fifo: bool,
    /// With `domain_fifo`: the domain's queue is served shortest remaining
    /// time limit first (latency class first; ties, and tasks without a
    /// limit, by wait): shortest-job-first backfilling (SJBF: Srinivasan
    /// et al., "Characterization of backfilling strategies for parallel
    /// job scheduling", 2002; the backfill order of Tsafrir, Etsion and
    /// Feitelson's EASY++, 2007). The reservation is unchanged: the head
    /// that has waited longest keeps it (`domain_reservation`) and its
    /// node holds room for it, so no task starves: a long task passed
    /// over by shorter ones starts no later than its reservation once it
    /// is the oldest head of its domain. Unlike EASY++, the protected
    /// head does not jump the order on other nodes where it fits: that
    /// variant lost most of the gain and was worse on the mixed workload
    /// (docs/BENCHMARKS.md, "Placement quality (issue 13, fourth pass)").
    /// Off: longest wait first, as EASY's queue in arrival order. Off by
    /// default.
    pub shortest_limit_first: bool,
    /// With `shortest_limit_first`: order the domain's queue by the time
    /// each task would end had it started when it began to wait
    /// (`queued_at` + remaining limit; a deadline, earliest first), not by
    /// the remaining limit alone. Shortest first, a long task is passed
    /// over by every shorter task that arrives while it waits, and only
    /// the domain's one reservation bounds its wait: during a burst the
    /// large, long tasks start one reservation at a time (heavy tail:
    /// 16-CPU jobs' wait p99 1,512 s against 978 s in a central queue).
    /// By deadline, a task is passed over only by tasks that arrived
    /// before its deadline: shortest first among tasks that arrive
    /// together, arrival order among tasks of one limit. A trade, measured
    /// in docs/BENCHMARKS.md (quality2's notes): lower p99 and higher
    /// utilization while work waits, a higher mean response and bounded
    /// slowdown. Off by default.
    pub deadline_order: bool,
    /// With `shortest_limit_first` (and not `deadline_order`): aging
    /// bounded by each task's own limit. A task that has waited longer
    /// than its remaining limit (overdue: `queued_at` + remaining limit
    /// <= now, its bounded slowdown already above 2) goes before every
    /// task that is not; each of the two tiers is served shortest
    /// remaining limit first (the latency class first in both; ordering
    /// the overdue tier by deadline behaved like `deadline_order`, as at
    /// saturation nearly every task is overdue). Shortest first alone has
    /// no aging: a long or large task is passed over by every shorter one
    /// until it is the oldest head of its domain. No tunable: the wait is
    /// compared with the task's own limit. Off by default.
    pub limit_aging: bool,
    /// With `domain_fifo`: which tasks of the domain's queue start widest
    /// first ([`WidestFirst`]). A narrow task starts on any CPU that
    /// frees; a wide one only where as many free at once, which the
    /// shortest-first order gave to narrow tasks as often as not, so the
    /// widest waited out every burst. Measured on 51 runs of shapes no
    /// generated table uses (docs/BENCHMARKS.md, "Session 37 (lead)"),
    /// against `Never`: `Overdue`, mean response 4% lower and the widest
    /// jobs' longest wait 7-9% shorter; `Always`, mean response 5-6%
    /// lower, that wait 18-37% shorter, the CPUs busier while work waits
    /// in every run, bounded slowdown within 2%. `Never` by default (the
    /// dispatcher uses `Always`).
    pub widest_first: WidestFirst,
}

impl Default for SchedConfig {
    fn default() -> Self {
        Self {
            steal: true,
            steal_cross_llc: false,
            steal_cost: 10_000,
            steal_node_limit: 2,
            node_limit_scope: NodeLimitScope::Global,
            wake_wide: true,
            wake_affine: true,
            latency: true,
            busy_skip: true,
            default_policy: Policy::Spread,
            pack_threshold: PackThreshold::Cores,
            preempt: true,
            sched_latency: 6_000_000,
            min_granularity: 750_000,
            wakeup_granularity: 1_000_000,
            migration_cost: 500_000,
            backfill: false,
            idle_balance: false,
            pull_longest_wait: false,
            latency_pull: false,
            domain_reservation: false,
            domain_fifo: false,
            shortest_limit_first: false,
            deadline_order: false,
            limit_aging: false,
            widest_first: WidestFirst::Never,
        }
    }
}

impl SchedConfig {
    /// The defaults for node-level placement in the dispatcher: jobs are not
    /// time-sliced, node limit counts zones per searched domain.
    pub fn cluster() -> Self {
        Self {
            preempt: false,
            node_limit_scope: NodeLimitScope::Domain,
            pack_threshold: PackThreshold::Fraction(1.0),
            ..Self::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::WidestFirst;

    #[test]
    fn widest_first_names_round_trip_and_refuse_others() {
        for w in WidestFirst::ALL {
            assert_eq!(WidestFirst::parse(w.as_str()), Some(w));
        }
        assert_eq!(WidestFirst::NAMES, ["never", "overdue", "always"]);
        assert_eq!(WidestFirst::parse("maybe"), None);
    }
}
