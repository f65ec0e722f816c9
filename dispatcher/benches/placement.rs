//! Placement decisions per second in-process, at 1,000 / 10,000 / 100,000
//! nodes, against a least-loaded scan (Kubernetes' LeastAllocated: the node
//! with the most free CPUs that fits) measured in the same run.
//!
//! Both sides run the same steady-state loop on a cluster kept ~75% busy:
//! submit one job (1-8 CPUs), then finish one running job; or, in rounds
//! of a batch of K, one submission of K jobs (a SubmitJobs of K specs)
//! then K finishes. Ours forgets done jobs as the dispatcher does: on the
//! core's tick period (500 ms of the bench's clock, one round = 1 ms) it
//! runs the tick's retention step (`Cluster::retire_done`, the default
//! `Retention`: at most 100,000 done jobs kept), and it is measured only
//! after a warm-up past that cap, so the job table has the size and the
//! heap the reuse of a dispatcher that has run for a while. (Without it
//! every op kept its ~900 B of done job: the table was a young
//! dispatcher's, smaller than in steady state, the retention's work was
//! left out, and the heap grew without end, each new page a fault.)
//! "ours" is the
//! dispatcher's `Cluster::submit` (validation, job record, engine placement
//! on the node tree, CPU model, effects); the baseline only scans and
//! updates a free-CPU array, so the ratio flatters the baseline. One at a
//! time is ours' worst case: one job's way through a submit overflows the
//! CPU's instruction cache, where a submission of K jobs runs each of its
//! steps K times in a row (`scripts/bench/per-op.sh` counts the misses);
//! the table shows both.
//!
//! The two sides are measured in alternated slices ([`run_pair`]): each
//! row's ratio is the median of ten slices' ratios, each slice of ours
//! timed within milliseconds of one of the scan, so that the machine's
//! speed, which moves on a shared machine, cancels out of the ratio
//! (the range column shows how far the slices spread).
//!
//! `cargo bench -p dispatcher --bench placement` prints the table
//! (`-- --nodes 10000`: one size only, for profiling; `-- --batch K`: one
//! batch size only; `-- --ops N`: N measured ops per size, for steadier
//! wall-clock figures; `-- --tick-rounds N`: the retention every N
//! rounds, see [`TICK_ROUNDS`]). With `DISPATCH_HUGE_PAGES=1` in the
//! environment the heap is in transparent huge pages, as a dispatcher
//! run so ([`dispatcher::allocator::options`]). Under
//! `cargo test` (no `--bench` argument), or with `--check`, it runs the same
//! loops at a small size in check mode: after every step both sides verify
//! their results against an account the bench keeps itself (see
//! [`Check`]), and any disagreement panics.

use std::collections::HashMap;
use std::time::Instant;

use dispatcher::cluster::{Cluster, ClusterConfig, Effects, ToAgent};
use dispatcher::record::JobKey;
use proto::v1::{JobSpec, JobState, JobStatus, Register};
use sched::Topology;

/// SplitMix64: a tiny seeded generator, so runs are reproducible.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

fn machine(spec: &str) -> proto::v1::Topology {
    engine_proto::topology(
        &Topology::from_spec(spec).unwrap_or_else(|e| panic!("bad spec {spec}: {e}")),
    )
}

/// The `dispatcher` binary's allocator (see `src/bin/dispatcher.rs`), so
/// that ours is measured as it runs; the scan allocates nothing.
#[global_allocator]
static ALLOCATOR: dispatcher::allocator::Mimalloc = dispatcher::allocator::Mimalloc;

/// With the dispatcher's options (lazy commit, the purge delay), set
/// before the first allocation as the binary does.
#[used]
#[unsafe(link_section = ".init_array")]
static TUNE_ALLOCATOR: extern "C" fn() = dispatcher::allocator::tune;

const NODE_SPEC: &str = "2s:8c:2t";
const NODE_CPUS: u32 = 32;

