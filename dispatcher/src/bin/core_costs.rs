//! `core_costs`: what the dispatcher's core thread spends on a large
//! cluster, and where the bytes of a node and of a pending job go.
//!
//! The cluster is built in this process as the core builds it (nodes
//! registered with loadgen's shapes, labels and LoadReports; jobs no node
//! can run submitted as arrays), under a counting global allocator, so
//! every figure is heap bytes the cluster holds (not RSS: the process's
//! connections are `loadgen`'s business). Times are the best of a few
//! runs, each against its baseline measured in the same run:
//!
//! - the web snapshot: built whole on the core (before) against the
//!   core's copy of it, the rest assembled off the core (after);
//! - the metrics sample of the tick;
//! - a LoadReport on the core (the old command path: the report applied
//!   to the cluster) against its stream's reader comparing it with the
//!   last one (the new path, off the core), and the core's per-tick
//!   liveness scan divided by the nodes.
//!
//! ```text
//! cargo run --release -p dispatcher --bin core_costs -- --nodes 10000 --pending 10000
//! cargo run -p dispatcher --bin core_costs -- --check     # small, verifies itself
//! ```

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use clap::Parser;
use dispatcher::beats::{Beats, Reporter};
use dispatcher::cluster::{Cluster, ClusterConfig, Effects};
use dispatcher::metrics::Metrics;
use dispatcher::web;
use proto::v1::{CpuLoad, JobSpec, NodeLoad, Register};
use sched::Topology;

/// Counts the heap bytes in use.
struct Counting;

static IN_USE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; the
// counter only observes sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        IN_USE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: as the caller's contract for `System`.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        IN_USE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: as the caller's contract for `System`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        IN_USE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: as the caller's contract for `System`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        IN_USE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        // SAFETY: as the caller's contract for `System`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn in_use() -> isize {
    IN_USE.load(Ordering::Relaxed)
}

/// Heap bytes `f`'s result holds (what it allocated and kept).
fn held<T>(f: impl FnOnce() -> T) -> (T, isize) {
    let before = in_use();
    let v = f();
    (v, in_use() - before)
}

#[derive(Parser, Debug)]
#[command(
    name = "core_costs",
    about = "The core's time per tick and the heap bytes per node and per pending job"
)]
struct Args {
    /// Nodes (loadgen's shapes cycled, 40 per rack over 4 zones).
    #[arg(long, default_value_t = 10_000)]
    nodes: usize,
    /// Pending jobs (a selector no node matches), as arrays of 1,000.
    #[arg(long, default_value_t = 10_000)]
    pending: usize,
    /// Timed runs per figure (the best is shown).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Small sizes, and exit 1 unless the figures are consistent.
    #[arg(long)]
    check: bool,
}

const SHAPES: [&str; 4] = ["2s:16c:2t", "1s:8c:2t", "2s:8c:2t", "1s:4c:2t"];

/// loadgen's LoadReport of an idle node: every CPU, its schedstat names.
fn idle_load(cpus: &[u32]) -> NodeLoad {
    NodeLoad {
        cpus: cpus
            .iter()
            .map(|&cpu| CpuLoad {
                cpu,
                busy: false,
                runnable: 0,
            })
            .collect(),
        avg_idle_ns: 500_000,
        schedstats: dispatch_telemetry::schedstat_fields(&sched::Schedstats::default())
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
        ..Default::default()
    }
}

fn register_msg(i: usize, topo: &proto::v1::Topology) -> Register {
    let rack = i / 40;
    let zone = rack % 4;
    Register {
        node: format!("lg-{i:05}"),
        labels: HashMap::from([
            (
                "topology.kubernetes.io/zone".to_string(),
                format!("z{zone}"),
            ),
            ("dispatch.io/rack".to_string(), format!("z{zone}-r{rack}")),
        ]),
        topology: Some(topo.clone()),
        memory_bytes: topo.cpus.len() as u64 * (4 << 30),
        version: "core_costs".into(),
        oversubscribe: 1,
        ..Default::default()
    }
}

/// The best of `runs` timings of `f`.
fn best(runs: usize, mut f: impl FnMut()) -> Duration {
    (0..runs.max(1))
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .min()
        .unwrap_or_default()
}

fn ms(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64() * 1e3)
}

fn us(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64() * 1e6)
}

