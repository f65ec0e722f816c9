//! Cost of the engine's placement and stealing paths, at 20 to 100,000
//! leaves, against a brute-force least-loaded scan measured in the same run.
//!
//! Why: `select_task_rq` and `try_steal` are the engine's hot paths (every
//! wakeup, every leaf going idle), and the engine's claim is that they stay
//! local at cluster scale — an LLC scan, or a descent over exact aggregates
//! (O(depth x fanout)) — where a Kubernetes-style scheduler scores every
//! node. Absolute times on a shared machine are noisy, so every size also
//! measures the brute-force baseline and the closing numbers are ratios.
//!
//! Sizes (leaves): CPU machines `1s:10c:2t` (20), `2s:22c:2t` (88) and
//! `6s:16c:8t:linear` (POWER10, 768), capacity 1, `SchedConfig::default()`;
//! clusters `10z:10r:100n` (10,000) and `10z:100r:100n` (100,000),
//! capacity 64, `SchedConfig::cluster()`, task demands 1..=8.
//!
//! Loaded state, built deterministically from a seeded SplitMix64 at a
//! frozen clock (so no vruntime moves and the state is exactly repeatable):
//! ~75% of the capacity runs, 10% of the leaves (random ones) are
//! overloaded with 1-3 waiting tasks, the rest is idle or busy (machines)
//! or partly free (clusters); see [`make_plan`].
//! Every leaf ticks once so the busy flags are what the engine would have.
//!
//! Groups (parameter = number of leaves):
//!
//! * `select_task_rq/wake`: 256 sleeping tasks, each run on two random
//!   leaves earlier (so `prev` and `recent_used` are set), woken by a random
//!   running task: `record_wakee`, `wake_affine`, `select_idle_sibling`.
//!   Cycles through the 256 pairs; the call mutates only stats, wakee flips
//!   and `recent_used_leaf`, so it is repeatable in `b.iter`.
//! * `select_task_rq/new`: 64 never-run tasks, no waker: the `find_idlest`
//!   slow path.
//! * `least_loaded/scan`: the baseline, a Kubernetes LeastAllocated-style
//!   choice for the same 64 new tasks: filter the leaves with room for the
//!   demand, take the minimum `nr_running / capacity`, reading every leaf's
//!   run queue through the public API. `least_loaded/scan_packed` does the
//!   same over dense arrays copied once (the best case for a brute-force
//!   scan: what a scheduler with a compact node cache would pay).
//! * `try_steal/steal_restore`: one successful steal plus undoing it. A leaf
//!   with exactly one free unit (machines: an empty CPU; clusters: 63 of 64
//!   used) in an LLC with overloaded leaves. `Sched` is not `Clone` and any
//!   path that leaves a leaf idle runs the newidle steal, so one iteration
//!   is: `set_capacity(dst, C - 1)` (the stolen task, last started, is
//!   preempted back to dst's queue), `block` it (queued: no newidle pass),
//!   `wake_up_on` its source leaf, `set_capacity(dst, C)` whose `schedule`
//!   finds dst idle and calls `try_steal`, which steals again. Exactly one
//!   steal per iteration (checked), and the per-leaf state is the same
//!   after the measurement as before (checked).
//! * `try_steal/restore_local`: the control for `steal_restore`: the same
//!   four calls, but the task is woken on dst itself, so the final
//!   `schedule()` starts it and steals nothing. `steal_restore -
//!   restore_local` is the cost of one successful `try_steal`, search and
//!   migration (dequeue from the source, enqueue on dst) included.
//! * `try_steal/fail_search`: an idle leaf whose LLC has no overloaded leaf
//!   while other LLCs do: SMT siblings, then the LLC's overload mask, empty.
//!   (`1s:10c:2t` has a single LLC, so there it is a second engine with no
//!   overloaded leaf at all.) Read-only.
//! * `try_steal/gated`: the steal leaf with node-limit gating refusing
//!   (`NodeLimitScope::Global`, limit 0): the O(1) early exit.
//!
//! * `idle_balance/steady_pass`: after the steal groups, backfill and idle
//!   balance are switched on (newidle stealing off, so that the pass does
//!   the pulling), one pass moves what it can (printed), and the
//!   measured pass finds nothing more to move (checked): the cost of the
//!   call on a tick or finish when no room can be used.
//!
//! With `SchedConfig::default()` the POWER10 shape (6 NUMA nodes > limit 2)
//! never steals at all; its `steal_restore` and `fail_search` raise the
//! node limit to 6 so that the search itself is measured.
//!
//! `cargo test --benches` runs each routine once; setup at 100,000 leaves
//! (~1.2 million tasks) is linear and takes a few seconds.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use sched::{LeafId, NodeLimitScope, Sched, SchedConfig, TaskId, TaskSpec, TaskState, Topology};