/// The bench's clock: one round (one submission and its finishes) is 1 ms.
/// `TICK_ROUNDS` is the core's tick period on it (the dispatcher ticks
/// every heartbeat interval / 2, 500 ms by default); check mode ticks
/// more often, so that its short run forgets jobs many times. The
/// bench's `--tick-rounds N` sets it: a dispatcher at 50,000 jobs/s ends
/// ~25,000 jobs between two ticks, and its retention forgets as many at
/// once (`--tick-rounds 25000`).
const TICK_ROUNDS: usize = 500;
const CHECK_TICK_ROUNDS: usize = 25;

/// Done jobs kept in check mode (the bench uses the dispatcher's default).
const CHECK_MAX_DONE: usize = 100;

fn cluster(nodes: usize, max_done_jobs: usize) -> Cluster {
    let mut cfg = ClusterConfig::default();
    cfg.retention.max_done_jobs = max_done_jobs;
    let mut c = Cluster::new(cfg);
    let topo = machine(NODE_SPEC);
    let mut fx = Effects::default();
    let racks_per_zone = (nodes / 100 / 10).max(1);
    for i in 0..nodes {
        let rack = i / 100;
        let zone = rack / racks_per_zone;
        let mut labels = HashMap::new();
        labels.insert("topology.kubernetes.io/zone".into(), format!("z{zone}"));
        labels.insert("dispatch.io/rack".into(), format!("r{rack}"));
        c.register(
            Register {
                node: format!("n{i:06}"),
                labels,
                topology: Some(topo.clone()),
                ..Default::default()
            },
            0,
            &mut fx,
        )
        .unwrap_or_else(|e| panic!("register: {e}"));
    }
    c.settle(0, &mut fx);
    c
}

fn spec(cpus: u32) -> JobSpec {
    JobSpec {
        command: vec!["true".into()],
        cpus,
        ..Default::default()
    }
}

/// Check mode: the bench's own account of which job runs where, against
/// the cluster's answers. Every job the bench counts as running is
/// ASSIGNED on the node it was placed on, once; no node holds more CPUs
/// than it has; the cluster's CPU model of each node marks exactly as many
/// CPUs busy as the bench's account; and a job is left queued only when
/// no node has that many CPUs free by the account.
struct Check {
    on: bool,
    placed: u64,
    queued: u64,
    /// Jobs the bench ended that the cluster may still keep, by end time
    /// (the round's `now`) and then key, the retention's order.
    ended: Vec<(i64, JobKey, String)>,
    /// Jobs the retention forgot.
    forgotten: u64,
}

impl Check {
    fn used_by_node(running: &[(String, String, u32)]) -> HashMap<&str, u32> {
        let mut used: HashMap<&str, u32> = HashMap::new();
        for (_, node, cpus) in running {
            *used.entry(node.as_str()).or_default() += cpus;
        }
        used
    }

    /// A submit of `cpus` CPUs left its job queued (before it counts).
    fn queued(&mut self, c: &Cluster, running: &[(String, String, u32)], cpus: u32) {
        if !self.on {
            return;
        }
        self.queued += 1;
        let used = Self::used_by_node(running);
        for n in c.nodes() {
            let free = NODE_CPUS - used.get(n.name.as_str()).copied().unwrap_or(0);
            assert!(
                free < cpus,
                "a {cpus}-CPU job was queued while {} has {free} CPUs free",
                n.name
            );
        }
    }

    /// The bench ended `id` at `now` (its SUCCEEDED status was applied).
    fn ended(&mut self, id: &str, now: i64) {
        if self.on {
            let key = JobKey::parse(id).unwrap_or_else(|| panic!("job id {id}"));
            self.ended.push((now, key, id.to_owned()));
        }
    }

