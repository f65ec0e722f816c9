//! Property tests of the engine's invariants, each checked against a
//! brute-force oracle over random topologies, capacities, tasks and
//! operation sequences:
//!
//! - the overload mask equals {leaves with runnable demand > capacity}
//!   after any sequence of wakeups, blocks, ticks, capacity changes and the
//!   steals they trigger;
//! - a steal never takes a running task and never breaks affinity;
//! - busy flags never hide an idle leaf: the busy-skip searches find room
//!   if and only if a full scan does;
//! - the pack policy never uses a higher-numbered core while a lower one
//!   has room, below the threshold;
//! - CPU time is proportional to weight within 5%, latency-nice included.

use std::collections::HashMap;
use std::sync::Arc;

use proptest::prelude::*;
use sched::config::PackThreshold;
use sched::topology::Topology;
use sched::{LeafSet, Policy, Sched, SchedConfig, SchedEvent, TaskId, TaskSpec, TaskState};

const TOPOLOGIES: &[&str] = &[
    "1s:2c:2t",
    "1s:4c:2t",
    "2s:2c:2t",
    "2s:4c:1t:llc=2",
    "1s:3c:1t",
    "2z:2r:3n",
    "2z:2r:4n:2h",
    "3z:1r:2n",
];

#[derive(Clone, Debug)]
enum Op {
    Wake {
        task: usize,
        waker: Option<usize>,
        sync: bool,
    },
    WakeOn {
        task: usize,
        leaf: usize,
    },
    Block {
        task: usize,
    },
    Tick {
        leaf: usize,
    },
    TickAll,
    SetCapacity {
        leaf: usize,
        capacity: u32,
    },
    Advance {
        ns: u64,
    },
    SetFree {
        leaf: usize,
        free: Option<[u32; 5]>,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..32usize, proptest::option::of(0..32usize), any::<bool>())
            .prop_map(|(task, waker, sync)| Op::Wake { task, waker, sync }),
        1 => (0..32usize, 0..64usize).prop_map(|(task, leaf)| Op::WakeOn { task, leaf }),
        3 => (0..32usize).prop_map(|task| Op::Block { task }),
        2 => (0..64usize).prop_map(|leaf| Op::Tick { leaf }),
        1 => Just(Op::TickAll),
        1 => (0..64usize, 0..4u32).prop_map(|(leaf, capacity)| Op::SetCapacity { leaf, capacity }),
        2 => (1..5_000_000u64).prop_map(|ns| Op::Advance { ns }),
        1 => (0..64usize, proptest::option::of(proptest::array::uniform5(0..4u32)))
            .prop_map(|(leaf, free)| Op::SetFree { leaf, free }),
    ]
}

#[derive(Clone, Debug)]
struct TaskGen {
    demand: u32,
    nice: i32,
    latency_nice: i32,
    affinity_seed: Option<u64>,
    pack: bool,
    align: usize,
}

fn task_gen() -> impl Strategy<Value = TaskGen> {
    (
        prop_oneof![3 => Just(1u32), 1 => Just(2u32)],
        -5..5i32,
        -20..20i32,
        proptest::option::weighted(0.3, any::<u64>()),
        any::<bool>(),
        0..5usize,
    )
        .prop_map(
            |(demand, nice, latency_nice, affinity_seed, pack, align)| TaskGen {
                demand,
                nice,
                latency_nice,
                affinity_seed,
                pack,
                align,
            },
        )
}

#[derive(Clone, Debug)]
struct Scenario {
    topo: usize,
    capacities: Vec<u32>,
    tasks: Vec<TaskGen>,
    ops: Vec<Op>,
    steal_cross_llc: bool,
    busy_skip: bool,
    cluster: bool,
    preempt: bool,
}

