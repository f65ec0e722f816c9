//! The lazy tick (`Sched::tick` records the tick's time and a leaf does
//! the accounting when it next changes) checked against the eager tick it
//! replaced (`Sched::set_lazy_tick(false)`: every tick accounts every
//! running task at once, the previous code): two engines driven through
//! the same random operations on random cluster and CPU topologies, with
//! capacities, alignments with per-level room, affinities, time limits,
//! nice values (weights other than nice-0 keep their leaf's tick eager),
//! latency-nice, time slices (`preempt`) and the switches that move tasks
//! (backfill, one reservation and one queue per domain, cross-LLC
//! stealing, the latency pull, the idle-balance pass). Ticks come one
//! leaf at a time, for the whole topology, and at times earlier or later
//! than the operations around them.
//!
//! After every operation: the same return values, events and schedstats,
//! every task as `Sched::task` shows it (its `sum_exec_runtime`,
//! `vruntime`, `exec_start` accounted up to its leaf's latest tick) and
//! every leaf's `Sched::min_vruntime`, reservation and next task. At
//! random points and at the end the lazy engine settles every deferred
//! tick (`Sched::settle_all`) and the two whole engines (Debug form) must
//! be equal.
//!
//! Each run counts the deferred ticks that a change settled with a
//! running task to account (and of those, the ones that stood for two
//! ticks or more), and the reads that computed a deferred accounting; too
//! few of any fails the test.

use std::borrow::Cow;
use std::sync::Arc;

mod switches;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use sched::topology::Topology;
use sched::{Align, FreeSummary, LeafSet, Sched, TaskId, TaskSpec, TaskState};

const TOPOLOGIES: &[&str] = &[
    "2z:3r:3n",
    "1z:2r:2n",
    "2z:2r:2n:2h",
    "1s:2c:2t",
    "2s:2c:1t",
];
const NR_TASKS: usize = 20;

#[derive(Clone, Debug)]
enum Op {
    Wake(usize, usize),
    WakeAnywhere(usize, usize),
    Block(usize),
    Steal(usize),
    Schedule(usize),
    IdleBalance,
    TickAll,
    Tick(usize),
    /// `tick_all` at `now` minus this, or plus this: the engine takes
    /// any `now`, so a tick may come later than the next change.
    TickBefore(u64),
    TickAfter(u64),
    SetCapacity(usize, u32),
    Summary(usize, Option<[u32; 3]>),
    Advance(u64),
    Settle,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..NR_TASKS, 0..24usize).prop_map(|(t, l)| Op::Wake(t, l)),
        2 => (0..NR_TASKS, 0..NR_TASKS).prop_map(|(t, w)| Op::WakeAnywhere(t, w)),
        4 => (0..NR_TASKS).prop_map(Op::Block),
        2 => (0..24usize).prop_map(Op::Steal),
        1 => (0..24usize).prop_map(Op::Schedule),
        1 => Just(Op::IdleBalance),
        6 => Just(Op::TickAll),
        3 => (0..24usize).prop_map(Op::Tick),
        1 => (1..3_000_000u64).prop_map(Op::TickBefore),
        1 => (1..3_000_000u64).prop_map(Op::TickAfter),
        1 => (0..24usize, 0..9u32).prop_map(|(l, c)| Op::SetCapacity(l, c)),
        1 => (0..24usize, prop::option::of([0..9u32, 0..9u32, 0..9u32]))
            .prop_map(|(l, s)| Op::Summary(l, s)),
        6 => prop_oneof![1..2_000_000u64, 1..4_000_000_000u64].prop_map(Op::Advance),
        1 => Just(Op::Settle),
    ]
}

#[derive(Clone, Debug)]
struct Job {
    demand: u32,
    nice: i32,
    latency_nice: i32,
    limit: u64,
    align: usize,
    affinity: u32,
}

fn job() -> impl Strategy<Value = Job> {
    (
        1..6u32,
        prop_oneof![4 => Just(0i32), 1 => -20..20i32],
        prop_oneof![2 => Just(0i32), 1 => -20..20i32],
        0..3_000_000_000u64,
        prop_oneof![3 => Just(4usize), 1 => 0..5usize],
        prop_oneof![3 => Just(0u32), 1 => any::<u32>()],
    )
        .prop_map(|(demand, nice, latency_nice, limit, align, affinity)| Job {
            demand,
            nice,
            latency_nice,
            limit,
            align,
            affinity,
        })
}

