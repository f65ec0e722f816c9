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
//!
//! The oracles never ask the engine what they check: domain membership
//! comes from the topology spec's own arithmetic ([`SpecDomains`]), a
//! leaf's room from the tasks' states and the capacities and free
//! summaries the test itself set ([`Model`]). Each property counts the
//! cases that really exercised it (a steal happened, a search had to skip,
//! pack was active, ...) and fails when too few did: a generator that
//! drifts into trivial cases cannot pass silently.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use proptest::prelude::*;
use proptest::test_runner::TestRunner;
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

/// The domains of a topology spec, computed from the spec alone (its
/// documented numbering: x86-style `cpu % (sockets * cores)` is the core;
/// cluster leaves numbered zone by zone, rack by rack), never from
/// [`Topology`]. A key per leaf and level: equal keys, same domain; keys
/// increase with the domain's lowest leaf.
struct SpecDomains {
    n: usize,
    keys: [Vec<usize>; 5],
}

impl SpecDomains {
    fn new(spec: &str) -> Self {
        let mut count: HashMap<char, usize> = HashMap::new();
        let mut llc = None;
        for part in spec.split(':') {
            if let Some(v) = part.strip_prefix("llc=") {
                llc = Some(v.parse::<usize>().unwrap());
            } else {
                let (num, unit) = part.split_at(part.len() - 1);
                count.insert(unit.chars().next().unwrap(), num.parse().unwrap());
            }
        }
        let c = |u: char| count.get(&u).copied();
        let (n, keys): (usize, [Vec<usize>; 5]) = if let Some(sockets) = c('s') {
            let (cores, threads) = (c('c').unwrap(), c('t').unwrap_or(1));
            let ncores = sockets * cores;
            let n = ncores * threads;
            let core = |l: usize| l % ncores;
            let socket = |l: usize| core(l) / cores;
            let llc_of = |l: usize| match llc {
                Some(k) => socket(l) * cores.div_ceil(k) + (core(l) % cores) / k,
                None => socket(l),
            };
            let all = |f: &dyn Fn(usize) -> usize| (0..n).map(f).collect::<Vec<_>>();
            (
                n,
                [
                    all(&core),
                    all(&llc_of),
                    all(&socket),
                    all(&socket),
                    vec![0; n],
                ],
            )
        } else {
            let (zones, racks, nodes) = (c('z').unwrap(), c('r').unwrap(), c('n').unwrap());
            let n = zones * racks * nodes;
            let rack = |l: usize| l / nodes;
            // Without host groups every node is its own "core".
            let group = |l: usize| match c('h') {
                Some(h) => rack(l) * nodes.div_ceil(h) + (l % nodes) / h,
                None => l,
            };
            let all = |f: &dyn Fn(usize) -> usize| (0..n).map(f).collect::<Vec<_>>();
            (
                n,
                [
                    all(&group),
                    all(&rack),
                    all(&|l| l / (nodes * racks)),
                    // No package level: one package, the whole cluster.
                    vec![0; n],
                    vec![0; n],
                ],
            )
        };
        SpecDomains { n, keys }
    }

    fn key(&self, align: sched::Align, leaf: usize) -> usize {
        self.keys[align.index()][leaf]
    }

    /// The domains of a level, each its leaves in increasing order.
    fn groups(&self, align: sched::Align) -> Vec<Vec<usize>> {
        let mut by_key: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for l in 0..self.n {
            by_key.entry(self.key(align, l)).or_default().push(l);
        }
        by_key.into_values().collect()
    }

    /// The most leaves satisfying `ok` inside one domain of the level.
    fn best(&self, align: sched::Align, ok: impl Fn(usize) -> bool) -> u32 {
        self.groups(align)
            .iter()
            .map(|g| g.iter().filter(|&&l| ok(l)).count() as u32)
            .max()
            .unwrap_or(0)
    }
}

/// What the test itself set on each leaf: its capacity and its free
/// summary (normalized as documented: each level capped by every wider
/// one), to judge a leaf's room without the engine's own fit. One value is
/// read back: after a report the engine lowers a leaf's summary by the
/// demand of each task it starts there ("conservative until the caller
/// reports the real room again", also on a preempted task picked again at
/// once, which leaves no event), so the model takes the engine's current
/// summary after checking it never shows more room than was reported.
struct Model {
    capacity: Vec<u32>,
    free: Vec<Option<[u32; 5]>>,
}

impl Model {
    fn new(sc: &Scenario, n: usize) -> Self {
        Model {
            capacity: sc.capacities[..n].to_vec(),
            free: vec![None; n],
        }
    }

