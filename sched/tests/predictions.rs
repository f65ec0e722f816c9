//! Run-time predictions in EASY backfill (`TaskSpec::predicted`, EASY++),
//! on one leaf of random capacity:
//!
//! - while predictions hold (every task ends by its limit or, without one,
//!   by its prediction), they are dates like limits: the head starts no
//!   later than the first dated reservation it had, the engine's
//!   reservation is the brute-force oracle's (running tasks ending at
//!   their limits or predictions), and every waiting task that fits now
//!   and, by the oracle, would not delay the head has started;
//! - when predictions fail (a stream of short-predicted tasks that run far
//!   longer), the head still starts: once a prediction has failed since it
//!   began to wait, nothing starts past it on a prediction, so it waits at
//!   most for the tasks running then.

mod leaf_model;
mod oracle;

use std::sync::Arc;

use leaf_model::{Known, Model, UNIT, config};
use proptest::prelude::*;
use sched::topology::Topology;
use sched::{Sched, SchedEvent, TaskId, TaskSpec, TaskState};

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Predictions that hold are dates like limits: EASY's guarantee and
    /// the oracle's reservation.
    #[test]
    fn predictions_that_hold_against_oracle(
        (cap, ops) in (2u32..=12).prop_flat_map(|cap| {
            let known = prop_oneof![
                2 => (1u64..60).prop_map(|l| Known::Limit(l * UNIT)),
                3 => (1u64..60).prop_map(|p| Known::Predicted(p * UNIT)),
                1 => Just(Known::Nothing),
            ];
            (Just(cap), prop::collection::vec(leaf_model::op(cap, known), 1..80))
        })
    ) {
        let mut m = Model::new(cap);
        for op in &ops {
            m.apply(op)?;
        }
    }
}

/// A 4-CPU leaf: a 1-CPU task predicted to run 10 units runs, a 4-CPU head
/// waits behind it (no limit, no prediction), and every unit a 1-CPU task
/// predicted to run 1 unit arrives and actually runs 100. The first ones
/// start past the head on their predictions (they would end by the
/// running task's predicted end): those of units 1 and 2; at unit 3 the
/// first of them has outlived its prediction, nothing more starts past
/// the head, which starts when the tasks running then have ended (unit
/// 102), long before the stream ends (unit 2,000). Counting on predictions however often they fail (the
/// doubled predictions of the running tasks keep the reservation's date
/// ahead of every new short prediction), the stream takes every CPU that
/// frees and the head waits for its end.
#[test]
fn a_stream_of_wrong_predictions_does_not_starve_the_head() {
    let topo = Arc::new(Topology::from_spec("1z:1r:1n").unwrap());
    let mut s = Sched::new(topo, 4, config());
    let add = |s: &mut Sched, id: u64, demand: u32, predicted: Option<u64>| {
        let mut spec = TaskSpec::new(TaskId(id));
        spec.demand = demand;
        spec.predicted = predicted;
        s.add_task(spec).unwrap();
        TaskId(id)
    };
    let first = add(&mut s, 0, 1, Some(10 * UNIT));
    s.wake_up_on(first, 0, 0).unwrap();
    let head = add(&mut s, 1, 4, None);
    s.wake_up_on(head, 0, 0).unwrap();
    let res = s.reservation(0, 0).unwrap();
    assert_eq!(
        (res.task, res.start, res.predicted),
        (head, Some(10 * UNIT), true)
    );
    s.drain_events();
    // (end, task) of the running tasks.
    let mut ends = vec![(100 * UNIT, first)];
    let mut started_past_head = 0;
    let mut head_start = None;
    for t in 1..2_000u64 {
        let now = t * UNIT;
        ends.sort();
        while let Some(&(end, id)) = ends.first()
            && end <= now
        {
            ends.remove(0);
            s.block(id, end).unwrap();
        }
        let id = add(&mut s, t + 1, 1, Some(UNIT));
        s.wake_up_on(id, 0, now).unwrap();
        for ev in s.drain_events() {
            if let SchedEvent::Started { task, .. } = ev {
                if task == head {
                    head_start.get_or_insert(now);
                } else {
                    ends.push((now + 100 * UNIT, task));
                    if head_start.is_none() {
                        started_past_head += 1;
                    }
                }
            }
        }
        if head_start.is_some() {
            break;
        }
    }
    assert_eq!(head_start, Some(102 * UNIT));
    // Two started on their predictions before the first failed.
    assert_eq!(started_past_head, 2);
    assert_eq!(s.task(head).unwrap().state, TaskState::Running(0));
}

/// A task that outlives its prediction is expected to run as long again as
/// the prediction it passed (doubled), and a limit caps it; its miss is
/// the last prediction it passed below the limit.
#[test]
fn an_outlived_prediction_doubles_up_to_the_limit() {
    let topo = Arc::new(Topology::from_spec("1z:1r:1n").unwrap());
    let mut s = Sched::new(topo, 4, config());
    let mut spec = TaskSpec::new(TaskId(0));
    spec.predicted = Some(10);
    spec.time_limit = Some(70);
    s.add_task(spec).unwrap();
    s.wake_up_on(TaskId(0), 0, 0).unwrap();
    let t = s.task(TaskId(0)).unwrap();
    assert_eq!(t.estimate(0, true), Some(10));
    assert_eq!(t.estimate(10, true), Some(10));
    assert_eq!(t.estimate(11, true), Some(20));
    assert_eq!(t.estimate(35, true), Some(40));
    assert_eq!(t.estimate(41, true), Some(70));
    assert_eq!(t.estimate(41, false), Some(70));
    // Missed at the last prediction passed, not after the limit governed.
    assert_eq!(t.prediction_missed_at(10), None);
    assert_eq!(t.prediction_missed_at(11), Some(10));
    assert_eq!(t.prediction_missed_at(35), Some(20));
    assert_eq!(t.prediction_missed_at(45), Some(40));
    assert_eq!(t.prediction_missed_at(85), Some(40));
}