#[derive(Clone, Debug)]
struct Scenario {
    topo: usize,
    capacities: Vec<u32>,
    jobs: Vec<Job>,
    ops: Vec<Op>,
    switches: [bool; 10],
}

fn scenario() -> impl Strategy<Value = Scenario> {
    (
        0..TOPOLOGIES.len(),
        proptest::collection::vec(0..7u32, 24),
        proptest::collection::vec(job(), NR_TASKS),
        proptest::collection::vec(op(), 1..160),
        any::<[bool; 10]>(),
    )
        .prop_map(|(topo, capacities, jobs, ops, switches)| Scenario {
            topo,
            capacities,
            jobs,
            ops,
            switches,
        })
}

fn build(sc: &Scenario, lazy: bool) -> Sched {
    let topo = Arc::new(Topology::from_spec(TOPOLOGIES[sc.topo]).unwrap());
    let n = topo.nr_leaves();
    let config = switches::config_of(sc.switches);
    let mut s = Sched::with_capacities(topo, &sc.capacities[..n], config);
    s.set_lazy_tick(lazy);
    for (i, j) in sc.jobs.iter().enumerate() {
        let mut spec = TaskSpec::new(TaskId(i as u64));
        spec.demand = j.demand;
        spec.nice = j.nice;
        spec.latency_nice = j.latency_nice;
        spec.time_limit = (j.limit > 0).then_some(j.limit);
        spec.align = Align::ALL[j.align];
        if j.affinity != 0 {
            let first = j.affinity as usize % n;
            let leaves = (0..n).filter(|&l| l == first || j.affinity & (1 << (l % 32)) != 0);
            spec.affinity = Some(Arc::new(LeafSet::from_leaves(n, leaves)));
        }
        s.add_task(spec).unwrap();
    }
    s
}

/// The Debug form without the switch itself.
fn state(s: &Sched) -> String {
    format!("{s:?}").replace("lazy_tick: false", "lazy_tick: true")
}

#[derive(Default)]
struct Seen {
    /// Deferred ticks with running tasks that a change settled.
    settled: usize,
    /// Of those, the ones that stood for two ticks or more.
    several: usize,
    /// Reads that computed a deferred accounting (`task` gave a copy).
    computed: usize,
}

/// Everything a caller can read, per task and per leaf.
fn check_reads(
    eager: &Sched,
    lazy: &Sched,
    now: u64,
    seen: &mut Seen,
    op: &Op,
) -> Result<(), TestCaseError> {
    for i in 0..NR_TASKS {
        let id = TaskId(i as u64);
        let l = lazy.task(id);
        if matches!(l, Some(Cow::Owned(_))) {
            seen.computed += 1;
        }
        prop_assert_eq!(
            format!("{:?}", eager.task(id)),
            format!("{l:?}"),
            "task {} after {:?}",
            i,
            op
        );
        // The reads without the accounting: existence and place.
        prop_assert_eq!(lazy.has_task(id), l.is_some());
        prop_assert_eq!(lazy.task_state(id), eager.task(id).map(|t| t.state));
    }
    for leaf in 0..eager.topology().nr_leaves() {
        prop_assert!(eager.tick_pending(leaf).is_none());
        prop_assert_eq!(
            eager.min_vruntime(leaf),
            lazy.min_vruntime(leaf),
            "leaf {} after {:?}",
            leaf,
            op
        );
        prop_assert_eq!(eager.reservation(leaf, now), lazy.reservation(leaf, now));
        prop_assert_eq!(eager.next_to_run(leaf), lazy.next_to_run(leaf));
    }
    Ok(())
}