    /// After the retention step: the cluster keeps exactly the last
    /// `CHECK_MAX_DONE` jobs that ended, and forgot the older ones.
    fn retired(&mut self, c: &Cluster) {
        if !self.on {
            return;
        }
        self.ended.sort_unstable();
        let keep = self.ended.len().min(CHECK_MAX_DONE);
        let old = self.ended.len() - keep;
        for (i, (_, _, id)) in self.ended.iter().enumerate() {
            let kept = c.get_job(id).is_ok();
            assert_eq!(
                kept,
                i >= old,
                "done job {id} ({i} of {})",
                self.ended.len()
            );
        }
        self.forgotten += old as u64;
        self.ended.drain(..old);
    }

    fn verify(&mut self, c: &Cluster, running: &[(String, String, u32)]) {
        if !self.on {
            return;
        }
        let mut seen = std::collections::HashSet::new();
        for (id, node, _) in running {
            assert!(seen.insert(id.as_str()), "job {id} counted twice");
            let j = c.get_job(id).unwrap_or_else(|e| panic!("job {id}: {e}"));
            assert_eq!(j.state, JobState::Assigned as i32, "job {id}");
            assert_eq!(&j.node, node, "job {id}");
        }
        self.placed = self.placed.max(running.len() as u64);
        let used = Self::used_by_node(running);
        for n in c.nodes() {
            let ours = used.get(n.name.as_str()).copied().unwrap_or(0);
            assert!(ours <= NODE_CPUS, "{} holds {ours} CPUs", n.name);
            let busy = n.busy_cpus();
            assert_eq!(busy, ours, "{}: CPU model vs running jobs", n.name);
        }
    }
}

/// Empty the effects after each operation, the buffers kept, as in the
/// core, where one `Effects` collects a whole batch of messages; its
/// changed jobs' records are turned into store writes first, as the core
/// does at a batch's end (`Cluster::write_back`).
fn clear(c: &Cluster, fx: &mut Effects) {
    c.write_back(fx);
    fx.writes.clear();
    fx.events.clear();
    fx.to_agents.clear();
    fx.moves.clear();
}

/// The rounds of one [`steady_ours`] call: `count` rounds of `batch`
/// jobs from round `first` (the clock goes on from the warm-up into the
/// measured loop), forgetting done jobs every `tick` rounds.
#[derive(Clone, Copy)]
struct Rounds {
    first: usize,
    count: usize,
    batch: usize,
    tick: usize,
}

/// Ours, set up and warmed, measured a slice at a time ([`Ours::measure`]).
struct Ours {
    c: Cluster,
    rng: Rng,
    running: Vec<(String, String, u32)>,
    fx: Effects,
    /// The next round's number (the clock goes on from slice to slice).
    round: usize,
    batch: usize,
    tick: usize,
}

impl Ours {
    /// A cluster of `nodes` filled to ~75% and warmed past its retention
    /// cap; with the set-up's seconds (the warm-up included).
    fn new(
        nodes: usize,
        batch: usize,
        tick_rounds: Option<usize>,
        check: &mut Check,
    ) -> (Self, f64) {
        let t0 = Instant::now();
        let (max_done, tick) = if check.on {
            (CHECK_MAX_DONE, tick_rounds.unwrap_or(CHECK_TICK_ROUNDS))
        } else {
            (
                dispatcher::cluster::Retention::default().max_done_jobs,
                tick_rounds.unwrap_or(TICK_ROUNDS),
            )
        };
        let mut c = cluster(nodes, max_done);
        // A new cluster: its job ids start again.
        check.ended.clear();
        let mut rng = Rng(42);
        let target = (nodes as u64 * NODE_CPUS as u64) * 3 / 4;
        let mut used = 0u64;
        let mut running: Vec<(String, String, u32)> = Vec::new();
        // As the core runs with no watcher and no observer (loadgen's and
        // this bench's dispatcher): no events are recorded.
        let mut fx = Effects {
            drop_events: true,
            ..Effects::default()
        };
        // Fill to ~75%.
        while used < target {
            let cpus = 1 + rng.below(8) as u32;
            let jobs = c
                .submit(vec![spec(cpus)], false, 1, &mut fx)
                .unwrap_or_else(|e| panic!("{e}"));
            for j in jobs {
                if j.state == JobState::Assigned as i32 {
                    used += cpus as u64;
                    running.push((j.id(), j.node.to_string(), cpus));
                } else {
                    check.queued(&c, &running, cpus);
                }
            }
            clear(&c, &mut fx);
            check.verify(&c, &running);
        }
        // The warm-up: past the cap of done jobs by two ticks, so that the
        // measured loop forgets as many as it ends.
        let warm = Rounds {
            first: 0,
            count: (max_done + 2 * tick * batch).div_ceil(batch),
            batch,
            tick,
        };
        steady_ours(&mut c, &mut rng, &mut running, &mut fx, warm, check);
        let ours = Self {
            c,
            rng,
            running,
            fx,
            round: warm.count,
            batch,
            tick,
        };
        (ours, t0.elapsed().as_secs_f64())
    }

