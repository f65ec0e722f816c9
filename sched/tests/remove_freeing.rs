//! `Sched::remove_task_freeing` (a task's end and the room it frees on a
//! machine leaf, in one engine operation) against the two calls it
//! replaces, `remove_task` then `set_free_summary`: two engines driven
//! through the same random wakes, room reports and ends on random cluster
//! topologies with the cluster defaults (backfill, latency pull,
//! cross-rack stealing), each end through one path per engine.
//!
//! After every end, on the fused engine: no leaf leaves a task waiting
//! that fits (work conservation), and every domain's aggregate equals its
//! leaves' values recomputed. While nothing waited anywhere before an end
//! (nothing to start or steal, so the order of the room and the removal
//! cannot matter) the leaf holds the room it was given and the two
//! engines stay equal in their whole state (Debug form); once something
//! waited they may part (the fused engine starts the leaf's head against
//! its real room where the other first ran and stole against the stale
//! one), and only the invariants are checked.

mod room;

use std::sync::Arc;

use proptest::prelude::*;
use room::summary;
use sched::topology::Topology;
use sched::{FreeSummary, Sched, SchedConfig, TaskId, TaskSpec, TaskState};

const TOPOLOGIES: &[&str] = &["2z:3r:3n", "1z:3r:2n", "2z:2r:4n:2h", "3z:2r:2n"];
const NR_TASKS: usize = 20;
const CAPACITY: u32 = 8;

#[derive(Clone, Debug)]
enum Op {
    Wake(usize),
    Room(usize, Option<[u32; 5]>),
    End(usize, Option<[u32; 5]>),
    Advance(u64),
}

fn op() -> impl Strategy<Value = Op> {
    let room = prop::option::weighted(0.8, prop::array::uniform5(0u32..=CAPACITY));
    prop_oneof![
        4 => (0..NR_TASKS).prop_map(Op::Wake),
        1 => (0usize..64, room.clone()).prop_map(|(l, r)| Op::Room(l, r)),
        3 => (0..NR_TASKS, room).prop_map(|(t, r)| Op::End(t, r)),
        1 => (1u64..50_000_000).prop_map(Op::Advance),
    ]
}

fn engine(topo: usize, demands: &[u32]) -> Sched {
    let topo = Arc::new(Topology::from_spec(TOPOLOGIES[topo]).unwrap());
    let caps = vec![CAPACITY; topo.nr_leaves()];
    let mut config = SchedConfig::cluster();
    config.steal_cost = 0;
    let mut s = Sched::with_capacities(topo, &caps, config);
    for (i, &d) in demands.iter().enumerate() {
        let mut spec = TaskSpec::new(TaskId(i as u64));
        spec.demand = d;
        s.add_task(spec).unwrap();
    }
    s
}

fn check(s: &Sched) -> Result<(), TestCaseError> {
    let topo = s.topology().clone();
    let n = topo.nr_leaves();
    for leaf in 0..n {
        if let Some(next) = s.next_to_run(leaf) {
            let t = s.task(next).unwrap();
            prop_assert!(
                !s.rq(leaf).can_start(t.demand, t.align),
                "leaf {} leaves {:?} waiting although it fits",
                leaf,
                next
            );
        }
    }
    for node in n..topo.nodes().len() {
        let a = s.aggregate(node);
        let span = topo.span(node);
        let max = |f: &dyn Fn(usize) -> u32| span.iter().map(|&l| f(l)).max().unwrap_or(0);
        prop_assert_eq!(a.max_free, max(&|l| s.rq(l).fit_free()));
        prop_assert_eq!(
            a.sum_free,
            span.iter().map(|&l| s.rq(l).fit_free() as u64).sum::<u64>()
        );
        for align in sched::Align::ALL {
            prop_assert_eq!(a.max_room[align.index()], max(&|l| s.rq(l).room(align)));
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    #[test]
    fn removal_with_room_matches_removal_then_room(
        topo in 0..TOPOLOGIES.len(),
        demands in prop::collection::vec(1u32..=CAPACITY, NR_TASKS),
        ops in prop::collection::vec(op(), 1..120),
    ) {
        let mut fused = engine(topo, &demands);
        let mut twice = engine(topo, &demands);
        let n = fused.topology().nr_leaves();
        let mut now = 1u64;
        let mut equal = true;
        for op in ops {
            match op {
                Op::Advance(ns) => now += ns,
                Op::Wake(t) => {
                    let id = TaskId(t as u64);
                    if fused.task(id).is_some_and(|x| x.state == TaskState::Sleeping) {
                        fused.wake_up(id, None, false, now).unwrap();
                    }
                    if twice.task(id).is_some_and(|x| x.state == TaskState::Sleeping) {
                        twice.wake_up(id, None, false, now).unwrap();
                    }
                }
                Op::Room(leaf, r) => {
                    fused.set_free_summary(leaf % n, summary(r), now).unwrap();
                    twice.set_free_summary(leaf % n, summary(r), now).unwrap();
                }
                Op::End(t, r) => {
                    let id = TaskId(t as u64);
                    let Some(task) = fused.task(id) else { continue };
                    let leaf = match task.state {
                        TaskState::Running(l) | TaskState::Queued(l) => l,
                        TaskState::Sleeping => t % n,
                    };
                    let waited = (0..n).any(|l| fused.rq(l).nr_waiting() > 0);
                    fused.remove_task_freeing(id, leaf, summary(r), now).unwrap();
                    if !waited {
                        // Nothing started after it: the leaf holds the room.
                        prop_assert_eq!(
                            fused.rq(leaf).align_free(),
                            summary(r).map(FreeSummary::normalized)
                        );
                    }
                    if twice.task(id).is_some() {
                        twice.remove_task(id, now).unwrap();
                        twice.set_free_summary(leaf, summary(r), now).unwrap();
                    }
                    if equal && !waited {
                        prop_assert_eq!(format!("{fused:?}"), format!("{twice:?}"));
                    }
                    check(&fused)?;
                }
            }
            equal = equal && format!("{fused:?}") == format!("{twice:?}");
            fused.drain_events();
            twice.drain_events();
        }
    }
}