/// The frozen clock of the loaded state (ns).
const NOW: u64 = 1_000_000_000;
/// Sleeping tasks with a waker, cycled through by `select_task_rq/wake`.
const NR_WAKEES: usize = 256;
/// New tasks, cycled through by `select_task_rq/new` and the baselines.
const NR_NEW: usize = 64;

/// One benchmarked shape.
struct Size {
    spec: &'static str,
    capacity: u32,
    max_demand: u32,
    cluster: bool,
}

const SIZES: [Size; 5] = [
    Size {
        spec: "1s:10c:2t",
        capacity: 1,
        max_demand: 1,
        cluster: false,
    },
    Size {
        spec: "2s:22c:2t",
        capacity: 1,
        max_demand: 1,
        cluster: false,
    },
    Size {
        spec: "6s:16c:8t:linear",
        capacity: 1,
        max_demand: 1,
        cluster: false,
    },
    Size {
        spec: "10z:10r:100n",
        capacity: 64,
        max_demand: 8,
        cluster: true,
    },
    Size {
        spec: "10z:100r:100n",
        capacity: 64,
        max_demand: 8,
        cluster: true,
    },
];

impl Size {
    fn config(&self) -> SchedConfig {
        if self.cluster {
            SchedConfig::cluster()
        } else {
            SchedConfig::default()
        }
    }
}

/// SplitMix64: tiny, seeded, good enough for layouts.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n`.
    fn below(&mut self, n: usize) -> usize {
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: u32, hi: u32) -> u32 {
        lo + self.below((hi - lo + 1) as usize) as u32
    }
}

/// Demands of tasks filling exactly `target` units.
fn fill(rng: &mut Rng, target: u32, max_demand: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let mut used = 0;
    while used < target {
        let d = rng.range(1, max_demand).min(target - used);
        out.push(d);
        used += d;
    }
    out
}

/// Per leaf: demands of the running tasks (they fit) and of the waiting ones.
struct Plan {
    running: Vec<Vec<u32>>,
    waiting: Vec<Vec<u32>>,
}

/// What a leaf gets in the plan.
#[derive(Clone, Copy)]
enum Kind {
    /// Machines: empty; clusters: 0-50% used.
    Light,
    /// Machines: one running task; clusters: 75-100% used.
    Busy,
    /// Full, plus 1-3 waiting tasks.
    Overloaded,
}

/// Exact shares of leaf kinds (machines: 25% idle, 65% busy, 10%
/// overloaded = 75% of the CPUs busy; clusters: 20% light, 70% busy, 10%
/// overloaded = ~76% of the capacity running), on randomly chosen leaves.
fn make_plan(topo: &Topology, size: &Size, rng: &mut Rng) -> Plan {
    let n = topo.nr_leaves();
    let c = size.capacity;
    let light = if size.cluster { 0.20 } else { 0.25 };
    let mut kinds: Vec<Kind> = (0..n)
        .map(|i| {
            let x = i as f64 / n as f64;
            if x < light {
                Kind::Light
            } else if x < 0.90 {
                Kind::Busy
            } else {
                Kind::Overloaded
            }
        })
        .collect();
    for i in (1..n).rev() {
        kinds.swap(i, rng.below(i + 1));
    }
    let mut plan = Plan {
        running: Vec::with_capacity(n),
        waiting: Vec::with_capacity(n),
    };
    for kind in kinds {
        let (target, nr_wait) = match (kind, size.cluster) {
            (Kind::Light, false) => (0, 0),
            (Kind::Busy, false) => (1, 0),
            (Kind::Light, true) => (rng.below(c as usize / 2 + 1) as u32, 0),
            (Kind::Busy, true) => (c * 3 / 4 + rng.below(c as usize / 4 + 1) as u32, 0),
            (Kind::Overloaded, _) => (c, 1 + rng.below(3)),
        };
        plan.running.push(fill(rng, target, size.max_demand));
        plan.waiting.push(
            (0..nr_wait)
                .map(|_| rng.range(1, size.max_demand))
                .collect(),
        );
    }
    plan
}