    /// Seconds to run `ops` more ops (a multiple of the batch).
    fn measure(&mut self, ops: usize, check: &mut Check) -> f64 {
        let rounds = Rounds {
            first: self.round,
            count: ops.div_ceil(self.batch),
            batch: self.batch,
            tick: self.tick,
        };
        self.round += rounds.count;
        let start = Instant::now();
        measured_ours(
            &mut self.c,
            &mut self.rng,
            &mut self.running,
            &mut self.fx,
            rounds,
            check,
        );
        start.elapsed().as_secs_f64()
    }
}

/// The measured rounds of ours: [`steady_ours`] apart from the warm-up's
/// call, so that `scripts/bench/per-op.sh` counts instructions inside
/// this one only (the warm-up runs the same loop past the retention cap,
/// 100,000 ops and more, and counted with it multiplied the figure per
/// op by six).
#[inline(never)]
fn measured_ours(
    c: &mut Cluster,
    rng: &mut Rng,
    running: &mut Vec<(String, String, u32)>,
    fx: &mut Effects,
    rounds: Rounds,
    check: &mut Check,
) {
    steady_ours(c, rng, running, fx, rounds, check);
}

/// Ours' loop: `rounds.count` rounds, each one submission of
/// `batch` jobs (a SubmitJobs of `batch` specs: validated, recorded, then
/// placed, each step for all of them), then `batch` random running jobs
/// finish, one status each (as the core applies an agent's statuses, one
/// after the other); every `rounds.tick` rounds the tick's retention
/// step forgets the done jobs beyond the cap. With `batch` 1 it
/// alternates one submit and one
/// finish, the worst case for the instruction cache: the path of one job
/// through a submit does not fit in it. Never inlined, so that a profile can count it alone
/// (`valgrind --tool=callgrind --toggle-collect='*steady_ours*'`), whatever
/// the compiler inlines inside it.
#[inline(never)]
fn steady_ours(
    c: &mut Cluster,
    rng: &mut Rng,
    running: &mut Vec<(String, String, u32)>,
    fx: &mut Effects,
    rounds: Rounds,
    check: &mut Check,
) {
    let batch = rounds.batch;
    let mut cpus_of = Vec::with_capacity(batch);
    for round in rounds.first..rounds.first + rounds.count {
        let now = 2 + round as i64;
        // The batch's jobs in one submission (a SubmitJobs of `batch`
        // specs).
        cpus_of.clear();
        cpus_of.extend((0..batch).map(|_| 1 + rng.below(8) as u32));
        let jobs = c
            .submit(cpus_of.iter().map(|&n| spec(n)).collect(), false, now, fx)
            .unwrap_or_else(|e| panic!("{e}"));
        for (j, &cpus) in jobs.iter().zip(&cpus_of) {
            if j.state == JobState::Assigned as i32 {
                running.push((j.id(), j.node.to_string(), cpus));
            } else {
                check.queued(c, running, cpus);
            }
        }
        // Found by the check mode: the submit's own Assign stayed in `fx`
        // and was counted again with the exit's below.
        clear(c, fx);
        check.verify(c, running);
        // The agents' statuses of the batch: as many jobs end.
        for _ in 0..batch {
            if running.is_empty() {
                break;
            }
            let k = rng.below(running.len() as u64) as usize;
            let (id, node, _) = running.swap_remove(k);
            check.ended(&id, now);
            c.job_status(
                &node,
                JobStatus {
                    job_id: id,
                    attempt: 1,
                    state: JobState::Succeeded as i32,
                    ..Default::default()
                },
                now,
                fx,
            );
            // Jobs the exit let start (queued ones, steals).
            for (_, msg) in fx.to_agents.drain(..) {
                // A plain job's Assign is its record (built into the
                // proto only when sent to an agent).
                let (id, cpus) = match msg {
                    ToAgent::Assign(job) => (job.id(), job.spec().map_or(1, |s| s.cpus)),
                    ToAgent::Msg(m) => match m.msg {
                        Some(proto::v1::dispatcher_message::Msg::Assign(a)) => {
                            (a.job_id, a.spec.map_or(1, |s| s.cpus))
                        }
                        _ => continue,
                    },
                };
                if let Ok(j) = c.get_job(&id) {
                    running.push((j.id, j.node, cpus));
                }
            }
            clear(c, fx);
            check.verify(c, running);
        }
        if (round + 1) % rounds.tick == 0 {
            // Its deletes are the tick's store writes.
            c.retire_done(now, fx);
            clear(c, fx);
            check.verify(c, running);
            check.retired(c);
        }
    }
}

