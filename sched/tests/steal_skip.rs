//! The steal searches' skip of sources that cannot supply a fitting task
//! (`sched/src/steal.rs`: an LLC, or a source leaf, none of whose waiting
//! tasks is small enough to start on the stealer) and the domain queue's
//! skip of the tasks a reservation refuses for their limit
//! (`Sched::oldest_fitting`, `sched/src/reserve.rs`), checked against the
//! full walk: two engines, one with the skips and one without
//! (`Sched::set_steal_skip(false)`), driven through the same random
//! operations on random cluster and CPU topologies, with capacities,
//! alignments with per-level room, affinities, time limits, run-time
//! predictions, latency-nice,
//! and every switch that changes what "fits" (backfill, one reservation
//! and one queue per domain, cross-LLC stealing, longest-wait pulls, the
//! latency pull, the idle-balance pass, the deadline order of the domain's
//! queue, its aging bounded by each task's limit). After every operation: the same
//! return values, events, schedstats (`steal_scanned` included: a skipped
//! leaf counts as visited) and whole engine state (Debug form).
//!
//! Also the demand sets the skip reads, against brute force: per leaf the
//! demands of its fair and latency timelines, per LLC their union, per
//! sibling group (the LLCs of a parent domain) the union of its LLCs'.
//!
//! Each run counts the searches in which the skip had something to skip
//! (an overloaded leaf of the stealer's domain whose every waiting task is
//! larger than the stealer's bound); too few fails the test.

use std::collections::BTreeMap;
use std::sync::Arc;

mod switches;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use sched::topology::Topology;
use sched::{Align, FreeSummary, LeafSet, Sched, TaskId, TaskSpec, TaskState};

const TOPOLOGIES: &[&str] = &[
    "2z:3r:3n",
    "1z:3r:2n",
    "2z:2r:4n:2h",
    "3z:2r:2n",
    "2s:2c:2t",
];
const NR_TASKS: usize = 24;

#[derive(Clone, Debug)]
enum Op {
    Wake(usize, usize),
    WakeAnywhere(usize),
    Block(usize),
    Steal(usize),
    Schedule(usize),
    IdleBalance,
    TickAll,
    SetCapacity(usize, u32),
    Summary(usize, Option<[u32; 3]>),
    Advance(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..NR_TASKS, 0..24usize).prop_map(|(t, l)| Op::Wake(t, l)),
        2 => (0..NR_TASKS).prop_map(Op::WakeAnywhere),
        3 => (0..NR_TASKS).prop_map(Op::Block),
        3 => (0..24usize).prop_map(Op::Steal),
        1 => (0..24usize).prop_map(Op::Schedule),
        1 => Just(Op::IdleBalance),
        2 => Just(Op::TickAll),
        1 => (0..24usize, 0..9u32).prop_map(|(l, c)| Op::SetCapacity(l, c)),
        1 => (0..24usize, prop::option::of([0..9u32, 0..9u32, 0..9u32]))
            .prop_map(|(l, s)| Op::Summary(l, s)),
        2 => (1..4_000_000_000u64).prop_map(Op::Advance),
    ]
}

#[derive(Clone, Debug)]
struct Job {
    demand: u32,
    latency_nice: i32,
    limit: u64,
    align: usize,
    affinity: u32,
    /// A run-time prediction (0: none), which a reservation may count on
    /// instead of the limit, so the block skip must not apply.
    predicted: u64,
}

fn job() -> impl Strategy<Value = Job> {
    (
        1..9u32,
        prop_oneof![2 => Just(0i32), 1 => -20..20i32],
        0..3_000_000_000u64,
        prop_oneof![3 => Just(4usize), 1 => 0..5usize],
        prop_oneof![3 => Just(0u32), 1 => any::<u32>()],
        prop_oneof![1 => Just(0u64), 1 => 0..3_000_000_000u64],
    )
        .prop_map(
            |(demand, latency_nice, limit, align, affinity, predicted)| Job {
                demand,
                latency_nice,
                limit,
                align,
                affinity,
                predicted,
            },
        )
}

#[derive(Clone, Debug)]
struct Scenario {
    topo: usize,
    capacities: Vec<u32>,
    jobs: Vec<Job>,
    ops: Vec<Op>,
    switches: [bool; 10],
    /// `SchedConfig::deadline_order` (with `shortest_limit_first`).
    deadline: bool,
    /// `SchedConfig::limit_aging` (with `shortest_limit_first`, without
    /// `deadline_order`).
    aging: bool,
    /// `SchedConfig::widest_first`: never, overdue, always.
    widest: u8,
}