/// An engine in the loaded state, and what the benchmarks need of it.
struct Fixture {
    s: Sched,
    /// (wakee, waker) pairs.
    wake_pairs: Vec<(TaskId, TaskId)>,
    /// New tasks and their demands.
    new_tasks: Vec<(TaskId, u32)>,
    /// The leaf each waiting task was queued on, by task id.
    home: Vec<LeafId>,
    /// A leaf with one free unit in an LLC with a stealable task.
    steal_dst: Option<LeafId>,
    /// An idle leaf in an LLC without overloaded leaves.
    fail_dst: Option<LeafId>,
    nr_tasks: usize,
}

/// Builds the loaded state. `quiet_llc`: an LLC left without overloaded
/// leaves (for `fail_search`); `with_steal`: pick a steal leaf.
fn build(size: &Size, quiet_llc: Option<usize>, with_steal: bool) -> Fixture {
    let topo = Arc::new(Topology::from_spec(size.spec).expect("valid spec"));
    let n = topo.nr_leaves();
    let c = size.capacity;
    let mut rng = Rng(0x5eed_0000 ^ n as u64);
    let mut plan = make_plan(&topo, size, &mut rng);

    if let Some(q) = quiet_llc {
        for &l in &topo.llcs()[q].members {
            plan.waiting[l].clear();
        }
    }
    // The steal leaf: in the first LLC holding a waiting demand-1 task, a
    // random leaf with nothing waiting, left with exactly one free unit.
    let steal_dst = if with_steal {
        let llc = (0..topo.llcs().len())
            .filter(|&i| Some(i) != quiet_llc)
            .find(|&i| {
                topo.llcs()[i]
                    .members
                    .iter()
                    .any(|&l| plan.waiting[l].contains(&1))
            })
            .expect("an LLC with a stealable task");
        let free: Vec<LeafId> = topo.llcs()[llc]
            .members
            .iter()
            .copied()
            .filter(|&l| plan.waiting[l].is_empty())
            .collect();
        let dst = free[rng.below(free.len())];
        plan.running[dst] = fill(&mut rng, c - 1, size.max_demand);
        Some(dst)
    } else {
        None
    };
    let fail_dst = quiet_llc.map(|q| {
        let members = &topo.llcs()[q].members;
        let dst = members[rng.below(members.len())];
        plan.running[dst] = fill(&mut rng, c - 1, size.max_demand);
        dst
    });

    let mut s = Sched::new(topo.clone(), c, size.config());
    let mut next_id = 0u64;
    let mut new_task = |s: &mut Sched, demand: u32| {
        let id = TaskId(next_id);
        next_id += 1;
        let mut spec = TaskSpec::new(id);
        spec.demand = demand;
        s.add_task(spec).expect("valid task");
        id
    };

    // Phase 0: the wakees run briefly on two random leaves, then sleep
    // (before anything else is placed, so their leaves go back to idle
    // with nothing to steal). The clock advances here so that avg_idle
    // stays realistic; everything after happens at NOW.
    let mut wakees = Vec::with_capacity(NR_WAKEES);
    let mut t = 0;
    for _ in 0..NR_WAKEES {
        let id = new_task(&mut s, rng.range(1, size.max_demand));
        for _ in 0..2 {
            t += 1_000_000;
            s.wake_up_on(id, rng.below(n), t).expect("wake");
            s.block(id, t).expect("block");
        }
        wakees.push(id);
    }
    assert!(t < NOW);

    // Phase 1: the running tasks (they fit, so nothing queues and no leaf
    // is overloaded yet: the newidle passes of partly filled leaves find
    // nothing to steal).
    let mut running = Vec::new();
    for (leaf, demands) in plan.running.iter().enumerate() {
        for &d in demands {
            let id = new_task(&mut s, d);
            s.wake_up_on(id, leaf, NOW).expect("wake");
            running.push(id);
        }
    }
    // Phase 2: the waiting tasks, on full leaves.
    let mut home = Vec::new();
    for (leaf, demands) in plan.waiting.iter().enumerate() {
        for &d in demands {
            let id = new_task(&mut s, d);
            s.wake_up_on(id, leaf, NOW).expect("wake");
            home.resize(id.0 as usize + 1, usize::MAX);
            home[id.0 as usize] = leaf;
        }
    }
    let new_tasks: Vec<(TaskId, u32)> = (0..NR_NEW)
        .map(|_| {
            let d = rng.range(1, size.max_demand);
            (new_task(&mut s, d), d)
        })
        .collect();
    for leaf in 0..n {
        s.tick(leaf, NOW);
    }
    s.clear_events();

    // The state is the plan: no steal or preemption moved anything.
    for leaf in 0..n {
        let rq = s.rq(leaf);
        let run: u32 = plan.running[leaf].iter().sum();
        let wait: u32 = plan.waiting[leaf].iter().sum();
        assert_eq!(rq.running_demand, run, "leaf {leaf} running demand");
        assert_eq!(rq.nr_running, run + wait, "leaf {leaf} runnable demand");
    }
    let wake_pairs = wakees
        .iter()
        .map(|&p| (p, running[rng.below(running.len())]))
        .collect::<Vec<_>>();
    for &(_, w) in &wake_pairs {
        assert!(matches!(
            s.task(w).map(|t| t.state),
            Some(TaskState::Running(_))
        ));
    }
    Fixture {
        nr_tasks: s.nr_tasks(),
        s,
        wake_pairs,
        new_tasks,
        home,
        steal_dst,
        fail_dst,
    }
}

