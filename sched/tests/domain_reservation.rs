//! One reservation per steal domain (`SchedConfig::domain_reservation`),
//! checked against a brute-force oracle on four leaves of random capacity
//! (two racks of two; cross-rack stealing on, one domain of four, or off,
//! two domains of two) with tasks (random demand, time limit or none)
//! arriving on random leaves, finishing at or before their limits, time
//! passing, and the idle-balance pass after every call, with and without
//! one queue per domain (`SchedConfig::domain_fifo`), served in arrival
//! order or shortest remaining limit first
//! (`SchedConfig::shortest_limit_first`):
//!
//! - the protected leaf of each domain is the one whose head has waited
//!   longest, by the oracle's scan of every leaf's head;
//! - no starvation: a protected head starts no later than the reservation
//!   it had when it became protected (the oracle's earliest start over
//!   its leaf's running tasks' ends), and that reservation never moves
//!   later while it stays protected;
//! - work conservation within the domain: no leaf has room for a task
//!   waiting anywhere in its domain that it could start without delaying
//!   its own protected head (the oracle's rule: a leaf whose head is not
//!   protected may start anything that fits).

mod oracle;

mod limited;

use std::collections::HashMap;
use std::sync::Arc;

use limited::add;
use oracle::oracle_start;
use proptest::prelude::*;
use sched::topology::Topology;
use sched::{Sched, SchedConfig, SchedEvent, TaskId, TaskSpec, TaskState};

const UNIT: u64 = 1_000;
const LEAVES: usize = 4;

fn config(cross: bool, fifo: bool, shortest: bool) -> SchedConfig {
    SchedConfig {
        backfill: true,
        domain_reservation: true,
        domain_fifo: fifo,
        shortest_limit_first: shortest,
        idle_balance: true,
        steal_cross_llc: cross,
        steal_cost: 0,
        ..SchedConfig::cluster()
    }
}

#[derive(Clone, Debug)]
enum Op {
    /// A task arrives on a leaf chosen by the caller.
    Arrive {
        leaf: usize,
        demand: u32,
        limit: Option<u64>,
    },
    /// A running task finishes now (before its limit).
    FinishEarly { pick: usize },
    /// Time passes; tasks with a limit finish exactly at it.
    Advance { dt: u64 },
}

fn op(cap: u32) -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..LEAVES, 1..=cap, prop::option::weighted(0.8, 1u64..60)).prop_map(
            |(leaf, demand, limit)| Op::Arrive {
                leaf,
                demand,
                limit: limit.map(|l| l * UNIT),
            }
        ),
        1 => any::<usize>().prop_map(|pick| Op::FinishEarly { pick }),
        3 => (1u64..40).prop_map(|dt| Op::Advance { dt: dt * UNIT }),
    ]
}

struct Model {
    s: Sched,
    cap: u32,
    cross: bool,
    now: u64,
    next: u64,
    demand: HashMap<TaskId, u32>,
    limit: HashMap<TaskId, Option<u64>>,
    started_at: HashMap<TaskId, u64>,
    arrived_at: HashMap<TaskId, u64>,
    /// Per domain (by its first leaf), the protected head and the
    /// reservation it had when it became protected.
    protected: HashMap<usize, (TaskId, Option<u64>)>,
}

impl Model {
    fn new(cap: u32, cross: bool, fifo: bool, shortest: bool) -> Self {
        let topo = Arc::new(Topology::from_spec("1z:2r:2n").unwrap());
        Self {
            s: Sched::new(topo, cap, config(cross, fifo, shortest)),
            cap,
            cross,
            now: 0,
            next: 0,
            demand: HashMap::new(),
            limit: HashMap::new(),
            started_at: HashMap::new(),
            arrived_at: HashMap::new(),
            protected: HashMap::new(),
        }
    }

