//! NO_HZ idle (`Sched::tick_all`, `sched::busy::NohzMask`), checked
//! against brute force over random cluster and CPU topologies, capacities
//! (0 included), tasks and operation sequences:
//!
//! - the mask of ticking leaves always equals {leaves with something
//!   running or waiting, or without room for a newcomer}, computed from
//!   the run queues' public counters;
//! - `tick_all`, which skips the other leaves, leaves the engine in the
//!   same state (tasks, run queues, masks, flags, schedstats, events) as
//!   ticking every leaf in order, which is what the dispatcher's tick did.
//!
//! Each run counts the ticks that really skipped a leaf and the ticks that
//! had work to account; too few of either fails the test.

use std::sync::Arc;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use sched::topology::Topology;
use sched::{Sched, SchedConfig, TaskId, TaskSpec, TaskState};

const TOPOLOGIES: &[&str] = &[
    "2z:2r:3n",
    "2z:2r:4n:2h",
    "3z:1r:2n",
    "1s:4c:2t",
    "2s:2c:2t",
];

#[derive(Clone, Debug)]
enum Op {
    Wake(usize),
    Block(usize),
    TickAll,
    SetCapacity(usize, u32),
    Advance(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0..24usize).prop_map(Op::Wake),
        3 => (0..24usize).prop_map(Op::Block),
        3 => Just(Op::TickAll),
        1 => (0..16usize, 0..5u32).prop_map(|(l, c)| Op::SetCapacity(l, c)),
        2 => (1..200_000_000u64).prop_map(Op::Advance),
    ]
}

#[derive(Clone, Debug)]
struct Scenario {
    topo: usize,
    capacities: Vec<u32>,
    demands: Vec<(u32, i32, u64)>,
    ops: Vec<Op>,
    cluster: bool,
    preempt: bool,
    backfill: bool,
    domains: bool,
}

fn scenario() -> impl Strategy<Value = Scenario> {
    (
        0..TOPOLOGIES.len(),
        proptest::collection::vec(0..5u32, 16),
        proptest::collection::vec((1..4u32, -20..20i32, 0..2_000_000_000u64), 1..24),
        proptest::collection::vec(op(), 1..150),
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(
            |(topo, capacities, demands, ops, cluster, preempt, backfill, domains)| Scenario {
                topo,
                capacities,
                demands,
                ops,
                cluster,
                preempt,
                backfill,
                domains,
            },
        )
}

fn build(sc: &Scenario) -> Sched {
    let topo = Arc::new(Topology::from_spec(TOPOLOGIES[sc.topo]).unwrap());
    let n = topo.nr_leaves();
    let mut config = if sc.cluster {
        SchedConfig::cluster()
    } else {
        SchedConfig::default()
    };
    config.preempt = sc.preempt;
    config.backfill = sc.backfill;
    config.latency_pull = sc.backfill;
    config.domain_reservation = sc.domains;
    config.domain_fifo = sc.domains;
    config.steal_cost = 0;
    let mut s = Sched::with_capacities(topo, &sc.capacities[..n], config);
    for (i, &(demand, latency_nice, limit)) in sc.demands.iter().enumerate() {
        let mut spec = TaskSpec::new(TaskId(i as u64));
        spec.demand = demand;
        spec.latency_nice = latency_nice;
        spec.time_limit = (limit > 0).then_some(limit);
        s.add_task(spec).unwrap();
    }
    s
}

/// The brute-force mask: a leaf ticks unless nothing runs or waits on it
/// and it has room (`room(Any) > 0`, the engine's idle).
fn oracle_ticking(s: &Sched, leaf: usize) -> bool {
    let rq = s.rq(leaf);
    rq.nr_running > 0
        || rq.running_demand > 0
        || rq.nr_waiting() > 0
        || rq.room(sched::Align::Any) == 0
}

#[derive(Default)]
struct Seen {
    skipped: usize,
    accounted: usize,
}

fn run(sc: &Scenario, seen: &mut Seen) -> Result<(), TestCaseError> {
    // `all` ticks every leaf, as the dispatcher's tick did; `nohz` only
    // the mask's leaves.
    let mut all = build(sc);
    let mut nohz = build(sc);
    let n = all.topology().nr_leaves();
    let nr = sc.demands.len();
    let mut now = 0u64;
    for op in &sc.ops {
        match *op {
            Op::Wake(t) => {
                let id = TaskId((t % nr) as u64);
                if all.task(id).unwrap().state == TaskState::Sleeping {
                    let a = all.wake_up(id, None, false, now).unwrap();
                    let b = nohz.wake_up(id, None, false, now).unwrap();
                    prop_assert_eq!(a, b);
                }
            }
            Op::Block(t) => {
                let id = TaskId((t % nr) as u64);
                all.block(id, now).unwrap();
                nohz.block(id, now).unwrap();
            }
            Op::TickAll => {
                let ticking = nohz.nohz_mask().nr_ticking();
                if ticking < n {
                    seen.skipped += 1;
                }
                if (0..n).any(|l| !all.rq(l).running.is_empty()) {
                    seen.accounted += 1;
                }
                for leaf in 0..n {
                    all.tick(leaf, now);
                }
                nohz.tick_all(now);
            }
            Op::SetCapacity(l, c) => {
                all.set_capacity(l % n, c, now).unwrap();
                nohz.set_capacity(l % n, c, now).unwrap();
            }
            Op::Advance(ns) => now += ns,
        }
        for leaf in 0..n {
            prop_assert_eq!(
                nohz.nohz_mask().is_ticking(leaf),
                oracle_ticking(&nohz, leaf),
                "leaf {} after {:?}",
                leaf,
                op
            );
        }
        let want = (0..n).filter(|&l| oracle_ticking(&nohz, l)).count();
        prop_assert_eq!(nohz.nohz_mask().nr_ticking(), want);
        prop_assert_eq!(all.drain_events(), nohz.drain_events());
        // The whole engine, field by field (its Debug form): tasks'
        // vruntimes and run times, run queues, overload masks, busy
        // flags, aggregates, schedstats.
        prop_assert_eq!(format!("{all:?}"), format!("{nohz:?}"), "after {:?}", op);
    }
    Ok(())
}

#[test]
fn nohz_mask_and_tick_all_match_ticking_every_leaf() {
    let mut runner = TestRunner::new(Config {
        cases: 256,
        ..Config::default()
    });
    let seen = std::cell::RefCell::new(Seen::default());
    runner
        .run(&scenario(), |sc| run(&sc, &mut seen.borrow_mut()))
        .unwrap();
    let seen = seen.into_inner();
    assert!(
        seen.skipped > 200,
        "ticks that skipped a leaf: {}",
        seen.skipped
    );
    assert!(
        seen.accounted > 200,
        "ticks with running tasks: {}",
        seen.accounted
    );
}