    fn record(&mut self, op: &Op) {
        let n = self.capacity.len();
        match *op {
            Op::SetCapacity { leaf, capacity } => self.capacity[leaf % n] = capacity,
            Op::SetFree { leaf, free } => {
                self.free[leaf % n] = free.map(|mut f| {
                    for i in (0..4).rev() {
                        f[i] = f[i].min(f[i + 1]);
                    }
                    f
                })
            }
            _ => {}
        }
    }

    /// Room on `leaf` for a new task of `demand` and `align` with no
    /// affinity, from the tasks' states: nothing waits there, the running
    /// demand leaves `demand` of the capacity, and the leaf's free
    /// summary (if the test set one) has `demand` at that level.
    fn fits(
        &self,
        s: &Sched,
        nr_tasks: usize,
        leaf: usize,
        demand: u32,
        align: sched::Align,
    ) -> bool {
        let mut running = 0;
        for i in 0..nr_tasks {
            let t = s.task(TaskId(i as u64)).unwrap();
            match t.state {
                TaskState::Queued(l) if l == leaf => return false,
                TaskState::Running(l) if l == leaf => running += t.demand,
                _ => {}
            }
        }
        let free = match (self.free[leaf], s.rq(leaf).align_free()) {
            (None, None) => None,
            (Some(reported), Some(now)) => {
                for a in sched::Align::ALL {
                    assert!(
                        now.get(a) <= reported[a.index()],
                        "leaf {leaf}: {a:?} room {} above the reported {}",
                        now.get(a),
                        reported[a.index()]
                    );
                }
                Some(now.get(align))
            }
            (reported, now) => panic!("leaf {leaf}: reported {reported:?}, engine has {now:?}"),
        };
        running + demand <= self.capacity[leaf] && free.is_none_or(|f| f >= demand)
    }
}