/// The running best of a least-loaded scan: `(leaf, nr_running, capacity)`,
/// starting above any real ratio (`2^32 / 1`); ratios are compared by cross
/// multiplication, which cannot overflow for `u32` inputs.
type Best = (LeafId, u64, u64);
const NO_BEST: Best = (usize::MAX, 1 << 32, 1);

/// The Kubernetes LeastAllocated-style choice by brute force: among the
/// leaves with room for `demand`, the least `nr_running / capacity` (over
/// all leaves when none has room).
fn least_loaded_scan(s: &Sched, demand: u32) -> LeafId {
    let (mut fit, mut any) = (NO_BEST, NO_BEST);
    for leaf in 0..s.topology().nr_leaves() {
        let rq = s.rq(leaf);
        let (nr, cap) = (rq.nr_running as u64, rq.capacity.max(1) as u64);
        if nr * any.2 < any.1 * cap {
            any = better(leaf, nr, cap);
        }
        if nr * fit.2 < fit.1 * cap && rq.fit_free() >= demand {
            fit = better(leaf, nr, cap);
        }
    }
    pick(fit, any)
}

/// A new best: rare after the first few leaves, so kept out of line to make
/// the comparison a predicted branch rather than a dependency chain of
/// conditional moves.
#[cold]
#[inline(never)]
fn better(leaf: LeafId, nr: u64, cap: u64) -> Best {
    (leaf, nr, cap)
}

fn pick(fit: Best, any: Best) -> LeafId {
    if fit.0 != usize::MAX {
        fit.0
    } else if any.0 != usize::MAX {
        any.0
    } else {
        0
    }
}

/// The same scan over dense per-leaf arrays.
struct Packed {
    nr_running: Vec<u32>,
    capacity: Vec<u32>,
    fit_free: Vec<u32>,
}

