//! `Sched::idle_balance`, the periodic / nohz idle balance pass, checked
//! against a brute-force oracle: random cluster topologies, node
//! capacities, jobs (demand, time limit or none, affinity) placed on
//! random allowed nodes, some finishing; after one pass, no node with room
//! for a waiting job that may move to it, anywhere in its steal domain,
//! stays without it. The oracle scans every pair of (node, waiting job):
//! the domain is the node's rack, plus the other racks of its zone when
//! cross-LLC stealing is on (zones within the node limit); "room" is
//! brute force over the node's running jobs: the job fits now and, if the
//! node has a waiting head, cannot delay the head's earliest start. And
//! nothing the pass brings to a node delays that node's own head.

mod oracle;

use std::collections::HashMap;
use std::sync::Arc;

use oracle::oracle_start;
use proptest::prelude::*;
use sched::topology::Topology;
use sched::{LeafId, LeafSet, Sched, SchedConfig, SchedEvent, TaskId, TaskSpec, TaskState};

const TOPOLOGIES: &[&str] = &["2z:2r:3n", "1z:3r:2n", "2z:2r:4n:2h", "3z:1r:3n"];
const UNIT: u64 = 1_000;

#[derive(Clone, Debug)]
struct Job {
    demand: u32,
    limit: Option<u64>,
    /// Allowed nodes as a bitmask over leaf ids (0 = anywhere).
    affinity: u16,
    /// Index of the node it is placed on (among its allowed ones).
    place: usize,
}

fn job() -> impl Strategy<Value = Job> {
    (
        1u32..=8,
        prop::option::weighted(0.8, 1u64..50),
        prop_oneof![3 => Just(0u16), 1 => any::<u16>()],
        any::<usize>(),
    )
        .prop_map(|(demand, limit, affinity, place)| Job {
            demand,
            limit: limit.map(|l| l * UNIT),
            affinity,
            place,
        })
}

struct World {
    s: Sched,
    caps: Vec<u32>,
    jobs: HashMap<TaskId, Job>,
    started_at: HashMap<TaskId, u64>,
}

impl World {
    fn record(&mut self, now: u64) {
        for ev in self.s.drain_events() {
            if let SchedEvent::Started { task, .. } = ev {
                self.started_at.insert(task, now);
            }
        }
    }

    fn plan(&self, leaf: LeafId) -> Vec<(u32, Option<u64>)> {
        self.s
            .rq(leaf)
            .running
            .iter()
            .map(|id| {
                let j = &self.jobs[id];
                (j.demand, j.limit.map(|l| self.started_at[id] + l))
            })
            .collect()
    }

    /// The oracle: could job `w` start on `leaf` now without delaying the
    /// leaf's head?
    fn room_for(&self, leaf: LeafId, w: TaskId, now: u64) -> bool {
        let cap = self.caps[leaf];
        let plan = self.plan(leaf);
        let used: u32 = plan.iter().map(|r| r.0).sum();
        let wj = &self.jobs[&w];
        if used + wj.demand > cap {
            return false;
        }
        // The head: the first waiting job, in queue order, that fits the
        // node at all.
        let head = self
            .s
            .rq(leaf)
            .waiting()
            .find(|id| self.jobs[id].demand <= cap);
        let Some(h) = head else {
            return true;
        };
        let hd = self.jobs[&h].demand;
        let Some(before) = oracle_start(cap, &plan, hd, now) else {
            return wj.limit.is_some();
        };
        let mut with = plan;
        with.push((wj.demand, wj.limit.map(|l| now + l)));
        oracle_start(cap, &with, hd, now).is_some_and(|t| t <= before)
    }

    /// The head of `leaf` (first waiting job, in queue order, that fits
    /// the node at all) and its earliest start by the oracle.
    fn head(&self, leaf: LeafId, now: u64) -> Option<(TaskId, Option<u64>)> {
        let cap = self.caps[leaf];
        let h = self
            .s
            .rq(leaf)
            .waiting()
            .find(|id| self.jobs[id].demand <= cap)?;
        Some((
            h,
            oracle_start(cap, &self.plan(leaf), self.jobs[&h].demand, now),
        ))
    }

