//! `SchedConfig::latency_pull`, seed 004's latency-first pick over a
//! leaf's steal domain, checked against a brute-force oracle: random
//! cluster topologies, node capacities, jobs (demand, latency class or
//! batch, affinity) woken on random allowed nodes, running jobs finishing
//! one at a time. After every finish, no latency-class job waiting
//! anywhere in the steal domain of the node that gained room could have
//! used what that node left free plus what it gave to batch jobs, unless
//! a latency-class job of its own waits (which its own queue runs first,
//! seed 004's per-leaf rule). The oracle knows the domain from the
//! topology string alone (same rack; with cross-rack stealing, any rack of
//! the same zone), the capacities and demands from the test's own records;
//! it reads from the engine only where each job is. And a latency-class
//! job moved by any pull starts at once where it went.

use std::collections::HashMap;
use std::sync::Arc;

use proptest::prelude::*;
use sched::topology::Topology;
use sched::{LeafId, LeafSet, Sched, SchedConfig, SchedEvent, TaskId, TaskSpec, TaskState};

/// (spec, zones, racks per zone, nodes per rack).
const TOPOLOGIES: &[(&str, usize, usize, usize)] = &[
    ("2z:2r:3n", 2, 2, 3),
    ("1z:3r:2n", 1, 3, 2),
    ("3z:1r:3n", 3, 1, 3),
    ("2z:3r:2n", 2, 3, 2),
];

#[derive(Clone, Debug)]
struct Job {
    demand: u32,
    latency: bool,
    /// Allowed nodes as a bitmask over leaf ids (0 = anywhere).
    affinity: u16,
    /// Index of the node it is woken on (among its allowed ones).
    place: usize,
}

fn job() -> impl Strategy<Value = Job> {
    (
        1u32..=6,
        prop::bool::weighted(0.3),
        prop_oneof![3 => Just(0u16), 1 => any::<u16>()],
        any::<usize>(),
    )
        .prop_map(|(demand, latency, affinity, place)| Job {
            demand,
            latency,
            affinity,
            place,
        })
}

struct World {
    s: Sched,
    caps: Vec<u32>,
    jobs: HashMap<TaskId, Job>,
    /// (racks per zone, nodes per rack).
    shape: (usize, usize),
    cross: bool,
}

impl World {
    fn rack(&self, leaf: LeafId) -> usize {
        leaf / self.shape.1
    }

    fn zone(&self, leaf: LeafId) -> usize {
        leaf / (self.shape.0 * self.shape.1)
    }

    /// The oracle's steal domain of `dst`.
    fn in_domain(&self, dst: LeafId, src: LeafId) -> bool {
        self.rack(dst) == self.rack(src) || (self.cross && self.zone(dst) == self.zone(src))
    }

    fn where_is(&self, id: TaskId) -> TaskState {
        self.s.task(id).map_or(TaskState::Sleeping, |t| t.state)
    }

    /// Free capacity of `leaf` from the test's own demands.
    fn free(&self, leaf: LeafId) -> u32 {
        let used: u32 = self
            .jobs
            .iter()
            .filter(|(id, _)| self.where_is(**id) == TaskState::Running(leaf))
            .map(|(_, j)| j.demand)
            .sum();
        self.caps[leaf] - used
    }

    fn allowed(&self, id: TaskId, leaf: LeafId) -> bool {
        let a = self.jobs[&id].affinity;
        a == 0 || a & (1 << (leaf % 16)) != 0
    }

    /// The invariant at `dst` after room opened there; `given` is the
    /// capacity batch jobs started on it in the same call.
    fn check_room(&self, dst: LeafId, given: u32) -> Result<(), TestCaseError> {
        let own_latency = self
            .jobs
            .iter()
            .any(|(id, j)| j.latency && self.where_is(*id) == TaskState::Queued(dst));
        if own_latency {
            return Ok(());
        }
        let free = self.free(dst) + given;
        for (id, j) in &self.jobs {
            let TaskState::Queued(src) = self.where_is(*id) else {
                continue;
            };
            if !j.latency || src == dst || !self.in_domain(dst, src) {
                continue;
            }
            prop_assert!(
                !(self.allowed(*id, dst) && j.demand <= free),
                "node {dst} had {free} free (batch jobs took {given}) for latency job {id:?} ({} CPUs) waiting on node {src}",
                j.demand
            );
        }
        Ok(())
    }

    /// Every latency-class job that moved in this batch of events started
    /// where it went. Returns the events.
    fn check_moves(&mut self) -> Result<Vec<SchedEvent>, TestCaseError> {
        let ev = self.s.drain_events();
        for (i, e) in ev.iter().enumerate() {
            if let SchedEvent::Migrated { task, to, .. } = *e
                && self.jobs[&task].latency
            {
                prop_assert!(
                    ev[i..].contains(&SchedEvent::Started { task, leaf: to }),
                    "latency job {task:?} moved to {to} and did not start: {ev:?}"
                );
            }
        }
        Ok(ev)
    }
}

