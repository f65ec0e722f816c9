//! `loadgen`: load on a real dispatcher from N fake agents and a stream of
//! clients, and what it costs the dispatcher.
//!
//! One pass: start a dispatcher (or use `--server`), attach N fake agents
//! (real gRPC `AgentService.Attach` streams, see [`agents`]) with synthetic
//! topologies spread over zones and racks, let them heartbeat through a
//! quiet window, then run an open-loop submission stream at R jobs/s with
//! a read stream beside it ([`streams`]) while the agents run the jobs on
//! timers; wait until every job has finished. Before the agents attach,
//! M jobs no node can run are submitted and cancelled (memory per pending
//! job on a fresh dispatcher). The dispatcher's RSS and CPU time are read from /proc at each
//! step ([`procstat`]), every call's latency goes into an HDR histogram
//! ([`latency`]), and the report ([`report`]) gives p50/p99/p99.9/max per
//! call, submit -> Assign, bytes per node and per pending job.
//!
//! `--baseline` runs a second pass on a fresh dispatcher with the same
//! agents and streams but no heartbeats (the dispatcher is told to wait
//! for them practically forever), so the cost of heartbeats shows as
//! ratios.
//!
//! ```text
//! cargo run --release -p e2e --bin loadgen -- --agents 1000 --rate 200 --duration-s 30 --baseline
//! ```

mod agents;
mod latency;
mod report;
mod streams;

/// The dispatcher's allocator: the generator shares the machine's CPUs
/// with the dispatcher it measures, and under glibc's malloc a quarter of
/// its own time went to allocation (every job's Assign decoded and its
/// status encoded), CPU taken from the dispatcher.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Parser, ValueEnum};
use e2e::{Dispatcher, procstat};
use proto::v1::job_service_client::JobServiceClient;
use proto::v1::node_service_client::NodeServiceClient;
use proto::v1::{JobState, ListJobsRequest};
use tokio::sync::{Semaphore, watch};
use tonic::transport::Channel;

use crate::agents::{Connection, Fleet, NodePlan, Shape};
use crate::latency::{Kind, Latencies};
use crate::report::{JobsReport, MemoryReport, PassReport, Report, per_item};
use crate::streams::{Clients, LoadPlan};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Format {
    /// Markdown tables.
    Table,
    Json,
    Csv,
}