/// Baseline: least-loaded scan over a free-CPU array, filled to ~75% and
/// measured a slice at a time ([`LeastLoaded::measure`]). In check mode
/// every CPU is accounted for after each step: free plus held by running
/// jobs is the cluster's capacity, and no node is over-full.
struct LeastLoaded {
    free: Vec<u32>,
    rng: Rng,
    running: Vec<(usize, u32)>,
    batch: usize,
}

impl LeastLoaded {
    fn new(nodes: usize, batch: usize) -> Self {
        let mut free = vec![NODE_CPUS; nodes];
        let mut rng = Rng(42);
        let target = (nodes as u64 * NODE_CPUS as u64) * 3 / 4;
        let mut used = 0u64;
        let mut running: Vec<(usize, u32)> = Vec::new();
        while used < target {
            let cpus = 1 + rng.below(8) as u32;
            if let Some(n) = place_least_loaded(&mut free, cpus) {
                used += cpus as u64;
                running.push((n, cpus));
            }
        }
        Self {
            free,
            rng,
            running,
            batch,
        }
    }

    /// Seconds to run `ops` more ops.
    fn measure(&mut self, ops: usize, check: bool) -> f64 {
        let start = Instant::now();
        steady_least_loaded(
            &mut self.free,
            &mut self.rng,
            &mut self.running,
            (ops, self.batch),
            check,
        );
        start.elapsed().as_secs_f64()
    }
}