fn scenario() -> impl Strategy<Value = Scenario> {
    (
        0..TOPOLOGIES.len(),
        proptest::collection::vec(1..4u32, 64),
        proptest::collection::vec(task_gen(), 1..24),
        proptest::collection::vec(op(), 1..160),
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(
            |(topo, capacities, tasks, ops, steal_cross_llc, busy_skip, cluster, preempt)| {
                Scenario {
                    topo,
                    capacities,
                    tasks,
                    ops,
                    steal_cross_llc,
                    busy_skip,
                    cluster,
                    preempt,
                }
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
    config.steal_cost = 0;
    config.steal_cross_llc = sc.steal_cross_llc;
    config.busy_skip = sc.busy_skip;
    config.preempt = sc.preempt;
    let mut s = Sched::with_capacities(topo, &sc.capacities[..n], config);
    for (i, t) in sc.tasks.iter().enumerate() {
        let mut spec = TaskSpec::new(TaskId(i as u64));
        spec.demand = t.demand;
        spec.nice = t.nice;
        spec.latency_nice = t.latency_nice;
        spec.policy = t.pack.then_some(Policy::Pack);
        spec.align = sched::Align::ALL[t.align];
        if let Some(seed) = t.affinity_seed {
            let mut leaves: Vec<usize> = (0..n).filter(|l| (seed >> (l % 64)) & 1 == 1).collect();
            if leaves.is_empty() {
                leaves.push((seed % n as u64) as usize);
            }
            spec.affinity = Some(Arc::new(LeafSet::from_leaves(n, leaves)));
        }
        s.add_task(spec).unwrap();
    }
    s
}

/// Apply one op; returns the events it produced.
fn apply(s: &mut Sched, op: &Op, now: &mut u64, nr_tasks: usize) -> Vec<SchedEvent> {
    let n = s.topology().nr_leaves();
    match *op {
        Op::Wake { task, waker, sync } => {
            let id = TaskId((task % nr_tasks) as u64);
            let waker = waker.map(|w| TaskId((w % nr_tasks) as u64));
            if s.task(id).unwrap().state == TaskState::Sleeping {
                let leaf = s.wake_up(id, waker, sync, *now).unwrap();
                assert!(s.task(id).unwrap().allowed(leaf), "placed against affinity");
            }
        }
        Op::WakeOn { task, leaf } => {
            let id = TaskId((task % nr_tasks) as u64);
            let leaf = leaf % n;
            let t = s.task(id).unwrap();
            if t.state == TaskState::Sleeping && t.allowed(leaf) {
                s.wake_up_on(id, leaf, *now).unwrap();
            }
        }
        Op::Block { task } => s.block(TaskId((task % nr_tasks) as u64), *now).unwrap(),
        Op::Tick { leaf } => s.tick(leaf % n, *now),
        Op::TickAll => {
            for leaf in 0..n {
                s.tick(leaf, *now);
            }
        }
        Op::SetCapacity { leaf, capacity } => s.set_capacity(leaf % n, capacity, *now).unwrap(),
        Op::Advance { ns } => *now += ns,
        Op::SetFree { leaf, free } => {
            let summary = free.map(|f| sched::FreeSummary {
                core: f[0],
                llc: f[1],
                numa: f[2],
                package: f[3],
                any: f[4],
            });
            s.set_free_summary(leaf % n, summary, *now).unwrap();
        }
    }
    s.drain_events()
}

/// The invariants that must hold between any two operations.
fn check_invariants(s: &Sched, nr_tasks: usize) -> Result<(), TestCaseError> {
    let topo = s.topology().clone();
    let n = topo.nr_leaves();
    // Oracle: runnable demand per leaf, from the tasks' own states.
    let mut demand = vec![0u32; n];
    let mut running = vec![0u32; n];
    for i in 0..nr_tasks {
        let t = s.task(TaskId(i as u64)).unwrap();
        match t.state {
            TaskState::Queued(l) => demand[l] += t.demand,
            TaskState::Running(l) => {
                demand[l] += t.demand;
                running[l] += t.demand;
                prop_assert!(t.allowed(l), "task {i} runs against its affinity");
            }
            TaskState::Sleeping => {}
        }
    }
    for leaf in 0..n {
        let rq = s.rq(leaf);
        prop_assert_eq!(rq.nr_running, demand[leaf], "nr_running of leaf {}", leaf);
        prop_assert_eq!(rq.running_demand, running[leaf]);
        prop_assert!(
            rq.running_demand <= rq.capacity,
            "leaf {} runs over capacity",
            leaf
        );
        // Work conservation: the task next in line never fits and waits.
        if let Some(next) = s.next_to_run(leaf) {
            let t = s.task(next).unwrap();
            prop_assert!(
                !rq.can_start(t.demand, t.align),
                "leaf {} leaves {:?} waiting although it fits",
                leaf,
                next
            );
        }
        let overloaded = demand[leaf] > rq.capacity;
        prop_assert_eq!(
            s.overload_masks().test(&topo, leaf),
            overloaded,
            "overload bit of leaf {} (demand {}, capacity {})",
            leaf,
            demand[leaf],
            rq.capacity
        );
    }
    for (i, llc) in topo.llcs().iter().enumerate() {
        let expect = llc
            .members
            .iter()
            .filter(|&&l| demand[l] > s.rq(l).capacity)
            .count();
        prop_assert_eq!(s.overload_masks().weight(i), expect);
    }
    // A domain flagged busy has no idle leaf.
    for node in topo.nr_leaves()..topo.nodes().len() {
        if s.busy_flags().is_busy(node) {
            for &leaf in topo.span(node) {
                prop_assert!(
                    !s.rq(leaf).is_idle(),
                    "busy-flagged domain {} hides idle leaf {}",
                    node,
                    leaf
                );
            }
        }
    }
    // Aggregates are exact.
    let root = s.aggregate(topo.root());
    prop_assert_eq!(
        root.nr_running,
        demand.iter().map(|&d| d as u64).sum::<u64>()
    );
    let max_free = (0..n).map(|l| s.rq(l).fit_free()).max().unwrap_or(0);
    prop_assert_eq!(root.max_free, max_free);
    for align in sched::Align::ALL {
        let max_room = (0..n).map(|l| s.rq(l).room(align)).max().unwrap_or(0);
        prop_assert_eq!(
            root.max_room[align.index()],
            max_room,
            "max_room {:?}",
            align
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Overload masks, nr_running, capacities, busy flags and aggregates
    /// stay exact; every steal takes a waiting task it may move.
    #[test]
    fn masks_flags_and_steals_stay_exact(sc in scenario()) {
        let mut s = build(&sc);
        let nr_tasks = sc.tasks.len();
        let mut now = 0u64;
        for op in &sc.ops {
            let before: HashMap<TaskId, TaskState> =
                (0..nr_tasks).map(|i| (TaskId(i as u64), s.task(TaskId(i as u64)).unwrap().state)).collect();
            let steals_before = s.stats().steal;
            let events = apply(&mut s, op, &mut now, nr_tasks);
            let mut migrated = 0;
            for ev in events {
                if let SchedEvent::Migrated { task, from, to } = ev {
                    migrated += 1;
                    let t = s.task(task).unwrap();
                    prop_assert!(t.allowed(to), "stole {:?} against affinity", task);
                    // It was waiting (never running) on `from`.
                    prop_assert_eq!(before[&task], TaskState::Queued(from), "stole {:?} that was not waiting on {}", task, from);
                    prop_assert!(matches!(t.state, TaskState::Running(l) | TaskState::Queued(l) if l == to));
                }
            }
            prop_assert_eq!(s.stats().steal - steals_before, migrated as u64);
            check_invariants(&s, nr_tasks)?;
        }
    }

    /// select_idle_sibling finds room iff some leaf of the target's LLC has
    /// room, with or without busy flags; find_idlest finds room iff some
    /// leaf anywhere has it.
    #[test]
    fn busy_skip_never_misses_an_idle_leaf(sc in scenario(), probe_demand in 1..3u32, target in 0..64usize, align in 0..5usize) {
        let mut s = build(&sc);
        let nr_tasks = sc.tasks.len();
        let mut now = 0;
        for op in &sc.ops {
            apply(&mut s, op, &mut now, nr_tasks);
        }
        // Flag everything that can be flagged, so skips really happen.
        let n = s.topology().nr_leaves();
        for leaf in 0..n {
            s.tick(leaf, now);
        }
        check_invariants(&s, nr_tasks)?;
        let probe = TaskId(1_000);
        let mut spec = TaskSpec::new(probe);
        spec.demand = probe_demand;
        spec.align = sched::Align::ALL[align];
        s.add_task(spec).unwrap();
        let topo = s.topology().clone();
        let target = target % n;
        let llc_has_room = topo.llcs()[topo.llc_of(target)].members.iter().any(|&l| s.fits(probe, l));
        let got = s.select_idle_sibling(probe, target, target);
        prop_assert_eq!(s.fits(probe, got), llc_has_room, "select_idle_sibling from {} -> {}", target, got);
        let any_room = (0..n).any(|l| s.fits(probe, l));
        let got = s.find_idlest(probe);
        prop_assert_eq!(s.fits(probe, got), any_room, "find_idlest -> {}", got);
    }

    /// Below the threshold, pack picks the lowest-numbered core with room.
    #[test]
    fn pack_uses_lowest_core_with_room(sc in scenario(), probe_demand in 1..3u32, prev in 0..64usize) {
        let mut s = build(&sc);
        let nr_tasks = sc.tasks.len();
        let mut now = 0;
        for op in &sc.ops {
            apply(&mut s, op, &mut now, nr_tasks);
        }
        let mut config = s.config().clone();
        config.pack_threshold = PackThreshold::Fraction(1.0);
        s.set_config(config);
        let topo = s.topology().clone();
        let n = topo.nr_leaves();
        let probe = TaskId(1_000);
        let mut spec = TaskSpec::new(probe);
        spec.demand = probe_demand;
        spec.policy = Some(Policy::Pack);
        s.add_task(spec).unwrap();
        // Give it a previous leaf so the same-core preference is exercised.
        s.wake_up_on(probe, prev % n, now).unwrap();
        s.block(probe, now).unwrap();
        let active = s.pack_active(probe_demand);
        let got = s.select_task_rq(probe, None, false, now);
        if active && (0..n).any(|l| s.fits(probe, l)) {
            prop_assert!(s.fits(probe, got), "pack chose {} without room", got);
            let lower = (0..n).find(|&l| topo.core_of(l) < topo.core_of(got) && s.fits(probe, l));
            prop_assert!(lower.is_none(), "pack chose core {} while core {} has room", topo.core_of(got), topo.core_of(lower.unwrap_or(0)));
        }
    }

    /// Over a long run on one CPU, CPU time is proportional to weight within
    /// 5%, whatever the latency-nice values.
    #[test]
    fn cpu_time_proportional_to_weight(
        nices in proptest::collection::vec((-8..8i32, -20..20i32), 2..6),
    ) {
        let topo = Arc::new(Topology::from_spec("1s:1c:1t").unwrap());
        let mut s = Sched::new(topo, 1, SchedConfig::default());
        for (i, &(nice, latency_nice)) in nices.iter().enumerate() {
            let mut spec = TaskSpec::new(TaskId(i as u64));
            spec.nice = nice;
            spec.latency_nice = latency_nice;
            s.add_task(spec).unwrap();
            s.wake_up_on(TaskId(i as u64), 0, 0).unwrap();
        }
        let tick = 1_000_000u64;
        let mut now = 0;
        for _ in 0..20_000 {
            now += tick;
            s.tick(0, now);
        }
        let total_weight: u64 = (0..nices.len()).map(|i| s.task(TaskId(i as u64)).unwrap().weight).sum();
        let total_time: u64 = (0..nices.len()).map(|i| s.task(TaskId(i as u64)).unwrap().sum_exec_runtime).sum();
        for i in 0..nices.len() {
            let t = s.task(TaskId(i as u64)).unwrap();
            let expect = total_time as f64 * t.weight as f64 / total_weight as f64;
            let err = (t.sum_exec_runtime as f64 - expect).abs() / expect;
            prop_assert!(err < 0.05, "task {} nice {} lat {}: {} ns vs {} expected ({:.1}%)",
                i, t.nice, t.latency_nice, t.sum_exec_runtime, expect as u64, err * 100.0);
        }
    }
}

/// Latency-nice shortens wake-to-run time without changing the share: a
/// task that sleeps and wakes among CPU hogs is picked sooner with
/// latency-nice -20 than with 0.
#[test]
fn latency_nice_runs_wakee_sooner() {
    fn mean_wait(latency_nice: i32) -> f64 {
        let topo = Arc::new(Topology::from_spec("1s:1c:1t").unwrap());
        let config = SchedConfig {
            wakeup_granularity: 4_000_000,
            ..SchedConfig::default()
        };
        let mut s = Sched::new(topo, 1, config);
        for i in 0..3 {
            s.add_task(TaskSpec::new(TaskId(i))).unwrap();
            s.wake_up_on(TaskId(i), 0, 0).unwrap();
        }
        let mut spec = TaskSpec::new(TaskId(9));
        spec.latency_nice = latency_nice;
        s.add_task(spec).unwrap();
        let tick = 1_000_000;
        let mut now = 0;
        let mut waits = Vec::new();
        let mut woke_at = None;
        let mut run_left = 0;
        for step in 0..20_000u64 {
            now += tick;
            s.tick(0, now);
            let t = s.task(TaskId(9)).unwrap();
            match t.state {
                TaskState::Running(_) => {
                    if let Some(w) = woke_at.take() {
                        waits.push((now - w) as f64);
                        run_left = 1;
                    }
                    if run_left == 0 {
                        s.block(TaskId(9), now).unwrap();
                    } else {
                        run_left -= 1;
                    }
                }
                TaskState::Sleeping if step % 20 == 0 => {
                    s.wake_up_on(TaskId(9), 0, now).unwrap();
                    if s.task(TaskId(9)).unwrap().state == TaskState::Running(0) {
                        waits.push(0.0);
                        run_left = 1;
                    } else {
                        woke_at = Some(now);
                    }
                }
                _ => {}
            }
        }
        waits.iter().sum::<f64>() / waits.len().max(1) as f64
    }
    let base = mean_wait(0);
    let latency = mean_wait(-20);
    assert!(
        latency < base,
        "latency-nice -20 waits {latency} ns, nice 0 waits {base} ns"
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// find_aligned returns k idle, allowed leaves of one domain of the
    /// level, and finds them whenever some domain has k such leaves.
    #[test]
    fn aligned_allocation_matches_oracle(
        topo_idx in 0..5usize,
        busy_seed in any::<u64>(),
        allow_seed in proptest::option::of(any::<u64>()),
        k in 1..6usize,
        align_idx in 0..5usize,
        pack in any::<bool>(),
    ) {
        let topo = Arc::new(Topology::from_spec(TOPOLOGIES[topo_idx]).unwrap());
        let n = topo.nr_leaves();
        let mut s = Sched::new(topo.clone(), 1, SchedConfig::default());
        for l in 0..n {
            if (busy_seed >> (l % 64)) & 1 == 1 {
                let id = TaskId(l as u64);
                s.add_task(TaskSpec::new(id)).unwrap();
                s.wake_up_on(id, l, 0).unwrap();
            }
        }
        let allowed = allow_seed.map(|a| LeafSet::from_leaves(n, (0..n).filter(|l| (a >> (l % 64)) & 1 == 1)));
        let align = sched::Align::ALL[align_idx];
        let policy = if pack { Policy::Pack } else { Policy::Spread };
        let ok = |l: usize| s.rq(l).is_idle() && allowed.as_ref().is_none_or(|a| a.contains(l));
        let groups = sched::alloc::align_groups(&topo, align);
        let possible = groups.iter().any(|g| g.iter().filter(|&&l| ok(l)).count() >= k);
        match s.find_aligned(k, align, policy, allowed.as_ref()) {
            None => prop_assert!(!possible, "a domain had room for {}", k),
            Some(got) => {
                prop_assert_eq!(got.len(), k);
                let mut uniq = got.clone();
                uniq.sort_unstable();
                uniq.dedup();
                prop_assert_eq!(uniq.len(), k, "duplicate leaves");
                prop_assert!(got.iter().all(|&l| ok(l)), "a leaf is busy or not allowed");
                prop_assert!(groups.iter().any(|g| got.iter().all(|l| g.contains(l))), "leaves span domains");
            }
        }
        let f = s.free_summary();
        for align in sched::Align::ALL {
            let brute = sched::alloc::align_groups(&topo, align)
                .iter()
                .map(|g| g.iter().filter(|&&l| s.rq(l).is_idle()).count() as u32)
                .max()
                .unwrap_or(0);
            prop_assert_eq!(f.get(align), brute);
        }
    }
}