impl Packed {
    fn of(s: &Sched) -> Self {
        let n = s.topology().nr_leaves();
        Self {
            nr_running: (0..n).map(|l| s.rq(l).nr_running).collect(),
            capacity: (0..n).map(|l| s.rq(l).capacity.max(1)).collect(),
            fit_free: (0..n).map(|l| s.rq(l).fit_free()).collect(),
        }
    }

    fn least_loaded(&self, demand: u32) -> LeafId {
        let (mut fit, mut any) = (NO_BEST, NO_BEST);
        let n = self.nr_running.len();
        let (caps, frees) = (&self.capacity[..n], &self.fit_free[..n]);
        for leaf in 0..n {
            let (nr, cap) = (self.nr_running[leaf] as u64, caps[leaf] as u64);
            if nr * any.2 < any.1 * cap {
                any = better(leaf, nr, cap);
            }
            if nr * fit.2 < fit.1 * cap && frees[leaf] >= demand {
                fit = better(leaf, nr, cap);
            }
        }
        pick(fit, any)
    }
}

/// What must not change across `steal_restore`: per-leaf runnable and
/// running demand and queue length.
fn fingerprint(s: &Sched) -> Vec<(u32, u32, usize)> {
    (0..s.topology().nr_leaves())
        .map(|l| {
            let rq = s.rq(l);
            (rq.nr_running, rq.running_demand, rq.nr_waiting())
        })
        .collect()
}

/// Config with stealing allowed by the node limit (POWER10: 6 nodes).
fn open_config(s: &Sched, base: &SchedConfig) -> SchedConfig {
    SchedConfig {
        steal_node_limit: base.steal_node_limit.max(s.topology().nr_numa()),
        ..base.clone()
    }
}

/// Config whose node-limit gating refuses every steal.
fn gated_config(base: &SchedConfig) -> SchedConfig {
    SchedConfig {
        node_limit_scope: NodeLimitScope::Global,
        steal_node_limit: 0,
        ..base.clone()
    }
}