/// Ours and the scan, `ops` each, in [`SLICES`] alternated slices (ours
/// first in even slices, the scan first in odd ones). Returns ours' and
/// the scan's decisions per second over all their slices, the median and
/// the range of the slices' ratios (ours / scan), and ours' set-up
/// seconds. A slice of each side runs within milliseconds of the other,
/// so a change of the machine's speed (these machines are shared: the
/// scan alone moved by 60% within a minute) moves both sides of a
/// slice's ratio; the two sides measured one after the other gave
/// ratios of 0.90 to 1.71 at 10,000 nodes in one afternoon.
fn run_pair(
    nodes: usize,
    ops: usize,
    batch: usize,
    tick_rounds: Option<usize>,
    check: &mut Check,
) -> Pair {
    let (mut ours, setup) = Ours::new(nodes, batch, tick_rounds, check);
    let mut base = LeastLoaded::new(nodes, batch);
    // The rounds spread evenly over the slices (the first ones a round
    // more when they do not divide), so that exactly `ops` are measured
    // (`scripts/bench/per-op.sh` divides by it).
    let rounds = ops.div_ceil(batch).max(1);
    let slices = SLICES.min(rounds);
    let (mut ours_s, mut base_s) = (0.0, 0.0);
    let mut ratios = Vec::with_capacity(slices);
    for slice in 0..slices {
        let n = (rounds / slices + usize::from(slice < rounds % slices)) * batch;
        let (o, b) = if slice % 2 == 0 {
            let o = ours.measure(n, check);
            (o, base.measure(n, check.on))
        } else {
            let b = base.measure(n, check.on);
            (ours.measure(n, check), b)
        };
        ours_s += o;
        base_s += b;
        // Rates' ratio: the scan's seconds over ours'.
        ratios.push(b / o);
    }
    ratios.sort_by(f64::total_cmp);
    let done = (rounds * batch) as f64;
    Pair {
        ours: done / ours_s,
        base: done / base_s,
        ratio: (ratios[(slices - 1) / 2] + ratios[slices / 2]) / 2.0,
        low: ratios[0],
        high: ratios[slices - 1],
        setup,
    }
}

/// The slices of [`run_pair`].
const SLICES: usize = 10;

/// One row of the table ([`run_pair`]).
struct Pair {
    ours: f64,
    base: f64,
    ratio: f64,
    low: f64,
    high: f64,
    setup: f64,
}

// The section of [`place_least_loaded`], aligned to 64 bytes: one
// build of the bench to the next, the scan's loop then sits at the same
// place in the instruction cache's lines. Left where the linker put it,
// its start moved with every change to the dispatcher's code (which
// shares the binary), and with it the loop's offset in a 64-byte line:
// the same scan ran 65-76k/s at 10,000 nodes in one build and 90-104k/s
// in the next, which differed only in the dispatcher, so a ratio
// compared across builds measured the layout, not the change.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
std::arch::global_asm!(
    ".pushsection .text.least_loaded_scan,\"ax\",@progbits",
    ".p2align 6",
    ".popsection",
);

/// The node with the most free CPUs that fits `cpus`, which it takes.
/// Never inlined, in its own aligned section (above).
#[inline(never)]
#[cfg_attr(
    all(target_arch = "x86_64", target_os = "linux"),
    unsafe(link_section = ".text.least_loaded_scan")
)]
fn place_least_loaded(free: &mut [u32], cpus: u32) -> Option<usize> {
    let mut best: Option<usize> = None;
    for (i, &f) in free.iter().enumerate() {
        if f >= cpus && best.is_none_or(|b| f > free[b]) {
            best = Some(i);
        }
    }
    if let Some(b) = best {
        free[b] -= cpus;
    }
    best
}

/// The baseline's measured loop, the same steps as [`steady_ours`]; never
/// inlined, for the same reason.
#[inline(never)]
fn steady_least_loaded(
    free: &mut [u32],
    rng: &mut Rng,
    running: &mut Vec<(usize, u32)>,
    (ops, batch): (usize, usize),
    check: bool,
) {
    for _ in 0..ops.div_ceil(batch) {
        for _ in 0..batch {
            let cpus = 1 + rng.below(8) as u32;
            match place_least_loaded(free, cpus) {
                Some(n) => running.push((n, cpus)),
                None if check => assert!(free.iter().all(|&f| f < cpus), "a fit was missed"),
                None => {}
            }
        }
        for _ in 0..batch {
            if running.is_empty() {
                break;
            }
            let k = rng.below(running.len() as u64) as usize;
            let (n, c) = running.swap_remove(k);
            free[n] += c;
        }
        if check {
            let mut held = vec![0u32; free.len()];
            for &(n, c) in running.iter() {
                held[n] += c;
            }
            for (n, (&f, &h)) in free.iter().zip(&held).enumerate() {
                assert_eq!(f + h, NODE_CPUS, "node {n}: free {f} + held {h}");
            }
        }
    }
}

