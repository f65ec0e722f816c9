//! Aging bounded by each task's own limit (`SchedConfig::limit_aging`,
//! with `shortest_limit_first` and one queue per domain), checked against
//! a brute-force oracle.
//!
//! - Order: three full nodes of one rack, tasks waiting on nodes 1 and 2
//!   (random demand, limit or none, latency class or not, distinct
//!   arrivals spread over time); node 0, with no queue of its own (so no
//!   reservation), frees at a random time. It must start exactly the
//!   tasks the oracle picks: repeatedly the first, by (latency class,
//!   overdue, shortest remaining limit, earliest arrival), of those that
//!   fit its remaining room, where overdue means the task has waited at
//!   least its limit (arrival + limit <= now); with
//!   `SchedConfig::widest_first`, the tasks of the tiers it covers (overdue
//!   ones, or all) by width, widest first, before their limits.
//! - No starvation: the reservation is unchanged by the aging (the
//!   domain's oldest head keeps it), so a protected head starts no later
//!   than the reservation it had when it became protected, under a
//!   stream of shorter tasks, some of them overdue, whichever tiers are
//!   served widest first.

mod limited;

use std::sync::Arc;

use limited::add;
use proptest::prelude::*;
use sched::topology::Topology;
use sched::{Sched, SchedConfig, SchedEvent, TaskId, TaskSpec, TaskState, WidestFirst};

const SCOPES: [WidestFirst; 3] = [
    WidestFirst::Never,
    WidestFirst::Overdue,
    WidestFirst::Always,
];

const UNIT: u64 = 1_000;

fn config() -> SchedConfig {
    SchedConfig {
        widest_first: WidestFirst::Never,
        backfill: true,
        domain_reservation: true,
        domain_fifo: true,
        shortest_limit_first: true,
        limit_aging: true,
        steal_cost: 0,
        ..SchedConfig::cluster()
    }
}