fn scenario() -> impl Strategy<Value = Scenario> {
    (
        0..TOPOLOGIES.len(),
        proptest::collection::vec(0..9u32, 24),
        proptest::collection::vec(job(), NR_TASKS),
        proptest::collection::vec(op(), 1..160),
        any::<[bool; 10]>(),
        any::<bool>(),
        any::<bool>(),
        0..3u8,
    )
        .prop_map(
            |(topo, capacities, jobs, ops, switches, deadline, aging, widest)| Scenario {
                topo,
                capacities,
                jobs,
                ops,
                switches,
                deadline,
                aging,
                widest,
            },
        )
}

fn build(sc: &Scenario, skip: bool) -> Sched {
    let topo = Arc::new(Topology::from_spec(TOPOLOGIES[sc.topo]).unwrap());
    let n = topo.nr_leaves();
    let [
        cluster,
        backfill,
        cross,
        longest,
        latency_pull,
        domains,
        balance,
        latency,
        fifo,
        shortest,
    ] = sc.switches;
    // The shared mapping, with each preset's own preemption (this test
    // does not draw it) and the longest-wait pull, which only this test
    // varies.
    let mut config = switches::config_of([
        cluster,
        !cluster,
        backfill,
        cross,
        latency_pull,
        domains,
        fifo,
        balance,
        latency,
        shortest,
    ]);
    config.pull_longest_wait = longest;
    config.deadline_order = sc.deadline;
    config.limit_aging = sc.aging;
    config.widest_first = [
        sched::WidestFirst::Never,
        sched::WidestFirst::Overdue,
        sched::WidestFirst::Always,
    ][sc.widest as usize];
    let mut s = Sched::with_capacities(topo, &sc.capacities[..n], config);
    s.set_steal_skip(skip);
    for (i, j) in sc.jobs.iter().enumerate() {
        let mut spec = TaskSpec::new(TaskId(i as u64));
        spec.demand = j.demand;
        spec.latency_nice = j.latency_nice;
        spec.time_limit = (j.limit > 0).then_some(j.limit);
        spec.predicted = (j.predicted > 0).then_some(j.predicted);
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

/// The demand multiset of some tasks, brute force.
fn demands(s: &Sched, ids: impl Iterator<Item = TaskId>) -> BTreeMap<u32, u32> {
    let mut m = BTreeMap::new();
    for id in ids {
        *m.entry(s.task(id).unwrap().demand).or_insert(0) += 1;
    }
    m
}

fn as_map(d: &sched::rq::DemandSet) -> BTreeMap<u32, u32> {
    d.counts().collect()
}

fn check_demands(s: &Sched) -> Result<(), TestCaseError> {
    let topo = s.topology().clone();
    for (l, llc) in topo.llcs().iter().enumerate() {
        let mut wait = BTreeMap::new();
        let mut lat = BTreeMap::new();
        for &leaf in &llc.members {
            let rq = s.rq(leaf);
            let w = demands(s, rq.waiting());
            let t = demands(s, rq.latency_waiting());
            prop_assert_eq!(&as_map(rq.wait_demands()), &w, "leaf {}", leaf);
            prop_assert_eq!(&as_map(rq.latency_demands()), &t, "leaf {}", leaf);
            for (d, c) in w {
                *wait.entry(d).or_insert(0) += c;
            }
            for (d, c) in t {
                *lat.entry(d).or_insert(0) += c;
            }
        }
        prop_assert_eq!(&as_map(s.llc_demands().wait(l)), &wait, "llc {}", l);
        prop_assert_eq!(&as_map(s.llc_demands().latency(l)), &lat, "llc {}", l);
    }
    // Per sibling group: the union of its LLCs' sets.
    for l in 0..topo.llcs().len() {
        let mut wait = BTreeMap::new();
        let mut lat = BTreeMap::new();
        for &x in topo.llc_siblings(l) {
            for (d, c) in s.llc_demands().wait(x).counts() {
                *wait.entry(d).or_insert(0) += c;
            }
            for (d, c) in s.llc_demands().latency(x).counts() {
                *lat.entry(d).or_insert(0) += c;
            }
        }
        prop_assert_eq!(
            &as_map(s.llc_demands().group_wait(l)),
            &wait,
            "group of {}",
            l
        );
        prop_assert_eq!(
            &as_map(s.llc_demands().group_latency(l)),
            &lat,
            "group of {}",
            l
        );
    }
    Ok(())
}

/// Something to skip for a search from `dst`: an overloaded leaf of its
/// LLC or of a sibling LLC with waiting tasks all larger than `dst`'s bound.
fn skippable(s: &Sched, dst: usize) -> bool {
    let topo = s.topology();
    let bound = s.rq(dst).start_bound();
    let llc = topo.llc_of(dst);
    let mut llcs = vec![llc];
    llcs.extend_from_slice(topo.llc_siblings(llc));
    llcs.into_iter().any(|l| {
        topo.llcs()[l].members.iter().any(|&src| {
            src != dst
                && s.overload_masks().test(topo, src)
                && s.rq(src).wait_demands().min().is_some_and(|m| m > bound)
        })
    })
}

/// The Debug form without the switch itself.
fn state(s: &Sched) -> String {
    format!("{s:?}").replace("steal_skip: false", "steal_skip: true")
}

fn run(sc: &Scenario, seen: &mut usize) -> Result<(), TestCaseError> {
    let mut full = build(sc, false);
    let mut fast = build(sc, true);
    let n = full.topology().nr_leaves();
    let mut now = 0u64;
    for op in &sc.ops {
        match *op {
            Op::Wake(t, l) => {
                let id = TaskId(t as u64);
                if full.task(id).unwrap().state == TaskState::Sleeping {
                    let a = full.wake_up_on(id, l % n, now).is_ok();
                    let b = fast.wake_up_on(id, l % n, now).is_ok();
                    prop_assert_eq!(a, b);
                }
            }
            Op::WakeAnywhere(t) => {
                let id = TaskId(t as u64);
                if full.task(id).unwrap().state == TaskState::Sleeping {
                    let a = full.wake_up(id, None, false, now).ok();
                    let b = fast.wake_up(id, None, false, now).ok();
                    prop_assert_eq!(a, b);
                }
            }
            Op::Block(t) => {
                let id = TaskId(t as u64);
                prop_assert_eq!(full.block(id, now).is_ok(), fast.block(id, now).is_ok());
            }
            Op::Steal(l) => {
                if skippable(&fast, l % n) {
                    *seen += 1;
                }
                let a = full.try_steal(l % n, now);
                let b = fast.try_steal(l % n, now);
                prop_assert_eq!(a, b);
            }
            Op::Schedule(l) => {
                if skippable(&fast, l % n) {
                    *seen += 1;
                }
                full.schedule(l % n, now);
                fast.schedule(l % n, now);
            }
            Op::IdleBalance => {
                prop_assert_eq!(full.idle_balance(now), fast.idle_balance(now));
            }
            Op::TickAll => {
                full.tick_all(now);
                fast.tick_all(now);
            }
            Op::SetCapacity(l, c) => {
                full.set_capacity(l % n, c, now).unwrap();
                fast.set_capacity(l % n, c, now).unwrap();
            }
            Op::Summary(l, sum) => {
                let sum = sum.map(|[a, b, c]| FreeSummary {
                    core: a.min(b),
                    llc: b,
                    numa: b.max(c),
                    package: b.max(c),
                    any: a.max(b).max(c),
                });
                full.set_free_summary(l % n, sum, now).unwrap();
                fast.set_free_summary(l % n, sum, now).unwrap();
            }
            Op::Advance(ns) => now += ns,
        }
        prop_assert_eq!(full.drain_events(), fast.drain_events(), "after {:?}", op);
        prop_assert_eq!(full.stats(), fast.stats(), "after {:?}", op);
        prop_assert_eq!(state(&full), state(&fast), "after {:?}", op);
        check_demands(&fast)?;
    }
    Ok(())
}

#[test]
fn skipping_sources_that_cannot_fit_makes_the_full_walks_decisions() {
    let mut runner = TestRunner::new(Config {
        cases: 384,
        ..Config::default()
    });
    let seen = std::cell::RefCell::new(0usize);
    runner
        .run(&scenario(), |sc| run(&sc, &mut seen.borrow_mut()))
        .unwrap();
    let seen = seen.into_inner();
    assert!(seen >= 200, "only {seen} searches had a source to skip");
}