#[derive(Parser, Debug)]
#[command(
    name = "loadgen",
    about = "Load a dispatcher with fake agents and client streams; report latencies and its memory"
)]
struct Args {
    /// Use this dispatcher instead of starting one (then --pid gives its
    /// process for memory and CPU figures).
    #[arg(long, value_name = "URL")]
    server: Option<String>,
    /// Process id of the --server dispatcher (on this machine).
    #[arg(long, requires = "server")]
    pid: Option<u32>,
    /// Fake agents (nodes).
    #[arg(long, default_value_t = 100)]
    agents: usize,
    /// Fake agents per HTTP/2 connection; 1 = a connection each, as real
    /// agents have.
    #[arg(long, default_value_t = 1)]
    agents_per_connection: usize,
    /// Attach the fake agents through in-process relays instead: this
    /// many nodes on one AgentService.AttachMany stream (each stream its
    /// own HTTP/2 connection); 0 = each agent its own Attach stream.
    #[arg(long, default_value_t = 0)]
    nodes_per_stream: usize,
    /// The fake agents attach here instead of the dispatcher, each with
    /// its own connection (e.g. a `dispatch-relay` of the dispatcher, to
    /// measure the relay process).
    #[arg(long, value_name = "URL", conflicts_with_all = ["nodes_per_stream", "agents_per_connection"])]
    attach_url: Option<String>,
    /// Node shapes, cycled through (synthetic topology specs).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "2s:16c:2t,1s:8c:2t,2s:8c:2t,1s:4c:2t"
    )]
    shapes: Vec<String>,
    /// Zones the racks are spread over.
    #[arg(long, default_value_t = 4)]
    zones: usize,
    /// Nodes per rack.
    #[arg(long, default_value_t = 40)]
    nodes_per_rack: usize,
    /// LoadReport period of every agent, ms (the dispatcher started here
    /// expects reports every 2 x this, as a real agent reports at half
    /// the interval the dispatcher announces).
    #[arg(long, default_value_t = 1000)]
    report_ms: u64,
    /// Runnable jobs per CPU the agents announce; above 1 they hold jobs
    /// that do not fit unstarted (what Steal can take back).
    #[arg(long, default_value_t = 1)]
    oversubscribe: u32,
    /// Jobs submitted per second (open loop).
    #[arg(long, default_value_t = 100.0)]
    rate: f64,
    /// Jobs per call: 1 = SubmitJob, more = SubmitJobs batches.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Length of the load phase, seconds.
    #[arg(long, default_value_t = 30.0)]
    duration_s: f64,
    /// Mean job duration, ms (each job: uniform in 0.5-1.5 x this).
    #[arg(long, default_value_t = 2000)]
    job_ms: u64,
    /// CPUs per job, cycled through.
    #[arg(long, value_delimiter = ',', default_value = "1,1,2,4")]
    job_cpus: Vec<u32>,
    /// GetJob calls per second during the load phase.
    #[arg(long, default_value_t = 50.0)]
    get_rate: f64,
    /// ListNodes calls per second during the load phase.
    #[arg(long, default_value_t = 0.5)]
    list_nodes_rate: f64,
    /// Nodes per ListNodes page: each listing reads every node, following
    /// the page tokens (0: one answer with every node).
    #[arg(long, default_value_t = 500)]
    list_nodes_page: u32,
    /// Unplaceable jobs submitted (then cancelled) before the agents attach:
    /// bytes per pending job.
    #[arg(long, default_value_t = 10_000)]
    pending: u64,
    /// Quiet window with the nodes attached, before the load, seconds.
    #[arg(long, default_value_t = 5.0)]
    steady_s: f64,
    /// Client connections for the submission stream.
    #[arg(long, default_value_t = 4)]
    client_connections: usize,
    /// Most calls in flight per stream (more are not sent, and counted).
    #[arg(long, default_value_t = 4096)]
    max_in_flight: usize,
    /// Concurrent agent connects + registrations.
    #[arg(long, default_value_t = 128)]
    connect_concurrency: usize,
    /// Give up waiting for registrations / for the jobs to finish after
    /// this many seconds.
    #[arg(long, default_value_t = 300.0)]
    timeout_s: f64,
    /// Also run a pass without heartbeats on a fresh dispatcher and print
    /// the ratios.
    #[arg(long, conflicts_with = "server")]
    baseline: bool,
    /// Exit 1 unless every job succeeded and no call failed.
    #[arg(long)]
    check: bool,
    /// Seed of durations, shapes' stagger and read targets.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Worker threads of the load generator's runtime.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Output format.
    #[arg(long, value_enum, default_value = "table")]
    format: Format,
}

fn main() -> Result<()> {
    let args = Args::parse();
    validate(&args)?;
    raise_fd_limit(&args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads.max(1))
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    // On SIGINT/SIGTERM the run is dropped, and with it the dispatcher it
    // started (killed on drop), instead of leaving it behind.
    let report = runtime.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .context("installing the SIGTERM handler")?;
        tokio::select! {
            report = run(&args) => report,
            _ = tokio::signal::ctrl_c() => bail!("interrupted"),
            _ = term.recv() => bail!("terminated"),
        }
    })?;
    match args.format {
        Format::Table => print!("{}", report.markdown()),
        Format::Json => println!("{}", serde_json::to_string_pretty(&report)?),
        Format::Csv => print!("{}", report.csv()),
    }
    if args.check {
        check(&report)?;
    }
    Ok(())
}