    /// The oracle's steal domain: same rack, or with cross-LLC stealing
    /// another rack of the same zone.
    fn in_domain(&self, dst: LeafId, src: LeafId, cross: bool) -> bool {
        let topo = self.s.topology();
        let (a, b) = (topo.llc_of(dst), topo.llc_of(src));
        if a == b {
            return true;
        }
        let parent = |llc: usize| topo.node(topo.llcs()[llc].node).parent();
        cross
            && parent(a) == parent(b)
            && parent(a).is_some_and(|p| topo.numa_span(p) <= self.s.config().steal_node_limit)
    }
}

fn build(
    spec: &str,
    caps: &[u32],
    jobs: &[Job],
    finish: &[usize],
    config: SchedConfig,
) -> (World, u64) {
    let topo = Arc::new(Topology::from_spec(spec).unwrap());
    let n = topo.nr_leaves();
    let caps: Vec<u32> = (0..n).map(|l| caps[l % caps.len()]).collect();
    let mut w = World {
        s: Sched::with_capacities(topo, &caps, config),
        caps,
        jobs: HashMap::new(),
        started_at: HashMap::new(),
    };
    let mut now = 0;
    for (i, j) in jobs.iter().enumerate() {
        let id = TaskId(i as u64);
        let allowed: Vec<LeafId> = (0..n)
            .filter(|&l| j.affinity == 0 || j.affinity & (1 << (l % 16)) != 0)
            .collect();
        let allowed = if allowed.is_empty() { vec![0] } else { allowed };
        let mut spec = TaskSpec::new(id);
        spec.demand = j.demand;
        spec.time_limit = j.limit;
        if j.affinity != 0 {
            spec.affinity = Some(Arc::new(LeafSet::from_leaves(n, allowed.iter().copied())));
        }
        w.s.add_task(spec).unwrap();
        w.jobs.insert(id, j.clone());
        w.s.wake_up_on(id, allowed[j.place % allowed.len()], now)
            .unwrap();
        w.record(now);
        now += UNIT / 10;
    }
    // Some running jobs finish early: nodes gain room without going idle.
    for &f in finish {
        let running: Vec<TaskId> = (0..w.jobs.len() as u64)
            .map(TaskId)
            .filter(|id| matches!(w.s.task(*id).unwrap().state, TaskState::Running(_)))
            .collect();
        if let Some(&id) = running.get(f % running.len().max(1)) {
            w.s.block(id, now).unwrap();
            w.record(now);
        }
        now += UNIT / 10;
    }
    (w, now)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn idle_balance_leaves_no_room_unused(
        spec in prop::sample::select(TOPOLOGIES),
        caps in prop::collection::vec(2u32..=10, 1..6),
        jobs in prop::collection::vec(job(), 1..40),
        finish in prop::collection::vec(any::<usize>(), 0..10),
        steal in any::<bool>(),
        cross in any::<bool>(),
    ) {
        let config = SchedConfig {
            backfill: true,
            idle_balance: true,
            steal,
            steal_cross_llc: cross,
            steal_cost: 0,
            ..SchedConfig::cluster()
        };
        let (mut w, now) = build(spec, &caps, &jobs, &finish, config);
        let waiting_before: usize = (0..w.caps.len()).map(|l| w.s.rq(l).nr_waiting()).sum();
        let heads_before: Vec<_> = (0..w.caps.len()).map(|l| w.head(l, now)).collect();
        let moved = w.s.idle_balance(now);
        w.record(now);
        prop_assert!(moved <= waiting_before);
        let n = w.caps.len();
        // Nothing pulled into a node delays its own head.
        for (leaf, before) in heads_before.into_iter().enumerate() {
            if let (Some((h, Some(start))), Some((h2, after))) = (before, w.head(leaf, now))
                && h == h2
            {
                prop_assert!(
                    after.is_some_and(|a| a <= start),
                    "node {leaf}: head {h:?} moved from {start} to {after:?}"
                );
            }
        }
        for dst in 0..n {
            for src in (0..n).filter(|&s| s != dst && w.in_domain(dst, s, cross)) {
                for id in w.s.rq(src).waiting().collect::<Vec<_>>() {
                    prop_assert!(
                        !(w.s.task(id).unwrap().allowed(dst) && w.room_for(dst, id, now)),
                        "node {dst} has room for job {id:?} waiting on node {src}"
                    );
                }
            }
        }
    }

    /// Off (the default), the pass does nothing.
    #[test]
    fn idle_balance_off_moves_nothing(
        spec in prop::sample::select(TOPOLOGIES),
        caps in prop::collection::vec(2u32..=10, 1..6),
        jobs in prop::collection::vec(job(), 1..30),
        finish in prop::collection::vec(any::<usize>(), 0..10),
    ) {
        let config = SchedConfig { backfill: true, ..SchedConfig::cluster() };
        let (mut w, now) = build(spec, &caps, &jobs, &finish, config);
        let before: Vec<TaskState> = (0..jobs.len() as u64).map(|i| w.s.task(TaskId(i)).unwrap().state).collect();
        prop_assert_eq!(w.s.idle_balance(now), 0);
        let after: Vec<TaskState> = (0..jobs.len() as u64).map(|i| w.s.task(TaskId(i)).unwrap().state).collect();
        prop_assert_eq!(before, after);
    }
}