fn run(sc: &Scenario, seen: &mut Seen) -> Result<(), TestCaseError> {
    let mut eager = build(sc, false);
    let mut lazy = build(sc, true);
    let n = eager.topology().nr_leaves();
    let mut now = 0u64;
    // Per leaf, the ticks its deferred accounting stands for.
    let mut ticks = vec![0usize; n];
    for op in &sc.ops {
        // Leaves with a deferred tick and a running task before the op.
        let deferred: Vec<usize> = (0..n)
            .filter(|&l| lazy.tick_pending(l).is_some() && !lazy.rq(l).running.is_empty())
            .collect();
        match *op {
            Op::Wake(t, l) => {
                let id = TaskId(t as u64);
                if eager.task(id).unwrap().state == TaskState::Sleeping {
                    let a = eager.wake_up_on(id, l % n, now).is_ok();
                    let b = lazy.wake_up_on(id, l % n, now).is_ok();
                    prop_assert_eq!(a, b);
                }
            }
            Op::WakeAnywhere(t, w) => {
                let id = TaskId(t as u64);
                let waker = (w != t).then_some(TaskId(w as u64));
                if eager.task(id).unwrap().state == TaskState::Sleeping {
                    let a = eager.wake_up_placed(id, waker, w % 2 == 0, now).ok();
                    let b = lazy.wake_up_placed(id, waker, w % 2 == 0, now).ok();
                    prop_assert_eq!(a, b);
                }
            }
            Op::Block(t) => {
                let id = TaskId(t as u64);
                prop_assert_eq!(eager.block(id, now).is_ok(), lazy.block(id, now).is_ok());
            }
            Op::Steal(l) => {
                prop_assert_eq!(eager.try_steal(l % n, now), lazy.try_steal(l % n, now));
            }
            Op::Schedule(l) => {
                eager.schedule(l % n, now);
                lazy.schedule(l % n, now);
            }
            Op::IdleBalance => {
                prop_assert_eq!(eager.idle_balance(now), lazy.idle_balance(now));
            }
            Op::TickAll => {
                eager.tick_all(now);
                lazy.tick_all(now);
            }
            Op::Tick(l) => {
                eager.tick(l % n, now);
                lazy.tick(l % n, now);
            }
            Op::TickBefore(ns) => {
                eager.tick_all(now.saturating_sub(ns));
                lazy.tick_all(now.saturating_sub(ns));
            }
            Op::TickAfter(ns) => {
                eager.tick_all(now + ns);
                lazy.tick_all(now + ns);
            }
            Op::SetCapacity(l, c) => {
                eager.set_capacity(l % n, c, now).unwrap();
                lazy.set_capacity(l % n, c, now).unwrap();
            }
            Op::Summary(l, sum) => {
                let sum = sum.map(|[a, b, c]| FreeSummary {
                    core: a.min(b),
                    llc: b,
                    numa: b.max(c),
                    package: b.max(c),
                    any: a.max(b).max(c),
                });
                eager.set_free_summary(l % n, sum, now).unwrap();
                lazy.set_free_summary(l % n, sum, now).unwrap();
            }
            Op::Advance(ns) => now += ns,
            Op::Settle => lazy.settle_all(),
        }
        for &l in &deferred {
            if lazy.tick_pending(l).is_none() && !matches!(op, Op::Settle) {
                seen.settled += 1;
                if ticks[l] >= 2 {
                    seen.several += 1;
                }
            }
        }
        for (l, k) in ticks.iter_mut().enumerate() {
            let ticked = match *op {
                Op::TickAll | Op::TickBefore(_) | Op::TickAfter(_) => true,
                Op::Tick(x) => x % n == l,
                _ => false,
            };
            if lazy.tick_pending(l).is_none() {
                *k = 0;
            } else if ticked {
                *k += 1;
            }
        }
        prop_assert_eq!(eager.drain_events(), lazy.drain_events(), "after {:?}", op);
        prop_assert_eq!(eager.stats(), lazy.stats(), "after {:?}", op);
        check_reads(&eager, &lazy, now, seen, op)?;
        if matches!(op, Op::Settle) {
            prop_assert_eq!(state(&eager), state(&lazy), "after {:?}", op);
        }
    }
    lazy.settle_all();
    prop_assert_eq!(state(&eager), state(&lazy), "at the end");
    Ok(())
}

#[test]
fn the_lazy_tick_makes_the_eager_ticks_values_and_decisions() {
    let mut runner = TestRunner::new(Config {
        cases: 768,
        ..Config::default()
    });
    let seen = std::cell::RefCell::new(Seen::default());
    runner
        .run(&scenario(), |sc| run(&sc, &mut seen.borrow_mut()))
        .unwrap();
    let seen = seen.into_inner();
    assert!(
        seen.settled >= 1_000,
        "only {} deferred ticks settled by a change",
        seen.settled
    );
    assert!(
        seen.several >= 500,
        "only {} settled deferred accounting of several ticks",
        seen.several
    );
    assert!(
        seen.computed >= 10_000,
        "only {} reads computed a deferred accounting",
        seen.computed
    );
}
