//! `Sched::wake_up_placed_claiming` and `Sched::wake_up_on_claiming` (a
//! wakeup whose start takes the caller's room report at once, so the leaf
//! is refreshed once) against the two calls they replace: the plain
//! wakeup, then `set_free_summary` of the leaf at the same time. Two
//! engines are driven through the same random wakes, room reports, ends
//! and ticks on random cluster topologies and configurations; every wake
//! goes through the claiming call on one engine and the plain one on the
//! other, which gets the room report when (and only when) the claim was
//! called. The two must stay equal in their whole state (Debug form:
//! queues, aggregates, flags, schedstats), their events and their
//! placements after every operation.

mod room;

use std::sync::Arc;

use proptest::prelude::*;
use room::summary;
use sched::topology::Topology;
use sched::{FreeSummary, Sched, SchedConfig, TaskId, TaskSpec, TaskState};

const TOPOLOGIES: &[&str] = &["2z:3r:3n", "1z:3r:2n", "2z:2r:4n:2h", "3z:2r:2n"];
const NR_TASKS: usize = 16;
const CAPACITY: u32 = 8;

#[derive(Clone, Debug)]
enum Op {
    /// Wake task `.0`; on a claim, report room `.2`. With `.1`, on a leaf
    /// chosen by the caller (`wake_up_on`), else placed by the engine.
    Wake(usize, Option<usize>, Option<[u32; 5]>),
    Room(usize, Option<[u32; 5]>),
    End(usize),
    Tick,
    Advance(u64),
}

fn room() -> impl Strategy<Value = Option<[u32; 5]>> {
    prop::option::weighted(0.8, prop::array::uniform5(0u32..=CAPACITY))
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0..NR_TASKS, prop::option::weighted(0.3, 0usize..64), room())
            .prop_map(|(t, l, r)| Op::Wake(t, l, r)),
        1 => (0usize..64, room()).prop_map(|(l, r)| Op::Room(l, r)),
        3 => (0..NR_TASKS).prop_map(Op::End),
        1 => Just(Op::Tick),
        1 => (1u64..50_000_000).prop_map(Op::Advance),
    ]
}

fn config(c: usize) -> SchedConfig {
    let mut config = match c {
        0 => SchedConfig::default(),
        _ => SchedConfig::cluster(),
    };
    config.steal_cost = 0;
    match c {
        2 => config.domain_reservation = true,
        3 => config.domain_fifo = true,
        _ => {}
    }
    config
}

fn engine(topo: usize, c: usize, demands: &[u32]) -> Sched {
    let topo = Arc::new(Topology::from_spec(TOPOLOGIES[topo]).unwrap());
    let caps = vec![CAPACITY; topo.nr_leaves()];
    let mut s = Sched::with_capacities(topo, &caps, config(c));
    for (i, &d) in demands.iter().enumerate() {
        let mut spec = TaskSpec::new(TaskId(i as u64));
        spec.demand = d;
        s.add_task(spec).unwrap();
    }
    s
}

/// Both engines' whole state and their events (drained) are equal.
fn same(claiming: &mut Sched, plain: &mut Sched) -> Result<(), TestCaseError> {
    prop_assert_eq!(claiming.drain_events(), plain.drain_events());
    prop_assert_eq!(format!("{claiming:?}"), format!("{plain:?}"));
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    #[test]
    fn claiming_wakeup_matches_wakeup_then_room(
        topo in 0..TOPOLOGIES.len(),
        c in 0usize..4,
        demands in prop::collection::vec(1u32..=CAPACITY, NR_TASKS),
        ops in prop::collection::vec(op(), 1..120),
    ) {
        let mut claiming = engine(topo, c, &demands);
        let mut plain = engine(topo, c, &demands);
        let n = claiming.topology().nr_leaves();
        let mut now = 1u64;
        for op in ops {
            match op {
                Op::Advance(ns) => now += ns,
                Op::Tick => {
                    claiming.tick_all(now);
                    plain.tick_all(now);
                }
                Op::Wake(t, on, r) => {
                    let id = TaskId(t as u64);
                    if claiming.task_state(id) != Some(TaskState::Sleeping) {
                        continue;
                    }
                    let mut asked = None;
                    let claim = |leaf| {
                        asked = Some(leaf);
                        Some(summary(r))
                    };
                    match on {
                        Some(l) => {
                            let leaf = l % n;
                            let took = claiming.wake_up_on_claiming(id, leaf, now, claim);
                            let was = plain.wake_up_on(id, leaf, now);
                            prop_assert_eq!(took.is_ok(), was.is_ok());
                            prop_assert_eq!(took.unwrap_or(false), asked.is_some());
                        }
                        None => {
                            let (leaf, how, took) =
                                claiming.wake_up_placed_claiming(id, None, false, now, claim).unwrap();
                            let (l, h) = plain.wake_up_placed(id, None, false, now).unwrap();
                            prop_assert_eq!((leaf, how), (l, h));
                            prop_assert_eq!(took, asked.is_some());
                        }
                    }
                    if let Some(leaf) = asked {
                        // Claimed only where the task started.
                        prop_assert_eq!(claiming.task_state(id), Some(TaskState::Running(leaf)));
                        plain.set_free_summary(leaf, summary(r), now).unwrap();
                    }
                }
                Op::Room(leaf, r) => {
                    claiming.set_free_summary(leaf % n, summary(r), now).unwrap();
                    plain.set_free_summary(leaf % n, summary(r), now).unwrap();
                }
                Op::End(t) => {
                    let id = TaskId(t as u64);
                    if claiming.has_task(id) {
                        claiming.remove_task(id, now).unwrap();
                        plain.remove_task(id, now).unwrap();
                        // Back as a new sleeping task, to be woken again.
                        let mut spec = TaskSpec::new(id);
                        spec.demand = demands[t];
                        claiming.add_task(spec.clone()).unwrap();
                        plain.add_task(spec).unwrap();
                    }
                }
            }
            same(&mut claiming, &mut plain)?;
        }
    }
}

/// The claim is taken in the common case (an idle cluster: the task
/// starts at once, nothing waits), with the room it returns; a task that
/// waits is not claimed.
#[test]
fn claim_taken_on_a_start_and_not_on_a_wait() {
    let mut s = engine(0, 1, &[CAPACITY; NR_TASKS]);
    let room = FreeSummary {
        core: 1,
        llc: 2,
        numa: 3,
        package: 4,
        any: 5,
    };
    let (leaf, _, took) = s
        .wake_up_placed_claiming(TaskId(0), None, false, 1, |_| Some(Some(room)))
        .unwrap();
    assert!(took);
    assert_eq!(s.rq(leaf).align_free(), Some(room.normalized()));
    // Full leaf: the next task on it waits, and no claim is asked.
    let took = s
        .wake_up_on_claiming(TaskId(1), leaf, 2, |_| panic!("claimed a waiting task"))
        .unwrap();
    assert!(!took);
    assert_eq!(s.task_state(TaskId(1)), Some(TaskState::Queued(leaf)));
}