fn validate(a: &Args) -> Result<()> {
    if a.agents == 0 {
        bail!("--agents: at least 1");
    }
    if a.shapes.is_empty() {
        bail!("--shapes: at least one shape");
    }
    if a.zones == 0 || a.nodes_per_rack == 0 {
        bail!("--zones and --nodes-per-rack: at least 1");
    }
    if !(a.rate >= 0.0 && a.rate.is_finite()) {
        bail!("--rate: a finite number >= 0");
    }
    if a.batch == 0 || a.batch > 10_000 {
        bail!("--batch: 1 to 10000 (the dispatcher's limit per SubmitJobs)");
    }
    if !(a.duration_s > 0.0 && a.duration_s.is_finite()) {
        bail!("--duration-s: a positive number");
    }
    if !(a.timeout_s > 0.0 && a.timeout_s.is_finite()) {
        bail!("--timeout-s: a positive number");
    }
    if !(a.steady_s >= 0.0 && a.steady_s.is_finite()) {
        bail!("--steady-s: a finite number >= 0");
    }
    let non_negative = |x: f64| x >= 0.0 && x.is_finite();
    if !non_negative(a.get_rate) || !non_negative(a.list_nodes_rate) {
        bail!("--get-rate and --list-nodes-rate: finite numbers >= 0");
    }
    if a.job_cpus.contains(&0) {
        bail!("--job-cpus: every value at least 1");
    }
    if a.client_connections == 0 || a.connect_concurrency == 0 || a.max_in_flight == 0 {
        bail!("--client-connections, --connect-concurrency, --max-in-flight: at least 1");
    }
    Ok(())
}

/// One connection per agent needs a file descriptor per agent here (and
/// in a dispatcher started here, which inherits the limit).
fn raise_fd_limit(a: &Args) -> Result<()> {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).context("reading RLIMIT_NOFILE")?;
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard).context("raising RLIMIT_NOFILE")?;
    }
    let connections = if a.nodes_per_stream > 0 {
        a.agents.div_ceil(a.nodes_per_stream)
    } else {
        a.agents.div_ceil(a.agents_per_connection.max(1))
    } as u64;
    let needed = connections + a.client_connections as u64 + 256;
    if needed > hard {
        bail!(
            "--agents {} with --agents-per-connection {} needs about {needed} file descriptors, \
             the limit is {hard}: raise it (ulimit -n) or share connections",
            a.agents,
            a.agents_per_connection
        );
    }
    Ok(())
}

async fn run(args: &Args) -> Result<Report> {
    let shapes: Vec<Arc<Shape>> = args
        .shapes
        .iter()
        .map(|s| Shape::parse(s).map(Arc::new))
        .collect::<Result<_>>()?;
    let largest = shapes.iter().map(|s| s.nr_cpus()).max().unwrap_or(0);
    if let Some(&too_big) = args.job_cpus.iter().find(|&&c| c as usize > largest) {
        bail!("--job-cpus: {too_big} CPUs is more than the largest shape has ({largest})");
    }
    let mut passes = vec![pass(args, &shapes, args.report_ms > 0).await?];
    if args.baseline {
        passes.push(pass(args, &shapes, false).await?);
    }
    let connections = if args.nodes_per_stream > 0 {
        args.agents.div_ceil(args.nodes_per_stream)
    } else {
        args.agents.div_ceil(args.agents_per_connection.max(1))
    };
    let setup = format!(
        "loadgen: {} fake agents (shapes {} cycled; {} zones, {} nodes per rack) on {} HTTP/2 connection(s); \
         LoadReport every {} ms; {} jobs/s for {} s ({}), jobs of {} ms mean, CPUs {:?} cycled; \
         reads: GetJob {}/s, ListNodes {}/s; {} pending jobs before the agents attach; dispatcher {}; load generator on {} threads",
        args.agents,
        args.shapes.join(", "),
        args.zones,
        args.nodes_per_rack,
        connections,
        args.report_ms,
        args.rate,
        args.duration_s,
        if args.batch == 1 {
            "SubmitJob".to_string()
        } else {
            format!("SubmitJobs of {}", args.batch)
        },
        args.job_ms,
        args.job_cpus,
        args.get_rate,
        args.list_nodes_rate,
        args.pending,
        match &args.server {
            Some(url) => format!("at {url}"),
            None => "started here on a random loopback port".into(),
        },
        args.threads,
    );
    let setup = if args.nodes_per_stream > 0 {
        format!(
            "{setup}; the agents attach through relays, {} nodes per AttachMany stream",
            args.nodes_per_stream
        )
    } else {
        setup
    };
    Ok(Report { setup, passes })
}