fn run(
    topo: (&str, usize, usize, usize),
    caps: &[u32],
    jobs: &[Job],
    finish: &[usize],
    config: SchedConfig,
) -> Result<World, TestCaseError> {
    let (spec, _, racks, nodes) = topo;
    let t = Arc::new(Topology::from_spec(spec).unwrap());
    let n = t.nr_leaves();
    let caps: Vec<u32> = (0..n).map(|l| caps[l % caps.len()]).collect();
    let cross = config.steal_cross_llc;
    let mut w = World {
        s: Sched::with_capacities(t, &caps, config),
        caps,
        jobs: HashMap::new(),
        shape: (racks, nodes),
        cross,
    };
    let mut now = 0;
    for (i, j) in jobs.iter().enumerate() {
        let id = TaskId(i as u64);
        let mut spec = TaskSpec::new(id);
        spec.demand = j.demand;
        spec.latency_nice = if j.latency { -10 } else { 0 };
        w.jobs.insert(id, j.clone());
        let allowed: Vec<LeafId> = (0..n).filter(|&l| w.allowed(id, l)).collect();
        let allowed = if allowed.is_empty() {
            w.jobs.get_mut(&id).unwrap().affinity = 0;
            (0..n).collect()
        } else {
            allowed
        };
        if w.jobs[&id].affinity != 0 {
            spec.affinity = Some(Arc::new(LeafSet::from_leaves(n, allowed.iter().copied())));
        }
        w.s.add_task(spec).unwrap();
        w.s.wake_up_on(id, allowed[j.place % allowed.len()], now)
            .unwrap();
        w.check_moves()?;
        now += 1_000;
    }
    for &f in finish {
        let running: Vec<(TaskId, LeafId)> = (0..w.jobs.len() as u64)
            .map(TaskId)
            .filter_map(|id| match w.where_is(id) {
                TaskState::Running(l) => Some((id, l)),
                _ => None,
            })
            .collect();
        let Some(&(id, leaf)) = running.get(f % running.len().max(1)) else {
            break;
        };
        w.s.block(id, now).unwrap();
        w.jobs.remove(&id);
        let given: u32 = w
            .check_moves()?
            .iter()
            .filter_map(|e| match *e {
                SchedEvent::Started { task, leaf: l } if l == leaf => Some(&w.jobs[&task]),
                _ => None,
            })
            .filter(|j| !j.latency)
            .map(|j| j.demand)
            .sum();
        w.check_room(leaf, given)?;
        now += 1_000;
    }
    Ok(w)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    #[test]
    fn room_goes_to_the_domains_latency_jobs_first(
        topo in prop::sample::select(TOPOLOGIES),
        caps in prop::collection::vec(2u32..=8, 1..5),
        jobs in prop::collection::vec(job(), 1..40),
        finish in prop::collection::vec(any::<usize>(), 0..25),
        backfill in any::<bool>(),
        cross in any::<bool>(),
    ) {
        let config = SchedConfig {
            backfill,
            steal_cross_llc: cross,
            steal_cost: 0,
            latency_pull: true,
            ..SchedConfig::cluster()
        };
        run(topo, &caps, &jobs, &finish, config)?;
    }
}

/// The oracle can fail: without the pull, a node that gains room runs
/// its own batch job while a latency job waits on the node beside it.
#[test]
fn without_the_pull_room_goes_to_the_local_batch_job() {
    let config = SchedConfig {
        steal_cost: 0,
        latency_pull: false,
        ..SchedConfig::cluster()
    };
    // One rack of two 2-CPU nodes. Node 0 runs j0 (2 CPUs) with batch j2
    // (2) waiting; node 1 runs j1 (2) with latency j3 (2) waiting.
    let jobs = [(2, false, 0), (2, false, 1), (2, false, 0), (2, true, 1)].map(
        |(demand, latency, place)| Job {
            demand,
            latency,
            affinity: 0,
            place,
        },
    );
    let w = run(("1z:1r:2n", 1, 1, 2), &[2], &jobs, &[], config.clone()).unwrap();
    assert_eq!(w.where_is(TaskId(3)), TaskState::Queued(1));
    // j0 ends: node 0 starts j2, its own.
    let err = run(("1z:1r:2n", 1, 1, 2), &[2], &jobs, &[0], config.clone());
    assert!(
        err.is_err(),
        "the oracle must see the latency job passed over"
    );
    // With the pull, j3 starts on node 0 and j2 keeps waiting.
    let on = SchedConfig {
        latency_pull: true,
        ..config
    };
    let w = run(("1z:1r:2n", 1, 1, 2), &[2], &jobs, &[0], on).unwrap();
    assert_eq!(w.where_is(TaskId(3)), TaskState::Running(0));
    assert_eq!(w.where_is(TaskId(2)), TaskState::Queued(0));
    assert_eq!(w.s.stats().latency_pull, 1);
    // Counted as a steal within the rack (schedstats' level split).
    let st = w.s.stats();
    assert_eq!((st.steal, st.steal_smt, st.steal_cross_llc), (1, 0, 0));
}