fn bench_size(c: &mut Criterion, size: &Size) {
    let t0 = Instant::now();
    let nr_llcs = Topology::from_spec(size.spec)
        .expect("valid spec")
        .llcs()
        .len();
    let quiet = (nr_llcs > 1).then_some(nr_llcs - 1);
    let mut fx = build(size, quiet, true);
    // A single-LLC machine cannot have a quiet LLC next to a loaded one.
    let mut fail_fx = quiet.is_none().then(|| build(size, Some(0), false));
    let n = fx.s.topology().nr_leaves();
    let (mut used, mut total, mut over) = (0u64, 0u64, 0usize);
    for l in 0..n {
        let rq = fx.s.rq(l);
        used += rq.running_demand as u64;
        total += rq.capacity as u64;
        over += rq.is_overloaded() as usize;
    }
    eprintln!(
        "engine bench {}: {n} leaves, {} tasks, {:.1}% of capacity running, \
         {over} leaves overloaded, setup {:.2?}",
        size.spec,
        fx.nr_tasks,
        100.0 * used as f64 / total as f64,
        t0.elapsed()
    );
    let base = size.config();
    let big = n >= 100_000;

    // ----- placement -----
    let mut g = c.benchmark_group("select_task_rq");
    if big {
        g.sample_size(20);
    }
    let s = &mut fx.s;
    let pairs = &fx.wake_pairs;
    let st0 = *s.stats();
    let mut i = 0;
    g.bench_function(BenchmarkId::new("wake", n), |b| {
        b.iter(|| {
            let (p, w) = pairs[i % pairs.len()];
            i += 1;
            black_box(s.select_task_rq(black_box(p), Some(w), false, NOW))
        })
    });
    // Which select_idle_sibling outcomes the wake path measured.
    let st = *s.stats();
    let calls = (i as f64).max(1.0);
    eprintln!(
        "  wake paths at {n}: easy {:.0}%, idle core {:.0}%, idle leaf {:.0}%, \
         none {:.0}% (busy-skip {:.0}%), {:.1} leaves scanned per call",
        100.0 * (st.sis_easy - st0.sis_easy) as f64 / calls,
        100.0 * (st.sis_core - st0.sis_core) as f64 / calls,
        100.0 * (st.sis_cpu - st0.sis_cpu) as f64 / calls,
        100.0 * (st.sis_none - st0.sis_none) as f64 / calls,
        100.0 * (st.busy_skip - st0.busy_skip) as f64 / calls,
        (st.sis_scanned - st0.sis_scanned) as f64 / calls,
    );
    let news = &fx.new_tasks;
    let mut i = 0;
    g.bench_function(BenchmarkId::new("new", n), |b| {
        b.iter(|| {
            let (p, _) = news[i % news.len()];
            i += 1;
            black_box(s.select_task_rq(black_box(p), None, false, NOW))
        })
    });
    g.finish();

    let mut g = c.benchmark_group("least_loaded");
    if big {
        g.sample_size(20);
    }
    let mut i = 0;
    g.bench_function(BenchmarkId::new("scan", n), |b| {
        b.iter(|| {
            let (_, d) = news[i % news.len()];
            i += 1;
            black_box(least_loaded_scan(s, black_box(d)))
        })
    });
    let packed = Packed::of(s);
    let mut i = 0;
    g.bench_function(BenchmarkId::new("scan_packed", n), |b| {
        b.iter(|| {
            let (_, d) = news[i % news.len()];
            i += 1;
            black_box(packed.least_loaded(black_box(d)))
        })
    });
    g.finish();

    // ----- stealing -----
    let mut g = c.benchmark_group("try_steal");
    if big {
        g.sample_size(20);
    }
    {
        let (fs, dst) = match fail_fx.as_mut() {
            Some(f) => (&mut f.s, f.fail_dst),
            None => (&mut *s, fx.fail_dst),
        };
        let dst = dst.expect("a fail leaf");
        fs.set_config(open_config(fs, &base));
        let topo = fs.topology().clone();
        assert!(fs.rq(dst).is_idle());
        assert_eq!(fs.overload_masks().weight(topo.llc_of(dst)), 0);
        assert_eq!(fs.try_steal(dst, NOW), None);
        g.bench_function(BenchmarkId::new("fail_search", n), |b| {
            b.iter(|| black_box(fs.try_steal(black_box(dst), NOW)))
        });
        fs.set_config(base.clone());
    }

    let dst = fx.steal_dst.expect("a steal leaf");
    assert!(s.rq(dst).is_idle());
    s.set_config(gated_config(&base));
    assert_eq!(s.try_steal(dst, NOW), None);
    g.bench_function(BenchmarkId::new("gated", n), |b| {
        b.iter(|| black_box(s.try_steal(black_box(dst), NOW)))
    });

    s.set_config(open_config(s, &base));
    let cap = size.capacity;
    let p = s.try_steal(dst, NOW).expect("the steal leaf steals");
    // try_steal only queues the task on dst; schedule() starts it.
    s.schedule(dst, NOW);
    assert_eq!(s.rq(dst).running.last(), Some(&p), "stolen task runs last");
    assert_eq!(s.rq(dst).free(), 0);
    s.clear_events();
    let before = fingerprint(s);
    let steals_before = s.stats().steal;
    let scanned_before = s.stats().steal_scanned;
    let home = &fx.home;
    let mut iters = 0u64;
    g.bench_function(BenchmarkId::new("steal_restore", n), |b| {
        b.iter(|| {
            iters += 1;
            let p = *s.rq(dst).running.last().expect("a stolen task");
            s.set_capacity(dst, cap - 1, NOW).expect("leaf");
            s.block(p, NOW).expect("task");
            s.wake_up_on(p, home[p.0 as usize], NOW).expect("home leaf");
            // Idle again: schedule() runs the newidle try_steal.
            s.set_capacity(dst, cap, NOW).expect("leaf");
            s.clear_events();
        })
    });
    assert_eq!(
        s.stats().steal - steals_before,
        iters,
        "one steal per steal_restore iteration"
    );
    eprintln!(
        "  steal at {n}: {:.1} overloaded leaves examined per steal",
        (s.stats().steal_scanned - scanned_before) as f64 / iters.max(1) as f64
    );
    assert!(fingerprint(s) == before, "steal_restore changed the state");

    // The control: the same four calls, but the task goes back to dst
    // itself, so the last schedule() starts it and nothing is stolen.
    let steals_before = s.stats().steal;
    g.bench_function(BenchmarkId::new("restore_local", n), |b| {
        b.iter(|| {
            let p = *s.rq(dst).running.last().expect("a running task");
            s.set_capacity(dst, cap - 1, NOW).expect("leaf");
            s.block(p, NOW).expect("task");
            s.wake_up_on(p, dst, NOW).expect("dst");
            s.set_capacity(dst, cap, NOW).expect("leaf");
            s.clear_events();
        })
    });
    assert_eq!(s.stats().steal, steals_before, "restore_local steals");
    assert!(fingerprint(s) == before, "restore_local changed the state");
    s.set_config(base.clone());
    g.finish();

    // ----- idle balance (last: it changes the loaded state) -----
    let mut g = c.benchmark_group("idle_balance");
    if big {
        g.sample_size(10);
    }
    // Newidle stealing off, so that turning backfill on (every leaf is
    // rescheduled) leaves the pulling to the pass.
    s.set_config(SchedConfig {
        backfill: true,
        idle_balance: true,
        steal: false,
        ..open_config(s, &base)
    });
    let t = Instant::now();
    let moved = s.idle_balance(NOW);
    eprintln!(
        "  idle_balance at {n}: first pass moved {moved} tasks in {:.2?}",
        t.elapsed()
    );
    assert_eq!(s.idle_balance(NOW), 0, "a second pass finds nothing");
    // The steady state: a pass that finds nothing to move, what the
    // dispatcher pays on a tick or finish when no room can be used.
    g.bench_function(BenchmarkId::new("steady_pass", n), |b| {
        b.iter(|| black_box(s.idle_balance(NOW)))
    });
    g.finish();
}