fn main() {
    // `--bench` (cargo bench) measures; `--check`, or no `--bench` (cargo
    // test), runs the check mode.
    let args: Vec<String> = std::env::args().collect();
    let bench = args.iter().any(|a| a == "--bench") && !args.iter().any(|a| a == "--check");
    let sizes: &[(usize, usize)] = if bench {
        &[(1_000, 20_000), (10_000, 20_000), (100_000, 5_000)]
    } else {
        &[(200, 500)]
    };
    let arg = |name: &str| -> Option<usize> {
        let i = args.iter().position(|a| a == name)?;
        args.get(i + 1)?.parse().ok()
    };
    // `--nodes N`: only that size (for profiling one size).
    let only = arg("--nodes");
    // `--ops N`: N measured ops per size instead of the table's (longer
    // runs for steadier wall-clock figures on a noisy machine).
    let ops_override = arg("--ops");
    // `--tick-rounds N`: the retention runs every N rounds instead of
    // `TICK_ROUNDS` (see there).
    let tick_rounds = arg("--tick-rounds").map(|n| n.max(1));
    // `--batch K`: only that batch size. The table has one job at a time
    // and batches of 16 (see `steady_ours`).
    let batches = match arg("--batch") {
        Some(k) => vec![k.max(1)],
        None => vec![1, 16],
    };
    let mut check = Check {
        on: !bench,
        placed: 0,
        queued: 0,
        ended: Default::default(),
        forgotten: 0,
    };
    println!(
        "placement decisions per second (steady state ~75% busy, jobs of 1-8 CPUs, nodes {NODE_SPEC}; ours after a warm-up past its retention cap, counted in setup s; ours and the scan alternated in {SLICES} slices, ours/base the slices' median ratio, range their lowest and highest)"
    );
    // The scan's alignment (see its section) holds in the release
    // profile's one codegen unit; a build where it does not says so, as
    // its figures are then not comparable with other builds'.
    let scan_at = place_least_loaded as fn(&mut [u32], u32) -> Option<usize> as usize;
    if bench
        && cfg!(all(target_arch = "x86_64", target_os = "linux"))
        && !scan_at.is_multiple_of(64)
    {
        println!(
            "note: the scan's code is not 64-byte aligned in this build (at {scan_at:#x}): its speed, and the ratio, depend on where it landed"
        );
    }
    println!(
        "{:>8} {:>6} {:>14} {:>16} {:>12} {:>12} {:>10}",
        "nodes", "batch", "ours/s", "least-loaded/s", "ours/base", "range", "setup s"
    );
    for &(nodes, ops) in sizes.iter().filter(|s| only.is_none_or(|n| n == s.0)) {
        for &batch in &batches {
            let ops = ops_override.unwrap_or(ops).div_ceil(batch) * batch;
            let p = run_pair(nodes, ops, batch, tick_rounds, &mut check);
            let range = format!("{:.2}-{:.2}", p.low, p.high);
            println!(
                "{nodes:>8} {batch:>6} {:>14.0} {:>16.0} {:>12.2} {range:>12} {:>10.2}",
                p.ours, p.base, p.ratio, p.setup
            );
        }
    }
    if check.on {
        // The checks ran on a busy cluster, not an empty one.
        assert!(
            check.placed >= 500,
            "only {} jobs ran at once",
            check.placed
        );
        // The retention ran, and forgot jobs.
        assert!(check.forgotten > 0, "the retention forgot no job");
        println!(
            "check mode: every step verified ({} jobs running at most, {} left queued, {} done jobs forgotten)",
            check.placed, check.queued, check.forgotten
        );
    }
}