/// The kernel's order: the idle node of the overloaded node's rack pulls
/// first; with cross-LLC stealing a node of another rack of the zone
/// pulls next; a node of another zone is outside the steal domain.
#[test]
fn pulls_rack_first_then_zone() {
    let config = SchedConfig {
        backfill: true,
        idle_balance: true,
        steal: false,
        steal_cross_llc: true,
        ..SchedConfig::cluster()
    };
    // Zone 0: racks {0,1} {2,3}; zone 1: racks {4,5} {6,7}.
    let mut s = Sched::new(
        Arc::new(Topology::from_spec("2z:2r:2n").unwrap()),
        4,
        config,
    );
    let add = |s: &mut Sched, id: u64, leaf: LeafId| {
        let mut spec = TaskSpec::new(TaskId(id));
        spec.demand = 4;
        s.add_task(spec).unwrap();
        s.wake_up_on(TaskId(id), leaf, 0).unwrap();
    };
    // Node 0 runs one job and holds three more; node 2 is full.
    for id in 0..4 {
        add(&mut s, id, 0);
    }
    add(&mut s, 10, 2);
    assert_eq!(s.rq(0).nr_waiting(), 3);
    assert_eq!(s.idle_balance(1), 2);
    let state = |s: &Sched, id| s.task(TaskId(id)).unwrap().state;
    // In next-to-run order: job 1 to node 1 (same rack), job 2 to node 3
    // (the zone's other rack); job 3 stays: zone 1 is not in the domain.
    assert_eq!(state(&s, 1), TaskState::Running(1));
    assert_eq!(state(&s, 2), TaskState::Running(3));
    assert_eq!(state(&s, 3), TaskState::Queued(0));
    // Without cross-LLC stealing only the rack's node pulls.
    let mut s = Sched::new(
        Arc::new(Topology::from_spec("2z:2r:2n").unwrap()),
        4,
        SchedConfig {
            steal_cross_llc: false,
            ..s.config().clone()
        },
    );
    for id in 0..4 {
        add(&mut s, id, 0);
    }
    add(&mut s, 10, 2);
    assert_eq!(s.idle_balance(1), 1);
    assert_eq!(state(&s, 1), TaskState::Running(1));
}