    /// The leaves of `leaf`'s domain, from the topology string: both racks
    /// with cross-rack stealing, else its rack (leaves 0-1, 2-3).
    fn domain(&self, leaf: usize) -> Vec<usize> {
        if self.cross {
            (0..LEAVES).collect()
        } else {
            let r = leaf / 2 * 2;
            vec![r, r + 1]
        }
    }

    /// (demand, end) of the tasks running on `leaf`.
    fn plan(&self, leaf: usize) -> Vec<(u32, Option<u64>)> {
        self.s
            .rq(leaf)
            .running
            .iter()
            .map(|id| {
                (
                    self.demand[id],
                    self.limit[id].map(|l| self.started_at[id] + l),
                )
            })
            .collect()
    }

    fn used(&self, leaf: usize) -> u32 {
        self.plan(leaf).iter().map(|r| r.0).sum()
    }

    fn waiting_on(&self, leaf: usize) -> Vec<TaskId> {
        self.s.rq(leaf).waiting().collect()
    }

    /// The oracle's protected leaf of a domain: the head (the leaf's next
    /// task) that arrived first.
    fn oracle_protected(&self, dom: &[usize]) -> Option<usize> {
        dom.iter()
            .filter_map(|&l| self.s.next_to_run(l).map(|h| (self.arrived_at[&h], l)))
            .min()
            .map(|(_, l)| l)
    }

    /// Would starting `w` on `leaf` now delay `leaf`'s head `h`?
    fn delays(&self, leaf: usize, h: TaskId, w: TaskId) -> bool {
        let plan = self.plan(leaf);
        let before = oracle_start(self.cap, &plan, self.demand[&h], self.now);
        let Some(before) = before else {
            return self.limit[&w].is_none();
        };
        let mut with = plan;
        with.push((self.demand[&w], self.limit[&w].map(|l| self.now + l)));
        oracle_start(self.cap, &with, self.demand[&h], self.now).is_none_or(|t| t > before)
    }

    /// One engine call and the idle-balance pass, then every property.
    fn step(&mut self, call: impl FnOnce(&mut Sched, u64)) -> Result<(), TestCaseError> {
        call(&mut self.s, self.now);
        self.s.idle_balance(self.now);
        for ev in self.s.drain_events() {
            if let SchedEvent::Started { task, .. } = ev {
                self.started_at.insert(task, self.now);
            }
        }
        let firsts: Vec<usize> = (0..LEAVES).filter(|&l| self.domain(l)[0] == l).collect();
        for first in firsts {
            let dom = self.domain(first);
            let want = self.oracle_protected(&dom);
            for &l in &dom {
                prop_assert_eq!(self.s.domain_protected(l), want, "leaf {}", l);
            }
            // No starvation of the protected head.
            if let Some((h, rec)) = self.protected.get(&first).copied() {
                let state = self.s.task(h).unwrap().state;
                if let Some(rec) = rec
                    && !matches!(state, TaskState::Running(_))
                    && want.and_then(|p| self.s.next_to_run(p)) == Some(h)
                {
                    prop_assert!(
                        self.now <= rec,
                        "protected head {h:?} waits at {} > {rec}",
                        self.now
                    );
                }
                if let TaskState::Running(_) = state
                    && let Some(rec) = rec
                {
                    prop_assert!(self.started_at[&h] <= rec, "head {h:?} started late");
                }
            }
            match want {
                None => {
                    self.protected.remove(&first);
                }
                Some(p) => {
                    let h = self.s.next_to_run(p).unwrap();
                    let start = oracle_start(self.cap, &self.plan(p), self.demand[&h], self.now);
                    match self.protected.get(&first).copied() {
                        Some((old, rec)) if old == h => {
                            if let Some(rec) = rec {
                                prop_assert!(
                                    start.is_some_and(|s| s <= rec),
                                    "protected head {h:?} reservation moved from {rec} to {start:?}"
                                );
                            }
                            self.protected.insert(first, (h, rec.or(start)));
                        }
                        _ => {
                            self.protected.insert(first, (h, start));
                        }
                    }
                }
            }
            // Work conservation within the domain.
            for &l in &dom {
                let protected_head = (want == Some(l)).then(|| self.s.next_to_run(l)).flatten();
                for &src in &dom {
                    for w in self.waiting_on(src) {
                        let fits = self.used(l) + self.demand[&w] <= self.cap;
                        let delays = match protected_head {
                            Some(h) if h != w => self.delays(l, h, w),
                            _ => false,
                        };
                        prop_assert!(
                            !fits || delays,
                            "leaf {l} could start {w:?} (waiting on {src}) at {} but idles",
                            self.now
                        );
                    }
                }
            }
        }
        Ok(())
    }

    fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match *op {
            Op::Arrive {
                leaf,
                demand,
                limit,
            } => {
                // Distinct arrival instants: "waited longest" is unambiguous.
                self.now += 1;
                let id = TaskId(self.next);
                self.next += 1;
                let mut spec = TaskSpec::new(id);
                spec.demand = demand;
                spec.time_limit = limit;
                self.s.add_task(spec).unwrap();
                self.demand.insert(id, demand);
                self.limit.insert(id, limit);
                self.arrived_at.insert(id, self.now);
                self.step(|s, now| s.wake_up_on(id, leaf, now).unwrap())?;
            }
            Op::FinishEarly { pick } => {
                let running: Vec<TaskId> = (0..LEAVES)
                    .flat_map(|l| self.s.rq(l).running.to_vec())
                    .collect();
                if !running.is_empty() {
                    let id = running[pick % running.len()];
                    self.step(|s, now| s.block(id, now).unwrap())?;
                }
            }
            Op::Advance { dt } => {
                let target = self.now + dt;
                loop {
                    let due = (0..LEAVES)
                        .flat_map(|l| self.s.rq(l).running.to_vec())
                        .filter_map(|id| {
                            self.limit[&id].map(|lim| (self.started_at[&id] + lim, id))
                        })
                        .filter(|&(end, _)| end <= target)
                        .min();
                    let Some((end, id)) = due else { break };
                    self.now = self.now.max(end);
                    self.step(|s, now| s.block(id, now).unwrap())?;
                }
                self.now = target;
                self.step(|_, _| {})?;
            }
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn one_reservation_per_domain_against_oracle(
        cross in any::<bool>(),
        fifo in any::<bool>(),
        shortest in any::<bool>(),
        (cap, ops) in (2u32..=8).prop_flat_map(|cap| (Just(cap), prop::collection::vec(op(cap), 1..80)))
    ) {
        let mut m = Model::new(cap, cross, fifo, shortest);
        for op in &ops {
            m.apply(op)?;
        }
    }
}

/// Two nodes of one rack, each with a blocked head behind a long job.
/// Per-leaf EASY protects both heads, so a long small job waits; with one
/// reservation per domain only the older head is protected and the long
/// job starts on the other node, past its younger head.
#[test]
fn only_the_oldest_head_of_the_domain_holds_back_work() {
    for domain_reservation in [false, true] {
        let mut s = Sched::new(
            Arc::new(Topology::from_spec("1z:1r:2n").unwrap()),
            4,
            SchedConfig {
                backfill: true,
                domain_reservation,
                steal_cost: 0,
                ..SchedConfig::cluster()
            },
        );
        for (id, leaf) in [(1, 0), (2, 1)] {
            let t = add(&mut s, id, 3, Some(100));
            s.wake_up_on(t, leaf, 0).unwrap();
        }
        let old = add(&mut s, 3, 4, Some(10));
        s.wake_up_on(old, 0, 1).unwrap();
        let young = add(&mut s, 4, 4, Some(10));
        s.wake_up_on(young, 1, 2).unwrap();
        let long = add(&mut s, 5, 1, Some(500));
        s.wake_up_on(long, 1, 3).unwrap();
        let state = |s: &Sched, id| s.task(id).unwrap().state;
        if domain_reservation {
            assert_eq!(s.domain_protected(1), Some(0));
            assert_eq!(state(&s, long), TaskState::Running(1));
        } else {
            assert_eq!(s.domain_protected(1), None);
            assert_eq!(state(&s, long), TaskState::Queued(1));
        }
        // The older head starts at its reservation either way.
        s.block(TaskId(1), 100).unwrap();
        assert_eq!(state(&s, old), TaskState::Running(0));
    }
}

/// One queue per domain (`SchedConfig::domain_fifo`): when a node of the
/// rack frees room, it starts the rack's oldest waiting job that fits,
/// not its own younger head; without it, its own queue goes first.
#[test]
fn a_node_with_room_starts_the_oldest_job_of_its_domain() {
    for fifo in [false, true] {
        let mut s = Sched::new(
            Arc::new(Topology::from_spec("1z:1r:2n").unwrap()),
            4,
            SchedConfig {
                backfill: true,
                domain_fifo: fifo,
                steal_cost: 0,
                ..SchedConfig::cluster()
            },
        );
        let a = add(&mut s, 1, 4, Some(100));
        s.wake_up_on(a, 0, 0).unwrap();
        let b = add(&mut s, 2, 4, Some(50));
        s.wake_up_on(b, 1, 0).unwrap();
        let old = add(&mut s, 3, 4, Some(10));
        s.wake_up_on(old, 0, 1).unwrap();
        let young = add(&mut s, 4, 4, Some(10));
        s.wake_up_on(young, 1, 2).unwrap();
        // Node 1 frees first.
        s.block(b, 50).unwrap();
        let state = |s: &Sched, id| s.task(id).unwrap().state;
        if fifo {
            assert_eq!(state(&s, old), TaskState::Running(1));
            assert_eq!(state(&s, young), TaskState::Queued(1));
            assert_eq!(s.stats().fifo_pull, 1);
        } else {
            assert_eq!(state(&s, young), TaskState::Running(1));
            assert_eq!(state(&s, old), TaskState::Queued(0));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// The domain's queue order (`SchedConfig::domain_fifo`, with
    /// `shortest_limit_first` on or off): three full nodes of one rack,
    /// tasks waiting on nodes 1 and 2 (random demand, limit or none,
    /// latency class or not, distinct arrivals); node 0, with no queue of
    /// its own (so no reservation), frees. It must start exactly the
    /// tasks the oracle picks: repeatedly the first, by (latency class,
    /// shortest remaining limit when on, earliest arrival), of those that
    /// fit its remaining room.
    #[test]
    fn a_freed_node_starts_the_domain_queue_in_order(
        shortest in any::<bool>(),
        (cap, waiting) in (2u32..=8).prop_flat_map(|cap| (
            Just(cap),
            prop::collection::vec(
                (1usize..3, 1..=cap, prop::option::weighted(0.8, 1u64..60), any::<bool>()),
                1..12,
            ),
        )),
    ) {
        let topo = Arc::new(Topology::from_spec("1z:1r:3n").unwrap());
        let mut s = Sched::new(
            topo,
            cap,
            SchedConfig {
                backfill: true,
                domain_reservation: true,
                domain_fifo: true,
                shortest_limit_first: shortest,
                steal_cost: 0,
                ..SchedConfig::cluster()
            },
        );
        // Every node full, with a task that never ends by itself.
        for leaf in 0..3 {
            let t = add(&mut s, 100 + leaf as u64, cap, None);
            s.wake_up_on(t, leaf, 0).unwrap();
            prop_assert_eq!(s.task(t).unwrap().state, TaskState::Running(leaf));
        }
        let mut keys = Vec::new();
        for (i, &(leaf, demand, limit, latency)) in waiting.iter().enumerate() {
            let id = i as u64;
            let mut spec = TaskSpec::new(TaskId(id));
            spec.demand = demand;
            spec.time_limit = limit.map(|l| l * UNIT);
            spec.latency_nice = if latency { -10 } else { 0 };
            s.add_task(spec).unwrap();
            let at = 1 + i as u64;
            s.wake_up_on(TaskId(id), leaf, at).unwrap();
            let remaining = if shortest {
                limit.map_or(u64::MAX, |l| l * UNIT)
            } else {
                0
            };
            keys.push((!latency, remaining, at, TaskId(id), demand));
        }
        s.drain_events();
        let now = 1_000;
        s.block(TaskId(100), now).unwrap();
        let started: Vec<TaskId> = s
            .drain_events()
            .into_iter()
            .filter_map(|e| match e {
                SchedEvent::Started { task, leaf: 0 } => Some(task),
                _ => None,
            })
            .collect();
        // The oracle: first fitting task by key, until none fits.
        keys.sort();
        let mut room = cap;
        let mut want = Vec::new();
        let mut left: Vec<_> = keys.clone();
        while let Some(i) = left.iter().position(|k| k.4 <= room) {
            let k = left.remove(i);
            room -= k.4;
            want.push(k.3);
        }
        prop_assert_eq!(started, want, "keys {:?}", keys);
    }
}

/// One queue per domain served shortest remaining limit first
/// (`SchedConfig::shortest_limit_first`): when a node frees room, it
/// starts the domain's waiting job with the shortest time limit, not the
/// older longer one; in arrival order, the older.
#[test]
fn a_node_with_room_starts_the_shortest_job_of_its_domain() {
    for shortest in [false, true] {
        let mut s = Sched::new(
            Arc::new(Topology::from_spec("1z:1r:2n").unwrap()),
            4,
            SchedConfig {
                backfill: true,
                domain_reservation: true,
                domain_fifo: true,
                shortest_limit_first: shortest,
                steal_cost: 0,
                ..SchedConfig::cluster()
            },
        );
        let a = add(&mut s, 1, 4, Some(100));
        s.wake_up_on(a, 0, 0).unwrap();
        let b = add(&mut s, 2, 4, Some(50));
        s.wake_up_on(b, 1, 0).unwrap();
        // The older, long job is node 0's head and holds the domain's
        // reservation; the younger, short one waits on node 0 too.
        let long = add(&mut s, 3, 4, Some(1_000));
        s.wake_up_on(long, 0, 1).unwrap();
        let short = add(&mut s, 4, 4, Some(10));
        s.wake_up_on(short, 0, 2).unwrap();
        assert_eq!(s.domain_protected(1), Some(0));
        // Node 1 frees first.
        s.block(b, 50).unwrap();
        let state = |s: &Sched, id| s.task(id).unwrap().state;
        if shortest {
            assert_eq!(state(&s, short), TaskState::Running(1));
            assert_eq!(state(&s, long), TaskState::Queued(0));
            // No starvation: the long job still starts at its reservation.
            s.block(a, 100).unwrap();
            assert_eq!(state(&s, long), TaskState::Running(0));
        } else {
            assert_eq!(state(&s, long), TaskState::Running(1));
            assert_eq!(state(&s, short), TaskState::Queued(0));
        }
    }
}

/// Without a time limit anywhere (NASA-iPSC's trace has none) a
/// protected head's reservation has no known start, so its leaf holds
/// every free CPU for it: the price of the no-starvation bound, which a
/// central least-loaded queue (no reservation) does not pay. A stream of
/// younger 1-CPU jobs placed by `wake_up` may not take node 0's three
/// free CPUs (its room for newcomers is the reservation's `extra`, 0), so the
/// 4-CPU head starts there as soon as node 0's own running job ends;
/// with the hold gone the small jobs fill node 0 and the head waits on.
/// The head is not tied to its leaf: when another node of the domain
/// empties first it starts there (the usual case on NASA at
/// time-scale 1.6, 87% of protected heads), and the held CPUs go to the
/// small jobs at once.
#[test]
fn an_unknown_reservation_holds_its_leaf_until_the_head_starts() {
    for other_node_frees_first in [false, true] {
        let mut s = Sched::new(
            Arc::new(Topology::from_spec("1z:1r:2n").unwrap()),
            4,
            config(false, true, true),
        );
        let a = add(&mut s, 1, 1, None);
        s.wake_up_on(a, 0, 0).unwrap();
        let b = add(&mut s, 2, 4, None);
        s.wake_up_on(b, 1, 0).unwrap();
        let head = add(&mut s, 3, 4, None);
        s.wake_up_on(head, 0, 1).unwrap();
        let small: Vec<TaskId> = (0..3)
            .map(|i| {
                let t = add(&mut s, 10 + i, 1, None);
                s.wake_up(t, None, false, 2 + i).unwrap();
                t
            })
            .collect();
        let state = |s: &Sched, id| s.task(id).unwrap().state;
        assert_eq!(s.domain_protected(1), Some(0));
        assert_eq!(
            s.reservation(0, 5).map(|r| (r.task, r.start)),
            Some((head, None))
        );
        // Node 0 has three free CPUs and three 1-CPU jobs wait: held.
        for &t in &small {
            assert!(
                matches!(state(&s, t), TaskState::Queued(_)),
                "node 0 holds its room"
            );
        }
        if other_node_frees_first {
            s.block(b, 10).unwrap();
            assert_eq!(state(&s, head), TaskState::Running(1));
            for &t in &small {
                assert_eq!(
                    state(&s, t),
                    TaskState::Running(0),
                    "the hold ends with the head"
                );
            }
        } else {
            s.block(a, 10).unwrap();
            assert_eq!(state(&s, head), TaskState::Running(0), "no starvation");
            for &t in &small {
                assert!(matches!(state(&s, t), TaskState::Queued(_)));
            }
        }
    }
}

/// The domain spans the zones within the node limit (the seed's third
/// level of reach, `steal_node_limit`): two zones of two racks of two
/// nodes (rack = LLC, its parent = the zone), every node full; a job
/// waits on node 0 (zone 0). When node 4 (zone 1) empties, it starts
/// that job if the limit allows two zones (one domain, one queue for both
/// zones); with the limit at one zone each zone is its own domain and the
/// job waits for a node of its own zone.
#[test]
fn a_freed_node_starts_a_job_of_the_other_zone_within_the_node_limit() {
    for limit in [1, 2] {
        let mut s = Sched::new(
            Arc::new(Topology::from_spec("2z:2r:2n").unwrap()),
            4,
            SchedConfig {
                steal_node_limit: limit,
                ..config(true, true, false)
            },
        );
        for leaf in 0..8 {
            let limit = if leaf == 4 { 50 } else { 100 };
            let t = add(&mut s, 1 + leaf as u64, 4, Some(limit));
            s.wake_up_on(t, leaf, 0).unwrap();
        }
        let waiting = add(&mut s, 20, 4, Some(10));
        s.wake_up_on(waiting, 0, 1).unwrap();
        let state = |s: &Sched, id| s.task(id).unwrap().state;
        assert_eq!(state(&s, waiting), TaskState::Queued(0));
        // Node 4, in the other zone, frees first.
        s.block(TaskId(5), 50).unwrap();
        if limit == 2 {
            assert_eq!(
                state(&s, waiting),
                TaskState::Running(4),
                "the other zone's freed node takes the job"
            );
        } else {
            assert_eq!(state(&s, waiting), TaskState::Queued(0), "zones apart");
            s.block(TaskId(1), 100).unwrap();
            assert_eq!(state(&s, waiting), TaskState::Running(0));
        }
    }
}