/// The nodes: shapes cycled, racks of `nodes_per_rack` consecutive nodes,
/// racks spread over the zones, report times staggered over the period.
fn node_plans(args: &Args, shapes: &[Arc<Shape>]) -> Vec<NodePlan> {
    let period = Duration::from_millis(args.report_ms.max(1));
    (0..args.agents)
        .map(|i| {
            let rack = i / args.nodes_per_rack;
            let zone = rack % args.zones;
            let labels = HashMap::from([
                (
                    "topology.kubernetes.io/zone".to_string(),
                    format!("z{zone}"),
                ),
                ("dispatch.io/rack".to_string(), format!("z{zone}-r{rack}")),
            ]);
            let frac = (streams::splitmix64(args.seed ^ (i as u64)) % 1_000_000) as f64 / 1e6;
            NodePlan {
                name: format!("lg-{i:05}"),
                labels,
                shape: shapes[i % shapes.len()].clone(),
                report_offset: period.mul_f64(frac),
            }
        })
        .collect()
}

/// A job client with room for large answers.
fn job_client(ch: Channel) -> JobServiceClient<Channel> {
    JobServiceClient::new(ch).max_decoding_message_size(512 << 20)
}

fn cpu_now(pid: Option<u32>) -> Option<f64> {
    pid.and_then(|p| procstat::cpu_seconds(p).ok())
}

fn rss_now(pid: Option<u32>) -> Result<Option<u64>> {
    pid.map(procstat::rss_bytes).transpose()
}