fn engine(c: &mut Criterion) {
    for size in &SIZES {
        bench_size(c, size);
    }
    deep_queue(c);
}

/// One rack of nodes of 8 units (`SchedConfig::cluster()`, EASY backfill
/// on) for the `schedule/deep_queue` groups, and the tasks added to it,
/// all at `NOW`.
struct DeepQueue {
    s: Sched,
    next_id: u64,
}

/// The time limit of a task that has one: a minute.
const DEEP_LIMIT: Option<u64> = Some(60_000_000_000);

type Fifo = std::collections::VecDeque<TaskId>;

impl DeepQueue {
    fn new(nodes: usize) -> Self {
        let topo = Arc::new(Topology::from_spec(&format!("1z:1r:{nodes}n")).expect("valid spec"));
        let config = SchedConfig {
            backfill: true,
            ..SchedConfig::cluster()
        };
        Self {
            s: Sched::new(topo, 8, config),
            next_id: 0,
        }
    }

    /// A new task of `demand` units, with `limit`, woken on `leaf`.
    fn add(&mut self, leaf: LeafId, demand: u32, limit: Option<u64>) -> TaskId {
        let id = TaskId(self.next_id);
        self.next_id += 1;
        let mut spec = TaskSpec::new(id);
        spec.demand = demand;
        spec.time_limit = limit;
        self.s.add_task(spec).expect("valid task");
        self.s.wake_up_on(id, leaf, NOW).expect("a leaf");
        id
    }

    fn running_on(&self, tasks: &Fifo, leaf: LeafId) -> bool {
        tasks
            .iter()
            .all(|&id| self.s.task_state(id) == Some(TaskState::Running(leaf)))
    }

    /// One iteration: end the oldest of `running`, then submit a one-unit
    /// task with a limit to node 0 (it becomes the newest of `running`
    /// when it starts at once).
    fn finish_submit(&mut self, running: &mut Fifo) {
        let done = running.pop_front().expect("a running task");
        black_box(self.s.remove_task(done, NOW).expect("known task"));
        running.push_back(self.add(0, 1, DEEP_LIMIT));
    }
}