fn started_on(s: &mut Sched, leaf: usize) -> Vec<TaskId> {
    s.drain_events()
        .into_iter()
        .filter_map(|e| match e {
            SchedEvent::Started { task, leaf: l } if l == leaf => Some(task),
            _ => None,
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    #[test]
    fn a_freed_node_starts_overdue_tasks_first_against_oracle(
        (cap, waiting) in (2u32..=8).prop_flat_map(|cap| (
            Just(cap),
            prop::collection::vec(
                (
                    1usize..3,
                    1..=cap,
                    prop::option::weighted(0.8, 1u64..60),
                    any::<bool>(),
                    1u64..20,
                ),
                1..14,
            ),
        )),
        late in 0u64..80,
        scope in 0..3usize,
    ) {
        let widest = SCOPES[scope];
        let topo = Arc::new(Topology::from_spec("1z:1r:3n").unwrap());
        let mut s = Sched::new(topo, cap, SchedConfig { widest_first: widest, ..config() });
        // Every node full, with a task that never ends by itself.
        for leaf in 0..3 {
            let t = add(&mut s, 100 + leaf as u64, cap, None);
            s.wake_up_on(t, leaf, 0).unwrap();
            prop_assert_eq!(s.task(t).unwrap().state, TaskState::Running(leaf));
        }
        let mut tasks = Vec::new();
        let mut at = 0;
        for (i, &(leaf, demand, limit, latency, gap)) in waiting.iter().enumerate() {
            at += gap * UNIT;
            let limit = limit.map(|l| l * UNIT);
            let id = i as u64;
            let mut spec = TaskSpec::new(TaskId(id));
            spec.demand = demand;
            spec.time_limit = limit;
            spec.latency_nice = if latency { -10 } else { 0 };
            s.add_task(spec).unwrap();
            s.wake_up_on(TaskId(id), leaf, at).unwrap();
            tasks.push((latency, limit, at, TaskId(id), demand));
        }
        s.drain_events();
        let now = at + late * UNIT;
        s.block(TaskId(100), now).unwrap();
        let started = started_on(&mut s, 0);
        // The oracle: first fitting task by key, until none fits.
        let mut keys: Vec<_> = tasks
            .iter()
            .map(|&(latency, limit, at, id, demand)| {
                let remaining = limit.unwrap_or(u64::MAX);
                let overdue = limit.is_some_and(|l| at + l <= now);
                let wide = match widest {
                    WidestFirst::Never => false,
                    WidestFirst::Overdue => overdue,
                    WidestFirst::Always => true,
                };
                let width = if wide { u32::MAX - demand } else { 0 };
                (!latency, !overdue, width, remaining, at, id, demand)
            })
            .collect();
        keys.sort();
        let mut room = cap;
        let mut want = Vec::new();
        while let Some(i) = keys.iter().position(|k| k.6 <= room) {
            let k = keys.remove(i);
            room -= k.6;
            want.push(k.5);
        }
        prop_assert_eq!(started, want, "now {} tasks {:?}", now, tasks);
    }

    /// No starvation under aging: node 0 runs a task to `first_end`, a
    /// whole-node task H waits on it from 1 unit and holds the domain's
    /// reservation (`first_end`); node 1 frees at 2 units while a stream
    /// of shorter tasks arrives on both nodes (some overdue by the time
    /// room opens). H starts no later than its reservation.
    #[test]
    fn the_protected_head_starts_by_its_reservation(
        cap in 2u32..=8,
        first_end in 5u64..60,
        stream in prop::collection::vec((0usize..2, 1u64..40, 1u64..30, 1u64..6), 1..30),
        scope in 0..3usize,
    ) {
        let topo = Arc::new(Topology::from_spec("1z:1r:2n").unwrap());
        let mut s = Sched::new(topo, cap, SchedConfig { widest_first: SCOPES[scope], ..config() });
        let a = add(&mut s, 1000, cap, Some(first_end * UNIT));
        s.wake_up_on(a, 0, 0).unwrap();
        let b = add(&mut s, 1001, cap, Some(2 * UNIT));
        s.wake_up_on(b, 1, 0).unwrap();
        let h = add(&mut s, 1002, cap, Some(100 * UNIT));
        s.wake_up_on(h, 0, UNIT).unwrap();
        prop_assert_eq!(s.domain_protected(0), Some(0));
        s.drain_events();
        let reservation = first_end * UNIT;
        // Events in time order: arrivals, and the ends of running tasks at
        // their limits.
        let mut arrivals: Vec<(u64, usize, u64, u32)> = stream
            .iter()
            .enumerate()
            .map(|(i, &(leaf, at, limit, demand))| {
                (UNIT + at * UNIT / 2 + i as u64, leaf, limit * UNIT, (demand as u32).min(cap))
            })
            .collect();
        arrivals.sort();
        let mut started_at = std::collections::HashMap::new();
        started_at.insert(a, 0);
        started_at.insert(b, 0);
        let mut next = 0;
        let mut now = UNIT;
        loop {
            // The earliest end among running tasks with a limit.
            let end = (0..2)
                .flat_map(|l| s.rq(l).running.to_vec())
                .filter_map(|id| {
                    let t = s.task(id)?;
                    Some((started_at[&id] + t.time_limit?, id))
                })
                .min();
            let arrival = arrivals.get(next).copied();
            match (end, arrival) {
                (Some((e, id)), Some((t, ..))) if e <= t => {
                    now = now.max(e);
                    s.block(id, now).unwrap();
                }
                (_, Some((t, leaf, limit, demand))) => {
                    now = now.max(t);
                    let id = add(&mut s, next as u64, demand, Some(limit));
                    s.wake_up_on(id, leaf, now).unwrap();
                    next += 1;
                }
                (Some((e, id)), None) => {
                    now = now.max(e);
                    s.block(id, now).unwrap();
                }
                (None, None) => break,
            }
            for ev in s.drain_events() {
                if let SchedEvent::Started { task, .. } = ev {
                    started_at.insert(task, now);
                }
            }
            if !started_at.contains_key(&h) {
                prop_assert!(now <= reservation, "H waits at {} past {}", now, reservation);
            }
        }
        prop_assert!(started_at.get(&h).is_some_and(|&t| t <= reservation));
    }
}

/// A task that has waited as long as its limit goes before a shorter one
/// that has not; without the aging, the shorter one first. Nodes 0 and 1
/// run whole-node tasks; L (limit 30) waits on node 1 from 1 unit and
/// is overdue at 31; S (limit 10) arrives at 35. Node 0 frees at 40.
#[test]
fn an_overdue_task_starts_before_a_shorter_fresh_one() {
    for aging in [false, true] {
        let topo = Arc::new(Topology::from_spec("1z:1r:2n").unwrap());
        let mut s = Sched::new(
            topo,
            4,
            SchedConfig {
                limit_aging: aging,
                ..config()
            },
        );
        let a = add(&mut s, 100, 4, None);
        s.wake_up_on(a, 0, 0).unwrap();
        let b = add(&mut s, 101, 4, None);
        s.wake_up_on(b, 1, 0).unwrap();
        let l = add(&mut s, 1, 4, Some(30 * UNIT));
        s.wake_up_on(l, 1, UNIT).unwrap();
        let short = add(&mut s, 2, 4, Some(10 * UNIT));
        s.wake_up_on(short, 1, 35 * UNIT).unwrap();
        s.drain_events();
        s.block(a, 40 * UNIT).unwrap();
        let want = if aging { l } else { short };
        assert_eq!(started_on(&mut s, 0), vec![want], "aging {aging}");
    }
}