async fn pass(args: &Args, shapes: &[Arc<Shape>], heartbeats: bool) -> Result<PassReport> {
    let label = if heartbeats {
        format!("LoadReport every {} ms", args.report_ms)
    } else {
        "no heartbeats".to_string()
    };
    eprintln!("loadgen: pass \"{label}\": starting");
    let dir = tempfile::tempdir().context("creating a temporary directory")?;
    let interval = (2 * args.report_ms.max(1)).to_string();
    let missed = if heartbeats { "3" } else { "1000000000" };
    let dispatcher = match &args.server {
        Some(_) => None,
        None => Some(
            // No per-client submission limit: the load generator is one
            // client measuring the dispatcher's own rate (the default
            // limit, 2,000 specs/s after a burst of 20,000, would cap it).
            Dispatcher::start(
                dir.path(),
                &[
                    "--heartbeat-ms",
                    &interval,
                    "--missed-heartbeats",
                    missed,
                    "--submit-rate",
                    "0",
                ],
            )
            .context("starting the dispatcher")?,
        ),
    };
    let url = match (&args.server, &dispatcher) {
        (Some(url), _) => url.clone(),
        (None, Some(d)) => d.url.clone(),
        (None, None) => bail!("no dispatcher"),
    };
    let pid = match &dispatcher {
        Some(d) => Some(d.proc.pid()),
        None => args.pid,
    };
    let loadavg_start = procstat::loadavg_1m();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let timeout = Duration::from_secs_f64(args.timeout_s);
    let latencies = Arc::new(Latencies::default());
    let mut job_clients = Vec::new();
    for _ in 0..args.client_connections {
        job_clients.push(job_client(agents::connect(&url).await?));
    }
    let mut jobs_client = job_clients[0].clone();

    // Pending jobs first, on the fresh dispatcher: no backlog in its
    // queues and no freed memory for the allocator to reuse, so the RSS
    // growth is the jobs'. Cancelled at once (their records stay), so no
    // later step pays for retrying them.
    wait_quiet(&mut jobs_client, timeout).await;
    let rss_start = rss_now(pid)?;
    let (pending_jobs, arrays) =
        streams::submit_unplaceable(&mut jobs_client, args.pending, 1000, &latencies).await;
    wait_quiet(&mut jobs_client, timeout).await;
    let rss_pending = rss_now(pid)?;
    let cancel_failed = streams::cancel(&mut jobs_client, &arrays).await;
    if cancel_failed > 0 {
        bail!("cancelling the pending jobs: {cancel_failed} CancelJob calls failed");
    }
    wait_quiet(&mut jobs_client, timeout).await;
    let rss_before_nodes = rss_now(pid)?;

    // Attach the fleet.
    let base = Instant::now();
    let fleet = Arc::new(Fleet {
        report_every: heartbeats.then(|| Duration::from_millis(args.report_ms)),
        oversubscribe: args.oversubscribe.max(1),
        base,
        latencies: latencies.clone(),
        stats: Default::default(),
        connect_gate: Semaphore::new(args.connect_concurrency),
    });
    let plans = node_plans(args, shapes);
    let cpus: u64 = plans.iter().map(|p| p.shape.nr_cpus() as u64).sum();
    let per = args.agents_per_connection.max(1);
    let mut shared = Vec::new();
    let relays: Vec<relay::upstream::Upstream> = if args.nodes_per_stream > 0 {
        (0..args.agents.div_ceil(args.nodes_per_stream))
            .map(|_| relay::upstream::Upstream::start(relay::upstream::Config::plain(url.clone())))
            .collect::<Result<_, _>>()?
    } else {
        Vec::new()
    };
    if per > 1 && relays.is_empty() {
        for _ in 0..args.agents.div_ceil(per) {
            shared.push(agents::connect(&url).await?);
        }
    }
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut fleet_tasks = tokio::task::JoinSet::new();
    for (i, plan) in plans.into_iter().enumerate() {
        let conn = if !relays.is_empty() {
            Connection::Relay(relays[i / args.nodes_per_stream].clone())
        } else if per > 1 {
            Connection::Shared(shared[i / per].clone())
        } else {
            Connection::Own(args.attach_url.clone().unwrap_or_else(|| url.clone()))
        };
        fleet_tasks.spawn(agents::run(plan, conn, fleet.clone(), stop_rx.clone()));
    }
    let attach_start = Instant::now();
    while (fleet.stats.registered.load(Ordering::Relaxed) as usize) < args.agents {
        if attach_start.elapsed() > timeout {
            bail!(
                "only {} of {} agents registered within {timeout:?}; last error: {:?}",
                fleet.stats.registered.load(Ordering::Relaxed),
                args.agents,
                fleet
                    .stats
                    .last_error
                    .lock()
                    .map(|e| e.clone())
                    .ok()
                    .flatten()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let register_s = attach_start.elapsed().as_secs_f64();
    eprintln!(
        "loadgen: {} agents registered in {register_s:.1} s",
        args.agents
    );

    // Quiet window: only heartbeats.
    let steady = Duration::from_secs_f64(args.steady_s.max(0.0));
    let (cpu0, reports0, t0) = (
        cpu_now(pid),
        fleet.stats.reports.load(Ordering::Relaxed),
        Instant::now(),
    );
    tokio::time::sleep(steady).await;
    let steady_s = t0.elapsed().as_secs_f64();
    let reports_per_s = (fleet.stats.reports.load(Ordering::Relaxed) - reports0) as f64 / steady_s;
    let cpu_steady_pct = cpu0
        .zip(cpu_now(pid))
        .map(|(a, b)| (b - a) / steady_s * 100.0);
    wait_quiet(&mut jobs_client, timeout).await;
    let rss_nodes = rss_now(pid)?;

    // Load.
    let nodes =
        NodeServiceClient::new(agents::connect(&url).await?).max_decoding_message_size(512 << 20);
    let clients = Clients {
        jobs: job_clients.clone(),
        nodes,
    };
    let plan = LoadPlan {
        rate: args.rate,
        batch: args.batch,
        duration: Duration::from_secs_f64(args.duration_s),
        job_ms: args.job_ms,
        job_cpus: args.job_cpus.clone(),
        get_rate: args.get_rate,
        list_nodes_rate: args.list_nodes_rate,
        list_nodes_page: args.list_nodes_page,
        max_in_flight: args.max_in_flight,
        seed: args.seed,
    };
    eprintln!(
        "loadgen: submitting {} jobs/s for {} s",
        args.rate, args.duration_s
    );
    let peak = Arc::new(AtomicU64::new(rss_nodes.unwrap_or(0)));
    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = pid.map(|p| {
        let (peak, sampling) = (peak.clone(), sampling.clone());
        tokio::spawn(async move {
            while sampling.load(Ordering::Relaxed) {
                if let Ok(rss) = procstat::rss_bytes(p) {
                    peak.fetch_max(rss, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        })
    });
    let me = Some(std::process::id());
    let wait_now = || pid.and_then(|p| procstat::run_delay_seconds(p).ok());
    let (cpu_l0, wait_l0, self_l0) = (cpu_now(pid), wait_now(), cpu_now(me));
    let outcome = streams::run(clients, plan, base, latencies.clone()).await;
    let load_s = outcome.elapsed.as_secs_f64();
    let pct = |a: Option<f64>, b: Option<f64>| a.zip(b).map(|(a, b)| (b - a) / load_s * 100.0);
    let cpu_load_pct = pct(cpu_l0, cpu_now(pid));
    let cpu_wait_load_pct = pct(wait_l0, wait_now());
    let loadgen_cpu_load_pct = pct(self_l0, cpu_now(me));
    sampling.store(false, Ordering::Relaxed);
    if let Some(s) = sampler {
        let _ = s.await;
    }

    // Drain: every accepted job finished at an agent.
    let drain_start = Instant::now();
    let drained = loop {
        if fleet.stats.finished() >= outcome.submitted {
            break true;
        }
        if drain_start.elapsed() > timeout {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let drain_s = drain_start.elapsed().as_secs_f64();
    let dispatcher_states = states_of_group(&mut jobs_client, streams::GROUP).await?;
    eprintln!("loadgen: load phase over; jobs: {dispatcher_states:?}");

    let _ = stop_tx.send(true);
    let stopping = async { while fleet_tasks.join_next().await.is_some() {} };
    if tokio::time::timeout(Duration::from_secs(10), stopping)
        .await
        .is_err()
    {
        fleet_tasks.abort_all();
    }
    drop(dispatcher);

    let memory = match (rss_start, rss_pending, rss_before_nodes, rss_nodes) {
        (Some(start), Some(pending), Some(before_nodes), Some(with_nodes)) => Some(MemoryReport {
            rss_start: start,
            rss_pending: pending,
            rss_before_nodes: before_nodes,
            rss_nodes: with_nodes,
            rss_load_peak: peak.load(Ordering::Relaxed),
            pending_jobs,
            bytes_per_pending_job: per_item(start, pending, pending_jobs),
            bytes_per_node: per_item(before_nodes, with_nodes, args.agents as u64),
        }),
        _ => None,
    };
    let seconds = |kind: Kind| match kind {
        Kind::Register => register_s,
        Kind::SubmitPending => 0.0,
        _ => load_s,
    };
    let s = &fleet.stats;
    Ok(PassReport {
        label,
        heartbeats,
        nodes: s.registered.load(Ordering::Relaxed),
        cpus,
        agent_connections: if relays.is_empty() {
            args.agents.div_ceil(per)
        } else {
            relays.len()
        } as u64,
        register_s,
        steady_s,
        load_s,
        latencies: latencies.summary(seconds),
        reports_per_s,
        jobs: JobsReport {
            target_rate: args.rate,
            submitted: outcome.submitted,
            failed: outcome.failed,
            skipped: outcome.skipped,
            achieved_rate: outcome.submitted as f64 / load_s,
            assigns: s.assigns.load(Ordering::Relaxed),
            finished_at_agents: s.finished(),
            drained,
            drain_s,
            dispatcher_states,
            steals: s.steals.load(Ordering::Relaxed),
            steals_released: s.steals_released.load(Ordering::Relaxed),
            stream_errors: s.stream_errors.load(Ordering::Relaxed),
            last_stream_error: s.last_error.lock().map(|e| e.clone()).ok().flatten(),
        },
        cpu_steady_pct,
        cpu_load_pct,
        cpu_wait_load_pct,
        loadgen_cpu_load_pct,
        loadavg_start,
        loadavg_end: procstat::loadavg_1m(),
        memory,
    })
}

/// Wait until the dispatcher answers a GetJob within 50 ms three times in
/// a row (its core has no backlog), or `timeout`. Any answer counts, a
/// NOT_FOUND too: the call went through the core either way.
async fn wait_quiet(client: &mut JobServiceClient<Channel>, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    let mut quick = 0;
    while quick < 3 && Instant::now() < deadline {
        let sent = Instant::now();
        let _ = client
            .get_job(proto::v1::GetJobRequest { id: "j-0".into() })
            .await;
        if sent.elapsed() < Duration::from_millis(50) {
            quick += 1;
        } else {
            quick = 0;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The states of a group's jobs, as the dispatcher lists them.
async fn states_of_group(
    client: &mut JobServiceClient<Channel>,
    group: &str,
) -> Result<BTreeMap<String, u64>> {
    let mut out = BTreeMap::new();
    let mut token = String::new();
    loop {
        let page = client
            .list_jobs(ListJobsRequest {
                group: group.to_string(),
                page_size: 10_000,
                page_token: token.clone(),
                ..Default::default()
            })
            .await
            .context("listing the load's jobs")?
            .into_inner();
        for job in page.jobs {
            let name = JobState::try_from(job.state)
                .map(|s| s.as_str_name().trim_start_matches("JOB_STATE_").to_string())
                .unwrap_or_else(|_| format!("state {}", job.state));
            *out.entry(name).or_insert(0) += 1;
        }
        if page.next_page_token.is_empty() {
            return Ok(out);
        }
        token = page.next_page_token;
    }
}

/// `--check`: every accepted job succeeded, no call failed, and the
/// histograms have samples.
fn check(report: &Report) -> Result<()> {
    for p in &report.passes {
        let j = &p.jobs;
        let succeeded = j.dispatcher_states.get("SUCCEEDED").copied().unwrap_or(0);
        if !j.drained || succeeded != j.submitted || j.submitted == 0 {
            bail!(
                "{}: {} jobs accepted, {} SUCCEEDED at the dispatcher (states {:?}, drained {})",
                p.label,
                j.submitted,
                succeeded,
                j.dispatcher_states,
                j.drained
            );
        }
        if j.failed > 0 || j.skipped > 0 {
            bail!(
                "{}: {} jobs in failed calls, {} not sent",
                p.label,
                j.failed,
                j.skipped
            );
        }
        if let Some(r) = p.latencies.iter().find(|r| r.errors > 0) {
            bail!(
                "{}: {} {} calls failed: {:?}",
                p.label,
                r.errors,
                r.kind,
                r.last_error
            );
        }
        for kind in [Kind::Register, Kind::Assign] {
            if !p
                .latencies
                .iter()
                .any(|r| r.kind == kind.name() && r.count > 0)
            {
                bail!("{}: no {} samples", p.label, kind.name());
            }
        }
    }
    Ok(())
}