/// `schedule/deep_queue`, what a dispatcher node with a deep queue pays
/// per finish; none of it should grow with the depth (backfill and the
/// steal once walked the whole queue on every finish). One iteration ends
/// the oldest running task of node 0 and submits a one-unit task with a
/// limit there. The benches check that each iteration did what it says.
///
/// - `finish_start`: one node, 8 one-unit tasks running and `depth`
///   waiting, all with a limit: the finish starts the head, the new task
///   queues at the tail.
/// - `blocked_head`: one node, 7 running behind an 8-unit head (it waits
///   for every running task), `depth` one-unit tasks without a limit
///   behind it (EASY can start none of them): the new task is
///   backfilled past the whole queue.
/// - `blocked_thief`: that node (with no queue behind its head) beside a
///   full node holding the `depth` tasks without a limit; the first tries
///   to steal on every finish and may take none of them.
fn deep_queue(c: &mut Criterion) {
    let mut g = c.benchmark_group("schedule/deep_queue");
    for depth in [10usize, 1_000, 10_000] {
        let mut q = DeepQueue::new(1);
        let mut order: Fifo = (0..8 + depth).map(|_| q.add(0, 1, DEEP_LIMIT)).collect();
        let fifo = |q: &DeepQueue, order: &Fifo| {
            order.iter().enumerate().all(|(i, &id)| {
                matches!(
                    (i < 8, q.s.task_state(id)),
                    (true, Some(TaskState::Running(0))) | (false, Some(TaskState::Queued(0)))
                )
            })
        };
        assert!(fifo(&q, &order), "8 running, the rest waiting, in order");
        g.bench_function(BenchmarkId::new("finish_start", depth), |b| {
            b.iter(|| q.finish_submit(&mut order))
        });
        // Each iteration started the head: still 8 running, oldest first.
        assert!(fifo(&q, &order), "the queue kept its order and depth");
        assert_eq!(q.s.rq(0).nr_waiting(), depth);
    }
    for depth in [10usize, 1_000, 10_000] {
        let mut q = DeepQueue::new(1);
        let mut running: Fifo = (0..7).map(|_| q.add(0, 1, DEEP_LIMIT)).collect();
        let head = q.add(0, 8, DEEP_LIMIT);
        for _ in 0..depth {
            q.add(0, 1, None);
        }
        let steady = |q: &DeepQueue, running: &Fifo| {
            q.s.rq(0).nr_waiting() == depth + 1
                && q.s.task_state(head) == Some(TaskState::Queued(0))
                && q.running_on(running, 0)
        };
        assert!(
            steady(&q, &running),
            "7 running, the head and the rest waiting"
        );
        g.bench_function(BenchmarkId::new("blocked_head", depth), |b| {
            b.iter(|| q.finish_submit(&mut running))
        });
        assert!(steady(&q, &running), "every new task was backfilled");
    }
    for depth in [10usize, 1_000, 10_000] {
        let mut q = DeepQueue::new(2);
        let mut running: Fifo = (0..7).map(|_| q.add(0, 1, DEEP_LIMIT)).collect();
        let head = q.add(0, 8, DEEP_LIMIT);
        for _ in 0..8 {
            q.add(1, 1, DEEP_LIMIT);
        }
        for _ in 0..depth {
            q.add(1, 1, None);
        }
        let steady = |q: &DeepQueue, running: &Fifo| {
            q.s.rq(0).nr_waiting() == 1
                && q.s.rq(1).nr_waiting() == depth
                && q.s.task_state(head) == Some(TaskState::Queued(0))
                && q.running_on(running, 0)
        };
        assert!(
            steady(&q, &running),
            "node 0: 7 running and its head; node 1's queue"
        );
        let steals = q.s.stats().steal;
        g.bench_function(BenchmarkId::new("blocked_thief", depth), |b| {
            b.iter(|| q.finish_submit(&mut running))
        });
        assert!(
            steady(&q, &running),
            "every new task was backfilled on node 0"
        );
        assert_eq!(q.s.stats().steal, steals, "node 0 stole nothing");
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(2));
    targets = engine
}
criterion_main!(benches);