fn main() -> Result<()> {
    let mut args = Args::parse();
    if args.check {
        args.nodes = args.nodes.min(400);
        args.pending = args.pending.min(2_000);
        args.runs = args.runs.min(2);
    }
    ensure!(args.nodes > 0, "--nodes: at least 1");
    let topos: Vec<proto::v1::Topology> = SHAPES
        .iter()
        .map(|s| {
            Topology::from_spec(s)
                .map(|t| engine_proto::topology(&t))
                .map_err(|e| anyhow::anyhow!("{s}: {e}"))
        })
        .collect::<Result<_>>()?;
    let mut fx = Effects::default();
    let (mut cluster, empty) = held(|| Cluster::new(ClusterConfig::default()));
    let base = in_use();

    // Nodes: registration (the registry and the node-level engine), then
    // one LoadReport each.
    let mut now = 1_000;
    for i in 0..args.nodes {
        cluster
            .register(register_msg(i, &topos[i % topos.len()]), now, &mut fx)
            .map_err(|s| anyhow::anyhow!("register: {s}"))?;
    }
    let registered = in_use();
    cluster.settle(now, &mut fx);
    fx = Effects::default();
    let settled = in_use();
    let loads: Vec<NodeLoad> = topos.iter().map(|t| idle_load(&t.cpus)).collect();
    for i in 0..args.nodes {
        let name = format!("lg-{i:05}");
        cluster.load_report(&name, loads[i % loads.len()].clone(), now, &mut fx);
    }
    fx = Effects::default();
    let reported = in_use();
    let n = args.nodes as f64;
    let per_node = (reported - base) as f64 / n;
    // One node's parts, measured on copies.
    let node = cluster
        .node("lg-00000")
        .map_err(|s| anyhow::anyhow!("{s}"))?;
    let (_t, topo_bytes) = held(|| node.topology.clone());
    let (_l, load_bytes) = held(|| node.load.clone());
    let (_b, labels_bytes) = held(|| node.labels.clone());
    let node_struct = std::mem::size_of::<dispatcher::cluster::NodeInfo>();

    // Pending jobs: unplaceable, as arrays of 1,000.
    let before_jobs = in_use();
    let mut left = args.pending;
    let mut k = 0;
    while left > 0 {
        let count = left.min(1_000);
        let spec = JobSpec {
            name: format!("lg-pending-{k}"),
            command: vec!["sleep".into(), "1".into()],
            group: "loadgen-pending".into(),
            node_selector: HashMap::from([("loadgen/unplaceable".to_string(), "true".into())]),
            array_count: count as u32,
            ..Default::default()
        };
        cluster
            .submit(vec![spec], false, now, &mut fx)
            .map_err(|s| anyhow::anyhow!("submit: {s}"))?;
        fx = Effects::default();
        left -= count;
        k += 1;
    }
    let per_job = (in_use() - before_jobs) as f64 / args.pending.max(1) as f64;
    let job = cluster
        .get_job(&format!("j-1.{}", 0))
        .or_else(|_| cluster.get_job("j-1"))
        .map_err(|s| anyhow::anyhow!("{s}"))?;
    let (_j, job_bytes) = held(|| job.clone());
    let job_proto = std::mem::size_of::<proto::v1::Job>();

    // The core's time on its tick: the web snapshot, before and after.
    let metrics = Arc::new(Metrics::new().context("metrics")?);
    now += 1_000;
    let counts = metrics.job_counts();
    let whole = best(args.runs, || {
        std::hint::black_box(web::build(&cluster, &counts, now));
    });
    let copy = best(args.runs, || {
        std::hint::black_box(web::capture(&cluster, counts.clone(), now));
    });
    let assembly = best(args.runs, || {
        let c = web::capture(&cluster, counts.clone(), now);
        std::hint::black_box(web::assemble(c));
    });
    let sample = best(args.runs, || metrics.sample(&cluster, now));
    let sample_copy = best(args.runs, || {
        std::hint::black_box(metrics.copy(&cluster, now));
    });

    // A LoadReport: the old path applied each to the cluster on the core;
    // the new one compares it on its stream's reader and queues nothing
    // when it is unchanged.
    let names: Vec<String> = (0..args.nodes).map(|i| format!("lg-{i:05}")).collect();
    let old_path = best(args.runs, || {
        for (i, name) in names.iter().enumerate() {
            cluster.load_report(name, loads[i % loads.len()].clone(), now, &mut fx);
        }
    }) / args.nodes as u32;
    let beats = Arc::new(Beats::default());
    let mut readers: Vec<Reporter> = names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let mut r = Reporter::new(beats.clone(), beats.beat(name.clone(), i as u64, now));
            r.report(loads[i % loads.len()].clone(), 0, now);
            r
        })
        .collect();
    let queued = beats.drain().len();
    let reports: Vec<NodeLoad> = (0..args.nodes)
        .map(|i| loads[i % loads.len()].clone())
        .collect();
    // Each run reports a clone of the same loads (a decoded message is a
    // fresh value); the clones are made outside the timing.
    let mut new_path = Duration::MAX;
    for _ in 0..args.runs.max(1) {
        let batch = reports.clone();
        let t = Instant::now();
        for (r, load) in readers.iter_mut().zip(batch) {
            r.report(load, 0, now + 1);
        }
        new_path = new_path.min(t.elapsed());
    }
    let new_path = new_path / args.nodes as u32;
    let requeued = beats.drain().len();

    let mut out = String::new();
    out.push_str(&format!(
        "core_costs: {} nodes (shapes {} cycled, 40 per rack, 4 zones), {} pending jobs \
         (arrays of 1,000, a selector no node matches); best of {} runs\n\n",
        args.nodes,
        SHAPES.join(", "),
        args.pending,
        args.runs
    ));
    out.push_str("| heap bytes (counting allocator) | total | per node / job |\n|---|---:|---:|\n");
    let row = |out: &mut String, what: &str, total: isize, per: f64| {
        out.push_str(&format!("| {what} | {total} | {per:.0} |\n"));
    };
    row(&mut out, "empty cluster", empty, 0.0);
    row(
        &mut out,
        "nodes registered (registry, labels, topology, CPU model)",
        registered - base,
        (registered - base) as f64 / n,
    );
    row(
        &mut out,
        "node-level engine built (settle)",
        settled - registered,
        (settled - registered) as f64 / n,
    );
    row(
        &mut out,
        "one LoadReport kept per node",
        reported - settled,
        (reported - settled) as f64 / n,
    );
    row(&mut out, "all of a node", reported - base, per_node);
    row(
        &mut out,
        "pending jobs",
        (per_job * args.pending as f64) as isize,
        per_job,
    );
    out.push_str("\n| one part, on a copy | heap bytes | inline bytes |\n|---|---:|---:|\n");
    out.push_str(&format!(
        "| a node's topology as reported (proto) | {topo_bytes} | |\n\
         | a node's last LoadReport | {load_bytes} | |\n\
         | a node's labels | {labels_bytes} | |\n\
         | NodeInfo | | {node_struct} |\n\
         | a pending job's Job record (proto, spec included) | {job_bytes} | {job_proto} |\n"
    ));
    out.push_str(&format!(
        "\n| core work | before (ms) | after (ms) | ratio |\n|---|---:|---:|---:|\n\
         | web snapshot on the core per publish: built whole / copied ({} off the core) | {} | {} | {:.3} |\n\
         | metrics sample per tick: taken whole / copied (the rest off the core) | {} | {} | {:.3} |\n",
        ms(assembly),
        ms(whole),
        ms(copy),
        copy.as_secs_f64() / whole.as_secs_f64().max(1e-12),
        ms(sample),
        ms(sample_copy),
        sample_copy.as_secs_f64() / sample.as_secs_f64().max(1e-12),
    ));
    out.push_str(&format!(
        "\n| a LoadReport that changes nothing | before: core (us) | after: stream reader, off the core (us) |\n|---|---:|---:|\n\
         | per report | {} | {} |\n\
         | beats queued for the core: first report / unchanged report | {queued} | {requeued} |\n",
        us(old_path),
        us(new_path),
    ));
    print!("{out}");
    if args.check {
        if per_node <= 0.0 || per_job <= 0.0 {
            bail!("no bytes counted: per node {per_node}, per job {per_job}");
        }
        if queued != args.nodes || requeued != 0 {
            bail!(
                "{queued} first reports queued (want {}), {requeued} unchanged",
                args.nodes
            );
        }
        // The snapshot assembled from the copy equals the one built whole.
        let a = web::build(&cluster, &counts, now);
        let b = web::assemble(web::capture(&cluster, counts.clone(), now));
        if a.cluster != b.cluster || a.racks != b.racks {
            bail!("the assembled snapshot differs from the one built whole");
        }
        if a.cluster.totals.nodes as usize != args.nodes {
            bail!("snapshot of {} nodes", a.cluster.totals.nodes);
        }
        println!("\ncheck: ok");
    }
    Ok(())
}