/// How often each kind of case occurred in one property's run.
#[derive(Default)]
struct Tally(RefCell<BTreeMap<&'static str, u32>>);

impl Tally {
    fn count(&self, what: &'static str) {
        *self.0.borrow_mut().entry(what).or_default() += 1;
    }

    fn get(&self, what: &str) -> u32 {
        self.0.borrow().get(what).copied().unwrap_or(0)
    }
}

/// Run a property over `cases` generated cases, then require each listed
/// kind of case to have occurred at least `min` times.
fn check_property<S: Strategy>(
    name: &str,
    cases: u32,
    strategy: S,
    at_least: &[(&str, u32)],
    test: impl Fn(S::Value, &Tally) -> Result<(), TestCaseError>,
) {
    let tally = Tally::default();
    let mut runner = TestRunner::new(ProptestConfig {
        cases,
        ..ProptestConfig::default()
    });
    if let Err(e) = runner.run(&strategy, |v| test(v, &tally)) {
        panic!("{name}: {e}");
    }
    eprintln!("{name}: {cases} cases, {:?}", tally.0.borrow());
    for &(what, min) in at_least {
        assert!(
            tally.get(what) >= min,
            "{name}: only {} of {cases} cases were {what:?} (want >= {min}): the generator no longer exercises the property",
            tally.get(what)
        );
    }
}

#[test]
fn spec_domains_agree_with_the_engines_topology() {
    // The oracle and the engine read the same spec independently; where
    // they disagree one of them is wrong, and the properties would test
    // nothing meaningful.
    for spec in TOPOLOGIES {
        let topo = Topology::from_spec(spec).unwrap();
        let d = SpecDomains::new(spec);
        assert_eq!(d.n, topo.nr_leaves(), "{spec}");
        for align in sched::Align::ALL {
            let mut engine: Vec<Vec<usize>> = sched::alloc::align_groups(&topo, align)
                .iter()
                .map(|g| {
                    let mut g = g.to_vec();
                    g.sort_unstable();
                    g
                })
                .collect();
            engine.sort();
            assert_eq!(engine, d.groups(align), "{spec} {align:?}");
        }
    }
}

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

/// The invariants that must hold between any two operations; true when
/// some leaf was overloaded (the masks had something to show).
fn check_invariants(s: &Sched, nr_tasks: usize) -> Result<bool, TestCaseError> {
    let topo = s.topology().clone();
    let n = topo.nr_leaves();
    let mut any_overloaded = false;
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
        any_overloaded |= overloaded;
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
    // Every node's aggregate, not only the root's, against its leaves
    // (they are kept by difference when a child changes; a leaf's in its
    // own 32-byte form).
    for node in 0..topo.nodes().len() {
        let a = s.aggregate(node);
        let span = topo.span(node);
        let sum = |f: &dyn Fn(usize) -> u64| span.iter().map(|&l| f(l)).sum::<u64>();
        prop_assert_eq!(
            a.capacity,
            sum(&|l| s.rq(l).capacity as u64),
            "capacity of {}",
            node
        );
        prop_assert_eq!(
            a.nr_running,
            sum(&|l| demand[l] as u64),
            "nr_running of {}",
            node
        );
        prop_assert_eq!(
            a.sum_free,
            sum(&|l| s.rq(l).fit_free() as u64),
            "sum_free of {}",
            node
        );
        let max = |f: &dyn Fn(usize) -> u32| span.iter().map(|&l| f(l)).max().unwrap_or(0);
        prop_assert_eq!(
            a.max_free,
            max(&|l| s.rq(l).fit_free()),
            "max_free of {}",
            node
        );
        for align in sched::Align::ALL {
            prop_assert_eq!(
                a.max_room[align.index()],
                max(&|l| s.rq(l).room(align)),
                "max_room {:?} of {}",
                align,
                node
            );
        }
    }
    Ok(any_overloaded)
}

/// Overload masks, nr_running, capacities, busy flags and aggregates
/// stay exact; every steal takes a waiting task it may move.
#[test]
fn masks_flags_and_steals_stay_exact() {
    check_property(
        "masks_flags_and_steals_stay_exact",
        256,
        scenario(),
        &[("stole", 40), ("overloaded", 60)],
        |sc, tally| {
            let mut s = build(&sc);
            let nr_tasks = sc.tasks.len();
            let mut now = 0u64;
            let (mut stole, mut overloaded) = (false, false);
            for op in &sc.ops {
                let before: HashMap<TaskId, TaskState> = (0..nr_tasks)
                    .map(|i| (TaskId(i as u64), s.task(TaskId(i as u64)).unwrap().state))
                    .collect();
                let steals_before = s.stats().steal;
                let events = apply(&mut s, op, &mut now, nr_tasks);
                let mut migrated = 0;
                for ev in events {
                    if let SchedEvent::Migrated { task, from, to } = ev {
                        migrated += 1;
                        let t = s.task(task).unwrap();
                        prop_assert!(t.allowed(to), "stole {:?} against affinity", task);
                        // It was waiting (never running) on `from`.
                        prop_assert_eq!(
                            before[&task],
                            TaskState::Queued(from),
                            "stole {:?} that was not waiting on {}",
                            task,
                            from
                        );
                        prop_assert!(
                            matches!(t.state, TaskState::Running(l) | TaskState::Queued(l) if l == to)
                        );
                    }
                }
                stole |= migrated > 0;
                prop_assert_eq!(s.stats().steal - steals_before, migrated as u64);
                overloaded |= check_invariants(&s, nr_tasks)?;
            }
            if stole {
                tally.count("stole");
            }
            if overloaded {
                tally.count("overloaded");
            }
            Ok(())
        },
    );
}

/// select_idle_sibling finds room iff some leaf of the target's LLC has
/// room, with or without busy flags; find_idlest finds room iff some leaf
/// anywhere has it. Room and LLCs come from the model and the spec.
#[test]
fn busy_skip_never_misses_an_idle_leaf() {
    check_property(
        "busy_skip_never_misses_an_idle_leaf",
        256,
        (scenario(), 1..3u32, 0..64usize, 0..5usize),
        &[
            ("llc with room", 50),
            ("llc without room", 30),
            ("llc without room, room elsewhere", 8),
            ("busy flags set", 50),
        ],
        |(sc, probe_demand, target, align), tally| {
            let mut s = build(&sc);
            let nr_tasks = sc.tasks.len();
            let n = s.topology().nr_leaves();
            let mut model = Model::new(&sc, n);
            let mut now = 0;
            for op in &sc.ops {
                apply(&mut s, op, &mut now, nr_tasks);
                model.record(op);
            }
            // Flag everything that can be flagged, so skips really happen.
            for leaf in 0..n {
                s.tick(leaf, now);
            }
            check_invariants(&s, nr_tasks)?;
            let topo = s.topology().clone();
            if (n..topo.nodes().len()).any(|d| s.busy_flags().is_busy(d)) {
                tally.count("busy flags set");
            }
            let domains = SpecDomains::new(TOPOLOGIES[sc.topo]);
            let align = sched::Align::ALL[align];
            let probe = TaskId(1_000);
            let mut spec = TaskSpec::new(probe);
            spec.demand = probe_demand;
            spec.align = align;
            s.add_task(spec).unwrap();
            let room: Vec<bool> = (0..n)
                .map(|l| model.fits(&s, nr_tasks, l, probe_demand, align))
                .collect();
            let fits = |l: usize| room[l];
            let target = target % n;
            let llc = domains.key(sched::Align::Llc, target);
            let llc_has_room = (0..n).any(|l| domains.key(sched::Align::Llc, l) == llc && fits(l));
            let any_room = (0..n).any(fits);
            tally.count(match (llc_has_room, any_room) {
                (true, _) => "llc with room",
                (false, true) => "llc without room, room elsewhere",
                (false, false) => "no room anywhere",
            });
            if !llc_has_room {
                tally.count("llc without room");
            }
            let got = s.select_idle_sibling(probe, target, target);
            prop_assert_eq!(
                fits(got),
                llc_has_room,
                "select_idle_sibling from {} -> {}",
                target,
                got
            );
            if llc_has_room {
                prop_assert_eq!(
                    domains.key(sched::Align::Llc, got),
                    llc,
                    "left the LLC of {}",
                    target
                );
            }
            let got = s.find_idlest(probe);
            prop_assert_eq!(fits(got), any_room, "find_idlest -> {}", got);
            Ok(())
        },
    );
}

/// Below the threshold, pack picks the lowest-numbered core with room
/// (cores and room from the spec and the model); whether pack is active
/// at all is checked against the runnable demand and capacity the test
/// knows.
#[test]
fn pack_uses_lowest_core_with_room() {
    check_property(
        "pack_uses_lowest_core_with_room",
        256,
        (scenario(), 1..3u32, 0..64usize),
        &[("active with room", 60), ("inactive", 20)],
        |(sc, probe_demand, prev), tally| {
            let mut s = build(&sc);
            let nr_tasks = sc.tasks.len();
            let n = s.topology().nr_leaves();
            let mut model = Model::new(&sc, n);
            let mut now = 0;
            for op in &sc.ops {
                apply(&mut s, op, &mut now, nr_tasks);
                model.record(op);
            }
            let mut config = s.config().clone();
            config.pack_threshold = PackThreshold::Fraction(1.0);
            s.set_config(config);
            let domains = SpecDomains::new(TOPOLOGIES[sc.topo]);
            let probe = TaskId(1_000);
            let mut spec = TaskSpec::new(probe);
            spec.demand = probe_demand;
            spec.policy = Some(Policy::Pack);
            s.add_task(spec).unwrap();
            // Give it a previous leaf so the same-core preference is exercised.
            s.wake_up_on(probe, prev % n, now).unwrap();
            s.block(probe, now).unwrap();
            // Fraction(1.0): active while the runnable demand, the probe's
            // included, stays within the total capacity.
            let runnable: u32 = (0..nr_tasks)
                .map(|i| s.task(TaskId(i as u64)).unwrap())
                .filter(|t| t.state != TaskState::Sleeping)
                .map(|t| t.demand)
                .sum();
            let capacity: u32 = model.capacity.iter().sum();
            let active = runnable + probe_demand <= capacity;
            prop_assert_eq!(
                s.pack_active(probe_demand),
                active,
                "runnable {} capacity {}",
                runnable,
                capacity
            );
            let room: Vec<bool> = (0..n)
                .map(|l| model.fits(&s, nr_tasks, l, probe_demand, sched::Align::Any))
                .collect();
            let fits = |l: usize| room[l];
            // The engine's own fit agrees with the model on every leaf.
            for (l, &r) in room.iter().enumerate() {
                prop_assert_eq!(r, s.fits(probe, l), "fit of leaf {}", l);
            }
            let got = s.select_task_rq(probe, None, false, now);
            prop_assert!(got < n);
            if !active {
                tally.count("inactive");
                return Ok(());
            }
            if !(0..n).any(fits) {
                tally.count("active without room");
                return Ok(());
            }
            tally.count("active with room");
            prop_assert!(fits(got), "pack chose {} without room", got);
            let core = |l: usize| domains.key(sched::Align::Core, l);
            let lower = (0..n).find(|&l| core(l) < core(got) && fits(l));
            prop_assert!(
                lower.is_none(),
                "pack chose leaf {} while leaf {} of a lower core has room",
                got,
                lower.unwrap_or(0)
            );
            Ok(())
        },
    );
}

/// Over a long run on one CPU, CPU time is proportional to weight within
/// 5%, whatever the latency-nice values.
#[test]
fn cpu_time_proportional_to_weight() {
    check_property(
        "cpu_time_proportional_to_weight",
        256,
        proptest::collection::vec((-8..8i32, -20..20i32), 2..6),
        &[("unequal weights", 200), ("unequal latency-nice", 200)],
        |nices, tally| {
            let topo = Arc::new(Topology::from_spec("1s:1c:1t").unwrap());
            let mut s = Sched::new(topo, 1, SchedConfig::default());
            for (i, &(nice, latency_nice)) in nices.iter().enumerate() {
                let mut spec = TaskSpec::new(TaskId(i as u64));
                spec.nice = nice;
                spec.latency_nice = latency_nice;
                s.add_task(spec).unwrap();
                s.wake_up_on(TaskId(i as u64), 0, 0).unwrap();
            }
            if nices.iter().any(|n| n.0 != nices[0].0) {
                tally.count("unequal weights");
            }
            if nices.iter().any(|n| n.1 != nices[0].1) {
                tally.count("unequal latency-nice");
            }
            let tick = 1_000_000u64;
            let mut now = 0;
            for _ in 0..20_000 {
                now += tick;
                s.tick(0, now);
            }
            let total_weight: u64 = (0..nices.len())
                .map(|i| s.task(TaskId(i as u64)).unwrap().weight)
                .sum();
            let total_time: u64 = (0..nices.len())
                .map(|i| s.task(TaskId(i as u64)).unwrap().sum_exec_runtime)
                .sum();
            for i in 0..nices.len() {
                let t = s.task(TaskId(i as u64)).unwrap();
                let expect = total_time as f64 * t.weight as f64 / total_weight as f64;
                let err = (t.sum_exec_runtime as f64 - expect).abs() / expect;
                prop_assert!(
                    err < 0.05,
                    "task {} nice {} lat {}: {} ns vs {} expected ({:.1}%)",
                    i,
                    t.nice,
                    t.latency_nice,
                    t.sum_exec_runtime,
                    expect as u64,
                    err * 100.0
                );
            }
            Ok(())
        },
    );
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

/// find_aligned returns k idle, allowed leaves of one domain of the
/// level, and finds them whenever some domain has k such leaves (domains
/// from the spec); the free summary is, per level, the most idle leaves in
/// one domain.
#[test]
fn aligned_allocation_matches_oracle() {
    check_property(
        "aligned_allocation_matches_oracle",
        256,
        (
            0..5usize,
            any::<u64>(),
            proptest::option::of(any::<u64>()),
            1..6usize,
            0..5usize,
            any::<bool>(),
        ),
        &[("found", 30), ("no room", 50)],
        |(topo_idx, busy_seed, allow_seed, k, align_idx, pack), tally| {
            let topo = Arc::new(Topology::from_spec(TOPOLOGIES[topo_idx]).unwrap());
            let domains = SpecDomains::new(TOPOLOGIES[topo_idx]);
            let n = topo.nr_leaves();
            let mut s = Sched::new(topo.clone(), 1, SchedConfig::default());
            let busy = |l: usize| (busy_seed >> (l % 64)) & 1 == 1;
            for l in (0..n).filter(|&l| busy(l)) {
                let id = TaskId(l as u64);
                s.add_task(TaskSpec::new(id)).unwrap();
                s.wake_up_on(id, l, 0).unwrap();
            }
            let allowed_by_seed = |l: usize| allow_seed.is_none_or(|a| (a >> (l % 64)) & 1 == 1);
            let allowed =
                allow_seed.map(|_| LeafSet::from_leaves(n, (0..n).filter(|&l| allowed_by_seed(l))));
            let align = sched::Align::ALL[align_idx];
            let policy = if pack { Policy::Pack } else { Policy::Spread };
            // Capacity 1 everywhere: a leaf is idle iff the test put no task on it.
            let ok = |l: usize| !busy(l) && allowed_by_seed(l);
            let possible = domains.best(align, ok) as usize >= k;
            match s.find_aligned(k, align, policy, allowed.as_ref()) {
                None => {
                    tally.count("no room");
                    prop_assert!(!possible, "a domain had room for {}", k)
                }
                Some(got) => {
                    tally.count("found");
                    prop_assert_eq!(got.len(), k);
                    let mut uniq = got.clone();
                    uniq.sort_unstable();
                    uniq.dedup();
                    prop_assert_eq!(uniq.len(), k, "duplicate leaves");
                    prop_assert!(got.iter().all(|&l| ok(l)), "a leaf is busy or not allowed");
                    let key = domains.key(align, got[0]);
                    prop_assert!(
                        got.iter().all(|&l| domains.key(align, l) == key),
                        "leaves span domains"
                    );
                }
            }
            let f = s.free_summary();
            for align in sched::Align::ALL {
                prop_assert_eq!(
                    f.get(align),
                    domains.best(align, |l| !busy(l)),
                    "{:?}",
                    align
                );
            }
            Ok(())
        },
    );
}
